//! Client of the daemon's REST API (docs/api.md): one async method per
//! route, over the daemon's Unix socket or over TCP with a bearer token.
//!
//! Every request opens its own connection: on a local socket that costs
//! little, and streamed bodies (exec, cp) and WebSocket upgrades (shell,
//! forward) need one each anyway. The methods take and return the types of
//! [`tine_proto::api`].

use std::fmt;
use std::future::poll_fn;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use base64::Engine as _;
use bytes::{Buf, Bytes, BytesMut};
use futures_core::Stream;
use futures_util::{SinkExt, StreamExt};
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{Method, Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Body as _, Frame, Incoming};
use hyper_util::rt::TokioIo;
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tine_proto::api::{
    CommitInfo, CommitPoolRequest, CommitRequest, CreateSecretRequest, CreateVmRequest,
    CreateVmResponse, DaemonInfo, DeleteSecretResponse, ErrorBody, ErrorCode, ExecFrame,
    ForkRequest, ForkResponse, FsEventType, FsWatchEvent, HostGroupInfo, LifecycleResponse,
    ListQuery, LogsResponse, NetworkPolicy, NodeStat, SecretInfo, StdioEncoding, SuspendResponse,
    TagsPatch, TagsResponse, UpdateSecretRequest, VmHealth, VmInfo, VmNetworkInfo,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::Message;
use tokio_tungstenite::WebSocketStream;
use tokio_util::io::ReaderStream;

/// Where the daemon listens unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/var/lib/tine/tine.sock";

/// The token file `tine up` writes for TCP clients in the default data
/// directory; read when a TCP URL comes without a token.
pub const DEFAULT_TOKEN_FILE: &str = "/var/lib/tine/auth/token";

/// Environment variable naming the daemon's URL.
pub const ENV_URL: &str = "TINE_URL";
/// Environment variable holding the bearer token.
pub const ENV_TOKEN: &str = "TINE_TOKEN";
/// Environment variable naming a file that holds the bearer token.
pub const ENV_TOKEN_FILE: &str = "TINE_TOKEN_FILE";

/// Largest error body read from a failed response.
const ERROR_BODY_LIMIT: usize = 64 << 10;

use tine_proto::api::shell as shell_frames;
pub use tine_proto::api::{CpResponse, DeleteCommitResponse};

/// Bytes per WebSocket message when bridging a forward.
const FORWARD_CHUNK: usize = 64 << 10;

/// Errors of REST calls.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The daemon could not be reached at all.
    #[error(
        "cannot reach the tine daemon at {url} (is the daemon running? start it with `tine up`)"
    )]
    Connect {
        /// The URL tried.
        url: String,
        /// Why the connection failed.
        #[source]
        source: io::Error,
    },
    /// The daemon answered with an error status.
    #[error("{}", body.error)]
    Api {
        /// The HTTP status.
        status: u16,
        /// The error the daemon sent (or one made from the status when the
        /// body was not an [`ErrorBody`]).
        body: ErrorBody,
    },
    /// The URL given for the daemon is not one this client understands.
    #[error("invalid daemon URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The token file could not be read.
    #[error("cannot read the token file {}", path.display())]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An argument cannot be sent (a header or query that is not valid).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The HTTP exchange failed after connecting.
    #[error("HTTP exchange with the daemon failed")]
    Http(#[from] hyper::Error),
    /// The WebSocket exchange failed.
    #[error("WebSocket exchange with the daemon failed")]
    WebSocket(#[source] Box<tokio_tungstenite::tungstenite::Error>),
    /// A response body did not decode.
    #[error("cannot decode the daemon's answer to {what}")]
    Decode {
        /// The request, `METHOD /path`.
        what: String,
        /// The decoding error.
        #[source]
        source: serde_json::Error,
    },
    /// The daemon sent something the contract does not allow.
    #[error("unexpected answer from the daemon: {0}")]
    Protocol(String),
    /// Reading a local source or writing a local sink failed.
    #[error("local I/O failed")]
    Io(#[from] io::Error),
}

impl ApiError {
    /// The daemon's error code, when the daemon answered with an error.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Api { body, .. } => Some(body.code),
            _ => None,
        }
    }

    /// The HTTP status, when the daemon answered with an error.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the daemon could not be reached.
    pub fn is_connect(&self) -> bool {
        matches!(self, Self::Connect { .. })
    }

    /// Whether a wait ran past its timeout (408).
    pub fn is_timeout(&self) -> bool {
        self.code() == Some(ErrorCode::Timeout)
    }
}

impl From<tokio_tungstenite::tungstenite::Error> for ApiError {
    fn from(err: tokio_tungstenite::tungstenite::Error) -> Self {
        Self::WebSocket(Box::new(err))
    }
}

/// Result of REST calls.
pub type Result<T, E = ApiError> = std::result::Result<T, E>;

/// The error code a status stands for, for error bodies that are not
/// [`ErrorBody`] (a proxy's page, an empty body).
fn code_for_status(status: u16) -> ErrorCode {
    match status {
        400 => ErrorCode::BadRequest,
        401 | 403 => ErrorCode::Unauthorized,
        404 | 405 => ErrorCode::NotFound,
        408 => ErrorCode::Timeout,
        409 => ErrorCode::Conflict,
        503 => ErrorCode::AgentUnavailable,
        _ => ErrorCode::Internal,
    }
}

/// Makes [`ApiError::Api`] from a failed response's status and body.
fn api_error(status: u16, body: &[u8]) -> ApiError {
    let body = serde_json::from_slice::<ErrorBody>(body).unwrap_or_else(|_| {
        let text = String::from_utf8_lossy(body).trim().to_string();
        ErrorBody {
            error: if text.is_empty() {
                format!("HTTP {status}")
            } else {
                format!("HTTP {status}: {text}")
            },
            code: code_for_status(status),
        }
    });
    ApiError::Api { status, body }
}

pub use tine_proto::api::{ShutdownAction, Wait};

mod images;

/// How `cp` moves files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CpMode {
    /// One file's bytes.
    #[default]
    Binary,
    /// A tar of a directory tree (names relative to the path).
    Tar,
}

impl CpMode {
    fn as_str(self) -> &'static str {
        match self {
            CpMode::Binary => "binary",
            CpMode::Tar => "tar",
        }
    }
}

/// Owner and mode of an uploaded file (`POST /vm/{hostname}/cp`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UploadOptions {
    /// Permission bits, sent in octal (`permissions=0644`).
    pub mode_bits: Option<u32>,
    /// Owner.
    pub uid: Option<u32>,
    /// Group.
    pub gid: Option<u32>,
}

/// The query of `POST /vm/{hostname}/exec`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOptions {
    /// The program (or, with `shell`, the script).
    pub cmd: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Environment, `K=V`.
    pub env: Vec<String>,
    /// User to run as.
    pub uid: Option<u32>,
    /// Group to run as.
    pub gid: Option<u32>,
    /// Working directory.
    pub cwd: Option<String>,
    /// Run `cmd` with `/bin/sh -c` (`Some(true)`), directly (`Some(false)`),
    /// or as the daemon chooses (`None`).
    pub shell: Option<bool>,
    /// Kill the command after this long.
    pub timeout: Option<Duration>,
}

