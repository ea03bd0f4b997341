//! Guest-system duties the protocol operations call: fork fix-ups, the
//! userdata state and the system uptime.
//!
//! This branch carries only host-safe stand-ins in `fallback.rs`; the guest
//! implementation (PID 1, fix-ups through the kernel, userdata, vsock) lands
//! from the system work and replaces this file at merge. The signatures
//! below are the contract between the two.

mod fallback;

pub use fallback::{
    apply_fixups, system_uptime, userdata_status, FixupReport, FixupRequest, UserdataStatus,
};
