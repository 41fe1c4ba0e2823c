//! HTTP/1.1 framing on top of `httparse`: request heads from clients, response heads from
//! workers, chunked bodies, and the heads kvroute writes.
//!
//! Everything here works on byte slices; sockets live in [`crate::conn`]. Limits: a request
//! head over [`kvroute_core::config::defaults::MAX_HEAD_BYTES`] is refused (431), at most
//! [`MAX_HEADERS`] header lines.

use crate::error::HttpError;
use crate::message::Headers;

pub mod server;

/// Most header lines parsed in one head (request or response). More → 431 (request) or a
/// worker protocol error (response). Nginx's default buffer holds about as many.
pub const MAX_HEADERS: usize = 128;

/// Headers that describe one hop, never forwarded either way (RFC 9110 §7.6.1, plus the
/// de-facto `proxy-connection` and `keep-alive`). `content-length`, `transfer-encoding` and
/// `host` are rewritten by kvroute itself, so they are dropped as well.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
    "expect",
];

/// True when `name` (any case) must not be forwarded: a hop-by-hop field (RFC 9110 §7.6.1,
/// plus `proxy-connection` and `keep-alive`) or one kvroute rewrites itself
/// (`content-length`, `transfer-encoding`, `host`).
pub fn is_hop_by_hop(name: &str) -> bool {
    // Most names have no hop-by-hop name's length: refused without a compare.
    name.len() < 32
        && HOP_BY_HOP_LENGTHS & (1 << name.len()) != 0
        && HOP_BY_HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// Bit `n` set when some [`HOP_BY_HOP`] name is `n` bytes long (all are under 32).
const HOP_BY_HOP_LENGTHS: u32 = {
    let mut mask = 0u32;
    let mut i = 0;
    while i < HOP_BY_HOP.len() {
        assert!(HOP_BY_HOP[i].len() < 32);
        mask |= 1 << HOP_BY_HOP[i].len();
        i += 1;
    }
    mask
};

/// How a message body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body (e.g. a GET request, a 204 response).
    Empty,
    /// `Content-Length`, in bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// A response body that ends when the worker closes the connection.
    UntilClose,
}

/// A parsed request head. Header names keep their original spelling; values are raw bytes.
#[derive(Debug, Clone)]
pub struct RequestHead {
    /// Method, e.g. `POST`.
    pub method: String,
    /// Request target as sent (origin form, e.g. `/v1/chat/completions?x=1`, or absolute
    /// form, `http://host/v1/...`).
    pub target: String,
    /// Minor version: 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// Header lines in order.
    pub headers: Headers,
    /// How the body is delimited.
    pub framing: Framing,
    /// Whether the client lets the connection live after this exchange.
    pub keep_alive: bool,
    /// `Expect: 100-continue` was sent (curl does for bodies > 1 KiB).
    pub expect_continue: bool,
}

impl RequestHead {
    /// Path of the target without the query string (see [`crate::message::path_of`]).
    pub fn path(&self) -> &str {
        crate::message::path_of(&self.target)
    }
}

/// A parsed response head from a worker.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    /// Status code.
    pub status: u16,
    /// Reason phrase (may be empty).
    pub reason: String,
    /// Header lines in order.
    pub headers: Headers,
    /// How the body is delimited.
    pub framing: Framing,
    /// Whether the worker keeps the connection open after the body.
    pub keep_alive: bool,
}

fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// Body framing and keep-alive from a head's headers (RFC 9112 §6.3): chunked wins over
/// Content-Length; a message with both is refused (request smuggling).
fn framing_of(headers: &Headers, minor_version: u8) -> Result<(Option<Framing>, bool), HttpError> {
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut keep_alive = minor_version >= 1;
    for (name, value) in headers.iter() {
        if name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(value)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or(HttpError::Malformed("invalid content-length"))?;
            if length.is_some_and(|l| l != v) {
                return Err(HttpError::Malformed("conflicting content-length headers"));
            }
            length = Some(v);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            if has_token(value, "chunked") {
                chunked = true;
            } else {
                return Err(HttpError::Malformed("unsupported transfer-encoding"));
            }
        } else if name.eq_ignore_ascii_case("connection") {
            if has_token(value, "close") {
                keep_alive = false;
            } else if has_token(value, "keep-alive") {
                keep_alive = true;
            }
        }
    }
    if chunked && length.is_some() {
        return Err(HttpError::Malformed(
            "both content-length and transfer-encoding",
        ));
    }
    let framing = if chunked {
        Some(Framing::Chunked)
    } else {
        length.map(Framing::Length)
    };
    Ok((framing, keep_alive))
}

