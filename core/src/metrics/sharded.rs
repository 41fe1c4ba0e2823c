//! [`ShardedCounter`] and [`ShardedHistogram`]: the per-request metrics, with one cell per
//! thread group instead of one shared value.
//!
//! prometheus-client's `Counter` is one atomic and its `Histogram` one mutex-guarded struct:
//! every shard that counts a request writes the same cache line, which then moves between
//! cores at every request (a histogram observation also takes and releases the mutex). Here
//! a thread writes only its own cell (a thread picks one of [`CELLS`] at its first
//! observation, round robin, so up to [`CELLS`] shards never share one), and a scrape sums
//! the cells. A scrape is therefore not one atomic snapshot across cells: a request counted
//! during a scrape may be in `_count` and not yet in its bucket, off by the few in flight,
//! as prometheus-client's own counters are across series.

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Cells per metric: threads beyond this many share cells (still correct, only slower).
/// 16 covers the router's shards on most bare-metal hosts' core counts per NUMA node.
pub const CELLS: usize = 16;

/// This thread's cell, assigned round robin at its first use.
fn cell() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static CELL: usize = NEXT.fetch_add(1, Ordering::Relaxed) % CELLS;
    }
    CELL.with(|c| *c)
}

/// A counter's cell, alone on its 128-byte pair of cache lines (the adjacent-line
/// prefetcher fetches lines in pairs).
#[derive(Debug, Default)]
#[repr(align(128))]
struct CounterCell(AtomicU64);

/// A monotonic `u64` counter (OpenMetrics `counter`). Clones share the value.
#[derive(Debug, Clone, Default)]
pub struct ShardedCounter(Arc<[CounterCell; CELLS]>);

impl ShardedCounter {
    /// Adds 1.
    pub fn inc(&self) {
        self.inc_by(1);
    }

    /// Adds `v`.
    pub fn inc_by(&self, v: u64) {
        self.0[cell()].0.fetch_add(v, Ordering::Relaxed);
    }

    /// The sum over every cell.
    pub fn get(&self) -> u64 {
        self.0
            .iter()
            .fold(0u64, |s, c| s.wrapping_add(c.0.load(Ordering::Relaxed)))
    }
}

impl TypedMetric for ShardedCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for ShardedCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Most buckets of a [`ShardedHistogram`], `+Inf` included: the counts live inside the
/// cell (a boxed slice per cell would put two cells' counts on one cache line).
pub const MAX_BUCKETS: usize = 24;

/// A histogram's cell: observations, their sum (f64 bits) and one count per bucket (the
/// first `bounds.len() + 1` are used, the last of them `+Inf`).
#[derive(Debug, Default)]
#[repr(align(128))]
struct HistogramCell {
    count: AtomicU64,
    sum: AtomicU64,
    buckets: [AtomicU64; MAX_BUCKETS],
}

/// A histogram with fixed upper bounds (OpenMetrics `histogram`, classic buckets). Clones
/// share the values.
#[derive(Debug, Clone)]
pub struct ShardedHistogram {
    /// Finite upper bounds, ascending; the `+Inf` bucket is implicit.
    bounds: &'static [f64],
    cells: Arc<[HistogramCell]>,
}

impl ShardedHistogram {
    /// Empty, with buckets at `bounds` (finite, ascending, as prometheus-client's
    /// `Histogram::new` takes them) and `+Inf`.
    ///
    /// # Panics
    /// With [`MAX_BUCKETS`] or more bounds (a programming error: bounds are constants).
    pub fn new(bounds: &'static [f64]) -> Self {
        assert!(
            bounds.len() < MAX_BUCKETS,
            "at most {} bounds",
            MAX_BUCKETS - 1
        );
        debug_assert!(
            bounds.windows(2).all(|w| w[0] < w[1]) && bounds.iter().all(|b| b.is_finite())
        );
        // The sum starts at 0.0, whose bits are 0: a default cell is an empty one.
        let cells = (0..CELLS).map(|_| HistogramCell::default()).collect();
        Self { bounds, cells }
    }

