//! Admin and observability endpoints of the KV-event index (issue 5 item 7):
//! `GET /admin/cache-view/{worker}` → `{"worker": id, "blocks": N, "streams": [...]}` and the
//! per-stream `kvroute_kv_events_*` lines appended to `/metrics`.

use crate::shard::Shared;
use kvroute_core::events::StreamStats;
use std::fmt::Write as _;

/// Answers `GET /admin/cache-view/{worker}`: `(status, JSON body)`, or `None` when `path` is
/// not an admin path. 404 for an unknown worker id, 503 when no event index is configured.
pub fn answer(shared: &Shared, method: &str, path: &str) -> Option<(u16, Vec<u8>)> {
    let id = path.strip_prefix("/admin/cache-view/")?;
    if method != "GET" {
        return Some((405, br#"{"error":"method not allowed"}"#.to_vec()));
    }
    let Some(worker) = id
        .parse::<u32>()
        .ok()
        .filter(|&w| (w as usize) < shared.workers.len())
    else {
        return Some((404, br#"{"error":"unknown worker"}"#.to_vec()));
    };
    let Some(ix) = &shared.events else {
        return Some((503, br#"{"error":"no KV event index configured"}"#.to_vec()));
    };
    let ix = crate::zmq::lock(ix);
    let streams: Vec<serde_json::Value> = ix
        .stats()
        .into_iter()
        .filter(|(s, _)| s.worker == worker)
        .map(|(s, st)| stream_json(s.rank, &st, ix.stream_keys(s)))
        .collect();
    let body = serde_json::json!({
        "worker": worker,
        "blocks": ix.worker_blocks(worker),
        "streams": streams,
    });
    Some((200, body.to_string().into_bytes()))
}

fn stream_json(rank: u32, st: &StreamStats, keys: usize) -> serde_json::Value {
    serde_json::json!({
        "rank": rank, "keys": keys, "batches": st.batches, "events": st.events,
        "gaps": st.gaps, "replays": st.replays, "unrecoverable_gaps": st.unrecoverable_gaps,
        "restarts": st.restarts, "duplicates": st.duplicates, "decode_errors": st.decode_errors,
        "orphans": st.orphans, "orphan_replays": st.orphan_replays,
        "length_mismatches": st.length_mismatches,
        "size_mismatches": st.size_mismatches,
        "declared_size_mismatches": st.declared_size_mismatches,
        "last_seq": st.last_seq, "learned_block_size": st.learned_block_size,
    })
}

/// Prometheus text for every event stream: `kvroute_kv_events_{batches,events,gaps,replays,
/// unrecoverable_gaps,restarts,duplicates,decode_errors,orphans,orphan_replays,
/// size_mismatches}_total`,
/// `kvroute_kv_events_last_seq` and `kvroute_kv_indexed_blocks`, labels `worker`, `rank`.
/// Inserted before the closing `# EOF` of `text`; nothing without an event index.
pub fn append_metrics(shared: &Shared, text: &mut String) {
    let Some(ix) = &shared.events else {
        return;
    };
    let ix = crate::zmq::lock(ix);
    let stats = ix.stats();
    let mut out = String::new();
    type Get = fn(&StreamStats) -> u64;
    let counters: [(&str, Get); 11] = [
        ("batches", |s| s.batches),
        ("events", |s| s.events),
        ("gaps", |s| s.gaps),
        ("replays", |s| s.replays),
        ("unrecoverable_gaps", |s| s.unrecoverable_gaps),
        ("restarts", |s| s.restarts),
        ("duplicates", |s| s.duplicates),
        ("decode_errors", |s| s.decode_errors),
        ("orphans", |s| s.orphans),
        ("orphan_replays", |s| s.orphan_replays),
        ("size_mismatches", |s| {
            s.size_mismatches + s.length_mismatches
        }),
    ];
    for (name, get) in counters {
        let _ = writeln!(out, "# TYPE kvroute_kv_events_{name} counter");
        for (s, st) in &stats {
            let _ = writeln!(
                out,
                "kvroute_kv_events_{name}_total{{worker=\"{}\",rank=\"{}\"}} {}",
                s.worker,
                s.rank,
                get(st)
            );
        }
    }
    let _ = writeln!(out, "# TYPE kvroute_kv_events_last_seq gauge");
    for (s, st) in &stats {
        if let Some(seq) = st.last_seq {
            let _ = writeln!(
                out,
                "kvroute_kv_events_last_seq{{worker=\"{}\",rank=\"{}\"}} {seq}",
                s.worker, s.rank
            );
        }
    }
    let _ = writeln!(out, "# TYPE kvroute_kv_indexed_blocks gauge");
    for (s, _) in &stats {
        let _ = writeln!(
            out,
            "kvroute_kv_indexed_blocks{{worker=\"{}\",rank=\"{}\"}} {}",
            s.worker,
            s.rank,
            ix.stream_keys(*s)
        );
    }
    match text.rfind("# EOF") {
        Some(i) => text.insert_str(i, &out),
        None => text.push_str(&out),
    }
}
