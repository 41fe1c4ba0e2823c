//! The one error type of the core crate.

/// Why a configuration or a request body was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoreError {
    /// The TOML did not parse (message from the parser, with line and column).
    #[error("config: {0}")]
    ConfigSyntax(String),
    /// A config value is out of range.
    #[error("config: `{field}` {problem}")]
    ConfigValue {
        /// The key, as in TOML (`cache_threshold`).
        field: &'static str,
        /// What is wrong, e.g. "must be in [0, 1], got 2".
        problem: String,
    },
    /// No worker configured.
    #[error("config: at least one worker is required (--worker URL or `workers = [..]`)")]
    NoWorkers,
    /// A worker URL is not `http://host:port`.
    #[error("config: worker URL {url:?}: {problem}")]
    BadWorkerUrl {
        /// The URL as given.
        url: String,
        /// What is wrong.
        problem: &'static str,
    },
    /// An unknown policy name.
    #[error("unknown policy {0:?} (expected round_robin, least_request or cache_aware)")]
    UnknownPolicy(String),
    /// The request body is not what the route expects (→ HTTP 400).
    #[error("invalid request body: {0}")]
    BadBody(String),
}
