//! Trace handling: Mooncake JSONL records ([`TraceRecord`], [`load_mooncake`]), WEKA
//! conversation documents ([`weka`]), both as a [`Trace`] ([`load_trace`] detects the
//! format), the infinite-cache hit-rate bound ([`infinite_cache_bound`],
//! [`Trace::engine_bound`]) and id→text synthesis ([`WordIds`], [`PromptBuilder`], in
//! [`synth`]).
//!
//! Traces carry lengths and prefix-block ids, never text; [`synth`] turns each id into a
//! deterministic block of words so that equal ids become equal prefixes. Source:
//! `shared/reference/traces.md` §1, §3, §5.

pub mod synth;
pub mod weka;

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use synth::{PromptBuilder, SplitMix64, WordIds};

/// Tokens per Mooncake `hash_ids` block. Source: traces.md §1 ("one id per 512-token block").
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// Engine/router KV block size used by the engine-level bound variant, in tokens.
/// Source: traces.md §5 ("engine-level variant (block 16 …)"), engine-model.md §6.
pub const ENGINE_BLOCK_TOKENS: u32 = 16;

/// Namespace of the Mooncake conversation trace's ids in the text generator.
/// Source: traces.md §3 ("`ns`: 0 for the Mooncake file").
pub const MOONCAKE_NAMESPACE: u32 = 0;

/// Bit set on the namespace of request-private tail blocks: a WEKA request's tail tokens
/// come from `(ns | 2^31, request index)`. Source: traces.md §3.
pub const TAIL_NAMESPACE_BIT: u32 = 1 << 31;

/// One request of a Mooncake-format trace (one JSONL line).
///
/// Invariant checked by [`load_mooncake`]: `hash_ids.len() = ⌈input_length / 512⌉`, so the last
/// block holds `input_length − 512·(n−1)` tokens (1 ..= 512). Source: traces.md §1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Arrival time from trace start, ms (JSON field `timestamp`).
    #[serde(rename = "timestamp")]
    pub timestamp_ms: u64,
    /// Prompt length, tokens.
    pub input_length: u32,
    /// Tokens to generate (sent as `max_tokens`).
    pub output_length: u32,
    /// One id per 512-token prompt block; equal ids are equal (reusable) prefix blocks.
    pub hash_ids: Vec<u64>,
}

impl TraceRecord {
    /// Tokens of block `i` of this request's prompt with `block_tokens` tokens per id:
    /// `block_tokens` for every block but the last, which holds the remainder
    /// `input_length − block_tokens·(n−1)`. Returns 0 for `i ≥ n`. Source: traces.md §3.
    pub fn block_len(&self, i: usize, block_tokens: u32) -> u32 {
        let n = self.hash_ids.len();
        if i >= n {
            0
        } else if i + 1 < n {
            block_tokens
        } else {
            self.input_length
                .saturating_sub(block_tokens * (n as u32 - 1))
                .min(block_tokens)
        }
    }
}

/// Errors from reading a trace file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// File being read.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A line is not a valid Mooncake record (bad JSON or missing / mistyped field).
    #[error("{path}:{line}: invalid record: {source}")]
    Parse {
        /// File being read.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Underlying JSON error.
        source: serde_json::Error,
    },
    /// `hash_ids.len()` is not `⌈input_length / 512⌉` (traces.md §1).
    #[error(
        "{path}:{line}: {blocks} hash_ids for input_length {input_length} (expected ⌈input_length/512⌉)"
    )]
    BlockCount {
        /// File being read.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// `input_length` of the record, tokens.
        input_length: u32,
        /// `hash_ids.len()` of the record.
        blocks: usize,
    },
    /// The tokenizer vocabulary has no `Ġ` + 3–8 lowercase-letter token to build text from
    /// (traces.md §3 `WORD_IDS`).
    #[error("vocabulary has no leading-space lowercase word tokens (WORD_IDS is empty)")]
    NoWordTokens,
    /// A WEKA file name carries no number to use as its id namespace (traces.md §3).
    #[error("{path}: a WEKA file name must end in its number (trace_0024.json)")]
    WekaNamespace {
        /// File being read.
        path: PathBuf,
    },
    /// A WEKA document or request breaks traces.md §2.
    #[error("{path}: request {request}: {reason}")]
    WekaBlock {
        /// File being read.
        path: PathBuf,
        /// 0-based request index in the file.
        request: usize,
        /// The rule broken.
        reason: &'static str,
    },
    /// A trace directory holds no `.json` file.
    #[error("{path}: no .json trace files")]
    Empty {
        /// Directory read.
        path: PathBuf,
    },
}

