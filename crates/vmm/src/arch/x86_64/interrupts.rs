//! Local APIC setup at boot: LINT0 delivers ExtINT (the legacy PIC) and
//! LINT1 delivers NMI, as on a PC.

use kvm_bindings::kvm_lapic_state;

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn get_reg(lapic: &kvm_lapic_state, offset: usize) -> u32 {
    let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[offset + i] as u8);
    u32::from_le_bytes(bytes)
}

fn set_reg(lapic: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, b) in value.to_le_bytes().iter().enumerate() {
        lapic.regs[offset + i] = *b as _;
    }
}

fn with_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

/// Configures LINT0 as ExtINT and LINT1 as NMI in `lapic`.
pub fn set_lint(lapic: &mut kvm_lapic_state) {
    let lvt0 = get_reg(lapic, APIC_LVT0);
    set_reg(lapic, APIC_LVT0, with_delivery_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = get_reg(lapic, APIC_LVT1);
    set_reg(lapic, APIC_LVT1, with_delivery_mode(lvt1, APIC_MODE_NMI));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_set_lint_sets_delivery_modes() {
        let mut lapic = kvm_lapic_state::default();
        set_reg(&mut lapic, APIC_LVT0, 0x0001_00ff);
        set_lint(&mut lapic);
        assert_eq!(get_reg(&lapic, APIC_LVT0), 0x0001_07ff);
        assert_eq!((get_reg(&lapic, APIC_LVT1) >> 8) & 0x7, APIC_MODE_NMI);
    }
}
