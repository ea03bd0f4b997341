//! The fake daemon the client's and the CLI's tests run against must not
//! drift from the real one: every route it serves is one the daemon serves
//! and docs/openapi.yaml describes, with the same path template; its
//! success statuses are documented ones; its JSON bodies are exactly what
//! the `tine_proto::api` type the client decodes them into serializes to
//! (the type docs/openapi.yaml names, where it names one); and its errors
//! are `{error, code}` with the status the daemon sends for that code.

#[path = "../../client/tests/support/fake_daemon.rs"]
mod fake_daemon;

use std::collections::BTreeSet;
use std::time::Duration;

use axum::http::Method;
use fake_daemon::FakeDaemon;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_yaml::Value as Yaml;
use tine_proto::api::{
    CommitInfo, CpResponse, CreateVmResponse, DaemonInfo, DeleteCommitResponse, ErrorBody,
    ErrorCode, ExecFrame, ForkResponse, HealthResponse, HostGroupInfo, LifecycleResponse,
    LogsResponse, NodeStat, TagsResponse, VmHealth, VmInfo,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The commit the fake knows.
const COMMIT: &str = "cmt-dev-0123456789abcdef";

fn openapi() -> Yaml {
    serde_yaml::from_str(tine_daemon::api::OPENAPI_YAML).expect("docs/openapi.yaml is YAML")
}

/// The operation docs/openapi.yaml describes for `method` on `path`.
fn operation<'a>(doc: &'a Yaml, method: &Method, path: &str) -> Option<&'a Yaml> {
    doc["paths"]
        .get(path)?
        .get(method.as_str().to_ascii_lowercase())
}

fn route_key(method: &Method, path: &str) -> (String, String) {
    (method.as_str().to_owned(), path.to_owned())
}

#[test]
fn every_fake_route_is_served_by_the_daemon_and_documented() {
    let doc = openapi();
    let served: BTreeSet<(String, String)> = tine_daemon::api::routes()
        .list
        .iter()
        .map(|(m, p)| route_key(m, p))
        .collect();
    let fake = fake_daemon::routes();
    assert!(!fake.is_empty());
    let mut seen = BTreeSet::new();
    for (method, path) in &fake {
        assert!(
            seen.insert(route_key(method, path)),
            "the fake routes {method} {path} twice"
        );
        assert!(
            served.contains(&route_key(method, path)),
            "the fake serves {method} {path}, the daemon does not"
        );
        assert!(
            operation(&doc, method, path).is_some(),
            "the fake serves {method} {path}, docs/openapi.yaml does not describe it"
        );
    }
}

/// What the answer to a request must be.
enum Expect {
    /// A documented 2xx JSON body that is exactly what `T` serializes to.
    Json {
        status: u16,
        check: fn(&[u8]) -> Result<(), String>,
        /// `T`'s name, and whether the body is a list of `T`.
        schema: (&'static str, bool),
    },
    /// 200 and an NDJSON stream of exec frames.
    Ndjson,
    /// 200 and an NDJSON stream of image import events.
    ImportEvents,
    /// 200 and bytes of the documented content type.
    Bytes,
    /// A WebSocket upgrade (101).
    Upgrade,
    /// `{error, code}` with the status the daemon sends for `code`.
    Error(ErrorCode),
    /// `{error, code}` with `status`, where the daemon does not use the
    /// code's own status.
    ErrorWithStatus(ErrorCode, u16),
}

fn short_name<T>() -> &'static str {
    let name = std::any::type_name::<T>();
    name.rsplit("::").next().unwrap_or(name)
}

/// Whether `body` is exactly what `T` makes of it: it decodes into `T` and
/// `T` writes it back unchanged (no field missing, extra or of another
/// shape).
fn exact<T: DeserializeOwned + Serialize>(body: &[u8]) -> Result<(), String> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let typed: T = serde_json::from_value(value.clone())
        .map_err(|e| format!("does not decode as {}: {e}", short_name::<T>()))?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    if back != value {
        return Err(format!(
            "is not what {} writes:\n  fake: {value}\n  type: {back}",
            short_name::<T>()
        ));
    }
    Ok(())
}

fn json<T: DeserializeOwned + Serialize>(status: u16) -> Expect {
    Expect::Json {
        status,
        check: exact::<T>,
        schema: (short_name::<T>(), false),
    }
}

fn list<T: DeserializeOwned + Serialize>() -> Expect {
    Expect::Json {
        status: 200,
        check: exact::<Vec<T>>,
        schema: (short_name::<T>(), true),
    }
}

