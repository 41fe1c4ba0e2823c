//! [`Router`]: picks a worker for a request from its [`RouteKey`] and a [`Snapshot`] of the
//! eligible workers and their loads. No sockets, no clocks; randomness only breaks ties (and
//! samples, for the policies that sample).
//!
//! Two steps, as the request lifecycle has them (style.md "One request"):
//! - [`Router::decide`] is read-only: it reads the indexes through [`prefix::PrefixIndex`]
//!   and the snapshot, picks among `snapshot.eligible` only, and writes nothing, so a failed
//!   attempt can decide again with the failed worker vetoed and leave no trace;
//! - [`Router::record`] runs once the request is committed to its worker (the gateway: when
//!   the worker's response head arrives; the simulator: when it dispatches), and writes the
//!   chosen worker into the approximate indexes. [`Router::booking`] says what the dispatch
//!   books on the worker's load ([`crate::load::active`]).
//!
//! One pipeline for every policy: the request's facts ([`Request`]), then its overlaps with
//! every worker from one index ([`prefix::Overlaps`], chosen by [`Router::overlaps`]), then
//! the policy's selector, a small pure function in its own file:
//!
//! | policy | file | reads | picks |
//! |---|---|---|---|
//! | `round_robin` | `round_robin.rs` | `seq` | `eligible[seq % n]` |
//! | `random` | `random.rs` | — | uniform |
//! | `least_request` | `least_request.rs` | requests | fewest, random ties |
//! | `power_of_two` | `power_of_two.rs` | engine reports, credit | lower expected wait of two |
//! | `least_load` | `least_load.rs` | engine reports, credit | lowest expected wait (SMG §2.5) |
//! | `cache_aware`, `smg_cache_aware` | `cache_aware.rs` | overlaps, requests, KV usage | SMG §2.2 |
//! | `kv_aware`, `dynamo_kv` | `kv_aware.rs` | overlaps, prefill tokens, decode blocks | Dynamo §3.1 |
//! | `prefix_hash` | `prefix_hash.rs` | the prompt's head, requests | ring, bounded load |
//! | `consistent_hash` | `consistent_hash.rs` | the session key, requests | ring, bounded load |
//! | `pure_affinity` | `pure_affinity.rs` | overlaps | the largest |
//! | `predicted_ttft` | `predicted_ttft.rs` | overlaps, prefill clock, learned curve, KV memory | lowest predicted TTFT |
//!
//! The trees and the hash index live per model inside [`LeftRight`]s: a decision matches on
//! the published copy without a lock and without waiting for a writer; a record queues its
//! insert, applied by whichever caller holds the writer side. The event index
//! ([`crate::events::EventReader`]) is fed by engine events only.

mod cache_aware;
pub mod candidates;
mod consistent_hash;
mod kv_aware;
mod least_load;
mod least_request;
mod power_of_two;
mod predicted_ttft;
pub mod prefix;
mod prefix_hash;
mod pure_affinity;
mod random;
mod round_robin;
pub mod wait;

use crate::config::{Config, PolicyKind};
use crate::ids::{BlockKeySeq, TokenIds};
use crate::load::active::Booking;
use crate::route_key::RouteKey;
use crate::tokens::BlockKeys;
use kvroute_index::{
    HashIndex, HashIndexConfig, LeftRight, Namespace, PeerPages, PeerPagesConfig, StringTree,
    TenantId, TokenTree,
};
use prefix::{Overlaps, PrefixIndex, Query, Source, Unit};
use rand::Rng;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

pub use crate::config::CacheIndexKind;
pub use crate::workers::WorkerLoad;
use crate::workers::{FleetView, Workers};
pub use cache_aware::{CacheAwareParams, SPILL_NEAR_LOAD, SpillGate};
pub use consistent_hash::{Ring, VIRTUAL_NODES};
pub use kv_aware::KvParams;
pub use predicted_ttft::TtftParams;
pub use wait::{expected_wait_s, least_loaded};

/// Why a worker was chosen: the branch of the policy that chose it (metric label
/// [`Reason::as_str`], decision log).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reason {
    /// round_robin's turn.
    RoundRobin,
    /// random's draw.
    Random,
    /// least_request: fewest in flight.
    LeastRequest,
    /// power_of_two: the lower expected wait of two draws.
    PowerOfTwo,
    /// least_load: the lowest expected wait.
    LeastLoad,
    /// cache_aware on token ids (token tree, hash index, events): a prefix holder that is not
    /// hot.
    TokenHit {
        /// Matched prefix, tokens (whole pages, blocks, or the matched hash head).
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
    /// cache_aware: no holder above the threshold; lowest expected wait.
    CacheMiss,
    /// cache_aware: every prefix holder was hot; a spill target.
    Spill,
    /// cache_aware: engine KV usage tripped a pressure threshold; lowest expected wait.
    KvPressure,
    /// kv_aware / predicted_ttft / pure_affinity: the lowest cost (highest overlap for
    /// pure_affinity), with the chosen worker's overlap.
    Cost {
        /// The chosen worker's predicted cached prefix, tokens (text: chars scaled).
        matched_tokens: usize,
        /// Its share of the request, 0–1.
        ratio: f64,
    },
    /// prefix_hash / consistent_hash: the key's owner on the ring (`fallback`: it was full
    /// or ineligible and the walk went on; no key at all: the least loaded).
    Hashed {
        /// The owner was passed over.
        fallback: bool,
    },
}

