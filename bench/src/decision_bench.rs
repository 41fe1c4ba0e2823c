//! `kvroute bench decision`: the cost of one whole token-mode routing decision on one core,
//! the way `kvroute serve` makes it for a chat request (io's exchange, without the sockets):
//!
//! ```text
//! body parse + chat template render + tokenize (ShardTokenizers::route: the chat prefix
//!   cache, else route_key then attach) → block keys and lengths (Router::request)
//!   → fleet snapshot and policy (Router::decide_on: the whole fleet, or a large fleet's
//!   candidate set) → booking + load guard (Worker::acquire_booked)
//!   [the request leaves for its worker here: the decision ends]
//!   → after the worker's response head, as io's exchange does it: the request's chat-prefix
//!     entries cached (ChatInsert::apply) and the decision recorded in the indexes
//!     (Router::record)
//! ```
//!
//! For each chat size `S` of [`SIZES`] tokens and each policy of [`policies`],
//! [`CONVERSATIONS`] conversations of [`TURNS`] turns run in order, turn by turn, as a chat
//! client sends them: turn 1 is a shared system message (800 characters, as
//! `perf/compare.sh` sends) and a user message of `S` tokens (a document, vocabulary words:
//! one token each); every later turn adds the assistant's reply ([`REPLY_TOKENS`]) and a
//! short user question ([`QUESTION_TOKENS`]). So turn 1 is a cold chat of ~`S` tokens and
//! turn 10 a chat of ~`S + 9 × 48` tokens whose new text is ~48 tokens. Each decision is
//! timed stage by stage (`Instant`, ~25 ns per read) into hdrhistograms; the report gives
//! p50 / p99 / max of the whole decision at turn 1 and turn 10, the p50 of each stage at
//! turn 10, and `late_over_early`: turn 10's p50 over the last half of the conversations
//! against the first half (the router's state grows in between: ≈ 1 when the per-request
//! cost does not grow with it). [`WORKERS`] workers, every one idle and eligible; load guards
//! are released right after each decision, as a served request's would be.

use hdrhistogram::Histogram;
use kvroute_core::chat_prefix::PrefixScanner;
use kvroute_core::config::{Config, PolicyKind, defaults};
use kvroute_core::policy::Router;
use kvroute_core::route_key::Endpoint;
use kvroute_core::tokens::Tokenizers;
use kvroute_core::workers::Workers;
use kvroute_tokenize::Tokenizer;
use kvroute_tokenize::incremental::DEFAULT_CACHE_TOKENS;
use serde_json::{Value, json};
use std::time::Instant;

use crate::BoxError;
use crate::trace::synth::WordIds;

/// Chat sizes at turn [`TURNS`], tokens (issue 15: 1k, 8k and 32k-token chats).
pub const SIZES: [usize; 3] = [1024, 8192, 32768];
/// Turns per conversation; the last is the measured "turn 10".
pub const TURNS: usize = 10;
/// Conversations per (policy, size): 200 turn-10 samples, a p99 of two.
pub const CONVERSATIONS: usize = 200;
/// Workers behind the router.
pub const WORKERS: usize = 8;
/// Tokens of each assistant reply between user turns.
pub const REPLY_TOKENS: usize = 32;
/// Tokens of each user question after turn 1.
pub const QUESTION_TOKENS: usize = 16;
/// The system message every chat starts with, 800 characters (perf/compare/chat.lua's).
pub(crate) fn system_prompt() -> String {
    "You are a careful assistant for a fleet operator. "
        .repeat(16)
        .chars()
        .take(800)
        .collect()
}

/// The policies measured: the default ([`defaults::POLICY`]) and SMG's `cache_aware`.
pub fn policies() -> [PolicyKind; 2] {
    [defaults::POLICY, PolicyKind::CacheAware]
}

/// The stages of one decision, in order (report keys): the first four are the decision the
/// request waits on; `after_head` (the chat-prefix entries cached and the decision recorded)
/// runs after the request has left, as `kvroute serve` runs it, and is not in the whole.
pub(crate) const STAGES: [&str; 5] = ["parse_tokenize", "facts", "decide", "book", "after_head"];
/// Stages of [`STAGES`] the request waits on (the whole decision).
pub(crate) const DECISION_STAGES: usize = 4;

