//! Guest memory.
//!
//! Guest RAM is one or two regions (the second above 4 GiB when RAM reaches
//! into the 32-bit MMIO hole), mapped from a single file:
//! - a fresh VM maps a memfd `MAP_SHARED`: untouched pages stay holes in
//!   the memfd, so the snapshot writer finds the touched ones with
//!   `SEEK_DATA` and the memory file copies no more than it must;
//! - a restored VM maps the snapshot's memory file `MAP_PRIVATE`: pages are
//!   shared through the page cache by every VM restored from that file and
//!   copied only when written, so a fork copies nothing up front, and a
//!   child's writes never reach the file or its siblings. Its snapshot
//!   writer reads the pages the file has data for (`SEEK_DATA`) and those
//!   the guest copied since (anonymous in `/proc/self/pagemap`), not the
//!   whole of RAM: a suspend of a restored VM costs what its first did.
//!
//! The memory file is the regions' bytes back to back, region by region.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;

use vm_memory::mmap::MmapRegion;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap,
};

use crate::arch::x86_64::layout::{MMIO_HOLE_END, MMIO_HOLE_START};

/// The guest memory type used throughout the VMM.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<()>;

/// Page size used for zero-page detection.
pub const PAGE_SIZE: usize = 4096;

/// Errors from creating, mapping or dumping guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// memfd_create or ftruncate failed.
    #[error("cannot create guest memory file")]
    CreateFile(#[source] std::io::Error),
    /// mmap failed.
    #[error("cannot map guest memory: {0}")]
    Map(String),
    /// The memory file is smaller than the layout needs.
    #[error("memory file has {actual} bytes but the VM needs {expected}")]
    FileSize {
        /// Bytes the regions need.
        expected: u64,
        /// Bytes in the file.
        actual: u64,
    },
    /// Writing the snapshot memory file failed.
    #[error("cannot write memory file")]
    Dump(#[source] std::io::Error),
}

/// Guest-physical ranges of RAM for `size` bytes, skipping the MMIO hole.
pub fn ram_ranges(size: u64) -> Vec<(GuestAddress, usize)> {
    if size <= MMIO_HOLE_START {
        vec![(GuestAddress(0), size as usize)]
    } else {
        vec![
            (GuestAddress(0), MMIO_HOLE_START as usize),
            (
                GuestAddress(MMIO_HOLE_END),
                (size - MMIO_HOLE_START) as usize,
            ),
        ]
    }
}

/// Anonymous address space reserved for guest RAM ahead of a restore, so
/// that the KVM memory slots can be registered before the snapshot is known
/// (registering a slot is the slowest step of a restore). The snapshot file
/// is later mapped over it with `MAP_FIXED`; KVM's MMU notifier drops any
/// stale translation. Unmapped on drop.
#[derive(Debug)]
pub struct Reservation {
    ranges: Vec<(GuestAddress, usize, usize)>,
}

// SAFETY: the reservation only holds addresses of mappings it owns; moving
// it between threads moves that ownership.
unsafe impl Send for Reservation {}

impl Reservation {
    /// Reserves RAM for a VM of `size` bytes.
    pub fn new(size: u64) -> Result<Self, MemoryError> {
        let mut ranges = Vec::new();
        for (addr, len) in ram_ranges(size) {
            // SAFETY: an anonymous, private, non-fixed mapping touches no
            // existing memory; the result is checked below.
            let host = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if host == libc::MAP_FAILED {
                return Err(MemoryError::Map(format!(
                    "cannot reserve {len} bytes: {}",
                    std::io::Error::last_os_error()
                )));
            }
            ranges.push((addr, len, host as usize));
        }
        Ok(Self { ranges })
    }

    /// Bytes reserved.
    pub fn size(&self) -> u64 {
        self.ranges.iter().map(|r| r.1 as u64).sum()
    }

    /// (guest address, length, host address) of each range.
    pub fn ranges(&self) -> &[(GuestAddress, usize, usize)] {
        &self.ranges
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        for &(_, len, host) in &self.ranges {
            // SAFETY: unmaps exactly the ranges this reservation mapped (or
            // that were mapped over them with MAP_FIXED); nothing else
            // refers to them once the reservation is dropped.
            unsafe {
                libc::munmap(host as *mut libc::c_void, len);
            }
        }
    }
}

/// How [`GuestRam::populate_data`] maps pages ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Populate {
    /// Read-only, shared with the file (`MADV_POPULATE_READ`).
    Read,
    /// Copied, as a write would (`MADV_POPULATE_WRITE`): of a private
    /// mapping, each page becomes the guest's own.
    Write,
}

