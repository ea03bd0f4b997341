//! JSON control messages.
//!
//! A stream starts with one [`Request`] from the client. After that the
//! client may send [`Control`] messages and the agent sends [`Response`]
//! messages, interleaved with raw data frames. Unknown fields are ignored so
//! that a minor version can add optional fields.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use super::observe::{CpuTimes, FsSpace, GuestStats, WatchEvent, WatchEventKind, WatchRequest};

/// A protocol version. Peers with different `major` refuse each other;
/// `minor` only adds optional fields and operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtocolVersion {
    /// Incompatible changes bump this.
    pub major: u16,
    /// Compatible additions bump this.
    pub minor: u16,
}

impl std::fmt::Display for ProtocolVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The client's first message, on stream 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The client's protocol version.
    pub version: ProtocolVersion,
    /// A free-form name for logs, e.g. `tine-client 0.1.0`.
    #[serde(default)]
    pub client: String,
}

/// The agent's answer to [`Hello`] when the versions are compatible.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The agent's protocol version.
    pub version: ProtocolVersion,
    /// The agent's build version (`CARGO_PKG_VERSION`).
    pub agent_version: String,
    /// The largest frame length the agent accepts.
    pub max_frame_len: u32,
    /// Flow-control credit each side starts with on every stream.
    pub stream_window: u32,
}

/// Why something failed. Unknown codes from a newer agent decode as
/// [`ErrorCode::Other`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The major protocol versions differ.
    VersionMismatch,
    /// The request names an operation this agent does not know.
    UnknownOperation,
    /// The request is malformed or its fields are invalid.
    BadRequest,
    /// A frame broke the framing rules (size, kind, flow control).
    Protocol,
    /// A file, directory, program or background job does not exist.
    NotFound,
    /// The operating system refused access.
    PermissionDenied,
    /// The target already exists.
    AlreadyExists,
    /// A path is not absolute, or a tar entry escapes its target directory.
    InvalidPath,
    /// A process could not be started.
    SpawnFailed,
    /// A wait ran out of time.
    Timeout,
    /// The connection's or agent's limits are reached.
    LimitExceeded,
    /// The client closed the stream or vanished before the operation ended.
    Cancelled,
    /// Any other I/O failure.
    Io,
    /// A code this version does not know.
    #[serde(other)]
    Other,
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| "other".to_owned());
        f.write_str(&s)
    }
}

/// An error the agent reports on a stream (or on stream 0 before it closes
/// the connection).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// Machine-readable reason.
    pub code: ErrorCode,
    /// Human-readable explanation.
    pub message: String,
}

/// The first message on every stream: which operation to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Run a process with pipes (or in the background).
    Exec(ExecRequest),
    /// Run a process on a new PTY.
    Shell(ShellRequest),
    /// List background execs.
    BgList,
    /// Read (and optionally follow) a background exec's output.
    BgLogs(BgLogsRequest),
    /// Wait for a background exec to exit.
    BgWait(BgWaitRequest),
    /// Send a signal to a background exec's process group.
    BgKill(BgKillRequest),
    /// Forget a finished background exec and free its buffers.
    BgRemove(BgIdRequest),
    /// Write one file from the stream's data channel.
    Upload(UploadRequest),
    /// Read one file onto the stream's data channel.
    Download(PathRequest),
    /// Unpack a tar archive from the data channel into a directory.
    UploadTar(UploadTarRequest),
    /// Pack a directory (or file) as a tar archive onto the data channel.
    DownloadTar(DownloadTarRequest),
    /// Stat one path.
    Stat(StatRequest),
    /// List a directory.
    List(PathRequest),
    /// Create a directory.
    Mkdir(MkdirRequest),
    /// Remove a file, symlink or directory.
    Remove(RemoveRequest),
    /// Connect to a TCP port or Unix socket in the guest and relay bytes.
    Forward(ForwardRequest),
    /// Agent and system health.
    Health,
    /// Make a fork unique (hostname, machine-id, SSH keys, entropy, clock).
    Fixups(FixupRequest),
    /// Whether the first-boot userdata script is present and ran.
    UserdataStatus,
    /// Install a first-boot userdata script and start it in the background,
    /// unless userdata already ran on this disk (forks never rerun it).
    UserdataRun(UserdataRunRequest),
    /// (Re)configure a network interface: address, default route, DNS.
    /// A fork restored from a snapshot gets its own address this way.
    Network(NetworkRequest),
    /// Shut the guest down cleanly: stop every process, sync, remount `/`
    /// read-only, then power off (or reboot). Answered before it begins.
    Shutdown(ShutdownRequest),
    /// Make the guest's secrets folder (`/run/tine/secrets`, a tmpfs) hold
    /// exactly these files: write each, remove every other.
    SecretsSync(SecretsSyncRequest),
    /// Add public SSH keys to `authorized_keys` of root and of the image's
    /// login user (uid 1000), if there is one.
    AuthorizedKeys(AuthorizedKeysRequest),
    /// A snapshot of the guest's figures: memory, load, CPU time, disk and
    /// network counters, open files, entropy, root file system space.
    Stats,
    /// Watch paths for changes (inotify) until the client closes the stream.
    Watch(WatchRequest),
}

