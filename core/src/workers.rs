//! [`Workers`]: the registry of engines behind the gateway, shared by all shards, changed at
//! run time (admin API, SIGHUP) without a lock on the request path; [`Worker`]: one engine's
//! counts and state (health, circuit breaker, draining, models); [`LoadGuard`]: one request
//! counted on one worker, released exactly once.
//!
//! Which workers a request may go to is decided here, once per attempt, by
//! [`Workers::snapshot`]: the eligible set handed to the policy ([`crate::policy::Snapshot`]).
//! A worker is eligible for a request when all of these hold (operations.md §1, "eligible
//! set"):
//!
//! | condition | changed by |
//! |---|---|
//! | not removed | [`Workers::remove`] |
//! | not draining | [`Workers::drain`] |
//! | healthy | active health checks ([`Worker::record_health`]) |
//! | breaker closed or half-open | request outcomes ([`Worker::record_outcome`]) |
//! | serves the request's model (or its models are not known) | [`Worker::set_models`] |
//! | not tried yet by this request | the caller's veto list |

use crate::CoreError;
use crate::config::{WorkerSpec, parse_worker_spec, parse_worker_url};
use crate::health::{
    Breaker, BreakerConfig, BreakerState, HealthChange, HealthConfig, HealthTracker, Outcome,
};
use crate::ids::BlockKeySeq;
use crate::load::EngineReport;
use crate::load::active::{ActiveLoad, ActiveView, Booking};
use arc_swap::ArcSwap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// One worker (an engine endpoint).
#[derive(Debug)]
pub struct Worker {
    /// Id: the worker's slot in the registry, never reused (a worker added again after its
    /// removal gets a new id, so no index can mix the two); also its index tenant id.
    pub id: usize,
    /// Normalised base URL `http://host:port` (no trailing `/`).
    pub url: String,
    /// Host part of the URL.
    pub host: String,
    /// Port part of the URL.
    pub port: u16,
    /// `host:port` as sent in `Host` (IPv6 hosts in brackets).
    pub authority: String,
    /// The address its host resolved to when it was added (`None`: not resolved, as in the
    /// simulator; `io` resolves before adding).
    pub addr: Option<std::net::SocketAddr>,
    /// The spec it was added with (events, DP ranks, configured models, key variable).
    pub spec: WorkerSpec,
    /// The worker's own API key, read from `spec.api_key_env` when it was added.
    pub api_key: Option<String>,
    /// The counts and flags a decision reads, in one cache line ([`Hot`]).
    hot: Hot,
    breaker: Mutex<Breaker>,
    health: Mutex<HealthTracker>,
    models: RwLock<Vec<String>>,
    /// What this router booked on the worker (prefill, active blocks, since-poll credit,
    /// learned prefill curve).
    active: ActiveLoad,
    /// Requests other router replicas sent and reported (replica sync, [`crate::sync`]), by
    /// (origin replica, its request id): the booking's id in `active` and when it was booked
    /// (this router's clock, ms).
    peers: Mutex<HashMap<(u64, u64), (u64, f64)>>,
}

/// The words of a [`Worker`] that a decision reads (with its published active load,
/// [`ActiveLoad::prefetch`]), packed into one 64-byte line and aligned to it: a decision over
/// a candidate set reads this line of each of its ~32 candidates, workers no recent decision
/// touched, so one line per worker instead of fields spread over the `Worker` (URL strings,
/// spec, locks between them); with the prefetch, ~4 % of the decide stage
/// (perf/runs/2026-12-06-candidate-reads).
#[derive(Debug)]
#[repr(C, align(64))]
struct Hot {
    /// Requests sent and not finished (response body ended, failed, or client gone).
    in_flight: AtomicUsize,
    /// Requests ever sent.
    processed: AtomicU64,
    /// Requests the engine runs or queues that this router did not send (other router
    /// replicas, direct clients), from its last load report; 0 without reports.
    foreign: AtomicUsize,
    /// `peers.len()`, read without the lock.
    peer_requests: AtomicUsize,
    /// Time (ms on the caller's clock) before which the breaker is open; 0 = closed.
    blocked_until_ms: AtomicU64,
    /// [`models_key_of`] `models`, read without the lock by [`Worker::serves_key`].
    models_key: AtomicU64,
    /// Blocks its engine caches, from KV events; `u64::MAX` = unknown.
    cached_blocks: AtomicU64,
    healthy: AtomicBool,
    draining: AtomicBool,
}

const _: () = assert!(std::mem::size_of::<Hot>() == 64, "Hot is one cache line");

