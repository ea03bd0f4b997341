//! PID 1 duties in the min image.
//!
//! [`boot`] mounts the base file systems ([`mount_base`]), sets `PATH`, the
//! hostname (`tine.hostname=`, the `ip=` hostname field, `/etc/hostname`,
//! or [`DEFAULT_HOSTNAME`]), brings `lo` up and configures the interface
//! named on the kernel command line ([`super::cmdline`]).
//!
//! Signals sent to PID 1 ([`spawn_signal_thread`]): `SIGTERM` and `SIGINT`
//! are forwarded to every process and the VM then powers off (Ctrl-Alt-Del,
//! which tine-vmm's graceful shutdown presses, arrives as `SIGINT`: [`boot`]
//! turns the kernel's immediate, unsynced reboot on Ctrl-Alt-Del off); `SIGUSR1`,
//! `SIGUSR2` and `SIGPWR` (busybox `halt`, `poweroff`, and power events)
//! power off the same way. busybox `reboot` sends `SIGTERM`, so it powers
//! off too; `reboot -f` or [`request_shutdown`] reboots.
//!
//! [`shutdown`] sends `SIGTERM` to every process, waits up to a grace
//! period, sends `SIGKILL`, syncs, remounts `/` read-only and stops the VM:
//! power off is a write of 0 to tine-vmm's debug-exit port 0x501, which
//! works with kernels without ACPI too (`ioperm`, which needs
//! `CONFIG_X86_IOPL_IOPERM`, then `outb`), and reboot is `reboot(RB_AUTOBOOT)` (the kernel pulses the
//! i8042 reset line with `reboot=k`; tine-vmm then stops the VM). When the
//! port write does not stop the VM, power off falls back to
//! `reboot(RB_POWER_OFF)` with ACPI and to a reset without it (a halt would
//! leave the VM running).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::mount::MsFlags;

use super::cmdline::KernelCmdline;
use super::fs::under;
use super::hostname::{valid_hostname, write_hostname_files};
use super::net::{self, NetConfig};
use super::reaper::{self, Reaper};
use crate::error::describe_error;

/// The hostname when nothing names one.
pub const DEFAULT_HOSTNAME: &str = "tine";

/// `PATH` for PID 1 and everything it starts.
pub const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long [`shutdown`] waits after `SIGTERM` before `SIGKILL`.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// The VMM's debug-exit port: a byte written there powers the VM off.
pub const DEBUG_EXIT_PORT: u16 = 0x501;

