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
    /// Each worker in turn.
    RoundRobin,
    /// Fewest in-flight requests; ties broken at random (never by list order: bug B1).
    LeastRequest,
    /// Prefix affinity from an approximate string tree, with SMG's spill gate (anchors.md §2).
    CacheAware,
}

impl PolicyKind {
    /// Every policy, in the order the demo compares them.
    pub const ALL: [PolicyKind; 3] = [
        PolicyKind::RoundRobin,
        PolicyKind::LeastRequest,
        PolicyKind::CacheAware,
    ];

    /// The name used by `--policy`, TOML and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastRequest => "least_request",
            PolicyKind::CacheAware => "cache_aware",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = CoreError;

    /// Parses `round_robin`, `least_request` or `cache_aware` (`-` accepted for `_`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.trim().replace('-', "_");
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.as_str() == norm)
            .ok_or_else(|| CoreError::UnknownPolicy(s.to_string()))
    }
}

/// Settings of `kvroute serve`. TOML keys are the field names; flags are the same names with
/// `-`. Every field defaults to its constant in [`defaults`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Listen address, `HOST:PORT` ([`defaults::LISTEN`]).
    pub listen: String,
    /// Shard threads; `None` = one per core the process may use.
    pub shards: Option<usize>,
    /// Worker base URLs, `http://host:port`; ids are positions in this list.
    pub workers: Vec<String>,
    /// Routing policy ([`defaults::POLICY`]).
    pub policy: PolicyKind,
    /// cache_aware match-ratio threshold, 0–1 ([`defaults::CACHE_THRESHOLD`]).
    pub cache_threshold: f64,
    /// Spill gate relative factor, ≥ 1 ([`defaults::BALANCE_REL_THRESHOLD`]).
    pub balance_rel_threshold: f64,
    /// Spill gate absolute margin, requests ([`defaults::BALANCE_ABS_THRESHOLD`]).
    pub balance_abs_threshold: usize,
    /// Per-model string tree budget, chars ([`defaults::MAX_TREE_SIZE_CHARS`]).
    pub max_tree_size_chars: usize,
    /// Largest request body, bytes ([`defaults::MAX_BODY_BYTES`]).
    pub max_body_bytes: usize,
    /// Time allowed per exchange with a worker, s ([`defaults::REQUEST_TIMEOUT_SECS`]).
    pub request_timeout_secs: u64,
    /// Idle upstream connections close after this, ms ([`defaults::UPSTREAM_IDLE_TIMEOUT_MS`]).
    pub upstream_idle_timeout_ms: u64,
    /// Connect timeout to a worker, ms ([`defaults::CONNECT_TIMEOUT_MS`]).
    pub connect_timeout_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: defaults::LISTEN.to_string(),
            shards: None,
            workers: Vec::new(),
            policy: defaults::POLICY,
            cache_threshold: defaults::CACHE_THRESHOLD,
            balance_rel_threshold: defaults::BALANCE_REL_THRESHOLD,
            balance_abs_threshold: defaults::BALANCE_ABS_THRESHOLD,
            max_tree_size_chars: defaults::MAX_TREE_SIZE_CHARS,
            max_body_bytes: defaults::MAX_BODY_BYTES,
            request_timeout_secs: defaults::REQUEST_TIMEOUT_SECS,
            upstream_idle_timeout_ms: defaults::UPSTREAM_IDLE_TIMEOUT_MS,
            connect_timeout_ms: defaults::CONNECT_TIMEOUT_MS,
        }
    }
}

impl Config {
    /// Parses TOML; absent keys take their defaults.
    ///
    /// # Errors
    /// [`CoreError::ConfigSyntax`] for invalid TOML, an unknown key or a value of the wrong type.
    pub fn from_toml_str(text: &str) -> Result<Config, CoreError> {
        toml::from_str(text).map_err(|e| CoreError::ConfigSyntax(e.to_string()))
    }

    /// Checks every value; returns the config unchanged when it is usable.
    ///
    /// # Errors
    /// - [`CoreError::NoWorkers`]: the worker list is empty.
    /// - [`CoreError::BadWorkerUrl`]: a worker is not `http://host:port` (see
    ///   [`parse_worker_url`]).
    /// - [`CoreError::ConfigValue`]: `shards` is 0, `cache_threshold` outside [0, 1],
    ///   `balance_rel_threshold` < 1 or not finite, a zero body limit or timeout.
    pub fn validate(self) -> Result<Config, CoreError> {
        if self.workers.is_empty() {
            return Err(CoreError::NoWorkers);
        }
        for url in &self.workers {
            parse_worker_url(url)?;
        }
        let bad =
            |field: &'static str, problem: String| Err(CoreError::ConfigValue { field, problem });
        if self.shards == Some(0) {
            return bad("shards", "must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return bad(
                "cache_threshold",
                format!("must be in [0, 1], got {}", self.cache_threshold),
            );
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 1.0) {
            return bad(
                "balance_rel_threshold",
                format!(
                    "must be a finite number ≥ 1, got {}",
                    self.balance_rel_threshold
                ),
            );
        }
        for (field, value) in [
            ("max_body_bytes", self.max_body_bytes as u64),
            ("request_timeout_secs", self.request_timeout_secs),
            ("upstream_idle_timeout_ms", self.upstream_idle_timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
        ] {
            if value == 0 {
                return bad(field, "must be greater than 0".into());
            }
        }
        Ok(self)
    }
}

/// Splits a worker URL `http://host:port` (trailing `/` allowed) into `(normalised url, host,
/// port)`.
///
/// # Errors
/// [`CoreError::BadWorkerUrl`]: not `http://`, no port, a port that is not a number 1–65535,
/// or a path after the port.
pub fn parse_worker_url(url: &str) -> Result<(String, String, u16), CoreError> {
    let bad = |problem| CoreError::BadWorkerUrl {
        url: url.to_string(),
        problem,
    };
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| bad("must start with http:// (TLS to workers is not supported yet)"))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') {
        return Err(bad("must not have a path"));
    }
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad("must have a port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad("must have a host"));
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

    #[test]
    fn empty_toml_equals_default() {
        assert_eq!(Config::from_toml_str("").unwrap(), Config::default());
        assert_eq!(Config::default().cache_threshold, defaults::CACHE_THRESHOLD);
        assert_eq!(Config::default().policy, PolicyKind::CacheAware);
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
        let with = |f: fn(&mut Config)| {
            let mut c = Config {
                workers: vec!["http://a:1".into()],
                ..Config::default()
            };
            f(&mut c);
            c.validate()
        };
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
        assert!(with(|_| {}).is_ok());
    }

    #[test]
    fn worker_urls() {
        assert_eq!(
            parse_worker_url("http://10.0.0.1:8000/").unwrap(),
            ("http://10.0.0.1:8000".into(), "10.0.0.1".into(), 8000)
        );
        assert_eq!(parse_worker_url("http://[::1]:9").unwrap().1, "::1");
        for bad in [
            "https://a:1",
            "http://a",
            "http://a:0",
            "http://a:x",
            "http://a:1/v1",
            "http://:1",
        ] {
            assert!(
                matches!(parse_worker_url(bad), Err(CoreError::BadWorkerUrl { .. })),
                "{bad}"
            );
        }
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
        assert!("random".parse::<PolicyKind>().is_err());
    }
}
