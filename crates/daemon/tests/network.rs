//! Host networking, for real: bridges, TAPs, addresses and nftables rules on
//! this host (needs root, `ip` and `nft`), and the isolation they give,
//! checked with network namespaces standing in for guests.
//!
//! Every test has its own TAP/bridge prefixes, nft table and link-local
//! (169.254.0.0/16) ranges, so tests run in parallel and never touch the
//! daemon's objects; a guard removes everything, even on failure. No
//! traffic leaves the host: the "outside" is another namespace.

use std::fs::File;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::Duration;

use nix::sched::{setns, CloneFlags};
use serde_json::Value;
use tine_daemon::network::{
    ManagerOptions, NetMode, NetworkConfig, NetworkError, NetworkManager, PolicyOverride, VmNetwork,
};

/// How long a connection attempt that should be blocked is given (dropped
/// packets give no answer, so a blocked check always waits this long).
const BLOCKED_TIMEOUT: Duration = Duration::from_millis(1000);
/// How long a connection that should work may take (generous: CI machines
/// are small and busy).
const REACH_TIMEOUT: Duration = Duration::from_secs(5);

fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} (tests need ip and nft): {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ip(args: &[&str]) {
    sh("ip", args);
}

fn ip_json(args: &[&str]) -> Value {
    let mut full = vec!["-j"];
    full.extend_from_slice(args);
    serde_json::from_str(&sh("ip", &full)).expect("ip -j output is JSON")
}

/// `ip -j -d link show dev NAME`, or `None` when there is no such link.
fn link(name: &str) -> Option<Value> {
    let all = ip_json(&["-d", "link", "show"]);
    all.as_array()
        .expect("array")
        .iter()
        .find(|l| l["ifname"] == name)
        .cloned()
}

fn ipv4_addrs(name: &str) -> Vec<String> {
    let out = ip_json(&["-4", "addr", "show", "dev", name]);
    out.as_array()
        .expect("array")
        .iter()
        .flat_map(|i| i["addr_info"].as_array().cloned().unwrap_or_default())
        .map(|a| format!("{}/{}", a["local"].as_str().expect("local"), a["prefixlen"]))
        .collect()
}

/// The elements of a set or map of the table, and its chain names.
struct Table {
    chains: Vec<String>,
    json: Value,
}

impl Table {
    fn read(table: &str) -> Self {
        let json: Value = serde_json::from_str(&sh("nft", &["-j", "list", "table", "inet", table]))
            .expect("nft -j output is JSON");
        let chains = json["nftables"]
            .as_array()
            .expect("array")
            .iter()
            .filter_map(|i| i["chain"]["name"].as_str().map(str::to_owned))
            .collect();
        Self { chains, json }
    }

    fn elements(&self, set: &str) -> Vec<String> {
        self.json["nftables"]
            .as_array()
            .expect("array")
            .iter()
            .filter_map(|i| i.get("set").or_else(|| i.get("map")))
            .filter(|s| s["name"] == set)
            .flat_map(|s| s["elem"].as_array().cloned().unwrap_or_default())
            .filter_map(|e| {
                e.as_str()
                    .or_else(|| e.get(0).and_then(|k| k.as_str()))
                    .map(str::to_owned)
            })
            .collect()
    }
}

/// The rules of one chain, as `nft list chain` prints them.
fn chain_rules(table: &str, chain: &str) -> Vec<String> {
    sh("nft", &["list", "chain", "inet", table, chain])
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("table") && !l.starts_with("chain"))
        .filter(|l| *l != "}")
        .map(str::to_owned)
        .collect()
}

/// A test's manager plus everything to remove when the test ends.
struct Fixture {
    mgr: NetworkManager,
    links: Vec<String>,
    netns: Vec<String>,
}

impl Fixture {
    /// `id`: one or two letters unique to the test.
    fn new(id: &str) -> Self {
        let mgr = NetworkManager::new(ManagerOptions {
            table: format!("tine_test_{id}"),
            tap_prefix: format!("q{id}-"),
            bridge_prefix: format!("r{id}-"),
        })
        .expect("test options");
        let fixture = Self {
            mgr,
            links: Vec::new(),
            netns: Vec::new(),
        };
        // Leftovers of an earlier, killed run.
        fixture.clean();
        fixture
    }

    fn table(&self) -> String {
        self.mgr.options().table.clone()
    }

    fn netns(&mut self, name: &str) {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        ip(&["netns", "add", name]);
        ip(&["-n", name, "link", "set", "lo", "up"]);
        self.netns.push(name.to_owned());
    }

