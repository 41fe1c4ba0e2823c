//! Fault switches, request counts, continuation and model checks of the simulated engine
//! (`server.rs`): each test starts its own engines on 127.0.0.1:0 and talks raw HTTP/1.1 over
//! loopback TCP, so a killed connection is seen exactly as a client would see it.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvroute_bench::engine::{EngineConfig, EngineFaults, EngineHandle, RequestStats, spawn};
use kvroute_tokenize::Tokenizer;
use serde_json::{Value, json};

fn tokenizer() -> Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| Arc::new(Tokenizer::qwen3().expect("embedded qwen3")))
        .clone()
}

fn start(cfg: EngineConfig) -> EngineHandle {
    spawn(
        EngineConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..cfg
        },
        tokenizer(),
    )
    .expect("engine starts")
}

/// No modelled delays: every token of a request is ready at once.
fn fast() -> EngineConfig {
    EngineConfig {
        speedup_ratio: 0.0,
        ..EngineConfig::default()
    }
}

fn faulty(faults: EngineFaults) -> EngineConfig {
    EngineConfig { faults, ..fast() }
}

/// Sends one request (`Connection: close`) with optional extra header lines.
fn send(addr: SocketAddr, method: &str, path: &str, body: &str, extra: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: engine\r\nConnection: close\r\n{extra}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    s
}

/// Everything the server sends until it closes the connection. `reset` is true when the
/// connection ended with an error (RST) rather than a clean EOF. Bounded by the 20 s read
/// timeout per read and 30 s in all.
fn read_all(s: &mut TcpStream) -> (Vec<u8>, bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => return (raw, false),
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                assert!(
                    matches!(
                        e.kind(),
                        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
                    ),
                    "read failed: {e}"
                );
                return (raw, true);
            }
        }
    }
    panic!("connection still open after 30 s");
}

/// A parsed response: status, lower-cased head, body (de-chunked), and whether a chunked body
/// ended with its terminator (`true` for a non-chunked body).
struct Resp {
    status: u16,
    head: String,
    body: String,
    complete: bool,
}

fn parse(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8(raw[..split].to_vec())
        .unwrap()
        .to_ascii_lowercase();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let rest = &raw[split + 4..];
    let (body, complete) = if head.contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        (rest.to_vec(), true)
    };
    Resp {
        status,
        head,
        body: String::from_utf8(body).unwrap(),
        complete,
    }
}

/// Decodes a chunked body that may be cut anywhere; returns the data and whether the final
/// zero-size chunk arrived.
fn dechunk(mut b: &[u8]) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    for _ in 0..100_000 {
        let Some(nl) = b.windows(2).position(|w| w == b"\r\n") else {
            return (out, false);
        };
        let size_str = std::str::from_utf8(&b[..nl]).unwrap();
        let size = usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16).unwrap();
        b = &b[nl + 2..];
        if size == 0 {
            return (out, true);
        }
        if b.len() < size + 2 {
            out.extend_from_slice(&b[..size.min(b.len())]);
            return (out, false);
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
    panic!("too many chunks");
}

fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> Resp {
    let mut s = send(addr, method, path, body, "");
    parse(&read_all(&mut s).0)
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let r = http(addr, "POST", path, &body.to_string());
    assert!(r.complete, "{path}: cut response");
    (r.status, serde_json::from_str(&r.body).unwrap())
}

fn stats(addr: SocketAddr) -> RequestStats {
    let r = http(addr, "GET", "/_kvroute/stats", "");
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

fn set_faults(addr: SocketAddr, faults: &Value) -> Value {
    let (status, v) = post(addr, "/_kvroute/fault", faults);
    assert_eq!(status, 200, "{v}");
    v
}

/// `name{labels} value` from /metrics.
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let r = http(addr, "GET", "/metrics", "");
    assert_eq!(r.status, 200);
    r.body
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or_else(|| panic!("{name} missing"))
        .parse()
        .unwrap()
}

/// Waits (≤ 3 s) until `f` holds.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SSE `data:` payloads of a (possibly cut) stream body, `[DONE]` included as a string.
fn sse_events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let d = e.strip_prefix("data: ").expect("SSE data line");
            serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.to_string()))
        })
        .collect()
}

