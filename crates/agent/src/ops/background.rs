//! Background execs: processes that outlive the client that started them.
//! Their stdout and stderr go to bounded ring buffers addressed by absolute
//! byte offsets, so a client can reattach, tail, follow, wait and kill.

use std::collections::{BTreeMap, VecDeque};
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tine_proto::agent::mux::{StreamReceiver, StreamSender, MAX_DATA_CHUNK};
use tine_proto::agent::{
    BgJob, BgLogsRequest, BgWaitRequest, Channel, ErrorCode, ExecRequest, ExitStatus, Response,
};
use tokio::io::AsyncRead;
use tokio::sync::watch;

use super::exec::READ_CHUNK;
use super::process::{self, read_output, signal_group};
use crate::error::OpError;

/// Smallest ring a request may ask for.
const MIN_RING_BYTES: u64 = 4 << 10;
/// Largest ring a request may ask for (per stream).
const MAX_RING_BYTES: u64 = 64 << 20;

/// Limits on background execs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JobsConfig {
    /// Jobs remembered at once.
    pub(crate) max_jobs: usize,
    /// Ring bytes reserved by all jobs together.
    pub(crate) max_ring_total: u64,
}

/// A byte ring that remembers the absolute offset of its first byte.
#[derive(Debug)]
struct Ring {
    buf: VecDeque<u8>,
    start: u64,
    cap: usize,
}

impl Ring {
    fn new(cap: usize) -> Self {
        Self {
            buf: VecDeque::new(),
            start: 0,
            cap,
        }
    }

    fn end(&self) -> u64 {
        self.start + self.buf.len() as u64
    }

    fn push(&mut self, data: &[u8]) {
        let data = if data.len() > self.cap {
            self.start += (self.buf.len() + data.len() - self.cap) as u64;
            self.buf.clear();
            &data[data.len() - self.cap..]
        } else {
            data
        };
        self.buf.extend(data);
        let excess = self.buf.len().saturating_sub(self.cap);
        if excess > 0 {
            self.buf.drain(..excess);
            self.start += excess as u64;
        }
    }

    /// Up to `max` bytes from absolute offset `from` (moved forward to the
    /// oldest kept byte). Returns the offset actually used and the bytes.
    fn read(&self, from: u64, max: usize) -> (u64, Vec<u8>) {
        let from = from.clamp(self.start, self.end());
        let offset = (from - self.start) as usize;
        let len = (self.buf.len() - offset).min(max);
        (
            from,
            self.buf.range(offset..offset + len).copied().collect(),
        )
    }
}

#[derive(Debug)]
struct JobState {
    stdout: Ring,
    stderr: Ring,
    exit: Option<ExitStatus>,
}

/// One background exec.
#[derive(Debug)]
pub(crate) struct Job {
    id: u64,
    pid: u32,
    command: String,
    started_unix_ms: u64,
    ring_bytes: u64,
    state: Mutex<JobState>,
    /// Bumped on every change (output or exit) to wake followers.
    changes: watch::Sender<u64>,
}

impl Job {
    fn lock(&self) -> MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn append(&self, channel: Channel, data: &[u8]) {
        {
            let mut state = self.lock();
            match channel {
                Channel::Stderr => state.stderr.push(data),
                _ => state.stdout.push(data),
            }
        }
        self.changes.send_modify(|v| *v += 1);
    }

    fn finish(&self, exit: ExitStatus) {
        self.lock().exit = Some(exit);
        self.changes.send_modify(|v| *v += 1);
    }

    fn exit(&self) -> Option<ExitStatus> {
        self.lock().exit
    }

    fn info(&self) -> BgJob {
        let state = self.lock();
        BgJob {
            id: self.id,
            pid: self.pid,
            command: self.command.clone(),
            started_unix_ms: self.started_unix_ms,
            exit: state.exit,
            stdout_bytes: state.stdout.end(),
            stderr_bytes: state.stderr.end(),
            ring_bytes: self.ring_bytes,
        }
    }
}

#[derive(Debug)]
struct JobsInner {
    next_id: u64,
    jobs: BTreeMap<u64, Arc<Job>>,
    ring_reserved: u64,
}

/// Every background exec of the agent.
#[derive(Debug)]
pub(crate) struct Jobs {
    config: JobsConfig,
    inner: Mutex<JobsInner>,
}

