//! Snapshot state shared by virtio devices: queues, common fields, and the
//! enum that gathers every device type's state.

use serde::{Deserialize, Serialize};
use virtio_queue::Queue;

use super::net::NetState;
use super::VirtioCommon;

/// A virtqueue's guest-visible state: sizes, ring addresses and indices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueState {
    /// Largest size the device allows.
    pub max_size: u16,
    /// Size the driver chose.
    pub size: u16,
    /// QueueReady.
    pub ready: bool,
    /// Descriptor table address.
    pub desc_table: u64,
    /// Available ring address.
    pub avail_ring: u64,
    /// Used ring address.
    pub used_ring: u64,
    /// Next available-ring index the device will read.
    pub next_avail: u16,
    /// Next used-ring index the device will write.
    pub next_used: u16,
    /// VIRTIO_RING_F_EVENT_IDX negotiated.
    pub event_idx_enabled: bool,
}

/// Why a queue could not be rebuilt from its state.
#[derive(Debug, thiserror::Error)]
#[error("invalid queue state: {0}")]
pub struct QueueRestoreError(String);

impl QueueState {
    /// Captures `queue`.
    pub fn save(queue: &Queue) -> Self {
        let state = queue.state();
        Self {
            max_size: state.max_size,
            size: state.size,
            ready: state.ready,
            desc_table: state.desc_table,
            avail_ring: state.avail_ring,
            used_ring: state.used_ring,
            next_avail: state.next_avail,
            next_used: state.next_used,
            event_idx_enabled: state.event_idx_enabled,
        }
    }

    /// Rebuilds a queue; sizes and alignment are validated again.
    pub fn restore(&self) -> Result<Queue, QueueRestoreError> {
        let state = virtio_queue::QueueState {
            max_size: self.max_size,
            size: self.size,
            ready: self.ready,
            desc_table: self.desc_table,
            avail_ring: self.avail_ring,
            used_ring: self.used_ring,
            next_avail: self.next_avail,
            next_used: self.next_used,
            event_idx_enabled: self.event_idx_enabled,
        };
        Queue::try_from(state).map_err(|e| QueueRestoreError(format!("{e:?}")))
    }
}

/// State of [`VirtioCommon`]. Memory and the interrupt line are host
/// resources and are supplied again at restore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioCommonState {
    /// Offered features.
    pub avail_features: u64,
    /// Accepted features.
    pub acked_features: u64,
    /// The queues.
    pub queues: Vec<QueueState>,
    /// Whether the device had been activated.
    pub activated: bool,
}

impl VirtioCommonState {
    /// Captures `common`.
    pub fn save(common: &VirtioCommon) -> Self {
        Self {
            avail_features: common.avail_features,
            acked_features: common.acked_features,
            queues: common.queues.iter().map(QueueState::save).collect(),
            activated: common.is_activated(),
        }
    }

    /// Rebuilds the common state, not yet activated: the caller activates it
    /// with memory and interrupt when `activated` is set.
    pub fn restore(&self) -> Result<VirtioCommon, QueueRestoreError> {
        let queues = self
            .queues
            .iter()
            .map(QueueState::restore)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(VirtioCommon {
            avail_features: self.avail_features,
            acked_features: self.acked_features,
            queues,
            mem: None,
            interrupt: None,
        })
    }
}

/// The state of any virtio device, tagged by type. Each variant's state
/// type is defined next to its device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum VirtioDeviceState {
    /// State of the stand-in devices used by unit tests.
    #[cfg(test)]
    Test,
    /// A network device.
    Net(NetState),
    /// A vsock device.
    Vsock(super::vsock::VsockState),
    /// The entropy device.
    Rng(super::rng::RngState),
    /// The block device.
    Block(super::block::BlockState),
}
