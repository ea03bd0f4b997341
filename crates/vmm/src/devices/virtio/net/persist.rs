//! Snapshot state of the network device and restore-by-construction.
//!
//! The state holds what the guest can see: features, queues and the MAC.
//! The TAP is a host resource: a restored device gets a newly opened
//! backend, possibly on a differently named interface. A frame read from
//! the host but not yet delivered is not saved; to the guest it looks like
//! a frame lost on the wire.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::device::AVAIL_FEATURES;
use super::{Net, NetBackend, NetError, NET_QUEUE_SIZE};
use crate::devices::virtio::persist::{QueueRestoreError, VirtioCommonState};
use crate::devices::virtio::{ActivateError, IrqTrigger, VirtioDevice};
use crate::snapshot::Persist;
use crate::vstate::memory::GuestMemoryMmap;

/// The network device's snapshot state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    /// Features and queues.
    pub common: VirtioCommonState,
    /// The MAC address in the config space.
    pub mac: [u8; 6],
    /// The host interface the device used when saved (informational: the
    /// restored device uses whatever backend it is given).
    pub tap_name: String,
}

/// Host resources a restored network device needs.
#[derive(Debug)]
pub struct NetConstructorArgs {
    /// A newly opened backend (usually a [`super::Tap`]).
    pub backend: Box<dyn NetBackend>,
    /// Guest memory, used if the device was activated when saved.
    pub mem: GuestMemoryMmap,
    /// The device's interrupt line, used if it was activated when saved.
    pub interrupt: Arc<IrqTrigger>,
}

