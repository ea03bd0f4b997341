//! VM disks as qcow2 copy-on-write chains (tine_disk):
//! image base -> VM disk -> commit -> fork disks.
//!
//! Every disk the daemon creates is a qcow2 overlay written in a few KiB
//! whatever the parent's size; a commit is the stopped source's disk made
//! immutable under a second name (a hard link, O(1)), and the source goes
//! on with a fresh overlay on top of it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use tine_disk::{self as vstore, Format};

/// Errors from disk operations, with the whole cause chain in the message.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DiskError(pub String);

fn err(what: &str, e: &dyn std::error::Error) -> DiskError {
    DiskError(format!("{what}: {}", tine_proto::error_chain(e)))
}

/// Creates `dest`, a qcow2 overlay on `base` of `size` bytes (default: the
/// base's size), mode 0600.
pub fn create_disk(base: &Path, dest: &Path, size: Option<u64>) -> Result<(), DiskError> {
    let format = vstore::detect_format(base).map_err(|e| err("read the base image", &e))?;
    vstore::create_overlay(dest, base, format, size)
        .map_err(|e| err(&format!("create {}", dest.display()), &e))?;
    std::fs::set_permissions(dest, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| err(&format!("chmod {}", dest.display()), &e))
}

/// Makes the names created, renamed or removed in `dir` survive a crash
/// (an `fsync` of the directory).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Virtual size, bytes allocated on the host, and format of a disk.
pub fn describe(path: &Path) -> (u64, u64, String) {
    use std::os::unix::fs::MetadataExt;
    let allocated = std::fs::metadata(path)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0);
    match vstore::info(path) {
        Ok(i) => (i.virtual_size, allocated, i.format.as_str().to_owned()),
        Err(_) if !path.exists() => (0, 0, "missing".into()),
        Err(_) => (0, allocated, "unreadable".into()),
    }
}

/// The virtual size of a disk.
pub fn virtual_size(path: &Path) -> Result<u64, DiskError> {
    vstore::info(path)
        .map(|i| i.virtual_size)
        .map_err(|e| err(&format!("read {}", path.display()), &e))
}

/// Checks that a commit's file is present and its qcow2 metadata (and its
/// backing chain's headers) consistent.
pub fn verify_commit(path: &Path) -> Result<(), DiskError> {
    if !path.is_file() {
        return Err(DiskError(format!("its file {} is missing", path.display())));
    }
    let report =
        vstore::check(path).map_err(|e| err(&format!("{} is corrupted", path.display()), &e))?;
    if !report.is_ok() {
        return Err(DiskError(format!(
            "{} is corrupted: {}",
            path.display(),
            report.messages.join("; ")
        )));
    }
    vstore::backing_chain(path)
        .map_err(|e| err(&format!("the backing chain of {}", path.display()), &e))?;
    Ok(())
}

/// Chains deeper than this (image, commits, the disk) are flattened when
/// committed.
pub const FLATTEN_DEPTH: usize = 16;

/// Makes `disk` a commit at `commit_path` and gives the source a fresh
/// overlay at `new_disk`; returns the commit's virtual size. On failure
/// nothing is left behind and `disk` is unchanged.
pub fn commit_disk(disk: &Path, commit_path: &Path, new_disk: &Path) -> Result<u64, DiskError> {
    let size = virtual_size(disk)?;
    if let Some(dir) = commit_path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| err(&format!("create {}", dir.display()), &e))?;
    }
    let depth = vstore::backing_chain(disk)
        .map_err(|e| err(&format!("read the chain of {}", disk.display()), &e))?
        .len();
    if depth > FLATTEN_DEPTH {
        // Long chains cost a lookup per level on every read miss: write the
        // commit as one standalone file instead (time grows with the data).
        vstore::flatten(disk, commit_path).map_err(|e| {
            err(
                &format!("flatten {} into {}", disk.display(), commit_path.display()),
                &e,
            )
        })?;
    } else {
        std::fs::hard_link(disk, commit_path).map_err(|e| {
            err(
                &format!("link {} to {}", disk.display(), commit_path.display()),
                &e,
            )
        })?;
    }
    crate::failpoint::hit(crate::failpoint::Failpoint::CommitLinked);
    let undo = |e: DiskError| {
        for made in [commit_path, new_disk] {
            match std::fs::remove_file(made) {
                Err(r) if r.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!(
                        "cannot remove {} after a failed commit: {r}",
                        made.display()
                    )
                }
                _ => {}
            }
        }
        e
    };
    // Immutable from here on: read-only for everyone (the inode is shared
    // with `disk`, which nobody writes again).
    std::fs::set_permissions(commit_path, std::fs::Permissions::from_mode(0o444))
        .map_err(|e| undo(err("make the commit read-only", &e)))?;
    create_disk_on(commit_path, new_disk).map_err(undo)?;
    // The directory entries must survive a crash before the record says
    // the commit exists.
    for dir in [commit_path.parent(), new_disk.parent()]
        .into_iter()
        .flatten()
    {
        sync_dir(dir).map_err(|e| undo(err(&format!("sync {}", dir.display()), &e)))?;
    }
    Ok(size)
}

/// Undoes [`commit_disk`] of a disk nothing wrote since (a memory commit
/// that failed after it): removes the source's fresh overlay and the
/// commit file, and makes `disk` writable again. Each step is tried; the
/// first failure is returned.
pub fn uncommit_disk(disk: &Path, commit_path: &Path, new_disk: &Path) -> Result<(), DiskError> {
    let mut first = None;
    let mut note = |e: DiskError| {
        tracing::warn!("undo a commit: {e}");
        first.get_or_insert(e);
    };
    if let Err(e) = make_writable(disk) {
        note(e);
    }
    for made in [new_disk, commit_path] {
        match std::fs::remove_file(made) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                note(err(&format!("remove {}", made.display()), &e))
            }
            _ => {}
        }
    }
    first.map_or(Ok(()), Err)
}

