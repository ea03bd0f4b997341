//! The KVM VM: creation with an in-kernel irqchip and PIT, guest memory
//! slots, irqfds and ioeventfds, and the VM-wide state saved in snapshots.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_config, kvm_pit_state2, kvm_userspace_memory_region,
    KVM_CLOCK_TSC_STABLE, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VmFd};
use serde::{Deserialize, Serialize};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::memory::GuestRam;
use crate::arch::x86_64::layout::KVM_TSS_ADDRESS;

/// Errors from creating or restoring the VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// A KVM ioctl failed.
    #[error("{op} failed")]
    Kvm {
        /// Which ioctl.
        op: &'static str,
        /// Why.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A guest memory region has no host mapping.
    #[error("guest memory region at {0:#x} is not mapped")]
    Unmapped(u64),
}

fn kvm_err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { op, source }
}

/// VM-wide state: interrupt controllers, PIT and kvmclock.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmState {
    /// PIC master.
    pub pic_master: kvm_irqchip,
    /// PIC slave.
    pub pic_slave: kvm_irqchip,
    /// IOAPIC.
    pub ioapic: kvm_irqchip,
    /// PIT channels.
    pub pit: kvm_pit_state2,
    /// kvmclock.
    pub clock: kvm_clock_data,
}

/// A KVM VM with its guest memory registered.
pub struct Vm {
    /// The /dev/kvm handle.
    pub kvm: Kvm,
    /// The VM file descriptor.
    pub fd: VmFd,
}

impl Vm {
    /// Opens /dev/kvm and creates a VM with an irqchip and a PIT.
    pub fn new() -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(kvm_err("open /dev/kvm"))?;
        let fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        fd.set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
        fd.create_irq_chip()
            .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit).map_err(kvm_err("KVM_CREATE_PIT2"))?;
        Ok(Self { kvm, fd })
    }

    /// Registers every region of `ram` as a memory slot.
    pub fn register_memory(&self, ram: &GuestRam) -> Result<(), VmError> {
        let ranges: Vec<_> = ram
            .mem
            .iter()
            .map(|r| (r.start_addr(), r.len() as usize, r.as_ptr() as usize))
            .collect();
        self.register_ranges(&ranges)
    }

    /// Registers (guest address, length, host address) ranges as memory
    /// slots 0, 1, ... The caller keeps the host mappings alive for as long
    /// as the VM exists.
    pub fn register_ranges(
        &self,
        ranges: &[(vm_memory::GuestAddress, usize, usize)],
    ) -> Result<(), VmError> {
        for (slot, &(guest, len, host)) in ranges.iter().enumerate() {
            if host == 0 {
                return Err(VmError::Unmapped(guest.0));
            }
            let mem_region = kvm_userspace_memory_region {
                slot: slot as u32,
                guest_phys_addr: guest.0,
                memory_size: len as u64,
                userspace_addr: host as u64,
                flags: 0,
            };
            // SAFETY: the mapping is owned by the caller's GuestRam or
            // Reservation, which lives as long as this VM (both in `Vmm` or
            // `PreparedVm`).
            unsafe { self.fd.set_user_memory_region(mem_region) }
                .map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
        }
        Ok(())
    }

    /// Captures the VM-wide state. The vCPUs must be paused.
    pub fn save_state(&self) -> Result<VmState, VmError> {
        let chip = |id| -> Result<kvm_irqchip, VmError> {
            let mut chip = kvm_irqchip {
                chip_id: id,
                ..Default::default()
            };
            self.fd
                .get_irqchip(&mut chip)
                .map_err(kvm_err("KVM_GET_IRQCHIP"))?;
            Ok(chip)
        };
        let clock = self.clock()?;
        Ok(VmState {
            pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
            pit: self.fd.get_pit2().map_err(kvm_err("KVM_GET_PIT2"))?,
            clock,
        })
    }

    /// The guest's kvmclock now, as [`Vm::set_clock`] takes it back.
    pub fn clock(&self) -> Result<kvm_clock_data, VmError> {
        let mut clock = self.fd.get_clock().map_err(kvm_err("KVM_GET_CLOCK"))?;
        // Only the clock value is restorable; the flags describe the host.
        clock.flags &= !KVM_CLOCK_TSC_STABLE;
        Ok(clock)
    }

    /// Sets kvmclock to a saved value.
    pub fn set_clock(&self, saved: &kvm_clock_data) -> Result<(), VmError> {
        let mut clock = *saved;
        clock.flags = 0;
        self.fd.set_clock(&clock).map_err(kvm_err("KVM_SET_CLOCK"))
    }

    /// Restores the VM-wide state.
    pub fn restore_state(&self, state: &VmState) -> Result<(), VmError> {
        self.fd
            .set_pit2(&state.pit)
            .map_err(kvm_err("KVM_SET_PIT2"))?;
        self.set_clock(&state.clock)?;
        for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
            self.fd
                .set_irqchip(chip)
                .map_err(kvm_err("KVM_SET_IRQCHIP"))?;
        }
        Ok(())
    }
}
