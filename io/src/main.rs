//! The `kvroute` binary: `serve` (the gateway), `engine` (a simulated vLLM-like worker),
//! `replay` (a Mooncake-format trace against a URL), `load` (fixed-rate load against a URL)
//! and `demo` (all of it on loopback).

use anyhow::Context;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use kvroute_core::config::{Config, defaults};
use kvroute_io::gateway;

#[cfg(feature = "bench")]
mod demo;
#[cfg(feature = "bench")]
mod fleet;
#[cfg(feature = "bench")]
mod simulate;
use std::path::PathBuf;

#[global_allocator]
static GLOBAL: kvroute_io::alloc::RecentFirst = kvroute_io::alloc::RecentFirst;

/// kvroute: a KV-cache-aware router for LLM inference fleets.
#[derive(Parser, Debug)]
#[command(name = "kvroute", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the gateway in front of workers.
    Serve(Box<ServeArgs>),
    #[cfg(feature = "bench")]
    /// Run one simulated vLLM-like engine.
    Engine(EngineArgs),
    #[cfg(feature = "bench")]
    /// Replay a Mooncake-format trace (or the built-in workload) against a URL.
    Replay(ReplayArgs),
    #[cfg(feature = "bench")]
    /// Fixed-rate load in the wrk2 sense: chat requests scheduled at a constant rate over
    /// keep-alive connections, latency counted from each request's scheduled time.
    Load(LoadArgs),
    #[cfg(feature = "bench")]
    /// Start 4 engines and the router on loopback, replay a workload once per policy, print
    /// a comparison table.
    Demo(demo::DemoArgs),
    #[cfg(feature = "bench")]
    /// The demo's comparison on the discrete-event simulator: the same router policy and
    /// engine model on a virtual clock, deterministic, about a second per run.
    Simulate(simulate::SimulateArgs),
    #[cfg(feature = "bench")]
    /// Short benchmark runs (< 60 s each) that print and write JSON.
    Bench(BenchArgs),
}

#[cfg(feature = "bench")]
/// Flags of `kvroute bench`.
#[derive(Args, Debug)]
struct BenchArgs {
    /// Which benchmark.
    #[arg(value_enum)]
    what: BenchWhat,
    /// Write the JSON report to this file (`fleet`: only the keys of issue 16).
    #[arg(long)]
    out: Option<PathBuf>,
    /// `fleet`: workers.
    #[arg(long, default_value_t = kvroute_bench::fleet_bench::DEFAULT_WORKERS)]
    workers: usize,
    /// `fleet`: prompt tokens.
    #[arg(long, default_value_t = kvroute_bench::fleet_bench::DEFAULT_TOKENS)]
    tokens: usize,
    /// `fleet`: seconds of events and decisions after the fill.
    #[arg(long, default_value_t = kvroute_bench::fleet_bench::DEFAULT_SECONDS)]
    seconds: f64,
}

#[cfg(feature = "bench")]
/// The benchmarks of `kvroute bench`.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum BenchWhat {
    /// The cache indexes against naive baselines (issue 3).
    Index,
    /// Full vs incremental tokenization (issue 4).
    Tokenize,
    /// One whole token-mode routing decision, stage by stage (issue 15).
    Decision,
    /// Whole decisions on a fleet-sized event index while it ingests every worker's events
    /// (issue 16).
    Fleet,
}

