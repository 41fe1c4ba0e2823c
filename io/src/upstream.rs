//! Upstream connections: a per-shard keep-alive pool per worker, and one attempt of an
//! exchange with a worker up to its first body byte (the head is held until then, so a
//! worker that fails before it can be retried without the client noticing).
//!
//! The pool lives on one shard (single-threaded, `RefCell`), so taking and returning a
//! connection never takes a lock. Idle connections older than `--upstream-idle-timeout-ms`
//! (3 s, below the engines' 5 s keep-alive: bug-cases.md B42) are closed instead of reused,
//! and a reused connection that fails before the first response byte is retried once on a
//! fresh connection: the worker closed it while it sat idle (an engine with a shorter
//! keep-alive, or one that restarted), so every older idle connection to that worker is
//! closed too, and none of them is tried next.

use crate::conn::Conn;
use crate::error::{HttpError, ProxyError};
use crate::http1::{self, Framing, ResponseHead};
use crate::message::{HeaderLine, REQUEST_ID_HEADER, Request};
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
        Ok((self.connect(addr).await?, false))
    }

    /// A new connection to `addr`, bypassing the idle ones.
    ///
    /// # Errors
    /// The connect error, or `TimedOut` after the connect timeout.
    pub async fn connect(&self, addr: SocketAddr) -> std::io::Result<Conn> {
        match monoio::time::timeout(self.connect_timeout, TcpStream::connect_addr(addr)).await {
            Ok(Ok(stream)) => Ok(Conn::new(stream)),
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

    /// Closes every idle connection to `worker` (it closed one of them while idle, so the
    /// older ones are as likely gone).
    pub fn clear(&self, worker: usize) {
        if let Some(list) = self.idle.borrow_mut().get_mut(worker) {
            list.clear();
        }
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

/// Header that pins a request to one DP rank of an engine: vLLM's API server
/// (`_get_data_parallel_rank`, case-insensitive) and SGLang's `DataParallelController` read
/// it.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// Builds the request sent to `worker`: the client's method and target, its end-to-end
/// headers (hop-by-hop ones and those named in its `Connection` header removed), `Host` set
/// to the worker, `x-request-id`, the worker's own key as `Authorization` when it has one
/// (replacing the client's: at most one goes upstream), [`DP_RANK_HEADER`] `dp_rank` when the
/// router pins one (replacing the client's), and the body unchanged with a
/// `Content-Length`. `strip_client_auth`: drop the client's `Authorization` even when the
/// worker has no key (it was kvroute's own client key).
pub fn build_request(
    req: &Request,
    body: &[u8],
    worker: &Worker,
    request_id: &str,
    strip_client_auth: bool,
    dp_rank: Option<u32>,
) -> Vec<u8> {
    use std::io::Write as _;
    let mut out = Vec::with_capacity(512 + body.len());
    out.extend_from_slice(req.method.as_bytes());
    out.push(b' ');
    // An absolute-form target with an empty path goes as `/` (RFC 9112 §3.2.1).
    let target = req.path_and_query();
    if target.is_empty() || target.starts_with('?') {
        out.push(b'/');
    }
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    http1::push_header(&mut out, "host", worker.authority.as_bytes());
    let named = named_by_connection(|| req.headers.iter().map(|(n, v)| (n.as_bytes(), v)));
    let drop_auth = worker.api_key.is_some() || strip_client_auth;
    for (name, value) in req.headers.iter() {
        if http1::is_hop_by_hop(name)
            || named(name)
            || name.eq_ignore_ascii_case(REQUEST_ID_HEADER)
            || (drop_auth && name.eq_ignore_ascii_case("authorization"))
            || (dp_rank.is_some() && name.eq_ignore_ascii_case(DP_RANK_HEADER))
        {
            continue;
        }
        http1::push_header(&mut out, name, value);
    }
    http1::push_header(&mut out, REQUEST_ID_HEADER, request_id.as_bytes());
    if let Some(rank) = dp_rank {
        let _ = write!(out, "{DP_RANK_HEADER}: {rank}\r\n");
    }
    if let Some(key) = &worker.api_key {
        let _ = write!(out, "authorization: Bearer {key}\r\n");
    }
    if !body.is_empty() || req.method != "GET" {
        let _ = write!(out, "content-length: {}\r\n", body.len());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// Prefix of the headers kvroute sets itself.
const X_KVROUTE: &str = "x-kvroute-";

/// The end-to-end headers of a worker's response, for the client, borrowed from `head`:
/// hop-by-hop headers, those named in its `Connection` header, and any `x-kvroute-*` or
/// `x-request-id` it set removed (kvroute sets those itself). `room`: capacity kept for the
/// lines the caller adds after these.
pub fn response_headers(head: &ResponseHead, room: usize) -> Vec<HeaderLine<'_>> {
    let named = named_by_connection(|| head.headers.iter().map(|(n, v)| (n.as_bytes(), v)));
    let mut out = Vec::with_capacity(head.headers.len() + room);
    out.extend(head.headers.iter().filter(|(n, _)| {
        !http1::is_hop_by_hop(n)
            && !named(n)
            && !n
                .get(..X_KVROUTE.len())
                .is_some_and(|p| p.eq_ignore_ascii_case(X_KVROUTE))
            && !n.eq_ignore_ascii_case(REQUEST_ID_HEADER)
    }));
    out
}

/// Sends `request` to `worker` and reads the response head (skipping 1xx) and, when the
/// response has a body, its first bytes: on return the connection's buffer holds at least
/// one body byte (or the body is empty).
///
/// Only connecting has a timeout here: the caller bounds the whole attempt (the exchange
/// races it against `--first-byte-timeout-secs`, the client leaving and the worker's health
/// with one timer, where a timeout per read here cost one more timer per request:
/// perf/runs/2026-12-03-lean-headers).
///
/// # Errors
/// - [`ProxyError::Connect`]: connecting failed or timed out.
/// - [`ProxyError::Upstream`]: the connection broke or the head is not valid HTTP.
pub async fn send(
    pool: &Pool,
    worker: &Worker,
    method: &str,
    request: Vec<u8>,
    max_head_bytes: usize,
) -> Result<(Conn, ResponseHead), ProxyError> {
    let Some(addr) = worker.addr else {
        return Err(ProxyError::Connect {
            worker: worker.id,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "address not resolved"),
        });
    };
    let mut request = request;
    let connect_error = |source| ProxyError::Connect {
        worker: worker.id,
        source,
    };
    let mut fresh = false;
    loop {
        let (mut conn, reused) = if fresh {
            (pool.connect(addr).await.map_err(connect_error)?, false)
        } else {
            pool.get(worker.id, addr).await.map_err(connect_error)?
        };
        let (res, buf) = conn.write_all(request).await;
        request = buf;
        let outcome = match res {
            Err(e) => Err(Failure::BeforeResponse(e.to_string())),
            Ok(()) => match read_head(&mut conn, method, max_head_bytes).await {
                Ok(head) => first_body_bytes(&mut conn, &head).await.map(|()| head),
                Err(e) => Err(e),
            },
        };
        match outcome {
            Ok(head) => return Ok((conn, head)),
            // A pooled connection the worker closed while idle (B42): nothing was answered,
            // so one safe retry, on a fresh connection (the freshest idle one failed: the
            // older ones go too). A fresh connection is never `reused`: at most one retry.
            Err(Failure::BeforeResponse(_)) if reused => {
                pool.clear(worker.id);
                fresh = true;
                continue;
            }
            Err(Failure::BeforeResponse(message)) | Err(Failure::Protocol(message)) => {
                return Err(ProxyError::Upstream {
                    worker: worker.id,
                    message,
                });
            }
        }
    }
}

/// Waits until `conn`'s buffer holds a body byte, unless the body is empty.
async fn first_body_bytes(conn: &mut Conn, head: &ResponseHead) -> Result<(), Failure> {
    if matches!(head.framing, Framing::Empty | Framing::Length(0)) {
        return Ok(());
    }
    while conn.buffered().is_empty() {
        match conn.fill().await {
            Ok(0) if head.framing == Framing::UntilClose => return Ok(()),
            Ok(0) => {
                return Err(Failure::Protocol(
                    "connection closed before the body".into(),
                ));
            }
            Ok(_) => {}
            Err(e) => return Err(Failure::Protocol(e.to_string())),
        }
    }
    Ok(())
}

enum Failure {
    /// Nothing of the response arrived (closed, reset).
    BeforeResponse(String),
    /// Invalid HTTP from the worker.
    Protocol(String),
}

async fn read_head(
    conn: &mut Conn,
    method: &str,
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
        let had = conn.buffered().len();
        match conn.fill().await {
            Ok(0) if had == 0 => {
                return Err(Failure::BeforeResponse("connection closed".into()));
            }
            Ok(0) => {
                return Err(Failure::Protocol(
                    "connection closed inside the head".into(),
                ));
            }
            Ok(_) => {}
            Err(e) if had == 0 => return Err(Failure::BeforeResponse(e.to_string())),
            Err(e) => return Err(Failure::Protocol(e.to_string())),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Headers;

    /// The request line, `Host`, the client's end-to-end headers, `x-request-id` and the
    /// body go upstream; a pinned DP rank replaces the client's `X-Data-Parallel-Rank`, which
    /// goes through unchanged when the router pins none.
    #[test]
    fn build_request_pins_the_dp_rank_over_the_clients() {
        let workers =
            kvroute_core::workers::Workers::new(&["http://10.0.0.7:8000".into()]).unwrap();
        let worker = workers.get(0).unwrap();
        let req = Request {
            method: "POST".into(),
            target: "/v1/completions".into(),
            headers: Headers::collect(
                [
                    ("Host", &b"router"[..]),
                    ("Connection", b"keep-alive"),
                    ("X-Data-Parallel-Rank", b"3"),
                    ("x-a", b"1"),
                ]
                .into_iter(),
            ),
            body: b"{}".to_vec(),
            prefix_scan: None,
            received: Instant::now(),
        };
        let text = |rank| {
            String::from_utf8(build_request(&req, b"{}", &worker, "rid", false, rank)).unwrap()
        };
        assert_eq!(
            text(Some(1)),
            "POST /v1/completions HTTP/1.1\r\nhost: 10.0.0.7:8000\r\nx-a: 1\r\n\
             x-request-id: rid\r\nx-data-parallel-rank: 1\r\ncontent-length: 2\r\n\r\n{}"
        );
        assert_eq!(
            text(None),
            "POST /v1/completions HTTP/1.1\r\nhost: 10.0.0.7:8000\r\nX-Data-Parallel-Rank: 3\r\n\
             x-a: 1\r\nx-request-id: rid\r\ncontent-length: 2\r\n\r\n{}"
        );
    }
}
