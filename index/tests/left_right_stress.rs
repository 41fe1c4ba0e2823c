//! Concurrent stress test of [`LeftRight`] holding a real tree ([`StringTree`], then
//! [`TokenTree`]), the way the router uses it (`core::policy` wraps each tree in a
//! `LeftRight<_, TreeOp>`).
//!
//! Setup: 2 reader threads read continuously while 2 writer threads each `write` 5,000 ops
//! (pair inserts, plus a tenant removal every 500th op) into a tree with a budget small enough
//! that eviction runs during the test. The structure under `LeftRight` is the tree plus a log
//! of applied op ids, appended by the same `apply` function, so every snapshot carries its own
//! version (the log length) and history.
//!
//! What is asserted:
//! - every snapshot a reader sees is internally consistent: the last op of the snapshot's
//!   log is fully visible (both halves of a pair insert match in full, with the inserting
//!   tenant first), and the tree's `check_invariants()` holds (O(nodes), ~0.5 ms here, so at
//!   most every [`CHECK_EVERY`] per reader: the writer waits for reads in flight);
//! - versions never go backwards for a reader, and the copies agree on history: the op at a
//!   position a reader saw earlier is the same op in every later snapshot (the two copies
//!   alternate as the active one, so this compares them);
//! - readers really overlapped the writes: at least one read saw an intermediate version
//!   (0 < log length < all ops), otherwise the test proves nothing and fails;
//! - after quiescence (`flush` until `pending() == 0`) the log holds every op exactly once,
//!   each writer's ops in the order it wrote them, and the tree equals a single-threaded
//!   replay of the log (same sizes in chars/tokens, node count, per-tenant sizes, and the
//!   same match — length and tenant order — for every inserted key). Two more writes make
//!   each copy active in turn, and each must equal the replay extended by those writes.
//!
//! Readers pause [`READ_PAUSE`] between reads, outside the read, like router threads between
//! requests: with 2 readers spinning on 2 shared cores a reader is usually preempted *inside*
//! a read, and the writer then waits a whole time slice per batch (measured: 6 ms per op,
//! 30 s instead of 0.2 s for the test). That is a property of left-right under CPU
//! oversubscription, not a correctness problem.
//!
//! Bounded: 10,000 ops per tree (~0.2 s in `--release`); readers stop when the writers are
//! done or after [`READ_LIMIT`], whichever is first. Sizes: chars for the string tree, tokens
//! for the token tree.

use kvroute_index::reference::synthetic_words;
use kvroute_index::{IndexError, LeftRight, StringTree, TenantId, TokenTree};
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const WRITERS: u32 = 2;
const READERS: usize = 2;
const OPS_PER_WRITER: u32 = 5_000;
/// Every this many ops a writer removes one of its tenants instead of inserting.
const REMOVE_EVERY: u32 = 500;
/// Tenants per writer; writer `w` uses tenants `8w .. 8w + 8`.
const TENANTS_PER_WRITER: u32 = 8;
/// Hard stop for readers, in case the writers hang (they are bounded by count).
const READ_LIMIT: Duration = Duration::from_secs(30);
/// Pause of a reader between two reads.
const READ_PAUSE: Duration = Duration::from_micros(20);
/// Least time between two `check_invariants` runs of one reader.
const CHECK_EVERY: Duration = Duration::from_millis(2);

/// The tree-specific part of the harness.
trait Tree: Clone + Send + Sync + 'static {
    /// A routing key: text or token ids.
    type Key: Clone + Send + Sync + PartialEq + std::fmt::Debug;
    fn insert(&mut self, key: &Self::Key, tenant: TenantId);
    fn remove_tenant(&mut self, tenant: TenantId);
    /// (matched length, tenants most recent first).
    fn lookup(&self, key: &Self::Key) -> (usize, Vec<TenantId>);
    /// Length a full match of `key` reports (chars, or tokens in whole pages).
    fn full_len(&self, key: &Self::Key) -> usize;
    /// (node count, total size, stored size).
    fn sizes(&self) -> (usize, usize, usize);
    fn tenant_size(&self, tenant: TenantId) -> usize;
    fn check(&self) -> Result<(), IndexError>;
    /// Key of half `half` (0 or 1) of op `i` of writer `w`; deterministic.
    fn key(w: u32, i: u32, half: u32) -> Self::Key;
}

