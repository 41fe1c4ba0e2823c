//! One request, top to bottom (style.md "One request"), whatever the client's transport:
//! route → authenticate → routing key → tokenize → attempts (snapshot → decide → guard →
//! forward → first byte) → record → relay → [`Record`] on drop.
//!
//! Failover (issue 13), in the order an attempt meets it:
//! 1. the snapshot holds only eligible workers (`kvroute_core::workers`' table), minus those
//!    this request already tried;
//! 2. the decision is read-only; the load guard is taken before the request is sent (B1);
//! 3. the client hears nothing until the worker's first body byte (the head is held), so a
//!    worker that refuses, resets, stalls past `--first-byte-timeout-secs` (or until health
//!    checks take it out) or answers 502/503/504 is retried on another worker after a jittered backoff, while retries, the
//!    fleet's retry budget and `--retry-deadline-secs` allow; each failure feeds the worker's
//!    circuit breaker, and nothing is recorded in the indexes for it;
//! 4. the first response byte commits the request: the policy's `record` runs, the response
//!    streams through;
//! 5. a worker that fails after that ends an SSE stream with an OpenAI-style error event and
//!    `data: [DONE]`, or, with `--migration-limit`, has its generation continued on another
//!    worker ([`crate::migrate`]); a plain body ends by closing the connection.

use crate::conn::Conn;
use crate::error::ProxyError;
use crate::http1::ResponseHead;
use crate::message::{
    ApiError, HeaderLine, Headers, Request, ResponseSink, respond, respond_error,
};
use crate::migrate::StreamTracker;
use crate::record::Record;
use crate::relay::{self, RelayEnd};
use crate::state::Shared;
use crate::upstream::{self, Pool};
use kvroute_core::chat_prefix::{ChatInsert, PrefixScanner};
use kvroute_core::config::defaults;
use kvroute_core::health::{Outcome, is_retryable_status};
use kvroute_core::metrics::Format;
use kvroute_core::policy::Decision;
use kvroute_core::route_key::{Endpoint, RouteKey};
use kvroute_core::tokens::{ROUTING_TOKENS_HEADER, ShardTokenizers};
use kvroute_core::workers::{LoadGuard, ModelStanding, Worker};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What one shard hands to each exchange: the shared state, its upstream pool and its
/// tokenizers.
#[derive(Clone)]
pub struct ShardCtx {
    /// State shared by all shards.
    pub shared: Arc<Shared>,
    /// This shard's idle worker connections.
    pub pool: Rc<Pool>,
    /// This shard's tokenizers and prefix cache.
    pub tokens: Rc<RefCell<ShardTokenizers>>,
}

/// Header naming the chosen worker's id in every proxied response.
pub const WORKER_HEADER: &str = "x-kvroute-worker";
/// Header naming the chosen worker's URL, with `--expose-worker-url` only.
pub const WORKER_URL_HEADER: &str = "x-kvroute-worker-url";
pub use crate::message::REQUEST_ID_HEADER;

/// The routes kvroute answers or proxies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Health,
    Readiness,
    Metrics,
    Models,
    Model,
    Infer(Endpoint),
    NotFound,
}

impl Route {
    fn of(path: &str) -> Route {
        match path {
            "/health" | "/liveness" => Route::Health,
            "/readiness" => Route::Readiness,
            "/metrics" => Route::Metrics,
            "/v1/models" => Route::Models,
            "/v1/chat/completions" => Route::Infer(Endpoint::ChatCompletions),
            "/v1/completions" => Route::Infer(Endpoint::Completions),
            "/generate" => Route::Infer(Endpoint::Generate),
            p if p.starts_with("/v1/models/") && p.len() > "/v1/models/".len() => Route::Model,
            _ => Route::NotFound,
        }
    }

    /// The method the route answers.
    fn method(self) -> &'static str {
        match self {
            Route::Infer(_) => "POST",
            _ => "GET",
        }
    }

    /// The metric label (a fixed set: never the raw path).
    fn label(self) -> &'static str {
        match self {
            Route::Health => "/health",
            Route::Readiness => "/readiness",
            Route::Metrics => "/metrics",
            Route::Models => "/v1/models",
            Route::Model => "/v1/models/{id}",
            Route::Infer(Endpoint::ChatCompletions) => "/v1/chat/completions",
            Route::Infer(Endpoint::Completions) => "/v1/completions",
            Route::Infer(Endpoint::Generate) => "/generate",
            Route::NotFound => "other",
        }
    }

    /// Routes that need a client API key when keys are configured (the OpenAI API; probes
    /// and metrics stay open for the orchestrator).
    fn needs_key(self) -> bool {
        matches!(self, Route::Models | Route::Model | Route::Infer(_))
    }
}

