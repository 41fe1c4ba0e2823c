//! The simulated engine's KV events through real ZMQ sockets on loopback, decoded with the
//! router's decoder (`engine-model.md` §9 items 1–2, bug case B38): stores chain per block,
//! root stores carry nil parents, the replay ROUTER serves its buffer (with the topic frame,
//! B23) and the end marker, and the faults produce exactly the gaps, duplicates, restarts and
//! size lies they promise. Every loop is bounded in count and time.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvroute_bench::engine::events::{Encoding, Faults, KvEventsConfig};
use kvroute_bench::engine::{EngineConfig, EngineHandle, spawn};
use kvroute_core::events::decode::{self, ReplayFrames};
use kvroute_core::events::{Consumer, EventIndex, Input, KvEvent, StreamId, Tier};
use kvroute_tokenize::Tokenizer;
use rand::{Rng, SeedableRng};

const STREAM: StreamId = StreamId { worker: 0, rank: 0 };

fn tokenizer() -> Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| Arc::new(Tokenizer::qwen3().expect("embedded qwen3")))
        .clone()
}

fn start(encoding: Encoding, faults: Faults, num_gpu_blocks: usize) -> EngineHandle {
    spawn(
        EngineConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            speedup_ratio: 0.0,
            num_gpu_blocks,
            kv_events: Some(KvEventsConfig {
                events_addr: "127.0.0.1:0".into(),
                replay_addr: Some("127.0.0.1:0".into()),
                encoding,
                topic: b"kv@test".to_vec(),
                faults,
                ..KvEventsConfig::default()
            }),
            ..EngineConfig::default()
        },
        tokenizer(),
    )
    .expect("engine starts")
}

/// One HTTP/1.1 request with `Connection: close`; returns the body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out.split_once("\r\n\r\n").unwrap().1.to_string()
}

fn cached(addr: SocketAddr) -> HashSet<u64> {
    serde_json::from_str::<Vec<u64>>(&http(addr, "GET", "/debug/cached_blocks", ""))
        .unwrap()
        .into_iter()
        .collect()
}

/// Sends `n` completions whose token prompts share prefixes (seeded), one at a time.
fn workload(addr: SocketAddr, n: usize, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let prefixes: Vec<Vec<u32>> = (0..4)
        .map(|p| (0..64).map(|i| 1000 * (p + 1) + i).collect())
        .collect();
    for _ in 0..n {
        let mut prompt = prefixes[rng.random_range(0..prefixes.len())].clone();
        let extra = rng.random_range(1..60);
        prompt.extend((0..extra).map(|_| rng.random_range(10..30_000u32)));
        let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 3});
        http(addr, "POST", "/v1/completions", &body.to_string());
    }
}

fn sub(ctx: &zmq::Context, endpoint: &str) -> zmq::Socket {
    let s = ctx.socket(zmq::SUB).unwrap();
    s.set_subscribe(b"").unwrap();
    s.set_rcvtimeo(200).unwrap();
    s.connect(endpoint).unwrap();
    // Slow-joiner: give the subscription time to reach the PUB before anything is published.
    std::thread::sleep(Duration::from_millis(300));
    s
}

/// Receives live messages until `quiet` passes with nothing (at most 20,000 and 20 s).
fn drain(s: &zmq::Socket, quiet: Duration) -> Vec<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = Instant::now();
    while out.len() < 20_000 && Instant::now() < deadline {
        match s.recv_multipart(0) {
            Ok(m) => {
                out.push(m);
                last = Instant::now();
            }
            Err(_) if last.elapsed() >= quiet => break,
            Err(_) => {}
        }
    }
    out
}

