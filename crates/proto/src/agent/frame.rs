//! Frame layout and codec.
//!
//! Every frame is `length: u32 BE | stream: u32 BE | kind: u8 | payload`,
//! where `length` counts the bytes after itself (header rest plus payload).
//! The decoder refuses a length above [`MAX_FRAME_LEN`] before reading the
//! payload, so a peer cannot make the other side allocate more than that.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest accepted value of the length field: 1 MiB.
pub const MAX_FRAME_LEN: u32 = 1 << 20;
/// Bytes of the header after the length field (stream id and kind).
pub const HEADER_REST_LEN: u32 = 5;
/// Bytes of the whole header, length field included.
pub const HEADER_LEN: usize = 9;
/// Largest payload a frame may carry.
pub const MAX_PAYLOAD_LEN: usize = (MAX_FRAME_LEN - HEADER_REST_LEN) as usize;

/// What a frame carries. The numeric values are part of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A JSON control message.
    Msg = 1,
    /// Raw bytes on the stream's main channel: stdin, file contents, a tar
    /// archive, terminal or forwarded bytes.
    Data = 2,
    /// Raw bytes a process wrote to its stdout.
    Stdout = 3,
    /// Raw bytes a process wrote to its stderr.
    Stderr = 4,
    /// End of one channel; the payload is one byte, the channel's kind
    /// ([`FrameKind::Data`], [`FrameKind::Stdout`] or [`FrameKind::Stderr`]).
    Eof = 5,
    /// Flow-control credit; the payload is a `u32 BE` byte count.
    Window = 6,
    /// The sender will send nothing more on this stream and drops whatever
    /// arrives on it. Empty payload.
    Close = 7,
}

impl FrameKind {
    /// Decodes a kind byte.
    pub fn from_u8(value: u8) -> Option<Self> {
        Some(match value {
            1 => Self::Msg,
            2 => Self::Data,
            3 => Self::Stdout,
            4 => Self::Stderr,
            5 => Self::Eof,
            6 => Self::Window,
            7 => Self::Close,
            _ => return None,
        })
    }
}

/// A byte channel within a stream, named by the frame kind that carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    /// The main channel ([`FrameKind::Data`]).
    Data,
    /// A process's stdout ([`FrameKind::Stdout`]).
    Stdout,
    /// A process's stderr ([`FrameKind::Stderr`]).
    Stderr,
}

impl Channel {
    /// The frame kind that carries this channel's bytes.
    pub fn kind(self) -> FrameKind {
        match self {
            Self::Data => FrameKind::Data,
            Self::Stdout => FrameKind::Stdout,
            Self::Stderr => FrameKind::Stderr,
        }
    }

    /// The channel a data-carrying kind (or an EOF payload byte) names.
    pub fn from_u8(value: u8) -> Option<Self> {
        match FrameKind::from_u8(value)? {
            FrameKind::Data => Some(Self::Data),
            FrameKind::Stdout => Some(Self::Stdout),
            FrameKind::Stderr => Some(Self::Stderr),
            _ => None,
        }
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Stream id; 0 is the connection itself (handshake, fatal errors).
    pub stream: u32,
    /// What the payload is.
    pub kind: FrameKind,
    /// The payload, at most [`MAX_PAYLOAD_LEN`] bytes.
    pub payload: Vec<u8>,
}

/// Errors from reading or writing frames.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length field exceeds the limit.
    #[error("Frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// The length the peer announced.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// The length field is smaller than the header.
    #[error("Frame length {0} is shorter than the frame header")]
    TooShort(u32),
    /// The kind byte is not one this version knows.
    #[error("Unknown frame kind {0}")]
    UnknownKind(u8),
    /// The stream ended in the middle of a frame.
    #[error("Connection closed in the middle of a frame")]
    Truncated,
    /// A payload given to the encoder is larger than a frame can carry.
    #[error("Payload of {0} bytes does not fit in one frame")]
    PayloadTooLarge(usize),
    /// Reading or writing the transport failed.
    #[error("Transport I/O failed")]
    Io(#[source] std::io::Error),
}

impl Frame {
    /// Builds a frame.
    pub fn new(stream: u32, kind: FrameKind, payload: Vec<u8>) -> Self {
        Self {
            stream,
            kind,
            payload,
        }
    }

