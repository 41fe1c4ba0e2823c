//! `prefix_hash`: the prompt's head — its first `prefix_hash_tokens` token ids, or without
//! ids the chars of as many tokens (4 chars each, [`crate::config::defaults::CHARS_PER_TOKEN`]
//! is not used so the key does not move with a knob) — hashed onto the consistent-hash ring
//! of [`super::consistent_hash`], bounded load. Requests sharing a head (a system prompt, a
//! conversation's first turn) meet on one worker without any index; a head shorter than the
//! key length is hashed whole.

use super::consistent_hash::{Ring, owner_or_least};
use super::{Decision, Request, Snapshot};
use rand::Rng;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Chars per token of a text request's head.
const HEAD_CHARS_PER_TOKEN: usize = 4;

/// The head's owner on `ring`.
pub fn decide(
    ring: &Ring,
    snap: &Snapshot<'_>,
    req: &Request<'_>,
    head_tokens: usize,
    load_factor: f64,
    rng: &mut impl Rng,
) -> Decision {
    let hash = match req.ids {
        Some(ids) => {
            let head = &ids[..ids.len().min(head_tokens)];
            let bytes: Vec<u8> = head.iter().flat_map(|t| t.to_le_bytes()).collect();
            Some(xxh3_64_with_seed(&bytes, req.key.namespace))
        }
        None if !req.key.text.is_empty() => {
            let end = req
                .key
                .text
                .char_indices()
                .nth(head_tokens * HEAD_CHARS_PER_TOKEN)
                .map_or(req.key.text.len(), |(i, _)| i);
            Some(xxh3_64_with_seed(
                &req.key.text.as_bytes()[..end],
                req.key.namespace,
            ))
        }
        None => None,
    };
    owner_or_least(ring, snap, hash, load_factor, rng)
}
