//! Stream multiplexer with per-stream flow control.
//!
//! One connection carries many streams. The client opens a stream by
//! sending its first [`FrameKind::Msg`] frame on a new, higher stream id.
//! Every frame that carries content (`Msg`, `Data`, `Stdout`, `Stderr`,
//! `Eof`) costs its length field in credit on its stream; each side starts
//! with [`STREAM_WINDOW`] bytes of credit per stream and returns credit with
//! [`FrameKind::Window`] frames as the receiving application consumes what
//! arrived. A stalled consumer therefore only stalls its own stream, and the
//! bytes buffered for a stream never exceed its window. A peer that sends
//! beyond its credit breaks the protocol and loses the connection.
//!
//! Each side sends [`FrameKind::Close`] when it has dropped every handle of a
//! stream; a stream whose peer has closed refuses further sends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, Notify, Semaphore};

use super::frame::{read_frame, Channel, Frame, FrameError, FrameKind, HEADER_REST_LEN};
use super::frame::{MAX_FRAME_LEN, MAX_PAYLOAD_LEN};
use super::message::{ErrorCode, ErrorReply, Response};

/// Credit, in bytes of frame length, that each side starts with on every
/// stream. It is at least twice [`MAX_FRAME_LEN`], so a returned credit
/// batch never leaves a maximum-size frame waiting.
pub const STREAM_WINDOW: u32 = 2 * MAX_FRAME_LEN;
/// Consumed credit is returned once this much has accumulated.
const WINDOW_UPDATE_THRESHOLD: u32 = 256 << 10;
/// Data is split into frames of at most this many payload bytes.
pub const MAX_DATA_CHUNK: usize = 128 << 10;
/// Default limit on streams open at once on one connection.
pub const DEFAULT_MAX_STREAMS: usize = 1024;
const WRITE_BUFFER: usize = 256 << 10;
const READ_BUFFER: usize = 64 << 10;

/// Which end of the connection this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Opens streams.
    Client,
    /// Accepts streams.
    Server,
}

/// Limits of one connection.
#[derive(Debug, Clone, Copy)]
pub struct MuxConfig {
    /// Largest frame length accepted from the peer.
    pub max_frame_len: u32,
    /// Streams that may be open at once (server: more are refused).
    pub max_streams: usize,
}

impl Default for MuxConfig {
    fn default() -> Self {
        Self {
            max_frame_len: MAX_FRAME_LEN,
            max_streams: DEFAULT_MAX_STREAMS,
        }
    }
}

/// Why a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseReason {
    /// The peer closed the connection.
    Eof,
    /// This side dropped every handle.
    Local,
    /// Reading or writing the transport failed.
    Io(String),
    /// The peer broke the protocol (frame size, kind, flow control).
    Protocol(String),
    /// The peer reported a fatal error on stream 0.
    Remote(ErrorReply),
}

impl std::fmt::Display for CloseReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Eof => f.write_str("closed by the peer"),
            Self::Local => f.write_str("closed locally"),
            Self::Io(e) => write!(f, "transport failed: {e}"),
            Self::Protocol(e) => write!(f, "protocol violation: {e}"),
            Self::Remote(e) => write!(f, "peer reported {}: {}", e.code, e.message),
        }
    }
}

/// Errors from sending on or opening a stream.
#[derive(Debug, thiserror::Error)]
pub enum MuxError {
    /// The connection is gone.
    #[error("Connection lost: {0}")]
    ConnectionLost(CloseReason),
    /// The peer closed this stream.
    #[error("Stream closed by the peer")]
    StreamClosed,
    /// A message does not fit in one frame.
    #[error("Message of {0} bytes does not fit in one frame")]
    MessageTooLarge(usize),
    /// A message could not be encoded.
    #[error("Could not encode message")]
    Encode(#[source] serde_json::Error),
    /// Every stream id has been used, or too many streams are open.
    #[error("No more streams can be opened on this connection")]
    StreamsExhausted,
}

/// Something that arrived on a stream.
#[derive(Debug)]
pub enum Inbound {
    /// A JSON control message (decode with [`Inbound::parse`] or serde).
    Msg(Vec<u8>),
    /// Raw bytes; the credit returns to the peer when the chunk is dropped.
    Data(Channel, Chunk),
    /// A channel ended.
    Eof(Channel),
}

impl Inbound {
    /// Decodes a control message as `T`; `None` when this is not a message.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Option<Result<T, serde_json::Error>> {
        match self {
            Self::Msg(bytes) => Some(serde_json::from_slice(bytes)),
            _ => None,
        }
    }
}

