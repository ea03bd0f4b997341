//! Device tests. The test plays the guest driver (packets placed in the TX
//! queue, packets read back from the RX queue of mock split queues) and the
//! host clients (real Unix sockets in a temporary directory), and stands in
//! for the VMM's event loop with a real epoll over `host_fds()`.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::RawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::connection::CONN_BUF_SIZE;
use super::muxer::FIRST_LOCAL_PORT;
use super::packet::*;
use super::*;
use crate::devices::virtio::persist::VirtioDeviceState;
use crate::devices::virtio::test_utils::{configure_queue, test_memory};
use crate::devices::virtio::{device_type, IrqTrigger, VirtioDevice, VIRTIO_MMIO_INT_VRING};
use crate::snapshot::Persist;
use crate::vstate::memory::GuestMemoryMmap;

const GUEST_CID: u64 = 3;
const QSIZE: u16 = QUEUE_SIZE;
/// TX packets are consumed as soon as they are sent, so one area serves all.
const TX_HDR: u64 = 0x20_0000;
const TX_DATA: u64 = 0x20_1000;
/// RX and event buffers are handed out from here.
const BUF_BASE: u64 = 0x40_0000;
const MEM_END: u64 = 16 << 20;
const EPOLLOUT: u32 = libc::EPOLLOUT as u32;

/// One virtqueue as the driver sees it.
struct VirtQ<'a> {
    mem: &'a GuestMemoryMmap,
    mock: MockSplitQueue<'a, GuestMemoryMmap>,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
    /// Writable segments of each outstanding chain, by head.
    segments: HashMap<u16, Vec<(u64, u32)>>,
}

impl<'a> VirtQ<'a> {
    fn new(mem: &'a GuestMemoryMmap, base: u64) -> Self {
        Self {
            mem,
            mock: MockSplitQueue::create(mem, GuestAddress(base), QSIZE),
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
            segments: HashMap::new(),
        }
    }

    /// Adds a chain of (address, length, device-writable) descriptors.
    fn add_chain(&mut self, descs: &[(u64, u32, bool)]) {
        let head = self.next_desc;
        let table = self.mock.desc_table_addr();
        for (i, &(addr, len, write)) in descs.iter().enumerate() {
            let idx = (head as usize + i) % QSIZE as usize;
            let next = ((idx + 1) % QSIZE as usize) as u16;
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let d = table.unchecked_add(16 * idx as u64);
            self.mem.write_obj(addr, d).expect("desc addr");
            self.mem
                .write_obj(len, d.unchecked_add(8))
                .expect("desc len");
            self.mem
                .write_obj(flags, d.unchecked_add(12))
                .expect("flags");
            self.mem.write_obj(next, d.unchecked_add(14)).expect("next");
        }
        self.next_desc = ((head as usize + descs.len()) % QSIZE as usize) as u16;
        let avail = self.mock.avail_addr();
        let slot = avail.unchecked_add(4 + 2 * u64::from(self.avail_idx % QSIZE));
        self.mem.write_obj(head, slot).expect("avail slot");
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, avail.unchecked_add(2))
            .expect("avail idx");
        let writable = descs
            .iter()
            .filter(|d| d.2)
            .map(|&(a, l, _)| (a, l))
            .collect();
        self.segments.insert(head, writable);
    }

    /// Used entries since the last call: (head, len).
    fn used(&mut self) -> Vec<(u16, u32)> {
        let used = self.mock.used_addr();
        let idx: u16 = self.mem.read_obj(used.unchecked_add(2)).expect("used idx");
        let mut out = Vec::new();
        while self.used_seen != idx {
            let e = used.unchecked_add(4 + 8 * u64::from(self.used_seen % QSIZE));
            let id: u32 = self.mem.read_obj(e).expect("used id");
            let len: u32 = self.mem.read_obj(e.unchecked_add(4)).expect("used len");
            out.push((id as u16, len));
            self.used_seen = self.used_seen.wrapping_add(1);
        }
        out
    }

    /// The first `len` bytes the device wrote into chain `head`.
    fn written(&self, head: u16, len: u32) -> Vec<u8> {
        let mut out = Vec::new();
        let mut left = len as usize;
        for &(addr, seg_len) in self.segments.get(&head).into_iter().flatten() {
            let n = left.min(seg_len as usize);
            let mut buf = vec![0; n];
            self.mem
                .read_slice(&mut buf, GuestAddress(addr))
                .expect("read buffer");
            out.extend(buf);
            left -= n;
        }
        out
    }
}

/// The simulated guest driver.
struct Guest<'a> {
    rx: VirtQ<'a>,
    tx: VirtQ<'a>,
    ev: VirtQ<'a>,
    next_buf: u64,
}

impl<'a> Guest<'a> {
    fn new(mem: &'a GuestMemoryMmap) -> Self {
        Self {
            rx: VirtQ::new(mem, 0x0_0000),
            tx: VirtQ::new(mem, 0x1_0000),
            ev: VirtQ::new(mem, 0x2_0000),
            next_buf: BUF_BASE,
        }
    }

    fn configure(&self, dev: &mut Vsock) {
        configure_queue(&mut dev.common.queues[RXQ], &self.rx.mock);
        configure_queue(&mut dev.common.queues[TXQ], &self.tx.mock);
        configure_queue(&mut dev.common.queues[EVQ], &self.ev.mock);
    }

