//! The gateway end to end on loopback, against simulated engines started in-process.

mod common;

use common::*;
use kvroute_bench::engine::{self, EngineConfig};
use kvroute_core::config::{Config, PolicyKind};
use kvroute_io::gateway;
use kvroute_io::shard::Server;
use kvroute_tokenize::Tokenizer;
use serde_json::json;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

fn tokenizer() -> Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::qwen3().expect("embedded tokenizer"))
        .clone()
}

fn engine_with(speedup_ratio: f64, seed: u64) -> engine::server::EngineHandle {
    let cfg = EngineConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        speedup_ratio,
        seed,
        ..EngineConfig::default()
    };
    engine::server::spawn(cfg, std::sync::Arc::new(tokenizer())).expect("engine starts")
}

fn gateway_for(urls: Vec<String>, policy: PolicyKind, tweak: impl FnOnce(&mut Config)) -> Server {
    let mut cfg = Config {
        listen: "127.0.0.1:0".into(),
        workers: urls,
        policy,
        shards: Some(2),
        // Off unless a test turns them on: the hand-written upstreams below answer only the
        // requests a test sends (a probe would be an extra one).
        health_check_interval_secs: 0,
        // Tests run side by side: any free port.
        admin_listen: "127.0.0.1:0".into(),
        ..Config::default()
    };
    tweak(&mut cfg);
    gateway::start(cfg, false).expect("gateway starts")
}

fn url_of(h: &engine::server::EngineHandle) -> String {
    format!("http://{}", h.addr)
}

/// Drops the fields that differ between two identical requests (`id`, `created`).
fn normalise(v: &mut serde_json::Value) {
    if let Some(o) = v.as_object_mut() {
        o.remove("id");
        o.remove("created");
    }
}

