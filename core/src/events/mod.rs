//! KV-cache events from real engines (vLLM, SGLang) and the simulated one: decoding, ordering,
//! gap recovery and the per-model event index. Pure: no sockets, no clocks, no threads; `io`
//! feeds frames in and sends the replay requests this module asks for.
//!
//! Main types:
//! - [`decode::decode_batch`]: msgpack payload → [`EventBatch`] (`kv-events.md` §3), and
//!   [`decode::split_live`] / [`decode::split_replay`] for the ZMQ frames (§1–§2).
//! - [`sequence::SeqTracker`]: per (worker, DP rank) seq tracking; gap → replay → buffer drain,
//!   restart and unrecoverable-gap clears (§2), as a state machine fed by frames.
//! - [`index::EventIndex`]: what each (worker, rank) really caches, keyed by kvroute's own block
//!   keys (§7) with engine hashes kept as opaque handles; `find_matches` for routing; per-stream
//!   counters ([`index::StreamStats`]).
//! - [`Consumer`]: ties them together: `on_live` / `on_replay` / `on_replay_end` update an
//!   [`index::EventIndex`] and return the replay to request, if any.
//!
//! | input | rule | source |
//! |---|---|---|
//! | live seq = last + 1 | apply | §2 |
//! | live seq > last + 1 | buffer live, replay from last + 1, apply, drain buffer skipping duplicates | §2, B22 |
//! | replay cannot cover the gap | clear the stream, rebuild from live | §2, §8.4 |
//! | live seq ≤ last, same payload as applied | duplicate, dropped | §8.3 |
//! | live seq ≤ last, other payload | engine restart: clear the stream | §2, §8.5 |
//! | `AllBlocksCleared` | clear the stream | §8.6, B24 |

pub mod decode;
pub mod index;
pub mod sequence;

pub use decode::{BlockRemoved, BlockStored, DecodeError, EngineHash, EventBatch, KvEvent};
pub use index::{EventIndex, Match, StreamStats, Tier};
pub use sequence::{ClearReason, SeqTracker, Step};

use std::collections::HashMap;

/// One event publisher: a worker (dense id, as in the worker registry) and its DP rank. Each
/// has its own PUB socket, replay socket and seq counter (`kv-events.md` §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
    /// Worker id (`0..n`).
    pub worker: u32,
    /// Data-parallel rank (`0..dp`); rank r publishes on the configured port + r.
    pub rank: u32,
}

/// Block-key seed S of `kv-events.md` §7 (no namespace).
pub const BLOCK_KEY_SEED: u64 = 1337;

/// kvroute's chained block keys of `tokens` cut into blocks of `block_size` tokens, continuing
/// the chain after `parent` (`None` = chain starts at the root). Only full blocks get a key.
/// Source: `kv-events.md` §7: `local_i = XXH3_64(seed S, u32le tokens)`, `key_0 = local_0`,
/// `key_i = XXH3_64(seed S, u64le(key_{i−1}) ‖ u64le(local_i))`.
// Same function as `tokenize::blocks::block_keys` (issue 4); this copy goes when it lands.
pub fn chain_keys(parent: Option<u64>, tokens: &[u32], block_size: usize) -> Vec<u64> {
    use xxhash_rust::xxh3::xxh3_64_with_seed;
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    if block_size == 0 {
        return out;
    }
    let mut prev = parent;
    let mut buf = Vec::with_capacity(4 * block_size);
    for block in tokens.chunks_exact(block_size) {
        buf.clear();
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        let local = xxh3_64_with_seed(&buf, BLOCK_KEY_SEED);
        let key = match prev {
            None => local,
            Some(p) => {
                let mut pair = [0u8; 16];
                pair[..8].copy_from_slice(&p.to_le_bytes());
                pair[8..].copy_from_slice(&local.to_le_bytes());
                xxh3_64_with_seed(&pair, BLOCK_KEY_SEED)
            }
        };
        out.push(key);
        prev = Some(key);
    }
    out
}

