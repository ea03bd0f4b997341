//! Boot-time vCPU state for the Linux 64-bit boot protocol: identity page
//! tables for the first 1 GiB, the boot GDT, and the registers at entry.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs};
use vm_memory::{Bytes, GuestAddress};

use super::gdt::{boot_gdt, segment_from_entry};
use super::layout::{
    BOOT_STACK_POINTER, GDT_START, IDT_START, PDE_START, PDPTE_START, PML4_START, ZERO_PAGE_START,
};

/// CR0: protected mode enable.
pub const X86_CR0_PE: u64 = 1;
/// CR0: extension type (always 1 on modern CPUs).
pub const X86_CR0_ET: u64 = 1 << 4;
/// CR0: paging.
pub const X86_CR0_PG: u64 = 1 << 31;
/// CR4: physical address extension.
pub const X86_CR4_PAE: u64 = 1 << 5;
/// CR4: OS supports FXSAVE/FXRSTOR and SSE.
pub const X86_CR4_OSFXSR: u64 = 1 << 9;
/// CR4: OS supports XSAVE and XCR0.
pub const X86_CR4_OSXSAVE: u64 = 1 << 18;
/// EFER: long mode enable.
pub const EFER_LME: u64 = 1 << 8;
/// EFER: long mode active.
pub const EFER_LMA: u64 = 1 << 10;

/// Errors from writing boot structures into guest memory.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    /// Guest memory does not cover an address a boot structure needs.
    #[error("guest memory too small for boot structure at {0:#x}")]
    GuestMemory(u64),
}

fn write_u64<M: Bytes<GuestAddress>>(mem: &M, value: u64, addr: u64) -> Result<(), RegsError> {
    mem.write_obj(value, GuestAddress(addr))
        .map_err(|_| RegsError::GuestMemory(addr))
}

/// Present, writable.
const PAGE_PRESENT_WRITABLE: u64 = 0x3;
/// Accessible from ring 3.
const PAGE_USER: u64 = 0x4;
/// A 2 MiB page (in a page directory entry).
const PAGE_SIZE_2M: u64 = 0x80;

/// Writes identity page tables for the first `gibs` GiB (at most 4) with
/// 2 MiB pages: one PML4 entry, `gibs` PDPT entries, and page directories
/// from [`PDE_START`] (0xb000-0xefff). `extra_flags` is ORed into every
/// entry (e.g. the user bit).
fn write_identity_map<M: Bytes<GuestAddress>>(
    mem: &M,
    gibs: u64,
    extra_flags: u64,
) -> Result<(), RegsError> {
    let flags = PAGE_PRESENT_WRITABLE | extra_flags;
    write_u64(mem, PDPTE_START | flags, PML4_START)?;
    for gib in 0..gibs.min(4) {
        let pd = PDE_START + gib * 0x1000;
        write_u64(mem, pd | flags, PDPTE_START + gib * 8)?;
        for i in 0..512u64 {
            let addr = (gib << 30) | (i << 21);
            write_u64(mem, addr | PAGE_SIZE_2M | flags, pd + i * 8)?;
        }
    }
    Ok(())
}

/// Writes identity page tables mapping the first 1 GiB with 2 MiB pages.
pub fn write_identity_page_tables<M: Bytes<GuestAddress>>(mem: &M) -> Result<(), RegsError> {
    write_identity_map(mem, 1, 0)
}

/// Writes the boot GDT and a null IDT, and loads the matching segments,
/// descriptor tables, control registers and EFER into `sregs` for 64-bit
/// long mode with paging through [`write_identity_page_tables`].
pub fn setup_long_mode<M: Bytes<GuestAddress>>(
    mem: &M,
    sregs: &mut kvm_sregs,
) -> Result<(), RegsError> {
    let gdt = boot_gdt();
    for (i, entry) in gdt.iter().enumerate() {
        write_u64(mem, *entry, GDT_START + (i as u64) * 8)?;
    }
    write_u64(mem, 0, IDT_START)?;
    write_identity_page_tables(mem)?;

    let code = segment_from_entry(gdt[1], 1);
    let data = segment_from_entry(gdt[2], 2);
    let tss = segment_from_entry(gdt[3], 3);
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;

    sregs.cr0 |= X86_CR0_PE | X86_CR0_PG | X86_CR0_ET;
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.efer |= EFER_LME | EFER_LMA;
    Ok(())
}

/// Switches `sregs` (already set up by [`setup_long_mode`]) to ring 3:
/// user code and data segments with RPL 3. With [`write_user_page_tables`]
/// and IOPL 3 in RFLAGS, code then runs in ring 3 and may do port I/O.
/// Used by synthetic test guests, whose work then runs at native speed even
/// where KVM emulates guest ring 0.
pub fn enter_user_mode(sregs: &mut kvm_sregs) {
    let gdt = boot_gdt();
    let mut code = segment_from_entry(gdt[4], 4);
    let mut data = segment_from_entry(gdt[5], 5);
    code.selector |= 3;
    data.selector |= 3;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
}

/// Rewrites the identity page tables with the user bit set on every level,
/// covering the first 4 GiB (the MMIO hole included).
pub fn write_user_page_tables<M: Bytes<GuestAddress>>(mem: &M) -> Result<(), RegsError> {
    write_identity_map(mem, 4, PAGE_USER)
}

/// RFLAGS with IOPL 3 (port I/O allowed in ring 3) and interrupts off.
pub const USER_IOPL3_RFLAGS: u64 = 0x3002;

/// General-purpose registers at the kernel's 64-bit entry point.
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    }
}

/// x87/SSE control state at entry (the values a CPU has after FNINIT).
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("test memory")
    }

    #[test]
    fn test_setup_long_mode_writes_identity_map() {
        let mem = mem();
        let mut sregs = kvm_sregs::default();
        setup_long_mode(&mem, &mut sregs).expect("long mode setup");
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_START)).expect("pml4");
        assert_eq!(pml4, PDPTE_START | 3);
        let last_pde: u64 = mem
            .read_obj(GuestAddress(PDE_START + 511 * 8))
            .expect("pde");
        assert_eq!(last_pde, (511 << 21) | 0x83);
        assert_eq!(sregs.cr3, PML4_START);
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(sregs.cs.l, 1);
        assert_eq!(sregs.gdt.limit, 47);
    }

    #[test]
    fn test_setup_long_mode_too_small_memory_fails() {
        let small = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x1000)]).expect("mem");
        let mut sregs = kvm_sregs::default();
        assert!(matches!(
            setup_long_mode(&small, &mut sregs),
            Err(RegsError::GuestMemory(_))
        ));
    }
}