/// Counts one request that could not be read (it never reaches [`handle`]): its metrics and
/// access-log line, as for every other request. `req`: its head when that was read (a body
/// refused: 413, 408), for the line's method, path and request id; returns the request id
/// (the client's or a new one) for the answer's `x-request-id`, `None` without a head.
pub fn reject(
    ctx: &ShardCtx,
    err: &ApiError,
    kind: &'static str,
    received: Instant,
    req: Option<&Request>,
) -> Option<String> {
    ctx.shared.metrics.on_bad_request(kind);
    let id = req.map(|r| request_id(&ctx.shared, r));
    let (method, path, route) = req.map_or(("", "", "other"), |r| {
        (r.method.as_str(), r.path(), Route::of(r.path()).label())
    });
    let mut rec = Record::new(
        &ctx.shared,
        method,
        path,
        route,
        received,
        id.as_deref().unwrap_or(""),
    );
    rec.status = err.status;
    rec.error = Some(kind);
    drop(rec);
    id
}

/// True when routing the body of a `method` request to `target` scans it for cached chat
/// prefixes ([`kvroute_core::tokens::ShardTokenizers::scans`]): a transport that reads the
/// body in several pieces then feeds a [`PrefixScanner`] as it arrives and puts it in
/// [`Request::prefix_scan`], so the decision, once the last bytes are in, scans and hashes
/// only those (the whole-body hash pass is the largest step of a long conversation's turn,
/// perf/runs/2026-12-06-decision-anatomy).
pub fn scans_body(ctx: &ShardCtx, method: &str, target: &str) -> bool {
    let Route::Infer(endpoint) = Route::of(crate::message::path_of(target)) else {
        return false;
    };
    method == "POST" && ctx.tokens.borrow().scans(endpoint)
}

/// Answers one request through `sink`. Every outcome is counted and logged once, by the
/// request's [`Record`].
pub async fn handle(ctx: &ShardCtx, mut req: Request, sink: &mut impl ResponseSink) {
    let shared = &ctx.shared;
    shared.in_flight.fetch_add(1, Ordering::SeqCst);
    let _in_flight = InFlight(shared);
    if shared.is_shutting_down() {
        sink.close_after();
    }
    let route = Route::of(req.path());
    let scan = req.prefix_scan.take();
    let request_id = request_id(shared, &req);
    let mut rec = Record::new(
        shared,
        &req.method,
        req.path(),
        route.label(),
        req.received,
        &request_id,
    );
    let extra = [(REQUEST_ID_HEADER, request_id.as_bytes())];
    if route == Route::NotFound {
        let msg = format!("no route for {} {}", req.method, req.path());
        return answer_error(sink, &mut rec, &ApiError::new(404, msg), &extra).await;
    }
    if req.method != route.method() {
        let err = ApiError::new(405, format!("{} takes {}", route.label(), route.method()));
        // RFC 9110 §15.5.6: a 405 names the methods the resource takes.
        let extra = [extra[0], ("allow", route.method().as_bytes())];
        return answer_error(sink, &mut rec, &err, &extra).await;
    }
    if route.needs_key() && !authorized(shared, &req) {
        let err = ApiError::new(
            401,
            "invalid or missing API key (Authorization: Bearer KEY)",
        );
        rec.error = Some("unauthorized");
        // RFC 6750 §3: the scheme the client must use.
        let extra = [extra[0], ("www-authenticate", b"Bearer".as_slice())];
        return answer_error(sink, &mut rec, &err, &extra).await;
    }
    match route {
        Route::Health => {
            rec.status = 200;
            respond(
                sink,
                200,
                "application/json",
                &extra,
                crate::admin::HEALTH_BODY.to_vec(),
            )
            .await;
        }
        Route::Readiness => {
            let (status, body) = shared.readiness();
            rec.status = status;
            respond(sink, status, "application/json", &extra, body).await;
        }
        Route::Metrics => {
            let format = Format::negotiate(req.header("accept"));
            let text = crate::admin::metrics_text(shared, format);
            rec.status = 200;
            respond(sink, 200, format.content_type(), &extra, text.into_bytes()).await;
        }
        Route::Models => {
            rec.status = 200;
            let body = models_json(shared, None).unwrap_or_default();
            respond(sink, 200, "application/json", &extra, body).await;
        }
        Route::Model => {
            let id = &req.path()["/v1/models/".len()..];
            match models_json(shared, Some(id)) {
                Some(body) => {
                    rec.status = 200;
                    respond(sink, 200, "application/json", &extra, body).await;
                }
                None => {
                    let err = ApiError::new(404, format!("The model `{id}` does not exist."));
                    answer_error(sink, &mut rec, &err, &extra).await;
                }
            }
        }
        Route::Infer(endpoint) => proxy(ctx, &req, scan, endpoint, sink, &mut rec, &extra).await,
        Route::NotFound => unreachable!("answered above"),
    }
}