impl Jobs {
    pub(crate) fn new(config: JobsConfig) -> Self {
        Self {
            config,
            inner: Mutex::new(JobsInner {
                next_id: 1,
                jobs: BTreeMap::new(),
                ring_reserved: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, JobsInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, id: u64) -> Result<Arc<Job>, OpError> {
        self.lock()
            .jobs
            .get(&id)
            .cloned()
            .ok_or_else(|| OpError::new(ErrorCode::NotFound, format!("no background exec {id}")))
    }

    /// Makes room for a job reserving `reserve` ring bytes, evicting the
    /// oldest finished jobs when needed.
    fn make_room(&self, inner: &mut JobsInner, reserve: u64) -> Result<(), OpError> {
        let fits = |inner: &JobsInner| {
            inner.jobs.len() < self.config.max_jobs
                && inner.ring_reserved + reserve <= self.config.max_ring_total
        };
        while !fits(inner) {
            let finished = inner
                .jobs
                .iter()
                .find(|(_, job)| job.exit().is_some())
                .map(|(id, _)| *id);
            let Some(id) = finished else {
                return Err(OpError::new(
                    ErrorCode::LimitExceeded,
                    format!(
                        "background exec limits reached ({} jobs, {} ring bytes); \
                         remove finished jobs or ask for smaller rings",
                        self.config.max_jobs, self.config.max_ring_total
                    ),
                ));
            };
            if let Some(job) = inner.jobs.remove(&id) {
                inner.ring_reserved -= 2 * job.ring_bytes;
            }
        }
        Ok(())
    }

    /// Lists every remembered job.
    pub(crate) fn list(&self) -> Response {
        let jobs: Vec<Arc<Job>> = self.lock().jobs.values().cloned().collect();
        Response::BgJobs {
            jobs: jobs.iter().map(|j| j.info()).collect(),
        }
    }

    /// Signals a running job's process group; a finished job is left alone.
    pub(crate) fn kill(&self, id: u64, signal: i32) -> Result<Response, OpError> {
        let job = self.get(id)?;
        if job.exit().is_none() {
            signal_group(job.pid, signal)?;
        }
        Ok(Response::Ok)
    }

    /// Forgets a finished job.
    pub(crate) fn remove(&self, id: u64) -> Result<Response, OpError> {
        let mut inner = self.lock();
        let job = inner
            .jobs
            .get(&id)
            .ok_or_else(|| OpError::new(ErrorCode::NotFound, format!("no background exec {id}")))?;
        if job.exit().is_none() {
            return Err(OpError::bad_request(format!(
                "background exec {id} is still running; kill it first"
            )));
        }
        let ring_bytes = job.ring_bytes;
        inner.jobs.remove(&id);
        inner.ring_reserved -= 2 * ring_bytes;
        Ok(Response::Ok)
    }
}

/// Starts a background exec and answers [`Response::BgStarted`].
pub(crate) async fn start(jobs: &Jobs, req: ExecRequest) -> Result<Response, OpError> {
    let ring_bytes = req
        .background
        .as_ref()
        .map(|b| b.ring_bytes)
        .unwrap_or(1 << 20)
        .clamp(MIN_RING_BYTES, MAX_RING_BYTES);
    let argv = process::argv(&req.command)?;
    let mut cmd = process::build(&argv, &req.options, &BTreeMap::new())?;
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());

    let mut inner = jobs.lock();
    jobs.make_room(&mut inner, 2 * ring_bytes)?;
    let started = Instant::now();
    let (mut child, exit) =
        process::spawn(&mut cmd).map_err(|e| process::spawn_error(&argv[0], &e))?;
    drop(cmd);
    let pid = child.id();
    let pipes = process::async_pipes(&mut child);
    drop(child);
    let (_, stdout, stderr) = match pipes {
        Ok(pipes) => pipes,
        Err(e) => {
            let _ = signal_group(pid, libc::SIGKILL);
            tokio::spawn(async move {
                let _ = exit.wait().await;
            });
            return Err(OpError::io("set up process pipes", &e));
        }
    };
    let id = inner.next_id;
    inner.next_id += 1;
    let (changes, _) = watch::channel(0);
    let job = Arc::new(Job {
        id,
        pid,
        command: process::describe(&req.command),
        started_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default(),
        ring_bytes,
        state: Mutex::new(JobState {
            stdout: Ring::new(ring_bytes as usize),
            stderr: Ring::new(ring_bytes as usize),
            exit: None,
        }),
        changes,
    });
    inner.jobs.insert(id, job.clone());
    inner.ring_reserved += 2 * ring_bytes;
    drop(inner);

    let timeout = req.timeout_ms.map(Duration::from_millis);
    tokio::spawn(async move {
        let (exited_tx, exited_rx) = watch::channel(false);
        let stdout = tokio::spawn(pump_ring(
            stdout,
            Channel::Stdout,
            job.clone(),
            exited_rx.clone(),
        ));
        let stderr = tokio::spawn(pump_ring(stderr, Channel::Stderr, job.clone(), exited_rx));
        let waited = process::wait_with_timeout(&exit, pid, timeout).await;
        let _ = exited_tx.send(true);
        let _ = stdout.await;
        let _ = stderr.await;
        let exit = match waited {
            Ok((status, timed_out)) => process::exit_status(status, started, timed_out),
            Err(e) => {
                tracing::warn!("waiting for background exec {pid}: {e}");
                ExitStatus::default()
            }
        };
        job.finish(exit);
    });
    Ok(Response::BgStarted { id, pid })
}

async fn pump_ring<R: AsyncRead + Unpin>(
    pipe: Option<R>,
    channel: Channel,
    job: Arc<Job>,
    mut exited: watch::Receiver<bool>,
) {
    let Some(mut pipe) = pipe else { return };
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        match read_output(&mut pipe, &mut buf, &mut exited).await {
            Ok(0) | Err(_) => return,
            Ok(n) => job.append(channel, &buf[..n]),
        }
    }
}

/// Sends a job's buffered output (and, with `follow`, new output until it
/// exits), then [`Response::LogsEnd`].
pub(crate) async fn logs(
    jobs: &Jobs,
    req: BgLogsRequest,
    tx: StreamSender,
    mut rx: StreamReceiver,
) -> Result<Response, OpError> {
    let job = jobs.get(req.id)?;
    let mut changes = job.changes.subscribe();
    let (mut out_pos, mut err_pos, mut dropped) = {
        let state = job.lock();
        let start = |ring: &Ring, from: Option<u64>| {
            let mut pos = from.unwrap_or(ring.start);
            if let Some(tail) = req.tail_bytes {
                pos = pos.max(ring.end().saturating_sub(tail));
            }
            let dropped = ring.start.saturating_sub(pos);
            (pos.clamp(ring.start, ring.end()), dropped)
        };
        let (out, out_dropped) = start(&state.stdout, req.stdout_from);
        let (err, err_dropped) = start(&state.stderr, req.stderr_from);
        (out, err, out_dropped + err_dropped)
    };
    tx.send_msg(&Response::LogsStart {
        stdout_from: out_pos,
        stderr_from: err_pos,
        dropped,
    })
    .await
    .map_err(|_| OpError::cancelled())?;
    loop {
        changes.borrow_and_update();
        let (out, err, exited) = {
            let state = job.lock();
            (
                state.stdout.read(out_pos, MAX_DATA_CHUNK),
                state.stderr.read(err_pos, MAX_DATA_CHUNK),
                state.exit.is_some(),
            )
        };
        let mut sent = false;
        for ((from, data), pos, channel) in [
            (out, &mut out_pos, Channel::Stdout),
            (err, &mut err_pos, Channel::Stderr),
        ] {
            dropped += from - *pos;
            *pos = from + data.len() as u64;
            if !data.is_empty() {
                sent = true;
                tx.send_data_vec(channel, data)
                    .await
                    .map_err(|_| OpError::cancelled())?;
            }
        }
        if sent {
            continue;
        }
        if !req.follow || exited {
            break;
        }
        tokio::select! {
            _ = changes.changed() => {}
            item = rx.recv() => if item.is_none() {
                return Err(OpError::cancelled());
            },
        }
    }
    Ok(Response::LogsEnd {
        stdout_to: out_pos,
        stderr_to: err_pos,
        dropped,
        exit: job.exit(),
    })
}

/// Waits for a job to exit and answers [`Response::Exited`].
pub(crate) async fn wait(
    jobs: &Jobs,
    req: BgWaitRequest,
    mut rx: StreamReceiver,
) -> Result<Response, OpError> {
    let job = jobs.get(req.id)?;
    let mut changes = job.changes.subscribe();
    let deadline = req
        .timeout_ms
        .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
    loop {
        changes.borrow_and_update();
        if let Some(exit) = job.exit() {
            return Ok(Response::Exited(exit));
        }
        let timeout = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = changes.changed() => {}
            () = timeout => {
                return Err(OpError::new(
                    ErrorCode::Timeout,
                    format!("background exec {} is still running", req.id),
                ));
            }
            item = rx.recv() => if item.is_none() {
                return Err(OpError::cancelled());
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_ring_keeps_last_cap_bytes_with_offsets() {
        let mut ring = Ring::new(4);
        ring.push(b"abc");
        ring.push(b"def");
        assert_eq!(ring.start, 2);
        assert_eq!(ring.end(), 6);
        assert_eq!(ring.read(0, 100), (2, b"cdef".to_vec()));
        assert_eq!(ring.read(4, 1), (4, b"e".to_vec()));
        assert_eq!(ring.read(9, 10), (6, Vec::new()));
    }

    #[test]
    fn test_ring_push_larger_than_cap_keeps_tail() {
        let mut ring = Ring::new(3);
        ring.push(b"x");
        ring.push(b"123456");
        assert_eq!(ring.read(0, 10), (4, b"456".to_vec()));
    }
}
