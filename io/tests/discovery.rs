//! DNS discovery end to end (issue 16, item 4): an authoritative DNS server in-process
//! (hickory-server) on 127.0.0.1, simulated engines on 127.0.0.2–4, and `kvroute serve`
//! with `--worker-dns` sources of both forms resolving through that server. The zone changes
//! mid-test and the fleet follows within the refresh interval; a lookup that fails keeps the
//! last good set. Only loopback; every wait is bounded.

mod common;

use common::*;
use hickory_server::net::runtime::TokioRuntimeProvider;
use hickory_server::proto::rr::rdata::{A, SOA, SRV};
use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordType, RrKey};
use hickory_server::store::in_memory::InMemoryZoneHandler;
use hickory_server::zone_handler::{AxfrPolicy, Catalog, ZoneHandler, ZoneType};
use kvroute_bench::engine::{self, EngineConfig, EngineHandle};
use kvroute_core::config::{Config, PolicyKind};
use kvroute_io::gateway;
use serde_json::json;
use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

type Zone = Arc<InMemoryZoneHandler<TokioRuntimeProvider>>;

const ORIGIN: &str = "kvroute.test.";
const POOL: &str = "pool.kvroute.test.";
const SRV_NAME: &str = "_http._tcp.srv.kvroute.test.";
const TARGET: &str = "e.kvroute.test.";
const MODEL: &str = "qwen3-sim";

fn name(s: &str) -> Name {
    Name::from_ascii(s).unwrap()
}

/// Runs one Tokio future to its end on a throw-away runtime (the zone's lock is Tokio's).
fn block<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// The zone `kvroute.test.` served on 127.0.0.1 (UDP and TCP, one port) from its own thread;
/// returns the zone (to change it) and the server's address.
fn dns_server() -> (Zone, SocketAddr) {
    let mut zone = InMemoryZoneHandler::<TokioRuntimeProvider>::empty(
        name(ORIGIN),
        ZoneType::Primary,
        AxfrPolicy::Deny,
    );
    let soa = SOA::new(
        name("ns.kvroute.test."),
        name("admin.kvroute.test."),
        1,
        60,
        60,
        60,
        1,
    );
    assert!(zone.upsert_mut(Record::from_rdata(name(ORIGIN), 1, RData::SOA(soa)), 1));
    let zone: Zone = Arc::new(zone);
    let mut catalog = Catalog::new();
    catalog.upsert(
        LowerName::new(&name(ORIGIN)),
        vec![zone.clone() as Arc<dyn ZoneHandler>],
    );
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("test-dns".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
                let addr = udp.local_addr().unwrap();
                let tcp = tokio::net::TcpListener::bind(addr).await.unwrap();
                let mut server = hickory_server::Server::new(catalog);
                server.register_socket(udp);
                server.register_listener(tcp, Duration::from_secs(5), 1 << 16);
                tx.send(addr).unwrap();
                let _ = server.block_until_done().await;
            });
        })
        .unwrap();
    let addr = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("DNS server up");
    (zone, addr)
}

/// Makes the A records of `host` exactly `ips` (none: the name is gone).
fn set_a(zone: &Zone, host: &str, ips: &[Ipv4Addr]) {
    block(async {
        zone.records_mut()
            .await
            .remove(&RrKey::new(LowerName::new(&name(host)), RecordType::A));
        for ip in ips {
            assert!(
                zone.upsert(Record::from_rdata(name(host), 1, RData::A(A(*ip))), 1)
                    .await
            );
        }
    });
}

/// Makes the SRV records of [`SRV_NAME`] exactly one: `port` on [`TARGET`].
fn set_srv(zone: &Zone, port: u16) {
    block(async {
        zone.records_mut().await.remove(&RrKey::new(
            LowerName::new(&name(SRV_NAME)),
            RecordType::SRV,
        ));
        let srv = SRV::new(0, 0, port, name(TARGET));
        assert!(
            zone.upsert(Record::from_rdata(name(SRV_NAME), 1, RData::SRV(srv)), 1)
                .await
        );
    });
}

fn engine_on(ip: Ipv4Addr, port: u16) -> EngineHandle {
    let cfg = EngineConfig {
        listen: SocketAddr::from((ip, port)),
        model_name: MODEL.into(),
        speedup_ratio: 0.0,
        ..EngineConfig::default()
    };
    // One tokenizer for every engine: loading it is most of the test's time.
    static TOK: std::sync::OnceLock<Arc<kvroute_tokenize::Tokenizer>> = std::sync::OnceLock::new();
    let tok = TOK.get_or_init(|| {
        Arc::new(kvroute_tokenize::Tokenizer::qwen3().expect("embedded tokenizer"))
    });
    engine::server::spawn(cfg, tok.clone()).expect("engine starts")
}

fn urls(gw: &kvroute_io::shard::Server) -> BTreeSet<String> {
    gw.shared()
        .workers
        .iter()
        .iter()
        .map(|w| w.url.clone())
        .collect()
}

fn set(list: &[String]) -> BTreeSet<String> {
    list.iter().cloned().collect()
}

