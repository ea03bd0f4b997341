//! Virtio-mmio device placement and the device event loop.
//!
//! Each device gets a 4 KiB MMIO window from [`VIRTIO_MMIO_START`] and one
//! legacy GSI from [`FIRST_DEVICE_GSI`], injected through an irqfd. Every
//! queue's QueueNotify write is caught by an ioeventfd (datamatch = queue
//! index), so vCPUs never run device code for notifications: one event-loop
//! thread serves queue notifications and each device's host-side file
//! descriptors (TAP, sockets), locking only the device it serves. The loop
//! is paused while a snapshot is taken, so no device writes guest memory
//! then.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use kvm_ioctls::IoEventAddress;
use serde::{Deserialize, Serialize};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arch::x86_64::layout::{
    FIRST_DEVICE_GSI, LAST_DEVICE_GSI, VIRTIO_MMIO_SIZE, VIRTIO_MMIO_START,
};
use crate::devices::bus::{Bus, BusError};
use crate::devices::virtio::block::{Block, BlockConfig, BlockConstructorArgs};
use crate::devices::virtio::mmio::{
    MmioTransport, MmioTransportConstructorArgs, MmioTransportState, MMIO_QUEUE_NOTIFY_OFFSET,
};
use crate::devices::virtio::net::{Net, NetConstructorArgs, Tap};
use crate::devices::virtio::persist::VirtioDeviceState;
use crate::devices::virtio::rng::{Rng, RngConstructorArgs};
use crate::devices::virtio::vsock::{Vsock, VsockConstructorArgs};
use crate::devices::virtio::{IrqTrigger, VirtioDevice};
use crate::snapshot::Persist;
use crate::spare_thread::{SpareThread, Worker};
use crate::vstate::memory::GuestMemoryMmap;
use crate::vstate::vm::Vm;

/// A disk for virtio-blk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriveConfig {
    /// Raw disk image.
    pub path: PathBuf,
    /// Expose it read-only.
    #[serde(default)]
    pub read_only: bool,
}

/// A virtio-net card on a TAP device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    /// TAP interface name (created if missing).
    pub tap: String,
    /// Guest MAC address.
    pub mac: [u8; 6],
}

/// A virtio-vsock device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockConfig {
    /// Guest CID (3 or more).
    pub guest_cid: u64,
    /// Host Unix socket (Firecracker's hybrid vsock convention).
    pub uds_path: PathBuf,
}

/// The devices of a VM.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceConfigs {
    /// Disks, in order (`/dev/vda`, `/dev/vdb`, ...).
    #[serde(default)]
    pub drives: Vec<DriveConfig>,
    /// Network cards.
    #[serde(default)]
    pub nets: Vec<NetConfig>,
    /// The vsock device.
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    /// An entropy device.
    #[serde(default)]
    pub rng: bool,
}

/// Host resources that may differ for a restored VM.
#[derive(Debug, Clone, Default)]
pub struct RestoreOverrides {
    /// Listen on this vsock socket instead of the snapshot's.
    pub vsock_uds: Option<PathBuf>,
    /// TAP names by device id (`net0`, ...), instead of the snapshot's.
    pub taps: HashMap<String, String>,
    /// Disk images by device id (`drive0`, ...), instead of the snapshot's
    /// (a fork uses its own copy-on-write disk).
    pub drives: HashMap<String, PathBuf>,
}

