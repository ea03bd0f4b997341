//! Synthetic guests whose work runs in ring 3, so they run at native speed
//! on any KVM (also nested PVM hosts, where guest ring 0 is emulated): exit
//! handling, pause, snapshot, restore into several VMs, copy-on-write
//! isolation.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_proto::vmm::{RunState, StopReason};
use tine_vmm::device_manager::RestoreOverrides;
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Privilege, Vmm};
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
    BootConfig::raw_image(code, CODE_ADDR, 32)
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

/// Boots the counter guest, lets it count (unless `counted` is false),
/// and snapshots it into `dir` as `vm.state` and `vm.mem`: those two
/// files, and the counter the snapshot holds.
fn counter_snapshot(dir: &Path, counted: bool) -> (PathBuf, PathBuf, u64) {
    let (state, mem) = (dir.join("vm.state"), dir.join("vm.mem"));
    let mut parent = Vmm::boot(&raw_config(COUNTER_LOOP), &ConsoleConfig::default()).expect("boot");
    if counted {
        wait_counter_above(&parent, 0);
    }
    parent.pause().expect("pause");
    let at_snapshot = counter(&parent);
    parent.snapshot(&state, &mem).expect("snapshot");
    parent.kill();
    (state, mem, at_snapshot)
}

/// Pauses `vmm`, snapshots it into `dir` as `again.state` and
/// `again.mem`, and kills it: the state file.
fn last_snapshot(mut vmm: Vmm, dir: &Path) -> PathBuf {
    vmm.pause().expect("pause");
    let state = dir.join("again.state");
    vmm.snapshot(&state, &dir.join("again.mem"))
        .expect("snapshot");
    vmm.kill();
    state
}

/// Restores the snapshot `state` + `mem` with no overrides, paused or
/// running.
fn restore(
    state: &std::path::Path,
    mem: &std::path::Path,
    paused: bool,
) -> Result<Vmm, tine_vmm::vmm::VmmError> {
    Vmm::restore(
        state,
        mem,
        None,
        &ConsoleConfig::default(),
        &RestoreOverrides::default(),
        paused,
    )
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

/// A resume does not wait for the vCPU thread to take it, so a pause can
/// come before the thread ran at all: the pause must still park the vCPU
/// (the guest holds still), and each resume must let it run again.
#[test]
fn test_synthetic_a_pause_right_after_a_resume_parks_the_vcpu() {
    let mut vmm = Vmm::boot(&raw_config(COUNTER_LOOP), &ConsoleConfig::default()).expect("boot");
    wait_counter_above(&vmm, 0);
    for round in 0..200u32 {
        vmm.pause()
            .unwrap_or_else(|e| panic!("round {round}: pause: {e}"));
        let paused_at = counter(&vmm);
        std::thread::sleep(Duration::from_micros(200));
        assert_eq!(
            counter(&vmm),
            paused_at,
            "round {round}: guest ran while paused"
        );
        vmm.resume()
            .unwrap_or_else(|e| panic!("round {round}: resume: {e}"));
        if round % 10 == 0 {
            wait_counter_above(&vmm, paused_at);
        }
    }
    vmm.pause().expect("pause");
    let paused_at = counter(&vmm);
    vmm.resume().expect("resume");
    wait_counter_above(&vmm, paused_at);
    assert_eq!(vmm.run_state(), RunState::Running);
    vmm.kill();
}

/// A kill ends a guest that never exits on its own, at any moment: right
/// after boot (the vCPU thread may not have entered `KVM_RUN` yet) or while
/// it spins. A kick that lands outside `KVM_RUN` used to be lost and the
/// kill then waited forever; each round here runs on a watchdog thread.
#[test]
fn test_synthetic_kill_ends_a_spinning_guest_every_time() {
    for round in 0..300u32 {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut vmm =
                Vmm::boot(&raw_config(COUNTER_LOOP), &ConsoleConfig::default()).expect("boot");
            if round % 3 == 1 {
                wait_counter_above(&vmm, 0);
            }
            let reason = vmm.kill();
            let _ = done_tx.send(reason);
        });
        match done_rx.recv_timeout(Duration::from_secs(20)) {
            Ok(reason) => assert_eq!(reason, StopReason::Killed, "round {round}"),
            Err(_) => panic!("round {round}: kill did not return within 20 s"),
        }
    }
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
        .map(|_| restore(&state, &mem, true).expect("restore"))
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
    let (state, mem, _) = counter_snapshot(dir.path(), false);
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

