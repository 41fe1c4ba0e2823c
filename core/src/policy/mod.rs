//! [`Router`]: picks a worker for a request from its [`RouteKey`] and a snapshot of worker
//! loads. No sockets, no clocks; randomness only breaks ties.
//!
//! The cache_aware index is a per-model [`StringTree`] behind one mutex: a decision matches
//! and inserts in one critical section (a few µs). Issue 3 replaces it with lock-free reads.

use crate::config::{Config, PolicyKind};
use crate::route_key::RouteKey;
use kvroute_index::{StringTree, TenantId};
use rand::Rng;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Why a worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reason {
    /// round_robin's turn.
    RoundRobin,
    /// least_request: fewest in flight.
    LeastRequest,
    /// cache_aware: a prefix holder that is not hot.
    CacheHit {
        /// Matched prefix, chars.
        matched_chars: usize,
        /// matched_chars / request chars.
        ratio: f64,
    },
    /// cache_aware: match ratio at or below the threshold; least-loaded worker.
    CacheMiss,
    /// cache_aware: every prefix holder was hot; least-loaded worker.
    Spill,
}

impl Reason {
    /// Metric label: `round_robin`, `least_request`, `hit`, `miss`, `spill`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::RoundRobin => "round_robin",
            Reason::LeastRequest => "least_request",
            Reason::CacheHit { .. } => "hit",
            Reason::CacheMiss => "miss",
            Reason::Spill => "spill",
        }
    }
}

/// A routing decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Worker id.
    pub worker: usize,
    /// Why.
    pub reason: Reason,
}

/// The spill gate of SMG (anchors.md §2.2 step 5): worker `w` is hot when
/// `loads[w] > rel × mean` **and** `loads[w] > mean + abs`, mean over eligible workers.
#[derive(Debug, Clone, Copy)]
pub struct SpillGate {
    /// Load above which a worker is hot, requests (`max(rel × mean, mean + abs)`).
    pub threshold: f64,
}

impl SpillGate {
    /// Gate for `loads` (all workers eligible).
    pub fn new(loads: &[usize], rel: f64, abs: usize) -> Self {
        let mean = if loads.is_empty() {
            0.0
        } else {
            loads.iter().sum::<usize>() as f64 / loads.len() as f64
        };
        Self {
            threshold: (rel * mean).max(mean + abs as f64),
        }
    }

    /// True when a worker with `load` in flight is hot.
    pub fn is_hot(&self, load: usize) -> bool {
        load as f64 > self.threshold
    }
}

/// The least-loaded of `candidates` (worker ids), ties broken uniformly at random — never by
/// list order (bug-cases.md B1). `None` when `candidates` is empty.
pub fn least_loaded(
    loads: &[usize],
    candidates: impl IntoIterator<Item = usize>,
    rng: &mut impl Rng,
) -> Option<usize> {
    let mut best: Option<(usize, usize)> = None; // (worker, load)
    let mut ties = 0u32;
    for w in candidates {
        let load = loads[w];
        match best {
            Some((_, b)) if load > b => {}
            Some((_, b)) if load == b => {
                // Reservoir sampling over the tied set: uniform without collecting it.
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((w, load));
                }
            }
            _ => {
                best = Some((w, load));
                ties = 1;
            }
        }
    }
    best.map(|(w, _)| w)
}

/// Picks workers for requests: one per gateway, shared by all shards (`Send + Sync`).
///
/// Holds the policy and its thresholds (from [`Config`]), a round-robin counter, and for
/// cache_aware one [`StringTree`] per model (keyed by [`RouteKey::model`], created on first
/// use) behind a single `Mutex`: a decision matches and inserts in one critical section. Issue 3
/// replaces the mutex with lock-free reads.
pub struct Router {
    kind: PolicyKind,
    cache_threshold: f64,
    balance_rel_threshold: f64,
    balance_abs_threshold: usize,
    max_tree_size_chars: usize,
    next: AtomicUsize,
    trees: Mutex<HashMap<String, StringTree>>,
}

impl Router {
    /// A router for `cfg` (policy and thresholds).
    pub fn new(cfg: &Config) -> Self {
        Self {
            kind: cfg.policy,
            cache_threshold: cfg.cache_threshold,
            balance_rel_threshold: cfg.balance_rel_threshold,
            balance_abs_threshold: cfg.balance_abs_threshold,
            max_tree_size_chars: cfg.max_tree_size_chars,
            next: AtomicUsize::new(0),
            trees: Mutex::new(HashMap::new()),
        }
    }

