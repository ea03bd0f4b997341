//! Background execs (Slicer's `background=true` and `/vm/{h}/exec/{id}/*`):
//! detached processes whose output the agent keeps in rings.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use tine_client::agent::{ClientError, LogEvent};
use tine_client::AgentClient;
use tine_proto::agent::{BgJob, BgLogsRequest, ErrorCode as AgentCode, ExecRequest};
use tine_proto::api::{
    self, BgDeleteResponse, BgExecInfo, BgExecResponse, BgKillRequest, BgKillResponse, BgLogFrame,
    BgWaitResponse, StdioEncoding,
};

use super::agent_call::{agent, call_err, exit_fields};
use super::params::AppState;
use super::params::{
    parse_json, parse_timeout, query_bool, query_get, query_num, query_only, query_pairs,
};
use crate::error::{ApiError, ApiResult};

/// Default grace before a kill escalates to `SIGKILL`.
const DEFAULT_GRACE_MS: u64 = 5000;

/// How long a kill waits for `SIGKILL` to end the process before it
/// answers (still running past it: `running: true`).
const KILL_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

fn bg_err(id: u64, e: ClientError) -> ApiError {
    match e.code() {
        Some(AgentCode::NotFound) => ApiError::not_found(format!("no background exec {id}: {e}")),
        Some(AgentCode::Timeout) => ApiError::timeout(format!("background exec {id}: {e}")),
        Some(_) => ApiError::conflict(format!("background exec {id}: {e}")),
        None => call_err(e, |msg| {
            ApiError::agent(format!("background exec {id}: {msg}"))
        }),
    }
}

fn exec_id(id: &str) -> ApiResult<u64> {
    id.parse()
        .map_err(|_| ApiError::not_found(format!("no background exec `{id}` (ids are numbers)")))
}

fn info(job: &BgJob) -> BgExecInfo {
    let (exit_code, signal) = match &job.exit {
        Some(s) => {
            let (code, signal, _) = exit_fields(s);
            (Some(code), signal)
        }
        None => (None, None),
    };
    let dropped = job.stdout_bytes.saturating_sub(job.ring_bytes)
        + job.stderr_bytes.saturating_sub(job.ring_bytes);
    BgExecInfo {
        exec_id: job.id.to_string(),
        pid: job.pid,
        command: job.command.clone(),
        started_at: api::rfc3339_millis(job.started_unix_ms),
        running: job.exit.is_none(),
        exit_code,
        signal,
        bytes_written: job.stdout_bytes + job.stderr_bytes,
        bytes_dropped: dropped,
        ring_bytes: job.ring_bytes,
        stdout_bytes: job.stdout_bytes,
        stderr_bytes: job.stderr_bytes,
        next_id: job.next_id,
    }
}

async fn job(client: &AgentClient, id: u64) -> ApiResult<BgJob> {
    client
        .bg_list()
        .await
        .map_err(|e| bg_err(id, e))?
        .into_iter()
        .find(|j| j.id == id)
        .ok_or_else(|| ApiError::not_found(format!("no background exec {id}")))
}

/// Starts `req` detached, its output kept in rings of `ring_bytes`.
pub(super) async fn start(
    client: AgentClient,
    req: ExecRequest,
    ring_bytes: Option<u64>,
) -> ApiResult<Response> {
    let (id, pid) = client
        .exec_background(req, ring_bytes)
        .await
        .map_err(|e| call_err(e, ApiError::bad_request))?;
    let job = job(&client, id).await?;
    Ok(Json(BgExecResponse {
        exec_id: id.to_string(),
        pid,
        started_at: api::rfc3339_millis(job.started_unix_ms),
        ring_bytes: job.ring_bytes,
    })
    .into_response())
}

pub(super) async fn list(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
) -> ApiResult<Json<Vec<BgExecInfo>>> {
    let client = agent(&d, &hostname).await?;
    let jobs = client.bg_list().await.map_err(|e| bg_err(0, e))?;
    Ok(Json(jobs.iter().map(info).collect()))
}

