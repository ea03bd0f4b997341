//! The VMM: assembles a VM for boot or from a snapshot (the only code that
//! does), and controls it: pause, resume, snapshot, stop.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tine_proto::vmm::{RunState, SnapshotInfo, StopReason};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arch::x86_64::acpi::{self, AcpiError};
use crate::arch::x86_64::boot::{self, BootError};
use crate::arch::x86_64::cpuid::{self, CpuidError, TEMPLATE_NAME};
use crate::arch::x86_64::interrupts::set_lint;
use crate::arch::x86_64::layout::{ACPI_PM1_EVT_PORT, ACPI_PM1_LEN, GED_GSI, VMGENID_START};
use crate::arch::x86_64::mptable::{self, MptableError, MAX_VCPUS};
use crate::arch::x86_64::msr::{self, MsrError};
use crate::arch::x86_64::regs::{self, RegsError};
use crate::device_manager::{
    event_loop_thread_name, DeviceConfigs, DeviceManager, DeviceManagerError, MmioDeviceState,
    RestoreOverrides,
};
use crate::devices::acpi::pm::AcpiPm1;
use crate::devices::acpi::vmgenid::{VmGenId, VmGenIdConstructorArgs, VmGenIdError, VmGenIdState};
use crate::devices::bus::{Bus, BusError};
use crate::devices::legacy::debug_exit::{DebugExit, DEBUG_EXIT_PORT};
use crate::devices::legacy::i8042::{I8042, I8042_KBD_GSI, I8042_LEN, I8042_PORT};
use crate::devices::legacy::serial::{
    BoundedLog, SerialConsole, SerialState, COM1_GSI, COM1_LEN, COM1_PORT,
};
use crate::snapshot::format::{self, FormatError};
use crate::snapshot::write_set::{WriteSet, WriteSetError};
use crate::snapshot::{temp_name, Persist};
use crate::spare_thread::SpareThread;
use crate::vstate::memory::{GuestRam, MemoryError, Populate, Reservation};
use crate::vstate::vcpu::{
    host_is_amd, install_kick_handler, vcpu_thread_name, ResetState, StopSignal, Vcpu, VcpuContext,
    VcpuError, VcpuHandle, VcpuState,
};
use crate::vstate::vm::{Vm, VmError, VmState};

/// Smallest guest RAM accepted, in MiB.
pub const MIN_MEM_MIB: u64 = 16;
/// Largest guest RAM accepted, in MiB.
pub const MAX_MEM_MIB: u64 = 1 << 20;
/// Default size limit of the serial log.
pub const DEFAULT_SERIAL_LOG_LIMIT: u64 = 16 << 20;
/// Command line used when none is given.
///
/// `nokaslr`: with KASLR, the bzImage decompressor's relocation triple-faulted
/// or hung in about 1 boot in 3 under load in the nested test bed (8 of 8
/// parallel 2-vCPU boots passed without it; vmlinux boots, which skip the
/// decompressor, never failed). Forks of one snapshot share one layout
/// anyway. The root cause is still open (docs/vmm-control.md).
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 pci=off nomodule nokaslr \
     i8042.noaux i8042.nomux i8042.dumbkbd i8042.nopnp swiotlb=noforce cryptomgr.notests";

/// A raw guest image instead of a Linux kernel: bytes loaded at
/// `load_addr`, entered at `entry` in 64-bit long mode at `privilege`.
/// Used by synthetic test guests and benchmarks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RawImage {
    /// The code and data.
    pub bytes: Vec<u8>,
    /// Guest-physical load address.
    pub load_addr: u64,
    /// Entry point.
    pub entry: u64,
    /// The ring its code runs in.
    #[serde(default)]
    pub privilege: Privilege,
}

/// The ring a raw image's code runs in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Privilege {
    /// Ring 3 with IOPL 3 (port I/O allowed): native speed on hosts whose
    /// KVM emulates guest ring 0.
    #[default]
    User,
    /// Ring 0: the code may `hlt`, so an idle guest holds no host CPU (on
    /// such hosts each of its instructions is emulated).
    Kernel,
}

/// Everything needed to boot a VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BootConfig {
    /// vmlinux (ELF) or bzImage.
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initramfs: Option<PathBuf>,
    /// Kernel command line (virtio-mmio entries are appended).
    pub cmdline: String,
    /// Guest RAM in MiB.
    pub mem_mib: u64,
    /// Number of vCPUs.
    pub vcpus: u8,
    /// Boot this raw image instead of `kernel` (which is then ignored).
    #[serde(default)]
    pub raw: Option<RawImage>,
    /// Virtio devices.
    #[serde(default)]
    pub devices: DeviceConfigs,
}

