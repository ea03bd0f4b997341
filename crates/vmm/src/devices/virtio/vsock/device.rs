//! [`Vsock`]: the virtio side of the device. It moves packets between the
//! virtqueues and the [`Muxer`], and handles the transport-reset event.
//!
//! Hostile-guest rules: every chain is read through virtio-queue's
//! `Reader`/`Writer`, which only build slices inside guest RAM; a TX chain
//! that is unreadable, shorter than a header, from a foreign CID or whose
//! `len` exceeds the chain or [`MAX_PKT_SIZE`] is completed and dropped (with
//! an RST for the stream it belonged to); an RX chain too short for a header
//! is completed with length 0.
//!
//! Event-loop contract: [`VirtioDevice::host_fds`] changes after every call
//! into the device (connections come and go, EPOLLOUT is wanted only while
//! bytes wait for a host socket, a socket that hung up is dropped from the
//! list because EPOLLHUP is level-triggered). The loop must re-sync its
//! registrations after each call, treating the list as the whole truth: a
//! closed fd's number can reappear for a new socket. Timeouts (handshake,
//! shutdown) are driven by a timerfd that is one of those fds.

use std::io::{Read, Write};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT, Reader, Writer};

use super::muxer::{Muxer, FIRST_LOCAL_PORT};
use super::packet::{PacketHeader, EVENT_SIZE, EVENT_TRANSPORT_RESET, HDR_SIZE};
use super::{VsockError, EVQ, MAX_PKT_SIZE, QUEUE_SIZE, RXQ, TXQ};
use crate::devices::virtio::persist::VirtioDeviceState;
use crate::devices::virtio::{
    device_type, ActivateError, IrqTrigger, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1,
    VIRTIO_MMIO_INT_VRING,
};
use crate::snapshot::Persist;
use crate::vstate::memory::GuestMemoryMmap;

/// Where the `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` event stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransportResetState {
    /// No reset in progress.
    Idle,
    /// A reset is due but the guest provided no event buffer yet.
    Pending,
    /// The event is in the used ring; RX waits for the guest to notify the
    /// event queue, which it does after handling it.
    Delivered,
}

/// A virtio-vsock device backed by Unix sockets.
#[derive(Debug)]
pub struct Vsock {
    pub(super) common: VirtioCommon,
    pub(super) guest_cid: u64,
    pub(super) muxer: Muxer,
    /// Progress of the transport-reset event. While it is not `Idle`, RX is
    /// held back so no packet of a new connection reaches the guest before
    /// it has dropped its old ones.
    pub(super) reset_event: TransportResetState,
    /// Restored from a snapshot: at activation, re-signal the guest and
    /// replay the queues (a notification or interrupt in flight when the
    /// snapshot was taken is lost).
    pub(super) kick_on_activate: bool,
    /// TX processing stopped because too many RSTs wait for RX buffers.
    tx_stalled: bool,
    /// Bounce buffer for TX payloads.
    tx_data: Vec<u8>,
}

impl Vsock {
    /// A device for a guest with CID `guest_cid`, listening for host
    /// clients on `uds_path` (a stale socket file there is replaced).
    pub fn new(guest_cid: u64, uds_path: PathBuf) -> Result<Self, VsockError> {
        Self::build(guest_cid, uds_path, FIRST_LOCAL_PORT)
    }

    pub(super) fn build(
        guest_cid: u64,
        uds_path: PathBuf,
        next_local_port: u32,
    ) -> Result<Self, VsockError> {
        if !(3..u64::from(u32::MAX)).contains(&guest_cid) {
            return Err(VsockError::InvalidCid(guest_cid));
        }
        Ok(Self {
            common: VirtioCommon::new(VIRTIO_F_VERSION_1, &[QUEUE_SIZE; 3]),
            guest_cid,
            muxer: Muxer::new(guest_cid, uds_path, next_local_port)?,
            reset_event: TransportResetState::Idle,
            kick_on_activate: false,
            tx_stalled: false,
            tx_data: vec![0; MAX_PKT_SIZE],
        })
    }

    /// The guest's CID.
    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    /// The path host clients connect to.
    pub fn uds_path(&self) -> &Path {
        self.muxer.uds_path()
    }

