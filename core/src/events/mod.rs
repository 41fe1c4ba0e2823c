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
//!   keys (§7) with engine hashes kept as opaque handles: the writer side of the lock-free
//!   `kvroute_index::positional` index, with per-stream counters ([`index::StreamStats`]);
//!   [`index::EventReader`] (one per router) matches requests without a lock.
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
//! | a store's parent is unknown (orphan) | count it; replay the engine's whole buffer and re-apply it in order (at most once per 1,000 batches) | §8.7, B39 |
//! | a store with a nil parent | its blocks go to namespace [`event_namespace`]`(lora_name, cache_salt)`, the root of their key chain; requests match them only from the same namespace ([`crate::route_key::RouteKey::namespace`], same function) | anchors §2.7, §7 |
//! | a store with a known parent | inherits the parent's namespace through its key chain (its own `lora_name` / salt are not read: vLLM puts the salt in block 0's `extra_keys` only) | vLLM `generate_block_hash_extra_keys` |
//! | `cache_salt` | top-level `cache_salt` (map form), else `metadata.cache_salt` (SGLang `BlockStoredWithMetadata`; array form: a map in field 7), else the one string in `extra_keys[0]` after a leading copy of `lora_name`; empty = unset | §3.3–§3.4, Dynamo `zmq_wire/filter.rs` |
//! | a malformed partition or group field (`lora_name`, `extra_keys`, `cache_salt`, `metadata`, `group_idx`, `kv_cache_spec_kind`, window) | drop the batch, count `decode_errors` and `bad_partitions`, warn | house rule for bad fields |
//! | `kv_cache_spec_kind` full / MLA / sink full attention | prefix blocks: indexed | vLLM PR #40984, Dynamo `is_main_attention` |
//! | another kind (sliding window, Mamba, chunked local, encoder, cross) | store not indexed (`non_prefix_stores`), removal not applied (`non_prefix_removals`): it must not remove the full-attention copy of the same hash | PR #37688 ("vLLM can evict SWA blocks while retaining the full-attention blocks") |
//! | an unknown kind | as another kind, and counted (`unknown_group_kinds`) | Dynamo treats it as non-main |
//! | no kind, no `group_idx` | full attention (legacy single group) | vLLM `block_pool.py` before PR #37688: "we disable hybrid kv cache manager when kv cache event is enabled, so there is only one group" |
//! | no kind, `group_idx` g | g's kind if an earlier event named it; else full attention while g is the only kindless group of the stream; a second kindless group → stream cleared once, such events dropped (`ambiguous_groups`), warn | PR #37688 (HMA events, no kind) and PR #40984: group numbers "are allocator/layout details rather than stable semantic labels" |
//! | a removal naming a group no store named (and no kind) | not applied (`non_prefix_removals`): none of our copies is from it | — |
//! | a GPU store of a block already held on GPU (same stream) | one more copy (`copies`); the index itself is unchanged | vLLM `BlockHashToBlockMap`: "we don't de-duplicate the blocks in the cache"; one store per full-attention group |
//! | a GPU removal of a block with several copies | one copy fewer (`copies_kept`); the block leaves with its last copy | same; supersedes anchors §3.4 "duplicate stores are no-ops" (Dynamo), which drops a block another copy still holds |
//! | a batch whose `data_parallel_rank` / `attn_dp_rank` is not its socket's rank | applied under the socket's rank, counted (`rank_mismatches`): the socket (configured port + r) says which rank published it, and the index never learns a rank the config does not have, so no request targets it | B36 (Dynamo #5001: every pod launched with DP start rank 0 labels its batches, not its ports, wrongly) |
//! | during an orphan relearn | stores and removals of blocks held when it began change nothing (history already applied) | B39 with copies |

pub mod decode;
pub mod index;
pub mod sequence;

pub use decode::{BlockRemoved, BlockStored, DecodeError, EngineHash, EventBatch, KvEvent};
pub use index::{
    EventIndex, EventIndexSettings, EventReader, Holders, Match, StreamStats, Tier, kind_is_prefix,
};
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

