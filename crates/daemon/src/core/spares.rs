//! Spares: a hot fork made ahead of it, so that the fork's own path only
//! hands over what is ready and runs the vCPUs. Per host group with a NIC,
//! networks (TAP made, its rules in place, its address reserved, in
//! quarantine); per memory commit, overlay disks on the commit's disk
//! (made and synced), and primed VMs: the commit's snapshot restored,
//! paused, into a `tine-vmm` of its own with one of those disks and
//! networks attached. A memory commit wants as many primed VMs as its warm
//! pool (its own `hot_fork_pool`, or its group's); a group as many
//! networks as its commits' pools together.
//!
//! A fork that would take its group's network as it is (no policy of its
//! own, not `network: none`) claims a primed VM inside the transaction that
//! records it (the folder of the VM's disk becomes the fork's folder by one
//! rename), and its launch hands the network over and resumes the VM: no
//! restore on its path. A fork that finds no primed VM takes a loose spare
//! disk (and network), and restores into a pre-started process of the warm
//! pool.
//!
//! A spare network is made under a spare's own name (`spare-<hex>`, the
//! TAP's alias) and handed to a hot fork by
//! [`crate::network::NetworkManager::hand_over`] together with the fork's
//! network record, under the address allocation lock; a fork that asked
//! for its own policy or no NIC gets none. A spare disk's folder is renamed
//! to the fork's folder inside the transaction that records the fork. A
//! spare is nobody's until it is taken: a graceful exit removes the
//! daemon's spares, and a restarted daemon removes an earlier one's
//! (start-up reconciliation kills the untaken primed processes and removes
//! the TAPs and rules no VM owns and the spares folder). When the last hot
//! fork launch under way ends, a refill runs in the background.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tine_proto::api::{CommitMode, ForkNetwork};

use super::daemon::{capped, remove_file_logged, Daemon};
use super::error::{chain, Error, Result};
use super::lifecycle::{remove_dir_logged, NewFolder};
use super::netattach::takes_group_network;
use super::snapshot::SnapshotFiles;
use super::spare_book::{ReadyVm, Released, SetAhead, SpareVm};
use super::supervise::identity_fixups;
use crate::config::HostGroup;
use crate::db::{CommitFilter, CommitRecord, VmRecord};
use crate::launcher::pool::new_slot_name;
use crate::launcher::{GuestStep, PrimeSpec, WarmUp, WriteSetCopy};
use crate::network::{NetMode, VmNetwork};
use crate::process::DISK_FILE;
use crate::secrets::SecretsDigest;
use crate::storage;

/// The folder of spare disks in the data directory, one folder per memory
/// commit in it.
pub const SPARES_DIR: &str = "spares";

/// What the spares should be.
#[derive(Default)]
struct Wanted {
    /// Networks per host group.
    networks: BTreeMap<String, u32>,
    /// The memory commits with a pool: each wants as many disks and
    /// primed VMs as its pool's size.
    commits: Vec<PooledCommit>,
}

/// What a hot fork took of its commit's spares.
pub(super) enum TakenSpare {
    /// A primed VM (the fork claims it once recorded).
    Vm(Box<SpareVm>),
    /// A loose disk.
    Disk(PathBuf),
}

/// The folder made for a spare disk (see [`Daemon::make_spare_disk`]),
/// which a fork takes as its own.
/// Whether a hot fork of `commit` asking for network `policy` can take a
/// primed VM: the commit's source had no NIC (so neither have its forks nor
/// its primed VMs), or it had one and the fork takes its group's network
/// as it is.
pub(super) fn takes_primed_vm(commit: &CommitRecord, policy: Option<&ForkNetwork>) -> bool {
    commit.has_nic != Some(true) || takes_group_network(policy)
}

/// A fork counted as waiting for a VM of `commit` being primed, until
/// dropped.
struct Awaiting<'a> {
    daemon: &'a Daemon,
    commit: &'a str,
}

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        self.daemon.spare_book().stop_awaiting(self.commit);
    }
}

