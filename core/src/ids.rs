//! [`TokenIds`] and [`BlockKeySeq`]: a request's token ids and block keys, shared without
//! copying, and extended in place when a conversation's next turn appends to them
//! ([`Shared`]).
//!
//! A chat client resends the whole conversation every turn, so the router's ids for turn
//! N+1 are turn N's ids up to its last message, then the new messages' ids
//! ([`crate::chat_prefix`]). A `TokenIds` is the first `len` ids of an append-only buffer
//! that keeps room past its end ([`grown`]): turn N+1 writes its new ids right after turn
//! N's, in the same buffer, when nothing else was written there, and its key reads the whole
//! conversation from that buffer. So a turn costs O(its new ids), not O(conversation): with
//! the per-turn copy of a 33k-token head into a new `Arc<[u32]>` gone, parsing and
//! tokenizing a turn went from 73.2 to 29.7 µs p50 (`kvroute bench fleet --workers 1024
//! --tokens 32768`, medians of 3 interleaved rounds, `perf/runs/2026-12-06-token-ids/`).
//!
//! A request that extends a head some other request already extended differently (an edited
//! or regenerated turn, two branches of one conversation) gets a new buffer: the head is
//! copied once, as before. A turn's block keys ([`crate::policy::Router::request`]) extend
//! the previous turn's the same way (2,080 keys at 33k tokens were copied three times).
//!
//! # Invariants
//! 1. A buffer's `filled` (behind its mutex) only grows, up to the capacity; the ids
//!    `[..filled]` are initialised and never written again.
//! 2. Every write happens with the mutex held, into `[filled..new]`, before `filled` becomes
//!    `new`.
//! 3. A `TokenIds` reads `[..len]` of its buffer with `len <= filled` from its creation on,
//!    so it reads initialised ids that no one writes (1), without the mutex.
//!
//! The unsafe code is checked under Miri (stacked borrows, threads included):
//! `cargo +nightly miri test -p kvroute-core --lib ids::tests -- --skip extensions_read`.

use std::cell::UnsafeCell;
use std::fmt;
use std::mem::MaybeUninit;
use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::copy::copy_unaliased;

/// Items of room a buffer keeps past its end at least (256 bytes of ids, 512 of keys): a
/// short reply and question extend a short conversation in place. Kept small because the
/// chat prefix cache charges a buffer's capacity ([`Shared::capacity`]) and copying a short
/// head again costs little; the room that saves copies is a long conversation's half
/// ([`grown`]).
pub const MIN_HEADROOM: usize = 64;

/// Capacity, items, of a buffer made for `len` items that later turns may extend: `len` + half
/// of it + [`MIN_HEADROOM`]. A 1.5× growth factor (folly's `fbvector`, MSVC's `std::vector`)
/// bounds the copies of a growing conversation to O(1) amortised per item while wasting at
/// most a third of a buffer.
pub fn grown(len: usize) -> usize {
    len + len / 2 + MIN_HEADROOM
}

/// An append-only buffer (module invariants).
struct Buffer<T> {
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
    /// Initialised items from the start (invariant 1).
    filled: Mutex<usize>,
}

// SAFETY: shared access either reads `[..len]` with `len <= filled` (initialised and never
// written again, invariants 1 and 3), or writes `[filled..new]` with the mutex held
// (invariant 2), which no reader reads (its `len` is at most the `filled` it saw) and no other
// writer touches (the mutex). So no two threads access one slot unless both read it.
unsafe impl<T: Send + Sync> Sync for Buffer<T> {}

