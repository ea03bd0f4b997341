//! The fuzz targets. Each takes arbitrary bytes; errors are fine, a panic
//! or a hang is a bug.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use tine_proto::agent::frame::{read_frame, Frame, MAX_FRAME_LEN};
use tine_proto::agent::mux::{Mux, MuxConfig};
use tine_proto::agent::{Hello, Request as AgentRequest, Response as AgentResponse, Welcome};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What a target keeps between cases.
pub struct State {
    rt: tokio::runtime::Runtime,
    // Keeps the scratch directory alive for the process.
    _dir: Option<tempfile::TempDir>,
    file: PathBuf,
}

/// One fuzz target.
pub struct Target {
    /// Its name on the command line and in the corpus directory.
    pub name: &'static str,
    /// Builds the per-process state.
    pub init: fn() -> State,
    /// Runs one case.
    pub run: fn(&mut State, &[u8]),
    /// A case slower than this counts as a hang.
    pub hang: Duration,
}

fn init() -> State {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("cannot build a tokio runtime: {e}"));
    // Memory-backed when there is a tmpfs: the qcow2 target rewrites its
    // image file every case, and a disk file system turns each rewrite
    // into a writeback.
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm).or_else(|_| tempfile::tempdir())
    } else {
        tempfile::tempdir()
    }
    .unwrap_or_else(|e| panic!("cannot make a temp dir: {e}"));
    let file = dir.path().join("image");
    State {
        rt,
        _dir: Some(dir),
        file,
    }
}

/// Every target, in the order `all` runs them.
pub const ALL: &[Target] = &[
    Target {
        name: "agent_frame",
        init,
        run: agent_frame,
        hang: Duration::from_secs(1),
    },
    Target {
        name: "agent_message",
        init,
        run: agent_message,
        hang: Duration::from_secs(1),
    },
    Target {
        name: "agent_mux",
        init,
        run: agent_mux,
        hang: Duration::from_secs(3),
    },
    Target {
        name: "qcow2",
        init,
        run: qcow2,
        hang: Duration::from_secs(2),
    },
    Target {
        name: "snapshot_state",
        init,
        run: snapshot_state,
        hang: Duration::from_secs(1),
    },
    Target {
        name: "vmm_event",
        init,
        run: vmm_event,
        hang: Duration::from_secs(1),
    },
    Target {
        name: "rest_query",
        init,
        run: rest_query,
        hang: Duration::from_secs(1),
    },
    Target {
        name: "virtio_blk_queue",
        init,
        run: virtio_blk_queue,
        hang: Duration::from_secs(1),
    },
    Target {
        name: "vsock_packet",
        init,
        run: vsock_packet,
        hang: Duration::from_secs(1),
    },
    Target {
        name: "virtio_net_queue",
        init,
        run: virtio_net_queue,
        hang: Duration::from_secs(1),
    },
    Target {
        name: "virtio_rng_queue",
        init,
        run: virtio_rng_queue,
        hang: Duration::from_secs(1),
    },
    Target {
        name: "ws_shell",
        init,
        run: ws_shell,
        hang: Duration::from_secs(2),
    },
];

/// Frames from the synchronous decoder, until it needs more bytes or fails.
fn decode_all(data: &[u8], max_len: u32) -> (Vec<Frame>, bool) {
    let mut frames = Vec::new();
    let mut rest = data;
    loop {
        match Frame::decode(rest, max_len) {
            Ok(Some((frame, used))) => {
                assert!(used > 0 && used <= rest.len(), "decode used {used} bytes");
                rest = &rest[used..];
                frames.push(frame);
            }
            Ok(None) => return (frames, rest.is_empty()),
            Err(_) => return (frames, false),
        }
    }
}

