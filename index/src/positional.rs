//! Exact positional index fed by engine KV events: which worker holds how many consecutive
//! leading blocks of a request.
//!
//! One lock-free table maps `block key → worker bitset` (bit `w % 64` of word `w / 64`;
//! ⌈max_workers / 64⌉ words per key; readers never wait, see `table`). Workers are
//! split into shards of [`SHARD_WORKERS`] (64) dense ids, each with exactly one
//! [`EventWriter`] that applies that shard's events in order and owns one word of every
//! bitset. The writers share the table's single-writer side through a writer-only mutex,
//! taken once per event (not per block), with one epoch pin per event; readers never see it.
//! [`EventIndex`] is the cheap, cloneable read handle used by every gateway shard.
//!
//! Why one table of wide bitsets rather than one table per 64-worker shard (the previous
//! design): a query probes each block position once for every worker, instead of once per
//! shard: at 8k tokens × 256 workers (`kvroute bench index` fixture) ~25 probes instead of
//! ~100, each reading a 40-byte slot (one cache line) instead of four 16-byte slots.
//!
//! Block keys are kvroute's own chained hashes ([`crate::keys`]) computed from the event's
//! token ids, so the engine's hash algorithm never matters; engine hashes are kept per
//! worker only as opaque handles for parent links and removals (`kv-events.md` §7).
//!
//! # Writer layout
//! Per worker, a writer keeps a **slab** of 16-byte records and a **u32 index** over it:
//!
//! | structure | bytes per (worker, block) | content |
//! |---|---|---|
//! | slab `Vec<Rec>` | 16 / slab load (free list keeps it dense; grows by 1/16) | engine hash (2 × u32), table slot (u32), parent's slab index (24 bits) + child count (8 bits) |
//! | stamps `Vec<u32>` | 4 / slab load, only with `ttl_ms` or `max_entries` | last touch, s |
//! | index `Vec<u32>` | 4 / index load (0.65 … 0.8) | Robin Hood open addressing, any length, deletion by backward shift (no tombstones): slab index + 1 in the low ≥ 24 bits, then the distance from home and an engine-hash tag (a probe reads the slab only on a home and tag match) |
//! | table share | 8·(1 + words) / table load (0.65 … 0.9 for 1 word), over the key's holders; from 5 words (> 256 workers) 16 / load plus a heap row of 8·(masks + non-zero words) bytes for keys that outgrew 3 holders (an in-place clear may leave a heap row with ≤ 3 until one of its words empties) | the shared table's slot of the block's key (tombstones reused, see `table`) |
//!
//! A record refers to its key by **table slot**, not by the 8-byte key: live keys never move
//! except in a table rebuild, whose old → new slot map each shard writer applies to its
//! records the next time it takes the mutex (maps are kept until every shard has). A parent
//! key for chaining is read back from the parent's slot. Rare overflows stay exact in small
//! per-worker maps: child counts ≥ 255 (the Mooncake ingest fixture peaks at 146 children of
//! one block) and parents at slab index ≥ 2^24 − 2.
//!
//! **Ghosts** replace the old `dangling` map: a removed block whose children are still held
//! stays in the slab as a ghost (no table bit, not an entry, not [`EventWriter::holds`]) until
//! its last held child goes; re-storing the same engine hash revives it with its children.
//! A worker is *holey* iff it holds a block whose parent is a ghost (`orphans` > 0: exact).
//!
//! Measured (`kvroute bench index`, medians of 3 runs, old and new binaries alternating on
//! the shared 2-core dev VM; timings move ±20 % with the other tenants' load):
//!
//! | metric | hashbrown maps + `dangling` + key per record (before) | slab + index + slot refs (now) |
//! |---|---|---|
//! | bytes per (worker, block), Mooncake ingest (8 workers) | 137.3 | 46.7 |
//! | bytes per (worker, block), grid 8k tok × 256 workers | 73.2 | 37.6 |
//! | ingest, block events/s (one writer, one core) | 6.9 M | 9.4 M |
//! | match 8k tok × 256 workers, p50 / p99 | 1.59 / 4.64 µs | 1.58 / 4.93 µs |
//!
//! Where the ingest bytes went before: each hashbrown map sat at load 0.5 (82 B per block:
//! 40-byte entry + control byte) and the table at load 0.5 (31.7 B: churn tombstones forced
//! rebuilds to 2 slots per live key). Now: 16.4 B slab + 5.5 B index + 24.3 B table.
//!
//! # Matching
//! A worker whose held blocks are *prefix-closed* (every held block's parent is held — true
//! unless a removal punched a hole) holds block `i` of a chain only if it holds every block
//! before it, so "holds block i" is monotone in `i` and its overlap is found by bisection.
//! [`EventIndex::find_matches`] probes block 0 (who holds anything), then the last block
//! (whoever holds it holds the whole request: one probe for a fully cached prompt), then
//! bisects `[0, last)` once for the whole remaining set, splitting it at every probe into the
//! workers that hold the midpoint and those that do not: O(d · log(len / d) + d) probes for
//! d distinct overlaps, each probe answering for every worker (one row of the table). Each
//! bisection step prefetches both possible next midpoints. A worker with holes (counted
//! exactly by the writer) is scanned block by block instead, so a hole always truncates its
//! match. A query allocates only its answer (scratch is per thread).
//!
//! A conversation's next turn asks for the same prefix and a few blocks more, so the index
//! remembers answers ([`MEMO_SLOTS`] of them, cut at a multiple of [`MEMO_STRIDE`] blocks,
//! shared by every reader thread, each slot only ever try-locked). A query that finds one
//! checks each remembered depth `d` with two probes (blocks `d − 1` and `d`) before any
//! bisection, and bisects only the workers whose depth moved, on the side they moved to:
//! ~6 probes instead of ~22 for a turn of a 32k-token conversation whose holders sit at two
//! depths (`perf/runs/2026-12-07-remembered-depths/`). A remembered depth is a guess that is
//! verified, so the answer never depends on it.
//!
//! Measured in `kvroute bench index` (same run, alternating builds; 2-core VM): against
//! Dynamo's jump search (skip 32 blocks, bisect the last skip; batched and prefetched) the
//! bisection is at par at 1k tokens and faster from 8k: 8k tokens × 256 workers p50
//! 1.46–1.51 µs vs 1.74–1.77 µs, p99 2.08–2.12 µs vs 2.35–2.49 µs; 32k × 1024 p50 4.0–4.9 µs
//! vs 7.2–7.4 µs.

use crate::keys::chain;
use crate::table::{NO_SLOT, SharedTable, TableRef, TableWriter};
use crate::{IndexError, Namespace, TenantId};
use crossbeam_epoch::{self as epoch, Guard};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Workers per shard: one 64-bit worker set per block key.
pub const SHARD_WORKERS: usize = 64;

/// Settings of an [`EventIndex`] (one per model).
#[derive(Clone, Debug, PartialEq)]
pub struct EventIndexConfig {
    /// Tokens per block of the events' `token_ids` (engine block size), tokens.
    pub block_size: usize,
    /// Largest worker id + 1 the index must hold; shards = ⌈max_workers / 64⌉.
    pub max_workers: usize,
    /// Entries untouched for this long are pruned by [`EventWriter::prune`], ms
    /// (`--kv-indexer-ttl-secs`; `None` = never). With this or `max_entries` set, every
    /// record keeps a 4-byte touch stamp (seconds).
    pub ttl_ms: Option<u64>,
    /// Most (worker, block) entries per model; [`EventWriter::prune`] cuts the
    /// least-recently-touched down to 90 % of it (`--kv-indexer-max-entries`, split evenly
    /// over shards; `None` = unbounded). Source: SMG, anchors §2.3.
    pub max_entries: Option<usize>,
}

/// Overlap of each worker with a request: `(worker, consecutive leading blocks held)`,
/// sorted by worker, only workers holding at least the first block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overlap(pub Vec<(TenantId, u32)>);

impl Overlap {
    /// Blocks `worker` holds (0 when absent).
    pub fn blocks(&self, worker: TenantId) -> u32 {
        self.0
            .binary_search_by_key(&worker, |&(w, _)| w)
            .map_or(0, |i| self.0[i].1)
    }

    /// The largest overlap, blocks (0 when empty).
    pub fn max_blocks(&self) -> u32 {
        self.0.iter().map(|&(_, b)| b).max().unwrap_or(0)
    }
}

pub(crate) use crate::mix::MixMap;

/// State shared by the read handle and every writer.
struct Shared {
    table: Arc<SharedTable>,
    /// Bit `w % 64` of word `w / 64` set when worker `w` holds a block whose parent it does
    /// not hold (written only by the shard `w / 64`'s writer).
    holey: Box<[AtomicU64]>,
    /// (worker, block) entries of each shard (gauge, one per writer).
    entries: Box<[AtomicUsize]>,
    /// Remembered answers of the readers' queries ([`EventIndex::find_depths`]).
    memo: Memo,
}

/// Read handle: cheap to clone, `Send + Sync`, lookups are lock-free.
#[derive(Clone)]
pub struct EventIndex {
    shared: Arc<Shared>,
    /// The table, also in `shared`: one pointer hop less per query (cold-cache latency).
    table: Arc<SharedTable>,
    block_size: usize,
}

/// One record of a worker's slab: a held block, a ghost, or a free slab entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
struct Rec {
    /// Engine hash, low and high halves (align 4 keeps the record at 16 bytes). Free: next
    /// free record ([`NONE`] ends the list) in `engine[0]`.
    engine: [u32; 2],
    /// Held: the table slot of the block's key. [`GHOST`] or [`FREE`] otherwise.
    slot: u32,
    /// Bits 0–23: held: slab index of the parent record ([`P_NONE`] at sequence start,
    /// [`P_FAR`]: index ≥ 2^24 − 2, in the worker's `far` map); ghost or free: [`P_NONE`].
    /// Bits 24–31: held children, 255 = see the worker's `overflow` map.
    link: u32,
}

const _: () = assert!(std::mem::size_of::<Rec>() == 16);

/// `Rec::slot` of a ghost.
const GHOST: u32 = u32::MAX - 1;
/// `Rec::slot` of a free record.
const FREE: u32 = u32::MAX;
/// No record (parent of a root block, end of the free list).
const NONE: u32 = u32::MAX;
const P_MASK: u32 = (1 << 24) - 1;
/// Parent field: no parent.
const P_NONE: u32 = P_MASK;
/// Parent field: the parent's index does not fit 24 bits; see `WorkerState::far`.
const P_FAR: u32 = P_MASK - 1;
const CHILD_SHIFT: u32 = 24;
const CHILD_SPILL: u32 = 255;
/// Parents at this slab index or above go to the `far` map.
#[cfg(not(test))]
#[inline(always)]
fn far_from() -> u32 {
    P_FAR
}

#[cfg(test)]
thread_local! {
    /// Tests lower it so the brute-force proptest exercises the far path.
    static FAR_FROM: std::cell::Cell<u32> = const { std::cell::Cell::new(P_FAR) };
}

#[cfg(test)]
fn far_from() -> u32 {
    FAR_FROM.with(|f| f.get())
}

impl Rec {
    #[inline]
    fn engine(&self) -> u64 {
        self.engine[0] as u64 | (self.engine[1] as u64) << 32
    }
    #[inline]
    fn held(&self) -> bool {
        self.slot < GHOST
    }
}

/// Index entry of an empty position.
const IX_EMPTY: u32 = 0;

/// Engine hash → index hash (splitmix64 finaliser: engine hashes may be structured).
#[inline]
fn mix(eh: u64) -> u64 {
    let mut x = eh ^ (eh >> 30);
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[inline]
fn home(h: u64, len: usize) -> usize {
    ((u128::from(h) * len as u128) >> 64) as usize
}

/// Result of a worker index lookup.
enum Find {
    /// Found at index position `pos`, slab record `idx`.
    Hit { pos: usize, idx: u32 },
    /// Absent; an insert goes to position `ins` (the empty position ending the probe), at
    /// distance `disp` from the home.
    Miss { ins: usize, disp: usize },
}

/// Layout of a worker's index entries (u32): `idx + 1` in the low `bits`, then the
/// distance from the entry's home position (saturated at `dmax`: Robin Hood probing and
/// backward-shift deletion read it instead of the slab), then a tag of the engine hash in
/// the rest (a probe reads the slab only for an entry with our home and our tag).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    bits: u32,
    disp_bits: u32,
    tag_bits: u32,
}

impl Layout {
    /// Layout for a slab of `cap` records: `bits` ≥ 24 holds `cap` (24 bits: 16 M records
    /// per worker; more shrinks the distance and tag fields, never below 1 distance bit).
    fn for_capacity(cap: usize) -> Self {
        let mut bits = 24;
        while bits < 31 && cap + 1 > (1usize << bits) {
            bits += 1;
        }
        assert!(cap < 1usize << bits, "worker slab over 2^31 records");
        let disp_bits = (32 - bits).min(4);
        Self {
            bits,
            disp_bits,
            tag_bits: 32 - bits - disp_bits,
        }
    }
    #[inline]
    fn dmax(self) -> u32 {
        (1 << self.disp_bits) - 1
    }
    #[inline]
    fn tag(self, h: u64) -> u32 {
        if self.tag_bits == 0 {
            0
        } else {
            (h as u32) >> (32 - self.tag_bits)
        }
    }
    #[inline]
    fn entry(self, idx: u32, disp: usize, tag: u32) -> u32 {
        let d = (disp as u32).min(self.dmax());
        let e = (d << self.bits) | (idx + 1);
        if self.tag_bits == 0 {
            e
        } else {
            e | (tag << (self.bits + self.disp_bits))
        }
    }
    #[inline]
    fn idx(self, e: u32) -> u32 {
        (e & ((1u32 << self.bits) - 1)) - 1
    }
    #[inline]
    fn disp(self, e: u32) -> u32 {
        (e >> self.bits) & self.dmax()
    }
    #[inline]
    fn etag(self, e: u32) -> u32 {
        if self.tag_bits == 0 {
            0
        } else {
            e >> (self.bits + self.disp_bits)
        }
    }
    /// `e` with its distance field set to `disp`.
    #[inline]
    fn with_disp(self, e: u32, disp: usize) -> u32 {
        let m = self.dmax() << self.bits;
        (e & !m) | ((disp as u32).min(self.dmax()) << self.bits)
    }
}

/// Home distance of `index[j]` (laid out as `l`, `index.len()` positions) from its distance
/// field, or from its record in `slab` when the field is saturated.
#[inline]
fn disp_in(index: &[u32], l: Layout, slab: &[Rec], j: usize) -> usize {
    let e = index[j];
    let d = l.disp(e);
    if d < l.dmax() {
        return d as usize;
    }
    let n = index.len();
    let h = home(mix(slab[l.idx(e) as usize].engine()), n);
    (j + n - h) % n
}

/// Robin Hood insertion: entry `cur`, `cd` positions from its home, takes position `i` or a
/// later one, pushing each poorer resident one step on until an empty position ends the run.
#[inline]
fn place(index: &mut [u32], l: Layout, slab: &[Rec], mut i: usize, mut cur: u32, mut cd: usize) {
    let n = index.len();
    loop {
        let e = index[i];
        if e == IX_EMPTY {
            index[i] = cur;
            return;
        }
        let ed = disp_in(index, l, slab, i);
        if ed < cd {
            index[i] = cur;
            cur = e;
            cd = ed;
        }
        i += 1;
        if i == n {
            i = 0;
        }
        cd += 1;
        cur = l.with_disp(cur, cd);
    }
}

/// One worker's records.
struct WorkerState {
    slab: Vec<Rec>,
    /// Head of the free list through `Rec::parent`.
    free: u32,
    /// Open-addressing index over `slab` (Robin Hood linear probing, deletion by backward
    /// shift: no tombstones), entries as [`Layout`] says.
    index: Vec<u32>,
    layout: Layout,
    /// Held records.
    held: usize,
    /// Ghost records.
    ghosts: usize,
    /// Held records whose parent is a ghost.
    orphans: u64,
    /// Children of records whose 8-bit count says [`CHILD_SPILL`].
    overflow: MixMap<u32, u32>,
    /// Parents (slab index) of held records whose parent field says [`P_FAR`].
    far: MixMap<u32, u32>,
    /// Last touch of each record, seconds (parallel to `slab`; empty unless the index
    /// prunes: `ttl_ms` or `max_entries` set).
    stamps: Vec<u32>,
    /// Whether `stamps` is kept.
    stamped: bool,
    /// Table keys (as stored) this worker holds through more than one record → the extra
    /// records: engine blocks the router's keys cannot tell apart (equal tokens under equal
    /// parents, e.g. multimodal blocks with equal placeholder tokens and different images).
    /// A removal clears the worker's bit only when no record of the key is left. Empty in
    /// the common case; while not empty, [`Self::store`] takes the full probe.
    dups: MixMap<u64, u32>,
}

