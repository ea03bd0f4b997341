//! Memory commits: a running VM's memory, vCPU and device state with its
//! disk become an immutable commit that hot forks resume.
//!
//! Order (the source stays paused from the snapshot to the record, so
//! nothing writes its disk in between):
//! 1. write the pending-commit file `<vm folder>/memory-commit.json`;
//! 2. pause the source (unless it was paused already);
//! 3. snapshot it into `<data_dir>/commits/<id>.memory/` (the VMM flushes
//!    the disk first): the memory file is a copy of guest RAM, written
//!    sparse, so nothing a fork maps is the source's live memory;
//! 4. freeze the disk as for a disk commit (the source's disk becomes
//!    `<id>.qcow2`, read-only, and a fresh overlay on it is made) and
//!    switch the paused VMM to the overlay: O(1), whatever the disk holds;
//! 5. record the commit and the source's new disk in one transaction;
//! 6. resume the source, remove its old disk name and the pending file.
//!
//! A failure undoes every step before it and the source runs on, on its
//! old disk. A crash is finished or undone at start-up from the pending
//! file: a recorded commit is kept (the VMM resumed), an unrecorded one
//! is removed and the VMM goes back to its old disk and runs on.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tine_proto::api::{CommitInfo, CommitMode, CommitRequest};

use super::commit_record::{info, record_for};
use super::daemon::Daemon;
use super::error::{chain, Error, Result};
use super::snapshot::SnapshotFiles;
use crate::db::{CommitRecord, VmRecord};
use crate::failpoint::{self, Failpoint};
use crate::launcher::LauncherExt;
use crate::storage;

/// What a memory commit in progress changes, written before it changes
/// anything: start-up finishes or undoes the commit from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingMemoryCommit {
    /// The commit's id.
    pub commit_id: String,
    /// The source's disk before the commit.
    pub old_disk: PathBuf,
    /// The overlay the source goes on in.
    pub new_disk: PathBuf,
    /// The commit's disk file.
    pub commit_disk: PathBuf,
    /// Whether the commit paused the source (and must resume it).
    pub resume: bool,
}

impl PendingMemoryCommit {
    /// Where a VM's pending memory commit is written.
    pub fn path(vm_dir: &Path) -> PathBuf {
        vm_dir.join("memory-commit.json")
    }

    /// Writes it to `path`: a synced temporary file renamed into place.
    fn write(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&text)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        match path.parent() {
            Some(dir) => storage::sync_dir(dir),
            None => Ok(()),
        }
    }

    /// Reads the pending commit at `path`, if there is one.
    pub fn read(path: &Path) -> std::io::Result<Option<Self>> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

fn remove_logged(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("cannot remove {}: {e}", path.display());
        }
    }
}

impl Daemon {
    /// Where memory commit `id` keeps its state and memory files.
    pub fn memory_commit_files(&self, id: &str) -> SnapshotFiles {
        SnapshotFiles::in_dir(self.commits_dir().join(format!("{id}.memory")))
    }

