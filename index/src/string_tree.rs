//! Approximate multi-tenant radix tree over the characters of routing text.
//!
//! The tree records what the router *sent* to each worker (tenant), not what the engine
//! holds, so a hit is a prediction. Shape and semantics follow SMG's string tree
//! (`smg` v1.9 `kv-index`, anchors §2.4): children keyed by first char, sizes in chars
//! (never bytes), one LRU clock that counts inserts (not wall time), size = Σ over tenants of
//! the chars attached to them. Unlike SMG, the budget is enforced inside every insert and
//! eviction costs O(log n) per evicted (tenant, leaf) pair, never a walk of the whole tree.

use crate::radix::{Radix, Unit};
use crate::{Namespace, TenantId};

/// Most tenants [`StringTree::match_prefix`] returns (the most recently used first).
/// Source: SMG `cache_aware` takes at most 8 candidates from the deepest matched node
/// (anchors §2.2 step 3).
pub const MAX_MATCH_TENANTS: usize = 8;

/// Result of [`StringTree::match_prefix`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Length of the longest prefix of the query present in the tree, in chars (Unicode
    /// scalar values, not bytes and not graphemes).
    pub matched_chars: usize,
    /// Up to [`MAX_MATCH_TENANTS`] tenants holding the deepest matched node, most recently
    /// used first. Empty when `matched_chars == 0`.
    pub tenants: Vec<TenantId>,
}

/// Approximate, multi-tenant radix tree over the chars of routing text (one per model).
///
/// Every call takes a [`Namespace`] (cache partition); texts of different namespaces live
/// under different namespace nodes and never match each other.
///
/// Sizes are in chars. `total_chars()` counts a node once per tenant holding it (SMG's
/// budget rule, anchors §2.4: a node shared by 3 tenants counts 3×); `stored_chars()` counts
/// each node once (memory). The budget `max_chars` bounds `total_chars()` after every
/// [`insert`](Self::insert): while an insert runs the tree can exceed it by at most that
/// request's chars (bug-cases B15).
///
/// Costs: `match_prefix` is O(len(text) + depth × log(children)); `insert` is the same plus
/// O(1) amortized for the LRU queue (O(log n) when it was not the newest entry) plus
/// O(log n) per evicted pair; `remove_tenant` is O(nodes the tenant holds × log n).
///
/// # Invariants
/// 1. The root has an empty edge, no parent and no tenants; its children are namespace nodes
///    (empty edge, keyed by the namespace hash); every deeper node has a non-empty edge cut at
///    char boundaries, a live parent that lists it under the digest of its first char, and a
///    cached unit count equal to a recount.
/// 2. Children of a node have distinct keys, sorted; tenants of a node are distinct, sorted.
/// 3. Every live non-root node has at least one tenant (emptied nodes are freed).
/// 4. A child's tenants are a subset of its parent's (root excepted), and each such tenant's
///    clock on the child is ≤ its clock on the parent.
/// 5. `tenant_chars[t]` = Σ edge chars over nodes listing `t`; `total_chars` = Σ over tenants;
///    `stored_chars` = Σ edge chars over live nodes.
/// 6. Every node is reachable from the root exactly once and `node_count` counts them.
/// 7. Each (node, tenant) records how many children list the tenant; the live entries of the
///    LRU queue are exactly the (clock, tenant, node) triples whose count is 0 (the eviction
///    candidates), and the queue, stale entries included, is within its compaction bound.
#[derive(Clone, Debug)]
pub struct StringTree {
    radix: Radix,
}

impl Default for StringTree {
    fn default() -> Self {
        Self::new()
    }
}

impl StringTree {
    /// Empty tree without a budget: the root only, every size 0.
    pub fn new() -> Self {
        Self::with_max_chars(usize::MAX)
    }

    /// Empty tree whose [`total_chars`](Self::total_chars) is kept ≤ `max_chars` after every
    /// insert (`--max-tree-size`, default `core::config::defaults::MAX_TREE_SIZE_CHARS`).
    pub fn with_max_chars(max_chars: usize) -> Self {
        Self {
            radix: Radix::new(Unit::Char, max_chars),
        }
    }

