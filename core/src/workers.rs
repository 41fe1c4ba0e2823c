//! [`Workers`]: the registry of engines behind the gateway, with the in-flight counts all
//! shards share.

use crate::CoreError;
use crate::config::parse_worker_url;
use crate::load::LoadGuard;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// One worker (an engine endpoint).
#[derive(Debug)]
pub struct Worker {
    /// Dense id, the worker's position in the config (`0..n`); also its index tenant id.
    pub id: usize,
    /// Normalised base URL `http://host:port` (no trailing `/`).
    pub url: String,
    /// Host part of the URL.
    pub host: String,
    /// Port part of the URL.
    pub port: u16,
    /// Requests sent and not finished (response body ended, failed, or client gone).
    pub(crate) in_flight: AtomicUsize,
    /// Requests ever sent.
    pub(crate) processed: AtomicU64,
    /// Requests the engine runs or queues that this router did not send (other router
    /// replicas, direct clients), from its last load report; 0 without reports.
    foreign: AtomicUsize,
}

impl Worker {
    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests ever sent.
    pub fn processed(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
    }

    /// Requests on the engine that this router did not send, from its last load report.
    pub fn foreign(&self) -> usize {
        self.foreign.load(Ordering::Relaxed)
    }

    /// Records a load report: the engine runs or queues `engine_requests` (running +
    /// waiting, [`crate::load::engine_requests`]). The foreign part is what exceeds this
    /// router's own in-flight count now, clamped at 0: requests still on their way to the
    /// engine, or relaying their last bytes from it, make it read low, never high. `None`
    /// (no report, or a failed poll) forgets the last one, so a dark engine is counted on
    /// this router's own requests only.
    pub fn report(&self, engine_requests: Option<usize>) {
        let foreign = engine_requests.map_or(0, |n| n.saturating_sub(self.in_flight()));
        self.foreign.store(foreign, Ordering::Relaxed);
    }
}

/// The worker registry, shared by all shards through an `Arc`. Counts are atomics: a shard
/// never locks to read or change a load.
///
/// # Invariants
/// 1. Ids are dense: the worker at position `i` has `id == i`.
/// 2. URLs are normalised (`http://host:port`, no trailing `/`) and distinct.
/// 3. A worker's `in_flight` equals the number of live [`LoadGuard`]s taken on it.
#[derive(Debug)]
pub struct Workers {
    list: Vec<Arc<Worker>>,
}

impl Workers {
    /// Registry of `urls`, ids in order.
    ///
    /// # Errors
    /// [`CoreError::BadWorkerUrl`] for a URL that is not `http://host:port`.
    pub fn new(urls: &[String]) -> Result<Workers, CoreError> {
        let list = urls
            .iter()
            .enumerate()
            .map(|(id, u)| {
                let (url, host, port) = parse_worker_url(u)?;
                Ok(Arc::new(Worker {
                    id,
                    url,
                    host,
                    port,
                    in_flight: AtomicUsize::new(0),
                    processed: AtomicU64::new(0),
                    foreign: AtomicUsize::new(0),
                }))
            })
            .collect::<Result<_, CoreError>>()?;
        Ok(Workers { list })
    }

    /// Number of workers.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// True with no workers.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Worker `id`.
    ///
    /// # Panics
    /// When `id >= len()`.
    pub fn get(&self, id: usize) -> &Worker {
        &self.list[id]
    }

    /// All workers in id order.
    pub fn iter(&self) -> impl Iterator<Item = &Worker> {
        self.list.iter().map(|w| w.as_ref())
    }

    /// Snapshot of loads, by worker id (the load input of every policy): requests this
    /// router has in flight, plus the foreign requests of the last load report
    /// ([`Worker::report`]; 0 when load reports are off).
    pub fn loads(&self) -> Vec<usize> {
        self.list
            .iter()
            .map(|w| w.in_flight() + w.foreign())
            .collect()
    }

    /// Checks invariants 1 and 2 (3 is checked by the guard tests).
    ///
    /// # Errors
    /// The number of the first broken invariant and the worker id.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), (u8, usize)> {
        let mut seen = std::collections::HashSet::new();
        for (i, w) in self.list.iter().enumerate() {
            if w.id != i {
                return Err((1, i));
            }
            if w.url.ends_with('/') || !seen.insert(w.url.as_str()) {
                return Err((2, i));
            }
        }
        Ok(())
    }

    /// Counts one request on worker `id` until the returned guard drops. Take it before the
    /// request is sent upstream (bug-cases.md B1).
    ///
    /// # Panics
    /// When `id >= len()`.
    pub fn acquire(&self, id: usize) -> LoadGuard {
        LoadGuard::new(self.list[id].clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two() -> Workers {
        Workers::new(&["http://a:1".into(), "http://b:2/".into()]).unwrap()
    }

    #[test]
    fn registry_ids_and_urls() {
        let w = two();
        assert_eq!(w.check_invariants(), Ok(()));
        assert_eq!(w.len(), 2);
        assert_eq!(w.get(1).url, "http://b:2");
        assert_eq!((w.get(1).host.as_str(), w.get(1).port), ("b", 2));
        assert!(Workers::new(&["ftp://x:1".into()]).is_err());
    }

    #[test]
    fn guard_counts_once() {
        let w = two();
        let g1 = w.acquire(0);
        let g2 = w.acquire(0);
        let g3 = w.acquire(1);
        assert_eq!(w.loads(), vec![2, 1]);
        drop(g2);
        assert_eq!(w.loads(), vec![1, 1]);
        drop((g1, g3));
        assert_eq!(w.loads(), vec![0, 0]);
        assert_eq!(w.get(0).processed(), 2);
    }

    /// A report adds what the engine holds beyond this router's own requests; our in-flight
    /// requests are never counted twice, and a failed poll forgets the report.
    #[test]
    fn load_reports_add_foreign_requests_once() {
        let w = two();
        let g = w.acquire(0);
        w.get(0).report(Some(5)); // 1 of ours + 4 from elsewhere
        w.get(1).report(Some(2));
        assert_eq!(w.loads(), vec![5, 2]);
        let h = w.acquire(0); // ours, sent after the report
        assert_eq!(w.loads(), vec![6, 2]);
        w.get(0).report(Some(1)); // fewer than ours: still on the way, clamped at 0
        assert_eq!((w.get(0).foreign(), w.loads()), (0, vec![2, 2]));
        w.get(1).report(None);
        assert_eq!(w.loads(), vec![2, 0]);
        drop((g, h));
        assert_eq!(w.loads(), vec![0, 0]);
    }

    #[test]
    fn guard_is_send_and_registry_is_sync() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<LoadGuard>();
        send_sync::<Workers>();
        // A guard moved to another thread releases there, exactly once.
        let w = two();
        let g = w.acquire(1);
        std::thread::spawn(move || drop(g)).join().unwrap();
        assert_eq!(w.loads(), vec![0, 0]);
        assert_eq!(w.get(1).processed(), 1);
    }

    #[test]
    fn concurrent_acquire_release_ends_at_zero() {
        let w = Arc::new(two());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let w = w.clone();
                std::thread::spawn(move || {
                    for i in 0..2_000 {
                        let g = w.acquire((t + i) % 2);
                        if i % 3 == 0 {
                            let _h = w.acquire(i % 2);
                        }
                        drop(g);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(w.loads(), vec![0, 0]);
        assert_eq!(
            w.get(0).processed() + w.get(1).processed(),
            4 * (2_000 + 667)
        );
    }
}
