//! Helpers for virtio-net unit tests: a datagram-socket backend, an
//! activated device on test memory, and the host side of a real TAP.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::process::Command;
use std::sync::Arc;

use vm_memory::GuestAddress;

use super::{Net, NetBackend, Tap, RX_QUEUE_INDEX, TX_QUEUE_INDEX, VNET_HDR_LEN};
use crate::devices::virtio::test_utils::configure_queue;
use crate::devices::virtio::{IrqTrigger, VirtioDevice};
use crate::vstate::memory::GuestMemoryMmap;

/// A locally administered unicast MAC.
pub const TEST_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x12, 0x34, 0x56];
/// Where the RX queue's rings live in test memory.
pub const RX_RING: GuestAddress = GuestAddress(0);
/// Where the TX queue's rings live in test memory.
pub const TX_RING: GuestAddress = GuestAddress(0x4000);

/// A backend over one end of a datagram socket pair: each datagram is one
/// Ethernet frame, without a virtio-net header.
#[derive(Debug)]
pub struct SocketBackend {
    /// The device's end.
    pub sock: UnixDatagram,
    /// The header `recv` reports for every frame.
    pub rx_hdr: [u8; VNET_HDR_LEN],
}

impl NetBackend for SocketBackend {
    fn recv(&mut self, hdr: &mut [u8; VNET_HDR_LEN], frame: &mut [u8]) -> io::Result<usize> {
        let len = self.sock.recv(frame)?;
        *hdr = self.rx_hdr;
        Ok(len)
    }

    fn send(&mut self, _hdr: &[u8; VNET_HDR_LEN], frame: &[u8]) -> io::Result<usize> {
        self.sock.send(frame)
    }

    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    fn name(&self) -> &str {
        ""
    }
}

/// A non-blocking socket backend and the test's (non-blocking) end.
pub fn socket_backend() -> (SocketBackend, UnixDatagram) {
    let (sock, peer) = UnixDatagram::pair().expect("socketpair");
    sock.set_nonblocking(true).expect("non-blocking");
    peer.set_nonblocking(true).expect("non-blocking");
    let backend = SocketBackend {
        sock,
        rx_hdr: [0; VNET_HDR_LEN],
    };
    (backend, peer)
}

/// A device on a socket backend with its queues at [`RX_RING`] and
/// [`TX_RING`], activated on `mem`.
pub fn activated_net(mem: &GuestMemoryMmap) -> (Net, UnixDatagram, Arc<IrqTrigger>) {
    let (backend, peer) = socket_backend();
    let mut net = Net::new(Box::new(backend), TEST_MAC).expect("net");
    // What a driver accepts: everything offered.
    net.common_mut().acked_features = net.common().avail_features;
    configure_queues(&mut net, mem);
    let irq = Arc::new(IrqTrigger::new().expect("irq"));
    net.activate(mem.clone(), irq.clone()).expect("activate");
    (net, peer, irq)
}

/// Points the device's queues at [`RX_RING`] and [`TX_RING`].
pub fn configure_queues(net: &mut Net, mem: &GuestMemoryMmap) {
    let size = super::NET_QUEUE_SIZE;
    let rxq = virtio_queue::mock::MockSplitQueue::create(mem, RX_RING, size);
    let txq = virtio_queue::mock::MockSplitQueue::create(mem, TX_RING, size);
    configure_queue(&mut net.common_mut().queues[RX_QUEUE_INDEX], &rxq);
    configure_queue(&mut net.common_mut().queues[TX_QUEUE_INDEX], &txq);
}

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
