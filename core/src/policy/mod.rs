//! [`Router`]: picks a worker for a request from its [`RouteKey`] and a [`Snapshot`] of the
//! eligible workers and their loads. No sockets, no clocks; randomness only breaks ties.
//!
//! Two steps, as the request lifecycle has them (style.md "One request"):
//! - [`Router::decide`] is read-only: it matches the indexes and picks among
//!   `snapshot.eligible` only, and writes nothing, so a failed attempt can decide again with
//!   the failed worker vetoed and leave no trace;
//! - [`Router::record`] runs once the request is committed to its worker (the gateway: when
//!   the worker's response head arrives; the simulator: when it dispatches), and writes the
//!   chosen worker into the approximate indexes.
//!
//! cache_aware keeps, per model, a [`StringTree`] (text requests), a [`TokenTree`] (requests
//! with token ids, whole pages of `block_size`) and in hash mode a [`HashIndex`], each inside a
//! [`LeftRight`]: a decision matches on the published copy without a lock and without waiting
//! for a writer, then queues its insert; the write is applied by whichever decision holds the
//! writer side (never waited for). The event index ([`kvroute_index::EventIndex`]) is fed by
//! engine events (issue 5) and is not consulted here yet.

use crate::config::{Config, PolicyKind};
use crate::route_key::RouteKey;
use kvroute_index::{
    HashIndex, HashIndexConfig, LeftRight, Namespace, StringTree, TenantId, TokenTree,
};
use rand::Rng;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

pub use crate::config::CacheIndexKind;

/// Why a worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reason {
    /// round_robin's turn.
    RoundRobin,
    /// least_request: fewest in flight.
    LeastRequest,
    /// cache_aware on token ids (token tree or hash index): a prefix holder that is not hot.
    TokenHit {
        /// Matched prefix, tokens (whole pages, or the matched hash head).
        matched_tokens: usize,
        /// matched_tokens / request tokens.
        ratio: f64,
    },
    /// cache_aware on text: a prefix holder that is not hot.
    CacheHit {
        /// Matched prefix, chars.
        matched_chars: usize,
        /// matched_chars / request chars.
        ratio: f64,
    },
    /// cache_aware: match ratio at or below the threshold; least-loaded worker.
    CacheMiss,
    /// cache_aware: every prefix holder was hot; least-loaded worker.
    Spill,
}

impl Reason {
    /// Metric label: `round_robin`, `least_request`, `hit`, `miss`, `spill`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::RoundRobin => "round_robin",
            Reason::LeastRequest => "least_request",
            Reason::CacheHit { .. } | Reason::TokenHit { .. } => "hit",
            Reason::CacheMiss => "miss",
            Reason::Spill => "spill",
        }
    }

    /// The prefix the router expects the chosen worker to serve from its KV cache, tokens:
    /// `matched_tokens` for a token hit; for a text hit, `ratio × prompt_tokens` (the matched
    /// share of the prompt's chars applied to its tokens, rounded), with `prompt_tokens` from
    /// the engine's `usage`. `None` for every other reason: no overlap was predicted.
    pub fn predicted_cached_tokens(&self, prompt_tokens: u64) -> Option<u64> {
        match *self {
            Reason::TokenHit { matched_tokens, .. } => Some(matched_tokens as u64),
            Reason::CacheHit { ratio, .. } => Some((ratio * prompt_tokens as f64).round() as u64),
            _ => None,
        }
    }
}

/// A routing decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Worker id.
    pub worker: usize,
    /// Why.
    pub reason: Reason,
}

/// The spill gate of SMG (anchors.md §2.2 step 5): worker `w` is hot when
/// `loads[w] > rel × mean` **and** `loads[w] > mean + abs`, mean over eligible workers.
#[derive(Debug, Clone, Copy)]
pub struct SpillGate {
    /// Load above which a worker is hot, requests (`max(rel × mean, mean + abs)`).
    pub threshold: f64,
}

