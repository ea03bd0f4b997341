//! Client for the guest agent protocol (docs/agent-protocol.md): one method
//! per operation, over any `AsyncRead + AsyncWrite` transport. Many calls
//! can run at once on one [`AgentClient`]; each gets its own stream.
//!
//! The agent is the guest's: code in the VM can replace it. [`Limits`] put
//! host-side deadlines on its answers and a cap on what a download brings;
//! a download that ends before the size the agent announced is an error.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tine_proto::agent::mux::{Inbound, Mux, MuxConfig, MuxError, StreamReceiver, StreamSender};
use tine_proto::agent::{
    client_handshake, AuthorizedKeysRequest, BackgroundOptions, BgIdRequest, BgJob, BgKillRequest,
    BgLogsRequest, BgWaitRequest, Channel, CloseReason, Control, DirEntry, DownloadTarRequest,
    ErrorCode, ExecRequest, ExitStatus, FileAttrs, FileStat, FixupReport, FixupRequest,
    ForwardRequest, ForwardTarget, GuestStats, HandshakeError, Health, Hello, KeysReport,
    MkdirRequest, NetworkRequest, PathRequest, RemoveRequest, Request, Response, SecretFile,
    SecretsReport, SecretsSyncRequest, ShellRequest, ShutdownAction, ShutdownRequest, StatRequest,
    UploadRequest, UploadTarRequest, UserdataRunRequest, UserdataStatus, WatchEvent, WatchRequest,
    Welcome, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes read from a local source per data frame.
const SEND_CHUNK: usize = 128 << 10;

/// The default cap on the bytes one download (a file or a tar) may bring:
/// 16 GiB.
pub const DEFAULT_DOWNLOAD_LIMIT: u64 = 16 << 30;

/// Host-side limits on an agent, set with [`AgentClient::with_limits`].
/// The defaults set no deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The longest wait for an answer that needs no long work: the answer
    /// of a one-answer call (health, stat, bg_list, ...; bg_wait gets its
    /// own timeout on top), each answer of a list, and the first answer of
    /// a stream (exec's and shell's `started`, a download's file info,
    /// forward's `connected`, bg_logs' start). A running process's output
    /// has no deadline.
    pub reply: Option<Duration>,
    /// The longest wait for progress of a file transfer: each frame of a
    /// download, each wait for flow-control credit of an upload, and the
    /// answer after an upload's last byte (it may wait for an fsync).
    pub transfer: Option<Duration>,
    /// Most bytes one download may bring ([`DEFAULT_DOWNLOAD_LIMIT`]).
    pub download_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            reply: None,
            transfer: None,
            download_bytes: DEFAULT_DOWNLOAD_LIMIT,
        }
    }
}

/// Runs `call`, giving up with [`ClientError::Timeout`] after `limit`.
async fn within<T>(limit: Option<Duration>, call: impl Future<Output = Result<T>>) -> Result<T> {
    match limit {
        None => call.await,
        Some(after) => tokio::time::timeout(after, call)
            .await
            .unwrap_or(Err(ClientError::Timeout { after })),
    }
}

