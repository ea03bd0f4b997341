//! tine-disk: disk images, raw files and qcow2 copy-on-write chains.
//!
//! tine's disks form chains: an image (a raw ext4 file or a qcow2) is the
//! backing file of a VM's disk, a qcow2 overlay; committing makes that
//! overlay immutable, and forks are new overlays on it. This crate reads
//! and writes such chains itself (no C library, no KVM): the VMM's
//! virtio-blk serves guests from it and the daemon manages chains with it.
//!
//! - [`BlockBackend`]: a disk as a block device sees it; [`open_disk`]
//!   opens any disk as one, [`RawFile`] and [`Qcow2`] implement it;
//! - [`create_overlay`], [`create_empty`], [`create`]: new qcow2 files, in
//!   time independent of the size of the backing file;
//! - [`info`], [`backing_chain`], [`detect_format`]: what a file is;
//! - [`check`]: a metadata consistency check;
//! - [`flatten`]: a chain's contents as one standalone qcow2.
//!
//! Every file written here is accepted by `qemu-img check`. See
//! [`qcow2`] for the on-disk format, what is supported and how crashes are
//! survived.

pub mod backend;
pub mod qcow2;
pub mod raw;

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

pub use backend::{check_range, BlockBackend};
pub use qcow2::{
    check, create, create_empty, create_overlay, flatten, sync_created, CheckReport, CreateOptions,
    Durability, Qcow2,
};
pub use raw::RawFile;

use raw::ProbedRaw;

/// The deepest backing chain that is opened (the top image included).
pub const MAX_CHAIN_DEPTH: usize = 256;

/// A disk image format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// Sector `n` at byte `512 * n` of the file.
    Raw,
    /// QEMU copy-on-write, version 2 or 3.
    Qcow2,
}

impl Format {
    /// The name qemu uses for the format (`raw`, `qcow2`).
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        }
    }

    /// The format named `name` as qemu spells it, if supported.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "raw" => Some(Format::Raw),
            "qcow2" => Some(Format::Qcow2),
            _ => None,
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a disk image could not be opened, created or inspected.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A system call on a file failed.
    #[error("cannot {op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The system error.
        #[source]
        source: io::Error,
    },
    /// The file is not a well-formed qcow2 image.
    #[error("{path} is not a valid qcow2 image: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, with offsets where they help.
        reason: String,
    },
    /// The image uses a qcow2 feature this implementation does not have.
    #[error("{path} uses an unsupported qcow2 feature: {feature}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// The feature.
        feature: String,
    },
    /// The image has qemu's corrupt bit set.
    #[error("{0} is marked corrupt; repair it with `qemu-img check -r all`")]
    MarkedCorrupt(PathBuf),
    /// The image was left dirty by a writer using lazy refcounts, so its
    /// refcounts cannot be trusted for writing.
    #[error("{0} was not closed cleanly (dirty bit set); repair it with `qemu-img check -r all`")]
    Dirty(PathBuf),
    /// A backing chain names a file it already contains.
    #[error("backing chain loops: {path} is already in the chain")]
    BackingLoop {
        /// The file met twice.
        path: PathBuf,
    },
    /// A backing chain is deeper than [`MAX_CHAIN_DEPTH`].
    #[error("backing chain of {0} is deeper than {MAX_CHAIN_DEPTH} images")]
    ChainTooDeep(PathBuf),
    /// A caller's argument cannot be honoured.
    #[error("{0}")]
    InvalidArgument(String),
}

impl From<Error> for io::Error {
    /// I/O errors keep their kind; format errors become `InvalidData`.
    fn from(e: Error) -> Self {
        let kind = match &e {
            Error::Io { source, .. } => source.kind(),
            Error::InvalidArgument(_) => io::ErrorKind::InvalidInput,
            Error::Unsupported { .. } => io::ErrorKind::Unsupported,
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Maps an `io::Error` from `op` on `path` to [`Error::Io`].
pub(crate) fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::Io { op, path, source }
}

/// What [`info`] found about one image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    /// The image, as it was named (by the caller or, for a backing file,
    /// resolved from the name in its child's header).
    pub path: PathBuf,
    /// Its format.
    pub format: Format,
    /// Size of the disk it holds, in bytes.
    pub virtual_size: u64,
    /// qcow2 cluster size in bytes (`None` for raw).
    pub cluster_size: Option<u64>,
    /// qcow2 version, 2 or 3 (`None` for raw).
    pub version: Option<u32>,
    /// The backing file name exactly as stored in the header.
    pub backing: Option<PathBuf>,
    /// [`ImageInfo::backing`] resolved relative to this image's directory,
    /// as qemu resolves it.
    pub backing_path: Option<PathBuf>,
    /// The backing format named in the header (`None`: not named, the
    /// backing file is probed).
    pub backing_format: Option<Format>,
    /// Length of the file in bytes.
    pub file_size: u64,
    /// Bytes the file occupies on its filesystem.
    pub allocated_bytes: u64,
    /// qemu's dirty bit (lazy refcounts, not closed cleanly).
    pub dirty: bool,
    /// qemu's corrupt bit.
    pub corrupt: bool,
}

/// Opens `path` for reading, close-on-exec.
pub(crate) fn open_read(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err("open", path))
}

/// The format of `path`, by its first bytes: the qcow2 magic or else raw.
pub fn detect_format(path: &Path) -> Result<Format> {
    let file = open_read(path)?;
    detect_file_format(&file, path)
}

