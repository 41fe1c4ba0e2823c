//! `kvroute bench tokenize`: full vs incremental tokenization of multi-turn agent chats whose
//! lengths follow the WEKA Claude Code traces (traces.md §2), in one run (< 60 s).
//!
//! For each of [`CONVERSATIONS`] traces, turns 1..=[`TURNS`] of a chat are built so that the
//! prompt of turn k has about `in_k × SCALE` tokens (the trace's input length): a system
//! message of `system_tokens + tool_tokens`, then per turn the previous reply (`out` tokens)
//! and a user message (tool results) making up the rest. Content is code-like text (words,
//! punctuation, paths, numbers, newlines, indentation) so the BPE does real merges.
//!
//! Each turn's prompt is rendered once with the Qwen3 chat template, then tokenized twice on
//! one core: [`Tokenizer::encode`] of the whole text (full) and
//! [`IncrementalTokenizer::encode`] with one cache per conversation (incremental). Ratios
//! compare the two in the same run; `ids_identical` is true only if every incremental result
//! equalled the full one. Render time is reported separately (both paths pay it).
//!
//! Traces are read from `$KVROUTE_WEKA_DIR`, else `../shared/data/traces/weka` (from the
//! repository root); they are never copied into the repository.
//!
//! A second part (`growing` in the report, [`growing`]) measures what the Mooncake replay
//! sends: each turn is ONE user message whose text is the previous turn's text plus
//! 500–2,000 new tokens of vocabulary words, from 1,000–2,000 tokens up to 16k tokens, over
//! [`GROWING_TURNS`] turns of [`GROWING_CONVERSATIONS`] conversations. Nothing there is
//! reusable at message boundaries, only at text cuts inside the message. Per turn it reports
//! full encode, incremental encode (warm cache, the previous turns seen) and a miss
//! (incremental encode on an empty cache: its cost over the full encode is the overhead
//! every first turn pays), each the minimum of [`GROWING_REPEATS`] runs in this process.

use kvroute_tokenize::{IncrementalTokenizer, Tokenizer};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::trace::synth::{SplitMix64, WordIds};

/// Conversations of the growing single-message part.
pub const GROWING_CONVERSATIONS: usize = 6;
/// Turns per growing conversation (turn 1: 1,000–2,000 tokens; then +500–2,000 per turn).
pub const GROWING_TURNS: usize = 8;
/// Largest growing prompt, words (one token each): the Mooncake replay of the demo sends
/// prompts of 1k–16k tokens.
pub const GROWING_MAX_WORDS: usize = 16_384;
/// Runs per measurement of the growing part; the minimum is reported (2 noisy shared cores).
pub const GROWING_REPEATS: usize = 5;

/// Conversations (WEKA trace files, in name order) measured.
pub const CONVERSATIONS: usize = 3;
/// Turns per conversation.
pub const TURNS: usize = 20;
/// Prompt length of turn k = `in_k × SCALE` tokens: 0.5 keeps the run under 60 s on one core
/// while turns stay at 8k–150k tokens.
pub const SCALE: f64 = 0.5;

/// Code-like fragments mixed between words, so pieces are not all single-token words.
const FRAGMENTS: [&str; 14] = [
    "\n",
    "(",
    "): ",
    "{\"path\": \"src/",
    "_",
    "123",
    ".rs\"}",
    "\n    ",
    " == ",
    "[i]",
    ";\n",
    " // ",
    "é",
    "\t",
];

