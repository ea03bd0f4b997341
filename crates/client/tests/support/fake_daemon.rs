//! A fake tine daemon for tests: an axum server on a Unix socket in a temp
//! dir (and optionally on TCP with a bearer token) that speaks the shapes of
//! docs/api.md with canned data. Shared by the client's and the CLI's tests.
//! Its routes ([`routes`]), bodies (`tine_proto::api` types) and error
//! statuses are checked against the real daemon by the CLI's
//! `fake_matches_daemon` test.
//!
//! Canned behaviour:
//! - host group `dev` with VMs `dev-1` (running, tags `name=web`, `env=ci`)
//!   and `dev-2` (stopped); anything else is 404. As in the daemon, the
//!   guest routes (health, exec, cp, shell, forward) answer 409 for the
//!   stopped VM, and health with `wait=agent` 500. `evil` (running, not
//!   listed) is a VM whose guest writes terminal escapes wherever guest text
//!   reaches: its `reason`, agent version and console log.
//! - create: 201 `dev-3`, `starting` without wait, `running` with
//!   `wait=agent`; a request named `slow` with `wait=agent` gets 408.
//! - exec `cmd`: `echo ARGS` prints them; `exit N` exits N; `kill N` dies
//!   of signal N; `cat` copies the streamed request body to stdout; `err`
//!   writes `oops` to stderr and exits 2; `split` sends its frames cut in
//!   the middle of lines, one piece every few ms; `lost` starts and then
//!   gets an `error` frame (`agent_unavailable`), as when the agent goes
//!   away; anything else cannot start: 400, before any frame.
//! - cp download: `hello from PATH\n`; in tar mode, `/hostile-tree` is
//!   what a guest that replaced its agent could send (a setuid file, a
//!   world-writable sticky directory, a device carrying bytes);
//!   `/cut-short` sends 8 bytes and aborts the body, as the daemon does
//!   when the agent fails mid-download; upload: counts and keeps the bytes.
//! - images: `app` (OCI, imported) and `min` (built-in, used by `dev-1`:
//!   removing it is a 409); an import of a body starting with `bad` ends
//!   with an `error` event, any other with `done`.
//! - shell: greets, echoes terminal data, answers a resize with
//!   `resized R C`, ends with exit 3 on input `exit\r`, and goes away
//!   without an exit message on `drop\r`.
//! - forward: echoes, prefixed once with the target.
//! - stats: `dev-1` with a snapshot and host figures, `dev-2` with
//!   `error` "dev-2 is stopped"; pause and resume answer the VM for a
//!   running one, 409 for the stopped one.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter};
use axum::{Json, Router};
use base64::Engine as _;
use futures_util::StreamExt;
use tine_proto::api::{
    CommitInfo, CommitPoolRequest, CommitRequest, CpResponse, CreateVmRequest, CreateVmResponse,
    DaemonInfo, DeleteCommitResponse, DeleteStatus, ErrorBody, ErrorCode, ExecFrame, ForkRequest,
    ForkResponse, HostGroupInfo, LifecycleResponse, LogsResponse, NodeStat, StdioEncoding,
    StopMode, StorageInfo, StorageKind, TagsPatch, TagsResponse, VmHealth, VmHostStats, VmInfo,
    VmNetworkInfo, VmSnapshot, VmState, VmStatus,
};
use tokio::sync::mpsc;

/// One request as the fake saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// `GET`, `POST`, ...
    pub method: String,
    /// Path and query as sent.
    pub uri: String,
    /// The Authorization header, if any.
    pub authorization: Option<String>,
    /// The request body, for JSON bodies.
    pub body: Option<String>,
}

/// What the fake records.
#[derive(Debug, Default)]
pub struct Record {
    /// Every request, in order.
    pub requests: Vec<Seen>,
    /// Uploaded files: path -> bytes.
    pub uploads: BTreeMap<String, Vec<u8>>,
    /// How many body chunks each upload arrived in.
    pub upload_chunks: BTreeMap<String, usize>,
    /// Bytes received so far by uploads still arriving.
    pub upload_progress: BTreeMap<String, usize>,
}

/// Shared state of the fake.
#[derive(Clone)]
struct Fake {
    record: Arc<Mutex<Record>>,
    token: Option<String>,
}

/// A running fake daemon.
pub struct FakeDaemon {
    _dir: tempfile::TempDir,
    /// Its socket.
    pub socket: PathBuf,
    /// `http://127.0.0.1:PORT`, when started with TCP.
    pub tcp_url: Option<String>,
    record: Arc<Mutex<Record>>,
}

impl FakeDaemon {
    /// Starts the fake on a Unix socket (and on TCP, with `token`).
    pub async fn start(tcp_token: Option<&str>) -> FakeDaemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("tine.sock");
        let record = Arc::new(Mutex::new(Record::default()));
        let unix = tokio::net::UnixListener::bind(&socket).expect("bind socket");
        let app = router(Fake {
            record: record.clone(),
            token: None,
        });
        tokio::spawn(async move {
            axum::serve(unix, app).await.expect("serve unix");
        });
        let tcp_url = match tcp_token {
            Some(token) => {
                let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind tcp");
                let addr = tcp.local_addr().expect("addr");
                let app = router(Fake {
                    record: record.clone(),
                    token: Some(token.to_string()),
                });
                tokio::spawn(async move {
                    axum::serve(tcp, app).await.expect("serve tcp");
                });
                Some(format!("http://{addr}"))
            }
            None => None,
        };
        FakeDaemon {
            _dir: dir,
            socket,
            tcp_url,
            record,
        }
    }

    /// `unix:///...` of its socket.
    pub fn url(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Every request seen so far.
    pub fn requests(&self) -> Vec<Seen> {
        self.record.lock().expect("lock").requests.clone()
    }

    /// The last request whose URI starts with `prefix`.
    pub fn last(&self, prefix: &str) -> Seen {
        self.requests()
            .into_iter()
            .rev()
            .find(|s| s.uri.starts_with(prefix))
            .unwrap_or_else(|| panic!("no request to {prefix}"))
    }

    /// Bytes of an upload to `path` received so far.
    pub fn upload_progress(&self, path: &str) -> usize {
        let r = self.record.lock().expect("lock");
        r.upload_progress.get(path).copied().unwrap_or(0)
    }

    /// The bytes uploaded to `path` and the number of chunks they came in.
    pub fn upload(&self, path: &str) -> Option<(Vec<u8>, usize)> {
        let r = self.record.lock().expect("lock");
        let data = r.uploads.get(path)?.clone();
        Some((data, r.upload_chunks.get(path).copied().unwrap_or(0)))
    }
}

