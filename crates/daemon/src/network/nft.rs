//! nftables scripts for `nft -f`. Each change is one script, which nft
//! applies as one atomic transaction.
//!
//! Everything lives in one table of family `inet` (default `tine`); other
//! tables are never touched. Its fixed part:
//!
//! - set `iso_ifs`: the TAPs of isolated VMs;
//! - set `nat_ifs`: every interface behind which VMs live (isolated TAPs and
//!   bridges), masqueraded when leaving through another interface;
//! - map `iso_fwd`: isolated TAP → `jump vm-<tap>`, that VM's egress policy;
//! - chain `input`: from an isolated TAP only replies (established/related)
//!   reach the host;
//! - chain `forward`: nothing new enters an isolated TAP, an isolated VM
//!   reaches no VM (isolated TAP or bridge), the rest of its traffic goes
//!   through its policy chain (and is dropped should the chain be
//!   missing);
//! - chain `postrouting`: the masquerade.
//!
//! The fixed part is re-asserted (chains flushed and refilled) in every
//! script, so a table that was deleted by hand comes back whole.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use super::config::{DefaultAction, PolicyEntry};

/// Verdict of a policy rule.
fn verdict(action: DefaultAction) -> &'static str {
    match action {
        DefaultAction::Allow => "accept",
        DefaultAction::Deny => "drop",
    }
}

/// The nft chain holding an isolated VM's policy.
pub(crate) fn vm_chain(tap: &str) -> String {
    format!("vm-{tap}")
}

/// The fixed part of the table (see the module documentation).
pub(crate) fn base(table: &str) -> String {
    let t = format!("inet {table}");
    format!(
        "add table {t}
add set {t} iso_ifs {{ type ifname; }}
add set {t} nat_ifs {{ type ifname; }}
add map {t} iso_fwd {{ type ifname : verdict; }}
add chain {t} input {{ type filter hook input priority filter; policy accept; }}
add chain {t} forward {{ type filter hook forward priority filter; policy accept; }}
add chain {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}
flush chain {t} input
add rule {t} input iifname @iso_ifs ct state established,related accept
add rule {t} input iifname @iso_ifs drop
flush chain {t} forward
add rule {t} forward oifname @iso_ifs ct state established,related accept
add rule {t} forward oifname @iso_ifs drop
add rule {t} forward iifname @iso_ifs oifname @nat_ifs drop
add rule {t} forward iifname vmap @iso_fwd
add rule {t} forward iifname @iso_ifs drop
flush chain {t} postrouting
add rule {t} postrouting iifname @nat_ifs oifname != @nat_ifs masquerade
"
    )
}

/// Match expression of one policy entry.
fn entry_match(entry: &PolicyEntry) -> String {
    let mut m = format!("ip daddr {}", entry.net);
    if let Some(port) = entry.port {
        let _ = write!(m, " meta l4proto {{ tcp, udp }} th dport {port}");
    }
    m
}

/// Adds (or replaces) an isolated VM's rules: its policy chain (anti-spoof,
/// replies, allow entries, drop entries, default) and its set and map
/// elements.
pub(crate) fn add_isolated(
    table: &str,
    tap: &str,
    address: Ipv4Addr,
    allow: &[PolicyEntry],
    drop: &[PolicyEntry],
    default: DefaultAction,
) -> String {
    let t = format!("inet {table}");
    let chain = vm_chain(tap);
    let mut s = String::new();
    let _ = writeln!(s, "add chain {t} {chain}");
    let _ = writeln!(s, "flush chain {t} {chain}");
    let mut rule = |body: &str| {
        let _ = writeln!(s, "add rule {t} {chain} {body}");
    };
    rule("meta nfproto != ipv4 drop");
    rule(&format!("ip saddr != {address} drop"));
    rule("ct state invalid drop");
    rule("ct state established,related accept");
    for entry in allow {
        rule(&format!("{} accept", entry_match(entry)));
    }
    for entry in drop {
        rule(&format!("{} drop", entry_match(entry)));
    }
    rule(verdict(default));
    let _ = writeln!(s, "add element {t} iso_ifs {{ \"{tap}\" }}");
    let _ = writeln!(s, "add element {t} nat_ifs {{ \"{tap}\" }}");
    let _ = writeln!(s, "add element {t} iso_fwd {{ \"{tap}\" : jump {chain} }}");
    s
}

