//! [`Metrics`]: the gateway's Prometheus metrics (prometheus-client), shared by all shards,
//! exposed in the Prometheus text format 0.0.4 or OpenMetrics 1.0 ([`Format`]).
//!
//! Every per-worker family is labelled `worker` = the worker's dense id (`"0"`, `"1"`, …, as
//! in [`Workers`] and `/admin/cache-view/{worker}`), never its URL.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `kvroute_requests_total` | counter | `route`, `status`, `model` (a name some worker lists, else one fixed value: a client's invented names are one series), `worker` (`""` when none was chosen) |
//! | `kvroute_worker_requests_total` | counter | `worker` |
//! | `kvroute_decisions_total` | counter | `policy`, `reason` (`hit`, `miss`, `spill`, ...) |
//! | `kvroute_worker_errors_total` | counter | `worker`, `kind` ([`Metrics::on_worker_error`]) |
//! | `kvroute_retries_total` | counter | `worker` (the one that failed), `reason` |
//! | `kvroute_migrations_total` | counter | `worker`, `outcome` |
//! | `kvroute_bad_requests_total` | counter | `reason` |
//! | `kvroute_token_source_total` | counter | `source` (`none`, `body`, `header`, `prompt`) |
//! | `kvroute_keyless_routings_total` | counter | `route`: requests routed with neither routing text nor token ids (no policy sees an overlap for them; 0 for well-formed requests of every endpoint, bug-cases.md B20) |
//! | `kvroute_routing_tokens_rejected_total` | counter | `reason` (`too_long`, `too_many`, `malformed`) |
//! | `kvroute_tokenize_tokens_total` | counter | `how` (`reused`, `encoded`) |
//! | `kvroute_hit_tokens_total` | counter | `worker`, `kind` (`predicted`, `served`, `phantom`, `unannounced`) |
//! | `kvroute_unannounced_hits_total` | counter | `worker` |
//! | `kvroute_request_duration_seconds` | histogram | `route` (request accepted → response end) |
//! | `kvroute_ttft_seconds` | histogram | `route` (request accepted → first body byte relayed) |
//! | `kvroute_router_added_seconds` | histogram | `phase` ([`Phase`]) |
//! | `kvroute_worker_in_flight` | gauge | `worker` (read from [`Workers`] at scrape time) |
//! | `kvroute_worker_foreign_requests` | gauge | `worker` (the last engine load report's requests from elsewhere) |
//! | `kvroute_worker_healthy` | gauge | `worker` (0/1, [`Metrics::set_worker_state`]) |
//! | `kvroute_worker_breaker_state` | gauge | `worker` ([`Breaker`]: 0 closed, 1 half-open, 2 open) |
//! | `kvroute_worker_draining` | gauge | `worker` (0/1) |
//! | `kvroute_index_size` | gauge | `index`, `model` ([`Metrics::set_index_sizes`], at scrape time) |
//! | `kvroute_kv_events_{batches,events,gaps,replays,unrecoverable_gaps,restarts,duplicates,decode_errors,orphans,orphan_replays,size_mismatches}_total` | counter | `worker`, `rank` ([`Metrics::set_event_streams`]) |
//! | `kvroute_kv_events_last_seq` | gauge | `worker`, `rank` |
//! | `kvroute_kv_indexed_blocks` | gauge | `worker`, `rank` |
//!
//! Histogram buckets are [`LATENCY_BUCKETS`] for all three histograms.
//!
//! The per-request families (`kvroute_requests_total`, `kvroute_worker_requests_total`,
//! `kvroute_decisions_total`, `kvroute_token_source_total`, `kvroute_tokenize_tokens_total`
//! and the three histograms) are [`ShardedCounter`]s and [`ShardedHistogram`]s: each shard
//! writes its own cell, a scrape sums them.

mod scrape;
mod sharded;
#[cfg(test)]
mod tests;

pub use scrape::{IndexSize, StreamSample};
pub use sharded::{ShardedCounter, ShardedHistogram};

use crate::workers::Workers;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::Arc;

