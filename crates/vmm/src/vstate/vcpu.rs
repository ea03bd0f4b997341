//! vCPUs: boot configuration, the complete saved state, and the run loop
//! thread with its handle (pause, resume, save, exit).
//!
//! Each vCPU runs on its own thread and owns its KVM fd. The VMM talks to it
//! through a [`VcpuHandle`]: commands go over a channel, and a pause kicks
//! the thread out of `KVM_RUN` with a real-time signal.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, KVM_SYSTEM_EVENT_CRASH,
    KVM_SYSTEM_EVENT_RESET, KVM_SYSTEM_EVENT_SHUTDOWN,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use serde::{Deserialize, Serialize};
use tine_proto::vmm::StopReason;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::msr::{
    self, MsrError, MSR_IA32_TSC_DEADLINE, MSR_KVM_SYSTEM_TIME, MSR_KVM_SYSTEM_TIME_NEW,
};
use crate::devices::bus::Bus;
use crate::spare_thread::{SpareThread, Worker};

/// Errors from vCPU setup, state transfer or control.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// A KVM ioctl failed.
    #[error("vCPU {index}: {op} failed")]
    Kvm {
        /// vCPU index.
        index: u8,
        /// Which ioctl.
        op: &'static str,
        /// Why.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// MSR transfer failed.
    #[error("vCPU {index}: MSR transfer failed")]
    Msr {
        /// vCPU index.
        index: u8,
        /// Why.
        #[source]
        source: MsrError,
    },
    /// The CPUID list could not be built.
    #[error("vCPU {0}: invalid CPUID list")]
    Cpuid(u8),
    /// The vCPU thread did not answer.
    #[error("vCPU {0} did not answer within {1:?}")]
    Timeout(u8, Duration),
    /// The vCPU thread is gone.
    #[error("vCPU {0} thread has exited")]
    Gone(u8),
    /// The vCPU thread reported an error.
    #[error("vCPU {index}: {message}")]
    Thread {
        /// vCPU index.
        index: u8,
        /// What it said.
        message: String,
    },
    /// The thread could not be spawned.
    #[error("cannot start vCPU thread")]
    Spawn(#[source] std::io::Error),
}

/// Everything KVM holds for one vCPU, in a serializable form.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct VcpuState {
    /// CPUID as set at creation (restored from here, never recomputed).
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// Saveable MSRs, IA32_TSC_DEADLINE last.
    pub msrs: Vec<kvm_msr_entry>,
    /// General-purpose registers.
    pub regs: kvm_regs,
    /// Segment and control registers.
    pub sregs: kvm_sregs,
    /// XSAVE area (x87, SSE, AVX... state).
    pub xsave: kvm_xsave,
    /// Extended control registers.
    pub xcrs: kvm_xcrs,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// Local APIC.
    pub lapic: kvm_lapic_state,
    /// Multiprocessing state (runnable, halted...).
    pub mp_state: kvm_mp_state,
    /// Pending exceptions, interrupts and NMIs.
    pub vcpu_events: kvm_vcpu_events,
    /// TSC frequency in kHz, when KVM reports it.
    pub tsc_khz: Option<u32>,
}

impl VcpuState {
    /// Whether the guest had enabled its kvmclock (a saved state without
    /// the MSRs is taken to have).
    pub fn kvmclock_enabled(&self) -> bool {
        let mut clock_msrs = self
            .msrs
            .iter()
            .filter(|m| m.index == MSR_KVM_SYSTEM_TIME_NEW || m.index == MSR_KVM_SYSTEM_TIME)
            .peekable();
        clock_msrs.peek().is_none() || clock_msrs.any(|m| m.data & 1 == 1)
    }
}

