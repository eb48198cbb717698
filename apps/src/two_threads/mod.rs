//! `two_threads`: two threads, each with a stream of its own and nothing shared, each running a
//! loop of small pooled steps whose temporaries change size every step. A step of `n` floats
//! (64Ki to 1Mi): `y = a * (i % 1024) + b`; `z = y * y`; 64 block sums of `z` into a short vector,
//! downloaded into a `Vec`. Three temporaries a step (`y`, `z`, the sums).
//!
//! This module holds what both twins share: the step lists, the kernels (one nvrtc source) with
//! their launch configurations, the CPU twins, the f64 reference and the check. `pooled.rs` is the
//! gpu-pool twin, `plain.rs` the cudarc twin.

mod host;
mod plain;
pub mod pooled;

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use gpu_pool::interop::cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use gpu_pool::prelude::*;

use crate::harness;

/// Blocks of the reduction, and so floats of a step's result.
pub const PARTS: usize = 64;
/// Threads a block, in every kernel.
pub const BLOCK: usize = 256;
/// Threads, one stream each.
pub const THREADS: usize = 2;
/// The largest relative difference from the f64 reference a twin may have.
pub const TOLERANCE: f64 = 1e-4;

/// The steps' sizes.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Steps a thread.
    pub steps: usize,
    /// The smallest and largest `n`.
    pub n: (usize, usize),
}

impl Config {
    /// On a GPU: 300 steps a thread, `n` from 64Ki to 1Mi floats.
    pub const FULL: Config = Config {
        steps: 300,
        n: (64 << 10, 1 << 20),
    };
    /// A few small steps, for the host backend (CI, debug builds).
    pub const HOST: Config = Config {
        steps: 12,
        n: (1000, 40_000),
    };
}

/// One step: `n` floats through the pipeline, with the affine stage's `a` and `b`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    /// Floats.
    pub n: usize,
    /// The affine stage's slope.
    pub a: f32,
    /// The affine stage's offset.
    pub b: f32,
}

/// Thread `thread`'s step list, the same on every run (each thread its own).
pub fn steps(cfg: &Config, thread: usize) -> Vec<Step> {
    let mut state = 0x2545_F491_4F6C_DD1D_u64 ^ (thread as u64 + 1).wrapping_mul(0x9E37_79B9);
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11
    };
    (0..cfg.steps)
        .map(|_| {
            let span = (cfg.n.1 - cfg.n.0 + 1) as u64;
            let unit = |v: u64| (v % 1000) as f32 / 1000.0;
            Step {
                n: cfg.n.0 + (next() % span) as usize,
                a: (0.5 + unit(next())) / 1024.0,
                b: unit(next()) - 0.75,
            }
        })
        .collect()
}

/// The kernels, in CUDA C. `affine` and `square` take one thread an element ([`elementwise`]);
/// `block_sum` takes [`PARTS`] blocks of [`BLOCK`] threads ([`reduction`]), which stride over `z`.
pub const SOURCE: &str = r#"
extern "C" __global__ void affine(float* y, int n, float a, float b) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaf(a, (float)(i % 1024), b);
}
extern "C" __global__ void square(const float* y, float* z, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) z[i] = y[i] * y[i];
}
// partial[blockIdx.x] = the sum of z[i] over the i this block's threads visit: i = (block * 256 +
// thread) + k * (blocks * 256). Launched with 256 threads a block.
extern "C" __global__ void block_sum(const float* z, int n, float* partial) {
    __shared__ float acc[256];
    float s = 0.0f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) s += z[i];
    acc[threadIdx.x] = s;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
        if (threadIdx.x < w) acc[threadIdx.x] += acc[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = acc[0];
}
"#;

/// The compiled kernels of [`SOURCE`].
#[derive(Debug)]
pub struct Kernels {
    /// `affine(y, n, a, b)`.
    pub affine: CudaFunction,
    /// `square(y, z, n)`.
    pub square: CudaFunction,
    /// `block_sum(z, n, partial)`.
    pub block_sum: CudaFunction,
}

impl Kernels {
    /// Compiles [`SOURCE`] with nvrtc and loads it into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, PoolError> {
        let module = ctx.load_module(gpu_pool::interop::cudarc::nvrtc::compile_ptx(SOURCE)?)?;
        Ok(Kernels {
            affine: module.load_function("affine")?,
            square: module.load_function("square")?,
            block_sum: module.load_function("block_sum")?,
        })
    }
}

