//! Emulated devices: the buses that route port and MMIO exits, ACPI and
//! legacy devices, and virtio devices with their MMIO transport.

pub mod acpi;
pub mod bus;
pub mod legacy;
pub mod virtio;