/// Flags of `kvroute serve`. Each overrides the same key of `--config`; unset flags keep the
/// file's value, and unset keys keep the default of `kvroute_core::config::defaults`.
#[derive(Args, Debug, Default)]
struct ServeArgs {
    /// TOML config file (keys as the long flags, with `_`; `workers = [..]`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Address to listen on, HOST:PORT.
    #[arg(long)]
    listen: Option<String>,
    /// Shard threads, one per core [default: the CPUs this process may use: affinity mask
    /// and cgroup quota].
    #[arg(long)]
    shards: Option<usize>,
    /// Pin each shard to a core: true or false [default: auto, pinned unless a cgroup CPU
    /// quota is below the cores of the affinity mask].
    #[arg(long)]
    pin_shards: Option<bool>,
    /// Worker, `http://HOST:PORT[;OPTION]...` (repeatable; quote it for the shell). Options:
    /// `model=NAME` (repeatable; else its /v1/models), `events=tcp://HOST:PORT` (its KV-event
    /// publisher), `replay=tcp://HOST:PORT` (its replay endpoint), `dp=N` (DP ranks
    /// publishing on ports events+0..N), `api_key_env=VAR` (its bearer key from $VAR).
    #[arg(long = "worker", value_name = "URL[;OPTION]...")]
    workers: Vec<String>,
    /// Workers from DNS (repeatable): NAME:PORT (every A/AAAA address is a worker
    /// http://ADDR:PORT; a headless Kubernetes service) or srv:NAME (SRV: target and port per
    /// record), then ;events_port=P;replay_port=P;dp=N;model=NAME;api_key_env=VAR for every
    /// worker of it. Looked up again every --dns-refresh-secs; a failed lookup keeps the last
    /// good set.
    #[arg(long = "worker-dns", value_name = "NAME:PORT|srv:NAME")]
    worker_dns: Vec<String>,
    /// Look every --worker-dns source up again this often, s.
    #[arg(long)]
    dns_refresh_secs: Option<u64>,
    /// Most addresses taken from one --worker-dns answer (the lowest are kept).
    #[arg(long)]
    dns_max_addresses: Option<usize>,
    /// Nameserver for --worker-dns, IP:PORT [default: the system's: getaddrinfo for A/AAAA,
    /// /etc/resolv.conf for SRV].
    #[arg(long, value_name = "IP:PORT")]
    dns_server: Option<String>,
    /// Replica sync: share load and placements with the other kvroute replicas of this
    /// fleet through this NATS server, nats://HOST:PORT (comma-separated for a cluster)
    /// [default: off].
    #[arg(long = "nats", value_name = "URL")]
    nats_url: Option<String>,
    /// Replica sync: subject prefix (messages go on PREFIX.sync); one per fleet.
    #[arg(long)]
    nats_subject_prefix: Option<String>,
    /// Routing policy: round_robin, random, least_request, power_of_two, least_load,
    /// cache_aware, kv_aware, prefix_hash, consistent_hash, pure_affinity, predicted_ttft, or
    /// a preset: smg_cache_aware, dynamo_kv.
    #[arg(long)]
    policy: Option<String>,
    /// A policy knob, NAME=VALUE (repeatable; names as the `[knobs]` keys of the config
    /// file: overlap_decay, selection_temperature, overlap_score_credit, prefill_load_scale,
    /// kv_overlap_weight, prefix_hash_tokens, hash_load_factor, ttft_prefill_weight, ...).
    #[arg(long = "knob", value_name = "NAME=VALUE")]
    knobs: Vec<String>,
    /// cache_aware: match ratio (matched chars / request chars) above which the prefix
    /// holders are the candidates; every policy on KV events: the lead in share of the
    /// prompt that pins a request to one DP rank of its worker.
    #[arg(long)]
    cache_threshold: Option<f64>,
    /// Spill gate: a candidate is hot above this multiple of the mean in-flight count...
    #[arg(long)]
    balance_rel_threshold: Option<f64>,
    /// ...and above the mean plus this many in-flight requests.
    #[arg(long)]
    balance_abs_threshold: Option<usize>,
    /// Per-model string tree budget, chars.
    #[arg(long = "max-tree-size")]
    max_tree_size_chars: Option<usize>,
    /// Tokenizer for token-mode routing of every model: a HF tokenizer.json, a directory
    /// with it and tokenizer_config.json (chat template), or `builtin:qwen3` (embedded).
    /// Loaded once; no network.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Tokenizer of one model, NAME=PATH (repeatable); wins over --tokenizer for that model.
    #[arg(long = "model", value_name = "NAME=PATH")]
    models: Vec<String>,
    /// Incremental-tokenization prefix cache per model, shared by all shards, tokens (0 = off).
    #[arg(long)]
    tokenize_cache_tokens: Option<usize>,
    /// Largest request body, bytes (413 above).
    #[arg(long)]
    max_body_bytes: Option<usize>,
    /// Time allowed for one exchange with a worker, s (504 after).
    #[arg(long)]
    request_timeout_secs: Option<u64>,
    /// Longest silence of a worker once its response body began, s (then it failed mid-stream).
    #[arg(long)]
    stream_idle_timeout_secs: Option<u64>,
    /// Idle upstream connections are closed after this many ms.
    #[arg(long)]
    upstream_idle_timeout_ms: Option<u64>,
    /// Time allowed to connect to a worker, ms (502 after).
    #[arg(long)]
    connect_timeout_ms: Option<u64>,
    /// Read every worker's `/metrics` this often, ms, and add the requests it runs or queues
    /// for others (other router replicas, direct clients) to its load; 0 = off.
    #[arg(long)]
    load_poll_ms: Option<u64>,
    /// Token tree budget per model, tokens.
    #[arg(long)]
    max_tree_size_tokens: Option<usize>,
    /// Tokens per KV block (page) of the token indexes; must equal the engines' block size.
    #[arg(long)]
    block_size: Option<usize>,
    /// cache_aware index for token requests: tree, or hash (exact heads at --cache-boundaries).
    #[arg(long, value_parser = parse_cache_index)]
    cache_index: Option<kvroute_core::config::CacheIndexKind>,
    /// Hash index: token boundaries to record and probe, strictly ascending (comma-separated).
    #[arg(long, value_delimiter = ',')]
    cache_boundaries: Vec<usize>,
    /// Hash index: seconds a recorded head stays valid.
    #[arg(long)]
    cache_ttl_secs: Option<u64>,
    /// Event index: drop entries untouched for this many seconds [default: never].
    #[arg(long)]
    kv_indexer_ttl_secs: Option<u64>,
    /// Event index: most entries per model, pruned to 90 % when exceeded [default: no cap].
    #[arg(long)]
    kv_indexer_max_entries: Option<usize>,
    /// Use the epoll driver even where io_uring works.
    #[arg(long)]
    force_epoll: bool,
    /// Active health checks (`GET /health` of every worker) every this many s; 0 = off.
    #[arg(long)]
    health_check_interval_secs: Option<u64>,
    /// Time allowed per health check, s.
    #[arg(long)]
    health_check_timeout_secs: Option<u64>,
    /// Failed health checks in a row that make a worker unhealthy.
    #[arg(long)]
    health_failure_threshold: Option<u32>,
    /// Passed health checks in a row that make it healthy again.
    #[arg(long)]
    health_success_threshold: Option<u32>,
    /// Consecutive failed attempts that open a worker's circuit breaker.
    #[arg(long)]
    breaker_failure_threshold: Option<u32>,
    /// Failures further apart than this do not add up, s.
    #[arg(long)]
    breaker_window_secs: Option<u64>,
    /// An open breaker keeps its worker out this long, s.
    #[arg(long)]
    breaker_open_secs: Option<u64>,
    /// Half-open successes that close the breaker.
    #[arg(long)]
    breaker_success_threshold: Option<u32>,
    /// Retries of a request on other workers before the client sees a byte; 0 = none.
    #[arg(long)]
    retry_max: Option<u32>,
    /// Wait before the first retry, ms.
    #[arg(long)]
    retry_initial_backoff_ms: Option<u64>,
    /// Growth of the wait per retry.
    #[arg(long)]
    retry_backoff_multiplier: Option<f64>,
    /// Largest wait between retries, ms.
    #[arg(long)]
    retry_max_backoff_ms: Option<u64>,
    /// Relative jitter of each wait.
    #[arg(long)]
    retry_jitter: Option<f64>,
    /// Retries earned per request in the fleet-wide retry budget.
    #[arg(long)]
    retry_budget_ratio: Option<f64>,
    /// Retries the budget may bank.
    #[arg(long)]
    retry_budget_cap: Option<u32>,
    /// No new attempt starts later than this after the request arrived, s.
    #[arg(long)]
    retry_deadline_secs: Option<u64>,
    /// Time allowed for a worker's first response byte, s (then the attempt is retried
    /// elsewhere, or 504).
    #[arg(long)]
    first_byte_timeout_secs: Option<u64>,
    /// Migrate a generation whose worker fails mid-stream to another worker, at most this
    /// many times per request; 0 = off (the stream ends with an error event).
    #[arg(long)]
    migration_limit: Option<u32>,
    /// After SIGTERM/SIGINT, in-flight exchanges may finish for this long, s.
    #[arg(long)]
    shutdown_timeout_secs: Option<u64>,
    /// Admin API address, HOST:PORT ("" = no admin API).
    #[arg(long)]
    admin_listen: Option<String>,
    /// Bearer key of the admin API (required unless it listens on loopback).
    #[arg(long, env = "KVROUTE_ADMIN_API_KEY", hide_env_values = true)]
    admin_api_key: Option<String>,
    /// A client API key (repeatable): inference and model routes need
    /// `Authorization: Bearer KEY` [default: no authentication].
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
    /// A file of client API keys, one per line (`#` comments).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Also name the worker's URL in `x-kvroute-worker-url` (only its id otherwise).
    #[arg(long)]
    expose_worker_url: bool,
    /// Time for a client's request head, s (408 after).
    #[arg(long)]
    client_header_timeout_secs: Option<u64>,
    /// Time between two reads of a request body, s (408 after).
    #[arg(long)]
    client_body_timeout_secs: Option<u64>,
    /// Idle keep-alive client connections close after this, s.
    #[arg(long)]
    client_idle_timeout_secs: Option<u64>,
    /// Client connections one shard serves at once (503 above).
    #[arg(long)]
    max_connections_per_shard: Option<usize>,
    /// Log format: text or json (text carries colour only on a terminal).
    #[arg(long, value_parser = parse_log_format)]
    log_format: Option<kvroute_core::config::LogFormat>,
}

