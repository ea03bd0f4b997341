//! Interface names and MAC addresses, derived deterministically from host
//! group names and VM hostnames so that a restarted daemon finds them again.

use super::config::NetworkConfig;
use super::error::NetworkError;

/// Longest Linux interface name (`IFNAMSIZ - 1`).
pub const IFNAME_MAX: usize = 15;
/// Default prefix of the TAPs the manager creates.
pub const DEFAULT_TAP_PREFIX: &str = "tt-";
/// Default prefix of the bridges the manager creates.
pub const DEFAULT_BRIDGE_PREFIX: &str = "tbr-";
/// Longest TAP or bridge prefix: leaves room for a readable part and a hash.
pub const PREFIX_MAX: usize = 5;
/// Hex digits of the hash in a shortened name.
const HASH_DIGITS: usize = 8;

/// FNV-1a, 64 bits: stable across Rust releases and platforms, unlike
/// `DefaultHasher`, so derived names and ranges never change.
pub(crate) fn fnv1a64(data: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// Characters kept as they are in derived names. They are also the only
/// ones that appear in nft chain names, so no quoting is needed there.
fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// Checks an interface name we create or were given: 1 to 15 bytes of
/// letters, digits, `-`, `_` and `.`, not `.` or `..`.
pub fn check_ifname(name: &str) -> Result<(), NetworkError> {
    let bad = |reason| {
        Err(NetworkError::BadInterfaceName {
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > IFNAME_MAX {
        return bad("longer than 15 bytes");
    }
    if name == "." || name == ".." {
        return bad("reserved name");
    }
    if !name.chars().all(|c| name_char(c) || c == '.') {
        return bad("only letters, digits, '-', '_' and '.' are allowed");
    }
    Ok(())
}

/// Checks a TAP or bridge prefix.
pub(crate) fn check_prefix(option: &'static str, prefix: &str) -> Result<(), NetworkError> {
    let bad = |reason| {
        Err(NetworkError::BadOption {
            option,
            value: prefix.to_owned(),
            reason,
        })
    };
    if prefix.is_empty() || prefix.len() > PREFIX_MAX {
        return bad("must be 1 to 5 bytes");
    }
    if !prefix.starts_with(|c: char| c.is_ascii_alphabetic()) || !prefix.chars().all(name_char) {
        return bad("must start with a letter and hold only letters, digits, '-' and '_'");
    }
    Ok(())
}

/// `prefix` + `text` when that fits in 15 bytes and `text` has only name
/// characters; otherwise `prefix` + the start of `text` + `-` + 8 hex digits
/// of its hash. The prefix must pass [`check_prefix`].
fn derive_name(prefix: &str, text: &str) -> String {
    let room = IFNAME_MAX - prefix.len();
    if !text.is_empty() && text.len() <= room && text.chars().all(name_char) {
        return format!("{prefix}{text}");
    }
    let keep: String = text
        .chars()
        .map(|c| if name_char(c) { c } else { '-' })
        .take(room - HASH_DIGITS - 1)
        .collect();
    let hash = fnv1a64(text.as_bytes()) & 0xffff_ffff;
    format!("{prefix}{keep}-{hash:08x}")
}

/// Checks a hostname before a name is derived from it: 1 to 253 bytes, no
/// whitespace or control characters.
pub(crate) fn check_hostname(hostname: &str) -> Result<(), NetworkError> {
    let bad = |reason| {
        Err(NetworkError::BadHostname {
            hostname: hostname.to_owned(),
            reason,
        })
    };
    if hostname.is_empty() {
        return bad("empty");
    }
    if hostname.len() > 253 {
        return bad("longer than 253 bytes");
    }
    if hostname
        .chars()
        .any(|c| c.is_whitespace() || c.is_control())
    {
        return bad("contains whitespace or control characters");
    }
    Ok(())
}

/// The TAP name of a VM: `tt-<hostname>`, or `tt-<start>-<hash>` when the
/// hostname is long or has other characters.
pub(crate) fn tap_name(prefix: &str, hostname: &str) -> String {
    derive_name(prefix, hostname)
}

/// The bridge of a bridge-mode group: the configured one, or
/// `tbr-<group>` (shortened with a hash when too long).
pub(crate) fn bridge_name(prefix: &str, group: &str, cfg: &NetworkConfig) -> String {
    match &cfg.bridge {
        Some(bridge) => bridge.clone(),
        None => derive_name(prefix, group),
    }
}

/// Six bytes from `salt` and `seed`, made locally administered and
/// unicast.
fn local_mac_bytes(seed: &str, salt: &[u8]) -> [u8; 6] {
    let mut data = salt.to_vec();
    data.extend_from_slice(seed.as_bytes());
    let b = fnv1a64(&data).to_be_bytes();
    [(b[0] & 0xfe) | 0x02, b[1], b[2], b[3], b[4], b[5]]
}

fn format_mac(b: [u8; 6]) -> String {
    format!(
        "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5]
    )
}

/// The guest MAC of a VM, derived from its hostname: locally administered,
/// unicast, the same after a daemon restart.
pub fn vm_mac(hostname: &str) -> String {
    format_mac(local_mac_bytes(hostname, b"tine-vm:"))
}

/// A fixed MAC for a bridge, so that it does not change as ports come and
/// go (Linux otherwise takes the lowest port MAC).
pub(crate) fn bridge_mac(bridge: &str) -> [u8; 6] {
    local_mac_bytes(bridge, b"tine-bridge:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_hostnames_stay_readable() {
        assert_eq!(tap_name("tt-", "web-1"), "tt-web-1");
        assert_eq!(tap_name("tt-", "abcdefghijkl"), "tt-abcdefghijkl");
        assert_eq!(
            bridge_name("tbr-", "runners", &NetworkConfig::default()),
            "tbr-runners"
        );
    }

    #[test]
    fn long_or_odd_names_are_shortened_with_a_hash() {
        let long = tap_name("tt-", "sandbox-agents-17");
        assert_eq!(long.len(), 15, "{long}");
        assert!(long.starts_with("tt-san-"), "{long}");
        assert_eq!(long, tap_name("tt-", "sandbox-agents-17"), "deterministic");
        assert_ne!(long, tap_name("tt-", "sandbox-agents-18"));

        let dotted = tap_name("tt-", "a.b");
        assert!(dotted.starts_with("tt-a-b-"), "{dotted}");
        check_ifname(&dotted).expect("valid");

        let bridge = bridge_name("tbr-", "a-very-long-group", &NetworkConfig::default());
        assert_eq!(bridge.len(), 15, "{bridge}");
        assert!(bridge.starts_with("tbr-aa-") || bridge.starts_with("tbr-a-"));
        check_ifname(&bridge).expect("valid");

        for prefix in ["t", "tt-", "xy-1-"] {
            for host in [
                "x",
                "web-1",
                "a.very.long.hostname.example.com",
                "ünïcödé-host-12",
            ] {
                let name = tap_name(prefix, host);
                assert!(name.len() <= IFNAME_MAX, "{name}");
                assert!(name.starts_with(prefix));
                check_ifname(&name).expect("derived names are valid");
            }
        }
    }

    #[test]
    fn configured_bridge_is_used_as_is() {
        let cfg = NetworkConfig {
            bridge: Some("br-lab".into()),
            ..Default::default()
        };
        assert_eq!(bridge_name("tbr-", "g", &cfg), "br-lab");
    }

    #[test]
    fn interface_name_limits() {
        check_ifname("abcdefghijklmno").expect("15 bytes");
        assert!(check_ifname("abcdefghijklmnop").is_err());
        assert!(check_ifname("").is_err());
        assert!(check_ifname("..").is_err());
        assert!(check_ifname("a/b").is_err());
        assert!(check_ifname("a b").is_err());
        check_prefix("tap_prefix", "tt-").expect("default");
        assert!(check_prefix("tap_prefix", "toolong").is_err());
        assert!(check_prefix("tap_prefix", "-x").is_err());
        assert!(check_prefix("tap_prefix", "").is_err());
    }

    #[test]
    fn hostnames_are_checked() {
        check_hostname("web-1").expect("ok");
        assert!(check_hostname("").is_err());
        assert!(check_hostname("a b").is_err());
        assert!(check_hostname("a\nb").is_err());
        assert!(check_hostname(&"a".repeat(254)).is_err());
    }

    #[test]
    fn macs_are_local_unicast_and_stable() {
        let mac = vm_mac("web-1");
        assert_eq!(mac, vm_mac("web-1"));
        assert_ne!(mac, vm_mac("web-2"));
        let bytes: Vec<u8> = mac
            .split(':')
            .map(|b| u8::from_str_radix(b, 16).expect("hex"))
            .collect();
        assert_eq!(bytes.len(), 6);
        assert_eq!(mac.len(), 17);
        assert_eq!(bytes[0] & 0x01, 0, "unicast");
        assert_eq!(bytes[0] & 0x02, 0x02, "locally administered");
        assert_eq!(mac, mac.to_lowercase());
        assert_ne!(format_mac(bridge_mac("tbr-x")), vm_mac("tbr-x"));
        assert_eq!(bridge_mac("tbr-x")[0] & 0x03, 0x02, "local unicast bridge");
    }

    #[test]
    fn fnv_is_the_reference_function() {
        // Reference values of FNV-1a 64.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
