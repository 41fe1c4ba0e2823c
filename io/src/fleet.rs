//! The workload and the fleet that `kvroute demo` and `kvroute simulate` share: the same
//! flags ([`FleetArgs`]) give the same engines, replicas and arrivals in both ([`Fleet`]).

use anyhow::Context;
use kvroute_bench::engine::{self, EngineConfig};
use kvroute_bench::sim::{self, Run, SimConfig};
use kvroute_bench::trace::{self, Trace, TraceRecord};
use kvroute_bench::workload::{self, WorkloadParams};
use kvroute_core::config::Config;
use std::path::{Path, PathBuf};

/// Engines the demo starts.
pub const DEMO_ENGINES: usize = 4;
/// Router replicas per run in the demo. Source: seed doc (one router).
pub const DEMO_REPLICAS: usize = 1;
/// KV capacity of each demo engine, blocks of 16 tokens: 4,096 blocks = 65,536 tokens, about
/// a quarter of the built-in workload's distinct prompt tokens, so a cache-blind spread of
/// every prefix over all engines evicts, as a real fleet under load does.
pub const DEMO_NUM_GPU_BLOCKS: usize = 4_096;
/// Tokens a replayed chat adds to its record's `input_length`: the chat template around its
/// one user message (Qwen3's 3 + 5, `../shared/reference/traces.md` §3), with room for
/// longer templates. The engines' context length leaves this much beyond the trace's
/// longest request, so that vLLM's context check (400) refuses none.
pub const TEMPLATE_ROOM: usize = 64;
/// KV capacity of each demo engine when replaying a trace file, blocks of 16 tokens (vLLM's
/// 16,384-block default, 262,144 tokens): Mooncake prompts average 12k tokens and reach 126k.
pub const DEMO_TRACE_NUM_GPU_BLOCKS: usize = 16_384;
/// Demo engines run the timing model this many times faster than real time.
pub const DEMO_SPEEDUP_RATIO: f64 = 4.0;
/// Trace timestamps are divided by this in the demo.
pub const DEMO_TIME_SCALE: f64 = 4.0;

/// The workload and fleet flags of `kvroute demo` and `kvroute simulate`.
#[derive(clap::Args, Debug, Clone)]
pub struct FleetArgs {
    /// Replay this trace instead of the built-in workload: a Mooncake JSONL file (open loop;
    /// `demo` takes only these), or for `simulate` also a WEKA JSON document or a directory
    /// of them (closed loop, one conversation per file); the format is detected.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Take only the first N requests of the workload.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Simulated engines (started on loopback by `demo`).
    #[arg(long, default_value_t = DEMO_ENGINES)]
    pub engines: usize,
    /// KV capacity of each engine, blocks [default: 4,096 for the built-in workload, 16,384
    /// with --trace; never below what the longest prompt needs].
    #[arg(long, conflicts_with = "capacity_factor")]
    pub num_gpu_blocks: Option<usize>,
    /// KV capacity of each engine as a multiple of the largest request's prompt:
    /// `num_gpu_blocks = ⌈factor × max input tokens / 16⌉` (e.g. 1.25; never below what the
    /// longest request needs).
    #[arg(long)]
    pub capacity_factor: Option<f64>,
    /// Engine speed-up over the timing model.
    #[arg(long, default_value_t = DEMO_SPEEDUP_RATIO)]
    pub speedup_ratio: f64,
    /// Trace time compression (timestamps divided by this).
    #[arg(long, default_value_t = DEMO_TIME_SCALE)]
    pub time_scale: f64,
    /// Router replicas per run, each with its own indexes (and, for the events run, its own
    /// subscription to every engine), behind a round-robin balancer: the k-th request goes
    /// to replica k mod N, so a conversation's turns reach different replicas, as behind an
    /// L4 load balancer in front of a highly available router tier.
    #[arg(long, default_value_t = DEMO_REPLICAS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=16))]
    pub replicas: usize,
    /// Engine load reports every this many ms (`kvroute serve --load-poll-ms`; virtual ms in
    /// `simulate`), 0 = off: with replicas, each then counts the requests the others sent.
    #[arg(long, default_value_t = kvroute_core::config::defaults::LOAD_POLL_MS)]
    pub load_poll_ms: u64,
}

impl FleetArgs {
    /// The fleet these flags set up for `records` (KV capacity from [`engine_blocks`], or
    /// from [`capacity_blocks`] with `--capacity-factor`).
    pub fn fleet(&self, records: &[TraceRecord]) -> Fleet {
        let requested = self
            .num_gpu_blocks
            .or_else(|| self.capacity_factor.map(|f| capacity_blocks(f, records)));
        Fleet {
            engines: self.engines,
            num_gpu_blocks: engine_blocks(requested, self.trace.is_some(), records),
            max_model_len: records
                .iter()
                .map(|r| r.input_length as usize + r.output_length as usize + TEMPLATE_ROOM)
                .max()
                .unwrap_or(0)
                .max(engine::defaults::MAX_MODEL_LEN),
            speedup_ratio: self.speedup_ratio,
            time_scale: self.time_scale,
            replicas: self.replicas,
            load_poll_ms: self.load_poll_ms,
            sync_delay_ms: None,
        }
    }
}