    /// Records `v`: in the first bucket whose bound is ≥ `v`, `+Inf` when none is (and for
    /// NaN), as prometheus-client's `Histogram::observe`.
    pub fn observe(&self, v: f64) {
        let c = &self.cells[cell()];
        let i = if v.is_nan() {
            self.bounds.len()
        } else {
            self.bounds.partition_point(|&b| b < v)
        };
        c.buckets[i].fetch_add(1, Ordering::Relaxed);
        c.count.fetch_add(1, Ordering::Relaxed);
        // This thread is the cell's only writer unless threads outnumber the cells: the
        // exchange then succeeds the first time.
        let _ = c
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some((f64::from_bits(s) + v).to_bits())
            });
    }

    /// `(sum, count, per-bucket counts with their upper bounds, +Inf last)` over every cell.
    pub fn snapshot(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let mut buckets: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .map(|b| (b, 0))
            .collect();
        let (mut sum, mut count) = (0.0, 0u64);
        for c in self.cells.iter() {
            sum += f64::from_bits(c.sum.load(Ordering::Relaxed));
            count += c.count.load(Ordering::Relaxed);
            for (b, n) in buckets.iter_mut().zip(c.buckets.iter()) {
                b.1 += n.load(Ordering::Relaxed);
            }
        }
        (sum, count, buckets)
    }
}

impl TypedMetric for ShardedHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for ShardedHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.snapshot();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::histogram::Histogram;

    const BOUNDS: [f64; 4] = [0.001, 0.01, 0.1, 1.0];

    /// Same observations, from several threads, into this histogram and prometheus-client's:
    /// the same sum, count and buckets (the reference for bucket edges, NaN and +Inf).
    #[test]
    fn matches_prometheus_clients_histogram_across_threads() {
        let ours = ShardedHistogram::new(&BOUNDS);
        let theirs = Histogram::new(BOUNDS);
        let values = [
            0.0005,
            0.001,
            0.0011,
            0.01,
            0.05,
            0.1,
            0.5,
            1.0,
            1.5,
            30.0,
            f64::NAN,
            -1.0,
        ];
        std::thread::scope(|s| {
            for t in 0..(CELLS + 3) {
                let (ours, theirs) = (&ours, &theirs);
                s.spawn(move || {
                    for (i, &v) in values.iter().enumerate() {
                        if !(i + t).is_multiple_of(3) {
                            ours.observe(v);
                            theirs.observe(v);
                        }
                    }
                });
            }
        });
        let (sum, count, buckets) = ours.snapshot();
        let n = (CELLS + 3) as u64;
        let kept = |i: usize| (0..n).filter(|t| !(i as u64 + t).is_multiple_of(3)).count() as u64;
        assert_eq!(count, (0..values.len()).map(kept).sum::<u64>());
        assert!(
            sum.is_nan(),
            "a NaN observation makes the sum NaN, as upstream"
        );
        // Bucket i holds the values whose first bound >= v: 0.0005, 0.001, -1.0 in the first.
        let want = [
            kept(0) + kept(1) + kept(11),
            kept(2) + kept(3),
            kept(4) + kept(5),
            kept(6) + kept(7),
            kept(8) + kept(9) + kept(10),
        ];
        assert_eq!(buckets.iter().map(|b| b.1).collect::<Vec<_>>(), want);
        let text = |register: &dyn Fn(&mut prometheus_client::registry::Registry)| {
            let mut r = prometheus_client::registry::Registry::default();
            register(&mut r);
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
            out
        };
        let text_ours = text(&|r| r.register("x", "x", ours.clone()));
        let reference = text(&|r| r.register("x", "x", theirs.clone()));
        assert!(
            text_ours.contains(&format!("x_count {count}")),
            "{text_ours}"
        );
        assert_eq!(text_ours, reference);
    }

    #[test]
    fn counter_sums_every_threads_cell() {
        let c = ShardedCounter::default();
        std::thread::scope(|s| {
            for t in 0..(CELLS as u64 + 5) {
                let c = &c;
                s.spawn(move || {
                    for _ in 0..100 {
                        c.inc();
                    }
                    c.inc_by(t);
                });
            }
        });
        let n = CELLS as u64 + 5;
        assert_eq!(c.get(), 100 * n + n * (n - 1) / 2);
    }
}
