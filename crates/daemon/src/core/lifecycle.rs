//! A VM's life cycle: create (record, disk, boot queued for a slot),
//! shutdown, relaunch, delete, tags, and describe/list.
//!
//! Every change is recorded in the store before files or processes are
//! touched and after they are done, so start-up reconciliation can finish
//! or undo whatever a `kill -9` interrupted.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_proto::agent::ShutdownAction as AgentShutdown;
use tine_proto::api::{self, CreateVmRequest, ShutdownAction, StopMode, VmState, Wait};
use tine_proto::vmm::Request as VmmRequest;

use super::daemon::{sync_disk_off_thread, Daemon};
use super::error::{chain, Error, Result};
use super::netattach::describe as describe_network;
use super::plan;
use super::supervise::DiskSynced;
use crate::artifacts;
use crate::db::{NewVm, VmRecord};
use crate::failpoint::{self, Failpoint};
use crate::launcher::{Instance, LauncherExt};
use crate::process::{VmPaths, DISK_FILE};
use crate::storage;

/// How long a graceful shutdown waits before killing.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(20);

/// Removes a folder and what it holds, logging a failure.
pub(super) fn remove_dir_logged(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("cannot remove {}: {e}", dir.display());
        }
    }
}

/// How a new VM's folder came to be, which says what of it still has to
/// reach stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NewFolder {
    /// Made on the VM's path: its disk file and its folder are new.
    Made,
    /// A spare's folder, made and synced ahead, renamed into `vms/`: only
    /// its name there is new.
    Renamed,
}

impl Daemon {
    /// Starts syncing a new VM's disk on other threads (`folder` says
    /// what is new: see [`NewFolder`]); the future says when the disk and
    /// its folder's name are on stable storage. New VMs share their syncs
    /// of `vms/`: a burst of forks costs one or two, not one each.
    pub(super) fn sync_disk_soon(&self, disk: &str, folder: NewFolder) -> DiskSynced {
        let disk = PathBuf::from(disk);
        let vms_dir = self.vms_dir_sync.clone();
        let syncing = tokio::spawn(async move {
            if folder == NewFolder::Made {
                sync_disk_off_thread(disk, "sync the new disk").await?;
            }
            vms_dir
                .sync()
                .await
                .map_err(|e| Error::io("sync the VM's folder into vms/", e))
        });
        Box::pin(async move {
            syncing.await.map_err(|source| Error::Task {
                what: "sync disk",
                source,
            })?
        })
    }
}

impl Daemon {
    /// Describes a VM for the API.
    pub fn describe(&self, vm: &VmRecord) -> api::VmInfo {
        let (size, allocated, format) = storage::describe(Path::new(&vm.disk));
        let group = self.config.group(&vm.host_group);
        let network = describe_network(vm, group.map(|g| &g.network));
        api::VmInfo {
            hostname: vm.hostname.clone(),
            host_group: vm.host_group.clone(),
            status: if self.is_paused(vm) {
                api::VmStatus::Paused
            } else {
                vm.state.into()
            },
            state: vm.state,
            cpus: vm.cpus,
            ram_bytes: vm.ram_bytes,
            persistent: vm.persistent,
            tags: vm.tags.clone(),
            secrets: vm.secrets.clone(),
            ip: network
                .address
                .as_ref()
                .map(|a| a.split('/').next().unwrap_or_default().to_owned()),
            arch: api::go_arch().into(),
            image: group.map(|g| g.image.clone()).unwrap_or_default(),
            network,
            pid: if vm.state.is_live() { vm.pid } else { None },
            reason: vm.reason.clone(),
            stop_mode: if vm.state.is_live() {
                None
            } else {
                vm.stop_mode
            },
            created_at: api::rfc3339_millis(vm.created_ms),
            started_at: vm.started_ms.map(api::rfc3339_millis),
            boot_ms: vm.boot_ms,
            commit_id: vm.commit_id.clone(),
            parent_commit_id: vm.parent_commit_id.clone(),
            storage: api::StorageKind::Image,
            disk: api::StorageInfo {
                path: vm.disk.clone(),
                format,
                size_bytes: size,
                allocated_bytes: allocated,
            },
            memory: None,
        }
    }

