//! Host-side networking of VMs: a host group's `network:` block decides
//! whether its VMs get no NIC, a TAP on a per-group bridge with NAT, or an
//! isolated TAP with its own /30 and an allow/drop egress policy enforced in
//! nftables.
//!
//! The daemon keeps one [`NetworkManager`]. For each VM it calls
//! [`NetworkManager::attach`], stores the returned [`VmNetwork`] (serde) with
//! the VM, starts `tine-vmm --net` with [`VmNetwork::vmm_net_arg`] and sends
//! [`VmNetwork::agent_request`] to the guest agent; [`NetworkManager::detach`]
//! undoes it. After a daemon restart, [`NetworkManager::cleanup_orphans`]
//! removes what no stored VM owns and [`NetworkManager::ensure`] re-creates
//! what a stored VM lacks (e.g. after a host reboot).
//!
//! Links and addresses change over rtnetlink, TAPs through `/dev/net/tun`
//! and conntrack entries are deleted over ctnetlink, all in-process; rules
//! change through the `nft` command (one `nft -f -` per change, one atomic
//! transaction, only in our own `inet` table: libnftables is GPL-2.0-only,
//! so this Apache-2.0 daemon does not load it). It must run as root.
//!
//! The submodules form layers, each importing only from those before it:
//! `config` (the data types), `error`, `names`, `addr`, `validation`;
//! `nft` (needs `config`); `netlink`, `tun` and `nftcmd` (need `error`);
//! `rtnl` and `ctnl` (need `netlink`) and `sys` (needs `nftcmd`). Only this
//! module, the manager, uses them all, and none of them uses it.

mod addr;
mod config;
mod ctnl;
mod error;
mod names;
mod netlink;
mod nft;
mod nftcmd;
mod rtnl;
mod sys;
mod tun;
mod validation;

use std::collections::{BTreeSet, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Mutex, MutexGuard};

use nftcmd::Nftables;
use rtnl::{LinkChange, Rtnl};

use serde::{Deserialize, Serialize};
use tine_proto::agent::NetworkRequest;

pub use addr::{
    capacity, group_range, isolated_default_range, ISOLATED_RANGE_PREFIX, ISOLATED_VM_PREFIX,
};
pub use config::{
    DefaultAction, NetMode, NetworkConfig, Policy, PolicyEntry, PolicyOverride, PolicyReport,
    PolicySource,
};
pub use error::NetworkError;
pub use names::{
    check_ifname, vm_mac, DEFAULT_BRIDGE_PREFIX, DEFAULT_TAP_PREFIX, IFNAME_MAX, PREFIX_MAX,
};
pub use validation::{validate, validate_groups};

/// The network one VM was given. Serializable so that the daemon can store
/// it and tear it down or re-create it after a restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmNetwork {
    /// The VM's host group.
    pub group: String,
    /// The VM's hostname (also recorded as the TAP's alias).
    pub hostname: String,
    /// `bridge` or `isolated`.
    pub mode: NetMode,
    /// The host TAP interface, `tt-…`.
    pub tap: String,
    /// The bridge the TAP is attached to (bridge mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// The guest's MAC: locally administered, unicast, from the hostname.
    pub mac: String,
    /// The guest's address.
    pub address: Ipv4Addr,
    /// The guest's prefix length (the group's in bridge mode, 30 isolated).
    pub prefix: u8,
    /// The host side, the guest's default gateway.
    pub gateway: Ipv4Addr,
    /// Name servers for the guest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<IpAddr>,
    /// Effective allow list (isolated mode).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// Effective drop list (isolated mode).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drop: Vec<String>,
    /// The per-VM override the lists came from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_override: Option<PolicyOverride>,
}

impl VmNetwork {
    /// The request that makes the guest agent configure `eth0`.
    pub fn agent_request(&self) -> NetworkRequest {
        NetworkRequest {
            iface: "eth0".to_owned(),
            address: self.address,
            prefix: self.prefix,
            gateway: Some(self.gateway),
            dns: self.dns.clone(),
            mac: Some(self.mac.clone()),
        }
    }

    /// The value of `tine-vmm --net`: `TAP,MAC`.
    pub fn vmm_net_arg(&self) -> String {
        format!("{},{}", self.tap, self.mac)
    }