fn chat(content: &str, stream: bool, max_tokens: u32) -> serde_json::Value {
    json!({
        "model": "qwen3-sim",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// SSE events of a streamed body, `[DONE]` included, JSON normalised.
fn sse_events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| match serde_json::from_str::<serde_json::Value>(d) {
            Ok(mut v) => {
                normalise(&mut v);
                v.to_string()
            }
            Err(_) => d.to_string(),
        })
        .collect()
}

#[test]
fn responses_through_the_router_equal_direct_responses() {
    // Two identical fresh engines: one is called directly, one through the gateway.
    let direct = engine_with(0.0, 7);
    let behind = engine_with(0.0, 7);
    let gw = gateway_for(vec![url_of(&behind)], PolicyKind::CacheAware, |_| {});
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(20);
    for (i, stream) in [false, true].into_iter().enumerate() {
        let body = chat(&format!("{i}{text}"), stream, 12);
        let a = post(direct.addr, "/v1/chat/completions", &body);
        let b = post(gw.local_addr(), "/v1/chat/completions", &body);
        assert_eq!((a.status, b.status), (200, 200), "{}", b.text());
        assert_eq!(b.header("x-kvroute-worker"), Some("0"));
        assert_eq!(a.header("content-type"), b.header("content-type"));
        if stream {
            let (ea, eb) = (sse_events(&a.body), sse_events(&b.body));
            assert!(
                ea.len() >= 4 && ea.last().map(String::as_str) == Some("[DONE]"),
                "{ea:?}"
            );
            assert_eq!(ea, eb);
        } else {
            let (mut ja, mut jb) = (a.json(), b.json());
            normalise(&mut ja);
            normalise(&mut jb);
            assert_eq!(ja["usage"]["completion_tokens"], 12);
            assert_eq!(ja, jb);
        }
    }
    gw.shutdown();
}

#[test]
fn concurrent_misses_spread_over_all_workers() {
    // Real-time engines keep requests in flight, so loads differ while requests arrive.
    let engines: Vec<_> = (0..4).map(|i| engine_with(1.0, i)).collect();
    let urls: Vec<String> = engines.iter().map(url_of).collect();
    for policy in PolicyKind::ALL {
        let gw = gateway_for(urls.clone(), policy, |_| {});
        let addr = gw.local_addr();
        let handles: Vec<_> = (0..64)
            .map(|i| {
                std::thread::spawn(move || {
                    // Unique prompts: every request is a miss for cache_aware.
                    let body = chat(
                        &format!("unique request {i} {}", "lorem ipsum ".repeat(i % 7 + 1)),
                        false,
                        4,
                    );
                    post(addr, "/v1/chat/completions", &body)
                })
            })
            .collect();
        let mut per_worker: HashMap<String, usize> = HashMap::new();
        for h in handles {
            let r = h.join().unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            *per_worker
                .entry(r.header("x-kvroute-worker").unwrap().to_string())
                .or_default() += 1;
        }
        assert_eq!(per_worker.len(), 4, "{policy}: {per_worker:?}");
        assert!(
            per_worker.values().all(|&n| n <= 32),
            "{policy}: {per_worker:?} (> 2x fair share of 16)"
        );
        assert!(
            wait_until(Duration::from_secs(2), || gw
                .shared()
                .workers
                .loads()
                .iter()
                .all(|&l| l == 0)),
            "in-flight counts return to 0"
        );
        gw.shutdown();
    }
}

#[test]
fn cache_aware_keeps_a_conversation_and_misses_on_a_shared_system_prompt() {
    let engines: Vec<_> = (0..2).map(|i| engine_with(1.0, i)).collect();
    let urls: Vec<String> = engines.iter().map(url_of).collect();
    let gw = gateway_for(urls, PolicyKind::CacheAware, |_| {});
    let addr = gw.local_addr();
    let system = "You are a helpful assistant.";
    let user1 = "Tell me about the history of the printing press in Europe. ".repeat(8);
    let turn1 = json!({"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user1}]});
    let r1 = post(addr, "/v1/chat/completions", &turn1);
    assert_eq!(r1.status, 200);
    let w1 = r1.header("x-kvroute-worker").unwrap().to_string();
    let turn2 = json!({"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user1},
        {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And in Asia?"}]});
    let mut served = 0.0;
    for _ in 0..3 {
        let r2 = post(addr, "/v1/chat/completions", &turn2);
        assert_eq!(
            r2.header("x-kvroute-worker"),
            Some(w1.as_str()),
            "turn 2 follows turn 1"
        );
        served += r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_f64()
            .unwrap();
    }
    // The router read each hit's `cached_tokens` from the relayed body (B37's counters). It
    // records a hit's four counters one after the other once the client has the last byte,
    // so a scrape right after the third response may see the third hit half recorded: wait
    // (2 s at most) for the counters to balance; a real imbalance still fails below.
    let count = |m: &str, kind: &str| {
        metric(
            m,
            &format!("kvroute_hit_tokens_total{{worker=\"{w1}\",kind=\"{kind}\"}}"),
        )
    };
    let metrics = metrics_when(addr, Duration::from_secs(2), |m| {
        let c = |k| count(m, k).unwrap_or(f64::NAN);
        c("served") == served && c("predicted") - c("served") == c("phantom") - c("unannounced")
    });
    let hit_tokens =
        |kind: &str| count(&metrics, kind).unwrap_or_else(|| panic!("{kind}: {metrics}"));
    assert!(served > 0.0);
    assert_eq!(hit_tokens("served"), served, "{metrics}");
    assert_eq!(
        hit_tokens("predicted") - hit_tokens("served"),
        hit_tokens("phantom") - hit_tokens("unannounced")
    );
    // Hold a long stream open on w1 so the loads differ: a miss must go to the other worker,
    // while a (wrong) hit on the shared system prompt would stay on w1 (not hot: 1 < 64).
    let long = serde_json::to_vec(&json!({"model": "m", "max_tokens": 2000, "stream": true, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user1},
        {"role": "assistant", "content": "x"}, {"role": "user", "content": "Write a long essay."}]}))
    .unwrap();
    let mut holder = open_post(addr, "/v1/chat/completions", &long);
    let mut first = [0u8; 64];
    let _ = holder.read(&mut first).unwrap();
    // `x-kvroute-worker` is the worker's id.
    let w1_id: usize = w1.parse().expect("a worker id");
    assert!(wait_until(Duration::from_secs(2), || gw
        .shared()
        .workers
        .loads()[w1_id]
        == 1));
    let other = json!({"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Explain how a transistor amplifies a signal, step by step. ".repeat(8)}]});
    let r3 = post(addr, "/v1/chat/completions", &other);
    assert_ne!(
        r3.header("x-kvroute-worker"),
        Some(w1.as_str()),
        "a shared short system prompt is a miss"
    );
    let metrics = get(addr, "/metrics").text();
    assert!(
        metric(
            &metrics,
            "kvroute_decisions_total{policy=\"cache_aware\",reason=\"miss\"}"
        )
        .unwrap_or(0.0)
            >= 2.0,
        "{metrics}"
    );
    assert!(
        metric(
            &metrics,
            "kvroute_decisions_total{policy=\"cache_aware\",reason=\"hit\"}"
        )
        .unwrap_or(0.0)
            >= 3.0,
        "{metrics}"
    );
    drop(holder);
    gw.shutdown();
}

/// B44: with load reports on, requests another client put on an engine count in the
/// router's loads. Three long streams go straight to engine 0, around the router, as another
/// router replica's would. least_request then sends every short request to engine 1; without
/// reports the two engines look idle and each request would pick one at random. Once the
/// streams end, the next report clears the foreign load.
#[test]
fn load_reports_count_requests_sent_around_the_router_b44() {
    let engines: Vec<_> = (0..2).map(|i| engine_with(1.0, i)).collect();
    let urls: Vec<String> = engines.iter().map(url_of).collect();
    let gw = gateway_for(urls.clone(), PolicyKind::LeastRequest, |c| {
        c.load_poll_ms = 20
    });
    let addr = gw.local_addr();
    let long = serde_json::to_vec(&chat("Write a long essay.", true, 4000)).unwrap();
    let mut around: Vec<_> = (0..3)
        .map(|_| open_post(engines[0].addr, "/v1/chat/completions", &long))
        .collect();
    for s in &mut around {
        let mut first = [0u8; 64];
        assert!(s.read(&mut first).unwrap() > 0, "stream started");
    }
    assert!(
        wait_until(Duration::from_secs(3), || gw.shared().workers.loads()
            == vec![3, 0]),
        "{:?}",
        gw.shared().workers.loads()
    );
    for _ in 0..8 {
        let r = post(addr, "/v1/chat/completions", &chat("hi", false, 2));
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-kvroute-worker"), Some("1"));
    }
    let metrics = get(addr, "/metrics").text();
    assert_eq!(
        metric(&metrics, "kvroute_worker_foreign_requests{worker=\"0\"}"),
        Some(3.0),
        "{metrics}"
    );
    drop(around);
    assert!(
        wait_until(Duration::from_secs(3), || gw.shared().workers.loads()
            == vec![0, 0]),
        "{:?}",
        gw.shared().workers.loads()
    );
    // The kv-load thread ends with the gateway (it holds the registry weakly).
    let kv_load_threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter(|t| {
                std::fs::read_to_string(t.as_ref().unwrap().path().join("comm"))
                    .is_ok_and(|c| c.trim() == "kv-load")
            })
            .count()
    };
    assert_eq!(kv_load_threads(), 1);
    gw.shutdown();
    assert!(wait_until(Duration::from_secs(3), || kv_load_threads() == 0));
}

#[test]
fn client_disconnect_mid_stream_releases_load_and_closes_upstream() {
    let eng = engine_with(1.0, 1);
    let gw = gateway_for(vec![url_of(&eng)], PolicyKind::LeastRequest, |_| {});
    let body =
        serde_json::to_vec(&chat("stream me a very long answer please", true, 5000)).unwrap();
    let mut s = open_post(gw.local_addr(), "/v1/chat/completions", &body);
    // Read until at least two SSE events arrived: the stream is live.
    let mut got = Vec::new();
    let mut tmp = [0u8; 4096];
    while got.windows(6).filter(|w| w == b"data: ").count() < 2 {
        let n = s.read(&mut tmp).unwrap();
        assert!(n > 0);
        got.extend_from_slice(&tmp[..n]);
    }
    assert_eq!(gw.shared().workers.loads(), vec![1]);
    let running = || {
        metric(
            &get(eng.addr, "/metrics").text(),
            "vllm:num_requests_running",
        )
        .unwrap_or(-1.0)
    };
    assert_eq!(running(), 1.0);
    drop(s);
    assert!(
        wait_until(Duration::from_secs(3), || gw.shared().workers.loads()
            == vec![0]),
        "in-flight released after the client left"
    );
    assert!(
        wait_until(Duration::from_secs(3), || running() == 0.0),
        "engine aborted the request"
    );
    gw.shutdown();
}

fn error_of(r: &Response) -> serde_json::Value {
    let v = r.json();
    assert!(
        v["error"]["message"].is_string() && v["error"]["type"].is_string(),
        "{v}"
    );
    assert_eq!(v["error"]["code"], r.status);
    v
}

#[test]
fn client_errors_431_413_400() {
    let eng = engine_with(0.0, 1);
    let gw = gateway_for(vec![url_of(&eng)], PolicyKind::CacheAware, |c| {
        c.max_body_bytes = 1024
    });
    let addr = gw.local_addr();
    let big_head = format!(
        "GET /health HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
        "a".repeat(70 * 1024)
    );
    let r = send_raw(addr, big_head.as_bytes());
    assert_eq!(r.status, 431);
    error_of(&r);
    let r = send_raw(
        addr,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-request-id: rid-413\r\ncontent-length: 4096\r\n\r\n",
    );
    assert_eq!(r.status, 413);
    error_of(&r);
    // Its head was read: the answer and the request's record name it (`metrics_when`).
    assert_eq!(r.header("x-request-id"), Some("rid-413"));
    let counted = |m: &str| {
        m.lines().any(|l| {
            l.starts_with("kvroute_requests_total{")
                && l.contains("route=\"/v1/completions\"")
                && l.contains("status=\"413\"")
        })
    };
    let metrics = metrics_when(addr, Duration::from_secs(2), counted);
    assert!(counted(&metrics), "{metrics}");
    let chunked = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n800\r\n{}\r\n0\r\n\r\n",
        "a".repeat(2048)
    );
    assert_eq!(send_raw(addr, chunked.as_bytes()).status, 413);
    let r = send_raw(
        addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 9\r\n\r\nnot json!",
    );
    assert_eq!(r.status, 400);
    error_of(&r);
    let r = send_raw(addr, b"GARBAGE\x01\r\n\r\n");
    assert_eq!(r.status, 400);
    // A chunked request body is de-chunked and forwarded.
    let json = br#"{"model":"m","prompt":"hello there","max_tokens":3}"#;
    let mut raw = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n",
        10
    )
    .into_bytes();
    raw.extend_from_slice(&json[..10]);
    raw.extend_from_slice(format!("\r\n{:x}\r\n", json.len() - 10).as_bytes());
    raw.extend_from_slice(&json[10..]);
    raw.extend_from_slice(b"\r\n0\r\n\r\n");
    let r = send_raw(addr, &raw);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    assert_eq!(get(addr, "/nope").status, 404);
    assert_eq!(get(addr, "/health").status, 200);
    // A route with the wrong method: 405 naming the right one, in the OpenAI shape.
    let r = get(addr, "/v1/chat/completions");
    assert_eq!((r.status, r.header("allow")), (405, Some("POST")));
    assert_eq!(
        r.json()["error"],
        json!({"message": "/v1/chat/completions takes POST", "type": "invalid_request_error",
            "param": null, "code": 405})
    );
    gw.shutdown();
}

