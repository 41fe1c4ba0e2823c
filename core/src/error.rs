//! [`CoreError`]: the one error type of the core crate (config and request-body errors).
//! Variants carry data; `Display` formats it.

/// Why a configuration or a request body was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CoreError {
    /// The TOML did not parse, has an unknown key, or a value of the wrong type (the parser's
    /// error carries line, column and key).
    #[error("config: {0}")]
    ConfigSyntax(#[from] toml::de::Error),
    /// A config value is out of range.
    #[error("config: `{field}` must be {expected}, got {value}")]
    ConfigValue {
        /// The key, as in TOML (`cache_threshold`).
        field: &'static str,
        /// The value given (integers widened to `f64`).
        value: f64,
        /// The accepted range, e.g. `"in [0, 1]"`.
        expected: &'static str,
    },
    /// A `--knob` argument is not `NAME=VALUE`.
    #[error("config: --knob expects NAME=VALUE, got {0:?}")]
    BadKnob(String),
    /// No worker configured.
    #[error(
        "config: at least one worker is required (--worker URL, --worker-dns NAME:PORT, or `workers = [..]` / `worker_dns = [..]`)"
    )]
    NoWorkers,
    /// A worker URL is not `http://host:port`.
    #[error("config: worker URL {url:?}: {problem}")]
    BadWorkerUrl {
        /// The URL as given.
        url: String,
        /// What is wrong (a fixed phrase, e.g. "must have a port").
        problem: &'static str,
    },
    /// A `--worker-dns` source (TOML `worker_dns`) is malformed ([`crate::discovery`]).
    #[error("config: --worker-dns {spec:?}: {problem}")]
    BadDnsSource {
        /// The spec as given.
        spec: String,
        /// What is wrong (a fixed phrase, e.g. "port must be a number 1-65535").
        problem: &'static str,
    },
    /// `dns_server` (`--dns-server`) is not `IP:PORT`.
    #[error("config: --dns-server {0:?}: expected IP:PORT (e.g. 10.96.0.10:53)")]
    BadDnsServer(String),
    /// `nats_url` or `nats_subject_prefix` (`--nats`, `--nats-subject-prefix`) is malformed.
    #[error("config: --{flag} {value:?}: {problem}")]
    BadNats {
        /// The flag (`nats` or `nats-subject-prefix`).
        flag: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong (a fixed phrase).
        problem: &'static str,
    },
    /// The same worker (after normalisation) is listed twice.
    #[error("config: worker {url} is listed twice")]
    DuplicateWorker {
        /// The normalised URL.
        url: String,
    },
    /// A worker's host resolves to the address of a present worker that is not draining
    /// (`http://localhost:8000` and `http://127.0.0.1:8000`): one engine would count twice.
    #[error("worker {url} resolves to {addr}, the address of worker {other}")]
    SameAddress {
        /// The new worker's URL as given.
        url: String,
        /// The address both resolve to.
        addr: std::net::SocketAddr,
        /// The present worker's id.
        other: usize,
    },
    /// A worker's `;api_key_env=VAR` names a variable that is unset or empty: its requests
    /// would go without the key it asked for (and a vLLM started with `--api-key` would
    /// answer each with 401).
    #[error("worker {url}: api_key_env names {var}, which is unset or empty")]
    WorkerKeyUnset {
        /// The worker's URL as given.
        url: String,
        /// The variable's name.
        var: String,
    },
    /// The admin API listens beyond loopback without `admin_api_key`.
    #[error(
        "config: `admin_listen` {listen} is not loopback: set `admin_api_key` (--admin-api-key)"
    )]
    AdminKeyRequired {
        /// The address given.
        listen: String,
    },
    /// An unknown policy name.
    #[error("unknown policy {0:?} (expected round_robin, least_request or cache_aware)")]
    UnknownPolicy(String),
    /// The request body is not valid JSON (→ HTTP 400).
    #[error("request body is not valid JSON (line {line}, column {column})")]
    BodyNotJson {
        /// 1-based line of the first error.
        line: usize,
        /// 1-based column of the first error.
        column: usize,
    },
    /// The request body is JSON but not an object (→ HTTP 400).
    #[error("request body must be a JSON object")]
    BodyNotObject,
    /// A field routing needs is absent or null (→ HTTP 400).
    #[error("request body: `{field}` is required")]
    MissingField {
        /// The field (`messages`, `prompt`, `text or input_ids`).
        field: &'static str,
    },
    /// A field routing needs has the wrong JSON type (→ HTTP 400).
    #[error("request body: `{field}` must be {expected}")]
    WrongType {
        /// The field (`messages`, `messages[]`, `prompt`, `text`, `input_ids`).
        field: &'static str,
        /// What it must be, e.g. `"an array"`.
        expected: &'static str,
    },
    /// A configured tokenizer could not be loaded (`--tokenizer`, `--model NAME=PATH`).
    #[error("config: tokenizer for model {model:?} at {path}: {message}")]
    Tokenizer {
        /// The model name (`*` for the default `--tokenizer`).
        model: String,
        /// The path given.
        path: String,
        /// The tokenize crate's error, formatted.
        message: String,
    },
}

impl CoreError {
    /// Short metric label (`kvroute_bad_requests_total{reason}` and the like).
    pub fn kind(&self) -> &'static str {
        match self {
            CoreError::ConfigSyntax(_)
            | CoreError::ConfigValue { .. }
            | CoreError::NoWorkers
            | CoreError::BadWorkerUrl { .. }
            | CoreError::BadDnsSource { .. }
            | CoreError::BadDnsServer(_)
            | CoreError::BadNats { .. }
            | CoreError::DuplicateWorker { .. }
            | CoreError::WorkerKeyUnset { .. }
            | CoreError::SameAddress { .. }
            | CoreError::UnknownPolicy(_)
            | CoreError::BadKnob(_)
            | CoreError::AdminKeyRequired { .. } => "config",
            CoreError::BodyNotJson { .. } => "not_json",
            CoreError::BodyNotObject => "not_object",
            CoreError::MissingField { .. } => "missing_field",
            CoreError::WrongType { .. } => "wrong_type",
            CoreError::Tokenizer { .. } => "config",
        }
    }
}
