//! Commits and cold forks: a stopped persistent VM's disk becomes an
//! immutable parent (`cmt-<group>-<16 hex>`), and forks boot from
//! copy-on-write children of it.
//!
//! Order of a commit (crash-safe): link the source's disk to
//! `<data_dir>/commits/<id>.qcow2` and make it read-only, create the
//! source's fresh overlay on it, then record both in one transaction, then
//! remove the source's old name. A crash before the record leaves an
//! unrecorded commit file that start-up removes; the source keeps its disk.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_proto::api::{
    self, CommitInfo, CommitMode, CommitRequest, ForkRequest, ForkStatus, VmState, Wait,
};

use super::commit_record::{check_request, info, new_commit_id, record_for};
use super::daemon::{no_commit, remove_file_logged, Daemon, FileStamp};
use super::error::{chain, Error, Result};
use super::lifecycle::NewFolder;
use super::plan;
use super::snapshot::SnapshotFiles;
use super::spares::takes_primed_vm;
use super::supervise::Launching;
use crate::db::{CommitFilter, VmRecord};
use crate::failpoint::{self, Failpoint};
use crate::storage;

fn file_stamp(path: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.len(), m.mtime(), m.mtime_nsec()))
}

/// How much older than now a file's mtime must be for its stamp to be
/// remembered: a file system's clock is coarse (a tick of a few
/// milliseconds), so a write in the tick the stamp was read in could leave
/// the stamp as it was. Once the mtime is older than this, any later write
/// gives a later one.
const STAMP_SETTLED: Duration = Duration::from_millis(50);

/// How long until `stamp`'s mtime is [`STAMP_SETTLED`] old (zero: it is).
fn until_settled(stamp: &FileStamp) -> Duration {
    let (_, _, secs, nanos) = *stamp;
    let mtime = match (u64::try_from(secs), u32::try_from(nanos)) {
        (Ok(secs), Ok(nanos)) => std::time::UNIX_EPOCH + Duration::new(secs, nanos),
        _ => return Duration::ZERO,
    };
    let age = std::time::SystemTime::now()
        .duration_since(mtime)
        .unwrap_or(Duration::ZERO);
    STAMP_SETTLED.saturating_sub(age)
}

/// Checks commit `id`'s file at `path`; returns the stamp to remember it
/// checked by, when it had settled (see [`STAMP_SETTLED`]: one that has
/// not is checked again next time).
async fn verify_commit_file(id: &str, path: &Path) -> Result<Option<FileStamp>> {
    let stamp = file_stamp(path).filter(|s| until_settled(s).is_zero());
    let p = path.to_path_buf();
    tokio::task::spawn_blocking(move || storage::verify_commit(&p))
        .await
        .map_err(|source| Error::Task {
            what: "verify commit",
            source,
        })?
        .map_err(|e| Error::disk(format!("commit {id} cannot be forked"), e))?;
    Ok(stamp)
}

impl Daemon {
    /// The folder of commit files.
    pub fn commits_dir(&self) -> PathBuf {
        self.data_dir.join("commits")
    }

