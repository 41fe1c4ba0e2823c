use serde::Deserialize;
use std::borrow::Cow;
use std::time::Instant;
#[derive(Deserialize)]
#[allow(dead_code)]
struct Msg<'a> { #[serde(borrow)] role: Cow<'a, str>, #[serde(borrow)] content: Cow<'a, str> }
#[derive(Deserialize)]
#[allow(dead_code)]
struct Body<'a> { #[serde(borrow)] model: Cow<'a, str>, #[serde(borrow)] messages: Vec<Msg<'a>>, stream: Option<bool>, max_tokens: Option<u32> }
fn main() {
    let sys = "You are a helpful assistant. ".repeat(28);
    let body = format!(r#"{{"model":"m","messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"what is the answer to life the universe and everything please tell me now"}}],"stream":true,"max_tokens":16}}"#);
    println!("body {} bytes", body.len());
    let n = 200_000;
    for round in 0..3 {
        let t = Instant::now();
        let mut s = 0;
        for _ in 0..n { let b: Body = serde_json::from_str(std::hint::black_box(&body)).unwrap(); s += b.messages.len(); }
        let a = t.elapsed().as_nanos() as f64 / n as f64;
        let t = Instant::now();
        for _ in 0..n { let b: Body = sonic_rs::from_str(std::hint::black_box(&body)).unwrap(); s += b.messages.len(); }
        let c = t.elapsed().as_nanos() as f64 / n as f64;
        let t = Instant::now();
        for _ in 0..n { let b: Body = serde_json::from_slice(std::hint::black_box(body.as_bytes())).unwrap(); s += b.messages.len(); }
        let d = t.elapsed().as_nanos() as f64 / n as f64;
        println!("round {round}: serde_json from_str {a:.0} ns, from_slice {d:.0} ns, sonic-rs {c:.0} ns ({s})");
    }
}
