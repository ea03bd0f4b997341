//! virtio-blk, the block device (virtio spec 5.2).
//!
//! Disks themselves (the [`tine_disk::BlockBackend`] trait, raw and qcow2
//! images) live in the `tine-disk` crate.
//!
//! - [`device`]: [`Block`], the virtio device that parses requests from its
//!   queue and serves them from a backend.
//! - [`persist`]: [`BlockState`] and restore.

pub mod device;
pub mod persist;

pub use device::DiskIdentity;
pub use device::{Block, BlockConfig, BlockError};
pub use persist::{BlockConstructorArgs, BlockPersistError, BlockState};

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

/// Helpers for block device tests.
#[cfg(test)]
pub(crate) mod test_utils {
    use std::io;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use tine_disk::{check_range, BlockBackend};

    /// The byte a pattern-filled disk holds at `offset`.
    pub fn pattern(offset: usize) -> u8 {
        (offset % 251) as u8
    }

    /// An in-memory disk whose contents, failures and flushes the test
    /// controls and inspects through shared handles.
    #[derive(Debug, Clone, Default)]
    pub struct MemDisk {
        pub data: Arc<Mutex<Vec<u8>>>,
        pub read_only: bool,
        pub fail: Arc<AtomicBool>,
        pub flushes: Arc<AtomicUsize>,
    }

    impl MemDisk {
        /// A disk of `size` bytes filled with [`pattern`].
        pub fn with_pattern(size: usize) -> Self {
            Self {
                data: Arc::new(Mutex::new((0..size).map(pattern).collect())),
                ..Self::default()
            }
        }

        /// A copy of the contents.
        pub fn contents(&self) -> Vec<u8> {
            self.data.lock().expect("lock").clone()
        }

        fn check(&self, offset: u64, len: usize) -> io::Result<usize> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(io::Error::other("injected failure"));
            }
            check_range(offset, len, self.size())?;
            usize::try_from(offset).map_err(io::Error::other)
        }
    }

    impl BlockBackend for MemDisk {
        fn size(&self) -> u64 {
            self.data.lock().expect("lock").len() as u64
        }
        fn is_read_only(&self) -> bool {
            self.read_only
        }
        fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            let start = self.check(offset, buf.len())?;
            buf.copy_from_slice(&self.data.lock().expect("lock")[start..start + buf.len()]);
            Ok(())
        }
        fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
            let start = self.check(offset, buf.len())?;
            self.data.lock().expect("lock")[start..start + buf.len()].copy_from_slice(buf);
            Ok(())
        }
        fn flush(&mut self) -> io::Result<()> {
            self.check(0, 0)?;
            self.flushes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }
}
