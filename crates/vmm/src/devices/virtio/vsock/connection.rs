//! One vsock stream: a guest (peer) port paired with a host Unix socket.
//!
//! The connection is a passive state machine driven by three inputs:
//! packets from the guest ([`Connection::send_pkt`]), readiness of the host
//! socket ([`Connection::host_event`]) and free guest RX buffers
//! ([`Connection::recv_pkt`]). Each input returns a [`Verdict`] telling the
//! muxer whether the connection lives on.
//!
//! Flow control (virtio spec 5.10.6.3). Each side advertises `buf_alloc`
//! (receive space) and `fwd_cnt` (bytes consumed so far) in every packet.
//! - Guest to host: our receive space is `to_host`, a buffer of at most
//!   [`CONN_BUF_SIZE`] guest bytes that the host socket has not accepted yet.
//!   `fwd_cnt` counts guest bytes written to the host socket. A guest that
//!   sends more than its credit overruns the buffer and is reset.
//! - Host to guest: we read from the host socket only as much as
//!   `peer_buf_alloc - (tx_cnt - peer_fwd_cnt)` allows, straight into a guest
//!   RX buffer, so no host data is ever held here. Without credit the socket is
//!   not polled for input and a CREDIT_REQUEST is sent once.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::packet::*;
use super::MAX_PKT_SIZE;

/// Receive space per connection for guest-to-host bytes (our `buf_alloc`).
pub const CONN_BUF_SIZE: u32 = 64 * 1024;
/// Send a credit update when the guest believes we have less free space
/// than this and we have forwarded bytes it has not heard about.
pub const CREDIT_UPDATE_THRESHOLD: u32 = 16 * 1024;
/// How long a host-initiated connection waits for the guest's RESPONSE.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a closing connection waits for the final RST or for its buffered
/// bytes to drain.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);

const EPOLLIN: u32 = libc::EPOLLIN as u32;
const EPOLLOUT: u32 = libc::EPOLLOUT as u32;
const EPOLLHUP: u32 = libc::EPOLLHUP as u32;
const EPOLLERR: u32 = libc::EPOLLERR as u32;

// Packets waiting to be sent to the guest, in delivery order.
const PENDING_REQUEST: u8 = 1 << 0;
const PENDING_RESPONSE: u8 = 1 << 1;
const PENDING_RW: u8 = 1 << 2;
const PENDING_SHUTDOWN: u8 = 1 << 3;
const PENDING_CREDIT_REQUEST: u8 = 1 << 4;
const PENDING_CREDIT_UPDATE: u8 = 1 << 5;

/// What the muxer must do with a connection after an input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The connection lives on.
    Keep,
    /// Drop it silently: the guest already considers it closed.
    Close,
    /// Drop it and send the guest an RST.
    Reset,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Host-initiated, waiting for the guest's RESPONSE.
    LocalInit {
        /// The REQUEST reached the guest, so the guest knows the connection.
        request_sent: bool,
    },
    /// Handshake done (for guest-initiated connections, as soon as the host
    /// socket connected; the RESPONSE is then pending).
    Established,
}

/// A vsock connection and its host socket.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
    guest_cid: u64,
    local_port: u32,
    peer_port: u32,
    state: State,

    // Guest to host.
    to_host: VecDeque<u8>,
    /// Leading bytes of `to_host` that are not guest data (the `OK` line).
    to_host_prefix: usize,
    rx_cnt: Wrapping<u32>,
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    host_write_shut: bool,

    // Host to guest.
    tx_cnt: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    credit_request_sent: bool,
    /// Reading the host socket returned end of file.
    host_eof: bool,
    /// The host socket reported EPOLLHUP: the client closed both directions.
    host_hup: bool,

    /// SHUTDOWN flags the guest sent (ORed).
    peer_shut: u32,
    pending: u8,
    shutdown_flags: u32,
    deadline: Option<Instant>,
    /// Set while the muxer has this connection in its RX queue.
    pub in_rxq: bool,
}

impl Connection {
    fn new(stream: UnixStream, guest_cid: u64, local_port: u32, peer_port: u32) -> Self {
        Self {
            stream,
            guest_cid,
            local_port,
            peer_port,
            state: State::Established,
            to_host: VecDeque::new(),
            to_host_prefix: 0,
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            host_write_shut: false,
            tx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            credit_request_sent: false,
            host_eof: false,
            host_hup: false,
            peer_shut: 0,
            pending: 0,
            shutdown_flags: 0,
            deadline: None,
            in_rxq: false,
        }
    }

