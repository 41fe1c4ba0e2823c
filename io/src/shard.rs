//! Thread-per-core shards: one monoio runtime per thread, pinned to a core, each with its own
//! `SO_REUSEPORT` listener, so the kernel spreads connections over shards and a connection
//! lives on one shard for its whole life.
//!
//! Shards share only [`Shared`] (config, worker registry with atomic in-flight counts, the
//! router's indexes, metrics, the tokenizers as loaded). Each shard owns its upstream [`Pool`]
//! and its [`ShardTokenizers`] (own copies of the tokenizers and an incremental-tokenization
//! prefix cache), made on the shard's thread.

use crate::exchange;
use crate::upstream::{Pool, Target};
use kvroute_core::metrics::Metrics;
use kvroute_core::policy::Router;
use kvroute_core::route_key::RouteKey;
use kvroute_core::tokens::{ShardTokenizers, Tokenizers};
use kvroute_core::workers::Workers;
use std::cell::RefCell;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Network settings of `kvroute serve`, validated (durations, not raw numbers).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Address to listen on; port 0 picks a free port (tests).
    pub listen: String,
    /// Shard threads; each is pinned to one of the cores the process may use.
    pub shards: usize,
    /// Largest request body, in bytes (413 above).
    pub max_body_bytes: usize,
    /// Largest request head, in bytes (431 above).
    pub max_head_bytes: usize,
    /// Time allowed for a whole exchange with a worker (504 when no head arrives in time).
    pub request_timeout: Duration,
    /// Idle upstream connections older than this are closed, not reused.
    pub upstream_idle_timeout: Duration,
    /// Time allowed to connect to a worker (502 after).
    pub connect_timeout: Duration,
    /// Force the epoll (legacy) driver even where io_uring works.
    pub force_epoll: bool,
}

/// State shared by all shards.
pub struct Shared {
    /// Network settings.
    pub settings: Settings,
    /// Worker registry with in-flight counts (atomics).
    pub workers: Arc<Workers>,
    /// Resolved worker addresses, by worker id.
    pub targets: Vec<Target>,
    /// The routing policy and its indexes.
    pub router: Router,
    /// Writer side of the KV-event index (stats for `/metrics` and `/admin`; the router reads
    /// the index lock-free). `None` without event sources.
    pub events: Option<crate::zmq::SharedEvents>,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// The policy's name, for metric labels.
    pub policy_name: &'static str,
    /// Tokenizers loaded at start-up (empty: text-mode routing); each shard copies them once.
    pub tokenizers: Tokenizers,
    /// Test hook: once set, every routed request's final [`RouteKey`] (after tokenization) is
    /// appended here. Unset in production: one atomic load per request.
    pub key_tap: OnceLock<Mutex<Vec<RouteKey>>>,
}

/// A running gateway: its address and shard threads.
pub struct Server {
    addr: SocketAddr,
    shutdown: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl Server {
    /// The address the shards listen on (the real port when `listen` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The shared state (workers, metrics), for tests and the demo.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops accepting, ends every shard's runtime (dropping its open connections), and
    /// joins the threads. Bounded: gives up waiting after 5 s.
    pub fn shutdown(mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        let until = Instant::now() + Duration::from_secs(5);
        // Wake each shard's accept: the kernel spreads these connections over the listeners.
        while self.threads.iter().any(|t| !t.is_finished()) && Instant::now() < until {
            let _ = std::net::TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
            std::thread::sleep(Duration::from_millis(2));
        }
        for t in self.threads.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }

    /// Blocks until every shard thread ends (i.e. forever, for `kvroute serve`).
    pub fn wait(mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Resolves each worker URL's `host:port` once.
///
/// # Errors
/// A worker whose host does not resolve.
pub fn resolve_targets(workers: &Workers) -> std::io::Result<Vec<Target>> {
    workers
        .iter()
        .map(|w| {
            let authority = format!("{}:{}", w.host, w.port);
            let addr = authority.to_socket_addrs()?.next().ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("cannot resolve {authority}"),
                )
            })?;
            Ok(Target {
                id: w.id,
                url: w.url.clone(),
                authority,
                addr,
            })
        })
        .collect()
}

