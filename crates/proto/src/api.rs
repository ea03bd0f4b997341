//! REST bodies between the daemon (`tine up`) and its clients (the CLI, SDKs).
//!
//! Resource shapes follow Slicer's where they fit (docs/api.md,
//! docs/openapi.yaml): host groups and their nodes, `/vm/{hostname}`,
//! NDJSON exec frames, errors as `{error, code}`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The body of every error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, naming the problem (for people).
    pub error: String,
    /// A stable machine-readable code (for scripts).
    pub code: ErrorCode,
}

/// Stable error codes; each maps to one HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed or asks for something invalid (400).
    BadRequest,
    /// Missing or wrong bearer token (401).
    Unauthorized,
    /// No such host group, VM, commit or route (404).
    NotFound,
    /// The resource is in a state that forbids the request (409).
    Conflict,
    /// A wait ran past its timeout (408).
    Timeout,
    /// The guest agent cannot be reached (503).
    AgentUnavailable,
    /// The daemon failed (500).
    Internal,
}

impl ErrorCode {
    /// The HTTP status this code is sent with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::Timeout => 408,
            ErrorCode::AgentUnavailable => 503,
            ErrorCode::Internal => 500,
        }
    }
}

/// `GET /healthz`: the daemon answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthResponse {
    /// Always `ok`.
    pub status: HealthStatus,
}

/// What `GET /healthz` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthStatus {
    /// The daemon serves requests.
    Ok,
}

/// `POST /daemon/shutdown`: the daemon exits once this is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonShutdownResponse {
    /// Always `shutting down`.
    pub status: DaemonShutdownStatus,
}

/// What `POST /daemon/shutdown` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DaemonShutdownStatus {
    /// The daemon stops after this answer; its VMs run on.
    #[serde(rename = "shutting down")]
    ShuttingDown,
}

/// `DELETE /vm/{hostname}/fs/remove`: what was removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsRemoveResponse {
    /// The guest path removed.
    pub path: String,
    /// Always true (a path that could not be removed is an error).
    pub removed: bool,
}

/// `GET /info`: the daemon itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonInfo {
    /// The daemon's version.
    pub version: String,
    /// The commit it was built from (`unknown` outside a git checkout).
    pub git_commit: String,
    /// The host's operating system, as Go names it (`linux`).
    pub platform: String,
    /// The host's architecture, as Go names it (`amd64`, `arm64`).
    pub arch: String,
    /// Its data directory.
    pub data_dir: String,
    /// Its process id.
    pub pid: u32,
    /// When it started (RFC 3339).
    pub started_at: String,
    /// Host group names.
    pub host_groups: Vec<String>,
    /// VMs recorded, in any state.
    pub vms: usize,
}

/// `GET /hostgroup`: one host group as configured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostGroupInfo {
    /// Name; VMs are named `NAME-1`, `NAME-2`, ...
    pub name: String,
    /// VMs the daemon keeps running (0: API only).
    pub count: u32,
    /// Default vCPUs per VM.
    pub cpus: u32,
    /// Most vCPUs a VM may ask for.
    pub max_cpus: u32,
    /// Default RAM per VM in bytes.
    pub ram_bytes: u64,
    /// Most RAM a VM may ask for, in bytes.
    pub max_ram_bytes: u64,
    /// Root filesystem image.
    pub image: String,
    /// Virtual disk size per VM in bytes.
    pub storage_bytes: u64,
    /// Whether VMs keep their disk when they stop, by default.
    pub persistent: bool,
    /// Network mode: `none`, `bridge` or `isolated`.
    pub network: String,
    /// VMs of this group that exist now.
    pub nodes: usize,
    /// Guest architecture, as Go names it (`amd64`, `arm64`).
    pub arch: String,
    /// GPUs per VM: always 0 (tine has no device passthrough).
    pub gpu_count: u32,
    /// tine-vmm processes kept started ahead for hot forks of this group's
    /// memory commits, per shape of those commits.
    #[serde(default)]
    pub hot_fork_pool: u32,
}

/// How a VM's last run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopMode {
    /// tine shut it down gracefully: the guest stopped its processes,
    /// synced its file systems, made `/` read-only and powered off.
    Graceful,
    /// tine stopped it without the guest's help (`action=poweroff`, or the
    /// kill after the shutdown timeout): writes the guest had not synced may
    /// be lost.
    Forced,
    /// The guest powered off or rebooted by itself.
    Guest,
    /// The guest or its VMM crashed, or the process was killed from outside.
    Crashed,
}

impl StopMode {
    /// The lower-case name used on the wire and in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            StopMode::Graceful => "graceful",
            StopMode::Forced => "forced",
            StopMode::Guest => "guest",
            StopMode::Crashed => "crashed",
        }
    }

    /// Parses [`StopMode::as_str`]'s output.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "graceful" => StopMode::Graceful,
            "forced" => StopMode::Forced,
            "guest" => StopMode::Guest,
            "crashed" => StopMode::Crashed,
            _ => return None,
        })
    }
}

impl std::fmt::Display for StopMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A VM's life-cycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// Recorded; disk and process being prepared.
    Creating,
    /// Its tine-vmm process runs; the agent has not answered yet.
    Starting,
    /// Running and its agent answered.
    Running,
    /// Asked to stop; waiting for the guest.
    Stopping,
    /// Stopped; a persistent VM keeps its disk and can be relaunched.
    Stopped,
    /// Its VMM or guest failed; `failure` says why.
    Failed,
    /// Being suspended: its vCPUs are parked and its state and memory are
    /// being written to its folder; its process still runs.
    Suspending,
    /// Suspended: state, memory and disk are in its folder and no process
    /// runs; `restore` resumes it with its memory, `relaunch` boots it
    /// from its disk instead.
    Suspended,
}

