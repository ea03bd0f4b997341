//! The REST client against a fake daemon speaking docs/api.md's shapes.

#[path = "support/fake_daemon.rs"]
mod fake_daemon;

use std::time::{Duration, Instant};

use fake_daemon::FakeDaemon;
use tine_client::api::{
    decode_data, CommitQuery, CpMode, ExecOptions, ForwardTarget, ShellEvent, ShellOptions,
    ShutdownAction, UploadOptions, Wait,
};
use tine_client::rest::{
    CommitRequest, CreateVmRequest, ErrorCode, ExecFrame, ForkNetwork, ForkRequest, ListQuery,
    TagsPatch, VmState,
};
use tine_client::{ApiError, TineClient};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn client(fake: &FakeDaemon) -> TineClient {
    TineClient::new(&fake.url(), None).expect("client")
}

#[tokio::test]
async fn daemon_routes_decode() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    c.healthz().await.expect("healthz");
    let info = c.info().await.expect("info");
    assert_eq!(info.host_groups, vec!["dev".to_string()]);
    let groups = c.host_groups().await.expect("groups");
    assert_eq!(groups[0].max_cpus, 2);

    let all = c
        .list_vms(None, &ListQuery::default())
        .await
        .expect("list all");
    assert_eq!(all.len(), 2);
    assert_eq!(fake.last("/nodes").uri, "/nodes");

    let tagged = c
        .list_vms(
            Some("dev"),
            &ListQuery {
                tags: vec!["env=ci".into()],
                tag_prefix: None,
            },
        )
        .await
        .expect("list group");
    assert_eq!(tagged.len(), 1);
    assert_eq!(tagged[0].hostname, "dev-1");
    assert_eq!(
        fake.last("/hostgroup/dev/nodes").uri,
        "/hostgroup/dev/nodes?tag=env%3Dci"
    );

    let vm = c.describe("web").await.expect("describe by name");
    assert_eq!(vm.hostname, "dev-1");
    assert_eq!(vm.state, VmState::Running);
}

#[tokio::test]
async fn not_found_decodes_the_error_body() {
    let fake = FakeDaemon::start(None).await;
    let err = client(&fake)
        .describe("dev-9")
        .await
        .expect_err("unknown VM");
    match &err {
        ApiError::Api { status, body } => {
            assert_eq!(*status, 404);
            assert_eq!(body.code, ErrorCode::NotFound);
            assert_eq!(body.error, "no VM called `dev-9`");
        }
        other => panic!("not an API error: {other:?}"),
    }
    assert_eq!(err.to_string(), "no VM called `dev-9`");

    let err = client(&fake)
        .list_vms(Some("nope"), &ListQuery::default())
        .await
        .expect_err("unknown group");
    assert_eq!(err.code(), Some(ErrorCode::NotFound));
}

#[tokio::test]
async fn create_sends_wait_and_timeout() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    let req = CreateVmRequest {
        cpus: Some(2),
        ram_bytes: Some(1 << 30),
        tags: vec!["env=ci".into()],
        ..Default::default()
    };
    let created = c
        .create_vm("dev", &req, Wait::Agent, Some(Duration::from_secs(30)))
        .await
        .expect("create");
    assert_eq!(created.hostname, "dev-3");
    assert_eq!(created.state, VmState::Running);
    let seen = fake.last("/hostgroup/dev/nodes");
    assert_eq!(seen.method, "POST");
    assert_eq!(seen.uri, "/hostgroup/dev/nodes?wait=agent&timeout=30s");
    let body: serde_json::Value =
        serde_json::from_str(seen.body.as_deref().expect("json body")).expect("json");
    assert_eq!(
        body,
        serde_json::json!({"cpus": 2, "ram_bytes": 1073741824u64, "tags": ["env=ci"]})
    );

    let created = c
        .create_vm("dev", &CreateVmRequest::default(), Wait::None, None)
        .await
        .expect("create no wait");
    assert_eq!(created.state, VmState::Starting);
    assert_eq!(
        fake.last("/hostgroup").uri,
        "/hostgroup/dev/nodes?wait=none"
    );

    let slow = CreateVmRequest {
        name: Some("slow".into()),
        ..Default::default()
    };
    let err = c
        .create_vm("dev", &slow, Wait::Agent, Some(Duration::from_millis(1500)))
        .await
        .expect_err("timeout");
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(err.status(), Some(408));
    assert!(fake.last("/hostgroup").uri.ends_with("timeout=1500ms"));

    let too_big = CreateVmRequest {
        cpus: Some(4),
        ..Default::default()
    };
    let err = c
        .create_vm("dev", &too_big, Wait::None, None)
        .await
        .expect_err("above max");
    assert_eq!(err.code(), Some(ErrorCode::BadRequest));
}