impl Request {
    /// Every operation name, as it appears in the `op` field.
    pub const OPS: &'static [&'static str] = &[
        "exec",
        "shell",
        "bg_list",
        "bg_logs",
        "bg_wait",
        "bg_kill",
        "bg_remove",
        "upload",
        "download",
        "upload_tar",
        "download_tar",
        "stat",
        "list",
        "mkdir",
        "remove",
        "forward",
        "health",
        "fixups",
        "userdata_status",
        "userdata_run",
        "network",
        "shutdown",
        "secrets_sync",
        "authorized_keys",
        "stats",
        "watch",
    ];
}

/// Messages the client may send on a stream after its [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Control {
    /// Send a signal to the stream's process group (exec, shell).
    Signal {
        /// Signal number, e.g. 15 for SIGTERM.
        signal: i32,
    },
    /// Change the PTY's window size (shell).
    Resize {
        /// Rows.
        rows: u16,
        /// Columns.
        cols: u16,
    },
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// Run `argv[0]` (looked up in `PATH` when it has no `/`) with arguments.
    Argv(Vec<String>),
    /// Run a script with `interpreter -c script` (`/bin/sh` by default).
    Shell {
        /// The script.
        script: String,
        /// The shell to run it with.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        interpreter: Option<String>,
    },
}

/// Process settings shared by exec and shell.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessOptions {
    /// Variables added to (or replacing those in) the environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Start from an empty environment instead of the agent's.
    #[serde(default, skip_serializing_if = "is_false")]
    pub clear_env: bool,
    /// Working directory (absolute); the agent's own by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// User id to run as. Without `gid`, the user's group from
    /// `/etc/passwd` (or the same number) is used, and `HOME`, `USER` and
    /// `LOGNAME` are set from `/etc/passwd` when the user is listed there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Group id to run as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

/// Options for a background exec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackgroundOptions {
    /// Bytes of stdout and (separately) of stderr to keep; the oldest bytes
    /// are dropped first. Default 1 MiB, at most 64 MiB.
    #[serde(default = "default_ring_bytes")]
    pub ring_bytes: u64,
}

impl Default for BackgroundOptions {
    fn default() -> Self {
        Self {
            ring_bytes: default_ring_bytes(),
        }
    }
}

fn default_ring_bytes() -> u64 {
    1 << 20
}

/// Run a process with pipes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// What to run.
    pub command: Command,
    /// Environment, directory and identity.
    #[serde(flatten)]
    pub options: ProcessOptions,
    /// Whether the client streams stdin on the data channel. When false the
    /// process reads `/dev/null`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub stdin: bool,
    /// Kill the process group with SIGKILL after this many milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Run detached: the agent answers [`Response::BgStarted`], closes the
    /// stream and keeps the output in ring buffers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub background: Option<BackgroundOptions>,
}

