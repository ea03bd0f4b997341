//! The guest's file system through its agent (Slicer's `/vm/{h}/fs/*`):
//! stat, readdir, mkdir, remove.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::Uri;
use axum::Json;
use tine_client::agent::ClientError;
use tine_client::AgentClient;
use tine_proto::agent::{ErrorCode as AgentCode, FileAttrs, FileKind, FileStat, MkdirRequest};
use tine_proto::api::{self, FsEntry, FsKind, FsMkdirRequest};

use super::agent_call::{agent, call_err};
use super::params::{parse_json, query_get, query_only, query_pairs, AppState};
use crate::error::{ApiError, ApiResult};

/// An absolute path without NUL bytes, or a 400 naming the key.
fn absolute(path: Option<&str>) -> ApiResult<String> {
    path.filter(|p| p.starts_with('/') && !p.contains('\0'))
        .map(str::to_owned)
        .ok_or_else(|| ApiError::bad_request("`path` is required and must be absolute"))
}

/// An agent's answer about `path` as an HTTP error: missing is 404, taken
/// 409, refused or invalid 400, an unreachable agent 503.
fn fs_err(path: &str, e: ClientError) -> ApiError {
    match e.code() {
        Some(AgentCode::NotFound) => ApiError::not_found(format!("{path}: {e}")),
        Some(AgentCode::AlreadyExists) => ApiError::conflict(format!("{path}: {e}")),
        Some(_) => ApiError::bad_request(format!("{path}: {e}")),
        None => call_err(e, |msg| ApiError::agent(format!("{path}: {msg}"))),
    }
}

/// The entry for `path` (named by its last component) as the guest sees
/// it now.
async fn stat_entry(client: &AgentClient, path: &str) -> ApiResult<FsEntry> {
    let stat = client
        .stat(path, false)
        .await
        .map_err(|e| fs_err(path, e))?;
    let name = path.rsplit('/').next().unwrap_or_default().to_owned();
    Ok(entry(name, &stat))
}

fn entry(name: String, stat: &FileStat) -> FsEntry {
    let ms = stat
        .mtime_secs
        .max(0)
        .saturating_mul(1000)
        .saturating_add(i64::from(stat.mtime_nanos / 1_000_000));
    FsEntry {
        name,
        kind: match stat.kind {
            FileKind::File => FsKind::File,
            FileKind::Dir => FsKind::Directory,
            FileKind::Symlink => FsKind::Symlink,
            FileKind::Other => FsKind::Other,
        },
        size: stat.size,
        mtime: api::rfc3339_millis(ms as u64),
        mode: format!("{:04o}", stat.mode & 0o7777),
        uid: stat.uid,
        gid: stat.gid,
        link_target: stat.symlink_target.clone(),
    }
}

/// Parses an octal mode (`0755`, `755`).
fn octal_mode(mode: &str) -> ApiResult<u32> {
    u32::from_str_radix(mode.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| ApiError::bad_request(format!("mode `{mode}` is not octal like 0755")))
}

pub(super) async fn stat(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Json<FsEntry>> {
    let q = query_pairs(&uri);
    query_only(&q, &["path"])?;
    let path = absolute(query_get(&q, "path"))?;
    let client = agent(&d, &hostname).await?;
    stat_entry(&client, &path).await.map(Json)
}

pub(super) async fn readdir(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Json<Vec<FsEntry>>> {
    let q = query_pairs(&uri);
    query_only(&q, &["path"])?;
    let path = absolute(query_get(&q, "path"))?;
    let client = agent(&d, &hostname).await?;
    let entries = client.list(&path).await.map_err(|e| fs_err(&path, e))?;
    Ok(Json(
        entries
            .into_iter()
            .map(|e| entry(e.name, &e.stat))
            .collect(),
    ))
}

pub(super) async fn mkdir(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    body: Bytes,
) -> ApiResult<Json<FsEntry>> {
    let req: FsMkdirRequest = parse_json(&body)?;
    let path = absolute(Some(&req.path))?;
    let mode = req.mode.as_deref().map(octal_mode).transpose()?;
    let client = agent(&d, &hostname).await?;
    client
        .mkdir(MkdirRequest {
            path: path.clone(),
            parents: req.recursive,
            attrs: FileAttrs {
                mode,
                uid: req.uid,
                gid: req.gid,
            },
        })
        .await
        .map_err(|e| fs_err(&path, e))?;
    stat_entry(&client, &path).await.map(Json)
}

pub(super) async fn remove(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Json<tine_proto::api::FsRemoveResponse>> {
    let q = query_pairs(&uri);
    query_only(&q, &["path", "recursive"])?;
    let path = absolute(query_get(&q, "path"))?;
    if path == "/" {
        return Err(ApiError::bad_request("refusing to remove `/`"));
    }
    let recursive = match query_get(&q, "recursive") {
        None | Some("false" | "0" | "") => false,
        Some("true" | "1") => true,
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "`recursive={v}` is not true or false"
            )))
        }
    };
    let client = agent(&d, &hostname).await?;
    client
        .remove(&path, recursive)
        .await
        .map_err(|e| fs_err(&path, e))?;
    Ok(Json(tine_proto::api::FsRemoveResponse {
        path,
        removed: true,
    }))
}