    /// Replaces the VM's TAP with a veth whose other end is `eth0` in
    /// namespace `ns`, configured as the agent would configure the guest.
    /// The nft rules match interface names, so they apply unchanged.
    fn stand_in_guest(&mut self, vm: &VmNetwork, ns: &str) {
        self.netns(ns);
        ip(&["link", "del", "dev", &vm.tap]);
        ip(&[
            "link", "add", &vm.tap, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ]);
        self.links.push(vm.tap.clone());
        match &vm.bridge {
            Some(bridge) => ip(&["link", "set", "dev", &vm.tap, "master", bridge]),
            None => ip(&[
                "addr",
                "add",
                &format!("{}/{}", vm.gateway, vm.prefix),
                "dev",
                &vm.tap,
            ]),
        }
        ip(&["link", "set", "dev", &vm.tap, "up"]);
        let addr = format!("{}/{}", vm.address, vm.prefix);
        ip(&["-n", ns, "addr", "add", &addr, "dev", "eth0"]);
        ip(&["-n", ns, "link", "set", "eth0", "up"]);
        let gw = vm.gateway.to_string();
        ip(&["-n", ns, "route", "add", "default", "via", &gw]);
    }

    /// A namespace standing in for the outside world, joined to the host
    /// by a veth: host side `host_addr/24`, namespace side `addrs`.
    fn outside(&mut self, ns: &str, host_link: &str, host_addr: &str, addrs: &[&str]) {
        self.netns(ns);
        let _ = Command::new("ip")
            .args(["link", "del", "dev", host_link])
            .output();
        ip(&[
            "link", "add", host_link, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ]);
        self.links.push(host_link.to_owned());
        ip(&["addr", "add", host_addr, "dev", host_link]);
        ip(&["link", "set", "dev", host_link, "up"]);
        for a in addrs {
            ip(&["-n", ns, "addr", "add", a, "dev", "eth0"]);
        }
        ip(&["-n", ns, "link", "set", "eth0", "up"]);
    }

