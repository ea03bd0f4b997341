//! An in-process stand-in for `tine-vmm` and the guest: each "VM" is a few
//! tasks, and its agent speaks the real agent protocol over an in-memory
//! pipe. Tests and benchmarks run the daemon's whole core on it without KVM,
//! and tell each VM's guest how to behave ([`Guest`]): healthy, crashing,
//! silent, hanging, deaf to shutdown requests. A healthy agent runs an
//! exec as a process on the host (no uid/gid change), so exec's wire can be
//! tested end to end, and its file calls (stat, list, mkdir, remove) on
//! the host's paths.
//!
//! Each run has a memory, a number that stands for its guest RAM: a boot
//! gets a new one, a snapshot writes it into the state file and a restore
//! runs with the one its state file names ([`FakeLauncher::memory_of`]), so
//! a test tells a resumed guest from a rebooted one. Like `tine-vmm`, a
//! fake VMM pauses only a running VM, resumes only a paused one and
//! snapshots only a paused one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tine_proto::agent::mux::{Inbound, Mux, MuxConfig, Stream};
use tine_proto::agent::{
    server_handshake, ErrorCode, FixupReport, Health, KeysReport, Request, Response, SecretsReport,
    UserdataStatus, Welcome, MAX_FRAME_LEN, PROTOCOL_VERSION,
};
use tine_proto::vmm::StopReason;
use tine_proto::vmm::{Request as VmmRequest, Response as VmmResponse};
use tokio::sync::watch;

use super::{
    BootSpec, GuestStep, GuestStream, Instance, LaunchError, Launcher, PrimeSpec, Primed,
    RestoreSpec, Running, Shape, Stop, Stray, WarmUp, WriteSetCopy,
};

/// How a fake VM's guest behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Guest {
    /// Boots, answers its agent's requests, powers off when asked.
    #[default]
    Healthy,
    /// Triple-faults right after it starts, before its agent listens.
    Crashes,
    /// Its agent never listens: every vsock connection is refused.
    Silent,
    /// Its agent handshakes, then never answers a request.
    Hangs,
    /// Its agent answers every fix-up request with an error.
    FailsFixups,
    /// Its agent holds its answer to a fix-up request until it is asked
    /// something else (at most a second): shows whether the set-up's
    /// steps are sent at once.
    SlowFixups,
    /// Runs, but ignores every request to stop (agent and Ctrl-Alt-Del).
    Deaf,
}

/// Something a fake VM was asked, in order.
#[derive(Debug, Clone)]
pub enum Seen {
    /// A boot.
    Boot(BootSpec),
    /// A restore.
    Restore(RestoreSpec),
    /// A snapshot restored ahead of any VM (seen under `pool/<name>`).
    Prime(PrimeSpec),
    /// A primed process taken by the VM.
    ResumePrimed(PrimeSpec),
    /// A control request.
    Control(VmmRequest),
    /// An agent request.
    Agent(Request),
    /// The answer to a fix-up request, sent.
    FixupsAnswered,
    /// A kill by signal.
    Kill,
}

#[derive(Debug)]
struct Run {
    instance: Instance,
    guest: Guest,
    stop: watch::Sender<Option<Stop>>,
    paused: bool,
    memory: u64,
    /// The disk a switch moved it to.
    disk: Option<std::path::PathBuf>,
}

/// The first line of a fake state file; the memory number follows.
const STATE_MAGIC: &str = "fake-tine-snapshot memory=";

/// A fake write set: this, then the memory number of the run that saved it.
const WRITE_SET_MAGIC: &str = "fake-tine-write-set memory=";

/// The bytes a fake write set covers.
pub const FAKE_WRITE_SET_BYTES: u64 = 3 * 4096;

#[derive(Debug, Default)]
struct State {
    next_pid: u32,
    runs: HashMap<String, Run>,
    guests: HashMap<String, Guest>,
    refuse_boot: Option<String>,
    /// How long each priming takes.
    prime_delay: Duration,
    /// Why a primed guest's identity fix-ups fail, when they do.
    primed_identity_fails: Option<String>,
    refuse_snapshot: Option<String>,
    next_memory: u64,
    seen: Vec<(String, Seen)>,
    /// Background execs per VM, by id.
    jobs: HashMap<String, HashMap<u64, FakeJob>>,
    next_job: u64,
    /// Operations a real agent answers instead of the fake.
    delegate: Option<Delegate>,
    /// The warm pools last asked for (the fake starts no processes).
    warm: Vec<(Shape, u32)>,
    /// Primed snapshots by name, with their memory number.
    primed: HashMap<String, (PrimeSpec, u64)>,
}

/// Serves the agent protocol on the given connection: a real agent (in
/// process, on the host) for the operations the fake does not fake.
pub type ServeAgent = Arc<dyn Fn(tokio::io::DuplexStream) + Send + Sync>;

#[derive(Clone)]
struct Delegate {
    ops: Vec<&'static str>,
    serve: ServeAgent,
}

impl std::fmt::Debug for Delegate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delegate").field("ops", &self.ops).finish()
    }
}

/// A fake guest's background exec: a host process and all it wrote (the
/// ring is applied when it is read).
#[derive(Debug, Clone)]
struct FakeJob {
    pid: u32,
    command: String,
    started_ms: u64,
    ring_bytes: u64,
    out: Arc<Mutex<(Vec<u8>, Vec<u8>)>>,
    exit: watch::Receiver<Option<tine_proto::agent::ExitStatus>>,
}

impl FakeJob {
    fn info(&self, id: u64) -> tine_proto::agent::BgJob {
        let out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        tine_proto::agent::BgJob {
            id,
            pid: self.pid,
            command: self.command.clone(),
            started_unix_ms: self.started_ms,
            exit: *self.exit.borrow(),
            stdout_bytes: out.0.len() as u64,
            stderr_bytes: out.1.len() as u64,
            ring_bytes: self.ring_bytes,
            next_id: 0,
        }
    }
}

