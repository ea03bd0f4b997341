//! Spares: what a hot fork needs besides a pre-started VMM, made ahead of
//! it so that the fork's own path runs no `nft`, creates no TAP and writes
//! no disk: per host group with a NIC, networks (TAP made, its rules in
//! place, its address reserved, in quarantine), and per memory commit,
//! overlay disks on the commit's disk (made and synced). A memory commit
//! wants as many of each as its warm pool (its own `hot_fork_pool`, or its
//! group's); a group as many networks as its largest such pool.
//!
//! A spare network is attached under a spare's own name (`spare-<hex>`, the
//! TAP's alias) and handed to a hot fork by
//! [`crate::network::NetworkManager::hand_over`] together with the fork's
//! network record, under the address allocation lock; a fork that asked
//! for its own policy or no NIC gets none. A spare disk is renamed into
//! the fork's folder inside the transaction that records the fork. A
//! spare is nobody's until it is taken: a graceful exit removes the
//! daemon's spares, and a restarted daemon removes an earlier one's
//! (start-up reconciliation removes the TAPs and rules no VM owns and the
//! spares folder). Each hot fork's launch ends with a refill in the
//! background.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tine_proto::api::{CommitMode, ForkNetwork};

use super::daemon::{remove_file_logged, Daemon};
use super::error::{chain, Error, Result};
use super::netattach::override_of;
use super::spare_book::Released;
use crate::config::HostGroup;
use crate::db::{CommitFilter, CommitRecord, VmRecord};
use crate::launcher::pool::new_slot_name;
use crate::network::{NetMode, VmNetwork};
use crate::storage;

/// The folder of spare disks in the data directory, one folder per memory
/// commit in it.
pub const SPARES_DIR: &str = "spares";

/// What the spares should be.
#[derive(Debug, Default)]
struct Wanted {
    /// Networks per host group.
    networks: BTreeMap<String, u32>,
    /// Disks per memory commit, with the commit's disk.
    disks: BTreeMap<String, (PathBuf, u32)>,
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
            if p.group.network.mode != NetMode::None {
                let n = wanted.networks.entry(p.group.name.clone()).or_default();
                *n = p.size.max(*n);
            }
            wanted
                .disks
                .insert(p.commit.id.clone(), (PathBuf::from(&p.commit.disk), p.size));
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
            .disks
            .iter()
            .map(|(id, (_, n))| (id.clone(), *n))
            .collect();
        let released = self.spare_book().trim(&wanted.networks, &disk_counts);
        self.remove_spares(released).await;
        self.remove_unwanted_spare_folders(&disk_counts);
        for (id, (commit_disk, n)) in &wanted.disks {
            let have = self.spare_book().disks_of(id);
            for _ in have..*n as usize {
                match self.make_spare_disk(id, commit_disk).await {
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
    }

    /// The same in the background (once a hot fork that took spares was
    /// launched: a refill during its launch would compete with it for the
    /// CPU and the disk's syncs).
    pub(super) fn refresh_spares(self: &Arc<Self>) {
        let daemon = self.clone();
        tokio::spawn(async move { daemon.fill_spares().await });
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
        if released.networks.is_empty() && released.disks.is_empty() {
            return;
        }
        let this = self.clone();
        let removed = tokio::task::spawn_blocking(move || {
            for n in &released.networks {
                if let Err(e) = this.network.detach(n) {
                    tracing::warn!(tap = %n.tap, "cannot remove a spare network: {e}");
                }
            }
            for d in &released.disks {
                remove_file_logged(d);
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

    async fn make_spare_disk(&self, commit: &str, commit_disk: &Path) -> Result<PathBuf> {
        let dir = self.spares_dir().join(commit);
        let path = dir.join(format!("{}.qcow2", new_slot_name()));
        let commit_disk = commit_disk.to_path_buf();
        tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&dir).map_err(|e| Error::io("create the spares folder", e))?;
            let made =
                storage::fork_disk(&commit_disk, &path).and_then(|()| storage::sync_disk(&path));
            if let Err(e) = made {
                remove_file_logged(&path);
                return Err(Error::disk("make a spare disk", e));
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
    /// recorded as the fork's (the launch refills the spares once it ends) (`None`: no spare fits, the fork attaches its
    /// own). A fork with its own policy or without a NIC takes none.
    pub(super) fn take_spare_network(
        self: &Arc<Self>,
        group: &HostGroup,
        vm: &VmRecord,
    ) -> Result<Option<VmNetwork>> {
        if group.network.mode == NetMode::None
            || vm.network.is_some()
            || vm.policy == Some(ForkNetwork::None)
            || override_of(vm).is_some()
        {
            return Ok(None);
        }
        let taken = {
            let _one = self.allocate.lock().unwrap_or_else(|p| p.into_inner());
            let Some(spare) = self.spare_book().take_network(&group.name) else {
                return Ok(None);
            };
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

    /// A spare disk of memory commit `commit`, if one is ready; the caller
    /// renames it into place ([`fork_disk_from`]).
    pub(super) fn take_spare_disk(&self, commit: &str) -> Option<PathBuf> {
        self.spare_book().take_disk(commit)
    }
}

/// A fork's disk at `disk`: `spare` (an overlay made in advance on the
/// same commit) renamed into place, or else a new overlay on `commit`.
pub(super) fn fork_disk_from(spare: Option<PathBuf>, commit: &Path, disk: &Path) -> Result<()> {
    if let Some(spare) = spare {
        match std::fs::rename(&spare, disk) {
            Ok(()) => return Ok(()),
            Err(e) => {
                tracing::warn!("cannot use the spare disk {}: {e}", spare.display());
                remove_file_logged(&spare);
            }
        }
    }
    storage::fork_disk(commit, disk).map_err(|e| Error::disk("fork disk", e))
}