fn weka_dir() -> PathBuf {
    std::env::var_os("KVROUTE_WEKA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("../shared/data/traces/weka"))
}

/// About `n` tokens of code-like text, deterministic in `(ns, id)`.
fn content(words: &WordIds, ns: u32, id: u64, n: usize) -> String {
    let text = words.block_text(ns, id, n);
    let mut out = String::with_capacity(text.len() + n);
    for (i, w) in text.split_inclusive(' ').enumerate() {
        out.push_str(w);
        if i % 5 == 4 {
            out.push_str(FRAGMENTS[(i / 5 + id as usize) % FRAGMENTS.len()]);
        }
    }
    out
}

/// One measured turn of one conversation (times: one run, or the minimum over repeats).
#[derive(Default)]
struct Turn {
    tokens: usize,
    reused: usize,
    /// Rendering the chat template (WEKA section; zero in the growing section).
    render: Duration,
    full: Duration,
    incremental: Duration,
    /// A cold incremental encode, nothing cached (growing section; zero in the WEKA one).
    miss: Duration,
    identical: bool,
}

/// Sums over the conversations of one turn number (1-based `turn`, `n` conversations).
struct TurnSums {
    turn: usize,
    n: f64,
    sum: Turn,
}

impl TurnSums {
    fn mean_tokens(&self) -> f64 {
        (self.sum.tokens as f64 / self.n).round()
    }
    fn reused_fraction(&self) -> f64 {
        self.sum.reused as f64 / self.sum.tokens.max(1) as f64
    }
    /// Mean of `d` per conversation, ms.
    fn mean_ms(&self, d: Duration) -> f64 {
        d.as_secs_f64() * 1e3 / self.n
    }
    /// The table row both sections share (turn, mean tokens, reuse, full and incremental ms,
    /// speedup, identical ids), with the section's own columns `extra` (a JSON object) added.
    fn row(&self, extra: Value) -> Value {
        let t = &self.sum;
        let mut row = json!({
            "turn": self.turn,
            "mean_tokens": self.mean_tokens(),
            "reused_fraction": self.reused_fraction(),
            "full_ms": self.mean_ms(t.full),
            "incremental_ms": self.mean_ms(t.incremental),
            "speedup": ratio(t.full, t.incremental),
            "ids_identical": t.identical,
        });
        if let (Some(r), Value::Object(e)) = (row.as_object_mut(), extra) {
            r.extend(e);
        }
        row
    }
}

impl Turn {
    /// The sum of `turns` (identical when all are).
    fn sum<'a>(turns: impl IntoIterator<Item = &'a Turn>) -> Turn {
        turns.into_iter().fold(
            Turn {
                identical: true,
                ..Turn::default()
            },
            |a, t| Turn {
                tokens: a.tokens + t.tokens,
                reused: a.reused + t.reused,
                render: a.render + t.render,
                full: a.full + t.full,
                incremental: a.incremental + t.incremental,
                miss: a.miss + t.miss,
                identical: a.identical && t.identical,
            },
        )
    }
}

/// Per turn number: the sums of its non-empty row of turns.
fn turn_sums(per_turn: &[Vec<Turn>]) -> Vec<TurnSums> {
    per_turn
        .iter()
        .enumerate()
        .filter(|(_, row)| !row.is_empty())
        .map(|(k, row)| TurnSums {
            turn: k + 1,
            n: row.len() as f64,
            sum: Turn::sum(row),
        })
        .collect()
}

/// The sum of the turns numbered above `from`.
fn total_after(sums: &[TurnSums], from: usize) -> Turn {
    Turn::sum(sums.iter().filter(|s| s.turn > from).map(|s| &s.sum))
}

/// `a / b` for durations (b floored at 1 ns).
fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-9)
}