/// The stand-in launcher; clones share their VMs (a "restarted daemon" gets
/// a clone and finds the VMs that kept running).
#[derive(Debug, Clone, Default)]
pub struct FakeLauncher {
    state: Arc<Mutex<State>>,
}

impl FakeLauncher {
    /// A launcher with no VMs; every guest is [`Guest::Healthy`].
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Has a real agent, served by `serve`, answer the operations `ops`
    /// (their `op` names, e.g. `stats`, `watch`) of every healthy guest:
    /// each such stream is relayed to a fresh connection to it.
    pub fn delegate_agent(&self, ops: &[&'static str], serve: ServeAgent) {
        self.lock().delegate = Some(Delegate {
            ops: ops.to_vec(),
            serve,
        });
    }

    /// The snapshots primed now, none taken yet.
    pub fn primed(&self) -> Vec<PrimeSpec> {
        self.lock()
            .primed
            .values()
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// The warm pools the daemon last asked for, per shape.
    pub fn warm_pools(&self) -> Vec<(Shape, u32)> {
        self.lock().warm.clone()
    }

    /// How the guest of `hostname` behaves from its next boot on.
    pub fn set_guest(&self, hostname: &str, guest: Guest) {
        self.lock().guests.insert(hostname.to_owned(), guest);
    }

    /// Makes every boot fail to start, with `why` (a missing binary, say).
    pub fn refuse_boots(&self, why: Option<&str>) {
        self.lock().refuse_boot = why.map(str::to_owned);
    }

    /// Makes each priming take `delay` (as a guest's warm-up does).
    pub fn delay_priming(&self, delay: Duration) {
        self.lock().prime_delay = delay;
    }

    /// Makes a primed guest's identity fix-ups fail (or not), with `why`
    /// (a read-only `/etc`, say).
    pub fn fail_primed_identity(&self, why: Option<&str>) {
        self.lock().primed_identity_fails = why.map(str::to_owned);
    }

    /// Makes every snapshot fail, with `why` (a full disk, say).
    pub fn refuse_snapshots(&self, why: Option<&str>) {
        self.lock().refuse_snapshot = why.map(str::to_owned);
    }

    /// The memory of `hostname`'s current run (see the module docs).
    pub fn memory_of(&self, hostname: &str) -> Option<u64> {
        self.lock()
            .runs
            .get(hostname)
            .filter(|r| r.stop.borrow().is_none())
            .map(|r| r.memory)
    }

    /// The disk a VM's run was last switched to, if it was.
    pub fn switched_disk(&self, hostname: &str) -> Option<std::path::PathBuf> {
        self.lock().runs.get(hostname).and_then(|r| r.disk.clone())
    }

    /// Whether `hostname`'s current run has its vCPUs parked.
    pub fn is_paused(&self, hostname: &str) -> bool {
        self.lock()
            .runs
            .get(hostname)
            .is_some_and(|r| r.stop.borrow().is_none() && r.paused)
    }

    /// Whether `hostname` has a run that has not stopped.
    pub fn is_running(&self, hostname: &str) -> bool {
        self.lock()
            .runs
            .get(hostname)
            .is_some_and(|r| r.stop.borrow().is_none())
    }

    /// What `hostname` was asked, in order.
    pub fn seen(&self, hostname: &str) -> Vec<Seen> {
        self.lock()
            .seen
            .iter()
            .filter(|(h, _)| h == hostname)
            .map(|(_, s)| s.clone())
            .collect()
    }

    /// Boots `hostname` behind the daemon's back: a run nobody recorded.
    pub fn start_stray(&self, hostname: &str) -> Instance {
        self.start_run(hostname, Guest::Healthy, None)
    }

    /// Ends `hostname`'s run as if its guest or VMM did (`stop`).
    pub fn stop(&self, hostname: &str, stop: Stop) {
        if let Some(run) = self.lock().runs.get(hostname) {
            end(&run.stop, stop);
        }
    }

    fn record(&self, hostname: &str, seen: Seen) {
        self.lock().seen.push((hostname.to_owned(), seen));
    }

    /// Starts a run with `memory` (a restore) or a new memory (a boot).
    fn start_run(&self, hostname: &str, guest: Guest, memory: Option<u64>) -> Instance {
        let mut state = self.lock();
        state.next_pid += 1;
        let memory = memory.unwrap_or_else(|| {
            state.next_memory += 1;
            state.next_memory
        });
        let instance = Instance {
            pid: 1_000_000 + state.next_pid,
            pid_start: u64::from(state.next_pid),
        };
        let (stop, _) = watch::channel(None);
        if guest == Guest::Crashes {
            let stop = stop.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                end(&stop, Stop::Reported(StopReason::TripleFault));
            });
        }
        state.runs.insert(
            hostname.to_owned(),
            Run {
                instance,
                guest,
                stop,
                paused: false,
                memory,
                disk: None,
            },
        );
        instance
    }

    fn running(&self, hostname: &str, instance: Instance) -> Option<Running> {
        let mut rx = {
            let state = self.lock();
            let run = state.runs.get(hostname)?;
            if run.instance != instance || run.stop.borrow().is_some() {
                return None;
            }
            run.stop.subscribe()
        };
        let exit = async move {
            match rx.wait_for(Option::is_some).await {
                Ok(stop) => stop.clone().unwrap_or(Stop::Vanished),
                Err(_) => Stop::Vanished,
            }
        };
        // A fake primed VM has no agent before its fork resumes it.
        Some(Running {
            instance,
            exit: exit.boxed(),
            agent: None,
        })
    }