impl ServeArgs {
    /// The config file (or the defaults) with the flags laid over it.
    fn into_config(self) -> anyhow::Result<Config> {
        let mut cfg = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                Config::from_toml_str(&text).with_context(|| format!("in {}", path.display()))?
            }
            None => Config::default(),
        };
        if let Some(v) = self.listen {
            cfg.listen = v;
        }
        if self.shards.is_some() {
            cfg.shards = self.shards;
        }
        if self.pin_shards.is_some() {
            cfg.pin_shards = self.pin_shards;
        }
        if !self.workers.is_empty() {
            cfg.workers = self.workers;
        }
        if !self.worker_dns.is_empty() {
            cfg.worker_dns = self.worker_dns;
        }
        if self.dns_server.is_some() {
            cfg.dns_server = self.dns_server;
        }
        if let Some(v) = self.policy {
            cfg.policy = v.parse().map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
        }
        cfg.knobs
            .set_all(&self.knobs)
            .map_err(|e| anyhow::anyhow!("--knob: {e}"))?;
        if let Some(v) = self.cache_threshold {
            cfg.cache_threshold = v;
        }
        if let Some(v) = self.balance_rel_threshold {
            cfg.balance_rel_threshold = v;
        }
        if let Some(v) = self.balance_abs_threshold {
            cfg.balance_abs_threshold = v;
        }
        if let Some(v) = self.max_tree_size_chars {
            cfg.max_tree_size_chars = v;
        }
        if let Some(v) = self.tokenizer {
            cfg.tokenizer = Some(v);
        }
        for m in self.models {
            let (name, path) = m
                .split_once('=')
                .filter(|(n, p)| !n.is_empty() && !p.is_empty())
                .ok_or_else(|| anyhow::anyhow!("--model {m:?}: expected NAME=PATH"))?;
            cfg.models.insert(name.to_string(), PathBuf::from(path));
        }
        if let Some(v) = self.tokenize_cache_tokens {
            cfg.tokenize_cache_tokens = v;
        }
        if let Some(v) = self.max_body_bytes {
            cfg.max_body_bytes = v;
        }
        if let Some(v) = self.request_timeout_secs {
            cfg.request_timeout_secs = v;
        }
        if let Some(v) = self.stream_idle_timeout_secs {
            cfg.stream_idle_timeout_secs = v;
        }
        if let Some(v) = self.upstream_idle_timeout_ms {
            cfg.upstream_idle_timeout_ms = v;
        }
        if let Some(v) = self.load_poll_ms {
            cfg.load_poll_ms = v;
        }
        if let Some(v) = self.connect_timeout_ms {
            cfg.connect_timeout_ms = v;
        }
        if let Some(v) = self.max_tree_size_tokens {
            cfg.max_tree_size_tokens = v;
        }
        if let Some(v) = self.block_size {
            cfg.block_size = v;
        }
        if let Some(v) = self.cache_index {
            cfg.cache_index = v;
        }
        if !self.cache_boundaries.is_empty() {
            cfg.cache_boundaries = self.cache_boundaries;
        }
        if let Some(v) = self.cache_ttl_secs {
            cfg.cache_ttl_secs = v;
        }
        if self.kv_indexer_ttl_secs.is_some() {
            cfg.kv_indexer_ttl_secs = self.kv_indexer_ttl_secs;
        }
        if self.kv_indexer_max_entries.is_some() {
            cfg.kv_indexer_max_entries = self.kv_indexer_max_entries;
        }
        // Flags with the config key's name and type: a given flag replaces the key.
        macro_rules! overlay {
            ($($field:ident),* $(,)?) => {
                $(if let Some(v) = self.$field { cfg.$field = v; })*
            };
        }
        if self.nats_url.is_some() {
            cfg.nats_url = self.nats_url;
        }
        overlay!(
            nats_subject_prefix,
            dns_refresh_secs,
            dns_max_addresses,
            health_check_interval_secs,
            health_check_timeout_secs,
            health_failure_threshold,
            health_success_threshold,
            breaker_failure_threshold,
            breaker_window_secs,
            breaker_open_secs,
            breaker_success_threshold,
            retry_max,
            retry_initial_backoff_ms,
            retry_backoff_multiplier,
            retry_max_backoff_ms,
            retry_jitter,
            retry_budget_ratio,
            retry_budget_cap,
            retry_deadline_secs,
            first_byte_timeout_secs,
            migration_limit,
            shutdown_timeout_secs,
            admin_listen,
            client_header_timeout_secs,
            client_body_timeout_secs,
            client_idle_timeout_secs,
            max_connections_per_shard,
            log_format,
        );
        if self.admin_api_key.is_some() {
            cfg.admin_api_key = self.admin_api_key;
        }
        if !self.api_keys.is_empty() {
            cfg.api_keys = self.api_keys;
        }
        if self.api_key_file.is_some() {
            cfg.api_key_file = self.api_key_file;
        }
        if self.expose_worker_url {
            cfg.expose_worker_url = true;
        }
        Ok(cfg)
    }
}