/// Parses a request head at the start of `buf`.
///
/// Returns `Ok(None)` while the head is incomplete, or the head and its length in bytes.
///
/// # Errors
/// - [`HttpError::HeadTooLarge`]: no complete head within `max_head_bytes`, or more than
///   [`MAX_HEADERS`] header lines (→ 431).
/// - [`HttpError::Malformed`]: not HTTP/1.x, bad Content-Length, both length and chunked
///   (→ 400).
pub fn parse_request_head(
    buf: &[u8],
    max_head_bytes: usize,
) -> Result<Option<(RequestHead, usize)>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let status = match req.parse(buf) {
        Ok(s) => s,
        Err(httparse::Error::TooManyHeaders) => return Err(HttpError::HeadTooLarge),
        Err(_) => return Err(HttpError::Malformed("invalid request head")),
    };
    let len = match status {
        httparse::Status::Partial => {
            return if buf.len() > max_head_bytes {
                Err(HttpError::HeadTooLarge)
            } else {
                Ok(None)
            };
        }
        httparse::Status::Complete(len) => len,
    };
    if len > max_head_bytes {
        return Err(HttpError::HeadTooLarge);
    }
    let minor_version = req.version.unwrap_or(1);
    let headers = Headers::collect(req.headers.iter().map(|l| (l.name, l.value)));
    let (framing, keep_alive) = framing_of(&headers, minor_version)?;
    let expect_continue = headers
        .iter()
        .any(|(n, v)| n.eq_ignore_ascii_case("expect") && v.eq_ignore_ascii_case(b"100-continue"));
    Ok(Some((
        RequestHead {
            method: req.method.unwrap_or("").to_string(),
            target: req.path.unwrap_or("").to_string(),
            minor_version,
            headers,
            framing: framing.unwrap_or(Framing::Empty),
            keep_alive,
            expect_continue,
        },
        len,
    )))
}

/// Parses a worker's response head at the start of `buf`. `request_method` decides whether
/// a body can follow (HEAD never has one). Interim 1xx responses are reported as such; the
/// caller skips them.
///
/// # Errors
/// [`HttpError::Malformed`] for an invalid head, a status below 100, or bad framing;
/// [`HttpError::HeadTooLarge`] for
/// too many header lines or a head over `max_head_bytes`.
pub fn parse_response_head(
    buf: &[u8],
    request_method: &str,
    max_head_bytes: usize,
) -> Result<Option<(ResponseHead, usize)>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() > max_head_bytes => {
            return Err(HttpError::HeadTooLarge);
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(HttpError::HeadTooLarge),
        Err(_) => return Err(HttpError::Malformed("invalid response head")),
    };
    // As for requests: a complete head over the limit is refused too, not only a partial one
    // (fuzz find: a 2,102-byte head passed a 2,048-byte limit when it came in one read).
    if len > max_head_bytes {
        return Err(HttpError::HeadTooLarge);
    }
    let status = resp.code.unwrap_or(0);
    // RFC 9110 §15: valid codes are 100..=599. One below 100 ("HTTP/1.1 053", found by
    // fuzzing) would be relayed as a status line without its three digits.
    if status < 100 {
        return Err(HttpError::Malformed("invalid response status"));
    }
    let minor_version = resp.version.unwrap_or(1);
    let headers = Headers::collect(resp.headers.iter().map(|l| (l.name, l.value)));
    let (framing, keep_alive) = framing_of(&headers, minor_version)?;
    let no_body = request_method.eq_ignore_ascii_case("HEAD")
        || (100..200).contains(&status)
        || status == 204
        || status == 304;
    let framing = if no_body {
        Framing::Empty
    } else {
        framing.unwrap_or(Framing::UntilClose)
    };
    Ok(Some((
        ResponseHead {
            status,
            reason: resp.reason.unwrap_or("").to_string(),
            headers,
            keep_alive: keep_alive && framing != Framing::UntilClose,
            framing,
        },
        len,
    )))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    Size,
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    TrailerStart,
    TrailerLine,
    TrailerLf,
    EndLf,
    Done,
}

