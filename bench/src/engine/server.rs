//! HTTP front end of the simulated engine (`engine-model.md` §6–§7): tokio + hyper 1 (HTTP/1.1).
//!
//! One **driver** task owns the [`EngineCore`] and steps it in wall-clock mode: after each step
//! it sleeps the modelled step time (accumulated, slept once ≥ [`defaults::MIN_SLEEP_MS`] so
//! sub-millisecond steps batch), then delivers tokens to per-request tokio channels.
//! Connection tasks parse requests, tokenize, send commands to the driver and stream replies.
//! A request whose client goes away is aborted in the engine: dropping the response body (or
//! the handler future) sends an abort, and a failed token send aborts too.
//!
//! | endpoint | reply |
//! |---|---|
//! | `POST /v1/chat/completions` | OpenAI chat; `messages` rendered with the tokenizer's chat template (generation prompt on) |
//! | `POST /v1/completions` | OpenAI completions; `prompt` is a string or a list of token ids |
//! | `POST /generate` | SGLang native; `text` or `input_ids`, `sampling_params.max_new_tokens`, `meta_info.cached_tokens` |
//! | `GET /v1/models`, `GET /health` | discovery, liveness |
//! | `GET /metrics` | vLLM Prometheus gauges and counters, labels `model_name`, `engine` |
//! | `POST /reset_prefix_cache` | drops cached blocks (409 while requests hold blocks) |
//! | `GET /debug/cached_blocks` | JSON array of the engine hashes of every cached block (test oracle) |
//! | `GET /_kvroute/fault`, `POST /_kvroute/fault` | read / replace the [`EngineFaults`] (JSON, same field names); answers the state now in force |
//! | `GET /_kvroute/stats` | [`RequestStats`] as JSON: generation requests received, completed, aborted, failed, recent `x-request-id`s |
//!
//! `/_kvroute/*` is never subject to faults (a stalled engine can be released).
//!
//! With [`EngineConfig::kv_events`] set, every step that changed the cache is published by an
//! [`events::Publisher`] thread in vLLM's wire format.
//!
//! Output text is the filler words of [`tokens::OUTPUT_VOCAB`] (Qwen3 ids), a pure function of
//! the engine seed and the request, never of arrival order or timing
//! ([`tokens::OutputStream`]): completions and `/generate` key it on the prompt ids
//! ([`tokens::prompt_stream`]), chats on their `messages`, `tools` and `chat_template_kwargs`
//! ([`tokens::keyed_stream`]), both salted with the request's `seed` field. A request re-sent
//! with the K tokens it had produced appended (completions: to the prompt; `/generate`: to
//! `input_ids`; chat: as a final assistant message with `continue_final_message: true,
//! add_generation_prompt: false`, vLLM's parameters) continues at position K, so the texts
//! of a cut run and its continuation, concatenated, equal an unbroken run's on any engine with
//! the same seed. The words re-tokenize to the same ids, so appended text round-trips.
//!
//! A chat continuation is rendered as Hugging Face's `apply_chat_template(...,
//! continue_final_message=True)` does (the tokenizer's renderer has no such switch): the body
//! is rendered as is, then cut right after the last occurrence of the final message's content
//! (or, failing that, of its trimmed content), dropping the template's end-of-turn suffix
//! (`<|im_end|>\n` for Qwen3).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use kvroute_tokenize::incremental::DEFAULT_CACHE_TOKENS;
use kvroute_tokenize::{IncrementalTokenizer, Tokenizer};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};

use super::events::{self, PublishMsg, Publisher};
use super::model::tokens::{self, OutputStream};
use super::model::{EngineCore, EngineError, EngineStats, TokenOut};
use super::{EngineConfig, EngineFaults, defaults};

/// Largest accepted request body, in bytes (a 128 Ki-token prompt is well under 4 MiB).
const MAX_BODY_BYTES: usize = 64 << 20;

/// Value of the `engine` metric label (data-parallel rank; one rank per server).
const ENGINE_LABEL: &str = "0";

/// Header whose values `GET /_kvroute/stats` lists.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Response body: a full buffer or an SSE stream; an error frame kills the connection.
type Body = UnsyncBoxBody<Bytes, Died>;

/// The `die_after_tokens` fault fired: returned by the service (no response head) or as a
/// body frame (no more bytes), it makes hyper drop the connection without an HTTP answer.
#[derive(Debug)]
struct Died;

impl std::fmt::Display for Died {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("injected fault: die_after_tokens")
    }
}

impl std::error::Error for Died {}

/// Counts of generation requests (`/v1/chat/completions`, `/v1/completions`, `/generate`),
/// served as JSON by `GET /_kvroute/stats` and by [`EngineHandle::request_stats`]. A request
/// is *received* once its body was read and no stall holds it; it then ends as exactly one of
/// completed, aborted or failed (so `received − completed − aborted − failed` are in flight).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RequestStats {
    /// Generation requests received (counted before any fault or validation answers them).
    pub requests_received: u64,
    /// Requests answered 200 with every token (the non-streaming body handed to hyper, or a
    /// stream's last chunk and `[DONE]` produced).
    pub requests_completed: u64,
    /// Requests that left before completing: the client went away, or the `die_after_tokens`
    /// fault killed the connection.
    pub requests_aborted: u64,
    /// Requests answered with an error status: 400 (bad input), 404 (unknown model with
    /// [`EngineConfig::check_model`]), the `status` fault, or 503 from an engine shutting down.
    pub requests_failed: u64,
    /// `x-request-id` header values of the most recent received requests, oldest first, at
    /// most [`defaults::REQUEST_ID_LOG`]; requests without the header add nothing.
    pub request_ids: Vec<String>,
}

/// Run-time state shared by the server and its [`EngineHandle`]: fault switches (a watch, so
/// stalled requests wake when they change) and request counts.
#[derive(Debug)]
struct Control {
    faults: watch::Sender<EngineFaults>,
    stats: std::sync::Mutex<(RequestStats, VecDeque<String>)>,
}

impl Control {
    fn new(faults: EngineFaults) -> Arc<Self> {
        Arc::new(Self {
            faults: watch::Sender::new(faults),
            stats: std::sync::Mutex::new((RequestStats::default(), VecDeque::new())),
        })
    }

    fn faults(&self) -> EngineFaults {
        self.faults.borrow().clone()
    }

    fn with_stats(&self, f: impl FnOnce(&mut RequestStats, &mut VecDeque<String>)) {
        let mut g = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let (s, ids) = &mut *g;
        f(s, ids);
    }

    fn snapshot(&self) -> RequestStats {
        let g = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        RequestStats {
            request_ids: g.1.iter().cloned().collect(),
            ..g.0.clone()
        }
    }