    fn clean(&self) {
        for l in &self.links {
            let _ = Command::new("ip").args(["link", "del", "dev", l]).output();
        }
        for ns in &self.netns {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        if let Err(e) = self.mgr.teardown() {
            eprintln!("teardown: {e}");
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.clean();
    }
}

/// Runs `f` on a thread that entered namespace `ns` (`None`: the host's).
fn in_netns<T: Send + 'static>(ns: Option<&str>, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = ns.map(|ns| format!("/run/netns/{ns}"));
    std::thread::spawn(move || {
        if let Some(path) = path {
            let file = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
        }
        f()
    })
    .join()
    .expect("namespace thread")
}

/// A TCP listener on `addr:port` in `ns` (sockets stay in the namespace
/// they were made in). Connections complete in the backlog.
fn listen(ns: Option<&str>, addr: Ipv4Addr, port: u16) -> TcpListener {
    in_netns(ns, move || {
        TcpListener::bind(SocketAddr::from((addr, port)))
            .unwrap_or_else(|e| panic!("bind {addr}:{port}: {e}"))
    })
}

fn try_connect(ns: &str, addr: Ipv4Addr, port: u16, timeout: Duration) -> bool {
    in_netns(Some(ns), move || {
        TcpStream::connect_timeout(&SocketAddr::from((addr, port)), timeout).is_ok()
    })
}

/// Whether a TCP connection from namespace `ns` to `addr:port` works.
fn connects(ns: &str, addr: Ipv4Addr, port: u16) -> bool {
    try_connect(ns, addr, port, REACH_TIMEOUT)
}

/// Whether a TCP connection from namespace `ns` to `addr:port` gets no
/// answer in time.
fn blocked(ns: &str, addr: Ipv4Addr, port: u16) -> bool {
    !try_connect(ns, addr, port, BLOCKED_TIMEOUT)
}

fn v4(s: &str) -> Ipv4Addr {
    s.parse().expect("test address")
}

fn bridge_cfg(cidr: &str) -> NetworkConfig {
    NetworkConfig {
        mode: NetMode::Bridge,
        cidr: Some(cidr.parse().expect("cidr")),
        ..Default::default()
    }
}

fn isolated_cfg(cidr: &str, allow: &[&str], drop: &[&str]) -> NetworkConfig {
    NetworkConfig {
        mode: NetMode::Isolated,
        cidr: Some(cidr.parse().expect("cidr")),
        allow: allow.iter().map(|s| s.to_string()).collect(),
        drop: drop.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn attach(
    fx: &Fixture,
    group: &str,
    cfg: &NetworkConfig,
    host: &str,
    in_use: &[Ipv4Addr],
) -> VmNetwork {
    fx.mgr
        .attach(group, cfg, host, in_use, None)
        .expect("attach")
        .expect("a network")
}

#[test]
fn bridge_attach_and_detach() {
    let fx = Fixture::new("a");
    let cfg = bridge_cfg("169.254.201.0/24");
    let vm1 = attach(&fx, "ga", &cfg, "ga-1", &[]);
    let vm2 = attach(&fx, "ga", &cfg, "ga-2", &[vm1.address]);
    assert_eq!(vm1.address, v4("169.254.201.2"));
    assert_eq!(vm2.address, v4("169.254.201.3"));
    assert_eq!(vm1.gateway, v4("169.254.201.1"));
    assert_eq!(vm1.bridge.as_deref(), Some("ra-ga"));

    let bridge = link("ra-ga").expect("bridge exists");
    assert_eq!(bridge["linkinfo"]["info_kind"], "bridge");
    assert!(bridge["flags"]
        .as_array()
        .expect("flags")
        .contains(&"UP".into()));
    assert_eq!(ipv4_addrs("ra-ga"), ["169.254.201.1/24"]);

    for vm in [&vm1, &vm2] {
        let tap = link(&vm.tap).expect("tap exists");
        assert_eq!(tap["linkinfo"]["info_kind"], "tun");
        assert_eq!(tap["linkinfo"]["info_data"]["type"], "tap");
        assert_eq!(tap["linkinfo"]["info_data"]["vnet_hdr"], true);
        assert_eq!(tap["linkinfo"]["info_data"]["pi"], false);
        assert_eq!(tap["master"], "ra-ga");
        assert_eq!(tap["ifalias"], vm.hostname.as_str());
        assert!(tap["flags"]
            .as_array()
            .expect("flags")
            .contains(&"UP".into()));
        assert!(ipv4_addrs(&vm.tap).is_empty());
    }

    let table = Table::read(&fx.table());
    assert_eq!(table.elements("nat_ifs"), ["ra-ga"]);
    assert!(table.elements("iso_ifs").is_empty());
    assert!(table.chains.iter().all(|c| !c.starts_with("vm-")));
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .expect("ip_forward")
            .trim(),
        "1"
    );

    // Attaching again reuses the TAP.
    let again = attach(&fx, "ga", &cfg, "ga-1", &[]);
    assert_eq!(again, vm1);
    assert_eq!(link(&vm1.tap).expect("tap")["master"], "ra-ga");

    fx.mgr.detach(&vm1).expect("detach");
    assert!(link(&vm1.tap).is_none());
    fx.mgr.detach(&vm1).expect("detach is idempotent");
    assert!(link(&vm2.tap).is_some(), "the other VM keeps its TAP");
    assert!(link("ra-ga").is_some(), "the bridge stays for the group");

    fx.mgr.detach(&vm2).expect("detach");
    let removed = fx.mgr.cleanup_orphans(&[]).expect("cleanup");
    assert_eq!(removed, ["ra-ga"]);
    assert!(link("ra-ga").is_none());
    assert!(Table::read(&fx.table()).elements("nat_ifs").is_empty());
}

#[test]
fn isolated_attach_policy_and_detach() {
    let fx = Fixture::new("b");
    let table = fx.table();
    let cfg = isolated_cfg(
        "169.254.202.0/24",
        &["169.254.250.0/24"],
        &["169.254.250.7:80"],
    );
    let mut vm = attach(&fx, "gb", &cfg, "gb-1", &[]);
    assert_eq!(vm.tap, "qb-gb-1");
    assert_eq!(vm.address, v4("169.254.202.2"));
    assert_eq!(vm.prefix, 30);

    let tap = link(&vm.tap).expect("tap exists");
    assert_eq!(tap["linkinfo"]["info_data"]["type"], "tap");
    assert_eq!(tap["linkinfo"]["info_data"]["vnet_hdr"], true);
    assert!(tap.get("master").is_none());
    assert!(tap["flags"]
        .as_array()
        .expect("flags")
        .contains(&"UP".into()));
    assert_eq!(ipv4_addrs(&vm.tap), ["169.254.202.1/30"]);

    let t = Table::read(&table);
    assert_eq!(t.elements("iso_ifs"), ["qb-gb-1"]);
    assert_eq!(t.elements("nat_ifs"), ["qb-gb-1"]);
    assert_eq!(t.elements("iso_fwd"), ["qb-gb-1"]);
    let rules = chain_rules(&table, "vm-qb-gb-1");
    assert_eq!(
        rules,
        [
            "meta nfproto != ipv4 drop",
            "ip saddr != 169.254.202.2 drop",
            "ct state invalid drop",
            "ct state established,related accept",
            "ip daddr 169.254.250.0/24 accept",
            "ip daddr 169.254.250.7 meta l4proto { tcp, udp } th dport 80 drop",
            "accept",
        ]
    );

    // A second VM gets the next /30; an allow-only override denies the rest.
    let over = PolicyOverride {
        allow: Some(vec!["169.254.250.9:443".into()]),
        drop: Some(vec![]),
    };
    let vm2 = fx
        .mgr
        .attach("gb", &cfg, "gb-2", &[vm.address], Some(&over))
        .expect("attach")
        .expect("network");
    assert_eq!(vm2.address, v4("169.254.202.6"));
    assert_eq!(ipv4_addrs(&vm2.tap), ["169.254.202.5/30"]);
    let rules = chain_rules(&table, "vm-qb-gb-2");
    assert_eq!(
        rules[4..],
        [
            "ip daddr 169.254.250.9 meta l4proto { tcp, udp } th dport 443 accept",
            "drop"
        ]
    );

    // A changed policy replaces the chain's rules.
    vm.set_policy(
        &cfg,
        Some(&PolicyOverride {
            allow: None,
            drop: Some(vec!["0.0.0.0/0".into()]),
        }),
    )
    .expect("policy");
    fx.mgr.update_policy(&vm).expect("update");
    let rules = chain_rules(&table, "vm-qb-gb-1");
    assert_eq!(
        rules[4..],
        [
            "ip daddr 169.254.250.0/24 accept",
            "ip daddr 0.0.0.0/0 drop",
            "accept"
        ]
    );
    fx.mgr.ensure(&vm).expect("ensure is idempotent");
    assert_eq!(ipv4_addrs(&vm.tap), ["169.254.202.1/30"]);

    fx.mgr.detach(&vm).expect("detach");
    assert!(link(&vm.tap).is_none());
    let t = Table::read(&table);
    assert_eq!(t.elements("iso_ifs"), ["qb-gb-2"]);
    assert_eq!(t.elements("nat_ifs"), ["qb-gb-2"]);
    assert_eq!(t.elements("iso_fwd"), ["qb-gb-2"]);
    assert!(!t.chains.contains(&"vm-qb-gb-1".to_owned()));
    fx.mgr.detach(&vm).expect("detach is idempotent");

    // After a "host reboot" (TAP gone), ensure re-creates it from the record.
    ip(&["link", "del", "dev", &vm2.tap]);
    fx.mgr.ensure(&vm2).expect("ensure");
    assert_eq!(ipv4_addrs(&vm2.tap), ["169.254.202.5/30"]);
    assert_eq!(link(&vm2.tap).expect("tap")["ifalias"], "gb-2");
}

#[test]
fn cleanup_removes_orphans_only() {
    let mut fx = Fixture::new("c");
    let table = fx.table();
    let iso = isolated_cfg("169.254.203.0/24", &[], &[]);
    let keep = attach(&fx, "gc", &iso, "gc-1", &[]);
    let orphan = attach(&fx, "gc", &iso, "gc-2", &[keep.address]);
    let bridged = attach(&fx, "hc", &bridge_cfg("169.254.208.0/24"), "hc-1", &[]);

    // A TAP left by a crashed daemon, and a TAP that is not ours.
    ip(&["tuntap", "add", "dev", "qc-planted", "mode", "tap"]);
    ip(&["tuntap", "add", "dev", "zc-foreign", "mode", "tap"]);
    fx.links.push("zc-foreign".to_owned());

    let removed = fx
        .mgr
        .cleanup_orphans(std::slice::from_ref(&keep))
        .expect("cleanup");
    assert_eq!(removed, ["qc-gc-2", "qc-hc-1", "qc-planted", "rc-hc"]);
    assert!(link("qc-planted").is_none());
    assert!(link(&orphan.tap).is_none());
    assert!(link(&bridged.tap).is_none());
    assert!(link("rc-hc").is_none());
    assert!(link("zc-foreign").is_some(), "foreign TAP left alone");
    assert!(link(&keep.tap).is_some());
    let t = Table::read(&table);
    assert_eq!(t.elements("iso_ifs"), ["qc-gc-1"]);
    assert_eq!(t.elements("nat_ifs"), ["qc-gc-1"]);
    assert!(t.chains.contains(&"vm-qc-gc-1".to_owned()));
    assert!(!t.chains.contains(&"vm-qc-gc-2".to_owned()));

    assert!(fx.mgr.cleanup_orphans(&[keep]).expect("again").is_empty());
}

#[test]
fn tap_names_are_owned_by_their_vm() {
    let mut fx = Fixture::new("f");
    let cfg = isolated_cfg("169.254.209.0/24", &[], &[]);
    // A TAP with this VM's name that records another owner is refused and
    // left alone, rules included.
    let other = attach(&fx, "gf", &cfg, "gf-1", &[]);
    ip(&["link", "set", "dev", &other.tap, "alias", "someone-else"]);
    let err = fx
        .mgr
        .attach("gf", &cfg, "gf-1", &[other.address], None)
        .expect_err("collision");
    assert!(
        matches!(err, NetworkError::NameCollision { ref owner, .. } if owner == "someone-else"),
        "{err}"
    );
    assert!(link(&other.tap).is_some());
    let rules = chain_rules(&fx.table(), &format!("vm-{}", other.tap));
    assert_eq!(rules[1], format!("ip saddr != {} drop", other.address));
    assert!(matches!(
        fx.mgr.detach(&other),
        Err(NetworkError::NameCollision { .. })
    ));

    // A TAP made by hand without an owner is adopted.
    ip(&["tuntap", "add", "dev", "qf-gf-2", "mode", "tap"]);
    let adopted = attach(&fx, "gf", &cfg, "gf-2", &[other.address]);
    assert_eq!(adopted.tap, "qf-gf-2");
    assert_eq!(link("qf-gf-2").expect("tap")["ifalias"], "gf-2");

    // A non-TAP interface with the name is refused, and attach leaves it.
    ip(&["link", "add", "qf-gf-3", "type", "bridge"]);
    fx.links.push("qf-gf-3".to_owned());
    let err = fx
        .mgr
        .attach("gf", &cfg, "gf-3", &[], None)
        .expect_err("wrong kind");
    assert!(matches!(err, NetworkError::WrongKind { .. }), "{err}");
    ip(&["link", "del", "dev", "qf-gf-3"]);

    // Exhaustion is reported, and nothing is created.
    let small = isolated_cfg("169.254.210.0/30", &[], &[]);
    let only = attach(&fx, "hf", &small, "hf-1", &[]);
    let err = fx
        .mgr
        .attach("hf", &small, "hf-2", &[only.address], None)
        .expect_err("full");
    assert!(matches!(err, NetworkError::PoolExhausted { .. }), "{err}");
    assert!(link("qf-hf-2").is_none());
}

#[test]
fn a_spare_network_is_handed_over_with_its_tap_rules_and_address() {
    let fx = Fixture::new("s");
    let cfg = isolated_cfg("169.254.211.0/24", &[], &["203.0.113.0/24"]);
    // Made in advance under a spare's name, then quarantined.
    let spare = attach(&fx, "gs", &cfg, "spare-01", &[]);
    fx.mgr.set_quarantine(&spare, true).expect("quarantine");
    let taken = fx.mgr.hand_over(&spare, "gs-7").expect("hand over");
    assert_eq!(taken.hostname, "gs-7");
    assert_eq!(taken.tap, spare.tap, "the same TAP");
    assert_eq!(taken.address, spare.address, "the same address");
    assert_eq!(taken.mac, spare.mac, "the same MAC (a primed guest has it)");
    let l = link(&spare.tap).expect("tap");
    assert_eq!(l["ifalias"], "gs-7", "owned by the VM now");
    assert!(
        !l["flags"]
            .as_array()
            .expect("flags")
            .iter()
            .any(|f| f == "UP"),
        "still in quarantine: {l}"
    );
    let rules = chain_rules(&fx.table(), &format!("vm-{}", spare.tap));
    assert_eq!(rules[1], format!("ip saddr != {} drop", spare.address));
    // Owned by the VM: the spare's name no longer holds it, and the VM's
    // own record works as any other (quarantine, detach).
    let again = fx.mgr.hand_over(&spare, "gs-8").expect_err("taken");
    assert!(
        matches!(again, NetworkError::NameCollision { ref owner, .. } if owner == "gs-7"),
        "{again}"
    );
    fx.mgr
        .set_quarantine(&taken, false)
        .expect("out of quarantine");
    fx.mgr.detach(&taken).expect("detach");
    assert!(link(&spare.tap).is_none());

    // A spare that is not in quarantine is not handed over.
    let open = attach(&fx, "gs", &cfg, "spare-02", &[spare.address]);
    let err = fx.mgr.hand_over(&open, "gs-9").expect_err("up");
    assert!(matches!(err, NetworkError::BadRecord { .. }), "{err}");
    assert_eq!(link(&open.tap).expect("tap")["ifalias"], "spare-02");
    // Nor one whose TAP is gone.
    fx.mgr.detach(&open).expect("detach");
    let err = fx.mgr.hand_over(&open, "gs-9").expect_err("gone");
    assert!(matches!(err, NetworkError::Netlink { .. }), "{err}");
}

#[test]
fn isolated_traffic_follows_the_policy() {
    let mut fx = Fixture::new("d");
    let cfg = isolated_cfg("169.254.204.0/24", &["0.0.0.0/0"], &[]);
    let mut vm1 = attach(&fx, "gd", &cfg, "gd-1", &[]);
    let vm2 = attach(&fx, "gd", &cfg, "gd-2", &[vm1.address]);
    fx.stand_in_guest(&vm1, "tine-td-1");
    fx.stand_in_guest(&vm2, "tine-td-2");
    let dst = "tine-td-out";
    fx.outside(
        dst,
        "sd-out",
        "169.254.205.1/24",
        &["169.254.205.2/24", "169.254.205.3/24"],
    );
    let (a, b) = (v4("169.254.205.2"), v4("169.254.205.3"));
    let _l1 = listen(Some(dst), a, 8080);
    let _l2 = listen(Some(dst), a, 8081);
    let _l3 = listen(Some(dst), b, 8080);
    // A host service on every address, and one in the second VM.
    let host = listen(None, Ipv4Addr::UNSPECIFIED, 0);
    let host_port = host.local_addr().expect("local addr").port();
    let _peer = listen(Some("tine-td-2"), vm2.address, 8083);
    let _me = listen(Some("tine-td-1"), vm1.address, 8083);
    let vm = "tine-td-1";
    let (me, my_gateway) = (vm1.address, vm1.gateway);

    // Controls: the services answer where nothing stands in the way.
    assert!(
        connects(dst, v4("169.254.205.1"), host_port),
        "host service down"
    );
    let from_host = in_netns(None, move || {
        TcpStream::connect_timeout(&SocketAddr::from((vm2.address, 8083)), REACH_TIMEOUT)
    });
    assert!(from_host.is_ok(), "the host reaches a VM");

    // allow 0.0.0.0/0: the outside, through the masquerade (the outside
    // has no route back to the VM's /30)...
    assert!(connects(vm, a, 8080));
    assert!(connects(vm, b, 8080));
    // ...but never the host's services or another VM.
    for host_addr in [my_gateway, vm2.gateway, v4("169.254.205.1")] {
        assert!(
            blocked(vm, host_addr, host_port),
            "host service reachable at {host_addr}"
        );
    }
    assert!(blocked(vm, vm2.address, 8083), "other VM reachable");
    assert!(blocked("tine-td-2", vm1.address, 8083), "VM reachable");

    // A hot fork waits in quarantine until its fix-ups are done: its link
    // is down on the host, so nothing it sends leaves (and no route leads
    // to it); out of it, the policy holds again.
    fx.mgr.set_quarantine(&vm1, true).expect("quarantine");
    let flags = |tap: &str| {
        link(tap)
            .map(|l| l["flags"].to_string())
            .unwrap_or_default()
    };
    assert!(!flags(&vm1.tap).contains("\"UP\""), "{}", flags(&vm1.tap));
    assert!(blocked(vm, a, 8080), "a quarantined VM reaches the outside");
    fx.mgr
        .set_quarantine(&vm1, false)
        .expect("out of quarantine");
    assert!(flags(&vm1.tap).contains("\"UP\""), "{}", flags(&vm1.tap));
    assert!(
        connects(vm, a, 8080),
        "out of quarantine, the outside again"
    );

    let mut set = |allow: &[&str], drop: &[&str]| {
        let over = PolicyOverride {
            allow: Some(allow.iter().map(|s| s.to_string()).collect()),
            drop: Some(drop.iter().map(|s| s.to_string()).collect()),
        };
        vm1.set_policy(&cfg, Some(&over)).expect("policy");
        fx.mgr.update_policy(&vm1).expect("update");
    };

    // Allow only: everything else denied.
    set(&["169.254.205.2:8080"], &[]);
    assert!(connects(vm, a, 8080));
    assert!(blocked(vm, a, 8081), "other port allowed");
    assert!(blocked(vm, b, 8080), "other address allowed");
    assert!(udp_arrives(vm, me, dst, a, 8080), "a port covers UDP");
    assert!(udp_blocked(vm, me, dst, a, 8081), "other UDP port allowed");

    // Drop only: everything else allowed.
    set(&[], &["169.254.205.2:8081"]);
    assert!(connects(vm, a, 8080));
    assert!(blocked(vm, a, 8081), "dropped port reachable");
    assert!(connects(vm, b, 8080));

    // Both: allow first, then drop, then the rest allowed.
    set(&["169.254.205.2:8080"], &["169.254.205.2/32"]);
    assert!(connects(vm, a, 8080), "allow must win over drop");
    assert!(blocked(vm, a, 8081), "drop must apply after allow");
    assert!(connects(vm, b, 8080), "the rest must be allowed");

    // Closed.
    set(&[], &["0.0.0.0/0"]);
    assert!(blocked(vm, a, 8080));
    assert!(blocked(vm, my_gateway, host_port));

    // Spoofed sources are dropped: the guest sends from another address.
    set(&["0.0.0.0/0"], &[]);
    ip(&["-n", vm, "addr", "add", "169.254.204.9/32", "dev", "eth0"]);
    assert!(udp_arrives(vm, me, dst, a, 9000));
    assert!(
        udp_blocked(vm, v4("169.254.204.9"), dst, a, 9001),
        "spoofed source passed"
    );
}

fn try_udp(
    from: &str,
    src: Ipv4Addr,
    to: &str,
    dst: Ipv4Addr,
    port: u16,
    timeout: Duration,
) -> bool {
    let rx = in_netns(Some(to), move || {
        UdpSocket::bind(SocketAddr::from((dst, port))).expect("bind udp")
    });
    rx.set_read_timeout(Some(timeout)).expect("timeout");
    in_netns(Some(from), move || {
        let tx = UdpSocket::bind(SocketAddr::from((src, 0))).expect("bind source");
        tx.send_to(b"ping", SocketAddr::from((dst, port)))
            .expect("send");
    });
    let mut buf = [0u8; 16];
    rx.recv_from(&mut buf).is_ok()
}

/// Whether a UDP datagram sent from `src` in `from` reaches `dst:port` in
/// namespace `to`.
fn udp_arrives(from: &str, src: Ipv4Addr, to: &str, dst: Ipv4Addr, port: u16) -> bool {
    try_udp(from, src, to, dst, port, REACH_TIMEOUT)
}

/// Whether such a datagram is lost.
fn udp_blocked(from: &str, src: Ipv4Addr, to: &str, dst: Ipv4Addr, port: u16) -> bool {
    !try_udp(from, src, to, dst, port, BLOCKED_TIMEOUT)
}

#[test]
fn bridged_vms_reach_each_other_the_host_and_the_outside() {
    let mut fx = Fixture::new("e");
    let cfg = bridge_cfg("169.254.206.0/24");
    let vm1 = attach(&fx, "ge", &cfg, "ge-1", &[]);
    let vm2 = attach(&fx, "ge", &cfg, "ge-2", &[vm1.address]);
    let iso_cfg = isolated_cfg("169.254.211.0/24", &["0.0.0.0/0"], &[]);
    let iso = attach(&fx, "he", &iso_cfg, "he-1", &[]);
    fx.stand_in_guest(&vm1, "tine-te-1");
    fx.stand_in_guest(&vm2, "tine-te-2");
    fx.stand_in_guest(&iso, "tine-te-3");
    let dst = "tine-te-out";
    fx.outside(dst, "se-out", "169.254.207.1/24", &["169.254.207.2/24"]);
    let out = v4("169.254.207.2");
    let _o = listen(Some(dst), out, 8086);
    let _h = listen(None, vm1.gateway, 8084);
    let _p = listen(Some("tine-te-2"), vm2.address, 8085);
    let _i = listen(Some("tine-te-3"), iso.address, 8087);

    assert!(connects("tine-te-1", vm2.address, 8085), "VM to VM");
    assert!(connects("tine-te-1", vm1.gateway, 8084), "VM to host");
    assert!(connects("tine-te-1", out, 8086), "VM to the outside (NAT)");
    // The isolated VM of the same manager stays out of reach both ways.
    assert!(connects("tine-te-3", out, 8086), "isolated VM egress");
    assert!(
        blocked("tine-te-1", iso.address, 8087),
        "bridge VM reached isolated VM"
    );
    assert!(
        blocked("tine-te-3", vm2.address, 8085),
        "isolated VM reached bridge VM"
    );
}

/// A MAC address as bytes.
fn mac_bytes(mac: &str) -> [u8; 6] {
    let mut out = [0u8; 6];
    let parts: Vec<u8> = mac
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).expect("hex"))
        .collect();
    out.copy_from_slice(&parts);
    out
}