impl ExecRequest {
    /// Runs `argv` directly.
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::new(Command::Argv(argv.into_iter().map(Into::into).collect()))
    }

    /// Runs `script` with `/bin/sh -c`.
    pub fn shell(script: impl Into<String>) -> Self {
        Self::new(Command::Shell {
            script: script.into(),
            interpreter: None,
        })
    }

    fn new(command: Command) -> Self {
        Self {
            command,
            options: ProcessOptions::default(),
            stdin: false,
            timeout_ms: None,
            background: None,
        }
    }

    /// Adds an environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.env.insert(key.into(), value.into());
        self
    }

    /// Sets the working directory.
    pub fn cwd(mut self, cwd: impl Into<String>) -> Self {
        self.options.cwd = Some(cwd.into());
        self
    }

    /// Runs as this user id.
    pub fn uid(mut self, uid: u32) -> Self {
        self.options.uid = Some(uid);
        self
    }

    /// Runs with this group id.
    pub fn gid(mut self, gid: u32) -> Self {
        self.options.gid = Some(gid);
        self
    }

    /// Streams stdin from the client.
    pub fn with_stdin(mut self) -> Self {
        self.stdin = true;
        self
    }

    /// Kills the process after `timeout`.
    pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
        self.timeout_ms = Some(timeout.as_millis().min(u64::MAX as u128) as u64);
        self
    }
}

/// Run a process on a new PTY. Terminal bytes travel on the data channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShellRequest {
    /// Program and arguments; the default is `$SHELL`, else `/bin/bash`
    /// when present, else `/bin/sh`, started as a login shell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// Environment, directory and identity.
    #[serde(flatten)]
    pub options: ProcessOptions,
    /// Initial rows.
    #[serde(default = "default_rows")]
    pub rows: u16,
    /// Initial columns.
    #[serde(default = "default_cols")]
    pub cols: u16,
    /// `TERM` for the process; `xterm-256color` by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub term: Option<String>,
}

impl Default for ShellRequest {
    fn default() -> Self {
        Self {
            argv: None,
            options: ProcessOptions::default(),
            rows: default_rows(),
            cols: default_cols(),
            term: None,
        }
    }
}

fn default_rows() -> u16 {
    24
}

fn default_cols() -> u16 {
    80
}

/// Names a background exec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgIdRequest {
    /// The id from [`Response::BgStarted`].
    pub id: u64,
}

/// Read a background exec's buffered output.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgLogsRequest {
    /// The id from [`Response::BgStarted`].
    pub id: u64,
    /// Start stdout at this absolute byte offset (bytes already dropped from
    /// the ring are skipped). Default: the oldest kept byte.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_from: Option<u64>,
    /// Same for stderr.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_from: Option<u64>,
    /// Start each stream at most this many bytes before its end (a tail).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail_bytes: Option<u64>,
    /// Start at the frame with this id (each chunk of output, and the
    /// exit, is a frame with an id from 1); frames the rings no longer hold
    /// are counted in [`Response::LogsStart`]'s `dropped_frames`. Not with
    /// the byte offsets or `tail_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_id: Option<u64>,
    /// Keep streaming new output until the process exits.
    #[serde(default, skip_serializing_if = "is_false")]
    pub follow: bool,
}

/// Wait for a background exec to exit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgWaitRequest {
    /// The id from [`Response::BgStarted`].
    pub id: u64,
    /// Give up with [`ErrorCode::Timeout`] after this many milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// Signal a background exec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgKillRequest {
    /// The id from [`Response::BgStarted`].
    pub id: u64,
    /// Signal number; SIGKILL (9) by default.
    #[serde(default = "default_kill_signal")]
    pub signal: i32,
}

fn default_kill_signal() -> i32 {
    9
}

/// Owner and permissions to give a written file or directory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileAttrs {
    /// Permission bits (e.g. `0o644`); files default to 0644, directories
    /// to 0755.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    /// Owner user id; the agent's by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Owner group id; the agent's by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
}

/// Write one file atomically: the data goes to a temporary file in the
/// target's directory, which is fsynced and renamed over the target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadRequest {
    /// Absolute target path.
    pub path: String,
    /// Owner and mode of the new file.
    #[serde(flatten)]
    pub attrs: FileAttrs,
    /// Create missing parent directories (mode 0755).
    #[serde(default, skip_serializing_if = "is_false")]
    pub mkdirs: bool,
    /// Expected size; a transfer of another length is refused and leaves
    /// nothing behind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
}

/// Pack a directory (or file) as a tar archive. Without `exclude` it is
/// the same on the wire as a [`PathRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DownloadTarRequest {
    /// Absolute path.
    pub path: String,
    /// Leave out what matches these patterns (Slicer's cp `exclude`): a
    /// pattern without `/` matches any entry's name, one with `/` the
    /// path below the packed directory, segment by segment (`**` is any
    /// number of segments); an excluded directory takes its contents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
}

