//! Open-loop trace replay against an OpenAI-compatible endpoint (a kvroute router or an engine),
//! and the reports the demo prints.
//!
//! [`replay`] sends each [`TraceRecord`] as a streaming `POST /v1/chat/completions` at its
//! scheduled time (`timestamp_ms / time_scale`), whatever other requests are doing
//! (traces.md §4), and aggregates a [`ReplayReport`]: TTFT/TPOT/e2e percentiles (ms), the
//! token-weighted hit rate from `usage.prompt_tokens_details.cached_tokens`, and requests per
//! worker from the `x-kvroute-worker` response header.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::BodyExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::{CHAT_COMPLETIONS_PATH, Conn, Target};
use crate::trace::{PromptBuilder, TraceRecord};

/// Response header naming the worker a router picked. Absent (direct engine) → [`DIRECT_WORKER`].
pub const WORKER_HEADER: &str = "x-kvroute-worker";
/// Worker name recorded when a response has no [`WORKER_HEADER`].
pub const DIRECT_WORKER: &str = "direct";
/// Default target base URL (the router's default listen address).
pub const DEFAULT_URL: &str = "http://127.0.0.1:8000";
/// Default model name sent in requests.
pub const DEFAULT_MODEL: &str = "Qwen/Qwen3-0.6B";
/// Default time scale: trace timestamps are divided by it (2.0 replays twice as fast).
pub const DEFAULT_TIME_SCALE: f64 = 1.0;
/// Default cap on requests in flight; a request due while the cap is reached waits (the lag is
/// reported as `max_send_lag_ms`). A safety bound, not part of the open-loop model.
pub const DEFAULT_MAX_CONCURRENCY: usize = 1_024;
/// Default per-request timeout (connect to last byte), ms.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 120_000;
/// Largest latency the histograms record, µs (1 hour); larger values are clamped.
pub const MAX_RECORDED_LATENCY_US: u64 = 3_600_000_000;

/// Settings of one replay run.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Base URL, `http://host:port` with an optional path prefix (no TLS).
    pub url: String,
    /// `model` field of each request.
    pub model: String,
    /// Trace timestamps (ms) are divided by this; must be > 0.
    pub time_scale: f64,
    /// Most requests in flight; `None` = unbounded (pure open loop).
    pub max_concurrency: Option<usize>,
    /// Per-request timeout, connect to last byte; a timeout counts as error `timeout`.
    pub request_timeout: Duration,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Send `ignore_eos: true` (vLLM/SGLang extension) so engines generate `output_length`
    /// tokens, as the trace recorded.
    pub ignore_eos: bool,
    /// Number of workers behind the router, if known: `max_over_mean_load` then divides by it,
    /// so workers that got no request count in the mean. `None`: workers seen in responses.
    pub expected_workers: Option<usize>,
    /// Keep one [`RequestSample`] per request in the report.
    pub keep_samples: bool,
    /// Further base URLs of the same fleet: router replicas behind a round-robin L4 balancer.
    /// The k-th request sent goes to `[url, replicas…][k mod (1 + replicas.len())]`, so the
    /// turns of one conversation land on different replicas. Empty: everything to `url`.
    pub replicas: Vec<String>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            url: DEFAULT_URL.to_string(),
            model: DEFAULT_MODEL.to_string(),
            time_scale: DEFAULT_TIME_SCALE,
            max_concurrency: Some(DEFAULT_MAX_CONCURRENCY),
            request_timeout: Duration::from_millis(DEFAULT_REQUEST_TIMEOUT_MS),
            progress: false,
            ignore_eos: true,
            expected_workers: None,
            keep_samples: false,
            replicas: Vec::new(),
        }
    }
}

/// Errors that stop a replay before it starts.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// `url` is not `http://host[:port][/prefix]`.
    #[error("bad replay url {url:?}: {reason}")]
    BadUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `time_scale` is not a positive finite number.
    #[error("time_scale must be > 0 and finite, got {0}")]
    BadTimeScale(f64),
}

