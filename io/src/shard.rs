//! Thread-per-core shards: one monoio runtime per thread, pinned to a core, each with its own
//! `SO_REUSEPORT` listener, so the kernel spreads connections over shards and a connection
//! lives on one shard for its whole life.
//!
//! Shards share only [`Shared`] (settings, worker registry with atomic in-flight counts, the
//! router's indexes, metrics, the tokenizers as loaded). Each shard owns its upstream [`Pool`]
//! and its [`ShardTokenizers`] (own copies of the tokenizers and an incremental-tokenization
//! prefix cache), made on the shard's thread.

use crate::exchange::ShardCtx;
use crate::state::Shared;
use crate::upstream::Pool;
use std::cell::{Cell, RefCell};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A running gateway: its address and shard threads.
pub struct Server {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
    threads: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl Server {
    /// The address the shards listen on (the real port when `listen` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin API's address, when it runs.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
    }

    /// The shared state (workers, metrics), for tests and the demo.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Graceful shutdown: readiness turns false, the listeners close, exchanges in flight may
    /// finish for up to `--shutdown-timeout-secs`, then every shard's runtime ends (dropping
    /// what is still open) and the threads are joined. Returns the exchanges cut at the end
    /// (0 when all finished). Bounded: the grace plus 5 s.
    pub fn shutdown(mut self) -> usize {
        let grace = self.shared.settings.shutdown_timeout;
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        tracing::info!(
            in_flight = self.shared.in_flight.load(Ordering::SeqCst),
            grace_secs = grace.as_secs_f64(),
            "shutting down: listeners closing, waiting for exchanges in flight"
        );
        let until = Instant::now() + grace + Duration::from_secs(5);
        // Wake each shard's accept: the kernel spreads these connections over the listeners.
        while self.threads.iter().any(|t| !t.is_finished()) && Instant::now() < until {
            let _ = std::net::TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
            std::thread::sleep(Duration::from_millis(20));
        }
        let cut =
            self.shared.cut.load(Ordering::SeqCst) + self.shared.in_flight.load(Ordering::SeqCst);
        for t in self.threads.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            }
        }
        tracing::info!(cut, "shutdown complete");
        cut
    }

    /// Blocks until every shard thread ends (after a [`Server::shutdown`] from elsewhere,
    /// or forever).
    pub fn wait(mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }

    /// True once every shard thread has ended.
    pub fn is_finished(&self) -> bool {
        self.threads.iter().all(|t| t.is_finished())
    }
}

/// Resolves `host:port` to its first address.
///
/// # Errors
/// The host does not resolve.
pub fn resolve(host: &str, port: u16) -> std::io::Result<SocketAddr> {
    (host, port).to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("cannot resolve {host}:{port}"),
        )
    })
}

/// Binds `n` listeners on one address with `SO_REUSEPORT` (the first decides the port when
/// `listen` has port 0).
///
/// `SO_REUSEPORT` would let a second process bind the same port and silently take half of
/// the connections; so the address is first bound once *without* it, which fails with
/// `AddrInUse` while any other socket holds the port.
///
/// # Errors
/// The address does not parse or resolve, or is in use (a clear error naming it).
fn bind_listeners(listen: &str, n: usize) -> std::io::Result<Vec<TcpListener>> {
    let mut addr = listen.to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad listen address {listen}"),
        )
    })?;
    let domain = socket2::Domain::for_address(addr);
    let socket = |reuse_port: bool| -> std::io::Result<socket2::Socket> {
        let s = socket2::Socket::new(domain, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
        s.set_reuse_address(true)?;
        s.set_reuse_port(reuse_port)?;
        Ok(s)
    };
    let probe = socket(false)?;
    probe.bind(&addr.into()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            std::io::Error::new(
                e.kind(),
                format!(
                    "{addr} is already in use by another process (is kvroute already running?)"
                ),
            )
        } else {
            e
        }
    })?;
    if let Some(a) = probe.local_addr()?.as_socket() {
        addr = a;
    }
    drop(probe);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let s = socket(true)?;
        s.set_nonblocking(true)?;
        s.bind(&addr.into())?;
        s.listen(4096)?;
        let l: TcpListener = s.into();
        addr = l.local_addr()?;
        out.push(l);
    }
    Ok(out)
}

/// Whether shard threads are pinned to cores: `setting` when given, else (auto) when the
/// process may use every one of the `mask_cores` cores of its affinity mask (`usable`: what
/// `std::thread::available_parallelism` reports, the mask's size capped by a cgroup CPU
/// quota). A quota below the mask means the cores are shared with other tenants (a
/// Kubernetes CPU limit without a static CPU-manager policy): pinning every such pod onto
/// the mask's first cores would stack them there while other cores idle.
pub fn pins(setting: Option<bool>, mask_cores: usize, usable: usize) -> bool {
    setting.unwrap_or(mask_cores > 0 && usable >= mask_cores)
}

/// Starts the shards and returns once every listener is bound; `admin` is the admin API's
/// address when it runs.
///
/// # Errors
/// Binding the listen address failed, or a shard thread could not be spawned.
pub fn start(shared: Arc<Shared>, admin: Option<SocketAddr>) -> std::io::Result<Server> {
    let n = shared.settings.shards.max(1);
    let listeners = bind_listeners(&shared.settings.listen, n)?;
    let addr = listeners[0].local_addr()?;
    let cores = if shared.settings.pin_shards {
        core_affinity::get_core_ids().unwrap_or_default()
    } else {
        Vec::new()
    };
    let mut threads = Vec::with_capacity(n);
    for (i, listener) in listeners.into_iter().enumerate() {
        let shared = shared.clone();
        let core = (!cores.is_empty()).then(|| cores[i % cores.len()]);
        let t = std::thread::Builder::new()
            .name(format!("kvroute-shard-{i}"))
            .spawn(move || run_shard(i, core, listener, shared))?;
        threads.push(t);
    }
    tracing::info!(%addr, shards = n, pinned = !cores.is_empty(), "kvroute listening");
    Ok(Server {
        addr,
        admin,
        threads,
        shared,
    })
}

