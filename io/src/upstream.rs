//! Upstream connections: a per-shard keep-alive pool per worker, and one attempt of an
//! exchange with a worker up to its first body byte (the head is held until then, so a
//! worker that fails before it can be retried without the client noticing).
//!
//! The pool lives on one shard (single-threaded, `RefCell`), so taking and returning a
//! connection never takes a lock. Idle connections older than `--upstream-idle-timeout-ms`
//! (3 s, below the engines' 5 s keep-alive: bug-cases.md B42) are closed instead of reused,
//! and a reused connection that fails before the first response byte is retried once on a
//! fresh connection.

use crate::conn::Conn;
use crate::error::{HttpError, ProxyError};
use crate::http1::{self, Framing, ResponseHead};
use kvroute_core::workers::Worker;
use monoio::net::TcpStream;
use std::cell::RefCell;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Idle upstream connections of one shard, per worker id.
///
/// # Invariants
/// 1. `idle[w]` holds only connections to worker `w`, oldest first.
/// 2. After [`Pool::sweep`], no connection of a removed worker is held.
pub struct Pool {
    idle: RefCell<Vec<Vec<(Conn, Instant)>>>,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

impl Pool {
    /// An empty pool (it grows as workers are added).
    pub fn new(idle_timeout: Duration, connect_timeout: Duration) -> Self {
        Self {
            idle: RefCell::new(Vec::new()),
            idle_timeout,
            connect_timeout,
        }
    }

    /// The freshest idle connection to `worker` (second value `true`), or a new one.
    ///
    /// # Errors
    /// The connect error, or `TimedOut` after the connect timeout.
    pub async fn get(&self, worker: usize, addr: SocketAddr) -> std::io::Result<(Conn, bool)> {
        loop {
            let popped = self.idle.borrow_mut().get_mut(worker).and_then(Vec::pop);
            match popped {
                Some((conn, since)) if since.elapsed() < self.idle_timeout => {
                    return Ok((conn, true));
                }
                Some(_) => continue, // too old: dropping it closes it
                None => break,
            }
        }
        match monoio::time::timeout(self.connect_timeout, TcpStream::connect_addr(addr)).await {
            Ok(Ok(stream)) => Ok((Conn::new(stream), false)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connect timed out",
            )),
        }
    }

    /// Returns a connection whose last response ended cleanly.
    pub fn put(&self, worker: usize, conn: Conn) {
        let mut idle = self.idle.borrow_mut();
        if idle.len() <= worker {
            idle.resize_with(worker + 1, Vec::new);
        }
        let list = &mut idle[worker];
        let now = Instant::now();
        expire(list, now, self.idle_timeout);
        list.push((conn, now));
    }

    /// Closes every idle connection older than the idle timeout, and every connection of a
    /// worker that `present` says is gone (removed from the registry).
    pub fn sweep(&self, present: impl Fn(usize) -> bool) {
        for (w, list) in self.idle.borrow_mut().iter_mut().enumerate() {
            if present(w) {
                expire(list, Instant::now(), self.idle_timeout);
            } else {
                list.clear();
            }
        }
    }

    /// The idle timeout: older idle connections are closed, never reused.
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// Idle connections held for `worker` (for tests and metrics).
    pub fn idle_count(&self, worker: usize) -> usize {
        self.idle.borrow().get(worker).map_or(0, Vec::len)
    }
}

/// A test of whether a header name is one that a `Connection` header of `headers` lists
/// (RFC 9110 §7.6.1: each is hop-by-hop for this message), ASCII case-insensitively.
/// Nearly every message lists only `keep-alive` (itself hop-by-hop, [`http1::is_hop_by_hop`])
/// or `close` (no header's name): then the test is `false` without a scan. Otherwise it
/// rescans the `Connection` headers per name instead of collecting them (a collected list
/// cost an allocation per token per request).
fn named_by_connection<'a, I: Iterator<Item = (&'a [u8], &'a [u8])>>(
    headers: impl Fn() -> I,
) -> impl Fn(&str) -> bool {
    let listed = move |test: &dyn Fn(&[u8]) -> bool| {
        headers().any(|(n, v)| {
            n.eq_ignore_ascii_case(b"connection")
                && v.split(|&b| b == b',').map(<[u8]>::trim_ascii).any(test)
        })
    };
    let names_any = listed(&|t| {
        !t.is_empty() && !t.eq_ignore_ascii_case(b"keep-alive") && !t.eq_ignore_ascii_case(b"close")
    });
    move |name: &str| names_any && listed(&|t| t.eq_ignore_ascii_case(name.as_bytes()))
}

