//! Seed inputs, made with the real encoders (`--write-corpus`).

use std::io;
use std::path::Path;

use tine_proto::agent::frame::{Frame, FrameKind};
use tine_proto::agent::{ExecRequest, Hello, ProtocolVersion, Request, Response, Welcome};
use tine_proto::agent::{MAX_FRAME_LEN, PROTOCOL_VERSION};

fn json<T: serde::Serialize>(v: &T) -> io::Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(io::Error::other)
}

fn frames(list: &[(u32, FrameKind, Vec<u8>)]) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    for (stream, kind, payload) in list {
        Frame::new(*stream, *kind, payload.clone())
            .encode_into(&mut out)
            .map_err(io::Error::other)?;
    }
    Ok(out)
}

fn hello() -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        client: "tine-fuzz".into(),
    }
}

fn welcome() -> Welcome {
    Welcome {
        version: ProtocolVersion { major: 1, minor: 0 },
        agent_version: "0.1.0".into(),
        max_frame_len: MAX_FRAME_LEN,
        stream_window: 256 * 1024,
    }
}

fn agent_frames() -> io::Result<Vec<Vec<u8>>> {
    let exec = json(&Request::Exec(ExecRequest::argv(["ls", "-l"])))?;
    Ok(vec![
        frames(&[(0, FrameKind::Msg, json(&hello())?)])?,
        frames(&[
            (1, FrameKind::Msg, exec.clone()),
            (1, FrameKind::Data, b"stdin bytes".to_vec()),
            (1, FrameKind::Eof, vec![FrameKind::Data as u8]),
        ])?,
        frames(&[
            (1, FrameKind::Msg, json(&Response::Started { pid: 42 })?),
            (1, FrameKind::Stdout, b"out".to_vec()),
            (1, FrameKind::Stderr, b"err".to_vec()),
            (1, FrameKind::Window, 4096u32.to_be_bytes().to_vec()),
            (3, FrameKind::Msg, exec),
            (1, FrameKind::Eof, vec![FrameKind::Stdout as u8]),
            (3, FrameKind::Close, Vec::new()),
        ])?,
    ])
}

fn qcow2_images(dir: &Path) -> io::Result<Vec<Vec<u8>>> {
    let err = io::Error::other;
    let empty = dir.join("empty.qcow2");
    tine_disk::create(
        &empty,
        &tine_disk::CreateOptions {
            virtual_size: Some(64 * 1024),
            cluster_size: 512,
            ..Default::default()
        },
    )
    .map_err(err)?;
    let written = dir.join("written.qcow2");
    std::fs::copy(&empty, &written)?;
    {
        let mut disk = tine_disk::open_disk(&written, false).map_err(err)?;
        disk.write_at(&[0xa5; 1024], 0)?;
        disk.write_at(&[0x5a; 512], 32 * 1024)?;
        disk.flush()?;
    }
    std::fs::write(dir.join("base.raw"), [0u8; 4096])?;
    let overlay = dir.join("overlay.qcow2");
    tine_disk::create(
        &overlay,
        &tine_disk::CreateOptions {
            virtual_size: Some(4096),
            cluster_size: 512,
            backing: Some(("base.raw".into(), tine_disk::Format::Raw)),
            durability: tine_disk::Durability::Synced,
        },
    )
    .map_err(err)?;
    Ok(vec![
        std::fs::read(&empty)?,
        std::fs::read(&written)?,
        std::fs::read(&overlay)?,
    ])
}

fn snapshot_states() -> io::Result<Vec<Vec<u8>>> {
    use tine_vmm::snapshot::format;
    // A whole MicrovmState needs a live VM; seed with containers of small
    // payloads so that the header checks and the postcard decoder start
    // from something well formed.
    let e = |r: Result<Vec<u8>, format::FormatError>| r.map_err(io::Error::other);
    Ok(vec![
        e(format::encode(&(4096u64 << 20, "tine-v1".to_owned(), 7u64)))?,
        e(format::encode(&vec![0u8; 64]))?,
        e(format::encode(&()))?,
    ])
}

