//! The qcow2 header (versions 2 and 3) and its extensions.
//!
//! All fields are big-endian. Parsing checks every field that later code
//! uses as an offset or a size, so the rest of the implementation can
//! trust a [`Header`] (it still checks table entries, which are data).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{unaligned, MAGIC};
use crate::{io_err, path_from_bytes, Error, Format, Result};

/// Smallest cluster: 512 bytes.
pub const MIN_CLUSTER_BITS: u32 = 9;
/// Largest cluster: 2 MiB.
pub const MAX_CLUSTER_BITS: u32 = 21;
/// Cluster size of the images tine creates: 64 KiB.
pub const DEFAULT_CLUSTER_BITS: u32 = 16;
/// Largest L1 table accepted, in bytes (qemu's limit).
pub const MAX_L1_BYTES: u64 = 32 << 20;
/// Largest refcount table accepted, in bytes (qemu's limit).
pub const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// Longest backing file name (qemu's limit).
pub const MAX_BACKING_NAME: u32 = 1023;
/// Largest virtual size accepted or created: 2^56 bytes (64 PiB), well
/// inside what the 56-bit offsets of L1/L2 entries can map.
pub const MAX_VIRTUAL_SIZE: u64 = 1 << 56;

/// Length of a version 2 header.
pub const V2_HEADER_LEN: u32 = 72;
/// Length of the fixed part of a version 3 header.
pub const V3_HEADER_MIN_LEN: u32 = 104;
/// Length of the version 3 header tine writes (with the compression type
/// byte, padded to 8).
pub const V3_HEADER_LEN: u32 = 112;

/// Incompatible feature: refcounts may be stale (lazy refcounts).
pub const INCOMPAT_DIRTY: u64 = 1 << 0;
/// Incompatible feature: the image is corrupt.
pub const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTL2: u64 = 1 << 4;

/// Header extension: end of the extension area.
const EXT_END: u32 = 0;
/// Header extension: backing file format name.
pub const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// Header extension: external data file name.
const EXT_DATA_FILE: u32 = 0x4441_5441;
/// Header extension: full disk encryption header.
const EXT_CRYPTO: u32 = 0x0537_be77;
/// Header extension: bitmaps.
const EXT_BITMAPS: u32 = 0x2385_2875;

/// Offset of `refcount_table_offset`; `refcount_table_clusters` follows.
pub const REFTABLE_FIELDS_OFFSET: u64 = 48;
/// Offset of `autoclear_features`.
pub const AUTOCLEAR_OFFSET: u64 = 88;

/// A parsed and checked qcow2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// Offset of the backing file name in the file (0: none).
    pub backing_file_offset: u64,
    /// Length of the backing file name.
    pub backing_file_size: u32,
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    /// Entries in the active L1 table.
    pub l1_size: u32,
    /// Offset of the active L1 table.
    pub l1_table_offset: u64,
    /// Offset of the refcount table.
    pub refcount_table_offset: u64,
    /// Clusters the refcount table occupies.
    pub refcount_table_clusters: u32,
    /// Number of internal snapshots.
    pub nb_snapshots: u32,
    /// Offset of the snapshot table.
    pub snapshots_offset: u64,
    /// Incompatible feature bits (v3).
    pub incompatible_features: u64,
    /// Compatible feature bits (v3).
    pub compatible_features: u64,
    /// Auto-clear feature bits (v3).
    pub autoclear_features: u64,
    /// log2 of the refcount width in bits (4 in v2).
    pub refcount_order: u32,
    /// Length of the header proper; extensions follow it.
    pub header_length: u32,
    /// The backing file name, as stored.
    pub backing_file: Option<PathBuf>,
    /// The backing format extension, if any.
    pub backing_format: Option<Format>,
    /// Whether a bitmaps extension is present.
    pub has_bitmaps: bool,
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut v = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        v.copy_from_slice(s);
    }
    u32::from_be_bytes(v)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        v.copy_from_slice(s);
    }
    u64::from_be_bytes(v)
}