/// The body of turn `turn` (1-based) of conversation `conv` in a chat of `size` tokens.
fn chat_body(words: &WordIds, system: &str, conv: u64, turn: usize, size: usize) -> Vec<u8> {
    let id = conv * 100;
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": words.block_text(1, id, size)}),
    ];
    for k in 1..turn as u64 {
        let reply = words.block_text(2, id + k, REPLY_TOKENS);
        messages.push(json!({"role": "assistant", "content": reply}));
        let question = words.block_text(3, id + k, QUESTION_TOKENS);
        messages.push(json!({"role": "user", "content": question}));
    }
    serde_json::to_vec(&json!({"model": "m", "max_tokens": 16, "messages": messages}))
        .expect("a JSON value serializes")
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

fn ns_since(t: &mut Instant) -> u64 {
    let now = Instant::now();
    let ns = now.duration_since(*t).as_nanos() as u64;
    *t = now;
    ns.max(1)
}

/// One whole token-mode decision, timed stage by stage ([`STAGES`]).
pub(crate) struct Timed {
    /// The request's routing key (token ids attached).
    pub key: kvroute_core::route_key::RouteKey,
    /// Prompt tokens the shard's prefix cache reused.
    pub reused_tokens: usize,
    /// ns per stage, in [`STAGES`] order (each ≥ 1).
    pub stages: [u64; 5],
    /// ns of the whole decision (≥ 1): from the body's last read until the request could
    /// leave, the first [`DECISION_STAGES`] stages.
    pub whole: u64,
    /// ns the prefix scan of the reads before the last took, while the body arrived (not in
    /// `whole`).
    pub early_scan: u64,
}

/// Routes chat `body` as the gateway does, at virtual time `seq` ms: parse and tokenize,
/// facts, fleet snapshot and policy, book (a load guard, released right after its first
/// token); then what the gateway does once the request has left (`after_head`: the chat-prefix
/// entries cached, the decision recorded). Shared by `bench decision` and `bench fleet`.
///
/// Timed from the body's last read, as the gateway's decision starts: the reads before it
/// (all but the last [`defaults::MIN_READ_BYTES`]) were scanned for cached chat prefixes as
/// they came ([`PrefixScanner`]), untimed here and reported apart ([`Timed::early_scan`]).
/// The whole ends where the gateway sends the request (io's `exchange::attempts`), before
/// `after_head`.
///
/// # Errors
/// The body does not parse, the chat template fails, or the policy picks no worker.
pub(crate) fn timed_decision(
    tokenizers: &mut kvroute_core::tokens::ShardTokenizers,
    router: &Router,
    workers: &Workers,
    body: &[u8],
    seq: u64,
    rng: &mut impl rand::Rng,
) -> Result<Timed, BoxError> {
    let now = seq;
    let early = Instant::now();
    let mut scan = tokenizers
        .scans(Endpoint::ChatCompletions)
        .then(PrefixScanner::new);
    if let Some(s) = scan.as_mut() {
        s.feed(&body[..body.len().saturating_sub(defaults::MIN_READ_BYTES)]);
    }
    let early_scan = early.elapsed().as_nanos() as u64;
    let start = Instant::now();
    let mut t = start;
    let (key, mut attached) =
        tokenizers.route_scanned(Endpoint::ChatCompletions, body, None, &|_| true, scan)?;
    if let Some(e) = attached.prompt_error {
        return Err(format!("the chat template failed: {e}").into());
    }
    let tokenize = ns_since(&mut t);
    let facts = router.request(&key);
    let facts_ns = ns_since(&mut t);
    let (view, decision) = router
        .decide_on(workers, &[], seq, now, &facts, rng)
        .ok_or("no eligible worker")?;
    let decide = ns_since(&mut t);
    let booking = router.booking_request(&view.snapshot(seq, now), &facts, &decision);
    let worker = view
        .worker(decision.worker)
        .cloned()
        .ok_or("no such worker")?;
    let guard = worker.acquire_booked(booking, now as f64);
    let book = ns_since(&mut t);
    let whole = (start.elapsed().as_nanos() as u64).max(1);
    // The request has left: what io's exchange does after the worker's response head.
    let mut t = Instant::now();
    if let Some(insert) = attached.chat_insert.take() {
        insert.apply();
    }
    router.record(&key, &decision, now);
    let after_head = ns_since(&mut t);
    guard.first_token(now as f64);
    drop(guard);
    drop(facts);
    Ok(Timed {
        reused_tokens: attached.reused_tokens,
        key,
        stages: [tokenize, facts_ns, decide, book, after_head],
        whole,
        early_scan,
    })
}

