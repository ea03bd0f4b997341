//! Start-up reconciliation: after a restart (or a `kill -9`) the daemon
//! adopts the runs that survived, finishes or undoes interrupted changes
//! (a suspend with its snapshot in place is finished, one without is
//! undone), removes what no record names, relaunches persistent VMs (per
//! `reconcile:`) and keeps each group's `count`. A suspended VM has nothing
//! to run: it waits for its restore.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tine_proto::api::{CreateVmRequest, StopMode, VmState, Wait};

use super::daemon::Daemon;
use super::error::{chain, Error, Result};
use super::hot_fork::fork_disk_again;
use super::lifecycle::NewFolder;
use super::spare_book::SetAhead;
use super::supervise::{SetUp, SetUpHold};
use crate::config::Reconcile;
use crate::db::VmRecord;
use crate::launcher::{Instance, LauncherExt, Running};
use crate::storage;

/// How long a suspended VM's leftover VMM may take to exit at start-up.
const LEFTOVER_GONE: Duration = Duration::from_secs(5);

/// What start-up reconciliation did.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReconcileReport {
    /// Live VMs taken over.
    pub adopted: Vec<String>,
    /// Persistent VMs booted again.
    pub relaunched: Vec<String>,
    /// Persistent VMs recorded as stopped (`reconcile: report`).
    pub stopped: Vec<String>,
    /// Records or files removed.
    pub removed: Vec<String>,
    /// Unrecorded runs killed.
    pub killed: Vec<String>,
    /// VMs that could not be relaunched.
    pub failed: Vec<String>,
    /// VMs created to keep `count`.
    pub created: Vec<String>,
    /// VMs found suspended, or whose interrupted suspend was finished.
    pub suspended: Vec<String>,
}