/// Unpack a tar archive into a directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadTarRequest {
    /// Absolute target directory.
    pub path: String,
    /// Create the target directory (and parents) when missing.
    #[serde(default, skip_serializing_if = "is_false")]
    pub mkdirs: bool,
    /// Give every entry this owner instead of the archive's. Without it the
    /// archive's owners are kept when the agent runs as root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Same for the group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// Skip the entries that match these patterns (as in
    /// [`DownloadTarRequest::exclude`], on the entries' paths).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
}

/// An operation on one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathRequest {
    /// Absolute path.
    pub path: String,
}

/// Stat one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatRequest {
    /// Absolute path.
    pub path: String,
    /// Stat a symlink's target rather than the link.
    #[serde(default, skip_serializing_if = "is_false")]
    pub follow: bool,
}

/// Create a directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MkdirRequest {
    /// Absolute path.
    pub path: String,
    /// Create missing parents and succeed when it exists (`mkdir -p`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub parents: bool,
    /// Owner and mode of the new directory.
    #[serde(flatten)]
    pub attrs: FileAttrs,
}

/// Remove a path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveRequest {
    /// Absolute path.
    pub path: String,
    /// Remove a directory and everything below it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub recursive: bool,
}

/// Where a forward connects to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ForwardTarget {
    /// A TCP port, on the guest's loopback unless `host` says otherwise.
    Tcp {
        /// Port.
        port: u16,
        /// Address or name; `127.0.0.1` by default.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        host: Option<String>,
    },
    /// A Unix stream socket in the guest.
    Unix {
        /// Absolute socket path.
        path: String,
    },
}

/// Relay a byte stream to a socket in the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardRequest {
    /// Where to connect.
    pub target: ForwardTarget,
}

/// IPv4 configuration of one interface, applied by [`Request::Network`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkRequest {
    /// Interface name (`eth0` when omitted).
    #[serde(default = "default_iface")]
    pub iface: String,
    /// The interface's address.
    pub address: std::net::Ipv4Addr,
    /// Prefix length of the on-link network (0..=32).
    pub prefix: u8,
    /// Default gateway (must be on-link); none leaves no default route.
    #[serde(default)]
    pub gateway: Option<std::net::Ipv4Addr>,
    /// Name servers for /etc/resolv.conf; empty leaves the file alone.
    #[serde(default)]
    pub dns: Vec<std::net::IpAddr>,
    /// The interface's MAC address (`02:…`, six hex pairs), set first: a
    /// hot fork resumes with its source's and gets its own. Left out, the
    /// MAC stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

impl NetworkRequest {
    /// The six bytes of a MAC written as six colon-separated hex pairs.
    pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
        let mut bytes = [0u8; 6];
        let mut parts = text.split(':');
        for byte in &mut bytes {
            let part = parts.next()?;
            if part.len() != 2 {
                return None;
            }
            *byte = u8::from_str_radix(part, 16).ok()?;
        }
        parts.next().is_none().then_some(bytes)
    }
}

fn default_iface() -> String {
    "eth0".to_owned()
}

/// What [`Request::Shutdown`] ends with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShutdownAction {
    /// Stop the VM.
    #[default]
    Poweroff,
    /// Restart the guest (tine-vmm reports the reboot and stops the VM).
    Reboot,
}

/// Shuts the guest down ([`Request::Shutdown`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownRequest {
    /// Power off (the default) or reboot once the file systems are synced.
    #[serde(default)]
    pub action: ShutdownAction,
}

/// One secret as the guest gets it ([`Request::SecretsSync`]). Its `Debug`
/// shows the value's length, never the value.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretFile {
    /// File name (`[A-Za-z0-9._-]`, not starting with a dot).
    pub name: String,
    /// The value, base64.
    pub data: String,
    /// File mode (permission bits only).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
}

impl std::fmt::Debug for SecretFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretFile")
            .field("name", &self.name)
            .field(
                "data",
                &format_args!("<{} base64 characters>", self.data.len()),
            )
            .field("mode", &format_args!("{:o}", self.mode))
            .field("uid", &self.uid)
            .field("gid", &self.gid)
            .finish()
    }
}

impl SecretFile {
    /// Longest name.
    pub const MAX_NAME_LEN: usize = 128;

