//! What a restored guest's first touch of its memory costs, and what
//! mapping the memory file's pages ahead does to it, for a synthetic
//! ring-3 guest on this host's KVM. Prints p50/p99 and ratios; asserts
//! nothing.
//!
//!   cargo bench -p tine-vmm --bench first_touch [-- RUNS]
//!
//! The guest reads one word of every page of 16 MiB of its RAM (data the
//! snapshot holds), counts a pass, and starts again. Each run restores the
//! snapshot paused into a VM made beforehand (as a pool primes one), maps
//! the memory file's data ahead or not (`GuestRam::populate_data`), waits
//! 20 ms, resumes the guest, and times until it has finished one whole pass
//! after the resume: 4096 first reads of a page (the vCPU thread's wake-up
//! included). The three variants take turns, run by run:
//! - nothing ahead: each first read is a KVM fault, and the host page
//!   fault of a page of the file that this process has not mapped yet;
//! - read ahead (`MADV_POPULATE_READ`): the pages mapped read-only, shared
//!   with the file, as a primed VM could hold them for free;
//! - copied ahead (`MADV_POPULATE_WRITE`): each page the guest's own copy,
//!   which a fork would make only for pages it writes.
//!
//! A second pass over the same pages is timed too: the cost of a read once
//! KVM has mapped the page.
//!
//! Then the same for a guest that adds 1 to a word of each page (a read,
//! then a write: what a fork's set-up does to most pages it touches), with
//! nothing ahead against its write set copied ahead: the pages one earlier
//! restored run wrote, saved with `Vmm::save_write_set` and copied in with
//! `Vmm::populate_write_set`, as a hot fork's pool primes its VMs.

mod common;

use common::{percentile, restore_here};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tine_vmm::vmm::{BootConfig, ConsoleConfig, PreparedVm, Vmm};
use tine_vmm::vstate::memory::Populate;
use vm_memory::{Bytes, GuestAddress};

const COUNTER_ADDR: u64 = 0x20_0000;
const DATA_ADDR: u64 = 0x40_0000;
const DATA_BYTES: usize = 16 << 20;

/// Ring-3 code: `mov rax, 0x400000; next: mov rbx, [rax]; add rax, 0x1000;
/// cmp rax, 0x1400000; jb next; inc qword [0x200000]; jmp` to the start.
const PAGE_READER: &[u8] = &[
    0x48, 0xC7, 0xC0, 0x00, 0x00, 0x40, 0x00, // mov rax, 0x400000
    0x48, 0x8B, 0x18, // mov rbx, [rax]
    0x48, 0x05, 0x00, 0x10, 0x00, 0x00, // add rax, 0x1000
    0x48, 0x3D, 0x00, 0x00, 0x40, 0x01, // cmp rax, 0x1400000
    0x72, 0xEF, // jb next
    0x48, 0xFF, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, // inc qword [0x200000]
    0xEB, 0xDE, // jmp start
];

/// Ring-3 code: the same loop with `add qword [rax], 1` for the read.
const PAGE_WRITER: &[u8] = &[
    0x48, 0xC7, 0xC0, 0x00, 0x00, 0x40, 0x00, // mov rax, 0x400000
    0x48, 0x83, 0x00, 0x01, // add qword [rax], 1
    0x48, 0x05, 0x00, 0x10, 0x00, 0x00, // add rax, 0x1000
    0x48, 0x3D, 0x00, 0x00, 0x40, 0x01, // cmp rax, 0x1400000
    0x72, 0xEE, // jb next
    0x48, 0xFF, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, // inc qword [0x200000]
    0xEB, 0xDD, // jmp start
];

/// What is mapped ahead of the resume.
#[derive(Debug, Clone, Copy)]
enum Ahead {
    Nothing,
    /// The memory file's data, read-only or copied.
    Data(Populate),
    /// The write set saved from an earlier run.
    WriteSet,
}

fn passes(vmm: &Vmm) -> u64 {
    vmm.ram()
        .mem
        .read_obj::<u64>(GuestAddress(COUNTER_ADDR))
        .expect("the counter is in guest RAM")
}

/// Spins until the guest has counted `to` passes; the time it took, in ms.
fn until_passes(vmm: &Vmm, to: u64, since: Instant) -> f64 {
    let deadline = since + Duration::from_secs(10);
    while passes(vmm) < to {
        assert!(Instant::now() < deadline, "the restored guest did not run");
        std::hint::spin_loop();
    }
    since.elapsed().as_secs_f64() * 1e3
}

#[derive(Default)]
struct Samples {
    /// Mapping ahead, ms (before the resume: a primed VM's time).
    ahead: Vec<f64>,
    /// Resume until one whole pass after it, ms.
    first: Vec<f64>,
    /// The pass after that, ms.
    second: Vec<f64>,
}

fn p50_p99(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (percentile(v, 0.5), percentile(v, 0.99))
}

