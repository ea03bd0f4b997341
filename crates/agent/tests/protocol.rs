//! Handshake, bad input, vanishing clients, limits, health and fix-ups.

mod common;

use std::fs;
use std::time::Duration;

use common::{s, wait_until, TestAgent};
use tine_agent::AgentConfig;
use tine_client::proto::frame::{read_frame, write_frame, FrameKind, MAX_FRAME_LEN};
use tine_client::proto::mux::{Mux, MuxConfig};
use tine_client::proto::{
    client_handshake, Channel, ErrorCode, ExecRequest, FileAttrs, FixupRequest, HandshakeError,
    Hello, ProtocolVersion, Request, Response, UploadRequest, PROTOCOL_VERSION,
};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

fn hello(major: u16) -> Hello {
    Hello {
        version: ProtocolVersion { major, minor: 0 },
        client: "raw test".to_owned(),
    }
}

/// A raw connection past the handshake.
async fn raw(agent: &TestAgent) -> UnixStream {
    let mut conn = UnixStream::connect(&agent.socket).await.expect("connect");
    client_handshake(&mut conn, &hello(PROTOCOL_VERSION.major))
        .await
        .expect("handshake");
    conn
}

/// A multiplexed connection without the typed client, for sending
/// arbitrary requests.
async fn raw_mux(agent: &TestAgent) -> Mux {
    Mux::client(raw(agent).await, MuxConfig::default())
}

async fn first_response(mux: &Mux, request: &serde_json::Value) -> Response {
    let mut stream = mux.open().expect("open");
    stream.send_msg(request).await.expect("send");
    let item = tokio::time::timeout(Duration::from_secs(10), stream.recv())
        .await
        .expect("answer in time")
        .expect("an answer");
    item.parse::<Response>()
        .expect("a message")
        .expect("a response")
}

