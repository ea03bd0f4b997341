//! The virtio-blk device: parses requests from its queue and serves them
//! from a [`BlockBackend`].
//!
//! A request is a descriptor chain: a 16-byte header the device reads
//! (type, priority, sector), data buffers (device-readable for writes,
//! device-writable for reads) and a final status byte the device writes.
//! Following the spec, the device makes no assumption about how these are
//! split into descriptors: the header is the first 16 readable bytes and the
//! status is the last byte of the last descriptor.
//!
//! Requests are guest input. Any malformed request (a chain that loops, is
//! longer than the queue or puts readable after writable buffers, a short
//! header, a buffer outside guest memory, a transfer that is not whole
//! sectors or reaches past the disk) completes with `VIRTIO_BLK_S_IOERR`
//! without touching the disk; a chain without a writable status byte in
//! guest memory, or one longer than 4 GiB (virtio-queue stops walking it,
//! spec 2.7.5.2), is returned unanswered (used length 0). Nothing the guest
//! sends stops the device serving the next request.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::{DescriptorChain, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

use super::features::{VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX};
use super::request_type::{
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use super::status::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};
use super::{BLOCK_QUEUE_SIZE, SECTOR_SIZE, SERIAL_LEN};
use crate::devices::virtio::persist::VirtioDeviceState;
use crate::devices::virtio::{
    device_type, ActivateError, IrqTrigger, VirtioCommon, VirtioDevice, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX,
};
use crate::snapshot::Persist;
use crate::vstate::memory::GuestMemoryMmap;
use tine_disk::{BlockBackend, RawFile};

/// Which disk a block device serves, as the guest saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskIdentity {
    /// Path of the image.
    pub path: PathBuf,
    /// Exposed read-only.
    pub read_only: bool,
    /// Size in bytes.
    pub size: u64,
}

/// Bytes moved between guest memory and the disk per backend call.
const IO_CHUNK: usize = 128 * 1024;
const REQUEST_QUEUE: usize = 0;
const HEADER_LEN: usize = 16;
/// `struct virtio_blk_config` up to and including the write-zeroes fields.
const CONFIG_LEN: usize = 60;
const CONFIG_CAPACITY: usize = 0;
const CONFIG_SEG_MAX: usize = 12;

/// How a block device is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockConfig {
    /// Path of the disk image; identifies the disk in snapshots.
    pub path: PathBuf,
    /// Expose the disk read-only (VIRTIO_BLK_F_RO).
    pub read_only: bool,
    /// Device ID string returned by GET_ID; only its first 20 bytes are
    /// used.
    pub serial: String,
}

/// Why a block device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The disk image could not be opened.
    #[error("cannot open disk image {path}")]
    Open {
        /// The image.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The disk image is not one tine can serve (bad or unsupported
    /// qcow2, broken backing chain).
    #[error("cannot open disk image {path}")]
    Image {
        /// The image.
        path: PathBuf,
        /// The cause.
        #[source]
        source: tine_disk::Error,
    },
    /// The disk being left could not be flushed: the switch is refused,
    /// since its last writes may not be in the file.
    #[error("cannot flush disk image {path} before leaving it")]
    Flush {
        /// The image.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The image switched to is not the size the guest knows.
    #[error("disk image {path} is {found} bytes, the guest knows a disk of {expected}")]
    SizeMismatch {
        /// The image.
        path: PathBuf,
        /// The size the guest knows.
        expected: u64,
        /// The image's size.
        found: u64,
    },
    /// The guest may write its disk but the image switched to is read-only.
    #[error("disk image {0} is read-only, the guest's disk is writable")]
    ReadOnly(PathBuf),
}

/// Opens `path` in the format its first bytes say.
fn open_backend(path: &Path, read_only: bool) -> Result<Box<dyn BlockBackend>, BlockError> {
    tine_disk::open_disk(path, read_only).map_err(|source| match source {
        tine_disk::Error::Io { source, .. } => BlockError::Open {
            path: path.to_path_buf(),
            source,
        },
        source => BlockError::Image {
            path: path.to_path_buf(),
            source,
        },
    })
}

/// Why a request failed; decides its status byte.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("malformed descriptor chain")]
    MalformedChain,
    #[error("request header shorter than 16 bytes")]
    ShortHeader,
    #[error("transfer of {0} bytes is not whole sectors")]
    PartialSector(usize),
    #[error("transfer at sector {sector} of {len} bytes lies beyond the disk")]
    OutOfRange { sector: u64, len: usize },
    #[error("buffer outside guest memory")]
    GuestMemory,
    #[error("write to a read-only disk")]
    ReadOnly,
    #[error("unsupported request type {0}")]
    Unsupported(u32),
    #[error("disk I/O failed")]
    Io(#[source] io::Error),
}

impl RequestError {
    fn status(&self) -> u8 {
        match self {
            Self::Unsupported(_) => VIRTIO_BLK_S_UNSUPP,
            _ => VIRTIO_BLK_S_IOERR,
        }
    }
}

/// A guest buffer: one descriptor, or part of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    addr: GuestAddress,
    len: usize,
}

fn total_len(segments: &[Segment]) -> usize {
    segments
        .iter()
        .fold(0usize, |sum, s| sum.saturating_add(s.len))
}

/// Splits `segments` after `at` bytes; None if they hold fewer.
fn split_segments(segments: &[Segment], at: usize) -> Option<(Vec<Segment>, Vec<Segment>)> {
    let mut head = Vec::new();
    let mut tail = Vec::new();
    let mut need = at;
    for &seg in segments {
        if need == 0 {
            tail.push(seg);
        } else if seg.len <= need {
            head.push(seg);
            need -= seg.len;
        } else {
            head.push(Segment {
                addr: seg.addr,
                len: need,
            });
            tail.push(Segment {
                addr: seg.addr.checked_add(need as u64)?,
                len: seg.len - need,
            });
            need = 0;
        }
    }
    (need == 0).then_some((head, tail))
}

/// True if every segment lies in guest memory.
fn in_guest_memory(mem: &GuestMemoryMmap, segments: &[Segment], access: Permissions) -> bool {
    segments
        .iter()
        .all(|s| GuestMemory::check_range(mem, s.addr, s.len, access))
}

/// A position in a list of guest buffers, for scatter/gather copies.
struct Cursor<'a> {
    segments: &'a [Segment],
    index: usize,
    offset: usize,
}

impl<'a> Cursor<'a> {
    fn new(segments: &'a [Segment]) -> Self {
        Self {
            segments,
            index: 0,
            offset: 0,
        }
    }

    /// The next contiguous piece of at most `max` bytes.
    fn next_piece(&mut self, max: usize) -> Option<(GuestAddress, usize)> {
        loop {
            let seg = self.segments.get(self.index)?;
            let left = seg.len.saturating_sub(self.offset);
            if left == 0 {
                self.index += 1;
                self.offset = 0;
                continue;
            }
            let len = left.min(max);
            let addr = seg.addr.checked_add(self.offset as u64)?;
            self.offset += len;
            return Some((addr, len));
        }
    }

    /// Copies `data` into the guest buffers at the cursor.
    fn write_to_guest(
        &mut self,
        mem: &GuestMemoryMmap,
        mut data: &[u8],
    ) -> Result<(), RequestError> {
        while !data.is_empty() {
            let (addr, len) = self
                .next_piece(data.len())
                .ok_or(RequestError::GuestMemory)?;
            let (now, rest) = data
                .split_at_checked(len)
                .ok_or(RequestError::GuestMemory)?;
            mem.write_slice(now, addr)
                .map_err(|_| RequestError::GuestMemory)?;
            data = rest;
        }
        Ok(())
    }

