//! `power_of_two`: two distinct eligible workers drawn at random, the one with the lower
//! expected wait (SMG's scorer, anchors.md §2.5; ties at random). One eligible worker: that
//! one.

use super::{Decision, Reason, Snapshot};
use rand::Rng;

/// Two distinct draws, the lower expected wait.
pub fn decide(snap: &Snapshot<'_>, rng: &mut impl Rng) -> Decision {
    let n = snap.eligible.len();
    let worker = if n == 1 {
        snap.eligible[0]
    } else {
        let a = rng.random_range(0..n);
        let b = (a + 1 + rng.random_range(0..n - 1)) % n;
        snap.least_wait_among([snap.eligible[a], snap.eligible[b]], rng)
            .unwrap_or(snap.eligible[a])
    };
    Decision {
        worker,
        reason: Reason::PowerOfTwo,
    }
}
