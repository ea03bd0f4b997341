//! The host side: `ip` and `nft` commands, their JSON output, sysctls.

use std::collections::HashSet;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use serde::Deserialize;

use super::error::NetworkError;

/// Runs `program args…`, feeding `stdin` when given, and returns stdout.
pub(crate) fn run(
    program: &str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, NetworkError> {
    let command_line = || {
        let mut line = program.to_owned();
        for a in args {
            line.push(' ');
            line.push_str(a);
        }
        line
    };
    let spawn_err = |source| NetworkError::Spawn {
        program: program.to_owned(),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A write error shows up as the command's failure below.
        let _ = pipe.write_all(text.as_bytes());
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    if !out.status.success() {
        let mut stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        if let Some(text) = stdin {
            stderr.push_str("\n--- input ---\n");
            stderr.push_str(text);
        }
        return Err(NetworkError::Command {
            command: command_line(),
            status: out.status.to_string(),
            stderr,
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Applies one nft script atomically.
pub(crate) fn nft_apply(script: &str) -> Result<(), NetworkError> {
    run("nft", &["-f", "-"], Some(script)).map(drop)
}

/// Deletes the conntrack entries of connections from `address` (the VM's
/// address, the original source of everything it opened), so that packets
/// of a connection set up under an older policy are judged again by the
/// current one. `conntrack` exits 1 when there was nothing to delete.
pub(crate) fn conntrack_flush(address: Ipv4Addr) -> Result<(), NetworkError> {
    let source = address.to_string();
    match run("conntrack", &["-D", "-s", &source], None) {
        Ok(_) => Ok(()),
        Err(NetworkError::Command { stderr, .. })
            if stderr.contains("0 flow entries have been deleted") =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Runs `ip args…`.
pub(crate) fn ip(args: &[&str]) -> Result<(), NetworkError> {
    run("ip", args, None).map(drop)
}

/// One interface as `ip -j -d link show` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    pub name: String,
    /// `tap`, `tun`, `bridge`, `veth`…; `None` for plain devices.
    pub kind: Option<String>,
    pub master: Option<String>,
    pub alias: Option<String>,
}

#[derive(Deserialize)]
struct IpLink {
    ifname: String,
    #[serde(default)]
    master: Option<String>,
    #[serde(default)]
    ifalias: Option<String>,
    #[serde(default)]
    linkinfo: Option<IpLinkInfo>,
}

#[derive(Deserialize)]
struct IpLinkInfo {
    #[serde(default)]
    info_kind: Option<String>,
    #[serde(default)]
    info_data: Option<IpLinkData>,
}

#[derive(Deserialize)]
struct IpLinkData {
    #[serde(default, rename = "type")]
    tun_type: Option<String>,
}

fn parse_links(command: &str, json: &str) -> Result<Vec<Link>, NetworkError> {
    let links: Vec<IpLink> = serde_json::from_str(json).map_err(|e| NetworkError::Output {
        command: command.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(links
        .into_iter()
        .map(|l| {
            let info = l.linkinfo;
            let kind = info.as_ref().and_then(|i| i.info_kind.clone());
            // A tun device's data says whether it is a tap.
            let kind = match kind.as_deref() {
                Some("tun") => info
                    .and_then(|i| i.info_data)
                    .and_then(|d| d.tun_type)
                    .or(kind),
                _ => kind,
            };
            Link {
                name: l.ifname,
                kind,
                master: l.master,
                alias: l.ifalias,
            }
        })
        .collect())
}

/// Every interface of the host.
pub(crate) fn links() -> Result<Vec<Link>, NetworkError> {
    let json = run("ip", &["-j", "-d", "link", "show"], None)?;
    parse_links("ip -j -d link show", &json)
}

/// The interface called `name`, if any. Asks for that one interface only,
/// so the cost does not grow with the number of VMs.
pub(crate) fn link(name: &str) -> Result<Option<Link>, NetworkError> {
    match run("ip", &["-j", "-d", "link", "show", "dev", name], None) {
        Ok(json) => Ok(parse_links("ip -j -d link show dev", &json)?
            .into_iter()
            .find(|l| l.name == name)),
        Err(NetworkError::Command { stderr, .. }) if stderr.contains("does not exist") => Ok(None),
        Err(e) => Err(e),
    }
}

#[derive(Deserialize)]
struct IpAddrs {
    #[serde(default)]
    addr_info: Vec<IpAddrInfo>,
}

#[derive(Deserialize)]
struct IpAddrInfo {
    family: String,
    local: String,
    prefixlen: u8,
}

fn parse_addrs(command: &str, json: &str) -> Result<Vec<(Ipv4Addr, u8)>, NetworkError> {
    let out: Vec<IpAddrs> = serde_json::from_str(json).map_err(|e| NetworkError::Output {
        command: command.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(out
        .into_iter()
        .flat_map(|i| i.addr_info)
        .filter(|a| a.family == "inet")
        .filter_map(|a| Some((a.local.parse().ok()?, a.prefixlen)))
        .collect())
}

/// The IPv4 addresses of interface `name`.
pub(crate) fn addrs(name: &str) -> Result<Vec<(Ipv4Addr, u8)>, NetworkError> {
    let json = run("ip", &["-j", "-4", "addr", "show", "dev", name], None)?;
    parse_addrs("ip -j -4 addr show", &json)
}

/// What our table holds: chain names and the elements of its sets and map.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct TableState {
    pub chains: HashSet<String>,
    pub iso_ifs: HashSet<String>,
    pub nat_ifs: HashSet<String>,
    pub iso_fwd: HashSet<String>,
}

fn parse_table(command: &str, json: &str) -> Result<TableState, NetworkError> {
    let bad = |reason: String| NetworkError::Output {
        command: command.to_owned(),
        reason,
    };
    let doc: serde_json::Value = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    let items = doc
        .get("nftables")
        .and_then(|v| v.as_array())
        .ok_or_else(|| bad("no \"nftables\" array".to_owned()))?;
    let mut state = TableState::default();
    let elements = |obj: &serde_json::Value| -> HashSet<String> {
        let Some(elems) = obj.get("elem").and_then(|e| e.as_array()) else {
            return HashSet::new();
        };
        elems
            .iter()
            .filter_map(|e| {
                // A set element is a string, a map element a [key, value] pair.
                e.as_str()
                    .or_else(|| e.get(0).and_then(|k| k.as_str()))
                    .map(str::to_owned)
            })
            .collect()
    };
    for item in items {
        if let Some(chain) = item.get("chain") {
            if let Some(name) = chain.get("name").and_then(|n| n.as_str()) {
                state.chains.insert(name.to_owned());
            }
        }
        for key in ["set", "map"] {
            if let Some(obj) = item.get(key) {
                match obj.get("name").and_then(|n| n.as_str()) {
                    Some("iso_ifs") => state.iso_ifs = elements(obj),
                    Some("nat_ifs") => state.nat_ifs = elements(obj),
                    Some("iso_fwd") => state.iso_fwd = elements(obj),
                    _ => {}
                }
            }
        }
    }
    Ok(state)
}

/// Lists table `inet <table>`.
pub(crate) fn table_state(table: &str) -> Result<TableState, NetworkError> {
    let json = run("nft", &["-j", "list", "table", "inet", table], None)?;
    parse_table("nft -j list table", &json)
}

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// Turns on IPv4 forwarding (host-wide; needed for the VMs' egress).
pub(crate) fn enable_ip_forward() -> Result<(), NetworkError> {
    let err = |source| NetworkError::Sysctl {
        path: IP_FORWARD,
        source,
    };
    let current = std::fs::read_to_string(IP_FORWARD).map_err(err)?;
    if current.trim() != "1" {
        std::fs::write(IP_FORWARD, "1\n").map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_links() {
        let json = r#"[
          {"ifindex":1,"ifname":"lo","flags":["LOOPBACK"]},
          {"ifindex":5,"ifname":"tt-a","master":"tbr-g","ifalias":"a",
           "linkinfo":{"info_kind":"tun","info_data":{"type":"tap","pi":false,"vnet_hdr":true},
                       "info_slave_kind":"bridge"}},
          {"ifindex":6,"ifname":"tbr-g","linkinfo":{"info_kind":"bridge","info_data":{}}},
          {"ifindex":7,"ifname":"tun0","linkinfo":{"info_kind":"tun","info_data":{"type":"tun"}}}
        ]"#;
        let links = parse_links("ip", json).expect("parse");
        assert_eq!(links.len(), 4);
        assert_eq!(links[0].kind, None);
        assert_eq!(
            links[1],
            Link {
                name: "tt-a".into(),
                kind: Some("tap".into()),
                master: Some("tbr-g".into()),
                alias: Some("a".into()),
            }
        );
        assert_eq!(links[2].kind.as_deref(), Some("bridge"));
        assert_eq!(links[3].kind.as_deref(), Some("tun"));
        assert!(parse_links("ip", "not json").is_err());
    }

    #[test]
    fn parses_addrs() {
        let json = r#"[{"ifindex":5,"ifname":"tt-a","addr_info":[
            {"family":"inet","local":"169.254.40.1","prefixlen":30},
            {"family":"inet6","local":"fe80::1","prefixlen":64}]}]"#;
        assert_eq!(
            parse_addrs("ip", json).expect("parse"),
            [("169.254.40.1".parse().expect("ip"), 30)]
        );
    }

    #[test]
    fn parses_table() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
          {"table": {"family": "inet", "name": "tine", "handle": 1}},
          {"set": {"family": "inet", "name": "iso_ifs", "table": "tine", "type": "ifname", "elem": ["tt-a"]}},
          {"set": {"family": "inet", "name": "nat_ifs", "table": "tine", "type": "ifname", "elem": ["tt-a", "tbr-g"]}},
          {"map": {"family": "inet", "name": "iso_fwd", "table": "tine", "type": "ifname", "map": "verdict",
                   "elem": [["tt-a", {"jump": {"target": "vm-tt-a"}}]]}},
          {"chain": {"family": "inet", "table": "tine", "name": "input", "handle": 4}},
          {"chain": {"family": "inet", "table": "tine", "name": "vm-tt-a", "handle": 37}},
          {"rule": {"family": "inet", "table": "tine", "chain": "input", "handle": 14, "expr": []}}]}"#;
        let state = parse_table("nft", json).expect("parse");
        let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<HashSet<_>>();
        assert_eq!(state.chains, set(&["input", "vm-tt-a"]));
        assert_eq!(state.iso_ifs, set(&["tt-a"]));
        assert_eq!(state.nat_ifs, set(&["tt-a", "tbr-g"]));
        assert_eq!(state.iso_fwd, set(&["tt-a"]));
        assert!(parse_table("nft", "{}").is_err());
    }
}
