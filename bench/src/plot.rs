//! Figures of one simulated comparison (`kvroute simulate --plot DIR`), each written as PNG
//! and SVG with plotters:
//!
//! - `ttft_cdf`: the empirical CDF of TTFT per policy (x: virtual ms, log scale; y: fraction
//!   of successful requests with at most that TTFT), one line per policy.
//! - `load_<policy>`: requests in flight per engine over virtual time, one panel per engine
//!   (the same axes in every panel and every policy's figure): the time-weighted mean over
//!   each of [`LOAD_BUCKETS`] equal buckets spanning all the runs plotted together.
//! - `hit_rate`: hit rate per policy (bars, %) against the trace's infinite-cache bound
//!   (dashed line).
//!
//! Everything is computed after the run from the samples [`crate::sim::simulate`] keeps
//! anyway (arrival, TTFT, e2e and engine of each request): a run without `--plot` does no
//! extra work. A request is in flight on its engine from its arrival to its last token
//! (queued or running), as the gateway counts load. Text is drawn with the system's
//! `sans-serif` font through fontconfig (Debian: `fonts-dejavu-core`).

use std::path::{Path, PathBuf};

use image::codecs::png::{CompressionType, FilterType, PngEncoder};
use image::{ColorType, ImageEncoder};
use plotters::coord::Shift;
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::replay::RequestSample;
use crate::sim::{SimReport, engine_of};

/// Pixel size of every figure (width, height); the SVGs have the same viewport. The hit-rate
/// figure widens past 7 policies ([`hit_rate_size`]).
pub const SIZE: (u32, u32) = (1000, 600);
/// Time buckets of the load figures: the run's span is cut into this many equal buckets.
pub const LOAD_BUCKETS: usize = 200;
/// Most points of one CDF line ([`cdf`] thins longer ones).
pub const CDF_POINTS: usize = 1_000;
/// Colours of policies (in order given) and engines (by id), cycling: Tableau 20, the ten
/// strong colours first.
pub const PALETTE: [RGBColor; 20] = [
    RGBColor(0x1F, 0x77, 0xB4),
    RGBColor(0xFF, 0x7F, 0x0E),
    RGBColor(0x2C, 0xA0, 0x2C),
    RGBColor(0xD6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xBD),
    RGBColor(0x8C, 0x56, 0x4B),
    RGBColor(0xE3, 0x77, 0xC2),
    RGBColor(0x7F, 0x7F, 0x7F),
    RGBColor(0xBC, 0xBD, 0x22),
    RGBColor(0x17, 0xBE, 0xCF),
    RGBColor(0xAE, 0xC7, 0xE8),
    RGBColor(0xFF, 0xBB, 0x78),
    RGBColor(0x98, 0xDF, 0x8A),
    RGBColor(0xFF, 0x98, 0x96),
    RGBColor(0xC5, 0xB0, 0xD5),
    RGBColor(0xC4, 0x9C, 0x94),
    RGBColor(0xF7, 0xB6, 0xD2),
    RGBColor(0xC7, 0xC7, 0xC7),
    RGBColor(0xDB, 0xDB, 0x8D),
    RGBColor(0x9E, 0xDA, 0xE5),
];

const FONT: &str = "sans-serif";

/// Colour `i` of [`PALETTE`], cycling.
pub fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// One policy's run to plot.
#[derive(Debug, Clone, Copy)]
pub struct PolicyRun<'a> {
    /// Label in legends and, sanitized, in file names: the policy name as given to
    /// `--policies` (with the sweep setting, if any).
    pub name: &'a str,
    /// Its report, with the per-request samples and arrival times [`crate::sim::simulate`]
    /// keeps.
    pub report: &'a SimReport,
}

/// Errors of [`write_all`]; each names the file or directory.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The output directory could not be created.
    #[error("creating plot directory {}", path.display())]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The I/O error (the error's source, not repeated in its message).
        source: std::io::Error,
    },
    /// A figure could not be drawn or written (unwritable file, no usable font).
    #[error("writing {}: {message}", path.display())]
    Draw {
        /// The file.
        path: PathBuf,
        /// Plotters' error.
        message: String,
    },
}

