//! `GET /vm/{hostname}/fs/watch`: the guest's file changes as Server-Sent
//! Events, the way Slicer's SDKs read them (`WatchFS`, `vm.fs.watch`):
//! each event is `id: N`, `event: watch` and `data: {json}`; a comment
//! line keeps an idle stream alive. The agent watches with inotify; the
//! host numbers the events, stops after `max_events` (`one_shot`: 1) or
//! `timeout`, and ends the body with an error when the agent goes away.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use tine_client::agent::ClientError;
use tine_proto::agent::{ErrorCode as AgentCode, WatchEvent, WatchEventKind, WatchRequest};
use tine_proto::api::{rfc3339_nanos, FsEventType, FsWatchEvent};

use super::agent_call::{agent, call_err};
use super::params::{
    parse_go_duration, parse_query_enum, query_all, query_bool, query_num, query_only, query_pairs,
    AppState,
};
use crate::error::{ApiError, ApiResult};

/// An idle stream gets a comment this often (proxies and the SDKs' HTTP
/// clients see it alive; a client that left is noticed).
const HEARTBEAT: Duration = Duration::from_secs(15);

/// What a watch request asks, parsed from its query and headers.
#[derive(Debug, PartialEq)]
struct WatchQuery {
    req: WatchRequest,
    max_events: Option<u64>,
    timeout: Option<Duration>,
    /// The first event's id is this plus 1.
    last_event_id: u64,
}

fn kind_of(t: FsEventType) -> WatchEventKind {
    match t {
        FsEventType::Create => WatchEventKind::Create,
        FsEventType::Write => WatchEventKind::Write,
        FsEventType::Remove => WatchEventKind::Remove,
        FsEventType::Rename => WatchEventKind::Rename,
        FsEventType::Chmod => WatchEventKind::Chmod,
        FsEventType::Overflow => WatchEventKind::Overflow,
    }
}

fn type_of(k: WatchEventKind) -> FsEventType {
    match k {
        WatchEventKind::Create => FsEventType::Create,
        WatchEventKind::Write => FsEventType::Write,
        WatchEventKind::Remove => FsEventType::Remove,
        WatchEventKind::Rename => FsEventType::Rename,
        WatchEventKind::Chmod => FsEventType::Chmod,
        WatchEventKind::Overflow => FsEventType::Overflow,
    }
}

fn watch_query(uri: &Uri, headers: &HeaderMap) -> ApiResult<WatchQuery> {
    let q = query_pairs(uri);
    query_only(
        &q,
        &[
            "paths",
            "patterns",
            "events",
            "uid",
            "recursive",
            "one_shot",
            "debounce",
            "timeout",
            "max_events",
        ],
    )?;
    let paths: Vec<String> = query_all(&q, "paths")
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .collect();
    if paths.is_empty() {
        return Err(ApiError::bad_request(
            "`paths` is required: one or more absolute paths (or ~/...) to watch",
        ));
    }
    let mut events = Vec::new();
    for value in query_all(&q, "events") {
        let one = [("events".to_owned(), value)];
        if let Some(t) = parse_query_enum::<FsEventType>(&one, "events")? {
            events.push(kind_of(t));
        }
    }
    let debounce = query_all(&q, "debounce")
        .first()
        .map(|v| parse_go_duration("debounce", v))
        .transpose()?
        .filter(|d| !d.is_zero());
    let timeout = query_all(&q, "timeout")
        .first()
        .map(|v| parse_go_duration("timeout", v))
        .transpose()?
        .filter(|d| !d.is_zero());
    let max_events = match query_num::<u64>(&q, "max_events")? {
        Some(0) => None,
        other => other,
    };
    let one_shot = query_bool(&q, "one_shot")?.unwrap_or(false);
    let max_events = if one_shot { Some(1) } else { max_events };
    let last_event_id = match headers.get("last-event-id") {
        None => 0,
        Some(v) => v
            .to_str()
            .ok()
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(|v| v.parse::<u64>())
            .transpose()
            .map_err(|_| {
                ApiError::bad_request(
                    "Last-Event-ID must be a number (the id of the last event seen)",
                )
            })?
            .unwrap_or(0),
    };
    Ok(WatchQuery {
        req: WatchRequest {
            paths,
            recursive: query_bool(&q, "recursive")?.unwrap_or(false),
            patterns: query_all(&q, "patterns")
                .into_iter()
                .filter(|p| !p.trim().is_empty())
                .collect(),
            events,
            uid: query_num(&q, "uid")?,
            debounce_ms: debounce.map(|d| d.as_millis().min(u128::from(u64::MAX)) as u64),
        },
        max_events,
        timeout,
        last_event_id,
    })
}

/// A refused watch: the agent's code as an HTTP status.
fn watch_err(e: ClientError) -> ApiError {
    match e.code() {
        Some(AgentCode::NotFound) => ApiError::not_found(format!("watch: {e}")),
        Some(AgentCode::UnknownOperation) => ApiError::agent(format!(
            "this VM's agent cannot watch files (rebuild its image): {e}"
        )),
        Some(_) => ApiError::bad_request(format!("watch: {e}")),
        None => call_err(e, |msg| ApiError::agent(format!("watch: {msg}"))),
    }
}