    /// Where the effective lists come from.
    pub fn policy_source(&self) -> PolicySource {
        match &self.policy_override {
            Some(o) if !o.is_empty() => PolicySource::Override,
            _ => PolicySource::HostGroup,
        }
    }

    /// What happens to traffic that no entry matches.
    pub fn default_action(&self) -> DefaultAction {
        DefaultAction::for_lists(&self.allow, &self.drop)
    }

    /// Replaces the VM's lists with the group's, overridden per field by
    /// `overrides`. Takes effect on the host with [`NetworkManager::ensure`].
    pub fn set_policy(
        &mut self,
        cfg: &NetworkConfig,
        overrides: Option<&PolicyOverride>,
    ) -> Result<(), NetworkError> {
        let (allow, drop) = resolve_policy(&self.group, self.mode, cfg, overrides)?;
        self.allow = allow;
        self.drop = drop;
        self.policy_override = overrides.filter(|o| !o.is_empty()).cloned();
        Ok(())
    }

    /// The policy as `describe` shows it: the group's lists, the override
    /// and the lists in force.
    pub fn policy_report(&self, cfg: &NetworkConfig) -> PolicyReport {
        PolicyReport {
            mode: self.mode,
            policy_source: self.policy_source(),
            host_group: Policy::new(cfg.allow.clone(), cfg.drop.clone()),
            overrides: self.policy_override.clone(),
            effective: Policy::new(self.allow.clone(), self.drop.clone()),
        }
    }
}

/// The group's lists overridden per field, checked.
fn resolve_policy(
    group: &str,
    mode: NetMode,
    cfg: &NetworkConfig,
    overrides: Option<&PolicyOverride>,
) -> Result<(Vec<String>, Vec<String>), NetworkError> {
    let allow = overrides
        .and_then(|o| o.allow.clone())
        .unwrap_or_else(|| cfg.allow.clone());
    let drop = overrides
        .and_then(|o| o.drop.clone())
        .unwrap_or_else(|| cfg.drop.clone());
    if mode != NetMode::Isolated {
        let field = if !allow.is_empty() {
            Some("allow")
        } else if !drop.is_empty() {
            Some("drop")
        } else {
            None
        };
        if let Some(field) = field {
            return Err(NetworkError::FieldNotForMode {
                group: group.to_owned(),
                field,
                mode,
            });
        }
    }
    validation::parse_entries("allow", &allow)?;
    validation::parse_entries("drop", &drop)?;
    Ok((allow, drop))
}

/// Names the manager uses on the host; the defaults are right for the
/// daemon, tests pick their own so they never touch its objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagerOptions {
    /// The nftables table (family `inet`), default `tine`.
    pub table: String,
    /// Prefix of TAP names, default `tt-` (1 to 5 bytes).
    pub tap_prefix: String,
    /// Prefix of derived bridge names, default `tbr-` (1 to 5 bytes).
    pub bridge_prefix: String,
}

impl Default for ManagerOptions {
    fn default() -> Self {
        Self {
            table: "tine".to_owned(),
            tap_prefix: DEFAULT_TAP_PREFIX.to_owned(),
            bridge_prefix: DEFAULT_BRIDGE_PREFIX.to_owned(),
        }
    }
}

/// The manager's handles on the host: a route netlink socket, opened on
/// first use (so that planning works without root), and the nft runner.
#[derive(Debug, Default)]
struct Host {
    rtnl: Option<Rtnl>,
    nft: Option<Nftables>,
}

impl Host {
    fn rtnl(&mut self) -> Result<&mut Rtnl, NetworkError> {
        Ok(match self.rtnl {
            Some(ref mut rtnl) => rtnl,
            None => self.rtnl.insert(Rtnl::open()?),
        })
    }

    fn nft(&mut self) -> Result<&mut Nftables, NetworkError> {
        Ok(match self.nft {
            Some(ref mut nft) => nft,
            None => self.nft.insert(Nftables::open()?),
        })
    }

    /// Applies one nft script atomically.
    fn nft_apply(&mut self, script: &str) -> Result<(), NetworkError> {
        self.nft()?.run(script).map(drop)
    }
}

/// Creates and removes the host side of VM networks: bridges, TAPs,
/// addresses and nftables rules. Operations are serialized by an internal
/// lock; the host (the kernel's links and our nft table) is the only state,
/// so a new manager picks up where an old one left off.
#[derive(Debug)]
pub struct NetworkManager {
    options: ManagerOptions,
    lock: Mutex<Host>,
}

