//! Running a VM and watching it: the launch (a boot slot, the network, the
//! launcher), the boot's set-up once the agent answers (fix-ups, network,
//! first-boot userdata, each with a deadline), and what happens when the
//! run ends (the exit policy).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tine_client::AgentClient;
use tine_proto::agent::FixupRequest;
use tine_proto::api::{Fixup, StopMode, VmState};
use tokio_util::task::AbortOnDropHandle;

use super::daemon::Daemon;
use super::error::{chain, Error, Result};
use super::spare_book::SetAhead;
use crate::db::now_ms;
use crate::failpoint::{self, Failpoint};
use crate::launcher::{BootSpec, Instance, Running, Stop};

/// Kernel command line for every VM (the image's init is the agent).
pub const BASE_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 pci=off nomodule nokaslr \
     i8042.noaux i8042.nomux i8042.dumbkbd i8042.nopnp swiotlb=noforce cryptomgr.notests \
     quiet root=/dev/vda rw init=/sbin/init";

/// What a run holds until its set-up ends (or the run does).
#[derive(Default)]
pub(super) struct SetUpHold {
    /// The boot slot it took, if it took one.
    pub(super) boot_slot: Option<tokio::sync::OwnedSemaphorePermit>,
    /// A hot fork's place among the launches under way.
    pub(super) launch: Option<Launching>,
}

impl SetUpHold {
    /// The same hold, but with the launch let go after `bound` if the
    /// set-up has not ended by then.
    fn bounded(self, bound: std::time::Duration) -> HeldSetUp {
        let launch = self.launch.map(|launch| launch.bounded(bound));
        HeldSetUp {
            _boot_slot: self.boot_slot,
            _launch: launch,
        }
    }
}

/// A [`SetUpHold`] held by a set-up under way.
struct HeldSetUp {
    _boot_slot: Option<tokio::sync::OwnedSemaphorePermit>,
    _launch: Option<BoundedLaunch>,
}

impl From<Option<tokio::sync::OwnedSemaphorePermit>> for SetUpHold {
    fn from(boot_slot: Option<tokio::sync::OwnedSemaphorePermit>) -> Self {
        SetUpHold {
            boot_slot,
            launch: None,
        }
    }
}

/// Counts a hot fork launch under way, from its request until its set-up
/// ends; when the last one under way ends (whichever way), what the
/// launches took of the spares is made up in the background. A refill
/// during a burst of forks, or during a fork's set-up, would take the CPU
/// and the disk's syncs they need: priming a VM runs its guest until its
/// agent answers.
pub(super) struct Launching(Arc<Daemon>);

impl Launching {
    pub(super) fn new(daemon: &Arc<Daemon>) -> Self {
        daemon.hot_launches.fetch_add(1, Ordering::SeqCst);
        Launching(daemon.clone())
    }

    /// The same launch, let go when the guard is dropped or after `bound`,
    /// whichever comes first: a launch that hangs does not hold every
    /// refill back.
    pub(super) fn bounded(self, bound: std::time::Duration) -> BoundedLaunch {
        let launch = Arc::new(std::sync::Mutex::new(Some(self)));
        let held = launch.clone();
        let timer = AbortOnDropHandle::new(tokio::spawn(async move {
            tokio::time::sleep(bound).await;
            tracing::debug!("a hot fork's launch outlasted its bound");
            BoundedLaunch::let_go(&held);
        }));
        BoundedLaunch {
            launch,
            _timer: timer,
        }
    }
}

/// A [`Launching`] let go at its bound or when dropped (at once, not when
/// the runtime gets to a cancelled task).
pub(super) struct BoundedLaunch {
    launch: Arc<std::sync::Mutex<Option<Launching>>>,
    _timer: AbortOnDropHandle<()>,
}

impl BoundedLaunch {
    fn let_go(launch: &std::sync::Mutex<Option<Launching>>) {
        let taken = launch.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(taken);
    }
}

impl Drop for BoundedLaunch {
    fn drop(&mut self) {
        BoundedLaunch::let_go(&self.launch);
    }
}

impl Drop for Launching {
    fn drop(&mut self) {
        if self.0.hot_launches.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.refresh_spares();
        }
    }
}