/// The parts of a vCPU's state that a guest often holds as KVM made them,
/// read when the vCPU is made (off a pre-started VM's restore path): a
/// restore sets only those the snapshot holds otherwise. Each set is an
/// ioctl that loads the vCPU, about 10 us on a nested host.
#[derive(Debug, Clone, Copy)]
pub struct ResetState {
    mp_state: kvm_mp_state,
    debugregs: kvm_debugregs,
    xcrs: kvm_xcrs,
    vcpu_events: kvm_vcpu_events,
}

impl ResetState {
    /// Reads them from a vCPU that has neither run nor been set.
    pub fn read(fd: &VcpuFd) -> Result<Self, kvm_ioctls::Error> {
        Ok(Self {
            mp_state: fd.get_mp_state()?,
            debugregs: fd.get_debug_regs()?,
            xcrs: fd.get_xcrs()?,
            vcpu_events: fd.get_vcpu_events()?,
        })
    }
}

/// Where the first stop reason is recorded and announced.
#[derive(Debug, Clone)]
pub struct StopSignal {
    reason: Arc<Mutex<Option<StopReason>>>,
    event: Arc<EventFd>,
}

impl StopSignal {
    /// A new, unfired signal.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            reason: Arc::new(Mutex::new(None)),
            event: Arc::new(EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)?),
        })
    }

    /// Records `reason` unless one was recorded already, and wakes the VMM.
    pub fn stop(&self, reason: StopReason) {
        let mut slot = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(reason);
        }
        if let Err(e) = self.event.write(1) {
            eprintln!("tine-vmm: cannot wake the VMM to stop the VM: {e}");
        }
    }

    /// The recorded reason.
    pub fn reason(&self) -> Option<StopReason> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The eventfd written on stop.
    pub fn event(&self) -> &EventFd {
        &self.event
    }
}

/// A vCPU before its thread starts.
pub struct Vcpu {
    /// Index (also its APIC ID).
    pub index: u8,
    /// The KVM fd.
    pub fd: VcpuFd,
    /// MSRs saved with this vCPU.
    pub msr_indices: Vec<u32>,
    /// The CPUID set on it.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// The TSC frequency KVM gives it (`None`: KVM did not say), read when
    /// it is created so that a restore need not ask.
    pub tsc_khz: Option<u32>,
    /// What KVM made it with, while nothing has been set since (`None`
    /// once anything was, or when it was not read).
    pub reset: Option<ResetState>,
}

impl Vcpu {
    fn err(&self, op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
        let index = self.index;
        move |source| VcpuError::Kvm { index, op, source }
    }

    /// Sets the CPUID (before the first run). Entries equal to those set
    /// already are not set again: a pre-started vCPU has its CPUID set
    /// ahead, and `KVM_SET_CPUID2` is the slowest ioctl of a restore
    /// (about 70 us on a nested host).
    pub fn set_cpuid(&mut self, entries: &[kvm_cpuid_entry2]) -> Result<(), VcpuError> {
        if self.cpuid == entries {
            return Ok(());
        }
        let cpuid = CpuId::from_entries(entries).map_err(|_| VcpuError::Cpuid(self.index))?;
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(self.err("KVM_SET_CPUID2"))?;
        self.cpuid = entries.to_vec();
        Ok(())
    }

