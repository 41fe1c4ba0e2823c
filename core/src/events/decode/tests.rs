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

// Partition and group golden bytes: msgspec 0.23.0 output of mirrors of vLLM's
// `BlockStored` / `BlockRemoved` (array_like as v0.23, and the map form) and SGLang's
// `BlockStoredWithMetadata`, built per `kv-events.md` §3.3–§3.4 and §4 (same ts, hashes,
// tokens as G1/G4).

/// H1 — hybrid model, array form (vLLM after PR #40984, 178 B): one step in which group 0
/// (`full_attention`) and group 1 (`sliding_window`, window 128) both store G1's block
/// (same engine hash: the group id is stripped before publishing), then group 1 evicts it.
pub(crate) const H1: &str = "
93cb41d954fc40200000939cab426c6f636b53746f72656491cf2ceabcfae6d3
32eac0dc00100102030405060708090a0b0c0d0e0f1010c0a3475055c0c000ae
66756c6c5f617474656e74696f6ec09cab426c6f636b53746f72656491cf2cea
bcfae6d332eac0dc00100102030405060708090a0b0c0d0e0f1010c0a3475055
c0c001ae736c6964696e675f77696e646f77cc8094ac426c6f636b52656d6f76
656491cf2ceabcfae6d332eaa34750550100";

/// H2 — the same three events as H1 in map form (461 B).
pub(crate) const H2: &str = "
93cb41d954fc40200000938aa474797065ab426c6f636b53746f726564ac626c
6f636b5f68617368657391cf2ceabcfae6d332eab1706172656e745f626c6f63
6b5f68617368c0a9746f6b656e5f696473dc00100102030405060708090a0b0c
0d0e0f10aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756d
a3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f6361
6368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e8ba47479
7065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf2ceabc
fae6d332eab1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69
6473dc00100102030405060708090a0b0c0d0e0f10aa626c6f636b5f73697a65
10a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0
a967726f75705f69647801b26b765f63616368655f737065635f6b696e64ae73
6c6964696e675f77696e646f77bc6b765f63616368655f737065635f736c6964
696e675f77696e646f77cc8084a474797065ac426c6f636b52656d6f766564ac
626c6f636b5f68617368657391cf2ceabcfae6d332eaa66d656469756da34750
55a967726f75705f6964780100";

/// H3 — `group_idx` without `kv_cache_spec_kind` (vLLM PR #37688 before #40984, 120 B):
/// groups 0 and 1 store G1's block.
pub(crate) const H3: &str = "
93cb41d954fc40200000929cab426c6f636b53746f72656491cf2ceabcfae6d3
32eac0dc00100102030405060708090a0b0c0d0e0f1010c0a3475055c0c000c0
c09cab426c6f636b53746f72656491cf2ceabcfae6d332eac0dc001001020304
05060708090a0b0c0d0e0f1010c0a3475055c0c001c0c000";

/// P1 — LoRA and cache salt, array form (142 B): `lora_name` "sql-lora", two blocks (G1's and
/// G4's tokens), `extra_keys` `[("sql-lora", "tenant-a"), ("sql-lora",)]` (vLLM: the LoRA
/// name in every block, the salt in the sequence's first only), group 0 full attention.
pub(crate) const P1: &str = "
93cb41d954fc40200000919cab426c6f636b53746f72656492cf2ceabcfae6d3
32eacf26470bbec927f5bfc0dc00200102030405060708090a0b0c0d0e0f1011
12131415161718191a1b1c1d1e1f201003a3475055a873716c2d6c6f72619292
a873716c2d6c6f7261a874656e616e742d6191a873716c2d6c6f726100ae6675
6c6c5f617474656e74696f6ec000";

/// P2 — salt only, map form (219 B): `extra_keys` `[(("img-1", 4), "tenant-a")]` (a
/// multimodal key, then the salt).
pub(crate) const P2: &str = "
93cb41d954fc40200000918ba474797065ab426c6f636b53746f726564ac626c
6f636b5f68617368657391cf2ceabcfae6d332eab1706172656e745f626c6f63
6b5f68617368c0a9746f6b656e5f696473dc00100102030405060708090a0b0c
0d0e0f10aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756d
a3475055a96c6f72615f6e616d65c0aa65787472615f6b657973919292a5696d
672d3104a874656e616e742d61a967726f75705f69647800b26b765f63616368
655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00";

/// P3 — SGLang `BlockStoredWithMetadata`, array form (79 B): field 7 is
/// `metadata: {cache_salt: "tenant-a"}`, batch rank nil.
pub(crate) const P3: &str = "
93cb41d954fc402000009198ab426c6f636b53746f72656491cf2ceabcfae6d3
32eac0dc00100102030405060708090a0b0c0d0e0f1010c0c081aa6361636865
5f73616c74a874656e616e742d61c0";

