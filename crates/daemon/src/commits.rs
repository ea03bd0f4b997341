//! Commits and cold forks: a stopped persistent VM's disk becomes an
//! immutable parent (`cmt-<group>-<16 hex>`), and forks boot from
//! copy-on-write children of it.
//!
//! Order of a commit (crash-safe): link the source's disk to
//! `<data_dir>/commits/<id>.qcow2` and make it read-only, create the
//! source's fresh overlay on it, then record both in one transaction, then
//! remove the source's old name. A crash before the record leaves an
//! unrecorded commit file that start-up removes; the source keeps its disk.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{Method, StatusCode, Uri};
use axum::Json;
use tine_proto::api::{self, CommitInfo, CommitRequest, ForkNetwork, ForkRequest, VmState};

use crate::api::{
    parse_json, parse_timeout, parse_wait, query_get, query_only, query_pairs, AppState, Routes,
};
use crate::daemon::{validate_name, validate_tag, Daemon, Wait, DEFAULT_FIXUPS};
use crate::db::{now_ms, CommitRecord, NewVm};
use crate::error::{ApiError, ApiResult};
use crate::failpoint::{self, Failpoint};
use crate::storage;

/// Most characters in a cache key.
pub const MAX_CACHE_KEY: usize = 256;

/// Adds the commit routes.
pub fn add_routes(r: Routes) -> Routes {
    r.route(Method::POST, "/vm/{hostname}/commit", commit)
        .route(Method::GET, "/vm/commits", list)
        .route(Method::DELETE, "/vm/commits/{id}", delete)
        .route(Method::POST, "/vm/commits/{id}/fork", fork)
}

fn info(c: &CommitRecord) -> CommitInfo {
    CommitInfo {
        commit_id: c.id.clone(),
        status: "committed".into(),
        mode: "disk".into(),
        source: c.source.clone(),
        host_group: c.host_group.clone(),
        tags: c.tags.clone(),
        labels: c.labels.clone(),
        cache_key: c.cache_key.clone(),
        parent_commit_id: c.parent_commit_id.clone(),
        cpus: c.cpus,
        ram_bytes: c.ram_bytes,
        size_bytes: c.size_bytes,
        created_at: api::rfc3339_millis(c.created_ms),
        elapsed_ms: c.elapsed_ms,
    }
}

fn new_commit_id(group: &str) -> ApiResult<String> {
    let mut raw = [0u8; 8];
    getrandom::fill(&mut raw).map_err(|e| ApiError::internal(format!("random id: {e}")))?;
    let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("cmt-{group}-{hex}"))
}

impl Daemon {
    /// The folder of commit files.
    pub fn commits_dir(&self) -> PathBuf {
        self.data_dir.join("commits")
    }