pub(crate) fn detect_file_format(file: &File, path: &Path) -> Result<Format> {
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < magic.len() {
        match file.read_at(&mut magic[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read", path)(e)),
        }
    }
    Ok(if got == magic.len() && magic == qcow2::MAGIC {
        Format::Qcow2
    } else {
        Format::Raw
    })
}

/// Resolves a backing file name found in the header of `image` the way
/// qemu does: absolute names as they are, relative ones against the
/// directory of `image` (as named, not canonicalized).
pub fn resolve_backing(image: &Path, backing: &Path) -> PathBuf {
    if backing.is_absolute() {
        return backing.to_path_buf();
    }
    match image.parent() {
        Some(dir) => dir.join(backing),
        None => backing.to_path_buf(),
    }
}

/// The backing name bytes of a header as a path.
pub(crate) fn path_from_bytes(bytes: &[u8]) -> PathBuf {
    PathBuf::from(OsStr::from_bytes(bytes))
}

/// What `path` is: its format, size and backing file.
pub fn info(path: &Path) -> Result<ImageInfo> {
    let file = open_read(path)?;
    let meta = file.metadata().map_err(io_err("stat", path))?;
    let format = detect_file_format(&file, path)?;
    let file_size = file_length(&file, path)?;
    let mut info = ImageInfo {
        path: path.to_path_buf(),
        format,
        virtual_size: file_size,
        cluster_size: None,
        version: None,
        backing: None,
        backing_path: None,
        backing_format: None,
        file_size,
        allocated_bytes: meta.blocks() * 512,
        dirty: false,
        corrupt: false,
    };
    if format == Format::Qcow2 {
        let header = qcow2::header::Header::read(&file, file_size, path)?;
        info.virtual_size = header.size;
        info.cluster_size = Some(header.cluster_size());
        info.version = Some(header.version);
        info.backing_path = header
            .backing_file
            .as_ref()
            .map(|name| resolve_backing(path, name));
        info.dirty = header.is_dirty();
        info.corrupt = header.is_corrupt();
        info.backing = header.backing_file;
        info.backing_format = header.backing_format;
    }
    Ok(info)
}

/// [`info`] of `path` and of every file below it in its backing chain, top
/// first. Fails on loops and chains deeper than [`MAX_CHAIN_DEPTH`].
pub fn backing_chain(path: &Path) -> Result<Vec<ImageInfo>> {
    let mut chain: Vec<ImageInfo> = Vec::new();
    let mut seen = Vec::new();
    let mut next = Some(path.to_path_buf());
    while let Some(current) = next.take() {
        if chain.len() >= MAX_CHAIN_DEPTH {
            return Err(Error::ChainTooDeep(path.to_path_buf()));
        }
        let meta = std::fs::metadata(&current).map_err(io_err("stat", &current))?;
        let id = (meta.dev(), meta.ino());
        if seen.contains(&id) {
            return Err(Error::BackingLoop { path: current });
        }
        seen.push(id);
        let mut image = info(&current)?;
        // A backing file named raw in its child's header is raw whatever its
        // first bytes say.
        if let Some(parent) = chain.last() {
            if parent.backing_format == Some(Format::Raw) {
                image = raw_info(&current)?;
            }
        }
        next = image.backing_path.clone();
        chain.push(image);
    }
    Ok(chain)
}

fn raw_info(path: &Path) -> Result<ImageInfo> {
    let file = open_read(path)?;
    let meta = file.metadata().map_err(io_err("stat", path))?;
    let file_size = file_length(&file, path)?;
    Ok(ImageInfo {
        path: path.to_path_buf(),
        format: Format::Raw,
        virtual_size: file_size,
        cluster_size: None,
        version: None,
        backing: None,
        backing_path: None,
        backing_format: None,
        file_size,
        allocated_bytes: meta.blocks() * 512,
        dirty: false,
        corrupt: false,
    })
}

/// Length of a file or block device.
pub(crate) fn file_length(file: &File, path: &Path) -> Result<u64> {
    use std::io::Seek;
    let mut file = file;
    file.seek(io::SeekFrom::End(0))
        .map_err(io_err("seek", path))
}

/// Opens `path` as a disk for virtio-blk, in the format its first bytes
/// say (qcow2 or raw). A qcow2's backing chain is opened read-only.
///
/// A raw disk opened this way refuses guest writes that would make it
/// look like a qcow2 image (qemu does the same), so a guest cannot turn
/// its disk into an image whose backing file names a host file.
pub fn open_disk(path: &Path, read_only: bool) -> Result<Box<dyn BlockBackend>> {
    match detect_format(path)? {
        Format::Raw => {
            let raw = RawFile::open(path, read_only).map_err(io_err("open", path))?;
            Ok(Box::new(ProbedRaw(raw)))
        }
        Format::Qcow2 => Ok(Box::new(Qcow2::open(path, read_only)?)),
    }
}

/// Opens `path` as a disk in the given `format`, without probing.
pub fn open_disk_as(path: &Path, format: Format, read_only: bool) -> Result<Box<dyn BlockBackend>> {
    match format {
        Format::Raw => Ok(Box::new(
            RawFile::open(path, read_only).map_err(io_err("open", path))?,
        )),
        Format::Qcow2 => Ok(Box::new(Qcow2::open(path, read_only)?)),
    }
}
