//! Upstream connections: a per-shard keep-alive pool per worker, and one request/response
//! exchange with a worker up to the end of the response head.
//!
//! The pool lives on one shard (single-threaded, `RefCell`), so taking and returning a
//! connection never takes a lock. Idle connections older than `--upstream-idle-timeout-ms`
//! (3 s, below the engines' 5 s keep-alive: bug-cases.md B42) are closed instead of reused,
//! and a reused connection that fails before the first response byte is retried once on a
//! fresh connection.

use crate::conn::Conn;
use crate::error::{HttpError, ProxyError};
use crate::http1::{self, ResponseHead};
use monoio::net::TcpStream;
use std::cell::RefCell;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Idle upstream connections of one shard, per worker id.
///
/// # Invariants
/// 1. `idle[w]` holds only connections to worker `w`, oldest first.
pub struct Pool {
    idle: RefCell<Vec<Vec<(Conn, Instant)>>>,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

impl Pool {
    /// An empty pool for `workers` workers.
    pub fn new(workers: usize, idle_timeout: Duration, connect_timeout: Duration) -> Self {
        Self {
            idle: RefCell::new((0..workers).map(|_| Vec::new()).collect()),
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
            let popped = self.idle.borrow_mut()[worker].pop();
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
        let list = &mut idle[worker];
        list.retain(|(_, since)| since.elapsed() < self.idle_timeout);
        list.push((conn, Instant::now()));
    }

    /// Closes every idle connection older than the idle timeout.
    pub fn sweep(&self) {
        for list in self.idle.borrow_mut().iter_mut() {
            list.retain(|(_, since)| since.elapsed() < self.idle_timeout);
        }
    }

    /// The idle timeout: older idle connections are closed, never reused.
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// Idle connections held for `worker` (for tests and metrics).
    pub fn idle_count(&self, worker: usize) -> usize {
        self.idle.borrow()[worker].len()
    }
}

/// Where a worker lives, resolved once at start-up.
#[derive(Debug, Clone)]
pub struct Target {
    /// Dense worker id (index into the registry).
    pub id: usize,
    /// Worker URL as configured (`http://host:port`), reported in `x-kvroute-worker`.
    pub url: String,
    /// `host:port` for the `Host` header.
    pub authority: String,
    /// Resolved socket address.
    pub addr: SocketAddr,
}

/// Builds the request sent to the worker: the client's method and target, the end-to-end
/// headers (hop-by-hop removed), `Host` set to the worker, and the client's body bytes
/// unchanged with a `Content-Length`.
pub fn build_request(head: &http1::RequestHead, body: &[u8], target: &Target) -> Vec<u8> {
    let mut out = Vec::with_capacity(512 + body.len());
    out.extend_from_slice(head.method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(head.target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    http1::push_header(&mut out, "host", target.authority.as_bytes());
    for (name, value) in &head.headers {
        if !http1::is_hop_by_hop(name) {
            http1::push_header(&mut out, name, value);
        }
    }
    if !body.is_empty() || head.method != "GET" {
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

/// Sends `request` to `target` and reads the response head (skipping 1xx).
///
/// On return the connection's buffer holds the first body bytes that arrived with the head.
///
/// # Errors
/// - [`ProxyError::Connect`]: connecting failed (→ 502).
/// - [`ProxyError::Timeout`]: no response head before `deadline` (→ 504).
/// - [`ProxyError::Upstream`]: the connection broke or the head is not valid HTTP (→ 502).
pub async fn send(
    pool: &Pool,
    target: &Target,
    method: &str,
    request: Vec<u8>,
    deadline: Instant,
    timeout_secs: u64,
    max_head_bytes: usize,
) -> Result<(Conn, ResponseHead), ProxyError> {
    let mut request = request;
    let mut retried = false;
    loop {
        let (mut conn, reused) =
            pool.get(target.id, target.addr)
                .await
                .map_err(|source| ProxyError::Connect {
                    worker: target.url.clone(),
                    source,
                })?;
        let (res, buf) = conn.write_all(request).await;
        request = buf;
        let outcome = match res {
            Err(e) => Err(Failure::BeforeResponse(e.to_string())),
            Ok(()) => read_head(&mut conn, method, deadline, max_head_bytes).await,
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
                    worker: target.url.clone(),
                    message,
                });
            }
            Err(Failure::Timeout) => {
                return Err(ProxyError::Timeout {
                    worker: target.url.clone(),
                    secs: timeout_secs,
                });
            }
        }
    }
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