    fn alloc(&mut self, len: u32) -> u64 {
        let addr = self.next_buf;
        self.next_buf += u64::from(len).next_multiple_of(16);
        assert!(self.next_buf < MEM_END, "test ran out of buffer space");
        addr
    }

    /// Sends a packet whose header `len` is set to the payload length.
    fn send(&mut self, dev: &mut Vsock, mut hdr: PacketHeader, data: &[u8]) {
        hdr.len = data.len() as u32;
        self.send_with_len(dev, hdr, data);
    }

    /// Sends `hdr` as is (its `len` may lie) followed by `data`.
    fn send_with_len(&mut self, dev: &mut Vsock, hdr: PacketHeader, data: &[u8]) {
        let mem = self.tx.mem;
        mem.write_slice(&hdr.to_bytes(), GuestAddress(TX_HDR))
            .expect("tx header");
        let mut descs = vec![(TX_HDR, HDR_SIZE as u32, false)];
        if !data.is_empty() {
            mem.write_slice(data, GuestAddress(TX_DATA))
                .expect("tx data");
            descs.push((TX_DATA, data.len() as u32, false));
        }
        self.send_raw(dev, &descs);
    }

    fn send_raw(&mut self, dev: &mut Vsock, descs: &[(u64, u32, bool)]) {
        self.tx.add_chain(descs);
        dev.process_queue(TXQ);
    }

    /// Makes `count` RX buffers of `size` bytes available, without notifying.
    fn give_rx(&mut self, count: usize, size: u32) {
        for _ in 0..count {
            let addr = self.alloc(size);
            self.rx.add_chain(&[(addr, size, true)]);
        }
    }

    /// Packets the device completed on the RX queue, as (used len, bytes).
    fn recv_raw(&mut self) -> Vec<(u32, Vec<u8>)> {
        self.rx
            .used()
            .into_iter()
            .map(|(head, len)| (len, self.rx.written(head, len)))
            .collect()
    }

    /// Packets received on the RX queue; every completed buffer must hold
    /// one.
    fn recv(&mut self) -> Vec<(PacketHeader, Vec<u8>)> {
        self.recv_raw()
            .into_iter()
            .map(|(len, bytes)| {
                assert!(len as usize >= HDR_SIZE, "RX buffer completed empty");
                let mut raw = [0u8; HDR_SIZE];
                raw.copy_from_slice(&bytes[..HDR_SIZE]);
                let hdr = PacketHeader::from_bytes(&raw);
                let data = bytes[HDR_SIZE..].to_vec();
                assert_eq!(hdr.len as usize, data.len());
                (hdr, data)
            })
            .collect()
    }

    fn give_event_buf(&mut self) {
        let addr = self.alloc(8);
        self.ev.add_chain(&[(addr, 8, true)]);
    }

    /// Event IDs the device wrote.
    fn events(&mut self) -> Vec<u32> {
        self.ev
            .used()
            .into_iter()
            .map(|(head, len)| {
                assert_eq!(len, EVENT_SIZE as u32);
                let b = self.ev.written(head, len);
                u32::from_le_bytes([b[0], b[1], b[2], b[3]])
            })
            .collect()
    }
}

fn pkt(op: u16, src_port: u32, dst_port: u32) -> PacketHeader {
    PacketHeader {
        src_cid: GUEST_CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len: 0,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: CONN_BUF_SIZE,
        fwd_cnt: 0,
    }
}

fn uds(dir: &Path) -> PathBuf {
    dir.join("vsock")
}

/// A device on `uds(dir)` with its queues on `guest`, activated.
fn activated_device(
    mem: &GuestMemoryMmap,
    guest: &Guest<'_>,
    dir: &Path,
) -> (Vsock, Arc<IrqTrigger>) {
    let mut dev = Vsock::new(GUEST_CID, uds(dir)).expect("device");
    guest.configure(&mut dev);
    let irq = Arc::new(IrqTrigger::new().expect("irq"));
    dev.activate(mem.clone(), irq.clone()).expect("activate");
    (dev, irq)
}

/// Stands in for the VMM's event loop: polls `host_fds()` and dispatches
/// until nothing is ready. Fails if readiness never settles, which would
/// make the real loop spin.
fn pump_host(dev: &mut Vsock) {
    for _ in 0..100 {
        let epoll = Epoll::new().expect("epoll");
        for (fd, events) in dev.host_fds() {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::from_bits_truncate(events), fd as u64),
                )
                .expect("epoll add");
        }
        let mut ready = vec![EpollEvent::default(); 64];
        let n = epoll.wait(0, &mut ready).expect("epoll wait");
        if n == 0 {
            return;
        }
        for ev in &ready[..n] {
            dev.process_host_event(ev.fd(), ev.events());
        }
    }
    panic!("host fds stay ready: the event loop would spin");
}

fn read_timeout(stream: &mut UnixStream, n: usize) -> Vec<u8> {
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut buf = vec![0; n];
    stream.read_exact(&mut buf).expect("host read");
    buf
}

fn assert_host_eof(stream: &mut UnixStream) {
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("expected end of file, got {other:?}"),
    }
}

fn connect_client(dev: &mut Vsock, path: &Path, line: &[u8]) -> UnixStream {
    let mut client = UnixStream::connect(path).expect("connect");
    client.write_all(line).expect("write line");
    pump_host(dev);
    client
}

