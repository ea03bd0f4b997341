//! The SIGCHLD-driven child reaper, and how exec code gets exit statuses
//! without racing it.
//!
//! As PID 1 the agent inherits every orphan in the guest, and their zombies
//! must be collected, so the reaper calls `waitpid(-1)` ([`ReapMode::All`]).
//! That would steal the exit status of any child some other code waits for,
//! so **every child the agent starts goes through the reaper**:
//!
//! ```no_run
//! # fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use std::process::Command;
//! use tine_agent::system::reaper::Reaper;
//! let reaper = Reaper::global().expect("installed by system::start");
//! let (child, exit) = reaper.spawn(Command::new("true").arg("x"))?;
//! // Use child.stdin/stdout/stderr; never child.wait()/try_wait()/output().
//! let status = exit.wait_blocking()?; // or `exit.wait().await` in async code
//! # drop(child); Ok(()) }
//! ```
//!
//! Children spawned another way (a PTY's `fork`) are registered with
//! [`Reaper::register_with`], which holds the registry lock across the
//! spawn so the reaper cannot collect the child before it is registered.
//! Prefer `std::process::Command` to tokio's: a dropped tokio `Child` goes
//! to tokio's orphan queue, which calls `waitpid` on its pid later and could
//! take the status of an unrelated child that reused that pid. For async
//! I/O, wrap the std pipes (`tokio::process::ChildStdout::from_std` etc.).
//! The status of an unregistered child is discarded (counted in
//! [`Reaper::unknown_reaped`]); a registered child whose status someone
//! else took is reported as [`ReaperError::Lost`] rather than never.
//!
//! Host-side tests that run the agent inside a test harness must not reap
//! the harness's children: they use [`ReapMode::RegisteredOnly`], which
//! waits only for registered pids.
//!
//! The signal handler only writes a byte to a pipe (through
//! signal-hook-registry, which chains with tokio's own SIGCHLD handler); a
//! thread named `tine-reaper` does the waiting, and also polls once a second
//! in case a wake-up was lost.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// Which children the reaper collects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReapMode {
    /// Every child (`waitpid(-1)`): the agent as PID 1 or as the owner of
    /// all its children.
    All,
    /// Only registered pids: the agent embedded in a process (a test
    /// harness) whose other children are waited for by other code.
    RegisteredOnly,
}

/// Errors from the reaper.
#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    /// The wake-up pipe could not be created.
    #[error("Cannot create the reaper's wake-up pipe")]
    Pipe(#[source] io::Error),
    /// The SIGCHLD handler could not be installed.
    #[error("Cannot install the SIGCHLD handler")]
    Signal(#[source] io::Error),
    /// The reaper thread could not be started.
    #[error("Cannot start the reaper thread")]
    Thread(#[source] io::Error),
    /// [`Reaper::install_global`] was called with a different mode.
    #[error("The global reaper is already installed in {0:?} mode")]
    ModeMismatch(ReapMode),
    /// The status was collected by someone else's `wait`, or the reaper
    /// was dropped.
    #[error("The exit status of pid {0} was lost (waited for elsewhere, or the reaper stopped)")]
    Lost(u32),
}

enum SlotState {
    Running,
    Exited(ExitStatus),
    Lost,
}

struct Slot {
    state: Mutex<SlotState>,
    cv: Condvar,
    notify: tokio::sync::Notify,
}

impl Slot {
    fn finish(&self, s: SlotState) {
        *lock(&self.state) = s;
        self.cv.notify_all();
        self.notify.notify_waiters();
    }
}

/// The exit status of one registered child, delivered by the reaper.
pub struct ExitWatch {
    pid: u32,
    slot: Arc<Slot>,
}

impl std::fmt::Debug for ExitWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExitWatch").field("pid", &self.pid).finish()
    }
}

impl ExitWatch {
    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn check(&self, state: &SlotState) -> Option<Result<ExitStatus, ReaperError>> {
        match state {
            SlotState::Running => None,
            SlotState::Exited(s) => Some(Ok(*s)),
            SlotState::Lost => Some(Err(ReaperError::Lost(self.pid))),
        }
    }

    /// The status if the child has exited, without waiting.
    pub fn try_status(&self) -> Result<Option<ExitStatus>, ReaperError> {
        self.check(&lock(&self.slot.state)).transpose()
    }