/// Which kind of file a [`Trace`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// Mooncake JSONL (traces.md §1): open loop at `timestamp`, 512-token blocks, the last
    /// block partial.
    Mooncake,
    /// WEKA JSON documents (traces.md §2): closed loop per conversation, 64-token full
    /// blocks plus a private tail.
    Weka,
}

/// What the simulator needs of one request beyond its [`TraceRecord`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestMeta {
    /// Namespace of the request's `hash_ids` (traces.md §3): 0 for Mooncake, the file
    /// number for WEKA. Ids are keyed by `(namespace, id)`.
    pub namespace: u32,
    /// `None`: every block is an id, the last one partial (Mooncake). `Some(k)`: the ids are
    /// full blocks and the `input_length − B·len(hash_ids)` tail tokens come from
    /// `(namespace | 2^31, k)`, k = the request's index in its file (WEKA).
    pub tail_id: Option<u64>,
    /// Closed-loop conversation the request belongs to (`None`: open loop at
    /// `timestamp_ms`).
    pub conversation: Option<u32>,
    /// Closed loop: client delay between the previous response of the conversation and
    /// this request, ms of trace time (WEKA `think_time`).
    pub think_ms: f64,
}

impl RequestMeta {
    /// Mooncake request: namespace 0, no tail, open loop.
    pub const OPEN_LOOP: RequestMeta = RequestMeta {
        namespace: MOONCAKE_NAMESPACE,
        tail_id: None,
        conversation: None,
        think_ms: 0.0,
    };
}

/// A workload to replay: records in arrival order (Mooncake) or conversation by
/// conversation, each in its own order (WEKA), with one [`RequestMeta`] per record.
///
/// # Invariants
/// 1. `records.len() == meta.len()`.
/// 2. Closed-loop records of one conversation appear in their send order; conversations are
///    numbered `0..conversations`.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Where it came from.
    pub format: TraceFormat,
    /// Tokens per `hash_ids` block: 512 (Mooncake) or 64 (WEKA).
    pub block_tokens: u32,
    /// The requests.
    pub records: Vec<TraceRecord>,
    /// One per record.
    pub meta: Vec<RequestMeta>,
    /// Closed-loop conversations (0 for an open-loop trace).
    pub conversations: usize,
}

impl Trace {
    /// A trace without requests.
    pub fn empty(format: TraceFormat, block_tokens: u32) -> Self {
        Self {
            format,
            block_tokens,
            records: Vec::new(),
            meta: Vec::new(),
            conversations: 0,
        }
    }

    /// Mooncake-format records (built-in workload or a JSONL file) as an open-loop trace,
    /// 512-token blocks, namespace 0.
    pub fn mooncake(records: Vec<TraceRecord>) -> Self {
        let meta = vec![RequestMeta::OPEN_LOOP; records.len()];
        Self {
            format: TraceFormat::Mooncake,
            block_tokens: MOONCAKE_BLOCK_TOKENS,
            records,
            meta,
            conversations: 0,
        }
    }

    /// Appends `other`'s conversations after this trace's, renumbered.
    pub fn append_conversations(&mut self, other: Trace) {
        let base = self.conversations as u32;
        self.records.extend(other.records);
        self.meta
            .extend(other.meta.into_iter().map(|m| RequestMeta {
                conversation: m.conversation.map(|c| c + base),
                ..m
            }));
        self.conversations += other.conversations;
    }

