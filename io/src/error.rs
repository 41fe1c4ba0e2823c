//! Errors of the network layer and the one mapping from an error to a status code and an
//! OpenAI-shaped JSON body: `{"error":{"message","type","param","code"}}`.

/// A protocol error in an HTTP/1.1 message (ours to parse, from a client or a worker).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum HttpError {
    /// The request head exceeds the head limit or header count (→ 431).
    #[error("request head too large")]
    HeadTooLarge,
    /// The body exceeds `max_body_bytes` (→ 413).
    #[error("request body larger than {limit} bytes")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The bytes are not valid HTTP/1.1 (→ 400 for a client).
    #[error("malformed HTTP: {0}")]
    Malformed(&'static str),
    /// The client was too slow sending this part (`request head`, `request body`) (→ 408).
    #[error("timed out reading the {0}")]
    Timeout(&'static str),
}

impl HttpError {
    /// The status answered to the client: 431, 413, 400 or 408.
    pub fn status(&self) -> u16 {
        match self {
            HttpError::HeadTooLarge => 431,
            HttpError::BodyTooLarge { .. } => 413,
            HttpError::Malformed(_) => 400,
            HttpError::Timeout(_) => 408,
        }
    }

    /// Short metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            HttpError::HeadTooLarge => "head_too_large",
            HttpError::BodyTooLarge { .. } => "body_too_large",
            HttpError::Malformed(_) => "malformed",
            HttpError::Timeout(_) => "client_timeout",
        }
    }
}

/// Why one attempt of an exchange with a worker failed before its first body byte reached
/// kvroute. Every variant is the worker's fault, counts as a failure for its circuit breaker
/// (`kvroute_core::health`), and may be retried on another worker while the client has seen
/// nothing. Messages name the worker by id, never by its internal URL.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// Connecting to the worker failed (refused, unreachable, connect timeout) (→ 502).
    #[error("cannot connect to worker {worker}: {source}")]
    Connect {
        /// Worker id.
        worker: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// The attempt (connect, send, the worker's head and first body byte) did not finish
    /// within `--first-byte-timeout-secs` (→ 504).
    #[error("worker {worker} sent nothing within {secs} s")]
    Timeout {
        /// Worker id.
        worker: usize,
        /// The timeout, in seconds.
        secs: u64,
    },
    /// The worker's connection failed or it sent invalid HTTP (→ 502).
    #[error("worker {worker} failed: {message}")]
    Upstream {
        /// Worker id.
        worker: usize,
        /// What went wrong.
        message: String,
    },
}

impl ProxyError {
    /// The status sent to the client when no retry is left: 502 or 504.
    pub fn status(&self) -> u16 {
        match self {
            ProxyError::Connect { .. } | ProxyError::Upstream { .. } => 502,
            ProxyError::Timeout { .. } => 504,
        }
    }

    /// Short label for metrics (`kind`): `connect`, `first_byte_timeout`, `upstream`.
    pub fn kind(&self) -> &'static str {
        match self {
            ProxyError::Connect { .. } => "connect",
            ProxyError::Timeout { .. } => "first_byte_timeout",
            ProxyError::Upstream { .. } => "upstream",
        }
    }
}

/// Why `kvroute serve` could not start, or a fleet change was refused.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The config (or a worker spec) is invalid, or a tokenizer cannot be loaded.
    #[error(transparent)]
    Core(#[from] kvroute_core::CoreError),
    /// A socket, listener or thread could not be made (the message names the address).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A worker's host does not resolve.
    #[error("worker {url}: cannot resolve its host: {source}")]
    Resolve {
        /// The worker URL.
        url: String,
        /// The resolver's error.
        source: std::io::Error,
    },
    /// `--api-key-file` cannot be read.
    #[error("API key file {path}: {source}")]
    KeyFile {
        /// The path given.
        path: String,
        /// The read error.
        source: std::io::Error,
    },
}

/// `Retry-After` of every 503 the traffic port answers itself to a request (no eligible
/// worker, too many connections, shut down; not the probes' or the admin API's), seconds
/// (RFC 9110 §10.2.3). 1 s: the OpenAI Python client waits what `Retry-After` says (up to
/// 60 s) instead of its own backoff (0.5 s, doubling, up to 8 s), and a worker's breaker or
/// health standing can change within a second (a passed half-open probe, a re-added
/// worker), so a client is not held back longer than the earliest moment a retry could
/// succeed.
pub const RETRY_AFTER_SECS: &str = "1";

/// OpenAI error `type` for a status: `invalid_request_error` for 4xx, else `server_error`
/// (kvroute adds `upstream_error` / `timeout_error` for 502 / 504).
pub fn error_type(status: u16) -> &'static str {
    match status {
        400..=499 => "invalid_request_error",
        502 => "upstream_error",
        504 => "timeout_error",
        _ => "server_error",
    }
}

/// The JSON error body `{"error":{"message":..,"type":..,"param":null,"code":status}}`:
/// OpenAI's shape, whose `param` (the offending parameter) is always present, `null` when
/// none is named, as vLLM's is.
pub fn error_body(status: u16, message: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "error": {"message": message, "type": error_type(status), "param": null, "code": status}
    }))
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_body_shape() {
        assert_eq!(HttpError::HeadTooLarge.status(), 431);
        assert_eq!(HttpError::BodyTooLarge { limit: 1 }.status(), 413);
        assert_eq!(HttpError::Timeout("request head").status(), 408);
        let t = ProxyError::Timeout { worker: 3, secs: 1 };
        assert_eq!((t.status(), t.kind()), (504, "first_byte_timeout"));
        assert_eq!(t.to_string(), "worker 3 sent nothing within 1 s");
        let v: serde_json::Value = serde_json::from_slice(&error_body(413, "too big")).unwrap();
        assert_eq!(v["error"]["code"], 413);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "too big");
        assert_eq!(v["error"].get("param"), Some(&serde_json::Value::Null));
        let v: serde_json::Value = serde_json::from_slice(&error_body(503, "x")).unwrap();
        assert_eq!(v["error"]["type"], "server_error");
    }
}
