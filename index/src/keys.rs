//! Block keys: kvroute's own chained hash of each *full* block of token ids, so the engine's
//! hash algorithm never matters (`kv-events.md` §7, the same chain as Dynamo, anchors §3.4).
//!
//! ```text
//! local_i = XXH3_64(seed = 1337, bytes = u32 little-endian of block i's tokens)
//! key_0   = local_0
//! key_i   = XXH3_64(seed = 1337, bytes = u64le(key_{i-1}) ‖ u64le(local_i))
//! ```
//! Cache partitions are separated by the indexes' [`crate::Namespace`] argument, not by the
//! seed, so requests and events always use [`SEED`].

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of both hashes. Source: `kv-events.md` §7 (S = 1337), Dynamo.
pub const SEED: u64 = 1337;

/// `local` hash of one block: xxh3-64 of its token ids as u32 little-endian, seed [`SEED`].
///
/// ```
/// let tokens: Vec<u32> = (1..=16).collect();
/// assert_eq!(kvroute_index::keys::local_hash(&tokens), 16863443419780771464);
/// ```
pub fn local_hash(tokens: &[u32]) -> u64 {
    #[cfg(target_endian = "little")]
    {
        // The tokens' memory already is their u32 little-endian bytes: hash it in place.
        // Safety: a `[u32]` is `4 × len` initialised bytes, valid for the borrow's lifetime.
        let bytes =
            unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), 4 * tokens.len()) };
        xxh3_64_with_seed(bytes, SEED)
    }
    #[cfg(not(target_endian = "little"))]
    {
        local_hash_portable(tokens)
    }
}

/// [`local_hash`] by copying each token's little-endian bytes (big-endian targets).
#[cfg_attr(target_endian = "little", allow(dead_code))]
fn local_hash_portable(tokens: &[u32]) -> u64 {
    let mut buf = [0u8; 4 * 64];
    if tokens.len() <= 64 {
        for (i, t) in tokens.iter().enumerate() {
            buf[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64_with_seed(&buf[..4 * tokens.len()], SEED);
    }
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64_with_seed(&bytes, SEED)
}

/// Key of a block whose prefix ends in `parent` (`None` at the start of a sequence).
pub fn chain(parent: Option<u64>, local: u64) -> u64 {
    match parent {
        None => local,
        Some(p) => {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&p.to_le_bytes());
            b[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64_with_seed(&b, SEED)
        }
    }
}

/// Keys of every full block of `tokens` (`tokens.len() / block_size` keys; a trailing
/// partial block has none).
///
/// # Panics
/// If `block_size` is 0.
pub fn block_keys(tokens: &[u32], block_size: usize) -> Vec<u64> {
    assert!(block_size > 0, "block_size must be > 0");
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for block in tokens.chunks_exact(block_size) {
        let k = chain(parent, local_hash(block));
        out.push(k);
        parent = Some(k);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test vectors of `kv-events.md` §7.
    #[test]
    fn kv_events_vectors() {
        let t1: Vec<u32> = (1..=16).collect();
        let t2: Vec<u32> = (17..=32).collect();
        let t0: Vec<u32> = (0..16).collect();
        assert_eq!(local_hash(&t1), 16863443419780771464);
        assert_eq!(local_hash(&t2), 2287610619914608821);
        assert_eq!(local_hash(&t0), 15310707395893867146);
        assert_eq!(local_hash(&[]), 15128690059815094969);
        let both: Vec<u32> = (1..=32).collect();
        assert_eq!(
            block_keys(&both, 16),
            vec![16863443419780771464, 12466389667045779788]
        );
        assert_eq!(block_keys(&both[..31], 16).len(), 1);
        assert!(block_keys(&both[..15], 16).is_empty());
        let long: Vec<u32> = (0..100).collect();
        assert_eq!(block_keys(&long, 100), vec![local_hash(&long)]);
        // The in-place hash equals the byte-by-byte one.
        for t in [&t1[..], &t2[..], &long[..], &[]] {
            assert_eq!(local_hash(t), local_hash_portable(t));
        }
    }
}
