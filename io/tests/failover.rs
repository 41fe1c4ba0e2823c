//! Issue 13's fault matrix and operations on loopback: simulated engines with fault switches
//! behind `kvroute serve`. Every case asserts that each client got exactly one response, that
//! no engine ran a request twice (engine-side counts), and that in-flight counts return to 0.

mod common;

use common::*;
use kvroute_bench::engine::{self, EngineConfig, EngineFaults, EngineHandle};
use kvroute_core::config::{Config, PolicyKind};
use kvroute_io::gateway;
use kvroute_io::shard::Server;
use kvroute_tokenize::Tokenizer;
use serde_json::json;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::qwen3().expect("embedded tokenizer")))
        .clone()
}

fn engine_cfg(model: &str) -> EngineConfig {
    EngineConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        model_name: model.into(),
        check_model: true,
        // 4 × faster than the timing model: a 40-token stream takes ~0.1 s.
        speedup_ratio: 4.0,
        ..EngineConfig::default()
    }
}

fn engine(model: &str) -> EngineHandle {
    engine::server::spawn(engine_cfg(model), tokenizer()).expect("engine starts")
}

fn faulty(faults: EngineFaults) -> EngineHandle {
    let cfg = EngineConfig {
        faults,
        ..engine_cfg(MODEL)
    };
    engine::server::spawn(cfg, tokenizer()).expect("engine starts")
}

const MODEL: &str = "qwen3-sim";

fn gateway_for(engines: &[&EngineHandle], tweak: impl FnOnce(&mut Config)) -> Server {
    let mut cfg = Config {
        listen: "127.0.0.1:0".into(),
        workers: engines
            .iter()
            .map(|e| format!("http://{}", e.addr))
            .collect(),
        policy: PolicyKind::RoundRobin,
        shards: Some(1),
        admin_listen: "127.0.0.1:0".into(),
        // Short waits so the matrix runs in seconds.
        retry_initial_backoff_ms: 5,
        ..Config::default()
    };
    tweak(&mut cfg);
    gateway::start(cfg, false).expect("gateway starts")
}

fn completion(i: usize, max_tokens: u32) -> serde_json::Value {
    json!({"model": MODEL, "prompt": format!("request number {i} of the matrix"), "max_tokens": max_tokens})
}

fn chat(content: &str, max_tokens: u32) -> serde_json::Value {
    json!({"model": MODEL, "stream": true, "max_tokens": max_tokens, "seed": 7,
        "messages": [{"role": "user", "content": content}]})
}

/// `POST` with an `x-request-id`, on a new connection.
fn post_id(addr: SocketAddr, path: &str, body: &serde_json::Value, id: &str) -> Response {
    let body = serde_json::to_vec(body).unwrap();
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-request-id: {id}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(&body);
    send_raw(addr, &raw)
}

/// Each id completed on exactly one engine, and no engine completed more requests than were
/// sent (engine-side counts).
fn ran_once(engines: &[&EngineHandle], ids: &[String]) {
    let mut completed = 0;
    for e in engines {
        completed += e.request_stats().requests_completed;
    }
    assert_eq!(completed, ids.len() as u64, "completions over all engines");
    let mut seen: HashMap<String, usize> = HashMap::new();
    for e in engines {
        for id in e.request_stats().request_ids {
            *seen.entry(id).or_default() += 1;
        }
    }
    for id in ids {
        assert!(seen.contains_key(id), "{id} never reached an engine");
    }
}

fn loads_back_to_zero(gw: &Server) {
    assert!(
        wait_until(Duration::from_secs(3), || gw
            .shared()
            .workers
            .loads()
            .iter()
            .all(|&l| l == 0)),
        "{:?}",
        gw.shared().workers.loads()
    );
    assert!(wait_until(Duration::from_secs(3), || gw
        .shared()
        .in_flight
        .load(std::sync::atomic::Ordering::SeqCst)
        == 0));
}

/// Engine killed before its first byte: every client succeeds through a retry on the other
/// engine, the dead one's breaker opens, and each request completes once.
#[test]
fn killed_before_the_first_byte_is_retried_elsewhere() {
    let good = engine(MODEL);
    let dead = faulty(EngineFaults {
        die_after_tokens: Some(0),
        ..EngineFaults::default()
    });
    let gw = gateway_for(&[&dead, &good], |_| {});
    let ids: Vec<String> = (0..20).map(|i| format!("kill-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        let r = post_id(gw.local_addr(), "/v1/completions", &completion(i, 4), id);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-kvroute-worker"), Some("1"));
        assert_eq!(r.header("x-request-id"), Some(id.as_str()));
    }
    ran_once(&[&good, &dead], &ids);
    // The breaker opened after 3 failures: the dead engine saw only those attempts.
    assert_eq!(dead.request_stats().requests_received, 3);
    assert_eq!(dead.request_stats().requests_completed, 0);
    let w = gw.shared().workers.get(0).unwrap();
    assert_eq!(
        w.breaker_state(gw.shared().now_ms()),
        kvroute_core::health::BreakerState::Open
    );
    let metrics = get(gw.local_addr(), "/metrics").text();
    let retries: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_retries_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(retries, 3.0, "{metrics}");
    loads_back_to_zero(&gw);
    gw.shutdown();
}