    /// The value of this frame's length field.
    pub fn wire_len(&self) -> u32 {
        HEADER_REST_LEN + self.payload.len() as u32
    }

    /// Encodes the header of a frame with `payload_len` bytes of payload.
    pub fn encode_header(
        stream: u32,
        kind: FrameKind,
        payload_len: usize,
    ) -> Result<[u8; HEADER_LEN], FrameError> {
        if payload_len > MAX_PAYLOAD_LEN {
            return Err(FrameError::PayloadTooLarge(payload_len));
        }
        let len = HEADER_REST_LEN + payload_len as u32;
        let mut header = [0u8; HEADER_LEN];
        header[0..4].copy_from_slice(&len.to_be_bytes());
        header[4..8].copy_from_slice(&stream.to_be_bytes());
        header[8] = kind as u8;
        Ok(header)
    }

    /// Appends the encoded frame to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), FrameError> {
        let header = Self::encode_header(self.stream, self.kind, self.payload.len())?;
        out.extend_from_slice(&header);
        out.extend_from_slice(&self.payload);
        Ok(())
    }

    /// Decodes one frame from the front of `buf`. Returns the frame and the
    /// bytes it used, or `None` when `buf` holds only part of a frame. Size
    /// and kind are checked as soon as the header is complete.
    pub fn decode(buf: &[u8], max_len: u32) -> Result<Option<(Frame, usize)>, FrameError> {
        let Some(head) = buf.get(..HEADER_LEN) else {
            // A length prefix alone is enough to refuse an oversized frame.
            if let Some(len) = buf.get(..4) {
                check_len(
                    u32::from_be_bytes([len[0], len[1], len[2], len[3]]),
                    max_len,
                )?;
            }
            return Ok(None);
        };
        let (len, stream, kind) = parse_header(head, max_len)?;
        let total = 4 + len as usize;
        let Some(payload) = buf.get(HEADER_LEN..total) else {
            return Ok(None);
        };
        Ok(Some((Frame::new(stream, kind, payload.to_vec()), total)))
    }
}

fn check_len(len: u32, max_len: u32) -> Result<(), FrameError> {
    if len > max_len {
        return Err(FrameError::TooLarge { len, max: max_len });
    }
    if len < HEADER_REST_LEN {
        return Err(FrameError::TooShort(len));
    }
    Ok(())
}

fn parse_header(head: &[u8], max_len: u32) -> Result<(u32, u32, FrameKind), FrameError> {
    let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
    check_len(len, max_len)?;
    let stream = u32::from_be_bytes([head[4], head[5], head[6], head[7]]);
    let kind = FrameKind::from_u8(head[8]).ok_or(FrameError::UnknownKind(head[8]))?;
    Ok((len, stream, kind))
}

/// Reads one frame. Returns `Ok(None)` on a clean end of stream between
/// frames. A length above `max_len` is refused before any payload is read.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    max_len: u32,
) -> Result<Option<Frame>, FrameError> {
    let mut head = [0u8; HEADER_LEN];
    // Read the length prefix on its own so that a clean EOF is told apart
    // from a truncated frame, and so an oversized length is refused early.
    let mut got = 0;
    while got < 4 {
        let n = reader
            .read(&mut head[got..4])
            .await
            .map_err(FrameError::Io)?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(FrameError::Truncated)
            };
        }
        got += n;
    }
    check_len(
        u32::from_be_bytes([head[0], head[1], head[2], head[3]]),
        max_len,
    )?;
    read_exact(reader, &mut head[4..]).await?;
    let (len, stream, kind) = parse_header(&head, max_len)?;
    let mut payload = vec![0u8; (len - HEADER_REST_LEN) as usize];
    read_exact(reader, &mut payload).await?;
    Ok(Some(Frame::new(stream, kind, payload)))
}

