//! The expected-wait scorer of SMG's `least_load` (anchors.md §2.5), which also resolves
//! cache_aware's misses, spills and ties, and the tie-breaking minimum every selector uses.

use super::Snapshot;
use rand::Rng;

/// Queue drain rate assumed for every worker, tokens/s. Source: SMG's fallback throughput,
/// 2,000 tok/s (anchors.md §2.5).
pub const THROUGHPUT_TOKENS_PER_S: f64 = 2_000.0;
/// Tokens assumed per queued request when the engine reports counts only. Source: SMG's p̄,
/// 1,024 (anchors.md §2.5).
pub const MEAN_REQUEST_TOKENS: f64 = 1_024.0;
/// Weight of the KV-occupancy barrier `k / (1 − k)`, s. Source: SMG's λ, 0.15 s (anchors.md
/// §2.5).
pub const OCCUPANCY_WEIGHT_S: f64 = 0.15;
/// KV usage is capped here before the barrier, so a full engine scores high, not infinite.
/// kvroute's choice (0.99 → barrier 99 × λ = 14.85 s).
pub const MAX_USAGE: f64 = 0.99;

/// Expected wait of eligible worker `w`, s (lower is better), SMG's scorer:
/// `(queued_tokens + tokens dispatched since the last poll) / throughput + λ · k/(1−k)`,
/// k = KV usage, queued tokens = the engine's waiting requests × p̄ when it reports counts
/// only (vLLM). Degradation: a worker without a report while others have one scores its
/// local in-flight × p̄ / throughput; when `fleet_dark` (no eligible worker has a report) the
/// score is the shortest queue on requests in flight (+ foreign). Worked example E9.
pub fn expected_wait_s(snap: &Snapshot<'_>, w: usize, fleet_dark: bool) -> f64 {
    let wl = snap.load(w);
    if fleet_dark {
        return wl.requests as f64;
    }
    match wl.active.engine {
        Some(r) => {
            let queued = r
                .waiting_tokens
                .map_or(r.waiting as f64 * MEAN_REQUEST_TOKENS, |t| t as f64);
            let k = r.kv_usage.unwrap_or(0.0).clamp(0.0, MAX_USAGE);
            (queued + wl.active.since_poll_tokens as f64) / THROUGHPUT_TOKENS_PER_S
                + OCCUPANCY_WEIGHT_S * k / (1.0 - k)
        }
        None => wl.in_flight as f64 * MEAN_REQUEST_TOKENS / THROUGHPUT_TOKENS_PER_S,
    }
}

/// The candidate with the lowest `score`, ties broken uniformly at random — never by list
/// order (bug-cases.md B1). `None` when `candidates` is empty. Scores are compared exactly;
/// a NaN score counts as +∞ (it never wins over a number).
pub fn pick_min(
    candidates: impl IntoIterator<Item = usize>,
    score: impl Fn(usize) -> f64,
    rng: &mut impl Rng,
) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    let mut ties = 0u32;
    for w in candidates {
        let s = score(w);
        let s = if s.is_nan() { f64::INFINITY } else { s };
        match best {
            Some((_, b)) if s > b => {}
            Some((_, b)) if s == b => {
                // Reservoir sampling over the tied set: uniform without collecting it.
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((w, s));
                }
            }
            _ => {
                best = Some((w, s));
                ties = 1;
            }
        }
    }
    best.map(|(w, _)| w)
}

/// The least-loaded of `candidates` (worker ids into `loads`), ties broken uniformly at
/// random (B1). `None` when `candidates` is empty.
pub fn least_loaded(
    loads: &[usize],
    candidates: impl IntoIterator<Item = usize>,
    rng: &mut impl Rng,
) -> Option<usize> {
    pick_min(candidates, |w| loads[w] as f64, rng)
}

/// Samples one of `candidates` with probability ∝ `exp(−(c − c_min) / ((c_max − c_min) · t))`
/// over their costs `c` (Dynamo's selection, anchors.md §3.1; lower cost more likely); all
/// costs equal → uniform. `t` > 0. `None` when `candidates` is empty.
pub fn softmax_min(candidates: &[(usize, f64)], t: f64, rng: &mut impl Rng) -> Option<usize> {
    let (lo, hi) = candidates
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| {
            (lo.min(c.1), hi.max(c.1))
        });
    if candidates.is_empty() {
        return None;
    }
    let span = hi - lo;
    let weight = |c: f64| {
        if span > 0.0 {
            (-(c - lo) / (span * t)).exp()
        } else {
            1.0
        }
    };
    let total: f64 = candidates.iter().map(|c| weight(c.1)).sum();
    let mut x = rng.random::<f64>() * total;
    for c in candidates {
        x -= weight(c.1);
        if x <= 0.0 {
            return Some(c.0);
        }
    }
    candidates.last().map(|c| c.0)
}