/// Generated text of a streamed body, for any of the three APIs.
fn streamed_text(path: &str, events: &[Value]) -> String {
    match path {
        "/v1/chat/completions" => events
            .iter()
            .filter_map(|e| e.pointer("/choices/0/delta/content")?.as_str())
            .collect(),
        "/v1/completions" => events
            .iter()
            .filter_map(|e| e.pointer("/choices/0/text")?.as_str())
            .collect(),
        _ => events
            .iter()
            .rev()
            .find_map(|e| e.get("text")?.as_str())
            .unwrap_or_default()
            .to_string(),
    }
}

/// Generated text of a non-streamed body.
fn full_text(path: &str, v: &Value) -> String {
    let p = match path {
        "/v1/chat/completions" => "/choices/0/message/content",
        "/v1/completions" => "/choices/0/text",
        _ => "/text",
    };
    v.pointer(p)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

const PATHS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/generate"];

/// A generation body for `path` with `max_tokens` and `stream`.
fn gen_body(path: &str, max_tokens: u32, stream: bool) -> Value {
    match path {
        "/v1/chat/completions" => json!({"model": "qwen3-sim", "max_tokens": max_tokens,
            "stream": stream, "messages": [{"role": "user", "content": "Tell me about caches"}]}),
        "/v1/completions" => json!({"model": "qwen3-sim", "max_tokens": max_tokens,
            "stream": stream, "prompt": "Tell me about caches"}),
        _ => json!({"text": "Tell me about caches", "stream": stream,
            "sampling_params": {"max_new_tokens": max_tokens}}),
    }
}

/// Words in a generated text (each output token is one " word").
fn words(text: &str) -> usize {
    text.split(' ').filter(|w| !w.is_empty()).count()
}

#[test]
fn die_after_tokens_streams_n_tokens_then_drops_the_connection() {
    let engine = start(faulty(EngineFaults {
        die_after_tokens: Some(3),
        ..EngineFaults::default()
    }));
    for path in PATHS {
        let mut s = send(
            engine.addr,
            "POST",
            path,
            &gen_body(path, 10, true).to_string(),
            "",
        );
        let (raw, _reset) = read_all(&mut s);
        let r = parse(&raw);
        assert_eq!(r.status, 200, "{path}");
        assert!(!r.complete, "{path}: chunked terminator sent: {}", r.body);
        assert!(!r.body.contains("[DONE]"), "{path}: {}", r.body);
        let events = sse_events(&r.body);
        let text = streamed_text(path, &events);
        assert_eq!(words(&text), 3, "{path}: {text:?}");
        assert!(
            events
                .iter()
                .all(|e| e.pointer("/choices/0/finish_reason") != Some(&json!("length"))),
            "{path}: a finish_reason was sent"
        );
    }
    let st = stats(engine.addr);
    assert_eq!(
        (
            st.requests_received,
            st.requests_aborted,
            st.requests_completed
        ),
        (3, 3, 0)
    );
    // Aborted in the engine too: nothing left running, blocks released.
    eventually("requests released", || {
        metric(engine.addr, "vllm:num_requests_running") == 0.0
            && metric(engine.addr, "vllm:kv_cache_usage_perc") == 0.0
    });
}

#[test]
fn die_after_tokens_non_streaming_dies_before_any_byte() {
    for n in [0u32, 4] {
        let engine = start(faulty(EngineFaults {
            die_after_tokens: Some(n),
            ..EngineFaults::default()
        }));
        for path in PATHS {
            for stream in [false, true] {
                if stream && n > 0 {
                    continue; // covered by the streaming test
                }
                let mut s = send(
                    engine.addr,
                    "POST",
                    path,
                    &gen_body(path, 10, stream).to_string(),
                    "",
                );
                let (raw, _) = read_all(&mut s);
                assert!(
                    raw.is_empty(),
                    "n={n} {path} stream={stream}: got {:?}",
                    String::from_utf8_lossy(&raw)
                );
            }
        }
        let st = stats(engine.addr);
        let sent = if n == 0 { 6 } else { 3 };
        assert_eq!((st.requests_received, st.requests_aborted), (sent, sent));
        // The engine still serves other endpoints.
        assert_eq!(http(engine.addr, "GET", "/health", "").status, 200);
    }
}

#[test]
fn die_after_tokens_spares_requests_that_end_by_then() {
    let engine = start(faulty(EngineFaults {
        die_after_tokens: Some(5),
        ..EngineFaults::default()
    }));
    for path in PATHS {
        let (status, v) = post(engine.addr, path, &gen_body(path, 5, false));
        assert_eq!(status, 200, "{path}: {v}");
        assert_eq!(words(&full_text(path, &v)), 5);
        let r = http(
            engine.addr,
            "POST",
            path,
            &gen_body(path, 5, true).to_string(),
        );
        assert!(r.complete && r.body.ends_with("data: [DONE]\n\n"), "{path}");
    }
    let st = stats(engine.addr);
    assert_eq!((st.requests_completed, st.requests_aborted), (6, 0));
}

/// Setting the fault on a running engine kills a stream already past N at its next token.
#[test]
fn die_set_at_run_time_kills_a_running_stream() {
    // Real step times (≈6 ms per token): 10,000 tokens would take a minute.
    let engine = start(EngineConfig::default());
    let body = gen_body("/v1/chat/completions", 10_000, true).to_string();
    let mut s = send(engine.addr, "POST", "/v1/chat/completions", &body, "");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    for _ in 0..10_000 {
        if String::from_utf8_lossy(&seen)
            .matches("\"content\":\" ")
            .count()
            >= 2
        {
            break;
        }
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    let state = set_faults(engine.addr, &json!({"die_after_tokens": 0}));
    assert_eq!(state["die_after_tokens"], 0);
    let (rest, _) = read_all(&mut s);
    seen.extend_from_slice(&rest);
    let r = parse(&seen);
    assert!(!r.complete && !r.body.contains("[DONE]"));
    let sent = words(&streamed_text("/v1/chat/completions", &sse_events(&r.body)));
    assert!((2..10_000).contains(&sent), "{sent} tokens");
    eventually("request aborted", || {
        metric(engine.addr, "vllm:num_requests_running") == 0.0
    });
    assert_eq!(stats(engine.addr).requests_aborted, 1);
}

#[test]
fn stall_holds_generation_and_health_until_cleared() {
    let engine = start(fast());
    let state = set_faults(engine.addr, &json!({"stall": true}));
    assert_eq!(state["stall"], true);
    let body = gen_body("/v1/completions", 3, false).to_string();
    let mut held_gen = send(engine.addr, "POST", "/v1/completions", &body, "");
    let mut held_health = send(engine.addr, "GET", "/health", "", "");
    let gone = send(engine.addr, "POST", "/v1/completions", &body, "");
    for s in [&mut held_gen, &mut held_health] {
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut buf = [0u8; 64];
        let e = s
            .read(&mut buf)
            .expect_err("a stalled engine sends nothing");
        assert!(
            matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{e}"
        );
    }
    // Held requests are not received yet; the control endpoints still answer.
    assert_eq!(stats(engine.addr).requests_received, 0);
    assert_eq!(http(engine.addr, "GET", "/_kvroute/fault", "").status, 200);
    drop(gone); // this client gives up while stalled
    std::thread::sleep(Duration::from_millis(100));
    set_faults(engine.addr, &json!({}));
    for s in [&mut held_gen, &mut held_health] {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    }
    let r = parse(&read_all(&mut held_gen).0);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(parse(&read_all(&mut held_health).0).status, 200);
    let st = stats(engine.addr);
    assert_eq!(
        (st.requests_received, st.requests_completed),
        (1, 1),
        "the abandoned request never reached the engine"
    );
}

#[test]
fn stall_freezes_a_running_stream() {
    let engine = start(EngineConfig::default());
    let body = gen_body("/v1/completions", 400, true).to_string();
    let mut s = send(engine.addr, "POST", "/v1/completions", &body, "");
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).unwrap();
    assert!(n > 0);
    engine
        .set_faults(EngineFaults {
            stall: true,
            ..EngineFaults::default()
        })
        .unwrap();
    // Drain what was in flight, then nothing more arrives.
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut quiet = false;
    for _ in 0..50 {
        match s.read(&mut buf) {
            Ok(n) => assert!(n > 0, "stream ended while stalled"),
            Err(_) => {
                quiet = true;
                break;
            }
        }
    }
    assert!(quiet, "a stalled stream kept sending");
    engine.set_faults(EngineFaults::default()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let (rest, reset) = read_all(&mut s);
    assert!(!reset);
    assert!(String::from_utf8_lossy(&rest).contains("[DONE]"));
}

#[test]
fn status_fault_answers_openai_errors_and_health_is_independent() {
    let engine = start(faulty(EngineFaults {
        status: Some(503),
        retry_after_s: Some(2),
        ..EngineFaults::default()
    }));
    for path in PATHS {
        for stream in [false, true] {
            let r = http(
                engine.addr,
                "POST",
                path,
                &gen_body(path, 4, stream).to_string(),
            );
            assert_eq!(r.status, 503, "{path}");
            assert!(r.head.contains("retry-after: 2"), "{}", r.head);
            let v: Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(v["error"]["code"], 503);
            assert_eq!(v["error"]["type"], "InternalServerError");
            assert!(v["error"]["message"].as_str().unwrap().contains("503"));
        }
    }
    assert_eq!(http(engine.addr, "GET", "/health", "").status, 200);
    let st = stats(engine.addr);
    assert_eq!((st.requests_received, st.requests_failed), (6, 6));

    let state = set_faults(engine.addr, &json!({"status": 429}));
    assert_eq!(state["retry_after_s"], Value::Null);
    let r = http(
        engine.addr,
        "POST",
        "/v1/completions",
        &gen_body("/v1/completions", 1, false).to_string(),
    );
    assert_eq!(r.status, 429);
    assert!(!r.head.contains("retry-after"));
    assert_eq!(
        serde_json::from_str::<Value>(&r.body).unwrap()["error"]["type"],
        "RateLimitError"
    );

    set_faults(engine.addr, &json!({"health_status": 503}));
    let r = http(engine.addr, "GET", "/health", "");
    assert_eq!(r.status, 503);
    assert_eq!(
        serde_json::from_str::<Value>(&r.body).unwrap()["error"]["code"],
        503
    );
    // Generation is served again: `status` was replaced by the last POST.
    let (status, _) = post(
        engine.addr,
        "/v1/completions",
        &gen_body("/v1/completions", 1, false),
    );
    assert_eq!(status, 200);
}

#[test]
fn fault_endpoint_reads_replaces_and_validates() {
    let engine = start(fast());
    let r = http(engine.addr, "GET", "/_kvroute/fault", "");
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        v,
        json!({"die_after_tokens": null, "stall": false, "status": null,
               "retry_after_s": null, "health_status": null})
    );
    let v = set_faults(
        engine.addr,
        &json!({"die_after_tokens": 7, "health_status": 500}),
    );
    assert_eq!(
        (v["die_after_tokens"].clone(), v["health_status"].clone()),
        (json!(7), json!(500))
    );
    assert_eq!(
        engine.faults(),
        EngineFaults {
            die_after_tokens: Some(7),
            health_status: Some(500),
            ..EngineFaults::default()
        }
    );
    for bad in [
        r#"{"stal": true}"#,
        r#"{"status": 1000}"#,
        r#"{"status": 99}"#,
        r#"{"die_after_tokens": -1}"#,
        "nope",
    ] {
        let r = http(engine.addr, "POST", "/_kvroute/fault", bad);
        assert_eq!(r.status, 400, "{bad}");
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"]["code"], 400);
    }
    assert_eq!(engine.faults().die_after_tokens, Some(7), "unchanged");
    assert!(
        engine
            .set_faults(EngineFaults {
                health_status: Some(42),
                ..EngineFaults::default()
            })
            .is_err()
    );
    assert_eq!(
        http(engine.addr, "DELETE", "/_kvroute/fault", "").status,
        405
    );
    // A config with an invalid fault does not start.
    assert!(
        spawn(
            EngineConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                faults: EngineFaults {
                    status: Some(5),
                    ..EngineFaults::default()
                },
                ..fast()
            },
            tokenizer(),
        )
        .is_err()
    );
}

