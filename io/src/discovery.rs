//! DNS discovery at run time (`--worker-dns`, [`kvroute_core::discovery`]): the
//! `kv-discovery` thread looks every source up every `dns_refresh_secs` and changes the fleet
//! through the admin API's own paths ([`crate::gateway::add_worker`]: health check, models,
//! KV-event subscription; [`crate::gateway::remove_worker`]: drain, wait for in-flight
//! requests up to the shutdown grace, purge every index, cancel the subscription), never on a
//! shard's thread.
//!
//! [`DnsResolver`] is the real [`Resolve`]: A/AAAA through the system's getaddrinfo (as
//! `--worker` hosts are resolved: /etc/hosts, nsswitch, the cluster DNS search list) or, with
//! `--dns-server`, through hickory-resolver asking that nameserver; SRV always through
//! hickory-resolver (the system's /etc/resolv.conf, or `--dns-server`).
//!
//! # Invariants
//! 1. A lookup that fails or answers nothing changes no worker; it is logged and counted
//!    (`kvroute_discovery_errors_total{source}`), and the source's last good set stays.
//! 2. A discovered worker is removed only by the admin API's removal, on its own `kv-remove`
//!    thread: the discovery loop never waits for a drain, and no request in flight is cut
//!    before the shutdown grace.
//! 3. Discovered worker ids are in [`Shared::discovered`] until their removal ends, so a
//!    SIGHUP reload ([`crate::gateway::apply_workers`]) never removes them.
//! 4. Every lookup is bounded: [`kvroute_core::config::defaults::DNS_TIMEOUT_SECS`] per
//!    query, 2 attempts, at most `dns_max_addresses + 1` SRV targets resolved per refresh
//!    (one over the cap, so a cut is seen and counted).

use crate::state::Shared;
use kvroute_core::config::WorkerSpec;
use kvroute_core::discovery::{
    DnsQuery, DnsSource, Fleet, LookupError, Outcome, Reconciler, Resolve, refresh,
};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Time the loop sleeps between checks that the gateway still runs (it ends within this
/// after the gateway's state is dropped).
const POLL: Duration = Duration::from_millis(50);

/// The real resolver (see the module doc). Owns a single-threaded Tokio runtime for
/// hickory-resolver; used from the `kv-discovery` thread only.
pub struct DnsResolver {
    rt: tokio::runtime::Runtime,
    /// Set when some source needs it: SRV sources, or every source with `--dns-server`.
    hickory: Option<hickory_resolver::TokioResolver>,
    /// A/AAAA through hickory (`--dns-server`) rather than getaddrinfo.
    hickory_hosts: bool,
    /// SRV targets resolved per lookup at most (`dns_max_addresses + 1`).
    max_targets: usize,
    timeout: Duration,
}

impl std::fmt::Debug for DnsResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsResolver")
            .field("hickory", &self.hickory.is_some())
            .field("hickory_hosts", &self.hickory_hosts)
            .finish_non_exhaustive()
    }
}

impl DnsResolver {
    /// A resolver for `sources`: `server` (`--dns-server`) is the nameserver for every
    /// lookup; without it A/AAAA go through getaddrinfo and SRV through /etc/resolv.conf.
    /// `max_addresses` is the per-source cap (`dns_max_addresses`); `timeout` is per query.
    ///
    /// # Errors
    /// The runtime cannot be built, or SRV sources need the system's resolver configuration
    /// and it cannot be read.
    pub fn new(
        sources: &[DnsSource],
        server: Option<SocketAddr>,
        max_addresses: usize,
        timeout: Duration,
    ) -> std::io::Result<Self> {
        use hickory_resolver::config::{NameServerConfig, ResolveHosts, ResolverConfig};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let srv = sources
            .iter()
            .any(|s| matches!(s.query, DnsQuery::Srv { .. }));
        let provider = hickory_resolver::net::runtime::TokioRuntimeProvider::default();
        let builder = match server {
            Some(addr) => {
                let mut ns = NameServerConfig::udp_and_tcp(addr.ip());
                for c in &mut ns.connections {
                    c.port = addr.port();
                }
                let mut b = hickory_resolver::TokioResolver::builder_with_config(
                    ResolverConfig::from_name_servers(vec![ns]),
                    provider,
                );
                // Only the named server answers: no /etc/hosts.
                b.options_mut().use_hosts_file = ResolveHosts::Never;
                Some(b)
            }
            None if srv => Some(hickory_resolver::TokioResolver::builder(provider).map_err(
                |e| {
                    std::io::Error::other(format!(
                        "--worker-dns srv: cannot read the system resolver configuration: {e}"
                    ))
                },
            )?),
            None => None,
        };
        let hickory = match builder {
            Some(mut b) => {
                let o = b.options_mut();
                o.timeout = timeout;
                o.attempts = 2;
                let _enter = rt.enter();
                Some(
                    b.build()
                        .map_err(|e| std::io::Error::other(e.to_string()))?,
                )
            }
            None => None,
        };
        Ok(Self {
            rt,
            hickory,
            hickory_hosts: server.is_some(),
            max_targets: max_addresses.saturating_add(1),
            timeout,
        })
    }

