//! Fuzzes the HTTP/1.1 framing of `kvroute_io::http1`: request heads (then the chunked body
//! decoder on the bytes after a chunked head) and response heads.
//!
//! Properties beyond "no panic":
//! - a parsed head's length is at most the input's and the head limit, and every strict
//!   prefix of the head is incomplete (`Ok(None)`);
//! - a request head written back as text parses to the same fields; a response head
//!   written with `write_response_head` parses to the same status, headers and framing;
//! - the chunked decoder consumes at most its input, stops only at the end of the body or
//!   at an error, and gives the same result fed at once or byte by byte; its data re-encoded
//!   as one chunk decodes to the same data.

#![no_main]

use kvroute_io::http1::{
    ChunkedDecoder, Framing, MAX_HEADERS, RequestHead, is_hop_by_hop, parse_request_head,
    parse_response_head, write_response_head,
};
use libfuzzer_sys::fuzz_target;

/// Head limit used here: small, so the over-limit paths are reached by short inputs too.
const MAX_HEAD: usize = 2048;

fuzz_target!(|data: &[u8]| {
    request(data);
    response(data, "POST");
    response(data, "HEAD");
});

fn request(data: &[u8]) {
    let (head, len) = match parse_request_head(data, MAX_HEAD) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => {
            assert!(data.len() <= MAX_HEAD, "incomplete head over the limit");
            return;
        }
        Err(_) => return,
    };
    assert!(len <= data.len() && len <= MAX_HEAD, "head length {len}");
    assert!(head.headers.len() <= MAX_HEADERS);
    assert!(head.minor_version <= 1);
    assert!(head.target.starts_with(head.path()));
    for cut in [len - 1, len / 2] {
        assert!(
            matches!(parse_request_head(&data[..cut], MAX_HEAD), Ok(None)),
            "prefix of {cut} of a {len}-byte head is not incomplete"
        );
    }
    let again = parse_request_head(&data[..len], MAX_HEAD)
        .expect("the head alone parses")
        .expect("the head alone is complete");
    assert_eq!(again.1, len);
    let rewritten = write_request(&head);
    let (back, back_len) = parse_request_head(&rewritten, usize::MAX)
        .expect("a written head parses")
        .expect("a written head is complete");
    assert_eq!(back_len, rewritten.len());
    assert_eq!(back.method, head.method);
    assert_eq!(back.target, head.target);
    assert_eq!(back.minor_version, head.minor_version);
    assert_eq!(back.headers, head.headers);
    assert_eq!(back.framing, head.framing);
    assert_eq!(back.keep_alive, head.keep_alive);
    assert_eq!(back.expect_continue, head.expect_continue);
    if head.framing == Framing::Chunked {
        chunked(&data[len..]);
    }
}

/// The head as text: request line, header lines, blank line.
fn write_request(head: &RequestHead) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(head.method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(head.target.as_bytes());
    out.extend_from_slice(format!(" HTTP/1.{}\r\n", head.minor_version).as_bytes());
    for (name, value) in head.headers.iter() {
        kvroute_io::http1::push_header(&mut out, name, value);
    }
    out.extend_from_slice(b"\r\n");
    out
}

fn chunked(body: &[u8]) {
    let mut whole = ChunkedDecoder::new();
    let mut data = Vec::new();
    let at_once = whole.feed(body, Some(&mut data));
    if let Ok(n) = at_once {
        assert!(n <= body.len());
        assert!(
            data.len() <= n,
            "more data ({}) than bytes ({n})",
            data.len()
        );
        assert!(
            whole.is_done() || n == body.len(),
            "stopped early, not done"
        );
        if whole.is_done() {
            assert_eq!(
                whole.feed(b"0\r\n\r\n", None).ok(),
                Some(0),
                "fed after done"
            );
        }
    }
    // The same bytes one at a time: same consumed count, same end, same data.
    let mut bytewise = ChunkedDecoder::new();
    let mut data2 = Vec::new();
    let mut consumed = 0;
    let mut failed = false;
    for b in body {
        if bytewise.is_done() {
            break;
        }
        match bytewise.feed(std::slice::from_ref(b), Some(&mut data2)) {
            Ok(n) => consumed += n,
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    match at_once {
        Ok(n) => {
            assert!(!failed, "bytewise feed failed where the whole feed did not");
            assert_eq!(consumed, n);
            assert_eq!(bytewise.is_done(), whole.is_done());
            assert_eq!(data2, data);
        }
        Err(_) => assert!(failed, "whole feed failed where the bytewise feed did not"),
    }
    // The decoded data as one chunk decodes back to itself.
    if whole.is_done() {
        let mut wire = Vec::new();
        if !data.is_empty() {
            wire.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
            wire.extend_from_slice(&data);
            wire.extend_from_slice(b"\r\n");
        }
        wire.extend_from_slice(b"0\r\n\r\n");
        let mut dec = ChunkedDecoder::new();
        let mut out = Vec::new();
        assert_eq!(dec.feed(&wire, Some(&mut out)).ok(), Some(wire.len()));
        assert!(dec.is_done());
        assert_eq!(out, data);
    }
}

fn response(data: &[u8], method: &str) {
    let (head, len) = match parse_response_head(data, method, MAX_HEAD) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => {
            assert!(data.len() <= MAX_HEAD, "incomplete head over the limit");
            return;
        }
        Err(_) => return,
    };
    // The doc promises HeadTooLarge for a head over the limit, complete or not.
    assert!(len <= data.len() && len <= MAX_HEAD, "head length {len}");
    assert!(head.headers.len() <= MAX_HEADERS);
    assert!(head.status <= 999, "status {}", head.status);
    let no_body =
        method == "HEAD" || (100..200).contains(&head.status) || [204, 304].contains(&head.status);
    if no_body {
        assert_eq!(head.framing, Framing::Empty);
    }
    if head.framing == Framing::UntilClose {
        assert!(!head.keep_alive);
    }
    assert!(matches!(
        parse_response_head(&data[..len - 1], method, MAX_HEAD),
        Ok(None)
    ));
    // Written back as kvroute forwards it (hop-by-hop headers dropped, framing re-stated).
    if !matches!(head.framing, Framing::Length(_) | Framing::Chunked) {
        return;
    }
    let kept: Vec<(String, Vec<u8>)> = head
        .headers
        .iter()
        .filter(|(n, _)| !is_hop_by_hop(n))
        .map(|(n, v)| (n.to_string(), v.to_vec()))
        .collect();
    let mut out = Vec::new();
    write_response_head(
        &mut out,
        head.status,
        &head.reason,
        &kept,
        head.framing,
        &[],
    );
    let (back, back_len) = parse_response_head(&out, method, usize::MAX)
        .expect("a written head parses")
        .expect("a written head is complete");
    assert_eq!(back_len, out.len());
    assert_eq!(back.status, head.status);
    if !head.reason.is_empty() {
        assert_eq!(back.reason, head.reason);
    }
    assert_eq!(back.framing, head.framing);
    let back_kept: Vec<_> = back
        .headers
        .iter()
        .filter(|(n, _)| !is_hop_by_hop(n))
        .map(|(n, v)| (n.to_string(), v.to_vec()))
        .collect();
    assert_eq!(back_kept, kept);
}
