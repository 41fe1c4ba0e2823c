//! [`EventIndex`]: what each (worker, DP rank) really caches, from its KV events, keyed by
//! kvroute's own block keys (`kv-events.md` §7). Engine hashes are opaque handles used only for
//! parent links and removals. Pure; one writer (the caller) applies events, and any number of
//! [`EventReader`]s (one per gateway shard) match requests **without a lock**.
//!
//! Storage is the lock-free positional index of the `index` crate
//! ([`kvroute_index::positional`]): every stream (worker, DP rank) gets a dense id (a bit of
//! the index's worker sets) on first use; this module adds what the engines' wire format needs
//! on top: per-stream counters, the learned block size and its re-cut into router blocks, and
//! storage tiers.
//!
//! Rules (`kv-events.md` §8): a store chains from its parent's last key (nil = root; an unknown
//! parent is an orphan: counted, skipped); block i chains from block i − 1 (B30); the block
//! size is learned per stream from `token_ids / block_hashes` (a wrong declared size is
//! counted, not trusted); engine blocks that are k × the router block give k keys each (B31,
//! B32), stored as k positional blocks whose last one carries the engine hash (the others get
//! derived handles, [`sub_hash`]); other sizes are not indexed and counted; a token count that
//! is not blocks × size is skipped and counted; stores with no tokens (offload, B25) add a tier
//! to known hashes; removals drop one tier and a block leaves the index when it is in no tier;
//! `AllBlocksCleared` clears the stream (B24).
//!
//! Partitions and groups (`kv-events.md` §3.3–§3.4, anchors §2.7): a store that starts a
//! sequence (nil parent) is indexed in the namespace [`super::event_namespace`] gives its
//! `lora_name` and `cache_salt` (the function requests use too), as the root of its key chain
//! ([`kvroute_index::keys::root`]); a child store chains from its parent's key and so inherits
//! the parent's namespace (vLLM sends the salt with a sequence's first block only). Only the
//! blocks of prefix groups (full attention, MLA, sink full attention: [`kind_is_prefix`]) are
//! indexed; stores and removals of other groups (sliding window, Mamba, chunked local, …) are
//! counted and dropped, see the rule table in [`super`]. A GPU store of a block the stream
//! already holds on GPU is a second physical copy (vLLM's block pool does not de-duplicate,
//! and each full-attention group stores its own): copies are counted per (stream, engine
//! hash) and a GPU removal drops one copy; the block leaves the GPU tier with its last copy.
//!
//! Tiers decide residency only: a block held in any tier (GPU, CPU, disk, remote) counts as
//! held when matching. Only blocks whose tier set is not exactly {GPU} are remembered here
//! (one small map entry each), so the common GPU-only case costs nothing beyond the
//! positional index.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use kvroute_index::positional::{self, Depths, EventIndexConfig, EventWriter, SHARD_WORKERS};

use super::StreamId;
use super::decode::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};

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

    fn bit(self) -> u8 {
        1 << self as u8
    }
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
    /// Events of a stream beyond the index's stream capacity, not indexed.
    pub over_capacity: u64,
    /// Batches dropped because a partition or group field was malformed
    /// ([`super::DecodeError::BadPartition`]; also counted in `decode_errors`).
    pub bad_partitions: u64,
    /// Stores of a KV-cache group that is not a prefix group (sliding window, Mamba, …),
    /// not indexed.
    pub non_prefix_stores: u64,
    /// Removals of such a group (or of a group never seen in a store), not applied: they
    /// must not remove the full-attention copy of the same hash.
    pub non_prefix_removals: u64,
    /// Events naming a `kv_cache_spec_kind` not in [`kind_is_prefix`]'s table (treated as
    /// not a prefix group, as Dynamo does).
    pub unknown_group_kinds: u64,
    /// Events not applied because their group carries no kind and the stream shows more than
    /// one group (the group number alone does not say which is full attention).
    pub ambiguous_groups: u64,
    /// GPU removals that dropped one of several copies of a block (the block stays).
    pub copies_kept: u64,
}

impl StreamStats {
    /// Adds every counter of `other` (streams, replicas) to `self`; `last_seq` and
    /// `learned_block_size` describe one stream and stay as they are.
    pub fn add_counters(&mut self, other: &StreamStats) {
        // Exhaustive: a new field must be placed on one side or the other.
        let StreamStats {
            batches,
            events,
            gaps,
            replays,
            unrecoverable_gaps,
            restarts,
            duplicates,
            decode_errors,
            skipped_events,
            orphans,
            orphan_replays,
            reapplied_batches,
            length_mismatches,
            declared_size_mismatches,
            size_mismatches,
            unknown_offloads,
            unknown_removals,
            self_references,
            unknown_media,
            rank_mismatches,
            cleared,
            over_capacity,
            bad_partitions,
            non_prefix_stores,
            non_prefix_removals,
            unknown_group_kinds,
            ambiguous_groups,
            copies_kept,
            last_seq: _,
            learned_block_size: _,
        } = other;
        self.batches += batches;
        self.events += events;
        self.gaps += gaps;
        self.replays += replays;
        self.unrecoverable_gaps += unrecoverable_gaps;
        self.restarts += restarts;
        self.duplicates += duplicates;
        self.decode_errors += decode_errors;
        self.skipped_events += skipped_events;
        self.orphans += orphans;
        self.orphan_replays += orphan_replays;
        self.reapplied_batches += reapplied_batches;
        self.length_mismatches += length_mismatches;
        self.declared_size_mismatches += declared_size_mismatches;
        self.size_mismatches += size_mismatches;
        self.unknown_offloads += unknown_offloads;
        self.unknown_removals += unknown_removals;
        self.self_references += self_references;
        self.unknown_media += unknown_media;
        self.rank_mismatches += rank_mismatches;
        self.cleared += cleared;
        self.over_capacity += over_capacity;
        self.bad_partitions += bad_partitions;
        self.non_prefix_stores += non_prefix_stores;
        self.non_prefix_removals += non_prefix_removals;
        self.unknown_group_kinds += unknown_group_kinds;
        self.ambiguous_groups += ambiguous_groups;
        self.copies_kept += copies_kept;
    }
}

