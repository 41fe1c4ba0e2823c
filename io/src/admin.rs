//! Observability and administration: the `/metrics` text ([`metrics_text`]), the admin API
//! on its own port ([`start`]: the fleet at run time, the cache view), and the constant-time
//! key comparison both API-key checks use.

use crate::state::Shared;
use kvroute_core::events::StreamStats;
use kvroute_core::health::BreakerState;
use kvroute_core::metrics::{Breaker, Format, IndexSize, StreamSample, WorkerState};

/// The whole `/metrics` text in `format`: every counter and histogram, each present worker's
/// gauges (in flight, foreign, healthy, breaker state, draining), the indexes' sizes
/// (`kvroute_index_size{index,model}`: tree chars and tokens per model, event-index blocks),
/// and the KV-event streams (`kvroute_kv_events_*{worker,rank}`, `kvroute_kv_indexed_blocks`).
pub fn metrics_text(shared: &Shared, format: Format) -> String {
    let now = shared.now_ms();
    for w in shared.workers.iter() {
        let breaker = match w.breaker_state(now) {
            BreakerState::Closed => Breaker::Closed,
            BreakerState::HalfOpen => Breaker::HalfOpen,
            BreakerState::Open => Breaker::Open,
        };
        shared.metrics.set_worker_state(
            w.id,
            WorkerState {
                healthy: w.is_healthy(),
                breaker,
                draining: w.is_draining(),
            },
        );
    }
    let mut sizes = Vec::new();
    for (model, chars, tokens) in shared.router.index_sizes() {
        for (index, size) in [("tree_chars", chars), ("tree_tokens", tokens)] {
            sizes.push(IndexSize {
                index: index.into(),
                model: model.clone(),
                size: size as u64,
            });
        }
    }
    if let Some(ix) = &shared.events {
        let ix = crate::zmq::lock(ix);
        let blocks: usize = shared
            .workers
            .iter()
            .iter()
            .map(|w| ix.worker_blocks(w.id as u32))
            .sum();
        sizes.push(IndexSize {
            index: "kv_event_blocks".into(),
            model: String::new(),
            size: blocks as u64,
        });
        let streams = ix
            .stats()
            .into_iter()
            .map(|(stream, stats)| StreamSample {
                stream,
                stats,
                indexed_blocks: ix.stream_keys(stream),
            })
            .collect();
        drop(ix);
        shared.metrics.set_event_streams(streams);
    }
    shared.metrics.set_index_sizes(sizes);
    shared.metrics.encode_as(&shared.workers, format)
}

/// The cache view of worker `id`: `(status, JSON body)` — `{"worker": id, "blocks": N,
/// "streams": [...]}`; 404 for an unknown worker id, 503 when no event index is configured.
pub fn cache_view(shared: &Shared, id: &str) -> (u16, Vec<u8>) {
    let Some(worker) = id
        .parse::<u32>()
        .ok()
        .filter(|&w| shared.workers.get(w as usize).is_some())
    else {
        return (404, crate::error::error_body(404, "unknown worker"));
    };
    let Some(ix) = &shared.events else {
        return (
            503,
            crate::error::error_body(503, "no KV event index configured"),
        );
    };
    let ix = crate::zmq::lock(ix);
    let streams: Vec<serde_json::Value> = ix
        .stats()
        .into_iter()
        .filter(|(s, _)| s.worker == worker)
        .map(|(s, st)| stream_json(s.rank, &st, ix.stream_keys(s)))
        .collect();
    let body = serde_json::json!({
        "worker": worker,
        "blocks": ix.worker_blocks(worker),
        "streams": streams,
    });
    (200, body.to_string().into_bytes())
}

