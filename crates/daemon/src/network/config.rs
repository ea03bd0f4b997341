//! The `network:` block of a host group and egress policy entries
//! (`allow` / `drop`): plain data, parsed but not checked across fields
//! (the `validation` module does that). Imports nothing from its siblings.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;

use ipnet::Ipv4Net;
use serde::{Deserialize, Deserializer, Serialize};

/// How the VMs of a host group are networked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetMode {
    /// No network interface at all (the default).
    #[default]
    None,
    /// One Linux bridge per group; the host is the gateway and NATs the
    /// group's CIDR; VMs reach each other and the host.
    Bridge,
    /// One TAP and one /30 per VM; a VM reaches only what its allow/drop
    /// policy lets through, never another VM or the host's services.
    Isolated,
}

impl fmt::Display for NetMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NetMode::None => "none",
            NetMode::Bridge => "bridge",
            NetMode::Isolated => "isolated",
        })
    }
}

/// A host group's `network:` block in `tine.yaml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    /// `none`, `bridge` or `isolated`.
    #[serde(default)]
    pub mode: NetMode,
    /// Bridge mode: the group's network (required; the host takes the first
    /// address). Isolated mode: the range the per-VM /30s are carved from
    /// (default: a /22 in 169.254.0.0/16 derived from the group name).
    /// `range` is accepted as another name for it.
    #[serde(
        default,
        alias = "range",
        deserialize_with = "deserialize_cidr",
        skip_serializing_if = "Option::is_none"
    )]
    pub cidr: Option<Ipv4Net>,
    /// Bridge mode: the bridge's name (default `tbr-<group>`, shortened with
    /// a hash when too long). At most 15 bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// Isolated mode: destinations a VM may reach (`CIDR`, `IP`, `IP:port`
    /// or `CIDR:port`; a port covers TCP and UDP).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// Isolated mode: destinations a VM may not reach (same forms).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drop: Vec<String>,
    /// Name servers handed to the guest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<IpAddr>,
}

fn deserialize_cidr<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Ipv4Net>, D::Error> {
    let Some(text) = Option::<String>::deserialize(d)? else {
        return Ok(None);
    };
    parse_cidr(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// Parses `a.b.c.d/len` with a message that names the problem.
fn parse_cidr(text: &str) -> Result<Ipv4Net, String> {
    let text = text.trim();
    let Some((ip, len)) = text.split_once('/') else {
        return Err(format!(
            "invalid cidr {text:?}: missing the /prefix length (e.g. 169.254.100.0/24)"
        ));
    };
    let ip = Ipv4Addr::from_str(ip)
        .map_err(|_| format!("invalid cidr {text:?}: {ip:?} is not an IPv4 address"))?;
    let len: u8 = len
        .parse()
        .ok()
        .filter(|len| *len <= 32)
        .ok_or_else(|| format!("invalid cidr {text:?}: prefix length must be 0 to 32"))?;
    Ipv4Net::new(ip, len).map_err(|e| format!("invalid cidr {text:?}: {e}"))
}

/// Overrides of a group's `allow` / `drop` lists for one VM (at create or
/// fork). A list left out is inherited from the group; an empty list clears
/// it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyOverride {
    /// Replaces the group's `allow` list when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<String>>,
    /// Replaces the group's `drop` list when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop: Option<Vec<String>>,
}

impl PolicyOverride {
    /// Whether the override changes anything.
    pub fn is_empty(&self) -> bool {
        self.allow.is_none() && self.drop.is_none()
    }
}

/// One `allow` / `drop` entry: a destination network and optionally a port
/// (matched for TCP and UDP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PolicyEntry {
    /// Destination network (`/32` for a single address).
    pub net: Ipv4Net,
    /// Destination port, TCP and UDP; `None` matches every protocol.
    pub port: Option<u16>,
}

impl FromStr for PolicyEntry {
    type Err = String;

    /// Parses `CIDR`, `IP`, `IP:port` or `CIDR:port`; the error says what is
    /// wrong.
    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("empty entry".to_owned());
        }
        if text.matches(':').count() > 1 || text.contains('[') {
            return Err("IPv6 is not supported: VM networks are IPv4 only".to_owned());
        }
        let (dest, port) = match text.split_once(':') {
            Some((dest, port)) => {
                let port = port
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| format!("port {port:?} is not a number from 1 to 65535"))?;
                (dest, Some(port))
            }
            None => (text, None),
        };
        let net = if dest.contains('/') {
            let net = parse_cidr(dest)?;
            if net.addr() != net.network() {
                return Err(format!(
                    "{net} has host bits set; did you mean {}?",
                    net.trunc()
                ));
            }
            net
        } else {
            let ip = Ipv4Addr::from_str(dest).map_err(|_| {
                format!("{dest:?} is not an IPv4 address or CIDR (expected e.g. 10.0.0.0/8, 1.2.3.4 or 1.2.3.4:443)")
            })?;
            Ipv4Net::from(ip)
        };
        Ok(Self { net, port })
    }
}

impl fmt::Display for PolicyEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.net.prefix_len() == 32 {
            write!(f, "{}", self.net.addr())?;
        } else {
            write!(f, "{}", self.net)?;
        }
        if let Some(port) = self.port {
            write!(f, ":{port}")?;
        }
        Ok(())
    }
}

