//! Approximate multi-tenant radix tree over the characters of routing text.
//!
//! The tree records what the router *sent* to each worker (tenant), not what the engine
//! holds, so a hit is a prediction. Shape and semantics follow SMG's string tree
//! (`smg` v1.9 `kv-index`, anchors §2.4): children keyed by first char, sizes in chars
//! (never bytes), one LRU clock that counts inserts (not wall time), size = Σ over tenants of
//! the chars attached to them.

use crate::TenantId;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Most tenants [`StringTree::match_prefix`] returns (the most recently used first).
/// Source: SMG `cache_aware` takes at most 8 candidates from the deepest matched node
/// (anchors §2.2 step 3).
pub const MAX_MATCH_TENANTS: usize = 8;

/// Index of a node in the arena. `ROOT` is never freed.
type NodeId = u32;
const ROOT: NodeId = 0;
const NO_PARENT: NodeId = NodeId::MAX;

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

/// One radix node: an edge label plus the tenants whose inserted texts cover the whole edge.
#[derive(Debug)]
struct Node {
    /// Edge label from the parent (empty only for the root). Always non-empty UTF-8 and
    /// split only at char boundaries.
    edge: Box<str>,
    /// `edge.chars().count()`, cached so full-edge matches never recount.
    edge_chars: u32,
    parent: NodeId,
    /// `(first char of child edge, child)`, sorted by char.
    children: Vec<(char, NodeId)>,
    /// `(tenant, last insert clock)`, sorted by tenant.
    tenants: Vec<(TenantId, u64)>,
}

impl Node {
    fn tenant_pos(&self, tenant: TenantId) -> Result<usize, usize> {
        self.tenants.binary_search_by_key(&tenant, |&(t, _)| t)
    }

    fn child(&self, first: char) -> Option<NodeId> {
        let c = &self.children;
        if c.len() <= 8 {
            c.iter().find(|&&(k, _)| k == first).map(|&(_, id)| id)
        } else {
            c.binary_search_by_key(&first, |&(k, _)| k)
                .ok()
                .map(|i| c[i].1)
        }
    }
}

/// Approximate, multi-tenant radix tree over the chars of routing text (one per model).
///
/// Sizes are in chars. `total_chars()` counts a node once per tenant holding it (SMG's
/// budget rule, anchors §2.4: a node shared by 3 tenants counts 3×); `stored_chars()` counts
/// each node once (memory).
///
/// Costs: `match_prefix` and `insert` are O(len(text) + depth × log(children) + depth ×
/// log(tenants per node)); `remove_tenant` is O(nodes the tenant holds); `evict_to` rebuilds
/// a heap over all (tenant, leaf) pairs, O(nodes × tenants per node) per call (SMG's
/// simple scheme; to be made O(evicted)).
///
/// # Invariants
/// 1. The root has an empty edge, no parent and no tenants; every other live node has a
///    non-empty edge, a live parent that lists it under the edge's first char, and
///    `edge_chars == edge.chars().count()`.
/// 2. Children of a node have distinct first chars, sorted; tenants of a node are distinct,
///    sorted.
/// 3. Every live non-root node has at least one tenant (emptied nodes are freed).
/// 4. A child's tenants are a subset of its parent's (root excepted), and each such
///    tenant's clock on the child is ≤ its clock on the parent.
/// 5. `tenant_chars[t]` = Σ `edge_chars` over nodes listing `t`; `total_chars` = Σ over
///    tenants; `stored_chars` = Σ `edge_chars` over live nodes.
/// 6. `live_nodes` = number of reachable nodes (root included) = arena length − free list
///    length, and every node is reachable from the root exactly once.
#[derive(Debug)]
pub struct StringTree {
    nodes: Vec<Option<Node>>,
    free: Vec<NodeId>,
    live_nodes: usize,
    /// Chars attached per tenant, indexed by tenant id (dense worker ids).
    tenant_chars: Vec<usize>,
    total_chars: usize,
    stored_chars: usize,
    /// LRU clock: incremented once per `insert`.
    clock: u64,
}