    /// Why `name` cannot be a secret's file name, if it cannot: the rule
    /// the daemon applies at create and the agent again before writing.
    pub fn name_problem(name: &str) -> Option<&'static str> {
        if name.is_empty() {
            Some("is empty")
        } else if name.len() > Self::MAX_NAME_LEN {
            Some("is longer than 128 characters")
        } else if name.starts_with('.') {
            Some("must not start with a dot")
        } else if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            Some("may hold only letters, digits, '.', '_' and '-'")
        } else {
            None
        }
    }
}

/// The secrets a guest holds ([`Request::SecretsSync`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretsSyncRequest {
    /// Every secret the guest may hold; an empty list removes them all.
    #[serde(default)]
    pub secrets: Vec<SecretFile>,
}

/// What [`Request::SecretsSync`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretsReport {
    /// The folder the secrets are in.
    pub dir: String,
    /// Names written.
    #[serde(default)]
    pub written: Vec<String>,
    /// Names removed (no longer granted).
    #[serde(default)]
    pub removed: Vec<String>,
}

/// Public keys to authorize ([`Request::AuthorizedKeys`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthorizedKeysRequest {
    /// `authorized_keys` lines; a key already there is not added twice.
    pub keys: Vec<String>,
}

impl AuthorizedKeysRequest {
    /// Longest key line (RSA 16384 is about 2.8 KiB).
    pub const MAX_KEY_LEN: usize = 16 * 1024;

    /// Whether `key` is one `authorized_keys` line: no control characters
    /// (so no line break), at least a type and a base64 field.
    pub fn valid_key(key: &str) -> bool {
        key.len() <= Self::MAX_KEY_LEN
            && !key.chars().any(|c| c.is_control())
            && key.split_whitespace().count() >= 2
    }
}

/// What [`Request::AuthorizedKeys`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysReport {
    /// Each user whose `authorized_keys` holds the keys now.
    #[serde(default)]
    pub users: Vec<String>,
    /// Keys newly added (over all users).
    #[serde(default)]
    pub added: u32,
}

/// Installs and starts the userdata script ([`Request::UserdataRun`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserdataRunRequest {
    /// The script (run with `/bin/sh` unless it starts with `#!`).
    pub script: String,
}

/// Fix-ups that make a forked VM unique.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FixupRequest {
    /// Set the hostname (and `/etc/hostname`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Write a new `/etc/machine-id`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub machine_id: bool,
    /// Regenerate SSH host keys when sshd is installed.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ssh_host_keys: bool,
    /// Bytes from the host to credit to the kernel CSPRNG, then reseed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<Vec<u8>>,
    /// Set the system clock to this time (nanoseconds since the epoch). On
    /// the wire a decimal string (JSON numbers lose precision above 2^53 in
    /// many clients); a plain number is accepted too.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "opt_u128_string"
    )]
    pub clock_unix_nanos: Option<u128>,
}

/// What the fix-ups did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FixupReport {
    /// The hostname now set, if it was changed.
    #[serde(default)]
    pub hostname: Option<String>,
    /// The new machine id, if one was written.
    #[serde(default)]
    pub machine_id: Option<String>,
    /// Paths of the SSH host keys written.
    #[serde(default)]
    pub ssh_host_keys: Vec<String>,
    /// Entropy bytes credited to the kernel.
    #[serde(default)]
    pub entropy_bytes: usize,
    /// Whether the kernel CSPRNG was reseeded.
    #[serde(default)]
    pub reseeded: bool,
    /// Whether the clock was set.
    #[serde(default)]
    pub clock_set: bool,
    /// Whether a saved random seed was deleted.
    #[serde(default)]
    pub random_seed_removed: bool,
    /// Fix-ups that failed, one message each.
    #[serde(default)]
    pub errors: Vec<String>,
    /// How long each step that ran took in the guest, in the order they
    /// ran (an older agent sends none).
    #[serde(default)]
    pub steps: Vec<FixupStepTime>,
}

/// A step of [`Request::Fixups`], in the order the agent runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FixupStep {
    /// `clock_settime` from the host's time.
    Clock,
    /// The host's entropy credited, the CRNG reseeded, saved seeds removed.
    Entropy,
    /// The kernel's hostname and its files.
    Hostname,
    /// A fresh `/etc/machine-id`.
    MachineId,
    /// The SSH host keys regenerated.
    SshHostKeys,
    /// What the steps wrote and removed, synced to the disk.
    Sync,
}

