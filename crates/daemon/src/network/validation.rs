//! Checks of a group's `network:` block, alone and across groups, and
//! parsing of its `allow` / `drop` lists.

use std::collections::HashMap;

use ipnet::Ipv4Net;

use super::addr;
use super::config::{NetMode, NetworkConfig, PolicyEntry};
use super::error::NetworkError;
use super::names;

/// Parses every entry of an `allow` (`list = "allow"`) or `drop` list.
pub(crate) fn parse_entries(
    list: &'static str,
    entries: &[String],
) -> Result<Vec<PolicyEntry>, NetworkError> {
    entries
        .iter()
        .map(|entry| {
            entry
                .parse()
                .map_err(|reason| NetworkError::BadPolicyEntry {
                    list,
                    entry: entry.clone(),
                    reason,
                })
        })
        .collect()
}

/// Checks a group's network block: CIDR size and host bits, bridge name,
/// allow/drop entries, and that no field is set that the mode ignores.
pub fn validate(group: &str, cfg: &NetworkConfig) -> Result<(), NetworkError> {
    if group.is_empty() {
        return Err(NetworkError::EmptyGroup);
    }
    let not_for = |field| NetworkError::FieldNotForMode {
        group: group.to_owned(),
        field,
        mode: cfg.mode,
    };
    match cfg.mode {
        NetMode::None => {
            if cfg.cidr.is_some() {
                return Err(not_for("cidr"));
            }
            if cfg.bridge.is_some() {
                return Err(not_for("bridge"));
            }
            if !cfg.allow.is_empty() {
                return Err(not_for("allow"));
            }
            if !cfg.drop.is_empty() {
                return Err(not_for("drop"));
            }
            if !cfg.dns.is_empty() {
                return Err(not_for("dns"));
            }
            return Ok(());
        }
        NetMode::Bridge => {
            if cfg.cidr.is_none() {
                return Err(NetworkError::CidrRequired {
                    group: group.to_owned(),
                });
            }
            if !cfg.allow.is_empty() {
                return Err(not_for("allow"));
            }
            if !cfg.drop.is_empty() {
                return Err(not_for("drop"));
            }
            if let Some(bridge) = &cfg.bridge {
                names::check_ifname(bridge)?;
            }
        }
        NetMode::Isolated => {
            if cfg.bridge.is_some() {
                return Err(not_for("bridge"));
            }
            parse_entries("allow", &cfg.allow)?;
            parse_entries("drop", &cfg.drop)?;
        }
    }
    if let Some(cidr) = cfg.cidr {
        if cidr.addr() != cidr.network() {
            return Err(NetworkError::CidrHostBits {
                group: group.to_owned(),
                cidr,
            });
        }
        if cidr.prefix_len() > 30 {
            return Err(NetworkError::CidrTooSmall {
                group: group.to_owned(),
                cidr,
            });
        }
    }
    Ok(())
}