fn spare_folder(disk: &Path) -> std::io::Result<&Path> {
    disk.parent()
        .filter(|f| !f.as_os_str().is_empty())
        .ok_or_else(|| std::io::Error::other("a spare disk outside any folder"))
}

/// Removes a spare disk and the folder made for it (with the files of a
/// VM primed on it), logging a failure.
fn remove_spare_disk(disk: &Path) {
    match spare_folder(disk) {
        Ok(folder) => remove_dir_logged(folder),
        Err(_) => remove_file_logged(disk),
    }
}

impl TakenSpare {
    /// The disk whose folder becomes the fork's folder by rename.
    pub fn disk(&self) -> &Path {
        match self {
            TakenSpare::Vm(vm) => &vm.disk,
            TakenSpare::Disk(disk) => disk,
        }
    }
}

/// A memory commit whose forks resume from a warm pool.
pub(super) struct PooledCommit {
    /// The commit.
    pub commit: CommitRecord,
    /// Its host group.
    pub group: HostGroup,
    /// Its pool size (more than 0).
    pub size: u32,
}

impl PooledCommit {
    /// Whether its forks have a NIC (its source had one; the group has a
    /// network, or its forks are refused).
    fn forks_have_nic(&self) -> bool {
        self.commit.has_nic == Some(true) && self.group.network.mode != NetMode::None
    }
}

impl Daemon {
    /// Where spare disks are made.
    pub(super) fn spares_dir(&self) -> PathBuf {
        self.data_dir.join(SPARES_DIR)
    }

    /// The memory commits that want a warm pool, each with its group (a
    /// commit of a group no longer configured has none) and size.
    pub(super) fn pooled_commits(&self) -> Result<Vec<PooledCommit>> {
        let filter = CommitFilter {
            mode: Some(CommitMode::Memory),
            ..CommitFilter::default()
        };
        let mut pooled = Vec::new();
        for commit in self.store.list_commits(&filter)? {
            let Ok(group) = self.group(&commit.host_group) else {
                continue;
            };
            let size = commit.hot_fork_pool.unwrap_or(group.hot_fork_pool);
            if size > 0 {
                pooled.push(PooledCommit {
                    group: group.clone(),
                    commit,
                    size,
                });
            }
        }
        Ok(pooled)
    }

    fn wanted_spares(&self) -> Result<Wanted> {
        let mut wanted = Wanted::default();
        for p in self.pooled_commits()? {
            if p.forks_have_nic() {
                *wanted.networks.entry(p.group.name.clone()).or_default() += p.size;
            }
            wanted.commits.push(p);
        }
        Ok(wanted)
    }

    /// Brings the spares to what the memory commits want: removes those
    /// no longer wanted and makes what is missing (one fill at a time). A
    /// spare that cannot be made is logged; forks then make their own.
    pub async fn fill_spares(self: &Arc<Self>) {
        let _one_at_a_time = self.spare_sizing.lock().await;
        let wanted = match self.wanted_spares() {
            Ok(w) => w,
            Err(e) => {
                tracing::error!("cannot size the spares: {}", chain(&e));
                return;
            }
        };
        let disk_counts = wanted
            .commits
            .iter()
            .map(|p| (p.commit.id.clone(), p.size))
            .collect();
        let released = self.spare_book().trim(&wanted.networks, &disk_counts);
        self.remove_spares(released).await;
        self.remove_unwanted_spare_folders(&disk_counts);
        for p in &wanted.commits {
            let id = &p.commit.id;
            let have = self.spare_book().disks_of(id);
            for _ in have..p.size as usize {
                match self.make_spare_disk(id, Path::new(&p.commit.disk)).await {
                    Ok(path) => self.spare_book().add_disk(id, path),
                    Err(e) => {
                        tracing::warn!(commit = %id, "cannot make a spare disk: {}", chain(&e));
                        break;
                    }
                }
            }
        }
        for (group, n) in &wanted.networks {
            let have = self.spare_book().networks_of(group);
            for _ in have..*n as usize {
                if let Err(e) = self.make_spare_network(group).await {
                    tracing::warn!(%group, "cannot make a spare network: {}", chain(&e));
                    break;
                }
            }
        }
        for p in &wanted.commits {
            self.prime_spare_vms(p).await;
        }
    }

