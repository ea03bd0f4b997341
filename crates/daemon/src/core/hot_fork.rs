//! Hot forks: a new VM that resumes a memory commit's guest, processes
//! and all, on its own copy-on-write disk, TAP and vsock socket.
//!
//! A fork is provisioned as any fork (record, overlay disk on the commit's
//! disk, a spare one when the commit has one ready); its launch, instead
//! of a boot, restores the commit's snapshot in a pre-started `tine-vmm`
//! (with a spare network when one fits), the memory file mapped
//! copy-on-write (every fork shares its pages until it writes them). Its
//! set-up is [`SetUp::HotFork`]: the guest still believes it is the
//! source, so it gets its own hostname, machine-id, SSH host keys,
//! entropy, clock, MAC and address before it is `running`. Until then its
//! TAP is in network quarantine (down): the copy of the source never
//! reaches the wire.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tine_proto::api::{CommitInfo, CommitMode};

use super::commit_record::{check_pool_size, info};
use super::daemon::{no_commit, Daemon};
use super::error::{chain, Error, Result};
use super::lifecycle::NewFolder;
use super::snapshot::SnapshotFiles;
use super::spare_book::{SetAhead, SpareVm};
use super::supervise::{DiskSynced, Launching, SetUp, SetUpHold};
use crate::config::HostGroup;
use crate::db::{CommitRecord, VmRecord};
use crate::failpoint::{self, Failpoint};
use crate::launcher::pool::Shape;
use crate::launcher::{Instance, LauncherExt, RestoreSpec, Running};
use crate::network::VmNetwork;
use crate::storage;

/// Makes an unborn fork's disk at `disk` again: whatever is there is
/// removed, and a new overlay on `commit_disk` takes its place (not synced).
pub(super) fn fork_disk_again(commit_disk: &Path, disk: &Path) -> Result<()> {
    match std::fs::remove_file(disk) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("remove an unborn fork's disk", e)),
    }
    storage::fork_disk(commit_disk, disk)
        .map_err(|e| Error::disk("make an unborn fork's disk again", e))
}

impl Daemon {
    /// The warm pool each shape of memory commit needs: the largest size
    /// any commit of that shape asks for (its own, or else its group's
    /// `hot_fork_pool`). Commits of one shape share the shape's slots.
    fn wanted_pools(&self) -> Result<Vec<(Shape, u32)>> {
        let mut sizes: BTreeMap<Shape, u32> = BTreeMap::new();
        for p in self.pooled_commits()? {
            let shape = Shape {
                cpus: p.commit.cpus,
                ram_mib: p.commit.ram_bytes >> 20,
            };
            let size = sizes.entry(shape).or_default();
            *size = p.size.max(*size);
        }
        Ok(sizes.into_iter().collect())
    }

    /// Brings the warm pool of pre-started VMMs and the spares (see
    /// `spares`) to what the memory commits ask for (`wanted_pools`), and
    /// waits until they are.
    pub async fn fill_pools(self: &Arc<Self>) {
        {
            let _one_at_a_time = self.pool_sizing.lock().await;
            match self.wanted_pools() {
                Ok(wanted) => self.launcher.keep_warm(&wanted).await,
                Err(e) => tracing::error!("cannot size the warm pool: {}", chain(&e)),
            }
        }
        self.fill_spares().await;
    }

    /// The same in the background (after a memory commit was made or
    /// deleted, and at start).
    pub fn refresh_pools(self: &Arc<Self>) {
        let daemon = self.clone();
        tokio::spawn(async move { daemon.fill_pools().await });
    }

    /// Sets a memory commit's own warm pool size (`None`: back to its
    /// group's `hot_fork_pool`) and resizes the pools in the background.
    pub fn set_commit_pool(self: &Arc<Self>, id: &str, size: Option<u32>) -> Result<CommitInfo> {
        if let Some(size) = size {
            check_pool_size(size)?;
        }
        let c = self.commit_record(id)?;
        if c.mode != CommitMode::Memory {
            return Err(Error::BadRequest(format!(
                "{id} is a disk commit: only a memory commit's forks resume from a warm pool"
            )));
        }
        // Deleted in between: not found, as above.
        if !self.store.set_commit_pool(id, size)? {
            return Err(no_commit(id));
        }
        self.refresh_pools();
        Ok(info(&CommitRecord {
            hot_fork_pool: size,
            ..c
        }))
    }