    /// Counts a received request and logs its id; the returned guard counts its outcome.
    fn receive(self: &Arc<Self>, request_id: Option<String>) -> Outcome {
        self.with_stats(|s, ids| {
            s.requests_received += 1;
            if let Some(id) = request_id {
                if ids.len() == defaults::REQUEST_ID_LOG {
                    ids.pop_front();
                }
                ids.push_back(id);
            }
        });
        Outcome {
            control: self.clone(),
            done: false,
        }
    }
}

/// Outcome of one received request: [`Outcome::completed`] or [`Outcome::failed`], or, when
/// dropped without either, aborted.
struct Outcome {
    control: Arc<Control>,
    done: bool,
}

impl Outcome {
    fn completed(&mut self) {
        if !std::mem::replace(&mut self.done, true) {
            self.control.with_stats(|s, _| s.requests_completed += 1);
        }
    }

    fn failed(&mut self) {
        if !std::mem::replace(&mut self.done, true) {
            self.control.with_stats(|s, _| s.requests_failed += 1);
        }
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.done {
            self.control.with_stats(|s, _| s.requests_aborted += 1);
        }
    }
}

/// Waits while the `stall` fault is on; false if the engine is gone.
async fn wait_unstalled(faults: &mut watch::Receiver<EngineFaults>) -> bool {
    faults.wait_for(|f| !f.stall).await.is_ok()
}

/// A running engine started by [`spawn`]. Dropping it (or calling [`EngineHandle::shutdown`])
/// stops the server and joins its thread; in-flight requests are cut.
#[derive(Debug)]
pub struct EngineHandle {
    /// Address actually bound (useful with port 0).
    pub addr: SocketAddr,
    /// Bound KV-event PUB endpoint (`tcp://127.0.0.1:PORT`) when events are on.
    pub kv_events_endpoint: Option<String>,
    /// Bound replay ROUTER endpoint when events and replay are on.
    pub kv_replay_endpoint: Option<String>,
    /// Publisher counters when events are on.
    pub kv_stats: Option<Arc<events::PublisherStats>>,
    control: Arc<Control>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EngineHandle {
    /// Stops the server and waits for its thread to exit: the listener is closed (new
    /// connections are refused) and in-flight connections are dropped. A new engine can then
    /// be [`spawn`]ed on the same `addr` (a restart): std's `TcpListener::bind` sets
    /// `SO_REUSEADDR` on Unix, so connections left in `TIME_WAIT` do not block the port.
    pub fn shutdown(mut self) {
        self.stop();
    }

    /// The fault switches in force (as `GET /_kvroute/fault`).
    pub fn faults(&self) -> EngineFaults {
        self.control.faults()
    }

    /// Replaces the fault switches (as `POST /_kvroute/fault`); takes effect at once, also for
    /// in-flight requests (see the fields of [`EngineFaults`]).
    ///
    /// # Errors
    /// [`EngineError::InvalidConfig`] from [`EngineFaults::check`]; the faults are unchanged.
    pub fn set_faults(&self, faults: EngineFaults) -> Result<(), EngineError> {
        faults.check()?;
        self.control.faults.send_replace(faults);
        Ok(())
    }

    /// Request counts so far (as `GET /_kvroute/stats`).
    pub fn request_stats(&self) -> RequestStats {
        self.control.snapshot()
    }

    fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Binds `cfg.listen` (port 0 picks a free port) and runs [`serve`] on a dedicated thread with
/// a current-thread tokio runtime, so several engines can live in one process (the demo runs
/// four). `tokenizer` is shared; load it once.
///
/// # Errors
/// The listen address cannot be bound, the runtime or thread cannot be created, or `cfg` is
/// invalid (checked before returning, see [`EngineCore::new`]).
pub fn spawn(cfg: EngineConfig, tokenizer: Arc<Tokenizer>) -> std::io::Result<EngineHandle> {
    EngineCore::new(&cfg).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let std_listener = std::net::TcpListener::bind(cfg.listen)?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let publisher = cfg.kv_events.clone().map(Publisher::start).transpose()?;
    let kv_events_endpoint = publisher.as_ref().map(|p| p.events_endpoint.clone());
    let kv_replay_endpoint = publisher.as_ref().and_then(|p| p.replay_endpoint.clone());
    let kv_stats = publisher.as_ref().map(|p| p.stats.clone());
    let control = Control::new(cfg.faults.clone());
    let server_control = control.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (tx, rx) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name(format!("engine-{}", addr.port()))
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!(%addr, "engine listener: {e}");
                        return;
                    }
                };
                let stop = async {
                    let _ = rx.await;
                };
                if let Err(e) =
                    serve_until(listener, cfg, tokenizer, stop, publisher, server_control).await
                {
                    tracing::error!(%addr, "engine stopped: {e:#}");
                }
            });
        })?;
    Ok(EngineHandle {
        addr,
        kv_events_endpoint,
        kv_replay_endpoint,
        kv_stats,
        control,
        shutdown: Some(tx),
        thread: Some(thread),
    })
}

/// Serves the engine on `listener` until the task is dropped. Spawns the driver task and one
/// task per connection on the current tokio runtime. Idle keep-alive connections close after
/// `cfg.keep_alive_timeout_ms` (hyper's header-read timeout, which also runs while idle).
///
/// # Errors
/// `cfg` is invalid ([`EngineError::InvalidConfig`]), or its KV-event sockets cannot be
/// bound. Accept errors are logged and retried.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: EngineConfig,
    tokenizer: Arc<Tokenizer>,
) -> Result<(), crate::BoxError> {
    let publisher = cfg.kv_events.clone().map(Publisher::start).transpose()?;
    let control = Control::new(cfg.faults.clone());
    serve_until(
        listener,
        cfg,
        tokenizer,
        std::future::pending(),
        publisher,
        control,
    )
    .await
}

async fn serve_until(
    listener: tokio::net::TcpListener,
    cfg: EngineConfig,
    tokenizer: Arc<Tokenizer>,
    stop: impl Future<Output = ()>,
    publisher: Option<Publisher>,
    control: Arc<Control>,
) -> Result<(), crate::BoxError> {
    let core = EngineCore::new(&cfg)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let sink = publisher.as_ref().map(|p| EventSink {
        tx: p.sender(),
        restart_after_batches: cfg
            .kv_events
            .as_ref()
            .and_then(|k| k.faults.restart_after_batches),
        batches: 0,
    });
    let driver = tokio::spawn(drive(core, rx, sink));
    let keep_alive =
        (cfg.keep_alive_timeout_ms > 0).then(|| Duration::from_millis(cfg.keep_alive_timeout_ms));
    let shared = Arc::new(Shared {
        cfg,
        chat_ids: std::sync::Mutex::new(IncrementalTokenizer::new(
            (*tokenizer).clone(),
            DEFAULT_CACHE_TOKENS,
        )),
        tokenizer,
        tx,
        next_id: AtomicU64::new(0),
        id_nonce: rand::random(),
        control,
        started_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!("engine accept: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let shared = shared.clone();
                async move { route(shared, req).await }
            });
            let mut b = http1::Builder::new();
            b.timer(TokioTimer::new()).header_read_timeout(keep_alive);
            let _ = b.serve_connection(TokioIo::new(stream), svc).await;
        });
    }
    driver.abort();
    let _ = driver.await;
    drop(publisher);
    Ok(())
}

