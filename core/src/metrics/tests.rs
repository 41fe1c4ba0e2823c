//! Exposition tests: both formats parsed by a real text-format parser (openmetrics-parser's
//! grammars for Prometheus 0.0.4 and OpenMetrics 1.0) with exact values, `promtool check
//! metrics` on both, label escaping, format negotiation, and the URL → id hand-over.

use super::*;
use crate::events::{StreamId, StreamStats};
use openmetrics_parser::{
    MetricNumber, OpenMetricsValue, PrometheusValue, openmetrics::parse_openmetrics,
    prometheus::parse_prometheus,
};
use std::collections::BTreeMap;

/// One parsed series: family name, its labels sorted by name (`le` included for buckets).
type Series = (String, Vec<(String, String)>);

/// Every sample of a parse, histograms flattened to `<family>_bucket{le}`, `_sum`, `_count`.
#[derive(Debug, Default, PartialEq)]
struct Parsed {
    /// Family name → its type as the parser read it (`counter`, `gauge`, `histogram`, ...).
    types: BTreeMap<String, String>,
    /// Sample values. Counters are keyed by the family name the format uses: `x_total` in
    /// 0.0.4, `x` in OpenMetrics; [`Parsed::counter`] hides that.
    values: BTreeMap<Series, f64>,
}

impl Parsed {
    fn get(&self, family: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        labels.sort();
        self.values.get(&(family.to_string(), labels)).copied()
    }

    /// A counter's value by its sample name `x_total`, whichever format was parsed.
    fn counter(&self, sample: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let bare = sample
            .strip_suffix("_total")
            .expect("a counter sample ends in _total");
        self.get(sample, labels).or_else(|| self.get(bare, labels))
    }

    fn expect(&self, family: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(family, labels)
            .unwrap_or_else(|| panic!("{family}{labels:?} not in {:#?}", self.values))
    }

    fn expect_counter(&self, sample: &str, labels: &[(&str, &str)]) -> f64 {
        self.counter(sample, labels)
            .unwrap_or_else(|| panic!("{sample}{labels:?} not in {:#?}", self.values))
    }

    fn insert(&mut self, family: &str, names: &[String], values: &[String], v: f64) {
        let mut labels: Vec<(String, String)> =
            names.iter().cloned().zip(values.iter().cloned()).collect();
        labels.sort();
        let old = self.values.insert((family.to_string(), labels), v);
        assert!(old.is_none(), "duplicate series in {family}");
    }

    fn insert_histogram(
        &mut self,
        family: &str,
        names: &[String],
        values: &[String],
        h: &openmetrics_parser::HistogramValue,
    ) {
        for b in &h.buckets {
            let mut names = names.to_vec();
            let mut values = values.to_vec();
            names.push("le".into());
            values.push(if b.upper_bound == f64::INFINITY {
                "+Inf".into()
            } else {
                b.upper_bound.to_string()
            });
            self.insert(
                &format!("{family}_bucket"),
                &names,
                &values,
                b.count.as_f64(),
            );
        }
        let sum = h.sum.map_or(f64::NAN, |s| s.as_f64());
        self.insert(&format!("{family}_sum"), names, values, sum);
        let count = h.count.map_or(f64::NAN, |c| c as f64);
        self.insert(&format!("{family}_count"), names, values, count);
    }
}

fn num(n: &MetricNumber) -> f64 {
    n.as_f64()
}

/// Parses `text` as Prometheus 0.0.4 with the classic grammar.
fn parse_classic(text: &str) -> Result<Parsed, String> {
    let exp = parse_prometheus(text).map_err(|e| format!("{e:?}"))?;
    let mut p = Parsed::default();
    for (name, family) in &exp.families {
        p.types.insert(name.clone(), family.family_type.to_string());
        let names = family.get_label_names().to_vec();
        for s in family.iter_samples() {
            let values: Vec<String> = s
                .get_labelset()
                .map_err(|e| format!("{e:?}"))?
                .iter_values()
                .cloned()
                .collect();
            match &s.value {
                PrometheusValue::Counter(c) => p.insert(name, &names, &values, num(&c.value)),
                PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => {
                    p.insert(name, &names, &values, num(n))
                }
                PrometheusValue::Histogram(h) => p.insert_histogram(name, &names, &values, h),
                PrometheusValue::Summary(_) => return Err(format!("unexpected summary {name}")),
            }
        }
    }
    Ok(p)
}