/// Names of incompatible feature bits in `bits` that this implementation
/// cannot handle (dirty and corrupt are handled by the caller).
pub fn unsupported_incompatible(bits: u64) -> Vec<String> {
    let mut names = Vec::new();
    for bit in 0..64 {
        let mask = 1u64 << bit;
        if bits & mask == 0 || mask == INCOMPAT_DIRTY || mask == INCOMPAT_CORRUPT {
            continue;
        }
        names.push(match mask {
            INCOMPAT_DATA_FILE => "external data file (incompatible bit 2)".to_string(),
            INCOMPAT_COMPRESSION => "non-zlib compression type (incompatible bit 3)".to_string(),
            INCOMPAT_EXTL2 => "extended L2 entries (incompatible bit 4)".to_string(),
            _ => format!("unknown incompatible feature bit {bit}"),
        });
    }
    names
}

impl Header {
    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Whether the dirty bit is set.
    pub fn is_dirty(&self) -> bool {
        self.incompatible_features & INCOMPAT_DIRTY != 0
    }

    /// Whether the corrupt bit is set.
    pub fn is_corrupt(&self) -> bool {
        self.incompatible_features & INCOMPAT_CORRUPT != 0
    }

    /// L1 entries needed to map `size` bytes with clusters of
    /// `1 << cluster_bits` bytes.
    pub fn l1_entries_for(size: u64, cluster_bits: u32) -> u64 {
        let l2_span_bits = cluster_bits + cluster_bits - 3;
        size.div_ceil(1 << l2_span_bits)
    }

    /// Reads and checks the header of `file` (`file_len` bytes long).
    pub fn read(file: &File, file_len: u64, path: &Path) -> Result<Self> {
        let invalid = |reason: String| Error::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        if file_len < u64::from(V2_HEADER_LEN) {
            return Err(invalid(format!(
                "file is {file_len} bytes, too short for a header"
            )));
        }
        let mut fixed = [0u8; V3_HEADER_MIN_LEN as usize];
        let fixed_len = (file_len.min(fixed.len() as u64)) as usize;
        file.read_exact_at(&mut fixed[..fixed_len], 0)
            .map_err(io_err("read the header of", path))?;
        if fixed[..4] != MAGIC {
            return Err(invalid("bad magic".into()));
        }
        let version = be32(&fixed, 4);
        if version != 2 && version != 3 {
            return Err(Error::Unsupported {
                path: path.to_path_buf(),
                feature: format!("version {version}"),
            });
        }
        let cluster_bits = be32(&fixed, 20);
        if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
            return Err(invalid(format!(
                "cluster_bits {cluster_bits} outside {MIN_CLUSTER_BITS}..={MAX_CLUSTER_BITS}"
            )));
        }
        let cluster_size = 1u64 << cluster_bits;
        let mut h = Header {
            version,
            backing_file_offset: be64(&fixed, 8),
            backing_file_size: be32(&fixed, 16),
            cluster_bits,
            size: be64(&fixed, 24),
            l1_size: be32(&fixed, 36),
            l1_table_offset: be64(&fixed, 40),
            refcount_table_offset: be64(&fixed, 48),
            refcount_table_clusters: be32(&fixed, 56),
            nb_snapshots: be32(&fixed, 60),
            snapshots_offset: be64(&fixed, 64),
            incompatible_features: 0,
            compatible_features: 0,
            autoclear_features: 0,
            refcount_order: 4,
            header_length: V2_HEADER_LEN,
            backing_file: None,
            backing_format: None,
            has_bitmaps: false,
        };
        let crypt_method = be32(&fixed, 32);
        if crypt_method != 0 {
            return Err(Error::Unsupported {
                path: path.to_path_buf(),
                feature: format!("encryption (method {crypt_method})"),
            });
        }
        if version == 3 {
            if file_len < u64::from(V3_HEADER_MIN_LEN) {
                return Err(invalid(format!(
                    "file is {file_len} bytes, too short for a version 3 header"
                )));
            }
            h.incompatible_features = be64(&fixed, 72);
            h.compatible_features = be64(&fixed, 80);
            h.autoclear_features = be64(&fixed, 88);
            h.refcount_order = be32(&fixed, 96);
            h.header_length = be32(&fixed, 100);
            if h.header_length < V3_HEADER_MIN_LEN
                || h.header_length & 7 != 0
                || u64::from(h.header_length) > cluster_size
            {
                return Err(invalid(format!("header length {}", h.header_length)));
            }
            if h.refcount_order > 6 {
                return Err(invalid(format!("refcount order {}", h.refcount_order)));
            }
        }