impl Worker {
    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.hot.in_flight.load(Ordering::Relaxed)
    }

    /// Requests ever sent.
    pub fn processed(&self) -> u64 {
        self.hot.processed.load(Ordering::Relaxed)
    }

    /// Requests on the engine that this router did not send, from its last load report.
    pub fn foreign(&self) -> usize {
        self.hot.foreign.load(Ordering::Relaxed)
    }

    /// Checks the invariants of its active load ([`ActiveLoad::check`]) and that every peer
    /// booking is one of them (tests).
    ///
    /// # Errors
    /// The number of the broken invariant; 100 when a peer booking is not in the active
    /// load.
    pub fn active_check(&self) -> Result<(), u8> {
        self.active.check()?;
        let view = self.active.view(0.0);
        if self.peer_requests() != lock(&self.peers).len()
            || (view.prefill_requests > self.in_flight() + self.peer_requests())
        {
            return Err(100);
        }
        Ok(())
    }

    /// Blocks at the head of `keys` that a live request booked on this worker, other than an
    /// earlier turn of that prompt, shares ([`ActiveLoad::shared_head`]).
    pub fn shared_head(&self, keys: &BlockKeySeq) -> usize {
        self.active.shared_head(keys)
    }

    /// Blocks at the head of `keys` that a live request booked on this worker holds
    /// ([`ActiveLoad::live_head`]).
    pub fn live_head(&self, keys: &BlockKeySeq) -> usize {
        self.active.live_head(keys)
    }

    /// Requests other router replicas reported sending here and not yet ending
    /// ([`Worker::book_peer`]).
    pub fn peer_requests(&self) -> usize {
        self.hot.peer_requests.load(Ordering::Relaxed)
    }

    /// Load as policies see it: own in-flight requests + peers' + foreign ones.
    pub fn load(&self) -> usize {
        self.in_flight() + self.peer_requests() + self.foreign()
    }

    /// Books request `req` of peer replica `origin` on this worker at `now_ms` (this
    /// router's clock), as [`Worker::acquire_booked`] books its own: it counts in
    /// [`Worker::load`] and its prefill and blocks in the active load, until
    /// [`Worker::peer_done`] or [`Worker::expire_peers`]. Its first token teaches the
    /// prefill curve like an own request's: both ends reach this router one delivery delay
    /// late, so the delay cancels (without peers' samples, two replicas in the simulator
    /// learned curves 4× off and lost 15 points of hit rate, `perf/runs/2026-12-01-replicas`). Returns false, and books nothing,
    /// when that request is already booked (a message delivered twice).
    pub fn book_peer(&self, origin: u64, req: u64, booking: Booking, now_ms: f64) -> bool {
        let mut peers = lock(&self.peers);
        if peers.contains_key(&(origin, req)) {
            return false;
        }
        let in_flight = self.in_flight() + peers.len();
        let id = self.active.book(booking, now_ms, in_flight);
        peers.insert((origin, req), (id, now_ms));
        self.hot.peer_requests.store(peers.len(), Ordering::Relaxed);
        true
    }

    /// The first token of peer request (`origin`, `req`) reached its router: its prefill
    /// charge ends at `now_ms`. Returns false when no such request is booked.
    pub fn peer_first_token(&self, origin: u64, req: u64, now_ms: f64) -> bool {
        let peers = lock(&self.peers);
        let Some(&(id, _)) = peers.get(&(origin, req)) else {
            return false;
        };
        self.active.first_token(id, now_ms);
        true
    }

    /// Peer request (`origin`, `req`) ended, with the engine's `usage` as (prompt tokens,
    /// cached tokens) when its router saw one: its booking goes, and, as for this router's
    /// own ([`LoadGuard::served`]), its first token teaches the worker's prefill curve when
    /// it was alone. Returns false when no such request is booked (never booked here, ended
    /// already, or expired), so an end counts once.
    pub fn peer_done(&self, origin: u64, req: u64, usage: Option<(u64, u64)>) -> bool {
        let mut peers = lock(&self.peers);
        let Some((id, _)) = peers.remove(&(origin, req)) else {
            return false;
        };
        if let Some((prompt, cached)) = usage {
            self.active.served(id, prompt, cached);
        }
        self.active.free(id);
        self.hot.peer_requests.store(peers.len(), Ordering::Relaxed);
        true
    }

    /// Ends every peer request booked before `before_ms` (its end was lost: the peer died,
    /// or the bus dropped the message) and every one of replica `origin` when given (a peer
    /// that left). Returns how many ended.
    pub fn expire_peers(&self, before_ms: f64, origin: Option<u64>) -> usize {
        self.end_peers(|o, _, at| at < before_ms || origin == Some(o))
    }

    /// Ends every request of peer replica `origin` booked here whose id is not `live`
    /// (the peer's heartbeat, [`crate::sync::SyncMsg::Live`], no longer lists it: its end
    /// was lost). Returns how many ended.
    pub fn retain_peers(&self, origin: u64, live: impl Fn(u64) -> bool) -> usize {
        self.end_peers(|o, req, _| o == origin && !live(req))
    }

    /// Ends the peer bookings `end(origin, req, booked_at_ms)` picks; returns how many.
    fn end_peers(&self, end: impl Fn(u64, u64, f64) -> bool) -> usize {
        let mut peers = lock(&self.peers);
        let n = peers.len();
        peers.retain(|&(o, req), &mut (id, at)| {
            let ended = end(o, req, at);
            if ended {
                self.active.free(id);
            }
            !ended
        });
        self.hot.peer_requests.store(peers.len(), Ordering::Relaxed);
        n - peers.len()
    }

    /// Records a load report: the engine runs or queues `engine_requests` (running +
    /// waiting, [`crate::load::engine_requests`]). The foreign part is what exceeds this
    /// router's own in-flight count and its peers' reported requests now, clamped at 0: requests still on their way to the
    /// engine, or relaying their last bytes from it, make it read low, never high. `None`
    /// (no report, or a failed poll) forgets the last one, so a dark engine is counted on
    /// this router's own requests only.
    pub fn report(&self, engine_requests: Option<usize>) {
        self.report_engine(engine_requests.map(EngineReport::requests));
    }

    /// [`Worker::report`] with the whole report ([`crate::load::engine_report`]): its running
    /// and waiting requests make the foreign part, the rest (KV usage) reaches policies
    /// through [`Worker::load_view`], and the since-poll credit restarts.
    pub fn report_engine(&self, report: Option<EngineReport>) {
        let known = self.in_flight() + self.peer_requests();
        let foreign = report.map_or(0, |r| r.total().saturating_sub(known));
        self.hot.foreign.store(foreign, Ordering::Relaxed);
        self.active.report(report);
    }

    /// Counts one request on this worker until the returned guard drops. Take it before the
    /// request is sent upstream (bug-cases.md B1). Books nothing else (no prefill, no
    /// blocks): [`Worker::acquire_booked`] does.
    pub fn acquire(self: &Arc<Self>) -> LoadGuard {
        self.hot.in_flight.fetch_add(1, Ordering::Relaxed);
        self.hot.processed.fetch_add(1, Ordering::Relaxed);
        LoadGuard {
            worker: Arc::clone(self),
            booking: None,
            observer: None,
        }
    }

    /// [`Worker::acquire`], and books `booking` on the worker at `now_ms` (the caller's time
    /// base, the one its snapshots use): [`crate::load::active`]'s step 1. The guard ends the
    /// booking when it drops.
    pub fn acquire_booked(self: &Arc<Self>, booking: Booking, now_ms: f64) -> LoadGuard {
        let id = self
            .active
            .book(booking, now_ms, self.in_flight() + self.peer_requests());
        let mut g = self.acquire();
        g.booking = Some((id, now_ms, std::time::Instant::now()));
        g
    }

    /// Records the blocks the worker's engine caches (all tiers and DP ranks), as its KV
    /// events tell: the event writer calls this after applying a batch; `None` = unknown.
    pub fn set_cached_blocks(&self, blocks: Option<u64>) {
        self.hot
            .cached_blocks
            .store(blocks.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Starts loading the lines [`Worker::load_view`], [`Worker::is_available`] and
    /// [`Worker::serves_key`] read ([`kvroute_index::prefetch`]): a hint, no effect on any
    /// value.
    pub fn prefetch(&self) {
        kvroute_index::prefetch(&self.hot);
        self.active.prefetch();
    }

    /// What a policy reads of this worker at `now_ms`.
    ///
    /// Inlined with [`ActiveLoad::view`](crate::load::active::ActiveLoad::view): the ~200-byte
    /// view is then written where the caller keeps it, not built on the stack and copied
    /// twice through `memcpy` (a large-fleet decision's candidate snapshot: decide 0.90–0.95×
    /// p50 at 4,096 × 32k, perf/runs/2026-12-07-inline-load-view).
    #[inline]
    pub fn load_view(&self, now_ms: f64) -> WorkerLoad {
        WorkerLoad {
            requests: self.load(),
            in_flight: self.in_flight() + self.peer_requests(),
            processed: self.processed(),
            active: self.active.view(now_ms),
            cached_blocks: Some(self.hot.cached_blocks.load(Ordering::Relaxed))
                .filter(|&b| b != u64::MAX),
        }
    }

    /// True while active health checks pass (or are off).
    pub fn is_healthy(&self) -> bool {
        self.hot.healthy.load(Ordering::Relaxed)
    }

    /// True once [`Workers::drain`] was called: no new requests.
    pub fn is_draining(&self) -> bool {
        self.hot.draining.load(Ordering::Relaxed)
    }

    /// The breaker's state at `now_ms`.
    pub fn breaker_state(&self, now_ms: u64) -> BreakerState {
        lock(&self.breaker).state(now_ms)
    }

    /// True when the worker may take a new request at `now_ms`: healthy, not draining, its
    /// breaker not open. Lock-free.
    pub fn is_available(&self, now_ms: u64) -> bool {
        self.is_healthy()
            && !self.is_draining()
            && now_ms >= self.hot.blocked_until_ms.load(Ordering::Relaxed)
    }

    /// Records how one attempt on this worker ended at `now_ms` (see `health`'s table);
    /// returns the breaker's new state.
    pub fn record_outcome(&self, outcome: Outcome, now_ms: u64) -> BreakerState {
        let mut b = lock(&self.breaker);
        let state = b.record(outcome, now_ms);
        let until = match state {
            BreakerState::Open => now_ms.saturating_add(b.open_ms()),
            _ => 0,
        };
        self.hot.blocked_until_ms.store(until, Ordering::Relaxed);
        state
    }

    /// Records one active health check. A worker that becomes healthy again also closes its
    /// breaker (it was restarted or came back: its failures are history).
    pub fn record_health(&self, passed: bool) -> HealthChange {
        let change = lock(&self.health).record(passed);
        match change {
            HealthChange::BecameHealthy => {
                let mut b = lock(&self.breaker);
                *b = Breaker::new(b.config());
                drop(b);
                self.hot.blocked_until_ms.store(0, Ordering::Relaxed);
                self.hot.healthy.store(true, Ordering::Relaxed);
            }
            HealthChange::BecameUnhealthy => self.hot.healthy.store(false, Ordering::Relaxed),
            HealthChange::Same => {}
        }
        change
    }

    /// The models the worker serves: from its spec, else from its last `/v1/models`; empty
    /// while unknown.
    pub fn models(&self) -> Vec<String> {
        self.models.read().map(|m| m.clone()).unwrap_or_default()
    }

    /// Sets the models read from the worker's `/v1/models` (ignored when the spec names
    /// them: the operator's word wins).
    pub fn set_models(&self, models: Vec<String>) {
        if self.spec.models.is_empty()
            && let Ok(mut m) = self.models.write()
        {
            self.hot
                .models_key
                .store(models_key_of(&models), Ordering::Relaxed);
            *m = models;
        }
    }

    /// [`Worker::serves`] for `model` of [`model_key`] `key`, without a lock unless the
    /// worker serves several models. Fleet snapshots call it per worker: a lock's read-modify-
    /// write per worker stalled on each worker's cache line in turn (the `RwLock` was a third
    /// of `Workers::snapshot` at 4,096 workers, `kvroute bench fleet`,
    /// perf/runs/2026-12-02-fleet-2).
    pub fn serves_key(&self, model: &str, key: u64) -> bool {
        if model.is_empty() {
            return true;
        }
        match self.hot.models_key.load(Ordering::Relaxed) {
            MODELS_ANY => true,
            MODELS_MANY => self.serves(model),
            k => k == key,
        }
    }

    /// True when `model` (whose [`model_key`] is `key`) is in the worker's known list: not
    /// when the list is not known yet, as [`Worker::serves_key`] would be.
    fn lists_key(&self, model: &str, key: u64) -> bool {
        match self.hot.models_key.load(Ordering::Relaxed) {
            MODELS_ANY => false,
            MODELS_MANY => self
                .models
                .read()
                .is_ok_and(|m| m.iter().any(|x| x == model)),
            k => k == key,
        }
    }

    /// True when the worker serves `model`: it is in its list, the list is not known yet, or
    /// `model` is empty (SGLang's `/generate` names none).
    pub fn serves(&self, model: &str) -> bool {
        model.is_empty()
            || self
                .models
                .read()
                .map(|m| m.is_empty() || m.iter().any(|x| x == model))
                .unwrap_or(true)
    }
}

/// How the fleet knows a model name ([`Workers::standing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelStanding {
    /// No present worker serves it: a request for it is a 404.
    Unserved,
    /// Only workers whose model lists are not known yet (before their first health check
    /// read `/v1/models`) would take it.
    Unlisted,
    /// Some worker lists it (or it is empty: `/generate` names no model).
    Listed,
}

