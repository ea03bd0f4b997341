//! Commit and fork-disk creation time against the parent's size (issue 6
//! target: independent of size, <= 20 ms). Parents are sparse 1 GiB and
//! 20 GiB qcow2 VM disks over a raw base with some data written; each
//! sample commits a fresh VM disk (hard link + read-only + new overlay) or
//! creates a fork overlay on the commit. Prints p50/p99 side by side.
//!
//! cargo bench -p tine-daemon --bench commit

use std::path::Path;
use std::time::Instant;

use tine_daemon::storage;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (percentile(&v, 0.5), percentile(&v, 0.99))
}

/// A VM disk of `size` bytes: a qcow2 overlay on a sparse raw base, with
/// 64 MiB of data written through the qcow2 writer.
fn vm_disk(dir: &Path, size: u64) -> std::path::PathBuf {
    let base = dir.join("base.raw");
    std::fs::File::create(&base)
        .and_then(|f| f.set_len(size))
        .expect("base");
    let disk = dir.join("vm.qcow2");
    storage::create_disk(&base, &disk, None).expect("vm disk");
    let mut q = tine_disk::open_disk(&disk, false).expect("open");
    let chunk = vec![0xa5u8; 1 << 20];
    for i in 0..64u64 {
        q.write_at(&chunk, i * (size / 64)).expect("write");
    }
    q.flush().expect("flush");
    disk
}

fn measure(size: u64, runs: usize) -> ((f64, f64), (f64, f64)) {
    let dir = tempfile::tempdir().expect("tmp");
    let template = vm_disk(dir.path(), size);
    let mut commits = Vec::new();
    let mut forks = Vec::new();
    for i in 0..runs {
        // Each commit needs its own uncommitted source: copy the small
        // qcow2 file (its data clusters, ~64 MiB) outside the timing.
        let src = dir.path().join(format!("src-{i}.qcow2"));
        std::fs::copy(&template, &src).expect("copy");
        // A stopped VM's disk is flushed; so is this copy, or the commit's
        // directory fsync would time the copy's write-back.
        std::fs::File::open(&src)
            .and_then(|f| f.sync_all())
            .expect("sync");
        let commit = dir.path().join(format!("c/cmt-{i}.qcow2"));
        let next = dir.path().join(format!("next-{i}.qcow2"));
        let t = Instant::now();
        storage::commit_disk(&src, &commit, &next).expect("commit");
        commits.push(t.elapsed().as_secs_f64() * 1e3);
        let fork = dir.path().join(format!("fork-{i}.qcow2"));
        let t = Instant::now();
        storage::fork_disk(&commit, &fork).expect("fork");
        forks.push(t.elapsed().as_secs_f64() * 1e3);
        for p in [&src, &next, &fork] {
            let _ = std::fs::remove_file(p);
        }
    }
    (stats(commits), stats(forks))
}

fn main() {
    let runs = std::env::var("TINE_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let (c1, f1) = measure(1 << 30, runs);
    let (c20, f20) = measure(20 << 30, runs);
    println!(
        "{:<22} {:>14} {:>14} {:>14} {:>14} {:>8}",
        "", "1 GiB p50", "1 GiB p99", "20 GiB p50", "20 GiB p99", "ratio"
    );
    println!(
        "{:<22} {:>11.3} ms {:>11.3} ms {:>11.3} ms {:>11.3} ms {:>8.2}",
        "commit",
        c1.0,
        c1.1,
        c20.0,
        c20.1,
        c20.0 / c1.0
    );
    println!(
        "{:<22} {:>11.3} ms {:>11.3} ms {:>11.3} ms {:>11.3} ms {:>8.2}",
        "fork disk",
        f1.0,
        f1.1,
        f20.0,
        f20.1,
        f20.0 / f1.0
    );
    println!("target: <= 20 ms and independent of size (ratio ~1)");
}
