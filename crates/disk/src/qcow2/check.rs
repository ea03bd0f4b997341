//! A metadata consistency check of one qcow2 file (not its backing chain).
//!
//! It reads the header, the L1, L2 and refcount tables (never data) and
//! counts the references to every cluster: tables must be aligned and
//! inside the file, no cluster may be used twice, and every refcount must
//! equal the number of references. A refcount above it is a leak (wasted
//! space, harmless); anything else is corruption.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::header::{unsupported_incompatible, Header};
use super::refcount::get_entry;
use super::{
    unaligned, ImageFile, L1E_OFFSET_MASK, L1E_RESERVED, L2E_OFFSET_MASK, L2E_RESERVED,
    OFLAG_COMPRESSED, OFLAG_COPIED, OFLAG_ZERO,
};
use crate::{file_length, open_read, Error, Result};

/// Corruption messages kept in a report; the rest are only counted.
const MAX_MESSAGES: usize = 100;

/// What [`check`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Number of problems that make the image unsafe to use.
    pub corruptions: u64,
    /// The first of them, described.
    pub messages: Vec<String>,
    /// Clusters whose refcount exceeds their references (wasted space).
    pub leaked_clusters: u64,
    /// Data clusters allocated in this file.
    pub data_clusters: u64,
    /// Clusters referenced by metadata or data.
    pub referenced_clusters: u64,
    /// What was not checked, and why.
    pub warnings: Vec<String>,
}

impl CheckReport {
    /// No corruption (leaks allowed).
    pub fn is_ok(&self) -> bool {
        self.corruptions == 0
    }

    /// No corruption and no leak.
    pub fn is_clean(&self) -> bool {
        self.corruptions == 0 && self.leaked_clusters == 0
    }

    fn corrupt(&mut self, message: String) {
        self.corruptions += 1;
        if self.messages.len() < MAX_MESSAGES {
            self.messages.push(message);
        }
    }
}

/// References counted per cluster of the file.
struct Refs {
    cluster_bits: u32,
    /// Clusters in the file.
    nb_clusters: u64,
    counts: HashMap<u64, u16>,
    /// Clusters holding compressed data, which may be shared.
    compressed: HashSet<u64>,
}

impl Refs {
    /// Counts one reference to each cluster of `len` bytes at `offset`.
    fn add(
        &mut self,
        report: &mut CheckReport,
        offset: u64,
        len: u64,
        what: &str,
        compressed: bool,
    ) {
        if len == 0 {
            return;
        }
        let first = offset >> self.cluster_bits;
        let last = (offset + len - 1) >> self.cluster_bits;
        if last >= self.nb_clusters {
            report.corrupt(format!(
                "{what} at {offset:#x} is past the end of the file (truncated?)"
            ));
            return;
        }
        for c in first..=last {
            let count = self.counts.entry(c).or_insert(0);
            *count = count.saturating_add(1);
            let shared_ok = compressed && self.compressed.contains(&c);
            if *count > 1 && !shared_ok {
                report.corrupt(format!(
                    "cluster {:#x} is used twice (again by {what})",
                    c << self.cluster_bits
                ));
            }
            if compressed {
                self.compressed.insert(c);
            }
        }
    }
}

fn be64s(raw: &[u8]) -> impl Iterator<Item = u64> + '_ {
    raw.chunks_exact(8).map(|c| {
        let mut e = [0u8; 8];
        e.copy_from_slice(c);
        u64::from_be_bytes(e)
    })
}

