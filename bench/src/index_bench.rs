//! `kvroute bench index`: a short (< 60 s) benchmark run of the cache indexes that writes its
//! results as JSON. Every fast index is measured next to a naive baseline built from the same
//! data in the same run, and the ratio is reported with the absolute numbers.
//!
//! | section | fixture | baseline |
//! |---|---|---|
//! | event match | W workers; 64 conversations of T tokens sharing a 1k-token system prompt; worker w holds conversation w mod 64 | per-worker `HashSet<u64>` scan ([`NaiveWorkerSets`]) |
//! | token tree match | the same sequences recorded as routing decisions (pages of 16) | — (same grid) |
//! | event ingest | stores and removals from the first Mooncake conversation-trace requests through 8 simulated engines' block managers, replayed into one shard writer on one core | — |
//! | string tree match, warm insert | 200 conversations of N chars over 6 system prompts, 100 tenants (insert: one sent again to its tenant) | `BTreeMap<char, _>` trie (match) |
//! | eviction | string tree with 40k leaves of 200 chars, evicted to 0 | — |
//!
//! Latencies are per call, from `Instant` pairs into an hdrhistogram (ns); each index runs its
//! own loop over the same query sequence, so none is timed on caches another one just evicted.

use crate::engine::model::BlockEvent;
use crate::engine::{EngineConfig, EngineCore};
use crate::trace::{self, MOONCAKE_BLOCK_TOKENS, TraceRecord};
use hdrhistogram::Histogram;
use kvroute_index::keys::block_keys;
use kvroute_index::reference::{
    NaiveWorkerSets, conversation_corpus, synthetic_words, token_conversations, token_stream,
};
use kvroute_index::{EventIndex, EventIndexConfig, StringTree, TokenTree};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use std::hint::black_box;
use std::time::Instant;

/// Router block size, tokens (`defaults::BLOCK_SIZE`).
const BS: usize = 16;
/// Mooncake conversation trace, read from `../shared` (never committed).
const TRACE: &str = "../shared/data/traces/mooncake/conversation_trace.jsonl";

