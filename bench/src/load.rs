//! `kvroute load`: a fixed-rate HTTP/1.1 load generator in the wrk2 sense.
//!
//! Requests are scheduled at a constant rate R ([`Schedule`]: request `i` at `t_i = i / R`
//! after the start, `⌈R·D⌉` of them for a duration D) whatever the target does. They go out
//! over C keep-alive connections: a connection that is free takes the next request of the
//! schedule, waits for its time ([`Pacer`], to the µs) and sends it; it sends the next only
//! after the answer (no pipelining), as a client pool does. Each request's latency is measured
//! from its *scheduled* time (`corrected`), so a stall that holds every connection counts
//! for each request queued behind it (coordinated omission cannot hide it), and from the
//! moment it was sent (`uncorrected`, the service time). For a stream (`"stream": true`) the
//! time to the first SSE `data:` line of the body is measured both ways too. Latencies go to
//! hdrhistogram (µs, 3 significant digits) and are reported in ms ([`LatencySummary`]).
//!
//! If the generator cannot keep to the schedule, the report says so ([`LoadReport::warnings`]):
//! requests sent more than `max_lag` after their time are counted, split by cause (a
//! connection was free: the generator was late; none was: the target is slower than R or
//! needs more connections). The rate is never lowered to fit.
//!
//! Each request waits for its own time by default, one wake-up of the generator per request.
//! With a `tick`, requests wait for the next multiple of it instead (wrk2's timers tick in
//! ms), so those due within one tick share a wake-up: fewer wake-ups, at up to one tick of
//! wait in their corrected latencies and a burstier load.
//!
//! Bounded: the run sends at most [`Schedule::len`] requests, each bounded by `timeout`
//! (connect included), and sends nothing later than `timeout` after the schedule's end; a
//! request it did not send by then counts as `unsent`. Every scheduled request ends as exactly
//! one of ok, an error (by kind) or unsent.
//!
//! Bodies are OpenAI chat completions: an optional shared system prompt of `system_chars`
//! characters and a user message of `prompt_tokens` words, each word one token of the
//! tokenizer the [`WordIds`] came from (the CLI uses the embedded Qwen3 tokenizer, the
//! simulated engine's); request `i`'s words are block `(seed, i)` of [`WordIds`], so every
//! request of a run is new text and a run repeats exactly with its seed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::client::{BadUrl, CHAT_COMPLETIONS_PATH, Conn, ConnectError, Target};
use crate::replay::{LatencySummary, MAX_RECORDED_LATENCY_US, new_hist};
use crate::trace::WordIds;

/// Default target: the router's default listen address; a URL without a path gets
/// [`CHAT_COMPLETIONS_PATH`]. Source: [`crate::replay::DEFAULT_URL`].
pub const DEFAULT_URL: &str = crate::replay::DEFAULT_URL;
/// Default rate, requests per second: one per ms, which any target on loopback sustains.
/// kvroute's choice (wrk2 has no default; issue 15 measures at 2,000, 5,000 and 10,000).
pub const DEFAULT_RATE: f64 = 1_000.0;
/// Default run length, seconds. Source: wrk's and wrk2's `--duration` default (10 s).
pub const DEFAULT_DURATION_S: f64 = 10.0;
/// Default keep-alive connections. Source: issue 15's `wrk -t2 -c64`.
pub const DEFAULT_CONNECTIONS: usize = 64;
/// Default runtime threads of the generator: one, so that on the 2-core machine the target
/// keeps the other core. kvroute's choice.
pub const DEFAULT_THREADS: usize = 1;
/// Default user message length, words (one token each in the tokenizer of the [`WordIds`]).
/// Source: issue 15's bodies, a ~15-token user question.
pub const DEFAULT_PROMPT_TOKENS: u32 = 16;
/// Default shared system prompt, characters; 0 = no system message. Issue 15's comparison
/// uses 800.
pub const DEFAULT_SYSTEM_CHARS: usize = 0;
/// Default `max_tokens`. Source: the simulated engine's default when a request gives none
/// ([`crate::engine::defaults::MAX_TOKENS`], vLLM's for `/v1/completions`).
pub const DEFAULT_MAX_TOKENS: u32 = crate::engine::defaults::MAX_TOKENS;
/// Default `model` field: the simulated engine's model ([`crate::engine::defaults::MODEL_NAME`],
/// as the demo sends), so that `kvroute engine` and a router in front of it answer; a real
/// fleet needs `--model`.
pub const DEFAULT_MODEL: &str = crate::engine::defaults::MODEL_NAME;
/// Default seed of the user texts. kvroute's choice; another seed sends texts no earlier run
/// sent (a router's prefix cache remembers them).
pub const DEFAULT_SEED: u32 = 0;
/// Default per-request timeout, connect to last byte, ms: an error `timeout` after it, and the
/// connection is replaced. kvroute's choice: wrk's 2 s, stretched to cover an engine's
/// generation of a few hundred tokens.
pub const DEFAULT_TIMEOUT_MS: u64 = 10_000;
/// Default bound on how late a request may be sent after its scheduled time before the run
/// reports falling behind, ms: 10 requests at 1,000 req/s, above the few-ms preemptions of a
/// shared 2-core machine. kvroute's choice.
pub const DEFAULT_MAX_LAG_MS: f64 = 10.0;
/// Default wake-up grid, µs: 0, every request is sent at its own time (to the µs of the
/// timerfd). kvroute's choice, so that a corrected latency holds no wait of the generator's;
/// wrk2's timers tick in whole ms.
pub const DEFAULT_TICK_US: u64 = 0;
/// Block of [`WordIds`] the system prompt is cut from: `(2³² − 1, 2³² − 1)`, the same in every
/// run (request texts use `(seed, i)` with `i < 2³² − 1`).
pub const SYSTEM_PROMPT_BLOCK: (u32, u64) = (u32::MAX, u32::MAX as u64);
/// Interval of progress bar updates, ms.
const PROGRESS_TICK_MS: u64 = 100;

