//! The gate's figures: per-figure summaries, the summary table and the SVG plot.

use std::path::Path;

use plotters::element::DashedPathElement;
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
        return format!(
            "{label:<44} {:>4}  {:>9} {:>9} {:>9} {:>9}",
            0, "-", "-", "-", "-"
        );
    }
    let f = |x: f64| format!("{x:.decimals$}");
    format!(
        "{label:<44} {:>4}  {:>9} {:>9} {:>9} {:>9}",
        s.n,
        f(s.median),
        f(s.p90),
        f(s.p99),
        f(s.max)
    )
}

pub fn header() -> String {
    format!(
        "{:<44} {:>4}  {:>9} {:>9} {:>9} {:>9}",
        "figure", "n", "median", "p90", "p99", "max"
    )
}

/// The seed's surge gap on kind (Proposal 041, 20 rolls under load), in seconds: the
/// figures the plot marks, so a reader sees where a run stands against the design record.
pub const SEED_SURGE_MEDIAN_S: f64 = 0.080;
pub const SEED_SURGE_P99_S: f64 = 0.242;

/// One curve of the plot: a mode's gaps, or, behind the xDS relay (where Envoy's own gap
/// is 0), the relay's time without an agent stream, drawn dashed in its mode's colour.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub values: Vec<f64>,
    pub relayed: bool,
}

