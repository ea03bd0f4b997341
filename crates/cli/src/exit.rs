//! Exit codes scripts can rely on, and how errors are printed.

use tine_client::ApiError;

use crate::output::{code_name, sanitize};

/// Success.
pub const OK: i32 = 0;
/// The daemon answered with an error.
pub const API_ERROR: i32 = 1;
/// Bad flags or arguments (clap uses it too).
pub const USAGE: i32 = 2;
/// The daemon cannot be reached.
pub const UNREACHABLE: i32 = 3;
/// A wait timed out (408).
pub const TIMEOUT: i32 = 4;

/// A mistake in the command line found after parsing (exit 2).
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// The daemon's error inside an anyhow chain, if any.
fn api_error(err: &anyhow::Error) -> Option<&ApiError> {
    err.chain().find_map(|e| e.downcast_ref::<ApiError>())
}

/// The exit code for an error.
pub fn code_for(err: &anyhow::Error) -> i32 {
    if err.chain().any(|e| e.is::<UsageError>()) {
        return USAGE;
    }
    match api_error(err) {
        Some(ApiError::Connect { .. }) => UNREACHABLE,
        Some(e) if e.is_timeout() => TIMEOUT,
        Some(ApiError::InvalidUrl { .. } | ApiError::TokenFile { .. }) => USAGE,
        _ => API_ERROR,
    }
}

/// The line printed on stderr for an error: `tine: <error> (<code>)` when
/// the daemon answered, else `tine: <error: causes>`. Errors carry the
/// agent's words (a failed cp, exec or health): it is [`sanitize`]d.
pub fn message_for(err: &anyhow::Error) -> String {
    let line = match api_error(err).and_then(ApiError::code) {
        Some(code) => format!("tine: {err:#} ({})", code_name(code)),
        None => format!("tine: {err:#}"),
    };
    sanitize(&line, false).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;
    use tine_proto::api::{ErrorBody, ErrorCode};

    fn api(status: u16, code: ErrorCode, msg: &str) -> anyhow::Error {
        anyhow::Error::new(ApiError::Api {
            status,
            body: ErrorBody {
                error: msg.into(),
                code,
            },
        })
    }

    #[test]
    fn errors_map_to_documented_codes() {
        assert_eq!(
            code_for(&api(404, ErrorCode::NotFound, "no VM x")),
            API_ERROR
        );
        assert_eq!(
            code_for(&api(409, ErrorCode::Conflict, "running")),
            API_ERROR
        );
        assert_eq!(code_for(&api(408, ErrorCode::Timeout, "slow")), TIMEOUT);
        let connect = anyhow::Error::new(ApiError::Connect {
            url: "unix:///x".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        });
        assert_eq!(code_for(&connect), UNREACHABLE);
        let wrapped = Err::<(), _>(connect)
            .context("listing VMs")
            .expect_err("error");
        assert_eq!(code_for(&wrapped), UNREACHABLE);
        let url = anyhow::Error::new(ApiError::InvalidUrl {
            url: "ftp://x".into(),
            reason: "no".into(),
        });
        assert_eq!(code_for(&url), USAGE);
        assert_eq!(
            code_for(&anyhow::Error::new(UsageError("name a group".into()))),
            USAGE
        );
        assert_eq!(code_for(&anyhow::anyhow!("disk full")), API_ERROR);
    }

    #[test]
    fn messages_carry_the_code() {
        assert_eq!(
            message_for(&api(404, ErrorCode::NotFound, "no VM named dev-9")),
            "tine: no VM named dev-9 (not_found)"
        );
        let wrapped = Err::<(), _>(api(409, ErrorCode::Conflict, "dev-1 is running"))
            .context("deleting dev-1")
            .expect_err("error");
        assert_eq!(
            message_for(&wrapped),
            "tine: deleting dev-1: dev-1 is running (conflict)"
        );
        assert_eq!(
            message_for(&anyhow::anyhow!("cannot read x")),
            "tine: cannot read x"
        );
        assert_eq!(
            message_for(&api(
                503,
                ErrorCode::AgentUnavailable,
                "/x: \u{1b}]0;owned\u{7}"
            )),
            "tine: /x: \\x1b]0;owned\\x07 (agent_unavailable)"
        );
    }
}
