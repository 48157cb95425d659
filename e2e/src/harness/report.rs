//! The gate's figures: per-figure summaries, the summary table and the SVG plot.

use std::path::Path;

use plotters::prelude::*;

use crate::testing::percentile;

#[derive(Debug, Clone, Copy, Default)]
pub struct Summary {
    pub n: usize,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

pub fn summarize(v: &[f64]) -> Summary {
    if v.is_empty() {
        return Summary::default();
    }
    Summary {
        n: v.len(),
        median: percentile(v, 50.0).unwrap_or(0.0),
        p90: percentile(v, 90.0).unwrap_or(0.0),
        p99: percentile(v, 99.0).unwrap_or(0.0),
        max: percentile(v, 100.0).unwrap_or(0.0),
    }
}

/// One table row: label, n, median, p90, p99, max.
pub fn row(label: &str, v: &[f64], decimals: usize) -> String {
    let s = summarize(v);
    if s.n == 0 {
        return format!("{label:<44} {:>4}  {:>9} {:>9} {:>9} {:>9}", 0, "-", "-", "-", "-");
    }
    let f = |x: f64| format!("{x:.decimals$}");
    format!("{label:<44} {:>4}  {:>9} {:>9} {:>9} {:>9}", s.n, f(s.median), f(s.p90), f(s.p99), f(s.max))
}

pub fn header() -> String {
    format!("{:<44} {:>4}  {:>9} {:>9} {:>9} {:>9}", "figure", "n", "median", "p90", "p99", "max")
}

/// The gap distribution of each mode as an empirical CDF on a log time axis (the modes
/// differ by orders of magnitude), written as SVG.
pub fn plot(path: &Path, title: &str, series: &[(String, Vec<f64>)]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    let ms: Vec<(String, Vec<f64>)> = series
        .iter()
        .map(|(name, v)| {
            let mut v: Vec<f64> = v.iter().map(|s| (s * 1000.0).max(0.1)).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            (name.clone(), v)
        })
        .collect();
    let all = ms.iter().flat_map(|(_, v)| v.iter().copied());
    let lo = all.clone().fold(f64::INFINITY, f64::min);
    let hi = all.fold(0.0f64, f64::max);
    let (lo, hi) = if lo.is_finite() { (lo / 1.5, hi * 1.5) } else { (1.0, 1000.0) };
    let (lo, hi) = (lo.max(0.05), hi.max(lo * 10.0));

    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0f64..1.0f64)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("gap: Envoy control_plane.connected_state = 0 (ms, log scale)")
        .y_desc("fraction of rolls with gap <= x")
        .draw()
        .map_err(|e| err(&e))?;
    let colors = [RGBColor(31, 119, 180), RGBColor(214, 39, 40), RGBColor(44, 160, 44), RGBColor(148, 103, 189)];
    for (i, (name, v)) in ms.iter().enumerate() {
        if v.is_empty() {
            continue;
        }
        let color = colors[i % colors.len()];
        let n = v.len() as f64;
        // A step function: the fraction jumps at each sample.
        let mut pts = vec![(lo, 0.0)];
        for (k, x) in v.iter().enumerate() {
            pts.push((*x, k as f64 / n));
            pts.push((*x, (k + 1) as f64 / n));
        }
        pts.push((hi, 1.0));
        let s = summarize(&series[i].1);
        let label = format!("{name}: n={} median {:.1} ms, p99 {:.1} ms", s.n, s.median * 1000.0, s.p99 * 1000.0);
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(v.iter().enumerate().map(|(k, x)| Circle::new((*x, (k + 1) as f64 / n), 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