/// Parses `text` as OpenMetrics 1.0.
fn parse_om(text: &str) -> Result<Parsed, String> {
    let exp = parse_openmetrics(text).map_err(|e| format!("{e:?}"))?;
    let mut p = Parsed::default();
    for (name, family) in &exp.families {
        p.types.insert(name.clone(), family.family_type.to_string());
        let names = family.get_label_names().to_vec();
        for s in family.iter_samples() {
            let values: Vec<String> = s
                .get_labelset()
                .map_err(|e| format!("{e:?}"))?
                .iter_values()
                .cloned()
                .collect();
            match &s.value {
                OpenMetricsValue::Counter(c) => p.insert(name, &names, &values, num(&c.value)),
                OpenMetricsValue::Gauge(n) | OpenMetricsValue::Unknown(n) => {
                    p.insert(name, &names, &values, num(n))
                }
                OpenMetricsValue::Histogram(h) => p.insert_histogram(name, &names, &values, h),
                other => return Err(format!("unexpected {other:?} in {name}")),
            }
        }
    }
    Ok(p)
}

fn two_workers() -> Workers {
    Workers::new(&["http://a:1".into(), "http://b:2".into()]).unwrap()
}

/// Records a known value in every family: the numbers the parse tests assert.
fn recorded() -> (Metrics, Workers) {
    let m = Metrics::new();
    let w = two_workers();
    let guard = w.get(1).unwrap().acquire();
    std::mem::forget(guard); // worker 1 keeps one request in flight
    m.on_decision("cache_aware", "hit");
    m.on_decision("cache_aware", "hit");
    m.on_decision("cache_aware", "miss");
    m.on_request_done("/v1/completions", 200, "qwen", Some(1), 0.2);
    m.on_request_done("/v1/completions", 200, "qwen", Some(1), 0.3);
    m.on_request_done("/v1/chat/completions", 400, "", None, 0.00005);
    m.on_worker_error(0, "connect");
    m.on_worker_error(0, "connect");
    m.on_worker_error(1, "first_byte_timeout");
    m.on_retry(0, "connect");
    m.on_migration(1, "resumed");
    m.on_router_added(Phase::Request, 0.0004);
    m.on_router_added(Phase::Request, 0.0006);
    m.on_router_added(Phase::Response, 0.00002);
    m.on_ttft("/v1/completions", 0.15);
    m.on_ttft("/v1/completions", 75.0); // past the last bucket: only in +Inf
    m.on_bad_request("malformed");
    m.on_token_source("prompt", 30, 100);
    m.on_routing_tokens_rejected("too_long");
    m.on_worker_hit_outcome(1, 1024, 512);
    m.on_worker_hit_outcome(1, 256, 768);
    m.set_worker_state(
        0,
        WorkerState {
            healthy: true,
            breaker: Breaker::Closed,
            draining: false,
        },
    );
    m.set_worker_state(
        1,
        WorkerState {
            healthy: false,
            breaker: Breaker::Open,
            draining: true,
        },
    );
    m.set_index_sizes(vec![IndexSize {
        index: "tree_tokens".into(),
        model: "qwen".into(),
        size: 4096,
    }]);
    let stats = StreamStats {
        batches: 7,
        events: 21,
        restarts: 1,
        size_mismatches: 2,
        length_mismatches: 1,
        bad_partitions: 2,
        non_prefix_stores: 3,
        non_prefix_removals: 1,
        ambiguous_groups: 1,
        last_seq: Some(41),
        ..StreamStats::default()
    };
    m.set_event_streams(vec![
        StreamSample {
            stream: StreamId { worker: 1, rank: 0 },
            stats,
            indexed_blocks: 12,
        },
        StreamSample {
            stream: StreamId { worker: 1, rank: 1 },
            stats: StreamStats::default(),
            indexed_blocks: 0,
        },
    ]);
    (m, w)
}

