//! Exact positional index fed by engine KV events: which worker holds how many consecutive
//! leading blocks of a request.
//!
//! One lock-free table maps `block key → worker bitset` (bit `w % 64` of word `w / 64`;
//! ⌈max_workers / 64⌉ words per key; readers never lock nor wait, see `table`). Workers are
//! split into shards of [`SHARD_WORKERS`] (64) dense ids, each with exactly one
//! [`EventWriter`] that applies that shard's events in order and owns one word of every
//! bitset. The writers share the table's single-writer side through a writer-only mutex,
//! taken once per event (not per block); readers never see it. [`EventIndex`] is the cheap,
//! cloneable read handle used by every gateway shard.
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
//! Matching: a worker whose held blocks are *prefix-closed* (every held block's parent is
//! held — true unless a removal punched a hole) holds block `i` of a chain only if it holds
//! every block before it, so "holds block i" is monotone in `i`. For those workers
//! [`EventIndex::find_matches`] jumps [`JUMP`] blocks at a time and bisects where a worker
//! drops out: O(len/32 + drops × log 32) probes per shard instead of one per block (Dynamo's
//! positional jump search, anchors §3.4). A worker with holes (counted exactly by the writer)
//! is scanned block by block, so a hole always truncates its match.

use crate::keys::chain;
use crate::table::{SharedTable, TableWriter};
use crate::{IndexError, Namespace, TenantId};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Workers per shard: one 64-bit worker set per block key.
pub const SHARD_WORKERS: usize = 64;

/// Blocks skipped per probe of the jump search. Source: Dynamo positional index (jump search);
/// 32 measured best of {8, 16, 32, 64} at 8k tokens in `kvroute bench index`.
pub const JUMP: usize = 32;

/// Settings of an [`EventIndex`] (one per model).
#[derive(Clone, Debug, PartialEq)]
pub struct EventIndexConfig {
    /// Tokens per block of the events' `token_ids` (engine block size), tokens.
    pub block_size: usize,
    /// Largest worker id + 1 the index must hold; shards = ⌈max_workers / 64⌉.
    pub max_workers: usize,
    /// Entries untouched for this long are pruned by [`EventWriter::prune`], ms
    /// (`--kv-indexer-ttl-secs`; `None` = never).
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

/// Hasher for keys that are already hashes (engine block hashes): one multiply-xorshift.
#[derive(Default, Clone, Copy)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        let x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = x ^ (x >> 29);
    }
}

pub(crate) type MixMap<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;

/// Table key of block key `key` in namespace `ns`: `key ^ mix(ns)`, `mix(0) = 0`, so the
/// default namespace stores keys unchanged and the raw key is recoverable.
#[inline]
pub(crate) fn ns_mask(ns: Namespace) -> u64 {
    if ns == 0 {
        0
    } else {
        xxhash_rust::xxh3::xxh3_64(&ns.to_le_bytes()) | 1
    }
}

/// State shared by the read handle and every writer.
struct Shared {
    table: Arc<SharedTable>,
    /// Bit `w % 64` of word `w / 64` set when worker `w` holds a block whose parent it does
    /// not hold (written only by the shard `w / 64`'s writer).
    holey: Box<[AtomicU64]>,
    /// (worker, block) entries of each shard (gauge, one per writer).
    entries: Box<[AtomicUsize]>,
}

/// Read handle: cheap to clone, `Send + Sync`, lookups are lock-free.
#[derive(Clone)]
pub struct EventIndex {
    shared: Arc<Shared>,
    block_size: usize,
}

/// One held block of one worker.
#[derive(Clone, Copy, Debug)]
struct Rec {
    /// Table key (namespaced block key).
    key: u64,
    /// Engine hash of the parent block (valid when `has_parent`).
    parent: u64,
    /// Held blocks whose parent is this block.
    children: u32,
    /// Bit 31: has a parent; bits 0–30: last touch, seconds since the writer's epoch.
    meta: u32,
}