/// Runs the benchmark and returns its JSON report (also printed as a table on stderr).
///
/// # Errors
/// The Mooncake trace cannot be read (the ingest section needs it), or the simulated engine
/// rejects its configuration.
pub fn run() -> Result<Value, crate::BoxError> {
    let t0 = Instant::now();
    let mut out = serde_json::Map::new();
    let mut rows: Vec<String> = Vec::new();

    // Event index and token tree grid.
    let mut grid = Vec::new();
    for &(tokens, workers) in &[
        (1024, 8),
        (1024, 64),
        (8192, 8),
        (8192, 64),
        (8192, 256),
        (8192, 1024),
        (32768, 256),
        (32768, 1024),
    ] {
        let with_baseline = (tokens, workers) == (8192, 256);
        let r = event_grid_point(tokens, workers, with_baseline);
        rows.push(format!(
            "event match {tokens:>6} tok × {workers:>4} workers: p50 {:>7} ns  p99 {:>7} ns | token tree p50 {:>7} ns p99 {:>7} ns{}",
            r["event_p50_ns"], r["event_p99_ns"], r["token_tree_p50_ns"], r["token_tree_p99_ns"],
            if with_baseline {
                format!(
                    " | naive p99 {} ns ({:.0}×)",
                    r["baseline_p99_ns"],
                    r["baseline_p99_ns"].as_f64().unwrap_or(0.0)
                        / r["event_p99_ns"].as_f64().unwrap_or(1.0)
                )
            } else {
                String::new()
            }
        ));
        if with_baseline {
            out.insert("event_match_p50_ns".into(), r["event_p50_ns"].clone());
            out.insert("event_match_p99_ns".into(), r["event_p99_ns"].clone());
            out.insert(
                "baseline_event_match_p99_ns".into(),
                r["baseline_p99_ns"].clone(),
            );
            out.insert(
                "baseline_event_match_p50_ns".into(),
                r["baseline_p50_ns"].clone(),
            );
            out.insert(
                "token_tree_match_p99_ns".into(),
                r["token_tree_p99_ns"].clone(),
            );
            out.insert(
                "bytes_per_worker_block_grid".into(),
                r["bytes_per_worker_block"].clone(),
            );
        }
        grid.push(r);
    }
    out.insert("event_grid".into(), Value::Array(grid));

    // Ingest from the Mooncake trace through simulated engines.
    let ingest = ingest()?;
    rows.push(format!(
        "ingest: {} block-events in {} events → {:.1} M block-events/s (median of {}; {:.1}–{:.1}); {} entries, {:.1} bytes per (worker, block)",
        ingest["block_events"],
        ingest["events"],
        ingest["ingest_block_events_per_s"].as_f64().unwrap_or(0.0) / 1e6,
        ingest["runs"],
        ingest["ingest_block_events_per_s_min"].as_f64().unwrap_or(0.0) / 1e6,
        ingest["ingest_block_events_per_s_max"].as_f64().unwrap_or(0.0) / 1e6,
        ingest["entries"],
        ingest["bytes_per_worker_block"].as_f64().unwrap_or(0.0)
    ));
    out.insert(
        "ingest_block_events_per_s".into(),
        ingest["ingest_block_events_per_s"].clone(),
    );
    out.insert(
        "bytes_per_worker_block".into(),
        ingest["bytes_per_worker_block"].clone(),
    );
    out.insert("ingest".into(), ingest);

    // String tree.
    let mut strings = Vec::new();
    for &chars in &[4096usize, 16384, 65536] {
        let r = string_point(chars, chars == 4096);
        rows.push(format!(
            "string tree {:>5} KB: p50 {:>7} ns  p99 {:>7} ns  warm insert p50 {:>7} ns  {:.0} bytes/node{}",
            chars / 1024,
            r["p50_ns"],
            r["p99_ns"],
            r["insert_warm_p50_ns"],
            r["bytes_per_node"].as_f64().unwrap_or(0.0),
            if chars == 4096 {
                format!(
                    " | BTreeMap trie p50 {} ns ({:.1}×)",
                    r["baseline_p50_ns"],
                    r["baseline_p50_ns"].as_f64().unwrap_or(0.0)
                        / r["p50_ns"].as_f64().unwrap_or(1.0)
                )
            } else {
                String::new()
            }
        ));
        if chars == 4096 {
            out.insert("string_match_4kb_p50_ns".into(), r["p50_ns"].clone());
            out.insert("string_match_4kb_p99_ns".into(), r["p99_ns"].clone());
            out.insert(
                "string_insert_warm_4kb_p50_ns".into(),
                r["insert_warm_p50_ns"].clone(),
            );
            out.insert(
                "baseline_string_match_4kb_p50_ns".into(),
                r["baseline_p50_ns"].clone(),
            );
            out.insert(
                "string_tree_bytes_per_node".into(),
                r["bytes_per_node"].clone(),
            );
        }
        strings.push(r);
    }
    out.insert("string_tree".into(), Value::Array(strings));

    let ev = eviction();
    rows.push(format!(
        "eviction: {} pairs in {:.1} ms → {:.0} ns per evicted leaf",
        ev["evicted_pairs"],
        ev["evict_ms"].as_f64().unwrap_or(0.0),
        ev["ns_per_evicted_leaf"].as_f64().unwrap_or(0.0)
    ));
    out.insert(
        "eviction_ns_per_leaf".into(),
        ev["ns_per_evicted_leaf"].clone(),
    );
    out.insert("eviction".into(), ev);
    out.insert("elapsed_s".into(), json!(t0.elapsed().as_secs_f64()));
    for r in &rows {
        eprintln!("{r}");
    }
    Ok(Value::Object(out))
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 10_000_000_000, 3).expect("valid histogram bounds")
}