#[tokio::test]
async fn lifecycle_tags_logs_and_health() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);

    let tags = c.tags("dev-1").await.expect("tags");
    assert_eq!(tags.tags, vec!["name=web", "env=ci"]);
    let patched = c
        .patch_tags(
            "dev-1",
            &TagsPatch {
                add: vec!["x=1".into()],
                remove: vec!["env=ci".into()],
                replace: None,
            },
        )
        .await
        .expect("patch");
    assert_eq!(patched.tags, vec!["name=web", "x=1"]);
    assert_eq!(fake.last("/vm/dev-1/tags").method, "PATCH");

    let logs = c.logs("dev-1", Some(2)).await.expect("logs");
    assert_eq!(logs.lines, 2);
    assert_eq!(logs.content, "console line 2\nconsole line 3\n");
    assert_eq!(fake.last("/vm/dev-1/logs").uri, "/vm/dev-1/logs?lines=2");

    let h = c.health("dev-1", Wait::None, None).await.expect("health");
    assert!(h.agent_ready);
    assert_eq!(fake.last("/vm/dev-1/health").uri, "/vm/dev-1/health");
    let err = c
        .health("dev-2", Wait::None, None)
        .await
        .expect_err("stopped");
    assert_eq!(err.code(), Some(ErrorCode::Conflict));
    let err = c
        .health("dev-2", Wait::Agent, Some(Duration::from_secs(2)))
        .await
        .expect_err("wait");
    assert_eq!(err.code(), Some(ErrorCode::Internal));
    assert_eq!(
        fake.last("/vm/dev-2/health").uri,
        "/vm/dev-2/health?wait=agent&timeout=2s"
    );

    let r = c
        .shutdown("dev-1", ShutdownAction::Poweroff, None)
        .await
        .expect("shutdown");
    assert_eq!(r.state, VmState::Stopped);
    assert_eq!(
        fake.last("/vm/dev-1/shutdown").uri,
        "/vm/dev-1/shutdown?action=poweroff"
    );
    let r = c
        .shutdown(
            "dev-1",
            ShutdownAction::Shutdown,
            Some(Duration::from_secs(5)),
        )
        .await
        .expect("shutdown");
    assert_eq!(r.hostname, "dev-1");
    assert_eq!(
        fake.last("/vm/dev-1/shutdown").uri,
        "/vm/dev-1/shutdown?action=shutdown&timeout=5s"
    );

    let r = c
        .relaunch("dev-2", Wait::Agent, None)
        .await
        .expect("relaunch");
    assert_eq!(r.state, VmState::Running);
    let r = c.delete("dev-2").await.expect("delete");
    assert_eq!(r.state, VmState::Stopped);
    assert_eq!(fake.last("/vm/dev-2").method, "DELETE");
    c.delete_in_group("dev", "dev-1")
        .await
        .expect("delete in group");
    assert_eq!(fake.last("/hostgroup/dev/nodes/dev-1").method, "DELETE");
}

#[tokio::test]
async fn exec_frames_split_across_chunks_decode() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    let mut stream = c
        .exec(
            "dev-1",
            &ExecOptions::new("split", Vec::<String>::new()),
            None::<tokio::io::Empty>,
        )
        .await
        .expect("exec");
    let mut frames = Vec::new();
    while let Some(frame) = stream.next_frame().await {
        frames.push(frame.expect("frame"));
    }
    assert_eq!(frames.len(), 4, "{frames:?}");
    assert_eq!(frames[0], ExecFrame::Started { pid: 7 });
    let ExecFrame::Stdout { data, .. } = &frames[2] else {
        panic!("not stdout: {:?}", frames[2]);
    };
    assert_eq!(decode_data(data).expect("b64"), b"two\n");
    assert!(matches!(frames[3], ExecFrame::Exit { exit_code: 5, .. }));
}

