//! `tine-vmm`: runs one microVM in this process.
//!
//! Boot:     tine-vmm --kernel K [--initramfs I] [--cmdline C] [--mem-mib M] [--vcpus N]
//! Restore:  tine-vmm --restore STATE --mem-file MEM
//! Warm:     tine-vmm --prestart --vcpus N [--mem-mib M] --control-socket S
//!           (creates the VM, vCPUs and, with --mem-mib, registered guest RAM,
//!           then waits for a restore request for a snapshot of that size)
//!
//! With `--control-socket`, requests arrive as JSON lines (docs/vmm-control.md).
//! When the VM stops, one JSON line `{"event":"stopped",...}` is printed on
//! stdout and the process exits 0 (guest poweroff/reboot) or 1 (anything else).
//! Requests, responses and events are the types of `tine_proto::vmm`.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use std::collections::HashMap;

use tine_proto::vmm::{Event, Request, Response, StopReason};
use tine_vmm::device_manager::{
    DeviceConfigs, DriveConfig, NetConfig, RestoreOverrides, VsockConfig,
};
use tine_vmm::vmm::{
    validate, BootConfig, ConsoleConfig, PreparedVm, Vmm, VmmError, DEFAULT_CMDLINE,
};

/// Guest RAM of a boot without `--mem-mib`.
const DEFAULT_MEM_MIB: u64 = 256;

#[derive(Parser, Debug)]
#[command(name = "tine-vmm", version, about = "Run one tine microVM")]
struct Args {
    /// Kernel: vmlinux (ELF) or bzImage.
    #[arg(long, conflicts_with_all = ["restore", "prestart"])]
    kernel: Option<PathBuf>,
    /// Initramfs (newc cpio, optionally compressed).
    #[arg(long)]
    initramfs: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long, default_value = DEFAULT_CMDLINE)]
    cmdline: String,
    /// Guest RAM in MiB (256 for a boot). With `--prestart`, the RAM to
    /// reserve and register ahead of the restore (a snapshot of that size).
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Restore from this state file.
    #[arg(long, requires = "mem_file")]
    restore: Option<PathBuf>,
    /// Memory file to restore from (mapped copy-on-write).
    #[arg(long)]
    mem_file: Option<PathBuf>,
    /// Keep a restored VM paused.
    #[arg(long)]
    paused: bool,
    /// Create the VM and vCPUs, then wait for a restore request.
    #[arg(long, requires = "control_socket")]
    prestart: bool,
    /// Control socket path (created; removed on exit).
    #[arg(long)]
    control_socket: Option<PathBuf>,
    /// Serial console log file.
    #[arg(long)]
    serial_log: Option<PathBuf>,
    /// Byte limit of the serial log.
    #[arg(long)]
    serial_log_limit: Option<u64>,
    /// Copy the serial console to stdout.
    #[arg(long)]
    serial_stdout: bool,
    /// A virtio-blk disk, raw or qcow2 (told apart by the file's first
    /// bytes): PATH or PATH,ro (repeatable; /dev/vda, /dev/vdb...).
    #[arg(long = "drive", value_name = "PATH[,ro]")]
    drives: Vec<String>,
    /// A virtio-net card on a TAP device: TAP,MAC (repeatable).
    #[arg(long = "net", value_name = "TAP,MAC")]
    nets: Vec<String>,
    /// A virtio-vsock device: CID,UDS_PATH.
    #[arg(long, value_name = "CID,UDS_PATH")]
    vsock: Option<String>,
    /// A virtio-rng entropy device.
    #[arg(long)]
    rng: bool,
    /// On restore: listen for vsock on this socket instead of the snapshot's.
    #[arg(long, value_name = "UDS_PATH")]
    vsock_uds: Option<PathBuf>,
    /// On restore: use this TAP for a net device: ID=TAP (e.g. net0=tap7).
    #[arg(long = "tap-override", value_name = "ID=TAP")]
    tap_overrides: Vec<String>,
    /// On restore: use this disk image for a drive: ID=PATH (e.g. drive0=/x).
    #[arg(long = "drive-override", value_name = "ID=PATH")]
    drive_overrides: Vec<String>,
}

fn parse_mac(text: &str) -> anyhow::Result<[u8; 6]> {
    let parts: Vec<&str> = text.split(':').collect();
    if parts.len() != 6 {
        bail!("MAC address '{text}' must have six ':'-separated bytes");
    }
    let mut mac = [0u8; 6];
    for (slot, part) in mac.iter_mut().zip(parts) {
        *slot = u8::from_str_radix(part, 16)
            .with_context(|| format!("MAC address '{text}': '{part}' is not a hex byte"))?;
    }
    Ok(mac)
}

