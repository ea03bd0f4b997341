//! The daemon's host-side work for one fork, on the fake launcher (no KVM):
//! request in -> checked, recorded, disk made, boot queued (`wait=none`),
//! and the same to a fake agent-ready (`wait=agent`: boot slot, launch,
//! vsock handshake, fix-ups, record). p50/p99 side by side with a create
//! from the image, and hot forks of a memory commit (`wait=none`: the fake
//! VMM restored, the process recorded) at 1, 10 and 50 requests at once.
//! Targets: fork p50 <= 1 ms; hot fork p50 <= 2 ms, p99 <= 5 ms (here
//! without the VMM's own restore, which `--bench restore` of tine-vmm
//! measures).
//!
//! cargo bench -p tine-daemon --bench fork_host   (TINE_BENCH_RUNS, default 300)

#[path = "common/hot_forks.rs"]
mod hot_forks;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_daemon::config::{Config, HostGroup};
use tine_daemon::core::{Daemon, Deadlines, Parts};
use tine_daemon::launcher::fake::FakeLauncher;
use tine_proto::api::{
    CommitMode, CommitRequest, CreateVmRequest, ForkRequest, ShutdownAction, Wait,
};

const WAIT: Duration = Duration::from_secs(30);

fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (at(0.5), at(0.99))
}

fn daemon(dir: &std::path::Path) -> anyhow::Result<Arc<Daemon>> {
    let image = dir.join("base.img");
    std::fs::write(&image, vec![0u8; 1 << 20])?;
    let mut config = Config::embedded_default();
    config.host_groups = vec![HostGroup {
        name: "b".into(),
        image: image.display().to_string(),
        persistent: true,
        ram_mb: 256,
        ..config.host_groups[0].clone()
    }];
    Ok(Daemon::from_parts(Parts::on_launcher(
        config,
        dir.join("data"),
        Arc::new(FakeLauncher::new()),
        Deadlines::default(),
    )?))
}

fn main() -> anyhow::Result<()> {
    let runs: usize = std::env::var("TINE_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let dir = tempfile::tempdir()?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let d = daemon(dir.path())?;
        let builder = d
            .create_vm("b", CreateVmRequest::default(), Wait::Agent, WAIT, false)
            .await?
            .hostname;
        d.shutdown(&builder, ShutdownAction::Shutdown, WAIT).await?;
        let commit = d
            .commit(&builder, CommitRequest::default())
            .await?
            .commit_id;
        let mut figures = Vec::new();
        let mut hot_cpu = Vec::new();
        for (what, wait) in [
            ("fork, wait=none", Wait::None),
            ("fork, wait=agent", Wait::Agent),
        ] {
            let mut ms = Vec::new();
            for _ in 0..runs {
                let t = Instant::now();
                let f = d.fork(&commit, ForkRequest::default(), wait, WAIT).await?;
                ms.push(t.elapsed().as_secs_f64() * 1e3);
                d.delete(&f.hostname).await?;
            }
            figures.push((what, stats(ms)));
        }
        // Hot forks of a memory commit of a running VM: `wait=none`
        // answers once the (fake) VMM restored the snapshot and the
        // process is recorded; N requests at once.
        let source = d
            .create_vm("b", CreateVmRequest::default(), Wait::Agent, WAIT, false)
            .await?
            .hostname;
        let hot = d
            .commit(
                &source,
                CommitRequest {
                    mode: Some(CommitMode::Memory),
                    ..CommitRequest::default()
                },
            )
            .await?;
        for (what, concurrent) in [
            ("hot fork, 1 at once", 1usize),
            ("hot fork, 10 at once", 10),
            ("hot fork, 50 at once", 50),
        ] {
            let times =
                hot_forks::timed_hot_forks(&d, &hot.commit_id, concurrent, runs, 5, WAIT).await?;
            figures.push((what, stats(times.ms)));
            hot_cpu.push((what, times.cpu_ms_per_fork));
        }
        let mut ms = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            let vm = d
                .create_vm("b", CreateVmRequest::default(), Wait::None, WAIT, false)
                .await?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            d.delete(&vm.hostname).await?;
        }
        figures.push(("create, wait=none", stats(ms)));
        // Its parts, alone.
        let commit_disk =
            PathBuf::from(&d.commits(&tine_daemon::db::CommitFilter::default())?[0].disk);
        let mut verify = Vec::new();
        let mut disk = Vec::new();
        for i in 0..runs {
            let t = Instant::now();
            tine_daemon::storage::verify_commit(&commit_disk)?;
            verify.push(t.elapsed().as_secs_f64() * 1e3);
            let dest = dir.path().join(format!("part-{i}.qcow2"));
            let t = Instant::now();
            tine_daemon::storage::fork_disk(&commit_disk, &dest)?;
            disk.push(t.elapsed().as_secs_f64() * 1e3);
            std::fs::remove_file(&dest)?;
        }
        figures.push(("  verify commit", stats(verify)));
        figures.push(("  make fork disk", stats(disk)));
        let base = figures[0].1 .0;
        println!("host-side work on the fake launcher, {runs} runs each");
        println!(
            "{:<22} {:>9} {:>9} {:>9}",
            "", "p50 ms", "p99 ms", "p50/fork"
        );
        for (what, (p50, p99)) in &figures {
            println!("{what:<22} {p50:>9.3} {p99:>9.3} {:>9.2}", p50 / base);
        }
        for (what, cpu) in &hot_cpu {
            println!("{what}: {cpu:.3} ms of the daemon's CPU per fork");
        }
        println!(
            "target: fork (wait=none) p50 <= 1 ms: {}",
            if base <= 1.0 { "met" } else { "NOT met" }
        );
        for (what, (p50, p99)) in figures.iter().filter(|(w, _)| w.starts_with("hot")) {
            println!(
                "target: {what} p50 <= 2 ms, p99 <= 5 ms: {}",
                if *p50 <= 2.0 && *p99 <= 5.0 {
                    "met"
                } else {
                    "NOT met"
                }
            );
        }
        Ok::<(), anyhow::Error>(())
    })
}