        // Sizes and tables.
        if h.size > MAX_VIRTUAL_SIZE {
            return Err(invalid(format!("virtual size {} too large", h.size)));
        }
        let l1_needed = Self::l1_entries_for(h.size, cluster_bits);
        if u64::from(h.l1_size) < l1_needed {
            return Err(invalid(format!(
                "L1 table has {} entries, the virtual size needs {l1_needed}",
                h.l1_size
            )));
        }
        let l1_bytes = u64::from(h.l1_size) * 8;
        if l1_bytes > MAX_L1_BYTES {
            return Err(invalid(format!("L1 table of {} entries", h.l1_size)));
        }
        check_table(
            "L1 table",
            h.l1_table_offset,
            l1_bytes,
            cluster_size,
            file_len,
        )
        .map_err(invalid)?;
        let reftable_bytes = u64::from(h.refcount_table_clusters) * cluster_size;
        if h.refcount_table_clusters == 0 || reftable_bytes > MAX_REFTABLE_BYTES {
            return Err(invalid(format!(
                "refcount table of {} clusters",
                h.refcount_table_clusters
            )));
        }
        check_table(
            "refcount table",
            h.refcount_table_offset,
            reftable_bytes,
            cluster_size,
            file_len,
        )
        .map_err(invalid)?;
        if h.nb_snapshots > 65536 {
            return Err(invalid(format!("{} snapshots", h.nb_snapshots)));
        }
        if h.nb_snapshots > 0 && unaligned(h.snapshots_offset, cluster_size) {
            return Err(invalid("snapshot table offset unaligned".into()));
        }

        // The rest of cluster 0: extensions and the backing file name.
        let area_len = cluster_size.min(file_len);
        let mut area = vec![0u8; area_len as usize];
        file.read_exact_at(&mut area, 0)
            .map_err(io_err("read the header of", path))?;
        if h.backing_file_offset != 0 {
            let end = h
                .backing_file_offset
                .checked_add(u64::from(h.backing_file_size))
                .filter(|&end| end <= area_len);
            let Some(end) = end else {
                return Err(invalid(
                    "backing file name outside the first cluster".into(),
                ));
            };
            if h.backing_file_size > MAX_BACKING_NAME {
                return Err(invalid(format!(
                    "backing file name of {} bytes",
                    h.backing_file_size
                )));
            }
            let name = area
                .get(h.backing_file_offset as usize..end as usize)
                .unwrap_or_default();
            if name.is_empty() || name.contains(&0) {
                return Err(invalid("empty backing file name or one with NUL".into()));
            }
            h.backing_file = Some(path_from_bytes(name));
        }
        let ext_end = if h.backing_file_offset != 0 {
            h.backing_file_offset.min(area_len)
        } else {
            area_len
        };
        h.parse_extensions(&area, ext_end, path)?;
        Ok(h)
    }

    fn parse_extensions(&mut self, area: &[u8], ext_end: u64, path: &Path) -> Result<()> {
        let invalid = |reason: String| Error::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let mut at = u64::from(self.header_length);
        while at + 8 <= ext_end {
            let kind = be32(area, at as usize);
            let len = u64::from(be32(area, at as usize + 4));
            at += 8;
            if kind == EXT_END {
                break;
            }
            let data_end = at
                .checked_add(len)
                .filter(|&e| e <= ext_end)
                .ok_or_else(|| invalid(format!("header extension {kind:#x} overruns")))?;
            let data = area.get(at as usize..data_end as usize).unwrap_or_default();
            match kind {
                EXT_BACKING_FORMAT => {
                    let name = String::from_utf8_lossy(data);
                    let format = Format::from_name(&name).ok_or_else(|| Error::Unsupported {
                        path: path.to_path_buf(),
                        feature: format!("backing format {name:?}"),
                    })?;
                    self.backing_format = Some(format);
                }
                EXT_DATA_FILE => {
                    return Err(Error::Unsupported {
                        path: path.to_path_buf(),
                        feature: "external data file".into(),
                    })
                }
                EXT_CRYPTO => {
                    return Err(Error::Unsupported {
                        path: path.to_path_buf(),
                        feature: "encryption".into(),
                    })
                }
                EXT_BITMAPS => self.has_bitmaps = true,
                _ => {}
            }
            at = data_end.next_multiple_of(8);
        }
        Ok(())
    }
}

