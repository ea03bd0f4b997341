//! `GET /nodes/stats` and `GET /node/{hostname}/stats`: Slicer's
//! `[]SlicerNodeStat`. The guest's figures come from its agent (`stats`);
//! the host adds what it measures of the VM (its VMM process's CPU time
//! and memory, its disk file, its TAP counters). A VM that does not run,
//! is paused, or whose agent does not answer in time gets `error` and no
//! snapshot; the request itself succeeds.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::Json;
use futures_util::StreamExt;
use tine_proto::agent::GuestStats;
use tine_proto::api::{
    self, go_duration_secs, ListQuery, NodeStat, VmHostStats, VmSnapshot, VmState,
};

use super::agent_call::DEADLINES;
use super::params::AppState;
use crate::db::VmRecord;
use crate::error::ApiResult;
use crate::host_stats;

/// How long one VM's agent has to answer, connecting included; past it
/// the VM's stat says so (one hung guest does not hold up the others).
const AGENT_DEADLINE: Duration = Duration::from_secs(3);

/// VMs asked at once by `GET /nodes/stats`.
const AT_ONCE: usize = 16;

/// Where the host's network devices are.
const SYS_CLASS_NET: &str = "/sys/class/net";

pub(super) async fn all(State(d): State<AppState>) -> ApiResult<Json<Vec<NodeStat>>> {
    let mut vms = Vec::new();
    for info in d.list(None, &ListQuery::default())? {
        vms.push(d.vm(&info.hostname)?);
    }
    let stats = futures_util::stream::iter(vms)
        .map(|vm| node_stat(&d, vm))
        .buffered(AT_ONCE)
        .collect()
        .await;
    Ok(Json(stats))
}

pub(super) async fn one(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
) -> ApiResult<Json<Vec<NodeStat>>> {
    let vm = d.vm(&hostname)?;
    Ok(Json(vec![node_stat(&d, vm).await]))
}

/// One VM's stat; never an error (what fails is in `error` or `null`).
async fn node_stat(d: &AppState, vm: VmRecord) -> NodeStat {
    let info = d.describe(&vm);
    let host = host_figures(&vm, info.disk.clone()).await;
    let (snapshot, error) = match guest_figures(d, &vm).await {
        Ok(g) => (Some(snapshot(&vm.hostname, &g)), String::new()),
        Err(why) => (None, why),
    };
    NodeStat {
        hostname: vm.hostname,
        ip: info.ip.unwrap_or_default(),
        created_at: info.created_at,
        snapshot,
        error,
        host,
    }
}

/// The guest's figures, or why there are none.
async fn guest_figures(d: &AppState, vm: &VmRecord) -> Result<GuestStats, String> {
    if vm.state != VmState::Running {
        return Err(format!("{} is {}", vm.hostname, vm.state));
    }
    if d.is_paused(vm) {
        return Err(format!(
            "{} is paused: its agent answers once it is resumed",
            vm.hostname
        ));
    }
    let ask = async {
        let (_vm, client) = d.agent(&vm.hostname).await.map_err(|e| e.to_string())?;
        client
            .with_limits(DEADLINES.limits())
            .stats()
            .await
            .map_err(|e| match e.code() {
                Some(tine_proto::agent::ErrorCode::UnknownOperation) => format!(
                    "the agent of {} is too old for stats (rebuild its image): {e}",
                    vm.hostname
                ),
                _ => format!("the agent of {}: {e}", vm.hostname),
            })
    };
    tokio::time::timeout(AGENT_DEADLINE, ask)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "the agent of {} did not answer within {}s",
                vm.hostname,
                AGENT_DEADLINE.as_secs()
            ))
        })
}

/// What the host measures: the VMM process while it runs, the disk file
/// always, the TAP while the VM has one.
async fn host_figures(vm: &VmRecord, disk: api::StorageInfo) -> VmHostStats {
    let mut host = VmHostStats::disk_only(disk);
    if !vm.state.is_live() {
        return host;
    }
    let process = vm.pid.zip(vm.pid_start);
    let tap = vm.network.as_ref().map(|n| n.tap.clone());
    let read = tokio::task::spawn_blocking(move || {
        let figures = process.map(|(pid, start)| host_stats::process(pid, start));
        let net =
            tap.and_then(|t| host_stats::tap_counters(std::path::Path::new(SYS_CLASS_NET), &t));
        (figures, net)
    })
    .await;
    let Ok((figures, net)) = read else {
        return host;
    };
    host.net = net;
    if let (Some((pid, _)), Some((cpu, memory))) = (process, figures) {
        if cpu.is_some() || memory.is_some() {
            host.vmm_pid = Some(pid);
        }
        host.cpu_user_ms = cpu.map(|c| c.user_ms);
        host.cpu_system_ms = cpu.map(|c| c.system_ms);
        host.rss_bytes = memory.map(|m| m.rss);
        host.pss_bytes = memory.map(|m| m.pss);
        host.uss_bytes = memory.map(|m| m.uss);
        host.swap_bytes = memory.map(|m| m.swap);
    }
    host
}

fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        (part as f64 * 100.0 / whole as f64).clamp(0.0, 100.0)
    }
}

/// Slicer's snapshot from the agent's figures. The guest may send
/// anything: the figures derived here never underflow, divide by zero or
/// leave 0..=100.
pub fn snapshot(hostname: &str, g: &GuestStats) -> VmSnapshot {
    let available = g.mem_available_bytes.min(g.mem_total_bytes);
    let used = g.mem_total_bytes - available;
    let fs = g.root_fs;
    let disk_used = fs.total_bytes.saturating_sub(fs.free_bytes);
    let disk_free = fs.available_bytes.min(fs.total_bytes);
    let load = |l: f64| if l.is_finite() { l.max(0.0) } else { 0.0 };
    VmSnapshot {
        hostname: hostname.to_owned(),
        arch: api::go_arch().to_owned(),
        timestamp: api::rfc3339_millis(crate::db::now_ms()),
        uptime: go_duration_secs(g.uptime_ms / 1000),
        total_cpus: g.cpus,
        total_memory: g.mem_total_bytes,
        memory_used: used,
        memory_available: available,
        memory_used_percent: percent(used, g.mem_total_bytes),
        load_avg1: load(g.load_avg_1),
        load_avg5: load(g.load_avg_5),
        load_avg15: load(g.load_avg_15),
        disk_read_total: g.disk_read_bytes as f64,
        disk_write_total: g.disk_write_bytes as f64,
        network_read_total: g.net_rx_bytes as f64,
        network_write_total: g.net_tx_bytes as f64,
        disk_io_inflight: g.disk_io_in_flight,
        open_connections: g.tcp_established,
        open_files: g.open_files,
        entropy: g.entropy_bits,
        disk_space_total: fs.total_bytes,
        disk_space_used: disk_used,
        disk_space_free: disk_free,
        disk_space_used_percent: percent(disk_used, disk_used.saturating_add(disk_free)),
        uptime_ms: g.uptime_ms,
        memory_free: g.mem_free_bytes.min(g.mem_total_bytes),
        cpu_user_ms: g.cpu.user_ms,
        cpu_system_ms: g.cpu.system_ms,
        cpu_idle_ms: g.cpu.idle_ms,
        cpu_iowait_ms: g.cpu.iowait_ms,
        cpu_steal_ms: g.cpu.steal_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tine_proto::agent::FsSpace;

    #[test]
    fn a_snapshot_from_hostile_figures_stays_sane() {
        let g = GuestStats {
            mem_total_bytes: 100,
            mem_available_bytes: u64::MAX,
            mem_free_bytes: 500,
            root_fs: FsSpace {
                total_bytes: 10,
                free_bytes: 50,
                available_bytes: u64::MAX,
            },
            load_avg_1: -3.0,
            uptime_ms: 3_723_000,
            ..GuestStats::default()
        };
        let s = snapshot("dev-1", &g);
        assert_eq!((s.memory_used, s.memory_available), (0, 100));
        assert_eq!(s.memory_used_percent, 0.0);
        assert_eq!(s.memory_free, 100);
        assert_eq!((s.disk_space_used, s.disk_space_free), (0, 10));
        assert_eq!(s.disk_space_used_percent, 0.0);
        assert_eq!(s.load_avg1, 0.0);
        assert_eq!(s.uptime, "1h2m3s");
        let empty = snapshot("dev-1", &GuestStats::default());
        assert_eq!(
            (empty.memory_used_percent, empty.disk_space_used_percent),
            (0.0, 0.0)
        );
    }

    #[test]
    fn a_snapshot_computes_slicers_percentages() {
        let g = GuestStats {
            mem_total_bytes: 1000,
            mem_available_bytes: 250,
            root_fs: FsSpace {
                total_bytes: 1000,
                free_bytes: 300,
                available_bytes: 200,
            },
            ..GuestStats::default()
        };
        let s = snapshot("dev-1", &g);
        assert_eq!((s.memory_used, s.memory_used_percent), (750, 75.0));
        // As df: used / (used + available to users).
        assert_eq!((s.disk_space_used, s.disk_space_free), (700, 200));
        assert!((s.disk_space_used_percent - 700.0 * 100.0 / 900.0).abs() < 1e-9);
    }
}