fn device_configs(args: &Args) -> anyhow::Result<DeviceConfigs> {
    let mut configs = DeviceConfigs {
        rng: args.rng,
        ..Default::default()
    };
    for drive in &args.drives {
        let (path, read_only) = match drive.strip_suffix(",ro") {
            Some(path) => (path, true),
            None => (drive.as_str(), false),
        };
        if path.contains(',') {
            bail!("--drive '{drive}': only ',ro' may follow the path");
        }
        configs.drives.push(DriveConfig {
            path: PathBuf::from(path),
            read_only,
        });
    }
    for net in &args.nets {
        let Some((tap, mac)) = net.split_once(',') else {
            bail!("--net '{net}' must be TAP,MAC");
        };
        configs.nets.push(NetConfig {
            tap: tap.to_string(),
            mac: parse_mac(mac)?,
        });
    }
    if let Some(vsock) = &args.vsock {
        let Some((cid, uds)) = vsock.split_once(',') else {
            bail!("--vsock '{vsock}' must be CID,UDS_PATH");
        };
        configs.vsock = Some(VsockConfig {
            guest_cid: cid
                .parse()
                .with_context(|| format!("--vsock: CID '{cid}' is not a number"))?,
            uds_path: PathBuf::from(uds),
        });
    }
    Ok(configs)
}

fn pairs(list: &[String], flag: &str) -> anyhow::Result<HashMap<String, String>> {
    list.iter()
        .map(|item| {
            item.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .with_context(|| format!("{flag} '{item}' must be ID=VALUE"))
        })
        .collect()
}

fn overrides(args: &Args) -> anyhow::Result<RestoreOverrides> {
    Ok(RestoreOverrides {
        vsock_uds: args.vsock_uds.clone(),
        taps: pairs(&args.tap_overrides, "--tap-override")?,
        drives: pairs(&args.drive_overrides, "--drive-override")?
            .into_iter()
            .map(|(k, v)| (k, PathBuf::from(v)))
            .collect(),
    })
}

enum Machine {
    Prepared(Option<PreparedVm>),
    Live(Box<Vmm>),
}

fn respond(stream: &mut UnixStream, response: &Response) {
    match serde_json::to_string(response) {
        Ok(mut line) => {
            line.push('\n');
            if let Err(e) = stream.write_all(line.as_bytes()) {
                eprintln!("cannot answer on the control socket: {e}");
            }
        }
        Err(e) => eprintln!("cannot encode {response:?}: {e}"),
    }
}

/// Removes a socket file left by an earlier process (or this one's, at
/// exit); one that is not there is fine.
fn remove_socket(path: &std::path::Path) {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            eprintln!("cannot remove {}: {e}", path.display())
        }
        _ => {}
    }
}

fn ok(vmm: Option<&Vmm>, start: Instant) -> Response {
    Response::Ok {
        state: vmm.map(Vmm::run_state),
        snapshot: None,
        stop_reason: vmm.and_then(|v| v.stop_signal().reason()),
        write_set_bytes: None,
        duration_us: start.elapsed().as_micros() as u64,
    }
}

/// [`ok`], with the bytes a write set covers.
fn ok_write_set(vmm: &Vmm, start: Instant, bytes: u64) -> Response {
    Response::Ok {
        state: Some(vmm.run_state()),
        snapshot: None,
        stop_reason: vmm.stop_signal().reason(),
        write_set_bytes: Some(bytes),
        duration_us: start.elapsed().as_micros() as u64,
    }
}

fn error(e: impl std::fmt::Display) -> Response {
    Response::Error {
        error: e.to_string(),
    }
}

fn error_of(e: &dyn std::error::Error) -> Response {
    Response::Error {
        error: tine_vmm::device_manager::error_chain(e),
    }
}

/// The answer to a request that changes `vmm` and reports nothing else.
fn answer(vmm: &Vmm, start: Instant, done: Result<(), VmmError>) -> Response {
    match done {
        Ok(()) => ok(Some(vmm), start),
        Err(e) => error_of(&e),
    }
}