/// Checks that a table of `len` bytes at `offset` is cluster-aligned and
/// lies inside a file of `file_len` bytes.
pub fn check_table(
    what: &str,
    offset: u64,
    len: u64,
    cluster_size: u64,
    file_len: u64,
) -> Result<(), String> {
    if len == 0 {
        return Ok(());
    }
    if offset == 0 || unaligned(offset, cluster_size) {
        return Err(format!("{what} at unaligned offset {offset:#x}"));
    }
    match offset.checked_add(len) {
        Some(end) if end <= file_len => Ok(()),
        _ => Err(format!(
            "{what} at {offset:#x} ({len} bytes) is past the end of the file ({file_len} bytes)"
        )),
    }
}

/// What to write in the first cluster of a new version 3 image.
#[derive(Debug, Clone)]
pub struct NewHeader<'a> {
    /// log2 of the cluster size.
    pub cluster_bits: u32,
    /// Virtual size.
    pub size: u64,
    /// L1 entries.
    pub l1_size: u32,
    /// L1 table offset.
    pub l1_table_offset: u64,
    /// Refcount table offset.
    pub refcount_table_offset: u64,
    /// Refcount table clusters.
    pub refcount_table_clusters: u32,
    /// Backing file name and format.
    pub backing: Option<(&'a [u8], Format)>,
}

impl NewHeader<'_> {
    /// The header, its extensions and the backing name, ready to be
    /// written at offset 0. Fails if they do not fit in one cluster.
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let mut b = Vec::with_capacity(512);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&3u32.to_be_bytes());
        b.extend_from_slice(&0u64.to_be_bytes()); // backing offset, patched below
        b.extend_from_slice(&0u32.to_be_bytes()); // backing size, patched below
        b.extend_from_slice(&self.cluster_bits.to_be_bytes());
        b.extend_from_slice(&self.size.to_be_bytes());
        b.extend_from_slice(&0u32.to_be_bytes()); // crypt_method
        b.extend_from_slice(&self.l1_size.to_be_bytes());
        b.extend_from_slice(&self.l1_table_offset.to_be_bytes());
        b.extend_from_slice(&self.refcount_table_offset.to_be_bytes());
        b.extend_from_slice(&self.refcount_table_clusters.to_be_bytes());
        b.extend_from_slice(&0u32.to_be_bytes()); // nb_snapshots
        b.extend_from_slice(&0u64.to_be_bytes()); // snapshots_offset
        b.extend_from_slice(&0u64.to_be_bytes()); // incompatible
        b.extend_from_slice(&0u64.to_be_bytes()); // compatible
        b.extend_from_slice(&0u64.to_be_bytes()); // autoclear
        b.extend_from_slice(&4u32.to_be_bytes()); // refcount_order
        b.extend_from_slice(&V3_HEADER_LEN.to_be_bytes());
        b.push(0); // compression type: zlib
        b.resize(V3_HEADER_LEN as usize, 0);
        if let Some((name, format)) = self.backing {
            let fmt = format.as_str().as_bytes();
            b.extend_from_slice(&EXT_BACKING_FORMAT.to_be_bytes());
            b.extend_from_slice(&(fmt.len() as u32).to_be_bytes());
            b.extend_from_slice(fmt);
            b.resize(b.len().next_multiple_of(8), 0);
            b.extend_from_slice(&[0; 8]); // end of extensions
            if name.is_empty() || name.len() > MAX_BACKING_NAME as usize || name.contains(&0) {
                return Err(format!(
                    "backing file name must be 1..={MAX_BACKING_NAME} bytes without NUL"
                ));
            }
            let offset = b.len() as u64;
            b[8..16].copy_from_slice(&offset.to_be_bytes());
            b[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
            b.extend_from_slice(name);
        } else {
            b.extend_from_slice(&[0; 8]);
        }
        if b.len() as u64 > 1 << self.cluster_bits {
            return Err(format!(
                "header and backing file name ({} bytes) do not fit in a {}-byte cluster",
                b.len(),
                1u64 << self.cluster_bits
            ));
        }
        Ok(b)
    }
}