/// Received bytes. Holding a chunk holds its flow-control credit, so a
/// consumer that keeps chunks queued slows its sender down.
#[derive(Debug)]
pub struct Chunk {
    data: Vec<u8>,
    _credit: Credit,
}

impl Chunk {
    /// Takes the bytes out; the credit is returned now.
    pub fn into_vec(mut self) -> Vec<u8> {
        std::mem::take(&mut self.data)
    }
}

impl std::ops::Deref for Chunk {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.data
    }
}

/// Credit held by a received item; returned on drop.
#[derive(Debug)]
struct Credit {
    stream: Weak<StreamShared>,
    amount: u32,
}

impl Drop for Credit {
    fn drop(&mut self) {
        if let Some(stream) = self.stream.upgrade() {
            stream.release(self.amount);
        }
    }
}

enum Outbound {
    Frame(Frame),
    Shutdown,
}

struct RawInbound {
    kind: FrameKind,
    payload: Vec<u8>,
    cost: u32,
}

struct Slot {
    tx: mpsc::UnboundedSender<RawInbound>,
    send_credit: Arc<Semaphore>,
    recv_budget: Arc<AtomicU64>,
}

struct State {
    streams: HashMap<u32, Slot>,
    next_id: u32,
    highest_remote: u32,
    closed: Option<CloseReason>,
    incoming: Option<mpsc::UnboundedSender<Stream>>,
}

struct Shared {
    role: Role,
    config: MuxConfig,
    out: mpsc::UnboundedSender<Outbound>,
    state: Mutex<State>,
    stop_reader: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not take every stream down with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn closed(&self) -> Option<CloseReason> {
        self.lock().closed.clone()
    }

    /// Ends the connection: every stream sees its end, senders fail, and the
    /// writer flushes what is queued and shuts the transport down.
    fn fail(&self, reason: CloseReason) {
        // Everything taken out is dropped after the lock is released: drops
        // may run stream destructors, which take the lock themselves.
        let (slots, incoming) = {
            let mut state = self.lock();
            if state.closed.is_none() {
                state.closed = Some(reason);
            }
            (std::mem::take(&mut state.streams), state.incoming.take())
        };
        drop(incoming);
        for slot in slots.into_values() {
            slot.send_credit.close();
        }
        if self.out.send(Outbound::Shutdown).is_err() {
            tracing::trace!("the connection's writer has ended already");
        }
        self.stop_reader.notify_one();
    }

    fn lost(&self) -> MuxError {
        MuxError::ConnectionLost(self.closed().unwrap_or(CloseReason::Local))
    }
}

/// Per-stream state shared by its sender clones and its receiver.
struct StreamShared {
    id: u32,
    send_credit: Arc<Semaphore>,
    recv_budget: Arc<AtomicU64>,
    pending: AtomicU32,
    mux: Weak<Shared>,
    _live: Option<Arc<Liveness>>,
}

impl std::fmt::Debug for StreamShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamShared")
            .field("id", &self.id)
            .finish()
    }
}

impl StreamShared {
    fn release(&self, amount: u32) {
        let pending = self.pending.fetch_add(amount, Ordering::AcqRel) + amount;
        if pending < WINDOW_UPDATE_THRESHOLD {
            return;
        }
        let amount = self.pending.swap(0, Ordering::AcqRel);
        if amount == 0 {
            return;
        }
        self.recv_budget
            .fetch_add(u64::from(amount), Ordering::AcqRel);
        if let Some(mux) = self.mux.upgrade() {
            let frame = Frame::new(self.id, FrameKind::Window, amount.to_be_bytes().to_vec());
            if mux.out.send(Outbound::Frame(frame)).is_err() {
                tracing::trace!(
                    stream = self.id,
                    "the connection's writer has ended; no window update"
                );
            }
        }
    }
}

impl Drop for StreamShared {
    fn drop(&mut self) {
        let Some(mux) = self.mux.upgrade() else {
            return;
        };
        let removed = mux.lock().streams.remove(&self.id);
        if removed.is_some() {
            let close = Frame::new(self.id, FrameKind::Close, Vec::new());
            if mux.out.send(Outbound::Frame(close)).is_err() {
                tracing::trace!(
                    stream = self.id,
                    "the connection's writer has ended; no close"
                );
            }
        }
    }
}