/// The text of an SSE chat stream (content deltas in order) and whether it ended with an
/// error event.
fn stream_text(body: &[u8]) -> (String, bool, bool) {
    let mut text = String::new();
    let (mut error, mut done) = (false, false);
    for ev in String::from_utf8_lossy(body).split("\n\n") {
        let Some(d) = ev.strip_prefix("data: ") else {
            continue;
        };
        if d == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(d).expect("event JSON");
        if v.get("error").is_some() {
            error = true;
        }
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(c);
        }
    }
    (text, error, done)
}

/// Killed mid-stream: without migration the client's stream ends cleanly with an error event
/// and `[DONE]`; with `--migration-limit 1` it continues on the other engine and its text
/// equals an unbroken run's.
#[test]
fn killed_mid_stream_ends_cleanly_or_migrates() {
    let mut body = chat("tell me a long story about routers", 40);
    body["stream_options"] = json!({"include_usage": true});
    // The `usage` of an SSE stream (its last event with one).
    let usage_of = |body: &[u8]| {
        String::from_utf8_lossy(body)
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .filter_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
            .last()
    };
    // The unbroken run, straight to a healthy engine.
    let reference = engine(MODEL);
    let direct = post(reference.addr, "/v1/chat/completions", &body);
    let (want, _, _) = stream_text(&direct.body);
    assert!(want.len() > 40, "{want}");
    // (migrate, the router tokenizes: token mode)
    for (migrate, tokens) in [(false, false), (true, false), (true, true)] {
        let dying = faulty(EngineFaults {
            die_after_tokens: Some(15),
            ..EngineFaults::default()
        });
        let good = engine(MODEL);
        let gw = gateway_for(&[&dying, &good], |c| {
            c.migration_limit = u32::from(migrate);
            if tokens {
                c.tokenizer = Some(kvroute_core::tokens::BUILTIN_QWEN3.into());
            }
        });
        let r = post(gw.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-kvroute-worker"), Some("0"));
        let (text, error, done) = stream_text(&r.body);
        assert!(done, "stream ended with [DONE] (migrate {migrate})");
        if migrate {
            assert!(!error, "{}", r.text());
            assert_eq!(text, want, "migrated stream equals the unbroken one");
            // The client is told the whole request's usage, not the continuation's. In text
            // mode its prompt count is the continuation's minus the streamed tokens, which
            // keeps the 4 tokens of Qwen3's empty think block around the final assistant
            // message; in token mode it is the prompt the router tokenized.
            let (got, want) = (usage_of(&r.body).unwrap(), usage_of(&direct.body).unwrap());
            let seam = if tokens { 0 } else { 4 };
            let prompt = want["prompt_tokens"].as_u64().unwrap() + seam;
            assert_eq!(got["prompt_tokens"], prompt, "{got} vs {want}");
            assert_eq!(got["completion_tokens"], want["completion_tokens"]);
            assert_eq!(got["total_tokens"], prompt + 40, "{got}");
            assert_eq!(good.request_stats().requests_completed, 1);
            let role_deltas = r.text().matches("\"role\"").count();
            assert_eq!(role_deltas, 1, "{}", r.text());
        } else {
            assert!(error, "{}", r.text());
            assert!(want.starts_with(&text) && text.len() < want.len(), "{text}");
            assert_eq!(good.request_stats().requests_received, 0);
        }
        assert_eq!(dying.request_stats().requests_completed, 0);
        loads_back_to_zero(&gw);
        gw.shutdown();
    }
}

/// Stopped (SIGSTOP-like): the first-byte timeout fails the attempt, the request is retried
/// on the other engine; 503 from a worker is retried too.
#[test]
fn stalled_and_503_workers_are_retried_elsewhere() {
    let stalled = faulty(EngineFaults {
        stall: true,
        ..EngineFaults::default()
    });
    let busy = faulty(EngineFaults {
        status: Some(503),
        ..EngineFaults::default()
    });
    let good = engine(MODEL);
    let gw = gateway_for(&[&stalled, &busy, &good], |c| {
        c.first_byte_timeout_secs = 1;
        c.health_check_interval_secs = 0;
    });
    let t0 = Instant::now();
    // seq 0 → worker 0 (stalled) → timeout → worker 1 (503) → worker 2.
    let r = post_id(
        gw.local_addr(),
        "/v1/completions",
        &completion(0, 4),
        "stall-0",
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvroute-worker"), Some("2"));
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(busy.request_stats().requests_failed, 1);
    assert_eq!(good.request_stats().requests_completed, 1);
    // The stalled engine's held request was dropped when the router gave up on it.
    stalled.set_faults(EngineFaults::default()).unwrap();
    assert!(wait_until(Duration::from_secs(2), || stalled
        .request_stats()
        .requests_completed
        == 0));
    loads_back_to_zero(&gw);
    gw.shutdown();
}

/// Refused everywhere: 502 in the OpenAI error shape after the retry budget, naming workers
/// by id only; nothing left in flight.
#[test]
fn refused_everywhere_is_a_502_after_the_budget() {
    // Port 1 of three loopback addresses: nothing listens there, and no other test's
    // server can take it (bind(0) never hands out port 1), as it could a freed port.
    let dead: Vec<SocketAddr> = (1..=3)
        .map(|i| format!("127.0.0.{i}:1").parse().unwrap())
        .collect();
    let mut cfg = Config {
        listen: "127.0.0.1:0".into(),
        workers: dead.iter().map(|a| format!("http://{a}")).collect(),
        policy: PolicyKind::LeastRequest,
        shards: Some(1),
        admin_listen: String::new(),
        health_check_interval_secs: 0,
        retry_max: 2,
        retry_initial_backoff_ms: 5,
        ..Config::default()
    };
    cfg.retry_budget_cap = 100;
    let gw = gateway::start(cfg, false).unwrap();
    let r = post(gw.local_addr(), "/v1/completions", &completion(0, 2));
    assert_eq!(r.status, 502, "{}", r.text());
    let e = r.json();
    assert_eq!(e["error"]["type"], "upstream_error");
    for a in &dead {
        assert!(!r.text().contains(&a.to_string()), "{}", r.text());
    }
    loads_back_to_zero(&gw);
    gw.shutdown();
}

/// Restarted: a killed engine is taken out by health checks, and once it answers again on the
/// same port it is back in rotation, its indexes purged first.
#[test]
fn restarted_engine_is_back_in_rotation_after_health_checks() {
    let a = engine(MODEL);
    let b = engine(MODEL);
    let a_addr = a.addr;
    let gw = gateway_for(&[&a, &b], |c| {
        c.health_check_interval_secs = 1;
        c.health_check_timeout_secs = 1;
        c.policy = PolicyKind::CacheAware;
    });
    let prompt = |i: usize| json!({"model": MODEL, "prompt": format!("{} {i}", "shared system prompt ".repeat(20)), "max_tokens": 2});
    let r = post(gw.local_addr(), "/v1/completions", &prompt(0));
    assert_eq!(r.status, 200);
    a.shutdown();
    // Requests keep succeeding while the engine is down.
    for i in 1..6 {
        let r = post(gw.local_addr(), "/v1/completions", &prompt(i));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-kvroute-worker"), Some("1"));
    }
    let w0 = gw.shared().workers.get(0).unwrap();
    assert!(
        wait_until(Duration::from_secs(6), || !w0.is_healthy()),
        "unhealthy after 3 checks"
    );
    let restarted = engine::server::spawn(
        EngineConfig {
            listen: a_addr,
            ..engine_cfg(MODEL)
        },
        tokenizer(),
    )
    .expect("restart on the same port");
    assert!(
        wait_until(Duration::from_secs(6), || w0.is_healthy()),
        "healthy after 2 checks"
    );
    // Back in rotation: least loaded with no affinity left for it → some request lands there.
    let back = (10..40).any(|i| {
        let r = post(gw.local_addr(), "/v1/completions", &json!({"model": MODEL, "prompt": format!("fresh prompt {i} {}", "x".repeat(i)), "max_tokens": 1}));
        r.header("x-kvroute-worker") == Some("0")
    });
    assert!(back, "the restarted engine never served again");
    // The tree's size is exported per model.
    let metrics = get(gw.local_addr(), "/metrics").text();
    let chars = metrics
        .lines()
        .find(|l| {
            l.starts_with("kvroute_index_size{") && l.contains("tree_chars") && l.contains(MODEL)
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert!(chars.is_some_and(|c| c > 0.0), "{metrics}");
    assert!(restarted.request_stats().requests_completed >= 1);
    loads_back_to_zero(&gw);
    gw.shutdown();
}

/// An engine that comes up after the router (it starts unhealthy) is in rotation within
/// seconds, long before the next round of every worker (30 s here): unhealthy workers are
/// checked every second.
#[test]
fn an_engine_up_after_the_router_is_in_rotation_within_seconds() {
    let early = engine(MODEL);
    let late = engine(MODEL);
    let addr = early.addr;
    early.shutdown();
    let gw = gateway_for(&[&late], |c| {
        c.workers.insert(0, format!("http://{addr}"));
        c.health_check_interval_secs = 30;
        c.health_check_timeout_secs = 1;
    });
    let w0 = gw.shared().workers.get(0).unwrap();
    assert!(!w0.is_healthy(), "down at start-up");
    let t0 = Instant::now();
    let up = engine::server::spawn(
        EngineConfig {
            listen: addr,
            ..engine_cfg(MODEL)
        },
        tokenizer(),
    )
    .expect("the engine starts on its port");
    assert!(
        wait_until(Duration::from_secs(5), || w0.is_healthy()),
        "still unhealthy after {:?}",
        t0.elapsed()
    );
    let served = (0..8).any(|i| {
        let r = post(gw.local_addr(), "/v1/completions", &completion(i, 1));
        r.header("x-kvroute-worker") == Some("0")
    });
    assert!(served, "never routed to the late engine");
    assert!(up.request_stats().requests_completed >= 1);
    gw.shutdown();
}

/// Model-aware routing: each model goes only to its workers; missing model → 400, unknown →
/// 404; `/v1/models` is the union and `/v1/models/{id}` answers; neither is a decision.
#[test]
fn models_route_to_their_workers() {
    let alpha = engine("alpha");
    let beta = engine("beta");
    let gw = gateway_for(&[&alpha, &beta], |c| c.policy = PolicyKind::LeastRequest);
    let addr = gw.local_addr();
    for i in 0..8 {
        for (model, worker) in [("alpha", "0"), ("beta", "1")] {
            let body = json!({"model": model, "prompt": format!("p{i}"), "max_tokens": 1});
            let r = post(addr, "/v1/completions", &body);
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.header("x-kvroute-worker"), Some(worker));
        }
    }
    let r = post(addr, "/v1/completions", &json!({"prompt": "x"}));
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("model")
    );
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": "gamma", "prompt": "x"}),
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let list = get(addr, "/v1/models").json();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        (list["object"].as_str(), ids),
        (Some("list"), vec!["alpha", "beta"])
    );
    let one = get(addr, "/v1/models/beta");
    assert_eq!((one.status, one.json()["id"].as_str()), (200, Some("beta")));
    assert_eq!(get(addr, "/v1/models/gamma").status, 404);
    let metrics = get(addr, "/metrics").text();
    let decisions: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_decisions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(decisions, 16.0, "model listings are not routing decisions");
    assert_eq!(alpha.request_stats().requests_failed, 0);
    assert_eq!(beta.request_stats().requests_failed, 0);
    gw.shutdown();
}

/// A one-request upstream that records the head it got and answers 200.
fn capture_upstream() -> (SocketAddr, std::thread::JoinHandle<String>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = Vec::new();
        let mut tmp = [0u8; 4096];
        while find(&buf, b"\r\n\r\n").is_none() {
            let n = s.read(&mut tmp).unwrap();
            buf.extend_from_slice(&tmp[..n]);
        }
        let body = r#"{"ok":true}"#;
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive, X-Hop\r\nX-Hop: secret\r\nX-Request-Id: bogus\r\nX-Kvroute-Worker: 99\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(resp.as_bytes()).unwrap();
        String::from_utf8_lossy(&buf).into_owned()
    });
    (addr, h)
}