fn event_grid_point(tokens: usize, workers: usize, baseline: bool) -> Value {
    let convs = token_conversations(64, tokens);
    let keys: Vec<Vec<u64>> = convs.iter().map(|c| block_keys(c, BS)).collect();
    let (ix, mut writers) = EventIndex::new(&EventIndexConfig {
        block_size: BS,
        max_workers: workers,
        ttl_ms: None,
        max_entries: None,
    });
    let mut tree = TokenTree::new(BS, usize::MAX);
    let mut naive = NaiveWorkerSets::default();
    for w in 0..workers {
        let c = w % 64;
        let hashes: Vec<u64> = (0..keys[c].len() as u64)
            .map(|i| (c as u64) << 40 | i)
            .collect();
        writers[w / 64]
            .apply_stored(w as u32, 0, None, &hashes, &convs[c], 0)
            .expect("root store");
        tree.insert(0, &convs[c], w as u32);
        if baseline {
            naive.sets.push(keys[c].iter().copied().collect());
        }
    }
    let entries = ix.entries();
    let bytes: usize = writers.iter().map(|w| w.memory_bytes()).sum();
    // Each index in its own loop over the same query sequence: interleaving them would time
    // each one on caches the other just evicted (the naive scan walks ~MBs per query).
    let query_convs: Vec<usize> = {
        let mut rng = StdRng::seed_from_u64(7);
        (0..4_000).map(|_| rng.random_range(0..64)).collect()
    };
    let (mut he, mut ht, mut hb) = (hist(), hist(), hist());
    for &c in &query_convs {
        let t = Instant::now();
        black_box(ix.find_matches(black_box(&keys[c])));
        he.record(t.elapsed().as_nanos() as u64).ok();
    }
    for &c in &query_convs {
        let t = Instant::now();
        black_box(tree.match_prefix(0, black_box(&convs[c])));
        ht.record(t.elapsed().as_nanos() as u64).ok();
    }
    if baseline {
        for &c in &query_convs[..400] {
            let t = Instant::now();
            black_box(naive.find_matches(black_box(&keys[c])));
            hb.record(t.elapsed().as_nanos() as u64).ok();
        }
    }
    // Correctness column: the fast answer equals the brute-force one on a sample.
    let correct = !baseline
        || (0..64).all(|c| {
            let fast = ix.find_matches(&keys[c]);
            let slow = naive.find_matches(&keys[c]);
            (0..workers).all(|w| fast.blocks(w as u32) == slow[w])
        });
    json!({
        "tokens": tokens,
        "workers": workers,
        "event_p50_ns": he.value_at_quantile(0.5),
        "event_p99_ns": he.value_at_quantile(0.99),
        "token_tree_p50_ns": ht.value_at_quantile(0.5),
        "token_tree_p99_ns": ht.value_at_quantile(0.99),
        "baseline_p50_ns": if baseline { json!(hb.value_at_quantile(0.5)) } else { Value::Null },
        "baseline_p99_ns": if baseline { json!(hb.value_at_quantile(0.99)) } else { Value::Null },
        "entries": entries,
        "bytes_per_worker_block": bytes as f64 / entries.max(1) as f64,
        "token_tree_bytes_per_node": tree.memory_bytes() as f64 / tree.node_count() as f64,
        "matches_reference": correct,
    })
}

/// Prompt token ids of a Mooncake record: block `h` of 512 tokens is a deterministic stream
/// of `h`, so equal hash ids give equal prefixes (traces.md §3, ids only).
fn record_tokens(r: &TraceRecord) -> Vec<u32> {
    let mut v = Vec::with_capacity(r.input_length as usize);
    for (i, &h) in r.hash_ids.iter().enumerate() {
        let n = r.block_len(i, MOONCAKE_BLOCK_TOKENS) as usize;
        v.extend(token_stream(1_000_000 + h, n));
    }
    v
}

/// Replays of the ingest section; the median is reported.
const INGEST_RUNS: usize = 5;

