//! Engine-level tests: spec worked examples, `engine-model.md` §9 self-checks 3–6, and
//! proptests against brute-force references.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::blocks::{BlockEvent, BlockHash, BlockManager, extend_block_hashes};
use super::timing::{decode_ms, prefill_ms};
use super::tokens::{output_token, splitmix64};
use super::{EngineCore, FinishReason, StepOutput};
use crate::engine::EngineConfig;

const BS: usize = 16;

fn cfg(num_gpu_blocks: usize) -> EngineConfig {
    EngineConfig {
        num_gpu_blocks,
        speedup_ratio: 0.0,
        ..EngineConfig::default()
    }
}

/// Virtual-clock loop: steps until idle (bounded), checking invariants after every step.
fn run_to_idle(e: &mut EngineCore, now_ms: &mut f64, steps: &mut Vec<StepOutput>) {
    for _ in 0..100_000 {
        if e.is_idle() {
            return;
        }
        let out = e.step(*now_ms);
        *now_ms += out.duration_ms;
        e.check_invariants().unwrap();
        steps.push(out);
    }
    panic!("engine did not drain within 100,000 steps");
}

/// Runs one request alone to completion; returns its cached_tokens and token ids.
fn run_one(e: &mut EngineCore, id: u64, prompt: Vec<u32>, max_tokens: u32) -> (u32, Vec<u32>) {
    e.add_request(id, prompt, max_tokens).unwrap();
    let mut steps = Vec::new();
    run_to_idle(e, &mut 0.0, &mut steps);
    let mut cached = None;
    let mut toks = Vec::new();
    for (rid, t) in steps.iter().flat_map(|s| &s.outputs) {
        assert_eq!(*rid, id);
        if let Some(p) = t.prompt {
            cached = Some(p.cached_tokens);
        }
        toks.push(t.token_id);
    }
    (cached.expect("first token carries usage"), toks)
}

#[test]
fn cached_tokens_worked_examples_with_l_minus_1_cap() {
    let mut e = EngineCore::new(&cfg(1_000)).unwrap();
    let a: Vec<u32> = (0..64).collect();
    assert_eq!(run_one(&mut e, 1, a.clone(), 1).0, 0);
    // Same 64 tokens: 4 blocks cached but the cap is ⌊63/16⌋ = 3 blocks → 48.
    assert_eq!(run_one(&mut e, 2, a.clone(), 1).0, 48);
    // One more token: cap ⌊64/16⌋ = 4 → 64.
    let mut c = a.clone();
    c.push(999);
    assert_eq!(run_one(&mut e, 3, c, 1).0, 64);
    // 40-token prefix: 2 full blocks of 16 → 32.
    assert_eq!(run_one(&mut e, 4, a[..40].to_vec(), 1).0, 32);
    // 17 tokens: cap ⌊16/16⌋ = 1 → 16.
    assert_eq!(run_one(&mut e, 5, a[..17].to_vec(), 1).0, 16);
    // Diverging in block 2: only blocks 0–1 hit.
    let mut d = a.clone();
    d[40] = 7;
    assert_eq!(run_one(&mut e, 6, d, 1).0, 32);
    let s = e.stats();
    assert_eq!(s.prefix_hits_tokens, 48 + 64 + 32 + 16 + 32);
    assert_eq!(s.prefix_queries_tokens, 64 + 64 + 65 + 40 + 17 + 64);
    assert_eq!(s.prompt_tokens, s.prefix_queries_tokens);
    assert_eq!(s.generation_tokens, 6);
}

