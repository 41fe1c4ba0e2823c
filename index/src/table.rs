//! A single-writer, many-reader open-addressing hash table of `u64` keys to a row of `words`
//! `u64` words (a worker bitset: bit `w % 64` of word `w / 64` = worker `w`), with lock-free
//! reads: the event index's storage.
//!
//! Readers pin a crossbeam epoch, load the table pointer and probe atomics; they never take a
//! lock nor wait. The one [`TableWriter`] updates words in place with release stores, inserts
//! a new key by writing its words before its key, and grows or shrinks by building a new
//! table, swapping the pointer and deferring the old table's destruction to the epoch
//! collector. Why epochs rather than snapshot swap: a write changes one word, so a
//! copy-on-write snapshot would copy the whole table per event batch; epochs only copy on
//! growth (amortised O(1) per insert) and keep one copy in memory (left-right would keep two).
//!
//! The row width is chosen at construction (`words` = ⌈max workers / 64⌉), so one probe
//! answers for every worker: the positional index probes one key per block position, not one
//! per 64-worker shard. Narrow rows (under [`SPARSE_FROM_WORDS`] words, ≤ 256 workers) are laid
//! out flat, `[key, word 0, …, word words−1]`, so a probe touches one or two cache lines.
//! Wider rows are **sparse**: `[key, cell]`, the cell holding up to 3 worker bits inline or
//! pointing to a heap row of only the non-zero words (module `sparse`). At 4,096 workers a
//! flat row is 520 bytes per key while most keys have one holder (a conversation's blocks
//! live on one worker): `kvroute bench fleet` at 4,096 workers × 32k tokens holds 16.8 M
//! (worker, block) pairs on 8.9 M keys, 6.2 GB of flat rows at load 0.75 against 0.71 GB for
//! the whole index with sparse rows (42.2 bytes per pair). A probe of a key with more than 3
//! holders reads one more cache line (the heap row).
//!
//! # Slot states and tombstone reuse
//! A slot's key is [`EMPTY`] (0: never used since the last rebuild; ends a probe), a live key,
//! or one of two tombstones that readers skip like any other non-matching key:
//! - [`PENDING`]: the key's last bit was cleared; the key is unlinked at once (overwritten),
//!   but a reader that matched the old key just before may still be reading the (all-zero)
//!   words, so the slot cannot take a new key yet.
//! - [`FREE`]: every reader pinned when the slot was unlinked has since unpinned (a
//!   crossbeam-deferred stamp per writer batch says so), so an insert whose probe passes the
//!   slot reuses it. Without the wait, a reader could match key `T`, be delayed, and read the
//!   words of a different key `Y` that reused the slot (ABA).
//!
//! A FREE slot followed by an empty one ends its run, so no live key's probe crosses it: it
//! (and the FREE slots right before it) becomes [`EMPTY`] again at once.
//!
//! Under churn (blocks evicted and stored all the time: the Mooncake ingest fixture of
//! `kvroute bench index`) the live count stays flat and only tombstones accumulate; reuse and
//! trimming make the cleanup rebuilds rarer (30 instead of 36 there), and each cleanup
//! rebuilds at the target load instead of growing. Before, every rebuild doubled the slots
//! per live key (load 0.5: 31.7 bytes of table per (worker, block) there; now 24.3 at 0.65).
//! A rebuild places keys with an occupancy bitmap (clusters at the cap are long, and keys
//! come in old-slot order, not home order) and allocates zeroed memory (no memset).
//!
//! A live key never moves except in a rebuild, so the writer side refers to keys by slot
//! number; [`TableWriter::reserve`] and [`TableWriter::shrink`] return the old → new slot map
//! of a rebuild so the caller can renumber its references.
//!
//! Real keys equal to 0 or to a tombstone marker are stored as stand-ins (a 2^-64 collision,
//! accepted).

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Stand-in for key 0 (the golden-ratio constant).
pub(crate) const ZERO_KEY: u64 = 0x9E37_79B9_7F4A_7C15;
/// Key of an empty slot (never used since the last rebuild).
pub(crate) const EMPTY: u64 = 0;
/// Key of a tombstone some reader may still be reading: not reusable yet.
pub(crate) const PENDING: u64 = u64::MAX;
/// Key of a tombstone no reader can still be reading: reusable by an insert.
pub(crate) const FREE: u64 = u64::MAX - 1;
/// Stand-ins for real keys equal to [`PENDING`] / [`FREE`].
const PENDING_KEY: u64 = 0xC2B2_AE3D_27D4_EB4F;
const FREE_KEY: u64 = 0x1656_67B1_9E37_79F9;

/// No slot (returned in a rebuild's slot map for a dropped slot).
pub(crate) const NO_SLOT: u32 = u32::MAX;

#[inline]
fn stored_key(k: u64) -> u64 {
    match k {
        EMPTY => ZERO_KEY,
        PENDING => PENDING_KEY,
        FREE => FREE_KEY,
        k => k,
    }
}

#[inline]
fn is_live_key(k: u64) -> bool {
    k != EMPTY && k != PENDING && k != FREE
}

/// Slot array: `len` slots of `1 + words` atomics each (dense rows), or of 2 (sparse rows:
/// the key and one [`sparse`] cell).
struct Table {
    cells: Box<[AtomicU64]>,
    /// Atomics per slot (`1 + words`, or 2 when `sparse`).
    stride: usize,
    /// Slot count (any size ≥ 16: homes come from a multiply-shift, not a mask).
    len: usize,
    /// Words per row (⌈workers / 64⌉).
    words: usize,
    /// Rows are [`sparse`] cells.
    sparse: bool,
}

impl Table {
    fn with_slots(len: usize, words: usize, sparse: bool) -> Self {
        let stride = if sparse { 2 } else { 1 + words };
        // A zeroed allocation (calloc: fresh pages need no memset), viewed as atomics.
        let zeros: Box<[u64]> = vec![0u64; len * stride].into_boxed_slice();
        // Safety: `AtomicU64` has the same size, alignment and bit validity as `u64`.
        let cells = unsafe { Box::from_raw(Box::into_raw(zeros) as *mut [AtomicU64]) };
        Self {
            cells,
            stride,
            len,
            words,
            sparse,
        }
    }

    /// The sparse cell of slot `i` (sparse tables only).
    #[inline]
    fn cell(&self, i: usize) -> &AtomicU64 {
        &self.cells[i * self.stride + 1]
    }

    /// Copies row `i` into `out` (`words` long); whether any bit is set. Lock-free.
    #[inline]
    fn read_row(&self, i: usize, out: &mut [u64]) -> bool {
        if self.sparse {
            // Safety: a cell loaded under a pin points to a live heap row (freed only
            // through the epoch collector after it was replaced).
            return unsafe { sparse::read(self.cell(i).load(Ordering::Acquire), self.words, out) };
        }
        let mut any = 0;
        for (o, w) in out.iter_mut().zip(self.words(i)) {
            *o = w.load(Ordering::Acquire);
            any |= *o;
        }
        any != 0
    }

    /// Row `i` as `words` words (writer side, tests, checks).
    fn row(&self, i: usize) -> Vec<u64> {
        let mut v = vec![0; self.words];
        self.read_row(i, &mut v);
        v
    }