pub(super) async fn get(
    State(d): State<AppState>,
    Path((hostname, id)): Path<(String, String)>,
) -> ApiResult<Json<BgExecInfo>> {
    let id = exec_id(&id)?;
    let client = agent(&d, &hostname).await?;
    Ok(Json(info(&job(&client, id).await?)))
}

pub(super) async fn remove(
    State(d): State<AppState>,
    Path((hostname, id)): Path<(String, String)>,
) -> ApiResult<Json<BgDeleteResponse>> {
    let id = exec_id(&id)?;
    let client = agent(&d, &hostname).await?;
    client.bg_remove(id).await.map_err(|e| bg_err(id, e))?;
    Ok(Json(BgDeleteResponse {
        exec_id: id.to_string(),
        reaped: true,
    }))
}

/// A signal by name (`TERM`, `SIGTERM`) or number.
fn signal(name: &str) -> ApiResult<nix::sys::signal::Signal> {
    use std::str::FromStr;
    let upper = name.trim().to_ascii_uppercase();
    let parsed = match upper.parse::<i32>() {
        Ok(n) => nix::sys::signal::Signal::try_from(n).ok(),
        Err(_) if upper.starts_with("SIG") => nix::sys::signal::Signal::from_str(&upper).ok(),
        Err(_) => nix::sys::signal::Signal::from_str(&format!("SIG{upper}")).ok(),
    };
    parsed.ok_or_else(|| {
        ApiError::bad_request(format!(
            "signal `{name}` is not a signal name like TERM or KILL"
        ))
    })
}

