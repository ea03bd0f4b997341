//! Refcounts of a writable image and cluster allocation.
//!
//! Clusters are only ever allocated at the end of the file, never reused,
//! so a refcount that says "free" is never trusted for a cluster that
//! might be referenced. Allocation goes through a small pool: a batch of
//! clusters gets refcount 1 and the file is extended over them, then one
//! `fdatasync` makes those refcounts durable before any of the clusters is
//! referenced. A crash thus leaves at worst clusters with refcount 1 that
//! nothing references (leaks, which `qemu-img check -r leaks` reclaims).
//! [`Refcounts::release_pool`] gives the unused clusters back (refcount 0,
//! file truncated) on flush and close, so a cleanly flushed image has no
//! leaks.

use std::collections::VecDeque;

use super::cache::TableCache;
use super::header::{Header, MAX_REFTABLE_BYTES, REFTABLE_FIELDS_OFFSET};
use super::{unaligned, ImageFile};
use crate::{Error, Result};

/// Bits 0-8 of a refcount table entry are reserved.
const REFT_RESERVED: u64 = 0x1ff;
/// Bytes of clusters the pool reserves at first; each refill before the
/// next flush doubles it, up to `POOL_MAX_BYTES`, so long streams of
/// writes pay one `fdatasync` per 64 MiB of new clusters.
const POOL_BYTES: u64 = 2 << 20;
const POOL_MAX_BYTES: u64 = 64 << 20;
/// Fewest clusters the pool reserves at a time (large clusters).
const POOL_MIN: u64 = 4;
/// Refcount blocks cached.
const BLOCK_CACHE: usize = 16;

/// The refcount structures of a writable image.
#[derive(Debug)]
pub struct Refcounts {
    cluster_bits: u32,
    order: u32,
    /// log2 of the refcount entries per block.
    block_bits: u32,
    /// The refcount table as in memory. While the table is being moved it
    /// may hold more entries than the one on disk.
    table: Vec<u64>,
    table_offset: u64,
    table_clusters: u64,
    /// Entries of the table on disk.
    disk_entries: u64,
    blocks: TableCache<Vec<u8>>,
    /// First cluster index that was never allocated.
    alloc_end: u64,
    pool: VecDeque<u64>,
    /// Clusters the next refill reserves.
    pool_size: u64,
    pool_first: u64,
    pool_max: u64,
}

impl Refcounts {
    /// Loads and checks the refcount table of `f`, and finds the end of
    /// the allocated clusters.
    pub fn load(f: &mut ImageFile, h: &Header) -> Result<Self> {
        let cs = h.cluster_size();
        let table_bytes = u64::from(h.refcount_table_clusters) * cs;
        let mut raw = vec![0u8; table_bytes as usize];
        f.read_exact(
            &mut raw,
            h.refcount_table_offset,
            "read the refcount table of",
        )?;
        let mut table = Vec::with_capacity(raw.len() / 8);
        for (i, chunk) in raw.chunks_exact(8).enumerate() {
            let mut e = [0u8; 8];
            e.copy_from_slice(chunk);
            let entry = u64::from_be_bytes(e);
            if entry & REFT_RESERVED != 0 || unaligned(entry, cs) {
                return Err(f.invalid(format!(
                    "refcount table entry {i} is {entry:#x} (reserved bits or unaligned)"
                )));
            }
            if entry != 0 && entry.checked_add(cs).is_none_or(|end| end > f.len) {
                return Err(f.invalid(format!(
                    "refcount block {i} at {entry:#x} is past the end of the file"
                )));
            }
            table.push(entry);
        }
        let block_bits = h.cluster_bits + 3 - h.refcount_order;
        let pool_first = (POOL_BYTES >> h.cluster_bits).max(POOL_MIN);
        let pool_max = (POOL_MAX_BYTES >> h.cluster_bits).max(POOL_MIN);
        let mut rc = Self {
            cluster_bits: h.cluster_bits,
            order: h.refcount_order,
            block_bits,
            disk_entries: table.len() as u64,
            table,
            table_offset: h.refcount_table_offset,
            table_clusters: u64::from(h.refcount_table_clusters),
            blocks: TableCache::new(BLOCK_CACHE),
            alloc_end: f.len.div_ceil(cs),
            pool: VecDeque::new(),
            pool_size: pool_first,
            pool_first,
            pool_max,
        };
        // Nothing with a refcount may ever be allocated again, even past
        // the end of the file. A block named twice is refused (it would
        // also make this scan cost more than reading the file).
        let mut seen = std::collections::HashSet::new();
        for bi in 0..rc.table.len() {
            let Some(&offset) = rc.table.get(bi) else {
                break;
            };
            if offset == 0 {
                continue;
            }
            if !seen.insert(offset) {
                return Err(f.invalid(format!(
                    "refcount block {offset:#x} is named twice in the refcount table"
                )));
            }
            let order = rc.order;
            let block = rc.block(f, offset)?;
            if let Some(last) = last_nonzero_entry(block, order) {
                let cluster = ((bi as u64) << block_bits) + last;
                rc.alloc_end = rc.alloc_end.max(cluster + 1);
            }
        }
        Ok(rc)
    }

    fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// The refcount block at `offset`, from the cache or the file.
    fn block<'a>(&'a mut self, f: &ImageFile, offset: u64) -> Result<&'a mut Vec<u8>> {
        if self.blocks.get_mut(offset).is_none() {
            let mut block = vec![0u8; self.cluster_size() as usize];
            f.read_exact(&mut block, offset, "read a refcount block of")?;
            self.blocks.insert(offset, block);
        }
        self.blocks
            .get_mut(offset)
            .ok_or_else(|| f.invalid("refcount block cache lost an entry".into()))
    }

    /// The refcount of cluster `cluster`.
    pub fn get(&mut self, f: &ImageFile, cluster: u64) -> Result<u64> {
        let bi = cluster >> self.block_bits;
        let offset = match self.table.get(bi as usize) {
            Some(&offset) if offset != 0 => offset,
            _ => return Ok(0),
        };
        let index = cluster & ((1 << self.block_bits) - 1);
        let order = self.order;
        Ok(get_entry(self.block(f, offset)?, index, order))
    }

    /// Sets the refcounts of `count` clusters from `start` to `value`. The
    /// refcount blocks must exist.
    pub fn set_range(
        &mut self,
        f: &mut ImageFile,
        start: u64,
        count: u64,
        value: u64,
    ) -> Result<()> {
        let max = if self.order == 6 {
            u64::MAX
        } else {
            (1u64 << (1 << self.order)) - 1
        };
        if value > max {
            return Err(f.invalid(format!("refcount {value} overflows")));
        }
        let per_block = 1u64 << self.block_bits;
        let bits = 1u64 << self.order;
        let mut cluster = start;
        let end = start + count;
        while cluster < end {
            let bi = cluster >> self.block_bits;
            let first = cluster & (per_block - 1);
            let n = (per_block - first).min(end - cluster);
            let offset = match self.table.get(bi as usize) {
                Some(&offset) if offset != 0 => offset,
                _ => {
                    return Err(f.invalid(format!(
                        "no refcount block for cluster {cluster} (internal error)"
                    )))
                }
            };
            let order = self.order;
            let block = self.block(f, offset)?;
            for i in first..first + n {
                set_entry(block, i, order, value);
            }
            let byte_start = (first * bits / 8) as usize;
            let byte_end = ((first + n) * bits).div_ceil(8) as usize;
            let bytes = block.get(byte_start..byte_end).unwrap_or_default().to_vec();
            f.write_all(
                &bytes,
                offset + byte_start as u64,
                "write a refcount block of",
            )?;
            cluster += n;
        }
        Ok(())
    }

    /// Allocates `n` contiguous clusters at the end of the file, giving
    /// them refcount 1, creating refcount blocks (and growing the refcount
    /// table) as needed. Returns the first cluster's index. Nothing is
    /// synced.
    fn alloc_raw(&mut self, f: &mut ImageFile, n: u64) -> Result<u64> {
        loop {
            let start = self.alloc_end;
            let first_bi = start >> self.block_bits;
            let last_bi = (start + n - 1) >> self.block_bits;
            let missing = (first_bi..=last_bi).find(|&bi| {
                self.table
                    .get(bi as usize)
                    .is_none_or(|&offset| offset == 0)
            });
            let Some(bi) = missing else {
                self.set_range(f, start, n, 1)?;
                self.alloc_end = start + n;
                return Ok(start);
            };
            if bi >= self.table.len() as u64 {
                self.grow_table(f, bi + 1)?;
                continue;
            }
            // A new refcount block at cluster `start`. If it covers itself,
            // it holds its own refcount; otherwise the block covering it
            // exists (`bi` is the first missing one).
            let cs = self.cluster_size();
            let offset = start * cs;
            let mut block = vec![0u8; cs as usize];
            if start >> self.block_bits == bi {
                set_entry(
                    &mut block,
                    start & ((1 << self.block_bits) - 1),
                    self.order,
                    1,
                );
            } else {
                self.set_range(f, start, 1, 1)?;
            }
            f.write_all(&block, offset, "write a refcount block of")?;
            self.blocks.insert(offset, block);
            self.alloc_end = start + 1;
            if bi < self.disk_entries {
                f.write_all(
                    &offset.to_be_bytes(),
                    self.table_offset + bi * 8,
                    "write the refcount table of",
                )?;
            }
            if let Some(slot) = self.table.get_mut(bi as usize) {
                *slot = offset;
            }
        }
    }

    /// Moves the refcount table to a larger one at the end of the file
    /// holding at least `min_entries` entries.
    fn grow_table(&mut self, f: &mut ImageFile, min_entries: u64) -> Result<()> {
        let cs = self.cluster_size();
        let per_cluster = cs / 8;
        let mut clusters = (self.table_clusters * 2).max(min_entries.div_ceil(per_cluster));
        loop {
            let capacity = clusters * per_cluster;
            // The new table and the refcount blocks it may need.
            let extra = clusters + 2 * ((clusters >> self.block_bits) + 2);
            let worst_end = self.alloc_end + extra;
            if capacity >= min_entries && (worst_end >> self.block_bits) < capacity {
                break;
            }
            clusters *= 2;
        }
        if clusters * cs > MAX_REFTABLE_BYTES {
            return Err(Error::Unsupported {
                path: f.path.clone(),
                feature:
                    "a refcount table larger than 8 MiB (image too large for its cluster size)"
                        .into(),
            });
        }
        self.table.resize((clusters * per_cluster) as usize, 0);
        let start = self.alloc_raw(f, clusters)?;
        let mut bytes = Vec::with_capacity((clusters * cs) as usize);
        for entry in &self.table {
            bytes.extend_from_slice(&entry.to_be_bytes());
        }
        let new_offset = start * cs;
        f.write_all(&bytes, new_offset, "write the refcount table of")?;
        // The new table and its blocks are durable before the header names
        // them, and the header before the old table is freed.
        f.sync()?;
        let mut fields = [0u8; 12];
        fields[..8].copy_from_slice(&new_offset.to_be_bytes());
        fields[8..].copy_from_slice(&(clusters as u32).to_be_bytes());
        f.write_all(&fields, REFTABLE_FIELDS_OFFSET, "write the header of")?;
        f.sync()?;
        let (old_offset, old_clusters) = (self.table_offset, self.table_clusters);
        self.table_offset = new_offset;
        self.table_clusters = clusters;
        self.disk_entries = clusters * per_cluster;
        self.set_range(f, old_offset / cs, old_clusters, 0)
    }

    /// One cluster for new data or metadata, with refcount 1 that is
    /// already durable. Returns its offset.
    pub fn alloc(&mut self, f: &mut ImageFile) -> Result<u64> {
        if self.pool.is_empty() {
            let start = self.alloc_raw(f, self.pool_size)?;
            self.pool.extend(start..start + self.pool_size);
            self.pool_size = (self.pool_size * 2).min(self.pool_max);
            let end = self.alloc_end * self.cluster_size();
            if f.len < end {
                f.set_len(end)?;
            }
            f.sync()?;
        }
        let cluster = self
            .pool
            .pop_front()
            .ok_or_else(|| f.invalid("allocation pool empty (internal error)".into()))?;
        Ok(cluster << self.cluster_bits)
    }

    /// Gives the clusters reserved but not used back: refcount 0, and the
    /// file truncated over those at its end.
    pub fn release_pool(&mut self, f: &mut ImageFile) -> Result<()> {
        self.pool_size = self.pool_first;
        let Some(&first) = self.pool.front() else {
            return Ok(());
        };
        let count = self.pool.len() as u64;
        // The pool is always one run: it is refilled only when empty.
        self.set_range(f, first, count, 0)?;
        self.pool.clear();
        if first + count == self.alloc_end {
            self.alloc_end = first;
            let end = first * self.cluster_size();
            if f.len > end {
                f.set_len(end)?;
            }
        }
        Ok(())
    }

    /// Drops one reference to the cluster at `offset`.
    pub fn free(&mut self, f: &mut ImageFile, offset: u64) -> Result<()> {
        let cluster = offset >> self.cluster_bits;
        let count = self.get(f, cluster)?;
        if count > 0 {
            self.set_range(f, cluster, 1, count - 1)?;
        }
        Ok(())
    }
}