    /// Fills `data` from the guest buffers at the cursor.
    fn read_from_guest(
        &mut self,
        mem: &GuestMemoryMmap,
        mut data: &mut [u8],
    ) -> Result<(), RequestError> {
        while !data.is_empty() {
            let (addr, len) = self
                .next_piece(data.len())
                .ok_or(RequestError::GuestMemory)?;
            let (now, rest) = std::mem::take(&mut data)
                .split_at_mut_checked(len)
                .ok_or(RequestError::GuestMemory)?;
            mem.read_slice(now, addr)
                .map_err(|_| RequestError::GuestMemory)?;
            data = rest;
        }
        Ok(())
    }
}

/// A chain taken apart: where its status byte goes and, if its shape is
/// valid, its readable and writable buffers (the status byte excluded).
struct ChainLayout {
    status: GuestAddress,
    buffers: Option<(Vec<Segment>, Vec<Segment>)>,
}

/// Walks `chain`. Returns None when there is no writable status byte in
/// guest memory (the request cannot be answered). The buffers are None
/// when the chain is malformed: more than `max_descs` descriptors, not
/// terminated (a loop, a next index outside the table, an unreadable
/// descriptor, more than 4 GiB), or a readable buffer after a writable one.
fn walk_chain(
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
    max_descs: usize,
) -> Option<ChainLayout> {
    let mut readable = Vec::new();
    let mut writable = Vec::new();
    let mut well_formed = true;
    let mut count = 0usize;
    let mut last = None;
    // The iterator itself stops after the queue size (direct) or table
    // size (indirect, at most 65535) descriptors.
    for desc in chain {
        count += 1;
        last = Some(desc);
        if count > max_descs {
            well_formed = false;
            continue;
        }
        let seg = Segment {
            addr: desc.addr(),
            len: desc.len() as usize,
        };
        if desc.is_write_only() {
            writable.push(seg);
        } else if writable.is_empty() {
            readable.push(seg);
        } else {
            well_formed = false;
        }
    }
    let last = last?;
    if last.has_next() {
        well_formed = false;
    }
    if !last.is_write_only() || last.len() == 0 {
        return None;
    }
    let status = last.addr().checked_add(u64::from(last.len()) - 1)?;
    if !GuestMemory::check_range(mem, status, 1, Permissions::Write) {
        return None;
    }
    let buffers = if well_formed {
        // The status byte is the last writable segment's last byte.
        if let Some(seg) = writable.last_mut() {
            seg.len -= 1;
        }
        Some((readable, writable))
    } else {
        None
    };
    Some(ChainLayout { status, buffers })
}

/// The disk side of the device: what requests operate on.
#[derive(Debug)]
struct Disk {
    backend: Box<dyn BlockBackend>,
    identity: DiskIdentity,
    serial: [u8; SERIAL_LEN],
    buffer: Vec<u8>,
}

impl Disk {
    fn capacity_sectors(&self) -> u64 {
        self.identity.size / SECTOR_SIZE
    }

    /// Byte offset of a `len`-byte transfer at `sector`, if it is whole
    /// sectors within the disk.
    fn transfer_offset(&self, sector: u64, len: usize) -> Result<u64, RequestError> {
        // SECTOR_SIZE is a power of two.
        if len as u64 & (SECTOR_SIZE - 1) != 0 {
            return Err(RequestError::PartialSector(len));
        }
        let out_of_range = || RequestError::OutOfRange { sector, len };
        let offset = sector.checked_mul(SECTOR_SIZE).ok_or_else(out_of_range)?;
        let end = offset.checked_add(len as u64).ok_or_else(out_of_range)?;
        if end > self.capacity_sectors() * SECTOR_SIZE {
            return Err(out_of_range());
        }
        Ok(offset)
    }

    /// Serves one chain; returns the used length (bytes written to the
    /// guest, status included).
    fn handle_chain(
        &mut self,
        mem: &GuestMemoryMmap,
        chain: DescriptorChain<&GuestMemoryMmap>,
        max_descs: usize,
        writethrough: bool,
    ) -> u32 {
        let Some(layout) = walk_chain(mem, chain, max_descs) else {
            return 0;
        };
        let result = match layout.buffers {
            Some((readable, writable)) => self.execute(mem, &readable, &writable, writethrough),
            None => Err(RequestError::MalformedChain),
        };
        let (status, written) = match result {
            Ok(written) => (VIRTIO_BLK_S_OK, written),
            Err(e) => (e.status(), 0),
        };
        if mem.write_obj(status, layout.status).is_err() {
            return 0;
        }
        u32::try_from(written).unwrap_or(u32::MAX).saturating_add(1)
    }

    /// Runs a well-formed request; returns the data bytes written to the
    /// guest.
    fn execute(
        &mut self,
        mem: &GuestMemoryMmap,
        readable: &[Segment],
        writable: &[Segment],
        writethrough: bool,
    ) -> Result<usize, RequestError> {
        let (header_segs, data_out) =
            split_segments(readable, HEADER_LEN).ok_or(RequestError::ShortHeader)?;
        let mut header = [0u8; HEADER_LEN];
        Cursor::new(&header_segs).read_from_guest(mem, &mut header)?;
        let [t0, t1, t2, t3, _, _, _, _, s0, s1, s2, s3, s4, s5, s6, s7] = header;
        let request_type = u32::from_le_bytes([t0, t1, t2, t3]);
        let sector = u64::from_le_bytes([s0, s1, s2, s3, s4, s5, s6, s7]);
        match request_type {
            VIRTIO_BLK_T_IN => self.read(mem, sector, writable),
            VIRTIO_BLK_T_OUT => {
                self.write(mem, sector, &data_out)?;
                if writethrough {
                    self.backend.flush().map_err(RequestError::Io)?;
                }
                Ok(0)
            }
            VIRTIO_BLK_T_FLUSH => self.backend.flush().map(|()| 0).map_err(RequestError::Io),
            VIRTIO_BLK_T_GET_ID => {
                let len = total_len(writable).min(SERIAL_LEN);
                let serial = self.serial.get(..len).ok_or(RequestError::GuestMemory)?;
                Cursor::new(writable).write_to_guest(mem, serial)?;
                Ok(len)
            }
            other => Err(RequestError::Unsupported(other)),
        }
    }

    /// VIRTIO_BLK_T_IN: disk to guest.
    fn read(
        &mut self,
        mem: &GuestMemoryMmap,
        sector: u64,
        data: &[Segment],
    ) -> Result<usize, RequestError> {
        let len = total_len(data);
        let offset = self.transfer_offset(sector, len)?;
        if !in_guest_memory(mem, data, Permissions::Write) {
            return Err(RequestError::GuestMemory);
        }
        let mut cursor = Cursor::new(data);
        let mut done = 0usize;
        while done < len {
            let n = (len - done).min(IO_CHUNK);
            let buf = self.buffer.get_mut(..n).ok_or(RequestError::GuestMemory)?;
            self.backend
                .read_at(buf, offset + done as u64)
                .map_err(RequestError::Io)?;
            cursor.write_to_guest(mem, buf)?;
            done += n;
        }
        Ok(len)
    }

    /// VIRTIO_BLK_T_OUT: guest to disk. Nothing is written unless every
    /// buffer is valid.
    fn write(
        &mut self,
        mem: &GuestMemoryMmap,
        sector: u64,
        data: &[Segment],
    ) -> Result<(), RequestError> {
        if self.identity.read_only {
            return Err(RequestError::ReadOnly);
        }
        let len = total_len(data);
        let offset = self.transfer_offset(sector, len)?;
        if !in_guest_memory(mem, data, Permissions::Read) {
            return Err(RequestError::GuestMemory);
        }
        let mut cursor = Cursor::new(data);
        let mut done = 0usize;
        while done < len {
            let n = (len - done).min(IO_CHUNK);
            let buf = self.buffer.get_mut(..n).ok_or(RequestError::GuestMemory)?;
            cursor.read_from_guest(mem, buf)?;
            self.backend
                .write_at(buf, offset + done as u64)
                .map_err(RequestError::Io)?;
            done += n;
        }
        Ok(())
    }
}

