//! The multi-tenant radix tree shared by [`crate::StringTree`] (unit = one char of UTF-8) and
//! [`crate::TokenTree`] (unit = one page of `block_size` token ids). Crate-private: the two
//! public trees are thin wrappers that convert their input to bytes and their sizes to units.
//!
//! Edges are byte strings cut only at unit boundaries. Children are keyed by a `u64` digest of
//! the edge's first unit (the char itself, or xxh3-64 of the first page). Under the root sits
//! one *namespace node* per cache partition (empty edge, keyed by the namespace hash), so
//! different namespaces never share a node and never match each other.
//!
//! Eviction is LRU over (tenant, leaf) pairs, as in SMG (anchors §2.4), but the candidates are
//! kept in a queue maintained on every insert ([`Leaves`]), so evicting costs O(log n) per
//! evicted pair instead of a heap rebuild over the whole tree.

use crate::{Namespace, TenantId};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use xxhash_rust::xxh3::xxh3_64;

/// Index of a node in the arena. `ROOT` is never freed.
pub(crate) type NodeId = u32;
pub(crate) const ROOT: NodeId = 0;
const NO_PARENT: NodeId = NodeId::MAX;

/// What one unit of an edge is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    /// One Unicode scalar value of UTF-8 text (1–4 bytes).
    Char,
    /// One page of token ids: `bytes` = `block_size × 4` bytes (native-endian `u32`s).
    Page { bytes: usize },
}

impl Unit {
    /// Digest of the first unit of non-empty `bytes` (which start at a unit boundary).
    #[inline]
    fn key(self, bytes: &[u8]) -> u64 {
        match self {
            Unit::Char => first_char(bytes) as u64,
            Unit::Page { bytes: page } => xxh3_64(&bytes[..page]),
        }
    }

    /// Units in `bytes` (a whole number of units).
    #[inline]
    fn count(self, bytes: &[u8]) -> usize {
        match self {
            Unit::Char => count_chars(bytes),
            Unit::Page { bytes: page } => bytes.len() / page,
        }
    }

    /// Bytes of the longest common prefix of `a` and `b`, cut back to a unit boundary of both.
    #[inline]
    fn common(self, a: &[u8], b: &[u8]) -> usize {
        let n = common_prefix_bytes(a, b);
        match self {
            Unit::Char => back_to_char_boundary(a, b, n),
            Unit::Page { bytes: page } => n - n % page,
        }
    }
}

/// Answer of [`Radix::match_prefix`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RadixMatch {
    /// Units of the longest prefix found.
    pub units: usize,
    /// Up to `max_tenants` tenants of the deepest matched node, most recent first.
    pub tenants: Vec<TenantId>,
}

/// `(tenant, clock of its last insert through this node, children listing the tenant)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    tenant: TenantId,
    children: u32,
    clock: u64,
}

#[derive(Clone, Debug)]
struct Node {
    /// Edge label from the parent, whole units; empty only for the root and namespace nodes.
    edge: Box<[u8]>,
    /// Units in `edge`.
    edge_units: u32,
    /// The parent's child key of this node: first-unit digest, or the namespace hash.
    key: u64,
    parent: NodeId,
    /// `(key, child)`, sorted by key.
    children: Vec<(u64, NodeId)>,
    /// Sorted by tenant.
    holders: Vec<Holder>,
    /// Page mode: the block key ([`crate::keys::block_keys_in`] in the node's namespace) of
    /// the last page of the path through this edge, when an insert that knew its keys made
    /// or passed the node; `None` otherwise (char mode, root and namespace nodes, keyless
    /// inserts). A keyed walk compares it instead of the edge's bytes.
    end: Option<u64>,
}

impl Node {
    #[inline]
    fn holder(&self, tenant: TenantId) -> Result<usize, usize> {
        self.holders.binary_search_by_key(&tenant, |h| h.tenant)
    }

    #[inline]
    fn child(&self, key: u64) -> Option<NodeId> {
        let c = &self.children;
        if c.len() <= 8 {
            c.iter().find(|&&(k, _)| k == key).map(|&(_, id)| id)
        } else {
            c.binary_search_by_key(&key, |&(k, _)| k)
                .ok()
                .map(|i| c[i].1)
        }
    }
}

