use super::*;
use crate::config::defaults;
use crate::ids::BlockKeySeq;
use crate::route_key::{Endpoint, route_key};
use kvroute_index::MAX_MATCH_TENANTS;
use proptest::prelude::*;
use rand::SeedableRng;

fn router(kind: PolicyKind) -> Router {
    Router::new(&Config {
        policy: kind,
        ..Config::default()
    })
}

/// SMG's `--balance-abs-threshold` (anchors.md §2.3), which its worked examples use; kvroute's
/// default is smaller (`defaults::BALANCE_ABS_THRESHOLD`).
const SMG_ABS: usize = 64;

/// cache_aware with SMG's spill-gate margin.
fn smg_router() -> Router {
    Router::new(&Config {
        policy: PolicyKind::CacheAware,
        balance_abs_threshold: SMG_ABS,
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
    let g = SpillGate::new(&[80, 10, 10, 10, 10], &[0, 1, 2, 3, 4], 1.5, SMG_ABS);
    assert_eq!(g.threshold, 88.0);
    assert!(!g.is_hot(80));
    let g = SpillGate::new(&[200, 100, 100, 100], &[0, 1, 2, 3], 1.5, SMG_ABS);
    assert_eq!(g.threshold, 189.0);
    assert!(g.is_hot(200));
}

#[test]
fn e8_holder_keeps_affinity_then_spills_and_replicates() {
    let r = smg_router();
    let prompt = "a shared prefix that is long enough to match ".repeat(4);
    // Seed: worker 0 is the unique least loaded, so the miss lands there.
    let d = r.decide_all(&text_key(&prompt), &[0, 1, 1, 1, 1]);
    assert_eq!((d.worker, d.reason), (0, Reason::CacheMiss));
    // [80, 10, 10, 10, 10]: 80 < 88, the holder is not hot, affinity holds.
    let d = r.decide_all(&text_key(&prompt), &[80, 10, 10, 10, 10]);
    assert_eq!(d.worker, 0);
    assert!(
        matches!(d.reason, Reason::CacheHit { matched_chars, .. } if matched_chars == prompt.chars().count())
    );
    // [200, 100, 100, 100] (4 workers): 200 > 189 → spill to a least-loaded worker.
    let r = smg_router();
    r.decide_all(&text_key(&prompt), &[0, 1, 1, 1]);
    let d = r.decide_all(&text_key(&prompt), &[200, 100, 100, 100]);
    assert_eq!(d.reason, Reason::Spill);
    let x = d.worker;
    assert_ne!(x, 0);
    // The spill target became a second holder: with 0 hot and x a bit busier than the
    // others, the request still goes to x (a holder), not to an idler non-holder.
    let mut loads = vec![200, 100, 100, 100];
    loads[x] = 120; // mean 130 → threshold max(195, 194) = 195: 0 hot, x not.
    let d = r.decide_all(&text_key(&prompt), &loads);
    assert_eq!(d.worker, x);
    assert!(matches!(d.reason, Reason::CacheHit { .. }));
}

#[test]
fn turn_two_follows_turn_one() {
    let r = router(PolicyKind::CacheAware);
    let sys = serde_json::json!({"role": "system", "content": "You are terse."});
    let u1 = serde_json::json!({"role": "user", "content": "Explain the KV cache of a transformer in detail. ".repeat(5)});
    let t1 = chat_key(serde_json::json!([sys, u1]));
    let first = r.decide_all(&t1, &[3, 0, 3, 3]);
    assert_eq!(first.worker, 1);
    let t2 = chat_key(
        serde_json::json!([sys, u1, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Shorter?"}]),
    );
    // Worker 1 is now the busiest but not hot: turn 2 stays.
    let d = r.decide_all(&t2, &[0, 5, 0, 0]);
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
    assert_eq!(r.decide_all(&a, &[0, 1]).worker, 0);
    // b shares only "<|system|>You are terse.<|user|>" (< 30 %): a miss, routed by load.
    let d = r.decide_all(&b, &[1, 0]);
    assert_eq!((d.worker, d.reason), (1, Reason::CacheMiss));
}

/// B1 (smg-project/smg PR #1714) and B4 (smg-project/smg PR #2146): 64 concurrent misses
/// over 4 idle workers, each dispatched the way the gateway does it (snapshot of the
/// registry, decide, book on the chosen worker, hold the guard): every policy sees the load
/// it reads and spreads them. Load-aware policies put 16 ± 3 on each; `random` and the hash
/// policies are within their bounds (random: 6–26, 2.9 standard deviations; bounded load:
/// ⌈1.25 · 64 / 4⌉ = 20 at most); the load-blind `pure_affinity` only counts them all.
#[test]
fn b1_b4_sixty_four_misses_spread_for_every_policy() {
    for kind in PolicyKind::ALL {
        // Distinct from the first char on: every request is a miss.
        let loads = dispatch_concurrent(kind, 4, 64, false, |i| {
            format!(
                "{:016x} unique prompt",
                (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            )
        });
        let (lo, hi) = match kind {
            PolicyKind::Random => (6, 26),
            PolicyKind::PrefixHash => (0, 20),
            // No load term by design: prompts sharing a first char follow each other.
            PolicyKind::PureAffinity => (0, 64),
            _ => (13, 19),
        };
        assert!(
            loads.iter().all(|&n| (lo..=hi).contains(&n)),
            "{kind}: {loads:?}"
        );
        assert_eq!(loads.iter().sum::<usize>(), 64);
    }
}

#[test]
fn least_request_ties_are_random_not_list_order() {
    let r = router(PolicyKind::LeastRequest);
    let mut counts = [0usize; 4];
    for _ in 0..400 {
        counts[r.decide_all(&text_key("x"), &[0, 0, 0, 0]).worker] += 1;
    }
    assert!(counts.iter().all(|&c| c >= 50), "{counts:?}");
    assert_eq!(r.decide_all(&text_key("x"), &[3, 1, 2, 5]).worker, 1);
}

#[test]
fn removed_worker_is_forgotten() {
    let r = router(PolicyKind::CacheAware);
    let p = "prompt held by worker two only, long enough ".repeat(3);
    assert_eq!(r.decide_all(&text_key(&p), &[1, 1, 0]).worker, 2);
    r.remove_worker(2);
    assert_eq!(
        r.decide_all(&text_key(&p), &[1, 0, 1]).reason,
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

/// Seeds `holders` as holders of `text` in the tree of model "m", without a decision.
fn seed(r: &Router, text: &str, holders: &[usize]) {
    let m = r.model("m");
    for &h in holders {
        m.strings
            .write(TreeOp::Insert(0, text.into(), h as TenantId));
    }
    r.flush();
}

/// SMG's rule written out directly (anchors.md §2.2 step 5): hot ⇔ load > max(rel·mean,
/// mean + abs), mean over all workers, with kvroute's defaults for rel and abs.
fn brute_hot(loads: &[usize], w: usize) -> bool {
    use crate::config::defaults::{BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD};
    let mean = loads.iter().sum::<usize>() as f64 / loads.len() as f64;
    let l = loads[w] as f64;
    l > BALANCE_REL_THRESHOLD * mean && l > mean + BALANCE_ABS_THRESHOLD as f64
}

proptest! {
    /// Every cache_aware decision obeys the written-out rule: a hit goes to a least-loaded
    /// non-hot holder; a spill happens only when every holder is hot and goes to a globally
    /// least-loaded worker, which then holds the prefix; a miss goes to a least-loaded worker.
    #[test]
    fn cache_aware_follows_the_rule(
        loads in prop::collection::vec(0usize..300, 1..=MAX_MATCH_TENANTS),
        holder_mask in any::<u16>(),
        cached in any::<bool>(),
    ) {
        let n = loads.len();
        let r = router(PolicyKind::CacheAware);
        let text = "a long shared conversation prefix, then the rest".repeat(3);
        let holders: Vec<usize> = (0..n).filter(|w| holder_mask & (1 << w) != 0).collect();
        if cached {
            seed(&r, &text, &holders);
        }
        let min_all = *loads.iter().min().unwrap();
        let d = r.decide_all(&text_key(&text), &loads);
        let cool: Vec<usize> = holders.iter().copied().filter(|&w| !brute_hot(&loads, w)).collect();
        if !cached || holders.is_empty() {
            prop_assert_eq!(d.reason, Reason::CacheMiss);
            prop_assert_eq!(loads[d.worker], min_all);
        } else if cool.is_empty() {
            prop_assert_eq!(d.reason, Reason::Spill);
            prop_assert_eq!(loads[d.worker], min_all);
            prop_assert!(!holders.contains(&d.worker));
        } else {
            let full = text.chars().count();
            prop_assert_eq!(d.reason, Reason::CacheHit { matched_chars: full, ratio: 1.0 });
            prop_assert!(cool.contains(&d.worker));
            prop_assert_eq!(loads[d.worker], cool.iter().map(|&w| loads[w]).min().unwrap());
        }
        // The chosen worker now holds the text.
        r.flush();
        let m = r.model("m").strings.read().match_prefix(0, &text);
        prop_assert!(m.tenants.contains(&(d.worker as TenantId)));
    }
}

#[test]
fn threshold_is_strict_and_per_model() {
    let r = router(PolicyKind::CacheAware);
    // 3 of 10 chars match: ratio 0.3 is not > 0.3 → miss; 4 of 10 → hit.
    seed(&r, "abcXXXXXXX", &[2]);
    seed(&r, "abcdYYYYYY", &[2]);
    assert_eq!(
        r.decide_all(&text_key("abcZZZZZZZ"), &[0, 1, 1]).reason,
        Reason::CacheMiss
    );
    let d = r.decide_all(&text_key("abcdZZZZZZ"), &[0, 1, 1]);
    assert_eq!(d.worker, 2);
    assert_eq!(
        d.reason,
        Reason::CacheHit {
            matched_chars: 4,
            ratio: 0.4
        }
    );
    // Another model never matches model "m"'s tree.
    let other = RouteKey {
        model: "other".into(),
        text: "abcdZZZZZZ".into(),
        ..RouteKey::default()
    };
    assert_eq!(r.decide_all(&other, &[0, 1, 1]).reason, Reason::CacheMiss);
}

#[test]
fn empty_text_is_a_miss_and_not_recorded() {
    let r = router(PolicyKind::CacheAware);
    let ids_only = RouteKey {
        model: "m".into(),
        input_ids: Some(vec![1, 2, 3].into()),
        ..RouteKey::default()
    };
    let d = r.decide_all(&ids_only, &[4, 0, 9]);
    assert_eq!((d.worker, d.reason), (1, Reason::CacheMiss));
    assert_eq!(r.tree_chars("m"), 0);
}

/// B15 (sgl-project/sglang PR #16734): the budget holds after every decision, not per sweep.
#[test]
fn b15_tree_stays_within_budget_at_every_decision() {
    let r = Router::new(&Config {
        policy: PolicyKind::CacheAware,
        max_tree_size_chars: 2_000,
        ..Config::default()
    });
    let mut loads = vec![0usize; 4];
    for i in 0..500 {
        let d = r.decide_all(&text_key(&format!("{i:05} {}", "y".repeat(i % 90))), &loads);
        loads[d.worker] += 1;
        assert!(r.tree_chars("m") <= 2_000, "decision {i}");
    }
    assert!(r.tree_chars("m") > 1_800);
}

#[test]
fn tenants_of_removed_workers_are_not_candidates() {
    // Worker 5 held the prefix but the fleet now has 3 workers: a miss, not a spill.
    let r = router(PolicyKind::CacheAware);
    let text = "prefix held by a worker that is gone ".repeat(3);
    seed(&r, &text, &[5]);
    let d = r.decide_all(&text_key(&text), &[2, 0, 1]);
    assert_eq!((d.worker, d.reason), (1, Reason::CacheMiss));
}

#[test]
fn round_robin_cycles_in_order() {
    let r = router(PolicyKind::RoundRobin);
    let got: Vec<usize> = (0..7)
        .map(|_| r.decide_all(&text_key("x"), &[9, 0, 0]).worker)
        .collect();
    assert_eq!(got, vec![0, 1, 2, 0, 1, 2, 0]);
}

#[test]
fn reason_labels() {
    let hit = Reason::CacheHit {
        matched_chars: 1,
        ratio: 1.0,
    };
    let labels: Vec<&str> = [
        Reason::RoundRobin,
        Reason::LeastRequest,
        hit,
        Reason::CacheMiss,
        Reason::Spill,
    ]
    .iter()
    .map(Reason::as_str)
    .collect();
    assert_eq!(
        labels,
        ["round_robin", "least_request", "hit", "miss", "spill"]
    );
}

/// Only hits predict a cached prefix: tokens as matched, text as its char ratio of the
/// engine's prompt tokens.
#[test]
fn hits_predict_their_cached_tokens() {
    let token = Reason::TokenHit {
        matched_tokens: 4096,
        ratio: 0.5,
    };
    let text = Reason::CacheHit {
        matched_chars: 300,
        ratio: 0.75,
    };
    assert_eq!(token.predicted_cached_tokens(9_999), Some(4096));
    assert_eq!(text.predicted_cached_tokens(1_000), Some(750));
    assert_eq!(text.predicted_cached_tokens(3), Some(2)); // 2.25 rounds down
    for r in [
        Reason::CacheMiss,
        Reason::Spill,
        Reason::RoundRobin,
        Reason::LeastRequest,
    ] {
        assert_eq!(r.predicted_cached_tokens(1_000), None, "{r:?}");
    }
}

#[test]
fn router_is_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Router>();
    let r = std::sync::Arc::new(router(PolicyKind::CacheAware));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let r = r.clone();
            std::thread::spawn(move || {
                for i in 0..200 {
                    let d = r.decide_all(&text_key(&format!("thread {t} turn {i}")), &[1, 1, 1, 1]);
                    assert!(d.worker < 4);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(r.tree_chars("m") > 0);
}

fn ids_key(ids: Vec<u32>) -> RouteKey {
    RouteKey {
        model: "m".into(),
        input_ids: Some(ids.into()),
        ..RouteKey::default()
    }
}

#[test]
fn token_requests_use_the_page_tree() {
    let r = router(PolicyKind::CacheAware);
    let base: Vec<u32> = (0..100).collect(); // 6 whole pages of 16 + 4 tokens
    let d = r.decide_all(&ids_key(base.clone()), &[1, 0, 1]);
    assert_eq!((d.worker, d.reason), (1, Reason::CacheMiss));
    assert_eq!(r.tree_tokens("m"), 96);
    assert_eq!(r.tree_chars("m"), 0, "text and token trees are separate");
    // Same 6 pages, different tail: 96 of 110 tokens match → hit on worker 1.
    let mut q = base[..96].to_vec();
    q.extend(500..514);
    let d = r.decide_all(&ids_key(q), &[0, 3, 0]);
    assert_eq!(d.worker, 1);
    assert_eq!(
        d.reason,
        Reason::TokenHit {
            matched_tokens: 96,
            ratio: 96.0 / 110.0
        }
    );
    // Shorter than one page never matches.
    let d = r.decide_all(&ids_key(base[..15].to_vec()), &[5, 5, 0]);
    assert_eq!((d.worker, d.reason), (2, Reason::CacheMiss));
}

#[test]
fn hash_mode_matches_the_deepest_head() {
    let r = Router::new(&Config {
        policy: PolicyKind::CacheAware,
        cache_index: CacheIndexKind::Hash,
        cache_boundaries: vec![8, 32],
        ..Config::default()
    });
    let ids: Vec<u32> = (0..40).collect();
    let d = r.decide_all(&ids_key(ids.clone()), &[0, 1]);
    assert_eq!(d.worker, 0);
    r.flush();
    let d = r.decide_all(&ids_key(ids[..35].to_vec()), &[2, 0]);
    assert_eq!(
        d.reason,
        Reason::TokenHit {
            matched_tokens: 32,
            ratio: 32.0 / 35.0
        }
    );
    assert_eq!(d.worker, 0);
    // Text in hash mode is a miss.
    assert_eq!(
        r.decide_all(&text_key("hello"), &[0, 0]).reason,
        Reason::CacheMiss
    );
}

/// bug-cases B12 through the router: a removed worker is gone from both trees.
#[test]
fn remove_worker_purges_both_trees() {
    let r = router(PolicyKind::CacheAware);
    r.decide_all(&ids_key((0..64).collect()), &[0, 1]);
    r.decide_all(&text_key("some prompt text"), &[0, 1]);
    r.remove_worker(0);
    assert_eq!((r.tree_tokens("m"), r.tree_chars("m")), (0, 0));
}

#[test]
fn cache_partitions_never_match_each_other() {
    // issue 3 item 5 / anchors §2.7: the same prompt under another cache_salt or LoRA
    // namespace is a miss; under its own namespace it is a hit.
    let r = router(PolicyKind::CacheAware);
    let text = "a prompt shared by two tenants with different salts ".repeat(3);
    let salted = |ns: u64| RouteKey {
        namespace: ns,
        ..text_key(&text)
    };
    assert_eq!(r.decide_all(&salted(7), &[0, 1]).worker, 0);
    let other = r.decide_all(&salted(9), &[0, 1]);
    assert_eq!(other.reason, Reason::CacheMiss);
    let same = r.decide_all(&salted(7), &[3, 0]);
    assert_eq!(same.worker, 0);
    assert!(matches!(same.reason, Reason::CacheHit { .. }));
    // Token requests too.
    let ids: Vec<u32> = (0..64).collect();
    let tok = |ns: u64| RouteKey {
        namespace: ns,
        input_ids: Some(ids.clone().into()),
        ..text_key("")
    };
    assert_eq!(r.decide_all(&tok(1), &[0, 1]).worker, 0);
    assert_eq!(r.decide_all(&tok(2), &[0, 1]).reason, Reason::CacheMiss);
}

/// A snapshot of request counts `loads` (leaked: a test's few bytes).
fn snap<'a>(loads: &[usize], eligible: &'a [usize], seq: u64) -> Snapshot<'a> {
    Snapshot {
        seq,
        ..snap_of(Vec::leak(WorkerLoad::of_requests(loads)), eligible)
    }
}

/// A snapshot of `workers` at time 0, decision 0.
fn snap_of<'a>(workers: &'a [WorkerLoad], eligible: &'a [usize]) -> Snapshot<'a> {
    Snapshot {
        workers,
        ids: &[],
        eligible,
        seq: 0,
        now_ms: 0,
        live: None,
    }
}

/// [`Snapshot::eligible_positions`], worked example: over candidates 3, 8, 11, 40 the
/// eligible 8 and 40 sit at positions 1 and 3; by worker id a worker is its own position; an
/// eligible id that is no candidate (5: not a valid snapshot) is left out.
#[test]
fn eligible_positions_name_each_eligible_workers_load() {
    let workers = WorkerLoad::of_requests(&[0, 1, 2, 3]);
    let cand = Snapshot {
        ids: &[3, 8, 11, 40],
        ..snap_of(&workers, &[8, 40])
    };
    assert_eq!(
        cand.eligible_positions().collect::<Vec<_>>(),
        vec![(8, 1), (40, 3)]
    );
    assert_eq!(cand.load_at(3).requests, 3);
    assert_eq!(
        snap_of(&workers, &[0, 2])
            .eligible_positions()
            .collect::<Vec<_>>(),
        vec![(0, 0), (2, 2)]
    );
    let odd = Snapshot {
        ids: &[3, 8, 11, 40],
        ..snap_of(&workers, &[5, 11])
    };
    assert_eq!(odd.eligible_positions().collect::<Vec<_>>(), vec![(11, 2)]);
}

/// predicted_ttft reads a worker alike whether the snapshot and the overlaps are laid out
/// by worker id (a small fleet) or over a candidate set (a large one, read by position):
/// equal context, equal terms for every eligible worker, the same pick, over 300 random
/// fleets (loads, candidates, eligibility and overlaps drawn from a seeded generator).
#[test]
fn predicted_ttft_reads_candidates_as_the_whole_fleet() {
    use rand::Rng;
    let key = RouteKey::default();
    let req = request_of(&key, 4_096);
    let p = TtftParams::of(&Config::default().knobs);
    let mut rng = rand::rngs::StdRng::seed_from_u64(16);
    let mut compared = 0;
    for _ in 0..300 {
        let n = rng.random_range(1..48usize);
        let loads: Vec<WorkerLoad> = (0..n)
            .map(|_| {
                let r = rng.random_range(0..6usize);
                let mut l = WorkerLoad::of_requests(&[r])[0];
                l.active.prefill_requests = rng.random_range(0..=r);
                l.active.prefill_wait_ms = rng.random_range(0.0..500.0);
                l.active.decode_blocks = rng.random_range(0..2_000);
                l
            })
            .collect();
        let ids: Vec<usize> = (0..n).filter(|_| rng.random_bool(0.5)).collect();
        let eligible: Vec<usize> = ids
            .iter()
            .copied()
            .filter(|_| rng.random_bool(0.8))
            .collect();
        if eligible.is_empty() {
            continue;
        }
        let found: Vec<(TenantId, usize)> = (0..n)
            .filter_map(|w| {
                let held = rng.random_range(1..=4_096);
                rng.random_bool(0.4).then_some((w as TenantId, held))
            })
            .collect();
        let lay = |among: Option<&[usize]>| {
            let (s, u) = (prefix::Source::Events, prefix::Unit::Tokens);
            match among {
                Some(ids) => prefix::Overlaps::from_index_among(s, u, &found, ids, 4_096, 1.0),
                None => prefix::Overlaps::from_index(s, u, &found, n, 4_096, 1.0),
            }
        };
        let (ov_all, ov_cand) = (lay(None), lay(Some(&ids)));
        let cand_loads: Vec<WorkerLoad> = ids.iter().map(|&w| loads[w]).collect();
        let all = snap_of(&loads, &eligible);
        let cand = Snapshot {
            ids: &ids,
            ..snap_of(&cand_loads, &eligible)
        };
        let ctx = predicted_ttft::Context::of(&p, &all, &req, &ov_all);
        assert_eq!(ctx, predicted_ttft::Context::of(&p, &cand, &req, &ov_cand));
        let none = || std::cell::Cell::new(None);
        for &w in &eligible {
            assert_eq!(
                predicted_ttft::terms(&p, &ctx, &all, &req, &ov_all, w, &none()),
                predicted_ttft::terms(&p, &ctx, &cand, &req, &ov_cand, w, &none()),
                "worker {w}"
            );
        }
        let seed = rng.random::<u64>();
        let pick = |snap: &Snapshot<'_>, ov: &prefix::Overlaps| {
            let mut r = rand::rngs::StdRng::seed_from_u64(seed);
            predicted_ttft::decide(&p, snap, &req, ov, &mut r).worker
        };
        assert_eq!(pick(&all, &ov_all), pick(&cand, &ov_cand));
        compared += 1;
    }
    assert!(compared > 250, "{compared} fleets compared");
}

/// The policy seam: `decide` writes nothing, so deciding twice, or deciding and not
/// recording (a failed attempt), leaves the indexes as they were; only `record` inserts.
#[test]
fn decide_is_read_only_and_record_writes() {
    let r = router(PolicyKind::CacheAware);
    let key = text_key(&"a conversation that will be routed twice ".repeat(3));
    let all = [0, 1, 2];
    for _ in 0..5 {
        let d = r.decide(&snap(&[0, 1, 1], &all, 0), &key, &mut rand::rng());
        assert_eq!((d.worker, d.reason), (0, Reason::CacheMiss));
    }
    assert_eq!(r.tree_chars("m"), 0, "decide inserted into the tree");
    let d = r.decide(&snap(&[1, 1, 0], &all, 0), &key, &mut rand::rng());
    r.record(&key, &d, 0);
    assert_eq!(d.worker, 2);
    assert_eq!(r.tree_chars("m"), key.text.chars().count());
    let d = r.decide(&snap(&[0, 0, 1], &all, 0), &key, &mut rand::rng());
    assert_eq!(d.worker, 2, "{d:?}");
    assert!(matches!(d.reason, Reason::CacheHit { .. }));
}

/// With the writer thread's catch-up between records (the gateway's `kv-index`), a record is
/// read by the very next decision, as without it (a client's next turn may follow a
/// non-streamed response within a millisecond), and the trees end as the records made them.
#[test]
fn a_record_is_read_at_once_with_catch_ups_between() {
    let r = router(PolicyKind::CacheAware);
    let text = text_key(&"a conversation recorded by a shard ".repeat(3));
    let ids = RouteKey {
        input_ids: Some((0..64).collect()),
        ..text_key("")
    };
    let all = [0, 1, 2];
    for (i, key) in [&text, &ids].into_iter().enumerate() {
        let miss = r.decide(&snap(&[1, 1, 0], &all, 0), key, &mut rand::rng());
        assert_eq!((miss.worker, miss.reason), (2, Reason::CacheMiss));
        r.record(key, &miss, 0);
        let hit = r.decide(&snap(&[0, 0, 1], &all, 0), key, &mut rand::rng());
        assert_eq!(hit.worker, 2, "key {i}");
        assert!(
            matches!(
                hit.reason,
                Reason::CacheHit { .. } | Reason::TokenHit { .. }
            ),
            "{hit:?}"
        );
        r.catch_up();
    }
    assert_eq!(
        (r.tree_chars("m"), r.tree_tokens("m")),
        (text.text.chars().count(), 64)
    );
}

/// A retry vetoes the failed holder: the next decision picks among the others, and the
/// failed attempt left no trace in the tree (bug-cases.md B43: at most one failed attempt).
#[test]
fn b43_a_vetoed_holder_is_never_chosen() {
    let r = router(PolicyKind::CacheAware);
    let key = text_key(&"prefix held by worker one only ".repeat(4));
    r.record(
        &key,
        &Decision {
            worker: 1,
            reason: Reason::CacheMiss,
        },
        0,
    );
    let d = r.decide(&snap(&[0, 0, 0], &[0, 1, 2], 0), &key, &mut rand::rng());
    assert_eq!(d.worker, 1);
    for _ in 0..50 {
        let d = r.decide(&snap(&[3, 0, 5], &[0, 2], 0), &key, &mut rand::rng());
        assert_eq!((d.worker, d.reason), (0, Reason::CacheMiss));
    }
    for kind in [PolicyKind::RoundRobin, PolicyKind::LeastRequest] {
        let r = router(kind);
        for seq in 0..20 {
            let d = r.decide(&snap(&[0, 0, 0, 0], &[1, 3], seq), &key, &mut rand::rng());
            assert!(d.worker == 1 || d.worker == 3, "{kind:?} chose {d:?}");
        }
    }
    // round_robin takes eligible workers in turn by sequence number.
    let r = router(PolicyKind::RoundRobin);
    let turns: Vec<usize> = (0..4)
        .map(|seq| {
            r.decide(&snap(&[0; 4], &[0, 2, 3], seq), &key, &mut rand::rng())
                .worker
        })
        .collect();
    assert_eq!(turns, vec![0, 2, 3, 0]);
}

/// bug-cases.md B5: healthy workers at [5, 5] and an unhealthy one at 0. The spill gate's
/// mean is over eligible workers (5), so the holder is not hot and keeps its affinity; over
/// all three (mean 3.3) with a margin of 1 it would have been hot.
#[test]
fn b5_unhealthy_workers_stay_out_of_the_balance_statistics() {
    let r = Router::new(&Config {
        policy: PolicyKind::CacheAware,
        balance_abs_threshold: 1,
        balance_rel_threshold: 1.0,
        ..Config::default()
    });
    let key = text_key(&"held by worker zero ".repeat(4));
    r.record(
        &key,
        &Decision {
            worker: 0,
            reason: Reason::CacheMiss,
        },
        0,
    );
    let loads = [5, 5, 0];
    let g = SpillGate::new(&loads, &[0, 1], 1.0, 1);
    assert!(!g.is_hot(5));
    assert!(SpillGate::new(&loads, &[0, 1, 2], 1.0, 1).is_hot(5));
    let d = r.decide(&snap(&loads, &[0, 1], 0), &key, &mut rand::rng());
    assert_eq!(d.worker, 0, "{d:?}");
    assert!(matches!(d.reason, Reason::CacheHit { .. }));
}

// ---- The cost policies' worked examples (anchors.md §7) ---------------------------------

fn loads_with(decode_blocks: &[u64], prefill_tokens: &[u64]) -> Vec<WorkerLoad> {
    decode_blocks
        .iter()
        .zip(prefill_tokens)
        .map(|(&d, &p)| {
            let mut w = WorkerLoad::default();
            w.active.decode_blocks = d;
            w.active.prefill_tokens = p;
            w
        })
        .collect()
}

fn request_of(key: &RouteKey, tokens: u64) -> Request<'_> {
    Request {
        key,
        ids: None,
        block_keys: BlockKeySeq::default(),
        prompt_tokens: tokens,
        chars: 0,
        block_size: 16,
    }
}

fn event_overlaps(blocks: &[usize], request_tokens: usize) -> prefix::Overlaps {
    let found: Vec<(TenantId, usize)> = blocks
        .iter()
        .enumerate()
        .map(|(w, &b)| (w as TenantId, b * 16))
        .collect();
    prefix::Overlaps::from_index(
        prefix::Source::Events,
        prefix::Unit::Tokens,
        &found,
        blocks.len(),
        request_tokens,
        1.0,
    )
}

fn costs_of(p: &KvParams, workers: &[WorkerLoad], tokens: u64, blocks: &[usize]) -> Vec<f64> {
    let eligible: Vec<usize> = (0..workers.len()).collect();
    let snap = Snapshot {
        workers,
        ids: &[],
        eligible: &eligible,
        seq: 0,
        now_ms: 0,
        live: None,
    };
    let key = RouteKey::default();
    kv_aware::costs(
        p,
        &snap,
        &request_of(&key, tokens),
        &event_overlaps(blocks, tokens as usize),
    )
    .into_iter()
    .map(|c| c.1)
    .collect()
}

/// E1 (Infera / seed doc's `--kv-overlap-weight`, the simple form): 10-block prompt; W0 holds
/// 8 with 6 active blocks, W1 holds none with 1 → costs 8 and 11, W0 wins; weight 0 → load
/// only: 6 and 1, W1 wins.
#[test]
fn e1_the_simple_form_of_the_cost() {
    let workers = loads_with(&[6, 1], &[0, 0]);
    let weight = |w: f64| {
        KvParams::of(&crate::config::PolicyKnobs {
            kv_overlap_weight: Some(w),
            ..Default::default()
        })
    };
    assert_eq!(
        costs_of(&weight(1.0), &workers, 160, &[8, 0]),
        vec![8.0, 11.0]
    );
    assert_eq!(
        costs_of(&weight(0.0), &workers, 160, &[8, 0]),
        vec![6.0, 1.0]
    );
}

/// E2 (Dynamo, 3 workers): raw prefill 10 blocks each, overlaps 2 / 5 / 8, decode blocks
/// 10 / 5 / 9 → costs 18 / 10 / 11; the second worker wins.
#[test]
fn e2_dynamo_cost_of_three_workers() {
    let workers = loads_with(&[10, 5, 9], &[0, 0, 0]);
    let c = costs_of(&KvParams::dynamo(), &workers, 160, &[2, 5, 8]);
    assert_eq!(c, vec![18.0, 10.0, 11.0]);
    let eligible = [0, 1, 2];
    let snap = Snapshot {
        workers: &workers,
        ids: &[],
        eligible: &eligible,
        seq: 0,
        now_ms: 0,
        live: None,
    };
    let key = RouteKey::default();
    let d = kv_aware::decide(
        &KvParams::dynamo(),
        &snap,
        &request_of(&key, 160),
        &event_overlaps(&[2, 5, 8], 160),
        &mut rand::rng(),
    );
    assert_eq!(d.worker, 1);
    assert_eq!(d.reason.as_str(), "cost_hit");
}

/// E3 (Dynamo's decay): 8-block request, both workers match 6, booked prefill 0 and 8
/// blocks. Decay 0: costs 2 and 10. Decay 1: the loaded worker's credit is 6 / 2 = 3 → cost
/// 13; the least loaded stays 2. Deprecated-weight rule (anchors.md §3.2): weight 2.5 over
/// credit 0.5 and scale 3.0 → credit 0.5, scale 2.5.
#[test]
fn e3_dynamo_decay_and_the_deprecated_weight() {
    let workers = loads_with(&[0, 0], &[0, 128]);
    assert_eq!(
        costs_of(&KvParams::dynamo(), &workers, 128, &[6, 6]),
        vec![2.0, 10.0]
    );
    let decayed = KvParams {
        credit_decay: 1.0,
        ..KvParams::dynamo()
    };
    assert_eq!(costs_of(&decayed, &workers, 128, &[6, 6]), vec![2.0, 13.0]);
    let k = crate::config::PolicyKnobs {
        kv_overlap_weight: Some(2.5),
        overlap_score_credit: 0.5,
        prefill_load_scale: 3.0,
        ..Default::default()
    };
    assert_eq!(k.kv_credit_and_scale(), (0.5, 2.5));
}

/// Dynamo's potential blocks: a 10-block request, no cached overlap; W0 decodes 4 blocks, W1
/// none. Without live requests both add all 10: costs 10 + 4 + 10 = 24 and 10 + 0 + 10 = 20,
/// W1 wins. With live requests on W0 holding the request's first 6 blocks, W0 adds only 4:
/// cost 18 < 20, W0 wins. A request without block keys (text mode) adds nothing: 14 and 10.
#[test]
fn dynamo_potential_blocks_count_the_live_head() {
    let workers = loads_with(&[4, 0], &[0, 0]);
    let eligible = [0, 1];
    let key = RouteKey::default();
    let mut req = request_of(&key, 160);
    req.block_keys = (0..10u64).collect();
    let ov = event_overlaps(&[0, 0], 160);
    let live = SharedOn(0, 6);
    let p = KvParams::dynamo();
    let run = |snap: &Snapshot, req: &Request| {
        let c: Vec<f64> = kv_aware::costs(&p, snap, req, &ov)
            .into_iter()
            .map(|c| c.1)
            .collect();
        (
            c,
            kv_aware::decide(&p, snap, req, &ov, &mut rand::rng()).worker,
        )
    };
    assert_eq!(
        run(&snap_of(&workers, &eligible), &req),
        (vec![24.0, 20.0], 1)
    );
    let with_live = Snapshot {
        live: Some(&live),
        ..snap_of(&workers, &eligible)
    };
    assert_eq!(run(&with_live, &req), (vec![18.0, 20.0], 0));
    assert_eq!(
        run(&with_live, &request_of(&key, 160)),
        (vec![14.0, 10.0], 1)
    );
}

/// E9 (SMG's expected wait): A 4,000 queued tokens at KV 0.5 → 2.15 s; B 1,000 queued + 500
/// since the poll at KV 0.9 → 2.10 s: B wins; with 1,200 since the poll B loses (2.45 s).
#[test]
fn e9_expected_wait_with_since_poll_credit() {
    let report = |tokens, usage| crate::load::EngineReport {
        waiting_tokens: Some(tokens),
        kv_usage: Some(usage),
        ..Default::default()
    };
    let mut workers = vec![WorkerLoad::default(); 2];
    workers[0].active.engine = Some(report(4_000, 0.5));
    workers[1].active.engine = Some(report(1_000, 0.9));
    workers[1].active.since_poll_tokens = 500;
    let eligible = [0, 1];
    let snap = |w: &[WorkerLoad]| -> (f64, f64) {
        let s = Snapshot {
            workers: w,
            ids: &[],
            eligible: &eligible,
            seq: 0,
            now_ms: 0,
            live: None,
        };
        (expected_wait_s(&s, 0, false), expected_wait_s(&s, 1, false))
    };
    let (a, b) = snap(&workers);
    assert!(
        (a - 2.15).abs() < 1e-9 && (b - 2.10).abs() < 1e-9,
        "{a} {b}"
    );
    workers[1].active.since_poll_tokens = 1_200;
    let (a, b) = snap(&workers);
    assert!((b - 2.45).abs() < 1e-9 && a < b);
    let s = Snapshot {
        workers: &workers,
        ids: &[],
        eligible: &eligible,
        seq: 0,
        now_ms: 0,
        live: None,
    };
    assert_eq!(s.least_wait(&mut rand::rng()), 0);
}

/// A cold index degenerates to the least-loaded eligible worker for every index-reading
/// policy — never to "always worker 0" (bug-cases.md B1): over 4 workers with worker 0
/// loaded, a miss never goes to it; with equal loads the choice spreads.
#[test]
fn a_cold_index_is_the_least_loaded_never_worker_zero() {
    for kind in [
        PolicyKind::CacheAware,
        PolicyKind::SmgCacheAware,
        PolicyKind::KvAware,
        PolicyKind::DynamoKv,
        PolicyKind::PredictedTtft,
    ] {
        let r = router(kind);
        let mut workers = WorkerLoad::of_requests(&[5, 1, 1, 1]);
        workers[0].active.decode_blocks = 100;
        workers[0].active.prefill_tokens = 4_000;
        workers[0].active.prefill_wait_ms = 500.0;
        let eligible = [0, 1, 2, 3];
        let mut seen = [0usize; 4];
        for i in 0..200u64 {
            let snap = Snapshot {
                workers: &workers,
                ids: &[],
                eligible: &eligible,
                seq: i,
                now_ms: 0,
                live: None,
            };
            let key = text_key(&format!("{i:08} a cold prompt"));
            seen[r.decide(&snap, &key, &mut rand::rng()).worker] += 1;
        }
        assert_eq!(seen[0], 0, "{kind}: {seen:?}");
        assert!(seen[1..].iter().all(|&n| n > 30), "{kind}: {seen:?}");
    }
}

proptest! {
    /// No policy ever picks an ineligible worker, and `decide` records nothing, over random
    /// snapshots (loads, bookings, engine reports, eligible subsets) and prompts held by
    /// random workers (the holders often ineligible).
    #[test]
    fn no_policy_picks_an_ineligible_worker(
        loads in prop::collection::vec((0usize..20, 0u64..5_000, 0u64..200, prop::option::of(0.0f64..1.0)), 2..7),
        mask in 1u32..127,
        holder in 0usize..7,
        seq in 0u64..100,
    ) {
        let n = loads.len();
        let eligible: Vec<usize> = (0..n).filter(|w| mask & (1 << w) != 0).collect();
        prop_assume!(!eligible.is_empty());
        let workers: Vec<WorkerLoad> = loads.iter().map(|&(r, p, d, u)| {
            let mut w = WorkerLoad { requests: r, in_flight: r, ..WorkerLoad::default() };
            w.active.prefill_tokens = p;
            w.active.prefill_wait_ms = p as f64 / 10.0;
            w.active.decode_blocks = d;
            w.active.engine = u.map(|u| crate::load::EngineReport { kv_usage: Some(u), capacity_blocks: Some(1_000), ..Default::default() });
            w
        }).collect();
        let key = RouteKey { input_ids: Some((0..200).collect()), session: Some(format!("s{seq}")), ..text_key(&"held prompt ".repeat(20)) };
        for kind in PolicyKind::ALL {
            let r = router(kind);
            r.record(&key, &Decision { worker: holder % n, reason: Reason::CacheMiss }, 0);
            r.flush();
            let before = r.index_sizes();
            let snap = Snapshot { workers: &workers, ids: &[], eligible: &eligible, seq, now_ms: 0 , live: None};
            let d = r.decide(&snap, &key, &mut rand::rng());
            prop_assert!(eligible.contains(&d.worker), "{} chose {:?} of {:?}", kind, d, eligible);
            r.flush();
            prop_assert_eq!(r.index_sizes(), before, "{} wrote in decide", kind);
        }
    }
}

/// `requests` concurrent requests (`prompt(i)`) dispatched over `n` fresh workers as the
/// gateway does it (snapshot, decide, book, record, hold the guard); each worker's engine
/// reported 0 running at one poll before them when `polled`. Returns the requests per worker
/// while all are in flight; checks that dropping the guards brings every load back to 0.
fn dispatch_concurrent(
    kind: PolicyKind,
    n: usize,
    requests: u64,
    polled: bool,
    prompt: impl Fn(u64) -> String,
) -> Vec<usize> {
    use crate::workers::Workers;
    let r = router(kind);
    let urls: Vec<String> = (0..n).map(|i| format!("http://w{i}:80")).collect();
    let workers = Workers::new(&urls).unwrap();
    if polled {
        for w in workers.iter() {
            w.report_engine(Some(crate::load::EngineReport::requests(0)));
        }
    }
    let mut guards = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for i in 0..requests {
        let key = text_key(&prompt(i));
        let view = workers.snapshot("m", &[], 0);
        let snap = Snapshot {
            workers: &view.workers,
            ids: &[],
            eligible: &view.eligible,
            seq: i,
            now_ms: 0,
            live: None,
        };
        let d = r.decide(&snap, &key, &mut rng);
        let booking = r.booking(&snap, &key, &d);
        guards.push(workers.get(d.worker).unwrap().acquire_booked(booking, 0.0));
        r.record(&key, &d, 0);
    }
    let loads = workers.loads();
    drop(guards);
    assert_eq!(
        workers.loads(),
        vec![0; n],
        "{kind}: every guard releases once"
    );
    loads
}

/// bug-cases.md B6 (vllm-project/router #177): engines polled idle, then 8 concurrent
/// requests inside one poll interval over 4 workers: the since-poll credit keeps any worker
/// from taking more than 3 (power_of_two) — exactly 2 each for least_load.
#[test]
fn b6_no_herd_on_the_last_polls_idlest_worker() {
    let prompt = |i: u64| format!("{i:04} a prompt of some length to book tokens");
    let p2 = dispatch_concurrent(PolicyKind::PowerOfTwo, 4, 8, true, prompt);
    assert!(p2.iter().all(|&n| n <= 3), "{p2:?}");
    let ll = dispatch_concurrent(PolicyKind::LeastLoad, 4, 8, true, prompt);
    assert_eq!(ll, vec![2, 2, 2, 2]);
}

/// bug-cases.md B10 (ai-dynamo/dynamo #7836): 256 concurrent single-turn requests over 5
/// workers: every worker gets at least 10 % under every load-aware policy.
#[test]
fn b10_every_worker_gets_work_under_concurrency() {
    for kind in PolicyKind::ALL {
        if matches!(kind, PolicyKind::PureAffinity | PolicyKind::Random) {
            continue; // load-blind by design
        }
        let loads = dispatch_concurrent(kind, 5, 256, false, |i| {
            format!(
                "{:016x} single turn",
                (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            )
        });
        assert!(loads.iter().all(|&n| n * 10 >= 256), "{kind}: {loads:?}");
    }
}

/// bug-cases.md B2 (sgl-project/sglang #14305): unique prompts while the worker holding the
/// least in the index is the busiest: misses go to the least loaded, never to the smallest
/// tree.
#[test]
fn b2_misses_never_go_to_the_smallest_tree() {
    for kind in [
        PolicyKind::CacheAware,
        PolicyKind::SmgCacheAware,
        PolicyKind::PredictedTtft,
        PolicyKind::KvAware,
    ] {
        let r = router(kind);
        for (w, text) in [(1, "one"), (2, "two"), (3, "three")] {
            let key = text_key(&format!("{text} held prompt ").repeat(8));
            r.record(
                &key,
                &Decision {
                    worker: w,
                    reason: Reason::CacheMiss,
                },
                0,
            );
        }
        let mut workers = WorkerLoad::of_requests(&[9, 1, 2, 2]);
        workers[0].active.prefill_wait_ms = 900.0;
        workers[0].active.prefill_tokens = 9_000;
        workers[0].active.decode_blocks = 900;
        let eligible = [0, 1, 2, 3];
        for i in 0..20u64 {
            let snap = Snapshot {
                workers: &workers,
                ids: &[],
                eligible: &eligible,
                seq: i,
                now_ms: 0,
                live: None,
            };
            let d = r.decide(
                &snap,
                &text_key(&format!("{i:04} unique")),
                &mut rand::rng(),
            );
            assert_ne!(d.worker, 0, "{kind}: {d:?}");
        }
    }
}

/// Live requests on worker `.0` share `.1` blocks with any prompt (and hold them).
#[derive(Debug)]
struct SharedOn(usize, usize);
impl LivePaths for SharedOn {
    fn shared_head(&self, w: usize, _: &BlockKeySeq) -> usize {
        if w == self.0 { self.1 } else { 0 }
    }
    fn live_head(&self, w: usize, keys: &BlockKeySeq) -> usize {
        self.shared_head(w, keys)
    }
}

/// predicted_ttft, worked example on the prior curve (engine-model.md §4; defaults α 50 for
/// a continuation while every worker is prefilling, 1 for a miss, τ 1 s; exploration off;
/// nothing decoding, no KV report), two workers, both with a prefill booked, an 8,704-token
/// prompt. prefill(512) = 16.50 + 15.18 × 0.512 + 0.421 × 0.512² =
/// 24.386, prefill(7,680) = 157.942, prefill(8,704) = 2 × 16.50 + 15.18 × 8.704 + 0.421 ×
/// (8.192² + 0.512²) = 193.523.
///
/// Continuation (worker 0 holds 8,192 tokens: 94 % > 30 %): idle worker 1 costs
/// 50 × 193.523 + 193.523² / 1000 = 9,713.60; worker 0 at wait W costs W + 50 × 24.386 +
/// (W + 24.386)² / 1000: 7,317.44 at 2,000 ms (stays), 13,366.21 at 3,000 ms (moves). With
/// worker 1 idle (half the fleet prefilling) α is 1 + 49 × 0.5 = 25.5: worker 1 costs
/// 4,972.29, worker 0 4,445.60 at 1,500 ms (stays) and 6,719.98 at 2,000 ms (moves).
///
/// Miss (worker 0 holds 1,024 tokens: 12 % ≤ 30 %, α 1): worker 1 costs 193.523 + 37.451 =
/// 230.97; worker 0 costs W + 157.942 + (W + 157.942)² / 1000: 182.89 idle (stays), 251.18
/// at 50 ms (moves).
///
/// Shared head (worker 0 holds 8,192 tokens, but live requests there share the first 8,000,
/// 500 blocks: 192 ≤ 30 % of the 704 beyond them): a miss, so worker 0 costs W + 24.386 +
/// (W + 24.386)² / 1000: 139.86 at 100 ms (stays), 274.74 at 200 ms (moves). With 6,400
/// shared (1,792 > 30 % of 2,304) it is a continuation again.
#[test]
fn predicted_ttft_worked_example() {
    let key = RouteKey::default();
    let req = request_of(&key, 8_704);
    let p = TtftParams::of(&Config::default().knobs);
    assert_eq!(
        (p.prefill_weight, p.miss_prefill_weight, p.tail_ms),
        (50.0, 1.0, 1_000.0)
    );
    // On the fitted curve itself (no exploration discount: both workers are unmeasured).
    let p = TtftParams { explore: 0.0, ..p };
    let eligible = [0, 1];
    let pick_on = |held: usize, wait: f64, shared_blocks: usize, other_busy: bool| {
        let ov = prefix::Overlaps::from_index(
            prefix::Source::Events,
            prefix::Unit::Tokens,
            &[(0, held)],
            2,
            8_704,
            1.0,
        );
        let mut workers = vec![WorkerLoad::default(); 2];
        workers[0].active.prefill_wait_ms = wait;
        workers[0].active.prefill_requests = 1;
        workers[0].in_flight = 1;
        workers[0].requests = 1;
        if other_busy {
            workers[1].active.prefill_requests = 1;
            workers[1].in_flight = 1;
            workers[1].requests = 1;
        }
        let live = SharedOn(0, shared_blocks);
        let snap = Snapshot {
            live: Some(&live),
            ..snap_of(&workers, &eligible)
        };
        let ctx = predicted_ttft::Context::of(&p, &snap, &req, &ov);
        let cost = |w| {
            predicted_ttft::terms(&p, &ctx, &snap, &req, &ov, w, &std::cell::Cell::new(None))
                .cost(&p, &ctx)
        };
        let (c0, c1) = (cost(0), cost(1));
        let d = predicted_ttft::decide(&p, &snap, &req, &ov, &mut rand::rng());
        (ctx.continuation, c0, c1, d.worker)
    };
    let pick = |held, wait, shared_blocks| pick_on(held, wait, shared_blocks, true);
    let close = |got: f64, want: f64| (got - want).abs() < 0.1;
    for (wait, want0, want_worker) in [(2_000.0, 7_317.44, 0), (3_000.0, 13_366.21, 1)] {
        let (continuation, c0, c1, w) = pick(8_192, wait, 0);
        assert!(continuation);
        assert!(close(c0, want0) && close(c1, 9_713.60), "{wait}: {c0} {c1}");
        assert_eq!(w, want_worker, "{wait}");
    }
    for (wait, want0, want_worker) in [(0.0, 182.89, 0), (50.0, 251.18, 1)] {
        let (continuation, c0, c1, w) = pick(1_024, wait, 0);
        assert!(!continuation);
        assert!(close(c0, want0) && close(c1, 230.97), "{wait}: {c0} {c1}");
        assert_eq!(w, want_worker, "{wait}");
    }
    for (wait, want0, want_worker) in [(100.0, 139.86, 0), (200.0, 274.74, 1)] {
        let (continuation, c0, c1, w) = pick(8_192, wait, 500);
        assert!(!continuation);
        assert!(close(c0, want0) && close(c1, 230.97), "{wait}: {c0} {c1}");
        assert_eq!(w, want_worker, "{wait}");
    }
    assert!(pick(8_192, 0.0, 400).0);
    for (wait, want0, want_worker) in [(1_500.0, 4_445.60, 0), (2_000.0, 6_719.98, 1)] {
        let (continuation, c0, c1, w) = pick_on(8_192, wait, 0, false);
        assert!(continuation);
        assert!(close(c0, want0) && close(c1, 4_972.29), "{wait}: {c0} {c1}");
        assert_eq!(w, want_worker, "{wait}");
    }
}

/// predicted_ttft's decode term: workers with 1,000 and 3,000 unique decode blocks (mean
/// 2,000), one block's prefill on the prior curve 169.14 ms / 512 = 0.3303 ms. A continuation
/// (worker 0 holds half the prompt) at the default margin 0.25 (floor 2,500): worker 0 pays
/// nothing and worker 1 0.5 × 500 × 0.3303 = 82.59 ms. A miss, or margin −1 (Dynamo's form),
/// charges every block: 0.5 × 1,000 × 0.3303 = 165.17 and 495.52 ms.
#[test]
fn predicted_ttft_decode_term_with_and_without_a_margin() {
    let key = RouteKey::default();
    let req = request_of(&key, 1_024);
    let held = |tokens| {
        prefix::Overlaps::from_index(
            prefix::Source::Events,
            prefix::Unit::Tokens,
            &[(0, tokens)],
            2,
            1_024,
            1.0,
        )
    };
    let mut workers = vec![WorkerLoad::default(); 2];
    workers[0].active.decode_blocks = 1_000;
    workers[1].active.decode_blocks = 3_000;
    let eligible = [0, 1];
    let snap = snap_of(&workers, &eligible);
    let decode = |p: &TtftParams, ov: &prefix::Overlaps| {
        let ctx = predicted_ttft::Context::of(p, &snap, &req, ov);
        let t = |w| {
            predicted_ttft::terms(p, &ctx, &snap, &req, ov, w, &std::cell::Cell::new(None)).decode
        };
        (ctx.decode_floor, t(0), t(1))
    };
    let close = |got: f64, want: f64| (got - want).abs() < 0.01;
    let p = TtftParams::of(&Config::default().knobs);
    assert_eq!(p.decode_margin, 0.25);
    let (floor, d0, d1) = decode(&p, &held(512));
    assert!(
        close(floor, 2_500.0) && d0 == 0.0 && close(d1, 82.59),
        "{d0} {d1}"
    );
    let every_block =
        |(floor, d0, d1): (f64, f64, f64)| floor == 0.0 && close(d0, 165.17) && close(d1, 495.52);
    assert!(every_block(decode(&p, &held(0))), "a miss");
    let dynamo = TtftParams {
        decode_margin: -1.0,
        ..p
    };
    assert!(every_block(decode(&dynamo, &held(512))), "margin -1");
}

/// predicted_ttft's memory-fit charge counts the whole prompt: a request runs with every
/// block of its prompt in GPU memory, its cached blocks included (vLLM takes them from the
/// same free pool its KV usage leaves), so an 8,704-token prompt (544 blocks of 16) with
/// 8,192 tokens cached on worker 0 needs 544 free blocks there, not its 32 new ones. Worker 0
/// has 1,000 blocks: at KV usage 0.6 (400 free) it is charged the 10 s no-fit cost; at 0.4
/// (600 free) nothing. Charging only new blocks let two long conversations that together
/// outgrow one worker's memory keep sharing it (WEKA seed 9: TTFT p99 9,093 ms against
/// 3,709 once whole prompts count; perf/runs/2026-12-04-busy-alpha). Cached blocks that
/// live requests on the worker hold are in its usage already: with 480 of them live on
/// worker 0 it needs 544 − 480 = 64 of 400 free blocks and pays nothing; worker 1, holding
/// none of the prompt, still does.
#[test]
fn predicted_ttft_a_hit_must_fit_whole() {
    let key = RouteKey::default();
    let req = request_of(&key, 8_704);
    let ov = prefix::Overlaps::from_index(
        prefix::Source::Events,
        prefix::Unit::Tokens,
        &[(0, 8_192)],
        2,
        8_704,
        1.0,
    );
    let p = TtftParams::of(&Config::default().knobs);
    assert_eq!(p.no_fit_ms, 10_000.0);
    let eligible = [0, 1];
    let no_fit_live = |usage: f64, live_blocks: usize| {
        let mut workers = vec![WorkerLoad::default(); 2];
        for w in &mut workers {
            w.active.engine = Some(crate::load::EngineReport {
                kv_usage: Some(usage),
                capacity_blocks: Some(1_000),
                ..Default::default()
            });
        }
        let live = SharedOn(0, live_blocks);
        let snap = Snapshot {
            live: Some(&live),
            ..snap_of(&workers, &eligible)
        };
        let ctx = predicted_ttft::Context::of(&p, &snap, &req, &ov);
        let t = |w| {
            predicted_ttft::terms(&p, &ctx, &snap, &req, &ov, w, &std::cell::Cell::new(None)).no_fit
        };
        (t(0), t(1))
    };
    let no_fit = |usage| no_fit_live(usage, 0);
    assert_eq!(no_fit(0.6), (10_000.0, 10_000.0));
    assert_eq!(no_fit(0.4), (0.0, 0.0));
    // 544 blocks against 1,000 × (1 − 0.5) = 500 free: the new blocks alone would fit.
    assert_eq!(no_fit(0.5).0, 10_000.0);
    assert_eq!(no_fit_live(0.6, 480), (0.0, 10_000.0));
    // Live blocks beyond the worker's overlap (512 cached blocks) do not count.
    assert_eq!(no_fit_live(0.6, 1_000).0, 0.0);
    assert_eq!(no_fit_live(0.97, 1_000).0, 10_000.0);
}

/// A registry of `n` workers whose model lists are not known yet (each takes any model).
fn fleet_of(n: usize) -> crate::workers::Workers {
    let urls: Vec<String> = (0..n).map(|i| format!("http://w{i}:80")).collect();
    crate::workers::Workers::new(&urls).unwrap()
}

/// Workers of the large-fleet tests: 4 × [`defaults::FULL_SCAN_WORKERS`], so decisions score
/// a candidate set.
const LARGE: usize = 4 * defaults::FULL_SCAN_WORKERS;

/// Most candidates of one decision: two answers' holders and the sample.
const MOST_CANDIDATES: usize = 2 * defaults::CANDIDATE_HOLDERS + defaults::CANDIDATE_SAMPLE;

/// A router of `kind`, a fleet of [`LARGE`] workers ([`fleet_of`]) and an rng seeded `seed`.
fn large_fleet(
    kind: PolicyKind,
    seed: u64,
) -> (Router, crate::workers::Workers, rand::rngs::StdRng) {
    (
        router(kind),
        fleet_of(LARGE),
        rand::rngs::StdRng::seed_from_u64(seed),
    )
}

/// Above [`defaults::FULL_SCAN_WORKERS`] slots, predicted_ttft scores a candidate set of at
/// most 2 answers' holders + the sample, and still sends each conversation's second turn to
/// the worker of its first (the holder is a candidate), never to a vetoed worker.
#[test]
fn a_large_fleet_decides_on_candidates_and_keeps_affinity() {
    let (r, workers, mut rng) = large_fleet(PolicyKind::PredictedTtft, 3);
    let most = MOST_CANDIDATES;
    for c in 0..40u64 {
        let t1 = format!(
            "conversation {c}: {}",
            "a long document of words ".repeat(40)
        );
        let k1 = text_key(&t1);
        let (view, d1) = r
            .decide_on(&workers, &[], c, 0, &r.request(&k1), &mut rng)
            .unwrap();
        assert!(
            !view.ids.is_empty() && view.ids.len() <= most,
            "{}",
            view.ids.len()
        );
        assert!(view.ids.contains(&d1.worker));
        // The first turn is answered before the second is sent.
        let booking = r.booking_request(&view.snapshot(c, 0), &r.request(&k1), &d1);
        let guard = workers.get(d1.worker).unwrap().acquire_booked(booking, 0.0);
        guard.first_token(0.5);
        drop(guard);
        r.record(&k1, &d1, 0);
        r.flush();
        let k2 = text_key(&format!("{t1} and then a question"));
        let (view, d2) = r
            .decide_on(&workers, &[], c, 1, &r.request(&k2), &mut rng)
            .unwrap();
        assert!(view.ids.len() <= most);
        assert_eq!(d2.worker, d1.worker, "conversation {c}");
        assert!(
            matches!(d2.reason, Reason::Cost { matched_tokens, .. } if matched_tokens > 0),
            "{:?}",
            d2.reason
        );
        let (_, d3) = r
            .decide_on(&workers, &[d1.worker], c, 2, &r.request(&k2), &mut rng)
            .unwrap();
        assert_ne!(d3.worker, d1.worker, "a vetoed holder");
    }
}

/// Prompt `c` of [`large_event_fleet`]: the shared system prompt, then 128 tokens of its own.
fn large_event_prompt(system_tokens: u32, c: u32) -> Vec<u32> {
    (0..system_tokens)
        .chain((0..128).map(|t| 1_000 + c * 1_000 + t))
        .collect()
}

/// The one worker whose engine holds prompt `c` of [`large_event_fleet`] whole.
fn large_event_holder(c: u32) -> usize {
    (c as usize * 97 + 13) % LARGE
}

/// One `BlockStored` batch of DP rank `rank`: `tokens` in blocks of 16 with engine hashes
/// `first..`, under `parent`.
fn stored_batch(
    parent: Option<u64>,
    first: u64,
    tokens: &[u32],
    rank: Option<u32>,
) -> crate::events::EventBatch {
    use crate::events::{BlockStored, EventBatch, KvEvent};
    let stored = BlockStored {
        block_hashes: (first..first + tokens.len() as u64 / 16).collect(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: 16,
        ..BlockStored::default()
    };
    EventBatch {
        ts: 0.0,
        events: vec![KvEvent::Stored(stored)],
        dp_rank: rank,
        skipped_events: 0,
    }
}

/// An event index over [`LARGE`] workers (blocks of 16 tokens): every worker holds a
/// system prompt of `system_tokens` (a multiple of 16), and [`large_event_holder`]`(c)`
/// holds the whole of [`large_event_prompt`]`(c)` for `c < 20`.
fn large_event_fleet(system_tokens: u32) -> crate::events::EventIndex {
    use crate::events::{EventIndex, EventIndexSettings, StreamId};
    let mut ev = EventIndex::with_settings(&EventIndexSettings {
        block_size: 16,
        max_streams: LARGE,
        ttl_ms: None,
        max_entries: None,
    });
    let mut store = |worker: usize, parent: Option<u64>, first: u64, tokens: &[u32]| {
        let stream = StreamId {
            worker: worker as u32,
            rank: 0,
        };
        ev.apply_batch(stream, &stored_batch(parent, first, tokens, None));
    };
    let system: Vec<u32> = (0..system_tokens).collect();
    let system_blocks = u64::from(system_tokens / 16);
    for w in 0..LARGE {
        store(w, None, 1, &system);
    }
    for c in 0..20 {
        store(
            large_event_holder(c),
            Some(system_blocks),
            system_blocks + 1,
            &large_event_prompt(system_tokens, c)[system_tokens as usize..],
        );
    }
    ev
}

/// On the event index over [`LARGE`] workers that all hold a fleet-wide system prompt (the
/// first 4 blocks of every prompt), predicted_ttft sends each conversation to the one worker
/// holding the whole of it, with its whole overlap: that worker is a candidate through the
/// event index's grouped answer (the sample alone would draw it in about one decision of
/// [`LARGE`] / `candidate_sample`), and a vetoed holder is never chosen.
#[test]
fn a_large_fleet_on_events_finds_the_one_deep_holder_among_all_sharing_a_prefix() {
    let ev = large_event_fleet(64);
    let prompt = |c| large_event_prompt(64, c);
    let holder = large_event_holder;
    let (mut r, workers, mut rng) = large_fleet(PolicyKind::PredictedTtft, 11);
    r.set_event_index(ev.reader());
    let most = MOST_CANDIDATES;
    for c in 0..20 {
        let key = ids_key(prompt(c));
        let req = r.request(&key);
        let (view, d) = r.decide_on(&workers, &[], 0, 0, &req, &mut rng).unwrap();
        assert!(view.ids.len() <= most, "{}", view.ids.len());
        assert_eq!(d.worker, holder(c), "conversation {c}: {:?}", d.reason);
        assert!(
            matches!(
                d.reason,
                Reason::Cost {
                    matched_tokens: 192,
                    ..
                }
            ),
            "{:?}",
            d.reason
        );
        let (_, d) = r
            .decide_on(&workers, &[holder(c)], 0, 0, &req, &mut rng)
            .unwrap();
        assert_ne!(d.worker, holder(c));
        assert!(
            matches!(
                d.reason,
                Reason::Cost {
                    matched_tokens: 64,
                    ..
                }
            ),
            "the system prompt is held everywhere: {:?}",
            d.reason
        );
    }
}

/// On the event index over [`LARGE`] workers, the token tree is asked only when the events
/// may not answer: with the one deep event holder vetoed and every other worker holding only
/// a system prompt under the threshold (32 of 160 tokens), the worker the router sent the
/// same prompt to (known to the tree, not yet to the events) takes it, though the tree was
/// not asked for candidates up front.
#[test]
fn a_large_fleet_on_events_falls_back_to_the_tree_when_the_deep_holder_is_vetoed() {
    let ev = large_event_fleet(32);
    let (mut r, workers, mut rng) = large_fleet(PolicyKind::PredictedTtft, 13);
    r.set_event_index(ev.reader());
    for c in 0..20 {
        let key = ids_key(large_event_prompt(32, c));
        let req = r.request(&key);
        let holder = large_event_holder(c);
        let (_, d) = r.decide_on(&workers, &[], 0, 0, &req, &mut rng).unwrap();
        assert_eq!(d.worker, holder, "conversation {c}: {:?}", d.reason);
        // The router sent this prompt to another worker before; its engine has not said so.
        let sent = (holder + LARGE / 2) % LARGE;
        let to_sent = Decision {
            worker: sent,
            reason: d.reason,
        };
        r.record(&key, &to_sent, 0);
        r.flush();
        let (_, d) = r
            .decide_on(&workers, &[holder], 0, 0, &req, &mut rng)
            .unwrap();
        assert_eq!(d.worker, sent, "conversation {c}: {:?}", d.reason);
        assert!(
            matches!(d.reason, Reason::Cost { matched_tokens, .. } if matched_tokens >= 128),
            "{:?}",
            d.reason
        );
    }
}

/// least_request on candidates (power of d choices) over [`LARGE`] workers, 3 requests per
/// worker held: no worker ends above mean + 1, against the whole fleet's exact mean.
#[test]
fn a_large_fleet_least_request_on_candidates_stays_within_one_of_the_mean() {
    let n = LARGE;
    let (r, workers, mut rng) = large_fleet(PolicyKind::LeastRequest, 5);
    let mut guards = Vec::new();
    for i in 0..3 * n as u64 {
        let key = text_key(&format!("request {i}"));
        let req = r.request(&key);
        let (view, d) = r.decide_on(&workers, &[], i, 0, &req, &mut rng).unwrap();
        assert!(view.ids.len() <= defaults::CANDIDATE_SAMPLE);
        let booking = r.booking_request(&view.snapshot(i, 0), &req, &d);
        guards.push(workers.get(d.worker).unwrap().acquire_booked(booking, 0.0));
    }
    let loads: Vec<usize> = workers.iter().iter().map(|w| w.load()).collect();
    let max = *loads.iter().max().unwrap();
    assert!(max <= 4, "max {max} over a mean of 3");
    assert_eq!(loads.iter().sum::<usize>(), 3 * n);
}

/// A model only 3 of [`LARGE`] workers serve: the candidate draw finds too few of them, and
/// the decision falls back to the whole fleet, so it still reaches one of the 3.
#[test]
fn a_large_fleet_falls_back_to_the_whole_when_few_candidates_serve() {
    let (r, workers, mut rng) = large_fleet(PolicyKind::PredictedTtft, 9);
    let serving = [10, LARGE / 2, LARGE - 24];
    for w in workers.iter() {
        let serves = if serving.contains(&w.id) {
            "m"
        } else {
            "other"
        };
        w.set_models(vec![serves.into()]);
    }
    for i in 0..50u64 {
        let key = text_key(&format!("prompt {i}"));
        let (view, d) = r
            .decide_on(&workers, &[], i, 0, &r.request(&key), &mut rng)
            .unwrap();
        assert!(serving.contains(&d.worker), "{}", d.worker);
        assert_eq!(view.eligible, serving);
    }
    let (_, d) = r
        .decide_on(
            &workers,
            &serving[..2],
            0,
            0,
            &r.request(&text_key("x")),
            &mut rng,
        )
        .unwrap();
    assert_eq!(d.worker, serving[2]);
    assert!(
        r.decide_on(
            &workers,
            &serving,
            0,
            0,
            &r.request(&text_key("x")),
            &mut rng
        )
        .is_none()
    );
}

proptest! {
    /// Over random fleets of 300–700 workers with random drained workers and vetoes, every
    /// policy's decision on the registry is eligible and not vetoed, and for the policies
    /// that must see every worker (and the presets) the view is the whole fleet.
    #[test]
    fn decide_on_never_picks_an_ineligible_worker(
        n in 300usize..700,
        drained in prop::collection::vec(0usize..700, 0..200),
        vetoed in prop::collection::vec(0usize..700, 0..20),
        kind_i in 0usize..13,
        seed in any::<u64>(),
    ) {
        let kind = PolicyKind::ALL[kind_i % PolicyKind::ALL.len()];
        let r = router(kind);
        let workers = fleet_of(n);
        for &d in &drained {
            if d < n {
                workers.drain(d);
            }
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for i in 0..4u64 {
            let key = text_key(&format!("prompt {} {}", seed % 7, i));
            let Some((view, d)) = r.decide_on(&workers, &vetoed, i, 0, &r.request(&key), &mut rng) else {
                prop_assert!(false, "some worker is eligible");
                unreachable!()
            };
            let w = workers.get(d.worker).unwrap();
            prop_assert!(!drained.contains(&d.worker) && !vetoed.contains(&d.worker), "{} chose {}", kind, d.worker);
            prop_assert!(w.is_available(0));
            let whole = matches!(kind, PolicyKind::RoundRobin | PolicyKind::Random | PolicyKind::PrefixHash | PolicyKind::ConsistentHash | PolicyKind::SmgCacheAware | PolicyKind::DynamoKv);
            prop_assert_eq!(view.ids.is_empty(), whole, "{}", kind);
            r.record(&key, &d, 0);
        }
    }
}

/// B28: the DP rank a request is pinned to. Worker 0 has two ranks: rank 0 holds a 2-block
/// system prompt, rank 1 that prompt and a conversation's 8 more blocks; worker 1 one rank.
/// The conversation's next turn (176 tokens) goes to rank 1 (160 vs 32 tokens: a gap of 128
/// over 0.3 × 176 = 52.8); not when live requests on worker 0 hold 7 of its blocks (112
/// tokens: the gap to them, 48, is under the threshold, a prefix in concurrent use), nor
/// while rank 1 waits for a replay (hidden), nor with a threshold of 0.8 (128 ≤ 140.8). A
/// new conversation after the system prompt pins nothing (both ranks hold its 32 tokens),
/// nor does any request to worker 1, which has no other rank.
#[test]
fn dp_rank_pins_a_conversation_to_the_rank_holding_it() {
    use crate::events::{EventIndex, StreamId};
    let mut ev = EventIndex::new(16);
    let mut store = |worker: u32, rank: u32, parent: Option<u64>, first: u64, tokens: &[u32]| {
        let batch = stored_batch(parent, first, tokens, Some(rank));
        ev.apply_batch(StreamId { worker, rank }, &batch);
    };
    let system: Vec<u32> = (0..32).collect();
    let history: Vec<u32> = (1_000..1_128).collect();
    store(0, 0, None, 1, &system);
    store(0, 1, None, 1, &system);
    store(0, 1, Some(2), 3, &history);
    store(1, 0, None, 1, &system);
    let mut r = router(PolicyKind::PredictedTtft);
    r.set_event_index(ev.reader());
    let workers = WorkerLoad::of_requests(&[0, 0, 0]);
    let eligible = [0, 1, 2];
    let quiet = snap_of(&workers, &eligible);
    let turn: Vec<u32> = system
        .iter()
        .chain(&history)
        .copied()
        .chain(5_000..5_016)
        .collect();
    let key = ids_key(turn);
    let req = r.request(&key);
    assert_eq!(r.dp_rank(&quiet, &req, 0), Some(1));
    assert_eq!(r.dp_rank(&quiet, &req, 1), None, "one rank");
    assert_eq!(r.dp_rank(&quiet, &req, 2), None, "no streams");
    let live = SharedOn(0, 7);
    let busy = Snapshot {
        live: Some(&live),
        ..snap_of(&workers, &eligible)
    };
    assert_eq!(
        r.dp_rank(&busy, &req, 0),
        None,
        "a prefix in concurrent use"
    );
    let fresh = ids_key(system.iter().copied().chain(7_000..7_144).collect());
    assert_eq!(r.dp_rank(&quiet, &r.request(&fresh), 0), None, "a tie");
    // Text requests have no block keys: never pinned.
    let text = text_key("a conversation in plain text");
    assert_eq!(r.dp_rank(&quiet, &r.request(&text), 0), None);
    let mut strict = Router::new(&Config {
        policy: PolicyKind::PredictedTtft,
        cache_threshold: 0.8,
        ..Config::default()
    });
    strict.set_event_index(ev.reader());
    assert_eq!(
        strict.dp_rank(&quiet, &strict.request(&key), 0),
        None,
        "under 0.8"
    );
    ev.set_hidden(StreamId { worker: 0, rank: 1 }, true);
    assert_eq!(r.dp_rank(&quiet, &req, 0), None, "rank 1 hidden");
}