/// The virtio block device.
#[derive(Debug)]
pub struct Block {
    common: VirtioCommon,
    disk: Disk,
}

/// The first 20 bytes of `serial`, NUL-padded.
fn serial_bytes(serial: &str) -> [u8; SERIAL_LEN] {
    let mut bytes = [0u8; SERIAL_LEN];
    for (dst, src) in bytes.iter_mut().zip(serial.bytes()) {
        *dst = src;
    }
    bytes
}

impl Block {
    /// A device serving `backend`. It is read-only if `config` or the
    /// backend says so.
    pub fn new(config: BlockConfig, backend: Box<dyn BlockBackend>) -> Self {
        let identity = DiskIdentity {
            path: config.path,
            read_only: config.read_only || backend.is_read_only(),
            size: backend.size(),
        };
        let mut features = VIRTIO_F_VERSION_1
            | VIRTIO_RING_F_EVENT_IDX
            | VIRTIO_BLK_F_FLUSH
            | VIRTIO_BLK_F_SEG_MAX;
        if identity.read_only {
            features |= VIRTIO_BLK_F_RO;
        }
        let common = VirtioCommon::new(features, &[BLOCK_QUEUE_SIZE]);
        Self::from_parts(common, identity, serial_bytes(&config.serial), backend)
    }

    /// Opens `config.path` as a raw image and serves it.
    pub fn open_raw(config: BlockConfig) -> Result<Self, BlockError> {
        let backend =
            RawFile::open(&config.path, config.read_only).map_err(|source| BlockError::Open {
                path: config.path.clone(),
                source,
            })?;
        Ok(Self::new(config, Box::new(backend)))
    }

    /// Opens `config.path` in the format its first bytes say (raw or a
    /// qcow2 with its backing chain, see [`tine_disk::open_disk`]) and
    /// serves it.
    pub fn open(config: BlockConfig) -> Result<Self, BlockError> {
        let backend = open_backend(&config.path, config.read_only)?;
        Ok(Self::new(config, backend))
    }

    /// Serves another image from now on: flushes the current one (a
    /// failed flush refuses the switch), opens `path` (same size, writable
    /// if the disk is; an image backed by the current one is fine) and
    /// replaces the backend; the guest sees the same
    /// disk. Only while the VM is paused: no request is in flight. A
    /// memory commit uses it to freeze the disk it captured and go on
    /// writing into a fresh overlay on it.
    pub fn switch_disk(&mut self, path: &Path) -> Result<(), BlockError> {
        // First, so that an image backed by the current one reads it whole.
        self.disk
            .backend
            .flush()
            .map_err(|source| BlockError::Flush {
                path: self.disk.identity.path.clone(),
                source,
            })?;
        let backend = open_backend(path, self.disk.identity.read_only)?;
        if backend.size() != self.disk.identity.size {
            return Err(BlockError::SizeMismatch {
                path: path.to_path_buf(),
                expected: self.disk.identity.size,
                found: backend.size(),
            });
        }
        if !self.disk.identity.read_only && backend.is_read_only() {
            return Err(BlockError::ReadOnly(path.to_path_buf()));
        }
        self.disk.backend = backend;
        self.disk.identity.path = path.to_path_buf();
        Ok(())
    }

    pub(super) fn from_parts(
        common: VirtioCommon,
        identity: DiskIdentity,
        serial: [u8; SERIAL_LEN],
        backend: Box<dyn BlockBackend>,
    ) -> Self {
        Self {
            common,
            disk: Disk {
                backend,
                identity,
                serial,
                buffer: vec![0; IO_CHUNK],
            },
        }
    }

    /// The disk this device serves.
    pub fn identity(&self) -> &DiskIdentity {
        &self.disk.identity
    }

    /// The device ID string, NUL-padded.
    pub fn serial(&self) -> &[u8; SERIAL_LEN] {
        &self.disk.serial
    }

    /// Capacity in 512-byte sectors (a partial last sector is not exposed).
    pub fn capacity(&self) -> u64 {
        self.disk.capacity_sectors()
    }

    fn config_space(&self) -> [u8; CONFIG_LEN] {
        let mut config = [0u8; CONFIG_LEN];
        let seg_max = u32::from(BLOCK_QUEUE_SIZE) - 2;
        let fields: [(usize, &[u8]); 2] = [
            (CONFIG_CAPACITY, &self.capacity().to_le_bytes()),
            (CONFIG_SEG_MAX, &seg_max.to_le_bytes()),
        ];
        for (offset, bytes) in fields {
            for (dst, src) in config.iter_mut().skip(offset).zip(bytes) {
                *dst = *src;
            }
        }
        config
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        device_type::BLOCK
    }

    fn common(&self) -> &VirtioCommon {
        &self.common
    }