/// Guest RAM with the file that backs it.
#[derive(Debug)]
pub struct GuestRam {
    /// The mapped memory.
    pub mem: GuestMemoryMmap,
    /// The backing file (memfd, or the snapshot memory file).
    pub file: File,
    /// Whether `file` is a private (copy-on-write) mapping of a snapshot.
    pub private: bool,
    /// Address space owned on behalf of `mem` when it was mapped into a
    /// reservation. Declared after `mem` so that it is dropped after it.
    _reservation: Option<Reservation>,
}

fn map_ranges(
    file: &File,
    ranges: &[(GuestAddress, usize)],
    flags: i32,
) -> Result<GuestMemoryMmap, MemoryError> {
    let mut offset = 0u64;
    let mut regions = Vec::with_capacity(ranges.len());
    for &(addr, size) in ranges {
        let handle = file.try_clone().map_err(MemoryError::CreateFile)?;
        let region = MmapRegion::build(
            Some(FileOffset::new(handle, offset)),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            flags | libc::MAP_NORESERVE,
        )
        .map_err(|e| MemoryError::Map(e.to_string()))?;
        let region = GuestRegionMmap::new(region, addr)
            .ok_or_else(|| MemoryError::Map(format!("region at {:#x} overflows", addr.0)))?;
        regions.push(region);
        offset += size as u64;
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Map(e.to_string()))
}

/// Total bytes of `ranges`.
pub fn total_size(ranges: &[(GuestAddress, usize)]) -> u64 {
    ranges.iter().map(|r| r.1 as u64).sum()
}

/// The data extents of `file` up to `total` bytes (`SEEK_DATA` /
/// `SEEK_HOLE`), as `(start, end)` byte ranges.
fn data_extents(file: &File, total: u64) -> Vec<(u64, u64)> {
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < total {
        // SAFETY: lseek on a descriptor we own has no memory effects.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no more data
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 { total as i64 } else { hole };
        out.push((data as u64, (end as u64).min(total)));
        pos = end;
    }
    out
}

