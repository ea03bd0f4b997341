//! The address plan: each group's range and the allocation of VM addresses
//! in it.
//!
//! - Bridge: the host (gateway) holds the first usable address of the
//!   group's CIDR, VMs get the following ones up to the last before the
//!   broadcast address.
//! - Isolated: the range (default: a /22 in 169.254.0.0/16 chosen by a hash
//!   of the group name) is cut into /30s, one per VM: `.1` is the host side
//!   (gateway), `.2` the guest.

use std::collections::HashSet;
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use super::config::{NetMode, NetworkConfig};
use super::error::NetworkError;
use super::names::fnv1a64;

/// Prefix length of the default isolated range of a group.
pub const ISOLATED_RANGE_PREFIX: u8 = 22;
/// Prefix length of one isolated VM's network.
pub const ISOLATED_VM_PREFIX: u8 = 30;

/// The default isolated range of a group: a /22 of 169.254.0.0/16 picked by
/// a stable hash of the group name (256 VMs). The first and last /22 hold
/// 169.254.0.x and 169.254.255.x, which RFC 3927 reserves, and the /22 of
/// 169.254.169.254 would shadow cloud metadata services: none of those is
/// ever picked, which leaves 61 ranges.
pub fn isolated_default_range(group: &str) -> Ipv4Net {
    const METADATA_BLOCK: u64 = 169 / 4;
    let candidates: Vec<u64> = (1..63).filter(|i| *i != METADATA_BLOCK).collect();
    let pick = fnv1a64(group.as_bytes()) % candidates.len() as u64;
    // The index is below the length, so the lookup cannot fail; 1 is a
    // harmless fallback that keeps this function total.
    let block = candidates
        .get(usize::try_from(pick).unwrap_or(0))
        .copied()
        .unwrap_or(1);
    let third = u8::try_from(block * 4).unwrap_or(4);
    Ipv4Net::new(Ipv4Addr::new(169, 254, third, 0), ISOLATED_RANGE_PREFIX)
        .unwrap_or_else(|_| Ipv4Net::from(Ipv4Addr::new(169, 254, 4, 0)))
}

/// The address range a group's VMs live in: the configured CIDR, or the
/// derived isolated /22; `None` in mode `none`.
pub fn group_range(group: &str, cfg: &NetworkConfig) -> Option<Ipv4Net> {
    match cfg.mode {
        NetMode::None => None,
        NetMode::Bridge => cfg.cidr,
        NetMode::Isolated => Some(cfg.cidr.unwrap_or_else(|| isolated_default_range(group))),
    }
}

/// How many VMs a group's range holds.
pub fn capacity(mode: NetMode, range: Ipv4Net) -> u32 {
    let size = 1u64 << (32 - u32::from(range.prefix_len()));
    let count = match mode {
        NetMode::None => 0,
        // Minus network, gateway and broadcast.
        NetMode::Bridge => size.saturating_sub(3),
        NetMode::Isolated => size / 4,
    };
    u32::try_from(count).unwrap_or(u32::MAX)
}

/// A VM's place in its group's range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lease {
    pub address: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Ipv4Addr,
}

fn offset(base: Ipv4Addr, n: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(base).wrapping_add(n))
}

/// The lease holding `address` in the range, if `address` is a VM address
/// of it.
pub(crate) fn lease_of(mode: NetMode, range: Ipv4Net, address: Ipv4Addr) -> Option<Lease> {
    if !range.contains(&address) {
        return None;
    }
    let index = u32::from(address) - u32::from(range.network());
    match mode {
        NetMode::None => None,
        NetMode::Bridge => {
            let last = u32::from(range.broadcast()) - u32::from(range.network());
            (index >= 2 && index < last).then(|| Lease {
                address,
                prefix: range.prefix_len(),
                gateway: offset(range.network(), 1),
            })
        }
        NetMode::Isolated => (index % 4 == 2).then(|| Lease {
            address,
            prefix: ISOLATED_VM_PREFIX,
            gateway: offset(address, u32::MAX), // address - 1
        }),
    }
}