    /// Captures the vCPU's state: MP state first, events last.
    pub fn save_state(&self) -> Result<VcpuState, VcpuError> {
        let mp_state = self
            .fd
            .get_mp_state()
            .map_err(self.err("KVM_GET_MP_STATE"))?;
        let regs = self.fd.get_regs().map_err(self.err("KVM_GET_REGS"))?;
        let sregs = self.fd.get_sregs().map_err(self.err("KVM_GET_SREGS"))?;
        let xsave = self.fd.get_xsave().map_err(self.err("KVM_GET_XSAVE"))?;
        let xcrs = self.fd.get_xcrs().map_err(self.err("KVM_GET_XCRS"))?;
        let debugregs = self
            .fd
            .get_debug_regs()
            .map_err(self.err("KVM_GET_DEBUGREGS"))?;
        let lapic = self.fd.get_lapic().map_err(self.err("KVM_GET_LAPIC"))?;
        let mut msrs =
            msr::get_msrs(&self.fd, &self.msr_indices).map_err(|source| VcpuError::Msr {
                index: self.index,
                source,
            })?;
        // A deadline of 0 means "disarmed"; restoring it as is after the TSC
        // moved would never fire, so arm it at the current TSC instead.
        let tsc = msrs
            .iter()
            .find(|m| m.index == msr::MSR_IA32_TSC)
            .map(|m| m.data);
        if let (Some(tsc), Some(deadline)) = (
            tsc,
            msrs.iter_mut().find(|m| m.index == MSR_IA32_TSC_DEADLINE),
        ) {
            if deadline.data == 0 {
                deadline.data = tsc;
            }
        }
        let vcpu_events = self
            .fd
            .get_vcpu_events()
            .map_err(self.err("KVM_GET_VCPU_EVENTS"))?;
        let tsc_khz = self
            .fd
            .get_tsc_khz()
            .inspect_err(|e| {
                eprintln!(
                    "tine-vmm: vCPU {}: cannot read its TSC rate, which its saved state then lacks: {e}",
                    self.index
                )
            })
            .ok();
        Ok(VcpuState {
            cpuid: self.cpuid.clone(),
            msrs,
            regs,
            sregs,
            xsave,
            xcrs,
            debugregs,
            lapic,
            mp_state,
            vcpu_events,
            tsc_khz,
        })
    }

    /// Restores `state` in the order KVM needs: CPUID, MP state, registers,
    /// XSAVE, XCRs, debug registers, LAPIC, MSRs (TSC deadline last), events.
    pub fn restore_state(&mut self, state: &VcpuState) -> Result<(), VcpuError> {
        self.set_cpuid(&state.cpuid)?;
        if let Some(khz) = state.tsc_khz {
            if self.tsc_khz != Some(khz) {
                // Best effort: scaling needs host support; a mismatch is
                // tolerated as Firecracker does below 250 ppm.
                match self.fd.set_tsc_khz(khz) {
                    Ok(()) => self.tsc_khz = Some(khz),
                    Err(e) => eprintln!(
                        "vcpu {}: cannot scale the TSC to the snapshot's {khz} kHz ({e}); the guest's clock runs at the host's rate",
                        self.index
                    ),
                }
            }
        }
        // What the snapshot holds as KVM made the vCPU is not set again.
        let reset = self.reset.take();
        if reset.is_none_or(|r| r.mp_state != state.mp_state) {
            self.fd
                .set_mp_state(state.mp_state)
                .map_err(self.err("KVM_SET_MP_STATE"))?;
        }
        self.fd
            .set_regs(&state.regs)
            .map_err(self.err("KVM_SET_REGS"))?;
        let sregs = sregs_for_host(&state.sregs, host_is_amd());
        self.fd
            .set_sregs(&sregs)
            .map_err(self.err("KVM_SET_SREGS"))?;
        // SAFETY: the xsave area comes from KVM_GET_XSAVE of a vCPU with the
        // same CPUID (checked through the template fingerprint), so its size
        // and layout match what this vCPU expects.
        unsafe { self.fd.set_xsave(&state.xsave) }.map_err(self.err("KVM_SET_XSAVE"))?;
        if reset.is_none_or(|r| r.xcrs != state.xcrs) {
            self.fd
                .set_xcrs(&state.xcrs)
                .map_err(self.err("KVM_SET_XCRS"))?;
        }
        if reset.is_none_or(|r| r.debugregs != state.debugregs) {
            self.fd
                .set_debug_regs(&state.debugregs)
                .map_err(self.err("KVM_SET_DEBUGREGS"))?;
        }
        self.fd
            .set_lapic(&state.lapic)
            .map_err(self.err("KVM_SET_LAPIC"))?;
        // KVM sets them in order, so the TSC deadline, last, is set once
        // the TSC is; one ioctl for all.
        let (mut ordered, deadline): (Vec<_>, Vec<_>) = state
            .msrs
            .iter()
            .copied()
            .partition(|m| m.index != MSR_IA32_TSC_DEADLINE);
        ordered.extend(deadline);
        msr::set_msrs(&self.fd, &ordered).map_err(|source| VcpuError::Msr {
            index: self.index,
            source,
        })?;
        // None of the sets above changes the pending events unless the
        // snapshot's differ from the reset ones too (an interrupt the
        // special registers queue is also in the saved events).
        if reset.is_none_or(|r| r.vcpu_events != state.vcpu_events) {
            self.fd
                .set_vcpu_events(&state.vcpu_events)
                .map_err(self.err("KVM_SET_VCPU_EVENTS"))?;
        }
        self.msr_indices = state.msrs.iter().map(|m| m.index).collect();
        Ok(())
    }