/// Checks the metadata of the qcow2 file at `path`.
///
/// Fails only if the file cannot be read or uses features this
/// implementation does not know; a malformed header, tables outside the
/// file, clusters used twice and wrong refcounts are reported as
/// corruption in the [`CheckReport`].
pub fn check(path: &Path) -> Result<CheckReport> {
    let file = open_read(path)?;
    let len = file_length(&file, path)?;
    let mut report = CheckReport::default();
    let header = match Header::read(&file, len, path) {
        Ok(header) => header,
        Err(e @ Error::Invalid { .. }) => {
            report.corrupt(e.to_string());
            return Ok(report);
        }
        Err(e) => return Err(e),
    };
    let unsupported = unsupported_incompatible(header.incompatible_features);
    if !unsupported.is_empty() {
        return Err(Error::Unsupported {
            path: path.to_path_buf(),
            feature: unsupported.join(", "),
        });
    }
    if header.is_corrupt() {
        report.corrupt("the corrupt bit is set".into());
    }
    let snapshots = header.nb_snapshots > 0;
    if snapshots {
        report.warnings.push(format!(
            "{} internal snapshots: their tables and the refcounts are not checked",
            header.nb_snapshots
        ));
    }
    if header.has_bitmaps {
        report
            .warnings
            .push("bitmaps are not traced: their clusters count as leaks".into());
    }
    if header.is_dirty() {
        report
            .warnings
            .push("dirty bit set: refcounts may be stale until repaired".into());
    }
    let f = ImageFile {
        file,
        path: path.to_path_buf(),
        len,
    };
    let cs = header.cluster_size();
    let bits = header.cluster_bits;
    let mut refs = Refs {
        cluster_bits: bits,
        nb_clusters: len.div_ceil(cs),
        counts: HashMap::new(),
        compressed: HashSet::new(),
    };
    refs.add(&mut report, 0, cs, "the header", false);
    let l1_bytes = u64::from(header.l1_size) * 8;
    refs.add(
        &mut report,
        header.l1_table_offset,
        l1_bytes,
        "the L1 table",
        false,
    );
    let reftable_bytes = u64::from(header.refcount_table_clusters) * cs;
    refs.add(
        &mut report,
        header.refcount_table_offset,
        reftable_bytes,
        "the refcount table",
        false,
    );

    // Refcount blocks.
    let mut raw = vec![0u8; reftable_bytes as usize];
    f.read_exact(
        &mut raw,
        header.refcount_table_offset,
        "read the refcount table of",
    )?;
    let mut blocks = Vec::new();
    let mut block_seen = HashSet::new();
    for (i, entry) in be64s(&raw).enumerate() {
        if entry == 0 {
            blocks.push(None);
            continue;
        }
        if entry & 0x1ff != 0 || unaligned(entry, cs) {
            report.corrupt(format!(
                "refcount table entry {i} is {entry:#x}: reserved bits or unaligned"
            ));
            blocks.push(None);
            continue;
        }
        if entry.checked_add(cs).is_none_or(|end| end > len) {
            report.corrupt(format!(
                "refcount block {i} at {entry:#x} is past the end of the file"
            ));
            blocks.push(None);
            continue;
        }
        if !block_seen.insert(entry) {
            report.corrupt(format!("refcount block {i} at {entry:#x} is named twice"));
            blocks.push(None);
            continue;
        }
        refs.add(
            &mut report,
            entry,
            cs,
            &format!("refcount block {i}"),
            false,
        );
        blocks.push(Some(entry));
    }

    // L1 and L2 tables.
    let mut raw_l1 = vec![0u8; l1_bytes as usize];
    f.read_exact(&mut raw_l1, header.l1_table_offset, "read the L1 table of")?;
    let mut l2_raw = vec![0u8; cs as usize];
    let mut l2_seen = HashSet::new();
    for (i, entry) in be64s(&raw_l1).enumerate() {
        if entry & L1E_RESERVED != 0 {
            report.corrupt(format!("L1 entry {i} is {entry:#x}: reserved bits set"));
            continue;
        }
        let l2 = entry & L1E_OFFSET_MASK;
        if l2 == 0 {
            continue;
        }
        if unaligned(l2, cs) || l2.checked_add(cs).is_none_or(|end| end > len) {
            report.corrupt(format!(
                "L1 entry {i} names an L2 table at {l2:#x}: unaligned or past the end of the file"
            ));
            continue;
        }
        if !snapshots && entry & OFLAG_COPIED == 0 {
            report.corrupt(format!("L1 entry {i}: COPIED flag missing"));
        }
        refs.add(&mut report, l2, cs, &format!("L2 table {i}"), false);
        if !l2_seen.insert(l2) {
            // Reported as used twice; its entries were counted once.
            continue;
        }
        f.read_exact(&mut l2_raw, l2, "read an L2 table of")?;
        for (j, entry) in be64s(&l2_raw).enumerate() {
            check_l2_entry(
                &header,
                &mut refs,
                &mut report,
                len,
                snapshots,
                entry,
                (i, j),
            );
        }
    }

    // Refcounts against references.
    report.referenced_clusters = refs.counts.len() as u64;
    if !snapshots {
        let order = header.refcount_order;
        let block_bits = bits + 3 - order;
        let per_block = 1u64 << block_bits;
        // Entries per 8 bytes of a block, skipped at once when zero.
        let per_word = (64u64 >> order).max(1);
        let mut block = vec![0u8; cs as usize];
        for (bi, offset) in blocks.iter().enumerate() {
            let Some(offset) = offset else {
                continue;
            };
            f.read_exact(&mut block, *offset, "read a refcount block of")?;
            let first = (bi as u64) << block_bits;
            let mut i = 0;
            while i < per_block {
                if i % per_word == 0 {
                    let at = (i * (1 << order) / 8) as usize;
                    if block
                        .get(at..at + 8)
                        .is_some_and(|w| w.iter().all(|&b| b == 0))
                    {
                        i += per_word;
                        continue;
                    }
                }
                let count = get_entry(&block, i, order);
                if count != 0 {
                    let cluster = first + i;
                    let referenced = refs.counts.remove(&cluster).map_or(0, u64::from);
                    compare(&mut report, cluster << bits, count, referenced);
                }
                i += 1;
            }
        }
        // What is left is referenced but has refcount 0.
        let mut unrefcounted: Vec<_> = refs.counts.into_iter().collect();
        unrefcounted.sort_unstable();
        for (cluster, referenced) in unrefcounted {
            compare(&mut report, cluster << bits, 0, u64::from(referenced));
        }
    }
    Ok(report)
}