/// Client keys: 401 in the OpenAI shape without the right one; the worker's own key replaces
/// the client's `Authorization` (exactly one upstream); headers named in `Connection` are
/// stripped both ways; `x-request-id` goes up once and comes back; header names match in any
/// case, and an absolute-form target (RFC 9112 §3.2.2) goes upstream in origin form.
#[test]
fn api_keys_worker_keys_and_hop_by_hop_headers() {
    let (up, seen) = capture_upstream();
    let home = std::env::var("HOME").expect("HOME is set");
    let gw = gateway::start(
        Config {
            listen: "127.0.0.1:0".into(),
            workers: vec![format!("http://{up};api_key_env=HOME")],
            shards: Some(1),
            admin_listen: String::new(),
            health_check_interval_secs: 0,
            api_keys: vec!["sk-client".into()],
            ..Config::default()
        },
        false,
    )
    .unwrap();
    let addr = gw.local_addr();
    let body = br#"{"model":"m","prompt":"x"}"#;
    let req = |auth: &str| {
        let mut raw = format!(
            "POST http://x/v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Connection: close, X-Private\r\nX-Private: 1\r\nX-Request-Id: rid-9\r\nX-Custom-Case: 1\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        raw.extend_from_slice(body);
        send_raw(addr, &raw)
    };
    for auth in [
        "",
        "authorization: Bearer sk-wrong\r\n",
        "authorization: Basic abc\r\n",
    ] {
        let r = req(auth);
        assert_eq!(r.status, 401, "{auth:?}");
        assert_eq!(r.json()["error"]["code"], 401);
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    assert_eq!(get(addr, "/health").status, 200, "probes need no key");
    let r = req("Authorization: Bearer sk-client\r\n");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-request-id"), Some("rid-9"));
    assert_eq!(
        r.header("x-hop"),
        None,
        "a header the worker named in Connection"
    );
    assert_eq!(
        r.header("x-kvroute-worker"),
        Some("0"),
        "kvroute's own, not the worker's"
    );
    assert_eq!(
        r.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("x-request-id"))
            .count(),
        1
    );
    let raw = seen.join().unwrap();
    assert!(
        raw.contains("\r\nX-Custom-Case: 1\r\n"),
        "forwarded as spelled: {raw}"
    );
    let head = raw.to_lowercase();
    assert_eq!(head.matches("authorization:").count(), 1, "{head}");
    assert!(
        head.contains(&format!("authorization: bearer {}", home.to_lowercase())),
        "{head}"
    );
    assert!(!head.contains("sk-client"), "{head}");
    assert!(!head.contains("x-private"), "{head}");
    assert!(
        head.starts_with("post /v1/completions http/1.1\r\n"),
        "{head}"
    );
    assert_eq!(head.matches("x-request-id:").count(), 1, "{head}");
    assert!(head.contains("x-request-id: rid-9"), "{head}");
    gw.shutdown();
}

fn admin(gw: &Server, method: &str, path: &str, body: &str, key: Option<&str>) -> Response {
    let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
    let raw = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\n{auth}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    send_raw(gw.admin_addr().unwrap(), raw.as_bytes())
}

/// The admin API: a wrong or missing key is 401; add, drain with a stream in flight (it
/// finishes), remove (indexes purged, subscription gone), re-add (a new id).
#[test]
fn admin_api_adds_drains_removes_and_re_adds() {
    let a = engine(MODEL);
    let b = engine(MODEL);
    let gw = gateway_for(&[&a], |c| c.admin_api_key = Some("adm".into()));
    assert_eq!(admin(&gw, "GET", "/workers", "", None).status, 401);
    assert_eq!(admin(&gw, "GET", "/workers", "", Some("nope")).status, 401);
    let list = admin(&gw, "GET", "/workers", "", Some("adm")).json();
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["state"], "healthy");
    assert_eq!(list[0]["models"], json!([MODEL]));
    let add = admin(
        &gw,
        "POST",
        "/workers",
        &json!({"url": format!("http://{}", b.addr)}).to_string(),
        Some("adm"),
    );
    assert_eq!((add.status, add.json()["id"].as_u64()), (201, Some(1)));
    let dup = admin(
        &gw,
        "POST",
        "/workers",
        &json!({"url": format!("http://{}", b.addr)}).to_string(),
        Some("adm"),
    );
    assert_eq!(dup.status, 409);
    assert_eq!(
        dup.json()["error"]["message"],
        format!("worker http://{} is already in the fleet", b.addr)
    );
    assert_eq!(
        admin(&gw, "POST", "/workers", r#"{"url":"ftp://x"}"#, Some("adm")).status,
        400
    );
    // A key variable that is not set: refused, naming it, not added without its key.
    let unset = json!({"url": "http://127.0.0.1:9;api_key_env=KVROUTE_TEST_UNSET_KEY"});
    let r = admin(&gw, "POST", "/workers", &unset.to_string(), Some("adm"));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("api_key_env names KVROUTE_TEST_UNSET_KEY, which is unset or empty"),
        "{}",
        r.text()
    );
    // A long stream on worker 0 (seq 0 → the first eligible), then drain worker 0.
    let long = serde_json::to_vec(&chat("a long answer please", 300)).unwrap();
    let mut stream = open_post(gw.local_addr(), "/v1/chat/completions", &long);
    let mut first = [0u8; 256];
    let n = stream.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).contains("x-kvroute-worker: 0"));
    assert_eq!(
        admin(&gw, "POST", "/workers/0/drain", "", Some("adm")).json()["state"],
        "draining"
    );
    for i in 0..4 {
        let r = post(gw.local_addr(), "/v1/completions", &completion(i, 1));
        assert_eq!(
            r.header("x-kvroute-worker"),
            Some("1"),
            "a draining worker takes nothing new"
        );
    }
    // The connection stays open (keep-alive): read up to the chunked terminator.
    let mut rest = Vec::new();
    let mut tmp = [0u8; 4096];
    while !rest.ends_with(b"0\r\n\r\n") {
        let n = stream
            .read(&mut tmp)
            .expect("the drained worker's stream goes on");
        assert!(n > 0, "closed before the stream ended");
        rest.extend_from_slice(&tmp[..n]);
    }
    assert!(
        String::from_utf8_lossy(&rest).contains("data: [DONE]"),
        "the stream finished"
    );
    let del = admin(&gw, "DELETE", "/workers/0", "", Some("adm"));
    assert_eq!(del.status, 200);
    let list = admin(&gw, "GET", "/workers", "", Some("adm")).json();
    let ids: Vec<u64> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, vec![1]);
    assert_eq!(
        admin(&gw, "DELETE", "/workers/0", "", Some("adm")).status,
        404
    );
    let again = admin(
        &gw,
        "POST",
        "/workers",
        &json!({"url": format!("http://{}", a.addr)}).to_string(),
        Some("adm"),
    );
    assert_eq!((again.status, again.json()["id"].as_u64()), (201, Some(2)));
    loads_back_to_zero(&gw);
    gw.shutdown();
}

