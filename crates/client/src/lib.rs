//! Typed client for the tine daemon's REST API and for the guest agent
//! protocol, used by the CLI, the daemon and the tests.
