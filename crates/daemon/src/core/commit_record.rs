//! What disk and memory commits share: the request's checks, the record
//! of a new commit, and the commit as the API shows it.

use std::path::Path;
use std::time::Instant;

use tine_proto::api::{self, CommitInfo, CommitMode, CommitRequest, CommitStatus};

use super::error::{Error, Result};
use super::plan;
use crate::db::{now_ms, CommitRecord, VmRecord};
use crate::launcher::pool::MAX_POOL_SIZE;

/// Most characters in a cache key.
pub const MAX_CACHE_KEY: usize = 256;

/// A commit as the API shows it.
pub fn info(c: &CommitRecord) -> CommitInfo {
    CommitInfo {
        commit_id: c.id.clone(),
        status: CommitStatus::Committed,
        mode: c.mode,
        hostname: c.source.clone(),
        source: c.source.clone(),
        host_group: c.host_group.clone(),
        parent_status: None,
        tags: c.tags.clone(),
        labels: c.labels.clone(),
        cache_key: c.cache_key.clone(),
        parent_commit_id: c.parent_commit_id.clone(),
        cpus: c.cpus,
        ram_bytes: c.ram_bytes,
        size_bytes: c.size_bytes,
        created_at: api::rfc3339_millis(c.created_ms),
        elapsed_ms: c.elapsed_ms,
        memory_bytes: c.memory_bytes,
        pause_us: None,
        hot_fork_pool: c.hot_fork_pool,
    }
}

/// A new commit id: `cmt-<group>-<16 hex>`.
pub fn new_commit_id(group: &str) -> Result<String> {
    let mut raw = [0u8; 8];
    getrandom::fill(&mut raw)
        .map_err(|e| Error::io("random commit id", std::io::Error::other(e.to_string())))?;
    let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("cmt-{group}-{hex}"))
}

/// Checks a commit request's tags, labels, cache key and warm pool size.
pub fn check_request(req: &CommitRequest) -> Result<()> {
    if let Some(size) = req.hot_fork_pool {
        if req.mode != Some(CommitMode::Memory) {
            return Err(Error::BadRequest(
                "hot_fork_pool applies to memory commits only (mode: memory): a disk commit's forks boot".into(),
            ));
        }
        check_pool_size(size)?;
    }
    for t in &req.tags {
        plan::validate_tag(t)?;
    }
    for (k, v) in &req.labels {
        if k.is_empty() || k.len() > 128 || v.len() > 1024 {
            return Err(Error::BadRequest(format!(
                "label `{k}` is invalid: keys 1-128 characters, values up to 1024"
            )));
        }
    }
    if let Some(k) = &req.cache_key {
        if k.is_empty() || k.len() > MAX_CACHE_KEY || k.chars().any(char::is_control) {
            return Err(Error::BadRequest(format!(
                "cache key is invalid: use 1-{MAX_CACHE_KEY} printable characters"
            )));
        }
    }
    Ok(())
}

/// Checks a warm pool size asked for a commit.
pub fn check_pool_size(size: u32) -> Result<()> {
    if size > MAX_POOL_SIZE {
        return Err(Error::BadRequest(format!(
            "hot_fork_pool {size} is too large: at most {MAX_POOL_SIZE} pre-started processes per shape"
        )));
    }
    Ok(())
}

/// The record of commit `id` of `vm` with its disk at `disk` (a disk
/// commit's; a memory commit sets its own fields on top).
pub fn record_for(
    vm: &VmRecord,
    req: CommitRequest,
    id: &str,
    disk: &Path,
    size_bytes: u64,
    began: Instant,
) -> CommitRecord {
    CommitRecord {
        id: id.to_owned(),
        host_group: vm.host_group.clone(),
        source: vm.hostname.clone(),
        disk: disk.display().to_string(),
        hot_fork_pool: req.hot_fork_pool,
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
        size_bytes,
        created_ms: now_ms(),
        elapsed_ms: began.elapsed().as_millis() as u64,
        secrets: vm.secrets.clone(),
        mode: CommitMode::Disk,
        snapshot: None,
        memory_bytes: None,
        has_nic: None,
    }
}
