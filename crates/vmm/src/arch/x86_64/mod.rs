//! x86_64: guest-physical layout, GDT, identity page tables and the register
//! state a Linux kernel expects at its 64-bit entry point.

pub mod gdt;
pub mod layout;
pub mod regs;
