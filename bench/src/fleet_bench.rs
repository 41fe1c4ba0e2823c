//! `kvroute bench fleet`: whole token-mode routing decisions against a fleet-sized event index
//! while that index ingests every worker's KV events at the rate real engines send them.
//!
//! # Fixture
//! `W` workers (`--workers`), prompts of about `T` tokens (`--tokens`), router blocks of
//! [`BLOCK`] tokens. Workers form groups of [`GROUP_WORKERS`] consecutive ids; group `g`
//! serves document `g` (a chat of the shape of `kvroute bench decision`: the 800-character
//! system message every chat shares, then a user message of `T` vocabulary words):
//!
//! | content | held by | blocks per worker |
//! |---|---|---|
//! | the chat template head and system message (the first ~10 blocks of every chat) | every worker (fleet-wide prefix, as Mooncake's id 0) | ~10 |
//! | the rest of group `g`'s document | the group's 16 workers | ⌊(T + ~170) / 16⌋ − ~10 |
//! | [`TAILS`] conversation tails of [`TAIL_BLOCKS`] blocks, each chained under the document | one worker (its own users' turns) | `TAILS × TAIL_BLOCKS` ≈ T / 16 |
//!
//! So each worker holds ~2·T/16 blocks, half of them unique to it, and the index holds
//! ~`W × 2·T/16` (worker, block) entries (16.8 M at 4,096 × 32k).
//!
//! # Threads
//! - **Ingest** (one thread, the router's one event writer): round-robin over workers, each
//!   step removes the worker's oldest tail and stores a new one (a `BlockRemoved` and a
//!   `BlockStored` of [`TAIL_BLOCKS`] blocks each, through
//!   [`kvroute_core::events::EventIndex::apply_batch`]: decoding and sequencing excluded),
//!   paced to `W ×` [`block_events_per_s_per_worker`] block events per second. Reported:
//!   offered, achieved (events / wall time), and per core (events / time spent applying).
//! - **Index writer** (one thread, as the gateway's `kv-index`): every
//!   `defaults::INDEX_WRITER_PERIOD_MS`, replays the records on the trees' second copies.
//!   Between two timed decisions the bench makes sure, untimed, that the replay is done (a
//!   conversation's next turn reaches a gateway long after its record).
//! - **Decisions** (this thread): conversations of [`TURNS`] turns on group documents, one
//!   after another, turn by turn (turn `k` adds an assistant reply and a question, as in
//!   `kvroute bench decision`); each turn is one whole decision, timed from the body's last
//!   read ([`defaults::MIN_READ_BYTES`]: the reads before it were scanned for cached chat
//!   prefixes as they came, as the gateway does; that scan is reported apart, `early_scan`):
//!   body parse → chat template →
//!   tokenize (incremental) → block keys → fleet snapshot → policy (`predicted_ttft`, on the
//!   event index) → booking, where the gateway sends the request and the decision ends.
//!   What the gateway does after the worker's response head follows, timed as the stage
//!   `after_head` and not in the whole: the chat-prefix entries cached and the record (one
//!   copy of each tree; the index writer thread replays it on the other, as the gateway's
//!   `kv-index`, `Router::catch_up`). Turns 2.. are timed into an hdrhistogram (p50, p99,
//!   max; and by turn, `by_turn`: turn 2 follows a cold first turn); turn 1 (a cold
//!   tokenization of the whole document, ms at 32k) is reported apart, and so is the decision
//!   from token ids (`from_ids`: the decision's stages after parse and tokenize, as a router
//!   whose clients send token ids would run).
//!   Between two timed turns this thread does only what a gateway's shard does between two
//!   requests: the body arrives (copied into the connection's reused receive buffer, as the
//!   kernel's receive copies it) and its early reads are scanned. The client's work, each
//!   turn's JSON built and serialized (~1 MB of writes at 32k), is done before a
//!   conversation's first turn, as a client on another machine does it: made between turns,
//!   it evicted the decision's lines (the same router code reads 0.65× the p50 without it,
//!   perf/runs/2026-12-07-client-work).
//!   Each timed decision is followed by the in-run baseline `body_read`: the body scanned
//!   once (`memchr`), the least any decision that reads the body costs on this machine at
//!   this moment (a ratio to it survives the host's speed changing run to run). After a
//!   conversation's last turn, the index lookup alone (`Router::overlaps` on a snapshot of
//!   the whole fleet, its own histogram) is timed for each of its turns: a whole-fleet walk
//!   is no step of a decision, so it runs outside the turns' sequence.
//!
//! Memory per (worker, block): the event index's own accounting (allocated capacities of
//! every slab, index and table, [`kvroute_core::events::EventIndex::memory_bytes`]) over
//! the (worker, block) entries it holds, after the fill.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvroute_core::config::{Config, defaults};
use kvroute_core::events::{
    BlockRemoved, BlockStored, EventBatch, EventIndex, EventIndexSettings, KvEvent, StreamId,
};
use kvroute_core::policy::Router;
use kvroute_core::route_key::Endpoint;
use kvroute_core::tokens::Tokenizers;
use kvroute_core::workers::Workers;
use kvroute_tokenize::Tokenizer;
use kvroute_tokenize::incremental::DEFAULT_CACHE_TOKENS;
use serde_json::{Value, json};

