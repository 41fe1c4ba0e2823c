//! Every default of kvroute, defined once. `Config::default()`, `#[serde(default)]`, the CLI
//! help and the tests read these constants. Each line gives the unit and where the number
//! comes from ("seed doc" = the project's founding brief; SMG = anchors.md §2.3).

use super::{CacheIndexKind, PolicyKind};

/// Gateway listen address, `HOST:PORT`. Source: seed doc.
pub const LISTEN: &str = "127.0.0.1:8000";
/// Largest request body, bytes (32 MiB); larger → 413. Source: seed doc.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
/// Largest request head, bytes (64 KiB); larger → 431. Source: seed doc.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Smallest free space a client connection offers one socket read, bytes (16 KiB): a chat
/// request's head and body usually arrive in one read, a 200 KB body in 13 or fewer, each
/// scanned for chat prefixes as it comes (`chat_prefix::PrefixScanner`). kvroute's choice.
pub const MIN_READ_BYTES: usize = 16 * 1024;
/// Time allowed for one exchange with a worker, seconds (30 min: long generations stream that
/// long); over → 504. Source: seed doc.
pub const REQUEST_TIMEOUT_SECS: u64 = 1800;
/// Longest silence of a worker once its response body began, s: over it, the worker counts
/// as failed mid-stream (a breaker failure; the stream migrates with `--migration-limit`,
/// else ends with an error event). Without it a wedged engine (a hung collective, a stopped
/// process) holds its streams until `--request-timeout-secs`, 30 min, health checks or not.
/// Source: nginx's `proxy_read_timeout`, 60 s (Envoy's `stream_idle_timeout` is 5 min); an
/// engine streams a token every ~10–200 ms (TPOT), and a preempted request waits for a batch
/// slot, not for a minute.
pub const STREAM_IDLE_TIMEOUT_SECS: u64 = 60;
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
/// Routing policy: `predicted_ttft`, kvroute's own (the lowest predicted time to first
/// token), because it has the shortest TTFT tail of the policies at near the anchors' hit
/// rates (issue 14). `kvroute simulate`, 8 engines, engine load reports every 1 s, on KV
/// events (perf/runs/2026-12-04-busy-alpha, every policy's row there):
///
/// | workload | policy | hit % (bound) | TTFT p99 ms | max/mean |
/// |---|---|---|---|---|
/// | Mooncake ×8 | predicted_ttft | 36.2 (37.4) | 1,772 | 1.15 |
/// | | smg_cache_aware | 36.4 | 2,462 | 1.05 |
/// | | dynamo_kv | 24.5 | 2,048 | 1.08 |
/// | Mooncake ×1 | predicted_ttft | 36.5 | 1,576 | 1.04 |
/// | | smg_cache_aware | 36.5 | 1,691 | 1.03 |
/// | | dynamo_kv | 29.8 | 1,578 | 1.02 |
/// | WEKA, 12 conversations | predicted_ttft | 95.3 (95.5) | 3,856 | 1.73 |
/// | | smg_cache_aware | 90.4 | 17,465 | 2.42 |
/// | | dynamo_kv | 94.2 | 3,856 | 2.30 |
///
/// SMG's `--policy` default is `cache_aware` (anchors.md §2.3), still available by name.
pub const POLICY: PolicyKind = PolicyKind::PredictedTtft;
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
/// cache_aware overlap decay (0 = off). Source: SMG `--overlap-decay` 0 (anchors.md §2.3).
pub const OVERLAP_DECAY: f64 = 0.0;
/// cache_aware selection temperature (0 = top group). Source: SMG `--selection-temperature` 0.
pub const SELECTION_TEMPERATURE: f64 = 0.0;
/// cache_aware KV-pressure trigger on the largest usage, fraction (1 = off). Source: SMG
/// `--overload-token-usage-threshold` 1.0.
pub const OVERLOAD_TOKEN_USAGE_THRESHOLD: f64 = 1.0;
/// cache_aware KV-pressure trigger on the usage spread, fraction (1 = off). Source: SMG
/// `--balance-token-usage-threshold` 1.0.
pub const BALANCE_TOKEN_USAGE_THRESHOLD: f64 = 1.0;
/// kv_aware device-overlap credit, fraction. Source: Dynamo `overlap_score_credit` 1.0
/// (anchors.md §3.2).
pub const OVERLAP_SCORE_CREDIT: f64 = 1.0;
/// kv_aware credit decay. Source: Dynamo `overlap_score_credit_decay` 0.
pub const OVERLAP_SCORE_CREDIT_DECAY: f64 = 0.0;
/// kv_aware prefill weight. Source: Dynamo `prefill_load_scale` 1.0.
pub const PREFILL_LOAD_SCALE: f64 = 1.0;
/// kv_aware cost per active request, blocks. Source: Dynamo `decode_active_request_weight` 0.
pub const DECODE_ACTIVE_REQUEST_WEIGHT: f64 = 0.0;
/// kv_aware credit of a CPU-tier block. Source: Dynamo `host_cache_hit_weight` 0.75.
pub const HOST_CACHE_HIT_WEIGHT: f64 = 0.75;
/// kv_aware credit of a disk-tier block. Source: Dynamo `disk_cache_hit_weight` 0.25.
pub const DISK_CACHE_HIT_WEIGHT: f64 = 0.25;
/// kv_aware softmax temperature (0 = argmin). Source: Dynamo `router_temperature` 0.
pub const ROUTER_TEMPERATURE: f64 = 0.0;
/// prefix_hash key length, tokens: 16 blocks of 16, long enough to cover a chat template's
/// head and a system prompt's start, short enough that turns of one conversation share it.
/// kvroute's choice.
pub const PREFIX_HASH_TOKENS: usize = 256;
/// prefix_hash / consistent_hash bounded load: a worker is full above `c × mean + 1`
/// requests, c = 1.25. Source: Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
/// Bounded Loads" (SODA 2018), the c used in HAProxy's `hash-balance-factor 125`.
pub const HASH_LOAD_FACTOR: f64 = 1.25;
/// predicted_ttft weight α of a continuation's own prefill (1 = pure predicted TTFT; above 1
/// a recomputed history pays for the capacity it takes from later requests, and the tail term
/// alone moves a conversation off a worker whose wait would put it in the tail). Measured with
/// `kvroute simulate --sweep` on Mooncake ×8 (8 engines, 365,600 blocks, load reports every
/// 1 s), α → hit %, TTFT p99 ms (decode margin 0.25): 3 → 33.6, 1,782; 50 → 36.3, 1,879; 200 →
/// 36.5, 1,946 (SMG's preset 36.4, 2,462). α 50 is the least that reaches the anchors' hit
/// rate; seed doc 003's herding test passes at every α since a continuation counts only the
/// prompt beyond the head concurrent requests share (coefficient of variation 0.00 at 50;
/// before that rule α 50 piled those sessions on one engine, 1.73;
/// perf/runs/2026-12-03-shared-head). This is α while every eligible worker is prefilling;
/// with a share `busy` of them prefilling it is `1 + 49 · busy` (`predicted_ttft::Context`):
/// on an idle fleet a recomputed history delays no one but itself. α 50 always → scaled
/// (perf/runs/2026-12-04-busy-alpha): built-in workload, 4 engines, 10 seeds: hit 68.3 →
/// 70.8 %, TTFT p99 median 1,053 → 507 ms, worst 4,067 → 1,923 (dynamo_kv 54.1 %, 563 ms);
/// Mooncake ×8: 36.4 → 36.2 %, 1,811 → 1,772 ms; ×1: 36.7 → 36.5 %, 1,621 → 1,576 ms; WEKA,
/// 10 seeds: the three seeds whose p99 was 6.8–10.5 s (two long conversations sharing one
/// worker's memory, which α 50 kept together) all at 3.7 s.
pub const TTFT_PREFILL_WEIGHT: f64 = 50.0;
/// predicted_ttft weight α of a miss's own prefill: 1, pure predicted TTFT (a miss keeps no
/// cache; it goes where it starts soonest).
pub const TTFT_MISS_PREFILL_WEIGHT: f64 = 1.0;
/// predicted_ttft: a request is a continuation when some eligible worker holds strictly more
/// than this share of its prompt, 0–1. Source: SMG's `--cache-threshold` 0.3 (anchors.md
/// §2.3), which gates affinity the same way.
pub const TTFT_AFFINITY_THRESHOLD: f64 = 0.3;
/// predicted_ttft τ of the tail term `(wait + own)² / τ`, ms: a predicted TTFT of τ costs τ
/// more, one of 3τ costs 9τ more, so short waits keep affinity and long ones move. With the
/// affinity threshold and the resident term, Mooncake ×8 (load reports every 1 s): τ 0 →
/// 33.1 % / 1,942 ms; 1 s → 32.4 % / 1,737 ms; ×1: 35.3 / 1,586 → 35.0 / 1,542
/// (perf/runs/2026-12-03-predicted-ttft).
pub const TTFT_TAIL_MS: f64 = 1_000.0;
/// predicted_ttft weight of evicted blocks' prefill time. Measured at α = 3 without the tail
/// term (Mooncake ×8, load reports every 1 s): 0 → 34.6 %, 1,920 ms and max/mean 1.60; 1.5 →
/// 35.2 %, 1,911 ms, 1.29; 3 → 34.8 %, 2,007 ms (perf/runs/2026-12-01-policies).
pub const TTFT_EVICT_WEIGHT: f64 = 1.5;
/// predicted_ttft charge when a request's whole prompt (its cached blocks included) does not
/// fit in a worker's free KV memory, ms: 10 s, above any
/// queue wait the trees' workloads produce, so a worker that would preempt is chosen last.
/// kvroute's choice.
pub const TTFT_NO_FIT_MS: f64 = 10_000.0;
/// predicted_ttft weight of active decode blocks (1 = Dynamo's equivalence of a decode block
/// and a prefill block, anchors.md §3.1). Seed doc 003's herding test needs ≥ 0.5 (0.25 leaves
/// a coefficient of variation of 0.27 over 4 engines; 0.5 passes under 0.1); on Mooncake ×8
/// at α 3, 0.25 → 34.3 %, 1,883 ms; 1 → 31.2 %, 1,959 ms (the decode load spreads sessions off
/// their prefix); 0.5 is the least that stops herding.
pub const TTFT_DECODE_WEIGHT: f64 = 0.5;
/// predicted_ttft: a continuation is not charged a worker's decode blocks up to (1 + this) ×
/// the eligible workers' mean (a miss is charged every block, Dynamo's form); −1 charges every
/// block always. At α 50, Mooncake ×8: −1 → 36.3 %, TTFT p99 2,045 ms; 0.25 → 36.3 %,
/// 1,879 ms (perf/runs/2026-12-03-shared-head). Charging misses only above the margin too
/// spread seed doc 003's first turns unevenly (coefficient of variation 0.58).
pub const TTFT_DECODE_MARGIN: f64 = 0.25;
/// predicted_ttft weight, for a miss, of the share of a worker's KV memory that other
/// sessions' cache holds (cached blocks / capacity, both known only with events and engine
/// reports): a new conversation placed there evicts their next turns. WEKA's 12
/// conversations (8 engines, capacity 1.25× the largest request, load reports every 1 s): 0 →
/// 95.0 % / 4,082 ms / max/mean 1.86; 1 → 95.4 / 3,856 / 1.58
/// (perf/runs/2026-12-03-predicted-ttft).
pub const TTFT_RESIDENT_WEIGHT: f64 = 1.0;
/// predicted_ttft: a worker's own prefill is predicted with its learned scale this many
/// standard deviations of the fit below the estimate (its lower confidence bound: 0.1 below
/// the prior before any sample). Without it a worker whose curve is still the prior is never
/// tried while measured ones look slightly faster, and a 2× faster engine is never learned
/// (test `two_fast_engines_are_learned_and_get_more_work`: engine 1 served 0 of 800
/// requests). Mooncake ×8 (load reports every 1 s): 0 → 32.4 % / 1,737 ms; 0.1 → 32.8 /
/// 1,732; 0.25 → 32.5 / 1,780; 0.5 → 32.4 / 1,881 (perf/runs/2026-12-03-predicted-ttft).
pub const TTFT_EXPLORE: f64 = 0.1;
/// Prompt chars per token, for text requests. Source: OpenAI's rule of thumb for English ("1
/// token ≈ 4 characters", help.openai.com "What are tokens").
pub const CHARS_PER_TOKEN: f64 = 4.0;
/// Worker slots up to which a decision snapshots and scores every worker. Above it kvroute's
/// own load and cost policies score a candidate set ([`CANDIDATE_HOLDERS`] +
/// [`CANDIDATE_SAMPLE`]), so a decision costs O(candidates). 128: a whole decision visits
/// ~50–70 ns per worker (snapshot and policy, perf/runs/2026-12-02-fleet-2), while the
/// candidate path costs ~6–10 µs whatever the fleet (the event index's query and ~32
/// candidates), so they cross near 128 workers. Measured at 256 workers (`kvroute bench
/// fleet`, 6 interleaved rounds, perf/runs/2026-12-06-full-scan): candidates instead of the
/// whole fleet take the decide stage from 17.0 to 6.2 µs p50 at 8k tokens and from 22.1 to
/// 10.1 at 32k; on the simulator, candidate sets keep a 64-engine fleet's hit rate and TTFT
/// (perf/runs/2026-12-06-candidate-size), and at 256 engines this threshold against 256
/// gives hit 33.9 vs 33.7 %, TTFT p99 1.70–1.76 vs 1.75 s (perf/runs/2026-12-06-full-scan).
pub const FULL_SCAN_WORKERS: usize = 128;
/// Deepest prefix holders a candidate set takes from each index answer: 16, `kvroute bench
/// fleet`'s workers per shared document, so every holder of a document replicated that
/// widely is scored. Measured: `kvroute simulate` on the Mooncake trace with 64 engines
/// forced onto candidate sets (`--knob full_scan_workers=8`), time scales 64 and 128, keeps
/// the whole fleet's hit rate and TTFT p99 for every holders × sample in {8, 16, 32}²
/// (35.6–35.8 % vs 35.6 %, 1,668–1,759 vs 1,759 ms at ×64; 32.4–33.0 % vs 32.7 %, 6.5–7.6 vs
/// 7.1 s at ×128), and the decision's cost grows with the set
/// (perf/runs/2026-12-06-candidate-size).
pub const CANDIDATE_HOLDERS: usize = 16;
/// Workers a candidate set draws at random (power of d choices, d = 8: the least loaded
/// draw is in the lightest ~11 % of the fleet in expectation; `policy::candidates`).
/// Measured with [`CANDIDATE_HOLDERS`], 8 tie-break seeds each, `kvroute simulate` on the
/// Mooncake trace with 64 engines forced onto candidate sets (mean hit %, TTFT p99 ms and its
/// standard deviation over seeds): at ×64, 4 / 8 / 16 give 35.61 / 35.65 / 35.60 %, 1,711 (26)
/// / 1,702 (24) / 1,723 (20); at ×128, 32.72 / 32.77 / 32.70 %, 6,789 (182) / 6,826 (196) /
/// 7,075 (129): no loss below 16. The decide stage of `kvroute bench fleet` at 4,096 workers
/// costs 0.84× (32k tokens) and 0.85× (8k) at 8 against 16, medians of 5 interleaved rounds
/// (perf/runs/2026-12-07-candidate-sample).
pub const CANDIDATE_SAMPLE: usize = 8;
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