impl WorkerState {
    fn new(stamped: bool) -> Self {
        Self {
            slab: Vec::new(),
            free: NONE,
            index: vec![IX_EMPTY; 16],
            layout: Layout::for_capacity(0),
            held: 0,
            ghosts: 0,
            orphans: 0,
            overflow: MixMap::default(),
            far: MixMap::default(),
            stamps: Vec::new(),
            stamped,
            dups: MixMap::default(),
        }
    }
}

/// Index load cap (entries / positions) before it grows, as a fraction: 4/5.
const INDEX_CAP: (usize, usize) = (4, 5);
/// Index load after a rebuild: 1/2 (growth steps ×1.6). Measured against 13/20 (×1.23) in
/// `kvroute bench index`: ingest 9.3–9.7 vs 7.9–8.8 M block-events/s for 47.1 vs 46.7 bytes
/// per (worker, block).
const INDEX_TARGET: (usize, usize) = (1, 2);

impl WorkerState {
    /// Robin Hood lookup: stops at an empty position or at an entry closer to its home than
    /// we are to ours (`eh` would have displaced it).
    #[inline]
    fn find(&self, eh: u64) -> Find {
        let h = mix(eh);
        let n = self.index.len();
        let l = self.layout;
        let tag = l.tag(h);
        let mut i = home(h, n);
        let mut d = 0usize;
        loop {
            let e = self.index[i];
            if e == IX_EMPTY {
                return Find::Miss { ins: i, disp: d };
            }
            let field = l.disp(e);
            let ed = if field < l.dmax() {
                field as usize
            } else if d < l.dmax() as usize {
                // Saturated: at least dmax > d, so neither ours nor a stop.
                usize::MAX
            } else {
                self.disp_at(i)
            };
            if ed < d {
                return Find::Miss { ins: i, disp: d };
            }
            if ed == d && l.etag(e) == tag {
                let idx = l.idx(e);
                if self.slab[idx as usize].engine() == eh {
                    return Find::Hit { pos: i, idx };
                }
            }
            i += 1;
            if i == n {
                i = 0;
            }
            d += 1;
        }
    }

    /// Slab index of held block `eh`.
    #[inline]
    fn held_idx(&self, eh: u64) -> Option<u32> {
        self.find_held(eh).map(|(_, idx)| idx)
    }

    /// Index position and slab index of held block `eh`.
    #[inline]
    fn find_held(&self, eh: u64) -> Option<(usize, u32)> {
        match self.find(eh) {
            Find::Hit { pos, idx } if self.slab[idx as usize].held() => Some((pos, idx)),
            _ => None,
        }
    }

    /// Prefetch hint for `eh`'s home position of the index.
    #[inline]
    fn prefetch(&self, eh: u64) {
        let i = home(mix(eh), self.index.len());
        crate::table::prefetch_ptr(self.index[i..].as_ptr().cast());
    }

    /// Prefetch hint for the table row of held block `eh`, whose index position and record
    /// should be cached already (an earlier [`Self::prefetch`]): a lookup, then a hint.
    #[inline]
    fn prefetch_row(&self, table: &TableWriter, g: &Guard, eh: u64) {
        if let Find::Hit { idx, .. } = self.find(eh) {
            let r = &self.slab[idx as usize];
            if r.held() {
                table.prefetch_slot(r.slot, g);
            }
        }
    }

    /// Makes sure one record can be added without growing anything inside a store: a free
    /// record or slab capacity (grown by 1/16), an index layout for the slab, and the index
    /// under its load cap.
    #[inline]
    fn ensure_room(&mut self) {
        if self.free == NONE && self.slab.len() == self.slab.capacity() {
            let cap = self.slab.capacity();
            self.slab.reserve_exact((cap / 16).max(16));
            if self.stamped {
                self.stamps
                    .reserve_exact(self.slab.capacity() - self.stamps.len());
            }
            if Layout::for_capacity(self.slab.capacity()) != self.layout {
                self.rebuild_index();
                return;
            }
        }
        if (self.held + self.ghosts + 1) * INDEX_CAP.1 > self.index.len() * INDEX_CAP.0 {
            self.rebuild_index();
        }
    }

    /// Rebuilds the index at load 3/4 from the slab.
    fn rebuild_index(&mut self) {
        let live = self.held + self.ghosts;
        let n = ((live + 1) * INDEX_TARGET.1 / INDEX_TARGET.0).max(16);
        let l = Layout::for_capacity(self.slab.capacity());
        self.layout = l;
        let mut index = vec![IX_EMPTY; n];
        for (idx, r) in self.slab.iter().enumerate() {
            if r.slot == FREE {
                continue;
            }
            let h = mix(r.engine());
            let e = l.entry(idx as u32, 0, l.tag(h));
            place(&mut index, l, &self.slab, home(h, n), e, 0);
        }
        self.index = index;
    }

    /// Home distance of the entry at position `j` (from its distance field, or from the
    /// slab when the field is saturated).
    #[inline]
    fn disp_at(&self, j: usize) -> usize {
        disp_in(&self.index, self.layout, &self.slab, j)
    }

    /// Deletes index position `pos`, shifting the displaced entries after it back one step
    /// (Robin Hood backward shift): no tombstones, so churn never fills the index.
    fn index_delete(&mut self, pos: usize) {
        let n = self.index.len();
        let mut hole = pos;
        loop {
            let j = if hole + 1 == n { 0 } else { hole + 1 };
            let e = self.index[j];
            if e == IX_EMPTY {
                break;
            }
            let d = self.disp_at(j);
            if d == 0 {
                break;
            }
            self.index[hole] = self.layout.with_disp(e, d - 1);
            hole = j;
        }
        self.index[hole] = IX_EMPTY;
    }

    /// Adds a held record for `eh` (table slot `slot`, parent `parent` or [`NONE`], touched
    /// at `now`) to the slab (room ensured) and the index at `ins`, `disp` from its home.
    #[inline]
    fn insert(
        &mut self,
        ins: usize,
        disp: usize,
        eh: u64,
        slot: u32,
        parent: u32,
        now: u32,
    ) -> u32 {
        let rec = Rec {
            engine: [eh as u32, (eh >> 32) as u32],
            slot,
            link: P_NONE,
        };
        let idx = if self.free != NONE {
            let i = self.free;
            self.free = self.slab[i as usize].engine[0];
            self.slab[i as usize] = rec;
            if self.stamped {
                self.stamps[i as usize] = now;
            }
            i
        } else {
            self.slab.push(rec);
            if self.stamped {
                self.stamps.push(now);
            }
            (self.slab.len() - 1) as u32
        };
        self.set_parent(idx, parent);
        let l = self.layout;
        let e = l.entry(idx, disp, l.tag(mix(eh)));
        place(&mut self.index, l, &self.slab, ins, e, disp);
        idx
    }

    /// Drops record `idx` (no children, no parent link) at index position `pos` onto the
    /// free list.
    #[inline]
    fn release(&mut self, pos: usize, idx: u32) {
        self.index_delete(pos);
        self.slab[idx as usize] = Rec {
            engine: [self.free, 0],
            slot: FREE,
            link: P_NONE,
        };
        self.free = idx;
    }

    /// Parent record of `idx`, or [`NONE`].
    #[inline]
    fn parent(&self, idx: u32) -> u32 {
        match self.slab[idx as usize].link & P_MASK {
            P_NONE => NONE,
            P_FAR => self.far[&idx],
            p => p,
        }
    }

    /// Sets the parent of `idx` ([`NONE`] clears it).
    #[inline]
    fn set_parent(&mut self, idx: u32, parent: u32) {
        let r = &mut self.slab[idx as usize];
        if r.link & P_MASK == P_FAR {
            self.far.remove(&idx);
        }
        let field = if parent == NONE {
            P_NONE
        } else if parent < far_from() {
            parent
        } else {
            self.far.insert(idx, parent);
            P_FAR
        };
        let r = &mut self.slab[idx as usize];
        r.link = (r.link & !P_MASK) | field;
    }

    #[inline]
    fn children(&self, idx: u32) -> u32 {
        let c = self.slab[idx as usize].link >> CHILD_SHIFT;
        if c == CHILD_SPILL {
            self.overflow[&idx]
        } else {
            c
        }
    }

    #[inline]
    fn add_child(&mut self, idx: u32) {
        let r = &mut self.slab[idx as usize];
        match r.link >> CHILD_SHIFT {
            c if c < CHILD_SPILL - 1 => r.link += 1 << CHILD_SHIFT,
            c if c == CHILD_SPILL - 1 => {
                r.link |= CHILD_SPILL << CHILD_SHIFT;
                self.overflow.insert(idx, CHILD_SPILL);
            }
            _ => *self.overflow.get_mut(&idx).expect("spilled count") += 1,
        }
    }

    /// One held child of `idx` went; returns the children left.
    #[inline]
    fn drop_child(&mut self, idx: u32) -> u32 {
        let r = &mut self.slab[idx as usize];
        let c = r.link >> CHILD_SHIFT;
        if c < CHILD_SPILL {
            r.link -= 1 << CHILD_SHIFT;
            return c - 1;
        }
        let v = self.overflow.get_mut(&idx).expect("spilled count");
        *v -= 1;
        let left = *v;
        if left < CHILD_SPILL {
            self.overflow.remove(&idx);
            r.link = (r.link & P_MASK) | (left << CHILD_SHIFT);
        }
        left
    }

    /// Stores block `eh` (key `key`, parent record `parent` or [`NONE`]) at `now`; returns its
    /// record. Room in the table was ensured by the caller.
    ///
    /// `unholey`: no worker of the index holds a block whose parent it does not hold. Then a
    /// new block whose parent has no held child yet, and whose parent's row names only this
    /// worker, has a key nobody holds: another worker holding it would hold the parent's key
    /// too (keys chain over the whole prefix), and this worker could hold it only through a
    /// second record of the parent's key, which `dups` would list. Such a block is
    /// inserted without probing the table to the end of its run
    /// ([`TableWriter::insert_absent`]): the tail of every new sequence.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn store(
        &mut self,
        table: &mut TableWriter,
        g: &Guard,
        gbit: usize,
        eh: u64,
        key: u64,
        parent: u32,
        now: u32,
        unholey: bool,
    ) -> (u32, bool) {
        self.ensure_room();
        let idx = match self.find(eh) {
            Find::Hit { idx, .. } => {
                if self.stamped {
                    self.stamps[idx as usize] = now;
                }
                if self.slab[idx as usize].held() {
                    return (idx, true);
                }
                // A ghost comes back with its held children.
                let slot = self.set_bit(table, g, gbit, key);
                self.slab[idx as usize].slot = slot;
                self.set_parent(idx, parent);
                self.orphans -= self.children(idx) as u64;
                self.ghosts -= 1;
                self.held += 1;
                if parent != NONE {
                    self.add_child(parent);
                }
                idx
            }
            Find::Miss { ins, disp } => {
                let fresh = unholey
                    && self.dups.is_empty()
                    && parent != NONE
                    && self.children(parent) == 0
                    && table.only_bit(self.slab[parent as usize].slot, gbit, g);
                let slot = if fresh {
                    table.insert_absent(key, gbit, g)
                } else {
                    self.set_bit(table, g, gbit, key)
                };
                let idx = self.insert(ins, disp, eh, slot, parent, now);
                self.held += 1;
                if parent != NONE {
                    self.add_child(parent);
                }
                idx
            }
        };
        (idx, false)
    }

    /// Sets this worker's bit in the row of `key` and returns the slot; a key the worker
    /// already held (through another record) gets one more count in `dups`.
    #[inline]
    fn set_bit(&mut self, table: &mut TableWriter, g: &Guard, gbit: usize, key: u64) -> u32 {
        let (slot, had) = table.set_bit_had(key, gbit, g);
        if had {
            *self.dups.entry(table.key_at(slot, g)).or_insert(0) += 1;
        }
        slot
    }

    /// Removes held record `idx` (index position `pos`): clears its table bit, unlinks it
    /// from its parent (freeing a ghost parent left childless), and leaves a ghost if it has
    /// held children.
    #[inline]
    fn remove(&mut self, table: &mut TableWriter, g: &Guard, gbit: usize, pos: usize, idx: u32) {
        let slot = self.slab[idx as usize].slot;
        match (!self.dups.is_empty())
            .then(|| table.key_at(slot, g))
            .and_then(|k| self.dups.get_mut(&k).map(|c| (k, c)))
        {
            // Another record of this worker still holds the key: the bit stays.
            Some((k, c)) => {
                *c -= 1;
                if *c == 0 {
                    self.dups.remove(&k);
                }
            }
            None => table.clear_bit(slot, gbit, g),
        }
        self.held -= 1;
        let p = self.parent(idx);
        self.set_parent(idx, NONE);
        // This record first: freeing it shifts index entries, so `pos` is only valid now.
        let c = self.children(idx);
        if c > 0 {
            self.slab[idx as usize].slot = GHOST;
            self.ghosts += 1;
            self.orphans += c as u64;
        } else {
            self.release(pos, idx);
        }
        if p != NONE {
            let left = self.drop_child(p);
            if !self.slab[p as usize].held() {
                self.orphans -= 1;
                if left == 0 {
                    let Find::Hit { pos: pp, .. } = self.find(self.slab[p as usize].engine())
                    else {
                        unreachable!("ghost is indexed")
                    };
                    self.ghosts -= 1;
                    self.release(pp, p);
                }
            }
        }
    }

    /// After removals: compacts a slab under 1/4 full (renumbering parents, spilled counts
    /// and stamps) or rebuilds an index under 1/4 full, so memory follows the live records.
    fn trim(&mut self) {
        let live = self.held + self.ghosts;
        if self.slab.capacity() > 64 && live * 4 < self.slab.capacity() {
            let mut map = vec![NONE; self.slab.len()];
            let cap = live + live / 16 + 1;
            let mut slab = Vec::with_capacity(cap);
            let mut stamps = Vec::with_capacity(if self.stamped { cap } else { 0 });
            for (i, r) in self.slab.iter().enumerate() {
                if r.slot != FREE {
                    map[i] = slab.len() as u32;
                    slab.push(*r);
                    if self.stamped {
                        stamps.push(self.stamps[i]);
                    }
                }
            }
            let parents: Vec<(u32, u32)> = (0..self.slab.len() as u32)
                .filter(|&i| self.slab[i as usize].slot != FREE)
                .map(|i| (map[i as usize], self.parent(i)))
                .collect();
            self.overflow = self
                .overflow
                .iter()
                .map(|(&k, &v)| (map[k as usize], v))
                .collect();
            self.far = MixMap::default();
            self.slab = slab;
            self.stamps = stamps;
            for (i, p) in parents {
                self.slab[i as usize].link |= P_MASK;
                self.set_parent(i, if p == NONE { NONE } else { map[p as usize] });
            }
            self.free = NONE;
            self.rebuild_index();
        } else if self.index.len() > 64 && live * 4 < self.index.len() {
            self.rebuild_index();
        }
        if self.overflow.capacity() > 4 * self.overflow.len() + 16 {
            self.overflow.shrink_to(self.overflow.len() * 2);
        }
        if self.far.capacity() > 4 * self.far.len() + 16 {
            self.far.shrink_to(self.far.len() * 2);
        }
    }

    /// Allocated bytes: the state itself, slab, stamps, index, spilled counts, far parents
    /// and duplicate keys (capacity × entry size, + 1 control byte per map bucket).
    fn memory_bytes(&self) -> usize {
        let map = std::mem::size_of::<(u32, u32)>() + 1;
        std::mem::size_of::<Self>()
            + self.slab.capacity() * std::mem::size_of::<Rec>()
            + self.stamps.capacity() * 4
            + self.index.capacity() * 4
            + (self.overflow.capacity() + self.far.capacity()) * map
            + self.dups.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
    }
}

