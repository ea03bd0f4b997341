//! The kernel command line options the agent reads at boot.
//!
//! - `tine.hostname=NAME`
//! - `tine.ip=ADDR/PREFIX`, `tine.gw=GW`, `tine.dns=DNS[,DNS...]`,
//!   `tine.iface=NAME` (default `eth0`)
//! - the kernel's own `ip=CLIENT:SERVER:GW:NETMASK:HOSTNAME:DEVICE:AUTOCONF:DNS0:DNS1`
//!   (static form only; the kernel in tine has no `CONFIG_IP_PNP`, so the
//!   agent applies it). `tine.*` values override the `ip=` ones.
//!
//! Invalid values never stop a boot: they are dropped with a warning.

use std::net::{IpAddr, Ipv4Addr};

use super::hostname::valid_hostname;
use super::net::NetConfig;

/// The interface configured when none is named.
pub const DEFAULT_IFACE: &str = "eth0";

/// What the agent takes from the kernel command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelCmdline {
    /// `tine.hostname=`, or else the hostname field of `ip=`.
    pub hostname: Option<String>,
    /// The static network configuration, when an address was given.
    pub net: Option<NetConfig>,
    /// Options that were present but unusable, one line each.
    pub warnings: Vec<String>,
}

impl KernelCmdline {
    /// Reads `/proc/cmdline`.
    pub fn read() -> std::io::Result<Self> {
        Ok(Self::parse(&std::fs::read_to_string("/proc/cmdline")?))
    }

    /// Parses a command line (space separated, double quotes group words).
    pub fn parse(line: &str) -> Self {
        let mut out = KernelCmdline::default();
        let mut ip_addr: Option<(Ipv4Addr, u8)> = None;
        let mut gw: Option<Ipv4Addr> = None;
        let mut dns: Vec<IpAddr> = Vec::new();
        let mut iface: Option<String> = None;
        let mut ip_hostname: Option<String> = None;
        // tine.* values, applied over ip= at the end.
        let mut t_addr = None;
        let mut t_gw = None;
        let mut t_dns = None;
        let mut t_iface = None;

        for word in split_words(line) {
            let Some((key, value)) = word.split_once('=') else {
                continue;
            };
            match key {
                "tine.hostname" => {
                    if valid_hostname(value) {
                        out.hostname = Some(value.to_string());
                    } else {
                        out.warn(format!("ignoring invalid tine.hostname={value:?}"));
                    }
                }
                "tine.ip" => match parse_cidr(value) {
                    Some(a) => t_addr = Some(a),
                    None => out.warn(format!(
                        "ignoring tine.ip={value:?}: expected IPv4ADDR/PREFIX"
                    )),
                },
                "tine.gw" => match value.parse::<Ipv4Addr>() {
                    Ok(g) => t_gw = Some(g),
                    Err(_) => out.warn(format!("ignoring tine.gw={value:?}: not an IPv4 address")),
                },
                "tine.dns" => {
                    let mut list = Vec::new();
                    for part in value.split(',').filter(|p| !p.is_empty()) {
                        match part.parse::<IpAddr>() {
                            Ok(a) => list.push(a),
                            Err(_) => out.warn(format!("ignoring DNS server {part:?} in tine.dns")),
                        }
                    }
                    t_dns = Some(list);
                }
                "tine.iface" => {
                    if valid_iface(value) {
                        t_iface = Some(value.to_string());
                    } else {
                        out.warn(format!("ignoring invalid tine.iface={value:?}"));
                    }
                }
                "ip" => match parse_kernel_ip(value) {
                    Ok(Some(k)) => {
                        ip_addr = Some((k.addr, k.prefix));
                        gw = k.gw;
                        dns = k.dns;
                        iface = k.iface;
                        ip_hostname = k.hostname;
                    }
                    Ok(None) => {}
                    Err(e) => out.warn(format!("ignoring ip={value:?}: {e}")),
                },
                _ => {}
            }
        }

        if out.hostname.is_none() {
            out.hostname = ip_hostname;
        }
        let addr = t_addr.or(ip_addr);
        let gw = t_gw.or(gw);
        let dns = t_dns.unwrap_or(dns);
        let iface = t_iface
            .or(iface)
            .unwrap_or_else(|| DEFAULT_IFACE.to_string());
        match addr {
            Some((addr, prefix)) => {
                out.net = Some(NetConfig {
                    iface,
                    addr,
                    prefix,
                    gateway: gw,
                    dns,
                    mac: None,
                })
            }
            None if gw.is_some() || !dns.is_empty() => out.warn(
                "tine.gw/tine.dns given without an address (tine.ip=); network left unconfigured"
                    .into(),
            ),
            None => {}
        }
        out
    }

