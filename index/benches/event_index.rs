//! `find_matches` on the positional [`EventIndex`] against the naive per-worker `HashSet`
//! scan ([`NaiveWorkerSets`]) holding the same blocks, in the same process.
//!
//! Fixture (as `event_grid_point` in `bench/src/index_bench.rs`, so the numbers compare with
//! `kvroute bench index`): blocks of 16 tokens; 64 conversations of `N` tokens that share one
//! system prompt of min(1,024, N/2) tokens, then diverge (random ids); worker `w` holds
//! conversation `w mod 64` from sequence start (one `BlockStored` each). A query is the block
//! keys of one whole conversation, cycling through the 64, so every worker matches the system
//! prompt's blocks and `workers / 64` of them (at least 0) match every block.
//!
//! Grid: N ∈ {1k, 8k, 32k} tokens × {8, 64, 256, 1024} workers. The naive scan runs only at
//! ≤ 256 workers (it is O(workers × matched blocks): ~ms per query beyond that, and the
//! fixture would hold another copy of every worker's blocks). Before timing, both answers are
//! checked against the closed form (conversation's workers: all blocks; others: the system
//! prompt's blocks).
//!
//! Benchmark names carry the shape: `find_matches/8k_tokens/256_workers/{event_index,naive}`.
//! After each point, the mean ns per query of both (a plain timed loop, outside criterion),
//! their ratio, the index's entries ((worker, block) pairs) and bytes per entry (writers'
//! `memory_bytes`, table included) are printed. Criterion runs 10 samples over ~2 s per
//! benchmark so the whole grid takes a couple of minutes.
//!
//! Run: `cargo bench -p kvroute-index --bench event_index`.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvroute_index::keys::block_keys;
use kvroute_index::reference::{NaiveWorkerSets, token_conversations, token_system_len};
use kvroute_index::{EventIndex, EventIndexConfig, EventWriter};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Tokens per block (the `kvroute bench index` fixture's).
const BS: usize = 16;
const CONVERSATIONS: usize = 64;
/// Largest worker count at which the naive scan is run.
const NAIVE_MAX_WORKERS: usize = 256;

struct Fixture {
    ix: EventIndex,
    writers: Vec<EventWriter>,
    naive: Option<NaiveWorkerSets>,
    /// Block keys of each conversation: the queries.
    keys: Vec<Vec<u64>>,
    /// Blocks of the shared system prompt.
    system_blocks: u32,
}

fn fixture(tokens: usize, workers: usize) -> Fixture {
    let convs = token_conversations(CONVERSATIONS, tokens);
    let keys: Vec<Vec<u64>> = convs.iter().map(|c| block_keys(c, BS)).collect();
    let (ix, mut writers) = EventIndex::new(&EventIndexConfig {
        block_size: BS,
        max_workers: workers,
        ttl_ms: None,
        max_entries: None,
    });
    let mut naive = (workers <= NAIVE_MAX_WORKERS).then(NaiveWorkerSets::default);
    for w in 0..workers {
        let c = w % CONVERSATIONS;
        let hashes: Vec<u64> = (0..keys[c].len() as u64)
            .map(|i| (c as u64) << 40 | i)
            .collect();
        writers[w / 64]
            .apply_stored(w as u32, 0, None, &hashes, &convs[c], 0)
            .expect("root store");
        if let Some(n) = &mut naive {
            n.sets.push(keys[c].iter().copied().collect());
        }
    }
    Fixture {
        ix,
        writers,
        naive,
        keys,
        system_blocks: (token_system_len(tokens) / BS) as u32,
    }
}

/// Mean ns per call of `f` over the queries, repeated until at least `min_calls` calls.
fn mean_ns(queries: &[Vec<u64>], min_calls: usize, mut f: impl FnMut(&[u64]) -> usize) -> f64 {
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

fn bench_find_matches(c: &mut Criterion) {
    for (label, tokens) in [("1k", 1_024), ("8k", 8_192), ("32k", 32_768)] {
        for workers in [8usize, 64, 256, 1024] {
            let fx = fixture(tokens, workers);
            // Both must give the closed-form answer before their speeds are compared.
            for (q, keys) in fx.keys.iter().enumerate() {
                let fast = fx.ix.find_matches(keys);
                let slow = fx.naive.as_ref().map(|n| n.find_matches(keys));
                for w in 0..workers {
                    let want = if w % CONVERSATIONS == q {
                        keys.len() as u32
                    } else {
                        fx.system_blocks
                    };
                    assert_eq!(fast.blocks(w as u32), want, "event index, worker {w}");
                    if let Some(s) = &slow {
                        assert_eq!(s[w], want, "naive, worker {w}");
                    }
                }
            }
            let mut group = c.benchmark_group(format!("find_matches/{label}_tokens"));
            group
                .sample_size(10)
                .warm_up_time(Duration::from_millis(500))
                .measurement_time(Duration::from_secs(2));
            let id = format!("{workers}_workers");
            let mut i = 0usize;
            group.bench_function(BenchmarkId::new(&id, "event_index"), |b| {
                b.iter(|| {
                    i = (i + 1) % fx.keys.len();
                    black_box(fx.ix.find_matches(black_box(&fx.keys[i])))
                })
            });
            if let Some(naive) = &fx.naive {
                group.bench_function(BenchmarkId::new(&id, "naive"), |b| {
                    b.iter(|| {
                        i = (i + 1) % fx.keys.len();
                        black_box(naive.find_matches(black_box(&fx.keys[i])))
                    })
                });
            }
            group.finish();
            let event_ns = mean_ns(&fx.keys, 2_000, |q| fx.ix.find_matches(q).0.len());
            let naive_ns = fx
                .naive
                .as_ref()
                .map(|n| mean_ns(&fx.keys, 128, |q| n.find_matches(q).len()));
            let entries = fx.ix.entries();
            let bytes: usize = fx.writers.iter().map(|w| w.memory_bytes()).sum();
            let naive_col = match naive_ns {
                Some(n) => format!(
                    "naive {n:.0} ns, ratio naive/event_index = {:.1}x",
                    n / event_ns
                ),
                None => "naive skipped".to_owned(),
            };
            println!(
                "find_matches/{label}_tokens/{workers}_workers: event_index {event_ns:.0} ns, \
                 {naive_col}, entries {entries}, {:.1} bytes/entry",
                bytes as f64 / entries.max(1) as f64
            );
        }
    }
}

criterion_group!(benches, bench_find_matches);
criterion_main!(benches);