    fn boot_as(&self, hostname: &str, memory: Option<u64>) -> Result<Running, LaunchError> {
        if let Some(why) = self.lock().refuse_boot.clone() {
            return Err(LaunchError::Spawn {
                program: "fake-vmm".into(),
                hostname: hostname.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, why),
            });
        }
        let guest = self
            .lock()
            .guests
            .get(hostname)
            .copied()
            .unwrap_or_default();
        let instance = self.start_run(hostname, guest, memory);
        self.running(hostname, instance)
            .ok_or_else(|| LaunchError::Vsock {
                hostname: hostname.to_owned(),
                port: 0,
                detail: "stopped at once".into(),
            })
    }

    fn guest_of(&self, hostname: &str) -> Option<(Guest, watch::Sender<Option<Stop>>)> {
        let state = self.lock();
        let run = state.runs.get(hostname)?;
        if run.stop.borrow().is_some() {
            return None;
        }
        Some((run.guest, run.stop.clone()))
    }
}

impl FakeLauncher {
    /// What a fake VMM answers to `request` (its kill or shutdown already
    /// handled).
    fn vmm_answer(&self, hostname: &str, request: &VmmRequest) -> VmmResponse {
        use tine_proto::vmm::{RunState, SnapshotInfo};
        let error = |error: &str| VmmResponse::Error {
            error: error.to_owned(),
        };
        let mut state = self.lock();
        let refuse_snapshot = state.refuse_snapshot.clone();
        let Some(run) = state.runs.get_mut(hostname) else {
            return error("no VM");
        };
        let mut snapshot = None;
        let mut write_set_bytes = None;
        match request {
            VmmRequest::Pause | VmmRequest::PauseHoldingClock if run.paused => {
                return error("pause needs a running VM; it is paused")
            }
            // A fake guest has no clock to hold.
            VmmRequest::Pause | VmmRequest::PauseHoldingClock => run.paused = true,
            VmmRequest::Resume { .. } if !run.paused => {
                return error("resume needs a paused VM; it is running")
            }
            VmmRequest::Resume { .. } => run.paused = false,
            VmmRequest::Snapshot { .. } if !run.paused => {
                return error("snapshot needs a paused VM; it is running")
            }
            VmmRequest::Snapshot { .. } if refuse_snapshot.is_some() => {
                return error(refuse_snapshot.as_deref().unwrap_or_default())
            }
            VmmRequest::Snapshot {
                state_path,
                mem_path,
            } => {
                let memory = format!("guest RAM of memory {}\n", run.memory);
                let written = std::fs::write(state_path, format!("{STATE_MAGIC}{}\n", run.memory))
                    .and_then(|()| std::fs::write(mem_path, &memory));
                if let Err(e) = written {
                    return error(&format!("write snapshot: {e}"));
                }
                snapshot = Some(SnapshotInfo {
                    state_path: state_path.clone(),
                    mem_path: mem_path.clone(),
                    mem_bytes_written: memory.len() as u64,
                    duration_us: 1,
                });
            }
            VmmRequest::SwitchDisk { .. } if !run.paused => {
                return error("switch_disk needs a paused VM; it is running")
            }
            VmmRequest::SwitchDisk { path, .. } if !path.is_file() => {
                return error(&format!("cannot open disk image {}", path.display()))
            }
            VmmRequest::SwitchDisk { path, .. } => run.disk = Some(path.clone()),
            VmmRequest::Restore { .. } => {
                return error("this process already runs a VM; restore needs a --prestart process")
            }
            VmmRequest::SaveWriteSet { path } => {
                if let Err(e) = std::fs::write(path, format!("{WRITE_SET_MAGIC}{}\n", run.memory)) {
                    return error(&format!("write set {}: {e}", path.display()));
                }
                write_set_bytes = Some(FAKE_WRITE_SET_BYTES);
            }
            VmmRequest::PopulateWriteSet { path } => match read_write_set(path, run.memory) {
                Ok(()) => write_set_bytes = Some(FAKE_WRITE_SET_BYTES),
                Err(why) => return error(&why),
            },
            _ => {}
        }
        let run_state = if run.stop.borrow().is_some() {
            RunState::Stopped
        } else if run.paused {
            RunState::Paused
        } else {
            RunState::Running
        };
        VmmResponse::Ok {
            state: Some(run_state),
            snapshot,
            stop_reason: None,
            write_set_bytes,
            duration_us: 1,
        }
    }
}

/// Whether `path` is a fake write set saved by a run of the memory
/// `memory`, or why not.
fn read_write_set(path: &std::path::Path, memory: u64) -> Result<(), String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("write set {}: {e}", path.display()))?;
    let of = text
        .trim()
        .strip_prefix(WRITE_SET_MAGIC)
        .and_then(|n| n.parse::<u64>().ok())
        .ok_or_else(|| format!("write set {} cannot be decoded", path.display()))?;
    if of != memory {
        return Err(format!(
            "write set {} is of memory {of}, this VM runs memory {memory}",
            path.display()
        ));
    }
    Ok(())
}

/// What a fake VM of the memory `memory` does with the write set at
/// `path`: copies it when a run of that memory saved it, refuses it
/// otherwise.
fn copy_write_set(path: &std::path::Path, memory: u64) -> WriteSetCopy {
    match read_write_set(path, memory) {
        Ok(()) => WriteSetCopy::Copied(FAKE_WRITE_SET_BYTES),
        Err(why) => WriteSetCopy::Refused(why),
    }
}

/// The memory number of the fake snapshot in `state` and `memory`, or
/// why it is none.
fn read_snapshot(state: &std::path::Path, memory: &std::path::Path) -> Result<u64, String> {
    let text = std::fs::read_to_string(state)
        .map_err(|e| format!("cannot read {}: {e}", state.display()))?;
    let number = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix(STATE_MAGIC))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .ok_or_else(|| format!("{} is not a snapshot", state.display()))?;
    if !memory.is_file() {
        return Err(format!("no memory file {}", memory.display()));
    }
    Ok(number)
}