/// The gap distribution of each mode as an empirical CDF on a log time axis (the modes
/// differ by orders of magnitude), written as SVG, with its references: the distribution
/// of Envoy's first ADS reconnect delay for `backoff_base_s` (dashed) and the seed's surge
/// median and p99 (marked vertical lines).
///
/// Envoy retries a closed ADS stream after `random() % interval` ms, the interval starting
/// at the retry policy's base and reset by every response received, so the first reconnect
/// after a stream that served is uniform on [0, base): a mode whose curve lies on it spends
/// its gap in Envoy's backoff, not waiting for the agent.
pub fn plot(
    path: &Path,
    title: &str,
    series: &[Series],
    backoff_base_s: f64,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    let ms: Vec<(String, Vec<f64>)> = series
        .iter()
        .map(|s| {
            let mut v: Vec<f64> = s.values.iter().map(|s| (s * 1000.0).max(0.1)).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            (s.name.clone(), v)
        })
        .collect();
    let base_ms = backoff_base_s * 1000.0;
    let (seed_median_ms, seed_p99_ms) = (SEED_SURGE_MEDIAN_S * 1000.0, SEED_SURGE_P99_S * 1000.0);
    let all = ms.iter().flat_map(|(_, v)| v.iter().copied());
    let lo = all.clone().fold(f64::INFINITY, f64::min);
    let hi = all.fold(0.0f64, f64::max);
    let (lo, hi) = if lo.is_finite() {
        (lo / 1.5, hi * 1.5)
    } else {
        (1.0, 1000.0)
    };
    // The references stay in view: the uniform curve reaching 1 at the base, and the seed's p99.
    let hi = hi.max(base_ms * 1.5).max(seed_p99_ms * 1.25);
    let (lo, hi) = (lo.max(0.05), hi.max(lo * 10.0));

    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(
            (lo..hi)
                .log_scale()
                .with_key_points(log_ticks(lo, hi))
                .with_light_points(log_grid(lo, hi)),
            0.0f64..1.0f64,
        )
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(if series.iter().any(|s| s.relayed) {
            "gap: Envoy control_plane.connected_state = 0; dashed, behind the relay (Envoy's gap 0): the relay without an agent stream (log scale)"
        } else {
            "gap: Envoy control_plane.connected_state = 0 (log scale)"
        })
        .y_desc("fraction of rolls with gap <= x")
        .x_label_formatter(&|x| fmt_ms(*x))
        .draw()
        .map_err(|e| err(&e))?;

    let reference = RGBColor(40, 40, 40);
    chart
        .draw_series(DashedLineSeries::new(
            uniform_cdf(base_ms, lo, hi, 64),
            8,
            5,
            reference.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label(format!(
            "Envoy's first ADS reconnect delay: uniform on [0, {}) (backoff base)",
            fmt_ms(base_ms)
        ))
        .legend(move |(x, y)| {
            DashedPathElement::new(vec![(x, y), (x + 20, y)], 5, 3, reference.stroke_width(2))
        });
    let seed = RGBColor(120, 120, 120);
    for (i, (x, name)) in [(seed_median_ms, "median"), (seed_p99_ms, "p99")]
        .into_iter()
        .enumerate()
    {
        let line = chart
            .draw_series(LineSeries::new([(x, 0.0), (x, 1.0)], seed.stroke_width(1)))
            .map_err(|e| err(&e))?;
        if i == 0 {
            line.label(format!(
                "seed surge on kind (Proposal 041): median {}, p99 {}",
                fmt_ms(seed_median_ms),
                fmt_ms(seed_p99_ms)
            ))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x + 10, y - 6), (x + 10, y + 6)], seed.stroke_width(1))
            });
        }
        // Written up the line from its foot, where the CDFs (near 1 by then) leave room.
        let (px, py) = chart.backend_coord(&(x, 0.03));
        root.draw(&Text::new(
            format!("seed {name} {}", fmt_ms(x)),
            (px - 3, py),
            ("sans-serif", 12)
                .into_font()
                .transform(FontTransform::Rotate270)
                .color(&seed),
        ))
        .map_err(|e| err(&e))?;
    }

    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
    ];
    // A relayed curve takes the colour of the curve before it (its mode without the
    // relay, side by side) or, alone, the next one.
    let mut color_of: Vec<usize> = Vec::with_capacity(ms.len());
    for (i, s) in series.iter().enumerate() {
        let c = match (s.relayed, i.checked_sub(1)) {
            (true, Some(p)) if !series[p].relayed => color_of[p],
            _ => color_of.last().map_or(0, |c: &usize| c + 1),
        };
        color_of.push(c);
    }
    for (i, (name, v)) in ms.iter().enumerate() {
        if v.is_empty() {
            continue;
        }
        let color = colors[color_of[i] % colors.len()];
        let dashed = series[i].relayed;
        let n = v.len() as f64;
        // A step function: the fraction jumps at each sample.
        let mut pts = vec![(lo, 0.0)];
        for (k, x) in v.iter().enumerate() {
            pts.push((*x, k as f64 / n));
            pts.push((*x, (k + 1) as f64 / n));
        }
        pts.push((hi, 1.0));
        let s = summarize(&series[i].values);
        let label = format!(
            "{name}: n={} median {:.1} ms, p99 {:.1} ms",
            s.n,
            s.median * 1000.0,
            s.p99 * 1000.0
        );
        if dashed {
            chart
                .draw_series(DashedLineSeries::new(pts, 6, 4, color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(label)
                .legend(move |(x, y)| {
                    DashedPathElement::new(vec![(x, y), (x + 20, y)], 4, 3, color.stroke_width(2))
                });
        } else {
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        // Filled dots for the gaps, hollow ones behind the relay.
        let dot = if dashed {
            color.stroke_width(1)
        } else {
            color.filled()
        };
        chart
            .draw_series(
                v.iter()
                    .enumerate()
                    .map(|(k, x)| Circle::new((*x, (k + 1) as f64 / n), 3, dot)),
            )
            .map_err(|e| err(&e))?;
    }
    // Upper left: a CDF's empty corner, clear of the seed's lines on the right.
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Points of the uniform CDF on [0, `base`) over [`lo`, `hi`], `n` of them spaced evenly
/// on the log axis below `base`, so the curve is smooth where it is drawn.
pub fn uniform_cdf(base: f64, lo: f64, hi: f64, n: usize) -> Vec<(f64, f64)> {
    let mut pts = Vec::with_capacity(n + 2);
    if base > lo {
        let top = base.min(hi);
        let step = (top / lo).ln() / n.max(1) as f64;
        pts.extend((0..=n.max(1)).map(|k| {
            let x = if k == n.max(1) {
                top
            } else {
                lo * (step * k as f64).exp()
            };
            (x, x / base)
        }));
    } else {
        pts.push((lo, 1.0));
    }
    if hi > base {
        pts.push((hi, 1.0));
    }
    pts
}

/// The labelled ticks of a log axis over [`lo`, `hi`]: 1, 2 and 5 of each decade while the
/// axis spans at most three decades, else the decades alone, so that labels never crowd.
pub fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let steps: &[f64] = if hi / lo <= 1000.0 {
        &[1.0, 2.0, 5.0]
    } else {
        &[1.0]
    };
    decade_multiples(lo, hi, steps)
}

/// The unlabelled grid lines of a log axis: 1 to 9 of each decade.
pub fn log_grid(lo: f64, hi: f64) -> Vec<f64> {
    decade_multiples(lo, hi, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
}

fn decade_multiples(lo: f64, hi: f64, steps: &[f64]) -> Vec<f64> {
    if !(lo > 0.0 && hi > lo) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut decade = 10f64.powi(lo.log10().floor() as i32);
    while decade <= hi {
        for s in steps {
            // Rounded so that 0.1 * 3 is 0.3, and labels and equality checks stay exact.
            let x = round_sig(decade * s);
            if x >= lo && x <= hi {
                out.push(x);
            }
        }
        decade *= 10.0;
    }
    out
}

fn round_sig(x: f64) -> f64 {
    let scale = 10f64.powi(6 - x.log10().floor() as i32);
    (x * scale).round() / scale
}

/// A time in milliseconds as an axis or legend label: "0.5 ms", "20 ms", "1 s", "2.5 s".
pub fn fmt_ms(ms: f64) -> String {
    let trim = |v: f64| {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    };
    if ms >= 1000.0 {
        format!("{} s", trim(ms / 1000.0))
    } else {
        format!("{} ms", trim(ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_cdf_is_x_over_base_up_to_base_then_one() {
        let pts = uniform_cdf(100.0, 1.0, 1000.0, 8);
        assert_eq!(pts.first(), Some(&(1.0, 0.01)));
        assert_eq!(
            pts[pts.len() - 2],
            (100.0, 1.0),
            "the curve reaches 1 at the base: {pts:?}"
        );
        assert_eq!(pts.last(), Some(&(1000.0, 1.0)));
        for w in pts.windows(2) {
            assert!(
                w[0].0 < w[1].0 && w[0].1 <= w[1].1,
                "not increasing: {pts:?}"
            );
        }
        for (x, y) in &pts[..pts.len() - 1] {
            assert!((y - x / 100.0).abs() < 1e-12, "({x}, {y}) is off x/base");
        }
        // Log-spaced: equal ratios between neighbours below the base.
        let r0 = pts[1].0 / pts[0].0;
        assert!((pts[5].0 / pts[4].0 - r0).abs() < 1e-9, "{pts:?}");
    }

    #[test]
    fn uniform_cdf_of_a_base_outside_the_axis() {
        assert_eq!(
            uniform_cdf(0.5, 1.0, 10.0, 8),
            vec![(1.0, 1.0), (10.0, 1.0)]
        );
        let cut = uniform_cdf(100.0, 1.0, 50.0, 4);
        assert_eq!(
            cut.last(),
            Some(&(50.0, 0.5)),
            "cut at the axis' end: {cut:?}"
        );
    }

    #[test]
    fn ticks_are_1_2_5_over_few_decades_and_decades_over_many() {
        assert_eq!(
            log_ticks(3.0, 400.0),
            vec![5.0, 10.0, 20.0, 50.0, 100.0, 200.0]
        );
        assert_eq!(
            log_ticks(0.07, 30.0),
            vec![0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0]
        );
        assert_eq!(
            log_ticks(0.3, 20000.0),
            vec![1.0, 10.0, 100.0, 1000.0, 10000.0]
        );
        assert!(log_ticks(10.0, 10.0).is_empty());
    }

    /// The labels near 100 ms used to overlap: no two labelled ticks may be closer than
    /// a label's width on the plot's axis (about 800 px for the span).
    #[test]
    fn labelled_ticks_leave_room_for_their_labels() {
        for (lo, hi) in [
            (20.0, 160.0),
            (3.0, 400.0),
            (0.5, 400.0),
            (0.07, 15000.0),
            (1.0, 1.0e6),
        ] {
            let t = log_ticks(lo, hi);
            assert!(t.len() >= 2, "{lo}..{hi}: {t:?}");
            let px = |x: f64| (x / lo).log10() / (hi / lo).log10() * 800.0;
            for w in t.windows(2) {
                let gap = px(w[1]) - px(w[0]);
                let width = 7.0 * fmt_ms(w[0]).len().max(fmt_ms(w[1]).len()) as f64;
                assert!(
                    gap > width,
                    "{lo}..{hi}: {} and {} are {gap:.0} px apart",
                    w[0],
                    w[1]
                );
            }
        }
    }

    #[test]
    fn grid_has_every_integer_multiple_in_range() {
        assert_eq!(
            log_grid(25.0, 110.0),
            vec![30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]
        );
        assert_eq!(log_grid(0.25, 0.45), vec![0.3, 0.4]);
    }

    /// The drawn plot, read back: both references are there, and the x-axis labels neither
    /// repeat nor crowd (they overlapped near 100 ms with plotters' own log ticks).
    #[test]
    fn plot_draws_the_references_and_spaced_x_labels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gap.svg");
        // Under two decades from 5 ms: plotters' own ticks would be 10, 20, ... 90, 100 ms.
        let spread = |from: f64, to: f64| {
            (0..20)
                .map(|k| from + (to - from) * k as f64 / 19.0)
                .collect::<Vec<_>>()
        };
        let one = |name: &str, values: Vec<f64>, relayed: bool| Series {
            name: name.to_string(),
            values,
            relayed,
        };
        let series = vec![
            one("surge", spread(0.008, 0.099), false),
            one("surge, relay", spread(0.0005, 0.002), true),
            one("recreate", spread(0.020, 0.120), false),
            one("worker-crash", spread(0.012, 0.101), false),
        ];
        plot(&path, "gap", &series, 0.1).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        for want in [
            "uniform on [0, 100 ms) (backoff base)",
            "seed median 80 ms",
            "seed p99 242 ms",
            "median 80 ms, p99 242 ms",
            "surge, relay: n=20",
        ] {
            assert!(svg.contains(want), "no {want:?} in {}", path.display());
        }
        let labels = x_labels(&svg);
        let texts: Vec<&str> = labels.iter().map(|(_, t)| t.as_str()).collect();
        assert!(
            texts.contains(&"100 ms") && texts.contains(&"10 ms"),
            "x labels: {texts:?}"
        );
        for w in labels.windows(2) {
            let width = 7.0 * w[0].1.len().max(w[1].1.len()) as f64;
            assert!(
                w[1].0 - w[0].0 > width,
                "x labels {:?} and {:?} overlap",
                w[0],
                w[1]
            );
        }
    }

    /// The x-axis tick labels of a plotters SVG: the texts on the row just below the plot
    /// whose text ends in a time unit, as (x, text), left to right.
    fn x_labels(svg: &str) -> Vec<(f64, String)> {
        let attr = |tag: &str, name: &str| -> Option<f64> {
            let at = tag.find(&format!(" {name}=\""))? + name.len() + 3;
            tag[at..].split('"').next()?.parse().ok()
        };
        let mut out: Vec<(f64, f64, String)> = svg
            .split("<text")
            .skip(1)
            .filter_map(|t| {
                let (tag, rest) = t.split_once('>')?;
                let text = rest.split('<').next()?.trim().to_string();
                if !(text.ends_with(" ms") || text.ends_with(" s")) || tag.contains("rotate") {
                    return None;
                }
                Some((attr(tag, "y")?, attr(tag, "x")?, text))
            })
            .collect();
        let row = out.iter().map(|(y, _, _)| *y).fold(0.0f64, f64::max);
        out.retain(|(y, _, _)| *y == row);
        out.sort_by(|a, b| a.1.total_cmp(&b.1));
        out.into_iter().map(|(_, x, t)| (x, t)).collect()
    }

    #[test]
    fn ms_labels() {
        for (ms, want) in [
            (0.5, "0.5 ms"),
            (1.0, "1 ms"),
            (20.0, "20 ms"),
            (242.0, "242 ms"),
            (1000.0, "1 s"),
            (2500.0, "2.5 s"),
            (10000.0, "10 s"),
        ] {
            assert_eq!(fmt_ms(ms), want);
        }
    }
}
