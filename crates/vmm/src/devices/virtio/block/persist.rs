//! Snapshot state of the block device.
//!
//! The state names the disk (path, read-only, size) but holds no file
//! descriptor: the caller reopens the image and passes the backend in, and
//! restore checks it is the same size and can be written if it was.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::device::{Block, DiskIdentity};
use super::SERIAL_LEN;
use crate::devices::virtio::persist::{QueueRestoreError, VirtioCommonState};
use crate::devices::virtio::{ActivateError, IrqTrigger, VirtioDevice};
use crate::snapshot::Persist;
use crate::vstate::memory::GuestMemoryMmap;
use tine_disk::BlockBackend;

/// Snapshot state of [`Block`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    /// Features, queues and activation.
    pub common: VirtioCommonState,
    /// The disk.
    pub disk: DiskIdentity,
    /// The device ID string.
    pub serial: [u8; SERIAL_LEN],
}

/// Host resources to rebuild a [`Block`].
#[derive(Debug)]
pub struct BlockConstructorArgs {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The interrupt line the device signals once re-activated; the
    /// transport shares it.
    pub interrupt: Arc<IrqTrigger>,
    /// The disk, reopened from [`DiskIdentity::path`] or from `path`.
    pub backend: Box<dyn BlockBackend>,
    /// Where `backend` was opened, when not the saved path (a fork's own
    /// disk): the restored device names it, so its next snapshot does too.
    pub path: Option<PathBuf>,
}