/// How long a run is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    /// Schedule every `t_i = i / R` before this duration: `⌈R·D⌉` requests.
    Duration(Duration),
    /// Schedule exactly this many requests.
    Requests(u64),
}

/// Settings of one run (defaults: the `DEFAULT_*` constants of this module).
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// `http://host[:port][/path]`; no path (or `/`) means [`CHAT_COMPLETIONS_PATH`].
    pub url: String,
    /// `model` field of each request.
    pub model: String,
    /// Requests per second, > 0 and finite.
    pub rate: f64,
    /// Run length.
    pub limit: Limit,
    /// Keep-alive connections, ≥ 1.
    pub connections: usize,
    /// Runtime threads, ≥ 1 (1: a current-thread runtime).
    pub threads: usize,
    /// Send `"stream": true` (with `stream_options.include_usage`) and read SSE.
    pub stream: bool,
    /// User message length, words.
    pub prompt_tokens: u32,
    /// Shared system prompt length, characters (0: none).
    pub system_chars: usize,
    /// `max_tokens` of each request.
    pub max_tokens: u32,
    /// Seed of the user texts.
    pub seed: u32,
    /// Per-request timeout, connect to last byte.
    pub timeout: Duration,
    /// A request sent later than this after its scheduled time counts as late.
    pub max_lag: Duration,
    /// Wake-up grid: each send waits until the first multiple of `tick` after the start at or
    /// after its scheduled time (zero: exactly its time). Requests due within one tick then
    /// share one wake-up of the generator, cheaper at high rates; the wait, up to `tick`,
    /// counts in their corrected latencies.
    pub tick: Duration,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            url: DEFAULT_URL.to_string(),
            model: DEFAULT_MODEL.to_string(),
            rate: DEFAULT_RATE,
            limit: Limit::Duration(Duration::from_secs_f64(DEFAULT_DURATION_S)),
            connections: DEFAULT_CONNECTIONS,
            threads: DEFAULT_THREADS,
            stream: false,
            prompt_tokens: DEFAULT_PROMPT_TOKENS,
            system_chars: DEFAULT_SYSTEM_CHARS,
            max_tokens: DEFAULT_MAX_TOKENS,
            seed: DEFAULT_SEED,
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
            max_lag: Duration::from_secs_f64(DEFAULT_MAX_LAG_MS / 1_000.0),
            tick: Duration::from_micros(DEFAULT_TICK_US),
            progress: false,
        }
    }
}

/// Errors that stop a run before it starts.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The URL is not `http://host[:port][/path]`.
    #[error(transparent)]
    BadUrl(#[from] BadUrl),
    /// The rate is not a positive finite number.
    #[error("rate must be > 0 req/s and finite, got {0}")]
    BadRate(f64),
    /// The run would schedule no request (zero duration or `Requests(0)`).
    #[error("the run schedules no request (duration or request count is 0)")]
    Empty,
    /// `connections` or `threads` is 0.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// The runtime or a timer could not be created.
    #[error("starting the load generator: {0}")]
    Io(#[from] std::io::Error),
}

/// The fixed-rate schedule: request `i` (0-based) is due `i / rate` seconds after the start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    rate: f64,
    len: u64,
}

impl Schedule {
    /// The schedule of `limit` at `rate` req/s: `Requests(n)` gives `n` requests; `Duration(d)`
    /// every `t_i = i / rate < d`, that is `⌈rate · d⌉` (a product within 1e-9 of an integer
    /// counts as that integer, so 1,000 req/s for 2 s is exactly 2,000).
    ///
    /// # Errors
    /// [`LoadError::BadRate`] for a rate that is not positive and finite; [`LoadError::Empty`]
    /// for no request.
    pub fn new(rate: f64, limit: Limit) -> Result<Self, LoadError> {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(LoadError::BadRate(rate));
        }
        let len = match limit {
            Limit::Requests(n) => n,
            Limit::Duration(d) => {
                let x = rate * d.as_secs_f64();
                let near = x.round();
                if (x - near).abs() < 1e-9 {
                    near as u64
                } else {
                    x.ceil() as u64
                }
            }
        };
        if len == 0 {
            return Err(LoadError::Empty);
        }
        Ok(Self { rate, len })
    }

    /// Number of requests scheduled.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: construction rejects an empty schedule.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rate, requests per second.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// `t_i = i / rate` after the start, rounded to the ns (exact for rates dividing 10⁹).
    pub fn offset(&self, i: u64) -> Duration {
        Duration::from_nanos((i as f64 * (1e9 / self.rate)).round() as u64)
    }

    /// `len / rate`: the schedule's length, the time one more request would be due.
    pub fn span(&self) -> Duration {
        self.offset(self.len)
    }
}

/// The request bodies of a run: `{"model":…,"max_tokens":…,"stream":…,"messages":[system?,
/// user]}`, the user content of request `i` being [`WordIds::block_text`]`(seed, i,
/// prompt_tokens)` (words with their leading space, no JSON escaping needed).
#[derive(Debug)]
pub struct Bodies {
    words: WordIds,
    seed: u32,
    prompt_tokens: usize,
    /// Everything up to the user content's opening quote.
    prefix: String,
}

/// Closes the user content, the message, the list and the object.
const BODY_SUFFIX: &str = "\"}]}";

impl Bodies {
    /// The bodies `cfg` asks for, with `words` as the vocabulary.
    pub fn new(words: WordIds, cfg: &LoadConfig) -> Self {
        let json = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
        let mut prefix = format!(
            "{{\"model\":{},\"max_tokens\":{},",
            json(&cfg.model),
            cfg.max_tokens
        );
        prefix.push_str(if cfg.stream {
            "\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        } else {
            "\"stream\":false,"
        });
        prefix.push_str("\"messages\":[");
        if cfg.system_chars > 0 {
            let system = system_prompt(&words, cfg.system_chars);
            let _ = write!(
                prefix,
                "{{\"role\":\"system\",\"content\":{}}},",
                json(&system)
            );
        }
        prefix.push_str("{\"role\":\"user\",\"content\":\"");
        Self {
            words,
            seed: cfg.seed,
            prompt_tokens: cfg.prompt_tokens as usize,
            prefix,
        }
    }