/// Length of the `virtio_net_hdr_v1` tine-vmm puts before every frame.
const VNET_HDR_LEN: usize = 12;

/// A TAP opened as tine-vmm opens it (`IFF_TAP | IFF_NO_PI |
/// IFF_VNET_HDR`, header length [`VNET_HDR_LEN`]), standing in for a VMM.
struct GuestTap(File);

impl GuestTap {
    fn open(name: &str) -> std::io::Result<Self> {
        let file = File::options()
            .read(true)
            .write(true)
            .open("/dev/net/tun")?;
        // SAFETY: `ifreq` is plain old data (a name array and a union of
        // integers and pointers never dereferenced here); all-zero bytes
        // are a valid value.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        let name = name.as_bytes();
        assert!(name.len() < libc::IFNAMSIZ, "TAP name too long");
        for (slot, &byte) in ifr.ifr_name.iter_mut().zip(name) {
            *slot = byte as libc::c_char;
        }
        ifr.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
        // SAFETY: `file` is an open tun descriptor and TUNSETIFF reads and
        // writes one `struct ifreq`, which `ifr` is and outlives the call.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut ifr) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: `file` is an attached tun descriptor and TUNSETVNETHDRSZ
        // reads one `int` through the pointer, which `hdr_len` outlives.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr_len) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(file))
    }