#[tokio::test]
async fn exec_query_and_output() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    let mut opts = ExecOptions::new("echo", ["a b", "c&d"]);
    opts.env = vec!["K=V".into()];
    opts.uid = Some(1000);
    opts.cwd = Some("/tmp".into());
    opts.shell = Some(false);
    opts.timeout = Some(Duration::from_secs(10));
    let out = c.exec_output("dev-1", &opts).await.expect("exec");
    assert_eq!(out.stdout, b"a b c&d\n");
    assert_eq!(out.code, Some(0));
    assert_eq!(
        fake.last("/vm/dev-1/exec").uri,
        "/vm/dev-1/exec?cmd=echo&args=a+b&args=c%26d&env=K%3DV&uid=1000&cwd=%2Ftmp&timeout=10s&stdio=base64"
    );

    let out = c
        .exec_output("dev-1", &ExecOptions::new("kill", ["15"]))
        .await
        .expect("kill");
    assert_eq!((out.code, out.signal), (None, Some(15)));

    let err = c
        .exec_output("dev-1", &ExecOptions::new("nope", Vec::<String>::new()))
        .await
        .expect_err("cannot start");
    assert_eq!(err.status(), Some(400));
    assert_eq!(err.code(), Some(ErrorCode::BadRequest));
    assert!(err.to_string().contains("cannot start \"nope\""), "{err}");

    let err = c
        .exec_output("dev-1", &ExecOptions::new("lost", Vec::<String>::new()))
        .await
        .expect_err("error frame");
    assert_eq!(err.code(), Some(ErrorCode::AgentUnavailable));
    assert_eq!(
        err.to_string(),
        "the agent closed the stream before the process ended"
    );
}

#[tokio::test]
async fn exec_streams_stdin_while_output_flows() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    let (mut input, reader) = tokio::io::duplex(1024);
    let mut stream = c
        .exec(
            "dev-1",
            &ExecOptions::new("cat", Vec::<String>::new()),
            Some(reader),
        )
        .await
        .expect("exec");
    assert!(fake.last("/vm/dev-1/exec").uri.ends_with("&stdin=true"));
    assert_eq!(
        stream.next_frame().await.expect("frame").expect("ok"),
        ExecFrame::Started { pid: 7 }
    );
    // Each piece of input comes back before the next is written: the body
    // is streamed, not collected first.
    for word in ["first", "second"] {
        input.write_all(word.as_bytes()).await.expect("write");
        input.flush().await.expect("flush");
        let frame = tokio::time::timeout(Duration::from_secs(10), stream.next_frame())
            .await
            .expect("echo in time")
            .expect("frame")
            .expect("ok");
        let ExecFrame::Stdout { data, .. } = frame else {
            panic!("not stdout: {frame:?}");
        };
        assert_eq!(decode_data(&data).expect("b64"), word.as_bytes());
    }
    drop(input);
    let out = stream.collect_output().await.expect("exit");
    assert_eq!(out.code, Some(0));
}

#[tokio::test]
async fn bearer_token_is_sent_on_tcp() {
    let fake = FakeDaemon::start(Some("s3cret")).await;
    let url = fake.tcp_url.clone().expect("tcp");
    let c = TineClient::new(&url, Some("s3cret".into())).expect("client");
    assert!(c.has_token());
    c.info().await.expect("info with token");
    assert_eq!(
        fake.last("/info").authorization.as_deref(),
        Some("Bearer s3cret")
    );

    let wrong = TineClient::new(&url, Some("nope".into())).expect("client");
    let err = wrong.info().await.expect_err("401");
    assert_eq!(err.code(), Some(ErrorCode::Unauthorized));
    assert_eq!(err.status(), Some(401));

    // The WebSocket routes carry it too.
    let mut shell = c
        .shell("dev-1", &ShellOptions::default())
        .await
        .expect("shell over tcp")
        .split()
        .1;
    assert!(matches!(
        shell.next_event().await.expect("event"),
        Some(ShellEvent::Output(_))
    ));
    assert_eq!(
        fake.last("/vm/dev-1/shell").authorization.as_deref(),
        Some("Bearer s3cret")
    );
    let err = wrong
        .shell("dev-1", &ShellOptions::default())
        .await
        .expect_err("ws 401");
    assert_eq!(err.code(), Some(ErrorCode::Unauthorized));
}

