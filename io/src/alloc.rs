//! [`RecentFirst`]: the `kvroute` binary's global allocator: mimalloc, with a small per-thread
//! stack of the blocks each thread freed last, handed out again first.
//!
//! # Why
//! A routing decision makes ~29 short-lived allocations (the candidates' snapshot, the
//! policy's vectors, the chat prefix's buffers: a temporary counting allocator, 4,096 workers
//! × 32k tokens, perf/runs/2026-12-07-decision-trims). mimalloc frees a block onto its page's
//! *local* free list and allocates from the page's other list until that one runs out
//! (free-list sharding, Leijen et al., "Mimalloc: Free List Sharding in Action", 2019): the
//! block a decision gets is the next of a page sweep, last touched hundreds of decisions ago,
//! and seldom still in cache; under `callgrind --cache-sim=yes` ~46 of a warm turn's ~400
//! last-level misses outside `memchr` were mimalloc's. glibc's `malloc` reuses the last freed block first (its
//! tcache) but was slower overall here (decision p50 ~1.2×, same directory). So mimalloc
//! stays, and this layer keeps, per thread and per size class, the last [`SLOTS`] blocks
//! freed and returns the most recent first: a decision's vectors land on the lines the
//! previous decision used, still in L1/L2. Measured in `kvroute bench fleet --workers 4096
//! --tokens 32768` against the same build without it: perf/runs/2026-12-07-recent-first.
//!
//! # Cost
//! A block served from a stack costs less than mimalloc's own path (8.2 against 10.8–12.7 ns
//! per alloc + free); one that falls through costs 5–8 ns more. In the gateway ~60 % of the
//! kept-size operations fall through (a block made on one thread and freed on another fills
//! the freeing thread's stacks), at most ~1 % of a token-mode request's CPU
//! (perf/runs/2026-12-08-allocator-cost).
//!
//! # Size classes
//! Blocks of at most [`MAX_BYTES`] bytes and alignment at most 16 ([`class`]): 16, 32, 48,
//! 64 bytes, then four classes per doubling (80, 96, 112, 128, 160, …, 8,192), which are
//! mimalloc's own bin sizes from 64 bytes up (`mi_bin` in its `page-queue.c`; the test
//! `classes_are_mimalloc_block_sizes`), so rounding a request up to its class costs no memory
//! mimalloc would not have spent anyway (below 64 bytes mimalloc's bins are 8 bytes apart:
//! at most 8 bytes more). Anything else goes straight to mimalloc.
//!
//! # Invariants
//! 1. A block in a thread's stack for class `c` was allocated from mimalloc with the layout
//!    (`class bytes`, 16) and is owned by no one else: it is handed out once, by a pop.
//! 2. A class's stack holds at most `slots(c)` blocks (8, fewer above 2 KiB, at most
//!    16 KiB): a thread caches at most ~220 KiB ([`MAX_CACHED_BYTES`]), usually a few KiB.
//! 3. When a thread exits, its stacks are returned to mimalloc and closed: a block freed
//!    later on that thread (by another thread-local's destructor) goes to mimalloc.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::UnsafeCell;

/// Largest block kept, bytes: the largest allocation of a decision at 4,096 workers is the
/// candidates' snapshot (~26 loads of 192 bytes, 4,992 bytes).
pub const MAX_BYTES: usize = 8192;

/// Most blocks kept per class (invariant 2): a warm decision allocates at most 5 blocks of
/// one class (32 bytes; its allocation sites: perf/runs/2026-12-07-recent-first).
pub const SLOTS: usize = 8;

/// Most bytes kept per class (invariant 2): the larger classes keep fewer blocks.
const CLASS_BYTES: usize = 16 * 1024;

/// Size classes ([`class`]): four of 16 bytes, then four per doubling from 64 to
/// [`MAX_BYTES`].
pub const CLASSES: usize = 4 + 4 * (MAX_BYTES.trailing_zeros() as usize - 6);

/// Alignment of every kept block, bytes (mimalloc's `MI_MAX_ALIGN_SIZE`: its blocks of a
/// multiple of 16 bytes are 16-aligned).
const ALIGN: usize = 16;

