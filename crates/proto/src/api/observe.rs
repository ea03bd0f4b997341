//! What the API reports about running VMs: stats (`GET /nodes/stats`,
//! `GET /node/{hostname}/stats`, Slicer's `SlicerNodeStat`) and file
//! changes (`GET /vm/{hostname}/fs/watch`, Slicer's watch events).

use serde::{Deserialize, Serialize};

use super::{rfc3339_millis, StorageInfo, UnknownValue};

/// One VM's stats: Slicer's `SlicerNodeStat`, plus `host` (tine's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStat {
    /// The VM.
    pub hostname: String,
    /// Its address (empty without a network).
    pub ip: String,
    /// When it was created (RFC 3339).
    pub created_at: String,
    /// What its guest reports; `null` with `error` set when the VM does
    /// not run or its agent did not answer.
    pub snapshot: Option<VmSnapshot>,
    /// Why there is no snapshot (empty when there is one).
    pub error: String,
    /// What the host measures of the VM (tine's, beyond Slicer's).
    pub host: VmHostStats,
}

/// The guest's figures: Slicer's `SlicerSnapshot` (camelCase), plus
/// tine's CPU times and free memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VmSnapshot {
    /// The VM.
    pub hostname: String,
    /// `amd64` or `arm64`.
    pub arch: String,
    /// When the figures were taken (RFC 3339).
    pub timestamp: String,
    /// Time since the guest booted, as Go prints a duration (`1h2m3s`).
    pub uptime: String,
    /// CPUs online in the guest.
    pub total_cpus: u32,
    /// Guest memory, bytes.
    pub total_memory: u64,
    /// In use: total less available.
    pub memory_used: u64,
    /// Available to programs without swapping.
    pub memory_available: u64,
    /// `memoryUsed` as a percentage of `totalMemory`.
    pub memory_used_percent: f64,
    /// Load average, 1 minute.
    pub load_avg1: f64,
    /// Load average, 5 minutes.
    pub load_avg5: f64,
    /// Load average, 15 minutes.
    pub load_avg15: f64,
    /// Bytes read from the guest's disks since boot.
    pub disk_read_total: f64,
    /// Bytes written to them.
    pub disk_write_total: f64,
    /// Bytes received by the guest since boot (loopback left out).
    pub network_read_total: f64,
    /// Bytes sent.
    pub network_write_total: f64,
    /// Disk requests in flight.
    #[serde(rename = "diskIOInflight")]
    pub disk_io_inflight: u64,
    /// Established TCP connections.
    pub open_connections: u64,
    /// File descriptors open in the guest's processes.
    pub open_files: u64,
    /// Bits in the guest kernel's entropy pool.
    pub entropy: u64,
    /// Size of the root file system.
    pub disk_space_total: u64,
    /// Used on it.
    pub disk_space_used: u64,
    /// Free on it for unprivileged users.
    pub disk_space_free: u64,
    /// `diskSpaceUsed` of used plus free, as a percentage (as `df` does).
    pub disk_space_used_percent: f64,
    /// Milliseconds since the guest booted (tine).
    pub uptime_ms: u64,
    /// Memory not used at all (tine).
    pub memory_free: u64,
    /// CPU time in user mode since boot, all CPUs (tine).
    pub cpu_user_ms: u64,
    /// In the kernel (tine).
    pub cpu_system_ms: u64,
    /// Idle (tine).
    pub cpu_idle_ms: u64,
    /// Idle with I/O outstanding (tine).
    pub cpu_iowait_ms: u64,
    /// Wanted to run while the host ran something else (tine).
    pub cpu_steal_ms: u64,
}

/// What the host measures of one VM: its `tine-vmm` process, its disk
/// file, its TAP device. A figure that cannot be read is `null`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmHostStats {
    /// The VMM process, while the VM runs.
    pub vmm_pid: Option<u32>,
    /// CPU time of the VMM process (all threads: the vCPUs' guest time
    /// included) in user mode, ms.
    pub cpu_user_ms: Option<u64>,
    /// In the host kernel, ms.
    pub cpu_system_ms: Option<u64>,
    /// Resident memory of the VMM process (`Rss` of `smaps_rollup`).
    pub rss_bytes: Option<u64>,
    /// Its proportional share: pages shared with other forks count a part
    /// each (`Pss`).
    pub pss_bytes: Option<u64>,
    /// Its unique memory: pages no other process maps (private clean and
    /// dirty), what stopping it would free.
    pub uss_bytes: Option<u64>,
    /// Swapped out.
    pub swap_bytes: Option<u64>,
    /// The disk file.
    pub disk: StorageInfo,
    /// The TAP device's counters, when the VM has a network.
    pub net: Option<TapCounters>,
}