type Labels = Vec<(&'static str, String)>;
type Histograms = Family<Labels, ShardedHistogram, fn() -> ShardedHistogram>;
/// The per-request counters' families ([`ShardedCounter`]: no line shared by the shards).
type Counters = Family<Labels, ShardedCounter>;

/// Upper bounds of every latency histogram's buckets, seconds (`+Inf` is added by
/// [`ShardedHistogram`]). Where they come from: the 1–2.5–5 series of the Prometheus client
/// libraries' default buckets (`DefBuckets`, 5 ms … 10 s), extended down to 100 µs so the
/// router's own added time (tens of µs to a few ms) resolves, and up to 60 s for long
/// generations; anything longer falls in `+Inf` (its exact share stays in `_sum`/`_count`).
pub const LATENCY_BUCKETS: [f64; 18] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

fn latency_histogram() -> ShardedHistogram {
    ShardedHistogram::new(&LATENCY_BUCKETS)
}

/// An exposition format of `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4: `# TYPE` names the sample family the classic parser
    /// expects (`x_total` for a counter), no `# EOF`.
    Prometheus,
    /// OpenMetrics 1.0.0 text, prometheus-client's own output (`# TYPE x counter` above
    /// `x_total` samples, closing `# EOF`).
    OpenMetrics,
}

impl Format {
    /// The format for a request whose `Accept` header is `accept`: [`Format::OpenMetrics`]
    /// when it lists `application/openmetrics-text` (any version, with a
    /// `q` other than 0), else [`Format::Prometheus`] — the Prometheus server's own
    /// negotiation, and what a client without `Accept` (curl, old scrapers) gets.
    pub fn negotiate(accept: Option<&[u8]>) -> Format {
        if accept.is_some_and(accepts_openmetrics) {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        }
    }

    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// Whether one `Accept` value has a media range `application/openmetrics-text` not refused
/// with `q=0`.
fn accepts_openmetrics(value: &[u8]) -> bool {
    let Ok(value) = std::str::from_utf8(value) else {
        return false;
    };
    value.split(',').any(|range| {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default();
        media.eq_ignore_ascii_case("application/openmetrics-text")
            && !parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f64>().ok())
                    .is_some_and(|q| q == 0.0)
            })
    })
}

/// Where router-added time is spent, the `phase` of `kvroute_router_added_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Request accepted (head read) → request sent upstream: parse, tokenize, decide, connect.
    Request,
    /// First upstream byte read → written to the client (first chunk's relay).
    Response,
}

impl Phase {
    /// The label value: `request` or `response`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Request => "request",
            Phase::Response => "response",
        }
    }
}

/// A worker's circuit-breaker state, the value of `kvroute_worker_breaker_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breaker {
    /// Requests flow (0).
    Closed = 0,
    /// Requests flow as probes: one failure reopens it (1).
    HalfOpen = 1,
    /// No requests sent (2).
    Open = 2,
}

/// A worker's state for the `kvroute_worker_{healthy,breaker_state,draining}` gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerState {
    /// Passing health checks (gauge 1) or not (0).
    pub healthy: bool,
    /// Its circuit breaker.
    pub breaker: Breaker,
    /// Being drained: no new requests, in-flight ones finish (1).
    pub draining: bool,
}

