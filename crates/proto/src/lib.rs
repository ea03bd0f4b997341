//! Wire types that cross process boundaries in tine: REST bodies between the
//! daemon and its clients, and frames between the host and the guest agent.
//!
//! The types arrive with the agent and daemon issues; this crate exists now so
//! that the workspace layout matches docs/architecture.md.
