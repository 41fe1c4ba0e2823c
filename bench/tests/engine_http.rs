//! End-to-end tests of the simulated engine's HTTP surface (`engine-model.md` §6–§7): each test
//! starts its own engine on 127.0.0.1:0 and talks to it over plain TCP.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvroute_bench::engine::{EngineConfig, EngineHandle, spawn};
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

fn fast() -> EngineConfig {
    EngineConfig {
        speedup_ratio: 0.0,
        ..EngineConfig::default()
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

fn write_request(s: &mut TcpStream, method: &str, path: &str, body: &str, close: bool) {
    let conn = if close { "close" } else { "keep-alive" };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: engine\r\nConnection: {conn}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
}

/// Decodes a chunked body.
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let nl = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size line");
        let size_str = std::str::from_utf8(&b[..nl]).unwrap();
        let size = usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16).unwrap();
        b = &b[nl + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// One request on a fresh `Connection: close` connection; returns (status, headers, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String, String) {
    let mut s = connect(addr);
    write_request(&mut s, method, path, body, true);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8(raw[..split].to_vec()).unwrap();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body_bytes = &raw[split + 4..];
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body_bytes)
    } else {
        body_bytes.to_vec()
    };
    (status, head, String::from_utf8(body).unwrap())
}

fn post_json(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, b) = http(addr, "POST", path, &body.to_string());
    (status, serde_json::from_str(&b).unwrap())
}

/// `name{labels} value` from the engine's /metrics.
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (status, _, text) = http(addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
        .parse()
        .unwrap()
}

fn chat_body(max_tokens: u32, stream: bool) -> Value {
    let words: Vec<String> = (0..120).map(|i| format!("word{i}")).collect();
    json!({
        "model": "qwen3-sim",
        "messages": [{"role": "user", "content": words.join(" ")}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

fn expected_prompt_len(body: &Value) -> usize {
    let t = tokenizer();
    t.encode(&t.render_chat(&body["messages"], true).unwrap())
        .len()
}

#[test]
fn chat_twice_second_request_hits_the_prefix_cache() {
    let engine = start(fast());
    let body = chat_body(5, false);
    let l = expected_prompt_len(&body);
    assert!(l > 100, "prompt long enough to span several blocks: {l}");

    let (status, first) = post_json(engine.addr, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["model"], "qwen3-sim");
    assert_eq!(first["choices"][0]["message"]["role"], "assistant");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let usage = &first["usage"];
    assert_eq!(usage["prompt_tokens"], l);
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(usage["total_tokens"], l + 5);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    // Five filler words, each " word".
    let content = first["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(content.split(' ').filter(|w| !w.is_empty()).count(), 5);

    let (_, second) = post_json(engine.addr, "/v1/chat/completions", &body);
    let cached = (l - 1) / 16 * 16;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        cached
    );

    // Counters match the two requests (no preemption with the default 16,384 blocks).
    assert_eq!(
        metric(engine.addr, "vllm:prefix_cache_queries_total"),
        (2 * l) as f64
    );
    assert_eq!(
        metric(engine.addr, "vllm:prefix_cache_hits_total"),
        cached as f64
    );
    assert_eq!(
        metric(engine.addr, "vllm:prompt_tokens_total"),
        (2 * l) as f64
    );
    assert_eq!(metric(engine.addr, "vllm:generation_tokens_total"), 10.0);
    assert_eq!(metric(engine.addr, "vllm:num_preemptions_total"), 0.0);
    assert_eq!(metric(engine.addr, "vllm:num_requests_running"), 0.0);
    assert_eq!(metric(engine.addr, "vllm:num_requests_waiting"), 0.0);
    assert_eq!(metric(engine.addr, "vllm:kv_cache_usage_perc"), 0.0);
}

#[test]
fn chat_stream_sends_role_content_finish_usage_done() {
    let engine = start(fast());
    let body = chat_body(4, true);
    let l = expected_prompt_len(&body);
    // Warm the cache so the streamed usage carries a non-zero cached_tokens.
    post_json(engine.addr, "/v1/chat/completions", &chat_body(1, false));
    let (status, head, text) = http(
        engine.addr,
        "POST",
        "/v1/chat/completions",
        &body.to_string(),
    );
    assert_eq!(status, 200);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/event-stream")
    );
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("SSE data line"))
        .collect();
    // role, 4 content chunks, usage, [DONE]
    assert_eq!(events.len(), 7, "{text}");
    let chunks: Vec<Value> = events[..6]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for (i, c) in chunks[1..5].iter().enumerate() {
        let content = c["choices"][0]["delta"]["content"].as_str().unwrap();
        assert!(content.starts_with(' ') && content.len() > 1, "{content}");
        let want = if i == 3 { json!("length") } else { Value::Null };
        assert_eq!(c["choices"][0]["finish_reason"], want);
    }
    assert_eq!(chunks[5]["choices"], json!([]));
    let usage = &chunks[5]["usage"];
    assert_eq!(usage["prompt_tokens"], l);
    assert_eq!(usage["completion_tokens"], 4);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"],
        (l - 1) / 16 * 16
    );
    assert_eq!(events[6], "[DONE]");
}

#[test]
fn same_request_same_output_text() {
    let a = start(fast());
    let b = start(fast());
    let body = chat_body(8, false);
    let (_, x) = post_json(a.addr, "/v1/chat/completions", &body);
    let (_, y) = post_json(b.addr, "/v1/chat/completions", &body);
    assert_eq!(x["choices"][0]["message"], y["choices"][0]["message"]);
}

#[test]
fn client_disconnect_mid_stream_aborts_the_request() {
    // Real step times (≈6 ms per decode step): 10,000 tokens would take a minute, so the
    // request can only leave the running set by being aborted.
    let engine = start(EngineConfig::default());
    let mut s = connect(engine.addr);
    write_request(
        &mut s,
        "POST",
        "/v1/chat/completions",
        &chat_body(10_000, true).to_string(),
        true,
    );
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"content\":\" ") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(metric(engine.addr, "vllm:num_requests_running"), 1.0);
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let running = metric(engine.addr, "vllm:num_requests_running");
        if running == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "request still running after disconnect"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(metric(engine.addr, "vllm:kv_cache_usage_perc"), 0.0);
    assert!(metric(engine.addr, "vllm:generation_tokens_total") < 10_000.0);
}