impl FixupStep {
    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            FixupStep::Clock => "clock",
            FixupStep::Entropy => "entropy",
            FixupStep::Hostname => "hostname",
            FixupStep::MachineId => "machine_id",
            FixupStep::SshHostKeys => "ssh_host_keys",
            FixupStep::Sync => "sync",
        }
    }
}

/// How long one fix-up step took in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FixupStepTime {
    /// The step.
    pub step: FixupStep,
    /// Its time, in microseconds.
    pub micros: u64,
}

/// Whether the first-boot userdata script exists and ran.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserdataStatus {
    /// A userdata script is installed.
    pub present: bool,
    /// It has run (in this VM or in the VM this one was forked from).
    pub ran: bool,
    /// Its exit code, when known.
    #[serde(default)]
    pub exit_code: Option<i32>,
}

/// Agent and system health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// The agent's build version.
    pub agent_version: String,
    /// The agent's protocol version.
    pub protocol: ProtocolVersion,
    /// Milliseconds since the agent started.
    pub agent_uptime_ms: u64,
    /// Milliseconds since the system booted.
    pub system_uptime_ms: u64,
    /// The userdata script's state.
    pub userdata: UserdataStatus,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// Exit code, when it exited normally.
    #[serde(default)]
    pub code: Option<i32>,
    /// Signal number, when a signal killed it.
    #[serde(default)]
    pub signal: Option<i32>,
    /// Whether the agent killed it because its timeout passed.
    #[serde(default, skip_serializing_if = "is_false")]
    pub timed_out: bool,
    /// Milliseconds from start to exit.
    #[serde(default)]
    pub duration_ms: u64,
}

impl ExitStatus {
    /// Whether it exited with code 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// File types reported by stat and list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (device, FIFO, socket).
    Other,
}

/// Metadata of one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// File type.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits, including setuid, setgid and sticky (`st_mode & 0o7777`).
    pub mode: u32,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// Modification time, seconds since the epoch.
    pub mtime_secs: i64,
    /// Sub-second part of the modification time.
    pub mtime_nanos: u32,
    /// Where a symlink points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// File name (non-UTF-8 bytes are replaced with U+FFFD).
    pub name: String,
    /// Its metadata (not following symlinks).
    pub stat: FileStat,
}

/// A background exec as listed by [`Request::BgList`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BgJob {
    /// Id.
    pub id: u64,
    /// Process id of the group leader.
    pub pid: u32,
    /// What was run, for display.
    pub command: String,
    /// Start time, milliseconds since the epoch.
    pub started_unix_ms: u64,
    /// How it ended; `None` while it runs.
    #[serde(default)]
    pub exit: Option<ExitStatus>,
    /// Total stdout bytes written so far (the end offset).
    pub stdout_bytes: u64,
    /// Total stderr bytes written so far.
    pub stderr_bytes: u64,
    /// Ring size per stream.
    pub ring_bytes: u64,
    /// The id the next frame (a chunk of output, or the exit) will get.
    #[serde(default)]
    pub next_id: u64,
}

