//! Simple, host-safe implementations of the `system` contract. They only
//! touch files below `root` and never change the running kernel: the
//! hostname is written to `etc/hostname` but not set, entropy is not
//! credited and the clock is not set; each of those is reported in
//! `errors` so that nobody mistakes this build for the guest one.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Which fix-ups to apply to a fork.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FixupRequest {
    /// New hostname.
    pub hostname: Option<String>,
    /// Write a new machine id.
    pub machine_id: bool,
    /// Regenerate SSH host keys (when sshd is installed).
    pub ssh_host_keys: bool,
    /// Entropy from the host for the kernel CSPRNG.
    pub entropy: Option<Vec<u8>>,
    /// The host's time, nanoseconds since the epoch.
    pub clock_unix_nanos: Option<u128>,
}

/// What [`apply_fixups`] did.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FixupReport {
    /// Hostname written.
    pub hostname: Option<String>,
    /// Machine id written.
    pub machine_id: Option<String>,
    /// SSH host keys written.
    pub ssh_host_keys: Vec<String>,
    /// Entropy bytes credited.
    pub entropy_bytes: usize,
    /// Whether the CSPRNG was reseeded.
    pub reseeded: bool,
    /// Whether the clock was set.
    pub clock_set: bool,
    /// Whether a saved random seed was removed.
    pub random_seed_removed: bool,
    /// One message per failed fix-up.
    pub errors: Vec<String>,
}

/// The first-boot userdata script's state.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct UserdataStatus {
    /// A script is installed.
    pub present: bool,
    /// It has run.
    pub ran: bool,
    /// Its exit code, when recorded.
    pub exit_code: Option<i32>,
}

/// Where the userdata script lives, relative to the root.
const USERDATA_SCRIPT: &str = "etc/tine/userdata";
/// Marker written after it ran; holds the exit code.
const USERDATA_MARKER: &str = "etc/tine/userdata-ran";
/// Saved seeds that a fork must not reuse.
const RANDOM_SEEDS: &[&str] = &["var/lib/systemd/random-seed", "var/lib/random-seed"];

/// Applies the requested fix-ups below `root` (see the module docs for what
/// this stand-in leaves out).
pub fn apply_fixups(req: &FixupRequest, root: &Path) -> FixupReport {
    let mut report = FixupReport::default();
    if let Some(name) = &req.hostname {
        match write_file(root, "etc/hostname", &format!("{name}\n")) {
            Ok(()) => report.hostname = Some(name.clone()),
            Err(e) => report.errors.push(format!("hostname: {e}")),
        }
        report
            .errors
            .push("hostname: this build writes etc/hostname but does not set it".to_owned());
    }
    if req.machine_id {
        match random_hex(16).and_then(|id| {
            write_file(root, "etc/machine-id", &format!("{id}\n"))?;
            Ok(id)
        }) {
            Ok(id) => report.machine_id = Some(id),
            Err(e) => report.errors.push(format!("machine-id: {e}")),
        }
    }
    if req.ssh_host_keys && root.join("usr/sbin/sshd").exists() {
        report
            .errors
            .push("ssh host keys: not supported by this build".to_owned());
    }
    if let Some(entropy) = &req.entropy {
        if !entropy.is_empty() {
            report
                .errors
                .push("entropy: this build cannot credit the kernel CSPRNG".to_owned());
        }
        for seed in RANDOM_SEEDS {
            match std::fs::remove_file(root.join(seed)) {
                Ok(()) => report.random_seed_removed = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => report.errors.push(format!("random seed {seed}: {e}")),
            }
        }
    }
    if req.clock_unix_nanos.is_some() {
        report
            .errors
            .push("clock: this build does not set the clock".to_owned());
    }
    report
}

/// Reports whether `root/etc/tine/userdata` exists and whether its marker
/// (holding the exit code) was written.
pub fn userdata_status(root: &Path) -> UserdataStatus {
    let marker = std::fs::read_to_string(root.join(USERDATA_MARKER)).ok();
    UserdataStatus {
        present: root.join(USERDATA_SCRIPT).exists(),
        ran: marker.is_some(),
        exit_code: marker.and_then(|m| m.trim().parse().ok()),
    }
}

/// Time since boot, from `/proc/uptime` (zero when unreadable).
pub fn system_uptime() -> Duration {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .filter(|secs| secs.is_finite() && *secs >= 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or_default()
}

fn write_file(root: &Path, rel: &str, contents: &str) -> std::io::Result<()> {
    let path = root.join(rel);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, contents)
}

fn random_hex(bytes: usize) -> std::io::Result<String> {
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_apply_fixups_writes_hostname_and_machine_id_below_root() {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(root.path().join("var/lib/systemd")).expect("mkdir");
        std::fs::write(root.path().join("var/lib/systemd/random-seed"), b"x").expect("seed");
        let req = FixupRequest {
            hostname: Some("fork-1".to_owned()),
            machine_id: true,
            entropy: Some(vec![1; 32]),
            ..FixupRequest::default()
        };
        let report = apply_fixups(&req, root.path());
        let hostname = std::fs::read_to_string(root.path().join("etc/hostname")).expect("read");
        assert_eq!(hostname, "fork-1\n");
        let id = report.machine_id.expect("machine id");
        assert_eq!(id.len(), 32);
        let written = std::fs::read_to_string(root.path().join("etc/machine-id")).expect("read");
        assert_eq!(written.trim(), id);
        assert!(report.random_seed_removed);
        assert!(!report.reseeded);
    }

    #[test]
    fn test_userdata_status_reads_marker_exit_code() {
        let root = tempfile::tempdir().expect("tempdir");
        assert!(!userdata_status(root.path()).present);
        std::fs::create_dir_all(root.path().join("etc/tine")).expect("mkdir");
        std::fs::write(root.path().join(USERDATA_SCRIPT), "#!/bin/sh\n").expect("script");
        std::fs::write(root.path().join(USERDATA_MARKER), "3\n").expect("marker");
        let status = userdata_status(root.path());
        assert!(status.present && status.ran);
        assert_eq!(status.exit_code, Some(3));
    }
}
