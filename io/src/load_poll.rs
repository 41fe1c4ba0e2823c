//! Engine load reports (`--load-poll-ms`): one `kv-load` thread reads every worker's
//! `/metrics` in turn and records its running + waiting requests
//! ([`kvroute_core::load::engine_requests`]) on the worker, where they become the foreign part
//! of its load ([`kvroute_core::workers::Worker::report`]). With several router replicas, each
//! then sees the requests the others sent (bug-cases.md B44), up to one poll old; its own
//! requests count the moment it sends them, which is SMG's since-poll credit
//! (anchors.md §2.5). The thread ends once the gateway's worker registry is dropped.

use kvroute_core::workers::Workers;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Starts the `kv-load` thread: every `every`, one `GET /metrics` per present worker, each
/// allowed `timeout` to connect and `timeout` per read. A failed poll (connect error,
/// timeout, status other than 200, no known gauge) clears that worker's report.
///
/// # Errors
/// The thread could not be spawned.
pub fn start(workers: &Arc<Workers>, every: Duration, timeout: Duration) -> std::io::Result<()> {
    let workers: Weak<Workers> = Arc::downgrade(workers);
    std::thread::Builder::new()
        .name("kv-load".into())
        .spawn(move || {
            while let Some(w) = workers.upgrade() {
                let started = Instant::now();
                for worker in w.iter() {
                    let Some(addr) = worker.addr else { continue };
                    let report = crate::health::http_get(
                        addr,
                        &worker.authority,
                        "/metrics",
                        timeout,
                        worker.api_key.as_deref(),
                    )
                    .inspect_err(
                        |e| tracing::debug!(worker = worker.id, error = %e, "load report failed"),
                    )
                    .ok()
                    .and_then(|(status, body)| {
                        (status == 200)
                            .then(|| {
                                kvroute_core::load::engine_requests(&String::from_utf8_lossy(&body))
                            })
                            .flatten()
                    });
                    worker.report(report);
                }
                drop(w);
                std::thread::sleep(every.saturating_sub(started.elapsed()));
            }
        })
        .map(|_| ())
}
