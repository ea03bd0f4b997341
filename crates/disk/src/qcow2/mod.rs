//! qcow2 images: reading, writing, creating, checking.
//!
//! Supported: versions 2 and 3 (read), version 3 with 16-bit refcounts
//! (written), clusters of 512 B to 2 MiB, backing files (raw or qcow2,
//! chains up to [`MAX_CHAIN_DEPTH`] deep), zero clusters. Not supported:
//! encryption, external data files, extended L2 entries, compressed
//! clusters (refused when read), writing images with internal snapshots,
//! writing images left dirty by lazy refcounts.
//!
//! # Crash safety
//!
//! Metadata is written through (never cached dirty), so another process
//! opening the file sees every completed write. The dirty bit is never
//! set: refcounts are kept correct at all times instead, by ordering
//! updates so that a crash leaves at worst leaked clusters:
//!
//! 1. a new cluster's refcount is made durable before anything refers to
//!    it (clusters come from a pool whose refcounts were synced, see
//!    `refcount.rs`);
//! 2. a new data cluster is written (with, around a partial write, the
//!    backing chain's data unless that is known to be zeros) before the L2
//!    entry naming it;
//! 3. a new L2 table is written in full before the L1 entry naming it;
//! 4. a new refcount table is synced before the header names it, and the
//!    header before the old table is freed.
//!
//! New clusters are always past the old end of the file, so a cluster
//! whose write did not reach the disk before a power loss reads as zeros.
//! Guest data written since the guest's last flush may be lost on a power
//! loss (as with any volatile write cache), and a cluster copied around a
//! partial write may then read as zeros instead of the backing data.

mod cache;
mod check;
mod create;
pub mod header;
mod refcount;

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

pub use check::{check, CheckReport};
pub use create::{
    create, create_empty, create_overlay, flatten, sync_created, CreateOptions, Durability,
};

use self::cache::TableCache;
use self::header::{unsupported_incompatible, Header, AUTOCLEAR_OFFSET};
use self::refcount::Refcounts;
use crate::backend::{check_range, BlockBackend};
use crate::{
    detect_file_format, file_length, io_err, resolve_backing, Error, Format, Result,
    MAX_CHAIN_DEPTH,
};

/// The first four bytes of every qcow2 file.
pub const MAGIC: [u8; 4] = *b"QFI\xfb";

/// Offset bits of an L1 entry (an L2 table).
const L1E_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Reserved bits of an L1 entry.
const L1E_RESERVED: u64 = 0x7f00_0000_0000_01ff;
/// Offset bits of a standard L2 entry (a data cluster).
const L2E_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Reserved bits of a standard L2 entry.
const L2E_RESERVED: u64 = 0x3f00_0000_0000_01fe;
/// The cluster's refcount is exactly 1 (it may be written in place).
const OFLAG_COPIED: u64 = 1 << 63;
/// The cluster is compressed.
const OFLAG_COMPRESSED: u64 = 1 << 62;
/// The cluster reads as zeros (version 3).
const OFLAG_ZERO: u64 = 1;

/// Bytes of L2 tables cached per image.
const L2_CACHE_BYTES: u64 = 4 << 20;
/// Bounds on the number of L2 tables cached per image.
const L2_CACHE_MIN: usize = 16;
const L2_CACHE_MAX: usize = 256;

/// Whether `offset` is not a multiple of `cluster_size` (a power of two).
pub(crate) fn unaligned(offset: u64, cluster_size: u64) -> bool {
    offset & (cluster_size - 1) != 0
}

/// An open image file: the file, its name for errors and its length.
#[derive(Debug)]
pub(crate) struct ImageFile {
    file: File,
    path: PathBuf,
    /// Current length in bytes, kept up to date as the file grows.
    len: u64,
}

impl ImageFile {
    fn invalid(&self, reason: String) -> Error {
        Error::Invalid {
            path: self.path.clone(),
            reason,
        }
    }