use crate::BoxError;
use crate::trace::synth::WordIds;
use crate::trace::{self, MOONCAKE_BLOCK_TOKENS};

/// Workers, default of `--workers` (issue 16's scale point).
pub const DEFAULT_WORKERS: usize = 4096;
/// Prompt tokens, default of `--tokens` (issue 16's scale point).
pub const DEFAULT_TOKENS: usize = 32768;
/// Seconds of events and decisions, default of `--seconds` (after the fill).
pub const DEFAULT_SECONDS: f64 = 10.0;
/// Router block size, tokens ([`defaults::BLOCK_SIZE`]).
pub const BLOCK: usize = defaults::BLOCK_SIZE;
/// Workers per group sharing one document.
pub const GROUP_WORKERS: usize = 16;
/// Blocks per conversation tail (one `BlockStored` or `BlockRemoved` of the ingest: 256
/// tokens, a turn).
pub const TAIL_BLOCKS: usize = 16;
/// Tails per worker at `tokens` T: as many blocks as the document (≥ 1).
pub fn tails(tokens: usize) -> usize {
    (tokens / BLOCK / TAIL_BLOCKS).max(1)
}
/// Turns per measured conversation.
pub const TURNS: usize = 10;
/// Tokens of each assistant reply after turn 1 (as `kvroute bench decision`).
pub const REPLY_TOKENS: usize = 32;
/// Tokens of each user question after turn 1.
pub const QUESTION_TOKENS: usize = 16;

/// Block events per second per worker (stores + removals), when the Mooncake trace is not at
/// hand: the value [`trace_block_events_per_s_per_worker`] computes on
/// `conversation_trace.jsonl` (418.08, rounded). The derivation, at issue 14's setup of 8
/// engines and 16-token blocks: every Mooncake block id seen for the first time is stored
/// once, ⌊its tokens / 16⌋ blocks (5,662,916 over the trace; ids are prefix-chained, so a
/// repeated id is a cache hit on an engine that keeps it: the fewest stores any placement
/// makes), plus ⌊output tokens / 16⌋ decode blocks per request (252,018); over 3,537 s and 8
/// engines that is 209.0 stores per second per engine, and with full caches every store
/// evicts as many blocks: × 2 = 418.1 block events per second per engine.
pub const MOONCAKE_BLOCK_EVENTS_PER_S_PER_WORKER: f64 = 418.1;
/// The Mooncake conversation trace, relative to the repo root (never committed).
pub const TRACE: &str = "../shared/data/traces/mooncake/conversation_trace.jsonl";
/// Engines of the derivation (issue 14's setup).
const TRACE_ENGINES: f64 = 8.0;

