//! Virtio devices over the MMIO transport.
//!
//! A device implements [`VirtioDevice`]: the transport (`mmio`) drives
//! feature negotiation and queue setup through it and calls
//! [`VirtioDevice::activate`] when the driver sets DRIVER_OK. After that the
//! VMM's event loop calls [`VirtioDevice::process_queue`] when the guest
//! notifies a queue (through an ioeventfd) and
//! [`VirtioDevice::process_host_event`] when one of the device's host-side
//! file descriptors is ready. Devices signal the guest through
//! [`IrqTrigger`].
//!
//! Every guest-supplied descriptor is hostile input: devices read and write
//! guest memory only through vm-memory's checked accessors, bound every
//! length, and on a malformed request complete it with an error status (or
//! zero length) and carry on. They never panic on guest input.

pub mod block;
pub mod mmio;
pub mod net;
pub mod persist;
pub mod rng;
pub mod vsock;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Once};

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::vstate::memory::GuestMemoryMmap;
use persist::VirtioDeviceState;

/// Virtio device IDs (virtio spec 5).
pub mod device_type {
    /// Network card.
    pub const NET: u32 = 1;
    /// Block device.
    pub const BLOCK: u32 = 2;
    /// Entropy source.
    pub const RNG: u32 = 4;
    /// Socket device.
    pub const VSOCK: u32 = 19;
}

/// Feature bit: the device conforms to virtio 1.x (required over MMIO v2).
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// Feature bit: used/avail event index suppression.
pub const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;

/// Interrupt status bit: a used ring was updated.
pub const VIRTIO_MMIO_INT_VRING: u32 = 0x01;
/// Interrupt status bit: the configuration space changed.
pub const VIRTIO_MMIO_INT_CONFIG: u32 = 0x02;

/// The interrupt line of one virtio-mmio device: the InterruptStatus
/// register plus the eventfd registered with KVM as an irqfd on the device's
/// GSI.
#[derive(Debug)]
pub struct IrqTrigger {
    status: AtomicU32,
    event: EventFd,
}

impl IrqTrigger {
    /// A new line with no interrupt pending.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            status: AtomicU32::new(0),
            event: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    /// Raises `status_bits` ([`VIRTIO_MMIO_INT_VRING`] or
    /// [`VIRTIO_MMIO_INT_CONFIG`]) and signals the guest.
    pub fn trigger(&self, status_bits: u32) -> std::io::Result<()> {
        self.status.fetch_or(status_bits, Ordering::SeqCst);
        self.event.write(1)
    }

    /// The InterruptStatus register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// The driver acknowledged `bits` (InterruptACK register).
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Overwrites the status register (restore).
    pub fn set_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
    }

    /// The eventfd KVM injects the interrupt from.
    pub fn event(&self) -> &EventFd {
        &self.event
    }
}

/// Why a device could not be activated.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// The driver left a queue the device needs unready or invalid.
    #[error("queue {0} is not ready or not valid")]
    InvalidQueue(usize),
    /// The device's host-side backend failed.
    #[error("device backend failed: {0}")]
    Backend(String),
}

/// State every virtio device has: features, queues and, once activated,
/// guest memory and the interrupt line.
#[derive(Debug)]
pub struct VirtioCommon {
    /// Features the device offers.
    pub avail_features: u64,
    /// Features the driver accepted.
    pub acked_features: u64,
    /// The device's virtqueues, configured by the transport.
    pub queues: Vec<Queue>,
    /// Guest memory, set at activation.
    pub mem: Option<GuestMemoryMmap>,
    /// Interrupt line, set at activation.
    pub interrupt: Option<Arc<IrqTrigger>>,
}

impl VirtioCommon {
    /// Common state for a device with queues of the given maximum sizes.
    /// Queue sizes must be powers of two no larger than 32768.
    pub fn new(avail_features: u64, queue_max_sizes: &[u16]) -> Self {
        let queues = queue_max_sizes
            .iter()
            .map(|&size| Queue::new(size).unwrap_or_else(|_| fallback_queue()))
            .collect();
        Self {
            avail_features,
            acked_features: 0,
            queues,
            mem: None,
            interrupt: None,
        }
    }

    /// True once [`VirtioDevice::activate`] succeeded.
    pub fn is_activated(&self) -> bool {
        self.mem.is_some()
    }

