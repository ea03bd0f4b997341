//! VM networking with booted guests in the test bed: real TAPs, real
//! nftables, test hosts in network namespaces of L1 on documentation
//! ranges (198.51.100.0/24, 203.0.113.0/24) serving HTTP, DNS and echo.
//!
//! - `isolated`: an open builder downloads over HTTP and resolves names
//!   through the group's `dns`; a fork made with `--no-allow --drop
//!   0.0.0.0/0` (as root) tries well over 1000 ways out and the test hosts
//!   and nft counters see no packet from it while exec over vsock still
//!   works; a live change to an `IP:port` allow list lets exactly that
//!   through; another live change cuts an open connection; two isolated
//!   VMs cannot reach each other.
//! - `bridge`: two bridge-mode VMs reach each other and the host.
//!
//! The figure (attempts, packets out) is printed.

mod support;

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::*;
use tine_client::api::{CpMode, ShutdownAction, TineClient, UploadOptions, Wait};
use tine_proto::api::{
    CommitRequest, DefaultAction, ForkNetwork, ForkRequest, NetworkMode, NetworkPolicy,
    PolicySource,
};
use tine_testbed::{repo_root, Trial};

/// Where the static probe is, from the host into the bed.
const PROBE_ENV: &str = "TINE_TEST_NETPROBE";
/// Where the probe lives in the guests.
const PROBE: &str = "/usr/local/bin/tine-netprobe";

/// Test host 1 (HTTP on 8080 and 8081, DNS, echo on 7000) and the host's
/// side of its link.
const TH1: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const TH1_LINK: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
/// Test host 2 (HTTP on 8080).
const TH2: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const TH2_LINK: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// The name the test's resolver answers, with TH1.
const NAME: &str = "files.test.example";
/// The bridge group's network; the host is its first address.
const BRIDGE_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 200, 1);

const GROUPS: &str = "  - name: iso
    cpus: 1
    ram_mb: 256
    persistent: true
    network:
      mode: isolated
      cidr: 169.254.64.0/22
      allow: [0.0.0.0/0]
      dns: [198.51.100.10]
  - name: br
    cpus: 1
    ram_mb: 256
    persistent: true
    network:
      mode: bridge
      cidr: 169.254.200.0/24
";

fn ip(args: &[&str]) -> R {
    run_tool(Command::new("ip").args(args), "ip (iproute2)").map(drop)
}

fn nft(script: &str, netns: Option<&str>) -> R {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "nft", "-f", "-"]);
            c
        }
        None => {
            let mut c = Command::new("nft");
            c.args(["-f", "-"]);
            c
        }
    };
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run nft (nftables): {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(fail(format!(
            "nft -f failed: {}\n{script}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(())
}

/// The packet counts of the counters in chain `chain` of table
/// `family_table` (e.g. `inet tinetest`), in rule order (anonymous
/// counters: named ones would need the nft_objref module).
fn counters(family_table: &str, chain: &str, netns: Option<&str>) -> R<Vec<u64>> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "nft"]);
            c
        }
        None => Command::new("nft"),
    };
    let mut args: Vec<&str> = vec!["-j", "list", "chain"];
    args.extend(family_table.split(' '));
    args.push(chain);
    let json = run_tool(cmd.args(&args), "nft (nftables)")?;
    let doc: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| fail(format!("nft -j: {e}: {json}")))?;
    let found: Vec<u64> = doc["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item["rule"]["expr"].as_array())
        .flatten()
        .filter_map(|e| e["counter"]["packets"].as_u64())
        .collect();
    if found.is_empty() {
        return Err(fail(format!(
            "no counter in {family_table} {chain}: {json}"
        )));
    }
    Ok(found)
}