    /// Body of request `i`.
    pub fn body(&self, i: u64) -> Bytes {
        let mut s = String::with_capacity(self.prefix.len() + self.prompt_tokens * 9 + 4);
        s.push_str(&self.prefix);
        self.words
            .push_block_text(self.seed, i, self.prompt_tokens, &mut s);
        s.push_str(BODY_SUFFIX);
        Bytes::from(s.into_bytes())
    }
}

/// The shared system prompt: exactly `chars` characters of [`SYSTEM_PROMPT_BLOCK`]'s words,
/// without the first word's leading space.
pub fn system_prompt(words: &WordIds, chars: usize) -> String {
    // Every word is at least 4 characters with its space.
    let (ns, id) = SYSTEM_PROMPT_BLOCK;
    let text = words.block_text(ns, id, chars / 4 + 2);
    text[1..].chars().take(chars).collect()
}

/// Sleeps until an [`Instant`] to the µs: a Linux timerfd on `CLOCK_MONOTONIC` (the clock of
/// `Instant`) polled by tokio's reactor. tokio's own timer ticks in whole ms, which would send
/// a 10,000 req/s schedule in bursts of 10 and add up to 1 ms to every latency counted from
/// the schedule. Elsewhere, or if the timerfd cannot be made or armed, tokio's timer.
struct Pacer {
    #[cfg(target_os = "linux")]
    fd: Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
}

impl Pacer {
    fn new() -> Self {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::FromRawFd;
            // Safety: a plain syscall with constant arguments; a non-negative result is a new
            // descriptor that nothing else owns.
            let fd = unsafe {
                libc::timerfd_create(
                    libc::CLOCK_MONOTONIC,
                    libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
                )
            };
            let fd = (fd >= 0)
                // Safety: see above.
                .then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
                .and_then(|fd| {
                    // Safety: an `OwnedFd` is open, and the `AsyncFd` owns it (the same
                    // descriptor) until it is dropped.
                    unsafe {
                        tokio::io::unix::AsyncFd::register_with_interest(
                            fd,
                            tokio::io::Interest::READABLE,
                        )
                    }
                    .ok()
                });
            Self { fd }
        }
        #[cfg(not(target_os = "linux"))]
        Self {}
    }

    async fn sleep_until(&self, due: Instant) {
        let Some(wait) = due.checked_duration_since(Instant::now()) else {
            return;
        };
        if wait.is_zero() {
            return;
        }
        #[cfg(target_os = "linux")]
        if let Some(fd) = &self.fd
            && Self::timerfd_wait(fd, wait).await.is_ok()
        {
            return;
        }
        tokio::time::sleep_until(due.into()).await;
    }

    /// Arms `fd` to fire once after `wait` (> 0) and waits until it has.
    #[cfg(target_os = "linux")]
    async fn timerfd_wait(
        fd: &tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
        wait: Duration,
    ) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let spec = libc::itimerspec {
            it_interval: zero,
            it_value: libc::timespec {
                tv_sec: wait.as_secs() as libc::time_t,
                tv_nsec: wait.subsec_nanos() as libc::c_long,
            },
        };
        // Safety: `fd` is a timerfd we own; `spec` is a valid itimerspec for the call; the old
        // value is not asked for (null). Re-arming also resets the expiry count.
        let r = unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        loop {
            let mut guard = fd.readable().await?;
            let read = guard.try_io(|fd| {
                let mut ticks = [0u8; 8];
                // Safety: `ticks` is a valid 8-byte buffer, the size a timerfd read needs.
                let n = unsafe { libc::read(fd.as_raw_fd(), ticks.as_mut_ptr().cast(), 8) };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(())
                }
            });
            match read {
                Ok(result) => {
                    // The expiry is consumed: the timerfd is not readable until it is re-armed
                    // and fires, so the next wait need not find that out with a failed read.
                    guard.clear_ready();
                    return result;
                }
                Err(_would_block) => continue,
            }
        }
    }
}

/// CPU time of this process so far: (user, system).
fn process_cpu() -> (Duration, Duration) {
    #[cfg(unix)]
    {
        let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // Safety: RUSAGE_SELF with a valid pointer to a rusage to fill.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) } == 0 {
            // Safety: getrusage returned 0, so it filled the struct (zeroed before anyway).
            let ru = unsafe { ru.assume_init() };
            let tv = |t: libc::timeval| {
                Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
            };
            return (tv(ru.ru_utime), tv(ru.ru_stime));
        }
    }
    (Duration::ZERO, Duration::ZERO)
}

/// Why one request failed; [`Failure::kind`] names it in the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// TCP connect failed.
    Connect,
    /// The HTTP exchange failed (handshake, send, a reset or close mid-response).
    Transport,
    /// No whole answer within the timeout.
    Timeout,
    /// The answer's status was not 2xx.
    Status(u16),
    /// A stream carried an error event (`data: {"error"…`).
    StreamError,
    /// A stream ended without `data: [DONE]`.
    NoDone,
}

impl Failure {
    /// `connect`, `transport`, `timeout`, `status_<code>`, `stream_error`, `no_done` (the kinds
    /// of [`crate::replay::RequestSample::error`]).
    fn kind(self) -> String {
        match self {
            Self::Connect => "connect".into(),
            Self::Transport => "transport".into(),
            Self::Timeout => "timeout".into(),
            Self::Status(code) => format!("status_{code}"),
            Self::StreamError => "stream_error".into(),
            Self::NoDone => "no_done".into(),
        }
    }

    /// Whether the whole answer was read, so the connection may serve the next request.
    fn keeps_connection(self) -> bool {
        matches!(self, Self::Status(_) | Self::StreamError | Self::NoDone)
    }
}

