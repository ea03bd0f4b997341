//! virtio-rng, the entropy device (virtio spec 5.4).
//!
//! One queue: the driver offers device-writable buffers and the device fills
//! them with bytes from the host's CSPRNG (`getrandom(2)`). Each request is
//! served up to [`MAX_BYTES_PER_REQUEST`]; the used length tells the driver
//! how much it got. A chain the device cannot write (no writable
//! descriptor, a buffer outside guest memory) completes with length 0.

use std::io::Write;
use std::sync::{Arc, Once};

use serde::{Deserialize, Serialize};
use virtio_queue::DescriptorChain;

use super::persist::{QueueRestoreError, VirtioCommonState, VirtioDeviceState};
use super::{
    device_type, ActivateError, IrqTrigger, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX,
};
use crate::snapshot::Persist;
use crate::vstate::memory::GuestMemoryMmap;

/// Size of the request queue.
pub const RNG_QUEUE_SIZE: u16 = 256;
/// Most bytes handed out for one request, however large its buffers.
pub const MAX_BYTES_PER_REQUEST: usize = 64 * 1024;

const REQUEST_QUEUE: usize = 0;

/// The virtio entropy device.
#[derive(Debug)]
pub struct Rng {
    common: VirtioCommon,
    buffer: Vec<u8>,
}

impl Default for Rng {
    fn default() -> Self {
        Self::new()
    }
}

impl Rng {
    /// A new, unactivated entropy device.
    pub fn new() -> Self {
        Self::with_common(VirtioCommon::new(
            VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX,
            &[RNG_QUEUE_SIZE],
        ))
    }

    fn with_common(common: VirtioCommon) -> Self {
        Self {
            common,
            buffer: vec![0; MAX_BYTES_PER_REQUEST],
        }
    }
}

/// Fills the writable part of `chain` with random bytes; returns how many
/// were written.
fn fill_chain(
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
    buffer: &mut [u8],
) -> u32 {
    let Ok(mut writer) = chain.writer(mem) else {
        return 0;
    };
    let len = writer.available_bytes().min(buffer.len());
    let Some(bytes) = buffer.get_mut(..len) else {
        return 0;
    };
    if len == 0 || getrandom::fill(bytes).is_err() {
        return 0;
    }
    // The writer only covers checked guest memory; a short write still
    // reports what reached the guest.
    if let Err(e) = writer.write_all(bytes) {
        // The guest asks at will: said once.
        static SAID: Once = Once::new();
        SAID.call_once(|| {
            eprintln!(
                "tine-vmm: virtio-rng: a buffer took part of its bytes: {e} (not said again)"
            );
        });
    }
    u32::try_from(writer.bytes_written()).unwrap_or(0)
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        device_type::RNG
    }

    fn common(&self) -> &VirtioCommon {
        &self.common
    }

    fn common_mut(&mut self) -> &mut VirtioCommon {
        &mut self.common
    }

    /// The entropy device has no configuration space.
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<IrqTrigger>,
    ) -> Result<(), ActivateError> {
        self.common.activate(mem, interrupt)
    }

    fn process_queue(&mut self, index: usize) {
        if index != REQUEST_QUEUE {
            return;
        }
        let buffer = &mut self.buffer;
        self.common
            .process_chains(index, |mem, chain| fill_chain(mem, chain, buffer));
    }

    fn reset(&mut self) {
        self.common.reset();
    }

    fn save(&self) -> VirtioDeviceState {
        VirtioDeviceState::Rng(<Self as Persist>::save(self))
    }
}

/// Snapshot state of [`Rng`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {
    /// Features, queues and activation.
    pub common: VirtioCommonState,
}

/// Host resources to rebuild an [`Rng`].
#[derive(Debug)]
pub struct RngConstructorArgs {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The interrupt line the device signals once re-activated; the
    /// transport shares it.
    pub interrupt: Arc<IrqTrigger>,
}

