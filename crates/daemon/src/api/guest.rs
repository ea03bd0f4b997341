//! Routes served by the guest agent: health, exec, files, shell, forward.

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::{header, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use futures_util::{SinkExt, StreamExt, TryStreamExt};
use tine_client::agent::{ExecEvent, ShellEvent};
use tine_proto::agent::{
    Command, ExecRequest, FileAttrs, ForwardTarget, ProcessOptions, ShellRequest, UploadRequest,
    UploadTarRequest,
};
use tine_proto::api::shell::{DATA as SHELL_DATA, EXIT as SHELL_EXIT, RESIZE as SHELL_RESIZE};
use tine_proto::api::{CpResponse, ErrorCode, ExecFrame, VmHealth};
use tokio_util::io::{ReaderStream, StreamReader};

use super::{parse_timeout, query_get, query_num, query_only, query_pairs, AppState};
use crate::error::{ApiError, ApiResult};

fn agent_err(e: impl std::fmt::Display) -> ApiError {
    ApiError::agent(e.to_string())
}

pub(super) async fn health(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Json<VmHealth>> {
    let q = query_pairs(&uri);
    query_only(&q, &["wait", "timeout"])?;
    let vm = d.vm(&hostname)?;
    if let Some(w) = query_get(&q, "wait") {
        if w != "agent" {
            return Err(ApiError::bad_request(format!("wait `{w}` is not `agent`")));
        }
        let timeout = parse_timeout(query_get(&q, "timeout"), super::DEFAULT_WAIT)?;
        d.wait_running(&vm.hostname, timeout).await?;
    }
    let (vm, client) = d.agent(&vm.hostname).await?;
    let began = Instant::now();
    let h = client.health().await.map_err(agent_err)?;
    Ok(Json(VmHealth {
        hostname: vm.hostname,
        agent_ready: true,
        agent_version: h.agent_version,
        agent_uptime_ms: h.agent_uptime_ms,
        system_uptime_ms: h.system_uptime_ms,
        userdata_ran: h.userdata.ran || !h.userdata.present,
        rtt_ms: began.elapsed().as_secs_f64() * 1e3,
    }))
}

fn frame_line(frame: &ExecFrame) -> Bytes {
    let mut line = serde_json::to_vec(frame).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

pub(super) async fn exec(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
    body: Body,
) -> ApiResult<Response> {
    let q = query_pairs(&uri);
    query_only(
        &q,
        &[
            "cmd", "args", "env", "uid", "gid", "cwd", "shell", "timeout", "stdin",
        ],
    )?;
    let cmd = query_get(&q, "cmd")
        .filter(|c| !c.is_empty())
        .ok_or_else(|| ApiError::bad_request("`cmd` is required"))?
        .to_owned();
    let args: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "args")
        .map(|(_, v)| v.clone())
        .collect();
    let mut options = ProcessOptions::default();
    for (_, kv) in q.iter().filter(|(k, _)| k == "env") {
        let (k, v) = kv
            .split_once('=')
            .filter(|(k, _)| !k.is_empty())
            .ok_or_else(|| ApiError::bad_request(format!("env `{kv}` is not KEY=VALUE")))?;
        options.env.insert(k.to_owned(), v.to_owned());
    }
    options.uid = query_num(&q, "uid")?;
    options.gid = query_num(&q, "gid")?;
    options.cwd = query_get(&q, "cwd").map(str::to_owned);
    let shell = matches!(query_get(&q, "shell"), Some("true") | Some("1"));
    let stdin = matches!(query_get(&q, "stdin"), Some("true") | Some("1"));
    let timeout = query_get(&q, "timeout")
        .map(|t| parse_timeout(Some(t), Duration::ZERO))
        .transpose()?;
    let command = if shell {
        let mut script = cmd;
        for a in &args {
            script.push(' ');
            script.push_str(a);
        }
        Command::Shell {
            script,
            interpreter: None,
        }
    } else {
        let mut argv = vec![cmd];
        argv.extend(args);
        Command::Argv(argv)
    };
    let req = ExecRequest {
        command,
        options,
        stdin,
        timeout_ms: timeout.map(|t| t.as_millis() as u64),
        background: None,
    };
    let (_vm, client) = d.agent(&hostname).await?;
    let mut execution = client.exec(req).await.map_err(|e| {
        let msg = e.to_string();
        if msg.contains("not found") || msg.contains("No such file") || msg.contains("spawn") {
            ApiError::bad_request(msg)
        } else {
            ApiError::agent(msg)
        }
    })?;
    let pid = execution.pid();
    if stdin {
        let control = execution.control();
        tokio::spawn(async move {
            let mut stream = body.into_data_stream();
            let mut open = true;
            while let Some(chunk) = stream.next().await {
                match chunk {
                    // Once the command stops reading, the rest of the body
                    // is drained, not refused: the client still gets the
                    // output and the exit frame.
                    Ok(bytes) if open => open = control.write(&bytes).await.is_ok(),
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            if open {
                let _ = control.close_stdin().await;
            }
        });
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    tokio::spawn(async move {
        // Keep the connection (and so the process's streams) alive until
        // the exit frame is sent.
        let _client = client;
        let b64 = base64::engine::general_purpose::STANDARD;
        if tx
            .send(Ok(frame_line(&ExecFrame::Started { pid })))
            .await
            .is_err()
        {
            return;
        }
        loop {
            let frame = match execution.next_event().await {
                Ok(Some(ExecEvent::Stdout(data))) => ExecFrame::Stdout {
                    data: b64.encode(data),
                },
                Ok(Some(ExecEvent::Stderr(data))) => ExecFrame::Stderr {
                    data: b64.encode(data),
                },
                Ok(Some(ExecEvent::Exit(s))) => ExecFrame::Exit {
                    code: s.code,
                    signal: s.signal,
                    timed_out: s.timed_out,
                    duration_ms: s.duration_ms,
                },
                Ok(None) => ExecFrame::Error {
                    error: "the agent closed the stream before the process ended".into(),
                    code: ErrorCode::AgentUnavailable,
                },
                Err(e) => ExecFrame::Error {
                    error: e.to_string(),
                    code: ErrorCode::AgentUnavailable,
                },
            };
            let last = matches!(frame, ExecFrame::Exit { .. } | ExecFrame::Error { .. });
            if tx.send(Ok(frame_line(&frame))).await.is_err() || last {
                // The client left: the agent ends the process when the
                // connection drops.
                return;
            }
        }
    });
    let stream = tokio_stream_from(rx);
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response())
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

type CpQuery = (Vec<(String, String)>, String, bool);

fn cp_query(uri: &Uri, allowed: &[&str]) -> ApiResult<CpQuery> {
    let q = query_pairs(uri);
    query_only(&q, allowed)?;
    let path = query_get(&q, "path")
        .filter(|p| p.starts_with('/'))
        .ok_or_else(|| ApiError::bad_request("`path` is required and must be absolute"))?
        .to_owned();
    let tar = match query_get(&q, "mode") {
        None | Some("binary") => false,
        Some("tar") => true,
        Some(m) => {
            return Err(ApiError::bad_request(format!(
                "mode `{m}` is not binary or tar"
            )))
        }
    };
    Ok((q, path, tar))
}

pub(super) async fn download(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Response> {
    let (_, path, tar) = cp_query(&uri, &["path", "mode"])?;
    let (_vm, client) = d.agent(&hostname).await?;
    if !tar {
        // Fail before the body starts when the file is not there.
        let stat = client
            .stat(&path, true)
            .await
            .map_err(|e| ApiError::not_found(format!("{path}: {e}")))?;
        if stat.kind != tine_proto::agent::FileKind::File {
            return Err(ApiError::bad_request(format!(
                "{path} is not a regular file; use mode=tar for a directory"
            )));
        }
    }
    let (writer, reader) = tokio::io::duplex(256 * 1024);
    tokio::spawn(async move {
        let result = if tar {
            client.download_tar(&path, writer).await.map(|_| ())
        } else {
            client.download(&path, writer).await.map(|_| ())
        };
        if let Err(e) = result {
            tracing::warn!("download {path}: {e}");
        }
    });
    let content_type = if tar {
        "application/x-tar"
    } else {
        "application/octet-stream"
    };
    Ok((
        [(header::CONTENT_TYPE, content_type)],
        Body::from_stream(ReaderStream::new(reader)),
    )
        .into_response())
}

pub(super) async fn upload(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
    body: Body,
) -> ApiResult<Json<CpResponse>> {
    let (q, path, tar) = cp_query(&uri, &["path", "mode", "mode_bits", "uid", "gid"])?;
    let mode = query_get(&q, "mode_bits")
        .map(|m| {
            u32::from_str_radix(m.trim_start_matches("0o"), 8)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| {
                    ApiError::bad_request(format!("mode_bits `{m}` is not octal like 0644"))
                })
        })
        .transpose()?;
    let uid = query_num(&q, "uid")?;
    let gid = query_num(&q, "gid")?;
    let (_vm, client) = d.agent(&hostname).await?;
    // Both modes report the bytes received; the tar mode counts them here.
    let received = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = received.clone();
    let reader = tokio_util::io::InspectReader::new(
        StreamReader::new(
            body.into_data_stream()
                .map_err(|e| std::io::Error::other(e.to_string())),
        ),
        move |chunk: &[u8]| {
            counter.fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
        },
    );
    let answer = if tar {
        let s = client
            .upload_tar(
                UploadTarRequest {
                    path,
                    mkdirs: true,
                    uid,
                    gid,
                },
                reader,
            )
            .await
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        CpResponse {
            bytes: received.load(std::sync::atomic::Ordering::Relaxed),
            entries: Some(s.entries),
            skipped: Some(s.skipped),
        }
    } else {
        let bytes = client
            .upload(
                UploadRequest {
                    path,
                    attrs: FileAttrs { mode, uid, gid },
                    mkdirs: true,
                    size: None,
                },
                reader,
            )
            .await
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        CpResponse {
            bytes,
            entries: None,
            skipped: None,
        }
    };
    Ok(Json(answer))
}

pub(super) async fn shell(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
    ws: WebSocketUpgrade,
) -> ApiResult<Response> {
    let q = query_pairs(&uri);
    query_only(&q, &["rows", "cols", "cwd", "uid", "shell", "term"])?;
    let options = ProcessOptions {
        cwd: query_get(&q, "cwd").map(str::to_owned),
        uid: query_num(&q, "uid")?,
        ..ProcessOptions::default()
    };
    let req = ShellRequest {
        argv: query_get(&q, "shell").map(|s| vec![s.to_owned()]),
        options,
        rows: query_num(&q, "rows")?.unwrap_or(24),
        cols: query_num(&q, "cols")?.unwrap_or(80),
        term: query_get(&q, "term").map(str::to_owned),
    };
    let (_vm, client) = d.agent(&hostname).await?;
    let session = client.shell(req).await.map_err(agent_err)?;
    Ok(ws.on_upgrade(move |socket| async move {
        let _client = client;
        pump_shell(socket, session).await;
    }))
}

async fn pump_shell(socket: WebSocket, mut session: tine_client::agent::ShellSession) {
    let (mut sink, mut stream) = socket.split();
    let control = session.control();
    let input = tokio::spawn(async move {
        while let Some(Ok(msg)) = stream.next().await {
            let Message::Binary(data) = msg else {
                if matches!(msg, Message::Close(_)) {
                    break;
                }
                continue;
            };
            match data.first() {
                Some(&SHELL_DATA) if control.write(&data[1..]).await.is_err() => break,
                Some(&SHELL_DATA) => {}
                Some(&SHELL_RESIZE) if data.len() >= 5 => {
                    let rows = u16::from_be_bytes([data[1], data[2]]);
                    let cols = u16::from_be_bytes([data[3], data[4]]);
                    let _ = control.resize(rows, cols).await;
                }
                _ => {}
            }
        }
        // The client left: hang up the terminal.
        let _ = control.signal(libc::SIGHUP).await;
    });
    loop {
        match session.next_event().await {
            Ok(Some(ShellEvent::Output(data))) => {
                let mut msg = Vec::with_capacity(data.len() + 1);
                msg.push(SHELL_DATA);
                msg.extend_from_slice(&data);
                if sink.send(Message::Binary(msg.into())).await.is_err() {
                    break;
                }
            }
            Ok(Some(ShellEvent::Exit(s))) => {
                let code = shell_exit_code(&s);
                let mut msg = vec![SHELL_EXIT];
                msg.extend_from_slice(&code.to_be_bytes());
                let _ = sink.send(Message::Binary(msg.into())).await;
                break;
            }
            Ok(None) | Err(_) => break,
        }
    }
    let _ = sink.send(Message::Close(None)).await;
    input.abort();
}

/// The code a shell's end is reported with: its exit code, else 128+N for
/// signal N. The agent reports these numbers; a signal outside 1..=127
/// (no real one) gives 128 rather than overflowing.
fn shell_exit_code(status: &tine_proto::agent::ExitStatus) -> i32 {
    match (status.code, status.signal) {
        (Some(code), _) => code,
        (None, Some(signal @ 1..=127)) => 128 + signal,
        (None, _) => 128,
    }
}

/// Parses `tcp:PORT`, `tcp:HOST:PORT` or `unix:PATH`.
pub fn parse_target(t: &str) -> ApiResult<ForwardTarget> {
    let bad = || {
        ApiError::bad_request(format!(
            "target `{t}` is not tcp:PORT, tcp:HOST:PORT or unix:/PATH"
        ))
    };
    if let Some(rest) = t.strip_prefix("tcp:") {
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) => (Some(h.to_owned()), p),
            None => (None, rest),
        };
        let port: u16 = port.parse().ok().filter(|p| *p > 0).ok_or_else(bad)?;
        Ok(ForwardTarget::Tcp { port, host })
    } else if let Some(path) = t.strip_prefix("unix:") {
        if path.starts_with('/') {
            Ok(ForwardTarget::Unix {
                path: path.to_owned(),
            })
        } else {
            Err(bad())
        }
    } else {
        Err(bad())
    }
}

pub(super) async fn forward(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
    ws: WebSocketUpgrade,
) -> ApiResult<Response> {
    let q = query_pairs(&uri);
    query_only(&q, &["target"])?;
    let target = parse_target(
        query_get(&q, "target").ok_or_else(|| ApiError::bad_request("`target` is required"))?,
    )?;
    let (_vm, client) = d.agent(&hostname).await?;
    let mut fwd = client
        .forward(target)
        .await
        .map_err(|e| ApiError::bad_request(format!("forward: {e}")))?;
    Ok(ws.on_upgrade(move |socket| async move {
        let _client = client;
        let (mut sink, mut stream) = socket.split();
        loop {
            tokio::select! {
                msg = stream.next() => match msg {
                    Some(Ok(Message::Binary(data))) => {
                        if fwd.write(&data).await.is_err() { break; }
                    }
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => {
                        let _ = fwd.shutdown_write().await;
                        // Drain what the guest still sends.
                        while let Ok(Some(data)) = fwd.read().await {
                            if sink.send(Message::Binary(data.into())).await.is_err() { break; }
                        }
                        break;
                    }
                    Some(Ok(_)) => {}
                },
                data = fwd.read() => match data {
                    Ok(Some(data)) => {
                        if sink.send(Message::Binary(data.into())).await.is_err() { break; }
                    }
                    Ok(None) | Err(_) => break,
                },
            }
        }
        let _ = sink.send(Message::Close(None)).await;
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_targets_parse() {
        assert_eq!(
            parse_target("tcp:8080").expect("port"),
            ForwardTarget::Tcp {
                port: 8080,
                host: None
            }
        );
        assert_eq!(
            parse_target("tcp:127.0.0.1:22").expect("host"),
            ForwardTarget::Tcp {
                port: 22,
                host: Some("127.0.0.1".into())
            }
        );
        assert_eq!(
            parse_target("unix:/run/x.sock").expect("unix"),
            ForwardTarget::Unix {
                path: "/run/x.sock".into()
            }
        );
        for bad in ["tcp:0", "tcp:x", "unix:rel", "udp:53", ""] {
            assert!(parse_target(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn shell_exit_codes_survive_signal_numbers_from_a_hostile_agent() {
        let status = |code, signal| tine_proto::agent::ExitStatus {
            code,
            signal,
            ..Default::default()
        };
        assert_eq!(shell_exit_code(&status(Some(3), None)), 3);
        assert_eq!(shell_exit_code(&status(None, Some(9))), 137);
        assert_eq!(shell_exit_code(&status(None, Some(i32::MAX))), 128);
        assert_eq!(shell_exit_code(&status(None, Some(i32::MIN))), 128);
        assert_eq!(shell_exit_code(&status(None, None)), 128);
    }
}