/// Incremental decoder of a chunked body (RFC 9112 §7.1). Feed it bytes as they arrive; it
/// reports how many it consumed and whether the body ended. Used both to de-chunk request
/// bodies (collecting data) and to find the end of a relayed response (data ignored, bytes
/// passed through unchanged).
///
/// # Invariants
/// 1. Once `Done`, `feed` consumes nothing more.
/// 2. The sum of data handed out equals the sum of chunk sizes read.
#[derive(Debug, Clone)]
pub struct ChunkedDecoder {
    state: ChunkState,
    size: u64,
    remaining: u64,
    size_digits: u8,
    line_bytes: usize,
}

/// Longest chunk-size line, extensions and trailer line we accept, in bytes.
const MAX_CHUNK_LINE: usize = 4096;

impl Default for ChunkedDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkedDecoder {
    /// A decoder at the start of a chunked body.
    pub fn new() -> Self {
        Self {
            state: ChunkState::Size,
            size: 0,
            remaining: 0,
            size_digits: 0,
            line_bytes: 0,
        }
    }

    /// True once the terminating zero chunk and trailers were read.
    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    /// Consumes bytes of `input` up to the end of the body, appending chunk data to `out`
    /// when given. Returns the number of bytes consumed (less than `input.len()` only when
    /// the body ended inside `input`).
    ///
    /// # Errors
    /// [`HttpError::Malformed`] on a bad chunk size, a missing CRLF, or an over-long line.
    pub fn feed(
        &mut self,
        input: &[u8],
        mut out: Option<&mut Vec<u8>>,
    ) -> Result<usize, HttpError> {
        let mut i = 0;
        while i < input.len() && self.state != ChunkState::Done {
            let b = input[i];
            match self.state {
                ChunkState::Size => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        let digit = (b as char).to_digit(16).unwrap_or(0) as u64;
                        self.size_digits += 1;
                        if self.size_digits > 15 {
                            return Err(HttpError::Malformed("chunk size too large"));
                        }
                        self.size = self.size * 16 + digit;
                        i += 1;
                    }
                    b';' | b' ' | b'\t' if self.size_digits > 0 => {
                        self.state = ChunkState::Extension;
                        self.line_bytes = 0;
                        i += 1;
                    }
                    b'\r' if self.size_digits > 0 => {
                        self.state = ChunkState::SizeLf;
                        i += 1;
                    }
                    _ => return Err(HttpError::Malformed("invalid chunk size")),
                },
                ChunkState::Extension => {
                    if b == b'\r' {
                        self.state = ChunkState::SizeLf;
                    } else {
                        self.line_bytes += 1;
                        if self.line_bytes > MAX_CHUNK_LINE {
                            return Err(HttpError::Malformed("chunk extension too long"));
                        }
                    }
                    i += 1;
                }
                ChunkState::SizeLf => {
                    if b != b'\n' {
                        return Err(HttpError::Malformed("missing LF after chunk size"));
                    }
                    i += 1;
                    if self.size == 0 {
                        self.state = ChunkState::TrailerStart;
                    } else {
                        self.remaining = self.size;
                        self.state = ChunkState::Data;
                    }
                }
                ChunkState::Data => {
                    let take = (self.remaining as usize).min(input.len() - i);
                    if let Some(out) = out.as_deref_mut() {
                        out.extend_from_slice(&input[i..i + take]);
                    }
                    i += take;
                    self.remaining -= take as u64;
                    if self.remaining == 0 {
                        self.state = ChunkState::DataCr;
                    }
                }
                ChunkState::DataCr => {
                    if b != b'\r' {
                        return Err(HttpError::Malformed("missing CRLF after chunk data"));
                    }
                    self.state = ChunkState::DataLf;
                    i += 1;
                }
                ChunkState::DataLf => {
                    if b != b'\n' {
                        return Err(HttpError::Malformed("missing CRLF after chunk data"));
                    }
                    self.state = ChunkState::Size;
                    self.size = 0;
                    self.size_digits = 0;
                    i += 1;
                }
                ChunkState::TrailerStart => {
                    i += 1;
                    if b == b'\r' {
                        self.state = ChunkState::EndLf;
                    } else {
                        self.line_bytes = 1;
                        self.state = ChunkState::TrailerLine;
                    }
                }
                ChunkState::TrailerLine => {
                    i += 1;
                    if b == b'\r' {
                        self.state = ChunkState::TrailerLf;
                    } else {
                        self.line_bytes += 1;
                        if self.line_bytes > MAX_CHUNK_LINE {
                            return Err(HttpError::Malformed("trailer line too long"));
                        }
                    }
                }
                ChunkState::TrailerLf => {
                    if b != b'\n' {
                        return Err(HttpError::Malformed("missing LF in trailer"));
                    }
                    i += 1;
                    self.state = ChunkState::TrailerStart;
                }
                ChunkState::EndLf => {
                    if b != b'\n' {
                        return Err(HttpError::Malformed("missing final LF"));
                    }
                    i += 1;
                    self.state = ChunkState::Done;
                }
                ChunkState::Done => unreachable!("loop condition"),
            }
        }
        Ok(i)
    }
}