/// Host-initiated connection to guest port `guest_port`, established.
/// Returns the client socket and the host port the device chose.
fn host_connection(dev: &mut Vsock, guest: &mut Guest<'_>, guest_port: u32) -> (UnixStream, u32) {
    guest.give_rx(4, 4096);
    let path = dev.uds_path().to_path_buf();
    let mut client = connect_client(dev, &path, format!("CONNECT {guest_port}\n").as_bytes());
    let pkts = guest.recv();
    assert_eq!(pkts.len(), 1);
    let req = pkts[0].0;
    assert_eq!(req.op, OP_REQUEST);
    assert_eq!(req.dst_port, guest_port);
    guest.send(dev, pkt(OP_RESPONSE, guest_port, req.src_port), &[]);
    let ok = format!("OK {}\n", req.src_port);
    assert_eq!(read_timeout(&mut client, ok.len()), ok.as_bytes());
    (client, req.src_port)
}

/// Guest-initiated connection from `guest_port` to host port `host_port`,
/// established; the one RX buffer it gives is used. Returns the listener and the accepted host socket.
fn guest_connection(
    dev: &mut Vsock,
    guest: &mut Guest<'_>,
    dir: &Path,
    host_port: u32,
    guest_port: u32,
    buf_alloc: u32,
) -> (UnixListener, UnixStream) {
    let listener = UnixListener::bind(dir.join(format!("vsock_{host_port}"))).expect("bind");
    guest.give_rx(1, 4096);
    let mut req = pkt(OP_REQUEST, guest_port, host_port);
    req.buf_alloc = buf_alloc;
    guest.send(dev, req, &[]);
    let pkts = guest.recv();
    assert_eq!(pkts.len(), 1);
    assert_eq!(pkts[0].0.op, OP_RESPONSE);
    assert_eq!(
        (pkts[0].0.src_port, pkts[0].0.dst_port),
        (host_port, guest_port)
    );
    let (stream, _) = listener.accept().expect("accept");
    (listener, stream)
}

fn ops(pkts: &[(PacketHeader, Vec<u8>)]) -> Vec<u16> {
    pkts.iter().map(|p| p.0.op).collect()
}

// ---------------------------------------------------------------------------
// Construction and configuration.

#[test]
fn test_vsock_new_reserved_cid_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    for cid in [0, 1, 2, u64::from(u32::MAX), u64::MAX] {
        assert!(matches!(
            Vsock::new(cid, uds(dir.path())),
            Err(VsockError::InvalidCid(c)) if c == cid
        ));
    }
}

#[test]
fn test_vsock_new_stale_socket_replaced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let stale = UnixListener::bind(uds(dir.path())).expect("bind");
    drop(stale);
    let dev = Vsock::new(GUEST_CID, uds(dir.path())).expect("device");
    assert_eq!(dev.uds_path(), uds(dir.path()));
    assert!(UnixStream::connect(uds(dir.path())).is_ok());
}

#[test]
fn test_vsock_new_regular_file_at_path_fails_and_keeps_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(uds(dir.path()), b"data").expect("file");
    assert!(matches!(
        Vsock::new(GUEST_CID, uds(dir.path())),
        Err(VsockError::Bind { .. })
    ));
    assert_eq!(std::fs::read(uds(dir.path())).expect("read"), b"data");
}

#[test]
fn test_vsock_read_config_returns_cid_le() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Vsock::new(0x0102_0304, uds(dir.path())).expect("device");
    assert_eq!(dev.device_type(), device_type::VSOCK);
    let mut full = [0xffu8; 8];
    dev.read_config(0, &mut full);
    assert_eq!(full, 0x0102_0304u64.to_le_bytes());
    let mut tail = [0xffu8; 4];
    dev.read_config(6, &mut tail);
    assert_eq!(tail, [0, 0, 0, 0]);
    let mut far = [0xffu8; 2];
    dev.read_config(u64::MAX, &mut far);
    assert_eq!(far, [0, 0]);
}

// ---------------------------------------------------------------------------
// Host-initiated connections.

#[test]
fn test_vsock_host_connect_handshake_relays_both_ways() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, irq) = activated_device(&mem, &guest, dir.path());

    let (mut client, local_port) = host_connection(&mut dev, &mut guest, 1234);
    assert!(local_port >= FIRST_LOCAL_PORT);
    assert_ne!(irq.status() & VIRTIO_MMIO_INT_VRING, 0);

    client.write_all(b"ping").expect("write");
    pump_host(&mut dev);
    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RW]);
    assert_eq!(pkts[0].1, b"ping");
    assert_eq!(
        (pkts[0].0.src_port, pkts[0].0.dst_port, pkts[0].0.dst_cid),
        (local_port, 1234, GUEST_CID)
    );

    guest.send(&mut dev, pkt(OP_RW, 1234, local_port), b"pong");
    assert_eq!(read_timeout(&mut client, 4), b"pong");
}

#[test]
fn test_vsock_host_connect_bytes_after_line_reach_guest() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(4, 4096);

    let _client = connect_client(&mut dev, &uds(dir.path()), b"CONNECT 7\nearly");
    let req = guest.recv()[0].0;
    guest.send(&mut dev, pkt(OP_RESPONSE, 7, req.src_port), &[]);
    pump_host(&mut dev);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RW]);
    assert_eq!(pkts[0].1, b"early");
}

