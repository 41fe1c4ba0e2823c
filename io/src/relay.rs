//! Relay of a worker's response to the client, as the bytes arrive.
//!
//! The body bytes pass through unchanged (a chunked SSE stream stays chunked, chunk for
//! chunk); kvroute only tracks the framing to know where the body ends, so the worker
//! connection can go back to the pool. Backpressure is structural: the next read from the
//! worker starts only after the previous bytes were written to the client, so a slow client
//! holds at most one read buffer (16 KiB) of the response in the router (bug-cases.md B41).
//! A failed client write drops the worker connection, which closes the upstream request: the
//! engine sees the disconnect and aborts.

use crate::conn::Conn;
use crate::http1::{self, ChunkedDecoder, Framing, ResponseHead};
use monoio::buf::IoBufMut;
use monoio::io::AsyncReadRent;
use std::time::Instant;

/// How a relay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayEnd {
    /// The whole body reached the client. `reusable`: the worker connection may be pooled.
    Complete {
        /// The worker connection ended cleanly and may serve another request.
        reusable: bool,
    },
    /// The client went away (write failed); the worker connection was dropped.
    ClientGone,
    /// The worker failed or timed out mid-body; the client connection must be closed since
    /// its response is truncated.
    UpstreamFailed,
}

/// Size of one relay read, in bytes.
const RELAY_READ_BYTES: usize = 16 * 1024;

/// Writes the response head (hop-by-hop headers removed, `x-kvroute-worker` added) and relays
/// the body until it ends, the client goes away, or `deadline` passes.
pub async fn relay(
    client: &mut Conn,
    upstream: &mut Conn,
    head: &ResponseHead,
    worker_url: &str,
    client_keep_alive: bool,
    deadline: Instant,
) -> RelayEnd {
    let headers: Vec<(String, Vec<u8>)> = head
        .headers
        .iter()
        .filter(|(n, _)| !http1::is_hop_by_hop(n))
        .cloned()
        .collect();
    let mut extra: Vec<(&str, &[u8])> = vec![("x-kvroute-worker", worker_url.as_bytes())];
    if !client_keep_alive {
        extra.push(("connection", b"close"));
    }
    let mut out = Vec::with_capacity(RELAY_READ_BYTES);
    http1::write_response_head(
        &mut out,
        head.status,
        &head.reason,
        &headers,
        head.framing,
        &extra,
    );

    let mut body = Body::new(head.framing);
    // Body bytes that arrived with the head go out in the same write as the head.
    let first = upstream.take_buffered();
    let status = body.push(&first, &mut out);
    let mut upstream_ok = head.keep_alive;
    match status {
        Ok(true) => {}
        Ok(false) => upstream_ok = false, // surplus bytes after the body
        Err(()) => return finish_failed(client, out).await,
    }
    let (res, returned) = client.write_all(out).await;
    if res.is_err() {
        return RelayEnd::ClientGone;
    }
    let mut out = returned;
    let mut read_buf = Vec::with_capacity(RELAY_READ_BYTES);
    while !body.done() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return RelayEnd::UpstreamFailed;
        }
        read_buf.clear();
        let cap = read_buf.capacity();
        let (res, slice) =
            match monoio::time::timeout(left, upstream.stream.read(read_buf.slice_mut(0..cap)))
                .await
            {
                Ok(r) => r,
                Err(_) => return RelayEnd::UpstreamFailed,
            };
        read_buf = slice.into_inner();
        let n = match res {
            Ok(n) => n,
            Err(_) => return RelayEnd::UpstreamFailed,
        };
        out.clear();
        if n == 0 {
            if body.framing == Framing::UntilClose {
                out.extend_from_slice(b"0\r\n\r\n");
                body.finished = true;
                upstream_ok = false;
            } else {
                return RelayEnd::UpstreamFailed;
            }
        } else {
            match body.push(&read_buf[..n], &mut out) {
                Ok(true) => {}
                Ok(false) => upstream_ok = false,
                Err(()) => return RelayEnd::UpstreamFailed,
            }
        }
        let (res, returned) = client.write_all(out).await;
        out = returned;
        if res.is_err() {
            return RelayEnd::ClientGone;
        }
    }
    RelayEnd::Complete {
        reusable: upstream_ok,
    }
}

async fn finish_failed(client: &mut Conn, out: Vec<u8>) -> RelayEnd {
    // The head is already decided; send what we have and close.
    let _ = client.write_all(out).await;
    RelayEnd::UpstreamFailed
}

/// Tracks where a response body ends while its bytes are copied to the client.
struct Body {
    framing: Framing,
    remaining: u64,
    chunked: ChunkedDecoder,
    finished: bool,
}

impl Body {
    fn new(framing: Framing) -> Self {
        let remaining = match framing {
            Framing::Length(n) => n,
            _ => 0,
        };
        Self {
            framing,
            remaining,
            chunked: ChunkedDecoder::new(),
            finished: matches!(framing, Framing::Empty | Framing::Length(0)),
        }
    }

    fn done(&self) -> bool {
        self.finished
    }

    /// Copies the body part of `input` to `out` (re-framing an until-close body as chunks).
    /// Returns `Ok(false)` when `input` held bytes past the end of the body (the worker
    /// connection is then not reusable), `Err` on a framing error.
    fn push(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<bool, ()> {
        if input.is_empty() {
            return Ok(true);
        }
        match self.framing {
            Framing::Empty => Ok(false),
            Framing::Length(_) => {
                let take = (self.remaining as usize).min(input.len());
                out.extend_from_slice(&input[..take]);
                self.remaining -= take as u64;
                self.finished = self.remaining == 0;
                Ok(take == input.len())
            }
            Framing::Chunked => {
                let used = self.chunked.feed(input, None).map_err(|_| ())?;
                out.extend_from_slice(&input[..used]);
                self.finished = self.chunked.is_done();
                Ok(used == input.len())
            }
            Framing::UntilClose => {
                out.extend_from_slice(format!("{:x}\r\n", input.len()).as_bytes());
                out.extend_from_slice(input);
                out.extend_from_slice(b"\r\n");
                Ok(true)
            }
        }
    }
}
