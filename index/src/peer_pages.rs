//! [`PeerPages`]: where the *other* router replicas sent prompts (issue 16), as the chained
//! page keys they publish, so a conversation whose next turn reaches this replica still finds
//! the worker that a peer placed its earlier turns on.
//!
//! A peer does not send its prompts (they may be private and large): it sends, per routed
//! request, the chained key of each full page of the prompt and the worker it chose. A page
//! is [`crate::keys`]' block of token ids (the token tree's page), or a fixed run of bytes of
//! the routing text (the caller's choice, the same on every replica). A chained key stands
//! for its page and the whole prefix before it, so "a worker holds key `i`" means "a peer
//! sent that worker the request's first `i + 1` pages".
//!
//! A lookup walks the request's own page keys from the first and stops at the first key no
//! live holder has; each worker's overlap is one past the deepest key it holds on that walk
//! (pages). It is approximate like the trees it complements: the router takes, per worker,
//! the larger of its own tree's overlap and this one.
//!
//! Bounded: a key holds at most [`MAX_HOLDERS`] workers (a new one replaces the stalest), a
//! holder lives `ttl_ms` after its last record, and at most `max_pages` keys are kept (the
//! oldest-recorded go first). Every operation costs O(its keys + the entries it expires).
//!
//! # Invariants
//! 1. Every key has 1..=[`MAX_HOLDERS`] holders with distinct workers.
//! 2. Every key appears in the expiry FIFO with expiry = its newest holder's time + TTL.
//! 3. At most `max_pages` keys are stored, and the FIFO holds at most
//!    2 × keys + [`FIFO_SLACK`] entries.

use crate::TenantId;
use crate::mix::MixMap;
use std::collections::VecDeque;

/// Most workers per key; a new one replaces the stalest. Four: a prefix shared by more
/// workers than that is spread load, where overlap no longer picks a worker (SMG's hash index
/// keeps 3 per head, `hash_index::MAX_HOLDERS`; one more for the replica that re-routes).
pub const MAX_HOLDERS: usize = 4;

/// FIFO entries allowed beyond twice the keys before it is rebuilt (invariant 3): refreshes
/// of hot keys leave stale entries behind; the rebuild is O(keys log keys), paid once per
/// ≥ keys + `FIFO_SLACK` records, so O(log keys) per record amortized.
pub const FIFO_SLACK: usize = 1024;

/// Settings of a [`PeerPages`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerPagesConfig {
    /// A holder not refreshed for this long is dropped, ms.
    pub ttl_ms: u64,
    /// Most keys kept; the oldest-recorded go first beyond it.
    pub max_pages: usize,
}

/// Page keys other replicas reported, with their workers. Single writer (`&mut self`); wrap
/// it in a [`crate::LeftRight`] for lock-free reads.
#[derive(Clone, Debug)]
pub struct PeerPages {
    cfg: PeerPagesConfig,
    pages: MixMap<u64, Vec<(TenantId, u64)>>,
    /// (newest time + ttl, key), in record order, so expiries ascend.
    fifo: VecDeque<(u64, u64)>,
}

impl PeerPages {
    /// Empty index.
    pub fn new(cfg: PeerPagesConfig) -> Self {
        Self {
            cfg,
            pages: MixMap::default(),
            fifo: VecDeque::new(),
        }
    }

    fn live(&self, t: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(t) < self.cfg.ttl_ms
    }

    /// Records that a peer sent `worker` the prompt whose page keys are `keys` (first page
    /// first) at `now_ms`: each key refreshes, adds, or replaces its stalest holder with the
    /// worker. Then expired keys go, and the oldest-recorded beyond `max_pages`.
    pub fn record(&mut self, keys: &[u64], worker: TenantId, now_ms: u64) {
        for &k in keys {
            let hs = self.pages.entry(k).or_default();
            if let Some(h) = hs.iter_mut().find(|h| h.0 == worker) {
                h.1 = h.1.max(now_ms);
            } else if hs.len() < MAX_HOLDERS {
                hs.push((worker, now_ms));
            } else {
                let stalest = (0..hs.len())
                    .min_by_key(|&i| (hs[i].1, hs[i].0))
                    .expect("MAX_HOLDERS > 0 holders");
                hs[stalest] = (worker, now_ms);
            }
            let newest = hs.iter().map(|h| h.1).max().unwrap_or(now_ms);
            self.fifo.push_back((newest + self.cfg.ttl_ms, k));
        }
        self.expire(now_ms);
        while self.pages.len() > self.cfg.max_pages {
            let Some((exp, k)) = self.fifo.pop_front() else {
                break;
            };
            if self.current(exp, k) {
                self.pages.remove(&k);
            }
        }
        self.compact();
    }

    /// Rebuilds the FIFO when stale entries passed invariant 3's bound.
    fn compact(&mut self) {
        if self.fifo.len() > 2 * self.pages.len() + FIFO_SLACK {
            self.rebuild_fifo();
        }
    }

