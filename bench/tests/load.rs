//! `kvroute load` against a tiny in-test HTTP/1.1 server on loopback whose answer to its k-th
//! request (in arrival order) is planned: instant, late, a given status, never, a closed
//! connection, or an SSE stream with a known delay before its first `data:` line.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvroute_bench::load::{self, Limit, LoadConfig, LoadReport};
use kvroute_bench::trace::WordIds;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The server's answer to one request.
#[derive(Debug, Clone, Copy)]
enum Reply {
    /// 200 with a small JSON body, after this delay.
    Ok(Duration),
    /// This status with a small JSON body.
    Status(u16),
    /// No answer, ever (the connection stays open).
    Hang,
    /// The connection is closed without an answer.
    Close,
    /// A chunked SSE stream: a `: ping` comment at once, the first `data:` event after
    /// `first`, `more` further events `gap` apart, then `data: [DONE]`.
    Sse {
        first: Duration,
        more: u32,
        gap: Duration,
    },
}

/// A server on its own thread and runtime, stopped (every connection dropped) with it.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(plan: impl Fn(u64) -> Reply + Send + Sync + 'static) -> Server {
    let plan: Arc<dyn Fn(u64) -> Reply + Send + Sync> = Arc::new(plan);
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            let counter = Arc::new(AtomicU64::new(0));
            loop {
                tokio::select! {
                    _ = &mut stopped => return,
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { return };
                        let _ = stream.set_nodelay(true);
                        tokio::spawn(connection(stream, Arc::clone(&plan), Arc::clone(&counter)));
                    }
                }
            }
        });
    });
    Server {
        addr: addr_rx.recv().unwrap(),
        stop: Some(stop),
        thread: Some(thread),
    }
}

