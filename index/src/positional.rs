//! Exact positional index fed by engine KV events: which worker holds how many consecutive
//! leading blocks of a request.
//!
//! Workers are split into shards of [`SHARD_WORKERS`] (64) dense ids. Each shard has one
//! lock-free table `block key → 64-bit worker set` (readers never lock nor wait, see
//! `table`) and exactly one [`EventWriter`], which applies that shard's events in order.
//! [`EventIndex`] is the cheap, cloneable read handle used by every gateway shard.
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

struct ShardShared {
    table: Arc<SharedTable<1>>,
    /// Bit `w % 64` set when worker `w` holds a block whose parent it does not hold.
    holey: AtomicU64,
    /// (worker, block) entries in this shard (gauge).
    entries: AtomicUsize,
}

/// Read handle: cheap to clone, `Send + Sync`, lookups are lock-free.
#[derive(Clone)]
pub struct EventIndex {
    shards: Arc<[Arc<ShardShared>]>,
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
    shared: Arc<ShardShared>,
    table: TableWriter<1>,
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
        let mut shards = Vec::with_capacity(n);
        let mut writers = Vec::with_capacity(n);
        let per_shard_cap = cfg.max_entries.map(|m| m.div_ceil(n));
        for shard in 0..n {
            let table = TableWriter::new();
            let shared = Arc::new(ShardShared {
                table: table.shared(),
                holey: AtomicU64::new(0),
                entries: AtomicUsize::new(0),
            });
            shards.push(Arc::clone(&shared));
            writers.push(EventWriter {
                shard,
                shared,
                table,
                workers: (0..SHARD_WORKERS).map(|_| WorkerState::default()).collect(),
                block_size: cfg.block_size,
                ttl_ms: cfg.ttl_ms,
                max_entries: per_shard_cap,
                rejected: 0,
            });
        }
        (
            EventIndex {
                shards: shards.into(),
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
        self.shards
            .iter()
            .map(|s| s.entries.load(Ordering::Relaxed))
            .sum()
    }

    /// Table memory, bytes (16 per slot); the writers' per-worker maps are counted by
    /// [`EventWriter::memory_bytes`].
    pub fn table_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.table.capacity() * 16).sum()
    }

    /// Whether any worker has a non-zero overlap with `keys` (no allocation beyond the
    /// answer; lock-free).
    ///
    /// `keys`: block keys of one request in namespace `ns`, in order ([`crate::keys`]).
    /// Returns each worker holding at least `keys[0]` with the number of consecutive leading
    /// blocks it holds; a hole truncates the match. Cost O(shards + len/32 + drops·5) probes
    /// for workers without holes, plus O(len) probes per shard with a holey worker in play.
    pub fn find_matches(&self, ns: Namespace, keys: &[u64]) -> Overlap {
        let mut out = Vec::new();
        if keys.is_empty() {
            return out_overlap(out);
        }
        let mask = ns_mask(ns);
        let guard = crossbeam_epoch::pin();
        for (s, shard) in self.shards.iter().enumerate() {
            let base = (s * SHARD_WORKERS) as TenantId;
            let probe = |i: usize| shard.table.get(keys[i] ^ mask, &guard)[0];
            let first = probe(0);
            if first == 0 {
                continue;
            }
            let holey = shard.holey.load(Ordering::Acquire) & first;
            let mut depth = [0u32; SHARD_WORKERS];
            // Workers with holes: block by block.
            if holey != 0 {
                let mut active = holey;
                let mut i = 1;
                while active != 0 && i < keys.len() {
                    let h = probe(i) & active;
                    set_depth(&mut depth, active & !h, i as u32);
                    active = h;
                    i += 1;
                }
                set_depth(&mut depth, active, keys.len() as u32);
            }
            // Prefix-closed workers: jump and bisect.
            let mut active = first & !holey;
            let mut lo = 0usize;
            while active != 0 && lo + 1 < keys.len() {
                let hi = (lo + JUMP).min(keys.len() - 1);
                let h = probe(hi) & active;
                let dropped = active & !h;
                if dropped != 0 {
                    bisect(&probe, &mut depth, lo, hi, dropped);
                }
                active = h;
                lo = hi;
            }
            set_depth(&mut depth, active, keys.len() as u32);
            for (b, &d) in depth.iter().enumerate() {
                if d > 0 {
                    out.push((base + b as TenantId, d));
                }
            }
        }
        out_overlap(out)
    }

    /// [`Self::find_matches`] on raw token ids: keys of every full block of `tokens`.
    pub fn find_matches_tokens(&self, ns: Namespace, tokens: &[u32]) -> Overlap {
        self.find_matches(ns, &crate::keys::block_keys(tokens, self.block_size))
    }
}

fn out_overlap(v: Vec<(TenantId, u32)>) -> Overlap {
    Overlap(v)
}