fn vmm_lines() -> io::Result<Vec<Vec<u8>>> {
    use tine_proto::vmm::{Event, Request};
    Ok(vec![
        json(&Event::Ready { pid: 1234 })?,
        json(&Request::Status)?,
        json(&Request::Snapshot {
            state_path: "state".into(),
            mem_path: "mem".into(),
        })?,
        json(&Request::Restore {
            state_path: "state".into(),
            mem_path: "mem".into(),
            paused: true,
            vsock_uds: Some("v.sock".into()),
            drives: [("drive0".to_owned(), "disk.qcow2".into())].into(),
            taps: [("net0".to_owned(), "tap0".to_owned())].into(),
            serial_log: Some("serial.log".into()),
        })?,
        br#"{"status":"ok","state":"running"}"#.to_vec(),
        br#"{"status":"error","message":"no"}"#.to_vec(),
    ])
}

fn rest_inputs() -> io::Result<Vec<Vec<u8>>> {
    use tine_proto::api::{CommitRequest, CreateVmRequest, ForkRequest, TagsPatch};
    let create = CreateVmRequest {
        cpus: Some(2),
        ram_bytes: Some(512 << 20),
        tags: vec!["a".into(), "b=c".into()],
        name: Some("web".into()),
        ..Default::default()
    };
    Ok(vec![
        b"wait=agent&timeout=30s&tag_mode=merge".to_vec(),
        b"/vm/x/exec?timeout=1.5&mode=disk&limit=10&wait=none".to_vec(),
        b"action=poweroff&timeout=500ms&network=nat%20x&a=%ff".to_vec(),
        json(&create)?,
        json(&ForkRequest::default())?,
        json(&CommitRequest::default())?,
        json(&TagsPatch::default())?,
    ])
}

