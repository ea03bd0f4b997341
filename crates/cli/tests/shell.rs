//! `tine vm shell` on a pseudo-terminal: raw mode while it runs, the
//! terminal restored afterwards (also when the session fails), a resize
//! sent on SIGWINCH, and the shell's exit code; and with piped stdin.

#[path = "../../client/tests/support/fake_daemon.rs"]
mod fake_daemon;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fake_daemon::FakeDaemon;
use nix::pty::{openpty, Winsize};
use nix::sys::signal::{kill, Signal};
use nix::sys::termios::{tcgetattr, LocalFlags};
use nix::unistd::Pid;

/// `tine vm shell` running on a new pseudo-terminal.
struct OnPty {
    child: Child,
    master: File,
    slave: OwnedFd,
    output: Arc<Mutex<Vec<u8>>>,
}

fn spawn_shell(fake: &FakeDaemon) -> OnPty {
    let size = Winsize {
        ws_row: 24,
        ws_col: 80,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = openpty(Some(&size), None).expect("openpty");
    let stdio = |fd: &OwnedFd| Stdio::from(fd.try_clone().expect("dup"));
    let child = Command::new(env!("CARGO_BIN_EXE_tine"))
        .args(["--url", &fake.url(), "vm", "shell", "dev-1"])
        .stdin(stdio(&pty.slave))
        .stdout(stdio(&pty.slave))
        .stderr(stdio(&pty.slave))
        .spawn()
        .expect("spawn tine");
    let master = File::from(pty.master);
    let output = Arc::new(Mutex::new(Vec::new()));
    let mut reader = master.try_clone().expect("dup master");
    let sink = output.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().expect("lock").extend_from_slice(&buf[..n]);
        }
    });
    OnPty {
        child,
        master,
        slave: pty.slave,
        output,
    }
}

impl OnPty {
    async fn wait_for(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = String::from_utf8_lossy(&self.output.lock().expect("lock")).into_owned();
            if text.contains(needle) {
                return;
            }
            assert!(Instant::now() < deadline, "no {needle:?} in {text:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn type_in(&mut self, bytes: &[u8]) {
        self.master.write_all(bytes).expect("type");
        self.master.flush().expect("flush");
    }

    fn canonical(&self) -> bool {
        tcgetattr(&self.slave)
            .expect("tcgetattr")
            .local_flags
            .contains(LocalFlags::ICANON | LocalFlags::ECHO)
    }

    async fn exit_code(&mut self) -> i32 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code().expect("exit code");
            }
            assert!(Instant::now() < deadline, "tine vm shell did not exit");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test]
async fn shell_runs_raw_resizes_and_restores_the_terminal() {
    let fake = FakeDaemon::start(None).await;
    let mut pty = spawn_shell(&fake);
    assert!(pty.canonical(), "a new terminal starts cooked");
    pty.wait_for("welcome").await;
    assert_eq!(
        fake.last("/vm/dev-1/shell").uri,
        "/vm/dev-1/shell?rows=24&cols=80"
    );
    // Keys go through unchanged (no line editing): raw mode.
    pty.type_in(b"q");
    pty.wait_for("welcome\r\nq").await;
    assert!(!pty.canonical(), "raw while the shell runs");

    let size = Winsize {
        ws_row: 40,
        ws_col: 100,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from a live local; the fd is
    // the open master.
    let rc = unsafe { libc::ioctl(pty.master.as_raw_fd(), libc::TIOCSWINSZ, &size) };
    assert_eq!(rc, 0, "TIOCSWINSZ");
    let pid = Pid::from_raw(i32::try_from(pty.child.id()).expect("pid"));
    kill(pid, Signal::SIGWINCH).expect("SIGWINCH");
    pty.wait_for("resized 40 100").await;

    pty.type_in(b"exit\r");
    assert_eq!(pty.exit_code().await, 3, "the shell's own code");
    assert!(pty.canonical(), "terminal restored after the shell");
}

#[tokio::test]
async fn a_failed_session_still_restores_the_terminal() {
    let fake = FakeDaemon::start(None).await;
    let mut pty = spawn_shell(&fake);
    pty.wait_for("welcome").await;
    pty.type_in(b"drop\r");
    assert_eq!(pty.exit_code().await, 1);
    assert!(pty.canonical(), "terminal restored after the error");
    pty.wait_for("tine: the daemon closed the shell without its exit code")
        .await;
}

#[tokio::test]
async fn shell_takes_piped_input() {
    let fake = FakeDaemon::start(None).await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tine"))
        .args(["--url", &fake.url(), "vm", "shell", "dev-1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut stdin = child.stdin.take().expect("stdin");
    tokio::io::AsyncWriteExt::write_all(&mut stdin, b"exit\r")
        .await
        .expect("write");
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("in time")
        .expect("wait");
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("welcome"));
    assert!(fake
        .last("/vm/dev-1/shell")
        .uri
        .ends_with("?rows=24&cols=80"));
}