/// The fake's router and the `(method, path)` of each of its routes, built
/// together like the daemon's `Routes`, so the list is what is served.
struct FakeRoutes {
    router: Router<Fake>,
    list: Vec<(Method, String)>,
}

impl FakeRoutes {
    fn add<H, T>(mut self, method: Method, path: &str, handler: H) -> Self
    where
        H: axum::handler::Handler<T, Fake>,
        T: 'static,
    {
        let filter = MethodFilter::try_from(method.clone()).expect("a method axum routes");
        self.router = self.router.route(path, on(filter, handler));
        self.list.push((method, path.to_owned()));
        self
    }
}

fn fake_routes() -> FakeRoutes {
    use Method as M;
    FakeRoutes {
        router: Router::new(),
        list: Vec::new(),
    }
    .add(M::GET, "/healthz", healthz)
    .add(M::GET, "/info", info)
    .add(M::GET, "/hostgroup", groups)
    .add(M::GET, "/hostgroup/{group}/nodes", group_nodes)
    .add(M::POST, "/hostgroup/{group}/nodes", create)
    .add(M::DELETE, "/hostgroup/{group}/nodes/{hostname}", delete_vm)
    .add(M::GET, "/nodes", nodes)
    .add(M::GET, "/nodes/stats", all_stats)
    .add(M::GET, "/node/{hostname}/stats", one_stat)
    .add(M::POST, "/vm/{hostname}/pause", pause)
    .add(M::POST, "/vm/{hostname}/resume", resume)
    .add(M::GET, "/vm/commits", commits)
    .add(M::DELETE, "/vm/commits/{id}", delete_commit)
    .add(M::POST, "/vm/commits/{id}/fork", fork)
    .add(M::PUT, "/vm/commits/{id}/pool", set_pool)
    .add(M::DELETE, "/vm/commits/{id}/pool", reset_pool)
    .add(M::GET, "/vm/{hostname}", describe)
    .add(M::DELETE, "/vm/{hostname}", delete_vm_by_name)
    .add(M::GET, "/vm/{hostname}/tags", tags)
    .add(M::PATCH, "/vm/{hostname}/tags", patch_tags)
    .add(M::GET, "/vm/{hostname}/health", health)
    .add(M::GET, "/vm/{hostname}/logs", logs)
    .add(M::POST, "/vm/{hostname}/shutdown", shutdown)
    .add(M::POST, "/vm/{hostname}/relaunch", relaunch)
    .add(M::POST, "/vm/{hostname}/exec", exec)
    .add(M::GET, "/vm/{hostname}/cp", download)
    .add(M::POST, "/vm/{hostname}/cp", upload)
    .add(M::GET, "/vm/{hostname}/shell", shell)
    .add(M::GET, "/vm/{hostname}/forward", forward)
    .add(M::POST, "/vm/{hostname}/commit", commit)
    .add(M::GET, "/images", images)
    .add(M::POST, "/images", import_image)
    .add(M::GET, "/images/{name}", image)
    .add(M::DELETE, "/images/{name}", delete_image)
}

/// Every route the fake serves, as `(method, path)` with `{param}`
/// placeholders (the form of the daemon's `Routes::list`).
pub fn routes() -> Vec<(Method, String)> {
    fake_routes().list
}

fn router(fake: Fake) -> Router {
    fake_routes()
        .router
        // The daemon's two fallbacks, with its messages.
        .fallback(|req: Request| async move {
            let msg = format!("no route {} {}", req.method(), req.uri().path());
            err(StatusCode::NOT_FOUND, ErrorCode::NotFound, &msg)
        })
        .method_not_allowed_fallback(|req: Request| async move {
            let msg = format!("{} is not allowed on {}", req.method(), req.uri().path());
            err(StatusCode::METHOD_NOT_ALLOWED, ErrorCode::BadRequest, &msg)
        })
        .layer(middleware::from_fn_with_state(
            fake.clone(),
            record_and_auth,
        ))
        .with_state(fake)
}

async fn healthz() -> Json<tine_proto::api::HealthResponse> {
    Json(tine_proto::api::HealthResponse {
        status: tine_proto::api::HealthStatus::Ok,
    })
}

async fn record_and_auth(State(fake): State<Fake>, req: Request, next: Next) -> Response {
    let method = req.method().to_string();
    let uri = req.uri().to_string();
    let authorization = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let is_json = req
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes() == b"application/json");
    let (req, body) = if is_json {
        let (parts, body) = req.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20).await.expect("body");
        let text = String::from_utf8_lossy(&bytes).into_owned();
        (Request::from_parts(parts, Body::from(bytes)), Some(text))
    } else {
        (req, None)
    };
    fake.record.lock().expect("lock").requests.push(Seen {
        method,
        uri,
        authorization: authorization.clone(),
        body,
    });
    if let Some(token) = &fake.token {
        let given = authorization
            .as_deref()
            .and_then(|v| v.strip_prefix("Bearer "));
        let problem = match given {
            None => Some(
                "missing bearer token (Authorization: Bearer <token>; \
                 the token is in <data_dir>/auth/token)",
            ),
            Some(t) if t != token => Some("wrong bearer token"),
            Some(_) => None,
        };
        if let Some(problem) = problem {
            return err(StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized, problem);
        }
    }
    next.run(req).await
}

