//! Turns a [`Config`] into running shards: validates it, builds the worker registry, the
//! router and the metrics, resolves worker addresses, and starts [`shard::start`].

use crate::shard::{self, Server, Settings, Shared};
use kvroute_core::config::{Config, defaults};
use kvroute_core::metrics::Metrics;
use kvroute_core::policy::Router;
use kvroute_core::tokens::Tokenizers;
use kvroute_core::workers::Workers;
use std::sync::Arc;
use std::time::Duration;

/// Starts `kvroute serve` with `cfg`.
///
/// # Errors
/// An invalid config (named field), a tokenizer that cannot be loaded, a worker host that does
/// not resolve, a KV-event socket that cannot be created, a load-report thread
/// (`load_poll_ms > 0`) that cannot be spawned, or a listen address that cannot be bound.
pub fn start(cfg: Config, force_epoll: bool) -> anyhow::Result<Server> {
    let cfg = cfg.validate()?;
    let workers = Arc::new(Workers::new(&cfg.workers)?);
    let targets = shard::resolve_targets(&workers)?;
    let shards = cfg.shards.unwrap_or_else(|| {
        core_affinity::get_core_ids()
            .map(|c| c.len())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    });
    let settings = Settings {
        listen: cfg.listen.clone(),
        shards,
        max_body_bytes: cfg.max_body_bytes,
        max_head_bytes: defaults::MAX_HEAD_BYTES,
        request_timeout: Duration::from_secs(cfg.request_timeout_secs),
        upstream_idle_timeout: Duration::from_millis(cfg.upstream_idle_timeout_ms),
        connect_timeout: Duration::from_millis(cfg.connect_timeout_ms),
        force_epoll,
    };
    let mut router = Router::new(&cfg);
    // KV events (issue 5): workers with `;events=…` feed one event index the router reads.
    let specs = cfg
        .workers
        .iter()
        .map(|w| kvroute_core::config::parse_worker_spec(w))
        .collect::<Result<Vec<_>, _>>()?;
    let sources = crate::zmq::sources(&specs);
    let events = if sources.is_empty() {
        None
    } else {
        let index = kvroute_core::events::EventIndex::with_settings(
            &kvroute_core::events::EventIndexSettings {
                block_size: cfg.block_size,
                max_streams: sources.len(),
                ttl_ms: cfg.kv_indexer_ttl_secs.map(|s| s.saturating_mul(1000)),
                max_entries: cfg.kv_indexer_max_entries,
            },
        );
        router.set_event_index(index.reader());
        let index = Arc::new(std::sync::Mutex::new(index));
        crate::zmq::start(sources, index.clone())?;
        Some(index)
    };
    let tokenizers = Tokenizers::load(&cfg)?;
    if cfg.load_poll_ms > 0 {
        let every = Duration::from_millis(cfg.load_poll_ms);
        // A poll must not outlast its interval by much: a stuck engine delays the others.
        let timeout = every.min(Duration::from_millis(cfg.connect_timeout_ms));
        crate::load_poll::start(&workers, targets.clone(), every, timeout)?;
    }
    let shared = Shared {
        settings,
        policy_name: cfg.policy.as_str(),
        workers,
        targets,
        router,
        events,
        metrics: Metrics::new(),
        tokenizers,
        key_tap: Default::default(),
    };
    tracing::info!(
        policy = shared.policy_name,
        workers = shared.targets.len(),
        token_mode = !shared.tokenizers.is_empty(),
        "gateway configured"
    );
    Ok(shard::start(shared)?)
}