/// Signals shutdown when the last user-held handle of a connection drops.
struct Liveness {
    mux: Weak<Shared>,
}

impl Drop for Liveness {
    fn drop(&mut self) {
        if let Some(mux) = self.mux.upgrade() {
            mux.fail(CloseReason::Local);
        }
    }
}

/// The sending half of a stream; clone it to send from several tasks.
#[derive(Clone, Debug)]
pub struct StreamSender {
    shared: Arc<StreamShared>,
}

/// The receiving half of a stream.
#[derive(Debug)]
pub struct StreamReceiver {
    rx: mpsc::UnboundedReceiver<RawInbound>,
    shared: Arc<StreamShared>,
}

/// Both halves of a stream.
#[derive(Debug)]
pub struct Stream {
    sender: StreamSender,
    receiver: StreamReceiver,
}

impl Stream {
    /// The stream id.
    pub fn id(&self) -> u32 {
        self.sender.shared.id
    }

    /// Splits into halves that can move to different tasks.
    pub fn split(self) -> (StreamSender, StreamReceiver) {
        (self.sender, self.receiver)
    }

    /// See [`StreamSender::send_msg`].
    pub async fn send_msg<T: Serialize>(&self, msg: &T) -> Result<(), MuxError> {
        self.sender.send_msg(msg).await
    }

    /// See [`StreamSender::send_data`].
    pub async fn send_data(&self, channel: Channel, data: &[u8]) -> Result<(), MuxError> {
        self.sender.send_data(channel, data).await
    }

    /// See [`StreamSender::send_eof`].
    pub async fn send_eof(&self, channel: Channel) -> Result<(), MuxError> {
        self.sender.send_eof(channel).await
    }

    /// See [`StreamReceiver::recv`].
    pub async fn recv(&mut self) -> Option<Inbound> {
        self.receiver.recv().await
    }

    /// A clone of the sending half.
    pub fn sender(&self) -> StreamSender {
        self.sender.clone()
    }
}

impl StreamSender {
    /// The stream id.
    pub fn id(&self) -> u32 {
        self.shared.id
    }

    fn mux(&self) -> Result<Arc<Shared>, MuxError> {
        self.shared
            .mux
            .upgrade()
            .ok_or(MuxError::ConnectionLost(CloseReason::Local))
    }

    async fn send_frame(&self, kind: FrameKind, payload: Vec<u8>) -> Result<(), MuxError> {
        let mux = self.mux()?;
        let cost = HEADER_REST_LEN + payload.len() as u32;
        match self.shared.send_credit.acquire_many(cost).await {
            Ok(permit) => permit.forget(),
            Err(_) => {
                return Err(match mux.closed() {
                    Some(reason) => MuxError::ConnectionLost(reason),
                    None => MuxError::StreamClosed,
                })
            }
        }
        let frame = Frame::new(self.shared.id, kind, payload);
        mux.out.send(Outbound::Frame(frame)).map_err(|_| mux.lost())
    }

    /// Sends a JSON control message, waiting for credit.
    pub async fn send_msg<T: Serialize>(&self, msg: &T) -> Result<(), MuxError> {
        let payload = serde_json::to_vec(msg).map_err(MuxError::Encode)?;
        if payload.len() > MAX_PAYLOAD_LEN {
            return Err(MuxError::MessageTooLarge(payload.len()));
        }
        self.send_frame(FrameKind::Msg, payload).await
    }

    /// Sends bytes on a channel, split into frames of at most
    /// [`MAX_DATA_CHUNK`] bytes, waiting for credit as needed. Empty data
    /// sends nothing.
    pub async fn send_data(&self, channel: Channel, data: &[u8]) -> Result<(), MuxError> {
        for chunk in data.chunks(MAX_DATA_CHUNK) {
            self.send_frame(channel.kind(), chunk.to_vec()).await?;
        }
        Ok(())
    }

    /// Sends an owned buffer of at most [`MAX_DATA_CHUNK`] bytes as one
    /// frame without copying it (larger buffers are split).
    pub async fn send_data_vec(&self, channel: Channel, data: Vec<u8>) -> Result<(), MuxError> {
        if data.len() > MAX_DATA_CHUNK {
            return self.send_data(channel, &data).await;
        }
        if data.is_empty() {
            return Ok(());
        }
        self.send_frame(channel.kind(), data).await
    }