/// Decrements [`Shared::in_flight`] when the exchange ends, however it ends.
struct InFlight<'a>(&'a Shared);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn answer_error(
    sink: &mut impl ResponseSink,
    rec: &mut Record<'_>,
    err: &ApiError,
    extra: &[HeaderLine<'_>],
) {
    rec.status = err.status;
    respond_error(sink, err, extra).await;
}

/// The client's `x-request-id` when it is a printable token of at most 128 bytes, else a new
/// one: 32 hex digits from the request sequence number and a random draw.
fn request_id(shared: &Shared, req: &Request) -> String {
    if let Some(v) = req.header(REQUEST_ID_HEADER)
        && !v.is_empty()
        && v.len() <= 128
        && v.iter().all(|b| b.is_ascii_graphic())
    {
        return String::from_utf8_lossy(v).into_owned();
    }
    let seq = shared.seq.load(Ordering::Relaxed);
    // As `format!("{:016x}{:016x}", random, seq)`, without the formatting machinery (~1.9k
    // instructions of a ~68k request: callgrind, perf/runs/2026-12-01-proxy).
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = String::with_capacity(32);
    for n in [rand::random::<u64>(), seq] {
        for shift in (0..16).rev() {
            id.push(HEX[((n >> (shift * 4)) & 0xf) as usize] as char);
        }
    }
    id
}

/// True when no client keys are configured, or `Authorization: Bearer KEY` names one
/// (compared in constant time).
fn authorized(shared: &Shared, req: &Request) -> bool {
    if shared.api_keys.is_empty() {
        return true;
    }
    let Some(key) = req
        .header("authorization")
        .and_then(crate::admin::bearer_token)
    else {
        return false;
    };
    shared
        .api_keys
        .iter()
        .fold(false, |ok, k| ok | crate::admin::constant_time_eq(k, key))
}

/// `/v1/models` (the union of the models of healthy workers, OpenAI's list shape) or, with
/// `id`, that model's object (`None` when no healthy worker serves it).
fn models_json(shared: &Shared, id: Option<&str>) -> Option<Vec<u8>> {
    let mut models: Vec<String> = shared
        .workers
        .iter()
        .iter()
        .filter(|w| w.is_healthy() && !w.is_draining())
        .flat_map(|w| w.models())
        .collect();
    models.sort();
    models.dedup();
    let card = |m: &str| serde_json::json!({"id": m, "object": "model", "created": shared.started_unix_secs, "owned_by": "kvroute"});
    let v = match id {
        Some(id) => card(models.iter().find(|m| *m == id)?),
        None => serde_json::json!({
            "object": "list",
            "data": models.iter().map(|m| card(m)).collect::<Vec<_>>(),
        }),
    };
    serde_json::to_vec(&v).ok()
}

/// The "parse" and "tokenize" steps (style.md) in one: the routing key of the body, and its
/// token ids from the body, the `x-kvroute-routing-tokens` header, or this shard's tokenizer
/// (see `kvroute_core::tokens`). A request `proxy` is about to refuse (no model, unknown
/// model) is not tokenized. Tokenizing never fails the request: an ignored header or a
/// prompt the template cannot render is counted and routing stays in text mode. Also
/// returns the request's chat-prefix entries, for [`proxy`] to apply once the request has
/// left ([`ChatInsert`]).
///
/// # Errors
/// The body's, as `route_key` reports them (a 400).
fn parse_and_tokenize(
    ctx: &ShardCtx,
    endpoint: Endpoint,
    req: &Request,
    scan: Option<Box<PrefixScanner>>,
) -> Result<(RouteKey, Option<ChatInsert>), kvroute_core::CoreError> {
    let shared = &ctx.shared;
    let header = req.header(ROUTING_TOKENS_HEADER);
    let accepted = |model: &str| {
        (!model.is_empty() || endpoint == Endpoint::Generate) && shared.workers.knows_model(model)
    };
    let (key, attached) = ctx.tokens.borrow_mut().route_scanned(
        endpoint,
        &req.body,
        header,
        &accepted,
        scan.map(|s| *s),
    )?;
    if !accepted(&key.model) {
        return Ok((key, None));
    }
    if let Some(why) = attached.header_rejected {
        shared.metrics.on_routing_tokens_rejected(why.as_str());
    }
    if let Some(e) = &attached.prompt_error {
        tracing::debug!(model = %key.model, error = %e, "prompt not tokenized; text mode");
    }
    if key.text.is_empty() && key.input_ids.as_ref().is_none_or(|ids| ids.is_empty()) {
        shared.metrics.on_keyless(Route::Infer(endpoint).label());
    }
    shared.metrics.on_token_source(
        key.token_source.as_str(),
        attached.reused_tokens,
        key.input_ids.as_ref().map_or(0, |ids| ids.len()),
    );
    if let Some(tap) = shared.key_tap.get()
        && let Ok(mut keys) = tap.lock()
    {
        keys.push(key.clone());
    }
    Ok((key, attached.chat_insert))
}

/// A request committed to a worker: its first response bytes have arrived.
struct Committed {
    worker: Arc<Worker>,
    decision: Decision,
    /// Counts the request on `worker` until dropped.
    guard: LoadGuard,
    conn: Conn,
    head: ResponseHead,
}

/// Why [`attempts`] returned without a committed worker.
enum Stop {
    /// The client left; nothing more to send.
    ClientGone,
    /// The shutdown grace passed before a worker answered ([`Shared::cutting`]): 503.
    Cut,
    /// No eligible worker is left: `None` when there never was one (503), else the last
    /// attempt's failure once retries were spent (502 / 504).
    NoWorker(Option<ProxyError>),
}

/// What [`attempts`] sends: the client's request with `body` (its own, or a migration's
/// continuation), routed on `key` with sequence number `seq`.
#[derive(Clone, Copy)]
struct Job<'a> {
    req: &'a Request,
    body: &'a [u8],
    key: &'a RouteKey,
    seq: u64,
}

