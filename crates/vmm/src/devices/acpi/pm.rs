//! The ACPI PM1a event and control blocks (ports
//! [`ACPI_PM1_EVT_PORT`](crate::arch::x86_64::layout::ACPI_PM1_EVT_PORT)
//! to `+6`): status (2 bytes), enable (2 bytes), control (2 bytes).
//!
//! There are no fixed events: status always reads 0 and enable bits are
//! only stored. Control always reads `SCI_EN` (the VM is always in ACPI
//! mode). A write of `SLP_EN` with the sleep type of the DSDT's `\_S5_`
//! (soft-off) stops the VM as a power-off with 0; other sleep types (tine
//! VMs offer no S1-S4) are ignored.

use tine_proto::vmm::StopReason;

use crate::arch::x86_64::acpi::SLEEP_TYPE_S5;
use crate::devices::bus::BusDevice;
use crate::vstate::vcpu::StopSignal;

#[cfg(test)]
const STATUS: usize = 0;
const ENABLE: usize = 2;
const CONTROL: usize = 4;
const BLOCK_LEN: usize = 6;
/// `SCI_EN` in PM1 control: ACPI mode.
const SCI_ENABLE: u16 = 1;
/// `SLP_EN` in PM1 control.
const SLEEP_ENABLE: u16 = 1 << 13;
/// Position of `SLP_TYP` in PM1 control.
const SLEEP_TYPE_SHIFT: u16 = 10;
/// Width mask of `SLP_TYP` after shifting.
const SLEEP_TYPE_MASK: u16 = 0b111;

/// The device.
pub struct AcpiPm1 {
    stop: StopSignal,
    enable: u16,
    control: u16,
}

impl AcpiPm1 {
    /// Registers that report soft-off through `stop`.
    pub fn new(stop: StopSignal) -> Self {
        Self {
            stop,
            enable: 0,
            control: 0,
        }
    }

    fn bytes(&self) -> [u8; BLOCK_LEN] {
        let mut regs = [0u8; BLOCK_LEN];
        regs[ENABLE..ENABLE + 2].copy_from_slice(&self.enable.to_le_bytes());
        regs[CONTROL..CONTROL + 2].copy_from_slice(&(self.control | SCI_ENABLE).to_le_bytes());
        regs
    }
}

impl BusDevice for AcpiPm1 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let regs = self.bytes();
        for (i, byte) in data.iter_mut().enumerate() {
            let at = usize::try_from(offset).map_or(BLOCK_LEN, |o| o.saturating_add(i));
            *byte = regs.get(at).copied().unwrap_or(0);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut regs = self.bytes();
        let mut control_written = false;
        for (i, byte) in data.iter().enumerate() {
            let at = usize::try_from(offset).map_or(BLOCK_LEN, |o| o.saturating_add(i));
            // Status bits are write-1-to-clear and never set: nothing to do.
            if (ENABLE..BLOCK_LEN).contains(&at) {
                regs[at] = *byte;
                control_written |= at >= CONTROL;
            }
        }
        self.enable = u16::from_le_bytes([regs[ENABLE], regs[ENABLE + 1]]);
        let control = u16::from_le_bytes([regs[CONTROL], regs[CONTROL + 1]]);
        // SLP_EN is write-only: it starts the transition and reads as 0.
        self.control = control & !SLEEP_ENABLE;
        let sleep_type = (control >> SLEEP_TYPE_SHIFT) & SLEEP_TYPE_MASK;
        if control_written && control & SLEEP_ENABLE != 0 && sleep_type == u16::from(SLEEP_TYPE_S5)
        {
            self.stop.stop(StopReason::GuestPoweroff(0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> (AcpiPm1, StopSignal) {
        let stop = StopSignal::new().expect("signal");
        (AcpiPm1::new(stop.clone()), stop)
    }

    fn soft_off() -> u16 {
        (u16::from(SLEEP_TYPE_S5) << SLEEP_TYPE_SHIFT) | SLEEP_ENABLE
    }

    #[test]
    fn test_soft_off_powers_off_as_the_kernel_writes_it() {
        let (mut dev, stop) = device();
        // Linux writes the sleep type first, then the same with SLP_EN.
        let typ = u16::from(SLEEP_TYPE_S5) << SLEEP_TYPE_SHIFT;
        dev.write(CONTROL as u64, &typ.to_le_bytes());
        assert_eq!(stop.reason(), None);
        dev.write(CONTROL as u64, &soft_off().to_le_bytes());
        assert_eq!(stop.reason(), Some(StopReason::GuestPoweroff(0)));
    }

    #[test]
    fn test_soft_off_by_single_byte_writes() {
        let (mut dev, stop) = device();
        let [low, high] = soft_off().to_le_bytes();
        dev.write(CONTROL as u64, &[low]);
        assert_eq!(stop.reason(), None);
        dev.write(CONTROL as u64 + 1, &[high]);
        assert_eq!(stop.reason(), Some(StopReason::GuestPoweroff(0)));
    }

    #[test]
    fn test_other_sleep_states_status_and_enable_do_not_stop() {
        let (mut dev, stop) = device();
        let s3 = (3 << SLEEP_TYPE_SHIFT) | SLEEP_ENABLE;
        dev.write(CONTROL as u64, &s3.to_le_bytes());
        dev.write(STATUS as u64, &[0xff, 0xff]);
        dev.write(ENABLE as u64, &[0x21, 0x01]);
        dev.write(u64::MAX, &[0xff]);
        dev.write(0, &[]);
        assert_eq!(stop.reason(), None);
        let mut regs = [0xaa; BLOCK_LEN];
        dev.read(0, &mut regs);
        assert_eq!(&regs[STATUS..ENABLE], [0, 0], "no status bit is ever set");
        assert_eq!(&regs[ENABLE..CONTROL], [0x21, 0x01], "enable bits are kept");
        let control = u16::from_le_bytes([regs[CONTROL], regs[CONTROL + 1]]);
        assert_eq!(control & SCI_ENABLE, SCI_ENABLE, "always in ACPI mode");
        assert_eq!(control & SLEEP_ENABLE, 0, "SLP_EN reads as 0");
        let mut past_end = [0xaa; 2];
        dev.read(5, &mut past_end);
        assert_eq!(past_end[1], 0);
    }
}
