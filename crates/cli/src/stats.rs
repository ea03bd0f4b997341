//! `tine vm stats [VM]`: each VM's figures, the guest's and the host's, as
//! a table (or the API's answer with `--json`).

use tine_client::TineClient;
use tine_proto::api::NodeStat;

use crate::cli::{GlobalArgs, StatsArgs};
use crate::exit;
use crate::output::{self, print_json};

/// Runs `tine vm stats`.
pub async fn run(g: &GlobalArgs, c: &TineClient, args: &StatsArgs) -> anyhow::Result<i32> {
    let stats = c.stats(args.vm.as_deref()).await?;
    if g.json {
        print_json(&stats)?;
    } else if g.quiet {
        for s in &stats {
            println!("{}", s.hostname);
        }
    } else {
        print!("{}", table(&stats));
    }
    Ok(exit::OK)
}

fn used_of(used: u64, total: u64, percent: f64) -> String {
    format!(
        "{}/{} ({percent:.0}%)",
        output::size(used),
        output::size(total)
    )
}

/// The `tine vm stats` table: one row per VM; a VM without a snapshot
/// shows `-` and why.
pub fn table(stats: &[NodeStat]) -> String {
    let dash = || "-".to_string();
    let opt = |v: Option<u64>| v.map_or_else(dash, output::size);
    let rows: Vec<Vec<String>> = stats
        .iter()
        .map(|s| {
            let host = &s.host;
            let vmm_cpu = match (host.cpu_user_ms, host.cpu_system_ms) {
                (Some(u), Some(k)) => output::millis(u.saturating_add(k)),
                _ => dash(),
            };
            let net = host.net.as_ref().map_or_else(dash, |n| {
                format!("{}/{}", output::size(n.rx_bytes), output::size(n.tx_bytes))
            });
            let disk_file = output::size(host.disk.allocated_bytes);
            let mut row = match &s.snapshot {
                Some(g) => vec![
                    s.hostname.clone(),
                    g.total_cpus.to_string(),
                    format!("{:.2}", g.load_avg1),
                    used_of(g.memory_used, g.total_memory, g.memory_used_percent),
                    used_of(
                        g.disk_space_used,
                        g.disk_space_total,
                        g.disk_space_used_percent,
                    ),
                    g.uptime.clone(),
                ],
                None => vec![s.hostname.clone(), dash(), dash(), dash(), dash(), dash()],
            };
            row.extend([
                vmm_cpu,
                opt(host.rss_bytes),
                opt(host.uss_bytes),
                disk_file,
                net,
                s.error.clone(),
            ]);
            row
        })
        .collect();
    output::table(
        &[
            "HOSTNAME",
            "CPUS",
            "LOAD",
            "MEMORY",
            "ROOT FS",
            "UPTIME",
            "VMM CPU",
            "RSS",
            "USS",
            "DISK FILE",
            "TAP RX/TX",
            "ERROR",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tine_proto::api::{StorageInfo, TapCounters, VmHostStats, VmSnapshot};

    fn stat(hostname: &str, snapshot: Option<VmSnapshot>, error: &str) -> NodeStat {
        let mut host = VmHostStats::disk_only(StorageInfo {
            path: "/d".into(),
            format: "qcow2".into(),
            size_bytes: 4 << 30,
            allocated_bytes: 300 << 20,
        });
        if snapshot.is_some() {
            host.cpu_user_ms = Some(1200);
            host.cpu_system_ms = Some(300);
            host.rss_bytes = Some(200 << 20);
            host.uss_bytes = Some(50 << 20);
            host.net = Some(TapCounters {
                tap: "tt-dev-1".into(),
                rx_bytes: 1536,
                tx_bytes: 2 << 20,
                ..TapCounters::default()
            });
        }
        NodeStat {
            hostname: hostname.into(),
            ip: String::new(),
            created_at: "2026-01-01T00:00:00.000Z".into(),
            snapshot,
            error: error.into(),
            host,
        }
    }

    #[test]
    fn the_table_shows_guest_and_host_figures_and_why_some_are_missing() {
        let snap: VmSnapshot = serde_json::from_value(serde_json::json!({
            "hostname": "dev-1", "arch": "amd64", "timestamp": "", "uptime": "1h2m3s",
            "totalCpus": 2, "totalMemory": 1u64 << 30, "memoryUsed": 256u64 << 20,
            "memoryAvailable": 768u64 << 20, "memoryUsedPercent": 25.0,
            "loadAvg1": 0.5, "loadAvg5": 0.0, "loadAvg15": 0.0,
            "diskReadTotal": 0.0, "diskWriteTotal": 0.0, "networkReadTotal": 0.0,
            "networkWriteTotal": 0.0, "diskIOInflight": 0, "openConnections": 0,
            "openFiles": 1, "entropy": 256, "diskSpaceTotal": 4u64 << 30,
            "diskSpaceUsed": 1u64 << 30, "diskSpaceFree": 3u64 << 30,
            "diskSpaceUsedPercent": 25.0, "uptimeMs": 3_723_000, "memoryFree": 0,
            "cpuUserMs": 0, "cpuSystemMs": 0, "cpuIdleMs": 0, "cpuIowaitMs": 0,
            "cpuStealMs": 0
        }))
        .expect("snapshot");
        let text = table(&[
            stat("dev-1", Some(snap), ""),
            stat("dev-2", None, "dev-2 is stopped"),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("HOSTNAME   CPUS   LOAD"), "{text}");
        let row = lines[1];
        for cell in [
            "dev-1",
            "0.50",
            "256M/1G (25%)",
            "1G/4G (25%)",
            "1h2m3s",
            "1.5 s",
            "200M",
            "50M",
            "300M",
            "1.5K/2M",
        ] {
            assert!(row.contains(cell), "{cell} missing in {row}");
        }
        assert!(
            lines[2].starts_with("dev-2 ") && lines[2].ends_with("dev-2 is stopped"),
            "{text}"
        );
    }
}
