//! Synthetic guests whose work runs in ring 3, so they run at native speed
//! on any KVM (also nested PVM hosts, where guest ring 0 is emulated): exit
//! handling, pause, snapshot, restore into several VMs, copy-on-write
//! isolation.

use std::time::{Duration, Instant};

use tine_vmm::device_manager::RestoreOverrides;
use tine_vmm::vmm::{BootConfig, ConsoleConfig, RawImage, RunState, Vmm};
use tine_vmm::vstate::vcpu::StopReason;
use vm_memory::{Bytes, GuestAddress};

const CODE_ADDR: u64 = 0x10_0000;
const COUNTER_ADDR: u64 = 0x20_0000;

/// `loop: inc qword [COUNTER_ADDR]; jmp loop`
const COUNTER_LOOP: &[u8] = &[
    0x48, 0xff, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, // inc qword [0x200000]
    0xeb, 0xf6, // jmp loop
];

/// `mov al, 7; mov dx, 0x501; out dx, al; jmp $`
const POWEROFF_7: &[u8] = &[0xb0, 0x07, 0x66, 0xba, 0x01, 0x05, 0xee, 0xeb, 0xfe];

fn raw_config(code: &[u8]) -> BootConfig {
    BootConfig {
        kernel: Default::default(),
        initramfs: None,
        cmdline: String::new(),
        mem_mib: 32,
        vcpus: 1,
        devices: Default::default(),
        raw: Some(RawImage {
            bytes: code.to_vec(),
            load_addr: CODE_ADDR,
            entry: CODE_ADDR,
        }),
    }
}

fn counter(vmm: &Vmm) -> u64 {
    vmm.ram()
        .mem
        .read_obj(GuestAddress(COUNTER_ADDR))
        .expect("counter is inside guest RAM")
}

fn wait_counter_above(vmm: &Vmm, value: u64) -> u64 {
    let start = Instant::now();
    loop {
        let now = counter(vmm);
        if now > value {
            return now;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "guest counter stuck at {now} (waiting for > {value})"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn test_synthetic_port_write_powers_off_with_value() {
    let mut vmm = Vmm::boot(&raw_config(POWEROFF_7), &ConsoleConfig::default())
        .expect("this host's KVM must run a ring-3 guest");
    assert_eq!(vmm.wait(), StopReason::GuestPoweroff(7));
}

#[test]
fn test_synthetic_pause_stops_progress_and_resume_continues() {
    let mut vmm = Vmm::boot(&raw_config(COUNTER_LOOP), &ConsoleConfig::default()).expect("boot");
    wait_counter_above(&vmm, 1000);
    vmm.pause().expect("pause");
    let paused_at = counter(&vmm);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(counter(&vmm), paused_at, "guest ran while paused");
    assert!(vmm.pause().is_err(), "pausing a paused VM must be refused");
    vmm.resume().expect("resume");
    wait_counter_above(&vmm, paused_at);
    assert_eq!(vmm.run_state(), RunState::Running);
    vmm.kill();
}

#[test]
fn test_synthetic_snapshot_restores_into_isolated_children() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("vm.state");
    let mem = dir.path().join("vm.mem");
    let mut parent = Vmm::boot(&raw_config(COUNTER_LOOP), &ConsoleConfig::default()).expect("boot");
    assert!(
        parent.snapshot(&state, &mem).is_err(),
        "snapshot of a running VM must be refused"
    );
    wait_counter_above(&parent, 100_000);
    parent.pause().expect("pause");
    let info = parent.snapshot(&state, &mem).expect("snapshot");
    let at_snapshot = counter(&parent);
    parent.kill();
    assert!(info.mem_bytes_written < 1 << 20, "memory file not sparse");

    let mut children: Vec<Vmm> = (0..3)
        .map(|_| {
            Vmm::restore(
                &state,
                &mem,
                None,
                &ConsoleConfig::default(),
                &RestoreOverrides::default(),
                true,
            )
            .expect("restore")
        })
        .collect();
    for child in &children {
        assert_eq!(
            counter(child),
            at_snapshot,
            "child does not start at the snapshot"
        );
    }
    // Only child 0 and 1 run; child 2 stays paused.
    children[0].resume().expect("resume 0");
    children[1].resume().expect("resume 1");
    let a = wait_counter_above(&children[0], at_snapshot + 1000);
    wait_counter_above(&children[1], at_snapshot + 1000);
    children[0].pause().expect("pause 0");
    let a_paused = counter(&children[0]);
    assert!(a_paused >= a);
    children[1].pause().expect("pause 1");
    let b_paused = counter(&children[1]);
    assert_ne!(a_paused, b_paused, "children share their counter page");
    assert_eq!(
        counter(&children[2]),
        at_snapshot,
        "a sibling's writes leaked"
    );

    // The memory file itself is untouched by the children's writes.
    let bytes = std::fs::read(&mem).expect("read memory file");
    let offset = COUNTER_ADDR as usize;
    let in_file = u64::from_le_bytes(bytes[offset..offset + 8].try_into().expect("8 bytes"));
    assert_eq!(in_file, at_snapshot);
    for mut child in children {
        child.kill();
    }
}

#[test]
fn test_synthetic_restore_corrupt_state_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("vm.state");
    let mem = dir.path().join("vm.mem");
    let mut parent = Vmm::boot(&raw_config(COUNTER_LOOP), &ConsoleConfig::default()).expect("boot");
    parent.pause().expect("pause");
    parent.snapshot(&state, &mem).expect("snapshot");
    parent.kill();
    let mut bytes = std::fs::read(&state).expect("state");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&state, &bytes).expect("write");
    let err = Vmm::restore(
        &state,
        &mem,
        None,
        &ConsoleConfig::default(),
        &RestoreOverrides::default(),
        true,
    )
    .err()
    .expect("corrupt state must be refused");
    assert!(err.to_string().contains("CRC"), "unexpected error: {err}");
    std::fs::write(&state, &bytes[..middle]).expect("truncate");
    let err = Vmm::restore(
        &state,
        &mem,
        None,
        &ConsoleConfig::default(),
        &RestoreOverrides::default(),
        true,
    )
    .err()
    .expect("truncated state must be refused");
    assert!(
        err.to_string().contains("truncated"),
        "unexpected error: {err}"
    );
}