fn run_shard(
    i: usize,
    core: Option<core_affinity::CoreId>,
    listener: TcpListener,
    shared: Arc<Shared>,
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
    let fut = accept_loop(listener, shared);
    let result = if uring {
        // Without the cooperative flags when the kernel refuses them (before 6.0).
        monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
            .uring_builder(ring_setup())
            .enable_timer()
            .build()
            .or_else(|e| {
                tracing::debug!(shard = i, error = %e, "io_uring flags refused; plain ring");
                monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
                    .enable_timer()
                    .build()
            })
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

/// The setup of a shard's io_uring: `IORING_SETUP_COOP_TASKRUN` and
/// `IORING_SETUP_SINGLE_ISSUER` (Linux 5.19 and 6.0). A shard's ring is created and used by
/// its one thread, so the kernel need not interrupt that thread to post completions (without
/// COOP_TASKRUN it does, by an IPI and a return through `irqentry_exit_to_user_mode`, 11.7 %
/// of the round-robin server's CPU in a profile): they are posted at its next
/// `io_uring_enter`, which monoio makes every time it runs out of tasks. Measured on
/// `perf/compare.sh`'s round-robin server (A/B in one script, medians of 4 rounds): 14.1 →
/// 11.1 CPU µs per request, 64.4k → 81.0k req/s (perf/runs/2026-12-02-proxy-path). Adding
/// `DEFER_TASKRUN` or `TASKRUN_FLAG` changed nothing measurable.
fn ring_setup() -> io_uring::Builder {
    let mut b = io_uring::IoUring::builder();
    b.setup_coop_taskrun().setup_single_issuer();
    b
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let listener = match monoio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot register listener");
            return;
        }
    };
    let pool = Rc::new(Pool::new(
        shared.settings.upstream_idle_timeout,
        shared.settings.connect_timeout,
    ));
    // Close idle upstream connections once they pass the idle timeout, not only when next
    // taken, so workers see them go after ~3 s (below their own 5 s keep-alive); and those of
    // removed workers.
    let sweeper = pool.clone();
    // Weak: the task may outlive the runtime's `block_on`; the registry must not.
    let workers = Arc::downgrade(&shared.workers);
    monoio::spawn(async move {
        let period = (sweeper.idle_timeout() / 3).max(Duration::from_millis(100));
        loop {
            monoio::time::sleep(period).await;
            let Some(workers) = workers.upgrade() else {
                return;
            };
            sweeper.sweep(|w| workers.get(w).is_some());
        }
    });
    let ctx = ShardCtx {
        shared: shared.clone(),
        pool,
        tokens: Rc::new(RefCell::new(shared.tokenizers.for_shard())),
    };
    let open = Rc::new(Cell::new(0usize));
    let max = shared.settings.max_connections_per_shard;
    loop {
        let accepted = listener.accept().await;
        if shared.is_shutting_down() {
            break;
        }
        match accepted {
            Ok((stream, _)) if open.get() >= max => {
                shared.metrics.on_bad_request("too_many_connections");
                monoio::spawn(refuse(stream));
            }
            Ok((stream, _)) => {
                let ctx = ctx.clone();
                let open = open.clone();
                open.set(open.get() + 1);
                monoio::spawn(async move {
                    crate::http1::server::serve_connection(ctx, crate::conn::Conn::new(stream))
                        .await;
                    open.set(open.get() - 1);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                monoio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    drop(listener);
    // Exchanges in flight (on every shard) may finish within the grace; then those left end
    // themselves (`Shared::cutting`), for at most CUT_WAIT more.
    let until = Instant::now() + shared.settings.shutdown_timeout;
    while shared.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < until {
        monoio::time::sleep(Duration::from_millis(20)).await;
    }
    shared.cutting.store(true, Ordering::SeqCst);
    let until = Instant::now() + CUT_WAIT;
    while shared.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < until {
        monoio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// After the shutdown grace, how long exchanges still in flight have to end themselves
/// cleanly (a stream at its next data, an attempt at its next health look, every 250 ms):
/// 1 s. A stream whose worker sends nothing in that time is dropped with the runtime.
const CUT_WAIT: Duration = Duration::from_secs(1);

/// Answers a connection over the shard's limit with a 503 and closes it.
async fn refuse(stream: monoio::net::TcpStream) {
    let mut conn = crate::conn::Conn::new(stream);
    let body = crate::error::error_body(503, "too many connections");
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\nretry-after: {}\r\n\r\n",
        body.len(),
        crate::error::RETRY_AFTER_SECS
    )
    .into_bytes();
    out.extend_from_slice(&body);
    let _ = conn.write_all(out).await;
}

#[cfg(test)]
mod tests {
    use super::pins;

    /// Auto pins when the whole affinity mask is usable, not under a smaller CPU quota nor
    /// without a known mask; an explicit setting always wins.
    #[test]
    fn pinning_follows_the_quota_unless_set() {
        // (setting, cores in the mask, usable CPUs) -> pinned
        let cases = [
            (None, 8, 8, true),
            (None, 2, 2, true),
            (None, 64, 2, false),
            (None, 0, 4, false),
            (Some(true), 64, 2, true),
            (Some(false), 8, 8, false),
            (Some(true), 0, 1, true),
        ];
        for (setting, mask, usable, want) in cases {
            assert_eq!(
                pins(setting, mask, usable),
                want,
                "{setting:?} {mask} {usable}"
            );
        }
    }
}