fn end(stop: &watch::Sender<Option<Stop>>, why: Stop) {
    stop.send_if_modified(|s| {
        if s.is_none() {
            *s = Some(why);
            true
        } else {
            false
        }
    });
}

impl Launcher for FakeLauncher {
    fn boot(&self, spec: &BootSpec) -> Result<Running, LaunchError> {
        self.record(&spec.hostname, Seen::Boot(spec.clone()));
        self.boot_as(&spec.hostname, None)
    }

    fn restore<'a>(&'a self, spec: &'a RestoreSpec) -> BoxFuture<'a, Result<Running, LaunchError>> {
        async move {
            self.record(&spec.hostname, Seen::Restore(spec.clone()));
            let memory =
                read_snapshot(&spec.state, &spec.memory).map_err(|error| LaunchError::Refused {
                    hostname: spec.hostname.clone(),
                    request: "restore".into(),
                    error,
                })?;
            let running = self.boot_as(&spec.hostname, Some(memory))?;
            if spec.paused {
                if let Some(run) = self.lock().runs.get_mut(&spec.hostname) {
                    run.paused = true;
                }
            }
            Ok(running)
        }
        .boxed()
    }

    fn prime<'a>(&'a self, spec: &'a PrimeSpec) -> BoxFuture<'a, Result<Primed, LaunchError>> {
        async move {
            let name = crate::launcher::pool::new_slot_name();
            let label = format!("{}/{name}", crate::process::POOL_DIR);
            self.record(&label, Seen::Prime(spec.clone()));
            let delay = self.lock().prime_delay;
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if let Some(why) = self.lock().refuse_boot.clone() {
                return Err(LaunchError::Refused {
                    hostname: label,
                    request: "restore".into(),
                    error: why,
                });
            }
            let memory =
                read_snapshot(&spec.state, &spec.memory).map_err(|error| LaunchError::Refused {
                    hostname: label,
                    request: "restore".into(),
                    error,
                })?;
            self.lock()
                .primed
                .insert(name.clone(), (spec.clone(), memory));
            let write_set = match &spec.write_set {
                None => WriteSetCopy::NotAsked,
                Some(path) => copy_write_set(path, memory),
            };
            // A fake guest's agent answers at once (and takes the steps
            // asked of it), its clock is nobody's.
            let identity_fails = self.lock().primed_identity_fails.clone();
            let step = |asked: bool, fails: Option<String>| match (spec.warm_agent && asked, fails)
            {
                (false, _) => GuestStep::NotAsked,
                (true, None) => GuestStep::Done,
                (true, Some(why)) => GuestStep::Failed(why),
            };
            let warm_up = match spec.warm_agent {
                false => WarmUp::NotAsked,
                true => WarmUp::Answered(0),
            };
            Ok(Primed {
                name,
                write_set,
                warm_up,
                guest_network: step(spec.guest_network.is_some(), None),
                guest_identity: step(spec.guest_identity.is_some(), identity_fails),
                guest_secrets: step(spec.guest_secrets.is_some(), None),
            })
        }
        .boxed()
    }

    fn resume_primed<'a>(
        &'a self,
        name: &'a str,
        hostname: &'a str,
    ) -> BoxFuture<'a, Result<Option<Running>, LaunchError>> {
        async move {
            let primed = self.lock().primed.remove(name);
            let Some((spec, memory)) = primed else {
                return Err(LaunchError::not_primed(hostname, name));
            };
            self.record(hostname, Seen::ResumePrimed(spec));
            self.boot_as(hostname, Some(memory)).map(Some)
        }
        .boxed()
    }

    fn populate_primed<'a>(
        &'a self,
        name: &'a str,
        write_set: &'a std::path::Path,
    ) -> BoxFuture<'a, Option<WriteSetCopy>> {
        async move {
            let label = format!("{}/{name}", crate::process::POOL_DIR);
            let memory = self.lock().primed.get(name).map(|(_, memory)| *memory)?;
            let request = VmmRequest::PopulateWriteSet {
                path: write_set.to_path_buf(),
            };
            self.record(&label, Seen::Control(request));
            Some(copy_write_set(write_set, memory))
        }
        .boxed()
    }

    fn discard_primed(&self, name: &str) {
        self.lock().primed.remove(name);
    }

    fn adopt(&self, hostname: &str, instance: Instance) -> Option<Running> {
        self.running(hostname, instance)
    }

    fn strays(&self) -> Vec<Stray> {
        self.lock()
            .runs
            .iter()
            .filter(|(_, r)| r.stop.borrow().is_none())
            .map(|(h, r)| Stray {
                pid: r.instance.pid,
                hostname: h.clone(),
            })
            .collect()
    }

    fn kill_strays<'a>(&'a self, strays: &'a [Stray]) -> BoxFuture<'a, ()> {
        async move {
            for s in strays {
                self.record(&s.hostname, Seen::Kill);
                self.stop(
                    &s.hostname,
                    Stop::Signalled {
                        signal: 9,
                        output: String::new(),
                    },
                );
            }
        }
        .boxed()
    }

    fn kill(&self, hostname: &str, instance: Instance) {
        let state = self.lock();
        if let Some(run) = state.runs.get(hostname).filter(|r| r.instance == instance) {
            end(
                &run.stop,
                Stop::Signalled {
                    signal: 9,
                    output: String::new(),
                },
            );
        }
        drop(state);
        self.record(hostname, Seen::Kill);
    }

    fn control<'a>(
        &'a self,
        hostname: &'a str,
        request: &'a VmmRequest,
    ) -> BoxFuture<'a, Result<VmmResponse, LaunchError>> {
        async move {
            self.record(hostname, Seen::Control(request.clone()));
            let Some((guest, stop)) = self.guest_of(hostname) else {
                return Err(LaunchError::Control {
                    hostname: hostname.to_owned(),
                    source: std::io::Error::new(std::io::ErrorKind::NotFound, "not running"),
                });
            };
            match request {
                VmmRequest::Kill => end(&stop, Stop::Reported(StopReason::Killed)),
                VmmRequest::Shutdown if guest != Guest::Deaf => {
                    end(&stop, Stop::Reported(StopReason::GuestPoweroff(0)))
                }
                _ => {}
            }
            Ok(self.vmm_answer(hostname, request))
        }
        .boxed()
    }

    fn keep_warm<'a>(&'a self, wanted: &'a [(Shape, u32)]) -> BoxFuture<'a, ()> {
        self.lock().warm = wanted.to_vec();
        Box::pin(async {})
    }

    fn connect<'a>(
        &'a self,
        hostname: &'a str,
        port: u32,
    ) -> BoxFuture<'a, Result<Box<dyn GuestStream>, LaunchError>> {
        async move {
            let refused = |detail: &str| LaunchError::Vsock {
                hostname: hostname.to_owned(),
                port,
                detail: detail.to_owned(),
            };
            let Some((guest, stop)) = self.guest_of(hostname) else {
                return Err(refused("the VM does not run"));
            };
            if self.is_paused(hostname) {
                return Err(refused("the VM is paused"));
            }
            if matches!(guest, Guest::Silent | Guest::Crashes)
                || port != tine_proto::agent::AGENT_VSOCK_PORT
            {
                return Err(refused("the port is not open"));
            }
            let (ours, theirs) = tokio::io::duplex(1 << 20);
            let agent = FakeAgent {
                launcher: self.clone(),
                hostname: hostname.to_owned(),
                guest,
                stop,
            };
            tokio::spawn(agent.serve(theirs));
            Ok(Box::new(ours) as Box<dyn GuestStream>)
        }
        .boxed()
    }
}

