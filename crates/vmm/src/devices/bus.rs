//! Port-I/O and MMIO buses: map an address range to the device that owns it.
//!
//! Each device sits behind its own small lock, so a vCPU in one device never
//! waits for another device, and the bus itself is immutable once the VM runs.

use std::sync::{Arc, Mutex};

/// A device reachable through a bus. `offset` is relative to the start of the
/// range the device was inserted at.
pub trait BusDevice: Send {
    /// Guest read of `data.len()` bytes at `offset`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Guest write of `data` at `offset`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors from building a bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// The new range overlaps one already inserted.
    #[error("bus range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap {
        /// Start of the rejected range.
        base: u64,
        /// Its length.
        len: u64,
    },
    /// A zero-length range.
    #[error("bus range at {0:#x} has zero length")]
    Empty(u64),
}

#[derive(Clone)]
struct BusRange {
    base: u64,
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// An address space of non-overlapping device ranges.
#[derive(Clone, Default)]
pub struct Bus {
    ranges: Vec<BusRange>,
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts `device` at `[base, base + len)`.
    pub fn insert(
        &mut self,
        device: Arc<Mutex<dyn BusDevice>>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let end = base
            .checked_add(len)
            .ok_or(BusError::Overlap { base, len })?;
        if self
            .ranges
            .iter()
            .any(|r| base < r.base + r.len && r.base < end)
        {
            return Err(BusError::Overlap { base, len });
        }
        self.ranges.push(BusRange { base, len, device });
        self.ranges.sort_by_key(|r| r.base);
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(&BusRange, u64)> {
        let idx = self.ranges.partition_point(|r| r.base <= addr);
        let range = self.ranges.get(idx.checked_sub(1)?)?;
        let offset = addr - range.base;
        (offset < range.len).then_some((range, offset))
    }

    /// Dispatches a guest read. Returns false when no device claims `addr`
    /// (the caller then reads as all-ones, like an empty bus).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((range, offset)) => {
                let mut device = range.device.lock().unwrap_or_else(|p| p.into_inner());
                device.read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a guest write. Returns false when no device claims `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((range, offset)) => {
                let mut device = range.device.lock().unwrap_or_else(|p| p.into_inner());
                device.write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        last_write: Option<(u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last_write = Some((offset, data.to_vec()));
        }
    }

    #[test]
    fn test_bus_routes_by_offset() {
        let mut bus = Bus::new();
        let dev = Arc::new(Mutex::new(Recorder::default()));
        bus.insert(dev.clone(), 0x100, 0x10).expect("insert");
        let mut data = [0u8; 1];
        assert!(bus.read(0x105, &mut data));
        assert_eq!(data[0], 5);
        assert!(bus.write(0x10f, &[7]));
        assert_eq!(dev.lock().expect("lock").last_write, Some((0xf, vec![7])));
    }

    #[test]
    fn test_bus_unclaimed_address_returns_false() {
        let mut bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Recorder::default())), 0x100, 0x10)
            .expect("insert");
        assert!(!bus.read(0x110, &mut [0u8; 1]));
        assert!(!bus.write(0xff, &[0]));
    }

    #[test]
    fn test_bus_overlap_is_rejected() {
        let mut bus = Bus::new();
        let dev = Arc::new(Mutex::new(Recorder::default()));
        bus.insert(dev.clone(), 0x100, 0x10).expect("insert");
        assert_eq!(
            bus.insert(dev.clone(), 0x10f, 1),
            Err(BusError::Overlap {
                base: 0x10f,
                len: 1
            })
        );
        assert_eq!(bus.insert(dev, 0x200, 0), Err(BusError::Empty(0x200)));
    }
}
