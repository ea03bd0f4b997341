//! The [`Daemon`]: its state (configuration, store, launcher, network
//! manager, boot slots, per-VM locks) and what every part of the core
//! shares: lookups, waits, the agent connection, records of a VM's end.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tine_client::AgentClient;
use tine_proto::agent::AGENT_VSOCK_PORT;
use tine_proto::api::{StopMode, VmState};
use tokio::sync::watch;

use super::dir_sync::DirSync;
use super::error::{chain, Error, Result};
use super::signals::VmSignals;
use super::spare_book::SpareBook;
use crate::config::{Config, HostGroup};
use crate::db::{now_ms, CommitFilter, CommitRecord, ImageRecord, Locking, Store, VmRecord};
use crate::failpoint::{self, Failpoint};
use crate::launcher::{Instance, Launcher, LauncherExt};
use crate::network::NetworkManager;
use crate::process::VmPaths;
use crate::secrets::SecretStore;

/// Time limits of a boot's set-up and of agent calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// From launch until the agent answers (boots in a nested test bed take
    /// tens of seconds).
    pub agent_ready: Duration,
    /// Each set-up call to the agent (fix-ups, network, userdata): a guest
    /// that misses it is marked failed and frees its boot slot. Three
    /// minutes: a debian guest's first fix-ups in the nested test bed, on
    /// a one-CPU L1, took over the minute this used to be.
    pub setup_call: Duration,
    /// The vsock handshake with the agent.
    pub handshake: Duration,
    /// How long a graceful shutdown gives the agent to take the request
    /// before it presses Ctrl-Alt-Del instead.
    pub shutdown_ask: Duration,
    /// How long a hot fork that finds no primed VM waits for one being
    /// primed for it: a priming takes milliseconds on a host, a second or
    /// two in a nested test bed.
    pub priming_wait: Duration,
    /// How long a hot fork's set-up counts as part of its launch at most
    /// (the spares are refilled once no launch is under way): a guest whose
    /// agent does not answer must not hold back every commit's refill
    /// until `agent_ready`. Set-ups take milliseconds on a host, a few
    /// seconds at worst in a nested test bed.
    pub launch_set_up: Duration,
}

/// How long a committed change may wait for its sync against a power
/// loss (commits, images and deletions are synced at once).
pub const STATE_SYNC_EVERY: Duration = Duration::from_secs(1);

/// WAL bytes at which the periodic sync copies the state's WAL into its
/// main file (a checkpoint, which requests wait for) when no hot fork
/// launch is under way; SQLite's own default is about as much (1000 pages).
pub const STATE_CHECKPOINT_QUIET: u64 = 4 << 20;

/// WAL bytes at which the periodic sync checkpoints whatever is under way,
/// so that a daemon that is never quiet still bounds its WAL.
pub const STATE_CHECKPOINT_ALWAYS: u64 = 64 << 20;

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            agent_ready: Duration::from_secs(600),
            setup_call: Duration::from_secs(180),
            handshake: Duration::from_secs(10),
            shutdown_ask: Duration::from_secs(5),
            priming_wait: Duration::from_secs(5),
            launch_set_up: Duration::from_secs(10),
        }
    }
}

/// What a [`Daemon`] runs on.
#[derive(Debug)]
pub struct Parts {
    /// Configuration.
    pub config: Config,
    /// Data directory (locked by the caller).
    pub data_dir: PathBuf,
    /// The state.
    pub store: Store,
    /// Host secrets (`<data_dir>/secrets`).
    pub secrets: SecretStore,
    /// Default guest kernel.
    pub kernel: PathBuf,
    /// What runs the VMs.
    pub launcher: Arc<dyn Launcher>,
    /// The host's network.
    pub network: NetworkManager,
    /// Time limits.
    pub deadlines: Deadlines,
}

impl Parts {
    /// Parts for a daemon whose VMs `launcher` runs (the fake one, in tests
    /// and benchmarks), its state in `data_dir` (made, with its `vms`
    /// folder), no guest kernel and no host network.
    pub fn on_launcher(
        config: Config,
        data_dir: PathBuf,
        launcher: Arc<dyn Launcher>,
        deadlines: Deadlines,
    ) -> Result<Parts> {
        Self::on_launcher_with(config, data_dir, launcher, deadlines, Locking::Exclusive)
    }

