//! Helpers for virtio-net unit tests: the host side of a real TAP.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::process::Command;

use super::Tap;

/// A name unique to this test process, so parallel test runs (other
/// worktrees) do not collide.
pub fn test_tap_name(tag: &str) -> String {
    format!("tn{tag}{}", std::process::id() % 10_000_000)
}

/// Opens a real TAP, failing the test with an explanation if it cannot.
pub fn open_tap_or_fail(name: &str) -> Tap {
    Tap::open(name).unwrap_or_else(|e| panic!("{}", tap_failure(name, &e)))
}

/// The message a test that needs a real TAP fails with when it has none.
pub fn tap_failure(name: &str, error: &dyn std::error::Error) -> String {
    let mut message = format!("opening TAP {name:?} failed: {error}");
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    message.push_str("; this test needs root (CAP_NET_ADMIN) and /dev/net/tun (the tun module)");
    message
}

/// Brings the interface up (`ip link set dev NAME up`).
pub fn set_link_up(name: &str) {
    let status = Command::new("ip")
        .args(["link", "set", "dev", name, "up"])
        .status()
        .expect("run `ip link set` (iproute2)");
    assert!(status.success(), "`ip link set dev {name} up` failed");
}

/// An experimental EtherType, so the test sees only its own frames.
pub const TEST_ETHERTYPE: u16 = 0x88b5;

/// A broadcast frame of `len` bytes with [`TEST_ETHERTYPE`] and `tag`
/// as payload.
pub fn test_frame(len: usize, tag: u8) -> Vec<u8> {
    let mut frame = vec![tag; len];
    frame[..6].copy_from_slice(&[0xff; 6]);
    frame[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    frame[12..14].copy_from_slice(&TEST_ETHERTYPE.to_be_bytes());
    frame
}

/// A raw `AF_PACKET` socket bound to one interface and
/// [`TEST_ETHERTYPE`]: the host's side of the TAP.
pub fn packet_socket(ifname: &str) -> File {
    let proto = TEST_ETHERTYPE.to_be();
    // SAFETY: socket(2) with constant arguments; the result is checked
    // before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            libc::c_int::from(proto),
        )
    };
    assert!(fd >= 0, "AF_PACKET socket: {}", io::Error::last_os_error());
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let cname = std::ffi::CString::new(ifname).expect("name without NUL");
    // SAFETY: `cname` is a NUL-terminated string that outlives the call.
    let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
    assert_ne!(ifindex, 0, "if_nametoindex({ifname})");
    // SAFETY: `sockaddr_ll` is plain old data; all-zero is valid.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = proto;
    addr.sll_ifindex = ifindex as i32;
    // SAFETY: `addr` is a valid `sockaddr_ll` and its exact size is
    // passed; bind(2) only reads it.
    let ret = unsafe {
        libc::bind(
            file.as_raw_fd(),
            (&addr as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    assert_eq!(ret, 0, "bind AF_PACKET: {}", io::Error::last_os_error());
    file
}

/// Retries `f` while it would block, for up to two seconds.
pub fn poll_until<T>(mut f: impl FnMut() -> io::Result<Option<T>>) -> T {
    for _ in 0..200 {
        match f() {
            Ok(Some(value)) => return value,
            Ok(None) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("read failed: {e}"),
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("no frame within two seconds");
}
