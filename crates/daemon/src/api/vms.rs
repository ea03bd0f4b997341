//! Host groups and the VM life cycle.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, Uri};
use axum::Json;
use tine_proto::api::{
    self, CreateVmRequest, CreateWait, DaemonInfo, HostGroupInfo, ListQuery, LogsResponse,
    ShutdownAction, ShutdownRequest, TagsPatch, Wait,
};

use super::params::{
    parse_json, parse_query_enum, parse_timeout, query_all, query_get, query_num, query_only,
    query_pairs, AppState, DEFAULT_WAIT,
};
use crate::core::DEFAULT_SHUTDOWN_TIMEOUT;
use crate::db::VmRecord;
use crate::error::{ApiError, ApiResult};
use crate::host_stats;

pub(super) async fn info(State(d): State<AppState>) -> ApiResult<Json<DaemonInfo>> {
    Ok(Json(DaemonInfo {
        version: env!("CARGO_PKG_VERSION").into(),
        git_commit: env!("TINE_GIT_COMMIT").into(),
        platform: std::env::consts::OS.into(),
        arch: api::go_arch().into(),
        data_dir: d.data_dir().display().to_string(),
        pid: std::process::id(),
        started_at: api::rfc3339_millis(d.started_ms()),
        host_groups: d
            .config()
            .host_groups
            .iter()
            .map(|g| g.name.clone())
            .collect(),
        vms: d.vm_count(None)?,
    }))
}

pub(super) async fn host_groups(State(d): State<AppState>) -> ApiResult<Json<Vec<HostGroupInfo>>> {
    let mut out = Vec::new();
    for g in &d.config().host_groups {
        let image_size = d.image(&g.image)?.map(|i| i.size_bytes).unwrap_or(0);
        out.push(HostGroupInfo {
            name: g.name.clone(),
            count: g.count,
            cpus: g.cpus,
            max_cpus: g.max_cpus(),
            ram_bytes: g.ram_mb << 20,
            max_ram_bytes: g.max_ram_mb() << 20,
            image: g.image.clone(),
            storage_bytes: g
                .storage_bytes()
                .map_err(|e| ApiError::internal(e.to_string()))?
                .unwrap_or(image_size),
            persistent: g.persistent,
            network: g.network.mode.to_string(),
            nodes: d.vm_count(Some(&g.name))?,
            arch: api::go_arch().into(),
            gpu_count: 0,
            hot_fork_pool: g.hot_fork_pool,
        });
    }
    Ok(Json(out))
}

fn list_query(uri: &Uri) -> ApiResult<ListQuery> {
    let q = query_pairs(uri);
    query_only(&q, &["tag", "tag_prefix"])?;
    Ok(ListQuery {
        tags: query_all(&q, "tag"),
        tag_prefix: query_get(&q, "tag_prefix").map(str::to_owned),
    })
}

pub(super) async fn group_nodes(
    State(d): State<AppState>,
    Path(group): Path<String>,
    uri: Uri,
) -> ApiResult<Json<Vec<api::VmInfo>>> {
    Ok(Json(d.list(Some(&group), &list_query(&uri)?)?))
}

pub(super) async fn nodes(
    State(d): State<AppState>,
    uri: Uri,
) -> ApiResult<Json<Vec<api::VmInfo>>> {
    Ok(Json(d.list(None, &list_query(&uri)?)?))
}

pub(super) async fn create(
    State(d): State<AppState>,
    Path(group): Path<String>,
    uri: Uri,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<api::CreateVmResponse>)> {
    let q = query_pairs(&uri);
    query_only(&q, &["wait", "timeout"])?;
    let wait: CreateWait = parse_query_enum(&q, "wait")?.unwrap_or_default();
    let timeout = parse_timeout(query_get(&q, "timeout"), DEFAULT_WAIT)?;
    d.group(&group)?;
    let req: CreateVmRequest = parse_json(&body)?;
    let began = tokio::time::Instant::now();
    let agent_wait = match wait {
        CreateWait::None => Wait::None,
        CreateWait::Agent | CreateWait::Userdata => Wait::Agent,
    };
    let mut r = d.create_vm(&group, req, agent_wait, timeout, false).await?;
    if wait == CreateWait::Userdata {
        wait_userdata(&d, &r.hostname, began + timeout).await?;
        r.elapsed_ms = began.elapsed().as_millis() as u64;
    }
    Ok((StatusCode::CREATED, Json(r)))
}