    /// Commits a persistent, never committed VM: its disk once stopped
    /// (mode `disk`), or, running, its memory with its disk (mode
    /// `memory`, see `memory_commit`).
    pub async fn commit(self: &Arc<Self>, key: &str, req: CommitRequest) -> Result<CommitInfo> {
        let began = Instant::now();
        check_request(&req)?;
        let mode = req.mode.unwrap_or(CommitMode::Disk);
        let vm = self.vm(key)?;
        let _guard = self.lock_vm(&vm.hostname).await;
        let vm = self.vm(&vm.hostname)?;
        if let Some(id) = &vm.commit_id {
            return Err(Error::Conflict(format!(
                "{} was already committed as {id}; a committed source cannot be committed again (fork it and commit the fork)",
                vm.hostname
            )));
        }
        if !vm.persistent {
            return Err(Error::Conflict(format!(
                "{} is not persistent: only a persistent VM's disk outlives its stop, so only it can be committed",
                vm.hostname
            )));
        }
        match mode {
            CommitMode::Disk if vm.state != VmState::Stopped => {
                return Err(Error::Conflict(format!(
                    "{} is {}; shut it down first (tine vm shutdown {}): only a stopped VM's disk can be committed (a running one's with --memory)",
                    vm.hostname, vm.state, vm.hostname
                )));
            }
            CommitMode::Memory if vm.state != VmState::Running || vm.pid.is_none() => {
                return Err(Error::Conflict(format!(
                    "{} is {}; only a running VM's memory can be committed",
                    vm.hostname, vm.state
                )));
            }
            _ => {}
        }
        if let Some(k) = &req.cache_key {
            let by_key = CommitFilter {
                cache_key: Some(k),
                ..CommitFilter::default()
            };
            if let Some(c) = self.store.list_commits(&by_key)?.first() {
                return Err(Error::Conflict(format!(
                    "the cache key `{k}` is already used by commit {}",
                    c.id
                )));
            }
        }
        let id = new_commit_id(&vm.host_group)?;
        if mode == CommitMode::Memory {
            let made = self.commit_memory(&vm, req, id, began).await;
            if let Ok(info) = &made {
                self.check_commit_soon(&info.commit_id);
                // A new shape may want pre-started VMMs for its forks.
                self.refresh_pools();
            }
            return made;
        }
        let commit_path = self.commits_dir().join(format!("{id}.qcow2"));
        let paths = self.paths(&vm.hostname);
        let new_disk = paths
            .dir
            .join(format!("disk-{}.qcow2", &id[id.len() - 8..]));
        let old_disk = PathBuf::from(&vm.disk);
        let (c2, n2, o2) = (commit_path.clone(), new_disk.clone(), old_disk.clone());
        let size = tokio::task::spawn_blocking(move || storage::commit_disk(&o2, &c2, &n2))
            .await
            .map_err(|source| Error::Task {
                what: "commit",
                source,
            })?
            .map_err(|e| {
                Error::disk(
                    format!("commit of {} failed, nothing recorded", vm.hostname),
                    e,
                )
            })?;
        let record = record_for(&vm, req, &id, &commit_path, size, began);
        failpoint::hit(Failpoint::CommitOverlayMade);
        if let Err(e) = self
            .store
            .insert_commit(&record, &new_disk.display().to_string())
        {
            remove_file_logged(&commit_path);
            remove_file_logged(&new_disk);
            return Err(e.into());
        }
        failpoint::hit(Failpoint::CommitRecorded);
        // The old name of the (now committed) inode.
        remove_file_logged(&old_disk);
        tracing::info!(vm = %vm.hostname, commit = %id, ms = record.elapsed_ms, "committed");
        self.check_commit_soon(&id);
        Ok(CommitInfo {
            parent_status: Some(vm.state),
            ..info(&record)
        })
    }

    /// Checks commit `id`'s file at `path` before a fork uses it. A commit
    /// is immutable: its metadata is checked once per daemon run (made by
    /// this daemon: right after the commit, off its first fork's path),
    /// and again only when the file itself changed.
    async fn check_commit_file(&self, id: &str, path: &Path) -> Result<()> {
        let stamp = file_stamp(path);
        if stamp.is_some() && self.verified_stamp(id) == stamp {
            return Ok(());
        }
        if let Some(stamp) = verify_commit_file(id, path).await? {
            self.remember_verified(id, stamp);
        }
        Ok(())
    }