/// One event as an SSE message.
fn sse(id: u64, e: WatchEvent) -> Bytes {
    let event = FsWatchEvent {
        id,
        kind: type_of(e.kind),
        path: e.path,
        timestamp: rfc3339_nanos(e.unix_nanos),
        size: e.size,
        is_dir: e.is_dir,
        message: e.message,
    };
    let data = serde_json::to_string(&event).unwrap_or_default();
    Bytes::from(format!("id: {id}\nevent: watch\ndata: {data}\n\n"))
}

pub(super) async fn watch(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let q = watch_query(&uri, &headers)?;
    let client = agent(&d, &hostname).await?;
    let mut watch = client.watch(q.req).await.map_err(watch_err)?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        // The connection lives as long as the watch.
        let _client = client;
        let mut id = q.last_event_id;
        let mut sent = 0u64;
        let deadline = q.timeout.map(|t| tokio::time::Instant::now() + t);
        let mut heartbeat =
            tokio::time::interval_at(tokio::time::Instant::now() + HEARTBEAT, HEARTBEAT);
        loop {
            let timed_out = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                batch = watch.next_batch() => match batch {
                    Ok(Some(events)) => {
                        for e in events {
                            id = id.saturating_add(1);
                            if tx.send(Ok(sse(id, e))).await.is_err() {
                                return;
                            }
                            sent += 1;
                            if q.max_events.is_some_and(|max| sent >= max) {
                                return;
                            }
                        }
                    }
                    Ok(None) => return,
                    Err(e) => {
                        tracing::debug!("watch: {e}");
                        let ended = Err(std::io::Error::other(format!("the watch ended: {e}")));
                        if tx.send(ended).await.is_err() {
                            tracing::debug!("watch: the client left before its end");
                        }
                        return;
                    }
                },
                _ = heartbeat.tick() => {
                    if tx.send(Ok(Bytes::from_static(b": keepalive\n\n"))).await.is_err() {
                        return;
                    }
                }
                () = timed_out => return,
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(query: &str, last: Option<&str>) -> ApiResult<WatchQuery> {
        let uri: Uri = format!("/vm/x/fs/watch?{query}").parse().expect("uri");
        let mut headers = HeaderMap::new();
        if let Some(v) = last {
            headers.insert("last-event-id", v.parse().expect("header"));
        }
        watch_query(&uri, &headers)
    }

    #[test]
    fn the_sdks_query_parses() {
        let q = parse(
            "paths=%2Ftmp&paths=%2Fsrv&patterns=*.go&events=create&events=write&uid=1000&recursive=true&debounce=100ms&timeout=5m&max_events=3",
            Some("41"),
        )
        .expect("query");
        assert_eq!(
            q,
            WatchQuery {
                req: WatchRequest {
                    paths: vec!["/tmp".into(), "/srv".into()],
                    recursive: true,
                    patterns: vec!["*.go".into()],
                    events: vec![WatchEventKind::Create, WatchEventKind::Write],
                    uid: Some(1000),
                    debounce_ms: Some(100),
                },
                max_events: Some(3),
                timeout: Some(Duration::from_secs(300)),
                last_event_id: 41,
            }
        );
        assert_eq!(
            parse("paths=%2Ftmp&one_shot=true&max_events=9", None)
                .expect("one shot")
                .max_events,
            Some(1)
        );
    }

    #[test]
    fn bad_watch_queries_are_named() {
        for (query, last, says) in [
            ("", None, "`paths` is required"),
            ("paths=", None, "`paths` is required"),
            (
                "paths=%2Ft&events=delete",
                None,
                "`delete` is not one of create",
            ),
            ("paths=%2Ft&debounce=soon", None, "`debounce=soon`"),
            ("paths=%2Ft&timeout=5", None, "`timeout=5`"),
            ("paths=%2Ft&recursive=yes", None, "`recursive=yes`"),
            ("paths=%2Ft&max_events=x", None, "`max_events=x`"),
            (
                "paths=%2Ft&follow=true",
                None,
                "unknown query parameter `follow`",
            ),
            ("paths=%2Ft", Some("abc"), "Last-Event-ID must be a number"),
        ] {
            let e = parse(query, last).expect_err(query);
            assert!(e.message.contains(says), "{query}: {}", e.message);
        }
    }

    #[test]
    fn an_event_is_one_sse_message() {
        let e = WatchEvent {
            kind: WatchEventKind::Write,
            path: "/tmp/a".into(),
            is_dir: false,
            size: 5,
            unix_nanos: 1_767_323_045_000_000_001,
            message: None,
        };
        let text = String::from_utf8(sse(7, e).to_vec()).expect("utf-8");
        assert_eq!(
            text,
            "id: 7\nevent: watch\ndata: {\"id\":7,\"type\":\"write\",\"path\":\"/tmp/a\",\"timestamp\":\"2026-01-02T03:04:05.000000001Z\",\"size\":5,\"isDir\":false}\n\n"
        );
    }
}