// ---- Health, failover and limits (issue 13) ----

/// Period of the gateway's index writer thread (`kv-index`,
/// [`crate::policy::Router::catch_up`]), ms: a record published on one copy of an index is
/// replayed on the other within this long, off the shards. A conversation's next turn comes
/// after the response to this one (seconds), so its record finds the copies caught up; a
/// record within the period of another replays that one itself (as without the thread).
/// Waking the thread per record instead (`Thread::unpark`) cost a shard 1–5 µs p50 per
/// record on this VM (a futex wake); polling 1,000 times a second costs ~nothing.
pub const INDEX_WRITER_PERIOD_MS: u64 = 1;

/// Interval of active health checks (`GET /health` of every worker), s. SMG checks every 60 s
/// (operations.md §1); 10 s is Kubernetes' default probe period, so a restarted worker is
/// back in rotation within ~20 s (2 passed checks) instead of 2 min. Request failures open
/// the breaker much sooner than that anyway.
pub const HEALTH_CHECK_INTERVAL_SECS: u64 = 10;
/// Interval of the health checks of an unhealthy worker, ms (at most the interval above).
/// Source: Envoy's `unhealthy_interval` (a separate, shorter period for hosts out of
/// rotation); 1 s is Kubernetes' shortest probe period. An engine that comes up a second
/// after the router (the usual order on a node) is in rotation ~2 s later (2 passed checks)
/// instead of ~20 s (measured by a newcomer's trial: 20 s of 503s), for one refused connect
/// a second per worker that is down.
pub const HEALTH_CHECK_UNHEALTHY_INTERVAL_MS: u64 = 1_000;
/// Time allowed for one health check (connect + answer), s. Source: SMG 5 s.
pub const HEALTH_CHECK_TIMEOUT_SECS: u64 = 5;
/// Failed checks in a row that make a worker unhealthy. Source: SMG 3.
pub const HEALTH_FAILURE_THRESHOLD: u32 = 3;
/// Passed checks in a row that make an unhealthy worker healthy again. Source: SMG 2.
pub const HEALTH_SUCCESS_THRESHOLD: u32 = 2;
/// Consecutive failed attempts that open a worker's circuit breaker.
///
/// Not SMG's 10: with prefix affinity a dead holder keeps being chosen (bug-cases.md B43), and
/// every attempt on it costs a connect (up to `connect_timeout_ms`) before the retry; nginx
/// takes a server out after 1 (`max_fails=1`). 3 in a row with no success between is rare for
/// a live engine (a 503 burst while it restarts is what it should catch).
pub const BREAKER_FAILURE_THRESHOLD: u32 = 3;
/// Failures further apart than this do not add up, s. Source: SMG ("within 120 s").
pub const BREAKER_WINDOW_SECS: u64 = 120;
/// Time an open breaker keeps its worker out before half-open probes, s. Source: SMG 60 s. A
/// worker that passes health checks again after being unhealthy closes its breaker at once.
pub const BREAKER_OPEN_SECS: u64 = 60;
/// Half-open successes that close the breaker. Source: SMG 3.
pub const BREAKER_SUCCESS_THRESHOLD: u32 = 3;
/// Retries of one request (attempts = 1 + this), each on a worker not tried yet for it.
/// SMG allows 5; beyond 3 failed workers in a row the fleet is down rather than one worker,
/// and more attempts only delay the client's error.
pub const RETRY_MAX: u32 = 3;
/// Wait before the first retry, ms. Source: SMG 50 ms.
pub const RETRY_INITIAL_BACKOFF_MS: u64 = 50;
/// Growth of the wait per retry. Source: SMG ×1.5.
pub const RETRY_BACKOFF_MULTIPLIER: f64 = 1.5;
/// Largest wait between retries, ms. SMG caps at 30 s; a retry here goes to *another* worker,
/// so waiting for the failed one to recover buys nothing: 1 s.
pub const RETRY_MAX_BACKOFF_MS: u64 = 1_000;
/// Relative jitter of each wait, ±. Source: SMG ±0.2.
pub const RETRY_JITTER: f64 = 0.2;
/// Retries earned per request in the fleet-wide retry budget (Envoy's retry budget default is
/// 20 % of active requests): retries add at most ~20 % load during an outage.
pub const RETRY_BUDGET_RATIO: f64 = 0.2;
/// Retries the budget may bank (so a quiet gateway can still retry a burst), retries.
pub const RETRY_BUDGET_CAP: u32 = 100;
/// No new attempt of a request starts later than this after it arrived, s: a retry past it
/// would outlive most clients' own timeouts (the OpenAI SDK's is 600 s, curl has none).
pub const RETRY_DEADLINE_SECS: u64 = 60;
/// Time allowed for an attempt, from when it starts (connecting or taking a pooled
/// connection, then sending the request) to the worker's first response body byte (or the
/// end of a head with no body), s; over → the attempt fails (retried elsewhere, else 504). It must cover queueing plus the prefill of a
/// long prompt: a 128k-token prompt prefills in ~25 s on one H100 for a 70B model
/// (~5k tokens/s, engine-model.md §3's rates), several times that behind a queue. 120 s;
/// a stopped engine is also caught by health checks within ~3 × the check interval.
pub const FIRST_BYTE_TIMEOUT_SECS: u64 = 120;
/// How long an attempt waits on its worker before it starts watching the client's connection
/// for a departure (bug-cases.md B41: a client that leaves cancels the request), ms. Watching
/// costs two io_uring operations per request (a poll, then its cancellation when the worker
/// answers first); a worker that answers within this never pays them, and a client that
/// leaves is still noticed this much later at most, which is noise against a prefill worth
/// cancelling (engine-model.md §3: a 2k-token prefill is ~0.4 s). The worker's health is
/// watched from the same moment on (a stopped engine is caught by the next health check,
/// seconds later, anyway). 10 ms. Measured with
/// `perf stat -e io_uring:io_uring_submit_req` on `perf/compare.sh`'s round-robin server:
/// perf/runs/2026-12-02-proxy-path.
pub const CLIENT_WATCH_DELAY_MS: u64 = 10;
/// Mid-stream migrations of one generation to another worker; 0 = off. Source: Dynamo's
/// `--migration-limit` default 0 (operations.md §2).
pub const MIGRATION_LIMIT: u32 = 0;
/// After SIGTERM/SIGINT, in-flight exchanges may finish for this long, s, then the process
/// exits. Kubernetes kills a pod 30 s after SIGTERM by default (terminationGracePeriodSeconds),
/// so a longer grace is cut there anyway. SMG uses 180 s.
pub const SHUTDOWN_TIMEOUT_SECS: u64 = 30;
/// Admin API listen address, `HOST:PORT` (loopback; no key is needed there). Source: seed doc.
pub const ADMIN_LISTEN: &str = "127.0.0.1:8001";
/// Time allowed for a client's request head, s (slowloris); over → 408. Source: nginx
/// `client_header_timeout` 60 s.
pub const CLIENT_HEADER_TIMEOUT_SECS: u64 = 60;
/// Time allowed between two reads of a request body, s; over → 408. Source: nginx
/// `client_body_timeout` 60 s.
pub const CLIENT_BODY_TIMEOUT_SECS: u64 = 60;
/// An idle client keep-alive connection closes after this, s. Source: nginx
/// `keepalive_timeout` 75 s.
pub const CLIENT_IDLE_TIMEOUT_SECS: u64 = 75;
/// Client connections one shard serves at once; more are answered 503 and closed. Each
/// streaming request holds one client and one worker connection; 4,096 per core stays well
/// under the 1,048,576 open files a systemd service gets by default.
pub const MAX_CONNECTIONS_PER_SHARD: usize = 4_096;
/// DNS discovery (`--worker-dns`): every name is looked up again this often, s. 30 s is the
/// TTL Kubernetes' cluster DNS gives its answers (the `kubernetes` plugin's `ttl 30` and
/// `cache 30` of the Corefile kubeadm installs; kubernetes/kubernetes#76238 raised CoreDNS'
/// 5 s to kube-dns' 30 s): looking sooner mostly re-reads the cluster DNS cache. A pod that
/// leaves is drained by its failed requests and health checks long before that anyway.
pub const DNS_REFRESH_SECS: u64 = 30;
/// DNS discovery: most addresses taken from one name's answer, workers; the rest of a longer
/// answer is dropped (the lowest addresses are kept, so the choice does not change with the
/// order a DNS server rotates its records in), logged and counted
/// (`kvroute_discovery_truncations_total`). 1,024 is the fleet kvroute's event index is
/// measured at (README, `kvroute bench index`), and a bound on what one bad zone can add.
pub const DNS_MAX_ADDRESSES: usize = 1024;
/// Replica sync (`--nats`): the subject prefix; messages go on `kvroute.sync`. The
/// product's name, as Dynamo prefixes its subjects with its namespace.
pub const NATS_SUBJECT_PREFIX: &str = "kvroute";
/// Replica sync: messages the shards may queue for the NATS thread; more are dropped and
/// counted (`kvroute_sync_dropped_total{reason="queue_full"}`), never waited on. 65,536
/// is ~1 s of a 2-core router at 20k req/s sending 3 messages per request (routed, first
/// token, done): a slow bus costs at most that much memory (~100 bytes a message).
pub const SYNC_QUEUE: usize = 65_536;
/// DNS discovery: time allowed for one query, s, tried twice per nameserver: the `timeout:5`
/// and `attempts:2` defaults of resolv.conf(5), which hickory-resolver follows.
pub const DNS_TIMEOUT_SECS: u64 = 5;