/// [`MOONCAKE_BLOCK_EVENTS_PER_S_PER_WORKER`]'s computation on the trace at `path`, block
/// events per second per engine; `None` when the file cannot be read.
pub fn trace_block_events_per_s_per_worker(path: &str) -> Option<f64> {
    let records = trace::load_mooncake(path, None).ok()?;
    let mut seen = std::collections::HashSet::new();
    let mut stored = 0u64;
    let mut end_ms = 0u64;
    for r in &records {
        end_ms = end_ms.max(r.timestamp_ms);
        for (i, &h) in r.hash_ids.iter().enumerate() {
            if seen.insert(h) {
                stored += u64::from(r.block_len(i, MOONCAKE_BLOCK_TOKENS)) / BLOCK as u64;
            }
        }
        stored += u64::from(r.output_length) / BLOCK as u64;
    }
    (end_ms > 0).then(|| 2.0 * stored as f64 / (end_ms as f64 / 1e3) / TRACE_ENGINES)
}

/// The rate the ingest offers per worker, block events/s, and where it came from.
pub fn block_events_per_s_per_worker() -> (f64, &'static str) {
    match trace_block_events_per_s_per_worker(TRACE) {
        Some(r) => (r, "mooncake conversation trace"),
        None => (
            MOONCAKE_BLOCK_EVENTS_PER_S_PER_WORKER,
            "MOONCAKE_BLOCK_EVENTS_PER_S_PER_WORKER (trace absent)",
        ),
    }
}

/// Flags of `kvroute bench fleet`.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetArgs {
    /// Workers (event streams), ≥ 1.
    pub workers: usize,
    /// Document tokens per prompt, ≥ [`BLOCK`].
    pub tokens: usize,
    /// Seconds of measurement after the fill.
    pub seconds: f64,
}

impl Default for FleetArgs {
    fn default() -> Self {
        Self {
            workers: DEFAULT_WORKERS,
            tokens: DEFAULT_TOKENS,
            seconds: DEFAULT_SECONDS,
        }
    }
}

/// The writer keeps up when it applies at least this share of the offered events.
pub const KEEPS_UP: f64 = 0.95;

/// What a run's ingest rates say ([`ingest_verdict`]); its [`IngestVerdict::label`] is the
/// report's `ingest` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngestVerdict {
    /// Achieved ≥ [`KEEPS_UP`] × offered.
    KeepsUp,
    /// Achieved below that while the writer applies faster than offered whenever it runs
    /// (per core ≥ offered): the thread did not get its core for part of the run (the host
    /// took it), not a writer too slow.
    ShortOfItsCore,
    /// Per core below offered: one writer cannot apply this fleet's events.
    TooSlow,
}

impl IngestVerdict {
    /// The report's `ingest` value: `keeps up`, `short of its core` or `too slow`.
    pub fn label(self) -> &'static str {
        match self {
            Self::KeepsUp => "keeps up",
            Self::ShortOfItsCore => "short of its core",
            Self::TooSlow => "too slow",
        }
    }

    /// What the printed line adds after the achieved rate (empty when it keeps up).
    fn note(self) -> &'static str {
        match self {
            Self::KeepsUp => "",
            Self::ShortOfItsCore => " (short: the ingest thread did not get its core all along)",
            Self::TooSlow => " (the writer does not keep up)",
        }
    }
}

/// The verdict on a run's offered, achieved (events / wall time) and per-core (events / time
/// spent applying) block events per second ([`IngestVerdict`]'s variants say when each holds).
pub fn ingest_verdict(offered: f64, achieved: f64, per_core: f64) -> IngestVerdict {
    if achieved >= KEEPS_UP * offered {
        IngestVerdict::KeepsUp
    } else if per_core >= offered {
        IngestVerdict::ShortOfItsCore
    } else {
        IngestVerdict::TooSlow
    }
}

/// The keys `--out` writes, in order (issue 16).
pub const OUT_KEYS: [&str; 7] = [
    "workers",
    "tokens",
    "decision_p50_ns",
    "decision_p99_ns",
    "decision_max_ns",
    "bytes_per_worker_block",
    "ingest_block_events_per_s",
];