impl Reason {
    /// Metric label: the policy's name for its own branch (`round_robin`, `random`,
    /// `least_request`, `power_of_two`, `least_load`), `hit`, `miss`, `spill`,
    /// `kv_pressure`, `cost_hit` / `cost_miss` (a cost decision with / without overlap),
    /// `hash` / `hash_fallback`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::RoundRobin => "round_robin",
            Reason::Random => "random",
            Reason::LeastRequest => "least_request",
            Reason::PowerOfTwo => "power_of_two",
            Reason::LeastLoad => "least_load",
            Reason::CacheHit { .. } | Reason::TokenHit { .. } => "hit",
            Reason::CacheMiss => "miss",
            Reason::Spill => "spill",
            Reason::KvPressure => "kv_pressure",
            Reason::Cost { matched_tokens, .. } if *matched_tokens > 0 => "cost_hit",
            Reason::Cost { .. } => "cost_miss",
            Reason::Hashed { fallback: false } => "hash",
            Reason::Hashed { fallback: true } => "hash_fallback",
        }
    }

    /// The prefix the router expects the chosen worker to serve from its KV cache, tokens:
    /// `matched_tokens` for a token hit or a cost decision with overlap; for a text hit,
    /// `ratio × prompt_tokens` (the matched share of the prompt's chars applied to its
    /// tokens, rounded), with `prompt_tokens` from the engine's `usage`. `None` for every
    /// other reason: no overlap was predicted.
    pub fn predicted_cached_tokens(&self, prompt_tokens: u64) -> Option<u64> {
        match *self {
            Reason::TokenHit { matched_tokens, .. } => Some(matched_tokens as u64),
            Reason::Cost { matched_tokens, .. } if matched_tokens > 0 => {
                Some(matched_tokens as u64)
            }
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

impl Decision {
    /// A cost policy's choice of `worker`, with its overlap in `ov` ([`Reason::Cost`]).
    pub fn by_cost(worker: usize, ov: &Overlaps) -> Self {
        Self {
            worker,
            reason: Reason::Cost {
                matched_tokens: ov.tokens(worker) as usize,
                ratio: ov.ratio(worker),
            },
        }
    }
}

/// What a policy may read: every worker's load ([`WorkerLoad`]: requests in flight, booked
/// prefill tokens and time, active decode blocks, the last engine report with its since-poll
/// credit, the learned prefill curve), the eligible ones, the request's sequence number and
/// the time. Made by the caller (the gateway from its registry,
/// [`crate::workers::Workers::snapshot`]; the simulator from its fleet); a policy never
/// looks past it.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot<'a> {
    /// Loads: by worker id, one entry per worker slot, when `ids` is empty; else one per
    /// entry of `ids`. Read them with [`Snapshot::load`].
    pub workers: &'a [WorkerLoad],
    /// The worker id of each entry of `workers`, ascending, when the snapshot is a large
    /// fleet's candidate set ([`Router::decide_on`]); empty when `workers` is by worker id.
    pub ids: &'a [usize],
    /// Ids the request may go to (healthy, breaker not open, serving its model, not draining,
    /// not vetoed by an earlier attempt), ascending; every id has a load in `workers`. Must
    /// not be empty (the caller answers 503 instead of deciding).
    pub eligible: &'a [usize],
    /// The request's sequence number: round_robin's turn (`eligible[seq % len]`), so the
    /// policy keeps no counter of its own.
    pub seq: u64,
    /// Time on the router's time base ([`Router::now_ms`]), ms.
    pub now_ms: u64,
    /// The workers' live requests, for the head of a prompt they share
    /// ([`LivePaths`]); `None` reads as nothing shared.
    pub live: Option<&'a dyn LivePaths>,
}

/// What the requests live on each worker share with a new prompt: read-only, answered under
/// each worker's own short lock ([`crate::load::active::ActiveLoad::shared_head`]). A head
/// that live requests share is a popular prefix (a system prompt) that every worker can
/// cache for all of them, not one conversation's history ([`predicted_ttft`]).
pub trait LivePaths: std::fmt::Debug + Sync {
    /// Blocks at the head of `keys` (a prompt's chained block keys, [`Request::block_keys`])
    /// that some request live on worker `w` shares and then leaves (a live prefix of `keys`
    /// is an earlier turn of it, not a shared head); 0 for none, or for a worker not known.
    fn shared_head(&self, w: usize, keys: &BlockKeySeq) -> usize;
    /// Blocks at the head of `keys` that some request live on worker `w` holds, its own
    /// earlier turn included: in `w`'s KV memory now and counted in its KV usage; 0 for
    /// none, or for a worker not known.
    fn live_head(&self, w: usize, keys: &BlockKeySeq) -> usize;
}

impl<'a> Snapshot<'a> {
    /// `(worker id, position)` of each eligible worker, in `eligible` order: its load is
    /// `workers[position]` ([`Snapshot::load_at`]), and so is its entry in overlaps laid out
    /// over the same candidates ([`Overlaps::of_at`]). A lazy merge of the two ascending
    /// lists (O(|ids|), no allocation), for a policy that reads every eligible worker several
    /// times: a binary search per read ([`Snapshot::load`]) was ~3 µs of a 64-candidate
    /// decision (perf/runs/2026-12-06-candidate-reads).
    pub fn eligible_positions(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let by_id = self.ids.is_empty();
        let mut i = 0;
        self.eligible.iter().filter_map(move |&w| {
            if by_id {
                return Some((w, w));
            }
            while i < self.ids.len() && self.ids[i] < w {
                i += 1;
            }
            (self.ids.get(i) == Some(&w)).then_some((w, i))
        })
    }

    /// The load at `position` of `workers` ([`Snapshot::eligible_positions`]).
    ///
    /// # Panics
    /// When `position` is past `workers`.
    pub fn load_at(&self, position: usize) -> &'a WorkerLoad {
        &self.workers[position]
    }

    /// True when `w` is eligible.
    pub fn is_eligible(&self, w: usize) -> bool {
        self.eligible.binary_search(&w).is_ok()
    }

    /// The load of worker `w`.
    ///
    /// # Panics
    /// When `w` has no load in the snapshot (past the slots, or not a candidate).
    pub fn load(&self, w: usize) -> &'a WorkerLoad {
        self.get(w).expect("a worker of the snapshot")
    }

    /// The load of worker `w`, `None` when the snapshot has none for it.
    pub fn get(&self, w: usize) -> Option<&'a WorkerLoad> {
        if self.ids.is_empty() {
            return self.workers.get(w);
        }
        self.ids.binary_search(&w).ok().map(|i| &self.workers[i])
    }

    /// Requests on worker `w` (in flight + foreign).
    pub fn requests(&self, w: usize) -> usize {
        self.load(w).requests
    }

    /// The eligible worker with the fewest requests, ties at random (B1).
    pub fn least_loaded(&self, rng: &mut impl Rng) -> usize {
        wait::pick_min(
            self.eligible.iter().copied(),
            |w| self.requests(w) as f64,
            rng,
        )
        .unwrap_or(self.eligible[0])
    }

    /// The eligible worker with the lowest expected wait ([`expected_wait_s`]), ties at
    /// random.
    pub fn least_wait(&self, rng: &mut impl Rng) -> usize {
        self.least_wait_among(self.eligible.iter().copied(), rng)
            .unwrap_or(self.eligible[0])
    }

    /// The lowest expected wait among `candidates`, ties at random; `None` when empty.
    pub fn least_wait_among(
        &self,
        candidates: impl IntoIterator<Item = usize>,
        rng: &mut impl Rng,
    ) -> Option<usize> {
        let dark = !self
            .eligible
            .iter()
            .any(|&w| self.load(w).active.engine.is_some());
        wait::pick_min(candidates, |w| expected_wait_s(self, w, dark), rng)
    }
}

