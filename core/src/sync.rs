//! Replica sync (issue 16): what one router replica tells its peers so that several replicas
//! behind an L4 balancer route as one router would. Transport-neutral: `kvroute serve
//! --nats` carries these messages over NATS, the simulator delivers them after a modelled
//! delay; both apply them with [`apply`].
//!
//! | message | sent when | a peer then | source |
//! |---|---|---|---|
//! | [`SyncMsg::Routed`] | a request is committed to a worker | books it on that worker as a peer request ([`crate::workers::Worker::book_peer`]): its request count, booked prefill and blocks; records its page keys for the worker ([`crate::policy::Router::record_peer`]) | Dynamo's replica sync (add-request), SMG's tree gossip (inserts) |
//! | [`SyncMsg::FirstToken`] | its first token reached the router | ends the booking's prefill charge | Dynamo (prefill-done) |
//! | [`SyncMsg::Done`] | it ended (any way), with the engine's `usage` if seen | ends the booking, once; an alone first token teaches the prefill curve, as an own request's does | Dynamo (free) |
//!
//! | [`SyncMsg::Live`] | every [`HEARTBEAT_MS`] | ends that peer's bookings whose ids it no longer lists (their `Done` was lost); a peer silent for [`SILENT_HEARTBEATS`] heartbeats has all its bookings ended ([`PeerClock`]) | Dynamo's router instances expire a silent peer's requests (etcd lease) |
//! | [`SyncMsg::Hello`] | a replica (re)connects to the bus | publishes again the `Routed` (and `FirstToken`) of every request it has in flight, so the newcomer books them (a duplicate books once), and sends it its recent placements ([`SyncMsg::Placed`]) | SMG's gossip pages whole trees to a joining router; this sends a bounded window |
//! | [`SyncMsg::Placed`] | a request committed (live transport: its `Routed` left at dispatch, without pages, since a failed attempt records nothing), or answering a `Hello` | records the page keys of each placement for its worker, books nothing | SMG's tree gossip (inserts) |
//!
//! What is never sent: the engine event index (every replica subscribes to every engine),
//! expiry and eviction (each replica bounds its own [`kvroute_index::PeerPages`]), prompts
//! (only chained page keys, [`PageKeys`]). Workers are named by URL, since ids are slots of
//! each replica's own registry.
//!
//! Nothing is queued without bound and nothing is counted twice: a `Routed` delivered twice
//! books once, a `Done` for a request never booked (a replica that joined late, a lost
//! `Routed`) does nothing, and a booking whose `Done` was lost ends when
//! [`crate::workers::Worker::expire_peers`] reaches it.

use crate::load::active::Booking;
use crate::policy::Router;
use crate::workers::Workers;
use serde::{Deserialize, Serialize};

/// Bytes per text page of replica sync's text page keys: 64 bytes ≈ 16 tokens at the
/// default 4 chars per token (`defaults::CHARS_PER_TOKEN`, ASCII text), the granularity of a
/// token page of 16 (vLLM's default block size). Every replica must use the same; a message
/// with another page size is refused ([`Applied::PageMismatch`]).
pub const TEXT_PAGE_BYTES: usize = 64;

/// How often a replica publishes its [`SyncMsg::Live`] heartbeat, ms. One second: the
/// poll interval of engine load reports (`defaults::LOAD_POLL_MS` order), so a lost end is
/// corrected as fast as a foreign-load report would be.
pub const HEARTBEAT_MS: u64 = 1_000;

/// Heartbeats a peer may miss before its bookings end: 3, NATS' own ping rule (a
/// connection is stale after `ping_interval` × `max_pings_out` = 2 unanswered pings).
pub const SILENT_HEARTBEATS: u64 = 3;

/// Most placements one replica keeps for [`SyncMsg::Placed`] answers, and sends per
/// `Hello`: the newest 4,096 (≈ one minute of a busy replica's conversation turns; each
/// holds at most the prompt's page keys).
pub const REPLAY_PLACEMENTS: usize = 4_096;

/// Placements per [`SyncMsg::Placed`] message (so one message stays far under NATS' 1 MiB
/// default `max_payload` even for 32k-token prompts: 64 × 2,048 keys × ≤ 21 bytes).
pub const PLACEMENTS_PER_MESSAGE: usize = 16;