    /// True when `(exp, k)` is key `k`'s live FIFO entry (not one a later refresh outdated).
    fn current(&self, exp: u64, k: u64) -> bool {
        self.pages
            .get(&k)
            .and_then(|hs| hs.iter().map(|h| h.1).max())
            .is_some_and(|newest| newest + self.cfg.ttl_ms == exp)
    }

    fn rebuild_fifo(&mut self) {
        let ttl = self.cfg.ttl_ms;
        let mut entries: Vec<(u64, u64)> = self
            .pages
            .iter()
            .map(|(&k, hs)| (hs.iter().map(|h| h.1).max().unwrap_or(0) + ttl, k))
            .collect();
        entries.sort_unstable();
        self.fifo = entries.into();
    }

    /// Drops the holders that expired by `now_ms`, and the keys left without one;
    /// O(expired + stale FIFO entries).
    pub fn expire(&mut self, now_ms: u64) {
        while let Some(&(exp, k)) = self.fifo.front() {
            if exp > now_ms {
                break;
            }
            self.fifo.pop_front();
            let ttl = self.cfg.ttl_ms;
            if let Some(hs) = self.pages.get_mut(&k) {
                hs.retain(|&(_, t)| now_ms.saturating_sub(t) < ttl);
                if hs.is_empty() {
                    self.pages.remove(&k);
                }
            }
        }
        self.compact();
    }

