//! Golden bytes G1–G7 of `kv-events.md` §4 (msgspec 0.22.0 output), widths of §3.5, frame
//! shapes of §1–§2, and a proptest that no input panics the decoder. Bug cases B23, B26, B27.

use super::*;
use proptest::prelude::*;

/// Decodes a hex dump (whitespace ignored).
pub(crate) fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

const TS: f64 = 1_700_000_000.5;
/// vLLM sha256_cbor block 0 (tokens 1..16), `kv-events.md` §6.
const B0: u64 = 3_236_607_068_019_569_386;
/// vLLM sha256_cbor block 1 (tokens 17..32).
const B1: u64 = 2_758_186_210_834_249_151;

pub(crate) const G1: &str = "
93cb41d954fc40200000938aa474797065ab426c6f636b53746f726564ac626c
6f636b5f68617368657391cf2ceabcfae6d332eab1706172656e745f626c6f63
6b5f68617368c0a9746f6b656e5f696473dc00100102030405060708090a0b0c
0d0e0f10aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756d
a3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f6361
6368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a47479
7065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf2cea
bcfae6d332eaa66d656469756da3475055a967726f75705f6964780081a47479
7065b0416c6c426c6f636b73436c656172656400";

pub(crate) const G2: &str = "
93cb41d954fc40200000939aab426c6f636b53746f72656491cf2ceabcfae6d3
32eac0dc00100102030405060708090a0b0c0d0e0f1010c0a3475055c0c0c094
ac426c6f636b52656d6f76656491cf2ceabcfae6d332eaa3475055c091b0416c
6c426c6f636b73436c656172656400";

const G3: &str = "
93cb41d954fc402000009296ab426c6f636b53746f72656491cf2ceabcfae6d3
32eac0dc00100102030405060708090a0b0c0d0e0f1010c092ac426c6f636b52
656d6f76656491cf2ceabcfae6d332eac0";

const G4: &str = "
8aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391
cf26470bbec927f5bfb1706172656e745f626c6f636b5f68617368cf2ceabcfa
e6d332eaa9746f6b656e5f696473dc00101112131415161718191a1b1c1d1e1f
20aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da34750
55a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f6361636865
5f737065635f6b696e64ae66756c6c5f617474656e74696f6e";

const G5: &str = "
93cb41d954fc402000009297ab426c6f636b53746f72656491d3c0250e9be50f
3bf7cf4e42fb1deab81fa8dc00105152535455565758595a5b5c5d5e5f6010c0
a347505593ac426c6f636b52656d6f76656491d3c0250e9be50f3bf7a3475055
c0";

const G6: &str = "
83a27473cb41d954fc40200000a66576656e74739181a474797065b0416c6c42
6c6f636b73436c6561726564b2646174615f706172616c6c656c5f72616e6b00";

const G7: &str = "
83a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573
91c420202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6
d332eaa66d656469756da3435055";

fn stored_b0(medium: Option<&str>) -> KvEvent {
    KvEvent::Stored(BlockStored {
        block_hashes: vec![B0],
        parent_block_hash: None,
        token_ids: (1..=16).collect(),
        block_size: 16,
        medium: medium.map(str::to_owned),
        lora_name: None,
    })
}

fn removed(hashes: Vec<u64>, medium: Option<&str>) -> KvEvent {
    KvEvent::Removed(BlockRemoved {
        block_hashes: hashes,
        medium: medium.map(str::to_owned),
    })
}

/// Wraps one event's bytes in an array batch `[TS, [event], 0]`.
fn batch_of(event: &[u8]) -> Vec<u8> {
    let mut b = unhex("93cb41d954fc4020000091");
    b.extend_from_slice(event);
    b.push(0);
    b
}

/// B26: map-encoded events in an array batch.
#[test]
fn g1_map_events_decode() {
    let bytes = unhex(G1);
    assert_eq!(bytes.len(), 276);
    let b = decode_batch(&bytes).unwrap();
    assert_eq!(b.ts, TS);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.skipped_events, 0);
    assert_eq!(
        b.events,
        vec![
            stored_b0(Some("GPU")),
            removed(vec![B0], Some("GPU")),
            KvEvent::AllCleared
        ]
    );
}

/// B26: legacy array events decode to the same events as G1.
#[test]
fn g2_legacy_array_events_decode_like_g1() {
    let bytes = unhex(G2);
    assert_eq!(bytes.len(), 111);
    assert_eq!(
        decode_batch(&bytes).unwrap(),
        decode_batch(&unhex(G1)).unwrap()
    );
}