/// A ring-3 guest talks to a real virtio-rng device through MMIO exits, the
/// way a driver starts: magic, version, device ID, then Status ACKNOWLEDGE
/// and ACKNOWLEDGE|DRIVER read back; it stores what it read and powers off.
#[test]
fn test_synthetic_mmio_exits_reach_virtio_transport() {
    // rbx = 0xd0000000 (first virtio-mmio window), rdi = 0x200000 (results)
    let code: &[u8] = &[
        0xbb, 0x00, 0x00, 0x00, 0xd0, // mov ebx, 0xd0000000
        0xbf, 0x00, 0x00, 0x20, 0x00, // mov edi, 0x200000
        0x8b, 0x03, // mov eax, [rbx]        (MagicValue)
        0x89, 0x07, // mov [rdi], eax
        0x8b, 0x43, 0x04, // mov eax, [rbx+4]     (Version)
        0x89, 0x47, 0x04, // mov [rdi+4], eax
        0x8b, 0x43, 0x08, // mov eax, [rbx+8]     (DeviceID)
        0x89, 0x47, 0x08, // mov [rdi+8], eax
        0xc7, 0x43, 0x70, 0x01, 0x00, 0x00, 0x00, // mov dword [rbx+0x70], 1 (ACK)
        0xc7, 0x43, 0x70, 0x03, 0x00, 0x00, 0x00, // mov dword [rbx+0x70], 3 (ACK|DRIVER)
        0x8b, 0x43, 0x70, // mov eax, [rbx+0x70]  (Status)
        0x89, 0x47, 0x0c, // mov [rdi+12], eax
        0xb0, 0x00, // mov al, 0
        0x66, 0xba, 0x01, 0x05, // mov dx, 0x501
        0xee, // out dx, al
        0xeb, 0xfe, // jmp $
    ];
    let mut config = raw_config(code);
    config.devices.rng = true;
    let mut vmm = Vmm::boot(&config, &ConsoleConfig::default()).expect("boot");
    assert_eq!(vmm.wait(), StopReason::GuestPoweroff(0));
    let mut words = [0u32; 4];
    for (i, word) in words.iter_mut().enumerate() {
        *word = vmm
            .ram()
            .mem
            .read_obj(GuestAddress(COUNTER_ADDR + 4 * i as u64))
            .expect("result");
    }
    assert_eq!(
        words,
        [0x7472_6976, 2, 4, 3],
        "magic, version, rng id, status"
    );
}

#[test]
fn test_synthetic_restore_other_cpu_template_is_refused() {
    use tine_vmm::snapshot::format;
    use tine_vmm::vmm::MicrovmState;
    let dir = tempfile::tempdir().expect("tmp");
    let (state, mem, _) = counter_snapshot(dir.path(), false);
    let mut saved: MicrovmState =
        format::decode(&std::fs::read(&state).expect("read")).expect("decode");
    saved.cpu_fingerprint ^= 1;
    std::fs::write(&state, format::encode(&saved).expect("encode")).expect("write");
    let err = Vmm::restore(
        &state,
        &mem,
        None,
        &ConsoleConfig::default(),
        &RestoreOverrides::default(),
        true,
    )
    .err()
    .expect("a snapshot from another CPU template must be refused");
    assert!(
        err.to_string().contains("CPU template"),
        "unexpected error: {err}"
    );
}