/// A guest memory image for `virtio_blk_queue`: descriptor table at 0,
/// available ring at 0x100, one request of type `kind` (header at 0x400,
/// 512 data bytes at 0x600, status byte at 0x800).
fn blk_request(kind: u32, sector: u64) -> Vec<u8> {
    const WRITE: u16 = 2;
    const NEXT: u16 = 1;
    let mut mem = vec![0u8; 0x801];
    let device_writes = kind != 1;
    let descs: [(u64, u32, u16); 3] = [
        (0x400, 16, NEXT),
        (0x600, 512, NEXT | if device_writes { WRITE } else { 0 }),
        (0x800, 1, WRITE),
    ];
    for (i, (addr, len, flags)) in descs.iter().enumerate() {
        let d = &mut mem[16 * i..16 * i + 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        let next = if i + 1 < descs.len() { i as u16 + 1 } else { 0 };
        d[14..16].copy_from_slice(&next.to_le_bytes());
    }
    // avail: flags 0, idx 1, ring[0] = head 0.
    mem[0x102..0x104].copy_from_slice(&1u16.to_le_bytes());
    mem[0x400..0x404].copy_from_slice(&kind.to_le_bytes());
    mem[0x408..0x410].copy_from_slice(&sector.to_le_bytes());
    mem[0x600..0x800].fill(0xc3);
    mem
}

/// A guest memory image for `vsock_packet`: one TX packet (44-byte header
/// at 0x1000, `payload` at 0x1100) of type `op` from guest port 1024 to
/// host port 52, and two 4 KiB RX buffers at 0x2000 and 0x3000.
fn vsock_tx(op: u16, payload: &[u8]) -> Vec<u8> {
    const WRITE: u16 = 2;
    const NEXT: u16 = 1;
    let mut mem = vec![0u8; 0x1100 + payload.len()];
    let put_desc = |mem: &mut Vec<u8>, at: usize, addr: u64, len: u32, flags: u16, next: u16| {
        mem[at..at + 8].copy_from_slice(&addr.to_le_bytes());
        mem[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
        mem[at + 12..at + 14].copy_from_slice(&flags.to_le_bytes());
        mem[at + 14..at + 16].copy_from_slice(&next.to_le_bytes());
    };
    // RX queue at 0: two writable buffers offered.
    put_desc(&mut mem, 0, 0x2000, 4096, WRITE, 0);
    put_desc(&mut mem, 16, 0x3000, 4096, WRITE, 0);
    mem[0x102..0x104].copy_from_slice(&2u16.to_le_bytes());
    mem[0x106..0x108].copy_from_slice(&1u16.to_le_bytes());
    // TX queue at 0x400: header then payload.
    let chained = !payload.is_empty();
    put_desc(
        &mut mem,
        0x400,
        0x1000,
        44,
        if chained { NEXT } else { 0 },
        1,
    );
    if chained {
        put_desc(&mut mem, 0x410, 0x1100, payload.len() as u32, 0, 0);
    }
    mem[0x502..0x504].copy_from_slice(&1u16.to_le_bytes());
    // The packet header: src_cid, dst_cid, src_port, dst_port, len, type,
    // op, flags, buf_alloc, fwd_cnt.
    let h = &mut mem[0x1000..0x102c];
    h[0..8].copy_from_slice(&3u64.to_le_bytes());
    h[8..16].copy_from_slice(&2u64.to_le_bytes());
    h[16..20].copy_from_slice(&1024u32.to_le_bytes());
    h[20..24].copy_from_slice(&52u32.to_le_bytes());
    h[24..28].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    h[28..30].copy_from_slice(&1u16.to_le_bytes());
    h[30..32].copy_from_slice(&op.to_le_bytes());
    h[36..40].copy_from_slice(&65536u32.to_le_bytes());
    mem[0x1100..].copy_from_slice(payload);
    mem
}

/// A guest memory image for `virtio_net_queue`: a 2 KiB RX buffer offered
/// at 0x2000 (RX queue at 0), one TX chain at 0x400 (its 12-byte header at
/// 0x1000, a 60-byte frame at 0x1100), and one 60-byte host frame at
/// `NET_HOST_FRAMES` (2-byte length first).
fn net_frames(ethertype: u16) -> Vec<u8> {
    const WRITE: u16 = 2;
    const NEXT: u16 = 1;
    let host_frames = crate::targets::NET_HOST_FRAMES;
    let mut mem = vec![0u8; host_frames + 2 + 60];
    let put_desc = |mem: &mut Vec<u8>, at: usize, addr: u64, len: u32, flags: u16, next: u16| {
        mem[at..at + 8].copy_from_slice(&addr.to_le_bytes());
        mem[at + 8..at + 12].copy_from_slice(&len.to_le_bytes());
        mem[at + 12..at + 14].copy_from_slice(&flags.to_le_bytes());
        mem[at + 14..at + 16].copy_from_slice(&next.to_le_bytes());
    };
    put_desc(&mut mem, 0, 0x2000, 2048, WRITE, 0);
    mem[0x102..0x104].copy_from_slice(&1u16.to_le_bytes());
    put_desc(&mut mem, 0x400, 0x1000, 12, NEXT, 1);
    put_desc(&mut mem, 0x410, 0x1100, 60, 0, 0);
    mem[0x502..0x504].copy_from_slice(&1u16.to_le_bytes());
    let frame = |dst: [u8; 6], src: [u8; 6]| {
        let mut f = vec![0u8; 60];
        f[..6].copy_from_slice(&dst);
        f[6..12].copy_from_slice(&src);
        f[12..14].copy_from_slice(&ethertype.to_be_bytes());
        f
    };
    let guest = frame([0xff; 6], [0x02, 0, 0, 0, 0, 1]);
    mem[0x1100..0x1100 + 60].copy_from_slice(&guest);
    let host = frame([0x02, 0, 0, 0, 0, 1], [0x02, 0, 0, 0, 0, 2]);
    mem[host_frames..host_frames + 2].copy_from_slice(&60u16.to_be_bytes());
    mem[host_frames + 2..].copy_from_slice(&host);
    mem
}

/// A guest memory image for `virtio_rng_queue`: one writable buffer of
/// `len` bytes at 0x1000.
fn rng_request(len: u32) -> Vec<u8> {
    const WRITE: u16 = 2;
    let mut mem = vec![0u8; 0x1000];
    mem[0..8].copy_from_slice(&0x1000u64.to_le_bytes());
    mem[8..12].copy_from_slice(&len.to_le_bytes());
    mem[12..14].copy_from_slice(&WRITE.to_le_bytes());
    mem[0x102..0x104].copy_from_slice(&1u16.to_le_bytes());
    mem
}

/// One masked client WebSocket frame (RFC 6455 5.2).
fn ws_frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
    let key = [0x37u8, 0xfa, 0x21, 0x3d];
    let mut out = vec![if fin { 0x80 } else { 0 } | opcode];
    match payload.len() {
        n @ 0..=125 => out.push(0x80 | n as u8),
        n @ 126..=0xffff => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&key);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    out
}

/// Client streams of the shell WebSocket: data, a resize, a ping, a
/// fragmented message, a text forward target, heartbeat, shutdown, close.
fn ws_streams() -> Vec<Vec<u8>> {
    use tine_proto::api::shell;
    const TEXT: u8 = 1;
    const BINARY: u8 = 2;
    const CONTINUATION: u8 = 0;
    const CLOSE: u8 = 8;
    const PING: u8 = 9;
    let mut size = 132u32.to_be_bytes().to_vec();
    size.extend_from_slice(&43u32.to_be_bytes());
    let data = shell::encode(shell::DATA, b"ls -l\r");
    let (head, tail) = data.split_at(3);
    vec![
        ws_frame(true, BINARY, &shell::encode(shell::DATA, b"echo hi\r")),
        [
            ws_frame(true, BINARY, &shell::encode(shell::WINDOW_SIZE, &size)),
            ws_frame(true, PING, b"p"),
            ws_frame(true, BINARY, &shell::encode(shell::HEARTBEAT, b"")),
            ws_frame(true, BINARY, &shell::encode(shell::SHUTDOWN, b"")),
        ]
        .concat(),
        [
            ws_frame(true, TEXT, b"tcp:127.0.0.1:8080"),
            ws_frame(false, BINARY, head),
            ws_frame(true, CONTINUATION, tail),
            ws_frame(true, CLOSE, &1000u16.to_be_bytes()),
        ]
        .concat(),
    ]
}

/// Writes every target's seeds under `root`; returns how many files.
pub fn write_all(root: &Path) -> io::Result<usize> {
    let scratch = tempfile::tempdir()?;
    let mut messages = vec![
        json(&Request::Exec(
            ExecRequest::argv(["sh", "-c", "echo hi"]).env("A", "1"),
        ))?,
        json(&Request::BgList)?,
        json(&hello())?,
        json(&welcome())?,
        json(&Response::Welcome(welcome()))?,
        json(&Response::Started { pid: 7 })?,
        json(&Response::Ok)?,
    ];
    messages.dedup();
    let sets: Vec<(&str, Vec<Vec<u8>>)> = vec![
        ("agent_frame", agent_frames()?),
        ("agent_message", messages),
        ("agent_mux", agent_frames()?),
        ("qcow2", qcow2_images(scratch.path())?),
        ("snapshot_state", snapshot_states()?),
        ("vmm_event", vmm_lines()?),
        ("rest_query", rest_inputs()?),
        (
            "virtio_blk_queue",
            vec![
                blk_request(0, 0),
                blk_request(1, 3),
                blk_request(4, 0),
                blk_request(8, 0),
            ],
        ),
        (
            "vsock_packet",
            vec![vsock_tx(1, b""), vsock_tx(5, b"hello"), vsock_tx(3, b"")],
        ),
        (
            "virtio_net_queue",
            vec![net_frames(0x0800), net_frames(0x0806)],
        ),
        (
            "virtio_rng_queue",
            vec![rng_request(64), rng_request(4096), rng_request(u32::MAX)],
        ),
        ("ws_shell", ws_streams()),
    ];
    let mut n = 0;
    for (target, seeds) in sets {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        for (i, seed) in seeds.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:02}")), seed)?;
            n += 1;
        }
    }
    Ok(n)
}