    /// [`Parts::on_launcher`], its state held as `locking` says.
    pub fn on_launcher_with(
        config: Config,
        data_dir: PathBuf,
        launcher: Arc<dyn Launcher>,
        deadlines: Deadlines,
        locking: Locking,
    ) -> Result<Parts> {
        std::fs::create_dir_all(data_dir.join("vms"))
            .map_err(|e| Error::io("create the data directory", e))?;
        Ok(Parts {
            config,
            store: Store::open_with(&data_dir.join("tine.db"), locking)?,
            secrets: SecretStore::open(&data_dir.join("secrets"))?,
            data_dir,
            kernel: PathBuf::from("/fake/vmlinux"),
            launcher,
            network: NetworkManager::default(),
            deadlines,
        })
    }
}

/// The daemon's core.
#[derive(Debug)]
pub struct Daemon {
    pub(super) config: Config,
    pub(super) data_dir: PathBuf,
    pub(super) store: Store,
    pub(super) secrets: SecretStore,
    pub(super) kernel: PathBuf,
    pub(super) launcher: Arc<dyn Launcher>,
    pub(super) network: NetworkManager,
    pub(super) deadlines: Deadlines,
    /// One address allocation at a time: concurrent creates must not pick
    /// the same free address.
    pub(super) allocate: Mutex<()>,
    started_ms: u64,
    /// Signalled on every change of a VM's record or process; its waiters
    /// re-read the store.
    changes: VmSignals,
    /// Serialises life-cycle operations per VM.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Serialises image imports (concurrent creates share one copy).
    pub(super) imports: Mutex<()>,
    /// Names of the images being imported (`POST /images`).
    pub(super) importing: Mutex<std::collections::HashSet<String>>,
    /// Serialises warm pool resizes: each reads the sizes wanted and
    /// applies them, so a later change is never undone by an earlier one.
    pub(super) pool_sizing: tokio::sync::Mutex<()>,
    /// Networks, disks and primed VMs made ahead of hot forks (see
    /// `spares`).
    pub(super) spares: Mutex<SpareBook>,
    /// Serialises spare fills, as `pool_sizing` does pool resizes.
    pub(super) spare_sizing: tokio::sync::Mutex<()>,
    /// Told whenever a VM's priming ends (whichever way).
    pub(super) priming_ended: tokio::sync::Notify,
    /// Hot fork launches under way: the spares are refilled once none is.
    pub(super) hot_launches: std::sync::atomic::AtomicUsize,
    /// Memory commits whose write set a fork is saving (one fork of a
    /// burst saves it).
    pub(super) saving_write_sets: Mutex<std::collections::HashSet<String>>,
    /// Boot slots: at most this many VMs between launch and agent-ready.
    pub(super) boot_slots: Arc<tokio::sync::Semaphore>,
    /// Syncs of the `vms` folder, shared by the new VMs that wait for
    /// their folder's name in it to reach stable storage.
    pub(super) vms_dir_sync: Arc<DirSync>,
    /// Why removed VMs failed (forks that never came up), for waiters.
    failures: Mutex<HashMap<String, String>>,
    /// VMs being stopped without the guest's help, with the reason their
    /// exit is recorded under ([`StopMode::Forced`]).
    forced: Mutex<HashMap<String, String>>,
    /// Commits whose metadata was checked, with the file's stamp then.
    verified: Mutex<HashMap<String, FileStamp>>,
    /// VMs whose vCPUs are parked (`pause`), with the pid of the run that
    /// was paused: a later run is not paused.
    paused: Mutex<HashMap<String, u32>>,
    /// The runs being supervised whose process has not ended yet.
    runs: Mutex<HashMap<String, Instance>>,
    /// Set by `POST /daemon/shutdown`; the server exits when it changes.
    stop_requested: watch::Sender<bool>,
}

/// Removes a file, logging a failure (one already gone is fine).
pub(super) fn remove_file_logged(path: &std::path::Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("cannot remove {}: {e}", path.display());
        }
    }
}

