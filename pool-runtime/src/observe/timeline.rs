//! Seeing the pool over time: the recordings of every device (see
//! [`Device::set_recording`](crate::Device::set_recording) or `GPU_POOL_CONF=record=N`) exported as
//! a Chrome trace, which Perfetto and `chrome://tracing` open, and as an SVG chart of each stream's
//! stack use with the stack size marked and fallbacks highlighted.
//!
//! ```
//! use gpu_pool::{compat::opencv::BufferPool, Device, observe::timeline, PoolError, Stream};
//! let device = Device::private_host();
//! device.set_recording(1000);
//! let stream = Stream::new(&device)?;
//! let pool = BufferPool::new(&stream);
//! for n in 1..=4 {
//!     let _a = pool.get_buffer::<f32>(64 * n, 64)?;
//! }
//! let trace: serde_json::Value = serde_json::from_str(&timeline::chrome_trace(&device.recordings()))
//!     .expect("the trace is JSON");
//! assert!(trace["traceEvents"].as_array().is_some_and(|e| !e.is_empty()));
//! let svg = timeline::svg(&device.recordings())?;
//! assert!(svg.contains("<svg"));
//! # Ok::<(), PoolError>(())
//! ```

use std::path::Path;

use plotters::prelude::*;
use serde_json::{Value, json};

use crate::base::error::PoolError;
use crate::base::source::Source;
use crate::core::device::all_devices;
use crate::core::record::{RecordKind, StreamRecording};

/// Every live device's recordings (live streams and the last dropped ones).
#[must_use]
pub fn recordings() -> Vec<StreamRecording> {
    all_devices().iter().flat_map(|d| d.recordings()).collect()
}

/// `recordings` as Chrome trace JSON: per stream (a thread of its device's process), a counter of
/// stack bytes in use, and an instant event per take, named for its `buffer!` and carrying its
/// bytes, source and call site. Fallbacks are in category `fallback`.
#[must_use]
pub fn chrome_trace(recordings: &[StreamRecording]) -> String {
    let mut events = Vec::new();
    let mut devices: Vec<String> = Vec::new();
    for r in recordings {
        let device = r.device.to_string();
        let pid = match devices.iter().position(|d| *d == device) {
            Some(i) => i,
            None => {
                devices.push(device.clone());
                events.push(
                    json!({"ph": "M", "name": "process_name", "pid": devices.len() - 1,
                    "args": {"name": format!("gpu-pool {device}")}}),
                );
                devices.len() - 1
            }
        };
        events.push(
            json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": r.stream,
            "args": {"name": format!("stream {}", r.stream)}}),
        );
        for e in &r.events {
            let ts = e.t_ns as f64 / 1e3;
            events.push(
                json!({"ph": "C", "name": "stack in use", "pid": pid, "tid": r.stream,
                "ts": ts, "args": {"bytes": e.stack_in_use, "mapped": e.stack_mapped}}),
            );
            if e.kind == RecordKind::Take {
                let name = e.site.and_then(|s| s.name()).unwrap_or("buffer");
                let (category, source) = match e.source {
                    Source::Fallback(reason) => ("fallback", format!("fallback: {reason}")),
                    other => ("stack", format!("{other:?}").to_lowercase()),
                };
                let site = e.site.map(|s| format!("{}:{}", s.file(), s.line()));
                events.push(json!({"ph": "i", "s": "t", "name": name, "cat": category,
                    "pid": pid, "tid": r.stream, "ts": ts,
                    "args": {"bytes": e.bytes, "offset": e.offset, "source": source, "site": site}}));
            }
        }
    }
    let trace: Value = json!({"traceEvents": events, "displayTimeUnit": "ns"});
    trace.to_string()
}

/// `recordings` as an SVG chart: stack bytes in use over time, one line per stream, the stack size
/// as a dashed line, and a red dot at every fallback.
pub fn svg(recordings: &[StreamRecording]) -> Result<String, PoolError> {
    let mut out = String::new();
    draw(recordings, &mut out).map_err(|e| PoolError::Io {
        path: "<svg>".into(),
        source: std::io::Error::other(e).into(),
    })?;
    Ok(out)
}