    /// Marks the end of a channel.
    pub async fn send_eof(&self, channel: Channel) -> Result<(), MuxError> {
        self.send_frame(FrameKind::Eof, vec![channel.kind() as u8])
            .await
    }

    /// Whether the peer has closed this stream or the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.send_credit.is_closed()
    }
}

impl StreamReceiver {
    /// The stream id.
    pub fn id(&self) -> u32 {
        self.shared.id
    }

    /// The next item, or `None` once the peer has closed the stream or the
    /// connection is gone (see [`StreamReceiver::connection_error`]).
    pub async fn recv(&mut self) -> Option<Inbound> {
        let raw = self.rx.recv().await?;
        Some(self.convert(raw))
    }

    fn convert(&self, raw: RawInbound) -> Inbound {
        match raw.kind {
            FrameKind::Stdout | FrameKind::Stderr | FrameKind::Data => {
                let channel = match raw.kind {
                    FrameKind::Stdout => Channel::Stdout,
                    FrameKind::Stderr => Channel::Stderr,
                    _ => Channel::Data,
                };
                Inbound::Data(
                    channel,
                    Chunk {
                        data: raw.payload,
                        _credit: Credit {
                            stream: Arc::downgrade(&self.shared),
                            amount: raw.cost,
                        },
                    },
                )
            }
            FrameKind::Eof => {
                self.shared.release(raw.cost);
                // The reader validated the payload.
                let channel = raw
                    .payload
                    .first()
                    .and_then(|b| Channel::from_u8(*b))
                    .unwrap_or(Channel::Data);
                Inbound::Eof(channel)
            }
            _ => {
                self.shared.release(raw.cost);
                Inbound::Msg(raw.payload)
            }
        }
    }

    /// Why the connection ended, once it has; `None` while it is up (a
    /// `recv` that returned `None` then means the peer closed the stream).
    pub fn connection_error(&self) -> Option<CloseReason> {
        self.shared.mux.upgrade().and_then(|m| m.closed())
    }
}

/// A connection: opens streams (client) and reports its state.
#[derive(Clone)]
pub struct Mux {
    shared: Arc<Shared>,
    live: Arc<Liveness>,
}

impl std::fmt::Debug for Mux {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mux")
            .field("role", &self.shared.role)
            .finish()
    }
}

/// New streams opened by the client (server side).
pub struct Incoming {
    rx: mpsc::UnboundedReceiver<Stream>,
    _live: Arc<Liveness>,
}

impl Incoming {
    /// The next stream the client opened; its first item is the request
    /// message. `None` once the connection is gone.
    pub async fn accept(&mut self) -> Option<Stream> {
        self.rx.recv().await
    }
}