    /// Each worker's overlap with a request whose page keys are `keys`, in pages, sorted by
    /// worker: the walk from the first key stops at the first key without a live holder at
    /// `now_ms`, and a worker's overlap is one past the deepest key it holds on the way.
    /// Workers with no overlap are absent.
    pub fn overlaps(&self, keys: &[u64], now_ms: u64) -> Vec<(TenantId, usize)> {
        let mut out: Vec<(TenantId, usize)> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let mut any = false;
            for &(w, t) in self.pages.get(k).into_iter().flatten() {
                if !self.live(t, now_ms) {
                    continue;
                }
                any = true;
                match out.iter_mut().find(|e| e.0 == w) {
                    Some(e) => e.1 = i + 1,
                    None => out.push((w, i + 1)),
                }
            }
            if !any {
                break;
            }
        }
        out.sort_unstable();
        out
    }

    /// Forgets `worker` (a removed worker); O(keys log keys): a key's newest holder may
    /// change, so the FIFO is rebuilt (invariant 2).
    pub fn remove_worker(&mut self, worker: TenantId) {
        self.pages.retain(|_, hs| {
            hs.retain(|h| h.0 != worker);
            !hs.is_empty()
        });
        self.rebuild_fifo();
    }

    /// Keys stored (gauge).
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// True when no key is stored.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Checks invariants 1–3.
    ///
    /// # Errors
    /// [`crate::IndexError::Invariant`] with the invariant's number.
    #[cfg(any(test, feature = "test-util"))]
    pub fn check_invariants(&self) -> Result<(), crate::IndexError> {
        let bad = |number| Err(crate::IndexError::Invariant { number, node: 0 });
        for (&k, hs) in &self.pages {
            let mut ws: Vec<TenantId> = hs.iter().map(|h| h.0).collect();
            ws.sort_unstable();
            ws.dedup();
            if hs.is_empty() || hs.len() > MAX_HOLDERS || ws.len() != hs.len() {
                return bad(1);
            }
            let newest = hs.iter().map(|h| h.1).max().unwrap_or(0);
            if !self.fifo.contains(&(newest + self.cfg.ttl_ms, k)) {
                return bad(2);
            }
        }
        if self.pages.len() > self.cfg.max_pages
            || self.fifo.len() > 2 * self.pages.len() + FIFO_SLACK
        {
            return bad(3);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn pages(ttl_ms: u64, max_pages: usize) -> PeerPages {
        PeerPages::new(PeerPagesConfig { ttl_ms, max_pages })
    }

    /// Worked example: worker 1 was sent pages a b c, worker 2 pages a b; a request a b c d
    /// overlaps 3 pages with worker 1 and 2 with worker 2; one that starts with x overlaps
    /// nothing though it shares b (a chained key stands for its prefix: the walk stops at x).
    #[test]
    fn overlaps_follow_the_chain() {
        let mut p = pages(1_000, 100);
        p.record(&[10, 11, 12], 1, 0);
        p.record(&[10, 11], 2, 5);
        assert_eq!(p.overlaps(&[10, 11, 12, 13], 10), vec![(1, 3), (2, 2)]);
        assert_eq!(p.overlaps(&[99, 11, 12], 10), vec![]);
        assert_eq!(p.overlaps(&[10], 10), vec![(1, 1), (2, 1)]);
        p.check_invariants().unwrap();
    }

    /// A holder lives `ttl` after its last record: at 999 ms worker 1 still holds the
    /// pages it was sent at 0, at 1,000 it is gone, and a refresh at 500 keeps it to 1,499.
    #[test]
    fn holders_expire_after_the_ttl_from_their_last_record() {
        let mut p = pages(1_000, 100);
        p.record(&[1, 2], 1, 0);
        assert_eq!(p.overlaps(&[1, 2], 999), vec![(1, 2)]);
        assert_eq!(p.overlaps(&[1, 2], 1_000), vec![]);
        p.record(&[1], 1, 500);
        assert_eq!(p.overlaps(&[1, 2], 1_499), vec![(1, 1)]);
        p.expire(1_000);
        assert_eq!(p.len(), 1, "key 2 expired at 1,000, key 1 lives to 1,500");
        p.expire(1_500);
        assert!(p.is_empty());
        p.check_invariants().unwrap();
    }

    /// A fifth worker on a key replaces the stalest of four (worker 0, recorded first).
    #[test]
    fn a_fifth_holder_replaces_the_stalest() {
        let mut p = pages(1_000, 100);
        for w in 0..5 {
            p.record(&[7], w, u64::from(w));
        }
        assert_eq!(p.overlaps(&[7], 10), vec![(1, 1), (2, 1), (3, 1), (4, 1)]);
        p.check_invariants().unwrap();
    }

    /// Beyond `max_pages` the oldest-recorded keys go, refreshed ones stay.
    #[test]
    fn the_cap_drops_the_oldest_recorded_keys() {
        let mut p = pages(1_000_000, 3);
        p.record(&[1, 2, 3], 0, 0);
        p.record(&[1], 0, 1); // refresh 1: now 2 is the oldest
        p.record(&[4], 0, 2);
        assert_eq!(p.len(), 3);
        assert_eq!(p.overlaps(&[1], 3), vec![(0, 1)]);
        assert_eq!(p.overlaps(&[2], 3), vec![]);
        assert_eq!(p.overlaps(&[3], 3), vec![(0, 1)]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn remove_worker_forgets_it_everywhere() {
        let mut p = pages(1_000, 100);
        p.record(&[1, 2], 1, 0);
        p.record(&[1], 2, 0);
        p.remove_worker(1);
        assert_eq!(p.overlaps(&[1, 2], 1), vec![(2, 1)]);
        assert_eq!(p.len(), 1);
    }

    /// The brute-force reference: every record kept; a key's live holders are the workers
    /// whose last record of it is within the TTL (at most 4 workers, so no replacement).
    fn reference(
        records: &[(Vec<u64>, TenantId, u64)],
        q: &[u64],
        now: u64,
        ttl: u64,
    ) -> Vec<(TenantId, usize)> {
        let mut last: HashMap<(u64, TenantId), u64> = HashMap::new();
        for (keys, w, t) in records {
            for &k in keys {
                let e = last.entry((k, *w)).or_insert(*t);
                *e = (*e).max(*t);
            }
        }
        let mut out: Vec<(TenantId, usize)> = Vec::new();
        for (i, k) in q.iter().enumerate() {
            let live: Vec<TenantId> = (0..4)
                .filter(|&w| {
                    last.get(&(*k, w))
                        .is_some_and(|&t| now.saturating_sub(t) < ttl)
                })
                .collect();
            if live.is_empty() {
                break;
            }
            for w in live {
                match out.iter_mut().find(|e| e.0 == w) {
                    Some(e) => e.1 = i + 1,
                    None => out.push((w, i + 1)),
                }
            }
        }
        out.sort_unstable();
        out
    }

    proptest! {
        /// Random prompts over a small key space (shared prefixes are common), 4 workers,
        /// times ascending: every lookup equals the reference, and the invariants hold.
        #[test]
        fn lookups_equal_the_reference(
            ops in prop::collection::vec(
                (prop::collection::vec(0u64..6, 1..8), 0u32..4, 0u64..50, prop::collection::vec(0u64..6, 1..8)),
                1..60),
        ) {
            let ttl = 200;
            let mut p = pages(ttl, usize::MAX);
            let mut records = Vec::new();
            let mut now = 0;
            for (keys, w, dt, q) in ops {
                now += dt;
                p.record(&keys, w, now);
                records.push((keys, w, now));
                prop_assert_eq!(p.overlaps(&q, now), reference(&records, &q, now, ttl));
                p.check_invariants().unwrap();
            }
        }

        /// With a cap and more workers than holders, the bounds hold after every record.
        #[test]
        fn bounds_hold_under_a_cap(
            ops in prop::collection::vec((prop::collection::vec(0u64..40, 1..12), 0u32..9, 0u64..30), 1..200),
            cap in 1usize..30,
        ) {
            let mut p = pages(500, cap);
            let mut now = 0;
            for (keys, w, dt) in ops {
                now += dt;
                p.record(&keys, w, now);
                p.check_invariants().unwrap();
                prop_assert!(p.len() <= cap);
            }
        }
    }
}