/// Bodies the OpenAI API rejects are refused by the router itself, never forwarded, each
/// with a message naming what is wrong and counted by reason: a model that is not a string,
/// no model, an empty `messages`.
#[test]
fn invalid_chat_bodies_are_refused_named_and_counted() {
    let eng = engine_with(0.0, 1);
    let gw = gateway_for(vec![url_of(&eng)], PolicyKind::RoundRobin, |_| {});
    let addr = gw.local_addr();
    let cases = [
        (
            json!({"model": 5, "messages": [{"role": "user", "content": "hi"}]}),
            "`model` must be a string",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            "you must provide a model parameter",
        ),
        (
            json!({"model": "qwen3-sim", "messages": []}),
            "`messages` must be a non-empty array",
        ),
    ];
    for (body, message) in &cases {
        let r = post(addr, "/v1/chat/completions", body);
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(r.header("x-kvroute-worker"), None, "not forwarded: {body}");
        let v = error_of(&r);
        let got = v["error"]["message"].as_str().unwrap();
        assert!(got.contains(message), "{body}: {got}");
    }
    let metrics = get(addr, "/metrics").text();
    for (reason, n) in [("wrong_type", 2.0), ("missing_field", 1.0)] {
        let name = format!("kvroute_bad_requests_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&metrics, &name), Some(n), "{metrics}");
    }
    // A good chat still goes through.
    let r = post(addr, "/v1/chat/completions", &chat("hi", false, 2));
    assert_eq!(r.status, 200, "{}", r.text());
    gw.shutdown();
}

/// B20: chat, completions and `/generate` (text and token ids) all route with a key, so
/// the keyless counter stays at 0 for them; an empty prompt is routed (by load, to the
/// engine, whose 400 the client gets, as vLLM's) and counted.
#[test]
fn every_endpoint_routes_with_a_key_b20() {
    let eng = engine_with(0.0, 1);
    let gw = gateway_for(vec![url_of(&eng)], PolicyKind::CacheAware, |_| {});
    let addr = gw.local_addr();
    let good = [
        ("/v1/chat/completions", chat("hi", false, 2)),
        (
            "/v1/completions",
            json!({"model": "qwen3-sim", "prompt": "hi", "max_tokens": 2}),
        ),
        (
            "/generate",
            json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
        ),
        (
            "/generate",
            json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}),
        ),
    ];
    for (path, body) in &good {
        let r = post(addr, path, body);
        assert_eq!(r.status, 200, "{path} {body}: {}", r.text());
    }
    let keyless = |route: &str| {
        let name = format!("kvroute_keyless_routings_total{{route=\"{route}\"}}");
        metric(&get(addr, "/metrics").text(), &name)
    };
    for route in ["/v1/chat/completions", "/v1/completions", "/generate"] {
        assert_eq!(keyless(route), None, "{route}");
    }
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": "qwen3-sim", "prompt": "", "max_tokens": 2}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("x-kvroute-worker"), Some("0"), "routed");
    assert_eq!(keyless("/v1/completions"), Some(1.0));
    gw.shutdown();
}

