//! [`Record`]: one per request, made when its head is parsed, filled in as the exchange goes,
//! and emitted exactly once when it drops, whatever the outcome: the request counters and
//! histograms, the hit-outcome counters, and the access-log line (target `kvroute::access`).

use crate::state::Shared;
use kvroute_core::metrics::Phase;
use kvroute_core::policy::Reason;
#[cfg(doc)]
use kvroute_core::workers::ModelStanding;
use kvroute_core::workers::Worker;
use std::time::{Duration, Instant};

/// The `model` label of a request whose model no worker lists (an unknown name, answered
/// 404, or one taken before any worker's list is known): one series for all such names.
pub const UNLISTED_MODEL: &str = "(unlisted)";

/// What the access log and the request metrics say of one request.
pub struct Record<'a> {
    shared: &'a Shared,
    /// Method.
    pub method: &'a str,
    /// Path of the target (without the query; an absolute-form target's path only).
    pub path: &'a str,
    /// Metric label of the route (a fixed set).
    pub route: &'static str,
    /// When the transport started reading the request.
    pub received: Instant,
    /// `x-request-id` (taken or generated).
    pub request_id: &'a str,
    /// Status sent to the client (0: none, the client left first).
    pub status: u16,
    /// `model` of the body ("" when none), as the client sent it: the access log's.
    pub model: String,
    /// Some worker lists `model` ([`ModelStanding::Listed`]): only then is it the metrics'
    /// `model` label, else [`UNLISTED_MODEL`]. A client's unchecked string as a label value
    /// would make one series per name it invents (each label set of a request counter holds
    /// a 2 KiB array of per-shard cells), an unbounded registry.
    pub model_listed: bool,
    /// The worker the request was committed to (or the last one tried).
    pub worker: Option<usize>,
    /// The policy's branch (`hit`, `miss`, ...), once committed.
    pub branch: &'static str,
    /// Cached tokens the policy predicted on the chosen worker, from the engine's usage.
    pub predicted_cached: Option<u64>,
    /// Cached tokens the engine reported serving (`usage.prompt_tokens_details`).
    pub served_cached: Option<u64>,
    /// When the first attempt was sent upstream (router-added latency, request side).
    pub upstream_sent: Option<Instant>,
    /// Time from `received` to the first body byte written to the client.
    pub ttft: Option<Duration>,
    /// Time from the worker's first byte to its write to the client (router-added latency,
    /// response side).
    pub response_added: Option<Duration>,
    /// Failed attempts retried on another worker.
    pub retries: u32,
    /// Mid-stream migrations.
    pub migrations: u32,
    /// Why the request failed, if it did (a metric `kind` label).
    pub error: Option<&'static str>,
}

impl<'a> Record<'a> {
    /// A record for a request read since `received`.
    pub fn new(
        shared: &'a Shared,
        method: &'a str,
        path: &'a str,
        route: &'static str,
        received: Instant,
        request_id: &'a str,
    ) -> Self {
        Self {
            shared,
            method,
            path,
            route,
            received,
            request_id,
            status: 0,
            model: String::new(),
            model_listed: false,
            worker: None,
            branch: "",
            predicted_cached: None,
            served_cached: None,
            upstream_sent: None,
            ttft: None,
            response_added: None,
            retries: 0,
            migrations: 0,
            error: None,
        }
    }

    /// The request is committed to `worker` for `reason`.
    pub fn commit(&mut self, worker: &Worker, reason: Reason) {
        self.worker = Some(worker.id);
        self.branch = reason.as_str();
    }
}

impl Drop for Record<'_> {
    fn drop(&mut self) {
        let m = &self.shared.metrics;
        let elapsed = self.received.elapsed();
        let label = if self.model_listed || self.model.is_empty() {
            self.model.as_str()
        } else {
            UNLISTED_MODEL
        };
        m.on_request_done(
            self.route,
            self.status,
            label,
            self.worker,
            elapsed.as_secs_f64(),
        );
        if let Some(sent) = self.upstream_sent {
            let added = sent.duration_since(self.received).as_secs_f64();
            m.on_router_added(Phase::Request, added);
        }
        if let Some(d) = self.response_added {
            m.on_router_added(Phase::Response, d.as_secs_f64());
        }
        if let Some(t) = self.ttft {
            m.on_ttft(self.route, t.as_secs_f64());
        }
        if let (Some(w), Some(p), Some(s)) =
            (self.worker, self.predicted_cached, self.served_cached)
        {
            m.on_worker_hit_outcome(w, p, s);
        }
        // The access line's fields are built only when it is logged (RUST_LOG=warn, as in
        // perf/compare.sh, skips them).
        if !tracing::enabled!(target: "kvroute::access", tracing::Level::INFO) {
            return;
        }
        // Fields without a value are left out (README, Logs): a request refused before its
        // head was read has no method, path or request id; before its model was read, or
        // before a worker was chosen, none of those.
        fn text(s: &str) -> Option<tracing::field::DisplayValue<&str>> {
            (!s.is_empty()).then(|| tracing::field::display(s))
        }
        let model = text(&self.model);
        let branch = (!self.branch.is_empty()).then_some(self.branch);
        tracing::info!(
            target: "kvroute::access",
            method = text(self.method),
            path = text(self.path),
            status = self.status,
            model,
            worker = self.worker.map(tracing::field::display),
            branch,
            predicted_cached = self.predicted_cached,
            served_cached = self.served_cached,
            ttft_ms = self.ttft.map(log_ms),
            duration_ms = log_ms(elapsed),
            retries = self.retries,
            migrations = self.migrations,
            error = self.error,
            request_id = text(self.request_id),
            "request"
        );
    }
}

/// `d` in ms with µs precision for the access log (`24.795`, not the binary fraction
/// `24.794980000000002` of `as_secs_f64() * 1e3`): an integer count of µs over 10³ is the
/// double nearest the 3-decimal value, which prints as those decimals.
fn log_ms(d: std::time::Duration) -> f64 {
    d.as_micros() as f64 / 1e3
}
