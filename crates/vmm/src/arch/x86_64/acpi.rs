//! ACPI tables for Linux guests: RSDP, XSDT, FADT, FACS, MADT and a DSDT.
//!
//! The MP table (see `mptable`) still describes the CPUs and the IOAPIC to
//! kernels without ACPI; kernels with ACPI read the same facts from the MADT
//! (Linux drops the MP table when ACPI has no MADT).
//!
//! The FADT is not hardware-reduced: on x86, Linux then drops the legacy PIC,
//! the PIT and the ISA interrupt mappings, and the serial port, the i8042 and
//! the virtio-mmio devices (declared on the command line) would lose their
//! interrupts. Its fixed hardware is the least ACPI allows: a PM1a event and
//! control block at [`ACPI_PM1_EVT_PORT`] (always in ACPI mode: no SMI
//! command port), an SCI on [`SCI_GSI`] that never fires, no PM timer, no
//! GPE blocks. What only ACPI can say lives in the DSDT:
//! - `\_SB_.VGEN`, the VM generation ID device (`VMGENCTR`): its `ADDR`
//!   names the 16 bytes at [`VMGENID_START`]; a changed ID tells the guest
//!   kernel it runs in a copy of a snapshot and must reseed its CRNG.
//! - `\_SB_.GED_`, a Generic Event Device on [`GED_GSI`] whose `_EVT`
//!   notifies `VGEN`: the VMM raises it after writing a new ID on restore.
//! - `\_S5_`, so the guest kernel's own power-off works: it writes that
//!   sleep type with `SLP_EN` to the PM1a control register.

use acpi_tables::aml::{
    self, Arg, Device, Equal, If, Interrupt, Method, Name, Notify, Package, Path, ResourceTemplate,
    Scope,
};
use acpi_tables::facs::FACS;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::{Bytes, GuestAddress};

use super::layout::{
    ACPI_PM1_CNT_PORT, ACPI_PM1_EVT_PORT, ACPI_RSDP_START, ACPI_TABLES_END, APIC_START, GED_GSI,
    IOAPIC_START, SCI_GSI, VMGENID_START,
};
use super::mptable::{ioapic_id, MAX_VCPUS};

const OEM_ID: [u8; 6] = *b"TINE  ";
const OEM_REVISION: u32 = 1;
/// FADT boot flag: an i8042 sits at ports 0x60/0x64 (Ctrl-Alt-Del and reset
/// go through it).
const BOOT_ARCH_8042: u16 = 1 << 1;
/// FADT boot flag: there is no VGA to probe.
const BOOT_ARCH_NO_VGA: u16 = 1 << 2;
/// The notification value that tells a VMGenID driver the ID changed.
const VMGENID_NOTIFY: u8 = 0x80;
/// Sleep type the DSDT's `\_S5_` gives for soft-off; the VMM's PM1 control
/// register powers the VM off when the guest writes it with `SLP_EN`.
pub const SLEEP_TYPE_S5: u8 = 5;

/// Why the ACPI tables could not be written.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AcpiError {
    /// The vCPU count cannot be described.
    #[error("{0} vCPUs cannot be described in the MADT (1 to {MAX_VCPUS})")]
    VcpuCount(u8),
    /// The tables outgrew their region.
    #[error("ACPI tables of {0} bytes do not fit below {ACPI_TABLES_END:#x}")]
    TooLarge(u64),
    /// Guest memory does not cover the tables.
    #[error("guest memory does not cover the ACPI tables")]
    GuestMemory,
}

/// One table and the guest address it goes to.
struct Placed {
    addr: u64,
    bytes: Vec<u8>,
}

fn to_bytes(table: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    table.to_aml_bytes(&mut bytes);
    bytes
}

/// The DSDT's AML: the VMGenID device, the GED that notifies it, and `\_S5_`.
fn dsdt_body() -> Vec<u8> {
    let low = (VMGENID_START & 0xffff_ffff) as u32;
    let high = (VMGENID_START >> 32) as u32;
    let mut body = Vec::new();
    // The AML builders borrow their children: each tree is built and
    // serialised in one statement.
    Scope::new(
        "\\_SB_".into(),
        vec![
            &Device::new(
                "VGEN".into(),
                vec![
                    &Name::new("_HID".into(), &"VMGENCTR"),
                    &Name::new("_CID".into(), &"VM_Gen_Counter"),
                    &Name::new("_DDN".into(), &"VM_Gen_Counter"),
                    &Name::new("ADDR".into(), &Package::new(vec![&low, &high])),
                ],
            ),
            &Device::new(
                "GED_".into(),
                vec![
                    &Name::new("_HID".into(), &"ACPI0013"),
                    &Name::new("_UID".into(), &aml::ZERO),
                    &Name::new(
                        "_CRS".into(),
                        &ResourceTemplate::new(vec![&Interrupt::new(
                            true, true, false, false, GED_GSI,
                        )]),
                    ),
                    &Method::new(
                        "_EVT".into(),
                        1,
                        true,
                        vec![&If::new(
                            &Equal::new(&Arg(0), &GED_GSI),
                            vec![&Notify::new(&Path::new("VGEN"), &VMGENID_NOTIFY)],
                        )],
                    ),
                ],
            ),
        ],
    )
    .to_aml_bytes(&mut body);
    Name::new(
        "_S5_".into(),
        &Package::new(vec![&SLEEP_TYPE_S5, &SLEEP_TYPE_S5]),
    )
    .to_aml_bytes(&mut body);
    body
}

