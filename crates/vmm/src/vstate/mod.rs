//! VM and vCPU state owned by KVM: guest memory, the VM (irqchip, PIT,
//! clock) and the vCPUs.

pub mod memory;
pub mod vcpu;
pub mod vm;