    /// A and AAAA of `name`, on `port`.
    fn hosts(&self, name: &str, port: u16) -> Result<Vec<SocketAddr>, LookupError> {
        if let Ok(ip) = name.parse::<std::net::IpAddr>() {
            return Ok(vec![SocketAddr::new(ip, port)]);
        }
        match (&self.hickory, self.hickory_hosts) {
            (Some(r), true) => {
                let ips = self.block(r.lookup_ip(name))?;
                Ok(ips.iter().map(|ip| SocketAddr::new(ip, port)).collect())
            }
            _ => (name, port)
                .to_socket_addrs()
                .map(Iterator::collect)
                .map_err(|e| LookupError::Other(format!("{name}: {e}"))),
        }
    }

    /// SRV of `name`: every target's addresses on its record's port. A target that does not
    /// resolve fails the whole lookup (a partial answer would remove healthy workers).
    fn srv(&self, name: &str) -> Result<Vec<SocketAddr>, LookupError> {
        let r = self
            .hickory
            .as_ref()
            .ok_or_else(|| LookupError::Other("no SRV resolver".into()))?;
        let lookup = self.block(r.srv_lookup(name))?;
        let mut targets: Vec<(String, u16)> = lookup
            .answers()
            .iter()
            .filter_map(|rec| match &rec.data {
                hickory_resolver::proto::rr::RData::SRV(srv) => {
                    Some((srv.target.to_ascii(), srv.port))
                }
                _ => None,
            })
            // RFC 2782: target "." means the service is not available there.
            .filter(|(t, port)| t != "." && *port > 0)
            .collect();
        targets.sort();
        targets.dedup();
        targets.truncate(self.max_targets);
        let mut out = Vec::new();
        for (target, port) in targets {
            out.extend(self.hosts(&target, port)?);
        }
        Ok(out)
    }

    /// Runs one hickory lookup to its end or [`DnsResolver::timeout`] × 2 attempts + 1 s.
    fn block<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, hickory_resolver::net::NetError>>,
    ) -> Result<T, LookupError> {
        let limit = self.timeout * 2 + Duration::from_secs(1);
        // The timer is made inside the runtime: `timeout` needs its time driver.
        match self
            .rt
            .block_on(async { tokio::time::timeout(limit, f).await })
        {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) if e.is_nx_domain() || e.is_no_records_found() => {
                Err(LookupError::NotFound(e.to_string()))
            }
            Ok(Err(hickory_resolver::net::NetError::Timeout)) => Err(LookupError::Timeout(
                format!("no answer in {:?}", self.timeout),
            )),
            Ok(Err(e)) => Err(LookupError::Other(e.to_string())),
            Err(_) => Err(LookupError::Timeout(format!("no answer in {limit:?}"))),
        }
    }
}

impl Resolve for DnsResolver {
    fn resolve(&mut self, query: &DnsQuery) -> Result<Vec<SocketAddr>, LookupError> {
        // Each refresh asks DNS again: the refresh interval is the operator's, not the TTL's
        // (a cluster DNS caches on its own side anyway).
        if let Some(r) = &self.hickory {
            r.clear_cache();
        }
        match query {
            DnsQuery::Host { name, port } => self.hosts(name, *port),
            DnsQuery::Srv { name } => self.srv(name),
        }
    }
}

/// The gateway's fleet as discovery changes it (invariants 2, 3).
struct GatewayFleet<'a> {
    shared: &'a Arc<Shared>,
}

impl Fleet for GatewayFleet<'_> {
    fn add(&mut self, spec: &WorkerSpec) -> Result<usize, String> {
        let id = crate::gateway::add_worker(
            self.shared,
            spec,
            self.shared.settings.health_checks.as_ref(),
        )
        .map_err(|e| e.to_string())?;
        crate::gateway::lock(&self.shared.discovered).insert(id);
        Ok(id)
    }

    fn remove(&mut self, id: usize) {
        crate::gateway::drain_worker(self.shared, id);
        let shared = self.shared.clone();
        let wait = shared.settings.shutdown_timeout;
        let spawned = std::thread::Builder::new()
            .name("kv-remove".into())
            .spawn(move || {
                crate::gateway::remove_worker(&shared, id, wait);
                crate::gateway::lock(&shared.discovered).remove(&id);
            });
        if let Err(e) = spawned {
            // Drained already: it takes no new request. Removed in place rather than never.
            tracing::warn!(id, error = %e, "discovery: no removal thread, removing in place");
            crate::gateway::remove_worker(self.shared, id, self.shared.settings.shutdown_timeout);
            crate::gateway::lock(&self.shared.discovered).remove(&id);
        }
    }

    fn present(&self, id: usize) -> bool {
        self.shared.workers.get(id).is_some()
    }
}

