//! Guest-physical addresses used at boot. Everything below 1 MiB that the
//! VMM writes lives here so that the e820 map and the writers agree.

/// Global descriptor table.
pub const GDT_START: u64 = 0x500;
/// Interrupt descriptor table (a single null entry at boot).
pub const IDT_START: u64 = 0x520;
/// Linux zero page (`boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Page map level 4 of the identity page tables.
pub const PML4_START: u64 = 0x9000;
/// Page directory pointer table.
pub const PDPTE_START: u64 = 0xa000;
/// Page directory (512 x 2 MiB pages = the first 1 GiB).
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Largest command line the VMM accepts, terminating NUL included.
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the region reserved for the MP table and the ACPI tables.
pub const SYSTEM_REGION_START: u64 = 0x9fc00;
/// ACPI root pointer (RSDP); XSDT, FADT and DSDT follow it.
pub const ACPI_RSDP_START: u64 = 0xe0000;
/// End (exclusive) of the ACPI tables.
pub const ACPI_TABLES_END: u64 = 0xe1000;
/// The 16-byte VM generation ID the VMGenID device points the guest at.
pub const VMGENID_START: u64 = 0xe1000;
/// End (exclusive) of the reserved system region.
pub const SYSTEM_REGION_END: u64 = 0x10_0000;
/// Where the kernel is loaded: 1 MiB.
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the 32-bit MMIO hole; guest RAM above it is relocated past 4 GiB.
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
/// End (exclusive) of the 32-bit MMIO hole.
pub const MMIO_HOLE_END: u64 = 0x1_0000_0000;
/// First virtio-mmio device window.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
/// Size of one virtio-mmio device window.
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// IOAPIC base address.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Local APIC base address.
pub const APIC_START: u64 = 0xfee0_0000;
/// Address KVM uses for its TSS (three pages) on Intel hosts.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// GSI of the ACPI Generic Event Device: its interrupt tells the guest the
/// VM generation ID changed (3 is COM2's, which tine VMs do not have).
pub const GED_GSI: u32 = 3;
/// The ACPI PM1a event block (status and enable, 2 bytes each) ...
pub const ACPI_PM1_EVT_PORT: u64 = 0x600;
/// ... and the PM1a control block (2 bytes) right after it: the guest's
/// power-off writes `SLP_TYP` 5 with `SLP_EN` there.
pub const ACPI_PM1_CNT_PORT: u64 = 0x604;
/// Ports the PM1a blocks span.
pub const ACPI_PM1_LEN: u64 = 6;
/// GSI of the ACPI SCI. Nothing raises it (tine VMs have no fixed ACPI
/// events and no GPEs), but ACPI without hardware reduction needs one; it is
/// off the ISA range, which the virtio devices use, because the kernel makes
/// it level-triggered.
pub const SCI_GSI: u32 = 20;
/// First GSI handed to virtio-mmio devices (0-4 are PIT, keyboard, cascade,
/// the GED and serial).
pub const FIRST_DEVICE_GSI: u32 = 5;
/// Last GSI handed to virtio-mmio devices: the last ISA IRQ. A kernel with
/// ACPI maps IOAPIC pins 16-23 only for interrupts ACPI itself declares, and
/// virtio-mmio devices are declared on the command line.
pub const LAST_DEVICE_GSI: u32 = 15;
