//! One `tine-vmm` process per VM: launching it, recognising it after a
//! daemon restart, asking it to stop, and reading why it stopped.
//!
//! The process runs in its own process group with stdout and stderr
//! appended to `vmm.log` in the VM's folder, never a pipe to the daemon: a
//! `kill -9` of the daemon leaves every VM running, and the next daemon
//! adopts it by pid plus start time (a reused pid does not match) plus its
//! command line naming the VM's folder.

use std::io::{BufRead, Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tine_proto::vmm::Event;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::launcher::{BootSpec, RestoreSpec, Stop};

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
        let dir = data_dir.join("vms").join(hostname);
        VmPaths {
            vsock: dir.join("vsock.sock"),
            control: dir.join("control.sock"),
            serial: dir.join("serial.log"),
            log: dir.join("vmm.log"),
            dir,
        }
    }
}

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

/// Starts tine-vmm without a VM (`--prestart`), ready to restore a
/// snapshot sent on its control socket, with the spec's disk and TAP in
/// place of the snapshot's.
pub fn prestart(vmm: &Path, spec: &RestoreSpec, paths: &VmPaths) -> std::io::Result<Child> {
    let mut cmd = command(vmm, paths)?;
    cmd.arg("--prestart")
        .arg("--vcpus")
        .arg(spec.cpus.to_string())
        .arg("--mem-mib")
        .arg(spec.ram_mib.to_string());
    if let Some(disk) = &spec.disk {
        let mut arg = std::ffi::OsString::from(format!("{}=", crate::launcher::ROOT_DRIVE));
        arg.push(disk);
        cmd.arg("--drive-override").arg(arg);
    }
    if let Some(tap) = &spec.tap {
        cmd.arg("--tap-override").arg(format!("net0={tap}"));
    }
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

/// Whether `pid` is still the tine-vmm process launched for `paths`.
pub fn is_ours(pid: u32, pid_start: u64, paths: &VmPaths) -> bool {
    if start_time(pid) != Some(pid_start) {
        return false;
    }
    // A zombie has an empty command line; it is not a running VM.
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = paths.control.display().to_string();
    cmdline
        .split(|b| *b == 0)
        .any(|arg| arg == needle.as_bytes())
}

/// tine-vmm processes whose control socket lies under `vms_dir`, with the
/// hostname folder each belongs to.
pub fn find_vmm_processes(vms_dir: &Path) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let prefix = format!("{}/", vms_dir.display());
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let Some(pos) = args.iter().position(|a| *a == b"--control-socket") else {
            continue;
        };
        let Some(sock) = args.get(pos + 1).and_then(|a| std::str::from_utf8(a).ok()) else {
            continue;
        };
        if let Some(rest) = sock.strip_prefix(&prefix) {
            if let Some((host, _)) = rest.split_once('/') {
                out.push((pid, host.to_owned()));
            }
        }
    }
    out
}

/// Waits until a process that is not our child exits (polling, as the
/// daemon cannot reap it).
pub async fn wait_adopted(pid: u32, pid_start: u64) {
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
    let exchange = async {
        let io = tokio::net::UnixStream::connect(&paths.control).await?;
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
    };
    tokio::time::timeout(within, exchange).await.map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer on {} within {within:?}", paths.control.display()),
        )
    })?
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
        assert!(find_vmm_processes(&dir.path().join("vms")).is_empty());
    }
}
