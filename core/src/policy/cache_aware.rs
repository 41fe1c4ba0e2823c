//! `cache_aware` and the `smg_cache_aware` preset: SMG's decision flow (anchors.md §2.2).
//!
//! 1. **Eligible set**: the snapshot's.
//! 2. **KV pressure**: when the largest engine KV usage among eligible workers that reported
//!    one exceeds `overload_token_usage_threshold`, or the spread (max − min) exceeds
//!    `balance_token_usage_threshold`, affinity is skipped: the lowest expected wait
//!    ([`Reason::KvPressure`]). Both default to 1.0 = off.
//! 3. **Candidates**: on the event index, eligible workers holding more than
//!    `cache_threshold` of the request (kvroute) or at least its first block (SMG: the
//!    threshold does not apply there); on a tree or the hash index, when the deepest match's
//!    share is strictly above `cache_threshold`, the eligible holders of that depth (SMG
//!    measures the depth over all holders, kvroute over eligible ones, so a dead deepest
//!    holder does not turn a hit into a miss). None → miss.
//! 4. **Rank**: score = overlap / (1 + `overlap_decay` · x), x = the candidate's booked
//!    prefill blocks beyond the least booked eligible worker's, per request block; keep the
//!    top group, or with `selection_temperature` T > 0 draw one from a softmax over the
//!    min-max-normalised scores.
//! 5. **Spill gate** ([`SpillGate`]): a candidate is hot when its requests exceed both
//!    `rel × mean` and `mean + abs` (mean over eligible workers, B5). SMG: the lowest expected
//!    wait non-hot candidate of the top group; all hot → the lowest-expected-wait non-hot
//!    eligible worker, else the lowest expected wait ([`Reason::Spill`]). kvroute drops the
//!    hot candidates *before* keeping the top group (a cool holder of a slightly shorter
//!    prefix beats spilling), and spills to B11's target ([`SPILL_NEAR_LOAD`]).
//! 6. **Miss** → lowest expected wait ([`Reason::CacheMiss`]); ties everywhere by expected
//!    wait, then at random ([`super::expected_wait_s`]: with no engine reports, requests).
//!
//! Recording (step 7) is [`super::Router::record`]'s.

use super::prefix::{Overlaps, Source, Unit};
use super::wait::{pick_min, softmax_min};
use super::{Decision, Reason, Request, Snapshot};
use crate::config::Config;
use rand::Rng;

/// The spill gate of SMG (anchors.md §2.2 step 5): worker `w` is hot when
/// `requests[w] > rel × mean` **and** `requests[w] > mean + abs`, mean over eligible workers.
#[derive(Debug, Clone, Copy)]
pub struct SpillGate {
    /// Load above which a worker is hot, requests (`max(rel × mean, mean + abs)`).
    pub threshold: f64,
}

impl SpillGate {
    /// Gate for the loads of `eligible` (worker ids into `loads`): the mean is over eligible
    /// workers only, so a dead or draining worker at load 0 does not make the live ones look
    /// hot (bug-cases.md B5).
    pub fn new(loads: &[usize], eligible: &[usize], rel: f64, abs: usize) -> Self {
        Self::of_mean(
            mean(eligible.iter().map(|&w| loads[w]), eligible.len()),
            rel,
            abs,
        )
    }

    /// The gate of a snapshot's eligible workers.
    pub fn of_snapshot(snap: &Snapshot<'_>, rel: f64, abs: usize) -> Self {
        let loads = snap.eligible.iter().map(|&w| snap.requests(w));
        Self::of_mean(mean(loads, snap.eligible.len()), rel, abs)
    }

    fn of_mean(mean: f64, rel: f64, abs: usize) -> Self {
        Self {
            threshold: (rel * mean).max(mean + abs as f64),
        }
    }

    /// True when a worker with `load` in flight is hot.
    pub fn is_hot(&self, load: usize) -> bool {
        load as f64 > self.threshold
    }
}