/// Why a network device could not be restored.
#[derive(Debug, thiserror::Error)]
pub enum NetPersistError {
    /// The saved state does not describe a network device's two queues.
    #[error("network device state has {0} queues, expected 2")]
    QueueCount(usize),
    /// A queue's saved maximum size is not the device's.
    #[error("network device queue has maximum size {0}, expected {NET_QUEUE_SIZE}")]
    QueueMaxSize(u16),
    /// The driver accepted features this device does not offer.
    #[error("network device state has unsupported features {0:#x}")]
    UnsupportedFeatures(u64),
    /// A queue could not be rebuilt.
    #[error("cannot restore a network device queue")]
    Queue(#[from] QueueRestoreError),
    /// The saved MAC address is invalid.
    #[error("cannot restore the network device")]
    Device(#[from] NetError),
    /// The restored device could not be activated.
    #[error("cannot activate the restored network device")]
    Activate(#[from] ActivateError),
}

impl Persist for Net {
    type State = NetState;
    type ConstructorArgs = NetConstructorArgs;
    type Error = NetPersistError;

    fn save(&self) -> NetState {
        NetState {
            common: VirtioCommonState::save(self.common()),
            mac: self.mac(),
            tap_name: self.backend_name().to_owned(),
        }
    }

    fn restore(args: NetConstructorArgs, state: &NetState) -> Result<Self, NetPersistError> {
        if state.common.queues.len() != 2 {
            return Err(NetPersistError::QueueCount(state.common.queues.len()));
        }
        if let Some(queue) = state
            .common
            .queues
            .iter()
            .find(|q| q.max_size != NET_QUEUE_SIZE)
        {
            return Err(NetPersistError::QueueMaxSize(queue.max_size));
        }
        let unsupported = state.common.acked_features & !AVAIL_FEATURES;
        if unsupported != 0 {
            return Err(NetPersistError::UnsupportedFeatures(unsupported));
        }
        let mut net = Net::new(args.backend, state.mac)?;
        let mut common = state.common.restore()?;
        // Offer what this build supports, whatever the saving build did.
        common.avail_features = AVAIL_FEATURES;
        net.set_common(common);
        if state.common.activated {
            // Also applies the negotiated offloads to the new backend.
            net.activate(args.mem, args.interrupt)?;
        }
        Ok(net)
    }
}

#[cfg(test)]
mod tests {
    use virtio_queue::desc::split::Descriptor as SplitDescriptor;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::QueueT;
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::devices::virtio::net::test_utils::{
        activated_net, socket_backend, RX_RING, TEST_MAC, TX_RING,
    };
    use crate::devices::virtio::net::{RX_QUEUE_INDEX, TX_QUEUE_INDEX};
    use crate::devices::virtio::persist::VirtioDeviceState;
    use crate::devices::virtio::test_utils::test_memory;

    const BUF: u64 = 0x10_0000;

    fn args(mem: &GuestMemoryMmap) -> (NetConstructorArgs, std::os::unix::net::UnixDatagram) {
        let (backend, peer) = socket_backend();
        let args = NetConstructorArgs {
            backend: Box::new(backend),
            mem: mem.clone(),
            interrupt: Arc::new(IrqTrigger::new().expect("irq")),
        };
        (args, peer)
    }

    /// An activated device that has sent one frame and received one.
    fn used_net(mem: &GuestMemoryMmap) -> Net {
        let txq = MockSplitQueue::create(mem, TX_RING, NET_QUEUE_SIZE);
        let rxq = MockSplitQueue::create(mem, RX_RING, NET_QUEUE_SIZE);
        used_net_on(mem, &txq, &rxq)
    }

    /// [`used_net`] on rings the caller keeps using.
    fn used_net_on(
        mem: &GuestMemoryMmap,
        txq: &MockSplitQueue<'_, GuestMemoryMmap>,
        rxq: &MockSplitQueue<'_, GuestMemoryMmap>,
    ) -> Net {
        let (mut net, peer, _irq) = activated_net(mem);
        let tx = SplitDescriptor::new(BUF, 60, 0, 0);
        txq.add_desc_chains(&[RawDescriptor::from(tx)], 0)
            .expect("tx chain");
        let rx = SplitDescriptor::new(BUF + 0x1000, 1526, 2, 0);
        rxq.add_desc_chains(&[RawDescriptor::from(rx)], 0)
            .expect("rx chain");
        peer.send(&[0x33; 64]).expect("send");
        net.process_queue(TX_QUEUE_INDEX);
        net.process_queue(RX_QUEUE_INDEX);
        net
    }

    #[test]
    fn test_net_persist_round_trip_same_state() {
        let mem = test_memory();
        let net = used_net(&mem);
        let state = Persist::save(&net);
        let bytes = serde_json::to_vec(&state).expect("serialize");
        let decoded: NetState = serde_json::from_slice(&bytes).expect("deserialize");
        let (args, _peer) = args(&mem);

        let restored = Net::restore(args, &decoded).expect("restore");

        assert_eq!(Persist::save(&restored), state);
        assert_eq!(state.common.acked_features, AVAIL_FEATURES);
        assert_eq!(state.mac, TEST_MAC);
        assert_eq!(state.common.queues[TX_QUEUE_INDEX].next_avail, 1);
        assert_eq!(state.common.queues[RX_QUEUE_INDEX].next_used, 1);
    }

    #[test]
    fn test_net_persist_restored_activated_device_sends() {
        let mem = test_memory();
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        let state = Persist::save(&used_net_on(&mem, &txq, &rxq));
        let (args, peer) = args(&mem);
        let mut restored = Net::restore(args, &state).expect("restore");
        mem.write_slice(&[9; 40], GuestAddress(BUF + 0x2000 + 12))
            .expect("frame");
        let tx = SplitDescriptor::new(BUF + 0x2000, 52, 0, 0);
        txq.add_desc_chains(&[RawDescriptor::from(tx)], 1)
            .expect("tx chain");

        restored.process_queue(TX_QUEUE_INDEX);

        let mut frame = [0; 64];
        let len = peer.recv(&mut frame).expect("frame after restore");
        assert_eq!(&frame[..len], &[9; 40]);
        assert!(restored.common().is_activated());
        assert_eq!(restored.common().queues[TX_QUEUE_INDEX].next_used(), 2);
    }

    #[test]
    fn test_net_persist_not_activated_restored_not_activated() {
        let mem = test_memory();
        let (backend, _peer) = socket_backend();
        let net = Net::new(Box::new(backend), TEST_MAC).expect("net");
        let state = Persist::save(&net);
        let (args, _peer2) = args(&mem);

        let restored = Net::restore(args, &state).expect("restore");

        assert!(!restored.common().is_activated());
        assert_eq!(Persist::save(&restored), state);
    }

    #[test]
    fn test_net_save_virtio_device_state_net_variant() {
        let mem = test_memory();
        let net = used_net(&mem);

        let state = VirtioDevice::save(&net);

        assert_eq!(state, VirtioDeviceState::Net(Persist::save(&net)));
    }

    #[test]
    fn test_net_persist_wrong_queue_count_fails() {
        let mem = test_memory();
        let mut state = Persist::save(&used_net(&mem));
        state.common.queues.pop();
        let (args, _peer) = args(&mem);

        let result = Net::restore(args, &state);

        assert!(matches!(result, Err(NetPersistError::QueueCount(1))));
    }

    #[test]
    fn test_net_persist_wrong_queue_max_size_fails() {
        let mem = test_memory();
        let mut state = Persist::save(&used_net(&mem));
        state.common.queues[0].max_size = 1024;
        let (args, _peer) = args(&mem);

        let result = Net::restore(args, &state);

        assert!(matches!(result, Err(NetPersistError::QueueMaxSize(1024))));
    }

    #[test]
    fn test_net_persist_unoffered_feature_acked_fails() {
        let mem = test_memory();
        let mut state = Persist::save(&used_net(&mem));
        state.common.acked_features |= 1 << 11;
        let (args, _peer) = args(&mem);

        let result = Net::restore(args, &state);

        assert!(matches!(
            result,
            Err(NetPersistError::UnsupportedFeatures(0x800))
        ));
    }

    #[test]
    fn test_net_persist_multicast_mac_fails() {
        let mem = test_memory();
        let mut state = Persist::save(&used_net(&mem));
        state.mac[0] |= 1;
        let (args, _peer) = args(&mem);

        let result = Net::restore(args, &state);

        assert!(matches!(result, Err(NetPersistError::Device(_))));
    }

    #[test]
    fn test_net_persist_rings_outside_memory_fails() {
        let mem = test_memory();
        let mut state = Persist::save(&used_net(&mem));
        state.common.queues[0].desc_table = 0xffff_0000_0000;
        let (args, _peer) = args(&mem);

        let result = Net::restore(args, &state);

        assert!(matches!(result, Err(NetPersistError::Activate(_))));
    }
}