/// Builds the request sent to `worker`: the client's method and target, its end-to-end
/// headers (hop-by-hop ones and those named in its `Connection` header removed), `Host` set
/// to the worker, `x-request-id`, the worker's own key as `Authorization` when it has one
/// (replacing the client's: at most one goes upstream), and the body unchanged with a
/// `Content-Length`. `strip_client_auth`: drop the client's `Authorization` even when the
/// worker has no key (it was kvroute's own client key).
pub fn build_request(
    parts: &http::request::Parts,
    body: &[u8],
    worker: &Worker,
    request_id: &str,
    strip_client_auth: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(512 + body.len());
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    http1::push_header(&mut out, "host", worker.authority.as_bytes());
    let named = named_by_connection(|| {
        parts
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()))
    });
    for (name, value) in &parts.headers {
        let n = name.as_str();
        if http1::is_hop_by_hop(n)
            || named(n)
            || n == "x-request-id"
            || (n == "authorization" && (worker.api_key.is_some() || strip_client_auth))
        {
            continue;
        }
        http1::push_header(&mut out, n, value.as_bytes());
    }
    http1::push_header(&mut out, "x-request-id", request_id.as_bytes());
    if let Some(key) = &worker.api_key {
        let mut v = b"Bearer ".to_vec();
        v.extend_from_slice(key.as_bytes());
        http1::push_header(&mut out, "authorization", &v);
    }
    if !body.is_empty() || parts.method != http::Method::GET {
        http1::push_header(
            &mut out,
            "content-length",
            body.len().to_string().as_bytes(),
        );
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// Prefix of the headers kvroute sets itself.
const X_KVROUTE: &str = "x-kvroute-";

/// The end-to-end headers of a worker's response, for the client: hop-by-hop headers, those
/// named in its `Connection` header, and any `x-kvroute-*` or `x-request-id` it set removed
/// (kvroute sets those itself). Headers the `http` types refuse are dropped.
pub fn response_headers(head: &ResponseHead) -> Vec<(http::HeaderName, http::HeaderValue)> {
    let named = named_by_connection(|| head.headers.iter().map(|(n, v)| (n.as_bytes(), v)));
    // Room for the headers the exchange adds after these (extra ones, the worker's id).
    let mut out = Vec::with_capacity(head.headers.len() + 4);
    let kept = head
        .headers
        .shared()
        .filter(|(n, _)| {
            !http1::is_hop_by_hop(n)
                && !named(n)
                && !n
                    .get(..X_KVROUTE.len())
                    .is_some_and(|p| p.eq_ignore_ascii_case(X_KVROUTE))
                && !n.eq_ignore_ascii_case("x-request-id")
        })
        .filter_map(|(n, v)| {
            Some((
                http::HeaderName::from_bytes(n.as_bytes()).ok()?,
                http::HeaderValue::from_maybe_shared(v).ok()?,
            ))
        });
    out.extend(kept);
    out
}

/// Sends `request` to `worker` and reads the response head (skipping 1xx) and, when the
/// response has a body, its first bytes: on return the connection's buffer holds at least
/// one body byte (or the body is empty).
///
/// # Errors
/// - [`ProxyError::Connect`]: connecting failed.
/// - [`ProxyError::Timeout`]: no head, or no first body byte, before `deadline`.
/// - [`ProxyError::Upstream`]: the connection broke or the head is not valid HTTP.
pub async fn send(
    pool: &Pool,
    worker: &Worker,
    method: &str,
    request: Vec<u8>,
    deadline: Instant,
    timeout_secs: u64,
    max_head_bytes: usize,
) -> Result<(Conn, ResponseHead), ProxyError> {
    let Some(addr) = worker.addr else {
        return Err(ProxyError::Connect {
            worker: worker.id,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "address not resolved"),
        });
    };
    let mut request = request;
    let mut retried = false;
    loop {
        let (mut conn, reused) =
            pool.get(worker.id, addr)
                .await
                .map_err(|source| ProxyError::Connect {
                    worker: worker.id,
                    source,
                })?;
        let (res, buf) = conn.write_all(request).await;
        request = buf;
        let outcome = match res {
            Err(e) => Err(Failure::BeforeResponse(e.to_string())),
            Ok(()) => match read_head(&mut conn, method, deadline, max_head_bytes).await {
                Ok(head) => first_body_bytes(&mut conn, &head, deadline)
                    .await
                    .map(|()| head),
                Err(e) => Err(e),
            },
        };
        match outcome {
            Ok(head) => return Ok((conn, head)),
            // A pooled connection the worker closed while idle: one safe retry (B42).
            Err(Failure::BeforeResponse(_)) if reused && !retried => {
                retried = true;
                continue;
            }
            Err(Failure::BeforeResponse(message)) | Err(Failure::Protocol(message)) => {
                return Err(ProxyError::Upstream {
                    worker: worker.id,
                    message,
                });
            }
            Err(Failure::Timeout) => {
                return Err(ProxyError::Timeout {
                    worker: worker.id,
                    secs: timeout_secs,
                });
            }
        }
    }
}