/// Syncs a disk and its folder (`storage::sync_disk`) on a blocking
/// thread; `what` says what the sync was for in an error.
pub(super) async fn sync_disk_off_thread(
    disk: std::path::PathBuf,
    what: impl Into<String>,
) -> Result<()> {
    tokio::task::spawn_blocking(move || crate::storage::sync_disk(&disk))
        .await
        .map_err(|source| Error::Task {
            what: "sync disk",
            source,
        })?
        .map_err(|e| Error::disk(what, e))
}

/// A file's inode, size and modification time.
pub(super) type FileStamp = (u64, u64, i64, i64);

/// Most bytes of a stop or failure reason kept (guest text included).
pub const MAX_REASON: usize = 4096;

/// `reason` cut to [`MAX_REASON`] bytes on a character boundary.
pub fn capped(reason: &str) -> String {
    if reason.len() <= MAX_REASON {
        return reason.to_owned();
    }
    let mut end = MAX_REASON;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes cut)", &reason[..end], reason.len() - end)
}

impl Daemon {
    /// A daemon over `parts`.
    pub fn from_parts(parts: Parts) -> Arc<Self> {
        let boot_concurrency = parts
            .config
            .boot_concurrency
            .map(|n| n as usize)
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(usize::from)
                    .unwrap_or(1)
            });
        Arc::new(Daemon {
            vms_dir_sync: Arc::new(DirSync::new(parts.data_dir.join("vms"))),
            config: parts.config,
            data_dir: parts.data_dir,
            store: parts.store,
            secrets: parts.secrets,
            kernel: parts.kernel,
            launcher: parts.launcher,
            network: parts.network,
            deadlines: parts.deadlines,
            allocate: Mutex::new(()),
            started_ms: now_ms(),
            changes: VmSignals::default(),
            locks: Mutex::new(HashMap::new()),
            imports: Mutex::new(()),
            importing: Mutex::default(),
            failures: Mutex::new(HashMap::new()),
            forced: Mutex::new(HashMap::new()),
            verified: Mutex::new(HashMap::new()),
            paused: Mutex::new(HashMap::new()),
            runs: Mutex::new(HashMap::new()),
            stop_requested: watch::channel(false).0,
            pool_sizing: tokio::sync::Mutex::new(()),
            spares: Mutex::default(),
            spare_sizing: tokio::sync::Mutex::new(()),
            priming_ended: tokio::sync::Notify::new(),
            hot_launches: std::sync::atomic::AtomicUsize::new(0),
            saving_write_sets: Mutex::default(),
            boot_slots: Arc::new(tokio::sync::Semaphore::new(boot_concurrency.max(1))),
        })
    }

    /// The book of spares (see `spares`).
    pub(super) fn spare_book(&self) -> std::sync::MutexGuard<'_, SpareBook> {
        // The book is consistent between its calls: a panic elsewhere
        // leaves it usable.
        self.spares.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Asks the server to exit (VMs keep running, as on SIGTERM).
    pub fn request_stop(&self) {
        self.stop_requested.send_replace(true);
    }

    /// Resolves once [`Daemon::request_stop`] was called.
    pub async fn stop_requested(&self) {
        let mut rx = self.stop_requested.subscribe();
        // The sender lives as long as `self`, so this never fails.
        let stopped = rx.wait_for(|stop| *stop).await.map(drop);
        if let Err(e) = stopped {
            tracing::warn!("the stop signal went away: {e}");
        }
    }

    /// Whether the VM's current run is paused.
    pub fn is_paused(&self, vm: &VmRecord) -> bool {
        let paused = self.paused.lock().unwrap_or_else(|p| p.into_inner());
        vm.state == VmState::Running
            && vm.pid.is_some()
            && paused.get(&vm.hostname) == vm.pid.as_ref()
    }

    /// Parks a running VM's vCPUs (a paused one stays paused); 409 when it
    /// does not run.
    pub async fn pause(&self, key: &str) -> Result<VmRecord> {
        let hostname = self.vm(key)?.hostname;
        let _guard = self.lock_vm(&hostname).await;
        let vm = self.vm(&hostname)?;
        let (VmState::Running, Some(pid)) = (vm.state, vm.pid) else {
            return Err(Error::Conflict(format!(
                "{hostname} is {}; only a running VM can be paused",
                vm.state
            )));
        };
        if self.is_paused(&vm) {
            return Ok(vm);
        }
        self.launcher
            .pause(&hostname)
            .await
            .map_err(|source| Error::Launch {
                what: format!("pause {hostname}"),
                source,
            })?;
        self.remember_paused(&hostname, pid);
        Ok(vm)
    }

    /// Runs a paused VM's vCPUs again; 409 when it is not paused.
    pub async fn resume(&self, key: &str) -> Result<VmRecord> {
        let hostname = self.vm(key)?.hostname;
        let _guard = self.lock_vm(&hostname).await;
        let vm = self.vm(&hostname)?;
        if !self.is_paused(&vm) {
            return Err(Error::Conflict(format!("{hostname} is not paused")));
        }
        self.launcher
            .resume(&hostname)
            .await
            .map_err(|source| Error::Launch {
                what: format!("resume {hostname}"),
                source,
            })?;
        self.forget_paused(&hostname);
        Ok(vm)
    }

    /// Forgets that `hostname`'s run was paused (it ended or was resumed).
    pub(super) fn forget_paused(&self, hostname: &str) {
        self.paused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(hostname);
    }

    /// Remembers that the run `pid` of `hostname` is paused.
    pub(super) fn remember_paused(&self, hostname: &str, pid: u32) {
        self.paused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(hostname.to_owned(), pid);
    }

    /// Notes that `instance` of `hostname` is supervised (its process runs).
    pub(super) fn run_started(&self, hostname: &str, instance: Instance) {
        self.runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(hostname.to_owned(), instance);
    }

    /// Notes that the process of `instance` has ended, and wakes waiters.
    pub(super) fn run_ended(&self, hostname: &str, instance: Instance) {
        {
            let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
            if runs.get(hostname) == Some(&instance) {
                runs.remove(hostname);
            }
        }
        self.notify(hostname);
    }

    /// Waits until the process of `instance` has ended; false when
    /// `timeout` passed first.
    pub(super) async fn wait_run_ended(
        &self,
        hostname: &str,
        instance: Instance,
        timeout: Duration,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.changes.subscribe(hostname);
        loop {
            rx.borrow_and_update();
            let running = self
                .runs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(hostname)
                == Some(&instance);
            if !running {
                return true;
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return false;
            }
        }
    }

    /// Resumes `vm` if its run is paused, so a stop can ask its guest.
    pub(super) async fn unpause_for_stop(&self, vm: &VmRecord) {
        if self.is_paused(vm) {
            if let Err(e) = self.launcher.resume(&vm.hostname).await {
                tracing::warn!(vm = %vm.hostname, "resume before stop: {e}");
            }
            self.forget_paused(&vm.hostname);
        }
    }

    /// Syncs the state (see [`crate::db`]) every `STATE_SYNC_EVERY` in
    /// the background, for as long as the daemon exists: a change not
    /// synced at once survives a power loss after at most that long.
    pub fn sync_state_periodically(self: &Arc<Self>) {
        let daemon = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(STATE_SYNC_EVERY);
            loop {
                tick.tick().await;
                let Some(d) = daemon.upgrade() else { break };
                d.sync_state().await;
            }
        });
    }

    /// Syncs the state now, and checkpoints its WAL when it has grown
    /// (see `STATE_CHECKPOINT_QUIET`); off the async threads, as both wait
    /// for the disk.
    pub async fn sync_state(self: &Arc<Self>) {
        let d = self.clone();
        let synced = tokio::task::spawn_blocking(move || {
            d.store.sync()?;
            let quiet = d.hot_launches.load(std::sync::atomic::Ordering::SeqCst) == 0;
            let wal_bytes = d.store.wal_bytes();
            let began = std::time::Instant::now();
            let checkpointed = d.store.checkpoint(if quiet {
                STATE_CHECKPOINT_QUIET
            } else {
                STATE_CHECKPOINT_ALWAYS
            })?;
            if checkpointed {
                tracing::debug!(
                    wal_bytes,
                    micros = began.elapsed().as_micros() as u64,
                    "state WAL checkpointed"
                );
            }
            Ok::<_, crate::db::DbError>(())
        })
        .await;
        match synced {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!("cannot sync the state: {}", chain(&e)),
            Err(e) => tracing::warn!("the state sync did not finish: {e}"),
        }
    }

    /// The data directory.
    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    /// When the daemon started (Unix ms).
    pub fn started_ms(&self) -> u64 {
        self.started_ms
    }

    /// The files of a VM.
    pub fn paths(&self, hostname: &str) -> VmPaths {
        VmPaths::new(&self.data_dir, hostname)
    }

    /// How many VMs exist (in `group`, or all).
    pub fn vm_count(&self, group: Option<&str>) -> Result<usize> {
        Ok(self.store.list_vms(group)?.len())
    }

    /// The imported image called `name`, if it was imported.
    pub fn image(&self, name: &str) -> Result<Option<ImageRecord>> {
        Ok(self.store.get_image(name)?)
    }

    /// Commits matching every filter given.
    pub fn commits(&self, filter: &CommitFilter<'_>) -> Result<Vec<CommitRecord>> {
        Ok(self.store.list_commits(filter)?)
    }

    /// Wakes the waiters of `hostname` (its record or process changed).
    pub(super) fn notify(&self, hostname: &str) {
        self.changes.notify(hostname);
    }

    /// Wakes every waiter (a change that may touch any VM).
    pub(super) fn notify_all(&self) {
        self.changes.notify_all();
    }

    pub(super) async fn lock_vm(&self, hostname: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = {
            let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
            locks.entry(hostname.to_owned()).or_default().clone()
        };
        m.lock_owned().await
    }

    /// The group called `name`, or not found.
    pub fn group(&self, name: &str) -> Result<&HostGroup> {
        self.config.group(name).ok_or_else(|| {
            let known: Vec<&str> = self
                .config
                .host_groups
                .iter()
                .map(|g| g.name.as_str())
                .collect();
            Error::NotFound(format!(
                "no host group `{name}` (known: {})",
                known.join(", ")
            ))
        })
    }

    /// The commit `id`, or not found.
    pub(super) fn commit_record(&self, id: &str) -> Result<CommitRecord> {
        self.store.get_commit(id)?.ok_or_else(|| no_commit(id))
    }

    /// The VM with this hostname or friendly name, or not found.
    pub fn vm(&self, key: &str) -> Result<VmRecord> {
        self.store
            .find_vm(key)?
            .ok_or_else(|| Error::NotFound(format!("no VM called `{key}`")))
    }

    /// Waits until `hostname` is running (agent ready), failed, stopped or
    /// gone, or `timeout` passes.
    pub async fn wait_running(&self, hostname: &str, timeout: Duration) -> Result<VmRecord> {
        self.wait_until(hostname, timeout, |vm| vm.state == VmState::Running)
            .await
    }

    /// Waits until `hostname`'s record satisfies `done` (or its start
    /// failed: an error says why). Only changes of that VM wake it.
    pub(super) async fn wait_until(
        &self,
        hostname: &str,
        timeout: Duration,
        done: impl Fn(&VmRecord) -> bool,
    ) -> Result<VmRecord> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.changes.subscribe(hostname);
        loop {
            rx.borrow_and_update();
            let vm = self.store.find_vm(hostname)?.ok_or_else(|| {
                let why = self
                    .failures
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(hostname)
                    .cloned()
                    .unwrap_or_else(|| "no reason recorded".into());
                Error::Failed(format!("{hostname} failed to start and was removed: {why}"))
            })?;
            if vm.hostname != hostname {
                // Called with a friendly name: its changes are signalled
                // under the hostname.
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                return Box::pin(self.wait_until(&vm.hostname, left, done)).await;
            }
            if done(&vm) {
                return Ok(vm);
            }
            match vm.state {
                VmState::Failed | VmState::Stopped | VmState::Suspended => {
                    return Err(Error::Failed(format!(
                        "{hostname} {} before its agent answered: {}",
                        vm.state,
                        vm.reason.as_deref().unwrap_or("no reason recorded")
                    )))
                }
                _ => {}
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(Error::ShuttingDown),
                Err(_) => {
                    return Err(Error::Timeout(format!(
                        "{hostname} is still {} after {}; it keeps booting",
                        vm.state,
                        humantime::format_duration(timeout)
                    )))
                }
            }
        }
    }

    /// Waits until `hostname` is no longer live (or gone); false when
    /// `timeout` passed first.
    pub(super) async fn wait_not_live(&self, hostname: &str, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.changes.subscribe(hostname);
        loop {
            rx.borrow_and_update();
            match self.store.find_vm(hostname) {
                Ok(Some(vm)) if vm.state.is_live() => {}
                Ok(_) => return true,
                Err(e) => {
                    tracing::warn!(vm = hostname, "cannot read its record: {e}");
                    return true;
                }
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return false;
            }
        }
    }

    pub(super) fn remember_failure(&self, hostname: &str, reason: &str) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if f.len() > 1024 {
            f.clear();
        }
        f.insert(hostname.to_owned(), capped(reason));
    }

    /// Marks a VM as being stopped without the guest's help: its exit is
    /// recorded as [`StopMode::Forced`] with `reason`.
    pub(super) fn mark_forced(&self, hostname: &str, reason: String) {
        self.forced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(hostname.to_owned(), reason);
    }

    pub(super) fn verified_stamp(&self, commit: &str) -> Option<FileStamp> {
        self.verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(commit)
            .copied()
    }

    pub(super) fn remember_verified(&self, commit: &str, stamp: FileStamp) {
        self.verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(commit.to_owned(), stamp);
    }

    pub(super) fn take_forced(&self, hostname: &str) -> Option<String> {
        self.forced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(hostname)
    }

    /// Records a VM's end (its process is gone), logging a failed write.
    pub(super) fn record_exit(&self, hostname: &str, state: VmState, reason: &str, mode: StopMode) {
        let reason = capped(reason);
        if let Err(e) = self
            .store
            .clear_process(hostname, state, Some(&reason), Some(mode))
        {
            tracing::error!(
                vm = hostname,
                "cannot record that it is {state} ({reason}): {}",
                chain(&e)
            );
        }
    }

    /// Removes a VM's record, then its folder (disk, sockets, logs). Record
    /// first: a crash in between leaves an orphan folder, which the next
    /// start removes, never a record without its disk.
    pub(super) fn forget(&self, hostname: &str) -> Result<()> {
        self.store.delete_vm(hostname)?;
        failpoint::hit(Failpoint::DeleteRecordRemoved);
        let dir = self.paths(hostname).dir;
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!(vm = hostname, "cannot remove {}: {e}", dir.display())
            }
            _ => {}
        }
        Ok(())
    }

    /// [`Daemon::forget`], logging a failed removal.
    pub(super) fn forget_logged(&self, hostname: &str) {
        if let Err(e) = self.forget(hostname) {
            tracing::error!(vm = hostname, "cannot remove its record: {}", chain(&e));
        }
    }

    /// Connects to a VM's agent once (vsock port 52, then the handshake).
    pub async fn connect_agent(&self, hostname: &str) -> Result<AgentClient> {
        let io = self
            .launcher
            .connect(hostname, AGENT_VSOCK_PORT)
            .await
            .map_err(|e| Error::AgentUnavailable(chain(&e)))?;
        let within = self.deadlines.handshake;
        match tokio::time::timeout(within, AgentClient::handshake(io)).await {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(source)) => Err(Error::Agent {
                what: format!("agent handshake with {hostname}"),
                source,
            }),
            Err(_) => Err(Error::AgentUnavailable(format!(
                "the agent of {hostname} did not finish the handshake within {}",
                humantime::format_duration(within)
            ))),
        }
    }

    /// An agent connection for a request: the VM must be running.
    pub async fn agent(&self, key: &str) -> Result<(VmRecord, AgentClient)> {
        let vm = self.vm(key)?;
        match vm.state {
            VmState::Running | VmState::Starting => {}
            VmState::Suspended | VmState::Suspending => {
                return Err(Error::Conflict(format!(
                    "{} is {}; restore it first (tine vm restore {})",
                    vm.hostname, vm.state, vm.hostname
                )))
            }
            _ => {
                return Err(Error::Conflict(format!(
                    "{} is {}; start it with relaunch first",
                    vm.hostname, vm.state
                )))
            }
        }
        let client = self.connect_agent(&vm.hostname).await.map_err(|e| {
            Error::AgentUnavailable(format!(
                "agent of {} does not answer: {}",
                vm.hostname,
                chain(&e)
            ))
        })?;
        Ok((vm, client))
    }
}

/// The error for a commit id nothing is recorded under.
pub(super) fn no_commit(id: &str) -> Error {
    Error::NotFound(format!("no commit `{id}`"))
}