    fn common_mut(&mut self) -> &mut VirtioCommon {
        &mut self.common
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.config_space();
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| config.get(o).copied())
                .unwrap_or(0);
        }
    }

    /// Nothing is writable without VIRTIO_BLK_F_CONFIG_WCE.
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<IrqTrigger>,
    ) -> Result<(), ActivateError> {
        self.common.activate(mem, interrupt)
    }

    fn process_queue(&mut self, index: usize) {
        if index != REQUEST_QUEUE {
            return;
        }
        let max_descs = self
            .common
            .queues
            .get(index)
            .map_or(0, |q| usize::from(q.size()));
        // Without FLUSH negotiated the driver expects every write durable.
        let writethrough = self.common.acked_features & VIRTIO_BLK_F_FLUSH == 0;
        let disk = &mut self.disk;
        self.common.process_chains(index, |mem, chain| {
            disk.handle_chain(mem, chain, max_descs, writethrough)
        });
    }

    fn reset(&mut self) {
        self.common.reset();
    }

    fn save(&self) -> VirtioDeviceState {
        VirtioDeviceState::Block(<Self as Persist>::save(self))
    }

    /// Flushes the disk, so that the file a snapshot names holds every
    /// write the guest saw complete, durably (a qcow2 also gives back the
    /// clusters it had reserved, leaving the file without leaks). A
    /// failure is not fatal to the snapshot: the writes are in the file
    /// already, only their durability is unknown.
    fn prepare_snapshot(&mut self) {
        if let Err(e) = self.disk.backend.flush() {
            eprintln!(
                "tine-vmm: cannot flush {} before a snapshot, whose writes may not be durable: {}",
                self.disk.identity.path.display(),
                crate::device_manager::error_chain(&e)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use virtio_bindings::bindings::virtio_ring::{
        VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    };
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;

    use super::super::test_utils::{pattern, MemDisk};
    use super::*;
    use crate::devices::virtio::test_utils::{
        configure_queue, offer, push_chain, test_memory, used_elem,
    };
    use crate::devices::virtio::VIRTIO_MMIO_INT_VRING;

    const R: u16 = 0;
    const W: u16 = VRING_DESC_F_WRITE as u16;
    const NEXT: u16 = VRING_DESC_F_NEXT as u16;
    /// See the rng tests: at 256 entries the mock's used ring stays clear
    /// of the available entries these tests use.
    const Q: u16 = BLOCK_QUEUE_SIZE;
    const QUEUE_ADDR: GuestAddress = GuestAddress(0x1_0000);
    const HEADERS: u64 = 0x20_0000;
    const DATA: u64 = 0x40_0000;
    const DISK_SIZE: usize = 1 << 20;
    const SECTORS: u64 = (DISK_SIZE / 512) as u64;
    const OUTSIDE: u64 = 1 << 40;
    const UNWRITTEN: u8 = 0xee;

    fn config() -> BlockConfig {
        BlockConfig {
            path: PathBuf::from("/images/disk.img"),
            read_only: false,
            serial: "tine-disk-0".into(),
        }
    }

    fn device(disk: &MemDisk) -> Block {
        Block::new(config(), Box::new(disk.clone()))
    }

    fn activate(
        block: &mut Block,
        mem: &GuestMemoryMmap,
        mock: &MockSplitQueue<'_, GuestMemoryMmap>,
    ) {
        configure_queue(&mut block.common.queues[0], mock);
        block.common.acked_features = block.common.avail_features;
        block
            .activate(mem.clone(), Arc::new(IrqTrigger::new().expect("irq")))
            .expect("activate");
    }

    fn activated(
        mem: &GuestMemoryMmap,
        mock: &MockSplitQueue<'_, GuestMemoryMmap>,
    ) -> (Block, MemDisk) {
        let disk = MemDisk::with_pattern(DISK_SIZE);
        let mut block = device(&disk);
        activate(&mut block, mem, mock);
        (block, disk)
    }

    fn header_addr(slot: u64) -> u64 {
        HEADERS + slot * 0x100
    }

    fn status_addr(slot: u64) -> u64 {
        header_addr(slot) + 0x80
    }

    /// Writes request header `slot` and poisons its status byte.
    fn write_header(mem: &GuestMemoryMmap, slot: u64, request_type: u32, sector: u64) -> u64 {
        let mut header = [0u8; 16];
        header[..4].copy_from_slice(&request_type.to_le_bytes());
        header[8..].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&header, GuestAddress(header_addr(slot)))
            .expect("header");
        mem.write_obj(UNWRITTEN, GuestAddress(status_addr(slot)))
            .expect("status");
        header_addr(slot)
    }

    /// Offers header + `data` + status as one chain at descriptor `head`.
    fn submit(
        mem: &GuestMemoryMmap,
        mock: &MockSplitQueue<'_, GuestMemoryMmap>,
        head: u16,
        request_type: u32,
        sector: u64,
        data: &[(u64, u32, u16)],
    ) {
        let slot = u64::from(head);
        let header = write_header(mem, slot, request_type, sector);
        let mut descs = vec![(header, 16, R)];
        descs.extend_from_slice(data);
        descs.push((status_addr(slot), 1, W));
        push_chain(mock, head, &descs);
    }

    fn status(mem: &GuestMemoryMmap, slot: u16) -> u8 {
        mem.read_obj(GuestAddress(status_addr(u64::from(slot))))
            .expect("status")
    }

    fn read_guest(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut data = vec![0; len];
        mem.read_slice(&mut data, GuestAddress(addr)).expect("read");
        data
    }

    fn expected(offset: usize, len: usize) -> Vec<u8> {
        (offset..offset + len).map(pattern).collect()
    }

    fn store(mock: &MockSplitQueue<'_, GuestMemoryMmap>, index: u16, desc: Descriptor) {
        mock.desc_table()
            .store(index, RawDescriptor::from(desc))
            .expect("store");
    }

    #[test]
    fn test_block_new_offers_features_and_config() {
        let block = device(&MemDisk::with_pattern(DISK_SIZE + 100));
        assert_eq!(block.device_type(), device_type::BLOCK);
        assert_eq!(
            block.common().avail_features,
            VIRTIO_F_VERSION_1
                | VIRTIO_RING_F_EVENT_IDX
                | VIRTIO_BLK_F_FLUSH
                | VIRTIO_BLK_F_SEG_MAX
        );
        let mut capacity = [0u8; 8];
        block.read_config(0, &mut capacity);
        assert_eq!(u64::from_le_bytes(capacity), SECTORS);
        let mut seg_max = [0u8; 4];
        block.read_config(12, &mut seg_max);
        assert_eq!(u32::from_le_bytes(seg_max), 254);
        assert_eq!(block.common().queues[0].max_size(), BLOCK_QUEUE_SIZE);
    }

    #[test]
    fn test_block_read_only_offers_ro_feature() {
        let mut disk = MemDisk::with_pattern(DISK_SIZE);
        disk.read_only = true;
        let from_backend = device(&disk);
        let from_config = Block::new(
            BlockConfig {
                read_only: true,
                ..config()
            },
            Box::new(MemDisk::with_pattern(DISK_SIZE)),
        );
        assert_ne!(from_backend.common().avail_features & VIRTIO_BLK_F_RO, 0);
        assert_ne!(from_config.common().avail_features & VIRTIO_BLK_F_RO, 0);
        assert!(from_config.identity().read_only);
    }

    #[test]
    fn test_block_config_read_partial_and_past_end() {
        let mut block = device(&MemDisk::with_pattern(DISK_SIZE));
        let mut byte = [0u8; 1];
        block.read_config(1, &mut byte);
        assert_eq!(byte, [(SECTORS >> 8) as u8]);
        let mut tail = [0xffu8; 8];
        block.read_config(CONFIG_LEN as u64 - 4, &mut tail);
        assert_eq!(tail, [0; 8]);
        block.read_config(u64::MAX, &mut tail);
        assert_eq!(tail, [0; 8]);
        block.write_config(0, &[0xff; 8]);
        block.read_config(0, &mut tail);
        assert_eq!(u64::from_le_bytes(tail), SECTORS);
    }

    #[test]
    fn test_block_in_reads_sectors_across_descriptors() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        // 1024 bytes split unevenly over two buffers.
        submit(
            &mem,
            &mock,
            0,
            VIRTIO_BLK_T_IN,
            3,
            &[(DATA + 1, 700, W), (DATA + 0x1000, 324, W)],
        );

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 1025));
        assert_eq!(read_guest(&mem, DATA + 1, 700), expected(3 * 512, 700));
        assert_eq!(
            read_guest(&mem, DATA + 0x1000, 324),
            expected(3 * 512 + 700, 324)
        );
        let irq = block.common.interrupt.clone().expect("irq");
        assert_eq!(irq.status(), VIRTIO_MMIO_INT_VRING);
    }

    #[test]
    fn test_block_out_writes_sectors_across_descriptors() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        mem.write_slice(&[0xab; 512], GuestAddress(DATA))
            .expect("data");
        mem.write_slice(&[0xcd; 512], GuestAddress(DATA + 0x1000))
            .expect("data");
        submit(
            &mem,
            &mock,
            0,
            VIRTIO_BLK_T_OUT,
            10,
            &[(DATA, 512, R), (DATA + 0x1000, 512, R)],
        );

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 1));
        let contents = disk.contents();
        assert_eq!(&contents[10 * 512..11 * 512], &[0xab; 512]);
        assert_eq!(&contents[11 * 512..12 * 512], &[0xcd; 512]);
        assert_eq!(
            &contents[12 * 512..12 * 512 + 16],
            &expected(12 * 512, 16)[..]
        );
        // FLUSH negotiated: no flush per write.
        assert_eq!(disk.flushes.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn test_block_header_data_status_in_one_buffer_each_direction() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        // Header split over two descriptors; data and status share one.
        let header = write_header(&mem, 0, VIRTIO_BLK_T_IN, 1);
        push_chain(
            &mock,
            0,
            &[(header, 10, R), (header + 10, 6, R), (DATA, 513, W)],
        );

        block.process_queue(0);

        assert_eq!(read_guest(&mem, DATA, 512), expected(512, 512));
        assert_eq!(read_guest(&mem, DATA + 512, 1), vec![VIRTIO_BLK_S_OK]);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 513));
    }

    #[test]
    fn test_block_large_in_and_out_span_several_chunks() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        let sizes = [1000u32, 200_000, 153_816];
        let total: u32 = sizes.iter().sum();
        assert_eq!(total % 512, 0);
        let mut addr = DATA;
        let mut data = Vec::new();
        for size in sizes {
            data.push((addr, size, W));
            addr += u64::from(size) + 0x1000;
        }
        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, 7, &data);
        let out: Vec<_> = data.iter().map(|&(a, l, _)| (a, l, R)).collect();
        submit(&mem, &mock, 8, VIRTIO_BLK_T_OUT, 1000, &out);

        block.process_queue(0);

        assert_eq!((status(&mem, 0), status(&mem, 8)), (0, 0));
        let mut offset = 7 * 512;
        let mut read_back = Vec::new();
        for &(a, l, _) in &data {
            assert_eq!(
                read_guest(&mem, a, l as usize),
                expected(offset, l as usize)
            );
            read_back.extend(read_guest(&mem, a, l as usize));
            offset += l as usize;
        }
        let start = 1000 * 512;
        assert_eq!(
            &disk.contents()[start..start + total as usize],
            &read_back[..]
        );
    }

    #[test]
    fn test_block_zero_length_transfer_succeeds() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, SECTORS, &[]);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 1));
    }

    #[test]
    fn test_block_flush_flushes_backend() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        submit(&mem, &mock, 0, VIRTIO_BLK_T_FLUSH, 0, &[]);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);
        assert_eq!(disk.flushes.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn test_block_get_id_returns_padded_serial() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        mem.write_slice(&[0xff; 32], GuestAddress(DATA))
            .expect("poison");
        submit(&mem, &mock, 0, VIRTIO_BLK_T_GET_ID, 0, &[(DATA, 20, W)]);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 21));
        let mut want = b"tine-disk-0".to_vec();
        want.resize(20, 0);
        assert_eq!(read_guest(&mem, DATA, 20), want);
        assert_eq!(read_guest(&mem, DATA + 20, 1), vec![0xff]);
    }

    #[test]
    fn test_block_get_id_long_serial_truncated_and_short_buffer_bounded() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let disk = MemDisk::with_pattern(DISK_SIZE);
        let mut block = Block::new(
            BlockConfig {
                serial: "0123456789abcdefghijKLMNOP".into(),
                ..config()
            },
            Box::new(disk),
        );
        activate(&mut block, &mem, &mock);
        mem.write_slice(&[0xff; 64], GuestAddress(DATA))
            .expect("poison");
        submit(&mem, &mock, 0, VIRTIO_BLK_T_GET_ID, 0, &[(DATA, 64, W)]);
        submit(
            &mem,
            &mock,
            8,
            VIRTIO_BLK_T_GET_ID,
            0,
            &[(DATA + 0x100, 4, W)],
        );

        block.process_queue(0);

        assert_eq!(
            read_guest(&mem, DATA, 21),
            b"0123456789abcdefghij\xff".to_vec()
        );
        assert_eq!(read_guest(&mem, DATA + 0x100, 4), b"0123".to_vec());
        assert_eq!(used_elem(&mem, &mock, 1), (8, 5));
    }

    #[test]
    fn test_block_unknown_type_returns_unsupp() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        submit(&mem, &mock, 0, 11, 0, &[(DATA, 16, R)]);
        submit(&mem, &mock, 8, u32::MAX, 0, &[]);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_UNSUPP);
        assert_eq!(status(&mem, 8), VIRTIO_BLK_S_UNSUPP);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 1));
    }

    #[test]
    fn test_block_out_on_read_only_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let disk = MemDisk::with_pattern(DISK_SIZE);
        let mut block = Block::new(
            BlockConfig {
                read_only: true,
                ..config()
            },
            Box::new(disk.clone()),
        );
        activate(&mut block, &mem, &mock);
        submit(&mem, &mock, 0, VIRTIO_BLK_T_OUT, 0, &[(DATA, 512, R)]);
        submit(&mem, &mock, 8, VIRTIO_BLK_T_IN, 0, &[(DATA, 512, W)]);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
        assert_eq!(disk.contents(), expected(0, DISK_SIZE));
        assert_eq!(status(&mem, 8), VIRTIO_BLK_S_OK);
    }

    #[test]
    fn test_block_transfer_beyond_end_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, SECTORS, &[(DATA, 512, W)]);
        submit(
            &mem,
            &mock,
            8,
            VIRTIO_BLK_T_OUT,
            SECTORS - 1,
            &[(DATA, 1024, R)],
        );
        submit(
            &mem,
            &mock,
            16,
            VIRTIO_BLK_T_IN,
            SECTORS - 1,
            &[(DATA, 512, W)],
        );

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
        assert_eq!(status(&mem, 8), VIRTIO_BLK_S_IOERR);
        assert_eq!(status(&mem, 16), VIRTIO_BLK_S_OK);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 1));
        assert_eq!(disk.contents(), expected(0, DISK_SIZE));
    }

    #[test]
    fn test_block_sector_overflow_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, u64::MAX, &[(DATA, 512, W)]);
        submit(
            &mem,
            &mock,
            8,
            VIRTIO_BLK_T_IN,
            u64::MAX / 512,
            &[(DATA, 512, W)],
        );
        submit(
            &mem,
            &mock,
            16,
            VIRTIO_BLK_T_OUT,
            1 << 55,
            &[(DATA, 512, R)],
        );

        block.process_queue(0);

        assert_eq!(
            [status(&mem, 0), status(&mem, 8), status(&mem, 16)],
            [VIRTIO_BLK_S_IOERR; 3]
        );
    }

    #[test]
    fn test_block_partial_sector_transfer_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        mem.write_slice(&[0u8; 1024], GuestAddress(DATA))
            .expect("zero");
        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, 0, &[(DATA, 100, W)]);
        submit(
            &mem,
            &mock,
            8,
            VIRTIO_BLK_T_OUT,
            0,
            &[(DATA, 512, R), (DATA, 1, R)],
        );

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
        assert_eq!(status(&mem, 8), VIRTIO_BLK_S_IOERR);
        assert_eq!(read_guest(&mem, DATA, 100), vec![0; 100]);
        assert_eq!(disk.contents(), expected(0, DISK_SIZE));
    }

    #[test]
    fn test_block_short_header_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_IN, 0);
        push_chain(&mock, 0, &[(header, 8, R), (status_addr(0), 1, W)]);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 1));
    }

    #[test]
    fn test_block_writable_header_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_IN, 0);
        push_chain(
            &mock,
            0,
            &[(header, 16, W), (DATA, 512, W), (status_addr(0), 1, W)],
        );

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
    }

    #[test]
    fn test_block_readable_status_dropped_without_io() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_OUT, 0);
        push_chain(
            &mock,
            0,
            &[(header, 16, R), (DATA, 512, R), (status_addr(0), 1, R)],
        );

        block.process_queue(0);

        assert_eq!(mock.used().idx().load(), 1);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 0));
        assert_eq!(status(&mem, 0), UNWRITTEN);
        assert_eq!(disk.contents(), expected(0, DISK_SIZE));
    }

    #[test]
    fn test_block_empty_status_descriptor_dropped() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_IN, 0);
        push_chain(
            &mock,
            0,
            &[(header, 16, R), (DATA, 512, W), (status_addr(0), 0, W)],
        );

        block.process_queue(0);

        assert_eq!(used_elem(&mem, &mock, 0), (0, 0));
        assert_eq!(status(&mem, 0), UNWRITTEN);
    }

    #[test]
    fn test_block_readable_after_writable_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        mem.write_slice(&[0u8; 512], GuestAddress(DATA))
            .expect("zero");
        submit(
            &mem,
            &mock,
            0,
            VIRTIO_BLK_T_IN,
            0,
            &[(DATA, 512, W), (DATA + 0x1000, 512, R)],
        );

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
        assert_eq!(read_guest(&mem, DATA, 512), vec![0; 512]);
    }

    #[test]
    fn test_block_data_outside_memory_returns_ioerr_without_io() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        mem.write_slice(&[0u8; 512], GuestAddress(DATA))
            .expect("zero");
        // The first buffer is fine, the second is not: nothing is done.
        submit(
            &mem,
            &mock,
            0,
            VIRTIO_BLK_T_IN,
            0,
            &[(DATA, 512, W), (OUTSIDE, 512, W)],
        );
        submit(
            &mem,
            &mock,
            8,
            VIRTIO_BLK_T_OUT,
            0,
            &[(DATA, 512, R), (OUTSIDE, 512, R)],
        );
        // Straddles the end of guest memory.
        submit(
            &mem,
            &mock,
            16,
            VIRTIO_BLK_T_IN,
            0,
            &[((16 << 20) - 256, 512, W)],
        );
        submit(
            &mem,
            &mock,
            24,
            VIRTIO_BLK_T_IN,
            0,
            &[(u64::MAX - 255, 512, W)],
        );

        block.process_queue(0);

        assert_eq!(
            [
                status(&mem, 0),
                status(&mem, 8),
                status(&mem, 16),
                status(&mem, 24)
            ],
            [VIRTIO_BLK_S_IOERR; 4]
        );
        assert_eq!(read_guest(&mem, DATA, 512), vec![0; 512]);
        assert_eq!(disk.contents(), expected(0, DISK_SIZE));
    }

    #[test]
    fn test_block_header_outside_memory_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        write_header(&mem, 0, VIRTIO_BLK_T_IN, 0);
        push_chain(&mock, 0, &[(OUTSIDE, 16, R), (status_addr(0), 1, W)]);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
    }

    #[test]
    fn test_block_status_outside_memory_dropped() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_OUT, 0);
        push_chain(
            &mock,
            0,
            &[(header, 16, R), (DATA, 512, R), (OUTSIDE, 1, W)],
        );
        submit(&mem, &mock, 8, VIRTIO_BLK_T_FLUSH, 0, &[]);

        block.process_queue(0);

        assert_eq!(used_elem(&mem, &mock, 0), (0, 0));
        assert_eq!(disk.contents(), expected(0, DISK_SIZE));
        assert_eq!(status(&mem, 8), VIRTIO_BLK_S_OK);
    }

    #[test]
    fn test_block_huge_lengths_return_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        // Whole sectors, just under the 4 GiB chain limit with header and
        // status.
        let huge = 0xffff_fe00;
        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, 0, &[(DATA, huge, W)]);
        submit(&mem, &mock, 8, VIRTIO_BLK_T_OUT, 0, &[(DATA, huge, R)]);
        let header = write_header(&mem, 16, VIRTIO_BLK_T_OUT, 0);
        push_chain(&mock, 16, &[(header, huge, R), (status_addr(16), 1, W)]);

        block.process_queue(0);

        assert_eq!(
            [status(&mem, 0), status(&mem, 8), status(&mem, 16)],
            [VIRTIO_BLK_S_IOERR; 3]
        );
        assert_eq!(disk.contents(), expected(0, DISK_SIZE));
    }

    #[test]
    fn test_block_chain_over_4_gib_dropped() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        // virtio-queue stops yielding descriptors past 4 GiB (spec 2.7.5.2),
        // so the status byte is never reached.
        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, 0, &[(DATA, u32::MAX, W)]);
        submit(
            &mem,
            &mock,
            8,
            VIRTIO_BLK_T_OUT,
            0,
            &[(DATA, u32::MAX, R), (DATA, u32::MAX, R)],
        );
        submit(&mem, &mock, 16, VIRTIO_BLK_T_FLUSH, 0, &[]);

        block.process_queue(0);

        assert_eq!(mock.used().idx().load(), 3);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 0));
        assert_eq!(used_elem(&mem, &mock, 1), (8, 0));
        assert_eq!((status(&mem, 0), status(&mem, 8)), (UNWRITTEN, UNWRITTEN));
        assert_eq!(status(&mem, 16), VIRTIO_BLK_S_OK);
        assert_eq!(disk.contents(), expected(0, DISK_SIZE));
    }

    #[test]
    fn test_block_self_looping_chain_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_IN, 0);
        store(&mock, 0, Descriptor::new(header, 16, R | NEXT, 1));
        store(&mock, 1, Descriptor::new(status_addr(0), 1, W | NEXT, 1));
        offer(&mock, 0);
        submit(&mem, &mock, 8, VIRTIO_BLK_T_FLUSH, 0, &[]);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 1));
        assert_eq!(status(&mem, 8), VIRTIO_BLK_S_OK);
    }

    #[test]
    fn test_block_loop_through_readable_descriptor_dropped() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_IN, 0);
        store(&mock, 0, Descriptor::new(header, 16, R | NEXT, 0));
        offer(&mock, 0);

        block.process_queue(0);

        assert_eq!(mock.used().idx().load(), 1);
        assert_eq!(used_elem(&mem, &mock, 0), (0, 0));
    }

    #[test]
    fn test_block_next_index_outside_table_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_IN, 0);
        store(&mock, 0, Descriptor::new(header, 16, R | NEXT, 1));
        store(
            &mock,
            1,
            Descriptor::new(status_addr(0), 1, W | NEXT, 0xffff),
        );
        offer(&mock, 0);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
    }

    #[test]
    fn test_block_indirect_chain_longer_than_queue_returns_ioerr() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_OUT, 0);
        // header + 299 data descriptors + status: 301 > 256.
        let table = GuestAddress(0x80_0000);
        let count: u16 = 301;
        for i in 0..count {
            let desc = match i {
                0 => Descriptor::new(header, 16, R | NEXT, 1),
                i if i == count - 1 => Descriptor::new(status_addr(0), 1, W, 0),
                i => Descriptor::new(DATA, 512, R | NEXT, i + 1),
            };
            mem.write_obj(
                RawDescriptor::from(desc),
                table.unchecked_add(16 * u64::from(i)),
            )
            .expect("indirect descriptor");
        }
        let indirect = Descriptor::new(
            table.0,
            16 * u32::from(count),
            VRING_DESC_F_INDIRECT as u16,
            0,
        );
        store(&mock, 0, indirect);
        offer(&mock, 0);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_IOERR);
        assert_eq!(disk.contents(), expected(0, DISK_SIZE));
    }

    #[test]
    fn test_block_indirect_chain_within_queue_served() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);
        let header = write_header(&mem, 0, VIRTIO_BLK_T_IN, 2);
        let table = GuestAddress(0x80_0000);
        let descs = [
            Descriptor::new(header, 16, R | NEXT, 1),
            Descriptor::new(DATA, 512, W | NEXT, 2),
            Descriptor::new(status_addr(0), 1, W, 0),
        ];
        for (i, desc) in descs.into_iter().enumerate() {
            mem.write_obj(
                RawDescriptor::from(desc),
                table.unchecked_add(16 * i as u64),
            )
            .expect("indirect descriptor");
        }
        store(
            &mock,
            0,
            Descriptor::new(table.0, 48, VRING_DESC_F_INDIRECT as u16, 0),
        );
        offer(&mock, 0);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);
        assert_eq!(read_guest(&mem, DATA, 512), expected(1024, 512));
    }

    #[test]
    fn test_block_backend_failure_returns_ioerr_then_recovers() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, disk) = activated(&mem, &mock);
        disk.fail.store(true, Ordering::SeqCst);
        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, 0, &[(DATA, 512, W)]);
        submit(&mem, &mock, 8, VIRTIO_BLK_T_OUT, 0, &[(DATA, 512, R)]);
        submit(&mem, &mock, 16, VIRTIO_BLK_T_FLUSH, 0, &[]);

        block.process_queue(0);
        disk.fail.store(false, Ordering::SeqCst);
        submit(&mem, &mock, 24, VIRTIO_BLK_T_IN, 0, &[(DATA, 512, W)]);
        block.process_queue(0);

        assert_eq!(
            [status(&mem, 0), status(&mem, 8), status(&mem, 16)],
            [VIRTIO_BLK_S_IOERR; 3]
        );
        assert_eq!(status(&mem, 24), VIRTIO_BLK_S_OK);
        assert_eq!(mock.used().idx().load(), 4);
    }

    #[test]
    fn test_block_writethrough_without_flush_feature_flushes_each_write() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let disk = MemDisk::with_pattern(DISK_SIZE);
        let mut block = device(&disk);
        activate(&mut block, &mem, &mock);
        block.common.acked_features &= !VIRTIO_BLK_F_FLUSH;
        submit(&mem, &mock, 0, VIRTIO_BLK_T_OUT, 0, &[(DATA, 512, R)]);
        submit(&mem, &mock, 8, VIRTIO_BLK_T_IN, 0, &[(DATA, 512, W)]);

        block.process_queue(0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);
        assert_eq!(disk.flushes.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn test_block_notify_before_activation_or_other_queue_ignored() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let disk = MemDisk::with_pattern(DISK_SIZE);
        let mut block = device(&disk);
        configure_queue(&mut block.common.queues[0], &mock);
        submit(&mem, &mock, 0, VIRTIO_BLK_T_FLUSH, 0, &[]);

        block.process_queue(0);
        activate(&mut block, &mem, &mock);
        block.process_queue(1);

        assert_eq!(mock.used().idx().load(), 0);
    }

    #[test]
    fn test_block_reset_deactivates() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let (mut block, _) = activated(&mem, &mock);

        block.reset();
        submit(&mem, &mock, 0, VIRTIO_BLK_T_FLUSH, 0, &[]);
        block.process_queue(0);

        assert!(!block.common().is_activated());
        assert_eq!(block.common().acked_features, 0);
        assert_eq!(mock.used().idx().load(), 0);
    }

    #[test]
    fn test_block_open_raw_serves_file() {
        let mut file = tempfile::NamedTempFile::new().expect("tempfile");
        std::io::Write::write_all(&mut file, &expected(0, 4096)).expect("write");
        let mut block = Block::open_raw(BlockConfig {
            path: file.path().to_path_buf(),
            read_only: true,
            serial: String::new(),
        })
        .expect("open");
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        activate(&mut block, &mem, &mock);
        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, 7, &[(DATA, 512, W)]);

        block.process_queue(0);

        assert_eq!(block.capacity(), 8);
        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);
        assert_eq!(read_guest(&mem, DATA, 512), expected(7 * 512, 512));
        assert_ne!(block.common().avail_features & VIRTIO_BLK_F_RO, 0);
    }

    #[test]
    fn test_block_open_raw_missing_file_fails() {
        let dir = tempfile::tempdir().expect("tempdir");
        let result = Block::open_raw(BlockConfig {
            path: dir.path().join("missing.img"),
            ..config()
        });
        assert!(matches!(result, Err(BlockError::Open { .. })));
    }

    #[test]
    fn test_block_open_serves_qcow2_and_rejects_broken_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("disk.qcow2");
        tine_disk::create_empty(&path, 8192).expect("create");
        let mut block = Block::open(BlockConfig {
            path: path.clone(),
            read_only: false,
            serial: String::new(),
        })
        .expect("open");
        assert_eq!(block.capacity(), 16);
        assert_eq!(block.common().avail_features & VIRTIO_BLK_F_RO, 0);
        block.prepare_snapshot();

        let mut bytes = std::fs::read(&path).expect("read");
        bytes[20..24].copy_from_slice(&40u32.to_be_bytes()); // cluster_bits
        std::fs::write(&path, &bytes).expect("write");
        let result = Block::open(BlockConfig {
            path,
            read_only: true,
            serial: String::new(),
        });
        assert!(matches!(result, Err(BlockError::Image { .. })));
        let missing = Block::open(BlockConfig {
            path: dir.path().join("missing"),
            read_only: true,
            serial: String::new(),
        });
        assert!(matches!(missing, Err(BlockError::Open { .. })));
    }

    #[test]
    fn test_block_switch_disk_freezes_the_old_image_under_an_overlay() {
        let dir = tempfile::tempdir().expect("tempdir");
        let live = dir.path().join("disk.qcow2");
        tine_disk::create_empty(&live, DISK_SIZE as u64).expect("create");
        let mut block = Block::open(BlockConfig {
            path: live.clone(),
            read_only: false,
            serial: String::new(),
        })
        .expect("open");
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        activate(&mut block, &mem, &mock);
        mem.write_slice(&[0xa1; 512], GuestAddress(DATA))
            .expect("data");
        submit(&mem, &mock, 0, VIRTIO_BLK_T_OUT, 3, &[(DATA, 512, R)]);
        block.process_queue(0);
        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);

        // What a memory commit does while the VM is paused: the snapshot
        // flushes the disk, the image gets a second name (the commit) and
        // an overlay on it, and the device goes on in the overlay.
        block.prepare_snapshot();
        let frozen = dir.path().join("commit.qcow2");
        std::fs::hard_link(&live, &frozen).expect("link");
        let overlay = dir.path().join("disk-2.qcow2");
        tine_disk::create_overlay(&overlay, &frozen, tine_disk::Format::Qcow2, None)
            .expect("overlay");
        let frozen_before = std::fs::read(&frozen).expect("read");
        block.switch_disk(&overlay).expect("switch");
        assert_eq!(block.identity().path, overlay);

        submit(&mem, &mock, 8, VIRTIO_BLK_T_IN, 3, &[(DATA + 512, 512, W)]);
        mem.write_slice(&[0xb2; 512], GuestAddress(DATA + 1024))
            .expect("data");
        submit(
            &mem,
            &mock,
            16,
            VIRTIO_BLK_T_OUT,
            3,
            &[(DATA + 1024, 512, R)],
        );
        block.process_queue(0);
        assert_eq!(status(&mem, 8), VIRTIO_BLK_S_OK);
        assert_eq!(status(&mem, 16), VIRTIO_BLK_S_OK);
        assert_eq!(read_guest(&mem, DATA + 512, 512), vec![0xa1; 512]);
        let frozen_after = std::fs::read(&frozen).expect("read");
        let changed = frozen_after
            .iter()
            .zip(&frozen_before)
            .position(|(a, b)| a != b);
        assert!(
            changed.is_none() && frozen_after.len() == frozen_before.len(),
            "the frozen image changed after the switch (first at byte {changed:?}, {} -> {} bytes)",
            frozen_before.len(),
            frozen_after.len()
        );
        let mut reopened = tine_disk::open_disk(&overlay, true).expect("reopen");
        let mut sector = vec![0u8; 512];
        reopened.read_at(&mut sector, 3 * 512).expect("read");
        assert_eq!(sector, vec![0xb2; 512]);
    }

    #[test]
    fn test_block_switch_disk_refuses_another_size_and_keeps_serving() {
        let dir = tempfile::tempdir().expect("tempdir");
        let live = dir.path().join("disk.qcow2");
        tine_disk::create_empty(&live, DISK_SIZE as u64).expect("create");
        let small = dir.path().join("small.qcow2");
        tine_disk::create_empty(&small, DISK_SIZE as u64 / 2).expect("create");
        let mut block = Block::open(BlockConfig {
            path: live.clone(),
            read_only: false,
            serial: String::new(),
        })
        .expect("open");
        let err = block.switch_disk(&small).expect_err("another size");
        assert!(
            err.to_string().contains("the guest knows a disk of"),
            "{err}"
        );
        let missing = block
            .switch_disk(&dir.path().join("missing"))
            .expect_err("missing");
        assert!(matches!(missing, BlockError::Open { .. }), "{missing}");
        assert_eq!(block.identity().path, live);
        assert_eq!(block.capacity(), SECTORS);
    }

    #[test]
    fn test_block_behind_mmio_transport_serves_linux_driver() {
        use crate::devices::bus::BusDevice;
        use crate::devices::virtio::mmio::{device_status::*, regs, MmioTransport};

        fn rd(t: &mut MmioTransport, offset: u64) -> u32 {
            let mut data = [0u8; 4];
            t.read(offset, &mut data);
            u32::from_le_bytes(data)
        }
        fn wr(t: &mut MmioTransport, offset: u64, value: u32) {
            t.write(offset, &value.to_le_bytes());
        }
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
        let disk = MemDisk::with_pattern(DISK_SIZE);
        let mut t = MmioTransport::new(mem.clone(), Box::new(device(&disk))).expect("transport");

        assert_eq!(rd(&mut t, regs::DEVICE_ID), device_type::BLOCK);
        wr(&mut t, regs::STATUS, 0);
        wr(&mut t, regs::STATUS, ACKNOWLEDGE);
        wr(&mut t, regs::STATUS, ACKNOWLEDGE | DRIVER);
        wr(&mut t, regs::DEVICE_FEATURES_SEL, 1);
        let high = rd(&mut t, regs::DEVICE_FEATURES);
        wr(&mut t, regs::DEVICE_FEATURES_SEL, 0);
        let low = rd(&mut t, regs::DEVICE_FEATURES);
        wr(&mut t, regs::DRIVER_FEATURES_SEL, 1);
        wr(&mut t, regs::DRIVER_FEATURES, high);
        wr(&mut t, regs::DRIVER_FEATURES_SEL, 0);
        wr(&mut t, regs::DRIVER_FEATURES, low);
        wr(&mut t, regs::STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
        assert_eq!(rd(&mut t, regs::STATUS) & FEATURES_OK, FEATURES_OK);
        let capacity =
            u64::from(rd(&mut t, regs::CONFIG)) | (u64::from(rd(&mut t, regs::CONFIG + 4)) << 32);
        assert_eq!(capacity, SECTORS);
        wr(&mut t, regs::QUEUE_SEL, 0);
        assert_eq!(rd(&mut t, regs::QUEUE_NUM_MAX), u32::from(BLOCK_QUEUE_SIZE));
        wr(&mut t, regs::QUEUE_NUM, u32::from(Q));
        wr(
            &mut t,
            regs::QUEUE_DESC_LOW,
            mock.desc_table_addr().0 as u32,
        );
        wr(&mut t, regs::QUEUE_DRIVER_LOW, mock.avail_addr().0 as u32);
        wr(&mut t, regs::QUEUE_DEVICE_LOW, mock.used_addr().0 as u32);
        wr(&mut t, regs::QUEUE_READY, 1);
        wr(
            &mut t,
            regs::STATUS,
            ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK,
        );
        assert!(t.is_activated());

        submit(&mem, &mock, 0, VIRTIO_BLK_T_IN, 5, &[(DATA, 4096, W)]);
        wr(&mut t, regs::QUEUE_NOTIFY, 0);

        assert_eq!(status(&mem, 0), VIRTIO_BLK_S_OK);
        assert_eq!(read_guest(&mem, DATA, 4096), expected(5 * 512, 4096));
        let pending = rd(&mut t, regs::INTERRUPT_STATUS);
        assert_eq!(pending, VIRTIO_MMIO_INT_VRING);
        wr(&mut t, regs::INTERRUPT_ACK, pending);
        assert_eq!(rd(&mut t, regs::INTERRUPT_STATUS), 0);
    }

    /// Random descriptor tables, rings and headers: the device must
    /// neither panic nor write outside the buffers, and must answer every
    /// chain whose head is inside the table.
    #[test]
    fn test_block_random_chains_never_panic() {
        use crate::devices::virtio::test_utils::XorShift;

        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        let mem = test_memory();
        let mem_end = 16u64 << 20;
        let disk = MemDisk::with_pattern(DISK_SIZE);
        let mut outcomes = [0usize; 3];
        for _ in 0..200 {
            let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, Q);
            let mut block = device(&disk);
            activate(&mut block, &mem, &mock);
            let types = [
                VIRTIO_BLK_T_IN,
                VIRTIO_BLK_T_OUT,
                VIRTIO_BLK_T_FLUSH,
                VIRTIO_BLK_T_GET_ID,
                11,
                u32::MAX,
            ];
            for slot in 0..32 {
                let sector = match rng.below(3) {
                    0 => rng.below(SECTORS),
                    1 => SECTORS - rng.below(4),
                    _ => rng.bits(),
                };
                write_header(&mem, slot, rng.pick(&types), sector);
            }
            let mut index = 0;
            while index < Q {
                if index + 3 <= Q && rng.below(3) == 0 {
                    // A plausible request, perhaps with one flag flipped.
                    let slot = rng.below(32);
                    let data_flags = rng.pick(&[R, W]);
                    let data_len = 512 * rng.below(9) as u32;
                    let mut descs = [
                        Descriptor::new(header_addr(slot), 16, R | NEXT, index + 1),
                        Descriptor::new(
                            DATA + 0x1000 * slot,
                            data_len,
                            data_flags | NEXT,
                            index + 2,
                        ),
                        Descriptor::new(status_addr(slot), 1, W, 0),
                    ];
                    if rng.below(4) == 0 {
                        let victim = rng.below(3) as usize;
                        let d = descs[victim];
                        let flip = rng.pick(&[NEXT, W]);
                        descs[victim] =
                            Descriptor::new(d.addr().0, d.len(), d.flags() ^ flip, d.next());
                    }
                    for (i, desc) in descs.into_iter().enumerate() {
                        store(&mock, index + i as u16, desc);
                    }
                    index += 3;
                    continue;
                }
                let addr = match rng.below(6) {
                    0 | 1 => header_addr(rng.below(32)),
                    2 => DATA + rng.below(0x10_0000),
                    3 => mem_end - rng.below(1024),
                    4 => OUTSIDE + rng.below(1024),
                    _ => u64::MAX - rng.below(1024),
                };
                let len = match rng.below(6) {
                    0 => 0,
                    1 => 1,
                    2 => 16,
                    3 => 512 * rng.below(8) as u32,
                    4 => rng.below(0x2_0000) as u32,
                    _ => u32::MAX - rng.below(2) as u32,
                };
                let mut flags = 0;
                for flag in [NEXT, W, VRING_DESC_F_INDIRECT as u16] {
                    if rng.below(3) == 0 {
                        flags |= flag;
                    }
                }
                let next = if rng.below(8) == 0 {
                    rng.bits() as u16
                } else {
                    rng.below(u64::from(Q)) as u16
                };
                store(&mock, index, Descriptor::new(addr, len, flags, next));
                index += 1;
            }
            let offered = 1 + rng.below(32) as u16;
            let mut answerable = 0;
            for _ in 0..offered {
                let head = if rng.below(10) == 0 {
                    rng.bits() as u16
                } else {
                    rng.below(u64::from(Q)) as u16
                };
                answerable += u16::from(head < Q);
                offer(&mock, head);
            }

            block.process_queue(0);

            assert_eq!(mock.used().idx().load(), answerable);
            assert_eq!(block.common.queues[0].next_avail(), offered);
            for slot in 0..answerable {
                let (_, len) = used_elem(&mem, &mock, slot);
                outcomes[usize::from(len > 0) + usize::from(len > 1)] += 1;
            }
        }
        // Dropped, status only, and data returned all happened.
        assert!(outcomes.iter().all(|&n| n > 0), "{outcomes:?}");
    }

    #[test]
    fn test_split_segments_splits_inside_and_between() {
        let segs = [
            Segment {
                addr: GuestAddress(0x1000),
                len: 10,
            },
            Segment {
                addr: GuestAddress(0x2000),
                len: 10,
            },
        ];
        let (head, tail) = split_segments(&segs, 16).expect("split");
        assert_eq!(total_len(&head), 16);
        assert_eq!(
            tail,
            vec![Segment {
                addr: GuestAddress(0x2006),
                len: 4
            }]
        );
        assert_eq!(split_segments(&segs, 20).map(|(_, t)| t), Some(vec![]));
        assert!(split_segments(&segs, 21).is_none());
    }
}