/// Why an [`Rng`] could not be restored.
#[derive(Debug, thiserror::Error)]
pub enum RngPersistError {
    /// A saved queue is invalid.
    #[error("cannot restore the entropy device's queues")]
    Queue(#[from] QueueRestoreError),
    /// The saved state has the wrong number of queues.
    #[error("entropy device state has {0} queues, expected 1")]
    QueueCount(usize),
    /// The device was active but its queues do not fit guest memory.
    #[error("cannot re-activate the entropy device")]
    Activate(#[from] ActivateError),
}

impl Persist for Rng {
    type State = RngState;
    type ConstructorArgs = RngConstructorArgs;
    type Error = RngPersistError;

    fn save(&self) -> Self::State {
        RngState {
            common: VirtioCommonState::save(&self.common),
        }
    }

    /// Rebuilds the device and, if it was active, re-activates it.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error> {
        if state.common.queues.len() != 1 {
            return Err(RngPersistError::QueueCount(state.common.queues.len()));
        }
        let mut common = state.common.restore()?;
        if state.common.activated {
            common.activate(args.mem, args.interrupt)?;
        }
        Ok(Self::with_common(common))
    }
}

#[cfg(test)]
mod tests {
    use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::QueueT;
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::devices::virtio::test_utils::{
        configure_queue, offer, push_chain, test_memory, used_elem,
    };
    use crate::devices::virtio::VIRTIO_MMIO_INT_VRING;

    const W: u16 = VRING_DESC_F_WRITE as u16;
    const QUEUE_ADDR: GuestAddress = GuestAddress(0x1_0000);
    const BUF: u64 = 0x10_0000;
    /// The mock lays its used ring over the tail of its available ring
    /// (it sizes the available ring in bytes, not entries); at 256 entries
    /// the overlap starts beyond anything these tests offer.
    const Q: u16 = RNG_QUEUE_SIZE;

    fn activated(mem: &GuestMemoryMmap, mock: &MockSplitQueue<'_, GuestMemoryMmap>) -> Rng {
        let mut rng = Rng::new();
        configure_queue(&mut rng.common.queues[0], mock);
        rng.activate(mem.clone(), Arc::new(IrqTrigger::new().expect("irq")))
            .expect("activate");
        rng
    }

    fn read_buf(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut data = vec![0; len];
        mem.read_slice(&mut data, GuestAddress(addr)).expect("read");
        data
    }

    fn irq(rng: &Rng) -> Arc<IrqTrigger> {
        rng.common.interrupt.clone().expect("interrupt")
    }

    #[test]
    fn test_rng_identity_type_features_and_queue() {
        let rng = Rng::new();
        assert_eq!(rng.device_type(), device_type::RNG);
        assert_eq!(
            rng.common().avail_features,
            VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX
        );
        assert_eq!(rng.common().queues.len(), 1);
        assert_eq!(rng.common().queues[0].max_size(), RNG_QUEUE_SIZE);
    }

    #[test]
    fn test_rng_config_space_reads_zero() {
        let mut rng = Rng::new();
        rng.write_config(0, &[1, 2, 3, 4]);
        let mut data = [0xffu8; 4];
        rng.read_config(0, &mut data);
        assert_eq!(data, [0; 4]);
    }

    #[test]
    fn test_rng_writable_chain_filled_and_completed() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        push_chain(&mock, 0, &[(BUF, 512, W), (BUF + 0x1000, 512, W)]);
        push_chain(&mock, 2, &[(BUF + 0x2000, 16, W)]);

        rng.process_queue(0);

