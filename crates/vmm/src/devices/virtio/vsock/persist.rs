//! Snapshot state of the vsock device.
//!
//! Connections are not saved: host sockets cannot outlive the process, and
//! the vsock protocol does not survive lost packets. Instead
//! `prepare_snapshot` closes them and queues a transport-reset event, which
//! makes the guest drop its side; what is saved is the guest-visible device
//! (queues, CID), the listening path, the next host port (so a restored VM
//! does not hand out ports the guest may still associate with old
//! connections) and where the reset event stands.
//!
//! Restore builds a new device listening on the saved path or on
//! [`VsockConstructorArgs::uds_path`], not yet activated. When the caller
//! activates it (as for every restored device whose `activated` flag is
//! set), the device kicks the event queue: it delivers the reset event if it
//! was still pending, raises the used-ring interrupt in case the one for an
//! event written before the snapshot was lost, and replays the TX queue in
//! case a notification was. RX stays held back until the guest acknowledges
//! the reset by notifying the event queue.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::device::{TransportResetState, Vsock};
use super::VsockError;
use crate::devices::virtio::persist::{QueueRestoreError, VirtioCommonState};
use crate::snapshot::Persist;

/// Saved state of a [`Vsock`] device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    /// Features, queues and activation.
    pub common: VirtioCommonState,
    /// The guest's CID.
    pub guest_cid: u64,
    /// The path host clients connected to.
    pub uds_path: PathBuf,
    /// The next host port for host-initiated connections.
    pub next_local_port: u32,
    /// The transport-reset event.
    pub transport_reset: TransportResetState,
}

/// Host resources for restoring a [`Vsock`]. Guest memory and the
/// interrupt line are supplied at activation.
#[derive(Debug, Clone, Default)]
pub struct VsockConstructorArgs {
    /// Listen here instead of the saved path (for example when the
    /// snapshot is restored next to the VM it was taken from).
    pub uds_path: Option<PathBuf>,
}

/// Why a vsock device could not be restored.
#[derive(Debug, thiserror::Error)]
pub enum VsockPersistError {
    /// A saved queue is invalid.
    #[error("invalid vsock queue state")]
    Queue(#[from] QueueRestoreError),
    /// The state does not have the three vsock queues.
    #[error("vsock state has {0} queues instead of 3")]
    QueueCount(usize),
    /// The device could not be rebuilt (invalid CID, socket path).
    #[error("cannot rebuild the vsock device")]
    Device(#[from] VsockError),
}

impl Persist for Vsock {
    type State = VsockState;
    type ConstructorArgs = VsockConstructorArgs;
    type Error = VsockPersistError;

    fn save(&self) -> VsockState {
        VsockState {
            common: VirtioCommonState::save(&self.common),
            guest_cid: self.guest_cid,
            uds_path: self.muxer.uds_path().to_path_buf(),
            next_local_port: self.muxer.next_local_port(),
            transport_reset: self.reset_event,
        }
    }

    fn restore(args: VsockConstructorArgs, state: &VsockState) -> Result<Self, VsockPersistError> {
        if state.common.queues.len() != 3 {
            return Err(VsockPersistError::QueueCount(state.common.queues.len()));
        }
        let common = state.common.restore()?;
        let uds_path = args.uds_path.unwrap_or_else(|| state.uds_path.clone());
        let mut vsock = Vsock::build(state.guest_cid, uds_path, state.next_local_port)?;
        vsock.common = common;
        vsock.reset_event = state.transport_reset;
        if state.common.activated {
            if vsock.reset_event == TransportResetState::Idle {
                // Saved without `prepare_snapshot`: the guest still believes
                // in connections whose host sockets are gone.
                vsock.reset_event = TransportResetState::Pending;
            }
            vsock.kick_on_activate = true;
        }
        Ok(vsock)
    }
}
