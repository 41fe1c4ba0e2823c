//! [`Config`]: every setting of `kvroute serve`, from TOML and flags, validated once.
//!
//! Raw values (TOML or flags laid over it) become a checked `Config` in one
//! [`Config::validate`] (ripgrep's low-args → high-args). Defaults live in [`defaults`].

pub mod defaults;

use crate::CoreError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How the gateway picks a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each eligible worker in turn.
    RoundRobin,
    /// A uniformly random eligible worker.
    Random,
    /// Fewest in-flight requests; ties broken at random (never by list order: bug B1).
    LeastRequest,
    /// Two distinct random eligible workers, the lower expected wait (anchors.md §2.5).
    PowerOfTwo,
    /// Lowest expected wait: SMG's `least_load` scorer (anchors.md §2.5).
    LeastLoad,
    /// Prefix affinity with SMG's spill gate (anchors.md §2.2), kvroute's margins.
    CacheAware,
    /// Dynamo's blended cost in KV blocks (anchors.md §3.1).
    KvAware,
    /// A hash of the prompt's first tokens on a consistent-hash ring, bounded load.
    PrefixHash,
    /// Session affinity: `x-session-id` / `x-kvroute-routing-key` on a consistent-hash ring.
    ConsistentHash,
    /// Maximum overlap, no load term: the herding yardstick.
    PureAffinity,
    /// Lowest predicted time to first token, ms: kvroute's own.
    PredictedTtft,
    /// Preset: cache_aware with SMG v1.11's defaults exactly (token tree).
    SmgCacheAware,
    /// Preset: kv_aware with Dynamo's defaults exactly (KV events).
    DynamoKv,
}

impl PolicyKind {
    /// Every policy and preset, in the order the simulator lists them.
    pub const ALL: [PolicyKind; 13] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastRequest,
        PolicyKind::PowerOfTwo,
        PolicyKind::LeastLoad,
        PolicyKind::CacheAware,
        PolicyKind::KvAware,
        PolicyKind::PrefixHash,
        PolicyKind::ConsistentHash,
        PolicyKind::PureAffinity,
        PolicyKind::PredictedTtft,
        PolicyKind::SmgCacheAware,
        PolicyKind::DynamoKv,
    ];

    /// The name used by `--policy`, TOML and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastRequest => "least_request",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::KvAware => "kv_aware",
            PolicyKind::PrefixHash => "prefix_hash",
            PolicyKind::ConsistentHash => "consistent_hash",
            PolicyKind::PureAffinity => "pure_affinity",
            PolicyKind::PredictedTtft => "predicted_ttft",
            PolicyKind::SmgCacheAware => "smg_cache_aware",
            PolicyKind::DynamoKv => "dynamo_kv",
        }
    }

    /// True for the policies that keep approximate indexes of their own decisions (the
    /// trees, the hash index): [`crate::policy::Router::record`] writes for these only.
    pub fn records(self) -> bool {
        matches!(
            self,
            PolicyKind::CacheAware
                | PolicyKind::KvAware
                | PolicyKind::PureAffinity
                | PolicyKind::PredictedTtft
                | PolicyKind::SmgCacheAware
                | PolicyKind::DynamoKv
        )
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = CoreError;

    /// Parses a name of [`PolicyKind::as_str`] (`-` accepted for `_`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.trim().replace('-', "_");
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.as_str() == norm)
            .ok_or_else(|| CoreError::UnknownPolicy(s.to_string()))
    }
}

/// The knobs of the policies beyond the spill gate, each defaulting to its constant in
/// [`defaults`] (whose docs give the source: SMG for cache_aware's, Dynamo for kv_aware's,
/// kvroute's measurements for predicted_ttft's). The anchor presets (`smg_cache_aware`,
/// `dynamo_kv`) ignore them and use the anchors' own defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyKnobs {
    /// cache_aware: a candidate's score is divided by `1 + d·x`, x = its excess waiting
    /// prefill blocks per request block ([`defaults::OVERLAP_DECAY`]); ≥ 0.
    pub overlap_decay: f64,
    /// cache_aware: softmax temperature over min-max-normalised candidate scores; 0 = keep
    /// the top group ([`defaults::SELECTION_TEMPERATURE`]); ≥ 0.
    pub selection_temperature: f64,
    /// cache_aware: skip affinity when the largest engine KV usage exceeds this, 0–1; 1 = off
    /// ([`defaults::OVERLOAD_TOKEN_USAGE_THRESHOLD`]).
    pub overload_token_usage_threshold: f64,
    /// cache_aware: skip affinity when (max − min) engine KV usage exceeds this, 0–1; 1 = off
    /// ([`defaults::BALANCE_TOKEN_USAGE_THRESHOLD`]).
    pub balance_token_usage_threshold: f64,
    /// kv_aware: share of overlapping device blocks credited, 0–1
    /// ([`defaults::OVERLAP_SCORE_CREDIT`]).
    pub overlap_score_credit: f64,
    /// kv_aware: credit decay per request-equivalent of excess prefill, ≥ 0
    /// ([`defaults::OVERLAP_SCORE_CREDIT_DECAY`]).
    pub overlap_score_credit_decay: f64,
    /// kv_aware: weight of the prefill term, ≥ 0 ([`defaults::PREFILL_LOAD_SCALE`]).
    pub prefill_load_scale: f64,
    /// kv_aware: cost per active request, blocks, ≥ 0
    /// ([`defaults::DECODE_ACTIVE_REQUEST_WEIGHT`]).
    pub decode_active_request_weight: f64,
    /// kv_aware: credit of a CPU-offloaded overlapping block, 0–1
    /// ([`defaults::HOST_CACHE_HIT_WEIGHT`]).
    pub host_cache_hit_weight: f64,
    /// kv_aware: credit of a disk-offloaded overlapping block, 0–1
    /// ([`defaults::DISK_CACHE_HIT_WEIGHT`]).
    pub disk_cache_hit_weight: f64,
    /// kv_aware: softmax temperature over costs; 0 = argmin ([`defaults::ROUTER_TEMPERATURE`]).
    pub router_temperature: f64,
    /// kv_aware: the simple form's weight (seed doc's `--kv-overlap-weight`, Dynamo's
    /// deprecated `overlap_score_weight`): when set it replaces `prefill_load_scale`, and
    /// replaces `overlap_score_credit` too when it is 0 (anchors.md §3.2). Unset by default.
    pub kv_overlap_weight: Option<f64>,
    /// prefix_hash: leading tokens hashed (chars: 4 per token) ([`defaults::PREFIX_HASH_TOKENS`]).
    pub prefix_hash_tokens: usize,
    /// prefix_hash and consistent_hash: a worker above this × the mean load (+1) is passed
    /// over on the ring ([`defaults::HASH_LOAD_FACTOR`]); ≥ 1.
    pub hash_load_factor: f64,
    /// predicted_ttft: weight α of a continuation's own prefill time against the wait while
    /// every eligible worker is prefilling, scaled towards `ttft_miss_prefill_weight` as
    /// fewer are ([`defaults::TTFT_PREFILL_WEIGHT`]); ≥ 0.
    pub ttft_prefill_weight: f64,
    /// predicted_ttft: weight α of a miss's own prefill time
    /// ([`defaults::TTFT_MISS_PREFILL_WEIGHT`]); ≥ 0.
    pub ttft_miss_prefill_weight: f64,
    /// predicted_ttft: share of the prompt some eligible worker must hold (strictly more) for
    /// the request to be a continuation, 0–1 ([`defaults::TTFT_AFFINITY_THRESHOLD`]).
    pub ttft_affinity_threshold: f64,
    /// predicted_ttft: τ of the tail term `TTFT² / τ`, ms; 0 = off
    /// ([`defaults::TTFT_TAIL_MS`]); ≥ 0.
    pub ttft_tail_ms: f64,
    /// predicted_ttft: weight of the prefill time of other sessions' cached blocks this
    /// request would evict ([`defaults::TTFT_EVICT_WEIGHT`]); ≥ 0.
    pub ttft_evict_weight: f64,
    /// predicted_ttft: charge when the request's new blocks do not fit in the worker's free
    /// KV memory, ms ([`defaults::TTFT_NO_FIT_MS`]); ≥ 0.
    pub ttft_no_fit_ms: f64,
    /// predicted_ttft: weight of the worker's active decode blocks, each charged one block's
    /// prefill ms ([`defaults::TTFT_DECODE_WEIGHT`]); ≥ 0.
    pub ttft_decode_weight: f64,
    /// predicted_ttft: a continuation is not charged decode blocks up to `(1 + margin) ×` the
    /// eligible workers' mean (a miss is charged every block); −1 charges every block always
    /// ([`defaults::TTFT_DECODE_MARGIN`]); ≥ −1.
    pub ttft_decode_margin: f64,
    /// predicted_ttft: weight, for a miss, of the share of a worker's KV memory other
    /// sessions' cache holds ([`defaults::TTFT_RESIDENT_WEIGHT`]); ≥ 0.
    pub ttft_resident_weight: f64,
    /// predicted_ttft: standard deviations of a worker's learned prefill scale below the fit
    /// that its own prefill is predicted at ([`defaults::TTFT_EXPLORE`]); ≥ 0.
    pub ttft_explore: f64,
    /// Prompt chars per token, for text requests' token estimates
    /// ([`defaults::CHARS_PER_TOKEN`]); > 0.
    pub chars_per_token: f64,
    /// Fleets of up to this many worker slots are snapshot and scored whole; above it,
    /// kvroute's own load and cost policies score a candidate set
    /// ([`crate::policy::Router::decide_on`], [`defaults::FULL_SCAN_WORKERS`]).
    pub full_scan_workers: usize,
    /// Candidate set: the deepest prefix holders taken from each index answer
    /// ([`defaults::CANDIDATE_HOLDERS`]).
    pub candidate_holders: usize,
    /// Candidate set: workers drawn at random ([`defaults::CANDIDATE_SAMPLE`]); ≥ 2.
    pub candidate_sample: usize,
}

