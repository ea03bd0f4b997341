//! One `tine-vmm` process per VM: launching it, recognising it after a
//! daemon restart, asking it to stop, and reading why it stopped.
//!
//! The process runs in its own process group with stdout and stderr
//! appended to `vmm.log` in the VM's folder, never a pipe to the daemon: a
//! `kill -9` of the daemon leaves every VM running, and the next daemon
//! adopts it by pid plus start time (a reused pid does not match) plus the
//! folder its log is in.
//!
//! A process of the warm pool (see [`crate::launcher::pool`]) was started
//! in `<data_dir>/pool/<slot>/` before anyone knew which VM it would run.
//! When a VM takes it, its socket and logs move into the VM's folder (a
//! primed one's move with the folder its fork takes, by rename). Its
//! command line still names the slot; the log it writes to, an open file
//! whose name follows every rename, says whose it is, with no link or
//! record to update on a fork's path.

use std::io::{BufRead, Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tine_proto::vmm::Event;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::launcher::{BootSpec, Stop};

/// The files of one VM, all inside `<data_dir>/vms/<hostname>/`.
#[derive(Debug, Clone)]
pub struct VmPaths {
    /// The folder.
    pub dir: PathBuf,
    /// vsock Unix socket (`CONNECT <port>`).
    pub vsock: PathBuf,
    /// tine-vmm control socket.
    pub control: PathBuf,
    /// Serial console log.
    pub serial: PathBuf,
    /// tine-vmm's stdout and stderr.
    pub log: PathBuf,
}

impl VmPaths {
    /// Paths for `hostname` under `data_dir`.
    pub fn new(data_dir: &Path, hostname: &str) -> Self {
        Self::in_dir(data_dir.join("vms").join(hostname))
    }

    /// The same files in `dir` (a warm pool slot's folder).
    pub fn in_dir(dir: PathBuf) -> Self {
        VmPaths {
            vsock: dir.join("vsock.sock"),
            control: dir.join("control.sock"),
            serial: dir.join("serial.log"),
            log: dir.join(LOG_FILE),
            dir,
        }
    }
}

/// tine-vmm's stdout and stderr in its VM's folder: which folder that is
/// now says whose the process is (see [`find_processes`]).
pub const LOG_FILE: &str = "vmm.log";

/// A VM's disk in its folder (and a spare disk in the spare's folder,
/// which becomes a fork's folder by rename).
pub const DISK_FILE: &str = "disk.qcow2";

/// The warm pool's folder in the data directory: `pool/<slot>/` holds a
/// pre-started process's files until a VM takes it.
pub const POOL_DIR: &str = "pool";

/// The serial log is capped at this many bytes per boot.
pub const SERIAL_LOG_LIMIT: u64 = 8 << 20;

/// Starts tine-vmm for a VM; returns the child (the caller reaps it).
pub fn launch(vmm: &Path, spec: &BootSpec, paths: &VmPaths) -> std::io::Result<Child> {
    let mut cmd = command(vmm, paths)?;
    cmd.arg("--kernel")
        .arg(&spec.kernel)
        .arg("--cmdline")
        .arg(&spec.cmdline)
        .arg("--vcpus")
        .arg(spec.cpus.to_string())
        .arg("--mem-mib")
        .arg(spec.ram_mib.to_string())
        .arg("--drive")
        .arg(&spec.disk)
        .arg("--vsock")
        .arg(format!("3,{}", paths.vsock.display()))
        .arg("--rng");
    if let Some((tap, mac)) = &spec.net {
        cmd.arg("--net").arg(format!("{tap},{mac}"));
    }
    cmd.spawn()
}

/// Starts tine-vmm without a VM (`--prestart`) for a snapshot of `cpus`
/// vCPUs and `ram_mib` of RAM (registered with KVM now), ready to restore
/// it when asked on its control socket; the restore request names the
/// VM's disk and TAP.
pub fn prestart(vmm: &Path, cpus: u32, ram_mib: u64, paths: &VmPaths) -> std::io::Result<Child> {
    let mut cmd = command(vmm, paths)?;
    cmd.arg("--prestart")
        .arg("--vcpus")
        .arg(cpus.to_string())
        .arg("--mem-mib")
        .arg(ram_mib.to_string());
    cmd.spawn()
}

/// The command line every VM process shares: its control socket (which
/// names the VM's folder, how a restarted daemon recognises it), its serial
/// log, output appended to `vmm.log`, its own process group.
fn command(vmm: &Path, paths: &VmPaths) -> std::io::Result<Command> {
    std::fs::create_dir_all(&paths.dir)?;
    for stale in [&paths.vsock, &paths.control] {
        match std::fs::remove_file(stale) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&paths.log)?;
    let mut cmd = Command::new(vmm);
    cmd.arg("--control-socket")
        .arg(&paths.control)
        .arg("--serial-log")
        .arg(&paths.serial)
        .arg("--serial-log-limit")
        .arg(SERIAL_LOG_LIMIT.to_string())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own group: signals for the daemon's terminal or group do not
        // reach VMs.
        .process_group(0);
    Ok(cmd)
}

/// A process's start time (clock ticks since boot, `/proc/PID/stat` field
/// 22), or `None` when it does not exist.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: fields
    // after it start past the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The `--control-socket` argument of process `pid`, if it has one (a
/// zombie's command line is empty).
fn control_socket_of(pid: u32) -> Option<PathBuf> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let pos = args.iter().position(|a| *a == b"--control-socket")?;
    let sock = std::str::from_utf8(args.get(pos + 1)?).ok()?;
    Some(PathBuf::from(sock))
}