    /// Row `i` has no bit set.
    #[cfg(any(test, feature = "test-util"))]
    fn row_is_zero(&self, i: usize) -> bool {
        if self.sparse {
            self.cell(i).load(Ordering::Relaxed) == 0
        } else {
            self.words(i).iter().all(|w| w.load(Ordering::Relaxed) == 0)
        }
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

    /// Slot index holding `k` (already a stored key), or `None`.
    #[inline]
    fn find(&self, k: u64) -> Option<usize> {
        let mut i = self.home(k);
        loop {
            let s = self.key(i).load(Ordering::Acquire);
            if s == k {
                return Some(i);
            }
            if s == EMPTY {
                return None;
            }
            i += 1;
            if i == self.len {
                i = 0;
            }
        }
    }

    /// Asks the CPU to start loading the home slot of `k` (already a stored key): its key and
    /// words, one or two cache lines. No effect on the answer.
    #[inline]
    fn prefetch(&self, k: u64) {
        self.prefetch_slot(self.home(k));
    }

    /// Asks the CPU to start loading slot `i` (< `len`): its key and words, one or two cache
    /// lines. No effect on the table.
    #[inline]
    fn prefetch_slot(&self, i: usize) {
        let p = self.cells[i * self.stride..].as_ptr();
        prefetch_ptr(p.cast());
        // A slot of more than one word may straddle a line: fetch the one holding its end.
        // Safety: `wrapping_add` never dereferences; the pointer only feeds a prefetch hint.
        prefetch_ptr(p.wrapping_add(self.stride - 1).cast());
    }
}

/// Prefetch hint for the cache line holding `p` (a no-op off x86-64). Never faults.
#[inline(always)]
pub(crate) fn prefetch_ptr(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // Safety: `prefetch` is a hint: it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The shared, readable side of a table.
pub(crate) struct SharedTable {
    table: Atomic<Table>,
    words: usize,
    /// Bytes of live sparse heap rows (requested sizes; 0 for dense rows).
    heap: std::sync::atomic::AtomicUsize,
    /// Tables replaced by a rebuild that no reader can reach any more, freed by the writer.
    graveyard: Arc<Graveyard>,
}

/// Tables replaced by a rebuild whose last readers have unpinned, waiting for the writer to
/// free them ([`TableWriter::end_batch`]).
///
/// Why not `defer_destroy`: crossbeam-epoch runs deferred functions on whichever thread
/// collects garbage, usually a reader's pin, and freeing a table of millions of slots takes
/// milliseconds (an munmap of hundreds of MB at 4,096 workers × 32k tokens). The deferred
/// function here only moves the pointer into this list; the writer, which made the garbage,
/// pays for freeing it. Measured in `kvroute bench fleet` (`perf/runs/2026-12-03-fleet-table/`).
#[derive(Default)]
struct Graveyard(Mutex<Vec<usize>>);

impl Graveyard {
    /// Frees every table here; returns how many.
    fn bury(&self) -> usize {
        let dead = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        for &addr in &dead {
            // Safety: `addr` came from the `Owned` that `TableWriter::rebuild` swapped out,
            // once every reader pinned before the swap had unpinned; it is pushed once and
            // taken out once, so it is freed once.
            drop(unsafe { Owned::<Table>::from_raw(addr as *mut Table) });
        }
        dead.len()
    }

    /// Tables waiting.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for Graveyard {
    fn drop(&mut self) {
        self.bury();
    }
}

/// The table as of one pin: cheap lookups without reloading the pointer.
#[derive(Clone, Copy)]
pub(crate) struct TableRef<'g> {
    t: &'g Table,
}

impl TableRef<'_> {
    /// Copies the words of `k` into `out` (`out.len() == words`); all 0 when absent. Returns
    /// whether any word is non-zero. Lock-free.
    #[inline]
    pub(crate) fn get_into(&self, k: u64, out: &mut [u64]) -> bool {
        match self.t.find(stored_key(k)) {
            Some(i) => self.t.read_row(i, out),
            None => {
                out.fill(0);
                false
            }
        }
    }

    /// Starts loading the home slot of `k` into the cache (a hint: the answer of a later
    /// [`Self::get_into`] is unchanged, it only waits less).
    #[inline]
    pub(crate) fn prefetch(&self, k: u64) {
        self.t.prefetch(stored_key(k));
    }
}

impl SharedTable {
    /// Words per row (⌈workers / 64⌉).
    pub(crate) fn words(&self) -> usize {
        self.words
    }

    /// The current table, valid while `guard` is pinned and `self` is borrowed (dropping the
    /// last `SharedTable` frees the table and its heap rows at once, so a view must not
    /// outlive it).
    #[inline]
    pub(crate) fn view<'g>(&'g self, guard: &'g Guard) -> TableRef<'g> {
        // Safety: `self` outlives the view (the borrow above), as `view_unbounded` needs.
        unsafe { self.view_unbounded(guard) }
    }

    /// [`SharedTable::view`] without borrowing `self` for the view's lifetime.
    ///
    /// # Safety
    /// The caller keeps this `SharedTable` alive as long as the returned view (the writer
    /// holds an `Arc` of it for as long as it uses the view).
    #[inline]
    unsafe fn view_unbounded<'g>(&self, guard: &'g Guard) -> TableRef<'g> {
        // Safety: the pointer is never null after construction, and the table it points to
        // is destroyed only through `defer_destroy` after every guard pinned now is dropped,
        // or by `Drop`, which the caller's contract puts after the view's last use.
        TableRef {
            t: unsafe { self.table.load(Ordering::Acquire, guard).deref() },
        }
    }

    /// Copies the words of `k` into `out` (`out.len() == words`); all 0 when absent. Returns
    /// whether any word is non-zero. Lock-free.
    #[cfg(test)]
    pub(crate) fn get_into(&self, k: u64, guard: &Guard, out: &mut [u64]) -> bool {
        self.view(guard).get_into(k, out)
    }

    /// Slots allocated (memory = slots × 8 × stride bytes).
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        let g = epoch::pin();
        self.view(&g).t.slots()
    }

    /// Bytes allocated for slots (capacity × 8 × (1 + words), or × 16 with sparse rows) and
    /// for sparse heap rows (requested sizes: mimalloc rounds them up to its 8-byte size
    /// classes below 64 bytes, so the count is exact there).
    pub(crate) fn memory_bytes(&self) -> usize {
        let g = epoch::pin();
        let t = self.view(&g).t;
        t.slots() * 8 * t.stride + self.heap.load(Ordering::Relaxed)
    }
}

impl Drop for SharedTable {
    fn drop(&mut self) {
        // Safety: `&mut self` means no reader or writer can reach the table any more; older
        // tables (buried, or deferred to the graveyard) never owned the heap rows, this one does.
        unsafe {
            let g = epoch::unprotected();
            let t = self.table.load(Ordering::Relaxed, g);
            if !t.is_null() {
                let table = t.into_owned();
                if table.sparse {
                    for i in 0..table.slots() {
                        sparse::free_now(table.cell(i).load(Ordering::Relaxed), table.words);
                    }
                }
                drop(table);
            }
        }
    }
}

/// Rows of this many words (⌈workers / 64⌉) or more are sparse: at 4,096 workers a dense row
/// is 520 bytes per key, most keys are held by one worker (a conversation's own blocks), and
/// the fixture of `kvroute bench fleet` did not fit the 2-core dev box's memory dense.
pub(crate) const SPARSE_FROM_WORDS: usize = 5;

/// Whether a table of `words`-word rows uses sparse rows.
fn sparse_for(words: usize) -> bool {
    #[cfg(test)]
    if let Some(f) = FORCE_SPARSE.with(|f| f.get()) {
        return f;
    }
    words >= SPARSE_FROM_WORDS
}

#[cfg(test)]
thread_local! {
    /// Tests force a layout (the positional brute-force tests run both).
    pub(crate) static FORCE_SPARSE: std::cell::Cell<Option<bool>> =
        const { std::cell::Cell::new(None) };
}