/// The `--out` object of a [`run`] report: exactly [`OUT_KEYS`].
pub fn out_json(report: &Value) -> Value {
    Value::Object(
        OUT_KEYS
            .iter()
            .map(|k| (k.to_string(), report[*k].clone()))
            .collect(),
    )
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// Turn `turn` (1-based) of a conversation on document `doc`, `round` telling conversations
/// on one document apart.
fn chat_body(
    words: &WordIds,
    system: &str,
    doc: u64,
    round: u64,
    turn: usize,
    size: usize,
) -> Vec<u8> {
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": words.block_text(1, doc, size)}),
    ];
    for k in 1..turn as u64 {
        let id = (round << 24) | (doc << 4) | k;
        messages
            .push(json!({"role": "assistant", "content": words.block_text(2, id, REPLY_TOKENS)}));
        messages.push(json!({"role": "user", "content": words.block_text(3, id, QUESTION_TOKENS)}));
    }
    serde_json::to_vec(&json!({"model": "m", "max_tokens": 16, "messages": messages}))
        .expect("a JSON value serializes")
}

/// splitmix64 step.
fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Engine hash of block `i` of a group document (per stream, so equal across workers).
fn doc_hash(i: usize) -> u64 {
    1 + i as u64
}

/// Engine hash of block `i` of tail number `serial` of a worker.
fn tail_hash(serial: u64, i: usize) -> u64 {
    (1 << 62) | (serial << 8) | i as u64
}

/// One worker's tails in the index, oldest first (serial numbers).
struct WorkerTails {
    serials: std::collections::VecDeque<u64>,
}

/// The ingest side: the index and every worker's state.
struct Ingest {
    index: EventIndex,
    tails: Vec<WorkerTails>,
    /// Last engine hash of each group's document (the tails' parent).
    doc_last: Vec<u64>,
    next_serial: u64,
    rng: u64,
    tokens: Vec<u32>,
}

impl Ingest {
    fn store_tail(&mut self, w: usize) {
        let serial = self.next_serial;
        self.next_serial += 1;
        self.tokens.clear();
        for _ in 0..TAIL_BLOCKS * BLOCK {
            self.tokens.push((splitmix(&mut self.rng) % 150_000) as u32);
        }
        let ev = BlockStored {
            block_hashes: (0..TAIL_BLOCKS).map(|i| tail_hash(serial, i)).collect(),
            parent_block_hash: Some(self.doc_last[w / GROUP_WORKERS]),
            token_ids: std::mem::take(&mut self.tokens),
            block_size: BLOCK,
            ..BlockStored::default()
        };
        self.apply(w, KvEvent::Stored(ev));
        self.tails[w].serials.push_back(serial);
    }

    fn remove_tail(&mut self, w: usize) {
        let Some(serial) = self.tails[w].serials.pop_front() else {
            return;
        };
        // Children first, as an engine's LRU evicts leaves.
        let ev = BlockRemoved {
            block_hashes: (0..TAIL_BLOCKS)
                .rev()
                .map(|i| tail_hash(serial, i))
                .collect(),
            ..BlockRemoved::default()
        };
        self.apply(w, KvEvent::Removed(ev));
    }

    fn apply(&mut self, w: usize, ev: KvEvent) {
        let batch = EventBatch {
            ts: 0.0,
            events: vec![ev],
            dp_rank: None,
            skipped_events: 0,
        };
        let stream = StreamId {
            worker: w as u32,
            rank: 0,
        };
        self.index.apply_batch(stream, &batch);
        // Hand the token buffer back for the next store.
        if let Some(KvEvent::Stored(s)) = batch.events.into_iter().next() {
            self.tokens = s.token_ids;
        }
    }
}

