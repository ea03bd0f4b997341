//! A VM's network through the daemon's [`crate::network::NetworkManager`]:
//! attached when it starts, released when it stops, shown in describe.
//!
//! A VM keeps its address for its whole life: it is recorded at its first
//! start and re-created with `ensure` at every relaunch; stopping removes
//! the TAP and its rules, deleting the VM frees the address. Its policy can
//! be replaced while it runs (`set_network_policy`).

use std::net::Ipv4Addr;

use tine_proto::api::{self, ForkNetwork, NetworkPolicy, VmNetworkInfo};

use super::daemon::Daemon;
use super::error::{Error, Result};
use super::plan;
use crate::config::HostGroup;
use crate::db::VmRecord;
use crate::network::{DefaultAction, NetMode, NetworkConfig, PolicyOverride, VmNetwork};

/// The VM's override, if it has one that changes anything.
pub(super) fn override_of(vm: &VmRecord) -> Option<PolicyOverride> {
    policy_override(vm.policy.as_ref())
}

/// Whether a VM that asked for `policy` gets its group's network as it
/// is: neither `none` nor a policy of its own (it may then take a spare).
pub(super) fn takes_group_network(policy: Option<&ForkNetwork>) -> bool {
    policy != Some(&ForkNetwork::None) && policy_override(policy).is_none()
}

fn policy_override(policy: Option<&ForkNetwork>) -> Option<PolicyOverride> {
    match policy {
        Some(ForkNetwork::Policy(p)) => Some(PolicyOverride {
            allow: p.allow.clone(),
            drop: p.drop.clone(),
        })
        .filter(|o| !o.is_empty()),
        _ => None,
    }
}

fn egress(allow: &[String], drop: &[String], default: DefaultAction) -> api::EgressPolicy {
    api::EgressPolicy {
        allow: allow.to_vec(),
        drop: drop.to_vec(),
        default: match default {
            DefaultAction::Allow => api::DefaultAction::Allow,
            DefaultAction::Deny => api::DefaultAction::Deny,
        },
    }
}