/// Sparse rows: one 64-bit cell per slot instead of `words` words.
///
/// | cell | meaning |
/// |---|---|
/// | 0 | no bit set |
/// | bit 0 = 1 | inline: up to 3 bits, each as `bit + 1` in a 21-bit field (bits 1–21, 22–42, 43–63; 0 = none), ascending |
/// | bit 0 = 0, ≠ 0 | pointer to a heap row: `⌈words / 64⌉` mask words (bit `j` of mask `i` = word `64i + j` is present), then the present words in order |
///
/// A heap row's masks never change; its words change in place (release stores) while
/// their bit set stays non-empty; any other change builds a new cell, publishes it and frees
/// the old heap row through the epoch collector. Heap rows belong to the current table: a
/// rebuild moves the cells, so only [`SharedTable`]'s drop frees the rows still linked.
mod sparse {
    use crossbeam_epoch::Guard;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Bits per inline field; ids are stored + 1, so bits up to `ID_MASK − 2`.
    pub(super) const ID_BITS: u32 = 21;
    pub(super) const ID_MASK: u64 = (1 << ID_BITS) - 1;

    /// Inline cell of `bits` (≤ 3, ascending, distinct).
    #[inline]
    pub(super) fn inline_of(bits: &[usize]) -> u64 {
        debug_assert!(bits.len() <= 3);
        let mut c = 1u64;
        for (f, &b) in bits.iter().enumerate() {
            c |= (b as u64 + 1) << (1 + ID_BITS * f as u32);
        }
        c
    }

    /// The bits of inline cell `c` (ascending) and how many there are.
    #[inline]
    pub(super) fn inline_bits(c: u64) -> ([usize; 3], usize) {
        let mut bits = [0usize; 3];
        let mut n = 0;
        for f in 0..3 {
            let id = (c >> (1 + ID_BITS * f)) & ID_MASK;
            if id != 0 {
                bits[n] = (id - 1) as usize;
                n += 1;
            }
        }
        (bits, n)
    }

    /// Heap row pointer of `c`, if it is one.
    #[inline]
    pub(super) fn heap(c: u64) -> Option<*const AtomicU64> {
        (c != 0 && c & 1 == 0).then_some(c as usize as *const AtomicU64)
    }

    /// Mask words of a row of `words` words.
    #[inline]
    fn mask_words(words: usize) -> usize {
        words.div_ceil(64)
    }

    /// Atomics of the heap row at `p`.
    ///
    /// # Safety
    /// `p` is a live heap row of a `words`-word table.
    pub(super) unsafe fn heap_len(p: *const AtomicU64, words: usize) -> usize {
        let mw = mask_words(words);
        // Safety: the row starts with `mw` masks (caller).
        mw + (0..mw)
            .map(|i| unsafe { &*p.add(i) }.load(Ordering::Relaxed).count_ones() as usize)
            .sum::<usize>()
    }

    /// Expands cell `c` into `out` (`words` long); whether any bit is set.
    ///
    /// # Safety
    /// A heap row of `c` is live for the call (the reader is pinned, or it is the writer).
    #[inline]
    pub(super) unsafe fn read(c: u64, words: usize, out: &mut [u64]) -> bool {
        out.fill(0);
        if c == 0 {
            return false;
        }
        let Some(p) = heap(c) else {
            for f in 0..3 {
                let id = (c >> (1 + ID_BITS * f)) & ID_MASK;
                if id != 0 {
                    let b = (id - 1) as usize;
                    out[b / 64] |= 1 << (b % 64);
                }
            }
            return true;
        };
        let mw = mask_words(words);
        let mut r = mw;
        let mut any = 0;
        for i in 0..mw {
            // Safety: a live heap row (caller) of `mw` masks and their words.
            let mut m = unsafe { &*p.add(i) }.load(Ordering::Relaxed);
            while m != 0 {
                let wi = i * 64 + m.trailing_zeros() as usize;
                // Safety: `r` counts the masks' set bits read so far after the `mw` masks, so
                // `r < mw + popcount(masks)`, the row's length (invariant 4).
                let v = unsafe { &*p.add(r) }.load(Ordering::Acquire);
                out[wi] = v;
                any |= v;
                r += 1;
                m &= m - 1;
            }
        }
        any != 0
    }

    /// The word `wi` of the heap row of `c`, in place, if `c` is a heap row holding it.
    ///
    /// # Safety
    /// As [`read`].
    #[inline]
    pub(super) unsafe fn word_in_place<'a>(
        c: u64,
        words: usize,
        wi: usize,
    ) -> Option<&'a AtomicU64> {
        let p = heap(c)?;
        let mw = mask_words(words);
        // Safety: a live heap row (caller).
        let m = unsafe { &*p.add(wi / 64) }.load(Ordering::Relaxed);
        if m & (1 << (wi % 64)) == 0 {
            return None;
        }
        let mut r = mw;
        for i in 0..wi / 64 {
            // Safety: `i < wi / 64 < mw`: a mask word of the live row.
            r += unsafe { &*p.add(i) }.load(Ordering::Relaxed).count_ones() as usize;
        }
        r += (m & ((1u64 << (wi % 64)) - 1)).count_ones() as usize;
        // Safety: word `wi` is present (its mask bit is set), and `r` is its rank among the
        // present words after the masks: `r < mw + popcount(masks)` (invariant 4).
        Some(unsafe { &*p.add(r) })
    }

    /// The cell of row `row` (`words` words): 0, inline, or a new heap row; and the heap
    /// bytes it allocated.
    pub(super) fn encode(row: &[u64]) -> (u64, usize) {
        let total: u32 = row.iter().map(|w| w.count_ones()).sum();
        if total == 0 {
            return (0, 0);
        }
        if total <= 3 {
            let mut bits = [0usize; 3];
            let mut n = 0;
            for (wi, &w) in row.iter().enumerate() {
                let mut w = w;
                while w != 0 {
                    bits[n] = wi * 64 + w.trailing_zeros() as usize;
                    n += 1;
                    w &= w - 1;
                }
            }
            return (inline_of(&bits[..n]), 0);
        }
        let mw = mask_words(row.len());
        let mut cells: Vec<u64> = vec![0; mw];
        for (wi, &w) in row.iter().enumerate() {
            if w != 0 {
                cells[wi / 64] |= 1 << (wi % 64);
                cells.push(w);
            }
        }
        let bytes = cells.len() * 8;
        let b: Box<[AtomicU64]> = cells.into_iter().map(AtomicU64::new).collect();
        let p = Box::into_raw(b) as *mut AtomicU64;
        (p as usize as u64, bytes)
    }

    /// Frees the heap row of `c` (if any) once every thread pinned now has unpinned; returns
    /// its bytes.
    ///
    /// # Safety
    /// `c` is no longer reachable from the table, its row is freed by no one else, and
    /// `guard` is a real pin (with `epoch::unprotected()` the free would run at once, under
    /// readers).
    pub(super) unsafe fn retire(c: u64, words: usize, guard: &Guard) -> usize {
        let Some(p) = heap(c) else {
            return 0;
        };
        debug_assert!(guard.collector().is_some(), "retire needs a pinned guard");
        // Safety: live until the deferred free (caller).
        let len = unsafe { heap_len(p, words) };
        let addr = p as usize;
        // Safety: the row is unreachable for readers that pin from now on; the ones pinned
        // now keep it alive until they unpin.
        unsafe {
            guard.defer_unchecked(move || {
                let p = addr as *mut AtomicU64;
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)));
            });
        }
        len * 8
    }

    /// Frees the heap row of `c` (if any) at once.
    ///
    /// # Safety
    /// No thread can reach `c`'s row any more, and no one else frees it.
    pub(super) unsafe fn free_now(c: u64, words: usize) {
        if let Some(p) = heap(c) {
            // Safety: caller.
            unsafe {
                let len = heap_len(p, words);
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                    p as *mut AtomicU64,
                    len,
                )));
            }
        }
    }
}

