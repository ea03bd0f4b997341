//! Typed client for the tine daemon's REST API and for the guest agent
//! protocol, used by the CLI, the daemon and the tests.
//!
//! [`agent`] holds the guest-agent client ([`AgentClient`]); the REST client
//! arrives with the daemon issue.

pub mod agent;

pub use agent::{AgentClient, ClientError, ExecEvent, ExecOutput, Execution};
/// The protocol types the client's methods take and return.
pub use tine_proto::agent as proto;