#[test]
fn stats_count_outcomes_and_log_request_ids() {
    let engine = start(EngineConfig {
        max_model_len: 50,
        ..fast()
    });
    for i in 0..5 {
        let body = gen_body("/v1/completions", 2, i % 2 == 0).to_string();
        let mut s = send(
            engine.addr,
            "POST",
            "/v1/completions",
            &body,
            &format!("X-Request-Id: req-{i}\r\n"),
        );
        assert_eq!(parse(&read_all(&mut s).0).status, 200);
    }
    // A 400 (prompt too long) and a request without the header.
    let long = json!({"prompt": vec![7; 60], "max_tokens": 1}).to_string();
    let mut s = send(
        engine.addr,
        "POST",
        "/v1/completions",
        &long,
        "x-request-id: too-long\r\n",
    );
    assert_eq!(parse(&read_all(&mut s).0).status, 400);
    post(engine.addr, "/generate", &gen_body("/generate", 1, false));
    let want = RequestStats {
        requests_received: 7,
        requests_completed: 6,
        requests_aborted: 0,
        requests_failed: 1,
        request_ids: ["req-0", "req-1", "req-2", "req-3", "req-4", "too-long"]
            .map(String::from)
            .to_vec(),
    };
    assert_eq!(stats(engine.addr), want);
    assert_eq!(engine.request_stats(), want);
    // Non-generation requests are not counted.
    http(engine.addr, "GET", "/v1/models", "");
    assert_eq!(engine.request_stats().requests_received, 7);
}