/// Percentiles of one latency, ms. All 0 when `count` is 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Samples recorded.
    pub count: u64,
    /// Median, ms.
    pub p50: f64,
    /// 90th percentile, ms.
    pub p90: f64,
    /// 99th percentile, ms.
    pub p99: f64,
    /// 99.9th percentile, ms (absent from reports written before it existed: 0).
    #[serde(default)]
    pub p999: f64,
    /// Mean, ms.
    pub mean: f64,
    /// Maximum, ms.
    pub max: f64,
}

impl LatencySummary {
    /// The summary of a histogram of µs values (as [`new_hist`] makes).
    pub(crate) fn from_hist(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let ms = |us: u64| us as f64 / 1_000.0;
        Self {
            count: h.len(),
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            mean: h.mean() / 1_000.0,
            max: ms(h.max()),
        }
    }
}

/// Outcome of one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestSample {
    /// Index of the record in the replayed slice.
    pub index: usize,
    /// Worker from [`WORKER_HEADER`], [`DIRECT_WORKER`] without it, `None` without a response.
    pub worker: Option<String>,
    /// HTTP status, `None` without a response.
    pub status: Option<u16>,
    /// Error kind (`status_<code>`, `connect`, `transport`, `timeout`, `stream_error`,
    /// `no_done`), `None` on success.
    pub error: Option<String>,
    /// Send start minus scheduled time, µs.
    pub send_lag_us: u64,
    /// Time to the first content chunk, µs (`None` if no content arrived).
    pub ttft_us: Option<u64>,
    /// Send start to end of stream, µs.
    pub e2e_us: u64,
    /// `usage.prompt_tokens` (0 without usage).
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens` (0 when absent).
    pub cached_tokens: u64,
    /// `usage.completion_tokens`, or content chunks counted when usage is absent.
    pub completion_tokens: u64,
    /// Whether the stream carried a usage object.
    pub usage_seen: bool,
}

/// Aggregate of one replay run; serialises to JSON for `--out`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReplayReport {
    /// Target base URL.
    pub url: String,
    /// Model sent.
    pub model: String,
    /// Time scale used.
    pub time_scale: f64,
    /// Requests sent (= records replayed).
    pub requests: u64,
    /// Requests that ended with status 200 and `data: [DONE]`.
    pub ok: u64,
    /// Requests that failed (`requests − ok`).
    pub errors: u64,
    /// Failures per kind (see [`RequestSample::error`]).
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Wall time from start to last response, s.
    pub duration_s: f64,
    /// Time to first content chunk of successful requests, ms (e2e for a response without
    /// content).
    pub ttft_ms: LatencySummary,
    /// Time per output token `(e2e − ttft)/(completion_tokens − 1)` of successful requests with
    /// ≥ 2 completion tokens, ms.
    pub tpot_ms: LatencySummary,
    /// End-to-end latency of successful requests, ms.
    pub e2e_ms: LatencySummary,
    /// Σ `prompt_tokens` over successful requests.
    pub prompt_tokens: u64,
    /// Σ `cached_tokens` over successful requests.
    pub cached_tokens: u64,
    /// Σ `completion_tokens` over successful requests.
    pub completion_tokens: u64,
    /// `cached_tokens / prompt_tokens` (0 when no prompt tokens), fraction 0–1.
    pub hit_rate: f64,
    /// Successful requests whose stream had no usage chunk.
    pub usage_missing: u64,
    /// Requests per worker, over all requests that got a response (any status).
    pub per_worker: BTreeMap<String, u64>,
    /// Max requests on one worker / mean requests per worker (1.0 = perfectly even; 0 when no
    /// responses). The mean divides by `expected_workers` when configured.
    pub max_over_mean_load: f64,
    /// Largest lag of a send behind its schedule, ms (client or concurrency cap falling behind).
    pub max_send_lag_ms: f64,
    /// Per-request outcomes, only with `keep_samples`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub samples: Vec<RequestSample>,
}

/// `{url's path}/v1/chat/completions` of a base URL.
fn chat_target(url: &str) -> Result<Target, ReplayError> {
    Target::parse(url, |prefix| format!("{prefix}{CHAT_COMPLETIONS_PATH}")).map_err(|e| {
        ReplayError::BadUrl {
            url: e.url,
            reason: e.reason,
        }
    })
}

/// JSON body of the chat request for one record.
fn request_body(cfg: &ReplayConfig, text: String, max_tokens: u32) -> Bytes {
    let mut body = serde_json::json!({
        "model": cfg.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if cfg.ignore_eos {
        body["ignore_eos"] = serde_json::Value::Bool(true);
    }
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// State of one SSE stream as chunks arrive.
#[derive(Default)]
struct StreamState {
    line: Vec<u8>,
    first_content: Option<Instant>,
    content_chunks: u64,
    usage: Option<(u64, u64, u64)>,
    done: bool,
    error: bool,
}

impl StreamState {
    /// Feeds body bytes; handles complete `data:` lines (one JSON payload per line).
    fn feed(&mut self, bytes: &[u8], now: Instant) {
        for &b in bytes {
            if b == b'\n' {
                let line = std::mem::take(&mut self.line);
                self.handle_line(&line, now);
            } else {
                self.line.push(b);
            }
        }
    }

    fn handle_line(&mut self, line: &[u8], now: Instant) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
            self.error = true;
            return;
        };
        if v.get("error").is_some_and(|e| !e.is_null()) {
            self.error = true;
        }
        if let Some(delta) = v.pointer("/choices/0/delta") {
            let has_text = |k: &str| {
                delta
                    .get(k)
                    .and_then(|c| c.as_str())
                    .is_some_and(|s| !s.is_empty())
            };
            if has_text("content") || has_text("reasoning_content") {
                self.content_chunks += 1;
                self.first_content.get_or_insert(now);
            }
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            let n = |p: &str| u.pointer(p).and_then(|x| x.as_u64()).unwrap_or(0);
            self.usage = Some((
                n("/prompt_tokens"),
                n("/prompt_tokens_details/cached_tokens"),
                n("/completion_tokens"),
            ));
        }
    }
}

/// Sends one request and reads its stream to the end; fills `sample` as far as it gets.
async fn send_one(target: &Target, body: Bytes, start: Instant, sample: &mut RequestSample) {
    let mut conn = match Conn::open(target).await {
        Ok(c) => c,
        Err(e) => {
            sample.error = Some(e.kind().into());
            return;
        }
    };
    let resp = match conn.sender.send_request(target.post_json(body, true)).await {
        Ok(r) => r,
        Err(_) => {
            sample.error = Some("transport".into());
            return;
        }
    };
    let status = resp.status().as_u16();
    sample.status = Some(status);
    sample.worker = Some(
        resp.headers()
            .get(WORKER_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(DIRECT_WORKER)
            .to_string(),
    );
    let mut body = resp.into_body();
    let mut st = StreamState::default();
    let mut transport_error = false;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Some(data) = f.data_ref() {
                    st.feed(data, Instant::now());
                }
            }
            Err(_) => {
                transport_error = true;
                break;
            }
        }
    }
    let end = Instant::now();
    drop(conn);
    sample.e2e_us = end.duration_since(start).as_micros() as u64;
    sample.ttft_us = st
        .first_content
        .map(|t| t.duration_since(start).as_micros() as u64);
    if let Some((p, c, o)) = st.usage {
        sample.prompt_tokens = p;
        sample.cached_tokens = c;
        sample.completion_tokens = o;
        sample.usage_seen = true;
    } else {
        sample.completion_tokens = st.content_chunks;
    }
    sample.error = if status != 200 {
        Some(format!("status_{status}"))
    } else if transport_error {
        Some("transport".into())
    } else if st.error {
        Some("stream_error".into())
    } else if !st.done {
        Some("no_done".into())
    } else {
        None
    };
}