/// Tier bit of GPU-only blocks, the ones not listed in [`StreamState::tiers`].
const DEVICE: u8 = 1 << Tier::Device as u8;

/// Streams an index holds when not told otherwise ([`EventIndex::new`]): one 64-bit word per
/// block key in the positional table.
pub const DEFAULT_STREAMS: usize = SHARD_WORKERS;

/// Handle of router block `j` (of `k`) of engine block `engine`: the last one is the engine
/// hash itself (so parent links by engine hash need no translation), the others are derived
/// with xxh3 seeded by `j + 1` (a collision with a real engine hash is a 2^-64 event).
pub fn sub_hash(engine: EngineHash, j: usize, k: usize) -> EngineHash {
    if j + 1 == k {
        engine
    } else {
        xxhash_rust::xxh3::xxh3_64_with_seed(&engine.to_le_bytes(), j as u64 + 1)
    }
}

/// Whether the blocks of a KV-cache group of kind `kind` (vLLM `kv_cache_spec_kind`, PR
/// #40984) are prefix blocks: `Some(true)` for `full_attention`, `mla_attention`,
/// `sink_full_attention` (every block of the prefix kept); `Some(false)` for
/// `sliding_window`, `sliding_window_mla`, `chunked_local_attention` (only the last window
/// or chunk is needed, older blocks are dropped independently), `mamba` (one state per
/// request, not per prefix block), `encoder_only_attention`, `cross_attention` (not the
/// decoder's prefix); `None` for any other name (the caller counts it and treats it as not a
/// prefix group). Source: vLLM `KVCacheSpecKind`, Dynamo `zmq_wire/filter.rs`
/// `is_main_attention`.
pub fn kind_is_prefix(kind: &str) -> Option<bool> {
    match kind {
        "full_attention" | "mla_attention" | "sink_full_attention" => Some(true),
        "sliding_window"
        | "sliding_window_mla"
        | "chunked_local_attention"
        | "mamba"
        | "encoder_only_attention"
        | "cross_attention" => Some(false),
        _ => None,
    }
}

/// Per-stream state kept beside the positional index.
#[derive(Debug, Default)]
struct StreamState {
    /// Dense id in the positional index (`None`: beyond capacity, never indexed).
    id: Option<u32>,
    /// Router blocks per engine block of the stored blocks (0 until the first store).
    ratio: usize,
    /// Tier mask of held engine blocks whose tiers are not exactly {GPU}.
    tiers: HashMap<EngineHash, u8>,
    /// Held engine hashes, kept only while `ratio > 1` (the positional index then also holds
    /// derived handles, which are not engine blocks).
    recut: HashSet<EngineHash>,
    /// GPU copies beyond the first of held blocks stored more than once on GPU (duplicate
    /// stores, several full-attention groups); absent = one copy.
    copies: HashMap<EngineHash, u32>,
    /// Group index → prefix group or not, learned from events that name the group's kind.
    groups: HashMap<u32, bool>,
    /// The one group index seen in stores without a kind (treated as full attention while
    /// it is the only one).
    kindless_group: Option<u32>,
    /// Stores without a kind named two group indexes: such events are no longer applied.
    ambiguous: bool,
    /// During an orphan relearn ([`EventIndex::set_relearning`]): blocks the relearn itself
    /// added, the only ones whose copies re-applied history may change.
    relearned: Option<HashSet<EngineHash>>,
    stats: StreamStats,
}

/// What a store or removal's group makes of it.
enum GroupRole {
    /// Prefix blocks: apply.
    Prefix,
    /// Another kind of group, or an unknown one: drop and count.
    NotPrefix,
    /// A kindless group next to another kindless one: drop, count as ambiguous.
    Ambiguous,
}

impl StreamState {
    /// The role of an event of group `group` with kind `kind`; learns the group's kind. The
    /// rules are rows of the table in [`super`].
    fn group_role(&mut self, group: Option<u32>, kind: Option<&str>, store: bool) -> GroupRole {
        if let Some(k) = kind {
            let prefix = kind_is_prefix(k).unwrap_or_else(|| {
                self.stats.unknown_group_kinds += 1;
                false
            });
            if let Some(g) = group {
                self.groups.insert(g, prefix);
            }
            return if prefix {
                GroupRole::Prefix
            } else {
                GroupRole::NotPrefix
            };
        }
        let Some(g) = group else {
            return GroupRole::Prefix;
        };
        if let Some(&prefix) = self.groups.get(&g) {
            return if prefix {
                GroupRole::Prefix
            } else {
                GroupRole::NotPrefix
            };
        }
        if self.ambiguous {
            return GroupRole::Ambiguous;
        }
        match self.kindless_group {
            Some(k) if k == g => GroupRole::Prefix,
            None if store => {
                self.kindless_group = Some(g);
                GroupRole::Prefix
            }
            // A removal of a group no store has named: none of our copies is from it.
            None => GroupRole::NotPrefix,
            Some(_) if store => {
                self.ambiguous = true;
                GroupRole::Ambiguous
            }
            Some(_) => GroupRole::NotPrefix,
        }
    }
}

