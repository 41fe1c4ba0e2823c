//! End-to-end replay against a tiny in-test hyper server that streams a fixed-shape SSE
//! response with a usage chunk and an `x-kvroute-worker` header.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use kvroute_bench::replay::{ReplayConfig, comparison_json, comparison_table, replay};
use kvroute_bench::trace::{PromptBuilder, TraceRecord, WordIds};
use tokio::net::TcpListener;

/// Output length that makes the server answer 503 without a worker header.
const FAIL_OUTPUT: u32 = 99;
const WORKERS: [&str; 3] = ["w0", "w1", "w2"];

/// Cached tokens the server reports for a prompt of `words` tokens: half, rounded down to 16.
fn cached_for(words: u64) -> u64 {
    words / 2 / 16 * 16
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    counter: Arc<AtomicU64>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["stream"], true);
    assert_eq!(v["stream_options"]["include_usage"], true);
    let max_tokens = v["max_tokens"].as_u64().unwrap();
    if max_tokens == u64::from(FAIL_OUTPUT) {
        return Ok(Response::builder()
            .status(503)
            .body(Full::new(Bytes::from_static(b"{\"error\":\"busy\"}")))
            .unwrap());
    }
    // The prompt is one word per token.
    let prompt = v["messages"][0]["content"].as_str().unwrap();
    let words = prompt.split_whitespace().count() as u64;
    let n = counter.fetch_add(1, Ordering::Relaxed);
    let worker = WORKERS[(n % 3) as usize];
    let mut sse = String::from("data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n");
    for i in 0..max_tokens {
        sse.push_str(&format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\" t{i}\"}}}}]}}\n\n"
        ));
    }
    sse.push_str(&format!(
        "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{words},\"completion_tokens\":{max_tokens},\
         \"prompt_tokens_details\":{{\"cached_tokens\":{}}}}}}}\n\ndata: [DONE]\n\n",
        cached_for(words)
    ));
    Ok(Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-kvroute-worker", worker)
        .body(Full::new(Bytes::from(sse)))
        .unwrap())
}