/// Handles one request; returns true when the process should exit.
fn handle(
    machine: &mut Machine,
    request: Request,
    console: &ConsoleConfig,
    overrides: &RestoreOverrides,
) -> (Response, bool) {
    let start = Instant::now();
    match (request, machine) {
        (Request::Kill, Machine::Live(vmm)) => {
            vmm.kill();
            (ok(Some(vmm), start), true)
        }
        (Request::Kill, Machine::Prepared(_)) => (ok(None, start), true),
        (
            Request::Restore {
                state_path,
                mem_path,
                paused,
                vsock_uds,
                drives,
                taps,
                serial_log,
            },
            machine @ Machine::Prepared(_),
        ) => {
            let Machine::Prepared(prepared) = machine else {
                return (error("internal: not prepared"), false);
            };
            // The request's overrides win over the command line's.
            let mut overrides = overrides.clone();
            if vsock_uds.is_some() {
                overrides.vsock_uds = vsock_uds;
            }
            overrides.drives.extend(drives);
            overrides.taps.extend(taps);
            let console = ConsoleConfig {
                log_path: serial_log.or_else(|| console.log_path.clone()),
                ..console.clone()
            };
            match Vmm::restore(
                &state_path,
                &mem_path,
                prepared.take(),
                &console,
                &overrides,
                paused,
            ) {
                Ok(vmm) => {
                    let response = ok(Some(&vmm), start);
                    *machine = Machine::Live(Box::new(vmm));
                    (response, false)
                }
                // The prepared VM was consumed by the failed attempt.
                Err(e) => (error_of(&e), true),
            }
        }
        (Request::Restore { .. }, Machine::Live(_)) => (
            error("this process already runs a VM; restore needs a --prestart process"),
            false,
        ),
        (_, Machine::Prepared(_)) => (error("no VM yet: send a restore request first"), false),
        (Request::Status, Machine::Live(vmm)) => (ok(Some(vmm), start), false),
        (Request::Shutdown, Machine::Live(vmm)) => {
            let done = vmm.request_shutdown();
            (answer(vmm, start, done), false)
        }
        (Request::Pause, Machine::Live(vmm)) => {
            let done = vmm.pause();
            (answer(vmm, start, done), false)
        }
        (Request::PauseHoldingClock, Machine::Live(vmm)) => {
            let done = vmm.pause_holding_clock();
            (answer(vmm, start, done), false)
        }
        (Request::SwitchDisk { drive, path }, Machine::Live(vmm)) => {
            let done = vmm.switch_disk(&drive, &path);
            (answer(vmm, start, done), false)
        }
        (Request::SaveWriteSet { path }, Machine::Live(vmm)) => match vmm.save_write_set(&path) {
            Ok(bytes) => (ok_write_set(vmm, start, bytes), false),
            Err(e) => (error_of(&e), false),
        },
        (Request::PopulateWriteSet { path }, Machine::Live(vmm)) => {
            match vmm.populate_write_set(&path) {
                Ok(bytes) => (ok_write_set(vmm, start, bytes), false),
                Err(e) => (error_of(&e), false),
            }
        }
        (Request::Resume { vsock_uds }, Machine::Live(vmm)) => {
            let moved = match &vsock_uds {
                Some(path) => vmm.set_vsock_path(path),
                None => Ok(()),
            };
            let done = moved.and_then(|()| vmm.resume());
            (answer(vmm, start, done), false)
        }
        (
            Request::Snapshot {
                state_path,
                mem_path,
            },
            Machine::Live(vmm),
        ) => match vmm.snapshot(&state_path, &mem_path) {
            Ok(info) => (
                Response::Ok {
                    state: Some(vmm.run_state()),
                    snapshot: Some(info),
                    stop_reason: None,
                    write_set_bytes: None,
                    duration_us: start.elapsed().as_micros() as u64,
                },
                false,
            ),
            Err(e) => (error_of(&e), false),
        },
    }
}