/// One input of [`Consumer`] for a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input<'a> {
    /// A live SUB message, already split ([`decode::split_live`]).
    Live {
        /// Its seq.
        seq: u64,
        /// Its msgpack payload.
        payload: &'a [u8],
    },
    /// One replayed batch ([`decode::ReplayFrames::Batch`]).
    Replay {
        /// Its seq.
        seq: u64,
        /// Its msgpack payload.
        payload: &'a [u8],
    },
    /// The replay ended: end marker, timeout, or no replay socket / engine down.
    ReplayEnd,
}

/// Ordering and recovery for every stream of one model, applying to an [`EventIndex`] the
/// caller owns (so it can lock it only while applying). Pure.
#[derive(Debug, Default)]
pub struct Consumer {
    trackers: HashMap<StreamId, SeqTracker>,
}

impl Consumer {
    /// Consumer with no stream yet; streams appear on first input.
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares `stream` and whether it has a replay socket (default: it has).
    pub fn add_stream(&mut self, stream: StreamId, replay_available: bool) {
        self.trackers
            .insert(stream, SeqTracker::new(replay_available));
    }

    /// Forgets `stream` (worker removed, B35); its index entries are the caller's to drop.
    pub fn remove_stream(&mut self, stream: StreamId) {
        self.trackers.remove(&stream);
    }

    /// True while `stream` waits for a replay to end.
    pub fn replaying(&self, stream: StreamId) -> bool {
        self.trackers
            .get(&stream)
            .is_some_and(SeqTracker::replaying)
    }

    /// Feeds one input of `stream`; applies what it releases to `index`. Returns `Some(start_seq)`
    /// when the caller must send a replay request `["", start_seq]` and later feed the replies
    /// and one [`Input::ReplayEnd`].
    pub fn handle(
        &mut self,
        index: &mut EventIndex,
        stream: StreamId,
        input: Input<'_>,
    ) -> Option<u64> {
        let tracker = self
            .trackers
            .entry(stream)
            .or_insert_with(|| SeqTracker::new(true));
        let steps = match input {
            Input::Live { seq, payload } => tracker.on_live(seq, payload),
            Input::Replay { seq, payload } => tracker.on_replay(seq, payload),
            Input::ReplayEnd => tracker.on_replay_end(),
        };
        let mut replay = None;
        for step in steps {
            match step {
                Step::Apply { seq, payload } => {
                    let stats = index.stats_mut(stream);
                    stats.last_seq = Some(seq);
                    stats.batches += 1;
                    match decode::decode_batch(&payload) {
                        Ok(batch) => {
                            if batch.dp_rank.is_some_and(|r| r != stream.rank) {
                                stats.rank_mismatches += 1;
                            }
                            index.apply_batch(stream, &batch);
                        }
                        Err(e) => {
                            stats.decode_errors += 1;
                            tracing::warn!(
                                worker = stream.worker,
                                rank = stream.rank,
                                seq,
                                "KV event batch dropped: {e}"
                            );
                        }
                    }
                }
                Step::Clear(reason) => {
                    let stats = index.stats_mut(stream);
                    match reason {
                        ClearReason::Restart => stats.restarts += 1,
                        ClearReason::GapUnrecoverable => stats.unrecoverable_gaps += 1,
                    }
                    tracing::warn!(
                        worker = stream.worker,
                        rank = stream.rank,
                        ?reason,
                        "KV event stream cleared"
                    );
                    index.clear(stream);
                }
                Step::Duplicate { .. } => index.stats_mut(stream).duplicates += 1,
                Step::Replay { start_seq } => {
                    let stats = index.stats_mut(stream);
                    stats.gaps += 1;
                    stats.replays += 1;
                    replay = Some(start_seq);
                }
            }
        }
        replay
    }
}

#[cfg(test)]
mod tests;