/// Index of the last non-zero entry of a refcount block, found a byte at a
/// time.
pub fn last_nonzero_entry(block: &[u8], order: u32) -> Option<u64> {
    let byte = block.iter().rposition(|&b| b != 0)? as u64;
    let bits = 1u64 << order;
    // Entries overlapping that byte, last first.
    let first = byte * 8 / bits;
    let last = ((byte + 1) * 8).div_ceil(bits) - 1;
    (first..=last)
        .rev()
        .find(|&i| get_entry(block, i, order) != 0)
}

/// Entry `index` of a refcount block with `1 << order`-bit entries.
pub fn get_entry(block: &[u8], index: u64, order: u32) -> u64 {
    let bits = 1u64 << order;
    if order < 3 {
        let byte = block.get((index * bits / 8) as usize).copied().unwrap_or(0);
        let shift = (index * bits) % 8;
        return (u64::from(byte) >> shift) & ((1 << bits) - 1);
    }
    let width = (bits / 8) as usize;
    let at = index as usize * width;
    let Some(bytes) = block.get(at..at + width) else {
        return 0;
    };
    bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

/// Sets entry `index` of a refcount block with `1 << order`-bit entries.
pub fn set_entry(block: &mut [u8], index: u64, order: u32, value: u64) {
    let bits = 1u64 << order;
    if order < 3 {
        let shift = (index * bits) % 8;
        let mask = (((1u64 << bits) - 1) << shift) as u8;
        if let Some(byte) = block.get_mut((index * bits / 8) as usize) {
            *byte = (*byte & !mask) | (((value << shift) as u8) & mask);
        }
        return;
    }
    let width = (bits / 8) as usize;
    let at = index as usize * width;
    if let Some(bytes) = block.get_mut(at..at + width) {
        let be = value.to_be_bytes();
        bytes.copy_from_slice(&be[8 - width..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_refcount_entries_round_trip_every_order() {
        for order in 0..=6u32 {
            let mut block = vec![0u8; 64];
            let entries = (64 * 8) >> order;
            let max = if order == 6 {
                u64::MAX
            } else {
                (1u64 << (1 << order)) - 1
            };
            for i in 0..entries {
                set_entry(&mut block, i, order, (i * 7 + 1) & max);
            }
            for i in 0..entries {
                assert_eq!(
                    get_entry(&block, i, order),
                    (i * 7 + 1) & max,
                    "order {order}"
                );
            }
        }
    }

    #[test]
    fn test_last_nonzero_entry_every_order() {
        for order in 0..=6u32 {
            let entries = (64 * 8) >> order;
            let mut block = vec![0u8; 64];
            assert_eq!(last_nonzero_entry(&block, order), None);
            for i in [0, 1, entries / 2 + 1, entries - 1] {
                set_entry(&mut block, i, order, 1);
                assert_eq!(last_nonzero_entry(&block, order), Some(i), "order {order}");
            }
        }
    }

    #[test]
    fn test_refcount_entry_layout_matches_qemu() {
        // Order 4: big-endian 16-bit entries.
        let mut block = vec![0u8; 8];
        set_entry(&mut block, 1, 4, 0x0102);
        assert_eq!(block[..4], [0, 0, 1, 2]);
        // Order 0: bit `i % 8` of byte `i / 8`.
        let mut block = vec![0u8; 2];
        set_entry(&mut block, 9, 0, 1);
        assert_eq!(block, [0, 2]);
    }
}
