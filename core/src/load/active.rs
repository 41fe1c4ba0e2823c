//! [`ActiveLoad`]: what one worker is doing, as this router booked it. The load side of every
//! policy (anchors.md §3.3, Dynamo's active-sequence tracking; §2.5, SMG's since-poll
//! credit).
//!
//! Lifecycle of one request on its worker, each step exactly once:
//! 1. **book** ([`ActiveLoad::book`], at dispatch, before the request is sent: bug-cases.md
//!    B1): its new prefill tokens (prompt − predicted cached) and predicted prefill time are
//!    charged to the worker, its prompt blocks join the worker's active blocks (a prefix
//!    shared by concurrent requests counts once: see *Unique blocks*), its prompt tokens
//!    join the since-poll credit, and the worker's prefill clock moves on by its predicted
//!    prefill time;
//! 2. **first token** ([`ActiveLoad::first_token`]: the first SSE data event, or the first
//!    body byte of a non-streaming response): its prefill charge ends, and the prefill clock
//!    is re-anchored at the observed time plus the predicted prefill of what is still booked;
//! 3. **free** ([`ActiveLoad::free`], when its load guard drops: body end, failure, client
//!    gone): its blocks leave; a request freed before its first token (a failure) takes its
//!    prefill charge with it. If it waited behind no other prefill, its observed TTFT
//!    teaches the worker's [`PrefillModel`].
//!
//! Invariants (checked by [`ActiveLoad::check`] in tests):
//! 1. `prefill_tokens`, `prefill_ms` and `prefill_requests` are the sums over booked requests
//!    that have not had their first token, and `in_prefill` orders exactly those by dispatch;
//! 2. `paths` holds one [`Path`] per live request with block keys, and `keyed_blocks` is
//!    the number of distinct keys among them;
//! 3. the words [`ActiveLoad::view`] reads are those of the state (`Published`).
//!
//! # Unique blocks
//! Block keys are chained ([`kvroute_index::keys::block_keys_in`]: a key hashes its block
//! and the key before it), so two prompts with equal keys at a position have equal keys
//! before it, and the live requests' keys are paths from one root in a trie: the distinct
//! keys are its nodes. Kept in lexicographic order, `n` sequences `s₁ < … < sₙ` have
//! `Σ |sᵢ| − lcp(sᵢ₋₁, sᵢ)` distinct prefixes (lcp = blocks in common from the start, with
//! `lcp(s₀, s₁) = 0`), so a request joining between `p` and `q` adds
//! `|s| − lcp(p, s) − lcp(s, q) + lcp(p, q)` and leaving takes as many away. With the order a
//! B-tree and lcp a binary search (the chain again), a book or free costs
//! O(log requests × log blocks) instead of a hash-map update per block: the map's 1,024
//! updates (book and free of 512 blocks) were 18.5 % of a whole token-mode decision at turn
//! 10 of an 8k-token chat (`kvroute bench decision`, perf/runs/2026-12-02-decision-2).

use super::EngineReport;
use super::timing::{PrefillModel, STEP_TOKENS};
use crate::ids::BlockKeySeq;
use kvroute_index::mix::MixMap;
use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::ops::Bound;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering, fence};

/// What a dispatch books on its worker (made by the router from its decision,
/// `kvroute_core::policy::Router::booking`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Booking {
    /// Prompt length, tokens (text requests: chars scaled to tokens).
    pub prompt_tokens: u64,
    /// Prompt tokens the router expects the worker to serve from its cache.
    pub cached_tokens: u64,
    /// Predicted own prefill time on the worker, ms ([`PrefillModel::prefill_ms`] of the new
    /// tokens).
    pub prefill_ms: f64,
    /// Block keys of the prompt's full blocks (router keys,
    /// [`kvroute_index::keys::block_keys`]); empty when the request has no token ids. Shared:
    /// the worker's path set keeps this buffer, not a copy.
    pub block_keys: BlockKeySeq,
    /// Prompt blocks without keys (text requests), counted without sharing.
    pub unkeyed_blocks: u64,
}

impl Booking {
    /// New prefill tokens: prompt − cached, at least 1 (an engine always computes the last
    /// prompt token, vLLM's rule).
    pub fn new_tokens(&self) -> u64 {
        self.prompt_tokens
            .saturating_sub(self.cached_tokens)
            .max(u64::from(self.prompt_tokens > 0))
    }
}

/// Decode load assumed for a worker with requests past their first token and no KV usage
/// report, 0–1: a quarter of its memory. kvroute's choice (the mocker's decode step at 0.25 is
/// 17.6 ms against 34 at 1.0, engine-model.md §4).
pub const DECODE_LOAD_UNREPORTED: f64 = 0.25;