/// The facts of one request every selector reads, computed once per decision.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    /// The routing key.
    pub key: &'a RouteKey,
    /// Its token ids, if any (non-empty).
    pub ids: Option<&'a [u32]>,
    /// Router block keys of `ids` at the event index's block size (the router's otherwise);
    /// empty without ids. Shared: a booking keeps this buffer, not a copy.
    pub block_keys: BlockKeySeq,
    /// Prompt length, tokens (text: chars / `chars_per_token`, rounded up).
    pub prompt_tokens: u64,
    /// Prompt length in chars, for a request without ids (text mode); 0 without text and for
    /// a request with ids (token-mode routing never reads it).
    pub chars: usize,
    /// Block size of `block_keys`, tokens.
    pub block_size: usize,
}

impl Request<'_> {
    /// Prompt blocks, fractional (Dynamo's `request_blocks`).
    pub fn blocks(&self) -> f64 {
        self.prompt_tokens as f64 / self.block_size as f64
    }
}

/// How a policy's overlaps are chosen among the indexes ([`Router::overlaps`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OverlapRule {
    /// kvroute's: token requests on the event index when an eligible worker holds more
    /// than `threshold` of the request there; else the token tree (requests in flight that
    /// no engine has announced yet), text on the string tree.
    EventsThenTree {
        /// Share of the request, 0–1.
        threshold: f64,
    },
    /// The anchors': the event index whenever it holds anything (never the trees); else the
    /// trees.
    EventsOnly,
}

/// A queued write to a tree: applied to both copies of a [`LeftRight`], in order.
#[derive(Debug, Clone)]
pub enum TreeOp<K> {
    /// Record `key` (text or token ids) for a worker in a namespace.
    Insert(Namespace, K, TenantId),
    /// [`TreeOp::Insert`] of token ids with their block keys at the tree's block size
    /// ([`kvroute_index::TokenTree::insert_keyed`]; a string tree ignores them).
    InsertKeyed(Namespace, K, TenantId, Arc<BlockKeys>),
    /// Forget a worker everywhere.
    RemoveTenant(TenantId),
}

/// A queued write to a hash index.
#[derive(Debug, Clone)]
pub enum HashOp {
    /// Record token ids for a worker at a time (ms since the router started).
    Record(Namespace, TokenIds, TenantId, u64),
    /// Forget a worker everywhere.
    RemoveTenant(TenantId),
}

fn apply_string(t: &mut StringTree, op: &TreeOp<Box<str>>) {
    match op {
        TreeOp::Insert(ns, text, w) | TreeOp::InsertKeyed(ns, text, w, _) => {
            t.insert(*ns, text, *w)
        }
        TreeOp::RemoveTenant(w) => t.remove_tenant(*w),
    }
}

fn apply_token(t: &mut TokenTree, op: &TreeOp<TokenIds>) {
    match op {
        TreeOp::Insert(ns, ids, w) => t.insert(*ns, ids, *w),
        TreeOp::InsertKeyed(ns, ids, w, keys) => t.insert_keyed(*ns, ids, *w, &keys.keys),
        TreeOp::RemoveTenant(w) => t.remove_tenant(*w),
    }
}

/// A queued write to a model's [`PeerPages`] (replica sync).
#[derive(Debug, Clone)]
pub enum PeerOp {
    /// A peer replica sent a worker the prompt of these page keys, at a time (ms since this
    /// router started).
    Record(Box<[u64]>, TenantId, u64),
    /// Forget a worker everywhere.
    RemoveTenant(TenantId),
}

fn apply_peer(p: &mut PeerPages, op: &PeerOp) {
    match op {
        PeerOp::Record(keys, w, now) => p.record(keys, *w, *now),
        PeerOp::RemoveTenant(w) => p.remove_worker(*w),
    }
}

fn apply_hash(h: &mut HashIndex, op: &HashOp) {
    match op {
        HashOp::Record(ns, ids, w, now) => h.record(*ns, ids, *w, *now),
        HashOp::RemoveTenant(w) => h.remove_worker(*w),
    }
}

/// One index's answer for a request ([`PrefixIndex::overlaps`]: the workers holding any of
/// it), before it is laid out over a snapshot's workers.
#[derive(Debug, Clone)]
struct Answer {
    source: Source,
    unit: Unit,
    /// (worker, matched units), sorted by worker, one entry per worker.
    found: Vec<(TenantId, usize)>,
    /// The request's length, units (≥ 1).
    len: usize,
    tokens_per_unit: f64,
}

impl Answer {
    /// The answer by worker over `snap`'s workers (every slot, or its candidate set).
    fn lay_out(&self, snap: &Snapshot<'_>) -> Overlaps {
        let (found, len, per_unit) = (&self.found, self.len, self.tokens_per_unit);
        if snap.ids.is_empty() {
            let n = snap.workers.len();
            Overlaps::from_index(self.source, self.unit, found, n, len, per_unit)
        } else {
            Overlaps::from_index_among(self.source, self.unit, found, snap.ids, len, per_unit)
        }
    }
}

/// The index query of `req` at `now_ms`.
fn query<'r>(req: &'r Request<'_>, now_ms: u64) -> Query<'r> {
    Query {
        text: &req.key.text,
        ids: req.ids,
        block_keys: &req.block_keys,
        block_size: req.block_size,
        now_ms,
    }
}

