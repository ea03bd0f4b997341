//! The book of spares (see `spares`): the networks, disks and primed VMs
//! made ahead of hot forks that are ready, the networks being made, the
//! primed VMs forks claimed and have yet to resume, and the guest
//! addresses they all hold. Plain data; the daemon keeps it behind a lock.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use crate::network::VmNetwork;
use crate::secrets::SecretsDigest;

/// A memory commit's snapshot restored (paused) ahead of a hot fork,
/// with the spare disk and spare network it was restored with.
#[derive(Debug, Clone, PartialEq)]
pub struct SpareVm {
    /// The launcher's name for its process.
    pub process: String,
    /// Its disk: a spare overlay on the commit's disk.
    pub disk: PathBuf,
    /// Its network, a spare of the commit's group (none when the group
    /// has no NIC).
    pub network: Option<VmNetwork>,
    /// What its guest was given while it was primed: its fork's set-up
    /// need not give it again.
    pub set_ahead: SetAhead,
}

/// What a primed VM's guest was given ahead of its fork.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetAhead {
    /// Its network's address and MAC (those of the spare network it was
    /// primed with).
    pub network: bool,
    /// An identity of its own: a machine-id, SSH host keys (when sshd is
    /// installed), fresh entropy, all on its disk. Not its hostname: the
    /// fork's is not known before the fork.
    pub identity: bool,
    /// The secrets its commit's forks inherit, synced as of then: a fork
    /// whose own sync would write the same files (the same digest) need
    /// not sync.
    pub secrets: Option<SecretsDigest>,
}

/// A VM whose priming ended with its process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyVm {
    /// The launcher's name for its process.
    pub process: String,
    /// What its guest was given while it was primed.
    pub set_ahead: SetAhead,
}

/// Spares by owner: networks by host group, disks and primed VMs by
/// memory commit.
#[derive(Debug, Default)]
pub struct SpareBook {
    /// Ready networks per host group, oldest first.
    networks: BTreeMap<String, Vec<VmNetwork>>,
    /// Networks being made (their addresses are taken already).
    making: Vec<VmNetwork>,
    /// Ready disks per memory commit, oldest first.
    disks: BTreeMap<String, Vec<PathBuf>>,
    /// Primed VMs per memory commit, oldest first.
    vms: BTreeMap<String, Vec<SpareVm>>,
    /// Primed VMs taken by forks (by hostname) that have not resumed them
    /// yet.
    claimed: BTreeMap<String, SpareVm>,
    /// The disks and networks of VMs being primed, with their commits.
    priming: Vec<(String, PathBuf, Option<VmNetwork>)>,
    /// Forks waiting for a VM being primed, per memory commit.
    awaiting: BTreeMap<String, usize>,
}

/// Spares the book let go of: the caller removes them from the host.
#[derive(Debug, Default)]
pub struct Released {
    /// Networks to detach.
    pub networks: Vec<VmNetwork>,
    /// Disk files to remove.
    pub disks: Vec<PathBuf>,
    /// Primed VMs to stop (and their disks and networks to remove).
    pub vms: Vec<SpareVm>,
}

impl Released {
    /// Whether nothing was released.
    pub fn is_empty(&self) -> bool {
        self.networks.is_empty() && self.disks.is_empty() && self.vms.is_empty()
    }
}

