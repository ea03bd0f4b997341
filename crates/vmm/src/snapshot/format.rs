//! The state-file container: magic, format version, payload length, the
//! postcard-encoded payload, and a CRC32 of the payload. A file of another
//! version, truncated or corrupted is refused before anything is decoded.

use std::io::{Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// First bytes of every state file.
pub const MAGIC: &[u8; 8] = b"TINESNAP";
/// Format version written. Bumped on any change to the payload's types.
/// Version 2 added the VM generation ID device.
pub const FORMAT_VERSION: u32 = 2;
/// Oldest format version [`open`] accepts; its reader converts the payload.
pub const OLDEST_FORMAT_VERSION: u32 = 1;
/// Largest payload accepted (the state of a VM is a few hundred KiB).
pub const MAX_PAYLOAD: u64 = 64 << 20;
const HEADER_LEN: usize = 8 + 4 + 8;

/// Why a state file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// I/O failed.
    #[error("state file I/O failed")]
    Io(#[from] std::io::Error),
    /// Not a tine state file.
    #[error("not a tine-vmm state file (bad magic)")]
    BadMagic,
    /// Another format version.
    #[error("state file has format version {found}; this tine-vmm reads versions {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}")]
    Version {
        /// Version in the file.
        found: u32,
    },
    /// Shorter than its header says.
    #[error("state file is truncated: {0}")]
    Truncated(&'static str),
    /// Payload length over the limit.
    #[error("state file payload of {0} bytes exceeds the {MAX_PAYLOAD}-byte limit")]
    TooLarge(u64),
    /// CRC mismatch.
    #[error("state file is corrupted (CRC mismatch)")]
    Crc,
    /// The payload does not decode.
    #[error("state file payload does not decode: {0}")]
    Decode(String),
    /// The payload does not encode.
    #[error("cannot encode state: {0}")]
    Encode(String),
}

/// Encodes `state` as a complete state file.
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, FormatError> {
    let payload = postcard::to_stdvec(state).map_err(|e| FormatError::Encode(e.to_string()))?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&payload);
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    Ok(out)
}

/// Writes `state` to `out`.
pub fn write<T: Serialize>(out: &mut impl Write, state: &T) -> Result<(), FormatError> {
    out.write_all(&encode(state)?)?;
    Ok(())
}

/// Checks a complete state file's container (magic, a readable version,
/// length, CRC) and returns its format version and payload.
pub fn open(bytes: &[u8]) -> Result<(u32, &[u8]), FormatError> {
    if bytes.len() < 8 {
        return Err(FormatError::Truncated("no header"));
    }
    if &bytes[..8] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    if bytes.len() < HEADER_LEN {
        return Err(FormatError::Truncated("short header"));
    }
    let mut version = [0u8; 4];
    version.copy_from_slice(&bytes[8..12]);
    let found = u32::from_le_bytes(version);
    if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&found) {
        return Err(FormatError::Version { found });
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[12..20]);
    let len = u64::from_le_bytes(len);
    if len > MAX_PAYLOAD {
        return Err(FormatError::TooLarge(len));
    }
    let end = HEADER_LEN + len as usize;
    if bytes.len() < end + 4 {
        return Err(FormatError::Truncated(
            "payload shorter than its header says",
        ));
    }
    let payload = &bytes[HEADER_LEN..end];
    let mut crc = [0u8; 4];
    crc.copy_from_slice(&bytes[end..end + 4]);
    if crc32fast::hash(payload) != u32::from_le_bytes(crc) {
        return Err(FormatError::Crc);
    }
    Ok((found, payload))
}

/// Decodes a payload [`open`] returned.
pub fn decode_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, FormatError> {
    postcard::from_bytes(payload).map_err(|e| FormatError::Decode(e.to_string()))
}

/// Decodes a complete state file of the current format version.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, FormatError> {
    let (found, payload) = open(bytes)?;
    if found != FORMAT_VERSION {
        return Err(FormatError::Version { found });
    }
    decode_payload(payload)
}