/// Errors from agent calls.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The agent's socket could not be reached.
    #[error("Cannot connect to the agent at {}", path.display())]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The version handshake failed.
    #[error("Agent handshake failed")]
    Handshake(#[from] HandshakeError),
    /// The agent reported an error for this call.
    #[error("Agent error ({code}): {message}")]
    Agent {
        /// The agent's error code.
        code: ErrorCode,
        /// The agent's message.
        message: String,
    },
    /// The connection to the agent is gone.
    #[error("Connection to the agent lost: {0}")]
    ConnectionLost(CloseReason),
    /// The agent closed the call's stream without a final message.
    #[error("The agent ended the call without an answer")]
    StreamEnded,
    /// The agent answered with a message this call does not expect.
    #[error("Unexpected answer from the agent: {0}")]
    Unexpected(String),
    /// Sending on the connection failed.
    #[error("Sending to the agent failed")]
    Send(#[source] MuxError),
    /// The agent did not answer, or a transfer made no progress, in time
    /// (see [`Limits`]).
    #[error("The agent did not answer within {after:?}")]
    Timeout {
        /// The limit that passed.
        after: Duration,
    },
    /// A download ended before the size the agent announced.
    #[error("The download ended after {received} of the {expected} bytes the agent announced")]
    Truncated {
        /// The size in the agent's file info.
        expected: u64,
        /// The bytes that came.
        received: u64,
    },
    /// A download brought more than [`Limits::download_bytes`].
    #[error("The download exceeds the limit of {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: u64,
    },
    /// Reading or writing a local source or sink failed.
    #[error("Local I/O failed")]
    Io(#[source] io::Error),
}

impl ClientError {
    /// The agent's error code, when the agent reported the error.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Agent { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl From<MuxError> for ClientError {
    fn from(err: MuxError) -> Self {
        match err {
            MuxError::ConnectionLost(reason) => Self::ConnectionLost(reason),
            other => Self::Send(other),
        }
    }
}

/// Result of agent calls.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

fn ended(rx: &StreamReceiver) -> ClientError {
    match rx.connection_error() {
        Some(reason) => ClientError::ConnectionLost(reason),
        None => ClientError::StreamEnded,
    }
}

fn parse_response(bytes: &[u8]) -> Result<Response> {
    match serde_json::from_slice::<Response>(bytes) {
        Ok(Response::Error(e)) => Err(ClientError::Agent {
            code: e.code,
            message: e.message,
        }),
        Ok(response) => Ok(response),
        Err(e) => Err(ClientError::Unexpected(format!("undecodable message: {e}"))),
    }
}

fn unexpected(response: Response) -> ClientError {
    ClientError::Unexpected(format!("{response:?}"))
}

/// Waits for the next control message, skipping data.
async fn next_response(rx: &mut StreamReceiver) -> Result<Response> {
    loop {
        match rx.recv().await {
            Some(Inbound::Msg(bytes)) => return parse_response(&bytes),
            Some(_) => {}
            None => return Err(ended(rx)),
        }
    }
}

/// What a finished exec produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOutput {
    /// Everything written to stdout.
    pub stdout: Vec<u8>,
    /// Everything written to stderr.
    pub stderr: Vec<u8>,
    /// How the process ended.
    pub status: ExitStatus,
}

impl ExecOutput {
    /// Stdout as text (invalid UTF-8 replaced).
    pub fn stdout_lossy(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Stderr as text (invalid UTF-8 replaced).
    pub fn stderr_lossy(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// One event of a running exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// Bytes from stdout, in order.
    Stdout(Vec<u8>),
    /// Bytes from stderr, in order.
    Stderr(Vec<u8>),
    /// The process ended; the last event.
    Exit(ExitStatus),
}

/// Sends input and signals to a running exec or shell from any task.
#[derive(Debug, Clone)]
pub struct ProcessControl {
    tx: StreamSender,
}

impl ProcessControl {
    /// Writes bytes to the process's stdin (exec) or terminal (shell).
    pub async fn write(&self, data: &[u8]) -> Result<()> {
        Ok(self.tx.send_data(Channel::Data, data).await?)
    }

    /// Ends the process's stdin (exec).
    pub async fn close_stdin(&self) -> Result<()> {
        Ok(self.tx.send_eof(Channel::Data).await?)
    }

    /// Sends a signal to the process group.
    pub async fn signal(&self, signal: i32) -> Result<()> {
        Ok(self.tx.send_msg(&Control::Signal { signal }).await?)
    }

    /// Resizes the terminal (shell).
    pub async fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        Ok(self.tx.send_msg(&Control::Resize { rows, cols }).await?)
    }
}

/// A running exec. Dropping it before the exit kills the process group.
#[derive(Debug)]
pub struct Execution {
    pid: u32,
    control: ProcessControl,
    rx: StreamReceiver,
    done: bool,
}

impl Execution {
    /// The process id (also its process group id) in the guest.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// A handle for stdin and signals that can move to another task.
    pub fn control(&self) -> ProcessControl {
        self.control.clone()
    }

    /// Writes to stdin (the request must have asked for stdin).
    pub async fn write_stdin(&self, data: &[u8]) -> Result<()> {
        self.control.write(data).await
    }

    /// Ends stdin.
    pub async fn close_stdin(&self) -> Result<()> {
        self.control.close_stdin().await
    }

    /// Sends a signal to the process group.
    pub async fn signal(&self, signal: i32) -> Result<()> {
        self.control.signal(signal).await
    }

    /// The next output chunk or the exit; `None` after the exit.
    pub async fn next_event(&mut self) -> Result<Option<ExecEvent>> {
        if self.done {
            return Ok(None);
        }
        loop {
            match self.rx.recv().await {
                Some(Inbound::Data(Channel::Stdout, chunk)) => {
                    return Ok(Some(ExecEvent::Stdout(chunk.into_vec())))
                }
                Some(Inbound::Data(Channel::Stderr, chunk)) => {
                    return Ok(Some(ExecEvent::Stderr(chunk.into_vec())))
                }
                Some(Inbound::Msg(bytes)) => match parse_response(&bytes) {
                    Ok(Response::Exited(status)) => {
                        self.done = true;
                        return Ok(Some(ExecEvent::Exit(status)));
                    }
                    Ok(other) => return Err(unexpected(other)),
                    Err(e) => {
                        self.done = true;
                        return Err(e);
                    }
                },
                Some(_) => {}
                None => {
                    self.done = true;
                    return Err(ended(&self.rx));
                }
            }
        }
    }