#[cfg(feature = "bench")]
/// Flags of `kvroute engine` (defaults: `kvroute_bench::engine::defaults`).
#[derive(Args, Debug, Default)]
struct EngineArgs {
    /// Address to listen on, HOST:PORT.
    #[arg(long)]
    listen: Option<String>,
    /// Model name served.
    #[arg(long)]
    model: Option<String>,
    /// Tokens per KV block.
    #[arg(long)]
    block_size: Option<usize>,
    /// KV capacity in blocks.
    #[arg(long)]
    num_gpu_blocks: Option<usize>,
    /// Running-set cap, requests.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Token budget per step.
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// Divides all modelled times; 0 = no delays.
    #[arg(long)]
    speedup_ratio: Option<f64>,
    /// Context length, tokens: a prompt must leave room for its `max_tokens` (400 otherwise, in vLLM's words).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Seed of all randomness (output tokens).
    #[arg(long)]
    seed: Option<u64>,
    /// HF tokenizer.json (or a directory with it and tokenizer_config.json) [default: the
    /// embedded Qwen3 tokenizer].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Publish KV events (vLLM wire format) on a PUB socket bound to this TCP port, on the
    /// listen address's host. KV events are off unless this or `--kv-replay-port` is given
    /// (vLLM's `enable_kv_cache_events` is false by default, and several engines on one host
    /// would otherwise collide on one port); the missing port then takes its default.
    #[arg(long)]
    kv_events_port: Option<u16>,
    /// Replay ROUTER port of the KV events (turns KV events on, see `--kv-events-port`).
    #[arg(long)]
    kv_replay_port: Option<u16>,
    /// Encoding of the events in a batch: `array` (vLLM <= v0.23 tagged arrays) or `map`
    /// (vLLM >= v0.26 tagged maps). Needs `--kv-events-port` or `--kv-replay-port`.
    #[arg(long)]
    kv_events_encoding: Option<kvroute_bench::engine::events::Encoding>,
}

#[cfg(feature = "bench")]
impl EngineArgs {
    /// The KV-event publishing these flags ask for, bound on `host`: `None` when neither port
    /// flag is given. A missing port takes [`kvroute_bench::engine::events::EVENTS_PORT`] /
    /// [`kvroute_bench::engine::events::REPLAY_PORT`]; the encoding defaults to
    /// [`kvroute_bench::engine::events::Encoding::default`] (array).
    ///
    /// # Errors
    /// `--kv-events-encoding` without a port flag (it would silently do nothing).
    fn kv_events(
        &self,
        host: std::net::IpAddr,
    ) -> anyhow::Result<Option<kvroute_bench::engine::events::KvEventsConfig>> {
        use kvroute_bench::engine::events::{EVENTS_PORT, KvEventsConfig, REPLAY_PORT};
        if self.kv_events_port.is_none() && self.kv_replay_port.is_none() {
            if self.kv_events_encoding.is_some() {
                anyhow::bail!("--kv-events-encoding needs --kv-events-port or --kv-replay-port");
            }
            return Ok(None);
        }
        let addr = |port: u16| std::net::SocketAddr::new(host, port).to_string();
        Ok(Some(KvEventsConfig {
            events_addr: addr(self.kv_events_port.unwrap_or(EVENTS_PORT)),
            replay_addr: Some(addr(self.kv_replay_port.unwrap_or(REPLAY_PORT))),
            encoding: self.kv_events_encoding.unwrap_or_default(),
            ..KvEventsConfig::default()
        }))
    }
}

#[cfg(feature = "bench")]
/// Flags of `kvroute replay`.
#[derive(Args, Debug)]
struct ReplayArgs {
    /// Base URL of the router or an engine, http://HOST:PORT.
    #[arg(long)]
    url: String,
    /// Mooncake-format JSONL trace [default: the built-in demo workload].
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Replay only the first N requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Trace timestamps are divided by this (2 = twice as fast).
    #[arg(long)]
    time_scale: Option<f64>,
    /// `model` sent in each request [default: the first model of the target's `/v1/models`,
    /// else `Qwen/Qwen3-0.6B`].
    #[arg(long)]
    model: Option<String>,
    /// Write the report as JSON to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[cfg(feature = "bench")]
/// Flags of `kvroute load` (defaults: the constants of `kvroute_bench::load`).
#[derive(Args, Debug)]
struct LoadArgs {
    /// Target, http://HOST:PORT[/PATH]; without a path, /v1/chat/completions.
    #[arg(long)]
    url: Option<String>,
    /// Requests per second, request i due i / RATE s after the start whatever the target does.
    #[arg(long)]
    rate: Option<f64>,
    /// Length of the schedule, s: every request due before it (⌈RATE × DURATION⌉ requests).
    #[arg(long, conflicts_with = "requests")]
    duration: Option<f64>,
    /// Schedule exactly N requests instead of a duration.
    #[arg(long, value_name = "N")]
    requests: Option<u64>,
    /// HTTP/1.1 keep-alive connections, one request in flight on each.
    #[arg(long)]
    connections: Option<usize>,
    /// Runtime threads of the generator.
    #[arg(long)]
    threads: Option<usize>,
    /// Streaming requests (`"stream": true`); measures the first SSE `data:` line too.
    #[arg(long)]
    stream: bool,
    /// User message length, words (one token each in the embedded Qwen3 tokenizer).
    #[arg(long, value_name = "N")]
    prompt_tokens: Option<u32>,
    /// Shared system prompt, characters (0 = none).
    #[arg(long)]
    system_chars: Option<usize>,
    /// `max_tokens` of each request.
    #[arg(long)]
    max_tokens: Option<u32>,
    /// `model` of each request.
    #[arg(long)]
    model: Option<String>,
    /// Seed of the user texts (another seed sends texts no earlier run sent).
    #[arg(long)]
    seed: Option<u32>,
    /// Per-request timeout, connect to last byte, ms (then error `timeout`).
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// A request sent more than this after its scheduled time is late, and the summary says
    /// the run fell behind, ms.
    #[arg(long)]
    max_lag_ms: Option<f64>,
    /// Wake-up grid, µs: each send waits for the first multiple of it (from the start) at or
    /// after its scheduled time, so requests due within one tick share a wake-up (cheaper at
    /// high rates; the wait counts in corrected latencies); 0 = each at its own time.
    #[arg(long)]
    tick_us: Option<u64>,
    /// No progress bar (drawn on stderr only when it is a terminal).
    #[arg(long)]
    quiet: bool,
    /// Write the report as JSON to this file (the summary's numbers, latencies in ms).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[cfg(feature = "bench")]
impl LoadArgs {
    /// The defaults of `kvroute_bench::load::LoadConfig` with the flags laid over them.
    ///
    /// # Errors
    /// A duration or lateness bound that is negative or not finite.
    fn into_config(self, progress: bool) -> anyhow::Result<kvroute_bench::load::LoadConfig> {
        use kvroute_bench::load::{Limit, LoadConfig};
        use std::time::Duration;
        let secs = |flag: &str, s: f64| {
            Duration::try_from_secs_f64(s).map_err(|_| anyhow::anyhow!("{flag} {s}: not >= 0"))
        };
        let mut cfg = LoadConfig {
            progress: progress && !self.quiet,
            stream: self.stream,
            ..LoadConfig::default()
        };
        if let Some(v) = self.url {
            cfg.url = v;
        }
        if let Some(v) = self.rate {
            cfg.rate = v;
        }
        if let Some(v) = self.duration {
            cfg.limit = Limit::Duration(secs("--duration", v)?);
        }
        if let Some(n) = self.requests {
            cfg.limit = Limit::Requests(n);
        }
        if let Some(v) = self.max_lag_ms {
            cfg.max_lag = secs("--max-lag-ms", v / 1_000.0)?;
        }
        if let Some(v) = self.timeout_ms {
            cfg.timeout = Duration::from_millis(v);
        }
        if let Some(v) = self.tick_us {
            cfg.tick = Duration::from_micros(v);
        }
        macro_rules! overlay {
            ($($field:ident),* $(,)?) => {
                $(if let Some(v) = self.$field { cfg.$field = v; })*
            };
        }
        overlay!(
            connections,
            threads,
            prompt_tokens,
            system_chars,
            max_tokens,
            model,
            seed
        );
        Ok(cfg)
    }
}

/// `text` or `json`, as in TOML.
fn parse_log_format(s: &str) -> Result<kvroute_core::config::LogFormat, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|_| format!("expected text or json, got {s:?}"))
}

