//! Model-specific registers: the values set at boot and the list saved in
//! snapshots.

use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::{Kvm, VcpuFd};

/// IA32_TSC.
pub const MSR_IA32_TSC: u32 = 0x10;
/// IA32_TSC_DEADLINE: restored last, after TSC and the LAPIC.
pub const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
/// KVM's paravirtual clock, the old and the current MSR: where the guest
/// has KVM write its time, bit 0 set while it is enabled.
pub const MSR_KVM_SYSTEM_TIME: u32 = 0x12;
/// See [`MSR_KVM_SYSTEM_TIME`].
pub const MSR_KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_IA32_MISC_ENABLE_FAST_STRING: u64 = 1;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MTRR_ENABLE: u64 = 1 << 11;
const MTRR_MEM_TYPE_WB: u64 = 6;

/// Errors from MSR handling.
#[derive(Debug, thiserror::Error)]
pub enum MsrError {
    /// KVM_GET_MSR_INDEX_LIST failed.
    #[error("KVM_GET_MSR_INDEX_LIST failed")]
    IndexList(#[source] kvm_ioctls::Error),
    /// Building the MSR list failed.
    #[error("cannot build MSR list: {0}")]
    Build(String),
    /// KVM_GET_MSRS / KVM_SET_MSRS failed.
    #[error("{op} failed")]
    Ioctl {
        /// Which ioctl.
        op: &'static str,
        /// Why.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// KVM accepted only part of the list.
    #[error("KVM_SET_MSRS stopped at MSR {index:#x} ({done} of {total} set)")]
    Partial {
        /// First MSR not set.
        index: u32,
        /// MSRs set.
        done: usize,
        /// MSRs asked for.
        total: usize,
    },
}

fn entry(index: u32, data: u64) -> kvm_msr_entry {
    kvm_msr_entry {
        index,
        data,
        ..Default::default()
    }
}

/// MSR values at the kernel's entry point.
pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    vec![
        entry(MSR_IA32_SYSENTER_CS, 0),
        entry(MSR_IA32_SYSENTER_ESP, 0),
        entry(MSR_IA32_SYSENTER_EIP, 0),
        entry(MSR_STAR, 0),
        entry(MSR_CSTAR, 0),
        entry(MSR_KERNEL_GS_BASE, 0),
        entry(MSR_SYSCALL_MASK, 0),
        entry(MSR_LSTAR, 0),
        entry(MSR_IA32_TSC, 0),
        entry(MSR_IA32_MISC_ENABLE, MSR_IA32_MISC_ENABLE_FAST_STRING),
        entry(MSR_MTRR_DEF_TYPE, MTRR_ENABLE | MTRR_MEM_TYPE_WB),
    ]
}

/// Sets every entry of `entries` on `vcpu`, failing on the first one KVM
/// refuses.
pub fn set_msrs(vcpu: &VcpuFd, entries: &[kvm_msr_entry]) -> Result<(), MsrError> {
    if entries.is_empty() {
        return Ok(());
    }
    let msrs = Msrs::from_entries(entries).map_err(|e| MsrError::Build(format!("{e:?}")))?;
    let done = vcpu.set_msrs(&msrs).map_err(|source| MsrError::Ioctl {
        op: "KVM_SET_MSRS",
        source,
    })?;
    if done != entries.len() {
        return Err(MsrError::Partial {
            index: entries[done].index,
            done,
            total: entries.len(),
        });
    }
    Ok(())
}

/// Reads the MSRs named by `indices` from `vcpu`.
pub fn get_msrs(vcpu: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, MsrError> {
    let mut out = Vec::with_capacity(indices.len());
    // KVM reads at most KVM_MAX_MSR_ENTRIES per call; use chunks of 256.
    for chunk in indices.chunks(256) {
        let entries: Vec<_> = chunk.iter().map(|&i| entry(i, 0)).collect();
        let mut msrs =
            Msrs::from_entries(&entries).map_err(|e| MsrError::Build(format!("{e:?}")))?;
        let read = vcpu.get_msrs(&mut msrs).map_err(|source| MsrError::Ioctl {
            op: "KVM_GET_MSRS",
            source,
        })?;
        if read != entries.len() {
            return Err(MsrError::Partial {
                index: chunk[read],
                done: read,
                total: chunk.len(),
            });
        }
        out.extend_from_slice(msrs.as_slice());
    }
    Ok(out)
}

/// Every MSR KVM reports as saveable that this vCPU can actually read, with
/// IA32_TSC_DEADLINE moved to the end so that it is restored after the TSC.
pub fn saveable_msr_indices(kvm: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>, MsrError> {
    let list = kvm.get_msr_index_list().map_err(MsrError::IndexList)?;
    let mut indices: Vec<u32> = list
        .as_slice()
        .iter()
        .copied()
        .filter(|&index| {
            Msrs::from_entries(&[entry(index, 0)])
                .ok()
                .and_then(|mut one| vcpu.get_msrs(&mut one).ok())
                == Some(1)
        })
        .collect();
    order_for_restore(&mut indices);
    Ok(indices)
}

/// Moves IA32_TSC_DEADLINE after everything else (it must follow the TSC).
pub fn order_for_restore(indices: &mut Vec<u32>) {
    if let Some(pos) = indices.iter().position(|&i| i == MSR_IA32_TSC_DEADLINE) {
        indices.remove(pos);
        indices.push(MSR_IA32_TSC_DEADLINE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_order_for_restore_puts_tsc_deadline_last() {
        let mut list = vec![MSR_IA32_TSC_DEADLINE, 0x1b, MSR_IA32_TSC, 0xc000_0080];
        order_for_restore(&mut list);
        assert_eq!(list.last(), Some(&MSR_IA32_TSC_DEADLINE));
        assert!(list.iter().position(|&i| i == MSR_IA32_TSC) < Some(3));
    }

    #[test]
    fn test_boot_msrs_enable_write_back_mtrr() {
        let msrs = boot_msrs();
        let def = msrs
            .iter()
            .find(|m| m.index == MSR_MTRR_DEF_TYPE)
            .expect("mtrr");
        assert_eq!(def.data, MTRR_ENABLE | MTRR_MEM_TYPE_WB);
    }
}
