//! The HTTP/1.1 client of the test bed's load tools ([`crate::replay`], [`crate::load`]): the
//! target URL ([`Target`]), one connection ([`Conn`]: hyper's HTTP/1.1 client over a tokio TCP
//! stream with `TCP_NODELAY`) and the JSON `POST` both send.

use bytes::Bytes;
use http::{HeaderValue, Uri};
use http_body_util::Full;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// Path of the OpenAI chat completions route.
pub const CHAT_COMPLETIONS_PATH: &str = "/v1/chat/completions";

/// A URL that is not `http://host[:port][/path]` (no TLS, no user info).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad url {url:?}: {reason}")]
pub struct BadUrl {
    /// The URL given.
    pub url: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// Where requests go: the host and port to connect to, the `Host` header and the request path.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// Host to connect to (an IPv6 literal without its brackets).
    pub(crate) host: String,
    /// TCP port (80 when the URL has none).
    pub(crate) port: u16,
    /// `Host` header: the URL's authority as written.
    pub(crate) authority: HeaderValue,
    /// Request path (and query), always starting with `/`.
    pub(crate) path: Uri,
}

impl Target {
    /// Parses `http://host[:port][/path]`; the request path is `route(p)`, where `p` is the
    /// URL's path without its trailing `/` (`""` for `http://host:port` and
    /// `http://host:port/`).
    ///
    /// # Errors
    /// [`BadUrl`]: not a URI, not `http://`, no host, or `route` gives no valid absolute path.
    pub(crate) fn parse(url: &str, route: impl FnOnce(&str) -> String) -> Result<Self, BadUrl> {
        let bad = |reason| BadUrl {
            url: url.to_string(),
            reason,
        };
        let uri: Uri = url.parse().map_err(|_| bad("not a URI"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(_) => return Err(bad("only http:// is supported")),
            None => return Err(bad("missing http:// scheme")),
        }
        let authority = uri.authority().ok_or_else(|| bad("missing host"))?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let mut path = route(uri.path().trim_end_matches('/'));
        if let Some(q) = uri.query() {
            path = format!("{path}?{q}");
        }
        if !path.starts_with('/') {
            return Err(bad("the request path must start with /"));
        }
        Ok(Self {
            host: host.to_string(),
            port: authority.port_u16().unwrap_or(80),
            authority: HeaderValue::from_str(authority.as_str()).map_err(|_| bad("bad host"))?,
            path: path.parse().map_err(|_| bad("bad path"))?,
        })
    }

    /// `POST {path}` with `body` as `application/json`, `Accept: text/event-stream` when `sse`
    /// (else `application/json`).
    pub(crate) fn post_json(&self, body: Bytes, sse: bool) -> hyper::Request<Full<Bytes>> {
        let accept = if sse {
            HeaderValue::from_static("text/event-stream")
        } else {
            HeaderValue::from_static("application/json")
        };
        let mut req = hyper::Request::new(Full::new(body));
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = self.path.clone();
        let h = req.headers_mut();
        h.insert(http::header::HOST, self.authority.clone());
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(http::header::ACCEPT, accept);
        req
    }
}

/// One HTTP/1.1 client connection. Its driver runs in a task of its own, aborted when the
/// `Conn` is dropped (which closes the socket).
pub(crate) struct Conn {
    /// Sends requests on the connection, one at a time.
    pub(crate) sender: SendRequest<Full<Bytes>>,
    driver: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// Why [`Conn::open`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnectError {
    /// The TCP connect failed.
    Connect,
    /// The HTTP/1.1 handshake failed.
    Handshake,
}

impl ConnectError {
    /// The error kind of the reports: `connect` or `transport`.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Handshake => "transport",
        }
    }
}

impl Conn {
    /// Connects to `target` (TCP, `TCP_NODELAY`, HTTP/1.1 handshake). Must run inside a tokio
    /// runtime with the net driver; not bounded in time by itself (callers wrap it in their
    /// timeout).
    ///
    /// # Errors
    /// [`ConnectError`]: the step that failed.
    pub(crate) async fn open(target: &Target) -> Result<Self, ConnectError> {
        let stream = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(|_| ConnectError::Connect)?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| ConnectError::Handshake)?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Self { sender, driver })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_targets() {
        let chat = |p: &str| format!("{p}{CHAT_COMPLETIONS_PATH}");
        let t = Target::parse("http://127.0.0.1:8000", chat).unwrap();
        assert_eq!((t.host.as_str(), t.port), ("127.0.0.1", 8000));
        assert_eq!(t.path, "/v1/chat/completions");
        assert_eq!(t.authority, "127.0.0.1:8000");
        let t = Target::parse("http://localhost/api/", chat).unwrap();
        assert_eq!((t.host.as_str(), t.port), ("localhost", 80));
        assert_eq!(t.path, "/api/v1/chat/completions");
        let t = Target::parse("http://[::1]:9/x?a=1", |p| p.to_string()).unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 9));
        assert_eq!(t.path, "/x?a=1");
        assert!(Target::parse("https://x", chat).is_err());
        assert!(Target::parse("127.0.0.1:8000", chat).is_err());
        assert!(Target::parse("http://h:1", |p| p.to_string()).is_err());
    }
}
