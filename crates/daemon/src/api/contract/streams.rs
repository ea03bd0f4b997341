//! Contract tests of the calls that carry data: cp in both modes (Go
//! `CpToVM`/`CpFromVM`, `WriteFile`/`ReadFile`; TS `fs.upload`,
//! `fs.download`), the shell WebSocket (Slicer's framed protocol) and the
//! forward WebSocket (`X-Inlets-Upstream`). The fake guests relay these
//! operations to a real agent running on this host, so the bytes really go
//! through files, a PTY and a TCP connection.

use std::io::Read as _;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use futures_util::{SinkExt as _, StreamExt as _};
use tine_proto::api::shell;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::Message;

use super::Sdk;

/// The router on a real TCP listener (a WebSocket needs a connection to
/// upgrade); returns its address.
async fn serve(sdk: &Sdk) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = sdk.app.clone();
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            panic!("test server: {e}");
        }
    });
    addr
}

fn url_path(p: &std::path::Path) -> String {
    form_urlencoded::byte_serialize(p.display().to_string().as_bytes()).collect()
}

#[tokio::test]
async fn cp_moves_bytes_both_ways_in_binary_and_tar_mode() {
    let (sdk, _root) = Sdk::with_real_agent(&["upload", "download", "upload_tar", "download_tar"]);
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let dir = tempfile::tempdir().expect("tmp");
    // WriteFile / CpToVM mode=binary with Slicer's permissions.
    let file = dir.path().join("one.bin");
    let payload: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let a = sdk
        .send(
            Method::POST,
            &format!(
                "/vm/{h}/cp?path={}&mode=binary&uid=0&gid=0&permissions=0640",
                url_path(&file)
            ),
            Some(("application/octet-stream", payload.clone())),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(std::fs::read(&file).expect("written"), payload);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&file).expect("meta").permissions(),
    );
    assert_eq!(mode & 0o777, 0o640);
    // ReadFile / CpFromVM binary: the bytes, and the file's mode in
    // X-Slicer-File-Mode (ReadFile returns it; CpFromVM gives the local
    // copy that mode when no permissions are named).
    let a = sdk
        .get(&format!("/vm/{h}/cp?path={}", url_path(&file)))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.body, payload);
    assert_eq!(a.header("x-slicer-file-mode"), Some("0640"));
    // A guest's setuid, setgid and sticky bits stay in the guest: the
    // header carries the permission bits alone.
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o7755))
        .expect("chmod");
    let a = sdk
        .get(&format!("/vm/{h}/cp?path={}", url_path(&file)))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.header("x-slicer-file-mode"), Some("0755"));
    // A missing file: Go ReadFile maps 404 to os.ErrNotExist.
    let a = sdk
        .get(&format!(
            "/vm/{h}/cp?path={}",
            url_path(&dir.path().join("nope"))
        ))
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text());

    // CpToVM of a directory: mode=tar, the tar as the body.
    let mut builder = tar::Builder::new(Vec::new());
    for (name, data) in [
        ("tree/a.txt", &b"alpha"[..]),
        ("tree/sub/b.txt", &b"beta"[..]),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder
            .append_data(&mut header, name, data)
            .expect("tar entry");
    }
    let archive = builder.into_inner().expect("tar");
    let dest = dir.path().join("in");
    let a = sdk
        .send(
            Method::POST,
            &format!("/vm/{h}/cp?path={}&mode=tar&uid=0&gid=0", url_path(&dest)),
            Some(("application/x-tar", archive)),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(
        std::fs::read(dest.join("tree/sub/b.txt")).expect("unpacked"),
        b"beta"
    );
    // CpFromVM of a directory: a tar holding it.
    let a = sdk
        .get(&format!(
            "/vm/{h}/cp?path={}&mode=tar",
            url_path(&dest.join("tree"))
        ))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.content_type, "application/x-tar");
    let mut names = Vec::new();
    let mut archive = tar::Archive::new(a.body.as_slice());
    for entry in archive.entries().expect("a tar") {
        let mut entry = entry.expect("entry");
        let name = entry.path().expect("path").display().to_string();
        if name.ends_with("a.txt") {
            let mut text = String::new();
            entry.read_to_string(&mut text).expect("read");
            assert_eq!(text, "alpha");
        }
        names.push(name);
    }
    assert!(names.iter().any(|n| n.ends_with("sub/b.txt")), "{names:?}");

    // CpToVM and CpFromVM with exclude patterns: `exclude=` repeated on
    // the tar request; the daemon leaves those entries out both ways.
    let mut builder = tar::Builder::new(Vec::new());
    for (name, data) in [
        ("keep.txt", &b"k"[..]),
        ("debug.log", &b"l"[..]),
        ("node_modules/m/index.js", &b"m"[..]),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder
            .append_data(&mut header, name, data)
            .expect("tar entry");
    }
    let archive = builder.into_inner().expect("tar");
    let dest = dir.path().join("ex");
    let a = sdk
        .send(
            Method::POST,
            &format!(
                "/vm/{h}/cp?path={}&mode=tar&exclude=*.log&exclude=node_modules",
                url_path(&dest)
            ),
            Some(("application/x-tar", archive)),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert!(dest.join("keep.txt").exists());
    assert!(!dest.join("debug.log").exists() && !dest.join("node_modules").exists());
    std::fs::write(dest.join("trace.log"), b"t").expect("write");
    let a = sdk
        .get(&format!(
            "/vm/{h}/cp?path={}&mode=tar&exclude=trace.log",
            url_path(&dest)
        ))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let mut archive = tar::Archive::new(a.body.as_slice());
    let names: Vec<String> = archive
        .entries()
        .expect("a tar")
        .map(|e| {
            e.expect("entry")
                .path()
                .expect("path")
                .display()
                .to_string()
        })
        .collect();
    assert!(names.iter().any(|n| n.ends_with("keep.txt")), "{names:?}");
    assert!(!names.iter().any(|n| n.ends_with("trace.log")), "{names:?}");
}