/// Serves `max_conns` connections on loopback, then stops.
async fn serve(max_conns: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counter = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        for _ in 0..max_conns {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let counter = counter.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| handle(req, counter.clone()));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

fn toy_prompts() -> PromptBuilder {
    let vocab = ["Ġalpha", "Ġbravo", "Ġcharlie", "Ġdelta", "Ġecho"];
    let words = WordIds::from_vocab(vocab.iter().enumerate().map(|(i, w)| (i as u32, *w)));
    PromptBuilder::new(words.unwrap(), 0)
}

fn record(ts: u64, input: u32, output: u32, first_id: u64) -> TraceRecord {
    let n = input.div_ceil(512) as u64;
    TraceRecord {
        timestamp_ms: ts,
        input_length: input,
        output_length: output,
        hash_ids: std::iter::once(0)
            .chain(first_id..first_id + n - 1)
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_reports_counts_hit_rate_and_workers() {
    let records: Vec<TraceRecord> = (0..12u32)
        .map(|i| record(u64::from(i) * 40, 700 + 97 * i, 5 + i, 1_000 * u64::from(i)))
        .chain([record(200, 900, FAIL_OUTPUT, 99_000)])
        .collect();
    let addr = serve(records.len()).await;
    let cfg = ReplayConfig {
        url: format!("http://{addr}"),
        model: "test-model".into(),
        time_scale: 4.0,
        request_timeout: Duration::from_secs(10),
        keep_samples: true,
        ..ReplayConfig::default()
    };
    let prompts = toy_prompts();
    let rep = tokio::time::timeout(Duration::from_secs(30), replay(cfg, &records, &prompts))
        .await
        .expect("replay finishes")
        .expect("valid config");
    println!("{}", rep.table());

    assert_eq!(rep.requests, 13);
    assert_eq!((rep.ok, rep.errors), (12, 1));
    assert_eq!(
        rep.errors_by_kind,
        BTreeMap::from([("status_503".into(), 1)])
    );
    // Prompt words = input_length (one token per word); cached = what the server reported.
    let ok: Vec<&TraceRecord> = records
        .iter()
        .filter(|r| r.output_length != FAIL_OUTPUT)
        .collect();
    let prompt: u64 = ok.iter().map(|r| u64::from(r.input_length)).sum();
    let cached: u64 = ok
        .iter()
        .map(|r| cached_for(u64::from(r.input_length)))
        .sum();
    let completion: u64 = ok.iter().map(|r| u64::from(r.output_length)).sum();
    assert_eq!(
        (rep.prompt_tokens, rep.cached_tokens, rep.completion_tokens),
        (prompt, cached, completion)
    );
    assert!((rep.hit_rate - cached as f64 / prompt as f64).abs() < 1e-12);
    assert_eq!(rep.usage_missing, 0);
    // Round-robin over 3 workers for the 12 successes, the 503 has no header.
    let want: BTreeMap<String, u64> = [("direct", 1), ("w0", 4), ("w1", 4), ("w2", 4)]
        .into_iter()
        .map(|(w, n)| (w.to_string(), n))
        .collect();
    assert_eq!(rep.per_worker, want);
    assert!((rep.max_over_mean_load - 4.0 / (13.0 / 4.0)).abs() < 1e-12);
    assert_eq!(rep.ttft_ms.count, 12);
    assert_eq!(rep.e2e_ms.count, 12);
    assert_eq!(rep.tpot_ms.count, 12);
    assert!(rep.ttft_ms.p50 <= rep.e2e_ms.p50 && rep.e2e_ms.p99 > 0.0);
    assert_eq!(rep.samples.len(), 13);

    // JSON round trip of the report and the demo's comparison shapes.
    let json = serde_json::to_string(&rep).unwrap();
    let back: kvroute_bench::replay::ReplayReport = serde_json::from_str(&json).unwrap();
    // (floats may differ in the last bit: serde_json parses without `float_roundtrip`)
    assert_eq!((back.requests, back.ok, back.errors), (13, 12, 1));
    assert_eq!(back.per_worker, rep.per_worker);
    assert_eq!(back.samples, rep.samples);
    assert!((back.hit_rate - rep.hit_rate).abs() < 1e-12);
    assert!((back.e2e_ms.p99 - rep.e2e_ms.p99).abs() < 1e-9);
    let runs = vec![("round_robin".to_string(), rep.clone())];
    let table = comparison_table(&runs);
    assert!(table.contains("round_robin") && table.contains("TTFT p50"));
    let v = comparison_json(&runs);
    assert_eq!(v["policies"][0]["requests"], 13);
    assert_eq!(v["policies"][0]["errors"], 1);
}

#[tokio::test]
async fn connection_refused_counts_as_error() {
    // Bind then drop to get a port nobody listens on.
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = ReplayConfig {
        url: format!("http://{addr}"),
        request_timeout: Duration::from_secs(5),
        ..ReplayConfig::default()
    };
    let records = vec![record(0, 600, 4, 1), record(1, 600, 4, 1)];
    let rep = tokio::time::timeout(
        Duration::from_secs(20),
        replay(cfg, &records, &toy_prompts()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!((rep.requests, rep.ok, rep.errors), (2, 0, 2));
    assert_eq!(rep.errors_by_kind.get("connect"), Some(&2));
    assert!(rep.per_worker.is_empty());
    assert_eq!(rep.hit_rate, 0.0);
}

#[tokio::test]
async fn bad_config_is_rejected() {
    let prompts = toy_prompts();
    let bad_url = ReplayConfig {
        url: "https://example.com".into(),
        ..ReplayConfig::default()
    };
    assert!(replay(bad_url, &[], &prompts).await.is_err());
    let bad_scale = ReplayConfig {
        time_scale: 0.0,
        ..ReplayConfig::default()
    };
    assert!(replay(bad_scale, &[], &prompts).await.is_err());
}
