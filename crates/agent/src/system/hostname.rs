//! Hostnames: which are valid, and the files that name the guest's own.

use std::fs;
use std::io;
use std::path::Path;

use super::fs::{under, write_atomic_unsynced};

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

/// `/etc/hostname`, and `127.0.1.1 NAME [SHORT]` in `/etc/hosts` (Debian's
/// convention), replacing any earlier `127.0.1.1` line. Not synced: the
/// fix-ups sync their file system once, init writes them again each boot.
pub(crate) fn write_hostname_files(root: &Path, name: &str) -> Result<(), String> {
    let hostname = under(root, "/etc/hostname");
    write_atomic_unsynced(&hostname, format!("{name}\n").as_bytes(), 0o644)
        .map_err(|e| format!("cannot write /etc/hostname: {e}"))?;
    let hosts = under(root, "/etc/hosts");
    let old = match fs::read_to_string(&hosts) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("cannot read /etc/hosts: {e}")),
    };
    write_atomic_unsynced(&hosts, hosts_with(&old, name).as_bytes(), 0o644)
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
