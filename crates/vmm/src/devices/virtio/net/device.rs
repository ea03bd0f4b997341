//! The virtio-net device: config space, TX gathering and RX delivery.
//!
//! TX: each chain is read whole (header plus frame, at most
//! [`MAX_BUFFER_LEN`] bytes) into a host buffer and sent to the backend.
//! Malformed chains are completed with length 0 and dropped.
//!
//! RX: frames are read from the backend while the RX queue has buffers.
//! When it has none, the frame read last stays pending and reading stops
//! until the guest adds buffers and notifies the RX queue. A frame that does
//! not fit the next chain is dropped and the chain is left for the next
//! frame; a malformed chain is completed with length 0.
//!
//! The backend's descriptor is polled edge-triggered (`EPOLLET`): after an
//! edge the device reads until the backend would block, or until the guest
//! is out of buffers, in which case the guest's next RX notification resumes
//! reading.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

use super::{
    NetBackend, Tap, TapError, MAX_BUFFER_LEN, NET_QUEUE_SIZE, RX_QUEUE_INDEX, TX_QUEUE_INDEX,
    VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP, VNET_HDR_LEN,
    VNET_HDR_NUM_BUFFERS_OFFSET,
};
use crate::devices::virtio::persist::VirtioDeviceState;
use crate::devices::virtio::{
    device_type, ActivateError, IrqTrigger, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1,
};
use crate::snapshot::Persist;
use crate::vstate::memory::GuestMemoryMmap;

/// Features the device offers.
pub(super) const AVAIL_FEATURES: u64 = VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MAC | VIRTIO_NET_F_STATUS;

/// Length of the config space: `mac` (6 bytes) and `status` (le16).
const CONFIG_LEN: usize = 8;

/// Why a network device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The MAC address is all zeros or a multicast address.
    #[error("invalid MAC address {0:02x?}: must be unicast and non-zero")]
    InvalidMac([u8; 6]),
    /// The TAP interface could not be opened.
    #[error("cannot open the TAP backend")]
    Tap(#[from] TapError),
}

/// Counters of what the device did, for metrics and tests. Frames the
/// device drops are counted here rather than logged, since the guest (or
/// the host network) controls how often they happen.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetCounters {
    /// Frames sent to the backend.
    pub tx_frames: u64,
    /// Bytes sent to the backend (frames only, no headers).
    pub tx_bytes: u64,
    /// TX chains dropped as malformed.
    pub tx_malformed_chains: u64,
    /// TX frames the backend refused.
    pub tx_backend_errors: u64,
    /// Frames delivered to the guest.
    pub rx_frames: u64,
    /// Bytes delivered to the guest (frames only, no headers).
    pub rx_bytes: u64,
    /// Frames dropped because they did not fit the guest's buffer.
    pub rx_frames_too_large: u64,
    /// RX chains completed empty because they were malformed.
    pub rx_malformed_chains: u64,
    /// Reads from the backend that failed (other than would-block).
    pub rx_backend_errors: u64,
}

/// Why a descriptor chain was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
enum ChainError {
    /// A device-writable descriptor in a TX chain.
    #[error("device-writable descriptor in a TX chain")]
    WriteOnlyDescriptor,
    /// A device-readable descriptor in an RX chain.
    #[error("device-readable descriptor in an RX chain")]
    ReadOnlyDescriptor,
    /// The chain's buffers add up to more than the device handles.
    #[error("chain longer than {MAX_BUFFER_LEN} bytes")]
    TooLong,
    /// The chain is shorter than the virtio-net header.
    #[error("chain shorter than the {VNET_HDR_LEN}-byte header")]
    TooShort,
    /// A buffer lies outside guest memory.
    #[error("buffer outside guest memory")]
    OutsideMemory,
    /// The chain ended early: a loop, a `next` index past the table, an
    /// unreadable descriptor or an invalid indirect table.
    #[error("descriptor chain is truncated or loops")]
    Truncated,
}

/// What happened to one received frame.
enum RxOutcome {
    /// Written into a chain.
    Delivered,
    /// Dropped: larger than the next chain.
    Dropped,
    /// The RX queue has no buffers: the frame stays pending.
    NoBuffer,
}

