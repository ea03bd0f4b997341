//! Contract tests of stats (Go `GetVMStats`, TS `vms.stats()`) and of the
//! file watch (Go `WatchFS` / `WatchFSIter`, TS `vm.fs.watch`). The fake
//! guests relay `stats` and `watch` to a real agent running on this host,
//! so the figures are this machine's and the events come from inotify.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde::Deserialize;

use super::{rfc3339, Sdk, SdkError};

/// Go `SlicerNodeStat`, TS `WireVMStat`.
#[derive(Debug, Deserialize)]
struct SdkNodeStat {
    hostname: String,
    ip: String,
    created_at: String,
    snapshot: Option<SdkSnapshot>,
    error: String,
    /// tine's host-side figures.
    host: serde_json::Value,
}

/// Go `SlicerSnapshot`, TS `VMSnapshot`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct SdkSnapshot {
    hostname: String,
    arch: String,
    timestamp: String,
    uptime: String,
    total_cpus: i64,
    total_memory: u64,
    memory_used: u64,
    memory_available: u64,
    memory_used_percent: f64,
    load_avg1: f64,
    load_avg5: f64,
    load_avg15: f64,
    disk_read_total: f64,
    disk_write_total: f64,
    network_read_total: f64,
    network_write_total: f64,
    #[serde(rename = "diskIOInflight")]
    disk_io_inflight: i64,
    open_connections: i64,
    open_files: i64,
    entropy: i64,
    disk_space_total: u64,
    disk_space_used: u64,
    disk_space_free: u64,
    disk_space_used_percent: f64,
}

/// Go `SlicerFSWatchEvent` (and its `watchEventPayload`), TS `FSWatchEvent`.
#[derive(Debug, Deserialize)]
struct SdkWatchEvent {
    id: u64,
    #[serde(rename = "type")]
    kind: String,
    path: String,
    timestamp: String,
    size: i64,
    #[serde(rename = "isDir")]
    is_dir: bool,
    #[serde(default)]
    message: Option<String>,
}

impl Sdk {
    /// A daemon whose guests answer the operations `ops` with a real agent.
    pub(super) fn with_real_agent(ops: &[&'static str]) -> (Self, tempfile::TempDir) {
        let sdk = Sdk::new();
        let root = tempfile::tempdir().expect("tmp");
        let agent = tine_agent::Agent::new(tine_agent::AgentConfig {
            system_root: root.path().to_path_buf(),
            ..tine_agent::AgentConfig::default()
        });
        sdk.fake.delegate_agent(
            ops,
            Arc::new(move |io| {
                tokio::spawn(agent.clone().serve_connection(io));
            }),
        );
        (sdk, root)
    }

    /// Opens a watch as `WatchFS` does: `Accept: text/event-stream`, and
    /// `Last-Event-ID` when given; the answer's head and its body.
    async fn open_watch(&self, uri: &str, last_id: Option<&str>) -> (StatusCode, String, Body) {
        use tower::ServiceExt;
        let mut req = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .header("accept", "text/event-stream");
        if let Some(id) = last_id {
            req = req.header("last-event-id", id);
        }
        let response = self
            .app
            .clone()
            .oneshot(req.body(Body::empty()).expect("request"))
            .await
            .expect("infallible");
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (response.status(), content_type, response.into_body())
    }
}

/// An SSE body read as Go's `WatchFS` reads it: comments and `event:`
/// lines skipped, `id:` kept.
struct SseReader {
    stream: axum::body::BodyDataStream,
    text: String,
}

impl SseReader {
    fn new(body: Body) -> Self {
        Self {
            stream: body.into_data_stream(),
            text: String::new(),
        }
    }

    /// The next `want` events, or fewer when the body ends first (then
    /// `true`); fails after 10 s.
    async fn next(&mut self, want: usize) -> (Vec<SdkWatchEvent>, bool) {
        let mut events = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            while let Some(end) = self.text.find("\n\n") {
                let block: String = self.text.drain(..end + 2).collect();
                let (mut id, mut data) = (0u64, Vec::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        id = v.trim().parse().expect("a numeric id");
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push(v.trim().to_owned());
                    }
                }
                if data.is_empty() {
                    continue;
                }
                let e: SdkWatchEvent = serde_json::from_str(&data.join("\n"))
                    .unwrap_or_else(|e| panic!("the SDK cannot decode {data:?}: {e}"));
                assert_eq!(e.id, id, "the payload's id is the SSE id");
                events.push(e);
            }
            if events.len() >= want {
                return (events, false);
            }
            let next = futures_util::StreamExt::next(&mut self.stream);
            match tokio::time::timeout_at(deadline, next).await {
                Err(_) => panic!("no more events after {events:?}"),
                Ok(None) => return (events, true),
                Ok(Some(chunk)) => self
                    .text
                    .push_str(&String::from_utf8_lossy(&chunk.expect("chunk"))),
            }
        }
    }
}

