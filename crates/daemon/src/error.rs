//! The daemon's error: a stable code plus a message that names the problem.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tine_proto::api::{ErrorBody, ErrorCode};

/// An error answered to a client as `{error, code}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// The code (and with it the HTTP status).
    pub code: ErrorCode,
    /// For people.
    pub message: String,
}

impl ApiError {
    /// A new error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }
    /// 400.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }
    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }
    /// 409.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message)
    }
    /// 408.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Timeout, message)
    }
    /// 503.
    pub fn agent(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::AgentUnavailable, message)
    }
    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }

    /// The response body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: self.message.clone(),
            code: self.code,
        }
    }
}

impl From<crate::db::DbError> for ApiError {
    fn from(e: crate::db::DbError) -> Self {
        match e {
            crate::db::DbError::Conflict(m) => ApiError::conflict(m),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl From<crate::artifacts::ArtifactError> for ApiError {
    fn from(e: crate::artifacts::ArtifactError) -> Self {
        ApiError::internal(e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(self.body())).into_response()
    }
}

/// Result alias for daemon operations.
pub type ApiResult<T> = Result<T, ApiError>;
