//! Test helpers: a blocking HTTP/1.1 client over std sockets (a different implementation from
//! the gateway's, so a framing bug on one side shows), and fleet set-up on loopback.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A response as the client saw it.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// Body with chunked framing removed.
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// `POST path` with a JSON body on a new connection (closed after).
pub fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Response {
    let body = serde_json::to_vec(body).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let mut raw = head.into_bytes();
    raw.extend_from_slice(&body);
    send_raw(addr, &raw)
}

/// `GET path` on a new connection.
pub fn get(addr: SocketAddr, path: &str) -> Response {
    send_raw(
        addr,
        format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").as_bytes(),
    )
}

/// Opens a connection and sends `POST path` with `body`, leaving the response unread (for
/// streams the test reads or drops itself). Read timeout 10 s.
pub fn open_post(addr: SocketAddr, path: &str, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body).expect("write body");
    s
}

/// Sends `raw` on a new connection and reads one response (bounded: 30 s).
pub fn send_raw(addr: SocketAddr, raw: &[u8]) -> Response {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(raw).expect("write");
    read_response(&mut s)
}

/// Reads one response from `s`.
pub fn read_response(s: &mut TcpStream) -> Response {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut tmp).expect("read head");
        assert!(
            n > 0,
            "connection closed before the response head: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (n, v) = l.split_once(':').unwrap();
            (n.trim().to_string(), v.trim().to_string())
        })
        .collect();
    let mut rest = buf[head_end..].to_vec();
    let get = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    let body = if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut body = Vec::new();
        loop {
            // need a full size line
            while find(&rest, b"\r\n").is_none() {
                let n = s.read(&mut tmp).expect("read chunk");
                assert!(n > 0, "closed inside chunked body");
                rest.extend_from_slice(&tmp[..n]);
            }
            let line_end = find(&rest, b"\r\n").unwrap();
            let size_str = String::from_utf8_lossy(&rest[..line_end]).to_string();
            let size =
                usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16).unwrap();
            while rest.len() < line_end + 2 + size + 2 {
                let n = s.read(&mut tmp).expect("read chunk data");
                assert!(n > 0, "closed inside chunk");
                rest.extend_from_slice(&tmp[..n]);
            }
            body.extend_from_slice(&rest[line_end + 2..line_end + 2 + size]);
            rest.drain(..line_end + 2 + size + 2);
            if size == 0 {
                break;
            }
        }
        body
    } else if let Some(len) = get("content-length") {
        let len: usize = len.parse().unwrap();
        while rest.len() < len {
            let n = s.read(&mut tmp).expect("read body");
            assert!(n > 0, "closed inside body");
            rest.extend_from_slice(&tmp[..n]);
        }
        rest.truncate(len);
        rest
    } else {
        s.read_to_end(&mut rest).ok();
        rest
    };
    Response {
        status,
        headers,
        body,
    }
}

pub fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Polls `f` every 10 ms until it returns true or `limit` passes; returns the last result.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let until = std::time::Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The gateway's `/metrics` text once `ready` holds for it, scraped every 10 ms for at most
/// `limit`; the last scrape when it never does (the caller's assertions then fail on it).
/// For counters a request's record adds when it is dropped, after its response's last byte
/// went out: a client can read the response and scrape before that.
pub fn metrics_when(
    addr: SocketAddr,
    limit: Duration,
    mut ready: impl FnMut(&str) -> bool,
) -> String {
    let mut text = String::new();
    wait_until(limit, || {
        text = get(addr, "/metrics").text();
        ready(&text)
    });
    text
}

/// The value of a Prometheus sample whose line starts with `prefix` (name and labels).
pub fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}