/// Runs the benchmark and returns its JSON report.
///
/// # Errors
/// The WEKA traces cannot be read or parsed (path in the message), or the embedded tokenizer
/// fails to load or render.
pub fn run() -> Result<Value, crate::BoxError> {
    let dir = weka_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| crate::BoxError::from(format!("reading {}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let tok = Tokenizer::qwen3()?;
    let words = WordIds::from_tokenizer(&tok)?;
    let started = Instant::now();
    let mut per_turn: Vec<Vec<Turn>> = (0..TURNS).map(|_| Vec::new()).collect();
    let mut used = Vec::new();
    for path in files.iter().take(CONVERSATIONS) {
        let doc: Value = serde_json::from_slice(&std::fs::read(path)?)
            .map_err(|e| crate::BoxError::from(format!("{}: {e}", path.display())))?;
        let ns = used.len() as u32 + 1;
        used.push(
            path.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
        );
        let reqs = doc["requests"].as_array().cloned().unwrap_or_default();
        let scaled = |v: &Value| (v.as_f64().unwrap_or(0.0) * SCALE) as usize;
        let head = scaled(&doc["system_tokens"]) + scaled(&doc["tool_tokens"]);
        let mut messages = vec![json!({"role": "system", "content": content(&words, ns, 0, head)})];
        let mut len = head;
        let mut inc = IncrementalTokenizer::new(tok.clone(), 1 << 24);
        for (k, req) in reqs.iter().take(TURNS).enumerate() {
            let target = scaled(&req["in"]);
            let user = target.saturating_sub(len).max(16);
            messages.push(
                json!({"role": "user", "content": content(&words, ns, 2 * k as u64 + 1, user)}),
            );
            len += user;
            let t0 = Instant::now();
            let text = tok.render_chat(&Value::Array(messages.clone()), true)?;
            let t1 = Instant::now();
            let full = tok.try_encode(&text)?;
            let t2 = Instant::now();
            let got = inc.encode(&text, 0)?;
            let t3 = Instant::now();
            per_turn[k].push(Turn {
                tokens: full.len(),
                reused: got.reused_tokens,
                render: t1 - t0,
                full: t2 - t1,
                incremental: t3 - t2,
                miss: Duration::ZERO,
                identical: got.ids == full,
            });
            let reply = scaled(&req["out"]).max(8);
            messages.push(json!({"role": "assistant", "content": content(&words, ns, 2 * k as u64 + 2, reply)}));
            len += reply;
        }
    }
    let sums = turn_sums(&per_turn);
    let table: Vec<Value> = sums
        .iter()
        .map(|s| {
            let t = &s.sum;
            s.row(json!({
                "render_ms": s.mean_ms(t.render),
                "speedup_with_render": ratio(t.full + t.render, t.incremental + t.render),
            }))
        })
        .collect();
    let all = total_after(&sums, 0);
    let turn10 = sums
        .iter()
        .find(|s| s.turn == 10)
        .map(|s| ratio(s.sum.full, s.sum.incremental));
    let growing = growing(&tok, &words)?;
    let report = json!({
        "growing": growing,
        "bench": "tokenize",
        "tokenizer": "qwen3 (embedded)",
        "traces": used,
        "scale": SCALE,
        "turns": TURNS,
        "full_tokens_per_s": all.tokens as f64 / all.full.as_secs_f64().max(1e-9),
        "incremental_tokens_per_s": all.tokens as f64 / all.incremental.as_secs_f64().max(1e-9),
        "incremental_speedup_turn10": turn10,
        "incremental_speedup_all_turns": ratio(all.full, all.incremental),
        "ids_identical": all.identical,
        "seconds": started.elapsed().as_secs_f64(),
        "per_turn": table,
    });
    print_table(&report);
    Ok(report)
}

/// The growing single-message part (see the module doc): per turn, full vs incremental vs
/// miss, and totals. Returns its JSON section and prints its table.
///
/// # Errors
/// The chat template fails to render, or the tokenizer fails.
pub fn growing(tok: &Tokenizer, words: &WordIds) -> Result<Value, crate::BoxError> {
    let started = Instant::now();
    let mut rows: Vec<Vec<Turn>> = (0..GROWING_TURNS).map(|_| Vec::new()).collect();
    for c in 0..GROWING_CONVERSATIONS {
        let ns = 1000 + c as u32;
        // The whole conversation text: blocks of 512 words (" w1 w2 …"), as replayed; a turn
        // of n words is its prefix up to the end of word n.
        let content: String = (0..GROWING_MAX_WORDS.div_ceil(512))
            .map(|b| words.block_text(ns, b as u64, 512))
            .collect();
        let mut ends: Vec<usize> = content.match_indices(' ').map(|(i, _)| i).skip(1).collect();
        ends.push(content.len());
        let mut rng = SplitMix64::new(ns, 7);
        let mut n = 1000 + (rng.next_u64() % 1001) as usize;
        let mut incs: Vec<IncrementalTokenizer> = (0..GROWING_REPEATS)
            .map(|_| IncrementalTokenizer::new(tok.clone(), 1 << 23))
            .collect();
        for row in rows.iter_mut() {
            let n_words = n.min(ends.len());
            let msg = &content[..ends[n_words - 1]];
            let prompt = tok.render_chat(&json!([{"role": "user", "content": msg}]), true)?;
            let (mut full, mut incr, mut miss) = (Duration::MAX, Duration::MAX, Duration::MAX);
            let (mut ok, mut reused, mut tokens) = (true, 0, 0);
            for inc in incs.iter_mut() {
                let mut empty = IncrementalTokenizer::new(tok.clone(), 1 << 23);
                let t0 = Instant::now();
                let want = tok.try_encode(&prompt)?;
                let t1 = Instant::now();
                let got = inc.encode(&prompt, 0)?;
                let t2 = Instant::now();
                let cold = empty.encode(&prompt, 0)?;
                let t3 = Instant::now();
                full = full.min(t1 - t0);
                incr = incr.min(t2 - t1);
                miss = miss.min(t3 - t2);
                ok &= got.ids == want && cold.ids == want && cold.reused_tokens == 0;
                (reused, tokens) = (got.reused_tokens, want.len());
            }
            row.push(Turn {
                tokens,
                reused,
                render: Duration::ZERO,
                full,
                incremental: incr,
                miss,
                identical: ok,
            });
            n += 500 + (rng.next_u64() % 1501) as usize;
        }
    }
    let sums = turn_sums(&rows);
    let table: Vec<Value> = sums
        .iter()
        .map(|s| {
            let t = &s.sum;
            s.row(json!({
                "miss_ms": s.mean_ms(t.miss),
                "miss_overhead": ratio(t.miss, t.full) - 1.0,
            }))
        })
        .collect();
    let (all, later) = (total_after(&sums, 0), total_after(&sums, 1));
    let secs = |d: Duration| d.as_secs_f64().max(1e-9);
    let out = json!({
        "conversations": GROWING_CONVERSATIONS,
        "turns": GROWING_TURNS,
        "repeats": GROWING_REPEATS,
        "full_tokens_per_s": all.tokens as f64 / secs(all.full),
        "incremental_tokens_per_s": all.tokens as f64 / secs(all.incremental),
        "incremental_tokens_per_s_turns_2_8": later.tokens as f64 / secs(later.incremental),
        "speedup_turns_2_8": ratio(later.full, later.incremental),
        "miss_overhead": ratio(all.miss, all.full) - 1.0,
        "ids_identical": all.identical,
        "seconds": started.elapsed().as_secs_f64(),
        "per_turn": table,
    });
    println!("growing single message (Mooncake-like), min of {GROWING_REPEATS} runs:");
    println!(
        "turn  mean_tokens  reused  full_ms  incr_ms  miss_ms  speedup  miss_overhead  identical"
    );
    for t in out["per_turn"].as_array().into_iter().flatten() {
        let f = |k: &str| t[k].as_f64().unwrap_or(0.0);
        println!(
            "{:>4}  {:>11}  {:>5.1}%  {:>7.2}  {:>7.2}  {:>7.2}  {:>6.1}x  {:>12.1}%  {}",
            t["turn"],
            t["mean_tokens"],
            f("reused_fraction") * 100.0,
            f("full_ms"),
            f("incremental_ms"),
            f("miss_ms"),
            f("speedup"),
            f("miss_overhead") * 100.0,
            t["ids_identical"],
        );
    }
    println!(
        "full {:.0} tokens/s, incremental {:.0} tokens/s (turns 2-8: {:.0}, {:.1}x), miss overhead {:.1}%, ids identical: {}",
        out["full_tokens_per_s"].as_f64().unwrap_or(0.0),
        out["incremental_tokens_per_s"].as_f64().unwrap_or(0.0),
        out["incremental_tokens_per_s_turns_2_8"]
            .as_f64()
            .unwrap_or(0.0),
        out["speedup_turns_2_8"].as_f64().unwrap_or(0.0),
        out["miss_overhead"].as_f64().unwrap_or(0.0) * 100.0,
        out["ids_identical"],
    );
    Ok(out)
}

fn print_table(r: &Value) {
    println!(
        "turn  mean_tokens  reused  full_ms  incr_ms  render_ms  speedup  w/render  identical"
    );
    for t in r["per_turn"].as_array().into_iter().flatten() {
        println!(
            "{:>4}  {:>11}  {:>5.1}%  {:>7.2}  {:>7.2}  {:>9.2}  {:>6.1}x  {:>7.1}x  {}",
            t["turn"],
            t["mean_tokens"],
            t["reused_fraction"].as_f64().unwrap_or(0.0) * 100.0,
            t["full_ms"].as_f64().unwrap_or(0.0),
            t["incremental_ms"].as_f64().unwrap_or(0.0),
            t["render_ms"].as_f64().unwrap_or(0.0),
            t["speedup"].as_f64().unwrap_or(0.0),
            t["speedup_with_render"].as_f64().unwrap_or(0.0),
            t["ids_identical"],
        );
    }
    println!(
        "full {:.0} tokens/s, incremental speedup at turn 10: {:.1}x, ids identical: {}",
        r["full_tokens_per_s"].as_f64().unwrap_or(0.0),
        r["incremental_speedup_turn10"].as_f64().unwrap_or(0.0),
        r["ids_identical"]
    );
}
