//! KV-event subscriber: libzmq SUB sockets on every (worker, DP rank) publisher, a DEALER per
//! replay endpoint, and one index writer (issue 5; `kv-events.md` §1–§2).
//!
//! Two threads:
//! - `kv-sub` polls every SUB socket (100 ms) and hands each message `(stream, seq, payload)`
//!   to the writer over a crossbeam channel (the cross-thread ring). libzmq reconnects
//!   dropped connections itself, with exponential backoff from [`RECONNECT_IVL_MS`] to
//!   [`RECONNECT_IVL_MAX_MS`].
//! - `kv-writer` runs the pure [`Consumer`] (ordering, gaps, restarts) and applies to the
//!   [`EventIndex`] (its mutex guards only the writer side and the counters: the router
//!   reads the index through a lock-free [`kvroute_core::events::EventReader`]). It stamps
//!   blocks with its own clock and prunes every [`defaults::KV_INDEXER_PRUNE_EVERY_MS`]
//!   when a TTL or entry cap is set. When the consumer asks for a replay it sends
//!   `["", start_seq]` on that stream's DEALER and feeds replies until the end marker, each
//!   read bounded by [`REPLAY_READ_TIMEOUT_MS`]; live messages wait in the channel meanwhile.
//!
//! Both threads end once the gateway state that holds the writer side is gone (the writer
//! thread then holds the only reference) — no handle to keep.

use kvroute_core::config::{WorkerSpec, defaults};
use kvroute_core::events::decode::{self, ReplayFrames};
use kvroute_core::events::{Consumer, EventIndex, Input, StreamId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Writer side of the event index: the `kv-writer` thread applies events, `/metrics` and
/// `/admin` read counters. Routing never takes this lock.
pub type SharedEvents = Arc<Mutex<EventIndex>>;

/// Locks the writer side (a panic elsewhere never poisons the counters for good).
pub fn lock(index: &SharedEvents) -> MutexGuard<'_, EventIndex> {
    index.lock().unwrap_or_else(|p| p.into_inner())
}

/// First reconnect delay, ms (libzmq `ZMQ_RECONNECT_IVL`).
pub const RECONNECT_IVL_MS: i32 = 100;
/// Reconnect backoff cap, ms (libzmq `ZMQ_RECONNECT_IVL_MAX`).
pub const RECONNECT_IVL_MAX_MS: i32 = 5_000;
/// Time allowed for each replay reply, ms; a silent engine ends the replay (→ clear).
pub const REPLAY_READ_TIMEOUT_MS: i32 = 1_000;
/// SUB receive high-water mark, messages (the engines' `hwm`).
pub const SUB_HWM: i32 = 100_000;
/// Messages queued between the subscriber and the writer.
pub const CHANNEL_CAPACITY: usize = 100_000;

/// One publisher to subscribe to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSource {
    /// (worker id, DP rank).
    pub stream: StreamId,
    /// PUB endpoint, `tcp://host:port`.
    pub events: String,
    /// Replay ROUTER endpoint, if any.
    pub replay: Option<String>,
}

/// Every publisher of `specs` (worker id = position): ranks `0..dp` on port + rank.
pub fn sources(specs: &[WorkerSpec]) -> Vec<EventSource> {
    specs
        .iter()
        .enumerate()
        .flat_map(|(w, spec)| sources_of(w, spec))
        .collect()
}

/// The publishers of worker `id` with `spec`: ranks `0..dp` on port + rank (none without
/// `events`).
pub fn sources_of(id: usize, spec: &WorkerSpec) -> Vec<EventSource> {
    let Some(events) = &spec.events else {
        return Vec::new();
    };
    (0..spec.dp)
        .filter_map(|rank| {
            Some(EventSource {
                stream: StreamId {
                    worker: id as u32,
                    rank,
                },
                events: WorkerSpec::rank_endpoint(events, rank)?,
                replay: spec
                    .replay
                    .as_deref()
                    .and_then(|r| WorkerSpec::rank_endpoint(r, rank)),
            })
        })
        .collect()
}

struct Live {
    stream: StreamId,
    frames: Vec<Vec<u8>>,
}

fn zerr(e: ::zmq::Error) -> std::io::Error {
    std::io::Error::other(format!("zmq: {e}"))
}

