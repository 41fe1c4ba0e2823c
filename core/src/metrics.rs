//! [`Metrics`]: the gateway's Prometheus metrics (prometheus-client), shared by all shards.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `kvroute_requests_total` | counter | `route`, `status` |
//! | `kvroute_worker_requests_total` | counter | `worker` |
//! | `kvroute_decisions_total` | counter | `policy`, `reason` (`hit`, `miss`, `spill`, ...) |
//! | `kvroute_upstream_errors_total` | counter | `worker`, `kind` |
//! | `kvroute_bad_requests_total` | counter | `reason` |
//! | `kvroute_token_source_total` | counter | `source` (`none`, `body`, `header`, `prompt`) |
//! | `kvroute_routing_tokens_rejected_total` | counter | `reason` (`too_long`, `too_many`, `malformed`) |
//! | `kvroute_tokenize_tokens_total` | counter | `how` (`reused`, `encoded`) |
//! | `kvroute_hit_tokens_total` | counter | `worker`, `kind` (`predicted`, `served`, `phantom`, `unannounced`) |
//! | `kvroute_unannounced_hits_total` | counter | `worker` |
//! | `kvroute_request_duration_seconds` | histogram | — |
//! | `kvroute_worker_in_flight` | gauge | `worker` (read from [`Workers`] at scrape time) |
//! | `kvroute_worker_foreign_requests` | gauge | `worker` (the last engine load report's requests from elsewhere) |

use crate::workers::Workers;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