pub(super) async fn kill(
    State(d): State<AppState>,
    Path((hostname, id)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Json<BgKillResponse>> {
    let id = exec_id(&id)?;
    let req: BgKillRequest = parse_json(&body)?;
    let sig = signal(req.signal.as_deref().unwrap_or("TERM"))?;
    let grace = std::time::Duration::from_millis(req.grace_ms.unwrap_or(DEFAULT_GRACE_MS));
    let client = agent(&d, &hostname).await?;
    let before = job(&client, id).await?;
    client
        .bg_kill(id, sig as i32)
        .await
        .map_err(|e| bg_err(id, e))?;
    let kill = nix::sys::signal::Signal::SIGKILL;
    let mut running = before.exit.is_none();
    if running && sig != kill && !grace.is_zero() {
        running = match client.bg_wait(id, Some(grace)).await {
            Ok(_) => false,
            Err(e) if e.code() == Some(AgentCode::Timeout) => {
                client
                    .bg_kill(id, kill as i32)
                    .await
                    .map_err(|e| bg_err(id, e))?;
                client.bg_wait(id, Some(KILL_WAIT)).await.is_err()
            }
            Err(e) => return Err(bg_err(id, e)),
        };
    } else if running && sig == kill {
        running = client.bg_wait(id, Some(KILL_WAIT)).await.is_err();
    } else if running {
        running = job(&client, id).await?.exit.is_none();
    }
    Ok(Json(BgKillResponse {
        exec_id: id.to_string(),
        pid: before.pid,
        running,
        signal_sent: sig.as_str().to_owned(),
    }))
}

pub(super) async fn wait_exit(
    State(d): State<AppState>,
    Path((hostname, id)): Path<(String, String)>,
    uri: Uri,
) -> ApiResult<Json<BgWaitResponse>> {
    let id = exec_id(&id)?;
    let q = query_pairs(&uri);
    query_only(&q, &["timeout"])?;
    let timeout = query_get(&q, "timeout")
        .map(|t| parse_timeout(Some(t), std::time::Duration::ZERO))
        .transpose()?;
    let client = agent(&d, &hostname).await?;
    let answer = |status: Option<&tine_proto::agent::ExitStatus>, timed_out| {
        let (exit_code, signal) = match status {
            Some(s) => {
                let (code, signal, _) = exit_fields(s);
                (Some(code), signal)
            }
            None => (None, None),
        };
        BgWaitResponse {
            exec_id: id.to_string(),
            running: status.is_none(),
            exit_code,
            signal,
            timed_out,
        }
    };
    match client.bg_wait(id, timeout).await {
        Ok(status) => Ok(Json(answer(Some(&status), false))),
        Err(e) if e.code() == Some(AgentCode::Timeout) => Ok(Json(answer(None, true))),
        Err(e) => Err(bg_err(id, e)),
    }
}

fn line(frame: &BgLogFrame) -> Bytes {
    let mut line = serde_json::to_vec(frame).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

pub(super) async fn logs(
    State(d): State<AppState>,
    Path((hostname, id)): Path<(String, String)>,
    uri: Uri,
) -> ApiResult<Response> {
    let id = exec_id(&id)?;
    let q = query_pairs(&uri);
    query_only(
        &q,
        &[
            "follow",
            "from_id",
            "stdout_from",
            "stderr_from",
            "tail_bytes",
        ],
    )?;
    let from_id = query_num::<u64>(&q, "from_id")?.filter(|f| *f > 0);
    let req = BgLogsRequest {
        id,
        stdout_from: query_num(&q, "stdout_from")?,
        stderr_from: query_num(&q, "stderr_from")?,
        tail_bytes: query_num(&q, "tail_bytes")?,
        follow: query_bool(&q, "follow")?.unwrap_or(false),
        from_id,
    };
    if from_id.is_some()
        && (req.stdout_from.is_some() || req.stderr_from.is_some() || req.tail_bytes.is_some())
    {
        return Err(ApiError::bad_request(
            "`from_id` is a frame cursor: give it without stdout_from, stderr_from or tail_bytes",
        ));
    }
    let client = agent(&d, &hostname).await?;
    let mut logs = client.bg_logs(req).await.map_err(|e| bg_err(id, e))?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    tokio::spawn(async move {
        let _client = client;
        let b64 = base64::engine::general_purpose::STANDARD;
        // The agent numbers its frames; one that does not (an older one)
        // gets them numbered here, per answer.
        let mut n = 0u64;
        let mut id_of = |given: u64| {
            n = if given > 0 { given } else { n + 1 };
            n
        };
        if logs.dropped_frames > 0 {
            let from = from_id.unwrap_or(1);
            let gap = BgLogFrame::Gap {
                id: from,
                dropped_frames: logs.dropped_frames,
                message: format!(
                    "frames {from} to {} are no longer in the ring",
                    from + logs.dropped_frames - 1
                ),
            };
            if tx.send(Ok(line(&gap))).await.is_err() {
                return;
            }
        }
        loop {
            let frame = match logs.next_event().await {
                Ok(Some(LogEvent::Stdout { id, data })) => BgLogFrame::Stdout {
                    id: id_of(id),
                    data: b64.encode(data),
                    encoding: StdioEncoding::Base64,
                },
                Ok(Some(LogEvent::Stderr { id, data })) => BgLogFrame::Stderr {
                    id: id_of(id),
                    data: b64.encode(data),
                    encoding: StdioEncoding::Base64,
                },
                Ok(Some(LogEvent::End(end))) => {
                    let id = id_of(end.next_id);
                    let frame = match &end.exit {
                        Some(s) => {
                            let (exit_code, signal, _) = exit_fields(s);
                            BgLogFrame::Exit {
                                id,
                                exit_code,
                                signal,
                                dropped_bytes: end.dropped,
                            }
                        }
                        None => BgLogFrame::End {
                            id,
                            dropped_bytes: end.dropped,
                            stdout_to: end.stdout_to,
                            stderr_to: end.stderr_to,
                        },
                    };
                    if tx.send(Ok(line(&frame))).await.is_err() {
                        tracing::debug!("background exec logs: the client left before the end");
                    }
                    return;
                }
                Ok(None) => return,
                Err(e) => {
                    // The body aborts: the client sees a cut stream.
                    if tx
                        .send(Err(std::io::Error::other(e.to_string())))
                        .await
                        .is_err()
                    {
                        tracing::debug!("background exec logs: the client left before {e}");
                    }
                    return;
                }
            };
            if tx.send(Ok(line(&frame))).await.is_err() {
                return;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response())
}