impl Default for StringTree {
    fn default() -> Self {
        Self::new()
    }
}

impl StringTree {
    /// Empty tree: the root only, every size 0.
    pub fn new() -> Self {
        let root = Node {
            edge: Box::from(""),
            edge_chars: 0,
            parent: NO_PARENT,
            children: Vec::new(),
            tenants: Vec::new(),
        };
        Self {
            nodes: vec![Some(root)],
            free: Vec::new(),
            live_nodes: 1,
            tenant_chars: Vec::new(),
            total_chars: 0,
            stored_chars: 0,
            clock: 0,
        }
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id as usize].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id as usize].as_mut().expect("live node")
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        self.live_nodes += 1;
        self.stored_chars += node.edge_chars as usize;
        if let Some(id) = self.free.pop() {
            self.nodes[id as usize] = Some(node);
            id
        } else {
            let id = NodeId::try_from(self.nodes.len()).expect("fewer than 2^32 nodes");
            self.nodes.push(Some(node));
            id
        }
    }

    fn release(&mut self, id: NodeId) {
        let node = self.nodes[id as usize].take().expect("live node");
        self.stored_chars -= node.edge_chars as usize;
        self.live_nodes -= 1;
        self.free.push(id);
    }

    fn add_tenant_chars(&mut self, tenant: TenantId, chars: usize) {
        let t = tenant as usize;
        if self.tenant_chars.len() <= t {
            self.tenant_chars.resize(t + 1, 0);
        }
        self.tenant_chars[t] += chars;
        self.total_chars += chars;
    }

    fn sub_tenant_chars(&mut self, tenant: TenantId, chars: usize) {
        self.tenant_chars[tenant as usize] -= chars;
        self.total_chars -= chars;
    }

    /// Lists `tenant` on `id` with clock `now`, counting its chars if new.
    fn touch(&mut self, id: NodeId, tenant: TenantId, now: u64) {
        let node = self.node_mut(id);
        match node.tenant_pos(tenant) {
            Ok(i) => node.tenants[i].1 = now,
            Err(i) => {
                node.tenants.insert(i, (tenant, now));
                let chars = node.edge_chars as usize;
                self.add_tenant_chars(tenant, chars);
            }
        }
    }

    /// Splits `child`'s edge after `at_bytes` bytes (a char boundary strictly inside the
    /// edge): a new node takes the head of the edge and the child's tenants, and becomes the
    /// child's parent. Per-tenant sizes do not change. Returns the new node.
    fn split(&mut self, child: NodeId, at_bytes: usize) -> NodeId {
        let (parent, head, head_chars, tail, tail_chars, first, tenants) = {
            let c = self.node(child);
            let head = &c.edge[..at_bytes];
            let head_chars = head.chars().count() as u32;
            (
                c.parent,
                Box::<str>::from(head),
                head_chars,
                Box::<str>::from(&c.edge[at_bytes..]),
                c.edge_chars - head_chars,
                c.edge[at_bytes..].chars().next().expect("tail non-empty"),
                c.tenants.clone(),
            )
        };
        let head_first = head.chars().next().expect("head non-empty");
        let mid = self.alloc(Node {
            edge: head,
            edge_chars: head_chars,
            parent,
            children: vec![(first, child)],
            tenants,
        });
        // `alloc` counted the head's chars; the child's edge shrinks by as many.
        self.stored_chars -= head_chars as usize;
        {
            let c = self.node_mut(child);
            c.edge = tail;
            c.edge_chars = tail_chars;
            c.parent = mid;
        }
        let p = self.node_mut(parent);
        let slot = p
            .children
            .binary_search_by_key(&head_first, |&(k, _)| k)
            .expect("parent lists child");
        p.children[slot].1 = mid;
        mid
    }

    fn add_child(&mut self, parent: NodeId, edge: &str, tenant: TenantId, now: u64) {
        let first = edge.chars().next().expect("edge non-empty");
        let chars = edge.chars().count();
        let id = self.alloc(Node {
            edge: Box::from(edge),
            edge_chars: u32::try_from(chars).expect("edge shorter than 2^32 chars"),
            parent,
            children: Vec::new(),
            tenants: vec![(tenant, now)],
        });
        self.add_tenant_chars(tenant, chars);
        let p = self.node_mut(parent);
        let slot = p
            .children
            .binary_search_by_key(&first, |&(k, _)| k)
            .expect_err("no child with this first char");
        p.children.insert(slot, (first, id));
    }

    /// Records that `tenant` was sent `text`: every node on the path of `text` lists
    /// `tenant` with the current LRU clock (one tick per call). Splits an edge where `text`
    /// diverges from it or ends inside it, always at a char boundary. Empty `text` only ticks
    /// the clock.
    ///
    /// # Panics
    /// If `text` is 2^32 chars or longer, or the tree would exceed 2^32 nodes.
    pub fn insert(&mut self, text: &str, tenant: TenantId) {
        self.clock += 1;
        let now = self.clock;
        let mut cur = ROOT;
        let mut rest = text;
        while let Some(first) = rest.chars().next() {
            let Some(child) = self.node(cur).child(first) else {
                self.add_child(cur, rest, tenant, now);
                return;
            };
            let edge = &self.node(child).edge;
            let common = common_prefix_chars_boundary(edge.as_bytes(), rest.as_bytes());
            let edge_len = edge.len();
            let next = if common == edge_len {
                child
            } else {
                self.split(child, common)
            };
            self.touch(next, tenant, now);
            rest = &rest[common..];
            cur = next;
        }
    }

    /// Longest prefix of `text` present in the tree, in chars, and up to
    /// [`MAX_MATCH_TENANTS`] tenants (most recently used first) of the deepest matched node:
    /// the node whose path covers the matched prefix; a partially matched edge counts as its
    /// child node. Read-only: does not touch the LRU clock (SMG refreshes 1 match in 8; here
    /// the router's insert after each decision refreshes the path).
    pub fn match_prefix(&self, text: &str) -> PrefixMatch {
        let mut cur = ROOT;
        let mut rest = text.as_bytes();
        let mut matched_chars = 0usize;
        let mut deepest = ROOT;
        while !rest.is_empty() {
            // `rest` always starts at a char boundary of `text`.
            let first = first_char(rest);
            let Some(child) = self.node(cur).child(first) else {
                break;
            };
            let node = self.node(child);
            let edge = node.edge.as_bytes();
            deepest = child;
            if rest.len() >= edge.len() && rest[..edge.len()] == *edge {
                matched_chars += node.edge_chars as usize;
                rest = &rest[edge.len()..];
                cur = child;
                continue;
            }
            let common = common_prefix_chars_boundary(edge, rest);
            // Safety of the slice: `common` is a char boundary of `edge`.
            matched_chars += count_chars(&edge[..common]);
            break;
        }
        if deepest == ROOT {
            return PrefixMatch::default();
        }
        PrefixMatch {
            matched_chars,
            tenants: most_recent(&self.node(deepest).tenants),
        }
    }

    /// Removes `tenant` from every node, frees nodes left without tenants, merges a node
    /// into its only child when both then hold the same tenants (so churn does not leave
    /// split chains behind, bug B17), and zeroes the tenant's size. Unknown tenant: no-op.
    pub fn remove_tenant(&mut self, tenant: TenantId) {
        // Nodes listing `tenant` form a subtree hanging off the root (invariant 4).
        let mut stack: Vec<NodeId> = self
            .node(ROOT)
            .children
            .iter()
            .map(|&(_, c)| c)
            .filter(|&c| self.node(c).tenant_pos(tenant).is_ok())
            .collect();
        let mut touched_parents = Vec::new();
        while let Some(id) = stack.pop() {
            let node = self.node_mut(id);
            let Ok(pos) = node.tenant_pos(tenant) else {
                continue;
            };
            node.tenants.remove(pos);
            let chars = node.edge_chars as usize;
            let emptied = node.tenants.is_empty();
            let parent = node.parent;
            let children: Vec<NodeId> = node.children.iter().map(|&(_, c)| c).collect();
            self.sub_tenant_chars(tenant, chars);
            if emptied {
                // Children hold a subset of {tenant}: all of them go too.
                self.detach(id);
                self.free_subtree(id, tenant);
                touched_parents.push(parent);
            } else {
                stack.extend(children);
                touched_parents.push(parent);
                touched_parents.push(id);
            }
        }
        // No allocation happens above, so a freed id is not reused before this loop.
        for id in touched_parents {
            while self.nodes[id as usize].is_some() && self.try_merge(id) {}
        }
    }

    /// Frees `id` and its descendants, which hold only `tenant` (already subtracted for `id`).
    fn free_subtree(&mut self, id: NodeId, tenant: TenantId) {
        let mut stack = vec![id];
        while let Some(n) = stack.pop() {
            let node = self.node(n);
            stack.extend(node.children.iter().map(|&(_, c)| c));
            if n != id {
                let chars = node.edge_chars as usize;
                debug_assert_eq!(node.tenants.len(), 1);
                self.sub_tenant_chars(tenant, chars);
            }
            self.release(n);
        }
    }

    /// Unlinks `id` from its parent's child list (does not free it).
    fn detach(&mut self, id: NodeId) {
        let node = self.node(id);
        let parent = node.parent;
        let first = node.edge.chars().next().expect("non-root edge");
        let p = self.node_mut(parent);
        let slot = p
            .children
            .binary_search_by_key(&first, |&(k, _)| k)
            .expect("parent lists child");
        p.children.remove(slot);
    }

    /// Merges non-root `id` with its only child when both list the same tenants: the child's
    /// edge is appended to `id`'s, `id` keeps its (newer) clocks. Sizes do not change.
    fn try_merge(&mut self, id: NodeId) -> bool {
        if id == ROOT {
            return false;
        }
        let node = self.node(id);
        if node.children.len() != 1 {
            return false;
        }
        let child = node.children[0].1;
        let c = self.node(child);
        let same = c.tenants.len() == node.tenants.len()
            && c.tenants.iter().zip(&node.tenants).all(|(a, b)| a.0 == b.0);
        if !same {
            return false;
        }
        let c = self.nodes[child as usize].take().expect("live child");
        self.live_nodes -= 1;
        self.free.push(child);
        let grand: Vec<NodeId> = c.children.iter().map(|&(_, g)| g).collect();
        for g in grand {
            self.node_mut(g).parent = id;
        }
        let node = self.node_mut(id);
        let mut edge = String::with_capacity(node.edge.len() + c.edge.len());
        edge.push_str(&node.edge);
        edge.push_str(&c.edge);
        node.edge = edge.into_boxed_str();
        node.edge_chars += c.edge_chars;
        node.children = c.children;
        true
    }

    /// Chars attached to `tenant`: Σ edge chars over nodes listing it. 0 for an unknown
    /// tenant.
    pub fn tenant_chars(&self, tenant: TenantId) -> usize {
        self.tenant_chars.get(tenant as usize).copied().unwrap_or(0)
    }

    /// Σ over tenants of [`Self::tenant_chars`], in chars: the size the eviction budget
    /// bounds (SMG, anchors §2.4).
    pub fn total_chars(&self) -> usize {
        self.total_chars
    }

    /// Chars stored in edges, each node counted once (memory, not budget).
    pub fn stored_chars(&self) -> usize {
        self.stored_chars
    }

    /// Live nodes, root included (an empty tree has 1).
    pub fn node_count(&self) -> usize {
        self.live_nodes
    }

    /// Evicts least-recently-inserted (tenant, leaf) pairs until `total_chars() <=
    /// max_chars`. A tenant's leaf is a node listing the tenant with no child listing it;
    /// removing the pair detaches the tenant there, frees the node when no tenant is left, and
    /// may make the parent the tenant's next leaf. Ties on the clock break by tenant id then
    /// node id. SMG's scheme (anchors §2.4): the heap is rebuilt over the whole tree on each
    /// call that has to evict.
    pub fn evict_to(&mut self, max_chars: usize) {
        if self.total_chars <= max_chars {
            return;
        }
        let mut heap: BinaryHeap<Reverse<(u64, TenantId, NodeId)>> = BinaryHeap::new();
        for (id, slot) in self.nodes.iter().enumerate() {
            let Some(node) = slot else { continue };
            let id = id as NodeId;
            if id == ROOT {
                continue;
            }
            for &(t, ts) in &node.tenants {
                if self.is_tenant_leaf(node, t) {
                    heap.push(Reverse((ts, t, id)));
                }
            }
        }
        while self.total_chars > max_chars {
            let Some(Reverse((_, tenant, id))) = heap.pop() else {
                break;
            };
            let node = self.node_mut(id);
            let pos = node.tenant_pos(tenant).expect("heap entries are live");
            node.tenants.remove(pos);
            let chars = node.edge_chars as usize;
            let parent = node.parent;
            let emptied = node.tenants.is_empty();
            self.sub_tenant_chars(tenant, chars);
            if emptied {
                debug_assert!(self.node(id).children.is_empty());
                self.detach(id);
                self.release(id);
            }
            if parent != ROOT {
                let p = self.node(parent);
                if self.is_tenant_leaf(p, tenant) {
                    let ts = p.tenants[p.tenant_pos(tenant).expect("subset")].1;
                    heap.push(Reverse((ts, tenant, parent)));
                }
            }
        }
    }

    fn is_tenant_leaf(&self, node: &Node, tenant: TenantId) -> bool {
        node.children
            .iter()
            .all(|&(_, c)| self.node(c).tenant_pos(tenant).is_err())
    }

    /// Checks invariants 1–6 of [`StringTree`], naming the first broken one.
    ///
    /// # Errors
    /// [`crate::IndexError::Invariant`] with the invariant's number and the offending node.
    #[cfg(any(test, feature = "test-util"))]
    pub fn check_invariants(&self) -> Result<(), crate::IndexError> {
        use crate::IndexError::Invariant;
        let bad = |number: u8, node: NodeId| Err(Invariant { number, node });
        let root = self.node(ROOT);
        if !root.edge.is_empty() || root.parent != NO_PARENT || !root.tenants.is_empty() {
            return bad(1, ROOT);
        }
        let mut tenant_chars: Vec<usize> = Vec::new();
        let mut stored = 0usize;
        let mut seen = vec![false; self.nodes.len()];
        let mut stack = vec![ROOT];
        let mut reached = 0usize;
        while let Some(id) = stack.pop() {
            if std::mem::replace(&mut seen[id as usize], true) {
                return bad(6, id);
            }
            reached += 1;
            let node = self.node(id);
            if id != ROOT {
                if node.edge.is_empty() || node.edge_chars as usize != node.edge.chars().count() {
                    return bad(1, id);
                }
                if node.tenants.is_empty() {
                    return bad(3, id);
                }
                stored += node.edge_chars as usize;
                for &(t, _) in &node.tenants {
                    let t = t as usize;
                    if tenant_chars.len() <= t {
                        tenant_chars.resize(t + 1, 0);
                    }
                    tenant_chars[t] += node.edge_chars as usize;
                }
            }
            if !node.children.windows(2).all(|w| w[0].0 < w[1].0)
                || !node.tenants.windows(2).all(|w| w[0].0 < w[1].0)
            {
                return bad(2, id);
            }
            for &(first, c) in &node.children {
                let Some(Some(child)) = self.nodes.get(c as usize) else {
                    return bad(1, c);
                };
                if child.parent != id || !child.edge.starts_with(first) {
                    return bad(1, c);
                }
                if id != ROOT {
                    for &(t, ts) in &child.tenants {
                        match node.tenant_pos(t) {
                            Ok(i) if node.tenants[i].1 >= ts => {}
                            _ => return bad(4, c),
                        }
                    }
                }
                stack.push(c);
            }
        }
        if reached != self.live_nodes || self.nodes.len() - self.free.len() != self.live_nodes {
            return bad(6, ROOT);
        }
        if stored != self.stored_chars {
            return bad(5, ROOT);
        }
        let n = tenant_chars.len().max(self.tenant_chars.len());
        for t in 0..n {
            let want = tenant_chars.get(t).copied().unwrap_or(0);
            if self.tenant_chars.get(t).copied().unwrap_or(0) != want {
                return bad(5, ROOT);
            }
        }
        if tenant_chars.iter().sum::<usize>() != self.total_chars {
            return bad(5, ROOT);
        }
        Ok(())
    }

    /// Whether any live node lists `tenant` (tests: removal leaves no trace).
    #[cfg(any(test, feature = "test-util"))]
    pub fn mentions_tenant(&self, tenant: TenantId) -> bool {
        self.nodes
            .iter()
            .flatten()
            .any(|n| n.tenant_pos(tenant).is_ok())
    }
}

