//! `frame`: a video-style frame pipeline. Per frame: a BGR frame is uploaded from page-locked
//! host memory, converted to grey, blurred with a 3x3 box filter and thresholded to a binary
//! image, which is downloaded into page-locked host memory; one synchronize a frame. Two input
//! frames alternate (a decoder's double buffer); 200 frames a round, at 1920x1080 and at 640x480.
//!
//! This module holds what both twins share: the sizes, the test frames, the kernels (one nvrtc
//! source) with their launch configuration, the CPU reference and the check. `pooled.rs` is the
//! gpu-pool twin, `plain.rs` the cudarc twin.

mod host;
mod plain;
pub mod pooled;

use std::error::Error;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use gpu_pool::interop::cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use gpu_pool::prelude::*;
use gpu_pool::{interop::PITCHED_H, interop::grid_2d};

use crate::harness;

/// A frame's shape: `rows x cols` pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size {
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}

impl Size {
    /// Pixels of a frame.
    pub fn pixels(self) -> usize {
        self.rows * self.cols
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.cols, self.rows)
    }
}

/// The sizes measured on a GPU, one table row each.
pub const SIZES: [Size; 2] = [
    Size {
        rows: 1080,
        cols: 1920,
    },
    Size {
        rows: 480,
        cols: 640,
    },
];
/// Frames a round on a GPU.
pub const FRAMES: usize = 200;
/// Frames each twin runs in the check pass (both input frames, each twice).
pub const CHECKED: usize = 4;
/// The host backend's size (CI, debug builds): odd, so no row is a multiple of anything.
pub const HOST_SIZE: Size = Size { rows: 45, cols: 67 };
/// The threshold: grey levels above it become 255, the others 0.
pub const THRESHOLD: u8 = 100;

/// Test frame `seed` (0 or 1) of `size`: a checkerboard of 60-pixel squares (strong edges) over a
/// texture that differs by channel, so the grey conversion, the blur and the threshold all have
/// work that a wrong kernel would get wrong.
pub fn test_frame(size: Size, seed: usize) -> Vec<[u8; 3]> {
    (0..size.pixels())
        .map(|i| {
            let (y, x) = (i / size.cols, i % size.cols);
            let base = (x / 60 + y / 60 + seed) % 2 * 120 + (x * 3 + y * 5 + seed * 17) % 50;
            let tex = (x * y + seed) % 7;
            [
                (base + tex) as u8,
                (base + x % 30) as u8,
                (base ^ (y % 64)) as u8,
            ]
        })
        .collect()
}

/// The kernels, in CUDA C++ after `PITCHED_H`: one thread a pixel, neighbours clamped at the
/// edges, integer arithmetic only (so the CPU reference matches bit for bit).
pub const SOURCE: &str = r#"
#define PIXEL unsigned x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y * blockDim.y + threadIdx.y; \
    if (!dst.contains(y, x)) return;
// BT.601 luma in fixed point, as OpenCV's cvtColor(BGR2GRAY).
extern "C" __global__ void bgr_to_gray(Pitched<const uchar3> src, Pitched<unsigned char> dst) {
    PIXEL
    uchar3 p = src(y, x);
    dst(y, x) = (unsigned char)((p.x * 1868u + p.y * 9617u + p.z * 4899u + (1u << 13)) >> 14);
}
// The rounded mean of the 3x3 neighbourhood.
extern "C" __global__ void box3(Pitched<const unsigned char> src, Pitched<unsigned char> dst) {
    PIXEL
    unsigned l = x > 0 ? x - 1 : 0, r = min(x + 1, (unsigned)dst.cols - 1);
    unsigned u = y > 0 ? y - 1 : 0, d = min(y + 1, (unsigned)dst.rows - 1);
    unsigned sum = src(u, l) + src(u, x) + src(u, r) + src(y, l) + src(y, x) + src(y, r)
                 + src(d, l) + src(d, x) + src(d, r);
    dst(y, x) = (unsigned char)((sum + 4) / 9);
}
extern "C" __global__ void threshold(Pitched<const unsigned char> src, Pitched<unsigned char> dst, unsigned char t) {
    PIXEL
    dst(y, x) = src(y, x) > t ? 255 : 0;
}
"#;

