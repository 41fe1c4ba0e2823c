//! Turns a [`Config`] into running shards: validates it, builds the worker registry (each
//! worker resolved and checked once), the router and the metrics, starts the background
//! threads (health checks, load reports, KV events, the index writer, the admin API) and
//! [`shard::start`].
//! Also the fleet's run-time changes, shared by the admin API, SIGHUP and DNS discovery
//! ([`crate::discovery`]): [`add_worker`], [`drain_worker`], [`remove_worker`].

use crate::error::GatewayError;
use crate::shard::{self, Server};
use crate::state::{Settings, Shared};
use kvroute_core::config::{Config, WorkerSpec, defaults, parse_worker_spec};
use kvroute_core::health::RetryBudget;
use kvroute_core::metrics::Metrics;
use kvroute_core::policy::Router;
use kvroute_core::tokens::Tokenizers;
use kvroute_core::workers::{WorkerSettings, Workers};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::time::Duration;

/// The `kv-index` thread: replays records on the indexes' second copies every
/// [`defaults::INDEX_WRITER_PERIOD_MS`] ([`Router::catch_up`]), until the gateway is dropped.
///
/// # Errors
/// The thread cannot be spawned.
fn start_index_writer(shared: &Arc<Shared>) -> std::io::Result<()> {
    let shared = Arc::downgrade(shared);
    let period = Duration::from_millis(defaults::INDEX_WRITER_PERIOD_MS);
    std::thread::Builder::new()
        .name("kv-index".into())
        .spawn(move || {
            while let Some(s) = shared.upgrade() {
                s.router.catch_up();
                drop(s);
                std::thread::sleep(period);
            }
        })?;
    Ok(())
}

