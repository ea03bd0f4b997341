//! Creating qcow2 images: empty, as overlays, and by flattening a chain.
//!
//! A new image is written to a temporary name in the destination's
//! directory, synced, and hard-linked to its name (which fails if the name
//! exists: an image is never replaced), so a crash never leaves a partial
//! image at the destination. An image created [`Durability::Deferred`]
//! skips both syncs: a crash of the process still leaves it whole (the
//! page cache holds it), and [`sync_created`] makes it survive a power loss
//! before anything depends on that.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::header::{
    Header, NewHeader, DEFAULT_CLUSTER_BITS, MAX_CLUSTER_BITS, MAX_L1_BYTES, MAX_VIRTUAL_SIZE,
    MIN_CLUSTER_BITS,
};
use super::{Backing, Qcow2};
use crate::{file_length, io_err, open_read, resolve_backing, Error, Format, Result};

/// What a new image looks like.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    /// Virtual size in bytes, rounded up to 512. `None`: the backing
    /// file's size (required then).
    pub virtual_size: Option<u64>,
    /// Cluster size in bytes: a power of two from 512 B to 2 MiB.
    pub cluster_size: u64,
    /// The backing file, stored as given (relative names are resolved
    /// against the new image's directory), and its format.
    pub backing: Option<(PathBuf, Format)>,
    /// When the new image reaches stable storage.
    pub durability: Durability,
}

/// When a new image (its contents and its name) reaches stable storage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Durability {
    /// Before `create` returns: the file and its directory are synced.
    #[default]
    Synced,
    /// When the caller calls [`sync_created`]; until then a power loss may
    /// take the image (never a process crash). For images the caller can
    /// make again, on a path where the syncs would cost more than the
    /// rest of the work.
    Deferred,
}

impl Default for CreateOptions {
    /// No size, 64 KiB clusters, no backing file.
    fn default() -> Self {
        Self {
            virtual_size: None,
            cluster_size: 1 << DEFAULT_CLUSTER_BITS,
            backing: None,
            durability: Durability::Synced,
        }
    }
}

/// Creates a qcow2 image at `path` whose backing file is `backing` (in
/// `backing_format`), with 64 KiB clusters. The virtual size defaults to
/// the backing file's and may be larger, never smaller.
///
/// Reads only the backing file's header (or size, for raw) and writes a
/// few KiB, whatever the backing file's size. Fails if `path` exists.
pub fn create_overlay(
    path: &Path,
    backing: &Path,
    backing_format: Format,
    virtual_size: Option<u64>,
) -> Result<()> {
    create(
        path,
        &CreateOptions {
            virtual_size,
            backing: Some((backing.to_path_buf(), backing_format)),
            ..CreateOptions::default()
        },
    )
}

/// Creates a standalone qcow2 image of `virtual_size` bytes at `path`,
/// with 64 KiB clusters. Fails if `path` exists.
pub fn create_empty(path: &Path, virtual_size: u64) -> Result<()> {
    create(
        path,
        &CreateOptions {
            virtual_size: Some(virtual_size),
            ..CreateOptions::default()
        },
    )
}

/// Creates a qcow2 image at `path` as `options` say. Fails if `path`
/// exists.
pub fn create(path: &Path, options: &CreateOptions) -> Result<()> {
    let layout = Layout::plan(path, options)?;
    atomically(path, options.durability, |tmp, file| {
        layout.write(tmp, file)
    })
}

/// Syncs an image made with [`Durability::Deferred`] and the directory
/// entry that names it, so that it survives a power loss.
pub fn sync_created(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io_err("sync", path))?;
    let dir = parent_dir(path);
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("sync", dir))
}

/// The directory holding `path` (`.` for a bare name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Writes a standalone qcow2 image at `dest` (64 KiB clusters, no backing
/// file) with the contents of the disk at `path` and its whole backing
/// chain. Only clusters that hold non-zero data are written. Fails if
/// `dest` exists.
pub fn flatten(path: &Path, dest: &Path) -> Result<()> {
    let mut source = Qcow2::open_any(path)?;
    let size = source.size().next_multiple_of(512);
    let layout = Layout::plan(
        dest,
        &CreateOptions {
            virtual_size: Some(size.max(512)),
            ..CreateOptions::default()
        },
    )?;
    atomically(dest, Durability::Synced, |tmp, file| {
        layout.write(tmp, file)?;
        let mut image = Qcow2::open(tmp, false)?;
        copy_data(&mut source, &mut image)?;
        image.flush_image()
    })
}

/// Copies every cluster of `source` that is not all zeros to `dest`.
fn copy_data(source: &mut Backing, dest: &mut Qcow2) -> Result<()> {
    let cs = dest.cluster_size();
    let size = source.size();
    let mut buf = vec![0u8; cs as usize];
    let mut offset = 0;
    while offset < size {
        let n = cs.min(dest.size - offset);
        if !source.known_zero(offset, n)? {
            source.read(&mut buf[..n as usize], offset)?;
            if buf[..n as usize].iter().any(|&b| b != 0) {
                buf[n as usize..].fill(0);
                dest.write(&buf[..n as usize], offset)?;
            }
        }
        offset += cs;
    }
    Ok(())
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Runs `write` on a new temporary file next to `path`, syncs it (unless
/// deferred) and gives it the name `path` (failing if that exists),
/// removing it on failure.
fn atomically(
    path: &Path,
    durability: Durability,
    write: impl FnOnce(&Path, &mut File) -> Result<()>,
) -> Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::InvalidArgument(format!("{} names no file", path.display())))?;
    if path.symlink_metadata().is_ok() {
        return Err(io_err("create", path)(
            std::io::ErrorKind::AlreadyExists.into(),
        ));
    }
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(
        ".tmp-{}-{}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp = path.with_file_name(tmp_name);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(io_err("create", &tmp))?;
    let synced = |file: &mut File| match durability {
        Durability::Synced => file.sync_all().map_err(io_err("sync", &tmp)),
        Durability::Deferred => Ok(()),
    };
    let result = write(&tmp, &mut file)
        .and_then(|()| synced(&mut file))
        .and_then(|()| std::fs::hard_link(&tmp, path).map_err(io_err("create", path)));
    if let Err(e) = std::fs::remove_file(&tmp) {
        // Only a name is left behind: the image (if any) is at `path`.
        tracing::warn!("cannot remove the temporary {}: {e}", tmp.display());
    }
    result?;
    if durability == Durability::Synced {
        let dir = parent_dir(path);
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err("sync", dir))?;
    }
    Ok(())
}

