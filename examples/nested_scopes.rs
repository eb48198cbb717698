//! `gpu_scope!` nested in loops, on two streams driven by two threads at once.
//!
//! Each thread owns a stream and processes frames. Per frame, an outer scope takes a frame-sized
//! buffer; an inner loop over bands opens a nested scope per band that takes the band's source and
//! result and checks the result. Every buffer goes back at the end of its scope, so each stream's
//! stack peaks at one frame plus one band, and after the first frame nothing reaches the driver.
//!
//! `cargo run --release --example nested_scopes [-- FRAMES]`

mod support;

use gpu_pool::compat::opencv::set_buffer_pool_config;
use gpu_pool::prelude::*;
use support::Stages;
use support::kernels::pattern;

const ROWS: usize = 2048;
const COLS: usize = 2048;
const BANDS: usize = 8;
const BAND_ROWS: usize = ROWS / BANDS;

/// One frame on `stream`: the number of pixels that differ from the CPU reference.
fn frame(stages: &Stages, stream: &Stream, seed: i32) -> Result<usize, PoolError> {
    gpu_scope!(stream, {
        let mut whole = buffer!(ROWS, COLS; u8)?;
        stages.fill_pattern(stream, whole.view_mut(), seed)?;
        let mut wrong = 0;
        let mut host = vec![0u8; BAND_ROWS * COLS];
        for band in 0..BANDS {
            let band_seed = seed + band as i32;
            gpu_scope!(stream, {
                let mut src = buffer!(BAND_ROWS, COLS; u8)?;
                let mut dst = buffer!(BAND_ROWS, COLS; u8)?;
                stages.fill_pattern(stream, src.view_mut(), band_seed)?;
                stages.invert(stream, src.view(), dst.view_mut())?;
                dst.download(&mut host)?;
                wrong += host
                    .chunks(COLS)
                    .enumerate()
                    .flat_map(|(y, row)| row.iter().enumerate().map(move |(x, &v)| (x, y, v)))
                    .filter(|&(x, y, v)| v != 255 - pattern(x, y, band_seed))
                    .count();
            });
        }
        let mut frame_host = vec![0u8; ROWS * COLS];
        whole.download(&mut frame_host)?;
        wrong += frame_host
            .iter()
            .enumerate()
            .filter(|&(i, &v)| v != pattern(i % COLS, i / COLS, seed))
            .count();
        Ok(wrong)
    })
}

/// What one thread saw.
struct Outcome {
    wrong: usize,
    stats: gpu_pool::observe::StreamStats,
    driver_calls_after_first_frame: u64,
}

fn run(stages: &Stages, device: &Device, frames: usize, seed: i32) -> Result<Outcome, PoolError> {
    let stream = Stream::new(device)?;
    let mut wrong = frame(stages, &stream, seed)?;
    let after_first = stream.stats().driver_alloc_calls;
    for f in 1..frames {
        wrong += frame(stages, &stream, seed + 100 * f as i32)?;
    }
    stream.synchronize()?;
    let stats = stream.stats();
    Ok(Outcome {
        wrong,
        driver_calls_after_first_frame: stats.driver_alloc_calls - after_first,
        stats,
    })
}

fn main() -> Result<(), PoolError> {
    let frames = support::count_arg(20);
    let device = Device::cuda_or_host();
    let stages = Stages::new(&device);
    // A frame (4 MiB) plus a band's two buffers (2 x 0.5 MiB) per stream, two streams.
    set_buffer_pool_config(&device, 6 << 20, 2)?;

    let start = std::time::Instant::now();
    let outcomes = std::thread::scope(|s| {
        let threads: Vec<_> = (0..2)
            .map(|t| {
                let (stages, device) = (&stages, &device);
                s.spawn(move || run(stages, device, frames, 1000 * t))
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("the worker does not panic"))
            .collect::<Result<Vec<_>, _>>()
    })?;
    let elapsed = start.elapsed();

    println!("device: {}", Stages::describe(&device));
    println!(
        "2 threads x {frames} frames of {ROWS}x{COLS}, {BANDS} nested band scopes each, in {:.1} ms",
        elapsed.as_secs_f64() * 1e3
    );
    let mut wrong = 0;
    for (t, o) in outcomes.iter().enumerate() {
        println!(
            "stream {t} (stack {}): {} stack buffers, {} fallback buffers, peak stack use {:.2} MiB, \
             its driver allocation calls after its first frame: {}",
            o.stats.stack_index.map_or("none".into(), |i| i.to_string()),
            o.stats.stack_allocations,
            o.stats.fallback_allocations.total(),
            o.stats.stack_high_water as f64 / (1 << 20) as f64,
            o.driver_calls_after_first_frame,
        );
        wrong += o.wrong;
    }
    println!("pixels differing from the CPU reference: {wrong}");
    if wrong != 0 {
        std::process::exit(1);
    }
    device.release_stack_memory()?; // the streams are gone: everything freed before exit
    Ok(())
}