    fn read_exact(&self, buf: &mut [u8], offset: u64, op: &'static str) -> Result<()> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(io_err(op, &self.path))
    }

    /// Reads what the file has at `offset` into `buf`, zeros past its end.
    fn read_padded(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err("read", &self.path)(e)),
            }
        }
        buf[done..].fill(0);
        Ok(())
    }

    fn write_all(&mut self, buf: &[u8], offset: u64, op: &'static str) -> Result<()> {
        self.file
            .write_all_at(buf, offset)
            .map_err(io_err(op, &self.path))?;
        self.len = self.len.max(offset + buf.len() as u64);
        Ok(())
    }

    fn set_len(&mut self, len: u64) -> Result<()> {
        self.file
            .set_len(len)
            .map_err(io_err("resize", &self.path))?;
        self.len = len;
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        self.file.sync_data().map_err(io_err("sync", &self.path))
    }
}

/// Where a guest cluster's data is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mapping {
    /// Not in this image: in the backing file, or zeros without one.
    Unallocated,
    /// Zeros; `prealloc` is a host cluster still allocated to it (or 0).
    Zero { prealloc: u64 },
    /// At `host` in the file; `copied` if its refcount is 1.
    Data { host: u64, copied: bool },
}

/// The file below an image in its chain. Always read-only.
#[derive(Debug)]
enum Backing {
    Raw { file: ImageFile, size: u64 },
    Qcow2(Box<Qcow2>),
}

impl Backing {
    fn size(&self) -> u64 {
        match self {
            Backing::Raw { size, .. } => *size,
            Backing::Qcow2(image) => image.size,
        }
    }

    /// Fills `buf` from `offset`, zeros past the backing file's end.
    fn read(&mut self, buf: &mut [u8], offset: u64) -> Result<()> {
        let size = self.size();
        let inside = size.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (head, tail) = buf.split_at_mut(inside);
        tail.fill(0);
        if head.is_empty() {
            return Ok(());
        }
        match self {
            Backing::Raw { file, .. } => file.read_exact(head, offset, "read backing file"),
            Backing::Qcow2(image) => image.read(head, offset),
        }
    }

    /// Whether `len` bytes at `offset` are known to read as zeros without
    /// reading data.
    fn known_zero(&mut self, offset: u64, len: u64) -> Result<bool> {
        if offset >= self.size() {
            return Ok(true);
        }
        match self {
            Backing::Raw { file, .. } => {
                // The next data at or after `offset` (None: only a hole).
                match next_data(&file.file, offset) {
                    Ok(None) => Ok(true),
                    Ok(Some(next)) => Ok(next >= offset + len),
                    Err(_) => Ok(false),
                }
            }
            Backing::Qcow2(image) => image.known_zero(offset, len),
        }
    }
}

/// Where the first data at or after `offset` in `file` starts (`None`:
/// only a hole follows), by `lseek(SEEK_DATA)`.
fn next_data(file: &File, offset: u64) -> io::Result<Option<u64>> {
    let offset = libc::off_t::try_from(offset).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: `lseek` takes only integers; `file` keeps the descriptor open
    // for the duration of the call.
    let at = unsafe { libc::lseek(file.as_raw_fd(), offset, libc::SEEK_DATA) };
    match u64::try_from(at) {
        Ok(at) => Ok(Some(at)),
        Err(_) => match io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
            e => Err(e),
        },
    }
}

/// A qcow2 image, opened with its backing chain.
///
/// Implements [`BlockBackend`], so virtio-blk serves it like a raw file.
pub struct Qcow2 {
    f: ImageFile,
    read_only: bool,
    header: Header,
    cluster_bits: u32,
    /// log2 of the entries of an L2 table.
    l2_bits: u32,
    l1: Vec<u64>,
    l2_cache: TableCache<Vec<u64>>,
    /// Present when writable.
    refcounts: Option<Refcounts>,
    backing: Option<Backing>,
    size: u64,
    /// One cluster, for copying around partial writes.
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Qcow2 {
    /// The image and its chain, without the tables.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2")
            .field("path", &self.f.path)
            .field("size", &self.size)
            .field("cluster_size", &self.cluster_size())
            .field("read_only", &self.read_only)
            .field("backing", &self.backing)
            .finish_non_exhaustive()
    }
}

