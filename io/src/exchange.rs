//! One client connection, and each request on it, top to bottom (style.md "One request"):
//! parse → routing key → decide → load guard → forward → relay → record.
//!
//! The load guard is taken before the request is sent upstream and dropped when the exchange
//! ends, whatever the outcome, for every route and policy (bug-cases.md B1, B3, B4, B7).

use crate::conn::Conn;
use crate::error::{HttpError, ProxyError, error_body};
use crate::http1::{self, Framing, RequestHead};
use crate::relay::{self, RelayEnd};
use crate::shard::Shared;
use crate::upstream::{self, Pool};
use kvroute_core::route_key::{Endpoint, RouteKey, route_key};
use kvroute_core::tokens::{ROUTING_TOKENS_HEADER, ShardTokenizers};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long an idle client keep-alive connection waits for its next request.
pub const CLIENT_IDLE_TIMEOUT: Duration = Duration::from_secs(75);

/// Serves one client connection until it closes, errs, or asks to close.
pub async fn serve_connection(
    shared: Arc<Shared>,
    pool: Rc<Pool>,
    tokens: Rc<RefCell<ShardTokenizers>>,
    stream: monoio::net::TcpStream,
) {
    let mut client = Conn::new(stream);
    loop {
        let head = match read_head(&mut client, shared.settings.max_head_bytes).await {
            Ok(Some(head)) => head,
            Ok(None) => return,
            Err(e) => {
                shared
                    .metrics
                    .on_bad_request(ProxyError::from(e.clone()).kind());
                let _ = respond_error(&mut client, &ProxyError::from(e), None, false).await;
                return;
            }
        };
        let body = match read_body(&mut client, &head, shared.settings.max_body_bytes).await {
            Ok(body) => body,
            Err(BodyError::Closed) => return,
            Err(BodyError::Http(e)) => {
                shared
                    .metrics
                    .on_bad_request(ProxyError::from(e.clone()).kind());
                let _ = respond_error(&mut client, &ProxyError::from(e), None, false).await;
                return;
            }
        };
        let keep = dispatch(&shared, &pool, &tokens, &mut client, &head, body).await;
        if !keep {
            return;
        }
    }
}

/// Reads one request head. `Ok(None)`: the client closed (or idled out) between requests.
async fn read_head(client: &mut Conn, max_head: usize) -> Result<Option<RequestHead>, HttpError> {
    loop {
        if !client.buffered().is_empty()
            && let Some((head, len)) = http1::parse_request_head(client.buffered(), max_head)?
        {
            client.consume(len);
            return Ok(Some(head));
        }
        let had = client.buffered().len();
        match monoio::time::timeout(CLIENT_IDLE_TIMEOUT, client.fill()).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) if had == 0 => return Ok(None),
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => {
                return Err(HttpError::Malformed(
                    "connection closed inside the request head",
                ));
            }
            Ok(Ok(_)) => {}
        }
    }
}

enum BodyError {
    Closed,
    Http(HttpError),
}

impl From<HttpError> for BodyError {
    fn from(e: HttpError) -> Self {
        BodyError::Http(e)
    }
}

/// Reads the whole request body (the router must see it to route), de-chunking if needed.
async fn read_body(
    client: &mut Conn,
    head: &RequestHead,
    max_body: usize,
) -> Result<Vec<u8>, BodyError> {
    let too_large = HttpError::BodyTooLarge { limit: max_body };
    match head.framing {
        Framing::Empty | Framing::Length(0) => Ok(Vec::new()),
        Framing::Length(n) => {
            if n > max_body as u64 {
                return Err(too_large.into());
            }
            let n = n as usize;
            send_continue(client, head).await;
            while client.buffered().len() < n {
                if client.fill().await.map_err(|_| BodyError::Closed)? == 0 {
                    return Err(BodyError::Closed);
                }
            }
            let body = client.buffered()[..n].to_vec();
            client.consume(n);
            Ok(body)
        }
        Framing::Chunked => {
            send_continue(client, head).await;
            let mut dec = http1::ChunkedDecoder::new();
            let mut body = Vec::new();
            loop {
                let used = dec.feed(client.buffered(), Some(&mut body))?;
                client.consume(used);
                if body.len() > max_body {
                    return Err(too_large.into());
                }
                if dec.is_done() {
                    return Ok(body);
                }
                if client.fill().await.map_err(|_| BodyError::Closed)? == 0 {
                    return Err(BodyError::Closed);
                }
            }
        }
        Framing::UntilClose => Err(HttpError::Malformed("request without length").into()),
    }
}

async fn send_continue(client: &mut Conn, head: &RequestHead) {
    if head.expect_continue && client.buffered().is_empty() {
        let _ = client
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec())
            .await;
    }
}