/// One request to the fake.
struct Case {
    method: Method,
    /// The route it exercises; `None` for requests no route serves.
    route: Option<&'static str>,
    uri: String,
    /// The request body and its content type.
    body: Option<(&'static str, &'static str)>,
    expect: Expect,
}

fn case(method: Method, route: &'static str, uri: &str, expect: Expect) -> Case {
    Case {
        method,
        route: Some(route),
        uri: uri.to_owned(),
        body: None,
        expect,
    }
}

fn with_body(mut case: Case, body: &'static str) -> Case {
    case.body = Some(("application/json", body));
    case
}

fn with_bytes(mut case: Case, body: &'static str) -> Case {
    case.body = Some(("application/octet-stream", body));
    case
}

fn cases() -> Vec<Case> {
    use Expect::*;
    use Method as M;
    let nodes = "/hostgroup/{group}/nodes";
    let node = "/hostgroup/{group}/nodes/{hostname}";
    let vm = "/vm/{hostname}";
    let commit = "/vm/commits/{id}";
    let fork = "/vm/commits/{id}/fork";
    let pool = "/vm/commits/{id}/pool";
    vec![
        case(M::GET, "/healthz", "/healthz", json::<HealthResponse>(200)),
        case(M::GET, "/info", "/info", json::<DaemonInfo>(200)),
        case(M::GET, "/hostgroup", "/hostgroup", list::<HostGroupInfo>()),
        case(
            M::GET,
            nodes,
            "/hostgroup/dev/nodes?tag=env%3Dci",
            list::<VmInfo>(),
        ),
        case(
            M::GET,
            nodes,
            "/hostgroup/nope/nodes",
            Error(ErrorCode::NotFound),
        ),
        with_body(
            case(
                M::POST,
                nodes,
                "/hostgroup/dev/nodes",
                json::<CreateVmResponse>(201),
            ),
            r#"{"cpus": 1}"#,
        ),
        with_body(
            case(
                M::POST,
                nodes,
                "/hostgroup/dev/nodes",
                Error(ErrorCode::BadRequest),
            ),
            r#"{"cpus": 4}"#,
        ),
        with_body(
            case(
                M::POST,
                nodes,
                "/hostgroup/dev/nodes?wait=agent",
                Error(ErrorCode::Timeout),
            ),
            r#"{"name": "slow"}"#,
        ),
        with_body(
            case(
                M::POST,
                nodes,
                "/hostgroup/nope/nodes",
                Error(ErrorCode::NotFound),
            ),
            "{}",
        ),
        case(
            M::DELETE,
            node,
            "/hostgroup/dev/nodes/dev-2",
            json::<LifecycleResponse>(200),
        ),
        case(
            M::DELETE,
            node,
            "/hostgroup/nope/nodes/dev-2",
            Error(ErrorCode::NotFound),
        ),
        case(M::GET, "/nodes", "/nodes", list::<VmInfo>()),
        case(M::GET, "/nodes/stats", "/nodes/stats", list::<NodeStat>()),
        case(
            M::GET,
            "/node/{hostname}/stats",
            "/node/dev-2/stats",
            list::<NodeStat>(),
        ),
        case(
            M::GET,
            "/node/{hostname}/stats",
            "/node/dev-9/stats",
            Error(ErrorCode::NotFound),
        ),
        case(
            M::POST,
            "/vm/{hostname}/pause",
            "/vm/dev-1/pause",
            json::<VmInfo>(200),
        ),
        case(
            M::POST,
            "/vm/{hostname}/pause",
            "/vm/dev-2/pause",
            Error(ErrorCode::Conflict),
        ),
        case(
            M::POST,
            "/vm/{hostname}/resume",
            "/vm/dev-1/resume",
            json::<VmInfo>(200),
        ),
        case(M::GET, "/vm/commits", "/vm/commits", list::<CommitInfo>()),
        case(
            M::DELETE,
            commit,
            &format!("/vm/commits/{COMMIT}"),
            json::<DeleteCommitResponse>(200),
        ),
        case(
            M::DELETE,
            commit,
            "/vm/commits/cmt-nope",
            Error(ErrorCode::NotFound),
        ),
        with_body(
            case(
                M::POST,
                fork,
                &format!("/vm/commits/{COMMIT}/fork?wait=agent"),
                json::<ForkResponse>(200),
            ),
            "{}",
        ),
        with_body(
            case(
                M::POST,
                fork,
                "/vm/commits/cmt-nope/fork",
                Error(ErrorCode::NotFound),
            ),
            "{}",
        ),
        with_body(
            case(
                M::PUT,
                pool,
                &format!("/vm/commits/{COMMIT}/pool"),
                json::<CommitInfo>(200),
            ),
            r#"{"hot_fork_pool":3}"#,
        ),
        with_body(
            case(
                M::PUT,
                pool,
                "/vm/commits/cmt-nope/pool",
                Error(ErrorCode::NotFound),
            ),
            r#"{"hot_fork_pool":3}"#,
        ),
        case(
            M::DELETE,
            pool,
            &format!("/vm/commits/{COMMIT}/pool"),
            json::<CommitInfo>(200),
        ),
        case(M::GET, vm, "/vm/dev-1", json::<VmInfo>(200)),
        case(M::GET, vm, "/vm/web", json::<VmInfo>(200)),
        case(M::GET, vm, "/vm/dev-9", Error(ErrorCode::NotFound)),
        case(M::DELETE, vm, "/vm/dev-2", json::<LifecycleResponse>(200)),
        case(M::DELETE, vm, "/vm/dev-9", Error(ErrorCode::NotFound)),
        case(
            M::GET,
            "/vm/{hostname}/tags",
            "/vm/dev-1/tags",
            json::<TagsResponse>(200),
        ),
        with_body(
            case(
                M::PATCH,
                "/vm/{hostname}/tags",
                "/vm/dev-1/tags",
                json::<TagsResponse>(200),
            ),
            r#"{"add": ["x=1"], "remove": ["env=ci"]}"#,
        ),
        case(
            M::GET,
            "/vm/{hostname}/health",
            "/vm/dev-1/health",
            json::<VmHealth>(200),
        ),
        case(
            M::GET,
            "/vm/{hostname}/health",
            "/vm/dev-2/health",
            Error(ErrorCode::Conflict),
        ),
        case(
            M::GET,
            "/vm/{hostname}/health",
            "/vm/dev-2/health?wait=agent&timeout=1s",
            Error(ErrorCode::Internal),
        ),
        case(
            M::GET,
            "/vm/{hostname}/logs",
            "/vm/dev-1/logs?lines=2",
            json::<LogsResponse>(200),
        ),
        case(
            M::POST,
            "/vm/{hostname}/shutdown",
            "/vm/dev-1/shutdown?action=poweroff",
            json::<LifecycleResponse>(200),
        ),
        case(
            M::POST,
            "/vm/{hostname}/shutdown",
            "/vm/dev-2/shutdown",
            Error(ErrorCode::Conflict),
        ),
        case(
            M::POST,
            "/vm/{hostname}/relaunch",
            "/vm/dev-2/relaunch?wait=agent",
            json::<CreateVmResponse>(200),
        ),
        case(
            M::POST,
            "/vm/{hostname}/relaunch",
            "/vm/dev-1/relaunch",
            Error(ErrorCode::Conflict),
        ),
        case(
            M::POST,
            "/vm/{hostname}/exec",
            "/vm/dev-1/exec?cmd=echo&args=hi",
            Ndjson,
        ),
        case(
            M::POST,
            "/vm/{hostname}/exec",
            "/vm/dev-1/exec?cmd=lost",
            Ndjson,
        ),
        case(
            M::POST,
            "/vm/{hostname}/exec",
            "/vm/dev-1/exec?cmd=nope",
            Error(ErrorCode::BadRequest),
        ),
        case(
            M::POST,
            "/vm/{hostname}/exec",
            "/vm/dev-1/exec",
            Error(ErrorCode::BadRequest),
        ),
        case(
            M::POST,
            "/vm/{hostname}/exec",
            "/vm/dev-2/exec?cmd=echo",
            Error(ErrorCode::Conflict),
        ),
        case(
            M::GET,
            "/vm/{hostname}/cp",
            "/vm/dev-1/cp?path=%2Fetc%2Fhostname",
            Bytes,
        ),
        case(
            M::GET,
            "/vm/{hostname}/cp",
            "/vm/dev-1/cp?path=%2Fmissing",
            Error(ErrorCode::NotFound),
        ),
        case(
            M::GET,
            "/vm/{hostname}/cp",
            "/vm/dev-1/cp?path=relative",
            Error(ErrorCode::BadRequest),
        ),
        case(
            M::GET,
            "/vm/{hostname}/cp",
            "/vm/dev-1/cp?path=%2Fx&mode=zip",
            Error(ErrorCode::BadRequest),
        ),
        with_bytes(
            case(
                M::POST,
                "/vm/{hostname}/cp",
                "/vm/dev-1/cp?path=%2Ftmp%2Ff",
                json::<CpResponse>(200),
            ),
            "some bytes",
        ),
        case(
            M::POST,
            "/vm/{hostname}/cp",
            "/vm/dev-2/cp?path=%2Ftmp%2Ff",
            Error(ErrorCode::Conflict),
        ),
        case(M::GET, "/vm/{hostname}/shell", "/vm/dev-1/shell", Upgrade),
        case(
            M::GET,
            "/vm/{hostname}/shell",
            "/vm/dev-9/shell",
            Error(ErrorCode::NotFound),
        ),
        case(
            M::GET,
            "/vm/{hostname}/shell",
            "/vm/dev-2/shell",
            Error(ErrorCode::Conflict),
        ),
        case(
            M::GET,
            "/vm/{hostname}/forward",
            "/vm/dev-1/forward?target=tcp%3A8080",
            Upgrade,
        ),
        with_body(
            case(
                M::POST,
                "/vm/{hostname}/commit",
                "/vm/dev-2/commit",
                json::<CommitInfo>(200),
            ),
            r#"{"tags": ["base"]}"#,
        ),
        with_body(
            case(
                M::POST,
                "/vm/{hostname}/commit",
                "/vm/dev-1/commit",
                Error(ErrorCode::Conflict),
            ),
            "{}",
        ),
        case(
            M::GET,
            "/images",
            "/images",
            list::<tine_proto::api::ImageInfo>(),
        ),
        case(
            M::GET,
            "/images/{name}",
            "/images/app",
            json::<tine_proto::api::ImageInfo>(200),
        ),
        case(
            M::GET,
            "/images/{name}",
            "/images/nope",
            Error(ErrorCode::NotFound),
        ),
        case(
            M::DELETE,
            "/images/{name}",
            "/images/app",
            json::<tine_proto::api::DeleteImageResponse>(200),
        ),
        case(
            M::DELETE,
            "/images/{name}",
            "/images/min",
            Error(ErrorCode::Conflict),
        ),
        with_bytes(
            case(M::POST, "/images", "/images?name=new", ImportEvents),
            "image bytes",
        ),
        with_bytes(
            case(
                M::POST,
                "/images",
                "/images?name=app",
                Error(ErrorCode::Conflict),
            ),
            "image bytes",
        ),
        Case {
            method: M::GET,
            route: None,
            uri: "/no/such/route".into(),
            body: None,
            expect: Error(ErrorCode::NotFound),
        },
        // The daemon's answer to a method a path does not serve: 405 (its
        // method_not_allowed fallback), with code bad_request.
        Case {
            method: M::PUT,
            route: None,
            uri: "/info".into(),
            body: None,
            expect: ErrorWithStatus(ErrorCode::BadRequest, 405),
        },
    ]
}