/// The probes answer on the admin port without its key, as on the traffic port (a saturated
/// traffic port cannot starve them there). Readiness stays 200 while one of two models has no
/// worker, naming it (its requests get 503 with `Retry-After`), and turns 503 once no worker
/// is available.
#[test]
fn probes_on_the_admin_port_and_readiness_with_a_model_down() {
    let a = engine(MODEL);
    let gw = gateway_for(&[&a], |c| {
        c.admin_api_key = Some("adm".into());
        c.workers.push("http://127.0.0.1:1;model=other".into());
    });
    let ports = [gw.local_addr(), gw.admin_addr().unwrap()];
    for addr in ports {
        let r = get(addr, "/readiness");
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(
            r.json(),
            json!({"status": "ready", "models_without_worker": ["other"]})
        );
        assert_eq!(get(addr, "/liveness").json(), json!({"status": "ok"}));
        assert_eq!(get(addr, "/health").status, 200);
    }
    assert_eq!(admin(&gw, "GET", "/workers", "", None).status, 401);
    let r = post(
        gw.local_addr(),
        "/v1/completions",
        &json!({"model": "other", "prompt": "x"}),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(
        admin(&gw, "POST", "/workers/0/drain", "", Some("adm")).status,
        200
    );
    for addr in ports {
        let r = get(addr, "/readiness");
        assert_eq!(r.status, 503, "{}", r.text());
        assert_eq!(
            r.json(),
            json!({"status": "not_ready", "reason": "no eligible worker"})
        );
    }
    gw.shutdown();
}

/// SIGTERM's path: readiness turns false, streams in flight finish, new connections are
/// refused, and nothing is cut.
#[test]
fn shutdown_lets_streams_in_flight_finish() {
    let a = engine(MODEL);
    let gw = gateway_for(&[&a], |c| c.shutdown_timeout_secs = 10);
    let addr = gw.local_addr();
    assert_eq!(get(addr, "/readiness").status, 200);
    let long = serde_json::to_vec(&chat("a long answer please", 400)).unwrap();
    let mut streams: Vec<TcpStream> = (0..2)
        .map(|_| open_post(addr, "/v1/chat/completions", &long))
        .collect();
    for s in &mut streams {
        let mut first = [0u8; 64];
        assert!(s.read(&mut first).unwrap() > 0);
    }
    let shared = gw.shared().clone();
    let admin_addr = gw.admin_addr().unwrap();
    let stopper = std::thread::spawn(move || gw.shutdown());
    assert!(wait_until(Duration::from_secs(2), || shared.is_shutting_down()));
    assert!(!shared.is_ready());
    // The probes' port answers while streams finish.
    let r = get(admin_addr, "/readiness");
    assert_eq!(
        (r.status, r.json()),
        (503, json!({"status": "shutting_down"}))
    );
    for s in &mut streams {
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        assert!(String::from_utf8_lossy(&rest).contains("data: [DONE]"));
    }
    assert_eq!(stopper.join().unwrap(), 0, "no exchange cut");
    assert!(TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err());
    assert_eq!(a.request_stats().requests_completed, 2);
}

/// Past the shutdown grace (1 s here) what is still in flight ends cleanly: a stream with an
/// error event and `[DONE]`, an attempt still waiting for its first byte with a 503; both
/// are counted as cut.
#[test]
fn shutdown_past_the_grace_cuts_cleanly() {
    let streaming = engine(MODEL);
    let stalled = engine(MODEL);
    let gw = gateway_for(&[&streaming, &stalled], |c| c.shutdown_timeout_secs = 1);
    // Stopped once the gateway counts it healthy (a stopped engine starts unhealthy).
    stalled
        .set_faults(EngineFaults {
            stall: true,
            ..EngineFaults::default()
        })
        .unwrap();
    let addr = gw.local_addr();
    // Round robin: the stream (~10 s of tokens) on worker 0, the completion on worker 1.
    let long = serde_json::to_vec(&chat("a very long answer please", 4000)).unwrap();
    let mut stream = open_post(addr, "/v1/chat/completions", &long);
    let mut first = [0u8; 64];
    assert!(stream.read(&mut first).unwrap() > 0);
    let waiting = std::thread::spawn(move || post(addr, "/v1/completions", &completion(0, 4)));
    let shared = gw.shared().clone();
    assert!(wait_until(Duration::from_secs(2), || shared
        .in_flight
        .load(std::sync::atomic::Ordering::SeqCst)
        == 2));
    let t0 = Instant::now();
    let stopper = std::thread::spawn(move || gw.shutdown());
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("the router shut down mid-stream"), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let r = waiting.join().unwrap();
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(
        r.json()["error"]["message"],
        "the router shut down before a worker answered"
    );
    assert_eq!(stopper.join().unwrap(), 2, "both cut");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    stalled.set_faults(EngineFaults::default()).unwrap();
}

/// Bad input and slow clients get clear errors and the server keeps serving: a port another
/// process holds, a head that never completes (408), a body that stops short (408), a
/// keep-alive connection left idle (closed), too many connections (503).
#[test]
fn port_in_use_slow_clients_and_connection_limits() {
    let a = engine(MODEL);
    let gw = gateway_for(&[&a], |c| {
        c.client_header_timeout_secs = 1;
        c.client_body_timeout_secs = 1;
        c.client_idle_timeout_secs = 1;
        c.max_connections_per_shard = 2;
    });
    let addr = gw.local_addr();
    // A second gateway on the same port fails with a clear error.
    let second = gateway::start(
        Config {
            listen: addr.to_string(),
            workers: vec![format!("http://{}", a.addr)],
            admin_listen: String::new(),
            ..Config::default()
        },
        false,
    );
    let err = second.err().expect("the port is taken").to_string();
    assert!(err.contains("already in use"), "{err}");
    // Slowloris: half a head, then nothing.
    let mut slow = TcpStream::connect(addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .unwrap();
    let t0 = Instant::now();
    let r = read_response(&mut slow);
    assert_eq!(r.status, 408);
    assert!(t0.elapsed() < Duration::from_secs(3));
    // A body that stops at 10 of its 100 bytes.
    let mut short = TcpStream::connect(addr).unwrap();
    short
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    short
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"model\":",
        )
        .unwrap();
    let t0 = Instant::now();
    let r = read_response(&mut short);
    assert_eq!(r.status, 408, "{}", r.text());
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert_eq!(
        a.request_stats().requests_received,
        0,
        "nothing was sent on"
    );
    // A keep-alive connection idle after its answer is closed after the idle timeout.
    let mut kept = TcpStream::connect(addr).unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut kept).status, 200);
    let t0 = Instant::now();
    let mut byte = [0u8; 1];
    assert_eq!(
        kept.read(&mut byte).unwrap(),
        0,
        "closed, nothing more sent"
    );
    let idle = t0.elapsed();
    assert!(
        idle > Duration::from_millis(500) && idle < Duration::from_secs(3),
        "{idle:?}"
    );
    // Two idle connections fill the shard; the third is refused with 503.
    let idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut third = TcpStream::connect(addr).unwrap();
    third
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let refused = read_response(&mut third);
    assert_eq!(refused.status, 503);
    assert_eq!(refused.header("retry-after"), Some("1"));
    drop(idle);
    assert!(wait_until(Duration::from_secs(3), || get(addr, "/health")
        .status
        == 200));
    gw.shutdown();
}

