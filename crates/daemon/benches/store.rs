//! The state database's own costs, on the disk the project is built on
//! (`CARGO_TARGET_TMPDIR`; `TINE_BENCH_DIR` picks another): a VM's record,
//! a state change, the sync that makes changes durable against a power
//! loss (the daemon's flusher runs it every second), a deletion (synced
//! before it returns, as commits and images are), and the checkpoint of a
//! WAL grown to the size at which the daemon checkpoints when quiet
//! (requests wait for it). p50/p99 side by side.
//!
//! cargo bench -p tine-daemon --bench store   (TINE_BENCH_RUNS, default 400)

use std::path::PathBuf;
use std::time::Instant;

use tine_daemon::core::STATE_CHECKPOINT_QUIET;
use tine_daemon::db::{NewVm, Store};
use tine_proto::api::VmState;

fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (at(0.5), at(0.99))
}

/// Microseconds `f` took.
fn timed(f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let began = Instant::now();
    f()?;
    Ok(began.elapsed().as_secs_f64() * 1e6)
}

fn main() -> anyhow::Result<()> {
    let runs: usize = std::env::var("TINE_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let base = std::env::var_os("TINE_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&base)?;
    let dir = tempfile::tempdir_in(&base)?;
    let store = Store::open(&dir.path().join("tine.db"))?;
    let new = NewVm {
        host_group: "bench".into(),
        cpus: 1,
        ram_bytes: 256 << 20,
        ..NewVm::default()
    };
    let disk = |h: &str| format!("/bench/{h}/disk.qcow2");
    let (mut insert, mut change, mut sync, mut delete) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        let mut hostname = String::new();
        insert.push(timed(|| {
            hostname = store.insert_vm(&new, disk)?.hostname;
            Ok(())
        })?);
        change.push(timed(|| {
            Ok(store.set_state(&hostname, VmState::Running, None)?)
        })?);
        sync.push(timed(|| Ok(store.sync()?))?);
        let doomed = store.insert_vm(&new, disk)?.hostname;
        delete.push(timed(|| Ok(store.delete_vm(&doomed)?))?);
    }
    let mut checkpoint = Vec::new();
    for _ in 0..5 {
        while store.wal_bytes() < STATE_CHECKPOINT_QUIET {
            let vm = store.insert_vm(&new, disk)?;
            store.set_state(&vm.hostname, VmState::Running, None)?;
        }
        store.sync()?;
        checkpoint.push(timed(|| {
            anyhow::ensure!(store.checkpoint(STATE_CHECKPOINT_QUIET)?, "no checkpoint");
            Ok(())
        })?);
    }
    println!(
        "state database in {}, {runs} of each ({} checkpoints of a {} MiB WAL)",
        base.display(),
        checkpoint.len(),
        STATE_CHECKPOINT_QUIET >> 20
    );
    println!("{:<34} {:>10} {:>10}", "", "p50", "p99");
    for (what, v) in [
        ("record a VM", insert),
        ("change its state", change),
        ("sync (after one change each)", sync),
        ("delete a VM (synced)", delete),
        ("checkpoint", checkpoint),
    ] {
        let (p50, p99) = stats(v);
        println!("{what:<34} {p50:>7.1} us {p99:>7.1} us");
    }
    Ok(())
}