/// The guest side of one agent connection.
struct FakeAgent {
    launcher: FakeLauncher,
    hostname: String,
    guest: Guest,
    stop: watch::Sender<Option<Stop>>,
}

impl FakeAgent {
    async fn serve(self, mut io: tokio::io::DuplexStream) {
        let welcome = Welcome {
            version: PROTOCOL_VERSION,
            agent_version: "fake".into(),
            max_frame_len: MAX_FRAME_LEN,
            stream_window: tine_proto::agent::mux::STREAM_WINDOW,
        };
        if server_handshake(&mut io, &welcome).await.is_err() {
            return;
        }
        let config = MuxConfig {
            max_frame_len: MAX_FRAME_LEN,
            max_streams: 16,
        };
        let (_mux, mut incoming) = Mux::server(io, config);
        let this = Arc::new(self);
        while let Some(stream) = incoming.accept().await {
            tokio::spawn(this.clone().answer(stream));
        }
    }

    /// Waits until this guest's agent was asked something after its last
    /// fix-up request, or `limit`.
    async fn until_asked_more(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < deadline {
            let seen = self.launcher.seen(&self.hostname);
            let after_fixups = seen
                .iter()
                .rev()
                .take_while(|s| !matches!(s, Seen::Agent(Request::Fixups(_))))
                .any(|s| matches!(s, Seen::Agent(_)));
            if after_fixups {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    async fn answer(self: Arc<Self>, mut stream: Stream) {
        let Some(Inbound::Msg(bytes)) = stream.recv().await else {
            return;
        };
        let Ok(request) = serde_json::from_slice::<Request>(&bytes) else {
            let reply = Response::error(ErrorCode::BadRequest, "not a request");
            send_reply(&stream, &reply).await;
            return;
        };
        self.launcher
            .record(&self.hostname, Seen::Agent(request.clone()));
        if self.guest == Guest::Hangs {
            std::future::pending::<()>().await;
        }
        let delegate = self.launcher.lock().delegate.clone();
        if let Some(d) = delegate.filter(|d| d.ops.iter().any(|op| *op == op_name(&bytes))) {
            return relay(stream, &request, &d.serve).await;
        }
        if let Request::Exec(req) = &request {
            if let Some(options) = &req.background {
                let reply = self.start_job(req, options.ring_bytes);
                send_reply(&stream, &reply).await;
                return;
            }
        }
        if let Request::Exec(req) = request {
            return run_exec(stream, req).await;
        }
        if let Some(reply) = self.answer_job(&stream, &request).await {
            send_reply(&stream, &reply).await;
            return;
        }
        if let Request::List(req) = &request {
            let reply = match host_list(&req.path) {
                Ok(entries) => {
                    if stream
                        .send_msg(&Response::Entries { entries })
                        .await
                        .is_err()
                    {
                        return;
                    }
                    Response::Ok
                }
                Err(e) => io_reply(e),
            };
            send_reply(&stream, &reply).await;
            return;
        }
        let reply = match request {
            Request::Health => Response::Health(Health {
                agent_version: "fake".into(),
                protocol: PROTOCOL_VERSION,
                agent_uptime_ms: 1,
                system_uptime_ms: 1,
                userdata: UserdataStatus::default(),
            }),
            Request::Fixups(_) if self.guest == Guest::FailsFixups => {
                Response::error(ErrorCode::Other, "fix-ups failed in the guest")
            }
            Request::Fixups(req) => {
                if self.guest == Guest::SlowFixups {
                    self.until_asked_more(Duration::from_secs(1)).await;
                }
                let reply = Response::Fixups(Box::new(FixupReport {
                    hostname: req.hostname,
                    ..FixupReport::default()
                }));
                send_reply(&stream, &reply).await;
                self.launcher.record(&self.hostname, Seen::FixupsAnswered);
                return;
            }
            Request::Network(_) | Request::UserdataRun(_) => Response::Ok,
            Request::SecretsSync(req) => Response::Secrets(SecretsReport {
                dir: "/run/tine/secrets".into(),
                written: req.secrets.into_iter().map(|s| s.name).collect(),
                removed: Vec::new(),
            }),
            Request::AuthorizedKeys(req) => Response::Keys(KeysReport {
                users: vec!["root".into()],
                added: req.keys.len() as u32,
            }),
            Request::Stat(req) => host_stat(std::path::Path::new(&req.path), req.follow)
                .map_or_else(io_reply, Response::Stat),
            Request::Mkdir(req) => host_mkdir(&req).map_or_else(io_reply, |()| Response::Ok),
            Request::Remove(req) => {
                let path = std::path::Path::new(&req.path);
                let done = match std::fs::symlink_metadata(path) {
                    Ok(m) if m.is_dir() && req.recursive => std::fs::remove_dir_all(path),
                    Ok(m) if m.is_dir() => std::fs::remove_dir(path),
                    Ok(_) => std::fs::remove_file(path),
                    Err(e) => Err(e),
                };
                done.map_or_else(io_reply, |()| Response::Ok)
            }
            Request::UserdataStatus => Response::Userdata(UserdataStatus::default()),
            Request::Shutdown(_) => {
                if self.guest != Guest::Deaf {
                    let stop = self.stop.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        end(&stop, Stop::Reported(StopReason::GuestPoweroff(0)));
                    });
                }
                Response::Ok
            }
            other => Response::error(
                ErrorCode::UnknownOperation,
                format!("the fake agent does not do {other:?}"),
            ),
        };
        send_reply(&stream, &reply).await;
    }
}

impl FakeAgent {
    fn job(&self, id: u64) -> Option<FakeJob> {
        let state = self.launcher.lock();
        state.jobs.get(&self.hostname)?.get(&id).cloned()
    }