    /// Creates a VM in `group` and starts it; the work finishes even if the
    /// caller goes away. With [`Wait::Agent`] it answers once the agent is
    /// ready.
    pub async fn create_vm(
        self: &Arc<Self>,
        group: &str,
        req: CreateVmRequest,
        wait: Wait,
        timeout: Duration,
        managed: bool,
    ) -> Result<api::CreateVmResponse> {
        let started = Instant::now();
        let group = self.group(group)?.clone();
        let name_taken = match &req.name {
            Some(n) => self.store.find_vm(n)?.is_some(),
            None => false,
        };
        let mut new = plan::create(&group, &req, name_taken, managed, || {
            group.userdata().map_err(Error::from)
        })?;
        self.check_grants(&new.secrets)?;
        if let Some(user) = req.import_user.clone() {
            let template = self
                .config
                .import_keys_url
                .clone()
                .unwrap_or_else(|| crate::ssh_keys::DEFAULT_IMPORT_URL.to_owned());
            let keys =
                tokio::task::spawn_blocking(move || crate::ssh_keys::import(&template, &user))
                    .await
                    .map_err(|source| Error::Task {
                        what: "import SSH keys",
                        source,
                    })??;
            new.ssh_keys.extend(keys);
            crate::ssh_keys::check(&new.ssh_keys)?;
        }
        let this = self.clone();
        let image = group.image.clone();
        let size = group.storage_bytes().map_err(|e| {
            Error::BadRequest(format!("storage of host group `{}`: {e}", group.name))
        })?;
        let group_name = group.name.clone();
        let job = tokio::spawn(async move {
            let this2 = this.clone();
            let base = tokio::task::spawn_blocking(move || {
                let _one = this2.imports.lock().unwrap_or_else(|p| p.into_inner());
                artifacts::image_base(&this2.store, &image, &this2.data_dir)
            })
            .await
            .map_err(|source| Error::Task {
                what: "import image",
                source,
            })??;
            if let Some(disk) = size.filter(|s| *s < base.size_bytes) {
                return Err(Error::BadRequest(format!(
                    "image `{}` ({} MiB) is too large for the disk size of host group `{}` \
                     ({} MiB); raise its storage_size",
                    base.name,
                    base.size_bytes.div_ceil(1 << 20),
                    group_name,
                    disk >> 20
                )));
            }
            let base = PathBuf::from(&base.path);
            this.provision(&new, move |vm: &VmRecord| {
                storage::create_disk(&base, Path::new(&vm.disk), size)
                    .map_err(|e| Error::disk("create disk", e))
            })
            .await
        });
        let hostname = job.await.map_err(|source| Error::Task {
            what: "create",
            source,
        })??;
        let vm = match wait {
            Wait::Agent => self.wait_running(&hostname, timeout).await?,
            Wait::None => self.vm(&hostname)?,
        };
        let info = self.describe(&vm);
        Ok(api::CreateVmResponse {
            hostname,
            host_group: info.host_group,
            state: vm.state,
            ip: info.ip,
            created_at: info.created_at,
            arch: info.arch,
            elapsed_ms: started.elapsed().as_millis() as u64,
        })
    }

    /// Records a new VM and makes its folder and disk with `make_disk` in
    /// one transaction (see [`Daemon::record_new`]), then queues its boot.
    pub(super) async fn provision(
        self: &Arc<Self>,
        new: &NewVm,
        make_disk: impl FnOnce(&VmRecord) -> Result<()>,
    ) -> Result<String> {
        let vm = self.record_new(new, |vm, dir| {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create VM folder", e))?;
            make_disk(vm)
        })?;
        self.spawn_boot(&vm.hostname);
        Ok(vm.hostname)
    }

    /// Records a new VM `starting` and has `make_folder` put its folder
    /// (the path it is given, which does not exist yet) with its disk in
    /// place, in one transaction (see `Store::insert_vm_with`); on any
    /// failure it leaves nothing behind (no record, files or network).
    /// `make_folder` runs with the store locked: it writes a few KiB (an
    /// overlay) or renames a spare's folder, never copies an image.
    pub(super) fn record_new(
        &self,
        new: &NewVm,
        make_folder: impl FnOnce(&VmRecord, &Path) -> Result<()>,
    ) -> Result<VmRecord> {
        let data_dir = self.data_dir.clone();
        let vm = self.store.insert_vm_with(
            new,
            |h| {
                VmPaths::new(&data_dir, h)
                    .dir
                    .join(DISK_FILE)
                    .display()
                    .to_string()
            },
            |vm| {
                let dir = VmPaths::new(&data_dir, &vm.hostname).dir;
                if let Err(e) = make_folder(vm, &dir) {
                    // Still under the store's lock: no other VM can have
                    // been given this hostname (and folder) yet.
                    remove_dir_logged(&dir);
                    return Err(e);
                }
                failpoint::hit(Failpoint::ProvisionDiskMade);
                Ok::<(), Error>(())
            },
        )?;
        failpoint::hit(Failpoint::ProvisionRecorded);
        self.notify(&vm.hostname);
        Ok(vm)
    }

