//! `consistent_hash`: session affinity. A request's session key (`x-kvroute-routing-key`,
//! else `x-session-id`: [`crate::route_key::RouteKey::session`]) is hashed onto a ring of
//! [`VIRTUAL_NODES`] points per worker slot; the request goes to the first worker clockwise
//! that is eligible and not full (bounded load: Mirrokni et al., a worker is full when its
//! requests + 1 exceed `⌈c · (total + 1) / eligible⌉`, c = `hash_load_factor`). A worker
//! that leaves moves only its own sessions; one that is passed over (ineligible, full) sends
//! its sessions to the next point's worker. No session key: the least loaded worker
//! ([`Reason::Hashed`] with `fallback`). The ring is shared with `prefix_hash`.

use super::wait::pick_min;
use super::{Decision, Reason, Snapshot};
use crate::route_key::RouteKey;
use rand::Rng;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Ring points per worker. Source: the 150 (Ketama's and nginx's `hash ...
/// consistent` figure: 160 points per weight unit; 100–200 keep the load within a few %).
pub const VIRTUAL_NODES: usize = 150;

/// A consistent-hash ring over worker slots `0..slots`.
#[derive(Debug)]
pub struct Ring {
    slots: usize,
    /// (point, worker), ascending by point.
    points: Vec<(u64, usize)>,
}

impl Ring {
    /// The ring of `slots` workers, [`VIRTUAL_NODES`] points each.
    pub fn new(slots: usize) -> Self {
        let mut points: Vec<(u64, usize)> = (0..slots)
            .flat_map(|w| {
                (0..VIRTUAL_NODES).map(move |v| {
                    let id = ((w as u64) << 32) | v as u64;
                    (
                        xxh3_64_with_seed(&id.to_le_bytes(), 0x006b_7672_6f75_7465),
                        w,
                    )
                })
            })
            .collect();
        points.sort_unstable();
        Self { slots, points }
    }

    /// Worker slots it was built for.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Workers clockwise from `hash`, each once, in ring order.
    pub fn walk(&self, hash: u64) -> impl Iterator<Item = usize> + '_ {
        let start = self.points.partition_point(|p| p.0 < hash);
        let mut seen = vec![false; self.slots];
        (0..self.points.len())
            .map(move |i| self.points[(start + i) % self.points.len()].1)
            .filter(move |&w| !std::mem::replace(&mut seen[w], true))
    }

    /// The first worker clockwise from `hash` that is eligible and not full (module doc),
    /// and whether an earlier one was passed over; `None` when every eligible worker is
    /// full.
    pub fn owner(&self, snap: &Snapshot<'_>, hash: u64, load_factor: f64) -> Option<(usize, bool)> {
        let total: usize = snap.eligible.iter().map(|&w| snap.requests(w)).sum();
        let cap = (load_factor * (total + 1) as f64 / snap.eligible.len() as f64).ceil();
        let mut passed = false;
        for w in self.walk(hash) {
            if snap.is_eligible(w) && (snap.requests(w) + 1) as f64 <= cap {
                return Some((w, passed));
            }
            passed = true;
        }
        None
    }
}

/// Hashes `key` (a session key or a prompt head) onto the ring: `hash`'s owner, else the
/// least loaded.
pub(super) fn owner_or_least(
    ring: &Ring,
    snap: &Snapshot<'_>,
    key: Option<u64>,
    load_factor: f64,
    rng: &mut impl Rng,
) -> Decision {
    if let Some((worker, fallback)) = key.and_then(|h| ring.owner(snap, h, load_factor)) {
        return Decision {
            worker,
            reason: Reason::Hashed { fallback },
        };
    }
    let worker = pick_min(
        snap.eligible.iter().copied(),
        |w| snap.requests(w) as f64,
        rng,
    )
    .unwrap_or(snap.eligible[0]);
    Decision {
        worker,
        reason: Reason::Hashed { fallback: true },
    }
}

/// The session key's owner (module doc).
pub fn decide(
    ring: &Ring,
    snap: &Snapshot<'_>,
    key: &RouteKey,
    load_factor: f64,
    rng: &mut impl Rng,
) -> Decision {
    let hash = key
        .session
        .as_deref()
        .filter(|s| !s.is_empty())
        .map(|s| xxh3_64_with_seed(s.as_bytes(), 0));
    owner_or_least(ring, snap, hash, load_factor, rng)
}
