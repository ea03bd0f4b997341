//! Grows the root file system to its disk. A VM's disk may be larger than
//! the image it was made from (a host group's `storage_size`); without this
//! the extra space would be there but unusable. ext4 grows online
//! (`EXT4_IOC_RESIZE_FS`), so this runs at every agent start in a VM: it is
//! a no-op once the file system fills its disk.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

mod ioctl {
    // EXT4_IOC_RESIZE_FS: _IOW('f', 16, __u64), the new block count.
    nix::ioctl_write_ptr!(ext4_resize_fs, b'f', 16, u64);
}

/// Errors growing the root file system.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// Reading the mount or its device failed.
    #[error("cannot read {what}: {source}")]
    Read {
        /// What was read.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The device's size file held something else than a number.
    #[error("{} holds {text:?}, not a sector count", path.display())]
    BadSize {
        /// The size file.
        path: PathBuf,
        /// What it held.
        text: String,
    },
    /// The superblock is not ext4's.
    #[error("the root file system's superblock: {0}")]
    Superblock(String),
    /// The kernel refused to grow the file system.
    #[error("EXT4_IOC_RESIZE_FS to {blocks} blocks of {block_size} bytes failed: {source}")]
    Resize {
        /// The new block count.
        blocks: u64,
        /// The block size.
        block_size: u64,
        /// The kernel's answer.
        #[source]
        source: nix::Error,
    },
}

/// What [`grow_root`] found or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Growth {
    /// `/` is not ext4 on a block device; nothing to grow.
    NotExt4,
    /// The file system already fills its disk.
    Full,
    /// Grown from `from` to `to` bytes.
    Grown {
        /// Size before.
        from: u64,
        /// Size after.
        to: u64,
    },
}

/// Grows the ext4 file system mounted at `/` to the size of its block
/// device. Needs `/proc` and `/sys` mounted and CAP_SYS_RESOURCE.
pub fn grow_root() -> Result<Growth, RootfsError> {
    let root = Path::new("/");
    let stat = nix::sys::statfs::statfs(root).map_err(|e| RootfsError::Read {
        what: "statfs(/)".into(),
        source: e.into(),
    })?;
    if stat.filesystem_type() != nix::sys::statfs::EXT4_SUPER_MAGIC {
        return Ok(Growth::NotExt4);
    }
    let dev = std::fs::metadata(root)
        .map_err(|source| RootfsError::Read {
            what: "stat(/)".into(),
            source,
        })?
        .dev();
    let (major, minor) = (libc_major(dev), libc_minor(dev));
    let sys_dir = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let size_file = sys_dir.join("size");
    let Ok(text) = std::fs::read_to_string(&size_file) else {
        // No block device behind `/` (a test's bind mount, say).
        return Ok(Growth::NotExt4);
    };
    let sectors: u64 = text.trim().parse().map_err(|_| RootfsError::BadSize {
        path: size_file.clone(),
        text: text.trim().to_owned(),
    })?;
    let device_bytes = sectors.saturating_mul(512);
    let block_size = u64::try_from(stat.block_size()).unwrap_or(4096).max(1024);
    let target_blocks = device_bytes / block_size;
    let before = current_blocks(&sys_dir)?;
    if target_blocks <= before {
        return Ok(Growth::Full);
    }
    let dir = std::fs::File::open(root).map_err(|source| RootfsError::Read {
        what: "open(/)".into(),
        source,
    })?;
    // SAFETY: the ioctl reads one u64 through the pointer, which points at a
    // live local; `dir` is an open descriptor of the ext4 file system.
    unsafe { ioctl::ext4_resize_fs(std::os::fd::AsRawFd::as_raw_fd(&dir), &target_blocks) }
        .map_err(|source| RootfsError::Resize {
            blocks: target_blocks,
            block_size,
            source,
        })?;
    Ok(Growth::Grown {
        from: before * block_size,
        to: target_blocks * block_size,
    })
}

/// The file system's block count, from its superblock on the device named
/// in sysfs (`DEVNAME=vda` → `/dev/vda`). `statvfs` would not do: it leaves
/// out the metadata blocks.
fn current_blocks(sys_dir: &Path) -> Result<u64, RootfsError> {
    use std::os::unix::fs::FileExt;
    let uevent = sys_dir.join("uevent");
    let text = std::fs::read_to_string(&uevent).map_err(|source| RootfsError::Read {
        what: uevent.display().to_string(),
        source,
    })?;
    let Some(name) = text.lines().find_map(|l| l.strip_prefix("DEVNAME=")) else {
        return Err(RootfsError::Superblock(format!(
            "{} names no device",
            uevent.display()
        )));
    };
    let device = Path::new("/dev").join(name);
    let file = std::fs::File::open(&device).map_err(|source| RootfsError::Read {
        what: device.display().to_string(),
        source,
    })?;
    let mut sb = [0u8; 1024];
    file.read_exact_at(&mut sb, 1024)
        .map_err(|source| RootfsError::Read {
            what: format!("the superblock of {}", device.display()),
            source,
        })?;
    superblock_blocks(&sb)
}

/// `s_blocks_count` of an ext4 superblock (1024 bytes).
fn superblock_blocks(sb: &[u8; 1024]) -> Result<u64, RootfsError> {
    let u16_at = |o: usize| u16::from_le_bytes([sb[o], sb[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes([sb[o], sb[o + 1], sb[o + 2], sb[o + 3]]);
    if u16_at(0x38) != 0xEF53 {
        return Err(RootfsError::Superblock("no ext4 magic".into()));
    }
    let low = u64::from(u32_at(0x04));
    // INCOMPAT_64BIT: the count's high half is in s_blocks_count_hi.
    let high = if u32_at(0x60) & 0x80 != 0 {
        u64::from(u32_at(0x150))
    } else {
        0
    };
    Ok(high << 32 | low)
}

fn libc_major(dev: u64) -> u64 {
    ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0000_0fff)
}

fn libc_minor(dev: u64) -> u64 {
    ((dev >> 12) & 0xffff_ff00) | (dev & 0x0000_00ff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_counts_come_from_the_superblock() {
        let mut sb = [0u8; 1024];
        assert!(superblock_blocks(&sb).is_err(), "no magic, no count");
        sb[0x38..0x3a].copy_from_slice(&0xEF53u16.to_le_bytes());
        sb[0x04..0x08].copy_from_slice(&524_288u32.to_le_bytes());
        sb[0x150..0x154].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(
            superblock_blocks(&sb).expect("count"),
            524_288,
            "no 64bit feature"
        );
        sb[0x60..0x64].copy_from_slice(&0x80u32.to_le_bytes());
        assert_eq!(superblock_blocks(&sb).expect("count"), (2 << 32) + 524_288);
    }

    #[test]
    fn device_numbers_split_like_the_kernel() {
        // makedev(254, 0) and makedev(259, 65537) in glibc's encoding.
        assert_eq!((libc_major(0xfe00), libc_minor(0xfe00)), (254, 0));
        let dev = (259u64 << 8) | (65537u64 & 0xff) | ((65537u64 & !0xff) << 12);
        assert_eq!((libc_major(dev), libc_minor(dev)), (259, 65537));
    }
}
