//! Routes served by the guest agent: health, exec, files, shell, forward.
//!
//! The agent is the guest's, and code in the VM can replace it: every call
//! a handler makes has a host-side deadline ([`DEADLINES`]), a download is
//! capped and a cut-short one aborts its body.

use std::future::Future;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use futures_util::{SinkExt, StreamExt, TryStreamExt};
use tine_client::agent::{ClientError, ExecEvent, ShellEvent};
use tine_client::AgentClient;
use tine_proto::agent::{
    Command, ExecRequest, FileAttrs, ForwardTarget, ProcessOptions, ShellRequest, UploadRequest,
    UploadTarRequest,
};
use tine_proto::api::shell as shell_frames;
use tine_proto::api::{
    CpResponse, ErrorCode, ExecFrame, ExecResult, StdioEncoding, VmHealth, MAX_BUFFERED_OUTPUT,
};
use tokio_util::io::{ReaderStream, StreamReader};

use super::agent_call::{
    agent, agent_err, call_err, exit_fields, shell_exit_code, Deadlines, DEADLINES,
};
use super::params::{
    parse_timeout, query_all, query_bool, query_get, query_num, query_only, query_pairs, AppState,
};
use crate::error::{ApiError, ApiResult};

/// Where Slicer's guest agent lives; its `upload` subcommands finish the Go
/// SDK's chunked copies inside the guest.
const SLICER_AGENT: &str = "/usr/local/bin/slicer-agent";

/// `health?wait=agent` gets at least this long for the agent's answer
/// once the VM is running, even when the wait used up its `timeout`.
const MIN_HEALTH_BUDGET: Duration = Duration::from_secs(1);

fn millis(d: Duration) -> String {
    humantime::format_duration(Duration::from_millis(d.as_millis() as u64)).to_string()
}

/// Runs `answer` for `budget`; past it, the agent "did not answer": 408
/// when the request waited for the agent (`wait=agent`), else 503.
async fn answer_within<T>(
    budget: Duration,
    waited: bool,
    hostname: &str,
    answer: impl Future<Output = ApiResult<T>>,
) -> ApiResult<T> {
    match tokio::time::timeout(budget, answer).await {
        Ok(answer) => answer,
        Err(_) => {
            let msg = format!(
                "the agent of {hostname} did not answer within {}",
                millis(budget)
            );
            Err(if waited {
                ApiError::timeout(msg)
            } else {
                ApiError::agent(msg)
            })
        }
    }
}

/// The health answer of `client`'s agent.
async fn health_answer(client: &AgentClient, hostname: String) -> ApiResult<VmHealth> {
    let began = Instant::now();
    let h = client.health().await.map_err(agent_err)?;
    Ok(VmHealth {
        hostname,
        agent_ready: true,
        agent_version: h.agent_version,
        agent_uptime: h.agent_uptime_ms.saturating_mul(1_000_000),
        system_uptime: h.system_uptime_ms.saturating_mul(1_000_000),
        agent_uptime_ms: h.agent_uptime_ms,
        system_uptime_ms: h.system_uptime_ms,
        userdata_ran: h.userdata.ran || !h.userdata.present,
        rtt_ms: began.elapsed().as_secs_f64() * 1e3,
    })
}