/// Every process with a `--control-socket` argument, with that argument.
fn control_sockets() -> Vec<(u32, PathBuf)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, control_socket_of(pid)?)))
        .collect()
}

/// Whether `pid` is still the tine-vmm process launched for `paths`: the
/// folder its log is in, or, with its log removed, the folder its command
/// line names (as [`find_processes`] says whose it is: a process started
/// for the VM must be known as the VM's, or a restarted daemon would
/// launch a second one on the same disk).
pub fn is_ours(pid: u32, pid_start: u64, paths: &VmPaths) -> bool {
    if start_time(pid) != Some(pid_start) {
        return false;
    }
    let Some(sock) = control_socket_of(pid) else {
        return false;
    };
    match log_folder(pid) {
        Some(dir) => dir == canonical(&paths.dir),
        None => sock.parent() == Some(paths.dir.as_path()),
    }
}

/// The folder process `pid` runs for: where the `vmm.log` its output goes
/// to is now. The daemon opens that log as the process's stdout, and the
/// kernel names an open file by where it is now: a pooled process's log
/// moves into the VM's folder when a VM takes it, and a primed one's moves
/// with the folder its fork takes. `None` when the process is gone or its
/// log was removed (the name then ends in " (deleted)").
pub fn log_folder(pid: u32) -> Option<PathBuf> {
    let log = std::fs::read_link(format!("/proc/{pid}/fd/1")).ok()?;
    if log.file_name()? != LOG_FILE {
        return None;
    }
    log.parent().map(Path::to_path_buf)
}

/// `path` as the kernel names it (links resolved), or as it is when it
/// cannot be resolved.
fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Who a tine-vmm process under a data directory runs for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// The VM of this hostname.
    Vm(String),
    /// Nobody yet: the warm pool's slot of this name.
    Pool(String),
}