/// The gateway's metrics. `Send + Sync`; every recording method takes `&self`.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    worker_requests: Family<Labels, Counter>,
    decisions: Family<Labels, Counter>,
    upstream_errors: Family<Labels, Counter>,
    bad_requests: Family<Labels, Counter>,
    token_sources: Family<Labels, Counter>,
    header_rejected: Family<Labels, Counter>,
    tokenize_tokens: Family<Labels, Counter>,
    hit_tokens: Family<Labels, Counter>,
    unannounced_hits: Family<Labels, Counter>,
    duration: Histogram,
    in_flight: Family<Labels, Gauge>,
    foreign: Family<Labels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric (all start at zero).
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<Labels, Counter>::default();
        let worker_requests = Family::<Labels, Counter>::default();
        let decisions = Family::<Labels, Counter>::default();
        let upstream_errors = Family::<Labels, Counter>::default();
        let bad_requests = Family::<Labels, Counter>::default();
        let token_sources = Family::<Labels, Counter>::default();
        let header_rejected = Family::<Labels, Counter>::default();
        let tokenize_tokens = Family::<Labels, Counter>::default();
        let hit_tokens = Family::<Labels, Counter>::default();
        let unannounced_hits = Family::<Labels, Counter>::default();
        registry.register(
            "kvroute_hit_tokens",
            "Cache hits: prompt tokens the router predicted the worker holds, the tokens the \
             engine served from its cache (usage.prompt_tokens_details.cached_tokens), and the \
             shortfall (phantom) and excess (unannounced) of served against predicted",
            hit_tokens.clone(),
        );
        registry.register(
            "kvroute_unannounced_hits",
            "Cache hits where the engine served more cached tokens than the router predicted \
             (bug-cases.md B37)",
            unannounced_hits.clone(),
        );
        registry.register(
            "kvroute_token_source",
            "Routed requests by where their token ids came from",
            token_sources.clone(),
        );
        registry.register(
            "kvroute_routing_tokens_rejected",
            "x-kvroute-routing-tokens headers ignored, by reason",
            header_rejected.clone(),
        );
        registry.register(
            "kvroute_tokenize_tokens",
            "Prompt tokens produced by the router, reused from the prefix cache or encoded",
            tokenize_tokens.clone(),
        );
        // 1 ms … ~33 min in ×2 steps: TTFT-scale to long generations.
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 22));
        let in_flight = Family::<Labels, Gauge>::default();
        let foreign = Family::<Labels, Gauge>::default();
        registry.register(
            "kvroute_worker_foreign_requests",
            "Requests the engine runs or queues that this router did not send, from its last \
             load report (0 when load reports are off)",
            foreign.clone(),
        );
        registry.register(
            "kvroute_requests",
            "Responses sent, by route and status",
            requests.clone(),
        );
        registry.register(
            "kvroute_worker_requests",
            "Requests proxied, by worker",
            worker_requests.clone(),
        );
        registry.register(
            "kvroute_decisions",
            "Routing decisions, by policy and reason",
            decisions.clone(),
        );
        registry.register(
            "kvroute_upstream_errors",
            "Failed exchanges with workers, by kind",
            upstream_errors.clone(),
        );
        registry.register(
            "kvroute_bad_requests",
            "Requests refused as invalid, by reason",
            bad_requests.clone(),
        );
        registry.register(
            "kvroute_request_duration_seconds",
            "Time from routing to the end of the response, s",
            duration.clone(),
        );
        registry.register(
            "kvroute_worker_in_flight",
            "Requests in flight, by worker",
            in_flight.clone(),
        );
        Self {
            registry,
            requests,
            worker_requests,
            decisions,
            upstream_errors,
            bad_requests,
            token_sources,
            header_rejected,
            tokenize_tokens,
            hit_tokens,
            unannounced_hits,
            duration,
            in_flight,
            foreign,
        }
    }

    /// One routing decision.
    pub fn on_decision(&self, policy: &str, reason: &str) {
        self.decisions
            .get_or_create(&vec![
                ("policy", policy.to_string()),
                ("reason", reason.to_string()),
            ])
            .inc();
    }

    /// One response sent for `route`; `worker` empty when none was chosen; `seconds` from
    /// routing to the end of the response.
    pub fn on_response(&self, route: &str, status: u16, worker: &str, seconds: f64) {
        self.requests
            .get_or_create(&vec![
                ("route", route.to_string()),
                ("status", status.to_string()),
            ])
            .inc();
        if !worker.is_empty() {
            self.worker_requests
                .get_or_create(&vec![("worker", worker.to_string())])
                .inc();
            self.duration.observe(seconds);
        }
    }

    /// A failed exchange with `worker` (`kind`: connect, timeout, upstream, client_gone, ...).
    pub fn on_upstream_error(&self, worker: &str, kind: &str) {
        self.upstream_errors
            .get_or_create(&vec![
                ("worker", worker.to_string()),
                ("kind", kind.to_string()),
            ])
            .inc();
    }

    /// A request refused as invalid (`reason`: malformed, head_too_large, body_too_large, ...).
    pub fn on_bad_request(&self, reason: &str) {
        self.bad_requests
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc();
    }

    /// Where one routed request's token ids came from (`source`: `none`, `body`, `header`,
    /// `prompt`); for `prompt`, `reused` of its `total` tokens came from the prefix cache.
    pub fn on_token_source(&self, source: &str, reused: usize, total: usize) {
        self.token_sources
            .get_or_create(&vec![("source", source.to_string())])
            .inc();
        if source == "prompt" {
            self.tokenize_tokens
                .get_or_create(&vec![("how", "reused".to_string())])
                .inc_by(reused as u64);
            self.tokenize_tokens
                .get_or_create(&vec![("how", "encoded".to_string())])
                .inc_by(total.saturating_sub(reused) as u64);
        }
    }

    /// One cache hit's outcome on `worker`: the router `predicted` that many prompt tokens
    /// cached ([`crate::policy::Reason::predicted_cached_tokens`]) and the engine `served`
    /// that many from its cache (its response's `cached_tokens`). Adds both, the phantom
    /// shortfall `max(0, predicted − served)` and the unannounced excess
    /// `max(0, served − predicted)`, and counts an unannounced hit when the excess is > 0:
    /// a prefix the engine held but the index did not know (bug-cases.md B37), tokens.
    pub fn on_hit_outcome(&self, worker: &str, predicted: u64, served: u64) {
        let mut h = HitTokens::default();
        h.add(predicted, served);
        let add = |kind: &str, v: u64| {
            self.hit_tokens
                .get_or_create(&vec![
                    ("worker", worker.to_string()),
                    ("kind", kind.to_string()),
                ])
                .inc_by(v);
        };
        add("predicted", h.predicted);
        add("served", h.served);
        add("phantom", h.phantom);
        add("unannounced", h.unannounced);
        if h.unannounced_hits > 0 {
            self.unannounced_hits
                .get_or_create(&vec![("worker", worker.to_string())])
                .inc();
        }
    }

    /// An `x-kvroute-routing-tokens` header that was ignored (`reason`: `too_long`,
    /// `too_many`, `malformed`). Never an error for the request.
    pub fn on_routing_tokens_rejected(&self, reason: &str) {
        self.header_rejected
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc();
    }

    /// Prometheus text exposition of everything, in-flight and foreign gauges read from
    /// `workers` now.
    pub fn encode(&self, workers: &Workers) -> String {
        for w in workers.iter() {
            self.in_flight
                .get_or_create(&vec![("worker", w.url.clone())])
                .set(w.in_flight() as i64);
            self.foreign
                .get_or_create(&vec![("worker", w.url.clone())])
                .set(w.foreign() as i64);
        }
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Cache hits' predictions against what the engines served, summed over hits, tokens: the
/// numbers behind `kvroute_hit_tokens_total{kind}` and `kvroute_unannounced_hits_total`
/// (bug-cases.md B37), also kept by the simulator (`kvroute_bench::sim`) and the demo.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_shared_across_shards() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Metrics>();
        let m = std::sync::Arc::new(Metrics::new());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..250 {
                        m.on_decision("round_robin", "round_robin");
                        m.on_upstream_error("http://a:1", "connect");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let text = m.encode(&Workers::new(&["http://a:1".into()]).unwrap());
        assert!(
            text.contains(
                "kvroute_decisions_total{policy=\"round_robin\",reason=\"round_robin\"} 1000"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "kvroute_upstream_errors_total{worker=\"http://a:1\",kind=\"connect\"} 1000"
            ),
            "{text}"
        );
        assert!(
            text.contains("kvroute_worker_in_flight{worker=\"http://a:1\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn encodes_counters_and_in_flight() {
        let m = Metrics::new();
        let w = Workers::new(&["http://a:1".into()]).unwrap();
        let _g = w.acquire(0);
        m.on_decision("cache_aware", "hit");
        m.on_decision("cache_aware", "hit");
        m.on_response("/v1/completions", 200, "http://a:1", 0.01);
        m.on_bad_request("malformed");
        let text = m.encode(&w);
        assert!(
            text.contains("kvroute_decisions_total{policy=\"cache_aware\",reason=\"hit\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_requests_total{route=\"/v1/completions\",status=\"200\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_worker_in_flight{worker=\"http://a:1\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_bad_requests_total{reason=\"malformed\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_request_duration_seconds_count 1"),
            "{text}"
        );
    }

    /// Phantom and unannounced are the two sides of served − predicted; an unannounced hit is
    /// counted only when the engine served more than predicted (B37).
    #[test]
    fn hit_outcomes_split_into_phantom_and_unannounced() {
        let m = Metrics::new();
        let w = Workers::new(&["http://a:1".into()]).unwrap();
        m.on_hit_outcome("http://a:1", 1024, 512); // 512 evicted after the decision
        m.on_hit_outcome("http://a:1", 256, 768); // 512 the index did not know
        m.on_hit_outcome("http://a:1", 64, 64);
        let text = m.encode(&w);
        for (kind, v) in [
            ("predicted", 1344),
            ("served", 1344),
            ("phantom", 512),
            ("unannounced", 512),
        ] {
            let line =
                format!("kvroute_hit_tokens_total{{worker=\"http://a:1\",kind=\"{kind}\"}} {v}");
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(
            text.contains("kvroute_unannounced_hits_total{worker=\"http://a:1\"} 1"),
            "{text}"
        );
    }
}