pub(super) async fn health(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Json<VmHealth>> {
    let q = query_pairs(&uri);
    query_only(&q, &["wait", "timeout"])?;
    let vm = d.vm(&hostname)?;
    let began = Instant::now();
    // The whole answer, connecting included, fits the request's timeout
    // with `wait=agent`, else the reply deadline.
    let budget = match query_get(&q, "wait") {
        Some("agent") => {
            let timeout = parse_timeout(query_get(&q, "timeout"), super::params::DEFAULT_WAIT)?;
            d.wait_running(&vm.hostname, timeout).await?;
            Some(
                timeout
                    .saturating_sub(began.elapsed())
                    .max(MIN_HEALTH_BUDGET),
            )
        }
        Some(w) => return Err(ApiError::bad_request(format!("wait `{w}` is not `agent`"))),
        None => None,
    };
    let answer = async {
        let (vm, client) = d.agent(&vm.hostname).await?;
        health_answer(&client, vm.hostname).await
    };
    let h = answer_within(
        budget.unwrap_or(DEADLINES.reply),
        budget.is_some(),
        &vm.hostname,
        answer,
    )
    .await?;
    Ok(Json(h))
}

fn frame_line(frame: &ExecFrame) -> Bytes {
    let mut line = serde_json::to_vec(frame).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

/// What `shell=` asks for: a shell path (Slicer's form, `shell=/bin/bash`),
/// `true` for `/bin/sh`, or nothing (empty or `false`: run `cmd` directly).
fn shell_choice(value: Option<&str>) -> ApiResult<Option<Option<String>>> {
    match value {
        None | Some("" | "false" | "0") => Ok(None),
        Some("true" | "1") => Ok(Some(None)),
        Some(path) if path.starts_with('/') && !path.contains('\0') => {
            Ok(Some(Some(path.to_owned())))
        }
        Some(other) => Err(ApiError::bad_request(format!(
            "shell `{other}` is not an absolute path to a shell (like /bin/bash), true or false"
        ))),
    }
}

/// Encodes output chunks as the request's `stdio=` asks. Text mode keeps
/// a UTF-8 sequence cut between two chunks for the next one, so only bytes
/// that are not UTF-8 become U+FFFD.
#[derive(Debug, Default)]
struct OutputEncoder {
    encoding: StdioEncoding,
    pending: Vec<u8>,
}

impl OutputEncoder {
    fn new(encoding: StdioEncoding) -> Self {
        OutputEncoder {
            encoding,
            pending: Vec::new(),
        }
    }

    /// The text of `data` (after what an earlier chunk left).
    fn encode(&mut self, data: &[u8]) -> String {
        if self.encoding == StdioEncoding::Base64 {
            return base64::engine::general_purpose::STANDARD.encode(data);
        }
        self.pending.extend_from_slice(data);
        let keep = match std::str::from_utf8(&self.pending) {
            Ok(_) => 0,
            // An incomplete sequence at the very end waits for more.
            Err(e) if e.error_len().is_none() => self.pending.len() - e.valid_up_to(),
            Err(_) => incomplete_tail(&self.pending),
        };
        let rest = self.pending.split_off(self.pending.len() - keep);
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending = rest;
        text
    }

    /// What is left at the end of the stream.
    fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// How many bytes at the end of `data` start a UTF-8 sequence that is not
/// complete yet (0 to 3).
fn incomplete_tail(data: &[u8]) -> usize {
    for back in 1..=3.min(data.len()) {
        let b = data[data.len() - back];
        let needs = match b {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            0x80..=0xBF => continue,
            _ => return 0,
        };
        return if needs > back { back } else { 0 };
    }
    0
}

/// What an exec request asks, parsed from its query.
struct ExecQuery {
    req: ExecRequest,
    timeout: Option<Duration>,
    encoding: StdioEncoding,
    buffered: bool,
    /// `background=true`: detached, with rings of this size (`None`: the
    /// agent's default).
    background: Option<Option<u64>>,
}

fn exec_query(uri: &Uri) -> ApiResult<ExecQuery> {
    let q = query_pairs(uri);
    query_only(
        &q,
        &[
            "cmd",
            "args",
            "env",
            "uid",
            "gid",
            "cwd",
            "shell",
            "timeout",
            "stdin",
            "stdio",
            "buffered",
            "permissions",
            "background",
            "ring_bytes",
        ],
    )?;
    if let Some(p) = query_get(&q, "permissions").filter(|p| !p.is_empty()) {
        return Err(ApiError::bad_request(format!(
            "`permissions={p}` on exec is not supported: tine gives it no meaning there; set a file's mode with cp's `permissions`"
        )));
    }
    let cmd = query_get(&q, "cmd")
        .filter(|c| !c.is_empty())
        .ok_or_else(|| ApiError::bad_request("`cmd` is required"))?
        .to_owned();
    let args: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "args")
        .map(|(_, v)| v.clone())
        .collect();
    if cmd == SLICER_AGENT && args.first().is_some_and(|a| a == "upload") {
        return Err(ApiError::bad_request(format!(
            "`{SLICER_AGENT} upload` is Slicer's chunked-copy helper, which tine guests do not have: \
             chunked copy (SupportsChunkedCopy, CpToVMChunked) is not supported; \
             cp (CpToVM) copies the same file or directory in one request"
        )));
    }
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
    options.cwd = query_get(&q, "cwd")
        .filter(|c| !c.is_empty())
        .map(str::to_owned);
    let stdin = query_bool(&q, "stdin")?.unwrap_or(false);
    let buffered = query_bool(&q, "buffered")?.unwrap_or(false);
    if stdin && buffered {
        return Err(ApiError::bad_request(
            "a buffered exec takes no stdin; use the streamed exec (no `buffered`) to send stdin",
        ));
    }
    let encoding: StdioEncoding = super::params::parse_query_enum(&q, "stdio")?.unwrap_or_default();
    let ring_bytes: Option<u64> = query_num(&q, "ring_bytes")?;
    let background = match query_bool(&q, "background")?.unwrap_or(false) {
        true if stdin || buffered => {
            return Err(ApiError::bad_request(
                "a background exec takes no stdin and is not buffered; read its output from /exec/{id}/logs",
            ))
        }
        true => Some(ring_bytes.filter(|r| *r > 0)),
        false if ring_bytes.is_some() => {
            return Err(ApiError::bad_request("`ring_bytes` needs `background=true`"))
        }
        false => None,
    };
    let timeout = query_get(&q, "timeout")
        .map(|t| parse_timeout(Some(t), Duration::ZERO))
        .transpose()?;
    let command = match shell_choice(query_get(&q, "shell"))? {
        Some(interpreter) => {
            let mut script = cmd;
            for a in &args {
                script.push(' ');
                script.push_str(a);
            }
            Command::Shell {
                script,
                interpreter,
            }
        }
        None => {
            let mut argv = vec![cmd];
            argv.extend(args);
            Command::Argv(argv)
        }
    };
    Ok(ExecQuery {
        req: ExecRequest {
            command,
            options,
            stdin,
            timeout_ms: timeout.map(|t| t.as_millis().min(u128::from(u64::MAX)) as u64),
            background: None,
        },
        timeout,
        encoding,
        buffered,
        background,
    })
}

pub(super) async fn exec(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
    body: Body,
) -> ApiResult<Response> {
    let q = exec_query(&uri)?;
    let client = agent(&d, &hostname).await?;
    if let Some(ring_bytes) = q.background {
        return super::bg::start(client, q.req, ring_bytes).await;
    }
    if q.buffered {
        let result = exec_buffered(client, q.req, q.timeout, q.encoding, DEADLINES).await?;
        return Ok(Json(result).into_response());
    }
    exec_stream(client, q.req, q.timeout, q.encoding, body, DEADLINES).await
}

/// The error of an exec that did not start.
fn start_err(e: ClientError) -> ApiError {
    call_err(e, |msg| {
        if msg.contains("not found") || msg.contains("No such file") || msg.contains("spawn") {
            ApiError::bad_request(msg)
        } else {
            ApiError::agent(msg)
        }
    })
}

/// Runs `req` to its end and answers once, with its output (at most
/// [`MAX_BUFFERED_OUTPUT`] of each stream). A run that does not end is an
/// error: 408 past the host's limit (`timeout` plus grace), 503 when the
/// agent goes away.
async fn exec_buffered(
    client: AgentClient,
    req: ExecRequest,
    timeout: Option<Duration>,
    encoding: StdioEncoding,
    deadlines: Deadlines,
) -> ApiResult<ExecResult> {
    let mut execution = client.exec(req).await.map_err(start_err)?;
    let pid = execution.pid();
    let limit = timeout.and_then(|t| t.checked_add(deadlines.exec_grace));
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut truncated = false;
    let collect = async {
        loop {
            match execution.next_event().await {
                Ok(Some(ExecEvent::Stdout(data))) => {
                    truncated |= keep_bounded(&mut stdout, &data);
                }
                Ok(Some(ExecEvent::Stderr(data))) => {
                    truncated |= keep_bounded(&mut stderr, &data);
                }
                Ok(Some(ExecEvent::Exit(s))) => return Ok(s),
                Ok(None) => {
                    return Err(ApiError::agent(
                        "the agent closed the stream before the process ended",
                    ))
                }
                Err(e) => return Err(agent_err(e)),
            }
        }
    };
    let status = match limit {
        None => collect.await?,
        Some(limit) => tokio::time::timeout(limit, collect).await.map_err(|_| {
            ApiError::timeout(format!(
                "the command ran past its timeout and the agent did not end it; the host gave up after {}",
                millis(limit)
            ))
        })??,
    };
    let _client = client;
    let (exit_code, signal, signal_number) = exit_fields(&status);
    let mut out = OutputEncoder::new(encoding);
    let mut text = out.encode(&stdout);
    text.push_str(&out.finish());
    let mut err = OutputEncoder::new(encoding);
    let mut err_text = err.encode(&stderr);
    err_text.push_str(&err.finish());
    Ok(ExecResult {
        stdout: text,
        stderr: err_text,
        encoding,
        pid,
        exit_code,
        signal,
        signal_number,
        timed_out: status.timed_out,
        duration_ms: status.duration_ms,
        truncated,
    })
}

/// Appends `data` to `buf` up to [`MAX_BUFFERED_OUTPUT`]; true when some
/// was dropped.
fn keep_bounded(buf: &mut Vec<u8>, data: &[u8]) -> bool {
    let room = MAX_BUFFERED_OUTPUT.saturating_sub(buf.len());
    buf.extend_from_slice(&data[..data.len().min(room)]);
    data.len() > room
}

/// Starts `req` and answers with its NDJSON frames. With a `timeout`, the
/// host ends the exec `exec_grace` after it with an `error` frame (code
/// `timeout`) if the agent has not reported the exit by then.
async fn exec_stream(
    client: AgentClient,
    req: ExecRequest,
    timeout: Option<Duration>,
    encoding: StdioEncoding,
    body: Body,
    deadlines: Deadlines,
) -> ApiResult<Response> {
    let stdin = req.stdin;
    let mut execution = client.exec(req).await.map_err(start_err)?;
    let give_up = timeout.and_then(|t| {
        let limit = t.checked_add(deadlines.exec_grace)?;
        Some((tokio::time::Instant::now().checked_add(limit)?, t, limit))
    });
    let pid = execution.pid();
    let mut feeder = None;
    if stdin {
        let control = execution.control();
        feeder = Some(tokio::spawn(async move {
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
                if let Err(e) = control.close_stdin().await {
                    tracing::debug!("exec: cannot close the process's stdin: {e}");
                }
            }
        }));
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    tokio::spawn(async move {
        // Keep the connection (and so the process's streams) alive until
        // the exit frame is sent.
        let _client = client;
        let mut out = OutputEncoder::new(encoding);
        let mut err = OutputEncoder::new(encoding);
        if tx
            .send(Ok(frame_line(&ExecFrame::Started { pid })))
            .await
            .is_err()
        {
            return;
        }
        loop {
            let event = match give_up {
                None => execution.next_event().await,
                Some((at, timeout, limit)) => {
                    match tokio::time::timeout_at(at, execution.next_event()).await {
                        Ok(event) => event,
                        Err(_) => {
                            let error = format!(
                                "the command ran past its timeout of {} and the agent did not end it; the host gave up after {}",
                                millis(timeout),
                                millis(limit)
                            );
                            let frame = ExecFrame::Error {
                                error,
                                code: ErrorCode::Timeout,
                            };
                            if tx.send(Ok(frame_line(&frame))).await.is_err() {
                                tracing::debug!("exec: the client left before its timeout frame");
                            }
                            // Every handle of the stream must go for the
                            // agent to see it closed (and kill the process).
                            if let Some(feeder) = feeder.take() {
                                feeder.abort();
                            }
                            return;
                        }
                    }
                }
            };
            let frame = match event {
                Ok(Some(ExecEvent::Stdout(data))) => ExecFrame::Stdout {
                    data: out.encode(&data),
                    encoding,
                },
                Ok(Some(ExecEvent::Stderr(data))) => ExecFrame::Stderr {
                    data: err.encode(&data),
                    encoding,
                },
                Ok(Some(ExecEvent::Exit(s))) => {
                    // Text cut at the very end goes out before the exit.
                    for (rest, stdout) in [(out.finish(), true), (err.finish(), false)] {
                        if rest.is_empty() {
                            continue;
                        }
                        let frame = if stdout {
                            ExecFrame::Stdout {
                                data: rest,
                                encoding,
                            }
                        } else {
                            ExecFrame::Stderr {
                                data: rest,
                                encoding,
                            }
                        };
                        if tx.send(Ok(frame_line(&frame))).await.is_err() {
                            return;
                        }
                    }
                    let (exit_code, signal, signal_number) = exit_fields(&s);
                    ExecFrame::Exit {
                        exit_code,
                        signal,
                        signal_number,
                        timed_out: s.timed_out,
                        duration_ms: s.duration_ms,
                    }
                }
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

/// Parses a cp query. The mode is checked first: Slicer's Go SDK asks for
/// its `cp-v1-*` modes (with their extra query keys) and falls back to the
/// plain `binary`/`tar` when the 400 says `invalid mode: <mode>`.
fn cp_query(uri: &Uri, allowed: &[&str]) -> ApiResult<CpQuery> {
    let q = query_pairs(uri);
    let tar = match query_get(&q, "mode") {
        None | Some("binary") => false,
        Some("tar") => true,
        Some(m) => {
            return Err(ApiError::bad_request(format!(
                "invalid mode: {m} (tine copies in mode binary or tar)"
            )))
        }
    };
    query_only(&q, allowed)?;
    if let Some((_, pattern)) = q.iter().find(|(k, _)| k == "exclude") {
        if !tar {
            return Err(ApiError::bad_request(format!(
                "`exclude={pattern}` applies to mode=tar (a binary copy is one file)"
            )));
        }
    }
    let path = query_get(&q, "path")
        .filter(|p| p.starts_with('/'))
        .ok_or_else(|| ApiError::bad_request("`path` is required and must be absolute"))?
        .to_owned();
    Ok((q, path, tar))
}

pub(super) async fn download(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Response> {
    let (q, path, tar) = cp_query(&uri, &["path", "mode", "exclude"])?;
    let client = agent(&d, &hostname).await?;
    let mut file_mode = None;
    if !tar {
        // Fail before the body starts when the file is not there.
        let stat = client
            .stat(&path, true)
            .await
            .map_err(|e| call_err(e, |msg| ApiError::not_found(format!("{path}: {msg}"))))?;
        if stat.kind != tine_proto::agent::FileKind::File {
            return Err(ApiError::bad_request(format!(
                "{path} is not a regular file; use mode=tar for a directory"
            )));
        }
        // Permission bits only: an SDK gives its local copy this mode, and
        // a guest's setuid, setgid or sticky bit must not reach the host.
        file_mode = Some(stat.mode & 0o777);
    }
    let content_type = if tar {
        "application/x-tar"
    } else {
        "application/octet-stream"
    };
    let mut response = (
        [(header::CONTENT_TYPE, content_type)],
        download_body(client, path, tar, query_all(&q, "exclude")),
    )
        .into_response();
    if let Some(mode) = file_mode {
        // Slicer's header: Go's ReadFile returns it, and CpFromVM gives the
        // local copy this mode when the caller names none.
        if let Ok(value) = header::HeaderValue::from_str(&format!("{mode:04o}")) {
            response.headers_mut().insert(FILE_MODE_HEADER, value);
        }
    }
    Ok(response)
}

/// The guest file's permission bits (octal) on a binary download.
const FILE_MODE_HEADER: &str = "x-slicer-file-mode";

/// The body of a download: the agent's bytes, then an error in the body
/// stream if the download failed (the agent's error, fewer bytes than it
/// announced, the cap passed, a stall). The error makes hyper abort the
/// response, so the client sees a broken transfer, never a short success.
fn download_body(client: AgentClient, path: String, tar: bool, exclude: Vec<String>) -> Body {
    let (writer, reader) = tokio::io::duplex(256 * 1024);
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        // `writer` is gone when the call returns: the reader ends, then
        // reads the result.
        let result = if tar {
            client
                .download_tar_excluding(&path, &exclude, writer)
                .await
                .map(|_| ())
        } else {
            client.download(&path, writer).await.map(|_| ())
        };
        if let Err(e) = &result {
            tracing::warn!("download {path}: {e}");
        }
        if done_tx
            .send(result.map_err(|e| format!("download {path}: {e}")))
            .is_err()
        {
            tracing::debug!("download {path}: the client left before its end");
        }
    });
    let end = futures_util::stream::once(async move {
        match done_rx.await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(Err(std::io::Error::other(e))),
            Err(_) => Some(Err(std::io::Error::other(
                "the download ended without a result",
            ))),
        }
    })
    .filter_map(std::future::ready);
    Body::from_stream(ReaderStream::new(reader).chain(end))
}

pub(super) async fn upload(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
    body: Body,
) -> ApiResult<Json<CpResponse>> {
    let (q, path, tar) = cp_query(
        &uri,
        &["path", "mode", "permissions", "uid", "gid", "exclude"],
    )?;
    let mode = query_get(&q, "permissions")
        .filter(|m| !m.is_empty())
        .map(|m| {
            u32::from_str_radix(m.trim_start_matches("0o"), 8)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| {
                    ApiError::bad_request(format!("permissions `{m}` is not octal like 0644"))
                })
        })
        .transpose()?;
    if tar && mode.is_some() {
        return Err(ApiError::bad_request(
            "`permissions` applies to one file (mode=binary); a tar carries each entry's mode",
        ));
    }
    let uid = query_num(&q, "uid")?;
    let gid = query_num(&q, "gid")?;
    let client = agent(&d, &hostname).await?;
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
                    exclude: query_all(&q, "exclude"),
                },
                reader,
            )
            .await
            .map_err(|e| call_err(e, ApiError::bad_request))?;
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
            .map_err(|e| call_err(e, ApiError::bad_request))?;
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
    query_only(&q, &["rows", "cols", "cwd", "uid", "gid", "shell", "term"])?;
    let options = ProcessOptions {
        cwd: query_get(&q, "cwd").map(str::to_owned),
        uid: query_num(&q, "uid")?,
        gid: query_num(&q, "gid")?,
        ..ProcessOptions::default()
    };
    let req = ShellRequest {
        argv: query_get(&q, "shell").map(|s| vec![s.to_owned()]),
        options,
        rows: query_num(&q, "rows")?.unwrap_or(24),
        cols: query_num(&q, "cols")?.unwrap_or(80),
        term: query_get(&q, "term").map(str::to_owned),
    };
    let client = agent(&d, &hostname).await?;
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
            match shell_frames::input(&data) {
                shell_frames::Input::Data(bytes) => {
                    if let Err(e) = control.write(bytes).await {
                        tracing::debug!("shell input not delivered, the session ended: {e}");
                        break;
                    }
                }
                shell_frames::Input::Resize { rows, cols } => {
                    if let Err(e) = control.resize(rows, cols).await {
                        tracing::debug!("shell resize not delivered: {e}");
                    }
                }
                shell_frames::Input::Shutdown => break,
                shell_frames::Input::Ignored => {}
            }
        }
        // The client left: hang up the terminal.
        if let Err(e) = control.signal(libc::SIGHUP).await {
            tracing::debug!("cannot hang up the shell (it may have ended): {e}");
        }
    });
    loop {
        match session.next_event().await {
            Ok(Some(ShellEvent::Output(data))) => {
                let msg = shell_frames::encode(shell_frames::DATA, &data);
                if sink.send(Message::Binary(msg.into())).await.is_err() {
                    break;
                }
            }
            Ok(Some(ShellEvent::Exit(s))) => {
                let code = shell_exit_code(&s).to_be_bytes();
                let msg = shell_frames::encode(shell_frames::SESSION_CLOSE, &code);
                if let Err(e) = sink.send(Message::Binary(msg.into())).await {
                    tracing::debug!("shell: cannot send the session's exit status: {e}");
                }
                break;
            }
            Ok(None) | Err(_) => break,
        }
    }
    if let Err(e) = sink.send(Message::Close(None)).await {
        tracing::debug!("shell: cannot close the WebSocket: {e}");
    }
    input.abort();
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