    /// Commits a stopped, persistent, never committed VM.
    pub async fn commit(self: &Arc<Self>, key: &str, req: CommitRequest) -> ApiResult<CommitInfo> {
        let began = Instant::now();
        for t in &req.tags {
            validate_tag(t)?;
        }
        for (k, v) in &req.labels {
            if k.is_empty() || k.len() > 128 || v.len() > 1024 {
                return Err(ApiError::bad_request(format!(
                    "label `{k}` is invalid: keys 1-128 characters, values up to 1024"
                )));
            }
        }
        if let Some(k) = &req.cache_key {
            if k.is_empty() || k.len() > MAX_CACHE_KEY || k.chars().any(char::is_control) {
                return Err(ApiError::bad_request(format!(
                    "cache key is invalid: use 1-{MAX_CACHE_KEY} printable characters"
                )));
            }
        }
        let vm = self.vm(key)?;
        let _guard = self.lock_vm(&vm.hostname).await;
        let vm = self.vm(&vm.hostname)?;
        if let Some(id) = &vm.commit_id {
            return Err(ApiError::conflict(format!(
                "{} was already committed as {id}; a committed source cannot be committed again (fork it and commit the fork)",
                vm.hostname
            )));
        }
        if !vm.persistent {
            return Err(ApiError::conflict(format!(
                "{} is not persistent: only a persistent VM's disk outlives its stop, so only it can be committed",
                vm.hostname
            )));
        }
        if vm.state != VmState::Stopped {
            return Err(ApiError::conflict(format!(
                "{} is {}; shut it down first (tine vm shutdown {}): only a stopped VM can be committed",
                vm.hostname, vm.state, vm.hostname
            )));
        }
        if let Some(k) = &req.cache_key {
            if let Some(c) = self.store.list_commits(None, Some(k), None)?.first() {
                return Err(ApiError::conflict(format!(
                    "the cache key `{k}` is already used by commit {}",
                    c.id
                )));
            }
        }
        let id = new_commit_id(&vm.host_group)?;
        let commit_path = self.commits_dir().join(format!("{id}.qcow2"));
        let paths = self.paths(&vm.hostname);
        let new_disk = paths
            .dir
            .join(format!("disk-{}.qcow2", &id[id.len() - 8..]));
        let old_disk = PathBuf::from(&vm.disk);
        let (c2, n2, o2) = (commit_path.clone(), new_disk.clone(), old_disk.clone());
        let size = tokio::task::spawn_blocking(move || storage::commit_disk(&o2, &c2, &n2))
            .await
            .map_err(|e| ApiError::internal(format!("commit: {e}")))?
            .map_err(|e| {
                ApiError::internal(format!(
                    "commit of {} failed, nothing recorded: {e}",
                    vm.hostname
                ))
            })?;
        let record = CommitRecord {
            id: id.clone(),
            host_group: vm.host_group.clone(),
            source: vm.hostname.clone(),
            disk: commit_path.display().to_string(),
            tags: req.tags,
            labels: req.labels,
            source_tags: vm
                .tags
                .iter()
                .filter(|t| !t.starts_with("name="))
                .cloned()
                .collect(),
            cache_key: req.cache_key,
            parent_commit_id: vm.parent_commit_id.clone(),
            cpus: vm.cpus,
            ram_bytes: vm.ram_bytes,
            size_bytes: size,
            created_ms: now_ms(),
            elapsed_ms: began.elapsed().as_millis() as u64,
        };
        failpoint::hit(Failpoint::CommitOverlayMade);
        if let Err(e) = self
            .store
            .insert_commit(&record, &new_disk.display().to_string())
        {
            let _ = std::fs::remove_file(&commit_path);
            let _ = std::fs::remove_file(&new_disk);
            return Err(e.into());
        }
        failpoint::hit(Failpoint::CommitRecorded);
        // The old name of the (now committed) inode.
        let _ = std::fs::remove_file(&old_disk);
        tracing::info!(vm = %vm.hostname, commit = %id, ms = record.elapsed_ms, "committed");
        Ok(info(&record))
    }

    /// Deletes a commit nobody depends on.
    pub fn delete_commit(&self, id: &str) -> ApiResult<()> {
        let c = self
            .store
            .delete_commit(id)?
            .ok_or_else(|| ApiError::not_found(format!("no commit `{id}`")))?;
        let _ = std::fs::remove_file(&c.disk);
        Ok(())
    }