/// Smallest table, slots.
const MIN_SLOTS: usize = 16;
/// Load settings by row width: `(cap, target)`, each a fraction `(num, den)`. `cap`: most
/// occupied slots (live + tombstones) before a rebuild; `target`: live keys per slot right
/// after one. Memory per key is 8·(1+words)/load, and under churn (live count flat, only
/// tombstones grow) the live load stays at `target`.
///
/// - One word (≤ 64 workers, 16-byte slots): cap 0.9, target 0.65 — rows are rarely shared
///   by several workers, so the table is half the memory per (worker, block) (Mooncake
///   ingest fixture: 24.3 of 46.6 bytes); the wide headroom makes churn rebuilds rare
///   (measured: cap 0.85 / target 0.75 rebuilt 1.5× as often and ingested ~10 % slower).
/// - Wider rows: cap 0.8, target 0.6 — a key is shared by many workers (8k tok × 256 workers
///   fixture: 4.6 per key) so memory per (worker, block) is small anyway, and a 40-byte slot
///   makes every extra slot probed a cache line.
///
/// Sparse rows (16-byte slots) take the one-word loads.
fn loads(slot_words: usize) -> ((usize, usize), (usize, usize)) {
    if slot_words == 1 {
        ((9, 10), (13, 20))
    } else {
        ((4, 5), (3, 5))
    }
}
/// A rebuild shrinks the table when fewer than 1/4 of its slots are live.
const SHRINK_BELOW: (usize, usize) = (1, 4);

/// First clear bit at or after `from` in a bitmap of `len` bits (cyclic; one must be clear).
#[inline]
fn next_clear(occ: &[u64], from: usize, len: usize) -> usize {
    let mut w = from / 64;
    let mut bits = !occ[w] & (!0u64 << (from % 64));
    loop {
        if bits != 0 {
            let i = w * 64 + bits.trailing_zeros() as usize;
            if i < len {
                return i;
            }
            // Past the end: wrap around.
            w = 0;
            bits = !occ[0];
            continue;
        }
        w += 1;
        if w == occ.len() {
            w = 0;
        }
        bits = !occ[w];
    }
}

/// The one writer of a [`SharedTable`].
///
/// # Invariants
/// 1. `used` = slots whose key is not [`EMPTY`] (live keys and tombstones); `live` = slots
///    with a live key, each with a non-zero word; `free` = [`FREE`] slots.
/// 2. `used` ≤ `cap` of the slots ([`loads`]: linear probing always finds an empty slot).
/// 3. Every [`PENDING`] slot is listed once in `retired` or `pending`, with all-zero words
///    (cell 0 with sparse rows); every [`FREE`] slot has all-zero words (cell 0).
/// 4. Sparse rows only: an inline cell's fields are ascending and packed from field 0
///    ([`TableWriter::only_bit`] reads field 0 alone); a heap row is linked from exactly
///    one slot of the current table (a second link would be a double free in `Drop`), its
///    present words are non-zero, and it holds `masks + popcount(masks)` words (what
///    `heap_len` and `read`'s bounds rely on).
/// 5. Sparse rows only: `shared.heap` is the bytes of the heap rows linked now, once the
///    batch's retired rows are counted out (they are, at retirement).
pub(crate) struct TableWriter {
    shared: Arc<SharedTable>,
    used: usize,
    live: usize,
    free: usize,
    /// Slots unlinked in the current batch (not yet handed to the epoch collector).
    retired: Vec<u32>,
    /// Slots unlinked in earlier batches, oldest first.
    pending: VecDeque<u32>,
    /// (batch number, slots) of the batches in `pending`, oldest first.
    batches: VecDeque<(u64, usize)>,
    /// Number of the last batch handed to the collector.
    batch: u64,
    /// Highest batch whose readers have all unpinned (set by deferred functions).
    safe: Arc<AtomicU64>,
    /// Rebuilds so far (tests).
    rebuilds: u64,
    /// Inserts that reused a [`FREE`] slot (tests).
    reused: u64,
    /// [`loads`] of this row width.
    cap: (usize, usize),
    target: (usize, usize),
}

impl TableWriter {
    /// A new empty table of `words` words per row (≥ 1) and its writer; rows are sparse from
    /// [`SPARSE_FROM_WORDS`] words on.
    pub(crate) fn new(words: usize) -> Self {
        let words = words.max(1);
        Self::with_layout(words, sparse_for(words))
    }

    /// [`Self::new`] with the row layout given.
    fn with_layout(words: usize, sparse: bool) -> Self {
        let words = words.max(1);
        let sparse = sparse && words * 64 < sparse::ID_MASK as usize;
        let slot_words = if sparse { 1 } else { words };
        Self {
            shared: Arc::new(SharedTable {
                table: Atomic::new(Table::with_slots(MIN_SLOTS, words, sparse)),
                words,
                heap: std::sync::atomic::AtomicUsize::new(0),
                graveyard: Arc::default(),
            }),
            used: 0,
            live: 0,
            free: 0,
            retired: Vec::new(),
            pending: VecDeque::new(),
            batches: VecDeque::new(),
            batch: 0,
            safe: Arc::new(AtomicU64::new(0)),
            rebuilds: 0,
            reused: 0,
            cap: loads(slot_words).0,
            target: loads(slot_words).1,
        }
    }

    pub(crate) fn shared(&self) -> Arc<SharedTable> {
        Arc::clone(&self.shared)
    }