impl Default for PolicyKnobs {
    fn default() -> Self {
        Self {
            overlap_decay: defaults::OVERLAP_DECAY,
            selection_temperature: defaults::SELECTION_TEMPERATURE,
            overload_token_usage_threshold: defaults::OVERLOAD_TOKEN_USAGE_THRESHOLD,
            balance_token_usage_threshold: defaults::BALANCE_TOKEN_USAGE_THRESHOLD,
            overlap_score_credit: defaults::OVERLAP_SCORE_CREDIT,
            overlap_score_credit_decay: defaults::OVERLAP_SCORE_CREDIT_DECAY,
            prefill_load_scale: defaults::PREFILL_LOAD_SCALE,
            decode_active_request_weight: defaults::DECODE_ACTIVE_REQUEST_WEIGHT,
            host_cache_hit_weight: defaults::HOST_CACHE_HIT_WEIGHT,
            disk_cache_hit_weight: defaults::DISK_CACHE_HIT_WEIGHT,
            router_temperature: defaults::ROUTER_TEMPERATURE,
            kv_overlap_weight: None,
            prefix_hash_tokens: defaults::PREFIX_HASH_TOKENS,
            hash_load_factor: defaults::HASH_LOAD_FACTOR,
            ttft_prefill_weight: defaults::TTFT_PREFILL_WEIGHT,
            ttft_miss_prefill_weight: defaults::TTFT_MISS_PREFILL_WEIGHT,
            ttft_affinity_threshold: defaults::TTFT_AFFINITY_THRESHOLD,
            ttft_tail_ms: defaults::TTFT_TAIL_MS,
            ttft_evict_weight: defaults::TTFT_EVICT_WEIGHT,
            ttft_no_fit_ms: defaults::TTFT_NO_FIT_MS,
            ttft_decode_weight: defaults::TTFT_DECODE_WEIGHT,
            ttft_decode_margin: defaults::TTFT_DECODE_MARGIN,
            ttft_resident_weight: defaults::TTFT_RESIDENT_WEIGHT,
            ttft_explore: defaults::TTFT_EXPLORE,
            chars_per_token: defaults::CHARS_PER_TOKEN,
            full_scan_workers: defaults::FULL_SCAN_WORKERS,
            candidate_holders: defaults::CANDIDATE_HOLDERS,
            candidate_sample: defaults::CANDIDATE_SAMPLE,
        }
    }
}

impl PolicyKnobs {
    /// The first knob out of range: `(name, value, rule)`.
    pub fn invalid(&self) -> Option<(&'static str, f64, &'static str)> {
        let k = self;
        let unit = |v: f64| (0.0..=1.0).contains(&v);
        let nonneg = |v: f64| v.is_finite() && v >= 0.0;
        [
            (
                "overlap_decay",
                k.overlap_decay,
                nonneg(k.overlap_decay),
                ">= 0",
            ),
            (
                "selection_temperature",
                k.selection_temperature,
                nonneg(k.selection_temperature),
                ">= 0",
            ),
            (
                "overload_token_usage_threshold",
                k.overload_token_usage_threshold,
                unit(k.overload_token_usage_threshold),
                "in [0, 1]",
            ),
            (
                "balance_token_usage_threshold",
                k.balance_token_usage_threshold,
                unit(k.balance_token_usage_threshold),
                "in [0, 1]",
            ),
            (
                "overlap_score_credit",
                k.overlap_score_credit,
                unit(k.overlap_score_credit),
                "in [0, 1]",
            ),
            (
                "overlap_score_credit_decay",
                k.overlap_score_credit_decay,
                nonneg(k.overlap_score_credit_decay),
                ">= 0",
            ),
            (
                "prefill_load_scale",
                k.prefill_load_scale,
                nonneg(k.prefill_load_scale),
                ">= 0",
            ),
            (
                "decode_active_request_weight",
                k.decode_active_request_weight,
                nonneg(k.decode_active_request_weight),
                ">= 0",
            ),
            (
                "host_cache_hit_weight",
                k.host_cache_hit_weight,
                unit(k.host_cache_hit_weight),
                "in [0, 1]",
            ),
            (
                "disk_cache_hit_weight",
                k.disk_cache_hit_weight,
                unit(k.disk_cache_hit_weight),
                "in [0, 1]",
            ),
            (
                "router_temperature",
                k.router_temperature,
                nonneg(k.router_temperature),
                ">= 0",
            ),
            (
                "kv_overlap_weight",
                k.kv_overlap_weight.unwrap_or(0.0),
                nonneg(k.kv_overlap_weight.unwrap_or(0.0)),
                ">= 0",
            ),
            (
                "prefix_hash_tokens",
                k.prefix_hash_tokens as f64,
                k.prefix_hash_tokens > 0,
                "> 0",
            ),
            (
                "hash_load_factor",
                k.hash_load_factor,
                k.hash_load_factor.is_finite() && k.hash_load_factor >= 1.0,
                ">= 1",
            ),
            (
                "ttft_prefill_weight",
                k.ttft_prefill_weight,
                nonneg(k.ttft_prefill_weight),
                ">= 0",
            ),
            (
                "ttft_miss_prefill_weight",
                k.ttft_miss_prefill_weight,
                nonneg(k.ttft_miss_prefill_weight),
                ">= 0",
            ),
            (
                "ttft_affinity_threshold",
                k.ttft_affinity_threshold,
                unit(k.ttft_affinity_threshold),
                "in [0, 1]",
            ),
            (
                "ttft_tail_ms",
                k.ttft_tail_ms,
                nonneg(k.ttft_tail_ms),
                ">= 0",
            ),
            (
                "ttft_decode_margin",
                k.ttft_decode_margin,
                k.ttft_decode_margin.is_finite() && k.ttft_decode_margin >= -1.0,
                ">= -1",
            ),
            (
                "ttft_resident_weight",
                k.ttft_resident_weight,
                nonneg(k.ttft_resident_weight),
                ">= 0",
            ),
            (
                "ttft_explore",
                k.ttft_explore,
                nonneg(k.ttft_explore),
                ">= 0",
            ),
            (
                "ttft_evict_weight",
                k.ttft_evict_weight,
                nonneg(k.ttft_evict_weight),
                ">= 0",
            ),
            (
                "ttft_no_fit_ms",
                k.ttft_no_fit_ms,
                nonneg(k.ttft_no_fit_ms),
                ">= 0",
            ),
            (
                "ttft_decode_weight",
                k.ttft_decode_weight,
                nonneg(k.ttft_decode_weight),
                ">= 0",
            ),
            (
                "chars_per_token",
                k.chars_per_token,
                k.chars_per_token.is_finite() && k.chars_per_token > 0.0,
                "> 0",
            ),
            (
                "candidate_sample",
                k.candidate_sample as f64,
                k.candidate_sample >= 2,
                ">= 2",
            ),
        ]
        .into_iter()
        .find(|e| !e.2)
        .map(|(n, v, _, r)| (n, v, r))
    }