/// Whether the path of `uri` is an instance of the template `route`.
fn matches(route: &str, uri: &str) -> bool {
    let path = uri.split('?').next().unwrap_or(uri);
    let (r, p): (Vec<_>, Vec<_>) = (route.split('/').collect(), path.split('/').collect());
    r.len() == p.len()
        && r.iter()
            .zip(&p)
            .all(|(r, p)| r == p || (r.starts_with('{') && r.ends_with('}') && !p.is_empty()))
}

/// An answer as it came off the wire.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Decodes a chunked body; `None` while it is incomplete.
fn dechunk(mut data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let end = find(data, b"\r\n")?;
        let size_text = std::str::from_utf8(&data[..end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        data = &data[end + 2..];
        if size == 0 {
            return Some(out);
        }
        if data.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

/// Sends one HTTP/1.1 request on `io` and reads the answer: its head, and
/// its body unless it is an upgrade.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut io: S,
    method: &Method,
    uri: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Answer {
    let mut head = format!("{method} {uri} HTTP/1.1\r\nhost: localhost\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !headers
        .iter()
        .any(|(n, _)| n.eq_ignore_ascii_case("connection"))
    {
        head.push_str("connection: close\r\n");
    }
    let body = body.unwrap_or("");
    head.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
    io.write_all(head.as_bytes()).await.expect("send head");
    io.write_all(body.as_bytes()).await.expect("send body");

    let mut data = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        if let Some(end) = find(&data, b"\r\n\r\n") {
            let text = String::from_utf8_lossy(&data[..end]).into_owned();
            let mut lines = text.split("\r\n");
            let status: u16 = lines
                .next()
                .and_then(|l| l.split(' ').nth(1))
                .and_then(|s| s.parse().ok())
                .expect("status line");
            let headers: Vec<(String, String)> = lines
                .filter_map(|l| l.split_once(':'))
                .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
                .collect();
            let mut answer = Answer {
                status,
                headers,
                body: Vec::new(),
            };
            let rest = &data[end + 4..];
            if status == 101 {
                return answer;
            }
            if let Some(len) = answer.header("content-length") {
                let len: usize = len.parse().expect("content-length");
                if rest.len() >= len {
                    answer.body = rest[..len].to_vec();
                    return answer;
                }
            } else if answer
                .header("transfer-encoding")
                .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
            {
                if let Some(body) = dechunk(rest) {
                    answer.body = body;
                    return answer;
                }
            }
        }
        let n = io.read(&mut buf).await.expect("read answer");
        assert!(n > 0, "{method} {uri}: connection closed mid-answer");
        data.extend_from_slice(&buf[..n]);
    }
}

/// The upgrade headers of a WebSocket handshake.
const UPGRADE: &[(&str, &str)] = &[
    ("connection", "upgrade"),
    ("upgrade", "websocket"),
    ("sec-websocket-version", "13"),
    ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
];

async fn ask(fake: &FakeDaemon, method: &Method, uri: &str, body: Option<(&str, &str)>) -> Answer {
    let io = tokio::net::UnixStream::connect(&fake.socket)
        .await
        .expect("connect to the fake");
    let upgrade = method == Method::GET && (uri.contains("/shell") || uri.contains("/forward"));
    let mut headers: Vec<(&str, &str)> = if upgrade { UPGRADE.to_vec() } else { vec![] };
    if let Some((content_type, _)) = body {
        headers.push(("content-type", content_type));
    }
    tokio::time::timeout(
        Duration::from_secs(10),
        exchange(io, method, uri, &headers, body.map(|(_, b)| b)),
    )
    .await
    .unwrap_or_else(|_| panic!("{method} {uri}: no answer in 10s"))
}

/// The `{error, code}` checks shared by every error answer.
fn check_error(answer: &Answer, code: ErrorCode, status: u16) -> Result<(), String> {
    if answer.status != status {
        return Err(format!(
            "status {} where the daemon sends {status} for {code:?}",
            answer.status
        ));
    }
    if answer.header("content-type") != Some("application/json") {
        return Err(format!("content type {:?}", answer.header("content-type")));
    }
    exact::<ErrorBody>(&answer.body)?;
    let body: ErrorBody = serde_json::from_slice(&answer.body).map_err(|e| e.to_string())?;
    if body.code != code {
        return Err(format!("code {:?}, expected {code:?}", body.code));
    }
    if body.error.is_empty() {
        return Err("empty error message".into());
    }
    Ok(())
}

/// The documented answer with `status`, as docs/openapi.yaml gives it.
fn documented(op: &Yaml, status: u16) -> Result<&Yaml, String> {
    op["responses"]
        .get(status.to_string())
        .ok_or_else(|| format!("status {status} is not documented in docs/openapi.yaml"))
}

/// The content types docs/openapi.yaml gives for an answer.
fn content_types(response: &Yaml) -> Vec<String> {
    response["content"]
        .as_mapping()
        .map(|m| {
            m.keys()
                .filter_map(|k| k.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The schema name an answer's JSON refers to, and whether it is a list.
fn schema_ref(response: &Yaml) -> Option<(String, bool)> {
    let schema = &response["content"]["application/json"]["schema"];
    let name = |r: &Yaml| {
        r.as_str()
            .map(|s| s.rsplit('/').next().unwrap_or(s).to_owned())
    };
    if let Some(r) = schema.get("$ref") {
        return name(r).map(|n| (n, false));
    }
    schema["items"]
        .get("$ref")
        .and_then(name)
        .map(|n| (n, true))
}

fn check(doc: &Yaml, case: &Case, answer: &Answer) -> Result<(), String> {
    let op = match case.route {
        Some(route) => Some(
            operation(doc, &case.method, route)
                .ok_or_else(|| "the route is not in docs/openapi.yaml".to_owned())?,
        ),
        None => None,
    };
    let success = |status: u16| -> Result<&Yaml, String> {
        if answer.status != status {
            return Err(format!("status {}, expected {status}", answer.status));
        }
        documented(op.ok_or("a success needs a route")?, status)
    };
    let content_type = |response: &Yaml| -> Result<(), String> {
        let got = answer.header("content-type").unwrap_or_default();
        if content_types(response).iter().any(|t| t == got) {
            Ok(())
        } else {
            Err(format!(
                "content type {got:?}, docs/openapi.yaml gives {:?}",
                content_types(response)
            ))
        }
    };
    match &case.expect {
        Expect::Json {
            status,
            check,
            schema,
        } => {
            let response = success(*status)?;
            if answer.header("content-type") != Some("application/json") {
                return Err(format!("content type {:?}", answer.header("content-type")));
            }
            if let Some(doc_schema) = schema_ref(response) {
                let ours = (schema.0.to_owned(), schema.1);
                if doc_schema != ours {
                    return Err(format!(
                        "docs/openapi.yaml answers {doc_schema:?}, the client decodes {ours:?}"
                    ));
                }
            }
            check(&answer.body)
        }
        Expect::Ndjson => {
            content_type(success(200)?)?;
            let text = String::from_utf8(answer.body.clone()).map_err(|e| e.to_string())?;
            if !text.ends_with('\n') || text.trim().is_empty() {
                return Err(format!("not NDJSON lines: {text:?}"));
            }
            for line in text.lines() {
                exact::<ExecFrame>(line.as_bytes())?;
            }
            Ok(())
        }
        Expect::ImportEvents => {
            content_type(success(200)?)?;
            let text = String::from_utf8(answer.body.clone()).map_err(|e| e.to_string())?;
            if !text.ends_with('\n') || text.trim().is_empty() {
                return Err(format!("not NDJSON lines: {text:?}"));
            }
            for line in text.lines() {
                exact::<tine_proto::api::ImportEvent>(line.as_bytes())?;
            }
            Ok(())
        }
        Expect::Bytes => content_type(success(200)?),
        Expect::Upgrade => success(101).map(|_| ()),
        Expect::Error(code) => check_error(answer, *code, code.http_status()),
        Expect::ErrorWithStatus(code, status) => check_error(answer, *code, *status),
    }
}

#[tokio::test]
async fn the_fakes_answers_have_the_daemons_shapes_and_statuses() {
    let doc = openapi();
    let fake = FakeDaemon::start(None).await;
    let routes: BTreeSet<(String, String)> = fake_daemon::routes()
        .iter()
        .map(|(m, p)| route_key(m, p))
        .collect();
    let cases = cases();
    let mut answered = BTreeSet::new();
    let mut failures = Vec::new();
    for case in &cases {
        if let Some(route) = case.route {
            assert!(
                routes.contains(&route_key(&case.method, route)),
                "case {} {}: the fake has no route {route}",
                case.method,
                case.uri
            );
            assert!(
                matches(route, &case.uri),
                "case {} {} does not exercise {route}",
                case.method,
                case.uri
            );
            if !matches!(case.expect, Expect::Error(_) | Expect::ErrorWithStatus(..)) {
                answered.insert(route_key(&case.method, route));
            }
        }
        let answer = ask(&fake, &case.method, &case.uri, case.body).await;
        if let Err(e) = check(&doc, case, &answer) {
            failures.push(format!(
                "{} {}: {e}\n  body: {}",
                case.method,
                case.uri,
                String::from_utf8_lossy(&answer.body)
            ));
        }
    }
    for (method, path) in routes.difference(&answered) {
        failures.push(format!(
            "{method} {path}: the fake serves it, no case here asks it for a success"
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn the_fakes_token_errors_are_the_daemons() {
    let fake = FakeDaemon::start(Some("t0ken")).await;
    let url = fake.tcp_url.clone().expect("tcp");
    let addr = url.trim_start_matches("http://").to_owned();
    for auth in [None, Some("Bearer wrong"), Some("t0ken")] {
        let io = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        let headers: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
        let answer = exchange(io, &Method::GET, "/info", &headers, None).await;
        check_error(
            &answer,
            ErrorCode::Unauthorized,
            ErrorCode::Unauthorized.http_status(),
        )
        .unwrap_or_else(|e| panic!("authorization {auth:?}: {e}"));
    }
    let io = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let answer = exchange(
        io,
        &Method::GET,
        "/info",
        &[("authorization", "Bearer t0ken")],
        None,
    )
    .await;
    assert_eq!(answer.status, 200);
    exact::<DaemonInfo>(&answer.body).expect("info with the token");
}