fn agent_frame(state: &mut State, data: &[u8]) {
    for max_len in [MAX_FRAME_LEN, 64] {
        let (decoded, clean) = decode_all(data, max_len);
        // The async reader must agree with the decoder frame for frame.
        let (read, read_clean) = state.rt.block_on(async {
            let mut cursor = data;
            let mut frames = Vec::new();
            loop {
                match read_frame(&mut cursor, max_len).await {
                    Ok(Some(f)) => frames.push(f),
                    Ok(None) => return (frames, true),
                    Err(_) => return (frames, false),
                }
            }
        });
        assert_eq!(decoded, read, "decode and read_frame disagree");
        assert_eq!(clean, read_clean, "decode and read_frame end differently");
        // What decodes re-encodes to the same bytes.
        let mut out = Vec::new();
        for f in &decoded {
            if let Err(e) = f.encode_into(&mut out) {
                panic!("a decoded frame does not encode: {e}");
            }
        }
        assert_eq!(&data[..out.len()], &out[..], "re-encoding differs");
    }
}

fn roundtrip<T>(data: &[u8])
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    if let Ok(v) = serde_json::from_slice::<T>(data) {
        let text = match serde_json::to_vec(&v) {
            Ok(t) => t,
            Err(e) => panic!("a parsed value does not serialize: {e}"),
        };
        match serde_json::from_slice::<T>(&text) {
            Ok(again) => assert_eq!(v, again, "round trip changed the value"),
            Err(e) => panic!(
                "serialized value does not parse back: {e}: {}",
                String::from_utf8_lossy(&text)
            ),
        }
    }
}

fn agent_message(_: &mut State, data: &[u8]) {
    roundtrip::<AgentRequest>(data);
    roundtrip::<AgentResponse>(data);
    roundtrip::<Hello>(data);
    roundtrip::<Welcome>(data);
}

fn agent_mux(state: &mut State, data: &[u8]) {
    let config = MuxConfig {
        max_frame_len: MAX_FRAME_LEN,
        max_streams: 8,
    };
    let ended = state.rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(2), async {
            // Server: the bytes come from a client.
            let (ours, theirs) = tokio::io::duplex(64 * 1024);
            let (mux, mut incoming) = Mux::server(ours, config);
            let peer = feed_peer(theirs, data.to_vec());
            let accept = async {
                while let Some(mut stream) = incoming.accept().await {
                    tokio::spawn(async move { while stream.recv().await.is_some() {} });
                }
            };
            tokio::join!(peer, accept);
            drop(mux);

            // Client: the bytes come from an agent.
            let (ours, theirs) = tokio::io::duplex(64 * 1024);
            let mux = Mux::client(ours, config);
            let peer = feed_peer(theirs, data.to_vec());
            let requests = async {
                let mut streams = Vec::new();
                for _ in 0..2 {
                    if let Ok(s) = mux.open_with_msg(&AgentRequest::BgList) {
                        streams.push(s);
                    }
                }
                for mut s in streams {
                    while s.recv().await.is_some() {}
                }
            };
            tokio::join!(peer, requests);
        })
        .await
        .is_ok()
    });
    assert!(ended, "the mux did not finish within its time bound");
}