/// Messages the agent sends on a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    /// Handshake accepted (stream 0).
    Welcome(Welcome),
    /// The operation failed; the agent closes the stream after this.
    Error(ErrorReply),
    /// The operation succeeded and returns nothing else.
    Ok,
    /// A process started (exec, shell).
    Started {
        /// Its process id, which is also its process group id.
        pid: u32,
    },
    /// A process ended; the last message of exec and shell, after both
    /// output channels' EOF.
    Exited(ExitStatus),
    /// A background exec started; the stream closes after this.
    BgStarted {
        /// Id for the `bg_*` operations.
        id: u64,
        /// Process id.
        pid: u32,
    },
    /// Answer to [`Request::BgList`].
    BgJobs {
        /// Every background exec the agent remembers.
        jobs: Vec<BgJob>,
    },
    /// Start of a [`Request::BgLogs`] answer; output frames follow.
    LogsStart {
        /// Absolute offset of the first stdout byte sent.
        stdout_from: u64,
        /// Absolute offset of the first stderr byte sent.
        stderr_from: u64,
        /// Requested bytes that had already left the rings.
        dropped: u64,
        /// Frames before `from_id`'s that had left the rings.
        #[serde(default)]
        dropped_frames: u64,
    },
    /// The id of the frame whose data follows (one data frame on stdout or
    /// stderr) in a [`Request::BgLogs`] answer.
    LogFrame {
        /// The frame's id.
        id: u64,
    },
    /// End of a [`Request::BgLogs`] answer.
    LogsEnd {
        /// Offset after the last stdout byte sent (resume from here).
        stdout_to: u64,
        /// Offset after the last stderr byte sent.
        stderr_to: u64,
        /// Requested bytes that left the rings before they could be sent
        /// (those counted in `LogsStart` included).
        #[serde(default)]
        dropped: u64,
        /// How the process ended, if it has.
        exit: Option<ExitStatus>,
        /// The id of the next frame: resume with `from_id` here (the exit's
        /// id when it has ended).
        #[serde(default)]
        next_id: u64,
    },
    /// Metadata of a file about to be downloaded; data frames follow.
    FileInfo(FileStat),
    /// An upload was committed.
    Written {
        /// Bytes written.
        bytes: u64,
    },
    /// A tar upload finished, or a tar download finished sending.
    TarDone {
        /// Entries unpacked or packed.
        entries: u64,
        /// Entries skipped (sockets, devices and the like).
        skipped: u64,
    },
    /// Answer to [`Request::Stat`].
    Stat(FileStat),
    /// A batch of [`Request::List`] entries; more batches may follow, then
    /// [`Response::Ok`].
    Entries {
        /// The batch.
        entries: Vec<DirEntry>,
    },
    /// A forward connected; data frames follow both ways.
    Connected,
    /// Answer to [`Request::Health`].
    Health(Health),
    /// Answer to [`Request::Fixups`] (boxed: the largest answer).
    Fixups(Box<FixupReport>),
    /// Answer to [`Request::UserdataStatus`].
    Userdata(UserdataStatus),
    /// Answer to [`Request::SecretsSync`].
    Secrets(SecretsReport),
    /// Answer to [`Request::AuthorizedKeys`].
    Keys(KeysReport),
    /// Answer to [`Request::Stats`] (boxed: it is the largest answer).
    Stats(Box<GuestStats>),
    /// The watches of a [`Request::Watch`] are in place; batches of
    /// [`Response::WatchEvents`] follow.
    Watching {
        /// Directories (and files) watched.
        watched: u64,
    },
    /// Changes seen by a [`Request::Watch`], oldest first.
    WatchEvents {
        /// The batch.
        events: Vec<WatchEvent>,
    },
}

impl Response {
    /// Builds an error response.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Error(ErrorReply {
            code,
            message: message.into(),
        })
    }
}

fn is_false(value: &bool) -> bool {
    !*value
}