/// The writers' side of the table, behind the writer-only mutex.
struct TableSide {
    table: TableWriter,
    /// Slot maps of rebuilds not yet applied by every shard, oldest first; map `i` is
    /// rebuild number `first + i`.
    remaps: VecDeque<Vec<u32>>,
    first: u64,
    /// Rebuilds each shard has applied to its records.
    applied: Vec<u64>,
}

impl TableSide {
    /// Records that rebuild `map` happened (the caller applies it to its own shard).
    fn push_remap(&mut self, map: Vec<u32>) {
        self.remaps.push_back(map);
    }

    /// Drops the maps every shard has applied.
    fn drop_applied(&mut self) {
        let min = self.applied.iter().copied().min().unwrap_or(0);
        while self.first < min {
            self.remaps.pop_front();
            self.first += 1;
        }
    }

    fn memory_bytes(&self) -> usize {
        self.table.writer_bytes()
            + self.remaps.iter().map(|m| m.capacity() * 4).sum::<usize>()
            + self.applied.capacity() * 8
    }
}

/// The single writer of one shard: applies that shard's workers' events in order.
///
/// # Invariants
/// 1. For every worker and held record, the table row at the record's slot has the worker's
///    bit; every set bit of this shard's word comes from a held record (no stale bits).
/// 2. A record's 8-bit child count (or its spilled count) = held records naming it as
///    parent; a held record's parent is held or a ghost; a ghost has ≥ 1 held child and no
///    parent; `orphans` = held records whose parent is a ghost; `held`, `ghosts` match.
/// 3. The shared `holey` bit of a worker is set iff its `orphans` > 0.
/// 4. The shared `entries` gauge = Σ over workers of held records.
/// 5. Slab and index agree: every non-free record is found by its engine hash at its slab
///    index, engine hashes are unique, the free list is exactly the free records, index
///    positions in use = entries + tombstones; a worker state exists only with ≥ 1 record.
/// 6. The table's own invariants (`table`); the slot maps this shard has not applied yet are
///    all still kept, and applying them maps every held record to a live slot (1).
pub struct EventWriter {
    shard: usize,
    shared: Arc<Shared>,
    /// The table's single writer and its pending slot maps, shared by all shard writers
    /// (writers only; readers never touch this lock). Each writer only sets and clears bits
    /// of its own word.
    table: Arc<Mutex<TableSide>>,
    /// Workers `64·shard + b`, `None` when holding no record.
    workers: Vec<Option<Box<WorkerState>>>,
    /// Σ held records.
    held: usize,
    /// Table rebuilds whose slot maps this shard has applied.
    applied: u64,
    block_size: usize,
    ttl_ms: Option<u64>,
    max_entries: Option<usize>,
    /// Touch stamps are kept (`ttl_ms` or `max_entries` set).
    stamped: bool,
    rejected: u64,
}

impl EventIndex {
    /// An empty index and its writers, one per shard (writer `i` owns workers
    /// `64·i .. 64·(i+1)`).
    ///
    /// # Panics
    /// If `block_size` is 0.
    pub fn new(cfg: &EventIndexConfig) -> (EventIndex, Vec<EventWriter>) {
        assert!(cfg.block_size > 0, "block_size must be > 0");
        let n = cfg.max_workers.div_ceil(SHARD_WORKERS).max(1);
        let mut writers = Vec::with_capacity(n);
        let per_shard_cap = cfg.max_entries.map(|m| m.div_ceil(n));
        let table = TableWriter::new(n);
        let shared = Arc::new(Shared {
            table: table.shared(),
            holey: (0..n).map(|_| AtomicU64::new(0)).collect(),
            entries: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            memo: Memo::new(),
        });
        let table = Arc::new(Mutex::new(TableSide {
            table,
            remaps: VecDeque::new(),
            first: 0,
            applied: vec![0; n],
        }));
        for shard in 0..n {
            writers.push(EventWriter {
                shard,
                shared: Arc::clone(&shared),
                table: Arc::clone(&table),
                workers: (0..SHARD_WORKERS).map(|_| None).collect(),
                held: 0,
                applied: 0,
                block_size: cfg.block_size,
                ttl_ms: cfg.ttl_ms,
                max_entries: per_shard_cap,
                stamped: cfg.ttl_ms.is_some() || cfg.max_entries.is_some(),
                rejected: 0,
            });
        }
        (
            EventIndex {
                table: Arc::clone(&shared.table),
                shared,
                block_size: cfg.block_size,
            },
            writers,
        )
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// (worker, block) entries held (gauge).
    pub fn entries(&self) -> usize {
        self.shared
            .entries
            .iter()
            .map(|e| e.load(Ordering::Relaxed))
            .sum()
    }

    /// Memory the readers share, bytes: the table (slots allocated × 8 × (1 + ⌈max_workers
    /// / 64⌉), or × 16 plus heap rows with sparse rows) and the remembered answers
    /// ([`MEMO_SLOTS`] slots and their runs). The writers' records are counted by
    /// [`EventWriter::memory_bytes`].
    pub fn table_bytes(&self) -> usize {
        self.shared.table.memory_bytes() + self.shared.memo.memory_bytes()
    }

    /// Overlap of every worker with `keys` (lock-free; allocates only the answer: scratch
    /// of O(workers) words is reused per thread).
    ///
    /// `keys`: block keys of one request, in order, computed in the request's namespace
    /// ([`crate::keys::block_keys_in`]: a namespace is the root of the key chain, so the keys
    /// themselves are partitioned). Returns each worker holding at least `keys[0]` with the number of consecutive leading
    /// blocks it holds; a hole truncates the match. Cost, in probes of the one table (each
    /// answering for every worker): O(len/32 + drop points × 5) for workers without holes,
    /// plus O(len) when a worker with holes holds `keys[0]`; then O(workers) to emit. Like
    /// [`Self::find_depths`], it starts from (and updates) the index's remembered answer for
    /// the same prefix: two probes per remembered depth when nothing moved.
    pub fn find_matches(&self, keys: &[u64]) -> Overlap {
        if keys.is_empty() {
            return Overlap::default();
        }
        // The answer's own buffers are the thread's, lent to the query and handed back.
        with_scratch(|s| {
            let nw = self.table.words();
            let memo = &self.shared.memo;
            let Scratch {
                words,
                first,
                depth,
                runs,
                hint,
                spare: _,
            } = s;
            first.resize(nw, 0);
            depth.resize(depth.len().max(nw * 64), 0);
            runs.clear();
            // Runs are gathered only for a prompt long enough to be remembered.
            let remembers = keys.len() >= MEMO_STRIDE;
            let mut out = Out {
                depth: Some(&mut depth[..nw * 64]),
                runs: remembers.then_some(&mut *runs),
            };
            let found = memo.recall(keys, hint);
            let h = found.is_some().then_some(hint.as_slice());
            if !self.find_into(keys, words, h, first, &mut out) {
                return Overlap::default();
            }
            if remembers {
                deepest_first(runs);
                memo.remember(keys, runs, found.map(|len| (len, hint.as_slice())));
            }
            emit(first, depth)
        })
    }

    /// [`Self::find_matches`] grouped by depth: the same overlaps as a [`Depths`], whose
    /// [`Depths::runs`] list the holders deepest first, so a caller wanting the `k` deepest
    /// of thousands of holders visits O(runs), not O(holders) (issue 16: at 4,096 workers
    /// sharing a system prompt, every worker holds the first blocks). Allocates the answer:
    /// ⌈workers / 64⌉ words and two copies of a run per (depth, 64-worker word) pair
    /// present; no per-worker array.
    ///
    /// The index remembers the answer (its depths cut at the last multiple of
    /// [`MEMO_STRIDE`] blocks, up to [`MEMO_SLOTS`] answers, shared by every reader thread)
    /// and a later query extending the same prefix (a conversation's next turn, on any
    /// thread) starts from it: each remembered depth
    /// `d` is checked with two probes (blocks `d − 1` and `d`) instead of a bisection of
    /// the whole prompt, and only the workers whose depth moved are bisected, within the
    /// side they moved to. The answer is the same as without it (a remembered depth is a
    /// guess that is verified, never trusted), so a stale one costs probes, not
    /// correctness. A remembered slot another thread is using is skipped, not waited for.
    pub fn find_depths(&self, keys: &[u64]) -> Depths {
        with_scratch(|s| {
            let memo = &self.shared.memo;
            let found = memo.recall(keys, &mut s.hint);
            let hint = found.is_some().then_some(s.hint.as_slice());
            let d = self.depths_hinted(keys, hint, &mut s.words, s.spare.take());
            memo.remember(keys, &d.runs, found.map(|len| (len, s.hint.as_slice())));
            d
        })
    }

    /// [`Self::find_depths`] starting from the depths `hint` (runs as [`Depths::runs`],
    /// any depths in 1..=keys.len(), repeated words allowed): the same answer whatever the
    /// hint says.
    fn depths_hinted(
        &self,
        keys: &[u64],
        hint: Option<&[Run]>,
        words: &mut Vec<u64>,
        spare: Option<Depths>,
    ) -> Depths {
        let nw = self.table.words();
        // Room for the hint's runs and a few that moved, so the answer rarely regrows.
        let mut d = Depths::empty(spare, nw, hint.map_or(0, <[Run]>::len) + 16);
        if keys.is_empty() {
            return d;
        }
        let mut out = Out {
            depth: None,
            runs: Some(&mut d.runs),
        };
        if !self.find_into(keys, words, hint, &mut d.first, &mut out) {
            d.first.fill(0);
            d.runs.clear();
            return d;
        }
        deepest_first(&mut d.runs);
        d.runs.dedup_by(|later, earlier| {
            let same = (later.0, later.1) == (earlier.0, earlier.1);
            if same {
                earlier.2 |= later.2;
            }
            same
        });
        // By word: a counting sort, O(runs + words). `word_start[w]` counts word `w`'s runs,
        // then (prefix sums) is where they end; placing the runs last to first, each one
        // just before its word's end, keeps a word's runs deepest first and leaves
        // `word_start[w]` where they start.
        d.word_start.resize(nw + 1, 0);
        for &(_, w, _) in &d.runs {
            d.word_start[w as usize] += 1;
        }
        let mut end = 0;
        for s in &mut d.word_start {
            end += *s;
            *s = end;
        }
        d.by_word.resize(d.runs.len(), (0, 0, 0));
        for &r in d.runs.iter().rev() {
            let at = &mut d.word_start[r.1 as usize];
            *at -= 1;
            d.by_word[*at as usize] = r;
        }
        d
    }

    /// The query of [`Self::find_matches`]: fills `first` (⌈workers / 64⌉ words) with the
    /// workers holding `keys[0]` and gives each of them its depth through `out`; false when
    /// none holds it (`first` is then unspecified). `words` is scratch; `hint`, remembered
    /// depths to verify before bisecting ([`Self::find_depths`]).
    fn find_into(
        &self,
        keys: &[u64],
        words: &mut Vec<u64>,
        hint: Option<&[Run]>,
        first: &mut [u64],
        out: &mut Out<'_>,
    ) -> bool {
        let table = &self.table;
        let nw = table.words();
        let guard = epoch::pin();
        let t = table.view(&guard);
        // The last block's slot starts loading now, together with the first one's.
        let last = keys.len() - 1;
        t.prefetch(keys[last]);
        // Scratch: active, row, holey, then 2 word-sets per bisection level.
        let levels = (usize::BITS - keys.len().leading_zeros()) as usize + 1;
        let need = nw * (3 + 2 * levels);
        if words.len() < need {
            words.resize(need, 0);
        }
        if !t.get_into(keys[0], first) {
            return false;
        }
        let (active, rest) = words[..need].split_at_mut(nw);
        let (row, rest) = rest.split_at_mut(nw);
        let (holey, scratch) = rest.split_at_mut(nw);
        let probe = Probe { t, keys };
        let mut any_holey = 0;
        for (w, h) in holey.iter_mut().enumerate() {
            *h = self.shared.holey[w].load(Ordering::Acquire) & first[w];
            any_holey |= *h;
        }
        // Every worker of `first` gets its depth written below before it is read.
        // Workers with holes: block by block.
        if any_holey != 0 {
            active.copy_from_slice(holey);
            let mut i = 1;
            while i < keys.len() {
                if i + 8 < keys.len() {
                    probe.prefetch(i + 8);
                }
                probe.get(i, row);
                let mut live = 0;
                for w in 0..nw {
                    let h = row[w] & active[w];
                    out.put(w, active[w] & !h, i as u32);
                    active[w] = h;
                    live |= h;
                }
                if live == 0 {
                    break;
                }
                i += 1;
            }
            for (w, &a) in active.iter().enumerate() {
                out.put(w, a, keys.len() as u32);
            }
        }
        // Prefix-closed workers: holders of the last block hold it all; the others drop
        // inside [1, last], found by one bisection of [0, last) for all of them.
        let mut live = 0;
        for w in 0..nw {
            active[w] = first[w] & !holey[w];
            live |= active[w];
        }
        if live != 0 && last > 0 {
            probe.get(last, row);
            live = 0;
            for w in 0..nw {
                let full = row[w] & active[w];
                out.put(w, full, keys.len() as u32);
                active[w] &= !full;
                live |= active[w];
            }
            if live != 0
                && let Some(hint) = hint
            {
                // `holey` is free from here on: it holds each remembered depth's workers.
                live = verify(&probe, out, hint, active, holey, row, scratch);
            }
            if live != 0 {
                bisect(&probe, out, 0, last, active, scratch);
            }
        } else if live != 0 {
            for (w, &a) in active.iter().enumerate() {
                out.put(w, a, 1);
            }
        }
        true
    }

    /// [`Self::find_matches`] on raw token ids: keys of every full block of `tokens` in
    /// namespace `ns` ([`crate::keys::block_keys_in`]).
    pub fn find_matches_tokens(&self, ns: Namespace, tokens: &[u32]) -> Overlap {
        self.find_matches(&crate::keys::block_keys_in(ns, tokens, self.block_size))
    }
}

/// A run of [`Depths::runs`]: `(blocks, word, workers)`.
type Run = (u32, u32, u64);

/// Sorts runs in [`Depths::runs`]' order: deepest first, then by word.
fn deepest_first(runs: &mut [Run]) {
    runs.sort_unstable_by_key(|&(blocks, w, _)| (std::cmp::Reverse(blocks), w));
}

/// Per-thread scratch of [`EventIndex::find_matches`] and [`EventIndex::find_depths`]:
/// bitsets, per-worker depths, and runs.
#[derive(Default)]
struct Scratch {
    words: Vec<u64>,
    first: Vec<u64>,
    depth: Vec<u32>,
    /// [`EventIndex::find_matches`]' answer as runs, for the memo.
    runs: Vec<Run>,
    /// A remembered answer, copied out of the memo.
    hint: Vec<Run>,
    /// The buffers of the last [`Depths`] this thread dropped, for its next query: a
    /// decision's query then allocates nothing (its four buffers were ~1.5 % of the samples
    /// of a 4,096-worker × 32k-token decision; the decide stage measured 0.96× with this,
    /// perf/runs/2026-12-07-decision-trims).
    spare: Option<Depths>,
}

/// `f` on the thread's scratch (a fresh one if the thread's is in use: a query inside a
/// query, which nothing does today).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Blocks between the prefix lengths at which [`EventIndex::find_depths`] remembers an
/// answer: a query of `n` keys is remembered cut at ⌊n / 16⌋ · 16 blocks (256 tokens at
/// the engines' usual 16-token blocks), so that a next turn adding fewer than
/// [`MEMO_LOOKBACK`] × 16 blocks finds it.
pub const MEMO_STRIDE: usize = 16;
/// Remembered lengths a query looks for below its own (each look a hash, a try-lock and a
/// compare): a turn adding up to 8 × 16 blocks (2,048 tokens; Mooncake's conversation turns
/// add a few hundred) finds the previous turn's answer.
pub const MEMO_LOOKBACK: usize = 8;

/// Answers an index remembers, direct-mapped by their last key: conversations in flight
/// at once across the router's threads (a conversation whose next turn comes after 1,024
/// others were asked since may have lost its slot: it is bisected, as with no memory).
pub const MEMO_SLOTS: usize = 1024;
/// Answers with more runs than this are not remembered (each run 16 bytes: at most 4 KiB
/// an answer, 4 MiB an index).
pub const MEMO_MAX_RUNS: usize = 256;

/// An index's remembered answers of [`EventIndex::find_depths`] and
/// [`EventIndex::find_matches`], shared by its readers. Each
/// slot has its own lock, only ever tried: a reader finding it taken goes on without (no
/// hint, or nothing remembered), so readers still never wait.
struct Memo {
    /// [`MEMO_SLOTS`] slots.
    slots: Box<[Mutex<Remembered>]>,
    /// Bytes the slots' runs hold (their capacities), for [`EventWriter::memory_bytes`].
    bytes: AtomicUsize,
}

/// One remembered answer: the runs of the query of the `len` first keys of some prompt
/// whose key `len − 1` is `key` (keys chain, so that key names the whole prefix).
#[derive(Default)]
struct Remembered {
    key: u64,
    len: usize,
    runs: Vec<Run>,
}

impl Memo {
    fn new() -> Self {
        Self {
            slots: (0..MEMO_SLOTS)
                .map(|_| Mutex::new(Remembered::default()))
                .collect(),
            bytes: AtomicUsize::new(0),
        }
    }

