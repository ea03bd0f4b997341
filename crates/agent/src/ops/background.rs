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

// A frame is one read of a pipe, sent as one data frame.
const _: () = assert!(READ_CHUNK <= MAX_DATA_CHUNK);

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

/// A byte ring that remembers the absolute offset of its first byte and
/// where each frame (one chunk of output, with its id) starts.
#[derive(Debug)]
struct Ring {
    buf: VecDeque<u8>,
    start: u64,
    cap: usize,
    /// `(id, absolute offset)` of each frame that still has bytes here.
    marks: VecDeque<(u64, u64)>,
    /// Most frames kept: past it the oldest go, with their bytes.
    max_marks: usize,
}

impl Ring {
    fn new(cap: usize) -> Self {
        Self {
            buf: VecDeque::new(),
            start: 0,
            cap,
            marks: VecDeque::new(),
            max_marks: (cap / 64).clamp(256, 65_536),
        }
    }

    fn end(&self) -> u64 {
        self.start + self.buf.len() as u64
    }

    /// Appends frame `id`.
    fn push(&mut self, id: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        self.marks.push_back((id, self.end()));
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
        // Frames whose bytes are all gone go; so do the oldest past the
        // frame limit, with their bytes.
        while self.marks.len() >= 2 && self.marks[1].1 <= self.start {
            self.marks.pop_front();
        }
        while self.marks.len() > self.max_marks {
            self.marks.pop_front();
            if let Some(&(_, offset)) = self.marks.front() {
                let cut = offset.saturating_sub(self.start) as usize;
                self.buf.drain(..cut.min(self.buf.len()));
                self.start = self.start.max(offset);
            }
        }
    }

    /// The frame holding the byte at `pos` (moved up to the oldest byte
    /// kept): its id, where `pos` lands in it, and where it ends.
    fn frame_at(&self, pos: u64) -> Option<(u64, u64, u64)> {
        let pos = pos.max(self.start);
        if pos >= self.end() {
            return None;
        }
        let i = self.marks.partition_point(|&(_, offset)| offset <= pos);
        let (id, _) = *self.marks.get(i.checked_sub(1)?)?;
        let end = self.marks.get(i).map_or(self.end(), |&(_, offset)| offset);
        Some((id, pos, end))
    }

    /// Where the first frame with an id of at least `id` starts (the end
    /// when there is none yet).
    fn offset_of(&self, id: u64) -> u64 {
        let i = self.marks.partition_point(|&(mark, _)| mark < id);
        self.marks
            .get(i)
            .map_or(self.end(), |&(_, offset)| offset.max(self.start))
    }

    /// The oldest frame id kept.
    fn first_id(&self) -> Option<u64> {
        self.marks.front().map(|&(id, _)| id)
    }

    /// The bytes from absolute offset `from` to `to` (both kept).
    fn read_range(&self, from: u64, to: u64) -> Vec<u8> {
        let a = from.saturating_sub(self.start) as usize;
        let b = (to.saturating_sub(self.start) as usize).min(self.buf.len());
        self.buf.range(a.min(b)..b).copied().collect()
    }
}

