//! Fuzzes the KV-event decoder of `kvroute_core::events::decode`: the msgpack payload
//! decoder (`decode_batch`) on the raw input, and the ZMQ frame splitters (`split_live`,
//! `split_replay`) on frames cut from the input.
//!
//! Properties beyond "no panic":
//! - a decoded batch has one entry (event or skip) per element of the payload's event list;
//! - re-encoding a decoded batch as msgpack (array form and map form) decodes to the same
//!   batch with no skips (hashes, token ids, sizes, media and LoRA names survive);
//! - `split_live` accepts exactly 3 frames with an 8-byte seq and returns them unchanged.

#![no_main]

use kvroute_core::events::decode::{ReplayFrames, decode_batch, split_live, split_replay};
use kvroute_core::events::{DecodeError, EventBatch, KvEvent};
use libfuzzer_sys::fuzz_target;
use rmpv::Value;

fuzz_target!(|data: &[u8]| {
    payload(data);
    frames(data);
});

fn payload(data: &[u8]) {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    let value = rmpv::decode::read_value(&mut &data[..]).expect("decoded, so valid msgpack");
    let listed = match &value {
        Value::Array(a) => a.get(1),
        Value::Map(m) => m
            .iter()
            .find(|(k, _)| k.as_str() == Some("events"))
            .map(|(_, v)| v),
        _ => None,
    };
    let Some(Value::Array(listed)) = listed else {
        panic!("decoded a batch without an event list");
    };
    assert_eq!(
        batch.events.len() + batch.skipped_events as usize,
        listed.len(),
        "events + skipped != listed"
    );
    for as_map in [false, true] {
        let bytes = encode(&batch, as_map);
        let again = decode_batch(&bytes).expect("a re-encoded batch decodes");
        assert_eq!(again.skipped_events, 0);
        assert_eq!(again.ts.to_bits(), batch.ts.to_bits());
        assert_eq!(again.dp_rank, batch.dp_rank);
        assert_eq!(again.events, batch.events, "map form: {as_map}");
    }
}

/// `batch` as msgpack: `[ts, events, rank]` with tagged-array events, or the map form with
/// `type`-tagged map events.
fn encode(batch: &EventBatch, as_map: bool) -> Vec<u8> {
    let s = |x: &str| Value::from(x);
    let opt_str = |x: &Option<String>| x.as_deref().map_or(Value::Nil, Value::from);
    let hashes = |h: &[u64]| Value::Array(h.iter().map(|&x| Value::from(x)).collect());
    let events = batch
        .events
        .iter()
        .map(|e| {
            let fields: Vec<(&str, Value)> = match e {
                KvEvent::Stored(b) => vec![
                    ("type", s("BlockStored")),
                    ("block_hashes", hashes(&b.block_hashes)),
                    (
                        "parent_block_hash",
                        b.parent_block_hash.map_or(Value::Nil, Value::from),
                    ),
                    (
                        "token_ids",
                        Value::Array(b.token_ids.iter().map(|&t| Value::from(t)).collect()),
                    ),
                    ("block_size", Value::from(b.block_size as u64)),
                    ("lora_id", Value::Nil),
                    ("medium", opt_str(&b.medium)),
                    ("lora_name", opt_str(&b.lora_name)),
                ],
                KvEvent::Removed(r) => vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", hashes(&r.block_hashes)),
                    ("medium", opt_str(&r.medium)),
                ],
                KvEvent::AllCleared => vec![("type", s("AllBlocksCleared"))],
            };
            if as_map {
                Value::Map(fields.into_iter().map(|(k, v)| (s(k), v)).collect())
            } else {
                // Tagged array: the tag, then the fields by position.
                let mut it = fields.into_iter().map(|(_, v)| v);
                let tag = it.next().expect("a tag");
                Value::Array(std::iter::once(tag).chain(it).collect())
            }
        })
        .collect();
    let rank = batch.dp_rank.map_or(Value::Nil, Value::from);
    let v = if as_map {
        Value::Map(vec![
            (s("ts"), Value::F64(batch.ts)),
            (s("events"), Value::Array(events)),
            (s("data_parallel_rank"), rank),
        ])
    } else {
        Value::Array(vec![Value::F64(batch.ts), Value::Array(events), rank])
    };
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).expect("writing to a Vec cannot fail");
    out
}

/// Frames cut from the input: the first byte is the frame count (mod 5), then each frame
/// is a length byte and that many bytes (the last takes what remains).
fn frames(data: &[u8]) {
    let Some((&n, mut rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 5);
    let mut frames = Vec::with_capacity(n);
    for i in 0..n {
        let take = if i + 1 == n {
            rest.len()
        } else {
            match rest.split_first() {
                Some((&len, tail)) => {
                    rest = tail;
                    usize::from(len).min(rest.len())
                }
                None => 0,
            }
        };
        frames.push(rest[..take].to_vec());
        rest = &rest[take..];
    }
    match split_live(&frames) {
        Ok(live) => {
            assert_eq!(frames.len(), 3);
            assert_eq!(live.topic, &frames[0][..]);
            assert_eq!(live.seq.to_be_bytes()[..], frames[1][..]);
            assert_eq!(live.payload, &frames[2][..]);
            let _ = decode_batch(live.payload);
        }
        Err(DecodeError::FrameCount { frames: got }) => {
            assert_eq!(got, frames.len());
            assert_ne!(got, 3);
        }
        Err(DecodeError::SeqLength { len }) => {
            assert_eq!(frames.len(), 3);
            assert_eq!(len, frames[1].len());
            assert_ne!(len, 8);
        }
        Err(e) => panic!("split_live: unexpected error {e:?}"),
    }
    match split_replay(&frames) {
        Ok(ReplayFrames::End) => {
            assert!(
                frames.last().is_some_and(Vec::is_empty),
                "end marker with a payload"
            );
        }
        Ok(ReplayFrames::Batch { seq, payload }) => {
            let last = frames.last().expect("a batch has frames");
            assert_eq!(payload, &last[..]);
            assert_eq!(frames[frames.len() - 2][..], seq.to_be_bytes()[..]);
            let _ = decode_batch(payload);
        }
        Err(DecodeError::FrameCount { .. } | DecodeError::SeqLength { .. }) => {}
        Err(e) => panic!("split_replay: unexpected error {e:?}"),
    }
}
