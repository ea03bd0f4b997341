//! Legacy PC devices on the port-I/O bus: the 8250 serial console, the
//! i8042 controller (guest reboot) and the debug-exit port (guest poweroff).

pub mod debug_exit;
pub mod i8042;
pub mod serial;
