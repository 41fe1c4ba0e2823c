//! `kvroute simulate`: the demo's comparison on the discrete-event simulator
//! ([`kvroute_bench::sim`]): the same policies and engines on a virtual clock, over the
//! built-in workload, a Mooncake trace (open loop) or WEKA conversations (closed loop), with
//! no run-to-run noise; repeatable over seeds (`--runs`) and over a grid of router knobs
//! (`--sweep`); `--plot DIR` draws each run's figures.

use crate::fleet::{self, FleetArgs};
use anyhow::Context;
use kvroute_bench::engine;
use kvroute_bench::plot;
use kvroute_bench::sim::{self, Run, SimReport};
use kvroute_bench::trace::{self, PromptBuilder, Trace, WordIds};
use kvroute_bench::workload::{self, WorkloadParams};
use kvroute_core::config::Config;
use kvroute_tokenize::Tokenizer;
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `kvroute simulate`.
#[derive(clap::Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Workload and fleet (as `kvroute demo`).
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Policies to compare, in order (comma-separated; names as `kvroute demo --policies`,
    /// `all` for every policy and preset).
    #[arg(long, value_delimiter = ',', default_values_t = sim::comparison_runs())]
    pub policies: Vec<String>,
    /// Repetitions: run k (from 0) uses tie-break seed `seed + k` and, for the built-in
    /// workload, workload seed `workload_seed + k` (a trace file stays the same).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=10_000))]
    pub runs: usize,
    /// Seed of the router's tie-breaking RNG and of the closed-loop start offsets (run 0).
    #[arg(long, default_value_t = sim::DEFAULT_SEED)]
    pub seed: u64,
    /// Seed of the built-in workload (run 0).
    #[arg(long, default_value_t = workload::DEFAULT_SEED)]
    pub workload_seed: u64,
    /// Virtual ms from an engine step's start until its KV events are in the router's index.
    #[arg(long, default_value_t = sim::DEFAULT_EVENT_DELAY_MS)]
    pub event_delay_ms: f64,
    /// Closed-loop traces (WEKA): conversations start at seeded offsets uniform within this
    /// many seconds of trace time (divided by --time-scale like think times).
    #[arg(long, default_value_t = sim::DEFAULT_SPREAD_SECS)]
    pub spread_secs: f64,
    /// Replica sync between the `--replicas` (as `kvroute serve --nats`): each replica sends
    /// its peers what it routed (booked load, page keys of the prompt), each first token and
    /// each end, delivered this many virtual ms later; unset = replicas share nothing.
    #[arg(long, value_name = "MS")]
    pub sync_delay_ms: Option<f64>,
    /// Send KV events through the vLLM msgpack wire format and the router's consumer
    /// instead of as decoded batches (same results, slower).
    #[arg(long)]
    pub wire_events: bool,
    /// cache_aware's match threshold, fraction 0–1 (as `kvroute serve --cache-threshold`).
    #[arg(long, default_value_t = kvroute_core::config::defaults::CACHE_THRESHOLD)]
    pub cache_threshold: f64,
    /// Spill gate, relative part (as `kvroute serve --balance-rel-threshold`).
    #[arg(long, default_value_t = kvroute_core::config::defaults::BALANCE_REL_THRESHOLD)]
    pub balance_rel_threshold: f64,
    /// Spill gate, absolute part, requests (as `kvroute serve --balance-abs-threshold`).
    #[arg(long, default_value_t = kvroute_core::config::defaults::BALANCE_ABS_THRESHOLD)]
    pub balance_abs_threshold: usize,
    /// A policy knob, NAME=VALUE (repeatable; names as the `[knobs]` keys of the config file,
    /// e.g. `ttft_prefill_weight=2`).
    #[arg(long = "knob", value_name = "NAME=VALUE")]
    pub knobs: Vec<String>,
    /// A grid over router config knobs, `KNOB=V1,V2,..` (repeatable; KNOB is a field of the
    /// router's TOML config, e.g. `cache_threshold=0.3,0.5`; values are JSON, else strings).
    /// Every combination runs every policy; the best setting per policy is printed: the
    /// lowest TTFT p99 among settings within one point of the best hit rate.
    #[arg(long, value_name = "KNOB=V1,V2")]
    pub sweep: Vec<String>,
    /// Write figures of each run into this directory (created if missing), PNG and SVG:
    /// `ttft_cdf` (TTFT CDF per policy), `load_<policy>` (requests in flight per engine over
    /// virtual time), `hit_rate` (hit rate per policy against the infinite-cache bound);
    /// with `--runs` > 1 each name ends in `_seed<S>`.
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,
    /// Write `{"runs":[{"seed","policies":[{policy, requests, errors, hit_rate,
    /// bound_hit_rate, prefill_tokens, ttft_ms, tpot_ms, e2e_ms, max_over_mean_load,
    /// load_cv, sticky_share, wall_s, setting}]}]}` to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One knob setting of a sweep: `(field, value)` pairs, applied in order.
pub type Setting = Vec<(String, Value)>;

/// One simulated policy under one setting.
#[derive(Debug, Clone)]
pub struct Row {
    /// Policy name as given to `--policies`.
    pub policy: String,
    /// The sweep setting (empty without `--sweep`).
    pub setting: Setting,
    /// The simulator's report.
    pub report: SimReport,
    /// Wall-clock seconds the simulation took.
    pub wall_s: f64,
}

/// Parses the `--sweep` flags into the grid of settings, in flag order, the last knob
/// varying fastest; one empty setting without flags.
///
/// # Errors
/// A flag without `=` or without values; a knob that is not a field of [`Config`] (the
/// message lists the fields); `policy` (use `--policies`).
pub fn sweep_grid(flags: &[String]) -> anyhow::Result<Vec<Setting>> {
    let fields = config_fields();
    let mut grid: Vec<Setting> = vec![Vec::new()];
    for flag in flags {
        let (knob, values) = flag
            .split_once('=')
            .with_context(|| format!("--sweep {flag:?}: expected KNOB=V1,V2,.."))?;
        let knob = knob.trim();
        if knob == "policy" {
            anyhow::bail!("--sweep policy: compare policies with --policies");
        }
        if !fields.iter().any(|f| f == knob) {
            anyhow::bail!(
                "--sweep: unknown knob {knob:?}; router config knobs are: {}",
                fields.join(", ")
            );
        }
        let values: Vec<Value> = values
            .split(',')
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(|v| serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string())))
            .collect();
        if values.is_empty() {
            anyhow::bail!("--sweep {flag:?}: no values");
        }
        grid = grid
            .into_iter()
            .flat_map(|s| {
                values.iter().map(move |v| {
                    let mut s = s.clone();
                    s.push((knob.to_string(), v.clone()));
                    s
                })
            })
            .collect();
    }
    Ok(grid)
}

