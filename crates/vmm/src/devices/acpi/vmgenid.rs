//! The VM generation ID device (Microsoft's "Virtual Machine Generation ID",
//! Linux's `vmgenid` driver): 16 random bytes at a guest address the DSDT's
//! `VGEN.ADDR` names, and the Generic Event Device interrupt that tells the
//! guest to read them again.
//!
//! At boot the ID is random; every restore writes a fresh one and raises the
//! interrupt before any vCPU runs. The guest kernel then mixes the new ID
//! into its CRNG and reseeds it (`add_vmfork_randomness`), so two VMs
//! restored from one snapshot stop sharing kernel random state. The notify
//! is handled asynchronously in the guest; tine's agent closes that window
//! for forks by reseeding before it reports them running.

use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::snapshot::Persist;
use crate::vstate::memory::GuestMemoryMmap;

/// Length of the ID.
pub const VMGENID_LEN: usize = 16;

/// Why the ID could not be written or announced.
#[derive(Debug, thiserror::Error)]
pub enum VmGenIdError {
    /// The host has no randomness to give.
    #[error("cannot draw a VM generation ID from the host's randomness: {0}")]
    Random(String),
    /// The ID's address is not in guest RAM.
    #[error("VM generation ID at {0:#x} is outside guest memory")]
    GuestMemory(u64),
    /// The interrupt could not be raised.
    #[error("cannot raise the VM generation ID interrupt")]
    Notify(#[source] std::io::Error),
}

/// Snapshot state: where the ID lives and which GSI announces a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmGenIdState {
    /// Guest-physical address of the 16 bytes.
    pub addr: u64,
    /// GSI of the Generic Event Device.
    pub gsi: u32,
}

/// Host resources to rebuild a [`VmGenId`].
#[derive(Debug)]
pub struct VmGenIdConstructorArgs {
    /// Guest memory the new ID is written to.
    pub mem: GuestMemoryMmap,
    /// The eventfd registered with KVM as an irqfd on the state's GSI.
    pub irq: EventFd,
}

/// The device.
#[derive(Debug)]
pub struct VmGenId {
    state: VmGenIdState,
    irq: EventFd,
}

fn fresh_id() -> Result<[u8; VMGENID_LEN], VmGenIdError> {
    let mut id = [0u8; VMGENID_LEN];
    getrandom::fill(&mut id).map_err(|e| VmGenIdError::Random(e.to_string()))?;
    Ok(id)
}

fn write_id(mem: &GuestMemoryMmap, addr: u64, id: &[u8; VMGENID_LEN]) -> Result<(), VmGenIdError> {
    mem.write_slice(id, GuestAddress(addr))
        .map_err(|_| VmGenIdError::GuestMemory(addr))
}

impl VmGenId {
    /// A device for a booting VM: writes a random ID at `addr`; `irq` is
    /// registered on `gsi`.
    pub fn new(
        mem: &GuestMemoryMmap,
        addr: u64,
        gsi: u32,
        irq: EventFd,
    ) -> Result<Self, VmGenIdError> {
        write_id(mem, addr, &fresh_id()?)?;
        Ok(Self {
            state: VmGenIdState { addr, gsi },
            irq,
        })
    }

    /// The GSI the device announces a new ID on.
    pub fn gsi(&self) -> u32 {
        self.state.gsi
    }

    fn notify(&self) -> Result<(), VmGenIdError> {
        self.irq.write(1).map_err(VmGenIdError::Notify)
    }
}

impl Persist for VmGenId {
    type State = VmGenIdState;
    type ConstructorArgs = VmGenIdConstructorArgs;
    type Error = VmGenIdError;

    fn save(&self) -> Self::State {
        self.state
    }

    /// Writes a fresh ID and raises the interrupt. Call it after the
    /// irqchip's state is restored (which would drop the pending edge) and
    /// before the vCPUs run.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error> {
        write_id(&args.mem, state.addr, &fresh_id()?)?;
        let device = Self {
            state: *state,
            irq: args.irq,
        };
        device.notify()?;
        Ok(device)
    }
}

#[cfg(test)]
mod tests {
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    use super::*;

    const ADDR: u64 = 0xe1000;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("mem")
    }

    fn read_id(mem: &GuestMemoryMmap) -> [u8; VMGENID_LEN] {
        let mut id = [0u8; VMGENID_LEN];
        mem.read_slice(&mut id, GuestAddress(ADDR)).expect("read");
        id
    }

    #[test]
    fn test_boot_writes_an_id_without_notifying() {
        let mem = mem();
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let probe = irq.try_clone().expect("clone");
        let device = VmGenId::new(&mem, ADDR, 3, irq).expect("device");
        assert_ne!(read_id(&mem), [0u8; VMGENID_LEN]);
        assert!(probe.read().is_err(), "boot must not raise the interrupt");
        assert_eq!(device.save(), VmGenIdState { addr: ADDR, gsi: 3 });
    }

    #[test]
    fn test_each_restore_writes_a_new_id_and_notifies() {
        let mem = mem();
        let boot = VmGenId::new(&mem, ADDR, 3, EventFd::new(EFD_NONBLOCK).expect("eventfd"))
            .expect("device");
        let mut seen = vec![read_id(&mem)];
        for _ in 0..3 {
            let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
            let probe = irq.try_clone().expect("clone");
            let args = VmGenIdConstructorArgs {
                mem: mem.clone(),
                irq,
            };
            let restored = VmGenId::restore(args, &boot.save()).expect("restore");
            assert_eq!(restored.gsi(), 3);
            assert_eq!(probe.read().expect("interrupt raised"), 1);
            let id = read_id(&mem);
            assert!(!seen.contains(&id), "restore reused an ID");
            seen.push(id);
        }
    }

    #[test]
    fn test_restore_outside_guest_memory_is_refused() {
        let args = VmGenIdConstructorArgs {
            mem: mem(),
            irq: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
        };
        let state = VmGenIdState {
            addr: 1 << 40,
            gsi: 3,
        };
        assert!(matches!(
            VmGenId::restore(args, &state),
            Err(VmGenIdError::GuestMemory(a)) if a == 1 << 40
        ));
    }
}