/// A stream holding a prefix of a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match {
    /// The stream.
    pub stream: StreamId,
    /// Consecutive leading router blocks held (any tier).
    pub blocks: usize,
}

/// Lock-free read side of an [`EventIndex`]: cheap to clone, `Send + Sync`; one per gateway
/// shard. A match never takes a lock nor waits for the writer.
#[derive(Clone)]
pub struct EventReader {
    index: positional::EventIndex,
    /// Dense id → its stream's owner, chain link and visibility ([`Slot`]).
    slots: Arc<[Slot]>,
    /// Worker → its newest dense id ([`NO_ID`]: none), for workers below the capacity (a
    /// worker at or past it is found by a scan of `slots`). Dense ids are never reused, so
    /// these chains only grow.
    heads: Arc<[AtomicU32]>,
}

/// What the read side knows of one dense id, 16 bytes aligned to 16 so that one cache line
/// holds it whole: a decision maps each candidate worker to its streams
/// ([`Holders::tokens_among`]) through `heads` and then these, one line each (they were three
/// arrays, three lines per stream: perf/runs/2026-12-06-decision-anatomy).
#[derive(Debug)]
#[repr(C, align(16))]
struct Slot {
    /// `worker << 32 | rank`; `u64::MAX` = unassigned.
    owner: AtomicU64,
    /// The same worker's previous dense id ([`NO_ID`]: none).
    prev: AtomicU32,
    /// Hidden from matches ([`EventIndex::set_hidden`]).
    hidden: AtomicBool,
}

impl Slot {
    fn new() -> Self {
        Self {
            owner: AtomicU64::new(u64::MAX),
            prev: AtomicU32::new(NO_ID),
            hidden: AtomicBool::new(false),
        }
    }
}

/// No dense id (end of a worker's chain in [`EventReader`]).
const NO_ID: u32 = u32::MAX;

impl std::fmt::Debug for EventReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventReader")
            .field("block_size", &self.index.block_size())
            .field("entries", &self.index.entries())
            .finish()
    }
}

impl EventReader {
    /// Router block size, tokens.
    pub fn block_size(&self) -> usize {
        self.index.block_size()
    }

    /// True when no stream holds any block (routing then falls back to the token tree).
    pub fn is_empty(&self) -> bool {
        self.index.entries() == 0
    }

    /// (stream, router block) entries held (gauge).
    pub fn entries(&self) -> usize {
        self.index.entries()
    }

    /// Router block keys of `tokens` in cache namespace `ns` (the request's
    /// [`crate::route_key::RouteKey::namespace`]): [`kvroute_index::keys::block_keys_in`] at
    /// this index's block size, what [`Self::find_matches`] takes.
    pub fn block_keys(&self, ns: kvroute_index::Namespace, tokens: &[u32]) -> Vec<u64> {
        kvroute_index::keys::block_keys_in(ns, tokens, self.index.block_size())
    }

    /// Streams holding a prefix of `keys` (router block keys of one prompt in its cache
    /// namespace, [`Self::block_keys`] / [`kvroute_index::keys::block_keys_in`]: blocks
    /// stored in another namespace never match), with the count of consecutive leading blocks each
    /// holds (a hole truncates); streams holding no leading block, and hidden streams
    /// ([`EventIndex::set_hidden`]), are absent. Lock-free; cost
    /// as [`positional::EventIndex::find_matches`] (jump search, O(len / 32) probes when no
    /// stream has a hole).
    pub fn find_matches(&self, keys: &[u64]) -> Vec<Match> {
        let found = self.index.find_matches(keys).0;
        let mut out = Vec::with_capacity(found.len());
        out.extend(found.into_iter().filter_map(|(id, blocks)| {
            self.owner(id).map(|stream| Match {
                stream,
                blocks: blocks as usize,
            })
        }));
        out
    }

    /// [`Self::find_matches`] as `(worker, matched tokens)`: `blocks × block size`, one
    /// entry per (worker, DP rank) stream, in stream order; one allocation of the answer's
    /// size, the layout a policy reads ([`crate::policy::prefix::PrefixIndex`]).
    pub fn worker_tokens(&self, keys: &[u64]) -> Vec<(u32, usize)> {
        let bs = self.block_size();
        let found = self.index.find_matches(keys).0;
        let mut out = Vec::with_capacity(found.len());
        out.extend(found.into_iter().filter_map(|(id, blocks)| {
            self.owner(id)
                .map(|stream| (stream.worker, blocks as usize * bs))
        }));
        out
    }

    /// The stream of dense id `id`, `None` when hidden or unassigned.
    #[inline]
    fn owner(&self, id: u32) -> Option<StreamId> {
        let slot = self.slots.get(id as usize)?;
        if slot.hidden.load(Ordering::Acquire) {
            return None;
        }
        let o = slot.owner.load(Ordering::Acquire);
        (o != u64::MAX).then_some(StreamId {
            worker: (o >> 32) as u32,
            rank: o as u32,
        })
    }