    /// Primes VMs of `p`'s commit until it has its pool's size, each on a
    /// ready spare disk and (in a group with a NIC) network.
    async fn prime_spare_vms(&self, p: &PooledCommit) {
        let id = &p.commit.id;
        let files = match self.memory_snapshot_of(&p.commit) {
            Ok(files) => files,
            Err(e) => {
                tracing::warn!(commit = %id, "primes no VM: {}", chain(&e));
                return;
            }
        };
        let group = p.forks_have_nic().then_some(p.group.name.as_str());
        while self.spare_book().vms_of(id) < p.size as usize {
            let Some((disk, network)) = self.spare_book().begin_priming(id, group) else {
                return;
            };
            let folder = match spare_folder(&disk) {
                Ok(folder) => folder.to_path_buf(),
                Err(e) => {
                    self.priming_ended(&disk, None);
                    tracing::warn!(commit = %id, disk = %disk.display(), "cannot prime a VM: {e}");
                    return;
                }
            };
            let identity = match identity_fixups() {
                Ok(request) => Some(request),
                Err(e) => {
                    tracing::warn!(commit = %id, "a VM primed without its identity (its fork's set-up gives it): {}", chain(&e));
                    None
                }
            };
            // What the commit's forks inherit, as it is now; a fork
            // granted other secrets, or after one changed, syncs its own.
            let secrets = match self
                .secrets
                .files(&format!("a VM primed for {id}"), &p.commit.secrets)
            {
                Ok(files) => Some(files),
                Err(e) => {
                    tracing::warn!(commit = %id, "a VM primed without its secrets (its fork's set-up syncs them): {e}");
                    None
                }
            };
            let secrets_digest = secrets.as_deref().map(SecretsDigest::of);
            let spec = PrimeSpec {
                cpus: p.commit.cpus,
                ram_mib: p.commit.ram_bytes >> 20,
                state: files.state(),
                memory: files.memory(),
                disk: disk.clone(),
                folder,
                guest_network: network.as_ref().map(VmNetwork::agent_request),
                guest_identity: identity,
                guest_secrets: secrets,
                tap: network.map(|n| n.tap),
                write_set: Some(files.write_set()).filter(|w| w.is_file()),
                warm_agent: true,
            };
            match self.launcher.prime(&spec).await {
                Ok(primed) => {
                    let done = |step: GuestStep, what: &str| match step {
                        GuestStep::Done => true,
                        GuestStep::NotAsked => false,
                        // The guest's own words: capped, as stored reasons are.
                        GuestStep::Failed(why) => {
                            tracing::warn!(
                                commit = %id,
                                "a primed VM's agent did not set its {what} (its fork's set-up will): {}",
                                capped(&why)
                            );
                            false
                        }
                    };
                    let ready = ReadyVm {
                        process: primed.name,
                        set_ahead: SetAhead {
                            network: done(primed.guest_network, "network"),
                            identity: done(primed.guest_identity, "identity"),
                            secrets: secrets_digest
                                .filter(|_| done(primed.guest_secrets, "secrets")),
                        },
                    };
                    self.priming_ended(&disk, Some(ready));
                    self.write_set_copied(id, &files, primed.write_set);
                    match primed.warm_up {
                        WarmUp::NotAsked => {}
                        WarmUp::Answered(ms) => {
                            tracing::debug!(commit = %id, ms, "a primed VM's agent answered")
                        }
                        WarmUp::NoAnswer(why) => tracing::warn!(
                            commit = %id,
                            "a primed VM's agent did not answer (its fork's will, later): {why}"
                        ),
                    }
                }
                Err(e) => {
                    self.priming_ended(&disk, None);
                    tracing::warn!(commit = %id, "cannot prime a VM: {}", chain(&e));
                    return;
                }
            }
        }
    }