    /// Tells the guest's kvmclock the vCPU was stopped (`KVM_KVMCLOCK_CTRL`),
    /// so that the time it did not run is not taken for a stuck CPU by the
    /// guest's soft-lockup watchdog and RCU stall detector. Fails when the
    /// guest has no kvmclock (synthetic guests): nothing to tell then.
    pub fn tell_clock_stopped(&self) {
        if let Err(e) = self.fd.kvmclock_ctrl() {
            if e.errno() != libc::EINVAL {
                eprintln!("tine-vmm: KVM_KVMCLOCK_CTRL on vCPU {}: {e}", self.index);
            }
        }
    }
}

/// The name of vCPU `index`'s thread.
pub fn vcpu_thread_name(index: u8) -> String {
    format!("vcpu{index}")
}

/// Whether this host's CPU is AMD's (or Hygon's, its licensee): SVM. Asked
/// once per process: a `CPUID` is a VM exit of several microseconds on a
/// nested host, and a pre-started VM asks before its restore.
pub fn host_is_amd() -> bool {
    static AMD: OnceLock<bool> = OnceLock::new();
    *AMD.get_or_init(|| {
        let leaf = std::arch::x86_64::__cpuid(0);
        let vendor: Vec<u8> = [leaf.ebx, leaf.edx, leaf.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        vendor == b"AuthenticAMD" || vendor == b"HygonGenuine"
    })
}

/// TSS descriptor types: available and busy 64-bit TSS.
const TSS_AVAILABLE: u8 = 9;
const TSS_BUSY: u8 = 11;

/// The special registers to give a restored vCPU on this host. On SVM,
/// KVM_GET_SREGS reports TR as busy although the VMCB holds it as the guest
/// loaded it, available (KVM sets the bit "to work around a bug where the
/// busy flag isn't exposed"). Written back as busy, a CPU that checks the
/// type before an I/O bitmap lookup (QEMU's SVM emulation does) faults
/// every `out` of a process that `ioperm` allowed: the agent's power-off
/// in a restored guest died of a general protection fault. Real AMD CPUs do
/// not look at the type there, so storing what the VMCB held changes nothing
/// for them. Intel's VM entry requires the busy type: left as it is.
fn sregs_for_host(saved: &kvm_sregs, amd: bool) -> kvm_sregs {
    let mut sregs = *saved;
    if amd && sregs.tr.type_ == TSS_BUSY {
        sregs.tr.type_ = TSS_AVAILABLE;
    }
    sregs
}

enum Command {
    Resume,
    SaveState,
    Exit,
}

enum Response {
    Paused,
    State(Box<VcpuState>),
    Error(String),
}

const KICK_INTERVAL: Duration = Duration::from_millis(1);
/// How long a vCPU may take to answer a command.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

extern "C" fn handle_kick(_: libc::c_int) {}

fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN() + 1
}

/// Installs the handler of the signal that kicks a vCPU out of `KVM_RUN`
/// (once per process; a pre-started VM does it before its restore).
pub fn install_kick_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: installs a handler that does nothing, without SA_RESTART,
        // so a signal makes a blocking KVM_RUN return EINTR.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = handle_kick as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(kick_signal(), &action, std::ptr::null_mut());
        }
    });
}

