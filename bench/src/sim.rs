//! Discrete-event simulator: replays a workload through the router's own policy code
//! ([`Router`]) and simulated engines ([`EngineCore`]) on a virtual clock. No sockets, no
//! threads, no wall clock: the same records, config and seed give the same report, and a
//! demo-sized run takes well under a second.
//!
//! What it shares with `kvroute demo` and what it leaves out:
//! - **Same code**: the policy ([`Router::decide`] then [`Router::record`], a seeded RNG breaking load ties), the
//!   router's trees, the engine's block manager, scheduler and timing model, the KV-event wire
//!   format (each step's events are encoded as vLLM does, decoded by
//!   [`kvroute_core::events::decode`] and applied through [`Consumer`] into an [`EventIndex`]).
//! - **Same arrivals**: record `i` arrives at `timestamp_ms / time_scale`; the engines run
//!   their timing model divided by `speedup_ratio` (engine-model.md §4), as in the demo.
//! - **Left out**: HTTP, tokenization time and the chat template (prompts are the records'
//!   token ids, [`PromptBuilder::prompt_tokens`]; text routing sees
//!   [`PromptBuilder::prompt_text`]), OS scheduling noise. KV events reach the router
//!   `event_delay_ms` after the step that produced them starts (default 0).
//!
//! Loads are what the gateway counts, with its own code ([`Workers`], [`LoadGuard`]): requests
//! a replica routed to a worker and that have not finished, plus, with load reports, the
//! engine's other requests.
//!
//! Event order at one instant: engine steps that end, then KV events due, then load reports,
//! then arrivals, then engines with work start their next step (a request that arrives while its engine is
//! stepping waits for the next step, as in the engine server's driver).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use kvroute_core::config::{Config, PolicyKind};
use kvroute_core::events::{Consumer, EventIndex, Input, StreamId, Tier};
use kvroute_core::load::EngineReport;
use kvroute_core::metrics::HitTokens;
use kvroute_core::policy::{Reason, Router, Snapshot, WorkerLoad};
use kvroute_core::route_key::RouteKey;
use kvroute_core::workers::LoadGuard;
use kvroute_core::workers::Workers;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Serialize;

use crate::engine::events::{Encoding, encode_batch};
use crate::engine::{EngineConfig, EngineCore, EngineError};
use crate::replay::{self, ReplayConfig, ReplayReport, RequestSample};
use crate::trace::{PromptBuilder, SplitMix64, TraceRecord};

/// Name of the run that routes cache_aware on engine KV events (issue 5).
pub const EVENTS_RUN: &str = "cache_aware_events";
/// Name of the run that routes cache_aware on the token tree: token mode without events, the
/// control for [`EVENTS_RUN`].
pub const TOKENS_RUN: &str = "cache_aware_tokens";
/// Default seed of the simulator's tie-breaking RNG.
pub const DEFAULT_SEED: u64 = 1;
/// Default delay from an engine step's start to its KV events reaching the router's index, ms
/// of virtual time.
pub const DEFAULT_EVENT_DELAY_MS: f64 = 0.0;

/// What a cache-aware router matches prompts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Prompt text on the string tree (the gateway without a tokenizer).
    Text,
    /// Token ids on the token tree (the gateway with a tokenizer, no events).
    Tokens,
    /// Token ids on the engines' KV events, the token tree while no engine has announced a
    /// match (issue 5 item 5).
    Events,
}

/// A named run of the demo and the simulator: a policy and what it routes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// The router's policy.
    pub policy: PolicyKind,
    /// What cache_aware matches on (ignored by the other policies).
    pub routing: Routing,
}

/// Name of the run of `kvroute serve`'s default policy on KV events.
pub const DEFAULT_RUN: &str = "default";

/// Name that expands to every policy ([`expand_runs`]).
pub const ALL_RUNS: &str = "all";

/// The comparison `kvroute demo` and `kvroute simulate` run by default: the anchors'
/// algorithms (`round_robin`, `least_load`, `smg_cache_aware`, `dynamo_kv`) against
/// kvroute's default policy on text and on events ([`DEFAULT_RUN`]).
pub fn comparison_runs() -> Vec<String> {
    let default = kvroute_core::config::defaults::POLICY.as_str();
    [
        "round_robin",
        "least_load",
        "smg_cache_aware",
        "dynamo_kv",
        default,
        DEFAULT_RUN,
    ]
    .map(String::from)
    .into()
}

