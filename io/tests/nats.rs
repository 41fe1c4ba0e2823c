//! Replica sync over NATS (`--nats`, issue 16) end to end: two and three `kvroute serve`
//! replicas in-process, one `nats-server` from PATH on a loopback port, simulated engines.
//! Without nats-server the tests skip with a notice, unless `KVROUTE_REQUIRE_NATS` is set
//! (CI installs it and sets it).

mod common;

use common::*;
use kvroute_bench::engine::{self, EngineConfig};
use kvroute_core::config::{Config, PolicyKind};
use kvroute_io::gateway;
use kvroute_io::shard::Server;
use kvroute_tokenize::Tokenizer;
use serde_json::json;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

const MODEL: &str = kvroute_bench::engine::defaults::MODEL_NAME;

/// A `nats-server` on a loopback port, killed on drop.
struct Nats {
    port: u16,
    child: Option<Child>,
}

impl Nats {
    /// Starts one on a free port; `None` (after a notice) without nats-server on PATH.
    fn start() -> Option<Nats> {
        if Command::new("nats-server")
            .arg("--version")
            .output()
            .is_err()
        {
            assert!(
                std::env::var_os("KVROUTE_REQUIRE_NATS").is_none(),
                "KVROUTE_REQUIRE_NATS is set but nats-server is not on PATH"
            );
            eprintln!("skipped: nats-server not on PATH (apt-get install nats-server)");
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut n = Nats { port, child: None };
        n.restart();
        Some(n)
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on its port and waits until it accepts connections.
    fn restart(&mut self) {
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server starts");
        self.child = Some(child);
        let addr: SocketAddr = format!("127.0.0.1:{}", self.port).parse().unwrap();
        assert!(
            wait_until(Duration::from_secs(10), || TcpStream::connect(addr).is_ok()),
            "nats-server listens on {addr}"
        );
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.kill();
    }
}

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::qwen3().expect("embedded tokenizer")))
        .clone()
}

/// `n` simulated engines; `speedup_ratio` 1 decodes in real time (a 100-token answer takes
/// about a second), high values answer at once.
/// Returns the handles (engines stop when dropped) and their URLs.
fn engines(n: usize, speedup_ratio: f64) -> (Vec<engine::server::EngineHandle>, Vec<String>) {
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let cfg = EngineConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                speedup_ratio,
                decode_speedup_ratio: speedup_ratio,
                seed: i as u64 + 1,
                ..EngineConfig::default()
            };
            engine::server::spawn(cfg, tokenizer()).expect("engine starts")
        })
        .collect();
    let urls = handles
        .iter()
        .map(|e| format!("http://{}", e.addr))
        .collect();
    (handles, urls)
}

fn replica(urls: &[String], nats: &Nats) -> Server {
    let cfg = Config {
        listen: "127.0.0.1:0".into(),
        workers: urls.to_vec(),
        policy: PolicyKind::CacheAware,
        shards: Some(1),
        health_check_interval_secs: 0,
        expose_worker_url: true,
        nats_url: Some(nats.url()),
        admin_listen: "127.0.0.1:0".into(),
        ..Config::default()
    };
    gateway::start(cfg, false).expect("gateway starts")
}

fn metrics(s: &Server) -> String {
    get(s.local_addr(), "/metrics").text()
}

/// Every replica is connected and hears the others.
fn wait_connected(replicas: &[&Server]) {
    let peers = (replicas.len() - 1) as f64;
    for r in replicas {
        assert!(
            wait_until(Duration::from_secs(15), || {
                let m = metrics(r);
                metric(&m, "kvroute_sync_connected ") == Some(1.0)
                    && metric(&m, "kvroute_sync_peers ") == Some(peers)
            }),
            "replica connected with {peers} peers:\n{}",
            metrics(r)
        );
    }
}