#[test]
fn worker_errors_502_and_504() {
    // 502: nothing listens on the worker's port. Port 1 (tcpmux), not a port bound and
    // dropped: tests run side by side, and another one's server (a gateway answering 503)
    // can take a freed ephemeral port; bind(0) never hands out port 1.
    let dead: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let gw = gateway_for(
        vec![format!("http://{dead}")],
        PolicyKind::RoundRobin,
        |_| {},
    );
    let r = post(
        gw.local_addr(),
        "/v1/completions",
        &json!({"model": "m", "prompt": "x"}),
    );
    assert_eq!(r.status, 502);
    error_of(&r);
    // The worker is named by id; its internal URL is not leaked.
    assert_eq!(r.header("x-kvroute-worker"), None);
    assert!(!r.text().contains(&dead.to_string()), "{}", r.text());
    assert_eq!(gw.shared().workers.loads(), vec![0]);
    // Its breaker opens at the third failure; then no worker is eligible: 503, with
    // `Retry-After` for the client's retry.
    for _ in 1..kvroute_core::config::defaults::BREAKER_FAILURE_THRESHOLD {
        let r = post(
            gw.local_addr(),
            "/v1/completions",
            &json!({"model": "m", "prompt": "x"}),
        );
        assert_eq!(r.status, 502, "{}", r.text());
    }
    let r = post(
        gw.local_addr(),
        "/v1/completions",
        &json!({"model": "m", "prompt": "x"}),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        error_of(&r)["error"]["message"],
        "no healthy worker serves model `m`"
    );
    assert_eq!(r.header("retry-after"), Some("1"));
    gw.shutdown();
    // 504: the worker accepts and never answers.
    let hang = TcpListener::bind("127.0.0.1:0").unwrap();
    let hang_addr = hang.local_addr().unwrap();
    let keeper = std::thread::spawn(move || {
        let conns: Vec<_> = hang.incoming().take(1).collect();
        std::thread::sleep(Duration::from_secs(3));
        drop(conns);
    });
    let gw = gateway_for(
        vec![format!("http://{hang_addr}")],
        PolicyKind::RoundRobin,
        |c| c.first_byte_timeout_secs = 1,
    );
    let t0 = std::time::Instant::now();
    let r = post(
        gw.local_addr(),
        "/v1/completions",
        &json!({"model": "m", "prompt": "x"}),
    );
    assert_eq!(r.status, 504);
    error_of(&r);
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert_eq!(gw.shared().workers.loads(), vec![0]);
    gw.shutdown();
    keeper.join().unwrap();
}