/// Gives a VM's disk back the mode a commit took from it (0600).
pub fn make_writable(disk: &Path) -> Result<(), DiskError> {
    std::fs::set_permissions(disk, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| err(&format!("make {} writable again", disk.display()), &e))
}

fn create_disk_on(parent: &Path, dest: &Path) -> Result<(), DiskError> {
    vstore::create_overlay(dest, parent, Format::Qcow2, None)
        .map_err(|e| err(&format!("create {}", dest.display()), &e))?;
    std::fs::set_permissions(dest, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| err(&format!("chmod {}", dest.display()), &e))
}

/// Creates a fork's disk: an overlay on the commit, not yet synced (a
/// fork answers before its disk reaches stable storage; [`sync_disk`] runs
/// before its first boot, and start-up reconciliation makes it again if a
/// power loss took it before then: an empty overlay holds nothing else).
pub fn fork_disk(commit_path: &Path, dest: &Path) -> Result<(), DiskError> {
    vstore::create(
        dest,
        &vstore::CreateOptions {
            backing: Some((commit_path.to_path_buf(), Format::Qcow2)),
            durability: vstore::Durability::Deferred,
            ..vstore::CreateOptions::default()
        },
    )
    .map_err(|e| err(&format!("create {}", dest.display()), &e))?;
    std::fs::set_permissions(dest, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| err(&format!("chmod {}", dest.display()), &e))
}

/// Brings a disk and the directory entry naming it to stable storage.
pub fn sync_disk(path: &Path) -> Result<(), DiskError> {
    vstore::sync_created(path).map_err(|e| err(&format!("sync {}", path.display()), &e))
}

/// Whether the disk exists and its image header reads.
pub fn is_intact(path: &Path) -> bool {
    vstore::open_disk(path, true).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(path: &Path, offset: u64, len: usize) -> Vec<u8> {
        let mut d = vstore::open_disk(path, true).expect("open");
        let mut buf = vec![0u8; len];
        d.read_at(&mut buf, offset).expect("read");
        buf
    }

    fn write(path: &Path, offset: u64, data: &[u8]) {
        let mut d = vstore::open_disk(path, false).expect("open");
        d.write_at(data, offset).expect("write");
        d.flush().expect("flush");
    }

    #[test]
    fn commits_share_the_disk_and_forks_are_independent() {
        let dir = tempfile::tempdir().expect("tmp");
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![7u8; 1 << 20]).expect("base");
        let disk = dir.path().join("vm.qcow2");
        create_disk(&base, &disk, Some(4 << 20)).expect("vm disk");
        write(&disk, 4096, b"builder");
        let commit = dir.path().join("c/cmt.qcow2");
        let next = dir.path().join("next.qcow2");
        assert_eq!(commit_disk(&disk, &commit, &next).expect("commit"), 4 << 20);
        assert!(std::fs::metadata(&commit)
            .expect("meta")
            .permissions()
            .readonly());
        verify_commit(&commit).expect("clean");
        let (a, b) = (dir.path().join("a.qcow2"), dir.path().join("b.qcow2"));
        fork_disk(&commit, &a).expect("fork a");
        fork_disk(&commit, &b).expect("fork b");
        write(&a, 4096, b"fork--a");
        assert_eq!(read(&a, 4096, 7), b"fork--a");
        assert_eq!(
            read(&b, 4096, 7),
            b"builder",
            "siblings do not see each other"
        );
        assert_eq!(
            read(&commit, 4096, 7),
            b"builder",
            "the commit never changes"
        );
        assert_eq!(
            read(&next, 0, 4),
            vec![7u8; 4],
            "the source goes on from the commit"
        );
        assert_eq!(
            read(&a, 2 << 20, 4),
            vec![0u8; 4],
            "beyond the base reads zeros"
        );
    }

    #[test]
    fn deep_chains_are_flattened_when_committed() {
        let dir = tempfile::tempdir().expect("tmp");
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![1u8; 256 << 10]).expect("base");
        let mut top = dir.path().join("l0.qcow2");
        create_disk(&base, &top, None).expect("l0");
        write(&top, 0, b"level0");
        for i in 1..=FLATTEN_DEPTH {
            let next = dir.path().join(format!("l{i}.qcow2"));
            create_disk_on(&top, &next).expect("level");
            top = next;
        }
        write(&top, 8192, b"top");
        let commit = dir.path().join("cmt.qcow2");
        commit_disk(&top, &commit, &dir.path().join("after.qcow2")).expect("commit");
        let info = vstore::info(&commit).expect("info");
        assert!(info.backing.is_none(), "flattened: {info:?}");
        assert_eq!(read(&commit, 0, 6), b"level0");
        assert_eq!(read(&commit, 8192, 3), b"top");
        assert_eq!(read(&commit, 100 << 10, 1), vec![1u8]);
    }

    #[test]
    fn a_corrupted_or_missing_commit_is_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let missing = verify_commit(&dir.path().join("nope.qcow2")).expect_err("missing");
        assert!(missing.to_string().contains("is missing"), "{missing}");
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![0u8; 1 << 20]).expect("base");
        let c = dir.path().join("c.qcow2");
        create_disk(&base, &c, None).expect("disk");
        std::fs::write(&c, vec![0u8; 512]).expect("zero the header");
        let bad = verify_commit(&c).expect_err("corrupt");
        assert!(bad.to_string().contains("corrupt"), "{bad}");
    }
}