#[test]
fn test_vsock_host_connect_guest_rst_closes_client() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(4, 4096);

    let mut client = connect_client(&mut dev, &uds(dir.path()), b"CONNECT 99\n");
    let req = guest.recv()[0].0;
    guest.send(&mut dev, pkt(OP_RST, 99, req.src_port), &[]);

    assert_host_eof(&mut client);
    assert_eq!(dev.muxer.connection_count(), 0);
    assert!(guest.recv().is_empty(), "an RST is not answered");
}

#[test]
fn test_vsock_connect_line_malformed_closes_client() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(4, 4096);

    let mut client = connect_client(&mut dev, &uds(dir.path()), b"CONNECT port\n");

    assert_host_eof(&mut client);
    assert!(guest.recv().is_empty());
    assert_eq!(dev.muxer.connection_count(), 0);
}

#[test]
fn test_vsock_connect_line_overlong_closes_client() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());

    let mut client = connect_client(&mut dev, &uds(dir.path()), &[b'1'; 100]);

    assert_host_eof(&mut client);
    assert_eq!(dev.muxer.connection_count(), 0);
}

#[test]
fn test_vsock_connect_line_split_writes_accepted() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(4, 4096);

    let mut client = connect_client(&mut dev, &uds(dir.path()), b"CONN");
    assert!(guest.recv().is_empty());
    client.write_all(b"ECT 5\n").expect("write");
    pump_host(&mut dev);

    assert_eq!(ops(&guest.recv()), [OP_REQUEST]);
}

#[test]
fn test_vsock_request_without_rx_buffers_waits_for_rx_notification() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());

    let _client = connect_client(&mut dev, &uds(dir.path()), b"CONNECT 5\n");
    assert!(guest.recv().is_empty());
    guest.give_rx(1, 4096);
    dev.process_queue(RXQ);

    assert_eq!(ops(&guest.recv()), [OP_REQUEST]);
}

#[test]
fn test_vsock_request_timeout_closes_client_and_rsts_guest() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(4, 4096);
    let mut client = connect_client(&mut dev, &uds(dir.path()), b"CONNECT 5\n");
    let req = guest.recv()[0].0;

    dev.muxer
        .process_timeouts(Instant::now() + Duration::from_secs(60));
    dev.process_queue(RXQ);

    assert_host_eof(&mut client);
    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RST]);
    assert_eq!(pkts[0].0.src_port, req.src_port);
}

#[test]
fn test_vsock_connection_limit_closes_extra_client() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    dev.muxer.set_max_connections(3);
    guest.give_rx(4, 4096);
    let _a = connect_client(&mut dev, &uds(dir.path()), b"CONNECT 5\n");
    let _b = connect_client(&mut dev, &uds(dir.path()), b"CONNECT 6\n");
    let _c = connect_client(&mut dev, &uds(dir.path()), b"CONN");
    assert_eq!(dev.muxer.connection_count(), 3);

    let mut extra = connect_client(&mut dev, &uds(dir.path()), b"CONNECT 7\n");

    assert_host_eof(&mut extra);
    assert_eq!(ops(&guest.recv()), [OP_REQUEST, OP_REQUEST]);
}

#[test]
fn test_vsock_connection_limit_rsts_guest_request() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let _listener = UnixListener::bind(dir.path().join("vsock_52")).expect("bind");
    dev.muxer.set_max_connections(1);
    let _client = connect_client(&mut dev, &uds(dir.path()), b"CONN");
    guest.give_rx(1, 4096);

    guest.send(&mut dev, pkt(OP_REQUEST, 5000, 52), &[]);

    assert_eq!(ops(&guest.recv()), [OP_RST]);
    assert_eq!(dev.muxer.connection_count(), 1);
}

// ---------------------------------------------------------------------------
// Guest-initiated connections.

#[test]
fn test_vsock_guest_connect_with_listener_relays_both_ways() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, mut host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(2, 4096);

    guest.send(&mut dev, pkt(OP_RW, 5000, 52), b"hello");
    assert_eq!(read_timeout(&mut host, 5), b"hello");

    host.write_all(b"world").expect("write");
    pump_host(&mut dev);
    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RW]);
    assert_eq!(pkts[0].1, b"world");
    assert_eq!((pkts[0].0.src_port, pkts[0].0.dst_port), (52, 5000));
}

/// A socket file moved with its folder (a primed VM's, which its fork
/// takes): once told, guest connections go next to the new name, and host
/// clients reach the listener there.
#[test]
fn test_vsock_moved_socket_takes_guest_connections_to_its_new_folder() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let moved = dir.path().join("fork");
    std::fs::create_dir(&moved).expect("folder");
    std::fs::rename(uds(dir.path()), uds(&moved)).expect("move the socket");
    dev.set_uds_path(uds(&moved));
    assert_eq!(dev.uds_path(), uds(&moved));
    // Nothing listens next to the old name any more: only the new one
    // gets the connection.
    let (_listener, mut host) =
        guest_connection(&mut dev, &mut guest, &moved, 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(2, 4096);
    guest.send(&mut dev, pkt(OP_RW, 5000, 52), b"moved");
    assert_eq!(read_timeout(&mut host, 5), b"moved");
    assert!(
        UnixStream::connect(uds(&moved)).is_ok(),
        "the listener moved"
    );
}

#[test]
fn test_vsock_guest_connect_without_listener_gets_rst() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(4, 4096);

    guest.send(&mut dev, pkt(OP_REQUEST, 5000, 53), &[]);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RST]);
    assert_eq!(
        (pkts[0].0.src_port, pkts[0].0.dst_port, pkts[0].0.dst_cid),
        (53, 5000, GUEST_CID)
    );
    assert_eq!(dev.muxer.connection_count(), 0);
}

