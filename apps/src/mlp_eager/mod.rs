//! `mlp_eager`: a 2-layer MLP (784-256-10) served step by step, eagerly, with a batch that changes
//! every step (1 to 64, a deterministic list of 500 steps). Per step: `x` is uploaded from a
//! pageable `Vec`; `h = relu(x W1 + b1)`; `logits = h W2 + b2`; `probs = softmax(logits)` row by
//! row; `probs` is downloaded into a pageable `Vec`. The GEMMs are cuBLAS SGEMMs, the rest three
//! small kernels.
//!
//! This module holds what both twins share: the workload, the kernels (one nvrtc source) with
//! their launch configurations, the cuBLAS call configuration, the f64 CPU reference and the
//! check. `pooled.rs` is the gpu-pool twin, `plain.rs` the cudarc twin; `mlp_graph` replays the
//! same forward pass from a CUDA graph.

mod host;
pub(crate) mod plain;
pub mod pooled;

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use gpu_pool::interop::cudarc::cublas::{GemmConfig, sys::cublasOperation_t};
use gpu_pool::interop::cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use gpu_pool::prelude::*;

use crate::harness;

/// Input features.
pub const IN: usize = 784;
/// Hidden units.
pub const HIDDEN: usize = 256;
/// Classes.
pub const CLASSES: usize = 10;
/// The largest relative difference from the f64 reference a twin's probability may have.
pub const TOLERANCE: f64 = 1e-4;

/// The shape of a workload's step list.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Steps in the list.
    pub steps: usize,
    /// The largest batch (the smallest is 1).
    pub max_batch: usize,
}

impl Config {
    /// The app's workload on a GPU: 500 steps of batch 1 to 64.
    pub const FULL: Config = Config {
        steps: 500,
        max_batch: 64,
    };
    /// A few small steps, for the host backend (CI, debug builds).
    pub const HOST: Config = Config {
        steps: 8,
        max_batch: 5,
    };
}

/// The model's parameters on the host, row-major: `w1` (`IN x HIDDEN`), `b1` (`1 x HIDDEN`),
/// `w2` (`HIDDEN x CLASSES`), `b2` (`1 x CLASSES`).
#[derive(Clone, Debug)]
pub struct Weights {
    /// First layer.
    pub w1: Vec<f32>,
    /// First layer's bias.
    pub b1: Vec<f32>,
    /// Second layer.
    pub w2: Vec<f32>,
    /// Second layer's bias.
    pub b2: Vec<f32>,
}

/// A workload: the weights, each step's batch, and one pool of input floats that every step
/// reads a window of.
#[derive(Clone, Debug)]
pub struct Work {
    /// The weights.
    pub weights: Weights,
    /// Each step's batch, in order.
    pub batches: Vec<usize>,
    /// Where each step's input starts in `inputs`.
    pub offsets: Vec<usize>,
    /// The input pool.
    pub inputs: Vec<f32>,
}

/// A deterministic value in [-1, 1) for index `i` of stream `seed` (splitmix64).
pub(crate) fn noise(seed: u64, i: u64) -> f32 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i.wrapping_mul(0xBF58_476D_1CE4_E5B9));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

impl Weights {
    /// The model, the same on every run: each layer keeps its input's variance (uniform in
    /// ±sqrt(3 / fan-in)), the second doubled, so the logits spread over about ±2 and every
    /// probability is well above 0.
    pub fn new() -> Weights {
        let fill = |seed, n: usize, scale: f32| -> Vec<f32> {
            (0..n).map(|i| scale * noise(seed, i as u64)).collect()
        };
        Weights {
            w1: fill(1, IN * HIDDEN, (3.0 / IN as f32).sqrt()),
            b1: fill(2, HIDDEN, 0.1),
            w2: fill(3, HIDDEN * CLASSES, 2.0 * (3.0 / HIDDEN as f32).sqrt()),
            b2: fill(4, CLASSES, 0.5),
        }
    }
}

