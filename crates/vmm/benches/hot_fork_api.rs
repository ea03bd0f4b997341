//! Hot forks through the daemon's core and its real launcher, on this
//! host's KVM: a fork request in (`wait=none`) until the child's tine-vmm
//! has resumed the snapshot and its vCPU runs, at 1, 10 and 50 requests at
//! once; first with every fork starting its own tine-vmm and restoring into
//! it, then with a pool (the host group's `hot_fork_pool`): VMs primed
//! ahead (the snapshot restored, paused, on a spare disk) that a fork
//! resumes, and pre-started processes for forks that find none. Then the
//! same in a group with an isolated network (needs root, `nft` and `ip`),
//! forking a commit whose source had a NIC: without a pool each fork makes
//! its TAP and nft rules on its path, with one it takes a primed VM with its
//! spare network, which its launch hands over. The synthetic guest has no
//! NIC device, so its tine-vmm opens no TAP: the rows measure the daemon's
//! part. The bench's network objects have their own nft table and TAP
//! prefix, on a link-local range; no packet is sent. Prints p50/p99 and
//! their ratio; asserts nothing. Targets: p50 <= 2 ms, p99 <= 5 ms.
//!
//!   cargo bench -p tine-vmm --bench hot_fork_api   (TINE_BENCH_RUNS, default 100)
//!
//! The memory commit is made as the daemon makes one (record, frozen disk,
//! snapshot folder) on the stand-in launcher, and its snapshot files are
//! then replaced by those of a synthetic 64 MiB guest, which is what the
//! real launcher restores: the daemon cannot boot a synthetic guest itself.
//! The guest idles with its vCPU halted (ring 0, `hlt`), as an idle Linux
//! guest does, so forks running at once do not take the host's CPUs from
//! the requests still being served.

mod common;
#[path = "../../daemon/benches/common/hot_forks.rs"]
mod hot_forks;

use common::{percentile, vmm_binary, HALT_LOOP};

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tine_daemon::config::{Config, HostGroup};
use tine_daemon::core::{Daemon, Deadlines, Parts};
use tine_daemon::launcher::fake::FakeLauncher;
use tine_daemon::launcher::vmm::VmmLauncher;
use tine_daemon::launcher::Launcher;
use tine_daemon::network::{ManagerOptions, NetMode, NetworkConfig, NetworkManager};
use tine_proto::api::{CommitMode, CommitRequest, CreateVmRequest, ShutdownAction, Wait};
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Privilege, Vmm};

const WAIT: Duration = Duration::from_secs(60);
const RAM_MIB: u64 = 64;
const TARGET_P50_MS: f64 = 2.0;
const TARGET_P99_MS: f64 = 5.0;

/// The bench's own nft table and TAP/bridge prefixes: never the daemon's.
fn bench_network() -> anyhow::Result<NetworkManager> {
    Ok(NetworkManager::new(ManagerOptions {
        table: "tine_bench".into(),
        tap_prefix: "tb-".into(),
        bridge_prefix: "tbb-".into(),
    })?)
}

/// An isolated network on a link-local range (nothing is sent).
fn isolated() -> anyhow::Result<NetworkConfig> {
    Ok(NetworkConfig {
        mode: NetMode::Isolated,
        cidr: Some("169.254.232.0/22".parse()?),
        ..NetworkConfig::default()
    })
}

fn config(image: &Path, pool: u32, network: Option<NetworkConfig>) -> Config {
    let mut config = Config::embedded_default();
    let group = config.host_groups[0].clone();
    config.host_groups = vec![HostGroup {
        name: "b".into(),
        image: image.display().to_string(),
        persistent: true,
        cpus: 1,
        ram_mb: RAM_MIB,
        hot_fork_pool: pool,
        network: network.unwrap_or(group.network.clone()),
        ..group
    }];
    config
}

fn daemon(
    dir: &Path,
    pool: u32,
    network: Option<NetworkConfig>,
    launcher: Arc<dyn Launcher>,
) -> anyhow::Result<Arc<Daemon>> {
    let with_network = network.is_some();
    let mut parts = Parts::on_launcher(
        config(&dir.join("base.img"), pool, network),
        dir.join("data"),
        launcher,
        Deadlines::default(),
    )?;
    if with_network {
        parts.network = bench_network()?;
    }
    Ok(Daemon::from_parts(parts))
}

