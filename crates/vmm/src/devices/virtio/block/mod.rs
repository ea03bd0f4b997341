//! virtio-blk, the block device (virtio spec 5.2).
//!
//! - [`backend`]: the [`BlockBackend`] trait disk formats implement, and
//!   [`RawFile`], a plain file or host block device.
//! - [`device`]: [`Block`], the virtio device that parses requests from its
//!   queue and serves them from a backend.
//! - [`persist`]: [`BlockState`] and restore.

pub mod backend;

pub use backend::{BlockBackend, RawFile};

/// Sector size of the virtio-blk protocol, whatever the disk's own.
pub const SECTOR_SIZE: u64 = 512;
/// Size of the request queue.
pub const BLOCK_QUEUE_SIZE: u16 = 256;
/// Length of the device ID string returned by GET_ID.
pub const SERIAL_LEN: usize = 20;

/// Feature bits (virtio spec 5.2.3).
pub mod features {
    /// `seg_max` in the configuration space is valid.
    pub const VIRTIO_BLK_F_SEG_MAX: u64 = 1 << 2;
    /// The device is read-only.
    pub const VIRTIO_BLK_F_RO: u64 = 1 << 5;
    /// The device supports the FLUSH request.
    pub const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
}

/// Request types (virtio spec 5.2.6).
pub mod request_type {
    /// Read.
    pub const VIRTIO_BLK_T_IN: u32 = 0;
    /// Write.
    pub const VIRTIO_BLK_T_OUT: u32 = 1;
    /// Flush the write cache.
    pub const VIRTIO_BLK_T_FLUSH: u32 = 4;
    /// Fetch the device ID string.
    pub const VIRTIO_BLK_T_GET_ID: u32 = 8;
}

/// Request status byte values (virtio spec 5.2.6).
pub mod status {
    /// Success.
    pub const VIRTIO_BLK_S_OK: u8 = 0;
    /// Device or driver error.
    pub const VIRTIO_BLK_S_IOERR: u8 = 1;
    /// Request not supported.
    pub const VIRTIO_BLK_S_UNSUPP: u8 = 2;
}