    /// Keeps the first `n` records (closed loop: whole conversations first, so later
    /// conversations are the ones cut).
    pub fn truncate(&mut self, n: usize) {
        self.records.truncate(n);
        self.meta.truncate(n);
        let last = self.meta.iter().filter_map(|m| m.conversation).max();
        self.conversations = last.map_or(0, |c| c as usize + 1);
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the trace has no request.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Largest `input_length`, tokens (0 when empty).
    pub fn max_input_tokens(&self) -> u32 {
        self.records
            .iter()
            .map(|r| r.input_length)
            .max()
            .unwrap_or(0)
    }

    /// Infinite-cache bound of the trace, engine-level variant (traces.md §5): requests in
    /// slice order (open loop: arrival order; closed loop: the conversations do not share
    /// ids, so their interleaving does not matter), ids keyed by `(namespace, id)`; per
    /// request, `k` = leading ids already seen, matched = `min(k·B, L)`, cached =
    /// `min(matched rounded down to engine_block, ⌊(L−1)/engine_block⌋·engine_block)`; the
    /// bound is `Σ cached / Σ L` (0 for an empty trace). This is what the simulator's hit rate
    /// (`cached_tokens / prompt_tokens`) reaches on one engine that never evicts
    /// (engine-model.md §9). Mooncake conversation: 37.4 % with (512, 16).
    pub fn engine_bound(&self, engine_block: u32) -> f64 {
        let keys = self
            .records
            .iter()
            .zip(&self.meta)
            .map(|(r, m)| (r, m.namespace));
        engine_bound_keyed(keys, self.block_tokens, engine_block)
    }
}

/// Reads a trace file or directory, detecting the format: a directory is WEKA (every
/// `*.json` file one conversation, [`weka::load_weka_dir`]); a file whose first line is a
/// JSON object with `timestamp` is Mooncake JSONL ([`load_mooncake`]); any other file is one
/// WEKA document ([`weka::load_weka_file`]). `max_requests` keeps the first N records
/// ([`Trace::truncate`]).
///
/// # Errors
/// The errors of the loader used; [`TraceError::Io`] when `path` cannot be read.
pub fn load_trace(path: &Path, max_requests: Option<usize>) -> Result<Trace, TraceError> {
    let io = |source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut trace = if std::fs::metadata(path).map_err(io)?.is_dir() {
        weka::load_weka_dir(path)?
    } else {
        let mut head = String::new();
        File::open(path)
            .map_err(io)?
            .take(1 << 20)
            .read_to_string(&mut head)
            .or_else(|e| {
                // A cut inside a UTF-8 sequence: the first line is still what matters.
                if e.kind() == std::io::ErrorKind::InvalidData {
                    Ok(0)
                } else {
                    Err(io(e))
                }
            })?;
        let first = head.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        let mooncake = serde_json::from_str::<serde_json::Value>(first)
            .ok()
            .is_some_and(|v| v.get("timestamp").is_some());
        if mooncake {
            Trace::mooncake(load_mooncake(path, max_requests)?)
        } else {
            weka::load_weka_file(path)?
        }
    };
    if let Some(n) = max_requests {
        trace.truncate(n);
    }
    Ok(trace)
}

/// Whether `r` satisfies `hash_ids.len() = ⌈input_length / block_tokens⌉` with at least one block.
pub fn block_count_ok(r: &TraceRecord, block_tokens: u32) -> bool {
    r.input_length > 0 && r.hash_ids.len() == r.input_length.div_ceil(block_tokens) as usize
}

/// Reads a Mooncake JSONL trace (traces.md §1), keeping file order; blank lines are skipped.
/// Stops after `max_requests` records when given.
///
/// # Errors
/// - [`TraceError::Io`]: the file cannot be opened or read.
/// - [`TraceError::Parse`]: a line is not a record (with its 1-based line number).
/// - [`TraceError::BlockCount`]: a record's `hash_ids` length disagrees with `input_length`.
pub fn load_mooncake(
    path: impl AsRef<Path>,
    max_requests: Option<usize>,
) -> Result<Vec<TraceRecord>, TraceError> {
    let path = path.as_ref();
    let io_err = |source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let reader = BufReader::new(File::open(path).map_err(io_err)?);
    let limit = max_requests.unwrap_or(usize::MAX);
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        if out.len() >= limit {
            break;
        }
        let line = line.map_err(io_err)?;
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRecord = serde_json::from_str(&line).map_err(|source| TraceError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            source,
        })?;
        if !block_count_ok(&r, MOONCAKE_BLOCK_TOKENS) {
            return Err(TraceError::BlockCount {
                path: path.to_path_buf(),
                line: i + 1,
                input_length: r.input_length,
                blocks: r.hash_ids.len(),
            });
        }
        out.push(r);
    }
    Ok(out)
}

