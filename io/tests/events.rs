//! End to end through the wire (issue 5): four simulated engines publish KV events over ZMQ on
//! loopback, each with a different fault (dropped batches, duplicates, a restart, a lying block
//! size + map encoding); the gateway subscribes. After a random workload settles, the router's
//! event index equals each engine's real cached block set (zero phantom, zero missed blocks),
//! the fault counters show each fault was seen, routing uses the events, and
//! `/admin/cache-view/{worker}` reports the same numbers. Bug cases B22, B24, B31, B33.

mod common;

use common::{get, post, wait_until};
use kvroute_bench::engine::events::{Encoding, Faults, KvEventsConfig};
use kvroute_bench::engine::{self, EngineConfig};
use kvroute_core::config::{Config, PolicyKind};
use kvroute_core::events::{StreamId, Tier};
use kvroute_io::gateway;
use kvroute_tokenize::Tokenizer;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

fn engine_with(faults: Faults, encoding: Encoding, seed: u64) -> engine::EngineHandle {
    let cfg = EngineConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        speedup_ratio: 0.0,
        num_gpu_blocks: 96,
        seed,
        kv_events: Some(KvEventsConfig {
            events_addr: "127.0.0.1:0".into(),
            replay_addr: Some("127.0.0.1:0".into()),
            encoding,
            faults,
            ..KvEventsConfig::default()
        }),
        ..EngineConfig::default()
    };
    engine::spawn(cfg, Arc::new(Tokenizer::qwen3().unwrap())).expect("engine starts")
}

fn cached(addr: SocketAddr) -> HashSet<u64> {
    let r = get(addr, "/debug/cached_blocks");
    assert_eq!(r.status, 200);
    serde_json::from_slice::<Vec<u64>>(&r.body)
        .unwrap()
        .into_iter()
        .collect()
}

#[test]
fn router_event_index_equals_every_engines_cache_under_faults() {
    let engines = [
        engine_with(
            Faults {
                drop_seqs: vec![2, 5, 6, 11],
                ..Faults::default()
            },
            Encoding::Array,
            0,
        ),
        engine_with(
            Faults {
                duplicate_seqs: vec![1, 4, 9],
                ..Faults::default()
            },
            Encoding::Map,
            1,
        ),
        engine_with(
            Faults {
                restart_after_batches: Some(8),
                ..Faults::default()
            },
            Encoding::Array,
            2,
        ),
        engine_with(
            Faults {
                declared_block_size: Some(64),
                ..Faults::default()
            },
            Encoding::Map,
            3,
        ),
    ];
    let workers: Vec<String> = engines
        .iter()
        .map(|e| {
            format!(
                "http://{};events={};replay={}",
                e.addr,
                e.kv_events_endpoint.as_deref().unwrap(),
                e.kv_replay_endpoint.as_deref().unwrap()
            )
        })
        .collect();
    let gw = gateway::start(
        Config {
            listen: "127.0.0.1:0".into(),
            workers,
            policy: PolicyKind::CacheAware,
            shards: Some(1),
            admin_listen: "127.0.0.1:0".into(),
            ..Config::default()
        },
        false,
    )
    .expect("gateway starts");
    std::thread::sleep(Duration::from_millis(300)); // SUB slow-joiner
    let addr = gw.local_addr();
    // xorshift64: a seeded workload without another dependency.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: u32| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % u64::from(n)) as u32
    };
    let prefixes: Vec<Vec<u32>> = (0..6u32)
        .map(|p| (0..96).map(|i| 2_000 * (p + 1) + i).collect())
        .collect();
    // Warm-up straight to each engine (15 distinct prompts each), so every engine's faults
    // fire whatever the router later picks; the subscriber already listens.
    for (w, e) in engines.iter().enumerate() {
        for k in 0..15u32 {
            let ids: Vec<u32> = (0..40)
                .map(|i| 50_000 + 1_000 * (w as u32 * 15 + k) + i)
                .collect();
            let body =
                serde_json::json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}});
            assert_eq!(post(e.addr, "/generate", &body).status, 200);
        }
    }
    let mut hits = 0;
    // Sequential requests, so every engine also goes idle (the restart fault waits for that).
    for i in 0..120 {
        let mut ids = prefixes[next(prefixes.len() as u32) as usize].clone();
        let extra = 1 + next(79);
        ids.extend((0..extra).map(|_| 10 + next(29_990)));
        let r = post(
            addr,
            "/generate",
            &serde_json::json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}),
        );
        assert_eq!(r.status, 200, "request {i}");
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        hits += v["meta_info"]["cached_tokens"].as_u64().unwrap();
    }
    let index = gw.shared().events.clone().expect("event index");
    let view = |w: u32| -> HashSet<u64> {
        let ix = index.lock().unwrap();
        ix.engine_hashes(StreamId { worker: w, rank: 0 }, Tier::Device)
            .into_iter()
            .collect()
    };
    let settled = wait_until(Duration::from_secs(10), || {
        engines
            .iter()
            .enumerate()
            .all(|(w, e)| view(w as u32) == cached(e.addr))
    });
    let mut total = 0;
    for (w, e) in engines.iter().enumerate() {
        let truth = cached(e.addr);
        let got = view(w as u32);
        let phantom = got.difference(&truth).count();
        let missed = truth.difference(&got).count();
        assert_eq!(
            (phantom, missed),
            (0, 0),
            "worker {w}: phantom/missed blocks"
        );
        total += truth.len();
    }
    // (Worker 2 may have restarted after its last request, with an empty cache.)
    assert!(total > 0, "no engine cached anything");
    assert!(settled);
    let ix = index.lock().unwrap();
    let st = |w: u32| {
        ix.stats()
            .into_iter()
            .find(|(s, _)| s.worker == w)
            .unwrap()
            .1
    };
    let (s0, s1, s2, s3) = (st(0), st(1), st(2), st(3));
    assert!(s0.gaps >= 1 && s0.replays >= 1, "{s0:?}");
    assert_eq!(s0.unrecoverable_gaps, 0, "{s0:?}");
    assert!(s1.duplicates >= 1, "{s1:?}");
    assert_eq!(s2.restarts, 1, "{s2:?}");
    assert!(s3.declared_size_mismatches >= 1, "{s3:?}");
    assert_eq!(s3.learned_block_size, Some(16));
    for s in [&s0, &s1, &s2, &s3] {
        assert_eq!((s.decode_errors, s.orphans), (0, 0), "{s:?}");
    }
    let blocks: Vec<usize> = (0..4).map(|w| ix.worker_blocks(w)).collect();
    drop(ix);
    // Routing used the events: prefixes came back to their holders.
    assert!(hits > 0);
    // Admin view and metrics agree with the index.
    for (w, b) in blocks.iter().enumerate() {
        // The cache view is on the admin port, not the traffic port.
        assert_eq!(get(addr, &format!("/admin/cache-view/{w}")).status, 404);
        let r = get(gw.admin_addr().unwrap(), &format!("/cache-view/{w}"));
        assert_eq!(r.status, 200);
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["worker"], w);
        assert_eq!(v["blocks"].as_u64().unwrap() as usize, *b);
    }
    assert_eq!(get(addr, "/admin/cache-view/9").status, 404);
    let m = String::from_utf8(get(addr, "/metrics").body).unwrap();
    assert!(
        m.contains("kvroute_kv_events_restarts_total{worker=\"2\",rank=\"0\"} 1"),
        "{m}"
    );
    gw.shutdown();
}