#[test]
fn output_is_max_tokens_seeded_tokens_finishing_with_length() {
    let mut e = EngineCore::new(&cfg(1_000)).unwrap();
    let (_, toks) = run_one(&mut e, 42, vec![5; 30], 7);
    let want: Vec<u32> = (0..7).map(|i| output_token(0, 42, i)).collect();
    assert_eq!(toks, want);
    e.add_request(43, vec![5; 30], 3).unwrap();
    let mut steps = Vec::new();
    run_to_idle(&mut e, &mut 0.0, &mut steps);
    let outs: Vec<_> = steps.iter().flat_map(|s| &s.outputs).collect();
    assert_eq!(outs.len(), 3);
    assert_eq!(
        outs.iter().map(|(_, t)| t.index).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    assert_eq!(outs[2].1.finish, Some(FinishReason::Length));
    assert!(outs[..2].iter().all(|(_, t)| t.finish.is_none()));
    assert_eq!(outs[0].1.prompt.unwrap().prompt_tokens, 30);
    assert!(outs[1].1.prompt.is_none());
}

#[test]
fn add_request_rejects_bad_input() {
    use super::EngineError::*;
    let mut e = EngineCore::new(&EngineConfig {
        max_model_len: 100,
        num_gpu_blocks: 4,
        ..cfg(4)
    })
    .unwrap();
    assert_eq!(e.add_request(1, vec![], 1), Err(EmptyPrompt));
    assert_eq!(
        e.add_request(1, vec![0; 101], 1),
        Err(PromptTooLong {
            prompt_tokens: 101,
            max_model_len: 100
        })
    );
    assert_eq!(e.add_request(1, vec![0; 10], 0), Err(ZeroMaxTokens));
    // 60 + 10 − 1 = 69 tokens → 5 blocks > 4.
    assert_eq!(
        e.add_request(1, vec![0; 60], 10),
        Err(ExceedsKvCapacity {
            blocks_needed: 5,
            num_gpu_blocks: 4
        })
    );
    e.add_request(1, vec![0; 10], 1).unwrap();
    assert_eq!(
        e.add_request(1, vec![0; 10], 1),
        Err(DuplicateRequest { req_id: 1 })
    );
    assert!(matches!(
        EngineCore::new(&EngineConfig {
            watermark: 1.0,
            ..cfg(4)
        }),
        Err(InvalidConfig { field: "watermark" })
    ));
}

#[test]
fn chunked_prefill_and_step_times_follow_section_4() {
    let mut e = EngineCore::new(&EngineConfig {
        speedup_ratio: 1.0,
        ..cfg(2_000)
    })
    .unwrap();
    e.add_request(1, (0..10_000).collect(), 2).unwrap();
    let s1 = e.step(0.0);
    assert_eq!(s1.prefill_tokens, 8_192);
    assert!(s1.outputs.is_empty());
    assert!((s1.duration_ms - prefill_ms(8_192)).abs() < 1e-9);
    assert!((s1.duration_ms - 169.14).abs() < 0.005);
    let s2 = e.step(s1.duration_ms);
    assert_eq!(s2.prefill_tokens, 10_000 - 8_192);
    assert_eq!(s2.outputs.len(), 1);
    assert_eq!(s2.start_ms, s1.duration_ms);
    // Decode step: 1 token, u = used blocks / capacity = ⌈10,001/16⌉ / 2,000.
    let s3 = e.step(0.0);
    assert_eq!((s3.prefill_tokens, s3.decode_requests), (0, 1));
    let u = 10_001usize.div_ceil(16) as f64 / 2_000.0;
    assert!((s3.duration_ms - decode_ms(u)).abs() < 1e-9);
    assert_eq!(s3.outputs[0].1.finish, Some(FinishReason::Length));
    assert!(e.is_idle());
    e.check_invariants().unwrap();
}

#[test]
fn running_cap_and_watermark_hold_requests_in_waiting() {
    let mut e = EngineCore::new(&EngineConfig {
        max_num_seqs: 2,
        ..cfg(1_000)
    })
    .unwrap();
    for id in 0..3 {
        e.add_request(id, vec![id as u32; 20], 5).unwrap();
    }
    e.step(0.0);
    assert_eq!((e.stats().running, e.stats().waiting), (2, 1));
    e.check_invariants().unwrap();

    // Watermark 0.1 of 100 blocks = 10 blocks must stay free: a 91-block prompt waits.
    let mut e = EngineCore::new(&EngineConfig {
        watermark: 0.1,
        max_num_batched_tokens: 100_000,
        ..cfg(100)
    })
    .unwrap();
    e.add_request(1, vec![1; 91 * 16], 1).unwrap();
    let out = e.step(0.0);
    assert!(out.outputs.is_empty());
    assert_eq!((e.stats().running, e.stats().waiting), (0, 1));
    e.check_invariants().unwrap();
}

#[test]
fn lifo_preemption_recomputes_and_keeps_outputs() {
    // 4 blocks; two requests of 16 prompt tokens and 40 outputs (55 KV tokens = 4 blocks
    // each) cannot both finish: the newest (2) is preempted when blocks run out.
    let mut e = EngineCore::new(&EngineConfig {
        watermark: 0.0,
        ..cfg(4)
    })
    .unwrap();
    e.add_request(1, (0..16).collect(), 40).unwrap();
    e.add_request(2, (100..116).collect(), 40).unwrap();
    let mut steps = Vec::new();
    let mut first_preempt = None;
    for i in 0..10_000 {
        if e.is_idle() {
            break;
        }
        steps.push(e.step(0.0));
        e.check_invariants().unwrap();
        if first_preempt.is_none() && e.stats().preemptions > 0 {
            first_preempt = Some(i);
            assert_eq!((e.stats().running, e.stats().waiting), (1, 1));
        }
    }
    assert!(e.is_idle());
    assert!(e.stats().preemptions >= 1);
    for id in [1u64, 2] {
        let toks: Vec<u32> = steps
            .iter()
            .flat_map(|s| &s.outputs)
            .filter(|(r, _)| *r == id)
            .map(|(_, t)| t.token_id)
            .collect();
        let want: Vec<u32> = (0..40).map(|i| output_token(0, id, i)).collect();
        assert_eq!(toks, want, "request {id}");
    }
    // Request 1 (oldest) finished before request 2 produced its last token.
    let last = |id| {
        steps
            .iter()
            .position(|s| {
                s.outputs
                    .iter()
                    .any(|(r, t)| *r == id && t.finish.is_some())
            })
            .unwrap()
    };
    assert!(last(1) < last(2));
    // Preemption counts a second prefix query for request 2 (the recompute).
    let s = e.stats();
    assert!(s.prefix_queries_tokens > 32);
    assert_eq!(s.prompt_tokens, 32);
    assert_eq!(s.generation_tokens, 80);
}

#[test]
fn abort_releases_blocks_and_reset_clears_cache() {
    let mut e = EngineCore::new(&cfg(100)).unwrap();
    e.add_request(1, (0..100).collect(), 50).unwrap();
    e.add_request(2, (0..10).collect(), 50).unwrap();
    e.step(0.0);
    assert!(e.stats().kv_usage > 0.0);
    assert_eq!(
        e.reset_prefix_cache(),
        Err(super::EngineError::ResetWhileBusy { used_blocks: 8 })
    );
    assert!(e.abort(1));
    assert!(e.abort(2));
    assert!(!e.abort(2));
    e.check_invariants().unwrap();
    let s = e.stats();
    assert_eq!((s.running, s.kv_usage, s.cached_blocks), (0, 0.0, 6));
    assert!(e.is_idle());
    assert_eq!(e.reset_prefix_cache(), Ok(6));
    let out = e.step(0.0);
    assert_eq!(out.events, vec![BlockEvent::AllCleared]);
    assert_eq!(out.duration_ms, 0.0);
    assert_eq!(e.stats().cached_blocks, 0);
}

#[test]
fn stored_events_chain_per_request_per_step() {
    let mut e = EngineCore::new(&cfg(100)).unwrap();
    let prompt: Vec<u32> = (0..40).collect();
    e.add_request(1, prompt.clone(), 10).unwrap();
    let s = e.step(0.0);
    let mut hashes = Vec::new();
    extend_block_hashes(&mut hashes, &prompt, BS);
    assert_eq!(
        s.events,
        vec![BlockEvent::Stored {
            parent: None,
            hashes: hashes.clone(),
            token_ids: prompt[..32].to_vec(),
        }]
    );
    // The third block fills after 8 more KV tokens: prompt 32..40 + 8 outputs. KV of output i
    // is computed in decode step i+1, so block 2 is stored in the 8th decode step.
    let mut stored = Vec::new();
    for _ in 0..9 {
        stored.extend(e.step(0.0).events);
    }
    let mut all = prompt.clone();
    all.extend((0..8).map(|i| output_token(0, 1, i)));
    let mut h3 = hashes.clone();
    extend_block_hashes(&mut h3, &all, BS);
    assert_eq!(
        stored,
        vec![BlockEvent::Stored {
            parent: Some(hashes[1]),
            hashes: vec![h3[2]],
            token_ids: all[32..48].to_vec(),
        }]
    );
}

// ---- synthetic trace and the infinite-cache bound (traces.md §5, engine-model.md §9.3) ----

/// A request of a synthetic trace: `ids` is a root-to-node path in a random tree (so ids are
/// prefix-consistent, like Mooncake hash ids), each id standing for `ID_TOKENS` tokens, then a
/// private tail of `tail` tokens.
#[derive(Debug, Clone)]
struct TraceReq {
    ids: Vec<u64>,
    tail: usize,
    max_tokens: u32,
}

const ID_TOKENS: usize = 32;

fn trace(seed: u64, nodes: usize, requests: usize) -> Vec<TraceReq> {
    let mut s = seed;
    let mut parent = vec![None; nodes];
    for (i, p) in parent.iter_mut().enumerate().skip(1) {
        let r = splitmix64(&mut s) as usize % (i + 1);
        *p = (r < i).then_some(r); // r == i → new root
    }
    (0..requests)
        .map(|_| {
            let mut n = Some(splitmix64(&mut s) as usize % nodes);
            let mut ids = Vec::new();
            while let Some(x) = n {
                ids.push(x as u64);
                n = parent[x];
            }
            ids.reverse();
            TraceReq {
                ids,
                tail: splitmix64(&mut s) as usize % 40,
                max_tokens: 1 + (splitmix64(&mut s) % 4) as u32,
            }
        })
        .collect()
}

fn prompt_of(r: &TraceReq, index: usize) -> Vec<u32> {
    let mut p = Vec::new();
    for id in &r.ids {
        let mut s = *id;
        p.extend((0..ID_TOKENS).map(|_| (splitmix64(&mut s) % 100_000) as u32));
    }
    // Private tail: ids ≥ 200,000 unique to this request.
    p.extend((0..r.tail).map(|j| 200_000 + (index * 64 + j) as u32));
    p
}

/// traces.md §5 engine-level variant, written from the spec: per request, `cached =
/// min(⌊k·B / 16⌋·16, ⌊(L−1)/16⌋·16)` with k the leading ids already seen.
fn brute_force_engine_bound(reqs: &[TraceReq]) -> Vec<usize> {
    let mut seen = HashSet::new();
    reqs.iter()
        .enumerate()
        .map(|(i, r)| {
            let l = prompt_of(r, i).len();
            let k = r.ids.iter().take_while(|id| seen.contains(*id)).count();
            seen.extend(r.ids.iter().copied());
            let matched = (k * ID_TOKENS).min(l);
            (matched / BS * BS).min(l.saturating_sub(1) / BS * BS)
        })
        .collect()
}

/// Replays `reqs` one at a time on one engine with unlimited blocks; returns cached_tokens.
fn replay_unlimited(reqs: &[TraceReq]) -> Vec<usize> {
    let mut e = EngineCore::new(&cfg(1 << 40)).unwrap();
    reqs.iter()
        .enumerate()
        .map(|(i, r)| run_one(&mut e, i as u64, prompt_of(r, i), r.max_tokens).0 as usize)
        .collect()
}

#[test]
fn unlimited_engine_reaches_infinite_cache_bound() {
    let reqs = trace(7, 60, 150);
    let want = brute_force_engine_bound(&reqs);
    let got = replay_unlimited(&reqs);
    assert_eq!(got, want);
    let total: usize = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| prompt_of(r, i).len())
        .sum();
    let hits: usize = got.iter().sum();
    // The trace has real reuse (the bound is far from 0 and from 1).
    let bound = hits as f64 / total as f64;
    assert!(bound > 0.2 && bound < 0.95, "bound {bound}");
}