/// `names` with [`ALL_RUNS`] replaced by every policy and preset, each on its natural index:
/// the cache-blind policies and `prefix_hash` / `consistent_hash` as they are, `cache_aware`
/// on text and on events, the other index readers on events.
pub fn expand_runs(names: &[String]) -> Vec<String> {
    names
        .iter()
        .flat_map(|n| {
            if n != ALL_RUNS {
                return vec![n.clone()];
            }
            PolicyKind::ALL
                .iter()
                .flat_map(|p| match p {
                    PolicyKind::CacheAware => vec![p.to_string(), EVENTS_RUN.to_string()],
                    PolicyKind::KvAware | PolicyKind::PureAffinity | PolicyKind::PredictedTtft => {
                        vec![format!("{p}_events")]
                    }
                    _ => vec![p.to_string()],
                })
                .collect()
        })
        .collect()
}

impl std::str::FromStr for Run {
    type Err = kvroute_core::CoreError;

    /// A policy name ([`PolicyKind`]), optionally suffixed `_tokens` (token ids on the token
    /// tree) or `_events` (token ids on the KV events); unsuffixed, a policy routes on text,
    /// except the presets, on their anchors' own index: `smg_cache_aware` on the token tree
    /// (SMG with a tokenizer), `dynamo_kv` on events. [`DEFAULT_RUN`]: the default policy
    /// ([`kvroute_core::config::defaults::POLICY`]) on events.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        if name == DEFAULT_RUN {
            return Ok(Self {
                policy: kvroute_core::config::defaults::POLICY,
                routing: Routing::Events,
            });
        }
        let (base, routing) = if let Some(b) = name.strip_suffix("_events") {
            (b, Some(Routing::Events))
        } else if let Some(b) = name.strip_suffix("_tokens") {
            (b, Some(Routing::Tokens))
        } else {
            (name, None)
        };
        let policy: PolicyKind = base.parse()?;
        let routing = routing.unwrap_or(match policy {
            PolicyKind::SmgCacheAware => Routing::Tokens,
            PolicyKind::DynamoKv => Routing::Events,
            _ => Routing::Text,
        });
        Ok(Self { policy, routing })
    }
}

/// Settings of one simulated run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Engines behind the router (worker ids `0..engines`).
    pub engines: usize,
    /// Template of every engine; engine `i` gets `seed = i` (as in the demo).
    pub engine: EngineConfig,
    /// The router's settings (policy, thresholds, block size; sockets and workers ignored).
    /// `load_poll_ms` > 0: every that many virtual ms each replica counts every engine's
    /// running + waiting requests beyond its own
    /// ([`kvroute_core::workers::Worker::report`]), read the instant of the poll.
    pub router: Config,
    /// What cache_aware routes on.
    pub routing: Routing,
    /// Trace timestamps (ms) are divided by this; > 0.
    pub time_scale: f64,
    /// Seed of the RNG that breaks load ties.
    pub seed: u64,
    /// Virtual ms from a step's start until its KV events are in the router's index; ≥ 0.
    pub event_delay_ms: f64,
    /// Router replicas (≥ 1), each with its own indexes and load counts, behind a round-robin
    /// balancer: request `i` goes to replica `i mod replicas` (as `kvroute demo --replicas`).
    /// With events, every replica reads the same event index (each would subscribe to every
    /// engine and index the same events).
    pub replicas: usize,
}

/// Errors of [`simulate`].
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// `engines` or `replicas` is 0.
    #[error("the simulator needs at least one engine and one router replica")]
    NoEngines,
    /// `time_scale` or `event_delay_ms` out of range.
    #[error("{field} must be finite and {rule}, got {value}")]
    BadParameter {
        /// Which.
        field: &'static str,
        /// The rule broken.
        rule: &'static str,
        /// The value given.
        value: f64,
    },
    /// An engine config is invalid.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// An engine had work but its step scheduled nothing (a model bug; never loops forever).
    #[error("engine {worker} stalled at {at_ms} ms with work queued")]
    Stalled {
        /// Worker id.
        worker: usize,
        /// Virtual time, ms.
        at_ms: f64,
    },
}