    /// Waits for the exit status, blocking the thread (use [`Self::wait`]
    /// in async code).
    pub fn wait_blocking(&self) -> Result<ExitStatus, ReaperError> {
        let mut g = lock(&self.slot.state);
        loop {
            if let Some(r) = self.check(&g) {
                return r;
            }
            g = self.slot.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits at most `timeout`; `Ok(None)` when the child is still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<Option<ExitStatus>, ReaperError> {
        let deadline = std::time::Instant::now() + timeout;
        let mut g = lock(&self.slot.state);
        loop {
            if let Some(r) = self.check(&g) {
                return r.map(Some);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            g = self
                .slot
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits for the exit status without blocking the runtime.
    pub async fn wait(&self) -> Result<ExitStatus, ReaperError> {
        loop {
            let notified = self.slot.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = self.check(&lock(&self.slot.state)) {
                return r;
            }
            notified.await;
        }
    }
}

struct Shared {
    mode: ReapMode,
    waiters: Mutex<HashMap<libc::pid_t, Arc<Slot>>>,
    unknown_reaped: AtomicU64,
    stop: AtomicBool,
    wake_w: OwnedFd,
}

impl Shared {
    fn wake(&self) {
        let b = 1u8;
        // SAFETY: wake_w is an open pipe we own; writing one byte from a
        // valid buffer. A full pipe (EAGAIN) already means "wake up".
        unsafe { libc::write(self.wake_w.as_raw_fd(), (&b as *const u8).cast(), 1) };
    }

    /// Collects what can be collected now; returns how many children.
    fn reap(&self) -> usize {
        let mut waiters = lock(&self.waiters);
        let mut n = 0;
        if self.mode == ReapMode::All {
            loop {
                let mut raw = 0;
                // SAFETY: waitpid writes the status into `raw`, a valid int.
                let pid = unsafe { libc::waitpid(-1, &mut raw, libc::WNOHANG) };
                if pid > 0 {
                    n += 1;
                    match waiters.remove(&pid) {
                        Some(slot) => slot.finish(SlotState::Exited(ExitStatus::from_raw(raw))),
                        None => {
                            self.unknown_reaped.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                } else if pid < 0 && last_errno() == Some(libc::EINTR) {
                    continue;
                } else {
                    break; // 0: none ready; ECHILD: no children.
                }
            }
        }
        // Registered pids one by one: in RegisteredOnly mode this is the
        // collection; in both modes a registered pid that is no longer our
        // child (ECHILD: someone else waited for it) is reported lost
        // instead of leaving its waiter hanging.
        let pids: Vec<libc::pid_t> = waiters.keys().copied().collect();
        for pid in pids {
            let mut raw = 0;
            let r = loop {
                // SAFETY: as above, for one registered pid.
                let r = unsafe { libc::waitpid(pid, &mut raw, libc::WNOHANG) };
                if r < 0 && last_errno() == Some(libc::EINTR) {
                    continue;
                }
                break r;
            };
            if r == pid {
                n += 1;
                if let Some(slot) = waiters.remove(&pid) {
                    slot.finish(SlotState::Exited(ExitStatus::from_raw(raw)));
                }
            } else if r < 0 {
                if let Some(slot) = waiters.remove(&pid) {
                    slot.finish(SlotState::Lost);
                }
            }
        }
        n
    }
}

fn last_errno() -> Option<i32> {
    io::Error::last_os_error().raw_os_error()
}

/// A running reaper: a SIGCHLD handler, a registry of pids and a thread.
/// Dropping it stops the thread; pending [`ExitWatch`]es then report
/// [`ReaperError::Lost`].
pub struct Reaper {
    shared: Arc<Shared>,
    sig: Option<signal_hook_registry::SigId>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper")
            .field("mode", &self.shared.mode)
            .finish()
    }
}

static GLOBAL: OnceLock<Reaper> = OnceLock::new();
static GLOBAL_INSTALL: Mutex<()> = Mutex::new(());

impl Reaper {
    /// Starts a reaper of its own (tests; the agent uses
    /// [`Self::install_global`]).
    pub fn start(mode: ReapMode) -> Result<Self, ReaperError> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two fds into the two-element array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
            return Err(ReaperError::Pipe(io::Error::last_os_error()));
        }
        // SAFETY: pipe2 succeeded, so both fds are open and ours alone.
        let (wake_r, wake_w) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let w = wake_w.as_raw_fd();
        let shared = Arc::new(Shared {
            mode,
            waiters: Mutex::new(HashMap::new()),
            unknown_reaped: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            wake_w,
        });
        // SAFETY: the action only calls write(2), which is async-signal-safe,
        // on a non-blocking pipe (signal-hook-registry saves errno). The fd
        // stays open until `shared` is dropped, which happens after the
        // action is unregistered in Drop (unregister waits for running
        // actions to leave).
        let sig = unsafe {
            signal_hook_registry::register(libc::SIGCHLD, move || {
                let b = 1u8;
                libc::write(w, (&b as *const u8).cast(), 1);
            })
        }
        .map_err(ReaperError::Signal)?;
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("tine-reaper".into())
            .spawn(move || run(thread_shared, wake_r));
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                signal_hook_registry::unregister(sig);
                return Err(ReaperError::Thread(e));
            }
        };
        // Children that died before the handler existed.
        shared.wake();
        Ok(Reaper {
            shared,
            sig: Some(sig),
            thread: Some(thread),
        })
    }

    /// Installs the process-wide reaper once, or returns the installed one
    /// when `mode` matches.
    pub fn install_global(mode: ReapMode) -> Result<&'static Reaper, ReaperError> {
        let _g = lock(&GLOBAL_INSTALL);
        if let Some(r) = GLOBAL.get() {
            return if r.mode() == mode {
                Ok(r)
            } else {
                Err(ReaperError::ModeMismatch(r.mode()))
            };
        }
        let r = Reaper::start(mode)?;
        Ok(GLOBAL.get_or_init(|| r))
    }

    /// The process-wide reaper, if installed.
    pub fn global() -> Option<&'static Reaper> {
        GLOBAL.get()
    }

