//! Running VMs: the [`Launcher`] trait the daemon's core drives, its real
//! implementation over `tine-vmm` processes ([`vmm::VmmLauncher`]) and an
//! in-process stand-in for tests and benchmarks ([`fake::FakeLauncher`]).
//!
//! The core never spawns, signals or connects to a process itself: it asks
//! the launcher to boot or restore a VM, to pause, resume, snapshot, shut
//! down or kill it, and to open a vsock connection to its agent; it learns
//! that a VM stopped from the [`Running::exit`] future, as a typed
//! [`Stop`].

pub mod fake;
pub mod pool;
pub mod vmm;

use std::path::PathBuf;

use futures_util::future::BoxFuture;
use tine_proto::agent::{FixupRequest, NetworkRequest, SecretFile};
use tine_proto::vmm::{Request as VmmRequest, Response as VmmResponse};
use tine_proto::vmm::{RunState, SnapshotInfo, StopReason};
use tokio::io::{AsyncRead, AsyncWrite};

/// The device id tine-vmm gives the first (root) disk.
pub const ROOT_DRIVE: &str = "drive0";

/// The device id tine-vmm gives the first NIC.
pub const ROOT_NIC: &str = "net0";

/// What a pooled process can run: a snapshot of this many vCPUs and MiB
/// of RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Shape {
    /// vCPUs.
    pub cpus: u32,
    /// RAM in MiB.
    pub ram_mib: u64,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} vCPU, {} MiB", self.cpus, self.ram_mib)
    }
}

/// What to boot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootSpec {
    /// The VM (its folder and sockets are named after it).
    pub hostname: String,
    /// Guest kernel.
    pub kernel: PathBuf,
    /// Kernel command line.
    pub cmdline: String,
    /// vCPUs.
    pub cpus: u32,
    /// RAM in MiB.
    pub ram_mib: u64,
    /// Root disk.
    pub disk: PathBuf,
    /// TAP and MAC, when the VM has a NIC.
    pub net: Option<(String, String)>,
}

/// What to restore: a snapshot resumed in a process started ahead of time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreSpec {
    /// The VM.
    pub hostname: String,
    /// vCPUs of the snapshot.
    pub cpus: u32,
    /// RAM of the snapshot in MiB.
    pub ram_mib: u64,
    /// The snapshot's state file.
    pub state: PathBuf,
    /// The snapshot's memory file (mapped copy-on-write).
    pub memory: PathBuf,
    /// Leave the vCPUs parked after the restore.
    pub paused: bool,
    /// The root disk (`drive0`) to attach instead of the snapshot's.
    pub disk: Option<PathBuf>,
    /// The TAP for the NIC (`net0`) instead of the snapshot's.
    pub tap: Option<String>,
}

/// A memory commit's snapshot to restore ahead of any VM, paused, with
/// the disk and TAP a hot fork will take over with it (see
/// [`Launcher::prime`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrimeSpec {
    /// vCPUs of the snapshot.
    pub cpus: u32,
    /// RAM of the snapshot in MiB.
    pub ram_mib: u64,
    /// The snapshot's state file.
    pub state: PathBuf,
    /// The snapshot's memory file (mapped copy-on-write).
    pub memory: PathBuf,
    /// The root disk (`drive0`): a spare overlay, in `folder`.
    pub disk: PathBuf,
    /// The folder that becomes the fork's folder by one rename: once the
    /// snapshot is restored, the process's sockets and logs move into it,
    /// so that the rename moves them too.
    pub folder: PathBuf,
    /// The TAP for the NIC (`net0`), when the fork will have one.
    pub tap: Option<String>,
    /// A write set of the snapshot (the pages an earlier fork wrote by the
    /// end of its set-up) to copy in while the VM waits, so that its fork's
    /// guest finds them its own. One that cannot be copied leaves the VM
    /// primed without it (logged).
    pub write_set: Option<PathBuf>,
    /// Run the guest, once restored, until its agent answers a handshake,
    /// then pause it again holding its clock (`pause_holding_clock`): what
    /// a restored guest does once (the kernel's work after the restore,
    /// the agent's first answer) is done before any fork, and the fork's
    /// guest goes on from the same instant of its clock however long it
    /// waited. Its TAP stays in quarantine.
    pub warm_agent: bool,
    /// With `warm_agent`: the guest's network to set once its agent
    /// answers (the spare network's address and MAC), so that the fork
    /// that takes the VM with that network need not.
    pub guest_network: Option<NetworkRequest>,
    /// With `warm_agent`: the fix-ups that give the guest an identity of
    /// its own once its agent answers (a machine-id, SSH host keys,
    /// entropy; no hostname, the fork's is not known yet), so that the
    /// fork that takes the VM need not.
    pub guest_identity: Option<FixupRequest>,
    /// With `warm_agent`: the secrets to sync into the guest once its
    /// agent answers (those its commit's forks inherit), so that a fork
    /// that is granted the same need not.
    pub guest_secrets: Option<Vec<SecretFile>>,
}