/// Every 5xx answer counts as a worker error, the 500 that goes to the client as it is (a
/// breaker failure, not retried) as much as the 503 that is retried.
#[test]
fn every_5xx_answer_counts_as_a_worker_error() {
    let broken = faulty(EngineFaults {
        status: Some(500),
        ..EngineFaults::default()
    });
    let busy = faulty(EngineFaults {
        status: Some(503),
        ..EngineFaults::default()
    });
    let gw = gateway_for(&[&broken, &busy], |_| {});
    // Round robin: one request goes to worker 0 (500, to the client), the other to worker 1
    // (503), retried on worker 0 (500, to the client).
    for _ in 0..2 {
        let r = post(gw.local_addr(), "/v1/completions", &completion(0, 2));
        assert_eq!(r.status, 500, "{}", r.text());
    }
    let text = get(gw.local_addr(), "/metrics").text();
    let errors = |w: &str| {
        metric(
            &text,
            &format!("kvroute_worker_errors_total{{worker=\"{w}\",kind=\"status_5xx\"}}"),
        )
    };
    assert_eq!((errors("0"), errors("1")), (Some(2.0), Some(1.0)), "{text}");
    gw.shutdown();
}

/// A one-shard gateway in front of the worker at `up` alone, health checks off.
fn gateway_on(up: SocketAddr, tweak: impl FnOnce(&mut Config)) -> Server {
    let mut cfg = Config {
        listen: "127.0.0.1:0".into(),
        workers: vec![format!("http://{up}")],
        shards: Some(1),
        admin_listen: String::new(),
        health_check_interval_secs: 0,
        ..Config::default()
    };
    tweak(&mut cfg);
    gateway::start(cfg, false).unwrap()
}

