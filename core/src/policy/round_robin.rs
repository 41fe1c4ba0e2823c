//! `round_robin`: each eligible worker in turn — `eligible[seq % n]`, the request's
//! sequence number choosing, so the policy keeps no counter.

use super::{Decision, Reason, Snapshot};

/// The eligible worker whose turn `snap.seq` is.
pub fn decide(snap: &Snapshot<'_>) -> Decision {
    Decision {
        worker: snap.eligible[(snap.seq % snap.eligible.len() as u64) as usize],
        reason: Reason::RoundRobin,
    }
}