#[test]
fn test_vsock_guest_duplicate_request_resets_connection() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, mut host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(2, 4096);

    guest.send(&mut dev, pkt(OP_REQUEST, 5000, 52), &[]);

    assert_eq!(ops(&guest.recv()), [OP_RST]);
    assert_host_eof(&mut host);
}

// ---------------------------------------------------------------------------
// Shutdown and reset.

#[test]
fn test_vsock_guest_shutdown_both_rsts_and_closes_host() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, mut host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(2, 4096);
    guest.send(&mut dev, pkt(OP_RW, 5000, 52), b"last");

    let mut shut = pkt(OP_SHUTDOWN, 5000, 52);
    shut.flags = SHUTDOWN_BOTH;
    guest.send(&mut dev, shut, &[]);

    assert_eq!(ops(&guest.recv()), [OP_RST]);
    assert_eq!(read_timeout(&mut host, 4), b"last");
    assert_host_eof(&mut host);
    assert_eq!(dev.muxer.connection_count(), 0);
}

#[test]
fn test_vsock_guest_shutdown_send_half_closes_host() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, mut host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(2, 4096);

    let mut shut = pkt(OP_SHUTDOWN, 5000, 52);
    shut.flags = SHUTDOWN_SEND;
    guest.send(&mut dev, shut, &[]);
    assert_host_eof(&mut host);

    host.write_all(b"reply").expect("host still writes");
    pump_host(&mut dev);
    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RW]);
    assert_eq!(pkts[0].1, b"reply");
}

#[test]
fn test_vsock_guest_rw_after_shutdown_send_resets() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, _host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(2, 4096);
    let mut shut = pkt(OP_SHUTDOWN, 5000, 52);
    shut.flags = SHUTDOWN_SEND;
    guest.send(&mut dev, shut, &[]);

    guest.send(&mut dev, pkt(OP_RW, 5000, 52), b"more");

    assert_eq!(ops(&guest.recv()), [OP_RST]);
    assert_eq!(dev.muxer.connection_count(), 0);
}

#[test]
fn test_vsock_host_close_sends_shutdown_then_guest_rst_removes() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (mut client, local_port) = host_connection(&mut dev, &mut guest, 1234);

    client.write_all(b"bye").expect("write");
    drop(client);
    pump_host(&mut dev);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RW, OP_SHUTDOWN]);
    assert_eq!(pkts[0].1, b"bye");
    assert_eq!(pkts[1].0.flags, SHUTDOWN_BOTH);
    guest.send(&mut dev, pkt(OP_RST, 1234, local_port), &[]);
    assert_eq!(dev.muxer.connection_count(), 0);
}

#[test]
fn test_vsock_host_close_guest_silent_times_out_with_rst() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (client, _local_port) = host_connection(&mut dev, &mut guest, 1234);
    drop(client);
    pump_host(&mut dev);
    assert_eq!(ops(&guest.recv()), [OP_SHUTDOWN]);

    dev.muxer
        .process_timeouts(Instant::now() + Duration::from_secs(60));
    dev.process_queue(RXQ);

    assert_eq!(ops(&guest.recv()), [OP_RST]);
    assert_eq!(dev.muxer.connection_count(), 0);
}

#[test]
fn test_vsock_host_half_close_sends_shutdown_send() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(2, 4096);

    host.shutdown(std::net::Shutdown::Write).expect("shutdown");
    pump_host(&mut dev);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_SHUTDOWN]);
    assert_eq!(pkts[0].0.flags, SHUTDOWN_SEND);
    assert_eq!(dev.muxer.connection_count(), 1);
}

#[test]
fn test_vsock_guest_rst_closes_host_socket() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, mut host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);

    guest.send(&mut dev, pkt(OP_RST, 5000, 52), &[]);

    assert_host_eof(&mut host);
    assert!(guest.recv().is_empty());
    assert_eq!(dev.muxer.connection_count(), 0);
}

// ---------------------------------------------------------------------------
// Flow control.

#[test]
fn test_vsock_credit_small_buf_alloc_stops_rx_until_credit_update() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, mut host) = guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, 16);
    let sent: Vec<u8> = (0..100u8).collect();
    host.write_all(&sent).expect("write");
    guest.give_rx(8, 4096);

    pump_host(&mut dev);
    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RW, OP_CREDIT_REQUEST]);
    assert_eq!(pkts[0].1, &sent[..16]);
    pump_host(&mut dev);
    dev.process_queue(RXQ);
    assert!(guest.recv().is_empty(), "no credit, no data");

    let mut update = pkt(OP_CREDIT_UPDATE, 5000, 52);
    update.buf_alloc = 16;
    update.fwd_cnt = 16;
    guest.send(&mut dev, update, &[]);
    pump_host(&mut dev);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RW, OP_CREDIT_REQUEST]);
    assert_eq!(pkts[0].1, &sent[16..32]);
}

#[test]
fn test_vsock_credit_request_answered_with_update() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, _host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(2, 4096);

    guest.send(&mut dev, pkt(OP_CREDIT_REQUEST, 5000, 52), &[]);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_CREDIT_UPDATE]);
    assert_eq!(pkts[0].0.buf_alloc, CONN_BUF_SIZE);
}