impl Tree for StringTree {
    type Key = Box<str>;
    fn insert(&mut self, key: &Box<str>, tenant: TenantId) {
        StringTree::insert(self, 0, key, tenant);
    }
    fn remove_tenant(&mut self, tenant: TenantId) {
        StringTree::remove_tenant(self, tenant);
    }
    fn lookup(&self, key: &Box<str>) -> (usize, Vec<TenantId>) {
        let m = self.match_prefix(0, key);
        (m.matched_chars, m.tenants)
    }
    fn full_len(&self, key: &Box<str>) -> usize {
        key.chars().count()
    }
    fn sizes(&self) -> (usize, usize, usize) {
        (self.node_count(), self.total_chars(), self.stored_chars())
    }
    fn tenant_size(&self, tenant: TenantId) -> usize {
        self.tenant_chars(tenant)
    }
    fn check(&self) -> Result<(), IndexError> {
        self.check_invariants()
    }
    fn key(w: u32, i: u32, half: u32) -> Box<str> {
        // 4 shared ~200-char system prompts, then ~60 unique chars.
        let mut sys_state = u64::from(i % 4);
        let sys = synthetic_words(&mut sys_state, 200);
        let mut state = u64::from((w << 16 | i) * 2 + half) + 1_000;
        let tail = synthetic_words(&mut state, 40);
        format!("<|system|>{sys}<|user|>w{w} i{i} h{half} {tail}").into()
    }
}

/// Page size of the token tree in this test, tokens.
const PAGE: usize = 4;

impl Tree for TokenTree {
    type Key = Box<[u32]>;
    fn insert(&mut self, key: &Box<[u32]>, tenant: TenantId) {
        TokenTree::insert(self, 0, key, tenant);
    }
    fn remove_tenant(&mut self, tenant: TenantId) {
        TokenTree::remove_tenant(self, tenant);
    }
    fn lookup(&self, key: &Box<[u32]>) -> (usize, Vec<TenantId>) {
        let m = self.match_prefix(0, key);
        (m.matched_tokens, m.tenants)
    }
    fn full_len(&self, key: &Box<[u32]>) -> usize {
        key.len() / PAGE * PAGE
    }
    fn sizes(&self) -> (usize, usize, usize) {
        (self.node_count(), self.total_tokens(), self.stored_tokens())
    }
    fn tenant_size(&self, tenant: TenantId) -> usize {
        self.tenant_tokens(tenant)
    }
    fn check(&self) -> Result<(), IndexError> {
        self.check_invariants()
    }
    fn key(w: u32, i: u32, half: u32) -> Box<[u32]> {
        // 4 shared 64-token system prompts, then a unique first page (w, i, half) and 6 pages
        // of pseudo-random ids.
        let sys = (0..64u32).map(|t| 1_000_000 + (i % 4) * 1_000 + t);
        let head = [w, i, half, 7];
        let mut x = u64::from((w << 16 | i) * 2 + half).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let tail = (0..24).map(move |_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 150_000) as u32
        });
        sys.chain(head).chain(tail).collect()
    }
}

/// A write: both keys of a pair for one tenant (readers must never see one without the
/// other), or a tenant removal. `id` = writer << 16 | op number.
#[derive(Clone, Debug)]
enum Op<K> {
    Pair {
        id: u32,
        tenant: TenantId,
        a: K,
        b: K,
    },
    Remove {
        id: u32,
        tenant: TenantId,
    },
}

impl<K> Op<K> {
    fn id(&self) -> u32 {
        match self {
            Op::Pair { id, .. } | Op::Remove { id, .. } => *id,
        }
    }
}

/// The structure under `LeftRight`: the tree and the ids of the ops applied to it, in order.
#[derive(Clone)]
struct Versioned<T> {
    tree: T,
    log: Vec<u32>,
}

fn apply<T: Tree>(v: &mut Versioned<T>, op: &Op<T::Key>) {
    match op {
        Op::Pair { tenant, a, b, .. } => {
            v.tree.insert(a, *tenant);
            v.tree.insert(b, *tenant);
        }
        Op::Remove { tenant, .. } => v.tree.remove_tenant(*tenant),
    }
    v.log.push(op.id());
}

fn make_ops<T: Tree>(w: u32) -> Vec<Op<T::Key>> {
    (0..OPS_PER_WRITER)
        .map(|i| {
            let id = w << 16 | i;
            if i % REMOVE_EVERY == REMOVE_EVERY - 1 {
                Op::Remove {
                    id,
                    tenant: w * TENANTS_PER_WRITER + (i / REMOVE_EVERY) % TENANTS_PER_WRITER,
                }
            } else {
                Op::Pair {
                    id,
                    tenant: w * TENANTS_PER_WRITER + i % TENANTS_PER_WRITER,
                    a: T::key(w, i, 0),
                    b: T::key(w, i, 1),
                }
            }
        })
        .collect()
}

