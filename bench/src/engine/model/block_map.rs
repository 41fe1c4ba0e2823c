//! The block manager's `block hash → arena slot` map: open addressing with linear probing
//! over one array of 16-byte entries (key and slot side by side), kept at most half full,
//! deletion by backward shift (no tombstones). A lookup reads one cache line, where a
//! hashbrown map reads a control group and then a bucket (two lines), and the caller can
//! prefetch that line ([`BlockMap::prefetch`]) for the next blocks of a request: a large
//! engine's map is far bigger than the CPU caches, so each lookup is a memory access.
//!
//! Keys are engine block hashes (uniform xxh3 outputs); they are still multiplied by an odd
//! constant before taking the top bits, so structured test keys spread too.

use super::blocks::{BlockHash, Slot};

/// Slot value of an empty entry.
const VACANT: Slot = Slot::MAX;

/// Fewest entries of a map's array.
const MIN_ENTRIES: usize = 16;

/// One position of the array: a key and its slot ([`VACANT`]: empty position).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
struct Entry {
    key: BlockHash,
    slot: Slot,
}

const EMPTY: Entry = Entry {
    key: 0,
    slot: VACANT,
};

/// Map of block hashes to arena slots (slots < `u32::MAX`). Iteration order is the array
/// order, which depends on the keys and the history of the map; callers treat it as
/// unordered.
#[derive(Debug, Clone)]
pub(crate) struct BlockMap {
    entries: Box<[Entry]>,
    /// `64 − log2(entries.len())`: a key's home is the top bits of its mixed value.
    shift: u32,
    len: usize,
}

/// Where a key is or would go (from [`BlockMap::find`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The key is present with this slot.
    Found(Slot),
    /// The key is absent; [`BlockMap::insert_at`] puts it at this position.
    Absent(usize),
}

impl BlockMap {
    /// Empty map with room for `n` keys before its first growth.
    pub(crate) fn with_capacity(n: usize) -> Self {
        let size = (n.max(1) * 2).next_power_of_two().max(MIN_ENTRIES);
        Self {
            entries: vec![EMPTY; size].into_boxed_slice(),
            shift: 64 - size.trailing_zeros(),
            len: 0,
        }
    }