    /// Starts a background exec as a host process.
    fn start_job(&self, req: &tine_proto::agent::ExecRequest, ring_bytes: u64) -> Response {
        use tokio::io::AsyncReadExt;
        let mut cmd = match host_command(req) {
            Ok(cmd) => cmd,
            Err(reply) => return reply,
        };
        // Its own process group, signalled whole, as the agent does.
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => return Response::error(ErrorCode::SpawnFailed, format!("spawn: {e}")),
        };
        let pid = child.id().unwrap_or_default();
        let out = Arc::new(Mutex::new((Vec::new(), Vec::new())));
        let (exit_tx, exit_rx) = watch::channel(None);
        let began = std::time::Instant::now();
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let sink = out.clone();
        tokio::spawn(async move {
            let pump = |r: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>>, err: bool| {
                let sink = sink.clone();
                async move {
                    let Some(mut r) = r else { return };
                    let mut buf = vec![0u8; 16 << 10];
                    while let Ok(n @ 1..) = r.read(&mut buf).await {
                        let mut o = sink.lock().unwrap_or_else(|p| p.into_inner());
                        if err { &mut o.1 } else { &mut o.0 }.extend_from_slice(&buf[..n]);
                    }
                }
            };
            let boxed = |r: Option<tokio::process::ChildStdout>| {
                r.map(|r| Box::new(r) as Box<dyn tokio::io::AsyncRead + Send + Unpin>)
            };
            let boxed_err = |r: Option<tokio::process::ChildStderr>| {
                r.map(|r| Box::new(r) as Box<dyn tokio::io::AsyncRead + Send + Unpin>)
            };
            let (_, _, status) = tokio::join!(
                pump(boxed(stdout), false),
                pump(boxed_err(stderr), true),
                child.wait()
            );
            use std::os::unix::process::ExitStatusExt;
            let status = status.map_or_else(
                |_| tine_proto::agent::ExitStatus::default(),
                |s| tine_proto::agent::ExitStatus {
                    code: s.code(),
                    signal: s.signal(),
                    duration_ms: began.elapsed().as_millis() as u64,
                    ..Default::default()
                },
            );
            exit_tx.send_replace(Some(status));
        });
        let command = match &req.command {
            tine_proto::agent::Command::Argv(argv) => argv.join(" "),
            tine_proto::agent::Command::Shell { script, .. } => script.clone(),
        };
        let started_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default();
        let mut state = self.launcher.lock();
        state.next_job += 1;
        let id = state.next_job;
        state.jobs.entry(self.hostname.clone()).or_default().insert(
            id,
            FakeJob {
                pid,
                command,
                started_ms,
                ring_bytes,
                out,
                exit: exit_rx,
            },
        );
        Response::BgStarted { id, pid }
    }