#[test]
fn g3_oldest_array_form() {
    let bytes = unhex(G3);
    assert_eq!(bytes.len(), 81);
    let b = decode_batch(&bytes).unwrap();
    assert_eq!(b.dp_rank, None);
    assert_eq!(b.events, vec![stored_b0(None), removed(vec![B0], None)]);
}

/// B30 shape: the child block names G1's block as parent.
#[test]
fn g4_child_block_map_form() {
    let ev = unhex(G4);
    assert_eq!(ev.len(), 185);
    let b = decode_batch(&batch_of(&ev)).unwrap();
    assert_eq!(
        b.events,
        vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![B1],
            parent_block_hash: Some(B0),
            token_ids: (17..=32).collect(),
            block_size: 16,
            medium: Some("GPU".into()),
            lora_name: None,
        })]
    );
}

/// B27: SGLang signed int64 hash (`d3`) normalises by two's complement.
#[test]
fn g5_sglang_negative_hash() {
    let bytes = unhex(G5);
    assert_eq!(bytes.len(), 97);
    let b = decode_batch(&bytes).unwrap();
    let h = (-4_601_255_381_563_393_033i64) as u64;
    assert_eq!(h, 13_845_488_692_146_158_583);
    assert_eq!(b.dp_rank, None);
    assert_eq!(
        b.events,
        vec![
            KvEvent::Stored(BlockStored {
                block_hashes: vec![h],
                parent_block_hash: Some(5_639_345_789_331_840_936),
                token_ids: (81..=96).collect(),
                block_size: 16,
                medium: Some("GPU".into()),
                lora_name: None,
            }),
            removed(vec![h], Some("GPU")),
        ]
    );
}

#[test]
fn g6_map_batch() {
    let bytes = unhex(G6);
    assert_eq!(bytes.len(), 64);
    let b = decode_batch(&bytes).unwrap();
    assert_eq!(b.ts, TS);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.events, vec![KvEvent::AllCleared]);
}

/// B27: a 32-byte `bin` digest normalises to its last 8 bytes, the same key as G1.
#[test]
fn g7_bin_hash_offload_tier() {
    let ev = unhex(G7);
    assert_eq!(ev.len(), 78);
    let b = decode_batch(&batch_of(&ev)).unwrap();
    assert_eq!(b.events, vec![removed(vec![B0], Some("CPU"))]);
}

/// §3.5 width example: `[5, 300, 70000, 2^33, −1, −200]`.
#[test]
fn every_int_width_normalises() {
    let ev = unhex(
        "82a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573
         96 05 cd012c ce00011170 cf0000000200000000 ff d1ff38",
    );
    let b = decode_batch(&batch_of(&ev)).unwrap();
    assert_eq!(
        b.events,
        vec![removed(
            vec![5, 300, 70_000, 1 << 33, u64::MAX, (-200i64) as u64],
            None
        )]
    );
    let neg = rmpv::decode::read_value(&mut &unhex("d3c0250e9be50f3bf7")[..]).unwrap();
    assert_eq!(hash(&neg), Some(13_845_488_692_146_158_583));
}

