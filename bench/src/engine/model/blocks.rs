//! KV block manager: an active pool (refcounted), an inactive LRU pool of cached full blocks,
//! and free space. Source: `engine-model.md` §2, vLLM V1 `KVCacheManager` / `BlockPool`,
//! Dynamo mocker `KvManager`.
//!
//! Every cached block is one entry of one hash map (its refcount, and its node in the LRU
//! list while inactive); the LRU is an intrusive doubly linked list in a slab, so each
//! operation is one map lookup plus O(1) list work (vLLM's `FreeKVCacheBlockQueue` is the
//! same list).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::block_map::{BlockMap, Probe};

/// Opaque engine hash of one *full* block, chained over the whole prefix up to and including
/// the block. Deliberately unrelated to the router's own block keys (`engine-model.md` §1
/// `hash_algo`), so the router has to treat it as an opaque handle.
pub type BlockHash = u64;

/// Seed of [`hash_block`]: the ASCII bytes `kvengine`, so engine hashes differ from any
/// router hash over the same tokens.
const HASH_SEED: u64 = u64::from_be_bytes(*b"kvengine");

/// Tokens of a block [`hash_block`] hashes from a stack buffer (larger blocks allocate).
const STACK_BLOCK_TOKENS: usize = 64;

/// Hash of a full block: xxh3-64 over the parent hash (8 bytes LE, omitted at the root)
/// followed by the block's token ids (4 bytes LE each), seeded with `"kvengine"`.
/// `tokens` is exactly one block (`block_size` tokens). Deterministic across runs and
/// platforms. Source: vLLM chains `hash(parent, tokens, extra)`; the function is our own.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    fn fill(buf: &mut [u8], parent: Option<BlockHash>, tokens: &[u32]) -> usize {
        let mut n = 0;
        if let Some(p) = parent {
            buf[..8].copy_from_slice(&p.to_le_bytes());
            n = 8;
        }
        for t in tokens {
            buf[n..n + 4].copy_from_slice(&t.to_le_bytes());
            n += 4;
        }
        n
    }
    if tokens.len() <= STACK_BLOCK_TOKENS {
        let mut buf = [0u8; 8 + 4 * STACK_BLOCK_TOKENS];
        let n = fill(&mut buf, parent, tokens);
        xxh3_64_with_seed(&buf[..n], HASH_SEED)
    } else {
        let mut buf = vec![0u8; 8 + 4 * tokens.len()];
        let n = fill(&mut buf, parent, tokens);
        xxh3_64_with_seed(&buf[..n], HASH_SEED)
    }
}

/// Appends to `hashes` the chained hashes of the full blocks of `tokens` not yet hashed:
/// afterwards `hashes.len() == tokens.len() / block_size`. `hashes` must already hold the
/// hashes of a prefix of `tokens` (as returned by earlier calls).
pub fn extend_block_hashes(hashes: &mut Vec<BlockHash>, tokens: &[u32], block_size: usize) {
    let full = tokens.len() / block_size;
    hashes.reserve(full.saturating_sub(hashes.len()));
    while hashes.len() < full {
        let i = hashes.len();
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        hashes.push(hash_block(
            parent,
            &tokens[i * block_size..(i + 1) * block_size],
        ));
    }
}

/// A change to the set of cached full blocks, collected per step so a later stage can publish
/// them as KV events (`engine-model.md` §5, vLLM `BlockStored` / `BlockRemoved` /
/// `AllBlocksCleared`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockEvent {
    /// Consecutive blocks of one request became full and were inserted into the cache.
    /// `parent` is the block before `hashes[0]` in that request, `None` at sequence start
    /// (never 0). `token_ids` holds exactly those blocks' tokens
    /// (`hashes.len() × block_size` tokens).
    Stored {
        /// Hash of the block preceding the first stored block; `None` for a root store.
        parent: Option<BlockHash>,
        /// Hashes of the newly stored blocks, in sequence order.
        hashes: Vec<BlockHash>,
        /// Token ids of the stored blocks, concatenated.
        token_ids: Vec<u32>,
    },
    /// Cached blocks evicted from the inactive pool to make room (one hash per eviction).
    Removed {
        /// Hashes of the evicted blocks, in eviction order.
        hashes: Vec<BlockHash>,
    },
    /// Every cached block was dropped (`POST /reset_prefix_cache`).
    AllCleared,
}