    /// Removes every trace of a VM (record, files, network).
    pub(super) async fn discard(&self, hostname: &str) {
        match self.store.find_vm(hostname) {
            Ok(Some(vm)) => {
                self.release_network(&vm);
                if let (Some(pid), Some(pid_start)) = (vm.pid, vm.pid_start) {
                    self.launcher.kill(hostname, Instance { pid, pid_start });
                }
            }
            Ok(None) => {}
            Err(e) => tracing::error!(vm = hostname, "cannot read its record: {}", chain(&e)),
        }
        self.forget_logged(hostname);
        self.notify(hostname);
    }

    /// Queues the VM's boot: it is `starting` (without a process) at once,
    /// and its tine-vmm is launched when a boot slot is free
    /// (`boot_concurrency`): a storm of creates boots a few at a time
    /// instead of starving every guest.
    pub(super) fn queue_boot(self: &Arc<Self>, hostname: &str) -> Result<()> {
        self.store.queue_start(hostname)?;
        self.notify(hostname);
        self.spawn_boot(hostname);
        Ok(())
    }

    /// Launches a VM recorded `starting` without a process once one of the
    /// `boot_concurrency` boot slots is free (a storm of boots does not
    /// starve every guest; the slot is held until its agent is ready),
    /// after its disk reached stable storage (a fork's disk is made
    /// without syncs: see `storage::fork_disk`). An unborn hot fork queued
    /// here (again, by a restarted daemon) resumes instead, its disk
    /// synced while it resumes and is set up (see `launch_hot_fork`). A
    /// hot fork's first launch does not come here: it takes no slot and
    /// runs in its request's own task (see `Daemon::launch_new_hot_fork`).
    pub(super) fn spawn_boot(self: &Arc<Self>, hostname: &str) {
        let this = self.clone();
        let h = hostname.to_owned();
        tokio::spawn(async move {
            let permit = this.boot_slots.clone().acquire_owned().await.ok();
            let _guard = this.lock_vm(&h).await;
            let vm = match this.still_unlaunched(&h) {
                Ok(Some(vm)) => vm,
                Ok(None) => return,
                Err(e) => {
                    tracing::error!(vm = %h, "cannot read its record to launch it: {}", chain(&e));
                    return;
                }
            };
            let launched = async {
                // An unborn fork of a memory commit resumes it.
                let snapshot = this.hot_fork_snapshot(&vm)?;
                let disk_synced = this.sync_disk_soon(&vm.disk, NewFolder::Made);
                match snapshot {
                    // A restore does not need its disk on stable storage,
                    // only a born fork does: the sync goes on while the
                    // guest resumes and is set up.
                    Some(files) => this
                        .launch_hot_fork(&vm, permit, &files, disk_synced)
                        .await
                        .map(drop),
                    None => {
                        disk_synced.await?;
                        failpoint::hit(Failpoint::BootDiskSynced);
                        this.launch(&h, permit)
                    }
                }
            }
            .await;
            if let Err(e) = launched {
                this.launch_failed(&h, &e);
            }
        });
    }

    /// The record of `hostname` (whose lock the caller holds) if it still
    /// waits for its launch: `starting` without a process. Deleted or
    /// stopped while it waited: none, and a primed VM it claimed goes back.
    pub(super) fn still_unlaunched(&self, hostname: &str) -> Result<Option<VmRecord>> {
        match self.store.find_vm(hostname)? {
            Some(vm) if vm.state == VmState::Starting && vm.pid.is_none() => Ok(Some(vm)),
            _ => {
                self.release_claimed(hostname);
                Ok(None)
            }
        }
    }