/// Cache partition of blocks an engine stored for a request with LoRA adapter `lora_name` and
/// `cache_salt` (`None` or empty = unset): [`kvroute_tokenize::blocks::namespace_hash`]`(
/// cache_salt, None, lora_name)`, the function a request's
/// [`crate::route_key::RouteKey::namespace`] comes from, so a request with `cache_salt` s and
/// adapter a (`lora_path`, `lora_id` or `model: "base:a"`) matches exactly the blocks stored
/// with salt s under `lora_name` a. The request's `extra_key` (SGLang) has no counterpart in
/// the events: blocks of such requests land in the namespace of their salt and adapter only.
///
/// Models: the index serves every model of the fleet; routing looks only at workers eligible
/// for the request's model, so a stream's blocks count only for the models its worker
/// serves. A worker serving a base model and LoRA adapters publishes the adapters' blocks
/// with their `lora_name`: they live in the adapter's namespace and never match base-model
/// requests (and vice versa). A vLLM request that selects the adapter by `"model": "a"`
/// carries no adapter field the router reads, so it is in namespace 0 and does not see the
/// adapter's blocks (it falls back to the token tree).
pub fn event_namespace(
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> kvroute_index::Namespace {
    kvroute_tokenize::blocks::namespace_hash(cache_salt, None, lora_name)
}

/// kvroute's chained block keys of `tokens` cut into blocks of `block_size` tokens, continuing
/// the chain after `parent` (`None` = chain starts at the root). Only full blocks get a key.
/// The one key function is [`kvroute_index::keys`] (`kv-events.md` §7); this only continues a
/// chain from a known parent key.
pub fn chain_keys(parent: Option<u64>, tokens: &[u32], block_size: usize) -> Vec<u64> {
    use kvroute_index::keys::{chain, local_hash};
    if block_size == 0 {
        return Vec::new();
    }
    let mut prev = parent;
    tokens
        .chunks_exact(block_size)
        .map(|b| {
            let k = chain(prev, local_hash(b));
            prev = Some(k);
            k
        })
        .collect()
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
    /// and one [`Input::ReplayEnd`]. Until that end the stream is hidden from routing
    /// ([`EventIndex::set_hidden`]): what a replay applies is history.
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
        let orphans_before = index.stats_mut(stream).orphans;
        let mut replay = Self::run_steps(index, stream, steps);
        if replay.is_none() && index.stats_mut(stream).orphans > orphans_before {
            // B39: a lost store is never re-announced while the engine keeps the block;
            // relearn it from the engine's buffer (rate-limited by the tracker).
            replay = self
                .trackers
                .get_mut(&stream)
                .and_then(SeqTracker::request_relearn);
            if replay.is_some() {
                let stats = index.stats_mut(stream);
                stats.orphan_replays += 1;
                stats.replays += 1;
                tracing::info!(
                    worker = stream.worker,
                    rank = stream.rank,
                    orphans = stats.orphans,
                    "KV event orphan stores: replaying the engine's buffer"
                );
            }
        }
        // Mid-replay the stream shows history, not the engine's cache: hidden from routing.
        index.set_hidden(stream, self.replaying(stream));
        replay
    }

    /// Carries out `steps` for `stream`; returns the replay start they ask for, if any.
    fn run_steps(index: &mut EventIndex, stream: StreamId, steps: Vec<Step>) -> Option<u64> {
        let mut replay = None;
        for step in steps {
            index.set_relearning(stream, matches!(step, Step::Reapply { .. }));
            match step {
                Step::Reapply { seq, payload } => match decode::decode_batch(&payload) {
                    Ok(batch) => {
                        // Counters saw this batch when it first arrived.
                        let before = index.stats_mut(stream).clone();
                        index.apply_batch(stream, &batch);
                        let stats = index.stats_mut(stream);
                        *stats = before;
                        stats.reapplied_batches += 1;
                    }
                    Err(e) => {
                        tracing::debug!(worker = stream.worker, seq, "reapplied batch: {e}");
                    }
                },
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
                            if matches!(e, DecodeError::BadPartition { .. }) {
                                stats.bad_partitions += 1;
                            }
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