/// Parses Slicer's `X-Inlets-Upstream` value: `HOST:PORT`, `PORT` or
/// `unix:PATH`.
pub fn parse_upstream(value: &str) -> ApiResult<ForwardTarget> {
    let target = if value.starts_with("unix:") {
        parse_target(value)
    } else {
        parse_target(&format!("tcp:{value}"))
    };
    target.map_err(|_| {
        ApiError::bad_request(format!(
            "X-Inlets-Upstream `{value}` is not HOST:PORT, PORT or unix:/PATH"
        ))
    })
}

/// Where a forward goes: `target=` (tine's form) or the `X-Inlets-Upstream`
/// header (Slicer's SDKs); both must agree when both are given.
fn forward_target(q: &[(String, String)], headers: &HeaderMap) -> ApiResult<ForwardTarget> {
    let header = headers
        .get("x-inlets-upstream")
        .map(|v| {
            v.to_str()
                .map_err(|_| ApiError::bad_request("X-Inlets-Upstream is not text"))
        })
        .transpose()?
        .map(parse_upstream)
        .transpose()?;
    let query = query_get(q, "target").map(parse_target).transpose()?;
    match (query, header) {
        (Some(a), Some(b)) if a != b => Err(ApiError::bad_request(
            "`target` and X-Inlets-Upstream name different targets; give one",
        )),
        (Some(t), _) | (None, Some(t)) => Ok(t),
        (None, None) => Err(ApiError::bad_request(
            "`target` (or an X-Inlets-Upstream header) is required",
        )),
    }
}