    /// See `Muxer::set_uds_path`.
    pub fn set_uds_path(&mut self, path: PathBuf) {
        self.muxer.set_uds_path(path);
    }

    /// Moves packets in both directions until no more progress is possible,
    /// then signals the guest.
    fn pump(&mut self, run_tx: bool) {
        let mut tx_used = run_tx && self.process_tx();
        let mut rx_used = false;
        loop {
            let progress = self.process_rx();
            rx_used |= progress;
            // TX paused on a full RST queue; RX just drained some of it.
            if !(self.tx_stalled && progress) {
                break;
            }
            tx_used |= self.process_tx();
        }
        if tx_used {
            self.common.signal_used(TXQ);
        }
        if rx_used {
            self.common.signal_used(RXQ);
        }
        self.muxer.sync_timer();
    }

    /// Consumes the TX queue. Returns whether a chain was completed.
    fn process_tx(&mut self) -> bool {
        let VirtioCommon { mem, queues, .. } = &mut self.common;
        let (Some(mem), Some(queue)) = (mem.as_ref(), queues.get_mut(TXQ)) else {
            return false;
        };
        self.tx_stalled = false;
        let mut used = false;
        loop {
            if self.muxer.rx_backlogged() {
                self.tx_stalled = true;
                break;
            }
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            handle_tx_chain(
                &mut self.muxer,
                &mut self.tx_data,
                self.guest_cid,
                mem,
                chain,
            );
            // TX buffers are only read: the used length is 0.
            complete_chain(queue, mem, head, 0);
            used = true;
        }
        used
    }

    /// Fills RX buffers with pending packets. Returns whether a chain was
    /// completed. Without RX buffers the packets stay pending for the next
    /// RX notification.
    fn process_rx(&mut self) -> bool {
        if self.reset_event != TransportResetState::Idle {
            return false;
        }
        let VirtioCommon { mem, queues, .. } = &mut self.common;
        let (Some(mem), Some(queue)) = (mem.as_ref(), queues.get_mut(RXQ)) else {
            return false;
        };
        let now = Instant::now();
        let mut used = false;
        while self.muxer.has_pending_rx() {
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let writer: Result<Writer<'_>, _> = Writer::new(mem, chain);
            let mut header = match writer {
                Ok(w) if w.available_bytes() >= HDR_SIZE => w,
                // Outside guest RAM, read-only, or too short: unusable.
                _ => {
                    complete_chain(queue, mem, head, 0);
                    used = true;
                    continue;
                }
            };
            let Ok(mut data) = header.split_at(HDR_SIZE) else {
                complete_chain(queue, mem, head, 0);
                used = true;
                continue;
            };
            let room = data.available_bytes();
            match self.muxer.recv_pkt(&mut header, &mut data, room, now) {
                Some(len) => {
                    complete_chain(queue, mem, head, len);
                    used = true;
                }
                None => {
                    // Nothing to send after all: give the buffer back.
                    queue.go_to_previous_position();
                    break;
                }
            }
        }
        used
    }

    /// Writes a pending transport-reset event into the event queue.
    fn deliver_reset_event(&mut self) {
        if self.reset_event != TransportResetState::Pending {
            return;
        }
        let VirtioCommon { mem, queues, .. } = &mut self.common;
        let (Some(mem), Some(queue)) = (mem.as_ref(), queues.get_mut(EVQ)) else {
            return;
        };
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let writer: Result<Writer<'_>, _> = Writer::new(mem, chain);
            let written = match writer {
                Ok(mut w) if w.available_bytes() >= EVENT_SIZE => {
                    w.write_all(&EVENT_TRANSPORT_RESET.to_le_bytes()).is_ok()
                }
                _ => false,
            };
            let len = if written { EVENT_SIZE as u32 } else { 0 };
            complete_chain(queue, mem, head, len);
            used = true;
            if written {
                self.reset_event = TransportResetState::Delivered;
                break;
            }
        }
        if used {
            self.common.signal_used(EVQ);
        }
    }
}