const HAS_PARENT: u32 = 1 << 31;

#[derive(Default)]
struct WorkerState {
    /// Engine hash → record, for held blocks.
    blocks: MixMap<u64, Rec>,
    /// Engine hash of a block *not* held → how many held blocks name it as parent.
    dangling: MixMap<u64, u32>,
    /// Σ `dangling` values: held blocks whose parent is not held.
    orphans: u64,
}

/// The single writer of one shard: applies that shard's workers' events in order.
///
/// # Invariants
/// 1. For every worker and held block, the table's worker set of the block's key has the
///    worker's bit; every set bit comes from a held block (no stale bits).
/// 2. `children` of a record = held blocks naming it as parent; `dangling[h]` = held blocks
///    naming the non-held `h` as parent; `orphans` = Σ `dangling`.
/// 3. The shared `holey` bit of a worker is set iff its `orphans` > 0.
/// 4. The shared `entries` gauge = Σ over workers of held blocks.
pub struct EventWriter {
    shard: usize,
    shared: Arc<Shared>,
    /// The table's single writer, shared by all shard writers (writers only; readers never
    /// touch this lock). Each writer only sets and clears bits of its own word.
    table: Arc<Mutex<TableWriter>>,
    workers: Vec<WorkerState>,
    block_size: usize,
    ttl_ms: Option<u64>,
    max_entries: Option<usize>,
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
        });
        let table = Arc::new(Mutex::new(table));
        for shard in 0..n {
            writers.push(EventWriter {
                shard,
                shared: Arc::clone(&shared),
                table: Arc::clone(&table),
                workers: (0..SHARD_WORKERS).map(|_| WorkerState::default()).collect(),
                block_size: cfg.block_size,
                ttl_ms: cfg.ttl_ms,
                max_entries: per_shard_cap,
                rejected: 0,
            });
        }
        (
            EventIndex {
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

    /// Table memory, bytes: slots allocated × 8 × (1 + ⌈max_workers / 64⌉). The writers'
    /// per-worker maps are counted by [`EventWriter::memory_bytes`].
    pub fn table_bytes(&self) -> usize {
        self.shared.table.memory_bytes()
    }

    /// Overlap of every worker with `keys` (lock-free; allocates the answer and one scratch
    /// buffer of O(words) words).
    ///
    /// `keys`: block keys of one request in namespace `ns`, in order ([`crate::keys`]).
    /// Returns each worker holding at least `keys[0]` with the number of consecutive leading
    /// blocks it holds; a hole truncates the match. Cost, in probes of the one table (each
    /// answering for every worker): O(len/32 + drop points × 5) for workers without holes,
    /// plus O(len) when a worker with holes holds `keys[0]`; then O(workers) to emit.
    pub fn find_matches(&self, ns: Namespace, keys: &[u64]) -> Overlap {
        if keys.is_empty() {
            return Overlap::default();
        }
        let mask = ns_mask(ns);
        let table = &self.shared.table;
        let nw = table.words();
        let guard = crossbeam_epoch::pin();
        // Scratch: first, active, row, dropped, holey, then 2 words-sets per bisect level.
        let mut buf = vec![0u64; nw * (5 + 2 * BISECT_LEVELS)];
        let (first, rest) = buf.split_at_mut(nw);
        if !table.get_into(keys[0] ^ mask, &guard, first) {
            return Overlap::default();
        }
        let (active, rest) = rest.split_at_mut(nw);
        let (row, rest) = rest.split_at_mut(nw);
        let (dropped, rest) = rest.split_at_mut(nw);
        let (holey, scratch) = rest.split_at_mut(nw);
        let probe = |i: usize, out: &mut [u64]| {
            table.get_into(keys[i] ^ mask, &guard, out);
        };
        let mut any_holey = 0;
        for (w, h) in holey.iter_mut().enumerate() {
            *h = self.shared.holey[w].load(Ordering::Acquire) & first[w];
            any_holey |= *h;
        }
        let mut depth = vec![0u32; nw * 64];
        // Workers with holes: block by block.
        if any_holey != 0 {
            active.copy_from_slice(holey);
            let mut i = 1;
            while i < keys.len() {
                probe(i, row);
                let mut live = 0;
                for w in 0..nw {
                    let h = row[w] & active[w];
                    set_depth(&mut depth[w * 64..], active[w] & !h, i as u32);
                    active[w] = h;
                    live |= h;
                }
                if live == 0 {
                    break;
                }
                i += 1;
            }
            for (w, &a) in active.iter().enumerate() {
                set_depth(&mut depth[w * 64..], a, keys.len() as u32);
            }
        }
        // Prefix-closed workers: jump and bisect.
        let mut live = 0;
        for w in 0..nw {
            active[w] = first[w] & !holey[w];
            live |= active[w];
        }
        let mut lo = 0usize;
        while live != 0 && lo + 1 < keys.len() {
            let hi = (lo + JUMP).min(keys.len() - 1);
            probe(hi, row);
            let mut any_drop = 0;
            live = 0;
            for w in 0..nw {
                let h = row[w] & active[w];
                dropped[w] = active[w] & !h;
                any_drop |= dropped[w];
                active[w] = h;
                live |= h;
            }
            if any_drop != 0 {
                bisect(&probe, &mut depth, lo, hi, dropped, scratch);
            }
            lo = hi;
        }
        for (w, &a) in active.iter().enumerate() {
            set_depth(&mut depth[w * 64..], a, keys.len() as u32);
        }
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

    /// [`Self::find_matches`] on raw token ids: keys of every full block of `tokens`.
    pub fn find_matches_tokens(&self, ns: Namespace, tokens: &[u32]) -> Overlap {
        self.find_matches(ns, &crate::keys::block_keys(tokens, self.block_size))
    }
}

/// Levels of [`bisect`] recursion: log2([`JUMP`]) + 1.
const BISECT_LEVELS: usize = JUMP.trailing_zeros() as usize + 1;

/// Sets `depth[b] = d` for every bit `b` of `set` (`depth` starts at the word's worker 0).
#[inline]
fn set_depth(depth: &mut [u32], mut set: u64, d: u32) {
    while set != 0 {
        let b = set.trailing_zeros() as usize;
        depth[b] = d;
        set &= set - 1;
    }
}

/// Every worker in `set` (a bitset of `set.len()` words) holds block `lo` and not block `hi`:
/// finds each one's first missing block by bisection, probing once per step for the whole
/// set. `scratch` holds 2 × `set.len()` words per remaining level.
fn bisect(
    probe: &impl Fn(usize, &mut [u64]),
    depth: &mut [u32],
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
            set_depth(&mut depth[w * 64..], x, hi as u32);
        }
        return;
    }
    let mid = lo + (hi - lo) / 2;
    let (held, rest) = scratch.split_at_mut(nw);
    let (gone, rest) = rest.split_at_mut(nw);
    probe(mid, held);
    for w in 0..nw {
        held[w] &= set[w];
        gone[w] = set[w] & !held[w];
    }
    bisect(probe, depth, lo, mid, gone, rest);
    bisect(probe, depth, mid, hi, held, rest);
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

    /// Publishes worker `b`'s holey bit and trims its maps' spare capacity: hash maps
    /// never shrink on removal, so a burst of holes (the `dangling` map) or a cleared worker
    /// would otherwise keep its peak memory forever. Shrinking at < ¼ full keeps the cost
    /// amortised O(1) per removal.
    fn sync_flags(&mut self, b: usize) {
        let st = &mut self.workers[b];
        if st.dangling.capacity() > 4 * st.dangling.len() + 16 {
            st.dangling.shrink_to(st.dangling.len() * 2);
        }
        if st.blocks.capacity() > 4 * st.blocks.len() + 64 {
            st.blocks.shrink_to(st.blocks.len() * 2);
        }
        let holey = self.workers[b].orphans > 0;
        let m = 1u64 << b;
        if holey {
            self.shared.holey[self.shard].fetch_or(m, Ordering::Release);
        } else {
            self.shared.holey[self.shard].fetch_and(!m, Ordering::Release);
        }
    }

    fn set_entries(&self) {
        let n = self.workers.iter().map(|w| w.blocks.len()).sum();
        self.shared.entries[self.shard].store(n, Ordering::Relaxed);
    }

    /// `BlockStored`: worker `worker` cached the blocks `engine_hashes` (in order; block `i`'s
    /// parent is block `i−1`, block 0's is `parent`, `None` at sequence start) whose tokens
    /// are `token_ids` (`block_size` per block), in namespace `ns`, at `now_ms`. Keys are
    /// chained from the parent's key. Blocks already held are only touched (duplicate stores
    /// are no-ops).
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
        let b = self.bit(worker)?;
        if token_ids.len() != engine_hashes.len() * self.block_size {
            return Err(IndexError::BlockSizeMismatch {
                tokens: token_ids.len(),
                blocks: engine_hashes.len(),
                block_size: self.block_size,
            });
        }
        let mask = ns_mask(ns);
        let st = &self.workers[b];
        let mut prev_key = match parent {
            None => None,
            Some(p) => match st.blocks.get(&p) {
                Some(r) => Some(r.key ^ mask),
                None => {
                    self.rejected += 1;
                    return Err(IndexError::UnknownParent { worker, parent: p });
                }
            },
        };
        let now = touch_stamp(now_ms);
        let mut prev_hash = parent;
        let table = Arc::clone(&self.table);
        let mut table = lock(&table);
        for (i, &eh) in engine_hashes.iter().enumerate() {
            let local =
                crate::keys::local_hash(&token_ids[i * self.block_size..][..self.block_size]);
            let key = chain(prev_key, local);
            prev_key = Some(key);
            self.store_one(&mut table, b, eh, key ^ mask, prev_hash, now);
            prev_hash = Some(eh);
        }
        self.sync_flags(b);
        self.set_entries();
        Ok(())
    }

    fn store_one(
        &mut self,
        table: &mut TableWriter,
        b: usize,
        eh: u64,
        key: u64,
        parent: Option<u64>,
        now: u32,
    ) {
        let st = &mut self.workers[b];
        if let Some(r) = st.blocks.get_mut(&eh) {
            r.meta = (r.meta & HAS_PARENT) | now;
            return;
        }
        let children = st.dangling.remove(&eh).unwrap_or(0);
        st.orphans -= children as u64;
        let mut meta = now;
        if let Some(p) = parent {
            meta |= HAS_PARENT;
            match st.blocks.get_mut(&p) {
                Some(pr) => pr.children += 1,
                None => {
                    *st.dangling.entry(p).or_insert(0) += 1;
                    st.orphans += 1;
                }
            }
        }
        st.blocks.insert(
            eh,
            Rec {
                key,
                parent: parent.unwrap_or(0),
                children,
                meta,
            },
        );
        table.set_bit(key, self.shard * SHARD_WORKERS + b, true);
    }

    /// `BlockRemoved`: worker `worker` evicted `engine_hashes`. Unknown hashes are ignored
    /// (non-fatal, anchors §3.4). Removing a block whose children are still held leaves a
    /// hole: those children stop counting until the block is stored again.
    ///
    /// # Errors
    /// [`IndexError::WrongShard`]: `worker` is not in this writer's shard.
    pub fn apply_removed(
        &mut self,
        worker: TenantId,
        engine_hashes: &[u64],
    ) -> Result<(), IndexError> {
        let b = self.bit(worker)?;
        let table = Arc::clone(&self.table);
        let mut table = lock(&table);
        for &eh in engine_hashes {
            self.remove_one(&mut table, b, eh);
        }
        self.sync_flags(b);
        self.set_entries();
        Ok(())
    }

    fn remove_one(&mut self, table: &mut TableWriter, b: usize, eh: u64) {
        let st = &mut self.workers[b];
        let Some(r) = st.blocks.remove(&eh) else {
            return;
        };
        if r.children > 0 {
            st.dangling.insert(eh, r.children);
            st.orphans += r.children as u64;
        }
        if r.meta & HAS_PARENT != 0 {
            match st.blocks.get_mut(&r.parent) {
                Some(pr) => pr.children -= 1,
                None => {
                    let d = st.dangling.get_mut(&r.parent).expect("orphan counted");
                    *d -= 1;
                    if *d == 0 {
                        st.dangling.remove(&r.parent);
                    }
                    st.orphans -= 1;
                }
            }
        }
        table.set_bit(r.key, self.shard * SHARD_WORKERS + b, false);
    }

    /// `AllBlocksCleared`: worker `worker` dropped every block.
    ///
    /// # Errors
    /// [`IndexError::WrongShard`]: `worker` is not in this writer's shard.
    pub fn apply_cleared(&mut self, worker: TenantId) -> Result<(), IndexError> {
        let b = self.bit(worker)?;
        let st = std::mem::take(&mut self.workers[b]);
        let mut table = lock(&self.table);
        for r in st.blocks.values() {
            table.set_bit(r.key, self.shard * SHARD_WORKERS + b, false);
        }
        drop(table);
        self.sync_flags(b);
        self.set_entries();
        Ok(())
    }

    /// The worker left the fleet: same as [`Self::apply_cleared`], and frees its maps.
    ///
    /// # Errors
    /// [`IndexError::WrongShard`]: `worker` is not in this writer's shard.
    pub fn remove_worker(&mut self, worker: TenantId) -> Result<(), IndexError> {
        self.apply_cleared(worker)
    }

    /// Applies the optional bounds at `now_ms`: drops entries untouched for `ttl_ms`, then,
    /// if the shard holds more than its share of `max_entries`, the least-recently-touched
    /// down to 90 % of the share (SMG). Returns the entries dropped. Cost O(entries of the
    /// shard); meant to run every 30 s (SMG), not per event.
    pub fn prune(&mut self, now_ms: u64) -> usize {
        let now = touch_stamp(now_ms);
        let mut victims: Vec<(u32, usize, u64)> = Vec::new();
        let ttl_s = self.ttl_ms.map(|t| (t / 1000) as u32);
        let mut kept: Vec<(u32, usize, u64)> = Vec::new();
        for (b, st) in self.workers.iter().enumerate() {
            for (&eh, r) in &st.blocks {
                let t = r.meta & !HAS_PARENT;
                match ttl_s {
                    Some(ttl) if now.saturating_sub(t) > ttl => victims.push((t, b, eh)),
                    _ => kept.push((t, b, eh)),
                }
            }
        }
        if let Some(cap) = self.max_entries
            && kept.len() > cap
        {
            let target = cap * 9 / 10;
            let cut = kept.len() - target;
            kept.select_nth_unstable(cut - 1);
            victims.extend_from_slice(&kept[..cut]);
        }
        // Children before parents where stamps tie, so a pruned chain leaves no holes.
        victims.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.2.cmp(&a.2)));
        let n = victims.len();
        let mut touched = 0u64;
        let table = Arc::clone(&self.table);
        let mut table = lock(&table);
        for (_, b, eh) in victims {
            self.remove_one(&mut table, b, eh);
            touched |= 1 << b;
        }
        for b in 0..SHARD_WORKERS {
            if touched & (1 << b) != 0 {
                self.sync_flags(b);
            }
        }
        self.set_entries();
        n
    }

    /// Memory of this shard, bytes: its equal share of the one table (slots allocated ×
    /// 8 × (1 + words), divided by the number of writers, so the writers' sum is the whole
    /// table) and its per-worker maps (capacity × (entry + 1 control byte)).
    pub fn memory_bytes(&self) -> usize {
        let rec = std::mem::size_of::<(u64, Rec)>() + 1;
        let dang = std::mem::size_of::<(u64, u32)>() + 1;
        self.shared.table.memory_bytes() / self.shared.holey.len()
            + self
                .workers
                .iter()
                .map(|w| w.blocks.capacity() * rec + w.dangling.capacity() * dang)
                .sum::<usize>()
    }

    /// True iff `worker` holds the block with engine hash `engine_hash` now (false for an
    /// unknown hash or a worker of another shard).
    pub fn holds(&self, worker: TenantId, engine_hash: u64) -> bool {
        self.bit(worker)
            .is_ok_and(|b| self.workers[b].blocks.contains_key(&engine_hash))
    }

    /// Engine hashes of the blocks `worker` holds, any order (empty for another shard).
    pub fn engine_hashes(&self, worker: TenantId) -> Vec<u64> {
        self.bit(worker).map_or_else(
            |_| Vec::new(),
            |b| self.workers[b].blocks.keys().copied().collect(),
        )
    }

    /// Blocks held by `worker` (0 when not in this shard).
    pub fn worker_blocks(&self, worker: TenantId) -> usize {
        self.bit(worker).map_or(0, |b| self.workers[b].blocks.len())
    }

    /// Checks invariants 1–4 of [`EventWriter`].
    ///
    /// # Errors
    /// [`IndexError::Invariant`] with the invariant's number (node = worker bit or 0).
    #[cfg(any(test, feature = "test-util"))]
    pub fn check_invariants(&self) -> Result<(), IndexError> {
        let bad = |number: u8, node: usize| {
            Err(IndexError::Invariant {
                number,
                node: node as u32,
            })
        };
        let mut want: HashMap<u64, u64> = HashMap::new();
        for (b, st) in self.workers.iter().enumerate() {
            let mut children: HashMap<u64, u32> = HashMap::new();
            for r in st.blocks.values() {
                *want.entry(r.key).or_default() |= 1 << b;
                if r.meta & HAS_PARENT != 0 {
                    *children.entry(r.parent).or_default() += 1;
                }
            }
            let mut orphans = 0u64;
            for (h, &c) in &children {
                match st.blocks.get(h) {
                    Some(r) if r.children == c => {}
                    Some(_) => return bad(2, b),
                    None => {
                        if st.dangling.get(h) != Some(&c) {
                            return bad(2, b);
                        }
                        orphans += c as u64;
                    }
                }
            }
            for (h, r) in &st.blocks {
                if r.children != children.get(h).copied().unwrap_or(0) {
                    return bad(2, b);
                }
            }
            if orphans != st.orphans
                || st.dangling.len()
                    != children
                        .keys()
                        .filter(|h| !st.blocks.contains_key(h))
                        .count()
            {
                return bad(2, b);
            }
            let flag = self.shared.holey[self.shard].load(Ordering::Relaxed) & (1 << b) != 0;
            if flag != (st.orphans > 0) {
                return bad(3, b);
            }
        }
        let got: HashMap<u64, u64> = lock(&self.table)
            .entries()
            .into_iter()
            .map(|(k, w)| (k, w[self.shard]))
            .filter(|&(_, w)| w != 0)
            .collect();
        let want: HashMap<u64, u64> = want
            .into_iter()
            .map(|(k, v)| (if k == 0 { crate::table::ZERO_KEY } else { k }, v))
            .collect();
        if got != want {
            return bad(1, 0);
        }
        let n: usize = self.workers.iter().map(|w| w.blocks.len()).sum();
        if n != self.shared.entries[self.shard].load(Ordering::Relaxed) {
            return bad(4, 0);
        }
        Ok(())
    }
}

