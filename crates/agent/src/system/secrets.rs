//! The guest's copy of its granted secrets: `/run/tine/secrets`, a tmpfs
//! (never on the disk, so never in a commit), one file per secret with the
//! mode, owner and group the host gave it. `/run/slicer/secrets` links to
//! it for programs written against Slicer.

use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use tine_proto::agent::SecretFile;

use super::fs::{remove_temporary, under};

/// Where the secrets are.
pub const SECRETS_DIR: &str = "/run/tine/secrets";
/// Slicer's path, a symbolic link to [`SECRETS_DIR`].
pub const SLICER_SECRETS_LINK: &str = "/run/slicer/secrets";
/// The folder's mode: others may reach a file they own, not list names.
const DIR_MODE: u32 = 0o711;
/// Size of the tmpfs (a VM's grants are at most 512 KiB).
const TMPFS_OPTIONS: &str = "mode=0711,size=2m";

/// One secret to hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Secret {
    /// File name.
    pub name: String,
    /// Value.
    pub data: Vec<u8>,
    /// Permission bits.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
}

/// What a sync changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Names written.
    pub written: Vec<String>,
    /// Names removed.
    pub removed: Vec<String>,
}

/// Makes the secrets folder under `root` hold exactly `secrets`. With
/// `mount_tmpfs` (the real guest) the folder is a tmpfs first, mounted
/// when it is not one already.
pub fn sync(root: &Path, secrets: &[Secret], mount_tmpfs: bool) -> io::Result<SyncReport> {
    for s in secrets {
        if let Some(problem) = SecretFile::name_problem(&s.name) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("secret name {:?} {problem}", s.name),
            ));
        }
        if s.mode > 0o777 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("secret {}: mode {:o} has bits beyond 0777", s.name, s.mode),
            ));
        }
    }
    let dir = under(root, SECRETS_DIR);
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(&dir)?;
    if mount_tmpfs && !is_tmpfs(&dir)? {
        nix::mount::mount(
            Some("tine-secrets"),
            &dir,
            Some("tmpfs"),
            nix::mount::MsFlags::MS_NOSUID
                | nix::mount::MsFlags::MS_NODEV
                | nix::mount::MsFlags::MS_NOEXEC,
            Some(TMPFS_OPTIONS),
        )
        .map_err(io::Error::from)?;
    }
    fs::set_permissions(&dir, fs::Permissions::from_mode(DIR_MODE))?;
    let mut report = SyncReport::default();
    for s in secrets {
        write_secret(&dir, s)?;
        report.written.push(s.name.clone());
    }
    for entry in fs::read_dir(&dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if secrets.iter().any(|s| s.name == name) {
            continue;
        }
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            fs::remove_dir_all(&path)?;
        } else {
            fs::remove_file(&path)?;
        }
        if !name.starts_with('.') {
            report.removed.push(name);
        }
    }
    link_slicer_path(root);
    Ok(report)
}

/// Writes one secret through a temporary file owned and moded before the
/// value goes in, then renamed over the old one.
fn write_secret(dir: &Path, s: &Secret) -> io::Result<()> {
    let tmp = dir.join(format!(".{}.tmp", s.name));
    let write = || -> io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        nix::unistd::fchown(
            &f,
            Some(nix::unistd::Uid::from_raw(s.uid)),
            Some(nix::unistd::Gid::from_raw(s.gid)),
        )
        .map_err(io::Error::from)?;
        f.set_permissions(fs::Permissions::from_mode(s.mode))?;
        f.write_all(&s.data)?;
        fs::rename(&tmp, dir.join(&s.name))
    };
    // The error that matters is the write's.
    write().inspect_err(|_| remove_temporary(&tmp))
}

fn is_tmpfs(dir: &Path) -> io::Result<bool> {
    let st = nix::sys::statfs::statfs(dir).map_err(io::Error::from)?;
    let kind = st.filesystem_type();
    Ok(kind == nix::sys::statfs::TMPFS_MAGIC)
}

/// Points Slicer's path at ours unless something is there already.
fn link_slicer_path(root: &Path) {
    let link = under(root, SLICER_SECRETS_LINK);
    if link.symlink_metadata().is_ok() {
        return;
    }
    let made = link
        .parent()
        .map_or(Ok(()), fs::create_dir_all)
        .and_then(|()| std::os::unix::fs::symlink(SECRETS_DIR, &link));
    if let Err(e) = made {
        tracing::warn!("cannot link {}: {e}", link.display());
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn secret(name: &str, data: &str, mode: u32) -> Secret {
        Secret {
            name: name.into(),
            data: data.as_bytes().to_vec(),
            mode,
            uid: 0,
            gid: 0,
        }
    }

    #[test]
    fn sync_writes_the_granted_files_with_their_modes_and_removes_the_rest() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = under(root.path(), SECRETS_DIR);
        let first = [secret("a", "one", 0o400), secret("b", "two", 0o640)];
        let report = sync(root.path(), &first, false).expect("sync");
        assert_eq!(report.written, ["a", "b"]);
        assert_eq!(fs::read(dir.join("a")).expect("a"), b"one");
        let meta = fs::metadata(dir.join("b")).expect("b");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
        let folder = fs::metadata(&dir).expect("dir").permissions().mode() & 0o7777;
        assert_eq!(folder, DIR_MODE);

        // A later grant list without `a`, and `b` changed.
        let report = sync(root.path(), &[secret("b", "three", 0o600)], false).expect("resync");
        assert_eq!(report.removed, ["a"]);
        assert!(!dir.join("a").exists());
        assert_eq!(fs::read(dir.join("b")).expect("b"), b"three");
        assert_eq!(
            fs::metadata(dir.join("b")).expect("b").permissions().mode() & 0o7777,
            0o600
        );
        // Clearing the grants removes everything, stray files too.
        fs::write(dir.join("stray"), "x").expect("stray");
        let report = sync(root.path(), &[], false).expect("clear");
        assert_eq!(report.removed.len(), 2, "{report:?}");
        assert_eq!(fs::read_dir(&dir).expect("dir").count(), 0);
        let link = under(root.path(), SLICER_SECRETS_LINK);
        assert_eq!(
            fs::read_link(link).expect("Slicer's path links to ours"),
            Path::new(SECRETS_DIR)
        );
    }

    #[test]
    fn owner_and_group_are_set_as_given() {
        let root = tempfile::tempdir().expect("tempdir");
        let mut s = secret("owned", "v", 0o400);
        s.uid = 4242;
        s.gid = 4343;
        sync(root.path(), &[s], false).expect("sync as root");
        let meta = fs::metadata(under(root.path(), SECRETS_DIR).join("owned")).expect("file");
        assert_eq!((meta.uid(), meta.gid()), (4242, 4343));
    }

    #[test]
    fn names_that_leave_the_folder_and_odd_modes_are_refused() {
        let root = tempfile::tempdir().expect("tempdir");
        for name in ["../etc/passwd", "a/b", ".hidden", "", ".."] {
            let err = sync(root.path(), &[secret(name, "x", 0o600)], false).expect_err(name);
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{name}");
        }
        let err = sync(root.path(), &[secret("s", "x", 0o4755)], false).expect_err("setuid");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(!under(root.path(), "/etc/passwd").exists());
    }
}
