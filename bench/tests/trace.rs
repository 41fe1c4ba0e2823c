//! Trace loading, the infinite-cache bound, id→text synthesis and the built-in workload,
//! checked against the figures and test vectors of `shared/reference/traces.md`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use kvroute_bench::trace::{
    ENGINE_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS, MOONCAKE_NAMESPACE, PromptBuilder, SplitMix64,
    TraceRecord, WordIds, block_count_ok, engine_cache_bound, infinite_cache_bound, load_mooncake,
};
use kvroute_bench::workload::{
    DEFAULT_MAX_INPUT_TOKENS, WorkloadParams, builtin_conversations, builtin_workload,
};
use kvroute_tokenize::Tokenizer;

const MOONCAKE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/data/traces/mooncake/conversation_trace.jsonl"
);

/// The Mooncake trace, or `None` (with a printed notice) when `../shared/data` is absent.
fn mooncake() -> Option<&'static [TraceRecord]> {
    static TRACE: OnceLock<Option<Vec<TraceRecord>>> = OnceLock::new();
    TRACE
        .get_or_init(|| {
            if !Path::new(MOONCAKE).exists() {
                eprintln!("skipping: Mooncake trace not found at {MOONCAKE}");
                return None;
            }
            Some(load_mooncake(MOONCAKE, None).expect("Mooncake trace loads"))
        })
        .as_deref()
}

fn qwen3() -> &'static (Tokenizer, WordIds) {
    static TOK: OnceLock<(Tokenizer, WordIds)> = OnceLock::new();
    TOK.get_or_init(|| {
        let tok = Tokenizer::qwen3().expect("embedded Qwen3 tokenizer");
        let words = WordIds::from_tokenizer(&tok).expect("Qwen3 has word tokens");
        (tok, words)
    })
}

#[test]
fn mooncake_file_facts_and_bound() {
    let Some(rs) = mooncake() else { return };
    assert_eq!(rs.len(), 12_031);
    assert_eq!(rs.first().unwrap().timestamp_ms, 0);
    assert_eq!(rs.last().unwrap().timestamp_ms, 3_536_999);
    assert!(rs.iter().all(|r| r.hash_ids[0] == 0));
    let b = infinite_cache_bound(rs, MOONCAKE_BLOCK_TOKENS);
    println!("Mooncake full: {b:?}");
    assert_eq!((b.hit_blocks, b.total_blocks), (105_710, 288_500));
    assert!((b.block_weighted * 100.0 - 36.6).abs() < 0.1, "{b:?}");
    assert!((b.token_weighted * 100.0 - 37.4).abs() < 0.1, "{b:?}");
    let e = engine_cache_bound(rs, MOONCAKE_BLOCK_TOKENS, ENGINE_BLOCK_TOKENS);
    println!("Mooncake full engine-level (16, L-1 cap): {e:.4}");
    assert!((e * 100.0 - 37.4).abs() < 0.1, "{e}");

    let head = load_mooncake(MOONCAKE, Some(600)).unwrap();
    assert_eq!(head, rs[..600]);
    let b600 = infinite_cache_bound(&head, MOONCAKE_BLOCK_TOKENS);
    println!("Mooncake first 600: {b600:?}");
    assert_eq!((b600.hit_blocks, b600.total_blocks), (2_783, 16_495));
    assert_eq!((b600.hit_tokens, b600.total_tokens), (1_423_195, 8_293_542));
}

#[test]
fn splitmix_block_vectors() {
    let (_, words) = qwen3();
    let cases: [((u32, u64), [u32; 8]); 3] = [
        (
            (0, 0),
            [73221, 26183, 35652, 29287, 42880, 60534, 60981, 37868],
        ),
        (
            (0, 1),
            [52282, 2518, 20763, 85425, 54425, 5999, 97666, 91221],
        ),
        (
            (1, 1),
            [27402, 43730, 31431, 89745, 30854, 88631, 47106, 31127],
        ),
    ];
    for ((ns, id), want) in cases {
        assert_eq!(words.block_tokens(ns, id, 8), want, "block ({ns}, {id})");
    }
    assert_eq!(
        words.block_text(1, 1, 8),
        " sticky finder vic quieter tendency adultos compuls purely"
    );
    // A shorter block is a prefix of the longer one.
    assert_eq!(
        words.block_tokens(0, 5, 512)[..100],
        words.block_tokens(0, 5, 100)[..]
    );
    // The generator is the reference SplitMix64 (state = (ns << 32) | id).
    assert_eq!(
        SplitMix64::new(1, 1).next_u64(),
        SplitMix64::from_state((1 << 32) | 1).next_u64()
    );
}

#[test]
fn word_ids_facts() {
    let (_, words) = qwen3();
    let ids = words.ids();
    assert_eq!(ids.len(), 18_584);
    assert_eq!(ids[..5], [279, 323, 369, 390, 419]);
    assert_eq!(ids[ids.len() - 3..], [143_854, 143_855, 143_934]);
}

#[test]
fn synthesized_text_retokenizes_to_its_ids() {
    let (tok, words) = qwen3();
    for (ns, id) in [(0u32, 0u64), (0, 1), (1, 1), (24, 7), (1 << 31, 3)] {
        let ids = words.block_tokens(ns, id, 512);
        let text = words.block_text(ns, id, 512);
        assert_eq!(tok.encode(&text), ids, "block ({ns}, {id})");
        assert_eq!(tok.decode(&ids), text);
    }
}