    /// A host-initiated connection: a REQUEST to the guest is pending.
    pub fn new_local(
        stream: UnixStream,
        guest_cid: u64,
        local_port: u32,
        peer_port: u32,
        now: Instant,
    ) -> Self {
        let mut conn = Self::new(stream, guest_cid, local_port, peer_port);
        conn.state = State::LocalInit {
            request_sent: false,
        };
        conn.pending = PENDING_REQUEST;
        conn.deadline = Some(now + REQUEST_TIMEOUT);
        conn
    }

    /// A guest-initiated connection whose host socket is connected: the
    /// RESPONSE to `request` is pending.
    pub fn new_peer(stream: UnixStream, guest_cid: u64, request: &PacketHeader) -> Self {
        let mut conn = Self::new(stream, guest_cid, request.dst_port, request.src_port);
        conn.peer_buf_alloc = request.buf_alloc;
        conn.peer_fwd_cnt = Wrapping(request.fwd_cnt);
        conn.pending = PENDING_RESPONSE;
        conn
    }

    /// The host socket.
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Whether the guest knows about this connection (and so must be told
    /// with an RST when it goes away).
    pub fn guest_knows(&self) -> bool {
        self.state
            != State::LocalInit {
                request_sent: false,
            }
    }

    /// The RST that tells the guest this connection is gone.
    pub fn rst_header(&self) -> PacketHeader {
        PacketHeader {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            type_: TYPE_STREAM,
            op: OP_RST,
            ..Default::default()
        }
    }

    /// Whether a packet for the guest is waiting for an RX buffer.
    pub fn has_pending_rx(&self) -> bool {
        self.pending != 0
    }

    /// When the connection must be reset if nothing else happens.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether the host socket should still be polled. After EPOLLHUP it
    /// must not be: the condition is level-triggered and would spin.
    pub fn pollable(&self) -> bool {
        !self.host_hup
    }

    /// The epoll events wanted on the host socket: input only when the
    /// guest can take data (credit, no read pending), output only while
    /// guest bytes wait in `to_host`.
    pub fn interest(&self) -> u32 {
        let mut events = 0;
        if self.can_read_host() && self.pending & PENDING_RW == 0 && self.peer_credit() > 0 {
            events |= EPOLLIN;
        }
        if !self.to_host.is_empty() {
            events |= EPOLLOUT;
        }
        events
    }

    /// Free space in the guest's receive buffer, as far as we know.
    fn peer_credit(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn can_read_host(&self) -> bool {
        self.state == State::Established && !self.host_eof && self.peer_shut & SHUTDOWN_RCV == 0
    }

    /// Handles a packet from the guest addressed to this connection.
    pub fn send_pkt(&mut self, hdr: &PacketHeader, data: &[u8], now: Instant) -> Verdict {
        if hdr.op == OP_RST {
            return Verdict::Close;
        }
        // Every packet carries the sender's credit.
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        if self.peer_credit() > 0 {
            self.credit_request_sent = false;
            if self.host_hup && self.can_read_host() {
                // The socket is no longer polled; read what is left of it.
                self.pending |= PENDING_RW;
            }
        }

        match (self.state, hdr.op) {
            (State::LocalInit { .. }, OP_RESPONSE) => {
                self.state = State::Established;
                self.deadline = None;
                let line = format!("OK {}\n", self.local_port);
                self.to_host_prefix = line.len();
                self.to_host.extend(line.as_bytes());
                if self.flush_to_host().is_err() {
                    return Verdict::Reset;
                }
            }
            (State::LocalInit { .. }, OP_CREDIT_UPDATE | OP_CREDIT_REQUEST) => {}
            (State::LocalInit { .. }, _) => return Verdict::Reset,
            (State::Established, OP_RW) => {
                if self.recv_from_guest(data).is_err() {
                    return Verdict::Reset;
                }
            }
            (State::Established, OP_SHUTDOWN) => {
                if self.peer_shutdown(hdr.flags).is_err() {
                    return Verdict::Reset;
                }
            }
            (State::Established, OP_CREDIT_UPDATE) => {}
            (State::Established, OP_CREDIT_REQUEST) => self.pending |= PENDING_CREDIT_UPDATE,
            // REQUEST or RESPONSE on an established connection, or an
            // unknown op: a protocol violation.
            (State::Established, _) => return Verdict::Reset,
        }
        self.verdict(now)
    }

    /// Handles readiness of the host socket.
    pub fn host_event(&mut self, events: u32, now: Instant) -> Verdict {
        if events & EPOLLERR != 0 {
            return Verdict::Reset;
        }
        if events & EPOLLHUP != 0 && !self.host_hup {
            self.host_hup = true;
            if matches!(self.state, State::LocalInit { .. }) {
                return Verdict::Reset;
            }
            // Nobody will read what is still buffered for the host.
            self.to_host.clear();
            self.to_host_prefix = 0;
            if self.can_read_host() {
                // Deliver what the client wrote before closing; the read
                // that returns end of file then sends SHUTDOWN.
                self.pending |= PENDING_RW;
            } else {
                self.host_eof = true;
                self.queue_shutdown(SHUTDOWN_BOTH);
            }
        }
        if events & EPOLLIN != 0 && self.can_read_host() {
            self.pending |= PENDING_RW;
        }
        if events & EPOLLOUT != 0 && !self.to_host.is_empty() && self.flush_to_host().is_err() {
            return Verdict::Reset;
        }
        self.verdict(now)
    }

    /// Whether the deadline passed.
    pub fn expired(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| d <= now)
    }

    /// Produces the next packet for the guest. Payload bytes go to `data`
    /// (the RX buffer after the header), using `scratch` as bounce buffer;
    /// the caller writes the returned header. `Ok(None)` means nothing is
    /// pending any more; `Err(())` means the connection must be reset.
    pub fn recv_pkt<W: Write>(
        &mut self,
        data: &mut W,
        data_room: usize,
        scratch: &mut [u8],
        now: Instant,
    ) -> Result<Option<PacketHeader>, ()> {
        if self.pending & PENDING_REQUEST != 0 {
            self.pending &= !PENDING_REQUEST;
            self.state = State::LocalInit { request_sent: true };
            return Ok(Some(self.header(OP_REQUEST, 0, 0)));
        }
        if self.pending & PENDING_RESPONSE != 0 {
            self.pending &= !PENDING_RESPONSE;
            return Ok(Some(self.header(OP_RESPONSE, 0, 0)));
        }
        if self.pending & PENDING_RW != 0 {
            if let Some(hdr) = self.read_host(data, data_room, scratch, now)? {
                return Ok(Some(hdr));
            }
        }
        if self.pending & PENDING_SHUTDOWN != 0 {
            self.pending &= !PENDING_SHUTDOWN;
            if self.shutdown_flags == SHUTDOWN_BOTH {
                // The guest answers a full shutdown with an RST.
                self.deadline.get_or_insert(now + SHUTDOWN_TIMEOUT);
            }
            return Ok(Some(self.header(OP_SHUTDOWN, self.shutdown_flags, 0)));
        }
        if self.pending & PENDING_CREDIT_REQUEST != 0 {
            self.pending &= !PENDING_CREDIT_REQUEST;
            return Ok(Some(self.header(OP_CREDIT_REQUEST, 0, 0)));
        }
        if self.pending & PENDING_CREDIT_UPDATE != 0 {
            return Ok(Some(self.header(OP_CREDIT_UPDATE, 0, 0)));
        }
        Ok(None)
    }

    /// Handles a pending read of the host socket.
    fn read_host<W: Write>(
        &mut self,
        data: &mut W,
        data_room: usize,
        scratch: &mut [u8],
        now: Instant,
    ) -> Result<Option<PacketHeader>, ()> {
        self.pending &= !PENDING_RW;
        if !self.can_read_host() {
            return Ok(None);
        }
        let credit = self.peer_credit() as usize;
        if credit == 0 {
            if self.credit_request_sent {
                return Ok(None);
            }
            self.credit_request_sent = true;
            return Ok(Some(self.header(OP_CREDIT_REQUEST, 0, 0)));
        }
        let max = credit.min(data_room).min(scratch.len()).min(MAX_PKT_SIZE);
        if max == 0 {
            // An RX buffer with no room for payload: use it for credit
            // information and keep the read pending for a larger buffer.
            self.pending |= PENDING_RW;
            return Ok(Some(self.header(OP_CREDIT_UPDATE, 0, 0)));
        }
        let Some(buf) = scratch.get_mut(..max) else {
            return Ok(None);
        };
        loop {
            match self.stream.read(buf) {
                Ok(0) => {
                    self.host_eof = true;
                    let flags = if self.host_hup {
                        SHUTDOWN_BOTH
                    } else {
                        SHUTDOWN_SEND
                    };
                    self.shutdown_flags |= flags;
                    if self.shutdown_flags == SHUTDOWN_BOTH {
                        self.deadline.get_or_insert(now + SHUTDOWN_TIMEOUT);
                    }
                    return Ok(Some(self.header(OP_SHUTDOWN, self.shutdown_flags, 0)));
                }
                Ok(n) => {
                    let bytes = buf.get(..n).ok_or(())?;
                    data.write_all(bytes).map_err(|_| ())?;
                    self.tx_cnt += Wrapping(n as u32);
                    if n == max || self.host_hup {
                        // Maybe more: try again with the next buffer.
                        self.pending |= PENDING_RW;
                    }
                    return Ok(Some(self.header(OP_RW, 0, n as u32)));
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(_) => return Err(()),
            }
        }
    }

    /// A header for this connection that carries our current credit.
    fn header(&mut self, op: u16, flags: u32, len: u32) -> PacketHeader {
        self.last_fwd_cnt_sent = self.fwd_cnt;
        self.pending &= !PENDING_CREDIT_UPDATE;
        PacketHeader {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: self.local_port,
            dst_port: self.peer_port,
            len,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF_SIZE,
            fwd_cnt: self.fwd_cnt.0,
        }
    }

    fn queue_shutdown(&mut self, flags: u32) {
        self.shutdown_flags |= flags;
        self.pending |= PENDING_SHUTDOWN;
    }

    /// Guest data for the host socket.
    fn recv_from_guest(&mut self, data: &[u8]) -> Result<(), ()> {
        if self.peer_shut & SHUTDOWN_SEND != 0 || self.host_hup || self.host_write_shut {
            return Err(());
        }
        if data.is_empty() {
            return Ok(());
        }
        let buffered = self.to_host.len().saturating_sub(self.to_host_prefix);
        if buffered + data.len() > CONN_BUF_SIZE as usize {
            // The guest ignored our credit.
            return Err(());
        }
        self.rx_cnt += Wrapping(data.len() as u32);
        let mut rest = data;
        if self.to_host.is_empty() {
            loop {
                match self.stream.write(rest) {
                    Ok(n) => {
                        self.fwd_cnt += Wrapping(n as u32);
                        rest = rest.get(n..).unwrap_or_default();
                        break;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(_) => return Err(()),
                }
            }
        }
        self.to_host.extend(rest);
        self.maybe_credit_update();
        Ok(())
    }

    /// Writes as much of `to_host` as the host socket takes.
    fn flush_to_host(&mut self) -> Result<(), ()> {
        while !self.to_host.is_empty() {
            let (front, _) = self.to_host.as_slices();
            match self.stream.write(front) {
                Ok(0) => return Err(()),
                Ok(n) => {
                    self.to_host.drain(..n);
                    let prefix = n.min(self.to_host_prefix);
                    self.to_host_prefix -= prefix;
                    self.fwd_cnt += Wrapping((n - prefix) as u32);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => return Err(()),
            }
        }
        if self.to_host.is_empty() && self.peer_shut & SHUTDOWN_SEND != 0 {
            self.shut_host_write();
        }
        self.maybe_credit_update();
        Ok(())
    }

    /// Tells the guest about freed space before it runs out of credit.
    fn maybe_credit_update(&mut self) {
        let guest_view_used = (self.rx_cnt - self.last_fwd_cnt_sent).0;
        let guest_view_free = CONN_BUF_SIZE.saturating_sub(guest_view_used);
        if self.fwd_cnt != self.last_fwd_cnt_sent
            && guest_view_free < CREDIT_UPDATE_THRESHOLD
            && self.peer_shut & SHUTDOWN_SEND == 0
        {
            self.pending |= PENDING_CREDIT_UPDATE;
        }
    }

    fn shut_host_write(&mut self) {
        if !self.host_write_shut {
            self.host_write_shut = true;
            if self.stream.shutdown(Shutdown::Write).is_err() {
                // The client may be gone already; nothing to do about it.
            }
        }
    }

    /// The guest's SHUTDOWN: its flags only accumulate.
    fn peer_shutdown(&mut self, flags: u32) -> Result<(), ()> {
        let new = flags & SHUTDOWN_BOTH & !self.peer_shut;
        self.peer_shut |= new;
        if new & SHUTDOWN_RCV != 0 {
            // The guest reads no more: stop polling for input and let the
            // client's further writes fail.
            self.pending &= !PENDING_RW;
            if self.stream.shutdown(Shutdown::Read).is_err() {
                // The client may be gone already; nothing to do about it.
            }
        }
        if new & SHUTDOWN_SEND != 0 {
            self.pending &= !PENDING_CREDIT_UPDATE;
            if self.to_host.is_empty() {
                self.shut_host_write();
            }
        }
        Ok(())
    }

    /// Decides whether the connection is finished.
    fn verdict(&mut self, now: Instant) -> Verdict {
        if self.state == State::Established && self.peer_shut == SHUTDOWN_BOTH {
            if self.to_host.is_empty() || self.host_hup {
                // The guest closed and everything reached the host: the
                // RST completes the close on the guest side.
                return Verdict::Reset;
            }
            self.deadline.get_or_insert(now + SHUTDOWN_TIMEOUT);
        }
        Verdict::Keep
    }
}