/// `tree` or `hash`, as in TOML.
fn parse_cache_index(s: &str) -> Result<kvroute_core::config::CacheIndexKind, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|_| format!("expected tree or hash, got {s:?}"))
}

/// `[default: X]` suffixes for flags whose default lives in a `pub const` elsewhere, so help
/// shows the one definition.
fn with_defaults(cmd: clap::Command) -> clap::Command {
    let serve: &[(&str, String)] = &[
        ("listen", defaults::LISTEN.to_string()),
        ("policy", defaults::POLICY.to_string()),
        ("cache_threshold", defaults::CACHE_THRESHOLD.to_string()),
        (
            "balance_rel_threshold",
            defaults::BALANCE_REL_THRESHOLD.to_string(),
        ),
        (
            "balance_abs_threshold",
            defaults::BALANCE_ABS_THRESHOLD.to_string(),
        ),
        (
            "max_tree_size_chars",
            defaults::MAX_TREE_SIZE_CHARS.to_string(),
        ),
        ("max_body_bytes", defaults::MAX_BODY_BYTES.to_string()),
        (
            "request_timeout_secs",
            defaults::REQUEST_TIMEOUT_SECS.to_string(),
        ),
        (
            "stream_idle_timeout_secs",
            defaults::STREAM_IDLE_TIMEOUT_SECS.to_string(),
        ),
        (
            "upstream_idle_timeout_ms",
            defaults::UPSTREAM_IDLE_TIMEOUT_MS.to_string(),
        ),
        (
            "connect_timeout_ms",
            defaults::CONNECT_TIMEOUT_MS.to_string(),
        ),
        ("load_poll_ms", defaults::LOAD_POLL_MS.to_string()),
        (
            "max_tree_size_tokens",
            defaults::MAX_TREE_SIZE_TOKENS.to_string(),
        ),
        ("block_size", defaults::BLOCK_SIZE.to_string()),
        (
            "cache_index",
            serde_json::to_value(defaults::CACHE_INDEX)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
        ),
        ("cache_ttl_secs", defaults::CACHE_TTL_SECS.to_string()),
        (
            "tokenize_cache_tokens",
            defaults::TOKENIZE_CACHE_TOKENS.to_string(),
        ),
        ("dns_refresh_secs", defaults::DNS_REFRESH_SECS.to_string()),
        ("dns_max_addresses", defaults::DNS_MAX_ADDRESSES.to_string()),
        (
            "nats_subject_prefix",
            defaults::NATS_SUBJECT_PREFIX.to_string(),
        ),
        (
            "health_check_interval_secs",
            defaults::HEALTH_CHECK_INTERVAL_SECS.to_string(),
        ),
        (
            "health_check_timeout_secs",
            defaults::HEALTH_CHECK_TIMEOUT_SECS.to_string(),
        ),
        (
            "health_failure_threshold",
            defaults::HEALTH_FAILURE_THRESHOLD.to_string(),
        ),
        (
            "health_success_threshold",
            defaults::HEALTH_SUCCESS_THRESHOLD.to_string(),
        ),
        (
            "breaker_failure_threshold",
            defaults::BREAKER_FAILURE_THRESHOLD.to_string(),
        ),
        (
            "breaker_window_secs",
            defaults::BREAKER_WINDOW_SECS.to_string(),
        ),
        ("breaker_open_secs", defaults::BREAKER_OPEN_SECS.to_string()),
        (
            "breaker_success_threshold",
            defaults::BREAKER_SUCCESS_THRESHOLD.to_string(),
        ),
        ("retry_max", defaults::RETRY_MAX.to_string()),
        (
            "retry_initial_backoff_ms",
            defaults::RETRY_INITIAL_BACKOFF_MS.to_string(),
        ),
        (
            "retry_backoff_multiplier",
            defaults::RETRY_BACKOFF_MULTIPLIER.to_string(),
        ),
        (
            "retry_max_backoff_ms",
            defaults::RETRY_MAX_BACKOFF_MS.to_string(),
        ),
        ("retry_jitter", defaults::RETRY_JITTER.to_string()),
        (
            "retry_budget_ratio",
            defaults::RETRY_BUDGET_RATIO.to_string(),
        ),
        ("retry_budget_cap", defaults::RETRY_BUDGET_CAP.to_string()),
        (
            "retry_deadline_secs",
            defaults::RETRY_DEADLINE_SECS.to_string(),
        ),
        (
            "first_byte_timeout_secs",
            defaults::FIRST_BYTE_TIMEOUT_SECS.to_string(),
        ),
        ("migration_limit", defaults::MIGRATION_LIMIT.to_string()),
        (
            "shutdown_timeout_secs",
            defaults::SHUTDOWN_TIMEOUT_SECS.to_string(),
        ),
        ("admin_listen", defaults::ADMIN_LISTEN.to_string()),
        (
            "client_header_timeout_secs",
            defaults::CLIENT_HEADER_TIMEOUT_SECS.to_string(),
        ),
        (
            "client_body_timeout_secs",
            defaults::CLIENT_BODY_TIMEOUT_SECS.to_string(),
        ),
        (
            "client_idle_timeout_secs",
            defaults::CLIENT_IDLE_TIMEOUT_SECS.to_string(),
        ),
        (
            "max_connections_per_shard",
            defaults::MAX_CONNECTIONS_PER_SHARD.to_string(),
        ),
        ("log_format", "text".to_string()),
    ];
    let add = |sub: clap::Command, table: &[(&str, String)]| {
        table.iter().fold(sub, |sub, (id, value)| {
            sub.mut_arg(*id, |a| {
                let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
                a.help(format!("{help} [default: {value}]"))
            })
        })
    };
    let cmd = cmd.mut_subcommand("serve", |s| add(s, serve));
    #[cfg(feature = "bench")]
    let cmd = {
        use kvroute_bench::engine::defaults as e;
        let engine: &[(&str, String)] = &[
            ("listen", e::ENGINE_LISTEN.to_string()),
            ("model", e::MODEL_NAME.to_string()),
            ("block_size", e::BLOCK_SIZE.to_string()),
            ("num_gpu_blocks", e::NUM_GPU_BLOCKS.to_string()),
            ("max_num_seqs", e::MAX_NUM_SEQS.to_string()),
            (
                "max_num_batched_tokens",
                e::MAX_NUM_BATCHED_TOKENS.to_string(),
            ),
            ("speedup_ratio", e::SPEEDUP_RATIO.to_string()),
            ("max_model_len", e::MAX_MODEL_LEN.to_string()),
            ("seed", e::SEED.to_string()),
            (
                "kv_events_port",
                kvroute_bench::engine::events::EVENTS_PORT.to_string(),
            ),
            (
                "kv_replay_port",
                kvroute_bench::engine::events::REPLAY_PORT.to_string(),
            ),
            (
                "kv_events_encoding",
                kvroute_bench::engine::events::Encoding::default().to_string(),
            ),
        ];
        let cmd = cmd.mut_subcommand("engine", |s| add(s, engine));
        use kvroute_bench::load as l;
        let load: &[(&str, String)] = &[
            ("url", l::DEFAULT_URL.to_string()),
            ("rate", l::DEFAULT_RATE.to_string()),
            ("duration", l::DEFAULT_DURATION_S.to_string()),
            ("connections", l::DEFAULT_CONNECTIONS.to_string()),
            ("threads", l::DEFAULT_THREADS.to_string()),
            ("prompt_tokens", l::DEFAULT_PROMPT_TOKENS.to_string()),
            ("system_chars", l::DEFAULT_SYSTEM_CHARS.to_string()),
            ("max_tokens", l::DEFAULT_MAX_TOKENS.to_string()),
            ("model", l::DEFAULT_MODEL.to_string()),
            ("seed", l::DEFAULT_SEED.to_string()),
            ("timeout_ms", l::DEFAULT_TIMEOUT_MS.to_string()),
            ("max_lag_ms", l::DEFAULT_MAX_LAG_MS.to_string()),
            ("tick_us", l::DEFAULT_TICK_US.to_string()),
        ];
        cmd.mut_subcommand("load", |s| add(s, load))
    };
    cmd
}