fn mean(loads: impl Iterator<Item = usize>, n: usize) -> f64 {
    if n == 0 {
        0.0
    } else {
        loads.sum::<usize>() as f64 / n as f64
    }
}

/// A spill goes to a worker at most this many requests above the least loaded, preferring
/// the most leading blocks held (bug-cases.md B11: "load ≤ min + margin, preferring the
/// longest prefix"). Measured with `kvroute simulate` over 40 workloads: margin 0 / 1 / 2 / 4
/// gave +0.09 / +0.08 / +0.05 / +0.04 points of hit rate against spilling to the least
/// loaded; at 3,072 blocks +0.08 / +0.16 / +0.18 / +0.05, the worst workload 53.9 / 54.3 /
/// 54.6 / 54.6 % against 50.9; at twice the arrival rate 0.00 / +0.01 / −0.02 / −0.12.
pub const SPILL_NEAR_LOAD: usize = 1;

/// cache_aware's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareParams {
    /// Match share strictly above which holders are candidates, 0–1.
    pub threshold: f64,
    /// Spill gate, relative part.
    pub rel: f64,
    /// Spill gate, absolute part, requests.
    pub abs: usize,
    /// Overlap decay d.
    pub decay: f64,
    /// Selection temperature T.
    pub temperature: f64,
    /// KV-pressure trigger on the largest usage.
    pub overload_usage: f64,
    /// KV-pressure trigger on the usage spread.
    pub balance_usage: f64,
    /// SMG's own steps 3 and 5 (preset) instead of kvroute's.
    pub smg: bool,
}

impl CacheAwareParams {
    /// kvroute's cache_aware with `cfg`'s thresholds and knobs.
    pub fn of(cfg: &Config) -> Self {
        Self {
            threshold: cfg.cache_threshold,
            rel: cfg.balance_rel_threshold,
            abs: cfg.balance_abs_threshold,
            decay: cfg.knobs.overlap_decay,
            temperature: cfg.knobs.selection_temperature,
            overload_usage: cfg.knobs.overload_token_usage_threshold,
            balance_usage: cfg.knobs.balance_token_usage_threshold,
            smg: false,
        }
    }

    /// SMG v1.11's CLI defaults exactly (anchors.md §2.3): threshold 0.3, gate 1.5 / 64,
    /// decay 0, temperature 0, pressure triggers off.
    pub fn smg() -> Self {
        Self {
            threshold: 0.3,
            rel: 1.5,
            abs: 64,
            decay: 0.0,
            temperature: 0.0,
            overload_usage: 1.0,
            balance_usage: 1.0,
            smg: true,
        }
    }
}