/// Reads and decodes a state file.
pub fn read<T: DeserializeOwned>(input: &mut impl Read) -> Result<T, FormatError> {
    decode(&read_bytes(input)?)
}

/// Does ahead what the first state file read in a process would do on a
/// restore's path: the CRC's CPU feature detection (a few `CPUID`s, each a
/// VM exit of several microseconds on a nested host) and the heap's growth
/// to a state file's size. Worth about 0.1 ms of a pre-started restore.
pub fn warm_up() {
    let buffer = vec![0u8; 64 << 10];
    std::hint::black_box(crc32fast::hash(std::hint::black_box(&buffer)));
}

/// Reads a state file's bytes, no more than the largest valid file holds.
pub fn read_bytes(input: &mut impl Read) -> Result<Vec<u8>, FormatError> {
    read_bytes_sized(input, 0)
}

/// [`read_bytes`] into a buffer made for `expected` bytes (a file's size):
/// a buffer grown as it is read takes several reads on a restore's path.
pub fn read_bytes_sized(input: &mut impl Read, expected: u64) -> Result<Vec<u8>, FormatError> {
    let limit = MAX_PAYLOAD + 64;
    // One byte more than expected, so that the read that finds the end
    // does not make the buffer grow.
    let mut bytes = Vec::with_capacity(expected.saturating_add(1).min(limit) as usize);
    input.take(limit).read_to_end(&mut bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Sample {
        a: u32,
        b: Vec<u8>,
    }

    fn sample() -> Sample {
        Sample {
            a: 7,
            b: vec![1, 2, 3],
        }
    }

    #[test]
    fn test_a_sized_read_reads_the_whole_file_whatever_its_size_was_said_to_be() {
        let bytes = encode(&sample()).expect("encode");
        for expected in [0, 3, bytes.len() as u64, 1 << 40] {
            let read = read_bytes_sized(&mut bytes.as_slice(), expected).expect("read");
            assert_eq!(read, bytes, "expected {expected}");
            assert_eq!(decode::<Sample>(&read).expect("decode"), sample());
        }
    }

    #[test]
    fn test_decode_round_trips() {
        let bytes = encode(&sample()).expect("encode");
        assert_eq!(decode::<Sample>(&bytes).expect("decode"), sample());
    }

    #[test]
    fn test_decode_other_version_is_refused() {
        let mut bytes = encode(&sample()).expect("encode");
        bytes[8] = 99;
        assert!(matches!(
            decode::<Sample>(&bytes),
            Err(FormatError::Version { found: 99 })
        ));
    }

    #[test]
    fn test_open_accepts_older_versions_that_decode_refuses() {
        let mut bytes = encode(&sample()).expect("encode");
        bytes[8..12].copy_from_slice(&OLDEST_FORMAT_VERSION.to_le_bytes());
        let (found, payload) = open(&bytes).expect("open");
        assert_eq!(found, OLDEST_FORMAT_VERSION);
        assert_eq!(
            decode_payload::<Sample>(payload).expect("payload"),
            sample()
        );
        assert!(matches!(
            decode::<Sample>(&bytes),
            Err(FormatError::Version { found }) if found == OLDEST_FORMAT_VERSION
        ));
    }

    #[test]
    fn test_decode_truncated_is_refused() {
        let bytes = encode(&sample()).expect("encode");
        for cut in [0, 5, 10, bytes.len() - 1] {
            assert!(
                matches!(
                    decode::<Sample>(&bytes[..cut]),
                    Err(FormatError::Truncated(_))
                ),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn test_decode_flipped_bit_is_refused() {
        let mut bytes = encode(&sample()).expect("encode");
        bytes[HEADER_LEN] ^= 1;
        assert!(matches!(decode::<Sample>(&bytes), Err(FormatError::Crc)));
        let mut other = encode(&sample()).expect("encode");
        other[0] = b'X';
        assert!(matches!(
            decode::<Sample>(&other),
            Err(FormatError::BadMagic)
        ));
    }
}