/// Starts `kvroute serve` with `cfg`.
///
/// Each worker's host is resolved once. With health checks on, each worker is checked once
/// before the listeners open: one that does not answer is logged and starts unhealthy (it
/// joins when its checks pass); its models are read from its `/v1/models` unless its spec
/// names them.
///
/// # Errors
/// An invalid config (named field), a client key file that cannot be read, a tokenizer that
/// cannot be loaded, a worker host that does not resolve, a KV-event socket that cannot be
/// created, a background thread that cannot be spawned, or a listen or admin address that
/// cannot be bound (in use by another process, named).
pub fn start(cfg: Config, force_epoll: bool) -> Result<Server, GatewayError> {
    let cfg = cfg.validate()?;
    let mask_cores = core_affinity::get_core_ids().map_or(0, |c| c.len());
    let usable = std::thread::available_parallelism().map_or(mask_cores.max(1), |n| n.get());
    let shards = cfg.shards.unwrap_or(usable);
    let pin = crate::shard::pins(cfg.pin_shards, mask_cores, usable);
    let api_keys = client_keys(&cfg)?;
    let workers = Arc::new(Workers::with_settings(&[], WorkerSettings::of(&cfg))?);
    let mut router = Router::new(&cfg);
    let specs = cfg
        .workers
        .iter()
        .map(|w| parse_worker_spec(w))
        .collect::<Result<Vec<_>, _>>()?;
    let dns_sources = cfg
        .worker_dns
        .iter()
        .map(|s| kvroute_core::discovery::parse_dns_source(s))
        .collect::<Result<Vec<_>, _>>()?;
    // KV events (issue 5): workers with `;events=…` (and DNS sources with `;events_port=P`)
    // feed one event index the router reads.
    let events = if specs.iter().any(|s| s.events.is_some())
        || dns_sources.iter().any(|s| s.events_port.is_some())
    {
        let index = kvroute_core::events::EventIndex::with_settings(
            &kvroute_core::events::EventIndexSettings {
                block_size: cfg.block_size,
                // Workers added at run time take new ids: leave room beyond the start-up fleet.
                max_streams: specs
                    .iter()
                    .map(|s| s.dp as usize)
                    .sum::<usize>()
                    .max(kvroute_core::events::index::DEFAULT_STREAMS),
                ttl_ms: cfg.kv_indexer_ttl_secs.map(|s| s.saturating_mul(1000)),
                max_entries: cfg.kv_indexer_max_entries,
            },
        );
        router.set_event_index(index.reader());
        Some(Arc::new(std::sync::Mutex::new(index)))
    } else {
        None
    };
    let tokenizers = Tokenizers::load(&cfg)?;
    let (sync, sync_rx) = match &cfg.nats_url {
        Some(_) => {
            let (link, rx) = crate::nats::SyncLink::new();
            (Some(link), Some(rx))
        }
        None => (None, None),
    };
    let shared = Arc::new(Shared {
        settings: Settings::of(&cfg, shards, pin, force_epoll),
        workers,
        router,
        events,
        subscriptions: Default::default(),
        discovered: Default::default(),
        metrics: Metrics::new(),
        policy_name: cfg.policy.as_str(),
        tokenizers,
        api_keys,
        retry_budget: RetryBudget::new(cfg.retry_budget_ratio, cfg.retry_budget_cap),
        seq: AtomicU64::new(0),
        in_flight: AtomicUsize::new(0),
        started_unix_secs: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        shutting_down: AtomicBool::new(false),
        cutting: AtomicBool::new(false),
        cut: AtomicUsize::new(0),
        key_tap: Default::default(),
        sync,
    });
    for spec in &specs {
        add_worker(&shared, spec, shared.settings.health_checks.as_ref())?;
    }
    if !dns_sources.is_empty() {
        let server = cfg.dns_server.as_deref().and_then(|s| s.parse().ok());
        let resolver = crate::discovery::DnsResolver::new(
            &dns_sources,
            server,
            cfg.dns_max_addresses,
            Duration::from_secs(kvroute_core::config::defaults::DNS_TIMEOUT_SECS),
        )?;
        crate::discovery::start(
            &shared,
            dns_sources,
            Duration::from_secs(cfg.dns_refresh_secs),
            cfg.dns_max_addresses,
            Box::new(resolver),
        )?;
    }
    if let (Some(link), Some(rx), Some(url)) = (&shared.sync, sync_rx, &cfg.nats_url) {
        crate::nats::start(&shared, link.clone(), rx, url, &cfg.nats_subject_prefix)?;
        tracing::info!(
            nats = url,
            subject = crate::nats::subject(&cfg.nats_subject_prefix),
            replica = link.origin(),
            "replica sync on"
        );
    }
    start_index_writer(&shared)?;
    if let Some(checks) = shared.settings.health_checks {
        crate::health::start(&shared, checks)?;
    }
    if cfg.load_poll_ms > 0 {
        let every = Duration::from_millis(cfg.load_poll_ms);
        // A poll must not outlast its interval by much: a stuck engine delays the others.
        let timeout = every.min(Duration::from_millis(cfg.connect_timeout_ms));
        crate::load_poll::start(&shared.workers, every, timeout)?;
    }
    let admin = if cfg.admin_listen.is_empty() {
        None
    } else {
        Some(crate::admin::start(
            &shared,
            &cfg.admin_listen,
            cfg.admin_api_key.clone(),
        )?)
    };
    tracing::info!(
        policy = shared.policy_name,
        workers = shared.workers.len(),
        token_mode = !shared.tokenizers.is_empty(),
        auth = !shared.api_keys.is_empty(),
        "gateway configured"
    );
    Ok(shard::start(shared, admin)?)
}

/// The client keys of `--api-key` and `--api-key-file` (one per line, blank lines and `#`
/// comments skipped).
///
/// # Errors
/// [`GatewayError::KeyFile`] when the file cannot be read.
fn client_keys(cfg: &Config) -> Result<Vec<Vec<u8>>, GatewayError> {
    let mut keys: Vec<Vec<u8>> = cfg.api_keys.iter().map(|k| k.as_bytes().to_vec()).collect();
    if let Some(path) = &cfg.api_key_file {
        let text = std::fs::read_to_string(path).map_err(|source| GatewayError::KeyFile {
            path: path.display().to_string(),
            source,
        })?;
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(|l| l.as_bytes().to_vec()),
        );
    }
    keys.retain(|k| !k.is_empty());
    Ok(keys)
}

