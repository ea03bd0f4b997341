//! The version handshake, run on the raw transport before the multiplexer
//! starts: the client sends [`Hello`] on stream 0, the agent answers
//! [`Response::Welcome`], or [`Response::Error`] with
//! [`ErrorCode::VersionMismatch`] and closes the connection.

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::frame::{read_frame, write_frame, FrameError, FrameKind, MAX_FRAME_LEN};
use super::message::{ErrorCode, ErrorReply, Hello, ProtocolVersion, Response, Welcome};

/// Errors from the handshake.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Reading or writing a frame failed.
    #[error("Handshake framing failed")]
    Frame(#[from] FrameError),
    /// The peer closed the connection during the handshake.
    #[error("Connection closed during the handshake")]
    Closed,
    /// The peer sent something other than the handshake message.
    #[error("Unexpected handshake message: {0}")]
    Unexpected(String),
    /// The major versions differ.
    #[error("Protocol version {theirs} is incompatible with ours ({ours})")]
    VersionMismatch {
        /// This side's version.
        ours: ProtocolVersion,
        /// The peer's version.
        theirs: ProtocolVersion,
    },
    /// The agent refused the handshake.
    #[error("Agent refused the handshake ({}): {}", .0.code, .0.message)]
    Rejected(ErrorReply),
}

async fn read_msg<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Vec<u8>, HandshakeError> {
    let frame = read_frame(reader, MAX_FRAME_LEN)
        .await?
        .ok_or(HandshakeError::Closed)?;
    if frame.stream != 0 || frame.kind != FrameKind::Msg {
        return Err(HandshakeError::Unexpected(format!(
            "{:?} frame on stream {}",
            frame.kind, frame.stream
        )));
    }
    Ok(frame.payload)
}

async fn write_msg<W: AsyncWrite + Unpin, T: serde::Serialize>(
    writer: &mut W,
    msg: &T,
) -> Result<(), HandshakeError> {
    let payload = serde_json::to_vec(msg)
        .map_err(|e| HandshakeError::Unexpected(format!("cannot encode: {e}")))?;
    write_frame(writer, 0, FrameKind::Msg, &payload).await?;
    writer
        .flush()
        .await
        .map_err(|e| HandshakeError::Frame(FrameError::Io(e)))?;
    Ok(())
}

/// Client side: sends `hello` and returns the agent's [`Welcome`].
pub async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    hello: &Hello,
) -> Result<Welcome, HandshakeError> {
    write_msg(io, hello).await?;
    let payload = read_msg(io).await?;
    match serde_json::from_slice::<Response>(&payload) {
        Ok(Response::Welcome(welcome)) if welcome.version.major == hello.version.major => {
            Ok(welcome)
        }
        Ok(Response::Welcome(welcome)) => Err(HandshakeError::VersionMismatch {
            ours: hello.version,
            theirs: welcome.version,
        }),
        Ok(Response::Error(e)) => Err(HandshakeError::Rejected(e)),
        Ok(other) => Err(HandshakeError::Unexpected(format!("{other:?}"))),
        Err(e) => Err(HandshakeError::Unexpected(e.to_string())),
    }
}

/// Agent side: reads the client's [`Hello`], answers with `welcome` when the
/// major versions match, or with an error (and returns it) when not.
pub async fn server_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    welcome: &Welcome,
) -> Result<Hello, HandshakeError> {
    let payload = read_msg(io).await?;
    let hello: Hello = match serde_json::from_slice(&payload) {
        Ok(hello) => hello,
        Err(e) => {
            let reply = Response::error(ErrorCode::BadRequest, format!("bad hello: {e}"));
            write_msg(io, &reply).await?;
            return Err(HandshakeError::Unexpected(e.to_string()));
        }
    };
    if hello.version.major != welcome.version.major {
        let reply = Response::error(
            ErrorCode::VersionMismatch,
            format!(
                "client speaks protocol {}, this agent speaks {}",
                hello.version, welcome.version
            ),
        );
        write_msg(io, &reply).await?;
        return Err(HandshakeError::VersionMismatch {
            ours: welcome.version,
            theirs: hello.version,
        });
    }
    write_msg(io, &Response::Welcome(welcome.clone())).await?;
    Ok(hello)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn welcome(major: u16) -> Welcome {
        Welcome {
            version: ProtocolVersion { major, minor: 3 },
            agent_version: "test".to_owned(),
            max_frame_len: MAX_FRAME_LEN,
            stream_window: 1,
        }
    }

    fn hello(major: u16) -> Hello {
        Hello {
            version: ProtocolVersion { major, minor: 0 },
            client: "test".to_owned(),
        }
    }

    #[tokio::test]
    async fn test_handshake_same_major_succeeds() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let server = tokio::spawn(async move { server_handshake(&mut b, &welcome(1)).await });
        let got = client_handshake(&mut a, &hello(1)).await.expect("welcome");
        assert_eq!(got, welcome(1));
        let seen = server.await.expect("join").expect("hello");
        assert_eq!(seen, hello(1));
    }

    #[tokio::test]
    async fn test_negative_handshake_major_mismatch_is_rejected_with_message() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let server = tokio::spawn(async move { server_handshake(&mut b, &welcome(2)).await });
        let err = client_handshake(&mut a, &hello(1))
            .await
            .expect_err("mismatch");
        match err {
            HandshakeError::Rejected(e) => {
                assert_eq!(e.code, ErrorCode::VersionMismatch);
                assert!(e.message.contains("1.0"), "{}", e.message);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            server.await.expect("join"),
            Err(HandshakeError::VersionMismatch { .. })
        ));
    }
}