/// P4 — malformed (66 B): `lora_name` is the int 7.
pub(crate) const P4: &str = "
93cb41d954fc40200000919cab426c6f636b53746f72656491cf2ceabcfae6d3
32eac0dc00100102030405060708090a0b0c0d0e0f1010c0a347505507c0c0c0
c000";

fn stored_b0(medium: Option<&str>) -> KvEvent {
    KvEvent::Stored(BlockStored {
        block_hashes: vec![B0],
        parent_block_hash: None,
        token_ids: (1..=16).collect(),
        block_size: 16,
        medium: medium.map(str::to_owned),
        lora_name: None,
        ..Default::default()
    })
}

fn removed(hashes: Vec<u64>, medium: Option<&str>) -> KvEvent {
    KvEvent::Removed(BlockRemoved {
        block_hashes: hashes,
        medium: medium.map(str::to_owned),
        ..Default::default()
    })
}

/// `ev` with the group fields G1 and G4 carry: group 0, `full_attention`.
fn in_group0(ev: KvEvent) -> KvEvent {
    match ev {
        KvEvent::Stored(mut s) => {
            s.group_idx = Some(0);
            s.kv_cache_spec_kind = Some("full_attention".into());
            KvEvent::Stored(s)
        }
        KvEvent::Removed(mut r) => {
            r.group_idx = Some(0);
            KvEvent::Removed(r)
        }
        e => e,
    }
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
            in_group0(stored_b0(Some("GPU"))),
            in_group0(removed(vec![B0], Some("GPU"))),
            KvEvent::AllCleared
        ]
    );
}

/// B26: legacy array events decode to the same events as G1, except that their group fields
/// are nil (the legacy single group).
#[test]
fn g2_legacy_array_events_decode_like_g1() {
    let bytes = unhex(G2);
    assert_eq!(bytes.len(), 111);
    let g2 = decode_batch(&bytes).unwrap();
    let g1 = decode_batch(&unhex(G1)).unwrap();
    assert_eq!(
        g2.events,
        vec![
            stored_b0(Some("GPU")),
            removed(vec![B0], Some("GPU")),
            KvEvent::AllCleared
        ]
    );
    assert_eq!(
        g2.events.into_iter().map(in_group0).collect::<Vec<_>>(),
        g1.events
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
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..Default::default()
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
                ..Default::default()
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

/// The stored and removed events of H1 / H2.
fn hybrid_events() -> Vec<KvEvent> {
    let store = |g: u32, kind: &str, window: Option<u32>| {
        KvEvent::Stored(BlockStored {
            block_hashes: vec![B0],
            token_ids: (1..=16).collect(),
            block_size: 16,
            medium: Some("GPU".into()),
            group_idx: Some(g),
            kv_cache_spec_kind: Some(kind.into()),
            kv_cache_spec_sliding_window: window,
            ..Default::default()
        })
    };
    vec![
        store(0, "full_attention", None),
        store(1, "sliding_window", Some(128)),
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![B0],
            medium: Some("GPU".into()),
            group_idx: Some(1),
            kv_cache_spec_kind: None,
        }),
    ]
}

/// Hybrid models: group index, kind and window decode by position (array) and by name (map)
/// to the same events.
#[test]
fn h1_h2_hybrid_groups_decode_in_both_forms() {
    let h1 = unhex(H1);
    let h2 = unhex(H2);
    assert_eq!((h1.len(), h2.len()), (178, 461));
    assert_eq!(decode_batch(&h1).unwrap().events, hybrid_events());
    assert_eq!(decode_batch(&h2).unwrap().events, hybrid_events());
}

/// Groups without a kind decode with `kv_cache_spec_kind` `None`.
#[test]
fn h3_groups_without_kind() {
    let b = decode_batch(&unhex(H3)).unwrap();
    let groups: Vec<_> = b
        .events
        .iter()
        .map(|e| match e {
            KvEvent::Stored(s) => (s.group_idx, s.kv_cache_spec_kind.clone()),
            e => panic!("{e:?}"),
        })
        .collect();
    assert_eq!(groups, vec![(Some(0), None), (Some(1), None)]);
}

/// The partition fields: LoRA name (field 7), salt from block 0's extra keys (after the
/// leading LoRA name; multimodal keys skipped), SGLang's metadata map.
#[test]
fn p1_p2_p3_partition_fields() {
    let KvEvent::Stored(p1) = &decode_batch(&unhex(P1)).unwrap().events[0] else {
        panic!()
    };
    assert_eq!(p1.block_hashes, vec![B0, B1]);
    assert_eq!(p1.lora_name.as_deref(), Some("sql-lora"));
    assert_eq!(p1.cache_salt.as_deref(), Some("tenant-a"));
    let KvEvent::Stored(p2) = &decode_batch(&unhex(P2)).unwrap().events[0] else {
        panic!()
    };
    assert_eq!(
        (p2.lora_name.as_deref(), p2.cache_salt.as_deref()),
        (None, Some("tenant-a"))
    );
    let p3 = decode_batch(&unhex(P3)).unwrap();
    assert_eq!(p3.dp_rank, None);
    let KvEvent::Stored(p3) = &p3.events[0] else {
        panic!()
    };
    assert_eq!(
        (p3.lora_name.as_deref(), p3.cache_salt.as_deref()),
        (None, Some("tenant-a"))
    );
    assert_eq!(p3.medium, None);
}