    /// Stops every pre-started VMM and removes the spares (the daemon is
    /// going away; a restarted one would remove them as strays).
    pub async fn drain_pools(self: &Arc<Self>) {
        {
            let _one_at_a_time = self.pool_sizing.lock().await;
            self.launcher.keep_warm(&[]).await;
        }
        self.drain_spares().await;
    }

    /// The snapshot of a memory commit, checked complete; an error names
    /// the commit and what is missing.
    pub(super) fn memory_snapshot_of(&self, c: &CommitRecord) -> Result<SnapshotFiles> {
        let Some(dir) = c.snapshot.as_deref() else {
            return Err(Error::Failed(format!(
                "commit {} is recorded as a memory commit without a snapshot folder",
                c.id
            )));
        };
        let files = SnapshotFiles::in_dir(PathBuf::from(dir));
        if !files.is_complete() {
            return Err(Error::Failed(format!(
                "commit {} cannot be forked: its memory snapshot {} is missing or incomplete (its disk commit is intact)",
                c.id,
                files.dir.display()
            )));
        }
        Ok(files)
    }

    /// The snapshot `vm` resumes instead of booting: some for an unborn
    /// fork of a memory commit, none for any other VM.
    pub(super) fn hot_fork_snapshot(&self, vm: &VmRecord) -> Result<Option<SnapshotFiles>> {
        let Some(parent) = vm
            .parent_commit_id
            .as_deref()
            .filter(|_| vm.is_unborn_fork())
        else {
            return Ok(None);
        };
        match self.store.get_commit(parent)? {
            Some(c) if c.mode == CommitMode::Memory => self.memory_snapshot_of(&c).map(Some),
            _ => Ok(None),
        }
    }

    /// Launches the hot fork just recorded as `hostname` in the caller's
    /// task (its request's): it takes no boot slot (it boots nothing; its
    /// set-up is a few agent calls, so a burst of forks resumes at once)
    /// and reads its commit's snapshot from `files`, which the request
    /// checked; `folder` says how its folder was made (what its disk sync
    /// has left to do). Returns its record with the process it runs in; a fork that
    /// cannot be launched is removed, and the error says why.
    pub(super) async fn launch_new_hot_fork(
        self: &Arc<Self>,
        hostname: &str,
        files: &SnapshotFiles,
        folder: NewFolder,
    ) -> Result<VmRecord> {
        let _guard = self.lock_vm(hostname).await;
        // A delete may have come between the record and the lock.
        let Some(vm) = self.still_unlaunched(hostname)? else {
            return Err(Error::Failed(format!(
                "{hostname} was deleted or stopped before it resumed"
            )));
        };
        let disk_synced = self.sync_disk_soon(&vm.disk, folder);
        match self.launch_hot_fork(&vm, None, files, disk_synced).await {
            Ok(Instance { pid, pid_start }) => Ok(VmRecord {
                pid: Some(pid),
                pid_start: Some(pid_start),
                ..vm
            }),
            Err(e) => {
                let reason = self.launch_failed(hostname, &e);
                Err(Error::Failed(format!(
                    "fork failed and was removed: {reason}"
                )))
            }
        }
    }

    /// Launches an unborn hot fork (recorded `starting` without a process;
    /// the caller holds its lock): the primed VM it claimed resumed with
    /// its network handed over, or else a network and a VMM restored from
    /// `files` with the fork's own disk and TAP; the process recorded, then
    /// its set-up supervised, which ends once `disk_synced` says its disk
    /// reached stable storage (the sync runs meanwhile). `permit` is its
    /// boot slot: none for a fork's first launch, one when a restart queued
    /// it again.
    pub(super) async fn launch_hot_fork(
        self: &Arc<Self>,
        vm: &VmRecord,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        files: &SnapshotFiles,
        disk_synced: DiskSynced,
    ) -> Result<Instance> {
        let hold = SetUpHold {
            boot_slot: permit,
            launch: Some(Launching::new(self)),
        };
        self.resume_hot_fork(vm, hold, files, disk_synced).await
    }