/// The network as `describe` shows it (never absent): the mode, the
/// group's lists (`group`: the VM's host group, `None` when the
/// configuration no longer has it), the override, the lists in force and,
/// once attached, the addresses.
pub fn describe(vm: &VmRecord, group: Option<&NetworkConfig>) -> VmNetworkInfo {
    let no_group = NetworkConfig::default();
    let cfg = group.unwrap_or(&no_group);
    let overrides = override_of(vm);
    let mode = if vm.policy == Some(ForkNetwork::None) {
        NetMode::None
    } else {
        vm.network.as_ref().map_or(cfg.mode, |n| n.mode)
    };
    let (allow, drop) = match (&vm.network, mode) {
        (_, NetMode::None) => (Vec::new(), Vec::new()),
        (Some(n), _) => (n.allow.clone(), n.drop.clone()),
        (None, _) => {
            let o = overrides.clone().unwrap_or_default();
            (
                o.allow.unwrap_or_else(|| cfg.allow.clone()),
                o.drop.unwrap_or_else(|| cfg.drop.clone()),
            )
        }
    };
    let effective = match mode {
        // No NIC: nothing leaves the VM.
        NetMode::None => egress(&[], &[], DefaultAction::Deny),
        _ => egress(&allow, &drop, DefaultAction::for_lists(&allow, &drop)),
    };
    let attached = vm.network.as_ref().filter(|_| mode != NetMode::None);
    VmNetworkInfo {
        mode: match mode {
            NetMode::None => api::NetworkMode::None,
            NetMode::Bridge => api::NetworkMode::Bridge,
            NetMode::Isolated => api::NetworkMode::Isolated,
        },
        policy_source: if overrides.is_some() {
            api::PolicySource::Override
        } else {
            api::PolicySource::HostGroup
        },
        host_group: egress(
            &cfg.allow,
            &cfg.drop,
            DefaultAction::for_lists(&cfg.allow, &cfg.drop),
        ),
        overrides: overrides.map(|o| NetworkPolicy {
            allow: o.allow,
            drop: o.drop,
        }),
        effective,
        tap: attached.map(|n| n.tap.clone()),
        mac: attached.map(|n| n.mac.clone()),
        address: attached.map(|n| format!("{}/{}", n.address, n.prefix)),
        gateway: attached.map(|n| n.gateway.to_string()),
        dns: attached
            .map(|n| n.dns.iter().map(ToString::to_string).collect())
            .unwrap_or_default(),
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
        let mut in_use: Vec<Ipv4Addr> = self
            .store
            .list_vms(Some(&group.name))?
            .iter()
            .filter_map(|v| v.network.as_ref())
            .map(|n| n.address)
            .collect();
        // Spare networks made ahead of hot forks hold theirs.
        in_use.extend(self.spare_book().addresses(&group.name));
        let overrides = override_of(vm);
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

    /// Replaces a VM's policy override (`policy`: lists left out inherit the
    /// group's, `[]` clears) while it runs or not. On a live VM the new
    /// rules apply at once and the VM's conntrack entries are flushed, so
    /// connections the new policy forbids are cut; a stopped VM gets them
    /// at its next start. Answers the network as describe shows it.
    pub async fn set_network_policy(
        &self,
        key: &str,
        policy: NetworkPolicy,
    ) -> Result<VmNetworkInfo> {
        let vm = self.vm(key)?;
        let _guard = self.lock_vm(&vm.hostname).await;
        let vm = self.vm(&vm.hostname)?;
        plan::validate_policy(&policy)?;
        let group = self.group(&vm.host_group)?.clone();
        if vm.policy == Some(ForkNetwork::None) {
            return Err(Error::Conflict(format!(
                "{} has no network device (it was forked with network `none`)",
                vm.hostname
            )));
        }
        if group.network.mode != NetMode::Isolated {
            return Err(Error::Conflict(format!(
                "{} is in host group `{}` with network mode {}: allow/drop policies apply \
                 only in isolated mode",
                vm.hostname, group.name, group.network.mode
            )));
        }
        let overrides = PolicyOverride {
            allow: policy.allow.clone(),
            drop: policy.drop.clone(),
        };
        let choice = (!overrides.is_empty()).then_some(ForkNetwork::Policy(policy));
        let fail = |source| Error::Network {
            vm: vm.hostname.clone(),
            source,
        };
        let updated = match &vm.network {
            Some(old) => {
                let mut n = old.clone();
                n.set_policy(&group.network, Some(&overrides))
                    .map_err(|e| Error::BadRequest(e.to_string()))?;
                Some(n)
            }
            None => None,
        };
        let live = vm.state.is_live();
        if let (Some(n), true) = (&updated, live) {
            self.network.update_policy(n).map_err(fail)?;
        }
        if let Err(e) = self
            .store
            .set_policy(&vm.hostname, choice.as_ref(), updated.as_ref())
        {
            // Put the host back to the stored policy: the two must agree.
            if let (Some(old), true) = (&vm.network, live) {
                if let Err(undo) = self.network.update_policy(old) {
                    tracing::warn!(vm = %vm.hostname, "restore the policy: {undo}");
                }
            }
            return Err(e.into());
        }
        tracing::info!(vm = %vm.hostname, live, "network policy changed");
        let vm = self.vm(&vm.hostname)?;
        Ok(describe(&vm, Some(&group.network)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::NetworkManager;
    use tine_proto::api::{DefaultAction as Default_, NetworkMode, PolicySource};

    fn record(policy: Option<ForkNetwork>) -> VmRecord {
        VmRecord {
            hostname: "iso-1".into(),
            host_group: "iso".into(),
            idx: 1,
            state: tine_proto::api::VmState::Running,
            cpus: 1,
            ram_bytes: 256 << 20,
            persistent: true,
            managed: false,
            tags: vec![],
            name: None,
            userdata: None,
            disk: "/d".into(),
            network: None,
            policy,
            pid: None,
            pid_start: None,
            reason: None,
            stop_mode: None,
            created_ms: 0,
            started_ms: None,
            boot_ms: None,
            booted_once: true,
            commit_id: None,
            parent_commit_id: None,
            fixups: None,
            secrets: vec![],
            ssh_keys: vec![],
        }
    }

    fn isolated() -> NetworkConfig {
        serde_yaml::from_str("mode: isolated\ncidr: 169.254.64.0/22\nallow: [0.0.0.0/0]\n")
            .expect("config")
    }

    #[test]
    fn describe_shows_the_group_the_override_and_the_lists_in_force() {
        let cfg = isolated();
        let closed = NetworkPolicy {
            allow: Some(vec![]),
            drop: Some(vec!["0.0.0.0/0".into()]),
        };
        // Not attached yet: computed from the group and the override.
        let mut vm = record(Some(ForkNetwork::Policy(closed.clone())));
        let n = describe(&vm, Some(&cfg));
        assert_eq!(n.mode, NetworkMode::Isolated);
        assert_eq!(n.policy_source, PolicySource::Override);
        assert_eq!(n.host_group.allow, ["0.0.0.0/0"]);
        assert_eq!(n.overrides, Some(closed.clone()));
        assert!(n.effective.allow.is_empty());
        assert_eq!(n.effective.drop, ["0.0.0.0/0"]);
        assert_eq!(n.effective.default, Default_::Allow);
        assert_eq!(n.tap, None);

        // Attached: the stored lists and addresses.
        let overrides = override_of(&vm);
        vm.network = NetworkManager::default()
            .plan("iso", &cfg, "iso-1", &[], overrides.as_ref())
            .expect("plan");
        let n = describe(&vm, Some(&cfg));
        assert_eq!(n.tap.as_deref(), Some("tt-iso-1"));
        assert_eq!(n.address.as_deref(), Some("169.254.64.2/30"));
        assert_eq!(n.effective.drop, ["0.0.0.0/0"]);
        let json = serde_json::to_value(&n).expect("json");
        assert_eq!(json["override"]["allow"], serde_json::json!([]));
        assert_eq!(json["policy_source"], "override");

        // No NIC: never null, mode none, nothing leaves.
        let n = describe(&record(Some(ForkNetwork::None)), Some(&cfg));
        assert_eq!(n.mode, NetworkMode::None);
        assert_eq!(n.effective.default, Default_::Deny);
        let json = serde_json::to_value(describe(&record(None), None)).expect("json");
        assert_eq!(json["mode"], "none");
        assert_eq!(json["override"], serde_json::Value::Null);

        // An empty override is no override.
        let n = describe(
            &record(Some(ForkNetwork::Policy(NetworkPolicy::default()))),
            Some(&cfg),
        );
        assert_eq!(n.policy_source, PolicySource::HostGroup);
        assert_eq!(n.overrides, None);
    }
}