    /// Sets the knob named `name` (a field name, `-` accepted for `_`) to `value`, a TOML value
    /// (`0.5`, `2`), checked as [`Config::validate`] checks it: the `--knob NAME=VALUE` flag
    /// of `serve`, `demo` and `simulate`.
    ///
    /// # Errors
    /// [`CoreError::ConfigSyntax`] for an unknown name or a value of the wrong type,
    /// [`CoreError::ConfigValue`] for a value out of range.
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), CoreError> {
        let name = name.trim().replace('-', "_");
        let mut table = toml::Table::try_from(*self).expect("knobs serialize to a table");
        let v: toml::Table = toml::from_str(&format!("v = {value}"))?;
        table.insert(name, v["v"].clone());
        let next: PolicyKnobs = table.try_into()?;
        if let Some((field, value, expected)) = next.invalid() {
            return Err(CoreError::ConfigValue {
                field,
                value,
                expected,
            });
        }
        *self = next;
        Ok(())
    }

    /// Applies `NAME=VALUE` pairs in order ([`PolicyKnobs::set`]).
    ///
    /// # Errors
    /// As [`PolicyKnobs::set`]; a pair without `=` is [`CoreError::BadKnob`].
    pub fn set_all(&mut self, pairs: &[String]) -> Result<(), CoreError> {
        for p in pairs {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| CoreError::BadKnob(p.clone()))?;
            self.set(k, v)?;
        }
        Ok(())
    }

    /// Dynamo's deprecation rule for `kv_overlap_weight` (anchors.md §3.2): `(credit,
    /// prefill_load_scale)` in effect.
    pub fn kv_credit_and_scale(&self) -> (f64, f64) {
        match self.kv_overlap_weight {
            Some(0.0) => (0.0, 0.0),
            Some(w) => (self.overlap_score_credit, w),
            None => (self.overlap_score_credit, self.prefill_load_scale),
        }
    }
}

