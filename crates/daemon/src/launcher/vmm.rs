//! The real launcher: one `tine-vmm` process per VM (see
//! [`crate::process`] for how it is started and recognised), driven through
//! its control socket with the VMM's own request types. Restores take a
//! process from the warm pool ([`super::pool`]) when it has one of the
//! snapshot's shape, and start one otherwise.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tine_client::AgentClient;
use tine_proto::agent::AGENT_VSOCK_PORT;
use tine_proto::vmm::{Request as VmmRequest, Response as VmmResponse};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::pool::{self, Pool, Shape, Slot, POOL_DIR};
use super::{
    BootSpec, GuestStep, GuestStream, Instance, LaunchError, Launcher, PrimeSpec, Primed,
    RestoreSpec, Running, Stray, WarmUp, WriteSetCopy,
};
use crate::process::{self, VmPaths};

/// How long a request on a VMM's control socket may take to be answered.
pub const CONTROL_ANSWER: Duration = Duration::from_secs(5);

/// How long a snapshot or a restore may take: they write or read the
/// state and memory files (seconds for GiBs of RAM, more in a nested bed).
pub const SNAPSHOT_ANSWER: Duration = Duration::from_secs(300);

/// How long a pre-started process may take to listen on its control
/// socket (seconds in a nested test bed).
const PRESTART_LISTENS: Duration = Duration::from_secs(60);

/// The answer limit of `request`.
fn answer_limit(request: &VmmRequest) -> Duration {
    match request {
        VmmRequest::Snapshot { .. }
        | VmmRequest::Restore { .. }
        | VmmRequest::SaveWriteSet { .. }
        | VmmRequest::PopulateWriteSet { .. } => SNAPSHOT_ANSWER,
        _ => CONTROL_ANSWER,
    }
}

/// How long the VMM's vsock socket may take to answer `CONNECT`.
const VSOCK_CONNECT_ANSWER: Duration = Duration::from_secs(5);

/// How long a killed stray may take to go away.
const STRAY_GONE: Duration = Duration::from_secs(5);

/// Runs VMs as `tine-vmm` processes with their files in
/// `<data_dir>/vms/<hostname>/`.
#[derive(Debug, Clone)]
pub struct VmmLauncher {
    vmm: PathBuf,
    data_dir: PathBuf,
    pool: Arc<Mutex<Pool>>,
    /// Told whenever a pooled process finished starting (or failed to).
    slot_done: Arc<tokio::sync::Notify>,
    /// Restores under way.
    restoring: Arc<AtomicUsize>,
}

impl VmmLauncher {
    /// A launcher running `vmm` for VMs under `data_dir`.
    pub fn new(vmm: PathBuf, data_dir: PathBuf) -> Self {
        VmmLauncher {
            vmm,
            data_dir,
            pool: Arc::default(),
            slot_done: Arc::default(),
            restoring: Arc::default(),
        }
    }