/// Op with id `id` (writer ops, or the two extra ops written after quiescence).
fn lookup_op<'a, K>(ops: &'a [Vec<Op<K>>], extra: &'a [Op<K>], id: u32) -> &'a Op<K> {
    let (w, i) = ((id >> 16) as usize, (id & 0xFFFF) as usize);
    match ops.get(w) {
        Some(v) => &v[i],
        None => extra.iter().find(|o| o.id() == id).expect("known op id"),
    }
}

/// Panics unless `got` and `want` are observably the same tree.
fn assert_same<T: Tree>(got: &T, want: &T, ops: &[Vec<Op<T::Key>>], extra: &[Op<T::Key>]) {
    assert_eq!(got.sizes(), want.sizes(), "(nodes, total, stored) differ");
    for t in 0..WRITERS * TENANTS_PER_WRITER {
        assert_eq!(got.tenant_size(t), want.tenant_size(t), "tenant {t} size");
    }
    for op in ops.iter().flatten().chain(extra) {
        if let Op::Pair { a, b, .. } = op {
            assert_eq!(got.lookup(a), want.lookup(a), "match of {a:?}");
            assert_eq!(got.lookup(b), want.lookup(b), "match of {b:?}");
        }
    }
}

fn replay<T: Tree>(
    init: &T,
    log: &[u32],
    ops: &[Vec<Op<T::Key>>],
    extra: &[Op<T::Key>],
) -> Versioned<T> {
    let mut v = Versioned {
        tree: init.clone(),
        log: Vec::new(),
    };
    for &id in log {
        apply(&mut v, lookup_op(ops, extra, id));
    }
    v
}

/// Per-reader tallies.
#[derive(Default, Debug)]
struct ReaderStats {
    reads: u64,
    /// Reads that saw 0 < version < all ops: proof of overlap with the writers.
    intermediate: u64,
    checked: u64,
}

