//! Every default of kvroute, defined once. `Config::default()`, `#[serde(default)]`, the CLI
//! help and the tests read these constants.

use super::PolicyKind;

/// Gateway listen address.
pub const LISTEN: &str = "127.0.0.1:8000";
/// Largest request body, bytes (32 MiB; SMG's default body limit is of the same order). → 413.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// Largest request head, bytes (64 KiB; nginx's large_client_header_buffers is 4 × 8 KiB). → 431.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Time allowed for one exchange with a worker, s (30 min: long generations stream that long). → 504.
pub const REQUEST_TIMEOUT_SECS: u64 = 1800;
/// Idle upstream keep-alive connections are closed after this, ms: below the 5 s idle timeout of
/// uvicorn-served engines (vLLM, SGLang), so the pool never reuses a connection the engine is
/// closing (bug-cases.md B42).
pub const UPSTREAM_IDLE_TIMEOUT_MS: u64 = 3_000;
/// Time allowed to open a connection to a worker, ms. → 502.
pub const CONNECT_TIMEOUT_MS: u64 = 3_000;
/// Routing policy (anchors.md §2: SMG's default is cache_aware).
pub const POLICY: PolicyKind = PolicyKind::CacheAware;
/// cache_aware: a match ratio above this makes the prefix holders the candidates (SMG
/// `--cache-threshold` 0.3).
pub const CACHE_THRESHOLD: f64 = 0.3;
/// Spill gate, relative part: hot when in-flight > this × mean (SMG `--balance-rel-threshold` 1.5).
pub const BALANCE_REL_THRESHOLD: f64 = 1.5;
/// Spill gate, absolute part: hot when in-flight > mean + this, requests (SMG
/// `--balance-abs-threshold` 64).
pub const BALANCE_ABS_THRESHOLD: usize = 64;
/// Per-model string tree budget, chars, counted once per tenant holding a node (SMG
/// `--max-tree-size` 67,108,864).
pub const MAX_TREE_SIZE_CHARS: usize = 67_108_864;