/// The indexes of one model, each readable without locks.
pub struct ModelIndexes {
    /// Text requests (chars).
    pub strings: LeftRight<StringTree, TreeOp<Box<str>>>,
    /// Token-id requests (whole pages of `block_size`).
    pub tokens: LeftRight<TokenTree, TreeOp<TokenIds>>,
    /// Hash mode only.
    pub hash: Option<LeftRight<HashIndex, HashOp>>,
    /// Page keys other router replicas reported ([`crate::sync`]); empty without sync.
    pub peers: LeftRight<PeerPages, PeerOp>,
}

/// Every policy's parameters, resolved once from [`Config`] (presets replace the knobs with
/// their anchor's defaults).
#[derive(Debug, Clone, Copy)]
struct Params {
    cache_aware: CacheAwareParams,
    kv: KvParams,
    ttft: TtftParams,
    hash_tokens: usize,
    hash_load_factor: f64,
    chars_per_token: f64,
    rule: OverlapRule,
    /// `--cache-threshold`, for [`Router::dp_rank`].
    cache_threshold: f64,
    full_scan: usize,
    holders: usize,
    sample: usize,
}

impl Params {
    fn of(cfg: &Config) -> Self {
        let k = &cfg.knobs;
        let kvroute_rule = OverlapRule::EventsThenTree {
            threshold: cfg.cache_threshold,
        };
        let (cache_aware, kv, rule) = match cfg.policy {
            PolicyKind::SmgCacheAware => (
                CacheAwareParams::smg(),
                KvParams::of(k),
                OverlapRule::EventsOnly,
            ),
            PolicyKind::DynamoKv => (
                CacheAwareParams::of(cfg),
                KvParams::dynamo(),
                OverlapRule::EventsOnly,
            ),
            PolicyKind::KvAware => (
                CacheAwareParams::of(cfg),
                KvParams::of(k),
                OverlapRule::EventsOnly,
            ),
            _ => (CacheAwareParams::of(cfg), KvParams::of(k), kvroute_rule),
        };
        Self {
            cache_aware,
            kv,
            ttft: TtftParams::of(k),
            hash_tokens: k.prefix_hash_tokens,
            hash_load_factor: k.hash_load_factor,
            chars_per_token: k.chars_per_token,
            rule,
            cache_threshold: cfg.cache_threshold,
            full_scan: k.full_scan_workers,
            holders: k.candidate_holders,
            sample: k.candidate_sample,
        }
    }
}

/// Picks workers for requests: one per gateway, shared by all shards (`Send + Sync`).
///
/// Holds the policy and its parameters (from [`Config`]), and one [`ModelIndexes`] per model
/// (keyed by [`RouteKey::model`], created on first record). Lookups take no lock; writes are
/// queued and applied by one writer at a time.
pub struct Router {
    kind: PolicyKind,
    params: Params,
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
    /// The consistent-hash ring of prefix_hash / consistent_hash, rebuilt when the number
    /// of worker slots changes (a memo of a pure function of that number, not routing
    /// state).
    ring: arc_swap::ArcSwapOption<Ring>,
}

fn add_model(m: &mut HashMap<String, Arc<ModelIndexes>>, op: &(String, Arc<ModelIndexes>)) {
    m.entry(op.0.clone()).or_insert_with(|| Arc::clone(&op.1));
}

impl Router {
    /// A router for `cfg` (policy, its parameters, index settings).
    pub fn new(cfg: &Config) -> Self {
        Self {
            kind: cfg.policy,
            params: Params::of(cfg),
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
            ring: arc_swap::ArcSwapOption::empty(),
        }
    }

    /// Routes token-bearing requests on the event index read by `reader` (engine KV events)
    /// whenever it holds any block ([`OverlapRule`]). Called once, before the router is
    /// shared.
    pub fn set_event_index(&mut self, reader: crate::events::EventReader) {
        self.events = Some(reader);
    }

