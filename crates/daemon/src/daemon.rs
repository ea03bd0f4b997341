//! The daemon's core: host groups, VM life cycles and their supervision,
//! independent of HTTP (the `api` module maps routes onto these methods).
//!
//! Every VM change is recorded in the [`Store`] before files or processes
//! are touched and after they are done, so start-up reconciliation
//! (`Daemon::reconcile`) can finish or undo whatever a `kill -9` interrupted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_client::AgentClient;
use tine_proto::agent::{FixupRequest, ShutdownAction, AGENT_VSOCK_PORT};
use tine_proto::api::{self, CreateVmRequest, StopMode, VmState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::artifacts;
use crate::config::{Config, HostGroup, Reconcile, MIN_RAM_MB};
use crate::db::{now_ms, NewVm, Store, VmRecord};
use crate::error::{ApiError, ApiResult};
use crate::failpoint::{self, Failpoint};
use crate::process::{self, LaunchSpec, VmPaths};
use crate::storage;
use tine_proto::vmm::{Request as VmmRequest, Response as VmmResponse};

/// Kernel command line for every VM (the image's init is the agent).
pub const BASE_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 pci=off nomodule nokaslr \
     i8042.noaux i8042.nomux i8042.dumbkbd i8042.nopnp swiotlb=noforce cryptomgr.notests \
     quiet root=/dev/vda rw init=/sbin/init";

/// Fix-ups a fork gets unless it asks otherwise.
pub const DEFAULT_FIXUPS: &[&str] = &["hostname", "machine-id", "ssh-host-keys"];

/// How long a graceful shutdown waits before killing.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a graceful shutdown waits for the agent to take the request
/// before it presses Ctrl-Alt-Del instead.
const AGENT_SHUTDOWN_ASK: Duration = Duration::from_secs(5);

/// How long a request on a VMM's control socket may take to be answered.
const VMM_CONTROL_ANSWER: Duration = Duration::from_secs(5);

/// What a create or fork waits for before answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Answer once the process runs.
    None,
    /// Answer once the agent has answered and the set-up is done.
    Agent,
}

/// The daemon.
#[derive(Debug)]
pub struct Daemon {
    /// Configuration.
    pub config: Config,
    /// Data directory.
    pub data_dir: PathBuf,
    /// State.
    pub store: Store,
    /// tine-vmm binary.
    pub vmm: PathBuf,
    /// Default guest kernel.
    pub kernel: PathBuf,
    /// When the daemon started (Unix ms).
    pub started_ms: u64,
    /// Bumped on every VM state change; waiters re-read the store.
    changes: watch::Sender<u64>,
    /// Serialises life-cycle operations per VM.
    locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Serialises image imports (concurrent creates share one copy).
    imports: std::sync::Mutex<()>,
    /// Boot slots: at most this many VMs between launch and agent-ready.
    boot_slots: Arc<tokio::sync::Semaphore>,
    /// Why removed VMs failed (forks that never came up), for waiters.
    failures: std::sync::Mutex<HashMap<String, String>>,
    /// VMs being stopped without the guest's help, with the reason their
    /// exit is recorded under ([`StopMode::Forced`]).
    forced: std::sync::Mutex<HashMap<String, String>>,
}

fn internal(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(format!("{what}: {e}"))
}

/// How a run ended: `forced` when the daemon killed it, `clean` when the
/// VMM reported a power-off, reboot or requested kill, `requested` when the
/// daemon had asked it to stop.
fn stop_mode(forced: bool, clean: bool, requested: bool) -> StopMode {
    match (forced, clean, requested) {
        (true, _, _) => StopMode::Forced,
        (false, false, _) => StopMode::Crashed,
        (false, true, true) => StopMode::Graceful,
        (false, true, false) => StopMode::Guest,
    }
}

/// Checks a tag: 1..=128 printable characters without spaces or commas.
pub fn validate_tag(tag: &str) -> ApiResult<()> {
    if tag.is_empty()
        || tag.len() > 128
        || tag
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == ',')
    {
        return Err(ApiError::bad_request(format!(
            "tag `{tag}` is invalid: use 1-128 characters without spaces or commas, like key=value"
        )));
    }
    Ok(())
}

/// Checks a friendly name: like a hostname label.
pub fn validate_name(name: &str) -> ApiResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "name `{name}` is invalid: use 1-63 letters, digits, '-', '_' or '.'"
        )))
    }
}

