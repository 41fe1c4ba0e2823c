use std::time::Instant;
fn main() {
    let n = 16 * 1024;
    let buf: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
    for _ in 0..3 {
        let iters = 200_000;
        let t = Instant::now();
        let mut acc = 0u128;
        for i in 0..iters {
            let mut h = twox_hash::XxHash3_128::default();
            h.write(&buf[..n - (i & 7)]);
            acc ^= h.finish_128();
        }
        let tw = t.elapsed().as_nanos() as f64 / iters as f64;
        let t = Instant::now();
        for i in 0..iters {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            h.update(&buf[..n - (i & 7)]);
            acc ^= h.digest128();
        }
        let xs = t.elapsed().as_nanos() as f64 / iters as f64;
        let t = Instant::now();
        for i in 0..iters {
            acc ^= xxhash_rust::xxh3::xxh3_128(&buf[..n - (i & 7)]);
        }
        let xo = t.elapsed().as_nanos() as f64 / iters as f64;
        println!("16 KiB: twox streaming {tw:.0} ns ({:.1} GB/s), xxhash-rust streaming {xs:.0} ns, oneshot {xo:.0} ns  {}", n as f64 / tw, acc & 1);
    }
}