/// A VM primed ahead of a hot fork by [`Launcher::prime`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Primed {
    /// The name [`Launcher::resume_primed`] takes it by.
    pub name: String,
    /// What became of the write set its spec named.
    pub write_set: WriteSetCopy,
    /// What running it until its agent answered did.
    pub warm_up: WarmUp,
    /// Whether its guest's network was set as the spec asked.
    pub guest_network: GuestStep,
    /// Whether its guest's identity fix-ups were applied as the spec asked.
    pub guest_identity: GuestStep,
    /// Whether its guest's secrets were synced as the spec asked.
    pub guest_secrets: GuestStep,
}

/// What became of a step a primed VM's agent was asked to take ahead of
/// its fork ([`PrimeSpec::guest_network`], [`PrimeSpec::guest_identity`],
/// [`PrimeSpec::guest_secrets`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestStep {
    /// The spec did not ask for it (or its agent never answered).
    NotAsked,
    /// The agent took it.
    Done,
    /// The agent did not (or not all of it), with why: the fork takes it.
    Failed(String),
}

/// What running a primed VM until its agent answered did
/// ([`PrimeSpec::warm_agent`]). The VM is primed (paused, its clock held)
/// whichever it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WarmUp {
    /// The spec did not ask for it.
    NotAsked,
    /// The agent answered after this many milliseconds.
    Answered(u64),
    /// It did not, with why (a guest without an agent or a vsock device).
    NoAnswer(String),
}

/// What priming a VM did with the write set its spec named. The VM is
/// primed whichever it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteSetCopy {
    /// The spec named none.
    NotAsked,
    /// Its pages were copied in: this many bytes.
    Copied(u64),
    /// The VMM refused the file (not a write set of this snapshot's
    /// memory), with its reason.
    Refused(String),
    /// The request went unanswered, with why: nothing is known of the
    /// file.
    Failed(String),
}

impl WriteSetCopy {
    /// What a VMM's answer to `populate_write_set` says of the copy.
    pub fn answered<E: std::fmt::Display>(answer: Result<VmmResponse, E>) -> Self {
        match answer {
            Ok(VmmResponse::Ok {
                write_set_bytes, ..
            }) => WriteSetCopy::Copied(write_set_bytes.unwrap_or(0)),
            Ok(VmmResponse::Error { error }) => WriteSetCopy::Refused(error),
            Err(e) => WriteSetCopy::Failed(e.to_string()),
        }
    }
}

/// One run of a VM: the process (or stand-in) that runs it. A pid plus
/// its start time names a process uniquely, also across daemon restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Instance {
    /// Process id.
    pub pid: u32,
    /// Process start time (clock ticks since boot).
    pub pid_start: u64,
}

