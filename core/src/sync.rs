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
}

impl SyncMsg {
    /// The sending replica.
    pub fn origin(&self) -> u64 {
        match self {
            SyncMsg::Routed { origin, .. }
            | SyncMsg::FirstToken { origin, .. }
            | SyncMsg::Done { origin, .. } => *origin,
        }
    }
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
}

impl Applied {
    /// `done`, `own`, `unknown_worker`, `not_booked`, `page_mismatch`.
    pub fn as_str(self) -> &'static str {
        match self {
            Applied::Done => "done",
            Applied::Own => "own",
            Applied::UnknownWorker => "unknown_worker",
            Applied::NotBooked => "not_booked",
            Applied::PageMismatch => "page_mismatch",
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
    booking: &Booking,
) -> SyncMsg {
    SyncMsg::Routed {
        origin,
        req,
        worker: worker_url.to_string(),
        model: key.model.clone(),
        booking: WireBooking {
            prompt_tokens: booking.prompt_tokens,
            cached_tokens: booking.cached_tokens,
            prefill_ms: booking.prefill_ms,
        },
        pages: router.page_keys(key),
    }
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
                }) if *b as usize == block => (keys.clone(), 0),
                _ => (Vec::new(), booking.prompt_tokens / block as u64),
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

    fn booking(prompt_tokens: u64) -> Booking {
        Booking {
            prompt_tokens,
            cached_tokens: 0,
            prefill_ms: 40.0,
            block_keys: Vec::new(),
            unkeyed_blocks: 0,
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
            &booking(50),
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
            eligible: &[0, 1],
            seq: 0,
            now_ms: 20,
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
        let own = routed(&router, 1, 1, "http://a:1", &key, &booking(32));
        assert_eq!(apply(&own, 1, &router, &workers, 0.0), Applied::Own);
        let unknown = routed(&router, 2, 1, "http://c:3", &key, &booking(32));
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
        let mut odd = routed(&router, 2, 2, "http://a:1", &key, &booking(32));
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
        let loads = vec![WorkerLoad::default(); 2];
        let snap = Snapshot {
            workers: &loads,
            eligible: &[0, 1],
            seq: 0,
            now_ms: 1,
        };
        assert_eq!(router.overlaps(&snap, &router.request(&key)).of(0), 0);
        assert_eq!(workers.get(1).unwrap().peer_requests(), 0);
    }

    /// A booking whose end was lost ends at `expire_peers`, as do a departed peer's.
    #[test]
    fn lost_ends_expire() {
        let (router, workers) = setup();
        let key = text_key("short");
        for (origin, req, at) in [(2, 1, 0.0), (2, 2, 100.0), (3, 1, 100.0)] {
            let m = routed(&router, origin, req, "http://a:1", &key, &booking(8));
            assert_eq!(apply(&m, 1, &router, &workers, at), Applied::Done);
        }
        let a = workers.get(0).unwrap();
        assert_eq!(a.expire_peers(50.0, None), 1);
        assert_eq!(a.expire_peers(50.0, Some(3)), 1);
        assert_eq!(a.peer_requests(), 1);
        a.active_check().unwrap();
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
            &booking(18),
        );
        let json = serde_json::to_string(&m).unwrap();
        assert!(
            json.starts_with(r#"{"type":"routed","origin":5,"req":6,"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<SyncMsg>(&json).unwrap(), m);
    }
}