/// What a streamed body held, scanned as it arrives without parsing its JSON (the generator
/// must stay cheap): whether a `data:` line has started, a `data: [DONE]` line, and a data
/// line whose payload starts `{"error"`. Only each line's first [`SCAN_HEAD`] bytes are kept.
#[derive(Debug, Default)]
struct SseScan {
    head: [u8; SCAN_HEAD],
    head_len: usize,
    line_len: usize,
    seen_data: bool,
    done: bool,
    error: bool,
}

/// Bytes kept of each SSE line: enough for `data: [DONE]\r` and `data: {"error"`.
const SCAN_HEAD: usize = 16;

impl SseScan {
    /// Feeds body bytes; true when they hold the start of the stream's first `data:` line.
    fn feed(&mut self, mut bytes: &[u8]) -> bool {
        let before = self.seen_data;
        while let Some(p) = memchr::memchr(b'\n', bytes) {
            self.take(&bytes[..p]);
            self.end_line();
            bytes = &bytes[p + 1..];
        }
        self.take(bytes);
        !before && self.seen_data
    }

    fn take(&mut self, part: &[u8]) {
        let n = part.len().min(SCAN_HEAD - self.head_len);
        self.head[self.head_len..self.head_len + n].copy_from_slice(&part[..n]);
        self.head_len += n;
        self.line_len += part.len();
        if !self.seen_data && self.head[..self.head_len].starts_with(b"data:") {
            self.seen_data = true;
        }
    }

    fn end_line(&mut self) {
        if let Some(data) = self.head[..self.head_len].strip_prefix(b"data:") {
            let data = data.trim_ascii();
            if self.line_len == self.head_len && data == b"[DONE]" {
                self.done = true;
            } else if data.starts_with(b"{\"error\"") {
                self.error = true;
            }
        }
        self.head_len = 0;
        self.line_len = 0;
    }
}

/// A whole answer: when it ended, and when its first `data:` line came (streams only).
struct Answer {
    first_data: Option<Instant>,
    end: Instant,
}

/// Sends `req` on `conn` and reads the whole answer.
async fn exchange(
    conn: &mut Conn,
    req: hyper::Request<Full<Bytes>>,
    stream: bool,
) -> Result<Answer, Failure> {
    let resp = conn
        .sender
        .send_request(req)
        .await
        .map_err(|_| Failure::Transport)?;
    let status = resp.status();
    let mut body = resp.into_body();
    let mut scan = SseScan::default();
    let mut first_data = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| Failure::Transport)?;
        if stream
            && let Some(data) = frame.data_ref()
            && scan.feed(data)
        {
            first_data = Some(Instant::now());
        }
    }
    let end = Instant::now();
    if !status.is_success() {
        Err(Failure::Status(status.as_u16()))
    } else if stream && scan.error {
        Err(Failure::StreamError)
    } else if stream && !scan.done {
        Err(Failure::NoDone)
    } else {
        Ok(Answer { first_data, end })
    }
}

/// The counts and histograms of one connection (merged into the report at the end).
struct Tally {
    corrected: Histogram<u64>,
    uncorrected: Histogram<u64>,
    first_corrected: Histogram<u64>,
    first_uncorrected: Histogram<u64>,
    send_lag: Histogram<u64>,
    sent: u64,
    ok: u64,
    unsent: u64,
    late: u64,
    late_generator: u64,
    errors: BTreeMap<String, u64>,
    last_send: Option<Instant>,
    last_end: Option<Instant>,
}

/// `d` in µs, clamped to what the histograms hold.
fn us(d: Duration) -> u64 {
    (d.as_micros().min(u128::from(MAX_RECORDED_LATENCY_US)) as u64).max(1)
}

impl Tally {
    fn new() -> Self {
        Self {
            corrected: new_hist(),
            uncorrected: new_hist(),
            first_corrected: new_hist(),
            first_uncorrected: new_hist(),
            send_lag: new_hist(),
            sent: 0,
            ok: 0,
            unsent: 0,
            late: 0,
            late_generator: 0,
            errors: BTreeMap::new(),
            last_send: None,
            last_end: None,
        }
    }

    /// A request due at `due`, to leave at `wake` (`due` on the wake-up grid), is sent at
    /// `sent` by a connection free since `free_at`. Its send lag counts from `due`; it is late
    /// when it left more than `max_lag` after `wake` (the grid's wait is by design), and late
    /// by the generator's fault when its connection was free by then too.
    fn on_send(
        &mut self,
        (due, wake): (Instant, Instant),
        free_at: Instant,
        sent: Instant,
        max_lag: Duration,
    ) {
        self.sent += 1;
        self.last_send = Some(sent);
        self.send_lag
            .saturating_record(us(sent.saturating_duration_since(due)));
        if sent.saturating_duration_since(wake) > max_lag {
            self.late += 1;
            if sent.saturating_duration_since(free_at.max(wake)) > max_lag {
                self.late_generator += 1;
            }
        }
    }

    fn on_answer(&mut self, due: Instant, sent: Instant, a: &Answer) {
        self.ok += 1;
        self.last_end = Some(a.end);
        self.corrected
            .saturating_record(us(a.end.saturating_duration_since(due)));
        self.uncorrected
            .saturating_record(us(a.end.saturating_duration_since(sent)));
        if let Some(first) = a.first_data {
            self.first_corrected
                .saturating_record(us(first.saturating_duration_since(due)));
            self.first_uncorrected
                .saturating_record(us(first.saturating_duration_since(sent)));
        }
    }

    fn on_failure(&mut self, f: Failure) {
        self.last_end = Some(Instant::now());
        *self.errors.entry(f.kind()).or_default() += 1;
    }