        assert_eq!(mock.used().idx().load(), 2);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 1024));
        assert_eq!(used_elem(&mem, &mock, 1), (2, 16));
        assert_ne!(read_buf(&mem, BUF, 512), vec![0; 512]);
        assert_ne!(read_buf(&mem, BUF + 0x1000, 512), vec![0; 512]);
        assert_eq!(irq(&rng).status(), VIRTIO_MMIO_INT_VRING);
    }

    #[test]
    fn test_rng_large_request_capped_at_maximum() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        let len = 2 * MAX_BYTES_PER_REQUEST as u32;
        push_chain(&mock, 0, &[(BUF, len, W)]);

        rng.process_queue(0);

        assert_eq!(used_elem(&mem, &mock, 0), (0, MAX_BYTES_PER_REQUEST as u32));
        let rest = read_buf(&mem, BUF + MAX_BYTES_PER_REQUEST as u64, 4096);
        assert_eq!(rest, vec![0; 4096]);
    }

    #[test]
    fn test_rng_readable_only_chain_completes_empty() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        push_chain(&mock, 0, &[(BUF, 512, 0)]);

        rng.process_queue(0);

        assert_eq!(used_elem(&mem, &mock, 0), (0, 0));
        assert_eq!(read_buf(&mem, BUF, 512), vec![0; 512]);
    }

    #[test]
    fn test_rng_buffer_outside_memory_completes_empty() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        push_chain(&mock, 0, &[(BUF, 512, W), (1 << 40, 512, W)]);
        // Straddles the end of guest memory.
        push_chain(&mock, 2, &[((16 << 20) - 256, 512, W)]);
        push_chain(&mock, 3, &[(u64::MAX - 8, 512, W)]);

        rng.process_queue(0);

        assert_eq!(mock.used().idx().load(), 3);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 0));
        assert_eq!(used_elem(&mem, &mock, 1), (2, 0));
        assert_eq!(used_elem(&mem, &mock, 2), (3, 0));
        assert_eq!(read_buf(&mem, BUF, 512), vec![0; 512]);
    }

    #[test]
    fn test_rng_u32_max_length_completes_empty() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        push_chain(&mock, 0, &[(BUF, u32::MAX, W)]);
        push_chain(&mock, 1, &[(BUF, u32::MAX, W), (BUF, u32::MAX, W)]);

        rng.process_queue(0);

        assert_eq!(used_elem(&mem, &mock, 0), (0, 0));
        assert_eq!(used_elem(&mem, &mock, 1), (1, 0));
    }

    #[test]
    fn test_rng_self_looping_chain_bounded() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        let looping = Descriptor::new(BUF, 4096, W | VRING_DESC_F_NEXT as u16, 0);
        mock.desc_table()
            .store(0, RawDescriptor::from(looping))
            .expect("store");
        offer(&mock, 0);
        push_chain(&mock, 1, &[(BUF + 0x10000, 8, W)]);

        rng.process_queue(0);

        // Served (capped), then the next chain.
        assert_eq!(mock.used().idx().load(), 2);
        assert_eq!(used_elem(&mem, &mock, 0), (0, MAX_BYTES_PER_REQUEST as u32));
        assert_eq!(used_elem(&mem, &mock, 1), (1, 8));
    }

    #[test]
    fn test_rng_next_index_outside_table_bounded() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        let bad = Descriptor::new(BUF, 64, W | VRING_DESC_F_NEXT as u16, 0xffff);
        mock.desc_table()
            .store(0, RawDescriptor::from(bad))
            .expect("store");
        offer(&mock, 0);

        rng.process_queue(0);

        assert_eq!(used_elem(&mem, &mock, 0), (0, 64));
    }

    #[test]
    fn test_rng_head_index_outside_table_skipped() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        offer(&mock, Q + 44);
        push_chain(&mock, 0, &[(BUF, 8, W)]);

        rng.process_queue(0);

        assert_eq!(mock.used().idx().load(), 1);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 8));
        assert_eq!(rng.common.queues[0].next_avail(), 2);
    }

    #[test]
    fn test_rng_available_index_far_ahead_ignored() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        mock.avail().idx().store(1000);

        rng.process_queue(0);

        assert_eq!(mock.used().idx().load(), 0);
        assert_eq!(rng.common.queues[0].next_avail(), 0);
        assert_eq!(irq(&rng).status(), 0);
    }

    #[test]
    fn test_rng_notify_before_activation_ignored() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = Rng::new();
        configure_queue(&mut rng.common.queues[0], &mock);
        push_chain(&mock, 0, &[(BUF, 8, W)]);

        rng.process_queue(0);
        rng.process_queue(1);

        assert_eq!(mock.used().idx().load(), 0);
    }

    #[test]
    fn test_rng_event_idx_publishes_avail_event() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = Rng::new();
        configure_queue(&mut rng.common.queues[0], &mock);
        rng.common.queues[0].set_event_idx(true);
        rng.activate(mem.clone(), Arc::new(IrqTrigger::new().expect("irq")))
            .expect("activate");
        push_chain(&mock, 0, &[(BUF, 8, W)]);
        push_chain(&mock, 1, &[(BUF, 8, W)]);

        rng.process_queue(0);

        // avail_event sits after the used ring's entries.
        let avail_event: u16 = mem
            .read_obj(GuestAddress(mock.used_addr().0 + 4 + 8 * u64::from(Q)))
            .expect("avail_event");
        assert_eq!(avail_event, 2);
        // used_event is 0, crossed by the first completion: interrupt.
        assert_eq!(irq(&rng).status(), VIRTIO_MMIO_INT_VRING);
    }

    #[test]
    fn test_rng_reset_deactivates() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);

        rng.reset();
        push_chain(&mock, 0, &[(BUF, 8, W)]);
        rng.process_queue(0);

        assert!(!rng.common().is_activated());
        assert!(!rng.common().queues[0].ready());
        assert_eq!(mock.used().idx().load(), 0);
    }

    #[test]
    fn test_rng_save_restore_round_trip_equal() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let mut rng = activated(&mem, &mock);
        rng.common.acked_features = VIRTIO_F_VERSION_1;
        push_chain(&mock, 0, &[(BUF, 8, W)]);
        rng.process_queue(0);
        let state = <Rng as Persist>::save(&rng);
        let json = serde_json::to_string(&state).expect("serialize");
        let state: RngState = serde_json::from_str(&json).expect("deserialize");

        let interrupt = Arc::new(IrqTrigger::new().expect("irq"));
        let mut restored = Rng::restore(
            RngConstructorArgs {
                mem: mem.clone(),
                interrupt: interrupt.clone(),
            },
            &state,
        )
        .expect("restore");

        assert_eq!(<Rng as Persist>::save(&restored), state);
        assert_eq!(VirtioDevice::save(&restored), VirtioDeviceState::Rng(state));
        // The restored device carries on from where the old one stopped.
        push_chain(&mock, 1, &[(BUF + 0x1000, 8, W)]);
        restored.process_queue(0);
        assert_eq!(mock.used().idx().load(), 2);
        assert_eq!(used_elem(&mem, &mock, 1), (1, 8));
        assert_eq!(interrupt.status(), VIRTIO_MMIO_INT_VRING);
    }

    #[test]
    fn test_rng_restore_inactive_stays_inactive() {
        let state = <Rng as Persist>::save(&Rng::new());
        let restored = Rng::restore(
            RngConstructorArgs {
                mem: test_memory(),
                interrupt: Arc::new(IrqTrigger::new().expect("irq")),
            },
            &state,
        )
        .expect("restore");
        assert!(!restored.common().is_activated());
        assert_eq!(<Rng as Persist>::save(&restored), state);
    }

    #[test]
    fn test_rng_restore_invalid_queue_size_fails() {
        let mut state = <Rng as Persist>::save(&Rng::new());
        state.common.queues[0].size = 3;
        let result = Rng::restore(
            RngConstructorArgs {
                mem: test_memory(),
                interrupt: Arc::new(IrqTrigger::new().expect("irq")),
            },
            &state,
        );
        assert!(matches!(result, Err(RngPersistError::Queue(_))));
    }

    #[test]
    fn test_rng_restore_wrong_queue_count_fails() {
        let mut state = <Rng as Persist>::save(&Rng::new());
        state.common.queues.clear();
        let result = Rng::restore(
            RngConstructorArgs {
                mem: test_memory(),
                interrupt: Arc::new(IrqTrigger::new().expect("irq")),
            },
            &state,
        );
        assert!(matches!(result, Err(RngPersistError::QueueCount(0))));
    }

    #[test]
    fn test_rng_restore_active_queue_outside_memory_fails() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let rng = activated(&mem, &mock);
        let mut state = <Rng as Persist>::save(&rng);
        state.common.queues[0].used_ring = 1 << 40;
        let result = Rng::restore(
            RngConstructorArgs {
                mem,
                interrupt: Arc::new(IrqTrigger::new().expect("irq")),
            },
            &state,
        );
        assert!(matches!(result, Err(RngPersistError::Activate(_))));
    }
}