    /// Calls `f` with each dense id of `worker`'s streams, hidden ones included: O(its
    /// streams) below the capacity, a scan of every id at or past it.
    fn for_each_id(&self, worker: u32, mut f: impl FnMut(u32)) {
        match self.heads.get(worker as usize) {
            Some(head) => {
                let mut id = head.load(Ordering::Acquire);
                while id != NO_ID {
                    f(id);
                    id = self.slots[id as usize].prev.load(Ordering::Relaxed);
                }
            }
            None => {
                for (id, slot) in self.slots.iter().enumerate() {
                    let o = slot.owner.load(Ordering::Acquire);
                    if o != u64::MAX && o >> 32 == u64::from(worker) {
                        f(id as u32);
                    }
                }
            }
        }
    }

    /// Calls `f(dense id, stream)` for each visible (not hidden, assigned) stream of
    /// `worker`. O(its streams), as [`Self::for_each_id`].
    fn for_each_visible(&self, worker: u32, mut f: impl FnMut(u32, StreamId)) {
        self.for_each_id(worker, |id| {
            if let Some(s) = self.owner(id) {
                f(id, s);
            }
        });
    }

    /// Visible streams (DP ranks) of `worker`. O(its streams), no index query.
    pub fn streams_of(&self, worker: u32) -> usize {
        let mut n = 0;
        self.for_each_visible(worker, |_, _| n += 1);
        n
    }

    /// The streams holding a prefix of `keys` (as [`Self::find_matches`]), grouped by depth
    /// so that a decision over thousands of workers takes the deepest few without mapping
    /// every holder to its worker ([`Holders`]). Cost: the positional query, plus O(streams)
    /// u32 writes of its answer.
    pub fn holders(&self, keys: &[u64]) -> Holders<'_> {
        Holders {
            reader: self,
            depths: self.index.find_depths(keys),
        }
    }
}

/// One query's holders ([`EventReader::holders`]): per worker, the most router blocks any of
/// its visible (not hidden) streams holds; hidden and unassigned streams count as holding
/// nothing.
pub struct Holders<'r> {
    reader: &'r EventReader,
    depths: Depths,
}

impl Holders<'_> {
    /// Matched tokens of `worker`: its deepest visible stream's blocks × block size (0 when
    /// it holds none). O(its streams).
    pub fn tokens(&self, worker: u32) -> usize {
        let mut best = 0;
        self.reader
            .for_each_visible(worker, |id, _| best = best.max(self.depths.blocks(id)));
        best as usize * self.reader.block_size()
    }

    /// `(worker, matched tokens)` of each of `workers` that holds some of the query, in the
    /// order of `workers`: [`Self::tokens`] of each, with every worker's `heads` entry and
    /// then every stream's slot asked of memory before the first is read (a decision's ~32
    /// candidates are lines no recent decision touched: their misses overlap instead of
    /// queueing). Workers past `u32` are skipped.
    pub fn tokens_among(&self, workers: &[usize]) -> Vec<(u32, usize)> {
        let r = self.reader;
        for &w in workers {
            if let Some(h) = r.heads.get(w) {
                kvroute_index::prefetch(h);
            }
        }
        for &w in workers {
            if let Some(h) = r.heads.get(w)
                && let Some(slot) = r.slots.get(h.load(Ordering::Relaxed) as usize)
            {
                kvroute_index::prefetch(slot);
            }
        }
        let mut out = Vec::with_capacity(workers.len());
        out.extend(workers.iter().filter_map(|&w| {
            let w = u32::try_from(w).ok()?;
            let t = self.tokens(w);
            (t > 0).then_some((w, t))
        }));
        out
    }

    /// `(DP rank, matched tokens)` of each visible stream of `worker`, in no particular
    /// order (empty when it has none). O(its streams).
    pub fn by_rank(&self, worker: u32) -> Vec<(u32, usize)> {
        let bs = self.reader.block_size();
        let mut out = Vec::new();
        self.reader.for_each_visible(worker, |id, s| {
            out.push((s.rank, self.depths.blocks(id) as usize * bs));
        });
        out
    }

    /// Streams holding at least the first block, hidden ones included.
    pub fn streams(&self) -> usize {
        self.depths.holders()
    }

    /// Appends up to `k` `(worker, matched tokens)` of the deepest holders to `out`, one per
    /// worker (at its deepest stream): every worker deeper than the cut, then as many at the
    /// cut's depth as fill `k`, the first met going round them from a position drawn from
    /// `rng` (so successive decisions spread over a prefix many workers share; the rule of
    /// [`crate::policy::candidates::deepest`]). Cost O(runs + k²), not O(holders).
    pub fn deepest(&self, k: usize, rng: &mut impl rand::Rng, out: &mut Vec<(u32, usize)>) {
        let bs = self.reader.block_size();
        let from = out.len();
        let runs = self.depths.runs();
        let mut i = 0;
        while i < runs.len() && out.len() - from < k {
            let blocks = runs[i].0;
            let end = i + runs[i..].partition_point(|r| r.0 == blocks);
            let level = &runs[i..end];
            i = end;
            let total: usize = level.iter().map(|r| r.2.count_ones() as usize).sum();
            // All of this depth fit: in order. Else from a random one of them, wrapping: the
            // run `r` holding the `start`-th bit splits into its bits from there (`hi`) and
            // those before (`lo`).
            let (r, hi, lo) = if total <= k - (out.len() - from) {
                (0, level[0].2, 0)
            } else {
                let mut before = rng.random_range(0..total);
                let mut r = 0;
                while before >= level[r].2.count_ones() as usize {
                    before -= level[r].2.count_ones() as usize;
                    r += 1;
                }
                let mut hi = level[r].2;
                for _ in 0..before {
                    hi &= hi - 1;
                }
                (r, hi, level[r].2 & !hi)
            };
            let word = |j: usize| level[j].1;
            let order = std::iter::once((word(r), hi))
                .chain((r + 1..level.len()).map(|j| (word(j), level[j].2)))
                .chain((0..r).map(|j| (word(j), level[j].2)))
                .chain(std::iter::once((word(r), lo)));
            'level: for (w, mut set) in order {
                while set != 0 {
                    if out.len() - from >= k {
                        break 'level;
                    }
                    let id = w * 64 + set.trailing_zeros();
                    set &= set - 1;
                    if let Some(s) = self.reader.owner(id)
                        && !out[from..].iter().any(|&(w, _)| w == s.worker)
                    {
                        out.push((s.worker, blocks as usize * bs));
                    }
                }
            }
        }
    }
}

