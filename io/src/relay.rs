//! Relay of a worker's response to the client's [`ResponseSink`], as the bytes arrive.
//!
//! The worker's body framing is decoded here (a chunked SSE stream yields its data, chunk by
//! chunk) and the data goes to the sink, which frames it for the client's transport: HTTP/1.1
//! re-chunks each piece as it came, so SSE events reach the client as the worker sent them.
//! kvroute keeps the body's last [`USAGE_TAIL_BYTES`] to read its `usage` (prompt and cached
//! tokens) once it has ended. Backpressure is structural: the next read from the worker
//! starts only after the previous bytes were written to the client, so a slow client holds at
//! most one read buffer (16 KiB) of the response in the router (bug-cases.md B41). A failed
//! client write drops the worker connection, which closes the upstream request: the engine
//! sees the disconnect and aborts.

use crate::conn::Conn;
use crate::http1::{ChunkedDecoder, Framing, ResponseHead};
use crate::message::{BodyKind, HeaderLine, ResponseSink};
use crate::migrate::StreamTracker;
use crate::record::Record;
use kvroute_core::workers::LoadGuard;
use monoio::buf::IoBufMut;
use monoio::io::AsyncReadRent;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How a relay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayEnd {
    /// The whole body reached the client. `reusable`: the worker connection may be pooled.
    Complete {
        /// The worker connection ended cleanly and may serve another request.
        reusable: bool,
        /// The response's `usage` token counts, when its last [`USAGE_TAIL_BYTES`] held them.
        usage: Option<Usage>,
    },
    /// The client went away (write failed); the worker connection was dropped.
    ClientGone,
    /// The worker failed mid-body (closed, reset, broken framing); nothing ended the
    /// client's body yet.
    UpstreamFailed {
        /// The response is an SSE stream (`text/event-stream`): it can be ended cleanly with
        /// an error event.
        sse: bool,
        /// The worker sent nothing for [`Limits::idle`] (else its connection broke or its
        /// body was invalid).
        stalled: bool,
    },
    /// The whole-exchange deadline (`--request-timeout-secs`) passed mid-body: the router's
    /// limit, not the worker's fault (no breaker failure, no migration).
    TimedOut {
        /// As for [`RelayEnd::UpstreamFailed`].
        sse: bool,
    },
    /// The shutdown grace passed mid-body ([`Limits::cutting`]): the router's end too.
    Cut {
        /// As for [`RelayEnd::UpstreamFailed`].
        sse: bool,
    },
}

/// When a relay stops waiting for the worker.
#[derive(Clone, Copy, Debug)]
pub struct Limits<'a> {
    /// The whole exchange's end (`--request-timeout-secs` after the request arrived):
    /// [`RelayEnd::TimedOut`].
    pub deadline: Instant,
    /// Longest wait for the worker's next bytes (`--stream-idle-timeout-secs`):
    /// [`RelayEnd::UpstreamFailed`] with `stalled`. Bounding the one read timeout each wait
    /// already has, it costs no timer of its own.
    pub idle: Duration,
    /// Set once the shutdown grace has passed ([`crate::state::Shared::cutting`]): read
    /// between two waits, [`RelayEnd::Cut`].
    pub cutting: &'a AtomicBool,
}

/// Size of one relay read, in bytes.
const RELAY_READ_BYTES: usize = 16 * 1024;

/// Bytes kept from the end of a response body to read its `usage` object: vLLM and SGLang put
/// it in the last SSE event before `data: [DONE]` (with `stream_options.include_usage`) or near
/// the end of a JSON body, a few hundred bytes either way.
pub const USAGE_TAIL_BYTES: usize = 4 * 1024;

/// Token counts of an OpenAI-style `usage` object, tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens the engine served from its
    /// prefix cache.
    pub cached_tokens: u64,
}