/// Turn `turn` of conversation `conv`: a long system prompt of its own, then the turns so far.
fn chat(conv: usize, turn: usize, max_tokens: u64) -> serde_json::Value {
    let mut messages = vec![json!({"role": "system", "content":
        format!("conversation {conv}: {}", "you answer questions about rivers and lakes. ".repeat(12))})];
    for t in 0..=turn {
        messages.push(
            json!({"role": "user", "content": format!("question {t} of conversation {conv}?")}),
        );
        if t < turn {
            messages.push(json!({"role": "assistant", "content": format!("answer {t} in some detail, conversation {conv}.")}));
        }
    }
    json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens})
}

/// Sends `body` to `replica`; returns the worker URL that served it.
fn send(replica: &Server, body: &serde_json::Value) -> String {
    let r = post(replica.local_addr(), "/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.header("x-kvroute-worker-url")
        .expect("worker url header")
        .to_string()
}

/// Sum over workers of the peer bookings a replica holds.
fn peer_bookings(s: &Server) -> usize {
    s.shared()
        .workers
        .iter()
        .iter()
        .map(|w| w.peer_requests())
        .sum()
}

/// No replica holds a peer booking, and each one's load accounting is consistent.
fn no_phantom_load(replicas: &[&Server]) {
    for r in replicas {
        let loads = || -> Vec<(usize, usize)> {
            r.shared()
                .workers
                .iter()
                .iter()
                .map(|w| (w.in_flight(), w.peer_requests()))
                .collect()
        };
        // A response's last bytes reach the client just before its guard drops, and a peer's
        // `routed` for its last request may reach this replica only after that client has its
        // answer: wait for no load, then long enough for such a late `routed` and the `done`
        // its publisher sent after it (in order, over loopback) to land, and look again.
        let idle = || loads().iter().all(|&l| l == (0, 0));
        assert!(
            wait_until(Duration::from_secs(5), idle),
            "load left (own, peers) per worker: {:?}",
            loads()
        );
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            idle(),
            "load came back (own, peers) per worker: {:?}",
            loads()
        );
        for w in r.shared().workers.iter() {
            assert_eq!(w.load(), 0, "worker {}", w.url);
            w.active_check().expect("active load consistent");
        }
    }
}

/// The messages of type `kind` replica `s` applied.
fn applied(s: &Server, kind: &str) -> f64 {
    let prefix = format!("kvroute_sync_received_total{{type=\"{kind}\",outcome=\"done\"}}");
    metric(&metrics(s), &prefix).unwrap_or(0.0)
}

/// Three replicas, conversations whose turns go round the replicas: every turn of a
/// conversation reaches the worker its first turn went to, whichever replica routes it, and
/// nothing is left booked at the end.
#[test]
fn three_replicas_keep_each_conversation_on_one_worker() {
    let Some(nats) = Nats::start() else { return };
    let (_engines, urls) = engines(4, 1000.0);
    let (a, b, c) = (
        replica(&urls, &nats),
        replica(&urls, &nats),
        replica(&urls, &nats),
    );
    let replicas = [&a, &b, &c];
    wait_connected(&replicas);
    let mut firsts = std::collections::HashSet::new();
    for conv in 0..8 {
        let mut holder: Option<String> = None;
        for turn in 0..4 {
            let (to, next) = (replicas[(conv + turn) % 3], replicas[(conv + turn + 1) % 3]);
            let before = applied(next, "placed");
            let served = send(to, &chat(conv, turn, 8));
            match &holder {
                None => holder = Some(served.clone()),
                Some(h) => assert_eq!(&served, h, "conversation {conv} turn {turn}"),
            }
            // The next replica has heard of this turn before the user's next message.
            assert!(wait_until(Duration::from_secs(5), || applied(
                next, "placed"
            ) > before));
        }
        firsts.insert(holder.unwrap());
    }
    // The load term still spreads conversations: not all on one worker.
    assert!(firsts.len() >= 2, "{firsts:?}");
    no_phantom_load(&replicas);
    for r in replicas {
        let m = metrics(r);
        assert_eq!(metric(&m, "kvroute_sync_dropped_total"), None, "{m}");
        assert!(metric(&m, "kvroute_sync_sent_total{type=\"routed\"}").unwrap() >= 10.0);
    }
}