/// Runs the benchmark; prints a table to stderr and returns the report (the keys of
/// [`OUT_KEYS`] first, then details).
///
/// # Errors
/// The embedded tokenizer fails to load, a body does not parse, or the chat template fails.
pub fn run(args: &FleetArgs) -> Result<Value, BoxError> {
    let t0 = Instant::now();
    let workers = args.workers.max(1);
    let size = args.tokens.max(BLOCK);
    let groups = workers.div_ceil(GROUP_WORKERS);
    let tok = Tokenizer::qwen3()?;
    let words = WordIds::from_tokenizer(&tok)?;
    let system = crate::decision_bench::system_prompt();

    // Each group's document as the router tokenizes it (a tokenizer of its own, so the
    // measured one starts cold).
    let mut setup_tok = Tokenizers::new(Some(tok.clone()), Vec::new(), 0).for_shard();
    let mut docs: Vec<Vec<u32>> = Vec::with_capacity(groups);
    for g in 0..groups {
        let body = chat_body(&words, &system, g as u64, 0, 1, size);
        let (key, _) = setup_tok.route(Endpoint::ChatCompletions, &body, None, &|_| true)?;
        let mut ids = key
            .input_ids
            .ok_or("the setup chat did not tokenize")?
            .to_vec();
        ids.truncate(ids.len() / BLOCK * BLOCK);
        docs.push(ids);
    }
    drop(setup_tok);

    // Fill: every worker stores its group's document, then its tails.
    let mut ingest = Ingest {
        index: EventIndex::with_settings(&EventIndexSettings {
            block_size: BLOCK,
            max_streams: workers,
            ttl_ms: None,
            max_entries: None,
        }),
        tails: (0..workers)
            .map(|_| WorkerTails {
                serials: Default::default(),
            })
            .collect(),
        doc_last: docs.iter().map(|d| doc_hash(d.len() / BLOCK - 1)).collect(),
        next_serial: 0,
        rng: 0x5EED,
        tokens: Vec::new(),
    };
    let fill = Instant::now();
    let tails = tails(size);
    for w in 0..workers {
        let doc = &docs[w / GROUP_WORKERS];
        let ev = BlockStored {
            block_hashes: (0..doc.len() / BLOCK).map(doc_hash).collect(),
            parent_block_hash: None,
            token_ids: doc.clone(),
            block_size: BLOCK,
            ..BlockStored::default()
        };
        ingest.apply(w, KvEvent::Stored(ev));
        for _ in 0..tails {
            ingest.store_tail(w);
        }
    }
    let fill_s = fill.elapsed().as_secs_f64();
    let entries = ingest.index.reader().entries();
    let bytes = ingest.index.memory_bytes();
    let bytes_per_pair = bytes as f64 / entries.max(1) as f64;

    // Router: predicted_ttft (the default) on the event index.
    let cfg = Config::default();
    let mut router = Router::new(&cfg);
    router.set_event_index(ingest.index.reader());
    let specs: Vec<String> = (0..workers)
        .map(|i| format!("http://10.{}.{}.{}:8000", i >> 16, (i >> 8) & 255, i & 255))
        .collect();
    let fleet = Workers::new(&specs)?;
    let mut tokenizers =
        Tokenizers::new(Some(tok.clone()), Vec::new(), DEFAULT_CACHE_TOKENS).for_shard();

    let (per_worker, rate_source) = block_events_per_s_per_worker();
    let offered = per_worker * workers as f64;
    let stop = AtomicBool::new(false);
    let seconds = args.seconds.max(0.0);
    let (ingest_report, decisions) = std::thread::scope(|s| {
        let ingest_thread = s.spawn(|| {
            let per_step = (2 * TAIL_BLOCKS) as f64;
            let (mut done, mut busy) = (0u64, Duration::ZERO);
            let mut w = 0usize;
            let start = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                let due = offered * start.elapsed().as_secs_f64();
                if (done as f64) + per_step > due {
                    std::thread::sleep(Duration::from_micros(100));
                    continue;
                }
                let t = Instant::now();
                ingest.remove_tail(w);
                ingest.store_tail(w);
                busy += t.elapsed();
                done += per_step as u64;
                w = (w + 1) % workers;
            }
            let wall = start.elapsed().as_secs_f64();
            (done, wall, busy.as_secs_f64())
        });
        let writer = s.spawn(|| {
            let period = Duration::from_millis(defaults::INDEX_WRITER_PERIOD_MS);
            while !stop.load(Ordering::Relaxed) {
                router.catch_up();
                std::thread::sleep(period);
            }
        });
        let decisions = decide_loop(
            &router,
            &fleet,
            &mut tokenizers,
            &words,
            &system,
            groups,
            size,
            seconds,
        );
        stop.store(true, Ordering::Relaxed);
        writer.join().expect("the index writer does not panic");
        let ingest = ingest_thread
            .join()
            .expect("the ingest thread does not panic");
        (ingest, decisions)
    });
    let d = decisions?;
    let (done, wall, busy) = ingest_report;
    let achieved = done as f64 / wall.max(1e-9);
    let per_core = done as f64 / busy.max(1e-9);
    let entries_after = ingest.index.reader().entries();
    let verdict = ingest_verdict(offered, achieved, per_core);
    let q = |h: &Histogram<u64>| json!({"p50_ns": h.value_at_quantile(0.5), "p99_ns": h.value_at_quantile(0.99), "max_ns": h.max(), "count": h.len()});
    let report = json!({
        "workers": workers,
        "tokens": size,
        "decision_p50_ns": d.whole.value_at_quantile(0.5),
        "decision_p99_ns": d.whole.value_at_quantile(0.99),
        "decision_max_ns": d.whole.max(),
        "bytes_per_worker_block": bytes_per_pair,
        "ingest_block_events_per_s": per_core,
        "decisions": d.whole.len(),
        "turn1": q(&d.turn1),
        // Entry i is turn i + 2.
        "by_turn": d.by_turn.iter().map(q).collect::<Vec<_>>(),
        "index_lookup": q(&d.lookup),
        "from_ids": q(&d.from_ids),
        "body_read": q(&d.body_read),
        "early_scan": q(&d.early_scan),
        "stages_p50_ns": by_stage(&d.stages, 0.5),
        "stages_p99_ns": by_stage(&d.stages, 0.99),
        "mean_matched_workers": d.matched as f64 / d.whole.len().max(1) as f64,
        "mean_prompt_tokens": d.prompt_tokens as f64 / d.whole.len().max(1) as f64,
        "offered_block_events_per_s": offered,
        "achieved_block_events_per_s": achieved,
        "keeps_up": verdict == IngestVerdict::KeepsUp,
        "ingest": verdict.label(),
        "ingest_busy_share": busy / wall.max(1e-9),
        "block_events_per_s_per_worker": per_worker,
        "rate_source": rate_source,
        "entries": entries,
        "entries_after": entries_after,
        "index_bytes": bytes,
        "groups": groups,
        "group_workers": GROUP_WORKERS,
        "tails_per_worker": tails,
        "tail_blocks": TAIL_BLOCKS,
        "fill_s": fill_s,
        "seconds": seconds,
        "elapsed_s": t0.elapsed().as_secs_f64(),
    });
    eprintln!(
        "fleet {workers:>5} workers × {size:>6} tokens: decision p50 {:>8} ns p99 {:>8} ns max {:>9} ns ({} decisions; from token ids p50 {} p99 {} ns; body read once p50 {} p99 {} ns; index lookup p50 {} p99 {} ns) | {:.1} B per (worker, block), {entries} entries | ingest offered {:.2} M/s, achieved {:.2} M/s{}, per core {:.2} M/s",
        report["decision_p50_ns"],
        report["decision_p99_ns"],
        report["decision_max_ns"],
        report["decisions"],
        report["from_ids"]["p50_ns"],
        report["from_ids"]["p99_ns"],
        report["body_read"]["p50_ns"],
        report["body_read"]["p99_ns"],
        report["index_lookup"]["p50_ns"],
        report["index_lookup"]["p99_ns"],
        bytes_per_pair,
        offered / 1e6,
        achieved / 1e6,
        verdict.note(),
        per_core / 1e6,
    );
    Ok(report)
}