/// Which approximate index cache_aware uses (`--cache-index`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheIndexKind {
    /// String tree for text, token tree for token ids (SMG default).
    Tree,
    /// TTL'd exact-match heads at `cache_boundaries` (token requests only; text → miss).
    Hash,
}

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines (`tracing-subscriber`'s default format), colour only on a terminal.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Settings of `kvroute serve`. TOML keys are the field names; flags are the same names with
/// `-`. Every field defaults to its constant in [`defaults`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Listen address, `HOST:PORT` ([`defaults::LISTEN`]).
    pub listen: String,
    /// Shard threads; `None` = one per CPU the process may use (its affinity mask and its
    /// cgroup CPU quota, as `std::thread::available_parallelism` reads them).
    pub shards: Option<usize>,
    /// Pin each shard thread to one core of the process's affinity mask. `None` (auto): pin
    /// when the process may use every core of its mask; under a cgroup CPU quota smaller than
    /// its mask (a Kubernetes CPU limit without a static CPU-manager policy) the cores are
    /// shared with other pods, and every pod pinning onto the mask's first cores would stack
    /// them there, so the scheduler places the threads instead.
    pub pin_shards: Option<bool>,
    /// Worker specs, `http://host:port` optionally followed by `;events=tcp://h:p;replay=tcp://h:p;dp=N`
    /// ([`parse_worker_spec`]); ids are positions in this list.
    pub workers: Vec<String>,
    /// DNS discovery sources, `NAME:PORT` or `srv:NAME` with `;key=value` options
    /// ([`crate::discovery::parse_dns_source`]): each answer's addresses are workers, looked
    /// up again every `dns_refresh_secs`; they join the static `workers`.
    pub worker_dns: Vec<String>,
    /// DNS discovery: look every source up again this often, s
    /// ([`defaults::DNS_REFRESH_SECS`]); > 0.
    pub dns_refresh_secs: u64,
    /// DNS discovery: most addresses taken from one source's answer
    /// ([`defaults::DNS_MAX_ADDRESSES`]); > 0.
    pub dns_max_addresses: usize,
    /// DNS discovery: the nameserver to ask, `IP:PORT` (unset = the system's: A/AAAA through
    /// getaddrinfo, which honours /etc/hosts and nsswitch as `--worker` hosts do, SRV through
    /// /etc/resolv.conf's nameservers, search list and ndots).
    pub dns_server: Option<String>,
    /// Replica sync: the NATS server(s) to share load and placements with the other router
    /// replicas over ([`crate::sync`]), `nats://HOST:PORT` (or `HOST:PORT`; several
    /// comma-separated). Unset: no sync (one router, or replicas that each poll the engines).
    pub nats_url: Option<String>,
    /// Replica sync: the subject prefix; messages go on `PREFIX.sync`. Replicas of one
    /// fleet share it; fleets sharing a NATS server use distinct ones
    /// ([`defaults::NATS_SUBJECT_PREFIX`]).
    pub nats_subject_prefix: String,
    /// Routing policy ([`defaults::POLICY`]).
    pub policy: PolicyKind,
    /// cache_aware match-ratio threshold, 0–1 ([`defaults::CACHE_THRESHOLD`]); also the lead
    /// that pins a request to a DP rank ([`crate::policy::Router::dp_rank`]).
    pub cache_threshold: f64,
    /// Spill gate relative factor, ≥ 1 ([`defaults::BALANCE_REL_THRESHOLD`]).
    pub balance_rel_threshold: f64,
    /// Spill gate absolute margin, requests ([`defaults::BALANCE_ABS_THRESHOLD`]).
    pub balance_abs_threshold: usize,
    /// Policy knobs (cache_aware, kv_aware, prefix_hash, predicted_ttft): see
    /// [`PolicyKnobs`]; TOML table `[knobs]`, flags named as the fields.
    pub knobs: PolicyKnobs,
    /// Per-model string tree budget, chars ([`defaults::MAX_TREE_SIZE_CHARS`]).
    pub max_tree_size_chars: usize,
    /// Per-model token tree budget, tokens ([`defaults::MAX_TREE_SIZE_TOKENS`]).
    pub max_tree_size_tokens: usize,
    /// Token tree page / block size, tokens ([`defaults::BLOCK_SIZE`]).
    pub block_size: usize,
    /// cache_aware index: `tree` or `hash` ([`defaults::CACHE_INDEX`]).
    pub cache_index: CacheIndexKind,
    /// Hash index head lengths, tokens, strictly ascending; required in hash mode (empty).
    pub cache_boundaries: Vec<usize>,
    /// Hash index holder lifetime, s ([`defaults::CACHE_TTL_SECS`]).
    pub cache_ttl_secs: u64,
    /// Event index: prune entries untouched this long, s (unset = never).
    pub kv_indexer_ttl_secs: Option<u64>,
    /// Event index: most (worker, block) entries per model, pruned to 90 % (unset = no cap).
    pub kv_indexer_max_entries: Option<usize>,
    /// Tokenizer of every model without its own entry in `models`: a HF `tokenizer.json`, or
    /// a directory with it and `tokenizer_config.json`. Set → token-mode routing (issue 4).
    pub tokenizer: Option<std::path::PathBuf>,
    /// Tokenizer per model name (`--model NAME=PATH`; TOML table `[models]`). A request's
    /// `model` is looked up as is, then without a `:adapter` suffix, then falls back to
    /// `tokenizer`.
    pub models: std::collections::BTreeMap<String, std::path::PathBuf>,
    /// Prefix cache of incremental tokenization, per model (shared by all shards), tokens
    /// ([`defaults::TOKENIZE_CACHE_TOKENS`]; 0 = off).
    pub tokenize_cache_tokens: usize,
    /// Largest request body, bytes ([`defaults::MAX_BODY_BYTES`]).
    pub max_body_bytes: usize,
    /// Time allowed per exchange with a worker, s ([`defaults::REQUEST_TIMEOUT_SECS`]).
    pub request_timeout_secs: u64,
    /// Longest silence of a worker's response body once it began, s
    /// ([`defaults::STREAM_IDLE_TIMEOUT_SECS`]).
    pub stream_idle_timeout_secs: u64,
    /// Idle upstream connections close after this, ms ([`defaults::UPSTREAM_IDLE_TIMEOUT_MS`]).
    pub upstream_idle_timeout_ms: u64,
    /// Connect timeout to a worker, ms ([`defaults::CONNECT_TIMEOUT_MS`]).
    pub connect_timeout_ms: u64,
    /// Engine load reports every this many ms, 0 = off ([`defaults::LOAD_POLL_MS`]).
    pub load_poll_ms: u64,
    /// Active health checks every this many s, 0 = off
    /// ([`defaults::HEALTH_CHECK_INTERVAL_SECS`]).
    pub health_check_interval_secs: u64,
    /// Time allowed per health check, s ([`defaults::HEALTH_CHECK_TIMEOUT_SECS`]).
    pub health_check_timeout_secs: u64,
    /// Failed checks in a row → unhealthy ([`defaults::HEALTH_FAILURE_THRESHOLD`]).
    pub health_failure_threshold: u32,
    /// Passed checks in a row → healthy ([`defaults::HEALTH_SUCCESS_THRESHOLD`]).
    pub health_success_threshold: u32,
    /// Consecutive failures that open a breaker ([`defaults::BREAKER_FAILURE_THRESHOLD`]).
    pub breaker_failure_threshold: u32,
    /// Failures further apart do not add up, s ([`defaults::BREAKER_WINDOW_SECS`]).
    pub breaker_window_secs: u64,
    /// An open breaker's time out, s ([`defaults::BREAKER_OPEN_SECS`]).
    pub breaker_open_secs: u64,
    /// Half-open successes that close it ([`defaults::BREAKER_SUCCESS_THRESHOLD`]).
    pub breaker_success_threshold: u32,
    /// Retries per request, 0 = none ([`defaults::RETRY_MAX`]).
    pub retry_max: u32,
    /// First retry wait, ms ([`defaults::RETRY_INITIAL_BACKOFF_MS`]).
    pub retry_initial_backoff_ms: u64,
    /// Wait growth per retry, ≥ 1 ([`defaults::RETRY_BACKOFF_MULTIPLIER`]).
    pub retry_backoff_multiplier: f64,
    /// Largest retry wait, ms ([`defaults::RETRY_MAX_BACKOFF_MS`]).
    pub retry_max_backoff_ms: u64,
    /// Relative jitter of retry waits, [0, 1) ([`defaults::RETRY_JITTER`]).
    pub retry_jitter: f64,
    /// Retries earned per request, fleet-wide ([`defaults::RETRY_BUDGET_RATIO`]).
    pub retry_budget_ratio: f64,
    /// Retries the budget may bank ([`defaults::RETRY_BUDGET_CAP`]).
    pub retry_budget_cap: u32,
    /// No attempt starts later than this after arrival, s ([`defaults::RETRY_DEADLINE_SECS`]).
    pub retry_deadline_secs: u64,
    /// Time for a worker's first response byte, s ([`defaults::FIRST_BYTE_TIMEOUT_SECS`]).
    pub first_byte_timeout_secs: u64,
    /// Mid-stream migrations per request, 0 = off ([`defaults::MIGRATION_LIMIT`]).
    pub migration_limit: u32,
    /// Grace for in-flight exchanges after SIGTERM, s ([`defaults::SHUTDOWN_TIMEOUT_SECS`]).
    pub shutdown_timeout_secs: u64,
    /// Admin API address; empty = no admin API ([`defaults::ADMIN_LISTEN`]).
    pub admin_listen: String,
    /// Bearer key of the admin API; required unless `admin_listen` is loopback.
    pub admin_api_key: Option<String>,
    /// Client API keys accepted on the traffic port (`Authorization: Bearer KEY`); empty =
    /// no authentication.
    pub api_keys: Vec<String>,
    /// A file of client API keys, one per line (`#` comments), added to `api_keys`.
    pub api_key_file: Option<std::path::PathBuf>,
    /// Report the worker's URL (not only its id) in `x-kvroute-worker-url`.
    pub expose_worker_url: bool,
    /// Time for a client's request head, s ([`defaults::CLIENT_HEADER_TIMEOUT_SECS`]).
    pub client_header_timeout_secs: u64,
    /// Time between reads of a request body, s ([`defaults::CLIENT_BODY_TIMEOUT_SECS`]).
    pub client_body_timeout_secs: u64,
    /// Idle keep-alive client connections close after this, s
    /// ([`defaults::CLIENT_IDLE_TIMEOUT_SECS`]).
    pub client_idle_timeout_secs: u64,
    /// Client connections per shard ([`defaults::MAX_CONNECTIONS_PER_SHARD`]).
    pub max_connections_per_shard: usize,
    /// Log line format (text by default).
    pub log_format: LogFormat,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: defaults::LISTEN.to_string(),
            shards: None,
            pin_shards: None,
            workers: Vec::new(),
            worker_dns: Vec::new(),
            dns_refresh_secs: defaults::DNS_REFRESH_SECS,
            dns_max_addresses: defaults::DNS_MAX_ADDRESSES,
            dns_server: None,
            nats_url: None,
            nats_subject_prefix: defaults::NATS_SUBJECT_PREFIX.to_string(),
            policy: defaults::POLICY,
            cache_threshold: defaults::CACHE_THRESHOLD,
            balance_rel_threshold: defaults::BALANCE_REL_THRESHOLD,
            balance_abs_threshold: defaults::BALANCE_ABS_THRESHOLD,
            knobs: PolicyKnobs::default(),
            max_tree_size_chars: defaults::MAX_TREE_SIZE_CHARS,
            max_tree_size_tokens: defaults::MAX_TREE_SIZE_TOKENS,
            block_size: defaults::BLOCK_SIZE,
            cache_index: defaults::CACHE_INDEX,
            cache_boundaries: Vec::new(),
            cache_ttl_secs: defaults::CACHE_TTL_SECS,
            kv_indexer_ttl_secs: None,
            kv_indexer_max_entries: None,
            tokenizer: None,
            models: Default::default(),
            tokenize_cache_tokens: defaults::TOKENIZE_CACHE_TOKENS,
            max_body_bytes: defaults::MAX_BODY_BYTES,
            request_timeout_secs: defaults::REQUEST_TIMEOUT_SECS,
            stream_idle_timeout_secs: defaults::STREAM_IDLE_TIMEOUT_SECS,
            upstream_idle_timeout_ms: defaults::UPSTREAM_IDLE_TIMEOUT_MS,
            connect_timeout_ms: defaults::CONNECT_TIMEOUT_MS,
            load_poll_ms: defaults::LOAD_POLL_MS,
            health_check_interval_secs: defaults::HEALTH_CHECK_INTERVAL_SECS,
            health_check_timeout_secs: defaults::HEALTH_CHECK_TIMEOUT_SECS,
            health_failure_threshold: defaults::HEALTH_FAILURE_THRESHOLD,
            health_success_threshold: defaults::HEALTH_SUCCESS_THRESHOLD,
            breaker_failure_threshold: defaults::BREAKER_FAILURE_THRESHOLD,
            breaker_window_secs: defaults::BREAKER_WINDOW_SECS,
            breaker_open_secs: defaults::BREAKER_OPEN_SECS,
            breaker_success_threshold: defaults::BREAKER_SUCCESS_THRESHOLD,
            retry_max: defaults::RETRY_MAX,
            retry_initial_backoff_ms: defaults::RETRY_INITIAL_BACKOFF_MS,
            retry_backoff_multiplier: defaults::RETRY_BACKOFF_MULTIPLIER,
            retry_max_backoff_ms: defaults::RETRY_MAX_BACKOFF_MS,
            retry_jitter: defaults::RETRY_JITTER,
            retry_budget_ratio: defaults::RETRY_BUDGET_RATIO,
            retry_budget_cap: defaults::RETRY_BUDGET_CAP,
            retry_deadline_secs: defaults::RETRY_DEADLINE_SECS,
            first_byte_timeout_secs: defaults::FIRST_BYTE_TIMEOUT_SECS,
            migration_limit: defaults::MIGRATION_LIMIT,
            shutdown_timeout_secs: defaults::SHUTDOWN_TIMEOUT_SECS,
            admin_listen: defaults::ADMIN_LISTEN.to_string(),
            admin_api_key: None,
            api_keys: Vec::new(),
            api_key_file: None,
            expose_worker_url: false,
            client_header_timeout_secs: defaults::CLIENT_HEADER_TIMEOUT_SECS,
            client_body_timeout_secs: defaults::CLIENT_BODY_TIMEOUT_SECS,
            client_idle_timeout_secs: defaults::CLIENT_IDLE_TIMEOUT_SECS,
            max_connections_per_shard: defaults::MAX_CONNECTIONS_PER_SHARD,
            log_format: LogFormat::Text,
        }
    }
}