/// Why a run ended, as the launcher saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The VMM reported the stop.
    Reported(StopReason),
    /// The process ended without a report, with this exit code.
    Exited {
        /// Exit status.
        code: i32,
        /// The last lines it wrote (start-up errors).
        output: String,
    },
    /// The process was killed by a signal without a report.
    Signalled {
        /// The signal.
        signal: i32,
        /// The last lines it wrote.
        output: String,
    },
    /// The process went away and nothing says why (an adopted process,
    /// which the daemon cannot reap).
    Vanished,
}

impl Stop {
    /// A guest power-off or reboot, or a kill the VMM was asked for: not a
    /// failure of the guest or the VMM.
    pub fn is_clean(&self) -> bool {
        matches!(self, Stop::Reported(reason) if reason.is_clean())
    }

    /// For people: `guest_poweroff: 0`, `triple_fault`, `tine-vmm was
    /// killed by signal 9: ...`.
    pub fn describe(&self) -> String {
        fn with_output(how: String, output: &str) -> String {
            if output.is_empty() {
                how
            } else {
                format!("{how}: {output}")
            }
        }
        match self {
            Stop::Reported(reason) => reason.to_string(),
            Stop::Exited { code, output } => {
                with_output(format!("tine-vmm exited with status {code}"), output)
            }
            Stop::Signalled { signal, output } => {
                with_output(format!("tine-vmm was killed by signal {signal}"), output)
            }
            Stop::Vanished => "tine-vmm exited without a stop report".into(),
        }
    }
}

/// A VM that runs: its instance, and a future that ends with the run.
pub struct Running {
    /// The process.
    pub instance: Instance,
    /// Resolves once the run has ended, with why.
    pub exit: BoxFuture<'static, Stop>,
    /// A connection to its guest's agent that the launcher held already
    /// (a primed VM's, open since its warm-up), for its set-up.
    pub agent: Option<tine_client::AgentClient>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

/// A connection to a port of a guest's vsock.
pub trait GuestStream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> GuestStream for T {}

/// A process that runs a VM nobody recorded (a crash between launch and
/// record), or a warm pool's process no launcher holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stray {
    /// Process id.
    pub pid: u32,
    /// The VM folder it runs in (`pool/<slot>` for a pool's process, which
    /// no VM is named).
    pub hostname: String,
}

