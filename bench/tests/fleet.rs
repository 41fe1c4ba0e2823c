//! `kvroute bench fleet` in its short CI form (issue 16): 512 workers, small prompts, one
//! second of events and decisions; the report's values are checked, not only its keys.

use std::path::Path;

use kvroute_bench::fleet_bench::{
    FleetArgs, IngestVerdict, MOONCAKE_BLOCK_EVENTS_PER_S_PER_WORKER, OUT_KEYS, TURNS,
    ingest_verdict, out_json, run, trace_block_events_per_s_per_worker,
};

const MOONCAKE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/data/traces/mooncake/conversation_trace.jsonl"
);

#[test]
fn short_fleet_reports_real_values() {
    let report = run(&FleetArgs {
        workers: 512,
        tokens: 1024,
        seconds: 1.0,
    })
    .expect("bench fleet runs");
    let out = out_json(&report);
    let obj = out.as_object().expect("an object");
    assert_eq!(obj.len(), OUT_KEYS.len());
    for k in OUT_KEYS {
        assert!(obj[k].is_number(), "{k}: {}", obj[k]);
    }
    assert_eq!(out["workers"], 512);
    assert_eq!(out["tokens"], 1024);
    let n = |k: &str| out[k].as_f64().unwrap();
    let (p50, p99, max) = (
        n("decision_p50_ns"),
        n("decision_p99_ns"),
        n("decision_max_ns"),
    );
    assert!(p50 > 0.0 && p50 <= p99 && p99 <= max, "{p50} {p99} {max}");
    assert!(report["decisions"].as_u64().unwrap() >= 9);
    // The decision from token ids is the whole decision but its parse and tokenize: as many
    // decisions, each shorter than its whole, so its p50 is at most the whole's (and its max
    // at most the whole's max).
    let ids = &report["from_ids"];
    assert_eq!(ids["count"], report["decisions"]);
    let (ids_p50, ids_max) = (
        ids["p50_ns"].as_f64().unwrap(),
        ids["max_ns"].as_f64().unwrap(),
    );
    assert!(ids_p50 > 0.0 && ids_p50 <= p50 && ids_max <= max, "{ids}");
    // The index lookup alone is timed after each conversation, once for each of its timed
    // turns: none lost, none twice.
    assert_eq!(report["index_lookup"]["count"], report["decisions"]);
    // By turn: turns 2..=TURNS, once per conversation: as many of each, and all of them.
    let by_turn = report["by_turn"].as_array().expect("an array");
    assert_eq!(by_turn.len(), TURNS - 1);
    let counts: Vec<u64> = by_turn
        .iter()
        .map(|t| t["count"].as_u64().unwrap())
        .collect();
    assert!(
        counts.iter().all(|&c| c == counts[0] && c >= 1),
        "{counts:?}"
    );
    assert_eq!(
        counts.iter().sum::<u64>(),
        report["decisions"].as_u64().unwrap()
    );
    // What the gateway does after the worker's response head (the turn's chat-prefix
    // inserts, the record) is timed as its own stage, outside the whole: every turn has one.
    let after_head = report["stages_p50_ns"]["after_head"].as_u64();
    assert!(
        after_head.is_some_and(|ns| ns > 0),
        "{}",
        report["stages_p50_ns"]
    );
    // Every decision matched the whole fleet on the shared system prompt and its group on
    // the document: the event index answered, with all 512 workers.
    assert!(
        report["mean_matched_workers"].as_f64().unwrap() >= 512.0,
        "{}",
        report["mean_matched_workers"]
    );
    // Entries: each worker holds its document (~70 blocks at 1k tokens) and 4 tails of 16.
    let entries = report["entries"].as_f64().unwrap();
    assert!(entries >= 512.0 * 100.0, "{entries}");
    // Bytes per (worker, block): a 16-byte slab record at least, and far below a dense
    // 512-worker row (72 bytes a key) per pair.
    let b = n("bytes_per_worker_block");
    assert!((16.0..72.0).contains(&b), "{b}");
    // Ingest: never above the offered rate; at it when the writer's capacity (events per
    // second of applying) has room, else the writer was busy all along and says so
    // (`keeps_up` false: a debug build of the index crates may not keep up).
    let offered = report["offered_block_events_per_s"].as_f64().unwrap();
    let achieved = report["achieved_block_events_per_s"].as_f64().unwrap();
    let per_core = n("ingest_block_events_per_s");
    assert!(
        achieved <= 1.02 * offered,
        "offered {offered}, achieved {achieved}"
    );
    assert!(per_core >= achieved, "{per_core} {achieved}");
    if per_core >= 1.3 * offered {
        assert!(
            achieved >= 0.9 * offered,
            "offered {offered}, achieved {achieved}, capacity {per_core}"
        );
        assert_eq!(report["keeps_up"], true);
    } else if report["keeps_up"] == false {
        assert!(report["ingest_busy_share"].as_f64().unwrap() > 0.8);
    }
    assert_eq!(
        report["ingest"],
        ingest_verdict(offered, achieved, per_core).label(),
        "{report}"
    );
}

/// The three verdicts on rates seen at 4,096 workers (block events per second): a pass that
/// kept up, one whose ingest thread lost its core to the host (per core still above the
/// offered rate: perf/runs/2026-12-07-fleet-table-3), and a writer slower than the offer.
#[test]
fn ingest_verdict_tells_a_slow_writer_from_a_thread_without_its_core() {
    use IngestVerdict::*;
    assert_eq!(ingest_verdict(1.71e6, 1.69e6, 2.36e6), KeepsUp);
    assert_eq!(ingest_verdict(1.71e6, 1.54e6, 2.05e6), ShortOfItsCore);
    assert_eq!(ingest_verdict(1.71e6, 1.40e6, 1.45e6), TooSlow);
    // The edges: exactly 95 % of the offer keeps up; a core exactly at the offer is short
    // of its core, not too slow.
    assert_eq!(ingest_verdict(1.0e6, 0.95e6, 0.96e6), KeepsUp);
    assert_eq!(ingest_verdict(1.0e6, 0.94e6, 1.0e6), ShortOfItsCore);
    assert_eq!(ingest_verdict(1.0e6, 0.94e6, 0.99e6), TooSlow);
    // The report's words.
    assert_eq!(
        [KeepsUp, ShortOfItsCore, TooSlow].map(IngestVerdict::label),
        ["keeps up", "short of its core", "too slow"]
    );
}

/// The fallback constant is the trace's own computation, rounded (skipped without the trace).
#[test]
fn fallback_rate_is_the_trace_computation() {
    if !Path::new(MOONCAKE).exists() {
        eprintln!("skipping: Mooncake trace not found at {MOONCAKE}");
        return;
    }
    let r = trace_block_events_per_s_per_worker(MOONCAKE).expect("the trace reads");
    assert!(
        (r - MOONCAKE_BLOCK_EVENTS_PER_S_PER_WORKER).abs() < 0.05,
        "{r} vs {MOONCAKE_BLOCK_EVENTS_PER_S_PER_WORKER}"
    );
}