/// A test host: namespace `ns` joined to L1 by a veth pair, `addr`/24
/// inside and `link`/24 on L1's side, with counters of every IPv4 and ARP
/// packet that reaches it.
fn test_host(ns: &str, outside: &str, addr: Ipv4Addr, link: Ipv4Addr) -> R {
    // Left over from an earlier run in the same L1, if any.
    let _ = Command::new("ip").args(["netns", "del", ns]).output();
    let _ = Command::new("ip").args(["link", "del", outside]).output();
    ip(&["netns", "add", ns])?;
    ip(&[
        "link", "add", outside, "type", "veth", "peer", "name", "th0", "netns", ns,
    ])?;
    // No IPv6 chatter (router solicitations, MLD) on the test links: every
    // packet the counters see must be explained.
    for (netns, dev) in [(None, outside), (Some(ns), "th0")] {
        let sysctl = format!("net.ipv6.conf.{dev}.disable_ipv6=1");
        let mut cmd = match netns {
            Some(n) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", n, "sysctl", "-qw", &sysctl]);
                c
            }
            None => {
                let mut c = Command::new("sysctl");
                c.args(["-qw", &sysctl]);
                c
            }
        };
        run_tool(&mut cmd, "sysctl (procps)")?;
    }
    ip(&["addr", "add", &format!("{link}/24"), "dev", outside])?;
    ip(&["link", "set", outside, "up"])?;
    ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", "th0"])?;
    ip(&["-n", ns, "link", "set", "th0", "up"])?;
    ip(&["-n", ns, "link", "set", "lo", "up"])?;
    ip(&[
        "-n",
        ns,
        "route",
        "add",
        "default",
        "via",
        &link.to_string(),
    ])?;
    nft(
        "add table netdev probe
add chain netdev probe count_in { type filter hook ingress device \"th0\" priority 0; }
add rule netdev probe count_in meta protocol ip counter
add rule netdev probe count_in meta protocol arp counter
",
        Some(ns),
    )
}

/// What test host `ns` has received so far: IPv4 packets, ARP frames
/// (L1's own included), and, once [`watch_mac`] ran, frames whose Ethernet
/// source or ARP sender is the watched VM's MAC.
fn host_seen(ns: &str) -> R<Vec<u64>> {
    counters("netdev probe", "count_in", Some(ns))
}

/// Adds counters of frames from `mac` to test host `ns`: a VM's frames
/// can only get there by leaking through at layer 2.
fn watch_mac(ns: &str, mac: &str) -> R {
    nft(
        &format!(
            "add rule netdev probe count_in ether saddr {mac} counter
add rule netdev probe count_in arp htype 1 arp hlen 6 arp saddr ether {mac} counter
"
        ),
        Some(ns),
    )
}