/// Writes [`chrome_trace`] of every device's recordings to `path`.
pub fn write_chrome_trace(path: impl AsRef<Path>) -> Result<(), PoolError> {
    write(path.as_ref(), &chrome_trace(&recordings()))
}

/// Writes [`svg`] of every device's recordings to `path`.
pub fn write_svg(path: impl AsRef<Path>) -> Result<(), PoolError> {
    write(path.as_ref(), &svg(&recordings())?)
}

fn write(path: &Path, text: &str) -> Result<(), PoolError> {
    std::fs::write(path, text).map_err(|e| PoolError::Io {
        path: path.display().to_string(),
        source: e.into(),
    })
}

const MIB: f64 = (1u64 << 20) as f64;

/// A step line through `points`: each value holds until the next event.
fn steps(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    let mut steps: Vec<(f64, f64)> = Vec::with_capacity(points.len() * 2);
    for (t, v) in points {
        if let Some(&(_, last)) = steps.last() {
            steps.push((t, last));
        }
        steps.push((t, v));
    }
    steps
}

fn draw(
    recordings: &[StreamRecording],
    out: &mut String,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let points = |r: &StreamRecording| -> Vec<(f64, f64)> {
        r.events
            .iter()
            .map(|e| (e.t_ns as f64 / 1e6, e.stack_in_use as f64 / MIB))
            .collect()
    };
    let all: Vec<(f64, f64)> = recordings.iter().flat_map(points).collect();
    let (t0, t1) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (t0, t1) = if all.is_empty() {
        (0.0, 1.0)
    } else {
        (t0, t1.max(t0 + 1e-3))
    };
    // A growable stack's size is its reservation (the device's memory): its mapped bytes are
    // drawn instead, as a dashed step line of the stream's color.
    let growable = |r: &StreamRecording| r.events.iter().any(|e| e.stack_mapped != r.stack_size);
    let mapped = |r: &StreamRecording| -> Vec<(f64, f64)> {
        r.events
            .iter()
            .map(|e| (e.t_ns as f64 / 1e6, e.stack_mapped as f64 / MIB))
            .collect()
    };
    let stack = recordings
        .iter()
        .filter(|r| !growable(r))
        .map(|r| r.stack_size)
        .max()
        .unwrap_or(0) as f64
        / MIB;
    let top = all
        .iter()
        .map(|p| p.1)
        .chain(
            recordings
                .iter()
                .filter(|r| growable(r))
                .flat_map(mapped)
                .map(|p| p.1),
        )
        .fold(stack, f64::max)
        .max(1e-3)
        * 1.1;
    {
        let root = SVGBackend::with_string(out, (960, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("gpu-pool: stack use per stream", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(t0..t1, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("milliseconds")
            .y_desc("MiB of stack in use")
            .draw()?;
        if stack > 0.0 {
            chart
                .draw_series(DashedLineSeries::new(
                    [(t0, stack), (t1, stack)],
                    8,
                    6,
                    BLACK.stroke_width(1),
                ))?
                .label(format!("stack size ({stack:.2} MiB)"))
                .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK));
        }
        for (i, r) in recordings.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(steps(points(r)), color.stroke_width(2)))?
                .label(format!("stream {} ({})", r.stream, r.device))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
            if growable(r) {
                chart
                    .draw_series(DashedLineSeries::new(
                        steps(mapped(r)),
                        6,
                        4,
                        color.stroke_width(1),
                    ))?
                    .label(format!("stream {} mapped", r.stream))
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
            }
            let fallbacks = r
                .events
                .iter()
                .filter(|e| e.kind == RecordKind::Take && matches!(e.source, Source::Fallback(_)));
            chart.draw_series(fallbacks.map(|e| {
                let at = (e.t_ns as f64 / 1e6, e.stack_in_use as f64 / MIB);
                Circle::new(at, 4, RED.filled())
            }))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
        root.present()?;
    }
    Ok(())
}
