//! The debug-exit port (0x501, QEMU's isa-debug-exit convention): a byte
//! written there powers the VM off with that value. Kernels without ACPI
//! have no other way to power off (Linux then halts forever); tine's agent
//! and test guests use it, and `reboot=k` remains the reboot path. Kernels
//! with ACPI can also use the PM1 control register (`devices::acpi`).

use crate::devices::bus::BusDevice;
use tine_proto::vmm::StopReason;

use crate::vstate::vcpu::StopSignal;

/// The port.
pub const DEBUG_EXIT_PORT: u64 = 0x501;

/// The device.
pub struct DebugExit {
    stop: StopSignal,
}

impl DebugExit {
    /// A port that reports poweroffs through `stop`.
    pub fn new(stop: StopSignal) -> Self {
        Self { stop }
    }
}

impl BusDevice for DebugExit {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        let value = data.first().copied().unwrap_or(0);
        self.stop.stop(StopReason::GuestPoweroff(value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_debug_exit_write_powers_off_with_value() {
        let stop = StopSignal::new().expect("signal");
        let mut dev = DebugExit::new(stop.clone());
        dev.write(0, &[7]);
        assert_eq!(stop.reason(), Some(StopReason::GuestPoweroff(7)));
    }
}
