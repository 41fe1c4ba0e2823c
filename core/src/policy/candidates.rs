//! The candidate set of a decision in a large fleet ([`super::Router::decide_on`]): instead of
//! snapshotting and scoring every worker, a decision scores
//!
//! | part | how many | why |
//! |---|---|---|
//! | the deepest holders of the request's prefix, in each index answer the policy may read | ≤ `candidate_holders` per answer | the workers a cache-aware policy would pick for their overlap |
//! | workers drawn uniformly at random (with replacement, duplicates dropped) | ≤ `candidate_sample` | the least loaded of them stands in for the least loaded of the fleet |
//!
//! The draw is the power of d choices (Mitzenmacher, Richa, Sitaraman, "The Power of Two
//! Random Choices: A Survey of Techniques and Results", 2001): the least loaded of d uniform
//! draws is, in expectation, in the lightest 1/(d + 1) of the fleet, and a balancer that sends
//! each request to the least loaded of d ≥ 2 draws keeps the maximum load within
//! O(log log n / log d) of the mean. With d = 8 (the default) a decision ranks its non-holders
//! among the lightest ~11 % of the fleet, which moves every time it runs.
//!
//! Holders tied at the cut (a prefix every worker holds, such as a fleet-wide system prompt)
//! are the first ones met going round the answer from a random position, so that successive
//! decisions spread over all of them without a random draw per holder.

use kvroute_index::TenantId;
use rand::Rng;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// The ids of up to `k` entries of `found` with the largest overlaps, appended to `out`:
/// every entry deeper than the `k`-th largest overlap, and as many entries at that overlap as
/// fill `k`, the first ones met going round `found` from a random position. All of `found`
/// when it has at most `k` entries. Two passes, O(|found| · log k) at worst (a heap of the `k`
/// largest, which most entries only compare against).
pub fn deepest(found: &[(TenantId, usize)], k: usize, rng: &mut impl Rng, out: &mut Vec<usize>) {
    if found.len() <= k {
        out.extend(found.iter().map(|&(w, _)| w as usize));
        return;
    }
    if k == 0 {
        return;
    }
    // The k largest overlaps, smallest on top: the cut is the k-th largest.
    let mut top: BinaryHeap<Reverse<usize>> = BinaryHeap::with_capacity(k + 1);
    for &(_, m) in found {
        if top.len() < k {
            top.push(Reverse(m));
        } else if top.peek().is_some_and(|&Reverse(least)| m > least) {
            top.pop();
            top.push(Reverse(m));
        }
    }
    let Some(&Reverse(cut)) = top.peek() else {
        return;
    };
    // Every entry above the cut is among the k largest.
    let mut ties = k - top.iter().filter(|&&Reverse(m)| m > cut).count();
    let start = rng.random_range(0..found.len());
    for &(w, m) in found[start..].iter().chain(&found[..start]) {
        if m > cut {
            out.push(w as usize);
        } else if m == cut && ties > 0 {
            out.push(w as usize);
            ties -= 1;
        }
    }
}

/// A decision's candidate set over `slots` worker slots, ascending and without duplicates:
/// the ids `first` (the event index's deepest holders, taken by
/// [`crate::events::Holders::deepest`]), the [`deepest`] `holders` of each of `answers`, and
/// `sample` uniform draws from `0..slots` (duplicates dropped), in one buffer allocated once.
/// The caller drops the ids that are not eligible.
pub fn choose(
    first: impl ExactSizeIterator<Item = usize>,
    answers: &[&[(TenantId, usize)]],
    slots: usize,
    holders: usize,
    sample: usize,
    rng: &mut impl Rng,
) -> Vec<usize> {
    let mut out = Vec::with_capacity(first.len() + answers.len() * holders + sample);
    out.extend(first);
    for a in answers {
        deepest(a, holders, rng, &mut out);
    }
    if slots > 0 {
        out.extend((0..sample).map(|_| rng.random_range(0..slots)));
    }
    out.retain(|&w| w < slots);
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn deepest_takes_the_deep_then_tied_ones_from_a_random_start() {
        // Workers 0..8 hold the 10-block system prompt; 3 and 5 hold 50 and 40.
        let found: Vec<(TenantId, usize)> = (0..8)
            .map(|w| {
                (
                    w,
                    match w {
                        3 => 50,
                        5 => 40,
                        _ => 10,
                    },
                )
            })
            .collect();
        let mut seen_tied = std::collections::BTreeSet::new();
        for seed in 0..64 {
            let mut out = Vec::new();
            deepest(&found, 4, &mut StdRng::seed_from_u64(seed), &mut out);
            assert_eq!(out.len(), 4);
            assert!(
                out.contains(&3) && out.contains(&5),
                "the deep always: {out:?}"
            );
            // The two tied ones are the first met going round from the start: consecutive
            // among 0 1 2 4 6 7 (wrapping).
            let tied = [0, 1, 2, 4, 6, 7];
            let picked: Vec<usize> = out.iter().copied().filter(|w| tied.contains(w)).collect();
            let i = tied.iter().position(|&w| w == picked[0]).unwrap();
            assert_eq!(
                picked[1],
                tied[(i + 1) % tied.len()],
                "seed {seed}: {out:?}"
            );
            seen_tied.extend(picked);
        }
        assert_eq!(seen_tied.len(), 6, "every tied holder is taken sometimes");
    }

    #[test]
    fn choose_merges_answers_and_draws_within_the_slots() {
        let mut rng = StdRng::seed_from_u64(7);
        let a: Vec<(TenantId, usize)> = vec![(900, 64), (5, 16)];
        let b: Vec<(TenantId, usize)> = vec![(5, 8), (7, 32)];
        let c = choose([3].into_iter(), &[&a, &b], 100, 8, 0, &mut rng);
        assert_eq!(
            c,
            vec![3, 5, 7],
            "ids given kept, ids past the slots dropped, duplicates merged"
        );
        let c = choose([].into_iter(), &[], 1000, 8, 32, &mut rng);
        assert!(c.windows(2).all(|p| p[0] < p[1]) && c.len() <= 32 && c.len() >= 28);
        assert!(choose([3].into_iter(), &[&a], 0, 8, 32, &mut rng).is_empty());
    }

    proptest! {
        /// Against a sort: `deepest` returns min(k, n) distinct entries of `found`, and no
        /// entry left out is deeper than one taken.
        #[test]
        fn deepest_is_a_top_k(
            depths in prop::collection::vec(0usize..6, 0..40),
            k in 0usize..12,
            seed in any::<u64>(),
        ) {
            let found: Vec<(TenantId, usize)> =
                depths.iter().enumerate().map(|(w, &d)| (w as TenantId, d)).collect();
            let mut out = Vec::new();
            deepest(&found, k, &mut StdRng::seed_from_u64(seed), &mut out);
            prop_assert_eq!(out.len(), k.min(found.len()));
            let mut uniq = out.clone();
            uniq.sort_unstable();
            uniq.dedup();
            prop_assert_eq!(uniq.len(), out.len());
            let least_taken = out.iter().map(|&w| depths[w]).min().unwrap_or(usize::MAX);
            for (w, &d) in depths.iter().enumerate() {
                if !out.contains(&w) {
                    prop_assert!(d <= least_taken, "left out {} (depth {}) above {}", w, d, least_taken);
                }
            }
        }
    }
}
