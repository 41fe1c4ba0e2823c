//! kvroute cache indexes: which worker (tenant) probably holds the KV cache for a prompt's
//! prefix. Pure data structures: no I/O, no clocks, no threads.
//!
//! Main types: [`StringTree`] (approximate char radix tree fed by routing decisions, one per
//! model) and its answer [`PrefixMatch`]; [`IndexError`] for the crate.
//!
//! # Module map
//! | module | content |
//! |---|---|
//! | [`string_tree`] | [`StringTree`]: multi-tenant radix tree over chars, LRU eviction |
//! | [`reference`](mod@reference) | brute-force models used by tests and benches as ground truth |
//!
//! # Identifiers
//! | name | meaning | unit |
//! |---|---|---|
//! | [`TenantId`] | dense worker id `0..n` as assigned by the router's worker registry | — |
//! | `matched_chars` | longest prefix of a query found in the tree | chars (Unicode scalar values) |
//! | `tenant_chars` | chars attached to one tenant (a node counts once per tenant holding it) | chars |
//! | `total_chars` | Σ of `tenant_chars` over tenants: what the size budget bounds (SMG) | chars |
//! | clock | LRU clock: one tick per insert, not wall time (SMG) | inserts |

pub mod reference;
pub mod string_tree;

pub use string_tree::{MAX_MATCH_TENANTS, PrefixMatch, StringTree};

/// Dense worker id (`0..n`) used as a tenant of an index.
pub type TenantId = u32;

/// Errors of the `index` crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// A data-structure invariant does not hold (reported by `check_invariants`, tests only).
    #[error("invariant {number} broken at node {node}")]
    Invariant {
        /// Number of the invariant in the type's `# Invariants` list.
        number: u8,
        /// Arena index of the offending node (0 = root or tree-wide).
        node: u32,
    },
}
