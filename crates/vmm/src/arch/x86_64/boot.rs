//! Loading a Linux kernel (ELF vmlinux or bzImage), the initramfs and the
//! command line, and writing the zero page with its e820 map.

use std::fs::File;

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::{Elf, Error as ElfError};
use linux_loader::loader::{Error as LoaderError, KernelLoader};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::layout::{
    ACPI_RSDP_START, CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, MMIO_HOLE_START,
    SYSTEM_REGION_END, SYSTEM_REGION_START, ZERO_PAGE_START,
};
use crate::vstate::memory::GuestMemoryMmap;

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x0100_0000;
const XLF_KERNEL_64: u16 = 1;
/// Default highest initramfs address for kernels that don't say.
const DEFAULT_INITRD_ADDR_MAX: u64 = 0x37ff_ffff;

/// Errors from loading the kernel, initramfs or command line.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel is neither a valid ELF nor a valid bzImage.
    #[error("kernel image is neither an x86_64 ELF nor a bzImage: {0}")]
    InvalidKernel(String),
    /// The bzImage cannot be booted through the 64-bit entry point.
    #[error("bzImage lacks a 64-bit entry point (boot protocol {version:#x}, xloadflags {xloadflags:#x})")]
    NotBootable64 {
        /// Boot protocol version.
        version: u16,
        /// Its xloadflags.
        xloadflags: u16,
    },
    /// The initramfs does not fit below the kernel's limit.
    #[error("initramfs of {size} bytes does not fit in guest RAM (room for {room})")]
    InitramfsTooLarge {
        /// Its size.
        size: u64,
        /// Bytes available between the kernel's end and the limit.
        room: u64,
    },
    /// The command line is longer than the VMM allows.
    #[error("kernel command line is {0} bytes; at most {max} are allowed", max = CMDLINE_MAX_SIZE - 1)]
    CmdlineTooLong(usize),
    /// The command line contains a NUL byte.
    #[error("kernel command line contains a NUL byte")]
    CmdlineNul,
    /// Reading a file failed.
    #[error("cannot read {what}")]
    Io {
        /// Which file.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Guest memory does not cover a boot structure.
    #[error("guest memory is too small for the {0}")]
    GuestMemory(&'static str),
}

/// Where the kernel landed and how to enter it.
#[derive(Debug, Clone, Copy)]
pub struct KernelEntry {
    /// 64-bit entry point.
    pub entry: GuestAddress,
    /// First byte after the loaded kernel.
    pub kernel_end: u64,
    /// The bzImage's setup header, copied into the zero page.
    pub setup_header: Option<setup_header>,
}

/// Loads `kernel` (ELF first, then bzImage) at 1 MiB.
pub fn load_kernel(mem: &GuestMemoryMmap, kernel: &mut File) -> Result<KernelEntry, BootError> {
    match Elf::load(mem, None, kernel, Some(GuestAddress(HIMEM_START))) {
        Ok(result) => {
            return Ok(KernelEntry {
                entry: result.kernel_load,
                kernel_end: result.kernel_end,
                setup_header: None,
            });
        }
        Err(LoaderError::Elf(ElfError::InvalidElfMagicNumber)) => {}
        Err(e) => return Err(BootError::InvalidKernel(format!("ELF: {e}"))),
    }
    let result = BzImage::load(mem, None, kernel, Some(GuestAddress(HIMEM_START)))
        .map_err(|e| BootError::InvalidKernel(format!("bzImage: {e}")))?;
    let header = result
        .setup_header
        .ok_or_else(|| BootError::InvalidKernel("bzImage without setup header".into()))?;
    let version = header.version;
    let xloadflags = header.xloadflags;
    if version < 0x020c || xloadflags & XLF_KERNEL_64 == 0 {
        return Err(BootError::NotBootable64 {
            version,
            xloadflags,
        });
    }
    Ok(KernelEntry {
        entry: GuestAddress(result.kernel_load.0 + 0x200),
        kernel_end: result.kernel_end,
        setup_header: Some(header),
    })
}

/// Highest guest address usable for the initramfs, exclusive.
fn lowmem_end(mem: &GuestMemoryMmap) -> u64 {
    mem.iter()
        .find(|r| r.start_addr().0 == 0)
        .map(|r| r.len().min(MMIO_HOLE_START))
        .unwrap_or(0)
}

/// Loads the initramfs at the top of low memory. Returns (address, size).
pub fn load_initramfs(
    mem: &GuestMemoryMmap,
    initramfs: &mut File,
    kernel: &KernelEntry,
) -> Result<(u64, u64), BootError> {
    let size = initramfs
        .metadata()
        .map_err(|source| BootError::Io {
            what: "initramfs",
            source,
        })?
        .len();
    let addr_max = kernel
        .setup_header
        .map(|h| u64::from(h.initrd_addr_max))
        .filter(|&m| m != 0)
        .unwrap_or(DEFAULT_INITRD_ADDR_MAX);
    let limit = lowmem_end(mem).min(addr_max + 1);
    let room = limit.saturating_sub(kernel.kernel_end);
    if size > room {
        return Err(BootError::InitramfsTooLarge { size, room });
    }
    let addr = (limit - size) & !0xfff;
    if addr < kernel.kernel_end {
        return Err(BootError::InitramfsTooLarge { size, room });
    }
    std::io::Seek::rewind(initramfs).map_err(|source| BootError::Io {
        what: "initramfs",
        source,
    })?;
    mem.read_exact_volatile_from(GuestAddress(addr), initramfs, size as usize)
        .map_err(|e| BootError::Io {
            what: "initramfs",
            source: std::io::Error::other(e.to_string()),
        })?;
    Ok((addr, size))
}

/// Writes the NUL-terminated command line. Returns its length with the NUL.
pub fn load_cmdline(mem: &GuestMemoryMmap, cmdline: &str) -> Result<usize, BootError> {
    if cmdline.len() >= CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong(cmdline.len()));
    }
    if cmdline.contains('\0') {
        return Err(BootError::CmdlineNul);
    }
    let mut bytes = cmdline.as_bytes().to_vec();
    bytes.push(0);
    mem.write_slice(&bytes, GuestAddress(CMDLINE_START))
        .map_err(|_| BootError::GuestMemory("command line"))?;
    Ok(bytes.len())
}