impl VmState {
    /// The lower-case name used on the wire and in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Creating => "creating",
            VmState::Starting => "starting",
            VmState::Running => "running",
            VmState::Stopping => "stopping",
            VmState::Stopped => "stopped",
            VmState::Failed => "failed",
            VmState::Suspending => "suspending",
            VmState::Suspended => "suspended",
        }
    }

    /// Parses [`VmState::as_str`]'s output.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "creating" => VmState::Creating,
            "starting" => VmState::Starting,
            "running" => VmState::Running,
            "stopping" => VmState::Stopping,
            "stopped" => VmState::Stopped,
            "failed" => VmState::Failed,
            "suspending" => VmState::Suspending,
            "suspended" => VmState::Suspended,
            _ => return None,
        })
    }

    /// Whether a tine-vmm process belongs to the VM in this state.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            VmState::Starting | VmState::Running | VmState::Stopping | VmState::Suspending
        )
    }
}

impl std::fmt::Display for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Per-VM network policy override (isolated mode), at create, at fork and
/// as the body of `PUT /vm/{hostname}/network` (a live change). Entries are
/// `CIDR`, `IP`, `IP:port` or `CIDR:port`. A list left out inherits the host
/// group's; an empty list clears it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    /// Destinations allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<String>>,
    /// Destinations dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop: Option<Vec<String>>,
}

/// `POST /hostgroup/{group}/nodes`: create a VM. Omitted fields take the
/// group's defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVmRequest {
    /// vCPUs (at most the group's maximum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    /// RAM in bytes (at most the group's maximum).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_bytes: Option<u64>,
    /// Keep the disk when the VM stops (default: the group's setting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent: Option<bool>,
    /// A script run once at first boot (replaces the group's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userdata: Option<String>,
    /// Tags, `key=value` or bare words.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// A friendly name, unique among VMs; the CLI accepts it in place of
    /// the hostname (stored as the tag `name=NAME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Network policy override (isolated mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
    /// Slicer's GPUs per VM: only 0 (tine has no device passthrough).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_count: Option<u32>,
    /// Slicer's per-VM image: refused (a VM boots its host group's image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_image: Option<String>,
    /// A GitHub user whose public SSH keys the daemon fetches at create
    /// (`https://github.com/USER.keys`, or the daemon's `import_keys_url`)
    /// and installs with `ssh_keys`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub import_user: Option<String>,
    /// Public SSH keys (`authorized_keys` lines) the agent installs at first
    /// boot for root and for the image's login user (uid 1000), if any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_keys: Vec<String>,
    /// Slicer's fixed address: refused (tine allocates each VM's address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    /// Names of host secrets (`/secrets`) granted to the VM: synced into
    /// the guest's `/run/tine/secrets` at every boot.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
}

/// The network of a VM as describe shows it, never null: the mode (`none`
/// for a VM without a NIC), the host group's allow/drop lists, the VM's own
/// override, the lists in force and where they came from, and the
/// addresses once the VM has a NIC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmNetworkInfo {
    /// How the VM is attached.
    pub mode: NetworkMode,
    /// Whether the lists in force are the group's or the VM's override.
    pub policy_source: PolicySource,
    /// The host group's lists.
    pub host_group: EgressPolicy,
    /// The VM's override (fields left out inherit the group's); null
    /// when it has none.
    #[serde(rename = "override", default)]
    pub overrides: Option<NetworkPolicy>,
    /// The lists in force.
    pub effective: EgressPolicy,
    /// Host TAP device, once attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap: Option<String>,
    /// Guest MAC address, once attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Guest IPv4 address with prefix (`a.b.c.d/n`), once attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Gateway (the host side), once attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// Name servers handed to the guest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<String>,
}

impl VmNetworkInfo {
    /// The network of a VM without a NIC: mode `none`, nothing leaves it.
    pub fn no_device() -> Self {
        let empty = |default| EgressPolicy {
            allow: Vec::new(),
            drop: Vec::new(),
            default,
        };
        Self {
            mode: NetworkMode::None,
            policy_source: PolicySource::HostGroup,
            host_group: empty(DefaultAction::Allow),
            overrides: None,
            effective: empty(DefaultAction::Deny),
            tap: None,
            mac: None,
            address: None,
            gateway: None,
            dns: Vec::new(),
        }
    }
}

/// One allow/drop egress policy: allow entries match first, then drop
/// entries, then `default` decides the rest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressPolicy {
    /// Destinations let through (`CIDR`, `IP`, `IP:port`, `CIDR:port`).
    pub allow: Vec<String>,
    /// Destinations dropped (same forms).
    pub drop: Vec<String>,
    /// What happens to traffic no entry matches.
    pub default: DefaultAction,
}

/// An optional string that is `""` on the wire when absent (Slicer's
/// `ip` is always a string).
pub mod empty_is_none {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `None` as `""`.
    pub fn serialize<S: Serializer>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.as_deref().unwrap_or(""))
    }

    /// Reads `""` or `null` as `None`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        Ok(Option::<String>::deserialize(d)?.filter(|v| !v.is_empty()))
    }
}

/// `GET /vm/{hostname}`: one VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmInfo {
    /// Hostname, `GROUP-N`.
    pub hostname: String,
    /// Host group (`hostgroup`, as Slicer spells it).
    #[serde(rename = "hostgroup")]
    pub host_group: String,
    /// Slicer's coarse status: `Running` or `Stopped`.
    pub status: VmStatus,
    /// tine's life-cycle state (finer than `status`).
    pub state: VmState,
    /// vCPUs.
    pub cpus: u32,
    /// RAM in bytes.
    pub ram_bytes: u64,
    /// Whether its disk outlives a stop.
    pub persistent: bool,
    /// Tags.
    pub tags: Vec<String>,
    /// Names of the secrets granted to it (never their values).
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Guest IPv4 address; `""` without a network.
    #[serde(default, with = "empty_is_none")]
    pub ip: Option<String>,
    /// Guest architecture, as Go names it (`amd64`).
    pub arch: String,
    /// The host group's root filesystem image.
    pub image: String,
    /// Network mode, policy and addresses (mode `none` without a NIC).
    pub network: VmNetworkInfo,
    /// The tine-vmm process id while it runs.
    #[serde(default)]
    pub pid: Option<u32>,
    /// Why it stopped or failed, when it did.
    #[serde(default)]
    pub reason: Option<String>,
    /// How its last run ended, once it has stopped: `graceful` (synced),
    /// `forced` (unsynced writes may be lost), `guest` or `crashed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_mode: Option<StopMode>,
    /// Created (RFC 3339).
    pub created_at: String,
    /// Last (re)started (RFC 3339).
    #[serde(default)]
    pub started_at: Option<String>,
    /// Milliseconds from process start to agent ready, for the last boot.
    #[serde(default)]
    pub boot_ms: Option<u64>,
    /// The commit this VM's disk was committed as, if any.
    #[serde(default)]
    pub commit_id: Option<String>,
    /// The commit this VM was forked from, if any.
    #[serde(default)]
    pub parent_commit_id: Option<String>,
    /// The storage backend: `image` (a disk file per VM).
    pub storage: StorageKind,
    /// The disk file and its format.
    pub disk: StorageInfo,
    /// What its VMM process holds in memory, and the guest pages it has
    /// copied (tine's, not Slicer's): only in `GET /vm/{hostname}` of a
    /// live VM whose process could be read; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<VmMemoryInfo>,
}