async fn read_exact<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
) -> Result<(), FrameError> {
    reader.read_exact(buf).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            FrameError::Truncated
        } else {
            FrameError::Io(e)
        }
    })?;
    Ok(())
}

/// Writes one frame (without flushing).
pub async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    stream: u32,
    kind: FrameKind,
    payload: &[u8],
) -> Result<(), FrameError> {
    let header = Frame::encode_header(stream, kind, payload.len())?;
    writer.write_all(&header).await.map_err(FrameError::Io)?;
    writer.write_all(payload).await.map_err(FrameError::Io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_frame_round_trip_decodes_same_frame() {
        let frame = Frame::new(7, FrameKind::Stdout, b"hello".to_vec());
        let mut buf = Vec::new();
        frame.encode_into(&mut buf).expect("ok");
        let (decoded, used) = Frame::decode(&buf, MAX_FRAME_LEN)
            .expect("decode")
            .expect("whole frame");
        assert_eq!(decoded, frame);
        assert_eq!(used, buf.len());
    }

    #[test]
    fn test_frame_decode_partial_returns_none() {
        let frame = Frame::new(1, FrameKind::Data, vec![1; 100]);
        let mut buf = Vec::new();
        frame.encode_into(&mut buf).expect("ok");
        for cut in 0..buf.len() {
            assert!(Frame::decode(&buf[..cut], MAX_FRAME_LEN)
                .expect("ok")
                .is_none());
        }
    }

    #[test]
    fn test_negative_frame_decode_oversized_length_refused_from_prefix() {
        let len = (MAX_FRAME_LEN + 1).to_be_bytes();
        let err = Frame::decode(&len, MAX_FRAME_LEN).expect_err("must fail");
        assert!(matches!(err, FrameError::TooLarge { .. }));
    }

    #[test]
    fn test_negative_frame_decode_unknown_kind_refused() {
        let mut buf = Frame::encode_header(1, FrameKind::Msg, 0)
            .expect("ok")
            .to_vec();
        buf[8] = 99;
        assert!(matches!(
            Frame::decode(&buf, MAX_FRAME_LEN),
            Err(FrameError::UnknownKind(99))
        ));
    }

    #[test]
    fn test_negative_frame_decode_short_length_refused() {
        let buf = [0, 0, 0, 2, 0, 0];
        assert!(matches!(
            Frame::decode(&buf, MAX_FRAME_LEN),
            Err(FrameError::TooShort(2))
        ));
    }

    #[test]
    fn test_negative_frame_encode_oversized_payload_refused() {
        assert!(Frame::encode_header(1, FrameKind::Data, MAX_PAYLOAD_LEN + 1).is_err());
        assert!(Frame::encode_header(1, FrameKind::Data, MAX_PAYLOAD_LEN).is_ok());
    }

    #[test]
    fn test_frame_decode_random_bytes_never_panics() {
        // A cheap deterministic fuzz: xorshift bytes, every prefix.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let mut buf = Vec::new();
            for _ in 0..32 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                buf.push(state as u8);
            }
            buf[0] = 0;
            let _ = Frame::decode(&buf, 64);
        }
    }

    #[tokio::test]
    async fn test_read_frame_clean_eof_returns_none_and_truncated_errors() {
        let mut empty: &[u8] = &[];
        assert!(read_frame(&mut empty, MAX_FRAME_LEN)
            .await
            .expect("ok")
            .is_none());
        let mut buf = Vec::new();
        Frame::new(3, FrameKind::Msg, b"{}".to_vec())
            .encode_into(&mut buf)
            .expect("ok");
        let mut cut: &[u8] = &buf[..buf.len() - 1];
        assert!(matches!(
            read_frame(&mut cut, MAX_FRAME_LEN).await,
            Err(FrameError::Truncated)
        ));
        let mut whole: &[u8] = &buf;
        let frame = read_frame(&mut whole, MAX_FRAME_LEN)
            .await
            .expect("decode")
            .expect("whole frame");
        assert_eq!(frame.stream, 3);
    }
}