    /// A queued VM could not be launched (`error` says why): a fork is
    /// removed (its waiter learns why), any other VM is recorded as failed
    /// with the reason. Returns the reason.
    pub(super) fn launch_failed(&self, hostname: &str, error: &Error) -> String {
        let reason = chain(error);
        tracing::warn!(vm = hostname, "launch: {reason}");
        match self.store.find_vm(hostname) {
            Ok(Some(vm)) => {
                self.release_network(&vm);
                if vm.is_unborn_fork() {
                    self.remember_failure(hostname, &reason);
                    self.forget_logged(hostname);
                } else {
                    self.record_exit(hostname, VmState::Failed, &reason, StopMode::Crashed);
                }
                self.notify(hostname);
            }
            Ok(None) => {}
            Err(e) => tracing::error!(vm = hostname, "cannot read its record: {}", chain(&e)),
        }
        reason
    }

    /// Stops a VM. Graceful: the agent is asked to power the guest off (it
    /// stops every process, syncs, remounts `/` read-only), or, when it does
    /// not take the request, Ctrl-Alt-Del is pressed (the min image's init
    /// takes it as the same request); a guest still running after `timeout`
    /// is killed. `poweroff` kills at once. A kill is recorded as
    /// [`StopMode::Forced`]: writes the guest had not synced may be lost.
    /// A suspended VM is restored first, so its guest can stop cleanly;
    /// `poweroff` discards its memory instead (forced).
    pub async fn shutdown(
        self: &Arc<Self>,
        key: &str,
        action: ShutdownAction,
        timeout: Duration,
    ) -> Result<api::LifecycleResponse> {
        let began = Instant::now();
        let poweroff = action == ShutdownAction::Poweroff;
        let hostname = self.vm(key)?.hostname;
        let vm = {
            let _guard = self.lock_vm(&hostname).await;
            let mut vm = self.vm(&hostname)?;
            if vm.state == VmState::Suspended && poweroff {
                self.discard_suspended(&vm, "powered off while suspended")?;
                return Ok(api::LifecycleResponse {
                    hostname,
                    state: VmState::Stopped,
                    stop_mode: Some(StopMode::Forced),
                    elapsed_ms: began.elapsed().as_millis() as u64,
                    message: None,
                    disk_removed: None,
                });
            }
            if vm.state == VmState::Suspended {
                self.restore_suspended(&vm).await?;
                vm = self.vm(&hostname)?;
            }
            if !vm.state.is_live() {
                return Err(Error::Conflict(format!(
                    "{hostname} is already {}",
                    vm.state
                )));
            }
            if !poweroff {
                // A paused guest cannot take the request to stop.
                self.unpause_for_stop(&vm).await;
            }
            if vm.pid.is_none() {
                // Still waiting for a boot slot: it never ran.
                if vm.persistent {
                    self.store.clear_process(
                        &hostname,
                        VmState::Stopped,
                        Some("stopped before it was launched"),
                        Some(StopMode::Graceful),
                    )?;
                } else {
                    self.forget(&hostname)?;
                }
                self.notify(&hostname);
                return Ok(api::LifecycleResponse {
                    hostname,
                    state: VmState::Stopped,
                    stop_mode: Some(StopMode::Graceful),
                    elapsed_ms: began.elapsed().as_millis() as u64,
                    message: None,
                    disk_removed: None,
                });
            }
            self.store.transition(
                &hostname,
                &[VmState::Starting, VmState::Running, VmState::Stopping],
                VmState::Stopping,
                None,
            )?;
            self.notify(&hostname);
            vm
        };
        let mode = self.stop_process(&vm, poweroff, timeout).await;
        // As recorded (a guest can crash on its way down); an ephemeral VM
        // is gone with its record.
        let (state, mode) = match self.store.find_vm(&hostname)? {
            Some(v) => (v.state, v.stop_mode.unwrap_or(mode)),
            None => (VmState::Stopped, mode),
        };
        Ok(api::LifecycleResponse {
            hostname,
            state,
            stop_mode: Some(mode),
            elapsed_ms: began.elapsed().as_millis() as u64,
            message: None,
            disk_removed: None,
        })
    }