impl ExecOptions {
    /// Runs `cmd` with `args` directly.
    pub fn new<I, S>(cmd: impl Into<String>, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            cmd: cmd.into(),
            args: args.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }
}

/// The query of `GET /vm/{hostname}/shell`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShellOptions {
    /// Terminal rows.
    pub rows: Option<u16>,
    /// Terminal columns.
    pub cols: Option<u16>,
    /// Working directory.
    pub cwd: Option<String>,
    /// User to run as.
    pub uid: Option<u32>,
    /// The shell program.
    pub shell: Option<String>,
}

/// What a forward connects to in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardTarget {
    /// A TCP port, on the guest's loopback unless `host` is given.
    Tcp {
        /// Host in the guest's view.
        host: Option<String>,
        /// Port.
        port: u16,
    },
    /// A Unix socket in the guest.
    Unix(String),
}

impl fmt::Display for ForwardTarget {
    /// The wire form: `tcp:PORT`, `tcp:HOST:PORT` or `unix:PATH`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ForwardTarget::Tcp { host: None, port } => write!(f, "tcp:{port}"),
            ForwardTarget::Tcp {
                host: Some(host),
                port,
            } => write!(f, "tcp:{host}:{port}"),
            ForwardTarget::Unix(path) => write!(f, "unix:{path}"),
        }
    }
}

/// The filters of `GET /vm/commits`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitQuery {
    /// Only commits with all of these tags.
    pub tags: Vec<String>,
    /// Only the commit with this cache key.
    pub cache_key: Option<String>,
    /// Only commits of this source VM.
    pub source: Option<String>,
    /// Only commits of this mode.
    pub mode: Option<tine_proto::api::CommitMode>,
}

/// How the daemon is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Endpoint {
    Unix(PathBuf),
    Tcp { host: String, port: u16 },
}

/// Parses `unix:///path`, a plain path, or `http://host:port`.
fn parse_url(url: &str) -> Result<Endpoint> {
    let invalid = |reason: &str| ApiError::InvalidUrl {
        url: url.to_string(),
        reason: reason.to_string(),
    };
    if let Some(rest) = url.strip_prefix("unix://") {
        if rest.is_empty() {
            return Err(invalid("no socket path"));
        }
        return Ok(Endpoint::Unix(PathBuf::from(rest)));
    }
    if let Some(rest) = url.strip_prefix("unix:") {
        if rest.is_empty() {
            return Err(invalid("no socket path"));
        }
        return Ok(Endpoint::Unix(PathBuf::from(rest)));
    }
    if let Some(rest) = url.strip_prefix("http://") {
        let authority = rest.split('/').next().unwrap_or_default();
        if authority.is_empty() {
            return Err(invalid("no host"));
        }
        let bad_port = || invalid("the port is not a number from 0 to 65535");
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, rest) = v6.split_once(']').ok_or_else(|| invalid("unclosed ["))?;
            match rest.strip_prefix(':') {
                Some(port) => (host, port.parse::<u16>().map_err(|_| bad_port())?),
                None if rest.is_empty() => (host, 80),
                None => return Err(invalid("junk after the address")),
            }
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host, port.parse::<u16>().map_err(|_| bad_port())?),
                None => (authority, 80),
            }
        };
        if host.is_empty() {
            return Err(invalid("no host"));
        }
        return Ok(Endpoint::Tcp {
            host: host.to_string(),
            port,
        });
    }
    if url.contains("://") {
        return Err(invalid(
            "only unix:///path/to/tine.sock, a socket path and http://host:port are supported",
        ));
    }
    if url.is_empty() {
        return Err(invalid("empty"));
    }
    Ok(Endpoint::Unix(PathBuf::from(url)))
}

/// Reads a token file: its content without surrounding whitespace.
pub fn read_token_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| ApiError::TokenFile {
            path: path.to_path_buf(),
            source,
        })
}

/// Characters escaped in a path segment.
const SEGMENT: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'/')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'`')
    .add(b'{')
    .add(b'}')
    .add(b'\\');

/// One path segment, escaped.
fn seg(s: &str) -> String {
    utf8_percent_encode(s, SEGMENT).to_string()
}

/// A duration as the daemon's humantime query (`30s`, `1500ms`).
pub fn format_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis().max(1))
    }
}

/// Builds `?a=b&c=d` (empty when no pairs).
#[derive(Debug, Default)]
struct Query {
    pairs: Vec<(&'static str, String)>,
}

impl Query {
    fn new() -> Self {
        Self::default()
    }

    fn add(&mut self, key: &'static str, value: impl Into<String>) -> &mut Self {
        self.pairs.push((key, value.into()));
        self
    }

    fn opt(&mut self, key: &'static str, value: Option<impl ToString>) -> &mut Self {
        if let Some(value) = value {
            self.pairs.push((key, value.to_string()));
        }
        self
    }

    fn wait(&mut self, wait: Wait, timeout: Option<Duration>) -> &mut Self {
        self.add("wait", wait.as_str());
        self.opt("timeout", timeout.map(format_duration))
    }

