//! A minimal i8042 keyboard controller at 0x60-0x64: enough for the guest to
//! reset the machine (command 0xFE to port 0x64, what `reboot=k` does), for
//! the kernel's probe to find a controller, and for the VMM to ask for a
//! graceful shutdown by injecting Ctrl-Alt-Del (the kernel then signals
//! init with SIGINT when `/proc/sys/kernel/ctrl-alt-del` is 0, as systemd,
//! busybox init and tine-agent set it).

use std::collections::VecDeque;
use std::sync::{Arc, Once};

use vmm_sys_util::eventfd::EventFd;

use crate::devices::bus::BusDevice;
use tine_proto::vmm::StopReason;

use crate::vstate::vcpu::StopSignal;

/// First port.
pub const I8042_PORT: u64 = 0x60;
/// Ports covered (0x60..=0x64).
pub const I8042_LEN: u64 = 5;
/// GSI of the keyboard interrupt.
pub const I8042_KBD_GSI: u32 = 1;
const DATA_OFFSET: u64 = 0;
const COMMAND_OFFSET: u64 = 4;
const CMD_RESET_CPU: u8 = 0xfe;
const CMD_READ_CTR: u8 = 0x20;
const CMD_WRITE_CTR: u8 = 0x60;
const STATUS_OUTPUT_FULL: u8 = 0x01;
/// Keep at most this many bytes waiting for the guest.
const OUTPUT_LIMIT: usize = 64;
/// Ctrl down, Alt down, Del down, Del up, Alt up, Ctrl up (scan code set 2).
const CTRL_ALT_DEL: [u8; 11] = [
    0x14, 0x11, 0xe0, 0x71, 0xe0, 0xf0, 0x71, 0xf0, 0x11, 0xf0, 0x14,
];

/// The controller.
pub struct I8042 {
    stop: StopSignal,
    kbd_irq: Option<Arc<EventFd>>,
    control: u8,
    output: VecDeque<u8>,
    expecting_ctr: bool,
}

impl I8042 {
    /// A controller that reports guest resets through `stop` and raises
    /// keyboard interrupts through `kbd_irq` (an irqfd on GSI 1).
    pub fn new(stop: StopSignal, kbd_irq: Option<Arc<EventFd>>) -> Self {
        Self {
            stop,
            kbd_irq,
            control: 0,
            output: VecDeque::new(),
            expecting_ctr: false,
        }
    }

    fn raise(&self) {
        if let Some(irq) = &self.kbd_irq {
            if let Err(e) = irq.write(1) {
                // The guest reads the keyboard at will: said once.
                static SAID: Once = Once::new();
                SAID.call_once(|| {
                    eprintln!("tine-vmm: i8042: cannot raise the keyboard interrupt: {e} (not said again)");
                });
            }
        }
    }

    /// Queues Ctrl-Alt-Del key presses for the guest.
    pub fn send_ctrl_alt_del(&mut self) {
        if self.output.len() + CTRL_ALT_DEL.len() <= OUTPUT_LIMIT {
            self.output.extend(CTRL_ALT_DEL);
            self.raise();
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match offset {
            DATA_OFFSET => {
                let byte = self.output.pop_front().unwrap_or(0);
                if !self.output.is_empty() {
                    self.raise();
                }
                byte
            }
            COMMAND_OFFSET if !self.output.is_empty() => STATUS_OUTPUT_FULL,
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
            (COMMAND_OFFSET, CMD_READ_CTR) if self.output.len() < OUTPUT_LIMIT => {
                self.output.push_back(self.control);
            }
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
        let mut dev = I8042::new(stop.clone(), None);
        dev.write(COMMAND_OFFSET, &[0x00]);
        assert_eq!(stop.reason(), None);
        dev.write(COMMAND_OFFSET, &[CMD_RESET_CPU]);
        assert_eq!(stop.reason(), Some(StopReason::GuestReboot));
    }

    #[test]
    fn test_i8042_control_register_round_trips() {
        let mut dev = I8042::new(StopSignal::new().expect("signal"), None);
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

    #[test]
    fn test_i8042_ctrl_alt_del_delivers_scancodes_with_interrupts() {
        let irq = Arc::new(EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).expect("eventfd"));
        let mut dev = I8042::new(StopSignal::new().expect("signal"), Some(irq.clone()));
        dev.send_ctrl_alt_del();
        assert_eq!(irq.read().expect("irq raised"), 1);
        let mut seen = Vec::new();
        loop {
            let mut status = [0u8];
            dev.read(COMMAND_OFFSET, &mut status);
            if status[0] & STATUS_OUTPUT_FULL == 0 {
                break;
            }
            let mut byte = [0u8];
            dev.read(DATA_OFFSET, &mut byte);
            seen.push(byte[0]);
        }
        assert_eq!(seen, CTRL_ALT_DEL);
    }

    #[test]
    fn test_i8042_output_is_bounded() {
        let mut dev = I8042::new(StopSignal::new().expect("signal"), None);
        for _ in 0..100 {
            dev.send_ctrl_alt_del();
        }
        assert!(dev.output.len() <= OUTPUT_LIMIT);
    }
}