/// The driver's end of the KV-event publisher.
struct EventSink {
    tx: std::sync::mpsc::Sender<PublishMsg>,
    /// Fault: restart once after this many batches (done when the engine is idle).
    restart_after_batches: Option<u64>,
    /// Batches sent so far.
    batches: u64,
}

impl EventSink {
    /// Publishes one step's events (nothing for an empty step, as vLLM).
    fn publish(&mut self, events: Vec<super::model::BlockEvent>, block_size: usize) {
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.batches += 1;
        let _ = self.tx.send(PublishMsg::Batch {
            ts,
            events,
            block_size,
        });
    }

    /// Runs the restart fault once it is due and the engine is idle.
    fn maybe_restart(&mut self, core: &mut EngineCore) {
        if self
            .restart_after_batches
            .is_some_and(|n| self.batches >= n)
            && core.is_idle()
            && core.restart_cache().is_ok()
        {
            self.restart_after_batches = None;
            let _ = self.tx.send(PublishMsg::Restart);
        }
    }
}

/// State shared by connection tasks.
struct Shared {
    cfg: EngineConfig,
    tokenizer: Arc<Tokenizer>,
    /// Rendered chats are tokenized through this prefix cache: exact ids (the same as
    /// `tokenizer.encode`), at the cost of the new part of a growing conversation only. The
    /// engine's timing model charges prefill by tokens, not by this CPU time; the cache keeps
    /// four engines sharing a 2-core box with the router from spending most of it on
    /// re-tokenizing whole prompts (uncontended: one engine = one current-thread runtime).
    chat_ids: std::sync::Mutex<IncrementalTokenizer>,
    tx: mpsc::UnboundedSender<Command>,
    next_id: AtomicU64,
    /// Drawn at start: response ids are `nonce · request number` in 32 hex digits, unique
    /// across engines and restarts as vLLM's random ones (`chatcmpl-{uuid}`) are.
    id_nonce: u64,
    control: Arc<Control>,
    /// Unix time the server started, in s (`created` of `/v1/models`).
    started_unix: u64,
}

/// Messages from connection tasks to the driver.
enum Command {
    Add {
        req_id: u64,
        prompt: Vec<u32>,
        max_tokens: u32,
        output: OutputStream,
        tokens: mpsc::UnboundedSender<TokenOut>,
        reply: oneshot::Sender<Result<(), EngineError>>,
    },
    Abort {
        req_id: u64,
    },
    Stats {
        reply: oneshot::Sender<EngineStats>,
    },
    Reset {
        reply: oneshot::Sender<Result<usize, EngineError>>,
    },
    Cached {
        reply: oneshot::Sender<Vec<u64>>,
    },
}

/// Driver: owns the engine, applies commands, steps while there is work, sleeps the modelled
/// time, delivers tokens. Ends when every command sender is gone.
async fn drive(
    mut core: EngineCore,
    mut rx: mpsc::UnboundedReceiver<Command>,
    mut sink: Option<EventSink>,
) {
    let mut streams: HashMap<u64, mpsc::UnboundedSender<TokenOut>> = HashMap::new();
    let start = Instant::now();
    // Modelled time not yet slept, in ms; negative after oversleeping (bounded credit).
    let mut debt_ms = 0.0f64;
    loop {
        if let Some(s) = sink.as_mut() {
            s.maybe_restart(&mut core);
        }
        if core.is_idle() {
            debt_ms = 0.0;
            match rx.recv().await {
                Some(c) => apply(&mut core, &mut streams, c),
                None => return,
            }
        }
        while let Ok(c) = rx.try_recv() {
            apply(&mut core, &mut streams, c);
        }
        if core.is_idle() {
            continue;
        }
        let mut out = core.step(start.elapsed().as_secs_f64() * 1e3);
        if let Some(s) = sink.as_mut() {
            s.publish(std::mem::take(&mut out.events), core.block_size());
        }
        debt_ms += out.duration_ms;
        if debt_ms >= defaults::MIN_SLEEP_MS {
            let t0 = Instant::now();
            tokio::time::sleep(Duration::from_secs_f64(debt_ms / 1e3)).await;
            // Oversleeping (a busy CPU) is paid back by stepping without sleep, up to 1 s of
            // credit, so modelled throughput holds when the host is loaded.
            debt_ms = (debt_ms - t0.elapsed().as_secs_f64() * 1e3).max(-1_000.0);
        } else {
            tokio::task::yield_now().await;
        }
        for (id, tok) in out.outputs {
            let finished = tok.finish.is_some();
            let Some(tx) = streams.get(&id) else {
                continue;
            };
            if tx.send(tok).is_err() {
                streams.remove(&id);
                if !finished {
                    core.abort(id);
                }
            } else if finished {
                streams.remove(&id);
            }
        }
    }
}

fn apply(
    core: &mut EngineCore,
    streams: &mut HashMap<u64, mpsc::UnboundedSender<TokenOut>>,
    c: Command,
) {
    match c {
        Command::Add {
            req_id,
            prompt,
            max_tokens,
            output,
            tokens,
            reply,
        } => {
            let r = core.add_request_stream(req_id, prompt, max_tokens, output);
            if r.is_ok() {
                streams.insert(req_id, tokens);
            }
            let _ = reply.send(r);
        }
        Command::Abort { req_id } => {
            core.abort(req_id);
            streams.remove(&req_id);
        }
        Command::Stats { reply } => {
            let _ = reply.send(core.stats());
        }
        Command::Reset { reply } => {
            let _ = reply.send(core.reset_prefix_cache());
        }
        Command::Cached { reply } => {
            let _ = reply.send(core.cached_hashes());
        }
    }
}

/// Sends an abort for `req_id` when dropped while armed (client went away mid-request).
struct AbortGuard {
    req_id: u64,
    tx: mpsc::UnboundedSender<Command>,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Command::Abort {
                req_id: self.req_id,
            });
        }
    }
}