    fn warn(&mut self, msg: String) {
        self.warnings.push(msg);
    }
}

/// Splits a command line into words; double quotes group words and are
/// removed (the kernel's `next_arg` rules).
fn split_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_quotes = false;
    let mut have_word = false;
    for c in line.chars() {
        match c {
            '"' => {
                in_quotes = !in_quotes;
                have_word = true;
            }
            c if c.is_whitespace() && !in_quotes => {
                if have_word {
                    words.push(std::mem::take(&mut cur));
                    have_word = false;
                }
            }
            c => {
                cur.push(c);
                have_word = true;
            }
        }
    }
    if have_word {
        words.push(cur);
    }
    words
}

/// `ADDR/PREFIX` with an IPv4 address and a prefix of 0..=32. A bare
/// address is refused: the prefix decides what is on-link.
fn parse_cidr(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (a, p) = s.split_once('/')?;
    let addr = a.parse().ok()?;
    let prefix: u8 = p.parse().ok()?;
    (prefix <= 32).then_some((addr, prefix))
}

/// A netmask's prefix length, or `None` when its bits are not contiguous.
fn mask_to_prefix(mask: Ipv4Addr) -> Option<u8> {
    let m = u32::from(mask);
    let ones = m.leading_ones();
    (m.checked_shl(ones).unwrap_or(0) == 0).then_some(ones as u8)
}

/// Interface names as the kernel accepts them (`dev_valid_name`).
fn valid_iface(s: &str) -> bool {
    !s.is_empty()
        && s.len() < libc::IFNAMSIZ
        && s != "."
        && s != ".."
        && !s.chars().any(|c| c == '/' || c == ':' || c.is_whitespace())
}

struct KernelIp {
    addr: Ipv4Addr,
    prefix: u8,
    gw: Option<Ipv4Addr>,
    hostname: Option<String>,
    iface: Option<String>,
    dns: Vec<IpAddr>,
}