/// Errors from this module.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A mount failed.
    #[error("Cannot mount {fstype} on {}", target.display())]
    Mount {
        /// File system type.
        fstype: &'static str,
        /// Mount point.
        target: PathBuf,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// A directory or symlink could not be created.
    #[error("Cannot create {}", path.display())]
    Create {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A signal handler or its pipe could not be installed.
    #[error("Cannot handle {0}")]
    Signal(&'static str, #[source] io::Error),
    /// The shutdown command (not PID 1) failed.
    #[error("Cannot run {0}")]
    Command(String, #[source] io::Error),
}

/// What to do at the end of [`shutdown`]: power off or reboot.
pub use tine_proto::agent::ShutdownAction;

/// What [`boot`] did.
#[derive(Debug, Clone, Default)]
pub struct BootReport {
    /// The parsed kernel command line.
    pub cmdline: KernelCmdline,
    /// The hostname set.
    pub hostname: String,
    /// The network configuration applied, if any.
    pub net: Option<NetConfig>,
    /// Mount points mounted (guest paths).
    pub mounted: Vec<String>,
    /// Problems that did not stop the boot.
    pub warnings: Vec<String>,
}

/// Whether this process is PID 1.
pub fn is_pid1() -> bool {
    std::process::id() == 1
}

/// PID 1 setup; never fails, collecting problems in the report. `root` is
/// `/` (tests use a directory inside a private mount namespace).
pub fn boot(root: &Path) -> BootReport {
    let mut rep = BootReport::default();
    // Before any thread exists (see `system::start`).
    std::env::set_var("PATH", PATH);
    if std::env::var_os("HOME").is_none_or(|h| h == "/") {
        std::env::set_var("HOME", "/root");
    }

    // The kernel's default answer to Ctrl-Alt-Del is an immediate restart
    // that syncs nothing: whatever the guest wrote last would be lost. With
    // it off, the kernel sends PID 1 SIGINT instead, and [`shutdown`] runs.
    if is_pid1() {
        if let Err(e) = nix::sys::reboot::set_cad_enabled(false) {
            rep.warnings.push(format!(
                "reboot(RB_DISABLE_CAD) failed ({e}): Ctrl-Alt-Del restarts without syncing"
            ));
        }
    }

    let m = mount_base(root);
    rep.mounted = m.mounted;
    rep.warnings
        .extend(m.errors.iter().map(|e| describe_error(e)));

    rep.cmdline = match KernelCmdline::read() {
        Ok(c) => c,
        Err(e) => {
            rep.warnings.push(format!("cannot read /proc/cmdline: {e}"));
            KernelCmdline::default()
        }
    };
    rep.warnings.extend(rep.cmdline.warnings.iter().cloned());

    let from_cmdline = rep.cmdline.hostname.clone();
    let name = from_cmdline
        .clone()
        .or_else(|| {
            std::fs::read_to_string(under(root, "/etc/hostname"))
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| valid_hostname(s))
        })
        .unwrap_or_else(|| DEFAULT_HOSTNAME.to_string());
    if let Err(e) = nix::unistd::sethostname(&name) {
        rep.warnings
            .push(format!("sethostname({name}) failed: {e}"));
    }
    if from_cmdline.is_some() {
        if let Err(e) = write_hostname_files(root, &name) {
            rep.warnings.push(format!("hostname: {e}"));
        }
    }
    rep.hostname = name;

    if let Err(e) = net::link_up("lo") {
        rep.warnings.push(describe_error(&e));
    }
    if let Some(cfg) = rep.cmdline.net.clone() {
        match net::configure_link(&cfg) {
            Ok(()) => rep.net = Some(cfg.clone()),
            Err(e) => rep.warnings.push(describe_error(&e)),
        }
        if !cfg.dns.is_empty() {
            if let Err(e) = net::write_resolv_conf(root, &cfg.dns) {
                rep.warnings.push(describe_error(&e));
            }
        }
    }
    rep
}

/// What [`mount_base`] did.
#[derive(Debug, Default)]
pub struct MountReport {
    /// Mount points mounted now (guest paths).
    pub mounted: Vec<String>,
    /// Mount points that already had something mounted (the kernel mounts
    /// devtmpfs itself with `CONFIG_DEVTMPFS_MOUNT`).
    pub already: Vec<String>,
    /// What failed; later steps still ran.
    pub errors: Vec<InitError>,
}

struct MountSpec {
    target: &'static str,
    fstype: &'static str,
    flags: MsFlags,
    data: Option<&'static str>,
    /// A failure is only worth a warning in the report, not fatal to what
    /// depends on it.
    optional: bool,
}

const NOSUID_NODEV: MsFlags = MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV);
const NOSUID_NODEV_NOEXEC: MsFlags = NOSUID_NODEV.union(MsFlags::MS_NOEXEC);

const MOUNTS: &[MountSpec] = &[
    MountSpec {
        target: "/proc",
        fstype: "proc",
        flags: NOSUID_NODEV_NOEXEC,
        data: None,
        optional: false,
    },
    MountSpec {
        target: "/sys",
        fstype: "sysfs",
        flags: NOSUID_NODEV_NOEXEC,
        data: None,
        optional: false,
    },
    MountSpec {
        target: "/dev",
        fstype: "devtmpfs",
        flags: MsFlags::MS_NOSUID,
        data: Some("mode=0755"),
        optional: false,
    },
    MountSpec {
        target: "/dev/pts",
        fstype: "devpts",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NOEXEC),
        data: Some("gid=5,mode=0620,ptmxmode=0666"),
        optional: false,
    },
    MountSpec {
        target: "/dev/shm",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=1777"),
        optional: false,
    },
    MountSpec {
        target: "/run",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=0755"),
        optional: false,
    },
    MountSpec {
        target: "/tmp",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=1777"),
        optional: false,
    },
    MountSpec {
        target: "/sys/fs/cgroup",
        fstype: "cgroup2",
        flags: NOSUID_NODEV_NOEXEC,
        data: None,
        optional: true,
    },
];

