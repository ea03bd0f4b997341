//! A running VM's state and memory to files and back, on the VMM's
//! snapshot and restore: what suspend and restore are made of, and what
//! memory commits and hot forks build on.
//!
//! A snapshot is written into a temporary folder (`<name>.partial`), synced
//! (files and folder), then renamed into place in one step, so a crash at
//! any point leaves either no snapshot (a partial folder start-up removes)
//! or a complete one. The VM must be paused while it is taken; the VMM
//! flushes the VM's disk first, so the disk as written holds every write
//! the guest saw complete and matches the memory.
//!
//! A restore starts a pre-started `tine-vmm` on the snapshot with the VM's
//! own disk, TAP and vsock socket, records the process, and supervises it
//! like a boot whose set-up is [`SetUp::Resume`]. The memory file is mapped
//! copy-on-write: nothing may write it in place while a VM runs on it
//! (removing its name is fine; the mapping keeps it).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::daemon::Daemon;
use super::error::{chain, Error, Result};
use super::supervise::{SetUp, SetUpHold};
use crate::db::VmRecord;
use crate::failpoint::{self, Failpoint};
use crate::launcher::{Instance, LauncherExt, RestoreSpec};

/// The files of one snapshot: `<dir>/state` and `<dir>/memory`, written
/// in `<dir>.partial` first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotFiles {
    /// The folder of a complete snapshot.
    pub dir: PathBuf,
    /// The folder it is written in.
    pub partial: PathBuf,
}

/// What taking a snapshot wrote and how long the VMM took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Captured {
    /// Bytes of guest RAM written (zero pages are holes).
    pub memory_bytes: u64,
    /// Microseconds inside the VMM.
    pub snapshot_us: u64,
}

fn remove_dir_if_there(dir: &Path) -> io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn sync_path(path: &Path) -> io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

impl SnapshotFiles {
    /// A snapshot in `dir` (its partial folder next to it).
    pub fn in_dir(dir: PathBuf) -> Self {
        let mut partial = dir.clone().into_os_string();
        partial.push(".partial");
        SnapshotFiles {
            dir,
            partial: partial.into(),
        }
    }

    /// The state file (vCPUs, devices).
    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// The memory file (guest RAM, sparse).
    pub fn memory(&self) -> PathBuf {
        self.dir.join("memory")
    }

    /// The write set of a memory commit's snapshot: the pages its first
    /// hot fork wrote by the end of its set-up, which the VMs primed for
    /// the next forks copy in ahead (see `tine_vmm::snapshot::write_set`).
    /// Not part of the snapshot proper: a snapshot without one is
    /// complete, and a fork records it.
    pub fn write_set(&self) -> PathBuf {
        self.dir.join("write-set")
    }

    /// Whether a complete snapshot is in place (both files; the VMM checks
    /// their content when it restores).
    pub fn is_complete(&self) -> bool {
        let state = std::fs::metadata(self.state());
        state.is_ok_and(|m| m.is_file() && m.len() > 0) && self.memory().is_file()
    }

    /// Whether anything of a snapshot, complete or partial, is there.
    pub fn exists(&self) -> bool {
        self.dir.exists() || self.partial.exists()
    }

    /// Removes the snapshot, complete and partial.
    pub fn remove(&self) -> io::Result<()> {
        remove_dir_if_there(&self.partial)?;
        remove_dir_if_there(&self.dir)
    }

    /// Removes the partial folder only (an interrupted snapshot).
    pub fn remove_partial(&self) -> io::Result<()> {
        remove_dir_if_there(&self.partial)
    }

    /// An empty partial folder to write into.
    fn prepare(&self) -> io::Result<()> {
        remove_dir_if_there(&self.partial)?;
        std::fs::create_dir_all(&self.partial)
    }

    /// Syncs the partial snapshot and renames it into place (replacing an
    /// older one: its files are unlinked, never rewritten), then syncs the
    /// folder that holds it.
    fn seal(&self) -> io::Result<()> {
        for name in ["state", "memory"] {
            sync_path(&self.partial.join(name))?;
        }
        sync_path(&self.partial)?;
        remove_dir_if_there(&self.dir)?;
        std::fs::rename(&self.partial, &self.dir)?;
        match self.dir.parent() {
            Some(parent) => sync_path(parent),
            None => Ok(()),
        }
    }
}

impl Daemon {
    /// Where a VM's suspended state lives: `<vm folder>/snapshot`.
    pub fn suspend_files(&self, hostname: &str) -> SnapshotFiles {
        SnapshotFiles::in_dir(self.paths(hostname).dir.join("snapshot"))
    }

