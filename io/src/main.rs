//! The `kvroute` binary: `serve` (the gateway), `engine` (a simulated vLLM-like worker),
//! `replay` (a Mooncake-format trace against a URL) and `demo` (all of it on loopback).

use anyhow::Context;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use kvroute_core::config::{Config, defaults};
use kvroute_io::{demo, gateway, simulate};
use std::path::PathBuf;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// kvroute: a KV-cache-aware router for LLM inference fleets.
#[derive(Parser, Debug)]
#[command(name = "kvroute", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the gateway in front of workers.
    Serve(Box<ServeArgs>),
    /// Run one simulated vLLM-like engine.
    Engine(EngineArgs),
    /// Replay a Mooncake-format trace (or the built-in workload) against a URL.
    Replay(ReplayArgs),
    /// Start 4 engines and the router on loopback, replay a workload once per policy, print
    /// a comparison table.
    Demo(demo::DemoArgs),
    /// The demo's comparison on the discrete-event simulator: the same router policy and
    /// engine model on a virtual clock, deterministic, about a second per run.
    Simulate(simulate::SimulateArgs),
    /// Short benchmark runs (< 60 s each) that print and write JSON.
    Bench(BenchArgs),
}

/// Flags of `kvroute bench`.
#[derive(Args, Debug)]
struct BenchArgs {
    /// Which benchmark.
    #[arg(value_enum)]
    what: BenchWhat,
    /// Write the JSON report to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The benchmarks of `kvroute bench`.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum BenchWhat {
    /// The cache indexes against naive baselines (issue 3).
    Index,
    /// Full vs incremental tokenization (issue 4).
    Tokenize,
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
    /// Shard threads, one per core [default: the cores this process may use].
    #[arg(long)]
    shards: Option<usize>,
    /// Worker base URL, http://HOST:PORT (repeatable).
    #[arg(long = "worker")]
    workers: Vec<String>,
    /// Routing policy: round_robin, least_request or cache_aware.
    #[arg(long)]
    policy: Option<String>,
    /// cache_aware: match ratio (matched chars / request chars) above which the prefix
    /// holders are the candidates.
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
    cache_index: Option<kvroute_core::policy::CacheIndexKind>,
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
        if !self.workers.is_empty() {
            cfg.workers = self.workers;
        }
        if let Some(v) = self.policy {
            cfg.policy = v.parse().map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
        }
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
        Ok(cfg)
    }
}

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
    /// Longest prompt, tokens (400 above).
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
    /// `model` sent in each request.
    #[arg(long)]
    model: Option<String>,
    /// Write the report as JSON to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// `tree` or `hash`, as in TOML.
fn parse_cache_index(s: &str) -> Result<kvroute_core::policy::CacheIndexKind, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|_| format!("expected tree or hash, got {s:?}"))
}

/// `[default: X]` suffixes for flags whose default lives in a `pub const` elsewhere, so help
/// shows the one definition.
fn with_defaults(cmd: clap::Command) -> clap::Command {
    use kvroute_bench::engine::defaults as e;
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
    ];
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
    let add = |sub: clap::Command, table: &[(&str, String)]| {
        table.iter().fold(sub, |sub, (id, value)| {
            sub.mut_arg(*id, |a| {
                let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
                a.help(format!("{help} [default: {value}]"))
            })
        })
    };
    cmd.mut_subcommand("serve", |s| add(s, serve))
        .mut_subcommand("engine", |s| add(s, engine))
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let matches = with_defaults(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches)?;
    match cli.command {
        Command::Serve(args) => {
            let force_epoll = args.force_epoll;
            let cfg = (*args).into_config()?;
            let server = gateway::start(cfg, force_epoll)?;
            server.wait();
            Ok(())
        }
        Command::Engine(args) => run_engine(args),
        Command::Replay(args) => run_replay(args),
        Command::Demo(args) => demo::run(args),
        Command::Simulate(args) => simulate::run(args),
        Command::Bench(args) => {
            let report = match args.what {
                BenchWhat::Index => kvroute_bench::index_bench::run()?,
                BenchWhat::Tokenize => kvroute_bench::tokenize_bench::run()?,
            };
            println!("{}", serde_json::to_string_pretty(&report)?);
            if let Some(out) = args.out {
                std::fs::write(&out, serde_json::to_vec_pretty(&report)?)
                    .with_context(|| format!("writing {}", out.display()))?;
            }
            Ok(())
        }
    }
}

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

fn run_replay(args: ReplayArgs) -> anyhow::Result<()> {
    let report = demo::replay_once(
        &args.url,
        args.trace.as_deref(),
        args.max_requests,
        args.time_scale,
        args.model,
        None,
    )?;
    println!("{}", report.table());
    if let Some(out) = args.out {
        std::fs::write(&out, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

#[cfg(test)]
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
}