/// The launch of `affine` and `square` over `n` elements.
pub fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK) as u32, 1, 1),
        block_dim: (BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The launch of `block_sum`.
pub fn reduction() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (PARTS as u32, 1, 1),
        block_dim: (BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The block of `block_sum` that sums element `i`.
fn part_of(i: usize) -> usize {
    i / BLOCK % PARTS
}

/// A step's result on the CPU, in f64.
pub fn reference(s: &Step) -> Vec<f64> {
    let mut partial = vec![0.0; PARTS];
    for i in 0..s.n {
        let y = f64::from(s.a) * (i % 1024) as f64 + f64::from(s.b);
        partial[part_of(i)] += y * y;
    }
    partial
}

/// The largest difference of `got` from `expected`, relative where `expected` is above 1 in size.
pub fn largest_difference(got: &[f32], expected: &[f64]) -> f64 {
    if got.len() != expected.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(expected)
        .map(|(&g, &e)| (f64::from(g) - e).abs() / e.abs().max(1.0))
        .fold(
            0.0,
            |a, d| if d.is_nan() { f64::INFINITY } else { a.max(d) },
        )
}

/// Compares every step's result of every thread (`results[t][k]`, of `lists[t][k]`) with the
/// reference and returns the largest difference; an error names the twin if it is above
/// [`TOLERANCE`] or a result is missing.
pub fn check(twin: &str, lists: &[Vec<Step>], results: &[Vec<Vec<f32>>]) -> Result<f64, String> {
    let counts = |v: &[Vec<_>]| v.len();
    if results.len() != lists.len() || lists.iter().zip(results).any(|(l, r)| l.len() != counts(r))
    {
        return Err(format!("{twin}: not one result a step"));
    }
    let worst = std::thread::scope(|s| {
        let threads: Vec<_> = lists
            .iter()
            .zip(results)
            .map(|(list, got)| {
                s.spawn(move || {
                    list.iter()
                        .zip(got)
                        .map(|(step, got)| largest_difference(got, &reference(step)))
                        .fold(0.0, f64::max)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("the reference does not panic"))
            .fold(0.0, f64::max)
    });
    println!("{twin}: largest relative difference from the f64 CPU reference {worst:.2e}");
    if worst > TOLERANCE {
        return Err(format!(
            "{twin}: a step's sums differ from the CPU reference by {worst:.2e} (more than {TOLERANCE:.0e})"
        ));
    }
    Ok(worst)
}

/// Runs `cfg`'s steps with the gpu-pool twin on `device` (the CPU twins of the kernels where there
/// is no CUDA) and checks every result: the host backend's run, and the test's.
pub fn run_on_host(device: &Device, cfg: &Config) -> Result<f64, Box<dyn Error>> {
    let lists: Vec<_> = (0..THREADS).map(|t| steps(cfg, t)).collect();
    let mut workers = [pooled::Worker::new(device)?, pooled::Worker::new(device)?];
    let results = pooled::run(None, &mut workers, &lists, true)?;
    Ok(check("gpu-pool", &lists, &results)?)
}

/// The app: on CUDA, checks both twins, then times them interleaved and prints the table row; on
/// the host backend, checks the gpu-pool twin on a few small steps.
pub fn main() -> Result<(), Box<dyn Error>> {
    let device = Device::cuda_or_host();
    let Ok(ctx) = device.cudarc().cloned() else {
        run_on_host(&device, &Config::HOST)?;
        println!("host backend: gpu-pool twin checked, no cudarc twin (needs CUDA)");
        return Ok(());
    };
    run_on_cuda(&device, &ctx).map_err(|e| e as Box<dyn Error>)
}

/// [`main`] on a CUDA device.
fn run_on_cuda(
    device: &Device,
    ctx: &Arc<CudaContext>,
) -> Result<(), Box<dyn Error + Send + Sync>> {
    // SAFETY: before any cudarc slice exists. The cudarc twin shares nothing between its streams:
    // every slice is allocated, used and freed on one thread's stream, in that stream's order.
    // gpu-pool's memory does not use cudarc's events.
    unsafe { ctx.disable_event_tracking() };
    crate::harness::keep_freed_pool_memory(ctx)?;
    let kernels = Kernels::load(ctx)?;
    let lists: Vec<_> = (0..THREADS).map(|t| steps(&Config::FULL, t)).collect();
    let units = lists.iter().map(Vec::len).sum();
    let mut workers = [pooled::Worker::new(device)?, pooled::Worker::new(device)?];
    let mut plain_workers = [plain::Worker::new(ctx)?, plain::Worker::new(ctx)?];
    let k = Some(&kernels);

    // The check pass is a whole round of each, every step checked; then a warm-up round each.
    check(
        "gpu-pool",
        &lists,
        &pooled::run(k, &mut workers, &lists, true)?,
    )?;
    check(
        "cudarc",
        &lists,
        &plain::run(ctx, &kernels, &mut plain_workers, &lists, true)?,
    )?;
    pooled::run(k, &mut workers, &lists, false)?;
    plain::run(ctx, &kernels, &mut plain_workers, &lists, false)?;

    let before = device.stats().driver_alloc_calls;
    let (pooled_us, plain_us) = harness::interleave(
        harness::rounds_arg(9),
        || -> Result<_, Box<dyn Error + Send + Sync>> {
            let start = Instant::now();
            pooled::run(k, &mut workers, &lists, false)?;
            Ok((start.elapsed(), units))
        },
        || {
            let start = Instant::now();
            plain::run(ctx, &kernels, &mut plain_workers, &lists, false)?;
            Ok((start.elapsed(), units))
        },
    )?;
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
        "driver asks per step: gpu-pool {:.2} allocation calls; cudarc {} cuMemAllocAsync + {} \
         cuMemFreeAsync (its three temporaries, by construction)",
        alloc_calls as f64 / (units * pooled_us.us.len()).max(1) as f64,
        plain::TEMPORARIES,
        plain::TEMPORARIES
    );
    harness::report(
        "two_threads",
        "step",
        (&pooled_us, &plain_us),
        (include_str!("pooled.rs"), include_str!("plain.rs")),
    );
    Ok(())
}