    /// Sends one frame after an all-zero header (no offloads), in one write.
    fn send(&mut self, frame: &[u8]) -> std::io::Result<()> {
        let mut packet = vec![0u8; VNET_HDR_LEN];
        packet.extend_from_slice(frame);
        let written = self.0.write(&packet)?;
        assert_eq!(written, packet.len(), "a TAP takes a frame whole");
        Ok(())
    }
}

/// An Ethernet frame holding one IPv4/UDP datagram, as a guest would send
/// it (UDP checksum 0: none).
fn udp_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    let udp_len = u16::try_from(8 + payload.len()).expect("small");
    let ip_len = 20 + udp_len;
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&ip_len.to_be_bytes());
    ip[6] = 0x40; // don't fragment
    ip[8] = 64; // TTL
    ip[9] = 17; // UDP
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let mut sum: u32 = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let checksum = !u16::try_from(sum).expect("folded");
    ip[10..12].copy_from_slice(&checksum.to_be_bytes());

    let mut frame = Vec::new();
    frame.extend_from_slice(&dst_mac);
    frame.extend_from_slice(&src_mac);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&40000u16.to_be_bytes());
    frame.extend_from_slice(&dport.to_be_bytes());
    frame.extend_from_slice(&udp_len.to_be_bytes());
    frame.extend_from_slice(&[0, 0]);
    frame.extend_from_slice(payload);
    frame
}