/// Not enough free or evictable blocks for an allocation; nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfBlocks {
    /// Blocks asked for.
    pub requested: usize,
    /// Blocks that were free or evictable.
    pub available: usize,
}

/// Most blocks whose map and arena room [`BlockManager::new`] reserves up front.
const PRESIZE_MAX_BLOCKS: usize = 1 << 20;

/// Blocks of a request whose map positions are prefetched ahead of the one being looked up
/// ([`BlockMap::prefetch`]; [`BlockManager::prefetch`] for callers).
const LOOKAHEAD: usize = 8;

/// End of list / no slot.
const NIL: u32 = u32::MAX;

/// Slot of a cached full block in a [`BlockManager`]'s arena: stable while the block stays
/// cached (active or inactive), reused after its eviction. Requests keep the slots of the
/// blocks they hold, so releasing them needs no hash lookup.
pub type Slot = u32;

/// One cached full block in the arena.
#[derive(Debug, Clone, Copy)]
struct Block {
    hash: BlockHash,
    /// Requests holding it; 0 = inactive (then linked in the LRU list).
    refcount: u32,
    prev: Slot,
    next: Slot,
}

/// Block manager of one engine rank.
///
/// Capacity is `num_gpu_blocks` blocks of `block_size` tokens. A block is in exactly one of:
/// the **active** pool (full block, keyed by hash, refcount ≥ 1), **private** (a partial or
/// not-yet-filled block owned by one request; counted, never hashed or cached), the
/// **inactive** pool (full cached block, refcount 0, evictable, LRU order) or free space.
/// Cached blocks live in an arena of [`Slot`]s indexed by a hash map; inactive ones are
/// linked through the arena in LRU order (head = least recently released; vLLM's
/// `FreeKVCacheBlockQueue` is the same list). Each operation is one map probe or one arena
/// access plus O(1) list work.
///
/// # Invariants
/// 1. A hash is cached at most once (identical full blocks are merged): `map` and the live
///    arena slots are a bijection (`arena[map[h]].hash == h`), freed slots are in `free`.
/// 2. `active` counts the live slots with refcount ≥ 1.
/// 3. `active + private + inactive ≤ num_gpu_blocks`.
/// 4. The LRU list holds exactly the live slots with refcount 0, linked consistently both
///    ways, `inactive` of them.
///
/// Refcounts matching the requests that hold blocks is checked one level up, by
/// `Scheduler::check_invariants`.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    num_gpu_blocks: usize,
    map: BlockMap,
    arena: Vec<Block>,
    free: Vec<Slot>,
    head: Slot,
    tail: Slot,
    inactive: usize,
    active: usize,
    private: usize,
    evicted_total: u64,
    stored_total: u64,
}