/// Errors from attaching, restoring or running devices.
#[derive(Debug, thiserror::Error)]
pub enum DeviceManagerError {
    /// No MMIO window or GSI left.
    #[error("too many virtio devices (at most {max})", max = LAST_DEVICE_GSI - FIRST_DEVICE_GSI + 1)]
    TooMany,
    /// Creating a device failed.
    #[error("cannot create device {id}: {message}")]
    Device {
        /// Device id.
        id: String,
        /// Why.
        message: String,
    },
    /// A KVM registration failed.
    #[error("cannot register {what} for device {id}")]
    Kvm {
        /// Device id.
        id: String,
        /// irqfd or ioeventfd.
        what: &'static str,
        /// Why.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Bus placement failed.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// Host I/O failed (eventfd, epoll, thread).
    #[error("{0}")]
    Io(&'static str, #[source] std::io::Error),
}

/// Saved state of one device: placement, transport registers, device.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MmioDeviceState {
    /// Device id (`drive0`, `net0`, `vsock`, `rng`).
    pub id: String,
    /// MMIO window base.
    pub base: u64,
    /// GSI.
    pub gsi: u32,
    /// Transport registers.
    pub transport: MmioTransportState,
    /// The device's own state.
    pub device: VirtioDeviceState,
}

struct MmioDevice {
    id: String,
    base: u64,
    gsi: u32,
    transport: Arc<Mutex<MmioTransport>>,
    queue_events: Vec<Arc<EventFd>>,
}

/// The VM's virtio devices and their event loop.
#[derive(Default)]
pub struct DeviceManager {
    devices: Vec<MmioDevice>,
    event_loop: Option<EventLoopHandle>,
}

fn dev_err(id: &str, e: impl std::fmt::Display) -> DeviceManagerError {
    DeviceManagerError::Device {
        id: id.to_string(),
        message: e.to_string(),
    }
}

impl DeviceManager {
    /// No devices.
    pub fn new() -> Self {
        Self::default()
    }

    /// Creates the devices of `configs` and attaches them.
    pub fn create(
        vm: &Vm,
        mmio: &mut Bus,
        mem: &GuestMemoryMmap,
        configs: &DeviceConfigs,
    ) -> Result<Self, DeviceManagerError> {
        let mut manager = Self::new();
        for (i, drive) in configs.drives.iter().enumerate() {
            let id = format!("drive{i}");
            let block = Block::open(BlockConfig {
                path: drive.path.clone(),
                read_only: drive.read_only,
                serial: id.clone(),
            })
            .map_err(|e| dev_err(&id, error_chain(&e)))?;
            manager.attach(vm, mmio, mem, id, Box::new(block))?;
        }
        for (i, net) in configs.nets.iter().enumerate() {
            let id = format!("net{i}");
            let device =
                Net::with_tap(&net.tap, net.mac).map_err(|e| dev_err(&id, error_chain(&e)))?;
            manager.attach(vm, mmio, mem, id, Box::new(device))?;
        }
        if let Some(vsock) = &configs.vsock {
            let device = Vsock::new(vsock.guest_cid, vsock.uds_path.clone())
                .map_err(|e| dev_err("vsock", error_chain(&e)))?;
            manager.attach(vm, mmio, mem, "vsock".into(), Box::new(device))?;
        }
        if configs.rng {
            manager.attach(vm, mmio, mem, "rng".into(), Box::new(Rng::new()))?;
        }
        Ok(manager)
    }

    fn next_slot(&self) -> Result<(u64, u32), DeviceManagerError> {
        let index = self.devices.len() as u32;
        let gsi = FIRST_DEVICE_GSI + index;
        if gsi > LAST_DEVICE_GSI {
            return Err(DeviceManagerError::TooMany);
        }
        Ok((VIRTIO_MMIO_START + u64::from(index) * VIRTIO_MMIO_SIZE, gsi))
    }

    /// Attaches `device` at the next free window and GSI.
    pub fn attach(
        &mut self,
        vm: &Vm,
        mmio: &mut Bus,
        mem: &GuestMemoryMmap,
        id: String,
        device: Box<dyn VirtioDevice>,
    ) -> Result<(), DeviceManagerError> {
        let (base, gsi) = self.next_slot()?;
        let transport = MmioTransport::new(mem.clone(), device)
            .map_err(|e| DeviceManagerError::Io("interrupt eventfd", e))?;
        self.register(vm, mmio, id, base, gsi, transport)
    }

