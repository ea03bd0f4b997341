//! ACPI platform devices: the VM generation ID (restores tell the guest it
//! runs in a copy) and the PM1 registers (the guest kernel's power-off).

pub mod pm;
pub mod vmgenid;