impl BlockManager {
    /// Empty manager: `num_gpu_blocks` free blocks of `block_size` tokens.
    ///
    /// # Panics
    /// If `block_size` or `num_gpu_blocks` is 0 (validated earlier by `EngineCore::new`).
    pub fn new(block_size: usize, num_gpu_blocks: usize) -> Self {
        assert!(block_size > 0 && num_gpu_blocks > 0, "empty block manager");
        // Sized for a full cache up front (capped for huge pools): growing the map by
        // rehashing was a visible share of a long simulation.
        let room = num_gpu_blocks.min(PRESIZE_MAX_BLOCKS);
        Self {
            block_size,
            num_gpu_blocks,
            map: BlockMap::with_capacity(room),
            arena: Vec::with_capacity(room),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            inactive: 0,
            active: 0,
            private: 0,
            evicted_total: 0,
            stored_total: 0,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Capacity in blocks.
    pub fn num_gpu_blocks(&self) -> usize {
        self.num_gpu_blocks
    }

    /// Blocks held by requests (active full blocks + private blocks).
    pub fn num_used(&self) -> usize {
        self.active + self.private
    }

    /// Cached evictable blocks (inactive pool).
    pub fn num_inactive(&self) -> usize {
        self.inactive
    }

    /// Blocks that can be handed out now: free space plus evictable cached blocks.
    pub fn num_available(&self) -> usize {
        self.num_gpu_blocks - self.num_used()
    }

    /// Used fraction of KV blocks, 0–1: `(active + private) / num_gpu_blocks`. Cached
    /// evictable blocks count as free, as in vLLM V1 `BlockPool::get_usage`
    /// (`vllm:kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        self.num_used() as f64 / self.num_gpu_blocks as f64
    }

    /// Cached full blocks (active + inactive).
    pub fn num_cached(&self) -> usize {
        self.map.len()
    }

    /// Hashes of every cached full block (active and inactive), unordered: the ground truth
    /// an event consumer's index is compared with.
    pub fn cached_hashes(&self) -> Vec<BlockHash> {
        self.map.iter().map(|(h, _)| h).collect()
    }

    /// Blocks evicted since start (each produced one hash in a [`BlockEvent::Removed`]).
    pub fn evicted_total(&self) -> u64 {
        self.evicted_total
    }

    /// Blocks inserted into the cache since start (each in one [`BlockEvent::Stored`]).
    pub fn stored_total(&self) -> u64 {
        self.stored_total
    }

    /// Whether the full block `h` is cached (active or inactive).
    pub fn is_cached(&self, h: BlockHash) -> bool {
        self.map.get(h).is_some()
    }

    /// Refcount of `h` (0 when inactive or absent).
    pub fn refcount(&self, h: BlockHash) -> u32 {
        self.map
            .get(h)
            .map_or(0, |s| self.arena[s as usize].refcount)
    }

    /// Inactive hashes from LRU head (next to evict) to tail.
    pub fn inactive_lru(&self) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(self.inactive);
        let mut at = self.head;
        while at != NIL {
            let b = &self.arena[at as usize];
            out.push(b.hash);
            at = b.next;
        }
        out
    }

    /// Prefix lookup for a prompt of `num_tokens` tokens whose full-block hashes are `hashes`:
    /// the number of leading blocks cached (active ∪ inactive), stopping at the first miss and
    /// capped at `⌊(num_tokens − 1) / block_size⌋` blocks, because the last prompt token is
    /// always recomputed to get logits. Pure: no refcount or LRU change.
    /// Source: `engine-model.md` §2, vLLM `KVCacheManager::get_computed_blocks`.
    pub fn lookup_prefix(&self, hashes: &[BlockHash], num_tokens: usize) -> usize {
        let cap = num_tokens.saturating_sub(1) / self.block_size;
        hashes
            .iter()
            .take(cap)
            .take_while(|h| self.is_cached(**h))
            .count()
    }