/// Why a launcher call failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Starting the process failed.
    #[error("cannot start {program} for {hostname}")]
    Spawn {
        /// The VMM binary.
        program: PathBuf,
        /// The VM.
        hostname: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Preparing the VM's folder failed.
    #[error("cannot prepare {path}")]
    Prepare {
        /// What.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The VMM's control socket failed or did not answer in time.
    #[error("control socket of {hostname}")]
    Control {
        /// The VM.
        hostname: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The VMM refused a request.
    #[error("tine-vmm of {hostname} refused {request}: {error}")]
    Refused {
        /// The VM.
        hostname: String,
        /// The request, for people.
        request: String,
        /// The VMM's answer.
        error: String,
    },
    /// The guest's vsock port could not be reached.
    #[error("vsock port {port} of {hostname}: {detail}")]
    Vsock {
        /// The VM.
        hostname: String,
        /// The port.
        port: u32,
        /// What happened.
        detail: String,
    },
}

impl LaunchError {
    /// `resume_primed` of a name the launcher does not hold.
    pub fn not_primed(hostname: &str, name: &str) -> Self {
        LaunchError::Refused {
            hostname: hostname.to_owned(),
            request: "resume".into(),
            error: format!("no primed process {name}"),
        }
    }
}

/// Runs VMs for the daemon. Every method names the VM by hostname; the
/// launcher knows where its files are.
pub trait Launcher: Send + Sync + std::fmt::Debug + 'static {
    /// Boots a VM from its disk.
    fn boot(&self, spec: &BootSpec) -> Result<Running, LaunchError>;

    /// Starts a process ahead of time and restores a snapshot into it.
    fn restore<'a>(&'a self, spec: &'a RestoreSpec) -> BoxFuture<'a, Result<Running, LaunchError>>;

    /// Restores `spec` paused into a process of its own, ahead of any VM,
    /// moves its sockets and logs into `spec.folder`, and copies in the
    /// pages of `spec.write_set`; returns the name
    /// [`Launcher::resume_primed`] takes it by, and what became of the
    /// write set. Nothing of it runs until then; a restarted daemon finds
    /// it a stray.
    fn prime<'a>(&'a self, spec: &'a PrimeSpec) -> BoxFuture<'a, Result<Primed, LaunchError>>;

    /// Hands the primed process `name` to `hostname`, whose folder is the
    /// one it was primed with, renamed (its sockets, logs, disk and TAP
    /// are the VM's from now on), and runs its vCPUs. `None` when that
    /// process had ended while it waited: its guest never ran, so its disk
    /// and TAP are as they were made. A failure stops the process.
    fn resume_primed<'a>(
        &'a self,
        name: &'a str,
        hostname: &'a str,
    ) -> BoxFuture<'a, Result<Option<Running>, LaunchError>>;

    /// Stops a primed process nobody will take.
    fn discard_primed(&self, name: &str);

    /// Copies the pages of the write set `write_set` into the primed
    /// process `name` while it waits (one primed before its snapshot had a
    /// write set); says what became of them. A process taken meanwhile is
    /// left alone: `None`.
    fn populate_primed<'a>(
        &'a self,
        name: &'a str,
        write_set: &'a std::path::Path,
    ) -> BoxFuture<'a, Option<WriteSetCopy>>;

    /// Takes over a run a previous daemon started, if it is still that
    /// process; `None` when it is gone.
    fn adopt(&self, hostname: &str, instance: Instance) -> Option<Running>;

    /// Every run under this daemon's data directory; reconciliation kills
    /// those no live record names.
    fn strays(&self) -> Vec<Stray>;

    /// Kills a stray run and waits (bounded) until it is gone.
    fn kill_strays<'a>(&'a self, strays: &'a [Stray]) -> BoxFuture<'a, ()>;

    /// Kills a run at once, if it is still that process (the last resort
    /// when its VMM does not answer).
    fn kill(&self, hostname: &str, instance: Instance);

    /// Sends one request to the VM's VMM and returns its answer (bounded
    /// in time).
    fn control<'a>(
        &'a self,
        hostname: &'a str,
        request: &'a VmmRequest,
    ) -> BoxFuture<'a, Result<VmmResponse, LaunchError>>;

    /// Opens a connection to a vsock port of the guest (the agent's, 52).
    fn connect<'a>(
        &'a self,
        hostname: &'a str,
        port: u32,
    ) -> BoxFuture<'a, Result<Box<dyn GuestStream>, LaunchError>>;

    /// Keeps `count` processes of each listed shape started ahead of time
    /// for [`Launcher::restore`] (refilled as restores take them) and none
    /// of any other shape; returns once they are started. A launcher
    /// without such processes (the stand-in) has nothing to do.
    fn keep_warm<'a>(&'a self, _wanted: &'a [(Shape, u32)]) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }
}

/// What a VMM answered to a request it carried out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Done {
    /// Run state after the request, when a VM exists.
    pub state: Option<RunState>,
    /// Snapshot details, for `snapshot`.
    pub snapshot: Option<SnapshotInfo>,
    /// Why the VM stopped, if it did.
    pub stop_reason: Option<StopReason>,
    /// Bytes of guest memory a write set covers, for the write-set
    /// requests.
    pub write_set_bytes: Option<u64>,
    /// Microseconds the request took inside the VMM.
    pub duration_us: u64,
}

