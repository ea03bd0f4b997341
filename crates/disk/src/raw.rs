//! Raw disks: sector `n` at byte `512 * n` of a file or host block device.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::backend::{check_range, BlockBackend};
use crate::qcow2;

/// A raw disk image: a regular file or a host block device, sector `n` at
/// byte `512 * n`.
#[derive(Debug)]
pub struct RawFile {
    file: File,
    read_only: bool,
    size: u64,
}

impl RawFile {
    /// Opens `path` (read-only if `read_only`), close-on-exec so it never
    /// leaks into child processes.
    pub fn open(path: &Path, read_only: bool) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)?;
        Self::from_file(file, read_only)
    }

    /// Wraps an already open file (e.g. one passed in by the daemon). Its
    /// size is taken now; `read_only` must match how it was opened.
    pub fn from_file(mut file: File, read_only: bool) -> io::Result<Self> {
        // Seeking works for block devices too, whose metadata length is 0.
        let size = file.seek(SeekFrom::End(0))?;
        Ok(Self {
            file,
            read_only,
            size,
        })
    }
}

impl BlockBackend for RawFile {
    fn size(&self) -> u64 {
        self.size
    }

    fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        self.file.read_exact_at(buf, offset)
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.read_only {
            return Err(io::ErrorKind::PermissionDenied.into());
        }
        check_range(offset, buf.len(), self.size)?;
        self.file.write_all_at(buf, offset)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file.sync_data()
    }
}

/// A raw disk whose format was probed: refuses writes that would put the
/// qcow2 magic at its start.
#[derive(Debug)]
pub(crate) struct ProbedRaw(pub(crate) RawFile);

impl BlockBackend for ProbedRaw {
    fn size(&self) -> u64 {
        self.0.size()
    }

    fn is_read_only(&self) -> bool {
        self.0.is_read_only()
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.0.read_at(buf, offset)
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let magic_len = qcow2::MAGIC.len() as u64;
        if offset < magic_len && !buf.is_empty() && self.0.size() >= magic_len {
            let mut start = [0u8; 4];
            self.0.read_at(&mut start, 0)?;
            for (i, byte) in start.iter_mut().enumerate() {
                let at = i as u64;
                if at >= offset {
                    if let Some(b) = buf.get((at - offset) as usize) {
                        *byte = *b;
                    }
                }
            }
            if start == qcow2::MAGIC {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "refusing to write a qcow2 header into a raw disk whose format was probed",
                ));
            }
        }
        self.0.write_at(buf, offset)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn image(contents: &[u8]) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().expect("tempfile");
        file.write_all(contents).expect("write");
        file
    }

    #[test]
    fn test_raw_file_open_reports_size() {
        let file = image(&[7; 4096]);
        let raw = RawFile::open(file.path(), false).expect("open");
        assert_eq!(raw.size(), 4096);
        assert!(!raw.is_read_only());
    }

    #[test]
    fn test_raw_file_open_sets_cloexec() {
        use std::os::fd::AsRawFd;
        let file = image(&[0; 512]);
        let raw = RawFile::open(file.path(), true).expect("open");
        let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", raw.file.as_raw_fd()))
            .expect("fdinfo");
        let flags = fdinfo
            .lines()
            .find_map(|line| line.strip_prefix("flags:"))
            .and_then(|v| i64::from_str_radix(v.trim(), 8).ok())
            .expect("flags");
        assert_eq!(
            flags & i64::from(libc::O_CLOEXEC),
            i64::from(libc::O_CLOEXEC)
        );
    }

    #[test]
    fn test_raw_file_open_missing_path_fails() {
        let dir = tempfile::tempdir().expect("tempdir");
        let result = RawFile::open(&dir.path().join("missing.img"), false);
        assert_eq!(
            result.map(|_| ()).map_err(|e| e.kind()),
            Err(io::ErrorKind::NotFound)
        );
    }

    #[test]
    fn test_raw_file_write_then_read_round_trips() {
        let file = image(&[0; 4096]);
        let mut raw = RawFile::open(file.path(), false).expect("open");
        raw.write_at(&[1, 2, 3], 1000).expect("write");
        raw.flush().expect("flush");
        let mut buf = [0; 5];
        raw.read_at(&mut buf, 999).expect("read");
        assert_eq!(buf, [0, 1, 2, 3, 0]);
    }

    #[test]
    fn test_raw_file_read_only_write_refused() {
        let file = image(&[9; 1024]);
        let mut raw = RawFile::open(file.path(), true).expect("open");
        let result = raw.write_at(&[0; 512], 0);
        assert_eq!(
            result.map_err(|e| e.kind()),
            Err(io::ErrorKind::PermissionDenied)
        );
        assert!(raw.flush().is_ok());
        let mut buf = [0; 4];
        raw.read_at(&mut buf, 0).expect("read");
        assert_eq!(buf, [9; 4]);
    }

    #[test]
    fn test_raw_file_access_beyond_end_refused() {
        let file = image(&[0; 1024]);
        let mut raw = RawFile::open(file.path(), false).expect("open");
        let mut buf = [0; 512];
        assert!(raw.read_at(&mut buf, 768).is_err());
        assert!(raw.read_at(&mut buf, u64::MAX).is_err());
        assert!(raw.write_at(&buf, 1024).is_err());
        assert!(raw.write_at(&buf, u64::MAX - 100).is_err());
        // The file did not grow.
        assert_eq!(std::fs::metadata(file.path()).expect("stat").len(), 1024);
    }

    #[test]
    fn test_raw_file_discard_and_write_zeroes_unsupported() {
        let file = image(&[0; 512]);
        let mut raw = RawFile::open(file.path(), false).expect("open");
        assert!(!raw.supports_discard() && !raw.supports_write_zeroes());
        assert!(raw.discard(0, 512).is_err());
        assert!(raw.write_zeroes(0, 512, false).is_err());
    }
}