/// Replays `records` open loop against `cfg.url` (and `cfg.replicas`, in turn) and
/// aggregates the outcomes.
///
/// Record `i` is sent at `start + (timestamp_ms − earliest timestamp_ms) / time_scale` (ties
/// keep slice order) as
/// `POST {url}/v1/chat/completions` with one user message, `prompts.prompt_text(record)`,
/// `max_tokens = output_length`, `stream: true`, `stream_options.include_usage: true`. Each
/// request runs in its own task over its own HTTP/1.1 connection, so a slow response never
/// delays later sends (only `max_concurrency` can). Each request is bounded by
/// `request_timeout`; the run by `records.len()` requests. Must run inside a tokio runtime
/// with the time and net drivers.
///
/// # Errors
/// - [`ReplayError::BadUrl`]: `cfg.url` or a replica is not `http://host[:port][/prefix]`.
/// - [`ReplayError::BadTimeScale`]: `cfg.time_scale` is not positive and finite.
///
/// Request failures are not errors: they are counted in the report.
pub async fn replay(
    cfg: ReplayConfig,
    records: &[TraceRecord],
    prompts: &PromptBuilder,
) -> Result<ReplayReport, ReplayError> {
    let targets = std::iter::once(&cfg.url)
        .chain(&cfg.replicas)
        .map(|u| chat_target(u).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    if !(cfg.time_scale.is_finite() && cfg.time_scale > 0.0) {
        return Err(ReplayError::BadTimeScale(cfg.time_scale));
    }
    let mut order: Vec<usize> = (0..records.len()).collect();
    order.sort_by_key(|&i| records[i].timestamp_ms);
    let t0_ms = order.first().map_or(0, |&i| records[i].timestamp_ms);

    let bar = if cfg.progress {
        let b =
            ProgressBar::with_draw_target(Some(records.len() as u64), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests done {msg}",
        ) {
            b.set_style(style.progress_chars("=> "));
        }
        b
    } else {
        ProgressBar::hidden()
    };
    let limit = Arc::new(Semaphore::new(
        cfg.max_concurrency
            .unwrap_or(Semaphore::MAX_PERMITS)
            .clamp(1, Semaphore::MAX_PERMITS),
    ));
    let timeout = cfg.request_timeout;
    let start = Instant::now();
    let mut tasks: JoinSet<RequestSample> = JoinSet::new();
    let mut samples = Vec::with_capacity(records.len());
    for (k, &i) in order.iter().enumerate() {
        let r = &records[i];
        // Build the body before waiting, so the send itself is on time.
        let body = request_body(&cfg, prompts.prompt_text(r), r.output_length);
        let offset_s = (r.timestamp_ms - t0_ms) as f64 / 1_000.0 / cfg.time_scale;
        let due = start + Duration::from_secs_f64(offset_s);
        tokio::time::sleep_until(due.into()).await;
        let Ok(permit) = limit.clone().acquire_owned().await else {
            break; // never closed
        };
        // Collect finished tasks as we go so memory stays bounded.
        while let Some(done) = tasks.try_join_next() {
            if let Ok(s) = done {
                samples.push(s);
            }
        }
        let target = Arc::clone(&targets[k % targets.len()]);
        let bar = bar.clone();
        tasks.spawn(async move {
            let sent = Instant::now();
            let mut sample = RequestSample {
                index: i,
                send_lag_us: sent.saturating_duration_since(due).as_micros() as u64,
                ..RequestSample::default()
            };
            if tokio::time::timeout(timeout, send_one(&target, body, sent, &mut sample))
                .await
                .is_err()
            {
                sample.error = Some("timeout".into());
                sample.e2e_us = sent.elapsed().as_micros() as u64;
            }
            drop(permit);
            bar.inc(1);
            sample
        });
    }
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(s) => samples.push(s),
            Err(_) => samples.push(RequestSample {
                error: Some("panic".into()),
                ..RequestSample::default()
            }),
        }
    }
    bar.finish_and_clear();
    let duration_s = start.elapsed().as_secs_f64();
    samples.sort_by_key(|s| s.index);
    Ok(aggregate(&cfg, samples, duration_s))
}