/// The routes kvroute answers or proxies.
enum Route {
    Health,
    Metrics,
    Models,
    Infer(Endpoint),
    MethodNotAllowed,
    NotFound,
}

fn route_of(head: &RequestHead) -> Route {
    let endpoint = match head.path() {
        "/health" => {
            return if head.method == "GET" {
                Route::Health
            } else {
                Route::MethodNotAllowed
            };
        }
        "/metrics" => {
            return if head.method == "GET" {
                Route::Metrics
            } else {
                Route::MethodNotAllowed
            };
        }
        "/v1/models" => {
            return if head.method == "GET" {
                Route::Models
            } else {
                Route::MethodNotAllowed
            };
        }
        "/v1/chat/completions" => Endpoint::ChatCompletions,
        "/v1/completions" => Endpoint::Completions,
        "/generate" => Endpoint::Generate,
        _ => return Route::NotFound,
    };
    if head.method == "POST" {
        Route::Infer(endpoint)
    } else {
        Route::MethodNotAllowed
    }
}

/// The metric label of an inference route.
fn endpoint_path(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::ChatCompletions => "/v1/chat/completions",
        Endpoint::Completions => "/v1/completions",
        Endpoint::Generate => "/generate",
    }
}

/// Answers one request. Returns whether the client connection stays open.
async fn dispatch(
    shared: &Arc<Shared>,
    pool: &Pool,
    tokens: &RefCell<ShardTokenizers>,
    client: &mut Conn,
    head: &RequestHead,
    body: Vec<u8>,
) -> bool {
    let keep = head.keep_alive;
    if let Some((status, json)) = crate::admin::answer(shared, &head.method, head.path()) {
        return respond(client, status, "application/json", json, keep).await;
    }
    match route_of(head) {
        Route::Health => {
            respond(
                client,
                200,
                "application/json",
                br#"{"status":"ok"}"#.to_vec(),
                keep,
            )
            .await
        }
        Route::Metrics => {
            let mut text = shared.metrics.encode(&shared.workers);
            crate::admin::append_metrics(shared, &mut text);
            respond(
                client,
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                text.into_bytes(),
                keep,
            )
            .await
        }
        Route::Models => {
            proxy(
                shared,
                pool,
                client,
                head,
                body,
                "/v1/models",
                RouteKey::default(),
            )
            .await
        }
        Route::Infer(endpoint) => match route_key(endpoint, &body) {
            Ok(mut key) => {
                attach_tokens(shared, tokens, endpoint, head, &body, &mut key);
                proxy(
                    shared,
                    pool,
                    client,
                    head,
                    body,
                    endpoint_path(endpoint),
                    key,
                )
                .await
            }
            Err(e) => {
                shared.metrics.on_bad_request("bad_request");
                let err = ProxyError::BadRequest(e.to_string());
                shared
                    .metrics
                    .on_response(endpoint_path(endpoint), err.status(), "", 0.0);
                respond_error(client, &err, None, keep).await
            }
        },
        Route::MethodNotAllowed => {
            respond(
                client,
                405,
                "application/json",
                error_body(405, "method not allowed"),
                keep,
            )
            .await
        }
        Route::NotFound => {
            let msg = format!("no route for {} {}", head.method, head.path());
            respond(client, 404, "application/json", error_body(404, &msg), keep).await
        }
    }
}

/// The "tokenize" step (style.md): token ids from the body, the `x-kvroute-routing-tokens`
/// header, or this shard's tokenizer (see `kvroute_core::tokens`). Never fails the request:
/// an ignored header or a prompt the template cannot render is counted and routing stays in
/// text mode.
fn attach_tokens(
    shared: &Shared,
    tokens: &RefCell<ShardTokenizers>,
    endpoint: Endpoint,
    head: &RequestHead,
    body: &[u8],
    key: &mut RouteKey,
) {
    let header = head
        .headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(ROUTING_TOKENS_HEADER))
        .map(|(_, value)| value.as_slice());
    let attached = tokens.borrow_mut().attach(endpoint, body, header, key);
    if let Some(why) = attached.header_rejected {
        shared.metrics.on_routing_tokens_rejected(why.as_str());
    }
    if let Some(e) = &attached.prompt_error {
        tracing::debug!(model = %key.model, error = %e, "prompt not tokenized; text mode");
    }
    shared.metrics.on_token_source(
        key.token_source.as_str(),
        attached.reused_tokens,
        key.input_ids.as_ref().map_or(0, Vec::len),
    );
    if let Some(tap) = shared.key_tap.get()
        && let Ok(mut keys) = tap.lock()
    {
        keys.push(key.clone());
    }
}