fn err(status: StatusCode, code: ErrorCode, msg: &str) -> Response {
    (
        status,
        Json(ErrorBody {
            error: msg.to_string(),
            code,
        }),
    )
        .into_response()
}

fn not_found_vm(name: &str) -> Response {
    err(
        StatusCode::NOT_FOUND,
        ErrorCode::NotFound,
        &format!("no VM called `{name}`"),
    )
}

fn not_found_group(group: &str) -> Response {
    err(
        StatusCode::NOT_FOUND,
        ErrorCode::NotFound,
        &format!("no host group `{group}` (known: dev)"),
    )
}

fn not_found_commit(id: &str) -> Response {
    err(
        StatusCode::NOT_FOUND,
        ErrorCode::NotFound,
        &format!("no commit `{id}`"),
    )
}

fn bad_request(msg: &str) -> Response {
    err(StatusCode::BAD_REQUEST, ErrorCode::BadRequest, msg)
}

/// The VM behind a guest route: as in the daemon, one that is not running
/// has no agent to talk to (409). The error is the answer to send.
fn guest_vm(name: &str) -> Result<VmInfo, Box<Response>> {
    let v = vm(name).ok_or_else(|| Box::new(not_found_vm(name)))?;
    if v.state != VmState::Running {
        return Err(Box::new(err(
            StatusCode::CONFLICT,
            ErrorCode::Conflict,
            &format!(
                "{} is {}; start it with relaunch first",
                v.hostname, v.state
            ),
        )));
    }
    Ok(v)
}

/// The `path` of a cp request, checked as the daemon does.
fn cp_path(q: &[(String, String)]) -> Result<String, Box<Response>> {
    let path = param(q, "path")
        .filter(|p| p.starts_with('/'))
        .ok_or_else(|| Box::new(bad_request("`path` is required and must be absolute")))?;
    match param(q, "mode").as_deref() {
        None | Some("binary") | Some("tar") => Ok(path),
        Some(m) => Err(Box::new(bad_request(&format!(
            "mode `{m}` is not binary or tar"
        )))),
    }
}

fn vm(hostname: &str) -> Option<VmInfo> {
    let (state, tags, ip) = match hostname {
        "dev-1" | "web" => (
            VmState::Running,
            vec!["name=web".to_string(), "env=ci".to_string()],
            Some("10.0.0.2".to_string()),
        ),
        "dev-2" => (VmState::Stopped, vec![], None),
        "evil" => (VmState::Running, vec![], None),
        _ => return None,
    };
    let hostname = if hostname == "web" { "dev-1" } else { hostname };
    let reason = (hostname == "evil").then(|| format!("agent said {EVIL_OSC52}"));
    Some(VmInfo {
        hostname: hostname.to_string(),
        host_group: "dev".into(),
        status: state.into(),
        state,
        cpus: 1,
        ram_bytes: 512 << 20,
        persistent: true,
        tags,
        secrets: vec![],
        ip,
        arch: "amd64".into(),
        image: "min".into(),
        network: VmNetworkInfo::no_device(),
        pid: None,
        reason,
        stop_mode: None,
        created_at: "2026-01-01T00:00:00.000Z".into(),
        started_at: None,
        boot_ms: Some(812),
        commit_id: None,
        parent_commit_id: None,
        storage: StorageKind::Image,
        disk: StorageInfo {
            path: format!("/var/lib/tine/vms/{hostname}.qcow2"),
            format: "qcow2".into(),
            size_bytes: 4 << 30,
            allocated_bytes: 1 << 20,
        },
        // A hot fork that copied 300 of its guest pages.
        memory: (hostname == "dev-1").then_some(tine_proto::api::VmMemoryInfo {
            rss_bytes: 3 << 20,
            pss_bytes: 2 << 20,
            uss_bytes: 1536 << 10,
            guest_pages_copied: Some(300),
        }),
    })
}

/// OSC 0: sets the terminal's title.
pub const EVIL_OSC0: &str = "\u{1b}]0;pwned\u{7}";
/// Clears the screen.
pub const EVIL_CLEAR: &str = "\u{1b}[2J";
/// OSC 52: writes the clipboard (`rm -rf ~`).
pub const EVIL_OSC52: &str = "\u{1b}]52;c;cm0gLXJmIH4K\u{7}";
/// CSI as the one C1 character U+009B.
pub const EVIL_C1: &str = "\u{9b}2J";

