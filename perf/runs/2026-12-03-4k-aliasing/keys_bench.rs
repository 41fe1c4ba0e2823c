use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Instant;
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
fn copy_unaliased<T: Copy>(dst: &mut [MaybeUninit<T>], src: &[T]) {
    let chunk = (1024 / std::mem::size_of::<T>().max(1)).max(1);
    let full = src.len() / chunk * chunk;
    dst[full..].write_copy_of_slice(&src[full..]);
    for at in (0..full).step_by(chunk).rev() {
        dst[at..at + chunk].write_copy_of_slice(&src[at..at + chunk]);
    }
}
fn shared<T: Copy>(src: &[T]) -> Arc<[T]> {
    let mut out = Arc::<[T]>::new_uninit_slice(src.len());
    copy_unaliased(Arc::get_mut(&mut out).unwrap(), src);
    unsafe { out.assume_init() }
}
fn main() {
    for n in [2048usize, 4096] {
        let v: Vec<u64> = (0..n as u64).collect();
        for round in 0..2 {
            let mut keep: Option<Arc<[u64]>> = None;
            let t = Instant::now();
            for _ in 0..5000 { let a: Arc<[u64]> = Arc::from(&v[..]); keep = Some(a); }
            let fwd = t.elapsed().as_secs_f64() * 1e6 / 5000.0;
            let t = Instant::now();
            for _ in 0..5000 { keep = Some(shared(&v)); }
            let un = t.elapsed().as_secs_f64() * 1e6 / 5000.0;
            println!("{round} n {n} u64: Arc::from {fwd:.2} us, shared {un:.2} us"); drop(keep);
        }
    }
}