#[tokio::test]
async fn upload_is_streamed() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    let (mut input, reader) = tokio::io::duplex(64 << 10);
    let chunk = vec![b'x'; 100_000];
    let upload = {
        let c = c.clone();
        tokio::spawn(async move {
            c.cp_upload(
                "dev-1",
                "/tmp/big",
                CpMode::Binary,
                &UploadOptions {
                    mode_bits: Some(0o755),
                    uid: Some(0),
                    gid: None,
                },
                reader,
            )
            .await
        })
    };
    for round in 1..=3 {
        input.write_all(&chunk).await.expect("write");
        // The daemon holds this round's bytes while the body is still open.
        let deadline = Instant::now() + Duration::from_secs(10);
        while fake.upload_progress("/tmp/big") < round * chunk.len() {
            assert!(Instant::now() < deadline, "upload not streamed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    drop(input);
    let n = upload.await.expect("join").expect("upload");
    assert_eq!(n, 300_000);
    let (data, chunks) = fake.upload("/tmp/big").expect("recorded");
    assert_eq!(data.len(), 300_000);
    assert!(chunks >= 3, "{chunks} chunks");
    assert_eq!(
        fake.last("/vm/dev-1/cp").uri,
        "/vm/dev-1/cp?path=%2Ftmp%2Fbig&mode=binary&permissions=0755&uid=0"
    );
}

#[tokio::test]
async fn download_streams_and_errors_decode() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    let mut dl = c
        .cp_download("dev-1", "/etc/hosts", CpMode::Binary)
        .await
        .expect("download");
    let mut got = String::new();
    dl.read_to_string(&mut got).await.expect("read");
    assert_eq!(got, "hello from /etc/hosts\n");

    let mut sink = Vec::new();
    let n = c
        .cp_download("dev-1", "/x", CpMode::Tar)
        .await
        .expect("download tar")
        .copy_to(&mut sink)
        .await
        .expect("copy");
    assert_eq!(n as usize, sink.len());
    assert!(fake.last("/vm/dev-1/cp").uri.ends_with("mode=tar"));

    let err = c
        .cp_download("dev-1", "/missing", CpMode::Binary)
        .await
        .expect_err("missing");
    assert_eq!(err.to_string(), "/missing: no such file");
}

#[tokio::test]
async fn shell_messages_follow_the_framing() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    let (mut w, mut r) = c
        .shell(
            "dev-1",
            &ShellOptions {
                rows: Some(24),
                cols: Some(80),
                ..Default::default()
            },
        )
        .await
        .expect("shell")
        .split();
    assert_eq!(
        fake.last("/vm/dev-1/shell").uri,
        "/vm/dev-1/shell?rows=24&cols=80"
    );
    assert_eq!(
        r.next_event().await.expect("greet"),
        Some(ShellEvent::Output("welcome\r\n".into()))
    );
    w.send_input(b"ls\r").await.expect("input");
    assert_eq!(
        r.next_event().await.expect("echo"),
        Some(ShellEvent::Output("ls\r".into()))
    );
    w.resize(50, 132).await.expect("resize");
    assert_eq!(
        r.next_event().await.expect("resized"),
        Some(ShellEvent::Output("resized 50 132".into()))
    );
    w.send_input(b"exit\r").await.expect("exit");
    assert_eq!(
        r.next_event().await.expect("exit"),
        Some(ShellEvent::Exit(3))
    );
}

#[tokio::test]
async fn forward_bridges_a_local_stream() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    let target = ForwardTarget::Tcp {
        host: None,
        port: 8080,
    };
    let conn = c.forward("dev-1", &target).await.expect("forward");
    assert_eq!(
        fake.last("/vm/dev-1/forward").uri,
        "/vm/dev-1/forward?target=tcp%3A8080"
    );
    let (mut local, remote_end) = tokio::io::duplex(4096);
    let bridge = tokio::spawn(conn.bridge(remote_end));
    local.write_all(b"ping").await.expect("write");
    let mut buf = vec![0u8; 64];
    let n = local.read(&mut buf).await.expect("read");
    assert_eq!(&buf[..n], b"[tcp:8080]ping");
    local.shutdown().await.expect("eof");
    let mut rest = Vec::new();
    local.read_to_end(&mut rest).await.expect("closed");
    let (sent, received) = bridge.await.expect("join").expect("bridge");
    assert_eq!((sent, received), (4, 14));

    let err = c.forward("dev-9", &target).await.expect_err("unknown VM");
    assert_eq!(err.code(), Some(ErrorCode::NotFound));
    assert_eq!(err.to_string(), "no VM called `dev-9`");
}