impl Default for Weights {
    fn default() -> Self {
        Weights::new()
    }
}

impl Work {
    /// The workload of `cfg`, the same on every run: batches 1 to `cfg.max_batch` in a
    /// pseudo-random order.
    pub fn new(cfg: &Config) -> Work {
        let largest = cfg.max_batch * IN;
        let inputs: Vec<f32> = (0..2 * largest).map(|i| noise(5, i as u64)).collect();
        let pick = |i: usize, salt: u64, n: usize| {
            ((noise(6 + salt, i as u64) + 1.0) * 0.5 * n as f32) as usize % n
        };
        Work {
            weights: Weights::new(),
            batches: (0..cfg.steps)
                .map(|i| 1 + pick(i, 0, cfg.max_batch))
                .collect(),
            offsets: (0..cfg.steps).map(|i| pick(i, 1, largest)).collect(),
            inputs,
        }
    }

    /// Steps in the list.
    pub fn steps(&self) -> usize {
        self.batches.len()
    }

    /// Step `i`'s input: `batches[i] x IN`, row-major.
    pub fn input(&self, i: usize) -> &[f32] {
        let at = self.offsets[i];
        &self.inputs[at..at + self.batches[i] * IN]
    }

    /// The largest batch of the list.
    pub fn max_batch(&self) -> usize {
        self.batches.iter().copied().max().unwrap_or(0)
    }
}

/// The kernels, in CUDA C: packed row-major matrices of `rows x cols` floats. Both twins launch
/// them with the same arguments: addresses and `int` sizes.
pub const SOURCE: &str = r#"
// m = relu(m + b), b broadcast over the rows; one thread an element.
extern "C" __global__ void bias_relu(float* m, const float* b, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) m[i] = fmaxf(m[i] + b[i % cols], 0.0f);
}
// m = m + b, b broadcast over the rows; one thread an element.
extern "C" __global__ void bias(float* m, const float* b, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) m[i] += b[i % cols];
}
// p = softmax(z) row by row; one thread a row.
extern "C" __global__ void softmax(const float* z, float* p, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* zr = z + (size_t)r * cols;
    float* pr = p + (size_t)r * cols;
    float m = zr[0], s = 0.0f;
    for (int c = 1; c < cols; ++c) m = fmaxf(m, zr[c]);
    for (int c = 0; c < cols; ++c) { pr[c] = expf(zr[c] - m); s += pr[c]; }
    for (int c = 0; c < cols; ++c) pr[c] /= s;
}
"#;

/// The compiled kernels of [`SOURCE`].
#[derive(Debug, GraphKey)]
pub struct Kernels {
    /// `bias_relu(m, b, rows, cols)`.
    pub bias_relu: CudaFunction,
    /// `bias(m, b, rows, cols)`.
    pub bias: CudaFunction,
    /// `softmax(z, p, rows, cols)`.
    pub softmax: CudaFunction,
}

impl Kernels {
    /// Compiles [`SOURCE`] with nvrtc and loads it into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, PoolError> {
        let module = ctx.load_module(gpu_pool::interop::cudarc::nvrtc::compile_ptx(SOURCE)?)?;
        Ok(Kernels {
            bias_relu: module.load_function("bias_relu")?,
            bias: module.load_function("bias")?,
            softmax: module.load_function("softmax")?,
        })
    }
}

/// The launch of a one-thread-an-element kernel (`bias_relu`, `bias`) over `n` elements, or of
/// `softmax` over `n` rows: 256 threads a block.
pub fn threads(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

/// The GEMM `c = a b` of row-major packed `a` (`rows x inner`), `b` (`inner x cols`) and `c`.
/// cuBLAS is column-major, where a row-major matrix reads as its transpose: so it computes
/// `c^T = b^T a^T`, and is called `gemm(cfg, b, a, c)`.
pub fn gemm_config(rows: usize, inner: usize, cols: usize) -> GemmConfig<f32> {
    GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: cols as i32,
        n: rows as i32,
        k: inner as i32,
        alpha: 1.0,
        lda: cols as i32,
        ldb: inner as i32,
        beta: 0.0,
        ldc: cols as i32,
    }
}