    /// Answers the `bg_*` requests; `None` for any other.
    async fn answer_job(&self, stream: &Stream, request: &Request) -> Option<Response> {
        use tine_proto::agent::Channel;
        let missing = |id: u64| Response::error(ErrorCode::NotFound, format!("no job {id}"));
        Some(match request {
            Request::BgList => {
                let jobs = {
                    let state = self.launcher.lock();
                    let mut jobs: Vec<_> = state
                        .jobs
                        .get(&self.hostname)
                        .map(|j| j.iter().map(|(id, job)| job.info(*id)).collect())
                        .unwrap_or_default();
                    jobs.sort_by_key(|j: &tine_proto::agent::BgJob| j.id);
                    jobs
                };
                Response::BgJobs { jobs }
            }
            Request::BgWait(req) => {
                let Some(job) = self.job(req.id) else {
                    return Some(missing(req.id));
                };
                let mut exit = job.exit.clone();
                let wait = exit.wait_for(Option::is_some);
                let status = match req.timeout_ms {
                    Some(ms) => match tokio::time::timeout(Duration::from_millis(ms), wait).await {
                        Ok(r) => r.ok().and_then(|s| *s),
                        Err(_) => {
                            return Some(Response::error(ErrorCode::Timeout, "still running"))
                        }
                    },
                    None => wait.await.ok().and_then(|s| *s),
                };
                Response::Exited(status.unwrap_or_default())
            }
            Request::BgKill(req) => {
                let Some(job) = self.job(req.id) else {
                    return Some(missing(req.id));
                };
                if job.exit.borrow().is_none() {
                    if let (Ok(pid), Ok(sig)) = (
                        i32::try_from(job.pid),
                        nix::sys::signal::Signal::try_from(req.signal),
                    ) {
                        let group = nix::unistd::Pid::from_raw(pid);
                        if let Err(e) = nix::sys::signal::killpg(group, sig) {
                            tracing::debug!("fake agent: signal {sig} to job {pid}: {e}");
                        }
                    }
                }
                Response::Ok
            }
            Request::BgRemove(req) => {
                let Some(job) = self.job(req.id) else {
                    return Some(missing(req.id));
                };
                if job.exit.borrow().is_none() {
                    return Some(Response::error(
                        ErrorCode::BadRequest,
                        format!("job {} still runs; kill it first", req.id),
                    ));
                }
                let mut state = self.launcher.lock();
                if let Some(jobs) = state.jobs.get_mut(&self.hostname) {
                    jobs.remove(&req.id);
                }
                Response::Ok
            }
            Request::BgLogs(req) => {
                let Some(job) = self.job(req.id) else {
                    return Some(missing(req.id));
                };
                if req.from_id.is_some() {
                    return Some(Response::error(
                        ErrorCode::BadRequest,
                        "the fake agent keeps no frame ids",
                    ));
                }
                if req.follow {
                    let mut exit = job.exit.clone();
                    if exit.wait_for(Option::is_some).await.is_err() {
                        tracing::debug!("fake agent: job {} ended without a status", job.pid);
                    }
                }
                let (o, e) = job.out.lock().unwrap_or_else(|p| p.into_inner()).clone();
                let window = |data: &[u8], from: Option<u64>| {
                    let total = data.len() as u64;
                    let oldest = total.saturating_sub(job.ring_bytes);
                    let mut from = from.unwrap_or(oldest);
                    if let Some(tail) = req.tail_bytes {
                        from = from.max(total.saturating_sub(tail));
                    }
                    let dropped = oldest.saturating_sub(from);
                    let start = from.max(oldest).min(total);
                    (start, dropped, data[start as usize..].to_vec(), total)
                };
                let (so, do_, out, to) = window(&o, req.stdout_from);
                let (se, de, err, te) = window(&e, req.stderr_from);
                let start = Response::LogsStart {
                    stdout_from: so,
                    stderr_from: se,
                    dropped: do_ + de,
                    dropped_frames: 0,
                };
                if stream.send_msg(&start).await.is_err()
                    || stream.send_data(Channel::Stdout, &out).await.is_err()
                    || stream.send_data(Channel::Stderr, &err).await.is_err()
                {
                    return None;
                }
                let exit = *job.exit.borrow();
                Response::LogsEnd {
                    stdout_to: to,
                    stderr_to: te,
                    dropped: do_ + de,
                    exit,
                    next_id: 0,
                }
            }
            _ => return None,
        })
    }
}

/// The `op` of a request message.
fn op_name(bytes: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|v| v.get("op").and_then(|op| op.as_str().map(str::to_owned)))
        .unwrap_or_default()
}

/// Sends the fake agent's `reply`; a client that has gone is logged.
async fn send_reply(stream: &Stream, reply: &Response) {
    if let Err(e) = stream.send_msg(reply).await {
        tracing::debug!("fake agent: cannot send a reply: {e}");
    }
}

/// Relays one stream to a new connection to the agent `serve` runs: the
/// request, then every message, data frame and EOF both ways until
/// either side ends.
async fn relay(ours: Stream, request: &Request, serve: &ServeAgent) {
    use tine_proto::agent::mux::StreamSender;
    use tine_proto::agent::{client_handshake, Hello};
    let (mut io, theirs) = tokio::io::duplex(1 << 20);
    serve(theirs);
    let hello = Hello {
        version: PROTOCOL_VERSION,
        client: "fake-relay".into(),
    };
    if let Err(e) = client_handshake(&mut io, &hello).await {
        let reply = Response::error(ErrorCode::Other, format!("relay handshake: {e}"));
        send_reply(&ours, &reply).await;
        return;
    }
    let config = MuxConfig {
        max_frame_len: MAX_FRAME_LEN,
        max_streams: 16,
    };
    let mux = Mux::client(io, config);
    let theirs = match mux.open_with_msg(request) {
        Ok(stream) => stream,
        Err(e) => {
            let reply = Response::error(ErrorCode::Other, format!("relay: {e}"));
            send_reply(&ours, &reply).await;
            return;
        }
    };
    async fn pump(mut rx: tine_proto::agent::StreamReceiver, tx: StreamSender) {
        while let Some(item) = rx.recv().await {
            let sent = match item {
                Inbound::Msg(bytes) => match serde_json::from_slice::<serde_json::Value>(&bytes) {
                    Ok(msg) => tx.send_msg(&msg).await,
                    Err(_) => return,
                },
                Inbound::Data(channel, chunk) => tx.send_data_vec(channel, chunk.into_vec()).await,
                Inbound::Eof(channel) => tx.send_eof(channel).await,
            };
            if sent.is_err() {
                return;
            }
        }
    }
    let (our_tx, our_rx) = ours.split();
    let (their_tx, their_rx) = theirs.split();
    tokio::select! {
        () = pump(our_rx, their_tx) => {}
        () = pump(their_rx, our_tx) => {}
    }
    drop(mux);
}