/// A worker that sends one SSE event, then nothing for 4 s (a wedged engine), then closes.
fn silent_worker() -> (SocketAddr, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let up = l.local_addr().unwrap();
    let silent = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut tmp = [0u8; 4096];
        let _ = c.read(&mut tmp);
        let event = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
            event.len()
        );
        c.write_all(head.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_secs(4));
    });
    (up, silent)
}

/// A worker silent mid-stream for `--stream-idle-timeout-secs` (1 s here) failed: the stream
/// ends with an error event naming the wait long before the request timeout, and the worker
/// is charged with it.
#[test]
fn a_stream_silent_past_the_idle_timeout_is_a_worker_failure() {
    let (up, silent) = silent_worker();
    let gw = gateway_on(up, |c| c.stream_idle_timeout_secs = 1);
    let t0 = Instant::now();
    let r = post(gw.local_addr(), "/v1/chat/completions", &chat("hello", 10));
    let took = t0.elapsed();
    assert_eq!(r.status, 200);
    let (text, error, done) = stream_text(&r.body);
    assert_eq!(text, "hi");
    assert!(error && done, "{}", r.text());
    assert!(
        r.text()
            .contains("worker 0 sent nothing for 1 s mid-stream"),
        "{}",
        r.text()
    );
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let metrics = get(gw.local_addr(), "/metrics").text();
    assert_eq!(
        metric(
            &metrics,
            "kvroute_worker_errors_total{worker=\"0\",kind=\"stream_idle_timeout\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    loads_back_to_zero(&gw);
    gw.shutdown();
    silent.join().unwrap();
}

/// A lone worker's own 503 reaches the client as it is (no retry can go anywhere, none is
/// counted); a stream cut by `--request-timeout-secs` ends with an error event and does not
/// count against the worker's breaker.
#[test]
fn a_lone_workers_503_and_the_request_timeout() {
    let busy = faulty(EngineFaults {
        status: Some(503),
        ..EngineFaults::default()
    });
    let gw = gateway_for(&[&busy], |_| {});
    let r = post(gw.local_addr(), "/v1/completions", &completion(0, 2));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(
        r.header("x-kvroute-worker"),
        Some("0"),
        "the worker's own answer"
    );
    let metrics = get(gw.local_addr(), "/metrics").text();
    assert!(
        !metrics
            .lines()
            .any(|l| l.starts_with("kvroute_retries_total{")),
        "{metrics}"
    );
    gw.shutdown();

    // A worker whose stream stops after its first event runs into the 2 s request timeout.
    let (up, silent) = silent_worker();
    let gw = gateway_on(up, |c| c.request_timeout_secs = 2);
    let t0 = Instant::now();
    let r = post(gw.local_addr(), "/v1/chat/completions", &chat("hello", 10));
    assert_eq!(r.status, 200);
    let (text, error, done) = stream_text(&r.body);
    assert_eq!(text, "hi");
    assert!(error && done, "{}", r.text());
    assert!(r.text().contains("request-timeout-secs"), "{}", r.text());
    assert!(t0.elapsed() < Duration::from_secs(4));
    let metrics = get(gw.local_addr(), "/metrics").text();
    assert!(
        !metrics.contains("kind=\"upstream_body\""),
        "the router's own limit is not the worker's failure: {metrics}"
    );
    loads_back_to_zero(&gw);
    gw.shutdown();
    silent.join().unwrap();
}

/// A stopped engine that health checks take out releases the attempts waiting on it at once:
/// the client is served elsewhere within the checks' detection time, long before the
/// first-byte timeout.
#[test]
fn attempts_on_a_worker_that_turns_unhealthy_move_on() {
    let good = engine(MODEL);
    let stopped = engine(MODEL);
    let gw = gateway_for(&[&stopped, &good], |c| {
        c.health_check_interval_secs = 1;
        c.health_check_timeout_secs = 1;
        c.first_byte_timeout_secs = 60;
    });
    stopped
        .set_faults(EngineFaults {
            stall: true,
            ..EngineFaults::default()
        })
        .unwrap();
    let t0 = Instant::now();
    // seq 0 → worker 0, the stopped one.
    let r = post(gw.local_addr(), "/v1/completions", &completion(0, 2));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-kvroute-worker"), Some("1"));
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "{took:?}: waited for the first-byte timeout"
    );
    assert!(!gw.shared().workers.get(0).unwrap().is_healthy());
    stopped.set_faults(EngineFaults::default()).unwrap();
    loads_back_to_zero(&gw);
    gw.shutdown();
}

/// Hung workers are checked side by side: three engines stopped at once are all out within
/// the 3 failed checks of 1 s rounds (~3–4 s), where checks one worker at a time took a
/// 1 s timeout per hung worker per round (~9 s).
#[test]
fn health_checks_of_hung_workers_run_side_by_side() {
    let good = engine(MODEL);
    let hung: Vec<_> = (0..3).map(|_| engine(MODEL)).collect();
    let mut all: Vec<&EngineHandle> = hung.iter().collect();
    all.push(&good);
    let gw = gateway_for(&all, |c| {
        c.health_check_interval_secs = 1;
        c.health_check_timeout_secs = 1;
    });
    let stall = EngineFaults {
        stall: true,
        ..EngineFaults::default()
    };
    for e in &hung {
        e.set_faults(stall.clone()).unwrap();
    }
    let t0 = Instant::now();
    let out = |w: usize| !gw.shared().workers.get(w).unwrap().is_healthy();
    assert!(
        wait_until(Duration::from_secs(12), || (0..3).all(out)),
        "not all out"
    );
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(6), "{took:?}");
    assert!(!out(3), "the good worker stays in");
    for e in &hung {
        e.set_faults(EngineFaults::default()).unwrap();
    }
    gw.shutdown();
}