    fn register(
        &mut self,
        vm: &Vm,
        mmio: &mut Bus,
        id: String,
        base: u64,
        gsi: u32,
        transport: MmioTransport,
    ) -> Result<(), DeviceManagerError> {
        let kvm_err = |what| {
            let id = id.clone();
            move |source| DeviceManagerError::Kvm { id, what, source }
        };
        vm.fd
            .register_irqfd(transport.interrupt().event(), gsi)
            .map_err(kvm_err("irqfd"))?;
        let queues = transport.device().common().queues.len();
        let mut queue_events = Vec::with_capacity(queues);
        for index in 0..queues {
            let event = EventFd::new(EFD_NONBLOCK)
                .map_err(|e| DeviceManagerError::Io("queue eventfd", e))?;
            vm.fd
                .register_ioevent(
                    &event,
                    &IoEventAddress::Mmio(base + MMIO_QUEUE_NOTIFY_OFFSET),
                    index as u32,
                )
                .map_err(kvm_err("ioeventfd"))?;
            queue_events.push(Arc::new(event));
        }
        let transport = Arc::new(Mutex::new(transport));
        mmio.insert(transport.clone(), base, VIRTIO_MMIO_SIZE)?;
        self.devices.push(MmioDevice {
            id,
            base,
            gsi,
            transport,
            queue_events,
        });
        Ok(())
    }

    /// Kernel command-line entries declaring the devices
    /// (`virtio_mmio.device=4K@0x...:GSI`).
    pub fn cmdline_entries(&self) -> String {
        self.devices
            .iter()
            .map(|d| format!(" virtio_mmio.device=4K@{:#x}:{}", d.base, d.gsi))
            .collect()
    }

    /// Starts the event loop thread.
    pub fn start(&mut self, spare: Option<SpareThread>) -> Result<(), DeviceManagerError> {
        if self.event_loop.is_none() {
            self.event_loop = Some(EventLoopHandle::start(&self.devices, spare)?);
        }
        Ok(())
    }

    /// Parks the event loop (no device touches guest memory until resume).
    pub fn pause(&self) {
        if let Some(event_loop) = &self.event_loop {
            event_loop.request(LoopCommand::Pause);
        }
    }

    /// Lets the event loop run again.
    pub fn resume(&self) {
        if let Some(event_loop) = &self.event_loop {
            event_loop.request(LoopCommand::Resume);
        }
    }

    /// Serves the block device `id` from the image at `path` (see
    /// [`Block::switch_disk`]). The vCPUs and the event loop must be
    /// paused.
    pub fn switch_disk(&self, id: &str, path: &std::path::Path) -> Result<(), DeviceManagerError> {
        let device = self
            .devices
            .iter()
            .find(|d| d.id == id)
            .ok_or_else(|| dev_err(id, "no such device"))?;
        let mut transport = device.transport.lock().unwrap_or_else(|p| p.into_inner());
        let block = transport
            .device_mut()
            .as_any_mut()
            .downcast_mut::<Block>()
            .ok_or_else(|| dev_err(id, "not a block device"))?;
        block
            .switch_disk(path)
            .map_err(|e| dev_err(id, error_chain(&e)))
    }

    /// Tells the vsock device that its socket file was moved to `path`
    /// (see [`Vsock::set_uds_path`]); an error when the VM has none.
    pub fn set_vsock_path(&self, path: &std::path::Path) -> Result<(), DeviceManagerError> {
        for device in &self.devices {
            let mut transport = device.transport.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(vsock) = transport.device_mut().as_any_mut().downcast_mut::<Vsock>() {
                vsock.set_uds_path(path.to_path_buf());
                return Ok(());
            }
        }
        Err(dev_err("vsock", "the VM has no vsock device"))
    }

    /// Saves every device. The vCPUs and the event loop must be paused.
    pub fn save(&self) -> Vec<MmioDeviceState> {
        self.devices
            .iter()
            .map(|d| {
                let mut transport = d.transport.lock().unwrap_or_else(|p| p.into_inner());
                transport.device_mut().prepare_snapshot();
                MmioDeviceState {
                    id: d.id.clone(),
                    base: d.base,
                    gsi: d.gsi,
                    transport: transport.save(),
                    device: transport.device().save(),
                }
            })
            .collect()
    }

