//! `predicted_ttft`, kvroute's own policy: the eligible worker with the lowest predicted
//! time to first token, ms, charged for what the request costs the worker and the fleet:
//!
//! ```text
//! cost_w = wait_w + α · own_w + (wait_w + own_w)² / τ + evict_w + no_fit_w + decode_w + resident_w
//! wait_w = the worker's prefill clock − now: when it will have prefilled what is booked on it
//!          (advanced by each dispatch's predicted prefill, re-anchored at every observed
//!          first token; once first tokens are overdue, the age of the oldest booking still
//!          waiting for one; crate::load::active)
//! own_w  = the worker's learned prefill curve (crate::load::timing) at this request's new
//!          tokens there: prompt − its overlap on w (at least the last token), chunked under
//!          the step token budget, slower while the worker decodes; its scale at the fit's
//!          lower confidence bound (explore · σ below it), so unmeasured workers get tried
//! α      = for a continuation (the worker holding most of the prompt holds more than
//!          affinity_threshold of it beyond the head that requests live there share:
//!          Context::among), miss_prefill_weight + (prefill_weight − miss_prefill_weight) × busy,
//!          busy the share of eligible workers with a prefill booked and not yet past its
//!          first token; miss_prefill_weight for a miss
//! τ      = tail_ms (0: no tail term)
//! evict_w = evict_weight · own_w · (blocks of other sessions' cache its new blocks evict
//!          / its new blocks): the new blocks beyond the worker's never-used memory
//!          (capacity − cached blocks), when both are known
//! no_fit_w = no_fit_ms when its prompt's blocks, cached ones included (they run from the
//!          same free pool) but for those live requests there hold (counted in the usage),
//!          exceed the worker's free KV memory (capacity × (1 − KV usage) − blocks
//!          dispatched since that report), when known
//! decode_w = decode_weight · the worker's unique active blocks above a floor · one block's
//!          prefill ms; the floor is (1 + decode_margin) × the eligible workers' mean for a
//!          continuation, 0 for a miss
//! resident_w = misses only: resident_weight · own_w · cached blocks / capacity, when known
//! ```
//!
//! Read as a rule: a continuation stays with the worker that holds its history (α up to 50: a
//! recomputed block costs fifty times its prefill while the whole fleet is prefilling, since
//! every worker's queue then pays for it; on an idle fleet it costs its own time, α = 1)
//! unless waiting there would put it in the tail — the quadratic term grows with the
//! predicted TTFT itself, so a predicted TTFT of 100 ms costs 10 ms more and one of 2 s costs
//! 4 s more; a miss (a new conversation, or one
//! whose history was evicted everywhere) goes where it starts soonest (α = 1), away from
//! workers whose memory other sessions hold (their next turns would be evicted) and whose
//! decode batch is larger. The threshold is SMG's `cache_threshold` idea (anchors.md §2.2,
//! step 3): affinity only for a real share of the prompt, so a short head every conversation
//! shares (Mooncake's first 512 tokens) does not make each new conversation a continuation of
//! that head's holder; and a long head that concurrent requests share (a system prompt) does
//! not count either, so sessions that share it spread instead of piling on its first holder.

//! The decode term is Dynamo's (anchors.md §3.1: a decode block weighs as a prefill block),
//! in ms (optionally only above a margin over the fleet's mean): without it a stream of
//! short prefills that each drain before the next arrives piles every session on the
//! holder of their shared prefix (its queue is always empty), and that worker's decode
//! batch, TPOT and KV memory pay for it (seed doc 003's herding experiment, test
//! `herding_pure_affinity_piles_the_cost_policies_spread`).
//!
//! Ties (a cold, idle fleet) at random. It runs on whatever index the router has (events
//! where workers publish them, the token tree else, the text tree with chars scaled to
//! tokens: [`super::Router::overlaps`]).

use super::prefix::Overlaps;
use super::wait::pick_min;
use super::{Decision, Request, Snapshot, WorkerLoad};
use crate::config::PolicyKnobs;
use crate::load::timing::Shape;
use rand::Rng;
use std::cell::Cell;

/// predicted_ttft's parameters (the module doc's symbols; defaults and their measurements in
/// [`crate::config::defaults`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftParams {
    /// α of a continuation while every eligible worker is prefilling, the weight of the
    /// request's own prefill (scaled down towards `miss_prefill_weight` as fewer are).
    pub prefill_weight: f64,
    /// α of a miss.
    pub miss_prefill_weight: f64,
    /// Share of the prompt, 0–1, that some eligible worker must hold (strictly more) for the
    /// request to be a continuation.
    pub affinity_threshold: f64,
    /// τ of the tail term, ms; 0 = no tail term.
    pub tail_ms: f64,
    /// Weight of evicted blocks' prefill.
    pub evict_weight: f64,
    /// Charge when the request does not fit, ms.
    pub no_fit_ms: f64,
    /// Weight of the worker's active decode blocks above the margin, each charged what
    /// prefilling one block costs on that worker.
    pub decode_weight: f64,
    /// Decode blocks up to `(1 + margin) ×` the eligible workers' mean are not charged; ≥ −1
    /// (−1: every block).
    pub decode_margin: f64,
    /// Weight of the share of a worker's memory other sessions' cache holds, for a miss.
    pub resident_weight: f64,
    /// `k` of the own prefill's optimistic scale
    /// ([`crate::load::timing::PrefillModel::prefill_ms_optimistic`]).
    pub explore: f64,
}

