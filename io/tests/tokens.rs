//! Token-mode routing end to end: the router's token ids and block keys for a request equal
//! what the simulated engine computes for it (issue 4 "done when").
//!
//! The engine reports `prompt_tokens` (its prompt length) and `cached_tokens` (its prefix-cache
//! hit, whole blocks of 16). The router's ids come from the gateway's key tap. A template or
//! tokenizer mismatch makes the lengths differ, and a boundary mismatch makes the router's
//! predicted overlap (leading block keys shared with the previous turn) differ from the
//! engine's hit.

mod common;

use common::*;
use kvroute_bench::engine::{self, EngineConfig};
use kvroute_core::config::{Config, PolicyKind};
use kvroute_core::route_key::{RouteKey, TokenSource};
use kvroute_index::keys::block_keys;
use kvroute_io::gateway;
use kvroute_io::shard::Server;
use kvroute_tokenize::Tokenizer;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

const BLOCK: usize = 16;

fn qwen3_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tokenizers/qwen3")
}

fn engine() -> engine::server::EngineHandle {
    let cfg = EngineConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        speedup_ratio: 0.0,
        block_size: BLOCK,
        ..EngineConfig::default()
    };
    engine::server::spawn(cfg, Arc::new(Tokenizer::qwen3().unwrap())).expect("engine starts")
}

fn gateway_to(url: String, tokenizer: Option<PathBuf>) -> Server {
    let cfg = Config {
        listen: "127.0.0.1:0".into(),
        workers: vec![url],
        policy: PolicyKind::CacheAware,
        shards: Some(1),
        tokenizer,
        admin_listen: String::new(),
        ..Config::default()
    };
    let server = gateway::start(cfg, false).expect("gateway starts");
    server.shared().key_tap.set(Mutex::new(Vec::new())).unwrap();
    server
}

fn last_key(server: &Server) -> RouteKey {
    let tap = server.shared().key_tap.get().unwrap().lock().unwrap();
    tap.last().cloned().expect("a routed request")
}

/// Leading blocks two key chains share.
fn common_blocks(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// (prompt_tokens, cached_tokens) of an OpenAI-shaped response.
fn usage(v: &Value) -> (usize, usize) {
    let u = &v["usage"];
    (
        u["prompt_tokens"].as_u64().expect("prompt_tokens") as usize,
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0) as usize,
    )
}

