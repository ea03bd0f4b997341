//! Glue between VMs and the host network module: what a VM record stores
//! about its network, and the calls made when it starts and stops.

use tine_proto::agent::NetworkRequest;
use tine_proto::api::{NetworkPolicy, VmNetworkInfo};

use crate::config::HostGroup;
use crate::daemon::Daemon;
use crate::db::VmRecord;

/// Gives a starting VM its network per its group; `None` for mode `none`.
pub fn attach(
    _daemon: &Daemon,
    _group: &HostGroup,
    _vm: &VmRecord,
) -> Result<Option<serde_json::Value>, String> {
    Ok(None)
}

/// Releases a VM's TAP and rules.
pub fn release(_network: &serde_json::Value) -> Result<(), String> {
    Ok(())
}

/// The `--net TAP,MAC` of a stored network.
pub fn tap_and_mac(_network: &serde_json::Value) -> Option<(String, String)> {
    None
}

/// What the agent is told to configure.
pub fn agent_request(_network: &serde_json::Value) -> Option<NetworkRequest> {
    None
}

/// The network as `describe` shows it.
pub fn describe(_network: &serde_json::Value) -> Option<VmNetworkInfo> {
    None
}

/// Checks a per-VM policy override.
pub fn validate_policy(_policy: &NetworkPolicy) -> Result<(), String> {
    Ok(())
}

/// Removes TAPs and rules no VM owns.
pub fn cleanup_orphans(_daemon: &Daemon) {}
