//! Hot forks through the daemon's core and its real launcher, on this
//! host's KVM: a fork request in (`wait=none`) until the child's tine-vmm
//! has restored the snapshot and its vCPU runs, at 1, 10 and 50 requests at
//! once; first with every fork starting its own tine-vmm, then with a warm
//! pool of pre-started ones (the host group's `hot_fork_pool`). Prints
//! p50/p99 and their ratio; asserts nothing. Targets: p50 <= 2 ms, p99 <=
//! 5 ms.
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
use tine_proto::api::{CommitMode, CommitRequest, CreateVmRequest, ShutdownAction, Wait};
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Privilege, Vmm};

const WAIT: Duration = Duration::from_secs(60);
const RAM_MIB: u64 = 64;
const TARGET_P50_MS: f64 = 2.0;
const TARGET_P99_MS: f64 = 5.0;

fn config(image: &Path, pool: u32) -> Config {
    let mut config = Config::embedded_default();
    config.boot_concurrency = Some(64);
    config.host_groups = vec![HostGroup {
        name: "b".into(),
        image: image.display().to_string(),
        persistent: true,
        cpus: 1,
        ram_mb: RAM_MIB,
        hot_fork_pool: pool,
        ..config.host_groups[0].clone()
    }];
    config
}

fn daemon(dir: &Path, pool: u32, launcher: Arc<dyn Launcher>) -> anyhow::Result<Arc<Daemon>> {
    Ok(Daemon::from_parts(Parts::on_launcher(
        config(&dir.join("base.img"), pool),
        dir.join("data"),
        launcher,
        Deadlines::default(),
    )?))
}

/// A memory commit recorded by the daemon, its snapshot that of a
/// synthetic guest: the commit's id.
async fn synthetic_memory_commit(dir: &Path) -> anyhow::Result<String> {
    std::fs::write(dir.join("base.img"), vec![0u8; 1 << 20])?;
    let d = daemon(dir, 0, Arc::new(FakeLauncher::new()))?;
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

fn main() -> anyhow::Result<()> {
    let runs: usize = std::env::var("TINE_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let vmm = vmm_binary();
    let rt = tokio::runtime::Runtime::new()?;
    let mut rows = Vec::new();
    rt.block_on(async {
        for concurrent in [1usize, 10, 50] {
            let mut figures = Vec::new();
            for pool in [0u32, concurrent as u32] {
                let dir = tempfile::tempdir()?;
                let commit = synthetic_memory_commit(dir.path()).await?;
                let launcher = Arc::new(VmmLauncher::new(vmm.clone(), dir.path().join("data")));
                let d = daemon(dir.path(), pool, launcher)?;
                d.fill_pools().await;
                let mut ms =
                    hot_forks::timed_hot_forks(&d, &commit, concurrent, runs, 3, WAIT).await?;
                ms.sort_by(f64::total_cmp);
                figures.push((percentile(&ms, 0.5), percentile(&ms, 0.99)));
                d.drain_pools().await;
            }
            rows.push((concurrent, figures[0], figures[1]));
        }
        Ok::<(), anyhow::Error>(())
    })?;
    println!(
        "hot fork through the daemon and tine-vmm, wait=none, {RAM_MIB} MiB idle synthetic guest, ~{runs} forks per row"
    );
    println!(
        "{:<14} {:>12} {:>12} {:>12} {:>12} {:>10}",
        "at once", "p50 no pool", "p99 no pool", "p50 pool", "p99 pool", "p50 ratio"
    );
    for (concurrent, (p50, p99), (pool_p50, pool_p99)) in &rows {
        println!(
            "{concurrent:<14} {p50:>9.3} ms {p99:>9.3} ms {pool_p50:>9.3} ms {pool_p99:>9.3} ms {:>10.2}",
            pool_p50 / p50
        );
    }
    for (concurrent, _, (p50, p99)) in &rows {
        println!(
            "target, {concurrent} at once with a pool: p50 <= {TARGET_P50_MS} ms, p99 <= {TARGET_P99_MS} ms: {}",
            if *p50 <= TARGET_P50_MS && *p99 <= TARGET_P99_MS {
                "met"
            } else {
                "NOT met"
            }
        );
    }
    Ok(())
}