/// Puts chain `head` in `queue`'s used ring, `len` bytes written. A used
/// ring the guest made unwritable is its own problem, which it can make at
/// will: said once.
fn complete_chain(queue: &mut Queue, mem: &GuestMemoryMmap, head: u16, len: u32) {
    if let Err(e) = queue.add_used(mem, head, len) {
        static SAID: Once = Once::new();
        SAID.call_once(|| {
            eprintln!("tine-vmm: vsock: cannot return a chain to the guest: {e} (not said again)");
        });
    }
}

/// Parses one TX chain and hands the packet to the muxer.
fn handle_tx_chain(
    muxer: &mut Muxer,
    scratch: &mut [u8],
    guest_cid: u64,
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
) {
    let reader: Result<Reader<'_>, _> = Reader::new(mem, chain);
    let Ok(mut reader) = reader else {
        return;
    };
    let mut raw = [0u8; HDR_SIZE];
    if reader.available_bytes() < HDR_SIZE || reader.read_exact(&mut raw).is_err() {
        return;
    }
    let hdr = PacketHeader::from_bytes(&raw);
    if hdr.src_cid != guest_cid {
        // Spoofed source: not answered, since the RST would go to a CID
        // that is not this guest.
        return;
    }
    let len = hdr.len as usize;
    let data = match scratch.get_mut(..len) {
        Some(data) if len <= MAX_PKT_SIZE && len <= reader.available_bytes() => data,
        _ => {
            muxer.reject_pkt(&hdr);
            return;
        }
    };
    if reader.read_exact(data).is_err() {
        muxer.reject_pkt(&hdr);
        return;
    }
    muxer.send_pkt(&hdr, data, Instant::now());
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        device_type::VSOCK
    }

    fn common(&self) -> &VirtioCommon {
        &self.common
    }

    fn common_mut(&mut self) -> &mut VirtioCommon {
        &mut self.common
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.guest_cid.to_le_bytes();
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| config.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // The configuration space (the guest CID) is read-only.
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<IrqTrigger>,
    ) -> Result<(), ActivateError> {
        self.common.activate(mem, interrupt)?;
        if std::mem::take(&mut self.kick_on_activate) {
            // Restored: the reset event may still wait for a buffer, and the
            // interrupt for one written before the snapshot may be lost.
            self.deliver_reset_event();
            if let Some(interrupt) = &self.common.interrupt {
                if let Err(e) = interrupt.trigger(VIRTIO_MMIO_INT_VRING) {
                    eprintln!("tine-vmm: vsock: cannot interrupt the restored guest: {e}");
                }
            }
        }
        // Replay TX (a notification may have been lost) and deliver whatever
        // host clients queued before the driver was ready.
        self.pump(true);
        Ok(())
    }

    fn process_queue(&mut self, index: usize) {
        match index {
            RXQ => self.pump(false),
            TXQ => self.pump(true),
            EVQ => {
                match self.reset_event {
                    TransportResetState::Pending => self.deliver_reset_event(),
                    // The guest refilled the event queue after handling the
                    // reset: its old connections are gone, RX may resume.
                    TransportResetState::Delivered => self.reset_event = TransportResetState::Idle,
                    TransportResetState::Idle => {}
                }
                self.pump(false);
            }
            _ => {}
        }
    }

    fn host_fds(&self) -> Vec<(RawFd, u32)> {
        self.muxer.host_fds()
    }

    fn process_host_event(&mut self, fd: RawFd, events: u32) {
        self.muxer.handle_event(fd, events, Instant::now());
        self.pump(false);
    }

    fn reset(&mut self) {
        self.common.reset();
        self.muxer.reset();
        self.reset_event = TransportResetState::Idle;
        self.kick_on_activate = false;
        self.tx_stalled = false;
    }

    fn save(&self) -> VirtioDeviceState {
        VirtioDeviceState::Vsock(Persist::save(self))
    }

    fn prepare_snapshot(&mut self) {
        // Host sockets cannot be saved; close them, and have the guest drop
        // its side of every connection.
        self.muxer.reset();
        if self.common.is_activated() {
            if self.reset_event == TransportResetState::Idle {
                self.reset_event = TransportResetState::Pending;
            }
            // Without an event buffer now, the event stays pending (and is
            // saved as such) until the guest provides one.
            self.deliver_reset_event();
        }
    }
}