impl SpillGate {
    /// Gate for the loads of `eligible` (worker ids into `loads`): the mean is over eligible
    /// workers only, so a dead or draining worker at load 0 does not make the live ones look
    /// hot (bug-cases.md B5).
    pub fn new(loads: &[usize], eligible: &[usize], rel: f64, abs: usize) -> Self {
        let mean = if eligible.is_empty() {
            0.0
        } else {
            eligible.iter().map(|&w| loads[w]).sum::<usize>() as f64 / eligible.len() as f64
        };
        Self {
            threshold: (rel * mean).max(mean + abs as f64),
        }
    }

    /// True when a worker with `load` in flight is hot.
    pub fn is_hot(&self, load: usize) -> bool {
        load as f64 > self.threshold
    }
}

/// A spill on the event index goes to a worker at most this many requests above the least
/// loaded, preferring the most leading blocks held (bug-cases.md B11: "load ≤ min + margin,
/// preferring the longest prefix"). Measured with `kvroute simulate` over 40 workloads: margin
/// 0 / 1 / 2 / 4 gave +0.09 / +0.08 / +0.05 / +0.04 points of hit rate against spilling to the
/// least loaded; at 3,072 blocks +0.08 / +0.16 / +0.18 / +0.05, the worst workload 53.9 / 54.3 /
/// 54.6 / 54.6 % against 50.9; at twice the arrival rate 0.00 / +0.01 / −0.02 / −0.12 (events
/// only; the trees use it too, from [`kvroute_index::StringTree::match_depths`]).
pub const SPILL_NEAR_LOAD: usize = 1;

/// Where a spill goes (bug-cases.md B11): among eligible workers at most [`SPILL_NEAR_LOAD`]
/// above the least eligible load, the one holding the longest prefix of the request
/// (`depth(worker)`, in any unit: blocks, tokens, chars), ties to the least loaded, at random.
/// Not a hot worker while the spill margin (`balance_abs_threshold`) is at least
/// [`SPILL_NEAR_LOAD`]: hot needs a load above the mean + the margin, and the mean is at least
/// the least load. `snap.eligible` must not be empty.
fn spill_target(snap: &Snapshot<'_>, depth: impl Fn(usize) -> usize, rng: &mut impl Rng) -> usize {
    let loads = snap.loads;
    let min = snap.eligible.iter().map(|&w| loads[w]).min().unwrap_or(0);
    let near = |w: &usize| loads[*w] <= min + SPILL_NEAR_LOAD;
    let best = snap.eligible.iter().copied().filter(near).map(&depth).max();
    least_loaded(
        loads,
        snap.eligible
            .iter()
            .copied()
            .filter(|w| near(w) && Some(depth(*w)) == best),
        rng,
    )
    .unwrap_or(snap.eligible[0])
}

/// What a policy may read (issue 13's policy seam): the loads of every worker, the eligible
/// ones, the request's sequence number and the time. Made by the caller (the gateway from its
/// registry, `kvroute_core::workers::Workers::snapshot`; the simulator from its fleet); a
/// policy never looks past it.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot<'a> {
    /// Load by worker id (requests in flight + foreign), one entry per worker slot.
    pub loads: &'a [usize],
    /// Ids the request may go to (healthy, breaker not open, serving its model, not draining,
    /// not vetoed by an earlier attempt), ascending; every id `< loads.len()`. Must not be
    /// empty (the caller answers 503 instead of deciding).
    pub eligible: &'a [usize],
    /// The request's sequence number: round_robin's turn (`eligible[seq % len]`), so the
    /// policy keeps no counter of its own.
    pub seq: u64,
    /// Time on the router's time base ([`Router::now_ms`]), for the hash index's TTL.
    pub now_ms: u64,
}

impl<'a> Snapshot<'a> {
    /// True when `w` is eligible.
    pub fn is_eligible(&self, w: usize) -> bool {
        self.eligible.binary_search(&w).is_ok()
    }