impl Mux {
    /// Starts a client connection over `io` (after the handshake).
    pub fn client<S>(io: S, config: MuxConfig) -> Mux
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        Self::start(io, Role::Client, config).0
    }

    /// Starts a server connection over `io` (after the handshake).
    pub fn server<S>(io: S, config: MuxConfig) -> (Mux, Incoming)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (mux, incoming) = Self::start(io, Role::Server, config);
        let incoming = incoming.unwrap_or_else(|| {
            // Unreachable: the server role always has an incoming queue.
            let (_tx, rx) = mpsc::unbounded_channel();
            Incoming {
                rx,
                _live: mux.live.clone(),
            }
        });
        (mux, incoming)
    }

    fn start<S>(io: S, role: Role, config: MuxConfig) -> (Mux, Option<Incoming>)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (reader, writer) = tokio::io::split(io);
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let (in_tx, in_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            role,
            config,
            out: out_tx,
            state: Mutex::new(State {
                streams: HashMap::new(),
                next_id: 1,
                highest_remote: 0,
                closed: None,
                incoming: (role == Role::Server).then_some(in_tx),
            }),
            stop_reader: Notify::new(),
        });
        let live = Arc::new(Liveness {
            mux: Arc::downgrade(&shared),
        });
        tokio::spawn(write_loop(shared.clone(), writer, out_rx));
        tokio::spawn(read_loop(shared.clone(), Arc::downgrade(&live), reader));
        let incoming = (role == Role::Server).then(|| Incoming {
            rx: in_rx,
            _live: live.clone(),
        });
        (Mux { shared, live }, incoming)
    }

    /// Opens a new stream (client side). Send the request message first;
    /// when several tasks open streams at once, use
    /// [`Mux::open_with_msg`], which keeps first frames in id order.
    pub fn open(&self) -> Result<Stream, MuxError> {
        let mut state = self.shared.lock();
        if let Some(reason) = &state.closed {
            return Err(MuxError::ConnectionLost(reason.clone()));
        }
        if state.next_id == u32::MAX || state.streams.len() >= self.shared.config.max_streams {
            return Err(MuxError::StreamsExhausted);
        }
        let id = state.next_id;
        state.next_id += 1;
        let stream = make_stream(&self.shared, &mut state, id, self.live.clone());
        Ok(stream)
    }

    /// Opens a new stream and queues `msg` as its first frame in one step
    /// (client side). The server takes a message on an id above every id
    /// it has seen as a new stream, so the first frames of streams must
    /// leave in id order: allocating the id and queueing the frame under
    /// one lock guarantees that when many tasks open streams at once.
    pub fn open_with_msg<T: Serialize>(&self, msg: &T) -> Result<Stream, MuxError> {
        let payload = serde_json::to_vec(msg).map_err(MuxError::Encode)?;
        let cost = HEADER_REST_LEN + payload.len() as u32;
        if cost > STREAM_WINDOW {
            return Err(MuxError::Encode(serde::ser::Error::custom(
                "request larger than a stream's window",
            )));
        }
        let mut state = self.shared.lock();
        if let Some(reason) = &state.closed {
            return Err(MuxError::ConnectionLost(reason.clone()));
        }
        if state.next_id == u32::MAX || state.streams.len() >= self.shared.config.max_streams {
            return Err(MuxError::StreamsExhausted);
        }
        let id = state.next_id;
        state.next_id += 1;
        let stream = make_stream(&self.shared, &mut state, id, self.live.clone());
        // A fresh stream has a whole window of credit.
        match stream.sender.shared.send_credit.try_acquire_many(cost) {
            Ok(permit) => permit.forget(),
            Err(_) => return Err(MuxError::StreamClosed),
        }
        self.shared
            .out
            .send(Outbound::Frame(Frame::new(id, FrameKind::Msg, payload)))
            .map_err(|_| self.shared.lost())?;
        drop(state);
        Ok(stream)
    }

    /// Why the connection ended, once it has.
    pub fn closed(&self) -> Option<CloseReason> {
        self.shared.closed()
    }

    /// Streams currently open.
    pub fn open_streams(&self) -> usize {
        self.shared.lock().streams.len()
    }
}

fn make_stream(shared: &Arc<Shared>, state: &mut State, id: u32, live: Arc<Liveness>) -> Stream {
    let (tx, rx) = mpsc::unbounded_channel();
    let send_credit = Arc::new(Semaphore::new(STREAM_WINDOW as usize));
    let recv_budget = Arc::new(AtomicU64::new(u64::from(STREAM_WINDOW)));
    state.streams.insert(
        id,
        Slot {
            tx,
            send_credit: send_credit.clone(),
            recv_budget: recv_budget.clone(),
        },
    );
    let stream_shared = Arc::new(StreamShared {
        id,
        send_credit,
        recv_budget,
        pending: AtomicU32::new(0),
        mux: Arc::downgrade(shared),
        _live: Some(live),
    });
    Stream {
        sender: StreamSender {
            shared: stream_shared.clone(),
        },
        receiver: StreamReceiver {
            rx,
            shared: stream_shared,
        },
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    shared: Arc<Shared>,
    writer: W,
    mut rx: mpsc::UnboundedReceiver<Outbound>,
) {
    let mut writer = BufWriter::with_capacity(WRITE_BUFFER, writer);
    let result: Result<(), FrameError> = async {
        'outer: while let Some(item) = rx.recv().await {
            let mut next = Some(item);
            while let Some(item) = next.take() {
                match item {
                    Outbound::Shutdown => {
                        writer.flush().await.map_err(FrameError::Io)?;
                        if let Err(e) = writer.shutdown().await {
                            tracing::debug!("cannot shut the connection's transport down: {e}");
                        }
                        break 'outer;
                    }
                    Outbound::Frame(frame) => {
                        let header =
                            Frame::encode_header(frame.stream, frame.kind, frame.payload.len())?;
                        writer.write_all(&header).await.map_err(FrameError::Io)?;
                        writer
                            .write_all(&frame.payload)
                            .await
                            .map_err(FrameError::Io)?;
                    }
                }
                next = rx.try_recv().ok();
            }
            writer.flush().await.map_err(FrameError::Io)?;
        }
        Ok(())
    }
    .await;
    match result {
        Ok(()) => shared.fail(CloseReason::Local),
        Err(e) => shared.fail(CloseReason::Io(e.to_string())),
    }
}