/// A virtio-net device.
pub struct Net {
    common: VirtioCommon,
    backend: Box<dyn NetBackend>,
    mac: [u8; 6],
    /// Header and frame of the last frame read from the backend.
    rx_buf: Vec<u8>,
    /// Frame length in `rx_buf` of a frame not yet delivered to the guest.
    rx_pending: Option<usize>,
    /// Header and frame gathered from a TX chain.
    tx_buf: Vec<u8>,
    counters: NetCounters,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Leaves out the two 64 KiB frame buffers.
        f.debug_struct("Net")
            .field("common", &self.common)
            .field("backend", &self.backend)
            .field("mac", &self.mac)
            .field("rx_pending", &self.rx_pending)
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl Net {
    /// A device sending and receiving through `backend`, with the given
    /// MAC address in its config space.
    pub fn new(backend: Box<dyn NetBackend>, mac: [u8; 6]) -> Result<Self, NetError> {
        if mac == [0; 6] || mac[0] & 1 != 0 {
            return Err(NetError::InvalidMac(mac));
        }
        Ok(Self {
            common: VirtioCommon::new(AVAIL_FEATURES, &[NET_QUEUE_SIZE, NET_QUEUE_SIZE]),
            backend,
            mac,
            rx_buf: vec![0; MAX_BUFFER_LEN],
            rx_pending: None,
            tx_buf: vec![0; MAX_BUFFER_LEN],
            counters: NetCounters::default(),
        })
    }

    /// A device on the TAP interface `tap_name` (opened, or created if it
    /// does not exist; see [`Tap::open`]).
    pub fn with_tap(tap_name: &str, mac: [u8; 6]) -> Result<Self, NetError> {
        let tap = Tap::open(tap_name)?;
        Self::new(Box::new(tap), mac)
    }

    /// The MAC address.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// The backend's host interface name (empty if it has none).
    pub fn backend_name(&self) -> &str {
        self.backend.name()
    }

    /// What the device has sent, received and dropped so far.
    pub fn counters(&self) -> NetCounters {
        self.counters
    }

    /// Whether a received frame is waiting for an RX buffer.
    pub fn rx_pending(&self) -> bool {
        self.rx_pending.is_some()
    }

    /// Replaces the common state (restore). The device is not activated.
    pub(super) fn set_common(&mut self, common: VirtioCommon) {
        self.common = common;
    }

    fn config_space(&self) -> [u8; CONFIG_LEN] {
        let mut config = [0; CONFIG_LEN];
        config[..6].copy_from_slice(&self.mac);
        // The link follows the backend: a TAP is always "up" for the guest;
        // whether the host interface is up is the host's business.
        config[6..8].copy_from_slice(&VIRTIO_NET_S_LINK_UP.to_le_bytes());
        config
    }

    /// Sends every available TX chain to the backend.
    fn process_tx(&mut self) {
        let Self {
            common,
            backend,
            tx_buf,
            counters,
            ..
        } = self;
        let Some(mem) = common.mem.as_ref() else {
            return;
        };
        let Some(queue) = common.queues.get_mut(TX_QUEUE_INDEX) else {
            return;
        };
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            match gather_tx_chain(mem, chain, tx_buf) {
                Ok(len) => {
                    // No offloads are offered, so the guest's header asks
                    // nothing of the host: send a clean one.
                    let hdr = [0; VNET_HDR_LEN];
                    match backend.send(&hdr, &tx_buf[VNET_HDR_LEN..len]) {
                        Ok(sent) => {
                            counters.tx_frames += 1;
                            counters.tx_bytes += sent as u64;
                        }
                        Err(_) => counters.tx_backend_errors += 1,
                    }
                }
                Err(_) => counters.tx_malformed_chains += 1,
            }
            // A head index past the queue cannot be returned; the guest
            // loses that chain.
            if queue.add_used(mem, head, 0).is_ok() {
                used = true;
            }
        }
        if used {
            common.signal_used(TX_QUEUE_INDEX);
        }
    }

    /// Delivers the pending frame, then frames from the backend, until the
    /// backend would block or the RX queue runs out of buffers.
    fn process_rx(&mut self) {
        let Self {
            common,
            backend,
            rx_buf,
            rx_pending,
            counters,
            ..
        } = self;
        let Some(mem) = common.mem.as_ref() else {
            return;
        };
        let Some(queue) = common.queues.get_mut(RX_QUEUE_INDEX) else {
            return;
        };
        let mut used = false;
        loop {
            let frame_len = match *rx_pending {
                Some(len) => len,
                None => match read_frame(backend.as_mut(), rx_buf) {
                    Ok(Some(len)) => len,
                    Ok(None) => break,
                    Err(_) => {
                        counters.rx_backend_errors += 1;
                        break;
                    }
                },
            };
            *rx_pending = Some(frame_len);
            let buffer = &rx_buf[..VNET_HDR_LEN + frame_len];
            match deliver_rx_frame(mem, queue, buffer, counters, &mut used) {
                RxOutcome::Delivered => {
                    counters.rx_frames += 1;
                    counters.rx_bytes += frame_len as u64;
                    *rx_pending = None;
                }
                RxOutcome::Dropped => {
                    counters.rx_frames_too_large += 1;
                    *rx_pending = None;
                }
                RxOutcome::NoBuffer => break,
            }
        }
        if used {
            common.signal_used(RX_QUEUE_INDEX);
        }
    }
}

/// Maps the guest offload features the driver accepted to `TUN_F_*` flags:
/// what the TAP may hand over without full checksums or segmentation.
fn tap_offload_flags(acked_features: u64) -> u32 {
    use virtio_bindings::virtio_net::{
        VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_ECN, VIRTIO_NET_F_GUEST_TSO4,
        VIRTIO_NET_F_GUEST_TSO6, VIRTIO_NET_F_GUEST_UFO,
    };
    let has = |bit: u32| acked_features & (1 << bit) != 0;
    let mut flags = 0;
    if has(VIRTIO_NET_F_GUEST_CSUM) {
        flags |= libc::TUN_F_CSUM;
        if has(VIRTIO_NET_F_GUEST_TSO4) {
            flags |= libc::TUN_F_TSO4;
        }
        if has(VIRTIO_NET_F_GUEST_TSO6) {
            flags |= libc::TUN_F_TSO6;
        }
        if has(VIRTIO_NET_F_GUEST_ECN) {
            flags |= libc::TUN_F_TSO_ECN;
        }
        if has(VIRTIO_NET_F_GUEST_UFO) {
            flags |= libc::TUN_F_UFO;
        }
    }
    flags
}

/// Reads one frame from `backend` into `buf` (header first) and rewrites
/// its header for the guest. `Ok(None)` when no frame is waiting.
fn read_frame(backend: &mut dyn NetBackend, buf: &mut [u8]) -> io::Result<Option<usize>> {
    let (hdr, frame) = buf.split_at_mut(VNET_HDR_LEN);
    let hdr: &mut [u8; VNET_HDR_LEN] = hdr
        .try_into()
        .map_err(|_| io::Error::other("RX buffer shorter than the header"))?;
    let len = loop {
        match backend.recv(hdr, frame) {
            Ok(len) => break len,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) => return Err(e),
        }
    };
    // No guest offloads are negotiated, so nothing from the host's header
    // may reach the guest; one buffer per frame (no MRG_RXBUF).
    *hdr = [0; VNET_HDR_LEN];
    hdr[VNET_HDR_NUM_BUFFERS_OFFSET..].copy_from_slice(&1u16.to_le_bytes());
    Ok(Some(len.min(frame.len())))
}