/// The empirical CDF of `values`: sorted, one point `(v, fraction of values ≤ v)` per
/// distinct value (ties merge into the last of their rank), fractions in (0, 1], the last
/// 1.0. Non-finite values are dropped. With more than `max_points` (≥ 1) distinct values, only
/// every ⌈len / max_points⌉-th point and the last are kept. Empty in, empty out.
pub fn cdf(values: &[f64], max_points: usize) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    let mut pts: Vec<(f64, f64)> = Vec::new();
    for (i, &x) in v.iter().enumerate() {
        let f = (i + 1) as f64 / n;
        match pts.last_mut() {
            Some(last) if last.0 == x => last.1 = f,
            _ => pts.push((x, f)),
        }
    }
    let max = max_points.max(1);
    if pts.len() <= max {
        return pts;
    }
    let stride = pts.len().div_ceil(max);
    let last = pts.len() - 1;
    pts.into_iter()
        .enumerate()
        .filter(|(i, _)| (i + 1) % stride == 0 || *i == last)
        .map(|(_, p)| p)
        .collect()
}

/// Requests in flight per engine over time, bucketed ([`in_flight`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadSeries {
    /// Start of the first bucket, virtual ms.
    pub start_ms: f64,
    /// Width of each bucket, virtual ms (0 when the span is empty).
    pub bucket_ms: f64,
    /// `per_engine[w][k]`: engine `w`'s mean requests in flight over bucket `k` (the summed
    /// overlap of its requests with the bucket / the bucket's width).
    pub per_engine: Vec<Vec<f64>>,
}

/// Buckets `intervals`, each `(engine, start_ms, end_ms)` a request in flight on `engine`
/// over `[start_ms, end_ms)`, into `buckets` equal buckets over `span_ms = (from, to)`:
/// per engine and bucket, the time-weighted mean requests in flight. Parts outside the span,
/// engines ≥ `engines` and empty intervals count nowhere; an empty span gives all zeros.
pub fn in_flight(
    intervals: &[(usize, f64, f64)],
    engines: usize,
    span_ms: (f64, f64),
    buckets: usize,
) -> LoadSeries {
    let (from, to) = span_ms;
    let mut per_engine = vec![vec![0.0; buckets]; engines];
    let width = if buckets > 0 && to > from {
        (to - from) / buckets as f64
    } else {
        0.0
    };
    if width > 0.0 {
        for &(w, s, e) in intervals {
            let (a, b) = (s.max(from), e.min(to));
            if w >= engines || b <= a {
                continue;
            }
            let first = ((a - from) / width).floor() as usize;
            let last = (((b - from) / width).ceil() as usize).clamp(1, buckets) - 1;
            let first = first.min(last);
            for (k, v) in per_engine[w][first..=last].iter_mut().enumerate() {
                let lo = from + (first + k) as f64 * width;
                let overlap = b.min(lo + width) - a.max(lo);
                if overlap > 0.0 {
                    *v += overlap / width;
                }
            }
        }
    }
    LoadSeries {
        start_ms: from,
        bucket_ms: width,
        per_engine,
    }
}

/// The successful requests of `report` as `(engine, arrival ms, last token ms)`.
fn intervals(report: &SimReport) -> Vec<(usize, f64, f64)> {
    report
        .replay
        .samples
        .iter()
        .filter(|s| s.error.is_none())
        .filter_map(|s: &RequestSample| {
            let start = *report.arrival_ms.get(s.index)?;
            Some((engine_of(s)?, start, start + s.e2e_us as f64 / 1e3))
        })
        .filter(|(_, s, _)| s.is_finite())
        .collect()
}

/// TTFTs of the successful requests of `report`, virtual ms.
fn ttfts_ms(report: &SimReport) -> Vec<f64> {
    report
        .replay
        .samples
        .iter()
        .filter(|s| s.error.is_none())
        .filter_map(|s| s.ttft_us.map(|t| t as f64 / 1e3))
        .collect()
}

/// Pixel size of the hit-rate figure for `policies` bars: [`SIZE`], widened to 120 px per
/// bar past 7 bars.
pub fn hit_rate_size(policies: usize) -> (u32, u32) {
    (SIZE.0.max(120 * policies as u32 + 160), SIZE.1)
}