    /// Asks the process to stop (see [`Daemon::shutdown`]) and waits for the
    /// exit handler to run; returns whether the stop was graceful or forced.
    async fn stop_process(
        self: &Arc<Self>,
        vm: &VmRecord,
        poweroff: bool,
        timeout: Duration,
    ) -> StopMode {
        let (Some(pid), Some(pid_start)) = (vm.pid, vm.pid_start) else {
            return StopMode::Graceful;
        };
        let hostname = vm.hostname.as_str();
        let deadline = tokio::time::Instant::now() + timeout;
        if poweroff {
            self.mark_forced(
                hostname,
                "forced stop (action=poweroff): killed; writes the guest had not synced may be lost"
                    .into(),
            );
            self.vmm_request(hostname, VmmRequest::Kill).await;
        } else {
            match self
                .ask_agent_to_power_off(hostname, timeout.min(self.deadlines.shutdown_ask))
                .await
            {
                Ok(()) => tracing::info!(vm = hostname, "the agent is powering the guest off"),
                Err(e) => {
                    tracing::info!(
                        vm = hostname,
                        "agent shutdown: {}; pressing Ctrl-Alt-Del",
                        chain(&e)
                    );
                    self.vmm_request(hostname, VmmRequest::Shutdown).await;
                }
            }
        }
        if self.wait_not_live_until(hostname, deadline).await {
            return if poweroff {
                StopMode::Forced
            } else {
                StopMode::Graceful
            };
        }
        tracing::warn!(vm = hostname, "did not stop within {timeout:?}; killing it");
        self.mark_forced(
            hostname,
            format!(
                "forced stop: the guest did not power off within {}; killed, writes it had not \
                 synced may be lost",
                humantime::format_duration(timeout)
            ),
        );
        self.vmm_request(hostname, VmmRequest::Kill).await;
        if !self.wait_not_live(hostname, Duration::from_secs(5)).await {
            self.launcher.kill(hostname, Instance { pid, pid_start });
            self.wait_not_live(hostname, Duration::from_secs(5)).await;
        }
        StopMode::Forced
    }

    /// Asks the VM's agent to shut the guest down cleanly, within `within`.
    async fn ask_agent_to_power_off(&self, hostname: &str, within: Duration) -> Result<()> {
        let ask = async {
            let client = self.connect_agent(hostname).await?;
            client
                .shutdown(AgentShutdown::Poweroff)
                .await
                .map_err(|source| Error::Agent {
                    what: "the agent refused to power off".into(),
                    source,
                })
        };
        tokio::time::timeout(within, ask).await.map_err(|_| {
            Error::AgentUnavailable(format!(
                "the agent did not answer within {}",
                humantime::format_duration(within)
            ))
        })?
    }

    /// Sends one request to the VM's VMM, logging a failure or a refusal
    /// (the caller's deadline handles a VMM that does not act on it).
    async fn vmm_request(&self, hostname: &str, request: VmmRequest) {
        if let Err(e) = self.launcher.request(hostname, request).await {
            tracing::warn!(vm = hostname, "{}", chain(&e));
        }
    }

    /// Boots a stopped (or failed) persistent VM from its disk. A suspended
    /// VM boots from its disk too: its memory is discarded (as after a
    /// power cut, writes its guest had not synced are lost); `restore`
    /// resumes it instead.
    pub async fn relaunch(
        self: &Arc<Self>,
        key: &str,
        wait: Wait,
        timeout: Duration,
    ) -> Result<api::CreateVmResponse> {
        let began = Instant::now();
        let vm = self.vm(key)?;
        {
            let _guard = self.lock_vm(&vm.hostname).await;
            let vm = self.vm(&vm.hostname)?;
            if vm.state.is_live() || vm.state == VmState::Creating {
                return Err(Error::Conflict(format!("{} is {}", vm.hostname, vm.state)));
            }
            if !Path::new(&vm.disk).is_file() {
                return Err(Error::Conflict(format!(
                    "{} has no disk left ({} is missing); delete it",
                    vm.hostname, vm.disk
                )));
            }
            self.queue_boot(&vm.hostname)?;
            if vm.state == VmState::Suspended {
                tracing::warn!(vm = %vm.hostname, "relaunched while suspended: its memory is discarded");
                self.remove_snapshot_logged(&vm.hostname, &self.suspend_files(&vm.hostname));
            }
        }
        let vm = match wait {
            Wait::Agent => self.wait_running(&vm.hostname, timeout).await?,
            Wait::None => self.vm(&vm.hostname)?,
        };
        // Slicer answers a relaunch as it answers a create.
        let info = self.describe(&vm);
        Ok(api::CreateVmResponse {
            hostname: vm.hostname,
            host_group: info.host_group,
            state: vm.state,
            ip: info.ip,
            created_at: info.created_at,
            arch: info.arch,
            elapsed_ms: began.elapsed().as_millis() as u64,
        })
    }