    fn finish(&self, path: String) -> String {
        if self.pairs.is_empty() {
            return path;
        }
        let mut ser = form_urlencoded::Serializer::new(String::new());
        for (k, v) in &self.pairs {
            ser.append_pair(k, v);
        }
        format!("{path}?{}", ser.finish())
    }
}

/// The body type requests are sent with.
type ReqBody = UnsyncBoxBody<Bytes, io::Error>;

fn empty_body() -> ReqBody {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

fn json_body<T: Serialize>(value: &T) -> Result<ReqBody> {
    let bytes = serde_json::to_vec(value)
        .map_err(|e| ApiError::InvalidRequest(format!("cannot encode the body: {e}")))?;
    Ok(Full::new(Bytes::from(bytes))
        .map_err(|never| match never {})
        .boxed_unsync())
}

fn reader_body<R: AsyncRead + Send + 'static>(reader: R) -> ReqBody {
    let frames = ReaderStream::new(reader).map(|chunk| chunk.map(Frame::data));
    BodyExt::boxed_unsync(StreamBody::new(frames))
}

/// A connection to the daemon: a Unix or TCP stream.
#[derive(Debug)]
pub struct DaemonStream {
    inner: StreamInner,
    /// Set for HTTP requests: once the daemon stopped reading (it answered
    /// without consuming the whole request body, e.g. an exec whose command
    /// ignores stdin), further writes are dropped instead of failing, so
    /// the answer already on its way is still read to the end.
    discard_writes_after_peer_closed: bool,
    write_closed: bool,
}

#[derive(Debug)]
enum StreamInner {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// Whether a write error only says the peer stopped reading.
fn peer_stopped_reading(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
    )
}

impl DaemonStream {
    fn new(inner: StreamInner) -> Self {
        Self {
            inner,
            discard_writes_after_peer_closed: false,
            write_closed: false,
        }
    }
}

impl AsyncRead for DaemonStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            StreamInner::Unix(s) => Pin::new(s).poll_read(cx, buf),
            StreamInner::Tcp(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for DaemonStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.write_closed {
            return Poll::Ready(Ok(buf.len()));
        }
        let result = match &mut this.inner {
            StreamInner::Unix(s) => ready!(Pin::new(s).poll_write(cx, buf)),
            StreamInner::Tcp(s) => ready!(Pin::new(s).poll_write(cx, buf)),
        };
        match result {
            Err(e) if this.discard_writes_after_peer_closed && peer_stopped_reading(&e) => {
                this.write_closed = true;
                Poll::Ready(Ok(buf.len()))
            }
            other => Poll::Ready(other),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.write_closed {
            return Poll::Ready(Ok(()));
        }
        match &mut this.inner {
            StreamInner::Unix(s) => Pin::new(s).poll_flush(cx),
            StreamInner::Tcp(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.write_closed {
            return Poll::Ready(Ok(()));
        }
        match &mut this.inner {
            StreamInner::Unix(s) => Pin::new(s).poll_shutdown(cx),
            StreamInner::Tcp(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Client of the daemon's REST API. Cheap to clone; every call opens its
/// own connection.
#[derive(Debug, Clone)]
pub struct TineClient {
    url: String,
    endpoint: Endpoint,
    token: Option<String>,
}

impl TineClient {
    /// A client for `url`: `unix:///path/to/tine.sock`, a plain socket path,
    /// or `http://host:port`. The token, when given, is sent as
    /// `Authorization: Bearer <token>`.
    pub fn new(url: &str, token: Option<String>) -> Result<Self> {
        let endpoint = parse_url(url)?;
        if let Some(token) = &token {
            HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
                ApiError::InvalidRequest("the token holds characters a header cannot".into())
            })?;
        }
        Ok(Self {
            url: url.to_string(),
            endpoint,
            token: token.filter(|t| !t.is_empty()),
        })
    }

    /// A client for the daemon's socket at `path`.
    pub fn unix(path: impl AsRef<Path>) -> Self {
        let path = path.as_ref().to_path_buf();
        Self {
            url: format!("unix://{}", path.display()),
            endpoint: Endpoint::Unix(path),
            token: None,
        }
    }

    /// The client a command line wants: the explicit `url` and `token` win;
    /// else `TINE_URL`, and `TINE_TOKEN` or the file named by
    /// `TINE_TOKEN_FILE`; else the default socket [`DEFAULT_SOCKET`]. A TCP
    /// URL without any token falls back to [`DEFAULT_TOKEN_FILE`] when that
    /// file is readable.
    pub fn from_env(url: Option<&str>, token: Option<&str>) -> Result<Self> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let url = url
            .map(str::to_string)
            .or_else(|| env(ENV_URL))
            .unwrap_or_else(|| format!("unix://{DEFAULT_SOCKET}"));
        let token = match token {
            Some(t) => Some(t.to_string()),
            None => match env(ENV_TOKEN) {
                Some(t) => Some(t),
                None => match env(ENV_TOKEN_FILE) {
                    Some(file) => Some(read_token_file(Path::new(&file))?),
                    None => None,
                },
            },
        };
        let mut client = Self::new(&url, token)?;
        if client.token.is_none() && matches!(client.endpoint, Endpoint::Tcp { .. }) {
            if let Ok(token) = read_token_file(Path::new(DEFAULT_TOKEN_FILE)) {
                client = Self::new(&url, Some(token))?;
            }
        }
        Ok(client)
    }

    /// The URL this client talks to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether this client has a bearer token.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Opens a raw connection to the daemon.
    pub async fn connect(&self) -> Result<DaemonStream> {
        let connected = match &self.endpoint {
            Endpoint::Unix(path) => UnixStream::connect(path).await.map(StreamInner::Unix),
            Endpoint::Tcp { host, port } => TcpStream::connect((host.as_str(), *port))
                .await
                .map(StreamInner::Tcp),
        };
        connected
            .map(DaemonStream::new)
            .map_err(|source| ApiError::Connect {
                url: self.url.clone(),
                source,
            })
    }

    fn host_header(&self) -> String {
        match &self.endpoint {
            Endpoint::Unix(_) => "localhost".to_string(),
            Endpoint::Tcp { host, port } if host.contains(':') => format!("[{host}]:{port}"),
            Endpoint::Tcp { host, port } => format!("{host}:{port}"),
        }
    }

    fn auth_header(&self) -> Option<HeaderValue> {
        self.token
            .as_ref()
            .and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok())
    }

    /// Sends one request on a new connection; returns the response once its
    /// head arrived, with any status.
    async fn send_raw(
        &self,
        method: Method,
        path_and_query: &str,
        content_type: Option<&'static str>,
        body: ReqBody,
    ) -> Result<Response<Incoming>> {
        let mut builder = Request::builder()
            .method(method)
            .uri(path_and_query)
            .header(HOST, self.host_header());
        if let Some(auth) = self.auth_header() {
            builder = builder.header(AUTHORIZATION, auth);
        }
        if let Some(ct) = content_type {
            builder = builder.header(CONTENT_TYPE, ct);
        }
        let request = builder
            .body(body)
            .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
        let mut io = self.connect().await?;
        io.discard_writes_after_peer_closed = true;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
        tokio::spawn(async move {
            // Errors surface through the request and its body too.
            if let Err(e) = conn.await {
                tracing::debug!("REST connection: {e}");
            }
        });
        Ok(sender.send_request(request).await?)
    }

    /// Sends a request and fails on a non-2xx status.
    async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        content_type: Option<&'static str>,
        body: ReqBody,
    ) -> Result<Response<Incoming>> {
        let response = self
            .send_raw(method, path_and_query, content_type, body)
            .await?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let limited = http_body_util::Limited::new(response.into_body(), ERROR_BODY_LIMIT);
        let bytes = match limited.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(_) => Bytes::new(),
        };
        Err(api_error(status.as_u16(), &bytes))
    }

    /// Sends a request and decodes a JSON answer.
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<ReqBody>,
    ) -> Result<T> {
        let what = format!("{method} {path_and_query}");
        let (ct, body) = match body {
            Some(body) => (Some("application/json"), body),
            None => (None, empty_body()),
        };
        let response = self.send(method, path_and_query, ct, body).await?;
        let bytes = response.into_body().collect().await?.to_bytes();
        serde_json::from_slice(&bytes).map_err(|source| ApiError::Decode { what, source })
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.call(Method::GET, path, None).await
    }

    /// `GET /healthz`: whether the daemon answers.
    pub async fn healthz(&self) -> Result<()> {
        let _: tine_proto::api::HealthResponse = self.get("/healthz").await?;
        Ok(())
    }

