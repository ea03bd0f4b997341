//! Forwarding: relays the stream's data channel to a TCP port or a Unix
//! socket in the guest, with half-close carried as EOF both ways.

use tine_proto::agent::mux::{Inbound, StreamReceiver, StreamSender};
use tine_proto::agent::{Channel, ForwardRequest, ForwardTarget, Response};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

use tokio_util::task::AbortOnDropHandle;

use super::exec::pump;
use super::files::absolute;
use crate::error::OpError;

/// Connects, answers [`Response::Connected`], relays until both directions
/// have ended, and returns [`Response::Ok`].
pub(crate) async fn run(
    req: ForwardRequest,
    tx: StreamSender,
    rx: StreamReceiver,
) -> Result<Response, OpError> {
    match req.target {
        ForwardTarget::Tcp { port, host } => {
            let host = host.unwrap_or_else(|| "127.0.0.1".to_owned());
            let socket = tokio::net::TcpStream::connect((host.as_str(), port))
                .await
                .map_err(|e| OpError::io(format_args!("connect to {host}:{port}"), &e))?;
            if let Err(e) = socket.set_nodelay(true) {
                tracing::debug!("cannot set TCP_NODELAY on {host}:{port}: {e}");
            }
            relay(socket, tx, rx).await
        }
        ForwardTarget::Unix { path } => {
            let path = absolute(&path)?;
            let socket = tokio::net::UnixStream::connect(&path)
                .await
                .map_err(|e| OpError::path("connect to", &path, &e))?;
            relay(socket, tx, rx).await
        }
    }
}

async fn relay<S: AsyncRead + AsyncWrite + Send + 'static>(
    socket: S,
    tx: StreamSender,
    mut rx: StreamReceiver,
) -> Result<Response, OpError> {
    tx.send_msg(&Response::Connected)
        .await
        .map_err(|_| OpError::cancelled())?;
    let (reader, mut writer) = tokio::io::split(socket);
    // The socket has no process exit to wait for: it ends at EOF.
    let (_never, not_exited) = watch::channel(false);
    let upstream = AbortOnDropHandle::new(tokio::spawn(pump(
        Some(reader),
        Channel::Data,
        tx,
        not_exited,
    )));
    loop {
        match rx.recv().await {
            Some(Inbound::Data(Channel::Data, chunk)) => {
                if writer.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            Some(Inbound::Eof(Channel::Data)) => break,
            Some(_) => {}
            None => return Err(OpError::cancelled()),
        }
    }
    if let Err(e) = writer.shutdown().await {
        tracing::debug!("cannot shut down the write side of the forwarded socket: {e}");
    }
    // Keep reading the client's side so that a late close is noticed.
    let mut upstream = upstream;
    tokio::select! {
        _ = &mut upstream => {}
        () = async { while rx.recv().await.is_some() {} } => return Err(OpError::cancelled()),
    }
    Ok(Response::Ok)
}
