//! The host ↔ guest-agent protocol (docs/agent-protocol.md).
//!
//! - [`frame`]: length-prefixed frames with a stream id and a kind, and a
//!   decoder that refuses frames above [`frame::MAX_FRAME_LEN`].
//! - [`message`]: the JSON control messages.
//! - [`handshake`]: the version handshake on stream 0.
//! - [`mux`]: many streams over one connection, with flow control.
//! - [`observe`]: the guest's figures (`stats`) and file changes (`watch`).
//!
//! Everything works over any `AsyncRead + AsyncWrite` transport: vsock in a
//! VM, a Unix socket on the host.

pub mod frame;
pub mod handshake;
pub mod message;
pub mod mux;
pub mod observe;

pub use frame::{Channel, Frame, FrameError, FrameKind, MAX_FRAME_LEN};
pub use handshake::{client_handshake, server_handshake, HandshakeError};
pub use message::*;
pub use mux::{
    Chunk, CloseReason, Inbound, Incoming, Mux, MuxConfig, MuxError, Stream, StreamReceiver,
    StreamSender,
};

/// The vsock port the agent listens on in a VM (`tine-agent serve
/// --vsock-port 52`, the default when it runs as PID 1 without arguments).
pub const AGENT_VSOCK_PORT: u32 = 52;

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: ProtocolVersion = ProtocolVersion { major: 1, minor: 1 };
