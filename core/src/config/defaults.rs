//! Every default of kvroute, defined once. `Config::default()`, `#[serde(default)]`, the CLI
//! help and the tests read these constants. Each line gives the unit and where the number
//! comes from ("seed doc" = the project's founding brief; SMG = anchors.md §2.3).

use super::PolicyKind;
use crate::policy::CacheIndexKind;

/// Gateway listen address, `HOST:PORT`. Source: seed doc.
pub const LISTEN: &str = "127.0.0.1:8000";
/// Largest request body, bytes (32 MiB); larger → 413. Source: seed doc.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// Largest request head, bytes (64 KiB); larger → 431. Source: seed doc.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Time allowed for one exchange with a worker, seconds (30 min: long generations stream that
/// long); over → 504. Source: seed doc.
pub const REQUEST_TIMEOUT_SECS: u64 = 1800;
/// Idle upstream keep-alive connections are closed after this, ms: below the 5 s idle timeout
/// of uvicorn-served engines (vLLM, SGLang), so the pool never reuses a connection the engine
/// is closing. Source: bug-cases.md B42.
pub const UPSTREAM_IDLE_TIMEOUT_MS: u64 = 3_000;
/// Time allowed to open a connection to a worker, ms; over → 502. Source: seed doc.
pub const CONNECT_TIMEOUT_MS: u64 = 3_000;
/// Interval of engine load reports, ms: every worker's `/metrics` is read this often and its
/// running + waiting requests that this router did not send are added to its load. 0 = off
/// (each router counts only its own requests, exact for a single router). SMG polls every
/// 10 s (engine-model.md §7); with several router replicas, a poll well under a request's
/// time in the engine keeps their views close (bug-cases.md B44).
pub const LOAD_POLL_MS: u64 = 0;
/// Routing policy. Source: SMG `--policy` default `cache_aware`.
pub const POLICY: PolicyKind = PolicyKind::CacheAware;
/// cache_aware: a match ratio (matched chars / request chars) strictly above this makes the
/// prefix holders the candidates; a fraction in [0, 1]. Source: SMG `--cache-threshold` 0.3.
pub const CACHE_THRESHOLD: f64 = 0.3;
/// Spill gate, relative part: a worker is hot when in-flight > this × mean in-flight
/// (dimensionless factor). Source: SMG `--balance-rel-threshold` 1.5.
pub const BALANCE_REL_THRESHOLD: f64 = 1.5;
/// Spill gate, absolute part: a worker is hot when in-flight > mean + this, requests.
///
/// Not SMG's 64 (`--balance-abs-threshold`): below a mean of 2 × this the margin binds, and
/// at 64 a worker may hold 64 more requests than the mean before it spills, which at tens of
/// requests per worker is no gate at all. Measured with `kvroute simulate` (README, "The
/// simulator"): over 40 built-in workloads on 4 engines, 64 let one worker take up to 1.96 ×
/// the mean requests (18 of 40 above 1.4 ×); 8 gives hit rate 73.83 % against 72.79, TTFT p99
/// median 829 ms against 1,348, at most 1.53 ×. bug-cases.md B9 (8 workers, one shared
/// 2,048-token prompt, ~64 in flight): 64 puts 2.09 × the fair share on one worker, 8 puts
/// 1.34 × (test `b9_a_shared_system_prompt_does_not_pin_one_worker`).
pub const BALANCE_ABS_THRESHOLD: usize = 8;
/// Per-model string tree budget, chars, counted once per tenant holding a node. Source: SMG
/// `--max-tree-size` 67,108,864.
pub const MAX_TREE_SIZE_CHARS: usize = 67_108_864;
/// Per-model token tree budget, tokens, counted once per tenant holding a page. Source: SMG
/// `--max-tree-size` 67,108,864 ("chars or tokens").
pub const MAX_TREE_SIZE_TOKENS: usize = 67_108_864;
/// Token tree page and router block size, tokens. Source: SMG `--block-size` 16.
pub const BLOCK_SIZE: usize = 16;
/// Approximate index of cache_aware. Source: SMG `--cache-index` `tree`.
pub const CACHE_INDEX: CacheIndexKind = CacheIndexKind::Tree;
/// Hash index holder lifetime, seconds. Source: SMG `--cache-ttl-secs` 180.
pub const CACHE_TTL_SECS: u64 = 180;
/// Listen address of the simulated engine in `bench`, `HOST:PORT` (the demo's workers take the
/// following ports: 8101, 8102, ...). Source: seed doc.
pub const ENGINE_LISTEN: &str = "127.0.0.1:8100";
/// Incremental-tokenization prefix cache of one model, shared by all shards, tokens held
/// (4 bytes each). Source:
/// `kvroute_tokenize::incremental::DEFAULT_CACHE_TOKENS` (sized from the WEKA traces).
pub const TOKENIZE_CACHE_TOKENS: usize = kvroute_tokenize::incremental::DEFAULT_CACHE_TOKENS;
/// Event index: how often the writer applies `--kv-indexer-ttl-secs` and
/// `--kv-indexer-max-entries`, ms. Source: SMG (prunes its indexes every 30 s, anchors §2.3).
pub const KV_INDEXER_PRUNE_EVERY_MS: u64 = 30_000;