    /// The priming of the VM on `disk` ended ([`SpareBook::end_priming`]);
    /// the forks waiting for one are told.
    fn priming_ended(&self, disk: &Path, ready: Option<ReadyVm>) {
        self.spare_book().end_priming(disk, ready);
        self.priming_ended.notify_waiters();
    }

    /// When no VM of `commit` is primed but one is being primed that no
    /// other fork waits for, waits until its priming ends (at most
    /// [`Deadlines::priming_wait`](super::daemon::Deadlines::priming_wait)),
    /// so that the fork takes it: a fork restored into
    /// another process would do most of the priming's work again, beside
    /// it, and then its whole set-up. Back-to-back forks with a pool of
    /// one each find the VM primed after the one before being primed.
    pub(super) async fn await_priming(&self, commit: &str) {
        if !self.spare_book().await_priming(commit) {
            return;
        }
        // No longer waiting however this ends (the request may be dropped).
        let _awaiting = Awaiting {
            daemon: self,
            commit,
        };
        let began = std::time::Instant::now();
        let wait = self.deadlines.priming_wait;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let ended = self.priming_ended.notified();
            tokio::pin!(ended);
            // Registered before the book is read: an end in between is
            // not missed.
            ended.as_mut().enable();
            if self.spare_book().priming_settled(commit) {
                break;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                tracing::debug!(%commit, "no VM primed within {wait:?}: the fork restores");
                break;
            }
        }
        tracing::debug!(%commit, waited_ms = began.elapsed().as_millis() as u64, "waited for a VM being primed");
    }

    /// Logs what copying `commit`'s write set into a VM did, and removes
    /// a write set its VMM refused (the next fork saves another).
    pub(super) fn write_set_copied(&self, commit: &str, files: &SnapshotFiles, copy: WriteSetCopy) {
        match copy {
            WriteSetCopy::NotAsked => {}
            WriteSetCopy::Copied(bytes) => {
                tracing::debug!(%commit, bytes, "a VM copied the commit's write set in")
            }
            WriteSetCopy::Refused(why) => {
                tracing::warn!(
                    %commit,
                    "its write set was refused and is removed (its next hot fork saves another): {why}"
                );
                remove_file_logged(&files.write_set());
            }
            WriteSetCopy::Failed(why) => {
                tracing::warn!(%commit, "a VM goes on without the commit's write set: {why}")
            }
        }
    }

    /// The same in the background (once no hot fork is being launched: a
    /// refill during a launch would compete with it for the CPU and the
    /// disk's syncs). Called outside a runtime (one shutting down), there
    /// is nobody to refill for.
    pub(super) fn refresh_spares(self: &Arc<Self>) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let daemon = self.clone();
            runtime.spawn(async move { daemon.fill_spares().await });
        }
    }

    /// Removes every spare (the daemon is going away).
    pub async fn drain_spares(self: &Arc<Self>) {
        let _one_at_a_time = self.spare_sizing.lock().await;
        let released = self.spare_book().trim(&BTreeMap::new(), &BTreeMap::new());
        self.remove_spares(released).await;
        let dir = self.spares_dir();
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!("cannot remove {}: {e}", dir.display())
            }
            _ => {}
        }
    }

    async fn remove_spares(self: &Arc<Self>, released: Released) {
        if released.is_empty() {
            return;
        }
        let this = self.clone();
        let removed = tokio::task::spawn_blocking(move || {
            for vm in &released.vms {
                this.launcher.discard_primed(&vm.process);
            }
            let vms = released.vms.iter();
            let networks = vms.clone().filter_map(|v| v.network.as_ref());
            for n in released.networks.iter().chain(networks) {
                if let Err(e) = this.network.detach(n) {
                    tracing::warn!(tap = %n.tap, "cannot remove a spare network: {e}");
                }
            }
            for d in released.disks.iter().chain(vms.map(|v| &v.disk)) {
                remove_spare_disk(d);
            }
        })
        .await;
        if let Err(e) = removed {
            tracing::error!("removing spares ended early: {e}");
        }
    }

    /// Removes the (empty) spare folders of commits that want none.
    fn remove_unwanted_spare_folders(&self, wanted: &BTreeMap<String, u32>) {
        let Ok(entries) = std::fs::read_dir(self.spares_dir()) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !wanted.contains_key(&name) {
                if let Err(err) = std::fs::remove_dir(e.path()) {
                    tracing::warn!("cannot remove {}: {err}", e.path().display());
                }
            }
        }
    }

    /// A spare disk for `commit`, in a folder of its own that a fork takes
    /// as its folder by one rename: the folder, its disk and its name in
    /// the commit's spares folder are on stable storage when this returns,
    /// so that the fork has only its new name to sync.
    async fn make_spare_disk(&self, commit: &str, commit_disk: &Path) -> Result<PathBuf> {
        let commit_dir = self.spares_dir().join(commit);
        let dir = commit_dir.join(new_slot_name());
        let path = dir.join(DISK_FILE);
        let commit_disk = commit_disk.to_path_buf();
        tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir).map_err(|e| Error::io("create a spare's folder", e))?;
            let made = storage::fork_disk(&commit_disk, &path)
                .and_then(|()| storage::sync_disk(&path))
                .map_err(|e| Error::disk("make a spare disk", e))
                .and_then(|()| {
                    storage::sync_dir(&commit_dir)
                        .map_err(|e| Error::io("sync the spares folder", e))
                });
            if let Err(e) = made {
                remove_spare_disk(&path);
                return Err(e);
            }
            Ok(path)
        })
        .await
        .map_err(|source| Error::Task {
            what: "make a spare disk",
            source,
        })?
    }

    async fn make_spare_network(self: &Arc<Self>, group: &str) -> Result<()> {
        let cfg = self.group(group)?.network.clone();
        let name = format!("spare-{}", &new_slot_name()[..6]);
        let fail = |source| Error::Network {
            vm: name.clone(),
            source,
        };
        let planned = {
            let _one = self.allocate.lock().unwrap_or_else(|p| p.into_inner());
            let mut in_use: Vec<Ipv4Addr> = self
                .store
                .list_vms(Some(group))?
                .iter()
                .filter_map(|v| v.network.as_ref())
                .map(|n| n.address)
                .collect();
            in_use.extend(self.spare_book().addresses(group));
            let Some(planned) = self
                .network
                .plan(group, &cfg, &name, &in_use, None)
                .map_err(fail)?
            else {
                return Ok(());
            };
            self.spare_book().making(planned.clone());
            planned
        };
        let this = self.clone();
        let spare = planned.clone();
        let made = tokio::task::spawn_blocking(move || {
            let made = this
                .network
                .ensure(&spare)
                .and_then(|()| this.network.set_quarantine(&spare, true));
            if made.is_err() {
                if let Err(e) = this.network.detach(&spare) {
                    tracing::warn!(tap = %spare.tap, "undo a spare network: {e}");
                }
            }
            made
        })
        .await;
        let made = match made {
            Ok(made) => made.map_err(fail),
            Err(source) => Err(Error::Task {
                what: "make a spare network",
                source,
            }),
        };
        self.spare_book().made(&planned.tap, made.is_ok());
        made
    }

    /// A spare network for a hot fork's first start, handed over and
    /// recorded as the fork's (`None`: no spare fits, the fork attaches
    /// its own). A fork with its own policy or without a NIC takes none.
    pub(super) fn take_spare_network(
        self: &Arc<Self>,
        group: &HostGroup,
        vm: &VmRecord,
    ) -> Result<Option<VmNetwork>> {
        if group.network.mode == NetMode::None
            || vm.network.is_some()
            || !takes_group_network(vm.policy.as_ref())
        {
            return Ok(None);
        }
        let Some(spare) = self.spare_book().take_network(&group.name) else {
            return Ok(None);
        };
        self.hand_over_network(vm, spare)
    }

    /// Hands `spare` over to `vm` and records it as `vm`'s network (under
    /// the address allocation lock); `None` when the hand-over failed (the
    /// spare is removed; the VM attaches its own).
    pub(super) fn hand_over_network(
        &self,
        vm: &VmRecord,
        spare: VmNetwork,
    ) -> Result<Option<VmNetwork>> {
        let taken = {
            let _one = self.allocate.lock().unwrap_or_else(|p| p.into_inner());
            let taken = match self.network.hand_over(&spare, &vm.hostname) {
                Ok(taken) => taken,
                Err(e) => {
                    tracing::warn!(vm = %vm.hostname, tap = %spare.tap, "cannot take a spare network: {e}");
                    if let Err(e) = self.network.detach(&spare) {
                        tracing::warn!(tap = %spare.tap, "cannot remove a spare network: {e}");
                    }
                    return Ok(None);
                }
            };
            if let Err(e) = self.store.set_network(&vm.hostname, Some(&taken)) {
                if let Err(undo) = self.network.detach(&taken) {
                    tracing::warn!(vm = %vm.hostname, "cannot remove a taken spare network: {undo}");
                }
                return Err(e.into());
            }
            taken
        };
        Ok(Some(taken))
    }

    /// What a hot fork of `commit` asking for network `policy` takes of
    /// its spares: a primed VM when it fits (the commit's source had no
    /// NIC, so neither have its forks nor its primed VMs; or it had one and
    /// the fork takes its group's network as it is), else (or when none is
    /// ready) a loose disk; the caller renames its disk into place
    /// ([`Daemon::fork_disk_from`]).
    pub(super) fn take_spare(
        &self,
        commit: &CommitRecord,
        policy: Option<&ForkNetwork>,
    ) -> Option<TakenSpare> {
        let mut book = self.spare_book();
        if takes_primed_vm(commit, policy) {
            if let Some(vm) = book.take_vm(&commit.id) {
                return Some(TakenSpare::Vm(Box::new(vm)));
            }
        }
        book.take_disk(&commit.id).map(TakenSpare::Disk)
    }

    /// A fork's folder `dir` with its disk: the folder of `spare` (made in
    /// advance on the same commit, its disk named as a VM's) renamed into
    /// place, or else a new folder with a new overlay on `commit`. A primed
    /// VM whose folder was renamed is claimed for the fork; one that cannot
    /// be used is removed. Returns which of the two it did.
    pub(super) fn fork_disk_from(
        &self,
        spare: Option<TakenSpare>,
        commit: &Path,
        vm: &VmRecord,
        dir: &Path,
    ) -> Result<NewFolder> {
        if let Some(spare) = spare {
            match spare_folder(spare.disk()).and_then(|folder| std::fs::rename(folder, dir)) {
                Ok(()) => {
                    if let TakenSpare::Vm(primed) = spare {
                        self.spare_book().claim(&vm.hostname, *primed);
                    }
                    return Ok(NewFolder::Renamed);
                }
                Err(e) => {
                    tracing::warn!("cannot use the spare disk {}: {e}", spare.disk().display());
                    self.release_taken(spare);
                }
            }
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create VM folder", e))?;
        storage::fork_disk(commit, Path::new(&vm.disk)).map_err(|e| Error::disk("fork disk", e))?;
        Ok(NewFolder::Made)
    }

    /// Removes a spare that was taken but that no fork holds.
    pub(super) fn release_taken(&self, spare: TakenSpare) {
        match spare {
            TakenSpare::Disk(disk) => remove_spare_disk(&disk),
            TakenSpare::Vm(vm) => {
                self.release_primed(&vm);
                remove_spare_disk(&vm.disk);
            }
        }
    }

    /// Stops the primed VM fork `hostname` claimed, if it has not resumed
    /// it (the fork failed to be recorded, or was deleted before its
    /// launch), and removes its network; its disk is the fork's.
    pub(super) fn release_claimed(&self, hostname: &str) {
        if let Some(vm) = self.spare_book().unclaim(hostname) {
            self.release_primed(&vm);
        }
    }

    fn release_primed(&self, vm: &SpareVm) {
        self.launcher.discard_primed(&vm.process);
        if let Some(n) = &vm.network {
            if let Err(e) = self.network.detach(n) {
                tracing::warn!(tap = %n.tap, "cannot remove a spare network: {e}");
            }
        }
    }
}
