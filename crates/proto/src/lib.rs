//! Wire types that cross process boundaries in tine: REST bodies between the
//! daemon and its clients, and frames between the host and the guest agent.
//!
//! [`agent`] holds the guest-agent protocol: framing, messages, handshake and
//! the stream multiplexer shared by the agent and its client
//! (docs/agent-protocol.md). [`api`] holds the daemon's REST bodies
//! (docs/api.md).

pub mod agent;
pub mod api;
