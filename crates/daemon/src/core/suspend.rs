//! Suspend and restore of a VM (Slicer's `POST /vm/{h}/suspend` and
//! `/restore`): its state, memory and disk go to its folder and its process
//! exits; a restore resumes it with the same memory, processes and all.
//!
//! Order of a suspend (crash-safe; start-up reconciliation finishes or
//! undoes it): record `suspending`, pause, write the snapshot (its files
//! renamed into place in one step, see `snapshot`), sync the disk, record
//! `suspended` without a process in one statement, stop the VMM, release
//! the network. A crash before the rename leaves the VM running (the
//! partial snapshot is removed and the VM resumed); after it, suspended.
//!
//! Order of a restore: network, a VMM restored from the snapshot, the
//! process recorded (`starting`), the snapshot removed (the VMM keeps its
//! mapping of the memory file), then the agent's set-up (entropy, clock)
//! marks it `running`. A crash before the record leaves it suspended (the
//! unrecorded VMM is killed at start-up); after it, running.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_proto::api::{self, StopMode, VmState, Wait};

use super::daemon::{sync_disk_off_thread, Daemon};
use super::error::{chain, Error, Result};
use super::snapshot::SnapshotFiles;
use crate::db::VmRecord;
use crate::failpoint::{self, Failpoint};
use crate::launcher::{Instance, LauncherExt};

/// Why a state refuses a suspend, for the error message.
fn why_not_suspend(vm: &VmRecord) -> String {
    let h = &vm.hostname;
    match vm.state {
        VmState::Suspended => format!("{h} is already suspended"),
        VmState::Suspending => format!("{h} is being suspended"),
        VmState::Starting => format!(
            "{h} is starting (its agent has not answered yet); suspend it once it is running"
        ),
        state => format!("{h} is {state}; only a running VM can be suspended"),
    }
}

/// Why a state refuses a restore, for the error message.
fn why_not_restore(vm: &VmRecord) -> String {
    let h = &vm.hostname;
    match vm.state {
        VmState::Starting | VmState::Running | VmState::Stopping => {
            format!("{h} is {}; only a suspended VM can be restored", vm.state)
        }
        VmState::Suspending => format!("{h} is being suspended; restore it once it is suspended"),
        state => format!(
            "{h} is {state}; only a suspended VM can be restored (tine vm relaunch {h} boots it \
             from its disk)"
        ),
    }
}

impl Daemon {
    /// Suspends a running (or paused) VM: see the module documentation.
    /// A paused VM comes back running when it is restored.
    pub async fn suspend(self: &Arc<Self>, key: &str) -> Result<api::SuspendResponse> {
        let began = Instant::now();
        let hostname = self.vm(key)?.hostname;
        let _guard = self.lock_vm(&hostname).await;
        let vm = self.vm(&hostname)?;
        let (VmState::Running, Some(pid), Some(pid_start)) = (vm.state, vm.pid, vm.pid_start)
        else {
            return Err(Error::Conflict(why_not_suspend(&vm)));
        };
        let instance = Instance { pid, pid_start };
        let was_paused = self.is_paused(&vm);
        if !self
            .store
            .transition(&hostname, &[VmState::Running], VmState::Suspending, None)?
        {
            return Err(Error::Conflict(why_not_suspend(&self.vm(&hostname)?)));
        }
        self.notify(&hostname);
        failpoint::hit(Failpoint::SuspendRecorded);
        let files = self.suspend_files(&hostname);
        let captured = async {
            if !was_paused {
                self.launcher
                    .pause(&hostname)
                    .await
                    .map_err(|source| Error::Launch {
                        what: format!("pause {hostname} to suspend it"),
                        source,
                    })?;
            }
            let captured = self.capture(&hostname, &files).await?;
            failpoint::hit(Failpoint::SuspendSnapshotSealed);
            // The VMM flushed the disk before the snapshot; this makes sure
            // it reached stable storage before the VM counts as suspended.
            let disk = std::path::PathBuf::from(&vm.disk);
            sync_disk_off_thread(disk, format!("sync the disk of {hostname}")).await?;
            Ok::<_, Error>(captured)
        }
        .await;
        let captured = match captured {
            Ok(c) => c,
            Err(e) => {
                self.undo_suspend(&vm, was_paused, &files).await;
                return Err(e);
            }
        };
        match self.store.record_suspended(&hostname) {
            Ok(true) => {}
            outcome => {
                self.undo_suspend(&vm, was_paused, &files).await;
                return Err(match outcome {
                    Err(e) => e.into(),
                    _ => {
                        Error::Conflict(format!("{hostname} changed while it was being suspended"))
                    }
                });
            }
        }
        self.forget_paused(&hostname);
        self.notify(&hostname);
        failpoint::hit(Failpoint::SuspendRecordedSuspended);
        self.end_run(&hostname, instance).await;
        self.release_network(&vm);
        self.notify(&hostname);
        tracing::info!(
            vm = %hostname,
            memory_bytes = captured.memory_bytes,
            snapshot_us = captured.snapshot_us,
            "suspended"
        );
        Ok(api::SuspendResponse {
            hostname,
            state: VmState::Suspended,
            memory_bytes: captured.memory_bytes,
            snapshot_ms: captured.snapshot_us / 1000,
            elapsed_ms: began.elapsed().as_millis() as u64,
        })
    }

