//! Block keys: kvroute's own chained hash of each *full* block of token ids, so the engine's
//! hash algorithm never matters (`kv-events.md` §7, the same chain as Dynamo, anchors §3.4).
//!
//! ```text
//! local_i = XXH3_64(seed = 1337, bytes = u32 little-endian of block i's tokens)
//! key_0   = local_0
//! key_i   = XXH3_64(seed = 1337, bytes = u64le(key_{i-1}) ‖ u64le(local_i))
//! ```
//! Cache partitions (`anchors.md` §2.7: cache_salt / extra_key / LoRA) start their chain at
//! a different root ([`root`], `kv-events.md` §7 "derive a different seed per namespace"):
//! block 0 of namespace `ns ≠ 0` chains from the namespace hash as if it were the key of a
//! block before it, `key_0 = XXH3_64(seed = 1337, u64le(ns) ‖ u64le(local_0))`, and every
//! later key chains from that. Keys of different namespaces therefore never collide (short of
//! a 2^-64 event), a child store that names its parent inherits the parent's namespace
//! without being told (vLLM sends `cache_salt` only with a sequence's first block), and
//! namespace 0 keeps the plain chain above (Dynamo's, and the §7 test vectors). The string
//! and token trees and the hash index keep the namespace as a separate argument instead.

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

/// Where the chain of namespace `ns` starts: `None` (the plain chain) for the default
/// namespace 0, else `Some(ns)`: the namespace hash plays the key of a virtual block before
/// block 0, so `key_0 = chain(root(ns), local_0)` (see the module doc).
#[inline]
pub fn root(ns: crate::Namespace) -> Option<u64> {
    (ns != 0).then_some(ns)
}

/// Keys of every full block of `tokens` in the default namespace: [`block_keys_in`]`(0, …)`.
///
/// # Panics
/// If `block_size` is 0.
pub fn block_keys(tokens: &[u32], block_size: usize) -> Vec<u64> {
    block_keys_in(0, tokens, block_size)
}

/// Keys of every full block of `tokens` in namespace `ns` (`tokens.len() / block_size` keys;
/// a trailing partial block has none), the chain starting at [`root`]`(ns)`.
///
/// # Panics
/// If `block_size` is 0.
pub fn block_keys_in(ns: crate::Namespace, tokens: &[u32], block_size: usize) -> Vec<u64> {
    assert!(block_size > 0, "block_size must be > 0");
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = root(ns);
    for block in tokens.chunks_exact(block_size) {
        let k = chain(parent, local_hash(block));
        out.push(k);
        parent = Some(k);
    }
    out
}

/// Root of every text page chain: the namespace's root xor this, so a text page key never
/// equals a block key of the same namespace (short of a 2^-64 event). xxh3-64 of
/// `b"kvroute text page"` with seed [`SEED`].
pub fn text_root(ns: crate::Namespace) -> u64 {
    ns ^ xxh3_64_with_seed(b"kvroute text page", SEED)
}

/// Keys of every full `page_bytes`-byte page of `text` in namespace `ns`: the chain of
/// [`chain`] over `local_i = XXH3_64(seed = SEED, page i's bytes)`, starting at
/// [`text_root`]`(ns)` (`text.len() / page_bytes` keys; a trailing partial page has none).
/// Replica sync's text pages ([`crate::peer_pages`]).
///
/// # Panics
/// If `page_bytes` is 0.
pub fn text_page_keys(ns: crate::Namespace, text: &[u8], page_bytes: usize) -> Vec<u64> {
    assert!(page_bytes > 0, "page_bytes must be > 0");
    let mut out = Vec::with_capacity(text.len() / page_bytes);
    let mut parent = Some(text_root(ns));
    for page in text.chunks_exact(page_bytes) {
        let k = chain(parent, xxh3_64_with_seed(page, SEED));
        out.push(k);
        parent = Some(k);
    }
    out
}

/// The keys [`block_keys_in`]`(ns, tokens, block_size)` has after its first `known.len()`,
/// when those are known: chained on from the last known key, so the cost is O(blocks not
/// known); empty when `known` covers every full block. `known` must be
/// `block_keys_in(ns, t, block_size)` of some `t` that `tokens` starts with, and at most
/// `tokens.len() / block_size` long.
///
/// # Panics
/// If `block_size` is 0, or `known` has more keys than `tokens` has full blocks.
pub fn block_keys_extending(
    ns: crate::Namespace,
    tokens: &[u32],
    block_size: usize,
    known: &[u64],
) -> Vec<u64> {
    assert!(block_size > 0, "block_size must be > 0");
    let blocks = tokens.len() / block_size;
    assert!(
        known.len() <= blocks,
        "known keys of at most the full blocks"
    );
    let mut out = Vec::with_capacity(blocks - known.len());
    let mut parent = known.last().copied().or(root(ns));
    for block in tokens[known.len() * block_size..].chunks_exact(block_size) {
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

    /// Continuing from any known head of the chain gives the whole chain.
    #[test]
    fn continuing_a_known_head_equals_the_whole_chain() {
        let tokens: Vec<u32> = (0..200).map(|i| i * 7919 % 1000).collect();
        for ns in [0, 0x1234_5678_9abc_def0] {
            for bs in [1, 4, 16] {
                let whole = block_keys_in(ns, &tokens, bs);
                for cut in 0..=whole.len() + 2 {
                    let head = &whole[..cut.min(whole.len())];
                    for len in [tokens.len(), tokens.len() - 3, cut * bs] {
                        let len = len.min(tokens.len());
                        let head = &head[..head.len().min(len / bs)];
                        let mut got = head.to_vec();
                        got.extend(block_keys_extending(ns, &tokens[..len], bs, head));
                        assert_eq!(
                            got,
                            block_keys_in(ns, &tokens[..len], bs),
                            "{ns} {bs} {cut} {len}"
                        );
                    }
                }
            }
        }
    }

    /// A namespace re-roots the whole chain: block 0 chains from the namespace hash, block 1
    /// from that key; namespace 0 is the plain chain.
    #[test]
    fn namespaces_start_their_own_chain() {
        let both: Vec<u32> = (1..=32).collect();
        assert_eq!(block_keys_in(0, &both, 16), block_keys(&both, 16));
        assert_eq!(root(0), None);
        assert_eq!(root(7), Some(7));
        let ns = 0x1234_5678_9abc_def0;
        let k = block_keys_in(ns, &both, 16);
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&ns.to_le_bytes());
        b[8..].copy_from_slice(&16863443419780771464u64.to_le_bytes());
        let k0 = xxh3_64_with_seed(&b, SEED);
        assert_eq!(k[0], k0);
        assert_eq!(k[1], chain(Some(k0), 2287610619914608821));
        let plain = block_keys(&both, 16);
        assert!(k.iter().all(|x| !plain.contains(x)));
        assert_ne!(block_keys_in(ns + 1, &both, 16)[0], k[0]);
    }

    /// Text pages chain like blocks: a shared first page gives a shared first key, the
    /// second differs when the second page does, a partial page has no key, and a namespace
    /// or block key never collides with them.
    #[test]
    fn text_pages_chain_their_prefix() {
        let a = text_page_keys(0, b"0123456789abcdefXY", 8);
        let b = text_page_keys(0, b"01234567zzzzzzzz", 8);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_ne!(text_page_keys(7, b"01234567", 8)[0], a[0]);
        let same_bytes: Vec<u32> = vec![u32::from_le_bytes(*b"0123"), u32::from_le_bytes(*b"4567")];
        assert_ne!(block_keys(&same_bytes, 2)[0], a[0]);
    }
}