/// Outcome of one simulated run.
#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    /// The same aggregate as a live replay: hit rate, TTFT / TPOT / e2e in virtual ms, load
    /// spread; workers are named `sim-<id>`; `duration_s` is virtual seconds; requests an
    /// engine rejected are errors `status_400`.
    pub replay: ReplayReport,
    /// Decisions per reason ([`Reason::as_str`]).
    pub decisions: BTreeMap<&'static str, u64>,
    /// On cache hits, the router's prediction against what the engines served, tokens.
    pub hit_tokens: HitTokens,
    /// With [`Routing::Events`]: the router's index against the engines' cached blocks after
    /// the run, blocks.
    pub index_drift: Option<IndexDrift>,
    /// Blocks the engines evicted, summed.
    pub evicted_blocks: u64,
    /// Each engine's prefill curve as the first router replica learned it by the end:
    /// predicted ms of one request's prefill of 1,024 / 8,192 / 32,768 new tokens (idle
    /// worker, no decode) and the samples learned from ([`kvroute_core::load::timing`]).
    pub learned: Vec<LearnedCurve>,
}

/// One engine's learned prefill curve at the end of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LearnedCurve {
    /// Predicted ms for 1,024 / 8,192 / 32,768 new tokens.
    pub ms: [f64; 3],
    /// Coefficients (a, b, c, d) in [`kvroute_core::load::timing::PRIOR`]'s units.
    pub coefficients: [f64; 4],
    /// Samples learned from.
    pub samples: u64,
}

/// The event index against the engines' cached blocks, summed over engines, blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct IndexDrift {
    /// Indexed, not cached.
    pub phantom: usize,
    /// Cached, not indexed.
    pub missed: usize,
    /// Cached.
    pub cached: usize,
}

/// One engine and the step it is running.
struct Slot {
    core: EngineCore,
    /// End of the running step; `None` = idle.
    busy_until: Option<f64>,
    /// Tokens the running step emits at its end.
    outputs: Vec<(u64, crate::engine::TokenOut)>,
    /// Seq of the next KV-event batch.
    seq: u64,
}

/// A request between arrival and its last token.
struct Live {
    /// Its count and booking on its replica's worker registry, until it finishes.
    load: LoadGuard,
    arrival_ms: f64,
    reason: Reason,
}

