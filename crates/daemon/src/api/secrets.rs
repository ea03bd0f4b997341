//! Host secrets: `/secrets` and `/secrets/{name}`, as Slicer's SDKs call
//! them (create answers 201 and 409 when the name is taken).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use tine_proto::api::{
    CreateSecretRequest, DeleteSecretResponse, DeleteStatus, SecretInfo, UpdateSecretRequest,
};

use super::params::{parse_json, AppState};
use crate::error::ApiResult;

pub(super) async fn list(State(d): State<AppState>) -> ApiResult<Json<Vec<SecretInfo>>> {
    Ok(Json(d.list_secrets()?))
}

pub(super) async fn create(
    State(d): State<AppState>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<SecretInfo>)> {
    let req: CreateSecretRequest = parse_json(&body)?;
    Ok((StatusCode::CREATED, Json(d.create_secret(&req)?)))
}

pub(super) async fn update(
    State(d): State<AppState>,
    Path(name): Path<String>,
    body: Bytes,
) -> ApiResult<Json<SecretInfo>> {
    let req: UpdateSecretRequest = parse_json(&body)?;
    Ok(Json(d.update_secret(&name, &req)?))
}

pub(super) async fn delete(
    State(d): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Json<DeleteSecretResponse>> {
    d.delete_secret(&name)?;
    Ok(Json(DeleteSecretResponse {
        name,
        status: DeleteStatus::Deleted,
    }))
}