    /// `GET /info`: the daemon itself.
    pub async fn info(&self) -> Result<DaemonInfo> {
        self.get("/info").await
    }

    /// `GET /hostgroup`: the host groups.
    pub async fn host_groups(&self) -> Result<Vec<HostGroupInfo>> {
        self.get("/hostgroup").await
    }

    /// `GET /hostgroup/{group}/nodes`, or `GET /nodes` for every group.
    pub async fn list_vms(&self, group: Option<&str>, query: &ListQuery) -> Result<Vec<VmInfo>> {
        let path = match group {
            Some(group) => format!("/hostgroup/{}/nodes", seg(group)),
            None => "/nodes".to_string(),
        };
        let mut q = Query::new();
        for tag in &query.tags {
            q.add("tag", tag);
        }
        q.opt("tag_prefix", query.tag_prefix.as_ref());
        self.get(&q.finish(path)).await
    }

    /// `POST /hostgroup/{group}/nodes`: creates a VM; with [`Wait::Agent`]
    /// the answer comes when its agent answers (408 after `timeout`).
    pub async fn create_vm(
        &self,
        group: &str,
        request: &CreateVmRequest,
        wait: Wait,
        timeout: Option<Duration>,
    ) -> Result<CreateVmResponse> {
        let path = Query::new()
            .wait(wait, timeout)
            .finish(format!("/hostgroup/{}/nodes", seg(group)));
        self.call(Method::POST, &path, Some(json_body(request)?))
            .await
    }

    /// `GET /vm/{vm}`: one VM (by hostname or friendly name), with lineage.
    pub async fn describe(&self, vm: &str) -> Result<VmInfo> {
        self.get(&format!("/vm/{}", seg(vm))).await
    }

    /// `DELETE /vm/{vm}`: stops the VM and removes its disk.
    pub async fn delete(&self, vm: &str) -> Result<LifecycleResponse> {
        self.call(Method::DELETE, &format!("/vm/{}", seg(vm)), None)
            .await
    }

    /// `DELETE /hostgroup/{group}/nodes/{hostname}`: the same, addressed
    /// within a group.
    pub async fn delete_in_group(&self, group: &str, hostname: &str) -> Result<LifecycleResponse> {
        let path = format!("/hostgroup/{}/nodes/{}", seg(group), seg(hostname));
        self.call(Method::DELETE, &path, None).await
    }

    /// `GET /vm/{vm}/tags`.
    pub async fn tags(&self, vm: &str) -> Result<TagsResponse> {
        self.get(&format!("/vm/{}/tags", seg(vm))).await
    }

    /// `PATCH /vm/{vm}/tags`: add and remove, or replace.
    pub async fn patch_tags(&self, vm: &str, patch: &TagsPatch) -> Result<TagsResponse> {
        let path = format!("/vm/{}/tags", seg(vm));
        self.call(Method::PATCH, &path, Some(json_body(patch)?))
            .await
    }

    /// `GET /vm/{vm}/network`: the VM's network and policy (describe's
    /// `network`).
    pub async fn network(&self, vm: &str) -> Result<VmNetworkInfo> {
        self.get(&format!("/vm/{}/network", seg(vm))).await
    }

    /// `PUT /vm/{vm}/network`: replaces the VM's policy override; on a
    /// running VM it applies at once and cuts connections it forbids.
    pub async fn set_network(&self, vm: &str, policy: &NetworkPolicy) -> Result<VmNetworkInfo> {
        let path = format!("/vm/{}/network", seg(vm));
        self.call(Method::PUT, &path, Some(json_body(policy)?))
            .await
    }

    /// `GET /vm/{vm}/health`: the agent's health; 503 when it does not
    /// answer, or with [`Wait::Agent`] waits for it (408 after `timeout`).
    pub async fn health(
        &self,
        vm: &str,
        wait: Wait,
        timeout: Option<Duration>,
    ) -> Result<VmHealth> {
        let mut q = Query::new();
        if wait == Wait::Agent {
            q.wait(wait, timeout);
        }
        self.get(&q.finish(format!("/vm/{}/health", seg(vm)))).await
    }

    /// `GET /vm/{vm}/logs`: the serial console's last `lines` lines (the
    /// daemon's default, 200, when `None`).
    pub async fn logs(&self, vm: &str, lines: Option<u32>) -> Result<LogsResponse> {
        let path = Query::new()
            .opt("lines", lines)
            .finish(format!("/vm/{}/logs", seg(vm)));
        self.get(&path).await
    }

    /// `POST /vm/{vm}/shutdown`.
    pub async fn shutdown(
        &self,
        vm: &str,
        action: ShutdownAction,
        timeout: Option<Duration>,
    ) -> Result<LifecycleResponse> {
        let path = Query::new()
            .add("action", action.as_str())
            .opt("timeout", timeout.map(format_duration))
            .finish(format!("/vm/{}/shutdown", seg(vm)));
        self.call(Method::POST, &path, None).await
    }

    /// `POST /vm/{vm}/relaunch`: boots a stopped persistent VM from its disk.
    pub async fn relaunch(
        &self,
        vm: &str,
        wait: Wait,
        timeout: Option<Duration>,
    ) -> Result<CreateVmResponse> {
        let path = Query::new()
            .wait(wait, timeout)
            .finish(format!("/vm/{}/relaunch", seg(vm)));
        self.call(Method::POST, &path, None).await
    }

    /// `POST /vm/{vm}/pause`: parks the VM's vCPUs (its memory stays).
    pub async fn pause(&self, vm: &str) -> Result<VmInfo> {
        self.call(Method::POST, &format!("/vm/{}/pause", seg(vm)), None)
            .await
    }

    /// `POST /vm/{vm}/resume`: runs a paused VM's vCPUs again.
    pub async fn resume(&self, vm: &str) -> Result<VmInfo> {
        self.call(Method::POST, &format!("/vm/{}/resume", seg(vm)), None)
            .await
    }

    /// `GET /node/{vm}/stats` for one VM, or `GET /nodes/stats` for all:
    /// the guest's figures and the host's; a VM whose guest did not answer
    /// has `error` set and no `snapshot`.
    pub async fn stats(&self, vm: Option<&str>) -> Result<Vec<NodeStat>> {
        let path = match vm {
            Some(vm) => format!("/node/{}/stats", seg(vm)),
            None => "/nodes/stats".to_owned(),
        };
        self.get(&path).await
    }