/// An eviction candidate: (clock, tenant, node), ordered by clock first (LRU), ties by
/// tenant then node.
type LeafEntry = (u64, TenantId, NodeId);

/// The eviction candidates: a min-heap of [`LeafEntry`]s with lazy deletion.
///
/// Every (tenant, leaf) pair of the tree is in the heap with its current clock; entries that
/// no longer match the tree (the node freed, the tenant gone from it, its clock moved on, a
/// child listing it) are *stale* and skipped when they come out. So an insert that re-touches
/// a leaf pushes one entry and removes none, and since its clock is the newest the push is
/// one comparison: an ordered set paid two O(log n) searches (remove + insert) for it, 140 ns
/// of a 330 ns insert of a warm 1 KB chat into a 4-worker tree (perf/runs/2026-12-02-text-path).
/// Pops come out in the ordered set's order, so eviction is unchanged.
///
/// Bound: the queue is compacted (stale entries dropped, O(n)) once it holds more than
/// twice its live size at the last compaction plus 1,024, so memory stays within 2× the peak
/// number of pairs + 1,024 entries of 16 bytes, and each push pays O(1) amortized for it. A
/// stale entry that matches the tree again (a reused node id listing the tenant at that clock)
/// is a live candidate again, and a duplicate of a live one is dropped when the first is
/// evicted: neither changes what is evicted.
#[derive(Clone, Debug, Default)]
struct Leaves {
    heap: BinaryHeap<Reverse<LeafEntry>>,
    /// Entries left by the last compaction.
    compacted: usize,
}

impl Leaves {
    /// Most entries before a compaction.
    fn bound(&self) -> usize {
        2 * self.compacted + 1024
    }
}

/// The tree. See [`crate::StringTree`] for the public contract and invariants; sizes here are
/// in units.
#[derive(Clone, Debug)]
pub(crate) struct Radix {
    unit: Unit,
    nodes: Vec<Option<Node>>,
    free: Vec<NodeId>,
    live_nodes: usize,
    tenant_units: Vec<usize>,
    total_units: usize,
    stored_units: usize,
    stored_bytes: usize,
    clock: u64,
    /// Budget on `total_units`, enforced at the end of every insert.
    max_units: usize,
    /// Every (clock, tenant, node) where the node lists the tenant and no child does, and
    /// stale entries ([`Leaves`]).
    leaves: Leaves,
    evicted_pairs: u64,
}

impl Radix {
    pub(crate) fn new(unit: Unit, max_units: usize) -> Self {
        let root = Node {
            edge: Box::default(),
            edge_units: 0,
            key: 0,
            parent: NO_PARENT,
            children: Vec::new(),
            holders: Vec::new(),
            end: None,
        };
        Self {
            unit,
            nodes: vec![Some(root)],
            free: Vec::new(),
            live_nodes: 1,
            tenant_units: Vec::new(),
            total_units: 0,
            stored_units: 0,
            stored_bytes: 0,
            clock: 0,
            max_units,
            leaves: Leaves::default(),
            evicted_pairs: 0,
        }
    }