    fn least_loaded(&self, rng: &mut impl Rng) -> usize {
        least_loaded(self.loads, self.eligible.iter().copied(), rng).unwrap_or(self.eligible[0])
    }
}

/// The least-loaded of `candidates` (worker ids), ties broken uniformly at random — never by
/// list order (bug-cases.md B1). `None` when `candidates` is empty.
pub fn least_loaded(
    loads: &[usize],
    candidates: impl IntoIterator<Item = usize>,
    rng: &mut impl Rng,
) -> Option<usize> {
    let mut best: Option<(usize, usize)> = None; // (worker, load)
    let mut ties = 0u32;
    for w in candidates {
        let load = loads[w];
        match best {
            Some((_, b)) if load > b => {}
            Some((_, b)) if load == b => {
                // Reservoir sampling over the tied set: uniform without collecting it.
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((w, load));
                }
            }
            _ => {
                best = Some((w, load));
                ties = 1;
            }
        }
    }
    best.map(|(w, _)| w)
}

/// A queued write to a tree: applied to both copies of a [`LeftRight`], in order.
#[derive(Debug, Clone)]
pub enum TreeOp<K> {
    /// Record `key` (text or token ids) for a worker in a namespace.
    Insert(Namespace, K, TenantId),
    /// Forget a worker everywhere.
    RemoveTenant(TenantId),
}

/// A queued write to a hash index.
#[derive(Debug, Clone)]
pub enum HashOp {
    /// Record token ids for a worker at a time (ms since the router started).
    Record(Namespace, Vec<u32>, TenantId, u64),
    /// Forget a worker everywhere.
    RemoveTenant(TenantId),
}

fn apply_string(t: &mut StringTree, op: &TreeOp<Box<str>>) {
    match op {
        TreeOp::Insert(ns, text, w) => t.insert(*ns, text, *w),
        TreeOp::RemoveTenant(w) => t.remove_tenant(*w),
    }
}

fn apply_token(t: &mut TokenTree, op: &TreeOp<Box<[u32]>>) {
    match op {
        TreeOp::Insert(ns, ids, w) => t.insert(*ns, ids, *w),
        TreeOp::RemoveTenant(w) => t.remove_tenant(*w),
    }
}

fn apply_hash(h: &mut HashIndex, op: &HashOp) {
    match op {
        HashOp::Record(ns, ids, w, now) => h.record(*ns, ids, *w, *now),
        HashOp::RemoveTenant(w) => h.remove_worker(*w),
    }
}

/// The cache_aware indexes of one model, each readable without locks.
pub struct ModelIndexes {
    /// Text requests (chars).
    pub strings: LeftRight<StringTree, TreeOp<Box<str>>>,
    /// Token-id requests (whole pages of `block_size`).
    pub tokens: LeftRight<TokenTree, TreeOp<Box<[u32]>>>,
    /// Hash mode only.
    pub hash: Option<LeftRight<HashIndex, HashOp>>,
}

/// Picks workers for requests: one per gateway, shared by all shards (`Send + Sync`).
///
/// Holds the policy and its thresholds (from [`Config`]), a round-robin counter, and for
/// cache_aware one [`ModelIndexes`] per model (keyed by [`RouteKey::model`], created on first
/// use). Lookups take no lock; writes are queued and applied by one writer at a time.
pub struct Router {
    kind: PolicyKind,
    cache_threshold: f64,
    balance_rel_threshold: f64,
    balance_abs_threshold: usize,
    max_tree_size_chars: usize,
    max_tree_size_tokens: usize,
    block_size: usize,
    cache_index: CacheIndexKind,
    hash_cfg: HashIndexConfig,
    started: Instant,
    models: LeftRight<HashMap<String, Arc<ModelIndexes>>, (String, Arc<ModelIndexes>)>,
    /// Lock-free read side of the engine KV-event index (issue 5), written only by `io`'s
    /// event writer.
    events: Option<crate::events::EventReader>,
}

