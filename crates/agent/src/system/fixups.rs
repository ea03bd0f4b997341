//! Fork fix-ups: the steps behind [`super::apply_fixups`].

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::{ssh, FixupReport, FixupRequest};

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

/// Whether `name` is a valid hostname: 1 to 64 characters, dot-separated
/// labels of ASCII letters, digits and inner hyphens.
pub fn valid_hostname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Whether `root` is the running system's root, where kernel-level steps
/// apply.
pub(crate) fn is_live_root(root: &Path) -> bool {
    root.canonicalize()
        .map(|p| p == Path::new("/"))
        .unwrap_or(false)
}

/// Writes `data` to `path` through a temporary file in the same directory
/// and a rename, so readers see the old or the new file, never a part. When
/// the rename fails because `path` is a mount point (systemd bind-mounts
/// `/etc/machine-id`), the file is rewritten in place instead.
pub(crate) fn write_atomic(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tine-tmp.{}", std::process::id()));
    let write = || -> io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(data)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    match fs::rename(&tmp, path) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            let _ = fs::remove_file(&tmp);
            let mut f = fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(path)?;
            f.write_all(data)?;
            f.sync_all()
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Guest path `p` ("/etc/x") under `root`.
pub(crate) fn under(root: &Path, p: &str) -> PathBuf {
    root.join(p.trim_start_matches('/'))
}

pub(super) fn apply(req: &FixupRequest, root: &Path) -> FixupReport {
    let live = is_live_root(root);
    let mut rep = FixupReport::default();

    if let Some(nanos) = req.clock_unix_nanos {
        if live {
            match set_clock(nanos) {
                Ok(()) => rep.clock_set = true,
                Err(e) => rep.errors.push(format!("clock: clock_settime failed: {e}")),
            }
        } else {
            rep.errors
                .push("clock: skipped clock_settime: root is not /".to_string());
        }
    }

    if let Some(bytes) = &req.entropy {
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
                Ok(()) => rep.random_seed_removed = true,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => rep
                    .errors
                    .push(format!("entropy: cannot remove /{seed}: {e}")),
            }
        }
    }

    if let Some(name) = &req.hostname {
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
            if let Err(e) = write_hostname_files(root, name) {
                rep.errors.push(format!("hostname: {e}"));
                ok = false;
            }
            if ok {
                rep.hostname = Some(name.clone());
            }
        }
    }

    if req.machine_id {
        match write_machine_id(root) {
            Ok((id, errs)) => {
                rep.machine_id = Some(id);
                rep.errors.extend(errs);
            }
            Err(e) => rep.errors.push(format!("machine-id: {e}")),
        }
    }

    if req.ssh_host_keys {
        let comment = req
            .hostname
            .clone()
            .filter(|h| valid_hostname(h))
            .or_else(|| current_hostname(root, live));
        let (keys, errs) = ssh::regenerate_host_keys(root, comment.as_deref());
        rep.ssh_host_keys = keys;
        rep.errors.extend(errs);
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

/// `/etc/hostname`, and `127.0.1.1 NAME [SHORT]` in `/etc/hosts` (Debian's
/// convention), replacing any earlier `127.0.1.1` line.
pub(crate) fn write_hostname_files(root: &Path, name: &str) -> Result<(), String> {
    let hostname = under(root, "/etc/hostname");
    write_atomic(&hostname, format!("{name}\n").as_bytes(), 0o644)
        .map_err(|e| format!("cannot write /etc/hostname: {e}"))?;
    let hosts = under(root, "/etc/hosts");
    let old = match fs::read_to_string(&hosts) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("cannot read /etc/hosts: {e}")),
    };
    write_atomic(&hosts, hosts_with(&old, name).as_bytes(), 0o644)
        .map_err(|e| format!("cannot write /etc/hosts: {e}"))
}

/// `hosts` with its `127.0.1.1` line replaced by one for `name`, placed
/// after the `127.0.0.1` line (or first when there is none).
pub(crate) fn hosts_with(hosts: &str, name: &str) -> String {
    let mut entry = format!("127.0.1.1\t{name}");
    if let Some((short, _)) = name.split_once('.') {
        entry.push('\t');
        entry.push_str(short);
    }
    let first_field = |l: &str| l.split_whitespace().next().map(str::to_owned);
    let mut lines: Vec<String> = hosts
        .lines()
        .filter(|l| first_field(l).as_deref() != Some("127.0.1.1"))
        .map(str::to_owned)
        .collect();
    let at = lines
        .iter()
        .position(|l| first_field(l).as_deref() == Some("127.0.0.1"))
        .map(|i| i + 1)
        .unwrap_or(0);
    if lines.is_empty() {
        lines.push("127.0.0.1\tlocalhost".to_string());
        lines.push(entry);
    } else {
        lines.insert(at, entry);
    }
    let mut out = lines.join("\n");
    out.push('\n');
    out
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
    write_atomic(
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
            let _ = fs::remove_file(&tmp);
            if let Err(e) = std::os::unix::fs::symlink("/etc/machine-id", &tmp)
                .and_then(|()| fs::rename(&tmp, &dbus))
            {
                let _ = fs::remove_file(&tmp);
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
    use super::*;
    use crate::system::{apply_fixups, FixupRequest};

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
    fn test_valid_hostname() {
        for ok in ["a", "vm-1", "fork-0001.example.com", "A1", &"x".repeat(63)] {
            assert!(valid_hostname(ok), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "a..b",
            "a b",
            "a_b",
            "ü",
            ".a",
            &"x".repeat(65),
        ] {
            assert!(!valid_hostname(bad), "{bad}");
        }
    }

    #[test]
    fn test_hosts_line_is_replaced_not_duplicated() {
        let base = "127.0.0.1\tlocalhost\n127.0.1.1\told\n::1\tlocalhost ip6-localhost\n";
        let once = hosts_with(base, "new-1");
        assert_eq!(
            once,
            "127.0.0.1\tlocalhost\n127.0.1.1\tnew-1\n::1\tlocalhost ip6-localhost\n"
        );
        assert_eq!(hosts_with(&once, "new-1"), once);
        assert_eq!(
            hosts_with("", "a.b.c"),
            "127.0.0.1\tlocalhost\n127.0.1.1\ta.b.c\ta\n"
        );
        assert_eq!(
            hosts_with("# only a comment\n", "x"),
            "127.0.1.1\tx\n# only a comment\n"
        );
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
    fn test_write_atomic_replaces_and_sets_mode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("sub/f");
        write_atomic(&p, b"one", 0o600).expect("write");
        write_atomic(&p, b"two", 0o640).expect("write");
        assert_eq!(fs::read(&p).expect("read"), b"two");
        assert_eq!(
            fs::metadata(&p).expect("meta").permissions().mode() & 0o777,
            0o640
        );
    }
}
