//! SSH host key regeneration for forks: follows sshd's `HostKey` settings
//! (with `Include`), or OpenSSH's default key set when there are none, and
//! runs `ssh-keygen` for each key.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::fs::under;
use super::reaper;

/// Where sshd may be installed; present under the root means "installed".
const SSHD_PATHS: &[&str] = &["/usr/sbin/sshd", "/usr/bin/sshd", "/sbin/sshd"];

/// OpenSSH's host keys when sshd_config names none.
const DEFAULT_KEYS: &[&str] = &[
    "/etc/ssh/ssh_host_rsa_key",
    "/etc/ssh/ssh_host_ecdsa_key",
    "/etc/ssh/ssh_host_ed25519_key",
];

/// How deep `Include` may nest (sshd allows 16).
const MAX_INCLUDE_DEPTH: usize = 16;

pub(crate) fn sshd_installed(root: &Path) -> bool {
    SSHD_PATHS.iter().any(|p| under(root, p).is_file())
}

/// Regenerates the host keys of the sshd under `root`. Returns the new
/// public keys and one line per problem. Without sshd, does nothing.
pub(crate) fn regenerate_host_keys(
    root: &Path,
    comment: Option<&str>,
) -> (Vec<String>, Vec<String>) {
    let mut errors = Vec::new();
    if !sshd_installed(root) {
        return (Vec::new(), errors);
    }
    let keys = host_keys(root, &mut errors);
    let Some(keygen) = find_ssh_keygen() else {
        errors.push("ssh: sshd is installed but ssh-keygen was not found in PATH".to_string());
        return (Vec::new(), errors);
    };
    let comment = format!("root@{}", comment.unwrap_or("tine"));
    let mut public = Vec::new();
    for key in keys {
        let Some(kind) = key_type(&key) else {
            errors.push(format!(
                "ssh: cannot tell the key type of HostKey {key}; left as it is"
            ));
            continue;
        };
        let path = under(root, &key);
        match generate(&keygen, kind, &path, &comment) {
            Ok(pubkey) => public.push(pubkey),
            Err(e) => errors.push(format!("ssh: {key}: {e}")),
        }
    }
    (public, errors)
}

/// The `HostKey` paths (guest paths) of sshd_config and what it includes,
/// in order and without duplicates; OpenSSH's defaults when there are none.
pub(crate) fn host_keys(root: &Path, errors: &mut Vec<String>) -> Vec<String> {
    let mut keys = Vec::new();
    let config = under(root, "/etc/ssh/sshd_config");
    if config.exists() {
        parse_config(root, &config, 0, &mut keys, errors);
    }
    if keys.is_empty() {
        keys = DEFAULT_KEYS.iter().map(|s| s.to_string()).collect();
    }
    let mut seen = std::collections::HashSet::new();
    keys.retain(|k| seen.insert(k.clone()));
    keys
}

fn parse_config(
    root: &Path,
    file: &Path,
    depth: usize,
    keys: &mut Vec<String>,
    errors: &mut Vec<String>,
) {
    let text = match fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            errors.push(format!("ssh: cannot read {}: {e}", file.display()));
            return;
        }
    };
    for line in text.lines() {
        let words = config_words(line);
        let Some((keyword, args)) = words.split_first() else {
            continue;
        };
        match keyword.to_ascii_lowercase().as_str() {
            "hostkey" => {
                if let Some(p) = args.first() {
                    keys.push(expand_key_path(p));
                }
            }
            "include" => {
                if depth >= MAX_INCLUDE_DEPTH {
                    errors.push("ssh: Include nested too deeply; ignored".to_string());
                    continue;
                }
                for pattern in args {
                    let pattern = if pattern.starts_with('/') {
                        pattern.clone()
                    } else {
                        format!("/etc/ssh/{pattern}")
                    };
                    for f in glob(root, &pattern) {
                        parse_config(root, &f, depth + 1, keys, errors);
                    }
                }
            }
            _ => {}
        }
    }
}

/// A config line's words: `#` starts a comment, `Key=value` is allowed and
/// double quotes group words.
fn config_words(line: &str) -> Vec<String> {
    let line = line.trim();
    if line.starts_with('#') {
        return Vec::new();
    }
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut have = false;
    for (i, c) in line.chars().enumerate() {
        match c {
            '"' => {
                quoted = !quoted;
                have = true;
            }
            '#' if !quoted => break,
            // Only the first separator may be '=' (sshd's "Keyword=value").
            '=' if !quoted && words.is_empty() && i > 0 => {
                if have {
                    words.push(std::mem::take(&mut cur));
                    have = false;
                }
            }
            c if c.is_whitespace() && !quoted => {
                if have {
                    words.push(std::mem::take(&mut cur));
                    have = false;
                }
            }
            c => {
                cur.push(c);
                have = true;
            }
        }
    }
    if have {
        words.push(cur);
    }
    words
}

/// HostKey paths may be relative to /etc/ssh and may start with `~`
/// (root's home here).
fn expand_key_path(p: &str) -> String {
    if let Some(rest) = p.strip_prefix("~/") {
        format!("/root/{rest}")
    } else if p.starts_with('/') {
        p.to_string()
    } else {
        format!("/etc/ssh/{p}")
    }
}