/// Settings of an [`EventIndex`].
#[derive(Debug, Clone, PartialEq)]
pub struct EventIndexSettings {
    /// Router block size, tokens (`--block-size`).
    pub block_size: usize,
    /// Most streams (Σ workers × DP ranks) indexed; later streams are counted, not indexed.
    pub max_streams: usize,
    /// Prune blocks untouched this long, ms (`--kv-indexer-ttl-secs`; `None` = never).
    pub ttl_ms: Option<u64>,
    /// Most (stream, block) entries, pruned to 90 % (`--kv-indexer-max-entries`; SMG).
    pub max_entries: Option<usize>,
}

/// The event index of one model: the writer side (apply events, counters) of a lock-free
/// positional index read through [`EventReader`]s.
///
/// # Invariants
/// 1. A stream's `tiers` and `recut` name only engine blocks its positional writer holds.
/// 2. `recut` is empty unless `ratio > 1`, and then holds every held engine block.
/// 3. No `tiers` entry is 0 or exactly {GPU}.
/// 4. The positional writers' own invariants hold.
/// 5. `copies` names only blocks held on GPU, each with a count > 0.
pub struct EventIndex {
    block_size: usize,
    reader: EventReader,
    writers: Vec<EventWriter>,
    streams: HashMap<StreamId, StreamState>,
    next_id: u32,
    now_ms: u64,
    prunes: bool,
}

impl std::fmt::Debug for EventIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventIndex")
            .field("block_size", &self.block_size)
            .field("streams", &self.streams.len())
            .field("entries", &self.reader.index.entries())
            .finish()
    }
}

impl EventIndex {
    /// Empty index for router blocks of `block_size` tokens (> 0), up to
    /// [`DEFAULT_STREAMS`] streams, no pruning.
    pub fn new(block_size: usize) -> Self {
        Self::with_settings(&EventIndexSettings {
            block_size,
            max_streams: DEFAULT_STREAMS,
            ttl_ms: None,
            max_entries: None,
        })
    }

    /// Empty index with `settings` (block size 0 is taken as 1).
    pub fn with_settings(settings: &EventIndexSettings) -> Self {
        let block_size = settings.block_size.max(1);
        let max_streams = settings.max_streams.max(1);
        let (index, writers) = positional::EventIndex::new(&EventIndexConfig {
            block_size,
            max_workers: max_streams,
            ttl_ms: settings.ttl_ms,
            max_entries: settings.max_entries,
        });
        Self {
            block_size,
            reader: EventReader {
                index,
                slots: (0..max_streams).map(|_| Slot::new()).collect(),
                heads: (0..max_streams).map(|_| AtomicU32::new(NO_ID)).collect(),
            },
            writers,
            streams: HashMap::new(),
            next_id: 0,
            now_ms: 0,
            prunes: settings.ttl_ms.is_some() || settings.max_entries.is_some(),
        }
    }

    /// A lock-free read handle (one per gateway shard or router).
    pub fn reader(&self) -> EventReader {
        self.reader.clone()
    }

    /// Memory of the positional index, bytes: every writer's share
    /// ([`EventWriter::memory_bytes`]: the shared table, slabs, record indexes) plus the
    /// dense-id maps of the read side (20 B per stream slot). The per-stream counters and the
    /// few tier and copy entries are not counted.
    pub fn memory_bytes(&self) -> usize {
        self.writers.iter().map(|w| w.memory_bytes()).sum::<usize>()
            + self.reader.slots.len() * std::mem::size_of::<Slot>()
            + self.reader.heads.len() * std::mem::size_of::<AtomicU32>()
    }

    /// Hides `stream` from [`EventReader::find_matches`] (or shows it again); its blocks stay
    /// indexed and counted. The consumer hides a stream while it waits for a replay: replayed
    /// batches are history applied in order, so until the replay ends the stream shows states
    /// its engine has left (a router that joins late replays from seq 0 through every block
    /// the engine stored and evicted since it started). A stream with no dense id is a no-op.
    pub fn set_hidden(&mut self, stream: StreamId, hidden: bool) {
        if let Some(id) = self.streams.get(&stream).and_then(|s| s.id) {
            self.reader.slots[id as usize]
                .hidden
                .store(hidden, Ordering::Release);
        }
    }