/// Writes `data` as the peer, then closes its write side, while draining
/// whatever the mux sends.
async fn feed_peer(io: tokio::io::DuplexStream, data: Vec<u8>) {
    let (mut rd, mut wr) = tokio::io::split(io);
    let drain = async {
        let mut buf = vec![0u8; 16 * 1024];
        while matches!(rd.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    let write = async {
        let _ = wr.write_all(&data).await;
        let _ = wr.shutdown().await;
    };
    tokio::join!(drain, write);
}

fn qcow2(state: &mut State, data: &[u8]) {
    let path = &state.file;
    let written = std::fs::File::create(path).and_then(|mut f| f.write_all(data));
    if let Err(e) = written {
        panic!("cannot write the scratch image: {e}");
    }
    let _ = tine_disk::info(path);
    let _ = tine_disk::check(path);
    let _ = tine_disk::backing_chain(path);
    if let Ok(mut disk) = tine_disk::open_disk(path, true) {
        let size = disk.size();
        let mut buf = [0u8; 4096];
        for offset in [
            0,
            512,
            size / 2,
            size.saturating_sub(512),
            size,
            u64::MAX - 511,
        ] {
            let _ = disk.read_at(&mut buf[..512], offset & !511);
        }
        let _ = disk.read_at(&mut buf, 0);
    }
}

fn snapshot_state(_: &mut State, data: &[u8]) {
    use tine_vmm::snapshot::format;
    use tine_vmm::vmm::MicrovmState;
    let _ = format::decode::<MicrovmState>(data);
    let _ = format::read::<MicrovmState>(&mut &data[..]);
    // The CRC stops almost every mutant before the payload decoder; wrap
    // the bytes as a payload with a correct header and CRC so the decoder
    // of the state itself is fuzzed too.
    let mut file = Vec::with_capacity(data.len() + 24);
    file.extend_from_slice(format::MAGIC);
    file.extend_from_slice(&format::FORMAT_VERSION.to_le_bytes());
    file.extend_from_slice(&(data.len() as u64).to_le_bytes());
    file.extend_from_slice(data);
    file.extend_from_slice(&crc32fast::hash(data).to_le_bytes());
    if let Ok(state) = format::decode::<MicrovmState>(&file) {
        // What decodes encodes again.
        if let Err(e) = format::encode(&state) {
            panic!("a decoded state does not encode: {e}");
        }
    }
}

fn vmm_event(_: &mut State, data: &[u8]) {
    use tine_proto::vmm::{Event, Request, Response};
    let line = String::from_utf8_lossy(data);
    if let Ok(event) = Event::from_line(&line) {
        let text = match serde_json::to_string(&event) {
            Ok(t) => t,
            Err(e) => panic!("an event does not serialize: {e}"),
        };
        match Event::from_line(&text) {
            Ok(again) => assert_eq!(event, again, "event round trip changed it"),
            Err(e) => panic!("an event does not parse back: {e}: {text}"),
        }
    }
    roundtrip::<Request>(data);
    roundtrip::<Response>(data);
}

fn rest_query(_: &mut State, data: &[u8]) {
    use tine_daemon::api;
    use tine_proto::api as wire;

    let mut uris = Vec::new();
    if let Ok(u) = axum::http::Uri::try_from(data) {
        uris.push(u);
    }
    let mut prefixed = b"/vm?".to_vec();
    prefixed.extend_from_slice(data);
    if let Ok(u) = axum::http::Uri::try_from(prefixed) {
        uris.push(u);
    }
    for uri in &uris {
        let pairs = api::query_pairs(uri);
        let _ = api::parse_query_enum::<wire::Wait>(&pairs, "wait");
        let _ = api::parse_query_enum::<wire::TagMode>(&pairs, "tag_mode");
        let _ = api::parse_query_enum::<wire::CommitMode>(&pairs, "mode");
        let _ = api::parse_query_enum::<wire::ShutdownAction>(&pairs, "action");
        let _ = api::parse_query_enum::<wire::NetworkMode>(&pairs, "network");
        let _ = api::query_num::<u64>(&pairs, "limit");
        let _ = api::query_only(&pairs, &["wait", "timeout", "mode"]);
        let _ = api::parse_timeout(api::query_get(&pairs, "timeout"), Duration::from_secs(30));
    }
    let text = String::from_utf8_lossy(data);
    let _ = api::parse_timeout(Some(&text), Duration::from_secs(30));
    let body = bytes::Bytes::copy_from_slice(data);
    let _ = api::parse_json::<wire::CreateVmRequest>(&body);
    let _ = api::parse_json::<wire::ForkRequest>(&body);
    let _ = api::parse_json::<wire::CommitRequest>(&body);
    let _ = api::parse_json::<wire::TagsPatch>(&body);
}

/// A disk held in memory, so the block target does no file I/O.
#[derive(Debug)]
struct MemDisk(Vec<u8>);

impl tine_disk::BlockBackend for MemDisk {
    fn size(&self) -> u64 {
        self.0.len() as u64
    }

    fn is_read_only(&self) -> bool {
        false
    }

    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        tine_disk::check_range(offset, buf.len(), self.size())?;
        let at = offset as usize;
        buf.copy_from_slice(&self.0[at..at + buf.len()]);
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        tine_disk::check_range(offset, buf.len(), self.size())?;
        let at = offset as usize;
        self.0[at..at + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Guest memory of the block target: the fuzz bytes are laid out from
/// address 0, where the descriptor table (16 entries), the available ring
/// (at 0x100) and the used ring (at 0x200) of a 16-entry queue live, so
/// the input is the descriptor table, the ring and the request buffers.
const BLK_MEM: usize = 64 * 1024;
const BLK_QUEUE: u16 = 16;

/// Guest memory of the device targets: `BLK_MEM` bytes from address 0,
/// the input copied to its start.
fn guest_memory(data: &[u8]) -> tine_vmm::vstate::memory::GuestMemoryMmap {
    use vm_memory::{Bytes, GuestAddress};
    let mem =
        match tine_vmm::vstate::memory::GuestMemoryMmap::from_ranges(&[(GuestAddress(0), BLK_MEM)])
        {
            Ok(m) => m,
            Err(e) => panic!("cannot make guest memory: {e}"),
        };
    let len = data.len().min(BLK_MEM);
    if let Err(e) = mem.write_slice(&data[..len], GuestAddress(0)) {
        panic!("cannot fill guest memory: {e}");
    }
    mem
}

/// A device's interrupt line.
fn interrupt() -> std::sync::Arc<tine_vmm::devices::virtio::IrqTrigger> {
    match tine_vmm::devices::virtio::IrqTrigger::new() {
        Ok(i) => std::sync::Arc::new(i),
        Err(e) => panic!("cannot make an eventfd: {e}"),
    }
}

/// Makes `q` a ready 16-entry queue with its descriptor table at `base`,
/// its available ring at `base + 0x100` and its used ring at
/// `base + 0x200`.
fn place_queue(q: &mut virtio_queue::Queue, base: u64) {
    use virtio_queue::QueueT;
    q.set_size(BLK_QUEUE);
    q.set_desc_table_address(Some(base as u32), Some(0));
    q.set_avail_ring_address(Some((base + 0x100) as u32), Some(0));
    q.set_used_ring_address(Some((base + 0x200) as u32), Some(0));
    q.set_ready(true);
}

fn virtio_blk_queue(_: &mut State, data: &[u8]) {
    let _ = blk_process(data);
}

/// Runs the block device over `data` laid out as guest memory; returns
/// the memory afterwards (`None` when the queue does not activate).
fn blk_process(data: &[u8]) -> Option<tine_vmm::vstate::memory::GuestMemoryMmap> {
    use tine_vmm::devices::virtio::block::{Block, BlockConfig};
    use tine_vmm::devices::virtio::VirtioDevice;
    use virtio_queue::QueueT;

    let mem = guest_memory(data);
    let config = BlockConfig {
        path: PathBuf::from("fuzz"),
        read_only: data.first().is_some_and(|b| b & 1 == 1),
        serial: "fuzz".into(),
    };
    let mut dev = Block::new(config, Box::new(MemDisk(vec![0x5a; 64 * 1024])));
    {
        let common = dev.common_mut();
        common.acked_features = common.avail_features;
        let q = common.queues.get_mut(0)?;
        place_queue(q, 0);
        q.set_event_idx(data.get(1).is_some_and(|b| b & 1 == 1));
    }
    let irq = interrupt();
    dev.activate(mem.clone(), irq).ok()?;
    // Twice: the second pass sees the rings as the first left them.
    dev.process_queue(0);
    dev.process_queue(0);
    let mut cfg = [0u8; 8];
    for off in [0u64, 8, 12, 20, 56, 60, 4096] {
        dev.read_config(off, &mut cfg);
    }
    Some(mem)
}

/// Guest memory of the vsock target: like the block target's, with the
/// RX, TX and event queues (16 entries each) at 0, 0x400 and 0x800 (each
/// a descriptor table, an available ring at +0x100 and a used ring at
/// +0x200); packet buffers are wherever the descriptors point.
fn vsock_packet(state: &mut State, data: &[u8]) {
    let _ = vsock_process(state, data);
}

/// Runs the vsock device over `data` laid out as guest memory; returns
/// the memory afterwards (`None` when the queues do not activate).
fn vsock_process(
    state: &mut State,
    data: &[u8],
) -> Option<tine_vmm::vstate::memory::GuestMemoryMmap> {
    use tine_vmm::devices::virtio::vsock::{Vsock, EVQ, RXQ, TXQ};
    use tine_vmm::devices::virtio::VirtioDevice;

    let uds = state.file.with_extension("vsock");
    let _ = std::fs::remove_file(&uds);
    let Ok(mut dev) = Vsock::new(3, uds.clone()) else {
        panic!("cannot start a vsock device at {}", uds.display());
    };
    let mem = guest_memory(data);
    {
        let common = dev.common_mut();
        common.acked_features = common.avail_features;
        for (i, q) in common.queues.iter_mut().enumerate() {
            place_queue(q, 0x400 * i as u64);
        }
    }
    let irq = interrupt();
    let activated = dev.activate(mem.clone(), irq).is_ok();
    if activated {
        for q in [TXQ, RXQ, EVQ, TXQ, RXQ] {
            dev.process_queue(q);
        }
    }
    drop(dev);
    let _ = std::fs::remove_file(&uds);
    activated.then_some(mem)
}

/// Where the net target's host frames start in the input: the bytes
/// from here on, cut into frames by 2-byte big-endian lengths, are what
/// the host side sends to the guest.
pub const NET_HOST_FRAMES: usize = 0x3000;

/// The host side of the net target: one end of a datagram socket pair.
#[derive(Debug)]
struct SocketBackend(std::os::unix::net::UnixDatagram);

impl tine_vmm::devices::virtio::net::NetBackend for SocketBackend {
    fn recv(
        &mut self,
        hdr: &mut [u8; tine_vmm::devices::virtio::net::VNET_HDR_LEN],
        frame: &mut [u8],
    ) -> std::io::Result<usize> {
        *hdr = [0; tine_vmm::devices::virtio::net::VNET_HDR_LEN];
        self.0.recv(frame)
    }

    fn send(
        &mut self,
        _hdr: &[u8; tine_vmm::devices::virtio::net::VNET_HDR_LEN],
        frame: &[u8],
    ) -> std::io::Result<usize> {
        self.0.send(frame)
    }

    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.0.as_raw_fd()
    }

    fn name(&self) -> &str {
        ""
    }
}

/// Guest memory of the net target: the RX and TX queues (16 entries each)
/// at 0 and 0x400, laid out like the vsock target's.
fn virtio_net_queue(_: &mut State, data: &[u8]) {
    let _ = net_process(data);
}

/// Guest memory and what the guest sent to the host.
type NetOutcome = (tine_vmm::vstate::memory::GuestMemoryMmap, Vec<Vec<u8>>);

/// Runs the net device over `data` laid out as guest memory, with host
/// frames cut from `data[NET_HOST_FRAMES..]`; returns the memory and what
/// the guest sent to the host (`None` when the queues do not activate).
fn net_process(data: &[u8]) -> Option<NetOutcome> {
    use tine_vmm::devices::virtio::net::{Net, RX_QUEUE_INDEX, TX_QUEUE_INDEX};
    use tine_vmm::devices::virtio::VirtioDevice;

    let (device_end, host_end) = match std::os::unix::net::UnixDatagram::pair() {
        Ok(p) => p,
        Err(e) => panic!("cannot make a socket pair: {e}"),
    };
    for end in [&device_end, &host_end] {
        if let Err(e) = end.set_nonblocking(true) {
            panic!("cannot make a socket non-blocking: {e}");
        }
    }
    let mut rest = data.get(NET_HOST_FRAMES..).unwrap_or_default();
    while let [hi, lo, tail @ ..] = rest {
        let len = (usize::from(*hi) << 8 | usize::from(*lo)).min(tail.len());
        let (frame, after) = tail.split_at(len);
        // A full socket buffer only means fewer frames for this case.
        if host_end.send(frame).is_err() {
            break;
        }
        rest = after;
    }
    let mem = guest_memory(data);
    let mac = [0x02, 0, 0, 0, 0, 1];
    let mut dev = match Net::new(Box::new(SocketBackend(device_end)), mac) {
        Ok(d) => d,
        Err(e) => panic!("cannot make a net device: {e}"),
    };
    {
        let common = dev.common_mut();
        common.acked_features = common.avail_features;
        for (i, q) in common.queues.iter_mut().enumerate() {
            place_queue(q, 0x400 * i as u64);
        }
    }
    let irq = interrupt();
    dev.activate(mem.clone(), irq).ok()?;
    let host_fd = dev.host_fds().first().map(|(fd, _)| *fd);
    dev.process_queue(TX_QUEUE_INDEX);
    if let Some(fd) = host_fd {
        dev.process_host_event(fd, libc::EPOLLIN as u32);
    }
    dev.process_queue(RX_QUEUE_INDEX);
    dev.process_queue(TX_QUEUE_INDEX);
    let mut cfg = [0u8; 8];
    for off in [0u64, 6, 8, 4096] {
        dev.read_config(off, &mut cfg);
    }
    let mut sent = Vec::new();
    let mut buf = vec![0u8; 70 * 1024];
    while let Ok(n) = host_end.recv(&mut buf) {
        sent.push(buf[..n].to_vec());
    }
    Some((mem, sent))
}

/// Guest memory of the rng target: one 16-entry queue at 0, like the
/// block target's.
fn virtio_rng_queue(_: &mut State, data: &[u8]) {
    let _ = rng_process(data);
}

/// Runs the entropy device over `data` laid out as guest memory; returns
/// the memory afterwards (`None` when the queue does not activate).
fn rng_process(data: &[u8]) -> Option<tine_vmm::vstate::memory::GuestMemoryMmap> {
    use tine_vmm::devices::virtio::rng::Rng;
    use tine_vmm::devices::virtio::VirtioDevice;
    use virtio_queue::QueueT;

    let mem = guest_memory(data);
    let mut dev = Rng::new();
    {
        let common = dev.common_mut();
        common.acked_features = common.avail_features;
        let q = common.queues.get_mut(0)?;
        place_queue(q, 0);
        q.set_event_idx(data.first().is_some_and(|b| b & 1 == 1));
    }
    let irq = interrupt();
    dev.activate(mem.clone(), irq).ok()?;
    dev.process_queue(0);
    dev.process_queue(0);
    Some(mem)
}

/// The bytes as what a client sends on the shell WebSocket after the
/// upgrade: WebSocket frames (masked or not, fragmented, control frames)
/// read as the daemon reads them, each binary message through the shell
/// protocol; text messages go through the forward target parsers.
fn ws_shell(state: &mut State, data: &[u8]) {
    let _ = ws_messages(state, data);
}

/// Reads `data` as a client's WebSocket stream; returns the shell inputs
/// of the binary messages read before the stream ended or failed.
fn ws_messages(state: &mut State, data: &[u8]) -> Vec<String> {
    use futures_util::StreamExt;
    use tine_proto::api::shell;
    use tokio_tungstenite::tungstenite::protocol::Role;
    use tokio_tungstenite::tungstenite::Message;

    let data = data.to_vec();
    state.rt.block_on(async move {
        let (server, mut client) = tokio::io::duplex(64 * 1024);
        let feed = tokio::spawn(async move {
            // The server may stop reading first: a failed write ends the feed.
            let _ = client.write_all(&data).await;
            let _ = client.shutdown().await;
            client
        });
        let mut ws =
            tokio_tungstenite::WebSocketStream::from_raw_socket(server, Role::Server, None).await;
        let mut seen = Vec::new();
        while let Some(Ok(msg)) = ws.next().await {
            match msg {
                Message::Binary(bytes) => seen.push(format!("{:?}", shell::input(&bytes))),
                Message::Text(text) => {
                    let _ = tine_daemon::api::parse_target(text.as_str());
                    let _ = tine_daemon::api::parse_upstream(text.as_str());
                }
                _ => {}
            }
        }
        drop(ws);
        let _ = feed.await;
        seen
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_every_target_runs_its_seeds() {
        for t in ALL {
            let mut state = (t.init)();
            for seed in crate::load_corpus(t.name) {
                (t.run)(&mut state, &seed);
            }
        }
    }

    #[test]
    fn test_frame_seeds_decode_whole() {
        for seed in crate::load_corpus("agent_frame") {
            let (frames, clean) = decode_all(&seed, MAX_FRAME_LEN);
            assert!(clean && !frames.is_empty());
        }
    }

    #[test]
    fn test_blk_seeds_complete_their_request() {
        use vm_memory::{Bytes, GuestAddress};
        for seed in crate::load_corpus("virtio_blk_queue") {
            let mem = blk_process(&seed).expect("queue activates");
            let used_idx: u16 = mem.read_obj(GuestAddress(0x202)).expect("used idx");
            assert_eq!(used_idx, 1, "the request was used");
            let status: u8 = mem.read_obj(GuestAddress(0x800)).expect("status");
            assert_eq!(status, 0, "the request succeeded");
        }
    }

    #[test]
    fn test_net_seeds_send_and_receive_frames() {
        use vm_memory::{Bytes, GuestAddress};
        let seeds = crate::load_corpus("virtio_net_queue");
        assert!(!seeds.is_empty());
        for seed in seeds {
            let (mem, sent) = net_process(&seed).expect("queues activate");
            assert_eq!(sent.len(), 1, "the guest's TX frame reached the host");
            let rx_used: u16 = mem.read_obj(GuestAddress(0x202)).expect("rx used idx");
            assert_eq!(rx_used, 1, "the host's frame reached the guest");
        }
    }

    #[test]
    fn test_rng_seeds_are_filled() {
        use vm_memory::{Bytes, GuestAddress};
        let seeds = crate::load_corpus("virtio_rng_queue");
        assert!(!seeds.is_empty());
        for seed in seeds {
            let mem = rng_process(&seed).expect("queue activates");
            let used_idx: u16 = mem.read_obj(GuestAddress(0x202)).expect("used idx");
            assert_eq!(used_idx, 1, "the buffer was used");
            let len = u32::from_le_bytes(seed[8..12].try_into().expect("4 bytes"));
            let written: u32 = mem.read_obj(GuestAddress(0x204 + 4)).expect("used len");
            if 0x1000 + u64::from(len) <= BLK_MEM as u64 {
                assert_eq!(written, len, "the whole buffer was filled");
                let mut filled = [0u8; 64];
                mem.read_slice(&mut filled, GuestAddress(0x1000))
                    .expect("buffer");
                assert!(filled.iter().any(|b| *b != 0), "entropy was written");
            } else {
                assert!(
                    u64::from(written) <= BLK_MEM as u64,
                    "a buffer past guest memory was written in part at most: {written}"
                );
            }
        }
    }

    #[test]
    fn test_ws_seeds_reach_the_shell_protocol() {
        let mut state = init();
        let seeds = crate::load_corpus("ws_shell");
        assert!(!seeds.is_empty());
        for seed in seeds {
            let inputs = ws_messages(&mut state, &seed);
            assert!(
                inputs.iter().any(|i| i != "Ignored"),
                "a seed's messages all read as ignored: {inputs:?}"
            );
        }
    }

    #[test]
    fn test_vsock_seeds_are_consumed() {
        use vm_memory::{Bytes, GuestAddress};
        let mut state = init();
        for seed in crate::load_corpus("vsock_packet") {
            let mem = vsock_process(&mut state, &seed).expect("queues activate");
            let tx_used: u16 = mem.read_obj(GuestAddress(0x602)).expect("tx used idx");
            assert_eq!(tx_used, 1, "the TX packet was consumed");
        }
    }
}
