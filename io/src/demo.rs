//! `kvroute demo`: the main job on an embedded default. Starts simulated engines and the
//! gateway on loopback, replays one workload once per policy (engine caches reset between
//! runs), and prints one comparison table. Also the helpers behind `kvroute engine` and
//! `kvroute replay`.

use crate::fleet::{self, FleetArgs};
use anyhow::Context;
use kvroute_bench::engine::{self, EngineConfig};
use kvroute_bench::replay::{self, ReplayConfig, ReplayReport};
use kvroute_bench::sim::{Routing, Run};
use kvroute_bench::trace::{self, PromptBuilder, WordIds};
use kvroute_core::config::Config;
use kvroute_core::metrics::HitTokens;
use kvroute_io::gateway;
use kvroute_tokenize::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tokenizer for the events run (token mode): `KVROUTE_TOKENIZER`, else the embedded Qwen3
/// tokenizer the simulated engines use.
fn events_tokenizer() -> PathBuf {
    std::env::var_os("KVROUTE_TOKENIZER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(kvroute_core::tokens::BUILTIN_QWEN3))
}

/// Flags of `kvroute demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Workload and fleet.
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Write the comparison as JSON to this file (`replay::comparison_json`; a run on KV
    /// events also carries `"kv_events"`: the fault counters summed over streams and the
    /// phantom / missed blocks of the router's index against the engines after the run, summed
    /// over replicas; a cache-aware run carries `"hit_tokens"`: on its hits, the prompt tokens
    /// the router predicted cached against those the engines served, with the phantom
    /// shortfall and unannounced excess, tokens; every run carries `"simulated_hit_rate"`,
    /// fraction 0–1: the same run on `kvroute simulate`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Policies to compare, in order (comma-separated): policy names, suffixed `_events`
    /// (token mode on the engines' KV events: engines publish, router subscribes) or `_tokens`
    /// (token mode on the token tree); `default` is kvroute's default policy on events; `all`
    /// every policy. Default: the anchors' algorithms against kvroute's default, on text and
    /// on events.
    #[arg(long, value_delimiter = ',', default_values_t = kvroute_bench::sim::comparison_runs())]
    pub policies: Vec<String>,
    /// Gateway shards per replica [default: the cores this process may use].
    #[arg(long)]
    pub shards: Option<usize>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
    /// Replica sync for --replicas: `embedded` (start nats-server from PATH on a free
    /// loopback port for the demo) or a NATS server's nats://HOST:PORT; each run gets its
    /// own subject prefix. The simulated comparison then models the same sync, delivered
    /// after loopback NATS's delay. [default: off]
    #[arg(long, value_name = "URL|embedded")]
    pub nats: Option<String>,
}

/// Delivery delay of replica sync on loopback NATS that the demo's simulated comparison
/// models, virtual ms: a NATS publish-to-delivery on loopback is ~0.1 ms (nats-bench);
/// 1 ms rounds up for the JSON encode and the kv-nats thread's wake-up.
pub const DEMO_SYNC_DELAY_MS: f64 = 1.0;

/// A `nats-server` child on a loopback port for `demo --nats embedded`; killed on drop.
struct EmbeddedNats {
    child: std::process::Child,
    url: String,
}

impl EmbeddedNats {
    /// Starts `nats-server` from PATH on a free loopback port and waits (≤ 10 s) until it
    /// accepts connections.
    ///
    /// # Errors
    /// nats-server is not on PATH, or does not listen within 10 s.
    fn start() -> anyhow::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = std::process::Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context(
                "--nats embedded starts nats-server from PATH (apt-get install nats-server), \
                 or give --nats nats://HOST:PORT",
            )?;
        let mut n = EmbeddedNats {
            child,
            url: format!("nats://127.0.0.1:{port}"),
        };
        let until = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > until || n.child.try_wait()?.is_some() {
                anyhow::bail!("nats-server did not listen on 127.0.0.1:{port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(n)
    }
}

impl Drop for EmbeddedNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (≤ 15 s) until every replica of `servers` is connected to NATS and hears the
/// others; warns when one does not (the run goes on: replicas route on local state).
fn wait_synced(servers: &[kvroute_io::shard::Server]) {
    let peers = servers.len().saturating_sub(1) as f64;
    let until = Instant::now() + Duration::from_secs(15);
    let synced = |s: &kvroute_io::shard::Server| {
        let m = s.shared().metrics.encode(&s.shared().workers);
        let v = |name: &str| {
            m.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        };
        v("kvroute_sync_connected ") == Some(1.0) && v("kvroute_sync_peers ") == Some(peers)
    };
    while !servers.iter().all(synced) {
        if Instant::now() > until {
            eprintln!("warning: replicas not all connected to NATS after 15 s; running anyway");
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tokio_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// `kvroute replay`: replays `trace` (or the built-in workload) against `url`.
///
/// # Errors
/// Bad URL or time scale, unreadable trace.
pub fn replay_once(
    url: &str,
    trace: Option<&Path>,
    max_requests: Option<usize>,
    time_scale: Option<f64>,
    model: Option<String>,
    expected_workers: Option<usize>,
) -> anyhow::Result<ReplayReport> {
    let records = fleet::load_records(trace, max_requests)?;
    let tokenizer = Tokenizer::qwen3()?;
    let prompts = PromptBuilder::new(
        WordIds::from_tokenizer(&tokenizer)?,
        trace::MOONCAKE_NAMESPACE,
    );
    let mut cfg = ReplayConfig {
        url: url.to_string(),
        progress: true,
        expected_workers,
        ..ReplayConfig::default()
    };
    if let Some(t) = time_scale {
        cfg.time_scale = t;
    }
    if let Some(m) = model {
        cfg.model = m;
    }
    let rt = tokio_runtime()?;
    Ok(rt.block_on(replay::replay(cfg, &records, &prompts))?)
}

/// `kvroute engine`: serves one simulated engine until the process is killed.
///
/// # Errors
/// The listen address cannot be bound.
pub fn run_engine_forever(cfg: EngineConfig, tokenizer: Tokenizer) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .with_context(|| format!("binding {}", cfg.listen))?;
        tracing::info!(addr = %cfg.listen, model = %cfg.model_name, "engine listening");
        engine::server::serve(listener, cfg, Arc::new(tokenizer))
            .await
            .map_err(|e| anyhow::anyhow!(e))
    })
}

/// `kvroute demo`.
///
/// # Errors
/// Engines or the gateway cannot start, the trace cannot be read.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let runs = kvroute_bench::sim::expand_runs(&args.policies)
        .iter()
        .map(|name| {
            let run: Run = name
                .parse()
                .map_err(|e| anyhow::anyhow!("--policies: {e}"))?;
            Ok((name.clone(), run))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let records = fleet::load_records(args.fleet.trace.as_deref(), args.fleet.max_requests)?;
    let mut fleet = args.fleet.fleet(&records);
    let embedded = match args.nats.as_deref() {
        Some("embedded") => Some(EmbeddedNats::start()?),
        _ => None,
    };
    let nats_url = embedded
        .as_ref()
        .map(|n| n.url.clone())
        .or(args.nats.clone());
    if nats_url.is_some() {
        anyhow::ensure!(
            fleet.replicas > 1,
            "--nats syncs router replicas: give --replicas N (N >= 2)"
        );
        fleet.sync_delay_ms = Some(DEMO_SYNC_DELAY_MS);
    }
    let num_gpu_blocks = fleet.num_gpu_blocks;
    let tokenizer = Arc::new(Tokenizer::qwen3()?);
    let prompts = PromptBuilder::new(
        WordIds::from_tokenizer(&tokenizer)?,
        trace::MOONCAKE_NAMESPACE,
    );
    let source = match &args.fleet.trace {
        Some(p) => p.display().to_string(),
        None => "built-in workload".to_string(),
    };
    eprintln!(
        "kvroute demo: {} requests from {source}, {} engines x {} KV blocks, speed-up {}, time scale {}",
        records.len(),
        fleet.engines,
        num_gpu_blocks,
        fleet.speedup_ratio,
        fleet.time_scale
    );
    let engines: Vec<_> = (0..fleet.engines)
        .map(|i| {
            let cfg = EngineConfig {
                listen: "127.0.0.1:0".parse().expect("literal address"),
                num_gpu_blocks,
                speedup_ratio: fleet.speedup_ratio,
                seed: i as u64,
                kv_events: Some(engine::events::KvEventsConfig {
                    events_addr: "127.0.0.1:0".into(),
                    replay_addr: Some("127.0.0.1:0".into()),
                    ..Default::default()
                }),
                ..EngineConfig::default()
            };
            engine::server::spawn(cfg, tokenizer.clone())
        })
        .collect::<Result<_, _>>()?;
    let urls: Vec<String> = engines
        .iter()
        .map(|e| format!("http://{}", e.addr))
        .collect();
    let rt = tokio_runtime()?;
    let mut reports = Vec::new();
    let mut notes = Vec::new();
    // (policy, field, value) added to that policy's entry in the `--out` JSON.
    let mut extras: Vec<(String, &str, serde_json::Value)> = Vec::new();
    for (i, (name, run)) in runs.iter().enumerate() {
        let on_events = run.routing == Routing::Events;
        let on_tokens = run.routing != Routing::Text;
        let policy = run.policy;
        for url in &urls {
            rt.block_on(reset_engine(url))?;
        }
        let mut cfg = Config {
            listen: "127.0.0.1:0".to_string(),
            workers: urls.clone(),
            policy,
            shards: args.shards,
            load_poll_ms: fleet.load_poll_ms,
            // Replicas share the host: no admin API (it would take one fixed port).
            admin_listen: String::new(),
            ..Config::default()
        };
        if on_tokens {
            cfg.tokenizer = Some(events_tokenizer());
        }
        if let Some(url) = &nats_url {
            cfg.nats_url = Some(url.clone());
            // Each run its own subject: a late message of the last run never reaches this one.
            cfg.nats_subject_prefix = format!("kvroute-demo-{}.run{i}", std::process::id());
        }
        if on_events {
            cfg.workers = engines
                .iter()
                .map(|e| {
                    format!(
                        "http://{};events={};replay={}",
                        e.addr,
                        e.kv_events_endpoint.as_deref().unwrap_or_default(),
                        e.kv_replay_endpoint.as_deref().unwrap_or_default()
                    )
                })
                .collect();
        }
        let servers = (0..fleet.replicas)
            .map(|_| gateway::start(cfg.clone(), false).map_err(anyhow::Error::from))
            .collect::<anyhow::Result<Vec<_>>>()?;
        if nats_url.is_some() {
            wait_synced(&servers);
        }
        let mut gateways = servers.iter().map(|s| format!("http://{}", s.local_addr()));
        let replay_cfg = ReplayConfig {
            url: gateways.next().expect("at least one replica"),
            replicas: gateways.collect(),
            time_scale: fleet.time_scale,
            progress: !args.quiet,
            expected_workers: Some(urls.len()),
            model: engine::defaults::MODEL_NAME.to_string(),
            ..ReplayConfig::default()
        };
        eprintln!("-- {name}");
        let report = rt.block_on(replay::replay(replay_cfg, &records, &prompts))?;
        let metrics: String = servers
            .iter()
            .map(|s| s.shared().metrics.encode(&s.shared().workers))
            .collect();
        notes.push(format!("{name}: {}", routing_note(&metrics)));
        if nats_url.is_some() {
            notes.push(format!("{name}: {}", sync_note(&metrics)));
        }
        if let Some(h) = hit_tokens_of(&metrics) {
            extras.push((name.clone(), "hit_tokens", serde_json::to_value(h)?));
        }
        let indexes: Vec<_> = servers
            .iter()
            .filter_map(|s| s.shared().events.clone())
            .collect();
        if !indexes.is_empty() {
            let mut totals = kvroute_core::events::StreamStats::default();
            let mut drift = Drift::default();
            for ix in &indexes {
                totals.add_counters(&event_totals(&kvroute_io::zmq::lock(ix)));
                let d = rt.block_on(index_drift(ix, &urls))?;
                drift.phantom += d.phantom;
                drift.missed += d.missed;
                drift.cached = d.cached;
            }
            notes.push(events_note(name, &totals));
            let each = if indexes.len() > 1 {
                format!(" (each of {} replicas)", indexes.len())
            } else {
                String::new()
            };
            notes.push(format!(
                "{name}: router index{each} vs engines after the run: phantom {}, missed \
                 {} of {} cached blocks",
                drift.phantom, drift.missed, drift.cached
            ));
            extras.push((name.clone(), "kv_events", events_json(&totals, &drift)));
        }
        for s in servers {
            s.shutdown();
        }
        reports.push((name.clone(), report));
    }
    // The same comparison on the simulator: no timing noise, so equal decisions show as equal
    // hit rates (README, "The simulator").
    let mut simulated = Vec::new();
    for (name, run) in &runs {
        let rep = kvroute_bench::sim::simulate(
            &kvroute_bench::trace::Trace::mooncake(records.clone()),
            &prompts,
            &fleet.config(*run),
        )
        .with_context(|| format!("simulating {name}"))?;
        simulated.push(format!("{name} {:.1} %", rep.replay.hit_rate * 100.0));
        extras.push((
            name.clone(),
            "simulated_hit_rate",
            serde_json::json!(rep.replay.hit_rate),
        ));
    }
    println!("{}", replay::comparison_table(&reports));
    for n in &notes {
        println!("{n}");
    }
    println!(
        "simulated on a virtual clock (kvroute simulate: same workload and fleet, no timing \
         noise): hit {}",
        simulated.join(", ")
    );
    eprintln!("demo finished in {:.1} s", started.elapsed().as_secs_f64());
    if let Some(out) = &args.out {
        std::fs::write(
            out,
            serde_json::to_vec_pretty(&with_extras(replay::comparison_json(&reports), extras))?,
        )
        .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// Replica sync's counters summed over the replicas' metrics `text`: messages sent,
/// applied, dropped, and peer bookings that ended by heartbeat or silence.
fn sync_note(text: &str) -> String {
    let total = |metric: &str, label: &str| -> f64 {
        sum_by_label(text, metric, label)
            .iter()
            .fold(0.0, |a, (_, v)| a + v)
    };
    let received = sum_by_label(text, "kvroute_sync_received_total", "outcome");
    format!(
        "replica sync sent {:.0}, applied {:.0} (not booked {:.0}), dropped {:.0}, peer \
         bookings expired {:.0}",
        total("kvroute_sync_sent_total", "type"),
        value_of(&received, "done"),
        value_of(&received, "not_booked"),
        total("kvroute_sync_dropped_total", "reason"),
        text.lines()
            .filter(|l| l.starts_with("kvroute_sync_peer_bookings_expired_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .fold(0.0, |a, b| a + b)
    )
}

/// Sum of the samples of `metric` in Prometheus text `text`, by the value of `label`.
fn sum_by_label(text: &str, metric: &str, label: &str) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    let key = format!("{label}=\"");
    for line in text.lines().filter(|l| l.starts_with(metric)) {
        let (Some(i), Some(v)) = (line.find(&key), line.rsplit(' ').next()) else {
            continue;
        };
        let value = &line[i + key.len()..];
        let value = &value[..value.find('"').unwrap_or(value.len())];
        let v: f64 = v.parse().unwrap_or(0.0);
        match out.iter_mut().find(|(k, _)| k == value) {
            Some(e) => e.1 += v,
            None => out.push((value.to_string(), v)),
        }
    }
    out
}

/// The value summed for label value `k` by [`sum_by_label`], 0 when absent.
fn value_of(sums: &[(String, f64)], k: &str) -> f64 {
    sums.iter().find(|(v, _)| v == k).map_or(0.0, |e| e.1)
}

/// One line of a run's routing decisions by reason and, in token mode, the router's
/// tokenizer reuse, read from the gateway's `/metrics` text.
fn routing_note(metrics: &str) -> String {
    let reasons = sum_by_label(metrics, "kvroute_decisions_total", "reason");
    let mut line = reasons
        .iter()
        .map(|(r, n)| format!("{r} {n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let tok = sum_by_label(metrics, "kvroute_tokenize_tokens_total", "how");
    let get = |k: &str| value_of(&tok, k);
    let total = get("reused") + get("encoded");
    if total > 0.0 {
        line.push_str(&format!(
            "; router tokenized {:.0} prompt tokens, {:.1} % reused from its prefix cache",
            total,
            100.0 * get("reused") / total
        ));
    }
    if let Some(h) = hit_tokens_of(metrics) {
        line.push_str(&format!("; {h}"));
    }
    line
}

/// The routers' predictions on cache hits against what the engines served, summed over
/// workers (and replicas), tokens, read from Prometheus text: `kvroute_hit_tokens_total` by
/// kind and `kvroute_unannounced_hits_total` (see
/// [`kvroute_core::metrics::Metrics::on_hit_outcome`]). `None` when no hit had a usage report.
fn hit_tokens_of(metrics: &str) -> Option<HitTokens> {
    let kinds = sum_by_label(metrics, "kvroute_hit_tokens_total", "kind");
    let get = |k: &str| value_of(&kinds, k) as u64;
    (!kinds.is_empty()).then(|| HitTokens {
        predicted: get("predicted"),
        served: get("served"),
        phantom: get("phantom"),
        unannounced: get("unannounced"),
        unannounced_hits: sum_by_label(metrics, "kvroute_unannounced_hits_total", "worker")
            .iter()
            .map(|e| e.1 as u64)
            .sum(),
    })
}

/// KV-event fault counters summed over every stream.
fn event_totals(ix: &kvroute_core::events::EventIndex) -> kvroute_core::events::StreamStats {
    let mut t = kvroute_core::events::StreamStats::default();
    for (_, s) in ix.stats() {
        t.add_counters(&s);
    }
    t
}

/// One line of the fault counters of [`event_totals`] for run `name` (size mismatches include
/// length mismatches).
fn events_note(name: &str, t: &kvroute_core::events::StreamStats) -> String {
    format!(
        "{name}: {} batches, {} events, gaps {}, replays {}, unrecoverable {}, restarts {}, \
         duplicates {}, decode errors {}, orphans {} (replays for them {}), size mismatches {}",
        t.batches,
        t.events,
        t.gaps,
        t.replays,
        t.unrecoverable_gaps,
        t.restarts,
        t.duplicates,
        t.decode_errors,
        t.orphans,
        t.orphan_replays,
        t.size_mismatches + t.length_mismatches
    )
}

/// How long the drift check waits for the last events to arrive before it counts.
const DRIFT_SETTLE: Duration = Duration::from_secs(5);

/// The router's event index against the engines' real GPU block sets, summed over engines.
#[derive(Debug, Default)]
struct Drift {
    /// Blocks the index lists that the engine does not hold.
    phantom: usize,
    /// Blocks the engine holds that the index does not list.
    missed: usize,
    /// Blocks the engines hold.
    cached: usize,
}

/// Compares the router's event index with every engine's real GPU block set once the run is
/// over, after waiting up to [`DRIFT_SETTLE`] for them to agree (the last batches may still
/// be in flight). Engine `w` of `urls` is worker `w`, DP rank 0.
async fn index_drift(ix: &kvroute_io::zmq::SharedEvents, urls: &[String]) -> anyhow::Result<Drift> {
    use kvroute_core::events::{StreamId, Tier};
    use std::collections::HashSet;
    let deadline = Instant::now() + DRIFT_SETTLE;
    loop {
        let mut d = Drift::default();
        for (w, url) in urls.iter().enumerate() {
            let (status, body) = http(url, "GET", "/debug/cached_blocks").await?;
            anyhow::ensure!(status == 200, "{url}/debug/cached_blocks: status {status}");
            let truth: HashSet<u64> = serde_json::from_slice::<Vec<u64>>(&body)
                .with_context(|| format!("{url}/debug/cached_blocks"))?
                .into_iter()
                .collect();
            let got: HashSet<u64> = kvroute_io::zmq::lock(ix)
                .engine_hashes(
                    StreamId {
                        worker: w as u32,
                        rank: 0,
                    },
                    Tier::Device,
                )
                .into_iter()
                .collect();
            d.phantom += got.difference(&truth).count();
            d.missed += truth.difference(&got).count();
            d.cached += truth.len();
        }
        if d.phantom + d.missed == 0 || Instant::now() > deadline {
            return Ok(d);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `"kv_events"` object of a run on events: [`event_totals`] (size mismatches include
/// length mismatches) and [`Drift`].
fn events_json(t: &kvroute_core::events::StreamStats, d: &Drift) -> serde_json::Value {
    serde_json::json!({
        "batches": t.batches,
        "events": t.events,
        "gaps": t.gaps,
        "replays": t.replays,
        "unrecoverable_gaps": t.unrecoverable_gaps,
        "restarts": t.restarts,
        "duplicates": t.duplicates,
        "decode_errors": t.decode_errors,
        "orphans": t.orphans,
        "orphan_replays": t.orphan_replays,
        "size_mismatches": t.size_mismatches + t.length_mismatches,
        "phantom_blocks": d.phantom,
        "missed_blocks": d.missed,
        "cached_blocks": d.cached,
    })
}

/// `report` (from [`replay::comparison_json`]) with each `(policy, field, value)` of `extras`
/// set as `field` on that policy's entry.
fn with_extras(
    mut report: serde_json::Value,
    extras: Vec<(String, &str, serde_json::Value)>,
) -> serde_json::Value {
    for (name, field, v) in extras {
        if let Some(run) = report["policies"]
            .as_array_mut()
            .into_iter()
            .flatten()
            .find(|r| r["policy"] == name.as_str())
        {
            run[field] = v;
        }
    }
    report
}

/// Empties an engine's prefix cache (`POST /reset_prefix_cache`), waiting up to 10 s for it to
/// go idle first (vLLM refuses a reset while requests hold blocks).
async fn reset_engine(url: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = http(url, "POST", "/reset_prefix_cache").await?;
        if status == 200 || Instant::now() > deadline {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One bodiless `method` request to a simulated engine (`connection: close`): its status and
/// body (the engine answers with a content-length, never chunked).
async fn http(url: &str, method: &str, path: &str) -> anyhow::Result<(u16, Vec<u8>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authority = url.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(authority).await?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {authority}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).await?;
    let head_end = memchr::memmem::find(&resp, b"\r\n\r\n")
        .with_context(|| format!("bad response from {url}{path}"))?;
    let line = String::from_utf8_lossy(&resp[..resp.len().min(16)]).to_string();
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad response from {url}{path}"))?;
    Ok((status, resp.split_off(head_end + 4)))
}