#[test]
fn test_vsock_credit_forwarded_bytes_trigger_update() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, mut host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(2, 4096);

    let data = vec![0x5a; 60_000];
    guest.send(&mut dev, pkt(OP_RW, 5000, 52), &data);

    assert_eq!(read_timeout(&mut host, data.len()), data);
    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_CREDIT_UPDATE]);
    assert_eq!(pkts[0].0.fwd_cnt, 60_000);
}

/// Sends 32 KiB packets (each within credit when sent on an empty buffer)
/// until the host socket is full and the device buffers: returns the bytes
/// sent.
fn fill_host_socket(dev: &mut Vsock, guest: &mut Guest<'_>) -> usize {
    let chunk = vec![0xa5; 32 * 1024];
    let mut sent = 0;
    for _ in 0..256 {
        guest.send(dev, pkt(OP_RW, 5000, 52), &chunk);
        sent += chunk.len();
        if dev.host_fds().iter().any(|&(_, ev)| ev & EPOLLOUT != 0) {
            return sent;
        }
    }
    panic!("host socket never filled");
}

#[test]
fn test_vsock_slow_host_reader_polls_epollout_then_credits() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, mut host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    let sent = fill_host_socket(&mut dev, &mut guest);

    host.set_nonblocking(true).expect("nonblocking");
    let mut received = 0;
    let mut buf = vec![0; 64 * 1024];
    for _ in 0..1000 {
        match host.read(&mut buf) {
            Ok(n) => received += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => pump_host(&mut dev),
            Err(e) => panic!("host read: {e}"),
        }
        if received == sent {
            break;
        }
    }
    assert_eq!(received, sent);
    guest.give_rx(2, 4096);
    dev.process_queue(RXQ);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_CREDIT_UPDATE]);
    assert_eq!(pkts[0].0.fwd_cnt as usize, sent);
    assert!(dev.host_fds().iter().all(|&(_, ev)| ev & EPOLLOUT == 0));
}

#[test]
fn test_vsock_credit_guest_overrun_resets() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_listener, _host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    fill_host_socket(&mut dev, &mut guest);
    guest.give_rx(4, 4096);

    let flood = vec![0u8; CONN_BUF_SIZE as usize];
    guest.send(&mut dev, pkt(OP_RW, 5000, 52), &flood);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts).last(), Some(&OP_RST));
    assert_eq!(dev.muxer.connection_count(), 0);
}

// ---------------------------------------------------------------------------
// Hostile guest.

/// A device with one established guest connection (5000 -> 52) and RX
/// buffers available.
fn established<'a>(
    mem: &'a GuestMemoryMmap,
    dir: &Path,
) -> (Vsock, Guest<'a>, UnixListener, UnixStream) {
    let mut guest = Guest::new(mem);
    let (mut dev, _irq) = activated_device(mem, &guest, dir);
    let (listener, host) = guest_connection(&mut dev, &mut guest, dir, 52, 5000, CONN_BUF_SIZE);
    guest.give_rx(8, 4096);
    (dev, guest, listener, host)
}

/// The device still serves: a request to a port nobody listens on is
/// answered with an RST.
fn assert_still_serving(dev: &mut Vsock, guest: &mut Guest<'_>) {
    guest.give_rx(1, 4096);
    guest.send(dev, pkt(OP_REQUEST, 6000, 4444), &[]);
    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RST]);
    assert_eq!(pkts[0].0.dst_port, 6000);
}

#[test]
fn test_vsock_tx_len_beyond_chain_resets_stream() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut dev, mut guest, _l, mut host) = established(&mem, dir.path());
    let mut hdr = pkt(OP_RW, 5000, 52);
    hdr.len = 100;

    guest.send_with_len(&mut dev, hdr, b"only ten b");

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RST]);
    assert_eq!((pkts[0].0.src_port, pkts[0].0.dst_port), (52, 5000));
    assert_host_eof(&mut host);
    assert!(guest.tx.used().iter().all(|&(_, len)| len == 0));
    assert_still_serving(&mut dev, &mut guest);
}

#[test]
fn test_vsock_tx_len_beyond_max_packet_rsts() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(2, 4096);
    let big = vec![1u8; MAX_PKT_SIZE + 1];

    guest.send(&mut dev, pkt(OP_RW, 5000, 52), &big);

    assert_eq!(ops(&guest.recv()), [OP_RST]);
    assert_still_serving(&mut dev, &mut guest);
}

#[test]
fn test_vsock_tx_unknown_op_resets_stream() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut dev, mut guest, _l, mut host) = established(&mem, dir.path());

    guest.send(&mut dev, pkt(42, 5000, 52), &[]);

    assert_eq!(ops(&guest.recv()), [OP_RST]);
    assert_host_eof(&mut host);
    assert_still_serving(&mut dev, &mut guest);
}

#[test]
fn test_vsock_tx_unknown_connection_rsts() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(2, 4096);

    guest.send(&mut dev, pkt(OP_RW, 7000, 70), b"stray");
    guest.send(&mut dev, pkt(OP_RST, 7000, 70), &[]);

    assert_eq!(ops(&guest.recv()), [OP_RST], "an RST is never answered");
}

#[test]
fn test_vsock_tx_seqpacket_type_rsts() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let _listener = UnixListener::bind(dir.path().join("vsock_52")).expect("bind");
    guest.give_rx(2, 4096);
    let mut req = pkt(OP_REQUEST, 5000, 52);
    req.type_ = 2;

    guest.send(&mut dev, req, &[]);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_RST]);
    assert_eq!(pkts[0].0.type_, 2);
    assert_eq!(dev.muxer.connection_count(), 0);
}