/// Locks the shared table writer. A writer that panicked mid-update leaves at most one
/// bit stale (no torn structure: every table write is a single atomic store), so a
/// poisoned lock is taken over rather than propagated.
fn lock(t: &Mutex<TableWriter>) -> std::sync::MutexGuard<'_, TableWriter> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

/// Touch stamp: seconds of `now_ms`, 31 bits (wraps after 68 years).
fn touch_stamp(now_ms: u64) -> u32 {
    ((now_ms / 1000) as u32) & !HAS_PARENT
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{block_keys, local_hash};
    use crate::reference::ReferenceEventIndex;
    use proptest::prelude::*;

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
        let parent = from.checked_sub(1).map(|p| ehash(seq, p));
        let hs: Vec<u64> = (from..from + n).map(|i| ehash(seq, i)).collect();
        let toks = tokens(seq, from, n);
        let shard = worker as usize / SHARD_WORKERS;
        let got = w[shard].apply_stored(worker, 0, parent, &hs, &toks, 0);
        let blocks: Vec<(u64, u64)> = hs
            .iter()
            .zip(toks.chunks(BS))
            .map(|(&h, t)| (h, local_hash(t)))
            .collect();
        assert_eq!(got.is_ok(), r.stored(worker, parent, &blocks));
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
        assert_eq!(ix.find_matches(0, &keys).0, vec![(0, 5), (1, 40)]);
        assert_eq!(ix.find_matches(0, &keys).0, r.find_matches(&keys));
        // Re-storing the hole revives the tail.
        w[0].apply_stored(0, 0, Some(ehash(1, 4)), &[ehash(1, 5)], &tokens(1, 5, 1), 0)
            .unwrap();
        check(&w);
        assert_eq!(ix.find_matches(0, &keys).blocks(0), 40);
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
        Clear(TenantId),
        Match(u32, usize),
        Prune,
    }

    fn op() -> impl Strategy<Value = Op> {
        let w = prop_oneof![0..4u32, 62..70u32];
        prop_oneof![
            6 => (w.clone(), 0..5u32, 0..6usize, 1..40usize).prop_map(|(w, s, f, n)| Op::Store(w, s, f, n)),
            3 => (w.clone(), 0..5u32, 0..45usize).prop_map(|(w, s, i)| Op::Remove(w, s, i)),
            1 => w.prop_map(Op::Clear),
            5 => (0..5u32, 1..45usize).prop_map(|(s, n)| Op::Match(s, n)),
            1 => Just(Op::Prune),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Random interleavings (holes mid-chain, clears, removals of unknown blocks, TTL
        /// pruning, two shards) answer exactly like the brute-force reference.
        #[test]
        fn matches_reference(ops in prop::collection::vec(op(), 1..150)) {
            let (ix, mut w) = EventIndex::new(&EventIndexConfig { ttl_ms: Some(1_000_000), ..cfg(128) });
            let mut r = ReferenceEventIndex::new();
            let mut mismatches = 0;
            for op in &ops {
                match *op {
                    Op::Store(wk, s, f, n) => {
                        // Only from a held parent (or the root) so both accept or both reject.
                        store(&mut w, &mut r, wk, s, f, n);
                    }
                    Op::Remove(wk, s, i) => {
                        w[wk as usize / 64].apply_removed(wk, &[ehash(s, i)]).unwrap();
                        r.removed(wk, &[ehash(s, i)]);
                    }
                    Op::Clear(wk) => {
                        w[wk as usize / 64].apply_cleared(wk).unwrap();
                        r.cleared(wk);
                    }
                    Op::Match(s, n) => {
                        let keys = block_keys(&tokens(s, 0, n), BS);
                        if ix.find_matches(0, &keys).0 != r.find_matches(&keys) {
                            mismatches += 1;
                        }
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
                prop_assert_eq!(w[wk as usize / 64].worker_blocks(wk), r.worker_blocks(wk));
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
            "at least one 32-byte record per block: {full}"
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
    /// reference. Bounded: 2,000 writer ops.
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
                        for &(_, d) in &ix.find_matches(0, &keys).0 {
                            assert!(d as usize <= keys.len());
                        }
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
        assert_eq!(ix.find_matches(0, &keys).0, r.find_matches(&keys));
    }
}
