//! The HTTP/1.1 client side: one connection's loop (read a request head and body under the
//! slow-client timeouts, hand a neutral [`Request`] to [`crate::exchange::handle`]) and
//! [`Http1Sink`], the [`ResponseSink`] that writes its response.
//!
//! Limits, each answered with an OpenAI-shaped error and a closed connection: a head over
//! `max_head_bytes` → 431, a body over `max_body_bytes` → 413, no complete head within
//! `client_header_timeout` → 408, a body read stalled for `client_body_timeout` → 408,
//! malformed bytes → 400 (nginx's behaviour, operations.md §3). An idle keep-alive
//! connection closes silently after `client_idle_timeout`.

use super::{ChunkedDecoder, Framing, RequestHead, parse_request_head};
use crate::conn::{Conn, Transport};
use crate::error::HttpError;
use crate::exchange::{self, ShardCtx};
use crate::message::{
    ApiError, BodyKind, HeaderLine, REQUEST_ID_HEADER, Request, ResponseSink, respond_error,
};
use kvroute_core::chat_prefix::PrefixScanner;
use std::io;
use std::time::{Duration, Instant};

/// Serves one client connection until it closes, errs, asks to close, or the gateway shuts
/// down between two requests.
pub async fn serve_connection<S: Transport>(ctx: ShardCtx, mut client: Conn<S>) {
    let s = &ctx.shared.settings;
    let mut out = Vec::new();
    loop {
        if ctx.shared.is_shutting_down() && client.buffered().is_empty() {
            return;
        }
        // `received` is when the request's first byte arrived, not when the connection went
        // idle: time a keep-alive connection waits for its next request is not latency.
        let mut received = Instant::now();
        let head = match read_head(
            &mut client,
            s.max_head_bytes,
            s.client_idle_timeout,
            s.client_header_timeout,
            &mut received,
        )
        .await
        {
            Ok(Some(head)) => head,
            Ok(None) => return,
            Err(e) => {
                reject(&ctx, &mut client, &e, received, None).await;
                return;
            }
        };
        let mut scan = BodyScan::new(|| exchange::scans_body(&ctx, &head.method, &head.target));
        let limits = (s.max_body_bytes, s.client_body_timeout);
        let body = match read_body(&mut client, &head, limits, &mut scan).await {
            Ok(body) => body,
            Err(BodyError::Closed) => return,
            Err(BodyError::Http(e)) => {
                let req = to_request(head, Vec::new(), None, received);
                reject(&ctx, &mut client, &e, received, Some(&req)).await;
                return;
            }
        };
        let scan = scan.scanner;
        let keep = head.keep_alive;
        let req = to_request(head, body, scan, received);
        let mut sink = Http1Sink::with_buffer(&mut client, keep, std::mem::take(&mut out));
        exchange::handle(&ctx, req, &mut sink).await;
        // Whatever the exchange left held (a head no data followed) reaches the client.
        let _ = sink.flush().await;
        if !sink.reusable() {
            return;
        }
        out = sink.into_buffer();
    }
}

/// Answers a request that could not be read (it never reaches the exchange, but is counted
/// and logged like every other: [`exchange::reject`]; `req`, its head when it was read) and
/// closes.
async fn reject<S: Transport>(
    ctx: &ShardCtx,
    client: &mut Conn<S>,
    e: &HttpError,
    received: Instant,
    req: Option<&Request>,
) {
    let err = ApiError::new(e.status(), e.to_string());
    let mut sink = Http1Sink::new(client, false);
    let id = exchange::reject(ctx, &err, e.kind(), received, req);
    let extra: Vec<_> = id
        .iter()
        .map(|id| (REQUEST_ID_HEADER, id.as_bytes()))
        .collect();
    let _ = respond_error(&mut sink, &err, &extra).await;
}

/// A parsed head and its body as a neutral [`Request`] (moved, nothing parsed again:
/// httparse already checked the method, target and header bytes).
fn to_request(
    head: RequestHead,
    body: Vec<u8>,
    prefix_scan: Option<Box<PrefixScanner>>,
    received: Instant,
) -> Request {
    Request {
        method: head.method,
        target: head.target,
        headers: head.headers,
        body,
        prefix_scan,
        received,
    }
}

/// Reads one request head. `Ok(None)`: the client closed (or idled out) between requests.
/// `started` is set to when its first byte was there (now, when bytes were already buffered).
///
/// # Errors
/// [`HttpError::HeadTooLarge`], [`HttpError::Malformed`], or [`HttpError::Timeout`] when the
/// head started but did not complete within `header_timeout`.
async fn read_head<S: Transport>(
    client: &mut Conn<S>,
    max_head: usize,
    idle_timeout: Duration,
    header_timeout: Duration,
    received: &mut Instant,
) -> Result<Option<RequestHead>, HttpError> {
    let mut started: Option<Instant> = None;
    loop {
        if !client.buffered().is_empty() {
            let first = *started.get_or_insert_with(Instant::now);
            *received = first;
            if let Some((head, len)) = parse_request_head(client.buffered(), max_head)? {
                client.consume(len);
                return Ok(Some(head));
            }
        }
        let wait = match started {
            None => idle_timeout,
            Some(t) => header_timeout.saturating_sub(t.elapsed()),
        };
        let had = client.buffered().len();
        match monoio::time::timeout(wait, client.fill()).await {
            Ok(Ok(n)) if n > 0 => {}
            Err(_) if had > 0 => return Err(HttpError::Timeout("request head")),
            _ if had == 0 => return Ok(None),
            _ => {
                return Err(HttpError::Malformed(
                    "connection closed inside the request head",
                ));
            }
        }
    }
}