#[test]
fn real_tap_carries_guest_frames_under_the_policy() {
    let mut fx = Fixture::new("g");
    let cfg = isolated_cfg("169.254.212.0/24", &[], &["169.254.213.2:9001"]);
    let vm = attach(&fx, "gg", &cfg, "gg-1", &[]);
    let dst = "tine-tg-out";
    fx.outside(dst, "sg-out", "169.254.213.1/24", &["169.254.213.2/24"]);
    let out = v4("169.254.213.2");

    // Opened as tine-vmm opens it: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR.
    let mut tap = GuestTap::open(&vm.tap).expect("open the TAP like tine-vmm");
    let host_side = link(&vm.tap).expect("tap");
    assert!(
        host_side["flags"]
            .as_array()
            .expect("flags")
            .contains(&"LOWER_UP".into()),
        "carrier once the VMM has the TAP open"
    );
    let host_mac = mac_bytes(host_side["address"].as_str().expect("address"));
    let guest_mac = mac_bytes(&vm.mac);

    let receiver = |ns: Option<&str>, addr: Ipv4Addr, port: u16| {
        in_netns(ns, move || {
            UdpSocket::bind(SocketAddr::from((addr, port))).expect("bind udp")
        })
    };
    let expect_nothing = |sock: &UdpSocket| {
        sock.set_read_timeout(Some(BLOCKED_TIMEOUT))
            .expect("timeout");
        let mut buf = [0u8; 64];
        sock.recv_from(&mut buf).is_err()
    };
    let mut send = |src: Ipv4Addr, dst: Ipv4Addr, port: u16| {
        let frame = udp_frame(guest_mac, host_mac, src, dst, port, b"from the guest");
        tap.send(&frame).expect("send a frame");
    };
    let mut buf = [0u8; 64];

    // Allowed: arrives, masqueraded to the host's outside address.
    let open = receiver(Some(dst), out, 9000);
    open.set_read_timeout(Some(REACH_TIMEOUT)).expect("timeout");
    send(vm.address, out, 9000);
    let (len, from) = open.recv_from(&mut buf).expect("allowed datagram arrives");
    assert_eq!(&buf[..len], b"from the guest");
    assert_eq!(from.ip(), std::net::IpAddr::V4(v4("169.254.213.1")));

    // Dropped port, spoofed source, host service: nothing arrives.
    let closed = receiver(Some(dst), out, 9001);
    send(vm.address, out, 9001);
    assert!(expect_nothing(&closed), "dropped port reachable");
    send(v4("169.254.212.6"), out, 9000);
    assert!(expect_nothing(&open), "spoofed source passed");
    let host = receiver(None, vm.gateway, 0);
    let host_port = host.local_addr().expect("addr").port();
    send(vm.address, vm.gateway, host_port);
    assert!(expect_nothing(&host), "host service reachable");

    drop(tap);
    fx.mgr.detach(&vm).expect("detach");
    assert!(link(&vm.tap).is_none());
}