    /// Records that `tenant` was sent `text` in namespace `ns`: every node on the path lists
    /// `tenant` with the current LRU clock (one tick per call). Splits an edge where `text`
    /// diverges from it or ends inside it, always at a char boundary. Then evicts
    /// least-recently-used (tenant, leaf) pairs until the budget holds. Empty `text` only ticks
    /// the clock.
    ///
    /// # Panics
    /// If `text` is 2^32 chars or longer, or the tree would exceed 2^32 nodes.
    pub fn insert(&mut self, ns: Namespace, text: &str, tenant: TenantId) {
        self.radix.insert(ns, text.as_bytes(), tenant, None);
    }

    /// Longest prefix of `text` in namespace `ns` and up to [`MAX_MATCH_TENANTS`] tenants of
    /// the deepest matched node (most recent first). Read-only: a match does not refresh the
    /// LRU clock.
    pub fn match_prefix(&self, ns: Namespace, text: &str) -> PrefixMatch {
        let m = self
            .radix
            .match_prefix(ns, text.as_bytes(), MAX_MATCH_TENANTS);
        PrefixMatch {
            matched_chars: m.units,
            tenants: m.tenants,
        }
    }

    /// Every tenant holding a prefix of `text` in namespace `ns`, with the chars of its
    /// longest one, sorted by tenant; tenants holding none are absent. Unlike
    /// [`Self::match_prefix`] this sees the tenants of shallower nodes too (a spill target
    /// that holds the shared system prompt, bug-cases.md B11).
    pub fn match_depths(&self, ns: Namespace, text: &str) -> Vec<(TenantId, usize)> {
        self.radix.match_depths(ns, text.as_bytes(), None)
    }

    /// Removes `tenant` from every node of every namespace, frees nodes left without tenants,
    /// merges a node into its only child when both then hold the same tenants (so churn does
    /// not leave split chains behind, bug B17), and zeroes the tenant's size. Unknown tenant:
    /// no-op.
    pub fn remove_tenant(&mut self, tenant: TenantId) {
        self.radix.remove_tenant(tenant);
    }

    /// Evicts least-recently-inserted (tenant, leaf) pairs until `total_chars() <=
    /// max_chars`. A tenant's leaf is a node listing the tenant with no child listing it;
    /// removing the pair detaches the tenant there, frees the node when no tenant is left, and
    /// may make the parent the tenant's next leaf. Ties on the clock break by tenant id then
    /// node id. Cost O(log n) per evicted pair. `insert` calls this with the tree's budget.
    pub fn evict_to(&mut self, max_chars: usize) {
        self.radix.evict_to(max_chars);
    }

    /// Chars attached to `tenant`: Σ edge chars over nodes listing it. 0 for an unknown
    /// tenant.
    pub fn tenant_chars(&self, tenant: TenantId) -> usize {
        self.radix.tenant_units(tenant)
    }

    /// Σ over tenants of [`Self::tenant_chars`], in chars: the size the budget bounds (SMG,
    /// anchors §2.4).
    pub fn total_chars(&self) -> usize {
        self.radix.total_units()
    }

    /// The budget on [`Self::total_chars`], chars (`usize::MAX` = none).
    pub fn max_chars(&self) -> usize {
        self.radix.max_units()
    }

    /// Chars stored in edges, each node counted once (memory, not budget).
    pub fn stored_chars(&self) -> usize {
        self.radix.stored_units()
    }

    /// Live nodes: the root, one per namespace in use, and the edge nodes (an empty tree
    /// has 1).
    pub fn node_count(&self) -> usize {
        self.radix.node_count()
    }

    /// (tenant, leaf) pairs evicted since creation (a gauge for eviction cost per leaf).
    pub fn evicted_pairs(&self) -> u64 {
        self.radix.evicted_pairs()
    }

    /// Estimated memory of the tree, bytes: arena, edges, child and tenant lists, LRU queue.
    pub fn memory_bytes(&self) -> usize {
        self.radix.memory_bytes()
    }

    /// Checks invariants 1–7 of [`StringTree`], naming the first broken one.
    ///
    /// # Errors
    /// [`crate::IndexError::Invariant`] with the invariant's number and the offending node.
    #[cfg(any(test, feature = "test-util"))]
    pub fn check_invariants(&self) -> Result<(), crate::IndexError> {
        self.radix.check_invariants()
    }