/// The VMM's handle on a running vCPU thread.
pub struct VcpuHandle {
    index: u8,
    commands: Sender<Command>,
    responses: Receiver<Response>,
    pause: Arc<AtomicBool>,
    pthread: libc::pthread_t,
    /// The CPUs the thread may run on (see [`CpuSet`]).
    home: Option<CpuSet>,
    thread: Option<Worker<Vcpu>>,
}

/// What a vCPU thread needs besides the vCPU.
#[derive(Clone)]
pub struct VcpuContext {
    /// Port I/O bus.
    pub pio: Arc<Bus>,
    /// MMIO bus.
    pub mmio: Arc<Bus>,
    /// Where stops are reported.
    pub stop: StopSignal,
}

impl VcpuHandle {
    /// Starts `vcpu` on its own thread: `spare` when given (see
    /// [`crate::spare_thread`]), else one started now; a running one off
    /// this thread's CPU when it may run elsewhere (see `CpuSet`). With
    /// `paused` it waits for [`VcpuHandle::resume`] before the first
    /// `KVM_RUN`.
    pub fn start(
        vcpu: Vcpu,
        ctx: VcpuContext,
        paused: bool,
        spare: Option<SpareThread>,
    ) -> Result<Self, VcpuError> {
        install_kick_handler();
        let (cmd_tx, cmd_rx) = channel();
        let (resp_tx, resp_rx) = channel();
        let pause = Arc::new(AtomicBool::new(paused));
        let index = vcpu.index;
        let thread_pause = pause.clone();
        let spare = SpareThread::given_or_new(spare, || vcpu_thread_name(index))
            .map_err(VcpuError::Spawn)?;
        let pthread = spare.as_pthread_t();
        let home = CpuSet::of(pthread);
        if !paused {
            if let Some(home) = &home {
                home.keep_off_this_cpu(pthread);
            }
        }
        let thread = spare
            .run(move || run_loop(vcpu, ctx, thread_pause, cmd_rx, resp_tx, home))
            .map_err(VcpuError::Spawn)?;
        let handle = Self {
            index,
            commands: cmd_tx,
            responses: resp_rx,
            pause,
            pthread,
            home,
            thread: Some(thread),
        };
        if paused {
            handle.expect(|r| matches!(r, Response::Paused))?;
        }
        Ok(handle)
    }

    fn expect(&self, want: impl Fn(&Response) -> bool) -> Result<Response, VcpuError> {
        match self.responses.recv_timeout(ANSWER_TIMEOUT) {
            Ok(Response::Error(message)) => Err(VcpuError::Thread {
                index: self.index,
                message,
            }),
            Ok(r) if want(&r) => Ok(r),
            Ok(_) => Err(VcpuError::Thread {
                index: self.index,
                message: "unexpected answer".into(),
            }),
            Err(RecvTimeoutError::Timeout) => Err(VcpuError::Timeout(self.index, ANSWER_TIMEOUT)),
            Err(RecvTimeoutError::Disconnected) => Err(VcpuError::Gone(self.index)),
        }
    }