    async fn resume_hot_fork(
        self: &Arc<Self>,
        vm: &VmRecord,
        hold: SetUpHold,
        files: &SnapshotFiles,
        disk_synced: DiskSynced,
    ) -> Result<Instance> {
        let hostname = vm.hostname.as_str();
        let group = self.group(&vm.host_group)?.clone();
        self.take_forced(hostname);
        let claimed = self.spare_book().unclaim(hostname);
        // For the log: whether the set-up's times are those of a VM primed
        // (and run until its agent answered) ahead.
        let claimed_primed = claimed.is_some();
        let (running, ahead) = match claimed {
            Some(primed) => self.resume_spare_vm(&group, vm, primed, files).await?,
            None => (
                self.restore_hot_fork(&group, vm, files, None).await?,
                SetAhead::default(),
            ),
        };
        let instance = running.instance;
        let Instance { pid, pid_start } = instance;
        if let Err(e) = self.store.set_process(hostname, pid, pid_start) {
            self.launcher.kill(hostname, instance);
            return Err(e.into());
        }
        self.notify(hostname);
        failpoint::hit(Failpoint::BootRecorded);
        tracing::info!(
            vm = hostname,
            pid,
            claimed_primed,
            network_set_ahead = ahead.network,
            identity_set_ahead = ahead.identity,
            "resumed from a memory commit"
        );
        self.supervise(
            hostname.to_owned(),
            running,
            hold,
            SetUp::HotFork { ahead },
            Some(disk_synced),
        );
        Ok(instance)
    }

    /// Resumes the primed VM fork `vm` claimed (its disk is the fork's
    /// already): hands its network over and runs its vCPUs. If the hand-over
    /// fails or its process had ended, the fork restores into another
    /// process instead (with the network, when it was handed over), on a
    /// disk made again. Says too what the running guest was given ahead.
    async fn resume_spare_vm(
        self: &Arc<Self>,
        group: &HostGroup,
        vm: &VmRecord,
        primed: SpareVm,
        files: &SnapshotFiles,
    ) -> Result<(Running, SetAhead)> {
        let network = match primed.network {
            Some(spare) => match self.hand_over_network(vm, spare) {
                Ok(Some(taken)) => Some(taken),
                Ok(None) => {
                    // Its TAP is gone with the failed hand-over.
                    self.launcher.discard_primed(&primed.process);
                    self.remake_primed_disk(vm).await?;
                    let restored = self.restore_hot_fork(group, vm, files, None).await?;
                    return Ok((restored, SetAhead::default()));
                }
                Err(e) => {
                    self.launcher.discard_primed(&primed.process);
                    return Err(e);
                }
            },
            None => None,
        };
        // In quarantine: the hand-over takes only a TAP that is down, and
        // nothing brings it up before the fork's set-up.
        let resumed = self
            .launcher
            .resume_primed(&primed.process, &vm.hostname)
            .await
            .map_err(|source| Error::Launch {
                what: format!("resume {} from a primed VM", vm.hostname),
                source,
            })?;
        match resumed {
            Some(running) => Ok((running, primed.set_ahead)),
            // Another guest from the same snapshot: given nothing yet.
            None => {
                self.remake_primed_disk(vm).await?;
                let restored = self.restore_hot_fork(group, vm, files, network).await?;
                Ok((restored, SetAhead::default()))
            }
        }
    }

    /// Makes the disk of unborn fork `vm` again on its commit's disk, and
    /// syncs it: the primed VM the fork claimed ran on the old one (its
    /// warm-up, its set-up ahead wrote to it), so a guest restored from the
    /// commit into another process, whose page cache is the commit's, must
    /// not find it changed under it.
    pub(super) async fn remake_primed_disk(&self, vm: &VmRecord) -> Result<()> {
        let Some(id) = vm.parent_commit_id.as_deref() else {
            return Err(Error::Failed(format!(
                "{} has no commit to make its disk again from",
                vm.hostname
            )));
        };
        let commit_disk = PathBuf::from(self.commit_record(id)?.disk);
        let disk = PathBuf::from(&vm.disk);
        tokio::task::spawn_blocking(move || {
            fork_disk_again(&commit_disk, &disk)?;
            storage::sync_disk(&disk).map_err(|e| Error::disk("make a fork's disk again", e))
        })
        .await
        .map_err(|source| Error::Task {
            what: "make a fork's disk again",
            source,
        })?
    }

