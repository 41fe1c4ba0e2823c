//! [`Shared`]: what every shard, the admin API and the background threads (health checks,
//! load reports, KV events) share; [`Settings`]: the validated network settings. Kept apart
//! from [`crate::shard`] so that the exchange, the admin API and the threads depend on the
//! state, not on the runtime that starts them.

use kvroute_core::config::{Config, defaults};
use kvroute_core::health::{Backoff, RetryBudget};
use kvroute_core::metrics::Metrics;
use kvroute_core::policy::Router;
use kvroute_core::route_key::RouteKey;
use kvroute_core::tokens::Tokenizers;
use kvroute_core::workers::Workers;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Network and failover settings of `kvroute serve`, validated (durations, not raw numbers).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Address to listen on; port 0 picks a free port (tests).
    pub listen: String,
    /// Shard threads.
    pub shards: usize,
    /// Each shard thread is pinned to one core of the process's affinity mask
    /// ([`crate::shard::pins`]).
    pub pin_shards: bool,
    /// Largest request body, in bytes (413 above).
    pub max_body_bytes: usize,
    /// Largest request head, in bytes (431 above).
    pub max_head_bytes: usize,
    /// Time allowed for a whole exchange with a worker (the stream is cut after it).
    pub request_timeout: Duration,
    /// Longest silence of a worker once its response body began (it failed mid-stream).
    pub stream_idle_timeout: Duration,
    /// Time allowed for a worker's first response byte (the attempt fails after it).
    pub first_byte_timeout: Duration,
    /// Idle upstream connections older than this are closed, not reused.
    pub upstream_idle_timeout: Duration,
    /// Time allowed to connect to a worker (the attempt fails after it).
    pub connect_timeout: Duration,
    /// Time for a client's request head (408 after).
    pub client_header_timeout: Duration,
    /// Time between two reads of a request body (408 after).
    pub client_body_timeout: Duration,
    /// Idle keep-alive client connections close after this.
    pub client_idle_timeout: Duration,
    /// Client connections per shard (503 above).
    pub max_connections_per_shard: usize,
    /// Retries per request.
    pub retry_max: u32,
    /// Waits between retries.
    pub backoff: Backoff,
    /// No attempt starts later than this after the request arrived.
    pub retry_deadline: Duration,
    /// Mid-stream migrations per request (0 = off).
    pub migration_limit: u32,
    /// Grace for in-flight exchanges after a shutdown signal.
    pub shutdown_timeout: Duration,
    /// Active health checks (`None`: off).
    pub health_checks: Option<crate::health::Checks>,
    /// Send `x-kvroute-worker-url` besides `x-kvroute-worker` (the id).
    pub expose_worker_url: bool,
    /// Force the epoll (legacy) driver even where io_uring works.
    pub force_epoll: bool,
}

impl Settings {
    /// The settings of a validated `cfg`.
    pub fn of(cfg: &Config, shards: usize, pin_shards: bool, force_epoll: bool) -> Self {
        let secs = Duration::from_secs;
        Self {
            listen: cfg.listen.clone(),
            shards,
            pin_shards,
            max_body_bytes: cfg.max_body_bytes,
            max_head_bytes: defaults::MAX_HEAD_BYTES,
            request_timeout: secs(cfg.request_timeout_secs),
            stream_idle_timeout: secs(cfg.stream_idle_timeout_secs),
            first_byte_timeout: secs(cfg.first_byte_timeout_secs),
            upstream_idle_timeout: Duration::from_millis(cfg.upstream_idle_timeout_ms),
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms),
            client_header_timeout: secs(cfg.client_header_timeout_secs),
            client_body_timeout: secs(cfg.client_body_timeout_secs),
            client_idle_timeout: secs(cfg.client_idle_timeout_secs),
            max_connections_per_shard: cfg.max_connections_per_shard,
            retry_max: cfg.retry_max,
            backoff: Backoff {
                initial_ms: cfg.retry_initial_backoff_ms,
                multiplier: cfg.retry_backoff_multiplier,
                max_ms: cfg.retry_max_backoff_ms,
                jitter: cfg.retry_jitter,
            },
            retry_deadline: secs(cfg.retry_deadline_secs),
            migration_limit: cfg.migration_limit,
            shutdown_timeout: secs(cfg.shutdown_timeout_secs),
            health_checks: crate::health::Checks::of(cfg),
            expose_worker_url: cfg.expose_worker_url,
            force_epoll,
        }
    }
}

