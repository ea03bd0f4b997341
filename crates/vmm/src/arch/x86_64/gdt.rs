//! The boot GDT: null, 64-bit code, data and TSS descriptors, and their
//! translation into the `kvm_segment`s loaded into the vCPU.

use kvm_bindings::kvm_segment;

/// Access/flags word of the 64-bit code segment (G, L, P, S, type 0xb).
pub const CODE64_FLAGS: u16 = 0xa09b;
/// Access/flags word of the data segment (G, D/B, P, S, type 0x3).
pub const DATA_FLAGS: u16 = 0xc093;
/// Access/flags word of the busy 64-bit TSS (G, P, type 0xb).
pub const TSS_FLAGS: u16 = 0x808b;

/// Access/flags word of a ring-3 64-bit code segment (G, L, P, DPL 3, S).
pub const USER_CODE64_FLAGS: u16 = 0xa0fb;
/// Access/flags word of a ring-3 data segment (G, D/B, P, DPL 3, S).
pub const USER_DATA_FLAGS: u16 = 0xc0f3;

/// Encodes one segment descriptor from its flags word, base and 20-bit limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = base as u64;
    let limit = limit as u64;
    let flags = flags as u64;
    ((base & 0xff00_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0x0000_ffff)
        | ((limit & 0x000f_0000) << 32)
        | ((flags & 0xf0ff) << 40)
}

/// The boot descriptors, in table order: null, kernel code, kernel data,
/// TSS, user code, user data.
pub fn boot_gdt() -> [u64; 6] {
    [
        0,
        gdt_entry(CODE64_FLAGS, 0, 0xfffff),
        gdt_entry(DATA_FLAGS, 0, 0xfffff),
        gdt_entry(TSS_FLAGS, 0, 0xfffff),
        gdt_entry(USER_CODE64_FLAGS, 0, 0xfffff),
        gdt_entry(USER_DATA_FLAGS, 0, 0xfffff),
    ]
}

/// Decodes descriptor `entry` found at `table_index` into the form KVM loads.
pub fn segment_from_entry(entry: u64, table_index: u8) -> kvm_segment {
    let granularity = ((entry >> 55) & 1) as u8;
    let raw_limit = (((entry >> 32) & 0x000f_0000) | (entry & 0xffff)) as u32;
    let limit = if granularity == 1 {
        (raw_limit << 12) | 0xfff
    } else {
        raw_limit
    };
    let present = ((entry >> 47) & 1) as u8;
    kvm_segment {
        base: ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit,
        selector: u16::from(table_index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 0x3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: granularity,
        avl: ((entry >> 52) & 1) as u8,
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_gdt_entry_code64_decodes_to_long_mode_segment() {
        let seg = segment_from_entry(gdt_entry(CODE64_FLAGS, 0, 0xfffff), 1);
        assert_eq!(seg.selector, 8);
        assert_eq!(seg.l, 1);
        assert_eq!(seg.db, 0);
        assert_eq!(seg.type_, 0xb);
        assert_eq!(seg.limit, 0xffff_ffff);
        assert_eq!(seg.present, 1);
        assert_eq!(seg.unusable, 0);
    }

    #[test]
    fn test_gdt_entry_base_and_limit_round_trip() {
        let entry = gdt_entry(0x0093, 0x1234_5678, 0xabcde);
        let seg = segment_from_entry(entry, 2);
        assert_eq!(seg.base, 0x1234_5678);
        assert_eq!(seg.limit, 0xabcde);
        assert_eq!(seg.g, 0);
        assert_eq!(seg.selector, 16);
    }

    #[test]
    fn test_gdt_entry_null_descriptor_is_unusable() {
        let seg = segment_from_entry(0, 0);
        assert_eq!(seg.unusable, 1);
    }
}