/// A live VM's memory as the host sees it (`/proc/PID/smaps_rollup` and
/// `/proc/PID/smaps` of its tine-vmm process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmMemoryInfo {
    /// Resident bytes of the process.
    pub rss_bytes: u64,
    /// Proportional share: each resident page divided by the number of
    /// processes that map it (pages of a memory commit shared by its hot
    /// forks count a fraction each).
    pub pss_bytes: u64,
    /// Unique set: the process's private pages, what stopping it frees.
    pub uss_bytes: u64,
    /// Guest pages (4 KiB) copied on write since the VM was restored from
    /// a snapshot (a hot fork, a restore after suspend): its own copies of
    /// the memory file's pages. `null` for a VM booted from scratch, whose
    /// RAM is its own from the start (all of it in `uss_bytes`).
    #[serde(default)]
    pub guest_pages_copied: Option<u64>,
}

/// Size of a guest page as `guest_pages_copied` counts them.
pub const GUEST_PAGE_BYTES: u64 = 4096;

/// A VM's disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StorageInfo {
    /// Path on the host.
    pub path: String,
    /// `qcow2` or `raw`.
    pub format: String,
    /// Virtual size in bytes.
    pub size_bytes: u64,
    /// Bytes allocated on the host.
    pub allocated_bytes: u64,
}

/// `POST /hostgroup/{group}/nodes` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateVmResponse {
    /// The new VM's hostname.
    pub hostname: String,
    /// Its host group.
    #[serde(rename = "hostgroup")]
    pub host_group: String,
    /// Its state when the response was sent.
    pub state: VmState,
    /// Guest IPv4 address; `""` without a network (or before it started).
    #[serde(default, with = "empty_is_none")]
    pub ip: Option<String>,
    /// Created (RFC 3339).
    pub created_at: String,
    /// Guest architecture, as Go names it (`amd64`).
    pub arch: String,
    /// Milliseconds from the request to the answer.
    pub elapsed_ms: u64,
}

/// `PATCH /vm/{hostname}/tags`: either `add`/`remove`, or `replace`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TagsPatch {
    /// Tags to add.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub add: Vec<String>,
    /// Tags to remove (a bare `key` removes every `key=...`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
    /// The new complete set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace: Option<Vec<String>>,
}

/// `GET|PATCH /vm/{hostname}/tags` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagsResponse {
    /// The VM.
    pub hostname: String,
    /// Its tags now.
    pub tags: Vec<String>,
}

/// `GET /vm/{hostname}/health`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmHealth {
    /// The VM.
    pub hostname: String,
    /// Whether the agent answered.
    pub agent_ready: bool,
    /// The agent's version.
    pub agent_version: String,
    /// Nanoseconds since the agent started (a Go `time.Duration`).
    pub agent_uptime: u64,
    /// Nanoseconds since the guest booted (a Go `time.Duration`).
    pub system_uptime: u64,
    /// Milliseconds since the agent started.
    pub agent_uptime_ms: u64,
    /// Milliseconds since the guest booted.
    pub system_uptime_ms: u64,
    /// Whether userdata has run (or there is none).
    pub userdata_ran: bool,
    /// Milliseconds the request took (a round trip to the agent).
    pub rtt_ms: f64,
}

/// One NDJSON line of `POST /vm/{hostname}/exec`, in Slicer's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecFrame {
    /// The process started.
    Started {
        /// Its pid in the guest.
        pid: u32,
    },
    /// Bytes on its stdout.
    Stdout {
        /// The bytes: UTF-8 text, or base64 with `encoding: base64`.
        data: String,
        /// How `data` is encoded (`stdio=` of the request).
        encoding: StdioEncoding,
    },
    /// Bytes on its stderr.
    Stderr {
        /// The bytes: UTF-8 text, or base64 with `encoding: base64`.
        data: String,
        /// How `data` is encoded (`stdio=` of the request).
        encoding: StdioEncoding,
    },
    /// It ended.
    Exit {
        /// Its exit code; 128+N when signal N killed it (so it is never 0
        /// for a killed process).
        exit_code: i32,
        /// The signal that killed it (`SIGKILL`), if one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal: Option<String>,
        /// That signal's number.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal_number: Option<i32>,
        /// Whether its timeout killed it.
        #[serde(default)]
        timed_out: bool,
        /// Milliseconds from start to exit.
        #[serde(default)]
        duration_ms: u64,
    },
    /// The exec failed (never started, or the agent went away).
    Error {
        /// What went wrong.
        error: String,
        /// Code, as in [`ErrorBody`].
        code: ErrorCode,
    },
}

/// `POST /vm/{hostname}/exec?buffered=true`: the whole run in one answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResult {
    /// Everything written to stdout (encoded as `encoding` says).
    pub stdout: String,
    /// Everything written to stderr (encoded as `encoding` says).
    pub stderr: String,
    /// How `stdout` and `stderr` are encoded.
    pub encoding: StdioEncoding,
    /// Its pid in the guest.
    pub pid: u32,
    /// Its exit code; 128+N when signal N killed it.
    pub exit_code: i32,
    /// The signal that killed it (`SIGKILL`), if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// That signal's number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal_number: Option<i32>,
    /// Whether its timeout killed it.
    #[serde(default)]
    pub timed_out: bool,
    /// Milliseconds from start to exit.
    #[serde(default)]
    pub duration_ms: u64,
    /// Whether output past [`MAX_BUFFERED_OUTPUT`] per stream was dropped.
    #[serde(default)]
    pub truncated: bool,
}

