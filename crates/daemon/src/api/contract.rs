//! Contract tests with Slicer's SDKs: for each method of its Go SDK
//! (`github.com/slicervm/sdk`) and TypeScript SDK (`@slicervm/sdk`), the
//! request it sends (path, method, query, body) goes through the real
//! router to a daemon on the fake launcher, and the answer must carry the
//! status the SDK accepts and every field it reads, with the type it
//! decodes. The `Sdk*` types below are written from the SDKs' documented
//! types: a field the SDK reads is required here, so a missing or retyped
//! field fails the test.

mod defaults;
mod frames;
mod observe;
mod refused;
mod streams;

use std::sync::Arc;

use axum::http::{Method, StatusCode};
use axum::Router;
use serde::Deserialize;

use super::testing::Answer;

use crate::config::{Config, HostGroup};
use crate::core::{Daemon, Deadlines, Parts};
use crate::launcher::fake::FakeLauncher;

/// A daemon on the fake launcher behind the real router.
struct Sdk {
    _dir: tempfile::TempDir,
    app: Router,
    fake: FakeLauncher,
}

impl Sdk {
    fn new() -> Self {
        Self::with_config(|_| {})
    }

    /// A new daemon whose `import_user` keys come from `url`.
    fn set_import_url(&mut self, url: &str) {
        let url = url.to_owned();
        *self = Self::with_config(move |c| c.import_keys_url = Some(url));
    }

    fn with_config(edit: impl FnOnce(&mut Config)) -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        let image = dir.path().join("base.img");
        std::fs::write(&image, vec![0u8; 1 << 20]).expect("image");
        let mut config = Config::embedded_default();
        config.host_groups = vec![HostGroup {
            name: "dev".into(),
            image: image.display().to_string(),
            persistent: true,
            ram_mb: 256,
            ..config.host_groups[0].clone()
        }];
        edit(&mut config);
        let fake = FakeLauncher::new();
        let parts = Parts::on_launcher(
            config,
            dir.path().join("data"),
            Arc::new(fake.clone()),
            Deadlines::default(),
        );
        let daemon = Daemon::from_parts(parts.expect("daemon parts"));
        Sdk {
            app: super::app(daemon),
            fake,
            _dir: dir,
        }
    }

    /// Sends one request as an SDK would.
    async fn send(&self, method: Method, uri: &str, body: Option<(&str, Vec<u8>)>) -> Answer {
        let (content_type, body) = match body {
            Some((content_type, body)) => (Some(content_type), body),
            None => (None, Vec::new()),
        };
        super::testing::send(&self.app, method, uri, content_type, body).await
    }

    async fn get(&self, uri: &str) -> Answer {
        self.send(Method::GET, uri, None).await
    }

    /// A JSON request as the SDKs send it (`Content-Type: application/json`).
    async fn json(&self, method: Method, uri: &str, body: serde_json::Value) -> Answer {
        let bytes = serde_json::to_vec(&body).expect("json");
        self.send(method, uri, Some(("application/json", bytes)))
            .await
    }

    /// `CreateVMWithOptions(ctx, "dev", req, {Wait: agent})`: a running VM.
    async fn create(&self, body: serde_json::Value) -> SdkCreateResponse {
        let a = self
            .json(
                Method::POST,
                "/hostgroup/dev/nodes?timeout=30s&wait=agent",
                body,
            )
            .await;
        assert!(
            a.status == StatusCode::OK || a.status == StatusCode::CREATED,
            "create: {} {}",
            a.status,
            a.text()
        );
        a.decode()
    }

    /// `Shutdown(ctx, h, nil)`: the Go SDK's default `action=reboot`.
    async fn shutdown(&self, hostname: &str) {
        let a = self
            .send(
                Method::POST,
                &format!("/vm/{hostname}/shutdown?action=reboot"),
                None,
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "shutdown: {}", a.text());
    }

    /// A stopped persistent VM committed with `CommitVMWithOptions`.
    async fn committed(&self, tags: &[&str], cache_key: &str) -> (String, SdkCommitResponse) {
        let vm = self.create(serde_json::json!({"persistent": true})).await;
        self.shutdown(&vm.hostname).await;
        let a = self
            .json(
                Method::POST,
                &format!("/vm/{}/commit", vm.hostname),
                serde_json::json!({"tags": tags, "labels": {"team": "ci"}, "cache_key": cache_key}),
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "commit: {}", a.text());
        (vm.hostname, a.decode())
    }
}

/// An RFC 3339 time, as Go's `time.Time` decodes it.
fn rfc3339(value: &str) {
    humantime::parse_rfc3339(value)
        .unwrap_or_else(|e| panic!("`{value}` is not an RFC 3339 time ({e})"));
}

/// Go `SlicerHostGroup`, TS `WireHostGroup`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkHostGroup {
    name: String,
    count: i64,
    ram_bytes: i64,
    cpus: i64,
    arch: String,
    gpu_count: i64,
}

/// Go `SlicerNode`, TS `WireVM`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkNode {
    hostname: String,
    hostgroup: String,
    ip: String,
    ram_bytes: i64,
    cpus: i64,
    created_at: String,
    arch: String,
    tags: Vec<String>,
    status: String,
    persistent: bool,
}

/// Go `SlicerVMNetworkPolicy`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkPolicy {
    allow: Vec<String>,
    drop: Vec<String>,
}

/// Go `SlicerVMNetworkDescription`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkNetwork {
    mode: String,
    policy_source: String,
    host_group: SdkPolicy,
    #[serde(rename = "override")]
    overrides: Option<serde_json::Map<String, serde_json::Value>>,
    effective: SdkPolicy,
}

/// Go `SlicerVMDescription`: the node plus storage, lineage, network.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkDescription {
    #[serde(flatten)]
    node: SdkNode,
    storage: String,
    image: String,
    commit_id: Option<String>,
    parent_commit_id: Option<String>,
    network: SdkNetwork,
}

/// Go `SlicerCreateNodeResponse`, TS `WireCreateVMResponse`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkCreateResponse {
    hostname: String,
    hostgroup: String,
    ip: String,
    created_at: String,
    arch: String,
}

/// Go `SlicerVMTags`.
#[derive(Debug, Deserialize)]
struct SdkTags {
    hostname: String,
    tags: Vec<String>,
}

/// Go `SlicerAgentHealthResponse` (durations are integer nanoseconds),
/// TS `WireAgentHealth`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkHealth {
    hostname: String,
    agent_uptime: u64,
    agent_version: String,
    system_uptime: u64,
    userdata_ran: bool,
}

/// Go `SlicerLogsResponse`, TS `VMLogs`.
#[derive(Debug, Deserialize)]
struct SdkLogs {
    hostname: String,
    lines: i64,
    content: String,
}

/// Go `SlicerDeleteResponse` (an `error` that is not empty fails it;
/// `message` and `disk_removed` are strings it hands back).
#[derive(Debug, Deserialize)]
struct SdkDelete {
    message: String,
    disk_removed: String,
    #[serde(default)]
    error: Option<String>,
}