    /// Stores memory and interrupt after checking every queue is usable.
    pub fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<IrqTrigger>,
    ) -> Result<(), ActivateError> {
        for (i, queue) in self.queues.iter().enumerate() {
            if !queue.is_valid(&mem) {
                return Err(ActivateError::InvalidQueue(i));
            }
        }
        self.mem = Some(mem);
        self.interrupt = Some(interrupt);
        Ok(())
    }

    /// Back to the state before feature negotiation (device reset).
    pub fn reset(&mut self) {
        self.acked_features = 0;
        for queue in &mut self.queues {
            queue.reset();
        }
        self.mem = None;
        self.interrupt = None;
    }

    /// Signals a used-ring update to the guest if the queue wants one.
    pub fn signal_used(&mut self, queue_index: usize) {
        let (Some(mem), Some(interrupt)) = (&self.mem, &self.interrupt) else {
            return;
        };
        let Some(queue) = self.queues.get_mut(queue_index) else {
            return;
        };
        // A queue whose rings the guest made unreadable still gets the
        // interrupt: the driver is the one who broke it.
        if queue.needs_notification(mem).unwrap_or(true) {
            if let Err(e) = interrupt.trigger(VIRTIO_MMIO_INT_VRING) {
                // Every completed request comes here: said once.
                static SAID: Once = Once::new();
                SAID.call_once(|| {
                    eprintln!("tine-vmm: cannot interrupt the guest for a used ring: {e} (not said again)");
                });
            }
        }
    }

    /// Serves every available chain of queue `index` with `handle`, which
    /// returns how many bytes it wrote into the chain, then signals the
    /// guest once if anything completed. Follows the notification
    /// suppression protocol (ring re-checked after notifications are
    /// re-enabled, as EVENT_IDX requires) and stops on a ring it cannot
    /// read. Does nothing before activation. Returns the chains completed.
    pub fn process_chains<F>(&mut self, index: usize, mut handle: F) -> usize
    where
        F: FnMut(&GuestMemoryMmap, DescriptorChain<&GuestMemoryMmap>) -> u32,
    {
        let Some(mem) = self.mem.as_ref() else {
            return 0;
        };
        let Some(queue) = self.queues.get_mut(index) else {
            return 0;
        };
        let mut completed = 0;
        loop {
            if let Err(e) = queue.disable_notification(mem) {
                // Only a hint: the guest then notifies more than it needs.
                // It comes with every notification: said once.
                static SAID: Once = Once::new();
                SAID.call_once(|| {
                    eprintln!(
                        "tine-vmm: cannot turn a queue's notifications off: {e} (not said again)"
                    );
                });
            }
            let mut popped = false;
            while let Some(chain) = queue.pop_descriptor_chain(mem) {
                popped = true;
                let head = chain.head_index();
                let len = handle(mem, chain);
                // A head index beyond the queue cannot be returned; the
                // driver that offered it loses that entry.
                if queue.add_used(mem, head, len).is_ok() {
                    completed += 1;
                }
            }
            // More chains arrived while notifications were off: go again,
            // unless nothing could be popped (a broken available ring).
            match queue.enable_notification(mem) {
                Ok(true) if popped => continue,
                _ => break,
            }
        }
        if completed > 0 {
            self.signal_used(index);
        }
        completed
    }
}

fn fallback_queue() -> Queue {
    // 256 is always a valid size; only reached if a device declared an
    // invalid maximum, which its own unit tests catch.
    Queue::new(256).unwrap_or_else(|_| unreachable!("256 is a valid queue size"))
}

/// A device as its concrete type, for what only one kind of device does
/// (switching a block device's disk).
pub trait AsAny {
    /// `self` as [`std::any::Any`].
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

impl<T: std::any::Any> AsAny for T {
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// A virtio device as seen by the MMIO transport and the event loop.
pub trait VirtioDevice: AsAny + Send {
    /// The virtio device ID (see [`device_type`]).
    fn device_type(&self) -> u32;
    /// Shared state.
    fn common(&self) -> &VirtioCommon;
    /// Shared state, mutably.
    fn common_mut(&mut self) -> &mut VirtioCommon;
    /// Reads the device-specific configuration space. Reads past its end
    /// return zeros.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the device-specific configuration space. Writes outside the
    /// writable fields are ignored.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// The driver set DRIVER_OK: start serving the queues.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<IrqTrigger>,
    ) -> Result<(), ActivateError>;
    /// The guest notified queue `index`.
    fn process_queue(&mut self, index: usize);
    /// Host-side file descriptors the event loop should poll, with the
    /// epoll events wanted for each (e.g. a TAP device or sockets).
    fn host_fds(&self) -> Vec<(RawFd, u32)> {
        Vec::new()
    }
    /// `fd` from [`VirtioDevice::host_fds`] reported `events`.
    fn process_host_event(&mut self, _fd: RawFd, _events: u32) {}
    /// The driver wrote 0 to the status register.
    fn reset(&mut self);
    /// Captures the device's state for a snapshot. Called while the VM is
    /// paused.
    fn save(&self) -> VirtioDeviceState;
    /// Called once before [`VirtioDevice::save`] when a snapshot is taken,
    /// for devices that must tell the guest (vsock queues a transport reset).
    fn prepare_snapshot(&mut self) {}
}

/// Helpers for tests of virtio devices.
#[cfg(test)]
pub mod test_utils {
    use super::*;
    use vm_memory::{Address, GuestAddress};

