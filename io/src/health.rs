//! Active health checks (`--health-check-interval-secs`): a `kv-health` thread sends every
//! worker `GET /health`, and `GET /v1/models` to learn what it serves, and feeds the
//! outcome to the worker's [`kvroute_core::health::HealthTracker`] (N failures → unhealthy,
//! M passes → healthy). A round checks up to [`PARALLEL_CHECKS`] workers at once, so a hung
//! worker (up to two timeouts) delays neither the others' checks nor its own detection. The
//! next round starts a period after this one started, and at least half a period after it
//! ended: the passes that bring a worker back are spread in time even after a round that
//! overran. The period is the interval for a round of every worker, and
//! [`defaults::HEALTH_CHECK_UNHEALTHY_INTERVAL_MS`] (when shorter) for rounds of the unhealthy
//! workers only between them: a worker that was down, or not up yet at start-up, is back in
//! rotation within seconds. (A round of the unhealthy ones that waits on a hung worker
//! delays the next round of every worker by up to two timeouts.) A worker that comes back
//! after being unhealthy is purged from every index first: it was restarted or lost its
//! cache, and its engine re-announces what it holds. The thread ends once the gateway's state
//! is dropped.
//!
//! Also [`http_get`], the small blocking HTTP/1.0 client the background threads share (this
//! one and the load reports of [`crate::load_poll`]).

use crate::state::Shared;
use kvroute_core::config::{Config, defaults};
use kvroute_core::health::HealthChange;
use kvroute_core::workers::Worker;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Workers a round checks at once (one thread each, for the round). A round over `W`
/// workers of which `H` hang then takes about ⌈H / 16⌉ × 2 timeouts instead of H × 2. 16:
/// kvroute's choice, threads that mostly wait.
pub const PARALLEL_CHECKS: usize = 16;

/// Largest response read by [`http_get`], bytes; a longer one is cut there.
const MAX_RESPONSE_BYTES: u64 = 4 * 1024 * 1024;

/// When and how long the checks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checks {
    /// Time between two rounds of every worker.
    pub interval: Duration,
    /// Time between two rounds of the unhealthy workers (taken up to `interval`).
    pub unhealthy_interval: Duration,
    /// Time allowed per request (connect, then each read).
    pub timeout: Duration,
}

impl Checks {
    /// The checks of `cfg`; `None` when `health_check_interval_secs` is 0 (off: every worker
    /// counts as healthy, and its models come from its spec only).
    pub fn of(cfg: &Config) -> Option<Checks> {
        (cfg.health_check_interval_secs > 0).then(|| Checks {
            interval: Duration::from_secs(cfg.health_check_interval_secs),
            unhealthy_interval: Duration::from_millis(defaults::HEALTH_CHECK_UNHEALTHY_INTERVAL_MS),
            timeout: Duration::from_secs(cfg.health_check_timeout_secs),
        })
    }
}