/// Sockets bound inside namespace `ns` (a socket stays in the namespace
/// it was made in, whichever thread then uses it).
fn bind_in(
    ns: &str,
    tcp: &[SocketAddr],
    udp: &[SocketAddr],
) -> R<(Vec<TcpListener>, Vec<UdpSocket>)> {
    let file = File::open(format!("/run/netns/{ns}"))?;
    let tcp = tcp.to_vec();
    let udp = udp.to_vec();
    std::thread::spawn(move || -> Result<_, String> {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("setns: {e}"))?;
        let listeners = tcp
            .iter()
            .map(|a| TcpListener::bind(a).map_err(|e| format!("bind {a}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let sockets = udp
            .iter()
            .map(|a| UdpSocket::bind(a).map_err(|e| format!("bind udp {a}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((listeners, sockets))
    })
    .join()
    .map_err(|_| fail("the bind thread panicked"))?
    .map_err(fail)
}

/// Answers every connection with `hello from ADDR` over HTTP/1.0.
fn serve_http(listener: TcpListener) {
    std::thread::spawn(move || {
        let me = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        for conn in listener.incoming().flatten() {
            let me = me.clone();
            std::thread::spawn(move || {
                let mut conn = conn;
                let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 16384 {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let body = format!("hello from {me}\n");
                let _ = write!(
                    conn,
                    "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
}

/// Echoes every byte back.
fn serve_echo(listener: TcpListener) {
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut conn = conn;
                let mut buf = [0u8; 256];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

/// A DNS server that answers A queries for [`NAME`] with [`TH1`] and
/// everything else with NXDOMAIN; counts the queries.
fn serve_dns(socket: UdpSocket, queries: Arc<AtomicU64>) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = socket.recv_from(&mut buf) {
            queries.fetch_add(1, Ordering::SeqCst);
            if let Some(answer) = dns_answer(&buf[..n]) {
                let _ = socket.send_to(&answer, from);
            }
        }
    });
}

fn dns_answer(query: &[u8]) -> Option<Vec<u8>> {
    if query.len() < 12 {
        return None;
    }
    // The question: labels up to a zero byte, then type and class.
    let mut i = 12;
    let mut labels = Vec::new();
    while i < query.len() && query[i] != 0 {
        let len = query[i] as usize;
        let label = query.get(i + 1..i + 1 + len)?;
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        i += 1 + len;
    }
    let question_end = i + 5;
    let question = query.get(12..question_end)?;
    let qtype = u16::from_be_bytes([*query.get(i + 1)?, *query.get(i + 2)?]);
    // The name exists (NOERROR) but has only an A record: other types get
    // an empty answer, other names NXDOMAIN.
    let known = labels.join(".") == NAME;
    let found = known && qtype == 1;
    let mut r = query[..2].to_vec();
    r.extend_from_slice(if known { &[0x81, 0x80] } else { &[0x81, 0x83] });
    r.extend_from_slice(&[0, 1, 0, u8::from(found), 0, 0, 0, 0]);
    r.extend_from_slice(question);
    if found {
        r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        r.extend_from_slice(&TH1.octets());
    }
    Some(r)
}

/// Both test hosts with their servers; returns the DNS query count.
fn test_hosts() -> R<Arc<AtomicU64>> {
    test_host("th1", "tv-h1", TH1, TH1_LINK)?;
    test_host("th2", "tv-h2", TH2, TH2_LINK)?;
    let sa = |ip: Ipv4Addr, port: u16| SocketAddr::from((ip, port));
    let (tcp, udp) = bind_in(
        "th1",
        &[sa(TH1, 8080), sa(TH1, 8081), sa(TH1, 7000)],
        &[sa(TH1, 53)],
    )?;
    let mut tcp = tcp.into_iter();
    let queries = Arc::new(AtomicU64::new(0));
    if let (Some(a), Some(b), Some(echo), Some(dns)) =
        (tcp.next(), tcp.next(), tcp.next(), udp.into_iter().next())
    {
        serve_http(a);
        serve_http(b);
        serve_echo(echo);
        serve_dns(dns, queries.clone());
    }
    let (tcp, _) = bind_in("th2", &[sa(TH2, 8080)], &[])?;
    tcp.into_iter().for_each(serve_http);
    Ok(queries)
}

/// Counts, on the host, what the VM behind `tap` got past tine's rules:
/// forwarded packets and packets delivered to the host itself (chains
/// after tine's filter chains, so only what tine accepted).
fn host_counters(tap: &str) -> R {
    nft(
        &format!(
            "add table inet tinetest
delete table inet tinetest
add table inet tinetest
add chain inet tinetest count_fwd {{ type filter hook forward priority 10; policy accept; }}
add chain inet tinetest count_inp {{ type filter hook input priority 10; policy accept; }}
add rule inet tinetest count_fwd iifname \"{tap}\" counter
add rule inet tinetest count_inp iifname \"{tap}\" counter
"
        ),
        None,
    )
}

fn tap_rx_packets(tap: &str) -> R<u64> {
    let text = std::fs::read_to_string(format!("/sys/class/net/{tap}/statistics/rx_packets"))?;
    text.trim()
        .parse()
        .map_err(|_| fail(format!("rx_packets of {tap}: {text:?}")))
}

async fn install_probe(c: &TineClient, vm: &str) -> R {
    let probe = std::env::var(PROBE_ENV).map_err(|_| fail(format!("{PROBE_ENV} is not set")))?;
    let bytes = std::fs::read(&probe)?;
    sh_ok(c, vm, "mkdir -p /usr/local/bin").await?;
    c.cp_upload(
        vm,
        PROBE,
        CpMode::Binary,
        &UploadOptions {
            mode_bits: Some(0o755),
            ..UploadOptions::default()
        },
        std::io::Cursor::new(bytes),
    )
    .await
    .or_fail()?;
    Ok(())
}

async fn connects(c: &TineClient, vm: &str, to: &str) -> R<(bool, String)> {
    let (code, out, err) = sh(c, vm, &format!("{PROBE} connect {to} 2000")).await?;
    Ok((code == 0, format!("{out}{err}")))
}

async fn expect_reach(c: &TineClient, vm: &str, to: &str, want: bool) -> R {
    let (reached, text) = connects(c, vm, to).await?;
    if reached != want {
        return Err(fail(format!(
            "{vm} -> {to}: expected {}, got: {text}",
            if want { "a connection" } else { "none" }
        )));
    }
    Ok(())
}

fn address_of(info: &tine_proto::api::VmInfo) -> R<Ipv4Addr> {
    info.ip
        .as_deref()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| fail(format!("{} has no address", info.hostname)))
}

fn policy(allow: Option<&[&str]>, drop: Option<&[&str]>) -> NetworkPolicy {
    let list = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
    NetworkPolicy {
        allow: allow.map(list),
        drop: drop.map(list),
    }
}

fn isolated() -> R {
    let queries = test_hosts()?;
    let mut d = Daemon::start("guestnet", GROUPS, None)?;
    let r = rt();
    let result = r.block_on(isolated_checks(&d.client, &queries));
    if result.is_err() {
        println!("daemon log:\n{}", d.log_tail());
    }
    let _ = d.kill9();
    result
}

async fn isolated_checks(c: &TineClient, queries: &AtomicU64) -> R {
    // The open builder.
    let t = Instant::now();
    let b = c
        .create_vm("iso", &create_req(true), Wait::Agent, Some(BOOT))
        .await
        .or_fail()?;
    println!(
        "builder {} up in {} ms",
        b.hostname,
        t.elapsed().as_millis()
    );
    let builder = b.hostname.clone();
    let info = c.describe(&builder).await.or_fail()?;
    let n = &info.network;
    assert_eq!(n.mode, NetworkMode::Isolated);
    assert_eq!(n.policy_source, PolicySource::HostGroup);
    assert_eq!(n.effective.allow, ["0.0.0.0/0"]);
    // Allow-only: the rest is denied, but 0.0.0.0/0 leaves no rest.
    assert_eq!(n.effective.default, DefaultAction::Deny);
    assert!(n.overrides.is_none());
    install_probe(c, &builder).await?;

    let resolv = sh_ok(c, &builder, "cat /etc/resolv.conf").await?;
    assert!(resolv.contains("nameserver 198.51.100.10"), "{resolv}");
    let before = queries.load(Ordering::SeqCst);
    let (code, looked_up, err) = sh(c, &builder, &format!("nslookup {NAME}")).await?;
    assert_eq!(code, 0, "nslookup {NAME}: {looked_up}{err}");
    assert!(looked_up.contains("198.51.100.10"), "{looked_up}");
    assert!(
        queries.load(Ordering::SeqCst) > before,
        "the test's resolver got no query"
    );
    // The image's own HTTP client, by address and by name.
    // As the issue typed it (progress on stderr), then quiet and by name.
    for (flags, url) in [
        ("-O-", format!("http://{TH1}:8080/")),
        ("-q -O-", format!("http://{TH1}:8080/")),
        ("-q -O-", format!("http://{NAME}:8081/")),
    ] {
        let (code, out, err) = sh(c, &builder, &format!("wget {flags} {url}")).await?;
        if code != 0 {
            let dmesg = sh(c, &builder, "dmesg | tail -5").await?.1;
            return Err(fail(format!(
                "wget {url} exited {code}: {out}{err}\nguest dmesg:\n{dmesg}"
            )));
        }
        assert!(
            out.starts_with("hello from 198.51.100.10:808"),
            "{url}: {out}"
        );
    }
    expect_reach(c, &builder, &format!("{TH2}:8080"), true).await?;
    println!("builder: HTTP and DNS through the test hosts work");

    // Commit the builder and fork the closed runner, as the seed types it:
    // tine vm fork C --tag role=runner --no-allow --drop 0.0.0.0/0
    c.shutdown(&builder, ShutdownAction::Shutdown, None)
        .await
        .or_fail()?;
    let commit = c
        .commit(&builder, &CommitRequest::default())
        .await
        .or_fail()?;
    let fork = |tag: &str, network: Option<ForkNetwork>| ForkRequest {
        tags: Some(vec![tag.to_owned()]),
        network,
        ..ForkRequest::default()
    };
    let closed = ForkNetwork::Policy(policy(Some(&[]), Some(&["0.0.0.0/0"])));
    let t = Instant::now();
    let runner = c
        .fork(
            &commit.commit_id,
            &fork("role=runner", Some(closed)),
            Wait::Agent,
            Some(BOOT),
        )
        .await
        .or_fail()?
        .hostname;
    println!("runner {runner} up in {} ms", t.elapsed().as_millis());
    let info = c.describe(&runner).await.or_fail()?;
    let n = &info.network;
    assert_eq!(n.policy_source, PolicySource::Override);
    assert_eq!(n.host_group.allow, ["0.0.0.0/0"]);
    assert_eq!(n.overrides, Some(policy(Some(&[]), Some(&["0.0.0.0/0"]))));
    assert!(n.effective.allow.is_empty());
    assert_eq!(n.effective.drop, ["0.0.0.0/0"]);
    let tap = n.tap.clone().ok_or_else(|| fail("runner has no tap"))?;
    let runner_ip = address_of(&info)?;
    let gateway = n
        .gateway
        .clone()
        .ok_or_else(|| fail("runner has no gateway"))?;

    let builder_ip = address_of(&c.describe(&builder).await.or_fail()?)?;
    let mac = n.mac.clone().ok_or_else(|| fail("runner has no MAC"))?;
    closed_runner(c, &runner, &tap, runner_ip, builder_ip, &gateway, &mac).await?;
    allow_list_precision(c, &runner).await?;
    live_change_cuts(c, &runner).await?;

    // A second isolated VM: neither reaches the other, though both are
    // open to the test hosts.
    let peer = c
        .fork(
            &commit.commit_id,
            &fork("role=peer", None),
            Wait::Agent,
            Some(BOOT),
        )
        .await
        .or_fail()?
        .hostname;
    let peer_ip = address_of(&c.describe(&peer).await.or_fail()?)?;
    c.set_network(&runner, &NetworkPolicy::default())
        .await
        .or_fail()?;
    for vm in [&runner, &peer] {
        sh_ok(
            c,
            vm,
            "(busybox nc -ll -p 9000 -e /bin/cat </dev/null >/dev/null 2>&1 &)",
        )
        .await?;
    }
    expect_reach(c, &runner, &format!("{TH1}:8080"), true).await?;
    expect_reach(c, &peer, &format!("{TH1}:8080"), true).await?;
    expect_reach(c, &peer, &format!("{peer_ip}:9000"), true).await?;
    expect_reach(c, &peer, &format!("{runner_ip}:9000"), false).await?;
    expect_reach(c, &runner, &format!("{peer_ip}:9000"), false).await?;
    let (code, out, _) = sh(c, &peer, &format!("ping -c 2 -W 1 {runner_ip}")).await?;
    assert_ne!(code, 0, "the peer pinged the runner: {out}");
    println!("isolated VMs: each reaches the test hosts, neither reaches the other");
    Ok(())
}

/// The closed runner tries every way out; nothing gets past the host.
async fn closed_runner(
    c: &TineClient,
    runner: &str,
    tap: &str,
    runner_ip: Ipv4Addr,
    other_vm: Ipv4Addr,
    gateway: &str,
    mac: &str,
) -> R {
    host_counters(tap)?;
    for ns in ["th1", "th2"] {
        watch_mac(ns, mac)?;
    }
    let seen_before = [host_seen("th1")?, host_seen("th2")?];
    let rx_before = tap_rx_packets(tap)?;
    let targets = format!("{TH1},{TH2},{TH1_LINK},{TH2_LINK},{gateway},{BRIDGE_GATEWAY}");
    let ports = "22,53,80,443,7000,8080,8081";
    // Forged sources: the host's own link address, a test-network address
    // and another VM's address.
    let spoof = format!("{TH1_LINK},198.51.100.77,{other_vm}");
    let arp = format!("{gateway},{TH1},{TH1_LINK},{other_vm},{TH2}");
    let escape = |rounds: u32| {
        format!(
            "{PROBE} escape --targets {targets} --ports {ports} --spoof {spoof} --arp {arp} --rounds {rounds}"
        )
    };
    let mut attempts = 0u64;
    let mut add = |out: &str| -> R {
        let total = out
            .split_whitespace()
            .find_map(|w| w.strip_prefix("total="))
            .and_then(|n| n.parse::<u64>().ok())
            .ok_or_else(|| fail(format!("probe said {out:?}")))?;
        attempts += total;
        println!("closed runner probe: {}", out.trim());
        Ok(())
    };
    // Through the default route.
    add(&sh_ok(c, runner, &escape(12)).await?)?;
    // Then with its own routes and a foreign address of its own: the test
    // host's network on-link, the other one through the host directly.
    sh_ok(
        c,
        runner,
        "ip addr add 198.51.100.77/24 dev eth0 && \
         ip route replace 203.0.113.0/24 dev eth0 && ip route replace default dev eth0",
    )
    .await?;
    add(&sh_ok(c, runner, &escape(6)).await?)?;
    // Busybox's own tools too: ping (a raw socket), nc, arping.
    let tools = format!(
        "for i in 1 2 3; do ping -c 1 -W 1 {TH1} ; ping -c 1 -W 1 -I 198.51.100.77 {TH2}; \
         nc -w 1 {TH1} 8080 </dev/null; arping -c 1 -w 1 -I eth0 {TH1_LINK}; done; true"
    );
    sh(c, runner, &tools).await?;
    attempts += 12;
    sh_ok(
        c,
        runner,
        &format!(
            "ip addr del 198.51.100.77/24 dev eth0 && ip route del 203.0.113.0/24 dev eth0 && \
             ip route replace default via {gateway}"
        ),
    )
    .await?;
    // Exec over vsock still answers.
    assert_eq!(sh_ok(c, runner, "echo alive").await?.trim(), "alive");
    std::thread::sleep(Duration::from_millis(500));

    let rx = tap_rx_packets(tap)? - rx_before;
    let forwarded: u64 = counters("inet tinetest", "count_fwd", None)?.iter().sum();
    let delivered: u64 = counters("inet tinetest", "count_inp", None)?.iter().sum();
    let seen_after = [host_seen("th1")?, host_seen("th2")?];
    // Per test host: [IPv4, ARP, frames from the runner's MAC, ARP from
    // the runner's MAC]; ARP that is not the runner's is L1's own.
    let delta = |i: usize| -> u64 {
        seen_after
            .iter()
            .zip(&seen_before)
            .map(|(a, b)| a.get(i).copied().unwrap_or(0) - b.get(i).copied().unwrap_or(0))
            .sum()
    };
    let (at_hosts, l1_arp, from_mac) = (delta(0), delta(1), delta(2) + delta(3));
    if seen_after.iter().any(|v| v.len() != 4) {
        return Err(fail(format!("test host counters: {seen_after:?}")));
    }
    let packets_out = forwarded + delivered + at_hosts + from_mac;
    println!(
        "closed runner ({runner_ip}): {attempts} attempts, {rx} packets reached its TAP, \
         packets out: {packets_out} (forwarded {forwarded}, delivered to the host {delivered}, \
         IPv4 at the test hosts {at_hosts}, frames with its MAC at the test hosts {from_mac}; \
         ARP from L1 itself: {l1_arp})"
    );
    assert!(attempts >= 1000, "only {attempts} attempts");
    assert!(
        rx >= 1000,
        "only {rx} packets left the guest: the probe did not really try"
    );
    assert_eq!(packets_out, 0, "packets got out of the closed runner");
    Ok(())
}

/// A live allow list of one `IP:port`: that port is reachable, another
/// port of the same host and another host are not.
async fn allow_list_precision(c: &TineClient, runner: &str) -> R {
    let only = format!("{TH1}:8080");
    let n = c
        .set_network(runner, &policy(Some(&[only.as_str()]), Some(&[])))
        .await
        .or_fail()?;
    assert_eq!(n.effective.allow, std::slice::from_ref(&only));
    assert_eq!(n.effective.default, DefaultAction::Deny);
    let (reached, text) = connects(c, runner, &only).await?;
    assert!(reached, "{only}: {text}");
    assert!(text.contains("hello from 198.51.100.10:8080"), "{text}");
    expect_reach(c, runner, &format!("{TH1}:8081"), false).await?;
    expect_reach(c, runner, &format!("{TH2}:8080"), false).await?;
    println!("allow list {only}: that port only");
    Ok(())
}

/// Waits up to 20 s for `needle` in the guest's /tmp/hold.log.
async fn wait_for_log(c: &TineClient, vm: &str, needle: &str) -> R<String> {
    let start = Instant::now();
    loop {
        let text = sh_ok(c, vm, "cat /tmp/hold.log").await?;
        if text.contains(needle) {
            return Ok(text);
        }
        if start.elapsed() > Duration::from_secs(20) {
            return Err(fail(format!("no {needle:?} in the hold log: {text}")));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An open connection is cut by a live change that forbids it.
async fn live_change_cuts(c: &TineClient, runner: &str) -> R {
    c.set_network(runner, &policy(Some(&["0.0.0.0/0"]), None))
        .await
        .or_fail()?;
    sh_ok(
        c,
        runner,
        &format!("({PROBE} hold {TH1}:7000 60 </dev/null >/tmp/hold.log 2>&1 &)"),
    )
    .await?;
    wait_for_log(c, runner, "echo 5\n").await?;
    let changed = Instant::now();
    c.set_network(runner, &policy(Some(&[]), Some(&["0.0.0.0/0"])))
        .await
        .or_fail()?;
    let text = wait_for_log(c, runner, "cut after").await?;
    println!(
        "live change: the open connection was cut {} ms after the change ({})",
        changed.elapsed().as_millis(),
        text.lines().last().unwrap_or_default()
    );
    Ok(())
}

/// Two bridge-mode VMs reach each other and the host.
fn bridge() -> R {
    let mut d = Daemon::start("guestbr", GROUPS, None)?;
    let r = rt();
    let result = r.block_on(async {
        let c = &d.client;
        let req = create_req(false);
        let (a, b) = tokio::join!(
            c.create_vm("br", &req, Wait::Agent, Some(BOOT)),
            c.create_vm("br", &req, Wait::Agent, Some(BOOT)),
        );
        let (a, b) = (a.or_fail()?.hostname, b.or_fail()?.hostname);
        let info = c.describe(&b).await.or_fail()?;
        assert_eq!(info.network.mode, NetworkMode::Bridge);
        let b_ip = address_of(&info)?;
        install_probe(c, &a).await?;
        sh_ok(
            c,
            &b,
            "(busybox nc -ll -p 9000 -e /bin/cat </dev/null >/dev/null 2>&1 &)",
        )
        .await?;
        let host = TcpListener::bind((BRIDGE_GATEWAY, 9100))?;
        serve_http(host);
        expect_reach(c, &a, &format!("{b_ip}:9000"), true).await?;
        let (reached, text) = connects(c, &a, &format!("{BRIDGE_GATEWAY}:9100")).await?;
        assert!(
            reached && text.contains("hello from 169.254.200.1:9100"),
            "{text}"
        );
        sh_ok(c, &a, &format!("ping -c 1 -W 2 {b_ip}")).await?;
        println!("bridge: {a} reaches {b} ({b_ip}) and the host");
        Ok(())
    });
    if result.is_err() {
        println!("daemon log:\n{}", d.log_tail());
    }
    let _ = d.kill9();
    result
}

/// Builds the static probe (like the min image's agent) on the host.
fn build_probe() -> Result<PathBuf, String> {
    let target = "x86_64-unknown-linux-gnu";
    let status = Command::new("cargo")
        .args([
            "build",
            "--release",
            "-q",
            "-p",
            "tine-netprobe",
            "--target",
            target,
        ])
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .current_dir(repo_root())
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("building tine-netprobe failed: {status}"));
    }
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let probe = dir.join(target).join("release/tine-netprobe");
    if !probe.is_file() {
        return Err(format!("cargo did not produce {}", probe.display()));
    }
    Ok(probe)
}

fn main() {
    run_daemon_if_asked();
    if tine_testbed::placement().is_none() && !std::env::args().any(|a| a == "--list") {
        match build_probe() {
            // Before any thread: the bed inherits the environment.
            Ok(probe) => std::env::set_var(PROBE_ENV, probe),
            Err(e) => {
                eprintln!("guest network test: {e}");
                std::process::exit(101);
            }
        }
    }
    bed_main(
        "guest network test",
        vec![
            Trial::test("isolated", isolated),
            Trial::test("bridge", bridge),
        ],
    );
}
