//! [`EventIndex`]: what each (worker, DP rank) really caches, from its KV events, keyed by
//! kvroute's own block keys (`kv-events.md` §7). Engine hashes are opaque handles used only for
//! parent links and removals. Pure; the caller serialises writes.
//!
//! Rules (`kv-events.md` §8): a store chains from its parent's last key (nil = root; an unknown
//! parent is an orphan: counted, skipped); block i chains from block i − 1 (B30); the block
//! size is learned per stream from `token_ids / block_hashes` (a wrong declared size is
//! counted, not trusted); engine blocks that are k × the router block give k keys each (B31,
//! B32); other sizes are not indexed and counted; a token count that is not blocks × size is
//! skipped and counted; stores with no tokens (offload, B25) add a tier to known hashes;
//! removals drop one tier; `AllBlocksCleared` clears the stream (B24).

use std::collections::HashMap;

use super::decode::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use super::{StreamId, chain_keys};

/// Storage tier of a cached block (`kv-events.md` §3.6, Dynamo's mapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// GPU memory (`GPU`, `DEVICE`, nil, and unknown names: fail open).
    Device = 0,
    /// Host memory (`CPU`, `CPU_PINNED`, `CPU_TIER1`).
    Host = 1,
    /// Local disk (`CPU_TIER2`, `DISK`, `NVME`, `STORAGE`).
    Disk = 2,
    /// Remote storage (`EXTERNAL`, `NETWORK`, `REMOTE`, `SHARED`).
    External = 3,
}

impl Tier {
    /// Tier of a `medium` string; `(tier, known)`: unknown names map to device and are counted.
    pub fn from_medium(medium: Option<&str>) -> (Tier, bool) {
        let Some(m) = medium else {
            return (Tier::Device, true);
        };
        match m.to_ascii_uppercase().as_str() {
            "GPU" | "DEVICE" => (Tier::Device, true),
            "CPU" | "CPU_PINNED" | "CPU_TIER1" => (Tier::Host, true),
            "CPU_TIER2" | "DISK" | "NVME" | "STORAGE" => (Tier::Disk, true),
            "EXTERNAL" | "NETWORK" | "REMOTE" | "SHARED" => (Tier::External, true),
            _ => (Tier::Device, false),
        }
    }