    /// `GET /vm/{vm}/fs/watch`: the guest's file changes as they happen,
    /// once the agent's watches are in place.
    pub async fn fs_watch(&self, vm: &str, options: &WatchOptions) -> Result<FsWatchStream> {
        let mut q = Query::new();
        for p in &options.paths {
            q.add("paths", p);
        }
        for p in &options.patterns {
            q.add("patterns", p);
        }
        for e in &options.events {
            q.add("events", e.as_str());
        }
        if options.recursive {
            q.add("recursive", "true");
        }
        q.opt("max_events", options.max_events);
        let go = |d: Duration| format!("{}ms", d.as_millis());
        q.opt("timeout", options.timeout.map(go));
        q.opt("debounce", options.debounce.map(go));
        let path = q.finish(format!("/vm/{}/fs/watch", seg(vm)));
        let response = self.send(Method::GET, &path, None, empty_body()).await?;
        Ok(FsWatchStream {
            body: response.into_body(),
            lines: NdjsonDecoder::default(),
            data: Vec::new(),
            done: false,
        })
    }

    /// `POST /vm/{vm}/suspend`: state, memory and disk to the VM's folder;
    /// its process exits.
    pub async fn suspend(&self, vm: &str) -> Result<SuspendResponse> {
        self.call(Method::POST, &format!("/vm/{}/suspend", seg(vm)), None)
            .await
    }

    /// `POST /vm/{vm}/restore`: resumes a suspended VM with its memory
    /// (with [`Wait::Agent`]: once its agent answers).
    pub async fn restore(
        &self,
        vm: &str,
        wait: Wait,
        timeout: Option<Duration>,
    ) -> Result<LifecycleResponse> {
        let path = Query::new()
            .wait(wait, timeout)
            .finish(format!("/vm/{}/restore", seg(vm)));
        self.call(Method::POST, &path, None).await
    }

    /// `POST /vm/{vm}/exec`: runs a command; its output and exit come as a
    /// stream of [`ExecFrame`]s while it runs. With `stdin`, the reader is
    /// streamed to the command's stdin as the request body (EOF closes it).
    pub async fn exec<R>(
        &self,
        vm: &str,
        options: &ExecOptions,
        stdin: Option<R>,
    ) -> Result<ExecStream>
    where
        R: AsyncRead + Send + 'static,
    {
        let mut q = Query::new();
        q.add("cmd", options.cmd.clone());
        for arg in &options.args {
            q.add("args", arg.clone());
        }
        for env in &options.env {
            q.add("env", env.clone());
        }
        q.opt("uid", options.uid)
            .opt("gid", options.gid)
            .opt("cwd", options.cwd.as_ref())
            .opt("shell", options.shell.filter(|s| *s).map(|_| "/bin/sh"))
            .opt("timeout", options.timeout.map(format_duration))
            // Any bytes, not only UTF-8.
            .add("stdio", StdioEncoding::Base64.as_str());
        let (ct, body) = match stdin {
            Some(reader) => {
                q.add("stdin", "true");
                (Some("application/octet-stream"), reader_body(reader))
            }
            None => (None, empty_body()),
        };
        let path = q.finish(format!("/vm/{}/exec", seg(vm)));
        let response = self.send(Method::POST, &path, ct, body).await?;
        Ok(ExecStream {
            body: response.into_body(),
            lines: NdjsonDecoder::default(),
            done: false,
        })
    }

    /// Runs a command without stdin and collects its output.
    pub async fn exec_output(&self, vm: &str, options: &ExecOptions) -> Result<ExecOutput> {
        self.exec(vm, options, None::<tokio::io::Empty>)
            .await?
            .collect_output()
            .await
    }

    /// `POST /vm/{vm}/cp`: streams `reader` to `path` in the guest (the
    /// file's bytes, or with [`CpMode::Tar`] a tar unpacked into the
    /// directory `path`). Returns the bytes the daemon received.
    pub async fn cp_upload<R>(
        &self,
        vm: &str,
        path: &str,
        mode: CpMode,
        options: &UploadOptions,
        reader: R,
    ) -> Result<u64>
    where
        R: AsyncRead + Send + 'static,
    {
        let query = Query::new()
            .add("path", path)
            .add("mode", mode.as_str())
            .opt("permissions", options.mode_bits.map(|m| format!("{m:04o}")))
            .opt("uid", options.uid)
            .opt("gid", options.gid)
            .finish(format!("/vm/{}/cp", seg(vm)));
        let ct = match mode {
            CpMode::Binary => "application/octet-stream",
            CpMode::Tar => "application/x-tar",
        };
        let what = format!("POST {query}");
        let response = self
            .send(Method::POST, &query, Some(ct), reader_body(reader))
            .await?;
        let bytes = response.into_body().collect().await?.to_bytes();
        let answer: CpResponse =
            serde_json::from_slice(&bytes).map_err(|source| ApiError::Decode { what, source })?;
        Ok(answer.bytes)
    }

    /// `GET /vm/{vm}/cp`: the file at `path` (or with [`CpMode::Tar`] a tar
    /// of the tree, names relative to `path`), as a stream read while it
    /// arrives.
    pub async fn cp_download(&self, vm: &str, path: &str, mode: CpMode) -> Result<Download> {
        let query = Query::new()
            .add("path", path)
            .add("mode", mode.as_str())
            .finish(format!("/vm/{}/cp", seg(vm)));
        let response = self.send(Method::GET, &query, None, empty_body()).await?;
        Ok(Download {
            body: response.into_body(),
            chunk: Bytes::new(),
            done: false,
        })
    }