    /// Writes a snapshot of a paused VM into `files` (see the module
    /// documentation); on failure nothing of it is left. The VM stays
    /// paused either way.
    pub(super) async fn capture(&self, hostname: &str, files: &SnapshotFiles) -> Result<Captured> {
        let io = |what: &str| {
            let what = format!("{what} {} for {hostname}", files.partial.display());
            move |e| Error::io(what, e)
        };
        files.prepare().map_err(io("prepare"))?;
        let taken = self
            .launcher
            .snapshot(
                hostname,
                files.partial.join("state"),
                files.partial.join("memory"),
            )
            .await
            .map_err(|source| Error::Launch {
                what: format!("snapshot {hostname}"),
                source,
            });
        let info = match taken {
            Ok(info) => info,
            Err(e) => {
                self.remove_snapshot_logged(hostname, files);
                return Err(e);
            }
        };
        failpoint::hit(Failpoint::SuspendSnapshotTaken);
        let sealing = files.clone();
        let sealed = tokio::task::spawn_blocking(move || sealing.seal())
            .await
            .map_err(|source| Error::Task {
                what: "sync the snapshot",
                source,
            })
            .and_then(|r| r.map_err(io("sync and rename")));
        if let Err(e) = sealed {
            self.remove_snapshot_logged(hostname, files);
            return Err(e);
        }
        Ok(Captured {
            memory_bytes: info.as_ref().map_or(0, |i| i.mem_bytes_written),
            snapshot_us: info.as_ref().map_or(0, |i| i.duration_us),
        })
    }

    /// Removes a snapshot's files, logging a failure (start-up removes
    /// what is left).
    pub(super) fn remove_snapshot_logged(&self, hostname: &str, files: &SnapshotFiles) {
        if let Err(e) = files.remove() {
            tracing::warn!(vm = hostname, "cannot remove {}: {e}", files.dir.display());
        }
    }

    /// Starts `vm` (recorded `suspended`) from the snapshot in `files` with
    /// its own disk, TAP and vsock socket, records the process (`starting`)
    /// and supervises it: its set-up is [`SetUp::Resume`]. On failure the
    /// VM stays as it was, its snapshot untouched. The caller holds the
    /// VM's lock.
    pub(super) async fn restore_run(
        self: &Arc<Self>,
        vm: &VmRecord,
        files: &SnapshotFiles,
    ) -> Result<Instance> {
        let hostname = vm.hostname.as_str();
        let group = self.group(&vm.host_group)?.clone();
        let network = self.attach_network(&group, vm)?;
        let spec = RestoreSpec {
            hostname: hostname.to_owned(),
            cpus: vm.cpus,
            ram_mib: vm.ram_bytes >> 20,
            state: files.state(),
            memory: files.memory(),
            paused: false,
            disk: Some(PathBuf::from(&vm.disk)),
            tap: network.map(|n| n.tap),
        };
        // A forced stop of an earlier run that was never reaped here.
        self.take_forced(hostname);
        let running = match self.launcher.restore(&spec).await {
            Ok(running) => running,
            Err(source) => {
                self.release_network(vm);
                return Err(Error::Launch {
                    what: format!("restore {hostname} from {}", files.dir.display()),
                    source,
                });
            }
        };
        let instance = running.instance;
        failpoint::hit(Failpoint::RestoreSpawned);
        let recorded = self
            .store
            .record_restored(hostname, instance.pid, instance.pid_start);
        if !matches!(recorded, Ok(true)) {
            self.launcher.kill(hostname, instance);
            self.release_network(vm);
            return Err(match recorded {
                Err(e) => e.into(),
                _ => Error::Conflict(format!("{hostname} is no longer suspended")),
            });
        }
        self.notify(hostname);
        failpoint::hit(Failpoint::RestoreRecorded);
        tracing::info!(vm = hostname, pid = instance.pid, "restored");
        self.supervise(
            hostname.to_owned(),
            running,
            SetUpHold::default(),
            SetUp::Resume,
            None,
        );
        Ok(instance)
    }

    /// Stops a run that no longer needs its process (suspended, its
    /// snapshot written): asks its VMM to exit, kills it if it does not,
    /// and waits until it is gone.
    pub(super) async fn end_run(&self, hostname: &str, instance: Instance) {
        const GONE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);
        if let Err(e) = self.launcher.stop_now(hostname).await {
            tracing::warn!(vm = hostname, "ask its VMM to exit: {}", chain(&e));
        }
        if !self.wait_run_ended(hostname, instance, GONE_WITHIN).await {
            tracing::warn!(vm = hostname, "its VMM did not exit; killing it");
            self.launcher.kill(hostname, instance);
            if !self.wait_run_ended(hostname, instance, GONE_WITHIN).await {
                tracing::error!(vm = hostname, pid = instance.pid, "its VMM is still there");
            }
        }
    }
}
