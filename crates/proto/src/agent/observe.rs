//! What the agent reports about the guest: a snapshot of its figures
//! ([`GuestStats`], the `stats` operation) and changes to its files
//! ([`WatchRequest`], the `watch` operation).
//!
//! Every field has a default, so an agent of a later minor version may add
//! figures and an older host reads the rest.

use serde::{Deserialize, Serialize};

/// CPU time of the whole guest, summed over its CPUs (`/proc/stat`'s `cpu`
/// line), in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CpuTimes {
    /// In user mode.
    pub user_ms: u64,
    /// In user mode at a low priority.
    pub nice_ms: u64,
    /// In the kernel.
    pub system_ms: u64,
    /// Idle.
    pub idle_ms: u64,
    /// Idle while I/O was outstanding.
    pub iowait_ms: u64,
    /// Serving interrupts.
    pub irq_ms: u64,
    /// Serving soft interrupts.
    pub softirq_ms: u64,
    /// Wanted to run while the host ran something else.
    pub steal_ms: u64,
}

/// Space on one file system (`statvfs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FsSpace {
    /// Its size.
    pub total_bytes: u64,
    /// Free blocks, root's reserve included.
    pub free_bytes: u64,
    /// Free blocks an unprivileged user may use.
    pub available_bytes: u64,
}

/// A snapshot of the guest's figures ([`crate::agent::Request::Stats`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GuestStats {
    /// Milliseconds since the guest booted.
    pub uptime_ms: u64,
    /// CPUs online.
    pub cpus: u32,
    /// CPU time since boot.
    pub cpu: CpuTimes,
    /// Load average over 1 minute.
    pub load_avg_1: f64,
    /// Load average over 5 minutes.
    pub load_avg_5: f64,
    /// Load average over 15 minutes.
    pub load_avg_15: f64,
    /// `MemTotal` of `/proc/meminfo`.
    pub mem_total_bytes: u64,
    /// `MemFree`.
    pub mem_free_bytes: u64,
    /// `MemAvailable`: what programs could still get without swapping.
    pub mem_available_bytes: u64,
    /// Bytes read from the guest's disks since boot (`/proc/diskstats`,
    /// whole disks only).
    pub disk_read_bytes: u64,
    /// Bytes written to them.
    pub disk_write_bytes: u64,
    /// Disk requests in flight now.
    pub disk_io_in_flight: u64,
    /// Bytes received on every interface but loopback (`/proc/net/dev`).
    pub net_rx_bytes: u64,
    /// Bytes sent on them.
    pub net_tx_bytes: u64,
    /// TCP connections in the established state, IPv4 and IPv6.
    pub tcp_established: u64,
    /// File descriptors open in the guest's processes (`/proc/PID/fd`;
    /// the kernel's `file-nr` when those cannot be read).
    pub open_files: u64,
    /// Entropy the kernel's pool holds, in bits.
    pub entropy_bits: u64,
    /// Space on the root file system.
    pub root_fs: FsSpace,
    /// Figures that could not be read (left at 0), one message each.
    pub errors: Vec<String>,
}

/// A kind of file-system change, as Slicer's watch names them (the names
/// of Go's fsnotify), plus `overflow` for events that were lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchEventKind {
    /// A file or directory appeared (created, or moved in).
    Create,
    /// A file's contents changed.
    Write,
    /// A file or directory went away.
    Remove,
    /// A file or directory was moved away (or a watched one was moved).
    Rename,
    /// Its metadata (mode, owner, times) changed.
    Chmod,
    /// Events were lost (the queue was full, the kernel's overflowed, or a
    /// new directory was past the limit); `message` says which.
    Overflow,
}

/// Watch paths for changes ([`crate::agent::Request::Watch`]). The agent
/// answers [`crate::agent::Response::Watching`] once the watches are in
/// place, then batches of events until the client closes the stream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRequest {
    /// Absolute paths, or `~` and `~/...` (the home of `uid`).
    pub paths: Vec<String>,
    /// Watch every directory below a watched one too, and those created
    /// later.
    #[serde(default)]
    pub recursive: bool,
    /// Glob patterns an event's path must match (one of them): a pattern
    /// without `/` matches the file name, one with `/` the path below the
    /// watched root. Empty: every path.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub patterns: Vec<String>,
    /// The kinds to report; empty: all of them. `overflow` is always
    /// reported.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<WatchEventKind>,
    /// Whose home `~` is (root's by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Holds events this long and reports each (kind, path) once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debounce_ms: Option<u64>,
}

/// One change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// What happened.
    pub kind: WatchEventKind,
    /// The path it happened to (empty for an overflow).
    #[serde(default)]
    pub path: String,
    /// Whether the path is a directory.
    #[serde(default)]
    pub is_dir: bool,
    /// Its size when the agent saw the event (0 when it is gone).
    #[serde(default)]
    pub size: u64,
    /// When the agent saw it, nanoseconds since the epoch (guest clock).
    #[serde(default)]
    pub unix_nanos: u64,
    /// What was lost (overflow), or a note.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}
