//! The agent connection of a route handler and what its calls share: the
//! host-side deadlines ([`DEADLINES`]), how a failed call maps to an API
//! error, and how an exit status is reported.

use std::time::Duration;

use tine_client::agent::{ClientError, Limits};
use tine_client::AgentClient;

use super::params::AppState;
use crate::error::{ApiError, ApiResult};

/// Host-side limits on the agent for the calls handlers make.
#[derive(Debug, Clone, Copy)]
pub(super) struct Deadlines {
    /// An answer that needs no long work (health without `wait`, stat,
    /// exec's and shell's start, forward's connect).
    pub(super) reply: Duration,
    /// A file transfer without progress (a frame of a download, credit for
    /// an upload, an upload's final answer, which may wait for an fsync).
    pub(super) transfer: Duration,
    /// How long past its own `timeout` an exec may go before the host ends
    /// it (the agent is meant to kill it at `timeout`).
    pub(super) exec_grace: Duration,
    /// Most bytes one download may bring.
    pub(super) download_bytes: u64,
}

/// The cap on one download (`GET /vm/{vm}/cp`): 16 GiB (docs/api.md).
pub const MAX_DOWNLOAD_BYTES: u64 = 16 << 30;

/// The deadlines of every handler here.
pub(super) const DEADLINES: Deadlines = Deadlines {
    reply: Duration::from_secs(10),
    transfer: Duration::from_secs(60),
    exec_grace: Duration::from_secs(5),
    download_bytes: MAX_DOWNLOAD_BYTES,
};

impl Deadlines {
    pub(super) fn limits(&self) -> Limits {
        Limits {
            reply: Some(self.reply),
            transfer: Some(self.transfer),
            download_bytes: self.download_bytes,
        }
    }
}

/// A handler's agent connection, with [`DEADLINES`] on its calls.
pub(super) async fn agent(d: &AppState, hostname: &str) -> ApiResult<AgentClient> {
    let (_vm, client) = d.agent(hostname).await?;
    Ok(client.with_limits(DEADLINES.limits()))
}

pub(super) fn agent_err(e: impl std::fmt::Display) -> ApiError {
    ApiError::agent(e.to_string())
}

/// An error from a call: a deadline or a lost connection as 503, any
/// other as `other` makes it.
pub(super) fn call_err(e: ClientError, other: impl FnOnce(String) -> ApiError) -> ApiError {
    match e {
        ClientError::Timeout { .. } | ClientError::ConnectionLost(_) | ClientError::StreamEnded => {
            agent_err(e)
        }
        e => other(e.to_string()),
    }
}

/// The exit frame's fields: the code (128+N for signal N), the signal's
/// name and number.
pub(super) fn exit_fields(
    status: &tine_proto::agent::ExitStatus,
) -> (i32, Option<String>, Option<i32>) {
    let signal = status.code.is_none().then_some(status.signal).flatten();
    let name = signal.and_then(|n| {
        nix::sys::signal::Signal::try_from(n)
            .ok()
            .map(|s| s.as_str().to_owned())
    });
    (shell_exit_code(status), name, signal)
}

/// The code a shell's end is reported with: its exit code, else 128+N for
/// signal N. The agent reports these numbers; a signal outside 1..=127
/// (no real one) gives 128 rather than overflowing.
pub(super) fn shell_exit_code(status: &tine_proto::agent::ExitStatus) -> i32 {
    match (status.code, status.signal) {
        (Some(code), _) => code,
        (None, Some(signal @ 1..=127)) => 128 + signal,
        (None, _) => 128,
    }
}