async fn read_loop<R: AsyncRead + Unpin>(shared: Arc<Shared>, live: Weak<Liveness>, reader: R) {
    // Small frames (window updates, messages) then cost no read syscall each.
    let mut reader = BufReader::with_capacity(READ_BUFFER, reader);
    let max = shared.config.max_frame_len;
    loop {
        let frame = tokio::select! {
            frame = read_frame(&mut reader, max) => frame,
            () = shared.stop_reader.notified() => return,
        };
        let frame = match frame {
            Ok(Some(frame)) => frame,
            Ok(None) => return shared.fail(CloseReason::Eof),
            Err(FrameError::Io(e)) => return shared.fail(CloseReason::Io(e.to_string())),
            Err(e) => return protocol_violation(&shared, e.to_string()),
        };
        if let Err(message) = dispatch(&shared, &live, frame) {
            return protocol_violation(&shared, message);
        }
    }
}

/// Tells the peer why on stream 0, then ends the connection.
fn protocol_violation(shared: &Shared, message: String) {
    let reply = Response::error(ErrorCode::Protocol, message.clone());
    if let Ok(payload) = serde_json::to_vec(&reply) {
        let told = shared
            .out
            .send(Outbound::Frame(Frame::new(0, FrameKind::Msg, payload)));
        if told.is_err() {
            tracing::trace!("the connection's writer has ended; the peer is not told why");
        }
    }
    shared.fail(CloseReason::Protocol(message));
}