/// The requests every VMM answers, as calls: what the core uses.
pub trait LauncherExt: Launcher {
    /// Sends `request`; a refusal is an error.
    fn request<'a>(
        &'a self,
        hostname: &'a str,
        request: VmmRequest,
    ) -> BoxFuture<'a, Result<Done, LaunchError>> {
        Box::pin(async move {
            match self.control(hostname, &request).await? {
                VmmResponse::Error { error } => Err(LaunchError::Refused {
                    hostname: hostname.to_owned(),
                    request: request.name().into(),
                    error,
                }),
                VmmResponse::Ok {
                    state,
                    snapshot,
                    stop_reason,
                    write_set_bytes,
                    duration_us,
                } => Ok(Done {
                    state,
                    snapshot,
                    stop_reason,
                    write_set_bytes,
                    duration_us,
                }),
            }
        })
    }

    /// Parks the vCPUs.
    fn pause<'a>(&'a self, hostname: &'a str) -> BoxFuture<'a, Result<(), LaunchError>> {
        Box::pin(async move { self.request(hostname, VmmRequest::Pause).await.map(drop) })
    }

    /// Runs them again.
    fn resume<'a>(&'a self, hostname: &'a str) -> BoxFuture<'a, Result<(), LaunchError>> {
        Box::pin(async move {
            self.request(hostname, VmmRequest::Resume { vsock_uds: None })
                .await
                .map(drop)
        })
    }

    /// Snapshots a paused VM into `state` and `memory`.
    fn snapshot<'a>(
        &'a self,
        hostname: &'a str,
        state: PathBuf,
        memory: PathBuf,
    ) -> BoxFuture<'a, Result<Option<SnapshotInfo>, LaunchError>> {
        Box::pin(async move {
            let request = VmmRequest::Snapshot {
                state_path: state,
                mem_path: memory,
            };
            Ok(self.request(hostname, request).await?.snapshot)
        })
    }

    /// Serves the paused VM's root disk (`drive0`) from `disk` from now
    /// on (the VMM flushes the one it leaves).
    fn switch_disk<'a>(
        &'a self,
        hostname: &'a str,
        disk: PathBuf,
    ) -> BoxFuture<'a, Result<(), LaunchError>> {
        Box::pin(async move {
            let request = VmmRequest::SwitchDisk {
                drive: ROOT_DRIVE.to_owned(),
                path: disk,
            };
            self.request(hostname, request).await.map(drop)
        })
    }

    /// Saves the pages the restored VM's guest has written since its
    /// restore to `path`, as a write set; returns the bytes they cover.
    fn save_write_set<'a>(
        &'a self,
        hostname: &'a str,
        path: PathBuf,
    ) -> BoxFuture<'a, Result<u64, LaunchError>> {
        Box::pin(async move {
            let done = self
                .request(hostname, VmmRequest::SaveWriteSet { path })
                .await?;
            Ok(done.write_set_bytes.unwrap_or(0))
        })
    }

    /// Copies the pages of the write set at `path` into the restored VM's
    /// memory (running or paused); says what became of it.
    fn copy_write_set<'a>(
        &'a self,
        hostname: &'a str,
        path: PathBuf,
    ) -> BoxFuture<'a, WriteSetCopy> {
        Box::pin(async move {
            let request = VmmRequest::PopulateWriteSet { path };
            WriteSetCopy::answered(self.control(hostname, &request).await)
        })
    }

    /// Presses Ctrl-Alt-Del.
    fn press_ctrl_alt_del<'a>(
        &'a self,
        hostname: &'a str,
    ) -> BoxFuture<'a, Result<(), LaunchError>> {
        Box::pin(async move { self.request(hostname, VmmRequest::Shutdown).await.map(drop) })
    }

    /// Stops the VM now (its VMM reports `killed` and exits).
    fn stop_now<'a>(&'a self, hostname: &'a str) -> BoxFuture<'a, Result<(), LaunchError>> {
        Box::pin(async move { self.request(hostname, VmmRequest::Kill).await.map(drop) })
    }
}

impl<L: Launcher + ?Sized> LauncherExt for L {}