    /// Rebuilds the devices of a snapshot, at their saved windows and GSIs.
    pub fn restore(
        vm: &Vm,
        mmio: &mut Bus,
        mem: &GuestMemoryMmap,
        states: &[MmioDeviceState],
        overrides: &RestoreOverrides,
    ) -> Result<Self, DeviceManagerError> {
        let mut manager = Self::new();
        for state in states {
            let id = state.id.as_str();
            let interrupt = Arc::new(
                IrqTrigger::new().map_err(|e| DeviceManagerError::Io("interrupt eventfd", e))?,
            );
            let device: Box<dyn VirtioDevice> = match &state.device {
                VirtioDeviceState::Rng(s) => Box::new(
                    Rng::restore(
                        RngConstructorArgs {
                            mem: mem.clone(),
                            interrupt: interrupt.clone(),
                        },
                        s,
                    )
                    .map_err(|e| dev_err(id, error_chain(&e)))?,
                ),
                VirtioDeviceState::Block(s) => {
                    let path = overrides.drives.get(id).unwrap_or(&s.disk.path);
                    let backend = tine_disk::open_disk(path, s.disk.read_only)
                        .map_err(|e| dev_err(id, error_chain(&e)))?;
                    Box::new(
                        Block::restore(
                            BlockConstructorArgs {
                                mem: mem.clone(),
                                interrupt: interrupt.clone(),
                                backend,
                                path: Some(path.clone()),
                            },
                            s,
                        )
                        .map_err(|e| dev_err(id, error_chain(&e)))?,
                    )
                }
                VirtioDeviceState::Net(s) => {
                    let name = overrides.taps.get(id).unwrap_or(&s.tap_name);
                    let tap = Tap::open(name).map_err(|e| dev_err(id, error_chain(&e)))?;
                    Box::new(
                        Net::restore(
                            NetConstructorArgs {
                                backend: Box::new(tap),
                                mem: mem.clone(),
                                interrupt: interrupt.clone(),
                            },
                            s,
                        )
                        .map_err(|e| dev_err(id, error_chain(&e)))?,
                    )
                }
                VirtioDeviceState::Vsock(s) => {
                    let mut device = Vsock::restore(
                        VsockConstructorArgs {
                            uds_path: overrides.vsock_uds.clone(),
                        },
                        s,
                    )
                    .map_err(|e| dev_err(id, error_chain(&e)))?;
                    if s.common.activated {
                        device
                            .activate(mem.clone(), interrupt.clone())
                            .map_err(|e| dev_err(id, error_chain(&e)))?;
                    }
                    Box::new(device)
                }
                #[cfg(test)]
                VirtioDeviceState::Test => return Err(dev_err(id, "test device state")),
            };
            let transport = MmioTransport::restore(
                MmioTransportConstructorArgs {
                    mem: mem.clone(),
                    device,
                },
                &state.transport,
            )
            .map_err(|e| dev_err(id, error_chain(&e)))?;
            manager.register(vm, mmio, state.id.clone(), state.base, state.gsi, transport)?;
        }
        Ok(manager)
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// True when there are no devices.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

impl Drop for DeviceManager {
    fn drop(&mut self) {
        if let Some(event_loop) = self.event_loop.take() {
            event_loop.stop();
        }
    }
}

/// `e` and its sources, joined with ": ".
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The name of the device event loop's thread.
pub fn event_loop_thread_name() -> String {
    "devices".into()
}

enum LoopCommand {
    Pause,
    Resume,
    Stop,
}

struct EventLoopHandle {
    commands: Sender<LoopCommand>,
    acks: Receiver<()>,
    wake: Arc<EventFd>,
    thread: Option<Worker<()>>,
}

const TOKEN_CONTROL: u64 = u64::MAX;
const KIND_QUEUE: u64 = 1 << 62;
const KIND_HOST: u64 = 2 << 62;
const KIND_MASK: u64 = 3 << 62;

fn queue_token(device: usize, queue: usize) -> u64 {
    KIND_QUEUE | ((device as u64) << 16) | queue as u64
}

fn host_token(device: usize, fd: RawFd) -> u64 {
    KIND_HOST | ((device as u64) << 32) | (fd as u32 as u64)
}

/// A device as the event loop sees it: its transport and queue eventfds.
type LoopDevice = (Arc<Mutex<MmioTransport>>, Vec<Arc<EventFd>>);

struct EventLoop {
    epoll: Epoll,
    devices: Vec<LoopDevice>,
    /// Host fds registered per device, with their events.
    registered: Vec<HashMap<RawFd, u32>>,
    wake: Arc<EventFd>,
    commands: Receiver<LoopCommand>,
    acks: Sender<()>,
}

impl EventLoopHandle {
    fn start(
        devices: &[MmioDevice],
        spare: Option<SpareThread>,
    ) -> Result<Self, DeviceManagerError> {
        let epoll = Epoll::new().map_err(|e| DeviceManagerError::Io("epoll", e))?;
        let wake =
            Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| DeviceManagerError::Io("eventfd", e))?);
        epoll
            .ctl(
                ControlOperation::Add,
                wake.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_CONTROL),
            )
            .map_err(|e| DeviceManagerError::Io("epoll add", e))?;
        for (d, device) in devices.iter().enumerate() {
            for (q, event) in device.queue_events.iter().enumerate() {
                epoll
                    .ctl(
                        ControlOperation::Add,
                        event.as_raw_fd(),
                        EpollEvent::new(EventSet::IN, queue_token(d, q)),
                    )
                    .map_err(|e| DeviceManagerError::Io("epoll add", e))?;
            }
        }
        let (cmd_tx, cmd_rx) = channel();
        let (ack_tx, ack_rx) = channel();
        let mut event_loop = EventLoop {
            epoll,
            devices: devices
                .iter()
                .map(|d| (d.transport.clone(), d.queue_events.clone()))
                .collect(),
            registered: vec![HashMap::new(); devices.len()],
            wake: wake.clone(),
            commands: cmd_rx,
            acks: ack_tx,
        };
        for d in 0..devices.len() {
            event_loop.sync_host_fds(d);
        }
        let thread = SpareThread::given_or_new(spare, event_loop_thread_name)
            .and_then(|thread| thread.run(move || event_loop.run()))
            .map_err(|e| DeviceManagerError::Io("event loop thread", e))?;
        Ok(Self {
            commands: cmd_tx,
            acks: ack_rx,
            wake,
            thread: Some(thread),
        })
    }