/// [`Worker::serves_key`]'s key of a worker whose models are not known: it serves any.
const MODELS_ANY: u64 = 0;
/// The key of a worker serving several models: [`Worker::serves_key`] reads the list.
const MODELS_MANY: u64 = u64::MAX;

/// The key of one model name for [`Worker::serves_key`]: xxh3-64 of the name, never
/// [`MODELS_ANY`] or [`MODELS_MANY`]. Two names of one key (2^-64 for a pair, the odds every
/// block key of the indexes accepts) would count as one model.
pub fn model_key(model: &str) -> u64 {
    match xxhash_rust::xxh3::xxh3_64(model.as_bytes()) {
        MODELS_ANY => 1,
        MODELS_MANY => MODELS_MANY - 1,
        k => k,
    }
}

/// The key of a worker serving `models`: any when none is known, its one model's, else
/// several.
fn models_key_of(models: &[String]) -> u64 {
    match models {
        [] => MODELS_ANY,
        [m] => model_key(m),
        _ => MODELS_MANY,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// RAII token for one in-flight request: made by [`Worker::acquire`] before the request is
/// sent, dropped when the response body ends, fails, or the client goes away (bug-cases.md
/// B1, B7). `Drop` decrements exactly once.
#[derive(Debug)]
pub struct LoadGuard {
    worker: Arc<Worker>,
    /// Its booking on the worker's [`ActiveLoad`], when taken with [`Worker::acquire_booked`]:
    /// (id, dispatch time on the caller's time base in ms, dispatch instant).
    booking: Option<(u64, f64, std::time::Instant)>,
    /// Told of the request's first token and end ([`LoadGuard::observe`]), with whether the
    /// first token was told yet and the engine's usage when seen.
    observer: Option<Observed>,
}

/// Who else learns of a request's load: replica sync ([`crate::sync`]) publishes its first
/// token and end to the peer replicas. Called on the thread that holds the [`LoadGuard`];
/// each method at most once per guard.
pub trait LoadObserver: Send + Sync + std::fmt::Debug {
    /// The request's first token reached the router.
    fn first_token(&self);
    /// The request ended (its guard dropped), with the engine's `usage` as (prompt tokens,
    /// cached tokens) when seen.
    fn done(&self, usage: Option<(u64, u64)>);
}

/// A [`LoadGuard`]'s observer and what it was told.
#[derive(Debug)]
struct Observed {
    observer: Box<dyn LoadObserver>,
    first_told: AtomicBool,
    usage: std::sync::OnceLock<(u64, u64)>,
}

impl LoadGuard {
    /// The worker this guard counts on.
    pub fn worker_id(&self) -> usize {
        self.worker.id
    }

    /// The request's first token reached the router at `now_ms` (first SSE data event, or
    /// the first body byte of a non-streaming response): its prefill charge ends
    /// ([`crate::load::active`] step 2). Later calls do nothing.
    pub fn first_token(&self, now_ms: f64) {
        if let Some((id, _, _)) = self.booking {
            self.worker.active.first_token(id, now_ms);
        }
        self.tell_first_token();
    }

    /// From now on `observer` learns of this request's first token and its end (once each;
    /// a first token already seen is not told again).
    pub fn observe(&mut self, observer: Box<dyn LoadObserver>) {
        self.observer = Some(Observed {
            observer,
            first_told: AtomicBool::new(false),
            usage: std::sync::OnceLock::new(),
        });
    }

    fn tell_first_token(&self) {
        if let Some(o) = &self.observer
            && !o.first_told.swap(true, Ordering::Relaxed)
        {
            o.observer.first_token();
        }
    }

    /// [`LoadGuard::first_token`] now: the dispatch time plus the wall time since (the
    /// gateway's form; the simulator passes its virtual time).
    pub fn first_token_now(&self) {
        if let Some((id, at_ms, at)) = self.booking {
            let now = at_ms + at.elapsed().as_secs_f64() * 1e3;
            self.worker.active.first_token(id, now);
        }
        self.tell_first_token();
    }

    /// The engine's `usage` for the request: `prompt_tokens`, of which `cached_tokens` came
    /// from its cache (teaches the worker's prefill curve the true new-token count).
    pub fn served(&self, prompt_tokens: u64, cached_tokens: u64) {
        if let Some((id, _, _)) = self.booking {
            self.worker.active.served(id, prompt_tokens, cached_tokens);
        }
        if let Some(o) = &self.observer {
            let _ = o.usage.set((prompt_tokens, cached_tokens));
        }
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        if let Some((id, _, _)) = self.booking {
            self.worker.active.free(id);
        }
        self.worker.hot.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some(o) = self.observer.take() {
            o.observer.done(o.usage.get().copied());
        }
    }
}

/// Health and breaker settings every worker of a registry starts with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerSettings {
    /// Circuit breaker.
    pub breaker: BreakerConfig,
    /// Active health checks.
    pub health: HealthConfig,
}

impl WorkerSettings {
    /// The settings of `cfg` (`breaker_*`, `health_*`).
    pub fn of(cfg: &crate::config::Config) -> Self {
        Self {
            breaker: BreakerConfig {
                failure_threshold: cfg.breaker_failure_threshold,
                window_ms: cfg.breaker_window_secs.saturating_mul(1000),
                open_ms: cfg.breaker_open_secs.saturating_mul(1000),
                success_threshold: cfg.breaker_success_threshold,
            },
            health: HealthConfig {
                failure_threshold: cfg.health_failure_threshold,
                success_threshold: cfg.health_success_threshold,
            },
        }
    }
}

impl Default for WorkerSettings {
    fn default() -> Self {
        Self::of(&crate::config::Config::default())
    }
}

/// One worker's load as a policy reads it ([`crate::policy::Snapshot`]): made by
/// [`Worker::load_view`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WorkerLoad {
    /// Requests in flight from this router + those its peer replicas reported + foreign ones
    /// from the last engine report
    /// ([`Worker::load`]).
    pub requests: usize,
    /// Requests in flight that this router knows of: its own and those its peer replicas
    /// reported ([`Worker::book_peer`]); not the engine report's foreign ones.
    pub in_flight: usize,
    /// Requests ever sent (SMG breaks least-loaded ties on it).
    pub processed: u64,
    /// Booked prefill and blocks, since-poll credit, engine report, prefill curve.
    pub active: ActiveView,
    /// Blocks the worker's engine holds in its cache, from its KV events
    /// ([`Worker::set_cached_blocks`]); `None` without events.
    pub cached_blocks: Option<u64>,
}

