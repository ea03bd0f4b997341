//! Write sets: the pages of a snapshot's memory file that a VM restored
//! from it wrote, saved so that the next VM restored from the same file
//! can copy them ahead of its guest's first touch.
//!
//! A restored VM maps the memory file copy-on-write, so each page its
//! guest writes first costs a fault and a copy (and, when the guest read
//! the page before, a second fault: the first one mapped it read-only).
//! VMs restored from one snapshot and set up alike (a hot fork's fix-ups)
//! write much the same pages, so the pages one of them wrote are what the
//! next ones will write: copied ahead while they wait in a pool, those
//! faults are off their path, and no memory is spent that their guests
//! would not take anyway.
//!
//! The file is JSON (a few hundred ranges): its version, the memory size
//! it is for, and sorted, disjoint, page-aligned byte ranges of the memory
//! file.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::temp_name;
use crate::vstate::memory::PAGE_SIZE;

/// The write-set format this build writes and reads.
pub const WRITE_SET_VERSION: u32 = 1;

/// Largest write-set file read, in bytes (about a million ranges).
pub const MAX_WRITE_SET_FILE: u64 = 32 << 20;

/// A write set as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteSet {
    /// [`WRITE_SET_VERSION`].
    pub version: u32,
    /// Bytes of guest RAM of the VMs it is for.
    pub memory_size: u64,
    /// Byte ranges `start..end` of the memory file (each `[start, end]` in
    /// the file), as
    /// [`GuestRam::written_pages`](crate::vstate::memory::GuestRam::written_pages)
    /// gives them and
    /// [`GuestRam::populate_ranges`](crate::vstate::memory::GuestRam::populate_ranges)
    /// takes them.
    pub ranges: Vec<(u64, u64)>,
}

/// Why a write set cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WriteSetError {
    /// The file could not be read or written.
    #[error("write set {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is larger than any write set.
    #[error("write set {path} has {bytes} bytes, more than the {MAX_WRITE_SET_FILE} a write set may have")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        bytes: u64,
    },
    /// The file is not a write set.
    #[error("write set {path} cannot be decoded")]
    Decode {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The file is a write set of another format version.
    #[error(
        "write set {path} has format version {found}; this tine-vmm reads {WRITE_SET_VERSION}"
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
    },
    /// The write set is for VMs of another memory size.
    #[error("write set {path} is for {found} bytes of guest RAM, this VM has {expected}")]
    MemorySize {
        /// The file.
        path: PathBuf,
        /// The VM's RAM.
        expected: u64,
        /// The write set's.
        found: u64,
    },
    /// A range is empty, not page-aligned, past the memory's end, or out of
    /// order.
    #[error("write set {path}: range {index} ({start:#x}..{end:#x}) {why}")]
    Range {
        /// The file.
        path: PathBuf,
        /// Its position in the list.
        index: usize,
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
        /// What is wrong with it.
        why: &'static str,
    },
}

impl WriteSet {
    /// A write set of the ranges `ranges` of `memory_size` bytes of RAM.
    pub fn new(memory_size: u64, ranges: Vec<(u64, u64)>) -> Self {
        WriteSet {
            version: WRITE_SET_VERSION,
            memory_size,
            ranges,
        }
    }

    /// Bytes of memory its ranges cover.
    pub fn bytes(&self) -> u64 {
        self.ranges
            .iter()
            .map(|(start, end)| end.saturating_sub(*start))
            .sum()
    }