impl SpareBook {
    /// The guest addresses the spare networks of `group` hold, ready or
    /// being made: no VM may be given one.
    pub fn addresses(&self, group: &str) -> Vec<Ipv4Addr> {
        let primed = self
            .vms
            .values()
            .flatten()
            .chain(self.claimed.values())
            .filter_map(|v| v.network.as_ref())
            .chain(self.priming.iter().filter_map(|(_, _, n)| n.as_ref()));
        self.networks
            .get(group)
            .into_iter()
            .flatten()
            .chain(self.making.iter())
            .chain(primed)
            .filter(|n| n.group == group)
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

    /// How many networks `group` has, ready, being made or held by a
    /// primed VM.
    pub fn networks_of(&self, group: &str) -> usize {
        self.networks.get(group).map_or(0, Vec::len)
            + self.making.iter().filter(|n| n.group == group).count()
            + self.primed_networks_of(group)
    }

    fn primed_networks_of(&self, group: &str) -> usize {
        self.vms
            .values()
            .flatten()
            .filter_map(|v| v.network.as_ref())
            .chain(self.priming.iter().filter_map(|(_, _, n)| n.as_ref()))
            .filter(|n| n.group == group)
            .count()
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

    /// How many disks `commit` has, ready or held by a primed VM.
    pub fn disks_of(&self, commit: &str) -> usize {
        self.disks.get(commit).map_or(0, Vec::len) + self.vms_of(commit)
    }

    /// How many primed VMs `commit` has, ready or being primed.
    pub fn vms_of(&self, commit: &str) -> usize {
        self.vms.get(commit).map_or(0, Vec::len)
            + self.priming.iter().filter(|(c, _, _)| c == commit).count()
    }

    /// Takes the oldest ready disk of `commit` and, for a group with a NIC
    /// (`group`), the oldest ready network of that group, for a VM to
    /// prime; none (nothing taken) when either is missing.
    pub fn begin_priming(
        &mut self,
        commit: &str,
        group: Option<&str>,
    ) -> Option<(PathBuf, Option<VmNetwork>)> {
        let has_network = group.is_none_or(|g| self.networks.get(g).is_some_and(|n| !n.is_empty()));
        if !has_network || self.disks.get(commit).is_none_or(Vec::is_empty) {
            return None;
        }
        let disk = self.take_disk(commit)?;
        let network = group.and_then(|g| self.take_network(g));
        self.priming
            .push((commit.to_owned(), disk.clone(), network.clone()));
        Some((disk, network))
    }

    /// The priming of the VM on `disk` ended: with its process (the VM is
    /// ready), or with none (its disk and network are ready again).
    pub fn end_priming(&mut self, disk: &std::path::Path, ready: Option<ReadyVm>) {
        let Some(at) = self.priming.iter().position(|(_, d, _)| d == disk) else {
            return;
        };
        let (commit, disk, network) = self.priming.remove(at);
        match ready {
            Some(ReadyVm { process, set_ahead }) => {
                self.vms.entry(commit).or_default().push(SpareVm {
                    process,
                    disk,
                    network,
                    set_ahead,
                })
            }
            None => {
                self.disks.entry(commit).or_default().insert(0, disk);
                if let Some(n) = network {
                    self.networks
                        .entry(n.group.clone())
                        .or_default()
                        .insert(0, n);
                }
            }
        }
    }

    /// Whether a fork of `commit` that finds no primed VM ready should wait
    /// for one: one is being primed that no other fork waits for. If so,
    /// the fork counts as waiting until [`SpareBook::stop_awaiting`].
    pub fn await_priming(&mut self, commit: &str) -> bool {
        let priming = self.priming.iter().filter(|(c, _, _)| c == commit).count();
        let awaiting = self.awaiting.get(commit).copied().unwrap_or(0);
        if self.has_ready_vm(commit) || priming <= awaiting {
            return false;
        }
        self.awaiting.insert(commit.to_owned(), awaiting + 1);
        true
    }

    /// A fork of `commit` no longer waits for a VM being primed.
    pub fn stop_awaiting(&mut self, commit: &str) {
        if let Some(awaiting) = self.awaiting.get_mut(commit) {
            *awaiting = awaiting.saturating_sub(1);
            if *awaiting == 0 {
                self.awaiting.remove(commit);
            }
        }
    }

    /// Whether `commit` has a primed VM ready, or none being primed.
    pub fn priming_settled(&self, commit: &str) -> bool {
        self.has_ready_vm(commit) || !self.priming.iter().any(|(c, _, _)| c == commit)
    }

    fn has_ready_vm(&self, commit: &str) -> bool {
        self.vms.get(commit).is_some_and(|v| !v.is_empty())
    }

    /// The launcher's names of `commit`'s ready primed VMs.
    pub fn primed_of(&self, commit: &str) -> Vec<String> {
        self.vms
            .get(commit)
            .map(|vms| vms.iter().map(|vm| vm.process.clone()).collect())
            .unwrap_or_default()
    }

    /// Takes the oldest primed VM of `commit`.
    pub fn take_vm(&mut self, commit: &str) -> Option<SpareVm> {
        let ready = self.vms.get_mut(commit)?;
        (!ready.is_empty()).then(|| ready.remove(0))
    }

    /// Notes that fork `hostname` will resume `vm`.
    pub fn claim(&mut self, hostname: &str, vm: SpareVm) {
        self.claimed.insert(hostname.to_owned(), vm);
    }

    /// The primed VM fork `hostname` claimed, now its own.
    pub fn unclaim(&mut self, hostname: &str) -> Option<SpareVm> {
        self.claimed.remove(hostname)
    }

    /// Takes the oldest ready disk of `commit`.
    pub fn take_disk(&mut self, commit: &str) -> Option<PathBuf> {
        let ready = self.disks.get_mut(commit)?;
        (!ready.is_empty()).then(|| ready.remove(0))
    }

    /// Keeps at most `networks[group]` networks per group and
    /// `disks[commit]` primed VMs and disks per commit, counting those of
    /// primed VMs (none of what is not named; loose spares go first,
    /// newest first); returns the rest. Claimed VMs are the forks'.
    pub fn trim(
        &mut self,
        networks: &BTreeMap<String, u32>,
        disks: &BTreeMap<String, u32>,
    ) -> Released {
        fn keep<T>(
            all: &mut BTreeMap<String, Vec<T>>,
            wanted: impl Fn(&str) -> usize,
            out: &mut Vec<T>,
        ) {
            for (owner, ready) in all.iter_mut() {
                let keep = wanted(owner);
                while ready.len() > keep {
                    out.extend(ready.pop());
                }
            }
            all.retain(|_, ready| !ready.is_empty());
        }
        let wanted = |counts: &BTreeMap<String, u32>, owner: &str| {
            counts.get(owner).copied().unwrap_or(0) as usize
        };
        let mut released = Released::default();
        keep(&mut self.vms, |c| wanted(disks, c), &mut released.vms);
        let vms = std::mem::take(&mut self.vms);
        let vms_of = |c: &str| vms.get(c).map_or(0, Vec::len);
        keep(
            &mut self.disks,
            |c| wanted(disks, c).saturating_sub(vms_of(c)),
            &mut released.disks,
        );
        self.vms = vms;
        let primed: BTreeMap<String, usize> = self
            .networks
            .keys()
            .map(|g| (g.clone(), self.primed_networks_of(g)))
            .collect();
        keep(
            &mut self.networks,
            |g| wanted(networks, g).saturating_sub(primed.get(g).copied().unwrap_or(0)),
            &mut released.networks,
        );
        released
    }
}

#[cfg(test)]
impl SpareBook {
    fn return_network_for_test(&mut self, network: VmNetwork) {
        self.networks
            .entry(network.group.clone())
            .or_default()
            .push(network);
    }

    fn add_vm_for_test(&mut self, commit: &str, vm: SpareVm) {
        self.vms.entry(commit.to_owned()).or_default().push(vm);
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

    #[test]
    fn a_fork_awaits_a_vm_being_primed_that_no_other_fork_awaits() {
        let mut book = SpareBook::default();
        assert!(!book.await_priming("c1"), "nothing being primed");
        assert!(book.priming_settled("c1"));
        book.add_disk("c1", PathBuf::from("c1/a"));
        let (disk, _) = book.begin_priming("c1", None).expect("a disk");
        assert!(!book.priming_settled("c1"));
        assert!(book.await_priming("c1"), "the first fork waits");
        assert!(!book.await_priming("c1"), "one VM being primed, one fork");
        assert!(!book.await_priming("c2"), "another commit's");
        book.stop_awaiting("c1");
        assert!(book.await_priming("c1"), "the first one gave up");
        book.end_priming(
            &disk,
            Some(ReadyVm {
                process: "p1".into(),
                set_ahead: SetAhead::default(),
            }),
        );
        assert!(book.priming_settled("c1"), "ready");
        book.stop_awaiting("c1");
        assert!(!book.await_priming("c1"), "one is ready: take it");
        assert!(book.awaiting.is_empty(), "{:?}", book.awaiting);
    }

    #[test]
    fn primed_vms_hold_their_disk_and_network_until_a_fork_resumes_them() {
        let mut book = SpareBook::default();
        let n = network("g", "spare-a", &[]);
        book.making(n.clone());
        book.made(&n.tap, true);
        book.add_disk("c1", PathBuf::from("c1/a"));
        assert!(book.begin_priming("c2", Some("g")).is_none(), "no disk");
        assert!(
            book.begin_priming("c1", Some("other")).is_none(),
            "no network"
        );
        assert_eq!(book.disks_of("c1"), 1, "nothing taken");
        let (disk, taken) = book.begin_priming("c1", Some("g")).expect("both ready");
        assert_eq!(taken.as_ref(), Some(&n));
        // Counted, and its address held, while it is primed.
        assert_eq!((book.vms_of("c1"), book.disks_of("c1")), (1, 1));
        assert_eq!(book.networks_of("g"), 1);
        assert_eq!(book.addresses("g"), [n.address]);
        book.end_priming(&disk, None);
        assert_eq!(book.vms_of("c1"), 0, "a failed priming gives both back");
        assert_eq!(book.take_network("g"), Some(n.clone()));
        book.return_network_for_test(n.clone());
        let (disk, _) = book.begin_priming("c1", Some("g")).expect("again");
        book.end_priming(
            &disk,
            Some(ReadyVm {
                process: "p1".into(),
                set_ahead: SetAhead::default(),
            }),
        );
        assert_eq!(book.vms_of("c1"), 1);
        assert!(book.take_network("g").is_none() && book.take_disk("c1").is_none());
        // Taken by a fork and claimed: its address is still held until
        // the fork's record has it.
        let vm = book.take_vm("c1").expect("primed");
        assert_eq!(vm.process, "p1");
        book.claim("fork-1", vm.clone());
        assert_eq!(book.addresses("g"), [n.address]);
        assert_eq!((book.vms_of("c1"), book.networks_of("g")), (0, 0));
        assert_eq!(book.unclaim("fork-1"), Some(vm.clone()));
        assert!(book.addresses("g").is_empty());
        // Trimming releases primed VMs beyond the wanted count.
        book.add_vm_for_test("c1", vm.clone());
        let released = book.trim(&[("g".into(), 1)].into(), &[("c1".into(), 1)].into());
        assert!(released.is_empty(), "{released:?}");
        let released = book.trim(&BTreeMap::new(), &BTreeMap::new());
        assert_eq!(released.vms, [vm]);
        assert!(released.networks.is_empty() && released.disks.is_empty());
    }
}
