//! The virtio-mmio transport, version 2 (virtio spec 4.2.2).
//!
//! [`MmioTransport`] is the register file one virtio device shows the guest
//! in its MMIO window. It runs feature negotiation, queue setup and the
//! device-status state machine, and activates the device when the driver
//! sets DRIVER_OK. The device logic itself lives behind [`VirtioDevice`].
//!
//! Every register access comes from the guest and is treated as hostile: a
//! malformed access (wrong width, unknown offset, write to a read-only
//! register, queue setup at the wrong time or for a queue that does not
//! exist) is ignored, and such reads return zero.

use std::sync::{Arc, Once};

use serde::{Deserialize, Serialize};
use virtio_queue::QueueT;

use super::{
    IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_CONFIG, VIRTIO_RING_F_EVENT_IDX,
};
use crate::devices::bus::BusDevice;
use crate::snapshot::Persist;
use crate::vstate::memory::GuestMemoryMmap;

/// MagicValue register contents: "virt" in little endian.
pub const MMIO_MAGIC_VALUE: u32 = 0x7472_6976;
/// The transport version implemented (the non-legacy interface).
pub const MMIO_VERSION: u32 = 2;
/// VendorID register contents (no registered vendor).
pub const MMIO_VENDOR_ID: u32 = 0;
/// Size of one device's MMIO window.
pub const MMIO_WINDOW_SIZE: u64 = 0x1000;
/// Offset of the QueueNotify register, where the VMM registers ioeventfds.
pub const MMIO_QUEUE_NOTIFY_OFFSET: u64 = 0x50;

/// Register offsets inside the MMIO window (virtio spec 4.2.2).
pub mod regs {
    /// R: magic value.
    pub const MAGIC_VALUE: u64 = 0x000;
    /// R: transport version.
    pub const VERSION: u64 = 0x004;
    /// R: virtio device ID.
    pub const DEVICE_ID: u64 = 0x008;
    /// R: vendor ID.
    pub const VENDOR_ID: u64 = 0x00c;
    /// R: 32 bits of the offered features, selected by DEVICE_FEATURES_SEL.
    pub const DEVICE_FEATURES: u64 = 0x010;
    /// W: selects the half of the offered features.
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    /// W: 32 bits of the accepted features, selected by DRIVER_FEATURES_SEL.
    pub const DRIVER_FEATURES: u64 = 0x020;
    /// W: selects the half of the accepted features.
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    /// W: selects the queue the queue registers refer to.
    pub const QUEUE_SEL: u64 = 0x030;
    /// R: maximum size of the selected queue (0: no such queue).
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    /// W: size of the selected queue.
    pub const QUEUE_NUM: u64 = 0x038;
    /// RW: the selected queue is ready.
    pub const QUEUE_READY: u64 = 0x044;
    /// W: the driver notifies a queue (value: queue index).
    pub const QUEUE_NOTIFY: u64 = 0x050;
    /// R: pending interrupt causes.
    pub const INTERRUPT_STATUS: u64 = 0x060;
    /// W: acknowledges interrupt causes.
    pub const INTERRUPT_ACK: u64 = 0x064;
    /// RW: device status.
    pub const STATUS: u64 = 0x070;
    /// W: descriptor table address, low 32 bits.
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    /// W: descriptor table address, high 32 bits.
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    /// W: available (driver) ring address, low 32 bits.
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    /// W: available (driver) ring address, high 32 bits.
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    /// W: used (device) ring address, low 32 bits.
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    /// W: used (device) ring address, high 32 bits.
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    /// W: selects a shared memory region.
    pub const SHM_SEL: u64 = 0x0ac;
    /// R: length of the selected shared memory region, low 32 bits.
    pub const SHM_LEN_LOW: u64 = 0x0b0;
    /// R: length of the selected shared memory region, high 32 bits.
    pub const SHM_LEN_HIGH: u64 = 0x0b4;
    /// R: base of the selected shared memory region, low 32 bits.
    pub const SHM_BASE_LOW: u64 = 0x0b8;
    /// R: base of the selected shared memory region, high 32 bits.
    pub const SHM_BASE_HIGH: u64 = 0x0bc;
    /// R: configuration atomicity value.
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    /// RW: start of the device-specific configuration space.
    pub const CONFIG: u64 = 0x100;
}

/// Device status bits (virtio spec 2.1).
pub mod device_status {
    /// The guest found the device.
    pub const ACKNOWLEDGE: u32 = 0x01;
    /// The guest knows how to drive the device.
    pub const DRIVER: u32 = 0x02;
    /// The driver is set up and ready to drive the device.
    pub const DRIVER_OK: u32 = 0x04;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u32 = 0x08;
    /// The device hit an error it cannot recover from without a reset.
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    /// The guest gave up on the device.
    pub const FAILED: u32 = 0x80;
}

use device_status::*;