// ---- pressure: preemptions, evictions one-for-one with Removed events (§9.6) ----

/// Cached-block set rebuilt from the event stream alone; panics on an inconsistent stream.
fn replay_events(steps: &[StepOutput]) -> (HashSet<BlockHash>, u64) {
    let mut set = HashSet::new();
    let mut removed = 0;
    for ev in steps.iter().flat_map(|s| &s.events) {
        match ev {
            BlockEvent::Stored {
                parent,
                hashes,
                token_ids,
            } => {
                assert_eq!(token_ids.len(), hashes.len() * BS);
                if let Some(p) = parent {
                    assert!(set.contains(p), "stored block's parent not cached");
                }
                for h in hashes {
                    assert!(set.insert(*h), "stored twice");
                }
            }
            BlockEvent::Removed { hashes } => {
                for h in hashes {
                    assert!(set.remove(h), "removed an uncached block");
                    removed += 1;
                }
            }
            BlockEvent::AllCleared => set.clear(),
        }
    }
    (set, removed)
}

fn pressure_run(seed: u64, num_gpu_blocks: usize, n: usize) -> (EngineCore, Vec<StepOutput>) {
    let reqs = trace(seed, 30, n);
    let mut e = EngineCore::new(&EngineConfig {
        seed,
        max_num_batched_tokens: 256,
        ..cfg(num_gpu_blocks)
    })
    .unwrap();
    let mut steps = Vec::new();
    let mut now = 0.0;
    // Open loop: a few arrivals per step.
    for (i, r) in reqs.iter().enumerate() {
        e.add_request(i as u64, prompt_of(r, i), r.max_tokens * 8)
            .unwrap();
        if i % 3 == 2 {
            let out = e.step(now);
            now += out.duration_ms;
            e.check_invariants().unwrap();
            steps.push(out);
        }
    }
    run_to_idle(&mut e, &mut now, &mut steps);
    (e, steps)
}

