//! KV-event publishing of the simulated engine in vLLM's wire format (`kv-events.md` §1–§4,
//! `engine-model.md` §5, §8).
//!
//! - [`encode_batch`]: one step's [`BlockEvent`]s → msgpack `[ts, events, dp_rank]`, events as
//!   legacy tagged arrays (vLLM ≤ v0.23: `BlockStored` with 9 fields) or tagged maps (v0.26),
//!   byte-identical to msgspec (golden bytes G1, G2).
//! - [`Publisher`]: a thread owning a PUB socket (frames `[topic, seq8 BE, payload]`) and a
//!   replay ROUTER (request `[id, "", start_seq8]` → one `[id, "", seq8, payload]` per buffered
//!   batch, then the end marker `[id, "", ff×8, ""]`), with a buffer of the last
//!   [`KvEventsConfig::buffer_steps`] batches and the faults of [`Faults`].

use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rmpv::Value;

use super::model::BlockEvent;

/// Default PUB port (vLLM `KVEventsConfig.endpoint` `tcp://*:5557`).
pub const EVENTS_PORT: u16 = 5557;
/// Default replay ROUTER port (`replay_endpoint`, 5558 in the docs' example).
pub const REPLAY_PORT: u16 = 5558;
/// Batches kept for replay (vLLM `buffer_steps`).
pub const BUFFER_STEPS: usize = 10_000;
/// PUB send high-water mark, messages (vLLM `hwm`).
pub const HWM: i32 = 100_000;

/// Send high-water mark of the replay ROUTER for a buffer of `buffer_steps` batches, messages:
/// `2 × (buffer_steps + 1)`, so a full replay and its end marker always fit. Source: vLLM
/// `ZmqEventPublisher._replay_hwm`.
pub fn replay_hwm(buffer_steps: usize) -> i32 {
    i32::try_from(2 * (buffer_steps.saturating_add(1))).unwrap_or(i32::MAX)
}

/// How events are encoded inside a batch (`kv-events.md` §3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    /// Legacy tagged arrays (vLLM ≤ v0.23.x): every declared field present.
    #[default]
    Array,
    /// `type`-tagged maps (vLLM ≥ v0.26): nil defaulted fields omitted.
    Map,
}

impl std::fmt::Display for Encoding {
    /// `array` or `map`, as [`FromStr`](std::str::FromStr) reads it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Encoding::Array => "array",
            Encoding::Map => "map",
        })
    }
}

impl std::str::FromStr for Encoding {
    type Err = String;

    /// `array` or `map`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "array" => Ok(Encoding::Array),
            "map" => Ok(Encoding::Map),
            _ => Err(format!("unknown KV event encoding {s:?} (array or map)")),
        }
    }
}

/// Faults injected into the published stream (`engine-model.md` §8). All randomness comes from
/// `seed`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Faults {
    /// Seqs never sent on PUB (still buffered for replay): gaps the consumer must fill.
    pub drop_seqs: Vec<u64>,
    /// Probability (0–1) that any batch is not sent on PUB (still buffered).
    pub drop_probability: f64,
    /// Seqs re-sent right after the next batch (same seq, same bytes): duplicates.
    pub duplicate_seqs: Vec<u64>,
    /// After this many published batches, restart once: the cache is dropped without an event
    /// (the driver does it when idle), the seq restarts at 0 and the replay buffer empties.
    pub restart_after_batches: Option<u64>,
    /// `block_size` written in every `BlockStored` instead of the real one (a lie the consumer
    /// must detect from `token_ids / block_hashes`).
    pub declared_block_size: Option<usize>,
    /// Seed of the drop draw.
    pub seed: u64,
}

/// KV-event publishing of one engine rank.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// Address the PUB binds, `HOST:PORT` (port 0 = any free port).
    pub events_addr: String,
    /// Address the replay ROUTER binds; `None` = no replay socket.
    pub replay_addr: Option<String>,
    /// Event encoding.
    pub encoding: Encoding,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Topic frame of every message.
    pub topic: Vec<u8>,
    /// `data_parallel_rank` stamped in every batch.
    pub dp_rank: u32,
    /// Injected faults.
    pub faults: Faults,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            events_addr: format!("127.0.0.1:{EVENTS_PORT}"),
            replay_addr: Some(format!("127.0.0.1:{REPLAY_PORT}")),
            encoding: Encoding::Array,
            buffer_steps: BUFFER_STEPS,
            topic: Vec::new(),
            dp_rank: 0,
            faults: Faults::default(),
        }
    }
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn hashes(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|&x| Value::from(x)).collect())
}

