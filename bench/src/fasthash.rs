//! A fast hasher for the simulator's hot maps, whose keys are single integers: block hashes
//! (already uniform xxh3 outputs) and request ids. The std `HashMap`'s SipHash dominated the
//! engine's block manager in profiles (`perf/runs/2026-12-01-sim-speed/`); this is the
//! multiply-rotate step of rustc's FxHasher (`rustc-hash`), which keeps the high bits that
//! hashbrown's control bytes read well mixed for sequential ids too. Not DoS-resistant:
//! only for keys the simulator makes itself.

use std::hash::{BuildHasherDefault, Hasher};

/// [`std::collections::HashMap`] state using [`FastHasher`].
pub type FastHash = BuildHasherDefault<FastHasher>;

/// FxHash-style hasher over integer writes (`write_u64` and friends); byte slices are folded
/// in 8-byte words.
#[derive(Debug, Default, Clone, Copy)]
pub struct FastHasher {
    hash: u64,
}

/// FxHash's multiplier (rustc-hash 1.x), an odd constant with well-spread bits.
const K: u64 = 0x517c_c1b7_2722_0a95;

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(w));
        }
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::hash::BuildHasher;

    /// Worked example: one u64 write is `(0 ^ x) · K`; 64 sequential ids spread over at
    /// least half of hashbrown's 128 tags (the top 7 bits); a map of them works.
    #[test]
    fn one_word_is_one_multiply() {
        let h = FastHash::default().hash_one(3u64);
        assert_eq!(h, 3u64.wrapping_mul(K));
        let tags: std::collections::HashSet<u64> = (0..64u64)
            .map(|i| FastHash::default().hash_one(i) >> 57)
            .collect();
        assert!(tags.len() >= 32, "{}", tags.len());
        let mut m: HashMap<u64, u64, FastHash> = HashMap::default();
        for i in 0..1000 {
            m.insert(i, i * 2);
        }
        assert_eq!(m.get(&999), Some(&1998));
    }
}