fn query_pairs(q: &Option<String>) -> Vec<(String, String)> {
    let q = q.clone().unwrap_or_default();
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            let dec = |s: &str| percent_decode(&s.replace('+', " "));
            (dec(k), dec(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn param(q: &[(String, String)], key: &str) -> Option<String> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

async fn info() -> Json<DaemonInfo> {
    Json(DaemonInfo {
        version: "0.1.0".into(),
        git_commit: "0123456789ab".into(),
        platform: "linux".into(),
        arch: "amd64".into(),
        data_dir: "/var/lib/tine".into(),
        pid: 42,
        started_at: "2026-01-01T00:00:00.000Z".into(),
        host_groups: vec!["dev".into()],
        vms: 2,
    })
}

async fn groups() -> Json<Vec<HostGroupInfo>> {
    Json(vec![HostGroupInfo {
        name: "dev".into(),
        count: 1,
        cpus: 1,
        max_cpus: 2,
        ram_bytes: 512 << 20,
        max_ram_bytes: 1 << 30,
        image: "min".into(),
        storage_bytes: 4 << 30,
        persistent: true,
        network: "none".into(),
        nodes: 2,
        arch: "amd64".into(),
        gpu_count: 0,
        hot_fork_pool: 1,
    }])
}

fn all_vms() -> Vec<VmInfo> {
    ["dev-1", "dev-2"].iter().filter_map(|h| vm(h)).collect()
}

fn filter(vms: Vec<VmInfo>, q: &[(String, String)]) -> Vec<VmInfo> {
    let tag = param(q, "tag");
    let prefix = param(q, "tag_prefix");
    vms.into_iter()
        .filter(|v| tag.as_ref().is_none_or(|t| v.tags.contains(t)))
        .filter(|v| {
            prefix
                .as_ref()
                .is_none_or(|p| v.tags.iter().any(|t| t.starts_with(p.as_str())))
        })
        .collect()
}

async fn nodes(RawQuery(q): RawQuery) -> Json<Vec<VmInfo>> {
    Json(filter(all_vms(), &query_pairs(&q)))
}

async fn group_nodes(Path(group): Path<String>, RawQuery(q): RawQuery) -> Response {
    if group != "dev" {
        return not_found_group(&group);
    }
    Json(filter(all_vms(), &query_pairs(&q))).into_response()
}

async fn create(
    Path(group): Path<String>,
    RawQuery(q): RawQuery,
    Json(req): Json<CreateVmRequest>,
) -> Response {
    if group != "dev" {
        return not_found_group(&group);
    }
    let q = query_pairs(&q);
    let wait = param(&q, "wait").as_deref() == Some("agent");
    if req.cpus.is_some_and(|c| c > 2) {
        return bad_request("cpus 4 is above the group's maximum 2");
    }
    if wait && req.name.as_deref() == Some("slow") {
        return err(
            StatusCode::REQUEST_TIMEOUT,
            ErrorCode::Timeout,
            "dev-3 did not answer within 1s",
        );
    }
    (
        StatusCode::CREATED,
        Json(CreateVmResponse {
            hostname: "dev-3".into(),
            host_group: "dev".into(),
            state: if wait {
                VmState::Running
            } else {
                VmState::Starting
            },
            ip: None,
            created_at: "2026-01-01T00:00:00.000Z".into(),
            arch: "amd64".into(),
            elapsed_ms: 812,
        }),
    )
        .into_response()
}

/// The stat of a listed VM: a snapshot for a running one.
fn stat_of(v: VmInfo) -> NodeStat {
    let running = v.state == VmState::Running;
    let snapshot = running.then(|| {
        serde_json::from_value::<VmSnapshot>(serde_json::json!({
            "hostname": v.hostname, "arch": "amd64",
            "timestamp": "2026-01-01T00:10:00.000Z", "uptime": "10m0s",
            "totalCpus": 1, "totalMemory": 512u64 << 20, "memoryUsed": 128u64 << 20,
            "memoryAvailable": 384u64 << 20, "memoryUsedPercent": 25.0,
            "loadAvg1": 0.25, "loadAvg5": 0.1, "loadAvg15": 0.05,
            "diskReadTotal": 1048576.0, "diskWriteTotal": 524288.0,
            "networkReadTotal": 0.0, "networkWriteTotal": 0.0, "diskIOInflight": 0,
            "openConnections": 0, "openFiles": 96, "entropy": 256,
            "diskSpaceTotal": 4u64 << 30, "diskSpaceUsed": 1u64 << 30,
            "diskSpaceFree": 3u64 << 30, "diskSpaceUsedPercent": 25.0,
            "uptimeMs": 600_000, "memoryFree": 256u64 << 20, "cpuUserMs": 900,
            "cpuSystemMs": 300, "cpuIdleMs": 598_000, "cpuIowaitMs": 0, "cpuStealMs": 0
        }))
        .expect("a snapshot")
    });
    let mut host = VmHostStats::disk_only(v.disk.clone());
    if running {
        host.vmm_pid = Some(4242);
        host.cpu_user_ms = Some(1500);
        host.cpu_system_ms = Some(500);
        host.rss_bytes = Some(200 << 20);
        host.pss_bytes = Some(120 << 20);
        host.uss_bytes = Some(80 << 20);
        host.swap_bytes = Some(0);
    }
    NodeStat {
        error: if running {
            String::new()
        } else {
            format!("{} is {}", v.hostname, v.state)
        },
        hostname: v.hostname,
        ip: v.ip.unwrap_or_default(),
        created_at: v.created_at,
        snapshot,
        host,
    }
}

async fn all_stats() -> Json<Vec<NodeStat>> {
    Json(all_vms().into_iter().map(stat_of).collect())
}

async fn one_stat(Path(h): Path<String>) -> Response {
    match vm(&h) {
        Some(v) => Json(vec![stat_of(v)]).into_response(),
        None => not_found_vm(&h),
    }
}

async fn pause(Path(h): Path<String>) -> Response {
    match guest_vm(&h) {
        Ok(v) => Json(VmInfo {
            status: VmStatus::Paused,
            ..v
        })
        .into_response(),
        Err(e) => *e,
    }
}

async fn resume(Path(h): Path<String>) -> Response {
    match guest_vm(&h) {
        Ok(v) => Json(v).into_response(),
        Err(e) => *e,
    }
}

async fn describe(Path(h): Path<String>) -> Response {
    match vm(&h) {
        Some(v) => Json(v).into_response(),
        None => not_found_vm(&h),
    }
}

fn lifecycle(h: &str, state: VmState, stop_mode: Option<StopMode>) -> Response {
    match vm(h) {
        Some(v) => Json(LifecycleResponse {
            hostname: v.hostname,
            state,
            stop_mode,
            elapsed_ms: 5,
            message: None,
            disk_removed: None,
        })
        .into_response(),
        None => not_found_vm(h),
    }
}

fn conflict(msg: &str) -> Response {
    err(StatusCode::CONFLICT, ErrorCode::Conflict, msg)
}

async fn delete_vm(Path((g, h)): Path<(String, String)>) -> Response {
    if g != "dev" {
        return not_found_group(&g);
    }
    lifecycle(&h, VmState::Stopped, None)
}

async fn delete_vm_by_name(Path(h): Path<String>) -> Response {
    lifecycle(&h, VmState::Stopped, None)
}

async fn tags(Path(h): Path<String>) -> Response {
    match vm(&h) {
        Some(v) => Json(TagsResponse {
            hostname: v.hostname,
            tags: v.tags,
        })
        .into_response(),
        None => not_found_vm(&h),
    }
}

async fn patch_tags(Path(h): Path<String>, Json(patch): Json<TagsPatch>) -> Response {
    let Some(v) = vm(&h) else {
        return not_found_vm(&h);
    };
    let mut tags = match patch.replace {
        Some(r) => r,
        None => v.tags,
    };
    tags.retain(|t| !patch.remove.contains(t));
    tags.extend(patch.add);
    Json(TagsResponse {
        hostname: v.hostname,
        tags,
    })
    .into_response()
}

async fn health(Path(h): Path<String>, RawQuery(q): RawQuery) -> Response {
    let Some(v) = vm(&h) else {
        return not_found_vm(&h);
    };
    let q = query_pairs(&q);
    // The daemon's wait for a VM that is not starting gives up at once.
    if v.state != VmState::Running && param(&q, "wait").as_deref() == Some("agent") {
        return err(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            &format!(
                "{} {} before its agent answered: no reason recorded",
                v.hostname, v.state
            ),
        );
    }
    let v = match guest_vm(&h) {
        Ok(v) => v,
        Err(e) => return *e,
    };
    let agent_version = if v.hostname == "evil" {
        format!("0.1.0{EVIL_OSC0}{EVIL_C1}")
    } else {
        "0.1.0".into()
    };
    Json(VmHealth {
        hostname: v.hostname,
        agent_ready: true,
        agent_version,
        agent_uptime: 1_000_000_000,
        system_uptime: 1_200_000_000,
        agent_uptime_ms: 1000,
        system_uptime_ms: 1200,
        userdata_ran: true,
        rtt_ms: 0.4,
    })
    .into_response()
}

async fn logs(Path(h): Path<String>, RawQuery(q): RawQuery) -> Response {
    let Some(v) = vm(&h) else {
        return not_found_vm(&h);
    };
    let n = param(&query_pairs(&q), "lines")
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(200);
    let mut lines: Vec<String> = (1..=3).map(|i| format!("console line {i}")).collect();
    if v.hostname == "evil" {
        lines.push(format!("{EVIL_CLEAR}{EVIL_OSC52}\tboot done\r"));
        lines.push(format!("{EVIL_OSC0}{EVIL_C1}"));
    }
    let skip = lines.len().saturating_sub(n);
    let mut content = String::new();
    for line in &lines[skip..] {
        content.push_str(line);
        content.push('\n');
    }
    Json(LogsResponse {
        hostname: v.hostname,
        lines: lines.len() - skip,
        content,
    })
    .into_response()
}

async fn shutdown(Path(h): Path<String>, RawQuery(q): RawQuery) -> Response {
    match vm(&h) {
        Some(v) if v.state == VmState::Stopped => {
            return conflict(&format!("{} is already stopped", v.hostname))
        }
        _ => {}
    }
    let mode = match param(&query_pairs(&q), "action").as_deref() {
        Some("poweroff") => StopMode::Forced,
        _ => StopMode::Graceful,
    };
    lifecycle(&h, VmState::Stopped, Some(mode))
}

async fn relaunch(Path(h): Path<String>, RawQuery(q): RawQuery) -> Response {
    match vm(&h) {
        Some(v) if v.state == VmState::Running => {
            return conflict(&format!("{} is running", v.hostname))
        }
        _ => {}
    }
    let wait = param(&query_pairs(&q), "wait").as_deref() == Some("agent");
    let state = if wait {
        VmState::Running
    } else {
        VmState::Starting
    };
    // A relaunch answers as a create does.
    match vm(&h) {
        Some(v) => Json(CreateVmResponse {
            hostname: v.hostname,
            host_group: "dev".into(),
            state,
            ip: None,
            created_at: "2026-01-01T00:00:00.000Z".into(),
            arch: "amd64".into(),
            elapsed_ms: 5,
        })
        .into_response(),
        None => not_found_vm(&h),
    }
}

fn frame_line(f: &ExecFrame) -> Bytes {
    let mut line = serde_json::to_vec(f).expect("encode frame");
    line.push(b'\n');
    Bytes::from(line)
}

fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

fn exit(code: Option<i32>, signal: Option<i32>) -> ExecFrame {
    ExecFrame::Exit {
        exit_code: code.unwrap_or(128 + signal.unwrap_or(0)),
        signal: signal.map(|_| "SIGKILL".to_string()),
        signal_number: signal,
        timed_out: false,
        duration_ms: 3,
    }
}

/// A streamed response body fed by a channel.
fn channel_body() -> (mpsc::Sender<Bytes>, Body) {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<Bytes, std::io::Error>(b), rx))
    });
    (tx, Body::from_stream(stream))
}

