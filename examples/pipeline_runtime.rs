//! The `pipeline` example written against the runtime API instead of the DSL: the temporaries are
//! taken with `BufferPool::get_buffer`, as OpenCV's `BufferPool` code takes them, and released in
//! reverse order by scope (here the loop body's end). Same loop, same checks.
//!
//! `cargo run --release --example pipeline_runtime [-- ITERATIONS]`

mod support;

use gpu_pool::compat::opencv::set_buffer_pool_config;
use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::prelude::*;
use support::Stages;

const ROWS: usize = 4096;
const COLS: usize = 4096;

fn main() -> Result<(), PoolError> {
    let iterations = support::count_arg(10);
    let device = Device::cuda_or_host();
    let stages = Stages::new(&device);
    // 64 MiB holds the gray image (16 MiB) and the thresholded one (16 MiB) twice over.
    set_buffer_pool_config(&device, 64 << 20, 1)?;
    let stream = Stream::new(&device)?;
    let pool = BufferPool::new(&stream);

    let image: Vec<[u8; 3]> = (0..ROWS * COLS)
        .map(|i| [(i % 251) as u8, (i / COLS % 241) as u8, (i * 7 % 239) as u8])
        .collect();
    let src = GpuMat::from_host(&stream, ROWS, COLS, &image)?;
    let mut out = vec![0u8; ROWS * COLS];

    let start = std::time::Instant::now();
    let mut calls_after_first = 0;
    for i in 0..iterations {
        let mut gray = pool.get_buffer::<u8>(ROWS, COLS)?;
        let mut binary = pool.get_buffer::<u8>(ROWS, COLS)?;
        stages.bgr_to_gray(&stream, src.view(), gray.view_mut())?;
        stages.threshold(&stream, gray.view(), binary.view_mut(), 128)?;
        if i == iterations - 1 {
            binary.download(&mut out)?;
        }
        if i == 0 {
            calls_after_first = device.stats().driver_alloc_calls;
        }
    }
    stream.synchronize()?;
    let elapsed = start.elapsed();

    support::report_seed_loop(
        &device,
        &stream,
        (&image, &out),
        (ROWS, COLS),
        (iterations, elapsed),
        calls_after_first,
    );
    drop(src);
    drop(stream);
    device.release_stack_memory()?; // everything freed before exit, as a leak checker wants
    Ok(())
}
