//! The agent's vsock listener.
//!
//! [`listen`] binds an `AF_VSOCK` stream socket on `VMADDR_CID_ANY` and the
//! given port and returns a [`VsockListener`] registered with the current
//! tokio runtime (tokio-vsock, an `AsyncFd` around the socket). Its
//! `accept().await` yields `(VsockStream, VsockAddr)`; [`VsockStream`]
//! implements `tokio::io::AsyncRead + AsyncWrite` and has `into_split()`.
//! The host reaches the port through the VMM's Unix socket with Firecracker's
//! `CONNECT <port>\n` handshake. The sockets are close-on-exec.

use std::io;

pub use tokio_vsock::{VsockAddr, VsockListener, VsockStream, VMADDR_CID_ANY};

/// Port number that asks the kernel to choose a free port.
pub const VMADDR_PORT_ANY: u32 = u32::MAX;

/// Errors from [`listen`].
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The socket could not be created, bound or put in listening state
    /// (no vsock transport in the kernel, port in use, no tokio runtime).
    #[error("Cannot listen on vsock port {port}")]
    Listen {
        /// The port asked for.
        port: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Listens on `port` for connections from any CID. Must be called from
/// within a tokio runtime with I/O enabled.
pub fn listen(port: u32) -> Result<VsockListener, VsockError> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(VsockError::Listen {
            port,
            source: io::Error::other("not called from within a tokio runtime"),
        });
    }
    VsockListener::bind(VsockAddr::new(VMADDR_CID_ANY, port))
        .map_err(|source| VsockError::Listen { port, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn test_listen_outside_a_runtime_is_an_error_not_a_panic() {
        assert!(matches!(
            listen(VMADDR_PORT_ANY),
            Err(VsockError::Listen { .. })
        ));
    }

    /// Binds on this machine's vsock transport (the kernel must have one:
    /// a guest with virtio-vsock, or vsock_loopback). Connecting needs a peer
    /// that this test machine lacks, so this checks bind, port choice and
    /// that accept waits.
    #[tokio::test]
    async fn test_listen_binds_any_cid_and_accept_waits() {
        let l = listen(VMADDR_PORT_ANY).expect("bind AF_VSOCK (is a vsock transport loaded?)");
        let addr = l.local_addr().expect("local addr");
        assert_eq!(addr.cid(), VMADDR_CID_ANY);
        assert_ne!(addr.port(), VMADDR_PORT_ANY);
        let pending = tokio::time::timeout(Duration::from_millis(50), l.accept()).await;
        assert!(pending.is_err(), "accept returned without a peer");
        // The same port cannot be bound twice.
        let again = listen(addr.port());
        assert!(matches!(again, Err(VsockError::Listen { port, .. }) if port == addr.port()));
    }
}
