//! The error every operation returns: a protocol error code plus a message
//! for the client.
//! `describe_error` writes any error with its sources as one line.

use std::io;
use std::path::Path;

use tine_proto::agent::{ErrorCode, Response};

/// An operation failed; sent to the client as [`Response::Error`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct OpError {
    /// Machine-readable reason.
    pub code: ErrorCode,
    /// What went wrong, naming the path or program involved.
    pub message: String,
}

impl OpError {
    /// Builds an error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// A malformed or invalid request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }

    /// An I/O failure while doing `what`, with the code taken from the
    /// error kind.
    pub fn io(what: impl std::fmt::Display, err: &io::Error) -> Self {
        Self::new(code_for(err), format!("{what}: {err}"))
    }

    /// An I/O failure on `path`.
    pub fn path(what: &str, path: &Path, err: &io::Error) -> Self {
        Self::io(format_args!("{what} {}", path.display()), err)
    }

    /// The client closed the stream or vanished.
    pub fn cancelled() -> Self {
        Self::new(ErrorCode::Cancelled, "the client closed the stream")
    }

    /// The protocol response for this error.
    pub fn to_response(&self) -> Response {
        Response::error(self.code, self.message.clone())
    }
}

/// The error code for an I/O error.
pub fn code_for(err: &io::Error) -> ErrorCode {
    match err.kind() {
        io::ErrorKind::NotFound => ErrorCode::NotFound,
        io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
        io::ErrorKind::AlreadyExists => ErrorCode::AlreadyExists,
        io::ErrorKind::TimedOut => ErrorCode::Timeout,
        _ => ErrorCode::Io,
    }
}

/// `e` and each of its sources, joined with ": ", for messages that leave
/// the process (console lines, protocol errors).
pub(crate) use tine_proto::error_chain as describe_error;