/// Up to [`MAX_MATCH_TENANTS`] tenants, most recent clock first (ties: lower id first).
fn most_recent(tenants: &[(TenantId, u64)]) -> Vec<TenantId> {
    let mut v: Vec<(TenantId, u64)> = tenants.to_vec();
    let key = |&(t, ts): &(TenantId, u64)| (Reverse(ts), t);
    if v.len() > MAX_MATCH_TENANTS {
        v.select_nth_unstable_by_key(MAX_MATCH_TENANTS - 1, key);
        v.truncate(MAX_MATCH_TENANTS);
    }
    v.sort_unstable_by_key(key);
    v.into_iter().map(|(t, _)| t).collect()
}

/// First char of non-empty UTF-8 `bytes` that start at a char boundary.
#[inline]
fn first_char(bytes: &[u8]) -> char {
    let len = match bytes[0] {
        b if b < 0x80 => return b as char,
        b if b >= 0xF0 => 4,
        b if b >= 0xE0 => 3,
        _ => 2,
    };
    // Both slices come from `&str`s cut at char boundaries, so this cannot fail.
    std::str::from_utf8(&bytes[..len])
        .ok()
        .and_then(|s| s.chars().next())
        .expect("valid UTF-8 at a char boundary")
}

/// Chars in UTF-8 `bytes`: the bytes that are not continuation bytes.
#[inline]
fn count_chars(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| (b as i8) >= -0x40).count()
}