/// `Option<u128>` as a decimal string, accepting numbers too (serde cannot
/// buffer 128-bit integers inside internally tagged enums).
mod opt_u128_string {
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<u128>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(v) => s.serialize_str(&v.to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u128>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Option<u128>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a non-negative integer or a decimal string")
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_some<D2: de::Deserializer<'de>>(
                self,
                d: D2,
            ) -> Result<Self::Value, D2::Error> {
                d.deserialize_any(V)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Some(u128::from(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                v.parse().map(Some).map_err(E::custom)
            }
        }
        d.deserialize_option(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_files_debug_form_hides_its_value() {
        let file = SecretFile {
            name: "db".into(),
            data: "c2VjcmV0LXZhbHVl".into(),
            mode: 0o640,
            uid: 0,
            gid: 7,
        };
        let shown = format!(
            "{:?}",
            Request::SecretsSync(SecretsSyncRequest {
                secrets: vec![file]
            })
        );
        assert!(!shown.contains("c2VjcmV0LXZhbHVl"), "{shown}");
        assert!(
            shown.contains("\"db\"")
                && shown.contains("<16 base64 characters>")
                && shown.contains("640"),
            "{shown}"
        );
    }

    #[test]
    fn macs_are_six_hex_pairs() {
        assert_eq!(
            NetworkRequest::parse_mac("02:74:69:6E:65:2a"),
            Some([0x02, 0x74, 0x69, 0x6e, 0x65, 0x2a])
        );
        for bad in [
            "",
            "02:74:69:6e:65",
            "02:74:69:6e:65:2a:00",
            "2:74:69:6e:65:2a",
            "02-74-69-6e-65-2a",
            "zz:74:69:6e:65:2a",
        ] {
            assert_eq!(NetworkRequest::parse_mac(bad), None, "{bad}");
        }
    }

    #[test]
    fn test_request_exec_json_shape_is_flat() {
        let req = Request::Exec(ExecRequest::argv(["ls", "-l"]).env("A", "1").cwd("/tmp"));
        let json = serde_json::to_value(&req).expect("serialize");
        assert_eq!(
            json,
            serde_json::json!({
                "op": "exec",
                "command": {"argv": ["ls", "-l"]},
                "env": {"A": "1"},
                "cwd": "/tmp"
            })
        );
        let back: Request = serde_json::from_value(json).expect("deserialize");
        assert_eq!(back, req);
    }

    #[test]
    fn test_request_ops_list_matches_enum() {
        for op in Request::OPS {
            let err = serde_json::from_value::<Request>(serde_json::json!({"op": op}))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(!err.contains("unknown variant"), "{op}: {err}");
        }
    }

    #[test]
    fn test_response_unknown_error_code_decodes_as_other() {
        let json = serde_json::json!({"type": "error", "code": "brand_new", "message": "m"});
        let resp: Response = serde_json::from_value(json).expect("deserialize");
        assert_eq!(resp, Response::error(ErrorCode::Other, "m"));
    }

    #[test]
    fn test_fixup_request_large_clock_round_trips() {
        let req = FixupRequest {
            clock_unix_nanos: Some(1_800_000_000_000_000_000_000),
            entropy: Some(vec![0, 255]),
            ..FixupRequest::default()
        };
        let text = serde_json::to_string(&Request::Fixups(req.clone())).expect("serialize");
        let back: Request = serde_json::from_str(&text).expect("deserialize");
        assert_eq!(back, Request::Fixups(req));
        let number = r#"{"op":"fixups","clock_unix_nanos":5}"#;
        let back: Request = serde_json::from_str(number).expect("deserialize");
        assert_eq!(
            back,
            Request::Fixups(FixupRequest {
                clock_unix_nanos: Some(5),
                ..FixupRequest::default()
            })
        );
    }

    #[test]
    fn test_fixup_report_step_times_on_the_wire() {
        let steps = [
            FixupStep::MachineId,
            FixupStep::SshHostKeys,
            FixupStep::Sync,
        ];
        let report = FixupReport {
            steps: steps
                .iter()
                .map(|&step| FixupStepTime { step, micros: 12 })
                .collect(),
            ..FixupReport::default()
        };
        let value =
            serde_json::to_value(Response::Fixups(Box::new(report.clone()))).expect("serialize");
        assert_eq!(
            value["steps"],
            serde_json::json!([
                {"step": "machine_id", "micros": 12},
                {"step": "ssh_host_keys", "micros": 12},
                {"step": "sync", "micros": 12}
            ])
        );
        for step in [
            FixupStep::Clock,
            FixupStep::Entropy,
            FixupStep::Hostname,
            FixupStep::MachineId,
            FixupStep::SshHostKeys,
            FixupStep::Sync,
        ] {
            assert_eq!(serde_json::json!(step), step.as_str());
        }
        let back: Response = serde_json::from_value(value).expect("deserialize");
        assert_eq!(back, Response::Fixups(Box::new(report)));
        // An agent from before the step times sends none.
        let older = r#"{"type":"fixups","entropy_bytes":64,"reseeded":true}"#;
        match serde_json::from_str::<Response>(older).expect("deserialize") {
            Response::Fixups(r) => assert!(r.steps.is_empty() && r.reseeded),
            other => panic!("decoded as {other:?}"),
        }
    }

    #[test]
    fn test_error_code_display_is_snake_case() {
        assert_eq!(ErrorCode::UnknownOperation.to_string(), "unknown_operation");
    }

    #[test]
    fn test_network_request_defaults_iface_and_round_trips() {
        let req: Request = serde_json::from_str(
            r#"{"op":"network","address":"192.0.2.7","prefix":24,"dns":["192.0.2.1"]}"#,
        )
        .expect("parse");
        let Request::Network(net) = &req else {
            panic!("not a network request: {req:?}");
        };
        assert_eq!(net.iface, "eth0");
        assert_eq!(net.prefix, 24);
        assert_eq!(net.gateway, None);
        let text = serde_json::to_string(&req).expect("serialize");
        assert_eq!(serde_json::from_str::<Request>(&text).expect("back"), req);
    }
}