/// Where the structures of a new image go: cluster 0 the header, then the
/// refcount table, the refcount blocks and the L1 table.
#[derive(Debug)]
struct Layout {
    cluster_bits: u32,
    header: Vec<u8>,
    l1_size: u32,
    reftable_clusters: u64,
    refblocks: u64,
    total_clusters: u64,
}

impl Layout {
    fn plan(path: &Path, options: &CreateOptions) -> Result<Self> {
        let cs = options.cluster_size;
        if !cs.is_power_of_two()
            || !(1u64 << MIN_CLUSTER_BITS..=1u64 << MAX_CLUSTER_BITS).contains(&cs)
        {
            return Err(Error::InvalidArgument(format!(
                "cluster size {cs} is not a power of two from 512 to 2 MiB"
            )));
        }
        let cluster_bits = cs.trailing_zeros();
        let backing_size = match &options.backing {
            Some((name, format)) => Some(backing_size(&resolve_backing(path, name), *format)?),
            None => None,
        };
        let size = match (options.virtual_size, backing_size) {
            (Some(size), Some(backing)) if size < backing => {
                return Err(Error::InvalidArgument(format!(
                    "virtual size {size} is smaller than the backing file's {backing}"
                )))
            }
            (Some(size), _) => size,
            (None, Some(backing)) => backing,
            (None, None) => {
                return Err(Error::InvalidArgument(
                    "an image without backing file needs a virtual size".into(),
                ))
            }
        };
        let size = size.next_multiple_of(512);
        if size == 0 || size > MAX_VIRTUAL_SIZE {
            return Err(Error::InvalidArgument(format!(
                "virtual size {size} is not within 1..={MAX_VIRTUAL_SIZE}"
            )));
        }
        let l1_entries = Header::l1_entries_for(size, cluster_bits);
        if l1_entries * 8 > MAX_L1_BYTES {
            return Err(Error::InvalidArgument(format!(
                "virtual size {size} needs an L1 table over 32 MiB with {cs}-byte clusters"
            )));
        }
        let l1_clusters = (l1_entries * 8).div_ceil(cs);
        // 16-bit refcounts: cs / 2 per block.
        let per_block = cs / 2;
        let (mut reftable_clusters, mut refblocks) = (1, 1);
        loop {
            let total = 1 + reftable_clusters + refblocks + l1_clusters;
            let blocks = total.div_ceil(per_block);
            let table = (blocks * 8).div_ceil(cs);
            if (blocks, table) == (refblocks, reftable_clusters) {
                break;
            }
            (refblocks, reftable_clusters) = (blocks, table);
        }
        let backing_name = options
            .backing
            .as_ref()
            .map(|(name, format)| (name.as_os_str().as_encoded_bytes(), *format));
        let header = NewHeader {
            cluster_bits,
            size,
            l1_size: l1_entries as u32,
            l1_table_offset: (1 + reftable_clusters + refblocks) * cs,
            refcount_table_offset: cs,
            refcount_table_clusters: reftable_clusters as u32,
            backing: backing_name,
        }
        .encode()
        .map_err(Error::InvalidArgument)?;
        Ok(Self {
            cluster_bits,
            header,
            l1_size: l1_entries as u32,
            reftable_clusters,
            refblocks,
            total_clusters: 1 + reftable_clusters + refblocks + l1_clusters,
        })
    }

    /// Writes the image to `file` (named `path`), sparse: the L1 table is
    /// a hole.
    fn write(&self, path: &Path, file: &mut File) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let cs = 1u64 << self.cluster_bits;
        debug_assert!(self.l1_size as u64 * 8 <= (self.total_clusters - 1) * cs);
        file.set_len(self.total_clusters * cs)
            .map_err(io_err("resize", path))?;
        file.write_all_at(&self.header, 0)
            .map_err(io_err("write", path))?;
        let first_block = 1 + self.reftable_clusters;
        let table: Vec<u8> = (0..self.refblocks)
            .flat_map(|i| ((first_block + i) * cs).to_be_bytes())
            .collect();
        file.write_all_at(&table, cs)
            .map_err(io_err("write", path))?;
        // Refcount 1 for every cluster of the image, 16-bit big-endian.
        let mut remaining = self.total_clusters;
        for i in 0..self.refblocks {
            let n = remaining.min(cs / 2);
            let block: Vec<u8> = (0..n).flat_map(|_| 1u16.to_be_bytes()).collect();
            file.write_all_at(&block, (first_block + i) * cs)
                .map_err(io_err("write", path))?;
            remaining -= n;
        }
        Ok(())
    }
}

/// The virtual size of the disk at `path` in `format` (reading only its
/// header).
fn backing_size(path: &Path, format: Format) -> Result<u64> {
    let file = open_read(path)?;
    let len = file_length(&file, path)?;
    match format {
        Format::Raw => Ok(len),
        Format::Qcow2 => Ok(Header::read(&file, len, path)?.size),
    }
}