/// A state file of format version 1 (written before the VM generation ID
/// device existed) still restores, and the guest runs on from it.
#[test]
fn test_synthetic_restore_of_a_format_1_state_file_runs() {
    use tine_vmm::snapshot::format;
    use tine_vmm::vmm::MicrovmState;
    let dir = tempfile::tempdir().expect("tmp");
    let (state, mem, before) = counter_snapshot(dir.path(), true);
    let bytes = std::fs::read(&state).expect("read");
    let (version, payload) = format::open(&bytes).expect("open");
    assert_eq!(version, format::FORMAT_VERSION);
    let saved = MicrovmState::decode(&bytes).expect("decode");
    assert_eq!(saved.vmgenid, None, "a raw guest has no VM generation ID");
    // Version 1 is the same payload without the trailing `vmgenid` (an
    // Option, encoded as one 0 byte when None).
    assert_eq!(payload.last(), Some(&0));
    let v1_payload = &payload[..payload.len() - 1];
    let mut v1 = Vec::new();
    v1.extend_from_slice(format::MAGIC);
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&(v1_payload.len() as u64).to_le_bytes());
    v1.extend_from_slice(v1_payload);
    v1.extend_from_slice(&crc32fast::hash(v1_payload).to_le_bytes());
    assert!(
        format::decode::<MicrovmState>(&v1).is_err(),
        "the current-version decoder must not take a version 1 file"
    );
    let old = MicrovmState::decode(&v1).expect("a version 1 file decodes");
    assert_eq!(old.mem_size, saved.mem_size);
    assert_eq!(old.vcpus.len(), saved.vcpus.len());
    std::fs::write(&state, &v1).expect("write");
    let child = restore(&state, &mem, false).expect("restore of a version 1 state file");
    assert!(wait_counter_above(&child, before) > before);
}

#[test]
fn test_synthetic_a_vm_restored_paused_resumes_with_the_snapshots_clock() {
    use tine_vmm::vmm::MicrovmState;
    let dir = tempfile::tempdir().expect("tmp");
    let (state, mem, _) = counter_snapshot(dir.path(), true);
    let clock_of = |path: &std::path::Path| {
        let bytes = std::fs::read(path).expect("read state");
        MicrovmState::decode(&bytes).expect("decode").vm.clock.clock
    };
    // Restored paused, it waits a second before it runs (a VM primed ahead
    // of a fork); its kvmclock then goes on from the snapshot's, not from
    // the restore's.
    let mut child = restore(&state, &mem, true).expect("restore");
    std::thread::sleep(Duration::from_secs(1));
    child.resume().expect("resume");
    let again = last_snapshot(child, dir.path());
    let ran_ns = clock_of(&again).saturating_sub(clock_of(&state));
    assert!(
        ran_ns < 500_000_000,
        "the guest's clock moved {ran_ns} ns over a run of a few ms: the wait counted"
    );
}

/// A pause holding the clock: over a second's wait the guest's kvmclock
/// stands (a snapshot then saves the held clock), and after the resume it
/// goes on from there; over a plain pause it runs on.
#[test]
fn test_synthetic_a_pause_holding_the_clock_hides_the_wait_from_the_guest() {
    use tine_vmm::vmm::MicrovmState;
    let dir = tempfile::tempdir().expect("tmp");
    let (state, mem) = (dir.path().join("vm.state"), dir.path().join("vm.mem"));
    let clock_now = |vmm: &mut Vmm| {
        vmm.snapshot(&state, &mem).expect("snapshot");
        MicrovmState::decode(&std::fs::read(&state).expect("read"))
            .expect("decode")
            .vm
            .clock
            .clock
    };
    let mut vmm = Vmm::boot(&raw_config(COUNTER_LOOP), &ConsoleConfig::default()).expect("boot");
    wait_counter_above(&vmm, 0);

    vmm.pause_holding_clock().expect("pause holding the clock");
    let held = clock_now(&mut vmm);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(clock_now(&mut vmm), held, "the held clock moved");
    vmm.resume().expect("resume");
    vmm.pause().expect("pause");
    let ran = clock_now(&mut vmm).saturating_sub(held);
    assert!(
        ran < 500_000_000,
        "the guest's clock moved {ran} ns over a run of a few ms: the wait counted"
    );

    let paused = clock_now(&mut vmm);
    std::thread::sleep(Duration::from_secs(1));
    let waited = clock_now(&mut vmm).saturating_sub(paused);
    assert!(
        waited >= 1_000_000_000,
        "a plain pause held the clock ({waited} ns over a 1 s wait)"
    );
    vmm.kill();
}