fn ingest() -> Result<Value, crate::BoxError> {
    const ENGINES: usize = 8;
    const REQUESTS: usize = 1_200;
    let records = trace::load_mooncake(TRACE, Some(REQUESTS))?;
    let cfg = EngineConfig {
        num_gpu_blocks: 8_192,
        ..EngineConfig::default()
    };
    let mut engines: Vec<EngineCore> = (0..ENGINES)
        .map(|_| EngineCore::new(&cfg))
        .collect::<Result<_, _>>()?;
    // Requests go to engine hash_ids[0] mod 8 (a crude prefix affinity), in trace order,
    // 16 at a time per engine; every engine steps until idle.
    let mut events: Vec<(u32, BlockEvent)> = Vec::new();
    for chunk in records.chunks(ENGINES * 16) {
        for (i, r) in chunk.iter().enumerate() {
            let e = (r.hash_ids[0] as usize + i) % ENGINES;
            if r.input_length as usize + 4 > cfg.num_gpu_blocks * cfg.block_size / 2 {
                continue; // longer than half an engine's KV: skipped
            }
            let id = events.len() as u64 * 1_000_000 + i as u64;
            engines[e].add_request(id, record_tokens(r), 4)?;
        }
        for (e, eng) in engines.iter_mut().enumerate() {
            let mut now = 0.0;
            let mut guard = 0;
            while !eng.is_idle() && guard < 100_000 {
                let out = eng.step(now);
                now += out.duration_ms.max(1.0);
                events.extend(out.events.into_iter().map(|ev| (e as u32, ev)));
                guard += 1;
            }
        }
    }
    let block_events: usize = events
        .iter()
        .map(|(_, e)| match e {
            BlockEvent::Stored { hashes, .. } | BlockEvent::Removed { hashes } => hashes.len(),
            BlockEvent::AllCleared => 1,
        })
        .sum();
    // The replay is short (~0.2 s): it runs INGEST_RUNS times into fresh indexes and the
    // median run is reported (the spread too), so one preempted run does not set the number.
    let mut runs: Vec<(f64, usize, usize, usize)> = Vec::new(); // (secs, entries, bytes, rejected)
    for _ in 0..INGEST_RUNS {
        let (ix, mut writers) = EventIndex::new(&EventIndexConfig {
            block_size: cfg.block_size,
            max_workers: ENGINES,
            ttl_ms: None,
            max_entries: None,
        });
        let w = &mut writers[0];
        let mut rejected = 0usize;
        let t = Instant::now();
        for (worker, ev) in &events {
            match ev {
                BlockEvent::Stored {
                    parent,
                    hashes,
                    token_ids,
                } => {
                    if w.apply_stored(*worker, 0, *parent, hashes, token_ids, 0)
                        .is_err()
                    {
                        rejected += 1;
                    }
                }
                BlockEvent::Removed { hashes } => {
                    w.apply_removed(*worker, hashes).expect("own shard");
                }
                BlockEvent::AllCleared => {
                    w.apply_cleared(*worker).expect("own shard");
                }
            }
        }
        let secs = t.elapsed().as_secs_f64();
        runs.push((secs, ix.entries(), w.memory_bytes(), rejected));
    }
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (secs, entries, memory, rejected) = runs[runs.len() / 2];
    let rate = |s: f64| block_events as f64 / s;
    Ok(json!({
        "requests": records.len(),
        "engines": ENGINES,
        "num_gpu_blocks": cfg.num_gpu_blocks,
        "events": events.len(),
        "block_events": block_events,
        "rejected_stores": rejected,
        "runs": INGEST_RUNS,
        "ingest_s": secs,
        "ingest_block_events_per_s": rate(secs),
        "ingest_block_events_per_s_min": rate(runs[runs.len() - 1].0),
        "ingest_block_events_per_s_max": rate(runs[0].0),
        "entries": entries,
        "memory_bytes": memory,
        "bytes_per_worker_block": memory as f64 / entries.max(1) as f64,
    }))
}