    /// Sends `command` to the loop. A pause is waited for (once it returns
    /// no device touches guest memory); a resume is not (nothing waits on
    /// it, and a fork's resume is on its path).
    fn request(&self, command: LoopCommand) {
        let acknowledged = matches!(command, LoopCommand::Pause);
        if self.commands.send(command).is_ok() {
            if let Err(e) = self.wake.write(1) {
                eprintln!("cannot wake the device event loop: {e}");
            }
            if acknowledged {
                if let Err(e) = self.acks.recv_timeout(Duration::from_secs(5)) {
                    eprintln!("the device event loop did not take a request: {e}");
                }
            }
        }
    }

    fn stop(mut self) {
        if self.commands.send(LoopCommand::Stop).is_err() {
            eprintln!("tine-vmm: the device event loop had ended before its stop");
        }
        if let Err(e) = self.wake.write(1) {
            eprintln!("tine-vmm: cannot wake the device event loop to stop it: {e}");
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_none() {
                eprintln!("the device event loop ended in a panic");
            }
        }
    }
}

impl EventLoop {
    fn run(mut self) {
        let mut events = vec![EpollEvent::default(); 64];
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            for event in &events[..n] {
                let token = event.data();
                if token == TOKEN_CONTROL {
                    if let Err(e) = self.wake.read() {
                        // Left unread, it wakes the loop at every turn: said once.
                        static SAID: Once = Once::new();
                        SAID.call_once(|| {
                            eprintln!("tine-vmm: cannot reset the device event loop's wake-up: {e} (not said again)");
                        });
                    }
                    if !self.handle_commands() {
                        return;
                    }
                    continue;
                }
                match token & KIND_MASK {
                    KIND_QUEUE => {
                        let d = ((token >> 16) & 0xffff) as usize;
                        let q = (token & 0xffff) as usize;
                        self.queue_event(d, q);
                    }
                    KIND_HOST => {
                        let d = ((token & !KIND_MASK) >> 32) as usize;
                        let fd = (token & 0xffff_ffff) as u32 as RawFd;
                        self.host_event(d, fd, event.events());
                    }
                    _ => {}
                }
            }
        }
    }

    /// Handles queued commands; false when the loop must end.
    fn handle_commands(&mut self) -> bool {
        while let Ok(command) = self.commands.try_recv() {
            match command {
                LoopCommand::Stop => return false,
                LoopCommand::Resume => {}
                LoopCommand::Pause => {
                    if self.acks.send(()).is_err() {
                        // The handle is gone: nobody waits, and the wait
                        // below ends the loop.
                    }
                    // Parked: wait for Resume or Stop.
                    loop {
                        match self.commands.recv() {
                            Ok(LoopCommand::Resume) => break,
                            Ok(LoopCommand::Pause) => {
                                if self.acks.send(()).is_err() {
                                    // The handle is gone: nobody waits.
                                }
                            }
                            Ok(LoopCommand::Stop) | Err(_) => return false,
                        }
                    }
                    // Host fds may have changed while paused (snapshot).
                    for d in 0..self.devices.len() {
                        self.sync_host_fds(d);
                    }
                }
            }
        }
        true
    }

    fn queue_event(&mut self, d: usize, q: usize) {
        let Some((transport, events)) = self.devices.get(d) else {
            return;
        };
        if let Some(event) = events.get(q) {
            if let Err(e) = event.read() {
                // The guest notifies at will: said once.
                static SAID: Once = Once::new();
                SAID.call_once(|| {
                    eprintln!("tine-vmm: device {d}: cannot reset queue {q}'s notification: {e} (not said again)");
                });
            }
        }
        {
            let mut transport = transport.lock().unwrap_or_else(|p| p.into_inner());
            if transport.is_activated() {
                transport.device_mut().process_queue(q);
            }
        }
        self.sync_host_fds(d);
    }

    fn host_event(&mut self, d: usize, fd: RawFd, events: u32) {
        let Some((transport, _)) = self.devices.get(d) else {
            return;
        };
        {
            let mut transport = transport.lock().unwrap_or_else(|p| p.into_inner());
            transport.device_mut().process_host_event(fd, events);
        }
        self.sync_host_fds(d);
    }

    /// Makes epoll watch exactly the host fds device `d` asks for. A closed
    /// fd leaves epoll by itself, and its number may come back as a new
    /// socket, so every wanted fd is (re)registered.
    fn sync_host_fds(&mut self, d: usize) {
        let Some((transport, _)) = self.devices.get(d) else {
            return;
        };
        let wanted: HashMap<RawFd, u32> = {
            let transport = transport.lock().unwrap_or_else(|p| p.into_inner());
            transport.device().host_fds().into_iter().collect()
        };
        let Some(registered) = self.registered.get_mut(d) else {
            return;
        };
        for (&fd, _) in registered.iter() {
            if !wanted.contains_key(&fd) {
                let deleted = self
                    .epoll
                    .ctl(ControlOperation::Delete, fd, EpollEvent::default());
                if let Err(e) = deleted {
                    // A closed fd has left epoll by itself (EBADF), and its
                    // number may now name one never added (ENOENT).
                    if !matches!(e.raw_os_error(), Some(libc::EBADF | libc::ENOENT)) {
                        eprintln!("tine-vmm: device {d}: cannot stop watching its host descriptor {fd}: {e}");
                    }
                }
            }
        }
        for (&fd, &events) in &wanted {
            let event = EpollEvent::new(EventSet::from_bits_truncate(events), host_token(d, fd));
            if self.epoll.ctl(ControlOperation::Modify, fd, event).is_err() {
                if let Err(e) = self.epoll.ctl(ControlOperation::Add, fd, event) {
                    // The device will not hear from this descriptor.
                    eprintln!("device {d}: cannot watch its host descriptor {fd}: {e}");
                }
            }
        }
        *registered = wanted;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_tokens_round_trip() {
        let t = queue_token(3, 2);
        assert_eq!(t & KIND_MASK, KIND_QUEUE);
        assert_eq!((t >> 16) & 0xffff, 3);
        assert_eq!(t & 0xffff, 2);
        let h = host_token(5, 1234);
        assert_eq!(h & KIND_MASK, KIND_HOST);
        assert_eq!((h & !KIND_MASK) >> 32, 5);
        assert_eq!(h & 0xffff_ffff, 1234);
    }

    #[test]
    fn test_error_chain_joins_sources() {
        let inner = std::io::Error::other("disk gone");
        let outer = DeviceManagerError::Io("read", inner);
        assert_eq!(error_chain(&outer), "read: disk gone");
    }
}