/// Go `SlicerInfo`, TS `SlicerInfo`.
#[derive(Debug, Deserialize)]
struct SdkInfo {
    version: String,
    git_commit: String,
    platform: String,
    arch: String,
}

/// Go `SlicerCommitVMResponse`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkCommitResponse {
    hostname: String,
    commit_id: String,
    status: String,
    parent_status: String,
    mode: String,
    tags: Vec<String>,
    labels: std::collections::BTreeMap<String, String>,
    cache_key: String,
}

/// Go `SlicerCommitInfo`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkCommitInfo {
    commit_id: String,
    source_hostname: String,
    source_host_group: String,
    created_at: String,
    mode: String,
    tags: Vec<String>,
    labels: std::collections::BTreeMap<String, String>,
    cache_key: Option<String>,
}

/// Go `SlicerCommitDeleteResponse`.
#[derive(Debug, Deserialize)]
struct SdkCommitDelete {
    commit_id: String,
    status: String,
}

/// Go `SlicerForkVMResponse`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkFork {
    hostname: String,
    source_hostname: String,
    commit_id: String,
    status: String,
    child_status: String,
    mode: String,
    persistent: bool,
}

/// `{error, code}`: what both SDKs put in their API errors.
#[derive(Debug, Deserialize)]
struct SdkError {
    error: String,
    code: String,
}

#[tokio::test]
async fn get_host_groups_and_info() {
    let sdk = Sdk::new();
    // Go GetHostGroups, TS hostGroups.list(): GET /hostgroup.
    let a = sdk.get("/hostgroup").await;
    assert_eq!(a.status, StatusCode::OK);
    let groups: Vec<SdkHostGroup> = a.decode();
    assert_eq!(groups.len(), 1);
    assert_eq!((groups[0].name.as_str(), groups[0].cpus), ("dev", 1));
    assert_eq!(groups[0].ram_bytes, 256 << 20);
    assert_eq!(groups[0].arch, tine_proto::api::go_arch());
    // Go GetInfo: GET /info.
    let a = sdk.get("/info").await;
    assert_eq!(a.status, StatusCode::OK);
    let info: SdkInfo = a.decode();
    assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(info.platform, "linux");
    assert_eq!(info.arch, tine_proto::api::go_arch());
    assert!(!info.git_commit.is_empty());
}

#[tokio::test]
async fn create_list_describe_and_delete_a_vm() {
    let sdk = Sdk::new();
    // Go CreateVMWithOptions with Wait agent and a timeout; TS
    // vms.create('dev', {...}, {wait: 'agent', waitTimeoutSec: 30}).
    let vm = sdk
        .create(serde_json::json!({
            "ram_bytes": 256u64 << 20,
            "cpus": 1,
            "persistent": true,
            "tags": ["env=ci", "team=a"],
        }))
        .await;
    assert_eq!(vm.hostname, "dev-1");
    assert_eq!(vm.hostgroup, "dev");
    assert_eq!(vm.ip, "", "no network in this group");
    rfc3339(&vm.created_at);

    // Go GetHostGroupNodes(ctx, "dev", ListOptions{Tag}), TS
    // hostGroups.listVMs('dev', {tag}); Go ListVMs, TS vms.list({tagPrefix}).
    for uri in [
        "/hostgroup/dev/nodes?tag=env%3Dci",
        "/nodes?tag_prefix=team%3D",
        "/nodes",
    ] {
        let a = sdk.get(uri).await;
        assert_eq!(a.status, StatusCode::OK, "{uri}");
        let nodes: Vec<SdkNode> = a.decode();
        assert_eq!(nodes.len(), 1, "{uri}");
        let n = &nodes[0];
        // TS vms.get() builds its handle from `hostgroup`: its delete()
        // needs the real group.
        assert_eq!(
            (n.hostname.as_str(), n.hostgroup.as_str()),
            ("dev-1", "dev")
        );
        assert_eq!(n.status, "Running");
        assert_eq!(n.tags, ["env=ci", "team=a"]);
        assert!(n.persistent);
        rfc3339(&n.created_at);
    }
    // Several tags are ANDed.
    let a = sdk.get("/nodes?tag=env%3Dci&tag=team%3Db").await;
    assert!(a.decode::<Vec<SdkNode>>().is_empty());
    let a = sdk.get("/nodes?tag=env%3Dci&tag=team%3Da").await;
    assert_eq!(a.decode::<Vec<SdkNode>>().len(), 1);

    // Go DescribeVM: GET /vm/{h}; `network` is an object even without one.
    let a = sdk.get("/vm/dev-1").await;
    assert_eq!(a.status, StatusCode::OK);
    let d: SdkDescription = a.decode();
    assert_eq!(d.storage, "image");
    assert_eq!(d.network.mode, "none");
    assert_eq!(d.network.policy_source, "host_group");
    assert!(d.network.effective.allow.is_empty() && d.network.overrides.is_none());
    assert_eq!(d.node.status, "Running");

    // Go DescribeVM of an unknown VM: an APIError with status 404 and
    // the `{error, code}` body.
    let a = sdk.get("/vm/nope-9").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.content_type, "application/json");
    let e: SdkError = a.decode();
    assert_eq!(e.code, "not_found");
    assert!(e.error.contains("nope-9"), "{}", e.error);

    // Go DeleteVM(ctx, group, h), TS vm.delete(): DELETE
    // /hostgroup/{group}/nodes/{h}, 200 without an `error`.
    let a = sdk
        .send(Method::DELETE, "/hostgroup/dev/nodes/dev-1", None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let del: SdkDelete = a.decode();
    assert!(del.error.unwrap_or_default().is_empty());
    assert!(del.message.contains("dev-1"), "{}", del.message);
    assert!(!del.disk_removed.is_empty());
    assert!(
        !std::path::Path::new(&del.disk_removed).exists(),
        "{} is gone",
        del.disk_removed
    );
    assert!(sdk.get("/nodes").await.decode::<Vec<SdkNode>>().is_empty());
}