/// Encodes one event as vLLM does (`kv-events.md` §3.3; GPU medium, group 0, full attention).
/// `block_size` is the value written in `BlockStored`.
pub fn encode_event(e: &BlockEvent, block_size: usize, enc: Encoding) -> Value {
    match (e, enc) {
        (
            BlockEvent::Stored {
                parent,
                hashes: h,
                token_ids,
            },
            Encoding::Array,
        ) => Value::Array(vec![
            s("BlockStored"),
            hashes(h),
            parent.map_or(Value::Nil, Value::from),
            Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
            Value::from(block_size as u64),
            Value::Nil,
            s("GPU"),
            Value::Nil,
            Value::Nil,
            Value::Nil,
        ]),
        (
            BlockEvent::Stored {
                parent,
                hashes: h,
                token_ids,
            },
            Encoding::Map,
        ) => Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), hashes(h)),
            (
                s("parent_block_hash"),
                parent.map_or(Value::Nil, Value::from),
            ),
            (
                s("token_ids"),
                Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
            ),
            (s("block_size"), Value::from(block_size as u64)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
            (s("lora_name"), Value::Nil),
            (s("group_idx"), Value::from(0u64)),
            (s("kv_cache_spec_kind"), s("full_attention")),
        ]),
        (BlockEvent::Removed { hashes: h }, Encoding::Array) => {
            Value::Array(vec![s("BlockRemoved"), hashes(h), s("GPU"), Value::Nil])
        }
        (BlockEvent::Removed { hashes: h }, Encoding::Map) => Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), hashes(h)),
            (s("medium"), s("GPU")),
            (s("group_idx"), Value::from(0u64)),
        ]),
        (BlockEvent::AllCleared, Encoding::Array) => Value::Array(vec![s("AllBlocksCleared")]),
        (BlockEvent::AllCleared, Encoding::Map) => {
            Value::Map(vec![(s("type"), s("AllBlocksCleared"))])
        }
    }
}

/// Encodes one batch `[ts, events, dp_rank]` (`kv-events.md` §3.1) to msgpack bytes.
pub fn encode_batch(
    ts: f64,
    events: &[BlockEvent],
    block_size: usize,
    enc: Encoding,
    dp_rank: u32,
) -> Vec<u8> {
    let v = Value::Array(vec![
        Value::F64(ts),
        Value::Array(
            events
                .iter()
                .map(|e| encode_event(e, block_size, enc))
                .collect(),
        ),
        Value::from(dp_rank),
    ]);
    let mut out = Vec::with_capacity(64 + 8 * events.len());
    rmpv::encode::write_value(&mut out, &v).expect("writing to a Vec cannot fail");
    out
}

/// The batch [`kvroute_core::events::decode::decode_batch`] yields for
/// `encode_batch(ts, events, block_size, _, dp_rank)`, built without the bytes: the
/// simulator's fast path to the router's index (the wire path is kept behind a flag and
/// compared with this one in tests). GPU medium, no LoRA, as [`encode_event`] writes.
pub fn decoded_batch(
    ts: f64,
    events: &[BlockEvent],
    block_size: usize,
    dp_rank: u32,
) -> kvroute_core::events::EventBatch {
    use kvroute_core::events::{BlockRemoved, BlockStored, EventBatch, KvEvent};
    let gpu = || Some("GPU".to_string());
    EventBatch {
        ts,
        events: events
            .iter()
            .map(|e| match e {
                BlockEvent::Stored {
                    parent,
                    hashes,
                    token_ids,
                } => KvEvent::Stored(BlockStored {
                    block_hashes: hashes.clone(),
                    parent_block_hash: *parent,
                    token_ids: token_ids.clone(),
                    block_size,
                    medium: gpu(),
                    // As the map encoding (today's vLLM) sends them.
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                    ..BlockStored::default()
                }),
                BlockEvent::Removed { hashes } => KvEvent::Removed(BlockRemoved {
                    block_hashes: hashes.clone(),
                    medium: gpu(),
                    group_idx: Some(0),
                    ..BlockRemoved::default()
                }),
                BlockEvent::AllCleared => KvEvent::AllCleared,
            })
            .collect(),
        dp_rank: Some(dp_rank),
        skipped_events: 0,
    }
}

/// Messages from the engine driver to the publisher thread.
#[derive(Debug)]
pub enum PublishMsg {
    /// One step's events (non-empty), with the real block size.
    Batch {
        /// Publisher timestamp, s since the epoch.
        ts: f64,
        /// The events.
        events: Vec<BlockEvent>,
        /// Real tokens per block.
        block_size: usize,
    },
    /// The engine restarted: seq back to 0, replay buffer emptied.
    Restart,
}

