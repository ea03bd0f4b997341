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
use crate::network::{NetMode, PolicyOverride, PolicySource, VmNetwork};

/// The network as `describe` shows it; `None` for a VM without a NIC.
pub fn describe(n: &VmNetwork) -> Option<VmNetworkInfo> {
    let mode = match n.mode {
        NetMode::None => return None,
        NetMode::Bridge => api::NetworkMode::Bridge,
        NetMode::Isolated => api::NetworkMode::Isolated,
    };
    Some(VmNetworkInfo {
        mode,
        tap: n.tap.clone(),
        mac: n.mac.clone(),
        address: format!("{}/{}", n.address, n.prefix),
        gateway: n.gateway.to_string(),
        allow: n.allow.iter().map(ToString::to_string).collect(),
        drop: n.drop.iter().map(ToString::to_string).collect(),
        policy_source: match n.policy_source() {
            PolicySource::HostGroup => api::PolicySource::HostGroup,
            PolicySource::Override => api::PolicySource::Override,
        },
    })
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