/// Adds the worker of `spec` at run time (or at start-up): resolves its host, checks it once
/// when health checks are on (unreachable → added unhealthy, logged), reads its models, and
/// registers it. Returns its id. A worker added again after its removal starts clean: a new
/// id, nothing in any index.
///
/// # Errors
/// [`GatewayError::Resolve`] when its host does not resolve; [`GatewayError::Core`] for a URL
/// already present.
pub fn add_worker(
    shared: &Shared,
    spec: &WorkerSpec,
    checks: Option<&crate::health::Checks>,
) -> Result<usize, GatewayError> {
    let (_, host, port) = kvroute_core::config::parse_worker_url(&spec.url)?;
    let addr = shard::resolve(&host, port).map_err(|source| GatewayError::Resolve {
        url: spec.url.clone(),
        source,
    })?;
    let (healthy, models) = match checks {
        Some(c) => {
            let key = spec
                .api_key_env
                .as_ref()
                .and_then(|v| std::env::var(v).ok());
            let probe = crate::health::probe(addr, &spec.url, c.timeout, key.as_deref());
            if !probe.healthy {
                tracing::warn!(worker = %spec.url, "worker unreachable at start-up: starts unhealthy");
            }
            (probe.healthy, probe.models)
        }
        None => (true, None),
    };
    let id = shared.workers.add_resolved(spec, Some(addr), healthy)?;
    if let (Some(models), Some(w)) = (models, shared.workers.get(id)) {
        w.set_models(models);
    }
    if spec.events.is_some() {
        match &shared.events {
            Some(ix) => {
                let worker = shared
                    .workers
                    .get(id)
                    .map_or_else(Default::default, |w| Arc::downgrade(&w));
                let sub = crate::zmq::start(crate::zmq::sources_of(id, spec), ix.clone(), worker)?;
                lock(&shared.subscriptions).insert(id, sub);
            }
            None => tracing::warn!(
                id,
                worker = %spec.url,
                "KV events ignored: the gateway started without an event index"
            ),
        }
    }
    tracing::info!(id, worker = %spec.url, healthy, "worker added");
    Ok(id)
}

/// Drains worker `id`: it takes no new request; those in flight finish. False for an
/// unknown id.
pub fn drain_worker(shared: &Shared, id: usize) -> bool {
    let ok = shared.workers.drain(id);
    if ok {
        tracing::info!(id, "worker draining");
    }
    ok
}

/// Removes worker `id`: drains it, waits (up to `wait`) for its requests in flight to end,
/// then removes it from the registry and purges it from every index (its pooled connections
/// close at each shard's next sweep). Returns false for an unknown id.
pub fn remove_worker(shared: &Shared, id: usize, wait: Duration) -> bool {
    let Some(w) = shared.workers.get(id) else {
        return false;
    };
    shared.workers.drain(id);
    let until = std::time::Instant::now() + wait;
    while w.in_flight() > 0 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    shared.workers.remove(id);
    if let Some(sub) = lock(&shared.subscriptions).remove(&id) {
        sub.cancel();
    }
    shared.purge_worker(id);
    shared.metrics.forget_worker(id);
    tracing::info!(id, worker = %w.url, cut = w.in_flight(), "worker removed");
    true
}