/// The commands the fake's exec knows.
const EXEC_COMMANDS: &[&str] = &["echo", "exit", "kill", "err", "cat", "split", "lost"];

async fn exec(Path(h): Path<String>, RawQuery(q): RawQuery, body: Body) -> Response {
    let q = query_pairs(&q);
    let Some(cmd) = param(&q, "cmd").filter(|c| !c.is_empty()) else {
        return bad_request("`cmd` is required");
    };
    if let Err(e) = guest_vm(&h) {
        return *e;
    }
    if !EXEC_COMMANDS.contains(&cmd.as_str()) {
        // What the daemon answers when the agent cannot start the program.
        return bad_request(&format!(
            "Agent error (not_found): cannot start {cmd:?}: No such file or directory (os error 2)"
        ));
    }
    let args: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "args")
        .map(|(_, v)| v.clone())
        .collect();
    let (tx, out) = channel_body();
    tokio::spawn(async move {
        let send = |f: ExecFrame| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(frame_line(&f)).await;
            }
        };
        match cmd.as_str() {
            "echo" => {
                send(ExecFrame::Started { pid: 7 }).await;
                let text = format!("{}\n", args.join(" "));
                send(ExecFrame::Stdout {
                    data: b64(text.as_bytes()),
                    encoding: StdioEncoding::Base64,
                })
                .await;
                send(exit(Some(0), None)).await;
            }
            "exit" => {
                send(ExecFrame::Started { pid: 7 }).await;
                let code = args.first().and_then(|a| a.parse().ok()).unwrap_or(1);
                send(exit(Some(code), None)).await;
            }
            "kill" => {
                send(ExecFrame::Started { pid: 7 }).await;
                let sig = args.first().and_then(|a| a.parse().ok()).unwrap_or(9);
                send(exit(None, Some(sig))).await;
            }
            "err" => {
                send(ExecFrame::Started { pid: 7 }).await;
                send(ExecFrame::Stderr {
                    data: b64(b"oops\n"),
                    encoding: StdioEncoding::Base64,
                })
                .await;
                send(exit(Some(2), None)).await;
            }
            "cat" => {
                send(ExecFrame::Started { pid: 7 }).await;
                let mut stream = body.into_data_stream();
                while let Some(Ok(chunk)) = stream.next().await {
                    send(ExecFrame::Stdout {
                        data: b64(&chunk),
                        encoding: StdioEncoding::Base64,
                    })
                    .await;
                }
                send(exit(Some(0), None)).await;
            }
            "split" => {
                let mut all = Vec::new();
                all.extend_from_slice(&frame_line(&ExecFrame::Started { pid: 7 }));
                all.extend_from_slice(&frame_line(&ExecFrame::Stdout {
                    data: b64(b"one\n"),
                    encoding: StdioEncoding::Base64,
                }));
                all.extend_from_slice(&frame_line(&ExecFrame::Stdout {
                    data: b64(b"two\n"),
                    encoding: StdioEncoding::Base64,
                }));
                all.extend_from_slice(&frame_line(&exit(Some(5), None)));
                for piece in all.chunks(7) {
                    let _ = tx.send(Bytes::copy_from_slice(piece)).await;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            _ => {
                send(ExecFrame::Started { pid: 7 }).await;
                send(ExecFrame::Error {
                    error: "the agent closed the stream before the process ended".into(),
                    code: ErrorCode::AgentUnavailable,
                })
                .await;
            }
        }
    });
    ([("content-type", "application/x-ndjson")], out).into_response()
}

