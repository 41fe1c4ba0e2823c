//! kvroute's own block keys: the one implementation of the chained xxh3-64 block hashing
//! (kv-events.md §7) used for requests and, through the same functions, for KV events.
//!
//! ```text
//! local_i = XXH3_64(seed = S, bytes = u32 little-endian of block i's tokens)
//! key_0   = local_0
//! key_i   = XXH3_64(seed = S, bytes = u64le(key_{i-1}) ‖ u64le(local_i))
//! ```
//!
//! `S` is [`BLOCK_KEY_SEED`] (1337) for the default partition and [`seed_for`]`(namespace)` for a
//! cache partition (cache_salt / extra_key / LoRA, see [`namespace_hash`]), so two partitions
//! never share a key. Full blocks only: a trailing partial block has no key. The chain matches
//! Dynamo's, so Dynamo and Mooncake tooling can be reused.
//!
//! These keys are deliberately different from the simulated engine's block hashes (seed
//! `"kvengine"`, a different chaining): the router treats engine hashes as opaque handles.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Seed `S` of the default partition (kv-events.md §7; Dynamo uses the same value).
pub const BLOCK_KEY_SEED: u64 = 1337;

/// Namespace of requests with no cache partition (no cache_salt, extra_key or LoRA).
pub const NO_NAMESPACE: u64 = 0;

/// xxh3-64 (seed `seed`) of `tokens` as u32 little-endian bytes: one block's local hash.
pub fn local_hash(tokens: &[u32], seed: u64) -> u64 {
    let mut bytes = Vec::with_capacity(4 * tokens.len());
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, seed)
}

/// The key of a block whose parent key is `parent` (`None` at the root) and whose local hash
/// is `local`.
pub fn chain(parent: Option<u64>, local: u64, seed: u64) -> u64 {
    match parent {
        None => local,
        Some(p) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&p.to_le_bytes());
            bytes[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64_with_seed(&bytes, seed)
        }
    }
}

/// Chained keys of the full `block_size`-token blocks of `tokens`: `⌊len / block_size⌋` keys,
/// key `i` covering tokens `[i·block_size, (i+1)·block_size)` and everything before them.
///
/// # Panics
/// When `block_size` is 0.
pub fn block_keys(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    let mut keys = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_block_keys(&mut keys, tokens, block_size, seed);
    keys
}

/// Appends the keys of the full blocks of `tokens` that `keys` does not hold yet: `keys` must
/// already hold the keys of a prefix of `tokens` (from an earlier call with the same
/// `block_size` and `seed`). Afterwards `keys.len() == tokens.len() / block_size`.
///
/// # Panics
/// When `block_size` is 0.
pub fn extend_block_keys(keys: &mut Vec<u64>, tokens: &[u32], block_size: usize, seed: u64) {
    assert!(block_size > 0, "block_size must be at least 1 token");
    let full = tokens.len() / block_size;
    while keys.len() < full {
        let i = keys.len();
        let local = local_hash(&tokens[i * block_size..(i + 1) * block_size], seed);
        keys.push(chain(keys.last().copied(), local, seed));
    }
}

/// Seed `S` of the partition `namespace`: [`BLOCK_KEY_SEED`] for [`NO_NAMESPACE`], otherwise
/// xxh3-64 (seed 1337) of the namespace's 8 little-endian bytes.
pub fn seed_for(namespace: u64) -> u64 {
    if namespace == NO_NAMESPACE {
        BLOCK_KEY_SEED
    } else {
        xxh3_64_with_seed(&namespace.to_le_bytes(), BLOCK_KEY_SEED)
    }
}

/// The cache partition of a request: a hash of its `cache_salt`, `extra_key` and LoRA adapter
/// name (anchors.md §2.7). Empty strings count as unset; all unset → [`NO_NAMESPACE`].
/// Otherwise a non-zero xxh3-64 of the three fields, each tagged and length-prefixed so that
/// `("ab", "")` and `("a", "b")` differ and a salt never equals an adapter of the same name.
pub fn namespace_hash(
    cache_salt: Option<&str>,
    extra_key: Option<&str>,
    lora: Option<&str>,
) -> u64 {
    let fields = [cache_salt, extra_key, lora].map(|f| f.filter(|s| !s.is_empty()));
    if fields.iter().all(Option::is_none) {
        return NO_NAMESPACE;
    }
    let mut bytes = Vec::new();
    for (tag, field) in fields.iter().enumerate() {
        if let Some(s) = field {
            bytes.push(tag as u8);
            bytes.extend_from_slice(&(s.len() as u64).to_le_bytes());
            bytes.extend_from_slice(s.as_bytes());
        }
    }
    match xxh3_64_with_seed(&bytes, BLOCK_KEY_SEED) {
        NO_NAMESPACE => 1,
        h => h,
    }
}