    /// Stops a VM if it runs and removes it with its disk.
    pub async fn delete(self: &Arc<Self>, key: &str) -> Result<api::LifecycleResponse> {
        let began = Instant::now();
        let vm = self.vm(key)?;
        let running = {
            let _guard = self.lock_vm(&vm.hostname).await;
            let current = self.vm(&vm.hostname)?;
            // Stopping also keeps a queued VM from being launched.
            if let Err(e) = self.store.transition(
                &vm.hostname,
                &[VmState::Starting, VmState::Running, VmState::Stopping],
                VmState::Stopping,
                Some("deleting"),
            ) {
                tracing::error!(vm = %vm.hostname, "cannot record that it is being deleted: {}", chain(&e));
            }
            current
        };
        if running.pid.is_some() && running.state.is_live() {
            self.stop_process(&running, true, Duration::from_secs(5))
                .await;
        }
        failpoint::hit(Failpoint::DeleteStopped);
        let _guard = self.lock_vm(&vm.hostname).await;
        let Some(vm) = self.store.find_vm(&vm.hostname)? else {
            // An ephemeral VM removes itself when it stops.
            let dir = self.paths(&vm.hostname).dir;
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(vm = %vm.hostname, "cannot remove {}: {e}", dir.display());
                }
            }
            return Ok(deleted(vm.hostname, vm.disk, began));
        };
        if vm.state.is_live() && vm.pid.is_some() {
            return Err(Error::Failed(format!(
                "{} did not stop; not deleted",
                vm.hostname
            )));
        }
        if let Some(id) = &vm.commit_id {
            // The source's own disk is an overlay on the commit; the commit
            // stays and keeps its record.
            tracing::info!(vm = %vm.hostname, commit = %id, "deleting a committed source");
        }
        self.release_network(&vm);
        self.forget(&vm.hostname)?;
        self.notify(&vm.hostname);
        Ok(deleted(vm.hostname, vm.disk, began))
    }

    /// Applies a tag change.
    pub async fn patch_tags(&self, key: &str, patch: api::TagsPatch) -> Result<api::TagsResponse> {
        let vm = self.vm(key)?;
        let _guard = self.lock_vm(&vm.hostname).await;
        let vm = self.vm(&vm.hostname)?;
        for t in patch.add.iter().chain(patch.replace.iter().flatten()) {
            plan::validate_tag(t)?;
        }
        if patch.replace.is_some() && (!patch.add.is_empty() || !patch.remove.is_empty()) {
            return Err(Error::BadRequest(
                "use either replace, or add and remove".into(),
            ));
        }
        let name_tag = vm.name.as_ref().map(|n| format!("name={n}"));
        let mut tags = match patch.replace {
            Some(r) => r,
            None => {
                let mut t = vm.tags.clone();
                t.retain(|x| {
                    !patch.remove.iter().any(|r| {
                        x == r || (!r.contains('=') && x.split('=').next() == Some(r.as_str()))
                    })
                });
                for a in patch.add {
                    if !t.contains(&a) {
                        t.push(a);
                    }
                }
                t
            }
        };
        // The friendly name is identity: it stays.
        if let Some(n) = name_tag {
            tags.retain(|t| !t.starts_with("name="));
            tags.push(n);
        }
        self.store.set_tags(&vm.hostname, &tags)?;
        Ok(api::TagsResponse {
            hostname: vm.hostname,
            tags,
        })
    }

    /// Lists VMs, filtered by group and tags.
    pub fn list(&self, group: Option<&str>, q: &api::ListQuery) -> Result<Vec<api::VmInfo>> {
        if let Some(g) = group {
            self.group(g)?;
        }
        Ok(self
            .store
            .list_vms(group)?
            .iter()
            .filter(|vm| q.tags.iter().all(|t| vm.tags.contains(t)))
            .filter(|vm| {
                q.tag_prefix
                    .as_ref()
                    .is_none_or(|p| vm.tags.iter().any(|t| t.starts_with(p.as_str())))
            })
            .map(|vm| self.describe(vm))
            .collect())
    }
}

impl Daemon {
    async fn wait_not_live_until(&self, hostname: &str, deadline: tokio::time::Instant) -> bool {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        self.wait_not_live(hostname, left).await
    }
}

/// A delete's answer, with Slicer's `message` and `disk_removed`.
fn deleted(hostname: String, disk: String, began: Instant) -> api::LifecycleResponse {
    api::LifecycleResponse {
        message: Some(format!("deleted {hostname} and its disk")),
        hostname,
        state: VmState::Stopped,
        stop_mode: None,
        elapsed_ms: began.elapsed().as_millis() as u64,
        disk_removed: Some(disk),
    }
}