fn add_model(m: &mut HashMap<String, Arc<ModelIndexes>>, op: &(String, Arc<ModelIndexes>)) {
    m.entry(op.0.clone()).or_insert_with(|| Arc::clone(&op.1));
}

impl Router {
    /// A router for `cfg` (policy, thresholds, index settings).
    pub fn new(cfg: &Config) -> Self {
        Self {
            kind: cfg.policy,
            cache_threshold: cfg.cache_threshold,
            balance_rel_threshold: cfg.balance_rel_threshold,
            balance_abs_threshold: cfg.balance_abs_threshold,
            max_tree_size_chars: cfg.max_tree_size_chars,
            max_tree_size_tokens: cfg.max_tree_size_tokens,
            block_size: cfg.block_size.max(1),
            cache_index: cfg.cache_index,
            hash_cfg: HashIndexConfig {
                boundaries: cfg.cache_boundaries.clone(),
                ttl_ms: cfg.cache_ttl_secs.saturating_mul(1000),
            },
            started: Instant::now(),
            models: LeftRight::new(HashMap::new(), add_model),
            events: None,
        }
    }

    /// Routes token-bearing cache_aware requests on the event index read by `reader`
    /// (engine KV events) whenever it holds any block. Called once, before the router is
    /// shared.
    pub fn set_event_index(&mut self, reader: crate::events::EventReader) {
        self.events = Some(reader);
    }

    /// cache_aware on engine events (issue 5 item 5): `None` when no event index is attached
    /// or it holds nothing (then the token tree decides). Eligible workers holding more than
    /// `cache_threshold` of the request in consecutive leading blocks are candidates; among the
    /// non-hot ones the deepest overlap wins, ties by load (`TokenHit`); all candidates hot →
    /// `Spill` to the deepest holder among eligible workers within [`SPILL_NEAR_LOAD`] of the
    /// least load (B11); none → `None` as well: the token tree decides (requests in flight
    /// that no engine has announced yet), else `CacheMiss`. Reads only.
    fn decide_on_events(
        &self,
        snap: &Snapshot<'_>,
        ns: Namespace,
        ids: &[u32],
        gate: &SpillGate,
        rng: &mut impl Rng,
    ) -> Option<Decision> {
        let ix = self.events.as_ref()?;
        if ix.is_empty() {
            return None;
        }
        let loads = snap.loads;
        let bs = ix.block_size();
        let keys = ix.block_keys(ns, ids);
        let mut blocks = vec![0usize; loads.len()];
        for m in ix.find_matches(&keys) {
            if let Some(b) = blocks.get_mut(m.stream.worker as usize) {
                *b = (*b).max(m.blocks);
            }
        }
        // As in cache_aware: a match of at most `cache_threshold` of the request is a miss.
        let deep = |b: usize| (b * bs) as f64 / ids.len().max(1) as f64 > self.cache_threshold;
        let eligible = || snap.eligible.iter().copied();
        let cool = |w: &usize| deep(blocks[*w]) && !gate.is_hot(loads[*w]);
        let top = eligible().filter(cool).map(|w| blocks[w]).max();
        Some(match top {
            Some(t) => {
                let worker = least_loaded(
                    loads,
                    eligible().filter(|w| cool(w) && blocks[*w] == t),
                    rng,
                )
                .unwrap_or(snap.eligible[0]);
                Decision {
                    worker,
                    reason: Reason::TokenHit {
                        matched_tokens: t * bs,
                        ratio: (t * bs) as f64 / ids.len().max(1) as f64,
                    },
                }
            }
            // Every deep eligible holder is hot: B11's spill target.
            None if eligible().any(|w| deep(blocks[w])) => Decision {
                worker: spill_target(snap, |w| blocks[w], rng),
                reason: Reason::Spill,
            },
            // No engine holds enough of the prompt *yet*: engines announce blocks only once
            // they schedule the request, so the followers of a new shared prefix arrive
            // before its stores. The token tree (where the router sent recent requests)
            // decides those, so a burst lands together instead of recomputing the prefix on
            // every least-loaded worker; with no tree match either it is the same miss.
            None => return None,
        })
    }

