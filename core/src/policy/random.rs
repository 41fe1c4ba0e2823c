//! `random`: a uniformly random eligible worker.

use super::{Decision, Reason, Snapshot};
use rand::Rng;

/// A uniform draw over `snap.eligible`.
pub fn decide(snap: &Snapshot<'_>, rng: &mut impl Rng) -> Decision {
    Decision {
        worker: snap.eligible[rng.random_range(0..snap.eligible.len())],
        reason: Reason::Random,
    }
}
