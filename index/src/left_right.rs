//! [`LeftRight`]: lock-free reads of a structure with one writer at a time, by keeping two
//! copies (the left-right pattern; Ramalhete & Correia 2015, the `left-right` crate).
//!
//! Readers enter the active copy by bumping that copy's reader count and re-checking that it
//! is still active; they never take a lock and never wait for the writer. Writes are queued
//! (`write` never blocks either); whichever writer holds the writer lock (taken with
//! `try_lock`, so nobody waits for it) drains the queue, applies the batch to the standby
//! copy, swaps the copies, and replays the batch on the other copy once its readers have left
//! (at its next write, or sooner when a writer thread calls [`LeftRight::catch_up`]).
//! The cost: two copies in memory and every write applied twice. Chosen for the trees because
//! their writes touch many nodes (splits, merges, evictions) that would each need epoch
//! reclamation in a concurrent tree, while a tree match is only ~1 µs so the writer's wait for
//! readers to leave a copy is short.

use std::cell::UnsafeCell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

#[repr(align(64))]
struct Padded(AtomicUsize);

struct Side<Op> {
    /// Ops applied to the active copy but not yet to the standby one.
    log: Vec<Op>,
    /// An empty vector whose allocation the next batch reuses (a flush per request
    /// otherwise allocates one).
    spare: Vec<Op>,
}

/// Two copies of a `T`, read without locks, written through queued ops.
pub struct LeftRight<T, Op> {
    copies: [UnsafeCell<T>; 2],
    active: AtomicUsize,
    readers: [Padded; 2],
    writer: Mutex<Side<Op>>,
    tx: crossbeam_channel::Sender<Op>,
    rx: crossbeam_channel::Receiver<Op>,
    apply: fn(&mut T, &Op),
}

// Safety: readers get `&T` only to the active copy and the writer mutates only the standby
// copy after its reader count drops to 0 (see `read` and `flush`), so `T: Sync` suffices for
// shared reads and `T: Send` for the writer's exclusive access from any thread.
unsafe impl<T: Send + Sync, Op: Send> Sync for LeftRight<T, Op> {}
// Safety: owning the structure owns both copies.
unsafe impl<T: Send, Op: Send> Send for LeftRight<T, Op> {}

/// A read of the active copy; the copy cannot be written while this lives.
pub struct ReadGuard<'a, T, Op> {
    lr: &'a LeftRight<T, Op>,
    side: usize,
}

impl<T, Op> std::ops::Deref for ReadGuard<'_, T, Op> {
    type Target = T;
    fn deref(&self) -> &T {
        // Safety: our reader count on `side` keeps the writer out of this copy.
        unsafe { &*self.lr.copies[self.side].get() }
    }
}

impl<T, Op> Drop for ReadGuard<'_, T, Op> {
    fn drop(&mut self) {
        self.lr.readers[self.side].0.fetch_sub(1, Ordering::Release);
    }
}

impl<T: Clone, Op> LeftRight<T, Op> {
    /// Two copies of `init`; `apply` must be deterministic, so both copies stay equal.
    pub fn new(init: T, apply: fn(&mut T, &Op)) -> Self {
        let (tx, rx) = crossbeam_channel::unbounded();
        Self {
            copies: [UnsafeCell::new(init.clone()), UnsafeCell::new(init)],
            active: AtomicUsize::new(0),
            readers: [Padded(AtomicUsize::new(0)), Padded(AtomicUsize::new(0))],
            writer: Mutex::new(Side {
                log: Vec::new(),
                spare: Vec::new(),
            }),
            tx,
            rx,
            apply,
        }
    }
}

