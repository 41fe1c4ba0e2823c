//! Engine load reports (`--load-poll-ms`): one `kv-load` thread reads every worker's
//! `/metrics` in turn and records its running + waiting requests
//! ([`kvroute_core::load::engine_requests`]) on the worker, where they become the foreign part
//! of its load ([`kvroute_core::workers::Worker::report`]). With several router replicas, each
//! then sees the requests the others sent (bug-cases.md B44), up to one poll old; its own
//! requests count the moment it sends them, which is SMG's since-poll credit
//! (anchors.md §2.5). The thread ends once the gateway's worker registry is dropped.

use crate::upstream::Target;
use kvroute_core::workers::Workers;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Largest `/metrics` response read, bytes; a longer one is cut there (the request gauges come
/// early in vLLM's and SGLang's output).
const MAX_METRICS_BYTES: u64 = 4 * 1024 * 1024;

/// Starts the `kv-load` thread: every `every`, one `GET /metrics` per target, each allowed
/// `timeout` to connect and `timeout` per read. A failed poll (connect error, timeout, status
/// other than 200, no known gauge) clears that worker's report.
///
/// # Errors
/// The thread could not be spawned.
pub fn start(
    workers: &Arc<Workers>,
    targets: Vec<Target>,
    every: Duration,
    timeout: Duration,
) -> std::io::Result<()> {
    let workers: Weak<Workers> = Arc::downgrade(workers);
    std::thread::Builder::new()
        .name("kv-load".into())
        .spawn(move || {
            while let Some(w) = workers.upgrade() {
                let started = Instant::now();
                for t in &targets {
                    let report = poll(t, timeout)
                        .inspect_err(
                            |e| tracing::debug!(worker = %t.url, error = %e, "load report failed"),
                        )
                        .ok()
                        .flatten();
                    w.get(t.id).report(report);
                }
                drop(w);
                std::thread::sleep(every.saturating_sub(started.elapsed()));
            }
        })
        .map(|_| ())
}

/// One load report from `t`: its running + waiting requests, `Ok(None)` when its `/metrics`
/// names no known gauge or answers other than 200.
fn poll(t: &Target, timeout: Duration) -> std::io::Result<Option<usize>> {
    let mut s = TcpStream::connect_timeout(&t.addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    // HTTP/1.0: the answer is never chunked and ends with the connection.
    write!(
        s,
        "GET /metrics HTTP/1.0\r\nHost: {}\r\nAccept: text/plain\r\n\r\n",
        t.authority
    )?;
    let mut resp = Vec::new();
    s.take(MAX_METRICS_BYTES).read_to_end(&mut resp)?;
    // The gateway's own response-head parser; a malformed or cut head is no report.
    let Ok(Some((head, len))) = crate::http1::parse_response_head(
        &resp,
        "GET",
        kvroute_core::config::defaults::MAX_HEAD_BYTES,
    ) else {
        return Ok(None);
    };
    let body = String::from_utf8_lossy(&resp[len..]);
    Ok((head.status == 200)
        .then(|| kvroute_core::load::engine_requests(&body))
        .flatten())
}