    /// Opens a WebSocket to `path_and_query` on a new connection.
    async fn websocket(&self, path_and_query: &str) -> Result<WebSocketStream<DaemonStream>> {
        let uri = format!("ws://{}{}", self.host_header(), path_and_query);
        let mut request = uri.into_client_request()?;
        if let Some(auth) = self.auth_header() {
            request.headers_mut().insert(AUTHORIZATION, auth);
        }
        let io = self.connect().await?;
        match tokio_tungstenite::client_async(request, io).await {
            Ok((ws, _response)) => Ok(ws),
            Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
                let status = response.status().as_u16();
                let body = response.body().as_deref().unwrap_or_default();
                Err(api_error(status, body))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// `GET /vm/{vm}/shell` (WebSocket): a shell on a terminal in the guest.
    pub async fn shell(&self, vm: &str, options: &ShellOptions) -> Result<ShellSession> {
        let path = Query::new()
            .opt("rows", options.rows)
            .opt("cols", options.cols)
            .opt("cwd", options.cwd.as_ref())
            .opt("uid", options.uid)
            .opt("shell", options.shell.as_ref())
            .finish(format!("/vm/{}/shell", seg(vm)));
        let ws = self.websocket(&path).await?;
        Ok(ShellSession { ws })
    }

    /// `GET /vm/{vm}/forward` (WebSocket): one connection to `target` in the
    /// guest. Open one per local connection.
    pub async fn forward(&self, vm: &str, target: &ForwardTarget) -> Result<ForwardConnection> {
        let path = Query::new()
            .add("target", target.to_string())
            .finish(format!("/vm/{}/forward", seg(vm)));
        let ws = self.websocket(&path).await?;
        Ok(ForwardConnection { ws })
    }

    /// `POST /vm/{vm}/commit`: makes a stopped persistent VM's disk an
    /// immutable commit.
    pub async fn commit(&self, vm: &str, request: &CommitRequest) -> Result<CommitInfo> {
        let path = format!("/vm/{}/commit", seg(vm));
        self.call(Method::POST, &path, Some(json_body(request)?))
            .await
    }

    /// `GET /vm/commits`, filtered.
    pub async fn list_commits(&self, query: &CommitQuery) -> Result<Vec<CommitInfo>> {
        let mut q = Query::new();
        for tag in &query.tags {
            q.add("tag", tag);
        }
        let path = q
            .opt("cache_key", query.cache_key.as_ref())
            .opt("source", query.source.as_ref())
            .opt("mode", query.mode.map(|m| m.as_str()))
            .finish("/vm/commits".to_string());
        self.get(&path).await
    }

    /// `DELETE /vm/commits/{id}`.
    pub async fn delete_commit(&self, id: &str) -> Result<DeleteCommitResponse> {
        self.call(Method::DELETE, &format!("/vm/commits/{}", seg(id)), None)
            .await
    }

    /// `PUT /vm/commits/{id}/pool` (a size) or `DELETE` (`None`: back to
    /// the host group's): a memory commit's own warm pool size.
    pub async fn set_commit_pool(&self, id: &str, size: Option<u32>) -> Result<CommitInfo> {
        let path = format!("/vm/commits/{}/pool", seg(id));
        match size {
            Some(hot_fork_pool) => {
                let body = json_body(&CommitPoolRequest { hot_fork_pool })?;
                self.call(Method::PUT, &path, Some(body)).await
            }
            None => self.call(Method::DELETE, &path, None).await,
        }
    }

    /// `POST /vm/commits/{id}/fork`: boots a new VM from a commit.
    pub async fn fork(
        &self,
        id: &str,
        request: &ForkRequest,
        wait: Wait,
        timeout: Option<Duration>,
    ) -> Result<ForkResponse> {
        let path = Query::new()
            .wait(wait, timeout)
            .finish(format!("/vm/commits/{}/fork", seg(id)));
        self.call(Method::POST, &path, Some(json_body(request)?))
            .await
    }

    /// `GET /secrets`: every secret's metadata (never a value).
    pub async fn list_secrets(&self) -> Result<Vec<SecretInfo>> {
        self.get("/secrets").await
    }

    /// `POST /secrets`.
    pub async fn create_secret(&self, request: &CreateSecretRequest) -> Result<SecretInfo> {
        self.call(Method::POST, "/secrets", Some(json_body(request)?))
            .await
    }

    /// `PATCH /secrets/{name}`.
    pub async fn update_secret(
        &self,
        name: &str,
        request: &UpdateSecretRequest,
    ) -> Result<SecretInfo> {
        self.call(
            Method::PATCH,
            &format!("/secrets/{}", seg(name)),
            Some(json_body(request)?),
        )
        .await
    }

    /// `DELETE /secrets/{name}`.
    pub async fn delete_secret(&self, name: &str) -> Result<DeleteSecretResponse> {
        self.call(Method::DELETE, &format!("/secrets/{}", seg(name)), None)
            .await
    }
}

/// Splits bytes into lines, across chunk boundaries.
#[derive(Debug, Default)]
pub struct NdjsonDecoder {
    buf: BytesMut,
}

impl NdjsonDecoder {
    /// Appends a chunk.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete line, without its newline; blank lines skipped.
    pub fn next_line(&mut self) -> Option<Bytes> {
        while let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
            let mut line = self.buf.split_to(pos + 1).freeze();
            line.truncate(pos);
            if line.last() == Some(&b'\r') {
                line.truncate(pos - 1);
            }
            if !line.iter().all(u8::is_ascii_whitespace) {
                return Some(line);
            }
        }
        None
    }

    /// The next complete line, without its newline, blank ones included.
    fn next_line_raw(&mut self) -> Option<Bytes> {
        let pos = self.buf.iter().position(|&b| b == b'\n')?;
        let mut line = self.buf.split_to(pos + 1).freeze();
        line.truncate(pos);
        if line.last() == Some(&b'\r') {
            line.truncate(pos - 1);
        }
        Some(line)
    }

    /// What is left after the last newline (a last line without one).
    pub fn finish(&mut self) -> Option<Bytes> {
        let rest = self.buf.split().freeze();
        (!rest.iter().all(u8::is_ascii_whitespace)).then_some(rest)
    }
}

/// Decodes the base64 `data` of a `stdout` or `stderr` frame.
pub fn decode_data(data: &str) -> Result<Vec<u8>> {
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| ApiError::Protocol(format!("exec output is not base64: {e}")))
}

/// The bytes of a `stdout` or `stderr` frame's `data`, per its `encoding`.
pub fn output_bytes(data: &str, encoding: StdioEncoding) -> Result<Vec<u8>> {
    match encoding {
        StdioEncoding::Base64 => decode_data(data),
        StdioEncoding::Text => Ok(data.as_bytes().to_vec()),
    }
}

fn decode_frame(line: &[u8]) -> Result<ExecFrame> {
    serde_json::from_slice(line).map_err(|source| ApiError::Decode {
        what: "an exec frame".into(),
        source,
    })
}

/// The frames of a running exec, in order: `started`, `stdout`/`stderr`,
/// then `exit` or `error`. Dropping it closes the connection.
#[derive(Debug)]
pub struct ExecStream {
    body: Incoming,
    lines: NdjsonDecoder,
    done: bool,
}

/// What a finished exec produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOutput {
    /// Everything written to stdout.
    pub stdout: Vec<u8>,
    /// Everything written to stderr.
    pub stderr: Vec<u8>,
    /// Its exit code, when it exited.
    pub code: Option<i32>,
    /// The signal that killed it, when one did.
    pub signal: Option<i32>,
    /// Whether its timeout killed it.
    pub timed_out: bool,
}

impl ExecStream {
    /// The next frame; `None` at the end of the stream.
    pub async fn next_frame(&mut self) -> Option<Result<ExecFrame>> {
        poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// Collects the output until the `exit` frame; an `error` frame becomes
    /// [`ApiError::Api`].
    pub async fn collect_output(mut self) -> Result<ExecOutput> {
        let mut out = ExecOutput::default();
        while let Some(frame) = self.next_frame().await {
            match frame? {
                ExecFrame::Started { .. } => {}
                ExecFrame::Stdout { data, encoding } => {
                    out.stdout.extend(output_bytes(&data, encoding)?)
                }
                ExecFrame::Stderr { data, encoding } => {
                    out.stderr.extend(output_bytes(&data, encoding)?)
                }
                ExecFrame::Exit {
                    exit_code,
                    signal_number,
                    timed_out,
                    ..
                } => {
                    out.code = signal_number.is_none().then_some(exit_code);
                    out.signal = signal_number;
                    out.timed_out = timed_out;
                    return Ok(out);
                }
                ExecFrame::Error { error, code } => {
                    return Err(ApiError::Api {
                        status: code.http_status(),
                        body: ErrorBody { error, code },
                    })
                }
            }
        }
        Err(ApiError::Protocol(
            "the exec stream ended without an exit frame".into(),
        ))
    }
}

impl Stream for ExecStream {
    type Item = Result<ExecFrame>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(line) = this.lines.next_line() {
                return Poll::Ready(Some(decode_frame(&line)));
            }
            if this.done {
                return Poll::Ready(this.lines.finish().map(|line| decode_frame(&line)));
            }
            match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        this.lines.push(&data);
                    }
                }
                Some(Err(e)) => {
                    this.done = true;
                    this.lines = NdjsonDecoder::default();
                    return Poll::Ready(Some(Err(e.into())));
                }
                None => this.done = true,
            }
        }
    }
}