#[tokio::test]
async fn tags_health_logs_and_shutdown() {
    let sdk = Sdk::new();
    let vm = sdk.create(serde_json::json!({"tags": ["a"]})).await;
    let h = vm.hostname.as_str();
    // Go GetVMTags, AddVMTags, RemoveVMTags, ReplaceVMTags.
    let tags: SdkTags = sdk.get(&format!("/vm/{h}/tags")).await.decode();
    assert_eq!(
        (tags.hostname.as_str(), tags.tags.clone()),
        (h, vec!["a".into()])
    );
    let uri = format!("/vm/{h}/tags");
    for (body, want) in [
        (serde_json::json!({"add": ["b"]}), vec!["a", "b"]),
        (serde_json::json!({"remove": ["a"]}), vec!["b"]),
        (serde_json::json!({"replace": ["c"]}), vec!["c"]),
        (serde_json::json!({"replace": []}), vec![]),
    ] {
        let a = sdk.json(Method::PATCH, &uri, body).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        assert_eq!(a.decode::<SdkTags>().tags, want);
    }

    // Go GetAgentHealth(ctx, h, true), TS vm.health(): GET; Go
    // GetAgentHealth(ctx, h, false): HEAD, status only.
    let a = sdk.get(&format!("/vm/{h}/health")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let health: SdkHealth = a.decode();
    assert_eq!(health.hostname, h);
    assert_eq!(health.agent_uptime, 1_000_000, "1 ms in nanoseconds");
    assert!(health.userdata_ran);
    let a = sdk
        .send(Method::HEAD, &format!("/vm/{h}/health"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK);

    // Go GetVMLogs(ctx, h, 10); TS vm.logs() (no `lines`).
    for uri in [format!("/vm/{h}/logs?lines=10"), format!("/vm/{h}/logs")] {
        let a = sdk.get(&uri).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        let logs: SdkLogs = a.decode();
        assert_eq!(logs.hostname, h);
        assert_eq!(logs.lines as usize, logs.content.lines().count());
    }

    // TS vm.shutdown({action: 'shutdown'}): the action in a JSON body.
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/{h}/shutdown"),
            serde_json::json!({"action": "shutdown"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let d: SdkDescription = sdk.get(&format!("/vm/{h}")).await.decode();
    assert_eq!(d.node.status, "Stopped");
    assert!(!sdk.fake.is_running(h));

    // Go RelaunchVM: POST /vm/{h}/relaunch, 200.
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/relaunch?wait=agent"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    // Go Shutdown(ctx, h, nil): `action=reboot`, the graceful stop.
    sdk.shutdown(h).await;
    assert!(!sdk.fake.is_running(h));
    // A body and a query that disagree are refused, naming both.
    sdk.send(Method::POST, &format!("/vm/{h}/relaunch?wait=agent"), None)
        .await;
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/{h}/shutdown?action=poweroff"),
            serde_json::json!({"action": "reboot"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let e: SdkError = a.decode();
    assert!(
        e.error.contains("`poweroff`") && e.error.contains("`reboot`"),
        "{}",
        e.error
    );
}

#[tokio::test]
async fn commit_list_fork_and_delete_commits() {
    let sdk = Sdk::new();
    // Go CommitVMWithOptions: 200 (the SDK refuses any other status).
    let (source, c) = sdk.committed(&["base", "py"], "deps-v1").await;
    assert_eq!(c.hostname, source);
    assert_eq!((c.status.as_str(), c.mode.as_str()), ("committed", "disk"));
    assert_eq!(c.parent_status, "stopped");
    assert_eq!(c.tags, ["base", "py"]);
    assert_eq!(c.cache_key, "deps-v1");
    let (_, other) = sdk.committed(&["base"], "deps-v2").await;

    // Go ListCommits with two tags (ANDed), a cache key, a source, a mode.
    let a = sdk.get("/vm/commits?tag=base&tag=py").await;
    assert_eq!(a.status, StatusCode::OK);
    let list: Vec<SdkCommitInfo> = a.decode();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].commit_id, c.commit_id);
    assert_eq!(list[0].source_hostname, source);
    assert_eq!(list[0].source_host_group, "dev");
    rfc3339(&list[0].created_at);
    let uri = "/vm/commits?cache_key=deps-v2&source=dev-2&mode=disk";
    let list: Vec<SdkCommitInfo> = sdk.get(uri).await.decode();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].commit_id, other.commit_id);
    assert_eq!(
        sdk.get("/vm/commits?tag=base")
            .await
            .decode::<Vec<SdkCommitInfo>>()
            .len(),
        2
    );

    // Go ForkCommittedVM(id, WithTags, WithVCPU, WithRAMBytes,
    // WithPersistent(false), WithFixups()): 200.
    let uri = format!("/vm/commits/{}/fork?timeout=30s&wait=agent", c.commit_id);
    let a = sdk
        .json(
            Method::POST,
            &uri,
            serde_json::json!({
                "tags": ["job=7"],
                "vcpu": 1,
                "ram_bytes": 128u64 << 20,
                "persistent": false,
                "fixups": [],
            }),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let fork: SdkFork = a.decode();
    assert_eq!(fork.source_hostname, source);
    assert_eq!(
        (fork.status.as_str(), fork.mode.as_str()),
        ("forked", "disk")
    );
    assert_eq!(fork.child_status, "running");
    assert!(!fork.persistent);
    let d: SdkDescription = sdk.get(&format!("/vm/{}", fork.hostname)).await.decode();
    assert_eq!(d.parent_commit_id.as_deref(), Some(c.commit_id.as_str()));
    assert_eq!((d.node.cpus, d.node.ram_bytes), (1, 128 << 20));
    assert!(
        d.node.tags.contains(&"job=7".to_string()),
        "{:?}",
        d.node.tags
    );

    // Go DeleteCommit while the source exists: 409 with `{error, code}`.
    let a = sdk
        .send(
            Method::DELETE,
            &format!("/vm/commits/{}", c.commit_id),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::CONFLICT);
    assert_eq!(a.decode::<SdkError>().code, "conflict");
    // Once nothing depends on it: 200 `{commit_id, status}`.
    for h in [fork.hostname.as_str(), source.as_str()] {
        let a = sdk.send(Method::DELETE, &format!("/vm/{h}"), None).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    }
    let a = sdk
        .send(
            Method::DELETE,
            &format!("/vm/commits/{}", c.commit_id),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let del: SdkCommitDelete = a.decode();
    assert_eq!(
        (del.commit_id, del.status.as_str()),
        (c.commit_id, "deleted")
    );
}

/// Go `SlicerExecWriteResult`, TS `WireExecFrame`: one NDJSON line.
#[derive(Debug, Deserialize)]
struct SdkExecFrame {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    pid: Option<i64>,
    #[serde(default)]
    encoding: Option<String>,
    #[serde(default)]
    data: Option<String>,
    #[serde(default)]
    exit_code: Option<i64>,
    #[serde(default)]
    signal: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

/// Go `ExecResult`, TS's buffered answer.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkExecResult {
    stdout: String,
    stderr: String,
    encoding: String,
    pid: i64,
    exit_code: i64,
    #[serde(default)]
    signal: Option<String>,
}

/// What a streamed exec gave, decoded as the SDKs decode it.
#[derive(Debug, Default)]
struct Streamed {
    pid: i64,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exit_code: Option<i64>,
    signal: Option<String>,
    error: Option<String>,
}

fn decode_output(data: &str, encoding: Option<&str>) -> Vec<u8> {
    use base64::Engine;
    match encoding {
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(data)
            .expect("base64 data"),
        _ => data.as_bytes().to_vec(),
    }
}

impl Sdk {
    /// A streamed exec (`Exec`, `exec()`), its frames decoded.
    async fn exec(&self, hostname: &str, query: &str, stdin: Option<&[u8]>) -> Streamed {
        let uri = format!("/vm/{hostname}/exec?{query}");
        let a = self
            .send(
                Method::POST,
                &uri,
                stdin.map(|b| ("application/octet-stream", b.to_vec())),
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{uri}: {}", a.text());
        assert_eq!(a.content_type, "application/x-ndjson");
        let mut out = Streamed::default();
        for line in a.text().lines() {
            let f: SdkExecFrame = serde_json::from_str(line).expect("an exec frame");
            match f.kind.as_str() {
                "started" => out.pid = f.pid.expect("started has pid"),
                "stdout" => out.stdout.extend(decode_output(
                    f.data.as_deref().unwrap_or_default(),
                    f.encoding.as_deref(),
                )),
                "stderr" => out.stderr.extend(decode_output(
                    f.data.as_deref().unwrap_or_default(),
                    f.encoding.as_deref(),
                )),
                "exit" => {
                    out.exit_code = Some(f.exit_code.expect("exit has exit_code"));
                    out.signal = f.signal;
                }
                "error" => out.error = f.error,
                other => panic!("frame type {other}"),
            }
        }
        out
    }

    /// A buffered exec (`ExecBuffered`, `execBuffered()`).
    async fn exec_buffered(&self, hostname: &str, query: &str) -> SdkExecResult {
        let uri = format!("/vm/{hostname}/exec?{query}&buffered=true");
        let a = self.send(Method::POST, &uri, None).await;
        assert_eq!(a.status, StatusCode::OK, "{uri}: {}", a.text());
        a.decode()
    }
}

#[tokio::test]
async fn exec_streamed_and_buffered_in_both_encodings() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    // Go Exec: always `stdio=base64`; uid and gid 0 unless NonRootUser.
    let r = sdk
        .exec(
            &h,
            "cmd=printf&stdio=base64&args=a%5Cnb%20%25s&args=%C3%A9&uid=0&gid=0",
            None,
        )
        .await;
    assert!(r.pid > 0);
    assert_eq!(r.stdout, "a\nb é".as_bytes());
    assert_eq!((r.exit_code, r.error), (Some(0), None));
    // TS exec() without `stdio`: text frames.
    let r = sdk.exec(&h, "cmd=echo&args=hello", None).await;
    assert_eq!(
        (r.stdout.as_slice(), r.exit_code),
        (&b"hello\n"[..], Some(0))
    );
    // Bytes that are not UTF-8 survive base64 only.
    let r = sdk
        .exec(&h, "cmd=printf&args=%5C377%5C376&stdio=base64", None)
        .await;
    assert_eq!(r.stdout, [0xff, 0xfe]);
    // `shell` is a path (Slicer's form): `$VAR` expands.
    let r = sdk
        .exec(
            &h,
            "cmd=echo%20%24GREETING&env=GREETING%3Dhi&shell=%2Fbin%2Fsh",
            None,
        )
        .await;
    assert_eq!(r.stdout, b"hi\n");
    // A failing command: the Go SDK treats exit_code != 0 as an error.
    let r = sdk
        .exec(
            &h,
            "cmd=sh&args=-c&args=echo%20no%20%3E%262%3B%20exit%203",
            None,
        )
        .await;
    assert_eq!((r.stderr.as_slice(), r.exit_code), (&b"no\n"[..], Some(3)));
    // A killed one is never exit 0: 128+N, and the signal by name.
    let r = sdk
        .exec(&h, "cmd=sh&args=-c&args=kill%20-9%20%24%24", None)
        .await;
    assert_eq!(
        (r.exit_code, r.signal.as_deref()),
        (Some(137), Some("SIGKILL"))
    );
    // Go ExecWithReader, TS exec({stdin}): the body is stdin.
    let r = sdk
        .exec(
            &h,
            "cmd=cat&stdin=true&stdio=base64",
            Some(b"piped\x00bytes"),
        )
        .await;
    assert_eq!(r.stdout, b"piped\x00bytes");

    // Go ExecBuffered (base64), TS execBuffered (text): one JSON answer.
    let b = sdk
        .exec_buffered(&h, "cmd=sh&args=-c&args=printf%20out%3B%20printf%20err%20%3E%262%3B%20exit%205&stdio=base64")
        .await;
    assert_eq!(b.encoding, "base64");
    assert_eq!(decode_output(&b.stdout, Some("base64")), b"out");
    assert_eq!(decode_output(&b.stderr, Some("base64")), b"err");
    assert_eq!(b.exit_code, 5);
    assert!(b.pid > 0);
    let b = sdk.exec_buffered(&h, "cmd=echo&args=plain").await;
    assert_eq!(
        (b.encoding.as_str(), b.stdout.as_str()),
        ("text", "plain\n")
    );
}

#[tokio::test]
async fn exec_refuses_what_it_cannot_do_naming_it() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    for (query, says) in [
        (
            "cmd=true&stdio=hex",
            "stdio `hex` is not one of text, base64",
        ),
        (
            "cmd=true&permissions=0755",
            "`permissions=0755` on exec is not supported",
        ),
        (
            "cmd=true&buffered=true&stdin=true",
            "a buffered exec takes no stdin",
        ),
        (
            "cmd=true&shell=bash",
            "shell `bash` is not an absolute path",
        ),
        (
            "cmd=true&buffered=maybe",
            "`buffered=maybe` is not true or false",
        ),
    ] {
        let a = sdk
            .send(Method::POST, &format!("/vm/{h}/exec?{query}"), None)
            .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{query}");
        let e: SdkError = a.decode();
        assert!(e.error.contains(says), "{query}: {}", e.error);
    }
}

#[tokio::test]
async fn cp_v1_modes_get_the_answer_the_go_sdk_falls_back_on() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    // CpToVM and CpFromVM ask for `cp-v1-*` first, with its extra keys,
    // and retry the plain mode when the 400 says `invalid mode: <mode>`.
    let v1 = "copy_semantics=cp-v1&source_name=a.txt&source_type=file";
    for (method, mode) in [
        (Method::POST, "cp-v1-binary"),
        (Method::POST, "cp-v1-tar"),
        (Method::GET, "cp-v1-binary"),
        (Method::GET, "cp-v1-tar"),
        (Method::GET, "cp-v1-recursive"),
    ] {
        let uri = format!("/vm/{h}/cp?path=%2Ftmp%2Fa.txt&mode={mode}&{v1}&uid=0&gid=0");
        let a = sdk.send(method.clone(), &uri, None).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{method} {mode}");
        assert!(
            a.text().contains(&format!("invalid mode: {mode}")),
            "{method} {mode}: {}",
            a.text()
        );
    }
    // Its legacy retry keeps `uid`, `gid` and `permissions`: all known.
    let uri = format!("/vm/{h}/cp?path=%2Ftmp%2Fa.txt&mode=binary&uid=0&gid=0&permissions=0600");
    let a = sdk
        .send(
            Method::POST,
            &uri,
            Some(("application/octet-stream", b"x".to_vec())),
        )
        .await;
    assert!(
        !a.text().contains("query parameter") && !a.text().contains("permissions"),
        "{}",
        a.text()
    );
    // Permissions on a tar, and excludes on one file, are refused by name.
    for (query, says) in [
        (
            "mode=tar&permissions=0600",
            "`permissions` applies to one file",
        ),
        (
            "mode=binary&permissions=rw",
            "permissions `rw` is not octal",
        ),
        (
            "mode=binary&exclude=*.log",
            "`exclude=*.log` applies to mode=tar",
        ),
    ] {
        let uri = format!("/vm/{h}/cp?path=%2Ftmp&{query}");
        let a = sdk.send(Method::POST, &uri, None).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{query}");
        assert!(
            a.decode::<SdkError>().error.contains(says),
            "{query}: {}",
            a.text()
        );
    }
}

/// Go `SlicerFSInfo`, TS `WireFSInfo`.
#[derive(Debug, Deserialize)]
struct SdkFsInfo {
    name: String,
    #[serde(rename = "type")]
    kind: String,
    size: i64,
    mtime: String,
    mode: String,
}

#[tokio::test]
async fn create_fields_the_sdks_send_work_or_are_refused_by_name() {
    let sdk = Sdk::new();
    // TS vms.create(..., {wait: 'userdata'}), Go Wait userdata: the answer
    // comes once userdata has run (this VM has none).
    let a = sdk
        .json(
            Method::POST,
            "/hostgroup/dev/nodes?wait=userdata&timeout=30s",
            serde_json::json!({"gpu_count": 0, "secrets": []}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    let vm: SdkCreateResponse = a.decode();
    assert!(sdk.fake.is_running(&vm.hostname));
    for (body, says) in [
        (
            serde_json::json!({"gpu_count": 1}),
            "gpu_count 1 is not supported",
        ),
        (
            serde_json::json!({"disk_image": "ubuntu"}),
            "disk_image `ubuntu` is not supported",
        ),
        (
            serde_json::json!({"ip": "192.168.137.9"}),
            "ip `192.168.137.9` is not supported",
        ),
        (
            serde_json::json!({"ssh_keys": ["ssh-ed25519"]}),
            "ssh_keys[0] is not one authorized_keys line",
        ),
        (
            serde_json::json!({"import_user": "not/a/user"}),
            "is not a GitHub user name",
        ),
        (
            serde_json::json!({"secrets": ["db"]}),
            "no secret named \"db\"",
        ),
    ] {
        let a = sdk
            .json(Method::POST, "/hostgroup/dev/nodes", body.clone())
            .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}");
        let e: SdkError = a.decode();
        assert!(e.error.contains(says), "{body}: {}", e.error);
    }
    let a = sdk
        .send(Method::POST, "/hostgroup/dev/nodes?wait=later", None)
        .await;
    let e: SdkError = a.decode();
    assert!(
        e.error.contains("not one of none, agent, userdata"),
        "{}",
        e.error
    );
}

/// Go `Secret`, TS `WireSecret`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkSecret {
    name: String,
    size: i64,
    permissions: String,
    #[serde(default)]
    uid: u32,
    #[serde(default)]
    gid: u32,
    modified_at: Option<String>,
}

/// What the fake guest was sent by `secrets_sync`, as (name, value, mode).
fn synced(sdk: &Sdk, hostname: &str) -> Vec<Vec<(String, String, u32)>> {
    use base64::Engine as _;
    use tine_proto::agent::Request as AgentRequest;
    sdk.fake
        .seen(hostname)
        .into_iter()
        .filter_map(|s| match s {
            crate::launcher::fake::Seen::Agent(AgentRequest::SecretsSync(req)) => Some(
                req.secrets
                    .into_iter()
                    .map(|f| {
                        let value = base64::engine::general_purpose::STANDARD
                            .decode(&f.data)
                            .expect("base64");
                        (f.name, String::from_utf8_lossy(&value).into_owned(), f.mode)
                    })
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn secrets_create_list_patch_delete_and_grants() {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let sdk = Sdk::new();
    // TS secrets.create / Go CreateSecret: 201, then 409 for the same name.
    let body = serde_json::json!({"name": "db", "data": b64("hunter2"), "permissions": "0400", "uid": 1000, "gid": 1000});
    let a = sdk.json(Method::POST, "/secrets", body.clone()).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    let a = sdk.json(Method::POST, "/secrets", body).await;
    assert_eq!(
        a.status,
        StatusCode::CONFLICT,
        "ErrSecretExists: {}",
        a.text()
    );
    let a = sdk
        .json(
            Method::POST,
            "/secrets",
            serde_json::json!({"name": "api", "data": b64("k1")}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text());
    // ListSecrets: metadata only.
    let a = sdk.get("/secrets").await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(
        !a.text().contains(&b64("hunter2")),
        "a value leaked: {}",
        a.text()
    );
    let list: Vec<SdkSecret> = a.decode();
    assert_eq!(list.len(), 2);
    let db = list.iter().find(|s| s.name == "db").expect("db listed");
    assert_eq!(
        (db.size, db.permissions.as_str(), db.uid),
        (7, "0400", 1000)
    );
    rfc3339(db.modified_at.as_deref().expect("modified_at"));
    // Bad input names the problem.
    for (body, says) in [
        (
            serde_json::json!({"name": "../x", "data": b64("v")}),
            "secret name",
        ),
        (serde_json::json!({"name": "x", "data": "%%%"}), "base64"),
        (
            serde_json::json!({"name": "x", "data": b64("v"), "permissions": "0999"}),
            "octal",
        ),
    ] {
        let a = sdk.json(Method::POST, "/secrets", body.clone()).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}");
        assert!(
            a.decode::<SdkError>().error.contains(says),
            "{body}: {}",
            a.text()
        );
    }

    // Create with grants (Go SlicerCreateNodeRequest.Secrets): the boot
    // syncs them into the guest with their modes.
    let vm = sdk
        .create(serde_json::json!({"persistent": true, "secrets": ["db", "api"]}))
        .await;
    let h = vm.hostname;
    assert_eq!(
        synced(&sdk, &h),
        [vec![
            ("db".to_string(), "hunter2".to_string(), 0o400),
            ("api".to_string(), "k1".to_string(), 0o600)
        ]]
    );
    let a = sdk.get(&format!("/vm/{h}")).await;
    assert!(
        a.text().contains(r#""secrets":["db","api"]"#),
        "{}",
        a.text()
    );
    assert!(!a.text().contains("hunter2"), "describe shows no value");

    // PatchSecret (Go always sends `data`): a running VM granted it gets
    // the new value.
    let a = sdk
        .json(
            Method::PATCH,
            "/secrets/db",
            serde_json::json!({"data": b64("swordfish")}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while synced(&sdk, &h).len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no resync after the change"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(synced(&sdk, &h)[1][0].1, "swordfish");
    let a = sdk
        .json(
            Method::PATCH,
            "/secrets/nope",
            serde_json::json!({"data": b64("x")}),
        )
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text());

    // Forks: inherit, replace (WithSecrets("api")), clear (WithSecrets()).
    sdk.shutdown(&h).await;
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/{h}/commit"),
            serde_json::json!({"cache_key": "secrets"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let c: SdkCommitResponse = a.decode();
    for (body, want) in [
        (serde_json::json!({}), vec!["db", "api"]),
        (serde_json::json!({"secrets": ["api"]}), vec!["api"]),
        (serde_json::json!({"secrets": []}), vec![]),
        (serde_json::json!({"no_secrets": true}), vec![]),
    ] {
        let a = sdk
            .json(
                Method::POST,
                &format!("/vm/commits/{}/fork?wait=agent", c.commit_id),
                body.clone(),
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{body}: {}", a.text());
        let fork: serde_json::Value = a.decode();
        let child = fork["hostname"].as_str().expect("hostname").to_owned();
        let sent = synced(&sdk, &child);
        assert_eq!(sent.len(), 1, "{body}: one sync at the fork's boot");
        let names: Vec<&str> = sent[0].iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(names, want, "{body}");
    }
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/commits/{}/fork", c.commit_id),
            serde_json::json!({"secrets": ["missing"]}),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    assert!(a.text().contains("missing"), "{}", a.text());

    // DeleteSecret: 200; then 404.
    let a = sdk.send(Method::DELETE, "/secrets/api", None).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let a = sdk.send(Method::DELETE, "/secrets/api", None).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text());
    let list: Vec<SdkSecret> = sdk.get("/secrets").await.decode();
    assert_eq!(list.len(), 1);
}

#[tokio::test]
async fn ssh_keys_and_import_user_reach_the_guest_at_first_boot() {
    use std::io::{BufRead as _, BufReader, Write as _};
    use tine_proto::agent::Request as AgentRequest;
    // A stand-in for github.com/USER.keys.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        let mut reader = BufReader::new(stream.try_clone().expect("clone"));
        let mut line = String::new();
        reader.read_line(&mut line).expect("request");
        loop {
            let mut h = String::new();
            reader.read_line(&mut h).expect("header");
            if h.trim().is_empty() {
                break;
            }
        }
        let body = "ssh-ed25519 AAAAimported\n";
        let mut out = stream;
        write!(
            out,
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .expect("answer");
        line
    });
    let mut sdk = Sdk::new();
    sdk.set_import_url(&format!("http://127.0.0.1:{port}/{{user}}.keys"));
    let vm = sdk
        .create(
            serde_json::json!({"ssh_keys": ["ssh-rsa AAAAgiven me@laptop"], "import_user": "octo"}),
        )
        .await;
    assert!(server.join().expect("server").starts_with("GET /octo.keys"));
    let keys: Vec<Vec<String>> = sdk
        .fake
        .seen(&vm.hostname)
        .into_iter()
        .filter_map(|s| match s {
            crate::launcher::fake::Seen::Agent(AgentRequest::AuthorizedKeys(r)) => Some(r.keys),
            _ => None,
        })
        .collect();
    assert_eq!(
        keys,
        [vec![
            "ssh-rsa AAAAgiven me@laptop".to_string(),
            "ssh-ed25519 AAAAimported octo@github".to_string()
        ]]
    );
}

#[tokio::test]
async fn fs_stat_readdir_mkdir_and_remove() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    // The fake agent's file calls work on the host's paths.
    let root = tempfile::tempdir().expect("tmp");
    let base = root.path().display().to_string();
    let enc = |p: &str| p.replace('/', "%2F");
    std::fs::write(root.path().join("a.txt"), b"hello").expect("write");
    // Go Mkdir / TS fs.mkdir({path, recursive, mode}).
    let dir = format!("{base}/x/y");
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/{h}/fs/mkdir"),
            serde_json::json!({"path": dir, "recursive": true, "mode": "0750"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    // Go ReadDir / TS fs.readDir(path).
    let a = sdk
        .get(&format!("/vm/{h}/fs/readdir?path={}", enc(&base)))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let list: Vec<SdkFsInfo> = a.decode();
    let names: Vec<(&str, &str)> = list
        .iter()
        .map(|e| (e.name.as_str(), e.kind.as_str()))
        .collect();
    assert_eq!(names, [("a.txt", "file"), ("x", "directory")]);
    assert_eq!(list[0].size, 5);
    rfc3339(&list[0].mtime);
    // Go Stat / TS fs.stat(path): the mode in octal; 404 when missing
    // (TS `exists()` turns it into false).
    let a = sdk
        .get(&format!("/vm/{h}/fs/stat?path={}", enc(&dir)))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let st: SdkFsInfo = a.decode();
    assert_eq!((st.name.as_str(), st.mode.as_str()), ("y", "0750"));
    let a = sdk
        .get(&format!(
            "/vm/{h}/fs/stat?path={}",
            enc(&format!("{base}/nope"))
        ))
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.decode::<SdkError>().code, "not_found");
    // Go Remove(path, recursive) / TS fs.remove(path, recursive).
    let x = enc(&format!("{base}/x"));
    let a = sdk
        .send(
            Method::DELETE,
            &format!("/vm/{h}/fs/remove?path={x}&recursive=false"),
            None,
        )
        .await;
    assert_eq!(
        a.status,
        StatusCode::BAD_REQUEST,
        "a non-empty dir without recursive"
    );
    let a = sdk
        .send(
            Method::DELETE,
            &format!("/vm/{h}/fs/remove?path={x}&recursive=true"),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert!(!root.path().join("x").exists());
    let a = sdk
        .send(
            Method::DELETE,
            &format!("/vm/{h}/fs/remove?path=rel&recursive=true"),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
}

/// Not in Slicer's SDKs: a memory commit's own warm pool, set in the commit
/// body, changed with `PUT` and given back to the group with `DELETE`; a
/// disk commit or an unknown one is refused by name.
#[tokio::test]
async fn a_memory_commits_warm_pool_over_rest() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/{h}/commit"),
            serde_json::json!({"mode": "memory", "hot_fork_pool": 2}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let c: tine_proto::api::CommitInfo = a.decode();
    assert_eq!(c.hot_fork_pool, Some(2));
    let uri = format!("/vm/commits/{}/pool", c.commit_id);
    let a = sdk
        .json(Method::PUT, &uri, serde_json::json!({"hot_fork_pool": 5}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(
        a.decode::<tine_proto::api::CommitInfo>().hot_fork_pool,
        Some(5)
    );
    let listed: Vec<tine_proto::api::CommitInfo> =
        sdk.get("/vm/commits?mode=memory").await.decode();
    assert_eq!(listed[0].hot_fork_pool, Some(5));
    let a = sdk.send(Method::DELETE, &uri, None).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(
        a.decode::<tine_proto::api::CommitInfo>().hot_fork_pool,
        None
    );

    for (uri, body, status, says) in [
        (
            uri.clone(),
            serde_json::json!({"hot_fork_pool": 65}),
            StatusCode::BAD_REQUEST,
            "at most 64",
        ),
        (
            uri.clone(),
            serde_json::json!({"size": 1}),
            StatusCode::BAD_REQUEST,
            "size",
        ),
        (
            "/vm/commits/cmt-dev-nope/pool".to_owned(),
            serde_json::json!({"hot_fork_pool": 1}),
            StatusCode::NOT_FOUND,
            "cmt-dev-nope",
        ),
    ] {
        let a = sdk.json(Method::PUT, &uri, body).await;
        assert_eq!(a.status, status, "{}", a.text());
        let e: SdkError = a.decode();
        assert!(e.error.contains(says), "{}", e.error);
    }
    let (_, disk) = sdk.committed(&[], "k").await;
    let a = sdk
        .json(
            Method::PUT,
            &format!("/vm/commits/{}/pool", disk.commit_id),
            serde_json::json!({"hot_fork_pool": 1}),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    assert!(a.decode::<SdkError>().error.contains("is a disk commit"));
}

#[tokio::test]
async fn pause_resume_suspend_restore_and_daemon_shutdown() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let status = |d: SdkDescription| d.node.status;
    // Go PauseVM / TS vm.pause(): 200, the list says Paused.
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/pause"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert!(sdk.fake.seen(&h).iter().any(|s| matches!(
        s,
        crate::launcher::fake::Seen::Control(tine_proto::vmm::Request::Pause)
    )));
    let nodes: Vec<SdkNode> = sdk.get("/nodes").await.decode();
    assert_eq!(nodes[0].status, "Paused");
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/pause"), None)
        .await;
    assert_eq!(
        a.status,
        StatusCode::OK,
        "pausing a paused VM: {}",
        a.text()
    );
    // Go ResumeVM / TS vm.resume().
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/resume"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(
        status(sdk.get(&format!("/vm/{h}")).await.decode()),
        "Running"
    );
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/resume"), None)
        .await;
    assert_eq!(a.status, StatusCode::CONFLICT);
    assert!(a.decode::<SdkError>().error.contains("is not paused"));
    // A paused VM is resumed before a graceful stop (its guest must hear it).
    sdk.send(Method::POST, &format!("/vm/{h}/pause"), None)
        .await;
    sdk.shutdown(&h).await;
    let seen = sdk.fake.seen(&h);
    let last_pause = seen.iter().rposition(|s| {
        matches!(
            s,
            crate::launcher::fake::Seen::Control(tine_proto::vmm::Request::Pause)
        )
    });
    let last_resume = seen.iter().rposition(|s| {
        matches!(
            s,
            crate::launcher::fake::Seen::Control(tine_proto::vmm::Request::Resume { .. })
        )
    });
    assert!(last_resume > last_pause, "{seen:?}");
    assert_eq!(
        status(sdk.get(&format!("/vm/{h}")).await.decode()),
        "Stopped"
    );
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/pause"), None)
        .await;
    assert_eq!(a.status, StatusCode::CONFLICT, "a stopped VM: {}", a.text());
    // Suspend and restore refuse what they cannot do, naming the state.
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/suspend"), None)
        .await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text());
    let e = a.decode::<SdkError>();
    assert!(e.error.contains(&format!("{h} is stopped")), "{}", e.error);
    assert_eq!(e.code, "conflict");
    // Go SuspendVM / TS vm.suspend() on a running VM: 200; the list then
    // says Stopped (tine's state: suspended) and no VMM runs.
    let v = sdk.create(serde_json::json!({})).await.hostname;
    let memory = sdk.fake.memory_of(&v);
    let a = sdk
        .send(Method::POST, &format!("/vm/{v}/restore"), None)
        .await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text());
    let e = a.decode::<SdkError>();
    assert!(e.error.contains(&format!("{v} is running")), "{}", e.error);
    let a = sdk
        .send(Method::POST, &format!("/vm/{v}/suspend"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "suspend: {}", a.text());
    assert!(!sdk.fake.is_running(&v), "the VMM is gone");
    let node = sdk
        .get("/nodes")
        .await
        .decode::<Vec<SdkNode>>()
        .into_iter()
        .find(|n| n.hostname == v)
        .expect("listed");
    assert_eq!(node.status, "Stopped");
    let described: serde_json::Value = sdk.get(&format!("/vm/{v}")).await.decode();
    assert_eq!(described["state"], "suspended", "{described}");
    let a = sdk
        .send(Method::POST, &format!("/vm/{v}/suspend"), None)
        .await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text());
    assert!(a.decode::<SdkError>().error.contains("already suspended"));
    // Go RestoreVMWithOptions(ctx, v, {Wait: agent, Timeout: 30s}): 200
    // once the agent answers; the same memory runs on.
    let a = sdk
        .send(
            Method::POST,
            &format!("/vm/{v}/restore?timeout=30s&wait=agent"),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "restore: {}", a.text());
    assert_eq!(
        status(sdk.get(&format!("/vm/{v}")).await.decode()),
        "Running"
    );
    assert_eq!(sdk.fake.memory_of(&v), memory, "resumed, not rebooted");
    // Go RestoreVM / TS vm.restore(): no wait; the agent answers soon.
    let a = sdk
        .send(Method::POST, &format!("/vm/{v}/suspend"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "suspend: {}", a.text());
    let a = sdk
        .send(Method::POST, &format!("/vm/{v}/restore"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "restore: {}", a.text());
    let health = sdk.get(&format!("/vm/{v}/health")).await;
    assert_eq!(health.status, StatusCode::OK, "{}", health.text());
    assert_eq!(sdk.fake.memory_of(&v), memory, "resumed, not rebooted");
    let a = sdk
        .send(Method::POST, &format!("/vm/{v}/restore?wait=later"), None)
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    // POST /daemon/shutdown answers, then the server is asked to stop.
    let a = sdk.send(Method::POST, "/daemon/shutdown", None).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
}

/// Go `ExecBackgroundResponse`, TS `BgExecResponse`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkBgStarted {
    exec_id: String,
    pid: i64,
    started_at: String,
    ring_bytes: i64,
}

/// Go `ExecBackgroundInfo`, TS `BgExecInfo`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkBgInfo {
    exec_id: String,
    pid: i64,
    command: String,
    started_at: String,
    running: bool,
    #[serde(default)]
    exit_code: Option<i64>,
    #[serde(default)]
    signal: Option<String>,
    bytes_written: i64,
    bytes_dropped: i64,
    next_id: u64,
    ring_bytes: i64,
}

/// Go `ExecBackgroundWaitExitResponse`.
#[derive(Debug, Deserialize)]
struct SdkBgWait {
    exec_id: String,
    running: bool,
    #[serde(default)]
    exit_code: Option<i64>,
    timed_out: bool,
}

/// Go `ExecBackgroundKillResponse`.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkBgKill {
    exec_id: String,
    pid: i64,
    running: bool,
    signal_sent: String,
}

/// Go `ExecBackgroundDeleteResponse`.
#[derive(Debug, Deserialize)]
struct SdkBgDelete {
    exec_id: String,
    reaped: bool,
}

impl Sdk {
    /// Go ExecBackground: `background=true`, `ring_bytes`, `stdio=base64`.
    async fn bg_exec(&self, h: &str, query: &str) -> SdkBgStarted {
        let uri = format!("/vm/{h}/exec?background=true&stdio=base64&{query}");
        let a = self.send(Method::POST, &uri, None).await;
        assert!(
            a.status == StatusCode::OK || a.status == StatusCode::CREATED,
            "{uri}: {}",
            a.text()
        );
        a.decode()
    }
}

#[tokio::test]
async fn background_exec_logs_wait_kill_and_remove() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    // A job that writes more than its ring holds, then exits 4.
    let script = "printf 0123456789; printf err >&2; exit 4";
    let q = format!(
        "cmd={}&shell=%2Fbin%2Fsh&ring_bytes=4",
        script
            .replace(' ', "%20")
            .replace(';', "%3B")
            .replace('>', "%3E")
            .replace('&', "%26")
    );
    let started = sdk.bg_exec(&h, &q).await;
    assert!(started.pid > 0);
    assert_eq!(started.ring_bytes, 4);
    rfc3339(&started.started_at);
    let id = started.exec_id.clone();

    // Go ExecWaitExit(timeout): GET .../wait-exit?timeout=N (seconds).
    let a = sdk
        .get(&format!("/vm/{h}/exec/{id}/wait-exit?timeout=10"))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let w: SdkBgWait = a.decode();
    assert_eq!(
        (w.exec_id.as_str(), w.running, w.exit_code, w.timed_out),
        (id.as_str(), false, Some(4), false)
    );

    // Go ExecList / ExecInfo.
    let list: Vec<SdkBgInfo> = sdk.get(&format!("/vm/{h}/exec")).await.decode();
    assert_eq!(list.len(), 1);
    let info: SdkBgInfo = sdk.get(&format!("/vm/{h}/exec/{id}")).await.decode();
    assert!(!info.running);
    assert_eq!(
        (info.exit_code, info.bytes_written, info.bytes_dropped),
        (Some(4), 13, 6)
    );

    // Go ExecLogs: NDJSON frames with ids, base64 data, then the exit; the
    // ring kept the last 4 bytes of each stream.
    let a = sdk
        .get(&format!("/vm/{h}/exec/{id}/logs?follow=true"))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    let mut last = None;
    for line in a.text().lines() {
        let f: serde_json::Value = serde_json::from_str(line).expect("frame");
        assert!(f["id"].as_u64().is_some_and(|n| n > 0), "{f}");
        let data = f["data"].as_str().unwrap_or_default();
        match f["type"].as_str() {
            Some("stdout") => stdout.extend(decode_output(data, f["encoding"].as_str())),
            Some("stderr") => stderr.extend(decode_output(data, f["encoding"].as_str())),
            _ => last = Some(f),
        }
    }
    assert_eq!(
        (stdout.as_slice(), stderr.as_slice()),
        (&b"6789"[..], &b"err"[..])
    );
    let last = last.expect("an exit frame");
    assert_eq!(
        (last["type"].as_str(), last["exit_code"].as_i64()),
        (Some("exit"), Some(4))
    );
    assert_eq!(
        last["dropped_bytes"], 0,
        "the default start is the oldest byte kept"
    );
    // Asking from offset 0 counts what the ring had already dropped.
    let a = sdk
        .get(&format!(
            "/vm/{h}/exec/{id}/logs?stdout_from=0&stderr_from=0"
        ))
        .await;
    let end = a
        .text()
        .lines()
        .last()
        .map(str::to_owned)
        .unwrap_or_default();
    let end: serde_json::Value = serde_json::from_str(&end).expect("frame");
    assert_eq!(
        (end["type"].as_str(), end["dropped_bytes"].as_u64()),
        (Some("exit"), Some(6))
    );
    // A cursor and byte offsets together are refused by name (the frame
    // ids themselves are tested with a real agent, in `frames`).
    let a = sdk
        .get(&format!("/vm/{h}/exec/{id}/logs?from_id=3&stdout_from=0"))
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a
        .decode::<SdkError>()
        .error
        .contains("`from_id` is a frame cursor"));

    // Go ExecKill with a grace: TERM, then KILL if it stays.
    let long = sdk
        .bg_exec(
            &h,
            "cmd=sh&args=-c&args=trap%20%27%27%20TERM%3B%20echo%20ready%3B%20sleep%2030",
        )
        .await;
    // Once it says ready, its trap is set.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let i: SdkBgInfo = sdk
            .get(&format!("/vm/{h}/exec/{}", long.exec_id))
            .await
            .decode();
        if i.bytes_written > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the job never said ready"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/{h}/exec/{}/kill", long.exec_id),
            serde_json::json!({"signal": "TERM", "grace_ms": 200}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let k: SdkBgKill = a.decode();
    assert_eq!((k.signal_sent.as_str(), k.running), ("SIGTERM", false));
    let w: SdkBgWait = sdk
        .get(&format!(
            "/vm/{h}/exec/{}/wait-exit?timeout=5",
            long.exec_id
        ))
        .await
        .decode();
    assert_eq!(w.exit_code, Some(137), "the grace ran out: SIGKILL");

    // A wait that times out says so.
    let sleeper = sdk.bg_exec(&h, "cmd=sleep&args=30").await;
    let w: SdkBgWait = sdk
        .get(&format!(
            "/vm/{h}/exec/{}/wait-exit?timeout=200ms",
            sleeper.exec_id
        ))
        .await
        .decode();
    assert!(w.running && w.timed_out);
    // Removing a running job is refused; once killed it goes.
    let uri = format!("/vm/{h}/exec/{}", sleeper.exec_id);
    assert_eq!(
        sdk.send(Method::DELETE, &uri, None).await.status,
        StatusCode::CONFLICT
    );
    let a = sdk
        .json(
            Method::POST,
            &format!("{uri}/kill"),
            serde_json::json!({"signal": "KILL"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    sdk.get(&format!("{uri}/wait-exit?timeout=5")).await;
    let a = sdk.send(Method::DELETE, &uri, None).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let del: SdkBgDelete = a.decode();
    assert!(del.reaped && del.exec_id == sleeper.exec_id);
    assert_eq!(sdk.get(&uri).await.status, StatusCode::NOT_FOUND);
    // Bad input is named.
    for (query, says) in [
        (
            "cmd=true&background=true&stdin=true",
            "a background exec takes no stdin",
        ),
        (
            "cmd=true&ring_bytes=9",
            "`ring_bytes` needs `background=true`",
        ),
    ] {
        let a = sdk
            .send(Method::POST, &format!("/vm/{h}/exec?{query}"), None)
            .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{query}");
        assert!(a.decode::<SdkError>().error.contains(says), "{query}");
    }
    let a = sdk
        .json(
            Method::POST,
            &format!("{uri}/kill"),
            serde_json::json!({"signal": "NOPE"}),
        )
        .await;
    assert!(a.decode::<SdkError>().error.contains("signal `NOPE`"));
}
