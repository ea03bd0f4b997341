//! The Unix-socket backend: multiplexes guest vsock connections onto host
//! Unix sockets, using Firecracker's hybrid vsock convention.
//!
//! - Host-initiated: a client connects to the listener at `uds_path` and
//!   writes `CONNECT <port>\n`; the muxer sends the guest a REQUEST from a
//!   fresh host port, and on the guest's RESPONSE the client reads
//!   `OK <host_port>\n` followed by the stream. An RST from the guest, a
//!   malformed line or a timeout closes the client.
//! - Guest-initiated: a REQUEST to host port `P` connects to
//!   `<uds_path>_P`; if nothing listens there the guest gets an RST.
//!
//! Everything is non-blocking and driven from the VMM's event loop: the
//! listener, the clients still writing their `CONNECT` line, the connection
//! sockets and a timer for handshake and shutdown deadlines are all exposed
//! through [`Muxer::host_fds`].

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm_sys_util::timerfd::TimerFd;

use super::connection::{Connection, Verdict};
use super::packet::*;
use super::{VsockError, MAX_PKT_SIZE};

/// Most connections (established, in handshake, or clients still sending
/// their `CONNECT` line) the device keeps open at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// Longest accepted `CONNECT <port>\n` line.
pub const MAX_CONNECT_LINE: usize = 32;
/// Most RSTs for unknown connections queued toward the guest. Beyond
/// [`RST_QUEUE_TX_PAUSE`] the device stops taking TX packets until the guest
/// makes RX buffers available, so a guest cannot grow this queue.
const RST_QUEUE_MAX: usize = 2 * MAX_CONNECTIONS;
const RST_QUEUE_TX_PAUSE: usize = MAX_CONNECTIONS;
/// How long the listener is left alone after `accept` failed (typically
/// out of file descriptors), so that its pending readiness does not spin
/// the event loop.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// First host port handed out to host-initiated connections.
pub const FIRST_LOCAL_PORT: u32 = 1 << 30;

const EPOLLIN: u32 = libc::EPOLLIN as u32;

/// (host port, guest port).
type ConnKey = (u32, u32);

#[derive(Debug)]
struct PendingClient {
    stream: UnixStream,
    line: Vec<u8>,
}

/// The host side of the vsock device.
#[derive(Debug)]
pub struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    timer: TimerFd,
    timer_deadline: Option<Instant>,
    /// Set while the listener is not polled after a failed `accept`.
    accept_resume_at: Option<Instant>,
    clients: HashMap<RawFd, PendingClient>,
    conns: HashMap<ConnKey, Connection>,
    fd_to_key: HashMap<RawFd, ConnKey>,
    rxq: VecDeque<ConnKey>,
    rst_queue: VecDeque<PacketHeader>,
    next_local_port: u32,
    max_connections: usize,
    scratch: Vec<u8>,
}

