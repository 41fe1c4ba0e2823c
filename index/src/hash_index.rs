//! `--cache-index hash`: TTL'd exact-match placement of token-id heads at fixed boundaries
//! (SMG, anchors §2.1–§2.3).
//!
//! For each boundary `b` (tokens, strictly ascending) not longer than a request, the head
//! `tokens[..b]` hashes (xxh3-64, seeded by the namespace) to a key holding at most
//! [`MAX_HOLDERS`] `(worker, last_seen_ms)` pairs. A lookup probes the deepest boundary first
//! and returns the live holders of the first head that has any. Recording a decision refreshes
//! or adds the worker at every applicable boundary; a 4th holder evicts the stalest. Memory
//! is bounded by the heads recorded within one TTL: every record drops the expired keys at
//! the front of a FIFO of (expiry, key).

use crate::positional::MixMap;
use crate::{IndexError, Namespace, TenantId};
use std::collections::VecDeque;
use xxhash_rust::xxh3::Xxh3;

/// Most holders per head; a new one evicts the stalest. Source: SMG hash index.
pub const MAX_HOLDERS: usize = 3;

/// Settings of a [`HashIndex`].
#[derive(Clone, Debug, PartialEq)]
pub struct HashIndexConfig {
    /// Head lengths, tokens, strictly ascending, > 0 (`--cache-boundaries`).
    pub boundaries: Vec<usize>,
    /// A holder not refreshed for this long is dead, ms (`--cache-ttl-secs` × 1000, default
    /// 180 s).
    pub ttl_ms: u64,
}

/// TTL'd exact-match head index (one per model). Single writer (`&mut self`); wrap it in a
/// [`crate::LeftRight`] for lock-free concurrent reads.
///
/// # Invariants
/// 1. Every key has 1..=3 holders with distinct workers.
/// 2. Every key appears in the expiry FIFO with an expiry ≥ its newest holder's time + TTL.
#[derive(Clone, Debug)]
pub struct HashIndex {
    cfg: HashIndexConfig,
    heads: MixMap<u64, Vec<(TenantId, u64)>>,
    /// (newest time + ttl, key), in record order (so expiries ascend).
    fifo: VecDeque<(u64, u64)>,
}

impl HashIndex {
    /// Empty index.
    ///
    /// # Errors
    /// [`IndexError::BadBoundaries`]: no boundaries, a 0, or not strictly ascending (hash mode
    /// refuses to start without boundaries, SMG).
    pub fn new(cfg: HashIndexConfig) -> Result<Self, IndexError> {
        let b = &cfg.boundaries;
        if b.is_empty() || b[0] == 0 || !b.windows(2).all(|w| w[0] < w[1]) {
            return Err(IndexError::BadBoundaries);
        }
        Ok(Self {
            cfg,
            heads: MixMap::default(),
            fifo: VecDeque::new(),
        })
    }

    /// Keys of the applicable heads of `tokens`, shortest first.
    fn head_keys(&self, ns: Namespace, tokens: &[u32]) -> Vec<(usize, u64)> {
        let mut h = Xxh3::with_seed(ns ^ crate::keys::SEED);
        let mut done = 0;
        let mut out = Vec::new();
        for &b in self
            .cfg
            .boundaries
            .iter()
            .take_while(|&&b| b <= tokens.len())
        {
            for t in &tokens[done..b] {
                h.update(&t.to_le_bytes());
            }
            done = b;
            out.push((b, h.digest()));
        }
        out
    }

    /// Deepest head of `tokens` (namespace `ns`) with a live holder at `now_ms`: `(head
    /// length in tokens, holders most recent first)`. `None` when no head has one.
    pub fn lookup(
        &self,
        ns: Namespace,
        tokens: &[u32],
        now_ms: u64,
    ) -> Option<(usize, Vec<TenantId>)> {
        for (b, k) in self.head_keys(ns, tokens).into_iter().rev() {
            let Some(hs) = self.heads.get(&k) else {
                continue;
            };
            let mut live: Vec<(TenantId, u64)> = hs
                .iter()
                .copied()
                .filter(|&(_, t)| now_ms.saturating_sub(t) < self.cfg.ttl_ms)
                .collect();
            if !live.is_empty() {
                live.sort_by_key(|&(w, t)| (std::cmp::Reverse(t), w));
                return Some((b, live.into_iter().map(|(w, _)| w).collect()));
            }
        }
        None
    }