/// SIGHUP: re-reads the config file at `path` and applies its worker list (see
/// [`apply_workers`]). A file that does not read, parse or validate changes nothing and is
/// logged. Other keys whose values differ from `running` (the config the router started
/// with, flags included) are named in a warning: they wait for a restart.
pub fn reload(shared: &Arc<Shared>, path: &std::path::Path, running: &Config) {
    let cfg = std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|text| Config::from_toml_str(&text).map_err(|e| e.to_string()))
        .and_then(|cfg| cfg.validate().map_err(|e| e.to_string()));
    match cfg {
        Ok(cfg) => {
            match apply_workers(shared, &cfg.workers) {
                Ok((added, removed)) => {
                    tracing::info!(path = %path.display(), ?added, ?removed, "config reloaded")
                }
                Err(e) => tracing::error!(path = %path.display(), error = %e, "reload failed"),
            }
            let waiting = restart_only_changes(running, &cfg);
            if !waiting.is_empty() {
                tracing::warn!(path = %path.display(), keys = ?waiting, "reload applies only `workers`: these keys differ from the running config and wait for a restart");
            }
        }
        Err(e) => tracing::error!(path = %path.display(), error = %e, "reload: config refused"),
    }
}

/// The keys of `file` other than `workers` (the one a reload applies) whose values differ
/// from `running`'s, in key order.
pub fn restart_only_changes(running: &Config, file: &Config) -> Vec<String> {
    let (Ok(serde_json::Value::Object(now)), Ok(serde_json::Value::Object(new))) =
        (serde_json::to_value(running), serde_json::to_value(file))
    else {
        return Vec::new();
    };
    new.into_iter()
        .filter(|(k, v)| k != "workers" && now.get(k) != Some(v))
        .map(|(k, _)| k)
        .collect()
}

/// Makes the static fleet the workers of `specs`: adds those whose URL is not present,
/// removes (drain first, on a background thread, up to the shutdown grace) those no longer
/// listed. Workers DNS discovery added are left alone ([`Shared::discovered`]). Returns the
/// ids added and removed.
///
/// # Errors
/// A spec that does not parse or a host that does not resolve (nothing is changed then).
pub fn apply_workers(
    shared: &Arc<Shared>,
    specs: &[String],
) -> Result<(Vec<usize>, Vec<usize>), GatewayError> {
    let specs = specs
        .iter()
        .map(|s| parse_worker_spec(s))
        .collect::<Result<Vec<_>, _>>()?;
    let discovered = lock(&shared.discovered).clone();
    let gone: Vec<usize> = shared
        .workers
        .iter()
        .iter()
        .filter(|w| !discovered.contains(&w.id) && !specs.iter().any(|s| s.url == w.url))
        .map(|w| w.id)
        .collect();
    let new: Vec<&WorkerSpec> = specs
        .iter()
        .filter(|s| shared.workers.find_url(&s.url).is_none())
        .collect();
    // Every new host must resolve before anything changes.
    for spec in &new {
        let (_, host, port) = kvroute_core::config::parse_worker_url(&spec.url)?;
        shard::resolve(&host, port).map_err(|source| GatewayError::Resolve {
            url: spec.url.clone(),
            source,
        })?;
    }
    // Drained first: a new URL for the same engine (`localhost` for `127.0.0.1`) is then
    // not refused for the address of the worker it replaces.
    for &id in &gone {
        shared.workers.drain(id);
    }
    let mut added = Vec::new();
    for spec in new {
        added.push(add_worker(
            shared,
            spec,
            shared.settings.health_checks.as_ref(),
        )?);
    }
    for &id in &gone {
        let shared = shared.clone();
        let wait = shared.settings.shutdown_timeout;
        std::thread::Builder::new()
            .name("kv-remove".into())
            .spawn(move || {
                remove_worker(&shared, id, wait);
            })?;
    }
    Ok((added, gone))
}

pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_names_the_keys_that_wait_for_a_restart() {
        let running = Config {
            workers: vec!["http://127.0.0.1:1".into()],
            ..Config::default()
        };
        // A new worker is applied; the policy and a timeout are not.
        let file = Config {
            workers: vec!["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
            policy: kvroute_core::config::PolicyKind::RoundRobin,
            stream_idle_timeout_secs: 5,
            ..running.clone()
        };
        assert_eq!(
            restart_only_changes(&running, &file),
            ["policy", "stream_idle_timeout_secs"]
        );
        assert!(restart_only_changes(&running, &running).is_empty());
    }
}