/// Length in bytes of the longest common prefix of two UTF-8 strings, cut back to a char
/// boundary (so it is a boundary of both).
#[inline]
fn common_prefix_chars_boundary(a: &[u8], b: &[u8]) -> usize {
    let mut n = common_prefix_bytes(a, b);
    // Back off while the byte at `n` continues a char in either string.
    while n > 0 && ((n < a.len() && (a[n] as i8) < -0x40) || (n < b.len() && (b[n] as i8) < -0x40))
    {
        n -= 1;
    }
    n
}

/// Length in bytes of the longest common prefix of `a` and `b`, compared 32 then 8 bytes
/// at a time.
#[inline]
fn common_prefix_bytes(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 32 <= n && a[i..i + 32] == b[i..i + 32] {
        i += 32;
    }
    while i + 8 <= n {
        let x = u64::from_le_bytes(a[i..i + 8].try_into().expect("8 bytes"));
        let y = u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let d = x ^ y;
        if d != 0 {
            return i + (d.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{ReferenceMatch, ReferenceStringIndex};
    use proptest::prelude::*;

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
        t.insert("hello world", 0);
        t.insert("hello there", 1);
        check(&t);
        // root, "hello ", "world", "there"
        assert_eq!(t.node_count(), 4);
        assert_eq!(t.tenant_chars(0), 11);
        assert_eq!(t.tenant_chars(1), 11);
        assert_eq!(t.total_chars(), 22);
        assert_eq!(t.stored_chars(), 16);
        let m = t.match_prefix("hello wor");
        assert_eq!(m.matched_chars, 9);
        assert_eq!(m.tenants, vec![0]);
        // Both hold "hello "; tenant 1 inserted last, so it comes first.
        let m = t.match_prefix("hello");
        assert_eq!(m.matched_chars, 5);
        assert_eq!(m.tenants, vec![1, 0]);
        let m = t.match_prefix("hello worldwide");
        assert_eq!((m.matched_chars, m.tenants), (11, vec![0]));
        assert_eq!(t.match_prefix("x"), PrefixMatch::default());
        assert_eq!(t.match_prefix(""), PrefixMatch::default());
    }

    #[test]
    fn text_ending_inside_an_edge_splits_it() {
        let mut t = StringTree::new();
        t.insert("abcdef", 0);
        t.insert("abc", 1);
        check(&t);
        assert_eq!(t.node_count(), 3);
        assert_eq!(t.match_prefix("abcx").tenants, vec![1, 0]);
        assert_eq!(t.match_prefix("abcd").tenants, vec![0]);
        assert_eq!(t.tenant_chars(1), 3);
        assert_eq!(t.total_chars(), 9);
    }

    #[test]
    fn emoji_sharing_leading_bytes_split_at_char_boundaries() {
        // U+1F600 and U+1F601 share their first 3 UTF-8 bytes.
        let mut t = StringTree::new();
        t.insert("😀👍🏽", 0);
        t.insert("😀😁", 1);
        check(&t);
        assert_eq!(t.match_prefix("😀😂").matched_chars, 1);
        assert_eq!(t.match_prefix("😀😂").tenants, vec![1, 0]);
        // 👍🏽 is two chars: thumbs up + skin tone modifier.
        assert_eq!(t.match_prefix("😀👍🏿").matched_chars, 2);
        assert_eq!(t.match_prefix("😀👍🏽!").matched_chars, 3);
        assert_eq!(t.tenant_chars(0), 3);
        assert_eq!(t.tenant_chars(1), 2);
    }

    #[test]
    fn combining_marks_count_as_chars() {
        let mut t = StringTree::new();
        t.insert("e\u{301}x", 0);
        check(&t);
        assert_eq!(t.match_prefix("e\u{300}").matched_chars, 1);
        assert_eq!(t.match_prefix("e\u{301}").matched_chars, 2);
        assert_eq!(t.match_prefix("é").matched_chars, 0); // precomposed U+00E9
    }

    #[test]
    fn cjk_and_runs_of_one_char() {
        let mut t = StringTree::new();
        let long = "中".repeat(100);
        t.insert(&long, 0);
        t.insert(&"中".repeat(40), 1);
        t.insert(&format!("{}文", "中".repeat(70)), 2);
        check(&t);
        assert_eq!(t.match_prefix(&"中".repeat(200)).matched_chars, 100);
        assert_eq!(t.match_prefix(&"中".repeat(200)).tenants, vec![0]);
        assert_eq!(t.match_prefix(&"中".repeat(50)).tenants, vec![2, 0]);
        assert_eq!(t.match_prefix(&"中".repeat(30)).tenants, vec![2, 1, 0]);
        assert_eq!(t.tenant_chars(2), 71);
    }

    #[test]
    fn at_most_eight_most_recent_tenants() {
        let mut t = StringTree::new();
        for tenant in 0..20 {
            t.insert("shared prefix", tenant);
        }
        t.insert("shared prefix", 3); // 3 becomes the most recent
        check(&t);
        let m = t.match_prefix("shared prefix and more");
        assert_eq!(m.matched_chars, 13);
        assert_eq!(m.tenants, vec![3, 19, 18, 17, 16, 15, 14, 13]);
    }

    #[test]
    fn remove_tenant_purges_frees_and_merges() {
        let mut t = StringTree::new();
        t.insert("abcdef", 0);
        t.insert("abcxyz", 1);
        t.insert("qqq", 1);
        assert_eq!(t.node_count(), 5);
        t.remove_tenant(1);
        check(&t);
        assert!(!t.mentions_tenant(1));
        assert_eq!(t.tenant_chars(1), 0);
        assert_eq!(t.total_chars(), 6);
        // "abc" + "def" merged back into one edge.
        assert_eq!(t.node_count(), 2);
        assert_eq!(t.match_prefix("abcdefg").matched_chars, 6);
        assert_eq!(t.match_prefix("qqq").matched_chars, 0);
        t.remove_tenant(0);
        t.remove_tenant(7); // unknown: no-op
        check(&t);
        assert_eq!(
            (t.node_count(), t.total_chars(), t.stored_chars()),
            (1, 0, 0)
        );
    }

    /// B12 (smg-project/smg PR #2132) and B17 (ai-dynamo/dynamo issue #10774): worker churn
    /// under one shared prefix returns the tree to its baseline node count.
    #[test]
    fn b12_b17_churn_returns_to_baseline() {
        let mut t = StringTree::new();
        t.insert("<|system|>you are helpful<|user|>hi", 0);
        let baseline = (t.node_count(), t.total_chars(), t.stored_chars());
        for cycle in 0..1000u32 {
            let w = 1 + cycle % 7;
            t.insert(&format!("<|system|>you are helpful<|user|>q{cycle}"), w);
            t.insert(&format!("<|system|>you are{cycle}"), w);
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
        t.insert("aaaa", 0); // clock 1
        t.insert("bbbb", 1); // clock 2
        t.insert("cccc", 0); // clock 3
        t.evict_to(8);
        check(&t);
        assert_eq!(t.total_chars(), 8);
        assert_eq!(t.match_prefix("aaaa").matched_chars, 0);
        assert_eq!(t.match_prefix("bbbb").matched_chars, 4);
        t.evict_to(4);
        check(&t);
        assert_eq!(t.match_prefix("bbbb").matched_chars, 0);
        assert_eq!(t.match_prefix("cccc").tenants, vec![0]);
        assert_eq!(t.node_count(), 2);
    }

    #[test]
    fn evict_detaches_tenant_leaf_before_shared_parent() {
        let mut t = StringTree::new();
        t.insert("abcd", 0);
        t.insert("abxy", 1);
        assert_eq!(t.total_chars(), 8);
        t.evict_to(6); // drops tenant 0's leaf "cd" (oldest), keeps "ab" for both
        check(&t);
        assert_eq!(t.total_chars(), 6);
        let m = t.match_prefix("abcd");
        assert_eq!((m.matched_chars, m.tenants), (2, vec![1, 0]));
        t.evict_to(3); // then tenant 0's "ab" (clock 1), then stop at 4 → tenant 1's "xy"
        check(&t);
        assert_eq!(t.total_chars(), 2);
        assert_eq!(t.tenant_chars(0), 0);
        assert_eq!(t.match_prefix("abxy").matched_chars, 2);
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
                        tree.insert(&text, *t);
                        reference.insert(&text, *t);
                    }
                    Op::Match(b, c, s) => {
                        let text = build(&bases, *b, *c, s);
                        let got = tree.match_prefix(&text);
                        if let Err(e) = compare(&got, &reference.match_prefix(&text)) {
                            mismatches[0] += 1;
                            prop_assert!(false, "query {text:?}: {e}");
                        }
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
                    let got = tree.match_prefix(&text);
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
                        tree.insert(&text, *t);
                        reference.insert(&text, *t);
                    }
                    Op::Match(b, c, s) => {
                        let text = build(&bases, *b, *c, s);
                        let got = tree.match_prefix(&text);
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