/// What a run's set-up does once its agent answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetUp {
    /// A boot (or an adopted run): hostname, machine-id and SSH host keys
    /// as the VM's fix-ups say, entropy, clock, network, first-boot
    /// userdata.
    Boot,
    /// A run resumed from a snapshot of the same VM: its guest kept its
    /// identity, network and processes, so only fresh entropy and the clock
    /// (it stood still while the VM was suspended).
    Resume,
    /// A hot fork resumed from its memory commit: the guest is a copy of
    /// the source, so it gets every identity fix-up (hostname, machine-id,
    /// SSH host keys), entropy, the clock, its own MAC and address, and the
    /// fork's secrets; no first-boot userdata (the source ran it). What a
    /// primed guest was given ahead (`ahead`) it is not given again.
    HotFork {
        /// What the guest was given while it was primed.
        ahead: SetAhead,
    },
}

impl SetUp {
    fn is_hot_fork(self) -> bool {
        matches!(self, SetUp::HotFork { .. })
    }
}

/// Bytes from the host's CSPRNG for a guest's kernel: the agent credits
/// them to its input pool and reseeds its CRNG.
fn host_entropy() -> Result<Vec<u8>> {
    let mut entropy = vec![0u8; 64];
    getrandom::fill(&mut entropy).map_err(|e| {
        Error::io(
            "host entropy for the guest",
            std::io::Error::other(e.to_string()),
        )
    })?;
    Ok(entropy)
}

/// The fix-ups that give a primed VM's guest an identity of its own ahead
/// of its fork ([`SetAhead::identity`]).
pub(super) fn identity_fixups() -> Result<FixupRequest> {
    Ok(FixupRequest {
        hostname: None,
        machine_id: true,
        ssh_host_keys: true,
        entropy: Some(host_entropy()?),
        clock_unix_nanos: None,
    })
}

/// What a hot fork's set-up waits for before the fork is `running`: its
/// disk on stable storage. The sync runs while the guest resumes and is set
/// up; until the fork is `running` it is unborn, and a power loss before
/// then has it made again from its commit (`core::reconcile`).
pub(super) type DiskSynced =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;

/// How a run ended: `forced` when the daemon killed it, `clean` when the
/// VMM reported a power-off, reboot or requested kill, `requested` when the
/// daemon had asked it to stop.
pub fn stop_mode(forced: bool, clean: bool, requested: bool) -> StopMode {
    match (forced, clean, requested) {
        (true, _, _) => StopMode::Forced,
        (false, false, _) => StopMode::Crashed,
        (false, true, true) => StopMode::Graceful,
        (false, true, false) => StopMode::Guest,
    }
}

/// What becomes of a VM whose run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterExit {
    /// Kept (with its disk) in this state.
    Keep(VmState),
    /// Removed with its disk: an ephemeral VM that stopped, or a fork that
    /// never came up (its waiter learns why).
    Remove,
    /// An ephemeral VM that failed: the record stays to say why, the disk
    /// goes.
    KeepFailedDropDisk,
}

/// The exit policy. `state` is the VM's state when the run ended,
/// `clean` whether the stop was a power-off, reboot or requested kill.
pub fn after_exit(state: VmState, persistent: bool, unborn_fork: bool, clean: bool) -> AfterExit {
    let requested = state == VmState::Stopping;
    // A guest that stops before its agent ever answered failed to boot (a
    // kernel panic reboots with panic=-1), whatever the exit said.
    let never_ready = state == VmState::Starting;
    let end = if requested || (clean && !never_ready) {
        VmState::Stopped
    } else {
        VmState::Failed
    };
    if never_ready && !requested && unborn_fork {
        AfterExit::Remove
    } else if persistent {
        AfterExit::Keep(end)
    } else if end == VmState::Stopped {
        AfterExit::Remove
    } else {
        AfterExit::KeepFailedDropDisk
    }
}

/// One call of a boot's set-up, which must answer within `step`.
async fn setup_call<T>(
    step: std::time::Duration,
    what: &'static str,
    call: impl std::future::Future<Output = Result<T, tine_client::ClientError>>,
) -> Result<T> {
    match tokio::time::timeout(step, call).await {
        Ok(answer) => answer.map_err(|source| Error::Agent {
            what: what.into(),
            source,
        }),
        Err(_) => Err(Error::Timeout(format!(
            "{what}: the agent did not answer within {}",
            humantime::format_duration(step)
        ))),
    }
}

