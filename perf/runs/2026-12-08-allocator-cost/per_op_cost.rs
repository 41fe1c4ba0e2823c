// Appended to io/src/alloc.rs for the measurement (not committed there); run with
// `cargo test --release -p kvroute-io --lib scratch_cost -- --ignored --nocapture`, with
// `count_kept`'s test-only atomic disabled (it adds ~10 ns per pair in test builds).
#[cfg(test)]
mod scratch_cost {
    use super::*;
    use std::time::Instant;

    fn run<A: GlobalAlloc>(a: &A, sizes: &[usize], n: usize) -> f64 {
        let t = Instant::now();
        let mut live: Vec<*mut u8> = Vec::with_capacity(8);
        for i in 0..n {
            for &s in sizes {
                let l = Layout::from_size_align(s, 8).unwrap();
                let p = unsafe { a.alloc(l) };
                unsafe { p.write_volatile(i as u8) };
                live.push(p);
            }
            for (&s, &p) in sizes.iter().zip(&live).rev() {
                let l = Layout::from_size_align(s, 8).unwrap();
                unsafe { a.dealloc(p, l) };
            }
            live.clear();
        }
        t.elapsed().as_nanos() as f64 / (n * sizes.len()) as f64
    }

    #[test]
    #[ignore]
    fn per_op_cost() {
        let sizes = [24, 48, 200, 1024, 96, 4000];
        let over = [1024usize; 24];
        let big = [9000usize, 20000];
        for round in 0..3 {
            let rf = run(&RecentFirst, &over, 300_000);
            let mi = run(&mimalloc::MiMalloc, &over, 300_000);
            let rfb = run(&RecentFirst, &big, 1_000_000);
            let mib = run(&mimalloc::MiMalloc, &big, 1_000_000);
            eprintln!("over slots: RecentFirst {rf:.2} MiMalloc {mi:.2}; above 8 KiB: RecentFirst {rfb:.2} MiMalloc {mib:.2}");
        }
        for round in 0..5 {
            let rf = std::hint::black_box(run(&RecentFirst, &sizes, 2_000_000));
            let mi = std::hint::black_box(run(&mimalloc::MiMalloc, &sizes, 2_000_000));
            eprintln!("round {round}: RecentFirst {rf:.2} ns, MiMalloc {mi:.2} ns per alloc+free");
        }
    }
}
