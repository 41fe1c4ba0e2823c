//! Approximate multi-tenant radix tree over token ids, page-granular (SMG's token tree,
//! anchors §2.1 and §2.4; SGLang's radix cache pages).
//!
//! Only whole pages of `block_size` tokens are recorded and matched: a request shorter than
//! a page never matches. Children are keyed by xxh3-64 of the edge's first page; edges store
//! the token ids themselves, so a match compares ids exactly. A digest collision between two
//! different first pages under one node counts as a miss (SMG), it never yields a false hit.

use crate::radix::{Radix, Unit};
use crate::{Namespace, TenantId};

/// Result of [`TokenTree::match_prefix`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenMatch {
    /// Longest prefix present in the tree, tokens; always a multiple of the page size.
    pub matched_tokens: usize,
    /// Up to [`crate::MAX_MATCH_TENANTS`] tenants of the deepest matched node, most recently
    /// used first. Empty when `matched_tokens == 0`.
    pub tenants: Vec<TenantId>,
}

/// Page-granular multi-tenant radix tree over token ids (one per model).
///
/// Sizes are in tokens, counted once per tenant holding a node (as [`crate::StringTree`]);
/// the budget `max_tokens` bounds [`total_tokens`](Self::total_tokens) after every insert
/// (overshoot during an insert ≤ that request). Costs and invariants are those of
/// [`crate::StringTree`], with pages for chars, plus: 8. a node that knows the block key of
/// its last page ([`Self::insert_keyed`]) knows the key of its path's pages from its
/// namespace's root ([`crate::keys::block_keys_in`]).
#[derive(Clone, Debug)]
pub struct TokenTree {
    radix: Radix,
    block_size: usize,
}

impl TokenTree {
    /// Empty tree with pages of `block_size` tokens and a budget of `max_tokens` tokens
    /// (rounded down to whole pages).
    ///
    /// # Panics
    /// If `block_size` is 0.
    pub fn new(block_size: usize, max_tokens: usize) -> Self {
        assert!(block_size > 0, "block_size must be > 0");
        Self {
            radix: Radix::new(
                Unit::Page {
                    bytes: block_size * 4,
                },
                max_tokens / block_size,
            ),
            block_size,
        }
    }

