//! Shell: a process on a new PTY. Terminal bytes travel raw on the data
//! channel both ways; the client resizes the window with
//! [`Control::Resize`].

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use nix::fcntl::OFlag;
use nix::pty::{grantpt, posix_openpt, ptsname_r, unlockpt};
use tine_proto::agent::mux::{Chunk, Inbound, StreamReceiver, StreamSender};
use tine_proto::agent::{Channel, Control, Response, ShellRequest};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, watch};

use tokio_util::task::AbortOnDropHandle;

use super::exec::{pump, write_input};
use super::process::{self, signal_group};
use crate::error::OpError;

/// The PTY master, shared by the output pump and the input writer.
#[derive(Clone)]
struct Pty(Arc<AsyncFd<OwnedFd>>);

impl Pty {
    fn set_size(&self, rows: u16, cols: u16) -> io::Result<()> {
        set_window_size(self.0.get_ref(), rows, cols)
    }
}

fn set_window_size(fd: &OwnedFd, rows: u16, cols: u16) -> io::Result<()> {
    let size = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` through the pointer, which
    // points to a live local; `fd` is an open PTY master.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &size) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl AsyncRead for Pty {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard
                .try_io(|fd| nix::unistd::read(fd.get_ref(), unfilled).map_err(io::Error::from))
            {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // Linux reports EIO once every slave descriptor is closed.
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Poll::Ready(Ok(())),
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for Pty {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.0.poll_write_ready(cx))?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), buf).map_err(io::Error::from))
            {
                Ok(result) => return Poll::Ready(result),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Opens a PTY pair: a non-blocking master and its slave, both close-on-exec.
fn open_pty(rows: u16, cols: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    let master =
        posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)?;
    grantpt(&master)?;
    unlockpt(&master)?;
    let name = ptsname_r(&master)?;
    let slave = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open(name)?;
    let master = OwnedFd::from(master);
    set_window_size(&master, rows, cols)?;
    Ok((master, OwnedFd::from(slave)))
}

fn default_argv(req: &ShellRequest) -> Vec<String> {
    let shell = req
        .options
        .env
        .get("SHELL")
        .cloned()
        .or_else(|| std::env::var("SHELL").ok())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| {
            if std::path::Path::new("/bin/bash").exists() {
                "/bin/bash".to_owned()
            } else {
                "/bin/sh".to_owned()
            }
        });
    vec![shell, "-l".to_owned()]
}

/// Runs the shell and returns [`Response::Exited`] when it has exited and
/// its output has drained. The session is killed when the client goes away.
pub(crate) async fn run(
    req: ShellRequest,
    tx: StreamSender,
    rx: StreamReceiver,
) -> Result<Response, OpError> {
    let argv = match &req.argv {
        Some(argv) if !argv.is_empty() => argv.clone(),
        Some(_) => return Err(OpError::bad_request("argv is empty")),
        None => default_argv(&req),
    };
    let (master, slave) = open_pty(req.rows, req.cols).map_err(|e| OpError::io("open PTY", &e))?;
    let mut env = BTreeMap::new();
    env.insert(
        "TERM".to_owned(),
        req.term
            .clone()
            .unwrap_or_else(|| "xterm-256color".to_owned()),
    );
    let mut cmd = process::build(&argv, &req.options, &env)?;
    let stdio = |fd: &OwnedFd| {
        fd.try_clone()
            .map(std::process::Stdio::from)
            .map_err(|e| OpError::io("duplicate PTY", &e))
    };
    cmd.stdin(stdio(&slave)?)
        .stdout(stdio(&slave)?)
        .stderr(stdio(&slave)?);
    // SAFETY: runs in the child between fork and exec, after stdio was set
    // up on 0/1/2; it only calls setsid and ioctl, which are
    // async-signal-safe, and touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            nix::unistd::setsid()?;
            if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let started = Instant::now();
    let (child, exit) = process::spawn(&mut cmd).map_err(|e| process::spawn_error(&argv[0], &e))?;
    // The slave must be closed here, or reading the master never ends.
    drop(cmd);
    drop(slave);
    let pid = child.id();
    drop(child);
    // SAFETY: `master` is an OwnedFd moved into the AsyncFd, so its
    // descriptor stays open and unchanged for the AsyncFd's whole life.
    let registered = unsafe { AsyncFd::register(master) };
    let pty =
        Pty(Arc::new(registered.map_err(|e| {
            OpError::io("register PTY", &io::Error::from(e))
        })?));

    if tx.send_msg(&Response::Started { pid }).await.is_err() {
        process::kill_and_wait(pid, &exit).await;
        return Err(OpError::cancelled());
    }
    let (exited_tx, exited_rx) = watch::channel(false);
    let output = tokio::spawn(pump(
        Some(pty.clone()),
        Channel::Data,
        tx.clone(),
        exited_rx,
    ));
    let control = tokio::spawn(control_loop(rx, pty, pid));
    let waited = exit.wait().await.map_err(io::Error::other);
    control.abort();
    process::drain_output(&exited_tx, [output], pid).await;
    let status = waited.map_err(|e| OpError::io(format_args!("waiting for shell {pid}"), &e))?;
    Ok(Response::Exited(process::exit_status(
        status, started, false,
    )))
}

async fn control_loop(mut rx: StreamReceiver, pty: Pty, pid: u32) {
    let (input_tx, input_rx) = mpsc::unbounded_channel::<Chunk>();
    let _writer = AbortOnDropHandle::new(tokio::spawn(write_input(pty.clone(), input_rx)));
    loop {
        match rx.recv().await {
            Some(Inbound::Data(Channel::Data, chunk)) => {
                if input_tx.send(chunk).is_err() {
                    tracing::trace!("input for {pid} dropped: its PTY writer has stopped");
                }
            }
            Some(Inbound::Msg(bytes)) => match serde_json::from_slice::<Control>(&bytes) {
                Ok(Control::Resize { rows, cols }) => {
                    if let Err(e) = pty.set_size(rows, cols) {
                        tracing::debug!("resize PTY of {pid}: {e}");
                    }
                }
                Ok(Control::Signal { signal }) => {
                    if let Err(e) = signal_group(pid, signal) {
                        tracing::debug!("signal {signal} to {pid}: {e}");
                    }
                }
                Err(_) => {}
            },
            Some(_) => {}
            None => {
                if let Err(e) = signal_group(pid, libc::SIGHUP) {
                    tracing::warn!("SIGHUP not delivered: {e}");
                }
                process::kill_group(pid);
                std::future::pending::<()>().await;
            }
        }
    }
}