    /// Collects all output until the exit.
    pub async fn wait_with_output(mut self) -> Result<ExecOutput> {
        let mut output = ExecOutput::default();
        while let Some(event) = self.next_event().await? {
            match event {
                ExecEvent::Stdout(data) => output.stdout.extend_from_slice(&data),
                ExecEvent::Stderr(data) => output.stderr.extend_from_slice(&data),
                ExecEvent::Exit(status) => output.status = status,
            }
        }
        Ok(output)
    }
}

/// One event of a shell session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShellEvent {
    /// Terminal output.
    Output(Vec<u8>),
    /// The shell ended; the last event.
    Exit(ExitStatus),
}

/// A shell on a PTY. Dropping it before the exit kills the session.
#[derive(Debug)]
pub struct ShellSession {
    pid: u32,
    control: ProcessControl,
    rx: StreamReceiver,
    done: bool,
}

impl ShellSession {
    /// The shell's process id (also its session id).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// A handle for input, resizes and signals that can move to another task.
    pub fn control(&self) -> ProcessControl {
        self.control.clone()
    }

    /// Writes terminal input.
    pub async fn write(&self, data: &[u8]) -> Result<()> {
        self.control.write(data).await
    }

    /// Resizes the terminal.
    pub async fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        self.control.resize(rows, cols).await
    }

    /// The next output or the exit; `None` after the exit.
    pub async fn next_event(&mut self) -> Result<Option<ShellEvent>> {
        if self.done {
            return Ok(None);
        }
        loop {
            match self.rx.recv().await {
                Some(Inbound::Data(_, chunk)) => {
                    return Ok(Some(ShellEvent::Output(chunk.into_vec())))
                }
                Some(Inbound::Msg(bytes)) => {
                    self.done = true;
                    return match parse_response(&bytes)? {
                        Response::Exited(status) => Ok(Some(ShellEvent::Exit(status))),
                        other => Err(unexpected(other)),
                    };
                }
                Some(Inbound::Eof(_)) => {}
                None => {
                    self.done = true;
                    return Err(ended(&self.rx));
                }
            }
        }
    }
}

/// A connected forward. Use [`ForwardStream::bridge`] to join it to a local
/// socket, or read and write it directly.
#[derive(Debug)]
pub struct ForwardStream {
    tx: StreamSender,
    rx: StreamReceiver,
    remote_eof: bool,
}

impl ForwardStream {
    /// Sends bytes to the guest socket.
    pub async fn write(&self, data: &[u8]) -> Result<()> {
        Ok(self.tx.send_data(Channel::Data, data).await?)
    }

    /// Half-closes: the guest socket sees EOF.
    pub async fn shutdown_write(&self) -> Result<()> {
        Ok(self.tx.send_eof(Channel::Data).await?)
    }

    /// Bytes from the guest socket; `None` once it has sent EOF.
    pub async fn read(&mut self) -> Result<Option<Vec<u8>>> {
        if self.remote_eof {
            return Ok(None);
        }
        loop {
            match self.rx.recv().await {
                Some(Inbound::Data(_, chunk)) => return Ok(Some(chunk.into_vec())),
                Some(Inbound::Eof(_)) => {
                    self.remote_eof = true;
                    return Ok(None);
                }
                Some(Inbound::Msg(bytes)) => {
                    // An error ends the forward; `ok` comes after both EOFs.
                    parse_response(&bytes)?;
                }
                None => return Err(ended(&self.rx)),
            }
        }
    }

    /// Copies bytes both ways between the guest socket and `io` until both
    /// directions have ended. Returns (bytes sent to the guest, bytes
    /// received from it).
    pub async fn bridge<S: AsyncRead + AsyncWrite>(mut self, io: S) -> Result<(u64, u64)> {
        let (mut local_rx, mut local_tx) = tokio::io::split(io);
        let tx = self.tx.clone();
        let upstream = async {
            let mut sent = 0u64;
            let mut buf = vec![0u8; SEND_CHUNK];
            loop {
                let n = local_rx.read(&mut buf).await.map_err(ClientError::Io)?;
                if n == 0 {
                    tx.send_eof(Channel::Data).await?;
                    return Ok::<u64, ClientError>(sent);
                }
                tx.send_data(Channel::Data, &buf[..n]).await?;
                sent += n as u64;
            }
        };
        let downstream = async {
            let mut received = 0u64;
            while let Some(data) = self.read().await? {
                local_tx.write_all(&data).await.map_err(ClientError::Io)?;
                received += data.len() as u64;
            }
            local_tx.shutdown().await.map_err(ClientError::Io)?;
            Ok::<u64, ClientError>(received)
        };
        let (sent, received) = tokio::try_join!(upstream, downstream)?;
        Ok((sent, received))
    }
}

