//! A minimal i8042 keyboard controller at 0x60-0x64: enough for the guest to
//! reset the machine (command 0xFE to port 0x64, what `reboot=k` does) and
//! for the kernel's probe to find a controller with nothing attached.

use crate::devices::bus::BusDevice;
use crate::vstate::vcpu::{StopReason, StopSignal};

/// First port.
pub const I8042_PORT: u64 = 0x60;
/// Ports covered (0x60..=0x64).
pub const I8042_LEN: u64 = 5;
const DATA_OFFSET: u64 = 0;
const COMMAND_OFFSET: u64 = 4;
const CMD_RESET_CPU: u8 = 0xfe;
const CMD_READ_CTR: u8 = 0x20;
const CMD_WRITE_CTR: u8 = 0x60;
const STATUS_OUTPUT_FULL: u8 = 0x01;

/// The controller.
pub struct I8042 {
    stop: StopSignal,
    control: u8,
    output: Option<u8>,
    expecting_ctr: bool,
}

impl I8042 {
    /// A controller that reports guest resets through `stop`.
    pub fn new(stop: StopSignal) -> Self {
        Self {
            stop,
            control: 0,
            output: None,
            expecting_ctr: false,
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match offset {
            DATA_OFFSET => self.output.take().unwrap_or(0),
            COMMAND_OFFSET if self.output.is_some() => STATUS_OUTPUT_FULL,
            _ => 0,
        };
        data.fill(0);
        if let Some(first) = data.first_mut() {
            *first = value;
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else {
            return;
        };
        match (offset, value) {
            (COMMAND_OFFSET, CMD_RESET_CPU) => self.stop.stop(StopReason::GuestReboot),
            (COMMAND_OFFSET, CMD_READ_CTR) => self.output = Some(self.control),
            (COMMAND_OFFSET, CMD_WRITE_CTR) => self.expecting_ctr = true,
            (DATA_OFFSET, v) if self.expecting_ctr => {
                self.control = v;
                self.expecting_ctr = false;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_i8042_reset_command_stops_with_reboot() {
        let stop = StopSignal::new().expect("signal");
        let mut dev = I8042::new(stop.clone());
        dev.write(COMMAND_OFFSET, &[0x00]);
        assert_eq!(stop.reason(), None);
        dev.write(COMMAND_OFFSET, &[CMD_RESET_CPU]);
        assert_eq!(stop.reason(), Some(StopReason::GuestReboot));
    }

    #[test]
    fn test_i8042_control_register_round_trips() {
        let mut dev = I8042::new(StopSignal::new().expect("signal"));
        dev.write(COMMAND_OFFSET, &[CMD_WRITE_CTR]);
        dev.write(DATA_OFFSET, &[0x47]);
        dev.write(COMMAND_OFFSET, &[CMD_READ_CTR]);
        let mut status = [0u8];
        dev.read(COMMAND_OFFSET, &mut status);
        assert_eq!(status[0] & STATUS_OUTPUT_FULL, STATUS_OUTPUT_FULL);
        let mut value = [0u8];
        dev.read(DATA_OFFSET, &mut value);
        assert_eq!(value[0], 0x47);
    }
}
