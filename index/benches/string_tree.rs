//! `match_prefix` on a [`StringTree`] holding ~1,000 conversations, against the brute-force
//! [`ReferenceStringIndex`] holding the same texts, in the same process.
//!
//! Shape (after the SMG measurement in anchors §2.9): 6 shared 1,000-char system prompts,
//! 1,000 conversations of `N` chars each (system prompt + unique turns, lowercase words plus
//! some multibyte chars), 100 tenants. A query is a stored conversation plus a new user turn,
//! so the walk covers almost the whole prompt (the realistic multi-turn hit). Benchmark names
//! carry the shape: `match_prefix/4k_chars/1000_conversations/{string_tree,reference}`.
//! After each size, the mean ns/query of both and their ratio are printed.
//!
//! Run: `cargo bench -p kvroute-index --bench string_tree`.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvroute_index::StringTree;
use kvroute_index::reference::{ReferenceStringIndex, conversation_corpus};
use std::hint::black_box;
use std::time::Instant;

const CONVERSATIONS: usize = 1_000;
const TENANTS: u32 = 100;
const SYSTEM_PROMPTS: usize = 6;
const SYSTEM_CHARS: usize = 1_000;
struct Fixture {
    tree: StringTree,
    reference: ReferenceStringIndex,
    queries: Vec<String>,
}

fn fixture(prompt_chars: usize) -> Fixture {
    let mut tree = StringTree::new();
    let mut reference = ReferenceStringIndex::new();
    let mut queries = Vec::new();
    let corpus = conversation_corpus(
        42,
        CONVERSATIONS,
        prompt_chars,
        SYSTEM_PROMPTS,
        SYSTEM_CHARS,
        TENANTS,
    );
    for (c, (conv, tenant)) in corpus.into_iter().enumerate() {
        tree.insert(0, &conv, tenant);
        reference.insert(&conv, tenant);
        if c % 16 == 0 {
            queries.push(format!("{conv}<|user|>and one more question?"));
        }
    }
    Fixture {
        tree,
        reference,
        queries,
    }
}

/// Mean ns per call of `f` over the queries, repeated until at least `min_calls` calls.
fn mean_ns(queries: &[String], min_calls: usize, mut f: impl FnMut(&str) -> usize) -> f64 {
    let mut calls = 0usize;
    let mut sink = 0usize;
    let start = Instant::now();
    while calls < min_calls {
        for q in queries {
            sink = sink.wrapping_add(f(q));
            calls += 1;
        }
    }
    black_box(sink);
    start.elapsed().as_nanos() as f64 / calls as f64
}

fn bench_match_prefix(c: &mut Criterion) {
    for (label, chars) in [("4k", 4_096), ("16k", 16_384), ("64k", 65_536)] {
        let fx = fixture(chars);
        // Both must agree on every query before their speeds are compared.
        for q in &fx.queries {
            let got = fx.tree.match_prefix(0, q);
            let want = fx.reference.match_prefix(q);
            assert_eq!(got.matched_chars, want.matched_chars, "query disagrees");
            assert!(got.tenants.iter().all(|t| want.tenants.contains(t)));
        }
        let mut group = c.benchmark_group(format!("match_prefix/{label}_chars"));
        let mut i = 0usize;
        group.bench_function(
            BenchmarkId::new(format!("{CONVERSATIONS}_conversations"), "string_tree"),
            |b| {
                b.iter(|| {
                    i = (i + 1) % fx.queries.len();
                    black_box(fx.tree.match_prefix(0, black_box(&fx.queries[i])))
                })
            },
        );
        group.sample_size(10);
        group.bench_function(
            BenchmarkId::new(format!("{CONVERSATIONS}_conversations"), "reference"),
            |b| {
                b.iter(|| {
                    i = (i + 1) % fx.queries.len();
                    black_box(fx.reference.match_prefix(black_box(&fx.queries[i])))
                })
            },
        );
        group.finish();
        let tree_ns = mean_ns(&fx.queries, 20_000, |q| {
            fx.tree.match_prefix(0, q).matched_chars
        });
        let ref_ns = mean_ns(&fx.queries, 64, |q| {
            fx.reference.match_prefix(q).matched_chars
        });
        println!(
            "match_prefix/{label}_chars/{CONVERSATIONS}_conversations: string_tree {tree_ns:.0} ns, \
             reference {ref_ns:.0} ns, ratio reference/string_tree = {:.0}x, nodes {}, total_chars {}",
            ref_ns / tree_ns,
            fx.tree.node_count(),
            fx.tree.total_chars(),
        );
    }
}

criterion_group!(benches, bench_match_prefix);
criterion_main!(benches);