/// One event stream's counters as JSON (the cache view and `GET /workers`).
pub fn stream_json(rank: u32, st: &StreamStats, keys: usize) -> serde_json::Value {
    serde_json::json!({
        "rank": rank, "keys": keys, "batches": st.batches, "events": st.events,
        "gaps": st.gaps, "replays": st.replays, "unrecoverable_gaps": st.unrecoverable_gaps,
        "restarts": st.restarts, "duplicates": st.duplicates, "decode_errors": st.decode_errors,
        "orphans": st.orphans, "orphan_replays": st.orphan_replays,
        "length_mismatches": st.length_mismatches,
        "size_mismatches": st.size_mismatches,
        "declared_size_mismatches": st.declared_size_mismatches,
        "last_seq": st.last_seq, "learned_block_size": st.learned_block_size,
    })
}

/// The token of an `Authorization: Bearer TOKEN` value (the scheme is case-insensitive,
/// RFC 9110 §11.1), trimmed; `None` for another scheme.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| token.trim_ascii())
        .filter(|t| !t.is_empty())
}

/// `a == b` in time that depends on their lengths only, not on where they differ (an API
/// key compared byte by byte would leak its prefix through timing).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // `black_box` keeps the compiler from turning the fold into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

/// Admin requests served at once; more are answered 503.
const MAX_ADMIN_CONNECTIONS: usize = 16;
/// Largest admin request body, bytes.
const MAX_ADMIN_BODY_BYTES: usize = 64 * 1024;
/// Time allowed to read an admin request, and to write its answer.
const ADMIN_IO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Starts the admin API on `listen` (its own port and thread, `kv-admin`, so a saturated
/// traffic port never starves it; operations.md §1). Every route but the probes
/// ([`probe_answer`]) needs `Authorization: Bearer KEY` when `key` is set (compared in
/// constant time); config validation requires a key unless `listen` is loopback. One thread
/// per connection, at most [`MAX_ADMIN_CONNECTIONS`]. Ends once the gateway's state is
/// dropped.
///
/// | route | answer |
/// |---|---|
/// | `GET /workers` | `[{"id","url","state","healthy","draining","breaker","models","load":{..},"events":{..}}]` |
/// | `POST /workers` `{"url": SPEC}` | 201 `{"id": N}`; 400 bad spec, 409 already present |
/// | `POST /workers/{id}/drain` | 200 `{"id","state":"draining"}` |
/// | `DELETE /workers/{id}` | drains, waits for its requests (up to the shutdown grace), purges every index, cancels its event subscription: 200 `{"id","removed":true}` |
/// | `GET /cache-view/{id}` | the event index's view of one worker ([`cache_view`]) |
/// | `GET /health`, `/liveness`, `/readiness` | as on the traffic port, without the key ([`probe_answer`]) |
///
/// # Errors
/// The address cannot be bound (in use: named in the message).
pub fn start(
    shared: &std::sync::Arc<Shared>,
    listen: &str,
    key: Option<String>,
) -> std::io::Result<std::net::SocketAddr> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|e| std::io::Error::new(e.kind(), format!("admin API on {listen}: {e}")))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let weak = std::sync::Arc::downgrade(shared);
    let open = std::sync::Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("kv-admin".into())
        .spawn(move || {
            loop {
                if weak.strong_count() == 0 {
                    return;
                }
                let stream = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        continue;
                    }
                    Err(_) => continue,
                };
                let Some(shared) = weak.upgrade() else { return };
                if open.fetch_add(1, Ordering::SeqCst) >= MAX_ADMIN_CONNECTIONS {
                    open.fetch_sub(1, Ordering::SeqCst);
                    let _ = write_answer(
                        stream,
                        503,
                        &crate::error::error_body(503, "admin API busy"),
                    );
                    continue;
                }
                let (open, key) = (open.clone(), key.clone());
                let spawned = std::thread::Builder::new()
                    .name("kv-admin-conn".into())
                    .spawn(move || {
                        serve_admin(&shared, stream, key.as_deref());
                        open.fetch_sub(1, Ordering::SeqCst);
                    });
                if spawned.is_err() {
                    tracing::warn!("admin API: cannot spawn a connection thread");
                }
            }
        })?;
    tracing::info!(%addr, auth = shared_key_note(listen), "admin API listening");
    Ok(addr)
}