/// State shared by all shards.
pub struct Shared {
    /// Network settings.
    pub settings: Settings,
    /// Worker registry: loads, health, breakers, models (atomics; changed at run time).
    pub workers: Arc<Workers>,
    /// The routing policy and its indexes.
    pub router: Router,
    /// Writer side of the KV-event index (stats for `/metrics` and the admin API; the router
    /// reads the index lock-free). `None` without event sources.
    pub events: Option<crate::zmq::SharedEvents>,
    /// The KV-event subscription of each worker that publishes events, by worker id.
    pub subscriptions: Mutex<std::collections::HashMap<usize, crate::zmq::Subscription>>,
    /// Ids of the workers DNS discovery added ([`crate::discovery`]), until their removal
    /// ends: a SIGHUP reload of the static `workers` leaves them alone.
    pub discovered: Mutex<std::collections::HashSet<usize>>,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// The policy's name, for metric labels.
    pub policy_name: &'static str,
    /// Tokenizers loaded at start-up (empty: text-mode routing); each shard copies them once.
    pub tokenizers: Tokenizers,
    /// Client API keys (`--api-key`); empty = no authentication.
    pub api_keys: Vec<Vec<u8>>,
    /// Fleet-wide retry budget.
    pub retry_budget: RetryBudget,
    /// Requests seen (request sequence numbers: round_robin's turn, generated request ids).
    pub seq: AtomicU64,
    /// Exchanges in progress, over all shards (graceful shutdown waits for 0).
    pub in_flight: AtomicUsize,
    /// When the gateway started, Unix seconds (`created` of `/v1/models` entries).
    pub started_unix_secs: u64,
    /// Set by a shutdown signal: readiness false, listeners closed, keep-alive ends.
    pub shutting_down: AtomicBool,
    /// Set when the shutdown grace has passed: exchanges still in flight end themselves
    /// (a stream with an error event at its next data, an attempt waiting for its first byte
    /// with a 503), each logged and counted in `cut`.
    pub cutting: AtomicBool,
    /// Exchanges the shutdown cut (see `cutting`).
    pub cut: AtomicUsize,
    /// Replica sync's shard side (`--nats`, [`crate::nats`]); `None`: off.
    pub sync: Option<Arc<crate::nats::SyncLink>>,
    /// Test hook: once set, every routed request's final [`RouteKey`] (after tokenization) is
    /// appended here. Unset in production: one atomic load per request.
    pub key_tap: OnceLock<Mutex<Vec<RouteKey>>>,
}

impl Shared {
    /// True once a shutdown began.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// Milliseconds on the router's time base (breakers, hash-index TTL).
    pub fn now_ms(&self) -> u64 {
        self.router.now_ms()
    }

    /// `GET /readiness` (on the traffic port and the admin port): `(status, JSON body)`.
    ///
    /// | state | answer |
    /// |---|---|
    /// | a shutdown under way | 503 `{"status":"shutting_down"}` |
    /// | no worker available (healthy, breaker closed or half-open, not draining) | 503 `{"status":"not_ready","reason":"no eligible worker"}` |
    /// | else | 200 `{"status":"ready","models_without_worker":[..]}`: the models some worker serves that no available worker does (sorted; empty when all are served) |
    ///
    /// One model's outage does not make the router unready: every replica of a router tier
    /// sees the same workers, so they would all leave the Service together and take the
    /// models still served with them (SMG's readiness is likewise "any healthy worker").
    /// Requests for such a model get 503 with `Retry-After`.
    pub fn readiness(&self) -> (u16, Vec<u8>) {
        if self.is_shutting_down() {
            return (503, br#"{"status":"shutting_down"}"#.to_vec());
        }
        let now = self.now_ms();
        let workers = self.workers.iter();
        let available: Vec<_> = workers.iter().filter(|w| w.is_available(now)).collect();
        if available.is_empty() {
            let body = serde_json::json!({"status": "not_ready", "reason": "no eligible worker"});
            return (503, body.to_string().into_bytes());
        }
        let models: std::collections::BTreeSet<String> =
            workers.iter().flat_map(|w| w.models()).collect();
        let unserved: Vec<String> = models
            .into_iter()
            .filter(|m| !available.iter().any(|w| w.serves(m)))
            .collect();
        let body = serde_json::json!({"status": "ready", "models_without_worker": unserved});
        (200, body.to_string().into_bytes())
    }

    /// True when [`Shared::readiness`] answers 200.
    pub fn is_ready(&self) -> bool {
        self.readiness().0 == 200
    }

    /// Forgets worker `id` in every index: the approximate trees and, when it has one, its
    /// streams in the event index (its cache is gone: a restart, a removal).
    pub fn purge_worker(&self, id: usize) {
        self.router.remove_worker(id);
        if let Some(ix) = &self.events {
            crate::zmq::lock(ix).remove_worker(id as u32);
        }
    }
}