/// A write set saved from one restored VM copies the same pages into
/// another paused one, whose guest then runs on from them; a booted VM
/// (its memory all its own) and a write set of another memory size are
/// refused by name.
#[test]
fn test_synthetic_write_set_moves_between_vms_of_one_snapshot() {
    let dir = tempfile::tempdir().expect("tmp");
    let (state, mem) = (dir.path().join("s"), dir.path().join("m"));
    let mut source = Vmm::boot(&raw_config(COUNTER_LOOP), &ConsoleConfig::default()).expect("boot");
    wait_counter_above(&source, 0);
    source.pause().expect("pause");
    let booted = source
        .save_write_set(&dir.path().join("booted"))
        .expect_err("a booted VM has no write set")
        .to_string();
    assert!(
        booted.contains("needs a VM restored from a snapshot"),
        "{booted}"
    );
    source.snapshot(&state, &mem).expect("snapshot");
    source.kill();

    let mut first = restore(&state, &mem, false).expect("restore");
    wait_counter_above(&first, counter(&first));
    first.pause().expect("pause");
    let write_set = dir.path().join("write-set");
    let bytes = first.save_write_set(&write_set).expect("save");
    assert!(bytes >= 4096, "at least the counter's page: {bytes}");
    first.kill();

    // Into a running guest: the counter it wrote stays its own, and it
    // counts on.
    let mut third = restore(&state, &mem, false).expect("restore");
    let before = wait_counter_above(&third, counter(&third));
    assert_eq!(
        third.populate_write_set(&write_set).expect("copy in"),
        bytes
    );
    let after = wait_counter_above(&third, before);
    third.pause().expect("pause");
    let paused_at = counter(&third);
    assert!(
        paused_at >= after,
        "it counted on: {after} then {paused_at}"
    );
    third.populate_write_set(&write_set).expect("copy in again");
    assert_eq!(
        counter(&third),
        paused_at,
        "a page it wrote is left as it is"
    );
    third.kill();

    let mut second = restore(&state, &mem, true).expect("restore paused");
    assert_eq!(
        second.populate_write_set(&write_set).expect("copy in"),
        bytes
    );
    let other = dir.path().join("other-size");
    std::fs::write(
        &other,
        format!(
            r#"{{"version":1,"memory_size":{},"ranges":[]}}"#,
            64u64 << 20
        ),
    )
    .expect("write");
    let refused = second
        .populate_write_set(&other)
        .expect_err("another size")
        .to_string();
    assert!(
        refused.contains("is for 67108864 bytes of guest RAM"),
        "{refused}"
    );
    second.resume().expect("resume");
    wait_counter_above(&second, counter(&second));
    second.kill();
}

/// Where the kvmclock guest has KVM write its time, and the offset of the
/// flags byte in it (`struct pvclock_vcpu_time_info`).
const PVCLOCK_ADDR: u64 = 0x30_0000;
const PVCLOCK_FLAGS: u64 = 29;
/// `PVCLOCK_GUEST_STOPPED`: the host stopped the vCPU since the guest last
/// looked (the guest clears it).
const PVCLOCK_GUEST_STOPPED: u8 = 1 << 1;