/// The exact values of [`recorded`], asserted on a parse of either format.
fn assert_recorded_values(p: &Parsed) {
    let c = |s: &str, l: &[(&str, &str)]| p.expect_counter(s, l);
    assert_eq!(
        c(
            "kvroute_requests_total",
            &[
                ("route", "/v1/completions"),
                ("status", "200"),
                ("model", "qwen"),
                ("worker", "1")
            ]
        ),
        2.0
    );
    assert_eq!(
        c(
            "kvroute_requests_total",
            &[
                ("route", "/v1/chat/completions"),
                ("status", "400"),
                ("model", ""),
                ("worker", "")
            ]
        ),
        1.0
    );
    assert_eq!(c("kvroute_worker_requests_total", &[("worker", "1")]), 2.0);
    assert_eq!(
        c(
            "kvroute_decisions_total",
            &[("policy", "cache_aware"), ("reason", "hit")]
        ),
        2.0
    );
    assert_eq!(
        c(
            "kvroute_worker_errors_total",
            &[("worker", "0"), ("kind", "connect")]
        ),
        2.0
    );
    assert_eq!(
        c(
            "kvroute_worker_errors_total",
            &[("worker", "1"), ("kind", "first_byte_timeout")]
        ),
        1.0
    );
    assert_eq!(
        c(
            "kvroute_retries_total",
            &[("worker", "0"), ("reason", "connect")]
        ),
        1.0
    );
    assert_eq!(
        c(
            "kvroute_migrations_total",
            &[("worker", "1"), ("outcome", "resumed")]
        ),
        1.0
    );
    assert_eq!(
        c("kvroute_bad_requests_total", &[("reason", "malformed")]),
        1.0
    );
    assert_eq!(
        c("kvroute_token_source_total", &[("source", "prompt")]),
        1.0
    );
    assert_eq!(
        c("kvroute_tokenize_tokens_total", &[("how", "encoded")]),
        70.0
    );
    assert_eq!(
        c(
            "kvroute_routing_tokens_rejected_total",
            &[("reason", "too_long")]
        ),
        1.0
    );
    for (kind, v) in [
        ("predicted", 1280.0),
        ("served", 1280.0),
        ("phantom", 512.0),
        ("unannounced", 512.0),
    ] {
        assert_eq!(
            c(
                "kvroute_hit_tokens_total",
                &[("worker", "1"), ("kind", kind)]
            ),
            v,
            "{kind}"
        );
    }
    assert_eq!(c("kvroute_unannounced_hits_total", &[("worker", "1")]), 1.0);
    let rs = [
        ("restarts", 1.0),
        ("batches", 7.0),
        ("events", 21.0),
        ("bad_partitions", 2.0),
        ("skipped_groups", 5.0),
    ];
    for (name, v) in rs {
        let sample = format!("kvroute_kv_events_{name}_total");
        assert_eq!(c(&sample, &[("worker", "1"), ("rank", "0")]), v, "{name}");
        assert_eq!(c(&sample, &[("worker", "1"), ("rank", "1")]), 0.0, "{name}");
    }
    assert_eq!(
        c(
            "kvroute_kv_events_size_mismatches_total",
            &[("worker", "1"), ("rank", "0")]
        ),
        3.0,
        "size + length mismatches"
    );

    let g = |f: &str, l: &[(&str, &str)]| p.expect(f, l);
    assert_eq!(g("kvroute_worker_in_flight", &[("worker", "0")]), 0.0);
    assert_eq!(g("kvroute_worker_in_flight", &[("worker", "1")]), 1.0);
    assert_eq!(
        g("kvroute_worker_foreign_requests", &[("worker", "0")]),
        0.0
    );
    assert_eq!(g("kvroute_worker_healthy", &[("worker", "0")]), 1.0);
    assert_eq!(g("kvroute_worker_healthy", &[("worker", "1")]), 0.0);
    assert_eq!(g("kvroute_worker_breaker_state", &[("worker", "0")]), 0.0);
    assert_eq!(g("kvroute_worker_breaker_state", &[("worker", "1")]), 2.0);
    assert_eq!(g("kvroute_worker_draining", &[("worker", "1")]), 1.0);
    assert_eq!(
        g(
            "kvroute_index_size",
            &[("index", "tree_tokens"), ("model", "qwen")]
        ),
        4096.0
    );
    assert_eq!(
        g(
            "kvroute_kv_events_last_seq",
            &[("worker", "1"), ("rank", "0")]
        ),
        41.0
    );
    assert_eq!(
        p.get(
            "kvroute_kv_events_last_seq",
            &[("worker", "1"), ("rank", "1")]
        ),
        None,
        "no last seq yet: no sample"
    );
    assert_eq!(
        g(
            "kvroute_kv_indexed_blocks",
            &[("worker", "1"), ("rank", "0")]
        ),
        12.0
    );

    // Histograms: count, sum, cumulative buckets, +Inf = count.
    let route = ("route", "/v1/completions");
    let d = "kvroute_request_duration_seconds";
    assert_eq!(g(&format!("{d}_count"), &[route]), 2.0);
    assert!((g(&format!("{d}_sum"), &[route]) - 0.5).abs() < 1e-12);
    assert_eq!(g(&format!("{d}_bucket"), &[route, ("le", "0.1")]), 0.0);
    assert_eq!(g(&format!("{d}_bucket"), &[route, ("le", "0.25")]), 1.0);
    assert_eq!(g(&format!("{d}_bucket"), &[route, ("le", "0.5")]), 2.0);
    assert_eq!(g(&format!("{d}_bucket"), &[route, ("le", "+Inf")]), 2.0);
    let chat = ("route", "/v1/chat/completions");
    assert_eq!(g(&format!("{d}_bucket"), &[chat, ("le", "0.0001")]), 1.0);
    let t = "kvroute_ttft_seconds";
    assert_eq!(g(&format!("{t}_count"), &[route]), 2.0);
    assert!((g(&format!("{t}_sum"), &[route]) - 75.15).abs() < 1e-9);
    assert_eq!(g(&format!("{t}_bucket"), &[route, ("le", "60")]), 1.0);
    assert_eq!(g(&format!("{t}_bucket"), &[route, ("le", "+Inf")]), 2.0);
    let a = "kvroute_router_added_seconds";
    let req = ("phase", "request");
    assert_eq!(g(&format!("{a}_count"), &[req]), 2.0);
    assert!((g(&format!("{a}_sum"), &[req]) - 0.001).abs() < 1e-12);
    assert_eq!(g(&format!("{a}_bucket"), &[req, ("le", "0.00025")]), 0.0);
    assert_eq!(g(&format!("{a}_bucket"), &[req, ("le", "0.0005")]), 1.0);
    assert_eq!(g(&format!("{a}_bucket"), &[req, ("le", "0.001")]), 2.0);
    assert_eq!(
        g(&format!("{a}_count"), &[("phase", "response")]),
        1.0,
        "{:#?}",
        p.values
    );
    let buckets = p
        .values
        .keys()
        .filter(|(f, l)| {
            f == &format!("{a}_bucket") && l.contains(&("phase".into(), "request".into()))
        })
        .count();
    assert_eq!(buckets, LATENCY_BUCKETS.len() + 1, "every bound and +Inf");
}