/// SMG's flow (module doc) over `ov`.
pub fn decide(
    p: &CacheAwareParams,
    snap: &Snapshot<'_>,
    req: &Request<'_>,
    ov: &Overlaps,
    rng: &mut impl Rng,
) -> Decision {
    let miss = |rng: &mut _| Decision {
        worker: snap.least_wait(rng),
        reason: Reason::CacheMiss,
    };
    // 2. KV pressure.
    let usages = snap
        .eligible
        .iter()
        .filter_map(|&w| snap.load(w).active.engine.and_then(|e| e.kv_usage));
    let (lo, hi) = usages.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), u| {
        (lo.min(u), hi.max(u))
    });
    if hi.is_finite() && (hi > p.overload_usage || hi - lo > p.balance_usage) {
        return Decision {
            worker: snap.least_wait(rng),
            reason: Reason::KvPressure,
        };
    }
    // 3. Candidates.
    let eligible = snap.eligible.iter().copied();
    let mut cands: Vec<usize> = match ov.source {
        Source::None => return miss(rng),
        Source::Events if p.smg => eligible.filter(|&w| ov.of(w) >= req.block_size).collect(),
        Source::Events => eligible.filter(|&w| ov.ratio(w) > p.threshold).collect(),
        _ => {
            let deepest = if p.smg {
                ov.matched.iter().copied().max().unwrap_or(0)
            } else {
                ov.max_among(eligible.clone())
            };
            if deepest == 0 || deepest as f64 / ov.len as f64 <= p.threshold {
                return miss(rng);
            }
            eligible.filter(|&w| ov.of(w) == deepest).collect()
        }
    };
    if cands.is_empty() {
        return miss(rng);
    }
    let gate = SpillGate::of_snapshot(snap, p.rel, p.abs);
    let hot = |w: usize| gate.is_hot(snap.requests(w));
    let all_hot = cands.iter().all(|&w| hot(w));
    if !p.smg {
        cands.retain(|&w| !hot(w));
    }
    // 4. Rank.
    let score = |w: usize| ov.of(w) as f64 / (1.0 + p.decay * excess(snap, req, w));
    if !cands.is_empty() {
        if p.temperature > 0.0 {
            // Lower cost = higher score: costs are the negated scores.
            let costs: Vec<(usize, f64)> = cands.iter().map(|&w| (w, -score(w))).collect();
            cands = softmax_min(&costs, p.temperature, rng)
                .into_iter()
                .collect();
        } else {
            let top = cands
                .iter()
                .map(|&w| score(w))
                .fold(f64::NEG_INFINITY, f64::max);
            cands.retain(|&w| score(w) == top);
        }
    }
    // 5. Spill gate.
    let cool = cands.iter().copied().filter(|&w| !hot(w));
    if let Some(worker) = snap.least_wait_among(cool, rng) {
        return Decision {
            worker,
            reason: hit(ov, worker),
        };
    }
    debug_assert!(p.smg || all_hot);
    let worker = if p.smg {
        let cool_eligible = snap.eligible.iter().copied().filter(|&w| !hot(w));
        snap.least_wait_among(cool_eligible, rng)
            .unwrap_or_else(|| snap.least_wait(rng))
    } else {
        spill_target(snap, |w| ov.of(w), rng)
    };
    Decision {
        worker,
        reason: Reason::Spill,
    }
}

/// The hit reason for `w`'s overlap in `ov`'s unit.
fn hit(ov: &Overlaps, w: usize) -> Reason {
    match ov.unit {
        Unit::Tokens => Reason::TokenHit {
            matched_tokens: ov.of(w),
            ratio: ov.ratio(w),
        },
        Unit::Chars => Reason::CacheHit {
            matched_chars: ov.of(w),
            ratio: ov.ratio(w),
        },
    }
}

/// Worker `w`'s booked prefill blocks beyond the least booked eligible worker's, per request
/// block (step 4's x).
fn excess(snap: &Snapshot<'_>, req: &Request<'_>, w: usize) -> f64 {
    let booked = |w: usize| snap.load(w).active.prefill_tokens;
    let min = snap.eligible.iter().map(|&w| booked(w)).min().unwrap_or(0);
    (booked(w) - min.min(booked(w))) as f64 / req.block_size as f64 / req.blocks().max(1.0)
}

/// Where a kvroute spill goes (bug-cases.md B11): among eligible workers at most
/// [`SPILL_NEAR_LOAD`] above the least eligible load, the one holding the longest prefix of
/// the request (`depth(worker)`, in any unit), ties by load, then at random. Not a hot worker
/// while the spill margin is at least [`SPILL_NEAR_LOAD`]: hot needs a load above the mean +
/// the margin, and the mean is at least the least load. `snap.eligible` must not be empty.
pub(super) fn spill_target(
    snap: &Snapshot<'_>,
    depth: impl Fn(usize) -> usize,
    rng: &mut impl Rng,
) -> usize {
    let min = snap
        .eligible
        .iter()
        .map(|&w| snap.requests(w))
        .min()
        .unwrap_or(0);
    let near = |w: &usize| snap.requests(*w) <= min + SPILL_NEAR_LOAD;
    let best = snap.eligible.iter().copied().filter(near).map(&depth).max();
    pick_min(
        snap.eligible
            .iter()
            .copied()
            .filter(|w| near(w) && Some(depth(*w)) == best),
        |w| snap.requests(w) as f64,
        rng,
    )
    .unwrap_or(snap.eligible[0])
}
