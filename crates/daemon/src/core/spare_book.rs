//! The book of spares (see `spares`): the networks and disks made ahead
//! of hot forks that are ready, the networks being made, and the guest
//! addresses they hold. Plain data; the daemon keeps it behind a lock.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use crate::network::VmNetwork;

/// Spares by owner: networks by host group, disks by memory commit.
#[derive(Debug, Default)]
pub struct SpareBook {
    /// Ready networks per host group, oldest first.
    networks: BTreeMap<String, Vec<VmNetwork>>,
    /// Networks being made (their addresses are taken already).
    making: Vec<VmNetwork>,
    /// Ready disks per memory commit, oldest first.
    disks: BTreeMap<String, Vec<PathBuf>>,
}

/// Spares the book let go of: the caller removes them from the host.
#[derive(Debug, Default)]
pub struct Released {
    /// Networks to detach.
    pub networks: Vec<VmNetwork>,
    /// Disk files to remove.
    pub disks: Vec<PathBuf>,
}

impl SpareBook {
    /// The guest addresses the spare networks of `group` hold, ready or
    /// being made: no VM may be given one.
    pub fn addresses(&self, group: &str) -> Vec<Ipv4Addr> {
        self.networks
            .get(group)
            .into_iter()
            .flatten()
            .chain(self.making.iter().filter(|n| n.group == group))
            .map(|n| n.address)
            .collect()
    }

    /// Notes a network whose making began.
    pub fn making(&mut self, network: VmNetwork) {
        self.making.push(network);
    }

    /// The network on `tap` was made (`ready`) or failed to be (the caller
    /// removed what it had made).
    pub fn made(&mut self, tap: &str, ready: bool) {
        let Some(at) = self.making.iter().position(|n| n.tap == tap) else {
            return;
        };
        let network = self.making.remove(at);
        if ready {
            self.networks
                .entry(network.group.clone())
                .or_default()
                .push(network);
        }
    }

    /// How many networks `group` has, ready or being made.
    pub fn networks_of(&self, group: &str) -> usize {
        self.networks.get(group).map_or(0, Vec::len)
            + self.making.iter().filter(|n| n.group == group).count()
    }

    /// Takes the oldest ready network of `group`.
    pub fn take_network(&mut self, group: &str) -> Option<VmNetwork> {
        let ready = self.networks.get_mut(group)?;
        (!ready.is_empty()).then(|| ready.remove(0))
    }

    /// Notes a disk made for `commit`.
    pub fn add_disk(&mut self, commit: &str, path: PathBuf) {
        self.disks.entry(commit.to_owned()).or_default().push(path);
    }

    /// How many disks `commit` has ready.
    pub fn disks_of(&self, commit: &str) -> usize {
        self.disks.get(commit).map_or(0, Vec::len)
    }

    /// Takes the oldest ready disk of `commit`.
    pub fn take_disk(&mut self, commit: &str) -> Option<PathBuf> {
        let ready = self.disks.get_mut(commit)?;
        (!ready.is_empty()).then(|| ready.remove(0))
    }

    /// Keeps at most `networks[group]` ready networks per group and
    /// `disks[commit]` ready disks per commit (none of what is not
    /// named); returns the rest.
    pub fn trim(
        &mut self,
        networks: &BTreeMap<String, u32>,
        disks: &BTreeMap<String, u32>,
    ) -> Released {
        fn keep<T>(
            all: &mut BTreeMap<String, Vec<T>>,
            wanted: &BTreeMap<String, u32>,
            out: &mut Vec<T>,
        ) {
            for (owner, ready) in all.iter_mut() {
                let keep = wanted.get(owner).copied().unwrap_or(0) as usize;
                while ready.len() > keep {
                    out.extend(ready.pop());
                }
            }
            all.retain(|_, ready| !ready.is_empty());
        }
        let mut released = Released::default();
        keep(&mut self.networks, networks, &mut released.networks);
        keep(&mut self.disks, disks, &mut released.disks);
        released
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::{NetMode, NetworkManager};

    fn network(group: &str, name: &str, in_use: &[Ipv4Addr]) -> VmNetwork {
        let cfg = crate::network::NetworkConfig {
            mode: NetMode::Isolated,
            cidr: Some("169.254.96.0/24".parse().expect("cidr")),
            ..Default::default()
        };
        NetworkManager::default()
            .plan(group, &cfg, name, in_use, None)
            .expect("plan")
            .expect("a network")
    }

    #[test]
    fn spares_hold_their_addresses_from_the_start_of_their_making() {
        let mut book = SpareBook::default();
        let a = network("g", "spare-a", &[]);
        book.making(a.clone());
        assert_eq!(book.addresses("g"), [a.address]);
        assert_eq!(book.networks_of("g"), 1);
        assert!(book.take_network("g").is_none(), "not ready yet");
        let b = network("g", "spare-b", &[a.address]);
        book.making(b.clone());
        book.made(&a.tap, true);
        book.made(&b.tap, false);
        assert_eq!(book.addresses("g"), [a.address], "a failed one holds none");
        assert!(book.addresses("other").is_empty());
        assert_eq!(book.take_network("g"), Some(a));
        assert!(book.take_network("g").is_none());
        assert!(book.addresses("g").is_empty(), "taken: the VM holds it");
    }

    #[test]
    fn trimming_gives_back_what_is_over_the_wanted_counts() {
        let mut book = SpareBook::default();
        for name in ["spare-a", "spare-b"] {
            let n = network("g", name, &book.addresses("g"));
            book.making(n.clone());
            book.made(&n.tap, true);
        }
        for d in ["c1/a", "c1/b", "c2/a"] {
            let commit = &d[..2];
            book.add_disk(commit, PathBuf::from(d));
        }
        assert_eq!(book.disks_of("c1"), 2);
        let released = book.trim(&[("g".into(), 1)].into(), &[("c1".into(), 1)].into());
        assert_eq!(released.networks.len(), 1);
        assert_eq!(released.networks[0].hostname, "spare-b", "newest first");
        assert_eq!(
            released.disks,
            [PathBuf::from("c1/b"), PathBuf::from("c2/a")]
        );
        assert_eq!(book.take_disk("c1"), Some(PathBuf::from("c1/a")));
        assert!(book.take_disk("c2").is_none());
        let all = book.trim(&BTreeMap::new(), &BTreeMap::new());
        assert_eq!(all.networks.len(), 1);
        assert_eq!(book.networks_of("g"), 0);
    }
}