/// Writes `buffer` (header and frame) into the next RX chain. Malformed
/// chains met on the way are completed empty; `used` is set whenever the
/// used ring changes.
fn deliver_rx_frame(
    mem: &GuestMemoryMmap,
    queue: &mut Queue,
    buffer: &[u8],
    counters: &mut NetCounters,
    used: &mut bool,
) -> RxOutcome {
    loop {
        let Some(chain) = queue.pop_descriptor_chain(mem) else {
            return RxOutcome::NoBuffer;
        };
        let head = chain.head_index();
        let result = rx_chain_buffers(mem, chain).and_then(|buffers| {
            let capacity = buffers
                .iter()
                .fold(0usize, |sum, &(_, len)| sum.saturating_add(len));
            if capacity < buffer.len() {
                return Ok(None);
            }
            scatter(mem, &buffers, buffer)?;
            Ok(Some(buffer.len()))
        });
        match result {
            Ok(Some(len)) => {
                // `len` is at most MAX_BUFFER_LEN, well within u32.
                if queue.add_used(mem, head, len as u32).is_ok() {
                    *used = true;
                }
                return RxOutcome::Delivered;
            }
            Ok(None) => {
                // Leave the chain for the next (smaller) frame.
                queue.go_to_previous_position();
                return RxOutcome::Dropped;
            }
            Err(_) => {
                counters.rx_malformed_chains += 1;
                if queue.add_used(mem, head, 0).is_ok() {
                    *used = true;
                }
            }
        }
    }
}

/// Reads a TX chain (header and frame) into `buf`, returning its length.
fn gather_tx_chain(
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
    buf: &mut [u8],
) -> Result<usize, ChainError> {
    let mut total = 0usize;
    let mut ended = false;
    for desc in chain {
        ended = !desc.has_next();
        if desc.is_write_only() {
            return Err(ChainError::WriteOnlyDescriptor);
        }
        let end = total
            .checked_add(desc.len() as usize)
            .filter(|&end| end <= buf.len())
            .ok_or(ChainError::TooLong)?;
        let dst = buf.get_mut(total..end).ok_or(ChainError::TooLong)?;
        mem.read_slice(dst, desc.addr())
            .map_err(|_| ChainError::OutsideMemory)?;
        total = end;
    }
    // The iterator stops silently on loops and bad links: the last
    // descriptor it gave must be the one that ends the chain.
    if !ended {
        return Err(ChainError::Truncated);
    }
    if total < VNET_HDR_LEN {
        return Err(ChainError::TooShort);
    }
    Ok(total)
}

/// The buffers of an RX chain, each checked to lie in guest memory.
fn rx_chain_buffers(
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
) -> Result<Vec<(GuestAddress, usize)>, ChainError> {
    let mut buffers = Vec::new();
    let mut capacity = 0usize;
    let mut ended = false;
    for desc in chain {
        ended = !desc.has_next();
        if !desc.is_write_only() {
            return Err(ChainError::ReadOnlyDescriptor);
        }
        let len = desc.len() as usize;
        if !mem.check_range(desc.addr(), len, Permissions::Write) {
            return Err(ChainError::OutsideMemory);
        }
        capacity = capacity.saturating_add(len);
        buffers.push((desc.addr(), len));
    }
    if !ended {
        return Err(ChainError::Truncated);
    }
    if capacity < VNET_HDR_LEN {
        return Err(ChainError::TooShort);
    }
    Ok(buffers)
}

