//! A hostile guest's network probe, run as root inside a VM by tine's
//! networking tests (a static binary: the min image has no libc).
//!
//! - `escape`: tries every way out it knows, many times, and prints how
//!   many attempts it made: TCP connects and UDP datagrams to each target
//!   and port, ICMP echo over a raw socket, hand-built IPv4 packets with
//!   forged source addresses (IP_HDRINCL), and ARP requests and forged ARP
//!   replies on `eth0`. What got out is for the test to count on the host.
//! - `connect IP:PORT`: one TCP connect with a timeout; on success sends
//!   an HTTP/1.0 GET and prints the answer. Exit 0 when it connected.
//! - `hold IP:PORT SECONDS`: keeps one TCP connection to an echo server
//!   busy (a byte every 100 ms, each echo awaited for 1 s) and prints
//!   `echo N` lines, then `cut after N` when the connection stops
//!   working or `held N` when the time is up.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::ExitCode;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: tine-netprobe escape --targets IP,.. --ports P,.. --rounds N \
[--spoof IP,..] [--arp IP,..] [--iface eth0]
       tine-netprobe connect IP:PORT [TIMEOUT_MS]
       tine-netprobe hold IP:PORT SECONDS";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("escape") => escape(&args[1..]),
        Some("connect") => connect(&args[1..]),
        Some("hold") => hold(&args[1..]),
        _ => Err(USAGE.to_owned()),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tine-netprobe: {e}");
            ExitCode::from(2)
        }
    }
}

fn parse_list<T: std::str::FromStr>(text: &str, what: &str) -> Result<Vec<T>, String> {
    text.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| format!("bad {what} {s:?}")))
        .collect()
}

fn parse_addr(text: Option<&String>) -> Result<SocketAddrV4, String> {
    let text = text.ok_or_else(|| USAGE.to_owned())?;
    text.parse().map_err(|_| format!("bad IP:PORT {text:?}"))
}

/// Attempts made, by kind; `local` counts those the guest's own kernel
/// refused (no route, say) before anything was sent.
#[derive(Default)]
struct Attempts {
    tcp: u64,
    udp: u64,
    icmp: u64,
    spoofed: u64,
    arp: u64,
    local: u64,
}

fn escape(args: &[String]) -> Result<ExitCode, String> {
    let mut targets: Vec<Ipv4Addr> = Vec::new();
    let mut ports: Vec<u16> = Vec::new();
    let mut spoof: Vec<Ipv4Addr> = Vec::new();
    let mut arp: Vec<Ipv4Addr> = Vec::new();
    let mut rounds = 1u32;
    let mut iface = "eth0".to_owned();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--targets" => targets = parse_list(value, "address")?,
            "--ports" => ports = parse_list(value, "port")?,
            "--spoof" => spoof = parse_list(value, "address")?,
            "--arp" => arp = parse_list(value, "address")?,
            "--rounds" => rounds = value.parse().map_err(|_| format!("bad --rounds {value}"))?,
            "--iface" => iface = value.clone(),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if targets.is_empty() || ports.is_empty() {
        return Err(USAGE.to_owned());
    }
    let mut n = Attempts::default();
    let icmp = raw_socket(libc::IPPROTO_ICMP)?;
    let forged = raw_socket(libc::IPPROTO_RAW)?;
    let link = ArpSender::open(&iface)?;
    for round in 0..rounds {
        let mut open = Vec::new();
        for &target in &targets {
            for &port in &ports {
                n.tcp += 1;
                match tcp_start(target, port) {
                    Ok(s) => open.push(s),
                    Err(_) => n.local += 1,
                }
                n.udp += 1;
                if udp_send(target, port).is_err() {
                    n.local += 1;
                }
            }
            n.icmp += 1;
            if send_to(&icmp, &echo_request(round as u16), target).is_err() {
                n.local += 1;
            }
            for &source in &spoof {
                n.spoofed += 1;
                let packet = forged_udp(source, target, 40000 + (round % 1000) as u16, 53);
                if send_to(&forged, &packet, target).is_err() {
                    n.local += 1;
                }
            }
        }
        for &who in &arp {
            // A request for `who`, then a forged reply claiming it.
            for reply in [false, true] {
                n.arp += 1;
                if link.send(who, reply).is_err() {
                    n.local += 1;
                }
            }
        }
        // Give the SYNs a moment on the wire before the sockets close.
        std::thread::sleep(Duration::from_millis(5));
        drop(open);
    }
    let total = n.tcp + n.udp + n.icmp + n.spoofed + n.arp;
    println!(
        "attempts tcp={} udp={} icmp={} spoofed={} arp={} total={total} refused_locally={}",
        n.tcp, n.udp, n.icmp, n.spoofed, n.arp, n.local
    );
    Ok(ExitCode::SUCCESS)
}