impl TtftParams {
    /// From the knobs.
    pub fn of(k: &PolicyKnobs) -> Self {
        Self {
            prefill_weight: k.ttft_prefill_weight,
            miss_prefill_weight: k.ttft_miss_prefill_weight,
            affinity_threshold: k.ttft_affinity_threshold,
            tail_ms: k.ttft_tail_ms,
            evict_weight: k.ttft_evict_weight,
            no_fit_ms: k.ttft_no_fit_ms,
            decode_weight: k.ttft_decode_weight,
            decode_margin: k.ttft_decode_margin,
            resident_weight: k.ttft_resident_weight,
            explore: k.ttft_explore,
        }
    }
}

/// Worker `w`'s decode load, 0–1 ([`crate::load::active::decode_load`]).
pub fn decode_load(w: &WorkerLoad) -> f64 {
    crate::load::active::decode_load(w.in_flight, &w.active)
}

/// What one decision knows before it scores a worker: whether the request is a
/// continuation (α, and whether the resident term applies), and the decode blocks a worker
/// may hold uncharged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Context {
    /// The eligible worker holding the most of the prompt holds more than
    /// `affinity_threshold` of it beyond the head that two requests live there share
    /// ([`Context::among`]).
    pub continuation: bool,
    /// `(1 + decode_margin) ×` the eligible workers' mean unique active blocks.
    pub decode_floor: f64,
    /// Share of the eligible workers, 0–1, with a prefill booked that has not had its first
    /// token: how much of the fleet a recomputed history would make wait.
    pub busy: f64,
}

impl Context {
    /// [`Context::among`] all of `snap`'s eligible workers (tests).
    #[cfg(test)]
    pub fn of(p: &TtftParams, snap: &Snapshot<'_>, req: &Request<'_>, ov: &Overlaps) -> Self {
        Self::among(
            p,
            snap,
            req,
            ov,
            &snap.eligible_positions().collect::<Vec<_>>(),
        )
    }

    /// The context of `req` over `snap`'s eligible workers `eligible`, `(worker, position)` as
    /// [`Snapshot::eligible_positions`] gives them (one pass over them).
    ///
    /// The eligible worker `w` holding the most of the prompt, `o_w` tokens (the first of
    /// equals), makes `req` a continuation when `o_w − s_w > threshold × (prompt − s_w)`,
    /// where `s_w` (at most `o_w`) is the head of the prompt that two requests live on `w`
    /// share ([`super::LivePaths`]; 0 without them): a popular prefix (a system prompt) that
    /// concurrent conversations share is cheap to cache on another worker for all of them,
    /// while a conversation's own history is not. So the first turns of sessions that share
    /// a long system prompt are misses and spread (seed doc 003's herding experiment), and a
    /// later turn whose own history follows that prompt stays. `s_w` is asked of that one
    /// worker only, and only when `o_w > threshold × prompt` (else no `s_w` can qualify it):
    /// one lock per decision at most.
    fn among(
        p: &TtftParams,
        snap: &Snapshot<'_>,
        req: &Request<'_>,
        ov: &Overlaps,
        eligible: &[(usize, usize)],
    ) -> Self {
        let prompt = req.prompt_tokens as f64;
        let (mut deepest, mut held, mut blocks, mut busy) = (0, 0u64, 0u64, 0usize);
        for &(w, at) in eligible {
            let t = ov.tokens_at(at, w);
            if t > held {
                (deepest, held) = (w, t);
            }
            let a = &snap.load_at(at).active;
            blocks += a.decode_blocks;
            busy += usize::from(a.prefill_requests > 0);
        }
        let continuation = held as f64 > p.affinity_threshold * prompt && {
            let shared = snap.live.map_or(0, |l| {
                (l.shared_head(deepest, &req.block_keys) * req.block_size) as u64
            });
            let shared = shared.min(held);
            (held - shared) as f64 > p.affinity_threshold * (prompt - shared as f64)
        };
        let n = eligible.len().max(1) as f64;
        Self {
            continuation,
            decode_floor: if continuation {
                (1.0 + p.decode_margin) * blocks as f64 / n
            } else {
                0.0
            },
            busy: busy as f64 / n,
        }
    }
}

/// The terms of `cost_w` (module doc) for one worker, ms.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Terms {
    /// `wait_w`.
    pub wait: f64,
    /// `own_w`.
    pub own: f64,
    /// `evict_w`.
    pub evict: f64,
    /// `no_fit_w`.
    pub no_fit: f64,
    /// `decode_w`.
    pub decode: f64,
    /// `resident_w`.
    pub resident: f64,
}

