//! A single-writer, many-reader open-addressing hash table of `u64` keys to `W` `u64` words,
//! with lock-free reads: the event index's storage.
//!
//! Readers pin a crossbeam epoch, load the table pointer and probe atomics; they never take a
//! lock nor wait. The one [`TableWriter`] updates words in place with release stores, inserts
//! a new key by writing its words before its key, and grows (or drops tombstones) by building
//! a new table, swapping the pointer and deferring the old table's destruction to the epoch
//! collector. Why epochs rather than snapshot swap: a write changes one or two words, so a
//! copy-on-write snapshot would copy the whole table per event batch; epochs only copy on
//! growth (amortised O(1) per insert) and keep one copy in memory (left-right would keep two).
//!
//! A key whose words are all 0 is a tombstone (kept until the next rebuild). Key 0 marks an
//! empty slot, so a real key 0 is stored as [`ZERO_KEY`] (a 2^-64 collision, accepted).

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Stand-in for key 0 (the golden-ratio constant).
const ZERO_KEY: u64 = 0x9E37_79B9_7F4A_7C15;

#[inline]
fn stored_key(k: u64) -> u64 {
    if k == 0 { ZERO_KEY } else { k }
}

struct Slot<const W: usize> {
    key: AtomicU64,
    words: [AtomicU64; W],
}

struct Table<const W: usize> {
    slots: Box<[Slot<W>]>,
    /// log2 of the slot count.
    bits: u32,
}

impl<const W: usize> Table<W> {
    fn with_bits(bits: u32) -> Self {
        let slots = (0..1usize << bits)
            .map(|_| Slot {
                key: AtomicU64::new(0),
                words: std::array::from_fn(|_| AtomicU64::new(0)),
            })
            .collect();
        Self { slots, bits }
    }

    #[inline]
    fn home(&self, k: u64) -> usize {
        (k.wrapping_mul(ZERO_KEY) >> (64 - self.bits)) as usize
    }

    /// Slot index holding `k`, or the empty slot where it would go.
    #[inline]
    fn find(&self, k: u64) -> (usize, bool) {
        let mask = self.slots.len() - 1;
        let mut i = self.home(k);
        loop {
            let s = self.slots[i].key.load(Ordering::Acquire);
            if s == k {
                return (i, true);
            }
            if s == 0 {
                return (i, false);
            }
            i = (i + 1) & mask;
        }
    }
}

/// The shared, readable side of a table.
pub(crate) struct SharedTable<const W: usize> {
    table: Atomic<Table<W>>,
}

impl<const W: usize> SharedTable<W> {
    /// Words of `k`, all 0 when absent. Lock-free.
    #[inline]
    pub(crate) fn get(&self, k: u64, guard: &Guard) -> [u64; W] {
        let k = stored_key(k);
        // Safety: the pointer is never null after construction, and the table it points to
        // is destroyed only through `defer_destroy` after every guard pinned now is dropped.
        let t = unsafe { self.table.load(Ordering::Acquire, guard).deref() };
        match t.find(k) {
            (i, true) => std::array::from_fn(|w| t.slots[i].words[w].load(Ordering::Acquire)),
            _ => [0; W],
        }
    }

    /// Slots allocated (memory = slots × (8 + 8·W) bytes).
    pub(crate) fn capacity(&self) -> usize {
        let g = epoch::pin();
        // Safety: as in `get`.
        unsafe { self.table.load(Ordering::Acquire, &g).deref() }
            .slots
            .len()
    }
}

impl<const W: usize> Drop for SharedTable<W> {
    fn drop(&mut self) {
        // Safety: `&mut self` means no reader or writer can reach the table any more.
        unsafe {
            let g = epoch::unprotected();
            let t = self.table.load(Ordering::Relaxed, g);
            if !t.is_null() {
                drop(t.into_owned());
            }
        }
    }
}

/// The one writer of a [`SharedTable`].
pub(crate) struct TableWriter<const W: usize> {
    shared: Arc<SharedTable<W>>,
    /// Occupied slots (live keys and tombstones).
    used: usize,
    /// Keys with at least one non-zero word.
    live: usize,
}