/// Every tine-vmm process whose control socket lies under `data_dir`
/// (`vms/<hostname>/` or `pool/<slot>/` on its command line), with whom it
/// runs for: the VM whose folder holds its log, else the slot it was
/// started in (not taken, or primed: its log is in the folder a fork would
/// take).
pub fn find_processes(data_dir: &Path) -> Vec<(u32, Owner)> {
    let vms = data_dir.join("vms");
    let pool = data_dir.join(POOL_DIR);
    let vms_now = canonical(&vms);
    let mut out = Vec::new();
    for (pid, sock) in control_sockets() {
        let Some(started_in) = sock.parent() else {
            continue;
        };
        let name = |dir: &Path| dir.file_name().map(|n| n.to_string_lossy().into_owned());
        let in_pool = started_in.parent() == Some(pool.as_path());
        if !in_pool && started_in.parent() != Some(vms.as_path()) {
            continue;
        }
        let owner = match log_folder(pid) {
            Some(dir) if dir.parent() == Some(vms_now.as_path()) => name(&dir).map(Owner::Vm),
            _ if in_pool => name(started_in).map(Owner::Pool),
            // Started for this VM, its log removed.
            _ => name(started_in).map(Owner::Vm),
        };
        out.extend(owner.map(|o| (pid, o)));
    }
    out
}

/// The pool slots (folder names under `pool/`) that a running process's
/// command line names, taken or not.
pub fn pool_slots_in_use(data_dir: &Path) -> std::collections::HashSet<String> {
    let pool = data_dir.join(POOL_DIR);
    control_sockets()
        .into_iter()
        .filter_map(|(_, sock)| {
            let folder = sock.parent()?;
            (folder.parent() == Some(pool.as_path()))
                .then(|| folder.file_name().map(|n| n.to_string_lossy().into_owned()))
                .flatten()
        })
        .collect()
}

/// The tine-vmm processes that run VMs under `data_dir`, with their
/// hostnames (the warm pool's untaken processes are not among them).
pub fn find_vmm_processes(data_dir: &Path) -> Vec<(u32, String)> {
    find_processes(data_dir)
        .into_iter()
        .filter_map(|(pid, owner)| match owner {
            Owner::Vm(h) => Some((pid, h)),
            Owner::Pool(_) => None,
        })
        .collect()
}

/// A pidfd of `pid` (Linux 5.3 and later): it becomes readable once the
/// process has ended, whether or not it is our child.
fn pidfd(pid: u32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    // SAFETY: pidfd_open takes a pid and flags (none) and returns a new
    // descriptor or -1; no memory is passed to the kernel.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = std::os::fd::RawFd::try_from(fd).map_err(std::io::Error::other)?;
    // SAFETY: the kernel just returned this descriptor, which nothing else
    // owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Returns once the process behind `fd` (a pidfd) has ended, holding no
/// thread meanwhile.
async fn ended(fd: std::os::fd::OwnedFd) -> std::io::Result<()> {
    // SAFETY: the AsyncFd owns `fd`, an OwnedFd: the descriptor stays open
    // and names the same pidfd until the AsyncFd is dropped.
    let fd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
    }?;
    let _ready = fd.readable().await?;
    Ok(())
}

/// Reaps `child` once it ends. A process's pidfd says when, so no thread
/// waits while it runs: a daemon runs as many VMs as the host holds, and a
/// blocked `wait` each would take every one of the runtime's blocking
/// threads (512), which disk syncs and file moves need too. Where pidfds
/// are missing, a blocking thread waits.
pub async fn wait_child(mut child: Child) -> std::io::Result<std::process::ExitStatus> {
    let waited = match pidfd(child.id()) {
        Ok(fd) => ended(fd).await,
        Err(e) => Err(e),
    };
    match waited {
        Ok(()) => child.wait(),
        Err(e) => {
            // The child is still reaped: returning here would leave it a
            // zombie and its VM never marked stopped.
            tracing::debug!(
                pid = child.id(),
                "no pidfd to wait on ({e}): a thread waits for the process"
            );
            tokio::task::spawn_blocking(move || child.wait())
                .await
                .map_err(std::io::Error::other)?
        }
    }
}