/// Replays `records` (timestamps ascending) through a router and `cfg.engines` simulated
/// engines on a virtual clock; see the module doc for what is modelled.
///
/// # Errors
/// [`SimError`] for a bad config, or an engine that stalls.
pub fn simulate(
    records: &[TraceRecord],
    prompts: &PromptBuilder,
    cfg: &SimConfig,
) -> Result<SimReport, SimError> {
    if cfg.engines == 0 || cfg.replicas == 0 {
        return Err(SimError::NoEngines);
    }
    let check = |field, ok: bool, rule, value| {
        if ok {
            Ok(())
        } else {
            Err(SimError::BadParameter { field, rule, value })
        }
    };
    check(
        "time_scale",
        cfg.time_scale.is_finite() && cfg.time_scale > 0.0,
        "> 0",
        cfg.time_scale,
    )?;
    check(
        "event_delay_ms",
        cfg.event_delay_ms.is_finite() && cfg.event_delay_ms >= 0.0,
        ">= 0",
        cfg.event_delay_ms,
    )?;
    let mut slots = (0..cfg.engines)
        .map(|i| {
            Ok(Slot {
                core: EngineCore::new(&EngineConfig {
                    seed: i as u64,
                    ..cfg.engine.clone()
                })?,
                busy_until: None,
                outputs: Vec::new(),
                seq: 0,
            })
        })
        .collect::<Result<Vec<_>, SimError>>()?;
    let on_events = cfg.router.policy.records() && cfg.routing == Routing::Events;
    let mut index = EventIndex::new(cfg.router.block_size);
    let mut consumer = Consumer::new();
    let urls: Vec<String> = (0..cfg.engines)
        .map(|i| format!("http://sim-{i}:80"))
        .collect();
    let replicas = (0..cfg.replicas)
        .map(|_| {
            let mut router = Router::new(&cfg.router);
            if on_events {
                router.set_event_index(index.reader());
            }
            Ok((router, Workers::new(&urls)?))
        })
        .collect::<Result<Vec<_>, kvroute_core::CoreError>>()
        .expect("sim worker urls are valid");
    let all_engines: Vec<usize> = (0..cfg.engines).collect();
    let poll_ms = cfg.router.load_poll_ms as f64;
    let mut next_poll = (cfg.router.load_poll_ms > 0).then_some(0.0f64);
    let stream_base = SplitMix64::from_state(cfg.seed).next_u64();
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut samples: Vec<RequestSample> = (0..records.len())
        .map(|index| RequestSample {
            index,
            ..RequestSample::default()
        })
        .collect();
    let mut report = SimReport {
        replay: ReplayReport::default(),
        decisions: BTreeMap::new(),
        hit_tokens: HitTokens::default(),
        index_drift: None,
        evicted_blocks: 0,
        learned: Vec::new(),
    };
    // (due, worker, seq, msgpack batch): FIFO is time order (constant delay).
    let mut events: VecDeque<(f64, usize, u64, Vec<u8>)> = VecDeque::new();
    let arrival = |i: usize| records[i].timestamp_ms as f64 / cfg.time_scale;
    let mut next = 0usize;
    let mut last_ms = 0.0f64;
    loop {
        let more = next < records.len() || !live.is_empty();
        let t = [
            slots.iter().filter_map(|s| s.busy_until).reduce(f64::min),
            events.front().map(|e| e.0),
            (next < records.len()).then(|| arrival(next)),
            next_poll.filter(|_| more),
        ]
        .into_iter()
        .flatten()
        .reduce(f64::min);
        let Some(t) = t else { break };
        last_ms = t;
        // 1. Steps ending now emit their tokens.
        for slot in slots.iter_mut() {
            if slot.busy_until != Some(t) {
                continue;
            }
            for (id, tok) in std::mem::take(&mut slot.outputs) {
                let (Some(l), s) = (live.get(&id), &mut samples[id as usize]) else {
                    continue;
                };
                if let Some(p) = tok.prompt {
                    s.prompt_tokens = u64::from(p.prompt_tokens);
                    s.cached_tokens = u64::from(p.cached_tokens);
                    l.load.served(s.prompt_tokens, s.cached_tokens);
                    l.load.first_token(t);
                    s.ttft_us = Some(((t - l.arrival_ms) * 1e3) as u64);
                    if let Some(predicted) = l.reason.predicted_cached_tokens(s.prompt_tokens) {
                        report.hit_tokens.add(predicted, s.cached_tokens);
                    }
                }
                s.completion_tokens += 1;
                if tok.finish.is_some() {
                    s.e2e_us = ((t - l.arrival_ms) * 1e3) as u64;
                    s.status = Some(200);
                    s.usage_seen = true;
                    live.remove(&id);
                }
            }
        }
        // 2. KV events due reach the router's index.
        while events.front().is_some_and(|e| e.0 <= t) {
            let (_, w, seq, payload) = events.pop_front().expect("front checked");
            let stream = StreamId {
                worker: w as u32,
                rank: 0,
            };
            index.set_now(t as u64);
            let replay = consumer.handle(
                &mut index,
                stream,
                Input::Live {
                    seq,
                    payload: &payload,
                },
            );
            debug_assert!(
                replay.is_none(),
                "a lossless stream never asks for a replay"
            );
            let blocks = index.worker_blocks(w as u32) as u64;
            for (_, workers) in &replicas {
                if let Some(worker) = workers.get(w) {
                    worker.set_cached_blocks(Some(blocks));
                }
            }
        }
        // 3. Load reports: every replica reads every engine's running + waiting now.
        if next_poll.is_some_and(|p| p <= t) {
            for (_, workers) in &replicas {
                for (w, slot) in slots.iter().enumerate() {
                    let st = slot.core.stats();
                    if let Some(worker) = workers.get(w) {
                        worker.report_engine(Some(EngineReport {
                            running: st.running,
                            waiting: st.waiting,
                            waiting_tokens: None,
                            kv_usage: Some(st.kv_usage),
                            capacity_blocks: Some(cfg.engine.num_gpu_blocks as u64),
                        }));
                    }
                }
            }
            next_poll = Some(t + poll_ms);
        }
        // 4. Arrivals are routed and queued on their engine.
        while next < records.len() && arrival(next) <= t {
            let r = &records[next];
            let ids = prompts.prompt_tokens(r);
            let key = RouteKey {
                text: match cfg.routing {
                    Routing::Text => prompts.prompt_text(r),
                    Routing::Tokens | Routing::Events => String::new(),
                },
                input_ids: (cfg.routing != Routing::Text).then(|| ids.clone()),
                ..RouteKey::default()
            };
            // Common random numbers: request i's tie-breaks draw from its own stream, so two
            // runs that see the same candidates and loads for it decide the same, and runs of
            // different policies diverge only where their indexes differ.
            let mut rng = StdRng::seed_from_u64(stream_base.wrapping_add(next as u64));
            let (router, workers) = &replicas[next % replicas.len()];
            // The gateway's two steps: a read-only decision on a snapshot of every engine
            // (all eligible: the simulator has no faults), then the record, since the request
            // is committed to its engine at once. `seq` counts this replica's requests.
            let loads: Vec<WorkerLoad> = workers.iter().iter().map(|w| w.load_view(t)).collect();
            let snap = Snapshot {
                workers: &loads,
                eligible: &all_engines,
                seq: (next / replicas.len()) as u64,
                now_ms: t as u64,
            };
            let d = router.decide(&snap, &key, &mut rng);
            let booking = router.booking(&snap, &key, &d);
            router.record(&key, &d, t as u64);
            *report.decisions.entry(d.reason.as_str()).or_default() += 1;
            let s = &mut samples[next];
            s.worker = Some(format!("sim-{}", d.worker));
            match slots[d.worker]
                .core
                .add_request(next as u64, ids, r.output_length)
            {
                Ok(()) => {
                    live.insert(
                        next as u64,
                        Live {
                            load: workers
                                .get(d.worker)
                                .expect("sim workers are never removed")
                                .acquire_booked(booking, t),
                            arrival_ms: t,
                            reason: d.reason,
                        },
                    );
                }
                Err(_) => {
                    s.status = Some(400);
                    s.error = Some("status_400".into());
                }
            }
            next += 1;
        }
        // 5. Engines with work start a step now; its events are published at its start.
        for (w, slot) in slots.iter_mut().enumerate() {
            if slot.busy_until.is_some_and(|b| b > t) {
                continue;
            }
            if slot.core.is_idle() {
                slot.busy_until = None;
                continue;
            }
            let out = slot.core.step(t);
            if out.prefill_tokens == 0 && out.decode_requests == 0 && out.outputs.is_empty() {
                return Err(SimError::Stalled {
                    worker: w,
                    at_ms: t,
                });
            }
            if on_events && !out.events.is_empty() {
                let bs = slot.core.block_size();
                let payload = encode_batch(t / 1e3, &out.events, bs, Encoding::Array, 0);
                events.push_back((t + cfg.event_delay_ms, w, slot.seq, payload));
                slot.seq += 1;
            }
            slot.busy_until = Some(t + out.duration_ms);
            slot.outputs = out.outputs;
        }
    }
    debug_assert!(live.is_empty(), "every routed request finishes");
    let rcfg = ReplayConfig {
        url: "sim".into(),
        model: cfg.engine.model_name.clone(),
        time_scale: cfg.time_scale,
        expected_workers: Some(cfg.engines),
        keep_samples: true,
        ..ReplayConfig::default()
    };
    let first_ms = records
        .first()
        .map_or(0.0, |r| r.timestamp_ms as f64 / cfg.time_scale);
    report.replay = replay::aggregate(&rcfg, samples, (last_ms - first_ms) / 1e3);
    if on_events {
        report.index_drift = Some(drift(&index, &slots));
    }
    report.evicted_blocks = slots.iter().map(|s| s.core.stats().evicted_blocks).sum();
    report.learned = replicas[0]
        .1
        .iter()
        .iter()
        .map(|w| {
            let m = w.load_view(last_ms).active.prefill;
            let step = kvroute_core::load::timing::STEP_TOKENS;
            LearnedCurve {
                ms: [1_024, 8_192, 32_768].map(|t| m.prefill_ms(t, step, 0.0)),
                coefficients: m.coefficients(),
                samples: m.samples(),
            }
        })
        .collect();
    Ok(report)
}