/// Files matching a guest-path pattern whose last component may hold `*`
/// and `?`, in sorted order (as sshd's glob).
fn glob(root: &Path, pattern: &str) -> Vec<PathBuf> {
    let (dir, name) = match pattern.rsplit_once('/') {
        Some((d, n)) => (if d.is_empty() { "/" } else { d }, n),
        None => ("/etc/ssh", pattern),
    };
    let dir = under(root, dir);
    if !name.contains(['*', '?']) {
        let p = dir.join(name);
        return if p.is_file() { vec![p] } else { Vec::new() };
    }
    let mut out: Vec<PathBuf> = fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| wildcard(name, &e.file_name().to_string_lossy()))
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// `*` and `?` matching; a leading dot must be matched literally.
fn wildcard(pattern: &str, name: &str) -> bool {
    if name.starts_with('.') && !pattern.starts_with('.') {
        return false;
    }
    fn m(p: &[u8], n: &[u8]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some(b'*'), _) => m(&p[1..], n) || (!n.is_empty() && m(p, &n[1..])),
            (Some(b'?'), Some(_)) => m(&p[1..], &n[1..]),
            (Some(a), Some(b)) if a == b => m(&p[1..], &n[1..]),
            _ => false,
        }
    }
    m(pattern.as_bytes(), name.as_bytes())
}

/// The `ssh-keygen -t` value for a key file, from its name.
fn key_type(path: &str) -> Option<&'static str> {
    let name = path.rsplit('/').next().unwrap_or(path);
    if name.contains("ed25519") {
        Some("ed25519")
    } else if name.contains("ecdsa") {
        Some("ecdsa")
    } else if name.contains("rsa") {
        Some("rsa")
    } else if name.contains("dsa") {
        Some("dsa")
    } else {
        None
    }
}

fn find_ssh_keygen() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin", "/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|d| d.join("ssh-keygen"))
        .find(|p| p.is_file())
}

/// Replaces the key at `path` (and its `.pub`) by a new one; returns the
/// public key line.
fn generate(keygen: &Path, kind: &str, path: &Path, comment: &str) -> Result<String, String> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let pub_path = PathBuf::from(format!("{}.pub", path.display()));
    for p in [path, pub_path.as_path()] {
        match fs::remove_file(p) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot remove the old key {}: {e}", p.display())),
        }
    }
    let mut cmd = Command::new(keygen);
    cmd.args(["-q", "-t", kind, "-N", "", "-C", comment, "-f"])
        .arg(path)
        .stdin(Stdio::null());
    let out = reaper::output(&mut cmd).map_err(|e| format!("cannot run ssh-keygen: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "ssh-keygen -t {kind} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    fs::read_to_string(&pub_path)
        .map(|s| s.trim().to_string())
        .map_err(|e| format!("cannot read {}: {e}", pub_path.display()))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn root_with_sshd() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(dir.path().join("usr/sbin")).expect("mkdir");
        fs::write(dir.path().join("usr/sbin/sshd"), "").expect("sshd stand-in");
        fs::create_dir_all(dir.path().join("etc/ssh/sshd_config.d")).expect("mkdir");
        dir
    }

    pub(crate) fn require_ssh_keygen() {
        assert!(
            find_ssh_keygen().is_some(),
            "ssh-keygen is missing: install it (apt-get install openssh-client); scripts/setup does"
        );
    }

    #[test]
    fn test_config_words() {
        assert_eq!(config_words("  HostKey /a/b  # c"), vec!["HostKey", "/a/b"]);
        assert_eq!(config_words("HostKey=/a/b"), vec!["HostKey", "/a/b"]);
        assert_eq!(
            config_words(r#"HostKey "/a b/k""#),
            vec!["HostKey", "/a b/k"]
        );
        assert!(config_words("# HostKey /x").is_empty());
        assert!(config_words("").is_empty());
    }

    #[test]
    fn test_host_keys_follow_config_and_includes() {
        let root = root_with_sshd();
        fs::write(
            root.path().join("etc/ssh/sshd_config"),
            "Include /etc/ssh/sshd_config.d/*.conf\nhostkey /etc/ssh/ssh_host_ed25519_key\nPort 22\n",
        )
        .expect("config");
        fs::write(
            root.path().join("etc/ssh/sshd_config.d/10-keys.conf"),
            "HostKey keys/custom_rsa_key\nHostKey /etc/ssh/ssh_host_ed25519_key\n",
        )
        .expect("include");
        fs::write(
            root.path().join("etc/ssh/sshd_config.d/20-other.txt"),
            "HostKey /not/included\n",
        )
        .expect("other");
        let mut errors = Vec::new();
        let keys = host_keys(root.path(), &mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            keys,
            vec![
                "/etc/ssh/keys/custom_rsa_key",
                "/etc/ssh/ssh_host_ed25519_key"
            ]
        );
    }

    #[test]
    fn test_default_keys_without_hostkey_lines() {
        let root = root_with_sshd();
        fs::write(root.path().join("etc/ssh/sshd_config"), "Port 22\n").expect("config");
        let mut errors = Vec::new();
        assert_eq!(host_keys(root.path(), &mut errors), DEFAULT_KEYS.to_vec());
    }

    #[test]
    fn test_wildcard() {
        assert!(wildcard("*.conf", "a.conf"));
        assert!(!wildcard("*.conf", "a.conf.bak"));
        assert!(!wildcard("*.conf", ".hidden.conf"));
        assert!(wildcard("?0-*.conf", "10-x.conf"));
        assert!(wildcard("*", "x"));
    }
}