/// Plain trie, one `BTreeMap<char, _>` node per char: the string tree's naive baseline.
#[derive(Default)]
struct BTreeTrie {
    children: BTreeMap<char, BTreeTrie>,
    tenants: Vec<u32>,
}

impl BTreeTrie {
    fn insert(&mut self, text: &str, tenant: u32) {
        let mut n = self;
        for c in text.chars() {
            n = n.children.entry(c).or_default();
            if !n.tenants.contains(&tenant) {
                n.tenants.push(tenant);
            }
        }
    }
    fn match_prefix(&self, text: &str) -> (usize, &[u32]) {
        let mut n = self;
        let mut k = 0;
        for c in text.chars() {
            match n.children.get(&c) {
                Some(x) => {
                    n = x;
                    k += 1;
                }
                None => break,
            }
        }
        (k, &n.tenants)
    }
}

fn string_point(chars: usize, baseline: bool) -> Value {
    let mut tree = StringTree::new();
    let mut trie = BTreeTrie::default();
    let mut queries = Vec::new();
    let mut sent = Vec::new();
    for (conv, tenant) in conversation_corpus(42, 200, chars, 6, 1_000, 100) {
        tree.insert(0, &conv, tenant);
        if baseline {
            trie.insert(&conv, tenant);
        }
        queries.push(format!("{conv}<|user|>and then?"));
        sent.push((conv, tenant));
    }
    let (mut h, mut hb) = (hist(), hist());
    for i in 0..4_000 {
        let q = &queries[i % queries.len()];
        let t = Instant::now();
        black_box(tree.match_prefix(0, black_box(q)));
        h.record(t.elapsed().as_nanos() as u64).ok();
        if baseline && i < 1_000 {
            let t = Instant::now();
            black_box(trie.match_prefix(black_box(q)));
            hb.record(t.elapsed().as_nanos() as u64).ok();
        }
    }
    // A warm insert: a conversation sent again to its worker (every node on the path is
    // there and lists it; the insert refreshes their clocks and its leaf's LRU entry).
    let mut hi = hist();
    for i in 0..4_000 {
        let (conv, tenant) = &sent[(i * 7) % sent.len()];
        let t = Instant::now();
        tree.insert(0, black_box(conv), *tenant);
        hi.record(t.elapsed().as_nanos() as u64).ok();
    }
    let correct = !baseline
        || queries.iter().all(|q| {
            let a = tree.match_prefix(0, q);
            a.matched_chars == trie.match_prefix(q).0
        });
    json!({
        "chars": chars,
        "p50_ns": h.value_at_quantile(0.5),
        "p99_ns": h.value_at_quantile(0.99),
        "insert_warm_p50_ns": hi.value_at_quantile(0.5),
        "insert_warm_p99_ns": hi.value_at_quantile(0.99),
        "baseline_p50_ns": if baseline { json!(hb.value_at_quantile(0.5)) } else { Value::Null },
        "bytes_per_node": tree.memory_bytes() as f64 / tree.node_count() as f64,
        "nodes": tree.node_count(),
        "matches_reference": correct,
    })
}

fn eviction() -> Value {
    let mut state = 9u64;
    let mut tree = StringTree::new();
    let mut seen = HashSet::new();
    let prefix = synthetic_words(&mut state, 200);
    for i in 0..40_000u32 {
        let text = format!("{prefix}{i} {}", synthetic_words(&mut state, 200));
        seen.insert(i);
        tree.insert(0, &text, i % 64);
    }
    let chars = tree.total_chars();
    let before = tree.evicted_pairs();
    let t = Instant::now();
    tree.evict_to(0);
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let n = tree.evicted_pairs() - before;
    json!({
        "leaves_inserted": seen.len(),
        "total_chars_before": chars,
        "evicted_pairs": n,
        "evict_ms": ms,
        "ns_per_evicted_leaf": ms * 1e6 / n.max(1) as f64,
    })
}
