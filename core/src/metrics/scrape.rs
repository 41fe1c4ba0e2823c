//! Families whose values are handed over at scrape time rather than counted by the router:
//! the KV-event streams' counters ([`StreamSample`]) and the index sizes ([`IndexSize`]).
//! A prometheus-client [`Collector`], so both exposition formats render them like any other
//! family (names, `_total`, label escaping, `# EOF`).

use crate::events::{StreamId, StreamStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use std::sync::{Mutex, PoisonError};

/// One KV-event stream's numbers, for the `kvroute_kv_events_*{worker,rank}` families.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSample {
    /// The stream: `worker` id and DP `rank` (the labels).
    pub stream: StreamId,
    /// Its counters (`kvroute_kv_events_*_total`) and last seq (`kvroute_kv_events_last_seq`,
    /// left out while `None`).
    pub stats: StreamStats,
    /// Block keys the index holds for it (`kvroute_kv_indexed_blocks`).
    pub indexed_blocks: usize,
}

/// One `kvroute_index_size{index,model}` gauge.
#[derive(Debug, Clone, PartialEq)]
pub struct IndexSize {
    /// Which index and unit, e.g. `tree_chars`, `tree_tokens`, `kv_event_blocks`.
    pub index: String,
    /// The model it indexes (`""` when the index is not per model).
    pub model: String,
    /// Entries, in the unit `index` names.
    pub size: u64,
}

type Get = fn(&StreamStats) -> u64;

/// The counters of each stream: name (without `kvroute_kv_events_` and `_total`), help, value.
const STREAM_COUNTERS: [(&str, &str, Get); 13] = [
    ("batches", "Event batches applied", |s| s.batches),
    ("events", "Events applied", |s| s.events),
    ("gaps", "Sequence gaps seen in the live stream", |s| s.gaps),
    ("replays", "Replay requests sent", |s| s.replays),
    (
        "unrecoverable_gaps",
        "Gaps replay could not fill (stream cleared)",
        |s| s.unrecoverable_gaps,
    ),
    (
        "restarts",
        "Engine restarts seen (seq went backwards; stream cleared)",
        |s| s.restarts,
    ),
    ("duplicates", "Batches dropped as already applied", |s| {
        s.duplicates
    }),
    ("decode_errors", "Batches dropped as undecodable", |s| {
        s.decode_errors
    }),
    ("orphans", "Stores with an unknown parent, skipped", |s| {
        s.orphans
    }),
    (
        "orphan_replays",
        "Whole-buffer replays asked for because of orphan stores",
        |s| s.orphan_replays,
    ),
    (
        "size_mismatches",
        "Stores skipped for a block size or token count that does not fit router blocks",
        |s| s.size_mismatches + s.length_mismatches,
    ),
    (
        "bad_partitions",
        "Batches dropped for a malformed partition or cache-group field",
        |s| s.bad_partitions,
    ),
    (
        "skipped_groups",
        "Stores and removals of KV-cache groups that are not prefix groups (sliding window, \
         Mamba, ...) or whose group is ambiguous, not applied",
        |s| s.non_prefix_stores + s.non_prefix_removals + s.ambiguous_groups,
    ),
];

/// The values the next scrape renders, replaced whole by their setters.
#[derive(Debug, Default)]
pub(super) struct ScrapeValues {
    streams: Mutex<Vec<StreamSample>>,
    index_sizes: Mutex<Vec<IndexSize>>,
}

impl ScrapeValues {
    pub(super) fn set_streams(&self, streams: Vec<StreamSample>) {
        *self.streams.lock().unwrap_or_else(PoisonError::into_inner) = streams;
    }

    pub(super) fn set_index_sizes(&self, sizes: Vec<IndexSize>) {
        *self
            .index_sizes
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = sizes;
    }
}

fn stream_labels(s: StreamId) -> Vec<(&'static str, String)> {
    vec![
        ("worker", s.worker.to_string()),
        ("rank", s.rank.to_string()),
    ]
}

impl Collector for ScrapeValues {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let streams = self
            .streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if !streams.is_empty() {
            for (name, help, get) in STREAM_COUNTERS {
                let name = format!("kvroute_kv_events_{name}");
                let c = ConstCounter::new(0u64);
                let help = format!("{help}, by worker id and rank.");
                let mut family = encoder.encode_descriptor(&name, &help, None, c.metric_type())?;
                for s in &streams {
                    let labels = stream_labels(s.stream);
                    ConstCounter::new(get(&s.stats)).encode(family.encode_family(&labels)?)?;
                }
            }
            let g = ConstGauge::new(0u64);
            let mut family = encoder.encode_descriptor(
                "kvroute_kv_events_last_seq",
                "Sequence number of the last batch applied, by worker id and rank.",
                None,
                g.metric_type(),
            )?;
            for s in &streams {
                if let Some(seq) = s.stats.last_seq {
                    let labels = stream_labels(s.stream);
                    ConstGauge::new(seq).encode(family.encode_family(&labels)?)?;
                }
            }
            let mut family = encoder.encode_descriptor(
                "kvroute_kv_indexed_blocks",
                "Block keys the KV-event index holds for the stream, by worker id and rank.",
                None,
                g.metric_type(),
            )?;
            for s in &streams {
                let labels = stream_labels(s.stream);
                ConstGauge::new(s.indexed_blocks as u64).encode(family.encode_family(&labels)?)?;
            }
        }
        let sizes = self
            .index_sizes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if !sizes.is_empty() {
            let g = ConstGauge::new(0u64);
            let mut family = encoder.encode_descriptor(
                "kvroute_index_size",
                "Entries in each routing index, in the unit the index label names.",
                None,
                g.metric_type(),
            )?;
            for s in &sizes {
                let labels = vec![("index", s.index.clone()), ("model", s.model.clone())];
                ConstGauge::new(s.size).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