    /// Memory-commits `vm` (running, persistent, never committed; the
    /// caller holds its lock and checked the request): see the module
    /// documentation.
    pub(super) async fn commit_memory(
        self: &Arc<Self>,
        vm: &VmRecord,
        req: CommitRequest,
        id: String,
        began: Instant,
    ) -> Result<CommitInfo> {
        let hostname = vm.hostname.as_str();
        let vm_dir = self.paths(hostname).dir;
        let pending = PendingMemoryCommit {
            commit_id: id.clone(),
            old_disk: PathBuf::from(&vm.disk),
            new_disk: vm_dir.join(format!("disk-{}.qcow2", &id[id.len() - 8..])),
            commit_disk: self.commits_dir().join(format!("{id}.qcow2")),
            resume: !self.is_paused(vm),
        };
        let marker = PendingMemoryCommit::path(&vm_dir);
        if let Some(dir) = pending.commit_disk.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        }
        pending
            .write(&marker)
            .map_err(|e| Error::io(format!("write {}", marker.display()), e))?;
        let paused_at = Instant::now();
        if pending.resume {
            if let Err(source) = self.launcher.pause(hostname).await {
                remove_logged(&marker);
                return Err(Error::Launch {
                    what: format!("pause {hostname} for its memory commit"),
                    source,
                });
            }
        }
        let made = self.capture_and_freeze(vm, req, &pending, began).await;
        if pending.resume {
            if let Err(e) = self.launcher.resume(hostname).await {
                tracing::error!(
                    vm = hostname,
                    "resume after its memory commit: {}",
                    chain(&e)
                );
            }
        }
        let pause_us = paused_at.elapsed().as_micros() as u64;
        let record = match made {
            Ok(record) => record,
            Err(e) => {
                remove_logged(&marker);
                return Err(e);
            }
        };
        // The old name of the (now committed) inode.
        remove_logged(&pending.old_disk);
        remove_logged(&marker);
        tracing::info!(
            vm = hostname,
            commit = %id,
            pause_us,
            memory_bytes = record.memory_bytes.unwrap_or(0),
            "memory committed"
        );
        Ok(CommitInfo {
            parent_status: Some(vm.state),
            pause_us: Some(pause_us),
            ..info(&record)
        })
    }

    /// Steps 3 to 5 of a memory commit on the paused source; on failure
    /// every one of them is undone.
    async fn capture_and_freeze(
        self: &Arc<Self>,
        vm: &VmRecord,
        req: CommitRequest,
        pending: &PendingMemoryCommit,
        began: Instant,
    ) -> Result<CommitRecord> {
        let hostname = vm.hostname.as_str();
        let id = pending.commit_id.as_str();
        let files = self.memory_commit_files(id);
        let captured = self.capture(hostname, &files).await?;
        failpoint::hit(Failpoint::MemoryCommitCaptured);
        let (old, commit, new) = (
            pending.old_disk.clone(),
            pending.commit_disk.clone(),
            pending.new_disk.clone(),
        );
        let frozen = tokio::task::spawn_blocking(move || storage::commit_disk(&old, &commit, &new))
            .await
            .map_err(|source| Error::Task {
                what: "memory commit",
                source,
            })
            .and_then(|r| {
                r.map_err(|e| {
                    Error::disk(
                        format!("memory commit of {hostname} failed, nothing recorded"),
                        e,
                    )
                })
            });
        let size = match frozen {
            Ok(size) => size,
            Err(e) => {
                self.remove_snapshot_logged(hostname, &files);
                return Err(e);
            }
        };
        if let Err(source) = self
            .launcher
            .switch_disk(hostname, pending.new_disk.clone())
            .await
        {
            self.undo_freeze(pending);
            self.remove_snapshot_logged(hostname, &files);
            return Err(Error::Launch {
                what: format!("switch {hostname} to its fresh overlay"),
                source,
            });
        }
        failpoint::hit(Failpoint::MemoryCommitSwitched);
        let record = CommitRecord {
            mode: CommitMode::Memory,
            snapshot: Some(files.dir.display().to_string()),
            memory_bytes: Some(captured.memory_bytes),
            has_nic: Some(vm.network.is_some()),
            ..record_for(vm, req, id, &pending.commit_disk, size, began)
        };
        if let Err(e) = self
            .store
            .insert_commit(&record, &pending.new_disk.display().to_string())
        {
            // Still paused: nothing wrote the overlay, so the old disk
            // holds every write; the VMM goes back to it.
            self.switch_back(hostname, pending).await;
            self.remove_snapshot_logged(hostname, &files);
            return Err(e.into());
        }
        failpoint::hit(Failpoint::MemoryCommitRecorded);
        Ok(record)
    }

    /// Puts a paused source whose memory commit failed after the switch
    /// back on its old disk and removes what the commit made.
    pub(super) async fn switch_back(&self, hostname: &str, pending: &PendingMemoryCommit) {
        if let Err(e) = storage::make_writable(&pending.old_disk) {
            tracing::warn!(vm = hostname, "{e}");
        }
        match self
            .launcher
            .switch_disk(hostname, pending.old_disk.clone())
            .await
        {
            Ok(()) => self.undo_freeze(pending),
            // Its writes go to the overlay now: keep the files, so nothing
            // it writes is lost; the next commit or boot finds them.
            Err(e) => tracing::error!(
                vm = hostname,
                "cannot switch back to {} after a failed memory commit: {}; {} and {} are kept",
                pending.old_disk.display(),
                chain(&e),
                pending.new_disk.display(),
                pending.commit_disk.display()
            ),
        }
    }

    fn undo_freeze(&self, pending: &PendingMemoryCommit) {
        if let Err(e) =
            storage::uncommit_disk(&pending.old_disk, &pending.commit_disk, &pending.new_disk)
        {
            tracing::warn!(commit = %pending.commit_id, "undo the disk of a failed memory commit: {e}");
        }
    }

    /// Finishes or undoes a memory commit of `vm` the old daemon did not
    /// finish (its pending file is in the VM's folder). A recorded commit
    /// is kept: its source, paused on its fresh overlay, is resumed. An
    /// unrecorded one is undone: the source goes back to its old disk (it
    /// never ran on the overlay) and runs on; a VMM that cannot go back is
    /// killed, so that the VM boots from the disk that holds its writes.
    /// The commit's files are removed with the other orphans.
    pub(super) async fn finish_memory_commit_at_start(&self, vm: &VmRecord) -> Result<()> {
        let hostname = vm.hostname.as_str();
        let marker = PendingMemoryCommit::path(&self.paths(hostname).dir);
        let pending = match PendingMemoryCommit::read(&marker) {
            Ok(Some(p)) => p,
            Ok(None) => return Ok(()),
            Err(e) => {
                // Unreadable: written before anything changed, or damaged.
                tracing::error!(
                    vm = hostname,
                    "cannot read {}: {e}; removed",
                    marker.display()
                );
                remove_logged(&marker);
                return Ok(());
            }
        };
        if self.store.get_commit(&pending.commit_id)?.is_some() {
            if pending.resume {
                if let Err(e) = self.launcher.resume(hostname).await {
                    tracing::info!(
                        vm = hostname,
                        "resume after its memory commit: {}",
                        chain(&e)
                    );
                }
            }
            tracing::info!(vm = hostname, commit = %pending.commit_id, "finished its interrupted memory commit");
        } else {
            if let Err(e) = storage::make_writable(&pending.old_disk) {
                tracing::warn!(vm = hostname, "{e}");
            }
            if vm.pid.is_some() {
                // Paused, unless the crash came before the pause.
                if let Err(e) = self.launcher.pause(hostname).await {
                    tracing::info!(
                        vm = hostname,
                        "pause to undo its memory commit: {}",
                        chain(&e)
                    );
                }
                match self
                    .launcher
                    .switch_disk(hostname, pending.old_disk.clone())
                    .await
                {
                    Ok(()) if pending.resume => {
                        if let Err(e) = self.launcher.resume(hostname).await {
                            tracing::warn!(
                                vm = hostname,
                                "resume after undoing its memory commit: {}",
                                chain(&e)
                            );
                        }
                    }
                    Ok(()) => {}
                    Err(e) => {
                        tracing::error!(
                            vm = hostname,
                            "cannot put it back on {} ({}): its VMM is killed, its disk keeps every write",
                            pending.old_disk.display(),
                            chain(&e)
                        );
                        if let (Some(pid), Some(pid_start)) = (vm.pid, vm.pid_start) {
                            self.launcher
                                .kill(hostname, crate::launcher::Instance { pid, pid_start });
                        }
                    }
                }
            }
            tracing::info!(vm = hostname, commit = %pending.commit_id, "undid its interrupted memory commit");
        }
        remove_logged(&marker);
        Ok(())
    }
}
