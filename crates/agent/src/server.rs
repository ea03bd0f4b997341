//! The agent: accepts connections, runs the handshake, and runs each stream's
//! operation in its own task. A failing operation, a malformed request or a
//! vanished client affects only its own stream or connection.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_proto::agent::mux::{
    Inbound, Mux, MuxConfig, MuxError, Stream, StreamReceiver, StreamSender,
};
use tine_proto::agent::{
    server_handshake, ErrorCode, Request, Response, Welcome, MAX_FRAME_LEN, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::error::OpError;
use crate::listener::Listener;
use crate::ops;
use crate::ops::background::{Jobs, JobsConfig};
use crate::ops::watch::WatchLimits;

pub use crate::ops::system::AGENT_VERSION;

/// Settings of an [`Agent`].
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Root the system fix-ups and userdata checks work below: `/` in a VM,
    /// a temporary directory in tests.
    pub system_root: PathBuf,
    /// Streams one connection may have open at once.
    pub max_streams: usize,
    /// Time a new connection has to send its hello.
    pub handshake_timeout: Duration,
    /// Background execs remembered at once (finished ones are evicted
    /// first when full).
    pub max_background_jobs: usize,
    /// Total ring-buffer bytes all background execs may hold.
    pub max_background_ring_bytes: u64,
    /// Directories (and files) one `watch` may cover.
    pub max_watch_dirs: usize,
    /// Events of one `watch` that may wait for a slow client; later ones
    /// are dropped and reported as one `overflow` event.
    pub max_watch_queue: usize,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            system_root: PathBuf::from("/"),
            max_streams: tine_proto::agent::mux::DEFAULT_MAX_STREAMS,
            handshake_timeout: Duration::from_secs(10),
            max_background_jobs: 256,
            max_background_ring_bytes: 256 << 20,
            max_watch_dirs: 8192,
            max_watch_queue: 4096,
        }
    }
}

impl AgentConfig {
    fn watch_limits(&self) -> WatchLimits {
        WatchLimits {
            max_dirs: self.max_watch_dirs,
            max_queued: self.max_watch_queue,
        }
    }
}

/// The agent: its settings, start time and background execs, shared by
/// every connection.
#[derive(Debug)]
pub struct Agent {
    pub(crate) config: AgentConfig,
    pub(crate) started: Instant,
    pub(crate) jobs: Jobs,
}

impl Agent {
    /// Creates an agent.
    pub fn new(config: AgentConfig) -> Arc<Self> {
        let jobs = Jobs::new(JobsConfig {
            max_jobs: config.max_background_jobs,
            max_ring_total: config.max_background_ring_bytes,
        });
        Arc::new(Self {
            config,
            started: Instant::now(),
            jobs,
        })
    }