    /// Forks a commit: a new VM booting from a copy-on-write child of it.
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        req: ForkRequest,
        wait: Wait,
        timeout: Duration,
    ) -> ApiResult<api::ForkResponse> {
        let began = Instant::now();
        let c = self
            .store
            .get_commit(id)?
            .ok_or_else(|| ApiError::not_found(format!("no commit `{id}`")))?;
        let group = self.group(&c.host_group)?.clone();
        let fixups = match &req.fixups {
            None => DEFAULT_FIXUPS.iter().map(|s| s.to_string()).collect(),
            Some(list) => {
                for f in list {
                    if !DEFAULT_FIXUPS.contains(&f.as_str()) {
                        return Err(ApiError::bad_request(format!(
                            "fix-up `{f}` is not one of {}",
                            DEFAULT_FIXUPS.join(", ")
                        )));
                    }
                }
                list.clone()
            }
        };
        let network = match &req.network {
            None => None,
            Some(ForkNetwork::Mode(m)) if m == "none" => Some(serde_json::json!({"mode": "none"})),
            Some(ForkNetwork::Mode(m)) => {
                return Err(ApiError::bad_request(format!(
                    "network `{m}` is not `none` or a policy {{allow, drop}}"
                )))
            }
            Some(ForkNetwork::Policy(p)) => {
                crate::vmnet::validate_policy(p).map_err(ApiError::bad_request)?;
                Some(serde_json::to_value(p).map_err(|e| ApiError::internal(e.to_string()))?)
            }
        };
        let replace = match req.tag_mode.as_deref() {
            None | Some("append") => false,
            Some("replace") => true,
            Some(m) => {
                return Err(ApiError::bad_request(format!(
                    "tag_mode `{m}` is not append or replace"
                )))
            }
        };
        let mut tags = if replace {
            Vec::new()
        } else {
            c.source_tags.clone()
        };
        for t in req.tags.iter().flatten() {
            validate_tag(t)?;
            if !tags.contains(t) {
                tags.push(t.clone());
            }
        }
        if req.tags.as_ref().is_some_and(Vec::is_empty) {
            tags.clear();
        }
        let plan = api::CreateVmRequest {
            cpus: Some(req.cpus.unwrap_or(c.cpus)),
            ram_bytes: Some(req.ram_bytes.unwrap_or(c.ram_bytes)),
            persistent: Some(req.persistent.unwrap_or(true)),
            userdata: None,
            tags,
            name: req.name.clone(),
            network: None,
        };
        if let Some(n) = &req.name {
            validate_name(n)?;
        }
        let mut new: NewVm = self.plan_vm(&group, &plan, false)?;
        new.userdata = None;
        new.booted_once = true;
        new.parent_commit_id = Some(c.id.clone());
        new.fixups = Some(fixups);
        new.policy = network;
        let commit_path = PathBuf::from(&c.disk);
        {
            let p = commit_path.clone();
            tokio::task::spawn_blocking(move || storage::verify_commit(&p))
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?
                .map_err(|e| {
                    ApiError::internal(format!("commit {} cannot be forked: {e}", c.id))
                })?;
        }
        let this = self.clone();
        // The fork finishes even if the client goes away.
        let job = tokio::spawn(async move {
            this.provision(&new, move |disk: &Path| {
                storage::fork_disk(&commit_path, disk)
                    .map_err(|e| ApiError::internal(format!("fork disk: {e}")))
            })
            .await
        });
        let hostname = job
            .await
            .map_err(|e| ApiError::internal(format!("fork: {e}")))??;
        let vm = match wait {
            Wait::Agent => match self.wait_running(&hostname, timeout).await {
                Ok(vm) => vm,
                Err(e) if e.code == tine_proto::api::ErrorCode::Timeout => return Err(e),
                Err(e) => {
                    // A fork that failed to come up leaves nothing behind.
                    self.discard(&hostname).await;
                    return Err(ApiError::internal(format!(
                        "fork failed and was removed: {}",
                        e.message
                    )));
                }
            },
            Wait::None => self.vm(&hostname)?,
        };
        Ok(api::ForkResponse {
            hostname: vm.hostname,
            source_hostname: c.source,
            commit_id: c.id,
            status: "forked".into(),
            child_status: vm.state,
            persistent: vm.persistent,
            elapsed_ms: began.elapsed().as_millis() as u64,
        })
    }

    /// Removes commit files no record names (a crash mid-commit).
    pub fn remove_orphan_commit_files(&self) -> Vec<String> {
        let known: Vec<String> = self.store.commit_paths().unwrap_or_default();
        let mut removed = Vec::new();
        if let Ok(entries) = std::fs::read_dir(self.commits_dir()) {
            for e in entries.flatten() {
                let p = e.path().display().to_string();
                if !known.contains(&p) {
                    let _ = std::fs::remove_file(e.path());
                    removed.push(p);
                }
            }
        }
        removed
    }
}

async fn commit(
    State(d): State<AppState>,
    UrlPath(hostname): UrlPath<String>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<CommitInfo>)> {
    let req: CommitRequest = parse_json(&body)?;
    Ok((StatusCode::CREATED, Json(d.commit(&hostname, req).await?)))
}

async fn list(State(d): State<AppState>, uri: Uri) -> ApiResult<Json<Vec<CommitInfo>>> {
    let q = query_pairs(&uri);
    query_only(&q, &["tag", "cache_key", "source", "mode"])?;
    if let Some(m) = query_get(&q, "mode") {
        if m != "disk" {
            return Ok(Json(Vec::new()));
        }
    }
    let list = d.store.list_commits(
        query_get(&q, "tag"),
        query_get(&q, "cache_key"),
        query_get(&q, "source"),
    )?;
    Ok(Json(list.iter().map(info).collect()))
}

async fn delete(
    State(d): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> ApiResult<Json<serde_json::Value>> {
    d.delete_commit(&id)?;
    Ok(Json(
        serde_json::json!({"commit_id": id, "status": "deleted"}),
    ))
}

async fn fork(
    State(d): State<AppState>,
    UrlPath(id): UrlPath<String>,
    uri: Uri,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<api::ForkResponse>)> {
    let q = query_pairs(&uri);
    query_only(&q, &["wait", "timeout"])?;
    let wait = parse_wait(query_get(&q, "wait"), Wait::Agent)?;
    let timeout = parse_timeout(query_get(&q, "timeout"), crate::api::DEFAULT_WAIT)?;
    let req: ForkRequest = parse_json(&body)?;
    Ok((
        StatusCode::CREATED,
        Json(d.fork(&id, req, wait, timeout).await?),
    ))
}
