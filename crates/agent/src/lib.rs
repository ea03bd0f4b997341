//! `tine-agent` as a library: the guest-system side ([`system`]) that the
//! agent binary and its tests use.

pub mod system;
