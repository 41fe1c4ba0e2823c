//! kvroute cache indexes: which worker (tenant) probably holds the KV cache for a prompt's
//! prefix. Pure data structures: no I/O, no clocks (time is passed in), no threads spawned.
//!
//! Main types: [`StringTree`] and [`TokenTree`] (approximate trees fed by routing decisions,
//! one per model), [`EventIndex`] with its per-shard [`EventWriter`]s (exact positional index
//! fed by engine KV events), [`HashIndex`] (TTL'd exact-match heads at fixed boundaries), and
//! [`LeftRight`] (lock-free reads of a single-writer structure). [`IndexError`] for the crate.
//!
//! # Module map
//! | module | content |
//! |---|---|
//! | [`string_tree`] | [`StringTree`]: multi-tenant radix tree over chars, budgeted LRU eviction |
//! | [`token_tree`] | [`TokenTree`]: the same over whole pages of token ids |
//! | `radix` (private) | the radix tree both trees wrap |
//! | [`keys`] | block keys: chained xxh3-64 of full blocks (`kv-events.md` §7) |
//! | [`positional`] | [`EventIndex`], [`EventWriter`]: engine events → per-worker overlap |
//! | [`hash_index`] | [`HashIndex`]: `--cache-index hash` |
//! | [`peer_pages`] | [`PeerPages`]: page keys other router replicas reported (replica sync) |
//! | [`left_right`] | [`LeftRight`]: two copies, readers never wait, one writer at a time |
//! | [`reference`](mod@reference) | brute-force models used by tests and benches as ground truth |
//!
//! # Identifiers
//! | name | meaning | unit |
//! |---|---|---|
//! | [`TenantId`] / worker | dense worker id `0..n` as assigned by the router's worker registry | — |
//! | [`Namespace`] | hash of a cache partition (cache_salt / extra_key / LoRA); 0 = default | — |
//! | block key | chained xxh3-64 of one full block and its whole prefix ([`keys`]) | — |
//! | engine hash | the engine's own block hash: an opaque handle for parents and removals | — |
//! | `matched_chars` | longest prefix of a query found in a string tree | chars (Unicode scalar values) |
//! | `matched_tokens` | longest prefix found in a token tree, whole pages only | tokens |
//! | `overlap_blocks` | consecutive leading blocks of a query a worker holds | blocks |
//! | `total_chars` / `total_tokens` | Σ over tenants of attached size: what the budget bounds (SMG) | chars / tokens |
//! | clock | tree LRU clock: one tick per insert, not wall time (SMG) | inserts |
//! | `now_ms` | caller's clock for TTLs (event and hash index) | ms |

pub mod hash_index;
pub mod keys;
pub mod left_right;
pub mod mix;
pub mod peer_pages;
pub mod positional;
mod radix;
pub mod reference;
pub mod string_tree;
mod table;
pub mod token_tree;

pub use hash_index::{HashIndex, HashIndexConfig};
pub use left_right::LeftRight;
pub use peer_pages::{PeerPages, PeerPagesConfig};
pub use positional::{Depths, EventIndex, EventIndexConfig, EventWriter, Overlap};
pub use string_tree::{MAX_MATCH_TENANTS, PrefixMatch, StringTree};
pub use token_tree::{TokenMatch, TokenTree};

/// Asks the CPU to start loading every cache line of `*r` (its `size_of::<T>()` bytes) into
/// L1, and returns at once: a hint with no effect on any value (a no-op off x86-64). A reader
/// about to visit many scattered, independent objects (a decision's candidate workers) calls
/// it on all of them first, so their lines load in parallel instead of one miss at a time.
#[inline(always)]
pub fn prefetch<T>(r: &T) {
    let p = std::ptr::from_ref(r).cast::<u8>();
    let size = std::mem::size_of::<T>();
    let mut off = 0;
    while off < size {
        table::prefetch_ptr(p.wrapping_add(off));
        off += 64;
    }
    // The line of the last byte, when `*r` does not start on a line.
    if size > 0 {
        table::prefetch_ptr(p.wrapping_add(size - 1));
    }
}

/// Dense worker id (`0..n`) used as a tenant of an index.
pub type TenantId = u32;

/// Cache partition: a hash of cache_salt / extra_key / LoRA adapter computed by the caller
/// (only the hash is stored). Different namespaces never match each other. 0 is the default
/// partition.
pub type Namespace = u64;

/// Errors of the `index` crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// A data-structure invariant does not hold (reported by `check_invariants`, tests only).
    #[error("invariant {number} broken at node {node}")]
    Invariant {
        /// Number of the invariant in the type's `# Invariants` list.
        number: u8,
        /// Arena index of the offending node or slot (0 = root or structure-wide).
        node: u32,
    },
    /// A stored event names a parent block the worker does not hold (Dynamo rejects and
    /// counts these, anchors §3.4).
    #[error("worker {worker}: stored blocks under unknown parent {parent:#x}")]
    UnknownParent {
        /// Worker that sent the event.
        worker: TenantId,
        /// The engine hash of the missing parent.
        parent: u64,
    },
    /// `token_ids` of a stored event is not `block_size` × the number of engine hashes.
    #[error("stored event has {tokens} tokens for {blocks} blocks of {block_size}")]
    BlockSizeMismatch {
        /// Token ids in the event.
        tokens: usize,
        /// Engine hashes in the event.
        blocks: usize,
        /// The index's block size, tokens.
        block_size: usize,
    },
    /// The worker id does not belong to this writer's shard.
    #[error("worker {worker} is not in this writer's shard")]
    WrongShard {
        /// The worker id.
        worker: TenantId,
    },
    /// Hash index without boundaries, or boundaries not strictly ascending / zero.
    #[error("hash index boundaries must be non-empty, > 0 and strictly ascending")]
    BadBoundaries,
}