/// Writes `data` across `buffers`, which hold at least `data.len()` bytes.
fn scatter(
    mem: &GuestMemoryMmap,
    buffers: &[(GuestAddress, usize)],
    data: &[u8],
) -> Result<(), ChainError> {
    let mut rest = data;
    for &(addr, len) in buffers {
        if rest.is_empty() {
            break;
        }
        let (now, later) = rest.split_at(len.min(rest.len()));
        mem.write_slice(now, addr)
            .map_err(|_| ChainError::OutsideMemory)?;
        rest = later;
    }
    Ok(())
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        device_type::NET
    }

    fn common(&self) -> &VirtioCommon {
        &self.common
    }

    fn common_mut(&mut self) -> &mut VirtioCommon {
        &mut self.common
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let config = self.config_space();
        let Some(src) = usize::try_from(offset)
            .ok()
            .and_then(|start| config.get(start..))
        else {
            return;
        };
        let len = src.len().min(data.len());
        data[..len].copy_from_slice(&src[..len]);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {
        // With VIRTIO_F_VERSION_1 the MAC is read-only and nothing else in
        // the config space is writable.
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<IrqTrigger>,
    ) -> Result<(), ActivateError> {
        self.backend
            .set_offload(tap_offload_flags(self.common.acked_features))
            .map_err(|e| ActivateError::Backend(format!("cannot set offloads: {e}")))?;
        self.common.activate(mem, interrupt)
    }

    fn process_queue(&mut self, index: usize) {
        match index {
            RX_QUEUE_INDEX => self.process_rx(),
            TX_QUEUE_INDEX => self.process_tx(),
            _ => {}
        }
    }

    /// The backend's descriptor, edge-triggered (`EPOLLIN | EPOLLET`): the
    /// event loop must register the events exactly as given.
    fn host_fds(&self) -> Vec<(RawFd, u32)> {
        if !self.common.is_activated() {
            return Vec::new();
        }
        vec![(
            self.backend.as_raw_fd(),
            (libc::EPOLLIN | libc::EPOLLET) as u32,
        )]
    }

    fn process_host_event(&mut self, fd: RawFd, _events: u32) {
        if fd == self.backend.as_raw_fd() {
            self.process_rx();
        }
    }

    fn reset(&mut self) {
        self.common.reset();
        self.rx_pending = None;
    }

    fn save(&self) -> VirtioDeviceState {
        VirtioDeviceState::Net(Persist::save(self))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixDatagram;

    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor as SplitDescriptor;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;

    use super::*;
    use crate::devices::virtio::net::test_utils::{
        activated_net, configure_queues, packet_socket, poll_until, set_link_up, socket_backend,
        tap_failure, test_frame, test_tap_name, SocketBackend, RX_RING, TEST_MAC, TX_RING,
    };
    use crate::devices::virtio::test_utils::{configure_queue, test_memory};
    use crate::devices::virtio::VIRTIO_MMIO_INT_VRING;

    const BUF: u64 = 0x10_0000;

    fn readable(addr: u64, len: u32) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, 0, 0))
    }

    fn writable(addr: u64, len: u32) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(
            addr,
            len,
            VRING_DESC_F_WRITE as u16,
            0,
        ))
    }

    /// `descs` as one chain starting at table index `first`.
    fn chain(descs: &[RawDescriptor], first: u16) -> Vec<RawDescriptor> {
        let last = descs.len() - 1;
        descs
            .iter()
            .enumerate()
            .map(|(i, &d)| {
                let d = SplitDescriptor::from(d);
                let (flags, next) = if i == last {
                    (d.flags() & !(VRING_DESC_F_NEXT as u16), 0)
                } else {
                    (d.flags() | VRING_DESC_F_NEXT as u16, first + i as u16 + 1)
                };
                RawDescriptor::from(SplitDescriptor::new(d.addr().0, d.len(), flags, next))
            })
            .collect()
    }

    fn add_chain(mock: &MockSplitQueue<'_, GuestMemoryMmap>, descs: &[RawDescriptor], first: u16) {
        mock.add_desc_chains(&chain(descs, first), first)
            .expect("add chain");
    }

    fn used_idx(mock: &MockSplitQueue<'_, GuestMemoryMmap>) -> u16 {
        mock.used().idx().load()
    }

    fn used_elem(mock: &MockSplitQueue<'_, GuestMemoryMmap>, i: usize) -> (u32, u32) {
        let elem = mock.used().ring().ref_at(i).expect("used elem").load();
        (elem.id(), elem.len())
    }

    fn recv_frame(peer: &UnixDatagram) -> Vec<u8> {
        let mut buf = vec![0; MAX_BUFFER_LEN];
        let len = peer.recv(&mut buf).expect("frame at the backend");
        buf.truncate(len);
        buf
    }

    fn expected_hdr() -> [u8; VNET_HDR_LEN] {
        let mut hdr = [0; VNET_HDR_LEN];
        hdr[VNET_HDR_NUM_BUFFERS_OFFSET] = 1;
        hdr
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn test_net_new_multicast_mac_invalid_mac() {
        let (backend, _peer) = socket_backend();

        let result = Net::new(Box::new(backend), [0x01, 0, 0, 0, 0, 1]);

        assert!(matches!(result, Err(NetError::InvalidMac(_))));
    }

    #[test]
    fn test_net_new_zero_mac_invalid_mac() {
        let (backend, _peer) = socket_backend();

        let result = Net::new(Box::new(backend), [0; 6]);

        assert!(matches!(result, Err(NetError::InvalidMac(_))));
    }

    #[test]
    fn test_net_new_offers_mac_status_version_1() {
        let (backend, _peer) = socket_backend();

        let net = Net::new(Box::new(backend), TEST_MAC).expect("net");

        assert_eq!(net.device_type(), device_type::NET);
        assert_eq!(net.common().avail_features, AVAIL_FEATURES);
        assert_eq!(net.common().queues.len(), 2);
        assert_eq!(net.common().queues[0].max_size(), NET_QUEUE_SIZE);
        assert_eq!(net.common().queues[1].max_size(), NET_QUEUE_SIZE);
    }

    #[test]
    fn test_net_read_config_whole_mac_and_link_up() {
        let (backend, _peer) = socket_backend();
        let net = Net::new(Box::new(backend), TEST_MAC).expect("net");
        let mut data = [0xff; CONFIG_LEN];

        net.read_config(0, &mut data);

        assert_eq!(&data[..6], &TEST_MAC);
        assert_eq!(u16::from_le_bytes([data[6], data[7]]), VIRTIO_NET_S_LINK_UP);
    }

    #[test]
    fn test_net_read_config_status_offset_link_up() {
        let (backend, _peer) = socket_backend();
        let net = Net::new(Box::new(backend), TEST_MAC).expect("net");
        let mut data = [0xff; 2];

        net.read_config(6, &mut data);

        assert_eq!(u16::from_le_bytes(data), VIRTIO_NET_S_LINK_UP);
    }

    #[test]
    fn test_net_read_config_past_end_zeros() {
        let (backend, _peer) = socket_backend();
        let net = Net::new(Box::new(backend), TEST_MAC).expect("net");
        let mut straddling = [0xff; 4];
        let mut beyond = [0xff; 4];

        net.read_config(6, &mut straddling);
        net.read_config(u64::MAX, &mut beyond);

        assert_eq!(straddling, [1, 0, 0, 0]);
        assert_eq!(beyond, [0; 4]);
    }

    #[test]
    fn test_net_write_config_mac_ignored() {
        let (backend, _peer) = socket_backend();
        let mut net = Net::new(Box::new(backend), TEST_MAC).expect("net");
        let mut data = [0; 6];

        net.write_config(0, &[0x02, 0, 0, 0, 0, 0x99]);
        net.read_config(0, &mut data);

        assert_eq!(data, TEST_MAC);
    }

    #[test]
    fn test_net_host_fds_before_activation_empty() {
        let (backend, _peer) = socket_backend();
        let net = Net::new(Box::new(backend), TEST_MAC).expect("net");

        assert!(net.host_fds().is_empty());
    }

    #[test]
    fn test_net_host_fds_activated_backend_fd_edge_triggered() {
        let mem = test_memory();
        let (net, _peer, _irq) = activated_net(&mem);

        let fds = net.host_fds();

        assert_eq!(fds.len(), 1);
        assert_eq!(fds[0].1, (libc::EPOLLIN | libc::EPOLLET) as u32);
    }

    #[test]
    fn test_net_activate_invalid_queue_fails() {
        let mem = test_memory();
        let (backend, _peer) = socket_backend();
        let mut net = Net::new(Box::new(backend), TEST_MAC).expect("net");
        let irq = Arc::new(IrqTrigger::new().expect("irq"));

        let result = net.activate(mem, irq);

        assert!(matches!(result, Err(ActivateError::InvalidQueue(0))));
    }

    #[test]
    fn test_net_tx_frame_reaches_backend_without_header() {
        let mem = test_memory();
        let (mut net, peer, irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        let frame = pattern(100);
        mem.write_slice(&[0x55; VNET_HDR_LEN], GuestAddress(BUF))
            .expect("hdr");
        mem.write_slice(&frame, GuestAddress(BUF + 0x1000))
            .expect("frame");
        add_chain(
            &txq,
            &[
                readable(BUF, VNET_HDR_LEN as u32),
                readable(BUF + 0x1000, frame.len() as u32),
            ],
            0,
        );

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(recv_frame(&peer), frame);
        assert_eq!(used_idx(&txq), 1);
        assert_eq!(used_elem(&txq, 0), (0, 0));
        assert_ne!(irq.status() & VIRTIO_MMIO_INT_VRING, 0);
        assert_eq!(net.counters().tx_frames, 1);
        assert_eq!(net.counters().tx_bytes, 100);
    }

    #[test]
    fn test_net_tx_header_and_frame_in_one_descriptor_frame_sent() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        let frame = pattern(60);
        mem.write_slice(&frame, GuestAddress(BUF + VNET_HDR_LEN as u64))
            .expect("frame");
        add_chain(&txq, &[readable(BUF, (VNET_HDR_LEN + 60) as u32)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(recv_frame(&peer), frame);
    }

    #[test]
    fn test_net_tx_several_chains_all_sent_in_order() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        mem.write_slice(&[1; 20], GuestAddress(BUF + 12))
            .expect("a");
        mem.write_slice(&[2; 30], GuestAddress(BUF + 0x1000 + 12))
            .expect("b");
        add_chain(&txq, &[readable(BUF, 32)], 0);
        add_chain(&txq, &[readable(BUF + 0x1000, 42)], 1);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(recv_frame(&peer), vec![1; 20]);
        assert_eq!(recv_frame(&peer), vec![2; 30]);
        assert_eq!(used_idx(&txq), 2);
    }

    #[test]
    fn test_net_tx_outside_guest_memory_dropped_and_completed() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(0xffff_ffff_0000, 64)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(used_idx(&txq), 1);
        assert_eq!(used_elem(&txq, 0), (0, 0));
        assert_eq!(net.counters().tx_malformed_chains, 1);
        assert!(peer.recv(&mut [0; 64]).is_err(), "nothing sent");
    }

    #[test]
    fn test_net_tx_straddling_end_of_memory_dropped() {
        let mem = test_memory();
        let (mut net, _peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable((16 << 20) - 32, 64)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(net.counters().tx_malformed_chains, 1);
        assert_eq!(used_idx(&txq), 1);
    }

    #[test]
    fn test_net_tx_write_only_descriptor_dropped() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(BUF, 12), writable(BUF + 0x1000, 64)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(net.counters().tx_malformed_chains, 1);
        assert_eq!(used_idx(&txq), 1);
        assert!(peer.recv(&mut [0; 64]).is_err(), "nothing sent");
    }

    #[test]
    fn test_net_tx_shorter_than_header_dropped() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(BUF, 11)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(net.counters().tx_malformed_chains, 1);
        assert_eq!(used_idx(&txq), 1);
        assert!(peer.recv(&mut [0; 64]).is_err(), "nothing sent");
    }

    #[test]
    fn test_net_tx_u32_max_length_dropped() {
        let mem = test_memory();
        let (mut net, _peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(BUF, 12), readable(BUF, u32::MAX)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(net.counters().tx_malformed_chains, 1);
        assert_eq!(used_idx(&txq), 1);
    }

    #[test]
    fn test_net_tx_frame_over_max_len_dropped() {
        let mem = test_memory();
        let (mut net, _peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(BUF, MAX_BUFFER_LEN as u32 + 1)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(net.counters().tx_malformed_chains, 1);
        assert_eq!(net.counters().tx_frames, 0);
    }

    #[test]
    fn test_net_tx_max_len_frame_sent() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(BUF, MAX_BUFFER_LEN as u32)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(recv_frame(&peer).len(), MAX_BUFFER_LEN - VNET_HDR_LEN);
    }

    #[test]
    fn test_net_tx_self_loop_dropped() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        let looped = SplitDescriptor::new(BUF, 16, VRING_DESC_F_NEXT as u16, 0);
        txq.add_desc_chains(&[RawDescriptor::from(looped)], 0)
            .expect("add chain");

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(net.counters().tx_malformed_chains, 1);
        assert_eq!(used_idx(&txq), 1);
        assert!(peer.recv(&mut [0; 64]).is_err(), "nothing sent");
    }

    #[test]
    fn test_net_tx_next_past_table_dropped() {
        let mem = test_memory();
        let (mut net, _peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        let dangling = SplitDescriptor::new(BUF, 64, VRING_DESC_F_NEXT as u16, 1000);
        txq.add_desc_chains(&[RawDescriptor::from(dangling)], 0)
            .expect("add chain");

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(net.counters().tx_malformed_chains, 1);
        assert_eq!(used_idx(&txq), 1);
    }

    #[test]
    fn test_net_tx_malformed_then_valid_valid_still_sent() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[writable(BUF, 64)], 0);
        mem.write_slice(&[7; 50], GuestAddress(BUF + 0x1000 + 12))
            .expect("frame");
        add_chain(&txq, &[readable(BUF + 0x1000, 62)], 1);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(recv_frame(&peer), vec![7; 50]);
        assert_eq!(used_idx(&txq), 2);
        assert_eq!(net.counters().tx_malformed_chains, 1);
    }

    #[test]
    fn test_net_tx_backend_error_chain_completed() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        drop(peer);
        add_chain(&txq, &[readable(BUF, 60)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(used_idx(&txq), 1);
        assert_eq!(net.counters().tx_backend_errors, 1);
    }

    #[test]
    fn test_net_tx_before_activation_nothing_consumed() {
        let mem = test_memory();
        let (backend, _peer) = socket_backend();
        let mut net = Net::new(Box::new(backend), TEST_MAC).expect("net");
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        configure_queue(&mut net.common_mut().queues[TX_QUEUE_INDEX], &txq);
        add_chain(&txq, &[readable(BUF, 60)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        assert_eq!(used_idx(&txq), 0);
    }

    #[test]
    fn test_net_rx_frame_lands_with_header_and_used_len() {
        let mem = test_memory();
        let (mut net, peer, irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(&rxq, &[writable(BUF, 1526)], 0);
        let frame = pattern(200);
        peer.send(&frame).expect("send");
        let fd = net.host_fds()[0].0;

        net.process_host_event(fd, libc::EPOLLIN as u32);

        let mut hdr = [0xff; VNET_HDR_LEN];
        mem.read_slice(&mut hdr, GuestAddress(BUF)).expect("hdr");
        let mut landed = vec![0; 200];
        mem.read_slice(&mut landed, GuestAddress(BUF + VNET_HDR_LEN as u64))
            .expect("frame");
        assert_eq!(hdr, expected_hdr());
        assert_eq!(landed, frame);
        assert_eq!(used_idx(&rxq), 1);
        assert_eq!(used_elem(&rxq, 0), (0, (VNET_HDR_LEN + 200) as u32));
        assert_ne!(irq.status() & VIRTIO_MMIO_INT_VRING, 0);
        assert!(!net.rx_pending());
    }

    #[test]
    fn test_net_rx_chain_of_small_buffers_frame_scattered() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(
            &rxq,
            &[
                writable(BUF, 10),
                writable(BUF + 0x1000, 10),
                writable(BUF + 0x2000, 100),
            ],
            0,
        );
        let frame = pattern(50);
        peer.send(&frame).expect("send");

        net.process_queue(RX_QUEUE_INDEX);

        let mut first = [0; 10];
        let mut second = [0; 10];
        let mut third = [0; 42];
        mem.read_slice(&mut first, GuestAddress(BUF)).expect("1");
        mem.read_slice(&mut second, GuestAddress(BUF + 0x1000))
            .expect("2");
        mem.read_slice(&mut third, GuestAddress(BUF + 0x2000))
            .expect("3");
        let mut landed = first.to_vec();
        landed.extend_from_slice(&second);
        landed.extend_from_slice(&third);
        let mut expected = expected_hdr().to_vec();
        expected.extend_from_slice(&frame);
        assert_eq!(landed, expected);
        assert_eq!(used_elem(&rxq, 0), (0, 62));
    }

    #[test]
    fn test_net_rx_no_buffers_frame_pending_then_delivered_after_notify() {
        let mem = test_memory();
        let (mut net, peer, irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        let fd = net.host_fds()[0].0;
        peer.send(&pattern(80)).expect("send first");
        peer.send(&pattern(90)).expect("send second");

        net.process_host_event(fd, libc::EPOLLIN as u32);

        assert!(net.rx_pending());
        assert_eq!(irq.status(), 0);
        // Reading stopped: the second frame is still in the backend.
        net.process_host_event(fd, libc::EPOLLIN as u32);
        assert!(net.rx_pending());

        add_chain(&rxq, &[writable(BUF, 1526)], 0);
        add_chain(&rxq, &[writable(BUF + 0x1000, 1526)], 1);
        net.process_queue(RX_QUEUE_INDEX);

        assert!(!net.rx_pending());
        assert_eq!(used_idx(&rxq), 2);
        assert_eq!(used_elem(&rxq, 0), (0, 92));
        assert_eq!(used_elem(&rxq, 1), (1, 102));
        assert_eq!(net.counters().rx_frames, 2);
    }

    #[test]
    fn test_net_rx_more_frames_than_buffers_rest_stays_queued() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(&rxq, &[writable(BUF, 1526)], 0);
        for _ in 0..3 {
            peer.send(&pattern(64)).expect("send");
        }

        net.process_queue(RX_QUEUE_INDEX);

        assert_eq!(used_idx(&rxq), 1);
        assert!(net.rx_pending());
        assert_eq!(net.counters().rx_frames, 1);
    }

    #[test]
    fn test_net_rx_frame_larger_than_buffer_dropped_chain_reused() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(&rxq, &[writable(BUF, 100)], 0);
        mem.write_slice(&[0xee; 200], GuestAddress(BUF + 100))
            .expect("canary");
        peer.send(&pattern(150)).expect("send big");
        peer.send(&pattern(40)).expect("send small");

        net.process_queue(RX_QUEUE_INDEX);

        let mut canary = [0; 200];
        mem.read_slice(&mut canary, GuestAddress(BUF + 100))
            .expect("canary");
        assert_eq!(canary, [0xee; 200], "nothing written past the chain");
        assert_eq!(net.counters().rx_frames_too_large, 1);
        assert_eq!(used_idx(&rxq), 1);
        assert_eq!(used_elem(&rxq, 0), (0, 52));
    }

    #[test]
    fn test_net_rx_read_only_descriptor_chain_completed_empty() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(&rxq, &[readable(BUF, 1526)], 0);
        add_chain(&rxq, &[writable(BUF + 0x1000, 1526)], 1);
        peer.send(&pattern(64)).expect("send");

        net.process_queue(RX_QUEUE_INDEX);

        assert_eq!(used_idx(&rxq), 2);
        assert_eq!(used_elem(&rxq, 0), (0, 0));
        assert_eq!(used_elem(&rxq, 1), (1, 76));
        assert_eq!(net.counters().rx_malformed_chains, 1);
    }

    #[test]
    fn test_net_rx_outside_guest_memory_chain_completed_empty() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(&rxq, &[writable(0xffff_ffff_0000, 1526)], 0);
        peer.send(&pattern(64)).expect("send");

        net.process_queue(RX_QUEUE_INDEX);

        assert_eq!(used_idx(&rxq), 1);
        assert_eq!(used_elem(&rxq, 0), (0, 0));
        assert!(net.rx_pending());
    }

    #[test]
    fn test_net_rx_u32_max_length_chain_completed_empty() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(&rxq, &[writable(BUF, u32::MAX)], 0);
        peer.send(&pattern(64)).expect("send");

        net.process_queue(RX_QUEUE_INDEX);

        assert_eq!(used_elem(&rxq, 0), (0, 0));
        assert_eq!(net.counters().rx_malformed_chains, 1);
    }

    #[test]
    fn test_net_rx_shorter_than_header_chain_completed_empty() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(&rxq, &[writable(BUF, 8)], 0);
        peer.send(&pattern(64)).expect("send");

        net.process_queue(RX_QUEUE_INDEX);

        assert_eq!(used_elem(&rxq, 0), (0, 0));
        assert_eq!(net.counters().rx_malformed_chains, 1);
    }

    #[test]
    fn test_net_rx_self_loop_chain_completed_empty() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        let looped =
            SplitDescriptor::new(BUF, 16, (VRING_DESC_F_NEXT | VRING_DESC_F_WRITE) as u16, 0);
        rxq.add_desc_chains(&[RawDescriptor::from(looped)], 0)
            .expect("add chain");
        peer.send(&pattern(64)).expect("send");

        net.process_queue(RX_QUEUE_INDEX);

        assert_eq!(used_elem(&rxq, 0), (0, 0));
        assert_eq!(net.counters().rx_malformed_chains, 1);
        assert!(net.rx_pending());
    }

    #[test]
    fn test_net_rx_host_header_not_passed_to_guest() {
        let mem = test_memory();
        let (backend, peer) = socket_backend();
        let backend = SocketBackend {
            rx_hdr: [0xaa; VNET_HDR_LEN],
            ..backend
        };
        let mut net = Net::new(Box::new(backend), TEST_MAC).expect("net");
        configure_queues(&mut net, &mem);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        net.activate(mem.clone(), Arc::new(IrqTrigger::new().expect("irq")))
            .expect("activate");
        add_chain(&rxq, &[writable(BUF, 1526)], 0);
        peer.send(&pattern(64)).expect("send");

        net.process_queue(RX_QUEUE_INDEX);

        let mut hdr = [0; VNET_HDR_LEN];
        mem.read_slice(&mut hdr, GuestAddress(BUF)).expect("hdr");
        assert_eq!(hdr, expected_hdr());
    }

    #[test]
    fn test_net_reset_pending_frame_discarded() {
        let mem = test_memory();
        let (mut net, peer, _irq) = activated_net(&mem);
        peer.send(&pattern(64)).expect("send");
        net.process_queue(RX_QUEUE_INDEX);
        assert!(net.rx_pending());

        net.reset();

        assert!(!net.rx_pending());
        assert!(!net.common().is_activated());
        assert!(net.host_fds().is_empty());
    }

    /// Pops the chain at the head of `mock`'s available ring.
    fn pop_chain<'a>(
        mem: &'a GuestMemoryMmap,
        mock: &MockSplitQueue<'_, GuestMemoryMmap>,
    ) -> DescriptorChain<&'a GuestMemoryMmap> {
        let mut queue: Queue = mock.create_queue().expect("queue");
        queue.pop_descriptor_chain(mem).expect("a chain")
    }

    #[test]
    fn test_gather_tx_chain_self_loop_truncated() {
        let mem = test_memory();
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        let looped = SplitDescriptor::new(BUF, 16, VRING_DESC_F_NEXT as u16, 0);
        txq.add_desc_chains(&[RawDescriptor::from(looped)], 0)
            .expect("add chain");
        let mut buf = vec![0; MAX_BUFFER_LEN];

        let result = gather_tx_chain(&mem, pop_chain(&mem, &txq), &mut buf);

        assert_eq!(result, Err(ChainError::Truncated));
    }

    #[test]
    fn test_gather_tx_chain_u32_max_length_too_long() {
        let mem = test_memory();
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(BUF, u32::MAX)], 0);
        let mut buf = vec![0; MAX_BUFFER_LEN];

        let result = gather_tx_chain(&mem, pop_chain(&mem, &txq), &mut buf);

        assert_eq!(result, Err(ChainError::TooLong));
    }

    #[test]
    fn test_gather_tx_chain_lengths_overflow_u32_truncated() {
        let mem = test_memory();
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(BUF, 12), readable(BUF, u32::MAX)], 0);
        let mut buf = vec![0; MAX_BUFFER_LEN];

        let result = gather_tx_chain(&mem, pop_chain(&mem, &txq), &mut buf);

        // virtio-queue ends the chain when its total passes u32::MAX.
        assert_eq!(result, Err(ChainError::Truncated));
    }

    #[test]
    fn test_gather_tx_chain_write_only_descriptor_rejected() {
        let mem = test_memory();
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(BUF, 12), writable(BUF + 0x1000, 64)], 0);
        let mut buf = vec![0; MAX_BUFFER_LEN];

        let result = gather_tx_chain(&mem, pop_chain(&mem, &txq), &mut buf);

        assert_eq!(result, Err(ChainError::WriteOnlyDescriptor));
    }

    #[test]
    fn test_gather_tx_chain_outside_memory_rejected() {
        let mem = test_memory();
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(0xffff_ffff_0000, 64)], 0);
        let mut buf = vec![0; MAX_BUFFER_LEN];

        let result = gather_tx_chain(&mem, pop_chain(&mem, &txq), &mut buf);

        assert_eq!(result, Err(ChainError::OutsideMemory));
    }

    #[test]
    fn test_gather_tx_chain_shorter_than_header_too_short() {
        let mem = test_memory();
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        add_chain(&txq, &[readable(BUF, 4), readable(BUF, 7)], 0);
        let mut buf = vec![0; MAX_BUFFER_LEN];

        let result = gather_tx_chain(&mem, pop_chain(&mem, &txq), &mut buf);

        assert_eq!(result, Err(ChainError::TooShort));
    }

    #[test]
    fn test_rx_chain_buffers_read_only_descriptor_rejected() {
        let mem = test_memory();
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(&rxq, &[writable(BUF, 64), readable(BUF + 0x1000, 64)], 0);

        let result = rx_chain_buffers(&mem, pop_chain(&mem, &rxq));

        assert_eq!(result, Err(ChainError::ReadOnlyDescriptor));
    }

    #[test]
    fn test_rx_chain_buffers_self_loop_truncated() {
        let mem = test_memory();
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        let flags = (VRING_DESC_F_NEXT | VRING_DESC_F_WRITE) as u16;
        let looped = SplitDescriptor::new(BUF, 16, flags, 0);
        rxq.add_desc_chains(&[RawDescriptor::from(looped)], 0)
            .expect("add chain");

        let result = rx_chain_buffers(&mem, pop_chain(&mem, &rxq));

        assert_eq!(result, Err(ChainError::Truncated));
    }

    #[test]
    fn test_rx_chain_buffers_u32_max_length_outside_memory() {
        let mem = test_memory();
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        add_chain(&rxq, &[writable(BUF, u32::MAX)], 0);

        let result = rx_chain_buffers(&mem, pop_chain(&mem, &rxq));

        assert_eq!(result, Err(ChainError::OutsideMemory));
    }

    /// An activated device on a new, up TAP interface `name`.
    fn tap_net(mem: &GuestMemoryMmap, name: &str) -> Net {
        let mut net =
            Net::with_tap(name, TEST_MAC).unwrap_or_else(|e| panic!("{}", tap_failure(name, &e)));
        configure_queues(&mut net, mem);
        net.activate(mem.clone(), Arc::new(IrqTrigger::new().expect("irq")))
            .expect("activate");
        set_link_up(name);
        net
    }

    #[test]
    fn test_net_tap_guest_tx_frame_reaches_host() {
        let mem = test_memory();
        let name = test_tap_name("j");
        let mut net = tap_net(&mem, &name);
        let txq = MockSplitQueue::create(&mem, TX_RING, NET_QUEUE_SIZE);
        let host = packet_socket(&name);
        let frame = test_frame(90, 0x11);
        mem.write_slice(&frame, GuestAddress(BUF + VNET_HDR_LEN as u64))
            .expect("frame");
        add_chain(&txq, &[readable(BUF, (VNET_HDR_LEN + 90) as u32)], 0);

        net.process_queue(TX_QUEUE_INDEX);

        let mut buf = vec![0; 2048];
        let received = poll_until(|| {
            let len = std::io::Read::read(&mut &host, &mut buf)?;
            Ok(Some(buf[..len].to_vec()))
        });
        assert_eq!(received, frame);
        assert_eq!(net.counters().tx_frames, 1);
    }

    #[test]
    fn test_net_tap_host_frame_lands_in_guest() {
        let mem = test_memory();
        let name = test_tap_name("k");
        let mut net = tap_net(&mem, &name);
        let rxq = MockSplitQueue::create(&mem, RX_RING, NET_QUEUE_SIZE);
        for i in 0..16u16 {
            add_chain(&rxq, &[writable(BUF + u64::from(i) * 0x1000, 2048)], i);
        }
        let host = packet_socket(&name);
        let frame = test_frame(100, 0x22);
        std::io::Write::write_all(&mut &host, &frame).expect("transmit on the TAP");

        // The kernel may send frames of its own (IPv6 ND) first: look for
        // ours among everything delivered.
        let landed = poll_until(|| {
            net.process_queue(RX_QUEUE_INDEX);
            let found = (0..used_idx(&rxq)).find_map(|i| {
                let (id, len) = used_elem(&rxq, usize::from(i));
                let mut buf = vec![0; len as usize];
                let addr = GuestAddress(BUF + u64::from(id) * 0x1000);
                mem.read_slice(&mut buf, addr).expect("used buffer");
                (buf.get(VNET_HDR_LEN..) == Some(&frame[..])).then_some(buf)
            });
            Ok(found)
        });

        assert_eq!(landed[..VNET_HDR_LEN], expected_hdr());
    }

    #[test]
    fn test_tap_offload_flags_no_offloads_zero() {
        assert_eq!(tap_offload_flags(AVAIL_FEATURES), 0);
    }

    #[test]
    fn test_tap_offload_flags_guest_csum_tso_mapped() {
        use virtio_bindings::virtio_net::{
            VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
        };
        let acked = (1 << VIRTIO_NET_F_GUEST_CSUM)
            | (1 << VIRTIO_NET_F_GUEST_TSO4)
            | (1 << VIRTIO_NET_F_GUEST_TSO6);

        assert_eq!(
            tap_offload_flags(acked),
            libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6
        );
    }

    #[test]
    fn test_tap_offload_flags_tso_without_csum_zero() {
        use virtio_bindings::virtio_net::VIRTIO_NET_F_GUEST_TSO4;

        assert_eq!(tap_offload_flags(1 << VIRTIO_NET_F_GUEST_TSO4), 0);
    }
}
