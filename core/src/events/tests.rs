//! Tests of the ordering state machine, the event index and the consumer that ties them:
//! bug cases B22, B24, B25, B28–B34 (`bug-cases.md` "Events and recovery").

use super::*;
use rmpv::Value as V;

const RANK0: StreamId = StreamId { worker: 0, rank: 0 };

fn s(x: &str) -> V {
    V::from(x)
}

/// A map-form `BlockStored` event.
fn store(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u64) -> V {
    V::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            V::Array(hashes.iter().map(|&h| V::from(h)).collect()),
        ),
        (s("parent_block_hash"), parent.map_or(V::Nil, V::from)),
        (
            s("token_ids"),
            V::Array(tokens.iter().map(|&t| V::from(t)).collect()),
        ),
        (s("block_size"), V::from(block_size)),
        (s("lora_id"), V::Nil),
        (s("medium"), V::Nil),
        (s("lora_name"), V::Nil),
    ])
}

fn store_medium(hashes: &[u64], tokens: &[u32], block_size: u64, medium: &str) -> V {
    let V::Map(mut m) = store(hashes, None, tokens, block_size) else {
        unreachable!()
    };
    m[6].1 = s(medium);
    V::Map(m)
}

fn remove(hashes: &[u64], medium: Option<&str>) -> V {
    V::Array(vec![
        s("BlockRemoved"),
        V::Array(hashes.iter().map(|&h| V::from(h)).collect()),
        medium.map_or(V::Nil, s),
    ])
}

fn cleared() -> V {
    V::Array(vec![s("AllBlocksCleared")])
}

/// Array batch `[1.0, events, rank]`, msgpack bytes.
fn batch(events: Vec<V>, rank: u32) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &V::Array(vec![V::F64(1.0), V::Array(events), V::from(rank)]),
    )
    .unwrap();
    out
}

/// Encodes `events` as one batch of DP rank `rank`, decodes it and applies it to `stream`.
fn apply(ix: &mut EventIndex, stream: StreamId, events: Vec<V>, rank: u32) {
    ix.apply_batch(stream, &decode::decode_batch(&batch(events, rank)).unwrap());
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn block_key_vectors_of_kv_events_section_7() {
    let k = chain_keys(None, &toks(1..33), 16);
    assert_eq!(k[0], 16_863_443_419_780_771_464);
    assert_eq!(k[1], 12_466_389_667_045_779_788);
    assert_eq!(
        chain_keys(None, &toks(0..16), 16),
        vec![15_310_707_395_893_867_146]
    );
    // Continuing a chain equals hashing the whole prefix; partial tails get no key.
    assert_eq!(chain_keys(Some(k[0]), &toks(17..33), 16), vec![k[1]]);
    assert_eq!(chain_keys(None, &toks(1..32), 16).len(), 1);
    assert!(chain_keys(None, &toks(1..33), 0).is_empty());
}

/// B30: a 4-block store with one parent field chains blocks 1–3 to their predecessors; a
/// query for the 4-block prefix matches 4.
#[test]
fn b30_multi_block_store_chains_each_block() {
    let mut ix = EventIndex::new(16);
    let t = toks(0..64);
    apply(&mut ix, RANK0, vec![store(&[1, 2, 3, 4], None, &t, 16)], 0);
    let keys = chain_keys(None, &t, 16);
    let m = ix.find_matches(&keys);
    assert_eq!(m.len(), 1);
    assert_eq!((m[0].stream, m[0].blocks), (RANK0, 4));
    // Prefix of 2 + a foreign block: 2.
    let mut q = keys[..2].to_vec();
    q.push(99);
    assert_eq!(ix.find_matches(&q)[0].blocks, 2);
    ix.check_invariants().unwrap();
}

/// Store split over two events via the parent link; removal of the middle block truncates
/// matches (a hole), the unknown parent is an orphan (B26: parent 0 that is not known).
#[test]
fn parent_links_holes_and_orphans() {
    let mut ix = EventIndex::new(16);
    let t = toks(0..48);
    let keys = chain_keys(None, &t, 16);
    let b = batch(
        vec![
            store(&[10], None, &t[..16], 16),
            store(&[11, 12], Some(10), &t[16..], 16),
            store(&[77], Some(0), &toks(500..516), 16),
        ],
        0,
    );
    ix.apply_batch(RANK0, &decode::decode_batch(&b).unwrap());
    assert_eq!(ix.find_matches(&keys)[0].blocks, 3);
    assert_eq!(ix.stats_mut(RANK0).orphans, 1);
    ix.removed(
        RANK0,
        &BlockRemoved {
            block_hashes: vec![11],
            medium: None,
            ..Default::default()
        },
    );
    assert_eq!(ix.find_matches(&keys)[0].blocks, 1);
    let mut e = ix.engine_hashes(RANK0, Tier::Device);
    e.sort();
    assert_eq!(e, vec![10, 12]);
    ix.check_invariants().unwrap();
}

/// B31/B32: 64-token and 32-token engine blocks re-cut into 16-token router keys; a size that
/// does not divide is counted and not indexed (never silent); a wrong declared size is
/// counted but the learned size wins.
#[test]
fn b31_b32_block_size_recut_and_mismatch() {
    let t = toks(0..128);
    let keys = chain_keys(None, &t, 16);
    for ebs in [32u64, 64] {
        let mut ix = EventIndex::new(16);
        let n = 128 / ebs;
        let hashes: Vec<u64> = (1..=n).collect();
        apply(&mut ix, RANK0, vec![store(&hashes, None, &t, ebs)], 0);
        assert_eq!(ix.find_matches(&keys)[0].blocks, 8, "engine block {ebs}");
        assert_eq!(ix.stats_mut(RANK0).learned_block_size, Some(ebs as usize));
    }
    let mut ix = EventIndex::new(16);
    apply(&mut ix, RANK0, vec![store(&[1, 2], None, &t[..48], 24)], 0);
    assert!(ix.is_empty());
    assert_eq!(ix.stats_mut(RANK0).size_mismatches, 1);
    // Declared 64, real 16 per block: indexed at 16, the declaration counted.
    let mut ix = EventIndex::new(16);
    apply(&mut ix, RANK0, vec![store(&[1, 2], None, &t[..32], 64)], 0);
    assert_eq!(ix.find_matches(&keys)[0].blocks, 2);
    assert_eq!(ix.stats_mut(RANK0).declared_size_mismatches, 1);
    // §8.10: 33 tokens for 2 hashes → skipped, counted.
    apply(&mut ix, RANK0, vec![store(&[5, 6], None, &t[..33], 16)], 0);
    assert_eq!(ix.stats_mut(RANK0).length_mismatches, 1);
    ix.check_invariants().unwrap();
}

/// B25 and B29: a tokenless CPU store adds the host tier to a known block and is counted when
/// unknown; a STORAGE store with 256-token blocks gives 16 keys on the disk tier whose removal
/// clears only that tier.
#[test]
fn b25_b29_offload_tiers() {
    let mut ix = EventIndex::new(16);
    let t = toks(0..256);
    let keys = chain_keys(None, &t, 16);
    apply(
        &mut ix,
        RANK0,
        vec![
            store(&[1], None, &t[..16], 16),
            store_medium(&[1, 9], &[], 0, "CPU"),
        ],
        0,
    );
    assert_eq!(ix.stats_mut(RANK0).unknown_offloads, 1);
    assert_eq!(ix.engine_hashes(RANK0, Tier::Host), vec![1]);
    // GPU copy evicted: the host copy keeps the block held; evicting it too drops it.
    ix.removed(
        RANK0,
        &BlockRemoved {
            block_hashes: vec![1],
            medium: Some("GPU".into()),
            ..Default::default()
        },
    );
    assert_eq!(ix.find_matches(&keys)[0].blocks, 1);
    assert!(ix.engine_hashes(RANK0, Tier::Device).is_empty());
    assert_eq!(ix.engine_hashes(RANK0, Tier::Host), vec![1]);
    ix.removed(
        RANK0,
        &BlockRemoved {
            block_hashes: vec![1],
            medium: Some("CPU".into()),
            ..Default::default()
        },
    );
    assert!(ix.find_matches(&keys).is_empty());

    let other = StreamId { worker: 1, rank: 0 };
    apply(
        &mut ix,
        other,
        vec![store_medium(&[500], &t, 256, "STORAGE")],
        0,
    );
    let m: Vec<_> = ix
        .find_matches(&keys)
        .into_iter()
        .filter(|m| m.stream == other)
        .collect();
    assert_eq!(m[0].blocks, 16);
    assert_eq!(ix.engine_hashes(other, Tier::Disk), vec![500]);
    assert_eq!(ix.worker_blocks(1), 1);
    // A GPU removal does not touch the disk tier; the STORAGE one does.
    ix.removed(
        other,
        &BlockRemoved {
            block_hashes: vec![500],
            medium: None,
            ..Default::default()
        },
    );
    assert_eq!(ix.stream_keys(other), 16);
    ix.removed(
        other,
        &BlockRemoved {
            block_hashes: vec![500],
            medium: Some("STORAGE".into()),
            ..Default::default()
        },
    );
    assert_eq!(ix.stream_keys(other), 0);
    ix.check_invariants().unwrap();
}

/// B24 and B28: AllBlocksCleared empties that (worker, rank) only; ranks are separate.
#[test]
fn b24_b28_clear_one_rank_only() {
    let mut ix = EventIndex::new(16);
    let r1 = StreamId { worker: 0, rank: 1 };
    let a = toks(0..16);
    let b = toks(100..116);
    ix.stored(RANK0, &decoded_store(&[1], &a));
    ix.stored(r1, &decoded_store(&[2], &b));
    assert_eq!(ix.find_matches(&chain_keys(None, &b, 16))[0].stream, r1);
    apply(&mut ix, r1, vec![cleared()], 1);
    assert!(ix.find_matches(&chain_keys(None, &b, 16)).is_empty());
    assert_eq!(ix.find_matches(&chain_keys(None, &a, 16))[0].stream, RANK0);
    ix.remove_worker(0);
    assert!(ix.is_empty());
    ix.check_invariants().unwrap();
}

/// A duplicate store (same hash again) does not inflate counts (§8.3); self-referencing
/// stores are rejected (§8.11).
#[test]
fn duplicate_and_self_referencing_stores() {
    let mut ix = EventIndex::new(16);
    let a = toks(0..16);
    ix.stored(RANK0, &decoded_store(&[1], &a));
    ix.stored(RANK0, &decoded_store(&[1], &a));
    assert_eq!(ix.stream_keys(RANK0), 1);
    assert_eq!(ix.worker_blocks(0), 1);
    let mut bad = decoded_store(&[3], &toks(16..32));
    bad.parent_block_hash = Some(3);
    ix.stored(RANK0, &bad);
    assert_eq!(ix.stats_mut(RANK0).self_references, 1);
    ix.check_invariants().unwrap();
}

fn decoded_store(hashes: &[u64], tokens: &[u32]) -> BlockStored {
    BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: 16,
        medium: None,
        lora_name: None,
        ..Default::default()
    }
}