/// A host process for `req`'s command, or the agent's refusal.
fn host_command(req: &tine_proto::agent::ExecRequest) -> Result<tokio::process::Command, Response> {
    use tine_proto::agent::Command;
    let mut cmd = match &req.command {
        Command::Argv(argv) if !argv.is_empty() => {
            let mut c = tokio::process::Command::new(&argv[0]);
            c.args(&argv[1..]);
            c
        }
        Command::Argv(_) => return Err(Response::error(ErrorCode::BadRequest, "empty argv")),
        Command::Shell {
            script,
            interpreter,
        } => {
            let mut c = tokio::process::Command::new(interpreter.as_deref().unwrap_or("/bin/sh"));
            c.arg("-c").arg(script);
            c
        }
    };
    cmd.envs(&req.options.env);
    if let Some(cwd) = &req.options.cwd {
        cmd.current_dir(cwd);
    }
    Ok(cmd)
}

/// Runs an exec as a host process: its stdout and stderr as data frames,
/// stdin from the stream's data channel, then its exit status.
async fn run_exec(stream: Stream, req: tine_proto::agent::ExecRequest) {
    use tine_proto::agent::{Channel, ExitStatus};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut cmd = match host_command(&req) {
        Ok(cmd) => cmd,
        Err(reply) => {
            send_reply(&stream, &reply).await;
            return;
        }
    };
    cmd.stdin(if req.stdin {
        std::process::Stdio::piped()
    } else {
        std::process::Stdio::null()
    })
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .kill_on_drop(true);
    let began = std::time::Instant::now();
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => {
            let reply = Response::error(ErrorCode::SpawnFailed, format!("spawn: {e}"));
            send_reply(&stream, &reply).await;
            return;
        }
    };
    let pid = child.id().unwrap_or_default();
    if stream.send_msg(&Response::Started { pid }).await.is_err() {
        return;
    }
    let (tx, mut rx) = stream.split();
    let mut stdin = child.stdin.take();
    let feed = async move {
        while let Some(inbound) = rx.recv().await {
            match inbound {
                Inbound::Data(Channel::Data, chunk) => {
                    if let Some(w) = stdin.as_mut() {
                        if w.write_all(&chunk.into_vec()).await.is_err() {
                            stdin = None;
                        }
                    }
                }
                Inbound::Eof(Channel::Data) => stdin = None,
                _ => {}
            }
        }
    };
    let feeder = tokio::spawn(feed);
    let pump = |mut r: Box<dyn tokio::io::AsyncRead + Send + Unpin>, channel: Channel| {
        let tx = tx.clone();
        async move {
            let mut buf = vec![0u8; 64 << 10];
            while let Ok(n @ 1..) = r.read(&mut buf).await {
                if tx.send_data(channel, &buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    };
    let out = child
        .stdout
        .take()
        .map(|r| pump(Box::new(r), Channel::Stdout));
    let err = child
        .stderr
        .take()
        .map(|r| pump(Box::new(r), Channel::Stderr));
    let (_, _, status) = tokio::join!(
        async {
            if let Some(f) = out {
                f.await
            }
        },
        async {
            if let Some(f) = err {
                f.await
            }
        },
        child.wait()
    );
    feeder.abort();
    let status = match status {
        Ok(s) => {
            use std::os::unix::process::ExitStatusExt;
            ExitStatus {
                code: s.code(),
                signal: s.signal(),
                duration_ms: began.elapsed().as_millis() as u64,
                ..ExitStatus::default()
            }
        }
        Err(e) => {
            let reply = Response::error(ErrorCode::Other, format!("wait: {e}"));
            if let Err(e) = tx.send_msg(&reply).await {
                tracing::debug!("fake agent: cannot send a reply: {e}");
            }
            return;
        }
    };
    if let Err(e) = tx.send_msg(&Response::Exited(status)).await {
        tracing::debug!("fake agent: cannot send an exit status: {e}");
    }
}

/// An I/O error as the agent reports it.
fn io_reply(e: std::io::Error) -> Response {
    let code = match e.kind() {
        std::io::ErrorKind::NotFound => ErrorCode::NotFound,
        std::io::ErrorKind::AlreadyExists => ErrorCode::AlreadyExists,
        std::io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
        _ => ErrorCode::Io,
    };
    Response::error(code, e.to_string())
}

fn host_stat(path: &std::path::Path, follow: bool) -> std::io::Result<tine_proto::agent::FileStat> {
    use std::os::unix::fs::MetadataExt;
    use tine_proto::agent::FileKind;
    let m = if follow {
        std::fs::metadata(path)?
    } else {
        std::fs::symlink_metadata(path)?
    };
    let kind = if m.file_type().is_symlink() {
        FileKind::Symlink
    } else if m.is_dir() {
        FileKind::Dir
    } else if m.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    Ok(tine_proto::agent::FileStat {
        kind,
        size: m.len(),
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        mtime_secs: m.mtime(),
        mtime_nanos: u32::try_from(m.mtime_nsec()).unwrap_or(0),
        symlink_target: std::fs::read_link(path)
            .ok()
            .map(|t| t.display().to_string()),
    })
}

fn host_list(path: &str) -> std::io::Result<Vec<tine_proto::agent::DirEntry>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(path)? {
        let e = e?;
        out.push(tine_proto::agent::DirEntry {
            name: e.file_name().to_string_lossy().into_owned(),
            stat: host_stat(&e.path(), false)?,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn host_mkdir(req: &tine_proto::agent::MkdirRequest) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if req.parents {
        std::fs::create_dir_all(&req.path)?;
    } else {
        std::fs::create_dir(&req.path)?;
    }
    if let Some(mode) = req.attrs.mode {
        std::fs::set_permissions(&req.path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}
