//! tine-vmm: a KVM microVM monitor built on the rust-vmm crates.
//!
//! Layout (see docs/architecture.md):
//! - [`arch`]: x86_64 guest-physical layout and boot-time CPU state.
//! - [`vstate`]: guest memory, the KVM VM and its vCPUs.
//! - [`devices`]: buses, legacy devices and virtio devices.
//! - [`snapshot`]: the [`snapshot::Persist`] trait and the state-file format.
//! - [`spare_thread`]: threads started before their work is known (a
//!   pre-started VM's vCPU and device threads).
//! - [`prefault`]: the pages a pre-started process's restore would fault
//!   on, mapped ahead.
//! - [`probe`]: a functional check of whether this host's KVM runs guest
//!   kernel code at hardware speed (used by the test bed).
//!
//! Disk images (raw files, qcow2 chains) are the `tine-disk` crate's;
//! virtio-blk serves them through its `BlockBackend` trait.

pub mod arch;
pub mod device_manager;
pub mod devices;
pub mod prefault;
pub mod probe;
pub mod snapshot;
pub mod spare_thread;
pub mod vmm;
pub mod vstate;