/// `name` for a file name: ASCII letters, digits, `-`, `_` and `.` kept, anything else `_`.
fn file_stem(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Writes the three figures of one run into `dir` (created if missing), as
/// `ttft_cdf{suffix}`, `load_<policy>{suffix}` (one per run in `runs`; a repeated name gets
/// `_2`, `_3`, ..) and `hit_rate{suffix}`, each `.png` then `.svg`. `suffix` keeps runs of
/// several seeds apart (e.g. `_seed2`, or empty); `bound` is the trace's infinite-cache hit
/// rate (fraction 0–1); `engines` the fleet size (an engine that served nothing gets an
/// empty panel). Colours follow the order of `runs`. Returns the files written, in that order.
///
/// # Errors
/// [`PlotError::Dir`] when `dir` cannot be created, [`PlotError::Draw`] when a file cannot
/// be written or text cannot be drawn (no `sans-serif` font).
pub fn write_all(
    dir: &Path,
    suffix: &str,
    runs: &[PolicyRun<'_>],
    bound: f64,
    engines: usize,
) -> Result<Vec<PathBuf>, PlotError> {
    std::fs::create_dir_all(dir).map_err(|source| PlotError::Dir {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files = Vec::new();
    let lines: Vec<CdfLine> = runs
        .iter()
        .map(|r| CdfLine {
            label: format!(
                "{}: p50 {} ms, p99 {} ms",
                r.name,
                num_label(r.report.replay.ttft_ms.p50),
                num_label(r.report.replay.ttft_ms.p99)
            ),
            points: cdf(&ttfts_ms(r.report), CDF_POINTS),
        })
        .collect();
    files.extend(write_figure(
        dir,
        &format!("ttft_cdf{suffix}"),
        &CdfFigure { lines },
    )?);

    let per_run: Vec<Vec<(usize, f64, f64)>> = runs.iter().map(|r| intervals(r.report)).collect();
    let from = per_run
        .iter()
        .flatten()
        .map(|i| i.1)
        .fold(f64::INFINITY, f64::min);
    let to = per_run
        .iter()
        .flatten()
        .map(|i| i.2)
        .fold(f64::NEG_INFINITY, f64::max);
    let span = if from < to { (from, to) } else { (0.0, 0.0) };
    let loads: Vec<LoadSeries> = per_run
        .iter()
        .map(|iv| in_flight(iv, engines, span, LOAD_BUCKETS))
        .collect();
    let y_max = loads
        .iter()
        .flat_map(|l| l.per_engine.iter().flatten())
        .copied()
        .fold(1.0, f64::max);
    let mut stems: Vec<String> = Vec::new();
    for (r, load) in runs.iter().zip(loads) {
        let base = format!("load_{}", file_stem(r.name));
        let mut stem = base.clone();
        let mut k = 1;
        while stems.contains(&stem) {
            k += 1;
            stem = format!("{base}_{k}");
        }
        stems.push(stem.clone());
        let fig = LoadFigure {
            policy: r.name.to_string(),
            load,
            y_max,
        };
        files.extend(write_figure(dir, &format!("{stem}{suffix}"), &fig)?);
    }

    let fig = HitFigure {
        bars: runs
            .iter()
            .map(|r| (r.name.to_string(), r.report.replay.hit_rate))
            .collect(),
        bound,
    };
    files.extend(write_figure(dir, &format!("hit_rate{suffix}"), &fig)?);
    Ok(files)
}

/// A number for labels: whole from 10 on, one decimal below, thousands separated.
fn num_label(ms: f64) -> String {
    if ms < 10.0 {
        return format!("{ms:.1}");
    }
    let digits = format!("{:.0}", ms);
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A figure drawable on any plotters backend.
trait Figure {
    fn size(&self) -> (u32, u32) {
        SIZE
    }
    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>;
}

/// Draws `fig` to `dir/stem.png` and `dir/stem.svg`.
fn write_figure(dir: &Path, stem: &str, fig: &impl Figure) -> Result<[PathBuf; 2], PlotError> {
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |e: &dyn std::fmt::Display| PlotError::Draw {
            path,
            message: e.to_string(),
        }
    };
    let (w, h) = fig.size();
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        fig.draw(&root)
            .and_then(|()| root.present())
            .map_err(|e| err(&png)(&e))?;
    }
    let file = std::fs::File::create(&png).map_err(|e| err(&png)(&e))?;
    PngEncoder::new_with_quality(
        std::io::BufWriter::new(file),
        CompressionType::Best,
        FilterType::Adaptive,
    )
    .write_image(&rgb, w, h, ColorType::Rgb8)
    .map_err(|e| err(&png)(&e))?;
    {
        let root = SVGBackend::new(&svg, fig.size()).into_drawing_area();
        fig.draw(&root)
            .and_then(|()| root.present())
            .map_err(|e| err(&svg)(&e))?;
    }
    Ok([png, svg])
}

struct CdfLine {
    label: String,
    points: Vec<(f64, f64)>,
}

struct CdfFigure {
    lines: Vec<CdfLine>,
}

impl Figure for CdfFigure {
    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        root.fill(&WHITE)?;
        // Log axis over the positive TTFTs, with a little room either side.
        let xs = self.lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
        let lo = xs
            .clone()
            .filter(|&x| x > 0.0)
            .fold(f64::INFINITY, f64::min);
        let hi = xs.fold(f64::NEG_INFINITY, f64::max);
        let (lo, hi) = if lo.is_finite() && hi > lo {
            (lo / 1.25, hi * 1.25)
        } else if lo.is_finite() {
            (lo / 2.0, lo * 2.0)
        } else {
            (1.0, 10.0)
        };
        let mut chart = ChartBuilder::on(root)
            .caption("TTFT CDF per policy", (FONT, 26))
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(64)
            .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)?;
        chart
            .configure_mesh()
            .x_desc("TTFT, virtual ms (log scale)")
            .y_desc("fraction of requests")
            .x_label_formatter(&|x| num_label(*x))
            .y_label_formatter(&|y| format!("{y:.1}"))
            .label_style((FONT, 16))
            .axis_desc_style((FONT, 18))
            .max_light_lines(4)
            .light_line_style(BLACK.mix(0.04))
            .draw()?;
        for (i, line) in self.lines.iter().enumerate() {
            let c = color(i);
            chart
                .draw_series(LineSeries::new(
                    line.points.iter().map(|&(x, y)| (x.max(lo), y)),
                    c.stroke_width(2),
                ))?
                .label(line.label.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 18, y + 5)], c.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font((FONT, 16))
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.5))
            .draw()?;
        Ok(())
    }
}