/// Key of one multimodal input (image / audio) for image affinity: xxh3-64 (seed 0) of its
/// reference string as sent — the URL, or the whole `data:` URI / base64 payload.
pub fn media_key(reference: &str) -> u64 {
    xxh3_64(reference.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kv-events.md §7 test vectors (S = 1337).
    #[test]
    fn kv_events_section_7_vectors() {
        let a: Vec<u32> = (1..=16).collect();
        let b: Vec<u32> = (17..=32).collect();
        let zero: Vec<u32> = (0..16).collect();
        assert_eq!(local_hash(&a, BLOCK_KEY_SEED), 16863443419780771464);
        assert_eq!(local_hash(&a, BLOCK_KEY_SEED), 0xea06fc71a5ee6e88);
        assert_eq!(local_hash(&b, BLOCK_KEY_SEED), 2287610619914608821);
        assert_eq!(local_hash(&zero, BLOCK_KEY_SEED), 15310707395893867146);
        assert_eq!(local_hash(&[], BLOCK_KEY_SEED), 15128690059815094969);
        let all: Vec<u32> = (1..=32).collect();
        let keys = block_keys(&all, 16, BLOCK_KEY_SEED);
        assert_eq!(keys, vec![16863443419780771464, 12466389667045779788]);
        assert_eq!(keys[1], 0xad01835a37dd294c);
    }

    #[test]
    fn full_blocks_only_and_extend_matches() {
        let t: Vec<u32> = (0..47).collect();
        assert_eq!(block_keys(&t, 16, BLOCK_KEY_SEED).len(), 2);
        assert!(block_keys(&t[..15], 16, BLOCK_KEY_SEED).is_empty());
        let mut keys = block_keys(&t[..20], 16, BLOCK_KEY_SEED);
        extend_block_keys(&mut keys, &t, 16, BLOCK_KEY_SEED);
        assert_eq!(keys, block_keys(&t, 16, BLOCK_KEY_SEED));
        // A key depends on every earlier block.
        let mut u = t.clone();
        u[0] = 999;
        let (k, l) = (block_keys(&t, 16, 1337), block_keys(&u, 16, 1337));
        assert!(k[0] != l[0] && k[1] != l[1]);
    }

    #[test]
    fn namespaces() {
        assert_eq!(namespace_hash(None, None, None), NO_NAMESPACE);
        assert_eq!(namespace_hash(Some(""), Some(""), Some("")), NO_NAMESPACE);
        let salt = namespace_hash(Some("x"), None, None);
        assert_ne!(salt, NO_NAMESPACE);
        assert_eq!(salt, namespace_hash(Some("x"), Some(""), None));
        assert_ne!(salt, namespace_hash(None, None, Some("x")));
        assert_ne!(salt, namespace_hash(None, Some("x"), None));
        assert_ne!(
            namespace_hash(Some("ab"), None, None),
            namespace_hash(Some("a"), Some("b"), None)
        );
        assert_eq!(seed_for(NO_NAMESPACE), BLOCK_KEY_SEED);
        let t: Vec<u32> = (0..32).collect();
        let (a, b) = (
            block_keys(&t, 16, seed_for(NO_NAMESPACE)),
            block_keys(&t, 16, seed_for(salt)),
        );
        assert!(a.iter().all(|k| !b.contains(k)));
    }

    #[test]
    fn media_keys_hash_the_reference() {
        assert_eq!(media_key("http://x/a.png"), media_key("http://x/a.png"));
        assert_ne!(media_key("http://x/a.png"), media_key("http://x/b.png"));
        assert_eq!(media_key(""), xxh3_64(b""));
    }
}
