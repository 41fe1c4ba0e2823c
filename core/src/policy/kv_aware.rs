//! `kv_aware` and the `dynamo_kv` preset: Dynamo's blended cost in KV blocks (anchors.md
//! §3.1), lowest wins:
//!
//! ```text
//! excess_w  = (prefill_tokens_w − min over eligible) / block_size
//! decay_w   = 1 / (1 + credit_decay × excess_w / request_blocks)        (1 when decay = 0)
//! credit_w  = credit × decay_w × overlap_blocks_w
//! prefill_w = max(0, (prefill_tokens_w + request_tokens) / block_size − credit_w)
//! added_w   = request_full_blocks − live_head_w
//! cost_w    = prefill_load_scale × prefill_w + decode_blocks_w + added_w
//!           + decode_active_request_weight × requests_w
//! ```
//!
//! `prefill_tokens_w` is the new prefill booked on `w` and not yet past its first token
//! (Dynamo's active prefill tokens with `router_assume_kv_reuse`), `decode_blocks_w` its
//! unique active blocks ([`crate::load::active`]). `added_w` is what the request adds to
//! them: its full blocks less the head that a request live on `w` already holds
//! ([`super::LivePaths::live_head`]). Dynamo's "potential blocks" are exactly that
//! (`ActiveSequences`: active blocks + the query's blocks past its matched depth in the
//! worker's active prompts), so a worker decoding the same prefix now pays less; only
//! without live requests sharing anything is the term the same on every worker (anchors.md
//! E3). A request without block keys (text mode) adds nothing, as Dynamo's does without a
//! token sequence. Overlaps are blocks of the event index's size; the
//! host and disk weights apply to offloaded tiers, which the event index does not yet tell
//! apart in a match (every matched block counts as device). Selection: argmin with random
//! ties, or with `router_temperature` T > 0 a softmax over costs
//! ([`super::wait::softmax_min`]).

use super::prefix::Overlaps;
use super::wait::{pick_min, softmax_min};
use super::{Decision, Request, Snapshot};
use crate::config::PolicyKnobs;
use rand::Rng;

/// kv_aware's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvParams {
    /// Device-overlap credit, 0–1.
    pub credit: f64,
    /// Credit decay per request-equivalent of excess prefill.
    pub credit_decay: f64,
    /// Weight of the prefill term.
    pub prefill_load_scale: f64,
    /// Cost per active request, blocks.
    pub decode_active_request_weight: f64,
    /// Credit of a CPU-tier block.
    pub host_weight: f64,
    /// Credit of a disk-tier block.
    pub disk_weight: f64,
    /// Softmax temperature; 0 = argmin.
    pub temperature: f64,
}

impl KvParams {
    /// From the knobs, with Dynamo's deprecation rule for `kv_overlap_weight`
    /// ([`PolicyKnobs::kv_credit_and_scale`]).
    pub fn of(k: &PolicyKnobs) -> Self {
        let (credit, scale) = k.kv_credit_and_scale();
        Self {
            credit,
            credit_decay: k.overlap_score_credit_decay,
            prefill_load_scale: scale,
            decode_active_request_weight: k.decode_active_request_weight,
            host_weight: k.host_cache_hit_weight,
            disk_weight: k.disk_cache_hit_weight,
            temperature: k.router_temperature,
        }
    }

    /// Dynamo's defaults exactly (anchors.md §3.2).
    pub fn dynamo() -> Self {
        Self::of(&PolicyKnobs {
            overlap_score_credit: 1.0,
            overlap_score_credit_decay: 0.0,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            router_temperature: 0.0,
            kv_overlap_weight: None,
            ..PolicyKnobs::default()
        })
    }
}

/// The cost of every eligible worker, in eligible order (module doc).
pub fn costs(
    p: &KvParams,
    snap: &Snapshot<'_>,
    req: &Request<'_>,
    ov: &Overlaps,
) -> Vec<(usize, f64)> {
    let bs = req.block_size as f64;
    let request_blocks = req.blocks().max(f64::MIN_POSITIVE);
    let booked = |w: usize| snap.load(w).active.prefill_tokens as f64;
    let min = snap
        .eligible
        .iter()
        .map(|&w| booked(w))
        .fold(f64::INFINITY, f64::min);
    snap.eligible
        .iter()
        .map(|&w| {
            let excess = (booked(w) - min) / bs;
            let decay = 1.0 / (1.0 + p.credit_decay * excess / request_blocks);
            let credit = p.credit * decay * (ov.tokens(w) as f64 / bs);
            let prefill = ((booked(w) + req.prompt_tokens as f64) / bs - credit).max(0.0);
            let wl = snap.load(w);
            let live = snap.live.map_or(0, |l| l.live_head(w, &req.block_keys));
            let added = req.block_keys.len().saturating_sub(live);
            let cost = p.prefill_load_scale * prefill
                + (wl.active.decode_blocks as usize + added) as f64
                + p.decode_active_request_weight * wl.requests as f64;
            (w, cost)
        })
        .collect()
}

/// The lowest cost (module doc).
pub fn decide(
    p: &KvParams,
    snap: &Snapshot<'_>,
    req: &Request<'_>,
    ov: &Overlaps,
    rng: &mut impl Rng,
) -> Decision {
    let c = costs(p, snap, req, ov);
    let worker = if p.temperature > 0.0 {
        softmax_min(&c, p.temperature, rng)
    } else {
        pick_min(0..c.len(), |i| c[i].1, rng).map(|i| c[i].0)
    }
    .unwrap_or(snap.eligible[0]);
    Decision::by_cost(worker, ov)
}