/// What [`TineClient::fs_watch`] watches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchOptions {
    /// Absolute paths in the guest (or `~/...`).
    pub paths: Vec<String>,
    /// Watch the directories below them too.
    pub recursive: bool,
    /// Globs a path must match (on the file name without `/`).
    pub patterns: Vec<String>,
    /// The kinds to report (all when empty).
    pub events: Vec<FsEventType>,
    /// End after this many events.
    pub max_events: Option<u64>,
    /// End after this long.
    pub timeout: Option<Duration>,
    /// Report each (kind, path) once per window.
    pub debounce: Option<Duration>,
}

/// The events of a file watch, read from its Server-Sent Events.
/// Dropping it ends the watch.
#[derive(Debug)]
pub struct FsWatchStream {
    body: Incoming,
    lines: NdjsonDecoder,
    /// The `data:` lines of the message being read.
    data: Vec<Bytes>,
    done: bool,
}

impl FsWatchStream {
    /// The next event; `None` once the daemon ended the stream (its
    /// `max_events` or `timeout`); an error when it was cut.
    pub async fn next_event(&mut self) -> Option<Result<FsWatchEvent>> {
        loop {
            while let Some(line) = self.lines.next_line_raw() {
                if line.is_empty() {
                    if let Some(event) = self.message() {
                        return Some(event);
                    }
                } else if let Some(data) = line.strip_prefix(b"data:") {
                    self.data.push(Bytes::copy_from_slice(data.trim_ascii()));
                }
            }
            if self.done {
                return self.message();
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.lines.push(&data);
                    }
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e.into()));
                }
                None => self.done = true,
            }
        }
    }

    /// The event the `data:` lines read so far make, if any.
    fn message(&mut self) -> Option<Result<FsWatchEvent>> {
        if self.data.is_empty() {
            return None;
        }
        let joined = self.data.join(&b'\n');
        self.data.clear();
        Some(
            serde_json::from_slice(&joined).map_err(|source| ApiError::Decode {
                what: "a watch event".into(),
                source,
            }),
        )
    }
}

/// A download's bytes, read as they arrive.
#[derive(Debug)]
pub struct Download {
    body: Incoming,
    chunk: Bytes,
    done: bool,
}

impl Download {
    /// Copies the rest of the download into `writer`; returns the bytes
    /// copied.
    pub async fn copy_to<W: AsyncWrite + Unpin>(mut self, writer: &mut W) -> Result<u64> {
        let n = tokio::io::copy(&mut self, writer).await?;
        writer.flush().await?;
        Ok(n)
    }
}

impl AsyncRead for Download {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.chunk.is_empty() {
                let n = this.chunk.len().min(buf.remaining());
                buf.put_slice(&this.chunk[..n]);
                this.chunk.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.done {
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        this.chunk = data;
                    }
                }
                Some(Err(e)) => {
                    this.done = true;
                    return Poll::Ready(Err(io::Error::other(e)));
                }
                None => this.done = true,
            }
        }
    }
}

/// Whether a WebSocket error only says the peer went away: the end of the
/// stream for a shell or a forward, even without a close frame.
fn closed_without_handshake(err: &tokio_tungstenite::tungstenite::Error) -> bool {
    use tokio_tungstenite::tungstenite::error::ProtocolError;
    use tokio_tungstenite::tungstenite::Error;
    matches!(
        err,
        Error::ConnectionClosed
            | Error::AlreadyClosed
            | Error::Protocol(ProtocolError::ResetWithoutClosingHandshake)
    )
}

/// One event of a shell session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShellEvent {
    /// Terminal output.
    Output(Bytes),
    /// The shell ended with this code; the last event.
    Exit(i32),
}

/// A shell on a terminal in the guest, over a WebSocket.
#[derive(Debug)]
pub struct ShellSession {
    ws: WebSocketStream<DaemonStream>,
}

impl ShellSession {
    /// Splits the session so input and output can be handled by separate
    /// tasks.
    pub fn split(self) -> (ShellWriter, ShellReader) {
        let (sink, stream) = self.ws.split();
        (ShellWriter { sink }, ShellReader { stream })
    }
}

/// The sending half of a [`ShellSession`].
#[derive(Debug)]
pub struct ShellWriter {
    sink: futures_util::stream::SplitSink<WebSocketStream<DaemonStream>, Message>,
}

impl ShellWriter {
    /// Sends terminal input.
    pub async fn send_input(&mut self, data: &[u8]) -> Result<()> {
        let msg = shell_frames::encode(shell_frames::DATA, data);
        Ok(self.sink.send(Message::Binary(msg.into())).await?)
    }

    /// Tells the guest the terminal's new size.
    pub async fn resize(&mut self, rows: u16, cols: u16) -> Result<()> {
        let mut size = Vec::with_capacity(8);
        size.extend_from_slice(&u32::from(cols).to_be_bytes());
        size.extend_from_slice(&u32::from(rows).to_be_bytes());
        let msg = shell_frames::encode(shell_frames::WINDOW_SIZE, &size);
        Ok(self.sink.send(Message::Binary(msg.into())).await?)
    }

    /// Closes the session (the daemon ends the shell).
    pub async fn close(&mut self) -> Result<()> {
        Ok(self.sink.close().await?)
    }
}

/// The receiving half of a [`ShellSession`].
#[derive(Debug)]
pub struct ShellReader {
    stream: futures_util::stream::SplitStream<WebSocketStream<DaemonStream>>,
}

