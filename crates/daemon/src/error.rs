//! The daemon's error: a stable code plus a message that names the problem.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tine_proto::api::{ErrorBody, ErrorCode};

use crate::core::{chain, Error as CoreError};
use crate::db::DbError;
use crate::secrets::SecretError;

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

/// The one mapping of the core's errors to HTTP: the code (and with it the
/// status) by kind, the message with the whole cause chain.
impl From<CoreError> for ApiError {
    fn from(e: CoreError) -> Self {
        let code = match &e {
            CoreError::BadRequest(_) => ErrorCode::BadRequest,
            CoreError::NotFound(_) => ErrorCode::NotFound,
            CoreError::Conflict(_) | CoreError::Store(DbError::Conflict(_)) => ErrorCode::Conflict,
            CoreError::Timeout(_) => ErrorCode::Timeout,
            CoreError::AgentUnavailable(_) | CoreError::Agent { .. } => ErrorCode::AgentUnavailable,
            CoreError::Secret(e) => match e {
                SecretError::NotFound(_) => ErrorCode::NotFound,
                SecretError::Exists(_) => ErrorCode::Conflict,
                SecretError::Corrupt { .. } | SecretError::Io { .. } => ErrorCode::Internal,
                SecretError::BadName { .. }
                | SecretError::BadData { .. }
                | SecretError::TooLarge { .. }
                | SecretError::BadPermissions { .. }
                | SecretError::BadGrants(_)
                | SecretError::GrantsTooLarge { .. } => ErrorCode::BadRequest,
            },
            CoreError::Image(e) if e.is_bad_input() => ErrorCode::BadRequest,
            CoreError::Image(_) => ErrorCode::Internal,
            // A key that cannot be fetched is the request's `import_user`.
            CoreError::Keys(_) => ErrorCode::BadRequest,
            CoreError::Failed(_)
            | CoreError::Store(_)
            | CoreError::Disk { .. }
            | CoreError::Network { .. }
            | CoreError::Launch { .. }
            | CoreError::Io { .. }
            | CoreError::Artifact(_)
            | CoreError::Config(_)
            | CoreError::Task { .. }
            | CoreError::ShuttingDown => ErrorCode::Internal,
        };
        let message = match &e {
            // The conflict's own text is the whole story.
            CoreError::Store(DbError::Conflict(m)) => m.clone(),
            other => chain(other),
        };
        ApiError::new(code, message)
    }
}

impl From<DbError> for ApiError {
    fn from(e: DbError) -> Self {
        CoreError::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(self.body())).into_response()
    }
}

/// Result alias for the API's handlers.
pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_errors_map_to_codes_with_their_causes() {
        let e: ApiError = CoreError::io(
            "create VM folder",
            std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied"),
        )
        .into();
        assert_eq!(e.code, ErrorCode::Internal);
        assert_eq!(e.message, "create VM folder: denied");
        let e: ApiError = CoreError::Store(DbError::Conflict("name taken".into())).into();
        assert_eq!(
            (e.code, e.message.as_str()),
            (ErrorCode::Conflict, "name taken")
        );
        let e: ApiError = CoreError::Timeout("late".into()).into();
        assert_eq!(e.code.http_status(), 408);
        let e: ApiError = CoreError::AgentUnavailable("gone".into()).into();
        assert_eq!(e.code.http_status(), 503);
    }
}