/// A running file-system watch ([`AgentClient::watch`]).
#[derive(Debug)]
pub struct FsWatch {
    _tx: StreamSender,
    rx: StreamReceiver,
    watched: u64,
}

impl FsWatch {
    /// Directories (and files) the agent watches.
    pub fn watched(&self) -> u64 {
        self.watched
    }

    /// The next batch of changes, oldest first; `None` if the agent ended
    /// the watch without an error.
    pub async fn next_batch(&mut self) -> Result<Option<Vec<WatchEvent>>> {
        loop {
            match self.rx.recv().await {
                Some(Inbound::Msg(bytes)) => match parse_response(&bytes)? {
                    Response::WatchEvents { events } => return Ok(Some(events)),
                    Response::Ok => return Ok(None),
                    other => return Err(unexpected(other)),
                },
                Some(_) => {}
                None => return Err(ended(&self.rx)),
            }
        }
    }
}

/// Streams a background exec's output.
#[derive(Debug)]
pub struct BgLogs {
    /// Offset of the first stdout byte that will be sent.
    pub stdout_from: u64,
    /// Offset of the first stderr byte that will be sent.
    pub stderr_from: u64,
    /// Frames before the requested `from_id` that had left the rings.
    pub dropped_frames: u64,
    rx: StreamReceiver,
    _tx: StreamSender,
    done: bool,
    /// The id the agent gave the data that comes next (0: none given).
    frame_id: u64,
}

/// The end of a logs stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogsEnd {
    /// Resume stdout from here.
    pub stdout_to: u64,
    /// Resume stderr from here.
    pub stderr_to: u64,
    /// Requested bytes that had left the rings.
    pub dropped: u64,
    /// How the process ended, if it has.
    pub exit: Option<ExitStatus>,
    /// The next frame's id (the exit's once it ended): resume from here
    /// with `from_id`.
    pub next_id: u64,
}

/// One event of a logs stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogEvent {
    /// A frame of stdout bytes.
    Stdout {
        /// The frame's id (0 from an agent that gives none).
        id: u64,
        /// The bytes.
        data: Vec<u8>,
    },
    /// A frame of stderr bytes.
    Stderr {
        /// The frame's id (0 from an agent that gives none).
        id: u64,
        /// The bytes.
        data: Vec<u8>,
    },
    /// The end; the last event.
    End(LogsEnd),
}

/// Collected output of a background exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BgOutput {
    /// Stdout bytes sent.
    pub stdout: Vec<u8>,
    /// Stderr bytes sent.
    pub stderr: Vec<u8>,
    /// Offsets and exit.
    pub end: LogsEnd,
}

impl BgLogs {
    /// The next event; `None` after [`LogEvent::End`].
    pub async fn next_event(&mut self) -> Result<Option<LogEvent>> {
        if self.done {
            return Ok(None);
        }
        loop {
            match self.rx.recv().await {
                Some(Inbound::Data(channel, chunk)) => {
                    let id = std::mem::take(&mut self.frame_id);
                    let data = chunk.into_vec();
                    return Ok(Some(match channel {
                        Channel::Stderr => LogEvent::Stderr { id, data },
                        _ => LogEvent::Stdout { id, data },
                    }));
                }
                Some(Inbound::Msg(bytes)) => match parse_response(&bytes) {
                    Ok(Response::LogFrame { id }) => self.frame_id = id,
                    other => {
                        self.done = true;
                        return match other? {
                            Response::LogsEnd {
                                stdout_to,
                                stderr_to,
                                dropped,
                                exit,
                                next_id,
                            } => Ok(Some(LogEvent::End(LogsEnd {
                                stdout_to,
                                stderr_to,
                                dropped,
                                exit,
                                next_id,
                            }))),
                            other => Err(unexpected(other)),
                        };
                    }
                },
                Some(Inbound::Eof(_)) => {}
                None => {
                    self.done = true;
                    return Err(ended(&self.rx));
                }
            }
        }
    }

