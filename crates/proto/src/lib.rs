//! Wire types that cross process boundaries in tine: REST bodies between the
//! daemon and its clients, and frames between the host and the guest agent.
//!
//! [`agent`] holds the guest-agent protocol: framing, messages, handshake and
//! the stream multiplexer shared by the agent and its client
//! (docs/agent-protocol.md). REST bodies arrive with the daemon issue.

pub mod agent;
