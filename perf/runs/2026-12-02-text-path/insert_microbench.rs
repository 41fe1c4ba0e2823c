use kvroute_index::string_tree::StringTree;
use std::time::Instant;
fn main() {
    let sys: String = (0..800).map(|i| (b'a' + (i * 7 % 26) as u8) as char).collect();
    let qs: Vec<String> = (0..1000).map(|i| format!("{sys} question number {i} about topic {} please?", i * 31 % 977)).collect();
    let mut t = StringTree::new();
    let mut x = 1u64;
    for i in 0..20000 { t.insert(0, &qs[i % 1000], (i % 4) as u32); }
    let n = 400_000;
    let mut picks = Vec::with_capacity(n);
    for _ in 0..n { x ^= x << 13; x ^= x >> 7; x ^= x << 17; picks.push(((x % 1000) as usize, ((x >> 20) % 4) as u32)); }
    for round in 0..3 {
        let t0 = Instant::now();
        for &(q, w) in &picks { t.insert(0, &qs[q], w); }
        let ins = t0.elapsed().as_nanos() as f64 / n as f64;
        let t0 = Instant::now();
        let mut s = 0;
        for &(q, _) in &picks { s += t.match_depths(0, &qs[q]).len(); }
        let m = t0.elapsed().as_nanos() as f64 / n as f64;
        println!("round {round}: insert {ins:.0} ns, match_depths {m:.0} ns ({s})");
    }
}