    #[inline]
    fn table<'g>(&self, guard: &'g Guard) -> &'g Table {
        // Safety: the writer's `Arc` keeps the shared table alive; the view is used only
        // inside the writer's own methods, while `self` (and its `Arc`) lives.
        unsafe { self.shared.view_unbounded(guard).t }
    }

    /// Keys with a non-zero word.
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    /// Rebuilds so far.
    #[cfg(test)]
    pub(crate) fn rebuilds(&self) -> u64 {
        self.rebuilds
    }

    /// Writer-side bytes: the tombstone lists (capacity × entry size).
    pub(crate) fn writer_bytes(&self) -> usize {
        self.retired.capacity() * 4
            + self.pending.capacity() * 4
            + self.batches.capacity() * std::mem::size_of::<(u64, usize)>()
    }

    /// Makes room for `n` more keys: rebuilds (growing) when `n` new slots could exceed the
    /// load cap, and then returns the old → new slot map ([`NO_SLOT`] for dropped slots),
    /// which the caller must apply to every slot number it keeps.
    pub(crate) fn reserve(&mut self, n: usize, guard: &Guard) -> Option<Vec<u32>> {
        let slots = self.table(guard).slots();
        if (self.used + n) * self.cap.1 <= slots * self.cap.0 {
            return None;
        }
        Some(self.rebuild(self.live + n, guard))
    }

    /// Shrinks the table when fewer than 1/4 of its slots are live (rebuild to the target load);
    /// returns the slot map as [`Self::reserve`] does.
    pub(crate) fn shrink(&mut self, guard: &Guard) -> Option<Vec<u32>> {
        let slots = self.table(guard).slots();
        if slots <= MIN_SLOTS * 4 || self.live * SHRINK_BELOW.1 >= slots * SHRINK_BELOW.0 {
            return None;
        }
        Some(self.rebuild(self.live, guard))
    }

    /// Sets bit `bit` (0..64·words) in the row of `k`, inserting `k` when absent (the caller
    /// reserved room), and returns its slot. A new key reuses the first [`FREE`] slot of its
    /// probe, else takes the empty slot that ends it.
    ///
    /// # Panics
    /// If `k` is new and the table is at its load cap (no [`Self::reserve`] first).
    #[cfg(test)]
    pub(crate) fn set_bit(&mut self, k: u64, bit: usize, guard: &Guard) -> u32 {
        self.set_bit_had(k, bit, guard).0
    }

    /// Sets bit `bit` as [`Self::set_bit`] does; also says whether the bit was set already.
    ///
    /// # Panics
    /// If `k` is new and the table is at its load cap (no [`Self::reserve`] first).
    #[inline]
    pub(crate) fn set_bit_had(&mut self, k: u64, bit: usize, guard: &Guard) -> (u32, bool) {
        let (wi, m) = (bit / 64, 1u64 << (bit % 64));
        let k = stored_key(k);
        let t = self.table(guard);
        let mut i = t.home(k);
        let mut reuse = usize::MAX;
        loop {
            // Relaxed: only this writer stores keys.
            let s = t.key(i).load(Ordering::Relaxed);
            if s == k {
                if t.sparse {
                    return (i as u32, self.sparse_set(t, i, wi, m, guard));
                }
                let w = &t.words(i)[wi];
                let old = w.load(Ordering::Relaxed);
                if old & m == 0 {
                    w.store(old | m, Ordering::Release);
                }
                return (i as u32, old & m != 0);
            }
            if s == EMPTY {
                break;
            }
            if s == FREE && reuse == usize::MAX {
                reuse = i;
            }
            i += 1;
            if i == t.len {
                i = 0;
            }
        }
        (self.link(k, i, reuse, wi, m, guard), false)
    }

    /// Inserts `k`, which the caller knows is absent, with only bit `bit` set, and returns its
    /// slot: the first [`FREE`] or empty slot from its home. Unlike [`Self::set_bit`] it does
    /// not probe to the end of the run to prove `k` absent. Measured on the Mooncake ingest
    /// fixture of `kvroute bench index`: 750,521 of 751,673 new keys came this way, probing
    /// 4.6 slots on average, against 12–14 for a new key's full probe.
    ///
    /// # Panics
    /// If the table is at its load cap (no [`Self::reserve`] first); in debug builds, if `k`
    /// is present.
    #[inline]
    pub(crate) fn insert_absent(&mut self, k: u64, bit: usize, guard: &Guard) -> u32 {
        let (wi, m) = (bit / 64, 1u64 << (bit % 64));
        let k = stored_key(k);
        let t = self.table(guard);
        debug_assert!(t.find(k).is_none(), "insert_absent of a present key");
        let mut i = t.home(k);
        loop {
            match t.key(i).load(Ordering::Relaxed) {
                EMPTY => return self.link(k, i, usize::MAX, wi, m, guard),
                FREE => return self.link(k, i, i, wi, m, guard),
                _ => {}
            }
            i += 1;
            if i == t.len {
                i = 0;
            }
        }
    }

    /// Links new stored key `k` with word `wi` = `m` at the [`FREE`] slot `reuse`, else at the
    /// empty slot `empty`; returns the slot.
    #[inline]
    fn link(
        &mut self,
        k: u64,
        empty: usize,
        reuse: usize,
        wi: usize,
        m: u64,
        guard: &Guard,
    ) -> u32 {
        let t = self.table(guard);
        let i = if reuse != usize::MAX {
            self.free -= 1;
            self.reused += 1;
            reuse
        } else {
            assert!(
                (self.used + 1) * self.cap.1 <= t.slots() * self.cap.0,
                "table full: reserve first"
            );
            self.used += 1;
            empty
        };
        // A fresh or FREE slot's words are all 0 and no reader can be reading them for
        // another key (see the module doc).
        if t.sparse {
            t.cell(i).store(
                sparse::inline_of(&[wi * 64 + m.trailing_zeros() as usize]),
                Ordering::Relaxed,
            );
        } else {
            t.words(i)[wi].store(m, Ordering::Relaxed);
        }
        // Release: a reader that sees the key sees its words.
        t.key(i).store(k, Ordering::Release);
        self.live += 1;
        i as u32
    }

    /// Sets bit `m` of word `wi` in sparse row `i` of `t` (the current table); whether it
    /// was set.
    fn sparse_set(&mut self, t: &Table, i: usize, wi: usize, m: u64, guard: &Guard) -> bool {
        let cell = t.cell(i);
        let c = cell.load(Ordering::Relaxed);
        let bit = wi * 64 + m.trailing_zeros() as usize;
        if c & 1 == 1 {
            // Inline: a new cell, no heap row, while it stays at ≤ 3 bits.
            let (mut bits, n) = sparse::inline_bits(c);
            if bits[..n].contains(&bit) {
                return true;
            }
            if n < 3 {
                bits[n] = bit;
                bits[..=n].sort_unstable();
                cell.store(sparse::inline_of(&bits[..=n]), Ordering::Release);
                return false;
            }
        }
        // Safety: the writer reads the current table's rows.
        if let Some(w) = unsafe { sparse::word_in_place(c, t.words, wi) } {
            let old = w.load(Ordering::Relaxed);
            if old & m == 0 {
                w.store(old | m, Ordering::Release);
            }
            return old & m != 0;
        }
        let mut row = t.row(i);
        if row[wi] & m != 0 {
            return true;
        }
        row[wi] |= m;
        self.sparse_replace(t, i, &row, guard);
        false
    }

    /// Clears bit `m` of word `wi` in sparse row `i` of `t`; whether the row is now empty
    /// (it was not before).
    fn sparse_clear(&mut self, t: &Table, i: usize, wi: usize, m: u64, guard: &Guard) -> bool {
        let cell = t.cell(i);
        let c = cell.load(Ordering::Relaxed);
        if c & 1 == 1 {
            let bit = wi * 64 + m.trailing_zeros() as usize;
            let (bits, n) = sparse::inline_bits(c);
            let Some(at) = bits[..n].iter().position(|&b| b == bit) else {
                return false;
            };
            let mut rest = [0usize; 2];
            let mut k = 0;
            for (j, &b) in bits[..n].iter().enumerate() {
                if j != at {
                    rest[k] = b;
                    k += 1;
                }
            }
            let new = if k == 0 {
                0
            } else {
                sparse::inline_of(&rest[..k])
            };
            cell.store(new, Ordering::Release);
            return new == 0;
        }
        // Safety: as in `sparse_set`.
        if let Some(w) = unsafe { sparse::word_in_place(c, t.words, wi) } {
            let old = w.load(Ordering::Relaxed);
            if old & m == 0 {
                return false;
            }
            if old & !m != 0 {
                w.store(old & !m, Ordering::Release);
                return false;
            }
        }
        let mut row = t.row(i);
        if row[wi] & m == 0 {
            return false;
        }
        row[wi] &= !m;
        self.sparse_replace(t, i, &row, guard);
        cell.load(Ordering::Relaxed) == 0
    }

    /// Publishes `row` as the new cell of sparse slot `i` and retires the old one.
    fn sparse_replace(&mut self, t: &Table, i: usize, row: &[u64], guard: &Guard) {
        let (c, bytes) = sparse::encode(row);
        let old = t.cell(i).swap(c, Ordering::AcqRel);
        // Safety: `old` was just unlinked; only this writer frees rows.
        let freed = unsafe { sparse::retire(old, t.words, guard) };
        let heap = &self.shared.heap;
        heap.fetch_add(bytes, Ordering::Relaxed);
        heap.fetch_sub(freed, Ordering::Relaxed);
    }

    /// True when the row at `slot` (a live slot) has bit `bit` and no other.
    #[inline]
    pub(crate) fn only_bit(&self, slot: u32, bit: usize, guard: &Guard) -> bool {
        let (wi, m) = (bit / 64, 1u64 << (bit % 64));
        let t = self.table(guard);
        if t.sparse {
            let c = t.cell(slot as usize).load(Ordering::Relaxed);
            if c & 1 == 1 {
                return c == sparse::inline_of(&[bit]);
            }
            // A heap row may hold one bit after in-place clears.
            let row = t.row(slot as usize);
            return row
                .iter()
                .enumerate()
                .all(|(j, &w)| w == if j == wi { m } else { 0 });
        }
        let row = t.words(slot as usize);
        row.iter()
            .enumerate()
            .all(|(j, w)| w.load(Ordering::Relaxed) == if j == wi { m } else { 0 })
    }

    /// Clears bit `bit` in the row at `slot` (a slot returned by [`Self::set_bit`] and still
    /// live); a row left all-zero is unlinked (key → [`PENDING`]).
    #[inline]
    pub(crate) fn clear_bit(&mut self, slot: u32, bit: usize, guard: &Guard) {
        let (wi, m) = (bit / 64, 1u64 << (bit % 64));
        let t = self.table(guard);
        let i = slot as usize;
        if t.sparse {
            if self.sparse_clear(t, i, wi, m, guard) {
                t.key(i).store(PENDING, Ordering::Release);
                self.live -= 1;
                self.retired.push(slot);
            }
            return;
        }
        let row = t.words(i);
        let old = row[wi].load(Ordering::Relaxed);
        if old & m == 0 {
            return;
        }
        let new = old & !m;
        row[wi].store(new, Ordering::Release);
        if new == 0 && row.iter().all(|w| w.load(Ordering::Relaxed) == 0) {
            // The words are all 0 before the key goes: a reader that still sees the key
            // reads an absent row.
            t.key(i).store(PENDING, Ordering::Release);
            self.live -= 1;
            self.retired.push(slot);
        }
    }

    /// Starts loading the home slot of `k` into the cache (a hint, no effect on the table).
    #[inline]
    pub(crate) fn prefetch(&self, k: u64, guard: &Guard) {
        self.table(guard).prefetch(stored_key(k));
    }

    /// Starts loading the row at `slot` (a live slot) into the cache, for a
    /// [`Self::clear_bit`] soon after (a hint, no effect on the table).
    #[inline]
    pub(crate) fn prefetch_slot(&self, slot: u32, guard: &Guard) {
        let t = self.table(guard);
        if (slot as usize) < t.slots() {
            t.prefetch_slot(slot as usize);
        }
    }

    /// The key stored at `slot` (a live slot; [`ZERO_KEY`] for a real 0).
    #[inline]
    pub(crate) fn key_at(&self, slot: u32, guard: &Guard) -> u64 {
        self.table(guard).key(slot as usize).load(Ordering::Relaxed)
    }

    /// Word `bit / 64` of the row at `slot` has bit `bit` (tests, invariant checks).
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn has_bit(&self, slot: u32, bit: usize, guard: &Guard) -> bool {
        let t = self.table(guard);
        (slot as usize) < t.slots() && t.row(slot as usize)[bit / 64] & (1 << (bit % 64)) != 0
    }

    /// Ends a writer batch (one event): tombstones whose readers have all unpinned become
    /// [`FREE`]; this batch's unlinked slots are handed to the epoch collector, which marks
    /// them safe once every thread pinned now has unpinned.
    pub(crate) fn end_batch(&mut self, guard: &Guard) {
        self.shared.graveyard.bury();
        let safe = self.safe.load(Ordering::Acquire);
        let t = self.table(guard);
        while let Some(&(b, n)) = self.batches.front() {
            if b > safe {
                break;
            }
            self.batches.pop_front();
            for slot in self.pending.drain(..n) {
                t.key(slot as usize).store(FREE, Ordering::Relaxed);
                self.free += 1;
                // A FREE slot followed by an empty one ends its run: no live key's probe
                // crosses it, so it (and the FREE slots just before it) can be empty again.
                let mut i = slot as usize;
                if t.key(if i + 1 == t.len { 0 } else { i + 1 })
                    .load(Ordering::Relaxed)
                    == EMPTY
                {
                    while t.key(i).load(Ordering::Relaxed) == FREE {
                        t.key(i).store(EMPTY, Ordering::Relaxed);
                        self.free -= 1;
                        self.used -= 1;
                        i = if i == 0 { t.len - 1 } else { i - 1 };
                    }
                }
            }
        }
        // A burst of removals should not keep its peak list capacity.
        if self.pending.capacity() > 4 * self.pending.len() + 1024 {
            self.pending.shrink_to(2 * self.pending.len());
        }
        if self.retired.capacity() > 1024 && self.retired.len() < 256 {
            self.retired.shrink_to(256);
        }
        if self.retired.is_empty() {
            return;
        }
        self.batch += 1;
        let b = self.batch;
        self.batches.push_back((b, self.retired.len()));
        self.pending.extend(self.retired.drain(..));
        let safe = Arc::clone(&self.safe);
        guard.defer(move || safe.fetch_max(b, Ordering::Release));
        // Hand the deferred stamp to the global queue now rather than when the thread's
        // bag of 64 fills, so tombstones become reusable within a few batches.
        guard.flush();
    }

    /// Copies the live keys into a fresh table of `room / target` slots, publishes it, and
    /// returns the old → new slot map.
    fn rebuild(&mut self, room: usize, guard: &Guard) -> Vec<u32> {
        let old = self.table(guard);
        let slots = old.slots();
        let mut want = ((room + 1) * self.target.1 / self.target.0).max(MIN_SLOTS);
        if (room + 1) * self.cap.1 > slots * self.cap.0 {
            // Growing: at least ×1.5, so filling a table costs few rebuilds; the first
            // cleanup rebuild of churn brings it back to the target load.
            want = want.max(slots * 3 / 2);
        }
        // Otherwise the rebuild cleans tombstones out (churn): back to the target load.
        // Sizes are rounded up to 1/64 of a power of two (≤ 1.6 % more slots), so the
        // cleanups of a steady table allocate the same size again and the allocator can hand
        // back the previous table's memory (freed once its readers left) instead of fresh
        // pages: page faults were most of a rebuild's time.
        let q = (want.next_power_of_two() >> 6).max(1);
        want = want.div_ceil(q) * q;
        let new = Table::with_slots(want, self.shared.words, old.sparse);
        // Occupancy bitmap of the new table: the first empty slot at or after a home is one
        // word scan away, instead of probing long runs slot by slot (clusters at the load
        // cap are long, and keys come in old-slot order, not home order).
        let mut occ = vec![0u64; want.div_ceil(64)];
        let mut map = vec![NO_SLOT; old.slots()];
        for (s, m) in map.iter_mut().enumerate() {
            let k = old.key(s).load(Ordering::Relaxed);
            if !is_live_key(k) {
                continue;
            }
            let i = next_clear(&occ, new.home(k), want);
            occ[i / 64] |= 1 << (i % 64);
            if old.sparse {
                // The heap row moves to the new table (the old one never frees rows).
                new.cell(i)
                    .store(old.cell(s).load(Ordering::Relaxed), Ordering::Relaxed);
            } else {
                for (d, w) in new.words(i).iter().zip(old.words(s)) {
                    d.store(w.load(Ordering::Relaxed), Ordering::Relaxed);
                }
            }
            new.key(i).store(k, Ordering::Relaxed);
            *m = i as u32;
        }
        self.used = self.live;
        self.free = 0;
        // Fresh lists: a burst of removals should not keep its peak capacity.
        self.retired = Vec::new();
        self.pending = VecDeque::new();
        self.batches = VecDeque::new();
        self.rebuilds += 1;
        let prev = self
            .shared
            .table
            .swap(Owned::new(new), Ordering::AcqRel, guard);
        // Safety: `prev` is unreachable for new readers; readers pinned before the swap keep
        // it alive until their guards drop, and only then does it go to the graveyard.
        let addr = prev.as_raw() as usize;
        let grave = Arc::clone(&self.shared.graveyard);
        unsafe {
            guard.defer_unchecked(move || {
                grave.0.lock().unwrap_or_else(|e| e.into_inner()).push(addr);
            })
        };
        guard.flush();
        map
    }

    /// Every (key, words) with a non-zero word (tests).
    #[cfg(test)]
    pub(crate) fn entries(&self) -> Vec<(u64, Vec<u64>)> {
        self.slot_entries()
            .into_iter()
            .map(|(_, k, w)| (k, w))
            .collect()
    }

    /// Every (slot, key, words) with a non-zero word.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn slot_entries(&self) -> Vec<(u32, u64, Vec<u64>)> {
        let g = epoch::pin();
        let t = self.table(&g);
        (0..t.slots())
            .filter_map(|s| {
                let k = t.key(s).load(Ordering::Relaxed);
                let w: Vec<u64> = t.row(s);
                (is_live_key(k) && w.iter().any(|&x| x != 0)).then_some((s as u32, k, w))
            })
            .collect()
    }

    /// Checks invariants 1–5.
    ///
    /// # Errors
    /// The number of the broken invariant.
    #[cfg(any(test, feature = "test-util"))]
    pub(crate) fn check(&self) -> Result<(), u8> {
        let g = epoch::pin();
        let t = self.table(&g);
        let (mut used, mut live, mut free, mut pend) = (0, 0, 0, 0);
        let mut listed: std::collections::HashSet<u32> = self.retired.iter().copied().collect();
        listed.extend(self.pending.iter().copied());
        if self.batches.iter().map(|&(_, n)| n).sum::<usize>() != self.pending.len() {
            return Err(3);
        }
        if listed.len() != self.retired.len() + self.pending.len() {
            return Err(3);
        }
        for s in 0..t.slots() {
            let k = t.key(s).load(Ordering::Relaxed);
            let zero = t.row_is_zero(s);
            match k {
                EMPTY => continue,
                PENDING => {
                    pend += 1;
                    if !zero || !listed.contains(&(s as u32)) {
                        return Err(3);
                    }
                }
                FREE => {
                    free += 1;
                    if !zero {
                        return Err(3);
                    }
                }
                _ => {
                    if zero {
                        return Err(1);
                    }
                    live += 1;
                }
            }
            used += 1;
        }
        if used != self.used || live != self.live || free != self.free || pend != listed.len() {
            return Err(1);
        }
        if used * self.cap.1 > t.slots() * self.cap.0 {
            return Err(2);
        }
        if t.sparse {
            let (mut rows, mut bytes) = (std::collections::HashSet::new(), 0);
            for i in 0..t.slots() {
                let c = t.cell(i).load(Ordering::Relaxed);
                match sparse::heap(c) {
                    None if c & 1 == 1 => {
                        let ids: Vec<u64> = (0..3)
                            .map(|f| (c >> (1 + sparse::ID_BITS * f)) & sparse::ID_MASK)
                            .collect();
                        let n = ids.iter().take_while(|&&id| id != 0).count();
                        let packed = ids[n..].iter().all(|&id| id == 0);
                        if n == 0 || !packed || !ids[..n].windows(2).all(|w| w[0] < w[1]) {
                            return Err(4);
                        }
                    }
                    None => {}
                    Some(p) => {
                        if !rows.insert(p as usize) {
                            return Err(4);
                        }
                        let mw = t.words.div_ceil(64);
                        // Safety: a linked heap row is live while the writer is pinned (`g`),
                        // and the writer is the only one that frees rows.
                        let len = unsafe { sparse::heap_len(p, t.words) };
                        let words = (mw..len).map(|i| unsafe { &*p.add(i) });
                        if words.map(|w| w.load(Ordering::Relaxed)).any(|w| w == 0) {
                            return Err(4);
                        }
                        bytes += len * 8;
                    }
                }
            }
            if bytes != self.shared.heap.load(Ordering::Relaxed) {
                return Err(5);
            }
        }
        Ok(())
    }
}

