//! Observability and administration: the `/metrics` text ([`metrics_text`]), the admin
//! API's cache view ([`cache_view`]), and the constant-time key comparison both API-key
//! checks use.

use crate::state::Shared;
use kvroute_core::events::StreamStats;
use kvroute_core::health::BreakerState;
use kvroute_core::metrics::{Breaker, Format, StreamSample, WorkerState};

/// The whole `/metrics` text in `format`: every counter and histogram, each present worker's
/// gauges (in flight, foreign, healthy, breaker state, draining), and the KV-event streams
/// (`kvroute_kv_events_*{worker,rank}`, `kvroute_kv_indexed_blocks`).
pub fn metrics_text(shared: &Shared, format: Format) -> String {
    let now = shared.now_ms();
    for w in shared.workers.iter() {
        let breaker = match w.breaker_state(now) {
            BreakerState::Closed => Breaker::Closed,
            BreakerState::HalfOpen => Breaker::HalfOpen,
            BreakerState::Open => Breaker::Open,
        };
        shared.metrics.set_worker_state(
            w.id,
            WorkerState {
                healthy: w.is_healthy(),
                breaker,
                draining: w.is_draining(),
            },
        );
    }
    if let Some(ix) = &shared.events {
        let ix = crate::zmq::lock(ix);
        let streams = ix
            .stats()
            .into_iter()
            .map(|(stream, stats)| StreamSample {
                stream,
                stats,
                indexed_blocks: ix.stream_keys(stream),
            })
            .collect();
        drop(ix);
        shared.metrics.set_event_streams(streams);
    }
    shared.metrics.encode_as(&shared.workers, format)
}

/// The cache view of worker `id`: `(status, JSON body)` — `{"worker": id, "blocks": N,
/// "streams": [...]}`; 404 for an unknown worker id, 503 when no event index is configured.
pub fn cache_view(shared: &Shared, id: &str) -> (u16, Vec<u8>) {
    let Some(worker) = id
        .parse::<u32>()
        .ok()
        .filter(|&w| shared.workers.get(w as usize).is_some())
    else {
        return (404, crate::error::error_body(404, "unknown worker"));
    };
    let Some(ix) = &shared.events else {
        return (503, crate::error::error_body(503, "no KV event index configured"));
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
    (200, body.to_string().into_bytes())
}

/// One event stream's counters as JSON (the cache view and `GET /workers`).
pub fn stream_json(rank: u32, st: &StreamStats, keys: usize) -> serde_json::Value {
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

/// `a == b` in time that depends on their lengths only, not on where they differ (an API
/// key compared byte by byte would leak its prefix through timing).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // `black_box` keeps the compiler from turning the fold into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"sk-abc", b"sk-abc"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-abd"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-ab"));
        assert!(constant_time_eq(b"", b""));
    }
}
