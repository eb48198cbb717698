//! The SVG charts of BENCHMARKS.md, drawn from the same run's medians.
#![allow(dead_code, reason = "each bench draws some of the kinds of chart")]

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// A value with three significant digits.
fn short(v: f64) -> String {
    match v {
        v if v >= 100.0 => format!("{v:.0}"),
        v if v >= 10.0 => format!("{v:.1}"),
        v => format!("{v:.2}"),
    }
}

/// A horizontal bar per `(label, value)`, on a log axis (the values span several decades).
pub(crate) fn log_bars(
    path: &Path,
    title: &str,
    axis: &str,
    bars: &[(String, f64)],
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(max) = bars.iter().map(|b| b.1).reduce(f64::max) else {
        return Ok(());
    };
    let min = bars.iter().map(|b| b.1).fold(f64::INFINITY, f64::min);
    let (lo, hi) = (
        10f64.powf(min.log10().floor()),
        10f64.powf((max.log10() + 0.5).ceil()), // room on the right for the last label
    );
    draw(path, title, axis, bars, (lo..hi).log_scale(), lo)
}

/// A horizontal bar per `(label, value)`, on a linear axis from 0 (values within a decade, whose
/// ratios a log axis would hide).
pub(crate) fn linear_bars(
    path: &Path,
    title: &str,
    axis: &str,
    bars: &[(String, f64)],
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(max) = bars.iter().map(|b| b.1).reduce(f64::max) else {
        return Ok(());
    };
    draw(path, title, axis, bars, 0.0..max * 1.15, 0.0)
}

fn draw<X>(
    path: &Path,
    title: &str,
    axis: &str,
    bars: &[(String, f64)],
    x: X,
    base: f64,
) -> Result<(), Box<dyn std::error::Error>>
where
    X: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    X::CoordDescType: plotters::coord::ranged1d::ValueFormatter<f64>,
{
    let height = 80 + 26 * bars.len() as u32;
    let root = SVGBackend::new(path, (960, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let rows = bars.len() as i32;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(260)
        .build_cartesian_2d(x, (0..rows - 1).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc(axis)
        .x_label_formatter(&|v| format!("{v}"))
        .y_labels(bars.len())
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => bars
                .get((rows - 1 - i) as usize)
                .map(|b| b.0.clone())
                .unwrap_or_default(),
            _ => String::new(),
        })
        .draw()?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (label, v))| {
        let row = rows - 1 - i as i32;
        let color = if label.contains("stack_pool") || label.starts_with("pool") {
            GREEN.mix(0.8)
        } else {
            BLUE.mix(0.6)
        };
        let mut bar = Rectangle::new(
            [
                (base, SegmentValue::Exact(row)),
                (*v, SegmentValue::Exact(row + 1)),
            ],
            color.filled(),
        );
        bar.set_margin(3, 3, 0, 0);
        bar
    }))?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
        let row = rows - 1 - i as i32;
        Text::new(
            format!(" {}", short(*v)),
            (*v, SegmentValue::CenterOf(row)),
            TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Left, VPos::Center)),
        )
    }))?;
    root.present()?;
    Ok(())
}