/// The kernel's `ip=` (Documentation/admin-guide/nfs/nfsroot.rst). Returns
/// `Ok(None)` for `off`/`none`; autoconfiguration (dhcp, ...) is refused.
fn parse_kernel_ip(v: &str) -> Result<Option<KernelIp>, String> {
    match v {
        "off" | "none" => return Ok(None),
        "on" | "any" | "dhcp" | "bootp" | "rarp" | "both" | "dhcp6" | "auto6" => {
            return Err("address autoconfiguration is not supported; give a static address".into())
        }
        _ => {}
    }
    let f: Vec<&str> = v.split(':').collect();
    let field = |i: usize| f.get(i).copied().filter(|s| !s.is_empty());
    let addr: Ipv4Addr = field(0)
        .ok_or("no client address")?
        .parse()
        .map_err(|_| "client address is not IPv4")?;
    let gw = match field(2) {
        Some(g) => Some(g.parse().map_err(|_| "gateway is not IPv4")?),
        None => None,
    };
    let prefix = match field(3) {
        Some(m) => {
            let mask: Ipv4Addr = m.parse().map_err(|_| "netmask is not IPv4")?;
            mask_to_prefix(mask).ok_or("netmask is not contiguous")?
        }
        // The kernel derives a classful mask; nobody wants that.
        None => return Err("no netmask".into()),
    };
    let hostname = match field(4) {
        Some(h) if valid_hostname(h) => Some(h.to_string()),
        Some(_) => return Err("invalid hostname field".into()),
        None => None,
    };
    let iface = match field(5) {
        Some(d) if valid_iface(d) => Some(d.to_string()),
        Some(_) => return Err("invalid device field".into()),
        None => None,
    };
    match field(6) {
        None | Some("off") | Some("none") => {}
        Some(_) => {
            return Err("address autoconfiguration is not supported; use autoconf=off".into())
        }
    }
    let mut dns = Vec::new();
    for i in [7, 8] {
        if let Some(d) = field(i) {
            dns.push(d.parse().map_err(|_| "DNS server is not an IP address")?);
        }
    }
    Ok(Some(KernelIp {
        addr,
        prefix,
        gw,
        hostname,
        iface,
        dns,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> Ipv4Addr {
        s.parse().expect("test address")
    }

    #[test]
    fn test_tine_options() {
        let c = KernelCmdline::parse(
            "console=ttyS0 reboot=k tine.hostname=box-7 tine.ip=10.0.0.2/24 tine.gw=10.0.0.1 tine.dns=1.1.1.1,2606:4700::1111 root=/dev/vda rw",
        );
        assert_eq!(c.hostname.as_deref(), Some("box-7"));
        assert_eq!(
            c.net,
            Some(NetConfig {
                iface: "eth0".into(),
                addr: v4("10.0.0.2"),
                prefix: 24,
                gateway: Some(v4("10.0.0.1")),
                dns: vec![
                    "1.1.1.1".parse().expect("ip"),
                    "2606:4700::1111".parse().expect("ip")
                ],
                mac: None,
            })
        );
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn test_kernel_ip_static_form() {
        let c = KernelCmdline::parse(
            "ip=172.16.0.2::172.16.0.1:255.255.255.252:vm-a:eth1:off:8.8.8.8:8.8.4.4 quiet",
        );
        assert_eq!(c.hostname.as_deref(), Some("vm-a"));
        let n = c.net.expect("net");
        assert_eq!(n.iface, "eth1");
        assert_eq!(n.addr, v4("172.16.0.2"));
        assert_eq!(n.prefix, 30);
        assert_eq!(n.gateway, Some(v4("172.16.0.1")));
        assert_eq!(n.dns.len(), 2);
    }

    #[test]
    fn test_tine_overrides_kernel_ip() {
        let c = KernelCmdline::parse(
            "ip=172.16.0.2::172.16.0.1:255.255.0.0:from-ip tine.hostname=from-tine tine.gw=172.16.9.9",
        );
        assert_eq!(c.hostname.as_deref(), Some("from-tine"));
        let n = c.net.expect("net");
        assert_eq!(n.iface, "eth0");
        assert_eq!(n.prefix, 16);
        assert_eq!(n.gateway, Some(v4("172.16.9.9")));
    }

    #[test]
    fn test_quotes_group_words() {
        let c = KernelCmdline::parse(r#"foo="a b c" tine.hostname="q1""#);
        assert_eq!(c.hostname.as_deref(), Some("q1"));
        assert_eq!(split_words(r#"a "b c" d"#), vec!["a", "b c", "d"]);
        assert_eq!(split_words("  \n "), Vec::<String>::new());
        assert_eq!(split_words(r#""""#), vec![""]);
    }

    #[test]
    fn test_invalid_values_warn_and_do_not_configure() {
        let c = KernelCmdline::parse(
            "tine.hostname=-bad tine.ip=10.0.0.300/24 tine.dns=x,9.9.9.9 ip=dhcp tine.iface=a/b",
        );
        assert_eq!(c.hostname, None);
        assert_eq!(c.net, None);
        // hostname, ip, dns entry, ip=dhcp, iface, plus "dns without address".
        assert_eq!(c.warnings.len(), 6, "{:?}", c.warnings);
    }

    #[test]
    fn test_bad_prefix_and_mask() {
        assert_eq!(parse_cidr("10.0.0.1/33"), None);
        assert_eq!(parse_cidr("10.0.0.1"), None);
        assert_eq!(parse_cidr("10.0.0.1/0"), Some((v4("10.0.0.1"), 0)));
        assert_eq!(mask_to_prefix(v4("255.255.255.0")), Some(24));
        assert_eq!(mask_to_prefix(v4("255.255.255.255")), Some(32));
        assert_eq!(mask_to_prefix(v4("0.0.0.0")), Some(0));
        assert_eq!(mask_to_prefix(v4("255.0.255.0")), None);
        assert!(parse_kernel_ip("10.0.0.2::10.0.0.1:255.0.255.0").is_err());
        assert!(parse_kernel_ip("10.0.0.2::10.0.0.1").is_err());
        assert!(parse_kernel_ip("10.0.0.2::10.0.0.1:255.255.255.0::eth0:dhcp").is_err());
        assert!(matches!(parse_kernel_ip("off"), Ok(None)));
    }

    #[test]
    fn test_no_network_options_means_no_network() {
        let c = KernelCmdline::parse("console=ttyS0 root=/dev/vda");
        assert_eq!(c, KernelCmdline::default());
    }
}