/// The forward pass on the CPU, in f64: the probabilities of `x` (`batch x IN`, row-major).
pub fn reference(w: &Weights, x: &[f32]) -> Vec<f64> {
    let dense = |a: &[f64], m: &[f32], b: &[f32], inner: usize, cols: usize| -> Vec<f64> {
        let mut out = Vec::with_capacity(a.len() / inner * cols);
        for row in a.chunks(inner) {
            let mut acc: Vec<f64> = b.iter().map(|&v| f64::from(v)).collect();
            for (&v, mr) in row.iter().zip(m.chunks(cols)) {
                acc.iter_mut()
                    .zip(mr)
                    .for_each(|(o, &w)| *o += v * f64::from(w));
            }
            out.extend(acc);
        }
        out
    };
    let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let mut h = dense(&x, &w.w1, &w.b1, IN, HIDDEN);
    h.iter_mut().for_each(|v| *v = v.max(0.0));
    let logits = dense(&h, &w.w2, &w.b2, HIDDEN, CLASSES);
    let mut probs = Vec::with_capacity(logits.len());
    for row in logits.chunks(CLASSES) {
        let max = row.iter().copied().fold(f64::MIN, f64::max);
        let sum: f64 = row.iter().map(|z| (z - max).exp()).sum();
        probs.extend(row.iter().map(|z| (z - max).exp() / sum));
    }
    probs
}

/// The largest relative difference of `got` from `expected` (infinite for a length mismatch or a
/// NaN). Every expected probability is well above 1e-3 (see [`Weights::new`]); the floor only
/// keeps a wrong 0 from dividing by 0.
pub fn largest_difference(got: &[f32], expected: &[f64]) -> f64 {
    if got.len() != expected.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(expected)
        .map(|(&g, &e)| (f64::from(g) - e).abs() / e.abs().max(1e-3))
        .fold(
            0.0,
            |a, d| if d.is_nan() { f64::INFINITY } else { a.max(d) },
        )
}

/// The reference output of every step of `work`, computed on all the host's cores.
pub fn expected(work: &Work) -> Vec<Vec<f64>> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let steps: Vec<usize> = (0..work.steps()).collect();
    let chunk = steps.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = steps
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|&i| reference(&work.weights, work.input(i)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|p| p.join().expect("the reference does not panic"))
            .collect()
    })
}

/// Compares each step's output (`outputs[i]` for step `i`) with its reference (`expected[i]`,
/// from [`expected`]) and returns the largest difference; an error names the twin if it is
/// above [`TOLERANCE`] or if not every step has an output.
pub fn check(twin: &str, expected: &[Vec<f64>], outputs: &[Vec<f32>]) -> Result<f64, String> {
    if outputs.len() != expected.len() {
        return Err(format!(
            "{twin}: {} outputs for {} steps",
            outputs.len(),
            expected.len()
        ));
    }
    let worst = outputs
        .iter()
        .zip(expected)
        .map(|(got, want)| largest_difference(got, want))
        .fold(0.0, f64::max);
    println!("{twin}: largest relative difference from the f64 CPU reference {worst:.2e}");
    if worst > TOLERANCE {
        return Err(format!(
            "{twin}: the probabilities differ from the CPU reference by {worst:.2e} (more than {TOLERANCE:.0e})"
        ));
    }
    Ok(worst)
}