impl BootConfig {
    /// A VM of `mem_mib` MiB and one vCPU that runs `bytes` loaded and
    /// entered at `addr` in ring 3 (see [`RawImage`]), with no devices.
    pub fn raw_image(bytes: &[u8], addr: u64, mem_mib: u64) -> Self {
        Self {
            kernel: PathBuf::new(),
            initramfs: None,
            cmdline: String::new(),
            mem_mib,
            vcpus: 1,
            raw: Some(RawImage {
                bytes: bytes.to_vec(),
                load_addr: addr,
                entry: addr,
                privilege: Privilege::User,
            }),
            devices: DeviceConfigs::default(),
        }
    }
}

/// Where the guest's console goes.
#[derive(Debug, Clone, Default)]
pub struct ConsoleConfig {
    /// Log file (created or truncated).
    pub log_path: Option<PathBuf>,
    /// Byte limit of the log.
    pub log_limit: Option<u64>,
    /// Also copy the console to stdout.
    pub echo_stdout: bool,
}

/// Errors from building or controlling a VM.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A file could not be opened.
    #[error("cannot open {what} {path}")]
    Open {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Boot loading failed.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// Guest memory failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// KVM VM setup failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// vCPU setup or control failed.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// CPUID failed.
    #[error(transparent)]
    Cpuid(#[from] CpuidError),
    /// MSRs failed.
    #[error(transparent)]
    Msr(#[from] MsrError),
    /// Boot structures failed.
    #[error(transparent)]
    Regs(#[from] RegsError),
    /// MP table failed.
    #[error(transparent)]
    Mptable(#[from] MptableError),
    /// ACPI tables failed.
    #[error(transparent)]
    Acpi(#[from] AcpiError),
    /// The VM generation ID device failed.
    #[error(transparent)]
    VmGenId(#[from] VmGenIdError),
    /// Device placement failed.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// State file failed.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// Virtio devices failed.
    #[error(transparent)]
    Devices(#[from] DeviceManagerError),
    /// The snapshot was taken under another CPU template.
    #[error("snapshot CPU template {saved} ({saved_fp:#018x}) does not match this host's {current} ({current_fp:#018x})")]
    CpuTemplate {
        /// Template name in the snapshot.
        saved: String,
        /// Its fingerprint.
        saved_fp: u64,
        /// This host's template name.
        current: String,
        /// This host's fingerprint.
        current_fp: u64,
    },
    /// The operation needs another VM state.
    #[error("VM is {actual}; {op} needs it {needed}")]
    State {
        /// Requested operation.
        op: &'static str,
        /// Needed state.
        needed: &'static str,
        /// Actual state.
        actual: &'static str,
    },
    /// A write set could not be saved or read.
    #[error(transparent)]
    WriteSet(#[from] WriteSetError),
    /// The operation needs a VM restored from a snapshot (its memory a
    /// copy-on-write mapping of the memory file).
    #[error("{0} needs a VM restored from a snapshot; this one was booted")]
    NotRestored(&'static str),
    /// I/O failed.
    #[error("{0}")]
    Io(&'static str, #[source] std::io::Error),
}

fn open(what: &'static str, path: &Path) -> Result<File, VmmError> {
    File::open(path).map_err(|source| VmmError::Open {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn check_vcpus(count: u8) -> Result<(), VmmError> {
    if count == 0 || count > MAX_VCPUS {
        return Err(VmmError::Config(format!(
            "vcpus must be 1 to {MAX_VCPUS}, not {count}"
        )));
    }
    Ok(())
}

/// Checks a configuration before anything is created.
pub fn validate(config: &BootConfig) -> Result<(), VmmError> {
    check_vcpus(config.vcpus)?;
    for drive in &config.devices.drives {
        if !drive.path.is_file() && !drive.path.exists() {
            return Err(VmmError::Config(format!(
                "disk image {} does not exist",
                drive.path.display()
            )));
        }
    }
    if let Some(vsock) = &config.devices.vsock {
        if vsock.guest_cid < 3 || vsock.guest_cid >= u64::from(u32::MAX) {
            return Err(VmmError::Config(format!(
                "vsock guest CID must be 3 to {}, not {}",
                u32::MAX - 1,
                vsock.guest_cid
            )));
        }
    }
    if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&config.mem_mib) {
        return Err(VmmError::Config(format!(
            "memory must be {MIN_MEM_MIB} to {MAX_MEM_MIB} MiB, not {}",
            config.mem_mib
        )));
    }
    Ok(())
}

/// The snapshot state file's contents.
#[derive(Debug, Serialize, Deserialize)]
pub struct MicrovmState {
    /// Guest RAM in bytes (the memory file's size).
    pub mem_size: u64,
    /// CPU template name.
    pub cpu_template: String,
    /// CPU template fingerprint on the host that took the snapshot.
    pub cpu_fingerprint: u64,
    /// VM-wide state.
    pub vm: VmState,
    /// Per-vCPU state.
    pub vcpus: Vec<VcpuState>,
    /// Serial console registers.
    pub serial: SerialState,
    /// Virtio devices.
    pub devices: Vec<MmioDeviceState>,
    /// The boot configuration the VM came from (informational).
    pub boot: BootConfig,
    /// The VM generation ID device (Linux guests booted with ACPI tables).
    pub vmgenid: Option<VmGenIdState>,
}

/// Format version 1 of [`MicrovmState`]: no VM generation ID device.
#[derive(Deserialize)]
struct MicrovmStateV1 {
    mem_size: u64,
    cpu_template: String,
    cpu_fingerprint: u64,
    vm: VmState,
    vcpus: Vec<VcpuState>,
    serial: SerialState,
    devices: Vec<MmioDeviceState>,
    boot: BootConfig,
}

impl From<MicrovmStateV1> for MicrovmState {
    fn from(v1: MicrovmStateV1) -> Self {
        Self {
            mem_size: v1.mem_size,
            cpu_template: v1.cpu_template,
            cpu_fingerprint: v1.cpu_fingerprint,
            vm: v1.vm,
            vcpus: v1.vcpus,
            serial: v1.serial,
            devices: v1.devices,
            boot: v1.boot,
            vmgenid: None,
        }
    }
}

impl MicrovmState {
    /// Decodes a state file of any readable format version.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let (version, payload) = format::open(bytes)?;
        if version == 1 {
            return format::decode_payload::<MicrovmStateV1>(payload).map(Self::from);
        }
        format::decode_payload(payload)
    }

    fn read(file: &mut File) -> Result<Self, FormatError> {
        let size = file.metadata()?.len();
        Self::decode(&format::read_bytes_sized(file, size)?)
    }
}

/// A VM created but not yet given memory and state: what a pre-started
/// tine-vmm process holds while it waits for a restore.
pub struct PreparedVm {
    vm: Vm,
    vcpus: Vec<Vcpu>,
    cpuid_base: kvm_bindings::CpuId,
    /// Guest RAM reserved and registered with KVM ahead of a restore.
    memory: Option<Reservation>,
    /// One thread per vCPU, and one for the device event loop, started
    /// ahead so that a restore does not start threads.
    vcpu_threads: Vec<SpareThread>,
    device_thread: SpareThread,
}

impl PreparedVm {
    /// Creates the KVM VM (irqchip, PIT) and `num_vcpus` vCPUs with this
    /// host's CPUID template set (a snapshot taken here holds the same, so
    /// its restore need not set it again), and starts the threads the VM
    /// will run on.
    pub fn new(num_vcpus: u8) -> Result<Self, VmmError> {
        check_vcpus(num_vcpus)?;
        let vm = Vm::new()?;
        let cpuid_base = cpuid::supported_cpuid(&vm.kvm)?;
        let mut vcpus = Vec::with_capacity(num_vcpus as usize);
        let mut vcpu_threads = Vec::with_capacity(num_vcpus as usize);
        for index in 0..num_vcpus {
            let fd = vm
                .fd
                .create_vcpu(u64::from(index))
                .map_err(|source| VmError::Kvm {
                    op: "KVM_CREATE_VCPU",
                    source,
                })?;
            // Without it a restore sets the snapshot's rate even when the
            // vCPU already runs at it.
            let tsc_khz = fd
                .get_tsc_khz()
                .inspect_err(|e| eprintln!("tine-vmm: vCPU {index}: cannot read its TSC rate: {e}"))
                .ok();
            let mut vcpu = Vcpu {
                index,
                fd,
                msr_indices: Vec::new(),
                cpuid: Vec::new(),
                tsc_khz,
                reset: None,
            };
            vcpu.set_cpuid(cpuid::vcpu_cpuid(&cpuid_base, index, num_vcpus)?.as_slice())?;
            // Not needed to run: without it a restore sets every part.
            vcpu.reset = match ResetState::read(&vcpu.fd) {
                Ok(reset) => Some(reset),
                Err(e) => {
                    eprintln!("tine-vmm: vCPU {index}: a restore will set all its state: {e}");
                    None
                }
            };
            vcpus.push(vcpu);
            vcpu_threads.push(
                SpareThread::spawn(vcpu_thread_name(index))
                    .map_err(|e| VmmError::Io("vCPU thread", e))?,
            );
        }
        let device_thread = SpareThread::spawn(event_loop_thread_name())
            .map_err(|e| VmmError::Io("event loop thread", e))?;
        // Done now rather than on the restore's path (a CPUID instruction,
        // a signal handler).
        host_is_amd();
        install_kick_handler();
        Ok(Self {
            vm,
            vcpus,
            cpuid_base,
            memory: None,
            vcpu_threads,
            device_thread,
        })
    }

    /// Like [`PreparedVm::new`], and also reserves `mem_size` bytes of guest
    /// RAM and registers them with KVM, so that a restore of a snapshot of
    /// that size only has to map its memory file.
    pub fn with_memory(num_vcpus: u8, mem_size: u64) -> Result<Self, VmmError> {
        let mut prepared = Self::new(num_vcpus)?;
        let reservation = Reservation::new(mem_size)?;
        prepared.vm.register_ranges(reservation.ranges())?;
        prepared.memory = Some(reservation);
        Ok(prepared)
    }

    /// Finds the saveable MSRs (probing each one) for a freshly booted VM.
    fn probe_msrs(&mut self) -> Result<(), VmmError> {
        let indices = match self.vcpus.first() {
            Some(v) => msr::saveable_msr_indices(&self.vm.kvm, &v.fd)?,
            None => Vec::new(),
        };
        for vcpu in &mut self.vcpus {
            vcpu.msr_indices = indices.clone();
        }
        Ok(())
    }

    /// Number of vCPUs created.
    pub fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }
}

/// A running (or paused, or stopped) VM.
pub struct Vmm {
    vm: Vm,
    ram: GuestRam,
    vcpus: Vec<VcpuHandle>,
    stop: StopSignal,
    serial: Arc<Mutex<SerialConsole>>,
    i8042: Arc<Mutex<I8042>>,
    devices: DeviceManager,
    vmgenid: Option<VmGenId>,
    state: RunState,
    cpu_fingerprint: u64,
    boot: BootConfig,
    /// The guest's kvmclock to go on from at the next resume: the
    /// snapshot's while a VM restored paused has not run yet, or the one a
    /// pause holding the clock read. The resume sets it again, so that the
    /// guest's clock does not count the wait.
    restored_clock: Option<kvm_bindings::kvm_clock_data>,
}

struct Legacy {
    pio: Bus,
    serial: Arc<Mutex<SerialConsole>>,
    i8042: Arc<Mutex<I8042>>,
}

fn console_writer(console: &ConsoleConfig) -> Result<Box<dyn Write + Send>, VmmError> {
    let inner: Box<dyn Write + Send> = match &console.log_path {
        Some(path) => Box::new(File::create(path).map_err(|source| VmmError::Open {
            what: "serial log",
            path: path.clone(),
            source,
        })?),
        None => Box::new(std::io::sink()),
    };
    let mut log = BoundedLog::new(inner, console.log_limit.unwrap_or(DEFAULT_SERIAL_LOG_LIMIT));
    if console.echo_stdout {
        log.echo = Some(Box::new(std::io::stdout()));
    }
    Ok(Box::new(log))
}

fn legacy_devices(
    vm: &Vm,
    stop: &StopSignal,
    console: &ConsoleConfig,
    serial_state: Option<&SerialState>,
) -> Result<Legacy, VmmError> {
    let irq = Arc::new(irqfd(vm, COM1_GSI, "KVM_IRQFD (serial)")?);
    let out = console_writer(console)?;
    let serial = Arc::new(Mutex::new(match serial_state {
        Some(state) => SerialConsole::restore(state, irq, out),
        None => SerialConsole::new(irq, out),
    }));
    let kbd_irq = Arc::new(irqfd(vm, I8042_KBD_GSI, "KVM_IRQFD (i8042)")?);
    let i8042 = Arc::new(Mutex::new(I8042::new(stop.clone(), Some(kbd_irq))));
    let mut pio = Bus::new();
    pio.insert(serial.clone(), COM1_PORT, COM1_LEN)?;
    pio.insert(i8042.clone(), I8042_PORT, I8042_LEN)?;
    pio.insert(
        Arc::new(Mutex::new(DebugExit::new(stop.clone()))),
        DEBUG_EXIT_PORT,
        1,
    )?;
    pio.insert(
        Arc::new(Mutex::new(AcpiPm1::new(stop.clone()))),
        ACPI_PM1_EVT_PORT,
        ACPI_PM1_LEN,
    )?;
    Ok(Legacy { pio, serial, i8042 })
}

/// An eventfd registered with KVM as an irqfd on `gsi`.
fn irqfd(vm: &Vm, gsi: u32, op: &'static str) -> Result<EventFd, VmmError> {
    let irq = EventFd::new(EFD_NONBLOCK).map_err(|e| VmmError::Io("eventfd", e))?;
    vm.fd
        .register_irqfd(&irq, gsi)
        .map_err(|source| VmError::Kvm { op, source })?;
    Ok(irq)
}

impl Vmm {
    /// Boots a VM from `config`. Every input is checked before the VM is
    /// created; the vCPUs start running before this returns.
    pub fn boot(config: &BootConfig, console: &ConsoleConfig) -> Result<Self, VmmError> {
        validate(config)?;
        let mut prepared = PreparedVm::new(config.vcpus)?;
        prepared.probe_msrs()?;
        let ram = GuestRam::new_memfd(config.mem_mib << 20)?;
        // Load the guest image; Linux also gets its zero page below, once
        // the devices (and so the command line) are known.
        let (entry_addr, linux) = match &config.raw {
            Some(raw) => {
                vm_memory::Bytes::write_slice(
                    &ram.mem,
                    &raw.bytes,
                    vm_memory::GuestAddress(raw.load_addr),
                )
                .map_err(|_| {
                    VmmError::Config(format!(
                        "raw image of {} bytes at {:#x} does not fit in guest RAM",
                        raw.bytes.len(),
                        raw.load_addr
                    ))
                })?;
                (raw.entry, None)
            }
            None => {
                let mut kernel = open("kernel", &config.kernel)?;
                let entry = boot::load_kernel(&ram.mem, &mut kernel)?;
                let initrd = match &config.initramfs {
                    Some(path) => Some(boot::load_initramfs(
                        &ram.mem,
                        &mut open("initramfs", path)?,
                        &entry,
                    )?),
                    None => None,
                };
                (entry.entry.0, Some((entry, initrd)))
            }
        };
        mptable::setup_mptable(&ram.mem, config.vcpus)?;

        let PreparedVm {
            vm,
            vcpus,
            cpuid_base,
            memory: _,
            vcpu_threads,
            device_thread,
        } = prepared;
        vm.register_memory(&ram)?;
        let stop = StopSignal::new().map_err(|e| VmmError::Io("eventfd", e))?;
        let legacy = legacy_devices(&vm, &stop, console, None)?;
        // Linux gets ACPI tables, and with them the VM generation ID.
        let vmgenid = match &linux {
            Some(_) => {
                acpi::setup_acpi(&ram.mem, config.vcpus)?;
                Some(VmGenId::new(
                    &ram.mem,
                    VMGENID_START,
                    GED_GSI,
                    irqfd(&vm, GED_GSI, "KVM_IRQFD (GED)")?,
                )?)
            }
            None => None,
        };
        let mut mmio = Bus::new();
        let mut devices = DeviceManager::create(&vm, &mut mmio, &ram.mem, &config.devices)?;
        if let Some((entry, initrd)) = &linux {
            let cmdline = format!("{}{}", config.cmdline, devices.cmdline_entries());
            let cmdline_len = boot::load_cmdline(&ram.mem, &cmdline)?;
            boot::write_zero_page(&ram.mem, entry, cmdline_len, *initrd)?;
        }
        devices.start(Some(device_thread))?;
        let ctx = VcpuContext {
            pio: Arc::new(legacy.pio),
            mmio: Arc::new(mmio),
            stop: stop.clone(),
        };

        let mut handles = Vec::with_capacity(vcpus.len());
        // `PreparedVm::new` set each vCPU's CPUID for `config.vcpus`.
        for (mut vcpu, thread) in vcpus.into_iter().zip(vcpu_threads) {
            // Set for a boot from here on.
            vcpu.reset = None;
            msr::set_msrs(&vcpu.fd, &msr::boot_msrs())?;
            let kvm_err = |op| move |source| VmError::Kvm { op, source };
            if vcpu.index == 0 {
                let mut sregs = vcpu.fd.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
                regs::setup_long_mode(&ram.mem, &mut sregs)?;
                let mut boot_regs = regs::boot_regs(entry_addr);
                if config
                    .raw
                    .as_ref()
                    .is_some_and(|r| r.privilege == Privilege::User)
                {
                    regs::write_user_page_tables(&ram.mem)?;
                    regs::enter_user_mode(&mut sregs);
                    boot_regs.rflags = regs::USER_IOPL3_RFLAGS;
                }
                vcpu.fd
                    .set_sregs(&sregs)
                    .map_err(kvm_err("KVM_SET_SREGS"))?;
                vcpu.fd
                    .set_regs(&boot_regs)
                    .map_err(kvm_err("KVM_SET_REGS"))?;
                vcpu.fd
                    .set_fpu(&regs::boot_fpu())
                    .map_err(kvm_err("KVM_SET_FPU"))?;
            }
            let mut lapic = vcpu.fd.get_lapic().map_err(kvm_err("KVM_GET_LAPIC"))?;
            set_lint(&mut lapic);
            vcpu.fd
                .set_lapic(&lapic)
                .map_err(kvm_err("KVM_SET_LAPIC"))?;
            handles.push(VcpuHandle::start(vcpu, ctx.clone(), false, Some(thread))?);
        }
        Ok(Self {
            cpu_fingerprint: cpuid::fingerprint(&cpuid_base),
            vm,
            ram,
            vcpus: handles,
            stop,
            serial: legacy.serial,
            i8042: legacy.i8042,
            devices,
            vmgenid,
            state: RunState::Running,
            boot: config.clone(),
            restored_clock: None,
        })
    }

    /// Restores a VM from `state_path` and `mem_path` (mapped copy-on-write)
    /// into `prepared` (or a VM created now). The state file is read and
    /// checked completely before any KVM object is touched. The VM is left
    /// paused when `paused` is set, running otherwise.
    pub fn restore(
        state_path: &Path,
        mem_path: &Path,
        prepared: Option<PreparedVm>,
        console: &ConsoleConfig,
        overrides: &RestoreOverrides,
        paused: bool,
    ) -> Result<Self, VmmError> {
        let mut state_file = open("state file", state_path)?;
        let state = MicrovmState::read(&mut state_file)?;
        let mem_file = open("memory file", mem_path)?;
        if state.vcpus.is_empty() || state.vcpus.len() > MAX_VCPUS as usize {
            return Err(VmmError::Config(format!(
                "state file holds {} vCPUs",
                state.vcpus.len()
            )));
        }
        let prepared = match prepared {
            Some(p) if p.vcpu_count() == state.vcpus.len() => p,
            Some(p) => {
                return Err(VmmError::Config(format!(
                    "pre-started VM has {} vCPUs, the snapshot {}",
                    p.vcpu_count(),
                    state.vcpus.len()
                )));
            }
            None => PreparedVm::new(state.vcpus.len() as u8)?,
        };
        let current_fp = cpuid::fingerprint(&prepared.cpuid_base);
        if state.cpu_template != TEMPLATE_NAME || state.cpu_fingerprint != current_fp {
            return Err(VmmError::CpuTemplate {
                saved: state.cpu_template.clone(),
                saved_fp: state.cpu_fingerprint,
                current: TEMPLATE_NAME.into(),
                current_fp,
            });
        }
        let PreparedVm {
            vm,
            vcpus,
            memory,
            vcpu_threads,
            device_thread,
            ..
        } = prepared;
        let ram = match memory {
            Some(reservation) if reservation.size() == state.mem_size => {
                GuestRam::from_snapshot_file_into(mem_file, reservation)?
            }
            Some(reservation) => {
                return Err(VmmError::Config(format!(
                    "pre-started VM reserved {} MiB, the snapshot needs {} MiB",
                    reservation.size() >> 20,
                    state.mem_size >> 20
                )));
            }
            None => {
                let ram = GuestRam::from_snapshot_file(mem_file, state.mem_size)?;
                vm.register_memory(&ram)?;
                ram
            }
        };
        let stop = StopSignal::new().map_err(|e| VmmError::Io("eventfd", e))?;
        let mut restored = Vec::with_capacity(vcpus.len());
        for (mut vcpu, saved) in vcpus.into_iter().zip(state.vcpus.iter()) {
            vcpu.restore_state(saved)?;
            restored.push(vcpu);
        }
        vm.restore_state(&state.vm)?;
        // Devices last, after the irqchip, so their pending interrupts are
        // not overwritten by the irqchip state.
        let legacy = legacy_devices(&vm, &stop, console, Some(&state.serial))?;
        // A fresh generation ID and its interrupt, after the irqchip's state
        // (which would drop the pending edge) and before any vCPU runs.
        let vmgenid = match &state.vmgenid {
            Some(saved) => {
                let args = VmGenIdConstructorArgs {
                    mem: ram.mem.clone(),
                    irq: irqfd(&vm, saved.gsi, "KVM_IRQFD (GED)")?,
                };
                Some(VmGenId::restore(args, saved)?)
            }
            None => None,
        };
        let mut mmio = Bus::new();
        let mut devices =
            DeviceManager::restore(&vm, &mut mmio, &ram.mem, &state.devices, overrides)?;
        let ctx = VcpuContext {
            pio: Arc::new(legacy.pio),
            mmio: Arc::new(mmio),
            stop: stop.clone(),
        };
        let mut handles = Vec::with_capacity(restored.len());
        for ((vcpu, thread), saved) in restored.into_iter().zip(vcpu_threads).zip(&state.vcpus) {
            // Only a guest with a kvmclock has one to tell (the ioctl
            // fails otherwise, at the cost of one that succeeds).
            if saved.kvmclock_enabled() {
                vcpu.tell_clock_stopped();
            }
            // A restore that runs the guest starts each vCPU running: its
            // state is set, and a start parked then resumed costs two more
            // hand-overs to the vCPU thread on the fork's path.
            handles.push(VcpuHandle::start(vcpu, ctx.clone(), paused, Some(thread))?);
        }
        // The device event loop starts after the vCPUs: each start wakes a
        // spare thread, which the scheduler places on an idle CPU if there
        // is one, else next to this thread, which it then preempts. The
        // event loop runs for microseconds before it waits; a vCPU runs the
        // guest for a time slice, and this thread has the answer to send.
        // Nothing is lost meanwhile: what the guest signals waits in its
        // eventfds, which the loop finds readable once it watches them.
        devices.start(Some(device_thread))?;
        // The device event loop runs from its start; the clock is set
        // again on resume only for a VM restored paused (its clock stood
        // still meanwhile).
        Ok(Self {
            cpu_fingerprint: current_fp,
            vm,
            ram,
            vcpus: handles,
            stop,
            serial: legacy.serial,
            i8042: legacy.i8042,
            devices,
            vmgenid,
            state: if paused {
                RunState::Paused
            } else {
                RunState::Running
            },
            boot: state.boot,
            restored_clock: paused.then_some(state.vm.clock),
        })
    }

    /// The VM's run state.
    pub fn run_state(&self) -> RunState {
        if self.stop.reason().is_some() {
            RunState::Stopped
        } else {
            self.state
        }
    }

    /// The stop signal (its eventfd fires when the guest stops).
    pub fn stop_signal(&self) -> &StopSignal {
        &self.stop
    }

    /// Guest RAM.
    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    fn require(&self, op: &'static str, needed: RunState) -> Result<(), VmmError> {
        let actual = self.run_state();
        if actual != needed {
            return Err(VmmError::State {
                op,
                needed: needed.as_str(),
                actual: actual.as_str(),
            });
        }
        Ok(())
    }

    /// Parks every vCPU.
    pub fn pause(&mut self) -> Result<(), VmmError> {
        self.require("pause", RunState::Running)?;
        for vcpu in &self.vcpus {
            vcpu.pause()?;
        }
        self.devices.pause();
        self.state = RunState::Paused;
        Ok(())
    }

    /// Parks every vCPU, and holds the guest's clock where it is until
    /// [`Vmm::resume`]: the guest does not see the time it waits pass, as
    /// a VM restored paused does not (a VM primed for a hot fork that ran
    /// ahead until its agent answered).
    pub fn pause_holding_clock(&mut self) -> Result<(), VmmError> {
        self.pause()?;
        self.restored_clock = Some(self.vm.clock()?);
        Ok(())
    }

    /// Lets every vCPU run again.
    pub fn resume(&mut self) -> Result<(), VmmError> {
        self.require("resume", RunState::Paused)?;
        if let Some(clock) = self.restored_clock.take() {
            self.vm.set_clock(&clock)?;
        }
        // The vCPUs first, for the reason the restore starts them first.
        for vcpu in &self.vcpus {
            vcpu.resume()?;
        }
        self.devices.resume();
        self.state = RunState::Running;
        Ok(())
    }

    /// Saves the pages of the memory file the guest has written since the
    /// restore to `path` as a write set (see
    /// [`write_set`](crate::snapshot::write_set)); returns the bytes they
    /// cover. The VM may run meanwhile: the set is what was written when
    /// `/proc/self/pagemap` was read.
    pub fn save_write_set(&self, path: &Path) -> Result<u64, VmmError> {
        if !self.ram.private {
            return Err(VmmError::NotRestored("save_write_set"));
        }
        let written = self
            .ram
            .written_pages()
            .map_err(|e| VmmError::Io("read /proc/self/pagemap", e))?;
        let set = WriteSet::new(self.ram.size(), written);
        set.save(path)?;
        Ok(set.bytes())
    }

    /// Copies the pages of the write set at `path` into the VM's memory,
    /// as the guest's first write of each would (their bytes stay those of
    /// the memory file); returns the bytes copied. A write set that does
    /// not fit this VM is refused before any page is touched.
    pub fn populate_write_set(&self, path: &Path) -> Result<u64, VmmError> {
        if !self.ram.private {
            return Err(VmmError::NotRestored("populate_write_set"));
        }
        let set = WriteSet::load(path, self.ram.size())?;
        self.ram
            .populate_ranges(&set.ranges, Populate::Write)
            .map_err(|e| VmmError::Io("copy a write set's pages (madvise MADV_POPULATE_WRITE)", e))
    }

    /// Writes a snapshot of the paused VM: the state file and a sparse
    /// memory file, each written to a temporary name and renamed into
    /// place, so a failed snapshot never leaves a half-written file behind.
    pub fn snapshot(
        &mut self,
        state_path: &Path,
        mem_path: &Path,
    ) -> Result<SnapshotInfo, VmmError> {
        self.require("snapshot", RunState::Paused)?;
        let start = Instant::now();
        let mut vcpu_states = Vec::with_capacity(self.vcpus.len());
        for vcpu in &self.vcpus {
            vcpu_states.push(vcpu.save_state()?);
        }
        let mut vm_state = self.vm.save_state()?;
        // A clock held for the next resume is the guest's own.
        if let Some(held) = self.restored_clock {
            vm_state.clock = held;
        }
        let serial = self.serial.lock().unwrap_or_else(|p| p.into_inner()).save();
        let state = MicrovmState {
            mem_size: self.ram.size(),
            cpu_template: TEMPLATE_NAME.into(),
            cpu_fingerprint: self.cpu_fingerprint,
            vm: vm_state,
            vcpus: vcpu_states,
            serial,
            devices: self.devices.save(),
            boot: self.boot.clone(),
            vmgenid: self.vmgenid.as_ref().map(Persist::save),
        };
        let encoded = format::encode(&state)?;
        let mem_tmp = temp_name(mem_path);
        let state_tmp = temp_name(state_path);
        let result = (|| {
            let mut mem_file =
                File::create(&mem_tmp).map_err(|e| VmmError::Io("create memory file", e))?;
            let written = self.ram.write_sparse(&mut mem_file)?;
            let mut state_file =
                File::create(&state_tmp).map_err(|e| VmmError::Io("create state file", e))?;
            state_file
                .write_all(&encoded)
                .and_then(|_| state_file.sync_all())
                .map_err(|e| VmmError::Io("write state file", e))?;
            std::fs::rename(&mem_tmp, mem_path)
                .map_err(|e| VmmError::Io("rename memory file", e))?;
            std::fs::rename(&state_tmp, state_path)
                .map_err(|e| VmmError::Io("rename state file", e))?;
            Ok(written)
        })();
        match result {
            Ok(written) => Ok(SnapshotInfo {
                state_path: state_path.to_path_buf(),
                mem_path: mem_path.to_path_buf(),
                mem_bytes_written: written,
                duration_us: start.elapsed().as_micros() as u64,
            }),
            Err(e) => {
                // A file renamed into place, or never created, is not there.
                for tmp in [&mem_tmp, &state_tmp] {
                    if let Err(removed) = std::fs::remove_file(tmp) {
                        if removed.kind() != std::io::ErrorKind::NotFound {
                            eprintln!("tine-vmm: cannot remove {}: {removed}", tmp.display());
                        }
                    }
                }
                Err(e)
            }
        }
    }

    /// Serves the paused VM's drive `id` from the image at `path` (see
    /// [`DeviceManager::switch_disk`]).
    pub fn switch_disk(&mut self, id: &str, path: &Path) -> Result<(), VmmError> {
        self.require("switch_disk", RunState::Paused)?;
        self.devices.switch_disk(id, path)?;
        Ok(())
    }

    /// Guest vsock connections go next to `path` from now on: the paused
    /// VM's socket file was moved there (see
    /// [`crate::devices::virtio::vsock::Vsock::set_uds_path`]).
    pub fn set_vsock_path(&mut self, path: &Path) -> Result<(), VmmError> {
        self.require("move the vsock socket", RunState::Paused)?;
        self.devices.set_vsock_path(path)?;
        Ok(())
    }

    /// Asks the guest to shut down by pressing Ctrl-Alt-Del. The guest's
    /// init decides what to do (tine-agent, systemd and busybox init shut
    /// down); the VM stops when the guest reboots or powers off.
    pub fn request_shutdown(&mut self) -> Result<(), VmmError> {
        self.require("shutdown", RunState::Running)?;
        self.i8042
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send_ctrl_alt_del();
        Ok(())
    }

    /// Stops the VM for good (if it has not stopped already) and returns
    /// why it stopped.
    pub fn kill(&mut self) -> StopReason {
        self.stop.stop(StopReason::Killed);
        for vcpu in self.vcpus.drain(..) {
            vcpu.exit();
        }
        self.devices = DeviceManager::new();
        self.state = RunState::Stopped;
        self.stop.reason().unwrap_or(StopReason::Killed)
    }

    /// Blocks until the guest stops, then ends the vCPU threads.
    pub fn wait(&mut self) -> StopReason {
        loop {
            if let Some(reason) = self.stop.reason() {
                for vcpu in self.vcpus.drain(..) {
                    vcpu.exit();
                }
                self.state = RunState::Stopped;
                return reason;
            }
            let mut fds = [libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(self.stop.event()),
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: `fds` is a valid array of one pollfd for the call.
            unsafe {
                libc::poll(fds.as_mut_ptr(), 1, 100);
            }
        }
    }
}