/// A snapshot of a 64 MiB guest running `code` over 16 MiB of data, in
/// `dir`; prints what it is.
fn snapshot(dir: &std::path::Path, code: &[u8], name: &str, what: &str) -> (PathBuf, PathBuf) {
    let (state, mem) = (
        dir.join(format!("{name}.state")),
        dir.join(format!("{name}.mem")),
    );
    let mut source = Vmm::boot(
        &BootConfig::raw_image(code, 0x10_0000, 64),
        &ConsoleConfig::default(),
    )
    .expect("boot the synthetic guest");
    source
        .ram()
        .mem
        .write_slice(&vec![0xA5u8; DATA_BYTES], GuestAddress(DATA_ADDR))
        .expect("fill the guest's data");
    std::thread::sleep(Duration::from_millis(100));
    source.pause().expect("pause");
    let info = source.snapshot(&state, &mem).expect("snapshot");
    let counted = passes(&source);
    source.kill();
    assert!(counted > 2, "the source guest made {counted} passes");
    println!(
        "snapshot: {} KiB of a 64 MiB synthetic guest that {what} a word of each page of 16 MiB, pass after pass",
        info.mem_bytes_written / 1024
    );
    (state, mem)
}

/// The pages one restored run of the snapshot writes in two passes, saved
/// as a write set in `dir`.
fn write_set_of(dir: &std::path::Path, state: &std::path::Path, mem: &std::path::Path) -> PathBuf {
    let path = dir.join("write-set");
    let prepared = PreparedVm::with_memory(1, 64 << 20).expect("prepare");
    let mut vmm = restore_here(state, mem, Some(prepared), true);
    let from = passes(&vmm);
    vmm.resume().expect("resume");
    until_passes(&vmm, from + 2, Instant::now());
    vmm.pause().expect("pause");
    let bytes = vmm.save_write_set(&path).expect("save the write set");
    vmm.kill();
    println!("write set of one run: {} KiB", bytes / 1024);
    path
}

/// Runs each variant `runs` times, taking turns, and prints the table.
fn measure(
    state: &std::path::Path,
    mem: &std::path::Path,
    write_set: Option<&std::path::Path>,
    variants: &[(&str, Ahead)],
    runs: usize,
    touch: &str,
) {
    let mut samples: Vec<Samples> = variants.iter().map(|_| Samples::default()).collect();
    for run in 0..runs * variants.len() {
        let which = run % variants.len();
        let prepared = PreparedVm::with_memory(1, 64 << 20).expect("prepare");
        let mut vmm = restore_here(state, mem, Some(prepared), true);
        let began = Instant::now();
        match variants[which].1 {
            Ahead::Nothing => {}
            Ahead::Data(how) => {
                vmm.ram().populate_data(how).expect("populate");
            }
            Ahead::WriteSet => {
                let path = write_set.expect("a write set for this variant");
                vmm.populate_write_set(path).expect("copy the write set in");
            }
        }
        samples[which]
            .ahead
            .push(began.elapsed().as_secs_f64() * 1e3);
        std::thread::sleep(Duration::from_millis(20));
        let from = passes(&vmm);
        let resumed = Instant::now();
        vmm.resume().expect("resume");
        // The pass under way at the snapshot ends first; the one after it
        // touches every page.
        let first = until_passes(&vmm, from + 2, resumed);
        let second = until_passes(&vmm, from + 3, resumed) - first;
        samples[which].first.push(first);
        samples[which].second.push(second);
        vmm.kill();
    }

    println!("\nfirst {touch} of 4096 pages after a resume, {runs} runs each (this host's KVM)");
    println!(
        "{:<16} {:>12} {:>12} {:>12} {:>14} {:>16}",
        "", "ahead p50", "first p50", "first p99", "second p50", "first / nothing"
    );
    let (base, _) = p50_p99(&mut samples[0].first.clone());
    for ((name, _), s) in variants.iter().zip(samples.iter_mut()) {
        let (ahead, _) = p50_p99(&mut s.ahead);
        let (first, first99) = p50_p99(&mut s.first);
        let (second, _) = p50_p99(&mut s.second);
        println!(
            "{name:<16} {ahead:>9.3} ms {first:>9.3} ms {first99:>9.3} ms {second:>11.3} ms {:>16.2}",
            first / base
        );
    }
}

fn main() {
    let runs: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(30);
    let dir = tempfile::tempdir().expect("tmp");
    let (state, mem) = snapshot(dir.path(), PAGE_READER, "reader", "reads");
    measure(
        &state,
        &mem,
        None,
        &[
            ("nothing ahead", Ahead::Nothing),
            ("read ahead", Ahead::Data(Populate::Read)),
            ("copied ahead", Ahead::Data(Populate::Write)),
        ],
        runs,
        "read",
    );

    println!();
    let (state, mem) = snapshot(dir.path(), PAGE_WRITER, "writer", "adds 1 to");
    let write_set = write_set_of(dir.path(), &state, &mem);
    measure(
        &state,
        &mem,
        Some(&write_set),
        &[
            ("nothing ahead", Ahead::Nothing),
            ("write set ahead", Ahead::WriteSet),
        ],
        runs,
        "read and write",
    );
    println!(
        "\nfirst: resume until one whole pass after it (the vCPU's wake-up included); \
         second: the pass after that; ahead: before the resume, off a fork's path"
    );
}
