//! [`LoadGuard`]: one request counted on one worker, released exactly once.

use crate::workers::Worker;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// RAII token for one in-flight request: made by [`crate::workers::Workers::acquire`] before
/// the request is sent, dropped when the response body ends, fails, or the client goes away
/// (bug-cases.md B1, B7). `Drop` decrements exactly once.
#[derive(Debug)]
pub struct LoadGuard {
    worker: Arc<Worker>,
}

impl LoadGuard {
    pub(crate) fn new(worker: Arc<Worker>) -> Self {
        worker.in_flight.fetch_add(1, Ordering::Relaxed);
        worker.processed.fetch_add(1, Ordering::Relaxed);
        Self { worker }
    }

    /// The worker this guard counts on.
    pub fn worker_id(&self) -> usize {
        self.worker.id
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}