/// The compiled kernels of [`SOURCE`].
#[derive(Debug)]
pub struct Kernels {
    /// `bgr_to_gray(src, dst)`.
    pub bgr_to_gray: CudaFunction,
    /// `box3(src, dst)`.
    pub box3: CudaFunction,
    /// `threshold(src, dst, t)`.
    pub threshold: CudaFunction,
}

impl Kernels {
    /// Compiles [`SOURCE`] with nvrtc and loads it into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, PoolError> {
        let ptx = gpu_pool::interop::cudarc::nvrtc::compile_ptx(format!("{PITCHED_H}{SOURCE}"))?;
        let module = ctx.load_module(ptx)?;
        Ok(Kernels {
            bgr_to_gray: module.load_function("bgr_to_gray")?,
            box3: module.load_function("box3")?,
            threshold: module.load_function("threshold")?,
        })
    }
}

/// The launch of every kernel over a `size` frame: one thread a pixel.
pub fn grid(size: Size) -> Result<LaunchConfig, PoolError> {
    grid_2d(size.rows, size.cols)
}

/// CPU twin of `bgr_to_gray`.
pub fn gray_of([b, g, r]: [u8; 3]) -> u8 {
    ((u32::from(b) * 1868 + u32::from(g) * 9617 + u32::from(r) * 4899 + (1 << 13)) >> 14) as u8
}

/// CPU twin of `box3` at `(y, x)` of `src` (`rows x cols`, row-major).
pub fn box3_at(src: &[u8], (rows, cols): (usize, usize), (y, x): (usize, usize)) -> u8 {
    let mut sum = 4u32;
    for v in [y.saturating_sub(1), y, (y + 1).min(rows - 1)] {
        for u in [x.saturating_sub(1), x, (x + 1).min(cols - 1)] {
            sum += u32::from(src[v * cols + u]);
        }
    }
    (sum / 9) as u8
}

/// CPU twin of `threshold`.
pub fn threshold_of(v: u8, t: u8) -> u8 {
    if v > t { 255 } else { 0 }
}

/// The pipeline on the CPU: the binary image of `frame`.
pub fn reference(frame: &[[u8; 3]], size: Size) -> Vec<u8> {
    let gray: Vec<u8> = frame.iter().map(|&p| gray_of(p)).collect();
    (0..size.pixels())
        .map(|i| {
            let blurred = box3_at(
                &gray,
                (size.rows, size.cols),
                (i / size.cols, i % size.cols),
            );
            threshold_of(blurred, THRESHOLD)
        })
        .collect()
}

/// Pixels of `got` that differ from `expected` (every pixel, if the lengths differ).
pub fn differences(got: &[u8], expected: &[u8]) -> usize {
    if got.len() != expected.len() {
        return expected.len().max(got.len());
    }
    got.iter().zip(expected).filter(|(g, e)| g != e).count()
}

/// What a timed frame does with its output: reads a pixel, as a consumer of the frame would.
fn touch(_: usize, out: &[u8]) {
    std::hint::black_box(out[out.len() / 2]);
}

/// Runs `frames` frames of the gpu-pool twin on `device` at `size` (the CPU twins of the kernels
/// where there is no CUDA) and returns how many pixels differ from the reference, over all of
/// them: the host backend's run, and the test's.
pub fn run_on_host(device: &Device, size: Size, frames: usize) -> Result<usize, Box<dyn Error>> {
    let stream = Stream::new(device)?;
    let mut io = pooled::Frames::new(device, size)?;
    let expected = [0, 1].map(|seed| reference(&test_frame(size, seed), size));
    let mut wrong = 0;
    pooled::run(&stream, None, &mut io, size, frames, |i, out| {
        wrong += differences(out, &expected[i % 2]);
    })?;
    println!("gpu-pool {size}: {wrong} pixels differ from the CPU reference over {frames} frames");
    Ok(wrong)
}