    /// The policy.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// The facts of `key` every selector reads.
    pub fn request<'k>(&self, key: &'k RouteKey) -> Request<'k> {
        let ids = key.input_ids.as_deref().filter(|v| !v.is_empty());
        let block_size = self
            .events
            .as_ref()
            .map_or(self.block_size, |e| e.block_size());
        // Only text-mode selectors read `chars`: a token request is not charged the count.
        let chars = if key.text.is_empty() || ids.is_some() {
            0
        } else {
            key.text.chars().count()
        };
        let prompt_tokens = match ids {
            Some(ids) => ids.len() as u64,
            None => (chars as f64 / self.params.chars_per_token).ceil() as u64,
        };
        // Keys of the request's namespace: the event index roots each cache partition's
        // chain at its namespace, so other partitions' blocks never match. (The event
        // index's keys are `block_keys_in` at its block size.) The blocks an earlier turn
        // shares with this one are taken from its memo, when made at the same namespace and
        // block size; this request's keys are left there for the next turn.
        let block_keys = match ids {
            Some(ids) => {
                let memo = &key.block_key_memo;
                let ns = key.namespace;
                // The earlier turn's keys then this one's new blocks, in place in that turn's
                // buffer when this request extends it (`crate::ids`): no copy of the known.
                let keys = match memo.known(ns, block_size) {
                    Some(known) => {
                        // At most the full blocks of these ids (a memo is made for them).
                        let n = known.len().min(ids.len() / block_size);
                        let new = kvroute_index::keys::block_keys_extending(
                            ns,
                            ids,
                            block_size,
                            &known[..n],
                        );
                        known.head_then(n, &new)
                    }
                    None => BlockKeySeq::with_headroom(&kvroute_index::keys::block_keys_in(
                        ns, ids, block_size,
                    )),
                };
                memo.keep(ns, block_size, &keys);
                keys
            }
            None => BlockKeySeq::default(),
        };
        Request {
            key,
            ids,
            block_keys,
            prompt_tokens,
            chars,
            block_size,
        }
    }

    /// The overlaps of `req` with every worker of `snap`, from the index its policy's
    /// [`OverlapRule`] picks (see [`prefix`]). Reads only.
    pub fn overlaps(&self, snap: &Snapshot<'_>, req: &Request<'_>) -> Overlaps {
        let events = self.event_answer(req, snap.now_ms);
        self.pick(snap, events.as_ref(), || self.tree_answer(req, snap.now_ms))
    }

    /// The event index's answer for `req`: `None` without token ids, without an event
    /// index, or while it holds nothing.
    fn event_answer(&self, req: &Request<'_>, now_ms: u64) -> Option<Answer> {
        let ev = self.event_reader(req)?;
        Some(Self::events_found(
            req,
            ev.overlaps(req.key.namespace, &query(req, now_ms)),
        ))
    }

    /// The event index when it answers `req`: `req` has token ids and the index holds a
    /// block.
    fn event_reader(&self, req: &Request<'_>) -> Option<&crate::events::EventReader> {
        req.ids?;
        self.events.as_ref().filter(|e| !e.is_empty())
    }

    /// The DP rank of `worker` to pin `req` to (vLLM and SGLang take it as the
    /// `X-data-parallel-rank` header), when the event index shows one of the worker's ranks
    /// holding more of the prompt than each of its other ranks, and than the head that
    /// requests live on the worker hold, by over `--cache-threshold` of the prompt (SMG's
    /// affinity gate, one level down): a conversation's history on rank 1 goes to rank 1
    /// (bug-cases.md B28). A prefix that concurrent requests share (a system prompt, a
    /// popular document: live requests hold it) pins nothing, so the engine's own balancer
    /// spreads those requests over its ranks instead of herding them onto the first rank
    /// that cached it (B8 / B9 one level down). Ranks are the event streams' (`0..dp`, on
    /// the events port plus the rank): the engine's DP start rank must be 0. `None` for a
    /// worker with one stream (no DP), without token ids or events, or when no rank stands
    /// out. Read-only; for a worker with several ranks, one index query (a decision's cost
    /// on a large fleet) and one lock of its live paths, else nothing.
    pub fn dp_rank(&self, snap: &Snapshot<'_>, req: &Request<'_>, worker: usize) -> Option<u32> {
        let ev = self.event_reader(req)?;
        if ev.streams_of(worker as u32) < 2 {
            return None;
        }
        let mut ranks = ev.holders(&req.block_keys).by_rank(worker as u32);
        if ranks.len() < 2 {
            return None;
        }
        ranks.sort_unstable_by_key(|&(rank, tokens)| (std::cmp::Reverse(tokens), rank));
        let live = snap
            .live
            .map_or(0, |l| l.live_head(worker, &req.block_keys) * req.block_size);
        let gap = ranks[0].1.saturating_sub(ranks[1].1.max(live)) as f64;
        (gap > self.params.cache_threshold * req.prompt_tokens as f64).then_some(ranks[0].0)
    }

    /// The event index's [`Answer`] of `req` holding `found`.
    fn events_found(req: &Request<'_>, found: Vec<(TenantId, usize)>) -> Answer {
        Answer {
            source: Source::Events,
            unit: Unit::Tokens,
            found,
            len: req.prompt_tokens.max(1) as usize,
            tokens_per_unit: 1.0,
        }
    }

    /// The approximate index's answer for `req` (the model's hash index, token tree or
    /// string tree, raised to what peer replicas reported), `Source::None` without one.
    fn tree_answer(&self, req: &Request<'_>, now_ms: u64) -> Answer {
        let ns: Namespace = req.key.namespace;
        let q = query(req, now_ms);
        let tokens_per_char = req.prompt_tokens as f64 / req.chars.max(1) as f64;
        let (source, unit, len, tokens_per_unit) = match req.ids {
            Some(_) => (
                Source::None,
                Unit::Tokens,
                req.prompt_tokens.max(1) as usize,
                1.0,
            ),
            None => (Source::None, Unit::Chars, req.chars, tokens_per_char),
        };
        let mut a = Answer {
            source,
            unit,
            found: Vec::new(),
            len: len.max(1),
            tokens_per_unit,
        };
        let Some(idx) = self.existing_model(&req.key.model) else {
            return a;
        };
        match (req.ids, &idx.hash) {
            (Some(_), Some(h)) => {
                a.source = Source::HashIndex;
                a.found = h.read().overlaps(ns, &q);
                prefix::by_worker(&mut a.found);
            }
            (Some(_), None) => {
                a.source = Source::TokenTree;
                a.found = idx.tokens.read().overlaps(ns, &q);
                prefix::by_worker(&mut a.found);
                self.with_peers(&mut a, &idx, req, now_ms);
            }
            // Text in hash mode: no index.
            (None, Some(_)) => {}
            (None, None) => {
                a.source = Source::StringTree;
                a.found = idx.strings.read().overlaps(ns, &q);
                prefix::by_worker(&mut a.found);
                self.with_peers(&mut a, &idx, req, now_ms);
            }
        }
        a
    }

    /// The overlaps a decision on `snap` reads: the event index's answer `events` when the
    /// policy's [`OverlapRule`] takes it, else the approximate index's (`tree`, asked only
    /// then), laid out over the snapshot's workers.
    fn pick(
        &self,
        snap: &Snapshot<'_>,
        events: Option<&Answer>,
        tree: impl FnOnce() -> Answer,
    ) -> Overlaps {
        if let Some(a) = events {
            let o = a.lay_out(snap);
            match self.params.rule {
                OverlapRule::EventsOnly => return o,
                OverlapRule::EventsThenTree { threshold } => {
                    let over = |(w, at)| o.of_at(at, w) as f64 / o.len as f64 > threshold;
                    if snap.eligible_positions().any(over) {
                        return o;
                    }
                }
            }
        }
        tree().lay_out(snap)
    }

    /// Chooses a worker among `snap.eligible` for `key`. Read-only: nothing is written into
    /// any index (that is [`Router::record`]'s job, once the request is committed), so an
    /// attempt that fails can decide again with its worker vetoed. Randomness only breaks
    /// ties and draws samples: with a seeded `rng` the same request, snapshot and index state
    /// give the same decision (the simulator, `kvroute_bench::sim`). Each policy is
    /// documented in its own file (module doc's table).
    ///
    /// # Panics
    /// When `snap.eligible` is empty or names an id `>= snap.workers.len()`.
    pub fn decide(&self, snap: &Snapshot<'_>, key: &RouteKey, rng: &mut impl Rng) -> Decision {
        self.decide_request(snap, &self.request(key), rng)
    }

    /// [`Router::decide`] on facts already made by [`Router::request`]: a caller that decides
    /// again (a retry) and books makes them once per request, so a prompt's block keys are
    /// hashed once, not per attempt and per booking.
    ///
    /// # Panics
    /// As [`Router::decide`].
    pub fn decide_request(
        &self,
        snap: &Snapshot<'_>,
        req: &Request<'_>,
        rng: &mut impl Rng,
    ) -> Decision {
        self.select(snap, req, || self.overlaps(snap, req), rng)
    }

    /// The policy's selector on `snap`, reading the overlaps `ov` makes only if it reads
    /// overlaps at all.
    fn select(
        &self,
        snap: &Snapshot<'_>,
        req: &Request<'_>,
        ov: impl FnOnce() -> Overlaps,
        rng: &mut impl Rng,
    ) -> Decision {
        assert!(!snap.eligible.is_empty(), "decide needs an eligible worker");
        let key = req.key;
        let p = &self.params;
        match self.kind {
            PolicyKind::RoundRobin => round_robin::decide(snap),
            PolicyKind::Random => random::decide(snap, rng),
            PolicyKind::LeastRequest => least_request::decide(snap, rng),
            PolicyKind::PowerOfTwo => power_of_two::decide(snap, rng),
            PolicyKind::LeastLoad => least_load::decide(snap, rng),
            PolicyKind::PrefixHash => prefix_hash::decide(
                &self.ring(snap),
                snap,
                req,
                p.hash_tokens,
                p.hash_load_factor,
                rng,
            ),
            PolicyKind::ConsistentHash => {
                consistent_hash::decide(&self.ring(snap), snap, key, p.hash_load_factor, rng)
            }
            PolicyKind::CacheAware | PolicyKind::SmgCacheAware => {
                if req.ids.is_none() && req.chars == 0 {
                    return Decision {
                        worker: snap.least_wait(rng),
                        reason: Reason::CacheMiss,
                    };
                }
                cache_aware::decide(&p.cache_aware, snap, req, &ov(), rng)
            }
            PolicyKind::KvAware | PolicyKind::DynamoKv => {
                kv_aware::decide(&p.kv, snap, req, &ov(), rng)
            }
            PolicyKind::PureAffinity => pure_affinity::decide(snap, &ov(), rng),
            PolicyKind::PredictedTtft => predicted_ttft::decide(&p.ttft, snap, req, &ov(), rng),
        }
    }

    /// Fleets of up to this many worker slots are scored whole by [`Router::decide_on`]
    /// (`full_scan_workers`, [`crate::config::defaults::FULL_SCAN_WORKERS`]).
    pub fn full_scan_workers(&self) -> usize {
        self.params.full_scan
    }

    /// Decides for `req` on the registry `fleet`: a snapshot of the workers that may take it
    /// (serving `req.key.model`, available, not in `vetoed`: [`Workers::snapshot`]), then the
    /// policy. Returns the view decided on, whose loads [`Router::booking_request`] reads
    /// (with [`FleetView::snapshot`]), and the decision; `None` when no worker is eligible.
    ///
    /// A fleet of up to `full_scan_workers` slots is snapshot and scored whole
    /// ([`Router::decide_request`]), as is every fleet under the policies that rotate over,
    /// draw from or hash onto every worker (`round_robin`, `random`, `prefix_hash`,
    /// `consistent_hash`) and under the anchor presets (`smg_cache_aware`, `dynamo_kv`,
    /// which score every worker as their anchors do). Above it kvroute's own load and cost
    /// policies score a candidate set ([`candidates`]: the `candidate_holders` deepest
    /// holders in each index answer the policy may read, and `candidate_sample` random
    /// workers), so the snapshot and the policy cost O(candidates), not O(workers) (issue
    /// 16). The approximate tree is not asked when the event index answers over the
    /// threshold (`--cache-threshold`, [`OverlapRule::EventsThenTree`]): at 4,096 workers ×
    /// 32k tokens its walk over ~2,080 block keys was ~8 µs of a ~40 µs decide stage
    /// (`perf/runs/2026-12-05-fleet-decide`). When fewer than a quarter of `candidate_sample`
    /// candidates are eligible (a model few workers serve, a fleet mostly down), or when the
    /// event holders over the threshold are all ineligible, the decision falls back to the
    /// whole fleet.
    pub fn decide_on(
        &self,
        fleet: &Workers,
        vetoed: &[usize],
        seq: u64,
        now_ms: u64,
        req: &Request<'_>,
        rng: &mut impl Rng,
    ) -> Option<(FleetView, Decision)> {
        let p = &self.params;
        let model = &req.key.model;
        let whole = |rng: &mut _| {
            let view = fleet.snapshot(model, vetoed, now_ms);
            if view.eligible.is_empty() {
                return None;
            }
            let d = self.decide_request(&view.snapshot(seq, now_ms), req, rng);
            Some((view, d))
        };
        let reads_overlaps = match self.kind {
            PolicyKind::LeastRequest | PolicyKind::PowerOfTwo | PolicyKind::LeastLoad => false,
            PolicyKind::CacheAware
            | PolicyKind::KvAware
            | PolicyKind::PureAffinity
            | PolicyKind::PredictedTtft => true,
            _ => return whole(rng),
        };
        let slots = fleet.slots();
        if slots <= p.full_scan {
            return whole(rng);
        }
        // The event index answers grouped by depth: only its deepest holders and the
        // candidates are mapped to workers, not every holder (a fleet-wide system prompt is
        // held by every worker).
        let holders = reads_overlaps
            .then(|| self.event_reader(req).map(|ev| ev.holders(&req.block_keys)))
            .flatten();
        let mut deepest = Vec::with_capacity(p.holders);
        if let Some(h) = &holders {
            h.deepest(p.holders, rng, &mut deepest);
        }
        // The tree is asked now, its deepest holders becoming candidates, unless the events
        // answer is the one `pick` takes whatever the eligibility: always under `EventsOnly`,
        // and under `EventsThenTree` when a deepest holder is over the threshold (if none of
        // them turns out eligible, the whole fleet decides, below).
        let events_suffice = holders.is_some()
            && match p.rule {
                OverlapRule::EventsOnly => true,
                OverlapRule::EventsThenTree { threshold } => deepest
                    .first()
                    .is_some_and(|&(_, t)| t as f64 / req.prompt_tokens.max(1) as f64 > threshold),
            };
        let tree = (reads_overlaps && !events_suffice).then(|| self.tree_answer(req, now_ms));
        let answers: Vec<&[(TenantId, usize)]> = tree.iter().map(|a| a.found.as_slice()).collect();
        let ids = candidates::choose(
            deepest.iter().map(|&(w, _)| w as usize),
            &answers,
            slots,
            p.holders,
            p.sample,
            rng,
        );
        let view = fleet.snapshot_among(model, vetoed, now_ms, &ids);
        if view.eligible.len() < (p.sample / 4).max(1) {
            return whole(rng);
        }
        // The event answer over the candidates (sorted by worker, as `ids`).
        let events = holders.map(|h| Self::events_found(req, h.tokens_among(&ids)));
        let snap = view.snapshot(seq, now_ms);
        let ov = if reads_overlaps {
            let ov = self.pick(&snap, events.as_ref(), || {
                tree.unwrap_or_else(|| self.tree_answer(req, now_ms))
            });
            if events_suffice && ov.source != Source::Events {
                // The deep holders are all ineligible and the tree's were not candidates.
                return whole(rng);
            }
            Some(ov)
        } else {
            None
        };
        let d = self.select(
            &snap,
            req,
            || ov.expect("read when the policy reads overlaps"),
            rng,
        );
        Some((view, d))
    }

    /// What dispatching `key` to `decision.worker` books on that worker's load
    /// ([`crate::load::active`]): the prompt's tokens, the cached tokens the decision
    /// predicted, the predicted prefill time from the worker's learned curve, and the
    /// prompt's blocks (keyed when it has token ids). Reads only.
    pub fn booking(&self, snap: &Snapshot<'_>, key: &RouteKey, decision: &Decision) -> Booking {
        self.booking_request(snap, &self.request(key), decision)
    }

    /// [`Router::booking`] on facts already made by [`Router::request`] (see
    /// [`Router::decide_request`]).
    pub fn booking_request(
        &self,
        snap: &Snapshot<'_>,
        req: &Request<'_>,
        decision: &Decision,
    ) -> Booking {
        let cached = decision
            .reason
            .predicted_cached_tokens(req.prompt_tokens)
            .unwrap_or(0)
            .min(req.prompt_tokens);
        let mut b = Booking {
            prompt_tokens: req.prompt_tokens,
            cached_tokens: cached,
            prefill_ms: 0.0,
            unkeyed_blocks: if req.ids.is_none() {
                req.prompt_tokens / req.block_size as u64
            } else {
                0
            },
            block_keys: req.block_keys.clone(),
        };
        if let Some(w) = snap.get(decision.worker) {
            let a = &w.active;
            b.prefill_ms = a.prefill.prefill_ms(
                b.new_tokens(),
                a.step_tokens,
                predicted_ttft::decode_load(w),
            );
        }
        b
    }

    fn ring(&self, snap: &Snapshot<'_>) -> Arc<Ring> {
        let n = snap.workers.len();
        if let Some(r) = self.ring.load_full().filter(|r| r.slots() == n) {
            return r;
        }
        let r = Arc::new(Ring::new(n));
        self.ring.store(Some(Arc::clone(&r)));
        r
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
            peers: LeftRight::new(PeerPages::new(self.peer_cfg()), apply_peer),
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

    /// Writes `decision` into the approximate indexes of `key.model` at `now_ms` (the
    /// [`Router::now_ms`] time base): the request's text or ids are now held by
    /// `decision.worker` (policies that read overlaps only, [`PolicyKind::records`]). Call it
    /// once per request, when it is committed to its worker; each tree keeps itself within
    /// its budget at every insert. A request with neither text nor ids records nothing.
    pub fn record(&self, key: &RouteKey, decision: &Decision, now_ms: u64) {
        if !self.kind.records() {
            return;
        }
        let ids = key.input_ids.as_ref().filter(|v| !v.is_empty());
        if key.text.is_empty() && ids.is_none() {
            return;
        }
        let idx = self.model(&key.model);
        let ns: Namespace = key.namespace;
        let worker = decision.worker as TenantId;
        match (ids, &idx.hash) {
            (Some(ids), Some(h)) => h.write(HashOp::Record(ns, ids.clone(), worker, now_ms)),
            // With the keys Router::request left in the key's memo at the tree's block size.
            (Some(ids), None) => {
                let ids = ids.clone();
                let op = match key.block_key_memo.kept(ns, self.block_size) {
                    Some(keys) => TreeOp::InsertKeyed(ns, ids, worker, keys),
                    None => TreeOp::Insert(ns, ids, worker),
                };
                idx.tokens.write(op);
            }
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
            m.peers.write(PeerOp::RemoveTenant(t));
            m.strings.write(TreeOp::RemoveTenant(t));
            m.tokens.write(TreeOp::RemoveTenant(t));
            if let Some(h) = &m.hash {
                h.write(HashOp::RemoveTenant(t));
            }
        }
    }

    /// Applies every queued write now (tests and shutdown; records apply their writes as
    /// they go).
    /// Replays the last records on the indexes' second copies ([`LeftRight::catch_up`]), so
    /// the next record applies only its own write: the work of the gateway's `kv-index`
    /// thread, every [`crate::config::defaults::INDEX_WRITER_PERIOD_MS`]. A record is read by
    /// the next decision as soon as it returns either way; without the catch-up the next
    /// record replays it, and a 33k-token prompt's new path made that record cost 20–70 µs on
    /// a shard (`perf/runs/2026-12-06-index-writer/`).
    pub fn catch_up(&self) {
        let models: Vec<Arc<ModelIndexes>> = self.models.read().values().cloned().collect();
        for m in &models {
            m.strings.catch_up();
            m.tokens.catch_up();
            if let Some(h) = &m.hash {
                h.catch_up();
            }
            m.peers.catch_up();
        }
    }

    pub fn flush(&self) {
        // Not under the model map's read guard: a new model's first record waits for it.
        let models: Vec<Arc<ModelIndexes>> = self.models.read().values().cloned().collect();
        for m in &models {
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
            while !m.peers.flush() && m.peers.pending() > 0 {
                std::thread::yield_now();
            }
        }
    }

    /// Settings of each model's [`PeerPages`]: holders live as long as a hash-index holder
    /// (`cache_ttl_secs`, one definition), and it keeps as many pages as the larger of the
    /// two trees' budgets holds (`max_tree_size_chars` / [`crate::sync::TEXT_PAGE_BYTES`],
    /// `max_tree_size_tokens` / `block_size`), so sync at most doubles an index's memory.
    fn peer_cfg(&self) -> PeerPagesConfig {
        PeerPagesConfig {
            ttl_ms: self.hash_cfg.ttl_ms,
            max_pages: (self.max_tree_size_chars / crate::sync::TEXT_PAGE_BYTES)
                .max(self.max_tree_size_tokens / self.block_size)
                .max(1),
        }
    }

    /// Tokens per page of the token tree and of replica sync's token pages.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The page keys replica sync sends for `key` ([`crate::sync::PageKeys`]): its token ids'
    /// block keys when it has ids, else its routing text's pages; `None` when this router
    /// records nothing ([`PolicyKind::records`]) or the request has neither.
    pub fn page_keys(&self, key: &RouteKey) -> Option<crate::sync::PageKeys> {
        use crate::sync::{PageKeys, PageUnit, TEXT_PAGE_BYTES};
        if !self.kind.records() {
            return None;
        }
        match key.input_ids.as_deref().filter(|v| !v.is_empty()) {
            Some(ids) => Some(PageKeys {
                unit: PageUnit::Tokens {
                    block: self.block_size as u32,
                },
                keys: kvroute_index::keys::block_keys_in(key.namespace, ids, self.block_size),
            }),
            None if !key.text.is_empty() => Some(PageKeys {
                unit: PageUnit::Text {
                    bytes: TEXT_PAGE_BYTES as u32,
                },
                keys: kvroute_index::keys::text_page_keys(
                    key.namespace,
                    key.text.as_bytes(),
                    TEXT_PAGE_BYTES,
                ),
            }),
            None => None,
        }
    }

    /// Records that a peer replica sent worker `worker` (this router's id) a prompt of
    /// `model` with these page keys, at `now_ms` ([`Router::now_ms`] time base). Returns
    /// false, recording nothing, when their unit is not this router's (another block size or
    /// text page size).
    pub fn record_peer(
        &self,
        model: &str,
        pages: &crate::sync::PageKeys,
        worker: usize,
        now_ms: u64,
    ) -> bool {
        use crate::sync::{PageUnit, TEXT_PAGE_BYTES};
        let ours = match pages.unit {
            PageUnit::Tokens { block } => block as usize == self.block_size,
            PageUnit::Text { bytes } => bytes as usize == TEXT_PAGE_BYTES,
        };
        if !ours {
            return false;
        }
        self.model(model).peers.write(PeerOp::Record(
            pages.keys.as_slice().into(),
            worker as TenantId,
            now_ms,
        ));
        true
    }

    /// `a` (a tree's answer) raised, worker by worker, to what peer replicas reported
    /// ([`PeerPages`]): tokens = pages × block size; chars = the chars of the text's first
    /// pages × [`crate::sync::TEXT_PAGE_BYTES`] bytes. `a` unchanged without peer pages.
    fn with_peers(&self, a: &mut Answer, idx: &ModelIndexes, req: &Request<'_>, now_ms: u64) {
        use crate::sync::TEXT_PAGE_BYTES;
        let peers = idx.peers.read();
        if peers.is_empty() {
            return;
        }
        let ns = req.key.namespace;
        let found = match req.ids {
            Some(ids) => {
                let own;
                let keys: &[u64] = if req.block_size == self.block_size {
                    &req.block_keys
                } else {
                    own = kvroute_index::keys::block_keys_in(ns, ids, self.block_size);
                    &own
                };
                peers
                    .overlaps(keys, now_ms)
                    .into_iter()
                    .map(|(w, p)| (w, p * self.block_size))
                    .collect::<Vec<_>>()
            }
            None => {
                let text = req.key.text.as_bytes();
                let keys = kvroute_index::keys::text_page_keys(ns, text, TEXT_PAGE_BYTES);
                peers
                    .overlaps(&keys, now_ms)
                    .into_iter()
                    .map(|(w, p)| {
                        let bytes = &text[..(p * TEXT_PAGE_BYTES).min(text.len())];
                        // Chars of the prefix: every byte that does not continue a UTF-8
                        // sequence starts a char.
                        (w, bytes.iter().filter(|&&b| (b as i8) >= -0x40).count())
                    })
                    .collect()
            }
        };
        if !found.is_empty() {
            a.found.extend(found);
            prefix::by_worker(&mut a.found);
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

/// Test helper: one request the way the gateway runs it when every worker is eligible and
/// loads are request counts only — [`Router::decide`] on a snapshot of `loads` (seq from a
/// per-thread counter, so round_robin takes turns), then [`Router::record`].
#[cfg(test)]
impl Router {
    pub(crate) fn decide_all(&self, key: &RouteKey, loads: &[usize]) -> Decision {
        thread_local!(static SEQ: std::cell::Cell<u64> = const { std::cell::Cell::new(0) });
        let seq = SEQ.with(|s| {
            let v = s.get();
            s.set(v + 1);
            v
        });
        let workers = WorkerLoad::of_requests(loads);
        let eligible: Vec<usize> = (0..loads.len()).collect();
        let now = self.now_ms();
        let snap = Snapshot {
            workers: &workers,
            ids: &[],
            eligible: &eligible,
            seq,
            now_ms: now,
            live: None,
        };
        let d = self.decide(&snap, key, &mut rand::rng());
        self.record(key, &d, now);
        d
    }
}
