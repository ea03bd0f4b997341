//! Transports the agent accepts connections on.

use std::future::Future;
use std::io;

use tokio::io::{AsyncRead, AsyncWrite};

/// A source of connections: a Unix socket listener on the host, a vsock
/// listener in a VM. Each connection carries one multiplexed session.
pub trait Listener: Send + 'static {
    /// One accepted connection.
    type Conn: AsyncRead + AsyncWrite + Send + Unpin + 'static;

    /// Waits for the next connection.
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Conn>> + Send;
}

impl Listener for tokio::net::UnixListener {
    type Conn = tokio::net::UnixStream;

    async fn accept(&mut self) -> io::Result<Self::Conn> {
        tokio::net::UnixListener::accept(self)
            .await
            .map(|(conn, _)| conn)
    }
}

impl Listener for tokio_vsock::VsockListener {
    type Conn = tokio_vsock::VsockStream;

    async fn accept(&mut self) -> io::Result<Self::Conn> {
        tokio_vsock::VsockListener::accept(self)
            .await
            .map(|(conn, _)| conn)
    }
}
