//! `least_load`: the eligible worker with the lowest expected wait, SMG's scorer
//! ([`super::expected_wait_s`], anchors.md §2.5), ties at random.

use super::{Decision, Reason, Snapshot};
use rand::Rng;

/// The lowest expected wait.
pub fn decide(snap: &Snapshot<'_>, rng: &mut impl Rng) -> Decision {
    Decision {
        worker: snap.least_wait(rng),
        reason: Reason::LeastLoad,
    }
}