#[test]
fn stats_keep_the_last_1024_request_ids() {
    let engine = start(faulty(EngineFaults {
        status: Some(500),
        ..EngineFaults::default()
    }));
    // One keep-alive connection, 1,030 cheap requests answered by the status fault.
    let mut s = TcpStream::connect(engine.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let body = "{}";
    let mut buf = vec![0u8; 4096];
    for i in 0..1030 {
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: e\r\nx-request-id: id-{i}\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        let n = s.read(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 500"));
        // The answer is small and sent in one write; make sure we read all of it.
        let text = String::from_utf8_lossy(&buf[..n]).to_string();
        let len: usize = text
            .to_ascii_lowercase()
            .split("content-length: ")
            .nth(1)
            .and_then(|r| r.split("\r\n").next())
            .unwrap()
            .parse()
            .unwrap();
        let head_len = text.find("\r\n\r\n").unwrap() + 4;
        assert_eq!(n, head_len + len, "response read in one go");
    }
    let st = engine.request_stats();
    assert_eq!(st.requests_received, 1030);
    assert_eq!(st.request_ids.len(), 1024);
    assert_eq!(st.request_ids[0], "id-6");
    assert_eq!(st.request_ids[1023], "id-1029");
}

/// "Restarted": after `shutdown` the port refuses connections; a new engine can bind the same
/// address at once (`SO_REUSEADDR`, set by std's `TcpListener::bind` on Unix) and starts with
/// fresh counts.
#[test]
fn shutdown_refuses_then_a_restart_binds_the_same_port() {
    let engine = start(fast());
    let addr = engine.addr;
    // Leave a connection in TIME_WAIT on the server side (the server closes first).
    let (status, _) = post(
        addr,
        "/v1/completions",
        &gen_body("/v1/completions", 2, false),
    );
    assert_eq!(status, 200);
    engine.shutdown();
    let e = TcpStream::connect(addr).expect_err("a stopped engine refuses connections");
    assert_eq!(e.kind(), ErrorKind::ConnectionRefused);

    let restarted = spawn(
        EngineConfig {
            listen: addr,
            ..fast()
        },
        tokenizer(),
    )
    .expect("restart on the same port");
    assert_eq!(restarted.addr, addr);
    assert_eq!(restarted.request_stats(), RequestStats::default());
    let (status, _) = post(
        addr,
        "/v1/completions",
        &gen_body("/v1/completions", 2, false),
    );
    assert_eq!(status, 200);
    assert_eq!(restarted.request_stats().requests_completed, 1);
}

/// Cuts a streamed request on an engine with `die_after_tokens: cut`; returns the text sent.
fn cut_run(path: &str, body: &Value, cut: u32) -> String {
    let dying = start(faulty(EngineFaults {
        die_after_tokens: Some(cut),
        ..EngineFaults::default()
    }));
    let mut body = body.clone();
    body["stream"] = json!(true);
    let mut s = send(dying.addr, "POST", path, &body.to_string(), "");
    let r = parse(&read_all(&mut s).0);
    assert!(!r.complete);
    let text = streamed_text(path, &sse_events(&r.body));
    assert_eq!(words(&text), cut as usize, "{path}: {text:?}");
    text
}

/// An unbroken run of 40 tokens equals 15 streamed tokens (cut by a fault on engine A) plus a
/// continuation of 25 on engine B, for chat (`continue_final_message`), completions
/// (prompt + text) and `/generate` (`input_ids` + output ids).
#[test]
fn continuation_on_another_engine_equals_an_unbroken_run() {
    let reference = start(fast());
    let other = start(fast());
    let msgs = json!([{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": "Explain prefix caching in detail."}]);
    for seed in [None, Some(42)] {
        // Chat.
        let mut unbroken = json!({"model": "qwen3-sim", "messages": msgs, "max_tokens": 40});
        if let Some(s) = seed {
            unbroken["seed"] = json!(s);
        }
        let (status, v) = post(reference.addr, "/v1/chat/completions", &unbroken);
        assert_eq!(status, 200, "{v}");
        let whole = full_text("/v1/chat/completions", &v);
        assert_eq!(words(&whole), 40);
        let partial = cut_run("/v1/chat/completions", &unbroken, 15);
        assert!(whole.starts_with(&partial));
        let mut cont = unbroken.clone();
        cont["messages"]
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "assistant", "content": partial}));
        cont["continue_final_message"] = json!(true);
        cont["add_generation_prompt"] = json!(false);
        cont["max_tokens"] = json!(25);
        let (status, v) = post(other.addr, "/v1/chat/completions", &cont);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 25);
        let rest = full_text("/v1/chat/completions", &v);
        assert_eq!(format!("{partial}{rest}"), whole, "chat, seed {seed:?}");

        // Completions with a text prompt.
        let prompt = "The quick brown fox jumps over the lazy dog.";
        let mut unbroken = json!({"model": "qwen3-sim", "prompt": prompt, "max_tokens": 40});
        if let Some(s) = seed {
            unbroken["seed"] = json!(s);
        }
        let (_, v) = post(reference.addr, "/v1/completions", &unbroken);
        let whole_c = full_text("/v1/completions", &v);
        let partial = cut_run("/v1/completions", &unbroken, 15);
        let mut cont = unbroken.clone();
        cont["prompt"] = json!(format!("{prompt}{partial}"));
        cont["max_tokens"] = json!(25);
        let (_, v) = post(other.addr, "/v1/completions", &cont);
        let rest = full_text("/v1/completions", &v);
        assert_eq!(
            format!("{partial}{rest}"),
            whole_c,
            "completions, seed {seed:?}"
        );
        // Streaming the continuation gives the same text.
        cont["stream"] = json!(true);
        let r = http(other.addr, "POST", "/v1/completions", &cont.to_string());
        assert_eq!(streamed_text("/v1/completions", &sse_events(&r.body)), rest);
        if seed.is_none() {
            assert_ne!(whole, whole_c, "chat and completion streams differ");
        }
    }

    // /generate with ids.
    let ids: Vec<u32> = (3000..3100).collect();
    let (_, v) = post(
        reference.addr,
        "/generate",
        &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 40}}),
    );
    let out: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
    assert_eq!(out.len(), 40);
    let mut cont_ids = ids.clone();
    cont_ids.extend_from_slice(&out[..15]);
    let (_, v) = post(
        other.addr,
        "/generate",
        &json!({"input_ids": cont_ids, "sampling_params": {"max_new_tokens": 25}}),
    );
    let rest: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
    assert_eq!(rest, out[15..]);
}