impl WorkerLoad {
    /// Loads that are request counts only, one worker per entry (tests, tools).
    pub fn of_requests(requests: &[usize]) -> Vec<WorkerLoad> {
        requests
            .iter()
            .map(|&r| WorkerLoad {
                requests: r,
                in_flight: r,
                ..WorkerLoad::default()
            })
            .collect()
    }
}

/// What one attempt of a request may choose from: the registry as it was, every worker's
/// load, and the eligible ids. Made by [`Workers::snapshot`].
#[derive(Debug)]
pub struct FleetView {
    /// The registry's slots at snapshot time (`None`: a removed worker).
    pub slots: Arc<Vec<Option<Arc<Worker>>>>,
    /// Loads: by worker id, one per slot (default, all 0, for removed workers), when `ids` is
    /// empty; else one per entry of `ids`.
    pub workers: Vec<WorkerLoad>,
    /// The worker id of each entry of `workers`, ascending, for a view of a candidate set
    /// ([`Workers::snapshot_among`]); empty for a view of every slot.
    pub ids: Vec<usize>,
    /// Eligible worker ids, ascending.
    pub eligible: Vec<usize>,
}

impl FleetView {
    /// The worker with id `id`, if it was in the registry.
    pub fn worker(&self, id: usize) -> Option<&Arc<Worker>> {
        self.slots.get(id).and_then(Option::as_ref)
    }