    /// Stops the vCPU at its next exit and waits until it is parked.
    pub fn pause(&self) -> Result<(), VcpuError> {
        self.pause.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        loop {
            // SAFETY: the thread is alive (we hold its Worker), and the
            // kick signal has a no-op handler installed.
            unsafe {
                libc::pthread_kill(self.pthread, kick_signal());
            }
            match self.responses.recv_timeout(KICK_INTERVAL) {
                Ok(Response::Paused) => return Ok(()),
                Ok(Response::Error(message)) => {
                    return Err(VcpuError::Thread {
                        index: self.index,
                        message,
                    });
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(RecvTimeoutError::Timeout) => {
                    return Err(VcpuError::Timeout(self.index, ANSWER_TIMEOUT));
                }
                Err(RecvTimeoutError::Disconnected) => return Err(VcpuError::Gone(self.index)),
            }
        }
    }

    /// Lets a paused vCPU run again, without waiting for its thread to
    /// take it (a fork's resume is on its path), and off this thread's CPU
    /// when it may run elsewhere (see `CpuSet`). Only this clears the
    /// pause flag: a [`VcpuHandle::pause`] that comes before the thread
    /// took the resume sets it again, and the thread parks once more.
    pub fn resume(&self) -> Result<(), VcpuError> {
        self.pause.store(false, Ordering::SeqCst);
        if let Some(home) = &self.home {
            home.keep_off_this_cpu(self.pthread);
        }
        self.commands
            .send(Command::Resume)
            .map_err(|_| VcpuError::Gone(self.index))
    }

    /// Saves the state of a paused vCPU.
    pub fn save_state(&self) -> Result<VcpuState, VcpuError> {
        self.commands
            .send(Command::SaveState)
            .map_err(|_| VcpuError::Gone(self.index))?;
        match self.expect(|r| matches!(r, Response::State(_)))? {
            Response::State(state) => Ok(*state),
            _ => Err(VcpuError::Gone(self.index)),
        }
    }

    /// Ends the thread and returns the vCPU (`None` when the thread did not
    /// end within [`ANSWER_TIMEOUT`]; it is then left to the process's exit).
    pub fn exit(mut self) -> Option<Vcpu> {
        self.end_thread()
    }

    /// Asks the thread to exit and kicks it until it has. One kick is not
    /// enough: a kick that lands after the thread read the pause flag but
    /// before it entered `KVM_RUN` is handled in user space, and the thread
    /// then blocks in `KVM_RUN` for as long as the guest makes no exit (an
    /// idle or spinning guest: forever), so a kill would never finish.
    fn end_thread(&mut self) -> Option<Vcpu> {
        let thread = self.thread.take()?;
        self.pause.store(true, Ordering::SeqCst);
        if self.commands.send(Command::Exit).is_err() {
            // The thread has ended already (a panic, which it printed):
            // the wait below finds it finished.
        }
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        while !thread.is_finished() {
            if Instant::now() >= deadline {
                return None;
            }
            // SAFETY: the thread is alive (it has not finished and we hold
            // its Worker), and the kick signal has a no-op handler.
            unsafe {
                libc::pthread_kill(self.pthread, kick_signal());
            }
            std::thread::sleep(KICK_INTERVAL);
        }
        thread.join()
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.end_thread();
    }
}

/// The CPUs a vCPU thread may run on, as it was started, and the hint its
/// wake-ups get. The scheduler puts a new thread on an idle CPU, but often
/// puts a woken one next to its waker, when its search for an idle CPU is
/// cut short (a busy cache domain: a nested host's is, with guests
/// spinning). There it preempts the VMM's control thread, which then sends
/// its answer only after the guest's time slice (the next tick,
/// milliseconds), and it keeps that CPU while the one the answer wakes
/// waits. So the control thread narrows a vCPU thread it wakes to the
/// other CPUs ([`CpuSet::keep_off_this_cpu`]), and the vCPU thread, once
/// running, takes them all back ([`CpuSet::restore_here`]).
#[derive(Clone, Copy)]
struct CpuSet(libc::cpu_set_t);

impl CpuSet {
    /// The CPUs `thread` may run on (`None` when the kernel does not say).
    fn of(thread: libc::pthread_t) -> Option<Self> {
        // SAFETY: an all-zero cpu_set_t is a valid (empty) set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `thread` is alive (its owner holds it), and the call
        // writes at most `size_of::<cpu_set_t>()` bytes into `set`.
        let rc = unsafe {
            libc::pthread_getaffinity_np(thread, std::mem::size_of::<libc::cpu_set_t>(), &mut set)
        };
        (rc == 0).then_some(Self(set))
    }