    /// Starts (`true`) or ends an orphan relearn of `stream` (B39: the engine's buffer is
    /// re-applied on top of the current state, [`super::sequence::Step::Reapply`]). While it
    /// runs, stores and removals of blocks the stream held when it began are history already
    /// applied: they change neither copies nor residency; blocks the relearn adds follow the
    /// usual rules. (With copies counted, re-applying a store of a held block would otherwise
    /// count one copy too many.) Ending it forgets which blocks it added.
    pub fn set_relearning(&mut self, stream: StreamId, on: bool) {
        let st = self.state(stream);
        match (on, st.relearned.is_some()) {
            (true, false) => st.relearned = Some(HashSet::new()),
            (false, true) => st.relearned = None,
            _ => {}
        }
    }

    /// GPU copies of engine block `h` that `stream` holds: 0 when it does not hold it on
    /// GPU, else 1 + the duplicate GPU stores not yet removed.
    pub fn copies(&self, stream: StreamId, h: EngineHash) -> u32 {
        let Some((st, Some(id))) = self.streams.get(&stream).map(|s| (s, s.id)) else {
            return 0;
        };
        let held = self.writers[id as usize / SHARD_WORKERS].holds(id, h)
            && st.tiers.get(&h).copied().unwrap_or(DEVICE) & DEVICE != 0;
        if held {
            1 + st.copies.get(&h).copied().unwrap_or(0)
        } else {
            0
        }
    }

    /// Router block size, tokens.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// True when no stream holds any block.
    pub fn is_empty(&self) -> bool {
        self.reader.is_empty()
    }

    /// Sets the time stamped on blocks stored or touched from now on, ms on the caller's
    /// clock (for [`Self::prune`]'s TTL and least-recently-touched order).
    pub fn set_now(&mut self, now_ms: u64) {
        self.now_ms = now_ms;
    }

    /// Counters of `stream` (created on first use).
    pub fn stats_mut(&mut self, stream: StreamId) -> &mut StreamStats {
        &mut self.state(stream).stats
    }

