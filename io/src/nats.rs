//! Replica sync over NATS (`--nats`, issue 16): the transport of [`kvroute_core::sync`]. Each
//! replica publishes what its peers need to count its requests and find its placements, and
//! applies theirs; every message goes on one subject, `PREFIX.sync`, so NATS keeps each
//! publisher's messages in order for every subscriber.
//!
//! Two sides:
//! - The shards hold a [`SyncLink`]. When an attempt is sent to a worker they call
//!   [`SyncLink::dispatched`], which queues its `Routed` and returns the observer that the
//!   attempt's [`kvroute_core::workers::LoadGuard`] tells of its first token and its end
//!   (`FirstToken`, `Done`); when it commits, [`SyncLink::committed`] queues its placement
//!   (`Placed`, the prompt's page keys). Peers thus count it from dispatch, as its own
//!   router does, and record its pages only for a worker that answered. Queueing is a `try_send` on a bounded channel
//!   ([`defaults::SYNC_QUEUE`]): a shard never waits on NATS.
//! - The `kv-nats` thread (a current-thread Tokio runtime for async-nats) publishes the
//!   queue, applies what peers send ([`sync::apply`]), and every [`sync::HEARTBEAT_MS`]
//!   publishes its `Live` heartbeat and ends the bookings of peers gone silent.
//!
//! # Invariants
//! 1. Nothing waits without bound and nothing queues without bound: the shard side drops on
//!    a full queue, the thread drops while NATS is disconnected; both are counted
//!    (`kvroute_sync_dropped_total{reason}`), and routing goes on with local state.
//! 2. A peer's booking ends exactly once: by its `Done`, or by a heartbeat that no longer
//!    lists it, or when the peer goes silent ([`sync::PeerClock`]); a second end finds
//!    nothing ([`kvroute_core::workers::Worker::peer_done`] returns false).
//! 3. After a reconnect the state converges without replaying history: the replica sends
//!    `Hello`, re-publishes the `Routed` of every request it has in flight (peers book the
//!    ones they missed; a duplicate books once), and each peer answers `Hello` the same way
//!    plus its newest [`sync::REPLAY_PLACEMENTS`] placements (`Placed`), so a replica that
//!    joins late finds the holders of recent conversations.
//! 4. The thread ends once the gateway's state is gone (it holds only a `Weak`) or its queue
//!    closes.

use crate::state::Shared;
use kvroute_core::config::defaults;
use kvroute_core::route_key::RouteKey;
use kvroute_core::sync::{self, Placement, SyncMsg, WireBooking};
use kvroute_core::workers::LoadObserver;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::mpsc;

/// A request this replica has in flight, as peers must learn of it again after a reconnect.
#[derive(Debug, Clone)]
struct LiveReq {
    worker: String,
    model: String,
    booking: WireBooking,
    /// Its first token was seen.
    first: bool,
}