/// Asks the replay ROUTER for everything from `start`; returns the replies up to the end marker.
fn replay(ctx: &zmq::Context, endpoint: &str, start: u64) -> Vec<(u64, Vec<u8>)> {
    let d = ctx.socket(zmq::DEALER).unwrap();
    d.set_rcvtimeo(2_000).unwrap();
    d.set_linger(0).unwrap();
    d.connect(endpoint).unwrap();
    d.send_multipart([&b""[..], &start.to_be_bytes()], 0)
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..20_000 {
        let frames = d
            .recv_multipart(0)
            .expect("replay reply before the timeout");
        match decode::split_replay(&frames).unwrap() {
            ReplayFrames::Batch { seq, payload } => out.push((seq, payload.to_vec())),
            ReplayFrames::End => return out,
        }
    }
    panic!("no end marker");
}

/// §9 items 1–2 and B38: every published batch decodes; stores are per block and chain to a
/// block the engine has announced; roots carry nil parents; seqs count from 0; replaying the
/// events into the router's index gives exactly the engine's cached set (with evictions).
#[test]
fn published_events_decode_chain_and_equal_the_cache() {
    for encoding in [Encoding::Map, Encoding::Array] {
        let e = start(encoding, Faults::default(), 40);
        let ctx = zmq::Context::new();
        let s = sub(&ctx, e.kv_events_endpoint.as_deref().unwrap());
        workload(e.addr, 40, 7);
        let msgs = drain(&s, Duration::from_millis(500));
        assert!(msgs.len() >= 10, "only {} batches", msgs.len());
        let mut known: HashSet<u64> = HashSet::new();
        let (mut stores, mut removals, mut roots) = (0, 0, 0);
        let mut index = EventIndex::new(16);
        for (i, m) in msgs.iter().enumerate() {
            let live = decode::split_live(m).unwrap();
            assert_eq!(live.topic, b"kv@test");
            assert_eq!(live.seq, i as u64, "seqs count from 0 without holes");
            let batch = decode::decode_batch(live.payload).unwrap();
            assert_eq!(batch.dp_rank, Some(0));
            assert_eq!(batch.skipped_events, 0);
            assert!(!batch.events.is_empty(), "empty steps publish nothing");
            for ev in &batch.events {
                match ev {
                    KvEvent::Stored(st) => {
                        stores += 1;
                        assert_eq!(st.token_ids.len(), 16 * st.block_hashes.len());
                        assert_eq!(st.block_size, 16);
                        match st.parent_block_hash {
                            None => roots += 1,
                            Some(p) => assert!(known.contains(&p), "parent {p} never stored"),
                        }
                        known.extend(&st.block_hashes);
                    }
                    KvEvent::Removed(r) => {
                        removals += 1;
                        for h in &r.block_hashes {
                            assert!(known.remove(h), "removal of a block never stored");
                        }
                    }
                    KvEvent::AllCleared => known.clear(),
                }
            }
            index.apply_batch(STREAM, &batch);
        }
        assert!(
            stores > 0 && removals > 0 && roots > 0,
            "{stores} {removals} {roots}"
        );
        let truth = cached(e.addr);
        assert_eq!(known, truth, "{encoding:?}: events vs cache");
        let indexed: HashSet<u64> = index
            .engine_hashes(STREAM, Tier::Device)
            .into_iter()
            .collect();
        assert_eq!(indexed, truth, "{encoding:?}: router index vs cache");
        assert_eq!(index.stats_mut(STREAM).orphans, 0);
        index.check_invariants().unwrap();
    }
}