/// One (policy, size) run: the JSON object of the report.
fn run_one(
    tok: &Tokenizer,
    words: &WordIds,
    policy: PolicyKind,
    size: usize,
) -> Result<Value, BoxError> {
    let cfg = Config {
        policy,
        ..Config::default()
    };
    let router = Router::new(&cfg);
    let specs: Vec<String> = (0..WORKERS)
        .map(|i| format!("http://127.0.0.1:{}", 19101 + i))
        .collect();
    let workers = Workers::new(&specs)?;
    let mut tokenizers =
        Tokenizers::new(Some(tok.clone()), Vec::new(), DEFAULT_CACHE_TOKENS).for_shard();
    let system = system_prompt();
    let (mut turn1, mut turn10) = (histogram(), histogram());
    let (mut early, mut late) = (histogram(), histogram());
    let mut stages: Vec<Histogram<u64>> = STAGES.iter().map(|_| histogram()).collect();
    let mut rng = rand::rng();
    let mut seq = 0u64;
    let mut prompt_tokens = 0usize;
    let mut reused_tokens = 0usize;
    for conv in 0..CONVERSATIONS as u64 {
        for turn in 1..=TURNS {
            let body = chat_body(words, &system, conv, turn, size);
            let d = timed_decision(&mut tokenizers, &router, &workers, &body, seq, &mut rng)?;
            let whole = d.whole;
            seq += 1;
            if turn == 1 {
                turn1.record(whole)?;
            }
            if turn == TURNS {
                prompt_tokens += d.key.input_ids.as_ref().map_or(0, |v| v.len());
                reused_tokens += d.reused_tokens;
                turn10.record(whole)?;
                let half = if (conv as usize) < CONVERSATIONS / 2 {
                    &mut early
                } else {
                    &mut late
                };
                half.record(whole)?;
                for (h, ns) in stages.iter_mut().zip(d.stages) {
                    h.record(ns)?;
                }
            }
        }
    }
    let q = |h: &Histogram<u64>| json!({"p50_ns": h.value_at_quantile(0.5), "p99_ns": h.value_at_quantile(0.99), "max_ns": h.max()});
    let stage_p50: serde_json::Map<String, Value> = STAGES
        .iter()
        .zip(&stages)
        .map(|(s, h)| (format!("{s}_p50_ns"), json!(h.value_at_quantile(0.5))))
        .collect();
    Ok(json!({
        "policy": policy.as_str(),
        "chat_tokens": size,
        "turn10_prompt_tokens_mean": prompt_tokens / CONVERSATIONS,
        "turn10_reused_share": reused_tokens as f64 / prompt_tokens.max(1) as f64,
        "turn1": q(&turn1),
        "turn10": q(&turn10),
        "turn10_stages": stage_p50,
        "late_over_early": late.value_at_quantile(0.5) as f64 / early.value_at_quantile(0.5).max(1) as f64,
    }))
}

/// Runs every (policy, size) pair and returns the report; prints one line per pair to stderr
/// as it goes.
///
/// # Errors
/// The embedded tokenizer fails to load, a body does not parse, or the chat template fails.
pub fn run() -> Result<Value, BoxError> {
    let tok = Tokenizer::qwen3()?;
    let words = WordIds::from_tokenizer(&tok)?;
    let mut runs = Vec::new();
    for policy in policies() {
        for size in SIZES {
            let r = run_one(&tok, &words, policy, size)?;
            eprintln!(
                "decision {:>15} {:>6} tokens: turn 1 p50 {:>8} ns, turn 10 p50 {:>8} ns p99 {:>8} ns, late/early {:.2}",
                policy.as_str(),
                size,
                r["turn1"]["p50_ns"],
                r["turn10"]["p50_ns"],
                r["turn10"]["p99_ns"],
                r["late_over_early"].as_f64().unwrap_or(f64::NAN),
            );
            runs.push(r);
        }
    }
    Ok(json!({
        "workers": WORKERS,
        "conversations": CONVERSATIONS,
        "turns": TURNS,
        "runs": runs,
    }))
}