impl<const W: usize> TableWriter<W> {
    /// A new empty table and its writer.
    pub(crate) fn new() -> Self {
        Self {
            shared: Arc::new(SharedTable {
                table: Atomic::new(Table::with_bits(4)),
            }),
            used: 0,
            live: 0,
        }
    }

    pub(crate) fn shared(&self) -> Arc<SharedTable<W>> {
        Arc::clone(&self.shared)
    }

    /// Applies `f` to the words of `k` (all 0 when absent) and stores the result.
    pub(crate) fn update(&mut self, k: u64, f: impl FnOnce(&mut [u64; W])) {
        let k = stored_key(k);
        let guard = epoch::pin();
        // Safety: as in `SharedTable::get`; only this writer swaps the pointer.
        let mut t = unsafe { self.shared.table.load(Ordering::Acquire, &guard).deref() };
        let (mut i, mut found) = t.find(k);
        if !found && (self.used + 1) * 4 > t.slots.len() * 3 {
            self.rebuild(&guard);
            // Safety: as above.
            t = unsafe { self.shared.table.load(Ordering::Acquire, &guard).deref() };
            (i, found) = t.find(k);
        }
        let slot = &t.slots[i];
        let old: [u64; W] = if found {
            std::array::from_fn(|w| slot.words[w].load(Ordering::Relaxed))
        } else {
            [0; W]
        };
        let mut new = old;
        f(&mut new);
        let was_live = old.iter().any(|&w| w != 0);
        let is_live = new.iter().any(|&w| w != 0);
        if !found {
            if !is_live {
                return;
            }
            for (w, v) in new.iter().enumerate() {
                slot.words[w].store(*v, Ordering::Relaxed);
            }
            // Release: a reader that sees the key sees its words.
            slot.key.store(k, Ordering::Release);
            self.used += 1;
        } else {
            for (w, v) in new.iter().enumerate() {
                if old[w] != *v {
                    slot.words[w].store(*v, Ordering::Release);
                }
            }
        }
        self.live = self.live + usize::from(is_live) - usize::from(was_live);
    }

    /// Copies the live keys into a fresh table at most half full and publishes it.
    fn rebuild(&mut self, guard: &Guard) {
        // Safety: as in `SharedTable::get`.
        let old = unsafe { self.shared.table.load(Ordering::Acquire, guard).deref() };
        let want = ((self.live + 1) * 2).next_power_of_two().max(16);
        let new = Table::<W>::with_bits(want.trailing_zeros());
        let mut used = 0;
        for s in old.slots.iter() {
            let k = s.key.load(Ordering::Relaxed);
            if k == 0 {
                continue;
            }
            let words: [u64; W] = std::array::from_fn(|w| s.words[w].load(Ordering::Relaxed));
            if words.iter().all(|&w| w == 0) {
                continue;
            }
            let (i, _) = new.find(k);
            for (w, v) in words.iter().enumerate() {
                new.slots[i].words[w].store(*v, Ordering::Relaxed);
            }
            new.slots[i].key.store(k, Ordering::Relaxed);
            used += 1;
        }
        self.used = used;
        let prev = self
            .shared
            .table
            .swap(Owned::new(new), Ordering::AcqRel, guard);
        // Safety: `prev` is unreachable for new readers; readers pinned before the swap keep
        // it alive until their guards drop.
        unsafe { guard.defer_destroy(prev) };
        guard.flush();
    }

    /// Every (key, words) with a non-zero word (tests and pruning).
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn entries(&self) -> Vec<(u64, [u64; W])> {
        let g = epoch::pin();
        // Safety: as in `SharedTable::get`.
        let t = unsafe { self.shared.table.load(Ordering::Acquire, &g).deref() };
        t.slots
            .iter()
            .filter_map(|s| {
                let k = s.key.load(Ordering::Relaxed);
                let w: [u64; W] = std::array::from_fn(|i| s.words[i].load(Ordering::Relaxed));
                (k != 0 && w.iter().any(|&x| x != 0)).then_some((k, w))
            })
            .collect()
    }
}