/// Field names of the serialized router [`Config`], sorted.
fn config_fields() -> Vec<String> {
    let v = serde_json::to_value(Config::default()).expect("Config serializes");
    let o = v.as_object();
    // Top-level keys, with the `[knobs]` table's fields in its place.
    let mut f: Vec<String> = o
        .into_iter()
        .flatten()
        .flat_map(|(k, v)| match (k.as_str(), v.as_object()) {
            ("knobs", Some(kn)) => kn.keys().cloned().collect::<Vec<_>>(),
            _ => vec![k.clone()],
        })
        .collect();
    f.sort();
    f
}

/// `cfg` with `setting` applied through its serialized form (so every config field is a
/// knob without code here), then validated as `kvroute serve` would.
///
/// # Errors
/// A value of the wrong type for its field, or one [`Config::validate`] refuses.
pub fn apply_setting(cfg: &Config, setting: &Setting) -> anyhow::Result<Config> {
    if setting.is_empty() {
        return Ok(cfg.clone());
    }
    let mut v = serde_json::to_value(cfg)?;
    let obj = v
        .as_object_mut()
        .context("Config serializes to an object")?;
    for (k, val) in setting {
        // A policy knob lives in the `[knobs]` table; any other name is a top-level key
        // (an unknown one fails below, naming it).
        let knobs = obj.get_mut("knobs").and_then(Value::as_object_mut);
        match knobs {
            Some(kn) if kn.contains_key(k) => {
                kn.insert(k.clone(), val.clone());
            }
            _ => {
                obj.insert(k.clone(), val.clone());
            }
        }
    }
    let label = setting_label(setting);
    let out: Config =
        serde_json::from_value(v).with_context(|| format!("--sweep {label}: bad value"))?;
    Config {
        workers: vec!["http://sim-0:80".into()],
        ..out.clone()
    }
    .validate()
    .with_context(|| format!("--sweep {label}"))?;
    Ok(out)
}