/// Histograms of the decision thread.
struct Decisions {
    whole: Histogram<u64>,
    turn1: Histogram<u64>,
    /// `whole` by turn, turns 2..=[`TURNS`] (turn 2 follows turn 1's cold tokenization).
    by_turn: Vec<Histogram<u64>>,
    lookup: Histogram<u64>,
    /// The decision after the body is parsed and tokenized: facts (block keys), decide,
    /// book.
    from_ids: Histogram<u64>,
    /// The body scanned once (`memchr` for a byte JSON never holds, AVX2), right after its
    /// decision: the floor of any decision that reads the body, the in-run baseline.
    body_read: Histogram<u64>,
    /// The prefix scan of a body's reads before its last (as they arrived; not in `whole`).
    early_scan: Histogram<u64>,
    stages: Vec<Histogram<u64>>,
    matched: usize,
    prompt_tokens: usize,
}

#[allow(clippy::too_many_arguments)]
fn decide_loop(
    router: &Router,
    fleet: &Workers,
    tokenizers: &mut kvroute_core::tokens::ShardTokenizers,
    words: &WordIds,
    system: &str,
    groups: usize,
    size: usize,
    seconds: f64,
) -> Result<Decisions, BoxError> {
    let mut d = Decisions {
        whole: histogram(),
        turn1: histogram(),
        by_turn: (2..=TURNS).map(|_| histogram()).collect(),
        lookup: histogram(),
        body_read: histogram(),
        early_scan: histogram(),
        from_ids: histogram(),
        stages: (0..5).map(|_| histogram()).collect(),
        matched: 0,
        prompt_tokens: 0,
    };
    let mut rng = rand::rng();
    let mut seq = 0u64;
    let start = Instant::now();
    let mut round = 1u64;
    // The connection's receive buffer, reused turn to turn as a gateway connection's is.
    let mut recv: Vec<u8> = Vec::new();
    // At least one whole conversation, however short the run.
    while seq < TURNS as u64 || start.elapsed().as_secs_f64() < seconds {
        let doc = (seq / TURNS as u64 * 7919) % groups as u64;
        round += 1;
        // The client's work, done before the conversation (module doc).
        let bodies: Vec<Vec<u8>> = (1..=TURNS)
            .map(|turn| chat_body(words, system, doc, round, turn, size))
            .collect();
        let mut asked = Vec::with_capacity(TURNS);
        for (turn, sent) in (1..=TURNS).zip(&bodies) {
            // The body arrives: the kernel's receive copies it into the connection's buffer.
            recv.clear();
            recv.extend_from_slice(sent);
            let timed = crate::decision_bench::timed_decision(
                tokenizers, router, fleet, &recv, seq, &mut rng,
            )?;
            seq += 1;
            // Untimed: this turn's record replayed before the next turn (module doc).
            router.catch_up();
            if turn == 1 {
                d.turn1.record(timed.whole)?;
                continue;
            }
            d.whole.record(timed.whole)?;
            d.by_turn[turn - 2].record(timed.whole)?;
            d.early_scan.record(timed.early_scan.max(1))?;
            // The floor: the body read once, as fast as the machine reads memory.
            let t = Instant::now();
            std::hint::black_box(memchr::memchr(0xFF, std::hint::black_box(&recv)));
            d.body_read.record((t.elapsed().as_nanos() as u64).max(1))?;
            let decision = &timed.stages[1..crate::decision_bench::DECISION_STAGES];
            d.from_ids.record(decision.iter().sum::<u64>().max(1))?;
            for (h, ns) in d.stages.iter_mut().zip(timed.stages) {
                h.record(ns)?;
            }
            asked.push((seq - 1, timed.key));
        }
        // The index lookup alone, untimed above: each turn's facts on a fresh snapshot of the
        // whole fleet, once the conversation is over (module doc).
        for (at, key) in &asked {
            let facts = router.request(key);
            let view = fleet.snapshot(&key.model, &[], *at);
            let snap = view.snapshot(*at, *at);
            let t = Instant::now();
            let ov = router.overlaps(&snap, &facts);
            d.lookup.record((t.elapsed().as_nanos() as u64).max(1))?;
            d.matched += ov.matched.iter().filter(|&&m| m > 0).count();
            d.prompt_tokens += facts.prompt_tokens as usize;
        }
    }
    Ok(d)
}

/// `{stage: quantile q of its histogram, ns}` over [`crate::decision_bench::STAGES`].
fn by_stage(stages: &[Histogram<u64>], q: f64) -> Value {
    crate::decision_bench::STAGES
        .iter()
        .zip(stages)
        .map(|(s, h)| (s.to_string(), json!(h.value_at_quantile(q))))
        .collect::<serde_json::Map<_, _>>()
        .into()
}