    /// Credit of a block held only in this tier: device 1, host 0.75, disk and external 0.25
    /// (Dynamo's weights, `kv-events.md` §3.6).
    pub fn weight(self) -> f64 {
        match self {
            Tier::Device => 1.0,
            Tier::Host => 0.75,
            Tier::Disk | Tier::External => 0.25,
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// Best weight among the tiers in `mask`.
fn mask_weight(mask: u8) -> f64 {
    [Tier::Device, Tier::Host, Tier::Disk, Tier::External]
        .into_iter()
        .find(|t| mask & t.bit() != 0)
        .map_or(0.0, Tier::weight)
}

/// Counters of one stream (`kvroute_kv_events_*` metrics, `/admin/cache-view`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Batches applied (decoded or not).
    pub batches: u64,
    /// Events applied.
    pub events: u64,
    /// Gaps seen in the live stream (each asked for one replay or cleared).
    pub gaps: u64,
    /// Replay requests sent.
    pub replays: u64,
    /// Gaps replay could not fill → stream cleared.
    pub unrecoverable_gaps: u64,
    /// Engine restarts (seq went backwards) → stream cleared.
    pub restarts: u64,
    /// Batches dropped as already applied.
    pub duplicates: u64,
    /// Batches dropped because they did not decode.
    pub decode_errors: u64,
    /// Events with an unknown tag, skipped.
    pub skipped_events: u64,
    /// Stores whose parent is unknown, skipped (§8.7, B39).
    pub orphans: u64,
    /// Replays of the engine's whole buffer asked for because stores were orphans (B39), at
    /// most one per [`super::sequence::ORPHAN_REPLAY_EVERY_BATCHES`] batches; also counted in
    /// `replays`.
    pub orphan_replays: u64,
    /// Batches applied a second time by those replays (not counted in `batches`/`events`).
    pub reapplied_batches: u64,
    /// Stores whose token count is not blocks × block size, skipped (§8.10).
    pub length_mismatches: u64,
    /// Stores whose declared `block_size` differs from the learned one (§8.9).
    pub declared_size_mismatches: u64,
    /// Stores not indexed because the learned block size does not divide into router blocks.
    pub size_mismatches: u64,
    /// Tokenless stores for unknown engine hashes (§8.8, B25).
    pub unknown_offloads: u64,
    /// Removals of unknown engine hashes (normal after a clear or a late join).
    pub unknown_removals: u64,
    /// Stores naming one of their own hashes as parent, rejected (§8.11).
    pub self_references: u64,
    /// `medium` names not in the tier table (mapped to device).
    pub unknown_media: u64,
    /// Batches whose `data_parallel_rank` differs from the socket's rank.
    pub rank_mismatches: u64,
    /// Clears by `AllBlocksCleared`.
    pub cleared: u64,
    /// Seq of the last applied batch.
    pub last_seq: Option<u64>,
    /// Block size learned from the last store, tokens.
    pub learned_block_size: Option<usize>,
}

/// One cached engine block of a stream.
#[derive(Debug, Clone)]
struct Entry {
    /// Router keys of this engine block (k ≥ 1 when the engine block is k router blocks).
    keys: Vec<u64>,
    /// Tiers holding it (bit per [`Tier`]).
    tiers: u8,
}

#[derive(Debug, Default)]
struct StreamState {
    by_engine: HashMap<EngineHash, Entry>,
    /// Router key → tier mask (refcounted by the engine blocks that carry it).
    keys: HashMap<u64, (u32, u8)>,
    stats: StreamStats,
}

/// A stream holding a prefix of a query.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Match {
    /// The stream.
    pub stream: StreamId,
    /// Consecutive leading blocks held, in router blocks.
    pub blocks: usize,
    /// Σ over those blocks of the best tier weight ([`Tier::weight`]).
    pub weighted_blocks: f64,
}

/// The event index of one model.
///
/// # Invariants
/// 1. `holders[k]` contains `s` iff stream `s` has key `k` in its `keys` map.
/// 2. A stream's `keys` refcounts equal the number of its engine entries carrying the key.
/// 3. No entry has an empty tier mask.
#[derive(Debug)]
pub struct EventIndex {
    block_size: usize,
    streams: HashMap<StreamId, StreamState>,
    holders: HashMap<u64, Vec<StreamId>>,
}

impl EventIndex {
    /// Empty index for router blocks of `block_size` tokens (> 0).
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            streams: HashMap::new(),
            holders: HashMap::new(),
        }
    }

    /// Router block size, tokens.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// True when no stream holds any block (routing then falls back to the token tree).
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Counters of `stream` (created on first use).
    pub fn stats_mut(&mut self, stream: StreamId) -> &mut StreamStats {
        &mut self.streams.entry(stream).or_default().stats
    }

    /// Counters of every known stream, sorted by stream.
    pub fn stats(&self) -> Vec<(StreamId, StreamStats)> {
        let mut v: Vec<_> = self
            .streams
            .iter()
            .map(|(s, st)| (*s, st.stats.clone()))
            .collect();
        v.sort_by_key(|(s, _)| *s);
        v
    }

    /// Engine blocks `stream` holds in `tier`.
    pub fn engine_hashes(&self, stream: StreamId, tier: Tier) -> Vec<EngineHash> {
        self.streams.get(&stream).map_or_else(Vec::new, |s| {
            s.by_engine
                .iter()
                .filter(|(_, e)| e.tiers & tier.bit() != 0)
                .map(|(h, _)| *h)
                .collect()
        })
    }

    /// Engine blocks (any tier) held by all ranks of `worker`.
    pub fn worker_blocks(&self, worker: u32) -> usize {
        self.streams
            .iter()
            .filter(|(s, _)| s.worker == worker)
            .map(|(_, st)| st.by_engine.len())
            .sum()
    }

    /// Router keys (any tier) held by `stream`.
    pub fn stream_keys(&self, stream: StreamId) -> usize {
        self.streams.get(&stream).map_or(0, |s| s.keys.len())
    }

    /// Applies every event of `batch` to `stream`, in order.
    pub fn apply_batch(&mut self, stream: StreamId, batch: &EventBatch) {
        let st = self.stats_mut(stream);
        st.skipped_events += u64::from(batch.skipped_events);
        st.events += batch.events.len() as u64;
        for ev in &batch.events {
            match ev {
                KvEvent::Stored(s) => self.stored(stream, s),
                KvEvent::Removed(r) => self.removed(stream, r),
                KvEvent::AllCleared => {
                    self.stats_mut(stream).cleared += 1;
                    self.clear(stream);
                }
            }
        }
    }

    /// Applies one `BlockStored`.
    pub fn stored(&mut self, stream: StreamId, ev: &BlockStored) {
        let rbs = self.block_size;
        let (tier, known) = Tier::from_medium(ev.medium.as_deref());
        let state = self.streams.entry(stream).or_default();
        if !known {
            state.stats.unknown_media += 1;
        }
        let n = ev.block_hashes.len();
        if n == 0 {
            return;
        }
        if ev
            .parent_block_hash
            .is_some_and(|p| ev.block_hashes.contains(&p))
        {
            state.stats.self_references += 1;
            return;
        }
        if ev.token_ids.is_empty() {
            // Offload store (B25): a tier for blocks known from their GPU store.
            for h in &ev.block_hashes {
                match state.by_engine.get_mut(h) {
                    Some(e) => {
                        e.tiers |= tier.bit();
                        for k in e.keys.clone() {
                            if let Some(r) = state.keys.get_mut(&k) {
                                r.1 |= tier.bit();
                            }
                        }
                    }
                    None => state.stats.unknown_offloads += 1,
                }
            }
            return;
        }
        if !ev.token_ids.len().is_multiple_of(n) {
            state.stats.length_mismatches += 1;
            return;
        }
        let ebs = ev.token_ids.len() / n;
        state.stats.learned_block_size = Some(ebs);
        if ev.block_size != 0 && ev.block_size != ebs {
            state.stats.declared_size_mismatches += 1;
        }
        if !ebs.is_multiple_of(rbs) {
            state.stats.size_mismatches += 1;
            tracing::warn!(
                worker = stream.worker,
                rank = stream.rank,
                engine_block = ebs,
                router_block = rbs,
                "engine block size is not a multiple of the router's: not indexed"
            );
            return;
        }
        let mut prev = match ev.parent_block_hash {
            None => None,
            Some(p) => match state.by_engine.get(&p) {
                Some(e) => e.keys.last().copied(),
                None => {
                    state.stats.orphans += 1;
                    return;
                }
            },
        };
        for (i, h) in ev.block_hashes.iter().enumerate() {
            if let Some(e) = state.by_engine.get_mut(h) {
                // Already indexed (duplicate store): never inflate counts (§8.3).
                e.tiers |= tier.bit();
                prev = e.keys.last().copied();
                continue;
            }
            let keys = chain_keys(prev, &ev.token_ids[i * ebs..(i + 1) * ebs], rbs);
            prev = keys.last().copied();
            for &k in &keys {
                let r = state.keys.entry(k).or_insert((0, 0));
                r.0 += 1;
                r.1 |= tier.bit();
                if r.0 == 1 {
                    self.holders.entry(k).or_default().push(stream);
                }
            }
            state.by_engine.insert(
                *h,
                Entry {
                    keys,
                    tiers: tier.bit(),
                },
            );
        }
    }

    /// Applies one `BlockRemoved`: drops its tier from each block; a block left in no tier
    /// leaves the index.
    pub fn removed(&mut self, stream: StreamId, ev: &BlockRemoved) {
        let (tier, _) = Tier::from_medium(ev.medium.as_deref());
        let state = self.streams.entry(stream).or_default();
        for h in &ev.block_hashes {
            let Some(e) = state.by_engine.get_mut(h) else {
                state.stats.unknown_removals += 1;
                continue;
            };
            e.tiers &= !tier.bit();
            if e.tiers != 0 {
                // A key carried by this entry alone takes its remaining tiers; a key shared
                // by several engine blocks keeps the union (over-credits, never under).
                let tiers = e.tiers;
                for k in &e.keys {
                    if let Some(r) = state.keys.get_mut(k)
                        && r.0 == 1
                    {
                        r.1 = tiers;
                    }
                }
                continue;
            }
            let e = state.by_engine.remove(h).expect("entry present");
            for k in e.keys {
                let Some(r) = state.keys.get_mut(&k) else {
                    continue;
                };
                r.0 -= 1;
                if r.0 == 0 {
                    state.keys.remove(&k);
                    remove_holder(&mut self.holders, k, stream);
                }
            }
        }
    }

    /// Drops every block of `stream` (`AllBlocksCleared`, restart, unrecoverable gap). Its
    /// counters stay.
    pub fn clear(&mut self, stream: StreamId) {
        let Some(state) = self.streams.get_mut(&stream) else {
            return;
        };
        state.by_engine.clear();
        for (k, _) in state.keys.drain() {
            remove_holder(&mut self.holders, k, stream);
        }
    }

    /// Forgets every stream of `worker`, counters included (worker removed, B35).
    pub fn remove_worker(&mut self, worker: u32) {
        let streams: Vec<StreamId> = self
            .streams
            .keys()
            .filter(|s| s.worker == worker)
            .copied()
            .collect();
        for s in streams {
            self.clear(s);
            self.streams.remove(&s);
        }
    }

    /// Streams holding a prefix of `keys` (router block keys of one prompt), with the count of
    /// consecutive leading blocks each holds (a hole truncates). Streams holding no leading
    /// block are absent. Cost O(Σ holders over the matched prefix).
    pub fn find_matches(&self, keys: &[u64]) -> Vec<Match> {
        let Some(first) = keys.first().and_then(|k| self.holders.get(k)) else {
            return Vec::new();
        };
        let mut out: Vec<Match> = first
            .iter()
            .map(|&s| Match {
                stream: s,
                blocks: 0,
                weighted_blocks: 0.0,
            })
            .collect();
        let mut frozen = vec![false; out.len()];
        let mut alive = out.len();
        for k in keys {
            if alive == 0 {
                break;
            }
            for (m, f) in out.iter_mut().zip(frozen.iter_mut()) {
                if *f {
                    continue;
                }
                let mask = self
                    .streams
                    .get(&m.stream)
                    .and_then(|st| st.keys.get(k))
                    .map(|r| r.1);
                match mask {
                    Some(mask) => {
                        m.blocks += 1;
                        m.weighted_blocks += mask_weight(mask);
                    }
                    None => {
                        *f = true;
                        alive -= 1;
                    }
                }
            }
        }
        out
    }

    /// Checks the invariants; the error names the broken one.
    ///
    /// # Errors
    /// `(number, stream)` of the first broken invariant.
    pub fn check_invariants(&self) -> Result<(), (u8, Option<StreamId>)> {
        let mut count = 0usize;
        for (s, st) in &self.streams {
            let mut refs: HashMap<u64, u32> = HashMap::new();
            for e in st.by_engine.values() {
                if e.tiers == 0 {
                    return Err((3, Some(*s)));
                }
                for k in &e.keys {
                    *refs.entry(*k).or_default() += 1;
                }
            }
            if refs.len() != st.keys.len()
                || refs
                    .iter()
                    .any(|(k, n)| st.keys.get(k).map(|r| r.0) != Some(*n))
            {
                return Err((2, Some(*s)));
            }
            for k in st.keys.keys() {
                if !self.holders.get(k).is_some_and(|h| h.contains(s)) {
                    return Err((1, Some(*s)));
                }
            }
            count += st.keys.len();
        }
        if self.holders.values().map(Vec::len).sum::<usize>() != count {
            return Err((1, None));
        }
        Ok(())
    }
}

fn remove_holder(holders: &mut HashMap<u64, Vec<StreamId>>, key: u64, stream: StreamId) {
    if let Some(v) = holders.get_mut(&key) {
        v.retain(|s| *s != stream);
        if v.is_empty() {
            holders.remove(&key);
        }
    }
}