fn check(ret: libc::c_int, what: &str) -> Result<libc::c_int, String> {
    if ret < 0 {
        Err(format!("{what}: {}", std::io::Error::last_os_error()))
    } else {
        Ok(ret)
    }
}

fn owned(fd: libc::c_int) -> OwnedFd {
    // SAFETY: `fd` was just returned by socket(2), is open and owned by
    // nobody else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn raw_socket(protocol: libc::c_int) -> Result<OwnedFd, String> {
    // SAFETY: socket(2) takes plain integers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, protocol) };
    Ok(owned(check(fd, "raw socket (run as root)")?))
}

fn sockaddr(ip: Ipv4Addr, port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    }
}

fn send_to(fd: &OwnedFd, data: &[u8], to: Ipv4Addr) -> Result<(), String> {
    let addr = sockaddr(to, 0);
    // SAFETY: `data` and `addr` are valid for the lengths passed and
    // outlive the call.
    let ret = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            data.as_ptr().cast(),
            data.len(),
            0,
            (&addr as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    check(ret as libc::c_int, "sendto").map(drop)
}

/// Starts a non-blocking TCP connect (the SYN leaves at once).
fn tcp_start(ip: Ipv4Addr, port: u16) -> Result<OwnedFd, String> {
    // SAFETY: socket(2) takes plain integers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0) };
    let fd = owned(check(fd, "tcp socket")?);
    let addr = sockaddr(ip, port);
    // SAFETY: `addr` is a valid sockaddr_in for the length passed.
    let ret = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    let err = std::io::Error::last_os_error();
    if ret == 0 || err.raw_os_error() == Some(libc::EINPROGRESS) {
        Ok(fd)
    } else {
        Err(format!("connect: {err}"))
    }
}

fn udp_send(ip: Ipv4Addr, port: u16) -> Result<(), String> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
    socket
        .send_to(b"tine-netprobe", SocketAddrV4::new(ip, port))
        .map(drop)
        .map_err(|e| e.to_string())
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn echo_request(seq: u16) -> Vec<u8> {
    let mut p = vec![8, 0, 0, 0, 0x74, 0x6e];
    p.extend_from_slice(&seq.to_be_bytes());
    p.extend_from_slice(b"tine-netprobe");
    let sum = checksum(&p);
    p[2..4].copy_from_slice(&sum.to_be_bytes());
    p
}

/// An IPv4/UDP packet with any source address, for IP_HDRINCL.
fn forged_udp(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16) -> Vec<u8> {
    let payload = b"forged";
    let udp_len = 8 + payload.len();
    let total = 20 + udp_len;
    let mut p = vec![0x45, 0];
    p.extend_from_slice(&(total as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0x40, 0, 64, libc::IPPROTO_UDP as u8, 0, 0]);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    let sum = checksum(&p[..20]);
    p[10..12].copy_from_slice(&sum.to_be_bytes());
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&(udp_len as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(payload);
    p
}

/// ARP frames on one interface, from its own MAC and first IPv4 address.
struct ArpSender {
    fd: OwnedFd,
    ifindex: libc::c_int,
    mac: [u8; 6],
    ip: Ipv4Addr,
}

impl ArpSender {
    fn open(iface: &str) -> Result<Self, String> {
        let mac_text = std::fs::read_to_string(format!("/sys/class/net/{iface}/address"))
            .map_err(|e| format!("{iface}: {e}"))?;
        let mac_bytes: Vec<u8> = mac_text
            .trim()
            .split(':')
            .map(|b| u8::from_str_radix(b, 16).map_err(|_| format!("bad MAC {mac_text:?}")))
            .collect::<Result<_, _>>()?;
        let mac: [u8; 6] = mac_bytes
            .try_into()
            .map_err(|_| format!("bad MAC {mac_text:?}"))?;
        let ip = own_address(iface)?;
        let name = std::ffi::CString::new(iface).map_err(|_| "bad interface name".to_owned())?;
        // SAFETY: `name` is a NUL-terminated string that outlives the call.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) } as libc::c_int;
        if ifindex == 0 {
            return Err(format!("no interface {iface}"));
        }
        let proto = (libc::ETH_P_ARP as u16).to_be() as libc::c_int;
        // SAFETY: socket(2) takes plain integers.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM, proto) };
        let fd = owned(check(fd, "packet socket")?);
        Ok(Self {
            fd,
            ifindex,
            mac,
            ip,
        })
    }

    /// A broadcast who-has `who`, or (`reply`) a forged "`who` is at me".
    fn send(&self, who: Ipv4Addr, reply: bool) -> Result<(), String> {
        let mut p = vec![0, 1, 8, 0, 6, 4, 0, if reply { 2 } else { 1 }];
        p.extend_from_slice(&self.mac);
        if reply {
            p.extend_from_slice(&who.octets());
            p.extend_from_slice(&[0xff; 6]);
            p.extend_from_slice(&self.ip.octets());
        } else {
            p.extend_from_slice(&self.ip.octets());
            p.extend_from_slice(&[0; 6]);
            p.extend_from_slice(&who.octets());
        }
        // SAFETY: sockaddr_ll is plain old data; all-zero bytes are valid.
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_protocol = (libc::ETH_P_ARP as u16).to_be();
        to.sll_ifindex = self.ifindex;
        to.sll_halen = 6;
        to.sll_addr[..6].copy_from_slice(&[0xff; 6]);
        // SAFETY: `p` and `to` are valid for the lengths passed and outlive
        // the call.
        let ret = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                p.as_ptr().cast(),
                p.len(),
                0,
                (&to as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        check(ret as libc::c_int, "arp sendto").map(drop)
    }
}

/// The interface's IPv4 address (SIOCGIFADDR).
fn own_address(iface: &str) -> Result<Ipv4Addr, String> {
    // SAFETY: socket(2) takes plain integers.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    let fd = owned(check(raw, "socket")?);
    // SAFETY: ifreq is plain old data; all-zero bytes are valid.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(iface.bytes().take(15)) {
        *dst = src as libc::c_char;
    }
    // SAFETY: SIOCGIFADDR reads and writes one ifreq, which `ifr` is.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFADDR, &mut ifr) };
    check(ret, "SIOCGIFADDR")?;
    // SAFETY: for AF_INET the kernel wrote a sockaddr_in into the union,
    // which is large enough to hold one.
    let addr: libc::sockaddr_in =
        unsafe { std::ptr::read_unaligned(&ifr.ifr_ifru as *const _ as *const libc::sockaddr_in) };
    Ok(Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)))
}

