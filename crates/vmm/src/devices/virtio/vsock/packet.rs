//! The virtio-vsock packet header (`struct virtio_vsock_hdr`, virtio spec
//! 5.10.6) and the protocol constants that go with it.
//!
//! The header is encoded and decoded field by field in little endian, so no
//! `unsafe` reinterpretation of guest bytes is needed.

/// Size of the packet header on the wire.
pub const HDR_SIZE: usize = 44;

/// The host's CID: the only destination a guest may address.
pub const HOST_CID: u64 = 2;

/// Connection request.
pub const OP_REQUEST: u16 = 1;
/// Connection response (accepts a request).
pub const OP_RESPONSE: u16 = 2;
/// Forced termination of a connection.
pub const OP_RST: u16 = 3;
/// Clean shutdown of one or both directions.
pub const OP_SHUTDOWN: u16 = 4;
/// Stream data.
pub const OP_RW: u16 = 5;
/// Unsolicited flow-control credit update.
pub const OP_CREDIT_UPDATE: u16 = 6;
/// Request for a credit update.
pub const OP_CREDIT_REQUEST: u16 = 7;

/// Shutdown flag: the sender will receive no more data.
pub const SHUTDOWN_RCV: u32 = 1;
/// Shutdown flag: the sender will send no more data.
pub const SHUTDOWN_SEND: u32 = 2;
/// Both shutdown flags.
pub const SHUTDOWN_BOTH: u32 = SHUTDOWN_RCV | SHUTDOWN_SEND;

/// Socket type: stream, the only type this device supports.
pub const TYPE_STREAM: u16 = 1;

/// Event ID of `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`.
pub const EVENT_TRANSPORT_RESET: u32 = 0;
/// Size of `struct virtio_vsock_event`.
pub const EVENT_SIZE: usize = 4;

/// A decoded `virtio_vsock_hdr`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketHeader {
    /// Source CID.
    pub src_cid: u64,
    /// Destination CID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length.
    pub len: u32,
    /// Socket type (`TYPE_STREAM`).
    pub type_: u16,
    /// Operation (`OP_*`).
    pub op: u16,
    /// Operation flags (`SHUTDOWN_*` for `OP_SHUTDOWN`).
    pub flags: u32,
    /// Receive buffer space the sender allocated for this connection.
    pub buf_alloc: u32,
    /// Bytes the sender consumed from that buffer so far (wrapping).
    pub fwd_cnt: u32,
}

impl PacketHeader {
    /// Decodes a header from its wire form.
    pub fn from_bytes(b: &[u8; HDR_SIZE]) -> Self {
        let u64_at = |o: usize| {
            let mut v = [0u8; 8];
            v.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(v)
        };
        let u32_at = |o: usize| {
            let mut v = [0u8; 4];
            v.copy_from_slice(&b[o..o + 4]);
            u32::from_le_bytes(v)
        };
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// Encodes the header in its wire form.
    pub fn to_bytes(&self) -> [u8; HDR_SIZE] {
        let mut b = [0u8; HDR_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// The RST that answers `self`, a packet the guest sent: addresses
    /// swapped, no payload, no credit.
    pub fn rst_reply(&self) -> Self {
        Self {
            src_cid: self.dst_cid,
            dst_cid: self.src_cid,
            src_port: self.dst_port,
            dst_port: self.src_port,
            len: 0,
            type_: self.type_,
            op: OP_RST,
            flags: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_header_roundtrip_preserves_fields() {
        let hdr = PacketHeader {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 0x1234_5678,
            dst_port: 52,
            len: 17,
            type_: TYPE_STREAM,
            op: OP_SHUTDOWN,
            flags: SHUTDOWN_BOTH,
            buf_alloc: 65536,
            fwd_cnt: 0xdead_beef,
        };
        assert_eq!(PacketHeader::from_bytes(&hdr.to_bytes()), hdr);
    }

    #[test]
    fn test_header_layout_matches_virtio_spec() {
        let hdr = PacketHeader {
            src_cid: 0x0102,
            op: OP_RW,
            fwd_cnt: 7,
            ..Default::default()
        };
        let b = hdr.to_bytes();
        assert_eq!(&b[0..2], &[0x02, 0x01]);
        assert_eq!(&b[30..32], &[OP_RW as u8, 0]);
        assert_eq!(&b[40..44], &[7, 0, 0, 0]);
    }

    #[test]
    fn test_header_rst_reply_swaps_addresses() {
        let hdr = PacketHeader {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 1000,
            dst_port: 52,
            len: 9,
            type_: TYPE_STREAM,
            op: OP_RW,
            ..Default::default()
        };
        let rst = hdr.rst_reply();
        assert_eq!(
            (rst.src_cid, rst.dst_cid, rst.src_port, rst.dst_port),
            (HOST_CID, 3, 52, 1000)
        );
        assert_eq!((rst.op, rst.len), (OP_RST, 0));
    }
}