#[test]
fn completions_generate_and_admin_endpoints() {
    let engine = start(fast());
    let ids: Vec<u32> = (1000..1040).collect();

    let (status, c) = post_json(
        engine.addr,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 3}),
    );
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["usage"]["prompt_tokens"], 40);
    assert_eq!(c["usage"]["completion_tokens"], 3);
    assert_eq!(c["choices"][0]["finish_reason"], "length");

    let (status, g) = post_json(
        engine.addr,
        "/generate",
        &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}),
    );
    assert_eq!(status, 200, "{g}");
    assert_eq!(g["meta_info"]["prompt_tokens"], 40);
    assert_eq!(g["meta_info"]["completion_tokens"], 2);
    // ⌊39/16⌋·16 = 32 cached from the completions request.
    assert_eq!(g["meta_info"]["cached_tokens"], 32);
    assert_eq!(g["meta_info"]["finish_reason"]["type"], "length");
    assert_eq!(g["output_ids"].as_array().unwrap().len(), 2);

    // Streaming /generate: cumulative text, then [DONE].
    let (_, _, text) = http(
        engine.addr,
        "POST",
        "/generate",
        &json!({"text": "hello", "stream": true, "sampling_params": {"max_new_tokens": 2}})
            .to_string(),
    );
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 3, "{text}");
    let last: Value = serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(last["meta_info"]["completion_tokens"], 2);
    assert_eq!(last["text"].as_str().unwrap().split(' ').count(), 3);
    assert_eq!(events[2], "data: [DONE]");

    let (status, _, models) = http(engine.addr, "GET", "/v1/models", "");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "qwen3-sim");
    assert_eq!(http(engine.addr, "GET", "/health", "").0, 200);
    assert_eq!(http(engine.addr, "GET", "/nope", "").0, 404);
    assert_eq!(http(engine.addr, "GET", "/v1/completions", "").0, 405);

    assert_eq!(http(engine.addr, "POST", "/reset_prefix_cache", "").0, 200);
    let (_, g) = post_json(
        engine.addr,
        "/generate",
        &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(g["meta_info"]["cached_tokens"], 0);
}

#[test]
fn bad_requests_get_openai_error_bodies() {
    let engine = start(EngineConfig {
        max_model_len: 50,
        ..fast()
    });
    let check = |path: &str, body: &str| {
        let (status, _, b) = http(engine.addr, "POST", path, body);
        assert_eq!(status, 400, "{path} {body}: {b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], 400);
        assert!(v["error"]["message"].as_str().unwrap().len() > 3);
    };
    check("/v1/chat/completions", "{not json");
    check("/v1/chat/completions", r#"{"messages": 3}"#);
    check("/v1/completions", r#"{"prompt": "x", "max_tokens": 0}"#);
    // 51 > max_model_len 50.
    check(
        "/v1/completions",
        &json!({"prompt": vec![7; 51]}).to_string(),
    );
    check("/generate", &json!({"input_ids": vec![7; 60]}).to_string());
    // 40 + 11 > 50, in vLLM's words.
    let (status, v) = post_json(
        engine.addr,
        "/v1/completions",
        &json!({"prompt": vec![7; 40], "max_tokens": 11}),
    );
    assert_eq!(status, 400);
    assert_eq!(
        v["error"]["message"],
        "'max_tokens' or 'max_completion_tokens' is too large: 11. This model's maximum \
         context length is 50 tokens and your request has 40 input tokens (11 > 50 - 40)."
    );
    // The engine still serves after errors, up to the context length exactly.
    let (status, _) = post_json(
        engine.addr,
        "/v1/completions",
        &json!({"prompt": vec![7; 49], "max_tokens": 1}),
    );
    assert_eq!(status, 200);
}

#[test]
fn idle_keep_alive_connection_is_closed() {
    let engine = start(EngineConfig {
        keep_alive_timeout_ms: 200,
        ..fast()
    });
    let mut s = connect(engine.addr);
    write_request(&mut s, "GET", "/health", "", false);
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // Idle: the server closes the connection (EOF) on its own, well within the read timeout.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let n = s.read(&mut buf).expect("closed, not timed out");
    assert_eq!(n, 0);
}