struct LoadFigure {
    policy: String,
    load: LoadSeries,
    y_max: f64,
}

impl Figure for LoadFigure {
    fn size(&self) -> (u32, u32) {
        load_size(self.load.per_engine.len())
    }

    /// One panel per engine, stacked, on shared axes: its mean requests in flight per bucket
    /// as a filled line.
    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        root.fill(&WHITE)?;
        let l = &self.load;
        let engines = l.per_engine.len();
        let buckets = l.per_engine.first().map_or(0, Vec::len);
        let t0 = l.start_ms / 1e3;
        let t1 = (l.start_ms + l.bucket_ms * buckets as f64) / 1e3;
        let t1 = if t1 > t0 { t1 } else { t0 + 1.0 };
        let title = format!(
            "{}: requests in flight per engine (mean over {} s buckets)",
            self.policy,
            sig3(l.bucket_ms / 1e3)
        );
        let body = root.titled(&title, (FONT, 24))?.margin(4, 8, 16, 24);
        let (panels, axis) = body.split_vertically(body.dim_in_pixel().1.saturating_sub(50));
        let rows = panels.split_evenly((engines.max(1), 1));
        let y_top = self.y_max * 1.1;
        for (w, (panel, series)) in rows.iter().zip(&l.per_engine).enumerate() {
            let c = color(w);
            let mut chart = ChartBuilder::on(panel)
                .y_label_area_size(84)
                .build_cartesian_2d(t0..t1, 0.0..y_top)?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(0)
                .y_labels(3)
                .y_desc(format!("engine {w}"))
                .y_label_formatter(&|y| num_label(*y))
                .label_style((FONT, 13))
                .axis_desc_style((FONT, 15))
                .light_line_style(TRANSPARENT)
                .draw()?;
            // Each bucket's mean at its midpoint.
            let pts = series
                .iter()
                .enumerate()
                .map(|(k, &v)| ((l.start_ms + (k as f64 + 0.5) * l.bucket_ms) / 1e3, v));
            chart.draw_series(
                AreaSeries::new(pts, 0.0, c.mix(0.35)).border_style(c.stroke_width(1)),
            )?;
        }
        // The shared time axis under the last panel.
        let mut chart = ChartBuilder::on(&axis)
            .y_label_area_size(84)
            .x_label_area_size(50)
            .build_cartesian_2d(t0..t1, 0.0..1.0)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .y_labels(0)
            .x_desc("virtual time, s")
            .x_label_formatter(&|x| num_label(*x))
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 18))
            .draw()?;
        Ok(())
    }
}