/// Faults: dropped seqs are missing on PUB but served by replay; duplicates arrive twice with
/// the same bytes; the consumer recovers to the exact cached set (B22, B23).
#[test]
fn dropped_and_duplicated_batches_recover_through_replay() {
    let faults = Faults {
        drop_seqs: vec![1, 4, 5],
        duplicate_seqs: vec![2],
        ..Faults::default()
    };
    let e = start(Encoding::Array, faults, 40);
    let ctx = zmq::Context::new();
    let s = sub(&ctx, e.kv_events_endpoint.as_deref().unwrap());
    workload(e.addr, 30, 11);
    let msgs = drain(&s, Duration::from_millis(500));
    let seqs: Vec<u64> = msgs
        .iter()
        .map(|m| decode::split_live(m).unwrap().seq)
        .collect();
    assert_eq!(&seqs[..4], &[0, 2, 3, 2], "drops and the duplicate");
    assert!(!seqs.contains(&1) && !seqs.contains(&4) && !seqs.contains(&5));
    let stats = e.kv_stats.as_ref().unwrap();
    assert_eq!(stats.dropped.load(std::sync::atomic::Ordering::Relaxed), 3);
    // The replay ROUTER serves everything from 0, with topic frames, then the end marker.
    let rp = replay(&ctx, e.kv_replay_endpoint.as_deref().unwrap(), 0);
    let max = *seqs.iter().max().unwrap();
    assert_eq!(
        rp.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        (0..=max).collect::<Vec<_>>()
    );
    // Through the consumer: gap at 2 → replay from 1, which (asked after the run) returns
    // the whole buffer, so every later live batch is a duplicate.
    let mut c = Consumer::new();
    let mut ix = EventIndex::new(16);
    for m in &msgs {
        let l = decode::split_live(m).unwrap();
        if let Some(start) = c.handle(
            &mut ix,
            STREAM,
            Input::Live {
                seq: l.seq,
                payload: l.payload,
            },
        ) {
            for (seq, p) in replay(&ctx, e.kv_replay_endpoint.as_deref().unwrap(), start) {
                c.handle(&mut ix, STREAM, Input::Replay { seq, payload: &p });
            }
            c.handle(&mut ix, STREAM, Input::ReplayEnd);
        }
    }
    let st = ix.stats_mut(STREAM).clone();
    assert_eq!((st.gaps, st.replays, st.unrecoverable_gaps), (1, 1, 0));
    // Every live batch but seq 0 (the buffered seq 2 included) was already replayed.
    assert_eq!(st.duplicates, msgs.len() as u64 - 1);
    assert_eq!(st.last_seq, Some(max));
    let indexed: HashSet<u64> = ix.engine_hashes(STREAM, Tier::Device).into_iter().collect();
    assert_eq!(indexed, cached(e.addr));
}

/// Faults: a restart drops the cache silently and restarts the seq at 0 (the consumer clears
/// the stream); a lying `block_size` is counted while the learned size keeps indexing exact.
#[test]
fn restart_and_wrong_block_size() {
    let faults = Faults {
        restart_after_batches: Some(5),
        declared_block_size: Some(64),
        ..Faults::default()
    };
    let e = start(Encoding::Map, faults, 4_000);
    let ctx = zmq::Context::new();
    let s = sub(&ctx, e.kv_events_endpoint.as_deref().unwrap());
    workload(e.addr, 12, 3);
    let msgs = drain(&s, Duration::from_millis(500));
    let seqs: Vec<u64> = msgs
        .iter()
        .map(|m| decode::split_live(m).unwrap().seq)
        .collect();
    let back = seqs
        .windows(2)
        .position(|w| w[1] <= w[0])
        .expect("seq restarted");
    assert_eq!(seqs[back + 1], 0);
    let mut c = Consumer::new();
    let mut ix = EventIndex::new(16);
    for m in &msgs {
        let l = decode::split_live(m).unwrap();
        assert_eq!(
            c.handle(
                &mut ix,
                STREAM,
                Input::Live {
                    seq: l.seq,
                    payload: l.payload
                }
            ),
            None
        );
    }
    let st = ix.stats_mut(STREAM).clone();
    assert_eq!(st.restarts, 1);
    assert_eq!(st.learned_block_size, Some(16));
    assert!(st.declared_size_mismatches > 0);
    let indexed: HashSet<u64> = ix.engine_hashes(STREAM, Tier::Device).into_iter().collect();
    let truth = cached(e.addr);
    assert!(!truth.is_empty());
    assert_eq!(indexed, truth);
}