    /// Keys held.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn home(&self, key: BlockHash) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.entries.len() - 1
    }

    /// Asks the CPU to start loading the home position of `key` (a hint: no effect on the
    /// map, a later lookup of `key` only waits less).
    #[inline]
    pub(crate) fn prefetch(&self, key: BlockHash) {
        let p = self.entries[self.home(key)..].as_ptr();
        #[cfg(target_arch = "x86_64")]
        // Safety: `_mm_prefetch` is a hint and never faults; `p` points into `entries`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    /// The slot of `key`, or where it would be inserted.
    #[inline]
    pub(crate) fn find(&self, key: BlockHash) -> Probe {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let e = &self.entries[i];
            if e.slot == VACANT {
                return Probe::Absent(i);
            }
            if e.key == key {
                return Probe::Found(e.slot);
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot of `key`, if present.
    #[inline]
    pub(crate) fn get(&self, key: BlockHash) -> Option<Slot> {
        match self.find(key) {
            Probe::Found(s) => Some(s),
            Probe::Absent(_) => None,
        }
    }

    /// Inserts absent `key` with `slot` at `pos`, the position [`Self::find`] just returned
    /// for it (no other change in between). May grow the map.
    ///
    /// # Panics
    /// If `slot` is `u32::MAX` (the empty marker).
    #[inline]
    pub(crate) fn insert_at(&mut self, pos: usize, key: BlockHash, slot: Slot) {
        assert_ne!(slot, VACANT, "slot u32::MAX is the empty marker");
        debug_assert_eq!(self.find(key), Probe::Absent(pos));
        self.entries[pos] = Entry { key, slot };
        self.len += 1;
        if self.len * 2 > self.entries.len() {
            self.grow();
        }
    }

    /// Inserts `key` with `slot`, replacing its slot if present.
    ///
    /// # Panics
    /// If `slot` is `u32::MAX` (the empty marker).
    #[cfg(test)]
    pub(crate) fn insert(&mut self, key: BlockHash, slot: Slot) {
        match self.find(key) {
            Probe::Found(_) => {
                let mask = self.mask();
                let mut i = self.home(key);
                while self.entries[i].key != key || self.entries[i].slot == VACANT {
                    i = (i + 1) & mask;
                }
                assert_ne!(slot, VACANT, "slot u32::MAX is the empty marker");
                self.entries[i].slot = slot;
            }
            Probe::Absent(pos) => self.insert_at(pos, key, slot),
        }
    }

    /// Removes `key`; returns its slot if it was present.
    pub(crate) fn remove(&mut self, key: BlockHash) -> Option<Slot> {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let e = self.entries[i];
            if e.slot == VACANT {
                return None;
            }
            if e.key == key {
                break;
            }
            i = (i + 1) & mask;
        }
        let slot = self.entries[i].slot;
        // Backward shift: move each later entry of the run that may live at the hole (its
        // home is not cyclically in (hole, j]) into it, until an empty position.
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let e = self.entries[j];
            if e.slot == VACANT {
                break;
            }
            let h = self.home(e.key);
            if (j.wrapping_sub(h) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.entries[hole] = e;
                hole = j;
            }
        }
        self.entries[hole] = EMPTY;
        self.len -= 1;
        Some(slot)
    }

    /// Removes every key, keeping the array.
    pub(crate) fn clear(&mut self) {
        self.entries.fill(EMPTY);
        self.len = 0;
    }

    /// Every (key, slot), in array order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockHash, Slot)> + '_ {
        self.entries
            .iter()
            .filter(|e| e.slot != VACANT)
            .map(|e| (e.key, e.slot))
    }

    /// Doubles the array and re-places every key.
    fn grow(&mut self) {
        let size = self.entries.len() * 2;
        let old = std::mem::replace(&mut self.entries, vec![EMPTY; size].into_boxed_slice());
        self.shift -= 1;
        let mask = self.mask();
        for e in old.iter().filter(|e| e.slot != VACANT) {
            let mut i = self.home(e.key);
            while self.entries[i].slot != VACANT {
                i = (i + 1) & mask;
            }
            self.entries[i] = *e;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// SplitMix64 step, for reproducible key streams.
    fn next(x: &mut u64) -> u64 {
        *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn empty_map_finds_nothing() {
        let m = BlockMap::with_capacity(0);
        assert_eq!(m.len(), 0);
        assert_eq!(m.entries.len(), MIN_ENTRIES);
        assert_eq!(m.get(0), None);
        assert_eq!(m.get(u64::MAX), None);
    }

    #[test]
    fn insert_get_remove_and_growth() {
        let mut m = BlockMap::with_capacity(4);
        assert_eq!(m.entries.len(), 16);
        for k in 0..100u64 {
            m.insert(k * 1000, k as u32);
        }
        assert_eq!(m.len(), 100);
        // Half full at most: 100 keys need 256 positions.
        assert_eq!(m.entries.len(), 256);
        for k in 0..100u64 {
            assert_eq!(m.get(k * 1000), Some(k as u32));
        }
        assert_eq!(m.get(1), None);
        assert_eq!(m.remove(5000), Some(5));
        assert_eq!(m.remove(5000), None);
        assert_eq!(m.get(5000), None);
        assert_eq!(m.len(), 99);
        m.insert(6000, 7);
        assert_eq!(m.get(6000), Some(7));
        assert_eq!(m.len(), 99);
        m.clear();
        assert_eq!(m.len(), 0);
        assert_eq!(m.get(0), None);
        assert_eq!(m.iter().count(), 0);
    }

    #[test]
    fn colliding_homes_survive_removals() {
        // In a 16-position map, keys whose mixed value has equal top 4 bits share a home;
        // removing from the middle of such a run must keep the later ones findable.
        let mut m = BlockMap::with_capacity(8);
        let probe = BlockMap::with_capacity(8);
        let same: Vec<u64> = (1..10_000u64)
            .filter(|&k| probe.home(k) == 3)
            .take(5)
            .collect();
        assert_eq!(same.len(), 5);
        for (i, &k) in same.iter().enumerate() {
            m.insert(k, i as u32);
        }
        assert_eq!(m.remove(same[1]), Some(1));
        for (i, &k) in same.iter().enumerate().filter(|&(i, _)| i != 1) {
            assert_eq!(m.get(k), Some(i as u32), "key {k}");
        }
        assert_eq!(m.remove(same[0]), Some(0));
        assert_eq!(m.remove(same[4]), Some(4));
        assert_eq!(m.get(same[2]), Some(2));
        assert_eq!(m.get(same[3]), Some(3));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn matches_std_hashmap_under_random_churn() {
        let mut m = BlockMap::with_capacity(64);
        let mut r: HashMap<u64, u32> = HashMap::new();
        let mut x = 7u64;
        for step in 0..200_000u32 {
            // Keys from a small range, so inserts hit present keys and removals absent ones.
            let k = next(&mut x) % 3_000;
            match next(&mut x) % 3 {
                0 | 1 => match m.find(k) {
                    Probe::Found(s) => assert_eq!(r.get(&k), Some(&s)),
                    Probe::Absent(pos) => {
                        assert_eq!(r.get(&k), None);
                        m.insert_at(pos, k, step);
                        r.insert(k, step);
                    }
                },
                _ => assert_eq!(m.remove(k), r.remove(&k)),
            }
            assert_eq!(m.len(), r.len());
        }
        let mut got: Vec<(u64, u32)> = m.iter().collect();
        let mut want: Vec<(u64, u32)> = r.into_iter().collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
        assert!(m.len() > 1_000, "the churn kept {} keys", m.len());
    }
}