/// Bytes a thread may keep at most (invariant 2): the sum over classes of the blocks kept
/// per class times the class's bytes.
pub const MAX_CACHED_BYTES: usize = {
    let mut total = 0;
    let mut c = 0;
    while c < CLASSES {
        total += slots(c) * class_bytes(c);
        c += 1;
    }
    total
};

/// Bytes of class `c` (`c < CLASSES`).
const fn class_bytes(c: usize) -> usize {
    if c < 4 {
        return (c + 1) * 16;
    }
    let doubling = (c - 4) / 4 + 6;
    let quarter = (c - 4) % 4 + 1;
    (1 << doubling) + quarter * (1 << (doubling - 2))
}

/// Blocks kept at most for class `c` (invariant 2).
const fn slots(c: usize) -> usize {
    let by_bytes = CLASS_BYTES / class_bytes(c);
    if by_bytes < SLOTS { by_bytes } else { SLOTS }
}

/// [`slots`] of every class, read by `push` (a division per free otherwise).
const SLOTS_OF: [u8; CLASSES] = {
    let mut t = [0; CLASSES];
    let mut c = 0;
    while c < CLASSES {
        t[c] = slots(c) as u8;
        c += 1;
    }
    t
};

/// The size class of a request of `layout` and its block size in bytes (≥ `layout.size()`),
/// or `None` when blocks of that layout are not kept (more than [`MAX_BYTES`], or an
/// alignment above 16).
#[inline]
pub fn class(layout: Layout) -> Option<(usize, usize)> {
    let size = layout.size().max(1);
    if size > MAX_BYTES || layout.align() > ALIGN {
        return None;
    }
    if size <= 64 {
        let c = size.div_ceil(16) - 1;
        return Some((c, class_bytes(c)));
    }
    // `size` in (2^d, 2^(d+1)], split in four steps of 2^(d-2).
    let d = (usize::BITS - 1 - (size - 1).leading_zeros()) as usize;
    let quarter = (size - (1 << d)).div_ceil(1 << (d - 2));
    let c = 4 + (d - 6) * 4 + quarter - 1;
    Some((c, class_bytes(c)))
}

/// One thread's stacks (invariants 1–3).
struct Stacks {
    /// Set when the thread's stacks were returned (invariant 3).
    closed: bool,
    len: [u8; CLASSES],
    blocks: [[*mut u8; SLOTS]; CLASSES],
}

thread_local! {
    /// This thread's stacks. `const` and without a destructor, so the allocator may read it
    /// at any point of the thread's life, its exit included.
    static STACKS: UnsafeCell<Stacks> = const {
        UnsafeCell::new(Stacks {
            closed: false,
            len: [0; CLASSES],
            blocks: [[std::ptr::null_mut(); SLOTS]; CLASSES],
        })
    };
    /// Returns the stacks on thread exit (invariant 3); registered at the thread's first
    /// kept block.
    static RETURN_AT_EXIT: ReturnAtExit = const { ReturnAtExit };
}

/// Blocks kept in all threads' stacks: what the tests check.
#[cfg(test)]
static KEPT: std::sync::atomic::AtomicIsize = std::sync::atomic::AtomicIsize::new(0);

#[inline]
fn count_kept(_delta: isize) {
    #[cfg(test)]
    KEPT.fetch_add(_delta, std::sync::atomic::Ordering::Relaxed);
}

struct ReturnAtExit;

impl Drop for ReturnAtExit {
    fn drop(&mut self) {
        STACKS.with(|s| {
            // SAFETY: the only other borrows of `STACKS` are inside `pop` and `push`, which
            // neither allocate nor call out, so none is live while this runs.
            let s = unsafe { &mut *s.get() };
            s.closed = true;
            for c in 0..CLASSES {
                for &p in &s.blocks[c][..usize::from(s.len[c])] {
                    // SAFETY: invariant 1: `p` came from mimalloc with this layout and is
                    // owned by no one; `class_bytes(c)` is a non-zero multiple of 16.
                    unsafe {
                        mimalloc::MiMalloc
                            .dealloc(p, Layout::from_size_align_unchecked(class_bytes(c), ALIGN))
                    };
                }
                count_kept(-isize::from(s.len[c]));
                s.len[c] = 0;
            }
        });
    }
}

