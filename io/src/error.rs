//! Errors of the network layer and the one mapping from an error to a status code and an
//! OpenAI-shaped JSON body: `{"error":{"message","type","code"}}`.

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
}

/// Who caused a failed exchange (as in Pingora's error blame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The client sent something invalid, or went away.
    Client,
    /// The worker refused, timed out, or broke the protocol.
    Worker,
    /// kvroute itself.
    Internal,
}

/// Why one proxied exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The client's request is invalid.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// The body is not a valid request for this route.
    #[error("{0}")]
    BadRequest(String),
    /// Connecting to the worker failed (refused, unreachable, connect timeout).
    #[error("cannot connect to worker {worker}: {source}")]
    Connect {
        /// Worker URL.
        worker: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The worker did not answer within `--request-timeout-secs`.
    #[error("worker {worker} did not respond within {secs} s")]
    Timeout {
        /// Worker URL.
        worker: String,
        /// The timeout, in seconds.
        secs: u64,
    },
    /// The worker's connection failed or it sent invalid HTTP.
    #[error("worker {worker} failed: {message}")]
    Upstream {
        /// Worker URL.
        worker: String,
        /// What went wrong.
        message: String,
    },
}

impl ProxyError {
    /// Who is to blame.
    pub fn blame(&self) -> Blame {
        match self {
            ProxyError::Http(_) | ProxyError::BadRequest(_) => Blame::Client,
            ProxyError::Connect { .. }
            | ProxyError::Timeout { .. }
            | ProxyError::Upstream { .. } => Blame::Worker,
        }
    }

    /// The status code sent to the client: 400, 413, 431, 502 or 504.
    pub fn status(&self) -> u16 {
        match self {
            ProxyError::Http(HttpError::HeadTooLarge) => 431,
            ProxyError::Http(HttpError::BodyTooLarge { .. }) => 413,
            ProxyError::Http(HttpError::Malformed(_)) | ProxyError::BadRequest(_) => 400,
            ProxyError::Connect { .. } | ProxyError::Upstream { .. } => 502,
            ProxyError::Timeout { .. } => 504,
        }
    }

    /// Short label for metrics (`kind`).
    pub fn kind(&self) -> &'static str {
        match self {
            ProxyError::Http(HttpError::HeadTooLarge) => "head_too_large",
            ProxyError::Http(HttpError::BodyTooLarge { .. }) => "body_too_large",
            ProxyError::Http(HttpError::Malformed(_)) => "malformed",
            ProxyError::BadRequest(_) => "bad_request",
            ProxyError::Connect { .. } => "connect",
            ProxyError::Timeout { .. } => "timeout",
            ProxyError::Upstream { .. } => "upstream",
        }
    }
}

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

/// The JSON error body `{"error":{"message":..,"type":..,"code":status}}`.
pub fn error_body(status: u16, message: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "error": {"message": message, "type": error_type(status), "code": status}
    }))
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_body_shape() {
        assert_eq!(ProxyError::from(HttpError::HeadTooLarge).status(), 431);
        assert_eq!(
            ProxyError::from(HttpError::BodyTooLarge { limit: 1 }).status(),
            413
        );
        assert_eq!(ProxyError::BadRequest("x".into()).status(), 400);
        let t = ProxyError::Timeout {
            worker: "w".into(),
            secs: 1,
        };
        assert_eq!((t.status(), t.blame()), (504, Blame::Worker));
        let v: serde_json::Value = serde_json::from_slice(&error_body(413, "too big")).unwrap();
        assert_eq!(v["error"]["code"], 413);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "too big");
    }
}