/// Prints `event` as one line on stdout, now.
fn print_event(event: &Event) {
    match serde_json::to_string(event) {
        Ok(line) => println!("{line}"),
        Err(e) => eprintln!("cannot encode {event:?}: {e}"),
    }
    if let Err(e) = std::io::stdout().flush() {
        eprintln!("cannot write an event to stdout: {e}");
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let console = ConsoleConfig {
        log_path: args.serial_log.clone(),
        log_limit: args.serial_log_limit,
        echo_stdout: args.serial_stdout,
    };

    let mut machine = if args.prestart {
        // With its RAM registered now, a restore only maps the memory file
        // over it: registering a memory slot is the slowest step of a
        // restore left (milliseconds for 64 MiB on a nested host).
        let prepared = match args.mem_mib {
            Some(mib) => PreparedVm::with_memory(args.vcpus, mib << 20),
            None => PreparedVm::new(args.vcpus),
        };
        let prepared = prepared.context("cannot pre-start the VM")?;
        tine_vmm::snapshot::format::warm_up();
        if let Err(e) = tine_vmm::prefault::ahead_of_restore() {
            eprintln!("tine-vmm: the pages of a restore are not mapped ahead: {e}");
        }
        Machine::Prepared(Some(prepared))
    } else if let Some(state) = &args.restore {
        let mem = args
            .mem_file
            .as_ref()
            .context("--restore needs --mem-file")?;
        Machine::Live(Box::new(
            Vmm::restore(state, mem, None, &console, &overrides(&args)?, args.paused)
                .context("restore failed")?,
        ))
    } else {
        let Some(kernel) = args.kernel.clone() else {
            bail!("nothing to run: give --kernel, --restore or --prestart");
        };
        let config = BootConfig {
            kernel,
            initramfs: args.initramfs.clone(),
            cmdline: args.cmdline.clone(),
            mem_mib: args.mem_mib.unwrap_or(DEFAULT_MEM_MIB),
            vcpus: args.vcpus,
            raw: None,
            devices: device_configs(&args)?,
        };
        validate(&config)?;
        Machine::Live(Box::new(
            Vmm::boot(&config, &console).context("boot failed")?,
        ))
    };

    let restore_overrides = overrides(&args)?;
    let listener = match &args.control_socket {
        Some(path) => {
            remove_socket(path);
            let listener = UnixListener::bind(path)
                .with_context(|| format!("cannot bind control socket {}", path.display()))?;
            listener.set_nonblocking(true)?;
            Some(listener)
        }
        None => None,
    };
    // Ready line: supervisors wait for it before sending requests.
    print_event(&Event::Ready {
        pid: std::process::id(),
    });

    let mut clients: Vec<BufReader<UnixStream>> = Vec::new();
    let reason = loop {
        if let Machine::Live(vmm) = &mut machine {
            if let Some(reason) = vmm.stop_signal().reason() {
                vmm.kill();
                break reason;
            }
        }
        let mut fds = Vec::new();
        if let Machine::Live(vmm) = &machine {
            fds.push(libc::pollfd {
                fd: vmm.stop_signal().event().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let listener_at = listener.as_ref().map(|l| {
            fds.push(libc::pollfd {
                fd: l.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            fds.len() - 1
        });
        let clients_at = fds.len();
        for c in &clients {
            fds.push(libc::pollfd {
                fd: c.get_ref().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        // Every event this loop serves has a descriptor here (the stop
        // signal's eventfd, the listener, the clients), so it sleeps until
        // one fires: an idle VMM never wakes (a host runs hundreds). A
        // client that sent several requests at once has the next one read
        // already: the loop does not sleep then.
        let buffered: Vec<bool> = clients.iter().map(|c| !c.buffer().is_empty()).collect();
        let timeout = if buffered.contains(&true) { 0 } else { -1 };
        // SAFETY: `fds` is a valid, correctly sized array of pollfd.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                eprintln!("tine-vmm: poll: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            continue;
        }
        let mut readable: Vec<bool> = fds[clients_at..]
            .iter()
            .zip(buffered)
            .map(|(f, buffered)| f.revents != 0 || buffered)
            .collect();
        let connecting = listener
            .as_ref()
            .zip(listener_at)
            .filter(|(_, at)| fds[*at].revents != 0);
        if let Some((l, _)) = connecting {
            while let Ok((stream, _)) = l.accept() {
                // A client whose requests cannot be read without blocking
                // the VMM's loop is not served.
                let blocking = stream.set_nonblocking(false).and_then(|()| {
                    stream.set_read_timeout(Some(std::time::Duration::from_millis(1)))
                });
                match blocking {
                    // Its first request may be there already.
                    Ok(()) => {
                        clients.push(BufReader::new(stream));
                        readable.push(true);
                    }
                    Err(e) => eprintln!("control socket client dropped: {e}"),
                }
            }
        }
        let mut exit = false;
        let mut keep = Vec::new();
        for (mut client, readable) in clients.drain(..).zip(readable) {
            if !readable {
                keep.push(client);
                continue;
            }
            let mut line = String::new();
            match client.read_line(&mut line) {
                Ok(0) => continue, // closed
                Ok(_) => {
                    let response = match serde_json::from_str::<Request>(line.trim()) {
                        Ok(request) => {
                            let (response, quit) =
                                handle(&mut machine, request, &console, &restore_overrides);
                            exit |= quit;
                            response
                        }
                        Err(e) => error(format!("malformed request: {e}")),
                    };
                    respond(client.get_mut(), &response);
                    keep.push(client);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    keep.push(client);
                }
                Err(_) => continue,
            }
        }
        clients = keep;
        if exit {
            break match &mut machine {
                Machine::Live(vmm) => vmm.kill(),
                Machine::Prepared(_) => StopReason::Killed,
            };
        }
    };
    if let Some(path) = &args.control_socket {
        remove_socket(path);
    }
    let clean = reason.is_clean();
    print_event(&Event::Stopped { stop: reason });
    std::process::exit(if clean { 0 } else { 1 });
}