    /// What a policy reads of this view, for the request numbered `seq` at `now_ms`.
    pub fn snapshot(&self, seq: u64, now_ms: u64) -> crate::policy::Snapshot<'_> {
        crate::policy::Snapshot {
            workers: &self.workers,
            ids: &self.ids,
            eligible: &self.eligible,
            seq,
            now_ms,
            live: Some(self),
        }
    }
}

impl crate::policy::LivePaths for FleetView {
    fn shared_head(&self, w: usize, keys: &BlockKeySeq) -> usize {
        self.worker(w).map_or(0, |w| w.shared_head(keys))
    }
    fn live_head(&self, w: usize, keys: &BlockKeySeq) -> usize {
        self.worker(w).map_or(0, |w| w.live_head(keys))
    }
}

impl crate::policy::LivePaths for Workers {
    fn shared_head(&self, w: usize, keys: &BlockKeySeq) -> usize {
        self.get(w).map_or(0, |w| w.shared_head(keys))
    }
    fn live_head(&self, w: usize, keys: &BlockKeySeq) -> usize {
        self.get(w).map_or(0, |w| w.live_head(keys))
    }
}

/// The worker registry, shared by all shards through an `Arc`. Reads (every request) load
/// one `Arc` of the slot list and touch only atomics; changes (admin API, SIGHUP) copy the
/// list and swap it.
///
/// # Invariants
/// 1. The worker in slot `i` has `id == i`; slots are never reused.
/// 2. URLs of live (present) workers are normalised and distinct.
/// 3. A worker's `in_flight` equals the number of live [`LoadGuard`]s taken on it.
/// 4. `by_url` maps exactly the present workers' URLs to their ids.
#[derive(Debug)]
pub struct Workers {
    slots: ArcSwap<Vec<Option<Arc<Worker>>>>,
    /// Present workers' ids by normalised URL ([`Workers::find_url`], once per replica sync
    /// message: a lookup, not a scan of thousands of workers); swapped with `slots`.
    by_url: ArcSwap<HashMap<String, usize>>,
    /// Serialises writers (add, remove); readers never take it.
    write: Mutex<()>,
    settings: WorkerSettings,
}

impl Workers {
    /// Registry of `specs` (worker spec strings, [`parse_worker_spec`]), ids in order, with the
    /// default health and breaker settings; every worker starts healthy.
    ///
    /// # Errors
    /// [`CoreError::BadWorkerUrl`] for a bad spec, [`CoreError::DuplicateWorker`] for a URL
    /// given twice.
    pub fn new(specs: &[String]) -> Result<Workers, CoreError> {
        Self::with_settings(specs, WorkerSettings::default())
    }

    /// [`Workers::new`] with `settings`.
    ///
    /// # Errors
    /// As [`Workers::new`].
    pub fn with_settings(specs: &[String], settings: WorkerSettings) -> Result<Workers, CoreError> {
        let w = Workers {
            slots: ArcSwap::from_pointee(Vec::new()),
            by_url: ArcSwap::from_pointee(HashMap::new()),
            write: Mutex::new(()),
            settings,
        };
        for s in specs {
            w.add(&parse_worker_spec(s)?, true)?;
        }
        Ok(w)
    }

    /// Adds a worker for `spec`, healthy or not (a worker unreachable at start-up starts
    /// unhealthy); returns its new id.
    ///
    /// # Errors
    /// - [`CoreError::DuplicateWorker`] when a present worker has the same URL.
    /// - [`CoreError::WorkerKeyUnset`] when `spec.api_key_env` names an unset or empty
    ///   variable.
    /// - [`CoreError::SameAddress`] ([`Workers::add_resolved`] only) when `addr` is a present
    ///   worker's, one that is not draining.
    pub fn add(&self, spec: &WorkerSpec, healthy: bool) -> Result<usize, CoreError> {
        self.add_resolved(spec, None, healthy)
    }

    /// [`Workers::add`] with the address its host resolved to.
    ///
    /// # Errors
    /// As [`Workers::add`].
    pub fn add_resolved(
        &self,
        spec: &WorkerSpec,
        addr: Option<std::net::SocketAddr>,
        healthy: bool,
    ) -> Result<usize, CoreError> {
        let _w = lock(&self.write);
        let (url, host, port) = parse_worker_url(&spec.url)?;
        let cur = self.slots.load_full();
        if self.by_url.load().contains_key(&url) {
            return Err(CoreError::DuplicateWorker { url });
        }
        if let Some(addr) = addr
            && let Some(other) = cur
                .iter()
                .flatten()
                .find(|w| w.addr == Some(addr) && !w.is_draining())
        {
            return Err(CoreError::SameAddress {
                url: spec.url.clone(),
                addr,
                other: other.id,
            });
        }
        let id = cur.len();
        let api_key = match &spec.api_key_env {
            None => None,
            Some(var) => match std::env::var(var) {
                Ok(key) if !key.is_empty() => Some(key),
                _ => {
                    return Err(CoreError::WorkerKeyUnset {
                        url: spec.url.clone(),
                        var: var.clone(),
                    });
                }
            },
        };
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let worker = Arc::new(Worker {
            id,
            url,
            host,
            port,
            authority,
            addr,
            spec: spec.clone(),
            api_key,
            hot: Hot {
                in_flight: AtomicUsize::new(0),
                processed: AtomicU64::new(0),
                foreign: AtomicUsize::new(0),
                peer_requests: AtomicUsize::new(0),
                blocked_until_ms: AtomicU64::new(0),
                models_key: AtomicU64::new(models_key_of(&spec.models)),
                cached_blocks: AtomicU64::new(u64::MAX),
                healthy: AtomicBool::new(healthy),
                draining: AtomicBool::new(false),
            },
            breaker: Mutex::new(Breaker::new(self.settings.breaker)),
            health: Mutex::new(HealthTracker::new(self.settings.health, healthy)),
            models: RwLock::new(spec.models.clone()),
            active: ActiveLoad::default(),
            peers: Mutex::new(HashMap::new()),
        });
        let mut by_url = (**self.by_url.load()).clone();
        by_url.insert(worker.url.clone(), id);
        let mut next = (*cur).clone();
        next.push(Some(worker));
        self.slots.store(Arc::new(next));
        self.by_url.store(Arc::new(by_url));
        Ok(id)
    }

