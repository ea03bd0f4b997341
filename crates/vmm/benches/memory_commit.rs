//! How long a memory commit keeps its source paused, for synthetic ring-3
//! guests of 256 MiB and 1 GiB on this host's KVM. Prints p50/p99 and
//! ratios; asserts nothing.
//!
//!   cargo bench -p tine-vmm --bench memory_commit [-- RUNS]
//!
//! The source is paused from the snapshot's start until its memory file
//! and state file are written (the daemon's disk freeze, `switch_disk`
//! and database record add a few milliseconds, see
//! `cargo bench -p tine-daemon --bench commit`). What the snapshot writes
//! is the guest's non-zero pages, so the figure depends on how much of
//! RAM the guest has touched: each size is measured with 10 % and with
//! all of its pages holding data, written by the host before the first
//! snapshot. The files go to the system's temporary directory.

mod common;

use common::{percentile, COUNTER_LOOP};

use std::time::{Duration, Instant};

use tine_vmm::vmm::{BootConfig, ConsoleConfig, Vmm};
use vm_memory::{Bytes, GuestAddress};

const PAGE: u64 = 4096;
/// Guest pages from here on are free for the host to fill.
const FILL_FROM: u64 = 0x40_0000;

/// Gives every `stride`-th page of guest RAM above [`FILL_FROM`] non-zero
/// contents; returns how many pages it wrote.
fn fill(vmm: &Vmm, mem_mib: u64, stride: u64) -> u64 {
    let end = mem_mib << 20;
    let page = vec![0xa5u8; PAGE as usize];
    let mut pages = 0;
    let mut at = FILL_FROM;
    while at + PAGE <= end {
        vmm.ram()
            .mem
            .write_slice(&page, GuestAddress(at))
            .expect("fill guest RAM");
        pages += 1;
        at += PAGE * stride;
    }
    pages
}

struct Figure {
    p50_ms: f64,
    p99_ms: f64,
    written_mib: f64,
}

/// Pauses, snapshots and resumes a `mem_mib` guest `runs` times; the
/// figure is the time from the pause to the resume.
fn measure(mem_mib: u64, stride: u64, runs: usize) -> Figure {
    let dir = tempfile::tempdir().expect("temporary directory");
    let config = BootConfig::raw_image(COUNTER_LOOP, 0x10_0000, mem_mib);
    let mut vmm = Vmm::boot(&config, &ConsoleConfig::default()).expect("boot synthetic guest");
    let pages = fill(&vmm, mem_mib, stride);
    std::thread::sleep(Duration::from_millis(10));
    let mut paused_ms = Vec::with_capacity(runs);
    let mut written = 0;
    for i in 0..runs {
        let state = dir.path().join(format!("{i}.state"));
        let mem = dir.path().join(format!("{i}.mem"));
        let start = Instant::now();
        vmm.pause().expect("pause");
        let info = vmm.snapshot(&state, &mem).expect("snapshot");
        vmm.resume().expect("resume");
        paused_ms.push(start.elapsed().as_secs_f64() * 1e3);
        written = info.mem_bytes_written;
        // Only one commit's files at a time, as the disk would hold them.
        let _ = std::fs::remove_file(&state);
        let _ = std::fs::remove_file(&mem);
    }
    vmm.kill();
    paused_ms.sort_by(|a, b| a.total_cmp(b));
    let figure = Figure {
        p50_ms: percentile(&paused_ms, 0.5),
        p99_ms: percentile(&paused_ms, 0.99),
        written_mib: written as f64 / f64::from(1 << 20),
    };
    println!(
        "{mem_mib:>5} MiB guest, {:>3} % of pages with data ({pages} filled): n={runs} \
         paused p50={:>8.1} ms p99={:>8.1} ms, {:>7.1} MiB written, {:>6.0} MiB/s",
        100 / stride,
        figure.p50_ms,
        figure.p99_ms,
        figure.written_mib,
        figure.written_mib / (figure.p50_ms / 1e3),
    );
    figure
}

fn main() {
    let runs: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5);
    println!("memory commit pause (pause + snapshot + resume), synthetic guests, {runs} runs each");
    let mut by_size = Vec::new();
    for mem_mib in [256u64, 1024] {
        let sparse = measure(mem_mib, 10, runs);
        let full = measure(mem_mib, 1, runs);
        println!(
            "{mem_mib:>5} MiB guest: all pages / 10 % of pages, p50 ratio {:.2}",
            full.p50_ms / sparse.p50_ms
        );
        by_size.push(full);
    }
    if let [small, large] = by_size.as_slice() {
        println!(
            "1 GiB / 256 MiB with every page holding data: p50 ratio {:.2} (data ratio {:.2})",
            large.p50_ms / small.p50_ms,
            large.written_mib / small.written_mib
        );
        println!(
            "1 GiB guest with every page holding data: p99 {:.1} ms",
            large.p99_ms
        );
    }
}