/// `/dev` links that programs expect (target, link).
const DEV_LINKS: &[(&str, &str)] = &[
    ("pts/ptmx", "/dev/ptmx"),
    ("/proc/self/fd", "/dev/fd"),
    ("/proc/self/fd/0", "/dev/stdin"),
    ("/proc/self/fd/1", "/dev/stdout"),
    ("/proc/self/fd/2", "/dev/stderr"),
];

/// Mounts proc, sysfs, devtmpfs, devpts, /dev/shm, /run, /tmp and cgroup2
/// under `root`, skipping mount points that already have a mount, and
/// creates the /dev links (/dev/ptmx becomes a link to pts/ptmx).
pub fn mount_base(root: &Path) -> MountReport {
    let mut rep = MountReport::default();
    for spec in MOUNTS {
        let target = under(root, spec.target);
        // Read each time: proc is mounted by the first step.
        if mount_points().iter().any(|m| m == &target) {
            rep.already.push(spec.target.to_string());
            continue;
        }
        if let Err(source) = std::fs::create_dir_all(&target) {
            rep.errors.push(InitError::Create {
                path: target,
                source,
            });
            continue;
        }
        match nix::mount::mount(
            Some(spec.fstype),
            &target,
            Some(spec.fstype),
            spec.flags,
            spec.data,
        ) {
            Ok(()) => rep.mounted.push(spec.target.to_string()),
            Err(source) if !spec.optional || source != nix::Error::ENODEV => {
                rep.errors.push(InitError::Mount {
                    fstype: spec.fstype,
                    target,
                    source,
                })
            }
            Err(_) => {} // optional and not in this kernel
        }
    }
    for (to, link) in DEV_LINKS {
        let path = under(root, link);
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_symlink() => continue,
            // The legacy ptmx node: replace it by the devpts one.
            Ok(_) if *link == "/dev/ptmx" => {
                if let Err(source) = std::fs::remove_file(&path) {
                    rep.errors.push(InitError::Create { path, source });
                    continue;
                }
            }
            Ok(_) => continue,
            Err(_) => {}
        }
        if let Err(source) = std::os::unix::fs::symlink(to, &path) {
            rep.errors.push(InitError::Create { path, source });
        }
    }
    rep
}