enum BodyError {
    Closed,
    Http(HttpError),
}

impl From<HttpError> for BodyError {
    fn from(e: HttpError) -> Self {
        BodyError::Http(e)
    }
}

/// One read of a body, allowed `timeout` (a stalled upload is a slow client).
async fn fill_body<S: Transport>(client: &mut Conn<S>, timeout: Duration) -> Result<(), BodyError> {
    match monoio::time::timeout(timeout, client.fill()).await {
        Ok(Ok(n)) if n > 0 => Ok(()),
        Ok(_) => Err(BodyError::Closed),
        Err(_) => Err(HttpError::Timeout("request body").into()),
    }
}

/// The prefix scan of a request body that takes more than one read: a [`PrefixScanner`] is
/// made at the first wait for more bytes, when `scans()` says routing will scan the body
/// ([`exchange::scans_body`]), and fed the body so far before each later wait. A body whole
/// at the first look (most requests: head and body in one read) makes none: the decision
/// scans it at once, and no request carries a scanner it did not need.
struct BodyScan<F> {
    scans: Option<F>,
    scanner: Option<Box<PrefixScanner>>,
}

impl<F: FnOnce() -> bool> BodyScan<F> {
    fn new(scans: F) -> Self {
        Self {
            scans: Some(scans),
            scanner: None,
        }
    }

    /// Before a wait for more bytes: `body` is the body so far.
    fn feed(&mut self, body: &[u8]) {
        if let Some(scans) = self.scans.take()
            && scans()
        {
            self.scanner = Some(Box::new(PrefixScanner::new()));
        }
        if let Some(s) = self.scanner.as_mut() {
            s.feed(body);
        }
    }
}

/// Reads the whole request body (the router must see it to route), de-chunking if needed,
/// under `(max_body, timeout)` (bytes, per read); feeds `scan` the body so far before each
/// wait for more ([`BodyScan`]).
async fn read_body<S: Transport, F: FnOnce() -> bool>(
    client: &mut Conn<S>,
    head: &RequestHead,
    (max_body, timeout): (usize, Duration),
    scan: &mut BodyScan<F>,
) -> Result<Vec<u8>, BodyError> {
    let too_large = HttpError::BodyTooLarge { limit: max_body };
    match head.framing {
        Framing::Empty | Framing::Length(0) => Ok(Vec::new()),
        Framing::Length(n) => {
            if n > max_body as u64 {
                return Err(too_large.into());
            }
            let n = n as usize;
            send_continue(client, head).await;
            while client.buffered().len() < n {
                scan.feed(client.buffered());
                fill_body(client, timeout).await?;
            }
            let body = client.buffered()[..n].to_vec();
            client.consume(n);
            Ok(body)
        }
        Framing::Chunked => {
            send_continue(client, head).await;
            let mut dec = ChunkedDecoder::new();
            let mut body = Vec::new();
            loop {
                let used = dec.feed(client.buffered(), Some(&mut body))?;
                client.consume(used);
                if body.len() > max_body {
                    return Err(too_large.into());
                }
                if dec.is_done() {
                    return Ok(body);
                }
                scan.feed(&body);
                fill_body(client, timeout).await?;
            }
        }
        Framing::UntilClose => Err(HttpError::Malformed("request without length").into()),
    }
}

async fn send_continue<S: Transport>(client: &mut Conn<S>, head: &RequestHead) {
    if head.expect_continue && client.buffered().is_empty() {
        let _ = client
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec())
            .await;
    }
}

/// Largest write buffer a connection keeps between responses, bytes: a proxied response's
/// head and first chunk fit (a completion of a few hundred bytes, an SSE event), a `/metrics`
/// page does not need to stay allocated per idle connection.
const KEPT_BUFFER_BYTES: usize = 16 * 1024;