/// A continuation only continues on an engine with the same seed (so the test above can
/// fail), and a continuation cut twice still lines up.
#[test]
fn continuation_needs_the_same_seed_and_survives_two_cuts() {
    let a = start(fast());
    let b = start(EngineConfig { seed: 1, ..fast() });
    let body = json!({"prompt": "Once upon a time", "max_tokens": 30});
    let (_, v) = post(a.addr, "/v1/completions", &body);
    let whole = full_text("/v1/completions", &v);
    let first = cut_run("/v1/completions", &body, 10);
    let second_body = json!({"prompt": format!("Once upon a time{first}"), "max_tokens": 20});
    let second = cut_run("/v1/completions", &second_body, 8);
    let third_body = json!({"prompt": format!("Once upon a time{first}{second}"),
                            "max_tokens": 12});
    let (_, v) = post(a.addr, "/v1/completions", &third_body);
    let third = full_text("/v1/completions", &v);
    assert_eq!(format!("{first}{second}{third}"), whole);
    let (_, v) = post(b.addr, "/v1/completions", &third_body);
    assert_ne!(full_text("/v1/completions", &v), third);
}

/// Generated text re-tokenizes to the generated ids (so appending it to a prompt appends
/// exactly those tokens), and the text is the ids' decoding.
#[test]
fn generated_text_round_trips_through_the_tokenizer() {
    let engine = start(fast());
    let (_, v) = post(
        engine.addr,
        "/generate",
        &json!({"text": "hello", "sampling_params": {"max_new_tokens": 2000}}),
    );
    let ids: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
    let text = v["text"].as_str().unwrap();
    let t = tokenizer();
    assert_eq!(t.encode(text), ids);
    assert_eq!(t.decode(&ids), text);
    // Appended to a prompt, it adds exactly those ids.
    let mut want = t.encode("hello");
    want.extend_from_slice(&ids);
    assert_eq!(t.encode(&format!("hello{text}")), want);
}