    fn merge(&mut self, o: Tally) {
        for (h, other) in [
            (&mut self.corrected, &o.corrected),
            (&mut self.uncorrected, &o.uncorrected),
            (&mut self.first_corrected, &o.first_corrected),
            (&mut self.first_uncorrected, &o.first_uncorrected),
            (&mut self.send_lag, &o.send_lag),
        ] {
            // Same bounds on both sides: adding never fails.
            let _ = h.add(other);
        }
        self.sent += o.sent;
        self.ok += o.ok;
        self.unsent += o.unsent;
        self.late += o.late;
        self.late_generator += o.late_generator;
        for (k, n) in o.errors {
            *self.errors.entry(k).or_default() += n;
        }
        self.last_send = self.last_send.max(o.last_send);
        self.last_end = self.last_end.max(o.last_end);
    }
}

/// What every connection of a run reads.
struct Shared {
    schedule: Schedule,
    start: Instant,
    /// Nothing is sent after this: the schedule's end plus the timeout.
    send_deadline: Instant,
    target: Target,
    bodies: Bodies,
    stream: bool,
    timeout: Duration,
    max_lag: Duration,
    /// Wake-up grid in ns (0: none).
    tick_ns: u128,
    /// Next request index to claim (may overshoot the schedule's length).
    next: AtomicU64,
    /// Requests finished (ok or error), for the progress bar.
    done: AtomicU64,
    /// Requests failed, for the progress bar.
    failed: AtomicU64,
}

/// `offset` rounded up to a multiple of `tick_ns` ns (unchanged when `tick_ns` is 0).
fn on_grid(offset: Duration, tick_ns: u128) -> Duration {
    if tick_ns == 0 {
        return offset;
    }
    let ns = offset.as_nanos().div_ceil(tick_ns) * tick_ns;
    Duration::from_nanos(ns.min(u128::from(u64::MAX)) as u64)
}

/// Opens a connection within `timeout`.
async fn open(target: &Target, timeout: Duration) -> Result<Conn, Failure> {
    match tokio::time::timeout(timeout, Conn::open(target)).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(ConnectError::Connect)) => Err(Failure::Connect),
        Ok(Err(ConnectError::Handshake)) => Err(Failure::Transport),
        Err(_) => Err(Failure::Timeout),
    }
}

/// One connection's loop: claim the next request, wait for its time, send it, read the whole
/// answer, repeat; ends when the schedule is exhausted or its send deadline has passed.
/// At most `schedule.len()` turns, each bounded by two connects and one exchange of at most
/// `timeout` each.
async fn connection(sh: Arc<Shared>, mut conn: Option<Conn>) -> Tally {
    let mut tally = Tally::new();
    let pacer = Pacer::new();
    let mut free_at = sh.start;
    loop {
        let i = sh.next.fetch_add(1, Ordering::Relaxed);
        if i >= sh.schedule.len() {
            break;
        }
        let offset = sh.schedule.offset(i);
        let times = (sh.start + offset, sh.start + on_grid(offset, sh.tick_ns));
        let due = times.0;
        // Built before the wait, so the send itself is on time.
        let req = sh.target.post_json(sh.bodies.body(i), sh.stream);
        pacer.sleep_until(times.1).await;
        if Instant::now() > sh.send_deadline {
            tally.unsent += 1;
            break;
        }
        let ready = match conn.as_mut() {
            Some(c) if c.sender.is_ready() => true,
            Some(c) => matches!(
                tokio::time::timeout(sh.timeout, c.sender.ready()).await,
                Ok(Ok(()))
            ),
            None => false,
        };
        if !ready {
            conn = match open(&sh.target, sh.timeout).await {
                Ok(c) => Some(c),
                Err(f) => {
                    // The request was tried: it counts as sent, and failed.
                    tally.on_send(times, free_at, Instant::now(), sh.max_lag);
                    tally.on_failure(f);
                    sh.failed.fetch_add(1, Ordering::Relaxed);
                    sh.done.fetch_add(1, Ordering::Relaxed);
                    free_at = Instant::now();
                    continue;
                }
            };
        }
        // Ready, or just opened: always a connection here.
        let Some(c) = conn.as_mut() else { continue };
        let sent = Instant::now();
        tally.on_send(times, free_at, sent, sh.max_lag);
        match tokio::time::timeout(sh.timeout, exchange(c, req, sh.stream)).await {
            Ok(Ok(answer)) => tally.on_answer(due, sent, &answer),
            Ok(Err(f)) => {
                tally.on_failure(f);
                sh.failed.fetch_add(1, Ordering::Relaxed);
                if !f.keeps_connection() {
                    conn = None;
                }
            }
            Err(_) => {
                tally.on_failure(Failure::Timeout);
                sh.failed.fetch_add(1, Ordering::Relaxed);
                conn = None;
            }
        }
        sh.done.fetch_add(1, Ordering::Relaxed);
        if conn.as_ref().is_some_and(|c| c.sender.is_closed()) {
            conn = None;
        }
        if conn.is_none() {
            // Reconnect now, while no request waits, rather than at the next one's time.
            conn = open(&sh.target, sh.timeout).await.ok();
        }
        free_at = Instant::now();
    }
    tally
}