/// The app: on CUDA, checks both twins at each size, then times them interleaved and prints a
/// table row a size; on the host backend, checks the gpu-pool twin on a few small frames.
pub fn main() -> Result<(), Box<dyn Error>> {
    let device = Device::cuda_or_host();
    let Ok(ctx) = device.cudarc().cloned() else {
        let wrong = run_on_host(&device, HOST_SIZE, CHECKED)?;
        if wrong != 0 {
            return Err(format!("gpu-pool: {wrong} pixels differ from the CPU reference").into());
        }
        println!("host backend: gpu-pool twin checked, no cudarc twin (needs CUDA)");
        return Ok(());
    };
    // SAFETY: before any cudarc slice exists. Every cudarc slice of the cudarc twin is made, used
    // and freed on its one stream; gpu-pool's memory does not use cudarc's events.
    unsafe { ctx.disable_event_tracking() };
    ctx.bind_to_thread()?;
    let kernels = Kernels::load(&ctx)?;
    let stream = Stream::new(&device)?;
    let rounds = harness::rounds_arg(9);
    for size in SIZES {
        measure(&stream, &ctx, &kernels, size, rounds)?;
    }
    Ok(())
}

/// One size: both twins checked, warmed up and timed, and the table row.
fn measure(
    stream: &Stream,
    ctx: &Arc<CudaContext>,
    k: &Kernels,
    size: Size,
    rounds: usize,
) -> Result<(), Box<dyn Error>> {
    let device = stream.device();
    let expected = [0, 1].map(|seed| reference(&test_frame(size, seed), size));
    let mut io = pooled::Frames::new(device, size)?;
    let mut twin = plain::Twin::new(ctx, size)?;

    let mut wrong = 0;
    pooled::run(stream, Some(k), &mut io, size, CHECKED, |i, out| {
        wrong += differences(out, &expected[i % 2]);
    })?;
    let mut wrong_plain = 0;
    twin.run(k, CHECKED, |i, out| {
        wrong_plain += differences(out, &expected[i % 2]);
    })?;
    println!(
        "{size}: pixels that differ from the CPU reference over {CHECKED} frames: gpu-pool {wrong}, cudarc {wrong_plain}"
    );
    if wrong != 0 || wrong_plain != 0 {
        return Err(format!("{size}: a twin computes the wrong binary image").into());
    }
    // Warm-up: one round each.
    pooled::run(stream, Some(k), &mut io, size, FRAMES, touch)?;
    twin.run(k, FRAMES, touch)?;

    let before = device.stats().driver_alloc_calls;
    let calls_0 = std::cell::Cell::new(gpu_pool::observe::DriverCalls::default());
    let (pooled_us, plain_us) = harness::interleave(
        rounds,
        || -> Result<_, Box<dyn Error>> {
            let start = Instant::now();
            let counted = gpu_pool::observe::DriverCalls::on_this_thread();
            pooled::run(stream, Some(k), &mut io, size, FRAMES, touch)?;
            calls_0.set(
                calls_0.get() + gpu_pool::observe::DriverCalls::on_this_thread().since(counted),
            );
            Ok((start.elapsed(), FRAMES))
        },
        || {
            let start = Instant::now();
            twin.run(k, FRAMES, touch)?;
            Ok((start.elapsed(), FRAMES))
        },
    )?;
    harness::print_calls_per_unit(calls_0.get(), FRAMES * rounds, "frame");
    let alloc_calls = device.stats().driver_alloc_calls - before;
    println!(
        "gpu-pool driver allocation calls during the timed rounds: {alloc_calls}{}",
        if alloc_calls == 0 {
            ""
        } else {
            " (expected 0 after warm-up)"
        }
    );
    println!(
        "driver asks per frame: gpu-pool {:.2} allocation calls; cudarc 0 allocation calls (its \
         buffers are made once), and for each pinned copy a cuStreamWaitEvent and a cuEventRecord \
         (cudarc's PinnedHostSlice), plus a cuEventSynchronize to read the output",
        alloc_calls as f64 / (FRAMES * rounds).max(1) as f64,
    );
    harness::report(
        &format!("frame {size}"),
        "frame",
        (&pooled_us, &plain_us),
        (include_str!("pooled.rs"), include_str!("plain.rs")),
    );
    Ok(())
}