pub(super) async fn forward(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> ApiResult<Response> {
    let q = query_pairs(&uri);
    query_only(&q, &["target"])?;
    let target = forward_target(&q, &headers)?;
    let client = agent(&d, &hostname).await?;
    let mut fwd = client
        .forward(target)
        .await
        .map_err(|e| call_err(e, |msg| ApiError::bad_request(format!("forward: {msg}"))))?;
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
                        if let Err(e) = fwd.shutdown_write().await {
                            tracing::debug!("port forward: cannot end the guest's input: {e}");
                        }
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
        if let Err(e) = sink.send(Message::Close(None)).await {
            tracing::debug!("port forward: cannot close the WebSocket: {e}");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tine_client::agent::Limits;
    use tine_proto::agent::Response as AgentResponse;
    use tine_proto::agent::{Channel, ErrorCode as AgentCode, Request};
    use tine_testbed::hostile_agent::{HostileAgent, Step};

    /// Short deadlines, so a test of a hung agent is quick.
    const FAST: Deadlines = Deadlines {
        reply: Duration::from_millis(300),
        transfer: Duration::from_millis(300),
        exec_grace: Duration::from_millis(300),
        download_bytes: 1 << 20,
    };
    /// Longer than any deadline here: what is still waiting then hangs.
    const HANG: Duration = Duration::from_secs(10);

    async fn connect(agent: &HostileAgent, limits: Limits) -> AgentClient {
        let io = agent.connect().expect("socket pair");
        AgentClient::handshake(io)
            .await
            .expect("handshake")
            .with_limits(limits)
    }

    /// The data of a body until its end or its first error.
    async fn read_body(body: Body) -> (Vec<u8>, Option<String>) {
        let mut stream = body.into_data_stream();
        let mut data = Vec::new();
        loop {
            match tokio::time::timeout(HANG, stream.next()).await {
                Err(_) => panic!("the body hangs"),
                Ok(None) => return (data, None),
                Ok(Some(Ok(chunk))) => data.extend_from_slice(&chunk),
                Ok(Some(Err(e))) => return (data, Some(e.to_string())),
            }
        }
    }

    #[tokio::test]
    async fn a_hung_health_answer_ends_at_its_deadline() {
        let agent = HostileAgent::new(|_| vec![Step::Hang]);
        for (waited, code) in [
            (false, ErrorCode::AgentUnavailable),
            (true, ErrorCode::Timeout),
        ] {
            let client = connect(&agent, Limits::default()).await;
            let began = Instant::now();
            let answer = health_answer(&client, "vm-1".into());
            let err = answer_within(FAST.reply, waited, "vm-1", answer)
                .await
                .expect_err("hung");
            assert_eq!(err.code, code, "{err:?}");
            assert!(
                err.message.contains("did not answer within 300ms"),
                "{err:?}"
            );
            assert!(began.elapsed() < HANG);
        }
    }

    #[tokio::test]
    async fn an_exec_past_its_timeout_is_ended_by_the_host() {
        let agent = HostileAgent::new(|request| match request {
            Request::Exec(_) => vec![Step::Reply(AgentResponse::Started { pid: 42 }), Step::Hang],
            _ => vec![],
        });
        let client = connect(&agent, FAST.limits()).await;
        let timeout = Duration::from_millis(300);
        let req = ExecRequest::argv(["sleep", "100"])
            .with_stdin()
            .timeout(timeout);
        // Stdin that never ends: its feeder must not keep the exec alive.
        let stdin = futures_util::stream::pending::<Result<Bytes, std::io::Error>>();
        let began = Instant::now();
        let response = exec_stream(
            client,
            req,
            Some(timeout),
            StdioEncoding::Base64,
            Body::from_stream(stdin),
            FAST,
        )
        .await
        .expect("started");
        let (body, err) = read_body(response.into_body()).await;
        assert_eq!(err, None);
        let frames: Vec<ExecFrame> = body
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).expect("frame"))
            .collect();
        assert_eq!(frames.first(), Some(&ExecFrame::Started { pid: 42 }));
        match frames.last() {
            Some(ExecFrame::Error { code, error }) => {
                assert_eq!(*code, ErrorCode::Timeout);
                assert!(error.contains("gave up after 600ms"), "{error}");
            }
            other => panic!("last frame {other:?}"),
        }
        assert!(began.elapsed() >= timeout + FAST.exec_grace);
        assert!(
            agent.wait_closed_by_host(1, HANG).await,
            "the host kept the exec's stream open"
        );
    }

    #[tokio::test]
    async fn an_exec_that_never_starts_fails_at_the_reply_deadline() {
        let agent = HostileAgent::new(|_| vec![Step::Hang]);
        let client = connect(&agent, FAST.limits()).await;
        let req = ExecRequest::argv(["true"]);
        let err = tokio::time::timeout(
            HANG,
            exec_stream(client, req, None, StdioEncoding::Text, Body::empty(), FAST),
        )
        .await
        .expect("the deadline ends it")
        .expect_err("never started");
        assert_eq!(err.code, ErrorCode::AgentUnavailable, "{err:?}");
    }

    /// A fresh connection to an agent answering downloads with `steps`.
    async fn download_agent(steps: Vec<Step>) -> AgentClient {
        let agent = HostileAgent::new(move |request| match request {
            Request::Download(_) | Request::DownloadTar(_) => steps.clone(),
            _ => vec![Step::Hang],
        });
        connect(&agent, FAST.limits()).await
    }

    #[tokio::test]
    async fn a_cut_short_download_aborts_its_body() {
        let eight = || Step::Data(Channel::Data, b"8 bytes!".to_vec());
        let cases = [
            (
                "agent error",
                false,
                vec![
                    Step::file_info(1_000_000),
                    eight(),
                    Step::Reply(AgentResponse::error(AgentCode::Io, "disk gone")),
                ],
            ),
            (
                "short stream",
                false,
                vec![
                    Step::file_info(1_000_000),
                    eight(),
                    Step::Eof(Channel::Data),
                    Step::Reply(AgentResponse::Ok),
                ],
            ),
            (
                "stall",
                false,
                vec![Step::file_info(1_000_000), eight(), Step::Hang],
            ),
            (
                "connection lost",
                true,
                vec![
                    eight(),
                    Step::Sleep(Duration::from_millis(50)),
                    Step::Disconnect,
                ],
            ),
            (
                "endless",
                true,
                vec![Step::Endless(Channel::Data, 64 << 10)],
            ),
        ];
        for (what, tar, steps) in cases {
            let client = download_agent(steps).await;
            let (data, err) = read_body(download_body(client, "/f".into(), tar, Vec::new())).await;
            assert!(err.is_some(), "{what}: the body ended cleanly");
            assert!(data.len() as u64 <= FAST.download_bytes, "{what}");
        }
        let honest = vec![
            Step::file_info(5),
            Step::Data(Channel::Data, b"hello".to_vec()),
            Step::Eof(Channel::Data),
            Step::Reply(AgentResponse::Ok),
        ];
        let client = download_agent(honest).await;
        let (data, err) = read_body(download_body(client, "/f".into(), false, Vec::new())).await;
        assert_eq!((data.as_slice(), err), (&b"hello"[..], None));
    }

    #[tokio::test]
    async fn a_cut_short_download_is_an_error_for_the_http_client() {
        use tine_client::api::CpMode;
        let dir = tempfile::tempdir().expect("tmp");
        let socket = dir.path().join("api.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        let app = axum::Router::new().route(
            "/vm/{hostname}/cp",
            axum::routing::get(|uri: Uri| async move {
                let short = uri.query().is_some_and(|q| q.contains("short"));
                let mut steps = vec![Step::file_info(if short { 1_000_000 } else { 8 })];
                steps.extend([
                    Step::Data(Channel::Data, b"8 bytes!".to_vec()),
                    Step::Eof(Channel::Data),
                    Step::Reply(AgentResponse::Ok),
                ]);
                let client = download_agent(steps).await;
                download_body(client, "/f".into(), false, Vec::new())
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        let api = tine_client::TineClient::unix(&socket);
        let mut got = Vec::new();
        let download = api
            .cp_download("vm-1", "/short", CpMode::Binary)
            .await
            .expect("the answer starts");
        let err = tokio::time::timeout(HANG, download.copy_to(&mut got))
            .await
            .expect("no hang")
            .expect_err("a short download is not a success");
        assert!(got.len() <= 8, "{err}");
        let mut got = Vec::new();
        let n = api
            .cp_download("vm-1", "/whole", CpMode::Binary)
            .await
            .expect("the answer starts")
            .copy_to(&mut got)
            .await
            .expect("a whole download");
        assert_eq!((n, got.as_slice()), (8, &b"8 bytes!"[..]));
    }

    #[test]
    fn text_output_keeps_a_character_cut_between_chunks() {
        let mut enc = OutputEncoder::new(StdioEncoding::Text);
        let bytes = "aé€😀".as_bytes();
        // Every split point: the text comes out whole, never U+FFFD.
        for cut in 0..=bytes.len() {
            let mut text = enc.encode(&bytes[..cut]);
            text.push_str(&enc.encode(&bytes[cut..]));
            text.push_str(&enc.finish());
            assert_eq!(text, "aé€😀", "cut at {cut}");
        }
        // Bytes that are not UTF-8 become U+FFFD, at once or at the end.
        assert_eq!(enc.encode(b"x\xffy"), "x\u{fffd}y");
        assert_eq!(enc.encode(b"z\xe2\x82"), "z");
        assert_eq!(enc.finish(), "\u{fffd}");
        let mut b64 = OutputEncoder::new(StdioEncoding::Base64);
        assert_eq!(b64.encode(b"\xff\xfe"), "//4=");
        assert_eq!(b64.finish(), "");
    }

    #[test]
    fn exit_fields_never_report_a_killed_process_as_success() {
        let status = |code, signal| tine_proto::agent::ExitStatus {
            code,
            signal,
            ..Default::default()
        };
        assert_eq!(exit_fields(&status(Some(0), None)), (0, None, None));
        assert_eq!(
            exit_fields(&status(None, Some(9))),
            (137, Some("SIGKILL".into()), Some(9))
        );
        // A number that is no signal keeps its number, with no name.
        assert_eq!(exit_fields(&status(None, Some(99))), (227, None, Some(99)));
    }

    #[test]
    fn forward_takes_slicers_upstream_header() {
        let headers = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("x-inlets-upstream", v.parse().expect("header"));
            h
        };
        let tcp = |host: &str, port| ForwardTarget::Tcp {
            port,
            host: Some(host.into()),
        };
        let none: Vec<(String, String)> = Vec::new();
        assert_eq!(
            forward_target(&none, &headers("127.0.0.1:8080")).expect("tcp"),
            tcp("127.0.0.1", 8080)
        );
        assert_eq!(
            forward_target(&none, &headers("unix:/var/run/docker.sock")).expect("unix"),
            ForwardTarget::Unix {
                path: "/var/run/docker.sock".into()
            }
        );
        let q = vec![("target".to_string(), "tcp:127.0.0.1:8080".to_string())];
        assert_eq!(
            forward_target(&q, &headers("127.0.0.1:8080")).expect("agree"),
            tcp("127.0.0.1", 8080)
        );
        let e = forward_target(&q, &headers("127.0.0.1:9090")).expect_err("disagree");
        assert!(e.message.contains("different targets"), "{}", e.message);
        let e = forward_target(&none, &headers("nowhere")).expect_err("bad");
        assert!(
            e.message.contains("X-Inlets-Upstream `nowhere`"),
            "{}",
            e.message
        );
        let e = forward_target(&none, &HeaderMap::new()).expect_err("none");
        assert!(e.message.contains("X-Inlets-Upstream header) is required"));
    }

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