/// Whether the body ends (with nothing more) within 5 s.
async fn ends(body: Body) -> bool {
    tokio::time::timeout(Duration::from_secs(5), body.collect())
        .await
        .is_ok_and(|b| b.is_ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_for_every_vm_and_for_one() {
    let (sdk, _root) = Sdk::with_real_agent(&["stats", "watch"]);
    let running = sdk.create(serde_json::json!({})).await.hostname;
    let stopped = sdk
        .create(serde_json::json!({"persistent": true}))
        .await
        .hostname;
    sdk.shutdown(&stopped).await;

    // Go GetVMStats(ctx, ""), TS vms.stats(): GET /nodes/stats.
    let a = sdk.get("/nodes/stats").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let stats: Vec<SdkNodeStat> = a.decode();
    assert_eq!(stats.len(), 2);
    let run = stats
        .iter()
        .find(|s| s.hostname == running)
        .expect("running");
    assert_eq!(run.error, "", "{run:?}");
    rfc3339(&run.created_at);
    assert_eq!(run.ip, "", "no network in this group");
    let snap = run.snapshot.as_ref().expect("a running VM has a snapshot");
    rfc3339(&snap.timestamp);
    assert_eq!(snap.hostname, running);
    // The real agent ran on this host: its figures are this machine's.
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get()) as i64;
    assert!(snap.total_cpus >= cpus && snap.total_cpus > 0, "{snap:?}");
    assert!(snap.total_memory > 0);
    assert_eq!(snap.memory_used + snap.memory_available, snap.total_memory);
    assert!((0.0..=100.0).contains(&snap.memory_used_percent));
    assert!(snap.disk_space_total > 0 && snap.disk_space_used <= snap.disk_space_total);
    assert!(snap.open_files > 0, "{snap:?}");
    assert!(snap.uptime.ends_with('s'), "{}", snap.uptime);
    // tine's extras: the host measured the disk file.
    let disk = &run.host["disk"];
    assert!(
        disk["size_bytes"].as_u64().is_some_and(|n| n > 0),
        "{}",
        run.host
    );
    assert!(disk["allocated_bytes"].as_u64().is_some(), "{}", run.host);
    let stop = stats
        .iter()
        .find(|s| s.hostname == stopped)
        .expect("stopped");
    assert!(stop.snapshot.is_none());
    assert!(stop.error.contains("is stopped"), "{}", stop.error);
    assert!(stop.host["vmm_pid"].is_null());

    // Go GetVMStats(ctx, h): GET /node/{h}/stats, a one-element list.
    let one: Vec<SdkNodeStat> = sdk.get(&format!("/node/{running}/stats")).await.decode();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].hostname, running);
    assert!(one[0].snapshot.is_some());
    let a = sdk.get("/node/nope-9/stats").await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.decode::<SdkError>().code, "not_found");

    // A paused VM's agent cannot answer: said so, without a failure.
    sdk.send(Method::POST, &format!("/vm/{running}/pause"), None)
        .await;
    let paused: Vec<SdkNodeStat> = sdk.get(&format!("/node/{running}/stats")).await.decode();
    assert!(paused[0].snapshot.is_none());
    assert!(paused[0].error.contains("paused"), "{}", paused[0].error);
    sdk.send(Method::POST, &format!("/vm/{running}/resume"), None)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_of_a_silent_agent_name_it() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    // Without the relay, the fake agent does not know `stats`: the VM's
    // stat says why, and the request still succeeds.
    let a = sdk.get("/nodes/stats").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let stats: Vec<SdkNodeStat> = a.decode();
    assert_eq!(stats[0].hostname, h);
    assert!(stats[0].snapshot.is_none());
    assert!(
        stats[0].error.contains("too old for stats"),
        "{}",
        stats[0].error
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fs_watch_streams_inotify_events_as_the_sdks_read_them() {
    let (sdk, _root) = Sdk::with_real_agent(&["stats", "watch"]);
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path().to_str().expect("utf-8").to_owned();
    std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
    let enc = |p: &str| p.replace('/', "%2F");

    // Go WatchFS{Paths, Recursive, MaxEvents: 3}, TS fs.watch({...}).
    let uri = format!(
        "/vm/{h}/fs/watch?paths={}&recursive=true&max_events=3",
        enc(&d)
    );
    let (status, content_type, body) = sdk.open_watch(&uri, None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(content_type, "text/event-stream");
    let mut sse = SseReader::new(body);
    std::fs::write(dir.path().join("sub/a.txt"), b"hello").expect("write");
    let (mut events, _) = sse.next(2).await;
    std::fs::remove_file(dir.path().join("sub/a.txt")).expect("rm");
    let (rest, ended) = sse.next(2).await;
    assert!(ended, "max_events ends the stream");
    events.extend(rest);
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["create", "write", "remove"], "{events:?}");
    assert_eq!(
        events.iter().map(|e| e.id).collect::<Vec<_>>(),
        [1, 2, 3],
        "monotonic per-stream ids"
    );
    let write = &events[1];
    assert_eq!(
        (write.path.clone(), write.size, write.is_dir),
        (format!("{d}/sub/a.txt"), 5, false)
    );
    assert!(write.message.is_none());
    // Go's ParseFSWatchTimestamp: RFC 3339 with nanoseconds.
    rfc3339(&write.timestamp);
    assert_eq!(write.timestamp.split('.').nth(1).map(str::len), Some(10));

    // OneShot with an event filter, a pattern and Last-Event-ID: one
    // event, numbered after the given id, then the stream ends.
    let uri = format!(
        "/vm/{h}/fs/watch?paths={}&patterns=*.txt&events=write&one_shot=true",
        enc(&d)
    );
    let (status, _, body) = sdk.open_watch(&uri, Some("41")).await;
    assert_eq!(status, StatusCode::OK);
    std::fs::write(dir.path().join("skip.log"), b"x").expect("write");
    std::fs::write(dir.path().join("b.txt"), b"xy").expect("write");
    let (events, ended) = SseReader::new(body).next(2).await;
    assert!(ended, "one_shot ends the stream");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (
            events[0].id,
            events[0].kind.as_str(),
            events[0].path.clone()
        ),
        (42, "write", format!("{d}/b.txt"))
    );

    // Timeout: the server ends an idle stream.
    let uri = format!("/vm/{h}/fs/watch?paths={}&timeout=300ms", enc(&d));
    let (status, _, body) = sdk.open_watch(&uri, None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(ends(body).await, "the stream outlived its timeout");

    // Refusals, before the stream starts, as the SDKs' errors read them.
    for (query, status, says) in [
        (
            "recursive=true".to_owned(),
            StatusCode::BAD_REQUEST,
            "`paths` is required",
        ),
        (
            format!("paths={}&events=delete", enc(&d)),
            StatusCode::BAD_REQUEST,
            "`delete`",
        ),
        (
            format!("paths={}", enc(&format!("{d}/absent"))),
            StatusCode::NOT_FOUND,
            "absent",
        ),
        (
            "paths=relative".to_owned(),
            StatusCode::BAD_REQUEST,
            "not absolute",
        ),
        (
            format!("paths={}&patterns=%5B", enc(&d)),
            StatusCode::BAD_REQUEST,
            "is not a glob",
        ),
    ] {
        let a = sdk.get(&format!("/vm/{h}/fs/watch?{query}")).await;
        assert_eq!(a.status, status, "{query}: {}", a.text());
        let e: SdkError = a.decode();
        assert!(e.error.contains(says), "{query}: {}", e.error);
    }
    sdk.shutdown(&h).await;
    let a = sdk
        .get(&format!("/vm/{h}/fs/watch?paths={}", enc(&d)))
        .await;
    assert_eq!(a.status, StatusCode::CONFLICT, "{}", a.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_reads_stats_and_watch_events() {
    use tine_client::api::WatchOptions;
    use tine_proto::api::FsEventType;
    let (sdk, _root) = Sdk::with_real_agent(&["stats", "watch"]);
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let dir = tempfile::tempdir().expect("tmp");
    let socket = dir.path().join("api.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
    let app = sdk.app.clone();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = tine_client::TineClient::unix(&socket);

    let stats = client.stats(Some(&h)).await.expect("stats");
    assert_eq!(stats.len(), 1);
    assert!(stats[0].snapshot.as_ref().is_some_and(|s| s.total_cpus > 0));
    assert_eq!(client.stats(None).await.expect("all").len(), 1);

    let watched = dir.path().join("w");
    std::fs::create_dir(&watched).expect("mkdir");
    let options = WatchOptions {
        paths: vec![watched.to_str().expect("utf-8").to_owned()],
        events: vec![FsEventType::Create],
        max_events: Some(2),
        ..WatchOptions::default()
    };
    let mut events = client.fs_watch(&h, &options).await.expect("watch");
    std::fs::write(watched.join("a"), b"1").expect("write");
    std::fs::write(watched.join("b"), b"22").expect("write");
    let mut got = Vec::new();
    while let Some(e) = tokio::time::timeout(Duration::from_secs(10), events.next_event())
        .await
        .expect("events in time")
    {
        got.push(e.expect("an event"));
    }
    let names: Vec<(u64, &str)> = got
        .iter()
        .map(|e| (e.id, e.path.rsplit('/').next().unwrap_or_default()))
        .collect();
    assert_eq!(names, [(1, "a"), (2, "b")], "{got:?}");
    assert!(got.iter().all(|e| e.kind == FsEventType::Create));
    let e = client
        .fs_watch(
            &h,
            &WatchOptions {
                paths: vec!["/no/such/dir".into()],
                ..WatchOptions::default()
            },
        )
        .await
        .expect_err("missing");
    assert_eq!(e.status(), Some(404), "{e}");
}