impl Usage {
    /// The last `"prompt_tokens"` and `"cached_tokens"` numbers in `tail` (the end of a body,
    /// chunk framing and SSE included). `None` unless both are present as plain integers: a
    /// `null` `cached_tokens` (prefix caching off) or a usage cut by [`USAGE_TAIL_BYTES`] is
    /// no report, and so is a response without the field (vLLM sends it only with
    /// `--enable-prompt-tokens-details`, SGLang only with `--enable-cache-report`,
    /// engine-model.md §6). A number split by a chunk-size line (an SSE event spread over two HTTP
    /// chunks, which vLLM and SGLang do not send) reads short or as absent.
    pub fn parse(tail: &[u8]) -> Option<Self> {
        use memchr::memmem::Finder;
        use std::sync::LazyLock;
        // The last occurrence, found forwards with searchers built once: `memmem::rfind`
        // builds its searcher on every call and scans with two-way (no SIMD), ~2.6k of the
        // ~68k instructions of a proxied request for these two keys (callgrind,
        // perf/runs/2026-12-01-proxy; `memrchr_iter` on `"` and a plain backward scan cost
        // more). Each search restarts one byte after the last match, so overlapping
        // occurrences count as `rfind`'s do.
        static PROMPT: LazyLock<Finder<'static>> =
            LazyLock::new(|| Finder::new(b"\"prompt_tokens\""));
        static CACHED: LazyLock<Finder<'static>> =
            LazyLock::new(|| Finder::new(b"\"cached_tokens\""));
        let rfind = |finder: &Finder<'static>| {
            let mut last = None;
            let mut from = 0;
            while let Some(i) = finder.find(&tail[from..]) {
                last = Some(from + i);
                from += i + 1;
            }
            last
        };
        let number = |finder: &Finder<'static>| -> Option<u64> {
            let at = rfind(finder)? + finder.needle().len();
            let rest = tail[at..].trim_ascii_start().strip_prefix(b":")?;
            let rest = rest.trim_ascii_start();
            let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
            std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
        };
        Some(Self {
            prompt_tokens: number(&PROMPT)?,
            cached_tokens: number(&CACHED)?,
        })
    }
}

/// The last [`USAGE_TAIL_BYTES`] bytes pushed (kept in a buffer of at most twice that, so a
/// push moves at most [`USAGE_TAIL_BYTES`] bytes).
#[derive(Debug, Default)]
struct Tail(Vec<u8>);

impl Tail {
    fn push(&mut self, bytes: &[u8]) {
        let bytes = &bytes[bytes.len().saturating_sub(USAGE_TAIL_BYTES)..];
        if self.0.len() + bytes.len() > 2 * USAGE_TAIL_BYTES {
            let keep = USAGE_TAIL_BYTES - bytes.len();
            self.0.drain(..self.0.len() - keep);
        }
        self.0.extend_from_slice(bytes);
    }

    fn last(&self) -> &[u8] {
        &self.0[self.0.len().saturating_sub(USAGE_TAIL_BYTES)..]
    }
}

/// How a worker's body framing reaches the client.
pub fn body_kind(framing: Framing) -> BodyKind {
    match framing {
        Framing::Empty => BodyKind::Length(0),
        Framing::Length(n) => BodyKind::Length(n),
        Framing::Chunked | Framing::UntilClose => BodyKind::Stream,
    }
}

/// True when `head` announces an SSE stream.
pub fn is_sse(head: &ResponseHead) -> bool {
    head.headers
        .get("content-type")
        .is_some_and(|v| v.starts_with(b"text/event-stream"))
}

/// The SSE end of a stream whose worker failed: an OpenAI-style error event (the OpenAI SDKs
/// raise `APIError` on a data event with an `error` key) and `data: [DONE]`.
pub fn sse_error_event(status: u16, message: &str) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    out.extend_from_slice(&crate::error::error_body(status, message));
    out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    out
}