fn stress<T: Tree>(init: T) {
    let ops: Vec<Vec<Op<T::Key>>> = (0..WRITERS).map(make_ops::<T>).collect();
    let total_ops = (WRITERS * OPS_PER_WRITER) as usize;
    let lr = LeftRight::new(
        Versioned {
            tree: init.clone(),
            log: Vec::new(),
        },
        apply::<T>,
    );
    let done = AtomicBool::new(false);
    let writers_running = AtomicUsize::new(WRITERS as usize);
    let write_reads = AtomicU64::new(0);
    let start_line = Barrier::new(READERS + WRITERS as usize);
    let started = Instant::now();

    let stats: Vec<ReaderStats> = std::thread::scope(|s| {
        let readers: Vec<_> = (0..READERS)
            .map(|_| {
                s.spawn(|| {
                    let mut st = ReaderStats::default();
                    let (mut last_len, mut last_id) = (0usize, 0u32);
                    let mut last_check = None;
                    start_line.wait();
                    while !done.load(Ordering::Acquire) && started.elapsed() < READ_LIMIT {
                        let writing = writers_running.load(Ordering::Acquire) > 0;
                        let g = lr.read();
                        let len = g.log.len();
                        assert!(len >= last_len, "version went back: {last_len} -> {len}");
                        if last_len > 0 {
                            assert_eq!(g.log[last_len - 1], last_id, "copies disagree on history");
                        }
                        if let Some(&id) = g.log.last() {
                            if let Op::Pair { tenant, a, b, .. } = lookup_op(&ops, &[], id) {
                                for k in [a, b] {
                                    let (n, ts) = g.tree.lookup(k);
                                    assert_eq!(n, g.tree.full_len(k), "last op not fully visible");
                                    assert_eq!(ts.first(), Some(tenant), "last op's tenant");
                                }
                            }
                            (last_len, last_id) = (len, id);
                        }
                        // The writer waits for reads in flight before each batch, so the
                        // O(nodes) check (~ms) runs at most every CHECK_EVERY per reader;
                        // the other reads stay ~µs as in the router.
                        if last_check.is_none_or(|t: Instant| t.elapsed() >= CHECK_EVERY) {
                            assert_eq!(g.tree.check(), Ok(()), "torn snapshot at version {len}");
                            st.checked += 1;
                            last_check = Some(Instant::now());
                        }
                        drop(g);
                        // Pause outside the read, as a router thread does between requests.
                        // Readers in a tight loop on 2 shared cores get preempted while
                        // holding a read, and the writer (which waits for reads in flight on
                        // the copy it is about to write) then waits a whole time slice (~ms)
                        // per batch: measured 6 ms per op, 30 s for the test.
                        std::thread::sleep(READ_PAUSE);
                        st.reads += 1;
                        if len > 0 && len < total_ops {
                            st.intermediate += 1;
                        }
                        if writing {
                            write_reads.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    st
                })
            })
            .collect();
        // A writer thread replaying the lagging batch between writes, as the gateway's
        // `kv-index` does (`LeftRight::catch_up`), racing the writers for the writer lock.
        let catch_ups = s.spawn(|| {
            let mut did = 0u64;
            while !done.load(Ordering::Acquire) {
                did += u64::from(lr.catch_up());
                std::thread::sleep(Duration::from_micros(50));
            }
            did
        });
        let writers: Vec<_> = ops
            .iter()
            .map(|mine| {
                let (lr, start_line) = (&lr, &start_line);
                s.spawn(move || {
                    start_line.wait();
                    for (i, op) in mine.iter().enumerate() {
                        lr.write(op.clone());
                        // Give the readers (2 cores shared by 4 threads) time slices while
                        // the writes are in flight: ≥ 20 ms of writing per writer.
                        if i % 50 == 49 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer panicked");
            writers_running.fetch_sub(1, Ordering::AcqRel);
        }
        let writing = started.elapsed();
        done.store(true, Ordering::Release);
        let caught_up = catch_ups.join().expect("catch-up thread panicked");
        assert!(caught_up > 0, "the catch-up thread never replayed a batch");
        assert!(
            writing < READ_LIMIT,
            "writers took {writing:?}: readers stopped before the writes ended"
        );
        readers
            .into_iter()
            .map(|r| r.join().expect("reader panicked"))
            .collect()
    });
    let write_reads = write_reads.load(Ordering::Relaxed);
    eprintln!(
        "left_right stress: {stats:?}, reads while writing {write_reads}, {:?}",
        started.elapsed()
    );
    assert!(
        stats.iter().map(|s| s.intermediate).sum::<u64>() > 0 && write_reads > 0,
        "readers never overlapped the writers: the test proved nothing"
    );
    assert!(stats.iter().all(|s| s.checked > 0));

    // Quiescence: every queued op applied and published.
    for _ in 0..1_000 {
        if lr.pending() == 0 {
            break;
        }
        lr.flush();
    }
    assert_eq!(lr.pending(), 0, "queue does not drain");

    // Active copy: every op exactly once, each writer's in its order, equal to a replay.
    let first = lr.read().log.clone();
    let mut sorted = first.clone();
    sorted.sort_unstable();
    let mut want_ids: Vec<u32> = ops.iter().flatten().map(Op::id).collect();
    want_ids.sort_unstable();
    assert_eq!(sorted, want_ids, "ops lost or applied twice");
    for w in 0..WRITERS {
        let mine: Vec<u32> = first.iter().copied().filter(|id| id >> 16 == w).collect();
        assert!(mine.is_sorted(), "writer {w}'s ops reordered");
    }
    let mut want = replay(&init, &first, &ops, &[]);
    {
        let g = lr.read();
        assert_eq!(g.tree.check(), Ok(()));
        assert_same(&g.tree, &want.tree, &ops, &[]);
    }

    // Each further write makes the other copy active (after it catches up on the lagging
    // batch): both copies must equal the replay extended by the same writes.
    let extra: Vec<Op<T::Key>> = (0..2u32)
        .map(|k| Op::Pair {
            id: 0xFFFF_0000 + k,
            tenant: k,
            a: T::key(7, k, 0),
            b: T::key(7, k, 1),
        })
        .collect();
    for op in &extra {
        lr.write(op.clone());
        while lr.pending() > 0 {
            lr.flush();
        }
        apply(&mut want, op);
        let g = lr.read();
        assert_eq!(g.log, want.log, "copy's log after an extra write");
        assert_eq!(g.tree.check(), Ok(()));
        assert_same(&g.tree, &want.tree, &ops, &extra);
    }
}

#[test]
fn string_tree_under_concurrent_readers_and_writers() {
    // Budget: ~1/4 of what the ops insert (10k pairs × ~70 unique chars ×2 ≈ 1.4M chars
    // counted per tenant), so eviction runs during the writes.
    stress(StringTree::with_max_chars(120_000));
}

#[test]
fn token_tree_under_concurrent_readers_and_writers() {
    // Budget in tokens: each pair adds 2 × 28 unique tokens; 10k pairs ≈ 560k tokens.
    stress(TokenTree::new(PAGE, 60_000));
}