/// What a page key stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PageUnit {
    /// A full block of `block` token ids ([`kvroute_index::keys::block_keys_in`]).
    Tokens {
        /// Tokens per block.
        block: u32,
    },
    /// A run of `bytes` bytes of the routing text ([`kvroute_index::keys::text_page_keys`]).
    Text {
        /// Bytes per page.
        bytes: u32,
    },
}

/// A prompt as replica sync knows it: the chained keys of its full pages, first first, in
/// the request's cache namespace (the chain's root), of one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageKeys {
    /// What each key stands for.
    pub unit: PageUnit,
    /// One key per full page.
    pub keys: Vec<u64>,
}

/// The load a peer books for a routed request ([`Booking`] without its block keys, which
/// travel once, as the page keys of a token prompt).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WireBooking {
    /// Prompt length, tokens.
    pub prompt_tokens: u64,
    /// Tokens the origin expects the worker to serve from its cache.
    pub cached_tokens: u64,
    /// The origin's predicted prefill time, ms.
    pub prefill_ms: f64,
}

/// One replica sync message (module doc's table). `origin` is the sending replica's random
/// id, `req` its own request counter; (`origin`, `req`) names a request everywhere.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SyncMsg {
    /// Request `req` of `origin` was committed to worker `worker` (URL) for `model`.
    Routed {
        /// Sending replica.
        origin: u64,
        /// Its request id.
        req: u64,
        /// The worker's URL.
        worker: String,
        /// Model (the peer's per-model indexes).
        model: String,
        /// Load to book.
        booking: WireBooking,
        /// The prompt's page keys (`None`: the request had neither text nor ids, or the
        /// origin's policy records nothing).
        pages: Option<PageKeys>,
    },
    /// Request `req`'s first token reached `origin`.
    FirstToken {
        /// Sending replica.
        origin: u64,
        /// Its request id.
        req: u64,
        /// The worker's URL.
        worker: String,
    },
    /// Request `req` ended.
    Done {
        /// Sending replica.
        origin: u64,
        /// Its request id.
        req: u64,
        /// The worker's URL.
        worker: String,
        /// The engine's `usage` when the origin saw one: prompt tokens.
        prompt_tokens: Option<u64>,
        /// The engine's `usage`: prompt tokens served from its cache.
        cached_tokens: Option<u64>,
    },
    /// `origin`'s heartbeat: the ids of every request it has booked and not ended, sorted.
    Live {
        /// Sending replica.
        origin: u64,
        /// Its requests in flight, ascending.
        reqs: Vec<u64>,
    },
    /// `origin` (re)connected: peers answer with their live requests and recent placements.
    Hello {
        /// Sending replica.
        origin: u64,
    },
    /// Placements of `origin`: one request's as it commits (`to` = `None`: for every
    /// peer), or its recent ones for replica `to` (a `Hello`'s sender).
    Placed {
        /// Sending replica.
        origin: u64,
        /// The replica that asked, or `None` for all.
        to: Option<u64>,
        /// Newest last.
        placements: Vec<Placement>,
    },
}

/// A past routing decision's placement: `pages` went to `worker` for `model`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// The worker's URL.
    pub worker: String,
    /// Model.
    pub model: String,
    /// The prompt's page keys.
    pub pages: PageKeys,
}

impl SyncMsg {
    /// The sending replica.
    pub fn origin(&self) -> u64 {
        match self {
            SyncMsg::Routed { origin, .. }
            | SyncMsg::FirstToken { origin, .. }
            | SyncMsg::Done { origin, .. }
            | SyncMsg::Live { origin, .. }
            | SyncMsg::Hello { origin }
            | SyncMsg::Placed { origin, .. } => *origin,
        }
    }

    /// `routed`, `first_token`, `done`, `live`, `hello`, `placed` (metric label).
    pub fn kind(&self) -> &'static str {
        match self {
            SyncMsg::Routed { .. } => "routed",
            SyncMsg::FirstToken { .. } => "first_token",
            SyncMsg::Done { .. } => "done",
            SyncMsg::Live { .. } => "live",
            SyncMsg::Hello { .. } => "hello",
            SyncMsg::Placed { .. } => "placed",
        }
    }
}