/// Polls the agent until the VM's userdata has run (or there is none);
/// 408 at `deadline`, naming the VM.
async fn wait_userdata(
    d: &AppState,
    hostname: &str,
    deadline: tokio::time::Instant,
) -> ApiResult<()> {
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let status = tokio::time::timeout(left, async {
            let (_vm, client) = d.agent(hostname).await?;
            client
                .userdata_status()
                .await
                .map_err(|e| ApiError::agent(e.to_string()))
        })
        .await;
        match status {
            Ok(Ok(s)) if s.ran || !s.present => return Ok(()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(ApiError::timeout(format!(
                    "the userdata of {hostname} had not finished when the wait timed out (the VM keeps running)"
                )))
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        if tokio::time::Instant::now() >= deadline {
            return Err(ApiError::timeout(format!(
                "the userdata of {hostname} had not finished when the wait timed out (the VM keeps running)"
            )));
        }
    }
}

pub(super) async fn describe(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
) -> ApiResult<Json<api::VmInfo>> {
    let vm = d.vm(&hostname)?;
    let mut info = d.describe(&vm);
    info.memory = memory(&vm).await;
    Ok(Json(info))
}

/// A live VM's memory, read from its VMM process (`None` when it does not
/// run or cannot be read: the describe still answers).
async fn memory(vm: &VmRecord) -> Option<api::VmMemoryInfo> {
    if !vm.state.is_live() {
        return None;
    }
    let (pid, start) = vm.pid.zip(vm.pid_start)?;
    let ram = vm.ram_bytes;
    let read = tokio::task::spawn_blocking(move || host_stats::vm_memory(pid, start, ram));
    let m = read.await.ok()??;
    Some(api::VmMemoryInfo {
        rss_bytes: m.process.rss,
        pss_bytes: m.process.pss,
        uss_bytes: m.process.uss,
        guest_pages_copied: m.copied_bytes.map(|b| b / api::GUEST_PAGE_BYTES),
    })
}

pub(super) async fn delete(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
) -> ApiResult<Json<api::LifecycleResponse>> {
    Ok(Json(d.delete(&hostname).await?))
}

pub(super) async fn delete_in_group(
    State(d): State<AppState>,
    Path((group, hostname)): Path<(String, String)>,
) -> ApiResult<Json<api::LifecycleResponse>> {
    d.group(&group)?;
    let vm = d.vm(&hostname)?;
    if vm.host_group != group {
        return Err(ApiError::not_found(format!(
            "{} is in host group `{}`, not `{group}`",
            vm.hostname, vm.host_group
        )));
    }
    Ok(Json(d.delete(&vm.hostname).await?))
}

pub(super) async fn tags(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
) -> ApiResult<Json<api::TagsResponse>> {
    let vm = d.vm(&hostname)?;
    Ok(Json(api::TagsResponse {
        hostname: vm.hostname,
        tags: vm.tags,
    }))
}

pub(super) async fn patch_tags(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    body: Bytes,
) -> ApiResult<Json<api::TagsResponse>> {
    let patch: TagsPatch = parse_json(&body)?;
    Ok(Json(d.patch_tags(&hostname, patch).await?))
}

pub(super) async fn network(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
) -> ApiResult<Json<api::VmNetworkInfo>> {
    let vm = d.vm(&hostname)?;
    Ok(Json(d.describe(&vm).network))
}

pub(super) async fn set_network(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    body: Bytes,
) -> ApiResult<Json<api::VmNetworkInfo>> {
    let policy: api::NetworkPolicy = parse_json(&body)?;
    Ok(Json(d.set_network_policy(&hostname, policy).await?))
}

pub(super) async fn logs(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Json<LogsResponse>> {
    let q = query_pairs(&uri);
    query_only(&q, &["lines"])?;
    let lines: usize = query_num(&q, "lines")?.unwrap_or(200).min(100_000);
    let vm = d.vm(&hostname)?;
    let path = d.paths(&vm.hostname).serial;
    let lines = tokio::task::spawn_blocking(move || crate::process::last_lines(&path, lines))
        .await
        .map_err(|e| ApiError::internal(format!("read log: {e}")))?;
    let mut content = String::new();
    for line in &lines {
        content.push_str(line);
        content.push('\n');
    }
    Ok(Json(LogsResponse {
        hostname: vm.hostname,
        lines: lines.len(),
        content,
    }))
}

pub(super) async fn shutdown(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
    body: Bytes,
) -> ApiResult<Json<api::LifecycleResponse>> {
    let q = query_pairs(&uri);
    query_only(&q, &["action", "timeout"])?;
    let in_query: Option<ShutdownAction> = parse_query_enum(&q, "action")?;
    let in_body = parse_json::<ShutdownRequest>(&body)?.action;
    let action = match (in_query, in_body) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::bad_request(format!(
                "action `{a}` in the query and `{b}` in the body disagree; give one"
            )))
        }
        (a, b) => a.or(b).unwrap_or_default(),
    };
    let timeout = parse_timeout(query_get(&q, "timeout"), DEFAULT_SHUTDOWN_TIMEOUT)?;
    Ok(Json(d.shutdown(&hostname, action, timeout).await?))
}