#[test]
fn test_vsock_tx_wrong_dst_cid_rsts() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let _listener = UnixListener::bind(dir.path().join("vsock_52")).expect("bind");
    guest.give_rx(2, 4096);
    let mut req = pkt(OP_REQUEST, 5000, 52);
    req.dst_cid = 7;

    guest.send(&mut dev, req, &[]);

    assert_eq!(ops(&guest.recv()), [OP_RST]);
    assert_eq!(dev.muxer.connection_count(), 0);
}

#[test]
fn test_vsock_tx_spoofed_src_cid_dropped() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let _listener = UnixListener::bind(dir.path().join("vsock_52")).expect("bind");
    guest.give_rx(2, 4096);
    let mut req = pkt(OP_REQUEST, 5000, 52);
    req.src_cid = 4;

    guest.send(&mut dev, req, &[]);

    assert!(guest.recv().is_empty());
    assert_eq!(guest.tx.used(), [(0, 0)]);
    assert_eq!(dev.muxer.connection_count(), 0);
    assert_still_serving(&mut dev, &mut guest);
}

#[test]
fn test_vsock_tx_descriptor_outside_ram_dropped() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(2, 4096);

    guest.send_raw(&mut dev, &[(MEM_END - 16, HDR_SIZE as u32, false)]);
    guest.send_raw(&mut dev, &[(u64::MAX - 8, HDR_SIZE as u32, false)]);

    assert_eq!(guest.tx.used(), [(0, 0), (1, 0)]);
    assert!(guest.recv().is_empty());
    assert_still_serving(&mut dev, &mut guest);
}

#[test]
fn test_vsock_tx_write_only_chain_dropped() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(2, 4096);
    mem.write_slice(
        &pkt(OP_REQUEST, 5000, 4444).to_bytes(),
        GuestAddress(TX_HDR),
    )
    .expect("write");

    guest.send_raw(&mut dev, &[(TX_HDR, HDR_SIZE as u32, true)]);

    assert_eq!(guest.tx.used(), [(0, 0)]);
    assert!(guest.recv().is_empty());
    assert_still_serving(&mut dev, &mut guest);
}

#[test]
fn test_vsock_tx_truncated_header_dropped() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(2, 4096);
    mem.write_slice(
        &pkt(OP_REQUEST, 5000, 4444).to_bytes(),
        GuestAddress(TX_HDR),
    )
    .expect("write");

    guest.send_raw(&mut dev, &[(TX_HDR, 20, false)]);

    assert!(guest.recv().is_empty());
    assert_still_serving(&mut dev, &mut guest);
}

#[test]
fn test_vsock_tx_header_split_across_descriptors_accepted() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_rx(2, 4096);
    mem.write_slice(
        &pkt(OP_REQUEST, 5000, 4444).to_bytes(),
        GuestAddress(TX_HDR),
    )
    .expect("write");

    guest.send_raw(
        &mut dev,
        &[
            (TX_HDR, 10, false),
            (TX_HDR + 10, HDR_SIZE as u32 - 10, false),
        ],
    );

    assert_eq!(ops(&guest.recv()), [OP_RST]);
}

#[test]
fn test_vsock_rx_unusable_buffers_skipped() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let _client = connect_client(&mut dev, &uds(dir.path()), b"CONNECT 5\n");
    let good = guest.alloc(4096);
    let ro = guest.alloc(4096);
    let short = guest.alloc(16);
    guest.rx.add_chain(&[(ro, 4096, false)]);
    guest.rx.add_chain(&[(short, 16, true)]);
    guest.rx.add_chain(&[(MEM_END - 8, 4096, true)]);
    guest.rx.add_chain(&[(good, 4096, true)]);

    dev.process_queue(RXQ);

    let raw = guest.recv_raw();
    let lens: Vec<u32> = raw.iter().map(|r| r.0).collect();
    assert_eq!(lens, [0, 0, 0, HDR_SIZE as u32]);
    let mut hdr = [0u8; HDR_SIZE];
    hdr.copy_from_slice(&raw[3].1);
    assert_eq!(PacketHeader::from_bytes(&hdr).op, OP_REQUEST);
}

#[test]
fn test_vsock_rx_header_only_buffer_carries_credit_not_data() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (_l, mut host) =
        guest_connection(&mut dev, &mut guest, dir.path(), 52, 5000, CONN_BUF_SIZE);
    let tiny = guest.alloc(HDR_SIZE as u32);
    guest.rx.add_chain(&[(tiny, HDR_SIZE as u32, true)]);
    guest.give_rx(1, 4096);

    host.write_all(b"data").expect("write");
    pump_host(&mut dev);

    let pkts = guest.recv();
    assert_eq!(ops(&pkts), [OP_CREDIT_UPDATE, OP_RW]);
    assert_eq!(pkts[1].1, b"data");
}

#[test]
fn test_vsock_process_queue_before_activation_ignored() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut dev = Vsock::new(GUEST_CID, uds(dir.path())).expect("device");

    for q in 0..4 {
        dev.process_queue(q);
    }
    dev.prepare_snapshot();

    assert!(!dev.common.is_activated());
}

// ---------------------------------------------------------------------------
// Snapshot.