    /// Keeps `thread`, which this thread is about to wake, off the CPU this
    /// thread runs on, when the set leaves it another.
    fn keep_off_this_cpu(&self, thread: libc::pthread_t) {
        // SAFETY: no arguments; it only reads this thread's CPU.
        let Ok(here) = usize::try_from(unsafe { libc::sched_getcpu() }) else {
            return;
        };
        let mut elsewhere = self.0;
        // SAFETY: `here` is a CPU number the kernel gave, below
        // CPU_SETSIZE; the macros only read and write `elsewhere`.
        let others = unsafe {
            if here >= 8 * std::mem::size_of::<libc::cpu_set_t>()
                || !libc::CPU_ISSET(here, &elsewhere)
            {
                return;
            }
            libc::CPU_CLR(here, &mut elsewhere);
            libc::CPU_COUNT(&elsewhere)
        };
        if others == 0 {
            return;
        }
        // SAFETY: `thread` is alive (its owner holds it); the set is read
        // only, `size_of::<cpu_set_t>()` bytes.
        let rc = unsafe {
            libc::pthread_setaffinity_np(thread, std::mem::size_of::<libc::cpu_set_t>(), &elsewhere)
        };
        if rc != 0 {
            eprintln!(
                "cannot keep a vCPU thread off CPU {here}: {}",
                std::io::Error::from_raw_os_error(rc)
            );
        }
    }