impl Config {
    /// Parses TOML; absent keys take their defaults ([`defaults`]).
    ///
    /// # Errors
    /// [`CoreError::ConfigSyntax`] for invalid TOML, an unknown key or a value of the wrong type.
    pub fn from_toml_str(text: &str) -> Result<Config, CoreError> {
        Ok(toml::from_str(text)?)
    }

    /// Checks every value; returns the config unchanged when it is usable.
    ///
    /// # Errors
    /// - [`CoreError::NoWorkers`]: no worker and no `worker_dns` source.
    /// - [`CoreError::BadDnsSource`]: a `worker_dns` source is malformed
    ///   ([`crate::discovery::parse_dns_source`]).
    /// - [`CoreError::BadWorkerUrl`]: a worker is not `http://host:port` (see
    ///   [`parse_worker_url`]).
    /// - [`CoreError::DuplicateWorker`]: two workers have the same normalised URL.
    /// - [`CoreError::ConfigValue`]: `shards` is 0; `cache_threshold` outside [0, 1];
    ///   `balance_rel_threshold` < 1 or not finite; `max_tree_size_chars`, `max_body_bytes` or a
    ///   timeout is 0; `max_tree_size_tokens`, `block_size` or `cache_ttl_secs` is 0;
    ///   `cache_index = hash` with `cache_boundaries` empty, containing 0 or not strictly
    ///   ascending (field `cache_boundaries`).
    pub fn validate(self) -> Result<Config, CoreError> {
        if self.workers.is_empty() && self.worker_dns.is_empty() {
            return Err(CoreError::NoWorkers);
        }
        for spec in &self.worker_dns {
            crate::discovery::parse_dns_source(spec)?;
        }
        if let Some(server) = &self.dns_server
            && server.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(CoreError::BadDnsServer(server.clone()));
        }
        check_nats(self.nats_url.as_deref(), &self.nats_subject_prefix)?;
        let mut seen = std::collections::HashSet::new();
        for spec in &self.workers {
            parse_worker_spec(spec)?;
            let (url, _, _) = parse_worker_url(spec)?;
            if !seen.insert(url.clone()) {
                return Err(CoreError::DuplicateWorker { url });
            }
        }
        let bad = |field: &'static str, value: f64, expected: &'static str| {
            Err(CoreError::ConfigValue {
                field,
                value,
                expected,
            })
        };
        if self.shards == Some(0) {
            return bad("shards", 0.0, "at least 1");
        }
        if let Some((field, value, expected)) = self.knobs.invalid() {
            return bad(field, value, expected);
        }
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return bad("cache_threshold", self.cache_threshold, "in [0, 1]");
        }
        for (field, value, min) in [
            ("balance_rel_threshold", self.balance_rel_threshold, 1.0),
            (
                "retry_backoff_multiplier",
                self.retry_backoff_multiplier,
                1.0,
            ),
            ("retry_budget_ratio", self.retry_budget_ratio, 0.0),
        ] {
            if !(value.is_finite() && value >= min) {
                let expected = if min == 0.0 {
                    "a finite number >= 0"
                } else {
                    "a finite number >= 1"
                };
                return bad(field, value, expected);
            }
        }
        if !(0.0..1.0).contains(&self.retry_jitter) {
            return bad("retry_jitter", self.retry_jitter, "in [0, 1)");
        }
        for (field, value) in [
            ("health_check_timeout_secs", self.health_check_timeout_secs),
            (
                "health_failure_threshold",
                u64::from(self.health_failure_threshold),
            ),
            (
                "health_success_threshold",
                u64::from(self.health_success_threshold),
            ),
            (
                "breaker_failure_threshold",
                u64::from(self.breaker_failure_threshold),
            ),
            (
                "breaker_success_threshold",
                u64::from(self.breaker_success_threshold),
            ),
            ("first_byte_timeout_secs", self.first_byte_timeout_secs),
            (
                "client_header_timeout_secs",
                self.client_header_timeout_secs,
            ),
            ("client_body_timeout_secs", self.client_body_timeout_secs),
            ("client_idle_timeout_secs", self.client_idle_timeout_secs),
            (
                "max_connections_per_shard",
                self.max_connections_per_shard as u64,
            ),
            ("max_tree_size_chars", self.max_tree_size_chars as u64),
            ("max_tree_size_tokens", self.max_tree_size_tokens as u64),
            ("block_size", self.block_size as u64),
            ("cache_ttl_secs", self.cache_ttl_secs),
            ("max_body_bytes", self.max_body_bytes as u64),
            ("request_timeout_secs", self.request_timeout_secs),
            ("stream_idle_timeout_secs", self.stream_idle_timeout_secs),
            ("upstream_idle_timeout_ms", self.upstream_idle_timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("dns_refresh_secs", self.dns_refresh_secs),
            ("dns_max_addresses", self.dns_max_addresses as u64),
        ] {
            if value == 0 {
                return bad(field, 0.0, "greater than 0");
            }
        }
        if !self.admin_listen.is_empty()
            && self.admin_api_key.as_deref().is_none_or(str::is_empty)
            && !is_loopback(&self.admin_listen)
        {
            return Err(CoreError::AdminKeyRequired {
                listen: self.admin_listen.clone(),
            });
        }
        let b = &self.cache_boundaries;
        if self.cache_index == CacheIndexKind::Hash
            && (b.is_empty() || b[0] == 0 || !b.windows(2).all(|w| w[0] < w[1]))
        {
            return bad(
                "cache_boundaries",
                b.len() as f64,
                "non-empty, > 0, strictly ascending in hash mode",
            );
        }
        Ok(self)
    }
}