/// Runs the command; an error is printed as its chain of causes on one line (`Error: a:
/// b`), without the backtrace `RUST_BACKTRACE` would add to the `Debug` form, and exits 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let matches = with_defaults(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches)?;
    // `serve` may take its log format from its config file: it starts logging itself. The
    // other commands run gateways of their own (demo) whose per-request access lines would
    // bury their report: they log those only when `RUST_LOG` asks. The demo starts and stops
    // a fleet per run (~12 lines each at info, between its progress bars): warnings only.
    #[cfg(feature = "bench")]
    let demo = matches!(cli.command, Command::Demo(_));
    #[cfg(not(feature = "bench"))]
    let demo = false;
    if !matches!(cli.command, Command::Serve(_)) {
        let default = if demo {
            "warn"
        } else {
            "info,kvroute::access=warn"
        };
        init_logging_with(Default::default(), default);
    }
    match cli.command {
        Command::Serve(args) => serve(*args),
        #[cfg(feature = "bench")]
        Command::Engine(args) => run_engine(args),
        #[cfg(feature = "bench")]
        Command::Replay(args) => run_replay(args),
        #[cfg(feature = "bench")]
        Command::Load(args) => run_load(args),
        #[cfg(feature = "bench")]
        Command::Demo(args) => demo::run(args),
        #[cfg(feature = "bench")]
        Command::Simulate(args) => simulate::run(args),
        #[cfg(feature = "bench")]
        Command::Bench(args) => {
            let report = match args.what {
                BenchWhat::Index => {
                    kvroute_bench::index_bench::run().map_err(|e| anyhow::anyhow!(e))?
                }
                BenchWhat::Tokenize => {
                    kvroute_bench::tokenize_bench::run().map_err(|e| anyhow::anyhow!(e))?
                }
                BenchWhat::Decision => {
                    kvroute_bench::decision_bench::run().map_err(|e| anyhow::anyhow!(e))?
                }
                BenchWhat::Fleet => {
                    kvroute_bench::fleet_bench::run(&kvroute_bench::fleet_bench::FleetArgs {
                        workers: args.workers,
                        tokens: args.tokens,
                        seconds: args.seconds,
                    })
                    .map_err(|e| anyhow::anyhow!(e))?
                }
            };
            println!("{}", serde_json::to_string_pretty(&report)?);
            if let Some(out) = args.out {
                let written = match args.what {
                    BenchWhat::Fleet => kvroute_bench::fleet_bench::out_json(&report),
                    _ => report,
                };
                std::fs::write(&out, serde_json::to_vec_pretty(&written)?)
                    .with_context(|| format!("writing {}", out.display()))?;
            }
            Ok(())
        }
    }
}

/// Logs to stderr in `format`, at `RUST_LOG` (default `info`); colour only when stderr is a
/// terminal (a log file or journald gets plain text).
fn init_logging(format: kvroute_core::config::LogFormat) {
    init_logging_with(format, "info");
}

/// [`init_logging`] with `default` as the filter when `RUST_LOG` is unset.
fn init_logging_with(format: kvroute_core::config::LogFormat, default: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        kvroute_core::config::LogFormat::Json => builder.json().init(),
        kvroute_core::config::LogFormat::Text => {
            builder.with_ansi(std::io::stderr().is_terminal()).init()
        }
    }
}