    /// This reaper's mode.
    pub fn mode(&self) -> ReapMode {
        self.shared.mode
    }

    /// Spawns `cmd` and registers the child. Never call `wait`, `try_wait`
    /// or `output` on the returned `Child`: its status comes through the
    /// [`ExitWatch`].
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, ExitWatch)> {
        self.register_with(|| {
            let child = cmd.spawn()?;
            let pid = child.id();
            Ok((child, pid))
        })
    }

    /// Runs `spawn`, which starts one child and returns it with its pid,
    /// while holding the registry lock, then registers the pid. `spawn`
    /// must not use this reaper (it would deadlock).
    pub fn register_with<T>(
        &self,
        spawn: impl FnOnce() -> io::Result<(T, u32)>,
    ) -> io::Result<(T, ExitWatch)> {
        let mut waiters = lock(&self.shared.waiters);
        let (value, pid) = spawn()?;
        let raw = libc::pid_t::try_from(pid)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
        let slot = Arc::new(Slot {
            state: Mutex::new(SlotState::Running),
            cv: Condvar::new(),
            notify: tokio::sync::Notify::new(),
        });
        waiters.insert(raw, Arc::clone(&slot));
        drop(waiters);
        // In RegisteredOnly mode a child that already exited sent its
        // SIGCHLD before it was registered: look again.
        self.shared.wake();
        Ok((value, ExitWatch { pid, slot }))
    }

    /// Runs `cmd` to completion through this reaper, capturing stdout and
    /// stderr (stdin is /dev/null), like [`Command::output`].
    pub fn output(&self, cmd: &mut Command) -> io::Result<Output> {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let (mut child, exit) = self.spawn(cmd)?;
        let pid = child.id();
        let stderr = child.stderr.take();
        let err_thread = std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut e) = stderr {
                if let Err(err) = e.read_to_end(&mut buf) {
                    tracing::warn!("stderr of pid {pid} cut short: {err}");
                }
            }
            buf
        });
        let mut stdout = Vec::new();
        if let Some(mut o) = child.stdout.take() {
            if let Err(e) = o.read_to_end(&mut stdout) {
                tracing::warn!("stdout of pid {pid} cut short: {e}");
            }
        }
        let stderr = err_thread.join().unwrap_or_default();
        let status = exit.wait_blocking().map_err(io::Error::other)?;
        Ok(Output {
            status,
            stdout,
            stderr,
        })
    }

    /// Runs `cmd` to completion through this reaper, like
    /// [`Command::status`] (stdio as configured on `cmd`).
    pub fn status(&self, cmd: &mut Command) -> io::Result<ExitStatus> {
        let (_child, exit) = self.spawn(cmd)?;
        exit.wait_blocking().map_err(io::Error::other)
    }

    /// Collects exited children now, without waiting for SIGCHLD; returns
    /// how many.
    pub fn reap_now(&self) -> usize {
        self.shared.reap()
    }

    /// Exit statuses of children nobody registered, discarded so far.
    pub fn unknown_reaped(&self) -> u64 {
        self.shared.unknown_reaped.load(Ordering::Relaxed)
    }

    /// Registered children whose status has not arrived yet.
    pub fn pending(&self) -> usize {
        lock(&self.shared.waiters).len()
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(sig) = self.sig.take() {
            signal_hook_registry::unregister(sig);
        }
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::warn!("the reaper thread panicked");
            }
        }
        for (_, slot) in lock(&self.shared.waiters).drain() {
            slot.finish(SlotState::Lost);
        }
    }
}