    /// The policy.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// The indexes of `model`, if any request for it was recorded (decisions only read).
    fn existing_model(&self, model: &str) -> Option<Arc<ModelIndexes>> {
        self.models.read().get(model).map(Arc::clone)
    }

    /// The indexes of `model`, created on first use (the only path that may wait: for the
    /// writer side of the model map, once per model). Called by [`Router::record`] only.
    fn model(&self, model: &str) -> Arc<ModelIndexes> {
        if let Some(m) = self.existing_model(model) {
            return m;
        }
        let hash = match self.cache_index {
            CacheIndexKind::Hash => HashIndex::new(self.hash_cfg.clone())
                .ok()
                .map(|h| LeftRight::new(h, apply_hash)),
            CacheIndexKind::Tree => None,
        };
        let fresh = Arc::new(ModelIndexes {
            strings: LeftRight::new(
                StringTree::with_max_chars(self.max_tree_size_chars),
                apply_string,
            ),
            tokens: LeftRight::new(
                TokenTree::new(self.block_size, self.max_tree_size_tokens),
                apply_token,
            ),
            hash,
        });
        self.models.write((model.to_string(), fresh));
        loop {
            if let Some(m) = self.existing_model(model) {
                return m;
            }
            self.models.flush();
            std::thread::yield_now();
        }
    }

    /// Milliseconds since the router was made: the time base of [`Snapshot::now_ms`].
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Chooses a worker among `snap.eligible` for `key`. Read-only: nothing is written into
    /// any index (that is [`Router::record`]'s job, once the request is committed), so an
    /// attempt that fails can decide again with its worker vetoed. Randomness only breaks
    /// load ties: with a seeded `rng` the same request, snapshot and index state give the
    /// same decision (the simulator, `kvroute_bench::sim`).
    ///
    /// - round_robin: `eligible[seq % eligible.len()]`. Reason `RoundRobin`.
    /// - least_request: fewest in flight, ties uniformly at random, never by list order (bug
    ///   B1). Reason `LeastRequest`.
    /// - cache_aware (SMG, anchors §2.2 steps 3, 5, 6, 7): requests with token ids use the
    ///   model's event index when it holds blocks (see `decide_on_events`), else the token
    ///   tree (ratio = whole matched pages × block_size / request tokens; shorter than a page
    ///   never matches) or, in hash mode, the deepest live hash head; text requests use the
    ///   string tree (ratio = matched chars / request chars; text in hash mode is a miss). If
    ///   ratio > `cache_threshold` the candidates are the eligible tenants of the deepest
    ///   matched node (at most 8); the least-loaded non-hot one wins (`CacheHit` /
    ///   `TokenHit`). Hot = load > `rel × mean` and load > `mean + abs`, mean over eligible
    ///   workers ([`SpillGate`], B5). All candidates hot → B11's spill target (`Spill`).
    ///   Otherwise → the least-loaded eligible worker (`CacheMiss`). A request with neither
    ///   text nor ids is a miss. Indexes are matched under `key.namespace` (cache partition).
    ///
    /// # Panics
    /// When `snap.eligible` is empty or names an id `>= snap.loads.len()`.
    pub fn decide(&self, snap: &Snapshot<'_>, key: &RouteKey, rng: &mut impl Rng) -> Decision {
        assert!(!snap.eligible.is_empty(), "decide needs an eligible worker");
        match self.kind {
            PolicyKind::RoundRobin => Decision {
                worker: snap.eligible[(snap.seq % snap.eligible.len() as u64) as usize],
                reason: Reason::RoundRobin,
            },
            PolicyKind::LeastRequest => Decision {
                worker: snap.least_loaded(rng),
                reason: Reason::LeastRequest,
            },
            PolicyKind::CacheAware => self.decide_cache_aware(snap, key, rng),
        }
    }

