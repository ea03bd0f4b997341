//! tine-vmm: a KVM microVM monitor built on the rust-vmm crates.
//!
//! Layout (see docs/architecture.md):
//! - [`arch`]: x86_64 guest-physical layout and boot-time CPU state.
//! - [`probe`]: a functional check of whether this host's KVM runs guest
//!   kernel code at hardware speed (used by the test bed).

pub mod arch;
pub mod probe;