#[test]
fn fleet_follows_a_and_srv_records() {
    let (zone, dns) = dns_server();
    // Three engines on one port, as pods of a headless service are.
    let e2 = engine_on(Ipv4Addr::new(127, 0, 0, 2), 0);
    let port = e2.addr.port();
    let _e3 = engine_on(Ipv4Addr::new(127, 0, 0, 3), port);
    let _e4 = engine_on(Ipv4Addr::new(127, 0, 0, 4), port);
    let u = |last: u8| format!("http://127.0.0.{last}:{port}");
    set_a(
        &zone,
        POOL,
        &[Ipv4Addr::new(127, 0, 0, 3), Ipv4Addr::new(127, 0, 0, 2)],
    );
    set_a(&zone, TARGET, &[Ipv4Addr::new(127, 0, 0, 4)]);
    set_srv(&zone, port);

    let pool_src = format!("pool.kvroute.test:{port}");
    let srv_src = format!("srv:{SRV_NAME}");
    let cfg = Config {
        listen: "127.0.0.1:0".into(),
        worker_dns: vec![pool_src.clone(), srv_src.clone()],
        dns_server: Some(dns.to_string()),
        dns_refresh_secs: 1,
        policy: PolicyKind::RoundRobin,
        shards: Some(1),
        admin_listen: "127.0.0.1:0".into(),
        ..Config::default()
    };
    let gw = gateway::start(cfg, false).expect("gateway starts");
    // The first answer is in the fleet before the listeners open.
    assert_eq!(urls(&gw), set(&[u(2), u(3), u(4)]));
    let ids: Vec<usize> = gw.shared().workers.iter().iter().map(|w| w.id).collect();
    assert_eq!(ids, vec![0, 1, 2]);
    let ask = || {
        post(
            gw.local_addr(),
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "hello", "max_tokens": 2}),
        )
    };
    let served: BTreeSet<String> = (0..6)
        .map(|_| {
            let r = ask();
            assert_eq!(r.status, 200, "{}", r.text());
            r.header("x-kvroute-worker").unwrap().to_string()
        })
        .collect();
    assert_eq!(served, ["0", "1", "2"].map(String::from).into());
    let text = get(gw.local_addr(), "/metrics").text();
    assert_eq!(
        metric(
            &text,
            &format!("kvroute_discovery_workers{{source=\"{pool_src}\"}}")
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &text,
            &format!("kvroute_discovery_workers{{source=\"{srv_src}\"}}")
        ),
        Some(1.0)
    );

    // .3 leaves the service: drained and removed within a refresh or two; .2 and .4 keep
    // their ids.
    set_a(&zone, POOL, &[Ipv4Addr::new(127, 0, 0, 2)]);
    assert!(
        wait_until(Duration::from_secs(10), || urls(&gw) == set(&[u(2), u(4)])),
        "{:?}",
        urls(&gw)
    );
    assert_eq!(gw.shared().workers.find_url(&u(2)).map(|w| w.id), Some(0));
    assert_eq!(gw.shared().workers.find_url(&u(4)).map(|w| w.id), Some(2));

    // The pool's name disappears (NXDOMAIN): nothing is removed, the failures are counted.
    set_a(&zone, POOL, &[]);
    let errors = |gw: &kvroute_io::shard::Server| {
        metric(
            &get(gw.local_addr(), "/metrics").text(),
            &format!("kvroute_discovery_errors_total{{source=\"{pool_src}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert!(wait_until(Duration::from_secs(10), || errors(&gw) >= 2.0));
    assert_eq!(urls(&gw), set(&[u(2), u(4)]));
    assert_eq!(ask().status, 200);

    // .3 comes back (a new id, working) and the SRV target moves to .3's address: the SRV
    // source's .4 leaves, and its .3 is refused while the pool holds that URL (retried,
    // not duplicated).
    set_a(
        &zone,
        POOL,
        &[Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)],
    );
    set_a(&zone, TARGET, &[Ipv4Addr::new(127, 0, 0, 3)]);
    assert!(
        wait_until(Duration::from_secs(10), || urls(&gw) == set(&[u(2), u(3)])),
        "{:?}",
        urls(&gw)
    );
    let back = gw.shared().workers.find_url(&u(3)).unwrap();
    assert!(back.id > 2, "a new slot: {}", back.id);
    assert!(wait_until(Duration::from_secs(10), || {
        (0..4).all(|_| ask().status == 200)
            && gw.shared().workers.get(back.id).unwrap().processed() > 0
    }));
    assert_eq!(gw.shared().workers.len(), 2);
    // A SIGHUP reload of a config without static workers leaves the discovered ones.
    let (added, removed) = gateway::apply_workers(gw.shared(), &[]).unwrap();
    assert!(
        added.is_empty() && removed.is_empty(),
        "{added:?} {removed:?}"
    );
    assert_eq!(urls(&gw), set(&[u(2), u(3)]));
    drop(gw);
}

/// A malformed `--worker-dns` is a start-up error that names the flag.
#[test]
fn bad_source_is_a_startup_error() {
    let cfg = Config {
        listen: "127.0.0.1:0".into(),
        worker_dns: vec!["pool.kvroute.test".into()],
        ..Config::default()
    };
    let err = gateway::start(cfg, false)
        .err()
        .expect("refused")
        .to_string();
    assert_eq!(
        err,
        "config: --worker-dns \"pool.kvroute.test\": expected NAME:PORT or srv:NAME"
    );
}