    /// Tokens per page.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The whole pages of `tokens`, as bytes.
    fn pages<'a>(&self, tokens: &'a [u32]) -> &'a [u8] {
        let whole = &tokens[..tokens.len() / self.block_size * self.block_size];
        // Safety: `u32` has no padding and every bit pattern is a valid `u8`; the byte slice
        // covers exactly the memory of `whole` and borrows it for the same lifetime.
        unsafe { std::slice::from_raw_parts(whole.as_ptr().cast::<u8>(), whole.len() * 4) }
    }

    /// Records that `tenant` was sent `tokens` in namespace `ns` (whole pages only; a trailing
    /// partial page is ignored), then evicts down to the budget.
    pub fn insert(&mut self, ns: Namespace, tokens: &[u32], tenant: TenantId) {
        let bytes = self.pages(tokens);
        self.radix.insert(ns, bytes, tenant, None);
    }

    /// [`Self::insert`] with `keys`, the block keys of `tokens` in `ns` at this tree's block
    /// size ([`crate::keys::block_keys_in`]; ignored unless there is one per whole page): the
    /// nodes it makes or passes learn the key of their last page, so later keyed walks
    /// ([`Self::match_depths_keyed`], this) compare one key per edge instead of its ids. Keys
    /// that are not those of `tokens` make later answers wrong (as a 64-bit key collision
    /// would: the event index's matching has the same trust in them).
    pub fn insert_keyed(&mut self, ns: Namespace, tokens: &[u32], tenant: TenantId, keys: &[u64]) {
        let bytes = self.pages(tokens);
        let keys = (keys.len() == tokens.len() / self.block_size).then_some(keys);
        self.radix.insert(ns, bytes, tenant, keys);
    }

    /// Longest whole-page prefix of `tokens` in namespace `ns`, and the tenants of the
    /// deepest matched node. Read-only.
    pub fn match_prefix(&self, ns: Namespace, tokens: &[u32]) -> TokenMatch {
        let m = self
            .radix
            .match_prefix(ns, self.pages(tokens), crate::MAX_MATCH_TENANTS);
        TokenMatch {
            matched_tokens: m.units * self.block_size,
            tenants: m.tenants,
        }
    }

    /// Every tenant holding a prefix of `tokens` in namespace `ns`, with the tokens of its
    /// longest one (whole pages), sorted by tenant (see [`crate::StringTree::match_depths`]).
    pub fn match_depths(&self, ns: Namespace, tokens: &[u32]) -> Vec<(TenantId, usize)> {
        let mut d = self.radix.match_depths(ns, self.pages(tokens), None);
        for e in &mut d {
            e.1 *= self.block_size;
        }
        d
    }

    /// [`Self::match_depths`] with the block keys of `tokens` (as [`Self::insert_keyed`]'s;
    /// ignored unless one per whole page): an edge whose last page's key is known matches
    /// when it equals the request's key at that depth, so a walk down a long shared path
    /// reads a key per node instead of the path's ids. Same answer, short of a 64-bit key
    /// collision.
    pub fn match_depths_keyed(
        &self,
        ns: Namespace,
        tokens: &[u32],
        keys: &[u64],
    ) -> Vec<(TenantId, usize)> {
        let keys = (keys.len() == tokens.len() / self.block_size).then_some(keys);
        let mut d = self.radix.match_depths(ns, self.pages(tokens), keys);
        for e in &mut d {
            e.1 *= self.block_size;
        }
        d
    }

    /// Removes `tenant` everywhere (see [`crate::StringTree::remove_tenant`]).
    pub fn remove_tenant(&mut self, tenant: TenantId) {
        self.radix.remove_tenant(tenant);
    }

    /// Evicts LRU (tenant, leaf) pairs until `total_tokens() <= max_tokens`.
    pub fn evict_to(&mut self, max_tokens: usize) {
        self.radix.evict_to(max_tokens / self.block_size);
    }

    /// Tokens attached to `tenant`.
    pub fn tenant_tokens(&self, tenant: TenantId) -> usize {
        self.radix.tenant_units(tenant) * self.block_size
    }

    /// Σ over tenants of [`Self::tenant_tokens`]: what the budget bounds.
    pub fn total_tokens(&self) -> usize {
        self.radix.total_units() * self.block_size
    }

    /// Tokens stored in edges, each node counted once.
    pub fn stored_tokens(&self) -> usize {
        self.radix.stored_units() * self.block_size
    }

    /// Live nodes (root and namespace nodes included).
    pub fn node_count(&self) -> usize {
        self.radix.node_count()
    }

    /// Estimated memory, bytes.
    pub fn memory_bytes(&self) -> usize {
        self.radix.memory_bytes()
    }

    /// Checks the invariants of [`crate::StringTree`] (pages for chars).
    ///
    /// # Errors
    /// [`crate::IndexError::Invariant`] naming the broken invariant.
    #[cfg(any(test, feature = "test-util"))]
    pub fn check_invariants(&self) -> Result<(), crate::IndexError> {
        self.radix.check_invariants()
    }

    /// Whether any node lists `tenant`.
    #[cfg(any(test, feature = "test-util"))]
    pub fn mentions_tenant(&self, tenant: TenantId) -> bool {
        self.radix.mentions_tenant(tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Per-tenant depths in whole pages: tenant 1 holds 3 pages of the query, tenant 2 the
    /// first page only, tenant 3 nothing of it; a partial last page never counts.
    #[test]
    fn match_depths_per_tenant() {
        let mut t = TokenTree::new(4, usize::MAX);
        let q: Vec<u32> = (1..=14).collect();
        t.insert(0, &q[..12], 1);
        t.insert(0, &[1, 2, 3, 4, 90, 91, 92, 93], 2);
        t.insert(0, &[50, 51, 52, 53], 3);
        assert_eq!(t.match_depths(0, &q), vec![(1, 12), (2, 4)]);
        assert_eq!(t.match_depths(0, &q[..3]), vec![]);
        assert_eq!(t.match_depths(1, &q), vec![], "another namespace");
    }

    /// Naive reference: every inserted page sequence kept; LCP in whole pages.
    fn naive(stored: &[(Vec<u32>, TenantId)], q: &[u32], bs: usize) -> (usize, Vec<TenantId>) {
        let pages = |v: &[u32]| v.len() / bs * bs;
        let lcp = |s: &[u32]| {
            let n = s[..pages(s)]
                .iter()
                .zip(&q[..pages(q)])
                .take_while(|(a, b)| a == b)
                .count();
            n / bs * bs
        };
        let best = stored.iter().map(|(s, _)| lcp(s)).max().unwrap_or(0);
        let mut ts: Vec<TenantId> = if best == 0 {
            Vec::new()
        } else {
            stored
                .iter()
                .filter(|(s, _)| lcp(s) >= best)
                .map(|&(_, t)| t)
                .collect()
        };
        ts.sort_unstable();
        ts.dedup();
        (best, ts)
    }

    #[test]
    fn pages_only_and_namespaces() {
        let mut t = TokenTree::new(4, usize::MAX);
        t.insert(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 0); // 2 pages + 1 token
        t.check_invariants().unwrap();
        assert_eq!(t.total_tokens(), 8);
        assert_eq!(t.match_prefix(0, &[1, 2, 3]).matched_tokens, 0);
        assert_eq!(
            t.match_prefix(0, &[1, 2, 3, 4, 5, 6, 7, 0]).matched_tokens,
            4
        );
        assert_eq!(
            t.match_prefix(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 9])
                .matched_tokens,
            8
        );
        assert_eq!(t.match_prefix(1, &[1, 2, 3, 4]).matched_tokens, 0);
        t.insert(1, &[1, 2, 3, 4], 3);
        assert_eq!(t.match_prefix(1, &[1, 2, 3, 4]).tenants, vec![3]);
        assert_eq!(t.match_prefix(0, &[1, 2, 3, 4]).tenants, vec![0]);
    }

    /// Keyed inserts and walks in a namespace: the same depths as the keyless ones, node end
    /// keys checked (invariant 8), and wrong-length keys ignored.
    #[test]
    fn keyed_walks_in_namespaces() {
        let ns = 0xfeed_beef;
        let mut t = TokenTree::new(4, usize::MAX);
        let a: Vec<u32> = (1..=14).collect();
        let b: Vec<u32> = (1..=8).chain(50..60).collect();
        let k = |v: &[u32]| crate::keys::block_keys_in(ns, v, 4);
        t.insert_keyed(ns, &a, 1, &k(&a));
        t.insert(ns, &b, 2);
        t.insert_keyed(ns, &b[..12], 3, &k(&b[..12]));
        t.insert_keyed(ns, &a[..9], 4, &[1, 2, 3]); // wrong length: inserted without keys
        t.check_invariants().unwrap();
        for q in [&a[..], &b[..], &a[..7], &b[..13]] {
            assert_eq!(t.match_depths_keyed(ns, q, &k(q)), t.match_depths(ns, q));
        }
        assert_eq!(
            t.match_depths_keyed(ns, &a, &k(&a)),
            vec![(1, 12), (2, 8), (3, 8), (4, 8)]
        );
        assert_eq!(
            t.match_depths_keyed(0, &a, &crate::keys::block_keys_in(0, &a, 4)),
            vec![]
        );
    }

    /// B15 for tokens: a stream of unique prompts never exceeds budget + one request.
    #[test]
    fn b15_budget_at_every_insert() {
        let mut t = TokenTree::new(16, 10_000);
        for i in 0..2_000u32 {
            let ids: Vec<u32> = (0..(64 + i % 300)).map(|x| x * 7 + i * 100_000).collect();
            t.insert(0, &ids, i % 50);
            assert!(t.total_tokens() <= 10_000);
        }
        t.check_invariants().unwrap();
        assert!(t.total_tokens() > 9_000);
    }

    fn seqs() -> impl Strategy<Value = Vec<u32>> {
        prop_oneof![
            prop::collection::vec(0..3u32, 0..40),
            (0..3u32, 0..40usize).prop_map(|(x, n)| vec![x; n]),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Without eviction: equals the naive page LCP (self-similar input: runs, repeated
        /// pages); with removals: the removed tenant is gone everywhere.
        #[test]
        fn matches_naive(ops in prop::collection::vec((seqs(), 0..6u32, 0..10u8), 1..80)) {
            let bs = 2;
            let mut t = TokenTree::new(bs, usize::MAX);
            let mut stored: Vec<(Vec<u32>, TenantId)> = Vec::new();
            for (s, tenant, kind) in ops {
                let keys = crate::keys::block_keys_in(0, &s, bs);
                // Keyed and keyless walks agree on every tree, whatever made it.
                prop_assert_eq!(t.match_depths_keyed(0, &s, &keys), t.match_depths(0, &s));
                match kind {
                    0..=1 => {
                        t.insert(0, &s, tenant);
                        stored.push((s, tenant));
                    }
                    2..=4 => {
                        t.insert_keyed(0, &s, tenant, &keys);
                        stored.push((s, tenant));
                    }
                    5 => {
                        t.remove_tenant(tenant);
                        stored.retain(|&(_, x)| x != tenant);
                        prop_assert!(!t.mentions_tenant(tenant));
                    }
                    _ => {
                        let got = t.match_prefix(0, &s);
                        let (want, ts) = naive(&stored, &s, bs);
                        prop_assert_eq!(got.matched_tokens, want);
                        let mut g = got.tenants.clone();
                        g.sort_unstable();
                        prop_assert_eq!(g.len(), ts.len().min(crate::MAX_MATCH_TENANTS));
                        prop_assert!(g.iter().all(|x| ts.contains(x)));
                    }
                }
                prop_assert_eq!(t.check_invariants(), Ok(()));
            }
        }

        /// With a budget: never over budget after an insert, answers stay sound.
        #[test]
        fn budget_is_sound(ops in prop::collection::vec((seqs(), 0..6u32), 1..80), budget in 0..60usize) {
            let bs = 2;
            let mut t = TokenTree::new(bs, budget);
            let mut stored: Vec<(Vec<u32>, TenantId)> = Vec::new();
            for (s, tenant) in ops {
                if tenant % 2 == 0 {
                    t.insert_keyed(0, &s, tenant, &crate::keys::block_keys_in(0, &s, bs));
                } else {
                    t.insert(0, &s, tenant);
                }
                stored.push((s.clone(), tenant));
                prop_assert!(t.total_tokens() <= budget / bs * bs);
                prop_assert_eq!(t.check_invariants(), Ok(()));
                let got = t.match_prefix(0, &s);
                prop_assert!(got.matched_tokens <= naive(&stored, &s, bs).0);
            }
        }
    }
}
