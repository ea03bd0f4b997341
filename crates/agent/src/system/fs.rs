//! Guest paths under a root and atomic file writes, for every module that
//! edits the guest's files. Imports nothing from its siblings.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Writes `data` to `path` through a temporary file in the same directory
/// and a rename, so readers see the old or the new file, never a part. When
/// the rename fails because `path` is a mount point (systemd bind-mounts
/// `/etc/machine-id`), the file is rewritten in place instead.
pub(crate) fn write_atomic(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    replace(path, data, mode, true)
}

/// [`write_atomic`] without its syncs, for a caller that writes several
/// files and then makes them durable together with [`sync_paths`]. Until
/// then a crash keeps the old file or the new one (a journaled file system
/// writes a replaced file's data before it commits the rename), never a
/// part.
pub(crate) fn write_atomic_unsynced(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    replace(path, data, mode, false)
}

/// Makes `files` (their data) and the entries of the folders holding them
/// and `removed` durable: each file synced, then each folder once. Only
/// these: not the rest of the file system (a forked guest's page cache may
/// hold much that its own writeback will write later). On a journaled file
/// system the first sync commits the journal, so the others cost little.
pub(crate) fn sync_paths(files: &[PathBuf], removed: &[PathBuf]) -> io::Result<()> {
    let mut dirs: Vec<&Path> = Vec::new();
    for file in files {
        fs::File::open(file)?.sync_all()?;
    }
    for path in files.iter().chain(removed) {
        if let Some(dir) = path.parent().filter(|d| !dirs.contains(d)) {
            dirs.push(dir);
        }
    }
    for dir in dirs {
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

fn replace(path: &Path, data: &[u8], mode: u32, sync: bool) -> io::Result<()> {
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
        if sync {
            f.sync_all()?;
        }
        Ok(())
    };
    if let Err(e) = write() {
        remove_temporary(&tmp);
        return Err(e);
    }
    match fs::rename(&tmp, path) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            remove_temporary(&tmp);
            let mut f = fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(path)?;
            f.write_all(data)?;
            if sync {
                f.sync_all()?;
            }
            Ok(())
        }
        Err(e) => {
            remove_temporary(&tmp);
            Err(e)
        }
    }
}

/// Removes the temporary file of a write that did not go through. One that
/// was never created is no failure; any other error is logged, as the file
/// stays behind.
pub(crate) fn remove_temporary(tmp: &Path) {
    match fs::remove_file(tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("cannot remove {}: {e}", tmp.display()),
    }
}

/// Guest path `p` ("/etc/x") under `root`.
pub(crate) fn under(root: &Path, p: &str) -> PathBuf {
    root.join(p.trim_start_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn test_write_atomic_unsynced_replaces_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("f");
        write_atomic_unsynced(&p, b"one", 0o600).expect("write");
        write_atomic_unsynced(&p, b"two", 0o644).expect("write");
        sync_paths(std::slice::from_ref(&p), &[dir.path().join("gone")]).expect("sync");
        assert_eq!(fs::read(&p).expect("read"), b"two");
        let names: Vec<_> = fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f")]);
    }
}