/// The families of [`recorded`] with the type a parser must read for each.
const FAMILIES: [(&str, &str); 27] = [
    ("kvroute_requests", "counter"),
    ("kvroute_worker_requests", "counter"),
    ("kvroute_decisions", "counter"),
    ("kvroute_worker_errors", "counter"),
    ("kvroute_retries", "counter"),
    ("kvroute_migrations", "counter"),
    ("kvroute_bad_requests", "counter"),
    ("kvroute_token_source", "counter"),
    ("kvroute_routing_tokens_rejected", "counter"),
    ("kvroute_tokenize_tokens", "counter"),
    ("kvroute_hit_tokens", "counter"),
    ("kvroute_unannounced_hits", "counter"),
    ("kvroute_kv_events_batches", "counter"),
    ("kvroute_kv_events_events", "counter"),
    ("kvroute_kv_events_restarts", "counter"),
    ("kvroute_kv_events_size_mismatches", "counter"),
    ("kvroute_request_duration_seconds", "histogram"),
    ("kvroute_ttft_seconds", "histogram"),
    ("kvroute_router_added_seconds", "histogram"),
    ("kvroute_worker_in_flight", "gauge"),
    ("kvroute_worker_foreign_requests", "gauge"),
    ("kvroute_worker_healthy", "gauge"),
    ("kvroute_worker_breaker_state", "gauge"),
    ("kvroute_worker_draining", "gauge"),
    ("kvroute_index_size", "gauge"),
    ("kvroute_kv_events_last_seq", "gauge"),
    ("kvroute_kv_indexed_blocks", "gauge"),
];

