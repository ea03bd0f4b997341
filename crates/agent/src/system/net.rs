//! IPv4 configuration of one interface through the classic ioctls
//! (`SIOCSIFADDR`, `SIOCSIFNETMASK`, `SIOCSIFFLAGS`, `SIOCADDRT`), so the
//! min image needs no `ip` binary and the agent no netlink crate.
//!
//! [`configure`] is idempotent and also re-addresses a running interface (a
//! fork's new IP, and a hot fork's new MAC through `SIOCSIFHWADDR`): the primary address is replaced and the default route is
//! deleted before the new one is added. IPv6 addresses are not handled.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::fs::write_atomic;
use crate::error::describe_error;

/// A static IPv4 configuration for one interface.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetConfig {
    /// Interface name, usually `eth0`.
    pub iface: String,
    /// The interface's address.
    pub addr: Ipv4Addr,
    /// Prefix length of the on-link network (0..=32).
    pub prefix: u8,
    /// Default gateway, which must be on-link.
    pub gateway: Option<Ipv4Addr>,
    /// Name servers for `/etc/resolv.conf`; empty leaves the file alone.
    pub dns: Vec<IpAddr>,
    /// The MAC address to give the interface first; `None` keeps it.
    #[serde(default)]
    pub mac: Option<[u8; 6]>,
}