/// Counters of a publisher, readable while it runs.
#[derive(Debug, Default)]
pub struct PublisherStats {
    /// Batches assigned a seq.
    pub batches: std::sync::atomic::AtomicU64,
    /// Batches not sent on PUB (faults).
    pub dropped: std::sync::atomic::AtomicU64,
    /// Batches sent twice (faults).
    pub duplicated: std::sync::atomic::AtomicU64,
    /// Replay requests served.
    pub replays: std::sync::atomic::AtomicU64,
    /// Restarts done.
    pub restarts: std::sync::atomic::AtomicU64,
}

/// A running publisher thread. Dropping it stops the thread.
#[derive(Debug)]
pub struct Publisher {
    /// Bound PUB endpoint, `tcp://127.0.0.1:PORT`.
    pub events_endpoint: String,
    /// Bound replay endpoint, if any.
    pub replay_endpoint: Option<String>,
    /// Live counters.
    pub stats: std::sync::Arc<PublisherStats>,
    tx: Option<mpsc::Sender<PublishMsg>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Publisher {
    /// Binds the sockets of `cfg` and starts the thread.
    ///
    /// # Errors
    /// A socket cannot be created or bound (address in use, bad address), or the thread
    /// cannot be spawned.
    pub fn start(cfg: KvEventsConfig) -> std::io::Result<Publisher> {
        let zerr = |e: zmq::Error| std::io::Error::other(format!("zmq: {e}"));
        let ctx = zmq::Context::new();
        let pub_sock = ctx.socket(zmq::PUB).map_err(zerr)?;
        pub_sock.set_sndhwm(HWM).map_err(zerr)?;
        pub_sock.set_linger(0).map_err(zerr)?;
        pub_sock
            .bind(&tcp_endpoint(&cfg.events_addr))
            .map_err(zerr)?;
        let events_endpoint = last_endpoint(&pub_sock)?;
        let (router, replay_endpoint) = match &cfg.replay_addr {
            Some(a) => {
                let r = ctx.socket(zmq::ROUTER).map_err(zerr)?;
                r.set_linger(0).map_err(zerr)?;
                // A ROUTER silently drops what exceeds its send HWM (default 1,000), which
                // would cut every replay longer than that into an unrecoverable gap. Queue a
                // full buffer plus the end marker, twice over (libzmq acknowledges reads only
                // every HWM/2 messages), as vLLM's `ZmqEventPublisher` does.
                r.set_sndhwm(replay_hwm(cfg.buffer_steps)).map_err(zerr)?;
                r.bind(&tcp_endpoint(a)).map_err(zerr)?;
                let ep = last_endpoint(&r)?;
                (Some(r), Some(ep))
            }
            None => (None, None),
        };
        let (tx, rx) = mpsc::channel();
        let stats = std::sync::Arc::new(PublisherStats::default());
        let st = stats.clone();
        let name = format!(
            "kv-pub-{}",
            events_endpoint.rsplit(':').next().unwrap_or("")
        );
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            let _ctx = ctx;
            run(cfg, pub_sock, router, rx, &st);
        })?;
        Ok(Publisher {
            events_endpoint,
            replay_endpoint,
            stats,
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// A sender for [`PublishMsg`]s (the engine driver holds one).
    pub fn sender(&self) -> mpsc::Sender<PublishMsg> {
        self.tx.clone().expect("publisher running")
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `HOST:PORT` → `tcp://HOST:PORT`, port 0 → `*` (ephemeral); full endpoints pass through.
fn tcp_endpoint(addr: &str) -> String {
    if addr.contains("://") {
        return addr.to_string();
    }
    match addr.strip_suffix(":0") {
        Some(host) => format!("tcp://{host}:*"),
        None => format!("tcp://{addr}"),
    }
}

fn last_endpoint(s: &zmq::Socket) -> std::io::Result<String> {
    match s.get_last_endpoint() {
        Ok(Ok(ep)) => Ok(ep),
        _ => Err(std::io::Error::other("zmq: no last endpoint")),
    }
}

/// Publisher loop: ends when every sender is dropped.
fn run(
    cfg: KvEventsConfig,
    pub_sock: zmq::Socket,
    router: Option<zmq::Socket>,
    rx: mpsc::Receiver<PublishMsg>,
    stats: &PublisherStats,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.faults.seed);
    let mut buffer: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
    let mut seq: u64 = 0;
    let mut pending_dup: Option<(u64, Vec<u8>)> = None;
    let send = |seq: u64, payload: &[u8]| {
        let frames: [&[u8]; 3] = [&cfg.topic, &seq.to_be_bytes(), payload];
        if let Err(e) = pub_sock.send_multipart(frames, 0) {
            tracing::warn!("kv event publish: {e}");
        }
    };
    loop {
        // Serve replay requests between batches (10 ms poll).
        if let Some(r) = &router {
            let mut items = [r.as_poll_item(zmq::POLLIN)];
            if zmq::poll(&mut items, 0).unwrap_or(0) > 0 {
                serve_replay(r, &buffer, &cfg.topic);
                stats.replays.fetch_add(1, Relaxed);
                continue;
            }
        }
        let msg = match rx.recv_timeout(Duration::from_millis(if router.is_some() {
            5
        } else {
            100
        })) {
            Ok(m) => m,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        match msg {
            PublishMsg::Restart => {
                seq = 0;
                buffer.clear();
                pending_dup = None;
                stats.restarts.fetch_add(1, Relaxed);
            }
            PublishMsg::Batch {
                ts,
                events,
                block_size,
            } => {
                let declared = cfg.faults.declared_block_size.unwrap_or(block_size);
                let payload = encode_batch(ts, &events, declared, cfg.encoding, cfg.dp_rank);
                let this = seq;
                seq += 1;
                stats.batches.fetch_add(1, Relaxed);
                let drop = cfg.faults.drop_seqs.contains(&this)
                    || (cfg.faults.drop_probability > 0.0
                        && rng.random::<f64>() < cfg.faults.drop_probability);
                if drop {
                    stats.dropped.fetch_add(1, Relaxed);
                } else {
                    send(this, &payload);
                }
                if let Some((dseq, dp)) = pending_dup.take() {
                    send(dseq, &dp);
                    stats.duplicated.fetch_add(1, Relaxed);
                }
                if cfg.faults.duplicate_seqs.contains(&this) {
                    pending_dup = Some((this, payload.clone()));
                }
                buffer.push_back((this, payload));
                while buffer.len() > cfg.buffer_steps {
                    buffer.pop_front();
                }
            }
        }
    }
}

/// Answers one replay request: `[id, "", start_seq8]`; anything else is ignored (vLLM).
fn serve_replay(r: &zmq::Socket, buffer: &VecDeque<(u64, Vec<u8>)>, topic: &[u8]) {
    let Ok(frames) = r.recv_multipart(zmq::DONTWAIT) else {
        return;
    };
    let [id, delim, start] = frames.as_slice() else {
        return;
    };
    let (true, Ok(start)) = (delim.is_empty(), <[u8; 8]>::try_from(start.as_slice())) else {
        return;
    };
    let start = u64::from_be_bytes(start);
    // vLLM ≥ v0.26 sends the topic frame too (B23); so do we.
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        let frames: [&[u8]; 5] = [id, b"", topic, &seq.to_be_bytes(), payload];
        let _ = r.send_multipart(frames, 0);
    }
    let end: [&[u8]; 5] = [id, b"", topic, &[0xff; 8], b""];
    let _ = r.send_multipart(end, 0);
}

#[cfg(test)]
mod tests {
    /// The fast path equals the wire: decoding the encoded bytes (array and map encodings)
    /// gives exactly [`decoded_batch`], for root and chained stores, removals and a clear
    /// (the legacy array form carries no group fields: compared without them).
    #[test]
    fn decoded_batch_equals_decoding_the_wire_bytes() {
        let events = vec![
            BlockEvent::Stored {
                parent: None,
                hashes: vec![u64::MAX, 1],
                token_ids: (0..32).collect(),
            },
            BlockEvent::Removed {
                hashes: vec![7, 1 << 63],
            },
            BlockEvent::Stored {
                parent: Some(1),
                hashes: vec![9],
                token_ids: (100..116).collect(),
            },
            BlockEvent::AllCleared,
        ];
        for enc in [Encoding::Array, Encoding::Map] {
            let bytes = encode_batch(12.5, &events, 16, enc, 3);
            let wire = kvroute_core::events::decode::decode_batch(&bytes).unwrap();
            let mut fast = decoded_batch(12.5, &events, 16, 3);
            if enc == Encoding::Array {
                for e in &mut fast.events {
                    match e {
                        kvroute_core::events::KvEvent::Stored(s) => {
                            (s.group_idx, s.kv_cache_spec_kind) = (None, None)
                        }
                        kvroute_core::events::KvEvent::Removed(r) => r.group_idx = None,
                        kvroute_core::events::KvEvent::AllCleared => {}
                    }
                }
            }
            assert_eq!(wire, fast, "{enc:?}");
        }
    }

    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    const B0: u64 = 3_236_607_068_019_569_386;

    fn g1_events() -> Vec<BlockEvent> {
        vec![
            BlockEvent::Stored {
                parent: None,
                hashes: vec![B0],
                token_ids: (1..=16).collect(),
            },
            BlockEvent::Removed { hashes: vec![B0] },
            BlockEvent::AllCleared,
        ]
    }

    /// Our encoder writes msgspec's exact bytes: golden G1 (map events) of `kv-events.md` §4.
    #[test]
    fn map_encoding_is_golden_g1() {
        let g1 = unhex(
            "93cb41d954fc40200000938aa474797065ab426c6f636b53746f726564ac626c
             6f636b5f68617368657391cf2ceabcfae6d332eab1706172656e745f626c6f63
             6b5f68617368c0a9746f6b656e5f696473dc00100102030405060708090a0b0c
             0d0e0f10aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756d
             a3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f6361
             6368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a47479
             7065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf2cea
             bcfae6d332eaa66d656469756da3475055a967726f75705f6964780081a47479
             7065b0416c6c426c6f636b73436c656172656400",
        );
        assert_eq!(
            encode_batch(1_700_000_000.5, &g1_events(), 16, Encoding::Map, 0),
            g1
        );
    }

    /// Golden G2 (legacy array events, `BlockStored` with 9 fields).
    #[test]
    fn array_encoding_is_golden_g2() {
        let g2 = unhex(
            "93cb41d954fc40200000939aab426c6f636b53746f72656491cf2ceabcfae6d3
             32eac0dc00100102030405060708090a0b0c0d0e0f1010c0a3475055c0c0c094
             ac426c6f636b52656d6f76656491cf2ceabcfae6d332eaa3475055c091b0416c
             6c426c6f636b73436c656172656400",
        );
        assert_eq!(
            encode_batch(1_700_000_000.5, &g1_events(), 16, Encoding::Array, 0),
            g2
        );
    }

    /// A replay longer than libzmq's default ROUTER send HWM (1,000) arrives whole: 5,000
    /// batches and the end marker, in order. Before the HWM was raised, the ROUTER silently
    /// dropped everything past ~2,000 queued messages, so a router joining a busy engine saw
    /// an unrecoverable gap (the demo's "unrecoverable 4").
    #[test]
    fn long_replay_is_not_cut_by_the_router_hwm() {
        const N: u64 = 5_000;
        let publisher = Publisher::start(KvEventsConfig {
            events_addr: "127.0.0.1:0".into(),
            replay_addr: Some("127.0.0.1:0".into()),
            ..KvEventsConfig::default()
        })
        .unwrap();
        let tx = publisher.sender();
        for i in 0..N {
            tx.send(PublishMsg::Batch {
                ts: 0.0,
                events: vec![BlockEvent::Removed { hashes: vec![i] }],
                block_size: 16,
            })
            .unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while publisher
            .stats
            .batches
            .load(std::sync::atomic::Ordering::Relaxed)
            < N
        {
            assert!(std::time::Instant::now() < deadline, "publisher stalled");
            std::thread::sleep(Duration::from_millis(10));
        }
        let ctx = zmq::Context::new();
        let d = ctx.socket(zmq::DEALER).unwrap();
        d.set_rcvtimeo(2_000).unwrap();
        d.set_linger(0).unwrap();
        d.connect(publisher.replay_endpoint.as_deref().unwrap())
            .unwrap();
        d.send_multipart([&b""[..], &0u64.to_be_bytes()], 0)
            .unwrap();
        // Let the publisher queue the whole replay before anything is read.
        std::thread::sleep(Duration::from_millis(500));
        let mut seqs = Vec::new();
        let mut ended = false;
        for _ in 0..N + 10 {
            let Ok(frames) = d.recv_multipart(0) else {
                break;
            };
            let seq = u64::from_be_bytes(frames[frames.len() - 2].as_slice().try_into().unwrap());
            if seq == u64::MAX {
                ended = true;
                break;
            }
            seqs.push(seq);
        }
        assert_eq!(seqs.len() as u64, N, "replayed batches");
        assert!(seqs.iter().copied().eq(0..N), "in order, no hole");
        assert!(ended, "end marker");
    }

    #[test]
    fn endpoints() {
        assert_eq!(tcp_endpoint("127.0.0.1:0"), "tcp://127.0.0.1:*");
        assert_eq!(tcp_endpoint("127.0.0.1:5557"), "tcp://127.0.0.1:5557");
        assert_eq!(tcp_endpoint("tcp://*:5557"), "tcp://*:5557");
        assert_eq!("map".parse::<Encoding>(), Ok(Encoding::Map));
        assert!("json".parse::<Encoding>().is_err());
    }
}