/// Checks replica sync's settings: each comma-separated server of `url` is
/// `[nats://|tls://]HOST:PORT`; `prefix` is dot-separated tokens of letters, digits, `_`
/// and `-` (a NATS subject without wildcards).
///
/// # Errors
/// [`CoreError::BadNats`] naming the flag.
fn check_nats(url: Option<&str>, prefix: &str) -> Result<(), CoreError> {
    let bad = |flag, value: &str, problem| {
        Err(CoreError::BadNats {
            flag,
            value: value.to_string(),
            problem,
        })
    };
    if let Some(url) = url {
        for server in url.split(',') {
            let hostport = server
                .trim()
                .strip_prefix("nats://")
                .or_else(|| server.trim().strip_prefix("tls://"))
                .unwrap_or(server.trim());
            let ok = hostport
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return bad(
                    "nats",
                    url,
                    "expected nats://HOST:PORT (e.g. nats://127.0.0.1:4222)",
                );
            }
        }
    }
    let token_ok = |t: &str| {
        !t.is_empty()
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    if !prefix.split('.').all(token_ok) {
        return bad(
            "nats-subject-prefix",
            prefix,
            "expected dot-separated tokens of letters, digits, _ and - (e.g. kvroute.prod)",
        );
    }
    Ok(())
}

/// True when `listen` (`HOST:PORT`) names a loopback address (`127.0.0.0/8`, `::1`,
/// `localhost`).
pub fn is_loopback(listen: &str) -> bool {
    match listen.parse::<std::net::SocketAddr>() {
        Ok(a) => a.ip().is_loopback(),
        Err(_) => listen
            .rsplit_once(':')
            .is_some_and(|(host, _)| host.eq_ignore_ascii_case("localhost")),
    }
}

/// A worker as given by `--worker` or `workers = [..]`:
/// `http://h:8000;events=tcp://h:5557;replay=tcp://h:5558;dp=2;model=qwen3;api_key_env=KEY`
/// (issues 5 and 13). Options after the
/// URL are `;key=value`; DP rank r publishes on the events (and replay) port + r
/// (`kv-events.md` §1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// Normalised base URL (see [`parse_worker_url`]).
    pub url: String,
    /// KV-event PUB endpoint of rank 0 (`tcp://host:port`); `None` = no events.
    pub events: Option<String>,
    /// Replay ROUTER endpoint of rank 0; `None` = gaps cannot be replayed.
    pub replay: Option<String>,
    /// Data-parallel ranks (≥ 1).
    pub dp: u32,
    /// Models the worker serves (`;model=NAME`, repeatable). Empty: read from the worker's
    /// `/v1/models` at start-up and on every health check.
    pub models: Vec<String>,
    /// Environment variable holding the worker's own API key (`;api_key_env=VAR`): sent as
    /// `Authorization: Bearer KEY` instead of the client's header.
    pub api_key_env: Option<String>,
}

impl WorkerSpec {
    /// Endpoint of rank `rank`: `tcp://host:port` with port + rank.
    pub fn rank_endpoint(endpoint: &str, rank: u32) -> Option<String> {
        let (head, port) = endpoint.rsplit_once(':')?;
        let port: u32 = port.parse().ok()?;
        let p = u16::try_from(port + rank).ok()?;
        Some(format!("{head}:{p}"))
    }
}

/// The options a static worker spec and a `--worker-dns` source share (`dp=N`,
/// `model=NAME`, `api_key_env=VAR`): applies option `key` (one of those three) with value `v`.
///
/// # Errors
/// The problem, as a fixed phrase: `dp` not an integer 1–1024, an empty `model`, an
/// `api_key_env` that is not a variable name.
pub(crate) fn common_option(
    key: &str,
    v: &str,
    dp: &mut u32,
    models: &mut Vec<String>,
    api_key_env: &mut Option<String>,
) -> Result<(), &'static str> {
    let v = v.trim();
    match key {
        "dp" => {
            *dp = v
                .parse()
                .ok()
                .filter(|d| (1..=1024).contains(d))
                .ok_or("dp must be an integer 1-1024")?
        }
        "model" if !v.is_empty() => models.push(v.to_string()),
        "model" => return Err("model must not be empty"),
        _ => {
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err("api_key_env must be an environment variable name");
            }
            *api_key_env = Some(v.to_string());
        }
    }
    Ok(())
}

/// Parses a worker spec `URL[;events=EP][;replay=EP][;dp=N][;model=NAME]...[;api_key_env=VAR]`.
///
/// # Errors
/// [`CoreError::BadWorkerUrl`]: a bad URL (see [`parse_worker_url`]), an unknown option, an
/// endpoint that is not `tcp://host:port`, `dp` not an integer 1–1024, `replay` without
/// `events`, an empty `model` or an `api_key_env` that is not a variable name.
pub fn parse_worker_spec(spec: &str) -> Result<WorkerSpec, CoreError> {
    let bad = |problem| CoreError::BadWorkerUrl {
        url: spec.to_string(),
        problem,
    };
    let mut parts = spec.split(';');
    let (url, _, _) = parse_worker_url(parts.next().unwrap_or(""))?;
    let mut out = WorkerSpec {
        url,
        events: None,
        replay: None,
        dp: 1,
        models: Vec::new(),
        api_key_env: None,
    };
    for opt in parts.map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = opt
            .split_once('=')
            .ok_or_else(|| bad("options are ;key=value"))?;
        let endpoint = |v: &str| {
            let ok = v.strip_prefix("tcp://").is_some_and(|r| {
                r.rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
            });
            if ok {
                Ok(v.to_string())
            } else {
                Err(bad("events/replay must be tcp://host:port"))
            }
        };
        match k.trim() {
            "events" => out.events = Some(endpoint(v.trim())?),
            "replay" => out.replay = Some(endpoint(v.trim())?),
            "dp" | "model" | "api_key_env" => common_option(
                k.trim(),
                v,
                &mut out.dp,
                &mut out.models,
                &mut out.api_key_env,
            )
            .map_err(bad)?,
            _ => {
                return Err(bad(
                    "unknown option (expected events, replay, dp, model, api_key_env)",
                ));
            }
        }
    }
    if out.replay.is_some() && out.events.is_none() {
        return Err(bad("replay needs events"));
    }
    Ok(out)
}

