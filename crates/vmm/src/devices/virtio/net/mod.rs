//! Virtio network device (virtio spec 5.1) backed by a host TAP interface.
//!
//! The device has one RX queue (host to guest) and one TX queue (guest to
//! host). Every buffer starts with a 12-byte `virtio_net_hdr_v1`. It offers
//! only `VIRTIO_NET_F_MAC` and `VIRTIO_NET_F_STATUS` (plus
//! `VIRTIO_F_VERSION_1`): no checksum or segmentation offloads and no
//! mergeable RX buffers, so every RX chain carries one whole frame and the
//! guest's headers carry nothing the host needs.
//!
//! The host side is a [`NetBackend`]: in production a [`Tap`], in unit
//! tests a datagram socket pair.
//!
//! - [`device`]: the [`Net`] device and its queue handling.
//! - [`tap`]: the TAP interface (`/dev/net/tun`).
//! - [`persist`]: [`NetState`] and restore-by-construction.

pub mod device;
pub mod persist;
pub mod tap;
#[cfg(test)]
pub mod test_utils;

use std::io;
use std::os::fd::RawFd;

pub use device::{Net, NetCounters, NetError};
pub use persist::{NetConstructorArgs, NetPersistError, NetState};
pub use tap::{Tap, TapError};

/// Size of each of the two queues.
pub const NET_QUEUE_SIZE: u16 = 256;
/// Index of the receive queue.
pub const RX_QUEUE_INDEX: usize = 0;
/// Index of the transmit queue.
pub const TX_QUEUE_INDEX: usize = 1;

/// Length of `virtio_net_hdr_v1`, the header in front of every frame (and
/// the header size the TAP is configured with).
pub const VNET_HDR_LEN: usize = 12;
/// Offset of `num_buffers` (little-endian u16) in `virtio_net_hdr_v1`.
const VNET_HDR_NUM_BUFFERS_OFFSET: usize = 10;
/// Largest Ethernet frame handled in either direction: a 64 KiB payload
/// plus the 14-byte Ethernet header.
pub const MAX_FRAME_LEN: usize = 65550;
/// Largest buffer (header plus frame) handled in either direction: longer
/// TX chains are dropped.
pub const MAX_BUFFER_LEN: usize = VNET_HDR_LEN + MAX_FRAME_LEN;

/// Feature bit: the device has a MAC address in its config space.
pub const VIRTIO_NET_F_MAC: u64 = 1 << virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
/// Feature bit: the config space has a link status field.
pub const VIRTIO_NET_F_STATUS: u64 = 1 << virtio_bindings::virtio_net::VIRTIO_NET_F_STATUS;
/// Link status bit in the config space: the link is up.
pub const VIRTIO_NET_S_LINK_UP: u16 = virtio_bindings::virtio_net::VIRTIO_NET_S_LINK_UP as u16;

/// The host side of a network device: something that exchanges Ethernet
/// frames, each with a `virtio_net_hdr_v1`.
///
/// Implementations are non-blocking: `recv` returns
/// [`io::ErrorKind::WouldBlock`] when no frame is waiting.
pub trait NetBackend: Send + std::fmt::Debug {
    /// Reads one frame: its header into `hdr` (zeros for backends without
    /// one) and the Ethernet frame into `frame`. Returns the frame's length.
    /// A frame longer than `frame` may be truncated.
    fn recv(&mut self, hdr: &mut [u8; VNET_HDR_LEN], frame: &mut [u8]) -> io::Result<usize>;
    /// Writes one frame with its header. Returns the frame's length (header
    /// excluded) once the whole frame was written.
    fn send(&mut self, hdr: &[u8; VNET_HDR_LEN], frame: &[u8]) -> io::Result<usize>;
    /// The file descriptor that becomes readable when a frame is waiting.
    fn as_raw_fd(&self) -> RawFd;
    /// Enables the TAP offloads in `flags` (`TUN_F_*`), matching the
    /// features the driver accepted. Backends without offloads ignore it.
    fn set_offload(&mut self, _flags: u32) -> io::Result<()> {
        Ok(())
    }
    /// The host interface's name, recorded in snapshots; empty if none.
    fn name(&self) -> &str;
}