fn vsock_state(dev: &Vsock) -> VsockState {
    match VirtioDevice::save(dev) {
        VirtioDeviceState::Vsock(state) => state,
        other => panic!("unexpected state {other:?}"),
    }
}

#[test]
fn test_vsock_prepare_snapshot_queues_reset_and_closes_hosts() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_event_buf();
    dev.process_queue(EVQ);
    let (mut client, _) = host_connection(&mut dev, &mut guest, 1234);

    dev.prepare_snapshot();

    assert_eq!(guest.events(), [EVENT_TRANSPORT_RESET]);
    assert_host_eof(&mut client);
    assert_eq!(dev.muxer.connection_count(), 0);
    assert_eq!(
        vsock_state(&dev).transport_reset,
        TransportResetState::Delivered
    );
}

#[test]
fn test_vsock_snapshot_roundtrip_saved_states_equal() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_event_buf();
    let (_client, local_port) = host_connection(&mut dev, &mut guest, 1234);
    dev.prepare_snapshot();
    let state = vsock_state(&dev);
    let json = serde_json::to_string(&VirtioDeviceState::Vsock(state.clone())).expect("ser");
    drop(dev);

    let VirtioDeviceState::Vsock(loaded) = serde_json::from_str(&json).expect("de") else {
        panic!("wrong variant");
    };
    let mut restored = Vsock::restore(VsockConstructorArgs::default(), &loaded).expect("restore");
    let irq = Arc::new(IrqTrigger::new().expect("irq"));
    restored
        .activate(mem.clone(), irq.clone())
        .expect("activate");

    assert_eq!(<Vsock as Persist>::save(&restored), state);
    assert!(state.next_local_port > local_port);
    assert_eq!(state.uds_path, uds(dir.path()));
    assert_ne!(
        irq.status() & VIRTIO_MMIO_INT_VRING,
        0,
        "event queue kicked"
    );
    assert_eq!(guest.events(), [EVENT_TRANSPORT_RESET]);
}

#[test]
fn test_vsock_restore_override_path_gates_rx_until_reset_acked() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    guest.give_event_buf();
    dev.prepare_snapshot();
    let state = vsock_state(&dev);
    let new_path = dir.path().join("restored");

    let args = VsockConstructorArgs {
        uds_path: Some(new_path.clone()),
    };
    let mut restored = Vsock::restore(args, &state).expect("restore");
    restored
        .activate(mem.clone(), Arc::new(IrqTrigger::new().expect("irq")))
        .expect("activate");
    guest.give_rx(2, 4096);
    let _client = connect_client(&mut restored, &new_path, b"CONNECT 5\n");
    assert!(guest.recv().is_empty(), "RX held until the reset is acked");
    assert_eq!(guest.events(), [EVENT_TRANSPORT_RESET]);
    guest.give_event_buf();
    restored.process_queue(EVQ);

    assert_eq!(ops(&guest.recv()), [OP_REQUEST]);
    assert_eq!(vsock_state(&restored).uds_path, new_path);
}

#[test]
fn test_vsock_snapshot_without_event_buffer_delivers_at_restore() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    dev.prepare_snapshot();
    let state = vsock_state(&dev);
    assert_eq!(state.transport_reset, TransportResetState::Pending);
    drop(dev);

    let mut restored = Vsock::restore(VsockConstructorArgs::default(), &state).expect("restore");
    guest.give_event_buf();
    restored
        .activate(mem.clone(), Arc::new(IrqTrigger::new().expect("irq")))
        .expect("activate");

    assert_eq!(guest.events(), [EVENT_TRANSPORT_RESET]);
    assert_eq!(
        vsock_state(&restored).transport_reset,
        TransportResetState::Delivered
    );
}

#[test]
fn test_vsock_restore_unactivated_keeps_idle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut dev = Vsock::new(GUEST_CID, uds(dir.path())).expect("device");
    dev.prepare_snapshot();
    let state = vsock_state(&dev);
    drop(dev);

    let restored = Vsock::restore(VsockConstructorArgs::default(), &state).expect("restore");

    assert_eq!(<Vsock as Persist>::save(&restored), state);
    assert_eq!(state.transport_reset, TransportResetState::Idle);
}

#[test]
fn test_vsock_restore_wrong_queue_count_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dev = Vsock::new(GUEST_CID, uds(dir.path())).expect("device");
    let mut state = vsock_state(&dev);
    drop(dev);
    state.common.queues.pop();

    assert!(matches!(
        Vsock::restore(VsockConstructorArgs::default(), &state),
        Err(VsockPersistError::QueueCount(2))
    ));
}

#[test]
fn test_vsock_reset_drops_connections_keeps_listener() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    let (mut client, _) = host_connection(&mut dev, &mut guest, 1234);

    VirtioDevice::reset(&mut dev);

    assert_host_eof(&mut client);
    assert!(!dev.common.is_activated());
    assert!(UnixStream::connect(uds(dir.path())).is_ok());
}

#[test]
fn test_vsock_host_fds_lists_listener_and_connections() {
    let mem = test_memory();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut guest = Guest::new(&mem);
    let (mut dev, _irq) = activated_device(&mem, &guest, dir.path());
    assert_eq!(dev.host_fds().len(), 2, "listener and timer");

    let (_client, _) = host_connection(&mut dev, &mut guest, 1234);

    let fds: Vec<RawFd> = dev.host_fds().iter().map(|f| f.0).collect();
    assert_eq!(fds.len(), 3);
}