/// Headers naming a request's session for `consistent_hash`, first present wins.
const SESSION_HEADERS: [&str; 2] = ["x-kvroute-routing-key", "x-session-id"];

/// The request's session key ([`SESSION_HEADERS`]), if a header carries a non-empty UTF-8
/// value.
fn session_key(headers: &Headers) -> Option<String> {
    SESSION_HEADERS.iter().find_map(|h| {
        headers
            .get(h)
            .and_then(|v| std::str::from_utf8(v).ok())
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    })
}

/// Attempts `body` (the request's, or a migration's continuation) on eligible workers not in
/// `tried` until one answers with its first bytes, retrying failures elsewhere while
/// [`may_retry`] allows. A worker's own 502/503/504 is returned as its answer once no retry is
/// left. Each failed worker is added to `tried`; nothing is recorded in the indexes for it.
async fn attempts(
    ctx: &ShardCtx,
    job: &Job<'_>,
    tried: &mut Vec<usize>,
    rec: &mut Record<'_>,
    sink: &impl ResponseSink,
) -> Result<Committed, Stop> {
    let Job {
        req,
        body,
        key,
        seq,
    } = *job;
    let shared = &ctx.shared;
    let settings = &shared.settings;
    let mut rng = rand::rng();
    // The last failed attempt's error: the answer when no eligible worker is left to try.
    let mut last: Option<ProxyError> = None;
    // The request's routing facts (block keys, lengths), once for every attempt.
    let facts = shared.router.request(key);
    loop {
        let now = shared.now_ms();
        let Some((view, decision)) =
            shared
                .router
                .decide_on(&shared.workers, tried, seq, now, &facts, &mut rng)
        else {
            return Err(Stop::NoWorker(last));
        };
        let snap = view.snapshot(seq, now);
        shared
            .metrics
            .on_decision(shared.policy_name, decision.reason.as_str());
        tracing::debug!(
            target: "kvroute::decision",
            policy = shared.policy_name,
            worker = decision.worker,
            reason = ?decision.reason,
            eligible = ?view.eligible,
            "routed"
        );
        let Some(worker) = view.worker(decision.worker).cloned() else {
            return Err(Stop::NoWorker(last));
        };
        // The rank of a DP engine that holds the prompt (B28), asked once the worker is
        // chosen.
        let dp_rank = shared.router.dp_rank(&snap, &facts, worker.id);
        if let Some(rank) = dp_rank {
            tracing::debug!(target: "kvroute::decision", worker = worker.id, rank, "DP rank pinned");
        }
        // A retry needs somewhere to go: with no other eligible worker, this attempt's answer
        // (or error) is the request's.
        let others = view.eligible.iter().any(|&w| w != worker.id);
        // Counted before the request leaves (B1); released exactly once when the guard
        // drops: at the end of the relay, on a failed attempt, or when the client leaves.
        let booking = shared.router.booking_request(&snap, &facts, &decision);
        let wire = kvroute_core::sync::WireBooking::from(&booking);
        let mut guard = worker.acquire_booked(booking, now as f64);
        // The peer replicas count it from now too; its first token and end follow from the
        // guard.
        if let Some(link) = &shared.sync {
            guard.observe(link.dispatched(&key.model, &worker.url, wire));
        }
        rec.upstream_sent.get_or_insert_with(Instant::now);
        rec.worker = Some(worker.id);
        // With client keys configured, the client's key is kvroute's: it never goes upstream.
        let strip_auth = !shared.api_keys.is_empty();
        let request =
            upstream::build_request(req, body, &worker, rec.request_id, strip_auth, dp_rank);
        let send = upstream::send(
            &ctx.pool,
            &worker,
            &req.method,
            request,
            settings.max_head_bytes,
        );
        let deadline = Instant::now() + settings.first_byte_timeout;
        let sent = monoio::select! {
            sent = send => sent,
            why = interrupt(sink, &worker, &shared.cutting, deadline) => match why {
                // The client left while the worker prefilled: dropping `send` closes the
                // worker connection, and the engine aborts the request (B41).
                // Not the worker's error: the request's status 0 counts it.
                Interrupt::ClientGone => return Err(Stop::ClientGone),
                // Health checks took the worker out while it held this attempt (a stopped
                // engine): the attempt fails now, not at the first-byte timeout.
                Interrupt::Unhealthy => Err(ProxyError::Upstream {
                    worker: worker.id,
                    message: "went unhealthy before its first byte".into(),
                }),
                Interrupt::TimedOut => Err(ProxyError::Timeout {
                    worker: worker.id,
                    secs: settings.first_byte_timeout.as_secs(),
                }),
                // The shutdown grace passed: the router's end, not the worker's failure.
                Interrupt::Cut => return Err(Stop::Cut),
            },
        };
        let now = shared.now_ms();
        match sent {
            Ok((conn, head)) => {
                let retryable = is_retryable_status(head.status);
                if retryable {
                    worker.record_outcome(Outcome::Failure, now);
                } else {
                    worker.record_outcome(Outcome::of_status(head.status), now);
                }
                if head.status >= 500 {
                    shared.metrics.on_worker_error(worker.id, "status_5xx");
                }
                // Not retryable, or no retry left: the worker's own answer goes to the client.
                if !retryable || !others || !may_retry(shared, rec, tried, "status_5xx", worker.id)
                {
                    // Committed: the peer replicas record its placement (a prompt the
                    // worker refused was not prefilled, as for Router::record).
                    if let Some(link) = &shared.sync
                        && is_success(head.status)
                    {
                        link.committed(&shared.router, key, &worker.url);
                    }
                    return Ok(Committed {
                        worker,
                        decision,
                        guard,
                        conn,
                        head,
                    });
                }
                tracing::warn!(worker = worker.id, status = head.status, request_id = %rec.request_id, "attempt failed");
            }
            Err(err) => {
                worker.record_outcome(Outcome::Failure, now);
                shared.metrics.on_worker_error(worker.id, err.kind());
                tracing::warn!(worker = worker.id, error = %err, request_id = %rec.request_id, "attempt failed");
                if !others || !may_retry(shared, rec, tried, err.kind(), worker.id) {
                    return Err(Stop::NoWorker(Some(err)));
                }
                last = Some(err);
            }
        }
        // A failed attempt leaves nothing behind: its guard is released, nothing recorded.
        drop(guard);
        tried.push(worker.id);
        rec.retries += 1;
        let wait = settings.backoff.delay_ms(rec.retries, &mut rng);
        monoio::select! {
            _ = monoio::time::sleep(Duration::from_millis(wait)) => {}
            _ = sink.client_gone() => return Err(Stop::ClientGone),
        }
    }
}