/// One path in the guest, as `GET /vm/{hostname}/fs/stat` and `fs/readdir`
/// show it (Slicer's `SlicerFSInfo`, plus owner and link target).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEntry {
    /// The file name (`readdir`) or the last part of the path (`stat`).
    pub name: String,
    /// What it is.
    #[serde(rename = "type")]
    pub kind: FsKind,
    /// Size in bytes.
    pub size: u64,
    /// Modification time (RFC 3339).
    pub mtime: String,
    /// Permission bits in octal (`0644`).
    pub mode: String,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// Where a symlink points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
}

/// `POST /vm/{hostname}/fs/mkdir` body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsMkdirRequest {
    /// Absolute path.
    pub path: String,
    /// Create missing parents, and succeed when it exists (`mkdir -p`).
    #[serde(default)]
    pub recursive: bool,
    /// Permission bits in octal (`0755`); the agent's default without.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Owner user id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Owner group id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

/// `POST /vm/{hostname}/exec?background=true`: a detached process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgExecResponse {
    /// Its id for `/vm/{hostname}/exec/{id}/...` (a decimal string).
    pub exec_id: String,
    /// Its pid in the guest.
    pub pid: u32,
    /// When it started (RFC 3339).
    pub started_at: String,
    /// Bytes kept per stream (the oldest go first).
    pub ring_bytes: u64,
}

/// `GET /vm/{hostname}/exec[/{id}]`: one background exec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgExecInfo {
    /// Its id.
    pub exec_id: String,
    /// Its pid in the guest.
    pub pid: u32,
    /// What runs, for display.
    pub command: String,
    /// When it started (RFC 3339).
    pub started_at: String,
    /// Whether it still runs.
    pub running: bool,
    /// Its exit code once it ended (128+N for signal N).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that killed it, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// Bytes it wrote, stdout and stderr together.
    pub bytes_written: u64,
    /// Of those, bytes the rings no longer hold.
    pub bytes_dropped: u64,
    /// Bytes kept per stream.
    pub ring_bytes: u64,
    /// Stdout bytes written (where a later read of new stdout starts).
    pub stdout_bytes: u64,
    /// Stderr bytes written.
    pub stderr_bytes: u64,
    /// The id the next log frame will get (`from_id` to read only what
    /// comes after now); 0 from an agent that numbers no frames.
    pub next_id: u64,
}

/// `POST /vm/{hostname}/exec/{id}/kill` body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BgKillRequest {
    /// Signal name (`TERM`, `SIGTERM`, `KILL`, `HUP`...); default `TERM`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// Milliseconds before `SIGKILL` follows if it still runs (default
    /// 5000; 0 never escalates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_ms: Option<u64>,
}

/// `POST /vm/{hostname}/exec/{id}/kill` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgKillResponse {
    /// Its id.
    pub exec_id: String,
    /// Its pid.
    pub pid: u32,
    /// Whether it still runs after the signal (and the grace).
    pub running: bool,
    /// The signal sent first (`SIGTERM`).
    pub signal_sent: String,
}

/// `GET /vm/{hostname}/exec/{id}/wait-exit` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgWaitResponse {
    /// Its id.
    pub exec_id: String,
    /// Whether it still runs (the wait timed out).
    pub running: bool,
    /// Its exit code once it ended (128+N for signal N).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that killed it, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// Whether `timeout` passed before it ended.
    pub timed_out: bool,
}

/// `DELETE /vm/{hostname}/exec/{id}` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgDeleteResponse {
    /// Its id.
    pub exec_id: String,
    /// Always true: its rings are freed.
    pub reaped: bool,
}

/// One NDJSON line of `GET /vm/{hostname}/exec/{id}/logs`. Each chunk of
/// output, and the exit, is a frame with an id the agent gives it (from 1,
/// the same in every answer), so `from_id=` resumes after the last seen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BgLogFrame {
    /// Frames from `from_id` on that the rings no longer hold; the first
    /// line when there are any.
    Gap {
        /// The first frame missing (`from_id`).
        id: u64,
        /// How many are missing.
        dropped_frames: u64,
        /// Which ones.
        message: String,
    },
    /// Stdout bytes, base64.
    Stdout {
        /// The frame's id.
        id: u64,
        /// The bytes, base64.
        data: String,
        /// Always `base64`.
        encoding: StdioEncoding,
    },
    /// Stderr bytes, base64.
    Stderr {
        /// The frame's id.
        id: u64,
        /// The bytes, base64.
        data: String,
        /// Always `base64`.
        encoding: StdioEncoding,
    },
    /// The end of what the rings hold (still running), with what was lost.
    End {
        /// The next frame's id: `from_id=` to resume.
        id: u64,
        /// Requested bytes the rings had already dropped.
        dropped_bytes: u64,
        /// Stdout offset to resume from (`stdout_from=`).
        stdout_to: u64,
        /// Stderr offset to resume from (`stderr_from=`).
        stderr_to: u64,
    },
    /// It ended; the last frame.
    Exit {
        /// The exit's frame id.
        id: u64,
        /// Its exit code (128+N for signal N).
        exit_code: i32,
        /// The signal that killed it, if one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal: Option<String>,
        /// Requested bytes the rings had already dropped.
        dropped_bytes: u64,
    },
}

/// Most bytes of each of stdout and stderr a buffered exec keeps: 16 MiB.
pub const MAX_BUFFERED_OUTPUT: usize = 16 << 20;

/// `GET /vm/{hostname}/logs` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogsResponse {
    /// The VM.
    pub hostname: String,
    /// How many lines `content` holds.
    pub lines: usize,
    /// The serial console's last lines, each ending in a newline.
    pub content: String,
}

/// `POST /vm/{hostname}/shutdown` body (optional; `action=` in the query
/// does the same).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownRequest {
    /// How to stop the VM (default `shutdown`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<ShutdownAction>,
}