async fn route(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Died> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    match (&method, path.as_str()) {
        (&Method::GET, "/_kvroute/fault") => {
            return Ok(json_response(StatusCode::OK, &faults_json(&shared)));
        }
        (&Method::POST, "/_kvroute/fault") => return Ok(set_faults(&shared, req).await),
        (&Method::GET, "/_kvroute/stats") => {
            let stats = shared.control.snapshot();
            return Ok(json_response(StatusCode::OK, &json!(stats)));
        }
        (_, "/_kvroute/fault" | "/_kvroute/stats") => {
            return Ok(error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
            ));
        }
        (&Method::POST, "/v1/chat/completions") => return generate(shared, req, Api::Chat).await,
        (&Method::POST, "/v1/completions") => return generate(shared, req, Api::Completion).await,
        (&Method::POST, "/generate") => return generate(shared, req, Api::Sglang).await,
        _ => {}
    }
    // Every other endpoint freezes with the engine.
    if !wait_unstalled(&mut shared.control.faults.subscribe()).await {
        return Ok(engine_gone());
    }
    Ok(match (method, path.as_str()) {
        (Method::GET, "/health") => match shared.control.faults().health_status {
            None => response(StatusCode::OK, "text/plain", Bytes::new()),
            Some(code) => {
                let status = StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
                if status.is_success() {
                    response(status, "text/plain", Bytes::new())
                } else {
                    error_response(status, "injected fault: health_status")
                }
            }
        },
        (Method::GET, "/v1/models") => json_response(StatusCode::OK, &models_json(&shared)),
        (Method::GET, "/metrics") => match ask(&shared, |reply| Command::Stats { reply }).await {
            Some(s) => response(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                render_metrics(&shared.cfg.model_name, &s).into(),
            ),
            None => engine_gone(),
        },
        (Method::POST, "/reset_prefix_cache") => {
            match ask(&shared, |reply| Command::Reset { reply }).await {
                Some(Ok(_)) => response(StatusCode::OK, "text/plain", Bytes::new()),
                Some(Err(e)) => error_response(StatusCode::CONFLICT, &e.to_string()),
                None => engine_gone(),
            }
        }
        (Method::GET, "/debug/cached_blocks") => {
            match ask(&shared, |reply| Command::Cached { reply }).await {
                Some(mut v) => {
                    v.sort_unstable();
                    json_response(StatusCode::OK, &json!(v))
                }
                None => engine_gone(),
            }
        }
        (
            _,
            "/health"
            | "/v1/models"
            | "/metrics"
            | "/reset_prefix_cache"
            | "/v1/chat/completions"
            | "/v1/completions"
            | "/generate",
        ) => error_response(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
        _ => error_response(StatusCode::NOT_FOUND, &format!("no route for {path}")),
    })
}

/// `GET /_kvroute/fault` body: every field of [`EngineFaults`], `null` when off.
fn faults_json(shared: &Shared) -> Value {
    json!(shared.control.faults())
}

/// `POST /_kvroute/fault`: the body (an [`EngineFaults`] object; missing fields are off)
/// replaces the faults; answers the new state, or 400 leaving them unchanged.
async fn set_faults(shared: &Shared, req: Request<Incoming>) -> Response<Body> {
    let bytes = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error_response(StatusCode::BAD_REQUEST, &format!("cannot read body: {e}"));
        }
    };
    let faults: EngineFaults = match serde_json::from_slice(&bytes) {
        Ok(f) => f,
        Err(e) => {
            return error_response(StatusCode::BAD_REQUEST, &format!("invalid faults: {e}"));
        }
    };
    if let Err(e) = faults.check() {
        return error_response(StatusCode::BAD_REQUEST, &e.to_string());
    }
    shared.control.faults.send_replace(faults);
    json_response(StatusCode::OK, &faults_json(shared))
}

/// Sends a command built around a reply channel and awaits the reply; `None` if the driver
/// is gone.
async fn ask<T>(shared: &Shared, cmd: impl FnOnce(oneshot::Sender<T>) -> Command) -> Option<T> {
    let (tx, rx) = oneshot::channel();
    shared.tx.send(cmd(tx)).ok()?;
    rx.await.ok()
}

/// Which API a generation request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
    Sglang,
}

/// A validated generation request.
#[derive(Debug, Clone, PartialEq)]
struct GenRequest {
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    /// Where the output comes from (the continuation rule of [`OutputStream`]).
    output: OutputStream,
}

/// [`parse_gen_raw`] for a body that has no original bytes (tests): chats are rendered from
/// its re-serialised JSON.
#[cfg(test)]
fn parse_gen(tok: &Tokenizer, api: Api, body: &Value) -> Result<GenRequest, String> {
    parse_gen_raw(
        tok,
        None,
        defaults::SEED,
        defaults::MAX_MODEL_LEN,
        api,
        body,
        &serde_json::to_vec(body).unwrap_or_default(),
    )
}