impl<T: Copy> Buffer<T> {
    /// An empty buffer of `capacity` items.
    fn new(capacity: usize) -> Self {
        let slots: Box<[MaybeUninit<T>]> = Box::new_uninit_slice(capacity);
        // SAFETY: `UnsafeCell<T>` is `repr(transparent)` over `T`, so the two slices have one
        // layout and the pointer cast keeps the allocation's length and provenance.
        let slots =
            unsafe { Box::from_raw(Box::into_raw(slots) as *mut [UnsafeCell<MaybeUninit<T>>]) };
        Self {
            slots,
            filled: Mutex::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, usize> {
        // Nothing panics with the lock held after `filled` changes: the value is always true.
        self.filled.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends `src` after the `filled` items, which the caller holds the lock of.
    ///
    /// # Panics
    /// When `src` does not fit in the capacity.
    fn append(&self, filled: &mut MutexGuard<'_, usize>, src: &[T]) {
        let at = **filled;
        assert!(
            at + src.len() <= self.slots.len(),
            "the items fit the buffer"
        );
        let base = UnsafeCell::raw_get(self.slots.as_ptr());
        // SAFETY: `[at..at + src.len()]` is inside the allocation (the assert); with the lock
        // held and `at == filled`, no reader reads these slots and no one else writes them
        // (invariants 2 and 3), so this is the only reference to them.
        let dst = unsafe { std::slice::from_raw_parts_mut(base.add(at), src.len()) };
        copy_unaliased(dst, src);
        **filled = at + src.len();
    }

    /// Items `[from..to]`.
    ///
    /// # Safety
    /// `to` is at most a `filled` this buffer had (invariant 1: initialised, never written).
    unsafe fn read(&self, from: usize, to: usize) -> &[T] {
        debug_assert!(from <= to && to <= self.slots.len());
        let base = UnsafeCell::raw_get(self.slots.as_ptr()) as *const T;
        // SAFETY: the caller's contract; `MaybeUninit<T>` has the layout of `T`.
        unsafe { std::slice::from_raw_parts(base.add(from), to - from) }
    }
}

/// The first `len` items of an append-only buffer (module doc): derefs to `[T]`; cloning
/// shares them (one atomic increment).
pub struct Shared<T> {
    buf: Arc<Buffer<T>>,
    len: usize,
}

/// A request's token ids.
pub type TokenIds = Shared<u32>;

/// A request's block keys ([`kvroute_index::keys::block_keys_in`]).
pub type BlockKeySeq = Shared<u64>;

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Self {
            buf: Arc::clone(&self.buf),
            len: self.len,
        }
    }
}

impl<T: Copy + PartialEq> Shared<T> {
    /// `items` in a buffer of [`grown`] capacity, for a prompt later turns extend.
    pub fn with_headroom(items: &[T]) -> Self {
        Self::in_buffer(items, &[], grown(items.len()))
    }

    /// `head` then `tail` in a new buffer of `capacity` items (≥ their sum).
    fn in_buffer(head: &[T], tail: &[T], capacity: usize) -> Self {
        let buf = Buffer::new(capacity);
        {
            let mut filled = buf.lock();
            buf.append(&mut filled, head);
            buf.append(&mut filled, tail);
        }
        Self {
            buf: Arc::new(buf),
            len: head.len() + tail.len(),
        }
    }

    /// The first `n` items (`n <= self.len()`), sharing the buffer.
    ///
    /// # Panics
    /// When `n > self.len()`.
    pub fn head(&self, n: usize) -> Self {
        assert!(n <= self.len, "a head of at most the items");
        Self {
            buf: Arc::clone(&self.buf),
            len: n,
        }
    }

    /// The first `n` items (`n <= self.len()`) then `tail`. In this buffer when what it holds
    /// past `n` is a prefix of `tail` (nothing, or what this request wrote after its head,
    /// such as a generation prompt the next turn's message starts with) and `tail` fits: the
    /// rest of `tail` is appended, O(`tail`). The same when `tail` is already there (a
    /// request sent again). Else (another request extended the head differently, or no room)
    /// in a new buffer of [`grown`] capacity: O(`n` + `tail`).
    ///
    /// # Panics
    /// When `n > self.len()`.
    pub fn head_then(&self, n: usize, tail: &[T]) -> Self {
        assert!(n <= self.len, "a head of at most the items");
        let want = n + tail.len();
        {
            let mut filled = self.buf.lock();
            // SAFETY: `*filled` is the buffer's `filled` now (lock held).
            let written = unsafe { self.buf.read(n, *filled) };
            let common = written.iter().zip(tail).take_while(|(a, b)| a == b).count();
            if common == tail.len() {
                return Self {
                    buf: Arc::clone(&self.buf),
                    len: want,
                };
            }
            if common == written.len() && want <= self.buf.slots.len() {
                self.buf.append(&mut filled, &tail[common..]);
                return Self {
                    buf: Arc::clone(&self.buf),
                    len: want,
                };
            }
        }
        Self::in_buffer(&self[..n], tail, grown(want))
    }

    /// Items the buffer holds room for (what it costs in memory): at least
    /// `self.len()`, shared with every `TokenIds` of the buffer.
    pub fn capacity(&self) -> usize {
        self.buf.slots.len()
    }