    /// Marks worker `id` draining: it takes no new request; those in flight finish. Returns
    /// false for an unknown id.
    pub fn drain(&self, id: usize) -> bool {
        match self.get(id) {
            Some(w) => {
                w.hot.draining.store(true, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Removes worker `id` from the registry (its slot stays empty; in-flight requests keep
    /// their guard until they end). Returns the removed worker.
    pub fn remove(&self, id: usize) -> Option<Arc<Worker>> {
        let _w = lock(&self.write);
        let cur = self.slots.load_full();
        let w = cur.get(id)?.clone()?;
        w.hot.draining.store(true, Ordering::Relaxed);
        let mut next = (*cur).clone();
        next[id] = None;
        let mut by_url = (**self.by_url.load()).clone();
        by_url.remove(&w.url);
        self.slots.store(Arc::new(next));
        self.by_url.store(Arc::new(by_url));
        Some(w)
    }

    /// Slots ever allocated (ids run `0..slots()`).
    pub fn slots(&self) -> usize {
        self.slots.load().len()
    }

    /// Present workers.
    pub fn len(&self) -> usize {
        self.slots.load().iter().flatten().count()
    }

    /// True with no present worker.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Worker `id`, unless removed or never added.
    pub fn get(&self, id: usize) -> Option<Arc<Worker>> {
        self.slots.load().get(id).cloned().flatten()
    }

    /// The present worker with URL `url` (normalised as [`parse_worker_url`] does).
    pub fn find_url(&self, url: &str) -> Option<Arc<Worker>> {
        let id = match self.by_url.load().get(url) {
            Some(&id) => id,
            None => *self.by_url.load().get(&parse_worker_url(url).ok()?.0)?,
        };
        self.get(id)
    }

    /// Present workers in id order.
    pub fn iter(&self) -> Vec<Arc<Worker>> {
        self.slots.load().iter().flatten().cloned().collect()
    }

    /// Load by worker id, one entry per slot (0 for removed workers): requests this router
    /// has in flight plus the foreign requests of the last load report.
    pub fn loads(&self) -> Vec<usize> {
        self.slots
            .load()
            .iter()
            .map(|w| w.as_ref().map_or(0, |w| w.load()))
            .collect()
    }

    /// What one attempt of a request for `model` may choose from at `now_ms`: the workers
    /// that are available ([`Worker::is_available`]), serve `model` ([`Worker::serves`]) and
    /// are not in `vetoed` (ids this request already tried).
    pub fn snapshot(&self, model: &str, vetoed: &[usize], now_ms: u64) -> FleetView {
        let slots = self.slots.load_full();
        let key = model_key(model);
        let mut loads = Vec::with_capacity(slots.len());
        let mut eligible = Vec::with_capacity(slots.len());
        for (id, w) in slots.iter().enumerate() {
            let Some(w) = w else {
                loads.push(WorkerLoad::default());
                continue;
            };
            loads.push(w.load_view(now_ms as f64));
            if w.is_available(now_ms) && w.serves_key(model, key) && !vetoed.contains(&id) {
                eligible.push(id);
            }
        }
        FleetView {
            slots,
            workers: loads,
            ids: Vec::new(),
            eligible,
        }
    }

    /// [`Workers::snapshot`] of the workers `ids` only (ascending, no duplicates: a
    /// decision's candidate set, [`crate::policy::Router::decide_on`]): the view holds the
    /// loads of those of them present, and the eligible among them. O(|ids|).
    pub fn snapshot_among(
        &self,
        model: &str,
        vetoed: &[usize],
        now_ms: u64,
        ids: &[usize],
    ) -> FleetView {
        let slots = self.slots.load_full();
        let key = model_key(model);
        let mut view = FleetView {
            workers: Vec::with_capacity(ids.len()),
            ids: Vec::with_capacity(ids.len()),
            eligible: Vec::with_capacity(ids.len()),
            slots: Arc::clone(&slots),
        };
        // Every candidate's lines start loading before the first is read: ~32 workers that no
        // recent decision touched, so their misses overlap instead of queueing one by one.
        for &id in ids {
            if let Some(Some(w)) = slots.get(id) {
                w.prefetch();
            }
        }
        for &id in ids {
            let Some(Some(w)) = slots.get(id) else {
                continue;
            };
            view.workers.push(w.load_view(now_ms as f64));
            view.ids.push(id);
            if w.is_available(now_ms) && w.serves_key(model, key) && !vetoed.contains(&id) {
                view.eligible.push(id);
            }
        }
        view
    }

    /// True when some present worker (in any state) serves `model`: a request for a model
    /// nobody serves is a 404, one whose workers are all down a 503.
    pub fn knows_model(&self, model: &str) -> bool {
        self.standing(model) != ModelStanding::Unserved
    }

    /// How the present workers (in any state) know `model`, in one pass that stops at the
    /// first worker listing it. [`ModelStanding::Unlisted`]: only workers whose model lists
    /// are not known yet would take it, so the name is the client's string, unchecked.
    pub fn standing(&self, model: &str) -> ModelStanding {
        let key = model_key(model);
        let mut standing = ModelStanding::Unserved;
        for w in self.slots.load().iter().flatten() {
            if !w.serves_key(model, key) {
                continue;
            }
            if model.is_empty() || w.lists_key(model, key) {
                return ModelStanding::Listed;
            }
            standing = ModelStanding::Unlisted;
        }
        standing
    }

    /// Checks invariants 1 and 2 (3 is checked by the guard tests).
    ///
    /// # Errors
    /// The number of the first broken invariant and the worker id.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), (u8, usize)> {
        let mut seen = std::collections::HashSet::new();
        for (i, w) in self.slots.load().iter().enumerate() {
            let Some(w) = w else { continue };
            if w.id != i {
                return Err((1, i));
            }
            if w.url.ends_with('/') || !seen.insert(w.url.clone()) {
                return Err((2, i));
            }
            if self.by_url.load().get(&w.url) != Some(&i) {
                return Err((4, i));
            }
        }
        if self.by_url.load().len() != seen.len() {
            return Err((4, usize::MAX));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two() -> Workers {
        Workers::new(&["http://a:1".into(), "http://b:2/".into()]).unwrap()
    }

    #[test]
    fn registry_ids_and_urls() {
        let w = two();
        assert_eq!(w.check_invariants(), Ok(()));
        assert_eq!(w.len(), 2);
        assert_eq!(w.get(1).unwrap().url, "http://b:2");
        let b = w.get(1).unwrap();
        assert_eq!((b.host.as_str(), b.port), ("b", 2));
        assert!(Workers::new(&["ftp://x:1".into()]).is_err());
        assert!(matches!(
            Workers::new(&["http://a:1".into(), "http://a:1/".into()]),
            Err(CoreError::DuplicateWorker { .. })
        ));
    }

    #[test]
    fn guard_counts_once() {
        let w = two();
        let (a, b) = (w.get(0).unwrap(), w.get(1).unwrap());
        let g1 = a.acquire();
        let g2 = a.acquire();
        let g3 = b.acquire();
        assert_eq!(w.loads(), vec![2, 1]);
        drop(g2);
        assert_eq!(w.loads(), vec![1, 1]);
        drop((g1, g3));
        assert_eq!(w.loads(), vec![0, 0]);
        assert_eq!(a.processed(), 2);
    }

    /// A report adds what the engine holds beyond this router's own requests; our in-flight
    /// requests are never counted twice, and a failed poll forgets the report.
    #[test]
    fn load_reports_add_foreign_requests_once() {
        let w = two();
        let (a, b) = (w.get(0).unwrap(), w.get(1).unwrap());
        let g = a.acquire();
        a.report(Some(5)); // 1 of ours + 4 from elsewhere
        b.report(Some(2));
        assert_eq!(w.loads(), vec![5, 2]);
        let h = a.acquire(); // ours, sent after the report
        assert_eq!(w.loads(), vec![6, 2]);
        a.report(Some(1)); // fewer than ours: still on the way, clamped at 0
        assert_eq!((a.foreign(), w.loads()), (0, vec![2, 2]));
        b.report(None);
        assert_eq!(w.loads(), vec![2, 0]);
        drop((g, h));
        assert_eq!(w.loads(), vec![0, 0]);
    }

    #[test]
    fn guard_is_send_and_registry_is_sync() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<LoadGuard>();
        send_sync::<Workers>();
        // A guard moved to another thread releases there, exactly once.
        let w = two();
        let g = w.get(1).unwrap().acquire();
        std::thread::spawn(move || drop(g)).join().unwrap();
        assert_eq!(w.loads(), vec![0, 0]);
        assert_eq!(w.get(1).unwrap().processed(), 1);
    }

    #[test]
    fn concurrent_acquire_release_ends_at_zero() {
        let w = Arc::new(two());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let w = w.clone();
                std::thread::spawn(move || {
                    for i in 0..2_000 {
                        let g = w.get((t + i) % 2).unwrap().acquire();
                        if i % 3 == 0 {
                            let _h = w.get(i % 2).unwrap().acquire();
                        }
                        drop(g);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(w.loads(), vec![0, 0]);
        let total = w.get(0).unwrap().processed() + w.get(1).unwrap().processed();
        assert_eq!(total, 4 * (2_000 + 667));
    }

    fn spec(s: &str) -> WorkerSpec {
        parse_worker_spec(s).unwrap()
    }

    /// The lock-free model check answers as the list does, for every list shape (none
    /// known, one, several) and every query (none, listed, not listed), before and after
    /// the list changes.
    #[test]
    fn serves_key_agrees_with_the_list() {
        let w = Workers::new(&["http://a:1".into()]).unwrap();
        let a = w.get(0).unwrap();
        let lists: [&[&str]; 5] = [&[], &["m"], &["m", "n"], &["n"], &["n", "zz", "m"]];
        for list in lists {
            a.set_models(list.iter().map(|m| m.to_string()).collect());
            for q in ["", "m", "n", "zz", "other"] {
                assert_eq!(a.serves_key(q, model_key(q)), a.serves(q), "{list:?} {q}");
            }
        }
        assert_ne!(model_key("m"), model_key("n"));
    }

    /// A name is listed once any worker lists it, unlisted while only workers of unknown
    /// lists take it, unserved when nobody would; each case against the brute force over
    /// the workers' `serves` and `models`.
    #[test]
    fn standing_of_listed_unlisted_and_unserved_names() {
        use ModelStanding::*;
        let w = Workers::new(&[
            "http://a:1;model=m".into(),
            "http://b:2;model=m;model=n".into(),
            "http://c:3".into(), // models unknown: serves anything
        ])
        .unwrap();
        let brute = |q: &str| {
            let all = w.iter();
            if !all.iter().any(|x| x.serves(q)) {
                Unserved
            } else if q.is_empty() || all.iter().any(|x| x.models().iter().any(|m| m == q)) {
                Listed
            } else {
                Unlisted
            }
        };
        let expect = [("", Listed), ("m", Listed), ("n", Listed), ("zz", Unlisted)];
        for (q, want) in expect {
            assert_eq!(w.standing(q), want, "{q}");
            assert_eq!(w.standing(q), brute(q), "{q}");
        }
        // Once c's list is read, a name nobody lists is unserved.
        w.get(2).unwrap().set_models(vec!["n".into(), "o".into()]);
        let expect = [("zz", Unserved), ("o", Listed), ("m", Listed)];
        for (q, want) in expect {
            assert_eq!(w.standing(q), want, "{q}");
            assert_eq!(w.standing(q), brute(q), "{q}");
            assert_eq!(w.knows_model(q), want != Unserved, "{q}");
        }
    }

    /// The eligible set of the module table, one condition at a time.
    #[test]
    fn snapshot_eligible_set() {
        let w = Workers::new(&[
            "http://a:1;model=m".into(),
            "http://b:2;model=m;model=n".into(),
            "http://c:3".into(), // models unknown: serves anything
        ])
        .unwrap();
        assert_eq!(w.snapshot("m", &[], 0).eligible, vec![0, 1, 2]);
        assert_eq!(w.snapshot("n", &[], 0).eligible, vec![1, 2]);
        assert_eq!(w.snapshot("", &[], 0).eligible, vec![0, 1, 2]);
        assert_eq!(w.snapshot("m", &[1], 0).eligible, vec![0, 2]);
        w.get(2).unwrap().set_models(vec!["n".into()]);
        assert_eq!(w.snapshot("m", &[], 0).eligible, vec![0, 1]);
        assert!(w.knows_model("n") && !w.knows_model("zz"));
        // Spec models win over discovered ones.
        w.get(0).unwrap().set_models(vec!["zz".into()]);
        assert_eq!(w.get(0).unwrap().models(), vec!["m".to_string()]);
        // Draining.
        assert!(w.drain(1));
        assert_eq!(w.snapshot("m", &[], 0).eligible, vec![0]);
        // Breaker: 3 failures (the default threshold) open it for BREAKER_OPEN_SECS.
        let a = w.get(0).unwrap();
        for t in 0..3 {
            a.record_outcome(Outcome::Failure, t);
        }
        assert_eq!(a.breaker_state(3), BreakerState::Open);
        assert!(w.snapshot("m", &[], 3).eligible.is_empty());
        let reopen = crate::config::defaults::BREAKER_OPEN_SECS * 1000 + 2;
        assert_eq!(w.snapshot("m", &[], reopen).eligible, vec![0]);
        // Health: 3 failed checks → unhealthy; 2 passed → healthy, breaker closed.
        let c = w.get(2).unwrap();
        for _ in 0..3 {
            c.record_health(false);
        }
        assert!(!c.is_healthy());
        assert_eq!(w.snapshot("n", &[], reopen).eligible, Vec::<usize>::new());
        c.record_outcome(Outcome::Failure, 0);
        c.record_health(true);
        assert_eq!(c.record_health(true), HealthChange::BecameHealthy);
        assert_eq!(w.snapshot("n", &[], reopen).eligible, vec![2]);
        // Removed: not in any snapshot, its slot stays empty.
        let removed = w.remove(2).unwrap();
        assert_eq!(removed.id, 2);
        let v = w.snapshot("n", &[], reopen);
        assert!(v.eligible.is_empty() && v.worker(2).is_none());
        assert_eq!((w.len(), w.slots()), (2, 3));
        assert_eq!(w.check_invariants(), Ok(()));
    }

    /// A removed URL can be added again: a new id, clean state; a present one cannot.
    #[test]
    fn re_add_gets_a_new_id() {
        let w = two();
        let g = w.get(0).unwrap().acquire();
        assert!(w.add(&spec("http://a:1"), true).is_err());
        w.remove(0).unwrap();
        let id = w.add(&spec("http://a:1/"), true).unwrap();
        assert_eq!(id, 2);
        assert_eq!(w.loads(), vec![0, 0, 0]);
        drop(g); // the old worker's guard still releases on the old worker
        assert_eq!(w.find_url("http://a:1").unwrap().id, 2);
        assert_eq!(w.check_invariants(), Ok(()));
        let cold = w.add(&spec("http://d:4"), false).unwrap();
        assert!(!w.get(cold).unwrap().is_healthy());
    }

    /// An observer hears of the first token once, however often the relay marks it, and of
    /// the end once, with the engine's usage.
    #[test]
    fn an_observer_hears_first_token_and_end_once() {
        #[derive(Debug, Default)]
        struct Heard(Mutex<Vec<String>>);
        impl LoadObserver for Arc<Heard> {
            fn first_token(&self) {
                lock(&self.0).push("first".into());
            }
            fn done(&self, usage: Option<(u64, u64)>) {
                lock(&self.0).push(format!("done {usage:?}"));
            }
        }
        let w = two();
        let worker = w.get(0).unwrap();
        let heard = Arc::new(Heard::default());
        let booking = Booking {
            prompt_tokens: 100,
            cached_tokens: 0,
            prefill_ms: 5.0,
            block_keys: BlockKeySeq::default(),
            unkeyed_blocks: 6,
        };
        let mut g = worker.acquire_booked(booking, 0.0);
        g.observe(Box::new(Arc::clone(&heard)));
        g.first_token(1.0);
        g.first_token_now();
        g.served(100, 64);
        assert_eq!(*lock(&heard.0), ["first"]);
        drop(g);
        assert_eq!(*lock(&heard.0), ["first", "done Some((100, 64))"]);
        assert_eq!(worker.in_flight(), 0);
        // Without a first token or usage: the end alone.
        let heard = Arc::new(Heard::default());
        let mut g = worker.acquire();
        g.observe(Box::new(Arc::clone(&heard)));
        drop(g);
        assert_eq!(*lock(&heard.0), ["done None"]);
    }

    #[test]
    fn a_second_url_for_a_present_address_is_refused_unless_that_worker_drains() {
        let w = Workers::new(&[]).unwrap();
        let addr: std::net::SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let spec = |url: &str| crate::config::parse_worker_spec(url).unwrap();
        let first = w
            .add_resolved(&spec("http://127.0.0.1:8000"), Some(addr), true)
            .unwrap();
        let e = w
            .add_resolved(&spec("http://localhost:8000"), Some(addr), true)
            .expect_err("refused");
        assert_eq!(
            e.to_string(),
            format!(
                "worker http://localhost:8000 resolves to 127.0.0.1:8000, the address of worker {first}"
            )
        );
        // Another port is another engine; a draining worker is being replaced.
        let other: std::net::SocketAddr = "127.0.0.1:8001".parse().unwrap();
        assert!(
            w.add_resolved(&spec("http://localhost:8001"), Some(other), true)
                .is_ok()
        );
        w.drain(first);
        assert!(
            w.add_resolved(&spec("http://localhost:8000"), Some(addr), true)
                .is_ok()
        );
    }

    #[test]
    fn worker_api_key_from_env() {
        // PATH is set in every test environment; reading it needs no `set_var`.
        let path = std::env::var("PATH").unwrap();
        let w = Workers::new(&["http://a:1;api_key_env=PATH".into()]).unwrap();
        assert_eq!(w.get(0).unwrap().api_key.as_deref(), Some(path.as_str()));
        // An unset variable is an error naming it, not a worker without its key.
        let Err(e) = Workers::new(&["http://a:1;api_key_env=KVROUTE_TEST_UNSET_VAR_XYZ".into()])
        else {
            panic!("refused");
        };
        assert_eq!(
            e.to_string(),
            "worker http://a:1: api_key_env names KVROUTE_TEST_UNSET_VAR_XYZ, which is unset or empty"
        );
    }
}