/// Routes, forwards and relays one inference request.
async fn proxy(
    shared: &Arc<Shared>,
    pool: &Pool,
    client: &mut Conn,
    head: &RequestHead,
    body: Vec<u8>,
    route: &'static str,
    key: RouteKey,
) -> bool {
    let started = Instant::now();
    let loads = shared.workers.loads();
    // The clock is read here, not inside the policy (a policy is a pure function of its inputs).
    let decision = shared
        .router
        .decide_at(&key, &loads, shared.router.now_ms());
    shared
        .metrics
        .on_decision(shared.policy_name, decision.reason.as_str());
    tracing::debug!(
        target: "kvroute::decision",
        policy = shared.policy_name,
        worker = decision.worker,
        reason = ?decision.reason,
        prompt_bytes = key.text.len(),
        prompt_tokens = key.input_ids.as_ref().map_or(0, |v| v.len()),
        ?loads,
        "routed"
    );
    // Counted before the request leaves (B1); released exactly once when `guard` drops: at the
    // end of the relay, on an upstream error, or when the client leaves (any early return).
    let guard = shared.workers.acquire(decision.worker);
    let target = &shared.targets[decision.worker];
    let request = upstream::build_request(head, &body, target);
    drop(body);
    let timeout = shared.settings.request_timeout;
    let deadline = started + timeout;
    let send = upstream::send(
        pool,
        target,
        &head.method,
        request,
        deadline,
        timeout.as_secs(),
        shared.settings.max_head_bytes,
    );
    // A client that leaves while the worker prefills cancels the request: dropping `send`
    // closes the worker connection, and the engine aborts (B41).
    let sent = monoio::select! {
        sent = send => sent,
        _ = crate::conn::peer_gone(&client.stream) => {
            shared.metrics.on_upstream_error(&target.url, "client_gone");
            return false;
        }
    };
    let (mut upstream_conn, response) = match sent {
        Ok(ok) => ok,
        Err(err) => {
            // The worker is done with this request before the client hears of it.
            drop(guard);
            tracing::warn!(worker = %target.url, error = %err, "upstream failed");
            shared.metrics.on_upstream_error(&target.url, err.kind());
            shared.metrics.on_response(
                route,
                err.status(),
                &target.url,
                started.elapsed().as_secs_f64(),
            );
            return respond_error(client, &err, Some(&target.url), head.keep_alive).await;
        }
    };
    let end = relay::relay(
        client,
        &mut upstream_conn,
        &response,
        &target.url,
        head.keep_alive,
        deadline,
    )
    .await;
    drop(guard);
    shared.metrics.on_response(
        route,
        response.status,
        &target.url,
        started.elapsed().as_secs_f64(),
    );
    match end {
        RelayEnd::Complete { reusable, usage } => {
            if let Some(u) = usage
                && let Some(predicted) = decision.reason.predicted_cached_tokens(u.prompt_tokens)
            {
                shared
                    .metrics
                    .on_hit_outcome(&target.url, predicted, u.cached_tokens);
            }
            if reusable {
                pool.put(target.id, upstream_conn);
            }
            head.keep_alive
        }
        RelayEnd::ClientGone => {
            shared.metrics.on_upstream_error(&target.url, "client_gone");
            false
        }
        RelayEnd::UpstreamFailed => {
            shared
                .metrics
                .on_upstream_error(&target.url, "upstream_body");
            false
        }
    }
}

/// Writes a complete response with a `Content-Length` body. Returns `keep` if the write
/// succeeded.
async fn respond(
    client: &mut Conn,
    status: u16,
    content_type: &str,
    body: Vec<u8>,
    keep: bool,
) -> bool {
    respond_with(client, status, content_type, body, keep, None).await
}

async fn respond_error(
    client: &mut Conn,
    err: &ProxyError,
    worker: Option<&str>,
    keep: bool,
) -> bool {
    let status = err.status();
    // After a request-level protocol error the byte stream cannot be trusted: close.
    let keep = keep && !matches!(err, ProxyError::Http(_));
    respond_with(
        client,
        status,
        "application/json",
        error_body(status, &err.to_string()),
        keep,
        worker,
    )
    .await
}

async fn respond_with(
    client: &mut Conn,
    status: u16,
    content_type: &str,
    body: Vec<u8>,
    keep: bool,
    worker: Option<&str>,
) -> bool {
    let mut out = Vec::with_capacity(256 + body.len());
    let headers = [("content-type".to_string(), content_type.as_bytes().to_vec())];
    let mut extra: Vec<(&str, &[u8])> = Vec::new();
    if let Some(w) = worker {
        extra.push(("x-kvroute-worker", w.as_bytes()));
    }
    if !keep {
        extra.push(("connection", b"close"));
    }
    http1::write_response_head(
        &mut out,
        status,
        "",
        &headers,
        Framing::Length(body.len() as u64),
        &extra,
    );
    out.extend_from_slice(&body);
    let (res, _) = client.write_all(out).await;
    res.is_ok() && keep
}