/// The outcome of a run; serialises to JSON for `--out`. Latencies are in ms.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// Target URL as given.
    pub url: String,
    /// Request path sent.
    pub path: String,
    /// `model` sent.
    pub model: String,
    /// Scheduled rate, requests per second.
    pub rate: f64,
    /// Requests scheduled.
    pub scheduled: u64,
    /// Length of the schedule (`scheduled / rate`), s.
    pub schedule_s: f64,
    /// Keep-alive connections.
    pub connections: usize,
    /// Runtime threads of the generator.
    pub threads: usize,
    /// Requests were streams.
    pub stream: bool,
    /// User message length, words.
    pub prompt_tokens: u32,
    /// System prompt length, characters.
    pub system_chars: usize,
    /// `max_tokens` sent.
    pub max_tokens: u32,
    /// Per-request timeout, ms.
    pub timeout_ms: u64,
    /// Lateness bound, ms: a request sent later than this after its time counts in `late`.
    pub max_lag_ms: f64,
    /// Wake-up grid, µs (0: every request at its own time).
    pub tick_us: u64,
    /// Requests sent (or whose connect was tried): `ok + errors`.
    pub sent: u64,
    /// Requests answered 2xx in full (a stream: with `data: [DONE]` and no error event).
    pub ok: u64,
    /// Requests failed: `sent − ok`.
    pub errors: u64,
    /// Failures per kind: `connect`, `transport`, `timeout`, `status_<code>`,
    /// `stream_error`, `no_done`.
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Requests scheduled but never sent (the send deadline passed): `scheduled − sent`.
    pub unsent: u64,
    /// Start to the last answer (or failure), s.
    pub wall_s: f64,
    /// Send rate achieved: `sent / (last send − start + 1/rate)`, requests per second (the
    /// rate itself when every request left on time).
    pub achieved_rate: f64,
    /// Answers per second: `ok / wall_s`.
    pub ok_rate: f64,
    /// Scheduled time to the answer's end, ok requests.
    pub corrected_ms: LatencySummary,
    /// Send to the answer's end (service time), ok requests.
    pub uncorrected_ms: LatencySummary,
    /// Scheduled time to the first SSE `data:` line, ok streams.
    pub first_chunk_corrected_ms: LatencySummary,
    /// Send to the first SSE `data:` line, ok streams.
    pub first_chunk_uncorrected_ms: LatencySummary,
    /// Send minus scheduled time, every sent request.
    pub send_lag_ms: LatencySummary,
    /// Requests sent more than `max_lag_ms` after their scheduled time.
    pub late: u64,
    /// Of `late`, those whose connection had been free for more than `max_lag_ms` after
    /// their time too: the generator itself was behind.
    pub late_generator: u64,
    /// User CPU of the process during the run, s.
    pub cpu_user_s: f64,
    /// System CPU of the process during the run, s.
    pub cpu_sys_s: f64,
    /// `(cpu_user_s + cpu_sys_s) / sent`, µs per request.
    pub cpu_us_per_request: f64,
    /// `(cpu_user_s + cpu_sys_s) / wall_s`, cores busy on average.
    pub cpu_cores: f64,
    /// What went wrong with the schedule, in words (empty when nothing did).
    pub warnings: Vec<String>,
}

/// Runs `cfg` on a runtime of its own (`cfg.threads` threads) and reports. Must not be called
/// from inside a tokio runtime.
///
/// # Errors
/// - [`LoadError::BadUrl`], [`LoadError::BadRate`], [`LoadError::Empty`],
///   [`LoadError::Zero`]: a bad setting.
/// - [`LoadError::Io`]: the runtime could not be built.
///
/// Request failures are not errors: they are counted in the report.
pub fn run(cfg: &LoadConfig, words: WordIds) -> Result<LoadReport, LoadError> {
    let schedule = Schedule::new(cfg.rate, cfg.limit)?;
    if cfg.connections == 0 {
        return Err(LoadError::Zero("connections"));
    }
    if cfg.threads == 0 {
        return Err(LoadError::Zero("threads"));
    }
    let target = Target::parse(&cfg.url, |p| {
        if p.is_empty() {
            CHAT_COMPLETIONS_PATH.to_string()
        } else {
            p.to_string()
        }
    })?;
    let bodies = Bodies::new(words, cfg);
    let rt = if cfg.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.threads)
            .enable_all()
            .build()?
    };
    Ok(rt.block_on(run_in(cfg, schedule, target, bodies)))
}

async fn run_in(
    cfg: &LoadConfig,
    schedule: Schedule,
    target: Target,
    bodies: Bodies,
) -> LoadReport {
    // Connect first, so no request pays for a connect it would not pay in steady state.
    let conns: Vec<Option<Conn>> = futures_util::future::join_all(
        (0..cfg.connections).map(|_| async { open(&target, cfg.timeout).await.ok() }),
    )
    .await;
    let bar = if cfg.progress {
        let b = ProgressBar::with_draw_target(Some(schedule.len()), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
        {
            b.set_style(style.progress_chars("=> "));
        }
        b
    } else {
        ProgressBar::hidden()
    };
    let path = target.path.to_string();
    let cpu0 = process_cpu();
    let start = Instant::now();
    let sh = Arc::new(Shared {
        schedule,
        start,
        send_deadline: start + schedule.span() + cfg.timeout,
        target,
        bodies,
        stream: cfg.stream,
        timeout: cfg.timeout,
        max_lag: cfg.max_lag,
        tick_ns: cfg.tick.as_nanos(),
        next: AtomicU64::new(0),
        done: AtomicU64::new(0),
        failed: AtomicU64::new(0),
    });
    let mut tasks = tokio::task::JoinSet::new();
    for conn in conns {
        tasks.spawn(connection(Arc::clone(&sh), conn));
    }
    let ticker = {
        let (sh, bar) = (Arc::clone(&sh), bar.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(PROGRESS_TICK_MS));
            loop {
                tick.tick().await;
                bar.set_position(sh.done.load(Ordering::Relaxed));
                bar.set_message(format!(
                    "done, {} errors",
                    sh.failed.load(Ordering::Relaxed)
                ));
            }
        })
    };
    let mut total = Tally::new();
    let mut panicked = 0;
    while let Some(t) = tasks.join_next().await {
        match t {
            Ok(t) => total.merge(t),
            Err(_) => panicked += 1,
        }
    }
    ticker.abort();
    bar.finish_and_clear();
    let cpu1 = process_cpu();
    let claimed = sh.next.load(Ordering::Relaxed).min(schedule.len());
    total.unsent += schedule.len() - claimed;
    let mut rep = report(cfg, &sh, path, total, (cpu1.0 - cpu0.0, cpu1.1 - cpu0.1));
    if panicked > 0 {
        rep.warnings.push(format!(
            "{panicked} connection task(s) panicked: their requests are missing from the counts"
        ));
    }
    rep
}

