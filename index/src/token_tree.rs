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
/// [`crate::StringTree`], with pages for chars.
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
        self.radix.insert(ns, bytes, tenant);
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