/// When each peer replica was last heard from, on this replica's clock (ms); finds the
/// silent ones ([`SILENT_HEARTBEATS`]).
#[derive(Debug, Default)]
pub struct PeerClock {
    heard: std::collections::HashMap<u64, f64>,
}

impl PeerClock {
    /// A message of `origin` arrived at `now_ms`.
    pub fn heard(&mut self, origin: u64, now_ms: f64) {
        self.heard.insert(origin, now_ms);
    }

    /// Peers heard from within the silence limit of `now_ms`.
    pub fn peers(&self) -> usize {
        self.heard.len()
    }

    /// Forgets and returns the peers not heard from for more than
    /// [`SILENT_HEARTBEATS`] × [`HEARTBEAT_MS`] before `now_ms`, ascending.
    pub fn take_silent(&mut self, now_ms: f64) -> Vec<u64> {
        let limit = (SILENT_HEARTBEATS * HEARTBEAT_MS) as f64;
        let mut silent: Vec<u64> = self
            .heard
            .iter()
            .filter(|&(_, &at)| now_ms - at > limit)
            .map(|(&o, _)| o)
            .collect();
        silent.sort_unstable();
        for o in &silent {
            self.heard.remove(o);
        }
        silent
    }
}

/// Ends every booking of peer `origin` on every worker (it went silent or left); returns how
/// many ended.
pub fn forget_peer(workers: &Workers, origin: u64) -> usize {
    workers
        .iter()
        .iter()
        .map(|w| w.retain_peers(origin, |_| false))
        .sum()
}

/// What [`apply`] did with a message (metric label [`Applied::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Booked (and its pages recorded), or its prefill or booking ended.
    Done,
    /// This replica's own message (a bus echoes a publisher's messages): ignored.
    Own,
    /// No worker with that URL here: ignored.
    UnknownWorker,
    /// A `Routed` already booked, or a `FirstToken` / `Done` for a request not booked here
    /// (joined late, booking expired, or delivered twice): ignored.
    NotBooked,
    /// Booked, but its pages' unit is not this replica's (another block size or text page
    /// size): pages ignored.
    PageMismatch,
    /// A `Placed` answer to another replica's `Hello`: ignored.
    Elsewhere,
}

impl Applied {
    /// `done`, `own`, `unknown_worker`, `not_booked`, `page_mismatch`, `elsewhere`.
    pub fn as_str(self) -> &'static str {
        match self {
            Applied::Elsewhere => "elsewhere",
            Applied::Done => "done",
            Applied::Own => "own",
            Applied::UnknownWorker => "unknown_worker",
            Applied::NotBooked => "not_booked",
            Applied::PageMismatch => "page_mismatch",
        }
    }
}

impl From<&Booking> for WireBooking {
    fn from(b: &Booking) -> Self {
        WireBooking {
            prompt_tokens: b.prompt_tokens,
            cached_tokens: b.cached_tokens,
            prefill_ms: b.prefill_ms,
        }
    }
}

/// The `Routed` message of a request `req` of replica `origin` committed to `worker_url`:
/// its booking, and its page keys when `router` records placements ([`Router::page_keys`]).
pub fn routed(
    router: &Router,
    origin: u64,
    req: u64,
    worker_url: &str,
    key: &crate::route_key::RouteKey,
    booking: WireBooking,
) -> SyncMsg {
    SyncMsg::Routed {
        origin,
        req,
        worker: worker_url.to_string(),
        model: key.model.clone(),
        booking,
        pages: router.page_keys(key),
    }
}

/// Applies peer `origin`'s heartbeat listing `reqs` (ascending): ends its bookings here that
/// it no longer lists. Returns how many ended.
pub fn apply_live(workers: &Workers, origin: u64, reqs: &[u64]) -> usize {
    workers
        .iter()
        .iter()
        .map(|w| w.retain_peers(origin, |r| reqs.binary_search(&r).is_ok()))
        .sum()
}