async fn download(Path(h): Path<String>, RawQuery(q): RawQuery) -> Response {
    let q = query_pairs(&q);
    let path = match cp_path(&q) {
        Ok(path) => path,
        Err(e) => return *e,
    };
    if let Err(e) = guest_vm(&h) {
        return *e;
    }
    if path == "/missing" {
        return err(
            StatusCode::NOT_FOUND,
            ErrorCode::NotFound,
            "/missing: no such file",
        );
    }
    if path == "/cut-short" {
        let parts: [Result<Bytes, std::io::Error>; 2] = [
            Ok(Bytes::from_static(b"8 bytes!")),
            Err(std::io::Error::other("the agent failed")),
        ];
        let body = Body::from_stream(futures_util::stream::iter(parts));
        return ([("content-type", "application/octet-stream")], body).into_response();
    }
    if path == "/hostile-tree" && param(&q, "mode").as_deref() == Some("tar") {
        return ([("content-type", "application/x-tar")], hostile_tar()).into_response();
    }
    let (tx, body) = channel_body();
    tokio::spawn(async move {
        let _ = tx.send(Bytes::from(format!("hello from {path}"))).await;
        let _ = tx.send(Bytes::from_static(b"\n")).await;
    });
    ([("content-type", "application/octet-stream")], body).into_response()
}

/// A tar no honest agent sends: modes a host must not keep, and a device.
fn hostile_tar() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |kind: tar::EntryType, path: &str, mode: u32, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, path, data).expect("tar entry");
    };
    add(tar::EntryType::Regular, "suid", 0o4755, b"#!/bin/sh\n");
    add(tar::EntryType::Directory, "drop/", 0o1777, b"");
    add(
        tar::EntryType::Char,
        "drop/\u{1b}]0;pwned\u{7}tty",
        0o6666,
        b"BOOM!",
    );
    b.into_inner().expect("tar")
}