/// Removing a worker that publishes KV events purges its blocks from the event index and
/// cancels its subscription; its engine's later stores never reach the index (bug-cases.md
/// B35).
#[test]
fn removing_a_worker_purges_its_events_and_cancels_its_subscription() {
    use kvroute_bench::engine::events::KvEventsConfig;
    let cfg = EngineConfig {
        kv_events: Some(KvEventsConfig {
            events_addr: "127.0.0.1:0".into(),
            replay_addr: Some("127.0.0.1:0".into()),
            ..KvEventsConfig::default()
        }),
        ..engine_cfg(MODEL)
    };
    let e = engine::server::spawn(cfg, tokenizer()).expect("engine starts");
    let spec = format!(
        "http://{};events={};replay={}",
        e.addr,
        e.kv_events_endpoint.as_deref().unwrap(),
        e.kv_replay_endpoint.as_deref().unwrap()
    );
    let other = engine(MODEL);
    let gw = gateway::start(
        Config {
            listen: "127.0.0.1:0".into(),
            workers: vec![spec, format!("http://{}", other.addr)],
            shards: Some(1),
            admin_listen: "127.0.0.1:0".into(),
            tokenizer: Some(kvroute_core::tokens::BUILTIN_QWEN3.into()),
            ..Config::default()
        },
        false,
    )
    .unwrap();
    let blocks =
        |gw: &Server| kvroute_io::zmq::lock(gw.shared().events.as_ref().unwrap()).worker_blocks(0);
    let long = |i: usize| {
        json!({"model": MODEL, "max_tokens": 2,
        "prompt": format!("{i} {}", "a prompt long enough to fill a few KV blocks ".repeat(12))})
    };
    let mut i = 0;
    assert!(
        wait_until(Duration::from_secs(5), || {
            i += 1;
            post_id(e.addr, "/v1/completions", &long(i), "direct").status == 200 && blocks(&gw) > 0
        }),
        "the engine's stores reached the index"
    );
    assert!(gw.shared().subscriptions.lock().unwrap().contains_key(&0));
    assert_eq!(admin(&gw, "DELETE", "/workers/0", "", None).status, 200);
    assert_eq!(blocks(&gw), 0, "purged");
    assert!(!gw.shared().subscriptions.lock().unwrap().contains_key(&0));
    // Stores the engine makes now are not applied.
    std::thread::sleep(Duration::from_millis(300));
    for j in 0..3 {
        assert_eq!(post(e.addr, "/v1/completions", &long(1000 + j)).status, 200);
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(blocks(&gw), 0, "the cancelled subscription applied events");
    gw.shutdown();
}