/// `ranges` sorted, with overlapping and touching ones joined.
fn merge_ranges(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

impl GuestRam {
    /// Fresh RAM of `size` bytes on a memfd mapped shared.
    pub fn new_memfd(size: u64) -> Result<Self, MemoryError> {
        let ranges = ram_ranges(size);
        let name = c"tine-guest-ram";
        // SAFETY: memfd_create takes a NUL-terminated name and flags; the
        // returned descriptor is owned by the File below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(MemoryError::CreateFile(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a freshly created descriptor nobody else owns.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(total_size(&ranges))
            .map_err(MemoryError::CreateFile)?;
        let mem = map_ranges(&file, &ranges, libc::MAP_SHARED)?;
        Ok(Self {
            mem,
            file,
            private: false,
            _reservation: None,
        })
    }

    /// Maps a snapshot memory file copy-on-write for a VM of `size` bytes.
    pub fn from_snapshot_file(file: File, size: u64) -> Result<Self, MemoryError> {
        let ranges = ram_ranges(size);
        let expected = total_size(&ranges);
        let actual = file.metadata().map_err(MemoryError::CreateFile)?.len();
        if actual != expected {
            return Err(MemoryError::FileSize { expected, actual });
        }
        let mem = map_ranges(&file, &ranges, libc::MAP_PRIVATE)?;
        Ok(Self {
            mem,
            file,
            private: true,
            _reservation: None,
        })
    }

    /// Maps a snapshot memory file copy-on-write over `reservation` (whose
    /// KVM slots may already be registered).
    pub fn from_snapshot_file_into(
        file: File,
        reservation: Reservation,
    ) -> Result<Self, MemoryError> {
        let expected = reservation.size();
        let actual = file.metadata().map_err(MemoryError::CreateFile)?.len();
        if actual != expected {
            return Err(MemoryError::FileSize { expected, actual });
        }
        let mut offset = 0u64;
        let mut regions = Vec::new();
        for &(addr, len, host) in reservation.ranges() {
            // SAFETY: MAP_FIXED replaces only the reservation's own range,
            // which no Rust reference points into; the file is open.
            let mapped = unsafe {
                libc::mmap(
                    host as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    file.as_raw_fd(),
                    offset as libc::off_t,
                )
            };
            if mapped == libc::MAP_FAILED || mapped as usize != host {
                return Err(MemoryError::Map(format!(
                    "cannot map the memory file over the reservation: {}",
                    std::io::Error::last_os_error()
                )));
            }
            // SAFETY: `host..host+len` is a live mapping owned by the
            // reservation, which `GuestRam` keeps until after `mem` drops.
            let region = unsafe {
                MmapRegion::build_raw(
                    host as *mut u8,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE,
                )
            }
            .map_err(|e| MemoryError::Map(e.to_string()))?;
            let region = GuestRegionMmap::new(region, addr)
                .ok_or_else(|| MemoryError::Map(format!("region at {:#x} overflows", addr.0)))?;
            regions.push(region);
            offset += len as u64;
        }
        let mem =
            GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Map(e.to_string()))?;
        Ok(Self {
            mem,
            file,
            private: true,
            _reservation: Some(reservation),
        })
    }

    /// Bytes of guest RAM.
    pub fn size(&self) -> u64 {
        self.mem.iter().map(|r| r.len()).sum()
    }

    /// File ranges that may hold non-zero data: the backing file's data
    /// extents (a memfd's holes were never touched, a snapshot file's holes
    /// were zero pages), and for a private mapping of a snapshot also the
    /// pages the guest wrote since the restore (anonymous copies the file
    /// does not have). Everything when those pages cannot be told.
    fn candidate_ranges(&self) -> Vec<(u64, u64)> {
        let total = self.size();
        let extents = data_extents(&self.file, total);
        if !self.private {
            return extents;
        }
        match self.written_pages() {
            Ok(written) => merge_ranges(extents.into_iter().chain(written).collect()),
            Err(_) => vec![(0, total)],
        }
    }

    /// File ranges of the pages of a private mapping that were written
    /// (copied from the file, so anonymous), from `/proc/self/pagemap`:
    /// present and not file-backed, or swapped out. Of a shared mapping
    /// (a booted VM's memfd) no page counts as written.
    pub fn written_pages(&self) -> std::io::Result<Vec<(u64, u64)>> {
        use std::os::unix::fs::FileExt;
        const PRESENT: u64 = 1 << 63;
        const SWAPPED: u64 = 1 << 62;
        const FILE_OR_SHARED: u64 = 1 << 61;
        /// Entries read at once (8 bytes each: 4 MiB of guest RAM).
        const CHUNK: usize = 1024;
        let pagemap = File::open("/proc/self/pagemap")?;
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut file_off = 0u64;
        let mut buf = vec![0u8; CHUNK * 8];
        for region in self.mem.iter() {
            let host = self
                .mem
                .get_host_address(region.start_addr())
                .map_err(|e| std::io::Error::other(e.to_string()))? as u64;
            let pages = region.len() / PAGE_SIZE as u64;
            let mut page = 0u64;
            while page < pages {
                let n = CHUNK.min((pages - page) as usize);
                let at = (host / PAGE_SIZE as u64 + page) * 8;
                pagemap.read_exact_at(&mut buf[..n * 8], at)?;
                for (i, entry) in buf[..n * 8].chunks_exact(8).enumerate() {
                    let mut raw = [0u8; 8];
                    raw.copy_from_slice(entry);
                    let e = u64::from_ne_bytes(raw);
                    let written = (e & PRESENT != 0 && e & FILE_OR_SHARED == 0) || e & SWAPPED != 0;
                    if written {
                        let start = file_off + (page + i as u64) * PAGE_SIZE as u64;
                        match out.last_mut() {
                            Some(last) if last.1 == start => last.1 += PAGE_SIZE as u64,
                            _ => out.push((start, start + PAGE_SIZE as u64)),
                        }
                    }
                }
                page += n as u64;
            }
            file_off += region.len();
        }
        Ok(out)
    }

    /// Maps the pages the backing file has data for into this process's
    /// page tables ahead of the guest's first touch: shared with the file,
    /// read-only ([`Populate::Read`]), or copied as the guest's own, as its
    /// first write would ([`Populate::Write`]). Holes are left alone (a read
    /// of one would give a private mapping page-cache pages of zeros).
    /// Returns the bytes populated. `cargo bench -p tine-vmm --bench
    /// first_touch` measures what each does to a restored guest's first
    /// touch of its memory.
    pub fn populate_data(&self, how: Populate) -> std::io::Result<u64> {
        let extents: Vec<(u64, u64)> = data_extents(&self.file, self.size())
            .into_iter()
            .map(|(start, end)| (start / PAGE_SIZE as u64 * PAGE_SIZE as u64, end))
            .collect();
        self.populate_ranges(&extents, how)
    }

    /// Maps the memory file's byte ranges `ranges` ahead, as
    /// [`GuestRam::populate_data`] maps all its data (a write set's, say).
    /// Each range must start on a page and end inside guest RAM; a range
    /// that does not is refused before any is mapped. Returns the bytes
    /// populated.
    pub fn populate_ranges(&self, ranges: &[(u64, u64)], how: Populate) -> std::io::Result<u64> {
        let total = self.size();
        if let Some(&(start, end)) = ranges
            .iter()
            .find(|&&(start, end)| start % PAGE_SIZE as u64 != 0 || start > end || end > total)
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "range {start:#x}..{end:#x} does not start on a page or lies outside the {total:#x} bytes of guest RAM"
                ),
            ));
        }
        let advice = match how {
            Populate::Read => libc::MADV_POPULATE_READ,
            Populate::Write => libc::MADV_POPULATE_WRITE,
        };
        let mut populated = 0u64;
        let mut file_off = 0u64;
        let mut regions = Vec::new();
        for region in self.mem.iter() {
            let host = self
                .mem
                .get_host_address(region.start_addr())
                .map_err(|e| std::io::Error::other(e.to_string()))? as u64;
            regions.push((file_off, file_off + region.len(), host));
            file_off += region.len();
        }
        for &(start, end) in ranges {
            for &(off, off_end, host) in &regions {
                let from = start.max(off);
                let to = end.min(off_end);
                if from >= to {
                    continue;
                }
                // SAFETY: `from..to` lies inside one region of guest RAM
                // (checked above against its size, clipped to the region
                // here), a live mapping `self` owns; populating faults its
                // pages in and changes no byte of them.
                let r = unsafe {
                    libc::madvise(
                        (host + (from - off)) as *mut libc::c_void,
                        (to - from) as usize,
                        advice,
                    )
                };
                if r != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                populated += to - from;
            }
        }
        Ok(populated)
    }

    /// Writes guest RAM to `out` as a sparse memory file: all-zero pages are
    /// skipped (left as holes). Returns the bytes actually written.
    pub fn write_sparse(&self, out: &mut File) -> Result<u64, MemoryError> {
        let total = self.size();
        out.set_len(0).map_err(MemoryError::Dump)?;
        out.set_len(total).map_err(MemoryError::Dump)?;
        // Map file offsets back to guest addresses.
        let mut layout = Vec::new();
        let mut offset = 0u64;
        for region in self.mem.iter() {
            layout.push((offset, region.start_addr(), region.len()));
            offset += region.len();
        }
        let mut page = vec![0u8; PAGE_SIZE];
        let mut written = 0u64;
        for (start, end) in self.candidate_ranges() {
            let mut pos = start - start % PAGE_SIZE as u64;
            while pos < end {
                let Some(&(file_off, guest, _)) = layout
                    .iter()
                    .find(|(off, _, len)| pos >= *off && pos < off + len)
                else {
                    break;
                };
                let addr = GuestAddress(guest.0 + (pos - file_off));
                self.mem
                    .read_slice(&mut page, addr)
                    .map_err(|e| MemoryError::Dump(std::io::Error::other(e.to_string())))?;
                if page.iter().any(|&b| b != 0) {
                    out.seek(SeekFrom::Start(pos)).map_err(MemoryError::Dump)?;
                    out.write_all(&page).map_err(MemoryError::Dump)?;
                    written += PAGE_SIZE as u64;
                }
                pos += PAGE_SIZE as u64;
            }
        }
        out.sync_data().map_err(MemoryError::Dump)?;
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn test_ram_ranges_split_around_mmio_hole() {
        assert_eq!(ram_ranges(1 << 30), vec![(GuestAddress(0), 1 << 30)]);
        let big = ram_ranges(4 << 30);
        assert_eq!(big.len(), 2);
        assert_eq!(big[1].0, GuestAddress(MMIO_HOLE_END));
        assert_eq!(total_size(&big), 4 << 30);
    }

    #[test]
    fn test_write_sparse_skips_untouched_and_zero_pages() {
        let ram = GuestRam::new_memfd(64 << 20).expect("ram");
        ram.mem
            .write_slice(&[0xaa; 10], GuestAddress(0x5000))
            .expect("write");
        ram.mem
            .write_slice(&[0u8; 4096], GuestAddress(0x9000))
            .expect("write zero page");
        let mut out = tempfile::tempfile().expect("tempfile");
        let written = ram.write_sparse(&mut out).expect("dump");
        assert_eq!(written, PAGE_SIZE as u64);
        let meta = out.metadata().expect("meta");
        assert_eq!(meta.len(), 64 << 20);
        assert!(
            meta.blocks() * 512 <= 64 * 1024,
            "memory file is not sparse"
        );
    }

    #[test]
    fn test_from_snapshot_file_is_copy_on_write() {
        let ram = GuestRam::new_memfd(4 << 20).expect("ram");
        ram.mem
            .write_obj(0x1234u32, GuestAddress(0x2000))
            .expect("w");
        let path = tempfile::NamedTempFile::new().expect("tmp");
        let mut file = path.reopen().expect("reopen");
        ram.write_sparse(&mut file).expect("dump");

        let a = GuestRam::from_snapshot_file(path.reopen().expect("r"), 4 << 20).expect("a");
        let b = GuestRam::from_snapshot_file(path.reopen().expect("r"), 4 << 20).expect("b");
        assert_eq!(
            a.mem.read_obj::<u32>(GuestAddress(0x2000)).expect("r"),
            0x1234
        );
        a.mem.write_obj(0x5678u32, GuestAddress(0x2000)).expect("w");
        assert_eq!(
            b.mem.read_obj::<u32>(GuestAddress(0x2000)).expect("r"),
            0x1234
        );
        let c = GuestRam::from_snapshot_file(path.reopen().expect("r"), 4 << 20).expect("c");
        assert_eq!(
            c.mem.read_obj::<u32>(GuestAddress(0x2000)).expect("r"),
            0x1234
        );
    }

    #[test]
    fn test_from_snapshot_file_into_reservation_reads_file_copy_on_write() {
        let ram = GuestRam::new_memfd(4 << 20).expect("ram");
        ram.mem
            .write_obj(0xabcdu32, GuestAddress(0x3000))
            .expect("w");
        let path = tempfile::NamedTempFile::new().expect("tmp");
        ram.write_sparse(&mut path.reopen().expect("r"))
            .expect("dump");
        let reservation = Reservation::new(4 << 20).expect("reserve");
        let host = reservation.ranges()[0].2;
        let child =
            GuestRam::from_snapshot_file_into(path.reopen().expect("r"), reservation).expect("map");
        assert_eq!(
            child.mem.get_host_address(GuestAddress(0)).expect("h") as usize,
            host
        );
        assert_eq!(
            child.mem.read_obj::<u32>(GuestAddress(0x3000)).expect("r"),
            0xabcd
        );
        child.mem.write_obj(1u32, GuestAddress(0x3000)).expect("w");
        let again = std::fs::read(path.path()).expect("read");
        assert_eq!(&again[0x3000..0x3004], &0xabcdu32.to_le_bytes());
    }

    #[test]
    fn test_populate_maps_the_files_data_and_only_a_write_copies_it() {
        let size = 16u64 << 20;
        let ram = GuestRam::new_memfd(size).expect("ram");
        ram.mem.write_obj(0x11u8, GuestAddress(0x5000)).expect("w");
        ram.mem
            .write_slice(&[0x22u8; 3 * PAGE_SIZE], GuestAddress(0x40_0000))
            .expect("w");
        let file = tempfile::NamedTempFile::new().expect("tmp");
        ram.write_sparse(&mut file.reopen().expect("r"))
            .expect("dump");
        let data = 4 * PAGE_SIZE as u64;

        let read = GuestRam::from_snapshot_file(file.reopen().expect("r"), size).expect("map");
        assert_eq!(read.populate_data(Populate::Read).expect("read"), data);
        assert_eq!(read.written_pages().expect("pagemap"), vec![]);

        let written = GuestRam::from_snapshot_file(file.reopen().expect("r"), size).expect("map");
        assert_eq!(written.populate_data(Populate::Write).expect("write"), data);
        assert_eq!(
            written.written_pages().expect("pagemap"),
            vec![(0x5000, 0x6000), (0x40_0000, 0x40_3000)],
            "the data pages, copied, and no hole"
        );
        assert_eq!(
            written
                .mem
                .read_obj::<u8>(GuestAddress(0x40_2000))
                .expect("r"),
            0x22
        );
        written
            .mem
            .write_obj(0x33u8, GuestAddress(0x5000))
            .expect("w");
        assert_eq!(
            read.mem.read_obj::<u8>(GuestAddress(0x5000)).expect("r"),
            0x11,
            "a copy's write stays its own"
        );
    }

    #[test]
    fn test_populate_ranges_copies_those_pages_only_and_checks_them_first() {
        let size = 16u64 << 20;
        let ram = GuestRam::new_memfd(size).expect("ram");
        ram.mem
            .write_slice(&[0x44u8; 8 * PAGE_SIZE], GuestAddress(0x10_0000))
            .expect("w");
        let file = tempfile::NamedTempFile::new().expect("tmp");
        ram.write_sparse(&mut file.reopen().expect("r"))
            .expect("dump");
        let child = GuestRam::from_snapshot_file(file.reopen().expect("r"), size).expect("map");
        let page = PAGE_SIZE as u64;
        let ranges = [
            (0x10_0000 + page, 0x10_0000 + 3 * page),
            (0x80_0000, 0x80_0000 + page),
        ];
        assert_eq!(
            child
                .populate_ranges(&ranges, Populate::Write)
                .expect("populate"),
            3 * page
        );
        assert_eq!(
            child.written_pages().expect("pagemap"),
            ranges.to_vec(),
            "those pages are the guest's own copies now, a hole's too"
        );
        assert_eq!(
            child
                .mem
                .read_obj::<u8>(GuestAddress(0x10_0000 + page))
                .expect("r"),
            0x44,
            "with the file's bytes"
        );
        for bad in [
            (0x800, 0x1000),
            (size - page, size + page),
            (0x3000, 0x2000),
        ] {
            let e = child
                .populate_ranges(&[(0, page), bad], Populate::Write)
                .expect_err("refused");
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{bad:?}: {e}");
        }
        assert_eq!(
            child.written_pages().expect("pagemap"),
            ranges.to_vec(),
            "a refused list maps nothing, not even its good ranges"
        );
    }

    #[test]
    fn test_write_sparse_of_a_restored_vm_has_the_file_and_its_writes_only() {
        let size = 64u64 << 20;
        let ram = GuestRam::new_memfd(size).expect("ram");
        ram.mem.write_obj(0x11u8, GuestAddress(0x5000)).expect("w");
        ram.mem
            .write_obj(0x22u8, GuestAddress(0x20_0000))
            .expect("w");
        let first = tempfile::NamedTempFile::new().expect("tmp");
        ram.write_sparse(&mut first.reopen().expect("r"))
            .expect("dump");
        let child =
            GuestRam::from_snapshot_file(first.reopen().expect("r"), size).expect("restore");
        // A write into a page the file has as a hole, one over a page it
        // has, one that zeroes a page it has; reads of holes copy nothing.
        child
            .mem
            .write_obj(0x33u8, GuestAddress(0x300_0000))
            .expect("w");
        child
            .mem
            .write_obj(0x44u8, GuestAddress(0x5001))
            .expect("w");
        child
            .mem
            .write_slice(&[0u8; PAGE_SIZE], GuestAddress(0x20_0000))
            .expect("w");
        let mut buf = [0u8; 16];
        child
            .mem
            .read_slice(&mut buf, GuestAddress(0x100_0000))
            .expect("read a hole");
        let ranges = child.candidate_ranges();
        let covered = |addr: u64| ranges.iter().any(|&(s, e)| addr >= s && addr < e);
        assert!(covered(0x300_0000), "a written hole: {ranges:?}");
        assert!(covered(0x5000) && covered(0x20_0000), "{ranges:?}");
        assert!(!covered(0x100_0000), "a hole only read: {ranges:?}");
        let scanned: u64 = ranges.iter().map(|(s, e)| e - s).sum();
        assert!(scanned < size / 8, "{scanned} bytes of {size} scanned");
        let second = tempfile::NamedTempFile::new().expect("tmp");
        let written = child
            .write_sparse(&mut second.reopen().expect("r"))
            .expect("dump");
        assert_eq!(written, 2 * PAGE_SIZE as u64, "two non-zero pages");
        let bytes = std::fs::read(second.path()).expect("read");
        assert_eq!(bytes.len() as u64, size);
        assert_eq!((bytes[0x5000], bytes[0x5001]), (0x11, 0x44));
        assert_eq!(bytes[0x300_0000], 0x33);
        assert_eq!(bytes[0x20_0000], 0);
        let allocated = second.as_file().metadata().expect("meta").blocks() * 512;
        assert!(
            allocated <= 4 * PAGE_SIZE as u64,
            "{allocated} bytes allocated"
        );
    }

    #[test]
    fn test_ranges_merge_when_they_overlap_or_touch() {
        assert_eq!(
            merge_ranges(vec![(8, 12), (0, 4), (4, 6), (10, 20), (30, 31)]),
            vec![(0, 6), (8, 20), (30, 31)]
        );
        assert!(merge_ranges(Vec::new()).is_empty());
    }

    #[test]
    fn test_from_snapshot_file_wrong_size_is_refused() {
        let file = tempfile::tempfile().expect("tmp");
        file.set_len(4096).expect("len");
        assert!(matches!(
            GuestRam::from_snapshot_file(file, 4 << 20),
            Err(MemoryError::FileSize { .. })
        ));
    }
}
