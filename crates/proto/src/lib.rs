//! Wire types that cross process boundaries in tine: REST bodies between the
//! daemon and its clients, frames between the host and the guest agent, and
//! the control protocol and events of a `tine-vmm` process.
//!
//! [`agent`] holds the guest-agent protocol: framing, messages, handshake and
//! the stream multiplexer shared by the agent and its client
//! (docs/agent-protocol.md). [`api`] holds the daemon's REST bodies
//! (docs/api.md). [`vmm`] holds the VMM's control requests and responses
//! and the events it prints (docs/vmm-control.md).

pub mod agent;
pub mod api;
pub mod vmm;