impl Daemon {
    /// Opens the state in `data_dir` (which the caller has locked).
    pub fn new(config: Config, data_dir: PathBuf) -> anyhow::Result<Arc<Self>> {
        use anyhow::Context;
        std::fs::create_dir_all(data_dir.join("vms"))
            .with_context(|| format!("create {}", data_dir.display()))?;
        let store = Store::open(&data_dir.join("tine.db"))
            .with_context(|| format!("open {}", data_dir.join("tine.db").display()))?;
        let vmm = artifacts::find_vmm(config.vmm.as_deref())?;
        let kernel = artifacts::find_kernel(config.kernel.as_deref(), &data_dir)?;
        let (changes, _) = watch::channel(0);
        let boot_concurrency = config
            .boot_concurrency
            .map(|n| n as usize)
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(usize::from)
                    .unwrap_or(1)
            });
        Ok(Arc::new(Daemon {
            config,
            data_dir,
            store,
            vmm,
            kernel,
            started_ms: now_ms(),
            changes,
            locks: std::sync::Mutex::new(HashMap::new()),
            imports: std::sync::Mutex::new(()),
            failures: std::sync::Mutex::new(HashMap::new()),
            forced: std::sync::Mutex::new(HashMap::new()),
            boot_slots: Arc::new(tokio::sync::Semaphore::new(boot_concurrency)),
        }))
    }

    /// The files of a VM.
    pub fn paths(&self, hostname: &str) -> VmPaths {
        VmPaths::new(&self.data_dir, hostname)
    }

    fn notify(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub(crate) async fn lock_vm(&self, hostname: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = {
            let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
            locks.entry(hostname.to_owned()).or_default().clone()
        };
        m.lock_owned().await
    }

    /// The group called `name`, or 404.
    pub fn group(&self, name: &str) -> ApiResult<&HostGroup> {
        self.config.group(name).ok_or_else(|| {
            let known: Vec<&str> = self
                .config
                .host_groups
                .iter()
                .map(|g| g.name.as_str())
                .collect();
            ApiError::not_found(format!(
                "no host group `{name}` (known: {})",
                known.join(", ")
            ))
        })
    }

    /// The VM with this hostname or friendly name, or 404.
    pub fn vm(&self, key: &str) -> ApiResult<VmRecord> {
        self.store
            .find_vm(key)?
            .ok_or_else(|| ApiError::not_found(format!("no VM called `{key}`")))
    }

    /// Describes a VM for the API.
    pub fn describe(&self, vm: &VmRecord) -> api::VmInfo {
        let (size, allocated, format) = storage::describe(Path::new(&vm.disk));
        let network = vm.network.as_ref().and_then(crate::vmnet::describe);
        api::VmInfo {
            hostname: vm.hostname.clone(),
            host_group: vm.host_group.clone(),
            state: vm.state,
            cpus: vm.cpus,
            ram_bytes: vm.ram_bytes,
            persistent: vm.persistent,
            tags: vm.tags.clone(),
            ip: network
                .as_ref()
                .map(|n| n.address.split('/').next().unwrap_or_default().to_owned()),
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
            storage: api::StorageInfo {
                path: vm.disk.clone(),
                format,
                size_bytes: size,
                allocated_bytes: allocated,
            },
        }
    }

    /// Waits until `hostname` is running (agent ready), failed, stopped or
    /// gone, or `timeout` passes.
    pub async fn wait_running(&self, hostname: &str, timeout: Duration) -> ApiResult<VmRecord> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.changes.subscribe();
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
                ApiError::internal(format!("{hostname} failed to start and was removed: {why}"))
            })?;
            match vm.state {
                VmState::Running => return Ok(vm),
                VmState::Failed | VmState::Stopped => {
                    return Err(ApiError::internal(format!(
                        "{hostname} {} before its agent answered: {}",
                        vm.state,
                        vm.reason.as_deref().unwrap_or("no reason recorded")
                    )))
                }
                _ => {}
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(ApiError::internal("the daemon is shutting down")),
                Err(_) => {
                    return Err(ApiError::timeout(format!(
                        "{hostname} is still {} after {}; it keeps booting",
                        vm.state,
                        humantime::format_duration(timeout)
                    )))
                }
            }
        }
    }

    /// Checks a create request against its group and fills in defaults.
    pub fn plan_vm(
        &self,
        group: &HostGroup,
        req: &CreateVmRequest,
        managed: bool,
    ) -> ApiResult<NewVm> {
        let cpus = req.cpus.unwrap_or(group.cpus);
        if cpus == 0 || cpus > group.max_cpus() {
            return Err(ApiError::bad_request(format!(
                "cpus {cpus} is outside 1..={} allowed by host group `{}`",
                group.max_cpus(),
                group.name
            )));
        }
        let ram_bytes = req.ram_bytes.unwrap_or(group.ram_mb << 20);
        let max = group.max_ram_mb() << 20;
        if ram_bytes > max || ram_bytes < (MIN_RAM_MB << 20) || !ram_bytes.is_multiple_of(1 << 20) {
            return Err(ApiError::bad_request(format!(
                "ram_bytes {ram_bytes} is outside {}..={max} (whole MiB) allowed by host group `{}`",
                MIN_RAM_MB << 20,
                group.name
            )));
        }
        for t in &req.tags {
            validate_tag(t)?;
        }
        let mut tags = req.tags.clone();
        if let Some(name) = &req.name {
            validate_name(name)?;
            if self.store.find_vm(name)?.is_some() {
                return Err(ApiError::conflict(format!(
                    "the name `{name}` is already used"
                )));
            }
            tags.retain(|t| !t.starts_with("name="));
            tags.push(format!("name={name}"));
        }
        let userdata = match &req.userdata {
            Some(u) => Some(u.clone()),
            None => group
                .userdata()
                .map_err(|e| ApiError::internal(e.to_string()))?,
        };
        let policy = match &req.network {
            Some(p) => {
                crate::vmnet::validate_policy(p)
                    .map_err(|e| ApiError::bad_request(e.to_string()))?;
                Some(serde_json::to_value(p).map_err(|e| internal("encode policy", e))?)
            }
            None => None,
        };
        Ok(NewVm {
            host_group: group.name.clone(),
            cpus,
            ram_bytes,
            persistent: managed || req.persistent.unwrap_or(group.persistent),
            managed,
            tags,
            name: req.name.clone(),
            userdata,
            policy,
            parent_commit_id: None,
            fixups: None,
            booted_once: false,
        })
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
    ) -> ApiResult<api::CreateVmResponse> {
        let started = Instant::now();
        let group = self.group(group)?.clone();
        let new = self.plan_vm(&group, &req, managed)?;
        let this = self.clone();
        let image = group.image.clone();
        let size = group
            .storage_bytes()
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let job = tokio::spawn(async move {
            let this2 = this.clone();
            let base = tokio::task::spawn_blocking(move || {
                let _one = this2.imports.lock().unwrap_or_else(|p| p.into_inner());
                artifacts::image_base(&this2.store, &image, &this2.data_dir)
            })
            .await
            .map_err(|e| internal("import image", e))??;
            let base = PathBuf::from(&base.path);
            this.provision(&new, move |disk: &Path| {
                storage::create_disk(&base, disk, size).map_err(|e| internal("create disk", e))
            })
            .await
        });
        let hostname = job.await.map_err(|e| internal("create", e))??;
        let vm = match wait {
            Wait::Agent => self.wait_running(&hostname, timeout).await?,
            Wait::None => self.vm(&hostname)?,
        };
        let info = self.describe(&vm);
        Ok(api::CreateVmResponse {
            hostname,
            state: vm.state,
            ip: info.ip,
            elapsed_ms: started.elapsed().as_millis() as u64,
        })
    }

    fn remember_failure(&self, hostname: &str, reason: &str) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if f.len() > 1024 {
            f.clear();
        }
        f.insert(hostname.to_owned(), reason.to_owned());
    }

    /// Records a new VM, makes its disk with `make_disk` and starts it; on
    /// any failure it leaves nothing behind (no record, files or network).
    pub(crate) async fn provision(
        self: &Arc<Self>,
        new: &NewVm,
        make_disk: impl FnOnce(&Path) -> ApiResult<()>,
    ) -> ApiResult<String> {
        let data_dir = self.data_dir.clone();
        let vm = self.store.insert_vm(new, |h| {
            VmPaths::new(&data_dir, h)
                .dir
                .join("disk.qcow2")
                .display()
                .to_string()
        })?;
        self.notify();
        failpoint::hit(Failpoint::ProvisionRecorded);
        let hostname = vm.hostname.clone();
        let result = async {
            std::fs::create_dir_all(self.paths(&hostname).dir)
                .map_err(|e| internal("create VM folder", e))?;
            make_disk(Path::new(&vm.disk))?;
            failpoint::hit(Failpoint::ProvisionDiskMade);
            self.start(&hostname).await
        }
        .await;
        if let Err(e) = result {
            self.discard(&hostname).await;
            return Err(e);
        }
        Ok(hostname)
    }

    /// Removes every trace of a VM (record, files, network).
    pub(crate) async fn discard(&self, hostname: &str) {
        if let Ok(Some(vm)) = self.store.find_vm(hostname) {
            self.release_network(&vm);
            if let (Some(pid), Some(start)) = (vm.pid, vm.pid_start) {
                process::kill_if_ours(pid, start, &self.paths(hostname));
            }
        }
        let _ = self.forget(hostname);
        self.notify();
    }

    /// Removes a VM's record, then its folder (disk, sockets, logs). Record
    /// first: a crash in between leaves an orphan folder, which the next
    /// start removes, never a record without its disk.
    fn forget(&self, hostname: &str) -> crate::db::Result<()> {
        self.store.delete_vm(hostname)?;
        failpoint::hit(Failpoint::DeleteRecordRemoved);
        let _ = std::fs::remove_dir_all(self.paths(hostname).dir);
        Ok(())
    }

    fn release_network(&self, vm: &VmRecord) {
        if let Some(n) = &vm.network {
            if let Err(e) = crate::vmnet::release(n) {
                tracing::warn!(vm = %vm.hostname, "release network: {e}");
            }
        }
    }

    /// Queues the VM's boot: it is `starting` (without a process) at once,
    /// and its tine-vmm is launched when a boot slot is free
    /// (`boot_concurrency`): a storm of creates boots a few at a time
    /// instead of starving every guest.
    pub(crate) async fn start(self: &Arc<Self>, hostname: &str) -> ApiResult<()> {
        self.store.queue_start(hostname)?;
        self.notify();
        failpoint::hit(Failpoint::BootQueued);
        let this = self.clone();
        let h = hostname.to_owned();
        tokio::spawn(async move {
            let permit = this.boot_slots.clone().acquire_owned().await.ok();
            let _guard = this.lock_vm(&h).await;
            match this.store.find_vm(&h) {
                Ok(Some(vm)) if vm.state == VmState::Starting && vm.pid.is_none() => {}
                // Deleted or stopped while it waited.
                _ => return,
            }
            if let Err(e) = this.launch(&h, permit) {
                tracing::warn!(vm = %h, "launch: {}", e.message);
                this.launch_failed(&h, &e.message);
            }
        });
        Ok(())
    }

    /// A queued VM could not be launched: a fork is removed (its waiter
    /// learns why), any other VM is recorded as failed with the reason.
    fn launch_failed(&self, hostname: &str, reason: &str) {
        let Ok(Some(vm)) = self.store.find_vm(hostname) else {
            return;
        };
        self.release_network(&vm);
        if vm.is_unborn_fork() {
            self.remember_failure(hostname, reason);
            let _ = self.forget(hostname);
        } else {
            self.record_exit(hostname, VmState::Failed, reason, StopMode::Crashed);
        }
        self.notify();
    }

    /// Records a VM's end (its process is gone), logging a failed write.
    fn record_exit(&self, hostname: &str, state: VmState, reason: &str, mode: StopMode) {
        if let Err(e) = self
            .store
            .clear_process(hostname, state, Some(reason), Some(mode))
        {
            tracing::error!(
                vm = hostname,
                "cannot record that it is {state} ({reason}): {e}"
            );
        }
    }

    /// Removes a VM's record and folder, logging a failed removal.
    fn forget_logged(&self, hostname: &str) {
        if let Err(e) = self.forget(hostname) {
            tracing::error!(vm = hostname, "cannot remove its record: {e}");
        }
    }

    /// Marks a VM as being stopped without the guest's help: its exit is
    /// recorded as [`StopMode::Forced`] with `reason`.
    fn mark_forced(&self, hostname: &str, reason: String) {
        self.forced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(hostname.to_owned(), reason);
    }

    fn take_forced(&self, hostname: &str) -> Option<String> {
        self.forced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(hostname)
    }

    /// Launches the VM's process and supervises it (the set-up at
    /// agent-ready, then its exit); `permit` is the boot slot, held until
    /// the boot's set-up ends.
    fn launch(
        self: &Arc<Self>,
        hostname: &str,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> ApiResult<()> {
        let vm = self.vm(hostname)?;
        let group = self.group(&vm.host_group)?.clone();
        let paths = self.paths(hostname);
        let network = crate::vmnet::attach(self, &group, &vm)
            .map_err(|e| ApiError::internal(format!("network for {hostname}: {e}")))?;
        self.store.set_network(hostname, network.as_ref())?;
        let mut cmdline = BASE_CMDLINE.to_owned();
        if let Some(extra) = &self.config.cmdline {
            cmdline.push(' ');
            cmdline.push_str(extra);
        }
        let spec = LaunchSpec {
            vmm: self.vmm.clone(),
            kernel: group.kernel.clone().unwrap_or_else(|| self.kernel.clone()),
            cmdline,
            cpus: vm.cpus,
            ram_mib: vm.ram_bytes >> 20,
            disk: PathBuf::from(&vm.disk),
            net: network.as_ref().and_then(crate::vmnet::tap_and_mac),
        };
        // A forced stop of an earlier run that was never reaped here.
        self.take_forced(hostname);
        let child = process::launch(&spec, &paths)
            .map_err(|e| internal(&format!("start {} for {hostname}", self.vmm.display()), e))?;
        let pid = child.id();
        let pid_start = process::start_time(pid).unwrap_or(0);
        failpoint::hit(Failpoint::BootSpawned);
        self.store.set_process(hostname, pid, pid_start)?;
        self.notify();
        failpoint::hit(Failpoint::BootRecorded);
        tracing::info!(vm = hostname, pid, "started");
        self.supervise(hostname.to_owned(), pid, pid_start, Some(child), permit);
        Ok(())
    }

    /// Watches a VM process: finishes its boot and handles its exit.
    fn supervise(
        self: &Arc<Self>,
        hostname: String,
        pid: u32,
        pid_start: u64,
        child: Option<std::process::Child>,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) {
        let this = self.clone();
        let h = hostname.clone();
        let boot = tokio::spawn(async move {
            // The boot slot is free again when the set-up ends (or the
            // process exits and this task is aborted).
            let _permit = permit;
            if let Err(e) = this.finish_boot(&h).await {
                tracing::warn!(vm = %h, "boot set-up: {}", e.message);
                if this
                    .store
                    .transition(&h, &[VmState::Starting], VmState::Failed, Some(&e.message))
                    .unwrap_or(false)
                {
                    this.notify();
                    // The guest is of no use without its set-up.
                    let paths = this.paths(&h);
                    process::kill_if_ours(pid, pid_start, &paths);
                }
            }
        });
        let this = self.clone();
        tokio::spawn(async move {
            let status = match child {
                Some(mut child) => tokio::task::spawn_blocking(move || child.wait().ok())
                    .await
                    .ok()
                    .flatten(),
                None => {
                    process::wait_adopted(pid, pid_start).await;
                    None
                }
            };
            boot.abort();
            this.on_exit(&hostname, status).await;
        });
    }

    /// Connects to a VM's agent once (vsock `CONNECT`, then the handshake).
    pub async fn connect_agent(&self, hostname: &str) -> Result<AgentClient, String> {
        let paths = self.paths(hostname);
        let mut io = tokio::net::UnixStream::connect(&paths.vsock)
            .await
            .map_err(|e| format!("vsock socket {}: {e}", paths.vsock.display()))?;
        io.write_all(format!("CONNECT {AGENT_VSOCK_PORT}\n").as_bytes())
            .await
            .map_err(|e| format!("vsock CONNECT: {e}"))?;
        // Read the answer byte by byte: nothing after its newline may be
        // consumed, it belongs to the agent protocol.
        let mut line = String::new();
        let read = tokio::time::timeout(Duration::from_secs(5), async {
            let mut byte = [0u8; 1];
            while line.len() < 128 {
                if io.read(&mut byte).await? == 0 {
                    break;
                }
                if byte[0] == b'\n' {
                    break;
                }
                line.push(byte[0] as char);
            }
            Ok::<usize, std::io::Error>(line.len())
        })
        .await;
        match read {
            Ok(Ok(_)) if line.starts_with("OK ") => {}
            Ok(Ok(_)) => return Err(format!("the agent's port is not open (answer {line:?})")),
            Ok(Err(e)) => return Err(format!("vsock: {e}")),
            Err(_) => return Err("vsock CONNECT got no answer in 5s".into()),
        }
        tokio::time::timeout(Duration::from_secs(10), AgentClient::handshake(io))
            .await
            .map_err(|_| "agent handshake timed out".to_string())?
            .map_err(|e| format!("agent handshake: {e}"))
    }

    /// An agent connection for a request: the VM must be running.
    pub async fn agent(&self, key: &str) -> ApiResult<(VmRecord, AgentClient)> {
        let vm = self.vm(key)?;
        if !matches!(vm.state, VmState::Running | VmState::Starting) {
            return Err(ApiError::conflict(format!(
                "{} is {}; start it with relaunch first",
                vm.hostname, vm.state
            )));
        }
        let client = self.connect_agent(&vm.hostname).await.map_err(|e| {
            ApiError::agent(format!("agent of {} does not answer: {e}", vm.hostname))
        })?;
        Ok((vm, client))
    }

    /// Waits for the agent, applies fix-ups, network and first-boot
    /// userdata, then marks the VM running.
    async fn finish_boot(&self, hostname: &str) -> ApiResult<()> {
        let began = Instant::now();
        let vm = self.vm(hostname)?;
        let started_ms = vm.started_ms.unwrap_or_else(now_ms);
        // Boots in a nested test bed take tens of seconds; give up only when
        // the process is gone (supervise aborts this task) or very late.
        let deadline = Instant::now() + Duration::from_secs(600);
        let client = loop {
            match self.connect_agent(hostname).await {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => {
                    return Err(ApiError::agent(format!("agent never answered: {e}")))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        let fixups = vm.fixups.clone().unwrap_or_default();
        let first = !vm.booted_once;
        let mut entropy = vec![0u8; 64];
        getrandom::fill(&mut entropy).map_err(|e| internal("entropy", e))?;
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .ok();
        let req = FixupRequest {
            hostname: Some(hostname.to_owned()),
            machine_id: first || fixups.iter().any(|f| f == "machine-id"),
            ssh_host_keys: first || fixups.iter().any(|f| f == "ssh-host-keys"),
            entropy: Some(entropy),
            clock_unix_nanos: clock,
        };
        client
            .fixups(req)
            .await
            .map_err(|e| ApiError::agent(format!("fix-ups: {e}")))?;
        if let Some(n) = vm.network.as_ref().and_then(crate::vmnet::agent_request) {
            client
                .network(n)
                .await
                .map_err(|e| ApiError::agent(format!("network set-up: {e}")))?;
        }
        if first {
            if let Some(script) = &vm.userdata {
                client
                    .userdata_run(script)
                    .await
                    .map_err(|e| ApiError::agent(format!("userdata: {e}")))?;
            }
        }
        let boot_ms = now_ms().saturating_sub(started_ms);
        failpoint::hit(Failpoint::BootSetUp);
        self.store.set_running(hostname, boot_ms)?;
        self.notify();
        tracing::info!(
            vm = hostname,
            boot_ms,
            setup_ms = began.elapsed().as_millis() as u64,
            "agent ready"
        );
        Ok(())
    }

    /// A VM process ended: record why, release what it held, remove an
    /// ephemeral VM's disk.
    async fn on_exit(self: &Arc<Self>, hostname: &str, status: Option<std::process::ExitStatus>) {
        let _guard = self.lock_vm(hostname).await;
        let Ok(Some(vm)) = self.store.find_vm(hostname) else {
            return;
        };
        if !vm.state.is_live() {
            return;
        }
        let paths = self.paths(hostname);
        let stop = process::stop_reason(&paths, status);
        let requested = vm.state == VmState::Stopping;
        // A guest that stops before its agent ever answered failed to boot
        // (a kernel panic reboots with panic=-1), whatever the exit said.
        let never_ready = vm.state == VmState::Starting;
        let state = if requested || (stop.clean && !never_ready) {
            VmState::Stopped
        } else {
            VmState::Failed
        };
        let forced = self.take_forced(hostname);
        let mode = stop_mode(forced.is_some(), stop.clean, requested);
        let reason = forced.unwrap_or(stop.reason);
        tracing::info!(vm = hostname, %reason, stop = %mode, "{state}");
        self.release_network(&vm);
        if never_ready && !requested && vm.is_unborn_fork() {
            // A fork that never came up leaves nothing behind; whoever
            // waits for it learns why.
            self.remember_failure(hostname, &reason);
            self.forget_logged(hostname);
        } else if vm.persistent {
            self.record_exit(hostname, state, &reason, mode);
        } else if state == VmState::Stopped {
            // Ephemeral: gone with its disk.
            self.forget_logged(hostname);
        } else {
            // Ephemeral and failed: the disk goes, the record stays to say why.
            self.record_exit(hostname, state, &reason, mode);
            if let Err(e) = std::fs::remove_file(&vm.disk) {
                tracing::warn!(vm = hostname, "cannot remove the disk {}: {e}", vm.disk);
            }
        }
        self.notify();
    }

    /// Stops a VM. Graceful: the agent is asked to power the guest off (it
    /// stops every process, syncs, remounts `/` read-only), or, when it does
    /// not take the request, Ctrl-Alt-Del is pressed (the min image's init
    /// takes it as the same request); a guest still running after `timeout`
    /// is killed. `poweroff` kills at once. A kill is recorded as
    /// [`StopMode::Forced`]: writes the guest had not synced may be lost.
    pub async fn shutdown(
        self: &Arc<Self>,
        key: &str,
        poweroff: bool,
        timeout: Duration,
    ) -> ApiResult<api::LifecycleResponse> {
        let began = Instant::now();
        let hostname = self.vm(key)?.hostname;
        let vm = {
            let _guard = self.lock_vm(&hostname).await;
            let vm = self.vm(&hostname)?;
            if !vm.state.is_live() {
                return Err(ApiError::conflict(format!(
                    "{hostname} is already {}",
                    vm.state
                )));
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
                self.notify();
                return Ok(api::LifecycleResponse {
                    hostname,
                    state: VmState::Stopped,
                    stop_mode: Some(StopMode::Graceful),
                    elapsed_ms: began.elapsed().as_millis() as u64,
                });
            }
            self.store.transition(
                &hostname,
                &[VmState::Starting, VmState::Running, VmState::Stopping],
                VmState::Stopping,
                None,
            )?;
            self.notify();
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
        let paths = self.paths(&vm.hostname);
        let (Some(pid), Some(start)) = (vm.pid, vm.pid_start) else {
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
            self.vmm_request(&paths, hostname, &VmmRequest::Kill).await;
        } else {
            match self
                .ask_agent_to_power_off(hostname, timeout.min(AGENT_SHUTDOWN_ASK))
                .await
            {
                Ok(()) => tracing::info!(vm = hostname, "the agent is powering the guest off"),
                Err(e) => {
                    tracing::info!(vm = hostname, "agent shutdown: {e}; pressing Ctrl-Alt-Del");
                    self.vmm_request(&paths, hostname, &VmmRequest::Shutdown)
                        .await;
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
        self.vmm_request(&paths, hostname, &VmmRequest::Kill).await;
        if !self.wait_not_live(hostname, Duration::from_secs(5)).await {
            process::kill_if_ours(pid, start, &paths);
            self.wait_not_live(hostname, Duration::from_secs(5)).await;
        }
        StopMode::Forced
    }

    /// Asks the VM's agent to shut the guest down cleanly, within `within`.
    async fn ask_agent_to_power_off(&self, hostname: &str, within: Duration) -> Result<(), String> {
        let ask = async {
            let client = self.connect_agent(hostname).await?;
            client
                .shutdown(ShutdownAction::Poweroff)
                .await
                .map_err(|e| format!("the agent refused: {e}"))
        };
        tokio::time::timeout(within, ask).await.map_err(|_| {
            format!(
                "the agent did not answer within {}",
                humantime::format_duration(within)
            )
        })?
    }

    /// Sends one request to the VM's tine-vmm, logging a failure or a
    /// refusal (the caller's deadline handles a VMM that does not act on it).
    async fn vmm_request(&self, paths: &VmPaths, hostname: &str, request: &VmmRequest) {
        match process::control(paths, request, VMM_CONTROL_ANSWER).await {
            Ok(VmmResponse::Ok { .. }) => {}
            Ok(VmmResponse::Error { error }) => {
                tracing::warn!(vm = hostname, "tine-vmm refused {request:?}: {error}")
            }
            Err(e) => tracing::warn!(vm = hostname, "tine-vmm control {request:?}: {e}"),
        }
    }

    async fn wait_not_live_until(&self, hostname: &str, deadline: tokio::time::Instant) -> bool {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        self.wait_not_live(hostname, left).await
    }

    async fn wait_not_live(&self, hostname: &str, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.changes.subscribe();
        loop {
            rx.borrow_and_update();
            match self.store.find_vm(hostname) {
                Ok(Some(vm)) if vm.state.is_live() => {}
                _ => return true,
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return false;
            }
        }
    }

    /// Boots a stopped (or failed) persistent VM from its disk.
    pub async fn relaunch(
        self: &Arc<Self>,
        key: &str,
        wait: Wait,
        timeout: Duration,
    ) -> ApiResult<api::LifecycleResponse> {
        let began = Instant::now();
        let vm = self.vm(key)?;
        {
            let _guard = self.lock_vm(&vm.hostname).await;
            let vm = self.vm(&vm.hostname)?;
            if vm.state.is_live() || vm.state == VmState::Creating {
                return Err(ApiError::conflict(format!(
                    "{} is {}",
                    vm.hostname, vm.state
                )));
            }
            if !Path::new(&vm.disk).is_file() {
                return Err(ApiError::conflict(format!(
                    "{} has no disk left ({} is missing); delete it",
                    vm.hostname, vm.disk
                )));
            }
            self.start(&vm.hostname).await?;
        }
        let vm = match wait {
            Wait::Agent => self.wait_running(&vm.hostname, timeout).await?,
            Wait::None => self.vm(&vm.hostname)?,
        };
        Ok(api::LifecycleResponse {
            hostname: vm.hostname,
            state: vm.state,
            stop_mode: None,
            elapsed_ms: began.elapsed().as_millis() as u64,
        })
    }

    /// Stops a VM if it runs and removes it with its disk.
    pub async fn delete(self: &Arc<Self>, key: &str) -> ApiResult<api::LifecycleResponse> {
        let began = Instant::now();
        let vm = self.vm(key)?;
        let running = {
            let _guard = self.lock_vm(&vm.hostname).await;
            let current = self.vm(&vm.hostname)?;
            // Stopping also keeps a queued VM from being launched.
            let _ = self.store.transition(
                &vm.hostname,
                &[VmState::Starting, VmState::Running, VmState::Stopping],
                VmState::Stopping,
                Some("deleting"),
            );
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
            let _ = std::fs::remove_dir_all(self.paths(&vm.hostname).dir);
            return Ok(api::LifecycleResponse {
                hostname: vm.hostname,
                state: VmState::Stopped,
                stop_mode: None,
                elapsed_ms: began.elapsed().as_millis() as u64,
            });
        };
        if vm.state.is_live() && vm.pid.is_some() {
            return Err(ApiError::internal(format!(
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
        self.notify();
        Ok(api::LifecycleResponse {
            hostname: vm.hostname,
            state: VmState::Stopped,
            stop_mode: None,
            elapsed_ms: began.elapsed().as_millis() as u64,
        })
    }

    /// Applies a tag change.
    pub async fn patch_tags(
        &self,
        key: &str,
        patch: api::TagsPatch,
    ) -> ApiResult<api::TagsResponse> {
        let vm = self.vm(key)?;
        let _guard = self.lock_vm(&vm.hostname).await;
        let vm = self.vm(&vm.hostname)?;
        for t in patch.add.iter().chain(patch.replace.iter().flatten()) {
            validate_tag(t)?;
        }
        if patch.replace.is_some() && (!patch.add.is_empty() || !patch.remove.is_empty()) {
            return Err(ApiError::bad_request(
                "use either replace, or add and remove",
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
    pub fn list(&self, group: Option<&str>, q: &api::ListQuery) -> ApiResult<Vec<api::VmInfo>> {
        if let Some(g) = group {
            self.group(g)?;
        }
        Ok(self
            .store
            .list_vms(group)?
            .iter()
            .filter(|vm| q.tag.as_ref().is_none_or(|t| vm.tags.contains(t)))
            .filter(|vm| {
                q.tag_prefix
                    .as_ref()
                    .is_none_or(|p| vm.tags.iter().any(|t| t.starts_with(p.as_str())))
            })
            .map(|vm| self.describe(vm))
            .collect())
    }

    /// Start-up: adopt live VMs, finish or undo interrupted changes, remove
    /// orphans, relaunch persistent VMs (per `reconcile`), keep `count`.
    pub async fn reconcile(self: &Arc<Self>) -> anyhow::Result<ReconcileReport> {
        let mut report = ReconcileReport::default();
        let vms = self.store.list_vms(None)?;
        let vms_dir = self.data_dir.join("vms");
        // Processes nobody recorded (a crash between launch and record) go
        // first: such a VMM holds the disk and sockets of a VM that is about
        // to be launched again, and two VMMs must never share a disk.
        let mut orphans = Vec::new();
        for (pid, host) in process::find_vmm_processes(&vms_dir) {
            let recorded = vms
                .iter()
                .any(|v| v.hostname == host && v.pid == Some(pid) && v.state.is_live());
            if !recorded {
                if let Err(e) = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                ) {
                    tracing::warn!(vm = %host, pid, "cannot kill an unrecorded tine-vmm: {e}");
                }
                report.killed.push(format!("{host} (pid {pid})"));
                orphans.push(pid);
            }
        }
        process::wait_gone(&orphans, Duration::from_secs(5)).await;
        for vm in &vms {
            let paths = self.paths(&vm.hostname);
            match vm.state {
                VmState::Creating => {
                    self.discard(&vm.hostname).await;
                    report.removed.push(vm.hostname.clone());
                }
                VmState::Starting if vm.pid.is_none() => {
                    // Queued for a boot slot when the daemon went down.
                    match self.start(&vm.hostname).await {
                        Ok(()) => report.relaunched.push(vm.hostname.clone()),
                        Err(_) => report.failed.push(vm.hostname.clone()),
                    }
                }
                s if s.is_live() => {
                    let alive = matches!((vm.pid, vm.pid_start), (Some(p), Some(t)) if process::is_ours(p, t, &paths));
                    if alive {
                        let (pid, start) = (vm.pid.unwrap_or(0), vm.pid_start.unwrap_or(0));
                        if s == VmState::Stopping {
                            let _ = self.store.transition(
                                &vm.hostname,
                                &[VmState::Stopping],
                                VmState::Running,
                                None,
                            );
                        }
                        self.supervise(vm.hostname.clone(), pid, start, None, None);
                        report.adopted.push(vm.hostname.clone());
                    } else if !vm.persistent {
                        self.discard(&vm.hostname).await;
                        report.removed.push(vm.hostname.clone());
                    } else {
                        let reason = "its process ended while the daemon was down";
                        self.store.clear_process(
                            &vm.hostname,
                            VmState::Stopped,
                            Some(reason),
                            Some(StopMode::Crashed),
                        )?;
                        self.release_network(vm);
                        if self.config.reconcile == Reconcile::Relaunch {
                            self.relaunch_at_start(&vm.hostname, &mut report).await?;
                        } else {
                            report.stopped.push(vm.hostname.clone());
                        }
                    }
                }
                _ => {
                    if vm.managed
                        && self.config.reconcile == Reconcile::Relaunch
                        && Path::new(&vm.disk).is_file()
                    {
                        self.relaunch_at_start(&vm.hostname, &mut report).await?;
                    }
                }
            }
        }
        let known: HashMap<String, VmRecord> = self
            .store
            .list_vms(None)?
            .into_iter()
            .map(|v| (v.hostname.clone(), v))
            .collect();
        // Folders nobody recorded.
        if let Ok(entries) = std::fs::read_dir(&vms_dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !known.contains_key(&name) {
                    let _ = std::fs::remove_dir_all(e.path());
                    report.removed.push(name);
                }
            }
        }
        for p in self.remove_orphan_commit_files() {
            report.removed.push(p);
        }
        // Disk files in VM folders that no record names (a crash between a
        // commit's record and the removal of the source's old disk name).
        for vm in self.store.list_vms(None)? {
            let dir = self.paths(&vm.hostname).dir;
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if name.starts_with("disk")
                        && name.ends_with(".qcow2")
                        && e.path().display().to_string() != vm.disk
                    {
                        let _ = std::fs::remove_file(e.path());
                        report.removed.push(e.path().display().to_string());
                    }
                }
            }
        }
        crate::vmnet::cleanup_orphans(self);
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
                        tracing::error!(group = %g.name, "cannot keep count: {}", e.message);
                        break;
                    }
                }
            }
        }
        self.notify();
        Ok(report)
    }
}

impl Daemon {
    /// Boots a persistent VM during reconciliation, recording the outcome.
    async fn relaunch_at_start(
        self: &Arc<Self>,
        hostname: &str,
        report: &mut ReconcileReport,
    ) -> anyhow::Result<()> {
        match self.start(hostname).await {
            Ok(()) => report.relaunched.push(hostname.to_owned()),
            Err(e) => {
                self.store
                    .set_state(hostname, VmState::Failed, Some(&e.message))?;
                report.failed.push(hostname.to_owned());
            }
        }
        Ok(())
    }
}

/// What start-up reconciliation did.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct ReconcileReport {
    /// Live VMs taken over.
    pub adopted: Vec<String>,
    /// Persistent VMs booted again.
    pub relaunched: Vec<String>,
    /// Persistent VMs recorded as stopped (`reconcile: report`).
    pub stopped: Vec<String>,
    /// Records or folders removed.
    pub removed: Vec<String>,
    /// Unrecorded processes killed.
    pub killed: Vec<String>,
    /// VMs that could not be relaunched.
    pub failed: Vec<String>,
    /// VMs created to keep `count`.
    pub created: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_kill_by_the_daemon_is_forced() {
        // Killed after the timeout or by action=poweroff: forced, whatever
        // the VMM reported.
        assert_eq!(stop_mode(true, true, true), StopMode::Forced);
        assert_eq!(stop_mode(true, false, true), StopMode::Forced);
        // Asked to stop and it powered off: graceful.
        assert_eq!(stop_mode(false, true, true), StopMode::Graceful);
        // Stopped by itself.
        assert_eq!(stop_mode(false, true, false), StopMode::Guest);
        // A crash, asked to stop or not.
        assert_eq!(stop_mode(false, false, false), StopMode::Crashed);
        assert_eq!(stop_mode(false, false, true), StopMode::Crashed);
    }
}
