//! Foreground exec: a process with pipes, its stdin fed from the stream and
//! its stdout and stderr streamed back separately.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tine_proto::agent::mux::{Chunk, Inbound, StreamReceiver, StreamSender};
use tine_proto::agent::{Channel, Control, ExecRequest, Response};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio_util::task::AbortOnDropHandle;

use super::process::{self, read_output, signal_group};
use crate::error::OpError;

/// Bytes read from a pipe at a time.
pub(crate) const READ_CHUNK: usize = 64 << 10;

/// Runs the process and returns [`Response::Exited`] once it has exited and
/// both output channels have ended. The process group is killed when the
/// client closes the stream or vanishes first.
pub(crate) async fn run(
    req: ExecRequest,
    tx: StreamSender,
    rx: StreamReceiver,
) -> Result<Response, OpError> {
    let argv = process::argv(&req.command)?;
    let mut cmd = process::build(&argv, &req.options, &BTreeMap::new())?;
    cmd.process_group(0)
        .stdin(if req.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let (mut child, exit) =
        process::spawn(&mut cmd).map_err(|e| process::spawn_error(&argv[0], &e))?;
    drop(cmd);
    let pid = child.id();
    let pipes = process::async_pipes(&mut child);
    drop(child);
    let (stdin, stdout, stderr) = match pipes {
        Ok(pipes) => pipes,
        Err(e) => {
            process::kill_and_wait(pid, &exit).await;
            return Err(OpError::io("set up process pipes", &e));
        }
    };

    if tx.send_msg(&Response::Started { pid }).await.is_err() {
        process::kill_and_wait(pid, &exit).await;
        return Err(OpError::cancelled());
    }
    let (exited_tx, exited_rx) = watch::channel(false);
    let stdout = tokio::spawn(pump(stdout, Channel::Stdout, tx.clone(), exited_rx.clone()));
    let stderr = tokio::spawn(pump(stderr, Channel::Stderr, tx.clone(), exited_rx));
    let control = tokio::spawn(control_loop(rx, stdin, pid));

    let timeout = req.timeout_ms.map(Duration::from_millis);
    let waited = process::wait_with_timeout(&exit, pid, timeout).await;
    // The group leader is reaped: stop taking signals for its id.
    control.abort();
    process::drain_output(&exited_tx, [stdout, stderr], pid).await;
    let (status, timed_out) =
        waited.map_err(|e| OpError::io(format_args!("waiting for process {pid}"), &e))?;
    Ok(Response::Exited(process::exit_status(
        status, started, timed_out,
    )))
}

/// Streams one output pipe as `channel` frames, then its EOF.
pub(crate) async fn pump<R: AsyncRead + Unpin>(
    pipe: Option<R>,
    channel: Channel,
    tx: StreamSender,
    mut exited: watch::Receiver<bool>,
) {
    if let Some(mut pipe) = pipe {
        loop {
            let mut buf = vec![0u8; READ_CHUNK];
            match read_output(&mut pipe, &mut buf, &mut exited).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.send_data_vec(channel, buf).await.is_err() {
                        // The client is gone; the control loop kills the group.
                        return;
                    }
                }
            }
        }
    }
    if let Err(e) = tx.send_eof(channel).await {
        tracing::trace!("no EOF of {channel:?} for a client that has gone: {e}");
    }
}

/// Handles what the client sends after the request: stdin bytes and EOF,
/// and signals. Ends the process group when the client goes away.
pub(crate) async fn control_loop<W: AsyncWrite + Unpin + Send + 'static>(
    mut rx: StreamReceiver,
    stdin: Option<W>,
    pgid: u32,
) {
    let (input_tx, input_rx) = mpsc::unbounded_channel::<Chunk>();
    // Stdin is written by its own task so that a process that does not read
    // its input cannot hold up signals. Queued chunks keep their credit, so
    // the client's window bounds what waits here.
    let _writer =
        stdin.map(|stdin| AbortOnDropHandle::new(tokio::spawn(write_input(stdin, input_rx))));
    let mut input_tx = Some(input_tx);
    loop {
        match rx.recv().await {
            Some(Inbound::Data(Channel::Data, chunk)) => {
                if let Some(input) = &input_tx {
                    if input.send(chunk).is_err() {
                        tracing::trace!("input for {pgid} dropped: it has no stdin");
                    }
                }
            }
            Some(Inbound::Eof(Channel::Data)) => input_tx = None,
            Some(Inbound::Msg(bytes)) => match serde_json::from_slice::<Control>(&bytes) {
                Ok(Control::Signal { signal }) => {
                    if let Err(e) = signal_group(pgid, signal) {
                        tracing::debug!("signal {signal} to {pgid}: {e}");
                    }
                }
                Ok(Control::Resize { .. }) | Err(_) => {}
            },
            Some(_) => {}
            None => {
                process::kill_group(pgid);
                // Keep the writer alive until this task is aborted.
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Writes queued input to the process. After a write error (the process
/// closed its end) the rest is discarded so the client is never stuck.
pub(crate) async fn write_input<W: AsyncWrite + Unpin>(
    mut stdin: W,
    mut input: mpsc::UnboundedReceiver<Chunk>,
) {
    let mut open = true;
    while let Some(chunk) = input.recv().await {
        if open && stdin.write_all(&chunk).await.is_err() {
            open = false;
        }
    }
    if let Err(e) = stdin.shutdown().await {
        tracing::debug!("cannot close a process's stdin: {e}");
    }
}