    /// Writes it to `path`: to a temporary name beside it, synced, then
    /// renamed over `path`, so a reader finds the old file or the whole new
    /// one, also after a crash.
    pub fn save(&self, path: &Path) -> Result<(), WriteSetError> {
        let io = |source| WriteSetError::Io {
            path: path.to_path_buf(),
            source,
        };
        let tmp = temp_name(path);
        let encoded = serde_json::to_vec(self).map_err(|e| io(std::io::Error::other(e)))?;
        let written = File::create(&tmp)
            .and_then(|mut f| f.write_all(&encoded).and_then(|()| f.sync_all()))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            if let Err(removed) = std::fs::remove_file(&tmp) {
                if removed.kind() != std::io::ErrorKind::NotFound {
                    eprintln!("tine-vmm: cannot remove {}: {removed}", tmp.display());
                }
            }
            return Err(io(e));
        }
        Ok(())
    }

    /// Reads the write set at `path` for a VM of `memory_size` bytes of
    /// RAM, and checks all of it: a file of another version or size, or one
    /// range that is empty, not page-aligned, out of order or past the
    /// memory's end, refuses the whole file.
    pub fn load(path: &Path, memory_size: u64) -> Result<Self, WriteSetError> {
        let io = |source| WriteSetError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let bytes = file.metadata().map_err(io)?.len();
        if bytes > MAX_WRITE_SET_FILE {
            return Err(WriteSetError::TooLarge {
                path: path.to_path_buf(),
                bytes,
            });
        }
        let mut text = Vec::with_capacity(bytes as usize);
        file.take(MAX_WRITE_SET_FILE)
            .read_to_end(&mut text)
            .map_err(io)?;
        let set: WriteSet =
            serde_json::from_slice(&text).map_err(|source| WriteSetError::Decode {
                path: path.to_path_buf(),
                source,
            })?;
        if set.version != WRITE_SET_VERSION {
            return Err(WriteSetError::Version {
                path: path.to_path_buf(),
                found: set.version,
            });
        }
        if set.memory_size != memory_size {
            return Err(WriteSetError::MemorySize {
                path: path.to_path_buf(),
                expected: memory_size,
                found: set.memory_size,
            });
        }
        let page = PAGE_SIZE as u64;
        let mut previous_end = 0u64;
        for (index, &(start, end)) in set.ranges.iter().enumerate() {
            let why = if start >= end {
                Some("is empty")
            } else if start % page != 0 || end % page != 0 {
                Some("is not page-aligned")
            } else if end > memory_size {
                Some("ends past the guest's RAM")
            } else if index > 0 && start < previous_end {
                Some("overlaps or precedes the range before it")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(WriteSetError::Range {
                    path: path.to_path_buf(),
                    index,
                    start,
                    end,
                    why,
                });
            }
            previous_end = end;
        }
        Ok(set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn saved(dir: &Path, set: &WriteSet) -> PathBuf {
        let path = dir.join("write-set");
        set.save(&path).expect("save");
        path
    }

    #[test]
    fn test_a_saved_write_set_loads_as_it_was() {
        let dir = tempfile::tempdir().expect("tmp");
        let set = WriteSet::new(16 * MIB, vec![(0, 0x2000), (0x5000, 0x6000)]);
        let path = saved(dir.path(), &set);
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(
            text, r#"{"version":1,"memory_size":16777216,"ranges":[[0,8192],[20480,24576]]}"#,
            "the format docs/vmm-control.md gives"
        );
        let loaded = WriteSet::load(&path, 16 * MIB).expect("load");
        assert_eq!(loaded, set);
        assert_eq!(loaded.bytes(), 0x3000);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["write-set"], "no temporary file is left");
    }

    #[test]
    fn test_a_bad_write_set_is_refused_with_what_is_wrong() {
        let dir = tempfile::tempdir().expect("tmp");
        let refused = |set: WriteSet| {
            let path = saved(dir.path(), &set);
            WriteSet::load(&path, 16 * MIB)
                .expect_err("refused")
                .to_string()
        };
        let cases = [
            (vec![(0x1000, 0x1000)], "is empty"),
            (vec![(0x1000, 0x1800)], "is not page-aligned"),
            (vec![(0x800, 0x1000)], "is not page-aligned"),
            (vec![(15 * MIB, 17 * MIB)], "ends past the guest's RAM"),
            (
                vec![(0x4000, 0x6000), (0x5000, 0x7000)],
                "overlaps or precedes",
            ),
            (
                vec![(0x4000, 0x5000), (0x1000, 0x2000)],
                "overlaps or precedes",
            ),
        ];
        for (ranges, why) in cases {
            let message = refused(WriteSet {
                version: WRITE_SET_VERSION,
                memory_size: 16 * MIB,
                ranges: ranges.clone(),
            });
            assert!(message.contains(why), "{ranges:?}: {message}");
        }
        let other_size = refused(WriteSet::new(32 * MIB, vec![]));
        assert!(
            other_size.contains("is for 33554432 bytes of guest RAM, this VM has 16777216"),
            "{other_size}"
        );
        let other_version = refused(WriteSet {
            version: 9,
            ..WriteSet::new(16 * MIB, vec![])
        });
        assert!(
            other_version.contains("format version 9"),
            "{other_version}"
        );

        let path = dir.path().join("garbage");
        std::fs::write(&path, b"\x00\x01 not json").expect("write");
        let garbage = WriteSet::load(&path, 16 * MIB).expect_err("garbage");
        assert!(
            matches!(garbage, WriteSetError::Decode { .. }),
            "{garbage:?}"
        );
        let missing = WriteSet::load(&dir.path().join("none"), 16 * MIB).expect_err("missing");
        assert!(matches!(missing, WriteSetError::Io { .. }), "{missing:?}");
    }

    #[test]
    fn test_an_oversized_file_is_refused_unread() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("huge");
        let f = File::create(&path).expect("create");
        f.set_len(MAX_WRITE_SET_FILE + 1).expect("grow");
        let e = WriteSet::load(&path, 16 * MIB).expect_err("huge");
        assert!(matches!(e, WriteSetError::TooLarge { .. }), "{e:?}");
    }
}
