//! A functional probe of the host's KVM: can it run guest kernel code at
//! hardware speed?
//!
//! The existence of `/dev/kvm` says nothing: on a nested PVM host, KVM opens
//! and creates VMs, but guest ring-0 code is emulated about 1000x slower and
//! stops at the first instruction the emulator lacks (XRSTOR). The probe runs
//! a tiny 64-bit guest in ring 0 that spins [`LOOP_ITERATIONS`] times, then
//! executes XRSTOR, then reports on an I/O port. KVM is usable for Linux
//! guests only when that completes and the loop ran fast.

use std::time::{Duration, Instant};

use kvm_bindings::{kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::arch::x86_64::regs::{
    boot_fpu, boot_regs, setup_long_mode, X86_CR4_OSFXSR, X86_CR4_OSXSAVE,
};

/// Iterations of the ring-0 `dec/jnz` loop.
pub const LOOP_ITERATIONS: u32 = 300_000;
/// The loop must finish within this to count as hardware speed. Natively it
/// takes about 0.1 ms; emulated at ~1.5 us an iteration it takes ~0.5 s.
pub const FAST_ENOUGH: Duration = Duration::from_millis(50);
/// Port the probe guest writes to when it is done.
pub const DONE_PORT: u16 = 0xf4;
/// Port the probe guest writes to when the ring-0 loop is done.
pub const LOOP_DONE_PORT: u16 = 0xf5;
/// Value the probe guest writes to [`DONE_PORT`].
pub const DONE_VALUE: u8 = 0x42;
/// How long the probe guest may run in all before it is declared stuck.
pub const RUN_LIMIT: Duration = Duration::from_secs(5);

const MEM_SIZE: usize = 4 << 20;
const CODE_ADDR: u64 = 0x10_0000;
const XSAVE_AREA_ADDR: u64 = 0x20_0000;

/// The probe guest, 64-bit code.
const PROBE_CODE: &[u8] = &[
    0xb9, 0xe0, 0x93, 0x04, 0x00, // mov ecx, 300_000
    0xff, 0xc9, // 1: dec ecx
    0x75, 0xfc, // jnz 1b
    0xe6, 0xf5, // out LOOP_DONE_PORT, al
    0xb8, 0x01, 0x00, 0x00, 0x00, // mov eax, 1 (restore x87 state only)
    0x31, 0xd2, // xor edx, edx
    0x48, 0xbf, 0x00, 0x00, 0x20, 0x00, 0x00, 0x00, 0x00, 0x00, // mov rdi, XSAVE_AREA_ADDR
    0x0f, 0xae, 0x2f, // xrstor [rdi]
    0xb0, DONE_VALUE, // mov al, DONE_VALUE
    0xe6, 0xf4, // out DONE_PORT, al
    0xf4, // hlt
];

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ProbeReport {
    /// True when KVM runs guest kernel code at hardware speed.
    pub usable: bool,
    /// One line saying why.
    pub reason: String,
    /// Wall time of the whole guest run, when it completed.
    pub guest_run_us: Option<u64>,
}

impl ProbeReport {
    fn unusable(reason: impl Into<String>) -> Self {
        Self {
            usable: false,
            reason: reason.into(),
            guest_run_us: None,
        }
    }
}

extern "C" fn ignore_signal(_: libc::c_int) {}

/// Arms SIGALRM so that a stuck `KVM_RUN` returns with EINTR after `limit`.
fn arm_alarm(limit: Duration) {
    // SAFETY: installs a handler that does nothing, without SA_RESTART, so
    // that a blocking ioctl is interrupted; `alarm` has no memory effects.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = ignore_signal as *const () as usize;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGALRM, &action, std::ptr::null_mut());
        libc::alarm(limit.as_secs().max(1) as libc::c_uint);
    }
}

fn disarm_alarm() {
    // SAFETY: cancelling a pending alarm has no memory effects.
    unsafe {
        libc::alarm(0);
    }
}

/// Runs the probe guest and reports whether KVM is usable for Linux guests.
pub fn probe_kvm() -> ProbeReport {
    match run_probe_guest() {
        Ok(elapsed) if elapsed <= FAST_ENOUGH => ProbeReport {
            usable: true,
            reason: format!("ring-0 loop and XRSTOR ran in {} us", elapsed.as_micros()),
            guest_run_us: Some(elapsed.as_micros() as u64),
        },
        Ok(elapsed) => ProbeReport {
            usable: false,
            reason: format!(
                "guest ring-0 code is emulated: {} iterations took {} ms (limit {} ms)",
                LOOP_ITERATIONS,
                elapsed.as_millis(),
                FAST_ENOUGH.as_millis()
            ),
            guest_run_us: Some(elapsed.as_micros() as u64),
        },
        Err(reason) => ProbeReport::unusable(reason),
    }
}