// ---- SeqTracker -------------------------------------------------------------------------

fn applied(steps: &[Step]) -> Vec<u64> {
    steps
        .iter()
        .filter_map(|s| match s {
            Step::Apply { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect()
}

#[test]
fn in_order_duplicate_and_restart() {
    let mut t = SeqTracker::new(true);
    for seq in 0..3 {
        assert_eq!(applied(&t.on_live(seq, &[seq as u8])), vec![seq]);
    }
    // The same seq and bytes again: duplicate.
    assert_eq!(t.on_live(1, &[1]), vec![Step::Duplicate { seq: 1 }]);
    // Seq back to 0 with other bytes: the engine restarted.
    let steps = t.on_live(0, &[42]);
    assert_eq!(steps[0], Step::Clear(ClearReason::Restart));
    assert_eq!(applied(&steps), vec![0]);
    assert_eq!(t.last_seq(), Some(0));
    t.check_invariants().unwrap();
}

/// B22: drop batch k → gap noticed at k+1, replay from k, live batches buffered and drained
/// in order, duplicates skipped; B34: the next live batch applies without another recovery.
#[test]
fn b22_gap_replays_then_drains_buffer() {
    let mut t = SeqTracker::new(true);
    t.on_live(0, &[0]);
    t.on_live(1, &[1]);
    // 2 lost.
    assert_eq!(t.on_live(3, &[3]), vec![Step::Replay { start_seq: 2 }]);
    assert!(t.on_live(4, &[4]).is_empty());
    assert_eq!(applied(&t.on_replay(2, &[2])), vec![2]);
    assert_eq!(applied(&t.on_replay(3, &[3])), vec![3]);
    let end = t.on_replay_end();
    assert_eq!(
        end,
        vec![
            Step::Duplicate { seq: 3 },
            Step::Apply {
                seq: 4,
                payload: vec![4]
            }
        ]
    );
    assert_eq!(applied(&t.on_live(5, &[5])), vec![5]);
    t.check_invariants().unwrap();
}

#[test]
fn unrecoverable_gaps_clear_once() {
    // Replay starts past the gap (buffer too short).
    let mut t = SeqTracker::new(true);
    t.on_live(0, &[0]);
    t.on_live(5, &[5]);
    let steps = t.on_replay(3, &[3]);
    assert_eq!(steps[0], Step::Clear(ClearReason::GapUnrecoverable));
    assert_eq!(applied(&steps), vec![3]);
    assert_eq!(applied(&t.on_replay(4, &[4])), vec![4]);
    assert_eq!(applied(&t.on_replay_end()), vec![5]);
    // Only an end marker (or timeout): one clear, then the buffered batch.
    let mut t = SeqTracker::new(true);
    t.on_live(0, &[0]);
    t.on_live(5, &[5]);
    t.on_live(6, &[6]);
    let steps = t.on_replay_end();
    assert_eq!(
        steps.iter().filter(|s| matches!(s, Step::Clear(_))).count(),
        1
    );
    assert_eq!(applied(&steps), vec![5, 6]);
    // No replay socket: clear at once and go on.
    let mut t = SeqTracker::new(false);
    t.on_live(0, &[0]);
    let steps = t.on_live(2, &[2]);
    assert_eq!(steps[0], Step::Clear(ClearReason::GapUnrecoverable));
    assert_eq!(applied(&steps), vec![2]);
}

/// B33: a router that joins mid-stream replays from 0 to learn older stores.
#[test]
fn b33_late_join_replays_from_zero() {
    let mut t = SeqTracker::new(true);
    assert_eq!(t.on_live(7, &[7]), vec![Step::Replay { start_seq: 0 }]);
    // The engine's buffer starts at 4: nothing to clear (nothing was indexed).
    let steps: Vec<Step> = (4..8).flat_map(|s| t.on_replay(s, &[s as u8])).collect();
    assert_eq!(applied(&steps), vec![4, 5, 6, 7]);
    assert!(!steps.iter().any(|s| matches!(s, Step::Clear(_))));
    assert_eq!(t.on_replay_end(), vec![Step::Duplicate { seq: 7 }]);
}

// ---- Consumer ---------------------------------------------------------------------------

/// The issue's named case: a live removal that arrives while a replay is running is applied
/// after the replayed store, so the removed block is never resurrected.
#[test]
fn live_removal_during_replay_never_resurrects_a_removed_block() {
    let mut c = Consumer::new();
    let mut ix = EventIndex::new(16);
    let a = toks(0..16);
    let b = toks(16..32);
    let keys_b = chain_keys(None, &b, 16);
    let b0 = batch(vec![store(&[1], None, &a, 16)], 0);
    let b1 = batch(vec![store(&[2], None, &b, 16)], 0); // lost live, replayed later
    let b2 = batch(vec![remove(&[2], None)], 0);
    let live = |c: &mut Consumer, ix: &mut EventIndex, seq, p: &[u8]| {
        c.handle(ix, RANK0, Input::Live { seq, payload: p })
    };
    assert_eq!(live(&mut c, &mut ix, 0, &b0), None);
    // Seq 1 dropped on the wire; seq 2 (removal of block 2) arrives → replay from 1.
    assert_eq!(live(&mut c, &mut ix, 2, &b2), Some(1));
    assert!(c.replaying(RANK0));
    // The replay delivers the store of block 2 and then the removal again.
    c.handle(
        &mut ix,
        RANK0,
        Input::Replay {
            seq: 1,
            payload: &b1,
        },
    );
    // Applied, but hidden from routing until the replay ends: the stream shows history.
    assert_eq!(ix.engine_hashes(RANK0, Tier::Device), vec![1, 2]);
    assert!(ix.find_matches(&keys_b).is_empty());
    assert!(ix.find_matches(&chain_keys(None, &a, 16)).is_empty());
    c.handle(
        &mut ix,
        RANK0,
        Input::Replay {
            seq: 2,
            payload: &b2,
        },
    );
    c.handle(&mut ix, RANK0, Input::ReplayEnd);
    assert!(ix.find_matches(&keys_b).is_empty(), "block 2 resurrected");
    assert_eq!(ix.engine_hashes(RANK0, Tier::Device), vec![1]);
    // Visible again once the replay ended.
    assert_eq!(ix.find_matches(&chain_keys(None, &a, 16))[0].blocks, 1);
    // Even if the replay stops before the removal, the buffered removal is drained after.
    let mut c = Consumer::new();
    let mut ix = EventIndex::new(16);
    live(&mut c, &mut ix, 0, &b0);
    live(&mut c, &mut ix, 2, &b2);
    c.handle(
        &mut ix,
        RANK0,
        Input::Replay {
            seq: 1,
            payload: &b1,
        },
    );
    c.handle(&mut ix, RANK0, Input::ReplayEnd);
    assert!(ix.find_matches(&keys_b).is_empty(), "block 2 resurrected");
    let st = ix.stats_mut(RANK0).clone();
    assert_eq!((st.gaps, st.replays, st.unrecoverable_gaps), (1, 1, 0));
    assert_eq!(st.last_seq, Some(2));
    ix.check_invariants().unwrap();
}

/// B36: a batch that names a DP rank other than its socket's (a pod launched with the wrong
/// DP start rank) is counted and applied under the socket's rank; no stream of the named
/// rank appears, so no request is sent to a rank that does not exist.
#[test]
fn a_batch_naming_another_dp_rank_counts_under_its_sockets_rank() {
    let mut c = Consumer::new();
    let mut ix = EventIndex::new(16);
    let rank1 = StreamId { worker: 0, rank: 1 };
    let a = toks(0..32);
    c.handle(
        &mut ix,
        rank1,
        Input::Live {
            seq: 0,
            payload: &batch(vec![store(&[1, 2], None, &a, 16)], 5),
        },
    );
    c.handle(
        &mut ix,
        rank1,
        Input::Live {
            seq: 1,
            payload: &batch(vec![store(&[3], Some(2), &toks(32..48), 16)], 1),
        },
    );
    let st = ix.stats_mut(rank1).clone();
    assert_eq!((st.rank_mismatches, st.batches), (1, 2));
    let keys = chain_keys(None, &toks(0..48), 16);
    let found: Vec<(StreamId, usize)> = ix
        .find_matches(&keys)
        .iter()
        .map(|m| (m.stream, m.blocks))
        .collect();
    assert_eq!(found, vec![(rank1, 3)]);
    ix.check_invariants().unwrap();
}

/// A malformed batch is dropped and counted; the stream goes on.
#[test]
fn malformed_batch_is_counted_and_the_stream_continues() {
    let mut c = Consumer::new();
    let mut ix = EventIndex::new(16);
    let a = toks(0..16);
    c.handle(
        &mut ix,
        RANK0,
        Input::Live {
            seq: 0,
            payload: &[0xc1],
        },
    );
    c.handle(
        &mut ix,
        RANK0,
        Input::Live {
            seq: 1,
            payload: &batch(vec![store(&[1], None, &a, 16)], 0),
        },
    );
    let st = ix.stats_mut(RANK0).clone();
    assert_eq!((st.decode_errors, st.batches, st.last_seq), (1, 2, Some(1)));
    assert_eq!(ix.find_matches(&chain_keys(None, &a, 16))[0].blocks, 1);
}

/// Restart (seq back to 0, new content) clears the worker; B22's second half.
#[test]
fn engine_restart_clears_the_stream() {
    let mut c = Consumer::new();
    let mut ix = EventIndex::new(16);
    let a = toks(0..16);
    let b = toks(100..116);
    c.handle(
        &mut ix,
        RANK0,
        Input::Live {
            seq: 0,
            payload: &batch(vec![store(&[1], None, &a, 16)], 0),
        },
    );
    c.handle(
        &mut ix,
        RANK0,
        Input::Live {
            seq: 0,
            payload: &batch(vec![store(&[2], None, &b, 16)], 0),
        },
    );
    assert!(ix.find_matches(&chain_keys(None, &a, 16)).is_empty());
    assert_eq!(ix.find_matches(&chain_keys(None, &b, 16)).len(), 1);
    assert_eq!(ix.stats_mut(RANK0).restarts, 1);
}

/// Routing on events when no engine has announced the prompt yet: engines publish a store only
/// once they schedule the request, so the followers of a new prefix arrive first. They follow
/// the router's own recent decision (token tree) instead of scattering over least-loaded
/// workers; once an engine announces the prefix, the event index decides.
#[test]
fn unannounced_prefix_follows_the_routers_recent_decision_until_events_arrive() {
    use crate::config::{Config, PolicyKind};
    use crate::policy::{Reason, Router};
    use crate::route_key::RouteKey;

    let mut router = Router::new(&Config {
        policy: PolicyKind::CacheAware,
        ..Config::default()
    });
    let mut events = EventIndex::new(16);
    router.set_event_index(events.reader());
    // The event index holds something else, so it is consulted.
    let other = toks(5_000..5_064);
    apply(
        &mut events,
        StreamId { worker: 2, rank: 0 },
        vec![store(&[7, 8, 9, 10], None, &other, 16)],
        0,
    );
    let key = RouteKey {
        model: "m".into(),
        input_ids: Some(toks(0..128).into()),
        ..RouteKey::default()
    };
    let first = router.decide_all(&key, &[0, 0, 0, 0]);
    assert_eq!(first.reason, Reason::CacheMiss);
    let w = first.worker;
    // The first request is in flight on `w` (load 1); the engine has not announced it.
    let mut loads = [0, 0, 0, 0];
    loads[w] = 1;
    for _ in 0..20 {
        let d = router.decide_all(&key, &loads);
        assert_eq!(d.worker, w, "follower scattered: {d:?}");
        assert!(matches!(d.reason, Reason::TokenHit { .. }), "{d:?}");
    }
    // Engine 3 announces the whole prompt: the event index decides, whatever the tree says.
    let t = toks(0..128);
    let hashes: Vec<u64> = (100..108).collect();
    apply(
        &mut events,
        StreamId { worker: 3, rank: 0 },
        vec![store(&hashes, None, &t, 16)],
        0,
    );
    let d = router.decide_all(&key, &loads);
    assert_eq!(d.worker, 3, "{d:?}");
    assert!(
        matches!(
            d.reason,
            Reason::TokenHit {
                matched_tokens: 128,
                ..
            }
        ),
        "{d:?}"
    );
}

/// bug-cases.md B11 on the event index: when every deep holder is hot, the spill goes to the
/// near-least-loaded worker (load ≤ min + [`SPILL_NEAR_LOAD`]) holding the most leading blocks,
/// not to the least loaded one that holds nothing, and not to a deeper holder further up.
#[test]
fn b11_a_spill_keeps_the_longest_prefix_among_the_near_least_loaded() {
    use crate::config::{Config, PolicyKind};
    use crate::policy::{Reason, Router, SPILL_NEAR_LOAD};
    use crate::route_key::RouteKey;

    let mut router = Router::new(&Config {
        policy: PolicyKind::CacheAware,
        ..Config::default()
    });
    let mut events = EventIndex::new(16);
    router.set_event_index(events.reader());
    let t = toks(0..160); // 10 blocks
    let hashes: Vec<u64> = (1..=10).collect();
    let hold = |ix: &mut EventIndex, worker: u32, blocks: usize| {
        apply(
            ix,
            StreamId { worker, rank: 0 },
            vec![store(&hashes[..blocks], None, &t[..16 * blocks], 16)],
            0,
        );
    };
    hold(&mut events, 0, 10); // the deep holder, about to be hot
    hold(&mut events, 1, 2); // a shared head (2 blocks)
    hold(&mut events, 2, 6); // deeper, but busier
    let key = RouteKey {
        model: "m".into(),
        input_ids: Some(t.clone().into()),
        ..RouteKey::default()
    };
    // Workers 0 (10 blocks) and 2 (6 blocks, 0.6 of the request) are the deep holders; worker
    // 1's 2 blocks are 0.2 ≤ 0.3. Mean 18.25 (18.5 below), hot above max(1.5 × mean, mean + 8)
    // ≈ 27.4: both deep holders are hot.
    let near = SPILL_NEAR_LOAD;
    let loads = [30, 1 + near, 40, 1];
    let d = router.decide_all(&key, &loads);
    assert_eq!(d.reason, Reason::Spill, "{d:?}");
    assert_eq!(d.worker, 1, "the 2-block holder within the margin: {d:?}");
    // One request more on worker 1 puts it outside the margin: the least loaded wins.
    let loads = [30, 2 + near, 40, 1];
    let d = router.decide_all(&key, &loads);
    assert_eq!((d.worker, d.reason), (3, Reason::Spill), "{d:?}");
}

/// B39 at the tracker: a relearn replays from 0, re-applies what was applied (without moving
/// `last`), buffers live batches meanwhile, drains them after; a second relearn waits for
/// [`sequence::ORPHAN_REPLAY_EVERY_BATCHES`] batches.
#[test]
fn b39_relearn_reapplies_then_drains_and_is_rate_limited() {
    let mut t = SeqTracker::new(true);
    assert_eq!(t.request_relearn(), None, "nothing applied yet");
    for seq in 0..3 {
        t.on_live(seq, &[seq as u8]);
    }
    assert_eq!(t.request_relearn(), Some(0));
    assert_eq!(t.request_relearn(), None, "one replay at a time");
    assert!(
        t.on_live(3, &[3]).is_empty(),
        "live buffered during the relearn"
    );
    for seq in 0..3 {
        assert_eq!(
            t.on_replay(seq, &[seq as u8]),
            vec![Step::Reapply {
                seq,
                payload: vec![seq as u8]
            }]
        );
    }
    assert_eq!(t.last_seq(), Some(2));
    assert_eq!(
        applied(&t.on_replay(3, &[3])),
        vec![3],
        "newer than the relearn: applied"
    );
    assert_eq!(t.on_replay_end(), vec![Step::Duplicate { seq: 3 }]);
    t.check_invariants().unwrap();
    let mut seq = 4;
    // The relearn was asked at last = 2: the next is due at last = 2 + N.
    while seq < 2 + sequence::ORPHAN_REPLAY_EVERY_BATCHES {
        t.on_live(seq, &[0]);
        assert_eq!(t.request_relearn(), None, "rate-limited at seq {seq}");
        seq += 1;
    }
    t.on_live(seq, &[0]);
    assert_eq!(t.request_relearn(), Some(0));
    assert!(SeqTracker::new(false).request_relearn().is_none());
}

/// B39 through the consumer (bug-cases.md B39): the batch holding a chain's first stores is
/// lost and its gap cannot be replayed at the time (the replay ends empty → clear); the next
/// store is an orphan, counted, and triggers a replay of the engine's buffer, which still
/// holds that batch: re-applied in order, the whole chain matches again.
#[test]
fn b39_orphan_store_triggers_a_replay_that_restores_matching() {
    let t = toks(0..48);
    let keys = chain_keys(None, &t, 16);
    let b0 = batch(vec![store(&[1], None, &t[..16], 16)], 0);
    let b1 = batch(vec![store(&[2], Some(1), &t[16..32], 16)], 0);
    let b2 = batch(vec![store(&[3], Some(2), &t[32..48], 16)], 0);
    let mut c = Consumer::new();
    c.add_stream(RANK0, true);
    let mut ix = EventIndex::new(16);
    fn live(seq: u64, payload: &[u8]) -> Input<'_> {
        Input::Live { seq, payload }
    }
    assert_eq!(c.handle(&mut ix, RANK0, live(0, &b0)), None);
    // Batch 1 lost; its replay finds nothing (engine busy): unrecoverable, cleared.
    assert_eq!(c.handle(&mut ix, RANK0, live(2, &b2)), Some(1));
    // Draining batch 2 after the clear: its parent is unknown → orphan → relearn from 0.
    assert_eq!(c.handle(&mut ix, RANK0, Input::ReplayEnd), Some(0));
    let st = ix.stats()[0].1.clone();
    assert_eq!(
        (st.unrecoverable_gaps, st.orphans, st.orphan_replays),
        (1, 1, 1)
    );
    assert!(ix.find_matches(&keys).is_empty(), "cleared, orphan skipped");
    for (seq, b) in [(0, &b0), (1, &b1), (2, &b2)] {
        let r = c.handle(&mut ix, RANK0, Input::Replay { seq, payload: b });
        assert_eq!(r, None);
    }
    assert_eq!(c.handle(&mut ix, RANK0, Input::ReplayEnd), None);
    let m = ix.find_matches(&keys);
    assert_eq!((m.len(), m[0].blocks), (1, 3), "whole chain restored");
    let st = ix.stats()[0].1.clone();
    assert_eq!(st.orphans, 1, "re-applied stores are not recounted");
    assert_eq!(st.reapplied_batches, 3);
    assert_eq!(st.batches, 2, "live batches 0 and 2");
    assert_eq!(st.replays, 2);
    ix.check_invariants().unwrap();
}

// ---- EventIndex against a brute-force reference ---------------------------------------

mod reference {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap, HashSet};

    /// Engine blocks per document.
    const BLOCKS: usize = 6;
    /// Streams: stream `s` has engine blocks of `16 × (s + 1)` tokens (router blocks 16), so
    /// stream 1 exercises the re-cut (k = 2).
    const STREAMS: u32 = 2;

    /// Documents 0 and 1 share their first 64 tokens; 2 is unrelated.
    fn doc(d: usize) -> Vec<u32> {
        (0..(BLOCKS * 32) as u32)
            .map(|t| {
                if t < 64 && d < 2 {
                    t
                } else {
                    10_000 * (d as u32 + 1) + t
                }
            })
            .collect()
    }

    #[derive(Debug, Clone)]
    enum Op {
        Store {
            s: u32,
            d: usize,
            from: usize,
            n: usize,
            cpu: bool,
        },
        Offload {
            s: u32,
            d: usize,
            i: usize,
        },
        Remove {
            s: u32,
            d: usize,
            i: usize,
            cpu: bool,
        },
        Clear {
            s: u32,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..STREAMS, 0..3usize, 0..BLOCKS, 1..4usize, prop::bool::weighted(0.2))
                .prop_map(|(s, d, from, n, cpu)| Op::Store { s, d, from, n, cpu }),
            1 => (0..STREAMS, 0..3usize, 0..BLOCKS).prop_map(|(s, d, i)| Op::Offload { s, d, i }),
            3 => (0..STREAMS, 0..3usize, 0..BLOCKS, prop::bool::weighted(0.3))
                .prop_map(|(s, d, i, cpu)| Op::Remove { s, d, i, cpu }),
            1 => (0..STREAMS).prop_map(|s| Op::Clear { s }),
        ]
    }

    /// Engine hash of block `i` of document `d` on stream `s`: documents 0 and 1 share the
    /// hash of their shared leading blocks, as an engine's chained hashes do.
    fn hash(s: u32, d: usize, i: usize) -> u64 {
        let shared_blocks = 64 / (16 * (s as usize + 1));
        let d = if d < 2 && i < shared_blocks { 0 } else { d };
        1 + (u64::from(s) << 32) + (d as u64) * 100 + i as u64
    }

    /// Per stream: engine hash → (router keys, tier mask, GPU copies).
    type Model = HashMap<u32, HashMap<u64, (Vec<u64>, u8, u32)>>;

    fn apply_model(m: &mut Model, op: &Op) {
        let bit = |cpu: bool| if cpu { 2u8 } else { 1u8 };
        match *op {
            Op::Store { s, d, from, n, cpu } => {
                let k = s as usize + 1;
                let keys = chain_keys(None, &doc(d), 16);
                let st = m.entry(s).or_default();
                if from > 0 && !st.contains_key(&hash(s, d, from - 1)) {
                    return; // orphan
                }
                for i in from..(from + n).min(BLOCKS) {
                    let e = st
                        .entry(hash(s, d, i))
                        .or_insert_with(|| (keys[i * k..(i + 1) * k].to_vec(), 0, 0));
                    if !cpu {
                        // A GPU store of a block on GPU is one more copy (rule table).
                        e.2 += 1;
                    }
                    e.1 |= bit(cpu);
                }
            }
            Op::Offload { s, d, i } => {
                if let Some(e) = m.entry(s).or_default().get_mut(&hash(s, d, i)) {
                    e.1 |= 2;
                }
            }
            Op::Remove { s, d, i, cpu } => {
                let st = m.entry(s).or_default();
                let h = hash(s, d, i);
                if let Some(e) = st.get_mut(&h) {
                    if !cpu && e.2 > 1 {
                        e.2 -= 1;
                        return;
                    }
                    if !cpu {
                        e.2 = 0;
                    }
                    e.1 &= !bit(cpu);
                    if e.1 == 0 {
                        st.remove(&h);
                    }
                }
            }
            Op::Clear { s } => {
                m.remove(&s);
            }
        }
    }

    fn apply_index(ix: &mut EventIndex, op: &Op) {
        let medium = |cpu: bool| cpu.then(|| "CPU".to_string());
        match *op {
            Op::Store { s, d, from, n, cpu } => {
                let ebs = 16 * (s as usize + 1);
                let to = (from + n).min(BLOCKS);
                ix.stored(
                    StreamId { worker: s, rank: 0 },
                    &BlockStored {
                        block_hashes: (from..to).map(|i| hash(s, d, i)).collect(),
                        parent_block_hash: (from > 0).then(|| hash(s, d, from - 1)),
                        token_ids: doc(d)[from * ebs..to * ebs].to_vec(),
                        block_size: ebs,
                        medium: medium(cpu),
                        lora_name: None,
                        ..Default::default()
                    },
                );
            }
            Op::Offload { s, d, i } => ix.stored(
                StreamId { worker: s, rank: 0 },
                &BlockStored {
                    block_hashes: vec![hash(s, d, i)],
                    parent_block_hash: None,
                    token_ids: Vec::new(),
                    block_size: 0,
                    medium: medium(true),
                    lora_name: None,
                    ..Default::default()
                },
            ),
            Op::Remove { s, d, i, cpu } => ix.removed(
                StreamId { worker: s, rank: 0 },
                &BlockRemoved {
                    block_hashes: vec![hash(s, d, i)],
                    medium: medium(cpu),
                    ..Default::default()
                },
            ),
            Op::Clear { s } => ix.clear(StreamId { worker: s, rank: 0 }),
        }
    }

    proptest! {
        /// Matches, held engine blocks per tier and block counts equal the reference after
        /// every op; invariants hold throughout.
        #[test]
        fn event_index_matches_reference(ops in prop::collection::vec(op(), 1..60)) {
            let mut ix = EventIndex::new(16);
            let mut model = Model::new();
            for op in &ops {
                apply_index(&mut ix, op);
                apply_model(&mut model, op);
                prop_assert_eq!(ix.check_invariants(), Ok(()), "after {:?}", op);
                for d in 0..3 {
                    let q = chain_keys(None, &doc(d), 16);
                    let got: HashMap<u32, usize> = ix
                        .find_matches(&q)
                        .into_iter()
                        .map(|m| (m.stream.worker, m.blocks))
                        .collect();
                    for s in 0..STREAMS {
                        let held: HashSet<u64> = model
                            .get(&s)
                            .map(|st| st.values().flat_map(|e| e.0.clone()).collect())
                            .unwrap_or_default();
                        let want = q.iter().take_while(|k| held.contains(k)).count();
                        prop_assert_eq!(
                            got.get(&s).copied().unwrap_or(0), want,
                            "stream {} doc {} after {:?}", s, d, op
                        );
                    }
                }
                for s in 0..STREAMS {
                    let stream = StreamId { worker: s, rank: 0 };
                    let st = model.get(&s).cloned().unwrap_or_default();
                    for (tier, bit) in [(Tier::Device, 1u8), (Tier::Host, 2)] {
                        let mut got = ix.engine_hashes(stream, tier);
                        got.sort_unstable();
                        let mut want: Vec<u64> =
                            st.iter().filter(|e| e.1.1 & bit != 0).map(|e| *e.0).collect();
                        want.sort_unstable();
                        prop_assert_eq!(got, want, "stream {} tier {:?}", s, tier);
                    }
                    for (h, e) in &st {
                        prop_assert_eq!(ix.copies(stream, *h), e.2, "copies of {} after {:?}", h, op);
                    }
                    prop_assert_eq!(ix.worker_blocks(s), st.len());
                }
            }
        }
    }

    /// Streams beyond the index's capacity are counted, never indexed, and never disturb
    /// the streams that fit.
    #[test]
    fn streams_beyond_capacity_are_counted_not_indexed() {
        let mut ix = EventIndex::with_settings(&EventIndexSettings {
            block_size: 16,
            max_streams: 1,
            ttl_ms: None,
            max_entries: None,
        });
        let a = StreamId { worker: 0, rank: 0 };
        let b = StreamId { worker: 1, rank: 0 };
        let t = doc(2);
        ix.stored(a, &decoded_store(&[1], &t[..16]));
        ix.stored(b, &decoded_store(&[1], &t[..16]));
        let m = ix.find_matches(&chain_keys(None, &t[..16], 16));
        assert_eq!(
            m,
            vec![Match {
                stream: a,
                blocks: 1
            }]
        );
        assert_eq!(ix.stats_mut(b).over_capacity, 1);
        ix.check_invariants().unwrap();
    }
}