/// The mount points of this thread's mount namespace (empty before /proc
/// is mounted).
fn mount_points() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mountinfo(p)))
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0')))
            .and_then(|v| u8::try_from(v).ok());
        if let Some(v) = octal {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

const HANDLED: &[(libc::c_int, &str)] = &[
    (libc::SIGTERM, "SIGTERM"),
    (libc::SIGINT, "SIGINT"),
    (libc::SIGUSR1, "SIGUSR1"),
    (libc::SIGUSR2, "SIGUSR2"),
    (libc::SIGPWR, "SIGPWR"),
];

/// Handles PID 1's signals on a thread named `tine-init-signals` (see the
/// module docs); every one of them ends in [`shutdown`] with `grace`.
pub fn spawn_signal_thread(grace: Duration) -> Result<(), InitError> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the two-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
        return Err(InitError::Signal("signals", io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded: both fds are open and ours alone. The write
    // end is leaked on purpose: the handlers use it for the process's life.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), fds[1]) };
    for (sig, name) in HANDLED {
        let byte = *sig as u8;
        // SAFETY: the action only calls write(2), async-signal-safe, on a
        // non-blocking pipe that is never closed.
        unsafe {
            signal_hook_registry::register(*sig, move || {
                libc::write(w, (&byte as *const u8).cast(), 1);
            })
        }
        .map_err(|e| InitError::Signal(name, e))?;
    }
    std::thread::Builder::new()
        .name("tine-init-signals".into())
        .spawn(move || {
            let mut b = [0u8; 1];
            loop {
                let mut pfd = libc::pollfd {
                    fd: r.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, no timeout.
                unsafe { libc::poll(&mut pfd, 1, -1) };
                // SAFETY: reading one byte into a valid buffer.
                if unsafe { libc::read(r.as_raw_fd(), b.as_mut_ptr().cast(), 1) } == 1 {
                    let sig = libc::c_int::from(b[0]);
                    let name = HANDLED
                        .iter()
                        .find(|(s, _)| *s == sig)
                        .map(|(_, n)| *n)
                        .unwrap_or("a signal");
                    eprintln!("tine-agent: {name} received, powering off");
                    shutdown(ShutdownAction::Poweroff, grace);
                }
            }
        })
        .map_err(|e| InitError::Signal("signals", e))?;
    Ok(())
}

static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);

/// PID 1's shutdown: terminate every process, sync, then power off or
/// reboot. Never returns (a second caller parks while the first finishes).
pub fn shutdown(action: ShutdownAction, grace: Duration) -> ! {
    if SHUTTING_DOWN.swap(true, Ordering::SeqCst) {
        loop {
            std::thread::park();
        }
    }
    terminate_all(grace);
    nix::unistd::sync();
    if let Err(e) = nix::mount::mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
        None::<&str>,
    ) {
        eprintln!("tine-agent: cannot remount / read-only: {e}");
    }
    nix::unistd::sync();
    match action {
        ShutdownAction::Poweroff => {
            match debug_exit(0) {
                // The VMM stops the vCPUs asynchronously: a few more
                // instructions may run. Give it time before falling back.
                Ok(()) => std::thread::sleep(Duration::from_secs(2)),
                Err(e) => eprintln!("tine-agent: cannot write the debug-exit port: {e}"),
            }
            // Still running: not under tine-vmm, or a kernel without
            // ioperm(). Without ACPI, RB_POWER_OFF would only halt the CPUs
            // and leave the VM running; a reset (i8042, reboot=k) at least
            // makes tine-vmm stop it.
            let mode = if Path::new("/sys/firmware/acpi").exists() {
                nix::sys::reboot::RebootMode::RB_POWER_OFF
            } else {
                eprintln!("tine-agent: no ACPI: resetting instead of powering off");
                nix::sys::reboot::RebootMode::RB_AUTOBOOT
            };
            let Err(e) = nix::sys::reboot::reboot(mode);
            eprintln!("tine-agent: reboot({mode:?}) failed: {e}");
        }
        ShutdownAction::Reboot => {
            let mode = nix::sys::reboot::RebootMode::RB_AUTOBOOT;
            let Err(e) = nix::sys::reboot::reboot(mode);
            eprintln!("tine-agent: reboot({mode:?}) failed: {e}");
        }
    }
    eprintln!("tine-agent: the kernel did not stop the VM; waiting forever");
    loop {
        std::thread::park();
    }
}

/// Asks for a shutdown from the agent's protocol handler. As PID 1 it runs
/// [`shutdown`] on a new thread and returns at once, so the caller can
/// answer; otherwise (a systemd service) it runs `poweroff` or `reboot`.
pub fn request_shutdown(action: ShutdownAction) -> Result<(), InitError> {
    if is_pid1() {
        std::thread::Builder::new()
            .name("tine-shutdown".into())
            .spawn(move || shutdown(action, DEFAULT_GRACE))
            .map_err(|e| InitError::Command("the shutdown thread".into(), e))?;
        return Ok(());
    }
    let prog = match action {
        ShutdownAction::Poweroff => "poweroff",
        ShutdownAction::Reboot => "reboot",
    };
    let st = reaper::status(&mut std::process::Command::new(prog))
        .map_err(|e| InitError::Command(prog.into(), e))?;
    if st.success() {
        Ok(())
    } else {
        Err(InitError::Command(
            prog.into(),
            io::Error::other(format!("{prog} exited with {st}")),
        ))
    }
}

/// `SIGTERM` (and `SIGCONT`) to every process but us, up to `grace` for
/// them to go, then `SIGKILL`.
fn terminate_all(grace: Duration) {
    use nix::sys::signal::Signal;
    signal_everyone(Signal::SIGTERM);
    signal_everyone(Signal::SIGCONT);
    if wait_all_gone(grace) {
        return;
    }
    eprintln!("tine-agent: processes left after {grace:?}; sending SIGKILL");
    signal_everyone(Signal::SIGKILL);
    wait_all_gone(Duration::from_secs(2));
}

/// Sends `signal` to every process but this one. None being left (ESRCH)
/// is no failure; any other error goes to the console.
fn signal_everyone(signal: nix::sys::signal::Signal) {
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(-1), signal) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
        Err(e) => eprintln!("tine-agent: cannot send {signal} to every process: {e}"),
    }
}