impl Default for NetworkManager {
    fn default() -> Self {
        Self {
            options: ManagerOptions::default(),
            lock: Mutex::new(Host::default()),
        }
    }
}

impl NetworkManager {
    /// A manager with the given names (checked; nothing on the host is
    /// touched yet).
    pub fn new(options: ManagerOptions) -> Result<Self, NetworkError> {
        let table = &options.table;
        if table.is_empty()
            || table.len() > 64
            || !table.starts_with(|c: char| c.is_ascii_alphabetic())
            || !table.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(NetworkError::BadOption {
                option: "table",
                value: table.clone(),
                reason: "must be 1 to 64 letters, digits or '_', starting with a letter",
            });
        }
        names::check_prefix("tap_prefix", &options.tap_prefix)?;
        names::check_prefix("bridge_prefix", &options.bridge_prefix)?;
        if options.tap_prefix.starts_with(&options.bridge_prefix)
            || options.bridge_prefix.starts_with(&options.tap_prefix)
        {
            return Err(NetworkError::BadOption {
                option: "bridge_prefix",
                value: options.bridge_prefix.clone(),
                reason: "neither of tap_prefix and bridge_prefix may start with the other",
            });
        }
        Ok(Self {
            options,
            lock: Mutex::new(Host::default()),
        })
    }

    /// The manager's names.
    pub fn options(&self) -> &ManagerOptions {
        &self.options
    }

    fn lock(&self) -> MutexGuard<'_, Host> {
        // The state that matters is on the host; the handles survive a
        // panic elsewhere unharmed.
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The TAP name of VM `hostname`: `tt-<hostname>` when it fits in 15
    /// bytes, else shortened with a hash.
    pub fn tap_name(&self, hostname: &str) -> Result<String, NetworkError> {
        names::check_hostname(hostname)?;
        Ok(names::tap_name(&self.options.tap_prefix, hostname))
    }

    /// The bridge of a bridge-mode group: its `bridge` field, or
    /// `tbr-<group>` (shortened with a hash when too long).
    pub fn bridge_name(&self, group: &str, cfg: &NetworkConfig) -> String {
        names::bridge_name(&self.options.bridge_prefix, group, cfg)
    }

    /// Decides a VM's network without touching the host: the lowest free
    /// address of the group's range (`in_use`: the guest addresses the
    /// group's other VMs hold), TAP name and MAC from the hostname, and the
    /// group's allow/drop lists overridden per field by `overrides`.
    /// `None` in mode `none`.
    pub fn plan(
        &self,
        group: &str,
        cfg: &NetworkConfig,
        hostname: &str,
        in_use: &[Ipv4Addr],
        overrides: Option<&PolicyOverride>,
    ) -> Result<Option<VmNetwork>, NetworkError> {
        validate(group, cfg)?;
        let Some(range) = group_range(group, cfg) else {
            return Ok(None);
        };
        let tap = self.tap_name(hostname)?;
        let (allow, drop) = resolve_policy(group, cfg.mode, cfg, overrides)?;
        let lease = addr::allocate(group, cfg.mode, range, in_use)?;
        Ok(Some(VmNetwork {
            group: group.to_owned(),
            hostname: hostname.to_owned(),
            mode: cfg.mode,
            tap,
            bridge: (cfg.mode == NetMode::Bridge).then(|| self.bridge_name(group, cfg)),
            mac: vm_mac(hostname),
            address: lease.address,
            prefix: lease.prefix,
            gateway: lease.gateway,
            dns: cfg.dns.clone(),
            allow,
            drop,
            policy_override: overrides.filter(|o| !o.is_empty()).cloned(),
        }))
    }

    /// Plans the VM's network ([`NetworkManager::plan`]) and sets it up on
    /// the host ([`NetworkManager::ensure`]). A TAP of the same name that
    /// this VM already owns is reused. When setting up fails, what was
    /// created is removed again. `None` in mode `none`.
    pub fn attach(
        &self,
        group: &str,
        cfg: &NetworkConfig,
        hostname: &str,
        in_use: &[Ipv4Addr],
        overrides: Option<&PolicyOverride>,
    ) -> Result<Option<VmNetwork>, NetworkError> {
        let Some(vm) = self.plan(group, cfg, hostname, in_use, overrides)? else {
            return Ok(None);
        };
        let mut host = self.lock();
        let existed = host.rtnl()?.link(&vm.tap)?.is_some();
        if let Err(err) = self.ensure_locked(&mut host, &vm) {
            if !existed {
                // Best effort: the original error is the one to report.
                if let Err(e) = self.detach_locked(&mut host, &vm) {
                    tracing::warn!(tap = %vm.tap, "undo a failed attach: {e}");
                }
            }
            return Err(err);
        }
        Ok(Some(vm))
    }

    /// Makes the host match `vm`, creating what is missing: the nft rules
    /// (before the TAP exists, so an isolated TAP is never open), the bridge
    /// with the gateway address (bridge mode), the TAP (vnet_hdr, alias =
    /// hostname, up) on the bridge or with the gateway /30 (isolated), and
    /// IPv4 forwarding. Idempotent; also applies a changed policy.
    pub fn ensure(&self, vm: &VmNetwork) -> Result<(), NetworkError> {
        self.ensure_locked(&mut self.lock(), vm)
    }

    /// Re-applies only the VM's nft rules, e.g. after
    /// [`VmNetwork::set_policy`] on a running VM; links are left alone.
    /// Then the VM's conntrack entries are deleted, so an established
    /// connection the new policy forbids is cut: its next packet is judged
    /// by the new rules as if it were new (the kernel picks up a TCP stream
    /// mid-way), and dropped.
    pub fn update_policy(&self, vm: &VmNetwork) -> Result<(), NetworkError> {
        Self::check_record(vm)?;
        let mut host = self.lock();
        host.nft_apply(&self.rules_script(vm)?)?;
        if vm.mode == NetMode::Isolated {
            ctnl::delete_from_source(vm.address)?;
        }
        Ok(())
    }

    /// The nft script that asserts the VM's rules.
    fn rules_script(&self, vm: &VmNetwork) -> Result<String, NetworkError> {
        let table = &self.options.table;
        let mut script = nft::base(table);
        match vm.mode {
            NetMode::None => {}
            NetMode::Isolated => {
                let allow = validation::parse_entries("allow", &vm.allow)?;
                let drop = validation::parse_entries("drop", &vm.drop)?;
                script.push_str(&nft::add_isolated(
                    table,
                    &vm.tap,
                    vm.address,
                    &allow,
                    &drop,
                    vm.default_action(),
                ));
            }
            NetMode::Bridge => {
                script.push_str(&nft::remove_isolated(table, &vm.tap));
                script.push_str(&nft::add_bridge(table, record_bridge(vm)?));
            }
        }
        Ok(script)
    }

    fn check_record(vm: &VmNetwork) -> Result<(), NetworkError> {
        names::check_ifname(&vm.tap)?;
        names::check_hostname(&vm.hostname)?;
        if let Some(bridge) = &vm.bridge {
            names::check_ifname(bridge)?;
        }
        if vm.mode == NetMode::Isolated && vm.bridge.is_some() {
            return Err(NetworkError::BadRecord {
                tap: vm.tap.clone(),
                reason: "isolated mode with a bridge",
            });
        }
        Ok(())
    }

    fn ensure_locked(&self, host: &mut Host, vm: &VmNetwork) -> Result<(), NetworkError> {
        Self::check_record(vm)?;
        let bridge = match vm.mode {
            NetMode::None => return Ok(()),
            NetMode::Isolated => None,
            NetMode::Bridge => Some(record_bridge(vm)?),
        };
        // Check an existing TAP before touching anything: rules written for
        // another VM's TAP would break that VM.
        let existing = host.rtnl()?.link(&vm.tap)?;
        if let Some(link) = &existing {
            if link.kind.as_deref() != Some("tap") {
                return Err(NetworkError::WrongKind {
                    name: vm.tap.clone(),
                    kind: link.kind.clone().unwrap_or_else(|| "plain".to_owned()),
                    expected: "tap",
                });
            }
            check_owner(link, vm)?;
        }

        host.nft_apply(&self.rules_script(vm)?)?;
        let rtnl = host.rtnl()?;
        let bridge_index = match bridge {
            Some(bridge) => Some(ensure_bridge(rtnl, bridge, vm.gateway, vm.prefix)?),
            None => None,
        };
        let link = match existing {
            Some(link) => link,
            None => {
                tun::create_tap(&vm.tap)?;
                rtnl.link(&vm.tap)?.ok_or_else(|| NetworkError::Netlink {
                    operation: format!("find the new TAP {}", vm.tap),
                    source: std::io::Error::from_raw_os_error(libc::ENODEV),
                })?
            }
        };

        let addrs = rtnl.ipv4_addrs(link.index)?;
        let want = match bridge_index {
            // On a bridge the TAP has no address of its own.
            Some(_) => vec![],
            None => vec![(vm.gateway, vm.prefix)],
        };
        if addrs != want {
            for &(address, prefix) in &addrs {
                rtnl.del_addr(link.index, address, prefix)?;
            }
        }
        let master = bridge_index.unwrap_or(0);
        let change = LinkChange {
            alias: (link.alias.as_deref() != Some(vm.hostname.as_str()))
                .then_some(vm.hostname.as_str()),
            master: (link.master.unwrap_or(0) != master).then_some(master),
            up: (!link.up).then_some(true),
        };
        if change.alias.is_some() || change.master.is_some() || change.up.is_some() {
            rtnl.set_link(link.index, change)?;
        }
        if addrs != want {
            for &(address, prefix) in &want {
                rtnl.add_addr(link.index, address, prefix, false)?;
            }
        }
        sys::enable_ip_forward()
    }

    /// Puts the VM's TAP in network quarantine (down: nothing it sends is
    /// received, nothing reaches it) or takes it out (up). A hot fork waits
    /// in quarantine until its guest has its own MAC and address.
    pub fn set_quarantine(&self, vm: &VmNetwork, quarantined: bool) -> Result<(), NetworkError> {
        Self::check_record(vm)?;
        if vm.mode == NetMode::None {
            return Ok(());
        }
        let mut host = self.lock();
        let rtnl = host.rtnl()?;
        let link = rtnl.link(&vm.tap)?.ok_or_else(|| NetworkError::Netlink {
            operation: format!("find the TAP {}", vm.tap),
            source: std::io::Error::from_raw_os_error(libc::ENODEV),
        })?;
        check_owner(&link, vm)?;
        if link.up == quarantined {
            rtnl.set_link(
                link.index,
                LinkChange {
                    up: Some(!quarantined),
                    ..LinkChange::default()
                },
            )?;
        }
        Ok(())
    }

    /// Hands a spare network (attached in advance under a spare's own
    /// hostname, then put in quarantine) to VM `hostname`: the TAP, its
    /// rules, its address and its MAC (made from the spare's hostname, as
    /// unique) stay as they are, so that a guest primed with them keeps
    /// them; the TAP's alias becomes `hostname`, and the record returned is
    /// the VM's. The TAP must still be the spare's and down: a spare only
    /// ever goes to a hot fork, which starts in quarantine.
    pub fn hand_over(&self, spare: &VmNetwork, hostname: &str) -> Result<VmNetwork, NetworkError> {
        Self::check_record(spare)?;
        names::check_hostname(hostname)?;
        let taken = VmNetwork {
            hostname: hostname.to_owned(),
            ..spare.clone()
        };
        if spare.mode == NetMode::None {
            return Ok(taken);
        }
        let mut host = self.lock();
        let rtnl = host.rtnl()?;
        let link = rtnl
            .link(&spare.tap)?
            .ok_or_else(|| NetworkError::Netlink {
                operation: format!("find the spare TAP {}", spare.tap),
                source: std::io::Error::from_raw_os_error(libc::ENODEV),
            })?;
        if link.kind.as_deref() != Some("tap") {
            return Err(NetworkError::WrongKind {
                name: spare.tap.clone(),
                kind: link.kind.clone().unwrap_or_else(|| "plain".to_owned()),
                expected: "tap",
            });
        }
        if link.alias.as_deref() != Some(spare.hostname.as_str()) {
            return Err(NetworkError::NameCollision {
                name: spare.tap.clone(),
                hostname: hostname.to_owned(),
                owner: link.alias.clone().unwrap_or_default(),
            });
        }
        if link.up {
            return Err(NetworkError::BadRecord {
                tap: spare.tap.clone(),
                reason: "a spare TAP is up: it must wait in quarantine",
            });
        }
        rtnl.set_link(
            link.index,
            LinkChange {
                alias: Some(hostname),
                ..LinkChange::default()
            },
        )?;
        Ok(taken)
    }

    /// Removes the VM's TAP, then its rules. A TAP already gone is fine; a
    /// TAP recorded as another VM's is left alone (error). The bridge stays
    /// for the group's other VMs ([`NetworkManager::cleanup_orphans`]
    /// removes unused ones).
    pub fn detach(&self, vm: &VmNetwork) -> Result<(), NetworkError> {
        self.detach_locked(&mut self.lock(), vm)
    }

    fn detach_locked(&self, host: &mut Host, vm: &VmNetwork) -> Result<(), NetworkError> {
        Self::check_record(vm)?;
        let rtnl = host.rtnl()?;
        if let Some(link) = rtnl.link(&vm.tap)? {
            check_owner(&link, vm)?;
            if link.kind.as_deref() == Some("tap") {
                rtnl.del_link(link.index, &link.name)?;
            }
        }
        let table = &self.options.table;
        let mut script = nft::base(table);
        script.push_str(&nft::remove_isolated(table, &vm.tap));
        host.nft_apply(&script)
    }

    /// Removes the TAPs and bridges with our prefixes, and the rules and set
    /// elements in our table, that no VM in `keep` owns (links first, so no
    /// isolated TAP is ever left without its rules). Returns the names
    /// removed, sorted. Does not re-create what a kept VM lacks; call
    /// [`NetworkManager::ensure`] for that.
    pub fn cleanup_orphans(&self, keep: &[VmNetwork]) -> Result<Vec<String>, NetworkError> {
        let mut host = self.lock();
        let opts = &self.options;
        let keep_taps: HashSet<&str> = keep.iter().map(|v| v.tap.as_str()).collect();
        let keep_iso: HashSet<&str> = keep
            .iter()
            .filter(|v| v.mode == NetMode::Isolated)
            .map(|v| v.tap.as_str())
            .collect();
        let keep_bridges: HashSet<&str> = keep.iter().filter_map(|v| v.bridge.as_deref()).collect();
        let mut removed = BTreeSet::new();

        let rtnl = host.rtnl()?;
        for link in rtnl.links()? {
            let orphan_tap = link.name.starts_with(&opts.tap_prefix)
                && link.kind.as_deref() == Some("tap")
                && !keep_taps.contains(link.name.as_str());
            let orphan_bridge = link.name.starts_with(&opts.bridge_prefix)
                && link.kind.as_deref() == Some("bridge")
                && !keep_bridges.contains(link.name.as_str());
            if orphan_tap || orphan_bridge {
                rtnl.del_link(link.index, &link.name)?;
                removed.insert(link.name);
            }
        }

        let table = &opts.table;
        host.nft_apply(&nft::base(table))?;
        let state = sys::table_state(host.nft()?, table)?;
        let chain_taps = state
            .chains
            .iter()
            .filter_map(|c| c.strip_prefix("vm-"))
            .map(str::to_owned);
        let iso_orphans: BTreeSet<String> = chain_taps
            .chain(state.iso_ifs.iter().cloned())
            .chain(state.iso_fwd.iter().cloned())
            .filter(|tap| !keep_iso.contains(tap.as_str()))
            .collect();
        let nat_orphans: BTreeSet<String> = state
            .nat_ifs
            .iter()
            .filter(|name| {
                !keep_iso.contains(name.as_str())
                    && !keep_bridges.contains(name.as_str())
                    && !iso_orphans.contains(*name)
            })
            .cloned()
            .collect();
        let mut script = String::new();
        for tap in &iso_orphans {
            names::check_ifname(tap)?;
            script.push_str(&nft::remove_isolated(table, tap));
        }
        for name in &nat_orphans {
            names::check_ifname(name)?;
            script.push_str(&nft::remove_bridge(table, name));
        }
        if !script.is_empty() {
            host.nft_apply(&script)?;
        }
        removed.extend(iso_orphans);
        removed.extend(nat_orphans);
        Ok(removed.into_iter().collect())
    }

    /// Removes everything the manager made: every TAP and bridge with our
    /// prefixes and the whole nft table. Returns the interface and rule
    /// owner names removed.
    pub fn teardown(&self) -> Result<Vec<String>, NetworkError> {
        let removed = self.cleanup_orphans(&[])?;
        self.lock()
            .nft_apply(&nft::delete_table(&self.options.table))?;
        Ok(removed)
    }
}