/// Parses a generation body into token ids and options. The error is the 400 message. Chats
/// are rendered from `raw` (the request bytes) exactly as the router renders them: `tools`,
/// `chat_template_kwargs` and key order included, and tokenized through `chat_ids` when given
/// (same ids, reusing a cached prefix). `seed` is the engine seed (for [`tokens::prompt_stream`]).
/// The prompt and `max_tokens` must fit in `max_model_len` tokens ([`context_budget`]).
///
/// A chat with `continue_final_message: true` (which needs `add_generation_prompt: false`, as
/// in vLLM) is cut after its final message's content (see the module doc) and keyed on the
/// other messages, continuing at the final content's token count.
fn parse_gen_raw(
    tok: &Tokenizer,
    chat_ids: Option<&std::sync::Mutex<IncrementalTokenizer>>,
    seed: u64,
    max_model_len: usize,
    api: Api,
    body: &Value,
    raw: &[u8],
) -> Result<GenRequest, String> {
    let obj = body
        .as_object()
        .ok_or("request body must be a JSON object")?;
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("'stream' must be a boolean".into()),
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let bool_field = |name: &str| -> Result<Option<bool>, String> {
        match obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(format!("'{name}' must be a boolean")),
        }
    };
    // OpenAI `seed`: any integer; negative values key by their two's-complement bits.
    let request_seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|i| i as u64))
                .ok_or("'seed' must be an integer")?,
        ),
    };
    let int_field = |v: Option<&Value>, name: &str| -> Result<Option<u32>, String> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| format!("'{name}' must be an integer from 0 to {}", u32::MAX)),
        }
    };
    let (prompt, max_tokens, output) = match api {
        Api::Chat => {
            let messages = obj.get("messages").ok_or("'messages' is required")?;
            let Some(messages) = messages.as_array() else {
                return Err("'messages' must be an array".into());
            };
            let continue_final = bool_field("continue_final_message")?.unwrap_or(false);
            if continue_final && bool_field("add_generation_prompt")?.unwrap_or(true) {
                return Err("Cannot set both `continue_final_message` and \
                            `add_generation_prompt` to True."
                    .into());
            }
            let mut text = tok
                .render_chat_body(raw)
                .map_err(|e| format!("cannot render chat template: {e}"))?;
            let (identity_messages, generated) = if continue_final {
                let content = messages
                    .last()
                    .and_then(|m| m.get("content"))
                    .and_then(Value::as_str)
                    .ok_or("'continue_final_message' needs a final message with string content")?;
                let cut = match text.rfind(content) {
                    Some(i) => i + content.len(),
                    None => {
                        let trimmed = content.trim();
                        text.rfind(trimmed)
                            .map(|i| i + trimmed.len())
                            .ok_or("cannot find the final message in the rendered prompt")?
                    }
                };
                text.truncate(cut);
                (&messages[..messages.len() - 1], Some(content))
            } else {
                (&messages[..], None)
            };
            let identity = json!([
                identity_messages,
                obj.get("tools"),
                obj.get("chat_template_kwargs")
            ])
            .to_string();
            let start = generated.map_or(0, |c| tok.encode(c).len() as u32);
            let output = tokens::keyed_stream(request_seed, identity.as_bytes(), start);
            let max = match int_field(obj.get("max_completion_tokens"), "max_completion_tokens")? {
                Some(m) => Some(m),
                None => int_field(obj.get("max_tokens"), "max_tokens")?,
            };
            let ids = match chat_ids {
                Some(inc) => {
                    inc.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .encode(&text, 0)
                        .map_err(|e| format!("cannot tokenize the prompt: {e}"))?
                        .ids
                }
                None => tok.encode(&text),
            };
            (ids, max, output)
        }
        Api::Completion => {
            let prompt = match obj.get("prompt") {
                Some(Value::String(s)) => tok.encode(s),
                Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                    tok.encode(a[0].as_str().unwrap_or_default())
                }
                Some(Value::Array(a)) => token_ids(a, "prompt")?,
                _ => return Err("'prompt' must be a string or a list of token ids".into()),
            };
            let output = tokens::prompt_stream(seed, request_seed, &prompt);
            (
                prompt,
                int_field(obj.get("max_tokens"), "max_tokens")?,
                output,
            )
        }
        Api::Sglang => {
            let prompt = match (obj.get("input_ids"), obj.get("text")) {
                (Some(Value::Array(a)), _) => token_ids(a, "input_ids")?,
                (_, Some(Value::String(s))) => tok.encode(s),
                _ => return Err("'text' (string) or 'input_ids' (list of ints) is required".into()),
            };
            let max = int_field(
                obj.get("sampling_params")
                    .and_then(|s| s.get("max_new_tokens")),
                "sampling_params.max_new_tokens",
            )?;
            let output = tokens::prompt_stream(seed, request_seed, &prompt);
            (prompt, max, output)
        }
    };
    let max_tokens = context_budget(prompt.len(), max_tokens, max_model_len)?;
    Ok(GenRequest {
        prompt,
        max_tokens,
        stream,
        include_usage,
        output,
    })
}

/// The output budget of a `prompt`-token request asking for `max_tokens` (`None`: not
/// given) on an engine of `max_model_len` tokens, or the 400 message. vLLM's input
/// validation (`_validate_input`, `vllm/entrypoints/openai/serving_engine.py`), messages
/// verbatim:
/// - a prompt of `max_model_len` tokens or more leaves no room to generate;
/// - an explicit `max_tokens` must fit beside the prompt;
/// - without one, [`defaults::MAX_TOKENS`] is cut to the room left (vLLM's own default is
///   that room).
fn context_budget(
    prompt: usize,
    max_tokens: Option<u32>,
    max_model_len: usize,
) -> Result<u32, String> {
    if prompt >= max_model_len {
        return Err(format!(
            "This model's maximum context length is {max_model_len} tokens. However, your \
             request has {prompt} input tokens. Please reduce the length of the input messages."
        ));
    }
    let room = max_model_len - prompt;
    match max_tokens {
        Some(m) if m as usize > room => Err(format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum \
             context length is {max_model_len} tokens and your request has {prompt} input \
             tokens ({m} > {max_model_len} - {prompt})."
        )),
        Some(m) => Ok(m),
        None => Ok(defaults::MAX_TOKENS.min(u32::try_from(room).unwrap_or(u32::MAX))),
    }
}

fn token_ids(a: &[Value], name: &str) -> Result<Vec<u32>, String> {
    a.iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| format!("'{name}' must be a list of token ids"))
}

