//! The CPU template: the CPUID a guest sees, derived from what this host's
//! KVM supports with documented changes, and a fingerprint of it so that a
//! snapshot is only restored where the same template yields the same CPU.
//!
//! Template `tine-host-v1`, applied to `KVM_GET_SUPPORTED_CPUID`:
//! - leaf 0x1: EBX APIC ID = vCPU index, logical processor count = vCPUs,
//!   ECX hypervisor bit set;
//! - leaves 0xb and 0x1f: EDX x2APIC ID = vCPU index;
//! - leaf 0xa (architectural PMU): zeroed, the VMM offers no PMU.
//!
//! The fingerprint covers the vendor and every entry of vCPU 0, so a host
//! whose KVM reports different features gives a different fingerprint and a
//! snapshot from elsewhere is refused before anything is loaded.

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;

/// Name of the template, stored in snapshots.
pub const TEMPLATE_NAME: &str = "tine-host-v1";

/// Errors from building the CPUID.
#[derive(Debug, thiserror::Error)]
pub enum CpuidError {
    /// KVM_GET_SUPPORTED_CPUID failed.
    #[error("KVM_GET_SUPPORTED_CPUID failed")]
    Supported(#[source] kvm_ioctls::Error),
    /// Building the CPUID list failed.
    #[error("cannot build CPUID list: {0}")]
    Build(String),
}

const HYPERVISOR_BIT: u32 = 1 << 31;

fn apply_template(entries: &mut [kvm_cpuid_entry2], cpu_index: u8, num_cpus: u8) {
    for entry in entries.iter_mut() {
        match entry.function {
            0x1 => {
                entry.ebx = (entry.ebx & 0x0000_ffff)
                    | (u32::from(cpu_index) << 24)
                    | (u32::from(num_cpus) << 16);
                entry.ecx |= HYPERVISOR_BIT;
                // HTT: more than one logical processor per package.
                if num_cpus > 1 {
                    entry.edx |= 1 << 28;
                }
            }
            0xb | 0x1f => entry.edx = u32::from(cpu_index),
            0xa => {
                entry.eax = 0;
                entry.ebx = 0;
                entry.ecx = 0;
                entry.edx = 0;
            }
            _ => {}
        }
    }
}

/// The host's supported CPUID, as the template's starting point.
pub fn supported_cpuid(kvm: &Kvm) -> Result<CpuId, CpuidError> {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(CpuidError::Supported)
}

/// The CPUID of vCPU `cpu_index` of `num_cpus` under the template.
pub fn vcpu_cpuid(base: &CpuId, cpu_index: u8, num_cpus: u8) -> Result<CpuId, CpuidError> {
    let mut entries = base.as_slice().to_vec();
    apply_template(&mut entries, cpu_index, num_cpus);
    CpuId::from_entries(&entries).map_err(|e| CpuidError::Build(format!("{e:?}")))
}

/// A 64-bit FNV-1a fingerprint of the template applied to `base` for a
/// one-vCPU VM: equal on hosts where a snapshot's CPU state is valid.
pub fn fingerprint(base: &CpuId) -> u64 {
    let mut entries = base.as_slice().to_vec();
    apply_template(&mut entries, 0, 1);
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    feed(TEMPLATE_NAME.as_bytes());
    for e in &entries {
        for word in [e.function, e.index, e.flags, e.eax, e.ebx, e.ecx, e.edx] {
            feed(&word.to_le_bytes());
        }
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> CpuId {
        let entries = [
            kvm_cpuid_entry2 {
                function: 0x1,
                ebx: 0xff00_0800,
                ecx: 0,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xa,
                eax: 0x0704_0802,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xb,
                edx: 7,
                ..Default::default()
            },
        ];
        CpuId::from_entries(&entries).expect("cpuid")
    }

    #[test]
    fn test_vcpu_cpuid_sets_apic_id_and_hypervisor_bit() {
        let cpuid = vcpu_cpuid(&base(), 3, 4).expect("cpuid");
        let leaf1 = cpuid.as_slice()[0];
        assert_eq!(leaf1.ebx >> 24, 3);
        assert_eq!((leaf1.ebx >> 16) & 0xff, 4);
        assert_eq!(leaf1.ebx & 0xffff, 0x0800);
        assert_ne!(leaf1.ecx & HYPERVISOR_BIT, 0);
        assert_eq!(cpuid.as_slice()[1].eax, 0);
        assert_eq!(cpuid.as_slice()[2].edx, 3);
    }

    #[test]
    fn test_fingerprint_changes_with_features() {
        let a = base();
        let mut entries = a.as_slice().to_vec();
        entries[0].ecx |= 1 << 26; // XSAVE
        let b = CpuId::from_entries(&entries).expect("cpuid");
        assert_ne!(fingerprint(&a), fingerprint(&b));
        assert_eq!(fingerprint(&a), fingerprint(&base()));
    }
}