/// `POST /vm/{hostname}/shutdown` response, also `delete` (a relaunch
/// answers as a create does, [`CreateVmResponse`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LifecycleResponse {
    /// The VM.
    pub hostname: String,
    /// Its state after the request.
    pub state: VmState,
    /// For a shutdown: how the VM stopped (`graceful` or `forced`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_mode: Option<StopMode>,
    /// Milliseconds the request took.
    pub elapsed_ms: u64,
    /// For a delete: what was done, for people (Slicer's `message`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// For a delete: the disk file removed with the VM (Slicer's
    /// `disk_removed`, a string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_removed: Option<String>,
}

/// `POST /vm/{hostname}/suspend` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SuspendResponse {
    /// The VM.
    pub hostname: String,
    /// `suspended`.
    pub state: VmState,
    /// Bytes of guest RAM written to the memory file (zero pages are
    /// holes).
    pub memory_bytes: u64,
    /// Milliseconds the VMM took to write the snapshot (the vCPUs were
    /// parked meanwhile).
    pub snapshot_ms: u64,
    /// Milliseconds the request took (pause, snapshot, sync, process exit).
    pub elapsed_ms: u64,
}

/// `POST /vm/{hostname}/commit` body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitRequest {
    /// Tags.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// A key unique among commits: a later run finds the commit by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<String>,
    /// What to capture (default `disk`: a stopped VM's disk; `memory`: a
    /// running VM's memory, vCPUs, devices and disk, for hot forks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<CommitMode>,
    /// A memory commit's own warm pool: tine-vmm processes kept started
    /// ahead for its forks (default: its host group's `hot_fork_pool`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_fork_pool: Option<u32>,
}

/// `PUT /vm/commits/{id}/pool` body: a memory commit's own warm pool size
/// (`DELETE` on the same path goes back to its host group's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommitPoolRequest {
    /// tine-vmm processes kept started ahead for the commit's forks
    /// (0: none).
    pub hot_fork_pool: u32,
}

/// A commit: an immutable disk that forks boot from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitInfo {
    /// `cmt-<group>-<16 hex>`.
    pub commit_id: String,
    /// Always `committed`.
    pub status: CommitStatus,
    /// What the commit holds.
    pub mode: CommitMode,
    /// The VM it was committed from (Slicer's commit answer names it
    /// `hostname`, its list `source_hostname`: both are sent).
    pub hostname: String,
    /// The VM it was committed from.
    #[serde(rename = "source_hostname")]
    pub source: String,
    /// The source's host group.
    #[serde(rename = "source_host_group")]
    pub host_group: String,
    /// The source's state now, when it still exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_status: Option<VmState>,
    /// Tags.
    pub tags: Vec<String>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Cache key, if any.
    #[serde(default)]
    pub cache_key: Option<String>,
    /// The commit the source was forked from, if any.
    #[serde(default)]
    pub parent_commit_id: Option<String>,
    /// The source's vCPUs and RAM (defaults for forks).
    pub cpus: u32,
    /// RAM in bytes.
    pub ram_bytes: u64,
    /// Disk virtual size in bytes.
    pub size_bytes: u64,
    /// Created (RFC 3339).
    pub created_at: String,
    /// Milliseconds the commit took.
    pub elapsed_ms: u64,
    /// Bytes of guest RAM a memory commit holds (zero pages are holes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Microseconds a memory commit kept its source paused (in the answer
    /// to the commit only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_us: Option<u64>,
    /// A memory commit's own warm pool size, when it has one (otherwise
    /// its host group's `hot_fork_pool` applies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hot_fork_pool: Option<u32>,
}

/// `POST /vm/commits/{id}/fork` body. Omitted fields inherit from the
/// commit's source; an empty list clears.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Tags for the fork (appended to the inherited ones, or replacing
    /// them with `tag_mode: replace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<String>>,
    /// How `tags` combine with the inherited ones (default `append`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag_mode: Option<TagMode>,
    /// Friendly name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Keep the disk when the fork stops (default true; false = `--rm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent: Option<bool>,
    /// Fix-ups applied at the fork's first agent-ready (default all; `[]`
    /// none, not even the hostname).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixups: Option<Vec<Fixup>>,
    /// Clear the inherited secret grants (the same as `secrets: []`): the
    /// fork's fix-ups delete their files from the guest.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_secrets: bool,
    /// The fork's secret grants, replacing the inherited ones (`[]`
    /// clears); left out, the fork keeps its source's grants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<Vec<String>>,
    /// vCPUs (within the group's limits); Slicer's SDKs send `vcpu`.
    #[serde(default, alias = "vcpu", skip_serializing_if = "Option::is_none")]
    pub cpus: Option<u32>,
    /// RAM in bytes (within the group's limits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_bytes: Option<u64>,
    /// Network: `none` to give the fork no NIC, or a policy override.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<ForkNetwork>,
}

/// A fork's network choice: `"none"` (no NIC) or a policy override.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "ForkNetworkWire")]
pub enum ForkNetwork {
    /// `"none"`: no NIC.
    None,
    /// A policy override.
    Policy(NetworkPolicy),
}

/// How [`ForkNetwork`] is written in JSON.
#[derive(Serialize)]
#[serde(untagged)]
enum ForkNetworkWire {
    Text(&'static str),
    Policy(NetworkPolicy),
}

impl From<ForkNetwork> for ForkNetworkWire {
    fn from(n: ForkNetwork) -> Self {
        match n {
            ForkNetwork::None => ForkNetworkWire::Text("none"),
            ForkNetwork::Policy(p) => ForkNetworkWire::Policy(p),
        }
    }
}

/// Reads `"none"` or a policy object; another string, or a policy with an
/// unknown field, is refused with a message that names the problem.
impl<'de> Deserialize<'de> for ForkNetwork {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Choice;
        impl<'de> serde::de::Visitor<'de> for Choice {
            type Value = ForkNetwork;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("`none` or a policy {allow, drop}")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ForkNetwork, E> {
                if v == "none" {
                    Ok(ForkNetwork::None)
                } else {
                    Err(E::custom(format!(
                        "network `{v}` is not `none` or a policy {{allow, drop}}"
                    )))
                }
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<ForkNetwork, A::Error> {
                NetworkPolicy::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    .map(ForkNetwork::Policy)
            }
        }
        d.deserialize_any(Choice)
    }
}

/// `POST /vm/commits/{id}/fork` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkResponse {
    /// The fork's hostname.
    pub hostname: String,
    /// The commit's source VM.
    pub source_hostname: String,
    /// The commit.
    pub commit_id: String,
    /// Always `forked`.
    pub status: ForkStatus,
    /// What the commit holds.
    pub mode: CommitMode,
    /// The fork's state.
    pub child_status: VmState,
    /// Whether the fork keeps its disk when it stops.
    pub persistent: bool,
    /// Milliseconds from request to answer.
    pub elapsed_ms: u64,
}