fn madt(num_cpus: u8) -> MADT {
    let mut madt = MADT::new(
        OEM_ID,
        *b"TINEAPIC",
        OEM_REVISION,
        LocalInterruptController::Address(APIC_START as u32),
    );
    for cpu in 0..num_cpus {
        madt.add_structure(ProcessorLocalApic::new(cpu, cpu, EnabledStatus::Enabled));
    }
    // ISA IRQs map to the same pins as in the MP table.
    madt.add_structure(IoApic::new(ioapic_id(num_cpus), IOAPIC_START as u32, 0));
    madt
}

/// Builds every table for a VM with `num_cpus` vCPUs, placed from
/// [`ACPI_RSDP_START`] up, 8-byte aligned.
fn build(num_cpus: u8) -> Result<Vec<Placed>, AcpiError> {
    if num_cpus == 0 || num_cpus > MAX_VCPUS {
        return Err(AcpiError::VcpuCount(num_cpus));
    }
    let align = |addr: u64| (addr + 7) & !7;
    let xsdt_addr = align(ACPI_RSDP_START + Rsdp::len() as u64);
    // The XSDT lists two tables: FADT and MADT.
    let fadt_addr = align(xsdt_addr + 36 + 2 * 8);
    // The FACS must be 64-byte aligned.
    let facs_addr = (fadt_addr + acpi_tables::fadt::FADT::len() as u64 + 63) & !63;
    let madt_addr = align(facs_addr + FACS::len() as u64);
    let madt = to_bytes(&madt(num_cpus));
    let dsdt_addr = align(madt_addr + madt.len() as u64);

    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, *b"TINEDSDT", OEM_REVISION);
    dsdt.append_slice(&dsdt_body());
    let dsdt = dsdt.as_slice().to_vec();

    // No fixed power or sleep button; C1 (HLT) works on every vCPU.
    let mut fadt = FADTBuilder::new(OEM_ID, *b"TINEFACP", OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .firmware_ctrl_64(facs_addr)
        .flag(Flags::Wbinvd)
        .flag(Flags::ProcC1)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    fadt.iapc_boot_arch = (BOOT_ARCH_8042 | BOOT_ARCH_NO_VGA).into();
    fadt.sci_int = (SCI_GSI as u16).into();
    fadt.pm1a_evt_blk = (ACPI_PM1_EVT_PORT as u32).into();
    fadt.pm1_evt_len = 4;
    fadt.pm1a_cnt_blk = (ACPI_PM1_CNT_PORT as u32).into();
    fadt.pm1_cnt_len = 2;
    let fadt = to_bytes(&fadt.finalize());

    let mut xsdt = XSDT::new(OEM_ID, *b"TINEXSDT", OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt = to_bytes(&xsdt);

    let end = dsdt_addr + dsdt.len() as u64;
    if end > ACPI_TABLES_END {
        return Err(AcpiError::TooLarge(end - ACPI_RSDP_START));
    }
    Ok(vec![
        Placed {
            addr: ACPI_RSDP_START,
            bytes: to_bytes(&Rsdp::new(OEM_ID, xsdt_addr)),
        },
        Placed {
            addr: xsdt_addr,
            bytes: xsdt,
        },
        Placed {
            addr: fadt_addr,
            bytes: fadt,
        },
        Placed {
            addr: facs_addr,
            bytes: to_bytes(&FACS::new()),
        },
        Placed {
            addr: madt_addr,
            bytes: madt,
        },
        Placed {
            addr: dsdt_addr,
            bytes: dsdt,
        },
    ])
}

/// Writes the tables for `num_cpus` vCPUs into guest memory. The zero page
/// names [`ACPI_RSDP_START`] as the root pointer.
pub fn setup_acpi<M: Bytes<GuestAddress>>(mem: &M, num_cpus: u8) -> Result<(), AcpiError> {
    for table in build(num_cpus)? {
        mem.write_slice(&table.bytes, GuestAddress(table.addr))
            .map_err(|_| AcpiError::GuestMemory)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    fn u32_at(bytes: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
    }

    fn u64_at(bytes: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
    }

    fn table_at(tables: &[Placed], addr: u64) -> &[u8] {
        &tables
            .iter()
            .find(|t| t.addr == addr)
            .unwrap_or_else(|| panic!("no table at {addr:#x}"))
            .bytes
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn test_tables_chain_from_rsdp_with_valid_checksums() {
        let tables = build(4).expect("tables");
        let rsdp = table_at(&tables, ACPI_RSDP_START);
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(sum(&rsdp[..20]), 0, "RSDP checksum");
        assert_eq!(sum(rsdp), 0, "RSDP extended checksum");
        let xsdt = table_at(&tables, u64_at(rsdp, 24));
        assert_eq!(&xsdt[..4], b"XSDT");
        assert_eq!(u32_at(xsdt, 4) as usize, xsdt.len());
        assert_eq!(sum(xsdt), 0, "XSDT checksum");
        let listed: Vec<&[u8]> = (36..xsdt.len())
            .step_by(8)
            .map(|at| table_at(&tables, u64_at(xsdt, at)))
            .collect();
        let signatures: Vec<&[u8]> = listed.iter().map(|t| &t[..4]).collect();
        assert_eq!(signatures, [&b"FACP"[..], &b"APIC"[..]]);
        for table in &listed {
            assert_eq!(u32_at(table, 4) as usize, table.len());
            assert_eq!(sum(table), 0, "{:?} checksum", &table[..4]);
        }
        let fadt = listed[0];
        // X_DSDT at offset 140, X_FIRMWARE_CTRL at 132, flags at 112.
        let dsdt = table_at(&tables, u64_at(fadt, 140));
        assert_eq!(&dsdt[..4], b"DSDT");
        assert_eq!(u32_at(dsdt, 4) as usize, dsdt.len());
        assert_eq!(sum(dsdt), 0, "DSDT checksum");
        let facs_addr = u64_at(fadt, 132);
        assert_eq!(facs_addr % 64, 0, "FACS alignment");
        assert_eq!(&table_at(&tables, facs_addr)[..4], b"FACS");
        assert_eq!(u32_at(fadt, 112) & Flags::HwReducedAcpi as u32, 0);
        // SCI_INT at 46, PM1a_EVT_BLK at 56, PM1a_CNT_BLK at 64, SMI_CMD at 48.
        assert_eq!(u32::from(u16::from_le_bytes([fadt[46], fadt[47]])), SCI_GSI);
        assert_eq!(u64::from(u32_at(fadt, 56)), ACPI_PM1_EVT_PORT);
        assert_eq!(u64::from(u32_at(fadt, 64)), ACPI_PM1_CNT_PORT);
        assert_eq!(
            u32_at(fadt, 48),
            0,
            "no SMI command port: always in ACPI mode"
        );
    }

    #[test]
    fn test_madt_lists_every_vcpu_and_the_ioapic() {
        let tables = build(3).expect("tables");
        let madt = tables
            .iter()
            .find(|t| &t.bytes[..4] == b"APIC")
            .expect("MADT");
        let entries = &madt.bytes[44..];
        let mut at = 0;
        let mut lapics = Vec::new();
        let mut ioapics = Vec::new();
        while at < entries.len() {
            let (kind, len) = (entries[at], entries[at + 1] as usize);
            match kind {
                0 => lapics.push(entries[at + 3]),
                1 => ioapics.push(u32_at(entries, at + 4)),
                other => panic!("unexpected MADT entry type {other}"),
            }
            at += len;
        }
        assert_eq!(lapics, [0, 1, 2]);
        assert_eq!(ioapics, [IOAPIC_START as u32]);
    }

    #[test]
    fn test_dsdt_declares_vmgenid_ged_and_soft_off() {
        let body = dsdt_body();
        for needle in [&b"VMGENCTR\0"[..], b"ACPI0013\0", b"_EVT", b"_S5_", b"ADDR"] {
            assert!(contains(&body, needle), "DSDT lacks {needle:?}");
        }
        // ADDR's package holds the ID's address as a DWordConst (0x0c).
        let mut low = vec![0x0c];
        low.extend_from_slice(&(VMGENID_START as u32).to_le_bytes());
        assert!(
            contains(&body, &low),
            "ADDR does not name {VMGENID_START:#x}"
        );
        // The GED's interrupt descriptor names GED_GSI, edge, active high.
        let mut irq = vec![0x89, 6, 0, 0b0011, 1];
        irq.extend_from_slice(&GED_GSI.to_le_bytes());
        assert!(contains(&body, &irq), "GED interrupt descriptor missing");
    }

    #[test]
    fn test_tables_fit_for_the_largest_vm_and_refuse_bad_counts() {
        let tables = build(MAX_VCPUS).expect("tables");
        let end = tables
            .iter()
            .map(|t| t.addr + t.bytes.len() as u64)
            .max()
            .expect("tables");
        assert!(end <= ACPI_TABLES_END);
        assert_eq!(build(0).err(), Some(AcpiError::VcpuCount(0)));
        assert_eq!(
            build(MAX_VCPUS + 1).err(),
            Some(AcpiError::VcpuCount(MAX_VCPUS + 1))
        );
    }
}