/// An empty histogram of latencies in µs, 1 µs to [`MAX_RECORDED_LATENCY_US`], 3 significant
/// digits.
pub(crate) fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_RECORDED_LATENCY_US, 3).expect("static histogram bounds")
}

/// Builds the report from per-request samples.
pub(crate) fn aggregate(
    cfg: &ReplayConfig,
    samples: Vec<RequestSample>,
    duration_s: f64,
) -> ReplayReport {
    let (mut ttft, mut tpot, mut e2e) = (new_hist(), new_hist(), new_hist());
    let mut rep = ReplayReport {
        url: cfg.url.clone(),
        model: cfg.model.clone(),
        time_scale: cfg.time_scale,
        requests: samples.len() as u64,
        duration_s,
        ..ReplayReport::default()
    };
    let mut max_lag_us = 0u64;
    for s in &samples {
        max_lag_us = max_lag_us.max(s.send_lag_us);
        if let Some(w) = &s.worker {
            *rep.per_worker.entry(w.clone()).or_default() += 1;
        }
        if let Some(kind) = &s.error {
            rep.errors += 1;
            *rep.errors_by_kind.entry(kind.clone()).or_default() += 1;
            continue;
        }
        rep.ok += 1;
        let clamp = |us: u64| us.clamp(1, MAX_RECORDED_LATENCY_US);
        let first_us = s.ttft_us.unwrap_or(s.e2e_us);
        ttft.saturating_record(clamp(first_us));
        e2e.saturating_record(clamp(s.e2e_us));
        if s.completion_tokens >= 2 {
            let per = s.e2e_us.saturating_sub(first_us) / (s.completion_tokens - 1);
            tpot.saturating_record(clamp(per));
        }
        rep.prompt_tokens += s.prompt_tokens;
        rep.cached_tokens += s.cached_tokens;
        rep.completion_tokens += s.completion_tokens;
        if !s.usage_seen {
            rep.usage_missing += 1;
        }
    }
    rep.ttft_ms = LatencySummary::from_hist(&ttft);
    rep.tpot_ms = LatencySummary::from_hist(&tpot);
    rep.e2e_ms = LatencySummary::from_hist(&e2e);
    rep.hit_rate = if rep.prompt_tokens == 0 {
        0.0
    } else {
        rep.cached_tokens as f64 / rep.prompt_tokens as f64
    };
    rep.max_over_mean_load = max_over_mean(&rep.per_worker, cfg.expected_workers);
    rep.max_send_lag_ms = max_lag_us as f64 / 1_000.0;
    if cfg.keep_samples {
        rep.samples = samples;
    }
    rep
}