/// A running subscription (one [`start`]): [`Subscription::cancel`] stops its threads
/// within ~100 ms (bug-cases.md B35: a removed worker's engine is never contacted again).
/// Dropping the handle does not stop it; the threads also end once the gateway's index is
/// dropped.
#[derive(Debug, Clone)]
pub struct Subscription {
    stop: Arc<AtomicBool>,
}

impl Subscription {
    /// Stops the subscriber (its sockets close) and then the writer.
    pub fn cancel(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// True once cancelled, or once its writer ended.
    pub fn is_stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// Starts the subscriber and writer threads for `sources`, applying to `index`; after each
/// applied message the writer tells `worker` (held weakly) how many blocks its engine caches
/// ([`kvroute_core::workers::Worker::set_cached_blocks`]), for predicted_ttft's eviction
/// charge.
///
/// # Errors
/// A socket cannot be created or configured, an endpoint is invalid, or a thread cannot be
/// spawned. (An unreachable engine is not an error: libzmq keeps reconnecting.)
pub fn start(
    sources: Vec<EventSource>,
    index: SharedEvents,
    worker: std::sync::Weak<kvroute_core::workers::Worker>,
) -> std::io::Result<Subscription> {
    let ctx = ::zmq::Context::new();
    let mut subs = Vec::new();
    for s in &sources {
        let sock = ctx.socket(::zmq::SUB).map_err(zerr)?;
        sock.set_rcvhwm(SUB_HWM).map_err(zerr)?;
        sock.set_reconnect_ivl(RECONNECT_IVL_MS).map_err(zerr)?;
        sock.set_reconnect_ivl_max(RECONNECT_IVL_MAX_MS)
            .map_err(zerr)?;
        sock.set_linger(0).map_err(zerr)?;
        sock.set_subscribe(b"").map_err(zerr)?;
        sock.connect(&s.events).map_err(zerr)?;
        subs.push((s.stream, sock));
    }
    let mut dealers = HashMap::new();
    let mut consumer = Consumer::new();
    for s in &sources {
        consumer.add_stream(s.stream, s.replay.is_some());
        if let Some(r) = &s.replay {
            let d = ctx.socket(::zmq::DEALER).map_err(zerr)?;
            d.set_rcvtimeo(REPLAY_READ_TIMEOUT_MS).map_err(zerr)?;
            // A whole replay (the engine's buffer, 10,000 batches) may queue here.
            d.set_rcvhwm(SUB_HWM).map_err(zerr)?;
            d.set_linger(0).map_err(zerr)?;
            d.set_reconnect_ivl(RECONNECT_IVL_MS).map_err(zerr)?;
            d.set_reconnect_ivl_max(RECONNECT_IVL_MAX_MS)
                .map_err(zerr)?;
            d.connect(r).map_err(zerr)?;
            dealers.insert(s.stream, d);
        }
    }
    let (tx, rx) = crossbeam_channel::bounded::<Live>(CHANNEL_CAPACITY);
    let stop = Arc::new(AtomicBool::new(false));
    let handle = Subscription { stop: stop.clone() };
    let sub_ctx = ctx.clone();
    let sub_stop = stop.clone();
    // The writer holds the index weakly: it ends once the gateway drops it, however many
    // subscriptions share it.
    let index = Arc::downgrade(&index);
    std::thread::Builder::new()
        .name("kv-sub".into())
        .spawn(move || {
            let _ctx = sub_ctx;
            subscribe(subs, tx, &sub_stop);
        })?;
    std::thread::Builder::new()
        .name("kv-writer".into())
        .spawn(move || {
            let _ctx = ctx;
            write(rx, consumer, dealers, index, worker);
            stop.store(true, Ordering::Relaxed);
        })?;
    Ok(handle)
}

/// Polls every SUB socket; ends when the writer is gone.
fn subscribe(
    subs: Vec<(StreamId, ::zmq::Socket)>,
    tx: crossbeam_channel::Sender<Live>,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::Relaxed) {
        let mut items: Vec<_> = subs
            .iter()
            .map(|(_, s)| s.as_poll_item(::zmq::POLLIN))
            .collect();
        if ::zmq::poll(&mut items, 100).is_err() {
            return;
        }
        let ready: Vec<bool> = items.iter().map(|i| i.is_readable()).collect();
        drop(items);
        for (i, (stream, s)) in subs.iter().enumerate() {
            if !ready[i] {
                continue;
            }
            // Drain what is queued on this socket (bounded per round for fairness).
            for _ in 0..1024 {
                match s.recv_multipart(::zmq::DONTWAIT) {
                    Ok(frames) => {
                        if tx
                            .send(Live {
                                stream: *stream,
                                frames,
                            })
                            .is_err()
                        {
                            return;
                        }
                    }
                    Err(_) => break,
                }
            }
        }
    }
}

/// The index writer: ordering, replays, application. Ends when the gateway dropped the index
/// or the subscriber stopped.
fn write(
    rx: crossbeam_channel::Receiver<Live>,
    mut consumer: Consumer,
    dealers: HashMap<StreamId, ::zmq::Socket>,
    index: std::sync::Weak<Mutex<EventIndex>>,
    worker: std::sync::Weak<kvroute_core::workers::Worker>,
) {
    let started = Instant::now();
    let mut last_prune = 0u64;
    loop {
        let Some(index) = index.upgrade() else {
            return;
        };
        let now = started.elapsed().as_millis() as u64;
        {
            let mut ix = lock(&index);
            ix.set_now(now);
            if ix.prunes() && now - last_prune >= defaults::KV_INDEXER_PRUNE_EVERY_MS {
                last_prune = now;
                let n = ix.prune(now);
                if n > 0 {
                    tracing::info!(blocks = n, "KV event index pruned");
                }
            }
        }
        let live = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(l) => l,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        };
        let stream = live.stream;
        let frames = match decode::split_live(&live.frames) {
            Ok(f) => f,
            Err(e) => {
                let mut ix = lock(&index);
                ix.stats_mut(stream).decode_errors += 1;
                tracing::warn!(
                    worker = stream.worker,
                    rank = stream.rank,
                    "bad KV event message: {e}"
                );
                continue;
            }
        };
        let replay = {
            let mut ix = lock(&index);
            let r = consumer.handle(
                &mut ix,
                stream,
                Input::Live {
                    seq: frames.seq,
                    payload: frames.payload,
                },
            );
            if let Some(w) = worker.upgrade() {
                w.set_cached_blocks(Some(ix.worker_blocks(stream.worker) as u64));
            }
            r
        };
        if let Some(start) = replay {
            run_replay(&mut consumer, dealers.get(&stream), &index, stream, start);
        }
    }
}