/// Waits until `conn`'s buffer holds a body byte, unless the body is empty.
async fn first_body_bytes(
    conn: &mut Conn,
    head: &ResponseHead,
    deadline: Instant,
) -> Result<(), Failure> {
    if matches!(head.framing, Framing::Empty | Framing::Length(0)) {
        return Ok(());
    }
    while conn.buffered().is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        match monoio::time::timeout(left, conn.fill()).await {
            Err(_) => return Err(Failure::Timeout),
            Ok(Ok(0)) if head.framing == Framing::UntilClose => return Ok(()),
            Ok(Ok(0)) => {
                return Err(Failure::Protocol(
                    "connection closed before the body".into(),
                ));
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(Failure::Protocol(e.to_string())),
        }
    }
    Ok(())
}

enum Failure {
    /// Nothing of the response arrived (closed, reset).
    BeforeResponse(String),
    /// Invalid HTTP from the worker.
    Protocol(String),
    Timeout,
}

async fn read_head(
    conn: &mut Conn,
    method: &str,
    deadline: Instant,
    max_head_bytes: usize,
) -> Result<ResponseHead, Failure> {
    loop {
        if !conn.buffered().is_empty() {
            match http1::parse_response_head(conn.buffered(), method, max_head_bytes) {
                Ok(Some((head, len))) => {
                    conn.consume(len);
                    if (100..200).contains(&head.status) {
                        continue;
                    }
                    return Ok(head);
                }
                Ok(None) => {}
                Err(HttpError::HeadTooLarge) => {
                    return Err(Failure::Protocol("response head too large".into()));
                }
                Err(e) => return Err(Failure::Protocol(e.to_string())),
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Failure::Timeout);
        }
        let had = conn.buffered().len();
        match monoio::time::timeout(left, conn.fill()).await {
            Err(_) => return Err(Failure::Timeout),
            Ok(Ok(0)) if had == 0 => {
                return Err(Failure::BeforeResponse("connection closed".into()));
            }
            Ok(Ok(0)) => {
                return Err(Failure::Protocol(
                    "connection closed inside the head".into(),
                ));
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) if had == 0 => return Err(Failure::BeforeResponse(e.to_string())),
            Ok(Err(e)) => return Err(Failure::Protocol(e.to_string())),
        }
    }
}

/// Closes the connections of `list` idle for `timeout` or more at `now`. They are a prefix
/// (invariant 1: oldest first), so this reads the clock once per call, not once per
/// connection (a clock read per idle connection on every `put` was 1.1 % of the round-robin
/// server's CPU under `perf/compare.sh`, perf/runs/2026-12-02-proxy-path).
fn expire(list: &mut Vec<(Conn, Instant)>, now: Instant, timeout: Duration) {
    let stale = list.partition_point(|(_, since)| now.duration_since(*since) >= timeout);
    list.drain(..stale);
}