fn connect(args: &[String]) -> Result<ExitCode, String> {
    let addr = parse_addr(args.first())?;
    let timeout = match args.get(1) {
        Some(ms) => Duration::from_millis(ms.parse().map_err(|_| format!("bad timeout {ms}"))?),
        None => Duration::from_secs(3),
    };
    let mut stream = match TcpStream::connect_timeout(&SocketAddr::V4(addr), timeout) {
        Ok(s) => s,
        Err(e) => {
            println!("no connection to {addr}: {e}");
            return Ok(ExitCode::from(1));
        }
    };
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.write_all(b"GET / HTTP/1.0\r\n\r\n");
    let mut answer = Vec::new();
    let _ = stream.take(4096).read_to_end(&mut answer);
    println!("connected to {addr}");
    print!("{}", String::from_utf8_lossy(&answer));
    Ok(ExitCode::SUCCESS)
}

fn hold(args: &[String]) -> Result<ExitCode, String> {
    let addr = parse_addr(args.first())?;
    let seconds: u64 = args
        .get(1)
        .ok_or_else(|| USAGE.to_owned())?
        .parse()
        .map_err(|_| "bad SECONDS".to_owned())?;
    let mut stream = TcpStream::connect_timeout(&SocketAddr::V4(addr), Duration::from_secs(3))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut echoes = 0u64;
    let mut out = std::io::stdout();
    while start.elapsed() < Duration::from_secs(seconds) {
        let mut byte = [0u8; 1];
        let ok = stream.write_all(b"x").is_ok() && matches!(stream.read(&mut byte), Ok(1));
        if !ok {
            let _ = writeln!(out, "cut after {echoes}");
            return Ok(ExitCode::SUCCESS);
        }
        echoes += 1;
        let _ = writeln!(out, "echo {echoes}");
        let _ = out.flush();
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = writeln!(out, "held {echoes}");
    Ok(ExitCode::SUCCESS)
}