/// Counters add up across streams; the per-stream descriptions stay those of the target.
#[test]
fn stream_counters_add_up() {
    let mut t = StreamStats {
        batches: 2,
        last_seq: Some(9),
        ..StreamStats::default()
    };
    let s = StreamStats {
        batches: 3,
        length_mismatches: 1,
        over_capacity: 4,
        last_seq: Some(1),
        learned_block_size: Some(16),
        ..StreamStats::default()
    };
    t.add_counters(&s);
    t.add_counters(&s);
    assert_eq!((t.batches, t.length_mismatches, t.over_capacity), (8, 2, 8));
    assert_eq!((t.last_seq, t.learned_block_size), (Some(9), None));
}

// ---- Partitions, hybrid groups, copies (issue 14) ---------------------------------------

/// Applies golden bytes (`decode/tests.rs`) to `stream`.
fn apply_golden(ix: &mut EventIndex, stream: StreamId, hex: &str) {
    let batch = decode::decode_batch(&decode::tests::unhex(hex)).unwrap();
    ix.apply_batch(stream, &batch);
}

/// The namespace a completions request with `extra` partition fields gets (the request side).
fn request_ns(extra: &str) -> u64 {
    use crate::route_key::{Endpoint, route_key};
    let body = format!(r#"{{"model":"m","prompt":[1,2,3]{extra}}}"#);
    route_key(Endpoint::Completions, body.as_bytes())
        .unwrap()
        .namespace
}

/// Blocks of `tokens` stream 0 holds in namespace `ns`, as the policy asks.
fn held_in(ix: &EventIndex, ns: u64, tokens: &[u32]) -> usize {
    let r = ix.reader();
    r.find_matches(&r.block_keys(ns, tokens))
        .iter()
        .find(|m| m.stream == RANK0)
        .map_or(0, |m| m.blocks)
}

/// P1 on the wire (LoRA "sql-lora", salt "tenant-a", tokens 1..32): the blocks match a request
/// carrying the same salt and adapter, in every way the request can name the adapter, and no
/// request of another partition; a child store that names no salt inherits the partition.
#[test]
fn partitions_from_wire_bytes_match_only_the_same_salt_and_adapter() {
    let mut ix = EventIndex::new(16);
    apply_golden(&mut ix, RANK0, decode::tests::P1);
    let ns = request_ns(r#","cache_salt":"tenant-a","lora_path":"sql-lora""#);
    assert_eq!(ns, event_namespace(Some("sql-lora"), Some("tenant-a")));
    assert_eq!(
        ns,
        request_ns(r#","cache_salt":"tenant-a","lora_id":"sql-lora""#)
    );
    assert_ne!(ns, 0);
    let t = toks(1..33);
    assert_eq!(held_in(&ix, ns, &t), 2);
    assert_eq!(held_in(&ix, 0, &t), 0);
    assert_eq!(
        held_in(&ix, request_ns(r#","cache_salt":"tenant-a""#), &t),
        0
    );
    assert_eq!(
        held_in(&ix, request_ns(r#","lora_path":"sql-lora""#), &t),
        0
    );
    // Block 2 (tokens 33..48) under parent B1, no salt in its extra keys: same partition.
    let mut child = decoded_store(&[77], &toks(33..49));
    child.parent_block_hash = Some(2_758_186_210_834_249_151);
    child.lora_name = Some("sql-lora".into());
    ix.stored(RANK0, &child);
    assert_eq!(held_in(&ix, ns, &toks(1..49)), 3);
    assert_eq!(held_in(&ix, 0, &toks(1..49)), 0);
    ix.check_invariants().unwrap();
}

/// P2 (salt after a multimodal key) and P3 (SGLang's metadata map) land in the salt's
/// partition; a default-partition store of the same tokens stays apart.
#[test]
fn salt_only_partitions_of_vllm_and_sglang() {
    let salt = request_ns(r#","cache_salt":"tenant-a""#);
    assert_eq!(salt, event_namespace(None, Some("tenant-a")));
    for hex in [decode::tests::P2, decode::tests::P3] {
        let mut ix = EventIndex::new(16);
        apply_golden(&mut ix, RANK0, hex);
        assert_eq!(held_in(&ix, salt, &toks(1..17)), 1);
        assert_eq!(held_in(&ix, 0, &toks(1..17)), 0);
        ix.stored(RANK0, &decoded_store(&[5], &toks(1..17)));
        assert_eq!(held_in(&ix, 0, &toks(1..17)), 1);
        assert_eq!(held_in(&ix, salt, &toks(1..17)), 1);
        assert_eq!(ix.stream_keys(RANK0), 2);
    }
}

/// The router routes a salted request to the worker holding its salted prefix, not to the
/// one holding the same tokens unsalted.
#[test]
fn the_policy_matches_events_in_the_requests_namespace() {
    use crate::config::{Config, PolicyKind};
    use crate::policy::{Reason, Router};
    use crate::route_key::RouteKey;
    let mut router = Router::new(&Config {
        policy: PolicyKind::CacheAware,
        ..Config::default()
    });
    let mut ix = EventIndex::new(16);
    router.set_event_index(ix.reader());
    let t = toks(0..64);
    let w = |worker| StreamId { worker, rank: 0 };
    ix.stored(w(1), &decoded_store(&[1, 2, 3, 4], &t));
    let mut salted = decoded_store(&[11, 12, 13, 14], &t);
    salted.cache_salt = Some("s".into());
    ix.stored(w(2), &salted);
    let key = |ns| RouteKey {
        model: "m".into(),
        input_ids: Some(t.clone().into()),
        namespace: ns,
        ..RouteKey::default()
    };
    for (ns, want) in [(0, 1), (event_namespace(None, Some("s")), 2)] {
        let d = router.decide_all(&key(ns), &[0, 0, 0, 0]);
        assert_eq!(d.worker, want, "{d:?}");
        assert!(
            matches!(
                d.reason,
                Reason::TokenHit {
                    matched_tokens: 64,
                    ..
                }
            ),
            "{d:?}"
        );
    }
}

/// H1 / H2 (hybrid model): the sliding-window group's store is not indexed and its removal
/// of the same hash does not remove the full-attention block.
#[test]
fn hybrid_sliding_window_group_neither_stores_nor_removes_prefix_blocks() {
    for hex in [decode::tests::H1, decode::tests::H2] {
        let mut ix = EventIndex::new(16);
        apply_golden(&mut ix, RANK0, hex);
        assert_eq!(held_in(&ix, 0, &toks(1..17)), 1);
        assert_eq!(ix.copies(RANK0, 3_236_607_068_019_569_386), 1);
        let st = ix.stats_mut(RANK0).clone();
        assert_eq!((st.non_prefix_stores, st.non_prefix_removals), (1, 1));
        assert_eq!((st.unknown_removals, st.copies_kept), (0, 0));
        // A removal naming group 0 (full attention, learned) removes it.
        ix.removed(
            RANK0,
            &BlockRemoved {
                block_hashes: vec![3_236_607_068_019_569_386],
                group_idx: Some(0),
                ..Default::default()
            },
        );
        assert_eq!(held_in(&ix, 0, &toks(1..17)), 0);
        ix.check_invariants().unwrap();
    }
}

fn in_group(mut s: BlockStored, g: Option<u32>, kind: Option<&str>) -> BlockStored {
    s.group_idx = g;
    s.kv_cache_spec_kind = kind.map(str::to_owned);
    s
}

fn removal(h: u64, g: Option<u32>) -> BlockRemoved {
    BlockRemoved {
        block_hashes: vec![h],
        group_idx: g,
        ..Default::default()
    }
}

/// Other kinds: a Mamba group with its own (larger) block size is ignored without touching
/// the learned block size; an unknown kind is counted and ignored; MLA is a prefix group.
#[test]
fn group_kinds_decide_what_is_indexed() {
    let mut ix = EventIndex::new(16);
    ix.stored(
        RANK0,
        &in_group(
            decoded_store(&[1], &toks(0..16)),
            Some(0),
            Some("mla_attention"),
        ),
    );
    let mut mamba = in_group(decoded_store(&[9], &toks(0..64)), Some(1), Some("mamba"));
    mamba.block_size = 64;
    ix.stored(RANK0, &mamba);
    ix.stored(
        RANK0,
        &in_group(
            decoded_store(&[8], &toks(100..116)),
            Some(2),
            Some("linear_attention"),
        ),
    );
    let st = ix.stats_mut(RANK0).clone();
    assert_eq!(st.learned_block_size, Some(16));
    assert_eq!((st.non_prefix_stores, st.unknown_group_kinds), (2, 1));
    assert_eq!(ix.stream_keys(RANK0), 1);
    assert_eq!(held_in(&ix, 0, &toks(0..16)), 1);
    // Group 1's removal (learned: Mamba) and a never-seen group's removal change nothing.
    ix.removed(RANK0, &removal(1, Some(1)));
    ix.removed(RANK0, &removal(1, Some(7)));
    assert_eq!(held_in(&ix, 0, &toks(0..16)), 1);
    assert_eq!(ix.stats_mut(RANK0).non_prefix_removals, 2);
    ix.removed(RANK0, &removal(1, Some(0)));
    assert_eq!(ix.stream_keys(RANK0), 0);
    ix.check_invariants().unwrap();
}

/// No kind: the one kindless group is full attention (and its removals apply); a second
/// kindless group (H3 on the wire) makes the stream ambiguous: cleared once, warned, counted,
/// and no kindless group event applies any more; events with a kind still do.
#[test]
fn groups_without_kind() {
    let mut ix = EventIndex::new(16);
    ix.stored(
        RANK0,
        &in_group(decoded_store(&[1], &toks(0..16)), Some(0), None),
    );
    assert_eq!(held_in(&ix, 0, &toks(0..16)), 1);
    ix.removed(RANK0, &removal(1, Some(0)));
    assert_eq!(ix.stream_keys(RANK0), 0);
    ix.removed(RANK0, &removal(1, Some(3)));
    assert_eq!(ix.stats_mut(RANK0).non_prefix_removals, 1);

    let mut ix = EventIndex::new(16);
    apply_golden(&mut ix, RANK0, decode::tests::H3);
    assert_eq!(ix.stream_keys(RANK0), 0);
    assert_eq!(ix.stats_mut(RANK0).ambiguous_groups, 1);
    ix.stored(
        RANK0,
        &in_group(decoded_store(&[2], &toks(0..16)), Some(0), None),
    );
    ix.removed(RANK0, &removal(2, Some(1)));
    assert_eq!(ix.stream_keys(RANK0), 0);
    assert_eq!(ix.stats_mut(RANK0).ambiguous_groups, 3);
    ix.stored(
        RANK0,
        &in_group(
            decoded_store(&[3], &toks(0..16)),
            Some(0),
            Some("full_attention"),
        ),
    );
    assert_eq!(held_in(&ix, 0, &toks(0..16)), 1);
    // Legacy events (no group at all) are full attention.
    ix.stored(RANK0, &decoded_store(&[4], &toks(50..66)));
    assert_eq!(held_in(&ix, 0, &toks(50..66)), 1);
    ix.check_invariants().unwrap();
}

/// Copies: a block stored twice on GPU (vLLM's block pool does not de-duplicate; or two
/// full-attention groups) survives the removal of one copy and leaves with the last; a CPU
/// removal does not touch GPU copies; sizes count the block once (§8.3).
#[test]
fn copies_keep_a_block_until_its_last_copy_is_removed() {
    let mut ix = EventIndex::new(16);
    let a = toks(0..16);
    ix.stored(RANK0, &decoded_store(&[1], &a));
    ix.stored(RANK0, &decoded_store(&[1], &a));
    ix.stored(
        RANK0,
        &in_group(decoded_store(&[1], &a), Some(2), Some("full_attention")),
    );
    assert_eq!(ix.copies(RANK0, 1), 3);
    assert_eq!((ix.stream_keys(RANK0), ix.worker_blocks(0)), (1, 1));
    let mut cpu = removal(1, None);
    cpu.medium = Some("CPU".into());
    ix.removed(RANK0, &cpu);
    assert_eq!(ix.copies(RANK0, 1), 3);
    ix.removed(RANK0, &removal(1, None));
    ix.removed(RANK0, &removal(1, Some(2)));
    assert_eq!((ix.copies(RANK0, 1), held_in(&ix, 0, &a)), (1, 1));
    assert_eq!(ix.stats_mut(RANK0).copies_kept, 2);
    ix.check_invariants().unwrap();
    ix.removed(RANK0, &removal(1, None));
    assert_eq!((ix.copies(RANK0, 1), held_in(&ix, 0, &a)), (0, 0));
    // Two DP ranks are separate streams: each holds its own copy.
    let r1 = StreamId { worker: 0, rank: 1 };
    ix.stored(RANK0, &decoded_store(&[1], &a));
    ix.stored(r1, &decoded_store(&[1], &a));
    ix.removed(r1, &removal(1, None));
    assert_eq!((ix.copies(RANK0, 1), ix.copies(r1, 1)), (1, 0));
    // A clear forgets copies.
    ix.stored(RANK0, &decoded_store(&[1], &a));
    ix.clear(RANK0);
    assert_eq!(ix.copies(RANK0, 1), 0);
    ix.check_invariants().unwrap();
}

/// An orphan relearn re-applies history: blocks held when it began keep their copies
/// (store, store, remove of block 1 re-applied leave 1 copy); a block it relearns follows
/// the rules (block 5's store, store, remove leave 1 copy).
#[test]
fn relearn_does_not_count_history_twice() {
    let mut ix = EventIndex::new(16);
    let a = toks(0..16);
    let b = toks(500..516);
    ix.stored(RANK0, &decoded_store(&[1], &a));
    ix.stored(RANK0, &decoded_store(&[1], &a));
    ix.removed(RANK0, &removal(1, None));
    assert_eq!(ix.copies(RANK0, 1), 1);
    ix.set_relearning(RANK0, true);
    for _ in 0..2 {
        ix.stored(RANK0, &decoded_store(&[1], &a));
        ix.stored(RANK0, &decoded_store(&[5], &b));
    }
    ix.removed(RANK0, &removal(1, None));
    ix.removed(RANK0, &removal(5, None));
    assert_eq!((ix.copies(RANK0, 1), ix.copies(RANK0, 5)), (1, 1));
    ix.set_relearning(RANK0, false);
    ix.removed(RANK0, &removal(5, None));
    ix.removed(RANK0, &removal(1, None));
    assert_eq!(ix.stream_keys(RANK0), 0);
    ix.check_invariants().unwrap();
}

/// A malformed partition field (P4: `lora_name` 7) drops the batch, counted twice (decode
/// error, bad partition); the stream goes on.
#[test]
fn malformed_partition_batch_is_counted_and_dropped() {
    let mut ix = EventIndex::new(16);
    let mut c = Consumer::new();
    let p4 = decode::tests::unhex(decode::tests::P4);
    let g1 = decode::tests::unhex(decode::tests::G1);
    let p1 = decode::tests::unhex(decode::tests::P1);
    for (seq, payload) in [(0, &p4), (1, &g1), (2, &p1)] {
        assert_eq!(c.handle(&mut ix, RANK0, Input::Live { seq, payload }), None);
    }
    let st = ix.stats_mut(RANK0).clone();
    assert_eq!((st.batches, st.decode_errors, st.bad_partitions), (3, 1, 1));
    assert_eq!(st.last_seq, Some(2));
    let ns = event_namespace(Some("sql-lora"), Some("tenant-a"));
    assert_eq!(held_in(&ix, ns, &toks(1..33)), 2);
}

/// An index of `max_streams` streams where each `(worker, rank, blocks)` holds the first
/// `blocks` of `prompt` (16-token blocks).
fn holding(max_streams: usize, prompt: &[u32], held: &[(u32, u32, usize)]) -> EventIndex {
    let mut ix = EventIndex::with_settings(&EventIndexSettings {
        block_size: 16,
        max_streams,
        ttl_ms: None,
        max_entries: None,
    });
    for &(worker, rank, blocks) in held {
        let hashes: Vec<u64> = (1..=blocks as u64).collect();
        apply(
            &mut ix,
            StreamId { worker, rank },
            vec![store(&hashes, None, &prompt[..16 * blocks], 16)],
            rank,
        );
    }
    ix
}

/// [`EventReader::holders`], worked example: a worker's DP ranks count once at the deepest,
/// a hidden stream holds nothing, and a worker past the reverse map's capacity (20, with 8
/// streams) is found by the scan.
#[test]
fn holders_take_each_worker_once_at_its_deepest_visible_stream() {
    let prompt = toks(0..160); // 10 blocks
    let held = [
        (0, 0, 10),
        (1, 0, 3),
        (1, 1, 7),
        (2, 0, 9),
        (3, 0, 3),
        (4, 0, 3),
        (20, 0, 5),
    ];
    use rand::SeedableRng;
    let mut ix = holding(8, &prompt, &held);
    ix.set_hidden(StreamId { worker: 2, rank: 0 }, true);
    let r = ix.reader();
    let h = r.holders(&r.block_keys(0, &prompt));
    assert_eq!(h.streams(), 7, "hidden streams still hold blocks");
    let tokens: Vec<usize> = [0, 1, 2, 3, 4, 20, 9].map(|w| h.tokens(w)).to_vec();
    assert_eq!(tokens, vec![160, 112, 0, 48, 48, 80, 0]);
    // The batch answer: the holders among them, in the order asked (20 past the capacity).
    assert_eq!(
        h.tokens_among(&[20, 9, 4, 2, 0, 1, 3]),
        vec![(20, 80), (4, 48), (0, 160), (1, 112), (3, 48)]
    );
    assert_eq!(h.tokens_among(&[]), vec![]);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let deepest = |k: usize, rng: &mut rand::rngs::StdRng| {
        let mut out = vec![(99, 1)];
        h.deepest(k, rng, &mut out);
        out
    };
    assert_eq!(deepest(2, &mut rng), vec![(99, 1), (0, 160), (1, 112)]);
    assert_eq!(
        deepest(3, &mut rng),
        vec![(99, 1), (0, 160), (1, 112), (20, 80)]
    );
    let mut all = deepest(10, &mut rng);
    assert_eq!(all.len(), 6, "{all:?}");
    all[4..].sort_unstable();
    assert_eq!(all[1..], [(0, 160), (1, 112), (20, 80), (3, 48), (4, 48)]);
    assert_eq!(deepest(0, &mut rng), vec![(99, 1)]);
    // A worker's ranks and the reader's own answer agree.
    let mut found = r.worker_tokens(&r.block_keys(0, &prompt));
    crate::policy::prefix::by_worker(&mut found);
    for (w, t) in found {
        assert_eq!(h.tokens(w), t, "worker {w}");
    }
}

/// Ties at the cut of [`Holders::deepest`]: 12 workers share a 2-block prefix, worker 5 holds
/// 6 blocks. Taking 4: worker 5, then 3 of the tied, consecutive going round them from a
/// random one; over seeds, every tied worker is taken sometimes.
#[test]
fn holders_break_ties_at_the_cut_going_round_from_a_random_worker() {
    use rand::SeedableRng;
    let prompt = toks(0..96);
    let held: Vec<(u32, u32, usize)> = (0..12)
        .map(|w| (w, 0, if w == 5 { 6 } else { 2 }))
        .collect();
    let ix = holding(64, &prompt, &held);
    let r = ix.reader();
    let h = r.holders(&r.block_keys(0, &prompt));
    let tied: Vec<u32> = (0..12).filter(|&w| w != 5).collect();
    let mut seen = std::collections::BTreeSet::new();
    for seed in 0..64 {
        let mut out = Vec::new();
        h.deepest(4, &mut rand::rngs::StdRng::seed_from_u64(seed), &mut out);
        assert_eq!(out[0], (5, 96));
        assert!(out[1..].iter().all(|&(_, t)| t == 32), "{out:?}");
        let at = tied.iter().position(|&w| w == out[1].0).unwrap();
        let next: Vec<u32> = (0..3).map(|i| tied[(at + i) % tied.len()]).collect();
        assert_eq!(
            out[1..].iter().map(|&(w, _)| w).collect::<Vec<_>>(),
            next,
            "seed {seed}"
        );
        seen.extend(next);
    }
    assert_eq!(
        seen.len(),
        tied.len(),
        "every tied worker is taken sometimes"
    );
}