/// The workload: a trace file's first `max_requests` records, or the built-in workload.
///
/// # Errors
/// The trace cannot be read or parsed.
pub fn load_records(
    trace: Option<&Path>,
    max_requests: Option<usize>,
) -> anyhow::Result<Vec<TraceRecord>> {
    let mut records = match trace {
        Some(path) => trace::load_mooncake(path, max_requests)
            .with_context(|| format!("loading {}", path.display()))?,
        None => workload::builtin_workload(&WorkloadParams::default()),
    };
    if let Some(n) = max_requests {
        records.truncate(n);
    }
    Ok(records)
}

/// The workload of `kvroute simulate`: a trace file or directory in any format
/// ([`trace::load_trace`]), or the built-in workload (open loop), first `max_requests`
/// records.
///
/// # Errors
/// The trace cannot be read or parsed.
pub fn load_trace(trace: Option<&Path>, max_requests: Option<usize>) -> anyhow::Result<Trace> {
    match trace {
        Some(path) => trace::load_trace(path, max_requests)
            .with_context(|| format!("loading {}", path.display())),
        None => Ok(Trace::mooncake(load_records(None, max_requests)?)),
    }
}

/// KV blocks of 16 tokens for `factor` times the largest prompt of `records`:
/// `⌈factor × max input_length / 16⌉` (0 for no records or a factor ≤ 0).
pub fn capacity_blocks(factor: f64, records: &[TraceRecord]) -> usize {
    let max_input = records.iter().map(|r| r.input_length).max().unwrap_or(0);
    let blocks = (factor * f64::from(max_input) / engine::defaults::BLOCK_SIZE as f64).ceil();
    if blocks.is_finite() && blocks > 0.0 {
        blocks as usize
    } else {
        0
    }
}

/// KV capacity of each demo engine, blocks: `requested`, else [`DEMO_TRACE_NUM_GPU_BLOCKS`]
/// for a trace file and [`DEMO_NUM_GPU_BLOCKS`] for the built-in workload; never below what
/// the longest request of `records` needs (prompt + output, plus 2 blocks).
pub fn engine_blocks(requested: Option<usize>, trace: bool, records: &[TraceRecord]) -> usize {
    let longest_blocks = records
        .iter()
        .map(|r| {
            (r.input_length as usize + r.output_length as usize) / engine::defaults::BLOCK_SIZE + 2
        })
        .max()
        .unwrap_or(0);
    requested
        .unwrap_or(if trace {
            DEMO_TRACE_NUM_GPU_BLOCKS
        } else {
            DEMO_NUM_GPU_BLOCKS
        })
        .max(longest_blocks)
}

/// The fleet a demo run or a simulated run sets up: the same fields give the same engines,
/// replicas and arrivals in both.
#[derive(Debug, Clone, Copy)]
pub struct Fleet {
    /// Engines.
    pub engines: usize,
    /// KV capacity of each engine, blocks.
    pub num_gpu_blocks: usize,
    /// Context length of an engine (prompt + output), tokens: the engine default, raised to
    /// the workload's longest request plus [`TEMPLATE_ROOM`] so that every request is
    /// served (WEKA prompts reach 310k).
    pub max_model_len: usize,
    /// Engine speed-up over the timing model.
    pub speedup_ratio: f64,
    /// Trace timestamps are divided by this.
    pub time_scale: f64,
    /// Router replicas.
    pub replicas: usize,
    /// Engine load reports, ms (0 = off).
    pub load_poll_ms: u64,
    /// Replica sync's delivery delay, virtual ms (`None`: replicas do not sync).
    pub sync_delay_ms: Option<f64>,
}

impl Fleet {
    /// The simulator's config for `run` on this fleet, every other setting at its default
    /// (the router's [`Config::default`], seed [`sim::DEFAULT_SEED`], events delay
    /// [`sim::DEFAULT_EVENT_DELAY_MS`], spread [`sim::DEFAULT_SPREAD_SECS`], decoded events).
    pub fn config(&self, run: Run) -> SimConfig {
        SimConfig {
            engines: self.engines,
            engine: EngineConfig {
                num_gpu_blocks: self.num_gpu_blocks,
                speedup_ratio: self.speedup_ratio,
                max_model_len: self.max_model_len,
                ..EngineConfig::default()
            },
            router: Config {
                policy: run.policy,
                load_poll_ms: self.load_poll_ms,
                ..Config::default()
            },
            routing: run.routing,
            time_scale: self.time_scale,
            seed: sim::DEFAULT_SEED,
            event_delay_ms: sim::DEFAULT_EVENT_DELAY_MS,
            replicas: self.replicas,
            sync_delay_ms: self.sync_delay_ms,
            spread_secs: sim::DEFAULT_SPREAD_SECS,
            wire_events: false,
            engine_speedups: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(input_length: u32) -> TraceRecord {
        TraceRecord {
            timestamp_ms: 0,
            input_length,
            output_length: 10,
            hash_ids: vec![0],
        }
    }

    /// Worked example: the largest prompt is 310,241 tokens (WEKA trace_0056); 1.25 × that
    /// / 16 = 24,237.6 → 24,238 blocks.
    #[test]
    fn capacity_factor_scales_the_largest_prompt() {
        let records = [rec(15_459), rec(310_241)];
        assert_eq!(capacity_blocks(1.25, &records), 24_238);
        assert_eq!(capacity_blocks(1.25, &[]), 0);
        assert_eq!(capacity_blocks(-1.0, &records), 0);
        // Never below what the longest request needs (prompt + output + 2 blocks).
        assert_eq!(engine_blocks(Some(10), true, &records), 310_251 / 16 + 2);
    }
}