/// Writes the response head (`headers`: end-to-end headers already chosen) and relays the
/// body ([`relay_body`]).
// The head's parts plus relay_body's: bundling them would only rename the same arguments.
#[allow(clippy::too_many_arguments)]
pub async fn relay(
    sink: &mut impl ResponseSink,
    upstream: &mut Conn,
    head: &ResponseHead,
    headers: &[HeaderLine<'_>],
    limits: Limits<'_>,
    rec: &mut Record<'_>,
    tracker: Option<&mut StreamTracker>,
    load: Option<&LoadGuard>,
) -> RelayEnd {
    if sink
        .send_head(head.status, headers, body_kind(head.framing))
        .await
        .is_err()
    {
        return RelayEnd::ClientGone;
    }
    relay_body(sink, upstream, head, limits, rec, tracker, load).await
}

/// Relays the body of `head` until it ends, the client goes away, or `limits` end it. The
/// first body bytes are already in `upstream`'s buffer (the exchange held the head until
/// they came). With a `tracker` (migration on), data passes through it event by event. A
/// complete relay reports the body's [`Usage`]; `rec` gets the TTFT and the response-side
/// latency of the first bytes, and `load` (the request's load guard) its first token then:
/// the first body bytes relayed (an SSE stream's first data event, or the first byte of a
/// whole response), when its booked prefill ends.
pub async fn relay_body(
    sink: &mut impl ResponseSink,
    upstream: &mut Conn,
    head: &ResponseHead,
    limits: Limits<'_>,
    rec: &mut Record<'_>,
    mut tracker: Option<&mut StreamTracker>,
    mut load: Option<&LoadGuard>,
) -> RelayEnd {
    let arrived = Instant::now();
    let sse = is_sse(head);
    let mut body = Body::new(head.framing);
    let mut tail = Tail::default();
    let mut upstream_ok = head.keep_alive;
    // Sized by what passes through them (a whole small response allocates a few hundred
    // bytes, not a read buffer's worth), then reused event after event.
    let mut out = Vec::new();
    let mut data = Vec::new();
    let mut pending = upstream.take_buffered();
    loop {
        out.clear();
        if !pending.is_empty() {
            data.clear();
            match body.push(&pending, &mut data) {
                Ok(true) => {}
                Ok(false) => upstream_ok = false, // surplus bytes after the body
                Err(()) => {
                    let _ = sink.flush().await;
                    return RelayEnd::UpstreamFailed {
                        sse,
                        stalled: false,
                    };
                }
            }
            tail.push(&data);
            match tracker.as_deref_mut() {
                Some(t) => t.filter(&data, &mut out),
                None => std::mem::swap(&mut out, &mut data),
            }
            if !out.is_empty() {
                let (res, returned) = sink.send_data(std::mem::take(&mut out)).await;
                out = returned;
                if res.is_err() {
                    return RelayEnd::ClientGone;
                }
                if rec.ttft.is_none() {
                    rec.ttft = Some(rec.received.elapsed());
                    rec.response_added = Some(arrived.elapsed());
                }
                if let Some(g) = load.take() {
                    g.first_token_now();
                }
            }
        }
        if body.done() {
            break;
        }
        // A head still held (no body bytes passed yet, e.g. a migration tracker holding a
        // partial event) goes out before waiting on the worker, as it did unbuffered.
        if sink.flush().await.is_err() {
            return RelayEnd::ClientGone;
        }
        let left = limits.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return RelayEnd::TimedOut { sse };
        }
        if limits.cutting.load(Ordering::Relaxed) {
            return RelayEnd::Cut { sse };
        }
        let wait = left.min(limits.idle);
        pending.clear();
        pending.reserve(RELAY_READ_BYTES);
        let cap = pending.capacity();
        let (res, slice) = match monoio::time::timeout(
            wait,
            upstream.stream.read(pending.slice_mut(0..cap)),
        )
        .await
        {
            Ok(r) => r,
            Err(_) if wait < left => return RelayEnd::UpstreamFailed { sse, stalled: true },
            Err(_) => return RelayEnd::TimedOut { sse },
        };
        pending = slice.into_inner();
        match res {
            Ok(0) if body.framing == Framing::UntilClose => {
                body.finished = true;
                upstream_ok = false;
            }
            Ok(0) | Err(_) => {
                return RelayEnd::UpstreamFailed {
                    sse,
                    stalled: false,
                };
            }
            Ok(_) => {}
        }
    }
    // The read buffer goes back to the connection, for its next response if it is reused.
    upstream.restore_buffer(pending);
    if sink.finish().await.is_err() {
        return RelayEnd::ClientGone;
    }
    RelayEnd::Complete {
        reusable: upstream_ok,
        usage: Usage::parse(tail.last()),
    }
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

    /// Appends the body data in `input` to `out` (chunk framing removed). Returns
    /// `Ok(false)` when `input` held bytes past the end of the body (the worker connection is
    /// then not reusable), `Err` on a framing error.
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
                let used = self.chunked.feed(input, Some(out)).map_err(|_| ())?;
                self.finished = self.chunked.is_done();
                Ok(used == input.len())
            }
            Framing::UntilClose => {
                out.extend_from_slice(input);
                Ok(true)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's last streamed event with `stream_options.include_usage`, chunk-framed.
    const VLLM_END: &str = "5e\r\ndata: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"prompt_tokens\"}}]}\n\n\r\n\
        a1\r\ndata: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\": 8211,\"total_tokens\":8311,\
        \"completion_tokens\":100,\"prompt_tokens_details\":{\"cached_tokens\":7168}}}\n\n\r\n\
        e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n";

    #[test]
    fn usage_of_a_streamed_and_a_json_response() {
        let want = Usage {
            prompt_tokens: 8211,
            cached_tokens: 7168,
        };
        assert_eq!(Usage::parse(VLLM_END.as_bytes()), Some(want));
        let json = br#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":0},"completion_tokens":3}}"#;
        assert_eq!(
            Usage::parse(json),
            Some(Usage {
                prompt_tokens: 12,
                cached_tokens: 0
            })
        );
    }

    #[test]
    fn no_usage_without_both_numbers() {
        let null = br#"{"usage":{"prompt_tokens":12,"prompt_tokens_details":null}}"#;
        assert_eq!(Usage::parse(null), None);
        let off =
            br#"{"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":null}}}"#;
        assert_eq!(Usage::parse(off), None);
        assert_eq!(Usage::parse(b"data: [DONE]\n\n"), None);
        assert_eq!(Usage::parse(br#"{"cached_tokens":"#), None);
    }

    /// The tail equals the last `USAGE_TAIL_BYTES` of everything pushed, for pushes of every
    /// size around the limit (brute force against the concatenation).
    #[test]
    fn tail_keeps_the_last_bytes() {
        let sizes = [
            1,
            7,
            200,
            USAGE_TAIL_BYTES - 1,
            USAGE_TAIL_BYTES,
            USAGE_TAIL_BYTES + 3,
        ];
        for (k, &a) in sizes.iter().enumerate() {
            for &b in &sizes[k..] {
                let mut tail = Tail::default();
                let mut all = Vec::new();
                for i in 0..40u32 {
                    let n = if i % 2 == 0 { a } else { b };
                    let piece: Vec<u8> = (0..n).map(|j| (i as usize * 31 + j) as u8).collect();
                    tail.push(&piece);
                    all.extend_from_slice(&piece);
                    assert_eq!(
                        tail.last(),
                        &all[all.len().saturating_sub(USAGE_TAIL_BYTES)..]
                    );
                    assert!(tail.0.len() <= 2 * USAGE_TAIL_BYTES);
                }
            }
        }
        // A usage object split over two reads is whole in the tail.
        let cut = VLLM_END.find("cached_").unwrap() + 4;
        let (x, y) = VLLM_END.as_bytes().split_at(cut);
        let mut tail = Tail::default();
        tail.push(x);
        tail.push(y);
        assert_eq!(
            Usage::parse(tail.last()).map(|u| u.cached_tokens),
            Some(7168)
        );
    }
}
