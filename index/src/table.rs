//! A single-writer, many-reader open-addressing hash table of `u64` keys to a row of `words`
//! `u64` words (a worker bitset: bit `w % 64` of word `w / 64` = worker `w`), with lock-free
//! reads: the event index's storage.
//!
//! Readers pin a crossbeam epoch, load the table pointer and probe atomics; they never take a
//! lock nor wait. The one [`TableWriter`] updates words in place with release stores, inserts
//! a new key by writing its words before its key, and grows (or drops tombstones) by building
//! a new table, swapping the pointer and deferring the old table's destruction to the epoch
//! collector. Why epochs rather than snapshot swap: a write changes one word, so a
//! copy-on-write snapshot would copy the whole table per event batch; epochs only copy on
//! growth (amortised O(1) per insert) and keep one copy in memory (left-right would keep two).
//!
//! The row width is chosen at construction (`words` = ⌈max workers / 64⌉), so one probe
//! answers for every worker: the positional index probes one key per block position, not one
//! per 64-worker shard. Slots are laid out flat, `[key, word 0, …, word words−1]`, so a probe
//! touches one or two cache lines.
//!
//! A key whose words are all 0 is a tombstone (kept until the next rebuild). Key 0 marks an
//! empty slot, so a real key 0 is stored as [`ZERO_KEY`] (a 2^-64 collision, accepted).

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Stand-in for key 0 (the golden-ratio constant).
pub(crate) const ZERO_KEY: u64 = 0x9E37_79B9_7F4A_7C15;

#[inline]
fn stored_key(k: u64) -> u64 {
    if k == 0 { ZERO_KEY } else { k }
}

/// Slot array: `len` slots of `1 + words` atomics each.
struct Table {
    cells: Box<[AtomicU64]>,
    /// Atomics per slot (`1 + words`).
    stride: usize,
    /// Slot count (any size ≥ 16: homes come from a multiply-shift, not a mask).
    len: usize,
}

impl Table {
    fn with_slots(len: usize, words: usize) -> Self {
        let stride = 1 + words;
        let cells = (0..len * stride).map(|_| AtomicU64::new(0)).collect();
        Self { cells, stride, len }
    }

    #[inline]
    fn slots(&self) -> usize {
        self.len
    }

    #[inline]
    fn key(&self, i: usize) -> &AtomicU64 {
        &self.cells[i * self.stride]
    }

    #[inline]
    fn words(&self, i: usize) -> &[AtomicU64] {
        &self.cells[i * self.stride + 1..(i + 1) * self.stride]
    }

    #[inline]
    fn home(&self, k: u64) -> usize {
        // Lemire's multiply-shift range reduction of a mixed key: uniform over any length.
        ((u128::from(k.wrapping_mul(ZERO_KEY)) * self.len as u128) >> 64) as usize
    }

    /// Slot index holding `k`, or the empty slot where it would go.
    #[inline]
    fn find(&self, k: u64) -> (usize, bool) {
        let mut i = self.home(k);
        loop {
            let s = self.key(i).load(Ordering::Acquire);
            if s == k {
                return (i, true);
            }
            if s == 0 {
                return (i, false);
            }
            i += 1;
            if i == self.len {
                i = 0;
            }
        }
    }
}

/// The shared, readable side of a table.
pub(crate) struct SharedTable {
    table: Atomic<Table>,
    words: usize,
}

impl SharedTable {
    /// Words per row (⌈workers / 64⌉).
    pub(crate) fn words(&self) -> usize {
        self.words
    }

    /// Copies the words of `k` into `out` (`out.len() == words`); all 0 when absent. Returns
    /// whether any word is non-zero. Lock-free.
    #[inline]
    pub(crate) fn get_into(&self, k: u64, guard: &Guard, out: &mut [u64]) -> bool {
        let k = stored_key(k);
        // Safety: the pointer is never null after construction, and the table it points to
        // is destroyed only through `defer_destroy` after every guard pinned now is dropped.
        let t = unsafe { self.table.load(Ordering::Acquire, guard).deref() };
        match t.find(k) {
            (i, true) => {
                let mut any = 0;
                for (o, w) in out.iter_mut().zip(t.words(i)) {
                    *o = w.load(Ordering::Acquire);
                    any |= *o;
                }
                any != 0
            }
            _ => {
                out.fill(0);
                false
            }
        }
    }

    /// Slots allocated (memory = slots × 8 × (1 + words) bytes).
    pub(crate) fn capacity(&self) -> usize {
        let g = epoch::pin();
        // Safety: as in `get_into`.
        unsafe { self.table.load(Ordering::Acquire, &g).deref() }.slots()
    }

    /// Bytes allocated for slots: capacity × 8 × (1 + words).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.capacity() * 8 * (1 + self.words)
    }
}

impl Drop for SharedTable {
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

/// Smallest table, slots.
const MIN_SLOTS: usize = 16;
/// Most occupied slots (live + tombstones) before a rebuild, as a fraction: 4/5. Reads are
/// mostly hits (expected ≈ 3 probes at 0.8 with linear probing), and any length is allowed,
/// so memory per key stays within 8·(1+words)/0.8 … 8·(1+words)/0.5 bytes instead of the
/// 0.375–0.75 load swing of power-of-two sizes (grid fixture of `kvroute bench index`, 8k
/// tokens × 256 workers: 77.8 → 73.2 bytes per (worker, block) in total).
const MAX_LOAD: (usize, usize) = (4, 5);
/// Slots per live key after a rebuild, as a fraction: 2/1 (load 0.5).
const GROWTH: (usize, usize) = (2, 1);

/// The one writer of a [`SharedTable`].
///
/// # Invariants
/// 1. `used` = occupied slots (live keys and tombstones); `live` = keys with a non-zero word.
/// 2. `used` ≤ 4/5 of the slots (linear probing always finds an empty slot).
pub(crate) struct TableWriter {
    shared: Arc<SharedTable>,
    used: usize,
    live: usize,
}

impl TableWriter {
    /// A new empty table of `words` words per row (≥ 1) and its writer.
    pub(crate) fn new(words: usize) -> Self {
        let words = words.max(1);
        Self {
            shared: Arc::new(SharedTable {
                table: Atomic::new(Table::with_slots(MIN_SLOTS, words)),
                words,
            }),
            used: 0,
            live: 0,
        }
    }