async fn upload(
    State(fake): State<Fake>,
    Path(h): Path<String>,
    RawQuery(q): RawQuery,
    body: Body,
) -> Response {
    let path = match cp_path(&query_pairs(&q)) {
        Ok(path) => path,
        Err(e) => return *e,
    };
    if let Err(e) = guest_vm(&h) {
        return *e;
    }
    let mut data = Vec::new();
    let mut chunks = 0;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            return bad_request("body failed");
        };
        chunks += 1;
        data.extend_from_slice(&chunk);
        fake.record
            .lock()
            .expect("lock")
            .upload_progress
            .insert(path.clone(), data.len());
    }
    let bytes = data.len() as u64;
    let mut r = fake.record.lock().expect("lock");
    r.uploads.insert(path.clone(), data);
    r.upload_chunks.insert(path, chunks);
    Json(CpResponse {
        bytes,
        entries: None,
        skipped: None,
    })
    .into_response()
}

async fn shell(Path(h): Path<String>, ws: WebSocketUpgrade) -> Response {
    if let Err(e) = guest_vm(&h) {
        return *e;
    }
    ws.on_upgrade(|mut socket: WebSocket| async move {
        use tine_proto::api::shell as frames;
        let data = |bytes: &[u8]| Message::Binary(frames::encode(frames::DATA, bytes).into());
        let _ = socket.send(data(b"welcome\r\n")).await;
        while let Some(Ok(msg)) = socket.recv().await {
            let Message::Binary(m) = msg else { continue };
            match frames::decode(&m) {
                Some((frames::DATA, b"exit\r")) => {
                    let e = frames::encode(frames::SESSION_CLOSE, &3i32.to_be_bytes());
                    let _ = socket.send(Message::Binary(e.into())).await;
                    let _ = socket.send(Message::Close(None)).await;
                    return;
                }
                // Goes away without the exit message.
                Some((frames::DATA, b"drop\r")) => return,
                Some((frames::DATA, bytes)) => {
                    let _ = socket.send(data(bytes)).await;
                }
                Some((frames::WINDOW_SIZE, size)) if size.len() == 8 => {
                    let cols = u32::from_be_bytes([size[0], size[1], size[2], size[3]]);
                    let rows = u32::from_be_bytes([size[4], size[5], size[6], size[7]]);
                    let _ = socket
                        .send(data(format!("resized {rows} {cols}").as_bytes()))
                        .await;
                }
                _ => {}
            }
        }
    })
}

async fn forward(Path(h): Path<String>, RawQuery(q): RawQuery, ws: WebSocketUpgrade) -> Response {
    if let Err(e) = guest_vm(&h) {
        return *e;
    }
    let target = param(&query_pairs(&q), "target").unwrap_or_default();
    ws.on_upgrade(move |mut socket: WebSocket| async move {
        let mut first = true;
        while let Some(Ok(msg)) = socket.recv().await {
            match msg {
                Message::Binary(m) => {
                    let mut out = Vec::new();
                    if first {
                        out.extend_from_slice(format!("[{target}]").as_bytes());
                        first = false;
                    }
                    out.extend_from_slice(&m);
                    if socket.send(Message::Binary(out.into())).await.is_err() {
                        return;
                    }
                }
                Message::Close(_) => {
                    let _ = socket.send(Message::Close(None)).await;
                    return;
                }
                _ => {}
            }
        }
    })
}

fn commit_info(id: &str, source: &str, req: &CommitRequest) -> CommitInfo {
    CommitInfo {
        commit_id: id.to_string(),
        status: tine_proto::api::CommitStatus::Committed,
        mode: req.mode.unwrap_or(tine_proto::api::CommitMode::Disk),
        hostname: source.to_string(),
        source: source.to_string(),
        host_group: "dev".into(),
        parent_status: None,
        tags: req.tags.clone(),
        labels: req.labels.clone(),
        cache_key: req.cache_key.clone(),
        parent_commit_id: None,
        cpus: 1,
        ram_bytes: 512 << 20,
        size_bytes: 4 << 30,
        created_at: "2026-01-01T00:00:00.000Z".into(),
        elapsed_ms: 120,
        memory_bytes: (req.mode == Some(tine_proto::api::CommitMode::Memory)).then_some(96 << 20),
        pause_us: None,
        hot_fork_pool: req.hot_fork_pool,
    }
}

/// The memory commit the fake knows, with its own warm pool size.
fn memory_commit_with_pool(size: Option<u32>) -> CommitInfo {
    commit_info(
        COMMIT,
        "dev-2",
        &CommitRequest {
            mode: Some(tine_proto::api::CommitMode::Memory),
            hot_fork_pool: size,
            ..CommitRequest::default()
        },
    )
}

async fn set_pool(Path(id): Path<String>, Json(req): Json<CommitPoolRequest>) -> Response {
    if id != COMMIT {
        return not_found_commit(&id);
    }
    Json(memory_commit_with_pool(Some(req.hot_fork_pool))).into_response()
}

async fn reset_pool(Path(id): Path<String>) -> Response {
    if id != COMMIT {
        return not_found_commit(&id);
    }
    Json(memory_commit_with_pool(None)).into_response()
}

const COMMIT: &str = "cmt-dev-0123456789abcdef";

async fn commit(Path(h): Path<String>, Json(req): Json<CommitRequest>) -> Response {
    let Some(v) = vm(&h) else {
        return not_found_vm(&h);
    };
    let memory = req.mode == Some(tine_proto::api::CommitMode::Memory);
    if v.state == VmState::Running && !memory {
        return conflict(&format!(
            "{h} is {}; shut it down first (tine vm shutdown {h}): \
             only a stopped VM's disk can be committed (a running one's with --memory)",
            v.state,
            h = v.hostname
        ));
    }
    if v.state != VmState::Running && memory {
        return conflict(&format!(
            "{} is {}; only a running VM's memory can be committed",
            v.hostname, v.state
        ));
    }
    (
        StatusCode::OK,
        Json(CommitInfo {
            parent_status: Some(v.state),
            pause_us: memory.then_some(850),
            ..commit_info(COMMIT, &v.hostname, &req)
        }),
    )
        .into_response()
}

