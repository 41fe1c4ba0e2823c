// Scratch program of perf/runs/2026-12-07-host-floor (not built by the workspace): copy to
// bench/examples/, add `mimalloc.workspace = true` to bench's [dev-dependencies], then
// `cargo run --release -p kvroute-bench --example enc_micro`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::time::Instant;
use kvroute_tokenize::Tokenizer;
use kvroute_bench::trace::synth::WordIds;

fn main() {
    let tok = Tokenizer::qwen3().unwrap();
    let words = WordIds::from_tokenizer(&tok).unwrap();
    let mut junk = vec![0u8; 256 << 20];
    let texts: Vec<String> = (0..2000).map(|i| words.block_text(2, i, 32)).collect();
    let mut ids = Vec::with_capacity(256);
    for mode in ["warm", "cold", "codewarm"] {
        let mut v = Vec::new();
        for (i, t) in texts.iter().enumerate() {
            if mode != "warm" {
                // thrash the caches: touch 64 MB
                let off = (i % 4) << 26;
                for j in (0..(64 << 20)).step_by(64) { junk[off + j] = junk[off + j].wrapping_add(1); }
            } else {
                ids.clear(); tok.encode_into(t, &mut ids).unwrap();
            }
            if mode == "codewarm" { ids.clear(); tok.encode_into(&texts[(i + 1000) % texts.len()], &mut ids).unwrap(); }
            ids.clear();
            let s = Instant::now();
            tok.encode_into(t, &mut ids).unwrap();
            v.push(s.elapsed().as_nanos() as u64);
            std::hint::black_box(&ids);
        }
        v.sort();
        println!("{mode}: {} ids, p50 {} p90 {} p99 {}", ids.len(), v[v.len()/2], v[v.len()*9/10], v[v.len()*99/100]);
    }
    std::hint::black_box(&junk);
    print!("{}", std::fs::read_to_string("/proc/self/smaps_rollup").unwrap().lines().filter(|l| l.starts_with("Rss") || l.starts_with("AnonHuge")).collect::<Vec<_>>().join("\n"));
}