fn run_probe_guest() -> Result<Duration, String> {
    let kvm = Kvm::new().map_err(|e| format!("cannot open /dev/kvm: {e}"))?;
    let vm = kvm
        .create_vm()
        .map_err(|e| format!("KVM_CREATE_VM failed: {e}"))?;
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)])
        .map_err(|e| format!("cannot allocate probe memory: {e}"))?;
    let host_addr = mem
        .get_host_address(GuestAddress(0))
        .map_err(|e| format!("probe memory not mapped: {e}"))?;
    let region = kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: MEM_SIZE as u64,
        userspace_addr: host_addr as u64,
        flags: 0,
    };
    // SAFETY: the region is backed by `mem`, which outlives the VM (both are
    // dropped at the end of this function, the VM first).
    unsafe { vm.set_user_memory_region(region) }
        .map_err(|e| format!("KVM_SET_USER_MEMORY_REGION failed: {e}"))?;
    mem.write_slice(PROBE_CODE, GuestAddress(CODE_ADDR))
        .map_err(|e| format!("cannot write probe code: {e}"))?;
    // A zeroed 4 KiB XSAVE area: XSTATE_BV = 0 restores the init state.
    mem.write_slice(&[0u8; 4096], GuestAddress(XSAVE_AREA_ADDR))
        .map_err(|e| format!("cannot write xsave area: {e}"))?;

    let vcpu = vm
        .create_vcpu(0)
        .map_err(|e| format!("KVM_CREATE_VCPU failed: {e}"))?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| format!("KVM_GET_SUPPORTED_CPUID failed: {e}"))?;
    vcpu.set_cpuid2(&cpuid)
        .map_err(|e| format!("KVM_SET_CPUID2 failed: {e}"))?;
    let mut sregs = vcpu
        .get_sregs()
        .map_err(|e| format!("KVM_GET_SREGS failed: {e}"))?;
    setup_long_mode(&mem, &mut sregs).map_err(|e| e.to_string())?;
    sregs.cr4 |= X86_CR4_OSFXSR | X86_CR4_OSXSAVE;
    vcpu.set_sregs(&sregs)
        .map_err(|e| format!("KVM_SET_SREGS (long mode, OSXSAVE) refused: {e}"))?;
    vcpu.set_regs(&boot_regs(CODE_ADDR))
        .map_err(|e| format!("KVM_SET_REGS failed: {e}"))?;
    vcpu.set_fpu(&boot_fpu())
        .map_err(|e| format!("KVM_SET_FPU failed: {e}"))?;

    let mut vcpu = vcpu;
    arm_alarm(RUN_LIMIT);
    let start = Instant::now();
    let mut loop_time = None;
    let result = loop {
        match vcpu.run() {
            Ok(VcpuExit::IoOut(LOOP_DONE_PORT, _)) => {
                loop_time = Some(start.elapsed());
            }
            Ok(VcpuExit::IoOut(DONE_PORT, data)) if data.first() == Some(&DONE_VALUE) => {
                break Ok(start.elapsed());
            }
            Ok(VcpuExit::IoOut(port, _)) => break Err(format!("unexpected port write {port:#x}")),
            Ok(VcpuExit::InternalError) => {
                let step = match loop_time {
                    Some(t) => {
                        format!("at XRSTOR, after the ring-0 loop took {} ms", t.as_millis())
                    }
                    None => "in the ring-0 loop".to_string(),
                };
                break Err(format!(
                    "KVM_EXIT_INTERNAL_ERROR (instruction emulation failed) {step}"
                ));
            }
            Ok(VcpuExit::FailEntry(reason, _)) => {
                break Err(format!("KVM_EXIT_FAIL_ENTRY, reason {reason:#x}"));
            }
            Ok(VcpuExit::Shutdown) => break Err("guest triple-faulted".into()),
            Ok(VcpuExit::Hlt) => break Err("guest halted before reporting".into()),
            Ok(other) => break Err(format!("unexpected exit {other:?}")),
            Err(e) if e.errno() == libc::EINTR => {
                break Err(format!(
                    "probe guest still running after {} s",
                    RUN_LIMIT.as_secs()
                ));
            }
            Err(e) if e.errno() == libc::EAGAIN => continue,
            Err(e) => break Err(format!("KVM_RUN failed: {e}")),
        }
    };
    disarm_alarm();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_probe_code_loop_count_matches_constant() {
        let count =
            u32::from_le_bytes([PROBE_CODE[1], PROBE_CODE[2], PROBE_CODE[3], PROBE_CODE[4]]);
        assert_eq!(count, LOOP_ITERATIONS);
    }

    #[test]
    fn test_probe_code_xrstor_operand_matches_area() {
        let addr = u64::from_le_bytes(PROBE_CODE[20..28].try_into().expect("8 bytes"));
        assert_eq!(addr, XSAVE_AREA_ADDR);
    }

    #[test]
    fn test_probe_kvm_reports_reason() {
        // Whatever this host is, the probe must finish with an explanation.
        let report = probe_kvm();
        assert!(!report.reason.is_empty());
    }
}