async fn commits(RawQuery(q): RawQuery) -> Json<Vec<CommitInfo>> {
    let q = query_pairs(&q);
    let c = commit_info(
        COMMIT,
        "dev-2",
        &CommitRequest {
            tags: vec!["base".into()],
            labels: BTreeMap::new(),
            cache_key: Some("k1".into()),
            mode: None,
            hot_fork_pool: None,
        },
    );
    let keep = q
        .iter()
        .filter(|(k, _)| k == "tag")
        .all(|(_, t)| c.tags.contains(t))
        && param(&q, "cache_key").is_none_or(|k| c.cache_key.as_deref() == Some(k.as_str()))
        && param(&q, "source").is_none_or(|s| c.source == s)
        && param(&q, "mode").is_none_or(|m| c.mode.as_str() == m);
    Json(if keep { vec![c] } else { vec![] })
}

async fn delete_commit(Path(id): Path<String>) -> Response {
    if id != COMMIT {
        return not_found_commit(&id);
    }
    Json(DeleteCommitResponse {
        commit_id: id,
        status: DeleteStatus::Deleted,
    })
    .into_response()
}

async fn fork(
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
    _headers: HeaderMap,
    Json(req): Json<ForkRequest>,
) -> Response {
    if id != COMMIT {
        return not_found_commit(&id);
    }
    let wait = param(&query_pairs(&q), "wait").as_deref() == Some("agent");
    (
        StatusCode::OK,
        Json(ForkResponse {
            hostname: "dev-4".into(),
            source_hostname: "dev-2".into(),
            commit_id: id,
            status: tine_proto::api::ForkStatus::Forked,
            mode: tine_proto::api::CommitMode::Disk,
            child_status: if wait {
                VmState::Running
            } else {
                VmState::Starting
            },
            persistent: req.persistent.unwrap_or(true),
            elapsed_ms: 300,
        }),
    )
        .into_response()
}

/// The fake's images: `app` (an imported OCI image) and `min` (built-in,
/// used by `dev-1`, so it cannot be removed).
fn fake_image(name: &str) -> Option<tine_proto::api::ImageInfo> {
    use tine_proto::api::{ImageExecDefaults, ImageFormat, ImageInfo, ImageOrigin};
    let (format, origin, defaults) = match name {
        "app" => (
            ImageFormat::Oci,
            ImageOrigin::Imported,
            Some(ImageExecDefaults {
                env: vec!["PATH=/bin".into()],
                user: None,
                workdir: Some("/srv".into()),
                entrypoint: vec![],
                cmd: vec!["/bin/sh".into()],
            }),
        ),
        "min" => (ImageFormat::Raw, ImageOrigin::BuiltIn, None),
        _ => return None,
    };
    Some(ImageInfo {
        name: name.into(),
        digest: Some(format!("sha256:{}", "0a".repeat(32))),
        format,
        origin,
        size: 256 << 20,
        created_at: "2026-01-02T03:04:05.000Z".into(),
        source: "upload (auto, 10 bytes)".into(),
        exec_defaults: defaults,
    })
}

fn not_found_image(name: &str) -> Response {
    err(
        StatusCode::NOT_FOUND,
        ErrorCode::NotFound,
        &format!("no image called `{name}`"),
    )
}

async fn images() -> Json<Vec<tine_proto::api::ImageInfo>> {
    Json(
        ["app", "min"]
            .iter()
            .filter_map(|n| fake_image(n))
            .collect(),
    )
}

async fn image(Path(name): Path<String>) -> Response {
    match fake_image(&name) {
        Some(i) => Json(i).into_response(),
        None => not_found_image(&name),
    }
}

async fn delete_image(Path(name): Path<String>) -> Response {
    match name.as_str() {
        "min" => conflict("image `min` is used by VM dev-1; delete them first"),
        "app" => Json(tine_proto::api::DeleteImageResponse {
            name,
            status: DeleteStatus::Deleted,
        })
        .into_response(),
        _ => not_found_image(&name),
    }
}

/// `POST /images`: takes the whole body, then answers NDJSON events; a
/// body starting with `bad` fails as a broken tar does.
async fn import_image(RawQuery(q): RawQuery, body: Body) -> Response {
    use tine_proto::api::{ImportEvent, ImportStage};
    let q = query_pairs(&q);
    let Some(name) = param(&q, "name") else {
        return bad_request("name= is required: the new image's name");
    };
    if fake_image(&name).is_some() {
        return conflict(&format!("an image called `{name}` already exists"));
    }
    let mut data = Vec::new();
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            return bad_request("body failed");
        };
        data.extend_from_slice(&chunk);
    }
    let mut events = vec![ImportEvent::Progress {
        stage: ImportStage::Received,
        done: Some(data.len() as u64),
        total: Some(data.len() as u64),
        message: format!("received {} bytes", data.len()),
    }];
    if data.starts_with(b"bad") {
        events.push(ImportEvent::Error(ErrorBody {
            error: "the upload is not a valid tar archive".into(),
            code: ErrorCode::BadRequest,
        }));
    } else {
        events.push(ImportEvent::Progress {
            stage: ImportStage::Layer,
            done: Some(1),
            total: Some(1),
            message: "applying layer 1".into(),
        });
        let mut image = fake_image("app").expect("app");
        image.name = name;
        image.size = data.len() as u64;
        events.push(ImportEvent::Done { image });
    }
    let mut text = Vec::new();
    for e in &events {
        text.extend(serde_json::to_vec(e).expect("json"));
        text.push(b'\n');
    }
    (
        [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
        text,
    )
        .into_response()
}