/// The event index against each engine's cached blocks.
fn drift(index: &EventIndex, slots: &[Slot]) -> IndexDrift {
    let mut d = IndexDrift::default();
    for (w, slot) in slots.iter().enumerate() {
        let truth: HashSet<u64> = slot.core.cached_hashes().into_iter().collect();
        let stream = StreamId {
            worker: w as u32,
            rank: 0,
        };
        let got: HashSet<u64> = index
            .engine_hashes(stream, Tier::Device)
            .into_iter()
            .collect();
        d.phantom += got.difference(&truth).count();
        d.missed += truth.difference(&got).count();
        d.cached += truth.len();
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{MOONCAKE_BLOCK_TOKENS, WordIds, engine_cache_bound};
    use crate::workload::{WorkloadParams, builtin_workload};

    fn prompts() -> PromptBuilder {
        // A toy vocabulary of 64 distinct words: 16-word blocks of different ids never match.
        let letter = |i: u32| char::from(b'a' + i as u8);
        let vocab: Vec<(u32, String)> = (0..64u32)
            .map(|i| (100 + i, format!("Ġwx{}{}", letter(i / 8), letter(i % 8))))
            .collect();
        PromptBuilder::new(WordIds::from_vocab(vocab).unwrap(), 0)
    }

    fn config(name: &str, engines: usize, blocks: usize) -> SimConfig {
        let run: Run = name.parse().unwrap();
        SimConfig {
            engines,
            engine: EngineConfig {
                num_gpu_blocks: blocks,
                speedup_ratio: 4.0,
                ..EngineConfig::default()
            },
            router: Config {
                policy: run.policy,
                ..Config::default()
            },
            routing: run.routing,
            time_scale: 4.0,
            seed: DEFAULT_SEED,
            event_delay_ms: DEFAULT_EVENT_DELAY_MS,
            replicas: 1,
        }
    }

    fn workload(conversations: usize) -> Vec<TraceRecord> {
        builtin_workload(&WorkloadParams {
            conversations,
            ..WorkloadParams::default()
        })
    }

    const RUNS: [&str; 5] = [
        "round_robin",
        "least_request",
        "cache_aware",
        TOKENS_RUN,
        EVENTS_RUN,
    ];

    /// Worked example: a 1,000-token prompt sent twice, 10 s apart, to one engine. The second
    /// is served its 62 full blocks (992 tokens; vLLM always computes the last token, and the
    /// 8-token tail is no full block). The text tree predicted all 1,000 (ratio 1.0), so 8
    /// tokens are phantom.
    #[test]
    fn a_repeated_prompt_is_served_its_full_blocks() {
        let r = |t| TraceRecord {
            timestamp_ms: t,
            input_length: 1_000,
            output_length: 10,
            hash_ids: vec![1, 2],
        };
        let rep = simulate(
            &[r(0), r(10_000)],
            &prompts(),
            &config("cache_aware", 1, 1_000),
        )
        .unwrap();
        let cached: Vec<u64> = rep.replay.samples.iter().map(|s| s.cached_tokens).collect();
        assert_eq!(cached, [0, 992]);
        assert_eq!(rep.replay.prompt_tokens, 2_000);
        assert_eq!(rep.decisions.get("miss"), Some(&1));
        assert_eq!(rep.decisions.get("hit"), Some(&1));
        assert_eq!(
            rep.hit_tokens,
            HitTokens {
                predicted: 1_000,
                served: 992,
                phantom: 8,
                unannounced: 0,
                unannounced_hits: 0,
            }
        );
    }

    /// Brute-force reference: one engine that never evicts, requests far apart (time scale
    /// 1/1000), serves exactly the engine-level infinite-cache bound (engine-model.md §9),
    /// whatever the policy.
    #[test]
    fn one_unbounded_engine_serves_the_engine_cache_bound() {
        let records = workload(12);
        let bound = engine_cache_bound(&records, MOONCAKE_BLOCK_TOKENS, 16);
        assert!(bound > 0.5, "the workload shares prefixes: {bound}");
        for name in RUNS {
            let mut cfg = config(name, 1, 40_000);
            cfg.time_scale = 0.001;
            let rep = simulate(&records, &prompts(), &cfg).unwrap();
            assert_eq!(rep.replay.ok, records.len() as u64, "{name}");
            assert!(
                (rep.replay.hit_rate - bound).abs() < 1e-12,
                "{name}: {} against {bound}",
                rep.replay.hit_rate
            );
            assert_eq!(rep.evicted_blocks, 0, "{name}");
        }
    }

    /// Every request is routed once, finishes, and gets exactly its output length; with
    /// several engines the cache-blind policies spread requests over all of them.
    #[test]
    fn every_request_finishes_once_with_its_output_length() {
        let records = workload(10);
        for name in RUNS {
            let rep = simulate(&records, &prompts(), &config(name, 4, 2_048)).unwrap();
            assert_eq!(rep.replay.requests, records.len() as u64);
            assert_eq!(rep.replay.ok, records.len() as u64, "{name}");
            assert_eq!(rep.decisions.values().sum::<u64>(), records.len() as u64);
            for (s, r) in rep.replay.samples.iter().zip(&records) {
                assert_eq!(s.completion_tokens, u64::from(r.output_length), "{name}");
                assert_eq!(s.prompt_tokens, u64::from(r.input_length), "{name}");
                assert!(s.ttft_us.unwrap() as f64 <= s.e2e_us as f64, "{name}");
            }
            if name == "round_robin" {
                assert_eq!(rep.replay.per_worker.len(), 4);
                assert!(rep.replay.max_over_mean_load < 1.1);
            }
        }
    }

    /// Under eviction, the router's event index equals each engine's cached blocks after the
    /// run: every store and removal went through the wire format and the consumer.
    #[test]
    fn event_index_equals_the_engines_under_eviction() {
        let records = workload(20);
        let rep = simulate(&records, &prompts(), &config(EVENTS_RUN, 4, 1_024)).unwrap();
        let d = rep.index_drift.unwrap();
        assert!(rep.evicted_blocks > 1_000, "evicted {}", rep.evicted_blocks);
        assert!(d.cached > 2_000, "{d:?}");
        assert_eq!((d.phantom, d.missed), (0, 0));
        assert!(rep.decisions.get("hit").copied().unwrap_or(0) > records.len() as u64 / 2);
    }

    /// Two router replicas behind a round-robin balancer: each tree sees every other turn of
    /// a conversation, so the text tree misses what the other replica placed; the event index
    /// shows both replicas the engines' caches. Events must win by a wide margin (the live
    /// demo measured 74.3 against 60.1 % on the default workload).
    #[test]
    fn replicas_blind_the_tree_and_not_the_events() {
        let records = workload(20);
        let run = |name: &str| {
            let mut cfg = config(name, 4, 4_096);
            cfg.replicas = 2;
            simulate(&records, &prompts(), &cfg).unwrap()
        };
        let (text, events) = (run("cache_aware"), run(EVENTS_RUN));
        assert!(
            events.replay.hit_rate > text.replay.hit_rate + 0.05,
            "events {} against text {}",
            events.replay.hit_rate,
            text.replay.hit_rate
        );
        assert!(text.hit_tokens.unannounced > 10 * events.hit_tokens.unannounced.max(1));
    }

    /// bug-cases.md B9 (Dynamo #737): 8 workers, every request = the same 2,048-token system
    /// prompt + 500 unique tokens, one every 5 ms (about 64 in flight). The spill gate must
    /// bite: no worker gets more than 2× its fair share of the requests. SMG's margin of 64
    /// does not (2.09 × when measured); the default does (1.34 ×), at the same hit rate.
    #[test]
    fn b9_a_shared_system_prompt_does_not_pin_one_worker() {
        let records: Vec<TraceRecord> = (0..640u64)
            .map(|i| TraceRecord {
                timestamp_ms: i * 5,
                input_length: 4 * 512 + 500,
                output_length: 100,
                hash_ids: vec![0, 1, 2, 3, 100 + i],
            })
            .collect();
        let run = |abs: usize| {
            let mut cfg = config("cache_aware", 8, 4_096);
            cfg.time_scale = 1.0;
            cfg.router.balance_abs_threshold = abs;
            simulate(&records, &prompts(), &cfg).unwrap().replay
        };
        let (smg, ours) = (run(64), run(Config::default().balance_abs_threshold));
        assert!(smg.max_over_mean_load > 2.0, "{}", smg.max_over_mean_load);
        assert!(
            ours.max_over_mean_load <= 2.0,
            "{}",
            ours.max_over_mean_load
        );
        assert_eq!(ours.per_worker.len(), 8);
        // Spreading recomputes the shared prompt once per worker, nothing more.
        assert!(
            ours.hit_rate > smg.hit_rate - 0.01,
            "{} {}",
            ours.hit_rate,
            smg.hit_rate
        );
    }

    /// The same records, config and seed give the same report, request by request.
    #[test]
    fn same_inputs_give_the_same_report() {
        let records = workload(15);
        for name in ["least_request", "cache_aware", EVENTS_RUN] {
            let cfg = config(name, 4, 2_048);
            let a = simulate(&records, &prompts(), &cfg).unwrap();
            let b = simulate(&records, &prompts(), &cfg).unwrap();
            assert_eq!(
                serde_json::to_value(&a).unwrap(),
                serde_json::to_value(&b).unwrap(),
                "{name}"
            );
        }
    }

    #[test]
    fn bad_configs_are_errors() {
        let records = workload(1);
        let p = prompts();
        let mut cfg = config("cache_aware", 0, 1_024);
        assert!(matches!(
            simulate(&records, &p, &cfg),
            Err(SimError::NoEngines)
        ));
        cfg.engines = 1;
        cfg.time_scale = 0.0;
        assert!(matches!(
            simulate(&records, &p, &cfg),
            Err(SimError::BadParameter {
                field: "time_scale",
                ..
            })
        ));
        cfg.time_scale = 1.0;
        cfg.event_delay_ms = f64::NAN;
        assert!(matches!(
            simulate(&records, &p, &cfg),
            Err(SimError::BadParameter {
                field: "event_delay_ms",
                ..
            })
        ));
        cfg.event_delay_ms = 0.0;
        cfg.engine.num_gpu_blocks = 0;
        assert!(matches!(
            simulate(&records, &p, &cfg),
            Err(SimError::Engine(_))
        ));
    }

    #[test]
    fn run_names_parse() {
        let r: Run = EVENTS_RUN.parse().unwrap();
        assert_eq!(
            (r.policy, r.routing),
            (PolicyKind::CacheAware, Routing::Events)
        );
        let r: Run = TOKENS_RUN.parse().unwrap();
        assert_eq!(
            (r.policy, r.routing),
            (PolicyKind::CacheAware, Routing::Tokens)
        );
        let r: Run = "least_request".parse().unwrap();
        assert_eq!(r.policy, PolicyKind::LeastRequest);
        assert!("cache_awre".parse::<Run>().is_err());
    }
}

#[cfg(test)]
mod calibration_tests {
    use super::*;
    use crate::trace::WordIds;

    fn prompts() -> PromptBuilder {
        let letter = |i: u32| char::from(b'a' + i as u8);
        let vocab: Vec<(u32, String)> = (0..64u32)
            .map(|i| (100 + i, format!("Ġwx{}{}", letter(i / 8), letter(i % 8))))
            .collect();
        PromptBuilder::new(WordIds::from_vocab(vocab).unwrap(), 0)
    }

    /// Requests far apart on one engine (each alone, nothing decoding): the learned curve
    /// is the engine's own within 10 % at 1k / 8k / 32k new tokens.
    #[test]
    fn alone_requests_teach_the_true_curve() {
        let mut s = 3u64;
        let records: Vec<TraceRecord> = (0..150u64)
            .map(|i| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let blocks = 1 + (s >> 33) % 60;
                TraceRecord {
                    timestamp_ms: i * 60_000,
                    input_length: (blocks * 512) as u32,
                    output_length: 1,
                    hash_ids: (0..blocks).map(|b| 1_000_000 * (i + 1) + b).collect(),
                }
            })
            .collect();
        let cfg = SimConfig {
            engines: 1,
            engine: EngineConfig {
                num_gpu_blocks: 400_000,
                ..EngineConfig::default()
            },
            router: Config {
                policy: PolicyKind::PredictedTtft,
                ..Config::default()
            },
            routing: Routing::Events,
            time_scale: 1.0,
            seed: DEFAULT_SEED,
            event_delay_ms: DEFAULT_EVENT_DELAY_MS,
            replicas: 1,
        };
        let rep = simulate(&records, &prompts(), &cfg).unwrap();
        let c = rep.learned[0];
        let truth = [32.49, 169.14, 4.0 * 169.14];
        for (got, want) in c.ms.iter().zip(truth) {
            assert!((got - want).abs() / want < 0.1, "{c:?}");
        }
    }
}