/// One refresh of every source: looks up, changes the fleet, logs, updates the metrics.
fn refresh_all(
    shared: &Arc<Shared>,
    sources: &[DnsSource],
    states: &mut [Reconciler],
    resolver: &mut dyn Resolve,
) {
    let mut fleet = GatewayFleet { shared };
    for (source, state) in sources.iter().zip(states.iter_mut()) {
        let r = refresh(source, state, resolver, &mut fleet);
        let label = source.label.as_str();
        match &r.outcome {
            Outcome::Failed(e) => {
                shared.metrics.on_discovery_error(label);
                tracing::warn!(source = label, error = %e, kept = state.members().len(),
                    "DNS discovery: lookup failed, keeping the last good set");
            }
            Outcome::Answered { addresses, dropped } if *dropped > 0 => {
                shared.metrics.on_discovery_truncated(label);
                tracing::warn!(
                    source = label,
                    addresses,
                    dropped,
                    kept = addresses - dropped,
                    "DNS discovery: answer cut to dns_max_addresses"
                );
            }
            Outcome::Answered { .. } => {}
        }
        for (addr, id) in &r.added {
            tracing::info!(source = label, %addr, id, "DNS discovery: worker added");
        }
        for (addr, id) in &r.removed {
            tracing::info!(source = label, %addr, id, "DNS discovery: worker left the answer, draining");
        }
        for (addr, why) in &r.refused {
            tracing::warn!(source = label, %addr, error = %why, "DNS discovery: add refused, retried next refresh");
        }
        shared
            .metrics
            .set_discovered_workers(label, state.members().len());
    }
}

/// Starts DNS discovery of `sources` on `shared`: one refresh now, on the caller's thread
/// (so the first answer's workers are in the fleet before the listeners open; a failure is
/// logged, and the fleet starts without them), then the `kv-discovery` thread refreshes every
/// `every` until the gateway's state is dropped or a shutdown begins.
///
/// # Errors
/// The thread cannot be spawned.
pub fn start(
    shared: &Arc<Shared>,
    sources: Vec<DnsSource>,
    every: Duration,
    max_addresses: usize,
    mut resolver: Box<dyn Resolve + Send>,
) -> std::io::Result<()> {
    let mut states: Vec<Reconciler> = sources
        .iter()
        .map(|_| Reconciler::new(max_addresses))
        .collect();
    refresh_all(shared, &sources, &mut states, resolver.as_mut());
    let weak: Weak<Shared> = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name("kv-discovery".into())
        .spawn(move || {
            loop {
                let next = std::time::Instant::now() + every;
                while std::time::Instant::now() < next {
                    match weak.upgrade() {
                        Some(s) if !s.is_shutting_down() => {}
                        _ => return,
                    }
                    std::thread::sleep(
                        POLL.min(next.saturating_duration_since(std::time::Instant::now())),
                    );
                }
                let Some(shared) = weak.upgrade() else { return };
                refresh_all(&shared, &sources, &mut states, resolver.as_mut());
            }
        })?;
    tracing::info!(every_secs = every.as_secs_f64(), "DNS discovery started");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::discovery::parse_dns_source;

    /// Without `--dns-server`, A/AAAA go through getaddrinfo as `--worker` hosts do:
    /// /etc/hosts names `localhost`, IP literals are themselves, an unknown name is an error.
    #[test]
    fn system_resolver_for_hosts() {
        let sources = [parse_dns_source("localhost:8000").unwrap()];
        let mut r = DnsResolver::new(&sources, None, 16, Duration::from_secs(2)).unwrap();
        assert!(
            r.hickory.is_none(),
            "no SRV source, no --dns-server: no hickory"
        );
        let got = r.resolve(&sources[0].query).unwrap();
        assert!(!got.is_empty());
        assert!(
            got.iter().all(|a| a.ip().is_loopback() && a.port() == 8000),
            "{got:?}"
        );
        let lit = parse_dns_source("[::1]:9000").unwrap();
        assert_eq!(
            r.resolve(&lit.query).unwrap(),
            vec!["[::1]:9000".parse().unwrap()]
        );
        let none = parse_dns_source("no-such-host.invalid:1").unwrap();
        assert!(r.resolve(&none.query).is_err());
    }
}
