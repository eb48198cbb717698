//! The seed's benchmark loop (OpenCV BufferPool article), with the DSL: a 4096x4096 BGR image
//! converted to gray and thresholded by a `#[pooled]` function whose two temporaries are
//! `buffer!`s, taken from the stream's stack at each call and given back, in reverse order, when
//! it returns. Checks the result against a plain CPU reference and reports how many driver
//! allocations the loop made after its first call. (`pipeline_runtime` is the same loop on the
//! runtime API.)
//!
//! `cargo run --release --example pipeline [-- ITERATIONS]`

mod support;

use gpu_pool::prelude::*;
use gpu_pool::set_buffer_pool_config;
use support::Stages;

const ROWS: usize = 4096;
const COLS: usize = 4096;

/// BGR -> gray -> binary, both intermediates from the stack; the binary image is downloaded into
/// `out` when one is given.
#[pooled(stream)]
fn gray_threshold(
    stream: &Stream,
    stages: &Stages,
    src: &GpuMat<'_, [u8; 3]>,
    out: Option<&mut [u8]>,
) -> Result<(), PoolError> {
    let mut gray = buffer!(src.rows(), src.cols(); u8)?;
    let mut binary = buffer!(src.rows(), src.cols(); u8)?;
    stages.bgr_to_gray(stream, src.view(), gray.view_mut())?;
    stages.threshold(stream, gray.view(), binary.view_mut(), 128)?;
    if let Some(out) = out {
        binary.download(out)?;
    }
    Ok(())
} // binary, then gray, go back to the stack: nothing reaches the driver

fn main() -> Result<(), PoolError> {
    let iterations = support::count_arg(10);
    let device = Device::cuda_or_host();
    let stages = Stages::new(&device);
    // 64 MiB holds the gray image (16 MiB) and the thresholded one (16 MiB) twice over.
    set_buffer_pool_config(&device, 64 << 20, 1)?;
    let stream = Stream::new(&device)?;

    let image: Vec<[u8; 3]> = (0..ROWS * COLS)
        .map(|i| [(i % 251) as u8, (i / COLS % 241) as u8, (i * 7 % 239) as u8])
        .collect();
    let src = GpuMat::from_host(&stream, ROWS, COLS, &image)?;
    let mut out = vec![0u8; ROWS * COLS];

    let start = std::time::Instant::now();
    let mut calls_after_first = 0;
    for i in 0..iterations {
        let last = i == iterations - 1;
        gray_threshold(&stream, &stages, &src, last.then_some(&mut out[..]))?;
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