/// A worker's decode load, 0–1, for the prefill curve ([`PrefillModel`]): 0 when none of its
/// `in_flight` requests is past its first token; else its engine's reported KV usage, or
/// [`DECODE_LOAD_UNREPORTED`] without one.
pub fn decode_load(in_flight: usize, v: &ActiveView) -> f64 {
    decode_load_of(in_flight, v.prefill_requests, v.engine)
}

fn decode_load_of(in_flight: usize, prefill_requests: usize, engine: Option<EngineReport>) -> f64 {
    if in_flight <= prefill_requests && engine.is_none_or(|e| e.running == 0) {
        return 0.0;
    }
    engine
        .and_then(|e| e.kv_usage)
        .unwrap_or(DECODE_LOAD_UNREPORTED)
}

/// A worker's active load at one instant, as a policy reads it
/// ([`kvroute_core::policy::Snapshot`]). The default is an idle worker with the prior curve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActiveView {
    /// Booked requests that have not had their first token.
    pub prefill_requests: usize,
    /// Their new prefill tokens, summed (Dynamo's active prefill tokens, with its
    /// `router_assume_kv_reuse`).
    pub prefill_tokens: u64,
    /// Predicted ms until the worker has prefilled everything booked on it: the prefill
    /// clock minus now while the clock is ahead; once it has fallen behind (first tokens
    /// overdue: the engine queues for another reason, e.g. its running set is full), the age
    /// of the oldest booked request still without its first token — a queue whose head has
    /// waited that long makes a newcomer wait at least as long (FCFS). 0 with nothing booked.
    pub prefill_wait_ms: f64,
    /// Unique prompt blocks of live requests (Dynamo's active decode blocks).
    pub decode_blocks: u64,
    /// Prompt tokens dispatched since the last engine report (SMG's since-poll credit).
    pub since_poll_tokens: u64,
    /// The last engine report, if the last poll gave one.
    pub engine: Option<EngineReport>,
    /// The worker's learned prefill curve.
    pub prefill: PrefillModel,
    /// Step token budget assumed for the worker, tokens.
    pub step_tokens: usize,
}

impl Default for ActiveView {
    fn default() -> Self {
        Self {
            prefill_requests: 0,
            prefill_tokens: 0,
            prefill_wait_ms: 0.0,
            decode_blocks: 0,
            since_poll_tokens: 0,
            engine: None,
            prefill: PrefillModel::default(),
            step_tokens: STEP_TOKENS,
        }
    }
}

/// [`ActiveView::prefill_wait_ms`] of a worker with `prefill_requests` booked without their
/// first token, its prefill clock at `clock_ms` and the oldest of them dispatched at
/// `oldest_ms`.
fn wait_ms(prefill_requests: usize, clock_ms: f64, oldest_ms: f64, now_ms: f64) -> f64 {
    if prefill_requests == 0 {
        return 0.0;
    }
    if clock_ms >= now_ms {
        return clock_ms - now_ms;
    }
    (now_ms - oldest_ms).max(0.0)
}