/// Routes, forwards and relays one inference request.
async fn proxy(
    ctx: &ShardCtx,
    req: &Request,
    scan: Option<Box<PrefixScanner>>,
    endpoint: Endpoint,
    sink: &mut impl ResponseSink,
    rec: &mut Record<'_>,
    extra: &[HeaderLine<'_>],
) {
    let shared = &ctx.shared;
    let (mut key, chat_insert) = match parse_and_tokenize(ctx, endpoint, req, scan) {
        Ok(parsed) => parsed,
        Err(e) => {
            shared.metrics.on_bad_request(e.kind());
            rec.error = Some("bad_request");
            return answer_error(sink, rec, &ApiError::new(400, e.to_string()), extra).await;
        }
    };
    rec.model = key.model.clone();
    // OpenAI's endpoints name a model; SGLang's `/generate` has none (any worker serves it).
    if key.model.is_empty() && endpoint != Endpoint::Generate {
        shared.metrics.on_bad_request("missing_field");
        rec.error = Some("bad_request");
        let err = ApiError::new(400, "you must provide a model parameter");
        return answer_error(sink, rec, &err, extra).await;
    }
    let standing = shared.workers.standing(&key.model);
    rec.model_listed = standing == ModelStanding::Listed;
    if standing == ModelStanding::Unserved {
        rec.error = Some("unknown_model");
        let err = ApiError::new(404, format!("The model `{}` does not exist.", key.model));
        return answer_error(sink, rec, &err, extra).await;
    }
    key.session = session_key(&req.headers);
    let seq = shared.seq.fetch_add(1, Ordering::Relaxed);
    shared.retry_budget.deposit();
    let settings = &shared.settings;
    let mut tried: Vec<usize> = Vec::new();
    let job = Job {
        req,
        body: &req.body,
        key: &key,
        seq,
    };
    let attempted = attempts(ctx, &job, &mut tried, rec, sink).await;
    // The request has left (or will not): its chat-prefix entries serve its next turn, which
    // comes after this answer, so they were kept off the path it waited on.
    if let Some(insert) = chat_insert {
        insert.apply();
    }
    let c = match attempted {
        Ok(c) => c,
        Err(Stop::ClientGone) => {
            rec.error = Some("client_gone");
            return;
        }
        Err(Stop::Cut) => {
            shared.cut.fetch_add(1, Ordering::SeqCst);
            rec.error = Some("shutdown_cut");
            let err = ApiError::new(503, "the router shut down before a worker answered");
            return answer_error(sink, rec, &err, extra).await;
        }
        Err(Stop::NoWorker(why)) => {
            let err = match why {
                None => {
                    rec.error = Some("no_eligible_worker");
                    ApiError::new(
                        503,
                        format!("no healthy worker serves model `{}`", key.model),
                    )
                }
                Some(e) => {
                    rec.error = Some(e.kind());
                    ApiError::new(e.status(), e.to_string())
                }
            };
            return answer_error(sink, rec, &err, extra).await;
        }
    };
    // Committed: the policy records its decision, the response streams through. A prompt
    // the worker refused (a 4xx: its own 404 for a model, a bad parameter) was never
    // prefilled, so the indexes do not record it: a worker taking any model name would
    // otherwise grow one set of indexes per name a client invents.
    if is_success(c.head.status) {
        shared.router.record(&key, &c.decision, shared.now_ms());
    }
    rec.commit(&c.worker, c.decision.reason);
    rec.status = c.head.status;
    // Migration tracks the text of successful SSE streams of chat and completions.
    let migrates = settings.migration_limit > 0
        && key.stream
        && c.head.status == 200
        && relay::is_sse(&c.head)
        && endpoint != Endpoint::Generate;
    let mut tracker = migrates.then(|| {
        let prompt_tokens = key.input_ids.as_ref().map(|ids| ids.len() as u64);
        StreamTracker::new(endpoint == Endpoint::ChatCompletions, prompt_tokens)
    });
    let limits = relay::Limits {
        deadline: req.received + settings.request_timeout,
        idle: settings.stream_idle_timeout,
        cutting: &shared.cutting,
    };
    let Committed {
        mut worker,
        decision,
        mut guard,
        mut conn,
        head,
    } = c;
    let worker_id = worker.id.to_string();
    let mut headers = upstream::response_headers(&head, extra.len() + 2);
    headers.extend_from_slice(extra);
    headers.push((WORKER_HEADER, worker_id.as_bytes()));
    if settings.expose_worker_url {
        headers.push((WORKER_URL_HEADER, worker.url.as_bytes()));
    }
    let mut end = relay::relay(
        sink,
        &mut conn,
        &head,
        &headers,
        limits,
        rec,
        tracker.as_mut(),
        Some(&guard),
    )
    .await;
    loop {
        match end {
            RelayEnd::Complete { reusable, usage } => {
                if let Some(u) = usage
                    && rec.migrations == 0
                {
                    guard.served(u.prompt_tokens, u.cached_tokens);
                    rec.served_cached = Some(u.cached_tokens);
                    rec.predicted_cached = decision.reason.predicted_cached_tokens(u.prompt_tokens);
                }
                if reusable {
                    ctx.pool.put(worker.id, conn);
                }
                return;
            }
            RelayEnd::ClientGone => {
                rec.error = Some("client_gone");
                return;
            }
            RelayEnd::Cut { sse } => {
                tracing::warn!(worker = worker.id, request_id = %rec.request_id, "cut by the shutdown mid-stream");
                shared.cut.fetch_add(1, Ordering::SeqCst);
                rec.error = Some("shutdown_cut");
                drop(guard);
                end_mid_stream(sink, sse, 503, "the router shut down mid-stream").await;
                return;
            }
            RelayEnd::TimedOut { sse } => {
                tracing::warn!(worker = worker.id, request_id = %rec.request_id, secs = settings.request_timeout.as_secs(), "request timeout mid-stream");
                rec.error = Some("request_timeout");
                drop(guard);
                let msg = format!(
                    "request exceeded --request-timeout-secs ({} s)",
                    settings.request_timeout.as_secs()
                );
                end_mid_stream(sink, sse, 504, &msg).await;
                return;
            }
            RelayEnd::UpstreamFailed { sse, stalled } => {
                let (kind, what) = if stalled {
                    (
                        "stream_idle_timeout",
                        format!(
                            "worker {} sent nothing for {} s mid-stream",
                            worker.id,
                            settings.stream_idle_timeout.as_secs()
                        ),
                    )
                } else {
                    (
                        "upstream_body",
                        format!("worker {} failed mid-stream", worker.id),
                    )
                };
                worker.record_outcome(Outcome::Failure, shared.now_ms());
                shared.metrics.on_worker_error(worker.id, kind);
                tracing::warn!(worker = worker.id, request_id = %rec.request_id, migrations = rec.migrations, error = kind, "worker failed mid-stream");
                tried.push(worker.id);
                let continuation = tracker
                    .as_ref()
                    .filter(|t| rec.migrations < settings.migration_limit && !t.finished())
                    .and_then(|t| t.continuation(&req.body));
                if let (Some(body), Some(t)) = (continuation, tracker.as_mut()) {
                    rec.migrations += 1;
                    let job = Job { body: &body, ..job };
                    match attempts(ctx, &job, &mut tried, rec, sink).await {
                        Ok(next) if next.head.status == 200 => {
                            shared.metrics.on_migration(worker.id, "resumed");
                            t.next_segment();
                            (worker, guard, conn) = (next.worker, next.guard, next.conn);
                            end = relay::relay_body(
                                sink,
                                &mut conn,
                                &next.head,
                                limits,
                                rec,
                                Some(t),
                                Some(&guard),
                            )
                            .await;
                            continue;
                        }
                        Err(Stop::ClientGone) => {
                            rec.error = Some("client_gone");
                            return;
                        }
                        _ => shared.metrics.on_migration(worker.id, "failed"),
                    }
                }
                drop(guard);
                rec.error = Some(kind);
                end_mid_stream(sink, sse, 502, &what).await;
                return;
            }
        }
    }
}

/// Ends a response cut mid-body: the connection closes after it, and an SSE stream (`sse`)
/// first gets a clean end, an OpenAI-style error event with `status` and `message`, then
/// `[DONE]` ([`relay::sse_error_event`]).
async fn end_mid_stream(sink: &mut impl ResponseSink, sse: bool, status: u16, message: &str) {
    sink.close_after();
    if sse {
        let (res, _) = sink
            .send_data(relay::sse_error_event(status, message))
            .await;
        if res.is_ok() {
            let _ = sink.finish().await;
        }
    }
}

/// A 2xx status: the worker took the request.
fn is_success(status: u16) -> bool {
    (200..300).contains(&status)
}

/// How often an attempt waiting for its first byte looks at its worker's health, ms.
const HEALTH_WATCH_MS: u64 = 250;

/// What ended an attempt's wait for its worker's first byte, other than the answer.
enum Interrupt {
    /// The client went away.
    ClientGone,
    /// Health checks marked the worker unhealthy.
    Unhealthy,
    /// `--first-byte-timeout-secs` passed.
    TimedOut,
    /// The shutdown grace passed ([`Shared::cutting`]).
    Cut,
}

/// Resolves when the attempt waiting for its first byte must stop: at `deadline`, or, from
/// [`defaults::CLIENT_WATCH_DELAY_MS`] on, once the client has gone, `worker` turned
/// unhealthy or the shutdown grace passed (`cutting`). Until that delay this is one timer
/// and nothing else: most answers come before it, and a watch of the client costs two
/// io_uring operations. One timer where a timeout
/// per upstream read, a client watch and a health watch were three: 46.9k → 45.0k
/// instructions per proxied SSE request (callgrind, perf/runs/2026-12-03-lean-headers).
async fn interrupt(
    sink: &impl ResponseSink,
    worker: &Worker,
    cutting: &AtomicBool,
    deadline: Instant,
) -> Interrupt {
    let watch_from = Instant::now() + Duration::from_millis(defaults::CLIENT_WATCH_DELAY_MS);
    if deadline <= watch_from {
        monoio::time::sleep_until(deadline.into()).await;
        return Interrupt::TimedOut;
    }
    monoio::time::sleep_until(watch_from.into()).await;
    monoio::select! {
        _ = sink.client_gone() => Interrupt::ClientGone,
        why = out_of_play(worker, cutting) => why,
        _ = monoio::time::sleep_until(deadline.into()) => Interrupt::TimedOut,
    }
}

/// Resolves once `worker` is marked unhealthy or the shutdown grace passed (both polled every
/// [`HEALTH_WATCH_MS`]).
async fn out_of_play(worker: &Worker, cutting: &AtomicBool) -> Interrupt {
    loop {
        if cutting.load(Ordering::Relaxed) {
            return Interrupt::Cut;
        }
        if !worker.is_healthy() {
            return Interrupt::Unhealthy;
        }
        monoio::time::sleep(Duration::from_millis(HEALTH_WATCH_MS)).await;
    }
}

/// Whether a failed attempt (`kind`, on `worker`) may be retried: retries left, the
/// request's deadline not passed, the fleet's budget not spent. Counts the retry.
fn may_retry(
    shared: &Shared,
    rec: &Record<'_>,
    tried: &[usize],
    kind: &'static str,
    worker: usize,
) -> bool {
    let s = &shared.settings;
    let ok = (tried.len() as u32) < s.retry_max
        && rec.received.elapsed() < s.retry_deadline
        && !shared.is_shutting_down()
        && shared.retry_budget.try_withdraw();
    if ok {
        shared.metrics.on_retry(worker, kind);
    }
    ok
}