#[tokio::test]
async fn commits_and_forks() {
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    let req = CommitRequest {
        tags: vec!["base".into()],
        labels: [("os".to_string(), "min".to_string())].into(),
        cache_key: Some("k1".into()),
        mode: None,
        hot_fork_pool: None,
    };
    let commit = c.commit("dev-2", &req).await.expect("commit");
    assert_eq!(commit.mode, tine_proto::api::CommitMode::Disk);
    assert_eq!(commit.labels.get("os").map(String::as_str), Some("min"));
    let err = c.commit("dev-1", &req).await.expect_err("running");
    assert_eq!(err.code(), Some(ErrorCode::Conflict));

    let list = c
        .list_commits(&CommitQuery {
            cache_key: Some("k1".into()),
            source: Some("dev-2".into()),
            ..Default::default()
        })
        .await
        .expect("list");
    assert_eq!(list.len(), 1);
    assert_eq!(
        fake.last("/vm/commits").uri,
        "/vm/commits?cache_key=k1&source=dev-2"
    );

    let fork = c
        .fork(
            &commit.commit_id,
            &ForkRequest {
                fixups: Some(vec![]),
                network: Some(ForkNetwork::None),
                persistent: Some(false),
                ..Default::default()
            },
            Wait::Agent,
            None,
        )
        .await
        .expect("fork");
    assert_eq!(fork.hostname, "dev-4");
    assert!(!fork.persistent);
    let seen = fake.last("/vm/commits/cmt-");
    assert_eq!(
        seen.uri,
        format!("/vm/commits/{}/fork?wait=agent", commit.commit_id)
    );
    let body: serde_json::Value =
        serde_json::from_str(seen.body.as_deref().expect("body")).expect("json");
    assert_eq!(
        body,
        serde_json::json!({"persistent": false, "fixups": [], "network": "none"})
    );

    let pooled = c
        .set_commit_pool(&commit.commit_id, Some(3))
        .await
        .expect("pool");
    assert_eq!(pooled.hot_fork_pool, Some(3));
    let seen = fake.last("/vm/commits/");
    assert_eq!(
        (seen.method.as_str(), seen.body.as_deref()),
        ("PUT", Some(r#"{"hot_fork_pool":3}"#))
    );
    let reset = c
        .set_commit_pool(&commit.commit_id, None)
        .await
        .expect("reset");
    assert_eq!(reset.hot_fork_pool, None);
    assert_eq!(fake.last("/vm/commits/").method, "DELETE");

    let deleted = c.delete_commit(&commit.commit_id).await.expect("delete");
    assert_eq!(deleted.status, tine_proto::api::DeleteStatus::Deleted);
    let err = c.delete_commit("cmt-x").await.expect_err("unknown");
    assert_eq!(err.code(), Some(ErrorCode::NotFound));
}

#[tokio::test]
async fn unreachable_daemon_says_how_to_start_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("none.sock");
    let c = TineClient::new(&format!("unix://{}", sock.display()), None).expect("client");
    let err = c.info().await.expect_err("no daemon");
    assert!(err.is_connect(), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("tine up"), "{msg}");
    assert!(msg.contains("none.sock"), "{msg}");
}

#[test]
fn from_env_prefers_explicit_then_env_then_default() {
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "from-file\n").expect("write");
    // This is the only test touching these variables.
    std::env::remove_var("TINE_URL");
    std::env::remove_var("TINE_TOKEN");
    std::env::remove_var("TINE_TOKEN_FILE");
    let c = TineClient::from_env(None, None).expect("default");
    assert_eq!(c.url(), "unix:///var/lib/tine/tine.sock");
    assert!(!c.has_token());

    std::env::set_var("TINE_URL", "http://127.0.0.1:9");
    std::env::set_var("TINE_TOKEN_FILE", &token_file);
    let c = TineClient::from_env(None, None).expect("env");
    assert_eq!(c.url(), "http://127.0.0.1:9");
    assert!(c.has_token());

    std::env::set_var("TINE_TOKEN", "env-token");
    let c = TineClient::from_env(Some("/tmp/x.sock"), Some("explicit")).expect("explicit");
    assert_eq!(c.url(), "/tmp/x.sock");
    assert!(c.has_token());

    std::env::set_var("TINE_TOKEN_FILE", dir.path().join("missing"));
    std::env::remove_var("TINE_TOKEN");
    let err = TineClient::from_env(None, None).expect_err("missing token file");
    assert!(matches!(err, ApiError::TokenFile { .. }), "{err:?}");
    std::env::remove_var("TINE_URL");
    std::env::remove_var("TINE_TOKEN_FILE");

    assert!(TineClient::new("https://x:1", None).is_err());
}

#[tokio::test]
async fn exec_output_survives_a_daemon_that_ignores_stdin() {
    // The command never reads stdin; the daemon answers and closes while the
    // client still has megabytes to send. The answer must still arrive.
    let fake = FakeDaemon::start(None).await;
    let c = client(&fake);
    for _ in 0..5 {
        let stdin = tokio::io::AsyncReadExt::take(tokio::io::repeat(b'x'), 8 << 20);
        let out = c
            .exec("dev-1", &ExecOptions::new("echo", ["hi"]), Some(stdin))
            .await
            .expect("exec")
            .collect_output()
            .await
            .expect("output despite the unread body");
        assert_eq!((out.stdout.as_slice(), out.code), (&b"hi\n"[..], Some(0)));
    }
}
