//! Building, signalling and reaping processes, shared by exec, background
//! execs and the shell.
//!
//! Every child is spawned through the process-wide [`Reaper`] and waited
//! through its [`ExitWatch`], never with `Child::wait`: as PID 1 the reaper
//! collects every child with `waitpid(-1)` ([`ReapMode::All`]), so any other
//! wait would lose the status. When no reaper is installed (the agent
//! embedded in a test harness or another program), one is installed lazily
//! in [`ReapMode::RegisteredOnly`], which leaves the host's other children
//! alone.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tine_proto::agent::{Command, ErrorCode, ExitStatus, ProcessOptions};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::OpError;
use crate::system::reaper::{ExitWatch, ReapMode, Reaper};

/// `PATH` for processes when neither the request nor the agent has one (as
/// PID 1 the agent starts with almost no environment).
pub(crate) const DEFAULT_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// After a process exits, its output is read until the pipe stays quiet this
/// long: a background grandchild holding the pipe open must not keep the
/// exec alive, but bytes already written are not lost.
pub(crate) const LINGER: Duration = Duration::from_millis(200);

/// Program and arguments for a [`Command`].
pub(crate) fn argv(command: &Command) -> Result<Vec<String>, OpError> {
    match command {
        Command::Argv(argv) if argv.is_empty() || argv[0].is_empty() => {
            Err(OpError::bad_request("argv is empty"))
        }
        Command::Argv(argv) => Ok(argv.clone()),
        Command::Shell {
            script,
            interpreter,
        } => Ok(vec![
            interpreter.clone().unwrap_or_else(|| "/bin/sh".to_owned()),
            "-c".to_owned(),
            script.clone(),
        ]),
    }
}

/// A short description of a command for listings.
pub(crate) fn describe(command: &Command) -> String {
    match command {
        Command::Argv(argv) => argv.join(" "),
        Command::Shell { script, .. } => script.clone(),
    }
}

/// An `/etc/passwd` entry.
struct PasswdEntry {
    name: String,
    gid: u32,
    home: String,
}

/// Looks `uid` up in `/etc/passwd` (parsed directly: a static binary cannot
/// rely on NSS).
fn lookup_user(uid: u32) -> Option<PasswdEntry> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() < 7 || fields[2].parse::<u32>().ok()? != uid {
            return None;
        }
        Some(PasswdEntry {
            name: fields[0].to_owned(),
            gid: fields[3].parse().ok()?,
            home: fields[5].to_owned(),
        })
    })
}

/// Builds a command with the request's environment, directory and identity
/// (an imported image's defaults where the request gives none).
pub(crate) fn build(
    argv: &[String],
    options: &ProcessOptions,
    extra_env: &BTreeMap<String, String>,
) -> Result<std::process::Command, OpError> {
    let defaults = super::image_defaults::read(Path::new(super::image_defaults::DEFAULTS_FILE));
    let options = &super::image_defaults::apply(options, &defaults, Path::new("/etc"))?;
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| OpError::bad_request("argv is empty"))?;
    let mut cmd = std::process::Command::new(program);
    cmd.args(args);
    if options.clear_env {
        cmd.env_clear();
    }
    for key in options.env.keys() {
        if key.is_empty() || key.contains('=') || key.contains('\0') {
            return Err(OpError::bad_request(format!(
                "invalid environment variable name {key:?}"
            )));
        }
    }
    let has_path = options.env.contains_key("PATH")
        || (!options.clear_env && std::env::var_os("PATH").is_some());
    if !has_path {
        cmd.env("PATH", DEFAULT_PATH);
    }
    let mut defaults = extra_env.clone();
    if let Some(uid) = options.uid {
        let entry = lookup_user(uid);
        let gid = options.gid.or(entry.as_ref().map(|e| e.gid)).unwrap_or(uid);
        cmd.uid(uid).gid(gid);
        if let Some(entry) = entry {
            defaults.insert("HOME".to_owned(), entry.home);
            defaults.insert("USER".to_owned(), entry.name.clone());
            defaults.insert("LOGNAME".to_owned(), entry.name);
        }
    } else if let Some(gid) = options.gid {
        cmd.gid(gid);
    }
    for (key, value) in defaults.iter().chain(&options.env) {
        cmd.env(key, value);
    }
    if let Some(cwd) = &options.cwd {
        let dir = Path::new(cwd);
        if !dir.is_absolute() {
            return Err(OpError::new(
                ErrorCode::InvalidPath,
                format!("working directory {cwd:?} is not absolute"),
            ));
        }
        match std::fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(OpError::bad_request(format!(
                    "working directory {cwd} is not a directory"
                )))
            }
            Err(e) => return Err(OpError::path("working directory", dir, &e)),
        }
        cmd.current_dir(dir);
    }
    Ok(cmd)
}

/// The error for a process that could not start.
pub(crate) fn spawn_error(program: &str, err: &io::Error) -> OpError {
    let code = match err.kind() {
        io::ErrorKind::NotFound => ErrorCode::NotFound,
        io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
        _ => ErrorCode::SpawnFailed,
    };
    OpError::new(code, format!("cannot start {program:?}: {err}"))
}

/// Sends `signal` to every process in group `pgid`.
pub(crate) fn signal_group(pgid: u32, signal: i32) -> Result<(), OpError> {
    let signal = Signal::try_from(signal)
        .map_err(|_| OpError::bad_request(format!("invalid signal number {signal}")))?;
    let pgid = i32::try_from(pgid).map_err(|_| OpError::bad_request("invalid process id"))?;
    match killpg(Pid::from_raw(pgid), signal) {
        // The group is already gone: nothing left to signal.
        Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
        Err(e) => Err(OpError::new(
            ErrorCode::Io,
            format!("cannot signal process group {pgid}: {e}"),
        )),
    }
}