/// A backing file to open: its resolved path and the format its child's
/// header names (`None`: probe).
type BackingName = (PathBuf, Option<Format>);

/// Identity of an open file, for loop detection.
fn file_id(file: &File, path: &Path) -> Result<(u64, u64)> {
    let meta = file.metadata().map_err(io_err("stat", path))?;
    Ok((meta.dev(), meta.ino()))
}

impl Qcow2 {
    /// Opens the image at `path` (read-only if `read_only`) and its backing
    /// chain (always read-only).
    ///
    /// Refuses images with the corrupt bit, unknown incompatible features
    /// or unsupported ones (named in the error), backing chains that loop
    /// or are deeper than [`MAX_CHAIN_DEPTH`], and, for writing, images
    /// with internal snapshots or the dirty bit. A writable open checks
    /// the image's tables so that no write can land on metadata.
    pub fn open(path: &Path, read_only: bool) -> Result<Self> {
        let mut seen = Vec::new();
        let (mut image, mut next) = Self::open_layer(path, read_only, &mut seen)?;
        // The chain is opened top-down in a loop (not recursively: chains
        // may be deep), then linked bottom-up.
        let mut layers = Vec::new();
        let mut below = None;
        while let Some((path, format)) = next.take() {
            if seen.len() >= MAX_CHAIN_DEPTH {
                return Err(Error::ChainTooDeep(path));
            }
            let file = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(io_err("open backing file", &path))?;
            let format = match format {
                Some(format) => format,
                None => detect_file_format(&file, &path)?,
            };
            match format {
                Format::Qcow2 => {
                    drop(file);
                    let (layer, after) = Self::open_layer(&path, true, &mut seen)?;
                    layers.push(layer);
                    next = after;
                }
                Format::Raw => {
                    if seen.contains(&file_id(&file, &path)?) {
                        return Err(Error::BackingLoop { path });
                    }
                    let size = file_length(&file, &path)?;
                    below = Some(Backing::Raw {
                        file: ImageFile {
                            file,
                            path,
                            len: size,
                        },
                        size,
                    });
                }
            }
        }
        while let Some(mut layer) = layers.pop() {
            layer.backing = below;
            below = Some(Backing::Qcow2(Box::new(layer)));
        }
        image.backing = below;
        Ok(image)
    }

    /// Opens the disk at `path` read-only in the format its first bytes
    /// say, as a [`Backing`].
    fn open_any(path: &Path) -> Result<Backing> {
        let file = crate::open_read(path)?;
        match detect_file_format(&file, path)? {
            Format::Qcow2 => Ok(Backing::Qcow2(Box::new(Self::open(path, true)?))),
            Format::Raw => {
                let size = file_length(&file, path)?;
                Ok(Backing::Raw {
                    file: ImageFile {
                        file,
                        path: path.to_path_buf(),
                        len: size,
                    },
                    size,
                })
            }
        }
    }

