//! The rest of the host side: what our nft table holds, sysctls.

use std::collections::HashSet;

use super::error::NetworkError;
use super::nftcmd::Nftables;

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
pub(crate) fn table_state(nft: &mut Nftables, table: &str) -> Result<TableState, NetworkError> {
    let command = format!("list table inet {table}");
    let json = nft.run_json(&command)?;
    parse_table(&command, &json)
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