fn run(shared: Arc<Shared>, wake_r: OwnedFd) {
    let mut buf = [0u8; 64];
    loop {
        let mut pfd = libc::pollfd {
            fd: wake_r.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; the timeout bounds the wait so a lost
        // wake-up delays reaping by a second at most.
        unsafe { libc::poll(&mut pfd, 1, 1000) };
        // SAFETY: reading into a valid buffer from our non-blocking pipe.
        while unsafe { libc::read(wake_r.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        shared.reap();
    }
}

/// Like [`Command::output`], through the global reaper when one is
/// installed (always use this in agent code instead of `Command::output`).
pub fn output(cmd: &mut Command) -> io::Result<Output> {
    match Reaper::global() {
        Some(r) => r.output(cmd),
        None => cmd.stdin(Stdio::null()).output(),
    }
}

/// Like [`Command::status`], through the global reaper when one is
/// installed.
pub fn status(cmd: &mut Command) -> io::Result<ExitStatus> {
    match Reaper::global() {
        Some(r) => r.status(cmd),
        None => cmd.status(),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("/bin/sh");
        c.arg("-c").arg(script);
        c
    }

    #[test]
    fn test_statuses_reach_the_right_waiters() {
        let r = Reaper::start(ReapMode::RegisteredOnly).expect("reaper");
        let mut watches = Vec::new();
        for code in 0..12 {
            // Staggered exits, in reverse order of spawning.
            let script = format!("sleep 0.{:02}; exit {code}", 60 - code * 5);
            let (_child, w) = r.spawn(&mut sh(&script)).expect("spawn");
            watches.push((code, w));
        }
        let (_c, killed) = r.spawn(&mut sh("kill -9 $$")).expect("spawn");
        for (code, w) in &watches {
            let st = w
                .wait_timeout(Duration::from_secs(10))
                .expect("status")
                .expect("exited");
            assert_eq!(st.code(), Some(*code), "pid {}", w.pid());
        }
        let st = killed.wait_blocking().expect("status");
        assert_eq!(st.signal(), Some(libc::SIGKILL));
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn test_async_wait_and_try_status() {
        let r = Reaper::start(ReapMode::RegisteredOnly).expect("reaper");
        let (_c, w) = r.spawn(&mut sh("sleep 0.2; exit 42")).expect("spawn");
        assert!(w.try_status().expect("ok").is_none());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let st = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), w.wait()).await })
            .expect("in time")
            .expect("status");
        assert_eq!(st.code(), Some(42));
        assert_eq!(
            w.try_status().expect("ok").map(|s| s.code()),
            Some(Some(42))
        );
    }

    #[test]
    fn test_child_that_exits_before_registration_finishes() {
        let r = Reaper::start(ReapMode::RegisteredOnly).expect("reaper");
        let (_c, w) = r
            .register_with(|| {
                let child = sh("exit 3").spawn()?;
                // Let it die and signal before the pid is registered.
                std::thread::sleep(Duration::from_millis(100));
                let pid = child.id();
                Ok((child, pid))
            })
            .expect("spawn");
        let st = w
            .wait_timeout(Duration::from_secs(5))
            .expect("ok")
            .expect("exited");
        assert_eq!(st.code(), Some(3));
    }

    #[test]
    fn test_registered_only_leaves_other_children_alone() {
        let r = Reaper::start(ReapMode::RegisteredOnly).expect("reaper");
        let mut other = sh("exit 9").spawn().expect("spawn");
        let (_c, w) = r.spawn(&mut sh("sleep 0.1")).expect("spawn");
        w.wait_blocking().expect("status");
        r.reap_now();
        // The unregistered child's status is still ours to collect.
        assert_eq!(other.wait().expect("wait").code(), Some(9));
        assert_eq!(r.unknown_reaped(), 0);
    }

    #[test]
    fn test_status_taken_by_someone_else_is_reported_lost() {
        let r = Reaper::start(ReapMode::RegisteredOnly).expect("reaper");
        let (mut child, w) = r
            .register_with(|| {
                let mut child = sh("exit 1").spawn()?;
                // Another waiter wins the race before registration ends.
                child.wait()?;
                let pid = child.id();
                Ok((child, pid))
            })
            .expect("spawn");
        assert!(matches!(
            w.wait_timeout(Duration::from_secs(5)),
            Err(ReaperError::Lost(_))
        ));
        assert!(child.try_wait().is_ok());
    }

    #[test]
    fn test_dropping_the_reaper_releases_waiters() {
        let r = Reaper::start(ReapMode::RegisteredOnly).expect("reaper");
        let (mut child, w) = r.spawn(&mut sh("sleep 30")).expect("spawn");
        drop(r);
        assert!(matches!(w.wait_blocking(), Err(ReaperError::Lost(_))));
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn test_output_captures_both_streams() {
        let r = Reaper::start(ReapMode::RegisteredOnly).expect("reaper");
        let out = r
            .output(&mut sh("echo out; echo err >&2; exit 4"))
            .expect("output");
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        assert_eq!(out.status.code(), Some(4));
    }
}
