//! virtio-vsock (device type 19) with a Unix-socket host side.
//!
//! The guest sees a standard virtio-vsock device: an RX queue for packets
//! toward it, a TX queue for its packets, an event queue, and its CID in
//! the configuration space. On the host, connections map onto Unix sockets
//! with Firecracker's "hybrid vsock" convention:
//! host clients connect to `uds_path` and write `CONNECT <port>\n`, and
//! guest connections to host port `P` go to `<uds_path>_P`.
//!
//! Layout:
//! - [`packet`]: the packet header and protocol constants;
//! - `connection`: one stream's state machine and flow control;
//! - `muxer`: the listener, the connection table and the RX scheduling;
//! - `device`: [`Vsock`], the [`VirtioDevice`](super::VirtioDevice);
//! - [`persist`]: snapshot state. A snapshot cannot carry host sockets, so
//!   [`Vsock`]'s `prepare_snapshot` closes them and queues a
//!   `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` that makes the guest drop its
//!   connections (its listeners survive).

mod connection;
mod device;
mod muxer;
pub mod packet;
pub mod persist;
#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use device::TransportResetState;
pub use device::Vsock;
pub use muxer::MAX_CONNECTIONS;
pub use persist::{VsockConstructorArgs, VsockPersistError, VsockState};

/// Index of the RX queue (device to guest).
pub const RXQ: usize = 0;
/// Index of the TX queue (guest to device).
pub const TXQ: usize = 1;
/// Index of the event queue.
pub const EVQ: usize = 2;
/// Size of each of the three queues.
pub const QUEUE_SIZE: u16 = 256;
/// Largest packet payload accepted from or sent to the guest.
pub const MAX_PKT_SIZE: usize = 64 * 1024;

/// Why a vsock device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The guest CID is reserved (0-2) or does not fit the 32-bit CID
    /// space guests use (`u32::MAX` is `VMADDR_CID_ANY`).
    #[error("invalid guest CID {0}: must be between 3 and {max}", max = u32::MAX - 1)]
    InvalidCid(u64),
    /// A stale socket at the listening path could not be removed.
    #[error("cannot remove stale socket {}", path.display())]
    RemoveStale {
        /// The socket path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Binding the listening socket failed.
    #[error("cannot listen on {}", path.display())]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The deadline timer could not be created.
    #[error("cannot create the vsock timer")]
    Timer(#[source] std::io::Error),
}