/// Where a VM's allow/drop lists come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicySource {
    /// The host group's `network:` block.
    #[default]
    HostGroup,
    /// A per-VM override given at create or fork.
    Override,
}

/// What happens to traffic that no allow/drop entry matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DefaultAction {
    /// Let it through (no allow list, or both lists given).
    Allow,
    /// Drop it (only an allow list given).
    Deny,
}

impl DefaultAction {
    /// The precedence rule: allow-only lists deny the rest; drop-only, both
    /// or neither allow the rest.
    pub fn for_lists(allow: &[String], drop: &[String]) -> Self {
        if !allow.is_empty() && drop.is_empty() {
            DefaultAction::Deny
        } else {
            DefaultAction::Allow
        }
    }
}

/// One allow/drop policy and its default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Entries let through first.
    pub allow: Vec<String>,
    /// Entries dropped next.
    pub drop: Vec<String>,
    /// What happens to the rest.
    pub default: DefaultAction,
}

impl Policy {
    /// Builds a policy and derives its default from the lists.
    pub fn new(allow: Vec<String>, drop: Vec<String>) -> Self {
        let default = DefaultAction::for_lists(&allow, &drop);
        Self {
            allow,
            drop,
            default,
        }
    }
}

/// A VM's network policy as `describe` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyReport {
    /// The VM's mode.
    pub mode: NetMode,
    /// Whether the effective lists come from the group or an override.
    pub policy_source: PolicySource,
    /// The host group's lists.
    pub host_group: Policy,
    /// The override given for this VM, if any (fields left out inherit).
    #[serde(rename = "override", skip_serializing_if = "Option::is_none")]
    pub overrides: Option<PolicyOverride>,
    /// The lists in force.
    pub effective: Policy,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("test cidr")
    }

    fn parse(json: &str) -> Result<NetworkConfig, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn syntax_errors_name_the_problem() {
        let err = parse(r#"{"mode":"bridge","cidr":"169.254.1.0"}"#).expect_err("no prefix");
        assert!(err.contains("missing the /prefix length"), "{err}");
        let err = parse(r#"{"mode":"bridge","cidr":"169.254.1.0/33"}"#).expect_err("prefix");
        assert!(err.contains("prefix length must be 0 to 32"), "{err}");
        let err = parse(r#"{"mode":"bridge","cidr":"169.254.300.0/24"}"#).expect_err("addr");
        assert!(err.contains("not an IPv4 address"), "{err}");
        let err = parse(r#"{"mode":"macvtap"}"#).expect_err("mode");
        assert!(err.contains("unknown variant `macvtap`"), "{err}");
        let err = parse(r#"{"mode":"bridge","gateway":"1.2.3.4"}"#).expect_err("field");
        assert!(err.contains("unknown field `gateway`"), "{err}");
        let err = parse(r#"{"dns":["one.one.one.one"]}"#).expect_err("dns");
        assert!(err.contains("invalid IP address syntax"), "{err}");
    }

    #[test]
    fn policy_entries() {
        let ok = |s: &str| s.parse::<PolicyEntry>().expect(s);
        let bad = |s: &str| s.parse::<PolicyEntry>().expect_err(s);
        assert_eq!(
            ok("10.0.0.0/8"),
            PolicyEntry {
                net: net("10.0.0.0/8"),
                port: None
            }
        );
        assert_eq!(
            ok(" 1.2.3.4:443 "),
            PolicyEntry {
                net: net("1.2.3.4/32"),
                port: Some(443)
            }
        );
        assert_eq!(ok("1.2.3.0/24:53").port, Some(53));
        assert_eq!(ok("0.0.0.0/0").net, net("0.0.0.0/0"));
        for s in ["10.0.0.0/8", "1.2.3.4", "1.2.3.4:443", "1.2.3.0/24:53"] {
            assert_eq!(ok(s).to_string(), s);
        }
        assert_eq!(bad(""), "empty entry");
        assert!(bad("::1").contains("IPv6"));
        assert!(bad("[::1]:80").contains("IPv6"));
        assert!(bad("1.2.3.4:0").contains("not a number from 1 to 65535"));
        assert!(bad("1.2.3.4:70000").contains("not a number from 1 to 65535"));
        assert!(bad("10.1.0.0/8").contains("did you mean 10.0.0.0/8"));
        assert!(bad("example.com").contains("not an IPv4 address or CIDR"));
        assert!(bad("10.0.0.0/40").contains("prefix length"));
    }

    #[test]
    fn default_action_follows_precedence() {
        let v = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(DefaultAction::for_lists(&[], &[]), DefaultAction::Allow);
        assert_eq!(
            DefaultAction::for_lists(&v(&["1.1.1.1"]), &[]),
            DefaultAction::Deny
        );
        assert_eq!(
            DefaultAction::for_lists(&[], &v(&["1.1.1.1"])),
            DefaultAction::Allow
        );
        assert_eq!(
            DefaultAction::for_lists(&v(&["1.1.1.1"]), &v(&["0.0.0.0/0"])),
            DefaultAction::Allow
        );
    }
}