fn error_code(response: &Response) -> ErrorCode {
    match response {
        Response::Error(e) => e.code,
        other => panic!("expected an error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_unknown_operation_gets_error_and_connection_survives() {
    let agent = TestAgent::start().await;
    let mux = raw_mux(&agent).await;

    let unknown = first_response(&mux, &serde_json::json!({"op": "frobnicate"})).await;
    let health = first_response(&mux, &serde_json::json!({"op": "health"})).await;

    assert_eq!(error_code(&unknown), ErrorCode::UnknownOperation);
    let Response::Error(e) = &unknown else {
        unreachable!()
    };
    assert!(e.message.contains("frobnicate"), "{}", e.message);
    assert!(matches!(health, Response::Health(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_malformed_requests_get_bad_request() {
    let agent = TestAgent::start().await;
    let mux = raw_mux(&agent).await;

    let missing_field = first_response(&mux, &serde_json::json!({"op": "exec"})).await;
    let no_op = first_response(&mux, &serde_json::json!({"path": "/"})).await;
    let wrong_type = first_response(&mux, &serde_json::json!({"op": "stat", "path": 5})).await;

    assert_eq!(error_code(&missing_field), ErrorCode::BadRequest);
    assert_eq!(error_code(&no_op), ErrorCode::BadRequest);
    assert_eq!(error_code(&wrong_type), ErrorCode::BadRequest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_non_json_request_gets_bad_request() {
    let agent = TestAgent::start().await;
    let mut conn = raw(&agent).await;

    write_frame(&mut conn, 1, FrameKind::Msg, b"not json at all")
        .await
        .expect("write");
    conn.flush().await.expect("flush");
    let frame = read_frame(&mut conn, MAX_FRAME_LEN)
        .await
        .expect("read")
        .expect("a frame");

    assert_eq!(frame.stream, 1);
    let response: Response = serde_json::from_slice(&frame.payload).expect("json");
    assert_eq!(error_code(&response), ErrorCode::BadRequest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_oversized_frame_closes_only_that_connection() {
    let agent = TestAgent::start().await;
    let bystander = agent.client().await;
    let running = bystander
        .exec(ExecRequest::shell("sleep 0.5; echo still here"))
        .await
        .expect("exec");
    let mut conn = raw(&agent).await;

    conn.write_all(&(MAX_FRAME_LEN + 1).to_be_bytes())
        .await
        .expect("write");
    // The agent may already have closed the connection after the header.
    let _ = conn.write_all(&[0u8; 64]).await;
    let frame = read_frame(&mut conn, MAX_FRAME_LEN)
        .await
        .expect("read")
        .expect("an error frame");
    let after = read_frame(&mut conn, MAX_FRAME_LEN).await;

    assert_eq!(frame.stream, 0);
    let response: Response = serde_json::from_slice(&frame.payload).expect("json");
    assert_eq!(error_code(&response), ErrorCode::Protocol);
    let Response::Error(e) = response else {
        unreachable!()
    };
    assert!(e.message.contains("exceeds"), "{}", e.message);
    assert!(matches!(after, Ok(None) | Err(_)), "connection closed");
    let output = running.wait_with_output().await.expect("bystander exec");
    assert_eq!(output.stdout_lossy(), "still here\n");
    assert!(bystander.health().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_network_bad_prefix_and_missing_interface_are_clear_errors() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let request = |iface: &str, prefix: u8| tine_client::proto::NetworkRequest {
        iface: iface.to_owned(),
        address: "192.0.2.10".parse().expect("address"),
        prefix,
        gateway: None,
        dns: Vec::new(),
        mac: None,
    };
    let bad_mac = tine_client::proto::NetworkRequest {
        mac: Some("02:00:00:00:00".into()),
        ..request("eth0", 24)
    };

    let refused_mac = client
        .network(bad_mac)
        .await
        .expect_err("a five-byte MAC must be refused");
    let bad_prefix = client
        .network(request("eth0", 33))
        .await
        .expect_err("prefix 33 must be refused");
    let missing = client
        .network(request("tine-nosuch0", 24))
        .await
        .expect_err("a missing interface must be an error");

    assert!(
        bad_prefix.to_string().contains("prefix length 33"),
        "{bad_prefix}"
    );
    assert!(missing.to_string().contains("tine-nosuch0"), "{missing}");
    assert!(
        refused_mac
            .to_string()
            .contains("MAC address `02:00:00:00:00`"),
        "{refused_mac}"
    );
    assert!(
        client.health().await.is_ok(),
        "the connection keeps serving"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_version_mismatch_is_refused_clearly() {
    let agent = TestAgent::start().await;
    let mut conn = UnixStream::connect(&agent.socket).await.expect("connect");

    let err = client_handshake(&mut conn, &hello(PROTOCOL_VERSION.major + 1))
        .await
        .expect_err("refused");

    match err {
        HandshakeError::Rejected(e) => {
            assert_eq!(e.code, ErrorCode::VersionMismatch);
            assert!(
                e.message.contains(&PROTOCOL_VERSION.to_string()),
                "{}",
                e.message
            );
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_exec_missing_binary_reports_not_found() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;

    let absolute = client
        .exec(ExecRequest::argv(["/nonexistent/bin/tool"]))
        .await
        .expect_err("missing");
    let searched = client
        .exec(ExecRequest::argv(["tine-no-such-command-xyz"]))
        .await
        .expect_err("missing");
    let bad_cwd = client
        .exec(ExecRequest::argv(["true"]).cwd("/nonexistent/dir"))
        .await
        .expect_err("missing cwd");

    assert_eq!(absolute.code(), Some(ErrorCode::NotFound));
    assert!(
        absolute.to_string().contains("/nonexistent/bin/tool"),
        "{absolute}"
    );
    assert_eq!(searched.code(), Some(ErrorCode::NotFound));
    assert!(searched.to_string().contains("tine-no-such-command-xyz"));
    assert_eq!(bad_cwd.code(), Some(ErrorCode::NotFound));
    assert!(
        bad_cwd.to_string().contains("working directory"),
        "{bad_cwd}"
    );
    assert!(client.health().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_client_vanishing_mid_upload_leaves_no_file() {
    let agent = TestAgent::start().await;
    let dir = agent.scratch("vanish");
    let target = dir.join("big.bin");
    {
        let mux = raw_mux(&agent).await;
        let stream = mux.open().expect("open");
        let request = Request::Upload(UploadRequest {
            path: s(&target).to_owned(),
            attrs: FileAttrs::default(),
            mkdirs: false,
            size: None,
        });
        stream.send_msg(&request).await.expect("request");
        stream
            .send_data(Channel::Data, &vec![7u8; 1 << 20])
            .await
            .expect("data");
        // Let the agent start writing the temporary file.
        assert!(
            wait_until(Duration::from_secs(10), || fs::read_dir(&dir)
                .map(|d| d.count() > 0)
                .unwrap_or(false))
            .await
        );
    }

    let cleaned = wait_until(Duration::from_secs(10), || {
        fs::read_dir(&dir).map(|d| d.count() == 0).unwrap_or(false)
    })
    .await;

    assert!(cleaned, "temporary file left in {}", dir.display());
    assert!(!target.exists());
    assert!(agent.client().await.health().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_client_vanishing_mid_exec_kills_process() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let execution = client
        .exec(ExecRequest::argv(["sleep", "300"]))
        .await
        .expect("exec");
    let pid = execution.pid();

    drop(execution);
    drop(client);

    let gone = wait_until(Duration::from_secs(10), || {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
    })
    .await;
    assert!(gone, "process {pid} survived its client");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_stream_limit_refuses_extra_streams_only() {
    let agent = TestAgent::start_with(AgentConfig {
        max_streams: 2,
        ..AgentConfig::default()
    })
    .await;
    let client = agent.client().await;
    let a = client
        .exec(ExecRequest::argv(["sleep", "30"]))
        .await
        .expect("first");
    let b = client
        .exec(ExecRequest::argv(["sleep", "30"]))
        .await
        .expect("second");

    let third = client.health().await.expect_err("over the limit");

    assert_eq!(third.code(), Some(ErrorCode::LimitExceeded));
    drop(a);
    drop(b);
    let recovered = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if client.health().await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(recovered.is_ok(), "streams were not released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_health_reports_versions_and_uptimes() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    tokio::time::sleep(Duration::from_millis(20)).await;

    let health = client.health().await.expect("health");

    assert_eq!(health.agent_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(health.protocol, PROTOCOL_VERSION);
    assert!(health.agent_uptime_ms >= 20);
    assert!(health.system_uptime_ms >= health.agent_uptime_ms);
    assert!(!health.userdata.present);
    assert_eq!(client.welcome().agent_version, env!("CARGO_PKG_VERSION"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_fixups_and_userdata_go_through_the_system_module() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    fs::create_dir_all(agent.root.path().join("etc/tine")).expect("mkdir");
    fs::write(agent.root.path().join("etc/tine/userdata"), "#!/bin/sh\n").expect("script");

    let report = client
        .fixups(FixupRequest {
            hostname: Some("fork-7".to_owned()),
            machine_id: true,
            ..FixupRequest::default()
        })
        .await
        .expect("fixups");
    let userdata = client.userdata_status().await.expect("userdata");
    let bad = client
        .fixups(FixupRequest {
            hostname: Some("bad host/name".to_owned()),
            ..FixupRequest::default()
        })
        .await
        .expect_err("invalid hostname");

    assert_eq!(report.hostname.as_deref(), Some("fork-7"));
    let id = report.machine_id.expect("machine id");
    let written = fs::read_to_string(agent.root.path().join("etc/machine-id")).expect("read");
    assert_eq!(written.trim(), id);
    assert!(userdata.present);
    assert!(!userdata.ran);
    assert_eq!(bad.code(), Some(ErrorCode::BadRequest));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_agent_binary_serves_on_unix_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("agent.sock");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tine-agent"))
        .args(["serve", "--unix", s(&socket), "--root", s(dir.path())])
        .kill_on_drop(true)
        .spawn()
        .expect("start tine-agent");
    assert!(wait_until(Duration::from_secs(30), || socket.exists()).await);

    let client = tine_client::AgentClient::connect_unix(&socket)
        .await
        .expect("connect");
    let output = client
        .exec_output(ExecRequest::argv(["echo", "from the binary"]))
        .await
        .expect("exec");

    assert_eq!(output.stdout_lossy(), "from the binary\n");
    child.kill().await.expect("kill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_agent_binary_without_listener_fails_clearly() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_tine-agent"))
        .arg("serve")
        .output()
        .await
        .expect("run tine-agent");

    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--unix"));
}
