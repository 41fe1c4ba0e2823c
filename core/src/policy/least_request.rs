//! `least_request`: the eligible worker with the fewest requests (in flight + foreign), ties
//! uniformly at random, never by list order (bug-cases.md B1).

use super::{Decision, Reason, Snapshot};
use rand::Rng;

/// The least-loaded eligible worker.
pub fn decide(snap: &Snapshot<'_>, rng: &mut impl Rng) -> Decision {
    Decision {
        worker: snap.least_loaded(rng),
        reason: Reason::LeastRequest,
    }
}