impl VmHostStats {
    /// Only the disk known: a VM that does not run.
    pub fn disk_only(disk: StorageInfo) -> Self {
        Self {
            vmm_pid: None,
            cpu_user_ms: None,
            cpu_system_ms: None,
            rss_bytes: None,
            pss_bytes: None,
            uss_bytes: None,
            swap_bytes: None,
            disk,
            net: None,
        }
    }
}

/// A TAP device's counters (`/sys/class/net/TAP/statistics`), from the
/// host's side: `rx` is what the guest sent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapCounters {
    /// The device.
    pub tap: String,
    /// Bytes the host received from the guest.
    pub rx_bytes: u64,
    /// Bytes the host sent to the guest.
    pub tx_bytes: u64,
    /// Packets received from the guest.
    pub rx_packets: u64,
    /// Packets sent to the guest.
    pub tx_packets: u64,
    /// Packets from the guest dropped.
    pub rx_dropped: u64,
    /// Packets to the guest dropped.
    pub tx_dropped: u64,
}

wire_enum! {
    /// A kind of file change (`events=` of `/fs/watch`, `type` of its
    /// events), with `overflow` for events that were lost.
    FsEventType, "event type" {
        /// A file or directory appeared.
        Create = "create",
        /// A file's contents changed.
        Write = "write",
        /// A file or directory went away.
        Remove = "remove",
        /// A file or directory was moved away.
        Rename = "rename",
        /// Its mode, owner or times changed.
        Chmod = "chmod",
        /// Events were lost; `message` says how.
        Overflow = "overflow",
    }
}

/// One event of `GET /vm/{hostname}/fs/watch` (the `data:` of an SSE
/// message): Slicer's `SlicerFSWatchEvent`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsWatchEvent {
    /// Its number in the stream (also its SSE `id:`), from 1 or from
    /// `Last-Event-ID` + 1.
    pub id: u64,
    /// What happened.
    #[serde(rename = "type")]
    pub kind: FsEventType,
    /// The path in the guest (empty for an overflow).
    pub path: String,
    /// When the agent saw it (RFC 3339 with nanoseconds).
    pub timestamp: String,
    /// The file's size then (0 once gone).
    pub size: u64,
    /// Whether the path is a directory.
    #[serde(rename = "isDir")]
    pub is_dir: bool,
    /// What was lost (overflow).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// `unix_nanos` as RFC 3339 with nanoseconds (`2026-01-02T03:04:05.123456789Z`).
pub fn rfc3339_nanos(unix_nanos: u64) -> String {
    let millis = rfc3339_millis(unix_nanos / 1_000_000);
    let seconds = millis.split('.').next().unwrap_or_default();
    format!("{seconds}.{:09}Z", unix_nanos % 1_000_000_000)
}

/// A duration as Go's `time.Duration.String` prints it, to the second
/// (`0s`, `42s`, `5m0s`, `26h3m7s`).
pub fn go_duration_secs(secs: u64) -> String {
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m{s}s"),
        _ => format!("{h}h{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_print_as_go_reads_them() {
        assert_eq!(rfc3339_nanos(0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(
            rfc3339_nanos(1_767_323_045_123_456_789),
            "2026-01-02T03:04:05.123456789Z"
        );
        assert_eq!(go_duration_secs(0), "0s");
        assert_eq!(go_duration_secs(42), "42s");
        assert_eq!(go_duration_secs(300), "5m0s");
        assert_eq!(go_duration_secs(26 * 3600 + 187), "26h3m7s");
    }

    #[test]
    fn snapshot_fields_are_slicers_names() {
        let s = VmSnapshot {
            hostname: "h".into(),
            arch: "amd64".into(),
            timestamp: String::new(),
            uptime: String::new(),
            total_cpus: 1,
            total_memory: 0,
            memory_used: 0,
            memory_available: 0,
            memory_used_percent: 0.0,
            load_avg1: 0.0,
            load_avg5: 0.0,
            load_avg15: 0.0,
            disk_read_total: 0.0,
            disk_write_total: 0.0,
            network_read_total: 0.0,
            network_write_total: 0.0,
            disk_io_inflight: 0,
            open_connections: 0,
            open_files: 0,
            entropy: 0,
            disk_space_total: 0,
            disk_space_used: 0,
            disk_space_free: 0,
            disk_space_used_percent: 0.0,
            uptime_ms: 0,
            memory_free: 0,
            cpu_user_ms: 0,
            cpu_system_ms: 0,
            cpu_idle_ms: 0,
            cpu_iowait_ms: 0,
            cpu_steal_ms: 0,
        };
        let v = serde_json::to_value(&s).expect("json");
        for key in [
            "totalCpus",
            "loadAvg1",
            "loadAvg15",
            "diskIOInflight",
            "memoryUsedPercent",
            "diskSpaceUsedPercent",
            "networkWriteTotal",
        ] {
            assert!(v.get(key).is_some(), "{key} missing: {v}");
        }
    }
}
