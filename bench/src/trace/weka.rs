//! WEKA Claude Code agentic traces (traces.md §2): one JSON document per conversation,
//! 64-token blocks, ids local to the file.
//!
//! [`load_weka_file`] reads one document into a [`Trace`] of one closed-loop conversation;
//! [`load_weka_dir`] reads every `*.json` of a directory (sorted by name), one conversation
//! each. A file's ids live in namespace = its number (`trace_0024.json` → 24, traces.md §3),
//! so conversations never share blocks, as in the data.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{RequestMeta, Trace, TraceError, TraceFormat, TraceRecord};

/// Tokens per WEKA `hash_ids` block. Source: traces.md §2 (`block_size` 64).
pub const WEKA_BLOCK_TOKENS: u32 = 64;

/// One WEKA document (the fields the simulator uses; others are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct WekaDoc {
    /// E.g. `"trace_0001"`.
    #[serde(default)]
    pub id: String,
    /// Tokens per hash id (64 in every file; others are refused).
    pub block_size: u32,
    /// Requests in time order.
    pub requests: Vec<WekaRequest>,
}

/// One request of a WEKA document (traces.md §2 request fields).
#[derive(Debug, Clone, Deserialize)]
pub struct WekaRequest {
    /// Seconds from conversation start.
    pub t: f64,
    /// `"n"` non-streaming, `"s"` streaming, `"subagent"` a nested sub-agent (refused).
    #[serde(rename = "type", default)]
    pub kind: String,
    /// Input tokens.
    #[serde(rename = "in")]
    pub input: u32,
    /// Output tokens.
    pub out: u32,
    /// Ids of the full 64-token blocks: `len = ⌊in / 64⌋`.
    pub hash_ids: Vec<u64>,
    /// Client delay before this request, s (0 when absent: one request in trace_0090).
    #[serde(default)]
    pub think_time: f64,
}

/// Namespace of a WEKA file: the number in its name (`trace_0024.json` → 24), traces.md §3.
/// `None` when the stem has no trailing digits or the number exceeds `2^31 − 1` (the bit
/// above is the tail namespace flag).
pub fn namespace_of(path: &Path) -> Option<u32> {
    let stem = path.file_stem()?.to_str()?;
    let digits: String = stem
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    digits
        .parse::<u32>()
        .ok()
        .filter(|&n| n < super::TAIL_NAMESPACE_BIT)
}

/// Reads one WEKA document as one closed-loop conversation (conversation index 0).
///
/// Each request becomes a [`TraceRecord`] (`timestamp_ms = t·1000`, `input_length = in`,
/// `output_length = out`, the full-block `hash_ids`) with [`RequestMeta`]: namespace from
/// [`namespace_of`], tail id = the request's index in the file, `think_ms = think_time·1000`.
///
/// # Errors
/// - [`TraceError::Io`]: unreadable file.
/// - [`TraceError::Parse`]: not a WEKA document (line 0).
/// - [`TraceError::WekaNamespace`]: the file name has no number.
/// - [`TraceError::WekaBlock`]: `block_size` ≠ 64, a request with `len(hash_ids) ≠ ⌊in/64⌋`
///   or `in = 0`, or a `subagent` request (none in the published files).
pub fn load_weka_file(path: &Path) -> Result<Trace, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_weka(path, &text)
}

/// [`load_weka_file`] on text already read from `path`.
///
/// # Errors
/// As [`load_weka_file`], without `Io`.
pub fn parse_weka(path: &Path, text: &str) -> Result<Trace, TraceError> {
    let doc: WekaDoc = serde_json::from_str(text).map_err(|source| TraceError::Parse {
        path: path.to_path_buf(),
        line: 0,
        source,
    })?;
    let ns = namespace_of(path).ok_or_else(|| TraceError::WekaNamespace {
        path: path.to_path_buf(),
    })?;
    let bad = |request: usize, reason: &'static str| TraceError::WekaBlock {
        path: path.to_path_buf(),
        request,
        reason,
    };
    if doc.block_size != WEKA_BLOCK_TOKENS {
        return Err(bad(0, "block_size is not 64"));
    }
    let mut trace = Trace::empty(TraceFormat::Weka, WEKA_BLOCK_TOKENS);
    for (i, r) in doc.requests.iter().enumerate() {
        if r.kind == "subagent" {
            return Err(bad(i, "subagent requests are not supported"));
        }
        if r.input == 0 || r.hash_ids.len() != (r.input / WEKA_BLOCK_TOKENS) as usize {
            return Err(bad(i, "len(hash_ids) is not ⌊in / 64⌋"));
        }
        trace.records.push(TraceRecord {
            timestamp_ms: (r.t.max(0.0) * 1e3).round() as u64,
            input_length: r.input,
            output_length: r.out,
            hash_ids: r.hash_ids.clone(),
        });
        trace.meta.push(RequestMeta {
            namespace: ns,
            tail_id: Some(i as u64),
            conversation: Some(0),
            think_ms: r.think_time.max(0.0) * 1e3,
        });
    }
    trace.conversations = 1;
    Ok(trace)
}

/// Reads every `*.json` file of `dir` (sorted by file name) as one conversation each, in
/// that order (conversation k = the k-th file).
///
/// # Errors
/// As [`load_weka_file`] for each file; [`TraceError::Io`] when the directory cannot be
/// listed; [`TraceError::Empty`] when it holds no `.json` file.
pub fn load_weka_dir(dir: &Path) -> Result<Trace, TraceError> {
    let io = |source| TraceError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(TraceError::Empty {
            path: dir.to_path_buf(),
        });
    }
    let mut out = Trace::empty(TraceFormat::Weka, WEKA_BLOCK_TOKENS);
    for f in &files {
        out.append_conversations(load_weka_file(f)?);
    }
    Ok(out)
}
