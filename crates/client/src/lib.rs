//! Typed client for the tine daemon's REST API and for the guest agent
//! protocol, used by the CLI, the daemon and the tests.
//!
//! [`api`] holds the REST client ([`TineClient`]) of `tine up`
//! (docs/api.md); [`agent`] holds the guest-agent client ([`AgentClient`]).

pub mod agent;
pub mod api;

pub use agent::{AgentClient, ClientError, ExecEvent, ExecOutput, Execution};
pub use api::{ApiError, TineClient};
/// The protocol types the client's methods take and return.
pub use tine_proto::agent as proto;
/// The REST types [`TineClient`]'s methods take and return.
pub use tine_proto::api as rest;