#[test]
fn continuation_request_validation() {
    let engine = start(fast());
    let msgs = json!([{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": " the"}]);
    // vLLM refuses both switches on (add_generation_prompt defaults to true).
    for body in [
        json!({"messages": msgs, "continue_final_message": true}),
        json!({"messages": msgs, "continue_final_message": true, "add_generation_prompt": true}),
        json!({"messages": msgs, "continue_final_message": "yes", "add_generation_prompt": false}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
               "continue_final_message": true, "add_generation_prompt": false}),
    ] {
        let (status, v) = post(engine.addr, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["code"], 400);
    }
    // The continued prompt has no end-of-turn suffix: it is the unbroken prompt's render with
    // the final content and without `<|im_end|>\n` (Qwen3 closes an assistant turn that way).
    let (status, v) = post(
        engine.addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "continue_final_message": true,
                "add_generation_prompt": false, "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{v}");
    let t = tokenizer();
    let closed = t.render_chat(&msgs, false).unwrap();
    let open = closed
        .strip_suffix("<|im_end|>\n")
        .expect("Qwen3 end of turn");
    assert_eq!(v["usage"]["prompt_tokens"], t.encode(open).len());
}

#[test]
fn models_list_and_unknown_model_404() {
    let engine = start(EngineConfig {
        check_model: true,
        ..fast()
    });
    let r = http(engine.addr, "GET", "/v1/models", "");
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 1);
    assert_eq!(data[0]["id"], "qwen3-sim");
    assert_eq!(data[0]["object"], "model");
    assert_eq!(data[0]["owned_by"], "vllm");
    assert!(data[0]["created"].as_u64().unwrap() > 1_600_000_000);

    for path in PATHS {
        let mut body = gen_body(path, 1, false);
        body["model"] = json!("gpt-x");
        let (status, v) = post(engine.addr, path, &body);
        assert_eq!(status, 404, "{path}");
        assert_eq!(
            v,
            json!({"error": {"message": "The model `gpt-x` does not exist.",
                             "type": "NotFoundError", "code": 404}})
        );
        // Absent or served: served.
        body.as_object_mut().unwrap().remove("model");
        assert_eq!(post(engine.addr, path, &body).0, 200, "{path}");
        body["model"] = json!("qwen3-sim");
        assert_eq!(post(engine.addr, path, &body).0, 200, "{path}");
    }
    let st = engine.request_stats();
    assert_eq!((st.requests_failed, st.requests_completed), (3, 6));

    // Off by default (`defaults::CHECK_MODEL`): any name is served.
    let lax = start(fast());
    let mut body = gen_body("/v1/completions", 1, false);
    body["model"] = json!("m");
    assert_eq!(post(lax.addr, "/v1/completions", &body).0, 200);
}

/// Response ids are unique across engines and requests, in vLLM's shape (`chatcmpl-` or
/// `cmpl-` and 32 hex digits): two engines' first requests no longer share `chatcmpl-0`.
#[test]
fn response_ids_are_unique_across_engines() {
    let engines = [start(fast()), start(fast())];
    let mut ids = std::collections::HashSet::new();
    for e in &engines {
        for path in ["/v1/chat/completions", "/v1/completions"] {
            for _ in 0..2 {
                let (status, v) = post(e.addr, path, &gen_body(path, 1, false));
                assert_eq!(status, 200, "{v}");
                let id = v["id"].as_str().unwrap().to_string();
                let hex = id.rsplit('-').next().unwrap();
                assert_eq!(hex.len(), 32, "{id}");
                assert!(hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
                assert!(ids.insert(id.clone()), "repeated {id}");
            }
        }
    }
    assert_eq!(ids.len(), 8);
}