/// The bridge of a bridge-mode record.
fn record_bridge(vm: &VmNetwork) -> Result<&str, NetworkError> {
    vm.bridge.as_deref().ok_or_else(|| NetworkError::BadRecord {
        tap: vm.tap.clone(),
        reason: "bridge mode without a bridge",
    })
}

/// Fails when the TAP's alias names another VM.
fn check_owner(link: &rtnl::Link, vm: &VmNetwork) -> Result<(), NetworkError> {
    match link.alias.as_deref() {
        Some(owner) if !owner.is_empty() && owner != vm.hostname => {
            Err(NetworkError::NameCollision {
                name: vm.tap.clone(),
                hostname: vm.hostname.clone(),
                owner: owner.to_owned(),
            })
        }
        _ => Ok(()),
    }
}

/// Creates the bridge (fixed MAC) if missing, gives it the gateway address
/// and brings it up. Returns its interface index.
fn ensure_bridge(
    rtnl: &mut Rtnl,
    bridge: &str,
    gateway: Ipv4Addr,
    prefix: u8,
) -> Result<u32, NetworkError> {
    let link = match rtnl.link(bridge)? {
        Some(link) => link,
        None => {
            rtnl.add_bridge(bridge, names::bridge_mac(bridge))?;
            rtnl.link(bridge)?.ok_or_else(|| NetworkError::Netlink {
                operation: format!("find the new bridge {bridge}"),
                source: std::io::Error::from_raw_os_error(libc::ENODEV),
            })?
        }
    };
    if link.kind.as_deref() != Some("bridge") {
        return Err(NetworkError::WrongKind {
            name: bridge.to_owned(),
            kind: link.kind.unwrap_or_else(|| "plain".to_owned()),
            expected: "bridge",
        });
    }
    if !rtnl.ipv4_addrs(link.index)?.contains(&(gateway, prefix)) {
        rtnl.add_addr(link.index, gateway, prefix, true)?;
    }
    if !link.up {
        rtnl.set_link(
            link.index,
            LinkChange {
                up: Some(true),
                ..LinkChange::default()
            },
        )?;
    }
    Ok(link.index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn isolated(cidr: &str) -> NetworkConfig {
        NetworkConfig {
            mode: NetMode::Isolated,
            cidr: Some(cidr.parse().expect("cidr")),
            allow: vec!["0.0.0.0/0".into()],
            drop: vec![],
            dns: vec!["1.1.1.1".parse().expect("ip")],
            bridge: None,
        }
    }

    #[test]
    fn plan_isolated() {
        let m = NetworkManager::default();
        let cfg = isolated("169.254.40.0/22");
        let vm = m
            .plan("g", &cfg, "g-1", &[], None)
            .expect("plan")
            .expect("some");
        assert_eq!(vm.tap, "tt-g-1");
        assert_eq!(vm.bridge, None);
        assert_eq!(vm.address, "169.254.40.2".parse::<Ipv4Addr>().expect("ip"));
        assert_eq!(vm.gateway, "169.254.40.1".parse::<Ipv4Addr>().expect("ip"));
        assert_eq!(vm.prefix, 30);
        assert_eq!(vm.mac, vm_mac("g-1"));
        assert_eq!(vm.allow, ["0.0.0.0/0"]);
        assert_eq!(vm.policy_source(), PolicySource::HostGroup);
        assert_eq!(vm.vmm_net_arg(), format!("tt-g-1,{}", vm.mac));
        let req = vm.agent_request();
        assert_eq!(req.iface, "eth0");
        assert_eq!(req.address, vm.address);
        assert_eq!(req.prefix, 30);
        assert_eq!(req.gateway, Some(vm.gateway));
        assert_eq!(req.dns, cfg.dns);

        let json = serde_json::to_string(&vm).expect("ser");
        assert_eq!(serde_json::from_str::<VmNetwork>(&json).expect("de"), vm);
    }

    #[test]
    fn plan_bridge_and_none() {
        let m = NetworkManager::default();
        let cfg = NetworkConfig {
            mode: NetMode::Bridge,
            cidr: Some("169.254.100.0/24".parse().expect("cidr")),
            ..Default::default()
        };
        let used = ["169.254.100.2".parse().expect("ip")];
        let vm = m
            .plan("web", &cfg, "web-2", &used, None)
            .expect("plan")
            .expect("some");
        assert_eq!(vm.bridge.as_deref(), Some("tbr-web"));
        assert_eq!(vm.address, "169.254.100.3".parse::<Ipv4Addr>().expect("ip"));
        assert_eq!(vm.prefix, 24);
        assert_eq!(vm.gateway, "169.254.100.1".parse::<Ipv4Addr>().expect("ip"));

        let over = PolicyOverride {
            allow: Some(vec!["1.1.1.1".into()]),
            drop: None,
        };
        let err = m
            .plan("web", &cfg, "web-2", &[], Some(&over))
            .expect_err("no policy in bridge mode");
        assert!(err.to_string().contains("`allow` is not used"), "{err}");

        let none = m
            .plan("x", &NetworkConfig::default(), "x-1", &[], None)
            .expect("plan");
        assert_eq!(none, None);
    }

    #[test]
    fn overrides_replace_per_field() {
        let m = NetworkManager::default();
        let mut cfg = isolated("169.254.40.0/22");
        cfg.drop = vec!["10.0.0.0/8".into()];
        let over = PolicyOverride {
            allow: Some(vec![]),
            drop: None,
        };
        let mut vm = m
            .plan("g", &cfg, "g-1", &[], Some(&over))
            .expect("plan")
            .expect("some");
        assert!(vm.allow.is_empty());
        assert_eq!(vm.drop, ["10.0.0.0/8"]);
        assert_eq!(vm.policy_source(), PolicySource::Override);
        assert_eq!(vm.default_action(), DefaultAction::Allow);

        let report = vm.policy_report(&cfg);
        assert_eq!(report.host_group.allow, ["0.0.0.0/0"]);
        assert_eq!(report.effective.drop, ["10.0.0.0/8"]);
        let json = serde_json::to_value(&report).expect("ser");
        assert_eq!(json["policy_source"], "override");
        assert_eq!(json["override"]["allow"], serde_json::json!([]));
        assert_eq!(json["effective"]["default"], "allow");

        let closed = PolicyOverride {
            allow: Some(vec!["169.254.1.1:53".into()]),
            drop: Some(vec![]),
        };
        vm.set_policy(&cfg, Some(&closed)).expect("set");
        assert_eq!(vm.default_action(), DefaultAction::Deny);
        vm.set_policy(&cfg, None).expect("back to the group");
        assert_eq!(vm.policy_source(), PolicySource::HostGroup);
        assert_eq!(vm.allow, ["0.0.0.0/0"]);

        let bad = PolicyOverride {
            allow: Some(vec!["nope".into()]),
            drop: None,
        };
        let err = m
            .plan("g", &cfg, "g-1", &[], Some(&bad))
            .expect_err("bad entry");
        assert!(
            err.to_string().starts_with("bad allow entry \"nope\""),
            "{err}"
        );
    }

    #[test]
    fn plan_errors() {
        let m = NetworkManager::default();
        let cfg = isolated("169.254.40.0/30");
        let one = m
            .plan("g", &cfg, "g-1", &[], None)
            .expect("plan")
            .expect("some");
        let err = m
            .plan("g", &cfg, "g-2", &[one.address], None)
            .expect_err("full");
        assert!(
            matches!(err, NetworkError::PoolExhausted { capacity: 1, .. }),
            "{err}"
        );
        let err = m.plan("g", &cfg, "a b", &[], None).expect_err("hostname");
        assert!(err.to_string().contains("bad hostname"), "{err}");
    }

    #[test]
    fn options_are_checked() {
        let opts = |table: &str, tap: &str, bridge: &str| ManagerOptions {
            table: table.into(),
            tap_prefix: tap.into(),
            bridge_prefix: bridge.into(),
        };
        NetworkManager::new(ManagerOptions::default()).expect("defaults");
        NetworkManager::new(opts("tine_test_1", "xa", "xab-")).expect_err("prefix of the other");
        NetworkManager::new(opts("tine_test_1", "xa-", "xb-")).expect("ok");
        NetworkManager::new(opts("1tine", "xa-", "xb-")).expect_err("table");
        NetworkManager::new(opts("ti ne", "xa-", "xb-")).expect_err("table");
        NetworkManager::new(opts("tine", "toolong", "xb-")).expect_err("tap prefix");
        let m = NetworkManager::new(opts("t", "xa-", "xb-")).expect("ok");
        assert_eq!(m.tap_name("web-1").expect("name"), "xa-web-1");
        assert_eq!(
            m.bridge_name("g", &NetworkConfig::default()),
            "xb-g".to_owned()
        );
    }
}