/// A few hundred tokens of varied text, so turns span many blocks.
fn paragraph(seed: usize) -> String {
    let words = [
        "router",
        "cache",
        "prefix",
        "block",
        "token",
        "engine",
        "déjà",
        "vu",
        "42",
        "f(x)",
        "\n",
        "中文",
        "😀",
        "tool_call",
        "<b>",
        "  ",
    ];
    (0..120)
        .map(|i| words[(i * 7 + seed * 13 + i / 5) % words.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn chat_turns_router_ids_and_block_keys_match_the_engine() {
    let eng = engine();
    let gw = gateway_to(format!("http://{}", eng.addr), Some(qwen3_dir()));
    let tok = Tokenizer::qwen3().unwrap();
    let mut messages = vec![json!({"role": "system", "content": paragraph(0)})];
    let mut prev_keys: Vec<u64> = Vec::new();
    for turn in 1..=5 {
        messages.push(json!({"role": "user", "content": paragraph(turn)}));
        let body = json!({"model": "qwen3-sim", "messages": messages, "max_tokens": 3});
        let resp = post(gw.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(resp.status, 200, "{}", resp.text());
        let key = last_key(&gw);
        assert_eq!(key.token_source, TokenSource::Prompt);
        let ids = key.input_ids.expect("token mode");
        // The engine's own path: render_chat + encode.
        let engine_ids = tok.encode(
            &tok.render_chat(&Value::Array(messages.clone()), true)
                .unwrap(),
        );
        assert_eq!(ids[..], engine_ids[..], "turn {turn}: ids");
        let (prompt_tokens, cached) = usage(&resp.json());
        assert_eq!(prompt_tokens, ids.len(), "turn {turn}: prompt length");
        let keys = block_keys(&ids, BLOCK);
        let predicted = common_blocks(&prev_keys, &keys).min((ids.len() - 1) / BLOCK) * BLOCK;
        assert_eq!(
            cached, predicted,
            "turn {turn}: engine hit vs router overlap"
        );
        if turn > 1 {
            assert!(cached > 0, "turn {turn}: later turns must hit");
        }
        prev_keys = keys;
        // Our own reply (not the engine's output), so only prompt blocks can match.
        messages.push(json!({"role": "assistant", "content": format!("reply {turn}: {}", paragraph(turn + 50))}));
    }
    let metrics = get(gw.local_addr(), "/metrics").text();
    assert_eq!(
        metric(&metrics, "kvroute_token_source_total{source=\"prompt\"}"),
        Some(5.0),
        "{metrics}"
    );
    assert!(metric(&metrics, "kvroute_tokenize_tokens_total{how=\"reused\"}").unwrap() > 0.0);
    gw.shutdown();
}

/// Sends `body` to `path` in pieces ending at each of `cuts` (ascending offsets), 10 ms
/// apart, so the gateway reads it over several reads; `chunked`: as chunked transfer coding,
/// one chunk per piece. Reads the response.
fn post_in_pieces(
    addr: std::net::SocketAddr,
    path: &str,
    body: &[u8],
    cuts: &[usize],
    chunked: bool,
) -> Response {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    s.set_nodelay(true).unwrap();
    let framing = if chunked {
        "transfer-encoding: chunked".to_string()
    } else {
        format!("content-length: {}", body.len())
    };
    let head = format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\n{framing}\r\n\r\n");
    s.write_all(head.as_bytes()).unwrap();
    let mut at = 0;
    for &end in cuts.iter().chain(std::iter::once(&body.len())) {
        let piece = &body[at..end];
        at = end;
        if chunked {
            s.write_all(format!("{:x}\r\n", piece.len()).as_bytes())
                .unwrap();
            s.write_all(piece).unwrap();
            s.write_all(b"\r\n").unwrap();
        } else {
            s.write_all(piece).unwrap();
        }
        s.flush().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    if chunked {
        s.write_all(b"0\r\n\r\n").unwrap();
    }
    read_response(&mut s)
}

/// A long chat's next turns arrive over many reads, whole or chunked, cut inside messages
/// and right after a message's `}` (the gateway scans each read for cached chat prefixes as
/// it comes, `PrefixScanner`): each turn still reuses all of the turn before's messages, and
/// its ids are the engine's.
#[test]
fn a_chat_body_read_in_pieces_reuses_the_turn_before() {
    let eng = engine();
    let gw = gateway_to(format!("http://{}", eng.addr), Some(qwen3_dir()));
    let tok = Tokenizer::qwen3().unwrap();
    let long: Vec<String> = (0..60).map(paragraph).collect();
    let mut messages = vec![
        json!({"role": "system", "content": long.join("\n")}),
        json!({"role": "user", "content": paragraph(1)}),
    ];
    let resp = post(
        gw.local_addr(),
        "/v1/chat/completions",
        &json!({"model": "qwen3-sim", "messages": messages, "max_tokens": 3}),
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    let reused = |gw: &Server| {
        let m = get(gw.local_addr(), "/metrics").text();
        metric(&m, "kvroute_tokenize_tokens_total{how=\"reused\"}").unwrap_or(0.0)
    };
    for (turn, chunked) in [(2, false), (3, true)] {
        // All of the turn before but its generation prompt is reused.
        let before_ids = last_key(&gw).input_ids.expect("token mode").len();
        let generation = tok.encode("<|im_start|>assistant\n").len();
        let before = reused(&gw);
        messages.push(json!({"role": "assistant", "content": paragraph(50 + turn)}));
        messages.push(json!({"role": "user", "content": paragraph(80 + turn)}));
        let body = serde_json::to_vec(
            &json!({"model": "qwen3-sim", "messages": messages, "max_tokens": 3}),
        )
        .unwrap();
        assert!(body.len() > 32 * 1024, "{} bytes", body.len());
        // Every 5,000 bytes, and right after the `}` closing each message but the last.
        let mut cuts: Vec<usize> = (1..body.len() / 5000).map(|k| k * 5000).collect();
        cuts.extend(
            body.windows(2)
                .enumerate()
                .filter(|(_, w)| w == b"},")
                .map(|(i, _)| i + 1),
        );
        cuts.sort_unstable();
        cuts.dedup();
        let resp = post_in_pieces(
            gw.local_addr(),
            "/v1/chat/completions",
            &body,
            &cuts,
            chunked,
        );
        assert_eq!(resp.status, 200, "turn {turn}: {}", resp.text());
        let ids = last_key(&gw).input_ids.expect("token mode");
        let engine_ids = tok.encode(
            &tok.render_chat(&Value::Array(messages.clone()), true)
                .unwrap(),
        );
        assert_eq!(ids[..], engine_ids[..], "turn {turn}: ids");
        assert_eq!(
            reused(&gw) - before,
            (before_ids - generation) as f64,
            "turn {turn}: reused tokens"
        );
    }
    gw.shutdown();
}

#[test]
fn completions_and_generate_agree_with_the_engine() {
    let eng = engine();
    let gw = gateway_to(format!("http://{}", eng.addr), Some(qwen3_dir()));
    let text = paragraph(3);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "qwen3-sim", "prompt": text, "max_tokens": 2}),
        ),
        (
            "/generate",
            json!({"text": text, "sampling_params": {"max_new_tokens": 2}}),
        ),
    ] {
        let resp = post(gw.local_addr(), path, &body);
        assert_eq!(resp.status, 200, "{path}: {}", resp.text());
        let key = last_key(&gw);
        let ids = key.input_ids.expect("token mode");
        let v = resp.json();
        let prompt_tokens = v["usage"]["prompt_tokens"]
            .as_u64()
            .or(v["meta_info"]["prompt_tokens"].as_u64())
            .unwrap() as usize;
        assert_eq!(
            (prompt_tokens, key.token_source),
            (ids.len(), TokenSource::Prompt),
            "{path}"
        );
    }
    // The second request had the same prompt: the engine hit equals every full block but the
    // one holding the last token.
    let resp = post(
        gw.local_addr(),
        "/generate",
        &json!({"text": text, "sampling_params": {"max_new_tokens": 1}}),
    );
    let n = last_key(&gw).input_ids.unwrap().len();
    assert_eq!(
        resp.json()["meta_info"]["cached_tokens"].as_u64(),
        Some((((n - 1) / BLOCK) * BLOCK) as u64)
    );
    gw.shutdown();
}

#[test]
fn header_tokens_body_ids_and_text_mode() {
    let eng = engine();
    let gw = gateway_to(format!("http://{}", eng.addr), None);
    let addr = gw.local_addr();
    let body = serde_json::to_vec(&json!({"model": "qwen3-sim", "prompt": "hi", "max_tokens": 1}))
        .unwrap();
    let send = |header: &str| {
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{header}content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let mut raw = head.into_bytes();
        raw.extend_from_slice(&body);
        let r = send_raw(addr, &raw);
        assert_eq!(r.status, 200, "{}", r.text());
        last_key(&gw)
    };
    let k = send("X-KVRoute-Routing-Tokens: 11, 12,13\r\n");
    assert_eq!(
        (k.input_ids, k.token_source),
        (Some(vec![11, 12, 13].into()), TokenSource::Header)
    );
    let k = send("x-kvroute-routing-tokens: 1,two\r\n");
    assert_eq!((k.input_ids, k.token_source), (None, TokenSource::None));
    let too_many = vec!["7"; 513].join(",");
    let k = send(&format!("x-kvroute-routing-tokens: {too_many}\r\n"));
    assert_eq!(k.input_ids, None);
    // No tokenizer configured: chat stays in text mode; /generate ids still count.
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "qwen3-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(last_key(&gw).input_ids, None);
    let r = post(
        addr,
        "/generate",
        &json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(last_key(&gw).token_source, TokenSource::Body);
    let metrics = get(addr, "/metrics").text();
    for (reason, n) in [("malformed", 1.0), ("too_many", 1.0)] {
        assert_eq!(
            metric(
                &metrics,
                &format!("kvroute_routing_tokens_rejected_total{{reason=\"{reason}\"}}")
            ),
            Some(n),
            "{metrics}"
        );
    }
    gw.shutdown();
}

#[test]
fn chat_with_tools_renders_the_same_prompt_on_both_sides() {
    // Tools change the rendered prompt (a system block with their JSON, keys in request
    // order); the engine must render from the same bytes the router tokenizes.
    let eng = engine();
    let gw = gateway_to(format!("http://{}", eng.addr), Some(qwen3_dir()));
    let body = json!({"model": "qwen3-sim", "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "messages": [{"role": "user", "content": paragraph(3)}]});
    let resp = post(gw.local_addr(), "/v1/chat/completions", &body);
    assert_eq!(resp.status, 200, "{}", resp.text());
    let ids = last_key(&gw).input_ids.expect("token mode");
    let plain = Tokenizer::qwen3().unwrap().encode(
        &Tokenizer::qwen3()
            .unwrap()
            .render_chat(&body["messages"], true)
            .unwrap(),
    );
    assert!(ids.len() > plain.len() + 20, "tools add a system block");
    assert_eq!(
        usage(&resp.json()).0,
        ids.len(),
        "engine prompt_tokens == router ids"
    );
    gw.shutdown();
}