    /// [`Self::lookup_prefix`] that also returns where the blocks are: clears `out`, then
    /// pushes the slot of each leading cached block (as many as `lookup_prefix` counts).
    pub fn lookup_prefix_slots(
        &self,
        hashes: &[BlockHash],
        num_tokens: usize,
        out: &mut Vec<Slot>,
    ) {
        out.clear();
        let cap = (num_tokens.saturating_sub(1) / self.block_size).min(hashes.len());
        let hashes = &hashes[..cap];
        for &h in hashes.iter().take(LOOKAHEAD) {
            self.map.prefetch(h);
        }
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(&next) = hashes.get(i + LOOKAHEAD) {
                self.map.prefetch(next);
            }
            match self.map.get(h) {
                Some(s) => out.push(s),
                None => break,
            }
        }
    }

    /// How many of `hashes` (all cached) sit in the inactive pool, i.e. would leave the
    /// evictable pool if taken.
    pub fn count_inactive(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .filter(|h| {
                self.map
                    .get(**h)
                    .is_some_and(|s| self.arena[s as usize].refcount == 0)
            })
            .count()
    }

    /// [`Self::count_inactive`] for the slots of cached blocks.
    pub fn count_inactive_slots(&self, slots: &[Slot]) -> usize {
        slots
            .iter()
            .filter(|&&s| self.arena[s as usize].refcount == 0)
            .count()
    }

    /// Takes the cached blocks `hashes` for a request: refcount + 1 for active ones, inactive
    /// ones move to the active pool with refcount 1.
    ///
    /// # Panics
    /// If a hash is not cached (callers pass the result of [`Self::lookup_prefix`]).
    pub fn take_cached(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            let s = self.map.get(*h).expect("take_cached: block not cached");
            self.acquire(s);
        }
    }

    /// [`Self::take_cached`] for the slots of cached blocks (from
    /// [`Self::lookup_prefix_slots`]).
    pub fn take_slots(&mut self, slots: &[Slot]) {
        for &s in slots {
            self.acquire(s);
        }
    }

    /// refcount + 1 of the cached block at `s`, moving it out of the inactive pool.
    fn acquire(&mut self, s: Slot) {
        if self.arena[s as usize].refcount == 0 {
            self.unlink(s);
            self.active += 1;
        }
        self.arena[s as usize].refcount += 1;
    }

    /// Removes inactive slot `s` from the LRU list.
    fn unlink(&mut self, s: Slot) {
        let Block { prev, next, .. } = self.arena[s as usize];
        match prev {
            NIL => self.head = next,
            p => self.arena[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.arena[n as usize].prev = prev,
        }
        self.inactive -= 1;
    }

    /// Appends slot `s` (refcount just reached 0) at the LRU tail.
    fn push_tail(&mut self, s: Slot) {
        let b = &mut self.arena[s as usize];
        b.prev = self.tail;
        b.next = NIL;
        match self.tail {
            NIL => self.head = s,
            t => self.arena[t as usize].next = s,
        }
        self.tail = s;
        self.inactive += 1;
    }

    /// Allocates `n` private blocks: free space first, then evicting the inactive LRU head.
    /// Evicted hashes are appended to `events` as one [`BlockEvent::Removed`].
    ///
    /// # Errors
    /// [`OutOfBlocks`] when fewer than `n` blocks are free or evictable; nothing changes.
    pub fn allocate_private(
        &mut self,
        n: usize,
        events: &mut Vec<BlockEvent>,
    ) -> Result<(), OutOfBlocks> {
        let available = self.num_available();
        if n > available {
            return Err(OutOfBlocks {
                requested: n,
                available,
            });
        }
        let free = available - self.inactive;
        if n > free {
            // Two passes: the LRU walk first (each block's load is dependent on the one
            // before), prefetching each evicted hash's map position, then the map removals,
            // whose positions are independent and cached by then.
            let mut removed = Vec::with_capacity(n - free);
            for _ in free..n {
                let s = self.head;
                debug_assert!(s != NIL, "counted as available");
                self.unlink(s);
                let h = self.arena[s as usize].hash;
                self.map.prefetch(h);
                self.free.push(s);
                removed.push(h);
            }
            for &h in &removed {
                self.map.remove(h);
            }
            self.evicted_total += removed.len() as u64;
            events.push(BlockEvent::Removed { hashes: removed });
        }
        self.private += n;
        Ok(())
    }

    /// Asks the CPU to start loading where the cache map keeps (or would keep) `h`: a hint,
    /// no effect on the cache, for callers that know the next blocks they will fill.
    #[inline]
    pub fn prefetch(&self, h: BlockHash) {
        self.map.prefetch(h);
    }

    /// A private block of a request just became full with hash `h`. If `h` is already cached
    /// the private block is freed and the cached one taken instead (merge, refcount + 1);
    /// otherwise the block enters the active pool with refcount 1. Returns true when the block
    /// is newly stored (the caller reports it in a [`BlockEvent::Stored`]).
    ///
    /// # Panics
    /// If no private block is allocated.
    pub fn fill_private(&mut self, h: BlockHash) -> bool {
        self.fill_private_slot(h).1
    }

    /// [`Self::fill_private`], also returning the block's slot.
    ///
    /// # Panics
    /// If no private block is allocated.
    pub fn fill_private_slot(&mut self, h: BlockHash) -> (Slot, bool) {
        assert!(self.private > 0, "fill_private without a private block");
        self.private -= 1;
        match self.map.find(h) {
            Probe::Found(s) => {
                self.acquire(s);
                (s, false)
            }
            Probe::Absent(pos) => {
                let block = Block {
                    hash: h,
                    refcount: 1,
                    prev: NIL,
                    next: NIL,
                };
                let s = match self.free.pop() {
                    Some(s) => {
                        self.arena[s as usize] = block;
                        s
                    }
                    None => {
                        self.arena.push(block);
                        (self.arena.len() - 1) as Slot
                    }
                };
                self.map.insert_at(pos, h, s);
                self.active += 1;
                self.stored_total += 1;
                (s, true)
            }
        }
    }

    /// Releases one request's blocks: its `private` blocks are discarded, then its full
    /// blocks `full` (in sequence order) get refcount − 1 **tail first**; a block reaching 0
    /// moves to the inactive tail, so the request's suffix is evicted before its prefix.
    /// Source: vLLM V1 `KVCacheManager::free` (reversed order).
    ///
    /// # Panics
    /// If a hash is not active or more private blocks are released than allocated.
    pub fn release(&mut self, full: &[BlockHash], private: usize) {
        let slots: Vec<Slot> = full
            .iter()
            .map(|&h| self.map.get(h).expect("released block not active"))
            .collect();
        self.release_slots(&slots, private);
    }

    /// [`Self::release`] for the slots of the request's full blocks, in sequence order.
    ///
    /// # Panics
    /// If a slot is not active or more private blocks are released than allocated.
    pub fn release_slots(&mut self, full: &[Slot], private: usize) {
        assert!(
            self.private >= private,
            "released more private blocks than held"
        );
        self.private -= private;
        for &s in full.iter().rev() {
            let b = &mut self.arena[s as usize];
            assert!(b.refcount > 0, "released block not active");
            b.refcount -= 1;
            if b.refcount == 0 {
                self.active -= 1;
                self.push_tail(s);
            }
        }
    }

    /// Drops every inactive cached block. Returns how many were dropped, or `None` (refused,
    /// nothing changed) while any request holds blocks, as vLLM does.
    pub fn reset(&mut self) -> Option<usize> {
        if self.num_used() > 0 {
            return None;
        }
        // Nothing is active, so every cached block is inactive.
        let n = self.inactive;
        self.map.clear();
        self.arena.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
        self.inactive = 0;
        Some(n)
    }

    /// Checks invariants 1–4; the error names the broken one.
    #[cfg(test)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let freed: std::collections::HashSet<Slot> = self.free.iter().copied().collect();
        if freed.len() != self.free.len() || self.map.len() + self.free.len() != self.arena.len() {
            return Err("1: live and free slots do not partition the arena".into());
        }
        let mut active = 0;
        for (h, s) in self.map.iter() {
            let b = self.arena.get(s as usize);
            if b.is_none_or(|b| b.hash != h) || freed.contains(&s) {
                return Err(format!("1: block {h:#x} not at its slot {s}"));
            }
            if self.arena[s as usize].refcount > 0 {
                active += 1;
            }
        }
        if active != self.active {
            return Err(format!("2: {active} active slots, counted {}", self.active));
        }
        let used = self.active + self.private + self.inactive;
        if used > self.num_gpu_blocks {
            return Err(format!("3: {used} blocks in use > {}", self.num_gpu_blocks));
        }
        let forward = self.inactive_lru();
        let mut backward = Vec::new();
        let mut at = self.tail;
        while at != NIL && backward.len() <= forward.len() {
            let b = &self.arena[at as usize];
            backward.push(b.hash);
            at = b.prev;
        }
        backward.reverse();
        let idle = self.map.len() - active;
        if forward.len() != idle || self.inactive != idle || forward != backward {
            return Err("4: LRU list and refcounts disagree".into());
        }
        if forward.iter().any(|h| self.refcount(*h) != 0) {
            return Err("4: listed block not inactive".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: usize, salt: u32) -> (Vec<u32>, Vec<BlockHash>) {
        let tokens: Vec<u32> = (0..(n * 16) as u32).map(|t| t * 7 + salt).collect();
        let mut hashes = Vec::new();
        extend_block_hashes(&mut hashes, &tokens, 16);
        (tokens, hashes)
    }

    /// Stores `hashes` as one request's full blocks (allocate + fill).
    fn store(bm: &mut BlockManager, hashes: &[BlockHash]) {
        let mut ev = Vec::new();
        bm.allocate_private(hashes.len(), &mut ev).unwrap();
        for &h in hashes {
            bm.fill_private(h);
        }
    }

    #[test]
    fn hash_chain_is_per_block_and_depends_on_parent() {
        let (tokens, hashes) = chain(3, 0);
        assert_eq!(hashes.len(), 3);
        assert_eq!(hashes[0], hash_block(None, &tokens[..16]));
        assert_eq!(hashes[1], hash_block(Some(hashes[0]), &tokens[16..32]));
        // Same tokens under a different parent hash differently.
        assert_ne!(hash_block(None, &tokens[16..32]), hashes[1]);
        // Partial tail is not hashed.
        let mut h2 = Vec::new();
        extend_block_hashes(&mut h2, &tokens[..47], 16);
        assert_eq!(h2, hashes[..2]);
    }

    #[test]
    fn lookup_caps_at_l_minus_1_over_bs() {
        let mut bm = BlockManager::new(16, 100);
        let (_, hashes) = chain(4, 0);
        store(&mut bm, &hashes);
        // L = 64: all 4 blocks cached but the cap is ⌊63/16⌋ = 3.
        assert_eq!(bm.lookup_prefix(&hashes, 64), 3);
        // L = 65: cap ⌊64/16⌋ = 4.
        assert_eq!(bm.lookup_prefix(&hashes, 65), 4);
        // L = 16: cap 0.
        assert_eq!(bm.lookup_prefix(&hashes[..1], 16), 0);
        // Stops at the first miss.
        let mut holes = hashes.clone();
        holes[1] = 42;
        assert_eq!(bm.lookup_prefix(&holes, 1000), 1);
        bm.check_invariants().unwrap();
    }

    #[test]
    fn release_tail_first_then_lru_evicts_suffix_first() {
        let mut bm = BlockManager::new(16, 6);
        let (_, a) = chain(3, 0);
        let (_, b) = chain(3, 1);
        store(&mut bm, &a);
        store(&mut bm, &b);
        bm.release(&a, 0);
        bm.release(&b, 0);
        // a released first, tail first: a2 a1 a0 b2 b1 b0.
        assert_eq!(bm.inactive_lru(), vec![a[2], a[1], a[0], b[2], b[1], b[0]]);
        assert_eq!(bm.usage(), 0.0);
        let mut ev = Vec::new();
        bm.allocate_private(2, &mut ev).unwrap();
        assert_eq!(
            ev,
            vec![BlockEvent::Removed {
                hashes: vec![a[2], a[1]]
            }]
        );
        assert_eq!(bm.evicted_total(), 2);
        // a0 still hits, a1 is gone.
        assert_eq!(bm.lookup_prefix(&a, 1000), 1);
        bm.check_invariants().unwrap();
    }

    #[test]
    fn taking_inactive_block_protects_it_from_eviction() {
        let mut bm = BlockManager::new(16, 3);
        let (_, a) = chain(3, 0);
        store(&mut bm, &a);
        bm.release(&a, 0);
        bm.take_cached(&a[..1]);
        assert_eq!(bm.refcount(a[0]), 1);
        let mut ev = Vec::new();
        assert_eq!(
            bm.allocate_private(3, &mut ev),
            Err(OutOfBlocks {
                requested: 3,
                available: 2
            })
        );
        assert!(ev.is_empty());
        bm.allocate_private(2, &mut ev).unwrap();
        assert!(bm.is_cached(a[0]) && !bm.is_cached(a[1]) && !bm.is_cached(a[2]));
        bm.check_invariants().unwrap();
    }

    #[test]
    fn identical_full_blocks_merge() {
        let mut bm = BlockManager::new(16, 10);
        let (_, a) = chain(2, 0);
        let mut ev = Vec::new();
        bm.allocate_private(4, &mut ev).unwrap();
        assert!(bm.fill_private(a[0]));
        assert!(bm.fill_private(a[1]));
        // Second request computes the same blocks: merged, not stored twice.
        assert!(!bm.fill_private(a[0]));
        assert!(!bm.fill_private(a[1]));
        assert_eq!(bm.refcount(a[0]), 2);
        assert_eq!(bm.num_used(), 2);
        assert_eq!(bm.stored_total(), 2);
        bm.check_invariants().unwrap();
    }

    #[test]
    fn reset_refused_while_blocks_are_held() {
        let mut bm = BlockManager::new(16, 10);
        let (_, a) = chain(2, 0);
        store(&mut bm, &a);
        assert_eq!(bm.reset(), None);
        bm.release(&a, 0);
        assert_eq!(bm.reset(), Some(2));
        assert_eq!(bm.lookup_prefix(&a, 1000), 0);
        bm.check_invariants().unwrap();
    }
}
