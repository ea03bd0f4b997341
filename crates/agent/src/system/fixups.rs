//! Fork fix-ups: what a fork asks to change ([`FixupRequest`]), the steps
//! that change it ([`apply_fixups`]) and what they did ([`FixupReport`]).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tine_proto::agent::{FixupStep, FixupStepTime};

use super::fs::{remove_temporary, sync_paths, under, write_atomic_unsynced};
use super::hostname::{valid_hostname, write_hostname_files};
use super::ssh;

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
    /// How long each step that ran took, in the order they ran.
    pub steps: Vec<FixupStepTime>,
}

impl FixupReport {
    /// Records that `step`, begun at `began`, is over.
    fn timed(&mut self, step: FixupStep, began: Instant) {
        let micros = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.steps.push(FixupStepTime { step, micros });
    }
}

/// Saved random seeds that a fork must not reuse (systemd, Debian's
/// sysvinit `urandom` script, OpenRC).
pub(crate) const RANDOM_SEEDS: &[&str] = &[
    "var/lib/systemd/random-seed",
    "var/lib/urandom/random-seed",
    "var/lib/misc/random-seed",
];

/// Most bytes of host entropy accepted in one request.
pub const MAX_ENTROPY_BYTES: usize = 4096;

/// `_IOW('R', 0x03, int[2])`
const RNDADDENTROPY: libc::Ioctl = 0x4008_5203;
/// `_IO('R', 0x07)`
const RNDRESEEDCRNG: libc::Ioctl = 0x5207;

/// Whether `root` is the running system's root, where kernel-level steps
/// apply.
pub(crate) fn is_live_root(root: &Path) -> bool {
    root.canonicalize()
        .map(|p| p == Path::new("/"))
        .unwrap_or(false)
}

