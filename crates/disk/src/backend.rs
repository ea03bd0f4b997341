//! [`BlockBackend`]: a disk as a block device sees it.
//!
//! The trait is byte-addressed and synchronous, on plain byte slices. A
//! format with its own metadata (qcow2) implements it over its file the
//! same way [`RawFile`](crate::RawFile) does over a plain one; the device
//! never sees the format.

use std::io;

/// A disk image as the block device sees it: `size()` bytes, read and
/// written at byte offsets.
///
/// Implementations reject any range that does not lie within `size()`
/// (the device checks too, but a backend must not trust its caller with
/// guest-derived offsets).
pub trait BlockBackend: Send + std::fmt::Debug {
    /// The disk's virtual size in bytes, fixed while the device exists.
    fn size(&self) -> u64;

    /// True when the disk must not be written.
    fn is_read_only(&self) -> bool;

    /// Fills `buf` from the disk at `offset`.
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// Writes `buf` to the disk at `offset`.
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;

    /// Makes every completed write durable.
    fn flush(&mut self) -> io::Result<()>;

    /// Whether [`BlockBackend::discard`] does anything.
    fn supports_discard(&self) -> bool {
        false
    }

    /// Tells the disk `len` bytes at `offset` are no longer needed (their
    /// contents become unspecified).
    fn discard(&mut self, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }

    /// Whether [`BlockBackend::write_zeroes`] does anything.
    fn supports_write_zeroes(&self) -> bool {
        false
    }

    /// Sets `len` bytes at `offset` to zero, deallocating them if `unmap`
    /// and the format can.
    fn write_zeroes(&mut self, _offset: u64, _len: u64, _unmap: bool) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// Checks that `len` bytes at `offset` lie within a disk of `size` bytes.
pub fn check_range(offset: u64, len: usize, size: u64) -> io::Result<()> {
    let end = u64::try_from(len)
        .ok()
        .and_then(|len| offset.checked_add(len));
    match end {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "access beyond the end of the disk",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_check_range_bounds() {
        assert!(check_range(0, 512, 512).is_ok());
        assert!(check_range(512, 0, 512).is_ok());
        assert!(check_range(1, 512, 512).is_err());
        assert!(check_range(u64::MAX, 1, u64::MAX).is_err());
    }
}