    /// Every worker that is a live holder of some head of `tokens` (namespace `ns`) at
    /// `now_ms`, with the length in tokens of its deepest such head, sorted by worker. The
    /// per-worker form of [`Self::lookup`] (a worker that holds only a shallower head than
    /// the deepest one is listed too).
    pub fn depths(&self, ns: Namespace, tokens: &[u32], now_ms: u64) -> Vec<(TenantId, usize)> {
        let mut out: Vec<(TenantId, usize)> = Vec::new();
        for (b, k) in self.head_keys(ns, tokens) {
            for &(w, t) in self.heads.get(&k).into_iter().flatten() {
                if now_ms.saturating_sub(t) >= self.cfg.ttl_ms {
                    continue;
                }
                match out.iter_mut().find(|e| e.0 == w) {
                    Some(e) => e.1 = e.1.max(b),
                    None => out.push((w, b)),
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// Records that `worker` was sent `tokens` at `now_ms`: at every applicable boundary the
    /// worker is refreshed, added, or replaces the stalest of 3 holders. Then expired heads
    /// are dropped.
    pub fn record(&mut self, ns: Namespace, tokens: &[u32], worker: TenantId, now_ms: u64) {
        for (_, k) in self.head_keys(ns, tokens) {
            let hs = self.heads.entry(k).or_default();
            if let Some(h) = hs.iter_mut().find(|h| h.0 == worker) {
                h.1 = now_ms;
            } else if hs.len() < MAX_HOLDERS {
                hs.push((worker, now_ms));
            } else {
                let stalest = (0..hs.len())
                    .min_by_key(|&i| (hs[i].1, hs[i].0))
                    .expect("3 holders");
                hs[stalest] = (worker, now_ms);
            }
            self.fifo.push_back((now_ms + self.cfg.ttl_ms, k));
        }
        self.expire(now_ms);
    }

    /// Drops heads whose newest holder expired by `now_ms`; O(expired + stale FIFO entries).
    pub fn expire(&mut self, now_ms: u64) {
        while let Some(&(exp, k)) = self.fifo.front() {
            if exp > now_ms {
                break;
            }
            self.fifo.pop_front();
            if let Some(hs) = self.heads.get_mut(&k) {
                hs.retain(|&(_, t)| now_ms.saturating_sub(t) < self.cfg.ttl_ms);
                if hs.is_empty() {
                    self.heads.remove(&k);
                }
            }
        }
    }

    /// Removes `worker` from every head; O(heads).
    pub fn remove_worker(&mut self, worker: TenantId) {
        self.heads.retain(|_, hs| {
            hs.retain(|h| h.0 != worker);
            !hs.is_empty()
        });
    }

    /// Heads stored (gauge).
    pub fn len(&self) -> usize {
        self.heads.len()
    }

    /// True when no head is stored.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// Checks invariants 1–2.
    ///
    /// # Errors
    /// [`IndexError::Invariant`] with the invariant's number.
    #[cfg(any(test, feature = "test-util"))]
    pub fn check_invariants(&self) -> Result<(), IndexError> {
        let bad = |number| Err(IndexError::Invariant { number, node: 0 });
        for (k, hs) in &self.heads {
            let mut ws: Vec<TenantId> = hs.iter().map(|h| h.0).collect();
            ws.sort_unstable();
            ws.dedup();
            if hs.is_empty() || hs.len() > MAX_HOLDERS || ws.len() != hs.len() {
                return bad(1);
            }
            let newest = hs.iter().map(|h| h.1).max().unwrap_or(0);
            if !self
                .fifo
                .iter()
                .any(|&(e, fk)| fk == *k && e >= newest + self.cfg.ttl_ms)
            {
                return bad(2);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ix() -> HashIndex {
        HashIndex::new(HashIndexConfig {
            boundaries: vec![4, 8],
            ttl_ms: 1_000,
        })
        .unwrap()
    }

    #[test]
    fn boundaries_are_validated() {
        for b in [vec![], vec![0, 4], vec![8, 4], vec![4, 4]] {
            let cfg = HashIndexConfig {
                boundaries: b,
                ttl_ms: 1,
            };
            assert_eq!(HashIndex::new(cfg).err(), Some(IndexError::BadBoundaries));
        }
    }

    #[test]
    fn deepest_head_three_holders_ttl() {
        let mut h = ix();
        let a: Vec<u32> = (0..10).collect();
        h.record(0, &a, 1, 0);
        assert_eq!(h.lookup(0, &a, 10), Some((8, vec![1])));
        // Same first 4, different 5..8: only the 4-head matches.
        let mut b = a.clone();
        b[6] = 99;
        assert_eq!(h.lookup(0, &b, 10), Some((4, vec![1])));
        assert_eq!(h.lookup(0, &a[..3], 10), None);
        assert_eq!(h.lookup(7, &a, 10), None, "namespaces never match");
        for (w, t) in [(2, 20), (3, 30), (4, 40)] {
            h.record(0, &a, w, t);
        }
        // A 4th holder evicts the stalest (worker 1 at t=0).
        assert_eq!(h.lookup(0, &a, 50), Some((8, vec![4, 3, 2])));
        h.check_invariants().unwrap();
        h.remove_worker(3);
        assert_eq!(h.lookup(0, &a, 50), Some((8, vec![4, 2])));
        // TTL: dead after 1 s; record() expires them (bounded memory).
        assert_eq!(h.lookup(0, &a, 1_100), None);
        h.record(0, &[9, 9, 9, 9], 0, 2_000);
        assert_eq!(h.len(), 1);
        h.check_invariants().unwrap();
    }
}