/// Infinite-cache prefix-hit bound of a trace (traces.md §5): the hit rate of one worker with
/// unlimited KV memory that never evicts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Bound {
    /// `hit_blocks / total_blocks`, fraction 0–1.
    pub block_weighted: f64,
    /// `hit_tokens / total_tokens`, fraction 0–1.
    pub token_weighted: f64,
    /// Leading blocks already seen, summed over requests.
    pub hit_blocks: u64,
    /// Blocks of all requests (`Σ len(hash_ids)`).
    pub total_blocks: u64,
    /// `Σ min(k·B, L)` tokens, k = leading blocks seen, B = block size, L = input length.
    pub hit_tokens: u64,
    /// `Σ input_length` tokens.
    pub total_tokens: u64,
}

/// Computes the infinite-cache bound of `records` in arrival (slice) order with
/// `block_tokens` tokens per id (512 for Mooncake): per request, k = number of leading ids
/// already seen (stopping at the first unseen id); block-weighted `Σk / Σn`, token-weighted
/// `Σ min(k·B, L) / Σ L`. Empty input gives 0 for both. Source: traces.md §5
/// (Mooncake conversation: 36.6 % = 105,710 / 288,500 blocks; 37.4 % token-weighted).
pub fn infinite_cache_bound(records: &[TraceRecord], block_tokens: u32) -> Bound {
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hit_blocks, mut total_blocks, mut hit_tokens, mut total_tokens) = (0u64, 0, 0, 0);
    for r in records {
        let k = r.hash_ids.iter().take_while(|id| seen.contains(id)).count() as u64;
        let len = u64::from(r.input_length);
        hit_blocks += k;
        total_blocks += r.hash_ids.len() as u64;
        hit_tokens += (k * u64::from(block_tokens)).min(len);
        total_tokens += len;
        seen.extend(r.hash_ids.iter().copied());
    }
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    Bound {
        block_weighted: ratio(hit_blocks, total_blocks),
        token_weighted: ratio(hit_tokens, total_tokens),
        hit_blocks,
        total_blocks,
        hit_tokens,
        total_tokens,
    }
}

/// Engine-level variant of the bound (traces.md §5): per request, cached tokens =
/// `min(matched tokens rounded down to engine_block, ⌊(L−1)/engine_block⌋·engine_block)`,
/// matched tokens = `min(k·block_tokens, L)`; returns `Σ cached / Σ L` (fraction 0–1, 0 for
/// empty input). A simulated single worker with unlimited blocks must reproduce it exactly
/// (engine-model.md §9). Mooncake conversation: 37.4 % with (512, 16).
pub fn engine_cache_bound(records: &[TraceRecord], block_tokens: u32, engine_block: u32) -> f64 {
    engine_bound_keyed(
        records.iter().map(|r| (r, MOONCAKE_NAMESPACE)),
        block_tokens,
        engine_block,
    )
}