    fn decide_cache_aware(
        &self,
        snap: &Snapshot<'_>,
        key: &RouteKey,
        rng: &mut impl Rng,
    ) -> Decision {
        let miss = |rng: &mut _| Decision {
            worker: snap.least_loaded(rng),
            reason: Reason::CacheMiss,
        };
        // Cache partition (cache_salt / extra_key / LoRA): different namespaces never match.
        let ns: Namespace = key.namespace;
        let ids = key.input_ids.as_deref().filter(|v| !v.is_empty());
        if key.text.is_empty() && ids.is_none() {
            return miss(rng);
        }
        let loads = snap.loads;
        let gate = SpillGate::new(
            loads,
            snap.eligible,
            self.balance_rel_threshold,
            self.balance_abs_threshold,
        );
        if let Some(d) = ids.and_then(|ids| self.decide_on_events(snap, ns, ids, &gate, rng)) {
            return d;
        }
        let Some(idx) = self.existing_model(&key.model) else {
            return miss(rng);
        };
        // (matched, request length, candidate tenants, is_tokens)
        let (matched, len, mut tenants, tokens) = match (ids, &idx.hash) {
            (Some(ids), Some(h)) => match h.read().lookup(ns, ids, snap.now_ms) {
                Some((b, ts)) => (b, ids.len(), ts, true),
                None => (0, ids.len(), Vec::new(), true),
            },
            (Some(ids), None) => {
                let m = idx.tokens.read().match_prefix(ns, ids);
                (m.matched_tokens, ids.len(), m.tenants, true)
            }
            (None, Some(_)) => (0, 1, Vec::new(), false),
            (None, None) => {
                let m = idx.strings.read().match_prefix(ns, &key.text);
                (m.matched_chars, key.text.chars().count(), m.tenants, false)
            }
        };
        let ratio = matched as f64 / len.max(1) as f64;
        // Eligible holders, in id order: a tie-break then depends on the set and the random
        // draw only, as on the event index (so the simulator's runs compare like with like).
        tenants.sort_unstable();
        let holders = || {
            tenants
                .iter()
                .map(|&t| t as usize)
                .filter(|&w| snap.is_eligible(w))
        };
        if ratio <= self.cache_threshold || holders().next().is_none() {
            return miss(rng);
        }
        let cool = holders().filter(|&w| !gate.is_hot(loads[w]));
        match least_loaded(loads, cool, rng) {
            Some(worker) => Decision {
                worker,
                reason: if tokens {
                    Reason::TokenHit {
                        matched_tokens: matched,
                        ratio,
                    }
                } else {
                    Reason::CacheHit {
                        matched_chars: matched,
                        ratio,
                    }
                },
            },
            // Every eligible holder is hot: B11's spill target (recorded as one more holder).
            None => {
                let depths = match (ids, &idx.hash) {
                    (Some(ids), None) => idx.tokens.read().match_depths(ns, ids),
                    (None, None) => idx.strings.read().match_depths(ns, &key.text),
                    (_, Some(_)) => Vec::new(),
                };
                let depth = |w: usize| {
                    depths
                        .binary_search_by_key(&(w as TenantId), |e| e.0)
                        .map_or(0, |i| depths[i].1)
                };
                Decision {
                    worker: spill_target(snap, depth, rng),
                    reason: Reason::Spill,
                }
            }
        }
    }

