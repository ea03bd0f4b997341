//! `tine-agent`: the guest agent. It serves the agent protocol
//! (docs/agent-protocol.md) over any stream transport: vsock in a VM, a
//! Unix socket on the host for tests.
//!
//! - [`server`]: the [`Agent`], its accept loop and per-stream dispatch.
//! - [`listener`]: the [`Listener`] abstraction over transports.
//! - `ops`: one module per operation family (exec and background execs,
//!   PTY shell, files and tar, forwarding, health and fix-ups).
//! - [`system`]: guest-system duties the operations call.

pub mod error;
pub mod listener;
mod ops;
pub mod server;
pub mod system;

pub use error::OpError;
pub use listener::Listener;
pub use server::{Agent, AgentConfig};