    #[inline]
    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id as usize].as_ref().expect("live node")
    }

    #[inline]
    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id as usize].as_mut().expect("live node")
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        self.live_nodes += 1;
        self.stored_units += node.edge_units as usize;
        self.stored_bytes += node.edge.len();
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
        self.stored_units -= node.edge_units as usize;
        self.stored_bytes -= node.edge.len();
        self.live_nodes -= 1;
        self.free.push(id);
    }

    fn add_units(&mut self, tenant: TenantId, units: usize) {
        let t = tenant as usize;
        if self.tenant_units.len() <= t {
            self.tenant_units.resize(t + 1, 0);
        }
        self.tenant_units[t] += units;
        self.total_units += units;
    }

    fn sub_units(&mut self, tenant: TenantId, units: usize) {
        self.tenant_units[tenant as usize] -= units;
        self.total_units -= units;
    }

    /// Lists `tenant` on `id` at `now`. When it is new there, its units are counted and the
    /// parent's child count for it goes up.
    fn touch(&mut self, id: NodeId, tenant: TenantId, now: u64) {
        let node = self.node_mut(id);
        match node.holder(tenant) {
            Ok(i) => node.holders[i].clock = now,
            Err(i) => {
                node.holders.insert(
                    i,
                    Holder {
                        tenant,
                        children: 0,
                        clock: now,
                    },
                );
                let (units, parent) = (node.edge_units as usize, node.parent);
                self.add_units(tenant, units);
                self.bump_parent_count(parent, tenant, 1);
            }
        }
    }

    /// Adds `delta` to `parent`'s count of children listing `tenant` (no-op at the root).
    fn bump_parent_count(&mut self, parent: NodeId, tenant: TenantId, delta: i32) {
        if parent == ROOT {
            return;
        }
        let p = self.node_mut(parent);
        let i = p.holder(tenant).expect("child tenants ⊆ parent tenants");
        p.holders[i].children = p.holders[i].children.wrapping_add_signed(delta);
    }

    /// The namespace node of `ns`, if any.
    fn ns_node(&self, ns: Namespace) -> Option<NodeId> {
        self.node(ROOT).child(ns)
    }

    fn insert_child(&mut self, parent: NodeId, key: u64, id: NodeId) {
        let p = self.node_mut(parent);
        let slot = p
            .children
            .binary_search_by_key(&key, |&(k, _)| k)
            .expect_err("no child with this key");
        p.children.insert(slot, (key, id));
    }

    /// Splits `child`'s edge after `at` bytes (a unit boundary strictly inside the edge): a
    /// new node takes the head and the child's tenants and becomes the child's parent.
    fn split(&mut self, child: NodeId, at: usize, end: Option<u64>) -> NodeId {
        let unit = self.unit;
        let (parent, key, head, tail, holders) = {
            let c = self.node(child);
            let holders: Vec<Holder> = c
                .holders
                .iter()
                .map(|h| Holder { children: 1, ..*h })
                .collect();
            (
                c.parent,
                c.key,
                Box::<[u8]>::from(&c.edge[..at]),
                Box::<[u8]>::from(&c.edge[at..]),
                holders,
            )
        };
        let head_units = unit.count(&head);
        let tail_key = unit.key(&tail);
        let mid = self.alloc(Node {
            edge: head,
            edge_units: head_units as u32,
            key,
            parent,
            children: vec![(tail_key, child)],
            holders,
            end,
        });
        // `alloc` counted the head; the child's edge shrinks by as much.
        self.stored_units -= head_units;
        self.stored_bytes -= at;
        {
            let c = self.node_mut(child);
            c.edge = tail;
            c.edge_units -= head_units as u32;
            c.key = tail_key;
            c.parent = mid;
        }
        let p = self.node_mut(parent);
        let slot = p
            .children
            .binary_search_by_key(&key, |&(k, _)| k)
            .expect("parent lists child");
        p.children[slot].1 = mid;
        mid
    }

    fn add_leaf(
        &mut self,
        parent: NodeId,
        key: u64,
        edge: &[u8],
        tenant: TenantId,
        now: u64,
        end: Option<u64>,
    ) -> NodeId {
        let units = self.unit.count(edge);
        let id = self.alloc(Node {
            edge: Box::from(edge),
            edge_units: u32::try_from(units).expect("edge shorter than 2^32 units"),
            key,
            parent,
            children: Vec::new(),
            holders: vec![Holder {
                tenant,
                children: 0,
                clock: now,
            }],
            end,
        });
        self.add_units(tenant, units);
        self.bump_parent_count(parent, tenant, 1);
        self.insert_child(parent, key, id);
        id
    }

    /// Records `bytes` (whole units) for `tenant` in namespace `ns`, one clock tick, then
    /// evicts down to the budget. Empty input only ticks the clock. `keys`: page mode only,
    /// the block key of each page of `bytes` in `ns` (see [`Node::end`]; `None`: not known,
    /// edges are compared byte by byte).
    pub(crate) fn insert(
        &mut self,
        ns: Namespace,
        bytes: &[u8],
        tenant: TenantId,
        keys: Option<&[u64]>,
    ) {
        self.clock += 1;
        let now = self.clock;
        if bytes.is_empty() {
            return;
        }
        let unit = self.unit;
        let nsn = match self.ns_node(ns) {
            Some(n) => n,
            None => self.add_leaf(ROOT, ns, &[], tenant, now, None),
        };
        // The key of the last page of the first `units` units of `bytes`.
        let end_at = |units: usize| keys.map(|k| k[units - 1]);
        let mut units = 0usize;
        // A leaf entry of `tenant` on the path goes stale here: its clock moves on ([`Leaves`]).
        self.touch(nsn, tenant, now);
        let mut cur = nsn;
        let mut rest = bytes;
        while !rest.is_empty() {
            let key = unit.key(rest);
            let Some(child) = self.node(cur).child(key) else {
                let end = end_at(units + unit.count(rest));
                cur = self.add_leaf(cur, key, rest, tenant, now, end);
                break;
            };
            let node = self.node(child);
            let (edge, edge_units) = (&node.edge, node.edge_units as usize);
            // A whole edge matches on most of a long path: the key of its last page (when
            // both are known), else one comparison of its bytes; else the common prefix.
            let whole = rest.len() >= edge.len()
                && match (node.end, end_at(units + edge_units)) {
                    (Some(a), Some(b)) => a == b,
                    _ => rest[..edge.len()] == **edge,
                };
            let common = if whole {
                edge.len()
            } else {
                unit.common(edge, rest)
            };
            if common == 0 {
                // Page digest collision: the rest is not recorded (counts as a miss, SMG).
                break;
            }
            let next = if common == edge.len() {
                if self.node(child).end.is_none() {
                    self.node_mut(child).end = end_at(units + edge_units);
                }
                child
            } else {
                let end = end_at(units + unit.count(&rest[..common]));
                self.split(child, common, end)
            };
            units += self.node(next).edge_units as usize;
            self.touch(next, tenant, now);
            cur = next;
            rest = &rest[common..];
        }
        if self.is_leaf_of(cur, tenant) {
            self.push_leaf((now, tenant, cur));
        }
        if self.total_units > self.max_units {
            self.evict_to(self.max_units);
        }
    }

    fn is_leaf_of(&self, id: NodeId, tenant: TenantId) -> bool {
        let n = self.node(id);
        n.holder(tenant).is_ok_and(|i| n.holders[i].children == 0)
    }

    /// Whether `(clock, tenant, id)` is a live eviction candidate: node `id` lists `tenant`
    /// at `clock` and no child of it does ([`Leaves`]).
    fn is_leaf_entry(&self, (clock, tenant, id): LeafEntry) -> bool {
        let Some(Some(n)) = self.nodes.get(id as usize) else {
            return false;
        };
        n.holder(tenant)
            .is_ok_and(|i| n.holders[i].clock == clock && n.holders[i].children == 0)
    }

    /// Queues a new eviction candidate; compacts the queue when its stale entries may have
    /// grown past [`Leaves::bound`].
    fn push_leaf(&mut self, e: LeafEntry) {
        self.leaves.heap.push(Reverse(e));
        if self.leaves.heap.len() > self.leaves.bound() {
            let mut heap = std::mem::take(&mut self.leaves.heap);
            heap.retain(|e| self.is_leaf_entry(e.0));
            self.leaves.compacted = heap.len();
            self.leaves.heap = heap;
        }
    }

    /// The least recent live eviction candidate, out of the queue; stale entries above it
    /// are dropped on the way.
    fn pop_leaf(&mut self) -> Option<LeafEntry> {
        while let Some(Reverse(e)) = self.leaves.heap.pop() {
            if self.is_leaf_entry(e) {
                return Some(e);
            }
        }
        None
    }

    /// Longest prefix of `bytes` (whole units) in namespace `ns` and up to `max_tenants` most
    /// recent tenants of the deepest matched node.
    pub(crate) fn match_prefix(
        &self,
        ns: Namespace,
        bytes: &[u8],
        max_tenants: usize,
    ) -> RadixMatch {
        let mut deepest = None;
        self.walk(ns, bytes, None, |node, units| deepest = Some((node, units)));
        match deepest {
            Some((node, units)) => RadixMatch {
                units,
                tenants: most_recent(&self.node(node).holders, max_tenants),
            },
            None => RadixMatch::default(),
        }
    }

    /// Every tenant holding a prefix of `bytes` in namespace `ns`, with the units of its
    /// longest one (the depth of the deepest matched node listing it), sorted by tenant.
    /// Tenants holding none are absent. Cost: the walk of [`Self::match_prefix`] plus the
    /// holders of the nodes on the path.
    /// `keys`: as [`Self::insert`]'s (a node's edge then matches when its end key equals the
    /// request's key at that depth, without reading the edge).
    pub(crate) fn match_depths(
        &self,
        ns: Namespace,
        bytes: &[u8],
        keys: Option<&[u64]>,
    ) -> Vec<(TenantId, usize)> {
        let mut depths: Vec<(TenantId, usize)> = Vec::new();
        // The walk goes shallowest first and each node's units exceed the earlier ones', so
        // a tenant's entry, kept sorted by tenant, ends at the deepest node listing it.
        self.walk(ns, bytes, keys, |node, units| {
            for h in &self.node(node).holders {
                match depths.binary_search_by_key(&h.tenant, |&(t, _)| t) {
                    Ok(i) => depths[i].1 = units,
                    Err(i) => depths.insert(i, (h.tenant, units)),
                }
            }
        });
        depths
    }

    /// Walks the path of `bytes` from namespace `ns`'s node, calling `visit(node, units)` for
    /// each node it reaches, in depth order, with the units matched up to and including that
    /// node (a partly matched last edge counts its matched units).
    fn walk(
        &self,
        ns: Namespace,
        bytes: &[u8],
        keys: Option<&[u64]>,
        mut visit: impl FnMut(NodeId, usize),
    ) {
        let unit = self.unit;
        let Some(mut cur) = self.ns_node(ns) else {
            return;
        };
        let mut units = 0usize;
        let mut rest = bytes;
        while !rest.is_empty() {
            let Some(child) = self.node(cur).child(unit.key(rest)) else {
                break;
            };
            let node = self.node(child);
            let edge = &node.edge[..];
            let whole = rest.len() >= edge.len()
                && match (
                    node.end,
                    keys.map(|k| k[units + node.edge_units as usize - 1]),
                ) {
                    (Some(a), Some(b)) => a == b,
                    _ => rest[..edge.len()] == *edge,
                };
            if whole {
                units += node.edge_units as usize;
                rest = &rest[edge.len()..];
                cur = child;
                visit(cur, units);
                continue;
            }
            let common = unit.common(edge, rest);
            if common > 0 {
                units += unit.count(&edge[..common]);
                visit(child, units);
            }
            break;
        }
    }

    /// Removes `tenant` everywhere, frees emptied nodes, merges chains left behind.
    pub(crate) fn remove_tenant(&mut self, tenant: TenantId) {
        let mut stack: Vec<NodeId> = self.node(ROOT).children.iter().map(|&(_, c)| c).collect();
        let mut touched = Vec::new();
        while let Some(id) = stack.pop() {
            let node = self.node_mut(id);
            let Ok(pos) = node.holder(tenant) else {
                continue;
            };
            // Its leaf entry, if any, goes stale with the holder ([`Leaves`]).
            node.holders.remove(pos);
            let units = node.edge_units as usize;
            let emptied = node.holders.is_empty();
            let parent = node.parent;
            self.sub_units(tenant, units);
            if emptied {
                // Children hold a subset of {tenant}: the whole subtree goes.
                self.detach(id);
                self.free_subtree(id, tenant);
            } else {
                let node = self.node(id);
                stack.extend(node.children.iter().map(|&(_, c)| c));
                touched.push(id);
            }
            touched.push(parent);
        }
        // Nothing was allocated above, so freed ids were not reused.
        for id in touched {
            while self.nodes[id as usize].is_some() && self.try_merge(id) {}
        }
    }

    /// Frees `id` (already stripped of `tenant`) and its descendants, which list only `tenant`.
    fn free_subtree(&mut self, id: NodeId, tenant: TenantId) {
        let mut stack = vec![id];
        while let Some(n) = stack.pop() {
            let node = self.node(n);
            stack.extend(node.children.iter().map(|&(_, c)| c));
            if n != id {
                // Its leaf entry goes stale with the node ([`Leaves`]).
                let units = node.edge_units as usize;
                self.sub_units(tenant, units);
            }
            self.release(n);
        }
    }

    fn detach(&mut self, id: NodeId) {
        let (parent, key) = {
            let n = self.node(id);
            (n.parent, n.key)
        };
        let p = self.node_mut(parent);
        let slot = p
            .children
            .binary_search_by_key(&key, |&(k, _)| k)
            .expect("parent lists child");
        p.children.remove(slot);
    }

    /// Merges `id` (below a namespace node) with its only child when both list the same
    /// tenants. The merged node keeps the child's clocks and child counts (both valid: the
    /// child's clocks are ≤ `id`'s). Sizes do not change.
    fn try_merge(&mut self, id: NodeId) -> bool {
        if id == ROOT {
            return false;
        }
        let node = self.node(id);
        if node.parent == ROOT || node.children.len() != 1 {
            return false;
        }
        let child = node.children[0].1;
        let c = self.node(child);
        let same = c.holders.len() == node.holders.len()
            && c.holders
                .iter()
                .zip(&node.holders)
                .all(|(a, b)| a.tenant == b.tenant);
        if !same {
            return false;
        }
        let c = self.nodes[child as usize].take().expect("live child");
        self.live_nodes -= 1;
        self.free.push(child);
        for &(_, g) in &c.children {
            self.node_mut(g).parent = id;
        }
        let node = self.node_mut(id);
        let mut edge = Vec::with_capacity(node.edge.len() + c.edge.len());
        edge.extend_from_slice(&node.edge);
        edge.extend_from_slice(&c.edge);
        node.edge = edge.into_boxed_slice();
        node.edge_units += c.edge_units;
        node.children = c.children;
        node.holders = c.holders;
        node.end = c.end;
        // The child's leaf entries went stale with it; `id` takes them over.
        for i in 0..self.node(id).holders.len() {
            let h = self.node(id).holders[i];
            if h.children == 0 {
                self.push_leaf((h.clock, h.tenant, id));
            }
        }
        true
    }

    /// Evicts least-recently-inserted (tenant, leaf) pairs until `total_units <= max_units`.
    /// Cost O(log n) per evicted pair. No merging here: a merged leaf would be coarser and
    /// evict more than the budget needs.
    pub(crate) fn evict_to(&mut self, max_units: usize) {
        while self.total_units > max_units {
            let Some((_, tenant, id)) = self.pop_leaf() else {
                break;
            };
            self.evicted_pairs += 1;
            let node = self.node_mut(id);
            let pos = node.holder(tenant).expect("leaf entries are live");
            node.holders.remove(pos);
            let units = node.edge_units as usize;
            let parent = node.parent;
            let emptied = node.holders.is_empty();
            self.sub_units(tenant, units);
            if emptied {
                debug_assert!(self.node(id).children.is_empty());
                self.detach(id);
                self.release(id);
            }
            if parent != ROOT {
                let p = self.node_mut(parent);
                let i = p.holder(tenant).expect("subset");
                p.holders[i].children -= 1;
                if p.holders[i].children == 0 {
                    if p.parent == ROOT {
                        // A namespace node holds 0 units: drop the tenant there at once.
                        p.holders.remove(i);
                        if p.holders.is_empty() {
                            self.detach(parent);
                            self.release(parent);
                        }
                    } else {
                        let clock = p.holders[i].clock;
                        self.push_leaf((clock, tenant, parent));
                    }
                }
            }
        }
    }

    pub(crate) fn tenant_units(&self, tenant: TenantId) -> usize {
        self.tenant_units.get(tenant as usize).copied().unwrap_or(0)
    }
    pub(crate) fn total_units(&self) -> usize {
        self.total_units
    }
    pub(crate) fn stored_units(&self) -> usize {
        self.stored_units
    }
    pub(crate) fn node_count(&self) -> usize {
        self.live_nodes
    }
    pub(crate) fn evicted_pairs(&self) -> u64 {
        self.evicted_pairs
    }
    pub(crate) fn max_units(&self) -> usize {
        self.max_units
    }

    /// Estimated heap + inline bytes: arena slots, edges, child and holder vectors, and the
    /// leaf queue (16 bytes per entry, stale ones included).
    pub(crate) fn memory_bytes(&self) -> usize {
        let mut b = self.nodes.capacity() * std::mem::size_of::<Option<Node>>()
            + self.free.capacity() * 4
            + self.tenant_units.capacity() * 8
            + self.leaves.heap.capacity() * std::mem::size_of::<LeafEntry>();
        for n in self.nodes.iter().flatten() {
            b += n.edge.len() + n.children.capacity() * 16 + n.holders.capacity() * 16;
        }
        b
    }

    /// Checks the invariants listed on [`crate::StringTree`].
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn check_invariants(&self) -> Result<(), crate::IndexError> {
        use crate::IndexError::Invariant;
        let bad = |number: u8, node: NodeId| Err(Invariant { number, node });
        let root = self.node(ROOT);
        if !root.edge.is_empty() || root.parent != NO_PARENT || !root.holders.is_empty() {
            return bad(1, ROOT);
        }
        let mut tenant_units: Vec<usize> = Vec::new();
        let mut stored = 0usize;
        let mut leaves = std::collections::BTreeSet::new();
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
                let is_ns = node.parent == ROOT;
                if node.edge.is_empty() != is_ns
                    || node.edge_units as usize != self.unit.count(&node.edge)
                    || (!is_ns && node.key != self.unit.key(&node.edge))
                {
                    return bad(1, id);
                }
                if node.holders.is_empty() {
                    return bad(3, id);
                }
                stored += node.edge_units as usize;
                for h in &node.holders {
                    let t = h.tenant as usize;
                    if tenant_units.len() <= t {
                        tenant_units.resize(t + 1, 0);
                    }
                    tenant_units[t] += node.edge_units as usize;
                    let listed = node
                        .children
                        .iter()
                        .filter(|&&(_, c)| self.node(c).holder(h.tenant).is_ok())
                        .count();
                    if listed != h.children as usize {
                        return bad(7, id);
                    }
                    if listed == 0 {
                        leaves.insert((h.clock, h.tenant, id));
                    }
                }
            }
            if !node.children.windows(2).all(|w| w[0].0 < w[1].0)
                || !node.holders.windows(2).all(|w| w[0].tenant < w[1].tenant)
            {
                return bad(2, id);
            }
            if node.end.is_some() && node.end != self.path_end_key(id) {
                return bad(8, id);
            }
            for &(key, c) in &node.children {
                let Some(Some(child)) = self.nodes.get(c as usize) else {
                    return bad(1, c);
                };
                if child.parent != id || child.key != key {
                    return bad(1, c);
                }
                if id != ROOT {
                    for h in &child.holders {
                        match node.holder(h.tenant) {
                            Ok(i) if node.holders[i].clock >= h.clock => {}
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
        if stored != self.stored_units {
            return bad(5, ROOT);
        }
        let n = tenant_units.len().max(self.tenant_units.len());
        for t in 0..n {
            if self.tenant_units.get(t).copied().unwrap_or(0)
                != tenant_units.get(t).copied().unwrap_or(0)
            {
                return bad(5, ROOT);
            }
        }
        if tenant_units.iter().sum::<usize>() != self.total_units {
            return bad(5, ROOT);
        }
        let queued: std::collections::BTreeSet<(u64, TenantId, NodeId)> = self
            .leaves
            .heap
            .iter()
            .map(|e| e.0)
            .filter(|&e| self.is_leaf_entry(e))
            .collect();
        if leaves != queued || self.leaves.heap.len() > self.leaves.bound() {
            return bad(7, ROOT);
        }
        Ok(())
    }

    /// The block key of the last page of the path to `id` (page mode, below a namespace
    /// node), from the edges' bytes: what [`Node::end`] must be when known.
    #[cfg(any(test, feature = "test-util"))]
    fn path_end_key(&self, id: NodeId) -> Option<u64> {
        let Unit::Page { bytes: page } = self.unit else {
            return None;
        };
        let mut edges = Vec::new();
        let mut cur = id;
        while self.node(cur).parent != ROOT {
            edges.push(&self.node(cur).edge[..]);
            cur = self.node(cur).parent;
        }
        let mut parent = crate::keys::root(self.node(cur).key);
        for e in edges.iter().rev() {
            for p in e.chunks_exact(page) {
                let ids: Vec<u32> = p
                    .chunks_exact(4)
                    .map(|b| u32::from_ne_bytes(b.try_into().expect("4 bytes")))
                    .collect();
                parent = Some(crate::keys::chain(parent, crate::keys::local_hash(&ids)));
            }
        }
        parent
    }

    /// Entries in the eviction queue, stale ones included.
    #[cfg(test)]
    pub(crate) fn queued_leaves(&self) -> usize {
        self.leaves.heap.len()
    }

    /// The least recent (tenant, leaf) pair, by a scan of every node (the brute-force
    /// reference for [`Self::pop_leaf`]); namespace nodes excluded, as eviction drops them
    /// with their last child.
    #[cfg(test)]
    pub(crate) fn least_recent_leaf(&self) -> Option<LeafEntry> {
        let mut best = None;
        for (id, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else { continue };
            if n.parent == ROOT || n.parent == NO_PARENT {
                continue;
            }
            for h in n.holders.iter().filter(|h| h.children == 0) {
                let e = (h.clock, h.tenant, id as NodeId);
                if best.is_none_or(|b| e < b) {
                    best = Some(e);
                }
            }
        }
        best
    }

    /// Whether node `id` is live and lists `tenant`.
    #[cfg(test)]
    pub(crate) fn lists(&self, id: NodeId, tenant: TenantId) -> bool {
        matches!(self.nodes.get(id as usize), Some(Some(n)) if n.holder(tenant).is_ok())
    }

    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn mentions_tenant(&self, tenant: TenantId) -> bool {
        self.nodes
            .iter()
            .flatten()
            .any(|n| n.holder(tenant).is_ok())
            || self
                .leaves
                .heap
                .iter()
                .any(|e| e.0.1 == tenant && self.is_leaf_entry(e.0))
    }
}

/// Up to `max` tenants, most recent clock first (ties: lower id first).
fn most_recent(holders: &[Holder], max: usize) -> Vec<TenantId> {
    let key = |h: &Holder| (std::cmp::Reverse(h.clock), h.tenant);
    if holders.len() <= max {
        let mut v: Vec<Holder> = holders.to_vec();
        v.sort_unstable_by_key(key);
        return v.into_iter().map(|h| h.tenant).collect();
    }
    let mut v: Vec<Holder> = holders.to_vec();
    v.select_nth_unstable_by_key(max - 1, key);
    v.truncate(max);
    v.sort_unstable_by_key(key);
    v.into_iter().map(|h| h.tenant).collect()
}

/// First char of non-empty UTF-8 `bytes` that start at a char boundary.
#[inline]
fn first_char(bytes: &[u8]) -> char {
    let b0 = bytes[0];
    if b0 < 0x80 {
        return b0 as char;
    }
    let len = if b0 >= 0xF0 {
        4
    } else if b0 >= 0xE0 {
        3
    } else {
        2
    };
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

/// Backs `n` off to a char boundary of both UTF-8 strings.
#[inline]
fn back_to_char_boundary(a: &[u8], b: &[u8], mut n: usize) -> usize {
    while n > 0 && ((n < a.len() && (a[n] as i8) < -0x40) || (n < b.len() && (b[n] as i8) < -0x40))
    {
        n -= 1;
    }
    n
}

/// Length in bytes of the longest common prefix of `a` and `b`, compared 32 then 8 bytes at a
/// time.
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
