//! The Intel MultiProcessor table (MP spec 1.4): tells the guest how many
//! CPUs there are, where the IOAPIC is and how ISA IRQs are routed. Without
//! it (and without ACPI) a Linux guest can hang in timer setup.

use vm_memory::{Bytes, GuestAddress};

use super::layout::{APIC_START, IOAPIC_START, SYSTEM_REGION_END, SYSTEM_REGION_START};

/// Most vCPUs the table (and the VMM) supports; APIC IDs stay below the
/// IOAPIC's ID.
pub const MAX_VCPUS: u8 = 64;
/// IOAPIC input pins.
pub const IOAPIC_PINS: u8 = 24;

/// Errors from writing the MP table.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MptableError {
    /// Zero or too many vCPUs.
    #[error("{0} vCPUs cannot be described (1 to {MAX_VCPUS})")]
    VcpuCount(u8),
    /// The table does not fit in the reserved system region.
    #[error("MP table of {0} bytes does not fit in the system region")]
    TooLarge(usize),
    /// Guest memory does not cover the system region.
    #[error("guest memory does not cover the MP table region")]
    GuestMemory,
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |acc, b| acc.wrapping_add(*b))
        .wrapping_neg()
}

/// The IOAPIC's ID, after the vCPUs' local APIC IDs (0 to `num_cpus - 1`);
/// the MP table and the MADT give the same.
pub fn ioapic_id(num_cpus: u8) -> u8 {
    num_cpus + 1
}

/// Builds the floating pointer plus configuration table for `num_cpus`
/// vCPUs, to be placed at `base`.
pub fn build(num_cpus: u8, base: u64) -> Result<Vec<u8>, MptableError> {
    if num_cpus == 0 || num_cpus > MAX_VCPUS {
        return Err(MptableError::VcpuCount(num_cpus));
    }
    let ioapic_id = ioapic_id(num_cpus);
    let table_addr = base + 16;

    let mut entries: Vec<u8> = Vec::new();
    let mut entry_count: u16 = 0;
    for cpu in 0..num_cpus {
        // Processor entry (20 bytes).
        entries.push(0); // type: processor
        entries.push(cpu); // local APIC ID
        entries.push(0x14); // local APIC version
        entries.push(if cpu == 0 { 0x3 } else { 0x1 }); // enabled (+ BSP)
        entries.extend_from_slice(&0x600u32.to_le_bytes()); // signature: family 6
        entries.extend_from_slice(&0x201u32.to_le_bytes()); // features: FPU, APIC
        entries.extend_from_slice(&[0u8; 8]);
        entry_count += 1;
    }
    // Bus entry: ISA.
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    entry_count += 1;
    // IOAPIC entry.
    entries.extend_from_slice(&[2, ioapic_id, 0x11, 1]);
    entries.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    entry_count += 1;
    // I/O interrupt assignments: ISA IRQ n -> IOAPIC pin n.
    for irq in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[3, 0]); // type, INT
        entries.extend_from_slice(&0u16.to_le_bytes()); // conforming polarity/trigger
        entries.extend_from_slice(&[0, irq, ioapic_id, irq]);
        entry_count += 1;
    }
    // Local interrupt assignments: ExtINT on LINT0, NMI on LINT1 of all CPUs.
    for (kind, lint) in [(3u8, 0u8), (1u8, 1u8)] {
        entries.extend_from_slice(&[4, kind]);
        entries.extend_from_slice(&0u16.to_le_bytes());
        entries.extend_from_slice(&[0, 0, 0xff, lint]);
        entry_count += 1;
    }

    let table_len = 44 + entries.len();
    let mut table = Vec::with_capacity(table_len);
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&(table_len as u16).to_le_bytes());
    table.push(4); // spec revision 1.4
    table.push(0); // checksum, patched below
    table.extend_from_slice(b"TINE    ");
    table.extend_from_slice(b"TINE-VMM    ");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&entry_count.to_le_bytes());
    table.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    table.extend_from_slice(&0u16.to_le_bytes()); // extended table length
    table.push(0); // extended table checksum
    table.push(0); // reserved
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut floating = Vec::with_capacity(16);
    floating.extend_from_slice(b"_MP_");
    floating.extend_from_slice(&(table_addr as u32).to_le_bytes());
    floating.push(1); // length in 16-byte units
    floating.push(4); // spec revision
    floating.push(0); // checksum, patched below
    floating.extend_from_slice(&[0u8; 5]); // no default configuration
    floating[10] = checksum(&floating);

    let mut out = floating;
    out.extend_from_slice(&table);
    if base + out.len() as u64 > SYSTEM_REGION_END {
        return Err(MptableError::TooLarge(out.len()));
    }
    Ok(out)
}

/// Writes the MP table for `num_cpus` vCPUs at the start of the system region.
pub fn setup_mptable<M: Bytes<GuestAddress>>(mem: &M, num_cpus: u8) -> Result<(), MptableError> {
    let bytes = build(num_cpus, SYSTEM_REGION_START)?;
    mem.write_slice(&bytes, GuestAddress(SYSTEM_REGION_START))
        .map_err(|_| MptableError::GuestMemory)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    #[test]
    fn test_build_checksums_are_valid() {
        let bytes = build(4, SYSTEM_REGION_START).expect("table");
        assert_eq!(&bytes[0..4], b"_MP_");
        assert_eq!(sum(&bytes[0..16]), 0);
        let len = u16::from_le_bytes([bytes[20], bytes[21]]) as usize;
        assert_eq!(&bytes[16..20], b"PCMP");
        assert_eq!(sum(&bytes[16..16 + len]), 0);
        assert_eq!(bytes.len(), 16 + len);
    }

    #[test]
    fn test_build_counts_one_processor_entry_per_vcpu() {
        let bytes = build(3, SYSTEM_REGION_START).expect("table");
        let count = u16::from_le_bytes([bytes[16 + 34], bytes[16 + 35]]);
        // 3 CPUs + bus + IOAPIC + 24 IRQs + 2 local interrupts.
        assert_eq!(count, 3 + 1 + 1 + 24 + 2);
        let pointer = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        assert_eq!(u64::from(pointer), SYSTEM_REGION_START + 16);
    }

    #[test]
    fn test_build_vcpu_count_out_of_range_fails() {
        assert_eq!(
            build(0, SYSTEM_REGION_START),
            Err(MptableError::VcpuCount(0))
        );
        assert_eq!(
            build(MAX_VCPUS + 1, SYSTEM_REGION_START),
            Err(MptableError::VcpuCount(MAX_VCPUS + 1))
        );
        assert!(build(MAX_VCPUS, SYSTEM_REGION_START).is_ok());
    }
}
