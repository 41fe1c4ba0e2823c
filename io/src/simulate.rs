//! `kvroute simulate`: the demo's comparison on the discrete-event simulator
//! ([`kvroute_bench::sim`]): the same policies, engines and workload on a virtual clock, so a
//! run takes about a second, has no run-to-run noise, and can be repeated over seeds.

use crate::fleet::{self, FleetArgs};
use anyhow::Context;
use kvroute_bench::replay;
use kvroute_bench::sim::{self, Run, SimReport};
use kvroute_bench::trace::{self, PromptBuilder, WordIds};
use kvroute_bench::workload::{self, WorkloadParams};
use kvroute_tokenize::Tokenizer;
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
    /// Seed of the router's tie-breaking RNG (run 0).
    #[arg(long, default_value_t = sim::DEFAULT_SEED)]
    pub seed: u64,
    /// Seed of the built-in workload (run 0).
    #[arg(long, default_value_t = workload::DEFAULT_SEED)]
    pub workload_seed: u64,
    /// Virtual ms from an engine step's start until its KV events are in the router's index.
    #[arg(long, default_value_t = sim::DEFAULT_EVENT_DELAY_MS)]
    pub event_delay_ms: f64,
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
    /// Write every run's reports as JSON to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `kvroute simulate`: prints one comparison table per run (or, with `--runs` > 1, one line
/// per run and a summary per policy).
///
/// # Errors
/// Unknown policy, unreadable trace, invalid engine config, a stalled engine.
pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
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
    let tokenizer = Tokenizer::qwen3()?;
    let prompts = PromptBuilder::new(
        WordIds::from_tokenizer(&tokenizer)?,
        trace::MOONCAKE_NAMESPACE,
    );
    let file = match &args.fleet.trace {
        Some(p) => Some(fleet::load_records(Some(p), args.fleet.max_requests)?),
        None => None,
    };
    let mut all: Vec<Vec<(String, SimReport)>> = Vec::with_capacity(args.runs);
    for k in 0..args.runs {
        let records = match &file {
            Some(r) => r.clone(),
            None => {
                let mut r = workload::builtin_workload(&WorkloadParams {
                    seed: args.workload_seed.wrapping_add(k as u64),
                    ..WorkloadParams::default()
                });
                if let Some(n) = args.fleet.max_requests {
                    r.truncate(n);
                }
                r
            }
        };
        let fleet = args.fleet.fleet(&records);
        let mut reports = Vec::with_capacity(runs.len());
        for (name, run) in &runs {
            let mut cfg = fleet.config(*run);
            cfg.router.cache_threshold = args.cache_threshold;
            cfg.router.balance_rel_threshold = args.balance_rel_threshold;
            cfg.router.balance_abs_threshold = args.balance_abs_threshold;
            cfg.router.knobs.set_all(&args.knobs)?;
            cfg.seed = args.seed.wrapping_add(k as u64);
            cfg.event_delay_ms = args.event_delay_ms;
            let rep = sim::simulate(&records, &prompts, &cfg)
                .with_context(|| format!("simulating {name}"))?;
            reports.push((name.clone(), rep));
        }
        if args.runs == 1 {
            eprintln!(
                "kvroute simulate: {} requests, {} engines x {} KV blocks, speed-up {}, time \
                 scale {} (virtual time)",
                records.len(),
                fleet.engines,
                fleet.num_gpu_blocks,
                fleet.speedup_ratio,
                fleet.time_scale
            );
            print_one(&reports);
        } else {
            let line: Vec<String> = reports
                .iter()
                .map(|(n, r)| format!("{n} {:.2}", r.replay.hit_rate * 100.0))
                .collect();
            println!("run {k}: hit % {}", line.join(", "));
        }
        all.push(reports);
    }
    if args.runs > 1 {
        println!("{}", summary(&all));
    }
    eprintln!(
        "simulate finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_vec_pretty(&all)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// One run: the demo's table, then per policy its decisions, hit tokens and index drift.
fn print_one(reports: &[(String, SimReport)]) {
    let table: Vec<_> = reports
        .iter()
        .map(|(n, r)| (n.clone(), r.replay.clone()))
        .collect();
    println!("{}", replay::comparison_table(&table));
    for (name, r) in reports {
        let decisions: Vec<String> = r
            .decisions
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let mut line = format!("{name}: {}", decisions.join(", "));
        if r.hit_tokens.predicted > 0 {
            line.push_str(&format!("; {}", r.hit_tokens));
        }
        if let Some(d) = r.index_drift {
            line.push_str(&format!(
                "; index vs engines: phantom {}, missed {} of {} cached blocks",
                d.phantom, d.missed, d.cached
            ));
        }
        println!("{line}");
        if r.learned.iter().any(|c| c.samples > 0) {
            let curves: Vec<String> = r
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

    fn report(hit_rate: f64) -> SimReport {
        SimReport {
            replay: replay::ReplayReport {
                hit_rate,
                ..Default::default()
            },
            decisions: Default::default(),
            hit_tokens: Default::default(),
            index_drift: None,
            evicted_blocks: 0,
        }
    }

    /// Two runs: b scores 60 against a's 50, then 70 against 75 → b is at least a in 1 of 2
    /// runs, mean difference (10 − 5) / 2 = +2.50 points.
    #[test]
    fn summary_counts_runs_at_least_the_first_policy() {
        let all = vec![
            vec![
                ("a".to_string(), report(0.50)),
                ("b".to_string(), report(0.60)),
            ],
            vec![
                ("a".to_string(), report(0.75)),
                ("b".to_string(), report(0.70)),
            ],
        ];
        let s = summary(&all);
        let b = s.lines().find(|l| l.starts_with("b ")).unwrap();
        let cols: Vec<&str> = b.split_whitespace().collect();
        assert_eq!(cols, ["b", "65.00", "60.00", "70.00", "1/2", "+2.50"]);
        let a = s.lines().find(|l| l.starts_with("a ")).unwrap();
        assert!(a.contains("2/2") && a.ends_with("+0.00"), "{a}");
    }
}