fn shared_key_note(listen: &str) -> &'static str {
    if kvroute_core::config::is_loopback(listen) {
        "loopback"
    } else {
        "bearer key"
    }
}

/// Reads one request from `stream`, answers it, closes.
fn serve_admin(
    shared: &std::sync::Arc<Shared>,
    mut stream: std::net::TcpStream,
    key: Option<&str>,
) {
    use std::io::Read;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(ADMIN_IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(ADMIN_IO_TIMEOUT));
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let max_head = kvroute_core::config::defaults::MAX_HEAD_BYTES;
    let (head, len) = loop {
        match crate::http1::parse_request_head(&buf, max_head) {
            Ok(Some(h)) => break h,
            Ok(None) => {}
            Err(e) => {
                let _ = write_answer(
                    stream,
                    e.status(),
                    &crate::error::error_body(e.status(), &e.to_string()),
                );
                return;
            }
        }
        match stream.read(&mut tmp) {
            Ok(n) if n > 0 => buf.extend_from_slice(&tmp[..n]),
            _ => return,
        }
    };
    let body_len = match head.framing {
        crate::http1::Framing::Length(n) if n as usize <= MAX_ADMIN_BODY_BYTES => n as usize,
        crate::http1::Framing::Length(_) | crate::http1::Framing::Chunked => {
            let _ = write_answer(
                stream,
                413,
                &crate::error::error_body(413, "admin body too large or chunked"),
            );
            return;
        }
        _ => 0,
    };
    while buf.len() < len + body_len {
        match stream.read(&mut tmp) {
            Ok(n) if n > 0 => buf.extend_from_slice(&tmp[..n]),
            _ => return,
        }
    }
    let body = &buf[len..len + body_len];
    let authorized = key.is_none_or(|k| {
        head.headers
            .get("authorization")
            .and_then(bearer_token)
            .is_some_and(|given| constant_time_eq(given, k.as_bytes()))
    });
    let probe = (head.method == "GET")
        .then(|| probe_answer(shared, head.path()))
        .flatten();
    let (status, answer) = if let Some(answer) = probe {
        answer
    } else if authorized {
        admin_route(shared, &head.method, head.path(), body)
    } else {
        (
            401,
            crate::error::error_body(401, "admin API: invalid or missing bearer key"),
        )
    };
    tracing::info!(target: "kvroute::access", method = %head.method, path = %head.path(), status, "admin");
    let _ = write_answer(stream, status, &answer);
}

/// Body of `GET /health` and `GET /liveness`: the process answers (always 200).
pub const HEALTH_BODY: &[u8] = br#"{"status":"ok"}"#;

/// The probes the admin port answers without its key, as the traffic port does (Kubernetes
/// probes carry no bearer key): `GET /health` and `/liveness` ([`HEALTH_BODY`]), `GET
/// /readiness` ([`Shared::readiness`]). On the admin port's own thread they are answered
/// however saturated the traffic port is (its connection limit, busy shards), as SMG's
/// separate health port (operations.md §1). `None` for any other path.
pub fn probe_answer(shared: &Shared, path: &str) -> Option<(u16, Vec<u8>)> {
    match path {
        "/health" | "/liveness" => Some((200, HEALTH_BODY.to_vec())),
        "/readiness" => Some(shared.readiness()),
        _ => None,
    }
}