impl ShellReader {
    /// The next output or the exit; `None` when the daemon closed without
    /// an exit message.
    pub async fn next_event(&mut self) -> Result<Option<ShellEvent>> {
        while let Some(msg) = self.stream.next().await {
            let data = match msg {
                Ok(Message::Binary(data)) => data,
                Ok(Message::Close(_)) => return Ok(None),
                Ok(_) => continue,
                Err(e) if closed_without_handshake(&e) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            match shell_frames::decode(&data) {
                Some((shell_frames::DATA, _)) => {
                    return Ok(Some(ShellEvent::Output(data.slice(5..))))
                }
                Some((shell_frames::SESSION_CLOSE, code)) => {
                    let code = <[u8; 4]>::try_from(code).map_or(0, i32::from_be_bytes);
                    return Ok(Some(ShellEvent::Exit(code)));
                }
                Some((shell_frames::HEARTBEAT, _)) => continue,
                Some((other, _)) => {
                    return Err(ApiError::Protocol(format!(
                        "shell frame of unknown type {other} ({} bytes)",
                        data.len()
                    )))
                }
                None => {
                    return Err(ApiError::Protocol(format!(
                        "shell message of {} bytes is not a frame (type, u32 length, payload)",
                        data.len()
                    )))
                }
            }
        }
        Ok(None)
    }
}

/// One forwarded connection to a socket in the guest, over a WebSocket.
#[derive(Debug)]
pub struct ForwardConnection {
    ws: WebSocketStream<DaemonStream>,
}

impl ForwardConnection {
    /// Sends bytes to the guest socket.
    pub async fn send(&mut self, data: &[u8]) -> Result<()> {
        Ok(self
            .ws
            .send(Message::Binary(Bytes::copy_from_slice(data)))
            .await?)
    }

    /// Bytes from the guest socket; `None` once the daemon closed.
    pub async fn recv(&mut self) -> Result<Option<Bytes>> {
        while let Some(msg) = self.ws.next().await {
            match msg {
                Ok(Message::Binary(data)) => return Ok(Some(data)),
                Ok(Message::Text(text)) => {
                    return Ok(Some(Bytes::copy_from_slice(text.as_bytes())))
                }
                Ok(Message::Close(_)) => return Ok(None),
                Ok(_) => {}
                Err(e) if closed_without_handshake(&e) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(None)
    }

    /// Ends the forward.
    pub async fn close(&mut self) -> Result<()> {
        Ok(self.ws.close(None).await?)
    }

    /// Copies bytes both ways between the guest socket and `io` (a local
    /// `TcpStream`, say) until the daemon closes; EOF on `io` closes the
    /// WebSocket. Returns (bytes sent to the guest, bytes received).
    pub async fn bridge<S: AsyncRead + AsyncWrite>(self, io: S) -> Result<(u64, u64)> {
        let (mut sink, mut stream) = self.ws.split();
        let (mut local_rx, mut local_tx) = tokio::io::split(io);
        let upstream = async {
            let mut sent = 0u64;
            let mut buf = vec![0u8; FORWARD_CHUNK];
            loop {
                let n = local_rx.read(&mut buf).await?;
                if n == 0 {
                    sink.send(Message::Close(None)).await?;
                    return Ok::<u64, ApiError>(sent);
                }
                sink.send(Message::Binary(Bytes::copy_from_slice(&buf[..n])))
                    .await?;
                sent += n as u64;
            }
        };
        let downstream = async {
            let mut received = 0u64;
            while let Some(msg) = stream.next().await {
                let data = match msg {
                    Ok(Message::Binary(data)) => data,
                    Ok(Message::Text(text)) => Bytes::copy_from_slice(text.as_bytes()),
                    Ok(Message::Close(_)) => break,
                    Ok(_) => continue,
                    Err(e) if closed_without_handshake(&e) => break,
                    Err(e) => return Err(ApiError::from(e)),
                };
                local_tx.write_all(&data).await?;
                received += data.len() as u64;
            }
            // The peer may be gone already; nothing more to tell it.
            if let Err(e) = local_tx.shutdown().await {
                tracing::debug!("port forward: cannot end the local side: {e}");
            }
            Ok::<u64, ApiError>(received)
        };
        tokio::pin!(upstream, downstream);
        let mut sent = None;
        loop {
            tokio::select! {
                result = &mut upstream, if sent.is_none() => sent = Some(result?),
                result = &mut downstream => {
                    let received = result?;
                    return Ok((sent.unwrap_or_default(), received));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse() {
        assert_eq!(
            parse_url("unix:///run/tine.sock").expect("unix"),
            Endpoint::Unix("/run/tine.sock".into())
        );
        assert_eq!(
            parse_url("/run/tine.sock").expect("path"),
            Endpoint::Unix("/run/tine.sock".into())
        );
        assert_eq!(
            parse_url("http://127.0.0.1:8080").expect("tcp"),
            Endpoint::Tcp {
                host: "127.0.0.1".into(),
                port: 8080
            }
        );
        assert_eq!(
            parse_url("http://[::1]:9/").expect("v6"),
            Endpoint::Tcp {
                host: "::1".into(),
                port: 9
            }
        );
        assert_eq!(
            parse_url("http://host").expect("default port"),
            Endpoint::Tcp {
                host: "host".into(),
                port: 80
            }
        );
        assert!(parse_url("https://host:1").is_err());
        assert!(parse_url("http://host:x").is_err());
        assert!(parse_url("unix://").is_err());
    }

    #[test]
    fn queries_escape_and_repeat() {
        let mut q = Query::new();
        q.add("cmd", "sh")
            .add("args", "-c")
            .add("args", "echo a&b=c");
        assert_eq!(
            q.finish("/vm/x/exec".into()),
            "/vm/x/exec?cmd=sh&args=-c&args=echo+a%26b%3Dc"
        );
        assert_eq!(seg("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn durations_format_for_humantime() {
        assert_eq!(format_duration(Duration::from_secs(60)), "60s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
    }

    #[test]
    fn ndjson_lines_cross_chunks() {
        let mut d = NdjsonDecoder::default();
        d.push(b"{\"a\":1}\n{\"b\"");
        assert_eq!(d.next_line().as_deref(), Some(&b"{\"a\":1}"[..]));
        assert_eq!(d.next_line(), None);
        d.push(b":2}\r\n\n");
        assert_eq!(d.next_line().as_deref(), Some(&b"{\"b\":2}"[..]));
        assert_eq!(d.next_line(), None);
        d.push(b"{\"c\":3}");
        assert_eq!(d.finish().as_deref(), Some(&b"{\"c\":3}"[..]));
    }

    #[test]
    fn error_bodies_decode_or_fall_back() {
        let e = api_error(404, br#"{"error":"no VM dev-9","code":"not_found"}"#);
        assert_eq!(e.to_string(), "no VM dev-9");
        assert_eq!(e.code(), Some(ErrorCode::NotFound));
        let e = api_error(502, b"bad gateway");
        assert_eq!(e.to_string(), "HTTP 502: bad gateway");
        assert_eq!(e.code(), Some(ErrorCode::Internal));
        assert!(api_error(408, b"").is_timeout());
    }

    #[test]
    fn forward_targets_format() {
        assert_eq!(
            ForwardTarget::Tcp {
                host: None,
                port: 80
            }
            .to_string(),
            "tcp:80"
        );
        assert_eq!(
            ForwardTarget::Tcp {
                host: Some("db".into()),
                port: 5432
            }
            .to_string(),
            "tcp:db:5432"
        );
        assert_eq!(
            ForwardTarget::Unix("/run/x.sock".into()).to_string(),
            "unix:/run/x.sock"
        );
    }
}
