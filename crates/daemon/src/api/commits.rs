//! Commits and forks.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::Json;
use tine_proto::api::{
    self, CommitInfo, CommitMode, CommitPoolRequest, CommitRequest, DeleteCommitResponse,
    DeleteStatus, ForkRequest, Wait,
};

use super::params::{
    parse_json, parse_query_enum, parse_timeout, query_all, query_get, query_only, query_pairs,
    AppState, DEFAULT_WAIT,
};
use crate::core::commit_info;
use crate::db::CommitFilter;
use crate::error::ApiResult;

pub(super) async fn commit(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<CommitInfo>)> {
    let req: CommitRequest = parse_json(&body)?;
    // 200, as Slicer answers (its Go SDK refuses any other status).
    Ok((StatusCode::OK, Json(d.commit(&hostname, req).await?)))
}

pub(super) async fn list(State(d): State<AppState>, uri: Uri) -> ApiResult<Json<Vec<CommitInfo>>> {
    let q = query_pairs(&uri);
    query_only(&q, &["tag", "cache_key", "source", "mode"])?;
    let mode: Option<CommitMode> = parse_query_enum(&q, "mode")?;
    let tags = query_all(&q, "tag");
    let tags: Vec<&str> = tags.iter().map(String::as_str).collect();
    let list = d.commits(&CommitFilter {
        tags: &tags,
        cache_key: query_get(&q, "cache_key"),
        source: query_get(&q, "source"),
        mode,
    })?;
    Ok(Json(list.iter().map(commit_info).collect()))
}

pub(super) async fn delete(
    State(d): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<DeleteCommitResponse>> {
    d.delete_commit(&id)?;
    Ok(Json(DeleteCommitResponse {
        commit_id: id,
        status: DeleteStatus::Deleted,
    }))
}

pub(super) async fn set_pool(
    State(d): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Json<CommitInfo>> {
    let req: CommitPoolRequest = parse_json(&body)?;
    Ok(Json(d.set_commit_pool(&id, Some(req.hot_fork_pool))?))
}

pub(super) async fn reset_pool(
    State(d): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<CommitInfo>> {
    Ok(Json(d.set_commit_pool(&id, None)?))
}

pub(super) async fn fork(
    State(d): State<AppState>,
    Path(id): Path<String>,
    uri: Uri,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<api::ForkResponse>)> {
    let q = query_pairs(&uri);
    query_only(&q, &["wait", "timeout"])?;
    let wait = parse_query_enum(&q, "wait")?.unwrap_or(Wait::Agent);
    let timeout = parse_timeout(query_get(&q, "timeout"), DEFAULT_WAIT)?;
    let req: ForkRequest = parse_json(&body)?;
    // 200, as Slicer answers (its Go SDK refuses any other status).
    Ok((StatusCode::OK, Json(d.fork(&id, req, wait, timeout).await?)))
}