impl Muxer {
    /// Listens on `uds_path`, replacing a stale socket file there.
    pub fn new(
        guest_cid: u64,
        uds_path: PathBuf,
        next_local_port: u32,
    ) -> Result<Self, VsockError> {
        remove_stale_socket(&uds_path)?;
        let listener = UnixListener::bind(&uds_path).map_err(|source| VsockError::Bind {
            path: uds_path.clone(),
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| VsockError::Bind {
                path: uds_path.clone(),
                source,
            })?;
        let timer = TimerFd::new().map_err(|e| VsockError::Timer(e.into()))?;
        Ok(Self {
            guest_cid,
            uds_path,
            listener,
            timer,
            timer_deadline: None,
            accept_resume_at: None,
            clients: HashMap::new(),
            conns: HashMap::new(),
            fd_to_key: HashMap::new(),
            rxq: VecDeque::new(),
            rst_queue: VecDeque::new(),
            next_local_port: next_local_port.max(FIRST_LOCAL_PORT),
            max_connections: MAX_CONNECTIONS,
            scratch: vec![0; MAX_PKT_SIZE],
        })
    }

    /// The path the listener is bound to.
    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// The listener's socket file was moved to `path` (its open socket
    /// goes on listening there): guest connections to host port P go to
    /// `<path>_P` from now on.
    pub fn set_uds_path(&mut self, path: PathBuf) {
        self.uds_path = path;
    }

    /// The next host port a host-initiated connection will try.
    pub fn next_local_port(&self) -> u32 {
        self.next_local_port
    }

    /// Lowers the connection limit (tests).
    #[cfg(test)]
    pub fn set_max_connections(&mut self, max: usize) {
        self.max_connections = max.min(MAX_CONNECTIONS);
    }

    /// Number of open connections, clients in handshake included.
    pub fn connection_count(&self) -> usize {
        self.conns.len() + self.clients.len()
    }

    /// File descriptors to poll and the events wanted on each. Connection
    /// sockets with nothing to wait for are listed with no events, so that
    /// EPOLLHUP/EPOLLERR still arrive; after a hang-up they are left out.
    pub fn host_fds(&self) -> Vec<(RawFd, u32)> {
        let mut fds = Vec::with_capacity(2 + self.clients.len() + self.conns.len());
        if self.accept_resume_at.is_none() {
            fds.push((self.listener.as_raw_fd(), EPOLLIN));
        }
        fds.push((self.timer.as_raw_fd(), EPOLLIN));
        fds.extend(self.clients.keys().map(|&fd| (fd, EPOLLIN)));
        fds.extend(
            self.conns
                .values()
                .filter(|c| c.pollable())
                .map(|c| (c.fd(), c.interest())),
        );
        fds
    }

    /// Handles `events` on `fd`, one of [`Muxer::host_fds`]. Stale fds are
    /// ignored.
    pub fn handle_event(&mut self, fd: RawFd, events: u32, now: Instant) {
        if fd == self.listener.as_raw_fd() {
            self.accept_clients();
        } else if fd == self.timer.as_raw_fd() {
            // The expiry is not read: re-arming or disarming the timer in
            // `sync_timer` resets it, and a read could block if it raced
            // with a re-arm.
            self.process_timeouts(now);
            self.apply_timer();
            return;
        } else if self.clients.contains_key(&fd) {
            self.read_connect_line(fd, now);
        } else if let Some(&key) = self.fd_to_key.get(&fd) {
            if let Some(conn) = self.conns.get_mut(&key) {
                let verdict = conn.host_event(events, now);
                self.apply(key, verdict);
            }
        }
        self.sync_timer();
    }

    /// Resets every connection whose deadline passed, and resumes
    /// accepting clients after a back-off.
    pub fn process_timeouts(&mut self, now: Instant) {
        if self.accept_resume_at.is_some_and(|t| t <= now) {
            self.accept_resume_at = None;
        }
        let expired: Vec<ConnKey> = self
            .conns
            .iter()
            .filter(|(_, c)| c.expired(now))
            .map(|(&k, _)| k)
            .collect();
        for key in expired {
            self.remove(key, true);
        }
    }

    /// Handles a packet the guest sent. The device already checked that it
    /// comes from the guest's CID and that `data` holds `hdr.len` bytes.
    pub fn send_pkt(&mut self, hdr: &PacketHeader, data: &[u8], now: Instant) {
        if hdr.type_ != TYPE_STREAM || hdr.dst_cid != HOST_CID {
            self.reply_rst(hdr);
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        if hdr.op == OP_REQUEST && self.conns.contains_key(&key) {
            // The guest lost track of this connection: drop ours too.
            self.remove(key, false);
            self.reply_rst(hdr);
        } else if let Some(conn) = self.conns.get_mut(&key) {
            let verdict = conn.send_pkt(hdr, data, now);
            self.apply(key, verdict);
        } else if hdr.op == OP_REQUEST {
            self.connect_to_host(hdr);
        } else {
            self.reply_rst(hdr);
        }
    }

    /// Handles a packet whose header is malformed (length out of bounds):
    /// the stream it belongs to lost data, so it is reset.
    pub fn reject_pkt(&mut self, hdr: &PacketHeader) {
        let key = (hdr.dst_port, hdr.src_port);
        if hdr.dst_cid == HOST_CID && self.conns.contains_key(&key) {
            self.remove(key, true);
        } else {
            self.reply_rst(hdr);
        }
    }

    /// Whether packets wait for guest RX buffers.
    pub fn has_pending_rx(&self) -> bool {
        !self.rst_queue.is_empty() || !self.rxq.is_empty()
    }

    /// Whether TX processing should pause until the guest drains RX.
    pub fn rx_backlogged(&self) -> bool {
        self.rst_queue.len() >= RST_QUEUE_TX_PAUSE
    }

    /// Writes the next packet for the guest into `writer`, an RX buffer of
    /// at least [`HDR_SIZE`] bytes. Returns the bytes written, or `None` if
    /// nothing was pending (the buffer is then untouched).
    pub fn recv_pkt<W: Write>(
        &mut self,
        header: &mut W,
        data: &mut W,
        data_room: usize,
        now: Instant,
    ) -> Option<u32> {
        loop {
            if let Some(hdr) = self.rst_queue.pop_front() {
                return Some(write_header(header, &hdr));
            }
            let key = self.rxq.pop_front()?;
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            conn.in_rxq = false;
            match conn.recv_pkt(data, data_room, &mut self.scratch, now) {
                Ok(Some(hdr)) => {
                    let written = write_header(header, &hdr);
                    self.enqueue_rx(key);
                    return Some(written.saturating_add(hdr.len));
                }
                Ok(None) => {}
                // The RST is queued and goes into this same buffer.
                Err(()) => self.remove(key, true),
            }
        }
    }

    /// Drops every connection and queued packet (device reset or snapshot);
    /// the listener stays.
    pub fn reset(&mut self) {
        self.conns.clear();
        self.fd_to_key.clear();
        self.clients.clear();
        self.rxq.clear();
        self.rst_queue.clear();
        self.sync_timer();
    }

    /// Arms the timer for the earliest deadline, or disarms it.
    pub fn sync_timer(&mut self) {
        if self.next_deadline() != self.timer_deadline {
            self.apply_timer();
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.conns
            .values()
            .filter_map(Connection::deadline)
            .chain(self.accept_resume_at)
            .min()
    }

    /// Programs the timer unconditionally, which also clears a pending
    /// expiry.
    fn apply_timer(&mut self) {
        let next = self.next_deadline();
        let result = match next {
            Some(deadline) => {
                let wait = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                self.timer.reset(wait, None)
            }
            None => self.timer.clear(),
        };
        // If the timer cannot be armed the deadlines are still enforced on
        // the next event that reaches the muxer.
        self.timer_deadline = if result.is_ok() { next } else { None };
    }

    fn apply(&mut self, key: ConnKey, verdict: Verdict) {
        match verdict {
            Verdict::Keep => self.enqueue_rx(key),
            Verdict::Close => self.remove(key, false),
            Verdict::Reset => self.remove(key, true),
        }
    }

    fn enqueue_rx(&mut self, key: ConnKey) {
        if let Some(conn) = self.conns.get_mut(&key) {
            if conn.has_pending_rx() && !conn.in_rxq {
                conn.in_rxq = true;
                self.rxq.push_back(key);
            }
        }
    }

    /// Closes the host socket; tells the guest with an RST if it knows
    /// about the connection and `rst` is set.
    fn remove(&mut self, key: ConnKey, rst: bool) {
        if let Some(conn) = self.conns.remove(&key) {
            self.fd_to_key.remove(&conn.fd());
            // A file descriptor was freed: accepting may work again.
            self.accept_resume_at = None;
            if rst && conn.guest_knows() {
                self.push_rst(conn.rst_header());
            }
        }
    }

    fn push_rst(&mut self, hdr: PacketHeader) {
        // Past the bound the RST is dropped; the guest gets another one
        // when it next uses the connection.
        if self.rst_queue.len() < RST_QUEUE_MAX {
            self.rst_queue.push_back(hdr);
        }
    }

    fn reply_rst(&mut self, hdr: &PacketHeader) {
        if hdr.op != OP_RST {
            self.push_rst(hdr.rst_reply());
        }
    }

    fn accept_clients(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.connection_count() >= self.max_connections
                        || stream.set_nonblocking(true).is_err()
                    {
                        continue; // Dropping the stream closes it.
                    }
                    self.clients.insert(
                        stream.as_raw_fd(),
                        PendingClient {
                            stream,
                            line: Vec::new(),
                        },
                    );
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => {
                    // Out of file descriptors, say: the pending connection
                    // keeps the listener readable, so stop polling it.
                    self.accept_resume_at = Some(Instant::now() + ACCEPT_BACKOFF);
                    return;
                }
            }
        }
    }

    /// Reads the client's `CONNECT <port>\n` one byte at a time, so that
    /// bytes after the line stay in the socket for the guest.
    fn read_connect_line(&mut self, fd: RawFd, now: Instant) {
        let Some(client) = self.clients.get_mut(&fd) else {
            return;
        };
        loop {
            let mut byte = [0u8; 1];
            match client.stream.read(&mut byte) {
                Ok(0) => break,
                Ok(_) if byte[0] == b'\n' => {
                    let port = parse_connect_line(&client.line);
                    if let (Some(port), Some(client)) = (port, self.clients.remove(&fd)) {
                        self.connect_to_guest(client.stream, port, now);
                        return;
                    }
                    break;
                }
                Ok(_) => {
                    client.line.push(byte[0]);
                    if client.line.len() >= MAX_CONNECT_LINE {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => break,
            }
        }
        // End of file, error or malformed line: close the client.
        self.clients.remove(&fd);
    }

    fn connect_to_guest(&mut self, stream: UnixStream, peer_port: u32, now: Instant) {
        let Some(local_port) = self.allocate_local_port() else {
            return;
        };
        let conn = Connection::new_local(stream, self.guest_cid, local_port, peer_port, now);
        let key = (local_port, peer_port);
        self.fd_to_key.insert(conn.fd(), key);
        self.conns.insert(key, conn);
        self.enqueue_rx(key);
    }

    fn allocate_local_port(&mut self) -> Option<u32> {
        // At most MAX_CONNECTIONS ports are taken, so this ends quickly.
        for _ in 0..=MAX_CONNECTIONS {
            let port = self.next_local_port;
            self.next_local_port = port.checked_add(1).unwrap_or(FIRST_LOCAL_PORT);
            if !self.conns.keys().any(|&(local, _)| local == port) {
                return Some(port);
            }
        }
        None
    }

    fn connect_to_host(&mut self, hdr: &PacketHeader) {
        if self.connection_count() >= self.max_connections {
            self.reply_rst(hdr);
            return;
        }
        let mut path = OsString::from(self.uds_path.as_os_str());
        path.push(format!("_{}", hdr.dst_port));
        match connect_nonblocking(Path::new(&path)) {
            Ok(stream) => {
                let conn = Connection::new_peer(stream, self.guest_cid, hdr);
                let key = (hdr.dst_port, hdr.src_port);
                self.fd_to_key.insert(conn.fd(), key);
                self.conns.insert(key, conn);
                self.enqueue_rx(key);
            }
            Err(_) => self.reply_rst(hdr),
        }
    }
}

fn write_header<W: Write>(w: &mut W, hdr: &PacketHeader) -> u32 {
    // The buffer was checked to hold a header; a failure here means the
    // guest gets a zero-length (ignored) buffer.
    match w.write_all(&hdr.to_bytes()) {
        Ok(()) => HDR_SIZE as u32,
        Err(_) => 0,
    }
}

/// Parses `CONNECT <port>` (the newline already stripped).
fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let line = std::str::from_utf8(line).ok()?;
    let line = line.strip_suffix('\r').unwrap_or(line);
    let port = line.strip_prefix("CONNECT ")?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    port.parse().ok()
}

fn remove_stale_socket(path: &Path) -> Result<(), VsockError> {
    match std::fs::symlink_metadata(path) {
        // Only a socket is replaced: anything else at the path is an error
        // the bind reports, never silently deleted.
        Ok(meta) if meta.file_type().is_socket() => {
            std::fs::remove_file(path).map_err(|source| VsockError::RemoveStale {
                path: path.to_path_buf(),
                source,
            })
        }
        _ => Ok(()),
    }
}

/// Connects to a Unix socket without blocking: if the listener's backlog is
/// full this fails with `EAGAIN` instead of stalling the event loop (std's
/// `UnixStream::connect` would block).
fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    let mut addr = libc::sockaddr_un {
        sun_family: libc::AF_UNIX as libc::sa_family_t,
        sun_path: [0; 108],
    };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::from(ErrorKind::InvalidInput));
    }
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    // SAFETY: socket() takes no pointers; the result is checked below.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a socket we just created and nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid, NUL-terminated sockaddr_un that lives
    // across the call, and `len` does not exceed its size.
    let ret = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast::<libc::sockaddr>(),
            len as libc::socklen_t,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_connect_line_valid_returns_port() {
        assert_eq!(parse_connect_line(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect_line(b"CONNECT 4294967295\r"), Some(u32::MAX));
    }

    #[test]
    fn test_parse_connect_line_malformed_returns_none() {
        for line in [
            &b"CONNECT"[..],
            b"CONNECT ",
            b"CONNECT x",
            b"CONNECT +5",
            b"CONNECT 4294967296",
            b"connect 5",
            b"CONNECT  5",
            b"\xff\xfe",
        ] {
            assert_eq!(parse_connect_line(line), None, "{line:?}");
        }
    }

    #[test]
    fn test_connect_nonblocking_full_backlog_fails_fast() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sock");
        // A listener that never accepts; fill its backlog.
        let _listener = UnixListener::bind(&path).expect("bind");
        let mut held = Vec::new();
        let err = loop {
            match connect_nonblocking(&path) {
                Ok(stream) => held.push(stream),
                Err(e) => break e,
            }
            assert!(held.len() < 100_000, "backlog never filled");
        };
        assert_eq!(err.kind(), ErrorKind::WouldBlock);
    }

    #[test]
    fn test_connect_nonblocking_missing_path_fails() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(connect_nonblocking(&dir.path().join("absent")).is_err());
    }

    #[test]
    fn test_timer_rearm_clears_readiness() {
        // The muxer never reads its timer: it relies on re-arming or
        // disarming to reset the expiry count. Check the kernel does so.
        let mut timer = TimerFd::new().expect("timer");
        timer.reset(Duration::from_millis(1), None).expect("arm");
        std::thread::sleep(Duration::from_millis(20));
        assert!(poll_readable(timer.as_raw_fd()));
        timer.clear().expect("disarm");
        assert!(!poll_readable(timer.as_raw_fd()));
    }

    fn poll_readable(fd: RawFd) -> bool {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        let ret = unsafe { libc::poll(&mut pfd, 1, 0) };
        ret == 1 && pfd.revents & libc::POLLIN != 0
    }
}