/// The virtio-mmio register file of one device.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    interrupt: Arc<IrqTrigger>,
    features_select: u32,
    acked_features_select: u32,
    queue_select: u32,
    device_status: u32,
    config_generation: u32,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device.device_type())
            .field("features_select", &self.features_select)
            .field("acked_features_select", &self.acked_features_select)
            .field("queue_select", &self.queue_select)
            .field("device_status", &self.device_status)
            .field("config_generation", &self.config_generation)
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// Wraps `device`, with a fresh interrupt line and the device reset.
    pub fn new(mem: GuestMemoryMmap, device: Box<dyn VirtioDevice>) -> std::io::Result<Self> {
        Ok(Self {
            device,
            mem,
            interrupt: Arc::new(IrqTrigger::new()?),
            features_select: 0,
            acked_features_select: 0,
            queue_select: 0,
            device_status: 0,
            config_generation: 0,
        })
    }

    /// The device's interrupt line (its eventfd is registered with KVM as an
    /// irqfd).
    pub fn interrupt(&self) -> Arc<IrqTrigger> {
        self.interrupt.clone()
    }

    /// The device behind this transport.
    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    /// The device behind this transport, mutably (event loop).
    pub fn device_mut(&mut self) -> &mut dyn VirtioDevice {
        self.device.as_mut()
    }

    /// True once the driver set DRIVER_OK and the device activated.
    pub fn is_activated(&self) -> bool {
        self.device.common().is_activated()
    }

    /// The Status register.
    pub fn device_status(&self) -> u32 {
        self.device_status
    }

    /// Tells the driver the configuration space changed: bumps
    /// ConfigGeneration and raises the configuration interrupt.
    pub fn notify_config_change(&mut self) -> std::io::Result<()> {
        self.config_generation = self.config_generation.wrapping_add(1);
        self.interrupt.trigger(VIRTIO_MMIO_INT_CONFIG)
    }

    /// True when every bit of `set` and no bit of `clear` is in Status.
    fn status_is(&self, set: u32, clear: u32) -> bool {
        self.device_status & set == set && self.device_status & clear == 0
    }

    /// Queue registers may change between FEATURES_OK and DRIVER_OK only.
    fn queue_config_allowed(&self) -> bool {
        self.status_is(FEATURES_OK, DRIVER_OK | FAILED | DEVICE_NEEDS_RESET)
    }

    fn selected_queue(&self) -> Option<&virtio_queue::Queue> {
        self.device
            .common()
            .queues
            .get(usize::try_from(self.queue_select).ok()?)
    }

    /// Applies `f` to the selected queue if queue configuration is allowed.
    fn update_queue(&mut self, f: impl FnOnce(&mut virtio_queue::Queue)) {
        if !self.queue_config_allowed() {
            return;
        }
        let Ok(index) = usize::try_from(self.queue_select) else {
            return;
        };
        if let Some(queue) = self.device.common_mut().queues.get_mut(index) {
            f(queue);
        }
    }

    /// Device and transport back to their power-on state. The interrupt
    /// line stays the same (KVM holds its eventfd).
    fn reset(&mut self) {
        self.device.reset();
        self.features_select = 0;
        self.acked_features_select = 0;
        self.queue_select = 0;
        self.device_status = 0;
        self.interrupt.set_status(0);
    }

    /// FEATURES_OK is accepted only for a subset of the offered features that
    /// includes VIRTIO_F_VERSION_1.
    fn features_acceptable(&self) -> bool {
        let common = self.device.common();
        common.acked_features & !common.avail_features == 0
            && common.acked_features & VIRTIO_F_VERSION_1 != 0
    }

    fn activate(&mut self) {
        let event_idx = self.device.common().acked_features & VIRTIO_RING_F_EVENT_IDX != 0;
        for queue in &mut self.device.common_mut().queues {
            queue.set_event_idx(event_idx);
        }
        if self
            .device
            .activate(self.mem.clone(), self.interrupt.clone())
            .is_err()
        {
            // Virtio spec 2.1.2: set DEVICE_NEEDS_RESET and, the driver
            // being past DRIVER_OK, tell it through a config interrupt.
            self.device_status |= DEVICE_NEEDS_RESET;
            if let Err(e) = self.interrupt.trigger(VIRTIO_MMIO_INT_CONFIG) {
                // The driver can activate a broken device over and over:
                // said once.
                static SAID: Once = Once::new();
                SAID.call_once(|| {
                    eprintln!("tine-vmm: cannot tell the guest a device needs a reset: {e} (not said again)");
                });
            }
        }
    }

    /// A driver write to the Status register. The driver only ever adds
    /// one bit at a time, in order, or writes 0 to reset; anything else is
    /// ignored.
    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        let old = self.device_status;
        if value & old != old {
            // Clearing bits is only possible through a reset.
            return;
        }
        let added = value & !old;
        match added {
            0 => {}
            FAILED => self.device_status |= FAILED,
            ACKNOWLEDGE if old == 0 => self.device_status = value,
            DRIVER if old == ACKNOWLEDGE => self.device_status = value,
            FEATURES_OK if old == ACKNOWLEDGE | DRIVER && self.features_acceptable() => {
                self.device_status = value;
            }
            DRIVER_OK if old == ACKNOWLEDGE | DRIVER | FEATURES_OK => {
                self.device_status = value;
                self.activate();
            }
            _ => {}
        }
    }

    fn write_driver_features(&mut self, value: u32) {
        if !self.status_is(DRIVER, FEATURES_OK | FAILED | DEVICE_NEEDS_RESET) {
            return;
        }
        let common = self.device.common_mut();
        let value = u64::from(value);
        match self.acked_features_select {
            0 => common.acked_features = (common.acked_features & !0xffff_ffff) | value,
            1 => common.acked_features = (common.acked_features & 0xffff_ffff) | (value << 32),
            _ => {}
        }
    }

    fn notify_queue(&mut self, value: u32) {
        let Ok(index) = usize::try_from(value) else {
            return;
        };
        if index < self.device.common().queues.len() && self.is_activated() {
            self.device.process_queue(index);
        }
    }

    fn read_register(&self, offset: u64) -> u32 {
        match offset {
            regs::MAGIC_VALUE => MMIO_MAGIC_VALUE,
            regs::VERSION => MMIO_VERSION,
            regs::DEVICE_ID => self.device.device_type(),
            regs::VENDOR_ID => MMIO_VENDOR_ID,
            regs::DEVICE_FEATURES => {
                let features = self.device.common().avail_features;
                match self.features_select {
                    0 => features as u32,
                    1 => (features >> 32) as u32,
                    _ => 0,
                }
            }
            regs::QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            regs::QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            regs::INTERRUPT_STATUS => self.interrupt.status(),
            regs::STATUS => self.device_status,
            // No shared memory regions: their length reads as all-ones.
            regs::SHM_LEN_LOW | regs::SHM_LEN_HIGH | regs::SHM_BASE_LOW | regs::SHM_BASE_HIGH => {
                u32::MAX
            }
            regs::CONFIG_GENERATION => self.config_generation,
            _ => 0,
        }
    }

    fn write_register(&mut self, offset: u64, value: u32) {
        match offset {
            regs::DEVICE_FEATURES_SEL => self.features_select = value,
            regs::DRIVER_FEATURES => self.write_driver_features(value),
            regs::DRIVER_FEATURES_SEL => self.acked_features_select = value,
            regs::QUEUE_SEL => self.queue_select = value,
            regs::QUEUE_NUM => self.update_queue(|q| {
                if let Ok(size) = u16::try_from(value) {
                    q.set_size(size);
                }
            }),
            regs::QUEUE_READY => self.update_queue(|q| match value {
                0 => q.set_ready(false),
                1 => q.set_ready(true),
                _ => {}
            }),
            regs::QUEUE_NOTIFY => self.notify_queue(value),
            regs::INTERRUPT_ACK => self.interrupt.ack(value),
            regs::STATUS => self.write_status(value),
            regs::QUEUE_DESC_LOW => {
                self.update_queue(|q| q.set_desc_table_address(Some(value), None))
            }
            regs::QUEUE_DESC_HIGH => {
                self.update_queue(|q| q.set_desc_table_address(None, Some(value)))
            }
            regs::QUEUE_DRIVER_LOW => {
                self.update_queue(|q| q.set_avail_ring_address(Some(value), None))
            }
            regs::QUEUE_DRIVER_HIGH => {
                self.update_queue(|q| q.set_avail_ring_address(None, Some(value)))
            }
            regs::QUEUE_DEVICE_LOW => {
                self.update_queue(|q| q.set_used_ring_address(Some(value), None))
            }
            regs::QUEUE_DEVICE_HIGH => {
                self.update_queue(|q| q.set_used_ring_address(None, Some(value)))
            }
            // SHMSel selects among no regions; read-only and unknown
            // registers ignore writes.
            _ => {}
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset >= regs::CONFIG {
            if offset < MMIO_WINDOW_SIZE {
                self.device.read_config(offset - regs::CONFIG, data);
            }
            return;
        }
        if data.len() != 4 {
            return;
        }
        data.copy_from_slice(&self.read_register(offset).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= regs::CONFIG {
            // A driver that gave up on the device no longer configures it.
            if offset < MMIO_WINDOW_SIZE && self.status_is(0, FAILED) {
                self.device.write_config(offset - regs::CONFIG, data);
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return;
        };
        self.write_register(offset, u32::from_le_bytes(bytes));
    }
}

/// Snapshot state of [`MmioTransport`]: its registers. The device's own
/// state is saved separately through [`VirtioDevice::save`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioTransportState {
    /// DeviceFeaturesSel.
    pub features_select: u32,
    /// DriverFeaturesSel.
    pub acked_features_select: u32,
    /// QueueSel.
    pub queue_select: u32,
    /// Status.
    pub device_status: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// InterruptStatus.
    pub interrupt_status: u32,
}

/// Host resources to rebuild an [`MmioTransport`] from its state.
pub struct MmioTransportConstructorArgs {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The device, already restored (and re-activated if it was active).
    pub device: Box<dyn VirtioDevice>,
}

/// Why an [`MmioTransport`] could not be restored.
#[derive(Debug, thiserror::Error)]
pub enum MmioTransportPersistError {
    /// The interrupt eventfd could not be created.
    #[error("cannot create the interrupt line")]
    Interrupt(#[source] std::io::Error),
    /// The saved Status and the restored device disagree on activation.
    #[error("device status {status:#x} does not match device activation ({activated})")]
    ActivationMismatch {
        /// The saved Status register.
        status: u32,
        /// Whether the restored device is active.
        activated: bool,
    },
}

impl Persist for MmioTransport {
    type State = MmioTransportState;
    type ConstructorArgs = MmioTransportConstructorArgs;
    type Error = MmioTransportPersistError;

    fn save(&self) -> Self::State {
        MmioTransportState {
            features_select: self.features_select,
            acked_features_select: self.acked_features_select,
            queue_select: self.queue_select,
            device_status: self.device_status,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
        }
    }

    /// Restores the registers and InterruptStatus. An activated device
    /// already holds its interrupt line, which the transport then shares;
    /// otherwise the transport creates a new one. Nothing is activated here.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error> {
        let activated = args.device.common().is_activated();
        let expect_active = state.device_status & (DRIVER_OK | DEVICE_NEEDS_RESET) == DRIVER_OK;
        if activated != expect_active {
            return Err(MmioTransportPersistError::ActivationMismatch {
                status: state.device_status,
                activated,
            });
        }
        let interrupt = match &args.device.common().interrupt {
            Some(interrupt) => interrupt.clone(),
            None => Arc::new(IrqTrigger::new().map_err(MmioTransportPersistError::Interrupt)?),
        };
        interrupt.set_status(state.interrupt_status);
        Ok(Self {
            device: args.device,
            mem: args.mem,
            interrupt,
            features_select: state.features_select,
            acked_features_select: state.acked_features_select,
            queue_select: state.queue_select,
            device_status: state.device_status,
            config_generation: state.config_generation,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestAddress;

    use super::*;
    use crate::devices::virtio::persist::{VirtioCommonState, VirtioDeviceState};
    use crate::devices::virtio::test_utils::test_memory;
    use crate::devices::virtio::{ActivateError, VirtioCommon, VIRTIO_MMIO_INT_VRING};

    const TEST_DEVICE_TYPE: u32 = 42;
    const TEST_FEATURE: u64 = 1 << 5;
    const TEST_QUEUE_MAX: u16 = 256;
    const MOCK_QUEUE_SIZE: u16 = 16;

    type ConfigWrites = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

    /// What the test device saw, shared with the test.
    #[derive(Default, Clone)]
    struct Probe {
        processed: Arc<Mutex<Vec<usize>>>,
        resets: Arc<AtomicUsize>,
        config_writes: ConfigWrites,
    }

    impl Probe {
        fn processed(&self) -> Vec<usize> {
            self.processed.lock().expect("lock").clone()
        }
        fn config_writes(&self) -> Vec<(u64, Vec<u8>)> {
            self.config_writes.lock().expect("lock").clone()
        }
    }

    struct TestDevice {
        common: VirtioCommon,
        config: [u8; 8],
        fail_activate: bool,
        probe: Probe,
    }

    impl TestDevice {
        fn new(probe: Probe) -> Self {
            Self {
                common: VirtioCommon::new(
                    VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | TEST_FEATURE,
                    &[TEST_QUEUE_MAX, TEST_QUEUE_MAX],
                ),
                config: [1, 2, 3, 4, 5, 6, 7, 8],
                fail_activate: false,
                probe,
            }
        }
    }

    impl VirtioDevice for TestDevice {
        fn device_type(&self) -> u32 {
            TEST_DEVICE_TYPE
        }
        fn common(&self) -> &VirtioCommon {
            &self.common
        }
        fn common_mut(&mut self) -> &mut VirtioCommon {
            &mut self.common
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            for (i, byte) in data.iter_mut().enumerate() {
                *byte = usize::try_from(offset)
                    .ok()
                    .and_then(|o| o.checked_add(i))
                    .and_then(|o| self.config.get(o).copied())
                    .unwrap_or(0);
            }
        }
        fn write_config(&mut self, offset: u64, data: &[u8]) {
            self.probe
                .config_writes
                .lock()
                .expect("lock")
                .push((offset, data.to_vec()));
        }
        fn activate(
            &mut self,
            mem: GuestMemoryMmap,
            interrupt: Arc<IrqTrigger>,
        ) -> Result<(), ActivateError> {
            if self.fail_activate {
                return Err(ActivateError::Backend("test failure".into()));
            }
            self.common.activate(mem, interrupt)
        }
        fn process_queue(&mut self, index: usize) {
            self.probe.processed.lock().expect("lock").push(index);
        }
        fn reset(&mut self) {
            self.common.reset();
            self.probe.resets.fetch_add(1, Ordering::SeqCst);
        }
        fn save(&self) -> VirtioDeviceState {
            VirtioDeviceState::Test
        }
    }

    fn transport_with(device: TestDevice) -> MmioTransport {
        MmioTransport::new(test_memory(), Box::new(device)).expect("transport")
    }

    fn transport() -> (MmioTransport, Probe) {
        let probe = Probe::default();
        (transport_with(TestDevice::new(probe.clone())), probe)
    }

    fn read32(t: &mut MmioTransport, offset: u64) -> u32 {
        let mut data = [0xffu8; 4];
        t.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn write32(t: &mut MmioTransport, offset: u64, value: u32) {
        t.write(offset, &value.to_le_bytes());
    }

    /// Adds `bit` to Status the way Linux's `virtio_add_status` does.
    fn add_status(t: &mut MmioTransport, bit: u32) {
        let status = read32(t, regs::STATUS);
        write32(t, regs::STATUS, status | bit);
    }

    /// Linux `vm_get_features`: high half first, then low half.
    fn read_device_features(t: &mut MmioTransport) -> u64 {
        write32(t, regs::DEVICE_FEATURES_SEL, 1);
        let high = u64::from(read32(t, regs::DEVICE_FEATURES));
        write32(t, regs::DEVICE_FEATURES_SEL, 0);
        (high << 32) | u64::from(read32(t, regs::DEVICE_FEATURES))
    }

    /// Linux `vm_finalize_features`.
    fn write_driver_features(t: &mut MmioTransport, features: u64) {
        write32(t, regs::DRIVER_FEATURES_SEL, 1);
        write32(t, regs::DRIVER_FEATURES, (features >> 32) as u32);
        write32(t, regs::DRIVER_FEATURES_SEL, 0);
        write32(t, regs::DRIVER_FEATURES, features as u32);
    }

    /// Reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK.
    fn negotiate(t: &mut MmioTransport, features: u64) {
        write32(t, regs::STATUS, 0);
        add_status(t, ACKNOWLEDGE);
        add_status(t, DRIVER);
        write_driver_features(t, features);
        add_status(t, FEATURES_OK);
    }

    /// Linux `vm_setup_vq` for queue `index`.
    fn setup_queue(t: &mut MmioTransport, index: u32, mock: &MockSplitQueue<'_, GuestMemoryMmap>) {
        write32(t, regs::QUEUE_SEL, index);
        assert_eq!(read32(t, regs::QUEUE_READY), 0);
        assert_eq!(read32(t, regs::QUEUE_NUM_MAX), u32::from(TEST_QUEUE_MAX));
        write32(t, regs::QUEUE_NUM, u32::from(MOCK_QUEUE_SIZE));
        let desc = mock.desc_table_addr().0;
        let avail = mock.avail_addr().0;
        let used = mock.used_addr().0;
        write32(t, regs::QUEUE_DESC_LOW, desc as u32);
        write32(t, regs::QUEUE_DESC_HIGH, (desc >> 32) as u32);
        write32(t, regs::QUEUE_DRIVER_LOW, avail as u32);
        write32(t, regs::QUEUE_DRIVER_HIGH, (avail >> 32) as u32);
        write32(t, regs::QUEUE_DEVICE_LOW, used as u32);
        write32(t, regs::QUEUE_DEVICE_HIGH, (used >> 32) as u32);
        write32(t, regs::QUEUE_READY, 1);
    }

    /// Drives a transport all the way to an activated device with both
    /// queues set up.
    fn activate(t: &mut MmioTransport, features: u64) {
        let mem = test_memory();
        let mock0 = MockSplitQueue::create(&mem, GuestAddress(0x1_0000), MOCK_QUEUE_SIZE);
        let mock1 = MockSplitQueue::create(&mem, GuestAddress(0x2_0000), MOCK_QUEUE_SIZE);
        negotiate(t, features);
        setup_queue(t, 0, &mock0);
        setup_queue(t, 1, &mock1);
        add_status(t, DRIVER_OK);
    }

    #[test]
    fn test_mmio_linux_probe_sequence_activates_and_notifies() {
        let probe = Probe::default();
        let mut device = TestDevice::new(probe.clone());
        device.common.queues.truncate(1);
        let mut t = transport_with(device);
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, GuestAddress(0x1_0000), MOCK_QUEUE_SIZE);

        // virtio_mmio_probe.
        assert_eq!(read32(&mut t, regs::MAGIC_VALUE), MMIO_MAGIC_VALUE);
        assert_eq!(read32(&mut t, regs::VERSION), 2);
        assert_eq!(read32(&mut t, regs::DEVICE_ID), TEST_DEVICE_TYPE);
        assert_eq!(read32(&mut t, regs::VENDOR_ID), MMIO_VENDOR_ID);
        // register_virtio_device: reset, then ACKNOWLEDGE.
        write32(&mut t, regs::STATUS, 0);
        assert_eq!(read32(&mut t, regs::STATUS), 0);
        add_status(&mut t, ACKNOWLEDGE);
        assert_eq!(read32(&mut t, regs::STATUS), ACKNOWLEDGE);
        // virtio_dev_probe.
        add_status(&mut t, DRIVER);
        let offered = read_device_features(&mut t);
        assert_eq!(
            offered,
            VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | TEST_FEATURE
        );
        write_driver_features(&mut t, VIRTIO_F_VERSION_1 | TEST_FEATURE);
        add_status(&mut t, FEATURES_OK);
        assert_eq!(
            read32(&mut t, regs::STATUS),
            ACKNOWLEDGE | DRIVER | FEATURES_OK
        );
        assert_eq!(
            t.device().common().acked_features,
            VIRTIO_F_VERSION_1 | TEST_FEATURE
        );
        // find_vqs.
        setup_queue(&mut t, 0, &mock);
        assert_eq!(read32(&mut t, regs::QUEUE_READY), 1);
        // virtio_device_ready.
        add_status(&mut t, DRIVER_OK);
        assert_eq!(
            read32(&mut t, regs::STATUS),
            ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK
        );
        assert!(t.is_activated());
        let queue = &t.device().common().queues[0];
        assert_eq!(queue.size(), MOCK_QUEUE_SIZE);
        assert_eq!(queue.desc_table(), mock.desc_table_addr().0);
        assert_eq!(queue.avail_ring(), mock.avail_addr().0);
        assert_eq!(queue.used_ring(), mock.used_addr().0);
        assert!(!queue.event_idx_enabled());
        // vm_notify.
        write32(&mut t, regs::QUEUE_NOTIFY, 0);
        assert_eq!(probe.processed(), vec![0]);
    }

    #[test]
    fn test_mmio_interrupt_ack_clears_acknowledged_bits() {
        let (mut t, _) = transport();
        t.interrupt()
            .trigger(VIRTIO_MMIO_INT_VRING | VIRTIO_MMIO_INT_CONFIG)
            .expect("trigger");
        assert_eq!(read32(&mut t, regs::INTERRUPT_STATUS), 3);
        write32(&mut t, regs::INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);
        assert_eq!(
            read32(&mut t, regs::INTERRUPT_STATUS),
            VIRTIO_MMIO_INT_CONFIG
        );
    }

    #[test]
    fn test_mmio_non_4_byte_register_read_returns_zero() {
        let (mut t, _) = transport();
        let mut one = [0xffu8; 1];
        let mut two = [0xffu8; 2];
        let mut eight = [0xffu8; 8];
        t.read(regs::MAGIC_VALUE, &mut one);
        t.read(regs::MAGIC_VALUE, &mut two);
        t.read(regs::MAGIC_VALUE, &mut eight);
        assert_eq!((one, two, eight), ([0; 1], [0; 2], [0; 8]));
    }

    #[test]
    fn test_mmio_non_4_byte_register_write_ignored() {
        let (mut t, _) = transport();
        t.write(regs::STATUS, &[ACKNOWLEDGE as u8]);
        t.write(regs::STATUS, &[ACKNOWLEDGE as u8, 0]);
        t.write(regs::STATUS, &u64::from(ACKNOWLEDGE).to_le_bytes());
        t.write(regs::STATUS, &[]);
        assert_eq!(read32(&mut t, regs::STATUS), 0);
    }

    #[test]
    fn test_mmio_unknown_offset_reads_zero_and_ignores_writes() {
        let (mut t, _) = transport();
        let before = t.save();
        for offset in [
            0x018, 0x028, 0x03c, 0x040, 0x048, 0x054, 0x0c0, 0x0f8, 0x002,
        ] {
            write32(&mut t, offset, 0xffff_ffff);
            assert_eq!(read32(&mut t, offset), 0, "offset {offset:#x}");
        }
        assert_eq!(t.save(), before);
    }

    #[test]
    fn test_mmio_read_only_register_write_ignored() {
        let (mut t, _) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        for offset in [
            regs::MAGIC_VALUE,
            regs::VERSION,
            regs::DEVICE_ID,
            regs::VENDOR_ID,
            regs::DEVICE_FEATURES,
            regs::QUEUE_NUM_MAX,
            regs::INTERRUPT_STATUS,
            regs::CONFIG_GENERATION,
        ] {
            write32(&mut t, offset, 0x1234_5678);
        }
        assert_eq!(read32(&mut t, regs::MAGIC_VALUE), MMIO_MAGIC_VALUE);
        assert_eq!(read32(&mut t, regs::VERSION), MMIO_VERSION);
        assert_eq!(read32(&mut t, regs::DEVICE_ID), TEST_DEVICE_TYPE);
        assert_eq!(
            read32(&mut t, regs::QUEUE_NUM_MAX),
            u32::from(TEST_QUEUE_MAX)
        );
        assert_eq!(read32(&mut t, regs::INTERRUPT_STATUS), 0);
        assert_eq!(read32(&mut t, regs::CONFIG_GENERATION), 0);
        assert_eq!(
            read_device_features(&mut t),
            VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | TEST_FEATURE
        );
    }

    #[test]
    fn test_mmio_write_only_queue_registers_read_zero() {
        let (mut t, _) = transport();
        activate(&mut t, VIRTIO_F_VERSION_1);
        for offset in [
            regs::QUEUE_NUM,
            regs::QUEUE_DESC_LOW,
            regs::QUEUE_DRIVER_LOW,
            regs::QUEUE_DEVICE_LOW,
            regs::QUEUE_NOTIFY,
            regs::INTERRUPT_ACK,
            regs::DRIVER_FEATURES,
        ] {
            assert_eq!(read32(&mut t, offset), 0, "offset {offset:#x}");
        }
    }

    #[test]
    fn test_mmio_queue_sel_out_of_range_reads_zero_and_ignores_config() {
        let (mut t, _) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        for sel in [2, 0xffff, u32::MAX] {
            write32(&mut t, regs::QUEUE_SEL, sel);
            assert_eq!(read32(&mut t, regs::QUEUE_NUM_MAX), 0);
            write32(&mut t, regs::QUEUE_NUM, 16);
            write32(&mut t, regs::QUEUE_DESC_LOW, 0x1000);
            write32(&mut t, regs::QUEUE_READY, 1);
            assert_eq!(read32(&mut t, regs::QUEUE_READY), 0);
        }
        let queues = &t.device().common().queues;
        assert!(queues
            .iter()
            .all(|q| !q.ready() && q.size() == TEST_QUEUE_MAX));
    }

    #[test]
    fn test_mmio_queue_config_after_driver_ok_ignored() {
        let (mut t, _) = transport();
        activate(&mut t, VIRTIO_F_VERSION_1);
        let before = t.device().common().queues[0].state();
        write32(&mut t, regs::QUEUE_SEL, 0);
        write32(&mut t, regs::QUEUE_NUM, 32);
        write32(&mut t, regs::QUEUE_DESC_LOW, 0x8000);
        write32(&mut t, regs::QUEUE_DRIVER_HIGH, 1);
        write32(&mut t, regs::QUEUE_DEVICE_LOW, 0x9000);
        write32(&mut t, regs::QUEUE_READY, 0);
        assert_eq!(t.device().common().queues[0].state(), before);
    }

    #[test]
    fn test_mmio_queue_config_before_features_ok_ignored() {
        let (mut t, _) = transport();
        add_status(&mut t, ACKNOWLEDGE);
        add_status(&mut t, DRIVER);
        write32(&mut t, regs::QUEUE_SEL, 0);
        write32(&mut t, regs::QUEUE_NUM, 16);
        write32(&mut t, regs::QUEUE_READY, 1);
        let queue = &t.device().common().queues[0];
        assert_eq!((queue.size(), queue.ready()), (TEST_QUEUE_MAX, false));
    }

    #[test]
    fn test_mmio_queue_num_invalid_size_ignored() {
        let (mut t, _) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        write32(&mut t, regs::QUEUE_SEL, 0);
        for size in [0, 3, 100, 512, 0x1_0010] {
            write32(&mut t, regs::QUEUE_NUM, size);
        }
        assert_eq!(t.device().common().queues[0].size(), TEST_QUEUE_MAX);
    }

    #[test]
    fn test_mmio_queue_ready_value_other_than_0_or_1_ignored() {
        let (mut t, _) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        write32(&mut t, regs::QUEUE_SEL, 0);
        write32(&mut t, regs::QUEUE_READY, 2);
        assert_eq!(read32(&mut t, regs::QUEUE_READY), 0);
    }

    #[test]
    fn test_mmio_features_ok_unoffered_feature_refused() {
        let (mut t, _) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1 | (1 << 7));
        assert_eq!(read32(&mut t, regs::STATUS), ACKNOWLEDGE | DRIVER);
        // Linux then gives up.
        add_status(&mut t, FAILED);
        assert_eq!(read32(&mut t, regs::STATUS), ACKNOWLEDGE | DRIVER | FAILED);
    }

    #[test]
    fn test_mmio_features_ok_without_version_1_refused() {
        let (mut t, _) = transport();
        negotiate(&mut t, TEST_FEATURE);
        assert_eq!(read32(&mut t, regs::STATUS), ACKNOWLEDGE | DRIVER);
    }

    #[test]
    fn test_mmio_driver_features_after_features_ok_ignored() {
        let (mut t, _) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        write_driver_features(&mut t, VIRTIO_F_VERSION_1 | TEST_FEATURE);
        assert_eq!(t.device().common().acked_features, VIRTIO_F_VERSION_1);
    }

    #[test]
    fn test_mmio_driver_features_before_driver_ignored() {
        let (mut t, _) = transport();
        add_status(&mut t, ACKNOWLEDGE);
        write_driver_features(&mut t, VIRTIO_F_VERSION_1);
        assert_eq!(t.device().common().acked_features, 0);
    }

    #[test]
    fn test_mmio_features_select_out_of_range_reads_zero() {
        let (mut t, _) = transport();
        add_status(&mut t, ACKNOWLEDGE);
        add_status(&mut t, DRIVER);
        write32(&mut t, regs::DEVICE_FEATURES_SEL, 2);
        assert_eq!(read32(&mut t, regs::DEVICE_FEATURES), 0);
        write32(&mut t, regs::DRIVER_FEATURES_SEL, 2);
        write32(&mut t, regs::DRIVER_FEATURES, u32::MAX);
        assert_eq!(t.device().common().acked_features, 0);
    }

    #[test]
    fn test_mmio_status_skipping_steps_ignored() {
        let (mut t, _) = transport();
        write32(
            &mut t,
            regs::STATUS,
            ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK,
        );
        assert_eq!(read32(&mut t, regs::STATUS), 0);
        add_status(&mut t, ACKNOWLEDGE);
        add_status(&mut t, FEATURES_OK);
        add_status(&mut t, DRIVER_OK);
        write32(&mut t, regs::STATUS, ACKNOWLEDGE | DEVICE_NEEDS_RESET);
        assert_eq!(read32(&mut t, regs::STATUS), ACKNOWLEDGE);
        assert!(!t.is_activated());
    }

    #[test]
    fn test_mmio_status_clearing_bits_ignored() {
        let (mut t, _) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        write32(&mut t, regs::STATUS, ACKNOWLEDGE);
        assert_eq!(
            read32(&mut t, regs::STATUS),
            ACKNOWLEDGE | DRIVER | FEATURES_OK
        );
    }

    #[test]
    fn test_mmio_status_failed_blocks_further_steps() {
        let (mut t, _) = transport();
        add_status(&mut t, ACKNOWLEDGE);
        add_status(&mut t, FAILED);
        add_status(&mut t, DRIVER);
        assert_eq!(read32(&mut t, regs::STATUS), ACKNOWLEDGE | FAILED);
    }

    #[test]
    fn test_mmio_status_zero_resets_device_and_transport() {
        let (mut t, probe) = transport();
        activate(&mut t, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX);
        write32(&mut t, regs::QUEUE_SEL, 1);
        write32(&mut t, regs::DEVICE_FEATURES_SEL, 1);
        t.interrupt()
            .trigger(VIRTIO_MMIO_INT_VRING)
            .expect("trigger");
        let interrupt = t.interrupt();

        write32(&mut t, regs::STATUS, 0);

        assert_eq!(probe.resets.load(Ordering::SeqCst), 2);
        assert!(!t.is_activated());
        assert_eq!(read32(&mut t, regs::STATUS), 0);
        assert_eq!(read32(&mut t, regs::INTERRUPT_STATUS), 0);
        assert_eq!(t.device().common().acked_features, 0);
        assert!(t.device().common().queues.iter().all(|q| !q.ready()));
        let state = t.save();
        assert_eq!((state.queue_select, state.features_select), (0, 0));
        assert!(Arc::ptr_eq(&interrupt, &t.interrupt()));
    }

    #[test]
    fn test_mmio_activation_failure_sets_needs_reset() {
        let probe = Probe::default();
        let mut device = TestDevice::new(probe.clone());
        device.fail_activate = true;
        let mut t = transport_with(device);

        activate(&mut t, VIRTIO_F_VERSION_1);

        assert!(!t.is_activated());
        assert_eq!(
            read32(&mut t, regs::STATUS),
            ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK | DEVICE_NEEDS_RESET
        );
        assert_eq!(
            read32(&mut t, regs::INTERRUPT_STATUS),
            VIRTIO_MMIO_INT_CONFIG
        );
        write32(&mut t, regs::QUEUE_NOTIFY, 0);
        assert!(probe.processed().is_empty());
    }

    #[test]
    fn test_mmio_activation_unready_queue_sets_needs_reset() {
        let (mut t, _) = transport();
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, GuestAddress(0x1_0000), MOCK_QUEUE_SIZE);
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        setup_queue(&mut t, 0, &mock);
        // Queue 1 never made ready.
        add_status(&mut t, DRIVER_OK);
        assert!(!t.is_activated());
        assert_ne!(read32(&mut t, regs::STATUS) & DEVICE_NEEDS_RESET, 0);
    }

    #[test]
    fn test_mmio_activation_queue_outside_memory_sets_needs_reset() {
        let (mut t, _) = transport();
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, GuestAddress(0x1_0000), MOCK_QUEUE_SIZE);
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        setup_queue(&mut t, 0, &mock);
        setup_queue(&mut t, 1, &mock);
        write32(&mut t, regs::QUEUE_SEL, 1);
        write32(&mut t, regs::QUEUE_DEVICE_HIGH, 0x10);
        add_status(&mut t, DRIVER_OK);
        assert!(!t.is_activated());
        assert_ne!(read32(&mut t, regs::STATUS) & DEVICE_NEEDS_RESET, 0);
    }

    #[test]
    fn test_mmio_needs_reset_cleared_by_reset() {
        let probe = Probe::default();
        let mut device = TestDevice::new(probe);
        device.fail_activate = true;
        let mut t = transport_with(device);
        activate(&mut t, VIRTIO_F_VERSION_1);
        write32(&mut t, regs::STATUS, 0);
        assert_eq!(read32(&mut t, regs::STATUS), 0);
    }

    #[test]
    fn test_mmio_event_idx_negotiated_enables_queue_event_idx() {
        let (mut t, _) = transport();
        activate(&mut t, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX);
        assert!(t
            .device()
            .common()
            .queues
            .iter()
            .all(|q| q.event_idx_enabled()));
    }

    #[test]
    fn test_mmio_notify_before_activation_ignored() {
        let (mut t, probe) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        write32(&mut t, regs::QUEUE_NOTIFY, 0);
        assert!(probe.processed().is_empty());
    }

    #[test]
    fn test_mmio_notify_out_of_range_queue_ignored() {
        let (mut t, probe) = transport();
        activate(&mut t, VIRTIO_F_VERSION_1);
        write32(&mut t, regs::QUEUE_NOTIFY, 2);
        write32(&mut t, regs::QUEUE_NOTIFY, u32::MAX);
        write32(&mut t, regs::QUEUE_NOTIFY, 1);
        assert_eq!(probe.processed(), vec![1]);
    }

    #[test]
    fn test_mmio_config_space_read_any_width() {
        let (mut t, _) = transport();
        let mut one = [0u8; 1];
        let mut two = [0u8; 2];
        let mut eight = [0u8; 8];
        t.read(regs::CONFIG + 3, &mut one);
        t.read(regs::CONFIG + 6, &mut two);
        t.read(regs::CONFIG, &mut eight);
        assert_eq!(one, [4]);
        assert_eq!(two, [7, 8]);
        assert_eq!(eight, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(read32(&mut t, regs::CONFIG + 6), 0x0807);
        assert_eq!(read32(&mut t, regs::CONFIG + 0x100), 0);
    }

    #[test]
    fn test_mmio_config_space_past_window_reads_zero() {
        let (mut t, _) = transport();
        let mut data = [0xffu8; 4];
        t.read(MMIO_WINDOW_SIZE, &mut data);
        t.read(u64::MAX, &mut data);
        assert_eq!(data, [0; 4]);
    }

    #[test]
    fn test_mmio_config_space_write_reaches_device() {
        let (mut t, probe) = transport();
        t.write(regs::CONFIG + 2, &[9, 9]);
        t.write(MMIO_WINDOW_SIZE, &[1]);
        assert_eq!(probe.config_writes(), vec![(2, vec![9, 9])]);
    }

    #[test]
    fn test_mmio_config_space_write_after_failed_ignored() {
        let (mut t, probe) = transport();
        add_status(&mut t, ACKNOWLEDGE);
        add_status(&mut t, FAILED);
        t.write(regs::CONFIG, &[1]);
        assert!(probe.config_writes().is_empty());
    }

    #[test]
    fn test_mmio_shm_registers_report_no_region() {
        let (mut t, _) = transport();
        write32(&mut t, regs::SHM_SEL, 0);
        assert_eq!(read32(&mut t, regs::SHM_LEN_LOW), u32::MAX);
        assert_eq!(read32(&mut t, regs::SHM_LEN_HIGH), u32::MAX);
    }

    #[test]
    fn test_mmio_notify_config_change_bumps_generation_and_interrupts() {
        let (mut t, _) = transport();
        t.notify_config_change().expect("notify");
        assert_eq!(read32(&mut t, regs::CONFIG_GENERATION), 1);
        assert_eq!(
            read32(&mut t, regs::INTERRUPT_STATUS),
            VIRTIO_MMIO_INT_CONFIG
        );
        assert_eq!(t.interrupt().event().read().expect("eventfd"), 1);
    }

    /// The Linux driver's writes, from reset to notify, for one queue.
    fn linux_script(mock: &MockSplitQueue<'_, GuestMemoryMmap>) -> Vec<(u64, u32)> {
        vec![
            (regs::STATUS, 0),
            (regs::STATUS, ACKNOWLEDGE),
            (regs::STATUS, ACKNOWLEDGE | DRIVER),
            (regs::DRIVER_FEATURES_SEL, 1),
            (regs::DRIVER_FEATURES, 1),
            (regs::DRIVER_FEATURES_SEL, 0),
            (regs::DRIVER_FEATURES, 0),
            (regs::STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK),
            (regs::QUEUE_SEL, 0),
            (regs::QUEUE_NUM, u32::from(MOCK_QUEUE_SIZE)),
            (regs::QUEUE_DESC_LOW, mock.desc_table_addr().0 as u32),
            (regs::QUEUE_DESC_HIGH, 0),
            (regs::QUEUE_DRIVER_LOW, mock.avail_addr().0 as u32),
            (regs::QUEUE_DRIVER_HIGH, 0),
            (regs::QUEUE_DEVICE_LOW, mock.used_addr().0 as u32),
            (regs::QUEUE_DEVICE_HIGH, 0),
            (regs::QUEUE_READY, 1),
            (regs::STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK),
            (regs::QUEUE_NOTIFY, 0),
        ]
    }

    /// The Linux driver's sequence with random register accesses (any
    /// offset, width and value) mixed in: never a panic, and the device is
    /// active exactly when Status says DRIVER_OK without
    /// DEVICE_NEEDS_RESET.
    #[test]
    fn test_mmio_random_accesses_keep_status_consistent() {
        use crate::devices::virtio::test_utils::XorShift;

        let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
        let mem = test_memory();
        let mock = MockSplitQueue::create(&mem, GuestAddress(0x1_0000), MOCK_QUEUE_SIZE);
        let script = linux_script(&mock);
        let mut device = TestDevice::new(Probe::default());
        device.common.queues.truncate(1);
        let mut t = transport_with(device);
        let (mut activated, mut refused) = (0, 0);
        for _ in 0..2000 {
            for &(offset, value) in &script {
                while rng.below(6) == 0 {
                    let offset = match rng.below(3) {
                        0 => rng.below(0x1100),
                        _ => rng.pick(&script).0,
                    };
                    let width = rng.pick(&[4usize, 4, 1, 2, 8]);
                    let mut data = rng.bits().to_le_bytes();
                    if rng.below(2) == 0 {
                        t.write(offset, &data[..width]);
                    } else {
                        t.read(offset, &mut data[..width]);
                    }
                    let status = t.device_status();
                    let expect_active = status & (DRIVER_OK | DEVICE_NEEDS_RESET) == DRIVER_OK;
                    assert_eq!(t.is_activated(), expect_active, "status {status:#x}");
                }
                write32(&mut t, offset, value);
                let status = t.device_status();
                let expect_active = status & (DRIVER_OK | DEVICE_NEEDS_RESET) == DRIVER_OK;
                assert_eq!(t.is_activated(), expect_active, "status {status:#x}");
            }
            activated += usize::from(t.is_activated());
            refused += usize::from(t.device_status() & DRIVER_OK == 0);
        }
        // Both clean runs and runs the noise derailed happened.
        assert!(activated > 0 && refused > 0, "{activated} {refused}");
    }

    /// Rebuilds a test device from the saved common state the way a real
    /// device's restore does: re-activated with a new interrupt line.
    fn restore_device(state: &VirtioCommonState, probe: Probe) -> TestDevice {
        let mut device = TestDevice::new(probe);
        device.common = state.restore().expect("common restore");
        if state.activated {
            let interrupt = Arc::new(IrqTrigger::new().expect("irq"));
            device
                .common
                .activate(test_memory(), interrupt)
                .expect("activate");
        }
        device
    }

    #[test]
    fn test_mmio_save_restore_round_trip_equal() {
        let (mut t, _) = transport();
        activate(&mut t, VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX);
        write32(&mut t, regs::QUEUE_SEL, 1);
        write32(&mut t, regs::DEVICE_FEATURES_SEL, 1);
        t.notify_config_change().expect("notify");
        t.interrupt()
            .trigger(VIRTIO_MMIO_INT_VRING)
            .expect("trigger");
        let state = t.save();
        let common = VirtioCommonState::save(t.device().common());
        let json = serde_json::to_string(&state).expect("serialize");
        let state: MmioTransportState = serde_json::from_str(&json).expect("deserialize");

        let probe = Probe::default();
        let device = restore_device(&common, probe.clone());
        let mut restored = MmioTransport::restore(
            MmioTransportConstructorArgs {
                mem: test_memory(),
                device: Box::new(device),
            },
            &state,
        )
        .expect("restore");

        assert_eq!(restored.save(), state);
        assert_eq!(VirtioCommonState::save(restored.device().common()), common);
        assert!(restored.is_activated());
        assert_eq!(read32(&mut restored, regs::INTERRUPT_STATUS), 3);
        write32(&mut restored, regs::QUEUE_NOTIFY, 1);
        assert_eq!(probe.processed(), vec![1]);
    }

    #[test]
    fn test_mmio_restore_shares_activated_device_interrupt() {
        let (mut t, _) = transport();
        activate(&mut t, VIRTIO_F_VERSION_1);
        let state = t.save();
        let common = VirtioCommonState::save(t.device().common());
        let device = restore_device(&common, Probe::default());
        let device_irq = device.common.interrupt.clone().expect("irq");

        let restored = MmioTransport::restore(
            MmioTransportConstructorArgs {
                mem: test_memory(),
                device: Box::new(device),
            },
            &state,
        )
        .expect("restore");

        assert!(Arc::ptr_eq(&device_irq, &restored.interrupt()));
    }

    #[test]
    fn test_mmio_restore_before_activation_round_trip_equal() {
        let (mut t, _) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        write32(&mut t, regs::DRIVER_FEATURES_SEL, 1);
        let state = t.save();
        let common = VirtioCommonState::save(t.device().common());
        let device = restore_device(&common, Probe::default());

        let mut restored = MmioTransport::restore(
            MmioTransportConstructorArgs {
                mem: test_memory(),
                device: Box::new(device),
            },
            &state,
        )
        .expect("restore");

        assert_eq!(restored.save(), state);
        assert!(!restored.is_activated());
        assert_eq!(
            read32(&mut restored, regs::STATUS),
            ACKNOWLEDGE | DRIVER | FEATURES_OK
        );
    }

    #[test]
    fn test_mmio_restore_activation_mismatch_fails() {
        let (mut t, _) = transport();
        activate(&mut t, VIRTIO_F_VERSION_1);
        let state = t.save();

        let result = MmioTransport::restore(
            MmioTransportConstructorArgs {
                mem: test_memory(),
                device: Box::new(TestDevice::new(Probe::default())),
            },
            &state,
        );

        assert!(matches!(
            result,
            Err(MmioTransportPersistError::ActivationMismatch {
                activated: false,
                ..
            })
        ));
    }
}