impl<T, Op> LeftRight<T, Op> {
    /// The current copy. Lock-free: at most one retry per concurrent swap, never a wait.
    pub fn read(&self) -> ReadGuard<'_, T, Op> {
        loop {
            let side = self.active.load(Ordering::SeqCst);
            self.readers[side].0.fetch_add(1, Ordering::SeqCst);
            if self.active.load(Ordering::SeqCst) == side {
                return ReadGuard { lr: self, side };
            }
            self.readers[side].0.fetch_sub(1, Ordering::Release);
        }
    }

    /// Queues `op` and, unless another thread is writing (which then applies it), applies
    /// every queued op and publishes the result. Never blocks on the writer lock.
    pub fn write(&self, op: Op) {
        // The receiver lives as long as `self`, so the send cannot fail.
        let _ = self.tx.send(op);
        self.flush();
    }

    /// Ops queued and not yet applied.
    pub fn pending(&self) -> usize {
        self.rx.len()
    }

    /// Applies queued ops if no other thread is doing so; returns whether it did.
    pub fn flush(&self) -> bool {
        let mut did = false;
        loop {
            let Ok(mut side) = self.writer.try_lock() else {
                return did;
            };
            let mut batch = std::mem::take(&mut side.spare);
            batch.extend(self.rx.try_iter());
            if batch.is_empty() {
                side.spare = batch;
                return did;
            }
            did = true;
            let standby = self.standby_without_readers();
            // Safety: the standby copy has no readers (count 0 after `active` stopped pointing
            // at it; new readers re-check `active` and back off) and we hold the writer lock.
            let copy = unsafe { &mut *self.copies[standby].get() };
            for op in side.log.drain(..) {
                (self.apply)(copy, &op);
            }
            for op in &batch {
                (self.apply)(copy, op);
            }
            self.active.store(standby, Ordering::SeqCst);
            side.spare = std::mem::replace(&mut side.log, batch);
            drop(side);
            if self.rx.is_empty() {
                return did;
            }
        }
    }

    /// Replays on the standby copy the last batch, which only the active copy has, if no
    /// other thread is writing; returns whether it did. The next write then applies only its
    /// own ops: a writer thread that catches up after each write takes the second half of
    /// every write's cost off the writing thread, whose write is still visible to readers as
    /// soon as it returns.
    pub fn catch_up(&self) -> bool {
        let Ok(mut side) = self.writer.try_lock() else {
            return false;
        };
        if side.log.is_empty() {
            return false;
        }
        let standby = self.standby_without_readers();
        // Safety: as in `flush`: no readers on the standby copy, and the writer lock held.
        let copy = unsafe { &mut *self.copies[standby].get() };
        for op in side.log.drain(..) {
            (self.apply)(copy, &op);
        }
        drop(side);
        // A write that found the lock taken meanwhile left its op queued for the holder (as
        // in `flush`): apply it now, or it would wait for the next write.
        if !self.rx.is_empty() {
            self.flush();
        }
        true
    }

    /// The standby copy, once the readers that entered it before the last swap have left
    /// (they are finishing a read, ~µs; the writer, never a reader, waits for them). Called
    /// with the writer lock held.
    fn standby_without_readers(&self) -> usize {
        let standby = 1 - self.active.load(Ordering::SeqCst);
        let mut spins = 0u32;
        while self.readers[standby].0.load(Ordering::SeqCst) != 0 {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        standby
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    static APPLIED: AtomicUsize = AtomicUsize::new(0);

    fn push(v: &mut Vec<u32>, op: &u32) {
        APPLIED.fetch_add(1, Ordering::Relaxed);
        v.push(*op);
    }

    /// A write is read at once; `catch_up` replays it on the other copy, so the next write
    /// applies only its own op (1 application instead of 2), and reads after any sequence
    /// see every op in order.
    #[test]
    fn catch_up_takes_the_replay_off_the_next_write() {
        let lr = LeftRight::new(Vec::new(), push);
        let applied = || APPLIED.load(Ordering::Relaxed);
        lr.write(1);
        assert_eq!((lr.read().clone(), applied()), (vec![1], 1));
        lr.write(2);
        assert_eq!(
            (lr.read().clone(), applied()),
            (vec![1, 2], 3),
            "replay of 1, then 2"
        );
        assert!(lr.catch_up());
        assert_eq!(applied(), 4);
        assert!(!lr.catch_up(), "nothing left to replay");
        lr.write(3);
        assert_eq!((lr.read().clone(), applied()), (vec![1, 2, 3], 5), "3 only");
        assert!(lr.catch_up());
        lr.write(4);
        assert_eq!((lr.read().clone(), applied()), (vec![1, 2, 3, 4], 7));
    }
}