/// A set-up step's name and how long it took in ms, for the log.
type StepTime = (&'static str, u64);

/// Runs one set-up step: its time, and what it returned.
async fn timed<T>(
    name: &'static str,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<(StepTime, T)> {
    let began = Instant::now();
    let out = work.await?;
    Ok(((name, began.elapsed().as_millis() as u64), out))
}

impl Daemon {
    /// Launches a queued VM and supervises it (the set-up at agent-ready,
    /// then its exit); `permit` is the boot slot, held until the set-up
    /// ends.
    pub(super) fn launch(
        self: &Arc<Self>,
        hostname: &str,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<()> {
        let vm = self.vm(hostname)?;
        let group = self.group(&vm.host_group)?.clone();
        let network = self.attach_network(&group, &vm)?;
        let mut cmdline = BASE_CMDLINE.to_owned();
        if let Some(extra) = &self.config.cmdline {
            cmdline.push(' ');
            cmdline.push_str(extra);
        }
        let spec = BootSpec {
            hostname: hostname.to_owned(),
            kernel: group.kernel.clone().unwrap_or_else(|| self.kernel.clone()),
            cmdline,
            cpus: vm.cpus,
            ram_mib: vm.ram_bytes >> 20,
            disk: PathBuf::from(&vm.disk),
            net: network.map(|n| (n.tap, n.mac)),
        };
        // A forced stop of an earlier run that was never reaped here.
        self.take_forced(hostname);
        let running = self.launcher.boot(&spec).map_err(|source| Error::Launch {
            what: format!("boot {hostname}"),
            source,
        })?;
        let Instance { pid, pid_start } = running.instance;
        failpoint::hit(Failpoint::BootSpawned);
        if let Err(e) = self.store.set_process(hostname, pid, pid_start) {
            self.launcher.kill(hostname, running.instance);
            return Err(e.into());
        }
        self.notify(hostname);
        failpoint::hit(Failpoint::BootRecorded);
        tracing::info!(vm = hostname, pid, "started");
        self.supervise(
            hostname.to_owned(),
            running,
            permit.into(),
            SetUp::Boot,
            None,
        );
        Ok(())
    }

    /// Watches a run: finishes its set-up and handles its exit.
    pub(super) fn supervise(
        self: &Arc<Self>,
        hostname: String,
        running: Running,
        hold: SetUpHold,
        setup: SetUp,
        disk_synced: Option<DiskSynced>,
    ) {
        let this = self.clone();
        let h = hostname.clone();
        let Running {
            instance,
            exit,
            agent,
        } = running;
        self.run_started(&hostname, instance);
        let boot = tokio::spawn(async move {
            // Released when the set-up ends (or the run ends and this task
            // is aborted); a hot fork's launch at the latest after
            // `Deadlines::launch_set_up`.
            let _hold = hold.bounded(this.deadlines.launch_set_up);
            if let Err(e) = this.finish_boot(&h, setup, disk_synced, agent).await {
                let reason = chain(&e);
                tracing::warn!(vm = %h, "boot set-up: {reason}");
                match this.store.transition(
                    &h,
                    &[VmState::Starting],
                    VmState::Failed,
                    Some(&super::daemon::capped(&reason)),
                ) {
                    Ok(true) => {
                        this.notify(&h);
                        // The guest is of no use without its set-up.
                        this.launcher.kill(&h, instance);
                    }
                    Ok(false) => {}
                    Err(e) => tracing::error!(vm = %h, "cannot record its failure: {}", chain(&e)),
                }
            }
        });
        let this = self.clone();
        tokio::spawn(async move {
            let stop = exit.await;
            boot.abort();
            this.run_ended(&hostname, instance);
            this.on_exit(&hostname, instance, stop).await;
        });
    }

    /// Waits for the agent (or takes the connection `held`, when it is
    /// still open), applies what `setup` says (fix-ups, network, first-boot
    /// userdata), then marks the VM running.
    async fn finish_boot(
        &self,
        hostname: &str,
        setup: SetUp,
        disk_synced: Option<DiskSynced>,
        held: Option<AgentClient>,
    ) -> Result<()> {
        let began = Instant::now();
        let vm = self.vm(hostname)?;
        let started_ms = vm.started_ms.unwrap_or_else(now_ms);
        let deadline = Instant::now() + self.deadlines.agent_ready;
        let mut agent_tries = 0u32;
        let held = held.filter(|client| match client.closed() {
            None => true,
            Some(why) => {
                tracing::info!(
                    vm = hostname,
                    "the agent connection held for it had closed ({why:?}): connecting again"
                );
                false
            }
        });
        let client = if let Some(client) = held {
            client
        } else {
            loop {
                agent_tries += 1;
                match self.connect_agent(hostname).await {
                    Ok(c) => break c,
                    Err(e) if Instant::now() > deadline => {
                        return Err(Error::AgentUnavailable(format!(
                            "agent never answered within {}: {}",
                            humantime::format_duration(self.deadlines.agent_ready),
                            chain(&e)
                        )))
                    }
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
                }
            }
        };
        // Where the set-up's time goes, for the log: until the agent
        // answered (and in how many connection attempts), then each step
        // (those run at once each from the same start).
        let agent_ms = began.elapsed().as_millis() as u64;
        let first = !vm.booted_once && setup == SetUp::Boot;
        let ahead = match setup {
            SetUp::HotFork { ahead } => ahead,
            SetUp::Boot | SetUp::Resume => SetAhead::default(),
        };
        let (set_hostname, machine_id, ssh_host_keys) = match &vm.fixups {
            _ if setup == SetUp::Resume => (false, false, false),
            _ if setup.is_hot_fork() => (true, !ahead.identity, !ahead.identity),
            // A fork's first boot: exactly the fix-ups it asked for.
            Some(list) => (
                list.contains(&Fixup::Hostname),
                list.contains(&Fixup::MachineId),
                list.contains(&Fixup::SshHostKeys),
            ),
            None => (true, first, first),
        };
        // A guest primed with its identity had its entropy then, and has
        // not been copied since.
        let entropy = match ahead.identity {
            true => None,
            false => Some(host_entropy()?),
        };
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .ok();
        let req = FixupRequest {
            hostname: set_hostname.then(|| hostname.to_owned()),
            machine_id,
            ssh_host_keys,
            entropy,
            clock_unix_nanos: clock,
        };
        let step = self.deadlines.setup_call;
        let network = vm.network.as_ref().filter(|_| setup != SetUp::Resume);
        // The steps touch different things (the fix-ups the identity files
        // and the kernel's, the network its interface and resolv.conf, the
        // secrets a tmpfs, the keys root's authorized_keys), so they run at
        // once: while the fix-ups wait for the guest's disk (they sync what
        // they write), the guest's CPU serves the others.
        let fixups = timed("fixups", setup_call(step, "fix-ups", client.fixups(req)));
        let network_step = async {
            let Some(n) = network.filter(|_| !ahead.network) else {
                return Ok(None);
            };
            let call = setup_call(step, "network set-up", client.network(n.agent_request()));
            Ok(Some(timed("network", call).await?.0))
        };
        let keys = async {
            if !first || vm.ssh_keys.is_empty() {
                return Ok(None);
            }
            let call = setup_call(
                step,
                "SSH keys",
                client.authorized_keys(vm.ssh_keys.clone()),
            );
            Ok(Some(timed("SSH keys", call).await?.0))
        };
        // The guest's secrets are on a tmpfs: every boot syncs them. A fork
        // syncs even without grants, so inherited files never survive.
        let secrets = async {
            if vm.secrets.is_empty() && !vm.is_unborn_fork() {
                return Ok(None);
            }
            if let Some(ahead) = ahead.secrets {
                if self.secrets_digest(hostname, &vm.secrets)? == ahead {
                    tracing::debug!(vm = hostname, "its secrets were synced ahead");
                    return Ok(None);
                }
            }
            let synced = async {
                match tokio::time::timeout(step, self.sync_secrets(hostname, &vm.secrets, &client))
                    .await
                {
                    Ok(done) => done,
                    Err(_) => Err(Error::Timeout(format!(
                        "secrets: the agent did not answer within {}",
                        humantime::format_duration(step)
                    ))),
                }
            };
            Ok(Some(timed("secrets", synced).await?.0))
        };
        let ((fixups_done, report), network_done, keys_done, secrets_done) =
            tokio::try_join!(fixups, network_step, keys, secrets)?;
        let mut steps: Vec<StepTime> = [Some(fixups_done), network_done, keys_done, secrets_done]
            .into_iter()
            .flatten()
            .collect();
        if let Some(n) = network.filter(|_| setup.is_hot_fork()) {
            // Its own identity and address now (the fix-ups and the network
            // both done): out of quarantine.
            self.network
                .set_quarantine(n, false)
                .map_err(|source| Error::Network {
                    vm: hostname.to_owned(),
                    source,
                })?;
        }
        if first {
            if let Some(script) = &vm.userdata {
                setup_call(step, "userdata", client.userdata_run(script)).await?;
            }
        }
        if let Some(synced) = disk_synced {
            steps.push(timed("disk sync", synced).await?.0);
        }
        let boot_ms = now_ms().saturating_sub(started_ms);
        failpoint::hit(Failpoint::BootSetUp);
        self.store.set_running(hostname, boot_ms)?;
        self.notify(hostname);
        let steps: Vec<String> = steps.iter().map(|(n, ms)| format!("{n} {ms} ms")).collect();
        // The fix-ups' own steps, as the guest timed them.
        let fixup_steps: Vec<String> = report
            .steps
            .iter()
            .map(|t| format!("{} {:.1} ms", t.step.as_str(), t.micros as f64 / 1000.0))
            .collect();
        tracing::info!(
            vm = hostname,
            boot_ms,
            setup_ms = began.elapsed().as_millis() as u64,
            agent_ms,
            agent_tries,
            steps = %steps.join(", "),
            fixup_steps = %fixup_steps.join(", "),
            "agent ready"
        );
        if setup.is_hot_fork() {
            self.save_write_set(&vm).await;
        }
        Ok(())
    }

    /// A run ended: record why, release what it held, apply the exit
    /// policy. A run the record no longer names (suspended and restored
    /// since, say) changes nothing.
    async fn on_exit(self: &Arc<Self>, hostname: &str, instance: Instance, stop: Stop) {
        let _guard = self.lock_vm(hostname).await;
        let vm = match self.store.find_vm(hostname) {
            Ok(Some(vm))
                if vm.state.is_live()
                    && vm.pid == Some(instance.pid)
                    && vm.pid_start == Some(instance.pid_start) =>
            {
                vm
            }
            Ok(_) => return,
            Err(e) => {
                tracing::error!(
                    vm = hostname,
                    "its run ended, but its record cannot be read: {}",
                    chain(&e)
                );
                return;
            }
        };
        let requested = vm.state == VmState::Stopping;
        let forced = self.take_forced(hostname);
        let mode = stop_mode(forced.is_some(), stop.is_clean(), requested);
        let reason = forced.unwrap_or_else(|| stop.describe());
        let policy = after_exit(
            vm.state,
            vm.persistent,
            vm.is_unborn_fork(),
            stop.is_clean(),
        );
        tracing::info!(vm = hostname, %reason, stop = %mode, ?policy, "run ended");
        self.release_network(&vm);
        match policy {
            AfterExit::Keep(state) => self.record_exit(hostname, state, &reason, mode),
            AfterExit::Remove => {
                if vm.is_unborn_fork() {
                    self.remember_failure(hostname, &reason);
                }
                self.forget_logged(hostname);
            }
            AfterExit::KeepFailedDropDisk => {
                self.record_exit(hostname, VmState::Failed, &reason, mode);
                if let Err(e) = std::fs::remove_file(&vm.disk) {
                    tracing::warn!(vm = hostname, "cannot remove the disk {}: {e}", vm.disk);
                }
            }
        }
        self.notify(hostname);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_kill_by_the_daemon_is_forced() {
        assert_eq!(stop_mode(true, true, true), StopMode::Forced);
        assert_eq!(stop_mode(true, false, true), StopMode::Forced);
        assert_eq!(stop_mode(false, true, true), StopMode::Graceful);
        assert_eq!(stop_mode(false, true, false), StopMode::Guest);
        assert_eq!(stop_mode(false, false, false), StopMode::Crashed);
        assert_eq!(stop_mode(false, false, true), StopMode::Crashed);
    }

    #[test]
    fn the_exit_policy_keeps_persistent_vms_and_removes_what_never_came_up() {
        use AfterExit::*;
        use VmState::*;
        // Persistent: kept; stopped when clean or asked, failed otherwise.
        assert_eq!(after_exit(Running, true, false, true), Keep(Stopped));
        assert_eq!(after_exit(Running, true, false, false), Keep(Failed));
        assert_eq!(after_exit(Stopping, true, false, false), Keep(Stopped));
        // A clean stop before the agent answered is a failed boot.
        assert_eq!(after_exit(Starting, true, false, true), Keep(Failed));
        // An unborn fork leaves nothing, persistent or not.
        assert_eq!(after_exit(Starting, true, true, false), Remove);
        assert_eq!(after_exit(Starting, false, true, true), Remove);
        // ... unless it was being stopped on request.
        assert_eq!(after_exit(Stopping, true, true, true), Keep(Stopped));
        // Ephemeral: gone when stopped, record kept when failed.
        assert_eq!(after_exit(Running, false, false, true), Remove);
        assert_eq!(after_exit(Stopping, false, false, false), Remove);
        assert_eq!(after_exit(Running, false, false, false), KeepFailedDropDisk);
    }
}
