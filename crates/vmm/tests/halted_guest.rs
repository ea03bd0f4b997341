//! A synthetic guest in ring 0 that halts: its vCPU thread holds no host
//! CPU, and a restore of it stays halted. Alone in its test binary, so the
//! only `vcpu0` thread of the process is its own.

use std::time::{Duration, Instant};

use tine_proto::vmm::RunState;
use tine_vmm::device_manager::RestoreOverrides;
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Privilege, Vmm};
use vm_memory::{Bytes, GuestAddress};

const CODE_ADDR: u64 = 0x10_0000;
const MARK_ADDR: u64 = 0x20_0000;

/// `mov byte [MARK_ADDR], 1; loop: hlt; jmp loop`, in ring 0.
const MARK_AND_HALT: &[u8] = &[
    0xc6, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, 0x01, // mov byte [0x200000], 1
    0xf4, // hlt
    0xeb, 0xfd, // jmp hlt
];

fn mark(vmm: &Vmm) -> u8 {
    vmm.ram()
        .mem
        .read_obj(GuestAddress(MARK_ADDR))
        .expect("the mark is inside guest RAM")
}

/// CPU time (user + system, in clock ticks) of this process's `vcpu0`
/// thread; fails when there is none.
fn vcpu_ticks() -> u64 {
    let tasks = std::fs::read_dir("/proc/self/task").expect("our threads");
    let ticks: Vec<u64> = tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "vcpu0")
        })
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            let rest = &stat[stat.rfind(')')? + 1..];
            let fields: Vec<&str> = rest.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .collect();
    assert_eq!(ticks.len(), 1, "one vcpu0 thread");
    ticks[0]
}

#[test]
fn test_synthetic_kernel_mode_guest_halts_without_a_host_cpu_and_restores_halted() {
    let mut config = BootConfig::raw_image(MARK_AND_HALT, CODE_ADDR, 32);
    if let Some(raw) = config.raw.as_mut() {
        raw.privilege = Privilege::Kernel;
    }
    let mut vmm = Vmm::boot(&config, &ConsoleConfig::default()).expect("boot a ring-0 guest");
    let began = Instant::now();
    while mark(&vmm) != 1 {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "the guest never ran"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Halted: a second of wall time costs its vCPU thread (next to) none.
    let before = vcpu_ticks();
    std::thread::sleep(Duration::from_secs(1));
    let spent = vcpu_ticks() - before;
    assert!(
        spent < 20,
        "a halted vCPU spent {spent} ticks of CPU in 1 s"
    );
    assert_eq!(vmm.run_state(), RunState::Running);
    assert!(vmm.stop_signal().reason().is_none(), "it did not stop");

    let dir = tempfile::tempdir().expect("tmp");
    let (state, memory) = (dir.path().join("s"), dir.path().join("m"));
    vmm.pause().expect("pause");
    vmm.snapshot(&state, &memory).expect("snapshot");
    vmm.kill();
    let mut child = Vmm::restore(
        &state,
        &memory,
        None,
        &ConsoleConfig::default(),
        &RestoreOverrides::default(),
        false,
    )
    .expect("restore");
    assert_eq!(mark(&child), 1, "the mark came with the memory");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        child.stop_signal().reason().is_none(),
        "the restored guest still halts"
    );
    child.kill();
}