fn remove_logged(path: &Path, dir: bool, report: &mut ReconcileReport) {
    let done = if dir {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match done {
        Ok(()) => report.removed.push(path.display().to_string()),
        Err(e) => tracing::warn!("cannot remove {}: {e}", path.display()),
    }
}

impl Daemon {
    /// Start-up: see the module documentation.
    pub async fn reconcile(self: &Arc<Self>) -> Result<ReconcileReport> {
        let mut report = ReconcileReport::default();
        let vms = self.store.list_vms(None)?;
        // Runs nobody recorded (a crash between launch and record) go first:
        // such a VMM holds the disk and sockets of a VM that is about to be
        // launched again, and two VMMs must never share a disk.
        let strays: Vec<_> = self
            .launcher
            .strays()
            .into_iter()
            .filter(|s| {
                !vms.iter()
                    .any(|v| v.hostname == s.hostname && v.pid == Some(s.pid) && v.state.is_live())
            })
            .collect();
        self.launcher.kill_strays(&strays).await;
        report.killed.extend(
            strays
                .iter()
                .map(|s| format!("{} (pid {})", s.hostname, s.pid)),
        );
        for vm in &vms {
            match vm.state {
                VmState::Creating => {
                    self.discard(&vm.hostname).await;
                    report.removed.push(vm.hostname.clone());
                }
                VmState::Starting if vm.pid.is_none() => {
                    // Queued for a boot slot when the daemon went down.
                    if let Err(e) = self.remake_lost_fork_disk(vm) {
                        let reason = chain(&e);
                        tracing::error!(vm = %vm.hostname, "{reason}");
                        self.store
                            .set_state(&vm.hostname, VmState::Failed, Some(&reason))?;
                        report.failed.push(vm.hostname.clone());
                        continue;
                    }
                    match self.queue_boot(&vm.hostname) {
                        Ok(()) => report.relaunched.push(vm.hostname.clone()),
                        Err(e) => {
                            tracing::error!(vm = %vm.hostname, "cannot queue its boot: {}", chain(&e));
                            report.failed.push(vm.hostname.clone())
                        }
                    }
                }
                VmState::Suspending => self.finish_suspend_at_start(vm, &mut report).await?,
                VmState::Suspended => self.check_suspended_at_start(vm, &mut report).await?,
                s if s.is_live() => {
                    self.finish_memory_commit_at_start(vm).await?;
                    if let Some(running) = self.adopt(vm) {
                        if s == VmState::Stopping {
                            // The stop request died with the old daemon.
                            self.store.transition(
                                &vm.hostname,
                                &[VmState::Stopping],
                                VmState::Running,
                                None,
                            )?;
                        }
                        // A hot fork whose set-up the old daemon did not
                        // finish gets the hot fork's (out of quarantine),
                        // its disk synced again (the old daemon may have
                        // died before its sync ended).
                        let (setup, disk_synced) = match self.hot_fork_snapshot(vm) {
                            Ok(Some(_)) => (
                                SetUp::HotFork {
                                    ahead: SetAhead::default(),
                                },
                                Some(self.sync_disk_soon(&vm.disk, NewFolder::Made)),
                            ),
                            _ => (SetUp::Boot, None),
                        };
                        self.supervise(
                            vm.hostname.clone(),
                            running,
                            SetUpHold::default(),
                            setup,
                            disk_synced,
                        );
                        report.adopted.push(vm.hostname.clone());
                    } else {
                        self.run_lost_at_start(vm, &mut report).await?;
                    }
                }
                _ => {
                    if vm.managed
                        && self.config.reconcile == Reconcile::Relaunch
                        && Path::new(&vm.disk).is_file()
                    {
                        self.relaunch_at_start(&vm.hostname, &mut report)?;
                    }
                }
            }
        }
        self.remove_orphan_files(&mut report)?;
        self.cleanup_network_orphans(&self.store.list_vms(None)?);
        // Keep `count` VMs per group.
        for g in self.config.host_groups.clone() {
            let have = self
                .store
                .list_vms(Some(&g.name))?
                .iter()
                .filter(|v| v.managed)
                .count() as u32;
            for _ in have..g.count {
                match self
                    .create_vm(
                        &g.name,
                        CreateVmRequest::default(),
                        Wait::None,
                        Duration::ZERO,
                        true,
                    )
                    .await
                {
                    Ok(r) => report.created.push(r.hostname),
                    Err(e) => {
                        tracing::error!(group = %g.name, "cannot keep count: {}", chain(&e));
                        break;
                    }
                }
            }
        }
        self.notify_all();
        Ok(report)
    }

    /// The recorded run of `vm`, if it is still that process.
    fn adopt(&self, vm: &VmRecord) -> Option<Running> {
        match (vm.pid, vm.pid_start) {
            (Some(pid), Some(pid_start)) => self
                .launcher
                .adopt(&vm.hostname, Instance { pid, pid_start }),
            _ => None,
        }
    }

    /// A live VM whose process ended while the daemon was down: an
    /// ephemeral one is removed, a persistent one is stopped (and
    /// relaunched with `reconcile: relaunch`).
    async fn run_lost_at_start(
        self: &Arc<Self>,
        vm: &VmRecord,
        report: &mut ReconcileReport,
    ) -> Result<()> {
        if !vm.persistent {
            self.discard(&vm.hostname).await;
            report.removed.push(vm.hostname.clone());
            return Ok(());
        }
        let reason = "its process ended while the daemon was down";
        self.store.clear_process(
            &vm.hostname,
            VmState::Stopped,
            Some(reason),
            Some(StopMode::Crashed),
        )?;
        self.release_network(vm);
        if self.config.reconcile == Reconcile::Relaunch {
            self.relaunch_at_start(&vm.hostname, report)?;
        } else {
            report.stopped.push(vm.hostname.clone());
        }
        Ok(())
    }

    /// A suspend the old daemon did not finish. With its snapshot in place
    /// (renamed, so complete) it is finished: the VM is recorded suspended
    /// and its paused VMM, if it still runs, exits. Without, the partial
    /// snapshot goes and the VM runs on (resumed), or, its process gone,
    /// is handled as any lost run.
    async fn finish_suspend_at_start(
        self: &Arc<Self>,
        vm: &VmRecord,
        report: &mut ReconcileReport,
    ) -> Result<()> {
        let hostname = vm.hostname.as_str();
        let files = self.suspend_files(hostname);
        let running = self.adopt(vm);
        if files.is_complete() {
            self.store.record_suspended(hostname)?;
            if let Err(e) = files.remove_partial() {
                tracing::warn!(
                    vm = hostname,
                    "cannot remove {}: {e}",
                    files.partial.display()
                );
            }
            if let Some(mut running) = running {
                if let Err(e) = self.launcher.stop_now(hostname).await {
                    tracing::warn!(vm = hostname, "ask its VMM to exit: {}", chain(&e));
                }
                if tokio::time::timeout(LEFTOVER_GONE, &mut running.exit)
                    .await
                    .is_err()
                {
                    self.launcher.kill(hostname, running.instance);
                    if tokio::time::timeout(LEFTOVER_GONE, &mut running.exit)
                        .await
                        .is_err()
                    {
                        tracing::error!(vm = hostname, "its VMM is still there");
                    }
                }
            }
            tracing::info!(vm = hostname, "finished its interrupted suspend");
            report.suspended.push(hostname.to_owned());
            return Ok(());
        }
        self.remove_snapshot_logged(hostname, &files);
        let Some(running) = running else {
            return self.run_lost_at_start(vm, report).await;
        };
        // Paused, unless the crash came before the pause.
        if let Err(e) = self.launcher.resume(hostname).await {
            tracing::info!(
                vm = hostname,
                "resume after an interrupted suspend: {}",
                chain(&e)
            );
        }
        self.store
            .transition(hostname, &[VmState::Suspending], VmState::Running, None)?;
        tracing::info!(vm = hostname, "undid its interrupted suspend; it runs on");
        self.supervise(
            hostname.to_owned(),
            running,
            SetUpHold::default(),
            SetUp::Boot,
            None,
        );
        report.adopted.push(hostname.to_owned());
        Ok(())
    }

    /// A suspended VM: nothing to run, if its snapshot is whole. Without
    /// it (removed or damaged by hand), it cannot be restored: a persistent
    /// VM is recorded stopped (it boots from its disk), an ephemeral one is
    /// removed.
    async fn check_suspended_at_start(
        self: &Arc<Self>,
        vm: &VmRecord,
        report: &mut ReconcileReport,
    ) -> Result<()> {
        let files = self.suspend_files(&vm.hostname);
        if files.is_complete() {
            report.suspended.push(vm.hostname.clone());
            return Ok(());
        }
        tracing::error!(vm = %vm.hostname, "its suspended state {} is missing or incomplete", files.dir.display());
        if !vm.persistent {
            self.discard(&vm.hostname).await;
            report.removed.push(vm.hostname.clone());
            return Ok(());
        }
        self.discard_suspended(
            vm,
            "its suspended state was missing or incomplete at start-up",
        )?;
        report.stopped.push(vm.hostname.clone());
        Ok(())
    }

    /// Removes VM folders, disk files and commit files no record names.
    fn remove_orphan_files(&self, report: &mut ReconcileReport) -> Result<()> {
        // Temporary files of imports cut short (an image's record is
        // written last, so none names them).
        let images_dir = self.data_dir.join("images");
        for path in crate::image::remove_stray_files(&images_dir) {
            report.removed.push(path.display().to_string());
        }
        // A base renamed in place whose record was never written.
        let bases: HashSet<String> = self.store.image_paths()?.into_iter().collect();
        if let Ok(entries) = std::fs::read_dir(&images_dir) {
            for e in entries.flatten() {
                let path = e.path();
                let is_base = path.extension().is_some_and(|x| x == "base");
                if is_base && !bases.contains(&path.display().to_string()) {
                    remove_logged(&path, false, report);
                }
            }
        }
        let vms = self.store.list_vms(None)?;
        let known: HashSet<&str> = vms.iter().map(|v| v.hostname.as_str()).collect();
        if let Ok(entries) = std::fs::read_dir(self.data_dir.join("vms")) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !known.contains(name.as_str()) {
                    remove_logged(&e.path(), true, report);
                }
            }
        }
        // Spares are nobody's until taken, and this daemon has made none
        // yet: an earlier one's are left-overs.
        let spares = self.spares_dir();
        if spares.exists() {
            remove_logged(&spares, true, report);
        }
        // Commit files and memory commits' snapshot folders (a partial
        // one is never named).
        let commits: HashSet<String> = self.store.commit_paths()?.into_iter().collect();
        if let Ok(entries) = std::fs::read_dir(self.commits_dir()) {
            for e in entries.flatten() {
                if !commits.contains(&e.path().display().to_string()) {
                    let dir = e.file_type().is_ok_and(|t| t.is_dir());
                    remove_logged(&e.path(), dir, report);
                }
            }
        }
        // Snapshots no suspended VM needs: a partial one is never needed
        // here; a complete one only by a suspended VM (a restore removes it
        // once the restored process is recorded).
        for vm in &vms {
            let files = self.suspend_files(&vm.hostname);
            if files.partial.exists() {
                remove_logged(&files.partial, true, report);
            }
            if vm.state != VmState::Suspended && files.dir.exists() {
                remove_logged(&files.dir, true, report);
            }
        }
        // Disk files in VM folders that no record names (a crash between a
        // commit's record and the removal of the source's old disk name).
        for vm in &vms {
            let dir = self.paths(&vm.hostname).dir;
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if name.starts_with("disk")
                        && name.ends_with(".qcow2")
                        && e.path().display().to_string() != vm.disk
                    {
                        remove_logged(&e.path(), false, report);
                    }
                }
            }
        }
        Ok(())
    }

    /// A fork is answered before its disk is synced (`storage::fork_disk`),
    /// and synced before its first boot: if a power loss took the disk of a
    /// fork that never booted, it held nothing but its commit, so it is
    /// made again. Any other VM with its disk gone cannot boot. An unborn
    /// hot fork's disk is made again in any case: it may be that of the
    /// primed VM the fork claimed, whose guest ran on it, and the fork's
    /// guest, restored from the commit, must find the commit's disk.
    fn remake_lost_fork_disk(&self, vm: &VmRecord) -> Result<()> {
        let disk = Path::new(&vm.disk);
        let hot_fork = matches!(self.hot_fork_snapshot(vm), Ok(Some(_)));
        let intact = storage::is_intact(disk);
        if intact && !hot_fork {
            return Ok(());
        }
        let commit = match (&vm.parent_commit_id, vm.is_unborn_fork()) {
            (Some(id), true) => self.store.get_commit(id)?,
            _ => None,
        };
        let Some(commit) = commit else {
            return Err(Error::Failed(format!(
                "its disk {} is missing or unreadable",
                disk.display()
            )));
        };
        std::fs::create_dir_all(self.paths(&vm.hostname).dir)
            .map_err(|e| Error::io("create VM folder", e))?;
        fork_disk_again(Path::new(&commit.disk), disk)?;
        match intact {
            true => {
                tracing::info!(vm = %vm.hostname, "an unborn hot fork's disk made again from {}", commit.id)
            }
            false => {
                tracing::warn!(vm = %vm.hostname, "its disk was lost before its first boot; made it again from {}", commit.id)
            }
        }
        Ok(())
    }

    /// Queues a persistent VM's boot during reconciliation, recording the
    /// outcome.
    fn relaunch_at_start(
        self: &Arc<Self>,
        hostname: &str,
        report: &mut ReconcileReport,
    ) -> Result<()> {
        match self.queue_boot(hostname) {
            Ok(()) => report.relaunched.push(hostname.to_owned()),
            Err(e) => {
                let reason = chain(&e);
                self.store
                    .set_state(hostname, VmState::Failed, Some(&reason))?;
                report.failed.push(hostname.to_owned());
            }
        }
        Ok(())
    }
}