    /// Opens one image of a chain, without its backing file; returns it
    /// with the resolved name and format of its backing file.
    fn open_layer(
        path: &Path,
        read_only: bool,
        seen: &mut Vec<(u64, u64)>,
    ) -> Result<(Self, Option<BackingName>)> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io_err("open", path))?;
        let id = file_id(&file, path)?;
        if seen.contains(&id) {
            return Err(Error::BackingLoop {
                path: path.to_path_buf(),
            });
        }
        seen.push(id);
        let len = file_length(&file, path)?;
        let header = Header::read(&file, len, path)?;
        if header.is_corrupt() {
            return Err(Error::MarkedCorrupt(path.to_path_buf()));
        }
        let unsupported = unsupported_incompatible(header.incompatible_features);
        if !unsupported.is_empty() {
            return Err(Error::Unsupported {
                path: path.to_path_buf(),
                feature: unsupported.join(", "),
            });
        }
        if !read_only {
            if header.is_dirty() {
                return Err(Error::Dirty(path.to_path_buf()));
            }
            if header.nb_snapshots > 0 {
                return Err(Error::Unsupported {
                    path: path.to_path_buf(),
                    feature: "writing an image with internal snapshots".into(),
                });
            }
        }
        let f = ImageFile {
            file,
            path: path.to_path_buf(),
            len,
        };
        let mut raw_l1 = vec![0u8; header.l1_size as usize * 8];
        f.read_exact(&mut raw_l1, header.l1_table_offset, "read the L1 table of")?;
        let l1 = raw_l1
            .chunks_exact(8)
            .map(|c| {
                let mut e = [0u8; 8];
                e.copy_from_slice(c);
                u64::from_be_bytes(e)
            })
            .collect();
        let next = header
            .backing_file
            .as_ref()
            .map(|name| (resolve_backing(path, name), header.backing_format));
        let cluster_bits = header.cluster_bits;
        let cs = 1u64 << cluster_bits;
        let cache_tables = ((L2_CACHE_BYTES / cs) as usize).clamp(L2_CACHE_MIN, L2_CACHE_MAX);
        let mut image = Self {
            f,
            read_only,
            cluster_bits,
            l2_bits: cluster_bits - 3,
            l1,
            l2_cache: TableCache::new(cache_tables),
            refcounts: None,
            backing: None,
            size: header.size,
            scratch: Vec::new(),
            header,
        };
        if !read_only {
            image.prepare_for_writing()?;
        }
        Ok((image, next))
    }

    /// Loads the refcounts and checks that every table entry points into
    /// the file and that no data cluster is also metadata, so that writes
    /// can trust the tables. Clears auto-clear features (none is known).
    fn prepare_for_writing(&mut self) -> Result<()> {
        let refcounts = Refcounts::load(&mut self.f, &self.header)?;
        let cs = self.cluster_size();
        let mut metadata = HashSet::new();
        let add_range = |offset: u64, len: u64, metadata: &mut HashSet<u64>| {
            let first = offset / cs;
            for c in first..(offset + len).div_ceil(cs) {
                metadata.insert(c);
            }
        };
        add_range(0, cs, &mut metadata);
        add_range(
            self.header.l1_table_offset,
            u64::from(self.header.l1_size) * 8,
            &mut metadata,
        );
        add_range(
            self.header.refcount_table_offset,
            u64::from(self.header.refcount_table_clusters) * cs,
            &mut metadata,
        );
        // Refcount blocks were checked by `Refcounts::load`; list them.
        let mut blocks =
            vec![0u8; u64::from(self.header.refcount_table_clusters) as usize * cs as usize];
        self.f.read_exact(
            &mut blocks,
            self.header.refcount_table_offset,
            "read the refcount table of",
        )?;
        for chunk in blocks.chunks_exact(8) {
            let mut e = [0u8; 8];
            e.copy_from_slice(chunk);
            let offset = u64::from_be_bytes(e);
            if offset != 0 {
                metadata.insert(offset / cs);
            }
        }
        let mut l2_tables = Vec::new();
        for i in 0..self.l1.len() {
            let entry = self.l1.get(i).copied().unwrap_or(0);
            if let Some(offset) = self.l2_offset(entry, i)? {
                if !metadata.insert(offset / cs) {
                    return Err(self.f.invalid(format!(
                        "L2 table {i} at {offset:#x} overlaps other metadata"
                    )));
                }
                l2_tables.push(offset);
            }
        }
        for l2 in l2_tables {
            let table = self.read_l2(l2)?;
            for (i, &entry) in table.iter().enumerate() {
                let host = match self.decode_l2(entry)? {
                    Mapping::Data { host, .. } => host,
                    Mapping::Zero { prealloc } if prealloc != 0 => prealloc,
                    _ => continue,
                };
                if metadata.contains(&(host / cs)) {
                    return Err(self.f.invalid(format!(
                        "L2 table at {l2:#x} entry {i}: data cluster {host:#x} overlaps metadata"
                    )));
                }
            }
            self.l2_cache.insert(l2, table);
        }
        if self.header.autoclear_features != 0 {
            self.f
                .write_all(&[0; 8], AUTOCLEAR_OFFSET, "write the header of")?;
            self.header.autoclear_features = 0;
        }
        self.refcounts = Some(refcounts);
        Ok(())
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// The image's path.
    pub fn path(&self) -> &Path {
        &self.f.path
    }

    /// The parsed header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The L2 table an L1 entry names, if any, checked.
    fn l2_offset(&self, entry: u64, index: usize) -> Result<Option<u64>> {
        if entry & L1E_RESERVED != 0 {
            return Err(self.f.invalid(format!(
                "L1 entry {index} is {entry:#x} (reserved bits set)"
            )));
        }
        let offset = entry & L1E_OFFSET_MASK;
        if offset == 0 {
            return Ok(None);
        }
        let cs = self.cluster_size();
        if unaligned(offset, cs) || offset + cs > self.f.len {
            return Err(self.f.invalid(format!(
                "L1 entry {index} names an L2 table at {offset:#x}, unaligned or past the end of the file"
            )));
        }
        Ok(Some(offset))
    }

    fn read_l2(&self, offset: u64) -> Result<Vec<u64>> {
        let mut raw = vec![0u8; self.cluster_size() as usize];
        self.f.read_exact(&mut raw, offset, "read an L2 table of")?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| {
                let mut e = [0u8; 8];
                e.copy_from_slice(c);
                u64::from_be_bytes(e)
            })
            .collect())
    }

    /// Entry `index` of the L2 table at `offset`.
    fn l2_entry(&mut self, offset: u64, index: usize) -> Result<u64> {
        if let Some(table) = self.l2_cache.get_mut(offset) {
            return Ok(table.get(index).copied().unwrap_or(0));
        }
        let table = self.read_l2(offset)?;
        let entry = table.get(index).copied().unwrap_or(0);
        self.l2_cache.insert(offset, table);
        Ok(entry)
    }

    fn decode_l2(&self, entry: u64) -> Result<Mapping> {
        if entry & OFLAG_COMPRESSED != 0 {
            return Err(Error::Unsupported {
                path: self.f.path.clone(),
                feature: "compressed clusters".into(),
            });
        }
        if entry & L2E_RESERVED != 0 {
            return Err(self
                .f
                .invalid(format!("L2 entry {entry:#x} has reserved bits set")));
        }
        let host = entry & L2E_OFFSET_MASK;
        let cs = self.cluster_size();
        if host != 0 && (unaligned(host, cs) || host >= self.f.len) {
            return Err(self.f.invalid(format!(
                "L2 entry {entry:#x} names a cluster unaligned or past the end of the file"
            )));
        }
        if entry & OFLAG_ZERO != 0 {
            if self.header.version < 3 {
                return Err(self
                    .f
                    .invalid(format!("zero flag in a version 2 L2 entry {entry:#x}")));
            }
            return Ok(Mapping::Zero { prealloc: host });
        }
        if host == 0 {
            return Ok(Mapping::Unallocated);
        }
        Ok(Mapping::Data {
            host,
            copied: entry & OFLAG_COPIED != 0,
        })
    }

    /// Where guest cluster `vcluster` is, and the L2 table (if any) and
    /// index that map it.
    fn lookup(&mut self, vcluster: u64) -> Result<(Mapping, Option<u64>)> {
        let l1_index = (vcluster >> self.l2_bits) as usize;
        let Some(&l1_entry) = self.l1.get(l1_index) else {
            return Ok((Mapping::Unallocated, None));
        };
        let Some(l2) = self.l2_offset(l1_entry, l1_index)? else {
            return Ok((Mapping::Unallocated, None));
        };
        let index = (vcluster & ((1 << self.l2_bits) - 1)) as usize;
        let entry = self.l2_entry(l2, index)?;
        Ok((self.decode_l2(entry)?, Some(l2)))
    }

    /// Reads `buf` from guest offset `offset` (within the virtual size).
    fn read(&mut self, buf: &mut [u8], offset: u64) -> Result<()> {
        let cs = self.cluster_size();
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let in_cluster = pos & (cs - 1);
            let mut n = ((cs - in_cluster) as usize).min(buf.len() - done);
            let (mapping, _) = self.lookup(pos >> self.cluster_bits)?;
            match mapping {
                Mapping::Data { host, .. } => {
                    // Extend over following clusters that are contiguous in
                    // the file, for one read.
                    while done + n < buf.len() {
                        let next = pos + n as u64;
                        match self.lookup(next >> self.cluster_bits)?.0 {
                            Mapping::Data { host: h, .. } if h == host + in_cluster + n as u64 => {
                                n += (cs as usize).min(buf.len() - done - n);
                            }
                            _ => break,
                        }
                    }
                    self.f
                        .read_padded(&mut buf[done..done + n], host + in_cluster)?;
                }
                Mapping::Zero { .. } => buf[done..done + n].fill(0),
                Mapping::Unallocated => match &mut self.backing {
                    Some(backing) => backing.read(&mut buf[done..done + n], pos)?,
                    None => buf[done..done + n].fill(0),
                },
            }
            done += n;
        }
        Ok(())
    }

    /// Whether `len` bytes at guest offset `offset` are known to read as
    /// zeros (zero clusters, or unallocated down the chain), without
    /// reading data clusters.
    fn known_zero(&mut self, offset: u64, len: u64) -> Result<bool> {
        let cs = self.cluster_size();
        let end = offset.saturating_add(len).min(self.size);
        let mut pos = offset;
        while pos < end {
            let n = (cs - (pos & (cs - 1))).min(end - pos);
            match self.lookup(pos >> self.cluster_bits)?.0 {
                Mapping::Data { .. } => return Ok(false),
                Mapping::Zero { .. } => {}
                Mapping::Unallocated => {
                    if let Some(backing) = &mut self.backing {
                        if !backing.known_zero(pos, n)? {
                            return Ok(false);
                        }
                    }
                }
            }
            pos += n;
        }
        Ok(true)
    }

    fn allocate(&mut self) -> Result<u64> {
        match &mut self.refcounts {
            Some(refcounts) => refcounts.alloc(&mut self.f),
            None => Err(Error::InvalidArgument(format!(
                "{} is open read-only",
                self.f.path.display()
            ))),
        }
    }

    /// Writes `data` at guest offset `offset` (within the virtual size).
    fn write(&mut self, data: &[u8], offset: u64) -> Result<()> {
        let cs = self.cluster_size();
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let in_cluster = pos & (cs - 1);
            let n = ((cs - in_cluster) as usize).min(data.len() - done);
            let chunk = &data[done..done + n];
            let vcluster = pos >> self.cluster_bits;
            match self.lookup(vcluster)? {
                (Mapping::Data { host, copied: true }, _) => {
                    self.f
                        .write_all(chunk, host + in_cluster, "write data to")?;
                }
                (
                    Mapping::Data {
                        host,
                        copied: false,
                    },
                    _,
                ) => {
                    return Err(Error::Unsupported {
                        path: self.f.path.clone(),
                        feature: format!(
                            "writing a shared cluster (at {host:#x}, refcount above 1)"
                        ),
                    });
                }
                (mapping, l2) => {
                    self.write_new_cluster(vcluster, in_cluster, chunk, mapping, l2)?;
                }
            }
            done += n;
        }
        Ok(())
    }

    /// Gives guest cluster `vcluster` a new host cluster holding `chunk` at
    /// `in_cluster` and, around it, what the cluster read before.
    fn write_new_cluster(
        &mut self,
        vcluster: u64,
        in_cluster: u64,
        chunk: &[u8],
        mapping: Mapping,
        l2: Option<u64>,
    ) -> Result<()> {
        let cs = self.cluster_size();
        let host = self.allocate()?;
        // What the rest of the cluster must hold: the backing data, or
        // zeros, which a new cluster already reads as (it lies past
        // everything ever written to the file).
        let copy = match (mapping, &mut self.backing) {
            (Mapping::Unallocated, Some(backing)) => {
                !backing.known_zero(vcluster << self.cluster_bits, cs)?
            }
            _ => false,
        };
        if chunk.len() as u64 == cs || !copy {
            self.f
                .write_all(chunk, host + in_cluster, "write data to")?;
        } else {
            let mut cluster = std::mem::take(&mut self.scratch);
            cluster.resize(cs as usize, 0);
            let result = (|| {
                if let Some(backing) = &mut self.backing {
                    backing.read(&mut cluster, vcluster << self.cluster_bits)?;
                }
                let at = in_cluster as usize;
                cluster[at..at + chunk.len()].copy_from_slice(chunk);
                self.f.write_all(&cluster, host, "write data to")
            })();
            self.scratch = cluster;
            result?;
        }
        let index = (vcluster & ((1 << self.l2_bits) - 1)) as usize;
        let entry = host | OFLAG_COPIED;
        match l2 {
            Some(l2) => {
                self.f.write_all(
                    &entry.to_be_bytes(),
                    l2 + index as u64 * 8,
                    "write an L2 table of",
                )?;
                if let Some(table) = self.l2_cache.get_mut(l2) {
                    if let Some(slot) = table.get_mut(index) {
                        *slot = entry;
                    }
                }
            }
            None => {
                let l2 = self.allocate()?;
                let mut table = vec![0u64; 1 << self.l2_bits];
                if let Some(slot) = table.get_mut(index) {
                    *slot = entry;
                }
                let bytes: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
                self.f.write_all(&bytes, l2, "write an L2 table of")?;
                self.l2_cache.insert(l2, table);
                let l1_index = (vcluster >> self.l2_bits) as usize;
                let l1_entry = l2 | OFLAG_COPIED;
                self.f.write_all(
                    &l1_entry.to_be_bytes(),
                    self.header.l1_table_offset + l1_index as u64 * 8,
                    "write the L1 table of",
                )?;
                if let Some(slot) = self.l1.get_mut(l1_index) {
                    *slot = l1_entry;
                }
            }
        }
        if let Mapping::Zero { prealloc } = mapping {
            if prealloc != 0 {
                if let Some(refcounts) = &mut self.refcounts {
                    refcounts.free(&mut self.f, prealloc)?;
                }
            }
        }
        Ok(())
    }

    /// Returns unused reserved clusters and syncs the file.
    fn flush_image(&mut self) -> Result<()> {
        if let Some(refcounts) = &mut self.refcounts {
            refcounts.release_pool(&mut self.f)?;
            self.f.sync()?;
        }
        Ok(())
    }
}

impl BlockBackend for Qcow2 {
    fn size(&self) -> u64 {
        self.size
    }

    fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len(), self.size)?;
        Ok(self.read(buf, offset)?)
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.read_only {
            return Err(io::ErrorKind::PermissionDenied.into());
        }
        check_range(offset, buf.len(), self.size)?;
        Ok(self.write(buf, offset)?)
    }

    /// Gives unused reserved clusters back, then `fdatasync`.
    fn flush(&mut self) -> io::Result<()> {
        Ok(self.flush_image()?)
    }
}

impl Drop for Qcow2 {
    fn drop(&mut self) {
        // Leaves no leaked clusters behind on a clean close; on failure the
        // clusters stay leaked, which is harmless.
        if let Some(refcounts) = &mut self.refcounts {
            if let Err(e) = refcounts.release_pool(&mut self.f) {
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "{}: cannot give back the clusters reserved for writes, which stay leaked",
                    self.f.path.display()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests;