/// Max requests on one worker / mean requests per worker; the mean divides by
/// `expected_workers` when given (≥ workers seen), else by the workers present. 0 when empty.
pub fn max_over_mean(per_worker: &BTreeMap<String, u64>, expected_workers: Option<usize>) -> f64 {
    let total: u64 = per_worker.values().sum();
    let workers = expected_workers.unwrap_or(0).max(per_worker.len());
    if total == 0 || workers == 0 {
        return 0.0;
    }
    let max = per_worker.values().copied().max().unwrap_or(0);
    max as f64 / (total as f64 / workers as f64)
}

impl ReplayReport {
    /// A readable multi-line table of the report (latencies in ms, hit rate in %).
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "replay of {} requests against {} (model {}, time scale {}) in {:.1} s",
            self.requests, self.url, self.model, self.time_scale, self.duration_s
        );
        let _ = writeln!(s, "  ok {}   errors {}", self.ok, self.errors);
        for (kind, n) in &self.errors_by_kind {
            let _ = writeln!(s, "    {kind:<14} {n}");
        }
        let _ = writeln!(
            s,
            "  {:<10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "latency", "p50 ms", "p90 ms", "p99 ms", "mean ms", "max ms"
        );
        for (name, l) in [
            ("TTFT", &self.ttft_ms),
            ("TPOT", &self.tpot_ms),
            ("e2e", &self.e2e_ms),
        ] {
            let _ = writeln!(
                s,
                "  {:<10} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                name, l.p50, l.p90, l.p99, l.mean, l.max
            );
        }
        let _ = writeln!(
            s,
            "  hit rate {:.1} % ({} cached / {} prompt tokens); {} completion tokens",
            self.hit_rate * 100.0,
            self.cached_tokens,
            self.prompt_tokens,
            self.completion_tokens
        );
        if self.usage_missing > 0 {
            let _ = writeln!(s, "  {} responses had no usage chunk", self.usage_missing);
        }
        let _ = writeln!(
            s,
            "  load: max/mean {:.2} over {} workers; max send lag {:.1} ms",
            self.max_over_mean_load,
            self.per_worker.len(),
            self.max_send_lag_ms
        );
        for (w, n) in &self.per_worker {
            let _ = writeln!(s, "    {w:<24} {n}");
        }
        s
    }
}

