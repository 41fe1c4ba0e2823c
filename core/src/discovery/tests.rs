use super::*;
use proptest::prelude::*;
use std::collections::VecDeque;

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn addrs(list: &[&str]) -> Vec<SocketAddr> {
    list.iter().map(|s| addr(s)).collect()
}

/// A resolver that gives the queued answers in order.
struct Script(VecDeque<Result<Vec<SocketAddr>, LookupError>>);

impl Resolve for Script {
    fn resolve(&mut self, _: &DnsQuery) -> Result<Vec<SocketAddr>, LookupError> {
        self.0
            .pop_front()
            .unwrap_or_else(|| Err(LookupError::Other("script ended".into())))
    }
}

/// A fleet of URLs with ids that are never reused, as `Workers` does; refuses the URLs in
/// `refuse`.
#[derive(Default)]
struct FakeFleet {
    next: usize,
    live: BTreeMap<usize, String>,
    refuse: BTreeSet<String>,
    removed: Vec<usize>,
}

impl FakeFleet {
    fn urls(&self) -> BTreeSet<String> {
        self.live.values().cloned().collect()
    }
}

impl Fleet for FakeFleet {
    fn add(&mut self, spec: &WorkerSpec) -> Result<usize, String> {
        if self.refuse.contains(&spec.url) || self.live.values().any(|u| *u == spec.url) {
            return Err(format!("{} is present", spec.url));
        }
        let id = self.next;
        self.next += 1;
        self.live.insert(id, spec.url.clone());
        Ok(id)
    }
    fn remove(&mut self, id: usize) {
        assert!(self.live.remove(&id).is_some(), "removed twice: {id}");
        self.removed.push(id);
    }
    fn present(&self, id: usize) -> bool {
        self.live.contains_key(&id)
    }
}