    /// 16 MiB of guest memory at address 0.
    pub fn test_memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 << 20)]).expect("test memory")
    }

    /// Points `queue` at the rings of a mock queue and marks it ready.
    pub fn configure_queue(
        queue: &mut Queue,
        mock: &virtio_queue::mock::MockSplitQueue<'_, GuestMemoryMmap>,
    ) {
        let size = mock.desc_table().total_size() / 16;
        queue.set_size(size as u16);
        queue.set_desc_table_address(
            Some(mock.desc_table_addr().0 as u32),
            Some((mock.desc_table_addr().0 >> 32) as u32),
        );
        queue.set_avail_ring_address(
            Some(mock.avail_addr().0 as u32),
            Some((mock.avail_addr().0 >> 32) as u32),
        );
        queue.set_used_ring_address(
            Some(mock.used_addr().0 as u32),
            Some((mock.used_addr().0 >> 32) as u32),
        );
        queue.set_ready(true);
    }

    /// Writes `descs` (address, length, flags) at consecutive descriptor
    /// table indices from `head`, links them with NEXT, and offers the chain
    /// in the available ring.
    pub fn push_chain(
        mock: &virtio_queue::mock::MockSplitQueue<'_, GuestMemoryMmap>,
        head: u16,
        descs: &[(u64, u32, u16)],
    ) {
        use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_NEXT;
        use virtio_queue::desc::{split::Descriptor, RawDescriptor};
        for (i, &(addr, len, flags)) in descs.iter().enumerate() {
            let index = head + i as u16;
            let (flags, next) = if i + 1 < descs.len() {
                (flags | VRING_DESC_F_NEXT as u16, index + 1)
            } else {
                (flags, 0)
            };
            let desc = RawDescriptor::from(Descriptor::new(addr, len, flags, next));
            mock.desc_table()
                .store(index, desc)
                .expect("store descriptor");
        }
        offer(mock, head);
    }

    /// Offers descriptor `head` in the next available ring slot.
    pub fn offer(mock: &virtio_queue::mock::MockSplitQueue<'_, GuestMemoryMmap>, head: u16) {
        let idx = mock.avail().idx().load();
        let size = mock.desc_table().total_size() / 16;
        mock.avail()
            .ring()
            .ref_at(usize::from(idx) % size as usize)
            .expect("avail slot")
            .store(head);
        mock.avail().idx().store(idx.wrapping_add(1));
    }

    /// A small deterministic generator for randomized robustness tests.
    pub struct XorShift(pub u64);

    impl XorShift {
        /// The next 64 random bits.
        pub fn bits(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// A value below `bound` (which must not be 0).
        pub fn below(&mut self, bound: u64) -> u64 {
            self.bits() % bound
        }

        /// One of `choices`.
        pub fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
            choices[self.below(choices.len() as u64) as usize]
        }
    }

    /// Entry `slot` of the used ring as (descriptor id, length).
    pub fn used_elem(
        mem: &GuestMemoryMmap,
        mock: &virtio_queue::mock::MockSplitQueue<'_, GuestMemoryMmap>,
        slot: u16,
    ) -> (u32, u32) {
        use vm_memory::Bytes;
        let addr = GuestAddress(mock.used_addr().0 + 4 + 8 * u64::from(slot));
        let id: u32 = mem.read_obj(addr).expect("used id");
        let len: u32 = mem.read_obj(addr.unchecked_add(4)).expect("used len");
        (id, len)
    }
}