#[test]
fn under_pressure_preemptions_rise_and_removed_events_match_evictions() {
    let (e, steps) = pressure_run(3, 40, 80);
    let s = e.stats();
    assert!(s.preemptions > 0, "no preemption under pressure");
    assert!(s.evicted_blocks > 0, "no eviction under pressure");
    let (set, removed) = replay_events(&steps);
    assert_eq!(removed, s.evicted_blocks);
    assert_eq!(set.len(), s.cached_blocks);
    // Every request produced its output in order.
    let mut count: HashMap<u64, u32> = HashMap::new();
    for (id, t) in steps.iter().flat_map(|s| &s.outputs) {
        let c = count.entry(*id).or_default();
        assert_eq!(t.index, *c);
        assert_eq!(t.token_id, output_token(3, *id, t.index));
        *c += 1;
    }
    assert_eq!(count.len(), 80);
}

#[test]
fn same_seed_and_virtual_clock_give_identical_outputs_and_events() {
    let (_, a) = pressure_run(5, 60, 40);
    let (_, b) = pressure_run(5, 60, 40);
    assert_eq!(a, b);
    let (_, c) = pressure_run(6, 60, 40);
    assert_ne!(a, c);
}

// ---- proptest: BlockManager against a brute-force reference ----

/// Reference block pool with linear scans: active (hash, refcount) in insertion order,
/// inactive as a Vec in LRU order (head = index 0).
#[derive(Default)]
struct RefPool {
    cap: usize,
    active: Vec<(BlockHash, u32)>,
    inactive: Vec<BlockHash>,
    private: usize,
}

