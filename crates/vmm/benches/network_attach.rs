//! Cost of giving a VM its network on this host, in the two steps a hot
//! fork will take apart: "prepare" (the daemon's `NetworkManager::attach`:
//! the VM's nft chain and set elements in one nftables transaction, the TAP
//! with its alias, address and link up) and "bind to a VM" (what tine-vmm
//! does at start: open `/dev/net/tun` and `TUNSETIFF` onto the prepared
//! TAP, with the vnet header size). Also a live policy change (the nft
//! transaction plus deleting the VM's conntrack entries) and the detach.
//! Prints p50/p99 of each and the attach's p50 and p99 against its 10 ms
//! budget; asserts nothing. Needs root, `/dev/net/tun` and `nft`.
//!
//!   cargo bench -p tine-vmm --bench network_attach [-- RUNS]
//!
//! Links and addresses go over rtnetlink, the TAP is made with
//! `TUNSETIFF`/`TUNSETPERSIST` and conntrack entries are deleted over
//! ctnetlink, in-process; the nft script still runs as one `nft -f -`
//! (libnftables would save that process, but it is GPL-2.0-only). With
//! `ip` and `nft` spawned per step, ~5 ms each, an attach cost ~50 ms; now
//! the one `nft` (its start and its read of our table) is most of it. For a
//! detach the kernel's unregistering of the TAP dominates, for a policy
//! change its walk of the whole conntrack table.
//!
//! Every VM stays attached until the end, so the later attaches run
//! against a table that already holds the earlier VMs' rules (as on a busy
//! host). Uses its own table (`tine_bench`) and prefixes; removes them at
//! the end.

mod common;

use common::percentile;

use std::net::Ipv4Addr;
use std::time::Instant;

use tine_daemon::network::{
    ManagerOptions, NetMode, NetworkConfig, NetworkManager, PolicyOverride, VmNetwork,
};
use tine_vmm::devices::virtio::net::Tap;

/// The budget for an attach (prepare + bind), p50.
const BUDGET_ATTACH_P50_MS: f64 = 10.0;

/// Prints one line and returns (p50, p99).
fn report(name: &str, mut samples_ms: Vec<f64>) -> (f64, f64) {
    samples_ms.sort_by(|a, b| a.total_cmp(b));
    let (p50, p99) = (percentile(&samples_ms, 0.5), percentile(&samples_ms, 0.99));
    println!(
        "{name:<34} p50 {p50:>7.2} ms   p99 {p99:>7.2} ms   ({} runs)",
        samples_ms.len()
    );
    (p50, p99)
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

fn main() {
    let runs: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100);
    let manager = NetworkManager::new(ManagerOptions {
        table: "tine_bench".into(),
        tap_prefix: "tb-".into(),
        bridge_prefix: "tbb-".into(),
    })
    .expect("manager options");
    manager.teardown().expect("clean up an earlier run");
    let cfg = NetworkConfig {
        mode: NetMode::Isolated,
        cidr: Some("169.254.240.0/22".parse().expect("cidr")),
        allow: vec!["0.0.0.0/0".into()],
        drop: vec![],
        dns: vec![],
        bridge: None,
    };
    // The seed's closed runner: --no-allow --drop 0.0.0.0/0.
    let closed = PolicyOverride {
        allow: Some(vec![]),
        drop: Some(vec!["0.0.0.0/0".into()]),
    };

    let (mut prepare, mut bind, mut attach, mut change, mut detach) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut attached: Vec<VmNetwork> = Vec::new();
    let mut taps = Vec::new();
    for i in 0..runs {
        let hostname = format!("b-{i}");
        let in_use: Vec<Ipv4Addr> = attached.iter().map(|v| v.address).collect();
        let t = Instant::now();
        let mut vm = manager
            .attach("bench", &cfg, &hostname, &in_use, None)
            .expect("prepare")
            .expect("an isolated VM has a network");
        let prepared = ms(t);
        let t = Instant::now();
        let tap = Tap::open(&vm.tap).expect("bind the prepared TAP");
        let bound = ms(t);
        prepare.push(prepared);
        bind.push(bound);
        attach.push(prepared + bound);
        taps.push(tap);

        vm.set_policy(&cfg, Some(&closed)).expect("policy");
        let t = Instant::now();
        manager.update_policy(&vm).expect("live policy change");
        change.push(ms(t));
        attached.push(vm);
    }
    drop(taps);
    for vm in &attached {
        let t = Instant::now();
        manager.detach(vm).expect("detach");
        detach.push(ms(t));
    }
    manager.teardown().expect("teardown");

    println!("network attach of an isolated VM, {runs} VMs attached one after another:");
    let (p50_prepare, _) = report("prepare (nft + TAP + address)", prepare);
    let (p50_bind, _) = report("bind to a VM (TUNSETIFF)", bind);
    let (p50_attach, p99_attach) = report("attach = prepare + bind", attach);
    report("live policy change (+ conntrack)", change);
    report("detach", detach);
    println!("bind / prepare: {:.3}", p50_bind / p50_prepare);
    println!(
        "attach vs its {BUDGET_ATTACH_P50_MS} ms budget: p50 {:.2} x, p99 {:.2} x: p50 {}",
        p50_attach / BUDGET_ATTACH_P50_MS,
        p99_attach / BUDGET_ATTACH_P50_MS,
        if p50_attach < BUDGET_ATTACH_P50_MS {
            "met"
        } else {
            "missed"
        }
    );
}