    /// [`Daemon::check_commit_file`] of a commit just made, in the
    /// background, once its file's stamp has settled; a file that does not
    /// check is logged (a fork says why). The task holds the daemon only to
    /// remember the check: a daemon dropped meanwhile (a restart in the
    /// same process) is not kept open by it.
    fn check_commit_soon(self: &Arc<Self>, id: &str) {
        let path = match self.commit_record(id) {
            Ok(c) => PathBuf::from(c.disk),
            Err(e) => {
                tracing::warn!(commit = %id, "its file was not checked after the commit: {}", chain(&e));
                return;
            }
        };
        let daemon = Arc::downgrade(self);
        let id = id.to_owned();
        tokio::spawn(async move {
            if let Some(stamp) = file_stamp(&path) {
                tokio::time::sleep(until_settled(&stamp)).await;
            }
            match verify_commit_file(&id, &path).await {
                Ok(Some(stamp)) => {
                    if let Some(daemon) = daemon.upgrade() {
                        daemon.remember_verified(&id, stamp);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(commit = %id, "its file was not checked after the commit: {}", chain(&e))
                }
            }
        });
    }

    /// Deletes a commit nobody depends on.
    pub fn delete_commit(self: &Arc<Self>, id: &str) -> Result<()> {
        let c = self.store.delete_commit(id)?.ok_or_else(|| no_commit(id))?;
        remove_file_logged(Path::new(&c.disk));
        if let Some(dir) = &c.snapshot {
            self.remove_snapshot_logged(&c.source, &SnapshotFiles::in_dir(PathBuf::from(dir)));
            // Its shape may need no pre-started VMMs any more.
            self.refresh_pools();
        }
        Ok(())
    }

    /// Forks a commit: a new VM on a copy-on-write child of its disk,
    /// booting from it (a disk commit) or resuming the commit's guest (a
    /// memory commit: see `hot_fork`).
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        req: ForkRequest,
        wait: Wait,
        timeout: Duration,
    ) -> Result<api::ForkResponse> {
        let began = Instant::now();
        let c = self.commit_record(id)?;
        let group = self.group(&c.host_group)?.clone();
        let name_taken = match &req.name {
            Some(n) => self.store.find_vm(n)?.is_some(),
            None => false,
        };
        let hot = c.mode == CommitMode::Memory;
        // Until the answer is made (the set-up holds its own): the refill
        // would take the CPU the answer needs once the set-up ends.
        let _launching = hot.then(|| Launching::new(self).bounded(self.deadlines.launch_set_up));
        let new = if hot {
            plan::hot_fork(&group, &c, &req, name_taken)?
        } else {
            plan::fork(&group, &c, &req, name_taken)?
        };
        let snapshot = if hot {
            Some(self.memory_snapshot_of(&c)?)
        } else {
            None
        };
        if req.secrets.is_some() {
            // Inherited grants are not checked: one whose secret was
            // deleted since is skipped when the fork boots.
            self.check_grants(&new.secrets)?;
        }
        let commit_path = PathBuf::from(&c.disk);
        self.check_commit_file(&c.id, &commit_path).await?;
        let mut spare = if hot {
            if takes_primed_vm(&c, new.policy.as_ref()) {
                self.await_priming(&c.id).await;
            }
            self.take_spare(&c, new.policy.as_ref())
        } else {
            None
        };
        let this = self.clone();
        // The fork finishes even if the client goes away.
        let job = tokio::spawn(async move {
            let mut recorded_as = None;
            let mut folder = NewFolder::Made;
            let recorded = this.record_new(&new, |vm: &VmRecord, dir: &Path| {
                recorded_as = Some(vm.hostname.clone());
                folder = this.fork_disk_from(spare.take(), &commit_path, vm, dir)?;
                Ok(())
            });
            if recorded.is_err() {
                // Taken or claimed, but no fork holds it: a spare the
                // record never reached, or the primed VM it claimed.
                if let Some(unused) = spare {
                    this.release_taken(unused);
                }
                if let Some(hostname) = recorded_as {
                    this.release_claimed(&hostname);
                }
            }
            let hostname = recorded?.hostname;
            let launched = match snapshot {
                // A hot fork resumes here and now, without a boot slot.
                Some(files) => Some(this.launch_new_hot_fork(&hostname, &files, folder).await?),
                None => {
                    this.spawn_boot(&hostname);
                    None
                }
            };
            Ok::<_, Error>((hostname, launched))
        });
        let (hostname, launched) = job.await.map_err(|source| Error::Task {
            what: "fork",
            source,
        })??;
        let vm = match (wait, launched) {
            (Wait::Agent, _) => match self.wait_running(&hostname, timeout).await {
                Ok(vm) => vm,
                Err(e) if e.is_timeout() => return Err(e),
                Err(e) => {
                    // A fork that failed to come up leaves nothing behind.
                    self.discard(&hostname).await;
                    return Err(Error::Failed(format!(
                        "fork failed and was removed: {}",
                        chain(&e)
                    )));
                }
            },
            // A hot fork answers once its vCPUs run (its set-up goes on).
            (Wait::None, Some(resumed)) => resumed,
            (Wait::None, None) => self.vm(&hostname)?,
        };
        Ok(api::ForkResponse {
            hostname: vm.hostname,
            source_hostname: c.source,
            commit_id: c.id,
            status: ForkStatus::Forked,
            mode: c.mode,
            child_status: vm.state,
            persistent: vm.persistent,
            elapsed_ms: began.elapsed().as_millis() as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_settles_once_its_mtime_is_old_enough() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970");
        let at = |d: Duration| (1, 2, d.as_secs() as i64, i64::from(d.subsec_nanos()));
        let fresh = until_settled(&at(now));
        assert!(
            fresh > Duration::ZERO && fresh <= STAMP_SETTLED,
            "{fresh:?}"
        );
        assert_eq!(
            until_settled(&at(now - Duration::from_secs(1))),
            Duration::ZERO
        );
        // A time before the epoch is long settled; one in the future never.
        assert_eq!(until_settled(&(1, 2, -5, 0)), Duration::ZERO);
        assert_eq!(
            until_settled(&at(now + Duration::from_secs(60))),
            STAMP_SETTLED
        );
    }
}