/// The engine-level bound over `(record, namespace)` pairs in order, ids keyed by
/// `(namespace, id)` (see [`Trace::engine_bound`]).
fn engine_bound_keyed<'a>(
    records: impl Iterator<Item = (&'a TraceRecord, u32)>,
    block_tokens: u32,
    engine_block: u32,
) -> f64 {
    let mut seen: HashSet<(u32, u64)> = HashSet::new();
    let eb = u64::from(engine_block.max(1));
    let (mut cached, mut total) = (0u64, 0u64);
    for (r, ns) in records {
        let k = r
            .hash_ids
            .iter()
            .take_while(|&&id| seen.contains(&(ns, id)))
            .count() as u64;
        let len = u64::from(r.input_length);
        let matched = (k * u64::from(block_tokens)).min(len);
        let cap = (len.saturating_sub(1) / eb) * eb;
        cached += ((matched / eb) * eb).min(cap);
        total += len;
        seen.extend(r.hash_ids.iter().map(|&id| (ns, id)));
    }
    if total == 0 {
        0.0
    } else {
        cached as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: u64, len: u32, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp_ms: ts,
            input_length: len,
            output_length: 10,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn bound_counts_leading_seen_blocks_only() {
        // r1: nothing seen. r2: 0,1 seen, 5 unseen → k=2. r3: 0 seen, 7 unseen, 1 seen but
        // after a gap → k=1.
        let rs = [
            rec(0, 1500, &[0, 1, 2]),
            rec(1, 1100, &[0, 1, 5]),
            rec(2, 1200, &[0, 7, 1]),
        ];
        let b = infinite_cache_bound(&rs, 512);
        assert_eq!((b.hit_blocks, b.total_blocks), (3, 9));
        assert_eq!((b.hit_tokens, b.total_tokens), (1024 + 512, 3800));
        assert!((b.block_weighted - 3.0 / 9.0).abs() < 1e-12);
        // Token-weighted caps a fully-seen request at its length.
        let b = infinite_cache_bound(&[rec(0, 600, &[0, 1]), rec(1, 600, &[0, 1])], 512);
        assert_eq!((b.hit_tokens, b.total_tokens), (600, 1200));
        // Engine-level: second request matched 600 tokens, cap ⌊599/16⌋·16 = 592.
        let e = engine_cache_bound(&[rec(0, 600, &[0, 1]), rec(1, 600, &[0, 1])], 512, 16);
        assert!((e - 592.0 / 1200.0).abs() < 1e-12);
    }

    #[test]
    fn bound_of_empty_trace_is_zero() {
        let b = infinite_cache_bound(&[], 512);
        assert_eq!(b.block_weighted, 0.0);
        assert_eq!(b.token_weighted, 0.0);
    }

    #[test]
    fn block_len_trims_last_block() {
        let r = rec(0, 1100, &[0, 1, 2]);
        assert_eq!(
            [
                r.block_len(0, 512),
                r.block_len(1, 512),
                r.block_len(2, 512),
                r.block_len(3, 512)
            ],
            [512, 512, 76, 0]
        );
    }

    #[test]
    fn load_reports_line_numbers() {
        let dir = std::env::temp_dir().join(format!("kvroute-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\":0,\"input_length\":600,\"output_length\":5,\"hash_ids\":[0,1]}\n\n\
             {\"timestamp\":1,\"input_length\":600}\n",
        )
        .unwrap();
        match load_mooncake(&p, None) {
            Err(TraceError::Parse { line, .. }) => assert_eq!(line, 3),
            other => panic!("expected parse error, got {other:?}"),
        }
        assert_eq!(load_mooncake(&p, Some(1)).unwrap().len(), 1);
        std::fs::write(
            &p,
            "{\"timestamp\":0,\"input_length\":1025,\"output_length\":5,\"hash_ids\":[0,1]}\n",
        )
        .unwrap();
        assert!(matches!(
            load_mooncake(&p, None),
            Err(TraceError::BlockCount {
                line: 1,
                input_length: 1025,
                blocks: 2,
                ..
            })
        ));
        assert!(matches!(
            load_mooncake(dir.join("missing.jsonl"), None),
            Err(TraceError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A tiny hand-made WEKA document: 64-token ids, tails from `(ns | 2^31, k)`.
    const WEKA_DOC: &str = r#"{"id": "trace_0024", "block_size": 64, "hash_id_scope": "local",
        "requests": [
          {"t": 0.0, "type": "n", "in": 150, "out": 10, "hash_ids": [1, 2], "think_time": 0.0},
          {"t": 20.5, "type": "s", "in": 260, "out": 5, "hash_ids": [1, 2, 3, 4], "think_time": 3.5},
          {"t": 40.0, "type": "n", "in": 200, "out": 7, "hash_ids": [1, 9, 10]}
        ]}"#;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvroute-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Worked example of the engine-level bound on [`WEKA_DOC`]: r0 sees nothing; r1 sees
    /// ids 1, 2 → 128 tokens (cap ⌊259/16⌋·16 = 256); r2 sees id 1 → 64. Bound
    /// (128 + 64) / (150 + 260 + 200) = 192 / 610. A second file (another namespace) with
    /// the same ids shares nothing.
    #[test]
    fn weka_bound_of_a_hand_made_doc() {
        let dir = temp_dir("weka-bound");
        let p = write(&dir, "trace_0024.json", WEKA_DOC);
        let t = load_trace(&p, None).unwrap();
        assert_eq!(
            (t.format, t.block_tokens, t.len()),
            (TraceFormat::Weka, 64, 3)
        );
        assert_eq!(t.meta[1].namespace, 24);
        assert_eq!(t.meta[1].tail_id, Some(1));
        assert_eq!(t.meta[1].think_ms, 3_500.0);
        assert_eq!(t.meta[2].think_ms, 0.0);
        assert_eq!(t.records[1].timestamp_ms, 20_500);
        assert!((t.engine_bound(16) - 192.0 / 610.0).abs() < 1e-12);
        write(&dir, "trace_0181.json", WEKA_DOC);
        let both = load_trace(&dir, None).unwrap();
        assert_eq!((both.len(), both.conversations), (6, 2));
        assert_eq!(both.meta[3].conversation, Some(1));
        assert_eq!(both.meta[3].namespace, 181);
        assert!((both.engine_bound(16) - 384.0 / 1220.0).abs() < 1e-12);
        // Truncating keeps whole conversations first.
        let mut cut = both.clone();
        cut.truncate(4);
        assert_eq!((cut.len(), cut.conversations), (4, 2));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The Mooncake bound through [`Trace::engine_bound`] equals [`engine_cache_bound`].
    #[test]
    fn trace_bound_matches_the_record_bound() {
        let rs = vec![
            rec(0, 1500, &[0, 1, 2]),
            rec(1, 1100, &[0, 1, 5]),
            rec(2, 600, &[0, 1]),
        ];
        let t = Trace::mooncake(rs.clone());
        assert_eq!(t.engine_bound(16), engine_cache_bound(&rs, 512, 16));
        assert!(t.engine_bound(16) > 0.0);
    }

    /// Format detection: a JSONL file whose first line has `timestamp` is Mooncake, a JSON
    /// document is WEKA; broken WEKA inputs name the rule.
    #[test]
    fn load_trace_detects_the_format_and_checks_weka_rules() {
        let dir = temp_dir("weka-detect");
        let m = write(
            &dir,
            "m.jsonl",
            "{\"timestamp\":5,\"input_length\":600,\"output_length\":5,\"hash_ids\":[0,1]}\n",
        );
        let t = load_trace(&m, None).unwrap();
        assert_eq!(
            (t.format, t.block_tokens, t.conversations),
            (TraceFormat::Mooncake, 512, 0)
        );
        assert_eq!(t.meta[0], RequestMeta::OPEN_LOOP);
        let bad = WEKA_DOC.replace("[1, 9, 10]", "[1, 9]");
        let p = write(&dir, "trace_0003.json", &bad);
        assert!(matches!(
            load_trace(&p, None),
            Err(TraceError::WekaBlock { request: 2, .. })
        ));
        let p = write(&dir, "noname.json", WEKA_DOC);
        assert!(matches!(
            load_trace(&p, None),
            Err(TraceError::WekaNamespace { .. })
        ));
        let p = write(
            &dir,
            "trace_0004.json",
            &WEKA_DOC.replace("\"n\"", "\"subagent\""),
        );
        assert!(matches!(
            load_trace(&p, None),
            Err(TraceError::WekaBlock { request: 0, .. })
        ));
        let empty = dir.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        assert!(matches!(
            load_trace(&empty, None),
            Err(TraceError::Empty { .. })
        ));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The 12 published WEKA files reproduce traces.md §2: 526 requests, bound 95.5 %
    /// (token-weighted; the engine-level variant can only be lower). Skipped without
    /// `../shared/data`.
    #[test]
    fn weka_files_reproduce_the_published_bound() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/traces/weka");
        if !dir.is_dir() {
            eprintln!("skipped: {} not found", dir.display());
            return;
        }
        let t = load_trace(&dir, None).unwrap();
        assert_eq!((t.len(), t.conversations), (526, 12));
        assert_eq!(t.max_input_tokens(), 310_241);
        let b = t.engine_bound(16);
        assert!((0.950..0.9555).contains(&b), "{b}");
    }
}
