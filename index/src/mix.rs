//! [`MixMap`]: a hash map for keys that are already hashes (block keys, engine block
//! hashes), without SipHash.
//!
//! Why: std's SipHash-1-3 costs ~15–20 ns per `u64` key; a request's load booking touches
//! one map entry per block (556 for an 8k-token prompt at 16 tokens per block), and the
//! event index one per block event. Block keys are xxh3 outputs (or engine hashes), already
//! uniform, so one multiply-xorshift (the first step of splitmix64's finalizer) spreads them
//! over hashbrown's groups. Not for keys a client picks freely: nothing here resists
//! crafted collisions beyond what the key's own hash does.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for keys that are already hashes (engine block hashes): one multiply-xorshift.
#[derive(Default, Clone, Copy)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        let x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = x ^ (x >> 29);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
}

/// A `HashMap` hashed by [`MixHasher`].
pub type MixMap<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;