#[test]
fn keep_alive_reuses_client_and_upstream_connections() {
    let eng = engine_with(0.0, 1);
    let gw = gateway_for(vec![url_of(&eng)], PolicyKind::RoundRobin, |c| {
        c.shards = Some(1)
    });
    let mut s = TcpStream::connect(gw.local_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for i in 0..5 {
        let body = format!(r#"{{"model":"m","prompt":"request {i}","max_tokens":2}}"#);
        s.write_all(
            format!(
                "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .unwrap();
        let r = read_response(&mut s);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 2);
        assert!(r.header("connection").is_none());
    }
    gw.shutdown();
}

/// A worker that answers every request with a small JSON body and keeps the connection open
/// for `idle` before closing it (a shorter keep-alive than the gateway's pool timeout).
fn short_keepalive_worker(
    idle: Duration,
    answers: usize,
) -> (SocketAddr, std::thread::JoinHandle<usize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let mut served = 0;
        let mut conns = 0;
        while served < answers && conns < 2 * answers {
            let (mut s, _) = l.accept().unwrap();
            conns += 1;
            s.set_read_timeout(Some(idle)).unwrap();
            let mut buf = Vec::new();
            let mut tmp = [0u8; 4096];
            loop {
                // One request: head + content-length body.
                let Some(end) = find(&buf, b"\r\n\r\n") else {
                    match s.read(&mut tmp) {
                        Ok(n) if n > 0 => {
                            buf.extend_from_slice(&tmp[..n]);
                            continue;
                        }
                        _ => break, // idle timeout or close: drop the connection
                    }
                };
                let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                while buf.len() < end + 4 + len {
                    let n = s.read(&mut tmp).unwrap();
                    buf.extend_from_slice(&tmp[..n]);
                }
                buf.drain(..end + 4 + len);
                let body = format!(r#"{{"served":{served}}}"#);
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                s.write_all(resp.as_bytes()).unwrap();
                served += 1;
            }
        }
        served
    });
    (addr, h)
}

#[test]
fn stale_pooled_connection_is_retried_once_b42() {
    // bug-cases.md B42 (smg-project/smg PR #2162): the worker closed an idle pooled
    // connection; the next POST must still succeed.
    let (addr, worker) = short_keepalive_worker(Duration::from_millis(100), 2);
    let gw = gateway_for(
        vec![format!("http://{addr}")],
        PolicyKind::RoundRobin,
        |c| c.shards = Some(1),
    );
    let r1 = post(
        gw.local_addr(),
        "/v1/completions",
        &json!({"model": "m", "prompt": "one"}),
    );
    assert_eq!((r1.status, r1.json()["served"].as_u64()), (200, Some(0)));
    std::thread::sleep(Duration::from_millis(300)); // the worker closes its side meanwhile
    let r2 = post(
        gw.local_addr(),
        "/v1/completions",
        &json!({"model": "m", "prompt": "two"}),
    );
    assert_eq!(
        (r2.status, r2.json()["served"].as_u64()),
        (200, Some(1)),
        "{}",
        r2.text()
    );
    assert_eq!(worker.join().unwrap(), 2);
    gw.shutdown();
}

#[test]
fn the_b42_retry_takes_a_fresh_connection_not_another_stale_one() {
    // Two pooled connections, both closed by the worker while idle: the retry after the
    // first fails must not take the second (it used to, and the client got a 502).
    let (addr, worker) = short_keepalive_worker(Duration::from_millis(100), 3);
    let gw = gateway_for(
        vec![format!("http://{addr}")],
        PolicyKind::RoundRobin,
        |c| c.shards = Some(1),
    );
    let gw_addr = gw.local_addr();
    // Two at once: two upstream connections (the worker serves the second once the first
    // has idled out), both returned to the pool.
    let both: Vec<u16> = std::thread::scope(|s| {
        let send = || {
            s.spawn(|| {
                post(
                    gw_addr,
                    "/v1/completions",
                    &json!({"model": "m", "prompt": "one"}),
                )
                .status
            })
        };
        let (a, b) = (send(), send());
        vec![a.join().unwrap(), b.join().unwrap()]
    });
    assert_eq!(both, [200, 200]);
    std::thread::sleep(Duration::from_millis(300)); // the worker closed both meanwhile
    let r = post(
        gw_addr,
        "/v1/completions",
        &json!({"model": "m", "prompt": "two"}),
    );
    assert_eq!(
        (r.status, r.json()["served"].as_u64()),
        (200, Some(2)),
        "{}",
        r.text()
    );
    assert_eq!(worker.join().unwrap(), 3);
    gw.shutdown();
}

#[test]
fn client_leaving_before_the_response_head_cancels_the_upstream_request_b41() {
    // bug-cases.md B41: the client goes away before the response head; the engine must
    // stop. A non-streaming request gets its head only at the end, so the gateway is still
    // waiting on the worker when the client leaves. 20x slower than the timing model: the
    // 2k-token prefill takes ≈ 1 s and each of the 50 decode steps ≈ 115 ms.
    let eng = engine_with(0.05, 1);
    let gw = gateway_for(vec![url_of(&eng)], PolicyKind::LeastRequest, |_| {});
    let body = serde_json::to_vec(&chat(&"word ".repeat(2000), false, 50)).unwrap();
    let s = open_post(gw.local_addr(), "/v1/chat/completions", &body);
    let running = || {
        metric(
            &get(eng.addr, "/metrics").text(),
            "vllm:num_requests_running",
        )
        .unwrap_or(-1.0)
    };
    assert!(
        wait_until(Duration::from_secs(3), || running() == 1.0),
        "request admitted"
    );
    drop(s);
    assert!(
        wait_until(Duration::from_millis(500), || running() == 0.0),
        "engine aborted within 500 ms"
    );
    assert!(wait_until(Duration::from_secs(1), || gw
        .shared()
        .workers
        .loads()
        == vec![0]));
    // Counted as the client's (status 0), not as an error of the worker (`metrics_when`).
    let counted = |m: &str| {
        m.lines()
            .any(|l| l.starts_with("kvroute_requests_total{") && l.contains("status=\"0\""))
    };
    let metrics = metrics_when(gw.local_addr(), Duration::from_secs(2), counted);
    assert!(counted(&metrics), "{metrics}");
    assert!(
        !metrics.contains("kvroute_worker_errors_total{"),
        "{metrics}"
    );
    gw.shutdown();
}

#[test]
fn idle_upstream_connections_are_closed_after_the_idle_timeout() {
    // The worker would keep the connection 5 s; the gateway's pool must close it first.
    let (addr, worker) = short_keepalive_worker(Duration::from_secs(5), 1);
    let gw = gateway_for(
        vec![format!("http://{addr}")],
        PolicyKind::RoundRobin,
        |c| {
            c.shards = Some(1);
            c.upstream_idle_timeout_ms = 200;
        },
    );
    let t0 = std::time::Instant::now();
    assert_eq!(
        post(
            gw.local_addr(),
            "/v1/completions",
            &json!({"model": "m", "prompt": "x"})
        )
        .status,
        200
    );
    // The worker thread ends when its connection is closed by the gateway.
    assert_eq!(worker.join().unwrap(), 1);
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "closed after {:?}",
        t0.elapsed()
    );
    gw.shutdown();
}

/// Model names no worker lists share one `model` label, and a prompt a worker refused is never
/// recorded: a client inventing names grows neither the metrics registry nor the indexes.
/// Worker 0 lists its model; worker 1's list is not known (no health checks read it), so it
/// takes any name, and its engine answers vLLM's 404 itself.
#[test]
fn invented_model_names_grow_neither_the_metrics_nor_the_indexes() {
    let engine = |seed| {
        let cfg = EngineConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            speedup_ratio: 0.0,
            seed,
            check_model: true,
            ..EngineConfig::default()
        };
        engine::server::spawn(cfg, std::sync::Arc::new(tokenizer())).expect("engine starts")
    };
    let (a, b) = (engine(1), engine(2));
    let listed = format!("{};model={}", url_of(&a), engine::defaults::MODEL_NAME);
    let gw = gateway_for(vec![listed, url_of(&b)], PolicyKind::CacheAware, |_| {});
    let addr = gw.local_addr();
    let invented = 6;
    for i in 0..invented {
        let mut body = chat(&format!("question {i} about something"), false, 2);
        body["model"] = json!(format!("junk-{i}"));
        let r = post(addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 404, "{}", r.text());
    }
    for i in 0..2 {
        let r = post(
            addr,
            "/v1/chat/completions",
            &chat(&format!("real {i}"), false, 2),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // The summed value of the `kvroute_requests_total` lines of `metrics` holding every one
    // of `labels`.
    let requests = |metrics: &str, labels: &[&str]| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with("kvroute_requests_total{"))
            .filter(|l| labels.iter().all(|x| l.contains(x)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let unlisted = format!("model=\"{}\"", kvroute_io::record::UNLISTED_MODEL);
    let junk = [unlisted.as_str(), "status=\"404\""];
    let real = ["model=\"qwen3-sim\"", "status=\"200\""];
    // Counted once each record is dropped (`metrics_when`): until every request shows.
    let metrics = metrics_when(addr, Duration::from_secs(2), |m| {
        requests(m, &real) >= 2.0 && requests(m, &junk) >= invented as f64
    });
    assert!(!metrics.contains("junk-"), "{metrics}");
    assert_eq!(requests(&metrics, &junk), invented as f64, "{metrics}");
    assert_eq!(requests(&metrics, &real), 2.0, "{metrics}");
    // The served model has its indexes; the invented ones none (checked above: no `junk-`).
    assert!(
        metrics.contains("kvroute_index_size{index=\"tree_chars\",model=\"qwen3-sim\"}"),
        "{metrics}"
    );
    gw.shutdown();
}
