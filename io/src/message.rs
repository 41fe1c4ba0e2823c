//! The protocol-neutral request and response of one exchange: what [`crate::exchange`] takes
//! and writes through, whatever the client's transport (HTTP/1.1 today in [`crate::http1`];
//! HTTP/2 and TLS later). Arrows: a transport → [`crate::exchange`] → this module; the
//! exchange never imports a transport.

use kvroute_core::chat_prefix::PrefixScanner;
use std::future::Future;
use std::io;
use std::time::Instant;

/// One header line as the exchange reads and writes it: the name (any case, as sent) and the
/// value's raw bytes.
pub type HeaderLine<'a> = (&'a str, &'a [u8]);

/// Request id header: taken from the client, or generated; sent upstream and back.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The header lines of a parsed head, in order: names in their original spelling, values as
/// raw bytes. What a transport hands the exchange, whatever its wire format.
///
/// Held in three buffers (the names, the values, the ends of each line's name and value)
/// whatever the number of lines, where a `Vec<(String, Vec<u8>)>` took two allocations per
/// line; the heads of one proxied request (the client's, the worker's) had ~10 lines, and
/// their allocations and frees were ~1.5 % of a round-robin request's samples
/// (perf/runs/2026-12-02-common-path). The exchange reads them in place: converting them to
/// `http::HeaderMap` and back cost 6.9k of a proxied SSE request's 53.8k instructions
/// (callgrind, perf/runs/2026-12-03-lean-headers).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers {
    names: String,
    values: Vec<u8>,
    /// Per line, the end of its name in `names` and of its value in `values` (each starts
    /// where the line before ended).
    ends: Vec<(u32, u32)>,
}

impl Headers {
    /// The lines of `lines`, copied, in order. `lines` is walked twice (once to size the
    /// buffers).
    pub fn collect<'h, I>(lines: I) -> Headers
    where
        I: Iterator<Item = HeaderLine<'h>> + Clone,
    {
        let (mut n, mut v, mut count) = (0, 0, 0);
        for (name, value) in lines.clone() {
            (n, v, count) = (n + name.len(), v + value.len(), count + 1);
        }
        let mut h = Headers {
            names: String::with_capacity(n),
            values: Vec::with_capacity(v),
            ends: Vec::with_capacity(count),
        };
        for (name, value) in lines {
            h.names.push_str(name);
            h.values.extend_from_slice(value);
            h.ends.push((h.names.len() as u32, h.values.len() as u32));
        }
        h
    }

    /// Lines, in order.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// No lines.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// `(name, value)` of every line, in order.
    pub fn iter(&self) -> impl Iterator<Item = HeaderLine<'_>> + Clone + '_ {
        let mut start = (0usize, 0usize);
        self.ends.iter().map(move |&(n, v)| {
            let (n, v) = (n as usize, v as usize);
            let line = (&self.names[start.0..n], &self.values[start.1..v]);
            start = (n, v);
            line
        })
    }

    /// The value of the first line named `name` (ASCII case-insensitively).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }
}

/// One parsed client request: its method, target and header lines as sent, the whole body,
/// and when its first byte was read.
#[derive(Debug)]
pub struct Request {
    /// Method, case-sensitive as sent (e.g. `POST`).
    pub method: String,
    /// Request target as sent: origin form (`/v1/chat/completions?x=1`) or absolute form
    /// (`http://host/v1/...`, RFC 9112 §3.2.2).
    pub target: String,
    /// Header lines, in order.
    pub headers: Headers,
    /// The whole body (de-chunked), bytes.
    pub body: Vec<u8>,
    /// The body's chat-prefix scan, run by the transport as the body arrived (see
    /// [`crate::exchange::scans_body`]); `None`: not run (routing scans the body itself).
    pub prefix_scan: Option<Box<PrefixScanner>>,
    /// When the transport started reading this request (router-added latency and TTFT are
    /// measured from here).
    pub received: Instant,
}

impl Request {
    /// The value of header `name` (any case) as bytes (the first one), if present.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.get(name)
    }

    /// The target's path and query, as forwarded: see [`origin_form`].
    pub fn path_and_query(&self) -> &str {
        origin_form(&self.target)
    }

    /// The path of the target, without the query: see [`path_of`].
    pub fn path(&self) -> &str {
        path_of(&self.target)
    }
}

/// The origin form of a request target (RFC 9112 §3.2), without a `#fragment` (never part of
/// a request target, RFC 9110 §4.2.4): `target` when it starts with `/`; for an absolute
/// form `scheme://authority[/path][?query]`, the part after the authority (empty, or starting
/// with `?` when the path is empty: the caller writes the `/` then, RFC 9112 §3.2.1); any
/// other form (`*`, an authority) as it is.
pub(crate) fn origin_form(target: &str) -> &str {
    let target = target.split_once('#').map_or(target, |(t, _)| t);
    if target.starts_with('/') {
        return target;
    }
    match target.split_once("://") {
        Some((_, rest)) => rest.find(['/', '?']).map_or("", |i| &rest[i..]),
        None => target,
    }
}

/// The path of a request target without its query: [`origin_form`]'s path, `/` when it is
/// empty.
pub(crate) fn path_of(target: &str) -> &str {
    let pq = origin_form(target);
    match pq.split_once('?').map_or(pq, |(p, _)| p) {
        "" => "/",
        p => p,
    }
}

/// How a response body will follow its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// Exactly this many bytes.
    Length(u64),
    /// A stream of unknown length (HTTP/1.1 writes it chunked), ended by
    /// [`ResponseSink::finish`].
    Stream,
}