/// The [`ResponseSink`] of one HTTP/1.1 exchange: writes the head with `content-length` or
/// `transfer-encoding: chunked`, frames stream data as chunks, and says `connection: close`
/// when the connection will not be reused.
///
/// The head is encoded by `send_head` but held in the sink's write buffer until the next
/// `send_data`, `finish` or `flush`, so it leaves in the same write (one TCP segment on
/// loopback) as the first body bytes. A proxied response's first body bytes are already
/// there when its head is sent (the exchange holds the head until the worker's first body
/// byte), so nothing waits: measured with perf/compare.sh (2026-12-01-proxy), one `send`
/// fewer per request took ~4 µs of CPU per proxied request and lowered the first SSE chunk's
/// latency (the client wakes once, not for the head and then the body).
///
/// # Invariants
/// 1. At most one head is written; data is written only after it.
/// 2. A `Length` body is written with no framing; a `Stream` body as chunks ending `0\r\n\r\n`.
/// 3. `out` holds only bytes not yet written, in wire order (a head, a chunk being framed).
pub struct Http1Sink<'a, S: Transport> {
    client: &'a mut Conn<S>,
    keep_alive: bool,
    body: Option<BodyKind>,
    finished: bool,
    failed: bool,
    /// The write buffer: a held head, then each chunk's framing (size line + data + CRLF) or
    /// a `Length` body's bytes. Reused for every write: no allocation per chunk once it has
    /// grown to the largest one.
    out: Vec<u8>,
}

impl<'a, S: Transport> Http1Sink<'a, S> {
    /// A sink on `client`; `keep_alive` is what the client asked for.
    pub fn new(client: &'a mut Conn<S>, keep_alive: bool) -> Self {
        Self {
            client,
            keep_alive,
            body: None,
            finished: false,
            failed: false,
            out: Vec::new(),
        }
    }

    /// A sink on `client` writing through `out` (emptied first): a connection's buffer from
    /// its previous response, so a response does not allocate one.
    pub fn with_buffer(client: &'a mut Conn<S>, keep_alive: bool, mut out: Vec<u8>) -> Self {
        out.clear();
        Self {
            out,
            ..Self::new(client, keep_alive)
        }
    }

    /// The write buffer, empty, for the connection's next response; dropped instead when it
    /// grew past [`KEPT_BUFFER_BYTES`] (a `/metrics` page, a large first chunk), so an idle
    /// keep-alive connection holds no more than that.
    pub fn into_buffer(self) -> Vec<u8> {
        let mut out = self.out;
        if out.capacity() > KEPT_BUFFER_BYTES {
            return Vec::new();
        }
        out.clear();
        out
    }

    /// True when the connection may serve another request: the client asked for keep-alive,
    /// the response was written whole, and nothing asked to close.
    pub fn reusable(&self) -> bool {
        self.keep_alive && self.finished && !self.failed && self.out.is_empty()
    }

    /// Writes (and empties) the write buffer.
    async fn write_out(&mut self) -> io::Result<()> {
        let out = std::mem::take(&mut self.out);
        let (res, mut out) = self.client.write_all(out).await;
        out.clear();
        self.out = out;
        self.failed |= res.is_err();
        res
    }
}

impl<S: Transport> ResponseSink for Http1Sink<'_, S> {
    async fn send_head(
        &mut self,
        status: u16,
        headers: &[HeaderLine<'_>],
        body: BodyKind,
    ) -> io::Result<()> {
        debug_assert!(self.body.is_none(), "invariant 1: one head");
        use std::io::Write as _;
        let out = &mut self.out;
        out.reserve(256);
        // `write!` into the buffer: no `String` per number.
        let _ = write!(out, "HTTP/1.1 {status} ");
        out.extend_from_slice(super::canonical_reason(status).as_bytes());
        out.extend_from_slice(b"\r\n");
        for &(name, value) in headers {
            super::push_header(out, name, value);
        }
        match body {
            BodyKind::Length(n) => {
                let _ = write!(out, "content-length: {n}\r\n");
            }
            BodyKind::Stream => super::push_header(out, "transfer-encoding", b"chunked"),
        }
        if !self.keep_alive {
            super::push_header(out, "connection", b"close");
        }
        out.extend_from_slice(b"\r\n");
        self.body = Some(body);
        // Held until the first data, `finish` or `flush` (see the type's doc).
        Ok(())
    }

    async fn send_data(&mut self, data: Vec<u8>) -> (io::Result<()>, Vec<u8>) {
        if data.is_empty() {
            return (Ok(()), data);
        }
        match self.body {
            Some(BodyKind::Stream) => {
                use std::io::Write as _;
                let _ = write!(self.out, "{:x}\r\n", data.len());
                self.out.extend_from_slice(&data);
                self.out.extend_from_slice(b"\r\n");
            }
            // Nothing held: the data's own buffer goes to the socket, no copy.
            _ if self.out.is_empty() => {
                let (res, data) = self.client.write_all(data).await;
                self.failed |= res.is_err();
                return (res, data);
            }
            _ => self.out.extend_from_slice(&data),
        }
        (self.write_out().await, data)
    }

    async fn finish(&mut self) -> io::Result<()> {
        if self.body == Some(BodyKind::Stream) {
            self.out.extend_from_slice(b"0\r\n\r\n");
        }
        if !self.out.is_empty() {
            self.write_out().await?;
        }
        self.finished = true;
        Ok(())
    }

    async fn flush(&mut self) -> io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        self.write_out().await
    }

    async fn client_gone(&self) {
        self.client.stream.peer_gone().await
    }

    fn head_sent(&self) -> bool {
        self.body.is_some()
    }

    fn close_after(&mut self) {
        self.keep_alive = false;
    }
}