/// Errors from this module.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The interface name is empty, too long or contains a NUL.
    #[error("Invalid interface name {0:?}")]
    InvalidIface(String),
    /// The prefix is longer than 32.
    #[error("Invalid prefix length /{0}")]
    InvalidPrefix(u8),
    /// The control socket could not be opened.
    #[error("Cannot open an AF_INET control socket")]
    Socket(#[source] io::Error),
    /// An ioctl failed.
    #[error("{op} on {iface} failed")]
    Ioctl {
        /// The request, e.g. `SIOCSIFADDR`.
        op: &'static str,
        /// The interface.
        iface: String,
        /// The errno.
        #[source]
        source: io::Error,
    },
    /// `/etc/resolv.conf` could not be written.
    #[error("Cannot write {}", path.display())]
    Resolv {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Brings `iface` up (`IFF_UP`); for `lo` the kernel adds 127.0.0.1/8.
pub fn link_up(iface: &str) -> Result<(), NetError> {
    let sock = control_socket()?;
    set_up(&sock, iface)
}

/// Applies `cfg`: address, netmask, link up, default route (replacing any),
/// then `/etc/resolv.conf` under `/` when `cfg.dns` is not empty.
pub fn configure(cfg: &NetConfig) -> Result<(), NetError> {
    configure_link(cfg)?;
    if !cfg.dns.is_empty() {
        write_resolv_conf(Path::new("/"), &cfg.dns)?;
    }
    Ok(())
}

/// [`configure`] without touching `/etc/resolv.conf`.
pub fn configure_link(cfg: &NetConfig) -> Result<(), NetError> {
    if cfg.prefix > 32 {
        return Err(NetError::InvalidPrefix(cfg.prefix));
    }
    let sock = control_socket()?;
    if let Some(mac) = cfg.mac {
        set_mac(&sock, &cfg.iface, mac)?;
    }
    let mut req = ifreq(&cfg.iface)?;
    req.ifr_ifru.ifru_addr = sockaddr_v4(cfg.addr);
    ioctl(
        &sock,
        libc::SIOCSIFADDR,
        "SIOCSIFADDR",
        &cfg.iface,
        &mut req,
    )?;
    let mask = prefix_to_mask(cfg.prefix);
    let mut req = ifreq(&cfg.iface)?;
    req.ifr_ifru.ifru_netmask = sockaddr_v4(mask);
    ioctl(
        &sock,
        libc::SIOCSIFNETMASK,
        "SIOCSIFNETMASK",
        &cfg.iface,
        &mut req,
    )?;
    set_up(&sock, &cfg.iface)?;
    if let Some(gw) = cfg.gateway {
        // Replace, not add: a fork re-addressed with a new gateway must not
        // keep the parent's route.
        let mut old = default_route(None, &cfg.iface)?;
        match route_ioctl(&sock, libc::SIOCDELRT, "SIOCDELRT", &cfg.iface, &mut old) {
            Ok(()) => {}
            // ESRCH: there was no default route to replace.
            Err(NetError::Ioctl { source, .. }) if source.raw_os_error() == Some(libc::ESRCH) => {}
            // The route added next reports what stands in its way.
            Err(e) => tracing::debug!("old default route not deleted: {}", describe_error(&e)),
        }
        let mut rt = default_route(Some(gw), &cfg.iface)?;
        route_ioctl(&sock, libc::SIOCADDRT, "SIOCADDRT", &cfg.iface, &mut rt)?;
    }
    Ok(())
}

/// Gives `iface` the hardware address `mac`, keeping its address family
/// (virtio-net, like loopback, takes it while the link is up).
fn set_mac(sock: &OwnedFd, iface: &str, mac: [u8; 6]) -> Result<(), NetError> {
    let mut req = ifreq(iface)?;
    ioctl(sock, libc::SIOCGIFHWADDR, "SIOCGIFHWADDR", iface, &mut req)?;
    // SAFETY: SIOCGIFHWADDR filled the hwaddr member of the union.
    let mut hw = unsafe { req.ifr_ifru.ifru_hwaddr };
    for (dst, src) in hw.sa_data.iter_mut().zip(mac) {
        *dst = src as libc::c_char;
    }
    let mut req = ifreq(iface)?;
    req.ifr_ifru.ifru_hwaddr = hw;
    ioctl(sock, libc::SIOCSIFHWADDR, "SIOCSIFHWADDR", iface, &mut req)
}

/// The interface's hardware address (its first six bytes).
pub fn mac_addr(iface: &str) -> Result<[u8; 6], NetError> {
    let sock = control_socket()?;
    let mut req = ifreq(iface)?;
    ioctl(&sock, libc::SIOCGIFHWADDR, "SIOCGIFHWADDR", iface, &mut req)?;
    // SAFETY: SIOCGIFHWADDR filled the hwaddr member of the union.
    let hw = unsafe { req.ifr_ifru.ifru_hwaddr };
    let mut mac = [0u8; 6];
    for (dst, src) in mac.iter_mut().zip(hw.sa_data) {
        *dst = src as u8;
    }
    Ok(mac)
}

/// The interface's primary IPv4 address and prefix, or `None` when it has
/// no IPv4 address.
pub fn ipv4_addr(iface: &str) -> Result<Option<(Ipv4Addr, u8)>, NetError> {
    let sock = control_socket()?;
    let mut req = ifreq(iface)?;
    match ioctl(&sock, libc::SIOCGIFADDR, "SIOCGIFADDR", iface, &mut req) {
        Err(NetError::Ioctl { source, .. })
            if source.raw_os_error() == Some(libc::EADDRNOTAVAIL) =>
        {
            return Ok(None)
        }
        r => r?,
    }
    // SAFETY: SIOCGIFADDR filled the address member of the union.
    let addr = sockaddr_to_v4(unsafe { &req.ifr_ifru.ifru_addr });
    let mut req = ifreq(iface)?;
    ioctl(
        &sock,
        libc::SIOCGIFNETMASK,
        "SIOCGIFNETMASK",
        iface,
        &mut req,
    )?;
    // SAFETY: SIOCGIFNETMASK filled the netmask member of the union.
    let mask = sockaddr_to_v4(unsafe { &req.ifr_ifru.ifru_netmask });
    Ok(Some((addr, u32::from(mask).leading_ones() as u8)))
}

/// Whether the interface is up (`IFF_UP`).
pub fn is_up(iface: &str) -> Result<bool, NetError> {
    let sock = control_socket()?;
    Ok(flags(&sock, iface)? & libc::IFF_UP as libc::c_short != 0)
}

/// Writes `ROOT/etc/resolv.conf` with one `nameserver` line per server
/// (atomically and synced; a symlink there is replaced by the file). A
/// file that says that already, with the same permissions, is left as it
/// is: every boot sets the same servers again, and a hot fork's guest has
/// its source's file, its group's servers; the write would cost a sync.
pub fn write_resolv_conf(root: &Path, dns: &[IpAddr]) -> Result<(), NetError> {
    const MODE: u32 = 0o644;
    let mut text = String::from("# Written by tine-agent\n");
    for d in dns {
        text.push_str(&format!("nameserver {d}\n"));
    }
    let path = root.join("etc/resolv.conf");
    let unchanged = std::fs::symlink_metadata(&path)
        .is_ok_and(|m| m.file_type().is_file() && m.permissions().mode() & 0o7777 == MODE)
        && std::fs::read(&path).is_ok_and(|old| old == text.as_bytes());
    if unchanged {
        return Ok(());
    }
    write_atomic(&path, text.as_bytes(), MODE).map_err(|source| NetError::Resolv { path, source })
}

fn prefix_to_mask(prefix: u8) -> Ipv4Addr {
    let p = u32::from(prefix.min(32));
    Ipv4Addr::from(u32::MAX.checked_shl(32 - p).unwrap_or(0))
}

fn control_socket() -> Result<OwnedFd, NetError> {
    // SAFETY: socket() takes no pointers; the result is checked below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(NetError::Socket(io::Error::last_os_error()));
    }
    // SAFETY: fd is a socket we just opened and own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn name_bytes(iface: &str) -> Result<[libc::c_char; libc::IFNAMSIZ], NetError> {
    let b = iface.as_bytes();
    if b.is_empty() || b.len() >= libc::IFNAMSIZ || b.contains(&0) {
        return Err(NetError::InvalidIface(iface.to_string()));
    }
    let mut name = [0 as libc::c_char; libc::IFNAMSIZ];
    for (d, s) in name.iter_mut().zip(b) {
        *d = *s as libc::c_char;
    }
    Ok(name)
}

fn ifreq(iface: &str) -> Result<libc::ifreq, NetError> {
    // SAFETY: ifreq is plain old data (a name array and a union of PODs);
    // all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    req.ifr_name = name_bytes(iface)?;
    Ok(req)
}

fn ioctl(
    sock: &OwnedFd,
    request: libc::Ioctl,
    op: &'static str,
    iface: &str,
    req: &mut libc::ifreq,
) -> Result<(), NetError> {
    // SAFETY: every request passed here takes a `struct ifreq *`, and `req`
    // is a valid, exclusively borrowed ifreq for the whole call.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), request, req as *mut libc::ifreq) };
    if r < 0 {
        return Err(NetError::Ioctl {
            op,
            iface: iface.to_string(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn flags(sock: &OwnedFd, iface: &str) -> Result<libc::c_short, NetError> {
    let mut req = ifreq(iface)?;
    ioctl(sock, libc::SIOCGIFFLAGS, "SIOCGIFFLAGS", iface, &mut req)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    Ok(unsafe { req.ifr_ifru.ifru_flags })
}

fn set_up(sock: &OwnedFd, iface: &str) -> Result<(), NetError> {
    let f = flags(sock, iface)?;
    let mut req = ifreq(iface)?;
    req.ifr_ifru.ifru_flags = f | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    ioctl(sock, libc::SIOCSIFFLAGS, "SIOCSIFFLAGS", iface, &mut req)
}

fn sockaddr_v4(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr are both 16-byte POD structs, the
    // generic and the AF_INET view of the same bytes; the read is unaligned
    // so their different alignments do not matter.
    unsafe { std::ptr::read_unaligned(&sin as *const libc::sockaddr_in as *const libc::sockaddr) }
}

fn sockaddr_to_v4(sa: &libc::sockaddr) -> Ipv4Addr {
    // SAFETY: as in sockaddr_v4, the two are same-sized POD views.
    let sin: libc::sockaddr_in = unsafe {
        std::ptr::read_unaligned(sa as *const libc::sockaddr as *const libc::sockaddr_in)
    };
    Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))
}

/// The kernel's `struct rtentry` (include/uapi/linux/route.h), which the
/// libc crate does not define for glibc targets.
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

/// A default route (0.0.0.0/0) on `iface`, with its name kept alive next to
/// the entry that points at it.
struct Route {
    entry: RtEntry,
    _dev: Box<[libc::c_char; libc::IFNAMSIZ]>,
}

fn default_route(gw: Option<Ipv4Addr>, iface: &str) -> Result<Route, NetError> {
    let mut dev = Box::new(name_bytes(iface)?);
    let mut flags = libc::RTF_UP;
    if gw.is_some() {
        flags |= libc::RTF_GATEWAY;
    }
    let entry = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_v4(Ipv4Addr::UNSPECIFIED),
        rt_gateway: sockaddr_v4(gw.unwrap_or(Ipv4Addr::UNSPECIFIED)),
        rt_genmask: sockaddr_v4(Ipv4Addr::UNSPECIFIED),
        rt_flags: flags,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: dev.as_mut_ptr(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    Ok(Route { entry, _dev: dev })
}

fn route_ioctl(
    sock: &OwnedFd,
    request: libc::Ioctl,
    op: &'static str,
    iface: &str,
    rt: &mut Route,
) -> Result<(), NetError> {
    // SAFETY: SIOCADDRT/SIOCDELRT take a `struct rtentry *`; RtEntry has its
    // layout, and rt_dev points into `rt._dev`, which outlives the call.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), request, &mut rt.entry as *mut RtEntry) };
    if r < 0 {
        return Err(NetError::Ioctl {
            op,
            iface: iface.to_string(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a thread of its own in a fresh network namespace (only
    /// that thread moves), so the host's interfaces are never touched.
    fn in_new_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
                panic!("unshare(CLONE_NEWNET) failed ({e}): these tests need root (CAP_SYS_ADMIN)");
            }
            f()
        })
        .join()
        .expect("netns thread panicked")
    }

    fn default_gateway() -> Option<Ipv4Addr> {
        // Only this thread is in the new namespace: read its own view.
        let routes = std::fs::read_to_string("/proc/thread-self/net/route").ok()?;
        routes.lines().skip(1).find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&"00000000") && f.get(7) == Some(&"00000000"))
                .then(|| f.get(2).and_then(|g| u32::from_str_radix(g, 16).ok()))
                .flatten()
                .map(|g| Ipv4Addr::from(u32::from_be(g)))
        })
    }

    #[test]
    fn test_prefix_to_mask() {
        assert_eq!(prefix_to_mask(0), Ipv4Addr::new(0, 0, 0, 0));
        assert_eq!(prefix_to_mask(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(prefix_to_mask(30), Ipv4Addr::new(255, 255, 255, 252));
        assert_eq!(prefix_to_mask(32), Ipv4Addr::new(255, 255, 255, 255));
    }

    #[test]
    fn test_invalid_names_are_refused() {
        assert!(matches!(ifreq(""), Err(NetError::InvalidIface(_))));
        assert!(matches!(
            ifreq("0123456789abcdef"),
            Err(NetError::InvalidIface(_))
        ));
        assert!(matches!(ifreq("a\0b"), Err(NetError::InvalidIface(_))));
        assert!(ifreq("0123456789abcde").is_ok());
    }

    #[test]
    fn test_configure_and_readdress_in_a_private_netns() {
        in_new_netns(|| {
            assert!(!is_up("lo").expect("flags"));
            link_up("lo").expect("lo up");
            assert!(is_up("lo").expect("flags"));
            assert_eq!(
                ipv4_addr("lo").expect("addr"),
                Some((Ipv4Addr::new(127, 0, 0, 1), 8))
            );

            let mut cfg = NetConfig {
                iface: "lo".into(),
                addr: Ipv4Addr::new(10, 1, 2, 3),
                prefix: 24,
                gateway: Some(Ipv4Addr::new(10, 1, 2, 1)),
                dns: vec![],
                mac: None,
            };
            let mac_before = mac_addr("lo").expect("mac");
            configure(&cfg).expect("configure");
            assert_eq!(ipv4_addr("lo").expect("addr"), Some((cfg.addr, 24)));
            assert_eq!(default_gateway(), cfg.gateway);
            assert_eq!(mac_addr("lo").expect("mac"), mac_before);

            // A fork gets a new address and gateway: both are replaced.
            cfg.addr = Ipv4Addr::new(10, 9, 0, 5);
            cfg.prefix = 30;
            cfg.gateway = Some(Ipv4Addr::new(10, 9, 0, 6));
            // A hot fork also gets its own MAC, on the link that is up.
            cfg.mac = Some([0x02, 0x74, 0x69, 0x6e, 0x65, 0x2a]);
            configure(&cfg).expect("reconfigure");
            assert_eq!(ipv4_addr("lo").expect("addr"), Some((cfg.addr, 30)));
            assert_eq!(default_gateway(), cfg.gateway);
            assert_eq!(
                mac_addr("lo").expect("mac"),
                [0x02, 0x74, 0x69, 0x6e, 0x65, 0x2a]
            );
        });
    }

    #[test]
    fn test_missing_interface_is_a_clear_error() {
        in_new_netns(|| {
            let cfg = NetConfig {
                iface: "eth0".into(),
                addr: Ipv4Addr::new(10, 0, 0, 2),
                prefix: 24,
                gateway: None,
                dns: vec![],
                mac: None,
            };
            let err = configure(&cfg).expect_err("no eth0 in a new netns");
            match err {
                NetError::Ioctl { op, iface, source } => {
                    assert_eq!(op, "SIOCSIFADDR");
                    assert_eq!(iface, "eth0");
                    assert_eq!(source.raw_os_error(), Some(libc::ENODEV));
                }
                other => panic!("unexpected error {other:?}"),
            }
        });
    }

    #[test]
    fn test_resolv_conf() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("etc")).expect("mkdir");
        write_resolv_conf(
            dir.path(),
            &[
                "9.9.9.9".parse().expect("ip"),
                "2620:fe::fe".parse().expect("ip"),
            ],
        )
        .expect("write");
        let text = std::fs::read_to_string(dir.path().join("etc/resolv.conf")).expect("read");
        assert!(
            text.contains("nameserver 9.9.9.9\nnameserver 2620:fe::fe\n"),
            "{text}"
        );
    }

    #[test]
    fn test_resolv_conf_is_written_only_when_it_would_change() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("etc")).expect("mkdir");
        let path = dir.path().join("etc/resolv.conf");
        let inode = || std::fs::symlink_metadata(&path).expect("stat").ino();
        let quad9: Vec<IpAddr> = vec!["9.9.9.9".parse().expect("ip")];
        write_resolv_conf(dir.path(), &quad9).expect("write");
        let first = inode();
        write_resolv_conf(dir.path(), &quad9).expect("write the same");
        assert_eq!(inode(), first, "the same servers: the file is left alone");

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        write_resolv_conf(dir.path(), &quad9).expect("write");
        assert_ne!(inode(), first, "other permissions: written again");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o7777, 0o644);

        let second = inode();
        write_resolv_conf(dir.path(), &["1.1.1.1".parse().expect("ip")]).expect("write");
        assert_ne!(inode(), second, "other servers: written again");
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.contains("nameserver 1.1.1.1\n"), "{text}");

        // A link to a file that says the same is replaced by a file.
        let target = dir.path().join("stub.conf");
        std::fs::copy(&path, &target).expect("copy");
        std::fs::remove_file(&path).expect("rm");
        std::os::unix::fs::symlink(&target, &path).expect("symlink");
        write_resolv_conf(dir.path(), &["1.1.1.1".parse().expect("ip")]).expect("write");
        assert!(
            std::fs::symlink_metadata(&path)
                .expect("stat")
                .file_type()
                .is_file(),
            "the link was replaced"
        );
    }
}