/// Applies the fix-ups in `req` to the system rooted at `root` ("/" in a VM).
///
/// The clock and the CSPRNG go first, so that the machine-id and the SSH keys
/// are generated from reseeded randomness. Kernel-level steps (sethostname,
/// `RNDADDENTROPY`/`RNDRESEEDCRNG`, `clock_settime`) run only when `root` is
/// `/`; otherwise they are reported as skipped in `errors`.
pub fn apply_fixups(req: &FixupRequest, root: &Path) -> FixupReport {
    let live = is_live_root(root);
    let mut rep = FixupReport::default();
    // Files written and removed, synced at the end.
    let mut written = Vec::new();
    let mut removed = Vec::new();

    if let Some(nanos) = req.clock_unix_nanos {
        let began = Instant::now();
        if live {
            match set_clock(nanos) {
                Ok(()) => rep.clock_set = true,
                Err(e) => rep.errors.push(format!("clock: clock_settime failed: {e}")),
            }
        } else {
            rep.errors
                .push("clock: skipped clock_settime: root is not /".to_string());
        }
        rep.timed(FixupStep::Clock, began);
    }

    if let Some(bytes) = &req.entropy {
        let began = Instant::now();
        if bytes.len() > MAX_ENTROPY_BYTES {
            rep.errors.push(format!(
                "entropy: {} bytes is more than the {MAX_ENTROPY_BYTES} accepted; nothing added",
                bytes.len()
            ));
        } else if live {
            match add_entropy(bytes) {
                Ok(()) => rep.entropy_bytes = bytes.len(),
                Err(e) => rep
                    .errors
                    .push(format!("entropy: RNDADDENTROPY failed: {e}")),
            }
        } else {
            rep.errors
                .push("entropy: skipped RNDADDENTROPY: root is not /".to_string());
        }
        if live {
            match reseed() {
                Ok(()) => rep.reseeded = true,
                Err(e) => rep
                    .errors
                    .push(format!("entropy: RNDRESEEDCRNG failed: {e}")),
            }
        } else {
            rep.errors
                .push("entropy: skipped RNDRESEEDCRNG: root is not /".to_string());
        }
        for seed in RANDOM_SEEDS {
            let p = under(root, seed);
            match fs::remove_file(&p) {
                Ok(()) => {
                    rep.random_seed_removed = true;
                    removed.push(p);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => rep
                    .errors
                    .push(format!("entropy: cannot remove /{seed}: {e}")),
            }
        }
        rep.timed(FixupStep::Entropy, began);
    }

    if let Some(name) = &req.hostname {
        let began = Instant::now();
        if !valid_hostname(name) {
            rep.errors
                .push(format!("hostname: {name:?} is not a valid hostname"));
        } else {
            let mut ok = true;
            if live {
                if let Err(e) = nix::unistd::sethostname(name) {
                    rep.errors
                        .push(format!("hostname: sethostname failed: {e}"));
                    ok = false;
                }
            } else {
                rep.errors
                    .push("hostname: skipped sethostname: root is not /".to_string());
            }
            // Not synced: the host sets the hostname at every boot, so a
            // write lost with a power cut is made again, and a hot fork's
            // set-up does not wait for the guest's disk for it.
            match write_hostname_files(root, name) {
                Ok(()) => {}
                Err(e) => {
                    rep.errors.push(format!("hostname: {e}"));
                    ok = false;
                }
            }
            if ok {
                rep.hostname = Some(name.clone());
            }
        }
        rep.timed(FixupStep::Hostname, began);
    }

    if req.machine_id {
        let began = Instant::now();
        match write_machine_id(root) {
            Ok((id, errs)) => {
                written.push(under(root, "/etc/machine-id"));
                rep.machine_id = Some(id);
                rep.errors.extend(errs);
            }
            Err(e) => rep.errors.push(format!("machine-id: {e}")),
        }
        rep.timed(FixupStep::MachineId, began);
    }

    if req.ssh_host_keys {
        let began = Instant::now();
        let comment = req
            .hostname
            .clone()
            .filter(|h| valid_hostname(h))
            .or_else(|| current_hostname(root, live));
        let (keys, errs) = ssh::regenerate_host_keys(root, comment.as_deref());
        if !keys.is_empty() {
            // ssh-keygen does not sync what it writes.
            for key in ssh::host_keys(root, &mut Vec::new()) {
                let private = under(root, &key);
                let mut public = private.clone().into_os_string();
                public.push(".pub");
                let public = PathBuf::from(public);
                written.extend([private, public].into_iter().filter(|p| p.is_file()));
            }
        }
        rep.ssh_host_keys = keys;
        rep.errors.extend(errs);
        rep.timed(FixupStep::SshHostKeys, began);
    }

    // What the fix-ups wrote (but the hostname files), renamed and removed
    // reaches the disk together, and nothing else of the guest's file
    // system. Nothing written, no sync.
    if !written.is_empty() || !removed.is_empty() {
        let began = Instant::now();
        if let Err(e) = sync_paths(&written, &removed) {
            rep.errors.push(format!("sync: {e}"));
        }
        rep.timed(FixupStep::Sync, began);
    }

    rep
}

fn current_hostname(root: &Path, live: bool) -> Option<String> {
    if live {
        if let Ok(h) = nix::unistd::gethostname() {
            return h.into_string().ok();
        }
    }
    fs::read_to_string(under(root, "/etc/hostname"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| valid_hostname(s))
}

fn set_clock(nanos: u128) -> Result<(), String> {
    let secs = i64::try_from(nanos / 1_000_000_000).map_err(|_| "time out of range".to_string())?;
    let sub = (nanos % 1_000_000_000) as i64;
    let ts = nix::sys::time::TimeSpec::new(secs, sub);
    nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts).map_err(|e| e.to_string())
}

fn open_random() -> io::Result<fs::File> {
    fs::OpenOptions::new().write(true).open("/dev/urandom")
}

/// Credits `bytes` to the input pool with full entropy (8 bits a byte): the
/// host's CSPRNG produced them.
fn add_entropy(bytes: &[u8]) -> io::Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    let f = open_random()?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    // laid out in u32 words so the header and the buffer are aligned.
    let words = bytes.len().div_ceil(4);
    let mut info = vec![0u32; 2 + words];
    info[0] = (bytes.len() * 8) as u32;
    info[1] = bytes.len() as u32;
    for (i, chunk) in bytes.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        info[2 + i] = u32::from_ne_bytes(w);
    }
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of 8 + buf_size bytes;
    // `info` holds the header and at least buf_size bytes after it, and
    // lives across the call.
    let r = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            RNDADDENTROPY,
            info.as_ptr(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Asks the kernel to reseed its CRNG from the input pool now.
fn reseed() -> io::Result<()> {
    let f = open_random()?;
    // SAFETY: RNDRESEEDCRNG takes no argument.
    let r = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&f), RNDRESEEDCRNG) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// 128 random bits as 32 lowercase hex digits (systemd's machine-id format).