/// Why a [`Block`] could not be restored.
#[derive(Debug, thiserror::Error)]
pub enum BlockPersistError {
    /// A saved queue is invalid.
    #[error("cannot restore the block device's queues")]
    Queue(#[from] QueueRestoreError),
    /// The saved state has the wrong number of queues.
    #[error("block device state has {0} queues, expected 1")]
    QueueCount(usize),
    /// The reopened disk is not the size the guest knows.
    #[error("disk {path} is {found} bytes, the snapshot expects {expected}")]
    SizeMismatch {
        /// The image.
        path: PathBuf,
        /// Size in the snapshot.
        expected: u64,
        /// Size of the reopened disk.
        found: u64,
    },
    /// The guest may write the disk but it was reopened read-only.
    #[error("disk {0} was writable in the snapshot but is reopened read-only")]
    ReadOnlyBackend(PathBuf),
    /// The device was active but its queues do not fit guest memory.
    #[error("cannot re-activate the block device")]
    Activate(#[from] ActivateError),
}

impl Persist for Block {
    type State = BlockState;
    type ConstructorArgs = BlockConstructorArgs;
    type Error = BlockPersistError;

    fn save(&self) -> Self::State {
        BlockState {
            common: VirtioCommonState::save(self.common()),
            disk: self.identity().clone(),
            serial: *self.serial(),
        }
    }

    /// Rebuilds the device over the reopened disk and, if it was active,
    /// re-activates it.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error> {
        if state.common.queues.len() != 1 {
            return Err(BlockPersistError::QueueCount(state.common.queues.len()));
        }
        let found = args.backend.size();
        if found != state.disk.size {
            return Err(BlockPersistError::SizeMismatch {
                path: state.disk.path.clone(),
                expected: state.disk.size,
                found,
            });
        }
        if !state.disk.read_only && args.backend.is_read_only() {
            return Err(BlockPersistError::ReadOnlyBackend(state.disk.path.clone()));
        }
        let mut common = state.common.restore()?;
        if state.common.activated {
            common.activate(args.mem, args.interrupt)?;
        }
        let identity = DiskIdentity {
            path: args.path.unwrap_or_else(|| state.disk.path.clone()),
            ..state.disk.clone()
        };
        Ok(Block::from_parts(
            common,
            identity,
            state.serial,
            args.backend,
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use tine_disk::RawFile;
    use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};

    use super::super::device::BlockConfig;
    use super::super::request_type::{VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
    use super::super::test_utils::MemDisk;
    use super::super::BLOCK_QUEUE_SIZE;
    use super::*;
    use crate::devices::virtio::persist::VirtioDeviceState;
    use crate::devices::virtio::test_utils::{configure_queue, push_chain, test_memory};
    use crate::devices::virtio::VIRTIO_MMIO_INT_VRING;

    const W: u16 = VRING_DESC_F_WRITE as u16;
    const QUEUE_ADDR: GuestAddress = GuestAddress(0x1_0000);
    const HEADER: u64 = 0x20_0000;
    const STATUS: u64 = 0x20_0080;
    const DATA: u64 = 0x40_0000;

    fn image(size: usize) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().expect("tempfile");
        file.write_all(&vec![0u8; size]).expect("write");
        file
    }

    fn config(path: &std::path::Path, read_only: bool) -> BlockConfig {
        BlockConfig {
            path: path.to_path_buf(),
            read_only,
            serial: "snap".into(),
        }
    }

    fn args(mem: &GuestMemoryMmap, backend: Box<dyn BlockBackend>) -> BlockConstructorArgs {
        BlockConstructorArgs {
            mem: mem.clone(),
            interrupt: Arc::new(IrqTrigger::new().expect("irq")),
            backend,
            path: None,
        }
    }

    /// Offers a one-sector request at descriptor `head` and returns after
    /// the device served it, with its status byte.
    fn request(
        mem: &GuestMemoryMmap,
        mock: &MockSplitQueue<'_, GuestMemoryMmap>,
        block: &mut Block,
        head: u16,
        request_type: u32,
    ) -> u8 {
        let mut header = [0u8; 16];
        header[..4].copy_from_slice(&request_type.to_le_bytes());
        mem.write_slice(&header, GuestAddress(HEADER))
            .expect("header");
        let flags = if request_type == VIRTIO_BLK_T_IN {
            W
        } else {
            0
        };
        push_chain(
            mock,
            head,
            &[(HEADER, 16, 0), (DATA, 512, flags), (STATUS, 1, W)],
        );
        block.process_queue(0);
        mem.read_obj(GuestAddress(STATUS)).expect("status")
    }

    fn activate(
        block: &mut Block,
        mem: &GuestMemoryMmap,
        mock: &MockSplitQueue<'_, GuestMemoryMmap>,
    ) {
        configure_queue(&mut block.common_mut().queues[0], mock);
        block.common_mut().acked_features = block.common().avail_features;
        block
            .activate(mem.clone(), Arc::new(IrqTrigger::new().expect("irq")))
            .expect("activate");
    }

    #[test]
    fn test_block_save_restore_round_trip_equal() {
        let file = image(64 * 1024);
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, BLOCK_QUEUE_SIZE);
        let mut block = Block::open_raw(config(file.path(), false)).expect("open");
        activate(&mut block, &mem, &mock);
        mem.write_slice(&[0x5a; 512], GuestAddress(DATA))
            .expect("data");
        assert_eq!(request(&mem, &mock, &mut block, 0, VIRTIO_BLK_T_OUT), 0);
        let state = <Block as Persist>::save(&block);
        let json = serde_json::to_string(&state).expect("serialize");
        let state: BlockState = serde_json::from_str(&json).expect("deserialize");
        drop(block);

        let backend = RawFile::open(&state.disk.path, state.disk.read_only).expect("reopen");
        let args = args(&mem, Box::new(backend));
        let interrupt = args.interrupt.clone();
        let mut restored = Block::restore(args, &state).expect("restore");

        assert_eq!(<Block as Persist>::save(&restored), state);
        assert!(restored.common().is_activated());
        mem.write_slice(&[0; 512], GuestAddress(DATA))
            .expect("clear");
        assert_eq!(request(&mem, &mock, &mut restored, 3, VIRTIO_BLK_T_IN), 0);
        let mut data = [0u8; 512];
        mem.read_slice(&mut data, GuestAddress(DATA)).expect("read");
        assert_eq!(data, [0x5a; 512]);
        assert_eq!(interrupt.status(), VIRTIO_MMIO_INT_VRING);
        assert_eq!(mock.used().idx().load(), 2);
    }

    #[test]
    fn test_block_save_restore_qcow2_overlay_reopens_chain() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("base.raw");
        std::fs::write(&base, [0x11u8; 64 * 1024]).expect("base");
        let disk = dir.path().join("disk.qcow2");
        tine_disk::create_overlay(&disk, &base, tine_disk::Format::Raw, None).expect("overlay");
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, BLOCK_QUEUE_SIZE);
        let mut block = Block::open(config(&disk, false)).expect("open");
        activate(&mut block, &mem, &mock);
        mem.write_slice(&[0x5a; 512], GuestAddress(DATA))
            .expect("data");
        assert_eq!(request(&mem, &mock, &mut block, 0, VIRTIO_BLK_T_OUT), 0);
        block.prepare_snapshot();
        let state = <Block as Persist>::save(&block);
        // Snapshot taken: the overlay is consistent without leaks while the
        // VM still runs.
        assert!(tine_disk::check(&disk).expect("check").is_clean());
        drop(block);

        let backend = tine_disk::open_disk(&state.disk.path, state.disk.read_only).expect("reopen");
        let mut restored = Block::restore(args(&mem, backend), &state).expect("restore");

        mem.write_slice(&[0; 512], GuestAddress(DATA))
            .expect("clear");
        assert_eq!(request(&mem, &mock, &mut restored, 3, VIRTIO_BLK_T_IN), 0);
        let mut data = [0u8; 512];
        mem.read_slice(&mut data, GuestAddress(DATA)).expect("read");
        assert_eq!(data, [0x5a; 512]);
        // The base was never written.
        assert_eq!(std::fs::read(&base).expect("base"), vec![0x11u8; 64 * 1024]);
    }