fn report(
    cfg: &LoadConfig,
    sh: &Shared,
    path: String,
    t: Tally,
    (user, sys): (Duration, Duration),
) -> LoadReport {
    let secs =
        |i: Option<Instant>| i.map_or(0.0, |i| i.saturating_duration_since(sh.start).as_secs_f64());
    let rate = sh.schedule.rate();
    let wall_s = secs(t.last_end);
    let errors: u64 = t.errors.values().sum();
    let cpu = (user + sys).as_secs_f64();
    let mut rep = LoadReport {
        url: cfg.url.clone(),
        path,
        model: cfg.model.clone(),
        rate,
        scheduled: sh.schedule.len(),
        schedule_s: sh.schedule.span().as_secs_f64(),
        connections: cfg.connections,
        threads: cfg.threads,
        stream: cfg.stream,
        prompt_tokens: cfg.prompt_tokens,
        system_chars: cfg.system_chars,
        max_tokens: cfg.max_tokens,
        timeout_ms: cfg.timeout.as_millis() as u64,
        max_lag_ms: cfg.max_lag.as_secs_f64() * 1e3,
        tick_us: cfg.tick.as_micros() as u64,
        sent: t.sent,
        ok: t.ok,
        errors,
        errors_by_kind: t.errors,
        unsent: t.unsent,
        wall_s,
        achieved_rate: if t.sent == 0 {
            0.0
        } else {
            t.sent as f64 / (secs(t.last_send) + 1.0 / rate)
        },
        ok_rate: if wall_s > 0.0 {
            t.ok as f64 / wall_s
        } else {
            0.0
        },
        corrected_ms: LatencySummary::from_hist(&t.corrected),
        uncorrected_ms: LatencySummary::from_hist(&t.uncorrected),
        first_chunk_corrected_ms: LatencySummary::from_hist(&t.first_corrected),
        first_chunk_uncorrected_ms: LatencySummary::from_hist(&t.first_uncorrected),
        send_lag_ms: LatencySummary::from_hist(&t.send_lag),
        late: t.late,
        late_generator: t.late_generator,
        cpu_user_s: user.as_secs_f64(),
        cpu_sys_s: sys.as_secs_f64(),
        cpu_us_per_request: if t.sent == 0 {
            0.0
        } else {
            cpu * 1e6 / t.sent as f64
        },
        cpu_cores: if wall_s > 0.0 { cpu / wall_s } else { 0.0 },
        warnings: Vec::new(),
    };
    rep.warnings = warnings(&rep);
    rep
}

/// The report's statements about the schedule: requests sent late (and why), requests never
/// sent, a generator near its CPU limit while behind.
fn warnings(r: &LoadReport) -> Vec<String> {
    let mut w = Vec::new();
    if r.late > 0 {
        w.push(format!(
            "behind schedule: {} of {} requests left more than {:.3} ms after their scheduled \
             time (send lag max {:.3} ms); achieved {:.1} req/s of {} req/s. {} of them while a \
             connection was free (the generator was late), {} waiting for one of the {} \
             connections (the target is slower than the rate, or needs more connections). \
             Corrected latencies include the wait.",
            r.late,
            r.sent,
            r.max_lag_ms,
            r.send_lag_ms.max,
            r.achieved_rate,
            r.rate,
            r.late_generator,
            r.late - r.late_generator,
            r.connections
        ));
        if r.cpu_cores >= 0.9 * r.threads as f64 {
            w.push(format!(
                "the generator used {:.2} cores of its {} thread(s): it may be the bottleneck",
                r.cpu_cores, r.threads
            ));
        }
    }
    if r.unsent > 0 {
        w.push(format!(
            "{} of {} scheduled requests were never sent: nothing is sent later than the \
             timeout ({} ms) after the schedule's end",
            r.unsent, r.scheduled, r.timeout_ms
        ));
    }
    w
}