/// `kvroute serve`: runs until SIGTERM or SIGINT (graceful shutdown, exit 0); SIGHUP re-reads
/// `--config` and applies its worker list.
fn serve(args: ServeArgs) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let force_epoll = args.force_epoll;
    let config_path = args.config.clone();
    let cfg = args.into_config()?;
    // The log format may come from the config file: logging starts once it is read.
    init_logging(cfg.log_format);
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    let running = cfg.clone();
    let server = gateway::start(cfg, force_epoll)?;
    for sig in signals.forever() {
        if sig == SIGHUP {
            match &config_path {
                Some(path) => gateway::reload(server.shared(), path, &running),
                None => tracing::warn!("SIGHUP without --config: nothing to re-read"),
            }
            continue;
        }
        tracing::info!(signal = sig, "shutdown signal");
        server.shutdown();
        return Ok(());
    }
    Ok(())
}

#[cfg(feature = "bench")]
fn run_engine(args: EngineArgs) -> anyhow::Result<()> {
    let mut cfg = kvroute_bench::engine::EngineConfig::default();
    if let Some(v) = &args.listen {
        cfg.listen = v.parse().with_context(|| format!("--listen {v}"))?;
    }
    cfg.kv_events = args.kv_events(cfg.listen.ip())?;
    if let Some(v) = args.model {
        cfg.model_name = v;
    }
    if let Some(v) = args.block_size {
        cfg.block_size = v;
    }
    if let Some(v) = args.num_gpu_blocks {
        cfg.num_gpu_blocks = v;
    }
    if let Some(v) = args.max_num_seqs {
        cfg.max_num_seqs = v;
    }
    if let Some(v) = args.max_num_batched_tokens {
        cfg.max_num_batched_tokens = v;
    }
    if let Some(v) = args.speedup_ratio {
        cfg.speedup_ratio = v;
    }
    if let Some(v) = args.max_model_len {
        cfg.max_model_len = v;
    }
    if let Some(v) = args.seed {
        cfg.seed = v;
    }
    let tokenizer = match &args.tokenizer {
        Some(p) => kvroute_tokenize::Tokenizer::from_path(p)?,
        None => kvroute_tokenize::Tokenizer::qwen3()?,
    };
    demo::run_engine_forever(cfg, tokenizer)
}