/// Serves one generation request: read the body, wait out a stall, count it received, then
/// apply the `status` fault, validation, the model check and the `die_after_tokens` fault.
async fn generate(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    api: Api,
) -> Result<Response<Body>, Died> {
    let request_id = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let bytes = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Ok(error_response(
                StatusCode::BAD_REQUEST,
                &format!("cannot read body: {e}"),
            ));
        }
    };
    let mut faults = shared.control.faults.subscribe();
    if !wait_unstalled(&mut faults).await {
        return Ok(engine_gone());
    }
    let mut outcome = shared.control.receive(request_id);
    let fail = |outcome: &mut Outcome, r: Response<Body>| {
        outcome.failed();
        Ok(r)
    };
    let now = shared.control.faults();
    if let Some(code) = now.status {
        return fail(&mut outcome, fault_status_response(code, now.retry_after_s));
    }
    let body: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => {
            let r = error_response(StatusCode::BAD_REQUEST, &format!("invalid JSON: {e}"));
            return fail(&mut outcome, r);
        }
    };
    if shared.cfg.check_model
        && let Some(model) = body.get("model")
    {
        match model.as_str() {
            Some(m) if m == shared.cfg.model_name => {}
            Some(m) => return fail(&mut outcome, model_not_found(m)),
            None => {
                let r = error_response(StatusCode::BAD_REQUEST, "'model' must be a string");
                return fail(&mut outcome, r);
            }
        }
    }
    let gen_req = match parse_gen_raw(
        &shared.tokenizer,
        Some(&shared.chat_ids),
        shared.cfg.seed,
        shared.cfg.max_model_len,
        api,
        &body,
        &bytes,
    ) {
        Ok(g) => g,
        Err(msg) => return fail(&mut outcome, error_response(StatusCode::BAD_REQUEST, &msg)),
    };
    // Dies at 0 tokens: before the response head, without running the request.
    if gen_req.max_tokens > 0 && shared.control.faults().die_after_tokens == Some(0) {
        return Err(Died);
    }
    let req_id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let (tok_tx, tok_rx) = mpsc::unbounded_channel();
    let (reply_tx, reply_rx) = oneshot::channel();
    let prompt_tokens = gen_req.prompt.len();
    let add = Command::Add {
        req_id,
        prompt: gen_req.prompt,
        max_tokens: gen_req.max_tokens,
        output: gen_req.output,
        tokens: tok_tx,
        reply: reply_tx,
    };
    if shared.tx.send(add).is_err() {
        return fail(&mut outcome, engine_gone());
    }
    let mut guard = AbortGuard {
        req_id,
        tx: shared.tx.clone(),
        armed: true,
    };
    match reply_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            guard.armed = false;
            return fail(
                &mut outcome,
                error_response(StatusCode::BAD_REQUEST, &e.to_string()),
            );
        }
        Err(_) => return fail(&mut outcome, engine_gone()),
    }
    let fmt = Formatter {
        api,
        id: match api {
            Api::Chat => format!("chatcmpl-{:016x}{req_id:016x}", shared.id_nonce),
            Api::Completion => format!("cmpl-{:016x}{req_id:016x}", shared.id_nonce),
            Api::Sglang => format!("{:016x}{req_id:016x}", shared.id_nonce),
        },
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: shared.cfg.model_name.clone(),
        include_usage: gen_req.include_usage,
        prompt_tokens,
    };
    if gen_req.stream {
        let state = SseState {
            rx: tok_rx,
            guard,
            fmt,
            acc: Accumulated::default(),
            faults,
            outcome,
            done: false,
            dying: false,
        };
        let stream = futures_util::stream::unfold(state, next_sse);
        let mut resp = Response::new(StreamBody::new(stream).boxed_unsync());
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/event-stream"),
        );
        h.insert(
            header::CACHE_CONTROL,
            header::HeaderValue::from_static("no-cache"),
        );
        return Ok(resp);
    }
    let mut rx = tok_rx;
    let mut acc = Accumulated::default();
    let mut finish = None;
    while let Some(t) = rx.recv().await {
        // Dropping `guard` and `outcome` on the way out aborts and counts the request.
        if past_die_point(&faults, &acc) {
            return Err(Died);
        }
        acc.push(&t);
        if t.finish.is_some() {
            finish = t.finish;
            break;
        }
        if past_die_point(&faults, &acc) {
            return Err(Died);
        }
    }
    guard.armed = false;
    if finish.is_none() {
        return fail(&mut outcome, engine_gone());
    }
    if !wait_unstalled(&mut faults).await {
        return fail(&mut outcome, engine_gone());
    }
    outcome.completed();
    Ok(json_response(StatusCode::OK, &fmt.full_response(&acc)))
}

/// True when `die_after_tokens` is set and `acc` already holds at least that many tokens
/// (the caller checks it for an unfinished request only).
fn past_die_point(faults: &watch::Receiver<EngineFaults>, acc: &Accumulated) -> bool {
    faults
        .borrow()
        .die_after_tokens
        .is_some_and(|n| acc.token_ids.len() >= n as usize)
}

/// What a request produced so far.
#[derive(Debug, Default)]
struct Accumulated {
    token_ids: Vec<u32>,
    text: String,
    cached_tokens: u32,
    finish: Option<&'static str>,
}

impl Accumulated {
    /// Adds `t`; returns its text.
    fn push(&mut self, t: &TokenOut) -> String {
        if let Some(p) = t.prompt {
            self.cached_tokens = p.cached_tokens;
        }
        self.finish = t.finish.map(|f| f.as_str());
        self.token_ids.push(t.token_id);
        let piece = tokens::decode_output(&[t.token_id]);
        self.text.push_str(&piece);
        piece
    }
}

/// Builds response JSON for one request.
#[derive(Debug, Clone)]
struct Formatter {
    api: Api,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    prompt_tokens: usize,
}

impl Formatter {
    fn usage(&self, acc: &Accumulated) -> Value {
        let completion = acc.token_ids.len();
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": acc.cached_tokens},
        })
    }

    fn sglang_meta(&self, acc: &Accumulated) -> Value {
        json!({
            "id": self.id,
            "finish_reason": acc.finish.map(|f| json!({"type": f, "length": acc.token_ids.len()})),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": acc.token_ids.len(),
            "cached_tokens": acc.cached_tokens,
        })
    }

    /// Non-streaming response body.
    fn full_response(&self, acc: &Accumulated) -> Value {
        match self.api {
            Api::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": acc.text},
                             "logprobs": null, "finish_reason": acc.finish}],
                "usage": self.usage(acc),
            }),
            Api::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": acc.text, "logprobs": null,
                             "finish_reason": acc.finish}],
                "usage": self.usage(acc),
            }),
            Api::Sglang => json!({
                "text": acc.text, "output_ids": acc.token_ids, "meta_info": self.sglang_meta(acc),
            }),
        }
    }

    /// SSE events for one new token: `piece` is its text; `first` when it is the first token.
    fn token_events(&self, acc: &Accumulated, piece: &str, first: bool, out: &mut String) {
        let chunk = match self.api {
            Api::Chat => {
                if first {
                    sse(
                        out,
                        &self.chat_chunk(json!({"role": "assistant", "content": ""}), None),
                    );
                }
                self.chat_chunk(json!({"content": piece}), acc.finish)
            }
            Api::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": piece, "logprobs": null,
                             "finish_reason": acc.finish}],
            }),
            // SGLang streams the cumulative text.
            Api::Sglang => json!({
                "text": acc.text, "output_ids": acc.token_ids, "meta_info": self.sglang_meta(acc),
            }),
        };
        sse(out, &chunk);
        if acc.finish.is_some() {
            if self.include_usage && self.api != Api::Sglang {
                let object = match self.api {
                    Api::Chat => "chat.completion.chunk",
                    _ => "text_completion",
                };
                sse(
                    out,
                    &json!({"id": self.id, "object": object, "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage(acc)}),
                );
            }
            out.push_str("data: [DONE]\n\n");
        }
    }

    fn chat_chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        })
    }
}

fn sse(out: &mut String, v: &Value) {
    out.push_str("data: ");
    out.push_str(&v.to_string());
    out.push_str("\n\n");
}

/// State of a streaming response body ([`next_sse`] unfolds it). Dropped early (client gone,
/// or the connection killed by a fault) → its [`AbortGuard`] aborts the request and its
/// [`Outcome`] counts it aborted.
struct SseState {
    rx: mpsc::UnboundedReceiver<TokenOut>,
    guard: AbortGuard,
    fmt: Formatter,
    acc: Accumulated,
    faults: watch::Receiver<EngineFaults>,
    outcome: Outcome,
    done: bool,
    /// `die_after_tokens` fired: the next frame is the error that kills the connection.
    dying: bool,
}

