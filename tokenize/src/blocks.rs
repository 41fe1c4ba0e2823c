//! Request-side keys next to the block keys: the cache-partition namespace and media keys.
//!
//! The block keys themselves (chained xxh3-64 of full blocks, kv-events.md §7, seed 1337) have
//! one implementation, [`kvroute_index`'s `keys` module], used for requests and KV events alike
//! (`index` and `tokenize` are both leaves, so the one copy lives where the events are indexed).
//! The trees and the hash index take the [`namespace_hash`] as a separate `Namespace`
//! argument; the KV-event index roots the block-key chain at it (`keys::block_keys_in`), so
//! keys of different partitions never meet. The event side computes the partition of stored
//! blocks with this same function (`kvroute_core::events::event_namespace`: the event's
//! `cache_salt` and `lora_name`, no `extra_key`), so requests and events agree.
//!
//! These keys are deliberately unrelated to the simulated engine's block hashes (seed
//! `"kvengine"`): the router treats engine hashes as opaque handles.
//!
//! [`kvroute_index`'s `keys` module]: https://docs.rs/kvroute-index

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Namespace of requests with no cache partition (no cache_salt, extra_key or LoRA).
pub const NO_NAMESPACE: u64 = 0;

/// Seed of [`namespace_hash`] (the kv-events.md §7 seed, reused).
const NAMESPACE_SEED: u64 = 1337;

/// The cache partition of a request: a hash of its `cache_salt`, `extra_key` and LoRA adapter
/// name (anchors.md §2.7). Empty strings count as unset; all unset → [`NO_NAMESPACE`].
/// Otherwise a non-zero xxh3-64 of the set fields, each tagged and length-prefixed so that
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
    match xxh3_64_with_seed(&bytes, NAMESPACE_SEED) {
        NO_NAMESPACE => 1,
        h => h,
    }
}

/// Key of one multimodal input (image / audio / video) for image affinity: xxh3-64 (seed 0)
/// of its reference string as sent — the URL, or the whole `data:` URI / base64 payload.
pub fn media_key(reference: &str) -> u64 {
    xxh3_64(reference.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // Golden value, so a change of the encoding is noticed (partitions would split).
        let mut b = vec![0u8];
        b.extend_from_slice(&1u64.to_le_bytes());
        b.push(b'x');
        assert_eq!(salt, xxh3_64_with_seed(&b, 1337));
    }

    #[test]
    fn media_keys_hash_the_reference() {
        assert_eq!(media_key("http://x/a.png"), media_key("http://x/a.png"));
        assert_ne!(media_key("http://x/a.png"), media_key("http://x/b.png"));
        assert_eq!(media_key(""), xxh3_64(b""));
        assert_eq!(media_key(""), 0x2d06800538d394c2);
    }
}