fn dispatch(shared: &Arc<Shared>, live: &Weak<Liveness>, frame: Frame) -> Result<(), String> {
    if frame.stream == 0 {
        if frame.kind == FrameKind::Msg {
            let reason = match serde_json::from_slice::<Response>(&frame.payload) {
                Ok(Response::Error(e)) => CloseReason::Remote(e),
                _ => CloseReason::Protocol("unexpected message on stream 0".to_owned()),
            };
            shared.fail(reason);
        }
        return Ok(());
    }
    let cost = frame.wire_len();
    let mut state = shared.lock();
    match frame.kind {
        FrameKind::Window => {
            let bytes: [u8; 4] = frame
                .payload
                .as_slice()
                .try_into()
                .map_err(|_| "window frame payload is not 4 bytes".to_owned())?;
            let amount = u32::from_be_bytes(bytes) as usize;
            if let Some(slot) = state.streams.get(&frame.stream) {
                if slot.send_credit.available_permits() + amount > 16 * STREAM_WINDOW as usize {
                    return Err(format!(
                        "stream {} credited beyond its window",
                        frame.stream
                    ));
                }
                slot.send_credit.add_permits(amount);
            }
            Ok(())
        }
        FrameKind::Close => {
            if let Some(slot) = state.streams.remove(&frame.stream) {
                slot.send_credit.close();
            }
            Ok(())
        }
        FrameKind::Eof
            if frame.payload.len() != 1 || Channel::from_u8(frame.payload[0]).is_none() =>
        {
            Err("EOF frame does not name a channel".to_owned())
        }
        kind => {
            if let Some(slot) = state.streams.get(&frame.stream) {
                let budget = &slot.recv_budget;
                let ok = budget
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                        b.checked_sub(u64::from(cost))
                    })
                    .is_ok();
                if !ok {
                    return Err(format!(
                        "stream {} sent beyond its flow-control window",
                        frame.stream
                    ));
                }
                let delivered = slot.tx.send(RawInbound {
                    kind,
                    payload: frame.payload,
                    cost,
                });
                if delivered.is_err() {
                    tracing::trace!(
                        stream = frame.stream,
                        "the stream's reader has gone; its frame is dropped"
                    );
                }
                return Ok(());
            }
            let opens = shared.role == Role::Server
                && kind == FrameKind::Msg
                && frame.stream > state.highest_remote;
            if !opens {
                // A frame for a stream that is already closed: drop it.
                return Ok(());
            }
            state.highest_remote = frame.stream;
            let Some(incoming) = state.incoming.clone() else {
                return Ok(());
            };
            let Some(live) = live.upgrade() else {
                return Ok(());
            };
            if state.streams.len() >= shared.config.max_streams {
                let reply = Response::error(
                    ErrorCode::LimitExceeded,
                    format!(
                        "too many open streams on this connection (limit {})",
                        shared.config.max_streams
                    ),
                );
                if let Ok(payload) = serde_json::to_vec(&reply) {
                    let refusal = Frame::new(frame.stream, FrameKind::Msg, payload);
                    if shared.out.send(Outbound::Frame(refusal)).is_err() {
                        tracing::trace!(
                            stream = frame.stream,
                            "the connection's writer has ended; no refusal"
                        );
                    }
                }
                let close = Frame::new(frame.stream, FrameKind::Close, Vec::new());
                if shared.out.send(Outbound::Frame(close)).is_err() {
                    tracing::trace!(
                        stream = frame.stream,
                        "the connection's writer has ended; no close"
                    );
                }
                drop(state);
                drop(live);
                return Ok(());
            }
            let stream = make_stream(shared, &mut state, frame.stream, live);
            let slot = state
                .streams
                .get(&frame.stream)
                .ok_or_else(|| "stream vanished".to_owned())?;
            slot.recv_budget
                .fetch_sub(u64::from(cost), Ordering::AcqRel);
            let delivered = slot.tx.send(RawInbound {
                kind,
                payload: frame.payload,
                cost,
            });
            if delivered.is_err() {
                // Not while `stream`, here, holds its receiver.
                tracing::trace!(
                    stream = frame.stream,
                    "a new stream's first frame has no reader"
                );
            }
            drop(state);
            // If the server stopped accepting, dropping the stream closes it.
            if incoming.send(stream).is_err() {
                tracing::trace!(
                    stream = frame.stream,
                    "no one accepts streams any more; this one closes"
                );
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::frame::write_frame;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    fn pair() -> (Mux, Incoming) {
        let (a, b) = tokio::io::duplex(64 << 10);
        let client = Mux::client(a, MuxConfig::default());
        let (_server, incoming) = Mux::server(b, MuxConfig::default());
        (client, incoming)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_streams_opened_at_once_all_reach_the_server() {
        // Ids are allocated in open order; were first frames sent later,
        // tasks could send them out of order and the server would take a
        // lower id for an already closed stream and drop the request.
        let (client, mut incoming) = pair();
        let opens: Vec<_> = (0..200)
            .map(|i| {
                let client = client.clone();
                tokio::spawn(async move {
                    tokio::task::yield_now().await;
                    client
                        .open_with_msg(&serde_json::json!({ "n": i }))
                        .expect("open")
                })
            })
            .collect();
        let mut streams = Vec::new();
        for o in opens {
            streams.push(o.await.expect("task"));
        }
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let mut s = tokio::time::timeout(Duration::from_secs(5), incoming.accept())
                .await
                .expect("every stream arrives")
                .expect("accepted");
            seen.insert(recv_msg(&mut s).await["n"].as_u64().expect("n"));
        }
        assert_eq!(seen.len(), 200);
    }

    async fn recv_msg(stream: &mut Stream) -> serde_json::Value {
        let item = stream.recv().await.expect("item");
        item.parse::<serde_json::Value>()
            .expect("a message")
            .expect("json")
    }

    #[tokio::test]
    async fn test_mux_stream_round_trip_carries_messages_and_data() {
        let (client, mut incoming) = pair();
        let mut stream = client.open().expect("open");
        stream
            .send_msg(&serde_json::json!({"op": "x"}))
            .await
            .expect("send");
        stream
            .send_data(Channel::Data, &vec![7u8; 300_000])
            .await
            .expect("data");
        stream.send_eof(Channel::Data).await.expect("eof");

        let mut server = incoming.accept().await.expect("accepted");
        assert_eq!(recv_msg(&mut server).await, serde_json::json!({"op": "x"}));
        let mut got = Vec::new();
        loop {
            match server.recv().await.expect("item") {
                Inbound::Data(Channel::Data, chunk) => got.extend_from_slice(&chunk),
                Inbound::Eof(Channel::Data) => break,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(got, vec![7u8; 300_000]);
        server
            .send_data(Channel::Stdout, b"out")
            .await
            .expect("reply");
        drop(server);
        match stream.recv().await.expect("reply") {
            Inbound::Data(Channel::Stdout, chunk) => assert_eq!(&chunk[..], b"out"),
            other => panic!("unexpected {other:?}"),
        }
        assert!(
            stream.recv().await.is_none(),
            "closed after the peer dropped"
        );
        assert!(stream.send_msg(&1).await.is_err());
    }

    #[tokio::test]
    async fn test_mux_stalled_stream_does_not_block_others() {
        let (client, mut incoming) = pair();
        let stalled = client.open().expect("open");
        stalled.send_msg(&"stalled").await.expect("send");
        let _stalled_server = incoming.accept().await.expect("accept");
        // Fill the stalled stream's whole window; the server never reads it.
        let filler = vec![0u8; STREAM_WINDOW as usize - 1024];
        tokio::time::timeout(
            Duration::from_secs(5),
            stalled.send_data(Channel::Data, &filler),
        )
        .await
        .expect("a full window is accepted without a reader")
        .expect("send");

        let mut other = client.open().expect("open");
        other.send_msg(&"other").await.expect("send");
        let mut other_server = tokio::time::timeout(Duration::from_secs(5), incoming.accept())
            .await
            .expect("second stream is not blocked")
            .expect("accept");
        assert_eq!(
            recv_msg(&mut other_server).await,
            serde_json::json!("other")
        );
        other_server.send_msg(&"pong").await.expect("reply");
        assert_eq!(recv_msg(&mut other).await, serde_json::json!("pong"));
    }

    #[tokio::test]
    async fn test_mux_sender_waits_for_credit_then_resumes() {
        let (client, mut incoming) = pair();
        let stream = client.open().expect("open");
        stream.send_msg(&"x").await.expect("send");
        let mut server = incoming.accept().await.expect("accept");
        let total = 3 * STREAM_WINDOW as usize;
        let sender = tokio::spawn(async move {
            stream
                .send_data(Channel::Data, &vec![1u8; total])
                .await
                .expect("send");
            stream
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!sender.is_finished(), "sender must wait for credit");
        let _ = server.recv().await;
        let mut got = 0;
        while got < total {
            match server.recv().await.expect("data") {
                Inbound::Data(_, chunk) => got += chunk.len(),
                other => panic!("unexpected {other:?}"),
            }
        }
        sender.await.expect("sender finishes once credit returns");
    }

    #[tokio::test]
    async fn test_negative_mux_oversized_frame_closes_connection_with_error() {
        let (mut raw, b) = tokio::io::duplex(64 << 10);
        let (server, _incoming) = Mux::server(b, MuxConfig::default());
        raw.write_all(&(MAX_FRAME_LEN + 1).to_be_bytes())
            .await
            .expect("write");
        let mut reply = Vec::new();
        raw.read_to_end(&mut reply).await.expect("read");
        let (frame, _) = Frame::decode(&reply, MAX_FRAME_LEN)
            .expect("decode")
            .expect("a whole frame");
        assert_eq!(frame.stream, 0);
        let resp: Response = serde_json::from_slice(&frame.payload).expect("json");
        assert!(matches!(
            resp,
            Response::Error(ErrorReply {
                code: ErrorCode::Protocol,
                ..
            })
        ));
        assert!(matches!(server.closed(), Some(CloseReason::Protocol(_))));
    }

    #[tokio::test]
    async fn test_negative_mux_peer_ignoring_credit_is_disconnected() {
        let (mut raw, b) = tokio::io::duplex(8 << 20);
        let (server, mut incoming) = Mux::server(b, MuxConfig::default());
        write_frame(&mut raw, 1, FrameKind::Msg, b"{}")
            .await
            .expect("open");
        let _stream = incoming.accept().await.expect("accept");
        let chunk = vec![0u8; MAX_DATA_CHUNK];
        for _ in 0..(STREAM_WINDOW as usize / MAX_DATA_CHUNK + 2) {
            if write_frame(&mut raw, 1, FrameKind::Data, &chunk)
                .await
                .is_err()
            {
                break;
            }
        }
        raw.flush().await.expect("flush");
        let mut reply = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut reply)).await;
        assert!(matches!(server.closed(), Some(CloseReason::Protocol(_))));
    }

    #[tokio::test]
    async fn test_mux_dropping_client_closes_connection_for_server() {
        let (client, mut incoming) = pair();
        let stream = client.open().expect("open");
        stream.send_msg(&"x").await.expect("send");
        let mut server = incoming.accept().await.expect("accept");
        let _ = server.recv().await;
        drop(stream);
        drop(client);
        assert!(tokio::time::timeout(Duration::from_secs(5), server.recv())
            .await
            .expect("server sees the end")
            .is_none());
        assert!(
            tokio::time::timeout(Duration::from_secs(5), incoming.accept())
                .await
                .expect("incoming ends")
                .is_none()
        );
    }
}