/// Binds `n` listeners on one address with `SO_REUSEPORT` (the first decides the port when
/// `listen` has port 0).
fn bind_listeners(listen: &str, n: usize) -> std::io::Result<Vec<TcpListener>> {
    let mut addr = listen.to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad listen address {listen}"),
        )
    })?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        socket.set_reuse_address(true)?;
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(4096)?;
        let l: TcpListener = socket.into();
        addr = l.local_addr()?;
        out.push(l);
    }
    Ok(out)
}

/// Starts the shards and returns once every listener is bound.
///
/// # Errors
/// Binding the listen address failed, or a shard thread could not be spawned.
pub fn start(shared: Shared) -> std::io::Result<Server> {
    let shared = Arc::new(shared);
    let n = shared.settings.shards.max(1);
    let listeners = bind_listeners(&shared.settings.listen, n)?;
    let addr = listeners[0].local_addr()?;
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let shutdown = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::with_capacity(n);
    for (i, listener) in listeners.into_iter().enumerate() {
        let shared = shared.clone();
        let shutdown = shutdown.clone();
        let core = (!cores.is_empty()).then(|| cores[i % cores.len()]);
        let t = std::thread::Builder::new()
            .name(format!("kvroute-shard-{i}"))
            .spawn(move || run_shard(i, core, listener, shared, shutdown))?;
        threads.push(t);
    }
    tracing::info!(%addr, shards = n, "kvroute listening");
    Ok(Server {
        addr,
        shutdown,
        threads,
        shared,
    })
}

fn run_shard(
    i: usize,
    core: Option<core_affinity::CoreId>,
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: Arc<AtomicBool>,
) {
    if let Some(core) = core
        && !core_affinity::set_for_current(core)
    {
        tracing::warn!(shard = i, core = core.id, "could not pin shard to core");
    }
    let uring = !shared.settings.force_epoll && monoio::utils::detect_uring();
    let driver = if uring { "io_uring" } else { "epoll" };
    tracing::info!(
        shard = i,
        core = core.map(|c| c.id),
        driver,
        "shard started"
    );
    let fut = accept_loop(listener, shared, shutdown);
    let result = if uring {
        monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
            .enable_timer()
            .build()
            .map(|mut rt| rt.block_on(fut))
    } else {
        monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
            .enable_timer()
            .build()
            .map(|mut rt| rt.block_on(fut))
    };
    if let Err(e) = result {
        tracing::error!(shard = i, driver, error = %e, "shard runtime failed to start");
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, shutdown: Arc<AtomicBool>) {
    let listener = match monoio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot register listener");
            return;
        }
    };
    let pool = Rc::new(Pool::new(
        shared.targets.len(),
        shared.settings.upstream_idle_timeout,
        shared.settings.connect_timeout,
    ));
    // Close idle upstream connections once they pass the idle timeout, not only when next
    // taken, so workers see them go after ~3 s (below their own 5 s keep-alive).
    let sweeper = pool.clone();
    monoio::spawn(async move {
        let period = (sweeper.idle_timeout() / 3).max(Duration::from_millis(100));
        loop {
            monoio::time::sleep(period).await;
            sweeper.sweep();
        }
    });
    let tokens: Rc<RefCell<ShardTokenizers>> = Rc::new(RefCell::new(shared.tokenizers.for_shard()));
    loop {
        let accepted = listener.accept().await;
        if shutdown.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            Ok((stream, _)) => {
                monoio::spawn(exchange::serve_connection(
                    shared.clone(),
                    pool.clone(),
                    tokens.clone(),
                    stream,
                ));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                monoio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}