fn compare(report: &mut CheckReport, offset: u64, refcount: u64, referenced: u64) {
    if refcount < referenced {
        report.corrupt(format!(
            "cluster {offset:#x} has refcount {refcount} but {referenced} references"
        ));
    } else if refcount > referenced {
        report.leaked_clusters += 1;
    }
}

fn check_l2_entry(
    header: &Header,
    refs: &mut Refs,
    report: &mut CheckReport,
    len: u64,
    snapshots: bool,
    entry: u64,
    (i, j): (usize, usize),
) {
    let cs = header.cluster_size();
    let bits = header.cluster_bits;
    if entry & OFLAG_COMPRESSED != 0 {
        // Offset in the low `62 - (bits - 8)` bits, then the number of
        // additional 512-byte sectors.
        let shift = 62 - (bits - 8);
        let offset = entry & ((1 << shift) - 1);
        let sectors = ((entry >> shift) & ((1 << (bits - 8)) - 1)) + 1;
        let end = (offset & !511) + sectors * 512;
        if entry & OFLAG_COPIED != 0 {
            report.corrupt(format!(
                "L2 entry {i}/{j}: compressed cluster with COPIED flag"
            ));
        }
        refs.add(
            report,
            offset,
            end - offset,
            &format!("compressed cluster {i}/{j}"),
            true,
        );
        report.data_clusters += 1;
        return;
    }
    if entry & L2E_RESERVED != 0 {
        report.corrupt(format!("L2 entry {i}/{j} is {entry:#x}: reserved bits set"));
        return;
    }
    let zero = entry & OFLAG_ZERO != 0;
    if zero && header.version < 3 {
        report.corrupt(format!("L2 entry {i}/{j}: zero flag in a version 2 image"));
        return;
    }
    let host = entry & L2E_OFFSET_MASK;
    if host == 0 {
        return;
    }
    if unaligned(host, cs) {
        report.corrupt(format!(
            "L2 entry {i}/{j} names an unaligned cluster {host:#x}"
        ));
        return;
    }
    if host >= len {
        report.corrupt(format!(
            "L2 entry {i}/{j} names cluster {host:#x}, past the end of the file (truncated?)"
        ));
        return;
    }
    if !snapshots && entry & OFLAG_COPIED == 0 {
        report.corrupt(format!("L2 entry {i}/{j}: COPIED flag missing"));
    }
    refs.add(
        report,
        host,
        cs.min(len - host),
        &format!("data cluster {i}/{j}"),
        false,
    );
    if !zero {
        report.data_clusters += 1;
    }
}
