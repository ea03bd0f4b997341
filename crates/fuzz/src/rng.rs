//! A deterministic PRNG and the input mutator.

/// splitmix64: small, fast and good enough to drive mutations.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

const INTERESTING: &[u64] = &[
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_fffe,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    0xffff_ffff_ffff_fffe,
    0xffff_ffff_ffff_ffff,
    512,
    4096,
    65536,
    1 << 20,
];

const TOKENS: &[&[u8]] = &[
    b"\"",
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b"null",
    b"true",
    b"-1",
    b"1e999",
    b"\\u0000",
    b"%",
    b"&",
    b"=",
    b"+",
    b"%ff",
    b"\"op\"",
    b"\"event\"",
    b"\"status\"",
];

fn put_int(rng: &mut Rng, data: &mut Vec<u8>, max: usize) {
    let v = INTERESTING[rng.below(INTERESTING.len() as u64) as usize];
    let width = [1usize, 2, 4, 8][rng.below(4) as usize];
    let bytes = if rng.below(2) == 0 {
        v.to_le_bytes()
    } else {
        v.to_be_bytes()
    };
    let bytes: &[u8] = if bytes[0] == 0 && width < 8 && rng.below(2) == 1 {
        &bytes[8 - width..]
    } else {
        &bytes[..width]
    };
    if data.is_empty() || rng.below(4) == 0 {
        let at = rng.below(data.len() as u64 + 1) as usize;
        if data.len() + bytes.len() <= max {
            data.splice(at..at, bytes.iter().copied());
        }
    } else {
        let at = rng.below(data.len() as u64) as usize;
        for (i, b) in bytes.iter().enumerate() {
            if let Some(slot) = data.get_mut(at + i) {
                *slot = *b;
            }
        }
    }
}

/// Applies one to eight random mutations to `data`, keeping it within
/// `max` bytes. `corpus` supplies splice material.
pub fn mutate(rng: &mut Rng, data: &mut Vec<u8>, corpus: &[Vec<u8>], max: usize) {
    let rounds = 1 + rng.below(8);
    for _ in 0..rounds {
        match rng.below(10) {
            // Flip a bit.
            0 if !data.is_empty() => {
                let at = rng.below(data.len() as u64) as usize;
                data[at] ^= 1 << rng.below(8);
            }
            // Set a byte.
            1 if !data.is_empty() => {
                let at = rng.below(data.len() as u64) as usize;
                data[at] = rng.next_u64() as u8;
            }
            // An interesting integer.
            2 | 3 => put_int(rng, data, max),
            // Truncate.
            4 if !data.is_empty() => {
                let len = rng.below(data.len() as u64) as usize;
                data.truncate(len);
            }
            // Insert random bytes.
            5 => {
                let n = 1 + rng.below(16) as usize;
                if data.len() + n <= max {
                    let at = rng.below(data.len() as u64 + 1) as usize;
                    let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                    data.splice(at..at, bytes);
                }
            }
            // Delete a range.
            6 if !data.is_empty() => {
                let at = rng.below(data.len() as u64) as usize;
                let n = 1 + rng.below((data.len() - at).min(64) as u64) as usize;
                data.drain(at..at + n);
            }
            // Splice in part of another seed.
            7 => {
                let other = &corpus[rng.below(corpus.len() as u64) as usize];
                if !other.is_empty() {
                    let from = rng.below(other.len() as u64) as usize;
                    let n = 1 + rng.below((other.len() - from) as u64) as usize;
                    let at = rng.below(data.len() as u64 + 1) as usize;
                    if data.len() + n <= max {
                        data.splice(at..at, other[from..from + n].iter().copied());
                    }
                }
            }
            // Duplicate a range.
            8 if !data.is_empty() => {
                let at = rng.below(data.len() as u64) as usize;
                let n = 1 + rng.below((data.len() - at).min(256) as u64) as usize;
                if data.len() + n <= max {
                    let chunk: Vec<u8> = data[at..at + n].to_vec();
                    let to = rng.below(data.len() as u64 + 1) as usize;
                    data.splice(to..to, chunk);
                }
            }
            // A syntax token.
            _ => {
                let t = TOKENS[rng.below(TOKENS.len() as u64) as usize];
                let at = rng.below(data.len() as u64 + 1) as usize;
                if data.len() + t.len() <= max {
                    data.splice(at..at, t.iter().copied());
                }
            }
        }
    }
}