/// A request in flight on one replica counts on its worker at the other one, once, until
/// it ends.
#[test]
fn a_peer_request_in_flight_is_booked_once_and_released() {
    let Some(nats) = Nats::start() else { return };
    let (_engines, urls) = engines(2, 1.0);
    let (a, b) = (replica(&urls, &nats), replica(&urls, &nats));
    wait_connected(&[&a, &b]);
    let mut body = chat(0, 0, 150);
    body["stream"] = json!(true);
    let mut stream = open_post(
        a.local_addr(),
        "/v1/chat/completions",
        &serde_json::to_vec(&body).unwrap(),
    );
    assert!(
        wait_until(Duration::from_secs(5), || peer_bookings(&b) == 1),
        "b books a's request"
    );
    let on: Vec<usize> = b
        .shared()
        .workers
        .iter()
        .iter()
        .map(|w| w.peer_requests())
        .collect();
    assert_eq!(on.iter().sum::<usize>(), 1, "{on:?}");
    assert_eq!(peer_bookings(&a), 0, "a does not book its own request");
    let r = read_response(&mut stream);
    assert_eq!(r.status, 200);
    assert!(r.text().contains("[DONE]"));
    no_phantom_load(&[&a, &b]);
}

/// NATS killed mid-run: both replicas keep answering on local state, count what they could
/// not send, and once NATS is back they reconnect, hear each other and route together again,
/// with no load left booked.
#[test]
fn nats_down_and_back_routing_continues_and_state_converges() {
    let Some(mut nats) = Nats::start() else {
        return;
    };
    let (_engines, urls) = engines(4, 1000.0);
    let (a, b) = (replica(&urls, &nats), replica(&urls, &nats));
    wait_connected(&[&a, &b]);
    send(&a, &chat(100, 0, 8));
    nats.kill();
    for r in [&a, &b] {
        assert!(wait_until(Duration::from_secs(10), || metric(
            &metrics(r),
            "kvroute_sync_connected "
        ) == Some(0.0)));
    }
    for conv in 0..6 {
        send(&a, &chat(200 + conv, 0, 8));
        send(&b, &chat(300 + conv, 0, 8));
    }
    for r in [&a, &b] {
        let m = metrics(r);
        let dropped = metric(&m, "kvroute_sync_dropped_total{reason=\"disconnected\"}");
        assert!(dropped.unwrap_or(0.0) >= 18.0, "{m}");
    }
    nats.restart();
    wait_connected(&[&a, &b]);
    for conv in 0..4 {
        let first = send(&a, &chat(400 + conv, 0, 8));
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            send(&b, &chat(400 + conv, 1, 8)),
            first,
            "conversation {conv}"
        );
    }
    no_phantom_load(&[&a, &b]);
}

/// A replica that joins after conversations started finds their holders: the others answer
/// its hello with their recent placements.
#[test]
fn a_late_replica_learns_recent_placements() {
    let Some(nats) = Nats::start() else { return };
    let (_engines, urls) = engines(4, 1000.0);
    let a = replica(&urls, &nats);
    let holders: Vec<String> = (0..6)
        .map(|conv| send(&a, &chat(500 + conv, 0, 8)))
        .collect();
    let late = replica(&urls, &nats);
    wait_connected(&[&a, &late]);
    assert!(wait_until(Duration::from_secs(5), || applied(
        &late, "placed"
    ) >= 1.0));
    for (conv, h) in holders.iter().enumerate() {
        assert_eq!(
            &send(&late, &chat(500 + conv, 1, 8)),
            h,
            "conversation {conv}"
        );
    }
    no_phantom_load(&[&a, &late]);
}
