//! The guest-system side of the agent: PID 1 duties, fork fix-ups, userdata,
//! child reaping, eth0 configuration and the vsock listener.
//!
//! - [`start`]: the one call the binary makes at startup. As PID 1 (the min
//!   image) it mounts the base file systems, sets the hostname, configures
//!   eth0 from the kernel command line and handles shutdown signals; in every
//!   mode it installs the process-wide child reaper and runs userdata once.
//! - [`apply_fixups`]: make a fork unique (hostname, machine-id, SSH host
//!   keys, CSPRNG reseed, clock). Against a root other than `/` the
//!   kernel-level steps are skipped and say so in [`FixupReport::errors`].
//! - [`userdata_status`], [`userdata::run_once`]: the run-once first-boot
//!   script at `/etc/tine/userdata`.
//! - [`reaper`]: the SIGCHLD-driven reaper. **Exec code must spawn through
//!   [`reaper::Reaper::spawn`] (or `register_with`) and read exit statuses
//!   from the returned [`reaper::ExitWatch`], never through `Child::wait`**:
//!   as PID 1 the reaper collects every child with `waitpid(-1)`.
//! - [`rootfs`]: grows `/` to a disk larger than its image (a VM's
//!   `storage_size`), online, at each start in a VM.
//! - [`net`]: IPv4 address, default route and DNS for eth0 via ioctls.
//! - [`stats`]: the guest's figures (memory, load, CPU, disk, network,
//!   open files, entropy, root file system space) from `/proc` and `/sys`.
//! - [`vsock`]: [`vsock::listen`] binds an `AF_VSOCK` stream listener on
//!   `VMADDR_CID_ANY` and returns a [`vsock::VsockListener`] (tokio-vsock)
//!   whose `accept()` yields [`vsock::VsockStream`]s, which implement tokio's
//!   `AsyncRead + AsyncWrite`.
//! - [`secrets`]: the granted secrets in `/run/tine/secrets` (a tmpfs);
//!   [`authorized_keys`]: public SSH keys for root and the login user.
//! - [`init`]: the PID 1 pieces (mounts, signals, shutdown and power off
//!   through the VMM's debug-exit port 0x501).
//!
//! Every type lives in the submodule that uses it and is re-exported here;
//! `fs` (guest paths, atomic writes) and `hostname` sit below the others,
//! and no submodule imports this one.

pub mod authorized_keys;
pub mod cmdline;
mod fixups;
mod fs;
mod hostname;
pub mod init;
pub mod net;
pub mod reaper;
pub mod rootfs;
pub mod secrets;
mod ssh;
pub mod stats;
pub mod userdata;
pub mod vsock;

use std::path::Path;
use std::time::Duration;

pub use fixups::{apply_fixups, FixupReport, FixupRequest};
pub use hostname::valid_hostname;
pub use userdata::UserdataStatus;

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

/// How the agent was started, as found by [`start`].
#[derive(Debug)]
pub struct Started {
    /// The agent is PID 1 (the min image) and did the init duties.
    pub pid1: bool,
    /// What PID 1 did at boot; `None` when not PID 1.
    pub boot: Option<init::BootReport>,
    /// The process-wide reaper every spawn must go through.
    pub reaper: &'static reaper::Reaper,
}

/// Errors from [`start`].
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The child reaper could not be installed.
    #[error("Cannot install the child reaper")]
    Reaper(#[source] reaper::ReaperError),
    /// The PID 1 signal handlers could not be installed.
    #[error("Cannot install the PID 1 signal handlers")]
    Signals(#[source] init::InitError),
}

/// The agent's startup: call it first thing in `main`, before any runtime or
/// thread exists (it sets environment variables as PID 1).
///
/// As PID 1: [`init::boot`] (mounts, hostname, network, PATH), then the
/// shutdown-signal thread ([`init::spawn_signal_thread`]). Always: installs
/// the global [`reaper::Reaper`] in [`reaper::ReapMode::All`] and starts
/// userdata ([`userdata::spawn_run_once`] on `/`) in the background.
/// Problems that must not stop a boot (a mount, the network) are logged to
/// stderr (the console) and listed in [`init::BootReport::warnings`].
///
/// Not for host-side tests that embed the server in a test process: they
/// would reap the harness's children and run the host's userdata. Those
/// install `Reaper::install_global(ReapMode::RegisteredOnly)` instead.
pub fn start() -> Result<Started, StartError> {
    let pid1 = init::is_pid1();
    let boot = if pid1 {
        let report = init::boot(Path::new("/"));
        for w in &report.warnings {
            eprintln!("tine-agent: {w}");
        }
        Some(report)
    } else {
        None
    };
    let reaper =
        reaper::Reaper::install_global(reaper::ReapMode::All).map_err(StartError::Reaper)?;
    if pid1 {
        init::spawn_signal_thread(init::DEFAULT_GRACE).map_err(StartError::Signals)?;
    }
    userdata::spawn_run_once(Path::new("/").to_path_buf());
    Ok(Started { pid1, boot, reaper })
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