/// `knob=value` pairs joined by spaces (`-` when empty).
pub fn setting_label(setting: &Setting) -> String {
    if setting.is_empty() {
        return "-".into();
    }
    setting
        .iter()
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={s}"),
            v => format!("{k}={v}"),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sets this process's memory up for a batch simulation: freed pages stay with mimalloc,
/// and pages are the kernel's base 4 KiB pages, not transparent huge pages.
///
/// - **No purge.** A simulation frees and regrows the event index's tables and slabs, the
///   engines' block maps and every request's prompt, thousands of times; with mimalloc's
///   default purge delay (1 s in the v3 this build links) the freed pages go back to the
///   kernel and regrowth faults them in again, zeroed. `MIMALLOC_SHOW_STATS=1` on the whole
///   Mooncake trace at ×8 (8 engines, default policy): 1.3 GiB purged for a peak of 1.1 GiB
///   committed, 0 with this; kernel page zeroing had been 13 % of such a run
///   (perf/runs/2026-12-03-sim-speed-2). Overrides `MIMALLOC_PURGE_DELAY`.
/// - **No THP** (`prctl(PR_SET_THP_DISABLE)`, which covers mappings mimalloc had already
///   advised `MADV_HUGEPAGE` before `main`). A huge page is zeroed whole at its first touch,
///   however little of it the simulation then uses: on the same run, 1,223 page faults
///   zeroed ~2.4 GiB and `clear_page_erms` took 27.7 % of the samples; with base pages,
///   290k faults zero 1.1 GiB and the run's median `wall s` fell from 6.71 to 5.25 (six
///   interleaved rounds, perf/runs/2026-12-04-sim-thp). Fails silently: THP then stays as
///   the system has it.
///
/// A batch process of bounded size loses nothing by either. `serve` keeps the defaults: a
/// long-lived router should return memory, and it zeroes its pages once, at start-up, not
/// once per run (whether huge pages help its index reads was not measured).
fn batch_memory() {
    /// `mi_option_purge_delay` in mimalloc's `mi_option_e` (15 in both v2 and v3, which
    /// `libmimalloc-sys` 0.1.49 does not name); -1 means never purge.
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // Safety: `mi_option_set` is not thread-safe; it runs first thing in `simulate`, before
    // this process starts any thread, and only writes an option word that mimalloc reads
    // when it decides whether to purge.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    // Safety: `prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)` takes integer arguments only and
    // sets one flag of this process's memory map; an error (an old kernel) leaves it as is.
    unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
}

/// `kvroute simulate`: prints one comparison table per run (or, with `--runs` > 1, one line
/// per run and a summary per policy), and with `--sweep` the best setting per policy.
///
/// # Errors
/// Unknown policy or knob, unreadable trace, invalid engine config, a stalled engine.
pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    batch_memory();
    let started = Instant::now();
    let runs: Vec<(String, Run)> = sim::expand_runs(&args.policies)
        .iter()
        .map(|n| {
            Ok((
                n.clone(),
                n.parse().map_err(|e| anyhow::anyhow!("--policies: {e}"))?,
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let grid = sweep_grid(&args.sweep)?;
    let tokenizer = Tokenizer::qwen3()?;
    let words = WordIds::from_tokenizer(&tokenizer)?;
    let file = match &args.fleet.trace {
        Some(p) => Some(fleet::load_trace(Some(p), args.fleet.max_requests)?),
        None => None,
    };
    let mut out_runs = Vec::with_capacity(args.runs);
    let mut all: Vec<Vec<(String, SimReport)>> = Vec::with_capacity(args.runs);
    for k in 0..args.runs {
        let seed = args.seed.wrapping_add(k as u64);
        let trace = match &file {
            Some(t) => t.clone(),
            None => {
                let mut r = workload::builtin_workload(&WorkloadParams {
                    seed: args.workload_seed.wrapping_add(k as u64),
                    ..WorkloadParams::default()
                });
                if let Some(n) = args.fleet.max_requests {
                    r.truncate(n);
                }
                Trace::mooncake(r)
            }
        };
        let prompts = PromptBuilder::new(words.clone(), trace::MOONCAKE_NAMESPACE)
            .with_block_tokens(trace.block_tokens);
        let bound = trace.engine_bound(engine::defaults::BLOCK_SIZE as u32);
        let fleet = args.fleet.fleet(&trace.records);
        let mut rows = Vec::with_capacity(runs.len() * grid.len());
        for setting in &grid {
            for (name, run) in &runs {
                let mut cfg = fleet.config(*run);
                cfg.router.cache_threshold = args.cache_threshold;
                cfg.router.balance_rel_threshold = args.balance_rel_threshold;
                cfg.router.balance_abs_threshold = args.balance_abs_threshold;
                cfg.router.knobs.set_all(&args.knobs)?;
                cfg.router = apply_setting(&cfg.router, setting)?;
                cfg.seed = seed;
                cfg.event_delay_ms = args.event_delay_ms;
                cfg.spread_secs = args.spread_secs;
                cfg.wire_events = args.wire_events;
                cfg.sync_delay_ms = args.sync_delay_ms;
                let t0 = Instant::now();
                let report = sim::simulate(&trace, &prompts, &cfg)
                    .with_context(|| format!("simulating {name}"))?;
                rows.push(Row {
                    policy: name.clone(),
                    setting: setting.clone(),
                    report,
                    wall_s: t0.elapsed().as_secs_f64(),
                });
            }
        }
        if args.runs == 1 {
            eprintln!(
                "kvroute simulate: {} requests ({:?}{}), {} engines x {} KV blocks, speed-up {}, \
                 time scale {} (virtual time); infinite-cache bound {:.1} %",
                trace.len(),
                trace.format,
                if trace.conversations > 0 {
                    format!(", {} conversations, closed loop", trace.conversations)
                } else {
                    String::new()
                },
                fleet.engines,
                fleet.num_gpu_blocks,
                fleet.speedup_ratio,
                fleet.time_scale,
                bound * 100.0
            );
            print!("{}", table(&rows, bound, !args.sweep.is_empty()));
            print_notes(&rows);
        } else {
            let line: Vec<String> = rows
                .iter()
                .map(|r| format!("{} {:.2}", r.policy, r.report.replay.hit_rate * 100.0))
                .collect();
            println!("run {k}: hit % {}", line.join(", "));
        }
        if !args.sweep.is_empty() {
            for line in best_settings(&rows) {
                println!("{line}");
            }
        }
        if let Some(dir) = &args.plot {
            let suffix = if args.runs > 1 {
                format!("_seed{seed}")
            } else {
                String::new()
            };
            let t0 = Instant::now();
            let files = plot_rows(dir, &suffix, &rows, bound, fleet.engines)?;
            eprintln!(
                "plots: {} files in {} ({:.1} s)",
                files.len(),
                dir.display(),
                t0.elapsed().as_secs_f64()
            );
        }
        out_runs.push(json!({
            "seed": seed,
            "policies": rows.iter().map(|r| row_json(r, bound)).collect::<Vec<_>>(),
        }));
        if grid.len() == 1 {
            all.push(
                rows.into_iter()
                    .map(|r| (r.policy, r.report))
                    .collect::<Vec<_>>(),
            );
        }
    }
    if args.runs > 1 && !all.is_empty() {
        println!("{}", summary(&all));
    }
    eprintln!(
        "simulate finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if let Some(out) = &args.out {
        let doc = json!({ "runs": out_runs });
        std::fs::write(out, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// Writes the `--plot` figures of one run's rows into `dir` ([`kvroute_bench::plot`]), each
/// row labelled by its policy and, with `--sweep`, its setting; returns the files written.
///
/// # Errors
/// `dir` cannot be created or a file written (the message names the path), or no font.
pub fn plot_rows(
    dir: &std::path::Path,
    suffix: &str,
    rows: &[Row],
    bound: f64,
    engines: usize,
) -> anyhow::Result<Vec<PathBuf>> {
    let labels: Vec<String> = rows
        .iter()
        .map(|r| {
            if r.setting.is_empty() {
                r.policy.clone()
            } else {
                format!("{} {}", r.policy, setting_label(&r.setting))
            }
        })
        .collect();
    let runs: Vec<plot::PolicyRun> = rows
        .iter()
        .zip(&labels)
        .map(|(r, name)| plot::PolicyRun {
            name,
            report: &r.report,
        })
        .collect();
    plot::write_all(dir, suffix, &runs, bound, engines)
        .with_context(|| format!("--plot {}", dir.display()))
}

/// The `--out` entry of one row: exactly the documented fields (hit rates as fractions 0–1,
/// latencies in virtual ms, `wall_s` in wall seconds), plus `setting` (the sweep's knobs as
/// an object, empty without `--sweep`).
pub fn row_json(r: &Row, bound: f64) -> Value {
    let rep = &r.report.replay;
    let lat = |l: &kvroute_bench::replay::LatencySummary| json!({"p50": l.p50, "p90": l.p90, "p99": l.p99});
    let setting: serde_json::Map<String, Value> = r.setting.iter().cloned().collect();
    json!({
        "policy": r.policy,
        "requests": rep.requests,
        "errors": rep.errors,
        "hit_rate": rep.hit_rate,
        "bound_hit_rate": bound,
        "prefill_tokens": r.report.prefill_tokens,
        "ttft_ms": lat(&rep.ttft_ms),
        "tpot_ms": lat(&rep.tpot_ms),
        "e2e_ms": lat(&rep.e2e_ms),
        "max_over_mean_load": rep.max_over_mean_load,
        "load_cv": r.report.load_cv,
        "sticky_share": r.report.sticky.share,
        "wall_s": r.wall_s,
        "setting": setting,
    })
}

/// The comparison table: per row, requests, errors, hit rate and the trace's bound (%),
/// prefill tokens computed (millions), TTFT / TPOT / e2e p50 p90 p99 (virtual ms), max/mean
/// load and its coefficient of variation, sticky share (%), wall seconds; with `settings`, a
/// column of sweep settings.
pub fn table(rows: &[Row], bound: f64, settings: bool) -> String {
    let w = rows
        .iter()
        .map(|r| r.policy.len())
        .max()
        .unwrap_or(0)
        .max("policy".len());
    let sw = if settings {
        rows.iter()
            .map(|r| setting_label(&r.setting).len())
            .max()
            .unwrap_or(0)
            .max("setting".len())
            + 1
    } else {
        0
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<w$} {:<sw$}{:>6} {:>4} {:>6} {:>6} {:>8} | {:>7} {:>7} {:>7} | {:>5} {:>5} {:>5} | \
         {:>8} {:>8} {:>8} | {:>5} {:>5} {:>7} {:>6}",
        "policy",
        if settings { "setting" } else { "" },
        "req",
        "err",
        "hit %",
        "bound",
        "prefill",
        "TTFT50",
        "TTFT90",
        "TTFT99",
        "TPOT50",
        "90",
        "99",
        "e2e50",
        "e2e90",
        "e2e99",
        "max/m",
        "cv",
        "sticky%",
        "wall s",
    );
    for r in rows {
        let rep = &r.report.replay;
        let _ = writeln!(
            s,
            "{:<w$} {:<sw$}{:>6} {:>4} {:>6.1} {:>6.1} {:>7.1}M | {:>7.1} {:>7.1} {:>7.1} | \
             {:>5.1} {:>5.1} {:>5.1} | {:>8.0} {:>8.0} {:>8.0} | {:>5.2} {:>5.2} {:>7.1} {:>6.2}",
            r.policy,
            if settings {
                setting_label(&r.setting)
            } else {
                String::new()
            },
            rep.requests,
            rep.errors,
            rep.hit_rate * 100.0,
            bound * 100.0,
            r.report.prefill_tokens as f64 / 1e6,
            rep.ttft_ms.p50,
            rep.ttft_ms.p90,
            rep.ttft_ms.p99,
            rep.tpot_ms.p50,
            rep.tpot_ms.p90,
            rep.tpot_ms.p99,
            rep.e2e_ms.p50,
            rep.e2e_ms.p90,
            rep.e2e_ms.p99,
            rep.max_over_mean_load,
            r.report.load_cv,
            r.report.sticky.share * 100.0,
            r.wall_s,
        );
    }
    let _ = writeln!(
        s,
        "(latencies in virtual ms; hit % = cached / prompt tokens; bound = the trace's \
         engine-level infinite-cache bound; prefill = prompt − cached tokens computed; \
         max/m, cv = requests per engine)"
    );
    s
}

/// Per policy, its decisions, hit tokens and index drift.
fn print_notes(rows: &[Row]) {
    for r in rows {
        let decisions: Vec<String> = r
            .report
            .decisions
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let mut line = format!("{}: {}", r.policy, decisions.join(", "));
        if r.report.hit_tokens.predicted > 0 {
            line.push_str(&format!("; {}", r.report.hit_tokens));
        }
        if let Some(d) = r.report.index_drift {
            line.push_str(&format!(
                "; index vs engines: phantom {}, missed {} of {} cached blocks",
                d.phantom, d.missed, d.cached
            ));
        }
        println!("{line}");
        if r.report.learned.iter().any(|c| c.samples > 0) {
            let curves: Vec<String> = r
                .report
                .learned
                .iter()
                .map(|c| {
                    format!(
                        "{:.0}/{:.0}/{:.0} ({})",
                        c.ms[0], c.ms[1], c.ms[2], c.samples
                    )
                })
                .collect();
            println!(
                "  learned prefill ms at 1k/8k/32k new tokens (samples), by engine: {}",
                curves.join(", ")
            );
        }
    }
}

/// Per policy (in first-seen order): the setting with the lowest TTFT p99 among those whose
/// hit rate is within one percentage point of that policy's best.
pub fn best_settings(rows: &[Row]) -> Vec<String> {
    let mut policies: Vec<&str> = Vec::new();
    for r in rows {
        if !policies.contains(&r.policy.as_str()) {
            policies.push(&r.policy);
        }
    }
    policies
        .into_iter()
        .filter_map(|p| {
            let mine: Vec<&Row> = rows.iter().filter(|r| r.policy == p).collect();
            let best_hit = mine
                .iter()
                .map(|r| r.report.replay.hit_rate)
                .fold(f64::NEG_INFINITY, f64::max);
            let best = mine
                .iter()
                .filter(|r| r.report.replay.hit_rate >= best_hit - 0.01)
                .min_by(|a, b| {
                    a.report
                        .replay
                        .ttft_ms
                        .p99
                        .total_cmp(&b.report.replay.ttft_ms.p99)
                })?;
            Some(format!(
                "best for {p}: {} (hit {:.1} %, best {:.1} %; TTFT p99 {:.1} ms)",
                setting_label(&best.setting),
                best.report.replay.hit_rate * 100.0,
                best_hit * 100.0,
                best.report.replay.ttft_ms.p99
            ))
        })
        .collect()
}

/// Per policy over runs: mean, min and max hit %, and against the first policy the runs at
/// or above it and the mean difference in points.
fn summary(all: &[Vec<(String, SimReport)>]) -> String {
    let Some(first) = all.first() else {
        return String::new();
    };
    let mut s = format!(
        "{:<20} {:>8} {:>8} {:>8} {:>12} {:>10}\n",
        "policy",
        "mean %",
        "min %",
        "max %",
        format!("≥ {}", first[0].0),
        "mean diff"
    );
    for (p, (name, _)) in first.iter().enumerate() {
        let hits: Vec<f64> = all.iter().map(|r| r[p].1.replay.hit_rate * 100.0).collect();
        let base: Vec<f64> = all.iter().map(|r| r[0].1.replay.hit_rate * 100.0).collect();
        let n = hits.len() as f64;
        let at_least = hits.iter().zip(&base).filter(|(h, b)| h >= b).count();
        let diff = hits.iter().zip(&base).map(|(h, b)| h - b).sum::<f64>() / n;
        s.push_str(&format!(
            "{:<20} {:>8.2} {:>8.2} {:>8.2} {:>12} {:>+10.2}\n",
            name,
            hits.iter().sum::<f64>() / n,
            hits.iter().copied().fold(f64::INFINITY, f64::min),
            hits.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            format!("{at_least}/{}", hits.len()),
            diff
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(hit_rate: f64, ttft_p99: f64) -> SimReport {
        SimReport {
            replay: kvroute_bench::replay::ReplayReport {
                hit_rate,
                ttft_ms: kvroute_bench::replay::LatencySummary {
                    p99: ttft_p99,
                    ..Default::default()
                },
                ..Default::default()
            },
            decisions: Default::default(),
            hit_tokens: Default::default(),
            index_drift: None,
            evicted_blocks: 0,
            learned: Vec::new(),
            prefill_tokens: 0,
            load_cv: 0.0,
            sticky: Default::default(),
            arrival_ms: Vec::new(),
            sync_applied: Default::default(),
            peer_requests_left: 0,
        }
    }

    /// Two runs: b scores 60 against a's 50, then 70 against 75 → b is at least a in 1 of 2
    /// runs, mean difference (10 − 5) / 2 = +2.50 points.
    #[test]
    fn summary_counts_runs_at_least_the_first_policy() {
        let all = vec![
            vec![
                ("a".to_string(), report(0.50, 0.0)),
                ("b".to_string(), report(0.60, 0.0)),
            ],
            vec![
                ("a".to_string(), report(0.75, 0.0)),
                ("b".to_string(), report(0.70, 0.0)),
            ],
        ];
        let s = summary(&all);
        let b = s.lines().find(|l| l.starts_with("b ")).unwrap();
        let cols: Vec<&str> = b.split_whitespace().collect();
        assert_eq!(cols, ["b", "65.00", "60.00", "70.00", "1/2", "+2.50"]);
        let a = s.lines().find(|l| l.starts_with("a ")).unwrap();
        assert!(a.contains("2/2") && a.ends_with("+0.00"), "{a}");
    }

    /// Two knobs give their product, the last varying fastest; values are JSON (numbers)
    /// or strings; unknown knobs and `policy` are refused with the reason.
    #[test]
    fn sweep_grid_is_the_product_of_the_knobs() {
        let g = sweep_grid(&[
            "cache_threshold=0.3,0.5".into(),
            "cache_index=tree,hash".into(),
        ])
        .unwrap();
        let labels: Vec<String> = g.iter().map(setting_label).collect();
        assert_eq!(
            labels,
            [
                "cache_threshold=0.3 cache_index=tree",
                "cache_threshold=0.3 cache_index=hash",
                "cache_threshold=0.5 cache_index=tree",
                "cache_threshold=0.5 cache_index=hash",
            ]
        );
        assert_eq!(sweep_grid(&[]).unwrap(), vec![Vec::new()]);
        let e = sweep_grid(&["cache_treshold=0.3".into()]).unwrap_err();
        assert!(
            e.to_string().contains("unknown knob \"cache_treshold\""),
            "{e}"
        );
        assert!(e.to_string().contains("balance_abs_threshold"), "{e}");
        assert!(sweep_grid(&["policy=round_robin".into()]).is_err());
        assert!(sweep_grid(&["cache_threshold".into()]).is_err());
        assert!(sweep_grid(&["cache_threshold=".into()]).is_err());
    }

    /// A setting lands in the config field of its name; a wrong type or a value validation
    /// refuses is an error.
    #[test]
    fn settings_apply_through_the_serialized_config() {
        let g = sweep_grid(&[
            "balance_abs_threshold=7".into(),
            "cache_threshold=0.25".into(),
        ])
        .unwrap();
        let c = apply_setting(&Config::default(), &g[0]).unwrap();
        assert_eq!(c.balance_abs_threshold, 7);
        assert_eq!(c.cache_threshold, 0.25);
        assert_eq!(
            Config {
                balance_abs_threshold: Config::default().balance_abs_threshold,
                cache_threshold: Config::default().cache_threshold,
                ..c
            },
            Config::default()
        );
        let bad = sweep_grid(&["balance_abs_threshold=lots".into()]).unwrap();
        assert!(apply_setting(&Config::default(), &bad[0]).is_err());
        let bad = sweep_grid(&["cache_threshold=7".into()]).unwrap();
        assert!(apply_setting(&Config::default(), &bad[0]).is_err());
    }

    /// Best setting: among settings within one point of the best hit rate (40 %), the lowest
    /// TTFT p99: 39.5 % at 100 ms beats 40 % at 200 ms; 30 % at 50 ms is too far off.
    #[test]
    fn best_setting_trades_at_most_one_point_of_hit_rate() {
        let row = |v: i64, hit, p99| Row {
            policy: "p".into(),
            setting: vec![("balance_abs_threshold".into(), json!(v))],
            report: report(hit, p99),
            wall_s: 0.0,
        };
        let rows = [
            row(1, 0.40, 200.0),
            row(2, 0.395, 100.0),
            row(3, 0.30, 50.0),
        ];
        let best = best_settings(&rows);
        assert_eq!(best.len(), 1);
        assert!(
            best[0].starts_with("best for p: balance_abs_threshold=2 "),
            "{}",
            best[0]
        );
    }

    /// `--plot` into a path under a file: the error names the flag and the directory.
    #[test]
    fn plot_into_an_unwritable_path_names_it() {
        let file = std::env::temp_dir().join(format!("kvroute-sim-plot-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let dir = file.join("plots");
        let rows = [Row {
            policy: "round_robin".into(),
            setting: Vec::new(),
            report: report(0.5, 10.0),
            wall_s: 0.0,
        }];
        let e = plot_rows(&dir, "", &rows, 0.6, 2).unwrap_err();
        let msg = format!("{e:#}");
        std::fs::remove_file(&file).unwrap();
        assert!(
            msg.starts_with(&format!(
                "--plot {}: creating plot directory {}",
                dir.display(),
                dir.display()
            )),
            "{msg}"
        );
        assert!(msg.ends_with("Not a directory (os error 20)"), "{msg}");
    }

    /// The `--out` entry has exactly the documented keys.
    #[test]
    fn out_entry_has_the_documented_shape() {
        let r = Row {
            policy: "round_robin".into(),
            setting: Vec::new(),
            report: report(0.5, 10.0),
            wall_s: 1.5,
        };
        let v = row_json(&r, 0.6);
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "bound_hit_rate",
                "e2e_ms",
                "errors",
                "hit_rate",
                "load_cv",
                "max_over_mean_load",
                "policy",
                "prefill_tokens",
                "requests",
                "setting",
                "sticky_share",
                "tpot_ms",
                "ttft_ms",
                "wall_s",
            ]
        );
        for lat in ["ttft_ms", "e2e_ms"] {
            let mut k: Vec<&str> = v[lat]
                .as_object()
                .unwrap()
                .keys()
                .map(|k| k.as_str())
                .collect();
            k.sort_unstable();
            assert_eq!(k, ["p50", "p90", "p99"]);
        }
        assert_eq!(v["bound_hit_rate"], 0.6);
        assert_eq!(v["wall_s"], 1.5);
    }
}