#[inline]
fn set_depth(depth: &mut [u32; SHARD_WORKERS], mut set: u64, d: u32) {
    while set != 0 {
        let b = set.trailing_zeros() as usize;
        depth[b] = d;
        set &= set - 1;
    }
}

/// Every worker in `set` holds block `lo` and not block `hi`: finds each one's first missing
/// block by bisection, probing once per step for the whole set.
fn bisect(
    probe: &impl Fn(usize) -> u64,
    depth: &mut [u32; SHARD_WORKERS],
    lo: usize,
    hi: usize,
    set: u64,
) {
    if set == 0 {
        return;
    }
    if hi == lo + 1 {
        set_depth(depth, set, hi as u32);
        return;
    }
    let mid = lo + (hi - lo) / 2;
    let h = probe(mid) & set;
    bisect(probe, depth, lo, mid, set & !h);
    bisect(probe, depth, mid, hi, h);
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

    fn sync_flags(&mut self, b: usize) {
        let holey = self.workers[b].orphans > 0;
        let m = 1u64 << b;
        if holey {
            self.shared.holey.fetch_or(m, Ordering::Release);
        } else {
            self.shared.holey.fetch_and(!m, Ordering::Release);
        }
    }

    fn set_entries(&self) {
        let n = self.workers.iter().map(|w| w.blocks.len()).sum();
        self.shared.entries.store(n, Ordering::Relaxed);
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
        for (i, &eh) in engine_hashes.iter().enumerate() {
            let local =
                crate::keys::local_hash(&token_ids[i * self.block_size..][..self.block_size]);
            let key = chain(prev_key, local);
            prev_key = Some(key);
            self.store_one(b, eh, key ^ mask, prev_hash, now);
            prev_hash = Some(eh);
        }
        self.sync_flags(b);
        self.set_entries();
        Ok(())
    }

    fn store_one(&mut self, b: usize, eh: u64, key: u64, parent: Option<u64>, now: u32) {
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
        self.table.update(key, |w| w[0] |= 1 << b);
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
        for &eh in engine_hashes {
            self.remove_one(b, eh);
        }
        self.sync_flags(b);
        self.set_entries();
        Ok(())
    }

    fn remove_one(&mut self, b: usize, eh: u64) {
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
        self.table.update(r.key, |w| w[0] &= !(1 << b));
    }

    /// `AllBlocksCleared`: worker `worker` dropped every block.
    ///
    /// # Errors
    /// [`IndexError::WrongShard`]: `worker` is not in this writer's shard.
    pub fn apply_cleared(&mut self, worker: TenantId) -> Result<(), IndexError> {
        let b = self.bit(worker)?;
        let st = std::mem::take(&mut self.workers[b]);
        for r in st.blocks.values() {
            self.table.update(r.key, |w| w[0] &= !(1 << b));
        }
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
        if let Some(cap) = self.max_entries {
            if kept.len() > cap {
                let target = cap * 9 / 10;
                let cut = kept.len() - target;
                kept.select_nth_unstable(cut - 1);
                victims.extend_from_slice(&kept[..cut]);
            }
        }
        // Children before parents where stamps tie, so a pruned chain leaves no holes.
        victims.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.2.cmp(&a.2)));
        let n = victims.len();
        let mut touched = 0u64;
        for (_, b, eh) in victims {
            self.remove_one(b, eh);
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

    /// Memory of this shard, bytes: the table (16 per slot) and the per-worker maps
    /// (capacity × (entry + 1 control byte)).
    pub fn memory_bytes(&self) -> usize {
        let rec = std::mem::size_of::<(u64, Rec)>() + 1;
        let dang = std::mem::size_of::<(u64, u32)>() + 1;
        self.shared.table.capacity() * 16
            + self
                .workers
                .iter()
                .map(|w| w.blocks.capacity() * rec + w.dangling.capacity() * dang)
                .sum::<usize>()
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
            let flag = self.shared.holey.load(Ordering::Relaxed) & (1 << b) != 0;
            if flag != (st.orphans > 0) {
                return bad(3, b);
            }
        }
        let got: HashMap<u64, u64> = self
            .table
            .entries()
            .into_iter()
            .map(|(k, w)| (k, w[0]))
            .collect();
        let want: HashMap<u64, u64> = want
            .into_iter()
            .map(|(k, v)| (if k == 0 { 0x9E37_79B9_7F4A_7C15 } else { k }, v))
            .collect();
        if got != want {
            return bad(1, 0);
        }
        let n: usize = self.workers.iter().map(|w| w.blocks.len()).sum();
        if n != self.shared.entries.load(Ordering::Relaxed) {
            return bad(4, 0);
        }
        Ok(())
    }
}

/// Touch stamp: seconds of `now_ms`, 31 bits (wraps after 68 years).
fn touch_stamp(now_ms: u64) -> u32 {
    ((now_ms / 1000) as u32) & !HAS_PARENT
}