/// Pixel size of a load figure for `engines` panels: [`SIZE`], taller past 8 engines (64 px
/// per panel).
pub fn load_size(engines: usize) -> (u32, u32) {
    (SIZE.0, SIZE.1.max(64 * engines as u32 + 90))
}

/// `x` to 3 significant digits, trailing zeros dropped.
fn sig3(x: f64) -> String {
    if x <= 0.0 || !x.is_finite() {
        return "0".into();
    }
    let decimals = (2 - x.log10().floor() as i32).max(0) as usize;
    let s = format!("{x:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

struct HitFigure {
    /// (policy, hit rate 0–1).
    bars: Vec<(String, f64)>,
    /// Infinite-cache bound, 0–1.
    bound: f64,
}

impl Figure for HitFigure {
    fn size(&self) -> (u32, u32) {
        hit_rate_size(self.bars.len())
    }

    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, Shift>,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        root.fill(&WHITE)?;
        let n = self.bars.len();
        let mut chart = ChartBuilder::on(root)
            .caption("Cache hit rate per policy", (FONT, 26))
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(64)
            // A usize range includes its end: n bars are 0..=n − 1.
            .build_cartesian_2d((0..n.saturating_sub(1)).into_segmented(), 0.0..112.0)?;
        let names: Vec<&str> = self.bars.iter().map(|b| b.0.as_str()).collect();
        let label = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) => names.get(*i).map_or(String::new(), |s| s.to_string()),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n.max(1))
            .x_label_formatter(&label)
            .y_labels(12)
            .y_label_formatter(&|y| format!("{y:.0}"))
            .y_desc("hit rate, % of prompt tokens")
            .x_desc("policy")
            .label_style((FONT, 16))
            .axis_desc_style((FONT, 18))
            // Not max_light_lines(0): plotters' integer key points overflow asking for none.
            .light_line_style(TRANSPARENT)
            .draw()?;
        chart.draw_series(self.bars.iter().enumerate().map(|(i, (_, h))| {
            let mut r = Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), h * 100.0),
                ],
                color(i).filled(),
            );
            r.set_margin(0, 0, 30, 30);
            r
        }))?;
        // Each bar's value inside its top (above a bar too short to hold it).
        chart.draw_series(self.bars.iter().enumerate().map(|(i, (_, h))| {
            let pct = h * 100.0;
            let (y, v, c) = if pct >= 8.0 {
                (pct - 1.0, VPos::Top, &WHITE)
            } else {
                (pct + 1.0, VPos::Bottom, &BLACK)
            };
            let style = TextStyle::from((FONT, 17).into_font())
                .color(c)
                .pos(Pos::new(HPos::Center, v));
            Text::new(format!("{pct:.1} %"), (SegmentValue::CenterOf(i), y), style)
        }))?;
        let b = self.bound * 100.0;
        chart
            .draw_series(DashedLineSeries::new(
                [(SegmentValue::Exact(0), b), (SegmentValue::Last, b)],
                8,
                6,
                BLACK.stroke_width(2),
            ))?
            .label(format!("infinite-cache bound {b:.1} %"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK.stroke_width(2)));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 16))
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.5))
            .draw()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{DEFAULT_EVENT_DELAY_MS, DEFAULT_SEED, DEFAULT_SPREAD_SECS, Run, SimConfig};
    use crate::trace::{PromptBuilder, Trace, WordIds};
    use crate::workload::{WorkloadParams, builtin_workload};
    use kvroute_core::config::Config;

    /// Four TTFTs in any order: each is a quarter of the mass.
    #[test]
    fn cdf_of_four_values_steps_by_a_quarter() {
        assert_eq!(
            cdf(&[40.0, 10.0, 30.0, 20.0], CDF_POINTS),
            [(10.0, 0.25), (20.0, 0.5), (30.0, 0.75), (40.0, 1.0)]
        );
        // Ties merge into their last rank; NaN is dropped.
        assert_eq!(
            cdf(&[5.0, 7.0, 5.0, f64::NAN], CDF_POINTS),
            [(5.0, 2.0 / 3.0), (7.0, 1.0)]
        );
        assert!(cdf(&[], CDF_POINTS).is_empty());
    }

    /// 10 distinct values thinned to at most 5 points: stride 2, every second point, the
    /// last (1.0) included; 11 values, stride 3: points 3, 6, 9 and the last.
    #[test]
    fn long_cdfs_are_thinned_keeping_the_last_point() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(
            cdf(&v, 5),
            [(2.0, 0.2), (4.0, 0.4), (6.0, 0.6), (8.0, 0.8), (10.0, 1.0)]
        );
        let v: Vec<f64> = (1..=11).map(f64::from).collect();
        let xs: Vec<f64> = cdf(&v, 5).iter().map(|p| p.0).collect();
        assert_eq!(xs, [3.0, 6.0, 9.0, 11.0]);
    }

    /// Span 0–40 ms in 4 buckets of 10 ms. Engine 0: A over [0, 20) fills buckets 0 and 1,
    /// B over [5, 15) half of each; engine 1: C over [25, 40) half of bucket 2 and all of
    /// bucket 3. A request beyond the span counts only inside it; an unknown engine nowhere.
    #[test]
    fn in_flight_is_the_time_weighted_mean_per_bucket() {
        let l = in_flight(
            &[
                (0, 0.0, 20.0),
                (0, 5.0, 15.0),
                (1, 25.0, 40.0),
                (1, 35.0, 90.0),
                (7, 0.0, 40.0),
            ],
            2,
            (0.0, 40.0),
            4,
        );
        assert_eq!(l.start_ms, 0.0);
        assert_eq!(l.bucket_ms, 10.0);
        assert_eq!(
            l.per_engine,
            [vec![1.5, 1.5, 0.0, 0.0], vec![0.0, 0.0, 0.5, 1.5]]
        );
        // Summed over buckets × width: the busy time inside the span (20 + 10 ms; 15 + 5 ms).
        let busy: Vec<f64> = l
            .per_engine
            .iter()
            .map(|s| s.iter().sum::<f64>() * 10.0)
            .collect();
        assert_eq!(busy, [30.0, 20.0]);
        // An empty span: zeros, no division by zero.
        let e = in_flight(&[(0, 1.0, 2.0)], 1, (5.0, 5.0), 3);
        assert_eq!((e.bucket_ms, e.per_engine), (0.0, vec![vec![0.0; 3]]));
    }

    #[test]
    fn labels_and_file_names() {
        assert_eq!(num_label(1572.94), "1,573");
        assert_eq!(num_label(123456.0), "123,456");
        assert_eq!(num_label(2.46), "2.5");
        assert_eq!(sig3(2.5), "2.5");
        assert_eq!(sig3(18.04), "18");
        assert_eq!(sig3(0.01234), "0.0123");
        assert_eq!(file_stem("cache_aware ttft=2/x"), "cache_aware_ttft_2_x");
        assert_eq!(hit_rate_size(3), SIZE);
        assert_eq!(hit_rate_size(10), (1360, 600));
    }

    fn prompts() -> PromptBuilder {
        let letter = |i: u32| char::from(b'a' + i as u8);
        let vocab: Vec<(u32, String)> = (0..64u32)
            .map(|i| (100 + i, format!("Ġwx{}{}", letter(i / 8), letter(i % 8))))
            .collect();
        PromptBuilder::new(WordIds::from_vocab(vocab).unwrap(), 0)
    }

    fn sim(trace: &Trace, name: &str) -> SimReport {
        let run: Run = name.parse().unwrap();
        let cfg = SimConfig {
            engines: 3,
            engine: crate::engine::EngineConfig {
                num_gpu_blocks: 2_048,
                speedup_ratio: 4.0,
                ..crate::engine::EngineConfig::default()
            },
            router: Config {
                policy: run.policy,
                ..Config::default()
            },
            routing: run.routing,
            time_scale: 4.0,
            seed: DEFAULT_SEED,
            event_delay_ms: DEFAULT_EVENT_DELAY_MS,
            replicas: 1,
            sync_delay_ms: None,
            spread_secs: DEFAULT_SPREAD_SECS,
            wire_events: false,
            engine_speedups: Vec::new(),
        };
        crate::sim::simulate(trace, &prompts(), &cfg).unwrap()
    }

    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
        (be(&bytes[16..20]), be(&bytes[20..24]))
    }

    /// A tiny comparison (2 policies, 3 engines) plotted into a directory that does not exist
    /// yet: every file is there, the PNGs are PNGs of the documented size, the CDF's SVG has
    /// exactly one line in each policy's colour and each policy's name, each load SVG one
    /// line per engine, the hit-rate SVG both names and the bound.
    #[test]
    fn a_small_run_writes_every_figure() {
        let trace = Trace::mooncake(builtin_workload(&WorkloadParams {
            conversations: 6,
            ..WorkloadParams::default()
        }));
        let names = ["round_robin", "cache_aware_events"];
        let reports: Vec<SimReport> = names.iter().map(|n| sim(&trace, n)).collect();
        let runs: Vec<PolicyRun> = names
            .iter()
            .zip(&reports)
            .map(|(name, report)| PolicyRun { name, report })
            .collect();
        let base = std::env::temp_dir().join(format!("kvroute-plot-{}", std::process::id()));
        let dir = base.join("new").join("plots");
        let files = write_all(&dir, "_seed1", &runs, 0.7, 3).unwrap();
        let want = [
            "ttft_cdf_seed1",
            "load_round_robin_seed1",
            "load_cache_aware_events_seed1",
            "hit_rate_seed1",
        ];
        let got: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        let want_files: Vec<String> = want
            .iter()
            .flat_map(|s| [format!("{s}.png"), format!("{s}.svg")])
            .collect();
        assert_eq!(got, want_files);
        for f in &files {
            let bytes = std::fs::read(f).unwrap();
            if f.extension().unwrap() == "png" {
                assert_eq!(png_size(&bytes), SIZE, "{}", f.display());
            } else {
                let s = String::from_utf8(bytes).unwrap();
                assert!(s.starts_with("<svg"), "{}", f.display());
                assert!(
                    s.contains(r#"width="1000" height="600""#),
                    "{}",
                    f.display()
                );
            }
        }
        let svg = |stem: &str| std::fs::read_to_string(dir.join(format!("{stem}.svg"))).unwrap();
        let lines_in = |s: &str, c: RGBColor| {
            let stroke = format!(r##"stroke="#{:02X}{:02X}{:02X}""##, c.0, c.1, c.2);
            s.lines()
                .filter(|l| l.contains("<polyline") && l.contains(&stroke))
                .count()
        };
        // Text elements' content, one line each.
        let texts = |s: &str| -> Vec<String> {
            let lines: Vec<&str> = s.lines().collect();
            lines
                .windows(2)
                .filter(|w| w[0].starts_with("<text"))
                .map(|w| w[1].trim().to_string())
                .collect()
        };
        let cdf_svg = svg("ttft_cdf_seed1");
        for (i, name) in names.iter().enumerate() {
            assert_eq!(lines_in(&cdf_svg, color(i)), 1, "{name}");
            let label = format!("{name}: p50 ");
            assert_eq!(
                texts(&cdf_svg)
                    .iter()
                    .filter(|t| t.starts_with(&label))
                    .count(),
                1,
                "{name}"
            );
        }
        // Grid lines are black with opacity: every coloured line is a policy's.
        let coloured: usize = PALETTE.iter().map(|&c| lines_in(&cdf_svg, c)).sum();
        assert_eq!(coloured, names.len());
        for name in names {
            let s = svg(&format!("load_{name}_seed1"));
            for w in 0..3 {
                assert_eq!(lines_in(&s, color(w)), 1, "{name} engine {w}");
                assert!(texts(&s).contains(&format!("engine {w}")), "{name} {w}");
            }
            let title = format!("{name}: requests in flight per engine");
            assert!(texts(&s).iter().any(|t| t.starts_with(&title)), "{name}");
        }
        let hit = svg("hit_rate_seed1");
        for name in names {
            assert!(texts(&hit).contains(&name.to_string()), "{name}");
        }
        assert!(texts(&hit).contains(&"infinite-cache bound 70.0 %".to_string()));
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// A directory that cannot be created (a file is in the way) is an error naming it.
    #[test]
    fn an_unwritable_directory_is_an_error_naming_it() {
        let file = std::env::temp_dir().join(format!("kvroute-plot-file-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let dir = file.join("plots");
        let e = write_all(&dir, "", &[], 0.5, 1).unwrap_err();
        assert!(matches!(e, PlotError::Dir { .. }), "{e}");
        assert!(e.to_string().contains(&dir.display().to_string()), "{e}");
        std::fs::remove_file(&file).unwrap();
    }
}