    pub(crate) fn shared(&self) -> Arc<SharedTable> {
        Arc::clone(&self.shared)
    }

    /// Keys with a non-zero word.
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    /// Sets (`set = true`) or clears bit `bit` (0..64·words) in the row of `k`.
    pub(crate) fn set_bit(&mut self, k: u64, bit: usize, set: bool) {
        let (wi, m) = (bit / 64, 1u64 << (bit % 64));
        let k = stored_key(k);
        let guard = epoch::pin();
        // Safety: as in `SharedTable::get_into`; only this writer swaps the pointer.
        let mut t = unsafe { self.shared.table.load(Ordering::Acquire, &guard).deref() };
        let (mut i, mut found) = t.find(k);
        if !found {
            if !set {
                return;
            }
            if (self.used + 1) * MAX_LOAD.1 > t.slots() * MAX_LOAD.0 {
                self.rebuild(&guard);
                // Safety: as above.
                t = unsafe { self.shared.table.load(Ordering::Acquire, &guard).deref() };
                (i, found) = t.find(k);
                debug_assert!(!found);
            }
            // A fresh slot's words are all 0 (never used since the last rebuild).
            t.words(i)[wi].store(m, Ordering::Relaxed);
            // Release: a reader that sees the key sees its words.
            t.key(i).store(k, Ordering::Release);
            self.used += 1;
            self.live += 1;
            return;
        }
        let row = t.words(i);
        let old = row[wi].load(Ordering::Relaxed);
        let new = if set { old | m } else { old & !m };
        if new == old {
            return;
        }
        let was_live = old != 0 || row.iter().any(|w| w.load(Ordering::Relaxed) != 0);
        row[wi].store(new, Ordering::Release);
        let is_live = new != 0 || row.iter().any(|w| w.load(Ordering::Relaxed) != 0);
        self.live = self.live + usize::from(is_live) - usize::from(was_live);
    }

    /// Copies the live keys into a fresh table of `live × GROWTH` slots and publishes it.
    fn rebuild(&mut self, guard: &Guard) {
        // Safety: as in `SharedTable::get_into`.
        let old = unsafe { self.shared.table.load(Ordering::Acquire, guard).deref() };
        let want = ((self.live + 1) * GROWTH.0 / GROWTH.1).max(MIN_SLOTS);
        let new = Table::with_slots(want, self.shared.words);
        let mut used = 0;
        for s in 0..old.slots() {
            let k = old.key(s).load(Ordering::Relaxed);
            if k == 0 || old.words(s).iter().all(|w| w.load(Ordering::Relaxed) == 0) {
                continue;
            }
            let (i, _) = new.find(k);
            for (d, w) in new.words(i).iter().zip(old.words(s)) {
                d.store(w.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            new.key(i).store(k, Ordering::Relaxed);
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
    pub(crate) fn entries(&self) -> Vec<(u64, Vec<u64>)> {
        let g = epoch::pin();
        // Safety: as in `SharedTable::get_into`.
        let t = unsafe { self.shared.table.load(Ordering::Acquire, &g).deref() };
        (0..t.slots())
            .filter_map(|s| {
                let k = t.key(s).load(Ordering::Relaxed);
                let w: Vec<u64> = t
                    .words(s)
                    .iter()
                    .map(|x| x.load(Ordering::Relaxed))
                    .collect();
                (k != 0 && w.iter().any(|&x| x != 0)).then_some((k, w))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Growth keeps every bit across rebuilds, drops tombstones, and counts memory as
    /// capacity × row size.
    #[test]
    fn growth_keeps_rows_and_drops_tombstones() {
        let mut t = TableWriter::new(4);
        let s = t.shared();
        for k in 0..5_000u64 {
            t.set_bit(k, (k % 256) as usize, true);
        }
        assert_eq!(t.live(), 5_000);
        let g = epoch::pin();
        let mut row = [0u64; 4];
        for k in 0..5_000u64 {
            assert!(s.get_into(k, &g, &mut row));
            let b = (k % 256) as usize;
            let mut want = [0u64; 4];
            want[b / 64] = 1 << (b % 64);
            assert_eq!(row, want, "key {k}");
        }
        drop(g);
        for k in 0..4_000u64 {
            t.set_bit(k, (k % 256) as usize, false);
        }
        assert_eq!(t.live(), 1_000);
        // Inserting new keys eventually rebuilds and drops the 4,000 tombstones.
        for k in 10_000..12_000u64 {
            t.set_bit(k, 3, true);
        }
        assert_eq!(t.entries().len(), 3_000);
        assert!(s.capacity() <= 8_192, "tombstones were dropped");
        assert_eq!(s.memory_bytes(), s.capacity() * 40);
        // Key 0 is stored under its stand-in and still found.
        t.set_bit(0, 200, true);
        let g = epoch::pin();
        assert!(s.get_into(0, &g, &mut row));
        assert_eq!(row[3], 1 << 8);
    }
}
