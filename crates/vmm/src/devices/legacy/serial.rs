//! The 16550A serial console at 0x3f8 (IRQ 4), from vm-superio, writing the
//! guest's output to a size-bounded log.

use std::io::Write;
use std::sync::{Arc, Once};

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState as SuperioState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::bus::BusDevice;

/// Port of COM1.
pub const COM1_PORT: u64 = 0x3f8;
/// Ports the UART occupies.
pub const COM1_LEN: u64 = 8;
/// GSI of COM1.
pub const COM1_GSI: u32 = 4;

/// Raises the serial IRQ through an irqfd.
#[derive(Debug, Clone)]
pub struct IrqFdTrigger(pub Arc<EventFd>);

impl Trigger for IrqFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// A writer that keeps at most `limit` bytes, then notes the truncation
/// once and drops the rest, so a chatty guest cannot fill the host's disk.
pub struct BoundedLog<W: Write> {
    inner: W,
    limit: u64,
    written: u64,
    truncated: bool,
    /// Also copy output here (e.g. stdout for tests), unbounded.
    pub echo: Option<Box<dyn Write + Send>>,
}

impl<W: Write> BoundedLog<W> {
    /// Wraps `inner` with a byte limit.
    pub fn new(inner: W, limit: u64) -> Self {
        Self {
            inner,
            limit,
            written: 0,
            truncated: false,
            echo: None,
        }
    }
}

impl<W: Write> Write for BoundedLog<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(echo) = self.echo.as_mut() {
            let written = echo.write_all(buf);
            let flushed = echo.flush();
            if let Err(e) = written.and(flushed) {
                // Every byte the guest writes comes here: said once.
                static SAID: Once = Once::new();
                SAID.call_once(|| {
                    eprintln!("tine-vmm: cannot echo the serial console: {e} (not said again)");
                });
            }
        }
        let room = self.limit.saturating_sub(self.written) as usize;
        if room >= buf.len() {
            self.inner.write_all(buf)?;
            self.written += buf.len() as u64;
        } else if !self.truncated {
            self.inner.write_all(&buf[..room])?;
            self.inner
                .write_all(b"\n[tine-vmm: serial log limit reached, output dropped]\n")?;
            self.written = self.limit;
            self.truncated = true;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Serializable UART registers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialState {
    /// DLL.
    pub baud_divisor_low: u8,
    /// DLM.
    pub baud_divisor_high: u8,
    /// IER.
    pub interrupt_enable: u8,
    /// IIR.
    pub interrupt_identification: u8,
    /// LCR.
    pub line_control: u8,
    /// LSR.
    pub line_status: u8,
    /// MCR.
    pub modem_control: u8,
    /// MSR.
    pub modem_status: u8,
    /// SCR.
    pub scratch: u8,
    /// Bytes waiting for the guest to read.
    pub in_buffer: Vec<u8>,
}

/// The serial console device.
pub struct SerialConsole {
    uart: Serial<IrqFdTrigger, NoEvents, Box<dyn Write + Send>>,
}

impl SerialConsole {
    /// A console raising `irq` and writing to `out`.
    pub fn new(irq: Arc<EventFd>, out: Box<dyn Write + Send>) -> Self {
        Self {
            uart: Serial::new(IrqFdTrigger(irq), out),
        }
    }

    /// A console restored from `state`.
    pub fn restore(state: &SerialState, irq: Arc<EventFd>, out: Box<dyn Write + Send>) -> Self {
        let superio = SuperioState {
            baud_divisor_low: state.baud_divisor_low,
            baud_divisor_high: state.baud_divisor_high,
            interrupt_enable: state.interrupt_enable,
            interrupt_identification: state.interrupt_identification,
            line_control: state.line_control,
            line_status: state.line_status,
            modem_control: state.modem_control,
            modem_status: state.modem_status,
            scratch: state.scratch,
            in_buffer: state.in_buffer.clone(),
        };
        let uart = Serial::from_state(&superio, IrqFdTrigger(irq.clone()), NoEvents, out)
            .unwrap_or_else(|_| {
                // Only fails when the saved input buffer is over the FIFO
                // size; start clean rather than refuse the whole restore.
                Serial::new(IrqFdTrigger(irq), Box::new(std::io::sink()))
            });
        Self { uart }
    }

    /// Captures the registers.
    pub fn save(&self) -> SerialState {
        let s = self.uart.state();
        SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl BusDevice for SerialConsole {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && offset < COM1_LEN {
            data[0] = self.uart.read(offset as u8);
        } else {
            data.fill(0);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 && offset < COM1_LEN {
            if let Err(e) = self.uart.write(offset as u8, data[0]) {
                // Every byte the guest writes comes here: said once.
                static SAID: Once = Once::new();
                SAID.call_once(|| {
                    eprintln!("tine-vmm: a guest write to the serial console failed: {e} (not said again)");
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn test_bounded_log_truncates_once_at_limit() {
        let sink = Shared::default();
        let mut log = BoundedLog::new(sink.clone(), 8);
        log.write_all(b"hello").expect("w");
        log.write_all(b"world").expect("w");
        log.write_all(b"again").expect("w");
        let text = String::from_utf8(sink.0.lock().expect("lock").clone()).expect("utf8");
        assert!(text.starts_with("hellowor\n[tine-vmm: serial log limit"));
        assert_eq!(text.matches("limit reached").count(), 1);
    }

    #[test]
    fn test_serial_console_transmits_bytes_and_round_trips_state() {
        let sink = Shared::default();
        let irq = Arc::new(EventFd::new(0).expect("eventfd"));
        let mut console = SerialConsole::new(irq.clone(), Box::new(sink.clone()));
        console.write(3, &[0x03]); // LCR: 8 data bits
        console.write(7, &[0x5a]); // scratch
        console.write(0, b"A");
        console.write(0, &[1, 2]); // wrong width: ignored
        assert_eq!(sink.0.lock().expect("lock").as_slice(), b"A");
        let state = console.save();
        assert_eq!(state.scratch, 0x5a);
        let restored = SerialConsole::restore(&state, irq, Box::new(std::io::sink()));
        assert_eq!(restored.save(), state);
    }
}