/// Applies a peer's message at `now_ms` (this replica's clock: the router's time base, as
/// its snapshots use) to this replica's `workers` and `router`; `me` is this replica's own
/// origin id.
pub fn apply(msg: &SyncMsg, me: u64, router: &Router, workers: &Workers, now_ms: f64) -> Applied {
    if msg.origin() == me {
        return Applied::Own;
    }
    match msg {
        SyncMsg::Routed {
            origin,
            req,
            worker,
            model,
            booking,
            pages,
        } => {
            let Some(w) = workers.find_url(worker) else {
                return Applied::UnknownWorker;
            };
            let block = router.block_size();
            let (block_keys, unkeyed_blocks) = match pages {
                Some(PageKeys {
                    unit: PageUnit::Tokens { block: b },
                    keys,
                }) if *b as usize == block => (keys[..].into(), 0),
                _ => (
                    crate::ids::BlockKeySeq::default(),
                    booking.prompt_tokens / block as u64,
                ),
            };
            let b = Booking {
                prompt_tokens: booking.prompt_tokens,
                cached_tokens: booking.cached_tokens,
                prefill_ms: booking.prefill_ms,
                block_keys,
                unkeyed_blocks,
            };
            if !w.book_peer(*origin, *req, b, now_ms) {
                return Applied::NotBooked;
            }
            match pages {
                Some(p) if !router.record_peer(model, p, w.id, now_ms as u64) => {
                    Applied::PageMismatch
                }
                _ => Applied::Done,
            }
        }
        SyncMsg::FirstToken {
            origin,
            req,
            worker,
        } => match workers.find_url(worker) {
            None => Applied::UnknownWorker,
            Some(w) if w.peer_first_token(*origin, *req, now_ms) => Applied::Done,
            Some(_) => Applied::NotBooked,
        },
        SyncMsg::Done {
            origin,
            req,
            worker,
            prompt_tokens,
            cached_tokens,
        } => match workers.find_url(worker) {
            None => Applied::UnknownWorker,
            Some(w) if w.peer_done(*origin, *req, prompt_tokens.zip(*cached_tokens)) => {
                Applied::Done
            }
            Some(_) => Applied::NotBooked,
        },
        SyncMsg::Live { origin, reqs } => {
            apply_live(workers, *origin, reqs);
            Applied::Done
        }
        // Answered by the transport (it holds the live requests and placements).
        SyncMsg::Hello { .. } => Applied::Done,
        SyncMsg::Placed { to: Some(to), .. } if *to != me => Applied::Elsewhere,
        SyncMsg::Placed { placements, .. } => {
            let mut applied = Applied::Done;
            for p in placements {
                match workers.find_url(&p.worker) {
                    Some(w) if !router.record_peer(&p.model, &p.pages, w.id, now_ms as u64) => {
                        applied = Applied::PageMismatch
                    }
                    Some(_) => {}
                    None => applied = Applied::UnknownWorker,
                }
            }
            applied
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, PolicyKind};
    use crate::policy::{Snapshot, WorkerLoad};
    use crate::route_key::RouteKey;
    use rand::SeedableRng;

    fn setup() -> (Router, Workers) {
        let cfg = Config {
            policy: PolicyKind::CacheAware,
            ..Config::default()
        };
        let workers = Workers::new(&["http://a:1".into(), "http://b:2".into()]).unwrap();
        (Router::new(&cfg), workers)
    }

    fn text_key(text: &str) -> RouteKey {
        RouteKey {
            model: "m".into(),
            text: text.into(),
            ..RouteKey::default()
        }
    }

    /// Workers 0 and 1's overlaps with `key` (idle loads, both eligible).
    fn overlaps(router: &Router, key: &RouteKey) -> (usize, usize) {
        let loads = vec![WorkerLoad::default(); 2];
        let snap = Snapshot {
            workers: &loads,
            ids: &[],
            eligible: &[0, 1],
            seq: 0,
            now_ms: 1,
            live: None,
        };
        let o = router.overlaps(&snap, &router.request(key));
        (o.of(0), o.of(1))
    }

    fn booking(prompt_tokens: u64) -> WireBooking {
        WireBooking {
            prompt_tokens,
            cached_tokens: 0,
            prefill_ms: 40.0,
        }
    }

    /// Worked example: peer 7 routed a 200-byte text prompt to worker b. Here, worker b's
    /// overlap with that prompt grown by a turn is its first 3 whole 64-byte pages (192
    /// chars), a's is 0, and cache_aware (match ratio 192 / 230 above its 0.3 threshold)
    /// sends the turn to b. b counts one peer request until the Done, and only once.
    #[test]
    fn a_peer_placement_routes_the_next_turn_and_its_load_counts_once() {
        let (router, workers) = setup();
        let (me, peer) = (1, 7);
        let turn1 = format!("<|user|>{}", "x".repeat(192));
        let msg = routed(
            &router,
            peer,
            42,
            "http://b:2",
            &text_key(&turn1),
            booking(50),
        );
        assert_eq!(apply(&msg, me, &router, &workers, 10.0), Applied::Done);
        assert_eq!(apply(&msg, me, &router, &workers, 11.0), Applied::NotBooked);
        router.flush();
        let b = workers.get(1).unwrap();
        assert_eq!((b.peer_requests(), b.load()), (1, 1));
        assert_eq!(b.load_view(12.0).active.prefill_requests, 1);

        let turn2 = format!("{turn1}<|assistant|>ok<|user|>{}", "y".repeat(10));
        let key = text_key(&turn2);
        let loads = vec![WorkerLoad::default(); 2];
        let snap = Snapshot {
            workers: &loads,
            ids: &[],
            eligible: &[0, 1],
            seq: 0,
            now_ms: 20,
            live: None,
        };
        let req = router.request(&key);
        let o = router.overlaps(&snap, &req);
        assert_eq!((o.of(0), o.of(1), o.len), (0, 192, turn2.chars().count()));
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(router.decide_request(&snap, &req, &mut rng).worker, 1);

        let first = SyncMsg::FirstToken {
            origin: peer,
            req: 42,
            worker: "http://b:2".into(),
        };
        assert_eq!(apply(&first, me, &router, &workers, 30.0), Applied::Done);
        assert_eq!(b.load_view(31.0).active.prefill_requests, 0);
        let done = SyncMsg::Done {
            origin: peer,
            req: 42,
            worker: "http://b:2".into(),
            prompt_tokens: Some(50),
            cached_tokens: Some(0),
        };
        assert_eq!(apply(&done, me, &router, &workers, 40.0), Applied::Done);
        assert_eq!(
            apply(&done, me, &router, &workers, 41.0),
            Applied::NotBooked
        );
        assert_eq!((b.peer_requests(), b.load()), (0, 0));
        b.active_check().unwrap();
    }

    /// A replica's own messages (echoed by the bus), unknown workers, unknown requests and
    /// another page size change nothing but the count.
    #[test]
    fn what_a_replica_ignores() {
        let (router, workers) = setup();
        let key = text_key(&"z".repeat(128));
        let own = routed(&router, 1, 1, "http://a:1", &key, booking(32));
        assert_eq!(apply(&own, 1, &router, &workers, 0.0), Applied::Own);
        let unknown = routed(&router, 2, 1, "http://c:3", &key, booking(32));
        assert_eq!(
            apply(&unknown, 1, &router, &workers, 0.0),
            Applied::UnknownWorker
        );
        let late = SyncMsg::Done {
            origin: 2,
            req: 99,
            worker: "http://a:1".into(),
            prompt_tokens: None,
            cached_tokens: None,
        };
        assert_eq!(apply(&late, 1, &router, &workers, 0.0), Applied::NotBooked);
        let mut odd = routed(&router, 2, 2, "http://a:1", &key, booking(32));
        if let SyncMsg::Routed { pages: Some(p), .. } = &mut odd {
            p.unit = PageUnit::Text { bytes: 32 };
        }
        assert_eq!(
            apply(&odd, 1, &router, &workers, 0.0),
            Applied::PageMismatch
        );
        router.flush();
        // Booked all the same; its pages were not recorded.
        assert_eq!(workers.get(0).unwrap().peer_requests(), 1);
        assert_eq!(overlaps(&router, &key).0, 0);
        assert_eq!(workers.get(1).unwrap().peer_requests(), 0);
    }

    /// A booking whose end was lost ends at `expire_peers`, as do a departed peer's.
    #[test]
    fn lost_ends_expire() {
        let (router, workers) = setup();
        let key = text_key("short");
        for (origin, req, at) in [(2, 1, 0.0), (2, 2, 100.0), (3, 1, 100.0)] {
            let m = routed(&router, origin, req, "http://a:1", &key, booking(8));
            assert_eq!(apply(&m, 1, &router, &workers, at), Applied::Done);
        }
        let a = workers.get(0).unwrap();
        assert_eq!(a.expire_peers(50.0, None), 1);
        assert_eq!(a.expire_peers(50.0, Some(3)), 1);
        assert_eq!(a.peer_requests(), 1);
        a.active_check().unwrap();
    }

    /// A heartbeat ends exactly the bookings its sender no longer lists, once; a silent peer
    /// loses all of its own and no one else's.
    #[test]
    fn heartbeats_end_lost_bookings_and_silence_ends_a_peer() {
        let (router, workers) = setup();
        let key = text_key("hb");
        for (origin, req, url) in [
            (2, 1, "http://a:1"),
            (2, 2, "http://b:2"),
            (2, 3, "http://a:1"),
            (3, 1, "http://a:1"),
        ] {
            let m = routed(&router, origin, req, url, &key, booking(8));
            assert_eq!(apply(&m, 1, &router, &workers, 0.0), Applied::Done);
        }
        let (a, b) = (workers.get(0).unwrap(), workers.get(1).unwrap());
        // Peer 2 still runs request 2 only: 1 and 3 (on a) end; 3's request 1 stays.
        assert_eq!(apply_live(&workers, 2, &[2]), 2);
        assert_eq!((a.peer_requests(), b.peer_requests()), (1, 1));
        assert_eq!(apply_live(&workers, 2, &[2]), 0);
        let mut clock = PeerClock::default();
        clock.heard(2, 0.0);
        clock.heard(3, 2_500.0);
        let limit = (SILENT_HEARTBEATS * HEARTBEAT_MS) as f64;
        assert_eq!(clock.take_silent(limit), Vec::<u64>::new());
        assert_eq!(clock.take_silent(limit + 1.0), vec![2]);
        assert_eq!(clock.peers(), 1);
        assert_eq!(forget_peer(&workers, 2), 1);
        assert_eq!((a.peer_requests(), b.peer_requests()), (1, 0));
        // A Done after the heartbeat ended the booking finds nothing (counted once).
        let done = SyncMsg::Done {
            origin: 2,
            req: 1,
            worker: "http://a:1".into(),
            prompt_tokens: None,
            cached_tokens: None,
        };
        assert_eq!(apply(&done, 1, &router, &workers, 1.0), Applied::NotBooked);
        a.active_check().unwrap();
        b.active_check().unwrap();
    }

    /// A `Placed` answer records its placements for the replica that asked, books nothing,
    /// and is ignored by the others; a broadcast one is recorded by all.
    #[test]
    fn placed_answers_record_pages_for_the_asker_only() {
        let (router, workers) = setup();
        let text = "p".repeat(256);
        let pages = router.page_keys(&text_key(&text)).expect("text pages");
        assert_eq!(pages.keys.len(), 256 / TEXT_PAGE_BYTES);
        let mut msg = SyncMsg::Placed {
            origin: 4,
            to: Some(1),
            placements: vec![Placement {
                worker: "http://b:2".into(),
                model: "m".into(),
                pages,
            }],
        };
        assert_eq!(apply(&msg, 9, &router, &workers, 0.0), Applied::Elsewhere);
        assert_eq!(apply(&msg, 1, &router, &workers, 0.0), Applied::Done);
        // Broadcast (a commit's placement): every peer records it.
        if let SyncMsg::Placed { to, .. } = &mut msg {
            *to = None;
        }
        assert_eq!(apply(&msg, 9, &router, &workers, 0.0), Applied::Done);
        router.flush();
        assert_eq!(workers.get(1).unwrap().peer_requests(), 0);
        assert_eq!(
            overlaps(&router, &text_key(&format!("{text}more"))),
            (0, 256)
        );
    }

    /// The wire form is JSON with a `type` tag (what `--nats` publishes), and round-trips.
    #[test]
    fn messages_round_trip_through_json() {
        let (router, _) = setup();
        let m = routed(
            &router,
            5,
            6,
            "http://a:1",
            &text_key(&"q".repeat(70)),
            booking(18),
        );
        let json = serde_json::to_string(&m).unwrap();
        assert!(
            json.starts_with(r#"{"type":"routed","origin":5,"req":6,"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<SyncMsg>(&json).unwrap(), m);
    }
}