/// Validates every group, then checks what only shows across groups:
/// overlapping address ranges (including derived isolated /22s that happen
/// to collide) and bridges used by two groups (derived names with the
/// default prefix).
pub fn validate_groups<'a>(
    groups: impl IntoIterator<Item = (&'a str, &'a NetworkConfig)>,
) -> Result<(), NetworkError> {
    let mut ranges: Vec<(&str, Ipv4Net)> = Vec::new();
    let mut bridges: HashMap<String, &str> = HashMap::new();
    for (group, cfg) in groups {
        validate(group, cfg)?;
        let Some(range) = addr::group_range(group, cfg) else {
            continue;
        };
        for (other, other_range) in &ranges {
            if range.contains(other_range) || other_range.contains(&range) {
                return Err(NetworkError::OverlappingGroups {
                    a: (*other).to_owned(),
                    cidr_a: *other_range,
                    b: group.to_owned(),
                    cidr_b: range,
                });
            }
        }
        ranges.push((group, range));
        if cfg.mode == NetMode::Bridge {
            let bridge = names::bridge_name(names::DEFAULT_BRIDGE_PREFIX, group, cfg);
            if let Some(other) = bridges.insert(bridge.clone(), group) {
                return Err(NetworkError::SharedBridge {
                    a: other.to_owned(),
                    b: group.to_owned(),
                    bridge,
                });
            }
        }
    }
    Ok(())
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
    fn parses_a_full_block() {
        let cfg = parse(
            r#"{"mode":"isolated","range":"169.254.40.0/22","allow":["0.0.0.0/0"],
                "drop":["10.0.0.0/8"],"dns":["1.1.1.1"]}"#,
        )
        .expect("parse");
        assert_eq!(cfg.mode, NetMode::Isolated);
        assert_eq!(cfg.cidr, Some(net("169.254.40.0/22")));
        assert_eq!(cfg.allow, ["0.0.0.0/0"]);
        validate("g", &cfg).expect("valid");
        let back: NetworkConfig =
            serde_json::from_str(&serde_json::to_string(&cfg).expect("ser")).expect("de");
        assert_eq!(back, cfg);
    }

    #[test]
    fn default_is_none() {
        let cfg = parse("{}").expect("parse");
        assert_eq!(cfg.mode, NetMode::None);
        validate("g", &cfg).expect("valid");
    }

    #[test]
    fn validation_errors_name_the_problem() {
        let bridge = |cidr: &str| NetworkConfig {
            mode: NetMode::Bridge,
            cidr: Some(net(cidr)),
            ..Default::default()
        };
        let err = |group: &str, cfg: &NetworkConfig| {
            validate(group, cfg).expect_err("invalid").to_string()
        };

        assert_eq!(
            err("", &bridge("169.254.1.0/24")),
            "host group name is empty"
        );
        let e = err("g", &bridge("169.254.1.5/24"));
        assert!(
            e.contains("has host bits set; did you mean 169.254.1.0/24"),
            "{e}"
        );
        let e = err("g", &bridge("169.254.1.0/31"));
        assert!(e.contains("too small"), "{e}");
        validate("g", &bridge("169.254.1.0/30")).expect("a /30 holds one VM");

        let e = err(
            "g",
            &NetworkConfig {
                mode: NetMode::Bridge,
                ..Default::default()
            },
        );
        assert!(e.contains("bridge mode needs a `cidr`"), "{e}");

        let mut cfg = bridge("169.254.1.0/24");
        cfg.bridge = Some("a-very-long-bridge-name".into());
        let e = err("g", &cfg);
        assert!(e.contains("longer than 15 bytes"), "{e}");
        cfg.bridge = Some("br 0".into());
        let e = err("g", &cfg);
        assert!(e.contains("only letters, digits"), "{e}");

        let mut cfg = bridge("169.254.1.0/24");
        cfg.allow = vec!["1.2.3.4".into()];
        let e = err("g", &cfg);
        assert!(
            e.contains("`allow` is not used in network mode bridge"),
            "{e}"
        );

        let cfg = NetworkConfig {
            cidr: Some(net("169.254.1.0/24")),
            ..Default::default()
        };
        let e = err("g", &cfg);
        assert!(e.contains("`cidr` is not used in network mode none"), "{e}");

        let cfg = NetworkConfig {
            mode: NetMode::Isolated,
            bridge: Some("br0".into()),
            ..Default::default()
        };
        let e = err("g", &cfg);
        assert!(
            e.contains("`bridge` is not used in network mode isolated"),
            "{e}"
        );

        let cfg = NetworkConfig {
            mode: NetMode::Isolated,
            drop: vec!["10.0.0.0/8".into(), "1.2.3.4:http".into()],
            ..Default::default()
        };
        let e = err("g", &cfg);
        assert_eq!(
            e,
            "bad drop entry \"1.2.3.4:http\": port \"http\" is not a number from 1 to 65535"
        );
    }

    #[test]
    fn groups_may_not_overlap_or_share_a_bridge() {
        let bridge = |cidr: &str| NetworkConfig {
            mode: NetMode::Bridge,
            cidr: Some(net(cidr)),
            ..Default::default()
        };
        let a = bridge("169.254.10.0/24");
        let b = bridge("169.254.10.128/25");
        let e = validate_groups([("a", &a), ("b", &b)]).expect_err("overlap");
        assert!(e.to_string().contains("overlapping"), "{e}");

        let c = bridge("169.254.11.0/24");
        validate_groups([("a", &a), ("c", &c)]).expect("disjoint");

        let mut d = bridge("169.254.12.0/24");
        d.bridge = Some("tbr-a".into());
        let e = validate_groups([("a", &a), ("d", &d)]).expect_err("shared bridge");
        assert!(e.to_string().contains("both use bridge \"tbr-a\""), "{e}");

        let none = NetworkConfig::default();
        validate_groups([("a", &a), ("n", &none), ("m", &none)]).expect("none has no range");
    }
}