/// `POST /vm/{hostname}/cp` response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpResponse {
    /// Bytes of the request body the daemon received (the file, or the tar).
    pub bytes: u64,
    /// Tar mode: entries unpacked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entries: Option<u64>,
    /// Tar mode: entries refused (escapes, links).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<u64>,
}

/// `DELETE /vm/commits/{id}` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteCommitResponse {
    /// The commit.
    pub commit_id: String,
    /// Always `deleted`.
    pub status: DeleteStatus,
}

/// Frames of the shell WebSocket (`GET /vm/{hostname}/shell`), Slicer's
/// protocol: each binary message is one type byte, the payload's length
/// (u32 BE), then the payload.
pub mod shell {
    /// Terminal bytes, both ways.
    pub const DATA: u8 = 1;
    /// Client to daemon: cols (u32 BE), rows (u32 BE).
    pub const WINDOW_SIZE: u8 = 2;
    /// Client to daemon: end the session (the shell is hung up).
    pub const SHUTDOWN: u8 = 3;
    /// Either way: keep-alive, no payload; ignored.
    pub const HEARTBEAT: u8 = 4;
    /// Daemon to client: the shell ended; the payload is its exit code
    /// (i32 BE; tine's addition), then a close.
    pub const SESSION_CLOSE: u8 = 5;

    /// One frame: its type and payload.
    pub fn encode(frame_type: u8, payload: &[u8]) -> Vec<u8> {
        let mut msg = Vec::with_capacity(payload.len() + 5);
        msg.push(frame_type);
        msg.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        msg.extend_from_slice(payload);
        msg
    }

    /// A frame's type and payload; `None` when the header is short or its
    /// length does not match the message.
    pub fn decode(msg: &[u8]) -> Option<(u8, &[u8])> {
        let (&frame_type, rest) = msg.split_first()?;
        let len_bytes: [u8; 4] = rest.get(..4)?.try_into().ok()?;
        let payload = &rest[4..];
        (u32::from_be_bytes(len_bytes) as usize == payload.len()).then_some((frame_type, payload))
    }

    /// What a client's binary message asks of the shell.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Input<'a> {
        /// Bytes for the terminal.
        Data(&'a [u8]),
        /// A new window size, each side clamped to `u16::MAX`.
        Resize {
            /// Rows.
            rows: u16,
            /// Columns.
            cols: u16,
        },
        /// Hang up the shell.
        Shutdown,
        /// A heartbeat, a frame that does not parse, an unknown type or a
        /// malformed size: dropped, never fatal.
        Ignored,
    }

    /// Reads one binary message from the client.
    pub fn input(msg: &[u8]) -> Input<'_> {
        let clamp = |b: &[u8]| {
            let n = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
            u16::try_from(n).unwrap_or(u16::MAX)
        };
        match decode(msg) {
            Some((DATA, bytes)) => Input::Data(bytes),
            Some((WINDOW_SIZE, size)) if size.len() == 8 => Input::Resize {
                cols: clamp(&size[..4]),
                rows: clamp(&size[4..]),
            },
            Some((SHUTDOWN, _)) => Input::Shutdown,
            _ => Input::Ignored,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn client_messages_read_as_inputs() {
            assert_eq!(input(&encode(DATA, b"ls")), Input::Data(b"ls"));
            let mut size = 132u32.to_be_bytes().to_vec();
            size.extend_from_slice(&u32::MAX.to_be_bytes());
            assert_eq!(
                input(&encode(WINDOW_SIZE, &size)),
                Input::Resize {
                    rows: u16::MAX,
                    cols: 132
                }
            );
            assert_eq!(input(&encode(WINDOW_SIZE, &[0; 7])), Input::Ignored);
            assert_eq!(input(&encode(SHUTDOWN, b"")), Input::Shutdown);
            assert_eq!(input(&encode(HEARTBEAT, b"")), Input::Ignored);
            assert_eq!(input(&encode(9, b"x")), Input::Ignored);
            assert_eq!(input(&[DATA, 0, 0, 0, 5, b'x']), Input::Ignored);
        }

        #[test]
        fn frames_round_trip_and_bad_lengths_are_refused() {
            let f = encode(DATA, b"ls\r");
            assert_eq!(f, [1, 0, 0, 0, 3, b'l', b's', b'\r']);
            assert_eq!(decode(&f), Some((DATA, &b"ls\r"[..])));
            assert_eq!(decode(&encode(HEARTBEAT, b"")), Some((HEARTBEAT, &b""[..])));
            assert_eq!(decode(&[1, 0, 0, 0, 9, b'x']), None, "length past the end");
            assert_eq!(decode(&[1, 0, 0]), None, "short header");
            assert_eq!(decode(&[]), None);
        }
    }
}

/// Query of the VM list routes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListQuery {
    /// Only VMs with all of these exact tags (`tag=` repeated).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Only VMs with a tag starting with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag_prefix: Option<String>,
}

/// Formats a Unix time in milliseconds as RFC 3339 (UTC, millisecond
/// precision).
pub fn rfc3339_millis(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let ms = unix_ms % 1000;
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (h, m, s) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Civil-from-days (Howard Hinnant's algorithm), for years >= 1970.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if mo <= 2 { y + 1 } else { y };
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{m:02}:{s:02}.{ms:03}Z")
}

/// A host secret as `GET /secrets` lists it: metadata only, never the
/// value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretInfo {
    /// Its name (the file name in the guest).
    pub name: String,
    /// Bytes of data.
    pub size: u64,
    /// Mode of the file in the guest, four octal digits (`0600`).
    pub permissions: String,
    /// Owner of the file in the guest.
    pub uid: u32,
    /// Group of the file in the guest.
    pub gid: u32,
    /// Last changed (RFC 3339).
    pub modified_at: String,
}

