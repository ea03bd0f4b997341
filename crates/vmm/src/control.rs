//! The control protocol of a tine-vmm process: newline-delimited JSON over a
//! Unix socket (docs/vmm-control.md). One request per line, one response
//! line per request.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::vmm::{RunState, SnapshotInfo};
use crate::vstate::vcpu::StopReason;

/// A request to the VMM process.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Current state.
    Status,
    /// Park the vCPUs.
    Pause,
    /// Run them again.
    Resume,
    /// Snapshot the paused VM.
    Snapshot {
        /// State file to write.
        state_path: PathBuf,
        /// Memory file to write.
        mem_path: PathBuf,
    },
    /// Restore into this pre-started process.
    Restore {
        /// State file.
        state_path: PathBuf,
        /// Memory file, mapped copy-on-write.
        mem_path: PathBuf,
        /// Leave it paused.
        #[serde(default)]
        paused: bool,
        /// Listen for vsock on this socket instead of the snapshot's.
        #[serde(default)]
        vsock_uds: Option<PathBuf>,
    },
    /// Ask the guest to shut down (Ctrl-Alt-Del); the process exits when
    /// the guest stops.
    Shutdown,
    /// Stop the VM now and exit the process.
    Kill,
}

/// The answer to a [`Request`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Response {
    /// Success.
    Ok {
        /// Run state after the request, when a VM exists.
        #[serde(skip_serializing_if = "Option::is_none", default)]
        state: Option<RunState>,
        /// Snapshot details, for `snapshot`.
        #[serde(skip_serializing_if = "Option::is_none", default)]
        snapshot: Option<SnapshotInfo>,
        /// Why the VM stopped, if it did.
        #[serde(skip_serializing_if = "Option::is_none", default)]
        stop_reason: Option<StopReason>,
        /// Microseconds the request took inside the VMM.
        duration_us: u64,
    },
    /// Failure, with the reason.
    Error {
        /// What went wrong.
        error: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_request_json_shape_is_stable() {
        let req: Request =
            serde_json::from_str(r#"{"op":"snapshot","state_path":"/s","mem_path":"/m"}"#)
                .expect("parse");
        assert!(matches!(req, Request::Snapshot { .. }));
        let text = serde_json::to_string(&Request::Pause).expect("json");
        assert_eq!(text, r#"{"op":"pause"}"#);
    }

    #[test]
    fn test_request_unknown_op_is_an_error() {
        assert!(serde_json::from_str::<Request>(r#"{"op":"explode"}"#).is_err());
    }
}