impl LoadReport {
    /// The summary table: counts, rates, latency percentiles (ms, 3 decimals), the
    /// generator's CPU and the warnings.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "load: {} req/s for {:.3} s ({} requests) over {} connections to {} ({}, {} prompt \
             tokens, {} system chars, max_tokens {})",
            self.rate,
            self.schedule_s,
            self.scheduled,
            self.connections,
            self.url,
            if self.stream { "stream" } else { "no stream" },
            self.prompt_tokens,
            self.system_chars,
            self.max_tokens
        );
        let _ = writeln!(
            s,
            "  sent {}   ok {}   errors {}   unsent {}",
            self.sent, self.ok, self.errors, self.unsent
        );
        for (kind, n) in &self.errors_by_kind {
            let _ = writeln!(s, "    {kind:<16} {n}");
        }
        let _ = writeln!(
            s,
            "  achieved {:.1} req/s sent, {:.1} req/s ok; wall {:.3} s",
            self.achieved_rate, self.ok_rate, self.wall_s
        );
        let _ = writeln!(
            s,
            "  {:<26} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "latency ms", "count", "p50", "p90", "p99", "p99.9", "max", "mean"
        );
        for (name, l) in [
            ("corrected", &self.corrected_ms),
            ("uncorrected", &self.uncorrected_ms),
            ("first chunk, corrected", &self.first_chunk_corrected_ms),
            ("first chunk, uncorrected", &self.first_chunk_uncorrected_ms),
            ("send lag", &self.send_lag_ms),
        ] {
            if l.count == 0 {
                continue;
            }
            let _ = writeln!(
                s,
                "  {:<26} {:>9} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}",
                name, l.count, l.p50, l.p90, l.p99, l.p999, l.max, l.mean
            );
        }
        let _ = writeln!(
            s,
            "  generator CPU {:.3} s user + {:.3} s sys = {:.2} µs per request ({:.2} cores)",
            self.cpu_user_s, self.cpu_sys_s, self.cpu_us_per_request, self.cpu_cores
        );
        for w in &self.warnings {
            let _ = writeln!(s, "  WARNING: {w}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn schedule_has_rate_times_duration_requests_at_i_over_rate() {
        let s = Schedule::new(1_000.0, Limit::Duration(Duration::from_secs(2))).unwrap();
        assert_eq!(s.len(), 2_000);
        for i in 0..s.len() {
            assert_eq!(s.offset(i), ms(i), "t_{i}");
        }
        assert_eq!(s.span(), Duration::from_secs(2));

        let s = Schedule::new(3.0, Limit::Duration(Duration::from_secs(1))).unwrap();
        let times: Vec<u64> = (0..s.len())
            .map(|i| s.offset(i).as_nanos() as u64)
            .collect();
        assert_eq!(times, [0, 333_333_333, 666_666_667]);

        // 0.5 req/s for 3 s: t = 0 and 2 s are before 3 s, 4 s is not.
        let s = Schedule::new(0.5, Limit::Duration(Duration::from_secs(3))).unwrap();
        assert_eq!((s.len(), s.offset(1)), (2, Duration::from_secs(2)));

        // 7 req/s for 0.3 s: 2.1 → 3 requests (0, 1/7, 2/7 s all < 0.3 s).
        assert_eq!(
            Schedule::new(7.0, Limit::Duration(ms(300))).unwrap().len(),
            3
        );

        // 2,500 req/s for 10 s: the float product 25,000.000000000004 is 25,000.
        let s = Schedule::new(2_500.0, Limit::Duration(Duration::from_secs(10))).unwrap();
        assert_eq!(
            (s.len(), s.offset(24_999)),
            (25_000, Duration::from_micros(9_999_600))
        );

        let s = Schedule::new(10.0, Limit::Requests(5)).unwrap();
        let times: Vec<Duration> = (0..s.len()).map(|i| s.offset(i)).collect();
        assert_eq!(times, [ms(0), ms(100), ms(200), ms(300), ms(400)]);
        assert_eq!(s.span(), ms(500));
    }

    #[test]
    fn the_wake_up_grid_rounds_up_to_its_tick() {
        let us = Duration::from_micros;
        assert_eq!(on_grid(us(1_234), 0), us(1_234));
        let tick = 1_000_000; // 1 ms in ns
        let got: Vec<Duration> = [0, 1, 999, 1_000, 1_001, 2_500]
            .into_iter()
            .map(|t| on_grid(us(t), tick))
            .collect();
        assert_eq!(
            got,
            [us(0), us(1_000), us(1_000), us(1_000), us(2_000), us(3_000)]
        );
    }

    #[test]
    fn schedule_rejects_bad_rates_and_empty_runs() {
        for r in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                Schedule::new(r, Limit::Requests(1)),
                Err(LoadError::BadRate(_))
            ));
        }
        assert!(matches!(
            Schedule::new(10.0, Limit::Requests(0)),
            Err(LoadError::Empty)
        ));
        assert!(matches!(
            Schedule::new(10.0, Limit::Duration(Duration::ZERO)),
            Err(LoadError::Empty)
        ));
    }

    #[test]
    fn sse_scan_finds_first_data_done_and_errors_across_splits() {
        let stream = b": ping\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\r\n\r\n\
            data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        for split in 1..stream.len() {
            let mut scan = SseScan::default();
            let hits: Vec<bool> = stream.chunks(split).map(|c| scan.feed(c)).collect();
            // Exactly one chunk completes the first data line's `data:`: the one holding byte
            // 12 (its `:`; the line starts at byte 8, after `: ping\n\n`).
            let at = 12 / split;
            let want: Vec<bool> = (0..hits.len()).map(|k| k == at).collect();
            assert_eq!(hits, want, "split {split}");
            assert!(scan.done && !scan.error, "split {split}");
        }
        let mut scan = SseScan::default();
        scan.feed(b"data: {\"error\":{\"message\":\"boom\"}}\n\ndata: [DONE]\n\n");
        assert!(scan.error && scan.done);
        let mut scan = SseScan::default();
        scan.feed(b"data: [DONE] and more\n: [DONE]\ndata:[DONE]x\n");
        assert!(!scan.done && !scan.error && scan.seen_data);
    }

    fn toy_words() -> WordIds {
        let vocab = ["Ġalpha", "Ġbravo", "Ġcharlie", "Ġdelta", "Ġecho"];
        WordIds::from_vocab(vocab.iter().enumerate().map(|(i, w)| (i as u32, *w))).unwrap()
    }

    #[test]
    fn bodies_are_chat_requests_of_the_asked_size() {
        let cfg = LoadConfig {
            model: "m\"x".into(),
            stream: true,
            prompt_tokens: 5,
            system_chars: 30,
            max_tokens: 7,
            seed: 3,
            ..LoadConfig::default()
        };
        let bodies = Bodies::new(toy_words(), &cfg);
        let v: serde_json::Value = serde_json::from_slice(&bodies.body(9)).unwrap();
        assert_eq!(v["model"], "m\"x");
        assert_eq!(
            (v["max_tokens"].as_u64(), v["stream"].as_bool()),
            (Some(7), Some(true))
        );
        assert_eq!(v["stream_options"]["include_usage"], true);
        let system = v["messages"][0]["content"].as_str().unwrap();
        assert_eq!(system.len(), 30);
        assert_eq!(system, system_prompt(&toy_words(), 30));
        let user = v["messages"][1]["content"].as_str().unwrap();
        assert_eq!(user, toy_words().block_text(3, 9, 5));
        assert_eq!(user.split_whitespace().count(), 5);
        // Same system prompt for every request and seed, a new user text for each request.
        let other: serde_json::Value = serde_json::from_slice(&bodies.body(10)).unwrap();
        assert_eq!(other["messages"][0], v["messages"][0]);
        assert_ne!(other["messages"][1], v["messages"][1]);

        let plain = Bodies::new(toy_words(), &LoadConfig::default());
        let v: serde_json::Value = serde_json::from_slice(&plain.body(0)).unwrap();
        assert_eq!(v["stream"], false);
        assert_eq!(v["messages"].as_array().unwrap().len(), 1);
        assert_eq!(v["messages"][0]["role"], "user");
        assert_eq!(v["max_tokens"], u64::from(DEFAULT_MAX_TOKENS));
    }
}
