//! `predicted_ttft`, kvroute's own policy: the eligible worker with the lowest predicted
//! time to first token, ms, charged for what the request costs the worker:
//!
//! ```text
//! cost_w = wait_w + α · own_w + evict_w + no_fit_w + decode_w
//! wait_w = the worker's prefill clock − now: when it will have prefilled what is booked on it
//!          (advanced by each dispatch's predicted prefill, re-anchored at every observed
//!          first token; once first tokens are overdue, the age of the oldest booking still
//!          waiting for one; crate::load::active)
//! own_w  = the worker's learned prefill curve (crate::load::timing) at this request's new
//!          tokens there: prompt − its overlap on w (at least the last token), chunked under
//!          the step token budget, slower while the worker decodes
//! evict_w = evict_weight · own_w · (blocks of other sessions' cache its new blocks evict
//!          / its new blocks): the new blocks beyond the worker's never-used memory
//!          (capacity − cached blocks), when both are known
//! no_fit_w = no_fit_ms when its new blocks exceed the worker's free KV memory
//!          (capacity × (1 − KV usage) − blocks dispatched since that report), when known
//! decode_w = decode_weight · the worker's unique active blocks · one block's prefill ms
//! ```
//!
//! The decode term is Dynamo's (anchors.md §3.1: a decode block weighs as a prefill block),
//! in ms: without it a stream of short prefills that each drain before the next arrives
//! piles every session on the holder of their shared prefix (its queue is always empty),
//! and that worker's decode batch, TPOT and KV memory pay for it (seed doc 003's herding
//! experiment, test `herding_pure_affinity_piles_the_cost_policies_spread`).
//!
//! α > 1 charges a miss for the capacity it burns: a long uncached prefill delays every
//! request queued after it on that worker, so a worker that would recompute a prefix must be
//! idle enough to be worth it. Ties (a cold, idle fleet) at random.
//!
//! It runs on whatever index the router has (events where workers publish them, the token
//! tree else, the text tree with chars scaled to tokens: [`super::Router::overlaps`]).

use super::prefix::Overlaps;
use super::wait::pick_min;
use super::{Decision, Request, Snapshot, WorkerLoad};
use crate::config::PolicyKnobs;
use crate::load::timing::Shape;
use rand::Rng;
use std::cell::Cell;

/// predicted_ttft's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftParams {
    /// α, the weight of the request's own prefill.
    pub prefill_weight: f64,
    /// Weight of evicted blocks' prefill.
    pub evict_weight: f64,
    /// Charge when the request does not fit, ms.
    pub no_fit_ms: f64,
    /// Weight of the worker's active decode blocks, each charged what prefilling one block
    /// costs on that worker.
    pub decode_weight: f64,
}

impl TtftParams {
    /// From the knobs.
    pub fn of(k: &PolicyKnobs) -> Self {
        Self {
            prefill_weight: k.ttft_prefill_weight,
            evict_weight: k.ttft_evict_weight,
            no_fit_ms: k.ttft_no_fit_ms,
            decode_weight: k.ttft_decode_weight,
        }
    }
}

/// Worker `w`'s decode load, 0–1 ([`crate::load::active::decode_load`]).
pub fn decode_load(w: &WorkerLoad) -> f64 {
    crate::load::active::decode_load(w.in_flight, &w.active)
}

/// The terms of `cost_w` (module doc) for worker `w`: `(wait, own, evict + decode, no_fit)`,
/// ms. `last`: the [`Shape`] of the previous worker scored in this decision (reused when this
/// worker would compute as many new tokens in chunks of the same size; `Cell::new(None)`
/// for a worker alone).
pub fn terms(
    p: &TtftParams,
    snap: &Snapshot<'_>,
    req: &Request<'_>,
    ov: &Overlaps,
    w: usize,
    last: &Cell<Option<(usize, Shape)>>,
) -> (f64, f64, f64, f64) {
    let wl = snap.load(w);
    let a = &wl.active;
    let cached = ov.tokens(w).min(req.prompt_tokens.saturating_sub(1));
    let new = req.prompt_tokens - cached;
    let shape = match last.get() {
        Some((step, s)) if s.tokens == new && step == a.step_tokens => s,
        _ => {
            let s = Shape::of(new, a.step_tokens);
            last.set(Some((a.step_tokens, s)));
            s
        }
    };
    let own = a.prefill.prefill_ms_shaped(&shape, decode_load(wl));
    let bs = req.block_size as u64;
    let new_blocks = new.div_ceil(bs);
    let (mut evict, mut no_fit) = (0.0, 0.0);
    if let Some(cap) = a.engine.and_then(|e| e.capacity_blocks) {
        if let (Some(cached_blocks), true) = (wl.cached_blocks, new_blocks > 0) {
            let empty = cap.saturating_sub(cached_blocks);
            let evicted = new_blocks.saturating_sub(empty);
            evict = p.evict_weight * own * evicted as f64 / new_blocks as f64;
        }
        if let Some(u) = a.engine.and_then(|e| e.kv_usage) {
            let free = cap as f64 * (1.0 - u) - a.since_poll_tokens as f64 / bs as f64;
            if new_blocks as f64 > free {
                no_fit = p.no_fit_ms;
            }
        }
    }
    // A block's worth of prefill at full-chunk efficiency, on this worker's curve (not
    // computed for a worker with nothing decoding: most of a large fleet at any instant).
    let decode = if a.decode_blocks == 0 || p.decode_weight == 0.0 {
        0.0
    } else {
        let step = a.step_tokens.max(1) as u64;
        let per_block = a.prefill.prefill_ms(step, a.step_tokens, 0.0) * bs as f64 / step as f64;
        p.decode_weight * a.decode_blocks as f64 * per_block
    };
    (a.prefill_wait_ms, own, evict + decode, no_fit)
}

/// The lowest predicted cost (module doc).
pub fn decide(
    p: &TtftParams,
    snap: &Snapshot<'_>,
    req: &Request<'_>,
    ov: &Overlaps,
    rng: &mut impl Rng,
) -> Decision {
    let last = Cell::new(None);
    let cost = |w: usize| {
        let (wait, own, evict, no_fit) = terms(p, snap, req, ov, w, &last);
        wait + p.prefill_weight * own + evict + no_fit
    };
    let worker = pick_min(snap.eligible.iter().copied(), cost, rng).unwrap_or(snap.eligible[0]);
    Decision::by_cost(worker, ov)
}
