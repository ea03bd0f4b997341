//! x86_64: guest-physical layout, boot structures (GDT, page tables, zero
//! page, MP table, ACPI tables), CPUID template, MSRs and LAPIC setup.

pub mod acpi;
pub mod boot;
pub mod cpuid;
pub mod gdt;
pub mod interrupts;
pub mod layout;
pub mod mptable;
pub mod msr;
pub mod regs;