/// The first free lease of the range: the lowest VM address not in
/// `in_use`, so freed addresses are reused.
pub(crate) fn allocate(
    group: &str,
    mode: NetMode,
    range: Ipv4Net,
    in_use: &[Ipv4Addr],
) -> Result<Lease, NetworkError> {
    let used: HashSet<Ipv4Addr> = in_use.iter().copied().collect();
    let total = capacity(mode, range);
    let candidate = |i: u32| match mode {
        NetMode::Isolated => offset(range.network(), i * 4 + 2),
        _ => offset(range.network(), i + 2),
    };
    (0..total)
        .map(candidate)
        .find(|a| !used.contains(a))
        .and_then(|a| lease_of(mode, range, a))
        .ok_or_else(|| NetworkError::PoolExhausted {
            group: group.to_owned(),
            cidr: range,
            capacity: total,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("test cidr")
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().expect("test ip")
    }

    #[test]
    fn bridge_allocation() {
        let range = net("169.254.100.0/24");
        assert_eq!(capacity(NetMode::Bridge, range), 253);
        let first = allocate("g", NetMode::Bridge, range, &[]).expect("first");
        assert_eq!(
            first,
            Lease {
                address: ip("169.254.100.2"),
                prefix: 24,
                gateway: ip("169.254.100.1"),
            }
        );
        let used = [ip("169.254.100.2"), ip("169.254.100.3")];
        let next = allocate("g", NetMode::Bridge, range, &used).expect("next");
        assert_eq!(next.address, ip("169.254.100.4"));
        // .2 freed: reused first.
        let used = [ip("169.254.100.3"), ip("169.254.100.4")];
        let reused = allocate("g", NetMode::Bridge, range, &used).expect("reuse");
        assert_eq!(reused.address, ip("169.254.100.2"));
    }

    #[test]
    fn bridge_exhaustion() {
        let range = net("169.254.100.0/29");
        assert_eq!(capacity(NetMode::Bridge, range), 5);
        let used: Vec<Ipv4Addr> = (2..7).map(|i| ip(&format!("169.254.100.{i}"))).collect();
        let err = allocate("g", NetMode::Bridge, range, &used).expect_err("full");
        assert_eq!(
            err.to_string(),
            "group \"g\": no free address left in 169.254.100.0/29 (5 VMs)"
        );
        let range = net("169.254.100.0/30");
        let only = allocate("g", NetMode::Bridge, range, &[]).expect("one VM");
        assert_eq!(only.address, ip("169.254.100.2"));
        assert!(allocate("g", NetMode::Bridge, range, &[only.address]).is_err());
    }

    #[test]
    fn isolated_allocation() {
        let range = net("169.254.40.0/22");
        assert_eq!(capacity(NetMode::Isolated, range), 256);
        let first = allocate("g", NetMode::Isolated, range, &[]).expect("first");
        assert_eq!(
            first,
            Lease {
                address: ip("169.254.40.2"),
                prefix: 30,
                gateway: ip("169.254.40.1"),
            }
        );
        let second = allocate("g", NetMode::Isolated, range, &[first.address]).expect("second");
        assert_eq!(second.address, ip("169.254.40.6"));
        assert_eq!(second.gateway, ip("169.254.40.5"));
        let reused = allocate("g", NetMode::Isolated, range, &[second.address]).expect("reuse");
        assert_eq!(reused.address, ip("169.254.40.2"));

        let all: Vec<Ipv4Addr> = (0..256u32)
            .map(|i| offset(range.network(), i * 4 + 2))
            .collect();
        assert_eq!(all.last(), Some(&ip("169.254.43.254")));
        let err = allocate("g", NetMode::Isolated, range, &all).expect_err("full");
        assert!(err.to_string().contains("(256 VMs)"), "{err}");
        let almost = &all[..255];
        let last = allocate("g", NetMode::Isolated, range, almost).expect("last");
        assert_eq!(last.address, ip("169.254.43.254"));
        assert_eq!(last.gateway, ip("169.254.43.253"));
    }

    #[test]
    fn leases_of_addresses() {
        let range = net("169.254.40.0/22");
        assert!(lease_of(NetMode::Isolated, range, ip("169.254.40.1")).is_none());
        assert!(lease_of(NetMode::Isolated, range, ip("169.254.44.2")).is_none());
        let bridge = net("169.254.100.0/24");
        assert!(lease_of(NetMode::Bridge, bridge, ip("169.254.100.1")).is_none());
        assert!(lease_of(NetMode::Bridge, bridge, ip("169.254.100.255")).is_none());
        assert!(lease_of(NetMode::Bridge, bridge, ip("169.254.100.254")).is_some());
    }

    #[test]
    fn default_isolated_range_is_stable_and_safe() {
        // Pinned: a change here would move every running group's VMs.
        for (group, range) in [
            ("runners", "169.254.232.0/22"),
            ("a", "169.254.148.0/22"),
            ("sandbox", "169.254.248.0/22"),
        ] {
            assert_eq!(isolated_default_range(group), net(range), "{group}");
        }
        let metadata = ip("169.254.169.254");
        for i in 0..2000 {
            let range = isolated_default_range(&format!("group-{i}"));
            assert_eq!(range.prefix_len(), 22);
            assert!(net("169.254.0.0/16").contains(&range));
            assert!(!range.contains(&metadata));
            assert!(!range.contains(&ip("169.254.0.1")));
            assert!(!range.contains(&ip("169.254.255.1")));
            assert_eq!(range.network(), range.addr());
        }
    }

    #[test]
    fn group_ranges() {
        let cfg = NetworkConfig {
            mode: NetMode::Isolated,
            ..Default::default()
        };
        assert_eq!(group_range("g", &cfg), Some(isolated_default_range("g")));
        let cfg = NetworkConfig {
            mode: NetMode::Isolated,
            cidr: Some(net("169.254.200.0/24")),
            ..Default::default()
        };
        assert_eq!(group_range("g", &cfg), Some(net("169.254.200.0/24")));
        assert_eq!(group_range("g", &NetworkConfig::default()), None);
    }
}