/// Kills group `pgid` with SIGKILL on the agent's own account. A group that
/// has already gone is no failure; any other error is logged, as the group
/// may live on.
pub(crate) fn kill_group(pgid: u32) {
    if let Err(e) = signal_group(pgid, libc::SIGKILL) {
        tracing::warn!("SIGKILL not delivered: {e}");
    }
}

/// Waits until the killed process behind `exit` has been reaped; nobody
/// needs its status, so only a status that was lost is worth a line.
pub(crate) async fn wait_killed(exit: &ExitWatch) {
    if let Err(e) = exit.wait().await {
        tracing::debug!("after SIGKILL: {e}");
    }
}

/// [`kill_group`], then [`wait_killed`]: ends a process that was started
/// but is not wanted after all.
pub(crate) async fn kill_and_wait(pgid: u32, exit: &ExitWatch) {
    kill_group(pgid);
    wait_killed(exit).await;
}

/// Tells the output pumps of process `pid` that it has exited, then waits
/// until they have passed on what is left of its output.
pub(crate) async fn drain_output(
    exited: &watch::Sender<bool>,
    pumps: impl IntoIterator<Item = JoinHandle<()>>,
    pid: u32,
) {
    if exited.send(true).is_err() {
        tracing::trace!("the output of {pid} had already ended");
    }
    for pump in pumps {
        if let Err(e) = pump.await {
            tracing::warn!("an output pump of {pid} failed: {e}");
        }
    }
}

/// Protocol form of an exit status.
pub(crate) fn exit_status(
    status: std::process::ExitStatus,
    started: Instant,
    timed_out: bool,
) -> ExitStatus {
    ExitStatus {
        code: status.code(),
        signal: status.signal(),
        timed_out,
        duration_ms: started.elapsed().as_millis().min(u128::from(u64::MAX)) as u64,
    }
}

/// Reads from a process's output. Before `exited` turns true this is a
/// plain read; afterwards a read that waits longer than [`LINGER`] counts
/// as the end of the output. Returns 0 at the end.
pub(crate) async fn read_output<R: AsyncRead + Unpin>(
    pipe: &mut R,
    buf: &mut [u8],
    exited: &mut watch::Receiver<bool>,
) -> io::Result<usize> {
    loop {
        if *exited.borrow_and_update() {
            return match tokio::time::timeout(LINGER, pipe.read(buf)).await {
                Ok(result) => result,
                Err(_) => Ok(0),
            };
        }
        tokio::select! {
            result = pipe.read(buf) => return result,
            changed = exited.changed() => {
                if changed.is_err() {
                    // Nobody will report the exit; read as if it happened.
                    return match tokio::time::timeout(LINGER, pipe.read(buf)).await {
                        Ok(result) => result,
                        Err(_) => Ok(0),
                    };
                }
            }
        }
    }
}

/// The process-wide reaper; installs one in [`ReapMode::RegisteredOnly`]
/// when none is (host tests, embedders). As PID 1, `system::start` has
/// already installed it in [`ReapMode::All`].
pub(crate) fn reaper() -> io::Result<&'static Reaper> {
    if let Some(r) = Reaper::global() {
        return Ok(r);
    }
    match Reaper::install_global(ReapMode::RegisteredOnly) {
        Ok(r) => Ok(r),
        // Someone installed another mode in the meantime: use theirs.
        Err(e) => Reaper::global().ok_or_else(|| io::Error::other(e)),
    }
}

/// Spawns `cmd` through the global reaper. Never wait on the returned
/// child: its status comes through the [`ExitWatch`].
pub(crate) fn spawn(
    cmd: &mut std::process::Command,
) -> io::Result<(std::process::Child, ExitWatch)> {
    reaper()?.spawn(cmd)
}

/// Takes a child's piped stdin, stdout and stderr as tokio pipes (must run
/// inside the runtime).
pub(crate) fn async_pipes(
    child: &mut std::process::Child,
) -> io::Result<(
    Option<tokio::process::ChildStdin>,
    Option<tokio::process::ChildStdout>,
    Option<tokio::process::ChildStderr>,
)> {
    let stdin = child
        .stdin
        .take()
        .map(tokio::process::ChildStdin::from_std)
        .transpose()?;
    let stdout = child
        .stdout
        .take()
        .map(tokio::process::ChildStdout::from_std)
        .transpose()?;
    let stderr = child
        .stderr
        .take()
        .map(tokio::process::ChildStderr::from_std)
        .transpose()?;
    Ok((stdin, stdout, stderr))
}

/// Waits for the child behind `exit`, killing its process group with
/// SIGKILL when `timeout` passes first. Returns the status and whether it
/// timed out.
pub(crate) async fn wait_with_timeout(
    exit: &ExitWatch,
    pgid: u32,
    timeout: Option<Duration>,
) -> io::Result<(std::process::ExitStatus, bool)> {
    let Some(timeout) = timeout else {
        return Ok((exit.wait().await.map_err(io::Error::other)?, false));
    };
    match tokio::time::timeout(timeout, exit.wait()).await {
        Ok(status) => Ok((status.map_err(io::Error::other)?, false)),
        Err(_) => {
            kill_group(pgid);
            Ok((exit.wait().await.map_err(io::Error::other)?, true))
        }
    }
}