/// The conntrack entries whose original source is `address`
/// (`conntrack -L -s`), one line each.
fn conntrack_entries(address: Ipv4Addr) -> Vec<String> {
    sh("conntrack", &["-L", "-s", &address.to_string()])
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_policy_change_cuts_established_connections() {
    let mut fx = Fixture::new("h");
    let cfg = isolated_cfg("169.254.214.0/24", &["0.0.0.0/0"], &[]);
    let mut vm = attach(&fx, "gh", &cfg, "gh-1", &[]);
    let other = attach(&fx, "gh", &cfg, "gh-2", &[vm.address]);
    fx.stand_in_guest(&vm, "tine-th-1");
    fx.stand_in_guest(&other, "tine-th-2");
    let dst = "tine-th-out";
    fx.outside(dst, "sh-out", "169.254.215.1/24", &["169.254.215.2/24"]);
    let server = v4("169.254.215.2");
    let listener = listen(Some(dst), server, 8088);
    let connect = |ns: &'static str| {
        in_netns(Some(ns), move || {
            TcpStream::connect_timeout(&SocketAddr::from((server, 8088)), REACH_TIMEOUT)
        })
        .expect("connect while allowed")
    };
    let echo = |client: &mut TcpStream, accepted: &mut TcpStream, byte: u8| -> bool {
        client.write_all(&[byte]).expect("write");
        accepted
            .set_read_timeout(Some(BLOCKED_TIMEOUT))
            .expect("timeout");
        let mut got = [0u8; 1];
        matches!(std::io::Read::read(accepted, &mut got), Ok(1) if got[0] == byte)
    };
    let mut client = connect("tine-th-1");
    let (mut accepted, _) = listener.accept().expect("accept");
    let mut other_client = connect("tine-th-2");
    let (mut other_accepted, _) = listener.accept().expect("accept");
    assert!(echo(&mut client, &mut accepted, 1), "open connection works");
    assert!(!conntrack_entries(vm.address).is_empty(), "no entry to cut");
    let others = conntrack_entries(other.address);
    assert!(!others.is_empty());

    // Closing the VM deletes its entries at once; the other VM's stay.
    let closed = PolicyOverride {
        allow: Some(vec![]),
        drop: Some(vec!["0.0.0.0/0".into()]),
    };
    vm.set_policy(&cfg, Some(&closed)).expect("policy");
    fx.mgr.update_policy(&vm).expect("update");
    assert_eq!(conntrack_entries(vm.address), Vec::<String>::new());
    assert_eq!(conntrack_entries(other.address), others);
    // The established connection is judged again, and dropped.
    assert!(!echo(&mut client, &mut accepted, 2), "connection survived");
    assert!(
        echo(&mut other_client, &mut other_accepted, 3),
        "other VM cut"
    );
    // With nothing to delete, a change still succeeds.
    fx.mgr.update_policy(&vm).expect("update again");
}
