use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Instant;
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn copy_rev<const C: usize>(dst: &mut [MaybeUninit<u32>], src: &[u32]) {
    let n = src.len();
    let full = n / C * C;
    dst[full..n].write_copy_of_slice(&src[full..]);
    let mut at = full;
    while at > 0 {
        at -= C;
        dst[at..at + C].write_copy_of_slice(&src[at..at + C]);
    }
}

fn main() {
    let n = 33_000usize;
    let big: Vec<u32> = (0..n as u32 + 64).collect();
    for off in [0usize, 4, 16] {
        let src = &big[off..off + n];
        for mode in 0..4 {
            let mut prev: Option<Arc<[u32]>> = None;
            let t = Instant::now();
            for _ in 0..2000 {
                let mut a = Arc::<[u32]>::new_uninit_slice(n);
                let d = Arc::get_mut(&mut a).unwrap();
                match mode {
                    0 => { d.write_copy_of_slice(src); }
                    1 => copy_rev::<16>(d, src),
                    2 => copy_rev::<64>(d, src),
                    _ => copy_rev::<256>(d, src),
                }
                let a = unsafe { a.assume_init() };
                assert_eq!(a[n - 1], src[n - 1]);
                prev = Some(a);
            }
            println!("src off {} mode {mode}: {:.1} us", off * 4, t.elapsed().as_secs_f64() * 1e6 / 2000.0);
            drop(prev);
        }
    }
}
