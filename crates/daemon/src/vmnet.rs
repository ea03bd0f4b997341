//! Glue between VM records and the host network ([`crate::network`]): what
//! a VM stores about its network (a `VmNetwork` as JSON), and the calls made
//! when it starts, stops and is described.
//!
//! A VM keeps its address for its whole life: the record is written at its
//! first start and re-created with `ensure` at every relaunch; stopping
//! removes the TAP and its rules, deleting the VM frees the address.

use std::net::Ipv4Addr;
use std::sync::Mutex;

use tine_proto::agent::NetworkRequest;
use tine_proto::api::{NetworkPolicy, VmNetworkInfo};

use crate::config::HostGroup;
use crate::daemon::Daemon;
use crate::db::VmRecord;
use crate::network::{NetMode, NetworkManager, PolicyEntry, PolicyOverride, VmNetwork};

/// One allocation at a time: concurrent creates must not pick the same
/// free address.
static ALLOCATE: Mutex<()> = Mutex::new(());

fn manager() -> &'static NetworkManager {
    static MANAGER: std::sync::OnceLock<NetworkManager> = std::sync::OnceLock::new();
    MANAGER.get_or_init(NetworkManager::default)
}

fn parse(network: &serde_json::Value) -> Option<VmNetwork> {
    serde_json::from_value(network.clone()).ok()
}

fn overrides(vm: &VmRecord) -> Option<PolicyOverride> {
    let p: NetworkPolicy = serde_json::from_value(vm.policy.clone()?).ok()?;
    Some(PolicyOverride {
        allow: p.allow,
        drop: p.drop,
    })
}

/// Whether the VM asked for no NIC (a fork with `network: none`).
fn wants_none(vm: &VmRecord) -> bool {
    vm.policy
        .as_ref()
        .and_then(|p| p.get("mode"))
        .and_then(|m| m.as_str())
        == Some("none")
}

/// Gives a starting VM its network per its group: the stored one again
/// (same TAP, MAC and address) or a new allocation. `None` in mode `none`.
pub fn attach(
    daemon: &Daemon,
    group: &HostGroup,
    vm: &VmRecord,
) -> Result<Option<serde_json::Value>, String> {
    if group.network.mode == NetMode::None || wants_none(vm) {
        return Ok(None);
    }
    if let Some(stored) = vm.network.as_ref().and_then(parse) {
        manager().ensure(&stored).map_err(|e| e.to_string())?;
        return serde_json::to_value(&stored)
            .map(Some)
            .map_err(|e| e.to_string());
    }
    let _one = ALLOCATE.lock().unwrap_or_else(|p| p.into_inner());
    let in_use: Vec<Ipv4Addr> = daemon
        .store
        .list_vms(Some(&group.name))
        .map_err(|e| e.to_string())?
        .iter()
        .filter_map(|v| v.network.as_ref().and_then(parse))
        .map(|n| n.address)
        .collect();
    let planned = manager()
        .attach(
            &group.name,
            &group.network,
            &vm.hostname,
            &in_use,
            overrides(vm).as_ref(),
        )
        .map_err(|e| e.to_string())?;
    let value = planned
        .map(|n| serde_json::to_value(&n))
        .transpose()
        .map_err(|e| e.to_string())?;
    // Recorded while the allocation lock is held, so the next VM sees it.
    daemon
        .store
        .set_network(&vm.hostname, value.as_ref())
        .map_err(|e| e.to_string())?;
    Ok(value)
}

/// Removes a VM's TAP and rules (the record keeps its address).
pub fn release(network: &serde_json::Value) -> Result<(), String> {
    match parse(network) {
        Some(n) => manager().detach(&n).map_err(|e| e.to_string()),
        None => Ok(()),
    }
}

/// The `--net TAP,MAC` of a stored network.
pub fn tap_and_mac(network: &serde_json::Value) -> Option<(String, String)> {
    let n = parse(network)?;
    Some((n.tap, n.mac))
}

/// What the agent is told to configure.
pub fn agent_request(network: &serde_json::Value) -> Option<NetworkRequest> {
    parse(network).map(|n| n.agent_request())
}

/// The network as `describe` shows it.
pub fn describe(network: &serde_json::Value) -> Option<VmNetworkInfo> {
    let n = parse(network)?;
    Some(VmNetworkInfo {
        mode: serde_json::to_value(n.mode)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default(),
        tap: n.tap.clone(),
        mac: n.mac.clone(),
        address: format!("{}/{}", n.address, n.prefix),
        gateway: n.gateway.to_string(),
        allow: n.allow.iter().map(ToString::to_string).collect(),
        drop: n.drop.iter().map(ToString::to_string).collect(),
        policy_source: serde_json::to_value(n.policy_source())
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default(),
    })
}

/// Checks a per-VM policy override: every entry must be a CIDR, an IP, or
/// either with `:port`.
pub fn validate_policy(policy: &NetworkPolicy) -> Result<(), String> {
    for entry in policy
        .allow
        .iter()
        .flatten()
        .chain(policy.drop.iter().flatten())
    {
        entry
            .parse::<PolicyEntry>()
            .map_err(|e| format!("network policy entry `{entry}`: {e}"))?;
    }
    Ok(())
}

/// Removes TAPs and rules that no live VM owns (after a restart).
pub fn cleanup_orphans(daemon: &Daemon) {
    let Ok(vms) = daemon.store.list_vms(None) else {
        return;
    };
    let uses_network = daemon
        .config
        .host_groups
        .iter()
        .any(|g| g.network.mode != NetMode::None);
    if !uses_network {
        return;
    }
    let keep: Vec<VmNetwork> = vms
        .iter()
        .filter(|v| v.state.is_live())
        .filter_map(|v| v.network.as_ref().and_then(parse))
        .collect();
    match manager().cleanup_orphans(&keep) {
        Ok(removed) if !removed.is_empty() => {
            tracing::info!(?removed, "removed orphan network devices")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("network clean-up: {e}"),
    }
}