/// Waits until a process that is not our child exits: through its pidfd,
/// or else by polling (the daemon cannot reap it).
pub async fn wait_adopted(pid: u32, pid_start: u64) {
    if let Ok(fd) = pidfd(pid) {
        // The descriptor is of whichever process has this pid now: the
        // adopted one if its start time still matches.
        if start_time(pid) != Some(pid_start) {
            return;
        }
        match ended(fd).await {
            Ok(()) => return,
            Err(e) => tracing::debug!(pid, "cannot wait on its pidfd ({e}): polling"),
        }
    }
    loop {
        match start_time(pid) {
            Some(t) if t == pid_start => {
                if is_gone(pid) {
                    return;
                }
            }
            _ => return,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Why a VM's process ended: its last `stopped` event, or how the process
/// ended with the last lines it wrote when it printed none (a crash, a
/// start-up error).
pub fn read_stop(paths: &VmPaths, status: Option<std::process::ExitStatus>) -> Stop {
    let tail = read_tail(&paths.log, 16 * 1024);
    let reported = tail
        .lines()
        .rev()
        .find_map(|line| match Event::from_line(line) {
            Ok(Event::Stopped { stop }) => Some(stop),
            _ => None,
        });
    if let Some(stop) = reported {
        return Stop::Reported(stop);
    }
    let last: Vec<&str> = tail
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('{'))
        .collect();
    let output = last[last.len().saturating_sub(3)..].join(" | ");
    match status.map(|s| (s.code(), std::os::unix::process::ExitStatusExt::signal(&s))) {
        Some((Some(code), _)) => Stop::Exited { code, output },
        Some((_, Some(signal))) => Stop::Signalled { signal, output },
        _ if output.is_empty() => Stop::Vanished,
        _ => Stop::Exited { code: -1, output },
    }
}

/// The last `limit` bytes of a file as text (lossy), empty if unreadable.
pub fn read_tail(path: &Path, limit: u64) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if f.seek(SeekFrom::Start(len.saturating_sub(limit))).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    if let Err(e) = f.take(limit).read_to_end(&mut buf) {
        tracing::warn!("read {}: {e}", path.display());
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// The last `n` lines of a file.
pub fn last_lines(path: &Path, n: usize) -> Vec<String> {
    let text = read_tail(path, (n as u64 + 1) * 512);
    let lines: Vec<String> = BufRead::lines(std::io::Cursor::new(text))
        .map_while(Result::ok)
        .collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

/// Sends one request line to a VM's control socket and returns its answer.
/// A VMM that does not answer within `within` is an error (`TimedOut`).
pub async fn control(
    paths: &VmPaths,
    request: &tine_proto::vmm::Request,
    within: Duration,
) -> std::io::Result<tine_proto::vmm::Response> {
    let answer = async {
        let io = tokio::net::UnixStream::connect(&paths.control).await?;
        exchange(io, request).await
    };
    answered_within(within, &paths.control.display().to_string(), answer).await
}

/// Sends `request` on a connection to a control socket and reads the
/// answer, within `within`.
pub async fn control_on(
    io: tokio::net::UnixStream,
    request: &tine_proto::vmm::Request,
    within: Duration,
) -> std::io::Result<tine_proto::vmm::Response> {
    answered_within(within, "tine-vmm's control socket", exchange(io, request)).await
}

/// `answer`, or `TimedOut` naming `from` when it takes longer than `within`.
async fn answered_within(
    within: Duration,
    from: &str,
    answer: impl std::future::Future<Output = std::io::Result<tine_proto::vmm::Response>>,
) -> std::io::Result<tine_proto::vmm::Response> {
    tokio::time::timeout(within, answer).await.map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer on {from} within {within:?}"),
        )
    })?
}

/// One request line out, one answer line (at most 64 KiB) back.
async fn exchange(
    io: tokio::net::UnixStream,
    request: &tine_proto::vmm::Request,
) -> std::io::Result<tine_proto::vmm::Response> {
    let (r, mut w) = io.into_split();
    let mut line = serde_json::to_string(request)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    line.push('\n');
    w.write_all(line.as_bytes()).await?;
    let mut answer = String::new();
    let mut reader = BufReader::new(r.take(64 * 1024));
    reader.read_line(&mut answer).await?;
    serde_json::from_str(&answer)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Whether the process `pid` started at `pid_start` has ended (gone, a
/// zombie, or its pid reused). Unlike `!is_ours`, a child that has not
/// reached its `exec` yet (its command line is still its parent's) has not
/// ended.
pub fn has_ended(pid: u32, pid_start: u64) -> bool {
    start_time(pid) != Some(pid_start) || is_gone(pid)
}

/// Whether `pid` no longer runs: no such process, or a zombie whose parent
/// has not reaped it yet.
fn is_gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(true)
}

/// Waits until none of `pids` exists any more (a zombie counts as gone),
/// up to `limit`.
pub async fn wait_gone(pids: &[u32], limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    while pids.iter().any(|&pid| !is_gone(pid)) {
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!("processes {pids:?} still exist after {limit:?}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends SIGKILL to `pid` if it is still the process launched for `paths`.
pub fn kill_if_ours(pid: u32, pid_start: u64, paths: &VmPaths) {
    if is_ours(pid, pid_start, paths) {
        if let Err(e) = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        ) {
            tracing::warn!(pid, "cannot kill {}: {e}", paths.dir.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Children that wait in `wait_child` hold none of the runtime's
    /// blocking threads: with only one, other blocking work still runs
    /// while three children are waited for. With a blocked `wait` each (as
    /// before), the check below timed out.
    #[test]
    fn waiting_for_children_holds_no_blocking_thread() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(1)
            .build()
            .expect("runtime");
        rt.block_on(async {
            let children: Vec<Child> = (0..3)
                .map(|_| Command::new("sleep").arg("60").spawn().expect("sleep runs"))
                .collect();
            let pids: Vec<u32> = children.iter().map(Child::id).collect();
            let waits: Vec<_> = children
                .into_iter()
                .map(|c| tokio::spawn(wait_child(c)))
                .collect();
            tokio::task::yield_now().await;
            let other =
                tokio::time::timeout(Duration::from_secs(20), tokio::task::spawn_blocking(|| 42))
                    .await
                    .expect("the blocking pool is free while children are waited for");
            assert_eq!(other.expect("task"), 42);
            for pid in &pids {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .expect("kill");
            }
            for w in waits {
                let status = w.await.expect("task").expect("reaped");
                use std::os::unix::process::ExitStatusExt;
                assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
            }
            for pid in pids {
                assert!(start_time(pid).is_none(), "{pid} reaped, not a zombie");
            }
        });
    }

    /// `wait_adopted` returns when the process ends, and at once for a
    /// pid whose start time is not the adopted process's.
    #[tokio::test]
    async fn waiting_for_an_adopted_process_ends_with_it() {
        let mut child = Command::new("sleep").arg("60").spawn().expect("sleep runs");
        let pid = child.id();
        let started = start_time(pid).expect("start time");
        wait_adopted(pid, started + 1).await;
        let waiting = tokio::spawn(wait_adopted(pid, started));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "it runs");
        child.kill().expect("kill");
        tokio::time::timeout(Duration::from_secs(20), waiting)
            .await
            .expect("returns once the process ended")
            .expect("task");
        child.wait().expect("reap");
    }

    /// A stand-in control socket that reads one request line and then
    /// answers `answer` (or nothing).
    fn fake_vmm(paths: &VmPaths, answer: Option<&'static str>) -> tokio::task::JoinHandle<String> {
        let listener = tokio::net::UnixListener::bind(&paths.control).expect("bind");
        tokio::spawn(async move {
            let (io, _) = listener.accept().await.expect("accept");
            let (r, mut w) = io.into_split();
            let mut line = String::new();
            BufReader::new(r).read_line(&mut line).await.expect("read");
            match answer {
                Some(a) => w.write_all(a.as_bytes()).await.expect("answer"),
                None => tokio::time::sleep(Duration::from_secs(60)).await,
            }
            line
        })
    }

    #[tokio::test]
    async fn control_sends_typed_requests_and_reads_typed_answers() {
        let dir = tempfile::tempdir().expect("tmp");
        let paths = VmPaths::new(dir.path(), "dev-1");
        std::fs::create_dir_all(&paths.dir).expect("dir");
        let vmm = fake_vmm(&paths, Some("{\"status\":\"ok\",\"duration_us\":7}\n"));
        let answer = control(
            &paths,
            &tine_proto::vmm::Request::Shutdown,
            Duration::from_secs(5),
        )
        .await
        .expect("answer");
        assert!(matches!(
            answer,
            tine_proto::vmm::Response::Ok { duration_us: 7, .. }
        ));
        assert_eq!(vmm.await.expect("vmm"), "{\"op\":\"shutdown\"}\n");
    }

    #[tokio::test]
    async fn control_gives_up_on_a_vmm_that_does_not_answer() {
        let dir = tempfile::tempdir().expect("tmp");
        let paths = VmPaths::new(dir.path(), "dev-1");
        std::fs::create_dir_all(&paths.dir).expect("dir");
        let _vmm = fake_vmm(&paths, None);
        let err = control(
            &paths,
            &tine_proto::vmm::Request::Kill,
            Duration::from_millis(200),
        )
        .await
        .expect_err("no answer");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("control.sock"), "{err}");
    }

    #[tokio::test]
    async fn wait_gone_returns_once_the_processes_have_ended() {
        let mut child = Command::new("sleep").arg("0.2").spawn().expect("sleep");
        let pid = child.id();
        let start = std::time::Instant::now();
        wait_gone(&[pid], Duration::from_secs(10)).await;
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        // Ended (a zombie until reaped here), not merely timed out.
        assert!(child.try_wait().expect("wait").is_some());
    }

    #[test]
    fn our_own_start_time_is_readable_and_stable() {
        let pid = std::process::id();
        let a = start_time(pid).expect("self");
        assert_eq!(start_time(pid), Some(a));
        assert!(start_time(u32::MAX - 1).is_none());
    }

    #[test]
    fn stop_reasons_come_from_the_last_stopped_event() {
        let dir = tempfile::tempdir().expect("tmp");
        let paths = VmPaths::new(dir.path(), "dev-1");
        std::fs::create_dir_all(&paths.dir).expect("dir");
        // The line exactly as tine-vmm prints it.
        let printed = serde_json::to_string(&Event::Stopped {
            stop: tine_proto::vmm::StopReason::GuestPoweroff(0),
        })
        .expect("encode");
        std::fs::write(
            &paths.log,
            format!("{{\"event\":\"ready\",\"pid\":1}}\n{printed}\n"),
        )
        .expect("write");
        let stop = read_stop(&paths, None);
        assert_eq!(
            stop,
            Stop::Reported(tine_proto::vmm::StopReason::GuestPoweroff(0))
        );
        assert!(stop.is_clean());
        assert_eq!(stop.describe(), "guest_poweroff: 0");
        std::fs::write(&paths.log, "error: cannot open kernel /x: No such file\n").expect("write");
        let stop = read_stop(&paths, None);
        assert!(!stop.is_clean());
        assert!(
            stop.describe().contains("cannot open kernel /x"),
            "{}",
            stop.describe()
        );
        std::fs::write(
            &paths.log,
            "{\"event\":\"stopped\",\"stop\":{\"reason\":\"triple_fault\"}}\n",
        )
        .expect("write");
        assert_eq!(read_stop(&paths, None).describe(), "triple_fault");
        assert!(!read_stop(&paths, None).is_clean());
    }

    #[test]
    fn last_lines_returns_the_tail() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("log");
        let text: String = (0..100).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&p, text).expect("write");
        assert_eq!(
            last_lines(&p, 2),
            vec!["line 98".to_string(), "line 99".to_string()]
        );
        assert!(last_lines(&dir.path().join("none"), 5).is_empty());
    }

    #[test]
    fn a_foreign_process_is_not_ours() {
        let dir = tempfile::tempdir().expect("tmp");
        let paths = VmPaths::new(dir.path(), "dev-1");
        let pid = std::process::id();
        let start = start_time(pid).expect("self");
        assert!(!is_ours(pid, start, &paths));
        assert!(!is_ours(pid, start + 1, &paths));
        assert!(find_processes(dir.path()).is_empty());
    }

    /// A process is known by where its log is now: a pool slot's until
    /// the log moves into a VM's folder (by a move of the file or a rename
    /// of its folder), that VM's after, the slot's again once the log is
    /// removed.
    #[test]
    fn a_process_belongs_to_the_folder_its_log_is_in() {
        let dir = tempfile::tempdir().expect("tmp");
        let data = dir.path();
        let slot = VmPaths::in_dir(data.join(POOL_DIR).join("ab12"));
        std::fs::create_dir_all(&slot.dir).expect("slot");
        let child = stand_in(&slot);
        let pid = child.id();
        let start = start_time(pid).expect("start time");
        let owner = || owner_of(data, pid);
        wait_listed(data, pid);
        assert_eq!(owner(), Some(Owner::Pool("ab12".into())));

        // Primed: its files go to a spare's folder, which a fork renames.
        let spare = VmPaths::in_dir(data.join("spares").join("c1").join("s1"));
        std::fs::create_dir_all(&spare.dir).expect("spare");
        std::fs::rename(&slot.log, &spare.log).expect("move the log");
        assert_eq!(owner(), Some(Owner::Pool("ab12".into())));
        let vm = VmPaths::new(data, "h-1");
        std::fs::create_dir_all(data.join("vms")).expect("vms");
        std::fs::rename(&spare.dir, &vm.dir).expect("the fork takes the folder");
        assert_eq!(owner(), Some(Owner::Vm("h-1".into())));
        assert!(is_ours(pid, start, &vm));
        assert!(!is_ours(pid, start + 1, &vm), "another start time");
        assert!(!is_ours(pid, start, &VmPaths::new(data, "h-2")));

        // Its log removed: nobody's VM, the slot's stray.
        std::fs::remove_file(&vm.log).expect("remove the log");
        assert_eq!(owner(), Some(Owner::Pool("ab12".into())));
        assert!(!is_ours(pid, start, &vm));
        stop_stand_in(child);

        // Started for a VM, its log removed: the VM's still, by its command
        // line.
        let booted = VmPaths::new(data, "h-3");
        std::fs::create_dir_all(&booted.dir).expect("folder");
        let child = stand_in(&booted);
        let pid = child.id();
        let start = start_time(pid).expect("start time");
        wait_listed(data, pid);
        std::fs::remove_file(&booted.log).expect("remove the log");
        assert_eq!(owner_of(data, pid), Some(Owner::Vm("h-3".into())));
        assert!(is_ours(pid, start, &booted));
        stop_stand_in(child);
    }

    /// A stand-in for tine-vmm started in `paths.dir`: its command line
    /// names the control socket there, its stdout is the log there. The
    /// trailing `:` keeps the shell from replacing itself with `sleep`.
    fn stand_in(paths: &VmPaths) -> Child {
        let log = std::fs::File::create(&paths.log).expect("log");
        Command::new("sh")
            .args(["-c", "sleep 30; :", "sh", "--control-socket"])
            .arg(&paths.control)
            .stdout(log)
            .process_group(0)
            .spawn()
            .expect("spawn sh")
    }

    /// Kills a stand-in with its `sleep`, and reaps it.
    fn stop_stand_in(mut child: Child) {
        let group = nix::unistd::Pid::from_raw(-(child.id() as i32));
        nix::sys::signal::kill(group, nix::sys::signal::Signal::SIGKILL).expect("kill");
        child.wait().expect("reap");
    }

    /// Waits until `pid`'s command line is readable: spawn returns once
    /// the new program is being loaded, and its arguments are in place a
    /// moment later.
    fn wait_listed(data: &Path, pid: u32) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while owner_of(data, pid).is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "process {pid} never listed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn owner_of(data: &Path, pid: u32) -> Option<Owner> {
        find_processes(data)
            .into_iter()
            .find(|(p, _)| *p == pid)
            .map(|(_, o)| o)
    }
}
