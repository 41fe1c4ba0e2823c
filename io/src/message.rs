//! The protocol-neutral request and response of one exchange: what [`crate::exchange`] takes
//! and writes through, whatever the client's transport (HTTP/1.1 today in [`crate::http1`];
//! HTTP/2 and TLS later). Arrows: a transport → [`crate::exchange`] → this module; the
//! exchange never imports a transport.

use std::future::Future;
use std::io;
use std::time::Instant;

/// One parsed client request: its head as `http` types, the whole body, and when its first
/// byte was read.
#[derive(Debug)]
pub struct Request {
    /// Method, URI (origin form), version and headers.
    pub parts: http::request::Parts,
    /// The whole body (de-chunked), bytes.
    pub body: Vec<u8>,
    /// When the transport started reading this request (router-added latency and TTFT are
    /// measured from here).
    pub received: Instant,
}

impl Request {
    /// The value of header `name` as bytes (the first one), if present.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.parts
            .headers
            .get(name)
            .map(http::HeaderValue::as_bytes)
    }

    /// The path of the URI, without the query.
    pub fn path(&self) -> &str {
        self.parts.uri.path()
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
        headers: &[(http::HeaderName, http::HeaderValue)],
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

/// An OpenAI-shaped error: status, `type` and message (`{"error":{"message","type","code"}}`).
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
    extra: &[(http::HeaderName, http::HeaderValue)],
    body: Vec<u8>,
) -> bool {
    let mut headers = Vec::with_capacity(1 + extra.len());
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        headers.push((http::header::CONTENT_TYPE, v));
    }
    headers.extend(extra.iter().cloned());
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

/// Writes `err` as an OpenAI-shaped JSON error response.
pub async fn respond_error(
    sink: &mut impl ResponseSink,
    err: &ApiError,
    extra: &[(http::HeaderName, http::HeaderValue)],
) -> bool {
    respond(sink, err.status, "application/json", extra, err.body()).await
}