/// In ring 0: enables kvmclock at `PVCLOCK_ADDR` (`MSR_KVM_SYSTEM_TIME_NEW`),
/// then counts as `COUNTER_LOOP` does.
const KVMCLOCK_COUNTER: &[u8] = &[
    0xb9, 0x01, 0x4d, 0x56, 0x4b, // mov ecx, 0x4b564d01
    0xb8, 0x01, 0x00, 0x30, 0x00, // mov eax, 0x300001 (enabled)
    0x31, 0xd2, // xor edx, edx
    0x0f, 0x30, // wrmsr
    0x48, 0xff, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, // inc qword [0x200000]
    0xeb, 0xf6, // jmp inc
];

fn pvclock_flags(vmm: &Vmm) -> u8 {
    vmm.ram()
        .mem
        .read_obj(GuestAddress(PVCLOCK_ADDR + PVCLOCK_FLAGS))
        .expect("the kvmclock page is inside guest RAM")
}

/// A pause tells the guest's kvmclock that the vCPU was stopped, as a
/// restore does, so that a kernel does not take the paused time for a
/// stuck CPU (the Linux bed test `linux_long_pause_reports_no_stall` shows
/// what it would report).
#[test]
fn test_synthetic_a_pause_tells_the_guests_kvmclock() {
    let mut config = raw_config(KVMCLOCK_COUNTER);
    if let Some(raw) = config.raw.as_mut() {
        raw.privilege = Privilege::Kernel;
    }
    let mut vmm = Vmm::boot(&config, &ConsoleConfig::default()).expect("boot a ring-0 guest");
    wait_counter_above(&vmm, 0);
    assert_eq!(
        pvclock_flags(&vmm) & PVCLOCK_GUEST_STOPPED,
        0,
        "stopped before any pause"
    );
    vmm.pause().expect("pause");
    vmm.resume().expect("resume");
    let start = Instant::now();
    while pvclock_flags(&vmm) & PVCLOCK_GUEST_STOPPED == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the guest's kvmclock never said its vCPU was stopped (flags {:#x})",
            pvclock_flags(&vmm)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    vmm.kill();
}

/// A restore into a pre-started VM sets only the parts of a vCPU's state
/// that differ from what KVM made the vCPU with: debug registers changed in
/// the state file are what the restored vCPU holds, and the parts the
/// snapshot holds as KVM made them (a ring-3 guest's extended control
/// registers, its multiprocessing state and pending events) are still what
/// the snapshot says.
#[test]
fn test_synthetic_a_restore_sets_the_parts_that_differ_from_a_new_vcpu() {
    use tine_vmm::snapshot::format;
    use tine_vmm::vmm::{MicrovmState, PreparedVm};
    let dir = tempfile::tempdir().expect("tmp");
    let (state, mem, before) = counter_snapshot(dir.path(), true);
    let decode = |path: &std::path::Path| {
        MicrovmState::decode(&std::fs::read(path).expect("read state")).expect("decode")
    };
    let mut saved = decode(&state);
    // Breakpoint addresses, none enabled (DR7 unchanged): the guest runs
    // the same.
    saved.vcpus[0].debugregs.db = [0x1234_5000, 0, 0, 0x9abc_d000];
    std::fs::write(&state, format::encode(&saved).expect("encode")).expect("write");

    let prepared = PreparedVm::with_memory(1, 32 << 20).expect("prepare");
    let child = Vmm::restore(
        &state,
        &mem,
        Some(prepared),
        &ConsoleConfig::default(),
        &RestoreOverrides::default(),
        false,
    )
    .expect("restore into a pre-started VM");
    assert!(wait_counter_above(&child, before) > before);
    let again = last_snapshot(child, dir.path());
    let (was, now) = (&saved.vcpus[0], &decode(&again).vcpus[0]);
    assert_eq!(
        now.debugregs.db, was.debugregs.db,
        "changed debug registers"
    );
    assert_eq!(now.debugregs.dr7, was.debugregs.dr7);
    assert_eq!(now.xcrs, was.xcrs);
    assert_eq!(now.mp_state, was.mp_state);
    assert_eq!(now.vcpu_events, was.vcpu_events);
}