/// One table comparing runs of the same workload under different policies: requests, errors,
/// hit rate (%), TTFT and e2e p50/p99 (ms), max/mean load.
pub fn comparison_table(reports: &[(String, ReplayReport)]) -> String {
    let width = reports
        .iter()
        .map(|(p, _)| p.len())
        .max()
        .unwrap_or(0)
        .max("policy".len());
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<width$} {:>8} {:>6} {:>8} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "policy",
        "requests",
        "errors",
        "hit %",
        "TTFT p50",
        "TTFT p99",
        "e2e p50",
        "e2e p99",
        "max/mean"
    );
    for (policy, r) in reports {
        let _ = writeln!(
            s,
            "{:<width$} {:>8} {:>6} {:>8.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>9.2}",
            policy,
            r.requests,
            r.errors,
            r.hit_rate * 100.0,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.e2e_ms.p50,
            r.e2e_ms.p99,
            r.max_over_mean_load
        );
    }
    let _ = writeln!(s, "(latencies in ms; hit % = cached / prompt tokens)");
    s
}

/// The demo's JSON summary, exactly
/// `{"policies":[{"policy","requests","errors","hit_rate","ttft_ms":{"p50","p99"},
/// "e2e_ms":{"p50","p99"},"max_over_mean_load"}]}` (hit rate a fraction 0–1, latencies ms).
pub fn comparison_json(reports: &[(String, ReplayReport)]) -> serde_json::Value {
    let policies: Vec<serde_json::Value> = reports
        .iter()
        .map(|(policy, r)| {
            serde_json::json!({
                "policy": policy,
                "requests": r.requests,
                "errors": r.errors,
                "hit_rate": r.hit_rate,
                "ttft_ms": {"p50": r.ttft_ms.p50, "p99": r.ttft_ms.p99},
                "e2e_ms": {"p50": r.e2e_ms.p50, "p99": r.e2e_ms.p99},
                "max_over_mean_load": r.max_over_mean_load,
            })
        })
        .collect();
    serde_json::json!({ "policies": policies })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_targets() {
        let t = chat_target("http://localhost/api/").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("localhost", 80));
        assert_eq!(t.path, "/api/v1/chat/completions");
        assert!(matches!(
            chat_target("https://x"),
            Err(ReplayError::BadUrl {
                reason: "only http:// is supported",
                ..
            })
        ));
    }

    #[test]
    fn sse_parsing_handles_split_lines_and_usage() {
        let mut st = StreamState::default();
        let now = Instant::now();
        let stream = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\r\n\r\n\
            data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
            data: {\"choices\":[{\"delta\":{\"content\":\" there\"},\"finish_reason\":\"length\"}]}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":2,\
            \"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\ndata: [DONE]\n\n";
        for chunk in stream.as_bytes().chunks(7) {
            st.feed(chunk, now);
        }
        assert_eq!(st.content_chunks, 2);
        assert_eq!(st.usage, Some((100, 64, 2)));
        assert!(st.done && !st.error && st.first_content.is_some());
    }

    #[test]
    fn load_ratio() {
        let m: BTreeMap<String, u64> = [("a".to_string(), 6), ("b".to_string(), 2)].into();
        assert!((max_over_mean(&m, None) - 1.5).abs() < 1e-12);
        assert!((max_over_mean(&m, Some(4)) - 3.0).abs() < 1e-12);
        assert_eq!(max_over_mean(&BTreeMap::new(), Some(2)), 0.0);
    }

    #[test]
    fn json_shape_is_exact() {
        let r = ReplayReport {
            requests: 3,
            errors: 1,
            hit_rate: 0.5,
            ..ReplayReport::default()
        };
        let v = comparison_json(&[("rr".to_string(), r)]);
        let p = &v["policies"][0];
        let mut keys: Vec<&str> = p.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "e2e_ms",
                "errors",
                "hit_rate",
                "max_over_mean_load",
                "policy",
                "requests",
                "ttft_ms"
            ]
        );
        assert_eq!(p["ttft_ms"].as_object().unwrap().len(), 2);
        assert_eq!(p["requests"], 3);
        assert_eq!(v.as_object().unwrap().len(), 1);
    }
}