/// Sends one replay request and feeds the replies, then the end (also on timeout or error).
fn run_replay(
    consumer: &mut Consumer,
    dealer: Option<&::zmq::Socket>,
    index: &SharedEvents,
    stream: StreamId,
    start: u64,
) {
    tracing::info!(
        worker = stream.worker,
        rank = stream.rank,
        start,
        "KV event gap: replaying"
    );
    let started = std::time::Instant::now();
    let mut replayed = 0usize;
    if let Some(d) = dealer {
        // Replies left over from an earlier, timed-out replay are stale.
        while d.recv_multipart(::zmq::DONTWAIT).is_ok() {}
        if d.send_multipart([&b""[..], &start.to_be_bytes()], 0)
            .is_ok()
        {
            // Bounded by the engine's buffer (10,000) plus slack.
            for _ in 0..20_000 {
                let Ok(frames) = d.recv_multipart(0) else {
                    tracing::warn!(worker = stream.worker, "KV event replay timed out");
                    break;
                };
                match decode::split_replay(&frames) {
                    Ok(ReplayFrames::Batch { seq, payload }) => {
                        let mut ix = lock(index);
                        consumer.handle(&mut ix, stream, Input::Replay { seq, payload });
                        replayed += 1;
                    }
                    Ok(ReplayFrames::End) => break,
                    Err(e) => {
                        let mut ix = lock(index);
                        ix.stats_mut(stream).decode_errors += 1;
                        tracing::warn!(worker = stream.worker, "bad replay reply: {e}");
                    }
                }
            }
        }
    }
    let mut ix = lock(index);
    consumer.handle(&mut ix, stream, Input::ReplayEnd);
    tracing::info!(
        worker = stream.worker,
        rank = stream.rank,
        batches = replayed,
        ms = started.elapsed().as_millis() as u64,
        "KV event replay done"
    );
}
