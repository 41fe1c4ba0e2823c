//! `match_prefix` on a [`TokenTree`] against a plain per-token trie (one node per token,
//! children in a `BTreeMap<u32, node>`, defined below) holding the same prompts, in the
//! same process.
//!
//! Fixture (the shape of `event_grid_point` in `bench/src/index_bench.rs` and of the
//! `event_index` bench): pages of 16 tokens; 64 conversations of `N` tokens that share one
//! system prompt of min(1,024, N/2) tokens, then diverge (random ids); 256 workers, worker `w`
//! sent conversation `w mod 64`. A query is a stored conversation plus a new 64-token turn
//! (the multi-turn hit), cycling through the 64, so the walk covers the whole conversation
//! and both answer `N` tokens and the conversation's 4 workers (checked before timing).
//!
//! Grid: N ∈ {1k, 8k, 32k} tokens. Benchmark names: `match_prefix/8k_tokens/256_workers/
//! {token_tree,btree_trie}`. After each point, the mean ns per query of both (a plain timed
//! loop, outside criterion) and their ratio are printed, with the tree's node count and
//! `memory_bytes` (bytes) and the trie's node count. Criterion runs 10 samples over ~2 s per
//! benchmark. The trie needs ~150 bytes per token (~300 MB at 32k); it is dropped after its
//! point.
//!
//! Run: `cargo bench -p kvroute-index --bench token_tree`.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvroute_index::reference::{token_conversations, token_stream};
use kvroute_index::{MAX_MATCH_TENANTS, TenantId, TokenTree};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Tokens per page.
const BS: usize = 16;
const CONVERSATIONS: usize = 64;
const WORKERS: usize = 256;

/// Node of [`BTreeTrie`]: children by next token; tenants only at page boundaries.
#[derive(Default)]
struct TrieNode {
    children: BTreeMap<u32, u32>,
    tenants: Vec<TenantId>,
}

/// The baseline: an uncompressed trie with one node per token (arena-allocated, children in
/// a `BTreeMap`), page-granular like [`TokenTree`]: only whole pages are inserted, and a
/// match ends at the last page boundary reached. Tenants in insertion order (no LRU).
struct BTreeTrie {
    nodes: Vec<TrieNode>,
}

impl BTreeTrie {
    fn new() -> Self {
        Self {
            nodes: vec![TrieNode::default()],
        }
    }

    fn insert(&mut self, tokens: &[u32], tenant: TenantId) {
        let mut at = 0usize;
        for (i, &t) in tokens[..tokens.len() / BS * BS].iter().enumerate() {
            let next = self.nodes.len() as u32;
            let child = *self.nodes[at].children.entry(t).or_insert(next);
            if child == next {
                self.nodes.push(TrieNode::default());
            }
            at = child as usize;
            if (i + 1) % BS == 0 && !self.nodes[at].tenants.contains(&tenant) {
                self.nodes[at].tenants.push(tenant);
            }
        }
    }

    /// (matched tokens, up to `MAX_MATCH_TENANTS` tenants of the deepest matched page).
    fn match_prefix(&self, tokens: &[u32]) -> (usize, Vec<TenantId>) {
        let (mut at, mut best) = (0usize, (0usize, 0usize));
        for (i, t) in tokens[..tokens.len() / BS * BS].iter().enumerate() {
            match self.nodes[at].children.get(t) {
                Some(&c) => at = c as usize,
                None => break,
            }
            if (i + 1) % BS == 0 {
                best = (i + 1, at);
            }
        }
        let ts = &self.nodes[best.1].tenants;
        (best.0, ts[..ts.len().min(MAX_MATCH_TENANTS)].to_vec())
    }
}

struct Fixture {
    tree: TokenTree,
    trie: BTreeTrie,
    queries: Vec<Vec<u32>>,
}

fn fixture(tokens: usize) -> Fixture {
    let convs = token_conversations(CONVERSATIONS, tokens);
    let mut tree = TokenTree::new(BS, usize::MAX);
    let mut trie = BTreeTrie::new();
    for w in 0..WORKERS {
        let c = &convs[w % CONVERSATIONS];
        tree.insert(0, c, w as TenantId);
        trie.insert(c, w as TenantId);
    }
    let queries = convs
        .iter()
        .enumerate()
        .map(|(c, v)| {
            let mut q = v.clone();
            q.extend(token_stream(10_000 + c as u64, 64));
            q
        })
        .collect();
    Fixture {
        tree,
        trie,
        queries,
    }
}

/// Mean ns per call of `f` over the queries, repeated until at least `min_calls` calls.
fn mean_ns(queries: &[Vec<u32>], min_calls: usize, mut f: impl FnMut(&[u32]) -> usize) -> f64 {
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
    for (label, tokens) in [("1k", 1_024), ("8k", 8_192), ("32k", 32_768)] {
        let fx = fixture(tokens);
        // Both must agree (and be right) on every query before their speeds are compared.
        for (q, query) in fx.queries.iter().enumerate() {
            let got = fx.tree.match_prefix(0, query);
            let (n, ts) = fx.trie.match_prefix(query);
            assert_eq!((got.matched_tokens, n), (tokens, tokens), "query {q}");
            let mut got_ts = got.tenants.clone();
            got_ts.sort_unstable();
            let want: Vec<TenantId> = (q..WORKERS)
                .step_by(CONVERSATIONS)
                .map(|w| w as TenantId)
                .collect();
            assert_eq!((got_ts, ts), (want.clone(), want), "tenants of query {q}");
        }
        let mut group = c.benchmark_group(format!("match_prefix/{label}_tokens"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        let id = format!("{WORKERS}_workers");
        let mut i = 0usize;
        group.bench_function(BenchmarkId::new(&id, "token_tree"), |b| {
            b.iter(|| {
                i = (i + 1) % fx.queries.len();
                black_box(fx.tree.match_prefix(0, black_box(&fx.queries[i])))
            })
        });
        group.bench_function(BenchmarkId::new(&id, "btree_trie"), |b| {
            b.iter(|| {
                i = (i + 1) % fx.queries.len();
                black_box(fx.trie.match_prefix(black_box(&fx.queries[i])))
            })
        });
        group.finish();
        let tree_ns = mean_ns(&fx.queries, 20_000, |q| {
            fx.tree.match_prefix(0, q).matched_tokens
        });
        let trie_ns = mean_ns(&fx.queries, 256, |q| fx.trie.match_prefix(q).0);
        println!(
            "match_prefix/{label}_tokens/{WORKERS}_workers: token_tree {tree_ns:.0} ns, \
             btree_trie {trie_ns:.0} ns, ratio btree_trie/token_tree = {:.1}x, tree nodes {}, \
             tree memory_bytes {}, trie nodes {}",
            trie_ns / tree_ns,
            fx.tree.node_count(),
            fx.tree.memory_bytes(),
            fx.trie.nodes.len(),
        );
    }
}

criterion_group!(benches, bench_match_prefix);
criterion_main!(benches);
