use super::*;
use crate::route_key::{Endpoint, route_key};
use proptest::prelude::*;

fn router(kind: PolicyKind) -> Router {
    Router::new(&Config {
        policy: kind,
        ..Config::default()
    })
}

fn text_key(text: &str) -> RouteKey {
    RouteKey {
        model: "m".into(),
        text: text.into(),
        ..RouteKey::default()
    }
}

fn chat_key(messages: serde_json::Value) -> RouteKey {
    let body = serde_json::json!({"model": "m", "messages": messages});
    route_key(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap()
}

#[test]
fn spill_gate_thresholds_from_anchors_e8() {
    // anchors.md §7 E8: mean 24 → threshold max(36, 88) = 88; mean 125 → max(187.5, 189).
    let g = SpillGate::new(&[80, 10, 10, 10, 10], 1.5, 64);
    assert_eq!(g.threshold, 88.0);
    assert!(!g.is_hot(80));
    let g = SpillGate::new(&[200, 100, 100, 100], 1.5, 64);
    assert_eq!(g.threshold, 189.0);
    assert!(g.is_hot(200));
}

#[test]
fn e8_holder_keeps_affinity_then_spills_and_replicates() {
    let r = router(PolicyKind::CacheAware);
    let prompt = "a shared prefix that is long enough to match ".repeat(4);
    // Seed: worker 0 is the unique least loaded, so the miss lands there.
    let d = r.decide(&text_key(&prompt), &[0, 1, 1, 1, 1]);
    assert_eq!((d.worker, d.reason), (0, Reason::CacheMiss));
    // [80, 10, 10, 10, 10]: 80 < 88, the holder is not hot, affinity holds.
    let d = r.decide(&text_key(&prompt), &[80, 10, 10, 10, 10]);
    assert_eq!(d.worker, 0);
    assert!(
        matches!(d.reason, Reason::CacheHit { matched_chars, .. } if matched_chars == prompt.chars().count())
    );
    // [200, 100, 100, 100] (4 workers): 200 > 189 → spill to a least-loaded worker.
    let r = router(PolicyKind::CacheAware);
    r.decide(&text_key(&prompt), &[0, 1, 1, 1]);
    let d = r.decide(&text_key(&prompt), &[200, 100, 100, 100]);
    assert_eq!(d.reason, Reason::Spill);
    let x = d.worker;
    assert_ne!(x, 0);
    // The spill target became a second holder: with 0 hot and x a bit busier than the
    // others, the request still goes to x (a holder), not to an idler non-holder.
    let mut loads = vec![200, 100, 100, 100];
    loads[x] = 120; // mean 130 → threshold max(195, 194) = 195: 0 hot, x not.
    let d = r.decide(&text_key(&prompt), &loads);
    assert_eq!(d.worker, x);
    assert!(matches!(d.reason, Reason::CacheHit { .. }));
}

#[test]
fn turn_two_follows_turn_one() {
    let r = router(PolicyKind::CacheAware);
    let sys = serde_json::json!({"role": "system", "content": "You are terse."});
    let u1 = serde_json::json!({"role": "user", "content": "Explain the KV cache of a transformer in detail. ".repeat(5)});
    let t1 = chat_key(serde_json::json!([sys, u1]));
    let first = r.decide(&t1, &[3, 0, 3, 3]);
    assert_eq!(first.worker, 1);
    let t2 = chat_key(
        serde_json::json!([sys, u1, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Shorter?"}]),
    );
    // Worker 1 is now the busiest but not hot: turn 2 stays.
    let d = r.decide(&t2, &[0, 5, 0, 0]);
    assert_eq!(d.worker, 1);
    assert!(matches!(d.reason, Reason::CacheHit { ratio, .. } if ratio > 0.8));
}

#[test]
fn a_shared_short_system_prompt_is_a_miss() {
    let r = router(PolicyKind::CacheAware);
    let sys = serde_json::json!({"role": "system", "content": "You are terse."});
    let a = chat_key(
        serde_json::json!([sys, {"role": "user", "content": "Tell me about rivers in Europe and their history. ".repeat(4)}]),
    );
    let b = chat_key(
        serde_json::json!([sys, {"role": "user", "content": "Compare sorting algorithms by their complexity. ".repeat(4)}]),
    );
    assert_eq!(r.decide(&a, &[0, 1]).worker, 0);
    // b shares only "<|system|>You are terse.<|user|>" (< 30 %): a miss, routed by load.
    let d = r.decide(&b, &[1, 0]);
    assert_eq!((d.worker, d.reason), (1, Reason::CacheMiss));
}

#[test]
fn sixty_four_misses_spread_for_every_policy() {
    // bug-cases.md B1/B4: each decision's worker load goes up before the next decision.
    for kind in PolicyKind::ALL {
        let r = router(kind);
        let mut loads = vec![0usize; 4];
        for i in 0..64 {
            // Distinct from the first char on: every request is a miss.
            let prompt = format!(
                "{:016x} unique prompt",
                (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            );
            let d = r.decide(&text_key(&prompt), &loads);
            loads[d.worker] += 1;
        }
        assert!(
            loads.iter().all(|&n| (13..=19).contains(&n)),
            "{kind}: {loads:?}"
        );
    }
}

#[test]
fn least_request_ties_are_random_not_list_order() {
    let r = router(PolicyKind::LeastRequest);
    let mut counts = [0usize; 4];
    for _ in 0..400 {
        counts[r.decide(&text_key("x"), &[0, 0, 0, 0]).worker] += 1;
    }
    assert!(counts.iter().all(|&c| c >= 50), "{counts:?}");
    assert_eq!(r.decide(&text_key("x"), &[3, 1, 2, 5]).worker, 1);
}

#[test]
fn removed_worker_is_forgotten() {
    let r = router(PolicyKind::CacheAware);
    let p = "prompt held by worker two only, long enough ".repeat(3);
    assert_eq!(r.decide(&text_key(&p), &[1, 1, 0]).worker, 2);
    r.remove_worker(2);
    assert_eq!(
        r.decide(&text_key(&p), &[1, 0, 1]).reason,
        Reason::CacheMiss
    );
}

proptest! {
    #[test]
    fn least_loaded_returns_a_minimum(loads in prop::collection::vec(0usize..5, 1..12), mask in any::<u16>()) {
        let cands: Vec<usize> = (0..loads.len()).filter(|i| mask & (1 << i) != 0).collect();
        let got = least_loaded(&loads, cands.iter().copied(), &mut rand::rng());
        match cands.iter().map(|&w| loads[w]).min() {
            None => prop_assert_eq!(got, None),
            Some(min) => {
                let w = got.unwrap();
                prop_assert!(cands.contains(&w));
                prop_assert_eq!(loads[w], min);
            }
        }
    }
}