pub(super) async fn relaunch(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Json<api::CreateVmResponse>> {
    let q = query_pairs(&uri);
    query_only(&q, &["wait", "timeout"])?;
    let wait: Wait = parse_query_enum(&q, "wait")?.unwrap_or_default();
    let timeout = parse_timeout(query_get(&q, "timeout"), DEFAULT_WAIT)?;
    Ok(Json(d.relaunch(&hostname, wait, timeout).await?))
}

pub(super) async fn pause(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
) -> ApiResult<Json<api::VmInfo>> {
    let vm = d.pause(&hostname).await?;
    Ok(Json(d.describe(&d.vm(&vm.hostname)?)))
}

pub(super) async fn resume(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
) -> ApiResult<Json<api::VmInfo>> {
    let vm = d.resume(&hostname).await?;
    Ok(Json(d.describe(&d.vm(&vm.hostname)?)))
}

/// `POST /vm/{hostname}/suspend`: state, memory and disk to the VM's
/// folder, its process exits (Go `SuspendVM`, TS `vm.suspend()`).
pub(super) async fn suspend(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Json<api::SuspendResponse>> {
    query_only(&query_pairs(&uri), &[])?;
    Ok(Json(d.suspend(&hostname).await?))
}

/// `POST /vm/{hostname}/restore?wait=agent&timeout=`: resumes a suspended
/// VM with its memory (Go `RestoreVM(WithOptions)`, TS `vm.restore()`).
pub(super) async fn restore(
    State(d): State<AppState>,
    Path(hostname): Path<String>,
    uri: Uri,
) -> ApiResult<Json<api::LifecycleResponse>> {
    let q = query_pairs(&uri);
    query_only(&q, &["wait", "timeout"])?;
    let wait: Wait = parse_query_enum(&q, "wait")?.unwrap_or_default();
    let timeout = parse_timeout(query_get(&q, "timeout"), DEFAULT_WAIT)?;
    Ok(Json(d.restore(&hostname, wait, timeout).await?))
}

/// `POST /daemon/shutdown`: the daemon exits; VMs keep running (as on
/// SIGTERM) and the next `tine up` finds them.
pub(super) async fn daemon_shutdown(
    State(d): State<AppState>,
) -> Json<tine_proto::api::DaemonShutdownResponse> {
    // After the answer is out.
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        d.request_stop();
    });
    Json(tine_proto::api::DaemonShutdownResponse {
        status: tine_proto::api::DaemonShutdownStatus::ShuttingDown,
    })
}