fn urls(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn specs_parse_and_errors_name_the_flag() {
    let s = parse_dns_source("vllm.default.svc.cluster.local:8000").unwrap();
    assert_eq!(
        s.query,
        DnsQuery::Host {
            name: "vllm.default.svc.cluster.local".into(),
            port: 8000
        }
    );
    assert_eq!(s.label, "vllm.default.svc.cluster.local:8000");
    assert_eq!((s.dp, s.events_port, s.replay_port), (1, None, None));
    let s = parse_dns_source("srv:_http._tcp.vllm.default.svc.cluster.local.").unwrap();
    assert_eq!(
        s.query,
        DnsQuery::Srv {
            name: "_http._tcp.vllm.default.svc.cluster.local.".into()
        }
    );
    let s = parse_dns_source(
        "srv:_http._tcp.pool;events_port=5557;replay_port=5558;dp=2;model=qwen3;api_key_env=K",
    )
    .unwrap();
    assert_eq!(s.label, "srv:_http._tcp.pool");
    assert_eq!(
        (s.events_port, s.replay_port, s.dp),
        (Some(5557), Some(5558), 2)
    );
    assert_eq!(
        (s.models.clone(), s.api_key_env.clone()),
        (vec!["qwen3".to_string()], Some("K".to_string()))
    );
    // A discovered worker's spec: its address, the source's options, events on its address.
    let w = s.worker_spec(addr("10.1.2.3:8000")).unwrap();
    assert_eq!(w.url, "http://10.1.2.3:8000");
    assert_eq!(w.events.as_deref(), Some("tcp://10.1.2.3:5557"));
    assert_eq!(w.replay.as_deref(), Some("tcp://10.1.2.3:5558"));
    assert_eq!((w.dp, w.models.clone()), (2, vec!["qwen3".to_string()]));
    let w6 = s.worker_spec(addr("[fd00::7]:9000")).unwrap();
    assert_eq!(w6.url, "http://[fd00::7]:9000");
    assert_eq!(w6.events.as_deref(), Some("tcp://[fd00::7]:5557"));
    assert_eq!(
        parse_dns_source("[::1]:80").unwrap().query,
        DnsQuery::Host {
            name: "::1".into(),
            port: 80
        }
    );
    assert!(matches!(
        parse_dns_source("127.0.0.1:80").unwrap().query,
        DnsQuery::Host { port: 80, .. }
    ));
    // A host named `srv` with a port is a host, not an SRV name.
    assert_eq!(
        parse_dns_source("srv:8000").unwrap().query,
        DnsQuery::Host {
            name: "srv".into(),
            port: 8000
        }
    );
    for (bad, problem) in [
        ("pool", "expected NAME:PORT or srv:NAME"),
        ("pool:0", "port must be a number 1-65535"),
        ("pool:70000", "port must be a number 1-65535"),
        ("pool:http", "port must be a number 1-65535"),
        (":80", "NAME must be a DNS name or an IP address"),
        ("bad name:80", "NAME must be a DNS name or an IP address"),
        ("a..b:80", "NAME must be a DNS name or an IP address"),
        ("[nope]:80", "a bracketed host must be an IPv6 address"),
        (
            "srv:",
            "srv: must be followed by a DNS name (srv:_http._tcp.NAME)",
        ),
        ("pool:80;dp", "options are ;key=value"),
        ("pool:80;dp=0", "dp must be an integer 1-1024"),
        (
            "pool:80;events_port=x",
            "events_port/replay_port must be a number 1-65535",
        ),
        ("pool:80;replay_port=5558", "replay_port needs events_port"),
        (
            "pool:80;events=tcp://h:1",
            "discovered workers take events_port=P / replay_port=P (their own address)",
        ),
        (
            "pool:80;colour=red",
            "unknown option (expected events_port, replay_port, dp, model, api_key_env)",
        ),
    ] {
        let err = parse_dns_source(bad).unwrap_err();
        assert_eq!(
            err,
            CoreError::BadDnsSource {
                spec: bad.into(),
                problem
            },
            "{bad}"
        );
        assert!(
            err.to_string().starts_with("config: --worker-dns "),
            "{err}"
        );
    }
}

/// The worked example: add, keep, remove, a failed lookup, an empty answer, a comeback.
#[test]
fn refresh_follows_the_answers() {
    let src = parse_dns_source("pool:8000").unwrap();
    let mut state = Reconciler::new(8);
    let mut fleet = FakeFleet::default();
    let mut dns = Script(VecDeque::from([
        Ok(addrs(&["10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.1:8000"])),
        Ok(addrs(&["10.0.0.1:8000", "10.0.0.3:8000"])),
        Err(LookupError::NotFound("NXDOMAIN".into())),
        Ok(vec![]),
        Err(LookupError::Timeout("5 s".into())),
        Ok(addrs(&["10.0.0.1:8000", "10.0.0.2:8000"])),
    ]));
    // 1: two workers (the duplicate counted once), in address order.
    let r = refresh(&src, &mut state, &mut dns, &mut fleet);
    assert_eq!(
        r.outcome,
        Outcome::Answered {
            addresses: 2,
            dropped: 0
        }
    );
    assert_eq!(
        r.added,
        vec![(addr("10.0.0.1:8000"), 0), (addr("10.0.0.2:8000"), 1)]
    );
    assert_eq!(
        fleet.urls(),
        urls(&["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    );
    // 2: .2 leaves, .3 joins, .1 is untouched (same id).
    let r = refresh(&src, &mut state, &mut dns, &mut fleet);
    assert_eq!(r.removed, vec![(addr("10.0.0.2:8000"), 1)]);
    assert_eq!(r.added, vec![(addr("10.0.0.3:8000"), 2)]);
    assert_eq!(state.members().get(&addr("10.0.0.1:8000")), Some(&0));
    assert_eq!(fleet.removed, vec![1]);
    // 3–5: NXDOMAIN, an empty answer, a timeout: nothing changes.
    for _ in 0..3 {
        let r = refresh(&src, &mut state, &mut dns, &mut fleet);
        assert!(matches!(r.outcome, Outcome::Failed(_)), "{r:?}");
        assert!(r.added.is_empty() && r.removed.is_empty());
        assert_eq!(
            fleet.urls(),
            urls(&["http://10.0.0.1:8000", "http://10.0.0.3:8000"])
        );
    }
    // 6: .2 is back with a new id; .3 leaves.
    let r = refresh(&src, &mut state, &mut dns, &mut fleet);
    assert_eq!(r.added, vec![(addr("10.0.0.2:8000"), 3)]);
    assert_eq!(r.removed, vec![(addr("10.0.0.3:8000"), 2)]);
    assert_eq!(
        fleet.urls(),
        urls(&["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    );
}

/// The cap keeps the lowest addresses whatever order the answer comes in, and says how many
/// it dropped.
#[test]
fn cap_keeps_the_lowest_addresses() {
    let src = parse_dns_source("pool:1").unwrap();
    let mut state = Reconciler::new(2);
    let mut fleet = FakeFleet::default();
    let mut dns = Script(VecDeque::from([
        Ok(addrs(&[
            "10.0.0.9:1",
            "10.0.0.3:1",
            "10.0.0.5:1",
            "10.0.0.1:1",
        ])),
        Ok(addrs(&[
            "10.0.0.5:1",
            "10.0.0.1:1",
            "10.0.0.3:1",
            "10.0.0.9:1",
        ])),
    ]));
    let r = refresh(&src, &mut state, &mut dns, &mut fleet);
    assert_eq!(
        r.outcome,
        Outcome::Answered {
            addresses: 4,
            dropped: 2
        }
    );
    assert_eq!(
        fleet.urls(),
        urls(&["http://10.0.0.1:1", "http://10.0.0.3:1"])
    );
    // The same records rotated: no churn.
    let r = refresh(&src, &mut state, &mut dns, &mut fleet);
    assert!(r.added.is_empty() && r.removed.is_empty(), "{r:?}");
}

/// A refused add is retried; a member removed by someone else is added again.
#[test]
fn refused_adds_retry_and_foreign_removals_are_repaired() {
    let src = parse_dns_source("pool:1").unwrap();
    let mut state = Reconciler::new(8);
    let mut fleet = FakeFleet::default();
    fleet.refuse.insert("http://10.0.0.2:1".into());
    let answer = || Ok(addrs(&["10.0.0.1:1", "10.0.0.2:1"]));
    let mut dns = Script(VecDeque::from([answer(), answer(), answer()]));
    let r = refresh(&src, &mut state, &mut dns, &mut fleet);
    assert_eq!(r.added, vec![(addr("10.0.0.1:1"), 0)]);
    assert_eq!(r.refused.len(), 1);
    assert_eq!(r.refused[0].0, addr("10.0.0.2:1"));
    fleet.refuse.clear();
    fleet.remove(0); // the admin API removed .1
    let r = refresh(&src, &mut state, &mut dns, &mut fleet);
    assert_eq!(
        r.added,
        vec![(addr("10.0.0.1:1"), 1), (addr("10.0.0.2:1"), 2)]
    );
    assert!(r.removed.is_empty());
    let r = refresh(&src, &mut state, &mut dns, &mut fleet);
    assert!(r.added.is_empty() && r.removed.is_empty() && r.refused.is_empty());
}

/// One step of a random script: a good answer drawn from a small pool of addresses (so they
/// leave and come back), an empty answer, or a failure.
fn step() -> impl Strategy<Value = Result<Vec<SocketAddr>, LookupError>> {
    let a = (0u8..12, prop_oneof![Just(80u16), Just(81u16)])
        .prop_map(|(i, p)| SocketAddr::from(([10, 0, 0, i], p)));
    prop_oneof![
        6 => prop::collection::vec(a, 1..10).prop_map(Ok),
        1 => Just(Ok(vec![])),
        1 => Just(Err(LookupError::NotFound("NXDOMAIN".into()))),
        1 => Just(Err(LookupError::Timeout("t".into()))),
    ]
}

proptest! {
    /// After every refresh the fleet is the last good answer, capped; a failed lookup removes
    /// nothing; an address that left and came back is a live worker under a new id.
    #[test]
    fn fleet_is_the_last_good_answer(script in prop::collection::vec(step(), 1..40), cap in 1usize..6) {
        let src = parse_dns_source("pool:80").unwrap();
        let mut state = Reconciler::new(cap);
        let mut fleet = FakeFleet::default();
        let mut last_good: BTreeSet<String> = BTreeSet::new();
        let mut ever: BTreeMap<SocketAddr, usize> = BTreeMap::new();
        for answer in script {
            let before = fleet.urls();
            let good = answer.as_ref().ok().filter(|a| !a.is_empty()).cloned();
            let mut dns = Script(VecDeque::from([answer]));
            let r = refresh(&src, &mut state, &mut dns, &mut fleet);
            match good {
                Some(a) => {
                    let sorted: BTreeSet<SocketAddr> = a.into_iter().collect();
                    let dropped = sorted.len().saturating_sub(cap);
                    prop_assert_eq!(&r.outcome, &Outcome::Answered { addresses: sorted.len(), dropped });
                    last_good = sorted.into_iter().take(cap).map(|a| format!("http://{a}")).collect();
                }
                None => {
                    prop_assert!(matches!(r.outcome, Outcome::Failed(_)));
                    prop_assert!(r.removed.is_empty());
                    prop_assert_eq!(&fleet.urls(), &before);
                }
            }
            prop_assert_eq!(&fleet.urls(), &last_good);
            prop_assert!(fleet.live.len() <= cap);
            prop_assert!(r.refused.is_empty());
            for &(a, id) in &r.added {
                if let Some(old) = ever.insert(a, id) {
                    prop_assert!(id > old, "a comeback gets a new id");
                    prop_assert!(!fleet.present(old));
                }
                prop_assert!(fleet.present(id));
            }
            // Members are exactly the fleet.
            let members: BTreeSet<String> = state.members().keys().map(|a| format!("http://{a}")).collect();
            prop_assert_eq!(&members, &fleet.urls());
        }
    }
}