/// The most recently kept block of class `c`, if any.
#[inline]
fn pop(c: usize) -> Option<*mut u8> {
    STACKS.with(|s| {
        // SAFETY: see `ReturnAtExit::drop`: this borrow ends before anything else runs.
        let s = unsafe { &mut *s.get() };
        let n = s.len[c].checked_sub(1)?;
        s.len[c] = n;
        count_kept(-1);
        Some(s.blocks[c][usize::from(n)])
    })
}

/// Keeps `p` (a block of class `c`, invariant 1) unless the class's stack is full or the
/// thread's stacks are closed or cannot be returned at its exit; false when not kept.
#[inline]
fn push(c: usize, p: *mut u8) -> bool {
    // Registers the return at exit on first use; fails once it has run.
    if RETURN_AT_EXIT.try_with(|_| ()).is_err() {
        return false;
    }
    STACKS.with(|s| {
        // SAFETY: see `ReturnAtExit::drop`.
        let s = unsafe { &mut *s.get() };
        let n = usize::from(s.len[c]);
        if s.closed || n >= usize::from(SLOTS_OF[c]) {
            return false;
        }
        s.blocks[c][n] = p;
        s.len[c] += 1;
        count_kept(1);
        true
    })
}

/// The global allocator of the `kvroute` binary (module doc).
#[derive(Debug, Clone, Copy, Default)]
pub struct RecentFirst;