/// Reads shell frames until `want` shows up in the terminal output or the
/// session closes; returns the output and the exit code, if it closed.
async fn read_shell<S>(ws: &mut S, want: &str) -> (String, Option<i32>)
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    let mut out = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let msg = match tokio::time::timeout_at(deadline, ws.next()).await {
            Err(_) => panic!("no `{want}` in the shell's output: {out:?}"),
            Ok(None) | Ok(Some(Err(_))) => return (out, None),
            Ok(Some(Ok(m))) => m,
        };
        let Message::Binary(bytes) = msg else {
            continue;
        };
        let (kind, payload) = shell::decode(&bytes).expect("a framed message");
        match kind {
            shell::DATA => {
                out.push_str(&String::from_utf8_lossy(payload));
                if !want.is_empty() && out.contains(want) {
                    return (out, None);
                }
            }
            shell::SESSION_CLOSE => {
                let code = payload
                    .get(..4)
                    .map(|b| i32::from_be_bytes(b.try_into().expect("4 bytes")));
                return (out, code);
            }
            shell::HEARTBEAT => {}
            other => panic!("frame type {other} from the daemon"),
        }
    }
}

#[tokio::test]
async fn the_shell_websocket_speaks_slicers_frames() {
    let (sdk, _root) = Sdk::with_real_agent(&["shell"]);
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let addr = serve(&sdk).await;
    let request = format!("ws://{addr}/vm/{h}/shell?rows=30&cols=100&shell=%2Fbin%2Fsh")
        .into_client_request()
        .expect("request");
    let (mut ws, _) = tokio_tungstenite::connect_async(request)
        .await
        .expect("the shell upgrades");
    // A window size, a heartbeat, then a command as terminal bytes.
    let mut size = 120u32.to_be_bytes().to_vec();
    size.extend_from_slice(&40u32.to_be_bytes());
    for frame in [
        shell::encode(shell::WINDOW_SIZE, &size),
        shell::encode(shell::HEARTBEAT, b""),
        shell::encode(shell::DATA, b"stty size; echo tine-$((6*7))\r"),
    ] {
        ws.send(Message::Binary(frame.into())).await.expect("send");
    }
    let (out, _) = read_shell(&mut ws, "tine-42").await;
    assert!(
        out.contains("40 120"),
        "the resize reached the PTY: {out:?}"
    );
    // The shell's exit code comes in the session-close frame.
    ws.send(Message::Binary(
        shell::encode(shell::DATA, b"exit 3\r").into(),
    ))
    .await
    .expect("send");
    let (_, code) = read_shell(&mut ws, "").await;
    assert_eq!(code, Some(3));
}