/// A memory commit recorded by the daemon, its snapshot that of a
/// synthetic guest: the commit's id. Its source runs in a group with
/// `network` (or none), so that its forks have a NIC as it had.
async fn synthetic_memory_commit(
    dir: &Path,
    network: Option<NetworkConfig>,
) -> anyhow::Result<String> {
    std::fs::write(dir.join("base.img"), vec![0u8; 1 << 20])?;
    let d = daemon(dir, 0, network, Arc::new(FakeLauncher::new()))?;
    let source = d
        .create_vm("b", CreateVmRequest::default(), Wait::Agent, WAIT, false)
        .await?
        .hostname;
    let commit = d
        .commit(
            &source,
            CommitRequest {
                mode: Some(CommitMode::Memory),
                ..CommitRequest::default()
            },
        )
        .await?
        .commit_id;
    d.shutdown(&source, ShutdownAction::Shutdown, WAIT).await?;
    let files = d.memory_commit_files(&commit);
    let mut config = BootConfig::raw_image(HALT_LOOP, 0x10_0000, RAM_MIB);
    if let Some(raw) = config.raw.as_mut() {
        raw.privilege = Privilege::Kernel;
    }
    let mut vmm = Vmm::boot(&config, &ConsoleConfig::default())?;
    std::thread::sleep(Duration::from_millis(10));
    vmm.pause()?;
    vmm.snapshot(&files.state(), &files.memory())?;
    vmm.kill();
    Ok(commit)
}

/// p50/p99 of hot forks, `concurrent` at once, without a pool and with
/// one of `concurrent`, in a group with `network` (or none), and the
/// daemon's CPU per fork with the pool.
async fn row(
    vmm: &Path,
    concurrent: usize,
    runs: usize,
    network: Option<NetworkConfig>,
) -> anyhow::Result<Row> {
    let mut figures = Vec::new();
    let mut pool_cpu_ms = 0.0;
    for pool in [0u32, concurrent as u32] {
        let dir = tempfile::tempdir()?;
        let commit = synthetic_memory_commit(dir.path(), network.clone()).await?;
        let launcher = Arc::new(VmmLauncher::new(vmm.to_path_buf(), dir.path().join("data")));
        let d = daemon(dir.path(), pool, network.clone(), launcher)?;
        d.fill_pools().await;
        let times = hot_forks::timed_hot_forks(&d, &commit, concurrent, runs, 3, WAIT).await?;
        let mut ms = times.ms;
        ms.sort_by(f64::total_cmp);
        figures.push((percentile(&ms, 0.5), percentile(&ms, 0.99)));
        pool_cpu_ms = times.cpu_ms_per_fork;
        d.drain_pools().await;
    }
    Ok((concurrent, figures[0], figures[1], pool_cpu_ms))
}

/// At once; p50/p99 without a pool; p50/p99 with one; the daemon's CPU
/// per fork with one.
type Row = (usize, (f64, f64), (f64, f64), f64);

fn print_table(title: &str, rows: &[Row]) {
    println!("{title}");
    println!(
        "{:<14} {:>12} {:>12} {:>12} {:>12} {:>10} {:>16}",
        "at once",
        "p50 no pool",
        "p99 no pool",
        "p50 pool",
        "p99 pool",
        "p50 ratio",
        "CPU/fork, pool"
    );
    for (concurrent, (p50, p99), (pool_p50, pool_p99), cpu) in rows {
        println!(
            "{concurrent:<14} {p50:>9.3} ms {p99:>9.3} ms {pool_p50:>9.3} ms {pool_p99:>9.3} ms {:>10.2} {cpu:>13.3} ms",
            pool_p50 / p50
        );
    }
    println!(
        "CPU/fork: the daemon's (user and system, all its threads) while the forks ran; \
         the VMMs' is not counted. Forks at once share the host's cores."
    );
    for (concurrent, _, (p50, p99), _) in rows {
        println!(
            "target, {concurrent} at once with a pool: p50 <= {TARGET_P50_MS} ms, p99 <= {TARGET_P99_MS} ms: {}",
            if *p50 <= TARGET_P50_MS && *p99 <= TARGET_P99_MS {
                "met"
            } else {
                "NOT met"
            }
        );
    }
}

fn main() -> anyhow::Result<()> {
    let runs: usize = std::env::var("TINE_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let vmm = vmm_binary();
    let rt = tokio::runtime::Runtime::new()?;
    let mut plain = Vec::new();
    let mut networked = Vec::new();
    rt.block_on(async {
        for concurrent in [1usize, 10, 50] {
            plain.push(row(&vmm, concurrent, runs, None).await?);
        }
        // Whatever an interrupted run left, then the bench's own objects.
        bench_network()?.teardown()?;
        for concurrent in [1usize, 10] {
            let measured = row(&vmm, concurrent, runs, Some(isolated()?)).await;
            bench_network()?.teardown()?;
            networked.push(measured?);
        }
        Ok::<(), anyhow::Error>(())
    })?;
    print_table(
        &format!("hot fork through the daemon and tine-vmm, wait=none, {RAM_MIB} MiB idle synthetic guest, no NIC, ~{runs} forks per row"),
        &plain,
    );
    println!();
    print_table(
        "the same with an isolated network (TAP, nft rules, quarantine): without a pool made on the fork's path, with one taken from the spares",
        &networked,
    );
    Ok(())
}
