//! Fuzzes `kvroute_core::tokens::parse_routing_tokens`, the parser of the
//! `x-kvroute-routing-tokens` header.
//!
//! Properties beyond "no panic":
//! - it agrees with a reference parser written differently here (byte scan, checked
//!   arithmetic), result for result and error for error;
//! - accepted ids respect the limits, and written back as `a,b,c` parse to themselves.

#![no_main]

use kvroute_core::tokens::{
    HeaderRejection, MAX_HEADER_BYTES, MAX_HEADER_IDS, parse_routing_tokens,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let got = parse_routing_tokens(data);
    assert_eq!(
        got,
        reference(data),
        "input {:?}",
        String::from_utf8_lossy(data)
    );
    if let Ok(ids) = got {
        assert!(!ids.is_empty() && ids.len() <= MAX_HEADER_IDS);
        let written = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        assert!(written.len() <= data.len());
        assert_eq!(parse_routing_tokens(written.as_bytes()), Ok(ids));
    }
});

/// The header grammar as the doc states it: at most `MAX_HEADER_BYTES` bytes; items split
/// on `,`, each optional spaces / tabs around one or more ASCII digits whose value fits a
/// `u32`; an item that is not digits wins over "too many" (item `MAX_HEADER_IDS + 1`),
/// which wins over an out-of-range value.
fn reference(value: &[u8]) -> Result<Vec<u32>, HeaderRejection> {
    if value.len() > MAX_HEADER_BYTES {
        return Err(HeaderRejection::TooLong);
    }
    if std::str::from_utf8(value).is_err() {
        return Err(HeaderRejection::Malformed);
    }
    let mut ids = Vec::new();
    let mut start = 0;
    loop {
        let end = value[start..]
            .iter()
            .position(|&b| b == b',')
            .map_or(value.len(), |p| start + p);
        let mut item = &value[start..end];
        while let [b' ' | b'\t', tail @ ..] = item {
            item = tail;
        }
        while let [head @ .., b' ' | b'\t'] = item {
            item = head;
        }
        if item.is_empty() || item.iter().any(|b| !b.is_ascii_digit()) {
            return Err(HeaderRejection::Malformed);
        }
        if ids.len() == MAX_HEADER_IDS {
            return Err(HeaderRejection::TooMany);
        }
        let n = item.iter().try_fold(0u32, |n, &b| {
            n.checked_mul(10)?.checked_add(u32::from(b - b'0'))
        });
        ids.push(n.ok_or(HeaderRejection::Malformed)?);
        if end == value.len() {
            return Ok(ids);
        }
        start = end + 1;
    }
}