    /// Lets the calling thread run on every CPU of the set again.
    fn restore_here(&self) {
        // SAFETY: pid 0 is the calling thread; the set is read only.
        let rc =
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.0) };
        if rc != 0 {
            eprintln!(
                "a vCPU thread cannot take back its CPUs: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// What a vCPU thread does when it is started or resumed: it takes back
/// the CPUs its waker kept it off ([`CpuSet`]), then yields once. When it
/// still shares a CPU with its waker (a host, or a process, with one CPU),
/// that hands the CPU back to it; alone on its CPU, it returns at once.
fn settle_after_wake(home: Option<&CpuSet>) {
    if let Some(home) = home {
        home.restore_here();
    }
    std::thread::yield_now();
}

/// Handles one exit. Returns a stop reason when the VM must stop.
fn handle_exit(exit: VcpuExit<'_>, ctx: &VcpuContext) -> Option<StopReason> {
    match exit {
        VcpuExit::IoIn(port, data) => {
            if !ctx.pio.read(u64::from(port), data) {
                data.fill(0xff);
            }
            None
        }
        VcpuExit::IoOut(port, data) => {
            ctx.pio.write(u64::from(port), data);
            None
        }
        VcpuExit::MmioRead(addr, data) => {
            if !ctx.mmio.read(addr, data) {
                data.fill(0xff);
            }
            None
        }
        VcpuExit::MmioWrite(addr, data) => {
            ctx.mmio.write(addr, data);
            None
        }
        VcpuExit::Shutdown => Some(StopReason::TripleFault),
        VcpuExit::SystemEvent(kind, _) => Some(match kind {
            KVM_SYSTEM_EVENT_SHUTDOWN => StopReason::GuestPoweroff(0),
            KVM_SYSTEM_EVENT_RESET => StopReason::GuestReboot,
            KVM_SYSTEM_EVENT_CRASH => StopReason::GuestCrash,
            other => StopReason::VmmError(format!("unknown system event {other}")),
        }),
        VcpuExit::Hlt => Some(StopReason::GuestPoweroff(0)),
        VcpuExit::InternalError => Some(StopReason::VmmError(
            "KVM internal error (instruction emulation failed)".into(),
        )),
        VcpuExit::FailEntry(reason, _) => Some(StopReason::VmmError(format!(
            "KVM entry failed, hardware reason {reason:#x}"
        ))),
        VcpuExit::Intr | VcpuExit::IrqWindowOpen => None,
        other => Some(StopReason::VmmError(format!(
            "unexpected vCPU exit {other:?}"
        ))),
    }
}

fn run_loop(
    mut vcpu: Vcpu,
    ctx: VcpuContext,
    pause: Arc<AtomicBool>,
    commands: Receiver<Command>,
    responses: Sender<Response>,
    home: Option<CpuSet>,
) -> Vcpu {
    // Whoever started or resumed this vCPU may still be answering for it.
    settle_after_wake(home.as_ref());
    // Whether the guest ran since the vCPU last parked (a restore tells
    // the guest's clock itself).
    let mut ran = false;
    loop {
        if pause.load(Ordering::SeqCst) {
            if responses.send(Response::Paused).is_err() {
                // The handle gave up waiting for this thread to end and is
                // gone: the commands left end the thread.
            }
            if std::mem::take(&mut ran) {
                // The guest's clock jumps by the paused time when it
                // resumes: without this, a pause longer than its kernel's
                // stall timeouts reads as a stuck CPU (an RCU stall report).
                vcpu.tell_clock_stopped();
            }
            loop {
                match commands.recv() {
                    // The flag says whether to run: a pause may have
                    // come after this resume.
                    Ok(Command::Resume) => {
                        settle_after_wake(home.as_ref());
                        break;
                    }
                    Ok(Command::SaveState) => {
                        let answer = match vcpu.save_state() {
                            Ok(state) => Response::State(Box::new(state)),
                            Err(e) => Response::Error(e.to_string()),
                        };
                        if responses.send(answer).is_err() {
                            // The handle gave up on this thread: nobody waits.
                        }
                    }
                    Ok(Command::Exit) | Err(_) => return vcpu,
                }
            }
        }
        ran = true;
        let stop = match vcpu.fd.run() {
            Ok(exit) => handle_exit(exit, &ctx),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => None,
            Err(e) => Some(StopReason::VmmError(format!("KVM_RUN failed: {e}"))),
        };
        if let Some(reason) = stop {
            ctx.stop.stop(reason);
            // Park until the VMM decides; never run a stopped guest again.
            pause.store(true, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvmclock_is_enabled_by_bit_0_of_either_system_time_msr() {
        let with = |msrs: &[(u32, u64)]| VcpuState {
            msrs: msrs
                .iter()
                .map(|&(index, data)| kvm_msr_entry {
                    index,
                    data,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        assert!(with(&[]).kvmclock_enabled(), "not saved: taken as enabled");
        assert!(!with(&[
            (MSR_KVM_SYSTEM_TIME_NEW, 0x30_0000),
            (MSR_KVM_SYSTEM_TIME, 0)
        ])
        .kvmclock_enabled());
        assert!(with(&[(MSR_KVM_SYSTEM_TIME_NEW, 0x30_0001)]).kvmclock_enabled());
        assert!(
            with(&[(MSR_KVM_SYSTEM_TIME_NEW, 0), (MSR_KVM_SYSTEM_TIME, 0x1001)]).kvmclock_enabled()
        );
    }

    #[test]
    fn a_busy_tss_is_restored_as_the_vmcb_held_it_on_amd_only() {
        let mut saved = kvm_sregs::default();
        saved.tr.type_ = TSS_BUSY;
        saved.tr.limit = 0x206f;
        saved.cs.type_ = TSS_BUSY; // only TR is touched
        let amd = sregs_for_host(&saved, true);
        assert_eq!(amd.tr.type_, TSS_AVAILABLE);
        assert_eq!(amd.tr.limit, 0x206f);
        assert_eq!(amd.cs.type_, TSS_BUSY);
        assert_eq!(
            sregs_for_host(&saved, false).tr.type_,
            TSS_BUSY,
            "Intel: as saved"
        );
        saved.tr.type_ = 3; // a 16-bit busy TSS: no 64-bit guest's, left alone
        assert_eq!(sregs_for_host(&saved, true).tr.type_, 3);
    }
}