#[derive(Debug)]
struct JobState {
    stdout: Ring,
    stderr: Ring,
    exit: Option<ExitStatus>,
    /// The id of the next frame.
    next_id: u64,
    /// The exit's frame id, once it ended.
    exit_id: Option<u64>,
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
            let id = state.next_id;
            state.next_id += 1;
            match channel {
                Channel::Stderr => state.stderr.push(id, data),
                _ => state.stdout.push(id, data),
            }
        }
        self.changes.send_modify(|v| *v += 1);
    }

    fn finish(&self, exit: ExitStatus) {
        {
            let mut state = self.lock();
            state.exit = Some(exit);
            state.exit_id = Some(state.next_id);
            state.next_id += 1;
        }
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
            next_id: state.next_id,
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
            process::kill_group(pid);
            tokio::spawn(async move { process::wait_killed(&exit).await });
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
            next_id: 1,
            exit_id: None,
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
        process::drain_output(&exited_tx, [stdout, stderr], pid).await;
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
/// exits) as frames, each a [`Response::LogFrame`] with its id and one data
/// frame, in id order; then [`Response::LogsEnd`].
pub(crate) async fn logs(
    jobs: &Jobs,
    req: BgLogsRequest,
    tx: StreamSender,
    mut rx: StreamReceiver,
) -> Result<Response, OpError> {
    if req.from_id.is_some()
        && (req.stdout_from.is_some() || req.stderr_from.is_some() || req.tail_bytes.is_some())
    {
        return Err(OpError::bad_request(
            "from_id is a frame cursor: give it without stdout_from, stderr_from or tail_bytes",
        ));
    }
    let job = jobs.get(req.id)?;
    let mut changes = job.changes.subscribe();
    // Frames before `from_id` that arrive while following are skipped.
    let min_id = req.from_id.unwrap_or(0);
    let (mut out_pos, mut err_pos, mut dropped, dropped_frames) = {
        let state = job.lock();
        match req.from_id {
            Some(from) => {
                let oldest = [state.stdout.first_id(), state.stderr.first_id()]
                    .into_iter()
                    .flatten()
                    .min()
                    .or(state.exit_id)
                    .unwrap_or(state.next_id);
                (
                    state.stdout.offset_of(from),
                    state.stderr.offset_of(from),
                    0,
                    oldest.saturating_sub(from),
                )
            }
            None => {
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
                (out, err, out_dropped + err_dropped, 0)
            }
        }
    };
    tx.send_msg(&Response::LogsStart {
        stdout_from: out_pos,
        stderr_from: err_pos,
        dropped,
        dropped_frames,
    })
    .await
    .map_err(|_| OpError::cancelled())?;
    loop {
        changes.borrow_and_update();
        let (next, exited) = {
            let state = job.lock();
            for (ring, pos) in [(&state.stdout, &mut out_pos), (&state.stderr, &mut err_pos)] {
                if *pos < ring.start {
                    dropped += ring.start - *pos;
                    *pos = ring.start;
                }
            }
            let out = state.stdout.frame_at(out_pos);
            let err = state.stderr.frame_at(err_pos);
            let pick = match (out, err) {
                (Some(o), Some(e)) if e.0 < o.0 => Some((Channel::Stderr, e)),
                (Some(o), _) => Some((Channel::Stdout, o)),
                (None, Some(e)) => Some((Channel::Stderr, e)),
                (None, None) => None,
            };
            let next = pick.map(|(channel, (id, from, to))| {
                let ring = match channel {
                    Channel::Stderr => &state.stderr,
                    _ => &state.stdout,
                };
                (channel, id, to, ring.read_range(from, to))
            });
            (next, state.exit.is_some())
        };
        if let Some((channel, id, to, data)) = next {
            match channel {
                Channel::Stderr => err_pos = to,
                _ => out_pos = to,
            }
            if id < min_id {
                continue;
            }
            tx.send_msg(&Response::LogFrame { id })
                .await
                .map_err(|_| OpError::cancelled())?;
            tx.send_data_vec(channel, data)
                .await
                .map_err(|_| OpError::cancelled())?;
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
    let state = job.lock();
    Ok(Response::LogsEnd {
        stdout_to: out_pos,
        stderr_to: err_pos,
        dropped,
        exit: state.exit,
        next_id: state.exit_id.unwrap_or(state.next_id),
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
        ring.push(1, b"abc");
        ring.push(2, b"def");
        assert_eq!(ring.start, 2);
        assert_eq!(ring.end(), 6);
        // Frame 1 lost its head, frame 2 is whole.
        assert_eq!(ring.frame_at(0), Some((1, 2, 3)));
        assert_eq!(ring.read_range(2, 3), b"c".to_vec());
        assert_eq!(ring.frame_at(4), Some((2, 4, 6)));
        assert_eq!(ring.read_range(4, 6), b"ef".to_vec());
        assert_eq!(ring.frame_at(6), None);
        assert_eq!(
            (ring.offset_of(2), ring.offset_of(1), ring.offset_of(3)),
            (3, 2, 6)
        );
        // Once all of frame 1 is gone, so is its mark.
        ring.push(5, b"g");
        assert_eq!(ring.first_id(), Some(2));
        assert_eq!(ring.frame_at(0), Some((2, 3, 6)));
        assert_eq!(ring.frame_at(6), Some((5, 6, 7)));
    }

    #[test]
    fn test_ring_push_larger_than_cap_keeps_tail() {
        let mut ring = Ring::new(3);
        ring.push(1, b"x");
        ring.push(2, b"123456");
        assert_eq!(ring.first_id(), Some(2));
        assert_eq!(ring.frame_at(0), Some((2, 4, 7)));
        assert_eq!(ring.read_range(4, 7), b"456".to_vec());
    }

    #[test]
    fn test_ring_past_its_frame_limit_drops_the_oldest_frames_and_bytes() {
        let mut ring = Ring::new(1 << 20);
        let limit = ring.max_marks as u64;
        for id in 1..=limit + 10 {
            ring.push(id, b"z");
        }
        assert_eq!(ring.marks.len() as u64, limit);
        assert_eq!(ring.first_id(), Some(11));
        assert_eq!((ring.start, ring.end()), (10, limit + 10));
        assert_eq!(ring.frame_at(0), Some((11, 10, 11)));
    }
}