/// Splits a worker URL `http://host:port` (trailing `/` allowed) into `(normalised url, host,
/// port)`: url without trailing `/`, host without IPv6 brackets, port 1–65535. Worker-spec
/// options after a `;` are ignored here ([`parse_worker_spec`] reads them).
///
/// # Errors
/// [`CoreError::BadWorkerUrl`]: not `http://`, a path, query or fragment after the port, no
/// port, a port that is not a number 1–65535, an empty host, or a host with user info,
/// whitespace, a control character (the URL goes into `x-kvroute-worker-url` headers) or an
/// unbracketed `:`.
pub fn parse_worker_url(url: &str) -> Result<(String, String, u16), CoreError> {
    let bad = |problem| CoreError::BadWorkerUrl {
        url: url.to_string(),
        problem,
    };
    let url = url.split(';').next().unwrap_or(url);
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| bad("must start with http:// (TLS to workers is not supported yet)"))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '?', '#']) {
        return Err(bad("must not have a path, query or fragment"));
    }
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad("must have a port"))?;
    let host = match host.strip_prefix('[') {
        Some(v6) => v6
            .strip_suffix(']')
            .ok_or_else(|| bad("unterminated [IPv6] host"))?,
        None if host.contains(':') => return Err(bad("an IPv6 host must be in brackets")),
        None => host,
    };
    if host.is_empty() {
        return Err(bad("must have a host"));
    }
    if host.contains(|c: char| c == '@' || c.is_whitespace() || c.is_control()) {
        return Err(bad(
            "host must not contain user info, whitespace or control characters",
        ));
    }
    let port: u16 = port
        .parse()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| bad("port must be a number 1-65535"))?;
    Ok((format!("http://{rest}"), host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-worker config changed by `f`, validated.
    fn with(f: fn(&mut Config)) -> Result<Config, CoreError> {
        let mut c = Config {
            workers: vec!["http://a:1".into()],
            ..Config::default()
        };
        f(&mut c);
        c.validate()
    }

    #[test]
    fn empty_toml_equals_default() {
        assert_eq!(Config::from_toml_str("").unwrap(), Config::default());
        assert_eq!(Config::default().cache_threshold, defaults::CACHE_THRESHOLD);
        assert_eq!(Config::default().policy, PolicyKind::PredictedTtft);
    }

    #[test]
    fn toml_values_and_errors() {
        let cfg = Config::from_toml_str(
            "workers = [\"http://127.0.0.1:8101\"]\npolicy = \"round_robin\"\ncache_threshold = 0.5\n",
        )
        .unwrap()
        .validate()
        .unwrap();
        assert_eq!(cfg.policy, PolicyKind::RoundRobin);
        assert_eq!(cfg.cache_threshold, 0.5);
        assert!(matches!(
            Config::from_toml_str("nope = 1"),
            Err(CoreError::ConfigSyntax(_))
        ));
        assert_eq!(Config::default().validate(), Err(CoreError::NoWorkers));
        assert!(matches!(
            with(|c| c.cache_threshold = 1.5),
            Err(CoreError::ConfigValue {
                field: "cache_threshold",
                ..
            })
        ));
        assert!(matches!(
            with(|c| c.balance_rel_threshold = 0.5),
            Err(CoreError::ConfigValue {
                field: "balance_rel_threshold",
                ..
            })
        ));
        assert!(matches!(
            with(|c| c.shards = Some(0)),
            Err(CoreError::ConfigValue {
                field: "shards",
                ..
            })
        ));
        assert!(matches!(
            with(|c| c.request_timeout_secs = 0),
            Err(CoreError::ConfigValue {
                field: "request_timeout_secs",
                ..
            })
        ));
        assert_eq!(
            with(|c| c.cache_threshold = f64::NAN).map_err(|e| e.kind()),
            Err("config")
        );
        assert_eq!(
            with(|c| c.max_tree_size_chars = 0),
            Err(CoreError::ConfigValue {
                field: "max_tree_size_chars",
                value: 0.0,
                expected: "greater than 0"
            })
        );
        assert_eq!(
            with(|c| c.workers = vec!["http://a:1".into(), "http://a:1/".into()]),
            Err(CoreError::DuplicateWorker {
                url: "http://a:1".into()
            })
        );
        assert!(with(|_| {}).is_ok());
        assert!(with(|c| c.cache_threshold = 1.0).is_ok());
    }

    #[test]
    fn every_key_from_toml() {
        let text = r#"
            listen = "0.0.0.0:9000"
            shards = 2
            pin_shards = false
            workers = ["http://h1:8101", "http://[::1]:8102/"]
            policy = "least_request"
            cache_threshold = 0.25
            balance_rel_threshold = 2.0
            balance_abs_threshold = 8
            max_tree_size_chars = 1000
            max_body_bytes = 1024
            request_timeout_secs = 5
            upstream_idle_timeout_ms = 100
            connect_timeout_ms = 200
        "#;
        let want = Config {
            listen: "0.0.0.0:9000".into(),
            shards: Some(2),
            pin_shards: Some(false),
            workers: vec!["http://h1:8101".into(), "http://[::1]:8102/".into()],
            policy: PolicyKind::LeastRequest,
            cache_threshold: 0.25,
            balance_rel_threshold: 2.0,
            balance_abs_threshold: 8,
            max_tree_size_chars: 1000,
            max_body_bytes: 1024,
            request_timeout_secs: 5,
            upstream_idle_timeout_ms: 100,
            connect_timeout_ms: 200,
            ..Config::default()
        };
        let got = Config::from_toml_str(text).unwrap();
        assert_eq!(got, want);
        assert_eq!(got.validate(), Ok(want));
        // Wrong type and unknown policy are syntax errors, with the key in the message.
        for bad in [
            "shards = \"two\"",
            "policy = \"fastest\"",
            "workers = \"http://a:1\"",
        ] {
            let e = Config::from_toml_str(bad).unwrap_err();
            assert!(matches!(e, CoreError::ConfigSyntax(_)), "{bad}");
        }
    }

    #[test]
    fn worker_urls() {
        assert_eq!(
            parse_worker_url("http://10.0.0.1:8000/").unwrap(),
            ("http://10.0.0.1:8000".into(), "10.0.0.1".into(), 8000)
        );
        assert_eq!(
            parse_worker_url("http://[::1]:9").unwrap(),
            ("http://[::1]:9".into(), "::1".into(), 9)
        );
        assert_eq!(
            parse_worker_url("http://engine-0.local:65535").unwrap(),
            (
                "http://engine-0.local:65535".into(),
                "engine-0.local".into(),
                65535
            )
        );
        for bad in [
            "https://a:1",
            "http://a",
            "http://a:0",
            "http://a:x",
            "http://a:1/v1",
            "http://a:1?x=1",
            "http://:1",
            "http://u@a:1",
            "http://::1:9",
            "http://[::1:9",
            "http://a b:1",
            "http://a\u{0}b:1",
            "http://a\u{7f}:1",
            "http://a:65536",
        ] {
            assert!(
                matches!(parse_worker_url(bad), Err(CoreError::BadWorkerUrl { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn worker_specs_with_events() {
        let w = parse_worker_spec("http://h:8000;events=tcp://h:5557;replay=tcp://h:5558;dp=2")
            .unwrap();
        assert_eq!(
            w,
            WorkerSpec {
                url: "http://h:8000".into(),
                events: Some("tcp://h:5557".into()),
                replay: Some("tcp://h:5558".into()),
                dp: 2,
                models: vec![],
                api_key_env: None,
            }
        );
        assert_eq!(
            WorkerSpec::rank_endpoint("tcp://h:5557", 1).as_deref(),
            Some("tcp://h:5558")
        );
        assert_eq!(parse_worker_spec("http://h:1").unwrap().dp, 1);
        assert_eq!(
            parse_worker_url("http://h:1;events=tcp://h:2").unwrap().0,
            "http://h:1"
        );
        for bad in [
            "http://h:1;events=h:2",
            "http://h:1;dp=0",
            "http://h:1;replay=tcp://h:3",
            "http://h:1;colour=red",
            "http://h:1;events",
        ] {
            assert!(parse_worker_spec(bad).is_err(), "{bad}");
        }
        // TOML form: the same spec strings in `workers`.
        let cfg = Config::from_toml_str(
            "workers = [\"http://127.0.0.1:8101;events=tcp://127.0.0.1:5557;dp=2\"]",
        )
        .unwrap()
        .validate()
        .unwrap();
        assert_eq!(parse_worker_spec(&cfg.workers[0]).unwrap().dp, 2);
    }

    /// `--knob NAME=VALUE`: names as TOML keys (`-` for `_`), TOML values, the same range
    /// checks as the config file; a `[knobs]` table in TOML sets the same fields.
    #[test]
    fn knobs_are_set_by_name_and_checked() {
        let mut k = PolicyKnobs::default();
        k.set_all(&[
            "ttft-prefill-weight=3".into(),
            "kv_overlap_weight=0.5".into(),
        ])
        .unwrap();
        assert_eq!(
            (k.ttft_prefill_weight, k.kv_overlap_weight),
            (3.0, Some(0.5))
        );
        assert!(matches!(
            k.set("no_such_knob", "1"),
            Err(CoreError::ConfigSyntax(_))
        ));
        assert!(matches!(
            k.set("overlap_decay", "\"x\""),
            Err(CoreError::ConfigSyntax(_))
        ));
        assert!(matches!(
            k.set("overlap_score_credit", "1.5"),
            Err(CoreError::ConfigValue {
                field: "overlap_score_credit",
                ..
            })
        ));
        assert!(matches!(
            k.set_all(&["overlap_decay".into()]),
            Err(CoreError::BadKnob(_))
        ));
        assert_eq!(k.ttft_prefill_weight, 3.0, "a refused knob changes nothing");
        let cfg = Config::from_toml_str("[knobs]\noverlap_decay = 0.25\n").unwrap();
        assert_eq!(cfg.knobs.overlap_decay, 0.25);
        assert!(Config::from_toml_str("[knobs]\noverlap_dekay = 0.25\n").is_err());
    }

    #[test]
    fn policy_names_round_trip() {
        for p in PolicyKind::ALL {
            assert_eq!(p.as_str().parse::<PolicyKind>().unwrap(), p);
        }
        assert_eq!(
            "least-request".parse::<PolicyKind>().unwrap(),
            PolicyKind::LeastRequest
        );
        assert!("fastest".parse::<PolicyKind>().is_err());
    }

    #[test]
    fn worker_spec_models_and_key_variable() {
        let s = parse_worker_spec("http://h:1;model=a;model=b;api_key_env=W_KEY").unwrap();
        assert_eq!(s.models, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(s.api_key_env.as_deref(), Some("W_KEY"));
        assert!(parse_worker_spec("http://h:1;model=").is_err());
        assert!(parse_worker_spec("http://h:1;api_key_env=A-B").is_err());
        assert!(parse_worker_spec("http://h:1;colour=red").is_err());
    }

    /// The admin API needs a key beyond loopback; the failover settings are range-checked.
    /// DNS sources stand in for static workers; each is checked at start-up, naming the flag.
    #[test]
    fn worker_dns_values() {
        let dns_only = Config {
            worker_dns: vec!["vllm.default.svc.cluster.local:8000".into()],
            ..Config::default()
        };
        assert_eq!(dns_only.clone().validate(), Ok(dns_only));
        let cfg = Config::from_toml_str(
            "worker_dns = [\"srv:_http._tcp.vllm;events_port=5557\"]\ndns_refresh_secs = 5\n\
             dns_max_addresses = 64\ndns_server = \"127.0.0.1:5353\"",
        )
        .unwrap()
        .validate()
        .unwrap();
        assert_eq!(
            (cfg.dns_refresh_secs, cfg.dns_max_addresses, cfg.dns_server),
            (5, 64, Some("127.0.0.1:5353".to_string()))
        );
        assert_eq!(
            Config::default().dns_refresh_secs,
            defaults::DNS_REFRESH_SECS
        );
        let err = with(|c| c.worker_dns = vec!["vllm".into()]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "config: --worker-dns \"vllm\": expected NAME:PORT or srv:NAME"
        );
        assert_eq!(
            with(|c| c.dns_server = Some("dns:53".into())),
            Err(CoreError::BadDnsServer("dns:53".into()))
        );
        for f in [
            (|c: &mut Config| c.dns_refresh_secs = 0) as fn(&mut Config),
            |c| c.dns_max_addresses = 0,
        ] {
            assert!(matches!(with(f), Err(CoreError::ConfigValue { .. })));
        }
    }

    #[test]
    fn admin_key_and_failover_values() {
        assert!(with(|_| {}).is_ok(), "default admin_listen is loopback");
        assert!(matches!(
            with(|c| c.admin_listen = "0.0.0.0:8001".into()),
            Err(CoreError::AdminKeyRequired { .. })
        ));
        assert!(
            with(|c| {
                c.admin_listen = "0.0.0.0:8001".into();
                c.admin_api_key = Some("k".into());
            })
            .is_ok()
        );
        assert!(with(|c| c.admin_listen = String::new()).is_ok());
        assert!(with(|c| c.admin_listen = "localhost:9".into()).is_ok());
        assert!(with(|c| c.admin_listen = "[::1]:9".into()).is_ok());
        for (f, field) in [
            (
                (|c: &mut Config| c.retry_jitter = 1.0) as fn(&mut Config),
                "retry_jitter",
            ),
            (
                |c| c.retry_backoff_multiplier = 0.5,
                "retry_backoff_multiplier",
            ),
            (|c| c.first_byte_timeout_secs = 0, "first_byte_timeout_secs"),
            (
                |c| c.breaker_failure_threshold = 0,
                "breaker_failure_threshold",
            ),
            (
                |c| c.max_connections_per_shard = 0,
                "max_connections_per_shard",
            ),
        ] {
            match with(f) {
                Err(CoreError::ConfigValue { field: got, .. }) => assert_eq!(got, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        // TOML spells them as the flags do.
        let cfg = Config::from_toml_str(
            "retry_max = 1\nmigration_limit = 2\nlog_format = \"json\"\napi_keys = [\"k\"]\n",
        )
        .unwrap();
        assert_eq!(
            (cfg.retry_max, cfg.migration_limit, cfg.log_format),
            (1, 2, LogFormat::Json)
        );
        assert_eq!(cfg.api_keys, vec!["k".to_string()]);
    }

    /// `--nats` takes nats://HOST:PORT lists; the prefix is a wildcard-free subject.
    #[test]
    fn nats_settings_are_checked() {
        let with = |url: Option<&str>, prefix: &str| {
            Config {
                workers: vec!["http://a:1".into()],
                nats_url: url.map(str::to_string),
                nats_subject_prefix: prefix.into(),
                ..Config::default()
            }
            .validate()
        };
        assert_eq!(
            Config::default().nats_subject_prefix,
            defaults::NATS_SUBJECT_PREFIX
        );
        assert!(with(None, defaults::NATS_SUBJECT_PREFIX).is_ok());
        assert!(with(Some("nats://127.0.0.1:4222"), "kvroute.prod-1").is_ok());
        assert!(with(Some("nats://a:4222, tls://b:4222,c:1"), "x").is_ok());
        for (url, prefix, flag) in [
            (Some("nats://host"), "kvroute", "nats"),
            (Some("nats://:4222"), "kvroute", "nats"),
            (Some("nats://h:0"), "kvroute", "nats"),
            (None, "kvroute.>", "nats-subject-prefix"),
            (None, "a..b", "nats-subject-prefix"),
            (None, "", "nats-subject-prefix"),
        ] {
            match with(url, prefix) {
                Err(CoreError::BadNats { flag: f, .. }) => assert_eq!(f, flag, "{url:?} {prefix}"),
                other => panic!("{url:?} {prefix}: {other:?}"),
            }
        }
        let e = with(Some("nats://host"), "kvroute")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "config: --nats \"nats://host\": expected nats://HOST:PORT (e.g. nats://127.0.0.1:4222)"
        );
    }
}