    #[test]
    fn test_block_state_names_disk_without_fd() {
        let file = image(4096);
        let block = Block::open_raw(config(file.path(), true)).expect("open");

        let state = VirtioDevice::save(&block);

        let VirtioDeviceState::Block(state) = state else {
            panic!("not a block state: {state:?}");
        };
        assert_eq!(
            state.disk,
            DiskIdentity {
                path: file.path().to_path_buf(),
                read_only: true,
                size: 4096,
            }
        );
        assert_eq!(&state.serial[..5], b"snap\0");
        let json = serde_json::to_value(&state).expect("serialize");
        let keys: Vec<_> = json["disk"]
            .as_object()
            .expect("object")
            .keys()
            .cloned()
            .collect();
        assert_eq!(keys, ["path", "read_only", "size"]);
    }

    #[test]
    fn test_block_restore_inactive_stays_inactive() {
        let mem = test_memory();
        let disk = MemDisk::with_pattern(8192);
        let block = Block::new(
            config(std::path::Path::new("/d"), false),
            Box::new(disk.clone()),
        );
        let state = <Block as Persist>::save(&block);

        let restored = Block::restore(args(&mem, Box::new(disk)), &state).expect("restore");

        assert!(!restored.common().is_activated());
        assert_eq!(<Block as Persist>::save(&restored), state);
    }

    #[test]
    fn test_block_restore_size_mismatch_fails() {
        let mem = test_memory();
        let block = Block::new(
            config(std::path::Path::new("/d"), false),
            Box::new(MemDisk::with_pattern(8192)),
        );
        let state = <Block as Persist>::save(&block);

        let result = Block::restore(args(&mem, Box::new(MemDisk::with_pattern(4096))), &state);

        assert!(matches!(
            result,
            Err(BlockPersistError::SizeMismatch {
                expected: 8192,
                found: 4096,
                ..
            })
        ));
    }

    #[test]
    fn test_block_restore_writable_disk_on_read_only_backend_fails() {
        let mem = test_memory();
        let block = Block::new(
            config(std::path::Path::new("/d"), false),
            Box::new(MemDisk::with_pattern(8192)),
        );
        let state = <Block as Persist>::save(&block);
        let mut backend = MemDisk::with_pattern(8192);
        backend.read_only = true;

        let result = Block::restore(args(&mem, Box::new(backend)), &state);

        assert!(matches!(result, Err(BlockPersistError::ReadOnlyBackend(_))));
    }

    #[test]
    fn test_block_restore_read_only_disk_stays_read_only_on_writable_backend() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, BLOCK_QUEUE_SIZE);
        let mut block = Block::new(
            config(std::path::Path::new("/d"), true),
            Box::new(MemDisk::with_pattern(8192)),
        );
        activate(&mut block, &mem, &mock);
        let state = <Block as Persist>::save(&block);
        let backend = MemDisk::with_pattern(8192);

        let mut restored =
            Block::restore(args(&mem, Box::new(backend.clone())), &state).expect("restore");

        assert_eq!(request(&mem, &mock, &mut restored, 0, VIRTIO_BLK_T_OUT), 1);
        assert_eq!(backend.contents(), MemDisk::with_pattern(8192).contents());
    }

    #[test]
    fn test_block_restore_wrong_queue_count_fails() {
        let mem = test_memory();
        let disk = MemDisk::with_pattern(8192);
        let block = Block::new(
            config(std::path::Path::new("/d"), false),
            Box::new(disk.clone()),
        );
        let mut state = <Block as Persist>::save(&block);
        state.common.queues.push(state.common.queues[0].clone());

        let result = Block::restore(args(&mem, Box::new(disk)), &state);

        assert!(matches!(result, Err(BlockPersistError::QueueCount(2))));
    }

    #[test]
    fn test_block_restore_active_queue_outside_memory_fails() {
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, QUEUE_ADDR, BLOCK_QUEUE_SIZE);
        let disk = MemDisk::with_pattern(8192);
        let mut block = Block::new(
            config(std::path::Path::new("/d"), false),
            Box::new(disk.clone()),
        );
        activate(&mut block, &mem, &mock);
        let mut state = <Block as Persist>::save(&block);
        state.common.queues[0].desc_table = 1 << 40;

        let result = Block::restore(args(&mem, Box::new(disk)), &state);

        assert!(matches!(result, Err(BlockPersistError::Activate(_))));
    }
}