/// The admin routes (see [`start`]'s table): `(status, JSON body)`.
pub fn admin_route(
    shared: &std::sync::Arc<Shared>,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, Vec<u8>) {
    let err = |status: u16, msg: &str| (status, crate::error::error_body(status, msg));
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let id = |s: &str| {
        s.parse::<usize>()
            .ok()
            .filter(|&i| shared.workers.get(i).is_some())
    };
    match (method, parts.as_slice()) {
        ("GET", ["workers"]) => (200, workers_json(shared).to_string().into_bytes()),
        ("POST", ["workers"]) => {
            let spec = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get("url")?.as_str().map(str::to_string));
            let Some(spec) = spec else {
                return err(400, "expected {\"url\": \"http://host:port[;options]\"}");
            };
            let spec = match kvroute_core::config::parse_worker_spec(&spec) {
                Ok(s) => s,
                Err(e) => return err(400, &e.to_string()),
            };
            match crate::gateway::add_worker(shared, &spec, shared.settings.health_checks.as_ref())
            {
                Ok(id) => (201, serde_json::json!({"id": id}).to_string().into_bytes()),
                Err(crate::error::GatewayError::Core(
                    kvroute_core::CoreError::DuplicateWorker { url },
                )) => err(409, &format!("worker {url} is already in the fleet")),
                Err(crate::error::GatewayError::Core(
                    e @ kvroute_core::CoreError::SameAddress { .. },
                )) => err(409, &e.to_string()),
                Err(e) => err(400, &e.to_string()),
            }
        }
        ("POST", ["workers", w, "drain"]) => match id(w) {
            Some(i) => {
                crate::gateway::drain_worker(shared, i);
                (
                    200,
                    serde_json::json!({"id": i, "state": "draining"})
                        .to_string()
                        .into_bytes(),
                )
            }
            None => err(404, "unknown worker"),
        },
        ("DELETE", ["workers", w]) => match id(w) {
            Some(i) => {
                crate::gateway::remove_worker(shared, i, shared.settings.shutdown_timeout);
                (
                    200,
                    serde_json::json!({"id": i, "removed": true})
                        .to_string()
                        .into_bytes(),
                )
            }
            None => err(404, "unknown worker"),
        },
        ("GET", ["cache-view", w]) | ("GET", ["admin", "cache-view", w]) => cache_view(shared, w),
        (_, ["workers"])
        | (_, ["workers", _])
        | (_, ["workers", _, "drain"])
        | (_, ["cache-view", _]) => err(405, "method not allowed"),
        _ => err(404, &format!("no admin route for {method} {path}")),
    }
}

/// `GET /workers`: every present worker's id, URL, state, models, load, breaker and event
/// streams.
fn workers_json(shared: &Shared) -> serde_json::Value {
    let now = shared.now_ms();
    let ix = shared.events.as_ref().map(crate::zmq::lock);
    let subs = shared
        .subscriptions
        .lock()
        .map(|s| s.keys().copied().collect::<Vec<_>>())
        .unwrap_or_default();
    let list: Vec<serde_json::Value> = shared
        .workers
        .iter()
        .iter()
        .map(|w| {
            let state = if w.is_draining() {
                "draining"
            } else if !w.is_healthy() {
                "unhealthy"
            } else if !w.is_available(now) {
                "breaker_open"
            } else {
                "healthy"
            };
            let streams: Vec<serde_json::Value> = ix.as_ref().map_or(Vec::new(), |ix| {
                ix.stats()
                    .into_iter()
                    .filter(|(s, _)| s.worker as usize == w.id)
                    .map(|(s, st)| stream_json(s.rank, &st, ix.stream_keys(s)))
                    .collect()
            });
            serde_json::json!({
                "id": w.id,
                "url": w.url,
                "state": state,
                "healthy": w.is_healthy(),
                "draining": w.is_draining(),
                "breaker": w.breaker_state(now).as_str(),
                "models": w.models(),
                "load": {"in_flight": w.in_flight(), "foreign": w.foreign(), "processed": w.processed()},
                "events": {"subscribed": subs.contains(&w.id), "streams": streams},
            })
        })
        .collect();
    serde_json::Value::Array(list)
}

fn write_answer(mut stream: std::net::TcpStream, status: u16, body: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let head = format!(
        "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        crate::http1::canonical_reason(status),
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens() {
        assert_eq!(bearer_token(b"Bearer sk-1"), Some(&b"sk-1"[..]));
        assert_eq!(bearer_token(b"bearer  sk-1 "), Some(&b"sk-1"[..]));
        assert_eq!(bearer_token(b"BEARER sk-1"), Some(&b"sk-1"[..]));
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"Bear"), None);
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"sk-abc", b"sk-abc"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-abd"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-ab"));
        assert!(constant_time_eq(b"", b""));
    }
}