// SAFETY: every block handed out is either mimalloc's answer to a layout at least as large
// and as aligned as the request's (a kept class's block: `class` rounds the size up, and its
// blocks are 16-aligned, ≥ any kept request's alignment), or a block popped from a stack,
// which invariant 1 makes unowned and of the same class. A block is freed to mimalloc with a
// layout mimalloc ignores but for its alignment, which is ≤ 16 for kept classes.
unsafe impl GlobalAlloc for RecentFirst {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match class(layout) {
            Some((c, bytes)) => match pop(c) {
                Some(p) => p,
                // SAFETY: `bytes` is a non-zero multiple of 16 and 16 a power of two.
                None => unsafe {
                    mimalloc::MiMalloc.alloc(Layout::from_size_align_unchecked(bytes, ALIGN))
                },
            },
            // SAFETY: the caller's layout has a non-zero size (GlobalAlloc's contract).
            None => unsafe { mimalloc::MiMalloc.alloc(layout) },
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if let Some((c, _)) = class(layout)
            && push(c, ptr)
        {
            return;
        }
        // SAFETY: `ptr` was allocated by `alloc` above, from mimalloc (GlobalAlloc's
        // contract: this allocator, this layout).
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match class(layout) {
            Some((c, bytes)) => match pop(c) {
                // SAFETY: a popped block holds `bytes ≥ layout.size()` bytes (invariant 1).
                Some(p) => unsafe {
                    std::ptr::write_bytes(p, 0, layout.size());
                    p
                },
                // SAFETY: as `alloc`.
                None => unsafe {
                    mimalloc::MiMalloc.alloc_zeroed(Layout::from_size_align_unchecked(bytes, ALIGN))
                },
            },
            // SAFETY: as `alloc`; mimalloc skips zeroing memory fresh from the OS (the event
            // index's large slabs).
            None => unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) },
        }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY (the layout): GlobalAlloc's contract makes `new_size`, rounded up to
        // `layout.align()`, not overflow.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (class(layout), class(new)) {
            // SAFETY: neither block is kept: mimalloc's own.
            (None, None) => unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) },
            // The block (class bytes) already holds `new_size`.
            (Some((a, _)), Some((b, _))) if a == b => ptr,
            // SAFETY: a new block, the live bytes copied, the old one freed as `dealloc`.
            _ => unsafe {
                let p = self.alloc(new);
                if !p.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                p
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::Ordering;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).expect("a valid layout")
    }

    /// Runs `f` on a thread of its own, one such test at a time: its stacks start empty,
    /// and [`KEPT`] counts only what finished threads left behind.
    fn on_own_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        std::thread::spawn(f).join().expect("the test thread runs")
    }

    #[test]
    fn classes_round_up_to_worked_sizes() {
        let bytes = |s| class(layout(s, 8)).map(|(_, b)| b);
        // Four 16-byte classes, then four per doubling.
        for (size, want) in [
            (0, 16),
            (1, 16),
            (16, 16),
            (17, 32),
            (64, 64),
            (65, 80),
            (128, 128),
            (129, 160),
            (192, 192),
            (193, 224),
            (4992, 5120),
            (8192, 8192),
        ] {
            assert_eq!(bytes(size), Some(want), "size {size}");
        }
        assert_eq!(bytes(8193), None);
        assert_eq!(
            class(layout(64, 32)),
            None,
            "alignment above 16 is not kept"
        );
        assert_eq!(class(layout(8192, 1)), Some((CLASSES - 1, 8192)));
    }

    #[test]
    fn classes_are_ordered_and_tight() {
        // Brute force over every kept size: the class holds the size, classes grow with the
        // size, and a class is at most a quarter (or 15 bytes) above the size.
        let mut last = 0;
        for size in 1..=MAX_BYTES {
            let (c, bytes) = class(layout(size, 1)).expect("kept");
            assert!(bytes >= size && bytes % 16 == 0, "size {size}: {bytes}");
            assert!(c >= last && c < CLASSES, "size {size}: class {c}");
            assert!(bytes <= size + (size / 4).max(15), "size {size}: {bytes}");
            assert_eq!(class_bytes(c), bytes);
            last = c;
        }
        assert_eq!(last, CLASSES - 1);
    }

    #[test]
    fn classes_are_mimalloc_block_sizes() {
        // Rounding a request up to its class spends what mimalloc spends on the class's
        // size anyway (from 64 bytes up; below, its bins are 8 bytes apart).
        for c in 0..CLASSES {
            // SAFETY: `mi_good_size` only computes.
            let good = unsafe { libmimalloc_sys::mi_good_size(class_bytes(c)) };
            assert_eq!(good, class_bytes(c), "class {c}");
        }
    }

    #[test]
    fn bound_on_kept_bytes() {
        // Classes up to 2,048 bytes keep 8: 8 × 13,056; then 2,560…4,096 keep 6, 5, 4, 4
        // (61,440 bytes) and 5,120…8,192 keep 3, 2, 2, 2 (58,368).
        assert_eq!(MAX_CACHED_BYTES, 8 * 13_056 + 61_440 + 58_368);
        assert_eq!(MAX_CACHED_BYTES, 224_256);
        assert_eq!(slots(0), SLOTS);
        assert_eq!(slots(CLASSES - 1), 2);
        for (c, &n) in SLOTS_OF.iter().enumerate() {
            assert_eq!(usize::from(n), slots(c), "class {c}");
        }
    }

    #[test]
    fn the_last_freed_block_comes_back_first() {
        on_own_thread(the_last_freed_block_comes_back_first_here);
    }

    fn the_last_freed_block_comes_back_first_here() {
        let a = RecentFirst;
        // SAFETY: layouts of non-zero size; each block freed once with its layout.
        unsafe {
            let p = a.alloc(layout(100, 8));
            let q = a.alloc(layout(100, 8));
            a.dealloc(p, layout(100, 8));
            a.dealloc(q, layout(100, 8));
            // Most recent first, and any size of the class (97..=112) takes it.
            assert_eq!(a.alloc(layout(112, 16)), q);
            assert_eq!(a.alloc(layout(97, 1)), p);
            // Another class does not.
            let r = a.alloc(layout(200, 8));
            assert!(r != p && r != q);
            // Growing within the class keeps the block; beyond it moves (and keeps) it.
            assert_eq!(a.realloc(p, layout(97, 1), 112), p);
            let moved = a.realloc(p, layout(112, 1), 113);
            assert_ne!(moved, p);
            assert_eq!(a.alloc(layout(100, 1)), p, "the old block was kept");
            for (x, l) in [
                (moved, layout(113, 1)),
                (p, layout(100, 1)),
                (q, layout(112, 16)),
                (r, layout(200, 8)),
            ] {
                a.dealloc(x, l);
            }
        }
    }

    #[test]
    fn a_class_keeps_at_most_its_slots_and_exit_returns_them() {
        let l = layout(6000, 8);
        let c = class(l).expect("kept").0;
        let before = KEPT.load(Ordering::Relaxed);
        let kept = on_own_thread(move || {
            let a = RecentFirst;
            // SAFETY: each block freed once with its layout.
            unsafe {
                let ps: Vec<*mut u8> = (0..SLOTS).map(|_| a.alloc(l)).collect();
                for &p in &ps {
                    a.dealloc(p, l);
                }
            }
            let here = STACKS.with(|s| {
                // SAFETY: no allocator call runs while this borrow lives.
                usize::from(unsafe { &*s.get() }.len[c])
            });
            (here, KEPT.load(Ordering::Relaxed))
        });
        // A 6,000-byte block is of class 6,144: 16 KiB keep two.
        assert_eq!(kept.0, 2);
        assert_eq!(kept.1, before + 2, "kept while the thread lived");
        assert_eq!(KEPT.load(Ordering::Relaxed), before, "returned at its exit");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc { size: usize, align_log: u32 },
        Free(usize),
        Grow(usize, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            ((1usize..10_000), 0u32..6).prop_map(|(size, align_log)| Op::Alloc { size, align_log }),
            any::<usize>().prop_map(Op::Free),
            (any::<usize>(), 1usize..10_000).prop_map(|(i, size)| Op::Grow(i, size)),
        ]
    }

    /// Fills `p[..n]` with `tag`.
    fn fill(p: *mut u8, n: usize, tag: u8) {
        // SAFETY: the caller owns `n` bytes at `p`.
        unsafe { std::ptr::write_bytes(p, tag, n) };
    }

    fn holds(p: *mut u8, n: usize, tag: u8) -> bool {
        // SAFETY: as `fill`.
        unsafe { std::slice::from_raw_parts(p, n) }
            .iter()
            .all(|&b| b == tag)
    }

    proptest! {
        /// Random allocations, frees and reallocations, each live block filled with its own
        /// byte: blocks are aligned, never handed out twice while live (no live block's
        /// bytes change under another's writes), and a reallocation keeps the bytes.
        #[test]
        fn live_blocks_are_distinct_aligned_and_kept(ops in proptest::collection::vec(op(), 1..200)) {
            on_own_thread(move || live_blocks_here(ops))?;
        }
    }

    fn live_blocks_here(ops: Vec<Op>) -> Result<(), TestCaseError> {
        let a = RecentFirst;
        let mut live: Vec<(*mut u8, Layout, u8)> = Vec::new();
        let mut tag = 0u8;
        for op in ops {
            match op {
                Op::Alloc { size, align_log } => {
                    let l = layout(size, 1 << align_log);
                    tag = tag.wrapping_add(1);
                    // SAFETY: a non-zero size.
                    let p = unsafe { a.alloc(l) };
                    prop_assert!(!p.is_null());
                    prop_assert_eq!(p as usize % l.align(), 0);
                    fill(p, size, tag);
                    live.push((p, l, tag));
                }
                Op::Free(i) if !live.is_empty() => {
                    let (p, l, t) = live.swap_remove(i % live.len());
                    prop_assert!(holds(p, l.size(), t));
                    // SAFETY: allocated above with `l`, freed once.
                    unsafe { a.dealloc(p, l) };
                }
                Op::Grow(i, size) if !live.is_empty() => {
                    let i = i % live.len();
                    let (p, l, t) = live[i];
                    // SAFETY: allocated above with `l`; a non-zero new size.
                    let q = unsafe { a.realloc(p, l, size) };
                    prop_assert!(!q.is_null());
                    prop_assert!(holds(q, l.size().min(size), t));
                    let nl = layout(size, l.align());
                    fill(q, size, t);
                    live[i] = (q, nl, t);
                }
                _ => {}
            }
            for &(p, l, t) in &live {
                prop_assert!(holds(p, l.size(), t), "a live block changed");
            }
        }
        for (p, l, _) in live {
            // SAFETY: allocated above with `l`, freed once.
            unsafe { a.dealloc(p, l) };
        }
        Ok(())
    }
}