    /// State of `stream`, created (with a dense id while any is left) on first use.
    fn state(&mut self, stream: StreamId) -> &mut StreamState {
        state_of(&mut self.streams, &self.reader, &mut self.next_id, stream)
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

    /// Engine blocks `stream` holds in `tier` (any order).
    pub fn engine_hashes(&self, stream: StreamId, tier: Tier) -> Vec<EngineHash> {
        let Some((st, Some(id))) = self.streams.get(&stream).map(|s| (s, s.id)) else {
            return Vec::new();
        };
        let held = if st.ratio > 1 {
            st.recut.iter().copied().collect()
        } else {
            self.writers[id as usize / SHARD_WORKERS].engine_hashes(id)
        };
        held.into_iter()
            .filter(|h| st.tiers.get(h).copied().unwrap_or(DEVICE) & tier.bit() != 0)
            .collect()
    }

    /// Engine blocks (any tier) held by all ranks of `worker`.
    pub fn worker_blocks(&self, worker: u32) -> usize {
        self.streams
            .iter()
            .filter(|(s, _)| s.worker == worker)
            .map(|(_, st)| match st.id {
                Some(_) if st.ratio > 1 => st.recut.len(),
                Some(id) => self.writers[id as usize / SHARD_WORKERS].worker_blocks(id),
                None => 0,
            })
            .sum()
    }

    /// Router blocks (any tier) held by `stream`.
    pub fn stream_keys(&self, stream: StreamId) -> usize {
        match self.streams.get(&stream).and_then(|s| s.id) {
            Some(id) => self.writers[id as usize / SHARD_WORKERS].worker_blocks(id),
            None => 0,
        }
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

    /// Applies one `BlockStored`. Each block sees the index as the store reaches it, so a
    /// hash listed twice in one event is a second physical copy the second time (rule table:
    /// copies), as two events would be.
    pub fn stored(&mut self, stream: StreamId, ev: &BlockStored) {
        let rbs = self.block_size;
        let now = self.now_ms;
        let (tier, known) = Tier::from_medium(ev.medium.as_deref());
        let state = state_of(&mut self.streams, &self.reader, &mut self.next_id, stream);
        if !known {
            state.stats.unknown_media += 1;
        }
        let Some(id) = state.id else {
            state.stats.over_capacity += 1;
            return;
        };
        let writer = &mut self.writers[id as usize / SHARD_WORKERS];
        match state.group_role(ev.group_idx, ev.kv_cache_spec_kind.as_deref(), true) {
            GroupRole::Prefix => {}
            GroupRole::NotPrefix => {
                state.stats.non_prefix_stores += 1;
                return;
            }
            GroupRole::Ambiguous => {
                if state.stats.ambiguous_groups == 0 {
                    // What was indexed as the only kindless group may be any kind: start over.
                    tracing::warn!(
                        worker = stream.worker,
                        rank = stream.rank,
                        group = ev.group_idx,
                        "KV events name several cache groups without their kind: \
                         group-tagged events of this stream are no longer indexed"
                    );
                    clear_stream(writer, id, state);
                }
                state.stats.ambiguous_groups += 1;
                return;
            }
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
            for &h in &ev.block_hashes {
                if writer.holds(id, h) {
                    add_tier(&mut state.tiers, h, tier);
                } else {
                    state.stats.unknown_offloads += 1;
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
        let k = ebs / rbs;
        if state.ratio != k {
            if state.ratio != 0 && writer.worker_blocks(id) > 0 {
                // Blocks stored at the old size would be removed at the new one: start over.
                tracing::warn!(
                    worker = stream.worker,
                    rank = stream.rank,
                    engine_block = ebs,
                    "engine block size changed: stream cleared"
                );
                clear_stream(writer, id, state);
            }
            state.ratio = k;
        }
        if let Some(p) = ev.parent_block_hash
            && !writer.holds(id, p)
        {
            state.stats.orphans += 1;
            return;
        }
        // The engine hash is the last of its `k` handles (`sub_hash`), so handle `j` with
        // `j % k == k − 1` reports whether the stream held engine block `j / k` before.
        let handles: Vec<u64> = ev
            .block_hashes
            .iter()
            .flat_map(|&h| (0..k).map(move |j| sub_hash(h, j, k)))
            .collect();
        // The namespace roots a chain that starts here; a child inherits its parent's.
        let ns = match ev.parent_block_hash {
            None => super::event_namespace(ev.lora_name.as_deref(), ev.cache_salt.as_deref()),
            Some(_) => 0,
        };
        let seen = |j: usize, held: bool| {
            if j % k != k - 1 {
                return;
            }
            let h = ev.block_hashes[j / k];
            if held {
                // Already indexed (§8.3): the index holds one record, whose tier and touch
                // change; a second GPU copy is counted (rule table: copies).
                let on_gpu = state.tiers.get(&h).copied().unwrap_or(DEVICE) & DEVICE != 0;
                let history = state.relearned.as_ref().is_some_and(|r| !r.contains(&h));
                if tier == Tier::Device && on_gpu && !history {
                    *state.copies.entry(h).or_insert(0) += 1;
                }
                add_tier(&mut state.tiers, h, tier);
            } else {
                if tier != Tier::Device {
                    state.tiers.insert(h, tier.bit());
                }
                if let Some(r) = state.relearned.as_mut() {
                    r.insert(h);
                }
            }
            if k > 1 {
                state.recut.insert(h);
            }
        };
        if let Err(e) = writer.apply_stored_reporting(
            id,
            ns,
            ev.parent_block_hash,
            &handles,
            &ev.token_ids,
            now,
            seen,
        ) {
            // Unreachable after the checks above; counted rather than trusted.
            tracing::warn!(worker = stream.worker, rank = stream.rank, "store: {e}");
            state.stats.orphans += 1;
        }
    }

    /// Applies one `BlockRemoved`: drops its tier from each block; a block left in no tier
    /// leaves the index. A hash listed twice is removed twice, as in two events (the second
    /// finds the block gone).
    pub fn removed(&mut self, stream: StreamId, ev: &BlockRemoved) {
        let (tier, _) = Tier::from_medium(ev.medium.as_deref());
        let state = state_of(&mut self.streams, &self.reader, &mut self.next_id, stream);
        let Some(id) = state.id else {
            state.stats.over_capacity += 1;
            return;
        };
        match state.group_role(ev.group_idx, ev.kv_cache_spec_kind.as_deref(), false) {
            GroupRole::Prefix => {}
            GroupRole::NotPrefix => {
                state.stats.non_prefix_removals += 1;
                return;
            }
            GroupRole::Ambiguous => {
                state.stats.ambiguous_groups += 1;
                return;
            }
        }
        let writer = &mut self.writers[id as usize / SHARD_WORKERS];
        let k = state.ratio.max(1);
        // Each engine block's `k` handles, deepest first so it never leaves a transient
        // hole; the first is the engine hash itself (`sub_hash`), whose probe decides all k.
        let handles: Cow<'_, [u64]> = if k == 1 {
            Cow::Borrowed(&ev.block_hashes)
        } else {
            ev.block_hashes
                .iter()
                .flat_map(|&h| (0..k).rev().map(move |j| sub_hash(h, j, k)))
                .collect()
        };
        let mut leaves = false;
        writer
            .apply_removed_if(id, &handles, |j, held| {
                if j % k == 0 {
                    leaves = leaves_index(state, tier, ev.block_hashes[j / k], held);
                }
                leaves
            })
            .expect("stream id is in its writer's shard");
    }

    /// Drops every block of `stream` (`AllBlocksCleared`, restart, unrecoverable gap). Its
    /// counters stay.
    pub fn clear(&mut self, stream: StreamId) {
        let Some(state) = self.streams.get_mut(&stream) else {
            return;
        };
        if let Some(id) = state.id {
            clear_stream(&mut self.writers[id as usize / SHARD_WORKERS], id, state);
        }
    }

    /// Forgets every stream of `worker`: its blocks and counters (worker removed, B35). Its
    /// dense ids stay reserved for it, so it may come back.
    pub fn remove_worker(&mut self, worker: u32) {
        for st in self.streams.iter_mut().filter(|(s, _)| s.worker == worker) {
            let st = st.1;
            if let Some(id) = st.id {
                clear_stream(&mut self.writers[id as usize / SHARD_WORKERS], id, st);
            }
            st.stats = StreamStats::default();
            st.groups = HashMap::new();
            st.kindless_group = None;
            st.ambiguous = false;
        }
    }

    /// True when a TTL or an entry cap is set, so [`Self::prune`] has work to do.
    pub fn prunes(&self) -> bool {
        self.prunes
    }

    /// Applies the TTL and entry cap at `now_ms` (see [`EventIndexSettings`]); returns the
    /// router blocks dropped. Cost O(entries); meant to run every
    /// [`crate::config::defaults::KV_INDEXER_PRUNE_EVERY_MS`], not per event.
    pub fn prune(&mut self, now_ms: u64) -> usize {
        let dropped = self.writers.iter_mut().map(|w| w.prune(now_ms)).sum();
        if dropped > 0 {
            for st in self.streams.values_mut() {
                let Some(id) = st.id else { continue };
                let w = &self.writers[id as usize / SHARD_WORKERS];
                st.tiers.retain(|h, _| w.holds(id, *h));
                st.recut.retain(|h| w.holds(id, *h));
                st.copies.retain(|h, _| w.holds(id, *h));
            }
        }
        dropped
    }

    /// Streams holding a prefix of `keys`: [`EventReader::find_matches`].
    pub fn find_matches(&self, keys: &[u64]) -> Vec<Match> {
        self.reader.find_matches(keys)
    }

    /// Checks the invariants; the error names the broken one.
    ///
    /// # Errors
    /// `(number, stream)` of the first broken invariant.
    pub fn check_invariants(&self) -> Result<(), (u8, Option<StreamId>)> {
        for (s, st) in &self.streams {
            let Some(id) = st.id else {
                if !st.tiers.is_empty() || !st.recut.is_empty() {
                    return Err((1, Some(*s)));
                }
                if !st.copies.is_empty() {
                    return Err((5, Some(*s)));
                }
                continue;
            };
            let w = &self.writers[id as usize / SHARD_WORKERS];
            if st
                .tiers
                .keys()
                .chain(st.recut.iter())
                .any(|h| !w.holds(id, *h))
            {
                return Err((1, Some(*s)));
            }
            if st.ratio > 1 {
                let k = st.ratio;
                if w.worker_blocks(id) != st.recut.len() * k
                    || st
                        .recut
                        .iter()
                        .any(|&h| (0..k).any(|j| !w.holds(id, sub_hash(h, j, k))))
                {
                    return Err((2, Some(*s)));
                }
            } else if !st.recut.is_empty() {
                return Err((2, Some(*s)));
            }
            if st.tiers.values().any(|&m| m == 0 || m == DEVICE) {
                return Err((3, Some(*s)));
            }
            if st.copies.iter().any(|(h, &c)| {
                c == 0
                    || !w.holds(id, *h)
                    || st.tiers.get(h).copied().unwrap_or(DEVICE) & DEVICE == 0
            }) {
                return Err((5, Some(*s)));
            }
        }
        for w in &self.writers {
            if w.check_invariants().is_err() {
                return Err((4, None));
            }
        }
        Ok(())
    }
}

/// State of `stream` in `streams`, created on first use with the next dense id (its owner
/// published in `slots` before any of its blocks) while ids are left, else with none.
fn state_of<'a>(
    streams: &'a mut HashMap<StreamId, StreamState>,
    reader: &EventReader,
    next: &mut u32,
    stream: StreamId,
) -> &'a mut StreamState {
    let slots = &reader.slots;
    streams.entry(stream).or_insert_with(|| {
        let id = ((*next as usize) < slots.len()).then(|| {
            let id = *next;
            *next += 1;
            slots[id as usize].owner.store(
                u64::from(stream.worker) << 32 | u64::from(stream.rank),
                Ordering::Release,
            );
            // Linked after its owner is published, so a reader following the chain finds it.
            if let Some(head) = reader.heads.get(stream.worker as usize) {
                slots[id as usize]
                    .prev
                    .store(head.load(Ordering::Relaxed), Ordering::Relaxed);
                head.store(id, Ordering::Release);
            }
            id
        });
        if id.is_none() {
            tracing::warn!(
                worker = stream.worker,
                rank = stream.rank,
                capacity = slots.len(),
                "KV event stream beyond the index's capacity: not indexed"
            );
        }
        StreamState {
            id,
            ..StreamState::default()
        }
    })
}

/// Adds `tier` to the held block `h`'s tier set.
fn add_tier(tiers: &mut HashMap<EngineHash, u8>, h: EngineHash, tier: Tier) {
    let mask = tiers.get(&h).copied().unwrap_or(DEVICE) | tier.bit();
    if mask != DEVICE {
        tiers.insert(h, mask);
    }
}

/// A `BlockRemoved` of engine block `h` in `tier` on a stream that holds it (`held`, from
/// the index) or not: updates the stream's tiers and copies and counts (rule table:
/// unknown removals, relearned history, copies, tiers), and returns whether the block now
/// leaves the index.
fn leaves_index(state: &mut StreamState, tier: Tier, h: EngineHash, held: bool) -> bool {
    if !held {
        state.stats.unknown_removals += 1;
        return false;
    }
    if state.relearned.as_ref().is_some_and(|r| !r.contains(&h)) {
        // Re-applied history of a block held before the relearn: already applied.
        return false;
    }
    if tier == Tier::Device
        && let Some(c) = state.copies.get_mut(&h)
    {
        *c -= 1;
        if *c == 0 {
            state.copies.remove(&h);
        }
        state.stats.copies_kept += 1;
        return false;
    }
    match state.tiers.get(&h).copied().unwrap_or(DEVICE) & !tier.bit() {
        0 => {
            state.tiers.remove(&h);
            state.recut.remove(&h);
            if let Some(r) = state.relearned.as_mut() {
                r.remove(&h);
            }
            true
        }
        DEVICE => {
            state.tiers.remove(&h);
            false
        }
        m => {
            state.tiers.insert(h, m);
            false
        }
    }
}

/// Drops every block of the stream with dense id `id`.
fn clear_stream(writer: &mut EventWriter, id: u32, state: &mut StreamState) {
    writer
        .apply_cleared(id)
        .expect("stream id is in its writer's shard");
    state.tiers = HashMap::new();
    state.recut = HashSet::new();
    state.copies = HashMap::new();
    if let Some(r) = state.relearned.as_mut() {
        r.clear();
    }
}