/// §3.2: unknown tags and non-event values are skipped, the rest of the batch stays; unknown
/// map keys and extra trailing array fields are ignored; both encodings mix in one batch.
#[test]
fn unknown_tags_keys_and_trailing_fields_are_ignored() {
    use rmpv::Value as V;
    let s = |x: &str| V::from(x);
    let stored_arr = V::Array(vec![
        s("BlockStored"),
        V::Array(vec![V::from(7u64)]),
        V::Nil,
        V::Array((0..4u64).map(V::from).collect()),
        V::from(4u64),
        V::Nil,
        V::Nil,
        V::Nil,
        V::Nil,
        V::Nil,
        V::Nil,
        V::Nil,
        s("future-field"),
        V::from(99u64),
    ]);
    let removed_map = V::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), V::Array(vec![V::from(7u64)])),
        (s("ownership"), s("shared")),
        (s("locality"), V::Map(vec![])),
    ]);
    let batch = V::Array(vec![
        V::F64(1.0),
        V::Array(vec![
            V::Map(vec![(s("type"), s("BlockPinned")), (s("x"), V::from(1u64))]),
            stored_arr,
            V::Array(vec![s("SomethingNew"), V::from(1u64)]),
            V::from(42u64),
            removed_map,
        ]),
        V::from(3u64),
        s("extra batch field"),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    let b = decode_batch(&bytes).unwrap();
    assert_eq!(b.dp_rank, Some(3));
    assert_eq!(b.skipped_events, 3);
    assert_eq!(
        b.events,
        vec![
            KvEvent::Stored(BlockStored {
                block_hashes: vec![7],
                parent_block_hash: None,
                token_ids: vec![0, 1, 2, 3],
                block_size: 4,
                medium: None,
                lora_name: None,
            }),
            removed(vec![7], None),
        ]
    );
}

#[test]
fn empty_event_list_is_a_valid_batch() {
    // [1.0, [], nil]
    let b = decode_batch(&unhex("93 cb3ff0000000000000 90 c0")).unwrap();
    assert!(b.events.is_empty());
    assert_eq!(b.dp_rank, None);
}

#[test]
fn malformed_batches_are_errors_not_panics() {
    let g1 = unhex(G1);
    assert_eq!(decode_batch(&g1[..100]), Err(DecodeError::Msgpack));
    let mut extra = g1.clone();
    extra.push(0xc0);
    assert_eq!(
        decode_batch(&extra),
        Err(DecodeError::TrailingBytes { extra: 1 })
    );
    assert_eq!(decode_batch(&unhex("05")), Err(DecodeError::NotABatch));
    assert_eq!(
        decode_batch(&unhex("92 00 05")),
        Err(DecodeError::NotABatch)
    );
    assert_eq!(decode_batch(&[]), Err(DecodeError::Msgpack));
    // BlockStored whose hash list is a string.
    let ev = unhex("92 ab426c6f636b53746f726564 a178");
    assert_eq!(
        decode_batch(&batch_of(&ev)),
        Err(DecodeError::BadField {
            index: 0,
            tag: "BlockStored",
            field: "block_hashes"
        })
    );
    // Token id above u32.
    let ev = unhex("94 ab426c6f636b53746f726564 9101 c0 91cf0000000100000000");
    assert!(matches!(
        decode_batch(&batch_of(&ev)),
        Err(DecodeError::BadField {
            field: "token_ids",
            ..
        })
    ));
}

#[test]
fn live_frames_split() {
    let f = vec![b"kv@x".to_vec(), 5u64.to_be_bytes().to_vec(), vec![0x90]];
    let l = split_live(&f).unwrap();
    assert_eq!(
        (l.topic, l.seq, l.payload),
        (&b"kv@x"[..], 5, &[0x90u8][..])
    );
    assert_eq!(
        split_live(&f[..2]),
        Err(DecodeError::FrameCount { frames: 2 })
    );
    let short = vec![vec![], vec![0, 1], vec![]];
    assert_eq!(split_live(&short), Err(DecodeError::SeqLength { len: 2 }));
}

/// B23: replies with and without the topic frame, with and without the delimiter, and the end
/// marker whatever precedes it.
#[test]
fn replay_frames_with_and_without_topic() {
    let seq = 9u64.to_be_bytes().to_vec();
    let end = vec![0xff; 8];
    let p = vec![0x90u8];
    let batch = ReplayFrames::Batch {
        seq: 9,
        payload: &[0x90],
    };
    for frames in [
        vec![seq.clone(), p.clone()],
        vec![vec![], seq.clone(), p.clone()],
        vec![b"topic".to_vec(), seq.clone(), p.clone()],
        vec![vec![], b"topic".to_vec(), seq.clone(), p.clone()],
    ] {
        assert_eq!(split_replay(&frames), Ok(batch), "{frames:?}");
    }
    for frames in [
        vec![end.clone(), vec![]],
        vec![vec![], end.clone(), vec![]],
        vec![b"t".to_vec(), end.clone(), vec![]],
        vec![vec![], b"t".to_vec(), end.clone(), vec![]],
    ] {
        assert_eq!(split_replay(&frames), Ok(ReplayFrames::End), "{frames:?}");
    }
    assert!(split_replay(std::slice::from_ref(&p)).is_err());
    assert!(split_replay(&[vec![1, 2], p]).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// No byte string panics the decoder.
    #[test]
    fn decoder_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    /// Random mutations of the golden batches never panic either (they reach deeper paths).
    #[test]
    fn decoder_never_panics_on_mutated_golden(
        which in 0usize..4,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut b = unhex([G1, G2, G3, G5][which]);
        for (i, x) in flips {
            let n = b.len();
            b[i % n] = x;
        }
        let n = b.len();
        b.truncate(n - cut % (n / 4 + 1));
        let _ = decode_batch(&b);
    }
}