/// `POST /secrets` body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSecretRequest {
    /// `[A-Za-z0-9._-]`, 1-128 characters, not starting with a dot.
    pub name: String,
    /// The value, base64-encoded (as Slicer's SDKs send it).
    pub data: String,
    /// Octal mode of the file in the guest (default `0600`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
    /// Owner in the guest (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Group in the guest (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

/// `DELETE /secrets/{name}` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteSecretResponse {
    /// The secret.
    pub name: String,
    /// Always `deleted`.
    pub status: DeleteStatus,
}

/// `PATCH /secrets/{name}` body: what is given changes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateSecretRequest {
    /// The new value, base64-encoded. Left out or `""` keeps the value
    /// (Slicer's Go SDK always sends the field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    /// New octal mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
    /// New owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// New group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_matches_known_instants() {
        assert_eq!(rfc3339_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_millis(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(
            rfc3339_millis(1_796_083_200_000),
            "2026-12-01T00:00:00.000Z"
        );
    }

    #[test]
    fn status_answers_keep_their_wire_words() {
        let health = HealthResponse {
            status: HealthStatus::Ok,
        };
        assert_eq!(
            serde_json::to_string(&health).expect("encode"),
            r#"{"status":"ok"}"#
        );
        let stopping = DaemonShutdownResponse {
            status: DaemonShutdownStatus::ShuttingDown,
        };
        assert_eq!(
            serde_json::to_string(&stopping).expect("encode"),
            r#"{"status":"shutting down"}"#
        );
        let removed = FsRemoveResponse {
            path: "/tmp/x".into(),
            removed: true,
        };
        assert_eq!(
            serde_json::to_string(&removed).expect("encode"),
            r#"{"path":"/tmp/x","removed":true}"#
        );
    }

    #[test]
    fn exec_frames_are_tagged_ndjson() {
        let f = ExecFrame::Exit {
            exit_code: 3,
            signal: None,
            signal_number: None,
            timed_out: false,
            duration_ms: 5,
        };
        let line = serde_json::to_string(&f).expect("encode");
        assert!(
            line.starts_with(r#"{"type":"exit","exit_code":3"#),
            "{line}"
        );
        let back: ExecFrame = serde_json::from_str(&line).expect("decode");
        assert_eq!(back, f);
    }

    #[test]
    fn create_request_refuses_unknown_fields() {
        let err =
            serde_json::from_str::<CreateVmRequest>(r#"{"cpu": 2}"#).expect_err("unknown field");
        assert!(err.to_string().contains("unknown field `cpu`"), "{err}");
    }

    #[test]
    fn error_codes_map_to_statuses() {
        assert_eq!(ErrorCode::NotFound.http_status(), 404);
        let body = ErrorBody {
            error: "no VM x".into(),
            code: ErrorCode::NotFound,
        };
        assert_eq!(
            serde_json::to_string(&body).expect("encode"),
            r#"{"error":"no VM x","code":"not_found"}"#
        );
    }

    #[test]
    fn vm_states_round_trip() {
        for s in [
            VmState::Creating,
            VmState::Starting,
            VmState::Running,
            VmState::Stopping,
            VmState::Stopped,
            VmState::Failed,
            VmState::Suspending,
            VmState::Suspended,
        ] {
            assert_eq!(VmState::parse(s.as_str()), Some(s));
        }
        assert_eq!(VmState::parse("bogus"), None);
    }

    #[test]
    fn fork_network_accepts_mode_or_policy() {
        let r: ForkRequest = serde_json::from_str(r#"{"network":"none"}"#).expect("mode");
        assert_eq!(r.network, Some(ForkNetwork::None));
        let back = serde_json::to_string(&r).expect("encode");
        assert_eq!(back, r#"{"network":"none"}"#);
        let err =
            serde_json::from_str::<ForkRequest>(r#"{"network":"bridge"}"#).expect_err("bad mode");
        assert!(
            err.to_string().contains("network `bridge` is not `none`"),
            "{err}"
        );
        let err =
            serde_json::from_str::<ForkRequest>(r#"{"network":{"alow":[]}}"#).expect_err("typo");
        assert!(err.to_string().contains("unknown field `alow`"), "{err}");
        let r: ForkRequest = serde_json::from_str(r#"{"network":{"allow":[]}}"#).expect("policy");
        assert_eq!(
            r.network,
            Some(ForkNetwork::Policy(NetworkPolicy {
                allow: Some(vec![]),
                drop: None
            }))
        );
    }

    #[test]
    fn closed_sets_refuse_other_values_naming_the_allowed_ones() {
        let err = serde_json::from_str::<ForkRequest>(r#"{"fixups":["hostname","mac"]}"#)
            .expect_err("bad fix-up");
        let text = err.to_string();
        assert!(text.contains("unknown variant `mac`"), "{text}");
        assert!(
            text.contains("machine-id") && text.contains("ssh-host-keys"),
            "{text}"
        );
        let err = serde_json::from_str::<ForkRequest>(r#"{"tag_mode":"merge"}"#)
            .expect_err("bad tag mode");
        assert!(
            err.to_string().contains("expected `append` or `replace`"),
            "{err}"
        );
        let err = "later".parse::<Wait>().expect_err("bad wait");
        assert_eq!(err.to_string(), "wait `later` is not one of none, agent");
        for f in Fixup::ALL {
            assert_eq!(f.as_str().parse::<Fixup>(), Ok(*f));
            let json = serde_json::to_string(f).expect("encode");
            assert_eq!(json, format!("\"{}\"", f.as_str()));
        }
        assert_eq!(Wait::default(), Wait::None);
        assert_eq!(ShutdownAction::default(), ShutdownAction::Shutdown);
    }
}

/// Defines a closed set of lower-case names: serde, `as_str`, `Display`,
/// `FromStr` (whose error names the allowed values) and `ALL`.
macro_rules! wire_enum {
    ($(#[$meta:meta])* $name:ident, $what:literal { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// Every value, in documentation order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The name used on the wire.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = UnknownValue;
            fn from_str(s: &str) -> Result<Self, UnknownValue> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownValue {
                        what: $what,
                        value: s.to_owned(),
                        allowed: &[$($text),+],
                    }),
                }
            }
        }
    };
}

/// A value outside a closed set, with the set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} `{value}` is not one of {}", allowed.join(", "))]
pub struct UnknownValue {
    /// What was being parsed (`wait`, `tag_mode`, ...).
    pub what: &'static str,
    /// The value given.
    pub value: String,
    /// The values allowed.
    pub allowed: &'static [&'static str],
}

wire_enum! {
    /// What a create, fork, relaunch or health check waits for before it
    /// answers (`wait=` in the query).
    #[derive(Default)]
    Wait, "wait" {
        /// Answer at once.
        #[default]
        None = "none",
        /// Answer once the guest agent answered and the boot's set-up is
        /// done; 408 after the timeout.
        Agent = "agent",
    }
}

wire_enum! {
    /// What a create waits for (`wait=` of `POST /hostgroup/{group}/nodes`).
    #[derive(Default)]
    CreateWait, "wait" {
        /// Answer at once.
        #[default]
        None = "none",
        /// Answer once the agent answered and the boot's set-up is done.
        Agent = "agent",
        /// Answer once, in addition, the userdata script has run (at once
        /// when there is none); 408 after the timeout.
        Userdata = "userdata",
    }
}

wire_enum! {
    /// How a fork's `tags` combine with the tags it inherits.
    #[derive(Default)]
    TagMode, "tag_mode" {
        /// Added to the inherited tags.
        #[default]
        Append = "append",
        /// Replace them.
        Replace = "replace",
    }
}

wire_enum! {
    /// A fix-up the agent applies at a fork's first agent-ready, so forks of
    /// one commit do not share identities.
    Fixup, "fix-up" {
        /// Set the hostname to the fork's.
        Hostname = "hostname",
        /// Generate a new `/etc/machine-id`.
        MachineId = "machine-id",
        /// Generate new SSH host keys.
        SshHostKeys = "ssh-host-keys",
    }
}

wire_enum! {
    /// What a commit holds.
    CommitMode, "mode" {
        /// The disk of a stopped VM: forks boot from it (cold forks).
        Disk = "disk",
        /// The memory, vCPU and device state of a running VM with its disk:
        /// forks resume its processes (hot forks).
        Memory = "memory",
    }
}

wire_enum! {
    /// A commit's status.
    CommitStatus, "status" {
        /// Made and immutable.
        Committed = "committed",
    }
}

wire_enum! {
    /// A fork answer's status.
    ForkStatus, "status" {
        /// The fork exists.
        Forked = "forked",
    }
}

wire_enum! {
    /// A deletion answer's status.
    DeleteStatus, "status" {
        /// It is gone.
        Deleted = "deleted",
    }
}

wire_enum! {
    /// How a VM with a NIC is attached to the host.
    NetworkMode, "network mode" {
        /// No network device (exec, cp, shell and forward use vsock).
        None = "none",
        /// On the group's bridge, with the host's LAN.
        Bridge = "bridge",
        /// Its own /30 behind the host, with allow/drop rules.
        Isolated = "isolated",
    }
}

wire_enum! {
    /// Where a VM's effective network policy came from.
    PolicySource, "policy source" {
        /// The host group's `allow`/`drop`.
        HostGroup = "host_group",
        /// The VM's own override.
        Override = "override",
    }
}

wire_enum! {
    /// What an egress policy does with traffic no entry matches.
    DefaultAction, "default action" {
        /// Let it through (no allow list, or both lists given).
        Allow = "allow",
        /// Drop it (only an allow list given, or no network device).
        Deny = "deny",
    }
}

wire_enum! {
    /// How `POST /vm/{hostname}/shutdown` stops a VM (`action=`).
    #[derive(Default)]
    ShutdownAction, "action" {
        /// Ask the guest to power off (agent, then Ctrl-Alt-Del), kill after
        /// the timeout.
        #[default]
        Shutdown = "shutdown",
        /// Kill at once.
        Poweroff = "poweroff",
        /// Slicer's default (its Go SDK always sends it): a guest reboot
        /// ends a microVM, so this is the graceful stop of `shutdown`.
        Reboot = "reboot",
    }
}

wire_enum! {
    /// How exec output is carried in JSON (`stdio=`).
    #[derive(Default)]
    StdioEncoding, "stdio" {
        /// UTF-8 text (Slicer's default); bytes that are not UTF-8 become
        /// U+FFFD.
        #[default]
        Text = "text",
        /// Base64 (standard alphabet, padded): any bytes.
        Base64 = "base64",
    }
}

wire_enum! {
    /// Slicer's coarse VM status, next to tine's finer [`VmState`]: the
    /// three values its SDKs know.
    VmStatus, "status" {
        /// Being created, booting, running or stopping.
        Running = "Running",
        /// Running with its vCPUs parked (`POST /vm/{hostname}/pause`), or
        /// being suspended.
        Paused = "Paused",
        /// Stopped, failed or suspended (no process runs; `state` tells
        /// them apart).
        Stopped = "Stopped",
    }
}

impl From<VmState> for VmStatus {
    fn from(s: VmState) -> Self {
        match s {
            VmState::Creating | VmState::Starting | VmState::Running | VmState::Stopping => {
                VmStatus::Running
            }
            VmState::Suspending => VmStatus::Paused,
            VmState::Stopped | VmState::Failed | VmState::Suspended => VmStatus::Stopped,
        }
    }
}

wire_enum! {
    /// Where a VM's disk lives.
    StorageKind, "storage" {
        /// A disk file per VM (qcow2 over the image, or a raw reflink copy).
        Image = "image",
    }
}

/// Go's name for this machine's architecture (`runtime.GOARCH`).
pub fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

wire_enum! {
    /// What a path in the guest is.
    FsKind, "type" {
        /// A regular file.
        File = "file",
        /// A directory.
        Directory = "directory",
        /// A symbolic link.
        Symlink = "symlink",
        /// Anything else: a device, FIFO or socket.
        Other = "other",
    }
}

// After `wire_enum!`, which it uses.
mod observe;
pub use observe::*;

// After `wire_enum!`, which it uses.
mod image;
pub use image::*;