    /// Collects everything until the end.
    pub async fn collect(mut self) -> Result<BgOutput> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        while let Some(event) = self.next_event().await? {
            match event {
                LogEvent::Stdout { data, .. } => stdout.extend_from_slice(&data),
                LogEvent::Stderr { data, .. } => stderr.extend_from_slice(&data),
                LogEvent::End(end) => {
                    return Ok(BgOutput {
                        stdout,
                        stderr,
                        end,
                    })
                }
            }
        }
        Err(ClientError::StreamEnded)
    }
}

/// Counts from a tar transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TarSummary {
    /// Entries packed or unpacked.
    pub entries: u64,
    /// Entries skipped (sockets, devices and the like).
    pub skipped: u64,
}

/// A connection to an agent.
#[derive(Debug, Clone)]
pub struct AgentClient {
    mux: Mux,
    welcome: Welcome,
    limits: Limits,
}

impl AgentClient {
    /// Connects to an agent listening on a Unix socket.
    pub async fn connect_unix(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let stream = tokio::net::UnixStream::connect(path)
            .await
            .map_err(|source| ClientError::Connect {
                path: path.to_path_buf(),
                source,
            })?;
        Self::handshake(stream).await
    }

    /// Runs the handshake over an already connected transport (a vsock
    /// stream after `CONNECT`, a Unix socket, an in-memory pipe).
    pub async fn handshake<S>(mut io: S) -> Result<Self>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            client: format!("tine-client {}", env!("CARGO_PKG_VERSION")),
        };
        let welcome = client_handshake(&mut io, &hello).await?;
        let mux = Mux::client(io, MuxConfig::default());
        Ok(Self {
            mux,
            welcome,
            limits: Limits::default(),
        })
    }

    /// The same connection with these limits on its calls (clones share
    /// the connection, each keeps its own limits).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// The limits on this client's calls.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The next control message within the reply limit.
    async fn reply(&self, rx: &mut StreamReceiver) -> Result<Response> {
        within(self.limits.reply, next_response(rx)).await
    }

    /// The next control message within the transfer limit.
    async fn transfer_reply(&self, rx: &mut StreamReceiver) -> Result<Response> {
        within(self.limits.transfer, next_response(rx)).await
    }

    /// What the agent said in the handshake (its versions and limits).
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// Why the connection ended, once it has.
    pub fn closed(&self) -> Option<CloseReason> {
        self.mux.closed()
    }

    async fn open(&self, request: &Request) -> Result<(StreamSender, StreamReceiver)> {
        let stream = self.mux.open_with_msg(request)?;
        Ok(stream.split())
    }

    /// Sends a request and returns its single answer.
    async fn call(&self, request: &Request) -> Result<Response> {
        let (_tx, mut rx) = self.open(request).await?;
        self.reply(&mut rx).await
    }

    async fn call_ok(&self, request: &Request) -> Result<()> {
        match self.call(request).await? {
            Response::Ok => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Agent and system health.
    pub async fn health(&self) -> Result<Health> {
        match self.call(&Request::Health).await? {
            Response::Health(health) => Ok(health),
            other => Err(unexpected(other)),
        }
    }

    /// Starts a process and returns a handle that streams its events.
    /// `req.background` must be unset (see [`AgentClient::exec_background`]).
    pub async fn exec(&self, req: ExecRequest) -> Result<Execution> {
        let (tx, mut rx) = self.open(&Request::Exec(req)).await?;
        match self.reply(&mut rx).await? {
            Response::Started { pid } => Ok(Execution {
                pid,
                control: ProcessControl { tx },
                rx,
                done: false,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// Runs a process to completion and collects its output. When the
    /// request asks for stdin, stdin is closed at once.
    pub async fn exec_output(&self, req: ExecRequest) -> Result<ExecOutput> {
        let wants_stdin = req.stdin;
        let execution = self.exec(req).await?;
        if wants_stdin {
            execution.close_stdin().await?;
        }
        execution.wait_with_output().await
    }

    /// Runs a process with `input` as its stdin and collects its output.
    /// Input is sent while output is read, so large amounts of both work.
    pub async fn exec_output_with_input(
        &self,
        req: ExecRequest,
        input: &[u8],
    ) -> Result<ExecOutput> {
        let execution = self.exec(req.with_stdin()).await?;
        let control = execution.control();
        let feed = async {
            // A process that exits without reading everything closes the
            // stream early; its output still counts.
            if control.write(input).await.is_ok() {
                if let Err(e) = control.close_stdin().await {
                    tracing::debug!("exec: cannot close the process's stdin: {e}");
                }
            }
            Ok::<(), ClientError>(())
        };
        let (_, output) = tokio::try_join!(feed, execution.wait_with_output())?;
        Ok(output)
    }

    /// Starts a background exec; returns its id and pid. Its output is kept
    /// in rings of `ring_bytes` per stream (1 MiB when `None`).
    pub async fn exec_background(
        &self,
        mut req: ExecRequest,
        ring_bytes: Option<u64>,
    ) -> Result<(u64, u32)> {
        let mut options = BackgroundOptions::default();
        if let Some(ring_bytes) = ring_bytes {
            options.ring_bytes = ring_bytes;
        }
        req.background = Some(options);
        req.stdin = false;
        match self.call(&Request::Exec(req)).await? {
            Response::BgStarted { id, pid } => Ok((id, pid)),
            other => Err(unexpected(other)),
        }
    }

    /// Every background exec the agent remembers.
    pub async fn bg_list(&self) -> Result<Vec<BgJob>> {
        match self.call(&Request::BgList).await? {
            Response::BgJobs { jobs } => Ok(jobs),
            other => Err(unexpected(other)),
        }
    }

    /// Streams a background exec's output (set `follow` to keep streaming
    /// until it exits).
    pub async fn bg_logs(&self, req: BgLogsRequest) -> Result<BgLogs> {
        let (tx, mut rx) = self.open(&Request::BgLogs(req)).await?;
        match self.reply(&mut rx).await? {
            Response::LogsStart {
                stdout_from,
                stderr_from,
                dropped_frames,
                ..
            } => Ok(BgLogs {
                stdout_from,
                stderr_from,
                dropped_frames,
                rx,
                _tx: tx,
                done: false,
                frame_id: 0,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// Waits for a background exec to exit (an error with
    /// [`ErrorCode::Timeout`] when `timeout` passes first).
    pub async fn bg_wait(&self, id: u64, timeout: Option<Duration>) -> Result<ExitStatus> {
        let request = Request::BgWait(BgWaitRequest {
            id,
            timeout_ms: timeout.map(|t| t.as_millis().min(u128::from(u64::MAX)) as u64),
        });
        // The agent waits `timeout` (or for ever) before it answers.
        let limit = match (timeout, self.limits.reply) {
            (Some(t), Some(reply)) => t.checked_add(reply),
            _ => None,
        };
        let (_tx, mut rx) = self.open(&request).await?;
        match within(limit, next_response(&mut rx)).await? {
            Response::Exited(status) => Ok(status),
            other => Err(unexpected(other)),
        }
    }

    /// Signals a background exec's process group (a no-op once it exited).
    pub async fn bg_kill(&self, id: u64, signal: i32) -> Result<()> {
        self.call_ok(&Request::BgKill(BgKillRequest { id, signal }))
            .await
    }

    /// Forgets a finished background exec.
    pub async fn bg_remove(&self, id: u64) -> Result<()> {
        self.call_ok(&Request::BgRemove(BgIdRequest { id })).await
    }

    /// Opens a shell on a PTY.
    pub async fn shell(&self, req: ShellRequest) -> Result<ShellSession> {
        let (tx, mut rx) = self.open(&Request::Shell(req)).await?;
        match self.reply(&mut rx).await? {
            Response::Started { pid } => Ok(ShellSession {
                pid,
                control: ProcessControl { tx },
                rx,
                done: false,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// Sends `reader`'s bytes and returns the final answer. If the agent
    /// fails early, its error is returned rather than the send failure.
    /// Reading `reader` has no deadline; the agent's credit does.
    async fn send_all<R: AsyncRead + Unpin>(
        &self,
        request: &Request,
        mut reader: R,
    ) -> Result<Response> {
        let (tx, mut rx) = self.open(request).await?;
        let mut buf = vec![0u8; SEND_CHUNK];
        loop {
            let n = reader.read(&mut buf).await.map_err(ClientError::Io)?;
            let send = async {
                let sent = if n == 0 {
                    tx.send_eof(Channel::Data).await
                } else {
                    tx.send_data(Channel::Data, &buf[..n]).await
                };
                Ok(sent)
            };
            match within(self.limits.transfer, send).await? {
                Ok(()) if n == 0 => break,
                Ok(()) => {}
                Err(MuxError::StreamClosed) => break,
                Err(e) => return Err(e.into()),
            }
        }
        self.transfer_reply(&mut rx).await
    }

    /// Uploads one file atomically; returns the bytes written.
    pub async fn upload<R: AsyncRead + Unpin>(&self, req: UploadRequest, reader: R) -> Result<u64> {
        match self.send_all(&Request::Upload(req), reader).await? {
            Response::Written { bytes } => Ok(bytes),
            other => Err(unexpected(other)),
        }
    }

    /// Writes `data` to a file atomically, creating missing parents.
    pub async fn write_file(&self, path: &str, data: &[u8], attrs: FileAttrs) -> Result<u64> {
        let req = UploadRequest {
            path: path.to_owned(),
            attrs,
            mkdirs: true,
            size: Some(data.len() as u64),
        };
        self.upload(req, data).await
    }

    /// Downloads one file into `writer`; returns its metadata. Fewer bytes
    /// than the file info announced is [`ClientError::Truncated`] (more is
    /// fine: a file can grow while it is read, and `/proc` files announce
    /// 0); more than [`Limits::download_bytes`] is [`ClientError::TooLarge`].
    pub async fn download<W: AsyncWrite + Unpin>(
        &self,
        path: &str,
        mut writer: W,
    ) -> Result<FileStat> {
        let request = Request::Download(PathRequest {
            path: path.to_owned(),
        });
        let (_tx, mut rx) = self.open(&request).await?;
        let stat = match self.reply(&mut rx).await? {
            Response::FileInfo(stat) => stat,
            other => return Err(unexpected(other)),
        };
        let received = self.receive_data(&mut rx, &mut writer).await?;
        match self.transfer_reply(&mut rx).await? {
            Response::Ok if received < stat.size => Err(ClientError::Truncated {
                expected: stat.size,
                received,
            }),
            Response::Ok => Ok(stat),
            other => Err(unexpected(other)),
        }
    }

    /// Reads a whole file.
    pub async fn read_file(&self, path: &str) -> Result<Vec<u8>> {
        let mut data = Vec::new();
        self.download(path, &mut data).await?;
        Ok(data)
    }

    /// Unpacks a tar archive read from `reader` into a directory.
    pub async fn upload_tar<R: AsyncRead + Unpin>(
        &self,
        req: UploadTarRequest,
        reader: R,
    ) -> Result<TarSummary> {
        match self.send_all(&Request::UploadTar(req), reader).await? {
            Response::TarDone { entries, skipped } => Ok(TarSummary { entries, skipped }),
            other => Err(unexpected(other)),
        }
    }

    /// Writes a tar archive of a directory (or file) into `writer`; more
    /// than [`Limits::download_bytes`] is [`ClientError::TooLarge`].
    pub async fn download_tar<W: AsyncWrite + Unpin>(
        &self,
        path: &str,
        writer: W,
    ) -> Result<TarSummary> {
        self.download_tar_excluding(path, &[], writer).await
    }

    /// [`Self::download_tar`] leaving out what matches `exclude` (see
    /// [`DownloadTarRequest::exclude`]).
    pub async fn download_tar_excluding<W: AsyncWrite + Unpin>(
        &self,
        path: &str,
        exclude: &[String],
        mut writer: W,
    ) -> Result<TarSummary> {
        let request = Request::DownloadTar(DownloadTarRequest {
            path: path.to_owned(),
            exclude: exclude.to_vec(),
        });
        let (_tx, mut rx) = self.open(&request).await?;
        self.receive_data(&mut rx, &mut writer).await?;
        match self.transfer_reply(&mut rx).await? {
            Response::TarDone { entries, skipped } => Ok(TarSummary { entries, skipped }),
            other => Err(unexpected(other)),
        }
    }

    /// Stats a path (`follow` stats a symlink's target).
    pub async fn stat(&self, path: &str, follow: bool) -> Result<FileStat> {
        let request = Request::Stat(StatRequest {
            path: path.to_owned(),
            follow,
        });
        match self.call(&request).await? {
            Response::Stat(stat) => Ok(stat),
            other => Err(unexpected(other)),
        }
    }

    /// Lists a directory, sorted by name.
    pub async fn list(&self, path: &str) -> Result<Vec<DirEntry>> {
        let request = Request::List(PathRequest {
            path: path.to_owned(),
        });
        let (_tx, mut rx) = self.open(&request).await?;
        let mut all = Vec::new();
        loop {
            match self.reply(&mut rx).await? {
                Response::Entries { entries } => all.extend(entries),
                Response::Ok => return Ok(all),
                other => return Err(unexpected(other)),
            }
        }
    }

    /// Creates a directory.
    pub async fn mkdir(&self, req: MkdirRequest) -> Result<()> {
        self.call_ok(&Request::Mkdir(req)).await
    }

    /// Removes a path (`recursive` for non-empty directories).
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<()> {
        self.call_ok(&Request::Remove(RemoveRequest {
            path: path.to_owned(),
            recursive,
        }))
        .await
    }

    /// Connects to a TCP port or Unix socket in the guest.
    pub async fn forward(&self, target: ForwardTarget) -> Result<ForwardStream> {
        let (tx, mut rx) = self
            .open(&Request::Forward(ForwardRequest { target }))
            .await?;
        match self.reply(&mut rx).await? {
            Response::Connected => Ok(ForwardStream {
                tx,
                rx,
                remote_eof: false,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// A snapshot of the guest's figures (memory, load, CPU time, disk and
    /// network counters, open files, entropy, root file system space).
    pub async fn stats(&self) -> Result<GuestStats> {
        match self.call(&Request::Stats).await? {
            Response::Stats(stats) => Ok(*stats),
            other => Err(unexpected(other)),
        }
    }

    /// Watches paths in the guest for changes; returns once the agent has
    /// its watches in place. Dropping the [`FsWatch`] ends the watch.
    pub async fn watch(&self, req: WatchRequest) -> Result<FsWatch> {
        let (tx, mut rx) = self.open(&Request::Watch(req)).await?;
        match self.reply(&mut rx).await? {
            Response::Watching { watched } => Ok(FsWatch {
                _tx: tx,
                rx,
                watched,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// Applies fork fix-ups and returns what was done.
    pub async fn fixups(&self, req: FixupRequest) -> Result<FixupReport> {
        match self.call(&Request::Fixups(req)).await? {
            Response::Fixups(report) => Ok(*report),
            other => Err(unexpected(other)),
        }
    }

    /// Makes the guest's secrets folder hold exactly `secrets`.
    pub async fn secrets_sync(&self, secrets: Vec<SecretFile>) -> Result<SecretsReport> {
        match self
            .call(&Request::SecretsSync(SecretsSyncRequest { secrets }))
            .await?
        {
            Response::Secrets(report) => Ok(report),
            other => Err(unexpected(other)),
        }
    }

    /// Adds public SSH keys for root and the guest's login user.
    pub async fn authorized_keys(&self, keys: Vec<String>) -> Result<KeysReport> {
        match self
            .call(&Request::AuthorizedKeys(AuthorizedKeysRequest { keys }))
            .await?
        {
            Response::Keys(report) => Ok(report),
            other => Err(unexpected(other)),
        }
    }

    /// Configures a network interface in the guest (address, default
    /// route, DNS), e.g. to give a restored fork its own address.
    pub async fn network(&self, req: NetworkRequest) -> Result<()> {
        match self.call(&Request::Network(req)).await? {
            Response::Ok => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Asks the guest to shut down cleanly (stop its processes, sync,
    /// remount `/` read-only, then `action`). The agent answers before the
    /// shutdown begins; the VM stops some seconds later.
    pub async fn shutdown(&self, action: ShutdownAction) -> Result<()> {
        match self
            .call(&Request::Shutdown(ShutdownRequest { action }))
            .await?
        {
            Response::Ok => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Installs the first-boot userdata script (unless userdata already ran
    /// on this disk) and starts it in the background.
    pub async fn userdata_run(&self, script: &str) -> Result<UserdataStatus> {
        let req = Request::UserdataRun(UserdataRunRequest {
            script: script.to_owned(),
        });
        match self.call(&req).await? {
            Response::Userdata(status) => Ok(status),
            other => Err(unexpected(other)),
        }
    }

    /// Whether the first-boot userdata script is present and ran.
    pub async fn userdata_status(&self) -> Result<UserdataStatus> {
        match self.call(&Request::UserdataStatus).await? {
            Response::Userdata(status) => Ok(status),
            other => Err(unexpected(other)),
        }
    }
}

impl AgentClient {
    /// Writes data frames into `writer` until the data channel's EOF;
    /// returns the bytes written. Each frame must come within the transfer
    /// limit (writing to `writer` has no deadline), and the total stays
    /// within the download limit.
    async fn receive_data<W: AsyncWrite + Unpin>(
        &self,
        rx: &mut StreamReceiver,
        writer: &mut W,
    ) -> Result<u64> {
        let limit = self.limits.download_bytes;
        let mut received = 0u64;
        loop {
            match within(self.limits.transfer, async { Ok(rx.recv().await) }).await? {
                Some(Inbound::Data(_, chunk)) => {
                    received = received.saturating_add(chunk.len() as u64);
                    if received > limit {
                        return Err(ClientError::TooLarge { limit });
                    }
                    writer.write_all(&chunk).await.map_err(ClientError::Io)?
                }
                Some(Inbound::Eof(_)) => break,
                Some(Inbound::Msg(bytes)) => {
                    let response = parse_response(&bytes)?;
                    return Err(unexpected(response));
                }
                None => return Err(ended(rx)),
            }
        }
        writer.flush().await.map_err(ClientError::Io)?;
        Ok(received)
    }
}