#[cfg(feature = "bench")]
fn run_replay(args: ReplayArgs) -> anyhow::Result<()> {
    let model = args.model.or_else(|| served_model(&args.url));
    let report = demo::replay_once(
        &args.url,
        args.trace.as_deref(),
        args.max_requests,
        args.time_scale,
        model,
        None,
    )?;
    println!("{}", report.table());
    if let Some(out) = args.out {
        std::fs::write(&out, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    anyhow::ensure!(
        report.ok > 0 || report.errors == 0,
        "every request failed: {:?}",
        report.errors_by_kind
    );
    Ok(())
}

/// The first model id of `GET {url}/v1/models` (a router's or an engine's), `None` when it
/// does not answer with a non-empty OpenAI list within 5 s.
#[cfg(feature = "bench")]
fn served_model(url: &str) -> Option<String> {
    use std::net::ToSocketAddrs;
    let authority = url.strip_prefix("http://")?.trim_end_matches('/');
    let addr = authority.to_socket_addrs().ok()?.next()?;
    let timeout = std::time::Duration::from_secs(5);
    let (status, body) =
        kvroute_io::health::http_get(addr, authority, "/v1/models", timeout, None).ok()?;
    (status == 200)
        .then(|| kvroute_io::health::model_ids(&body))??
        .into_iter()
        .next()
}

#[cfg(feature = "bench")]
/// `kvroute load`: the summary on stdout, the progress bar on stderr when it is a terminal.
fn run_load(args: LoadArgs) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let out = args.out.clone();
    let cfg = args.into_config(std::io::stderr().is_terminal())?;
    let tokenizer = kvroute_tokenize::Tokenizer::qwen3()?;
    let words = kvroute_bench::trace::WordIds::from_tokenizer(&tokenizer)?;
    drop(tokenizer);
    let report = kvroute_bench::load::run(&cfg, words)?;
    print!("{}", report.table());
    if let Some(out) = out {
        std::fs::write(&out, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

#[cfg(all(test, feature = "bench"))]
mod tests {
    use super::*;
    use kvroute_bench::engine::events::{EVENTS_PORT, Encoding, REPLAY_PORT};

    fn engine_args(argv: &[&str]) -> Result<EngineArgs, clap::Error> {
        let m = with_defaults(Cli::command())
            .try_get_matches_from(["kvroute", "engine"].iter().chain(argv))?;
        match Cli::from_arg_matches(&m)?.command {
            Command::Engine(a) => Ok(a),
            other => panic!("not engine: {other:?}"),
        }
    }

    fn lo() -> std::net::IpAddr {
        "127.0.0.1".parse().unwrap()
    }

    fn serve_config(argv: &[&str]) -> anyhow::Result<Config> {
        let m = with_defaults(Cli::command())
            .try_get_matches_from(["kvroute", "serve"].iter().chain(argv))?;
        match Cli::from_arg_matches(&m)?.command {
            Command::Serve(a) => a.into_config(),
            other => panic!("not serve: {other:?}"),
        }
    }

    /// `--worker-dns` is repeatable, the DNS flags reach the config, and a malformed source
    /// is refused naming the flag.
    #[test]
    fn serve_dns_flags() {
        let cfg = serve_config(&[
            "--worker-dns",
            "vllm.default.svc.cluster.local:8000;events_port=5557",
            "--worker-dns",
            "srv:_http._tcp.sglang.default.svc.cluster.local",
            "--dns-refresh-secs",
            "5",
            "--dns-max-addresses",
            "64",
            "--dns-server",
            "10.96.0.10:53",
        ])
        .unwrap();
        assert_eq!(
            cfg.worker_dns,
            vec![
                "vllm.default.svc.cluster.local:8000;events_port=5557".to_string(),
                "srv:_http._tcp.sglang.default.svc.cluster.local".to_string()
            ]
        );
        assert_eq!(
            (
                cfg.dns_refresh_secs,
                cfg.dns_max_addresses,
                cfg.dns_server.as_deref()
            ),
            (5, 64, Some("10.96.0.10:53"))
        );
        assert!(cfg.validate().is_ok());
        let d = serve_config(&[]).unwrap();
        assert_eq!(
            (d.dns_refresh_secs, d.dns_max_addresses, d.dns_server),
            (
                defaults::DNS_REFRESH_SECS,
                defaults::DNS_MAX_ADDRESSES,
                None
            )
        );
        let err = serve_config(&["--worker-dns", "vllm:0"])
            .unwrap()
            .validate()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "config: --worker-dns \"vllm:0\": port must be a number 1-65535"
        );
    }

    #[test]
    fn engine_kv_events_off_without_port_flags() {
        let a = engine_args(&[]).unwrap();
        assert_eq!(a.kv_events(lo()).unwrap(), None);
    }

    #[test]
    fn engine_kv_events_port_flags_and_defaults() {
        let a = engine_args(&["--kv-events-port", "6001", "--kv-events-encoding", "map"]).unwrap();
        let c = a.kv_events(lo()).unwrap().expect("on");
        assert_eq!(c.events_addr, "127.0.0.1:6001");
        assert_eq!(
            c.replay_addr.as_deref(),
            Some(format!("127.0.0.1:{REPLAY_PORT}").as_str())
        );
        assert_eq!(c.encoding, Encoding::Map);
        assert_eq!(c.buffer_steps, kvroute_bench::engine::events::BUFFER_STEPS);

        let a = engine_args(&["--kv-replay-port", "6002"]).unwrap();
        let c = a.kv_events(lo()).unwrap().expect("on");
        assert_eq!(c.events_addr, format!("127.0.0.1:{EVENTS_PORT}"));
        assert_eq!(c.replay_addr.as_deref(), Some("127.0.0.1:6002"));
        assert_eq!(c.encoding, Encoding::Array);
    }

    #[test]
    fn engine_kv_events_bad_values_rejected() {
        assert!(engine_args(&["--kv-events-encoding", "json", "--kv-events-port", "1"]).is_err());
        assert!(engine_args(&["--kv-events-port", "70000"]).is_err());
        let a = engine_args(&["--kv-events-encoding", "map"]).unwrap();
        assert!(a.kv_events(lo()).is_err());
    }

    #[test]
    fn engine_help_shows_kv_event_defaults() {
        let mut cmd = with_defaults(Cli::command());
        let help = cmd
            .find_subcommand_mut("engine")
            .unwrap()
            .render_long_help()
            .to_string();
        assert!(
            help.contains(&format!("[default: {EVENTS_PORT}]")),
            "{help}"
        );
        assert!(
            help.contains(&format!("[default: {REPLAY_PORT}]")),
            "{help}"
        );
        assert!(help.contains("[default: array]"), "{help}");
    }

    fn load_config(argv: &[&str]) -> anyhow::Result<kvroute_bench::load::LoadConfig> {
        let m = with_defaults(Cli::command())
            .try_get_matches_from(["kvroute", "load"].iter().chain(argv))?;
        match Cli::from_arg_matches(&m)?.command {
            Command::Load(a) => a.into_config(true),
            other => panic!("not load: {other:?}"),
        }
    }

    #[test]
    fn load_flags_lay_over_the_library_defaults() {
        use kvroute_bench::load::{self as l, Limit};
        use std::time::Duration;
        let c = load_config(&[]).unwrap();
        assert_eq!(c.url, l::DEFAULT_URL);
        assert_eq!(c.rate, l::DEFAULT_RATE);
        assert_eq!(c.limit, Limit::Duration(Duration::from_secs(10)));
        assert_eq!((c.connections, c.threads), (64, 1));
        assert_eq!((c.prompt_tokens, c.system_chars, c.max_tokens), (16, 0, 16));
        assert_eq!(c.timeout, Duration::from_millis(l::DEFAULT_TIMEOUT_MS));
        assert_eq!(c.max_lag, Duration::from_millis(10));
        assert_eq!(c.tick, Duration::ZERO);
        assert!(!c.stream && c.progress);

        let c = load_config(&[
            "--url",
            "http://127.0.0.1:9/x",
            "--rate",
            "2500",
            "--requests",
            "7",
            "--stream",
            "--connections",
            "3",
            "--threads",
            "2",
            "--prompt-tokens",
            "100",
            "--system-chars",
            "800",
            "--max-tokens",
            "4",
            "--model",
            "m",
            "--seed",
            "5",
            "--timeout-ms",
            "250",
            "--max-lag-ms",
            "2.5",
            "--tick-us",
            "100",
            "--quiet",
        ])
        .unwrap();
        assert_eq!(
            (c.url.as_str(), c.rate, c.limit),
            ("http://127.0.0.1:9/x", 2500.0, Limit::Requests(7))
        );
        assert_eq!(
            (c.connections, c.threads, c.stream, c.progress),
            (3, 2, true, false)
        );
        assert_eq!(
            (c.prompt_tokens, c.system_chars, c.max_tokens, c.seed),
            (100, 800, 4, 5)
        );
        assert_eq!(
            (c.model.as_str(), c.timeout),
            ("m", Duration::from_millis(250))
        );
        assert_eq!(c.max_lag, Duration::from_micros(2_500));
        assert_eq!(c.tick, Duration::from_micros(100));
        let c = load_config(&["--duration", "0.5"]).unwrap();
        assert_eq!(c.limit, Limit::Duration(Duration::from_millis(500)));

        assert!(load_config(&["--duration", "1", "--requests", "2"]).is_err());
        assert!(load_config(&["--duration", "-1"]).is_err());
    }

    #[test]
    fn load_help_shows_the_library_defaults() {
        let mut cmd = with_defaults(Cli::command());
        let help = cmd
            .find_subcommand_mut("load")
            .unwrap()
            .render_long_help()
            .to_string();
        for d in [
            "[default: http://127.0.0.1:8000]",
            "[default: 1000]",
            "[default: 10]",
            "[default: 64]",
            "[default: 10000]",
            "[default: qwen3-sim]",
        ] {
            assert!(help.contains(d), "{d} in {help}");
        }
    }

    /// `kvroute replay` without `--model` sends the model the target serves; nothing
    /// listening (or no list) → `None`, and the replay keeps its default.
    #[test]
    fn replay_asks_the_target_for_its_model() {
        use kvroute_bench::engine::{EngineConfig, server};
        let cfg = EngineConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            model_name: "served-m".into(),
            ..EngineConfig::default()
        };
        let tok = std::sync::Arc::new(kvroute_tokenize::Tokenizer::qwen3().unwrap());
        let engine = server::spawn(cfg, tok).unwrap();
        let url = format!("http://{}", engine.addr);
        assert_eq!(served_model(&url).as_deref(), Some("served-m"));
        assert_eq!(
            served_model(&format!("{url}/")).as_deref(),
            Some("served-m")
        );
        engine.shutdown();
        assert_eq!(served_model("http://127.0.0.1:1"), None);
        assert_eq!(served_model("https://127.0.0.1:1"), None);
    }
}
