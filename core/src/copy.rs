//! Copies of large slices into shared buffers ([`crate::ids::Shared`]) that avoid 4K aliasing.
//!
//! An `Arc<[T]>`'s data sits 16 bytes past the start of its allocation, while a large `Vec`
//! (a chat prefix cache segment, a tokenizer's output, a prompt's block keys) starts on a page
//! boundary, so the destination runs 16 bytes ahead of the source modulo 4096. In one forward
//! copy every load then matches the low 12 address bits of the store just before it and waits
//! for it ("4K aliasing", Intel 64 and IA-32 Architectures Optimization Reference Manual).
//! `Arc::from(vec)` is such a copy. Measured on the 2-core dev VM
//! (`perf/runs/2026-12-03-4k-aliasing/`, mimalloc as in the binary):
//!
//! | copy into a new `Arc` | forward (`Arc::from`) | [`copy_unaliased`] |
//! |---|---|---|
//! | 33,000 token ids (u32) | 62 µs | 2.8 µs |
//! | 2,048 block keys (u64) | 6.3–7.9 µs | 0.38–0.41 µs |
//!
//! Copying the last 1 KiB chunk first costs nothing where the offsets do not alias (2.8–3.4
//! µs forward or backward at source offsets 16 and 64).

use std::mem::MaybeUninit;

/// Bytes per chunk of [`copy_unaliased`].
const CHUNK_BYTES: usize = 1024;

/// Copies `src` into `dst` (of equal length) in chunks of [`CHUNK_BYTES`], the last chunk
/// first (module doc: why).
///
/// # Panics
/// When the lengths differ.
pub fn copy_unaliased<T: Copy>(dst: &mut [MaybeUninit<T>], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "copy_unaliased needs equal lengths");
    let chunk = (CHUNK_BYTES / std::mem::size_of::<T>().max(1)).max(1);
    let full = src.len() / chunk * chunk;
    dst[full..].write_copy_of_slice(&src[full..]);
    for at in (0..full).step_by(chunk).rev() {
        dst[at..at + chunk].write_copy_of_slice(&src[at..at + chunk]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_unaliased_copies_every_element_at_every_length_and_offset() {
        fn check<T: Copy + PartialEq + std::fmt::Debug>(src: &[T], fill: T) {
            let chunk = CHUNK_BYTES / std::mem::size_of::<T>();
            for len in [0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk, src.len() - 3] {
                for from in [0, 1, 3] {
                    let part = &src[from..from + len];
                    // Initialised beforehand, so an element left unwritten shows as `fill`.
                    let mut dst = vec![MaybeUninit::new(fill); len];
                    copy_unaliased(&mut dst, part);
                    // SAFETY: every element was initialised by `vec!` above.
                    let got: Vec<T> = dst.iter().map(|x| unsafe { x.assume_init() }).collect();
                    assert_eq!(got, part, "len {len} from {from}");
                }
            }
        }
        let ids: Vec<u32> = (0..3 * 256 + 7).map(|i| i * 7 + 1).collect();
        check(&ids, u32::MAX);
        let keys: Vec<u64> = (0..3 * 128 + 7).map(|i| i * 0x9E37_79B9 + 1).collect();
        check(&keys, u64::MAX);
    }

    #[test]
    #[should_panic(expected = "equal lengths")]
    fn copy_unaliased_refuses_unequal_lengths() {
        copy_unaliased(&mut [MaybeUninit::new(0u32); 2], &[1u32]);
    }
}
