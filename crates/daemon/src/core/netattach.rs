//! A VM's network through the daemon's [`crate::network::NetworkManager`]:
//! attached when it starts, released when it stops, shown in describe.
//!
//! A VM keeps its address for its whole life: it is recorded at its first
//! start and re-created with `ensure` at every relaunch; stopping removes
//! the TAP and its rules, deleting the VM frees the address.

use std::net::Ipv4Addr;

use tine_proto::api::{self, ForkNetwork, VmNetworkInfo};

use super::daemon::Daemon;
use super::error::{Error, Result};
use crate::config::HostGroup;
use crate::db::VmRecord;
use crate::network::{DefaultAction, NetMode, PolicyOverride, PolicySource, VmNetwork};

fn lists(allow: &[String], drop: &[String]) -> api::PolicyLists {
    api::PolicyLists {
        allow: allow.to_vec(),
        drop: drop.to_vec(),
        default: match DefaultAction::for_lists(allow, drop) {
            DefaultAction::Allow => api::DefaultAction::Allow,
            DefaultAction::Deny => api::DefaultAction::Deny,
        },
    }
}

/// The network as `describe` shows it: the mode, the group's lists, the
/// VM's override and the lists in force, and the NIC once it has one. A VM
/// not yet started shows the lists it will get; one without a NIC (a group
/// without network, or a fork with `network: none`) shows mode `none`.
pub fn describe(group: Option<&HostGroup>, vm: &VmRecord) -> VmNetworkInfo {
    let no_nic = vm.policy == Some(ForkNetwork::None);
    let group_mode = group.map(|g| g.network.mode).unwrap_or_default();
    let mode = match vm.network.as_ref().map(|n| n.mode).unwrap_or(group_mode) {
        _ if no_nic => api::NetworkMode::None,
        NetMode::None => api::NetworkMode::None,
        NetMode::Bridge => api::NetworkMode::Bridge,
        NetMode::Isolated => api::NetworkMode::Isolated,
    };
    let (group_allow, group_drop) = match group {
        Some(g) if mode == api::NetworkMode::Isolated => {
            (g.network.allow.clone(), g.network.drop.clone())
        }
        _ => (Vec::new(), Vec::new()),
    };
    let overrides = match &vm.policy {
        Some(ForkNetwork::Policy(p)) if p.allow.is_some() || p.drop.is_some() => Some(p.clone()),
        _ => None,
    };
    let effective = match &vm.network {
        Some(n) => lists(&n.allow, &n.drop),
        None => {
            let allow = overrides
                .as_ref()
                .and_then(|o| o.allow.clone())
                .unwrap_or_else(|| group_allow.clone());
            let drop = overrides
                .as_ref()
                .and_then(|o| o.drop.clone())
                .unwrap_or_else(|| group_drop.clone());
            lists(&allow, &drop)
        }
    };
    let nic = vm.network.as_ref().filter(|n| n.mode != NetMode::None);
    VmNetworkInfo {
        mode,
        policy_source: match (&vm.network, &overrides) {
            (Some(n), _) => match n.policy_source() {
                PolicySource::HostGroup => api::PolicySource::HostGroup,
                PolicySource::Override => api::PolicySource::Override,
            },
            (None, Some(_)) => api::PolicySource::Override,
            (None, None) => api::PolicySource::HostGroup,
        },
        host_group: lists(&group_allow, &group_drop),
        overrides,
        effective,
        tap: nic.map(|n| n.tap.clone()),
        mac: nic.map(|n| n.mac.clone()),
        address: nic.map(|n| format!("{}/{}", n.address, n.prefix)),
        gateway: nic.map(|n| n.gateway.to_string()),
    }
}

impl Daemon {
    /// Gives a starting VM its network per its group: the stored one again
    /// (same TAP, MAC and address) or a new allocation, recorded before it
    /// is used. `None` without a NIC.
    pub(super) fn attach_network(
        &self,
        group: &HostGroup,
        vm: &VmRecord,
    ) -> Result<Option<VmNetwork>> {
        let fail = |source| Error::Network {
            vm: vm.hostname.clone(),
            source,
        };
        if group.network.mode == NetMode::None || vm.policy == Some(ForkNetwork::None) {
            return Ok(None);
        }
        if let Some(stored) = &vm.network {
            self.network.ensure(stored).map_err(fail)?;
            return Ok(Some(stored.clone()));
        }
        let _one = self.allocate.lock().unwrap_or_else(|p| p.into_inner());
        let in_use: Vec<Ipv4Addr> = self
            .store
            .list_vms(Some(&group.name))?
            .iter()
            .filter_map(|v| v.network.as_ref())
            .map(|n| n.address)
            .collect();
        let overrides = match &vm.policy {
            Some(ForkNetwork::Policy(p)) => Some(PolicyOverride {
                allow: p.allow.clone(),
                drop: p.drop.clone(),
            }),
            _ => None,
        };
        let planned = self
            .network
            .attach(
                &group.name,
                &group.network,
                &vm.hostname,
                &in_use,
                overrides.as_ref(),
            )
            .map_err(fail)?;
        // Recorded while the allocation lock is held, so the next VM sees it.
        self.store.set_network(&vm.hostname, planned.as_ref())?;
        Ok(planned)
    }

    /// Removes a VM's TAP and rules (the record keeps its address), logging
    /// a failure.
    pub(super) fn release_network(&self, vm: &VmRecord) {
        if let Some(n) = &vm.network {
            if let Err(e) = self.network.detach(n) {
                tracing::warn!(vm = %vm.hostname, "release network: {e}");
            }
        }
    }

    /// Removes TAPs and rules that no live VM owns (after a restart).
    pub(super) fn cleanup_network_orphans(&self, vms: &[VmRecord]) {
        let uses_network = self
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
            .filter_map(|v| v.network.clone())
            .collect();
        match self.network.cleanup_orphans(&keep) {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(?removed, "removed orphan network devices")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("network clean-up: {e}"),
        }
    }
}