/// The gateway's metrics. `Send + Sync`; every recording method takes `&self`.
pub struct Metrics {
    registry: Registry,
    requests: Counters,
    worker_requests: Counters,
    decisions: Counters,
    worker_errors: Family<Labels, Counter>,
    retries: Family<Labels, Counter>,
    migrations: Family<Labels, Counter>,
    bad_requests: Family<Labels, Counter>,
    keyless: Family<Labels, Counter>,
    token_sources: Counters,
    header_rejected: Family<Labels, Counter>,
    tokenize_tokens: Counters,
    hit_tokens: Family<Labels, Counter>,
    unannounced_hits: Family<Labels, Counter>,
    duration: Histograms,
    ttft: Histograms,
    router_added: Histograms,
    in_flight: Family<Labels, Gauge>,
    foreign: Family<Labels, Gauge>,
    healthy: Family<Labels, Gauge>,
    breaker: Family<Labels, Gauge>,
    draining: Family<Labels, Gauge>,
    discovery_errors: Family<Labels, Counter>,
    discovery_truncations: Family<Labels, Counter>,
    discovered: Family<Labels, Gauge>,
    sync_sent: Family<Labels, Counter>,
    sync_dropped: Family<Labels, Counter>,
    sync_received: Family<Labels, Counter>,
    sync_connected: Gauge,
    sync_peers: Gauge,
    sync_peer_expired: Counter,
    scraped: Arc<scrape::ScrapeValues>,
    /// Tells this instance's entries in the per-thread [`HOT`] caches from another's.
    id: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn worker_label(worker: usize) -> String {
    worker.to_string()
}

/// Source of [`Metrics::id`].
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The families the per-request path records into through [`HOT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum HotFamily {
    Requests,
    WorkerRequests,
    Decisions,
    TokenSources,
    TokenizeTokens,
    Duration,
    Ttft,
    RouterAdded,
}

/// One cached handle: whose and which label values it stands for, and the metric itself
/// (a clone of the family's: the same atomic, so what it counts is what a scrape reads).
struct HotEntry<M> {
    metrics: u64,
    family: HotFamily,
    values: Vec<String>,
    metric: M,
}

/// Per-thread handles of the label sets the per-request path records into.
///
/// A `Family::get_or_create` builds a `Vec` of owned label strings, SipHashes it and takes
/// the family's `RwLock` (shared by every shard: its cache line moves between cores on each
/// call); a request makes about ten such calls. Callgrind (perf/runs/2026-12-01-proxy): ~5.3k
/// of the ~68k instructions of a round-robin request were `get_or_create`, plus the label
/// allocations. Here the label values are hashed in place (FNV-1a) and, once seen, looked up
/// in a thread-local map without allocating or locking. Only counters and histograms are
/// cached: their families never drop an entry (gauges do, [`Metrics::forget_worker`]).
#[derive(Default)]
struct Hot {
    counters: HashMap<u64, HotEntry<ShardedCounter>, IdentityHash>,
    histograms: HashMap<u64, HotEntry<ShardedHistogram>, IdentityHash>,
}

/// Label sets cached per thread before the cache starts over (client-chosen `model` values
/// could otherwise grow it without bound).
const HOT_MAX: usize = 4096;

thread_local! {
    static HOT: std::cell::RefCell<Hot> = std::cell::RefCell::default();
}

/// A `Hasher` for keys that already are hashes.
#[derive(Default, Clone, Copy)]
struct IdentityHash(u64);

impl std::hash::Hasher for IdentityHash {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

impl std::hash::BuildHasher for IdentityHash {
    type Hasher = IdentityHash;
    fn build_hasher(&self) -> IdentityHash {
        IdentityHash(0)
    }
}

/// The cache key of a metrics instance, a family and label values: rustc's FxHash
/// (rotate, xor, multiply), eight bytes of a value at a time, each value closed by its
/// length so `["ab", "c"]` and `["a", "bc"]` differ. Per request it hashes ~8 label sets of
/// short values; a byte-at-a-time FNV-1a was ~0.4 % of a request's samples and xxh3 per
/// value ~1.3 % of its instructions (perf/runs/2026-12-02-common-path). Two label sets that
/// still share a key are told apart by [`with_hot`]'s comparison.
fn hot_key(metrics: u64, family: HotFamily, values: &[&str]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mix = |h: u64, w: u64| (h.rotate_left(5) ^ w).wrapping_mul(K);
    let mut h = mix(mix(0, metrics), family as u64);
    for v in values {
        let mut words = v.as_bytes().chunks_exact(8);
        for w in words.by_ref() {
            h = mix(h, u64::from_le_bytes(w.try_into().unwrap_or_default()));
        }
        let mut last = [0u8; 8];
        let rest = words.remainder();
        last[..rest.len()].copy_from_slice(rest);
        h = mix(mix(h, u64::from_le_bytes(last)), v.len() as u64);
    }
    h
}

/// Runs `f` on the metric of `family` (a [`HotFamily`] of the instance `metrics`) labelled
/// `names` = `values`, from this thread's cache in `pick(hot)`; on a miss (or a hash shared
/// with another label set) from `get_or_create`, cached for next time.
fn with_hot<M: Clone, C: prometheus_client::metrics::family::MetricConstructor<M>>(
    metrics: u64,
    tag: HotFamily,
    family: &Family<Labels, M, C>,
    names: &[&'static str],
    values: &[&str],
    pick: fn(&mut Hot) -> &mut HashMap<u64, HotEntry<M>, IdentityHash>,
    f: impl FnOnce(&M),
) {
    let key = hot_key(metrics, tag, values);
    HOT.with(|hot| {
        let mut hot = hot.borrow_mut();
        let map = pick(&mut hot);
        if let Some(e) = map.get(&key) {
            if e.metrics == metrics
                && e.family == tag
                && e.values.len() == values.len()
                && e.values.iter().zip(values).all(|(a, b)| a == b)
            {
                return f(&e.metric);
            }
            // Another label set with this hash: served uncached, correct either way.
            let labels: Labels = names
                .iter()
                .zip(values)
                .map(|(n, v)| (*n, v.to_string()))
                .collect();
            return f(&family.get_or_create(&labels));
        }
        if map.len() >= HOT_MAX {
            map.clear();
        }
        let labels: Labels = names
            .iter()
            .zip(values)
            .map(|(n, v)| (*n, v.to_string()))
            .collect();
        let metric = family.get_or_create(&labels).clone();
        f(&metric);
        map.insert(
            key,
            HotEntry {
                metrics,
                family: tag,
                values: values.iter().map(|v| v.to_string()).collect(),
                metric,
            },
        );
    });
}

/// `n` in decimal, in `buf`.
fn decimal(n: u64, buf: &mut [u8; 20]) -> &str {
    let mut i = buf.len();
    let mut n = n;
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // Only ASCII digits were written.
    std::str::from_utf8(&buf[i..]).unwrap_or("")
}

impl Metrics {
    /// Registers every metric (all start at zero; labelled families appear with their first
    /// sample).
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let histograms = || Histograms::new_with_constructor(latency_histogram as fn() -> _);
        let m = Metrics {
            requests: Family::default(),
            worker_requests: Family::default(),
            decisions: Family::default(),
            worker_errors: Family::default(),
            retries: Family::default(),
            migrations: Family::default(),
            bad_requests: Family::default(),
            keyless: Family::default(),
            token_sources: Family::default(),
            header_rejected: Family::default(),
            tokenize_tokens: Family::default(),
            hit_tokens: Family::default(),
            unannounced_hits: Family::default(),
            duration: histograms(),
            ttft: histograms(),
            router_added: histograms(),
            in_flight: Family::default(),
            foreign: Family::default(),
            healthy: Family::default(),
            breaker: Family::default(),
            draining: Family::default(),
            discovery_errors: Family::default(),
            discovery_truncations: Family::default(),
            sync_sent: Family::default(),
            sync_dropped: Family::default(),
            sync_received: Family::default(),
            sync_connected: Gauge::default(),
            sync_peers: Gauge::default(),
            sync_peer_expired: Counter::default(),
            discovered: Family::default(),
            scraped: Arc::default(),
            registry: Registry::default(),
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        };
        let r = &mut registry;
        r.register(
            "kvroute_requests",
            "Responses sent, by route, status, model and worker id (empty when none was chosen)",
            m.requests.clone(),
        );
        r.register(
            "kvroute_worker_requests",
            "Requests proxied, by worker id",
            m.worker_requests.clone(),
        );
        r.register(
            "kvroute_decisions",
            "Routing decisions, by policy and reason",
            m.decisions.clone(),
        );
        r.register(
            "kvroute_worker_errors",
            "Failed exchanges with workers, by worker id and kind",
            m.worker_errors.clone(),
        );
        r.register(
            "kvroute_retries",
            "Requests retried on another worker, by the worker id that failed and reason",
            m.retries.clone(),
        );
        r.register(
            "kvroute_migrations",
            "Streams migrated away from a worker, by worker id and outcome",
            m.migrations.clone(),
        );
        r.register(
            "kvroute_bad_requests",
            "Requests refused as invalid, by reason",
            m.bad_requests.clone(),
        );
        r.register(
            "kvroute_keyless_routings",
            "Requests routed with no routing text nor token ids, by route",
            m.keyless.clone(),
        );
        r.register(
            "kvroute_token_source",
            "Routed requests by where their token ids came from",
            m.token_sources.clone(),
        );
        r.register(
            "kvroute_routing_tokens_rejected",
            "x-kvroute-routing-tokens headers ignored, by reason",
            m.header_rejected.clone(),
        );
        r.register(
            "kvroute_tokenize_tokens",
            "Prompt tokens produced by the router, reused from the prefix cache or encoded",
            m.tokenize_tokens.clone(),
        );
        r.register(
            "kvroute_hit_tokens",
            "Cache hits: prompt tokens the router predicted the worker holds, the tokens the \
             engine served from its cache (usage.prompt_tokens_details.cached_tokens), and the \
             shortfall (phantom) and excess (unannounced) of served against predicted",
            m.hit_tokens.clone(),
        );
        r.register(
            "kvroute_unannounced_hits",
            "Cache hits where the engine served more cached tokens than the router predicted \
             (bug-cases.md B37)",
            m.unannounced_hits.clone(),
        );
        r.register(
            "kvroute_request_duration_seconds",
            "Time from accepting a request to the end of its response, by route, seconds",
            m.duration.clone(),
        );
        r.register(
            "kvroute_ttft_seconds",
            "Router-observed time to first token: request accepted to first response body byte \
             relayed, by route, seconds",
            m.ttft.clone(),
        );
        r.register(
            "kvroute_router_added_seconds",
            "Time the router adds, by phase: request (accepted to sent upstream) and response \
             (first upstream byte to written to the client), seconds",
            m.router_added.clone(),
        );
        r.register(
            "kvroute_worker_in_flight",
            "Requests in flight, by worker id",
            m.in_flight.clone(),
        );
        r.register(
            "kvroute_worker_foreign_requests",
            "Requests the engine runs or queues that this router did not send, from its last \
             load report (0 when load reports are off)",
            m.foreign.clone(),
        );
        r.register(
            "kvroute_worker_healthy",
            "Whether the worker passes health checks (1) or not (0)",
            m.healthy.clone(),
        );
        r.register(
            "kvroute_worker_breaker_state",
            "The worker's circuit breaker: 0 closed, 1 half-open, 2 open",
            m.breaker.clone(),
        );
        r.register(
            "kvroute_worker_draining",
            "Whether the worker is being drained (1) or not (0)",
            m.draining.clone(),
        );
        r.register(
            "kvroute_discovery_errors",
            "DNS discovery lookups that gave no usable answer (NXDOMAIN, no records, timeout, \
             empty answer), by source; the source's last good set of workers is kept",
            m.discovery_errors.clone(),
        );
        r.register(
            "kvroute_discovery_truncations",
            "DNS discovery answers cut to dns_max_addresses, by source",
            m.discovery_truncations.clone(),
        );
        r.register(
            "kvroute_discovery_workers",
            "Workers a DNS discovery source has in the fleet now, by source",
            m.discovered.clone(),
        );
        r.register(
            "kvroute_sync_sent",
            "Replica sync messages published to NATS, by type (routed, first_token, done, \
             live, hello, placed)",
            m.sync_sent.clone(),
        );
        r.register(
            "kvroute_sync_dropped",
            "Replica sync messages not published, by reason: queue_full (the NATS thread fell \
             behind), disconnected (NATS down), publish_error; peers correct the gap from \
             the next heartbeat",
            m.sync_dropped.clone(),
        );
        r.register(
            "kvroute_sync_received",
            "Replica sync messages received, by type and outcome (done, own, unknown_worker, \
             not_booked, page_mismatch, elsewhere, bad_message)",
            m.sync_received.clone(),
        );
        r.register(
            "kvroute_sync_connected",
            "Whether replica sync is connected to NATS (1) or not (0)",
            m.sync_connected.clone(),
        );
        r.register(
            "kvroute_sync_peers",
            "Peer router replicas heard from within the silence limit",
            m.sync_peers.clone(),
        );
        r.register(
            "kvroute_sync_peer_bookings_expired",
            "Peer bookings ended without their done message (the peer's heartbeat no longer \
             listed them, or the peer went silent)",
            m.sync_peer_expired.clone(),
        );
        r.register_collector(Box::new(m.scraped.clone()));
        Metrics { registry, ..m }
    }

    /// One routing decision.
    pub fn on_decision(&self, policy: &str, reason: &str) {
        self.counter(
            HotFamily::Decisions,
            &self.decisions,
            &["policy", "reason"],
            &[policy, reason],
            |c| {
                c.inc();
            },
        );
    }

    fn counter(
        &self,
        tag: HotFamily,
        family: &Counters,
        names: &[&'static str],
        values: &[&str],
        f: impl FnOnce(&ShardedCounter),
    ) {
        with_hot(self.id, tag, family, names, values, |h| &mut h.counters, f);
    }

    fn observe(
        &self,
        tag: HotFamily,
        family: &Histograms,
        name: &'static str,
        value: &str,
        seconds: f64,
    ) {
        with_hot(
            self.id,
            tag,
            family,
            &[name],
            &[value],
            |h| &mut h.histograms,
            |m| m.observe(seconds),
        );
    }

    /// One response sent for `route` (`/v1/completions`, ...) with `status`, for `model`
    /// (`""` when unknown), proxied to `worker` (`None` when none was chosen); `seconds` from
    /// accepting the request to the end of its response. Counts `kvroute_requests_total`,
    /// `kvroute_worker_requests_total` (with a worker) and observes
    /// `kvroute_request_duration_seconds{route}`.
    pub fn on_request_done(
        &self,
        route: &str,
        status: u16,
        model: &str,
        worker: Option<usize>,
        seconds: f64,
    ) {
        self.count_request(route, status, model, worker);
        self.observe(HotFamily::Duration, &self.duration, "route", route, seconds);
    }

    fn count_request(&self, route: &str, status: u16, model: &str, worker: Option<usize>) {
        let (mut sb, mut wb) = ([0u8; 20], [0u8; 20]);
        let status = decimal(u64::from(status), &mut sb);
        let w = worker.map_or("", |w| decimal(w as u64, &mut wb));
        self.counter(
            HotFamily::Requests,
            &self.requests,
            &["route", "status", "model", "worker"],
            &[route, status, model, w],
            |c| {
                c.inc();
            },
        );
        if worker.is_some() {
            self.counter(
                HotFamily::WorkerRequests,
                &self.worker_requests,
                &["worker"],
                &[w],
                |c| {
                    c.inc();
                },
            );
        }
    }

    /// A failed exchange with `worker` (id), `kind` one of `connect`, `first_byte_timeout`,
    /// `upstream`, `status_5xx` (any 5xx response head, retried or not), `upstream_body`,
    /// `stream_idle_timeout` (`kvroute_worker_errors_total`). A client that leaves is not
    /// its worker's error: `kvroute_requests_total{status="0"}` counts it.
    pub fn on_worker_error(&self, worker: usize, kind: &str) {
        self.worker_errors
            .get_or_create(&vec![
                ("worker", worker_label(worker)),
                ("kind", kind.to_string()),
            ])
            .inc();
    }

    /// A request retried on another worker after `worker` (id) failed it for `reason`
    /// (`kvroute_retries_total`; the error kinds of [`Metrics::on_worker_error`]).
    pub fn on_retry(&self, worker: usize, reason: &str) {
        self.retries
            .get_or_create(&vec![
                ("worker", worker_label(worker)),
                ("reason", reason.to_string()),
            ])
            .inc();
    }

    /// A stream migrated away from `worker` (id) with `outcome` (e.g. `resumed`, `failed`)
    /// (`kvroute_migrations_total`).
    pub fn on_migration(&self, worker: usize, outcome: &str) {
        self.migrations
            .get_or_create(&vec![
                ("worker", worker_label(worker)),
                ("outcome", outcome.to_string()),
            ])
            .inc();
    }

    /// Time the router added in `phase`, seconds (`kvroute_router_added_seconds{phase}`).
    pub fn on_router_added(&self, phase: Phase, seconds: f64) {
        let phase = phase.as_str();
        self.observe(
            HotFamily::RouterAdded,
            &self.router_added,
            "phase",
            phase,
            seconds,
        );
    }

    /// Router-observed time to first token on `route`: request accepted → first response
    /// body byte relayed to the client, seconds (`kvroute_ttft_seconds{route}`).
    pub fn on_ttft(&self, route: &str, seconds: f64) {
        self.observe(HotFamily::Ttft, &self.ttft, "route", route, seconds);
    }

    /// A request refused as invalid (`reason`: malformed, head_too_large, body_too_large, ...).
    pub fn on_bad_request(&self, reason: &str) {
        inc_labelled(&self.bad_requests, "reason", reason, 1);
    }

    /// A request of `route` routed with no routing key (neither text nor token ids).
    pub fn on_keyless(&self, route: &str) {
        inc_labelled(&self.keyless, "route", route, 1);
    }

    /// Where one routed request's token ids came from (`source`: `none`, `body`, `header`,
    /// `prompt`); for `prompt`, `reused` of its `total` tokens came from the prefix cache.
    pub fn on_token_source(&self, source: &str, reused: usize, total: usize) {
        self.counter(
            HotFamily::TokenSources,
            &self.token_sources,
            &["source"],
            &[source],
            |c| {
                c.inc();
            },
        );
        if source == "prompt" {
            let tokens = &self.tokenize_tokens;
            self.counter(
                HotFamily::TokenizeTokens,
                tokens,
                &["how"],
                &["reused"],
                |c| {
                    c.inc_by(reused as u64);
                },
            );
            let encoded = total.saturating_sub(reused) as u64;
            self.counter(
                HotFamily::TokenizeTokens,
                tokens,
                &["how"],
                &["encoded"],
                |c| {
                    c.inc_by(encoded);
                },
            );
        }
    }

    /// One cache hit's outcome on `worker` (id): the router `predicted` that many prompt
    /// tokens cached ([`crate::policy::Reason::predicted_cached_tokens`]) and the engine
    /// `served` that many from its cache (its response's `cached_tokens`). Adds both, the
    /// phantom shortfall `max(0, predicted − served)` and the unannounced excess
    /// `max(0, served − predicted)`, and counts an unannounced hit when the excess is > 0:
    /// a prefix the engine held but the index did not know (bug-cases.md B37), tokens.
    pub fn on_worker_hit_outcome(&self, worker: usize, predicted: u64, served: u64) {
        let mut h = HitTokens::default();
        h.add(predicted, served);
        self.add_hit_tokens(worker, h);
    }

    fn add_hit_tokens(&self, worker: usize, h: HitTokens) {
        for (kind, v) in h.by_kind() {
            self.hit_tokens
                .get_or_create(&vec![
                    ("worker", worker_label(worker)),
                    ("kind", kind.to_string()),
                ])
                .inc_by(v);
        }
        if h.unannounced_hits > 0 {
            self.unannounced_hits
                .get_or_create(&vec![("worker", worker_label(worker))])
                .inc_by(h.unannounced_hits);
        }
    }

    /// An `x-kvroute-routing-tokens` header that was ignored (`reason`: `too_long`,
    /// `too_many`, `malformed`). Never an error for the request.
    pub fn on_routing_tokens_rejected(&self, reason: &str) {
        inc_labelled(&self.header_rejected, "reason", reason, 1);
    }

    /// Sets `worker`'s (id) health, breaker and draining gauges; call on every change or
    /// before each scrape. A worker appears in these gauges only once this was called for it.
    pub fn set_worker_state(&self, worker: usize, state: WorkerState) {
        let labels = vec![("worker", worker_label(worker))];
        self.healthy
            .get_or_create(&labels)
            .set(i64::from(state.healthy));
        self.breaker
            .get_or_create(&labels)
            .set(state.breaker as i64);
        self.draining
            .get_or_create(&labels)
            .set(i64::from(state.draining));
    }

    /// Drops `worker`'s (id) gauges (in flight, foreign, healthy, breaker, draining), e.g.
    /// after it left the fleet, so no stale value is scraped. Its counters stay (they are
    /// totals).
    pub fn forget_worker(&self, worker: usize) {
        let labels = vec![("worker", worker_label(worker))];
        for g in [
            &self.in_flight,
            &self.foreign,
            &self.healthy,
            &self.breaker,
            &self.draining,
        ] {
            g.remove(&labels);
        }
    }

    /// A DNS discovery lookup of `source` (its spec's `NAME:PORT` or `srv:NAME`) gave no
    /// usable answer (`kvroute_discovery_errors_total{source}`).
    pub fn on_discovery_error(&self, source: &str) {
        inc_labelled(&self.discovery_errors, "source", source, 1);
    }

    /// A DNS discovery answer of `source` was cut to the address cap
    /// (`kvroute_discovery_truncations_total{source}`).
    pub fn on_discovery_truncated(&self, source: &str) {
        inc_labelled(&self.discovery_truncations, "source", source, 1);
    }

    /// `source` has `workers` workers in the fleet now (`kvroute_discovery_workers{source}`).
    pub fn set_discovered_workers(&self, source: &str, workers: usize) {
        self.discovered
            .get_or_create(&vec![("source", source.to_string())])
            .set(workers as i64);
    }

    /// A replica sync message of type `kind` was published (`kvroute_sync_sent_total{type}`).
    pub fn on_sync_sent(&self, kind: &str) {
        inc_labelled(&self.sync_sent, "type", kind, 1);
    }

    /// `n` replica sync messages were not published (`kvroute_sync_dropped_total{reason}`).
    pub fn on_sync_dropped(&self, reason: &str, n: u64) {
        inc_labelled(&self.sync_dropped, "reason", reason, n);
    }

    /// A replica sync message of type `kind` ([`crate::sync::SyncMsg::kind`], or `unknown`
    /// for one that did not parse) arrived and was applied with `outcome`
    /// ([`crate::sync::Applied::as_str`], or `bad_message`)
    /// (`kvroute_sync_received_total{type,outcome}`).
    pub fn on_sync_received(&self, kind: &str, outcome: &str) {
        self.sync_received
            .get_or_create(&vec![
                ("type", kind.to_string()),
                ("outcome", outcome.to_string()),
            ])
            .inc();
    }

    /// Replica sync's NATS connection went up or down (`kvroute_sync_connected`), and the
    /// peers heard from within the silence limit (`kvroute_sync_peers`).
    pub fn set_sync_state(&self, connected: bool, peers: usize) {
        self.sync_connected.set(i64::from(connected));
        self.sync_peers.set(peers as i64);
    }

    /// `n` peer bookings ended without their done message
    /// (`kvroute_sync_peer_bookings_expired_total`).
    pub fn on_sync_peer_expired(&self, n: usize) {
        self.sync_peer_expired.inc_by(n as u64);
    }

    /// Replaces the KV-event streams' numbers exposed from the next scrape on
    /// (`kvroute_kv_events_*`, `kvroute_kv_indexed_blocks`); usually called right before
    /// encoding with the event index's current stats. Empty: the families are left out.
    pub fn set_event_streams(&self, streams: Vec<StreamSample>) {
        self.scraped.set_streams(streams);
    }

    /// Replaces the `kvroute_index_size{index,model}` gauges exposed from the next scrape
    /// on (an index absent from `sizes` is no longer exposed).
    pub fn set_index_sizes(&self, sizes: Vec<IndexSize>) {
        self.scraped.set_index_sizes(sizes);
    }

    /// OpenMetrics text of everything ([`Metrics::encode_as`] with
    /// [`Format::OpenMetrics`]); kept for callers that parse the text themselves.
    pub fn encode(&self, workers: &Workers) -> String {
        self.encode_as(workers, Format::OpenMetrics)
    }

    /// Everything in `format`, the in-flight and foreign gauges read from `workers` now.
    /// Serve it with [`Format::content_type`].
    pub fn encode_as(&self, workers: &Workers, format: Format) -> String {
        for w in workers.iter() {
            let labels = vec![("worker", worker_label(w.id))];
            self.in_flight
                .get_or_create(&labels)
                .set(w.in_flight() as i64);
            self.foreign.get_or_create(&labels).set(w.foreign() as i64);
        }
        let mut out = String::new();
        let written = match format {
            Format::OpenMetrics => {
                prometheus_client::encoding::text::encode(&mut out, &self.registry)
            }
            Format::Prometheus => {
                prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
            }
        };
        written.expect("encoding into a String cannot fail");
        out
    }
}

/// Cache hits' predictions against what the engines served, summed over hits, tokens: the
/// numbers behind `kvroute_hit_tokens_total{kind}` and `kvroute_unannounced_hits_total`
/// (bug-cases.md B37), also kept by the simulator (`kvroute_bench::sim`) and the demo.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct HitTokens {
    /// Prompt tokens the router predicted cached
    /// ([`crate::policy::Reason::predicted_cached_tokens`]).
    pub predicted: u64,
    /// Prompt tokens the engines served from cache (`cached_tokens`).
    pub served: u64,
    /// Σ `max(0, predicted − served)`: predicted, not served.
    pub phantom: u64,
    /// Σ `max(0, served − predicted)`: served, not predicted.
    pub unannounced: u64,
    /// Hits with an unannounced excess > 0.
    pub unannounced_hits: u64,
}

impl std::fmt::Display for HitTokens {
    /// One line for the demo and the simulator: `on hits the router predicted P cached tokens,
    /// engines served S: phantom X (x % of predicted), unannounced U in H hits`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "on hits the router predicted {} cached tokens, engines served {}: phantom {} \
             ({:.1} % of predicted), unannounced {} in {} hits",
            self.predicted,
            self.served,
            self.phantom,
            100.0 * self.phantom as f64 / self.predicted.max(1) as f64,
            self.unannounced,
            self.unannounced_hits,
        )
    }
}

impl HitTokens {
    /// Adds one hit that predicted `predicted` tokens and was served `served`.
    pub fn add(&mut self, predicted: u64, served: u64) {
        self.predicted += predicted;
        self.served += served;
        self.phantom += predicted.saturating_sub(served);
        self.unannounced += served.saturating_sub(predicted);
        self.unannounced_hits += u64::from(served > predicted);
    }

    /// The four token sums by their `kind` label of `kvroute_hit_tokens_total`.
    fn by_kind(&self) -> [(&'static str, u64); 4] {
        [
            ("predicted", self.predicted),
            ("served", self.served),
            ("phantom", self.phantom),
            ("unannounced", self.unannounced),
        ]
    }
}

/// Adds `n` to the sample of `family` labelled `name="value"`.
fn inc_labelled(family: &Family<Labels, Counter>, name: &'static str, value: &str, n: u64) {
    family
        .get_or_create(&vec![(name, value.to_string())])
        .inc_by(n);
}