    /// Whether any live node (or LRU entry) lists `tenant` (tests: removal leaves no trace).
    #[cfg(any(test, feature = "test-util"))]
    pub fn mentions_tenant(&self, tenant: TenantId) -> bool {
        self.radix.mentions_tenant(tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{ReferenceMatch, ReferenceStringIndex};
    use proptest::prelude::*;

    /// The namespace of every test that is not about namespaces.
    const NS: u64 = 0;

    fn check(t: &StringTree) {
        if let Err(e) = t.check_invariants() {
            panic!("{e}");
        }
    }

    /// Compares one answer of the tree with the reference: `Err` names the mismatch.
    fn compare(got: &PrefixMatch, want: &ReferenceMatch) -> Result<(), String> {
        if got.matched_chars != want.matched_chars {
            return Err(format!(
                "matched_chars {} != reference {}",
                got.matched_chars, want.matched_chars
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for t in &got.tenants {
            if !want.tenants.contains(t) || !seen.insert(*t) {
                return Err(format!("tenant {t} not in {:?} or repeated", want.tenants));
            }
        }
        if got.tenants.len() != want.tenants.len().min(MAX_MATCH_TENANTS) {
            return Err(format!(
                "{} tenants, want min(8, {})",
                got.tenants.len(),
                want.tenants.len()
            ));
        }
        Ok(())
    }

    #[test]
    fn worked_example_two_tenants_share_a_prefix() {
        let mut t = StringTree::new();
        t.insert(NS, "hello world", 0);
        t.insert(NS, "hello there", 1);
        check(&t);
        // root, namespace node, "hello ", "world", "there"
        assert_eq!(t.node_count(), 5);
        assert_eq!(t.tenant_chars(0), 11);
        assert_eq!(t.tenant_chars(1), 11);
        assert_eq!(t.total_chars(), 22);
        assert_eq!(t.stored_chars(), 16);
        let m = t.match_prefix(NS, "hello wor");
        assert_eq!(m.matched_chars, 9);
        assert_eq!(m.tenants, vec![0]);
        // Both hold "hello "; tenant 1 inserted last, so it comes first.
        let m = t.match_prefix(NS, "hello");
        assert_eq!(m.matched_chars, 5);
        assert_eq!(m.tenants, vec![1, 0]);
        let m = t.match_prefix(NS, "hello worldwide");
        assert_eq!((m.matched_chars, m.tenants), (11, vec![0]));
        assert_eq!(t.match_prefix(NS, "x"), PrefixMatch::default());
        assert_eq!(t.match_prefix(NS, ""), PrefixMatch::default());
    }

    #[test]
    fn text_ending_inside_an_edge_splits_it() {
        let mut t = StringTree::new();
        t.insert(NS, "abcdef", 0);
        t.insert(NS, "abc", 1);
        check(&t);
        assert_eq!(t.node_count(), 4);
        assert_eq!(t.match_prefix(NS, "abcx").tenants, vec![1, 0]);
        assert_eq!(t.match_prefix(NS, "abcd").tenants, vec![0]);
        assert_eq!(t.tenant_chars(1), 3);
        assert_eq!(t.total_chars(), 9);
    }

    #[test]
    fn emoji_sharing_leading_bytes_split_at_char_boundaries() {
        // U+1F600 and U+1F601 share their first 3 UTF-8 bytes.
        let mut t = StringTree::new();
        t.insert(NS, "😀👍🏽", 0);
        t.insert(NS, "😀😁", 1);
        check(&t);
        assert_eq!(t.match_prefix(NS, "😀😂").matched_chars, 1);
        assert_eq!(t.match_prefix(NS, "😀😂").tenants, vec![1, 0]);
        // 👍🏽 is two chars: thumbs up + skin tone modifier.
        assert_eq!(t.match_prefix(NS, "😀👍🏿").matched_chars, 2);
        assert_eq!(t.match_prefix(NS, "😀👍🏽!").matched_chars, 3);
        assert_eq!(t.tenant_chars(0), 3);
        assert_eq!(t.tenant_chars(1), 2);
    }

    #[test]
    fn combining_marks_count_as_chars() {
        let mut t = StringTree::new();
        t.insert(NS, "e\u{301}x", 0);
        check(&t);
        assert_eq!(t.match_prefix(NS, "e\u{300}").matched_chars, 1);
        assert_eq!(t.match_prefix(NS, "e\u{301}").matched_chars, 2);
        assert_eq!(t.match_prefix(NS, "é").matched_chars, 0); // precomposed U+00E9
    }

    #[test]
    fn cjk_and_runs_of_one_char() {
        let mut t = StringTree::new();
        let long = "中".repeat(100);
        t.insert(NS, &long, 0);
        t.insert(NS, &"中".repeat(40), 1);
        t.insert(NS, &format!("{}文", "中".repeat(70)), 2);
        check(&t);
        assert_eq!(t.match_prefix(NS, &"中".repeat(200)).matched_chars, 100);
        assert_eq!(t.match_prefix(NS, &"中".repeat(200)).tenants, vec![0]);
        assert_eq!(t.match_prefix(NS, &"中".repeat(50)).tenants, vec![2, 0]);
        assert_eq!(t.match_prefix(NS, &"中".repeat(30)).tenants, vec![2, 1, 0]);
        assert_eq!(t.tenant_chars(2), 71);
    }

    #[test]
    fn at_most_eight_most_recent_tenants() {
        let mut t = StringTree::new();
        for tenant in 0..20 {
            t.insert(NS, "shared prefix", tenant);
        }
        t.insert(NS, "shared prefix", 3); // 3 becomes the most recent
        check(&t);
        let m = t.match_prefix(NS, "shared prefix and more");
        assert_eq!(m.matched_chars, 13);
        assert_eq!(m.tenants, vec![3, 19, 18, 17, 16, 15, 14, 13]);
    }

    #[test]
    fn remove_tenant_purges_frees_and_merges() {
        let mut t = StringTree::new();
        t.insert(NS, "abcdef", 0);
        t.insert(NS, "abcxyz", 1);
        t.insert(NS, "qqq", 1);
        assert_eq!(t.node_count(), 6);
        t.remove_tenant(1);
        check(&t);
        assert!(!t.mentions_tenant(1));
        assert_eq!(t.tenant_chars(1), 0);
        assert_eq!(t.total_chars(), 6);
        // "abc" + "def" merged back into one edge.
        assert_eq!(t.node_count(), 3);
        assert_eq!(t.match_prefix(NS, "abcdefg").matched_chars, 6);
        assert_eq!(t.match_prefix(NS, "qqq").matched_chars, 0);
        t.remove_tenant(0);
        t.remove_tenant(7); // unknown: no-op
        check(&t);
        assert_eq!(
            (t.node_count(), t.total_chars(), t.stored_chars()),
            (1, 0, 0)
        );
    }

    /// The eviction queue's lazy deletion over a long run of re-inserts (each leaves a stale
    /// entry), removals and evictions: after every op the live entries are exactly the
    /// (tenant, leaf) pairs with their clocks and the queue is within its bound
    /// (`check_invariants`, invariant 7), the queue was compacted on the way, and an
    /// eviction of one pair at a time takes the least recent pair of a brute-force scan.
    #[test]
    fn leaf_queue_stays_exact_through_compactions() {
        let mut t = StringTree::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (mut shrank, mut before) = (false, 0);
        for step in 0..6_000u32 {
            let text = format!("sys-{}|q{}", next(3), next(40));
            match next(100) {
                0 => t.remove_tenant(next(6) as TenantId),
                1..=2 => {
                    let want = t.radix.least_recent_leaf();
                    t.evict_to(t.total_chars().saturating_sub(1));
                    if let Some((_, tenant, id)) = want {
                        assert!(!t.radix.lists(id, tenant), "step {step}: LRU pair kept");
                    }
                }
                _ => t.insert(NS, &text, next(6) as TenantId),
            }
            let queued = t.radix.queued_leaves();
            shrank |= queued < before;
            before = queued;
            if step % 20 == 0 {
                check(&t);
            }
        }
        check(&t);
        assert!(shrank, "never compacted");
    }

    /// B12 (smg-project/smg PR #2132) and B17 (ai-dynamo/dynamo issue #10774): worker churn
    /// under one shared prefix returns the tree to its baseline node count.
    #[test]
    fn b12_b17_churn_returns_to_baseline() {
        let mut t = StringTree::new();
        t.insert(NS, "<|system|>you are helpful<|user|>hi", 0);
        let baseline = (t.node_count(), t.total_chars(), t.stored_chars());
        for cycle in 0..1000u32 {
            let w = 1 + cycle % 7;
            t.insert(NS, &format!("<|system|>you are helpful<|user|>q{cycle}"), w);
            t.insert(NS, &format!("<|system|>you are{cycle}"), w);
            t.remove_tenant(w);
        }
        check(&t);
        assert_eq!(
            (t.node_count(), t.total_chars(), t.stored_chars()),
            baseline
        );
    }

    #[test]
    fn evict_least_recent_pair_first() {
        let mut t = StringTree::new();
        t.insert(NS, "aaaa", 0); // clock 1
        t.insert(NS, "bbbb", 1); // clock 2
        t.insert(NS, "cccc", 0); // clock 3
        t.evict_to(8);
        check(&t);
        assert_eq!(t.total_chars(), 8);
        assert_eq!(t.match_prefix(NS, "aaaa").matched_chars, 0);
        assert_eq!(t.match_prefix(NS, "bbbb").matched_chars, 4);
        t.evict_to(4);
        check(&t);
        assert_eq!(t.match_prefix(NS, "bbbb").matched_chars, 0);
        assert_eq!(t.match_prefix(NS, "cccc").tenants, vec![0]);
        assert_eq!(t.node_count(), 3);
    }

    #[test]
    fn evict_detaches_tenant_leaf_before_shared_parent() {
        let mut t = StringTree::new();
        t.insert(NS, "abcd", 0);
        t.insert(NS, "abxy", 1);
        assert_eq!(t.total_chars(), 8);
        t.evict_to(6); // drops tenant 0's leaf "cd" (oldest), keeps "ab" for both
        check(&t);
        assert_eq!(t.total_chars(), 6);
        let m = t.match_prefix(NS, "abcd");
        assert_eq!((m.matched_chars, m.tenants), (2, vec![1, 0]));
        t.evict_to(3); // then tenant 0's "ab" (clock 1), then stop at 4 → tenant 1's "xy"
        check(&t);
        assert_eq!(t.total_chars(), 2);
        assert_eq!(t.tenant_chars(0), 0);
        assert_eq!(t.match_prefix(NS, "abxy").matched_chars, 2);
        t.evict_to(0);
        check(&t);
        assert_eq!((t.node_count(), t.total_chars()), (1, 0));
    }

    /// B13 (smg-project/smg PR #2137): the budget bounds the total, not each tenant.
    #[test]
    fn b13_budget_is_total_over_tenants() {
        let mut t = StringTree::new();
        let budget = 5_000;
        for i in 0..2_000u32 {
            t.insert(
                NS,
                &format!("prompt {i} {}", "x".repeat((i % 50) as usize)),
                i % 100,
            );
            t.evict_to(budget);
            assert!(t.total_chars() <= budget);
        }
        check(&t);
        assert!(t.total_chars() > budget - 100, "evicts only what it must");
    }

    #[test]
    fn harness_self_test_detects_a_broken_answer() {
        let mut r = ReferenceStringIndex::new();
        r.insert("abc", 0);
        r.insert("abd", 1);
        let want = r.match_prefix("abz");
        let good = PrefixMatch {
            matched_chars: 2,
            tenants: vec![1, 0],
        };
        assert_eq!(compare(&good, &want), Ok(()));
        let off_by_one = PrefixMatch {
            matched_chars: 3,
            ..good.clone()
        };
        assert!(compare(&off_by_one, &want).is_err());
        let stranger = PrefixMatch {
            matched_chars: 2,
            tenants: vec![1, 2],
        };
        assert!(compare(&stranger, &want).is_err());
        let too_few = PrefixMatch {
            matched_chars: 2,
            tenants: vec![1],
        };
        assert!(compare(&too_few, &want).is_err());
        let repeated = PrefixMatch {
            matched_chars: 2,
            tenants: vec![1, 1],
        };
        assert!(compare(&repeated, &want).is_err());
    }

    const ATOMS: &[&str] = &[
        "a", "b", "é", "e\u{301}", "\u{301}", "😀", "😁", "👍🏽", "👍", "中", "文", "ß", " ",
    ];

    fn atom_text(max: usize) -> impl Strategy<Value = String> {
        prop_oneof![
            3 => prop::collection::vec(0..ATOMS.len(), 0..max)
                .prop_map(|v| v.into_iter().map(|i| ATOMS[i]).collect::<String>()),
            1 => (0..ATOMS.len(), 0..max * 2).prop_map(|(i, n)| ATOMS[i].repeat(n)),
        ]
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(usize, usize, String, TenantId),
        Match(usize, usize, String),
        Remove(TenantId),
        Evict(usize),
    }

    /// Text = first `cut` chars of base `b`, then `suffix`: shared prefixes of any depth.
    fn build(bases: &[String], b: usize, cut: usize, suffix: &str) -> String {
        let base = &bases[b % bases.len()];
        let mut s: String = base.chars().take(cut).collect();
        s.push_str(suffix);
        s
    }

    fn ops(evict: bool) -> impl Strategy<Value = (Vec<String>, Vec<Op>)> {
        let op = prop_oneof![
            6 => (0..4usize, 0..40usize, atom_text(6), 0..24u32)
                .prop_map(|(b, c, s, t)| Op::Insert(b, c, s, t)),
            4 => (0..4usize, 0..40usize, atom_text(6)).prop_map(|(b, c, s)| Op::Match(b, c, s)),
            1 => (0..24u32).prop_map(Op::Remove),
            (if evict { 2 } else { 0 }) => (0..200usize).prop_map(Op::Evict),
        ];
        (
            prop::collection::vec(atom_text(30), 4),
            prop::collection::vec(op, 1..120),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Without eviction the tree answers exactly like the brute-force reference.
        #[test]
        fn matches_reference((bases, ops) in ops(false)) {
            let mut tree = StringTree::new();
            let mut reference = ReferenceStringIndex::new();
            let mut mismatches = [0usize; 2]; // [match, size]
            for op in &ops {
                match op {
                    Op::Insert(b, c, s, t) => {
                        let text = build(&bases, *b, *c, s);
                        tree.insert(NS, &text, *t);
                        reference.insert(&text, *t);
                    }
                    Op::Match(b, c, s) => {
                        let text = build(&bases, *b, *c, s);
                        let got = tree.match_prefix(NS, &text);
                        if let Err(e) = compare(&got, &reference.match_prefix(&text)) {
                            mismatches[0] += 1;
                            prop_assert!(false, "query {text:?}: {e}");
                        }
                        prop_assert_eq!(
                            tree.match_depths(NS, &text),
                            reference.match_depths(&text),
                            "depths of {:?}", text
                        );
                    }
                    Op::Remove(t) => {
                        tree.remove_tenant(*t);
                        reference.remove_tenant(*t);
                        prop_assert!(!tree.mentions_tenant(*t));
                        prop_assert_eq!(tree.tenant_chars(*t), 0);
                    }
                    Op::Evict(_) => unreachable!(),
                }
                prop_assert_eq!(tree.check_invariants(), Ok(()));
            }
            for t in 0..24 {
                if tree.tenant_chars(t) != reference.tenant_chars(t) {
                    mismatches[1] += 1;
                }
            }
            prop_assert_eq!(mismatches, [0, 0]);
            // Every stored text's own prefixes still match in full.
            for b in 0..4 {
                for c in [0, 5, 40] {
                    let text = build(&bases, b, c, "");
                    let got = tree.match_prefix(NS, &text);
                    prop_assert_eq!(compare(&got, &reference.match_prefix(&text)), Ok(()));
                }
            }
        }

        /// With eviction the tree stays within budget and its answers stay sound: never a
        /// longer match than the reference, and only tenants that really sent that prefix.
        #[test]
        fn eviction_stays_sound((bases, ops) in ops(true)) {
            let mut tree = StringTree::new();
            let mut reference = ReferenceStringIndex::new();
            for op in &ops {
                match op {
                    Op::Insert(b, c, s, t) => {
                        let text = build(&bases, *b, *c, s);
                        tree.insert(NS, &text, *t);
                        reference.insert(&text, *t);
                    }
                    Op::Match(b, c, s) => {
                        let text = build(&bases, *b, *c, s);
                        let got = tree.match_prefix(NS, &text);
                        let q: Vec<char> = text.chars().collect();
                        let want = reference.match_chars(&q);
                        prop_assert!(got.matched_chars <= want.matched_chars);
                        if got.matched_chars > 0 {
                            let holders = reference.match_chars(&q[..got.matched_chars]).tenants;
                            prop_assert!(!got.tenants.is_empty());
                            prop_assert!(got.tenants.iter().all(|t| holders.contains(t)));
                        } else {
                            prop_assert!(got.tenants.is_empty());
                        }
                    }
                    Op::Remove(t) => {
                        tree.remove_tenant(*t);
                        reference.remove_tenant(*t);
                        prop_assert!(!tree.mentions_tenant(*t));
                    }
                    Op::Evict(max) => {
                        let before = tree.total_chars();
                        tree.evict_to(*max);
                        prop_assert!(tree.total_chars() <= *max);
                        if before <= *max {
                            prop_assert_eq!(tree.total_chars(), before);
                        }
                    }
                }
                prop_assert_eq!(tree.check_invariants(), Ok(()));
            }
        }
    }
}