/// Appends a status line and `headers` (already filtered) to `out`, then the framing header,
/// any `extra` headers, and the blank line.
pub fn write_response_head(
    out: &mut Vec<u8>,
    status: u16,
    reason: &str,
    headers: &[(String, Vec<u8>)],
    framing: Framing,
    extra: &[(&str, &[u8])],
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(if reason.is_empty() {
        canonical_reason(status).as_bytes()
    } else {
        reason.as_bytes()
    });
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        push_header(out, name, value);
    }
    match framing {
        Framing::Length(n) => push_header(out, "content-length", n.to_string().as_bytes()),
        Framing::Chunked | Framing::UntilClose => push_header(out, "transfer-encoding", b"chunked"),
        Framing::Empty => {}
    }
    for (name, value) in extra {
        push_header(out, name, value);
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends `name: value\r\n`.
pub fn push_header(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Reason phrase for the statuses kvroute itself produces.
pub fn canonical_reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        408 => "Request Timeout",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The lines come back in order, with their spelling, duplicates and empty values, and
    /// `get` finds the first of a name.
    #[test]
    fn headers_keep_every_line_in_order() {
        let raw =
            b"GET / HTTP/1.1\r\nX-A: 1\r\nx-b:\r\nX-A: two, 3\r\nContent-Type: text/plain\r\n\r\n";
        let (head, _) = parse_request_head(raw, 65536).unwrap().unwrap();
        let lines: Vec<(&str, &[u8])> = head.headers.iter().collect();
        let want: [(&str, &[u8]); 4] = [
            ("X-A", b"1"),
            ("x-b", b""),
            ("X-A", b"two, 3"),
            ("Content-Type", b"text/plain"),
        ];
        assert_eq!(lines, want);
        assert_eq!(head.headers.len(), 4);
        assert_eq!(head.headers.get("x-a"), Some(&b"1"[..]));
        assert_eq!(head.headers.get("CONTENT-TYPE"), Some(&b"text/plain"[..]));
        assert_eq!(head.headers.get("x-c"), None);
        assert!(Headers::default().is_empty());
    }

    /// Every listed name is hop-by-hop in any case, through the length mask; names of every
    /// length up to 40 that are not listed (lengths past the mask's 32 bits included), and
    /// common end-to-end names, are not.
    #[test]
    fn hop_by_hop_names_in_any_case() {
        for h in HOP_BY_HOP {
            assert!(is_hop_by_hop(h), "{h}");
            assert!(is_hop_by_hop(&h.to_ascii_uppercase()), "{h}");
        }
        for n in 0..40 {
            let name = "x".repeat(n);
            assert!(!is_hop_by_hop(&name), "{name}");
        }
        for kept in [
            "content-type",
            "x-request-id",
            "authorization",
            "accept",
            "te2",
        ] {
            assert!(!is_hop_by_hop(kept), "{kept}");
        }
    }

    #[test]
    fn request_head_content_length_and_keep_alive() {
        let raw =
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello";
        let (head, len) = parse_request_head(raw, 65536).unwrap().unwrap();
        assert_eq!(len, raw.len() - 5);
        assert_eq!(head.method, "POST");
        assert_eq!(head.path(), "/v1/chat/completions");
        assert_eq!(head.framing, Framing::Length(5));
        assert!(head.keep_alive);
        let raw10 = b"GET /health HTTP/1.0\r\n\r\n";
        let (head, _) = parse_request_head(raw10, 65536).unwrap().unwrap();
        assert!(!head.keep_alive);
        assert_eq!(head.framing, Framing::Empty);
    }

    #[test]
    fn request_head_errors() {
        assert!(
            parse_request_head(b"POST / HTTP/1.1\r\nHost: x\r\n", 65536)
                .unwrap()
                .is_none()
        );
        let big = format!("GET / HTTP/1.1\r\nX: {}\r\n", "a".repeat(70_000));
        assert!(matches!(
            parse_request_head(big.as_bytes(), 65536),
            Err(HttpError::HeadTooLarge)
        ));
        assert!(matches!(
            parse_request_head(b"\x01\x02 garbage\r\n\r\n", 65536),
            Err(HttpError::Malformed(_))
        ));
        let both = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(matches!(
            parse_request_head(both, 65536),
            Err(HttpError::Malformed(_))
        ));
    }

    #[test]
    fn response_head_framing() {
        let raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
        let (h, _) = parse_response_head(raw, "POST", 65536).unwrap().unwrap();
        assert_eq!(h.framing, Framing::Chunked);
        assert!(h.keep_alive);
        let raw = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n";
        let (h, _) = parse_response_head(raw, "POST", 65536).unwrap().unwrap();
        assert_eq!(h.framing, Framing::UntilClose);
        assert!(!h.keep_alive);
        let raw = b"HTTP/1.1 204 No Content\r\n\r\n";
        let (h, _) = parse_response_head(raw, "POST", 65536).unwrap().unwrap();
        assert_eq!(h.framing, Framing::Empty);
    }

    /// Fuzz find: a status below 100 parsed, and `write_response_head` then relayed it as
    /// `HTTP/1.1 53 ...`, which no client parses.
    #[test]
    fn response_status_below_100_is_refused() {
        let raw = b"HTTP/1.1 053 Service\r\ncontent-length: 2\r\n\r\n{}";
        assert!(matches!(
            parse_response_head(raw, "POST", 65536),
            Err(HttpError::Malformed("invalid response status"))
        ));
        let raw = b"HTTP/1.1 100 Continue\r\n\r\n";
        let (h, len) = parse_response_head(raw, "POST", 65536).unwrap().unwrap();
        assert_eq!((h.status, h.framing, len), (100, Framing::Empty, raw.len()));
        let mut out = Vec::new();
        write_response_head(&mut out, 599, "", &[], Framing::Length(0), &[]);
        let (h, _) = parse_response_head(&out, "POST", 65536).unwrap().unwrap();
        assert_eq!((h.status, h.framing), (599, Framing::Length(0)));
    }

    /// Fuzz find: a complete response head longer than `max_head_bytes` was accepted when it
    /// arrived in one read (only a partial one was refused).
    #[test]
    fn complete_response_head_over_limit_is_refused() {
        let raw = format!("HTTP/1.1 200 OK\r\nx-pad: {}\r\n\r\n", "a".repeat(100));
        assert!(matches!(
            parse_response_head(raw.as_bytes(), "POST", 64),
            Err(HttpError::HeadTooLarge)
        ));
        let (_, len) = parse_response_head(raw.as_bytes(), "POST", raw.len())
            .unwrap()
            .unwrap();
        assert_eq!(len, raw.len());
    }

    fn encode_chunked(parts: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in parts.iter().filter(|p| !p.is_empty()) {
            out.extend_from_slice(format!("{:x};ext=1\r\n", p.len()).as_bytes());
            out.extend_from_slice(p);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\n");
        out
    }

    proptest! {
        /// Any split of a chunked message into reads decodes to the concatenated parts and
        /// stops exactly at the end, leaving the pipelined tail unconsumed.
        #[test]
        fn chunked_roundtrip(parts in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..6),
                             cuts in prop::collection::vec(0usize..2000, 0..8)) {
            let mut wire = encode_chunked(&parts);
            let body_len = wire.len();
            wire.extend_from_slice(b"NEXT");
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (wire.len() + 1)).collect();
            cuts.push(wire.len());
            cuts.sort();
            let mut dec = ChunkedDecoder::new();
            let mut out = Vec::new();
            let mut pos = 0;
            for c in cuts {
                if c <= pos { continue; }
                let n = dec.feed(&wire[pos..c], Some(&mut out)).unwrap();
                pos += n;
                if dec.is_done() { break; }
            }
            prop_assert!(dec.is_done());
            prop_assert_eq!(pos, body_len);
            prop_assert_eq!(out, parts.concat());
        }
    }

    #[test]
    fn chunked_rejects_garbage() {
        let mut d = ChunkedDecoder::new();
        assert!(d.feed(b"zz\r\n", None).is_err());
        let mut d = ChunkedDecoder::new();
        assert!(d.feed(b"3\r\nabcX", None).is_err());
    }
}