    /// A suspend failed before it was recorded: the snapshot goes, the VM
    /// runs on (paused again if it was).
    async fn undo_suspend(&self, vm: &VmRecord, was_paused: bool, files: &SnapshotFiles) {
        let hostname = vm.hostname.as_str();
        self.remove_snapshot_logged(hostname, files);
        if !was_paused {
            if let Err(e) = self.launcher.resume(hostname).await {
                tracing::warn!(
                    vm = hostname,
                    "resume after a failed suspend: {}",
                    chain(&e)
                );
                // Paused or gone: `resume` and the exit handler sort it out.
                if let Some(pid) = vm.pid {
                    self.remember_paused(hostname, pid);
                }
            }
        }
        if let Err(e) =
            self.store
                .transition(hostname, &[VmState::Suspending], VmState::Running, None)
        {
            tracing::error!(
                vm = hostname,
                "cannot record that it runs on: {}",
                chain(&e)
            );
        }
        self.notify(hostname);
    }

    /// Resumes a suspended VM with its memory. With [`Wait::Agent`] it
    /// answers once the agent answered (fresh entropy and the clock set).
    pub async fn restore(
        self: &Arc<Self>,
        key: &str,
        wait: Wait,
        timeout: Duration,
    ) -> Result<api::LifecycleResponse> {
        let began = Instant::now();
        let hostname = self.vm(key)?.hostname;
        {
            let _guard = self.lock_vm(&hostname).await;
            let vm = self.vm(&hostname)?;
            if vm.state != VmState::Suspended {
                return Err(Error::Conflict(why_not_restore(&vm)));
            }
            self.restore_suspended(&vm).await?;
        }
        let vm = match wait {
            Wait::Agent => self.wait_running(&hostname, timeout).await?,
            Wait::None => self.vm(&hostname)?,
        };
        Ok(api::LifecycleResponse {
            hostname,
            state: vm.state,
            stop_mode: None,
            elapsed_ms: began.elapsed().as_millis() as u64,
            message: None,
            disk_removed: None,
        })
    }

    /// Restores a suspended VM and removes its snapshot; the caller holds
    /// the VM's lock.
    pub(super) async fn restore_suspended(self: &Arc<Self>, vm: &VmRecord) -> Result<Instance> {
        let files = self.suspend_files(&vm.hostname);
        if !files.is_complete() {
            return Err(Error::Conflict(format!(
                "the suspended state of {} is missing or incomplete ({}); tine vm relaunch {} \
                 boots it from its disk",
                vm.hostname,
                files.dir.display(),
                vm.hostname
            )));
        }
        let instance = self.restore_run(vm, &files).await?;
        self.remove_snapshot_logged(&vm.hostname, &files);
        Ok(instance)
    }

    /// Drops a suspended VM's memory: a persistent VM is `stopped` (its
    /// disk stays, as after a power cut: writes its guest had not synced
    /// are lost), an ephemeral one is removed. The caller holds the lock.
    pub(super) fn discard_suspended(&self, vm: &VmRecord, why: &str) -> Result<()> {
        if vm.persistent {
            self.store.clear_process(
                &vm.hostname,
                VmState::Stopped,
                Some(&format!(
                    "{why}: its suspended memory was discarded; writes the guest had not synced \
                     are lost"
                )),
                Some(StopMode::Forced),
            )?;
            self.remove_snapshot_logged(&vm.hostname, &self.suspend_files(&vm.hostname));
        } else {
            self.release_network(vm);
            self.forget(&vm.hostname)?;
        }
        self.notify(&vm.hostname);
        Ok(())
    }
}