impl Terms {
    /// `cost_w` (module doc).
    pub fn cost(&self, p: &TtftParams, ctx: &Context) -> f64 {
        let alpha = if ctx.continuation {
            p.miss_prefill_weight + (p.prefill_weight - p.miss_prefill_weight) * ctx.busy
        } else {
            p.miss_prefill_weight
        };
        let ttft = self.wait + self.own;
        let tail = if p.tail_ms > 0.0 {
            ttft * ttft / p.tail_ms
        } else {
            0.0
        };
        self.wait + alpha * self.own + tail + self.evict + self.no_fit + self.decode + self.resident
    }
}

/// [`terms_at`] of worker `w`, its position searched for (tests).
#[cfg(test)]
pub fn terms(
    p: &TtftParams,
    ctx: &Context,
    snap: &Snapshot<'_>,
    req: &Request<'_>,
    ov: &Overlaps,
    w: usize,
    last: &Cell<Option<(usize, Shape)>>,
) -> Terms {
    let at = if snap.ids.is_empty() {
        w
    } else {
        snap.ids
            .binary_search(&w)
            .expect("a worker of the snapshot")
    };
    terms_at(p, ctx, snap, req, ov, (w, at), last)
}

/// The [`Terms`] of worker `w` at `at`, its position in `snap`
/// ([`Snapshot::eligible_positions`]). `last`: the [`Shape`] of the previous worker scored in
/// this decision (reused when this worker would compute as many new tokens in chunks of the
/// same size; `Cell::new(None)` for a worker alone).
fn terms_at(
    p: &TtftParams,
    ctx: &Context,
    snap: &Snapshot<'_>,
    req: &Request<'_>,
    ov: &Overlaps,
    (w, at): (usize, usize),
    last: &Cell<Option<(usize, Shape)>>,
) -> Terms {
    let wl = snap.load_at(at);
    let a = &wl.active;
    let cached = ov.tokens_at(at, w).min(req.prompt_tokens.saturating_sub(1));
    let new = req.prompt_tokens - cached;
    let shape = match last.get() {
        Some((step, s)) if s.tokens == new && step == a.step_tokens => s,
        _ => {
            let s = Shape::of(new, a.step_tokens);
            last.set(Some((a.step_tokens, s)));
            s
        }
    };
    let own = a
        .prefill
        .prefill_ms_optimistic(&shape, decode_load(wl), p.explore);
    let bs = req.block_size as u64;
    let new_blocks = new.div_ceil(bs);
    let mut t = Terms {
        wait: a.prefill_wait_ms,
        own,
        ..Terms::default()
    };
    if let Some(cap) = a.engine.and_then(|e| e.capacity_blocks) {
        if let Some(cached_blocks) = wl.cached_blocks {
            if new_blocks > 0 {
                let empty = cap.saturating_sub(cached_blocks);
                let evicted = new_blocks.saturating_sub(empty);
                t.evict = p.evict_weight * own * evicted as f64 / new_blocks as f64;
            }
            if !ctx.continuation && cap > 0 {
                t.resident = p.resident_weight * own * cached_blocks.min(cap) as f64 / cap as f64;
            }
        }
        if let Some(u) = a.engine.and_then(|e| e.kv_usage) {
            let free = cap as f64 * (1.0 - u) - a.since_poll_tokens as f64 / bs as f64;
            let need = req.prompt_tokens.div_ceil(bs);
            // Cached blocks that live requests here hold are in the usage already (asked
            // only when the prompt would not fit: one lock, rarely).
            if need as f64 > free {
                let live = snap.live.map_or(0, |l| l.live_head(w, &req.block_keys)) as u64;
                if (need - live.min(cached / bs)) as f64 > free {
                    t.no_fit = p.no_fit_ms;
                }
            }
        }
    }
    // A block's worth of prefill at full-chunk efficiency, on this worker's curve (not
    // computed for a worker at or below the floor: most of a large fleet at any instant).
    let excess = a.decode_blocks as f64 - ctx.decode_floor;
    if excess > 0.0 && p.decode_weight > 0.0 {
        let step = a.step_tokens.max(1) as u64;
        let per_block = a.prefill.prefill_ms(step, a.step_tokens, 0.0) * bs as f64 / step as f64;
        t.decode = p.decode_weight * excess * per_block;
    }
    t
}

/// The lowest predicted cost (module doc).
pub fn decide(
    p: &TtftParams,
    snap: &Snapshot<'_>,
    req: &Request<'_>,
    ov: &Overlaps,
    rng: &mut impl Rng,
) -> Decision {
    // Sized up front: the iterator filters, so `collect` would grow from 4 (~1.5 % of a
    // 4,096-worker decision in a profile, perf/runs/2026-12-07-short-key).
    let mut eligible = Vec::with_capacity(snap.eligible.len());
    eligible.extend(snap.eligible_positions());
    let ctx = Context::among(p, snap, req, ov, &eligible);
    let last = Cell::new(None);
    let cost = |i: usize| terms_at(p, &ctx, snap, req, ov, eligible[i], &last).cost(p, &ctx);
    let worker = pick_min(0..eligible.len(), cost, rng).map_or(snap.eligible[0], |i| eligible[i].0);
    Decision::by_cost(worker, ov)
}