impl RefPool {
    fn cached(&self, h: BlockHash) -> bool {
        self.active.iter().any(|(a, _)| *a == h) || self.inactive.contains(&h)
    }
    fn lookup(&self, hashes: &[BlockHash], l: usize) -> usize {
        let mut k = 0;
        while k < hashes.len() && k < (l - 1) / BS && self.cached(hashes[k]) {
            k += 1;
        }
        k
    }
    fn acquire(&mut self, h: BlockHash) -> bool {
        if let Some(e) = self.active.iter_mut().find(|(a, _)| *a == h) {
            e.1 += 1;
            return true;
        }
        if let Some(i) = self.inactive.iter().position(|x| *x == h) {
            self.inactive.remove(i);
            self.active.push((h, 1));
            return true;
        }
        false
    }
    fn allocate(&mut self, n: usize) -> Option<Vec<BlockHash>> {
        let used = self.active.len() + self.private;
        if n > self.cap - used {
            return None;
        }
        let free = self.cap - used - self.inactive.len();
        let evict = n.saturating_sub(free);
        self.private += n;
        Some(self.inactive.drain(..evict).collect())
    }
    fn release(&mut self, full: &[BlockHash]) {
        for h in full.iter().rev() {
            let i = self.active.iter().position(|(a, _)| a == h).unwrap();
            self.active[i].1 -= 1;
            if self.active[i].1 == 0 {
                self.active.remove(i);
                self.inactive.push(*h);
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Admit a request over chain `chain` (prefix of a fixed chain set) of `len` tokens.
    Admit { chain: usize, len: usize },
    /// Release held request number `i` (modulo held count).
    Release { i: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..4, 1usize..120).prop_map(|(chain, len)| Op::Admit { chain, len }),
        2 => (0usize..8).prop_map(|i| Op::Release { i }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn block_manager_matches_brute_force(cap in 1usize..16, ops in prop::collection::vec(op(), 1..60)) {
        // Four token chains sharing prefixes pairwise (0/1 share 3 blocks, 2/3 share 1).
        let chains: Vec<Vec<u32>> = (0..4u32).map(|c| {
            (0..128u32).map(|t| {
                let shared = if c < 2 { 48 } else { 16 };
                if t < shared { t + 1000 * (c / 2) } else { t + 10_000 * (c + 1) }
            }).collect()
        }).collect();
        let mut bm = BlockManager::new(BS, cap);
        let mut rf = RefPool { cap, ..RefPool::default() };
        let mut held: Vec<Vec<BlockHash>> = Vec::new();
        for op in ops {
            match op {
                Op::Admit { chain, len } => {
                    let tokens = &chains[chain][..len];
                    let mut hashes = Vec::new();
                    extend_block_hashes(&mut hashes, tokens, BS);
                    let hit = bm.lookup_prefix(&hashes, len);
                    prop_assert_eq!(hit, rf.lookup(&hashes, len));
                    let new = len.div_ceil(BS) - hit;
                    let inactive_hits = bm.count_inactive(&hashes[..hit]);
                    if bm.num_available() < inactive_hits + new {
                        continue;
                    }
                    bm.take_cached(&hashes[..hit]);
                    for h in &hashes[..hit] { prop_assert!(rf.acquire(*h)); }
                    let mut ev = Vec::new();
                    bm.allocate_private(new, &mut ev).unwrap();
                    let evicted = rf.allocate(new).unwrap();
                    let got: Vec<BlockHash> = ev.iter().flat_map(|e| match e {
                        BlockEvent::Removed { hashes } => hashes.clone(),
                        _ => vec![],
                    }).collect();
                    prop_assert_eq!(got, evicted);
                    for h in &hashes[hit..] {
                        let stored = bm.fill_private(*h);
                        rf.private -= 1;
                        prop_assert_eq!(stored, !rf.acquire(*h));
                        if stored { rf.active.push((*h, 1)); }
                    }
                    // The partial tail stays private until release.
                    let tail = usize::from(len % BS != 0);
                    bm.release(&[], tail);
                    rf.private -= tail;
                    held.push(hashes);
                }
                Op::Release { i } => {
                    if held.is_empty() { continue; }
                    let h = held.remove(i % held.len());
                    bm.release(&h, 0);
                    rf.release(&h);
                }
            }
            bm.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(bm.inactive_lru(), rf.inactive.clone());
            prop_assert_eq!(bm.num_used(), rf.active.len() + rf.private);
            for (h, rc) in &rf.active { prop_assert_eq!(bm.refcount(*h), *rc); }
        }
    }

    #[test]
    fn unlimited_engine_matches_bound_on_random_traces(seed in any::<u64>(), nodes in 1usize..30, n in 1usize..25) {
        let reqs = trace(seed, nodes, n);
        prop_assert_eq!(replay_unlimited(&reqs), brute_force_engine_bound(&reqs));
    }

    #[test]
    fn random_pressure_keeps_invariants_and_event_consistency(seed in any::<u64>(), blocks in 24usize..80, n in 1usize..30) {
        // pressure_run checks invariants after every step and panics on a stuck engine.
        let (e, steps) = pressure_run(seed, blocks, n);
        let (set, removed) = replay_events(&steps);
        prop_assert_eq!(removed, e.stats().evicted_blocks);
        prop_assert_eq!(set.len(), e.stats().cached_blocks);
        let finished = steps.iter().flat_map(|s| &s.outputs).filter(|(_, t)| t.finish.is_some()).count();
        prop_assert_eq!(finished, n);
    }
}