    /// How long the agent has run.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Accepts connections forever, serving each in its own task. Accept
    /// errors (e.g. out of file descriptors) are logged and retried.
    pub async fn serve<L: Listener>(self: Arc<Self>, mut listener: L) {
        loop {
            match listener.accept().await {
                Ok(conn) => {
                    tokio::spawn(self.clone().serve_connection(conn));
                }
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    /// Serves one connection until the client closes it.
    pub async fn serve_connection<S>(self: Arc<Self>, mut conn: S)
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let welcome = Welcome {
            version: PROTOCOL_VERSION,
            agent_version: AGENT_VERSION.to_owned(),
            max_frame_len: MAX_FRAME_LEN,
            stream_window: tine_proto::agent::mux::STREAM_WINDOW,
        };
        let handshake = tokio::time::timeout(
            self.config.handshake_timeout,
            server_handshake(&mut conn, &welcome),
        )
        .await;
        match handshake {
            Ok(Ok(hello)) => tracing::debug!("client {:?} connected", hello.client),
            Ok(Err(e)) => {
                tracing::info!("handshake failed: {e}");
                return;
            }
            Err(_) => {
                tracing::info!("handshake timed out");
                return;
            }
        }
        let config = MuxConfig {
            max_frame_len: MAX_FRAME_LEN,
            max_streams: self.config.max_streams,
        };
        let (mux, mut incoming) = Mux::server(conn, config);
        while let Some(stream) = incoming.accept().await {
            tokio::spawn(handle_stream(self.clone(), stream));
        }
        if let Some(reason) = mux.closed() {
            tracing::debug!("connection ended: {reason}");
        }
    }
}

/// Runs one stream: reads its request, runs the operation, and sends the
/// final message (its result or an error). Every stream ends with exactly
/// one final message unless the client has gone.
async fn handle_stream(agent: Arc<Agent>, stream: Stream) {
    let (tx, mut rx) = stream.split();
    let result = match read_request(&mut rx).await {
        Ok(request) => run(agent, request, tx.clone(), rx).await,
        Err(e) => Err(e),
    };
    let reply = match result {
        Ok(reply) => reply,
        Err(e) => {
            tracing::debug!("stream {}: {} ({})", tx.id(), e.message, e.code);
            e.to_response()
        }
    };
    match tx.send_msg(&reply).await {
        Ok(()) => {}
        // The client is gone; nothing more to do then.
        Err(MuxError::ConnectionLost(_) | MuxError::StreamClosed) => {
            tracing::trace!(
                "stream {}: the client left before the final message",
                tx.id()
            );
        }
        Err(e) => tracing::warn!("stream {}: cannot send the final message: {e}", tx.id()),
    }
}

async fn read_request(rx: &mut StreamReceiver) -> Result<Request, OpError> {
    let item = rx.recv().await.ok_or_else(OpError::cancelled)?;
    let Inbound::Msg(bytes) = item else {
        return Err(OpError::bad_request(
            "a stream must start with a request message",
        ));
    };
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| OpError::bad_request(format!("request is not JSON: {e}")))?;
    let op = value
        .get("op")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| OpError::bad_request("request has no \"op\" string"))?;
    if !Request::OPS.contains(&op) {
        return Err(OpError::new(
            ErrorCode::UnknownOperation,
            format!("unknown operation {op:?}"),
        ));
    }
    let op = op.to_owned();
    serde_json::from_value(value)
        .map_err(|e| OpError::bad_request(format!("invalid {op} request: {e}")))
}

async fn run(
    agent: Arc<Agent>,
    request: Request,
    tx: StreamSender,
    rx: StreamReceiver,
) -> Result<Response, OpError> {
    match request {
        Request::Exec(req) if req.background.is_some() => {
            ops::background::start(&agent.jobs, req).await
        }
        Request::Exec(req) => ops::exec::run(req, tx, rx).await,
        Request::Shell(req) => ops::shell::run(req, tx, rx).await,
        Request::BgList => Ok(agent.jobs.list()),
        Request::BgLogs(req) => ops::background::logs(&agent.jobs, req, tx, rx).await,
        Request::BgWait(req) => ops::background::wait(&agent.jobs, req, rx).await,
        Request::BgKill(req) => agent.jobs.kill(req.id, req.signal),
        Request::BgRemove(req) => agent.jobs.remove(req.id),
        Request::Upload(req) => ops::files::upload(req, rx).await,
        Request::Download(req) => ops::files::download(req, tx).await,
        Request::UploadTar(req) => ops::archive::upload(req, rx).await,
        Request::DownloadTar(req) => ops::archive::download(req, tx).await,
        Request::Stat(req) => ops::files::stat(req).await,
        Request::List(req) => ops::files::list(req, tx).await,
        Request::Mkdir(req) => ops::files::mkdir(req).await,
        Request::Remove(req) => ops::files::remove(req).await,
        Request::Forward(req) => ops::forward::run(req, tx, rx).await,
        Request::Health => ops::system::health(&agent.config.system_root, agent.uptime()).await,
        Request::Fixups(req) => ops::system::fixups(&agent.config.system_root, req).await,
        Request::Network(req) => ops::system::network(req).await,
        Request::UserdataStatus => ops::system::userdata(&agent.config.system_root).await,
        Request::UserdataRun(req) => {
            ops::system::userdata_run(&agent.config.system_root, req).await
        }
        Request::Shutdown(req) => ops::system::shutdown(req).await,
        Request::SecretsSync(req) => {
            ops::system::secrets_sync(&agent.config.system_root, req).await
        }
        Request::AuthorizedKeys(req) => {
            ops::system::authorized_keys(&agent.config.system_root, req).await
        }
        Request::Stats => ops::system::stats().await,
        Request::Watch(req) => ops::watch::run(req, &agent.config.watch_limits(), tx, rx).await,
    }
}