/// The bug on main: OpenMetrics text served as 0.0.4 reads as broken counter families. The
/// 0.0.4 output parses with the classic grammar, every family typed as recorded (counters
/// named `x_total` on their TYPE line), every value exact.
#[test]
fn prometheus_text_parses_with_exact_values() {
    let (m, w) = recorded();
    let text = m.encode_as(&w, Format::Prometheus);
    let p = parse_classic(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    for (family, ty) in FAMILIES {
        let name = if ty == "counter" {
            format!("{family}_total")
        } else {
            family.to_string()
        };
        assert_eq!(
            p.types.get(&name).map(String::as_str),
            Some(ty),
            "{name}\n{text}"
        );
    }
    assert!(
        text.contains("# TYPE kvroute_requests_total counter\n"),
        "{text}"
    );
    assert_recorded_values(&p);
}

#[test]
fn openmetrics_text_parses_with_the_same_values() {
    let (m, w) = recorded();
    let text = m.encode_as(&w, Format::OpenMetrics);
    let p = parse_om(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    for (family, ty) in FAMILIES {
        assert_eq!(
            p.types.get(family).map(String::as_str),
            Some(ty),
            "{family}"
        );
    }
    assert_recorded_values(&p);
    // The same numbers as the 0.0.4 parse, series for series (counter names aside).
    let classic = parse_classic(&m.encode_as(&w, Format::Prometheus)).unwrap();
    assert_eq!(p.values.len(), classic.values.len());
}

/// What main served: the classic grammar refuses OpenMetrics counters (the parser can fail).
#[test]
fn classic_parser_rejects_openmetrics_counters() {
    let (m, w) = recorded();
    let om = m.encode_as(&w, Format::OpenMetrics);
    assert!(parse_classic(&om).is_err(), "{om}");
}

#[test]
fn only_openmetrics_ends_with_eof() {
    let (m, w) = recorded();
    let om = m.encode_as(&w, Format::OpenMetrics);
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert_eq!(om.matches("# EOF").count(), 1);
    let classic = m.encode_as(&w, Format::Prometheus);
    assert!(!classic.contains("# EOF"), "{classic}");
    assert_eq!(m.encode(&w), m.encode_as(&w, Format::OpenMetrics));
}

/// A label value with a quote, a backslash and a newline comes back unchanged from both
/// parsers.
#[test]
fn label_values_round_trip_escaped() {
    let m = Metrics::new();
    let w = two_workers();
    let model = "m\"x\\y\nz";
    m.on_request_done("/v1/completions", 200, model, Some(0), 0.01);
    let labels = [
        ("route", "/v1/completions"),
        ("status", "200"),
        ("model", model),
        ("worker", "0"),
    ];
    let classic = m.encode_as(&w, Format::Prometheus);
    assert!(
        classic.contains(r#"model="m\"x\\y\nz""#),
        "escaped on the wire: {classic}"
    );
    let p = parse_classic(&classic).unwrap_or_else(|e| panic!("{e}\n{classic}"));
    assert_eq!(p.counter("kvroute_requests_total", &labels), Some(1.0));
    let om = m.encode_as(&w, Format::OpenMetrics);
    let p = parse_om(&om).unwrap_or_else(|e| panic!("{e}\n{om}"));
    assert_eq!(p.counter("kvroute_requests_total", &labels), Some(1.0));
}

/// Runs `promtool` with `args`, `stdin` piped in: (success, stdout + stderr).
fn promtool(args: &[&str], stdin: &str) -> (bool, String) {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut child = Command::new("promtool")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// Prometheus' own tools on both outputs; skipped when `promtool` is not on PATH unless
/// `KVROUTE_REQUIRE_PROMTOOL=1` (then it fails).
///
/// - 0.0.4: `promtool check metrics` (Prometheus' text parser and its linter) finds nothing.
/// - OpenMetrics: `promtool check metrics` only reads 0.0.4 (promtool 2.x), so it is not the
///   check here; `promtool tsdb create-blocks-from openmetrics` runs Prometheus' strict
///   OpenMetrics parser (`# EOF`, `_total` counters, histogram structure, escapes) and must
///   ingest every sample. Backfill needs a timestamp on each sample: the test appends one.
#[test]
fn promtool_checks_both_formats() {
    let required = std::env::var("KVROUTE_REQUIRE_PROMTOOL").is_ok_and(|v| v == "1");
    if std::process::Command::new("promtool")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            !required,
            "KVROUTE_REQUIRE_PROMTOOL=1 but promtool is not on PATH (Debian package prometheus)"
        );
        eprintln!("skipped: promtool not on PATH (Debian package prometheus)");
        return;
    }
    let (m, w) = recorded();
    let classic = m.encode_as(&w, Format::Prometheus);
    let (ok, said) = promtool(&["check", "metrics"], &classic);
    assert!(ok, "{said}\n{classic}");
    assert_eq!(said.trim(), "", "promtool findings on 0.0.4\n{classic}");

    let om = m.encode_as(&w, Format::OpenMetrics);
    let mut stamped = String::new();
    let mut samples = 0;
    for line in om.lines() {
        stamped.push_str(line);
        if !line.starts_with('#') {
            stamped.push_str(" 1700000000");
            samples += 1;
        }
        stamped.push('\n');
    }
    let dir = std::env::temp_dir().join(format!("kvroute-promtool-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("metrics.om");
    std::fs::write(&file, &stamped).unwrap();
    let blocks = dir.join("blocks");
    let (ok, said) = promtool(
        &[
            "tsdb",
            "create-blocks-from",
            "openmetrics",
            file.to_str().unwrap(),
            blocks.to_str().unwrap(),
        ],
        "",
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(ok, "{said}\n{stamped}");
    // The summary line: ULID, min, max, duration, NUM SAMPLES, ...
    let ingested: usize = said
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no block summary: {said}"));
    assert_eq!(ingested, samples, "{said}");
    assert!(samples > 100, "{samples} samples");
}

#[test]
fn negotiation_follows_the_accept_header() {
    let h = |v: &'static str| Some(v.as_bytes());
    // Prometheus 2.x's scrape Accept header.
    let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                      version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    assert_eq!(Format::negotiate(h(prometheus)), Format::OpenMetrics);
    assert_eq!(
        Format::negotiate(h("Application/OpenMetrics-Text")),
        Format::OpenMetrics
    );
    assert_eq!(
        Format::negotiate(h("text/plain;version=0.0.4")),
        Format::Prometheus
    );
    assert_eq!(Format::negotiate(h("*/*")), Format::Prometheus);
    assert_eq!(Format::negotiate(None), Format::Prometheus);
    assert_eq!(
        Format::negotiate(h("application/openmetrics-text; q=0, text/plain")),
        Format::Prometheus
    );
    assert_eq!(
        Format::Prometheus.content_type(),
        "text/plain; version=0.0.4; charset=utf-8"
    );
    assert_eq!(
        Format::OpenMetrics.content_type(),
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
}

/// Many shards recording at once, with scrapes in between: every count lands once.
#[test]
fn concurrent_records_and_scrapes_count_once() {
    let m = std::sync::Arc::new(Metrics::new());
    let w = std::sync::Arc::new(two_workers());
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let (m, w) = (m.clone(), w.clone());
            std::thread::spawn(move || {
                for j in 0..250 {
                    m.on_decision("round_robin", "round_robin");
                    m.on_worker_error(0, "connect");
                    m.on_worker_error(0, "connect");
                    if i == 0 && j % 50 == 0 {
                        m.encode_as(&w, Format::Prometheus);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let p = parse_classic(&m.encode_as(&w, Format::Prometheus)).unwrap();
    assert_eq!(
        p.counter(
            "kvroute_decisions_total",
            &[("policy", "round_robin"), ("reason", "round_robin")]
        ),
        Some(1000.0)
    );
    assert_eq!(
        p.counter(
            "kvroute_worker_errors_total",
            &[("worker", "0"), ("kind", "connect")]
        ),
        Some(2000.0)
    );
}

/// Scrape-time values are replaced whole; a forgotten worker's gauges are gone.
#[test]
fn scrape_time_values_replace_and_forget() {
    let m = Metrics::new();
    let w = two_workers();
    let size = |index: &str, size| IndexSize {
        index: index.into(),
        model: "qwen".into(),
        size,
    };
    m.set_index_sizes(vec![size("tree_chars", 10), size("tree_tokens", 3)]);
    m.set_index_sizes(vec![size("tree_chars", 12)]);
    m.set_worker_state(
        1,
        WorkerState {
            healthy: true,
            breaker: Breaker::HalfOpen,
            draining: false,
        },
    );
    let p = parse_classic(&m.encode_as(&w, Format::Prometheus)).unwrap();
    let idx = |i| p.get("kvroute_index_size", &[("index", i), ("model", "qwen")]);
    assert_eq!((idx("tree_chars"), idx("tree_tokens")), (Some(12.0), None));
    assert_eq!(
        p.get("kvroute_worker_breaker_state", &[("worker", "1")]),
        Some(1.0)
    );
    assert_eq!(
        p.types.get("kvroute_kv_indexed_blocks"),
        None,
        "no streams set"
    );
    m.forget_worker(1);
    let one = Workers::new(&["http://a:1".into()]).unwrap();
    let p = parse_classic(&m.encode_as(&one, Format::Prometheus)).unwrap();
    assert_eq!(
        p.get("kvroute_worker_breaker_state", &[("worker", "1")]),
        None
    );
    assert_eq!(p.get("kvroute_worker_in_flight", &[("worker", "1")]), None);
    assert_eq!(
        p.get("kvroute_worker_in_flight", &[("worker", "0")]),
        Some(0.0)
    );
}

/// Phantom and unannounced are the two sides of served − predicted; an unannounced hit is
/// counted only when the engine served more than predicted (B37).
#[test]
fn hit_outcomes_split_into_phantom_and_unannounced() {
    let m = Metrics::new();
    let w = Workers::new(&["http://a:1".into()]).unwrap();
    m.on_worker_hit_outcome(0, 1024, 512); // 512 evicted after the decision
    m.on_worker_hit_outcome(0, 256, 768); // 512 the index did not know
    m.on_worker_hit_outcome(0, 64, 64);
    let p = parse_classic(&m.encode_as(&w, Format::Prometheus)).unwrap();
    for (kind, v) in [
        ("predicted", 1344.0),
        ("served", 1344.0),
        ("phantom", 512.0),
        ("unannounced", 512.0),
    ] {
        let labels = [("worker", "0"), ("kind", kind)];
        assert_eq!(
            p.counter("kvroute_hit_tokens_total", &labels),
            Some(v),
            "{kind}"
        );
    }
    assert_eq!(
        p.counter("kvroute_unannounced_hits_total", &[("worker", "0")]),
        Some(1.0)
    );
}