#[test]
fn prompts_retokenize_and_fit_the_chat_template() {
    let (tok, words) = qwen3();
    let pb = PromptBuilder::from_tokenizer(tok, MOONCAKE_NAMESPACE).unwrap();
    assert_eq!(pb.words().ids(), words.ids());
    let records = builtin_workload(&WorkloadParams::default());
    for r in records.iter().take(3) {
        let text = pb.prompt_text(r);
        let ids = pb.prompt_tokens(r);
        assert_eq!(ids.len(), r.input_length as usize);
        assert_eq!(tok.encode(&text), ids);
        // traces.md §3: the Qwen3 template adds 3 tokens before and 5 after.
        let chat = serde_json::json!([{"role": "user", "content": text}]);
        let rendered = tok.render_chat(&chat, true).unwrap();
        let mut want = vec![151_644, 872, 198];
        want.extend(&ids);
        want.extend([151_645, 198, 151_644, 77_091, 198]);
        assert_eq!(tok.encode(&rendered), want);
    }
    // Requests sharing leading ids share the text prefix.
    let (a, b) = (&records[0], &records[1]);
    let shared = a
        .hash_ids
        .iter()
        .zip(&b.hash_ids)
        .take_while(|(x, y)| x == y)
        .count()
        .min(a.hash_ids.len() - 1)
        .min(b.hash_ids.len() - 1);
    assert!(shared >= 1);
    assert_eq!(
        pb.prompt_tokens(a)[..shared * 512],
        pb.prompt_tokens(b)[..shared * 512]
    );
    if let Some(rs) = mooncake() {
        let r = &rs[0];
        assert_eq!(tok.encode(&pb.prompt_text(r)), pb.prompt_tokens(r));
    }
}

#[test]
fn builtin_workload_is_deterministic() {
    let p = WorkloadParams::default();
    assert_eq!(builtin_workload(&p), builtin_workload(&p));
    let other = builtin_workload(&WorkloadParams {
        seed: p.seed + 1,
        ..p.clone()
    });
    assert_ne!(builtin_workload(&p), other);
}

#[test]
fn builtin_workload_shape() {
    let p = WorkloadParams::default();
    let convs = builtin_conversations(&p);
    let records = builtin_workload(&p);
    let turns: Vec<usize> = convs.iter().map(Vec::len).collect();
    println!(
        "built-in: {} requests, {} conversations, turns {:?}, span {} ms",
        records.len(),
        convs.len(),
        turns,
        records.last().unwrap().timestamp_ms
    );
    assert!((200..=300).contains(&records.len()), "{}", records.len());
    assert!((40..=60).contains(&convs.len()));
    assert_eq!(records.len(), turns.iter().sum::<usize>());
    assert!(turns.iter().all(|&t| (1..=8).contains(&t)));
    assert!(turns.iter().filter(|&&t| t >= 3).count() * 10 >= convs.len() * 9);
    for r in &records {
        assert!(block_count_ok(r, MOONCAKE_BLOCK_TOKENS));
        assert_eq!(
            r.hash_ids[0], 0,
            "every request starts with the shared head"
        );
        assert!((1_000..=DEFAULT_MAX_INPUT_TOKENS).contains(&r.input_length));
        assert!((50..=300).contains(&r.output_length));
    }
    let max_len = records.iter().map(|r| r.input_length).max().unwrap();
    assert!(
        max_len > 10_000,
        "prompts grow to ≥ 10k tokens, max {max_len}"
    );

    // Turn N+1 extends turn N: same full blocks, a new id for the grown partial block.
    for c in &convs {
        for w in c.windows(2) {
            let (prev, next) = (&w[0], &w[1]);
            assert!(next.input_length > prev.input_length);
            assert!(next.timestamp_ms > prev.timestamp_ms);
            let full = (prev.input_length / 512) as usize;
            assert_eq!(next.hash_ids[..full], prev.hash_ids[..full]);
            if prev.hash_ids.len() > full {
                assert_ne!(next.hash_ids[full], prev.hash_ids[full]);
            }
        }
    }

    // Ids are prefix-chained: each id always sits at one position after one predecessor.
    let mut place: HashMap<u64, (usize, Option<u64>)> = HashMap::new();
    for r in &records {
        for (i, &id) in r.hash_ids.iter().enumerate() {
            let at = (i, i.checked_sub(1).map(|j| r.hash_ids[j]));
            assert_eq!(*place.entry(id).or_insert(at), at, "id {id}");
        }
    }

    // A handful of system prompts, each shared by several conversations.
    let mut systems: HashMap<u64, usize> = HashMap::new();
    for c in &convs {
        *systems.entry(c[0].hash_ids[1]).or_default() += 1;
    }
    assert!(
        (2..=p.system_prompts).contains(&systems.len()),
        "{systems:?}"
    );
    assert!(systems.values().filter(|&&n| n >= 3).count() >= 2);

    let b = infinite_cache_bound(&records, MOONCAKE_BLOCK_TOKENS);
    let e = engine_cache_bound(&records, MOONCAKE_BLOCK_TOKENS, ENGINE_BLOCK_TOKENS);
    println!("built-in bound: {b:?}; engine-level {e:.4}");
    assert!(b.block_weighted > 0.5 && b.token_weighted > 0.5, "{b:?}");
}