/// Next frame of a streaming body: every token available becomes SSE events in one frame,
/// held while the `stall` fault is on; after a `die_after_tokens` cut, an error frame.
async fn next_sse(mut st: SseState) -> Option<(Result<Frame<Bytes>, Died>, SseState)> {
    if st.done {
        return None;
    }
    if st.dying {
        // Pending once, so hyper flushes the frames already written before the error drops
        // the connection.
        tokio::task::yield_now().await;
        st.done = true;
        return Some((Err(Died), st));
    }
    let mut batch = Vec::new();
    match st.rx.recv().await {
        Some(t) => batch.push(t),
        // Driver gone: end the stream without [DONE] (a cut stream).
        None => return None,
    }
    if !wait_unstalled(&mut st.faults).await {
        return None;
    }
    while let Ok(t) = st.rx.try_recv() {
        batch.push(t);
    }
    let mut out = String::new();
    for t in batch {
        if past_die_point(&st.faults, &st.acc) {
            st.dying = true;
            break;
        }
        let first = st.acc.token_ids.is_empty();
        let piece = st.acc.push(&t);
        st.fmt.token_events(&st.acc, &piece, first, &mut out);
        if t.finish.is_some() {
            st.guard.armed = false;
            st.outcome.completed();
            st.done = true;
            break;
        }
        if past_die_point(&st.faults, &st.acc) {
            st.dying = true;
            break;
        }
    }
    if out.is_empty() {
        // Died before this batch's first token.
        tokio::task::yield_now().await;
        st.done = true;
        return Some((Err(Died), st));
    }
    Some((Ok(Frame::data(Bytes::from(out))), st))
}

/// `GET /v1/models` in the OpenAI list shape with vLLM's extra fields (`root`, `parent`,
/// `max_model_len`); `created` is the server's start time.
fn models_json(shared: &Shared) -> Value {
    let cfg = &shared.cfg;
    json!({"object": "list", "data": [{
        "id": cfg.model_name, "object": "model", "created": shared.started_unix,
        "owned_by": "vllm", "root": cfg.model_name, "parent": null,
        "max_model_len": cfg.max_model_len,
    }]})
}

/// Prometheus text exposition of `s` with vLLM metric names (`engine-model.md` §7), labels
/// `engine="0"` and `model_name`. Values are printed as floats (`2.0`), as Python's client does.
pub fn render_metrics(model_name: &str, s: &EngineStats) -> String {
    let labels = format!(
        "{{engine=\"{ENGINE_LABEL}\",model_name=\"{}\"}}",
        model_name.replace('\\', "\\\\").replace('"', "\\\"")
    );
    let rows: [(&str, &str, &str, f64); 8] = [
        (
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            s.running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            s.waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_usage,
        ),
        (
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_queries_tokens as f64,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_hits_tokens as f64,
        ),
        (
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemption from the engine.",
            s.preemptions as f64,
        ),
        (
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            s.prompt_tokens as f64,
        ),
        (
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            s.generation_tokens as f64,
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, v) in rows {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{labels} {v:?}\n"
        ));
    }
    out
}

fn response(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Body> {
    let mut r = Response::new(
        Full::new(body)
            .map_err(|never: Infallible| match never {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    response(status, "application/json", v.to_string().into())
}

/// OpenAI-style error body `{"error": {"message", "type", "code"}}`.
fn error_response(status: StatusCode, message: &str) -> Response<Body> {
    let kind = match status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::NOT_FOUND => "not_found_error",
        _ => "server_error",
    };
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "code": status.as_u16()}}),
    )
}

/// vLLM's answer to a request for a model it does not serve.
fn model_not_found(model: &str) -> Response<Body> {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({"error": {"message": format!("The model `{model}` does not exist."),
                          "type": "NotFoundError", "code": 404}}),
    )
}

/// The `status` fault's answer: `code` with an OpenAI error body whose `type` is the
/// openai-python exception class for that status (`RateLimitError` for 429,
/// `InternalServerError` for 5xx, …), plus `Retry-After: retry_after_s` when given.
fn fault_status_response(code: u16, retry_after_s: Option<u32>) -> Response<Body> {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let kind = match code {
        400 => "BadRequestError",
        401 => "AuthenticationError",
        403 => "PermissionDeniedError",
        404 => "NotFoundError",
        409 => "ConflictError",
        422 => "UnprocessableEntityError",
        429 => "RateLimitError",
        500.. => "InternalServerError",
        _ => "APIStatusError",
    };
    let mut r = json_response(
        status,
        &json!({"error": {"message": format!("injected fault: status {code}"),
                          "type": kind, "code": code}}),
    );
    if let Some(s) = retry_after_s {
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(s));
    }
    r
}