    /// Restores the fork `vm` from `files` into a pre-started process, with
    /// `network` (or a spare one, or one attached now).
    async fn restore_hot_fork(
        self: &Arc<Self>,
        group: &HostGroup,
        vm: &VmRecord,
        files: &SnapshotFiles,
        network: Option<VmNetwork>,
    ) -> Result<Running> {
        let network = match network {
            Some(n) => Some(n),
            None => match self.take_spare_network(group, vm)? {
                Some(spare) => Some(spare),
                None => self.attach_network(group, vm)?,
            },
        };
        if let Some(n) = &network {
            self.quarantine(&vm.hostname, n)?;
        }
        let spec = RestoreSpec {
            hostname: vm.hostname.clone(),
            cpus: vm.cpus,
            ram_mib: vm.ram_bytes >> 20,
            state: files.state(),
            memory: files.memory(),
            paused: false,
            disk: Some(PathBuf::from(&vm.disk)),
            tap: network.map(|n| n.tap),
        };
        let running = self
            .launcher
            .restore(&spec)
            .await
            .map_err(|source| Error::Launch {
                what: format!("resume {} from {}", vm.hostname, files.dir.display()),
                source,
            })?;
        self.copy_write_set_soon(vm, files);
        Ok(running)
    }

    /// Has a hot fork that was restored on its own path (no primed VM was
    /// left for it) copy its commit's write set in, in the background
    /// while its vCPUs run: a page its guest wrote already is left as it
    /// is, one it has only read becomes its own copy of the same bytes
    /// (KVM drops its mapping of the shared one). A page copied so costs
    /// a fraction of the fault and copy its guest's first write would
    /// (`cargo bench -p tine-vmm --bench first_touch`).
    fn copy_write_set_soon(self: &Arc<Self>, vm: &VmRecord, files: &SnapshotFiles) {
        let (Some(commit), path) = (vm.parent_commit_id.clone(), files.write_set()) else {
            return;
        };
        if !path.is_file() {
            return;
        }
        let (this, hostname, files) = (self.clone(), vm.hostname.clone(), files.clone());
        tokio::spawn(async move {
            let copy = this.launcher.copy_write_set(&hostname, path).await;
            this.write_set_copied(&commit, &files, copy);
        });
    }

    /// After hot fork `vm`'s set-up: when its commit's snapshot has no
    /// write set yet, saves the pages the fork's guest wrote since it
    /// resumed as one (its fix-ups', its agent's and its processes'), and
    /// has the VMs primed for the commit's next forks copy them in while
    /// they wait. Those forks' guests then find the pages their set-up
    /// writes their own already: no fault and no copy on their path, and
    /// no memory their guests would not take anyway. A failure is logged:
    /// without a write set, forks run as before.
    pub(super) async fn save_write_set(&self, vm: &VmRecord) {
        let hostname = vm.hostname.as_str();
        let (commit, files) = match (vm.parent_commit_id.as_deref(), self.hot_fork_snapshot(vm)) {
            (Some(commit), Ok(Some(files))) => (commit, files),
            (_, Ok(_)) => return,
            (_, Err(e)) => {
                tracing::warn!(vm = hostname, "no write set saved: {}", chain(&e));
                return;
            }
        };
        let path = files.write_set();
        if path.is_file() {
            return;
        }
        let saving = || {
            self.saving_write_sets
                .lock()
                .unwrap_or_else(|p| p.into_inner())
        };
        if !saving().insert(commit.to_owned()) {
            return;
        }
        let saved = self.launcher.save_write_set(hostname, path.clone()).await;
        saving().remove(commit);
        let bytes = match saved {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!(vm = hostname, %commit, "no write set saved: {}", chain(&e));
                return;
            }
        };
        tracing::info!(vm = hostname, %commit, bytes, "saved the commit's write set");
        let primed = self.spare_book().primed_of(commit);
        for name in primed {
            if let Some(copy) = self.launcher.populate_primed(&name, &path).await {
                self.write_set_copied(commit, &files, copy);
            }
        }
    }

    /// Until its set-up gives the guest its own MAC and address, a hot
    /// fork is its source on the wire: nothing of it may get out. A spare
    /// made ahead is in quarantine already; asserting it again costs one
    /// netlink query.
    fn quarantine(&self, hostname: &str, network: &VmNetwork) -> Result<()> {
        self.network
            .set_quarantine(network, true)
            .map_err(|source| Error::Network {
                vm: hostname.to_owned(),
                source,
            })
    }
}