/// Readies `ctx` for an MLP app's twins, before any cudarc slice exists, and loads the kernels.
pub(crate) fn prepare(ctx: &Arc<CudaContext>) -> Result<Kernels, Box<dyn Error>> {
    // SAFETY: called before any cudarc slice exists. Every cudarc slice of the cudarc twins is
    // made, used (also by their graphs) and freed on its one stream; gpu-pool's memory does not
    // use cudarc's events.
    unsafe { ctx.disable_event_tracking() };
    crate::harness::keep_freed_pool_memory(ctx)?;
    ctx.bind_to_thread()?; // cuBLAS launches in the thread's current context
    Ok(Kernels::load(ctx)?)
}

/// Runs every step of `work` with the gpu-pool twin on `device` (the CPU twins of the kernels and
/// GEMMs where there is no CUDA) and checks the outputs: the host backend's run, and the test's.
pub fn run_on_host(device: &Device, work: &Work) -> Result<f64, Box<dyn Error>> {
    let stream = Stream::new(device)?;
    let model = pooled::Model::load(&stream, &work.weights)?;
    let mut outputs = Vec::new();
    pooled::run(&stream, None, &model, work, |_, p| outputs.push(p.to_vec()))?;
    Ok(check("gpu-pool", &expected(work), &outputs)?)
}

/// The app: on CUDA, checks both twins, then times them interleaved and prints the table row; on
/// the host backend, checks the gpu-pool twin on a few small steps.
pub fn main() -> Result<(), Box<dyn Error>> {
    let device = Device::cuda_or_host();
    let Ok(ctx) = device.cudarc().cloned() else {
        run_on_host(&device, &Work::new(&Config::HOST))?;
        println!("host backend: gpu-pool twin checked, no cudarc twin (needs CUDA)");
        return Ok(());
    };
    let kernels = prepare(&ctx)?;
    let work = Work::new(&Config::FULL);
    let n = work.steps();

    let stream = Stream::new(&device)?;
    let blas = stream.cublas()?;
    let model = pooled::Model::load(&stream, &work.weights)?;
    let gpu = Some((&*blas, &kernels));
    let twin = plain::Twin::new(&ctx, &work.weights)?;

    // The check pass, which is also the warm-up: every batch size once on each twin.
    let want = expected(&work);
    let mut got = Vec::new();
    pooled::run(&stream, gpu, &model, &work, |_, p| got.push(p.to_vec()))?;
    check("gpu-pool", &want, &got)?;
    let mut got = Vec::new();
    twin.run(&kernels, &work, |_, p| got.push(p.to_vec()))?;
    check("cudarc", &want, &got)?;
    pooled::run(&stream, gpu, &model, &work, |_, _| {})?;
    twin.run(&kernels, &work, |_, _| {})?;

    let before = device.stats().driver_alloc_calls;
    let calls_0 = std::cell::Cell::new(gpu_pool::observe::DriverCalls::default());
    let (pooled_us, plain_us) = harness::interleave(
        harness::rounds_arg(9),
        || -> Result<_, Box<dyn Error>> {
            let start = Instant::now();
            let counted = gpu_pool::observe::DriverCalls::on_this_thread();
            pooled::run(&stream, gpu, &model, &work, |_, _| {})?;
            calls_0.set(
                calls_0.get() + gpu_pool::observe::DriverCalls::on_this_thread().since(counted),
            );
            Ok((start.elapsed(), n))
        },
        || {
            let start = Instant::now();
            twin.run(&kernels, &work, |_, _| {})?;
            Ok((start.elapsed(), n))
        },
    )?;
    harness::print_calls_per_unit(calls_0.get(), n * harness::rounds_arg(9), "step");
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
         cuMemFreeAsync (its temporaries, by construction)",
        alloc_calls as f64 / (n * pooled_us.us.len()).max(1) as f64,
        plain::TEMPORARIES,
        plain::TEMPORARIES
    );
    harness::report(
        "mlp_eager",
        "step",
        (&pooled_us, &plain_us),
        (include_str!("pooled.rs"), include_str!("plain.rs")),
    );
    Ok(())
}