/// Tests that need the global epoch to advance hold this, so the test that pins a reader
/// on purpose does not starve them when tests run in parallel.
#[cfg(test)]
pub(crate) static EPOCH_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    /// Sets a bit, growing first when needed (what the event index does per event).
    fn set(t: &mut TableWriter, k: u64, bit: usize) -> u32 {
        let g = epoch::pin();
        t.reserve(1, &g);
        t.set_bit(k, bit, &g)
    }

    /// Sparse rows (inline, heap, in-place words, shrinking back) read exactly as dense
    /// rows under the same random sets and clears, across rebuilds; heap bytes return to 0.
    #[test]
    fn sparse_rows_equal_dense_rows() {
        let _serial = EPOCH_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let words = 3;
        let mut dense = TableWriter::with_layout(words, false);
        let mut sparse = TableWriter::with_layout(words, true);
        let (ds, ss) = (dense.shared(), sparse.shared());
        let mut state = 11u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 33
        };
        let mut slots: std::collections::HashMap<u64, (u32, u32)> = Default::default();
        for step in 0..20_000 {
            let g = epoch::pin();
            let k = next() % 300;
            // Few bits per key mostly (inline), some keys with many (heap rows).
            let bit = if k < 20 {
                next() % 192
            } else {
                next() % 6 * 37
            } as usize;
            if next() % 3 != 0 {
                if let Some(m) = dense.reserve(1, &g) {
                    for (_, (d, _)) in slots.iter_mut() {
                        *d = m[*d as usize];
                    }
                }
                if let Some(m) = sparse.reserve(1, &g) {
                    for (_, (_, s)) in slots.iter_mut() {
                        *s = m[*s as usize];
                    }
                }
                let (d, dh) = dense.set_bit_had(k, bit, &g);
                let (s, sh) = sparse.set_bit_had(k, bit, &g);
                assert_eq!(dh, sh, "step {step}");
                slots.insert(k, (d, s));
            } else if let Some(&(d, s)) = slots.get(&k) {
                assert_eq!(dense.only_bit(d, bit, &g), sparse.only_bit(s, bit, &g));
                dense.clear_bit(d, bit, &g);
                sparse.clear_bit(s, bit, &g);
                if !ds.get_into(k, &g, &mut [0; 3]) {
                    slots.remove(&k);
                }
            }
            dense.end_batch(&g);
            sparse.end_batch(&g);
            if step % 1_000 == 0 {
                let (a, b) = (dense.shrink(&g), sparse.shrink(&g));
                for (_, (d, s)) in slots.iter_mut() {
                    if let Some(m) = &a {
                        *d = m[*d as usize];
                    }
                    if let Some(m) = &b {
                        *s = m[*s as usize];
                    }
                }
            }
            let (mut rd, mut rs) = ([0u64; 3], [0u64; 3]);
            let k = next() % 300;
            assert_eq!(ds.get_into(k, &g, &mut rd), ss.get_into(k, &g, &mut rs));
            assert_eq!(rd, rs, "key {k} at step {step}");
        }
        assert_eq!(dense.check(), Ok(()));
        assert_eq!(sparse.check(), Ok(()));
        let mut a = dense.entries();
        let mut b = sparse.entries();
        a.sort();
        b.sort();
        assert_eq!(a, b);
        assert!(
            ss.heap.load(Ordering::Relaxed) > 0,
            "no heap row was exercised"
        );
        let g = epoch::pin();
        for (k, (_, s)) in slots {
            for bit in 0..192 {
                sparse.clear_bit(s, bit, &g);
            }
            let _ = k;
        }
        sparse.end_batch(&g);
        assert_eq!(ss.heap.load(Ordering::Relaxed), 0);
        assert_eq!(sparse.check(), Ok(()));
    }

    /// Growth keeps every bit across rebuilds, the slot map follows every key, and memory is
    /// counted as capacity × row size.
    #[test]
    fn growth_keeps_rows_and_maps_slots() {
        let mut t = TableWriter::new(4);
        let s = t.shared();
        let mut slots = Vec::new();
        for k in 0..5_000u64 {
            let g = epoch::pin();
            if let Some(map) = t.reserve(1, &g) {
                for x in &mut slots {
                    *x = map[*x as usize];
                    assert_ne!(*x, NO_SLOT);
                }
            }
            slots.push(t.set_bit(k, (k % 256) as usize, &g));
        }
        assert_eq!(t.live(), 5_000);
        assert_eq!(t.check(), Ok(()));
        let g = epoch::pin();
        let mut row = [0u64; 4];
        for k in 0..5_000u64 {
            assert!(s.get_into(k, &g, &mut row));
            let b = (k % 256) as usize;
            let mut want = [0u64; 4];
            want[b / 64] = 1 << (b % 64);
            assert_eq!(row, want, "key {k}");
            // The slot map kept the writer's slot numbers right.
            assert!(t.has_bit(slots[k as usize], b, &g));
            let stored = if k == 0 { ZERO_KEY } else { k };
            assert_eq!(t.key_at(slots[k as usize], &g), stored);
        }
        drop(g);
        // Growth (×1.5 at least, from the 0.8 cap) keeps 4-word rows at load 0.53 … 0.8.
        assert!(s.capacity() * 8 <= 5_000 * 15, "{}", s.capacity());
        assert!(s.capacity() * 4 >= 5_000 * 5, "{}", s.capacity());
        assert_eq!(s.memory_bytes(), s.capacity() * 40);
        // Clearing 4,000 of them unlinks their rows: absent for readers.
        let g = epoch::pin();
        for k in 0..4_000u64 {
            t.clear_bit(slots[k as usize], (k % 256) as usize, &g);
        }
        t.end_batch(&g);
        assert_eq!(t.live(), 1_000);
        assert!(!s.get_into(7, &g, &mut row));
        assert_eq!(row, [0; 4]);
        assert_eq!(t.check(), Ok(()));
        drop(g);
        // Fewer than 1/4 live: a shrink rebuild drops every tombstone.
        let g = epoch::pin();
        let map = t.shrink(&g).expect("shrinks");
        let moved = map[slots[4_500] as usize];
        assert_eq!(t.key_at(moved, &g), 4_500);
        assert!(t.has_bit(moved, 4_500 % 256, &g));
        assert_eq!(map[slots[7] as usize], NO_SLOT);
        assert_eq!(t.entries().len(), 1_000);
        // Load 0.6, rounded up to a multiple of 2048 / 64 = 32 slots.
        assert_eq!(s.capacity(), (1_001 * 5 / 3usize).div_ceil(32) * 32);
        assert_eq!(t.check(), Ok(()));
        // Key 0 is stored under its stand-in and still found.
        drop(g);
        set(&mut t, 0, 200);
        let g = epoch::pin();
        assert!(s.get_into(0, &g, &mut row));
        assert_eq!(row[3], 1 << 8);
        // Marker values as real keys are stored under stand-ins too.
        drop(g);
        set(&mut t, PENDING, 1);
        set(&mut t, FREE, 2);
        let g = epoch::pin();
        assert!(s.get_into(PENDING, &g, &mut row));
        assert_eq!(row, [2, 0, 0, 0]);
        assert!(s.get_into(FREE, &g, &mut row));
        assert_eq!(row, [4, 0, 0, 0]);
        assert_eq!(t.check(), Ok(()));
    }

    /// Churn at a constant live count (10 keys removed and 10 new ones inserted per batch,
    /// 0.5 % of the keys: the Mooncake ingest fixture churns ~0.2 % per event) reuses
    /// tombstones once the epoch allows it, so rebuilds come less often than the headroom
    /// alone allows, and the table stays at its size.
    #[test]
    fn churn_reuses_tombstones() {
        let _serial = EPOCH_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = TableWriter::new(1);
        let s = t.shared();
        // Random keys, like real block keys (sequential ones spread unnaturally evenly).
        let key = |i: u64| crate::keys::local_hash(&[i as u32, (i >> 32) as u32]);
        let mut live: VecDeque<(u64, u32)> = VecDeque::new();
        let mut next = 1u64;
        for _ in 0..2_000 {
            let g = epoch::pin();
            if let Some(map) = t.reserve(1, &g) {
                for x in live.iter_mut() {
                    x.1 = map[x.1 as usize];
                }
            }
            live.push_back((key(next), t.set_bit(key(next), 3, &g)));
            next += 1;
        }
        let cap = s.capacity();
        let before = t.rebuilds();
        for _ in 0..20_000 {
            let g = epoch::pin();
            for _ in 0..10 {
                let (_, slot) = live.pop_front().unwrap();
                t.clear_bit(slot, 3, &g);
            }
            if let Some(map) = t.reserve(10, &g) {
                for x in live.iter_mut() {
                    x.1 = map[x.1 as usize];
                }
            }
            for _ in 0..10 {
                let slot = t.set_bit(key(next), 3, &g);
                live.push_back((key(next), slot));
                next += 1;
            }
            t.end_batch(&g);
        }
        assert_eq!(t.check(), Ok(()));
        assert_eq!(t.live(), 2_000);
        // Without reuse every rebuild would admit (cap − target) × slots = 0.15 × slots new
        // keys; reused tombstones stretch that.
        let headroom = (s.capacity() * 15 / 100) as u64;
        let rebuilds = t.rebuilds() - before;
        assert!(t.reused > 20_000, "{} inserts reused a tombstone", t.reused);
        assert!(
            rebuilds * headroom < 200_000,
            "{rebuilds} rebuilds of {headroom} headroom for 200k churned inserts"
        );
        assert!(s.capacity() <= cap * 2, "{} vs {cap}", s.capacity());
        let g = epoch::pin();
        let mut row = [0u64];
        for &(k, slot) in &live {
            assert!(s.get_into(k, &g, &mut row));
            assert!(t.has_bit(slot, 3, &g));
        }
        assert!(!s.get_into(key(1), &g, &mut row));
    }

    /// A table replaced by a rebuild is freed by the writer, never by a reader that collects
    /// epoch garbage: after a reader thread pins and flushes until the epoch has moved on, the
    /// old table waits in the graveyard, and the writer's next batch frees it.
    #[test]
    fn readers_never_free_a_replaced_table() {
        let _serial = EPOCH_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = TableWriter::new(1);
        let s = t.shared();
        set(&mut t, 1, 0);
        let g = epoch::pin();
        t.rebuild(100_000, &g);
        drop(g);
        // The reader's pins run the deferred functions (crossbeam collects on pin and flush).
        let reader_s = Arc::clone(&s);
        let waited = std::thread::spawn(move || {
            let mut row = [0u64];
            for i in 0..10_000 {
                let g = epoch::pin();
                assert!(reader_s.get_into(1, &g, &mut row));
                g.flush();
                drop(g);
                if reader_s.graveyard.len() == 1 {
                    return Some(i);
                }
            }
            None
        })
        .join()
        .unwrap();
        assert!(waited.is_some(), "the old table reached the graveyard");
        assert_eq!(s.graveyard.len(), 1, "no reader freed it");
        let g = epoch::pin();
        t.end_batch(&g);
        assert_eq!(s.graveyard.len(), 0, "the writer's batch freed it");
        let mut row = [0u64];
        assert!(s.get_into(1, &g, &mut row));
        assert_eq!(row, [1]);
    }

    /// A reader pinned across the writer's batches keeps the tombstones it might be reading
    /// from being reused: while it stays pinned no slot becomes FREE.
    #[test]
    fn pinned_reader_blocks_reuse() {
        let _serial = EPOCH_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = TableWriter::new(1);
        let mut slots = Vec::new();
        for k in 1..=100u64 {
            slots.push(set(&mut t, k, 0));
        }
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let reader = std::thread::spawn(move || {
            let _g = epoch::pin();
            pinned_tx.send(()).unwrap();
            done_rx.recv().unwrap();
        });
        pinned_rx.recv().unwrap();
        for &slot in slots.iter().take(50) {
            let g = epoch::pin();
            t.clear_bit(slot, 0, &g);
            t.end_batch(&g);
        }
        for _ in 0..1_000 {
            let g = epoch::pin();
            g.flush();
            t.end_batch(&g);
        }
        assert_eq!(t.free, 0, "a pinned reader must block reuse");
        done_tx.send(()).unwrap();
        reader.join().unwrap();
        // Other tests' readers may hold the epoch back for a moment: retry for up to 10 s.
        let start = std::time::Instant::now();
        while t.free == 0 && start.elapsed() < std::time::Duration::from_secs(10) {
            let g = epoch::pin();
            g.flush();
            t.end_batch(&g);
        }
        assert!(
            t.free > 0,
            "tombstones become reusable once the reader unpins"
        );
        assert_eq!(t.check(), Ok(()));
    }
}