#[tokio::test]
async fn forward_relays_a_tcp_connection_named_by_x_inlets_upstream() {
    let (sdk, _root) = Sdk::with_real_agent(&["forward"]);
    let h = sdk.create(serde_json::json!({})).await.hostname;
    // A service "in the guest": upper-cases what it reads.
    let service = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = service.local_addr().expect("addr").port();
    tokio::spawn(async move {
        let (mut conn, _) = service.accept().await.expect("accept");
        let mut buf = [0u8; 64];
        let n = conn.read(&mut buf).await.expect("read");
        conn.write_all(&buf[..n].to_ascii_uppercase())
            .await
            .expect("write");
    });
    let addr = serve(&sdk).await;
    let mut request = format!("ws://{addr}/vm/{h}/forward")
        .into_client_request()
        .expect("request");
    request.headers_mut().insert(
        "x-inlets-upstream",
        format!("127.0.0.1:{port}").parse().expect("header"),
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(request)
        .await
        .expect("the forward upgrades");
    ws.send(Message::Binary(b"ping".to_vec().into()))
        .await
        .expect("send");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < 4 {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => got.extend_from_slice(&b),
            Ok(Some(Ok(_))) => {}
            other => panic!("no answer through the forward: {other:?} after {got:?}"),
        }
    }
    assert_eq!(got, b"PING");
    // No upstream: the handshake is refused with a 400 naming the header.
    let request = format!("ws://{addr}/vm/{h}/forward")
        .into_client_request()
        .expect("request");
    match tokio_tungstenite::connect_async(request).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), StatusCode::BAD_REQUEST);
            let body = String::from_utf8_lossy(response.body().as_deref().unwrap_or_default())
                .into_owned();
            assert!(body.contains("X-Inlets-Upstream"), "{body}");
        }
        other => panic!("a forward without an upstream was not refused: {other:?}"),
    }
}

#[tokio::test]
async fn the_shell_takes_the_go_handlers_directory() {
    let (sdk, _root) = Sdk::with_real_agent(&["shell"]);
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let addr = serve(&sdk).await;
    let dir = tempfile::tempdir().expect("tmp");
    // shell.NewProxyHandler's URL: `shell`, and `cwd` when set (`uid` and
    // `gid` only when not 0).
    let request = format!(
        "ws://{addr}/vm/{h}/shell?cwd={}&shell=%2Fbin%2Fsh",
        url_path(dir.path())
    )
    .into_client_request()
    .expect("request");
    let (mut ws, _) = tokio_tungstenite::connect_async(request)
        .await
        .expect("the shell upgrades");
    ws.send(Message::Binary(
        shell::encode(shell::DATA, b"echo at-$(pwd)-end\r").into(),
    ))
    .await
    .expect("send");
    let want = format!("at-{}-end", dir.path().display());
    let (out, _) = read_shell(&mut ws, &want).await;
    assert!(out.contains(&want), "{out:?}");
}

#[tokio::test]
async fn forward_relays_a_unix_socket_named_by_x_inlets_upstream() {
    let (sdk, _root) = Sdk::with_real_agent(&["forward"]);
    let h = sdk.create(serde_json::json!({})).await.hostname;
    // A Unix socket service "in the guest" (forward.Start's and TS
    // forward()'s `9000:/var/run/docker.sock` form): echoes reversed.
    let dir = tempfile::tempdir().expect("tmp");
    let socket = dir.path().join("svc.sock");
    let service = tokio::net::UnixListener::bind(&socket).expect("bind");
    tokio::spawn(async move {
        let (mut conn, _) = service.accept().await.expect("accept");
        let mut buf = [0u8; 64];
        let n = conn.read(&mut buf).await.expect("read");
        let mut back = buf[..n].to_vec();
        back.reverse();
        conn.write_all(&back).await.expect("write");
    });
    let addr = serve(&sdk).await;
    let mut request = format!("ws://{addr}/vm/{h}/forward")
        .into_client_request()
        .expect("request");
    request.headers_mut().insert(
        "x-inlets-upstream",
        format!("unix:{}", socket.display())
            .parse()
            .expect("header"),
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(request)
        .await
        .expect("the forward upgrades");
    ws.send(Message::Binary(b"abc".to_vec().into()))
        .await
        .expect("send");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < 3 {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => got.extend_from_slice(&b),
            Ok(Some(Ok(_))) => {}
            other => panic!("no answer through the forward: {other:?} after {got:?}"),
        }
    }
    assert_eq!(got, b"cba");
}