    /// Whether `self` and `other` read one buffer (tests and benchmarks: no copy was made).
    pub fn shares_buffer(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }
}

impl<T: Copy> Deref for Shared<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` was at most `filled` when `self` was made (invariant 3).
        unsafe { self.buf.read(0, self.len) }
    }
}

impl<T: Copy + PartialEq> Default for Shared<T> {
    /// No items, in a buffer of none.
    fn default() -> Self {
        Self::from(&[][..])
    }
}

impl<T: Copy + PartialEq> From<&[T]> for Shared<T> {
    /// A buffer of exactly `items.len()`: items a later turn does not extend (a body's or a
    /// header's ids), copied by [`copy_unaliased`].
    fn from(items: &[T]) -> Self {
        Self::in_buffer(items, &[], items.len())
    }
}

impl<T: Copy + PartialEq> From<Vec<T>> for Shared<T> {
    fn from(items: Vec<T>) -> Self {
        Self::from(items.as_slice())
    }
}

impl<T: Copy + PartialEq> FromIterator<T> for Shared<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Self::from(iter.into_iter().collect::<Vec<T>>())
    }
}

impl<T: Copy + PartialEq> PartialEq for Shared<T> {
    /// Equal items, wherever they are held.
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Copy + Eq> Eq for Shared<T> {}

impl<T: Copy + fmt::Debug> fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_conversation_extends_one_buffer_and_a_branch_copies() {
        let turn1 = TokenIds::with_headroom(&[1, 2, 3, 9, 9]); // head 3 ids, then a prompt
        assert_eq!(turn1.capacity(), grown(5));
        // Turn 2 keeps 3 ids and its new message starts with the prompt turn 1 wrote.
        let turn2 = turn1.head_then(3, &[9, 9, 4, 5]);
        assert!(turn2.shares_buffer(&turn1));
        assert_eq!(&*turn2, &[1, 2, 3, 9, 9, 4, 5]);
        assert_eq!(&*turn1, &[1, 2, 3, 9, 9], "turn 1 still reads its own ids");
        // Turn 2 sent again: its ids are there already.
        let again = turn1.head_then(3, &[9, 9, 4, 5]);
        assert!(again.shares_buffer(&turn1));
        assert_eq!(again, turn2);
        // An edited turn 2 (differs at its third id): a branch, in a new buffer.
        let edit = turn1.head_then(3, &[9, 9, 7]);
        assert!(!edit.shares_buffer(&turn1));
        assert_eq!(&*edit, &[1, 2, 3, 9, 9, 7]);
        assert_eq!(edit.capacity(), grown(6));
        assert_eq!(
            &*turn2,
            &[1, 2, 3, 9, 9, 4, 5],
            "the branch left turn 2 alone"
        );
        // A turn that does not fit: a new buffer.
        let big: Vec<u32> = (0..grown(7) as u32).collect();
        let long = turn2.head_then(7, &big);
        assert!(!long.shares_buffer(&turn2));
        assert_eq!(long.len(), 7 + big.len());
        assert_eq!(&long[7..], &big[..]);
    }

    #[test]
    fn exact_buffers_and_equality_by_value() {
        let a = TokenIds::from(vec![5, 6]);
        assert_eq!(a.capacity(), 2);
        let b: TokenIds = [5, 6].into_iter().collect();
        assert_eq!(a, b);
        assert!(!a.shares_buffer(&b));
        assert_eq!(format!("{a:?}"), "[5, 6]");
        assert_eq!(a.head(1).len(), 1);
        let empty = TokenIds::from(&[][..]);
        assert!(empty.is_empty());
        // No room at all: extending copies.
        assert!(!a.head_then(2, &[7]).shares_buffer(&a));
    }

    #[test]
    fn threads_extending_one_head_each_read_their_own_ids() {
        let head: Vec<u32> = (0..100).collect();
        let base = TokenIds::with_headroom(&head);
        let results: Vec<(Vec<u32>, TokenIds)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8u32)
                .map(|t| {
                    let (base, head) = (base.clone(), &head);
                    s.spawn(move || {
                        let mut out = Vec::new();
                        for k in 0..50u32 {
                            // Half the threads share a tail (appends or finds it), half branch.
                            let tail: Vec<u32> =
                                (0..k % 7 + 1).map(|i| 1000 + (t % 2) * 100 + i).collect();
                            let ids = base.head_then(100 - (k as usize % 3), &tail);
                            let mut want = head[..100 - (k as usize % 3)].to_vec();
                            want.extend(&tail);
                            out.push((want, ids));
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        for (want, ids) in &results {
            assert_eq!(&**ids, &want[..]);
        }
        assert!(results.iter().any(|(_, ids)| ids.shares_buffer(&base)));
    }

    proptest! {
        /// Against a brute-force model (each `TokenIds` as its own `Vec`): any sequence of
        /// extensions of any earlier ids reads what the model says, and every earlier value
        /// still reads its own ids.
        #[test]
        fn extensions_read_what_a_vec_model_says(
            first in proptest::collection::vec(0u32..4, 0..40),
            steps in proptest::collection::vec(
                (any::<proptest::sample::Index>(), any::<proptest::sample::Index>(),
                 proptest::collection::vec(0u32..4, 0..30)),
                1..40,
            ),
        ) {
            let mut made = vec![(TokenIds::with_headroom(&first), first.clone())];
            for (which, cut, tail) in steps {
                let (ids, model) = &made[which.index(made.len())];
                let n = cut.index(model.len() + 1);
                let next = ids.head_then(n, &tail);
                let mut want = model[..n].to_vec();
                want.extend(&tail);
                prop_assert_eq!(&*next, &want[..]);
                prop_assert!(next.capacity() >= next.len());
                made.push((next, want));
                for (ids, model) in &made {
                    prop_assert_eq!(&**ids, &model[..]);
                }
            }
        }
    }
}