    /// Writes `decision` into the approximate indexes of `key.model` at `now_ms` (the
    /// [`Router::now_ms`] time base): the request's text or ids are now held by
    /// `decision.worker` (cache_aware only; the other policies keep no index). Call it once
    /// per request, when it is committed to its worker; each tree keeps itself within its
    /// budget at every insert. A request with neither text nor ids records nothing.
    pub fn record(&self, key: &RouteKey, decision: &Decision, now_ms: u64) {
        if self.kind != PolicyKind::CacheAware {
            return;
        }
        let ids = key.input_ids.as_deref().filter(|v| !v.is_empty());
        if key.text.is_empty() && ids.is_none() {
            return;
        }
        let idx = self.model(&key.model);
        let ns: Namespace = key.namespace;
        let worker = decision.worker as TenantId;
        match (ids, &idx.hash) {
            (Some(ids), Some(h)) => h.write(HashOp::Record(ns, ids.to_vec(), worker, now_ms)),
            (Some(ids), None) => idx.tokens.write(TreeOp::Insert(ns, ids.into(), worker)),
            (None, Some(_)) => {}
            (None, None) => idx
                .strings
                .write(TreeOp::Insert(ns, key.text.as_str().into(), worker)),
        }
    }

    /// Forgets worker `id` in every index (a removed or dead worker).
    pub fn remove_worker(&self, id: usize) {
        let t = id as TenantId;
        for m in self.models.read().values() {
            m.strings.write(TreeOp::RemoveTenant(t));
            m.tokens.write(TreeOp::RemoveTenant(t));
            if let Some(h) = &m.hash {
                h.write(HashOp::RemoveTenant(t));
            }
        }
    }

    /// Applies every queued write now (tests and shutdown; decisions do this as they go).
    pub fn flush(&self) {
        for m in self.models.read().values() {
            while !m.strings.flush() && m.strings.pending() > 0 {
                std::thread::yield_now();
            }
            while !m.tokens.flush() && m.tokens.pending() > 0 {
                std::thread::yield_now();
            }
            if let Some(h) = &m.hash {
                while !h.flush() && h.pending() > 0 {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Total chars held by the string tree of `model` (0 when it has none), after pending
    /// writes.
    pub fn tree_chars(&self, model: &str) -> usize {
        self.flush();
        self.models
            .read()
            .get(model)
            .map_or(0, |m| m.strings.read().total_chars())
    }

    /// Total tokens held by the token tree of `model` (0 when it has none), after pending
    /// writes.
    pub fn tree_tokens(&self, model: &str) -> usize {
        self.flush();
        self.models
            .read()
            .get(model)
            .map_or(0, |m| m.tokens.read().total_tokens())
    }

    /// The approximate indexes' sizes as published now (no flush, no wait): per model,
    /// `(model, string-tree chars, token-tree tokens)`, models in name order.
    pub fn index_sizes(&self) -> Vec<(String, usize, usize)> {
        let mut out: Vec<(String, usize, usize)> = self
            .models
            .read()
            .iter()
            .map(|(name, m)| {
                (
                    name.clone(),
                    m.strings.read().total_chars(),
                    m.tokens.read().total_tokens(),
                )
            })
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests;

/// Test helper: one request the way the gateway runs it when every worker is eligible —
/// [`Router::decide`] on a snapshot of `loads` (seq from a per-thread counter, so round_robin
/// takes turns), then [`Router::record`].
#[cfg(test)]
impl Router {
    pub(crate) fn decide_all(&self, key: &RouteKey, loads: &[usize]) -> Decision {
        thread_local!(static SEQ: std::cell::Cell<u64> = const { std::cell::Cell::new(0) });
        let seq = SEQ.with(|s| {
            let v = s.get();
            s.set(v + 1);
            v
        });
        let eligible: Vec<usize> = (0..loads.len()).collect();
        let now = self.now_ms();
        let snap = Snapshot {
            loads,
            eligible: &eligible,
            seq,
            now_ms: now,
        };
        let d = self.decide(&snap, key, &mut rand::rng());
        self.record(key, &d, now);
        d
    }
}