pub(crate) fn new_machine_id() -> io::Result<String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(io::Error::other)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Writes a fresh `/etc/machine-id` and points `/var/lib/dbus/machine-id`
/// at it when that is a separate copy. Returns the id and non-fatal errors.
fn write_machine_id(root: &Path) -> Result<(String, Vec<String>), String> {
    let id = new_machine_id().map_err(|e| format!("getrandom failed: {e}"))?;
    write_atomic_unsynced(
        &under(root, "/etc/machine-id"),
        format!("{id}\n").as_bytes(),
        0o444,
    )
    .map_err(|e| format!("cannot write /etc/machine-id: {e}"))?;
    let mut errs = Vec::new();
    let dbus = under(root, "/var/lib/dbus/machine-id");
    match fs::symlink_metadata(&dbus) {
        Ok(m) if m.file_type().is_symlink() => {}
        Ok(_) => {
            // A stale copy: replace it by the symlink Debian ships.
            let tmp = dbus.with_file_name(".machine-id.tine-tmp");
            remove_temporary(&tmp);
            if let Err(e) = std::os::unix::fs::symlink("/etc/machine-id", &tmp)
                .and_then(|()| fs::rename(&tmp, &dbus))
            {
                remove_temporary(&tmp);
                errs.push(format!(
                    "machine-id: cannot link /var/lib/dbus/machine-id to /etc/machine-id: {e}"
                ));
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => errs.push(format!(
            "machine-id: cannot inspect /var/lib/dbus/machine-id: {e}"
        )),
    }
    Ok((id, errs))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::system::ssh::tests::{require_ssh_keygen, root_with_sshd};

    fn temp_root() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(dir.path().join("etc")).expect("mkdir etc");
        dir
    }

    fn is_machine_id(s: &str) -> bool {
        s.len() == 32
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    }

    #[test]
    fn test_machine_id_format_and_change() {
        let root = temp_root();
        let path = root.path().join("etc/machine-id");
        fs::write(&path, "0123456789abcdef0123456789abcdef\n").expect("seed id");
        let req = FixupRequest {
            machine_id: true,
            ..Default::default()
        };
        let a = apply_fixups(&req, root.path());
        assert!(a.errors.is_empty(), "{:?}", a.errors);
        let id_a = a.machine_id.expect("machine id reported");
        assert!(is_machine_id(&id_a), "{id_a}");
        assert_eq!(
            fs::read_to_string(&path).expect("read"),
            format!("{id_a}\n")
        );
        assert_ne!(id_a, "0123456789abcdef0123456789abcdef");
        assert_eq!(
            fs::metadata(&path).expect("meta").permissions().mode() & 0o777,
            0o444
        );

        let b = apply_fixups(&req, root.path());
        let id_b = b.machine_id.expect("machine id reported");
        assert!(is_machine_id(&id_b));
        assert_ne!(id_a, id_b, "every fork gets a new id");
        // No temporary file left behind.
        let names: Vec<_> = fs::read_dir(root.path().join("etc"))
            .expect("readdir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("machine-id")]);
    }

    #[test]
    fn test_dbus_machine_id_copy_becomes_a_symlink() {
        let root = temp_root();
        let dbus = root.path().join("var/lib/dbus");
        fs::create_dir_all(&dbus).expect("mkdir");
        fs::write(
            dbus.join("machine-id"),
            "ffffffffffffffffffffffffffffffff\n",
        )
        .expect("write");
        let rep = apply_fixups(
            &FixupRequest {
                machine_id: true,
                ..Default::default()
            },
            root.path(),
        );
        assert!(rep.errors.is_empty(), "{:?}", rep.errors);
        let link = fs::read_link(dbus.join("machine-id")).expect("is a symlink");
        assert_eq!(link, Path::new("/etc/machine-id"));
    }

    #[test]
    fn test_hostname_files_and_kernel_step_reported_as_skipped() {
        let root = temp_root();
        fs::write(
            root.path().join("etc/hosts"),
            "127.0.0.1 localhost\n127.0.1.1 parent\n",
        )
        .expect("hosts");
        fs::write(root.path().join("etc/hostname"), "parent\n").expect("hostname");
        let rep = apply_fixups(
            &FixupRequest {
                hostname: Some("child-3".into()),
                ..Default::default()
            },
            root.path(),
        );
        assert_eq!(rep.hostname.as_deref(), Some("child-3"));
        assert_eq!(
            rep.errors,
            vec!["hostname: skipped sethostname: root is not /".to_string()]
        );
        assert_eq!(
            fs::read_to_string(root.path().join("etc/hostname")).expect("read"),
            "child-3\n"
        );
        let hosts = fs::read_to_string(root.path().join("etc/hosts")).expect("read");
        assert_eq!(hosts, "127.0.0.1 localhost\n127.0.1.1\tchild-3\n");
    }

    #[test]
    fn test_invalid_hostname_changes_nothing() {
        let root = temp_root();
        fs::write(root.path().join("etc/hostname"), "parent\n").expect("hostname");
        let rep = apply_fixups(
            &FixupRequest {
                hostname: Some("bad name/..".into()),
                ..Default::default()
            },
            root.path(),
        );
        assert_eq!(rep.hostname, None);
        assert_eq!(rep.errors.len(), 1);
        assert_eq!(
            fs::read_to_string(root.path().join("etc/hostname")).expect("read"),
            "parent\n"
        );
    }

    #[test]
    fn test_random_seeds_removed_and_kernel_steps_not_faked() {
        let root = temp_root();
        for seed in RANDOM_SEEDS.iter().take(2) {
            let p = root.path().join(seed);
            fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            fs::write(&p, [7u8; 512]).expect("seed");
        }
        let rep = apply_fixups(
            &FixupRequest {
                entropy: Some(vec![0x5a; 64]),
                clock_unix_nanos: Some(1_800_000_000_123_456_789),
                ..Default::default()
            },
            root.path(),
        );
        assert!(rep.random_seed_removed);
        for seed in RANDOM_SEEDS {
            assert!(!root.path().join(seed).exists(), "{seed} still there");
        }
        assert_eq!(rep.entropy_bytes, 0);
        assert!(!rep.reseeded);
        assert!(!rep.clock_set);
        assert_eq!(
            rep.errors,
            vec![
                "clock: skipped clock_settime: root is not /".to_string(),
                "entropy: skipped RNDADDENTROPY: root is not /".to_string(),
                "entropy: skipped RNDRESEEDCRNG: root is not /".to_string(),
            ]
        );
        // Nothing to remove the second time.
        let again = apply_fixups(
            &FixupRequest {
                entropy: Some(vec![]),
                ..Default::default()
            },
            root.path(),
        );
        assert!(!again.random_seed_removed);
    }

    #[test]
    fn test_oversized_entropy_is_refused() {
        let root = temp_root();
        let rep = apply_fixups(
            &FixupRequest {
                entropy: Some(vec![0; MAX_ENTROPY_BYTES + 1]),
                ..Default::default()
            },
            root.path(),
        );
        assert_eq!(rep.entropy_bytes, 0);
        assert!(rep.errors[0].contains("more than"), "{:?}", rep.errors);
    }

    #[test]
    fn test_empty_request_does_nothing() {
        let root = temp_root();
        let rep = apply_fixups(&FixupRequest::default(), root.path());
        assert!(rep.errors.is_empty());
        assert!(rep.hostname.is_none() && rep.machine_id.is_none());
        assert_eq!(
            fs::read_dir(root.path().join("etc"))
                .expect("readdir")
                .count(),
            0
        );
    }

    #[test]
    fn test_each_step_asked_for_is_timed_in_order() {
        let root = temp_root();
        let steps = |req: &FixupRequest| -> Vec<FixupStep> {
            apply_fixups(req, root.path())
                .steps
                .iter()
                .map(|t| t.step)
                .collect()
        };
        // Nothing runs for an empty request, nor a sync for the hostname
        // alone (the host sets it at every boot).
        assert_eq!(steps(&FixupRequest::default()), []);
        let hostname = FixupRequest {
            hostname: Some("fork-1".into()),
            clock_unix_nanos: Some(1),
            ..FixupRequest::default()
        };
        assert_eq!(steps(&hostname), [FixupStep::Clock, FixupStep::Hostname]);
        let every = FixupRequest {
            hostname: Some("fork-1".into()),
            machine_id: true,
            ssh_host_keys: true,
            entropy: Some(vec![1; 8]),
            clock_unix_nanos: Some(1),
        };
        assert_eq!(
            steps(&every),
            [
                FixupStep::Clock,
                FixupStep::Entropy,
                FixupStep::Hostname,
                FixupStep::MachineId,
                FixupStep::SshHostKeys,
                FixupStep::Sync
            ]
        );
    }

    #[test]
    fn test_no_sshd_no_keys_no_errors() {
        let root = tempfile::tempdir().expect("tempdir");
        let rep = apply_fixups(
            &FixupRequest {
                ssh_host_keys: true,
                ..Default::default()
            },
            root.path(),
        );
        assert!(rep.ssh_host_keys.is_empty());
        assert!(rep.errors.is_empty(), "{:?}", rep.errors);
        assert!(!root.path().join("etc/ssh").exists());
    }

    #[test]
    fn test_regenerates_configured_host_keys() {
        require_ssh_keygen();
        let root = root_with_sshd();
        fs::write(
            root.path().join("etc/ssh/sshd_config"),
            "HostKey /etc/ssh/ssh_host_ed25519_key\nHostKey /etc/ssh/ssh_host_ecdsa_key\n",
        )
        .expect("config");
        let key = root.path().join("etc/ssh/ssh_host_ed25519_key");
        fs::write(&key, "parent's private key").expect("old key");
        fs::write(root.path().join("etc/ssh/ssh_host_ed25519_key.pub"), "old").expect("old pub");

        let req = FixupRequest {
            hostname: Some("fork-9".into()),
            ssh_host_keys: true,
            ..Default::default()
        };
        let rep = apply_fixups(&req, root.path());
        let ssh_errors: Vec<_> = rep
            .errors
            .iter()
            .filter(|e| e.starts_with("ssh") || e.starts_with("sync"))
            .collect();
        assert!(ssh_errors.is_empty(), "{ssh_errors:?}");
        assert_eq!(rep.ssh_host_keys.len(), 2, "{:?}", rep.ssh_host_keys);
        assert!(rep.ssh_host_keys[0].starts_with("ssh-ed25519 "));
        assert!(rep.ssh_host_keys[0].ends_with(" root@fork-9"));
        assert!(rep.ssh_host_keys[1].starts_with("ecdsa-sha2-nistp256 "));
        let private = fs::read_to_string(&key).expect("new key");
        assert!(private.starts_with("-----BEGIN OPENSSH PRIVATE KEY-----"));
        assert_eq!(
            fs::metadata(&key).expect("meta").permissions().mode() & 0o777,
            0o600
        );
        // Only the configured keys: no RSA key appeared.
        assert!(!root.path().join("etc/ssh/ssh_host_rsa_key").exists());

        // A second fork gets different keys.
        let again = apply_fixups(&req, root.path());
        assert_eq!(again.ssh_host_keys.len(), 2);
        assert_ne!(again.ssh_host_keys[0], rep.ssh_host_keys[0]);
    }

    #[test]
    fn test_unknown_key_type_is_reported() {
        require_ssh_keygen();
        let root = root_with_sshd();
        fs::write(
            root.path().join("etc/ssh/sshd_config"),
            "HostKey /etc/ssh/mystery_key\n",
        )
        .expect("config");
        let rep = apply_fixups(
            &FixupRequest {
                ssh_host_keys: true,
                ..Default::default()
            },
            root.path(),
        );
        assert!(rep.ssh_host_keys.is_empty());
        assert_eq!(rep.errors.len(), 1);
        assert!(rep.errors[0].contains("mystery_key"), "{:?}", rep.errors);
    }
}
