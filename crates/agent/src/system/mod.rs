//! The guest-system side of the agent: fork fix-ups, userdata, child
//! reaping, eth0 configuration and the vsock listener.
//!
//! - [`apply_fixups`]: make a fork unique (hostname, machine-id, SSH host
//!   keys, CSPRNG reseed, clock). Against a root other than `/` the
//!   kernel-level steps are skipped and say so in [`FixupReport::errors`].
//! - [`userdata_status`], [`userdata::run_once`]: the run-once first-boot
//!   script at `/etc/tine/userdata`.
//! - [`reaper`]: the SIGCHLD-driven reaper. **Exec code must spawn through
//!   [`reaper::Reaper::spawn`] (or `register_with`) and read exit statuses
//!   from the returned [`reaper::ExitWatch`], never through `Child::wait`**:
//!   as PID 1 the reaper collects every child with `waitpid(-1)`.
//! - [`net`]: IPv4 address, default route and DNS for eth0 via ioctls.
//! - [`vsock`]: [`vsock::listen`] binds an `AF_VSOCK` stream listener on
//!   `VMADDR_CID_ANY` and returns a [`vsock::VsockListener`] (tokio-vsock)
//!   whose `accept()` yields [`vsock::VsockStream`]s, which implement tokio's
//!   `AsyncRead + AsyncWrite`.

pub mod cmdline;
mod fixups;
pub mod net;
pub mod reaper;
mod ssh;
pub mod userdata;
pub mod vsock;

use std::path::Path;
use std::time::Duration;

pub use fixups::valid_hostname;

/// What a fork asks the agent to change so that it differs from its siblings.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct FixupRequest {
    /// New hostname (kernel, `/etc/hostname`, the `127.0.1.1` line of `/etc/hosts`).
    pub hostname: Option<String>,
    /// Write a fresh `/etc/machine-id`.
    pub machine_id: bool,
    /// Regenerate the SSH host keys when sshd is installed.
    pub ssh_host_keys: bool,
    /// Bytes from the host's CSPRNG to credit to the kernel's pool before a
    /// reseed; the saved random seeds are deleted too. `Some(vec![])` only
    /// reseeds and deletes the seeds.
    pub entropy: Option<Vec<u8>>,
    /// The host's `CLOCK_REALTIME`, in nanoseconds since the Unix epoch.
    pub clock_unix_nanos: Option<u128>,
}

/// What [`apply_fixups`] did. A step that was not asked for leaves its field
/// at the default; a step that failed or was skipped says why in `errors`.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct FixupReport {
    /// The hostname now in effect, when one was set.
    pub hostname: Option<String>,
    /// The new machine-id (32 lowercase hex digits), when one was written.
    pub machine_id: Option<String>,
    /// The public halves of the regenerated SSH host keys
    /// (`TYPE BASE64 COMMENT`, as in the `.pub` files).
    pub ssh_host_keys: Vec<String>,
    /// Bytes credited to the kernel's entropy pool (0 when skipped).
    pub entropy_bytes: usize,
    /// The kernel CRNG was reseeded (`RNDRESEEDCRNG`).
    pub reseeded: bool,
    /// `CLOCK_REALTIME` was set from the host's time.
    pub clock_set: bool,
    /// At least one saved random seed file was found and deleted.
    pub random_seed_removed: bool,
    /// One line per step that failed or was skipped, prefixed with the step.
    pub errors: Vec<String>,
}

/// Applies the fix-ups in `req` to the system rooted at `root` ("/" in a VM).
///
/// The clock and the CSPRNG go first, so that the machine-id and the SSH keys
/// are generated from reseeded randomness. Kernel-level steps (sethostname,
/// `RNDADDENTROPY`/`RNDRESEEDCRNG`, `clock_settime`) run only when `root` is
/// `/`; otherwise they are reported as skipped in `errors`.
pub fn apply_fixups(req: &FixupRequest, root: &Path) -> FixupReport {
    fixups::apply(req, root)
}

/// Whether userdata exists under `root` and whether it has run (and how).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct UserdataStatus {
    /// `/etc/tine/userdata` exists.
    pub present: bool,
    /// It has run to completion (or was interrupted and will not run again).
    pub ran: bool,
    /// Its exit code; `None` when it did not run, was killed by a signal or
    /// was interrupted by a shutdown.
    pub exit_code: Option<i32>,
}

/// Reads the userdata state under `root` ("/" in a VM).
pub fn userdata_status(root: &Path) -> UserdataStatus {
    userdata::status(root)
}

/// Time since the guest booted (`CLOCK_BOOTTIME`, which counts suspend).
pub fn system_uptime() -> Duration {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME) {
        Ok(ts) => Duration::new(
            u64::try_from(ts.tv_sec()).unwrap_or(0),
            u32::try_from(ts.tv_nsec()).unwrap_or(0),
        ),
        Err(_) => Duration::ZERO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_system_uptime_is_positive_and_monotonic() {
        let a = system_uptime();
        let b = system_uptime();
        assert!(a > Duration::ZERO);
        assert!(b >= a);
    }

    #[test]
    fn test_contract_types_round_trip_through_serde() {
        let req = FixupRequest {
            hostname: Some("fork-1".into()),
            machine_id: true,
            ssh_host_keys: false,
            entropy: Some(vec![1, 2, 3]),
            clock_unix_nanos: Some(1_700_000_000_000_000_000),
        };
        let json = serde_json::to_string(&req).expect("serialize");
        let back: FixupRequest = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(back.hostname.as_deref(), Some("fork-1"));
        assert_eq!(back.entropy, Some(vec![1, 2, 3]));
        assert_eq!(back.clock_unix_nanos, Some(1_700_000_000_000_000_000));
    }
}