/// Reads one request (head and `content-length` body); `None` at EOF.
async fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<Option<()>> {
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    while buf.len() < head_end + len {
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body: serde_json::Value = serde_json::from_slice(&buf[head_end..head_end + len]).unwrap();
    assert!(body["messages"].is_array(), "a chat request");
    buf.drain(..head_end + len);
    Ok(Some(()))
}

fn json_response(status: u16) -> Vec<u8> {
    let body = r#"{"choices":[{"message":{"role":"assistant","content":"hi"}}]}"#;
    format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn chunk(data: &str) -> Vec<u8> {
    format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()
}

async fn connection(
    mut stream: TcpStream,
    plan: Arc<dyn Fn(u64) -> Reply + Send + Sync>,
    n: Arc<AtomicU64>,
) {
    let mut buf = Vec::new();
    while let Ok(Some(())) = read_request(&mut stream, &mut buf).await {
        let reply = plan(n.fetch_add(1, Ordering::Relaxed));
        let written = match reply {
            Reply::Ok(delay) => {
                // (tokio sleeps even a zero delay to its next 1 ms tick)
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                stream.write_all(&json_response(200)).await
            }
            Reply::Status(s) => stream.write_all(&json_response(s)).await,
            Reply::Hang => {
                tokio::time::sleep(Duration::from_secs(3_600)).await;
                return;
            }
            Reply::Close => return,
            Reply::Sse { first, more, gap } => {
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                            transfer-encoding: chunked\r\n\r\n";
                let event = "data: {\"choices\":[{\"delta\":{\"content\":\"t\"}}]}\n\n";
                let mut w = stream.write_all(head.as_bytes()).await;
                w = w.and(stream.write_all(&chunk(": ping\n\n")).await);
                tokio::time::sleep(first).await;
                w = w.and(stream.write_all(&chunk(event)).await);
                for _ in 0..more {
                    tokio::time::sleep(gap).await;
                    w = w.and(stream.write_all(&chunk(event)).await);
                }
                w = w.and(stream.write_all(&chunk("data: [DONE]\n\n")).await);
                w.and(stream.write_all(b"0\r\n\r\n").await)
            }
        };
        if written.is_err() {
            return;
        }
    }
}

fn words() -> WordIds {
    let vocab = ["Ġalpha", "Ġbravo", "Ġcharlie", "Ġdelta", "Ġecho"];
    WordIds::from_vocab(vocab.iter().enumerate().map(|(i, w)| (i as u32, *w))).unwrap()
}

fn run(cfg: LoadConfig) -> LoadReport {
    let rep = load::run(&cfg, words()).expect("valid config");
    println!("{}", rep.table());
    assert_eq!(rep.sent, rep.ok + rep.errors, "sent = ok + errors");
    assert_eq!(
        rep.scheduled,
        rep.sent + rep.unsent,
        "scheduled = sent + unsent"
    );
    assert_eq!(rep.errors, rep.errors_by_kind.values().sum::<u64>());
    rep
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The server stalls request 300 of 1,000 (1,000 req/s, one connection) for 300 ms. The 300
/// requests due during the stall wait for the connection: request 300 + j, due j ms into the
/// stall, leaves at its end (plus the catch-up of the j before it) and is answered at least
/// 300 − j ms after its time. Counted from the schedule, the 11th largest (p99) is ≥ 290 ms
/// and the 101st (p90) ≥ 200 ms; counted from the send, only the stalled request is slow.
/// (Upper bounds leave room for a loaded machine: the stall's end and the catch-up can only
/// come later.)
#[test]
fn coordinated_omission_a_stall_shows_in_corrected_latency_only() {
    let server = serve(|k| Reply::Ok(if k == 300 { ms(300) } else { Duration::ZERO }));
    let rep = run(LoadConfig {
        url: format!("http://{}", server.addr),
        rate: 1_000.0,
        limit: Limit::Requests(1_000),
        connections: 1,
        ..LoadConfig::default()
    });
    assert_eq!((rep.sent, rep.ok, rep.unsent), (1_000, 1_000, 0));
    assert_eq!(rep.path, "/v1/chat/completions");
    let (c, u) = (&rep.corrected_ms, &rep.uncorrected_ms);
    assert!((285.0..350.0).contains(&c.p99), "corrected p99 {}", c.p99);
    assert!((195.0..350.0).contains(&c.p90), "corrected p90 {}", c.p90);
    assert!((300.0..400.0).contains(&c.max), "corrected max {}", c.max);
    assert!(
        u.p50 < 5.0 && u.p99 < 20.0,
        "uncorrected p50 {} p99 {}",
        u.p50,
        u.p99
    );
    assert!((300.0..400.0).contains(&u.max), "uncorrected max {}", u.max);
    // The ~290 requests due in the stall's first 290 ms left more than 10 ms late (more if
    // the catch-up is slow), nearly all waiting for the one busy connection; none due before
    // it did.
    assert!((280..700).contains(&rep.late), "late {}", rep.late);
    assert!(rep.late_generator * 10 < rep.late, "{}", rep.late_generator);
    assert!(
        rep.warnings[0].starts_with("behind schedule"),
        "{:?}",
        rep.warnings
    );
}

/// First `data:` line 50 ms after the request (a comment line and the head come at once), then
/// 3 more events 10 ms apart: from the send, first chunk ≈ 50 ms and whole answer ≈ 80 ms
/// (plus the server's timer ticks); from the schedule, those plus the send lag.
#[test]
fn streaming_first_chunk_latency_is_the_servers_delay() {
    let server = serve(|_| Reply::Sse {
        first: ms(50),
        more: 3,
        gap: ms(10),
    });
    let rep = run(LoadConfig {
        url: format!("http://{}/v1/chat/completions", server.addr),
        rate: 20.0,
        limit: Limit::Requests(10),
        connections: 4,
        stream: true,
        ..LoadConfig::default()
    });
    assert_eq!((rep.sent, rep.ok), (10, 10));
    let (first, first_c) = (
        &rep.first_chunk_uncorrected_ms,
        &rep.first_chunk_corrected_ms,
    );
    assert_eq!((first.count, first_c.count), (10, 10));
    assert!(
        (50.0..65.0).contains(&first.p50),
        "first chunk p50 {}",
        first.p50
    );
    assert!(first_c.p50 >= first.p50, "corrected {}", first_c.p50);
    let e2e = &rep.uncorrected_ms;
    assert!((80.0..100.0).contains(&e2e.p50), "e2e p50 {}", e2e.p50);
    assert!(rep.corrected_ms.p50 >= e2e.p50);
}

/// 20 requests on one connection; the k-th answer by k mod 10: 3 → 503, 6 → never (timeout
/// after 100 ms), 8 → connection closed, else 200. 14 ok, 2 of each error.
#[test]
fn errors_and_timeouts_are_counted_by_kind() {
    let server = serve(|k| match k % 10 {
        3 => Reply::Status(503),
        6 => Reply::Hang,
        8 => Reply::Close,
        _ => Reply::Ok(Duration::ZERO),
    });
    let rep = run(LoadConfig {
        url: format!("http://{}", server.addr),
        rate: 20.0,
        limit: Limit::Requests(20),
        connections: 1,
        timeout: ms(100),
        ..LoadConfig::default()
    });
    assert_eq!((rep.sent, rep.ok, rep.errors, rep.unsent), (20, 14, 6, 0));
    let want: BTreeMap<String, u64> = [("status_503", 2), ("timeout", 2), ("transport", 2)]
        .into_iter()
        .map(|(k, n)| (k.to_string(), n))
        .collect();
    assert_eq!(rep.errors_by_kind, want);
    assert_eq!(rep.corrected_ms.count, 14);
}

/// Every request hangs: 10 at 100 req/s, timeout 200 ms. Request 0 times out at 200 ms,
/// request 1 (due at 10 ms) leaves then, late, and times out at 400 ms, after the send deadline
/// (schedule end 100 ms + 200 ms): the other 8 are never sent.
#[test]
fn a_stalled_target_leaves_requests_unsent_and_says_so() {
    let server = serve(|_| Reply::Hang);
    let rep = run(LoadConfig {
        url: format!("http://{}", server.addr),
        rate: 100.0,
        limit: Limit::Requests(10),
        connections: 1,
        timeout: ms(200),
        ..LoadConfig::default()
    });
    assert_eq!((rep.sent, rep.ok, rep.unsent), (2, 0, 8));
    assert_eq!(
        rep.errors_by_kind,
        BTreeMap::from([("timeout".to_string(), 2)])
    );
    assert_eq!((rep.late, rep.late_generator), (1, 0));
    assert!(rep.send_lag_ms.max >= 190.0, "lag {}", rep.send_lag_ms.max);
    assert_eq!(rep.warnings.len(), 2, "{:?}", rep.warnings);
    assert!(rep.warnings[0].starts_with("behind schedule: 1 of 2 requests"));
    assert!(rep.warnings[1].starts_with("8 of 10 scheduled requests were never sent"));
}

/// Nothing listens: every request is tried and fails to connect.
#[test]
fn connection_refused_counts_every_request() {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let rep = run(LoadConfig {
        url: format!("http://{addr}"),
        rate: 100.0,
        limit: Limit::Requests(5),
        connections: 2,
        ..LoadConfig::default()
    });
    assert_eq!((rep.sent, rep.ok, rep.unsent), (5, 0, 0));
    assert_eq!(
        rep.errors_by_kind,
        BTreeMap::from([("connect".to_string(), 5)])
    );
}

/// With a lateness bound of 1 ns every request is late by the timer's wake-up, on a connection
/// that was free: all of it is the generator's lag.
#[test]
fn lateness_on_a_free_connection_is_the_generators() {
    let server = serve(|_| Reply::Ok(Duration::ZERO));
    let rep = run(LoadConfig {
        url: format!("http://{}", server.addr),
        rate: 50.0,
        limit: Limit::Requests(10),
        connections: 2,
        max_lag: Duration::from_nanos(1),
        ..LoadConfig::default()
    });
    assert_eq!((rep.ok, rep.late, rep.late_generator), (10, 10, 10));
    assert!(rep.warnings[0].contains("10 of them while a connection was free"));
    // The wake-up is the µs timer's, not tokio's 1 ms tick.
    assert!(
        rep.send_lag_ms.p50 < 0.5,
        "send lag p50 {}",
        rep.send_lag_ms.p50
    );
}