    /// The policy.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// Chooses a worker for `key` given `loads` (in-flight requests per worker id, one entry
    /// per worker; all workers are eligible). Reads no clock; randomness only breaks ties.
    ///
    /// - round_robin: workers in turn (one shared counter). Reason `RoundRobin`.
    /// - least_request: fewest in flight, ties uniformly at random, never by list order (bug
    ///   B1). Reason `LeastRequest`.
    /// - cache_aware (SMG, anchors §2.2 steps 3, 5, 6, 7): ratio = matched chars / request
    ///   chars in the model's tree. If ratio > `cache_threshold` the candidates are the deepest
    ///   matched node's tenants (at most 8); the least-loaded non-hot one wins (`CacheHit`).
    ///   Hot = load > `rel × mean` and load > `mean + abs` ([`SpillGate`]). All candidates hot →
    ///   the least-loaded worker (`Spill`). Otherwise → the least-loaded worker (`CacheMiss`).
    ///   Then `key.text` is inserted for the chosen worker (a spill target becomes one more
    ///   holder) and the tree is evicted down to `max_tree_size_chars` if over. Empty text (a
    ///   token-ids-only request) is a miss and is not recorded.
    ///
    /// # Panics
    /// When `loads` is empty.
    pub fn decide(&self, key: &RouteKey, loads: &[usize]) -> Decision {
        assert!(!loads.is_empty(), "decide needs at least one worker");
        let mut rng = rand::rng();
        let all = 0..loads.len();
        match self.kind {
            PolicyKind::RoundRobin => Decision {
                worker: self.next.fetch_add(1, Ordering::Relaxed) % loads.len(),
                reason: Reason::RoundRobin,
            },
            PolicyKind::LeastRequest => Decision {
                worker: least_loaded(loads, all, &mut rng).unwrap_or(0),
                reason: Reason::LeastRequest,
            },
            PolicyKind::CacheAware => self.decide_cache_aware(key, loads, &mut rng),
        }
    }

    fn decide_cache_aware(&self, key: &RouteKey, loads: &[usize], rng: &mut impl Rng) -> Decision {
        let least = |rng: &mut _| least_loaded(loads, 0..loads.len(), rng).unwrap_or(0);
        if key.text.is_empty() {
            return Decision {
                worker: least(rng),
                reason: Reason::CacheMiss,
            };
        }
        let gate = SpillGate::new(
            loads,
            self.balance_rel_threshold,
            self.balance_abs_threshold,
        );
        let mut trees = self.trees.lock().unwrap_or_else(|p| p.into_inner());
        if !trees.contains_key(&key.model) {
            trees.insert(key.model.clone(), StringTree::new());
        }
        let tree = trees.get_mut(&key.model).expect("inserted above");
        let m = tree.match_prefix(&key.text);
        let request_chars = key.text.chars().count();
        let ratio = m.matched_chars as f64 / request_chars as f64;
        // Holders that are still workers (a tenant id beyond `loads` is a removed worker).
        let holders = || {
            m.tenants
                .iter()
                .map(|&t| t as usize)
                .filter(|&w| w < loads.len())
        };
        let decision = if ratio > self.cache_threshold && holders().next().is_some() {
            let cool = holders().filter(|&w| !gate.is_hot(loads[w]));
            match least_loaded(loads, cool, rng) {
                Some(worker) => Decision {
                    worker,
                    reason: Reason::CacheHit {
                        matched_chars: m.matched_chars,
                        ratio,
                    },
                },
                // Every holder is hot: the least-loaded worker, which is never hot unless all
                // are (hot is monotone in load), and which becomes one more holder below.
                None => Decision {
                    worker: least(rng),
                    reason: Reason::Spill,
                },
            }
        } else {
            Decision {
                worker: least(rng),
                reason: Reason::CacheMiss,
            }
        };
        tree.insert(&key.text, decision.worker as TenantId);
        if tree.total_chars() > self.max_tree_size_chars {
            tree.evict_to(self.max_tree_size_chars);
        }
        decision
    }

    /// Forgets worker `id` in every index (a removed or dead worker).
    pub fn remove_worker(&self, id: usize) {
        let mut trees = self.trees.lock().unwrap_or_else(|p| p.into_inner());
        for tree in trees.values_mut() {
            tree.remove_tenant(id as TenantId);
        }
    }

    /// Total chars held by the tree of `model` (0 when it has none).
    pub fn tree_chars(&self, model: &str) -> usize {
        let trees = self.trees.lock().unwrap_or_else(|p| p.into_inner());
        trees.get(model).map_or(0, |t| t.total_chars())
    }
}

#[cfg(test)]
mod tests;
