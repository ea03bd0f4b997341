//! Public SSH keys given at create (`ssh_keys`, `import_user`): added to
//! `~/.ssh/authorized_keys` of root and of the image's login user (the
//! account with uid 1000), each key once. The min image has no sshd; an
//! image with sshd gets a working login.

use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tine_proto::agent::AuthorizedKeysRequest;

use super::fs::under;

/// The uid of an image's login user (`tine`, `ubuntu`...).
const LOGIN_UID: u32 = 1000;

/// A user the keys go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// Login name.
    pub name: String,
    /// uid.
    pub uid: u32,
    /// Primary gid.
    pub gid: u32,
    /// Home directory (guest path).
    pub home: String,
}

/// What an install did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeysOutcome {
    /// The users whose `authorized_keys` hold the keys.
    pub users: Vec<String>,
    /// Lines added over all users.
    pub added: u32,
}

/// Root and the login user from the guest's `/etc/passwd` (root with
/// `/root` when the file has no entry for it).
pub fn accounts(root: &Path) -> Vec<Account> {
    let text = fs::read_to_string(under(root, "/etc/passwd")).unwrap_or_default();
    let parsed: Vec<Account> = text.lines().filter_map(parse_passwd_line).collect();
    let mut out = vec![parsed
        .iter()
        .find(|a| a.uid == 0)
        .cloned()
        .unwrap_or(Account {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
        })];
    if let Some(login) = parsed.into_iter().find(|a| a.uid == LOGIN_UID) {
        out.push(login);
    }
    out
}

fn parse_passwd_line(line: &str) -> Option<Account> {
    let fields: Vec<&str> = line.split(':').collect();
    if fields.len() < 7 || !fields[5].starts_with('/') {
        return None;
    }
    Some(Account {
        name: fields[0].to_owned(),
        uid: fields[2].parse().ok()?,
        gid: fields[3].parse().ok()?,
        home: fields[5].to_owned(),
    })
}

/// Adds `keys` to each account's `authorized_keys` under `root`.
pub fn install(root: &Path, keys: &[String]) -> io::Result<KeysOutcome> {
    if let Some(bad) = keys.iter().find(|k| !AuthorizedKeysRequest::valid_key(k)) {
        let shown: String = bad.chars().take(40).collect();
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("not an authorized_keys line: {shown:?}"),
        ));
    }
    let mut outcome = KeysOutcome::default();
    for account in accounts(root) {
        outcome.added += install_for(root, &account, keys)?;
        outcome.users.push(account.name);
    }
    Ok(outcome)
}

fn install_for(root: &Path, account: &Account, keys: &[String]) -> io::Result<u32> {
    let ssh_dir: PathBuf = under(root, &account.home).join(".ssh");
    refuse_symlink(&ssh_dir)?;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&ssh_dir)?;
    let uid = Some(nix::unistd::Uid::from_raw(account.uid));
    let gid = Some(nix::unistd::Gid::from_raw(account.gid));
    nix::unistd::chown(&ssh_dir, uid, gid).map_err(io::Error::from)?;
    let file = ssh_dir.join("authorized_keys");
    refuse_symlink(&file)?;
    let existing = match fs::read_to_string(&file) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    let mut text = existing;
    let mut added = 0;
    for key in keys {
        let key = key.trim();
        if text.lines().any(|l| l.trim() == key) {
            continue;
        }
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(key);
        text.push('\n');
        added += 1;
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&file)?;
    if added > 0 {
        f.set_len(0)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
    }
    nix::unistd::fchown(&f, uid, gid).map_err(io::Error::from)?;
    f.set_permissions(fs::Permissions::from_mode(0o600))?;
    Ok(added)
}

fn refuse_symlink(path: &Path) -> io::Result<()> {
    match path.symlink_metadata() {
        Ok(m) if m.file_type().is_symlink() => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is a symbolic link; keys not installed", path.display()),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    const KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample alex@laptop";

    fn guest(passwd: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(root.path().join("etc")).expect("etc");
        fs::write(root.path().join("etc/passwd"), passwd).expect("passwd");
        root
    }

    #[test]
    fn keys_go_to_root_and_the_login_user_once_each() {
        let root = guest(
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/nonexistent:/bin/false\n\
             tine:x:1000:1000:tine:/home/tine:/bin/bash\n",
        );
        let out = install(root.path(), &[KEY.into()]).expect("install");
        assert_eq!(out.users, ["root", "tine"]);
        assert_eq!(out.added, 2);
        let again = install(root.path(), &[KEY.into()]).expect("again");
        assert_eq!(again.added, 0, "a key already there is not added twice");
        let file = root.path().join("home/tine/.ssh/authorized_keys");
        assert_eq!(fs::read_to_string(&file).expect("keys"), format!("{KEY}\n"));
        let meta = fs::metadata(&file).expect("meta");
        assert_eq!((meta.uid(), meta.mode() & 0o777), (1000, 0o600));
        let dir = fs::metadata(root.path().join("home/tine/.ssh")).expect("dir");
        assert_eq!((dir.uid(), dir.mode() & 0o777), (1000, 0o700));
        assert!(root.path().join("root/.ssh/authorized_keys").is_file());
    }

    #[test]
    fn an_image_with_root_only_gets_roots_keys_and_keeps_existing_lines() {
        let root = guest("root:x:0:0:root:/root:/bin/sh\n");
        fs::create_dir_all(root.path().join("root/.ssh")).expect("dir");
        fs::write(
            root.path().join("root/.ssh/authorized_keys"),
            "ssh-rsa OLD old",
        )
        .expect("old");
        let out = install(root.path(), &[KEY.into()]).expect("install");
        assert_eq!(out.users, ["root"]);
        let text = fs::read_to_string(root.path().join("root/.ssh/authorized_keys")).expect("k");
        assert_eq!(text, format!("ssh-rsa OLD old\n{KEY}\n"));
    }

    #[test]
    fn bad_lines_and_symlinked_files_are_refused() {
        let root = guest("root:x:0:0:root:/root:/bin/sh\n");
        for bad in [
            "",
            "onlyone",
            "ssh-rsa AAA\nssh-rsa BBB",
            "ssh-rsa \u{1b}[2J x",
        ] {
            let err = install(root.path(), &[bad.into()]).expect_err(bad);
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }
        fs::create_dir_all(root.path().join("root/.ssh")).expect("dir");
        std::os::unix::fs::symlink("/etc/shadow", root.path().join("root/.ssh/authorized_keys"))
            .expect("link");
        let err = install(root.path(), &[KEY.into()]).expect_err("symlink");
        assert!(err.to_string().contains("symbolic link"), "{err}");
    }
}