/// Waits until no process other than this one is left (zombies count, so
/// they are reaped here too). `kill(-1, 0)` cannot tell: it succeeds on
/// kernel threads.
fn wait_all_gone(limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        match Reaper::global() {
            Some(r) => {
                r.reap_now();
            }
            None => {
                let mut st = 0;
                // SAFETY: waitpid writes into a valid int.
                while unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) } > 0 {}
            }
        }
        if user_processes(Path::new("/proc")).is_empty() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `PF_KTHREAD` in the flags field of /proc/PID/stat.
const PF_KTHREAD: u64 = 0x0020_0000;

/// Pids of the processes in `proc` other than this one and kernel threads.
fn user_processes(proc: &Path) -> Vec<u32> {
    let me = std::process::id();
    let Ok(rd) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            let stat = std::fs::read_to_string(proc.join(pid.to_string()).join("stat"))
                .unwrap_or_default();
            // Fields after "(comm)": state ppid pgrp session tty tpgid flags.
            let flags = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(6))
                .and_then(|f| f.parse::<u64>().ok());
            // Gone meanwhile (no stat) is not left.
            matches!(flags, Some(f) if f & PF_KTHREAD == 0)
        })
        .collect()
}

/// Writes `code` to the debug-exit port; under tine-vmm the VM stops with
/// that value before this returns.
#[cfg(target_arch = "x86_64")]
pub fn debug_exit(code: u8) -> io::Result<()> {
    // SAFETY: ioperm only changes this thread's I/O permission bitmap.
    if unsafe { libc::ioperm(libc::c_ulong::from(DEBUG_EXIT_PORT), 1, 1) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ioperm above granted this thread access to the port; the
    // write has no effect on this process's memory.
    unsafe {
        std::arch::asm!(
            "out dx, al",
            in("dx") DEBUG_EXIT_PORT,
            in("al") code,
            options(nomem, nostack, preserves_flags)
        );
    }
    Ok(())
}

/// Writes `code` to the debug-exit port (x86_64 only).
#[cfg(not(target_arch = "x86_64"))]
pub fn debug_exit(_code: u8) -> io::Result<()> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn test_unescape_mountinfo() {
        assert_eq!(unescape_mountinfo(r"/a\040b"), "/a b");
        assert_eq!(unescape_mountinfo(r"/x\134y"), r"/x\y");
        assert_eq!(unescape_mountinfo(r"/plain"), "/plain");
        assert_eq!(unescape_mountinfo(r"/end\04"), r"/end\04");
        assert_eq!(unescape_mountinfo(r"/big\777"), r"/big\777");
    }

    #[test]
    fn test_user_processes_skips_self_and_kernel_threads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let proc = dir.path();
        let stat = |pid: u32, comm: &str, flags: u64| {
            let d = proc.join(pid.to_string());
            fs::create_dir_all(&d).expect("mkdir");
            fs::write(
                d.join("stat"),
                format!("{pid} ({comm}) S 1 {pid} {pid} 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 1 0"),
            )
            .expect("stat");
        };
        stat(std::process::id(), "tine-agent", 0x400100);
        stat(2, "kthreadd", 0x208040);
        stat(40, "odd) name (x", 0x400000);
        stat(41, "kworker/0:1", 0x4208060);
        stat(42, "sh", 0x400100);
        fs::create_dir_all(proc.join("43")).expect("gone: no stat");
        fs::create_dir_all(proc.join("self")).expect("not a pid");
        let mut left = user_processes(proc);
        left.sort();
        assert_eq!(left, vec![40, 42]);
    }

    /// Runs `f` on a thread in a private mount namespace whose mounts do not
    /// propagate back, so nothing it mounts is seen outside.
    fn in_private_mount_ns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            use nix::sched::{unshare, CloneFlags};
            if let Err(e) = unshare(CloneFlags::CLONE_NEWNS) {
                panic!("unshare(CLONE_NEWNS) failed ({e}): this test needs root");
            }
            nix::mount::mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .expect("make / private in the new namespace");
            f()
        })
        .join()
        .expect("mount-ns thread panicked")
    }

    #[test]
    fn test_mount_base_in_a_private_namespace() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        let (rep, checks) = in_private_mount_ns(move || {
            // devtmpfs is one instance shared with the host's /dev: stand a
            // tmpfs in for it so the links below land in a scratch /dev.
            let dev = root.join("dev");
            fs::create_dir_all(&dev).expect("mkdir dev");
            nix::mount::mount(
                Some("tmpfs"),
                &dev,
                Some("tmpfs"),
                MsFlags::empty(),
                None::<&str>,
            )
            .expect("scratch /dev");
            fs::write(dev.join("ptmx"), "").expect("fake legacy ptmx");
            let rep = mount_base(&root);
            let mounts = mount_points();
            let fstype_at = |p: &str| {
                let want = root.join(p.trim_start_matches('/'));
                let text = fs::read_to_string("/proc/thread-self/mountinfo").unwrap_or_default();
                text.lines().find_map(|l| {
                    let f: Vec<&str> = l.split(' ').collect();
                    let sep = f.iter().position(|x| *x == "-")?;
                    (Path::new(f.get(4)?) == want).then(|| f.get(sep + 1).map(|s| s.to_string()))?
                })
            };
            let checks = (
                ["/proc", "/sys", "/dev/pts", "/dev/shm", "/run", "/tmp"]
                    .iter()
                    .map(|p| (p.to_string(), fstype_at(p)))
                    .collect::<Vec<_>>(),
                fs::read_link(root.join("dev/ptmx")).ok(),
                fs::read_link(root.join("dev/stdout")).ok(),
                root.join("dev/pts/ptmx").exists(),
                fs::metadata(root.join("tmp")).map(|m| {
                    use std::os::unix::fs::PermissionsExt;
                    m.permissions().mode() & 0o7777
                }),
                mounts.len(),
            );
            // A second run finds everything mounted.
            let again = mount_base(&root);
            (rep, (checks, again.mounted.len(), again.errors.len()))
        });
        let errors: Vec<String> = rep.errors.iter().map(|e| describe_error(e)).collect();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(rep.already, vec!["/dev"]);
        let ((fstypes, ptmx, stdout, pts_ptmx, tmp_mode, _), again_mounted, again_errors) = checks;
        let want = ["proc", "sysfs", "devpts", "tmpfs", "tmpfs", "tmpfs"];
        for ((p, got), want) in fstypes.iter().zip(want) {
            assert_eq!(got.as_deref(), Some(want), "{p}");
        }
        assert_eq!(ptmx, Some(PathBuf::from("pts/ptmx")));
        assert_eq!(stdout, Some(PathBuf::from("/proc/self/fd/1")));
        assert!(pts_ptmx);
        assert_eq!(tmp_mode.expect("tmp"), 0o1777);
        assert_eq!(again_mounted, 0);
        assert_eq!(again_errors, 0);
    }
}