/// The shard side of replica sync: this replica's id, its request counter, the queue to the
/// `kv-nats` thread and the requests in flight.
#[derive(Debug)]
pub struct SyncLink {
    origin: u64,
    next_req: AtomicU64,
    tx: mpsc::Sender<SyncMsg>,
    /// Requests routed and not ended, by request id (one short lock per message; taken
    /// only with `--nats`).
    live: Mutex<HashMap<u64, LiveReq>>,
    /// Messages the shards could not queue (the queue was full), not yet counted in metrics.
    queue_full: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SyncLink {
    /// A link with a random replica id, and the receiving end of its queue
    /// ([`defaults::SYNC_QUEUE`] messages) for [`start`].
    pub fn new() -> (Arc<SyncLink>, mpsc::Receiver<SyncMsg>) {
        let (tx, rx) = mpsc::channel(defaults::SYNC_QUEUE);
        let link = SyncLink {
            origin: rand::random(),
            next_req: AtomicU64::new(0),
            tx,
            live: Mutex::new(HashMap::new()),
            queue_full: AtomicU64::new(0),
        };
        (Arc::new(link), rx)
    }

    /// This replica's id on the bus.
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// Requests this replica has routed and not ended (its heartbeat's list).
    pub fn in_flight(&self) -> usize {
        lock(&self.live).len()
    }

    /// Queues `msg`; counts it when the queue is full or closed.
    fn send(&self, msg: SyncMsg) {
        if self.tx.try_send(msg).is_err() {
            self.queue_full.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request for `model` was sent to `worker_url` with `booking` (an attempt: counted
    /// from dispatch, as this router counts its own, bug-cases B1): queues its `Routed`
    /// (without pages) and returns the observer for its load guard
    /// ([`kvroute_core::workers::LoadGuard::observe`]), which sends its `FirstToken` and
    /// `Done`. A failed attempt ends like any other request: its guard drops.
    pub fn dispatched(
        self: &Arc<Self>,
        model: &str,
        worker_url: &str,
        booking: WireBooking,
    ) -> Box<dyn LoadObserver> {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        lock(&self.live).insert(
            req,
            LiveReq {
                worker: worker_url.to_string(),
                model: model.to_string(),
                booking,
                first: false,
            },
        );
        self.send(SyncMsg::Routed {
            origin: self.origin,
            req,
            worker: worker_url.to_string(),
            model: model.to_string(),
            booking,
            pages: None,
        });
        Box::new(Ticket {
            link: Arc::clone(self),
            req,
            worker: worker_url.to_string(),
        })
    }

    /// The request routed with `key` committed to `worker_url` (its first bytes arrived):
    /// queues its placement for every peer when `router` records placements
    /// ([`kvroute_core::policy::Router::page_keys`]), as this router records its own only now.
    pub fn committed(
        &self,
        router: &kvroute_core::policy::Router,
        key: &RouteKey,
        worker_url: &str,
    ) {
        if let Some(pages) = router.page_keys(key) {
            self.send(SyncMsg::Placed {
                origin: self.origin,
                to: None,
                placements: vec![Placement {
                    worker: worker_url.to_string(),
                    model: key.model.clone(),
                    pages,
                }],
            });
        }
    }

    /// The `Routed` (without pages) and, past their first token, `FirstToken` of every
    /// request in flight, by request id.
    fn live_messages(&self) -> Vec<SyncMsg> {
        let live = lock(&self.live);
        let mut reqs: Vec<_> = live.iter().collect();
        reqs.sort_unstable_by_key(|(req, _)| **req);
        let mut out = Vec::with_capacity(reqs.len() * 2);
        for (&req, r) in reqs {
            out.push(SyncMsg::Routed {
                origin: self.origin,
                req,
                worker: r.worker.clone(),
                model: r.model.clone(),
                booking: r.booking,
                pages: None,
            });
            if r.first {
                out.push(SyncMsg::FirstToken {
                    origin: self.origin,
                    req,
                    worker: r.worker.clone(),
                });
            }
        }
        out
    }

    /// This replica's heartbeat ([`SyncMsg::Live`]).
    fn heartbeat(&self) -> SyncMsg {
        let mut reqs: Vec<u64> = lock(&self.live).keys().copied().collect();
        reqs.sort_unstable();
        SyncMsg::Live {
            origin: self.origin,
            reqs,
        }
    }
}

/// One routed request's observer: sends its first token and end.
#[derive(Debug)]
struct Ticket {
    link: Arc<SyncLink>,
    req: u64,
    worker: String,
}

impl LoadObserver for Ticket {
    fn first_token(&self) {
        if let Some(r) = lock(&self.link.live).get_mut(&self.req) {
            r.first = true;
        }
        self.link.send(SyncMsg::FirstToken {
            origin: self.link.origin,
            req: self.req,
            worker: self.worker.clone(),
        });
    }

    fn done(&self, usage: Option<(u64, u64)>) {
        lock(&self.link.live).remove(&self.req);
        self.link.send(SyncMsg::Done {
            origin: self.link.origin,
            req: self.req,
            worker: self.worker.clone(),
            prompt_tokens: usage.map(|u| u.0),
            cached_tokens: usage.map(|u| u.1),
        });
    }
}

/// The subject every replica of a fleet publishes on and subscribes to: `PREFIX.sync`.
pub fn subject(prefix: &str) -> String {
    format!("{prefix}.sync")
}

/// Starts the `kv-nats` thread for `shared`'s link, publishing `rx` and subscribing on
/// [`subject`]`(prefix)` at the NATS server(s) `url`. Connecting is retried forever in the
/// background (async-nats' backoff, 0 ms then doubling to 4 s): a router starts and routes
/// while NATS is still down.
///
/// # Errors
/// The thread or its runtime cannot be created.
pub fn start(
    shared: &Arc<Shared>,
    link: Arc<SyncLink>,
    rx: mpsc::Receiver<SyncMsg>,
    url: &str,
    prefix: &str,
) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let weak = Arc::downgrade(shared);
    let (url, subject) = (url.to_string(), subject(prefix));
    std::thread::Builder::new()
        .name("kv-nats".into())
        .spawn(move || rt.block_on(run(weak, link, rx, url, subject)))?;
    Ok(())
}

/// The `kv-nats` thread's loop (module doc).
async fn run(
    weak: Weak<Shared>,
    link: Arc<SyncLink>,
    mut rx: mpsc::Receiver<SyncMsg>,
    url: String,
    subject: String,
) {
    use futures_util::StreamExt;
    let (ev_tx, mut ev_rx) = mpsc::channel::<async_nats::Event>(64);
    let opts = async_nats::ConnectOptions::new()
        .name(format!("kvroute-{:016x}", link.origin))
        .retry_on_initial_connect()
        .max_reconnects(None)
        // The bus does not echo our own messages back ([`sync::Applied::Own`] if it did).
        .no_echo()
        .event_callback(move |e| {
            let tx = ev_tx.clone();
            async move {
                let _ = tx.try_send(e);
            }
        });
    let client = match opts.connect(url.as_str()).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(url, error = %e, "replica sync: bad NATS address; sync is off");
            return;
        }
    };
    let mut sub = match client.subscribe(subject.clone()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(subject, error = %e, "replica sync: cannot subscribe; sync is off");
            return;
        }
    };
    let bus = Bus {
        client,
        subject: subject.into(),
        me: link.origin,
    };
    let mut clock = sync::PeerClock::default();
    let mut placements: VecDeque<Placement> = VecDeque::with_capacity(sync::REPLAY_PLACEMENTS);
    let mut tick = tokio::time::interval(Duration::from_millis(sync::HEARTBEAT_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut connected = false;
    loop {
        tokio::select! {
            msg = rx.recv() => {
                let (Some(msg), Some(shared)) = (msg, weak.upgrade()) else { break };
                if let SyncMsg::Placed { to: None, placements: p, .. } = &msg {
                    for p in p {
                        if placements.len() == sync::REPLAY_PLACEMENTS {
                            placements.pop_front();
                        }
                        placements.push_back(p.clone());
                    }
                }
                bus.publish(&shared, &msg).await;
            }
            m = sub.next() => {
                let (Some(m), Some(shared)) = (m, weak.upgrade()) else { break };
                let Ok(msg) = serde_json::from_slice::<SyncMsg>(&m.payload) else {
                    shared.metrics.on_sync_received("unknown", "bad_message");
                    tracing::debug!(bytes = m.payload.len(), "replica sync: bad message dropped");
                    continue;
                };
                let now = shared.now_ms() as f64;
                if msg.origin() != bus.me {
                    clock.heard(msg.origin(), now);
                }
                let applied = match &msg {
                    SyncMsg::Live { origin, reqs } if *origin != bus.me => {
                        let ended = sync::apply_live(&shared.workers, *origin, reqs);
                        shared.metrics.on_sync_peer_expired(ended);
                        sync::Applied::Done
                    }
                    _ => sync::apply(&msg, bus.me, &shared.router, &shared.workers, now),
                };
                shared.metrics.on_sync_received(msg.kind(), applied.as_str());
                if let SyncMsg::Hello { origin } = msg
                    && origin != bus.me
                {
                    bus.answer_hello(&shared, &link, origin, &placements).await;
                }
            }
            e = ev_rx.recv() => {
                let (Some(e), Some(shared)) = (e, weak.upgrade()) else { break };
                match e {
                    async_nats::Event::Connected => {
                        tracing::info!("replica sync: connected to NATS");
                        connected = true;
                        shared.metrics.set_sync_state(true, clock.peers());
                        bus.publish(&shared, &SyncMsg::Hello { origin: bus.me }).await;
                        for m in link.live_messages() {
                            bus.publish(&shared, &m).await;
                        }
                    }
                    async_nats::Event::Disconnected | async_nats::Event::Closed => {
                        tracing::warn!("replica sync: NATS disconnected; routing on local state");
                        connected = false;
                        shared.metrics.set_sync_state(false, clock.peers());
                    }
                    other => tracing::debug!(event = %other, "replica sync: NATS event"),
                }
            }
            _ = tick.tick() => {
                let Some(shared) = weak.upgrade() else { break };
                let full = link.queue_full.swap(0, Ordering::Relaxed);
                if full > 0 {
                    shared.metrics.on_sync_dropped("queue_full", full);
                }
                // A heartbeat is state, not news: while disconnected there is nothing to send.
                if connected {
                    bus.publish(&shared, &link.heartbeat()).await;
                }
                for origin in clock.take_silent(shared.now_ms() as f64) {
                    let ended = sync::forget_peer(&shared.workers, origin);
                    tracing::info!(peer = origin, ended, "replica sync: peer went silent");
                    shared.metrics.on_sync_peer_expired(ended);
                }
                shared.metrics.set_sync_state(connected, clock.peers());
            }
        }
    }
}

/// The NATS client and this replica's subject and id.
struct Bus {
    client: async_nats::Client,
    subject: async_nats::Subject,
    me: u64,
}

impl Bus {
    /// Publishes `msg` as JSON, or counts why not (NATS down: dropped, invariant 1).
    async fn publish(&self, shared: &Shared, msg: &SyncMsg) {
        if self.client.connection_state() != async_nats::connection::State::Connected {
            shared.metrics.on_sync_dropped("disconnected", 1);
            return;
        }
        let body = match serde_json::to_vec(msg) {
            Ok(b) => b,
            Err(_) => return shared.metrics.on_sync_dropped("publish_error", 1),
        };
        match self.client.publish(self.subject.clone(), body.into()).await {
            Ok(()) => shared.metrics.on_sync_sent(msg.kind()),
            Err(e) => {
                tracing::debug!(error = %e, "replica sync: publish failed");
                shared.metrics.on_sync_dropped("publish_error", 1);
            }
        }
    }

    /// Answers peer `to`'s `Hello` (invariant 3): this replica's requests in flight, then
    /// its recent placements in [`sync::PLACEMENTS_PER_MESSAGE`] chunks.
    async fn answer_hello(
        &self,
        shared: &Shared,
        link: &SyncLink,
        to: u64,
        placements: &VecDeque<Placement>,
    ) {
        for m in link.live_messages() {
            self.publish(shared, &m).await;
        }
        let all: Vec<Placement> = placements.iter().cloned().collect();
        for chunk in all.chunks(sync::PLACEMENTS_PER_MESSAGE) {
            let msg = SyncMsg::Placed {
                origin: self.me,
                to: Some(to),
                placements: chunk.to_vec(),
            };
            self.publish(shared, &msg).await;
        }
    }
}
