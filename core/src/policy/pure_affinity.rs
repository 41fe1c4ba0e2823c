//! `pure_affinity`: the eligible worker with the largest overlap, no load term at all; ties
//! (and a cold index) at random. The herding yardstick (anchors.md §7 E6): every request of a
//! shared prefix lands on its first holder.

use super::prefix::Overlaps;
use super::{Decision, Snapshot};
use rand::Rng;

/// The largest overlap.
pub fn decide(snap: &Snapshot<'_>, ov: &Overlaps, rng: &mut impl Rng) -> Decision {
    let worker = super::wait::pick_min(snap.eligible.iter().copied(), |w| -(ov.of(w) as f64), rng)
        .unwrap_or(snap.eligible[0]);
    Decision::by_cost(worker, ov)
}