fn engine_gone() -> Response<Body> {
    error_response(StatusCode::SERVICE_UNAVAILABLE, "engine is shutting down")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::model::{FinishReason, PromptUsage};
    use std::sync::OnceLock;

    fn tok() -> &'static Tokenizer {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        T.get_or_init(|| Tokenizer::qwen3().expect("embedded qwen3"))
    }

    /// Chats tokenized through the engine's prefix cache give the same ids as a full encode,
    /// and a grown conversation reuses the previous turn's ids.
    #[test]
    fn cached_chat_ids_equal_a_full_encode() {
        let inc = std::sync::Mutex::new(IncrementalTokenizer::new(tok().clone(), 1 << 20));
        let mut text = String::from("Summarise the following report about caches");
        for turn in 0..3 {
            text.push_str(" and the next section of it with more words");
            let body = json!({"messages": [{"role": "user", "content": text}]});
            let raw = serde_json::to_vec(&body).unwrap();
            let cached = parse_chat_raw(Some(&inc), &body, &raw);
            let full = parse_chat_raw(None, &body, &raw);
            assert_eq!(cached.prompt, full.prompt, "turn {turn}");
        }
        assert!(
            inc.lock().unwrap().stats().hits >= 1,
            "growing turns reuse a prefix"
        );
    }

    #[test]
    fn parse_chat_renders_tools_from_the_raw_body() {
        let body = json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "messages": [{"role": "user", "content": "Hello"}]});
        let raw = serde_json::to_vec(&body).unwrap();
        let with_tools = parse_chat_raw(None, &body, &raw);
        let plain = parse_gen(
            tok(),
            Api::Chat,
            &json!({"messages": [{"role": "user", "content": "Hello"}]}),
        )
        .unwrap();
        assert!(
            with_tools.prompt.len() > plain.prompt.len() + 20,
            "{} vs {}",
            with_tools.prompt.len(),
            plain.prompt.len()
        );
    }

    #[test]
    fn parse_chat_renders_template_and_reads_max_tokens() {
        let g = parse_gen(
            tok(),
            Api::Chat,
            &json!({"messages": [{"role": "user", "content": "Hello"}],
                    "max_completion_tokens": 5, "max_tokens": 9, "stream": true,
                    "stream_options": {"include_usage": true}}),
        )
        .unwrap();
        // traces.md §3: 3 head tokens + content + 5 tail tokens with the generation prompt.
        assert_eq!(
            g.prompt,
            [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
        );
        assert_eq!((g.max_tokens, g.stream, g.include_usage), (5, true, true));
        let g = parse_gen(
            tok(),
            Api::Chat,
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .unwrap();
        assert_eq!((g.max_tokens, g.stream), (defaults::MAX_TOKENS, false));
        // The Qwen3 template needs at least one message: a 400, not a panic.
        assert!(parse_gen(tok(), Api::Chat, &json!({"messages": []})).is_err());
    }

    #[test]
    fn parse_completion_and_generate_forms() {
        let g = parse_gen(
            tok(),
            Api::Completion,
            &json!({"prompt": "hello", "max_tokens": 3}),
        )
        .unwrap();
        assert_eq!((g.prompt, g.max_tokens), (vec![14990], 3));
        let g = parse_gen(tok(), Api::Completion, &json!({"prompt": [1, 2, 3]})).unwrap();
        assert_eq!(g.prompt, [1, 2, 3]);
        let g = parse_gen(
            tok(),
            Api::Sglang,
            &json!({"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 7}}),
        )
        .unwrap();
        assert_eq!((g.prompt, g.max_tokens), (vec![4, 5], 7));
        let g = parse_gen(tok(), Api::Sglang, &json!({"text": "hello"})).unwrap();
        assert_eq!(g.prompt, [14990]);
        for (api, bad) in [
            (Api::Chat, json!({"messages": "hi"})),
            (Api::Chat, json!([1])),
            (Api::Completion, json!({"prompt": [1, -2]})),
            (Api::Completion, json!({"prompt": "x", "max_tokens": "3"})),
            (Api::Sglang, json!({})),
        ] {
            assert!(parse_gen(tok(), api, &bad).is_err(), "{bad}");
        }
    }

    /// [`parse_gen_raw`] of a chat with engine seed 0 at the default context length.
    fn parse_chat_raw(
        chat_ids: Option<&std::sync::Mutex<IncrementalTokenizer>>,
        body: &Value,
        raw: &[u8],
    ) -> GenRequest {
        parse_gen_raw(
            tok(),
            chat_ids,
            0,
            defaults::MAX_MODEL_LEN,
            Api::Chat,
            body,
            raw,
        )
        .unwrap()
    }

    #[test]
    fn the_context_budget_is_vllms() {
        // vLLM's worked example (its own message): 1,297 input tokens, max_tokens 4,000,
        // max_model_len 4,096.
        assert_eq!(
            context_budget(1297, Some(4000), 4096),
            Err(
                "'max_tokens' or 'max_completion_tokens' is too large: 4000. This model's \
                 maximum context length is 4096 tokens and your request has 1297 input tokens \
                 (4000 > 4096 - 1297)."
                    .into()
            )
        );
        assert_eq!(context_budget(1297, Some(2799), 4096), Ok(2799));
        assert_eq!(
            context_budget(4096, None, 4096),
            Err(
                "This model's maximum context length is 4096 tokens. However, your request \
                 has 4096 input tokens. Please reduce the length of the input messages."
                    .into()
            )
        );
        // No max_tokens: the default, cut to the room left.
        assert_eq!(context_budget(10, None, 4096), Ok(defaults::MAX_TOKENS));
        assert_eq!(context_budget(4090, None, 4096), Ok(6));
        // Through the parser: "hello" is one token, so 10 − 1 = 9 tokens of room.
        let body = json!({"prompt": "hello", "max_tokens": 10});
        let raw = serde_json::to_vec(&body).unwrap();
        let parse = |b: &Value| parse_gen_raw(tok(), None, 0, 10, Api::Completion, b, &raw);
        assert!(parse(&body).unwrap_err().contains("is too large: 10."));
        let body = json!({"prompt": "hello", "max_tokens": 9});
        assert_eq!(parse(&body).map(|g| g.max_tokens), Ok(9));
    }

    fn tok_out(index: u32, last: bool) -> TokenOut {
        TokenOut {
            token_id: tokens::OUTPUT_VOCAB[index as usize].0,
            index,
            prompt: (index == 0).then_some(PromptUsage {
                prompt_tokens: 10,
                cached_tokens: 0,
            }),
            finish: last.then_some(FinishReason::Length),
        }
    }

    #[test]
    fn chat_stream_events_role_content_finish_usage_done() {
        let fmt = Formatter {
            api: Api::Chat,
            id: "chatcmpl-0".into(),
            created: 1,
            model: "m".into(),
            include_usage: true,
            prompt_tokens: 10,
        };
        let mut acc = Accumulated::default();
        let mut out = String::new();
        for i in 0..2 {
            let t = tok_out(i, i == 1);
            let piece = acc.push(&t);
            fmt.token_events(&acc, &piece, i == 0, &mut out);
        }
        let events: Vec<&str> = out
            .split("\n\n")
            .filter(|s| !s.is_empty())
            .map(|s| s.strip_prefix("data: ").unwrap())
            .collect();
        assert_eq!(events.len(), 5);
        let v: Vec<Value> = events[..4]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(v[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(v[1]["choices"][0]["delta"]["content"], " the");
        assert_eq!(v[1]["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(v[2]["choices"][0]["delta"]["content"], " and");
        assert_eq!(v[2]["choices"][0]["finish_reason"], "length");
        assert_eq!(v[3]["choices"], json!([]));
        assert_eq!(v[3]["usage"]["total_tokens"], 12);
        assert_eq!(events[4], "[DONE]");
    }

    #[test]
    fn metrics_text_has_vllm_names_and_labels() {
        let s = EngineStats {
            running: 2,
            prefix_hits_tokens: 48,
            ..EngineStats::default()
        };
        let m = render_metrics("qwen3-sim", &s);
        assert!(
            m.contains("vllm:num_requests_running{engine=\"0\",model_name=\"qwen3-sim\"} 2.0\n")
        );
        assert!(m.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
        assert!(m.contains(
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"qwen3-sim\"} 48.0\n"
        ));
        assert_eq!(m.lines().filter(|l| !l.starts_with('#')).count(), 8);
    }
}