/// The e820 map: low RAM, the reserved system region, then each RAM region
/// from 1 MiB up.
pub fn e820_map(mem: &GuestMemoryMmap) -> Vec<boot_e820_entry> {
    let mut map = vec![
        boot_e820_entry {
            addr: 0,
            size: SYSTEM_REGION_START,
            r#type: E820_RAM,
        },
        boot_e820_entry {
            addr: SYSTEM_REGION_START,
            size: SYSTEM_REGION_END - SYSTEM_REGION_START,
            r#type: E820_RESERVED,
        },
    ];
    for region in mem.iter() {
        let start = region.start_addr().0.max(HIMEM_START);
        let end = region.start_addr().0 + region.len();
        if end > start {
            map.push(boot_e820_entry {
                addr: start,
                size: end - start,
                r#type: E820_RAM,
            });
        }
    }
    map
}

/// Writes the zero page.
pub fn write_zero_page(
    mem: &GuestMemoryMmap,
    kernel: &KernelEntry,
    cmdline_len: usize,
    initramfs: Option<(u64, u64)>,
) -> Result<(), BootError> {
    let mut params = boot_params::default();
    if let Some(header) = kernel.setup_header {
        params.hdr = header;
    } else {
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.acpi_rsdp_addr = ACPI_RSDP_START;
    if let Some((addr, size)) = initramfs {
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    let map = e820_map(mem);
    for (slot, entry) in params.e820_table.iter_mut().zip(map.iter()) {
        *slot = *entry;
    }
    params.e820_entries = map.len().min(params.e820_table.len()) as u8;
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))
        .map_err(|_| BootError::GuestMemory("zero page"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(size: usize) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).expect("mem")
    }

    #[test]
    fn test_load_kernel_garbage_is_rejected() {
        let m = mem(64 << 20);
        let mut file = tempfile::tempfile().expect("tmp");
        std::io::Write::write_all(&mut file, &[0x5a; 8192]).expect("write");
        assert!(matches!(
            load_kernel(&m, &mut file),
            Err(BootError::InvalidKernel(_))
        ));
    }

    #[test]
    fn test_load_initramfs_larger_than_ram_is_rejected() {
        let m = mem(16 << 20);
        let mut file = tempfile::tempfile().expect("tmp");
        file.set_len(32 << 20).expect("len");
        let kernel = KernelEntry {
            entry: GuestAddress(HIMEM_START),
            kernel_end: 2 << 20,
            setup_header: None,
        };
        assert!(matches!(
            load_initramfs(&m, &mut file, &kernel),
            Err(BootError::InitramfsTooLarge { .. })
        ));
    }

    #[test]
    fn test_load_initramfs_lands_page_aligned_at_top_of_ram() {
        let m = mem(16 << 20);
        let mut file = tempfile::tempfile().expect("tmp");
        std::io::Write::write_all(&mut file, b"initramfs!").expect("write");
        let kernel = KernelEntry {
            entry: GuestAddress(HIMEM_START),
            kernel_end: 2 << 20,
            setup_header: None,
        };
        let (addr, size) = load_initramfs(&m, &mut file, &kernel).expect("load");
        assert_eq!(size, 10);
        assert_eq!(addr % 4096, 0);
        assert_eq!(addr, (16 << 20) - 4096);
        let mut buf = [0u8; 10];
        m.read_slice(&mut buf, GuestAddress(addr)).expect("read");
        assert_eq!(&buf, b"initramfs!");
    }

    #[test]
    fn test_load_cmdline_too_long_is_rejected() {
        let m = mem(1 << 20);
        let long = "x".repeat(CMDLINE_MAX_SIZE);
        assert!(matches!(
            load_cmdline(&m, &long),
            Err(BootError::CmdlineTooLong(_))
        ));
        assert_eq!(load_cmdline(&m, "console=ttyS0").expect("ok"), 14);
    }

    #[test]
    fn test_e820_map_reserves_system_region() {
        let m = mem(128 << 20);
        let map = e820_map(&m);
        let (kind, addr, size) = (map[1].r#type, map[2].addr, map[2].size);
        assert_eq!(kind, E820_RESERVED);
        assert_eq!(addr, HIMEM_START);
        assert_eq!(size, (128 << 20) - HIMEM_START);
    }
}