/// Removes whatever an isolated TAP has in the table. Each object is added
/// before it is deleted, so the script succeeds whether or not it was there
/// (nft 1.0.6 has no `destroy`).
pub(crate) fn remove_isolated(table: &str, tap: &str) -> String {
    let t = format!("inet {table}");
    let chain = vm_chain(tap);
    format!(
        "add chain {t} {chain}
add element {t} iso_ifs {{ \"{tap}\" }}
add element {t} nat_ifs {{ \"{tap}\" }}
add element {t} iso_fwd {{ \"{tap}\" : jump {chain} }}
delete element {t} iso_fwd {{ \"{tap}\" }}
delete element {t} iso_ifs {{ \"{tap}\" }}
delete element {t} nat_ifs {{ \"{tap}\" }}
flush chain {t} {chain}
delete chain {t} {chain}
"
    )
}

/// Masquerades what comes out of a bridge.
pub(crate) fn add_bridge(table: &str, bridge: &str) -> String {
    format!("add element inet {table} nat_ifs {{ \"{bridge}\" }}\n")
}

/// Removes a bridge's element, whether or not it is there.
pub(crate) fn remove_bridge(table: &str, bridge: &str) -> String {
    let t = format!("inet {table}");
    format!(
        "add element {t} nat_ifs {{ \"{bridge}\" }}
delete element {t} nat_ifs {{ \"{bridge}\" }}
"
    )
}

/// Deletes the whole table, whether or not it is there.
pub(crate) fn delete_table(table: &str) -> String {
    format!("add table inet {table}\ndelete table inet {table}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(list: &[&str]) -> Vec<PolicyEntry> {
        list.iter().map(|e| e.parse().expect("entry")).collect()
    }

    fn policy_lines(allow: &[&str], drop: &[&str]) -> Vec<String> {
        let allow_s: Vec<String> = allow.iter().map(|s| s.to_string()).collect();
        let drop_s: Vec<String> = drop.iter().map(|s| s.to_string()).collect();
        let text = add_isolated(
            "tine",
            "tt-web-1",
            "169.254.40.2".parse().expect("ip"),
            &entries(allow),
            &entries(drop),
            DefaultAction::for_lists(&allow_s, &drop_s),
        );
        text.lines()
            .filter_map(|l| l.strip_prefix("add rule inet tine vm-tt-web-1 "))
            .skip(4) // anti-spoof, invalid, replies: checked below
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn isolated_chain_layout() {
        let text = add_isolated(
            "tine",
            "tt-web-1",
            "169.254.40.2".parse().expect("ip"),
            &[],
            &[],
            DefaultAction::Allow,
        );
        assert_eq!(
            text,
            "add chain inet tine vm-tt-web-1
flush chain inet tine vm-tt-web-1
add rule inet tine vm-tt-web-1 meta nfproto != ipv4 drop
add rule inet tine vm-tt-web-1 ip saddr != 169.254.40.2 drop
add rule inet tine vm-tt-web-1 ct state invalid drop
add rule inet tine vm-tt-web-1 ct state established,related accept
add rule inet tine vm-tt-web-1 accept
add element inet tine iso_ifs { \"tt-web-1\" }
add element inet tine nat_ifs { \"tt-web-1\" }
add element inet tine iso_fwd { \"tt-web-1\" : jump vm-tt-web-1 }
"
        );
    }

    #[test]
    fn drop_only_allows_the_rest() {
        assert_eq!(
            policy_lines(&[], &["10.0.0.0/8", "1.2.3.4:53"]),
            [
                "ip daddr 10.0.0.0/8 drop",
                "ip daddr 1.2.3.4/32 meta l4proto { tcp, udp } th dport 53 drop",
                "accept",
            ]
        );
    }

    #[test]
    fn allow_only_denies_the_rest() {
        assert_eq!(
            policy_lines(&["169.254.50.0/24", "1.1.1.1:443"], &[]),
            [
                "ip daddr 169.254.50.0/24 accept",
                "ip daddr 1.1.1.1/32 meta l4proto { tcp, udp } th dport 443 accept",
                "drop",
            ]
        );
    }

    #[test]
    fn both_lists_allow_first_then_drop_then_allow_the_rest() {
        assert_eq!(
            policy_lines(&["10.1.0.0/16"], &["10.0.0.0/8"]),
            [
                "ip daddr 10.1.0.0/16 accept",
                "ip daddr 10.0.0.0/8 drop",
                "accept",
            ]
        );
    }

    #[test]
    fn closed_vm_drops_everything() {
        assert_eq!(
            policy_lines(&[], &["0.0.0.0/0"]),
            ["ip daddr 0.0.0.0/0 drop", "accept"]
        );
        assert_eq!(policy_lines(&[], &[]), ["accept"]);
    }

    #[test]
    fn base_never_flushes_the_table_or_other_tables() {
        let text = base("tine");
        assert!(!text.contains("flush table"));
        assert!(!text.contains("flush ruleset"));
        assert!(!text.contains("delete"));
        for line in text.lines() {
            assert!(line.contains(" inet tine"), "{line}");
        }
        assert!(text.contains("add rule inet tine input iifname @iso_ifs drop"));
        assert!(text.contains("add rule inet tine forward iifname @iso_ifs oifname @nat_ifs drop"));
        assert!(text.contains("iifname @nat_ifs oifname != @nat_ifs masquerade"));
    }

    #[test]
    fn removal_is_add_then_delete() {
        let text = remove_isolated("tine", "tt-a");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.first(), Some(&"add chain inet tine vm-tt-a"));
        assert_eq!(lines.last(), Some(&"delete chain inet tine vm-tt-a"));
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.starts_with("delete element"))
                .count(),
            3
        );
        assert_eq!(
            remove_bridge("tine", "tbr-g"),
            "add element inet tine nat_ifs { \"tbr-g\" }\ndelete element inet tine nat_ifs { \"tbr-g\" }\n"
        );
        assert_eq!(
            add_bridge("t", "b"),
            "add element inet t nat_ifs { \"b\" }\n"
        );
        assert_eq!(delete_table("t"), "add table inet t\ndelete table inet t\n");
    }
}