/// Where an exchange writes its response: the client side of one transport. Implemented by
/// the HTTP/1.1 connection ([`crate::http1::Http1Sink`]).
///
/// Calls come in this order: one [`ResponseSink::send_head`], any number of
/// [`ResponseSink::send_data`], one [`ResponseSink::finish`]. Headers that describe one hop
/// (framing, `connection`) are the sink's business: the exchange passes end-to-end headers
/// only.
pub trait ResponseSink {
    /// Writes the response head: `status`, end-to-end `headers` (in order), and how the body
    /// follows. A sink may hold the head until the next `send_data`, `finish` or `flush`, to
    /// write it with the first body bytes.
    ///
    /// # Errors
    /// The client's connection failed (it went away).
    fn send_head(
        &mut self,
        status: u16,
        headers: &[HeaderLine<'_>],
        body: BodyKind,
    ) -> impl Future<Output = io::Result<()>>;

    /// Writes body bytes (already de-framed), returning the buffer for reuse.
    ///
    /// # Errors
    /// The client's connection failed (it went away).
    fn send_data(&mut self, data: Vec<u8>) -> impl Future<Output = (io::Result<()>, Vec<u8>)>;

    /// Ends the body (a stream's terminator; nothing for a `Length` body).
    ///
    /// # Errors
    /// The client's connection failed.
    fn finish(&mut self) -> impl Future<Output = io::Result<()>>;

    /// Writes whatever the sink holds (a head waiting for its first body bytes). Called
    /// before waiting on anything else, so a held head never waits on the worker.
    ///
    /// # Errors
    /// The client's connection failed.
    fn flush(&mut self) -> impl Future<Output = io::Result<()>>;

    /// Resolves once the client has gone (EOF or reset), so work done for it can be cancelled
    /// (bug-cases.md B41). Never resolves while the client is there.
    fn client_gone(&self) -> impl Future<Output = ()>;

    /// True once the head was sent (nothing can be retried invisibly after that).
    fn head_sent(&self) -> bool;

    /// Asks the transport to close the connection after this response (shutdown, a broken
    /// stream); must be called before `send_head` to be announced in it.
    fn close_after(&mut self);
}

/// An OpenAI-shaped error: status, `type` and message (`{"error":{"message","type","param","code"}}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// What went wrong, for the client (never an internal URL).
    pub message: String,
}

impl ApiError {
    /// An error with `status` and `message`.
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// The JSON body (see [`crate::error::error_body`]).
    pub fn body(&self) -> Vec<u8> {
        crate::error::error_body(self.status, &self.message)
    }
}

/// Writes a whole response with a `Content-Length` body through `sink`. Returns whether the
/// write succeeded.
pub async fn respond(
    sink: &mut impl ResponseSink,
    status: u16,
    content_type: &str,
    extra: &[HeaderLine<'_>],
    body: Vec<u8>,
) -> bool {
    let mut headers = Vec::with_capacity(1 + extra.len());
    headers.push(("content-type", content_type.as_bytes()));
    headers.extend_from_slice(extra);
    if sink
        .send_head(status, &headers, BodyKind::Length(body.len() as u64))
        .await
        .is_err()
    {
        return false;
    }
    let (res, _) = sink.send_data(body).await;
    res.is_ok() && sink.finish().await.is_ok()
}

/// Writes `err` as an OpenAI-shaped JSON error response; a 503 carries `Retry-After`
/// ([`crate::error::RETRY_AFTER_SECS`]).
pub async fn respond_error(
    sink: &mut impl ResponseSink,
    err: &ApiError,
    extra: &[HeaderLine<'_>],
) -> bool {
    if err.status != 503 {
        return respond(sink, err.status, "application/json", extra, err.body()).await;
    }
    let mut headers = extra.to_vec();
    headers.push(("retry-after", crate::error::RETRY_AFTER_SECS.as_bytes()));
    respond(sink, err.status, "application/json", &headers, err.body()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(target: &str) -> Request {
        Request {
            method: "POST".into(),
            target: target.into(),
            headers: Headers::collect([("X-Session-Id", &b"s1"[..]), ("x-a", b"")].into_iter()),
            body: Vec::new(),
            prefix_scan: None,
            received: Instant::now(),
        }
    }

    /// Origin and absolute forms (RFC 9112 §3.2) give the same path and query, without a
    /// fragment; `*` and an authority stay as they are (no route has them: 404).
    #[test]
    fn path_and_query_of_each_target_form() {
        let cases = [
            (
                "/v1/chat/completions?x=1",
                "/v1/chat/completions?x=1",
                "/v1/chat/completions",
            ),
            ("/health", "/health", "/health"),
            ("/health#top", "/health", "/health"),
            (
                "http://h:8000/v1/completions?a=b",
                "/v1/completions?a=b",
                "/v1/completions",
            ),
            ("https://h/generate#f", "/generate", "/generate"),
            ("http://h:8000", "", "/"),
            ("http://h?q", "?q", "/"),
            ("*", "*", "*"),
            ("h:443", "h:443", "h:443"),
        ];
        for (target, pq, path) in cases {
            let r = request(target);
            assert_eq!((r.path_and_query(), r.path()), (pq, path), "{target}");
        }
    }

    /// Header lookups ignore case and return the first line's value, empty values included.
    #[test]
    fn header_lookup_ignores_case() {
        let r = request("/");
        assert_eq!(r.header("x-session-id"), Some(&b"s1"[..]));
        assert_eq!(r.header("X-A"), Some(&b""[..]));
        assert_eq!(r.header("x-b"), None);
        assert_eq!(r.headers.len(), 2);
    }
}