    fn paths(&self, hostname: &str) -> VmPaths {
        VmPaths::new(&self.data_dir, hostname)
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        // The pool's book-keeping stays consistent between its calls: a
        // panic elsewhere while it was held leaves it usable.
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The run of `child`, which started at `pid_start`.
    fn spawned(&self, child: std::process::Child, pid_start: u64, paths: VmPaths) -> Running {
        let pid = child.id();
        let instance = Instance { pid, pid_start };
        let exit = async move {
            let status = process::wait_child(child)
                .await
                .map_err(|e| tracing::warn!(pid, "cannot reap tine-vmm: {e}"))
                .ok();
            process::read_stop(&paths, status)
        };
        Running {
            instance,
            exit: exit.boxed(),
            agent: None,
        }
    }

    /// The oldest pooled process of `shape` that still runs, if any.
    fn take_slot(&self, shape: Shape) -> Option<Slot> {
        let mut dead = Vec::new();
        let slot = self.pool().take(shape, &mut dead);
        for slot in dead {
            tracing::warn!(slot = %slot.name, "a pooled tine-vmm had ended");
            stop_slot(slot);
        }
        slot
    }

    /// Restores into a pooled process. The request goes out on the slot's
    /// socket at once; moving the process's files into the VM's folder runs
    /// meanwhile (the move is off the fork's path). None when the slot
    /// cannot be used (it is stopped; the caller starts its own process).
    async fn restore_pooled(
        &self,
        hostname: &str,
        mut slot: Slot,
        paths: &VmPaths,
        request: &VmmRequest,
    ) -> Option<Result<Running, LaunchError>> {
        if let Err(e) = pool::prepare_vm_dir(&slot.paths, paths) {
            tracing::warn!("{}", tine_proto::error_chain(&e));
            stop_slot(slot);
            return None;
        }
        let io = match slot.control.take() {
            Some(io) => Ok(io),
            None => tokio::net::UnixStream::connect(&slot.paths.control).await,
        };
        let io = match io {
            Ok(io) => io,
            Err(e) => {
                tracing::warn!(slot = %slot.name, "a pooled tine-vmm does not listen: {e}");
                stop_slot(slot);
                return None;
            }
        };
        Some(
            self.hand_over(hostname, slot, paths, io, request, Some(pool::move_slot))
                .await,
        )
    }

    /// Sends `request` on `io`, the slot's control connection, and moves
    /// the slot's files into the VM's folder with `move_files` meanwhile,
    /// if they are not there yet (the answer comes on this connection
    /// whatever the socket's name is by then): the slot's process, now the
    /// VM's run, once both are done; otherwise it is stopped.
    async fn hand_over(
        &self,
        hostname: &str,
        slot: Slot,
        paths: &VmPaths,
        io: tokio::net::UnixStream,
        request: &VmmRequest,
        move_files: Option<MoveFiles>,
    ) -> Result<Running, LaunchError> {
        let moved = move_files.map(|move_files| {
            let (from, to) = (slot.paths.clone(), paths.clone());
            tokio::task::spawn_blocking(move || move_files(&from, &to))
        });
        let answer = process::control_on(io, request, answer_limit(request)).await;
        let moved = match moved {
            Some(moved) => files_moved(moved.await, &paths.dir, &slot.name),
            None => Ok(()),
        };
        let failed = match carried_out(hostname, request, answer).and(moved) {
            Ok(()) => return Ok(self.spawned(slot.child, slot.pid_start, paths.clone())),
            Err(e) => e,
        };
        stop_slot(slot);
        Err(failed)
    }

    /// Starts what the pool lacks, until it has what it wants; processes
    /// another call is starting are waited for, so that the pool is full
    /// when it returns.
    async fn refill(&self) {
        loop {
            // Made before the pool is read: a start that ends in between
            // still wakes it.
            let slot_done = self.slot_done.notified();
            let todo = self.pool().to_start(pool::new_slot_name);
            if todo.is_empty() {
                if !self.pool().is_starting() {
                    return;
                }
                slot_done.await;
                continue;
            }
            let started = futures_util::future::join_all(
                todo.iter()
                    .map(|(shape, name)| self.start_slot(*shape, name)),
            )
            .await;
            let mut failed = false;
            for ((shape, name), result) in todo.into_iter().zip(started) {
                match result {
                    Ok(slot) => {
                        let surplus = self.pool().started(shape, slot);
                        surplus.into_iter().for_each(stop_slot);
                    }
                    Err(e) => {
                        tracing::error!(slot = %name, %shape, "cannot fill the warm pool: {}", tine_proto::error_chain(&e));
                        self.pool().failed(&name);
                        failed = true;
                    }
                }
            }
            self.slot_done.notify_waiters();
            if failed {
                // Forks start their own process; the next fill tries again.
                return;
            }
        }
    }

    /// Starts one pooled process and waits until it listens.
    async fn start_slot(&self, shape: Shape, name: &str) -> Result<Slot, LaunchError> {
        let paths = VmPaths::in_dir(self.data_dir.join(POOL_DIR).join(name));
        let hostname = format!("{POOL_DIR}/{name}");
        let mut child =
            process::prestart(&self.vmm, shape.cpus, shape.ram_mib, &paths).map_err(|source| {
                LaunchError::Spawn {
                    program: self.vmm.clone(),
                    hostname: hostname.clone(),
                    source,
                }
            })?;
        // Read now, off any fork's path: the run it becomes is known by it.
        let pid_start = process::start_time(child.id()).unwrap_or(0);
        let deadline = tokio::time::Instant::now() + PRESTART_LISTENS;
        loop {
            if let Ok(control) = tokio::net::UnixStream::connect(&paths.control).await {
                return Ok(Slot {
                    name: name.to_owned(),
                    paths,
                    child,
                    pid_start,
                    moved_vsock: false,
                    primed_in: None,
                    control: Some(control),
                    agent: None,
                });
            }
            let ended = matches!(child.try_wait(), Ok(Some(_)) | Err(_));
            if ended || tokio::time::Instant::now() >= deadline {
                let error = if ended {
                    format!("it ended: {}", process::read_tail(&paths.log, 2048))
                } else {
                    format!("it did not listen within {PRESTART_LISTENS:?}")
                };
                stop_slot(Slot {
                    name: name.to_owned(),
                    paths,
                    child,
                    pid_start,
                    moved_vsock: false,
                    primed_in: None,
                    control: None,
                    agent: None,
                });
                return Err(LaunchError::Refused {
                    hostname,
                    request: "prestart".into(),
                    error,
                });
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Starts a process named `name` and restores `spec` into it, paused,
    /// its sockets and logs in its own folder, then copies its write set
    /// in.
    async fn prime_slot(
        &self,
        name: &str,
        spec: &PrimeSpec,
    ) -> Result<(Slot, WriteSetCopy, WarmUp, GuestSteps), LaunchError> {
        let shape = Shape {
            cpus: spec.cpus,
            ram_mib: spec.ram_mib,
        };
        let mut slot = self.start_slot(shape, name).await?;
        let request = VmmRequest::Restore {
            state_path: spec.state.clone(),
            mem_path: spec.memory.clone(),
            paused: true,
            vsock_uds: Some(slot.paths.vsock.clone()),
            drives: BTreeMap::from([(super::ROOT_DRIVE.to_owned(), spec.disk.clone())]),
            taps: spec
                .tap
                .iter()
                .map(|t| (super::ROOT_NIC.to_owned(), t.clone()))
                .collect(),
            serial_log: Some(slot.paths.serial.clone()),
        };
        let hostname = format!("{POOL_DIR}/{name}");
        let answer = process::control(&slot.paths, &request, answer_limit(&request)).await;
        let failed = match carried_out(&hostname, &request, answer) {
            Ok(()) => {
                // Its files go into the folder a fork will take by rename,
                // so that they move with it.
                let (from, to) = (slot.paths.clone(), VmPaths::in_dir(spec.folder.clone()));
                let moved =
                    tokio::task::spawn_blocking(move || pool::move_primed(&from, &to)).await;
                match files_moved(moved, &spec.folder, name) {
                    Ok(moved_vsock) => {
                        slot.moved_vsock = moved_vsock;
                        slot.primed_in = Some(spec.folder.clone());
                        let primed = VmPaths::in_dir(spec.folder.clone());
                        let copy = match &spec.write_set {
                            Some(write_set) => {
                                populate_write_set(&primed, write_set, &hostname).await
                            }
                            None => WriteSetCopy::NotAsked,
                        };
                        let warmed = if spec.warm_agent {
                            warm_up(&primed, &hostname, spec).await
                        } else {
                            Ok((WarmUp::NotAsked, GuestSteps::not_asked(), None))
                        };
                        match warmed {
                            Ok((warmed, steps, agent)) => {
                                slot.agent = agent;
                                return Ok((slot, copy, warmed, steps));
                            }
                            Err(e) => e,
                        }
                    }
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        stop_slot(slot);
        Err(failed)
    }

    /// Starts a process for `spec` now (the pool had none).
    fn prestart_now(&self, spec: &RestoreSpec, paths: &VmPaths) -> Result<Running, LaunchError> {
        let child =
            process::prestart(&self.vmm, spec.cpus, spec.ram_mib, paths).map_err(|source| {
                LaunchError::Spawn {
                    program: self.vmm.clone(),
                    hostname: spec.hostname.clone(),
                    source,
                }
            })?;
        let pid_start = process::start_time(child.id()).unwrap_or(0);
        Ok(self.spawned(child, pid_start, paths.clone()))
    }
}

/// Moves a slot's files from its folder to a VM's.
type MoveFiles = fn(&VmPaths, &VmPaths) -> Result<(), pool::HandOverError>;

/// The outcome of a blocking task that moved slot `slot`'s files to
/// `folder`, as a launch error when they did not all move.
fn files_moved<T>(
    moved: Result<Result<T, pool::HandOverError>, tokio::task::JoinError>,
    folder: &Path,
    slot: &str,
) -> Result<T, LaunchError> {
    match moved {
        Ok(moved) => moved.map_err(|e| LaunchError::Prepare {
            path: e.vm.clone(),
            source: std::io::Error::new(e.source.kind(), tine_proto::error_chain(&e)),
        }),
        Err(e) => Err(LaunchError::Prepare {
            path: folder.to_path_buf(),
            source: std::io::Error::other(format!("the move of slot {slot} ended: {e}")),
        }),
    }
}

/// Counts a restore under way; when the last one under way ends
/// (whichever way), the pool is refilled in the background.
struct RefillWhenIdle(VmmLauncher);

impl RefillWhenIdle {
    fn new(launcher: &VmmLauncher) -> Self {
        launcher.restoring.fetch_add(1, Ordering::SeqCst);
        RefillWhenIdle(launcher.clone())
    }
}

impl Drop for RefillWhenIdle {
    fn drop(&mut self) {
        if self.0.restoring.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Dropped outside a runtime (one shutting down), there is
            // nobody to refill for.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let launcher = self.0.clone();
                runtime.spawn(async move { launcher.refill().await });
            }
        }
    }
}

/// Has the primed process whose files are `primed` copy the pages of
/// `write_set` in; says what became of them (one that cannot copy them
/// stays primed without them: its fork's guest copies its pages itself).
async fn populate_write_set(primed: &VmPaths, write_set: &Path, hostname: &str) -> WriteSetCopy {
    let request = VmmRequest::PopulateWriteSet {
        path: write_set.to_path_buf(),
    };
    let answer = process::control(primed, &request, SNAPSHOT_ANSWER).await;
    if let Ok(VmmResponse::Ok {
        write_set_bytes,
        duration_us,
        ..
    }) = &answer
    {
        tracing::info!(
            slot = hostname,
            bytes = write_set_bytes.unwrap_or(0),
            duration_us,
            "primed with the commit's write set"
        );
    }
    WriteSetCopy::answered(answer)
}

/// `answer`, the one `hostname`'s VMM gave to `request`, as the launcher
/// reports it: a refusal and a control connection that failed are errors.
fn carried_out(
    hostname: &str,
    request: &VmmRequest,
    answer: std::io::Result<VmmResponse>,
) -> Result<(), LaunchError> {
    match answer {
        Ok(VmmResponse::Ok { .. }) => Ok(()),
        Ok(VmmResponse::Error { error }) => Err(LaunchError::Refused {
            hostname: hostname.to_owned(),
            request: request.name().into(),
            error,
        }),
        Err(source) => Err(LaunchError::Control {
            hostname: hostname.to_owned(),
            source,
        }),
    }
}

/// How long a primed VM's agent may take to answer its first handshake
/// (seconds in a nested test bed).
const WARM_UP_ANSWER: Duration = Duration::from_secs(30);

/// What a primed VM's agent did of the steps its spec asked for ahead of
/// its fork.
struct GuestSteps {
    network: GuestStep,
    identity: GuestStep,
    secrets: GuestStep,
}

impl GuestSteps {
    fn not_asked() -> Self {
        GuestSteps {
            network: GuestStep::NotAsked,
            identity: GuestStep::NotAsked,
            secrets: GuestStep::NotAsked,
        }
    }
}

/// Runs the primed VM at `primed` until its agent answers a handshake (and
/// has taken the steps `spec` asks of its guest: its network, its
/// identity, its secrets), and pauses it again holding its clock
/// ([`PrimeSpec::warm_agent`]); returns too the agent's connection, kept
/// open for its fork. An error is a VM that did not run or could not be
/// paused again: it must not wait as primed.
async fn warm_up(
    primed: &VmPaths,
    hostname: &str,
    spec: &PrimeSpec,
) -> Result<(WarmUp, GuestSteps, Option<AgentClient>), LaunchError> {
    let ask = |request: VmmRequest| async move {
        let answer = process::control(primed, &request, CONTROL_ANSWER).await;
        carried_out(hostname, &request, answer)
    };
    ask(VmmRequest::Resume { vsock_uds: None }).await?;
    let began = std::time::Instant::now();
    let answered = tokio::time::timeout(WARM_UP_ANSWER, agent_handshake(&primed.vsock)).await;
    let (warmed, steps, agent) = match answered {
        Ok(Ok(client)) => {
            let warmed = WarmUp::Answered(began.elapsed().as_millis() as u64);
            // The steps touch different things (the interface, the
            // identity files, the secrets' tmpfs): the guest's CPU serves
            // one while another waits for its disk.
            let network = async {
                match &spec.guest_network {
                    None => GuestStep::NotAsked,
                    Some(request) => guest_step(client.network(request.clone()), |()| Ok(())).await,
                }
            };
            let identity = async {
                match &spec.guest_identity {
                    None => GuestStep::NotAsked,
                    Some(request) => {
                        guest_step(client.fixups(request.clone()), |report| {
                            match report.errors.is_empty() {
                                true => Ok(()),
                                false => Err(report.errors.join("; ")),
                            }
                        })
                        .await
                    }
                }
            };
            let secrets = async {
                match &spec.guest_secrets {
                    None => GuestStep::NotAsked,
                    Some(files) => guest_step(client.secrets_sync(files.clone()), |_| Ok(())).await,
                }
            };
            let (network, identity, secrets) = tokio::join!(network, identity, secrets);
            let steps = GuestSteps {
                network,
                identity,
                secrets,
            };
            (warmed, steps, Some(client))
        }
        Ok(Err(why)) => (WarmUp::NoAnswer(why), GuestSteps::not_asked(), None),
        Err(_) => (
            WarmUp::NoAnswer(format!(
                "no handshake within {}",
                humantime::format_duration(WARM_UP_ANSWER)
            )),
            GuestSteps::not_asked(),
            None,
        ),
    };
    ask(VmmRequest::PauseHoldingClock).await?;
    Ok((warmed, steps, agent))
}

/// Waits (at most [`WARM_UP_ANSWER`]) for a step a primed VM's agent was
/// asked to take; `judge` says whether its answer means it was all done.
async fn guest_step<T>(
    call: impl std::future::Future<Output = tine_client::agent::Result<T>>,
    judge: impl FnOnce(T) -> Result<(), String>,
) -> GuestStep {
    match tokio::time::timeout(WARM_UP_ANSWER, call).await {
        Ok(Ok(answer)) => match judge(answer) {
            Ok(()) => GuestStep::Done,
            Err(why) => GuestStep::Failed(why),
        },
        Ok(Err(e)) => GuestStep::Failed(tine_proto::error_chain(&e)),
        Err(_) => GuestStep::Failed(format!(
            "no answer within {}",
            humantime::format_duration(WARM_UP_ANSWER)
        )),
    }
}

async fn agent_handshake(vsock: &Path) -> Result<AgentClient, String> {
    loop {
        match vsock_connect(vsock, AGENT_VSOCK_PORT).await {
            Ok(io) => {
                return AgentClient::handshake(io)
                    .await
                    .map_err(|e| tine_proto::error_chain(&e));
            }
            Err(why) if !vsock.exists() => return Err(why),
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Stops a pooled process nobody will use and removes its folder (a primed
/// one's files moved out, and its folder with them); reaped in the
/// background.
fn stop_slot(slot: Slot) {
    let Slot {
        name,
        paths,
        mut child,
        ..
    } = slot;
    if let Err(e) = child.kill() {
        tracing::debug!(slot = %name, "kill: {e}");
    }
    let removed = match std::fs::symlink_metadata(&paths.dir) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&paths.dir),
        // A link an earlier version left.
        Ok(_) => std::fs::remove_file(&paths.dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = removed {
        tracing::warn!(slot = %name, "cannot remove {}: {e}", paths.dir.display());
    }
    std::thread::spawn(move || {
        if let Err(e) = child.wait() {
            tracing::warn!(slot = %name, "cannot reap a pooled tine-vmm: {e}");
        }
    });
}

impl Launcher for VmmLauncher {
    fn boot(&self, spec: &BootSpec) -> Result<Running, LaunchError> {
        let paths = self.paths(&spec.hostname);
        let child =
            process::launch(&self.vmm, spec, &paths).map_err(|source| LaunchError::Spawn {
                program: self.vmm.clone(),
                hostname: spec.hostname.clone(),
                source,
            })?;
        let pid_start = process::start_time(child.id()).unwrap_or(0);
        Ok(self.spawned(child, pid_start, paths))
    }

    fn restore<'a>(&'a self, spec: &'a RestoreSpec) -> BoxFuture<'a, Result<Running, LaunchError>> {
        async move {
            let paths = self.paths(&spec.hostname);
            let shape = Shape {
                cpus: spec.cpus,
                ram_mib: spec.ram_mib,
            };
            // The pool is refilled once no restore is under way: a process
            // starting next to one would take the CPU it needs now.
            let _refill = RefillWhenIdle::new(self);
            let request = VmmRequest::Restore {
                state_path: spec.state.clone(),
                mem_path: spec.memory.clone(),
                paused: spec.paused,
                vsock_uds: Some(paths.vsock.clone()),
                drives: spec
                    .disk
                    .iter()
                    .map(|d| (super::ROOT_DRIVE.to_owned(), d.clone()))
                    .collect(),
                taps: spec
                    .tap
                    .iter()
                    .map(|t| (super::ROOT_NIC.to_owned(), t.clone()))
                    .collect(),
                serial_log: Some(paths.serial.clone()),
            };
            if let Some(slot) = self.take_slot(shape) {
                if let Some(result) = self
                    .restore_pooled(&spec.hostname, slot, &paths, &request)
                    .await
                {
                    return result;
                }
            }
            let running = self.prestart_now(spec, &paths)?;
            // The pre-started process listens once it is ready: until then
            // its socket is missing, or there but not listening yet (bound,
            // `listen` to come), and the request was not delivered.
            let deadline = tokio::time::Instant::now() + PRESTART_LISTENS;
            let (answer, ended) = loop {
                let answer = self.control(&spec.hostname, &request).await;
                let not_listening = matches!(
                    &answer,
                    Err(LaunchError::Control { source, .. })
                        if matches!(
                            source.kind(),
                            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                        )
                );
                let ended = not_listening
                    && process::has_ended(running.instance.pid, running.instance.pid_start);
                if !not_listening || ended || tokio::time::Instant::now() >= deadline {
                    break (answer, ended);
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            match answer {
                Ok(VmmResponse::Ok { .. }) => Ok(running),
                Ok(VmmResponse::Error { error }) => {
                    self.kill(&spec.hostname, running.instance);
                    Err(LaunchError::Refused {
                        hostname: spec.hostname.clone(),
                        request: "restore".into(),
                        error,
                    })
                }
                Err(e) if ended => {
                    // It ended before it listened: its output says why.
                    let stop = tokio::time::timeout(CONTROL_ANSWER, running.exit).await;
                    Err(LaunchError::Refused {
                        hostname: spec.hostname.clone(),
                        request: "restore".into(),
                        error: match stop {
                            Ok(stop) => format!("tine-vmm ended first: {}", stop.describe()),
                            Err(_) => e.to_string(),
                        },
                    })
                }
                Err(e) => {
                    self.kill(&spec.hostname, running.instance);
                    Err(e)
                }
            }
        }
        .boxed()
    }

    fn prime<'a>(&'a self, spec: &'a PrimeSpec) -> BoxFuture<'a, Result<Primed, LaunchError>> {
        async move {
            let name = pool::new_slot_name();
            self.pool().priming(&name);
            match self.prime_slot(&name, spec).await {
                Ok((slot, write_set, warm_up, steps)) => {
                    self.pool().primed(&name, Some(slot));
                    Ok(Primed {
                        name,
                        write_set,
                        warm_up,
                        guest_network: steps.network,
                        guest_identity: steps.identity,
                        guest_secrets: steps.secrets,
                    })
                }
                Err(e) => {
                    self.pool().primed(&name, None);
                    Err(e)
                }
            }
        }
        .boxed()
    }

    fn resume_primed<'a>(
        &'a self,
        name: &'a str,
        hostname: &'a str,
    ) -> BoxFuture<'a, Result<Option<Running>, LaunchError>> {
        async move {
            let Some(mut slot) = self.pool().take_primed(name) else {
                return Err(LaunchError::not_primed(hostname, name));
            };
            if !matches!(slot.child.try_wait(), Ok(None)) {
                tracing::warn!(slot = %slot.name, "a primed tine-vmm had ended");
                stop_slot(slot);
                return Ok(None);
            }
            // The fork took the folder the process was primed into: its
            // files are in the VM's folder already, and the resume tells
            // the process where its vsock socket is now. It goes out on the
            // connection the slot has held since it started.
            let paths = self.paths(hostname);
            let io = match slot.control.take() {
                Some(io) => Ok(io),
                None => tokio::net::UnixStream::connect(&paths.control).await,
            };
            let io = match io {
                Ok(io) => io,
                Err(source) => {
                    stop_slot(slot);
                    return Err(LaunchError::Control {
                        hostname: hostname.to_owned(),
                        source,
                    });
                }
            };
            let resume = VmmRequest::Resume {
                vsock_uds: slot.moved_vsock.then(|| paths.vsock.clone()),
            };
            // The connection its warm-up opened goes on across the pause.
            let agent = slot.agent.take();
            let running = self
                .hand_over(hostname, slot, &paths, io, &resume, None)
                .await?;
            Ok(Some(Running { agent, ..running }))
        }
        .boxed()
    }

    fn populate_primed<'a>(
        &'a self,
        name: &'a str,
        write_set: &'a Path,
    ) -> BoxFuture<'a, Option<WriteSetCopy>> {
        async move {
            let folder = self.pool().primed_folder(name)?;
            let hostname = format!("{POOL_DIR}/{name}");
            let copy = populate_write_set(&VmPaths::in_dir(folder), write_set, &hostname).await;
            match copy {
                // A fork took it in between: its folder is the fork's now.
                WriteSetCopy::Failed(_) if self.pool().primed_folder(name).is_none() => None,
                copy => Some(copy),
            }
        }
        .boxed()
    }

    fn discard_primed(&self, name: &str) {
        let slot = self.pool().take_primed(name);
        slot.into_iter().for_each(stop_slot);
    }

    fn adopt(&self, hostname: &str, instance: Instance) -> Option<Running> {
        let paths = self.paths(hostname);
        if !process::is_ours(instance.pid, instance.pid_start, &paths) {
            return None;
        }
        let exit = async move {
            process::wait_adopted(instance.pid, instance.pid_start).await;
            // Not our child: no exit status, but the log has its report.
            process::read_stop(&paths, None)
        };
        Some(Running {
            instance,
            exit: exit.boxed(),
            agent: None,
        })
    }

    fn strays(&self) -> Vec<Stray> {
        let ours = self.pool().names();
        process::find_processes(&self.data_dir)
            .into_iter()
            .filter_map(|(pid, owner)| match owner {
                process::Owner::Vm(hostname) => Some(Stray { pid, hostname }),
                process::Owner::Pool(slot) if ours.contains(&slot) => None,
                process::Owner::Pool(slot) => Some(Stray {
                    pid,
                    hostname: format!("{POOL_DIR}/{slot}"),
                }),
            })
            .collect()
    }

    fn kill_strays<'a>(&'a self, strays: &'a [Stray]) -> BoxFuture<'a, ()> {
        async move {
            for s in strays {
                if let Err(e) = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(s.pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                ) {
                    tracing::warn!(vm = %s.hostname, pid = s.pid, "cannot kill a stray tine-vmm: {e}");
                }
            }
            let pids: Vec<u32> = strays.iter().map(|s| s.pid).collect();
            process::wait_gone(&pids, STRAY_GONE).await;
        }
        .boxed()
    }

    fn kill(&self, hostname: &str, instance: Instance) {
        process::kill_if_ours(instance.pid, instance.pid_start, &self.paths(hostname));
    }

    fn control<'a>(
        &'a self,
        hostname: &'a str,
        request: &'a VmmRequest,
    ) -> BoxFuture<'a, Result<VmmResponse, LaunchError>> {
        async move {
            process::control(&self.paths(hostname), request, answer_limit(request))
                .await
                .map_err(|source| LaunchError::Control {
                    hostname: hostname.to_owned(),
                    source,
                })
        }
        .boxed()
    }

    fn keep_warm<'a>(&'a self, wanted: &'a [(Shape, u32)]) -> BoxFuture<'a, ()> {
        async move {
            let mut sizes = BTreeMap::new();
            for (shape, count) in wanted {
                let size = sizes.entry(*shape).or_insert(0);
                *size = (*count).max(*size);
            }
            let surplus = self.pool().set_wanted(sizes);
            surplus.into_iter().for_each(stop_slot);
            let keep = self.pool().names();
            let in_use = process::pool_slots_in_use(&self.data_dir);
            pool::sweep(&self.data_dir.join(POOL_DIR), &keep, &in_use);
            self.refill().await;
        }
        .boxed()
    }

    fn connect<'a>(
        &'a self,
        hostname: &'a str,
        port: u32,
    ) -> BoxFuture<'a, Result<Box<dyn GuestStream>, LaunchError>> {
        async move {
            let fail = |detail: String| LaunchError::Vsock {
                hostname: hostname.to_owned(),
                port,
                detail,
            };
            let path = self.paths(hostname).vsock;
            let io = vsock_connect(&path, port).await.map_err(fail)?;
            Ok(Box::new(io) as Box<dyn GuestStream>)
        }
        .boxed()
    }
}

/// Opens a guest port through the VMM's vsock socket (`CONNECT <port>`,
/// answered `OK <host port>`).
async fn vsock_connect(path: &Path, port: u32) -> Result<tokio::net::UnixStream, String> {
    let mut io = tokio::net::UnixStream::connect(path)
        .await
        .map_err(|e| format!("socket {}: {e}", path.display()))?;
    io.write_all(format!("CONNECT {port}\n").as_bytes())
        .await
        .map_err(|e| format!("CONNECT: {e}"))?;
    // Read the answer byte by byte: nothing after its newline may be
    // consumed, it belongs to the guest's protocol.
    let mut line = String::new();
    let read = tokio::time::timeout(VSOCK_CONNECT_ANSWER, async {
        let mut byte = [0u8; 1];
        while line.len() < 128 {
            if io.read(&mut byte).await? == 0 || byte[0] == b'\n' {
                break;
            }
            line.push(byte[0] as char);
        }
        Ok::<(), std::io::Error>(())
    })
    .await;
    match read {
        Ok(Ok(())) if line.starts_with("OK ") => Ok(io),
        Ok(Ok(())) => Err(format!("the port is not open (answer {line:?})")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "CONNECT got no answer in {}",
            humantime::format_duration(VSOCK_CONNECT_ANSWER)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_restore_whose_process_ends_before_it_listens_says_how_it_ended() {
        let dir = tempfile::tempdir().expect("tmp");
        // A "VMM" that exits 1 at once, as tine-vmm does on bad arguments.
        let launcher = VmmLauncher::new("false".into(), dir.path().to_owned());
        let spec = RestoreSpec {
            hostname: "t-1".into(),
            cpus: 1,
            ram_mib: 32,
            state: dir.path().join("state"),
            memory: dir.path().join("memory"),
            paused: false,
            disk: Some(dir.path().join("disk.qcow2")),
            tap: Some("tap-t1".into()),
        };
        let began = tokio::time::Instant::now();
        let err = launcher.restore(&spec).await.expect_err("it ended");
        let text = tine_proto::error_chain(&err);
        assert!(
            text.contains("tine-vmm ended first: tine-vmm exited with status 1"),
            "{text}"
        );
        assert!(
            began.elapsed() < PRESTART_LISTENS / 2,
            "it did not wait for a process that is gone"
        );
    }
}