    fn slot(&self, key: u64) -> &Mutex<Remembered> {
        &self.slots[home(mix(key), MEMO_SLOTS)]
    }

    /// Copies into `out` the runs remembered for the longest prefix of `keys` with a
    /// remembered answer, looking [`MEMO_LOOKBACK`] stride lengths down from
    /// ⌊len / stride⌋ · stride, and returns that prefix's length; `None` when there is
    /// none (or its slot is in use).
    fn recall(&self, keys: &[u64], out: &mut Vec<Run>) -> Option<usize> {
        let top = keys.len() / MEMO_STRIDE;
        (top.saturating_sub(MEMO_LOOKBACK - 1).max(1)..=top)
            .rev()
            .map(|k| k * MEMO_STRIDE)
            .find(|&len| {
                let key = keys[len - 1];
                let Ok(r) = self.slot(key).try_lock() else {
                    return false;
                };
                let found = r.key == key && r.len == len;
                if found {
                    out.clear();
                    out.extend_from_slice(&r.runs);
                }
                found
            })
    }

    /// Remembers `runs` (the answer for `keys`) cut at ⌊len / stride⌋ · stride blocks;
    /// nothing for a prompt shorter than one stride, an answer over [`MEMO_MAX_RUNS`], a
    /// slot in use, or when `recalled` (the length and runs [`Self::recall`] gave this
    /// query) is already that answer (a turn that moved nothing writes nothing).
    fn remember(&self, keys: &[u64], runs: &[Run], recalled: Option<(usize, &[Run])>) {
        let len = keys.len() / MEMO_STRIDE * MEMO_STRIDE;
        if len == 0 || runs.is_empty() || runs.len() > MEMO_MAX_RUNS {
            return;
        }
        let cut = len as u32;
        let clamped = runs.iter().map(|&(d, w, set)| (d.min(cut), w, set));
        if recalled.is_some_and(|(l, had)| l == len && clamped.clone().eq(had.iter().copied())) {
            return;
        }
        let key = keys[len - 1];
        // A slot whose holder panicked holds a hint like any other: taken over.
        let mut r = match self.slot(key).try_lock() {
            Ok(r) => r,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        let before = r.runs.capacity();
        (r.key, r.len) = (key, len);
        r.runs.clear();
        r.runs.extend(clamped);
        let after = r.runs.capacity();
        if after != before {
            let run = std::mem::size_of::<Run>();
            self.bytes
                .fetch_add((after - before) * run, Ordering::Relaxed);
        }
    }

    /// Bytes held, the slots included.
    fn memory_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Mutex<Remembered>>()
            + self.bytes.load(Ordering::Relaxed)
    }
}

/// Where a query writes its depths: each worker's, and the runs of [`Depths::runs`] when
/// asked for ([`EventIndex::find_depths`]).
struct Out<'a> {
    depth: Option<&'a mut [u32]>,
    runs: Option<&'a mut Vec<(u32, u32, u64)>>,
}

impl Out<'_> {
    /// Every worker of `set` (bits of word `w`) holds exactly `d` leading blocks.
    #[inline]
    fn put(&mut self, w: usize, set: u64, d: u32) {
        if set != 0 {
            if let Some(depth) = self.depth.as_mut() {
                set_depth(&mut depth[w * 64..], set, d);
            }
            if let Some(runs) = self.runs.as_mut() {
                runs.push((d, w as u32, set));
            }
        }
    }
}

/// The [`Overlap`] of the workers of `first`, at their `depth`.
fn emit(first: &[u64], depth: &[u32]) -> Overlap {
    let mut out = Vec::with_capacity(first.iter().map(|w| w.count_ones() as usize).sum());
    for (w, &f) in first.iter().enumerate() {
        let mut f = f;
        while f != 0 {
            let b = w * 64 + f.trailing_zeros() as usize;
            out.push((b as TenantId, depth[b]));
            f &= f - 1;
        }
    }
    Overlap(out)
}

/// One query's overlaps ([`EventIndex::find_depths`]): the holders grouped into runs by
/// depth, deepest first, and the same runs by worker word for a lookup per worker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Depths {
    /// Bit `w % 64` of word `w / 64`: worker `w` holds at least the first block.
    first: Vec<u64>,
    /// `(blocks, word, workers)`: the workers `64·word + bit` for each bit of `workers` hold
    /// exactly `blocks` leading blocks. Sorted by blocks (descending), then word; one run per
    /// (blocks, word).
    runs: Vec<(u32, u32, u64)>,
    /// `runs` sorted by word (the runs of one word have disjoint worker sets).
    by_word: Vec<(u32, u32, u64)>,
    /// The runs of word `w` are `by_word[word_start[w]..word_start[w + 1]]` (empty when no
    /// worker holds the first block).
    word_start: Vec<u32>,
}

impl Drop for Depths {
    /// Leaves the buffers in the thread's [`Scratch`] for its next query
    /// ([`Depths::empty`]), unless the thread is exiting, its scratch is in use, or it
    /// already keeps some.
    fn drop(&mut self) {
        // Moved only into an empty spare: a `Depths` left over is never dropped here again.
        let _ = SCRATCH.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut()
                && s.spare.is_none()
            {
                s.spare = Some(Depths {
                    first: std::mem::take(&mut self.first),
                    runs: std::mem::take(&mut self.runs),
                    by_word: std::mem::take(&mut self.by_word),
                    word_start: std::mem::take(&mut self.word_start),
                });
            }
        });
    }
}

impl Depths {
    /// No holders over `words` worker words, with room for `runs` runs, in `spare`'s
    /// buffers (cleared) when given, else new ones.
    fn empty(spare: Option<Depths>, words: usize, runs: usize) -> Self {
        let mut d = spare.unwrap_or_default();
        d.first.clear();
        d.first.resize(words, 0);
        d.runs.clear();
        d.runs.reserve(runs);
        d.by_word.clear();
        d.word_start.clear();
        d
    }

    /// Leading blocks worker `w` holds (0 when it holds none or is out of range). O(the
    /// runs of its 64-worker word).
    pub fn blocks(&self, w: TenantId) -> u32 {
        let (word, bit) = (w as usize / 64, 1u64 << (w % 64));
        let (Some(&from), Some(&to)) = (self.word_start.get(word), self.word_start.get(word + 1))
        else {
            return 0;
        };
        self.by_word[from as usize..to as usize]
            .iter()
            .find(|r| r.2 & bit != 0)
            .map_or(0, |r| r.0)
    }

