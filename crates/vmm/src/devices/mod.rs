//! Emulated devices: the buses that route port and MMIO exits, legacy
//! devices, and virtio devices with their MMIO transport.

pub mod bus;
pub mod legacy;
pub mod virtio;