/// Blocks two chained key sequences share from the start, by binary search (equal keys at a
/// position imply equal keys before it: module doc, *Unique blocks*).
fn common_blocks(a: &[u64], b: &[u64]) -> usize {
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if a[mid - 1] == b[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// A live request's block keys, ordered lexicographically (then by booking id, so equal
/// prompts stay apart). The order is total for chained keys (a [`Booking`]'s, from the
/// router's block keys); keys that are not chained (a 2^-64 collision) may be misplaced,
/// and a free may then miss its path: the worker's decode-block count drifts, nothing else.
#[derive(Debug, Clone)]
struct Path {
    keys: BlockKeySeq,
    id: u64,
}

impl Ord for Path {
    fn cmp(&self, other: &Self) -> Ordering {
        let l = common_blocks(&self.keys, &other.keys);
        let by_keys = match (self.keys.get(l), other.keys.get(l)) {
            (Some(a), Some(b)) => a.cmp(b),
            _ => self.keys.len().cmp(&other.keys.len()),
        };
        by_keys.then(self.id.cmp(&other.id))
    }
}

impl PartialOrd for Path {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Path {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Path {}

/// Blocks `path` shares from the start with the path of `paths` that shares the most:
/// `max(lcp(p, path), lcp(path, q))` over its neighbours `p < path < q` (`path` itself not
/// in `paths`), since in lexicographic order no path further away shares more.
fn shared_blocks(paths: &BTreeSet<Path>, path: &Path) -> usize {
    let before = paths.range(..path).next_back();
    let after = paths
        .range((Bound::Excluded(path), Bound::Unbounded))
        .next();
    [before, after]
        .into_iter()
        .flatten()
        .map(|n| common_blocks(&n.keys, &path.keys))
        .max()
        .unwrap_or(0)
}

/// Blocks `path` adds to (or, leaving, takes from) the distinct keys of `paths`: module doc,
/// *Unique blocks*, where `lcp(p, q) = min(lcp(p, path), lcp(path, q))` in lexicographic
/// order, so the change is `|path| − ` [`shared_blocks`].
fn added_blocks(paths: &BTreeSet<Path>, path: &Path) -> u64 {
    (path.keys.len() - shared_blocks(paths, path)) as u64
}

#[derive(Debug)]
struct Booked {
    /// Its place in [`Active::paths`], when it has block keys.
    path: Option<Path>,
    unkeyed: u64,
    new_tokens: u64,
    prefill_ms: f64,
    dispatched_ms: f64,
    /// No other prefill was booked on the worker at dispatch, nor queued on the engine.
    alone: bool,
    /// Decode load at dispatch, 0–1.
    decode_load: f64,
    in_prefill: bool,
    ttft_ms: Option<f64>,
    /// New tokens the engine reported (prompt − cached from `usage`), if it did.
    served_new_tokens: Option<u64>,
}

#[derive(Debug)]
struct Active {
    next_id: u64,
    requests: MixMap<u64, Booked>,
    /// `(dispatch time's order key, id)` of every booked request without its first token:
    /// the oldest is the first, so publishing it costs O(log requests), not a scan of the
    /// requests (a worker that every request is herded onto holds thousands: the scan was
    /// 7 % of `kvroute simulate --policies pure_affinity_events` on the Mooncake trace).
    in_prefill: BTreeSet<(u64, u64)>,
    /// Live requests' block keys in order (module doc, *Unique blocks*).
    paths: BTreeSet<Path>,
    /// Distinct keys among `paths`.
    keyed_blocks: u64,
    unkeyed_blocks: u64,
    prefill_requests: usize,
    prefill_tokens: u64,
    prefill_ms: f64,
    clock_ms: f64,
    since_poll_tokens: u64,
    engine: Option<EngineReport>,
    model: PrefillModel,
}

/// One worker's active load (module doc). `Send + Sync`; every method but
/// [`ActiveLoad::view`] takes one short lock; `view` takes none.
#[derive(Debug)]
pub struct ActiveLoad {
    inner: Mutex<Active>,
    /// What `view` reads, published under the lock after every change.
    published: Published,
}

/// Words of [`Published`]: 0 prefill requests, 1 prefill tokens, 2 prefill clock (f64 bits),
/// 3 oldest dispatch still in prefill (f64 bits, ∞ when none), 4 decode blocks, 5 since-poll
/// tokens, 6 engine report flags (bit 0 present, 1 `waiting_tokens`, 2 `kv_usage`, 3
/// `capacity_blocks`), 7–11 its running, waiting, waiting tokens, KV usage (f64 bits),
/// capacity, 12–18 the prefill curve ([`PrefillModel::to_words`]).
const WORDS: usize = 19;

/// The fields [`ActiveLoad::view`] reads, for readers that take no lock: a sequence lock.
/// Writers, serialized by the mutex, make `seq` odd, store the words, and make it even again;
/// a reader copies the words between two reads of `seq` and retries while it was odd or
/// changed (every access atomic: no torn value is ever used). A fleet snapshot reads every
/// worker's view; the mutex's lock and unlock, a read-modify-write each on a line not in
/// cache, were a third of `Workers::snapshot` at 4,096 workers (perf/runs/2026-12-02-fleet-2).
#[derive(Debug, Default)]
#[repr(align(64))]
struct Published {
    seq: AtomicU64,
    words: [AtomicU64; WORDS],
}

impl Published {
    /// The words of state `a`. The oldest dispatch still in prefill is the first of
    /// `a.in_prefill`, found once per write (readers scanned the requests for it, once per
    /// read, while first tokens were overdue).
    fn words(a: &Active) -> [u64; WORDS] {
        let oldest = a
            .in_prefill
            .first()
            .and_then(|(_, id)| a.requests.get(id))
            .map_or(f64::INFINITY, |r| r.dispatched_ms);
        let e = a.engine.unwrap_or_default();
        let flags = u64::from(a.engine.is_some())
            | u64::from(e.waiting_tokens.is_some()) << 1
            | u64::from(e.kv_usage.is_some()) << 2
            | u64::from(e.capacity_blocks.is_some()) << 3;
        let m = a.model.to_words();
        [
            a.prefill_requests as u64,
            a.prefill_tokens,
            a.clock_ms.to_bits(),
            oldest.to_bits(),
            a.keyed_blocks + a.unkeyed_blocks,
            a.since_poll_tokens,
            flags,
            e.running as u64,
            e.waiting as u64,
            e.waiting_tokens.unwrap_or(0),
            e.kv_usage.unwrap_or(0.0).to_bits(),
            e.capacity_blocks.unwrap_or(0),
            m[0],
            m[1],
            m[2],
            m[3],
            m[4],
            m[5],
            m[6],
        ]
    }

    /// Publishes `a` (the caller holds its mutex: one writer at a time).
    fn store(&self, a: &Active) {
        let words = Self::words(a);
        let s = self.seq.load(AtomicOrdering::Relaxed);
        self.seq.store(s.wrapping_add(1), AtomicOrdering::Relaxed);
        fence(AtomicOrdering::Release);
        // Only the words that changed are stored: a store takes the line from the readers'
        // caches, and the engine report's and the curve's words (7–18, two of the three
        // lines) change only at a report or a first token, not at every book and free.
        for (slot, w) in self.words.iter().zip(words) {
            if slot.load(AtomicOrdering::Relaxed) != w {
                slot.store(w, AtomicOrdering::Relaxed);
            }
        }
        self.seq.store(s.wrapping_add(2), AtomicOrdering::Release);
    }

    /// The last published words.
    #[inline]
    fn load(&self) -> [u64; WORDS] {
        loop {
            let s1 = self.seq.load(AtomicOrdering::Acquire);
            let words = std::array::from_fn(|i| self.words[i].load(AtomicOrdering::Relaxed));
            fence(AtomicOrdering::Acquire);
            let s2 = self.seq.load(AtomicOrdering::Relaxed);
            if s1 == s2 && s1.is_multiple_of(2) {
                return words;
            }
            std::hint::spin_loop();
        }
    }
}

impl Default for ActiveLoad {
    fn default() -> Self {
        let a = Self {
            inner: Mutex::new(Active {
                next_id: 0,
                requests: MixMap::default(),
                in_prefill: BTreeSet::new(),
                paths: BTreeSet::new(),
                keyed_blocks: 0,
                unkeyed_blocks: 0,
                prefill_requests: 0,
                prefill_tokens: 0,
                prefill_ms: 0.0,
                clock_ms: 0.0,
                since_poll_tokens: 0,
                engine: None,
                model: PrefillModel::default(),
            }),
            published: Published::default(),
        };
        a.published.store(&a.lock());
        a
    }
}

impl ActiveLoad {
    fn lock(&self) -> std::sync::MutexGuard<'_, Active> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts loading the published words [`ActiveLoad::view`] reads (three lines,
    /// [`kvroute_index::prefetch`]): a hint, no effect on any value.
    pub fn prefetch(&self) {
        kvroute_index::prefetch(&self.published);
    }

    /// Books a request dispatched at `now_ms` (step 1 of the module doc) on a worker with
    /// `in_flight` requests before it (its [`decode_load`] is taken then, under the same
    /// lock). Returns the booking's id for [`ActiveLoad::first_token`] and
    /// [`ActiveLoad::free`].
    pub fn book(&self, b: Booking, now_ms: f64, in_flight: usize) -> u64 {
        let new_tokens = b.new_tokens();
        let keys = (!b.block_keys.is_empty()).then(|| b.block_keys.clone());
        let mut a = self.lock();
        let decode_load = decode_load_of(in_flight, a.prefill_requests, a.engine);
        let id = a.next_id;
        a.next_id += 1;
        let queued = a.engine.is_some_and(|e| e.waiting > 0);
        let alone = a.prefill_requests == 0 && !queued;
        let path = keys.map(|keys| Path { keys, id });
        if let Some(p) = &path {
            a.keyed_blocks += added_blocks(&a.paths, p);
            a.paths.insert(p.clone());
        }
        a.unkeyed_blocks += b.unkeyed_blocks;
        a.prefill_requests += 1;
        a.prefill_tokens += new_tokens;
        a.prefill_ms += b.prefill_ms;
        a.clock_ms = a.clock_ms.max(now_ms) + b.prefill_ms;
        a.since_poll_tokens += b.prompt_tokens;
        a.in_prefill.insert((order_key(now_ms), id));
        a.requests.insert(
            id,
            Booked {
                path,
                unkeyed: b.unkeyed_blocks,
                new_tokens,
                prefill_ms: b.prefill_ms,
                dispatched_ms: now_ms,
                alone,
                decode_load,
                in_prefill: true,
                ttft_ms: None,
                served_new_tokens: None,
            },
        );
        self.published.store(&a);
        id
    }

    /// Blocks at the head of `keys` (a prompt's chained block keys,
    /// [`Booking::block_keys`]) that at least two requests live here share with it: the
    /// second longest run from the start over the live paths; 0 with fewer than two, or with
    /// empty `keys`. A head that two concurrent requests besides this one share is a popular
    /// prefix (a system prompt), while a run only one live request shares may be this
    /// conversation's own earlier turn, still decoding
    /// (`kvroute_core::policy::predicted_ttft`).
    ///
    /// In lexicographic order the paths sharing at least `l` blocks with `keys` are
    /// contiguous around its place (`lcp(a, c) = min(lcp(a, b), lcp(b, c))` for `a < b <
    /// c`), so the two longest runs are among the two paths on each side. One lock,
    /// O(log requests × log blocks).
    pub fn shared_head(&self, keys: &BlockKeySeq) -> usize {
        self.live_runs(keys).1
    }

    /// Blocks at the head of `keys` that some request live here holds (the longest run from
    /// the start over the live paths; 0 for none or empty `keys`): blocks in the worker's KV
    /// memory now, counted in its KV usage. One lock, as [`ActiveLoad::shared_head`].
    pub fn live_head(&self, keys: &BlockKeySeq) -> usize {
        self.live_runs(keys).0
    }

    /// The longest and second longest runs from the start that live paths share with
    /// `keys` ([`ActiveLoad::shared_head`] explains the search).
    fn live_runs(&self, keys: &BlockKeySeq) -> (usize, usize) {
        if keys.is_empty() {
            return (0, 0);
        }
        // After every live path with the same keys (ids are counted up from 0).
        let probe = Path {
            keys: keys.clone(),
            id: u64::MAX,
        };
        let a = self.lock();
        let after = a
            .paths
            .range((Bound::Excluded(&probe), Bound::Unbounded))
            .take(2);
        let before = a.paths.range(..&probe).rev().take(2);
        let (mut first, mut second) = (0, 0);
        for n in after.chain(before) {
            let l = common_blocks(&n.keys, keys);
            if l > first {
                (first, second) = (l, first);
            } else if l > second {
                second = l;
            }
        }
        (first, second)
    }

    /// Step 2: booking `id`'s first token came at `now_ms`. A second call, or an unknown id,
    /// does nothing.
    pub fn first_token(&self, id: u64, now_ms: f64) {
        let mut a = self.lock();
        let Some(r) = a.requests.get_mut(&id) else {
            return;
        };
        if !r.in_prefill {
            return;
        }
        r.in_prefill = false;
        r.ttft_ms = Some((now_ms - r.dispatched_ms).max(0.0));
        let (tokens, ms, at) = (r.new_tokens, r.prefill_ms, r.dispatched_ms);
        a.in_prefill.remove(&(order_key(at), id));
        a.end_prefill(tokens, ms);
        a.clock_ms = now_ms + a.prefill_ms;
        self.published.store(&a);
    }

    /// What the engine said it served booking `id` from its cache: `prompt_tokens` and
    /// `cached_tokens` of the response's `usage` (the learning sample then uses the true new
    /// tokens, not the router's prediction).
    pub fn served(&self, id: u64, prompt_tokens: u64, cached_tokens: u64) {
        if let Some(r) = self.lock().requests.get_mut(&id) {
            r.served_new_tokens = Some(prompt_tokens.saturating_sub(cached_tokens).max(1));
        }
    }

    /// Step 3: booking `id` ended. An unknown id does nothing.
    pub fn free(&self, id: u64) {
        let mut a = self.lock();
        let Some(r) = a.requests.remove(&id) else {
            return;
        };
        if let Some(p) = &r.path
            && a.paths.remove(p)
        {
            a.keyed_blocks = a.keyed_blocks.saturating_sub(added_blocks(&a.paths, p));
        }
        a.unkeyed_blocks -= r.unkeyed;
        if r.in_prefill {
            a.in_prefill.remove(&(order_key(r.dispatched_ms), id));
            a.end_prefill(r.new_tokens, r.prefill_ms);
            a.clock_ms -= r.prefill_ms;
        }
        if let (true, Some(ttft)) = (r.alone, r.ttft_ms) {
            let tokens = r.served_new_tokens.unwrap_or(r.new_tokens);
            a.model.observe(tokens, STEP_TOKENS, r.decode_load, ttft);
        }
        self.published.store(&a);
    }

    /// Records an engine report (or its absence: `None`); the since-poll credit restarts.
    pub fn report(&self, engine: Option<EngineReport>) {
        let mut a = self.lock();
        a.engine = engine;
        a.since_poll_tokens = 0;
        self.published.store(&a);
    }

    /// The view a policy reads at `now_ms`, from the last published state: no lock.
    #[inline]
    pub fn view(&self, now_ms: f64) -> ActiveView {
        let w = self.published.load();
        let f = f64::from_bits;
        let prefill_requests = w[0] as usize;
        let engine = (w[6] & 1 == 1).then(|| EngineReport {
            running: w[7] as usize,
            waiting: w[8] as usize,
            waiting_tokens: (w[6] & 2 != 0).then_some(w[9]),
            kv_usage: (w[6] & 4 != 0).then(|| f(w[10])),
            capacity_blocks: (w[6] & 8 != 0).then_some(w[11]),
        });
        ActiveView {
            prefill_requests,
            prefill_tokens: w[1],
            prefill_wait_ms: wait_ms(prefill_requests, f(w[2]), f(w[3]), now_ms),
            decode_blocks: w[4],
            since_poll_tokens: w[5],
            engine,
            prefill: PrefillModel::from_words(std::array::from_fn(|i| w[12 + i])),
            step_tokens: STEP_TOKENS,
        }
    }

    /// Checks the invariants of the module doc.
    ///
    /// # Errors
    /// The number of the first broken invariant.
    pub fn check(&self) -> Result<(), u8> {
        let a = self.lock();
        let open = a.requests.values().filter(|r| r.in_prefill);
        let (n, tokens, ms) = open.fold((0, 0, 0.0), |(n, t, m), r| {
            (n + 1, t + r.new_tokens, m + r.prefill_ms)
        });
        let ordered: BTreeSet<(u64, u64)> = a
            .requests
            .iter()
            .filter(|(_, r)| r.in_prefill)
            .map(|(&id, r)| (order_key(r.dispatched_ms), id))
            .collect();
        if n != a.prefill_requests
            || tokens != a.prefill_tokens
            || (ms - a.prefill_ms).abs() > 1e-6
            || ordered != a.in_prefill
        {
            return Err(1);
        }
        let paths: Vec<&Path> = a
            .requests
            .values()
            .filter_map(|r| r.path.as_ref())
            .collect();
        let distinct: std::collections::HashSet<u64> =
            paths.iter().flat_map(|p| p.keys.iter().copied()).collect();
        if paths.len() != a.paths.len()
            || paths.iter().any(|p| !a.paths.contains(*p))
            || distinct.len() as u64 != a.keyed_blocks
        {
            return Err(2);
        }
        if self.published.load() != Published::words(&a) {
            return Err(3);
        }
        Ok(())
    }
}

/// A `u64` in the order of `ms` (IEEE 754 total order: the sign bit flipped for a
/// non-negative value, every bit for a negative one).
fn order_key(ms: f64) -> u64 {
    let b = ms.to_bits();
    if b >> 63 == 0 { b | 1 << 63 } else { !b }
}

impl Active {
    fn end_prefill(&mut self, tokens: u64, ms: f64) {
        self.prefill_requests -= 1;
        self.prefill_tokens -= tokens;
        self.prefill_ms = (self.prefill_ms - ms).max(0.0);
        if self.prefill_requests == 0 {
            self.prefill_ms = 0.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn booking(prompt: u64, cached: u64, ms: f64, keys: &[u64]) -> Booking {
        Booking {
            prompt_tokens: prompt,
            cached_tokens: cached,
            prefill_ms: ms,
            block_keys: keys.into(),
            unkeyed_blocks: 0,
        }
    }

    /// Worked example: two requests sharing blocks 1 and 2 count them once; the prefill
    /// clock runs on by each dispatch and is re-anchored at the first token.
    #[test]
    fn a_shared_prefix_counts_once_and_the_clock_reanchors() {
        let a = ActiveLoad::default();
        let r1 = a.book(booking(48, 0, 100.0, &[1, 2, 3]), 1_000.0, 0);
        let r2 = a.book(booking(48, 32, 40.0, &[1, 2, 4]), 1_010.0, 0);
        let v = a.view(1_010.0);
        assert_eq!(v.decode_blocks, 4);
        assert_eq!((v.prefill_requests, v.prefill_tokens), (2, 48 + 16));
        // Clock: 1,000 + 100 + 40 = 1,140 → 130 ms to go at 1,010.
        assert!((v.prefill_wait_ms - 130.0).abs() < 1e-9);
        assert_eq!(v.since_poll_tokens, 96);
        // r1's first token comes late, at 1,150: the clock is now 1,150 + r2's 40.
        a.first_token(r1, 1_150.0);
        let v = a.view(1_150.0);
        assert!((v.prefill_wait_ms - 40.0).abs() < 1e-9);
        assert_eq!((v.prefill_requests, v.prefill_tokens), (1, 16));
        a.first_token(r1, 1_160.0); // twice: nothing
        a.free(r1);
        assert_eq!(a.view(1_150.0).decode_blocks, 3);
        a.free(r2); // freed before its first token: its charge leaves with it
        let v = a.view(1_200.0);
        assert_eq!(
            (v.prefill_requests, v.prefill_tokens, v.decode_blocks),
            (0, 0, 0)
        );
        assert_eq!(v.prefill_wait_ms, 0.0);
        // Overdue: booked at 2,000 for 50 ms, no first token by 2,300 → the head has waited
        // 300 ms, the estimate.
        let r3 = a.book(booking(16, 0, 50.0, &[]), 2_000.0, 0);
        assert!((a.view(2_020.0).prefill_wait_ms - 30.0).abs() < 1e-9);
        assert!((a.view(2_300.0).prefill_wait_ms - 300.0).abs() < 1e-9);
        a.free(r3);
        a.check().unwrap();
        a.report(None);
        assert_eq!(a.view(0.0).since_poll_tokens, 0);
    }

    /// A view read while another thread books and frees is one published state, never a
    /// mix of two: its prefill tokens are always 64 per prefill request.
    #[test]
    fn views_read_during_writes_are_whole() {
        let a = Arc::new(ActiveLoad::default());
        let writer = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                for i in 0..20_000u32 {
                    let id = a.book(booking(64, 0, 2.0, &[1, 2]), f64::from(i), 0);
                    if i % 2 == 0 {
                        a.first_token(id, f64::from(i));
                    }
                    a.free(id);
                }
            })
        };
        let mut reads = 0;
        while !writer.is_finished() && reads < 5_000_000 {
            let v = a.view(0.0);
            assert_eq!(v.prefill_tokens, 64 * v.prefill_requests as u64);
            assert!(v.decode_blocks == 0 || v.decode_blocks == 2);
            reads += 1;
        }
        writer.join().unwrap();
        assert_eq!(a.view(0.0).decode_blocks, 0);
    }

    /// Only a request that waited behind nothing teaches the curve, with the engine's served
    /// count when it gave one.
    #[test]
    fn alone_requests_teach_the_curve() {
        let a = ActiveLoad::default();
        let first = a.book(booking(8_192, 0, 169.0, &[]), 0.0, 0);
        let second = a.book(booking(8_192, 0, 169.0, &[]), 0.0, 0); // behind `first`
        a.first_token(first, 85.0);
        a.first_token(second, 170.0);
        a.free(second);
        assert_eq!(a.view(0.0).prefill.samples(), 0);
        a.served(first, 8_192, 0);
        a.free(first);
        assert_eq!(a.view(0.0).prefill.samples(), 1);
        assert!(a.view(0.0).prefill.prefill_ms(8_192, STEP_TOKENS, 0.0) < 169.0);
    }

    /// Worked example: a system prompt (blocks 1–4) that two live sessions share is a shared
    /// head; one live earlier turn of the probe's own conversation is not.
    #[test]
    fn shared_head_needs_two_live_requests() {
        let a = ActiveLoad::default();
        let probe: BlockKeySeq = chain(4, 7).into();
        assert_eq!(a.shared_head(&probe), 0);
        // The probe's own earlier turn: its first 6 blocks.
        let turn = a.book(booking(96, 0, 1.0, &probe[..6]), 0.0, 0);
        assert_eq!(a.shared_head(&probe), 0);
        // Another session on the same system prompt (branch 4 shares blocks 0–3).
        let other = a.book(booking(96, 0, 1.0, &chain(4, 6)[..4]), 0.0, 0);
        let third = a.book(booking(96, 0, 1.0, &chain(2, 6)), 0.0, 0);
        assert_eq!(a.shared_head(&probe), 4);
        a.free(other);
        // Left: the earlier turn (6 blocks) and branch 2 (2 blocks in common).
        assert_eq!(a.shared_head(&probe), 2);
        a.free(turn);
        a.free(third);
        assert_eq!(a.shared_head(&probe), 0);
        assert_eq!(a.shared_head(&BlockKeySeq::default()), 0);
    }

    /// Block keys of a prompt on branch `branch` of one trie, `len` blocks: the first
    /// `branch` blocks are the trunk every branch shares, the rest its own (chained as real
    /// keys are: equal at a position → equal before it).
    fn chain(branch: u64, len: usize) -> Vec<u64> {
        (0..len as u64)
            .map(|i| {
                if i < branch {
                    i
                } else {
                    1_000 * (branch + 1) + i
                }
            })
            .collect()
    }

    /// Replays `ops` on `a`: `(book, doc, blocks, pick)` books the first `blocks` 4-token
    /// blocks of `docs[doc]` (always when nothing is live) or frees live request
    /// `pick % live`; after each op `check` sees the live requests (booking id, block keys).
    fn replay(
        a: &ActiveLoad,
        docs: &[Vec<u32>],
        ops: &[(bool, usize, usize, usize)],
        mut check: impl FnMut(&[(u64, Vec<u64>)]) -> Result<(), TestCaseError>,
    ) -> Result<(), TestCaseError> {
        let mut live: Vec<(u64, Vec<u64>)> = Vec::new();
        for &(book, doc, blocks, pick) in ops {
            if book || live.is_empty() {
                let keys = kvroute_index::keys::block_keys(&docs[doc][..blocks * 4], 4);
                live.push((a.book(booking(64, 0, 1.0, &keys), 0.0, 0), keys));
            } else {
                let (id, _) = live.swap_remove(pick % live.len());
                a.free(id);
            }
            check(&live)?;
        }
        Ok(())
    }

    #[test]
    fn order_key_keeps_the_order_of_times() {
        let times = [
            f64::NEG_INFINITY,
            -1e9,
            -2.5,
            -0.0,
            0.0,
            1e-300,
            0.5,
            3.0,
            1e12,
        ];
        for w in times.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{} {}", w[0], w[1]);
        }
    }

    /// While first tokens are overdue the wait is the age of the oldest dispatch still in
    /// prefill, whichever order requests were booked and answered in.
    #[test]
    fn the_oldest_dispatch_in_prefill_sets_an_overdue_wait() {
        let a = ActiveLoad::default();
        let ids: Vec<u64> = [30.0, 10.0, 20.0]
            .iter()
            .map(|&t| a.book(booking(64, 0, 1.0, &chain(1, 2)), t, 0))
            .collect();
        // The prefill clock (1 ms each, from 30 ms: 33) is long past at 100 ms.
        assert_eq!(a.view(100.0).prefill_wait_ms, 90.0);
        // Re-anchored at 40 + the 2 ms still booked: past again at 100.
        a.first_token(ids[1], 40.0);
        assert_eq!(a.view(100.0).prefill_wait_ms, 80.0);
        a.free(ids[2]);
        assert_eq!(a.view(100.0).prefill_wait_ms, 70.0);
        a.first_token(ids[0], 50.0);
        assert_eq!(a.view(100.0).prefill_wait_ms, 0.0);
        a.check().unwrap();
    }

    proptest! {
        /// The distinct blocks of live requests equal a brute-force set union after every
        /// book and free, for prompts of every length on a few branches (real block keys
        /// from `kvroute_index::keys::block_keys` of random token prefixes).
        #[test]
        fn decode_blocks_are_the_union_of_live_prompts(
            ops in prop::collection::vec((any::<bool>(), 0usize..6, 0usize..40, 0usize..16), 1..80),
        ) {
            let a = ActiveLoad::default();
            let docs: Vec<Vec<u32>> = (0..6u32)
                .map(|d| (0..40 * 4).map(|t| if t < 64 { t } else { d * 10_000 + t }).collect())
                .collect();
            replay(&a, &docs, &ops, |live| {
                let union: std::collections::HashSet<u64> =
                    live.iter().flat_map(|(_, k)| k.iter().copied()).collect();
                prop_assert_eq!(a.view(0.0).decode_blocks, union.len() as u64);
                prop_assert_eq!(a.check(), Ok(()));
                Ok(())
            })?;
        }

        /// `shared_head` is the second longest run any live prompt shares with the probe
        /// from the start (brute force over every live prompt), after every book and free.
        #[test]
        fn shared_head_is_the_second_longest_live_run(
            ops in prop::collection::vec((any::<bool>(), 0usize..6, 0usize..40, 0usize..16), 1..60),
            probe in (0usize..6, 0usize..40),
        ) {
            let a = ActiveLoad::default();
            let docs: Vec<Vec<u32>> = (0..6u32)
                .map(|d| (0..40 * 4).map(|t| if t < 64 + d * 16 { t } else { d * 10_000 + t }).collect())
                .collect();
            let probe: BlockKeySeq =
                kvroute_index::keys::block_keys(&docs[probe.0][..probe.1 * 4], 4).into();
            replay(&a, &docs, &ops, |live| {
                let mut runs: Vec<usize> = live
                    .iter()
                    .map(|(_, k)| k.iter().zip(probe.iter()).take_while(|(x, y)| x == y).count())
                    .collect();
                runs.sort_unstable_by(|x, y| y.cmp(x));
                prop_assert_eq!(a.shared_head(&probe), runs.get(1).copied().unwrap_or(0));
                Ok(())
            })?;
        }

        /// Any order of books, first tokens and frees, at times that need not increase (a
        /// clock may step back; negative and equal times included), keeps the invariants
        /// (among them: the in-prefill order is the brute-force one, so the oldest dispatch
        /// published is); at the end nothing is left.
        #[test]
        fn invariants_hold(ops in prop::collection::vec((0u8..3, 0usize..8, 0u64..6, -20i32..20), 1..60)) {
            let a = ActiveLoad::default();
            let mut ids: Vec<u64> = Vec::new();
            let mut t = 0.0;
            for (op, pick, key, at) in ops {
                t = f64::from(at) / 2.0;
                match op {
                    0 => ids.push(a.book(booking(64, key * 8, 10.0, &chain(key, 2 + key as usize)), t, 0)),
                    1 if !ids.is_empty() => a.first_token(ids[pick % ids.len()], t),
                    _ if !ids.is_empty() => { a.free(ids.swap_remove(pick % ids.len())); }
                    _ => {}
                }
                prop_assert_eq!(a.check(), Ok(()));
            }
            for id in ids { a.free(id); }
            let v = a.view(t);
            prop_assert_eq!((v.prefill_requests, v.prefill_tokens, v.decode_blocks), (0, 0, 0));
        }
    }
}