    /// Workers holding at least the first block.
    pub fn holders(&self) -> usize {
        self.first.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The holders as runs `(blocks, word, workers)` (worker `64·word + b` for each bit `b`
    /// of `workers`), deepest first, then by word.
    pub fn runs(&self) -> &[(u32, u32, u64)] {
        &self.runs
    }

    /// The same overlaps as [`EventIndex::find_matches`] gives (O(holders · log holders)).
    pub fn overlap(&self) -> Overlap {
        let mut out: Vec<(TenantId, u32)> = Vec::with_capacity(self.holders());
        for &(d, word, mut set) in &self.by_word {
            while set != 0 {
                out.push((word * 64 + set.trailing_zeros(), d));
                set &= set - 1;
            }
        }
        out.sort_unstable();
        Overlap(out)
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Probes of one query: block position → worker words.
struct Probe<'a, 'g> {
    t: TableRef<'g>,
    keys: &'a [u64],
}

#[cfg(test)]
thread_local! {
    /// Rows a query read past its first block (tests count probes with it).
    static PROBES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Probe<'_, '_> {
    #[inline]
    fn get(&self, i: usize, out: &mut [u64]) {
        #[cfg(test)]
        PROBES.with(|p| p.set(p.get() + 1));
        self.t.get_into(self.keys[i], out);
    }
    #[inline]
    fn prefetch(&self, i: usize) {
        self.t.prefetch(self.keys[i]);
    }
}

/// Sets `depth[b] = d` for every bit `b` of `set` (`depth` starts at the word's worker 0).
#[inline]
fn set_depth(depth: &mut [u32], mut set: u64, d: u32) {
    while set != 0 {
        let b = set.trailing_zeros() as usize;
        depth[b] = d;
        set &= set - 1;
    }
}

/// Places the workers of `active` that `hint` (runs `(depth, word, workers)`, depths in
/// `1..=keys`, a depth's runs together) names, removing them from `active`; returns whether
/// any are left. Every worker of `active` holds block 0 and not the last block, and is
/// prefix-closed (holds every block before its first missing one). For a remembered depth
/// `d`: the workers still holding block `d − 1` and not block `d` hold exactly `d` blocks;
/// those not holding `d − 1` are bisected within `[0, d − 1)`, those holding `d` within
/// `[d, last)`. Two probes per remembered depth, all asked of memory before the first is
/// read. `group` and `row` are word-sets of `active.len()` words; `scratch` as
/// [`bisect`]'s.
fn verify(
    probe: &Probe<'_, '_>,
    out: &mut Out<'_>,
    hint: &[Run],
    active: &mut [u64],
    group: &mut [u64],
    row: &mut [u64],
    scratch: &mut [u64],
) -> u64 {
    let last = probe.keys.len() - 1;
    let nw = active.len();
    let depths = || {
        hint.chunk_by(|a, b| a.0 == b.0)
            .map(|runs| (runs[0].0 as usize, runs))
            .filter(|&(d, _)| (1..=last + 1).contains(&d))
    };
    for (d, _) in depths() {
        probe.prefetch(d - 1);
        if d < last {
            probe.prefetch(d);
        }
    }
    for (d, runs) in depths() {
        group.fill(0);
        let mut any = 0;
        for &(_, w, set) in runs {
            if let Some(a) = active.get_mut(w as usize) {
                group[w as usize] |= set & *a;
                any |= set & *a;
                *a &= !set;
            }
        }
        if any == 0 {
            continue;
        }
        // Block d − 1: held by all of them when d = 1 (block 0 is).
        if d > 1 {
            probe.get(d - 1, row);
            let (gone, rest) = scratch.split_at_mut(nw);
            for w in 0..nw {
                gone[w] = group[w] & !row[w];
                group[w] &= row[w];
            }
            bisect(probe, out, 0, d - 1, gone, rest);
        }
        // Block d: the last one is held by none of them.
        if d < last {
            probe.get(d, row);
            let (deeper, rest) = scratch.split_at_mut(nw);
            for w in 0..nw {
                deeper[w] = group[w] & row[w];
                group[w] &= !row[w];
            }
            bisect(probe, out, d, last, deeper, rest);
        }
        for (w, &g) in group.iter().enumerate() {
            out.put(w, g, d as u32);
        }
    }
    active.iter().fold(0, |acc, &a| acc | a)
}

/// Every worker in `set` (a bitset of `set.len()` words) holds block `lo` and not block `hi`:
/// finds each one's first missing block by bisection, probing once per step for the whole
/// set (and prefetching both possible next midpoints). `scratch` holds 2 × `set.len()` words
/// per remaining level.
fn bisect(
    probe: &Probe<'_, '_>,
    out: &mut Out<'_>,
    lo: usize,
    hi: usize,
    set: &[u64],
    scratch: &mut [u64],
) {
    let nw = set.len();
    if set.iter().all(|&w| w == 0) {
        return;
    }
    if hi == lo + 1 {
        for (w, &x) in set.iter().enumerate() {
            out.put(w, x, hi as u32);
        }
        return;
    }
    let mid = lo + (hi - lo) / 2;
    // Whichever half goes on, its midpoint is loading while this one is read.
    if mid > lo + 1 {
        probe.prefetch(lo + (mid - lo) / 2);
    }
    if hi > mid + 1 {
        probe.prefetch(mid + (hi - mid) / 2);
    }
    let (held, rest) = scratch.split_at_mut(nw);
    let (gone, rest) = rest.split_at_mut(nw);
    probe.get(mid, held);
    for w in 0..nw {
        held[w] &= set[w];
        gone[w] = set[w] & !held[w];
    }
    bisect(probe, out, lo, mid, gone, rest);
    bisect(probe, out, mid, hi, held, rest);
}

/// Locks the writers' table side. A writer that panicked mid-update leaves at most one
/// bit stale (no torn structure: every table write is a single atomic store), so a
/// poisoned lock is taken over rather than propagated.
fn lock(t: &Mutex<TableSide>) -> std::sync::MutexGuard<'_, TableSide> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

/// Touch stamp: seconds of `now_ms` (wraps after 136 years).
fn touch_stamp(now_ms: u64) -> u32 {
    (now_ms / 1000) as u32
}

impl EventWriter {
    /// Shard number: this writer owns workers `64·shard .. 64·(shard+1)`.
    pub fn shard(&self) -> usize {
        self.shard
    }

    /// Stored events rejected for an unknown parent (gauge).
    pub fn rejected(&self) -> u64 {
        self.rejected
    }

    fn bit(&self, worker: TenantId) -> Result<usize, IndexError> {
        let w = worker as usize;
        if w / SHARD_WORKERS != self.shard {
            return Err(IndexError::WrongShard { worker });
        }
        Ok(w % SHARD_WORKERS)
    }

    /// Applies the slot maps of table rebuilds this shard has not applied yet.
    fn catch_up(&mut self, side: &mut TableSide) {
        let end = side.first + side.remaps.len() as u64;
        if self.applied == end {
            return;
        }
        for g in self.applied..end {
            let map = &side.remaps[(g - side.first) as usize];
            for st in self.workers.iter_mut().flatten() {
                for r in &mut st.slab {
                    if r.held() {
                        r.slot = map[r.slot as usize];
                        debug_assert_ne!(r.slot, NO_SLOT);
                    }
                }
            }
        }
        self.applied = end;
        side.applied[self.shard] = end;
        side.drop_applied();
    }

    /// Publishes a rebuild's slot map and applies it here at once.
    fn remapped(&mut self, side: &mut TableSide, map: Option<Vec<u32>>) {
        if let Some(map) = map {
            side.push_remap(map);
            self.catch_up(side);
        }
    }

    /// Publishes worker `b`'s holey bit, drops its state when it holds no record, and the
    /// entries gauge. Called with the table lock held, so the next writer of any shard sees
    /// the holey bit (`apply_stored` relies on it).
    fn finish(&mut self, b: usize) {
        let holey = match &mut self.workers[b] {
            Some(st) if st.held + st.ghosts == 0 => {
                self.workers[b] = None;
                false
            }
            Some(st) => st.orphans > 0,
            None => false,
        };
        let m = 1u64 << b;
        let word = &self.shared.holey[self.shard];
        if holey != (word.load(Ordering::Relaxed) & m != 0) {
            if holey {
                word.fetch_or(m, Ordering::Release);
            } else {
                word.fetch_and(!m, Ordering::Release);
            }
        }
        self.shared.entries[self.shard].store(self.held, Ordering::Relaxed);
    }

    /// `BlockStored`: worker `worker` cached the blocks `engine_hashes` (in order; block `i`'s
    /// parent is block `i−1`, block 0's is `parent`, `None` at sequence start) whose tokens
    /// are `token_ids` (`block_size` per block), at `now_ms`. Keys are chained from the
    /// parent's key, which carries the parent's namespace; a store at sequence start
    /// (`parent` `None`) starts the chain of namespace `ns` ([`crate::keys::root`]), and `ns`
    /// is ignored otherwise (vLLM names the cache salt only with a sequence's first block). Blocks already held are only touched (duplicate stores
    /// are no-ops); a removed block kept as a ghost comes back with its held children.
    ///
    /// # Errors
    /// - [`IndexError::WrongShard`]: `worker` is not in this writer's shard.
    /// - [`IndexError::BlockSizeMismatch`]: `token_ids.len() != block_size × engine_hashes.len()`.
    /// - [`IndexError::UnknownParent`]: `parent` is not held by the worker (counted in
    ///   [`Self::rejected`]; nothing is stored).
    pub fn apply_stored(
        &mut self,
        worker: TenantId,
        ns: Namespace,
        parent: Option<u64>,
        engine_hashes: &[u64],
        token_ids: &[u32],
        now_ms: u64,
    ) -> Result<(), IndexError> {
        self.apply_stored_reporting(
            worker,
            ns,
            parent,
            engine_hashes,
            token_ids,
            now_ms,
            |_, _| {},
        )
    }

    /// [`Self::apply_stored`], calling `seen(i, held)` for each block `i` of `engine_hashes`
    /// in order as it is applied, `held` true when the worker held it before this store (a
    /// duplicate store, only touched). A caller that keeps per-block state of its own learns
    /// it from the same index probe as the store, instead of a [`Self::holds`] per block
    /// first: one cache miss per block instead of two, 13.5 % of a whole-trace simulation
    /// (perf/runs/2026-12-03-sim-speed-2). On an error `seen` is never called.
    ///
    /// # Errors
    /// As [`Self::apply_stored`].
    #[allow(clippy::too_many_arguments)]
    pub fn apply_stored_reporting(
        &mut self,
        worker: TenantId,
        ns: Namespace,
        parent: Option<u64>,
        engine_hashes: &[u64],
        token_ids: &[u32],
        now_ms: u64,
        mut seen: impl FnMut(usize, bool),
    ) -> Result<(), IndexError> {
        let b = self.bit(worker)?;
        if token_ids.len() != engine_hashes.len() * self.block_size {
            return Err(IndexError::BlockSizeMismatch {
                tokens: token_ids.len(),
                blocks: engine_hashes.len(),
                block_size: self.block_size,
            });
        }
        let parent_idx = match parent {
            None => NONE,
            Some(p) => match self.workers[b].as_ref().and_then(|st| st.held_idx(p)) {
                Some(idx) => idx,
                None => {
                    self.rejected += 1;
                    return Err(IndexError::UnknownParent { worker, parent: p });
                }
            },
        };
        if engine_hashes.is_empty() {
            return Ok(());
        }
        let now = touch_stamp(now_ms);
        let gbit = self.shard * SHARD_WORKERS + b;
        let side = Arc::clone(&self.table);
        let mut side = lock(&side);
        let g = epoch::pin();
        self.catch_up(&mut side);
        let map = side.table.reserve(engine_hashes.len(), &g);
        self.remapped(&mut side, map);
        let table = &mut side.table;
        let stamped = self.stamped;
        // Holey bits are published under the table lock (`finish`), so this sees every
        // shard's.
        let unholey = self
            .shared
            .holey
            .iter()
            .all(|w| w.load(Ordering::Acquire) == 0);
        let st = self.workers[b].get_or_insert_with(|| Box::new(WorkerState::new(stamped)));
        // Keys are computed a few blocks ahead of the stores (pure hashing), so each block's
        // table slot and index position are prefetched before its store needs them.
        const AHEAD: usize = 8;
        const RING: usize = 16;
        let mut prev_key = if parent_idx != NONE {
            Some(table.key_at(st.slab[parent_idx as usize].slot, &g))
        } else {
            crate::keys::root(ns)
        };
        let bs = self.block_size;
        let n = engine_hashes.len();
        let mut ring = [0u64; RING];
        let mut computed = 0;
        let held = st.held;
        let mut prev = parent_idx;
        for (i, &eh) in engine_hashes.iter().enumerate() {
            while computed < (i + AHEAD + 1).min(n) {
                let key = chain(
                    prev_key,
                    crate::keys::local_hash(&token_ids[computed * bs..][..bs]),
                );
                prev_key = Some(key);
                ring[computed % RING] = key;
                if computed > i {
                    table.prefetch(key, &g);
                    st.prefetch(engine_hashes[computed]);
                }
                computed += 1;
            }
            let was_held;
            (prev, was_held) = st.store(table, &g, gbit, eh, ring[i % RING], prev, now, unholey);
            seen(i, was_held);
        }
        self.held += st.held - held;
        table.end_batch(&g);
        drop(g);
        self.finish(b);
        drop(side);
        Ok(())
    }

    /// `BlockRemoved`: worker `worker` evicted `engine_hashes`. Unknown hashes are ignored
    /// (non-fatal, anchors §3.4). Removing a block whose children are still held leaves a
    /// hole (the block stays as a ghost): those children stop counting until the block is
    /// stored again.
    ///
    /// # Errors
    /// [`IndexError::WrongShard`]: `worker` is not in this writer's shard.
    pub fn apply_removed(
        &mut self,
        worker: TenantId,
        engine_hashes: &[u64],
    ) -> Result<(), IndexError> {
        self.apply_removed_if(worker, engine_hashes, |_, _| true)
    }

    /// [`Self::apply_removed`], removing block `i` of `engine_hashes` only when
    /// `remove(i, held)` returns true, `held` telling whether the worker holds it; called
    /// for every block in order (with `held` false for all when the worker holds nothing).
    /// A caller that keeps per-block state of its own (tiers, physical copies) decides from
    /// the same index probe as the removal, as [`Self::apply_stored_reporting`] does.
    ///
    /// # Errors
    /// [`IndexError::WrongShard`]: `worker` is not in this writer's shard (`remove` is never
    /// called).
    pub fn apply_removed_if(
        &mut self,
        worker: TenantId,
        engine_hashes: &[u64],
        mut remove: impl FnMut(usize, bool) -> bool,
    ) -> Result<(), IndexError> {
        let b = self.bit(worker)?;
        // Blocks up to the first one to remove need no table: a `BlockRemoved` that removes
        // nothing (a CPU-tier copy, a kept physical copy, an unknown hash) never takes the
        // lock the other shards' writers share. Index positions (`Find::Hit::pos`) are the
        // worker's own, so `catch_up` below leaves the first hit's `pos` valid.
        let first = {
            let st = self.workers[b].as_ref();
            let mut first = None;
            for (i, &eh) in engine_hashes.iter().enumerate() {
                match st.and_then(|st| st.find_held(eh)) {
                    Some((pos, idx)) => {
                        if remove(i, true) {
                            first = Some((i, pos, idx));
                            break;
                        }
                    }
                    None => {
                        remove(i, false);
                    }
                }
            }
            first
        };
        let Some((first, pos, idx)) = first else {
            return Ok(());
        };
        let gbit = self.shard * SHARD_WORKERS + b;
        let side = Arc::clone(&self.table);
        let mut side = lock(&side);
        let g = epoch::pin();
        self.catch_up(&mut side);
        let table = &mut side.table;
        let st = self.workers[b].as_mut().expect("checked");
        let held = st.held;
        st.remove(table, &g, gbit, pos, idx);
        let rest = &engine_hashes[first + 1..];
        // Two stages ahead of the removals: the index position of block `i + AHEAD`, then
        // (its position cached by then) the table row of block `i + NEAR`, which
        // `clear_bit` writes.
        const AHEAD: usize = 8;
        const NEAR: usize = 4;
        for &eh in rest.iter().take(AHEAD) {
            st.prefetch(eh);
        }
        for &eh in rest.iter().take(NEAR) {
            st.prefetch_row(table, &g, eh);
        }
        for (j, &eh) in rest.iter().enumerate() {
            let i = first + 1 + j;
            if let Some(&next) = rest.get(j + AHEAD) {
                st.prefetch(next);
            }
            if let Some(&near) = rest.get(j + NEAR) {
                st.prefetch_row(table, &g, near);
            }
            match st.find_held(eh) {
                Some((pos, idx)) => {
                    if remove(i, true) {
                        st.remove(table, &g, gbit, pos, idx);
                    }
                }
                None => {
                    remove(i, false);
                }
            }
        }
        st.trim();
        self.held -= held - st.held;
        table.end_batch(&g);
        let map = table.shrink(&g);
        self.remapped(&mut side, map);
        drop(g);
        self.finish(b);
        drop(side);
        Ok(())
    }

    /// `AllBlocksCleared`: worker `worker` dropped every block.
    ///
    /// # Errors
    /// [`IndexError::WrongShard`]: `worker` is not in this writer's shard.
    pub fn apply_cleared(&mut self, worker: TenantId) -> Result<(), IndexError> {
        let b = self.bit(worker)?;
        let Some(st) = self.workers[b].take() else {
            return Ok(());
        };
        let gbit = self.shard * SHARD_WORKERS + b;
        let side = Arc::clone(&self.table);
        let mut side = lock(&side);
        let g = epoch::pin();
        // Catch up first: `st` is out of `self.workers`, so map it by hand.
        let end = side.first + side.remaps.len() as u64;
        let maps: Vec<&Vec<u32>> = (self.applied..end)
            .map(|r| &side.remaps[(r - side.first) as usize])
            .collect();
        let slots: Vec<u32> = st
            .slab
            .iter()
            .filter(|r| r.held())
            .map(|r| maps.iter().fold(r.slot, |s, m| m[s as usize]))
            .collect();
        for s in slots {
            side.table.clear_bit(s, gbit, &g);
        }
        self.held -= st.held;
        self.catch_up(&mut side);
        side.table.end_batch(&g);
        let map = side.table.shrink(&g);
        self.remapped(&mut side, map);
        drop(g);
        self.finish(b);
        drop(side);
        Ok(())
    }

    /// The worker left the fleet: same as [`Self::apply_cleared`], and frees its records.
    ///
    /// # Errors
    /// [`IndexError::WrongShard`]: `worker` is not in this writer's shard.
    pub fn remove_worker(&mut self, worker: TenantId) -> Result<(), IndexError> {
        self.apply_cleared(worker)
    }

    /// Applies the optional bounds at `now_ms`: drops entries untouched for `ttl_ms`, then,
    /// if the shard holds more than its share of `max_entries`, the least-recently-touched
    /// down to 90 % of the share (SMG). Returns the entries dropped. Cost O(entries of the
    /// shard); meant to run every 30 s (SMG), not per event. A no-op (0) without bounds.
    pub fn prune(&mut self, now_ms: u64) -> usize {
        if !self.stamped {
            return 0;
        }
        let now = touch_stamp(now_ms);
        let ttl_s = self.ttl_ms.map(|t| (t / 1000).min(u32::MAX as u64) as u32);
        // (age, worker bit, slab index)
        let mut victims: Vec<(u32, usize, u32)> = Vec::new();
        let mut kept: Vec<(u32, usize, u32)> = Vec::new();
        for (b, st) in self.workers.iter().enumerate() {
            let Some(st) = st else { continue };
            for (i, r) in st.slab.iter().enumerate() {
                if !r.held() {
                    continue;
                }
                let a = now.saturating_sub(st.stamps[i]);
                match ttl_s {
                    Some(ttl) if a > ttl => victims.push((a, b, i as u32)),
                    _ => kept.push((a, b, i as u32)),
                }
            }
        }
        if let Some(cap) = self.max_entries
            && kept.len() > cap
        {
            let target = cap * 9 / 10;
            let cut = kept.len() - target;
            // Oldest (largest age) first.
            kept.select_nth_unstable_by(cut - 1, |a, b| b.0.cmp(&a.0));
            victims.extend_from_slice(&kept[..cut]);
        }
        let n = victims.len();
        if n == 0 {
            return 0;
        }
        // Removal order does not matter: a victim removed before its victim children is a
        // ghost until they go, then freed; every victim is held until its own removal.
        victims.sort_unstable_by_key(|&(_, b, i)| (b, i));
        let side = Arc::clone(&self.table);
        let mut side = lock(&side);
        let g = epoch::pin();
        self.catch_up(&mut side);
        let table = &mut side.table;
        let mut touched = 0u64;
        for &(_, b, idx) in &victims {
            let gbit = self.shard * SHARD_WORKERS + b;
            let st = self.workers[b].as_mut().expect("victim's worker");
            let eh = st.slab[idx as usize].engine();
            if let Find::Hit { pos, idx } = st.find(eh) {
                st.remove(table, &g, gbit, pos, idx);
            }
            touched |= 1 << b;
        }
        for b in 0..SHARD_WORKERS {
            if touched & (1 << b) != 0
                && let Some(st) = &mut self.workers[b]
            {
                st.trim();
            }
        }
        self.held -= n;
        table.end_batch(&g);
        let map = table.shrink(&g);
        self.remapped(&mut side, map);
        drop(g);
        for b in 0..SHARD_WORKERS {
            if touched & (1 << b) != 0 {
                self.finish(b);
            }
        }
        drop(side);
        n
    }

    /// Memory of this shard, bytes: its equal share of the one table (slots allocated ×
    /// 8 × (1 + words), or × 16 plus heap rows with sparse rows, plus the writer side's
    /// tombstone lists and pending slot maps and the readers' remembered answers,
    /// divided by the number of writers, so the writers' sum is the whole table) and its
    /// records (per worker: slab capacity × 16 B, + 4 B with stamps, + index capacity × 4 B
    /// + overflow maps + the state itself, and 8 B per worker slot).
    pub fn memory_bytes(&self) -> usize {
        let side = lock(&self.table).memory_bytes();
        (self.shared.table.memory_bytes() + side + self.shared.memo.memory_bytes())
            / self.shared.holey.len()
            + self.workers.capacity() * std::mem::size_of::<Option<Box<WorkerState>>>()
            + self
                .workers
                .iter()
                .flatten()
                .map(|st| st.memory_bytes())
                .sum::<usize>()
    }

    /// True iff `worker` holds the block with engine hash `engine_hash` now (false for an
    /// unknown hash, a removed block kept as a ghost, or a worker of another shard).
    /// Lock-free, O(1).
    #[inline]
    pub fn holds(&self, worker: TenantId, engine_hash: u64) -> bool {
        self.bit(worker).is_ok_and(|b| {
            self.workers[b]
                .as_ref()
                .is_some_and(|st| st.held_idx(engine_hash).is_some())
        })
    }

    /// Engine hashes of the blocks `worker` holds, any order (empty for another shard).
    /// O(worker's records).
    pub fn engine_hashes(&self, worker: TenantId) -> Vec<u64> {
        match self.bit(worker).ok().and_then(|b| self.workers[b].as_ref()) {
            Some(st) => st
                .slab
                .iter()
                .filter(|r| r.held())
                .map(Rec::engine)
                .collect(),
            None => Vec::new(),
        }
    }

    /// Blocks held by `worker` (0 when not in this shard).
    pub fn worker_blocks(&self, worker: TenantId) -> usize {
        self.bit(worker)
            .ok()
            .and_then(|b| self.workers[b].as_ref())
            .map_or(0, |st| st.held)
    }

    /// Checks invariants 1–6 of [`EventWriter`].
    ///
    /// # Errors
    /// [`IndexError::Invariant`] with the invariant's number (node = worker bit or 0).
    #[cfg(any(test, feature = "test-util"))]
    pub fn check_invariants(&self) -> Result<(), IndexError> {
        use std::collections::HashSet;
        let bad = |number: u8, node: usize| {
            Err(IndexError::Invariant {
                number,
                node: node as u32,
            })
        };
        let side = lock(&self.table);
        let end = side.first + side.remaps.len() as u64;
        if side.table.check().is_err()
            || self.applied < side.first
            || self.applied > end
            || side.applied[self.shard] != self.applied
        {
            return bad(6, 0);
        }
        // Slots of this shard's records in the current table: the maps it has not applied.
        let maps: Vec<&Vec<u32>> = (self.applied..end)
            .map(|r| &side.remaps[(r - side.first) as usize])
            .collect();
        let cur = |slot: u32| maps.iter().fold(slot, |s, m| m[s as usize]);
        let g = epoch::pin();
        let mut want: HashSet<(u32, usize)> = HashSet::new();
        let mut held_total = 0;
        for (b, st) in self.workers.iter().enumerate() {
            let flag = self.shared.holey[self.shard].load(Ordering::Relaxed) & (1 << b) != 0;
            let Some(st) = st else {
                if flag {
                    return bad(3, b);
                }
                continue;
            };
            let gbit = self.shard * SHARD_WORKERS + b;
            // 5: free list, index, unique engine hashes.
            let mut free = HashSet::new();
            let mut f = st.free;
            while f != NONE {
                if f as usize >= st.slab.len()
                    || st.slab[f as usize].slot != FREE
                    || !free.insert(f)
                {
                    return bad(5, b);
                }
                f = st.slab[f as usize].engine[0];
            }
            let mut engines = HashSet::new();
            let (mut held, mut ghosts, mut nfree) = (0usize, 0usize, 0usize);
            if st.stamped != self.stamped
                || (st.stamped && st.stamps.len() != st.slab.len())
                || (!st.stamped && st.stamps.capacity() != 0)
            {
                return bad(5, b);
            }
            for (i, r) in st.slab.iter().enumerate() {
                if r.slot == FREE {
                    nfree += 1;
                    if r.link != P_NONE {
                        return bad(5, b);
                    }
                    continue;
                }
                if !engines.insert(r.engine()) {
                    return bad(5, b);
                }
                match st.find(r.engine()) {
                    Find::Hit { idx, .. } if idx as usize == i => {}
                    _ => return bad(5, b),
                }
                if r.held() {
                    held += 1;
                } else {
                    ghosts += 1;
                }
            }
            let n = st.index.len();
            let l = st.layout;
            let mut entries = 0;
            for (j, &e) in st.index.iter().enumerate() {
                if e == IX_EMPTY {
                    continue;
                }
                entries += 1;
                let idx = l.idx(e) as usize;
                if idx >= st.slab.len() || st.slab[idx].slot == FREE {
                    return bad(5, b);
                }
                let h = mix(st.slab[idx].engine());
                let d = (j + n - home(h, n)) % n;
                // Distance and tag fields; every position from home to here is occupied; Robin
                // Hood order: the entry before a displaced one is displaced at least d − 1.
                if l.disp(e) != (d as u32).min(l.dmax())
                    || l.etag(e) != l.tag(h)
                    || (0..d).any(|k| st.index[(j + n - k - 1) % n] == IX_EMPTY)
                    || (d > 0 && st.disp_at((j + n - 1) % n) + 1 < d)
                {
                    return bad(5, b);
                }
            }
            if nfree != free.len()
                || entries != held + ghosts
                || held + ghosts == 0
                || l != Layout::for_capacity(st.slab.capacity())
                || (held + ghosts) * INDEX_CAP.1 > n * INDEX_CAP.0
            {
                return bad(5, b);
            }
            // 2: children, ghosts, orphans.
            let mut children: std::collections::HashMap<u32, u32> = Default::default();
            let mut orphans = 0u64;
            for (i, r) in st.slab.iter().enumerate() {
                if !r.held() {
                    continue;
                }
                let far = r.link & P_MASK == P_FAR;
                if far != st.far.contains_key(&(i as u32)) {
                    return bad(2, b);
                }
                let parent = st.parent(i as u32);
                if parent != NONE {
                    let p = parent as usize;
                    if p >= st.slab.len() || st.slab[p].slot == FREE || (far && parent < far_from())
                    {
                        return bad(2, b);
                    }
                    *children.entry(parent).or_default() += 1;
                    if !st.slab[p].held() {
                        orphans += 1;
                    }
                }
            }
            let fars = st
                .slab
                .iter()
                .filter(|r| r.held() && r.link & P_MASK == P_FAR)
                .count();
            for (i, r) in st.slab.iter().enumerate() {
                if r.slot == FREE {
                    continue;
                }
                let c = children.get(&(i as u32)).copied().unwrap_or(0);
                let spilled = r.link >> CHILD_SHIFT == CHILD_SPILL;
                if st.children(i as u32) != c
                    || spilled != st.overflow.contains_key(&(i as u32))
                    || (spilled && c < CHILD_SPILL)
                {
                    return bad(2, b);
                }
                if !r.held() && (c == 0 || r.link & P_MASK != P_NONE) {
                    return bad(2, b);
                }
            }
            let spills = st
                .slab
                .iter()
                .filter(|r| r.slot != FREE && r.link >> CHILD_SHIFT == CHILD_SPILL)
                .count();
            if st.overflow.len() != spills
                || st.far.len() != fars
                || orphans != st.orphans
                || held != st.held
                || ghosts != st.ghosts
            {
                return bad(2, b);
            }
            // 3.
            if flag != (st.orphans > 0) {
                return bad(3, b);
            }
            // 1: every held record's bit is set.
            for r in st.slab.iter().filter(|r| r.held()) {
                let slot = cur(r.slot);
                if slot == NO_SLOT || !side.table.has_bit(slot, gbit, &g) {
                    return bad(1, b);
                }
                want.insert((slot, gbit));
            }
            held_total += held;
        }
        // 1: no stale bits of this shard's word.
        for (slot, _, words) in side.table.slot_entries() {
            let mut w = words[self.shard];
            while w != 0 {
                let gbit = self.shard * SHARD_WORKERS + w.trailing_zeros() as usize;
                if !want.contains(&(slot, gbit)) {
                    return bad(1, gbit % SHARD_WORKERS);
                }
                w &= w - 1;
            }
        }
        if held_total != self.held
            || self.held != self.shared.entries[self.shard].load(Ordering::Relaxed)
        {
            return bad(4, 0);
        }
        Ok(())
    }

    /// (held, ghosts, slab capacity, index length) of `worker` (tests).
    #[cfg(test)]
    fn counts(&self, worker: TenantId) -> (usize, usize, usize, usize) {
        self.bit(worker)
            .ok()
            .and_then(|b| self.workers[b].as_ref())
            .map_or((0, 0, 0, 0), |st| {
                (st.held, st.ghosts, st.slab.capacity(), st.index.len())
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{block_keys, block_keys_in, local_hash};
    use crate::reference::ReferenceEventIndex;
    use proptest::prelude::*;

    /// `d`'s runs list exactly the workers of `found` at their depths, deepest first, then by
    /// word, one run per (depth, word).
    fn check_runs(d: &Depths, found: &Overlap) -> Result<(), TestCaseError> {
        let runs = d.runs();
        prop_assert!(
            runs.windows(2)
                .all(|p| (std::cmp::Reverse(p[0].0), p[0].1) < (std::cmp::Reverse(p[1].0), p[1].1)),
            "sorted and unique: {:?}",
            runs
        );
        let mut listed: Vec<(TenantId, u32)> = Vec::new();
        for &(blocks, word, mut set) in runs {
            prop_assert!(set != 0);
            while set != 0 {
                listed.push((word * 64 + set.trailing_zeros(), blocks));
                set &= set - 1;
            }
        }
        listed.sort_unstable();
        prop_assert_eq!(&listed, &found.0);
        for &(w, b) in &found.0 {
            prop_assert_eq!(d.blocks(w), b);
        }
        Ok(())
    }

    const BS: usize = 4;

    fn cfg(max_workers: usize) -> EventIndexConfig {
        EventIndexConfig {
            block_size: BS,
            max_workers,
            ttl_ms: None,
            max_entries: None,
        }
    }

    fn check(w: &[EventWriter]) {
        for x in w {
            if let Err(e) = x.check_invariants() {
                panic!("{e}");
            }
        }
    }

    /// Tokens of block `i` of sequence `seq`: blocks of one sequence share prefixes with the
    /// same `seq` only.
    fn tokens(seq: u32, from: usize, n: usize) -> Vec<u32> {
        (from * BS..(from + n) * BS)
            .map(|t| seq * 10_000 + t as u32)
            .collect()
    }

    fn ehash(seq: u32, i: usize) -> u64 {
        ((seq as u64) << 32) | i as u64 | 0x8000_0000
    }

    /// Stores blocks `from..from+n` of `seq` on `worker` (parent = block from−1).
    fn store(
        w: &mut [EventWriter],
        r: &mut ReferenceEventIndex,
        worker: TenantId,
        seq: u32,
        from: usize,
        n: usize,
    ) {
        store_as(w, r, worker, seq, seq, from, n);
    }

    /// [`store`] with the tokens of sequence `content` under the engine hashes of `seq`: with
    /// `seq != content`, blocks the router's keys cannot tell apart from `content`'s.
    fn store_as(
        w: &mut [EventWriter],
        r: &mut ReferenceEventIndex,
        worker: TenantId,
        seq: u32,
        content: u32,
        from: usize,
        n: usize,
    ) {
        let parent = from.checked_sub(1).map(|p| ehash(seq, p));
        let hs: Vec<u64> = (from..from + n).map(|i| ehash(seq, i)).collect();
        let toks = tokens(content, from, n);
        let shard = worker as usize / SHARD_WORKERS;
        let got = w[shard].apply_stored(worker, 0, parent, &hs, &toks, 0);
        let blocks: Vec<(u64, u64)> = hs
            .iter()
            .zip(toks.chunks(BS))
            .map(|(&h, t)| (h, local_hash(t)))
            .collect();
        assert_eq!(got.is_ok(), r.stored(worker, parent, &blocks));
    }

    /// Two engine blocks the router's keys cannot tell apart (equal tokens under equal
    /// parents, different engine hashes: multimodal blocks with equal placeholder tokens).
    /// The second chain's blocks must find the first chain's keys, not insert them again:
    /// `insert_absent` of a present key trips its debug assertion, and a duplicate row would
    /// outlive the removal of either chain.
    #[test]
    fn equal_tokens_under_two_engine_hashes_share_one_key() {
        let (ix, mut w) = EventIndex::new(&cfg(2));
        let toks = tokens(1, 0, 3);
        w[0].apply_stored(0, 0, None, &[11, 12, 13], &toks, 0)
            .unwrap();
        w[0].apply_stored(0, 0, None, &[21, 22, 23], &toks, 0)
            .unwrap();
        // Worker 1 holds the same three blocks under its own engine hashes.
        w[0].apply_stored(1, 0, None, &[31, 32, 33], &toks, 0)
            .unwrap();
        check(&w);
        let mut q = toks.clone();
        q.extend(tokens(1, 3, 1));
        assert_eq!(ix.find_matches_tokens(0, &q).blocks(0), 3);
        w[0].apply_removed(0, &[11, 12, 13]).unwrap();
        check(&w);
        assert_eq!(ix.find_matches_tokens(0, &q).blocks(0), 3);
        w[0].apply_removed(0, &[21, 22, 23]).unwrap();
        check(&w);
        assert_eq!(ix.find_matches_tokens(0, &q).blocks(0), 0);
        assert_eq!(ix.find_matches_tokens(0, &q).blocks(1), 3);
    }

    /// The reporting forms see what the store or removal's own probe saw: `held` before a
    /// store (a ghost is not held), `held` for a removal, and a removal the caller declines
    /// leaves the block held.
    #[test]
    fn reporting_forms_report_each_blocks_probe() {
        let (ix, mut w) = EventIndex::new(&cfg(2));
        let toks = tokens(1, 0, 3);
        w[0].apply_stored(0, 0, None, &[11, 12], &toks[..2 * BS], 0)
            .unwrap();
        w[0].apply_removed(0, &[11]).unwrap(); // 11 stays as a ghost under held 12
        let mut seen = Vec::new();
        w[0].apply_stored_reporting(0, 0, None, &[11, 12, 13], &toks, 0, |i, h| {
            seen.push((i, h))
        })
        .unwrap();
        assert_eq!(seen, [(0, false), (1, true), (2, false)]);
        let mut asked = Vec::new();
        w[0].apply_removed_if(0, &[13, 99, 12], |i, h| {
            asked.push((i, h));
            i == 0
        })
        .unwrap();
        assert_eq!(asked, [(0, true), (1, false), (2, true)]);
        check(&w);
        let mut q = toks.clone();
        q.extend(tokens(1, 3, 1));
        assert_eq!(ix.find_matches_tokens(0, &q).blocks(0), 2);
        // A stranger's removal asks about every block, none held.
        let mut asked = Vec::new();
        w[0].apply_removed_if(1, &[11, 12], |i, h| {
            asked.push((i, h));
            true
        })
        .unwrap();
        assert_eq!(asked, [(0, false), (1, false)]);
        let mut calls = 0;
        assert!(
            w[0].apply_removed_if(64, &[11], |_, _| {
                calls += 1;
                true
            })
            .is_err()
        );
        let toks2 = tokens(2, 0, 1);
        assert!(
            w[0].apply_stored_reporting(0, 0, Some(999), &[41], &toks2, 0, |_, _| calls += 1)
                .is_err()
        );
        assert_eq!(calls, 0, "no report on an error");
    }

    /// A namespace roots the chain of a sequence-start store; a child store inherits its
    /// parent's namespace whatever `ns` it passes (vLLM sends the salt with block 0 only).
    #[test]
    fn namespaces_root_the_chain_and_children_inherit_it() {
        let (ix, mut w) = EventIndex::new(&cfg(2));
        let toks = tokens(3, 0, 4);
        w[0].apply_stored(0, 9, None, &[1, 2], &toks[..2 * BS], 0)
            .unwrap();
        w[0].apply_stored(0, 0, Some(2), &[3, 4], &toks[2 * BS..], 0)
            .unwrap();
        w[0].apply_stored(1, 0, None, &[5, 6, 7, 8], &toks, 0)
            .unwrap();
        check(&w);
        let in9 = ix.find_matches_tokens(9, &toks);
        assert_eq!(in9.0, vec![(0, 4)]);
        assert_eq!(ix.find_matches(&block_keys_in(9, &toks, BS)), in9);
        assert_eq!(ix.find_matches_tokens(0, &toks).0, vec![(1, 4)]);
        assert_eq!(ix.find_matches_tokens(8, &toks), Overlap::default());
    }

    /// A worker holding a block without its parent (a hole) can hold the key of a block
    /// another worker stores as new under a parent only it holds: while any worker is holey,
    /// new blocks take the full probe.
    #[test]
    fn a_holey_worker_keeps_new_blocks_on_the_full_probe() {
        let (ix, mut w) = EventIndex::new(&cfg(2));
        let mut r = ReferenceEventIndex::new();
        store(&mut w, &mut r, 1, 7, 0, 2);
        w[0].apply_removed(1, &[ehash(7, 0)]).unwrap();
        store(&mut w, &mut r, 0, 7, 0, 1);
        // Block 1 of seq 7 under a parent only worker 0 holds: worker 1 holds its key.
        store(&mut w, &mut r, 0, 7, 1, 1);
        check(&w);
        let q = tokens(7, 0, 2);
        let m = |w: TenantId| ix.find_matches_tokens(0, &q).blocks(w);
        assert_eq!((m(0), m(1)), (2, 0));
        w[0].apply_removed(0, &[ehash(7, 1)]).unwrap();
        check(&w);
        assert_eq!((m(0), m(1)), (1, 0));
        // Worker 1's block 0 comes back: its held block 1 counts again.
        store(&mut w, &mut r, 1, 7, 0, 1);
        check(&w);
        assert_eq!((m(0), m(1)), (1, 2));
    }

    /// Worked example of [`EventIndex::find_depths`] over two 64-worker words: workers 3 and 70
    /// hold all 8 blocks, 5 and 65 hold 4 (65 by a hole: its block 4 is gone, 5..8 kept),
    /// 0 holds 1; 9 holds none. Runs deepest first, then by word.
    #[test]
    fn depths_group_holders_deepest_first() {
        let (ix, mut w) = EventIndex::new(&cfg(128));
        let mut r = ReferenceEventIndex::new();
        for (worker, n) in [(3, 8), (70, 8), (5, 4), (65, 8), (0, 1)] {
            store(&mut w, &mut r, worker, 1, 0, n);
        }
        w[1].apply_removed(65, &[ehash(1, 4)]).unwrap();
        check(&w);
        let keys = block_keys(&tokens(1, 0, 8), BS);
        let d = ix.find_depths(&keys);
        assert_eq!(
            d.runs(),
            &[
                (8, 0, 1 << 3),
                (8, 1, 1 << (70 - 64)),
                (4, 0, 1 << 5),
                (4, 1, 1 << (65 - 64)),
                (1, 0, 1),
            ]
        );
        assert_eq!(
            (d.blocks(3), d.blocks(65), d.blocks(0), d.blocks(9)),
            (8, 4, 1, 0)
        );
        assert_eq!(d.blocks(100_000), 0, "out of range");
        assert_eq!(d.holders(), 5);
        assert_eq!(d.overlap(), ix.find_matches(&keys));
        assert_eq!(
            ix.find_depths(&[]),
            Depths {
                first: vec![0; 2],
                runs: vec![],
                by_word: vec![],
                word_start: vec![]
            }
        );
        let other = block_keys(&tokens(2, 0, 3), BS);
        assert_eq!(ix.find_depths(&other).holders(), 0);
        assert!(ix.find_depths(&other).runs().is_empty());
    }

    /// Worked example of the remembered answer ([`EventIndex::find_depths`]): 128 workers;
    /// worker 3 holds 30 blocks of a conversation, 70 holds 20, the other 99 of workers
    /// 0..=100 hold its first 10. Turn 1 (36 blocks) bisects and is remembered at 32
    /// blocks; turn 2 (40 blocks, on another thread) reads the last block and 2 blocks per
    /// remembered depth
    /// (10, 20, 30): 7 rows. Worker 70 then evicts its blocks 15..20: turn 3 (44 blocks)
    /// finds it at 15 by a bisection of [0, 19) for it alone. Every answer equals the one
    /// without memory and the brute-force reference.
    #[test]
    fn a_next_turn_checks_remembered_depths_instead_of_bisecting() {
        let (ix, mut w) = EventIndex::new(&cfg(128));
        let mut r = ReferenceEventIndex::new();
        for worker in 0..=100 {
            let n = match worker {
                3 => 30,
                70 => 20,
                _ => 10,
            };
            store(&mut w, &mut r, worker, 1, 0, n);
        }
        check(&w);
        let probes = |r: &ReferenceEventIndex, keys: &[u64]| {
            PROBES.with(|p| p.set(0));
            let d = ix.find_depths(keys);
            let n = PROBES.with(|p| p.get());
            assert_eq!(d, ix.depths_hinted(keys, None, &mut Vec::new(), None));
            assert_eq!(d.overlap().0, r.find_matches(keys));
            (d, n)
        };
        let keys = |n| block_keys(&tokens(1, 0, n), BS);
        let (d1, cold) = probes(&r, &keys(36));
        assert_eq!((d1.blocks(3), d1.blocks(70), d1.blocks(0)), (30, 20, 10));
        // The index remembers, not the thread: turn 2 comes on another thread.
        let (d2, warm) = std::thread::scope(|s| s.spawn(|| probes(&r, &keys(40))).join())
            .expect("the query does not panic");
        assert_eq!((d2.blocks(3), d2.blocks(70), d2.blocks(100)), (30, 20, 10));
        assert_eq!(
            warm, 7,
            "the last block, then blocks d − 1 and d of 3 depths"
        );
        assert!(cold > warm, "cold {cold} warm {warm}");
        let gone: Vec<u64> = (15..20).map(|i| ehash(1, i)).collect();
        w[1].apply_removed(70, &gone).unwrap();
        r.removed(70, &gone);
        check(&w);
        let (d3, moved) = probes(&r, &keys(44));
        assert_eq!((d3.blocks(3), d3.blocks(70), d3.blocks(64)), (30, 15, 10));
        assert!(moved > warm && moved < cold, "moved {moved}");
        // `find_matches` reads and updates the same memory: the answer turn 3 left at 32.
        PROBES.with(|p| p.set(0));
        let found = ix.find_matches(&keys(44));
        assert_eq!(PROBES.with(|p| p.get()), 7);
        assert_eq!(found, d3.overlap());
        // A prompt under one stride is neither remembered nor helped.
        let (d4, short) = probes(&r, &keys(12));
        assert_eq!((d4.blocks(3), d4.blocks(5)), (12, 10));
        assert!(short > 1);
    }

    /// anchors §7 E4: block boundaries with a 153-token base (9 full blocks + 9-token tail).
    #[test]
    fn e4_block_boundaries() {
        let (ix, mut w) = EventIndex::new(&EventIndexConfig {
            block_size: 16,
            ..cfg(1)
        });
        let base: Vec<u32> = (0..153).map(|t| 1000 + t).collect();
        let full = &base[..144];
        let hs: Vec<u64> = (0..9).map(|i| 77 + i).collect();
        w[0].apply_stored(0, 0, None, &hs, full, 0).unwrap();
        let m = |q: &[u32]| ix.find_matches_tokens(0, q).blocks(0);
        assert_eq!(m(&base), 9);
        let flip = |i: usize| {
            let mut q = base.clone();
            q[i] = 7;
            q
        };
        assert_eq!(m(&flip(63)), 3);
        assert_eq!(m(&flip(64)), 4);
        assert_eq!(m(&flip(147)), 9);
        let mut pre = vec![5];
        pre.extend_from_slice(&base);
        assert_eq!(m(&pre), 0);
        assert!(block_keys(&base[..15], 16).is_empty());
        assert_eq!(ix.find_matches_tokens(0, &base[..15]), Overlap::default());
        // Another namespace never matches.
        assert_eq!(ix.find_matches_tokens(9, &base).blocks(0), 0);
    }

    /// anchors §7 E5: an interior hole truncates the match at exactly 5.
    #[test]
    fn e5_interior_hole() {
        let (ix, mut w) = EventIndex::new(&cfg(2));
        let mut r = ReferenceEventIndex::new();
        store(&mut w, &mut r, 0, 1, 0, 40);
        store(&mut w, &mut r, 1, 1, 0, 40);
        w[0].apply_removed(0, &[ehash(1, 5)]).unwrap();
        r.removed(0, &[ehash(1, 5)]);
        check(&w);
        let keys = block_keys(&tokens(1, 0, 40), BS);
        assert_eq!(ix.find_matches(&keys).0, vec![(0, 5), (1, 40)]);
        assert_eq!(ix.find_matches(&keys).0, r.find_matches(&keys));
        // Re-storing the hole revives the tail.
        w[0].apply_stored(0, 0, Some(ehash(1, 4)), &[ehash(1, 5)], &tokens(1, 5, 1), 0)
            .unwrap();
        check(&w);
        assert_eq!(ix.find_matches(&keys).blocks(0), 40);
    }

    /// anchors §7 E7: one LRU engine with 60 blocks, 40 requests of 8 blocks (4 shared + 4
    /// unique) sent twice. With removals applied, believed hits == served hits == 316.
    #[test]
    fn e7_stale_index_replay() {
        let (ix, mut w) = EventIndex::new(&cfg(1));
        // Engine: LRU of 60 blocks keyed by (seq, i); shared prefix = seq 0 blocks 0..4.
        let mut lru: std::collections::VecDeque<(u32, usize)> = Default::default();
        let (mut believed, mut served, mut believed_stale) = (0, 0, 0);
        let mut stale: std::collections::HashSet<(u32, usize)> = Default::default();
        for round in 0..2 {
            for req in 0..40u32 {
                let _ = round;
                let blocks: Vec<(u32, usize)> = (0..8)
                    .map(|i| if i < 4 { (0, i) } else { (req + 1, i) })
                    .collect();
                // Router belief from the index.
                let toks: Vec<u32> = blocks.iter().flat_map(|&(s, i)| tokens(s, i, 1)).collect();
                believed += ix.find_matches_tokens(0, &toks).blocks(0);
                believed_stale += blocks.iter().take_while(|b| stale.contains(b)).count();
                // Engine: consecutive cached prefix, then store the rest, evicting LRU heads.
                let hit = blocks.iter().take_while(|b| lru.contains(b)).count();
                served += hit;
                for (i, b) in blocks.iter().enumerate() {
                    if let Some(p) = lru.iter().position(|x| x == b) {
                        lru.remove(p);
                    } else {
                        if lru.len() == 60 {
                            let (s, j) = lru.pop_front().unwrap();
                            w[0].apply_removed(0, &[ehash(s, j)]).unwrap();
                        }
                        let parent = i.checked_sub(1).map(|p| ehash(blocks[p].0, blocks[p].1));
                        w[0].apply_stored(
                            0,
                            0,
                            parent,
                            &[ehash(b.0, b.1)],
                            &tokens(b.0, b.1, 1),
                            0,
                        )
                        .unwrap();
                        stale.insert(*b);
                    }
                    lru.push_back(*b);
                }
            }
        }
        check(&w);
        assert_eq!(served, 316);
        assert_eq!(believed as usize, served);
        assert_eq!(
            believed_stale, 476,
            "without removals the belief is 476/640"
        );
    }

    #[test]
    fn unknown_parent_is_rejected_and_counted() {
        let (_, mut w) = EventIndex::new(&cfg(1));
        let e = w[0].apply_stored(0, 0, Some(42), &[1], &tokens(1, 0, 1), 0);
        assert_eq!(
            e,
            Err(IndexError::UnknownParent {
                worker: 0,
                parent: 42
            })
        );
        assert_eq!(w[0].rejected(), 1);
        assert_eq!(
            w[0].apply_stored(64, 0, None, &[1], &tokens(1, 0, 1), 0),
            Err(IndexError::WrongShard { worker: 64 })
        );
        assert!(matches!(
            w[0].apply_stored(0, 0, None, &[1], &tokens(1, 0, 2), 0),
            Err(IndexError::BlockSizeMismatch { .. })
        ));
    }

    /// B16/B18: a cap keeps entries bounded; removing everything empties the table.
    #[test]
    fn b16_b18_cap_and_full_removal() {
        let (ix, mut w) = EventIndex::new(&EventIndexConfig {
            max_entries: Some(1_000),
            ttl_ms: Some(60_000),
            ..cfg(1)
        });
        let mut r = ReferenceEventIndex::new();
        for seq in 0..500u32 {
            store(&mut w, &mut r, 0, seq, 0, 8);
            if seq % 50 == 49 {
                w[0].prune(seq as u64 * 10);
                assert!(ix.entries() <= 1_000);
            }
        }
        check(&w);
        assert!(ix.entries() >= 900);
        // TTL: everything untouched for > 60 s goes.
        let before = ix.entries();
        assert_eq!(w[0].prune(200_000), before);
        check(&w);
        assert_eq!(ix.entries(), 0);
        store(&mut w, &mut r, 0, 1, 0, 8);
        w[0].remove_worker(0).unwrap();
        check(&w);
        assert_eq!(ix.entries(), 0);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Store(TenantId, u32, usize, usize),
        Remove(TenantId, u32, usize),
        RemoveRange(TenantId, u32, usize, usize),
        Clear(TenantId),
        Match(u32, usize),
        Prune,
    }

    /// Engine-hash sequences of the proptest: 0..5, and their aliases `ALIAS + s` (same
    /// tokens as `s`, other engine hashes: equal router keys held through two records).
    const ALIAS: u32 = 50;

    fn op() -> impl Strategy<Value = Op> {
        let w = prop_oneof![0..4u32, 62..70u32];
        let seq = prop_oneof![4 => 0..5u32, 1 => ALIAS..ALIAS + 5];
        prop_oneof![
            6 => (w.clone(), seq.clone(), 0..6usize, 1..40usize).prop_map(|(w, s, f, n)| Op::Store(w, s, f, n)),
            3 => (w.clone(), seq.clone(), 0..45usize).prop_map(|(w, s, i)| Op::Remove(w, s, i)),
            1 => (w.clone(), seq, 0..45usize, 1..45usize).prop_map(|(w, s, f, n)| Op::RemoveRange(w, s, f, n)),
            1 => w.prop_map(Op::Clear),
            5 => (0..5u32, 1..45usize).prop_map(|(s, n)| Op::Match(s, n)),
            1 => Just(Op::Prune),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Random interleavings (holes mid-chain, clears, removals of unknown blocks, TTL
        /// pruning, two shards, blocks stored twice under different engine hashes; dense and
        /// sparse table rows) answer exactly like the brute-force reference. Holes leave
        /// ghosts that re-stores revive; range removals free ghosts and shrink slabs, so
        /// records are reused; `holds` and `engine_hashes` follow a model of held blocks.
        #[test]
        fn matches_reference(ops in prop::collection::vec(op(), 1..150), sparse in any::<bool>()) {
            // It pins on every op and frees sparse rows through the collector: not at the
            // same time as the table tests that need the epoch to advance.
            let _serial = crate::table::EPOCH_TESTS.lock().unwrap_or_else(|e| e.into_inner());
            // Parents from slab index 40 on go to the `far` map (2^24 − 2 in production).
            FAR_FROM.with(|f| f.set(40));
            // Both table row layouts (sparse from 5 words in production).
            crate::table::FORCE_SPARSE.with(|f| f.set(Some(sparse)));
            let (ix, mut w) = EventIndex::new(&EventIndexConfig { ttl_ms: Some(1_000_000), ..cfg(128) });
            crate::table::FORCE_SPARSE.with(|f| f.set(None));
            let mut r = ReferenceEventIndex::new();
            let mut model: std::collections::BTreeSet<(TenantId, u64)> = Default::default();
            let mut mismatches = 0;
            let mut other = Vec::new();
            for op in &ops {
                match *op {
                    Op::Store(wk, s, f, n) => {
                        // Only from a held parent (or the root) so both accept or both reject.
                        let parent_held = f == 0 || model.contains(&(wk, ehash(s, f - 1)));
                        store_as(&mut w, &mut r, wk, s, s % ALIAS, f, n);
                        if parent_held {
                            model.extend((f..f + n).map(|i| (wk, ehash(s, i))));
                        }
                    }
                    Op::Remove(wk, s, i) => {
                        w[wk as usize / 64].apply_removed(wk, &[ehash(s, i)]).unwrap();
                        r.removed(wk, &[ehash(s, i)]);
                        model.remove(&(wk, ehash(s, i)));
                    }
                    Op::RemoveRange(wk, s, f, n) => {
                        let hs: Vec<u64> = (f..f + n).map(|i| ehash(s, i)).collect();
                        w[wk as usize / 64].apply_removed(wk, &hs).unwrap();
                        r.removed(wk, &hs);
                        for h in hs {
                            model.remove(&(wk, h));
                        }
                    }
                    Op::Clear(wk) => {
                        w[wk as usize / 64].apply_cleared(wk).unwrap();
                        r.cleared(wk);
                        model.retain(|&(x, _)| x != wk);
                    }
                    Op::Match(s, n) => {
                        let keys = block_keys(&tokens(s, 0, n), BS);
                        let found = ix.find_matches(&keys);
                        if found.0 != r.find_matches(&keys) {
                            mismatches += 1;
                        }
                        let d = ix.find_depths(&keys);
                        // Any remembered answer (another query's, shifted by 1) gives the
                        // same depths: it is verified, not trusted.
                        for shift in [0, 1] {
                            let hint: Vec<_> = other
                                .iter()
                                .map(|&(b, w, set)| (b % n as u32 + shift, w, set))
                                .collect();
                            prop_assert_eq!(&ix.depths_hinted(&keys, Some(&hint), &mut Vec::new(), None), &d);
                        }
                        other = d.runs().to_vec();
                        prop_assert_eq!(&d.overlap(), &found);
                        prop_assert_eq!(d.holders(), found.0.len());
                        for wk in 0..130 {
                            prop_assert_eq!(d.blocks(wk), found.blocks(wk));
                        }
                        check_runs(&d, &found)?;
                    }
                    Op::Prune => {
                        // Nothing is older than the TTL: a no-op that must keep state intact.
                        prop_assert_eq!(w[0].prune(0) + w[1].prune(0), 0);
                    }
                }
                for x in &w {
                    prop_assert_eq!(x.check_invariants(), Ok(()));
                }
            }
            prop_assert_eq!(mismatches, 0);
            for wk in (0..4).chain(62..70) {
                let x = &w[wk as usize / 64];
                prop_assert_eq!(x.worker_blocks(wk), r.worker_blocks(wk));
                let mut got = x.engine_hashes(wk);
                got.sort_unstable();
                let want: Vec<u64> = model.range((wk, 0)..=(wk, u64::MAX)).map(|&(_, h)| h).collect();
                prop_assert_eq!(&got, &want);
                for s in (0..5).chain(ALIAS..ALIAS + 5) {
                    for i in 0..45 {
                        let h = ehash(s, i);
                        prop_assert_eq!(x.holds(wk, h), model.contains(&(wk, h)));
                        // The other shard's writer never claims it.
                        prop_assert!(!w[1 - wk as usize / 64].holds(wk, h));
                    }
                }
            }
        }
    }

    /// Memory is counted from capacity and given back: removing every block one event at a
    /// time shrinks the worker maps to near nothing (hash maps never shrink by themselves).
    #[test]
    fn memory_accounting_shrinks_after_removals() {
        let (ix, mut w) = EventIndex::new(&cfg(1));
        let mut r = ReferenceEventIndex::new();
        let empty = w[0].memory_bytes();
        store(&mut w, &mut r, 0, 1, 0, 4_000);
        let full = w[0].memory_bytes();
        assert!(
            full >= 4_000 * 32,
            "at least 32 bytes per block (record, index, table share): {full}"
        );
        for i in (0..4_000).rev() {
            w[0].apply_removed(0, &[ehash(1, i)]).unwrap();
        }
        check(&w);
        assert_eq!(ix.entries(), 0);
        let after = w[0].memory_bytes();
        assert!(
            after - ix.table_bytes() <= 4_096,
            "maps trimmed: {after} (empty {empty})"
        );
    }

    /// Harness self-test: a broken answer (the hole ignored) is caught by the comparison.
    #[test]
    fn harness_detects_an_ignored_hole() {
        let mut r = ReferenceEventIndex::new();
        let (_, mut w) = EventIndex::new(&cfg(1));
        store(&mut w, &mut r, 0, 1, 0, 10);
        r.removed(0, &[ehash(1, 3)]);
        let keys = block_keys(&tokens(1, 0, 10), BS);
        assert_ne!(r.find_matches(&keys), vec![(0, 10)]);
    }

    /// Readers on 2 threads while a writer applies stores and removals: every answer is a
    /// plausible state (a prefix of some sequence), and after quiescence the index equals the
    /// reference at every prompt length, although the readers left remembered answers of
    /// states long gone (the shared memory is verified, never trusted). Bounded: 2,000
    /// writer ops.
    #[test]
    fn concurrent_readers_and_writer() {
        let (ix, mut w) = EventIndex::new(&cfg(64));
        let stop = std::sync::atomic::AtomicBool::new(false);
        let mut r = ReferenceEventIndex::new();
        std::thread::scope(|s| {
            for _ in 0..2 {
                let ix = ix.clone();
                let stop = &stop;
                s.spawn(move || {
                    let keys = block_keys(&tokens(3, 0, 64), BS);
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) && n < 5_000_000 {
                        for &(_, d) in &ix.find_matches(&keys).0 {
                            assert!(d as usize <= keys.len());
                        }
                        let d = ix.find_depths(&keys[..48]);
                        assert!(d.runs().iter().all(|r| r.0 <= 48));
                        n += 1;
                    }
                });
            }
            for i in 0..2_000usize {
                let wk = (i % 64) as TenantId;
                if i % 3 == 2 {
                    w[0].apply_removed(wk, &[ehash(3, (i * 7) % 64)]).unwrap();
                    r.removed(wk, &[ehash(3, (i * 7) % 64)]);
                } else {
                    store(&mut w, &mut r, wk, 3, 0, 1 + i % 64);
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        check(&w);
        let keys = block_keys(&tokens(3, 0, 64), BS);
        for n in 1..=keys.len() {
            let want = r.find_matches(&keys[..n]);
            assert_eq!(ix.find_depths(&keys[..n]).overlap().0, want, "{n} blocks");
            assert_eq!(ix.find_matches(&keys[..n]).0, want, "{n} blocks");
        }
    }

    /// A `BlockRemoved` that removes nothing (unknown hashes, blocks of a worker that holds
    /// none, a copy the caller keeps) returns without the table lock every shard's writer
    /// shares: it completes while the test holds that lock (before the fix, it waited).
    #[test]
    fn a_removal_that_removes_nothing_takes_no_lock() {
        let (ix, mut w) = EventIndex::new(&cfg(1));
        let mut r = ReferenceEventIndex::new();
        store(&mut w, &mut r, 0, 1, 0, 4);
        let table = Arc::clone(&w[0].table);
        let held = lock(&table);
        let (tx, rx) = std::sync::mpsc::channel();
        let w0 = &mut w[0];
        std::thread::scope(|s| {
            s.spawn(move || {
                w0.apply_removed(0, &[ehash(7, 0), ehash(7, 1)]).unwrap();
                w0.apply_removed(1, &[ehash(1, 3)]).unwrap();
                let mut asked = Vec::new();
                w0.apply_removed_if(0, &[ehash(7, 0), ehash(1, 3)], |i, h| {
                    asked.push((i, h));
                    false
                })
                .unwrap();
                tx.send(asked).unwrap();
            });
            let done = rx.recv_timeout(std::time::Duration::from_secs(5));
            drop(held);
            assert_eq!(done, Ok(vec![(0, false), (1, true)]));
        });
        check(&w);
        assert_eq!(ix.entries(), 4);
        assert_eq!(
            ix.find_matches(&block_keys(&tokens(1, 0, 4), BS)).blocks(0),
            4
        );
    }

    /// Removing an interior block leaves a ghost: not held, not an entry, a hole for the
    /// worker; re-storing revives the same record with its children; removing its last held
    /// child frees it, and the next store reuses the freed records.
    #[test]
    fn ghosts_hold_holes_and_are_freed() {
        let (ix, mut w) = EventIndex::new(&cfg(1));
        let mut r = ReferenceEventIndex::new();
        store(&mut w, &mut r, 0, 1, 0, 10);
        let keys = block_keys(&tokens(1, 0, 10), BS);
        w[0].apply_removed(0, &[ehash(1, 5)]).unwrap();
        check(&w);
        assert!(!w[0].holds(0, ehash(1, 5)));
        assert!(w[0].holds(0, ehash(1, 6)));
        assert_eq!(w[0].counts(0).0..w[0].counts(0).2, 9..w[0].counts(0).2);
        assert_eq!(w[0].counts(0).1, 1, "block 5 is a ghost");
        assert_eq!(ix.entries(), 9);
        assert_eq!(ix.shared.holey[0].load(Ordering::Relaxed), 1);
        assert_eq!(ix.find_matches(&keys).blocks(0), 5);
        // A store under the ghost is an unknown parent.
        assert!(
            w[0].apply_stored(0, 0, Some(ehash(1, 5)), &[ehash(9, 0)], &tokens(9, 0, 1), 0)
                .is_err()
        );
        // Revival: same record, children re-attached, no hole.
        let idx = w[0].workers[0]
            .as_ref()
            .unwrap()
            .held_idx(ehash(1, 6))
            .unwrap();
        w[0].apply_stored(0, 0, Some(ehash(1, 4)), &[ehash(1, 5)], &tokens(1, 5, 1), 0)
            .unwrap();
        check(&w);
        assert_eq!(w[0].counts(0).1, 0);
        assert_eq!(ix.shared.holey[0].load(Ordering::Relaxed), 0);
        assert_eq!(ix.find_matches(&keys).blocks(0), 10);
        assert_eq!(
            w[0].workers[0].as_ref().unwrap().held_idx(ehash(1, 6)),
            Some(idx)
        );
        // Punch 5 again, then remove 6..10 child-first: 6 is 5's only child, so 5 is freed
        // with it; the worker is whole again (0..5 held).
        w[0].apply_removed(0, &[ehash(1, 5)]).unwrap();
        r.removed(0, &[ehash(1, 5)]);
        let tail: Vec<u64> = (6..10).rev().map(|i| ehash(1, i)).collect();
        w[0].apply_removed(0, &tail).unwrap();
        r.removed(0, &tail);
        check(&w);
        assert_eq!(w[0].counts(0).0, 5);
        assert_eq!(w[0].counts(0).1, 0, "the ghost went with its last child");
        assert_eq!(ix.shared.holey[0].load(Ordering::Relaxed), 0);
        assert_eq!(ix.find_matches(&keys).0, r.find_matches(&keys));
        // Parent-first removal of 0..5: each removed block is a ghost until its child goes.
        let head: Vec<u64> = (0..5).map(|i| ehash(1, i)).collect();
        w[0].apply_removed(0, &head[..3]).unwrap();
        check(&w);
        assert_eq!(w[0].counts(0), (2, 1, w[0].counts(0).2, w[0].counts(0).3));
        w[0].apply_removed(0, &head[3..]).unwrap();
        check(&w);
        assert!(w[0].workers[0].is_none(), "no record left: state freed");
        assert_eq!(ix.entries(), 0);
        // Free records are reused: 10 blocks again fit the same slab.
        store(&mut w, &mut r, 0, 2, 0, 10);
        check(&w);
        assert_eq!(w[0].counts(0).0, 10);
    }

    /// A block with more than 254 held children spills its count to the side map and back.
    #[test]
    fn child_counts_spill_exactly() {
        let (ix, mut w) = EventIndex::new(&cfg(1));
        let root = tokens(1, 0, 1);
        w[0].apply_stored(0, 0, None, &[7], &root, 0).unwrap();
        for c in 0..300u32 {
            w[0].apply_stored(0, 0, Some(7), &[1_000 + c as u64], &tokens(2 + c, 1, 1), 0)
                .unwrap();
        }
        check(&w);
        let st = w[0].workers[0].as_ref().unwrap();
        let idx = st.held_idx(7).unwrap();
        assert_eq!(st.children(idx), 300);
        assert_eq!(st.overflow.len(), 1);
        // Removing the root leaves a ghost with 300 orphans.
        w[0].apply_removed(0, &[7]).unwrap();
        check(&w);
        assert_eq!(w[0].workers[0].as_ref().unwrap().orphans, 300);
        assert_eq!(ix.shared.holey[0].load(Ordering::Relaxed), 1);
        let hs: Vec<u64> = (0..299).map(|c| 1_000 + c).collect();
        w[0].apply_removed(0, &hs).unwrap();
        check(&w);
        let st = w[0].workers[0].as_ref().unwrap();
        assert_eq!(st.orphans, 1);
        assert!(st.overflow.is_empty(), "back under 255: no spill");
        w[0].apply_removed(0, &[1_299]).unwrap();
        check(&w);
        assert!(w[0].workers[0].is_none());
        assert_eq!(ix.shared.holey[0].load(Ordering::Relaxed), 0);
    }

    /// Churn (store 2,000 blocks, remove them, 30 times over) reuses slab records and
    /// table tombstones: memory stays at the first round's level.
    #[test]
    fn churn_keeps_memory_flat() {
        let _serial = crate::table::EPOCH_TESTS
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (ix, mut w) = EventIndex::new(&cfg(2));
        let mut r = ReferenceEventIndex::new();
        let mut first = 0;
        for round in 0..30u32 {
            store(&mut w, &mut r, 1, round, 0, 1_000);
            store(&mut w, &mut r, 0, round + 100, 0, 1_000);
            // Remove in eviction order (oldest = root first), one batch of 100 at a time.
            for c in 0..10 {
                let hs: Vec<u64> = (c * 100..(c + 1) * 100).map(|i| ehash(round, i)).collect();
                w[0].apply_removed(1, &hs).unwrap();
                r.removed(1, &hs);
            }
            // Keep worker 0's blocks of this round, drop the previous round's.
            if round > 0 {
                let hs: Vec<u64> = (0..1_000).map(|i| ehash(round + 99, i)).collect();
                w[0].apply_removed(0, &hs).unwrap();
                r.removed(0, &hs);
            }
            check(&w);
            assert_eq!(ix.entries(), 1_000);
            if round == 1 {
                first = w[0].memory_bytes();
            }
        }
        let last = w[0].memory_bytes();
        assert!(last <= first * 5 / 4, "{last} vs {first}");
        let keys = block_keys(&tokens(129, 0, 1_000), BS);
        assert_eq!(ix.find_matches(&keys).0, vec![(0, 1_000)]);
        // Worker 0 peaks at 2,000 blocks each round: its slab and index keep that size (a
        // slab shrinks below 1/4 full), 16 B + 4 B / load per block.
        let records = last - ix.table_bytes();
        let side = lock(&w[0].table).memory_bytes();
        assert!(
            records <= 2_000 * 24,
            "{records}: {:?} side {side}",
            w[0].counts(0)
        );
    }

    /// Touch stamps exist only when the index prunes (no memory for them otherwise); a
    /// duplicate store refreshes a block's stamp and a ghost's revival stamps it anew.
    #[test]
    fn stamps_only_when_pruning() {
        let (_, mut w) = EventIndex::new(&cfg(1));
        w[0].apply_stored(0, 0, None, &[1, 2], &tokens(1, 0, 2), 5_000)
            .unwrap();
        let st = w[0].workers[0].as_ref().unwrap();
        assert_eq!(st.stamps.capacity(), 0);
        assert_eq!(w[0].prune(1 << 40), 0, "nothing to prune without bounds");
        let (ix, mut w) = EventIndex::new(&EventIndexConfig {
            ttl_ms: Some(10_000),
            ..cfg(1)
        });
        w[0].apply_stored(0, 0, None, &[1, 2], &tokens(1, 0, 2), 0)
            .unwrap();
        w[0].apply_stored(0, 0, None, &[1], &tokens(1, 0, 1), 8_000)
            .unwrap();
        assert_eq!(w[0].workers[0].as_ref().unwrap().stamps.len(), 2);
        // At 15 s: block 2 (touched at 0 s) is 15 s old, block 1 (touched at 8 s) 7 s.
        assert_eq!(w[0].prune(15_000), 1);
        assert!(w[0].holds(0, 1) && !w[0].holds(0, 2));
        check(&w);
        // Remove 1 with a child held: ghost; revive at 40 s; TTL counts from the revival.
        w[0].apply_stored(0, 0, Some(1), &[3], &tokens(1, 1, 1), 30_000)
            .unwrap();
        w[0].apply_removed(0, &[1]).unwrap();
        w[0].apply_stored(0, 0, None, &[1], &tokens(1, 0, 1), 40_000)
            .unwrap();
        check(&w);
        assert_eq!(w[0].prune(45_000), 1, "block 3, touched at 30 s, goes");
        assert!(w[0].holds(0, 1));
        assert_eq!(ix.entries(), 1);
        check(&w);
    }

    /// A shard that stays idle while another shard's stores rebuild the shared table many
    /// times applies the slot maps later: its removals clear exactly its own bits.
    #[test]
    fn idle_shard_catches_up_on_table_rebuilds() {
        let (ix, mut w) = EventIndex::new(&cfg(128));
        let mut r = ReferenceEventIndex::new();
        store(&mut w, &mut r, 64, 1, 0, 50);
        store(&mut w, &mut r, 0, 1, 0, 50);
        let before = lock(&w[0].table).table.live();
        for s in 2..40 {
            store(&mut w, &mut r, 0, s, 0, 200);
        }
        assert!(lock(&w[0].table).remaps.len() > 3, "maps wait for shard 1");
        assert!(lock(&w[0].table).table.live() > before);
        for x in &w[..1] {
            assert_eq!(x.check_invariants(), Ok(()));
        }
        let hs: Vec<u64> = (25..50).map(|i| ehash(1, i)).collect();
        w[1].apply_removed(64, &hs).unwrap();
        r.removed(64, &hs);
        check(&w);
        assert!(
            lock(&w[0].table).remaps.is_empty(),
            "every shard applied every map"
        );
        let keys = block_keys(&tokens(1, 0, 50), BS);
        assert_eq!(ix.find_matches(&keys).0, vec![(0, 50), (64, 25)]);
        assert_eq!(ix.find_matches(&keys).0, r.find_matches(&keys));
    }

    /// The per-thread scratch is reused across indexes of different widths and never leaks
    /// one query's depths into the next.
    #[test]
    fn scratch_reuse_across_widths() {
        let (a, mut wa) = EventIndex::new(&cfg(256));
        let (b, mut wb) = EventIndex::new(&cfg(8));
        let (mut ra, mut rb) = (ReferenceEventIndex::new(), ReferenceEventIndex::new());
        for wk in 0..256u32 {
            store(&mut wa, &mut ra, wk, wk % 3, 0, 1 + (wk as usize * 7) % 60);
        }
        for wk in 0..8u32 {
            store(&mut wb, &mut rb, wk, wk % 3, 0, 1 + (wk as usize * 5) % 60);
        }
        wb[0].apply_removed(3, &[ehash(0, 2)]).unwrap();
        rb.removed(3, &[ehash(0, 2)]);
        for _ in 0..3 {
            for s in 0..3 {
                for n in [1, 2, 33, 64] {
                    let keys = block_keys(&tokens(s, 0, n), BS);
                    assert_eq!(a.find_matches(&keys).0, ra.find_matches(&keys));
                    assert_eq!(b.find_matches(&keys).0, rb.find_matches(&keys));
                }
            }
        }
    }
}