/// One `GET path` to `addr` with HTTP/1.0 (the answer ends with the connection, never
/// chunked), with the worker's own `key` as a bearer token when it has one (vLLM's
/// `--api-key` guards `/v1/*`): `(status, body)`.
///
/// # Errors
/// Connect or read error, a timeout, or a response that is not HTTP.
pub fn http_get(
    addr: SocketAddr,
    authority: &str,
    path: &str,
    timeout: Duration,
    key: Option<&str>,
) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: {authority}\r\nAccept: */*\r\n{auth}\r\n"
    )?;
    let mut resp = Vec::new();
    s.take(MAX_RESPONSE_BYTES).read_to_end(&mut resp)?;
    // The gateway's own response-head parser; a malformed or cut head is an error.
    match crate::http1::parse_response_head(
        &resp,
        "GET",
        kvroute_core::config::defaults::MAX_HEAD_BYTES,
    ) {
        Ok(Some((head, len))) => Ok((head.status, resp[len..].to_vec())),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not an HTTP response",
        )),
    }
}

/// What one check of a worker found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// `GET /health` answered 200 within the timeout.
    pub healthy: bool,
    /// The model ids of its `/v1/models` (`data[].id`), when that answered 200 with a list.
    pub models: Option<Vec<String>>,
}

/// Checks the worker at `addr` once (`url` for its `Host`, `key` its own API key).
pub fn probe(addr: SocketAddr, url: &str, timeout: Duration, key: Option<&str>) -> Probe {
    let authority = url.strip_prefix("http://").unwrap_or(url);
    let healthy = matches!(
        http_get(addr, authority, "/health", timeout, key),
        Ok((200, _))
    );
    let models = healthy
        .then(|| http_get(addr, authority, "/v1/models", timeout, key).ok())
        .flatten()
        .and_then(|(status, body)| (status == 200).then(|| model_ids(&body)).flatten());
    Probe { healthy, models }
}

/// The ids of an OpenAI `/v1/models` list (`{"data":[{"id":..},..]}`); `None` when the body
/// is not such a list.
pub fn model_ids(body: &[u8]) -> Option<Vec<String>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let ids = v
        .get("data")?
        .as_array()?
        .iter()
        .filter_map(|m| m.get("id")?.as_str().map(str::to_string))
        .collect();
    Some(ids)
}

/// Starts the `kv-health` thread.
///
/// # Errors
/// The thread could not be spawned.
pub fn start(shared: &Arc<Shared>, checks: Checks) -> std::io::Result<()> {
    let weak: Weak<Shared> = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name("kv-health".into())
        .spawn(move || {
            let period = checks.unhealthy_interval.min(checks.interval);
            let mut full_due = Instant::now();
            loop {
                let started = Instant::now();
                let Some(shared) = weak.upgrade() else { return };
                let all = started >= full_due;
                if all {
                    full_due = started + checks.interval;
                }
                round(&shared, checks.timeout, all);
                drop(shared);
                let next = (started + period).max(Instant::now() + period / 2);
                // Sleep in short steps, so the thread ends soon after the gateway does.
                while Instant::now() < next {
                    if weak.strong_count() == 0 {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50).min(period));
                }
            }
        })
        .map(|_| ())
}

/// One check of every present worker (`all`), or of the unhealthy ones,
/// [`PARALLEL_CHECKS`] at a time.
fn round(shared: &Shared, timeout: Duration, all: bool) {
    let mut workers = shared.workers.iter();
    if !all {
        workers.retain(|w| !w.is_healthy());
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..PARALLEL_CHECKS.min(workers.len()) {
            s.spawn(|| {
                while let Some(w) = workers.get(next.fetch_add(1, Ordering::Relaxed)) {
                    check(shared, w, timeout);
                }
            });
        }
    });
}

/// Checks worker `w` once and applies the outcome.
fn check(shared: &Shared, w: &Worker, timeout: Duration) {
    let Some(addr) = w.addr else { return };
    let p = probe(addr, &w.url, timeout, w.api_key.as_deref());
    if let Some(models) = p.models {
        w.set_models(models);
    }
    match w.record_health(p.healthy) {
        HealthChange::BecameHealthy => {
            shared.purge_worker(w.id);
            tracing::info!(worker = w.id, url = %w.url, "worker healthy: indexes purged, in rotation");
        }
        HealthChange::BecameUnhealthy => {
            tracing::warn!(worker = w.id, url = %w.url, "worker unhealthy: out of rotation");
        }
        HealthChange::Same => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_of_an_openai_list() {
        let body = br#"{"object":"list","data":[{"id":"qwen3","object":"model"},{"id":"lora-a"}]}"#;
        assert_eq!(
            model_ids(body),
            Some(vec!["qwen3".to_string(), "lora-a".to_string()])
        );
        assert_eq!(model_ids(br#"{"data":[]}"#), Some(vec![]));
        assert_eq!(model_ids(b"<html>"), None);
        assert_eq!(model_ids(br#"{"object":"list"}"#), None);
    }
}