/// Partition fields in the map form by name: top-level `cache_salt` wins over `metadata`,
/// which wins over `extra_keys`; empty strings are unset; a salt without a LoRA name that
/// equals it is kept.
#[test]
fn partition_fields_by_name_and_precedence() {
    let s = |x: &str| Value::from(x);
    let ev = |extra: Vec<(Value, Value)>| {
        let mut m = vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![Value::from(1u64)])),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), Value::Array(vec![])),
            (s("block_size"), Value::from(16u64)),
            (s("lora_id"), Value::Nil),
            (s("medium"), Value::Nil),
            (s("lora_name"), Value::Nil),
        ];
        m.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
        m.extend(extra);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &Value::Map(m)).unwrap();
        let KvEvent::Stored(st) = decode_batch(&batch_of(&out)).unwrap().events.remove(0) else {
            panic!()
        };
        (st.lora_name, st.cache_salt)
    };
    let extra = |keys: Vec<Value>| (s("extra_keys"), Value::Array(vec![Value::Array(keys)]));
    let meta = |salt: &str| (s("metadata"), Value::Map(vec![(s("cache_salt"), s(salt))]));
    assert_eq!(ev(vec![extra(vec![s("x")])]), (None, Some("x".into())));
    assert_eq!(
        ev(vec![meta("m"), extra(vec![s("x")])]),
        (None, Some("m".into()))
    );
    assert_eq!(
        ev(vec![(s("cache_salt"), s("t")), meta("m")]),
        (None, Some("t".into()))
    );
    assert_eq!(ev(vec![(s("cache_salt"), s(""))]), (None, None));
    // With lora_name "a", a leading "a" in the extra keys is the LoRA's, the next string the salt.
    let named = vec![(s("lora_name"), s("a")), extra(vec![s("a"), s("a")])];
    assert_eq!(ev(named), (Some("a".into()), Some("a".into())));
    // Without the LoRA name, the same keys name two salts: malformed.
    let two = extra(vec![s("a"), s("b")]);
    let mut out = Vec::new();
    let m = vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(vec![])),
        two,
    ];
    rmpv::encode::write_value(&mut out, &Value::Map(m)).unwrap();
    assert!(matches!(
        decode_batch(&batch_of(&out)),
        Err(DecodeError::BadPartition {
            field: "extra_keys",
            ..
        })
    ));
    assert_eq!(
        ev(vec![extra(vec![Value::Binary(vec![1, 2])])]),
        (None, None)
    );
}

/// Malformed partition or group fields drop the batch with `BadPartition` (counted by the
/// consumer), never a silent wrong partition.
#[test]
fn malformed_partition_fields_are_errors() {
    assert_eq!(
        decode_batch(&unhex(P4)),
        Err(DecodeError::BadPartition {
            index: 0,
            tag: "BlockStored",
            field: "lora_name"
        })
    );
    let s = |x: &str| Value::from(x);
    let stored = |pos: usize, v: Value| {
        let mut a = vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(1u64)]),
            Value::Nil,
            Value::Array(vec![]),
            Value::from(16u64),
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::Nil,
            Value::Nil,
        ];
        a[pos] = v;
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &Value::Array(a)).unwrap();
        decode_batch(&batch_of(&out))
    };
    let bad = |field| {
        Err(DecodeError::BadPartition {
            index: 0,
            tag: "BlockStored",
            field,
        })
    };
    let two_salts = Value::Array(vec![Value::Array(vec![s("x"), s("y")])]);
    assert_eq!(stored(8, two_salts), bad("extra_keys"));
    assert_eq!(stored(8, s("x")), bad("extra_keys"));
    assert_eq!(stored(8, Value::Array(vec![s("x")])), bad("extra_keys"));
    assert_eq!(stored(9, s("0")), bad("group_idx"));
    assert_eq!(stored(9, Value::from(-1i64)), bad("group_idx"));
    assert_eq!(stored(10, Value::from(3u64)), bad("kv_cache_spec_kind"));
    assert_eq!(stored(11, s("w")), bad("kv_cache_spec_sliding_window"));
    let meta = Value::Map(vec![(s("cache_salt"), Value::from(5u64))]);
    assert_eq!(stored(7, meta), bad("metadata"));
    assert!(stored(9, Value::from(2u64)).is_ok());
    let removed = unhex(
        "93cb41d954fc402000009194ac426c6f636b52656d6f76656491cf2ceabcfae6d332eaa3475055a17800",
    );
    assert_eq!(
        decode_batch(&removed),
        Err(DecodeError::BadPartition {
            index: 0,
            tag: "BlockRemoved",
            field: "group_idx"
        })
    );
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
                ..Default::default()
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
