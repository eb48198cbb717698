//! `attention`: an attention-block inference server. Requests of a changing shape (batch 1 to 8,
//! sequence 16 to 128) arrive in a deterministic pseudo-random list; two worker threads, each with
//! its own stream and cuBLAS handle, take them from a shared counter. Per request (d_model 256, 4
//! heads of 64): `xn = rmsnorm(x, gain)`; `q, k, v = xn W`; per (batch, head) `scores = q k^T / 8`;
//! a causal softmax in place; `ctx = probs v`; `out = ctx Wo`. The weights are shared by both
//! workers; the eight temporaries are sized to each request.
//!
//! This module holds what both twins share: the workload, the kernels (one nvrtc source) with
//! their launch configurations, the cuBLAS call configurations, the f64 CPU reference and the
//! check. `pooled.rs` is the gpu-pool twin, `plain.rs` the cudarc twin.

mod host;
mod plain;
pub mod pooled;

use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use gpu_pool::interop::cudarc::cublas::{GemmConfig, StridedBatchedConfig, sys::cublasOperation_t};
use gpu_pool::interop::cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use gpu_pool::prelude::*;

use crate::harness;

/// The model width.
pub const D: usize = 256;
/// Attention heads.
pub const HEADS: usize = 4;
/// Columns of one head (`D / HEADS`).
pub const HEAD: usize = 64;
/// Requests a check pass serves (and compares with the CPU reference).
pub const CHECKED: usize = 24;
/// The largest relative difference from the f64 reference a twin may have.
pub const TOLERANCE: f64 = 1e-3;
/// RMSNorm's epsilon.
const EPS: f64 = 1e-5;
/// How many times a timed round serves the request list.
const PASSES: usize = 3;

/// The shapes a workload's requests take.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Requests in the list.
    pub requests: usize,
    /// The largest batch (the smallest is 1).
    pub max_batch: usize,
    /// The shortest and longest sequence.
    pub seq: (usize, usize),
}

impl Config {
    /// The server's workload on a GPU: 400 requests, batch 1 to 8, sequence 16 to 128.
    pub const FULL: Config = Config {
        requests: 400,
        max_batch: 8,
        seq: (16, 128),
    };
    /// A few small requests, for the host backend (CI, debug builds).
    pub const HOST: Config = Config {
        requests: 5,
        max_batch: 2,
        seq: (8, 24),
    };
}

/// One request: `batch` sequences of `seq` tokens, its input at `offset` in [`Work::inputs`].
#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// Sequences.
    pub batch: usize,
    /// Tokens a sequence.
    pub seq: usize,
    /// Where its input starts in [`Work::inputs`].
    pub offset: usize,
}

impl Request {
    /// Rows of its activations (`batch * seq`).
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }

    /// Floats of its input (and of its output): `rows * D`.
    pub fn len(&self) -> usize {
        self.rows() * D
    }

    /// Whether it has no rows (never, in a [`Work`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The model's weights on the host, row-major: `wq`, `wk`, `wv`, `wo` (`D x D`) and the RMSNorm
/// gain (`1 x D`).
#[derive(Clone, Debug)]
pub struct Weights {
    /// Query projection.
    pub wq: Vec<f32>,
    /// Key projection.
    pub wk: Vec<f32>,
    /// Value projection.
    pub wv: Vec<f32>,
    /// Output projection.
    pub wo: Vec<f32>,
    /// RMSNorm gain.
    pub gain: Vec<f32>,
}

/// A workload: the weights, the request list and one pool of input floats that every request
/// reads a window of (so inputs differ without a copy per request on the host).
#[derive(Clone, Debug)]
pub struct Work {
    /// The weights.
    pub weights: Weights,
    /// The requests, in arrival order.
    pub requests: Vec<Request>,
    /// The input pool.
    pub inputs: Vec<f32>,
}

/// A deterministic value in [-1, 1) for index `i` of stream `seed` (splitmix64).
fn noise(seed: u64, i: u64) -> f32 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i.wrapping_mul(0xBF58_476D_1CE4_E5B9));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

impl Work {
    /// The workload of `cfg`, the same on every run.
    pub fn new(cfg: &Config) -> Work {
        // Projections keep the variance (uniform in ±sqrt(3 / D)), so every stage is of size ~1.
        let scale = (3.0 / D as f32).sqrt();
        let matrix = |seed| (0..D * D).map(|i| scale * noise(seed, i as u64)).collect();
        let weights = Weights {
            wq: matrix(1),
            wk: matrix(2),
            wv: matrix(3),
            wo: matrix(4),
            gain: (0..D).map(|i| 1.0 + 0.25 * noise(5, i as u64)).collect(),
        };
        let largest = cfg.max_batch * cfg.seq.1 * D;
        let inputs: Vec<f32> = (0..2 * largest).map(|i| noise(6, i as u64)).collect();
        let pick = |i: usize, salt: u64, n: usize| {
            ((noise(7 + salt, i as u64) + 1.0) * 0.5 * n as f32) as usize % n
        };
        let requests = (0..cfg.requests)
            .map(|i| Request {
                batch: 1 + pick(i, 0, cfg.max_batch),
                seq: cfg.seq.0 + pick(i, 1, cfg.seq.1 - cfg.seq.0 + 1),
                offset: pick(i, 2, largest),
            })
            .collect();
        Work {
            weights,
            requests,
            inputs,
        }
    }

    /// Request `r`'s input: `r.rows() x D`, row-major.
    pub fn input(&self, r: &Request) -> &[f32] {
        &self.inputs[r.offset..r.offset + r.len()]
    }

    /// The largest output of any request, in floats (a worker's result buffer).
    pub fn largest(&self) -> usize {
        self.requests.iter().map(Request::len).max().unwrap_or(0)
    }
}

/// The kernels, in CUDA C, one warp a row (launch with [`warp_rows`]). Both twins launch them with
/// the same arguments: addresses and `int` sizes.
pub const SOURCE: &str = r#"
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// y[r] = x[r] * gain / sqrt(mean(x[r]^2) + 1e-5), over `rows` packed rows of `cols` floats.
extern "C" __global__ void rmsnorm(const float* x, const float* gain, float* y, int rows, int cols) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return; // the whole warp: one row a warp
    const float* xr = x + (size_t)row * cols;
    float* yr = y + (size_t)row * cols;
    float ss = 0.0f;
    for (int c = lane; c < cols; c += 32) ss += xr[c] * xr[c];
    float scale = rsqrtf(warp_sum(ss) / cols + 1e-5f);
    for (int c = lane; c < cols; c += 32) yr[c] = xr[c] * scale * gain[c];
}
// Softmax in place over `rows` packed rows of `seq` scores, causal: row r is query i = r % seq,
// which sees keys j <= i; the others become 0.
extern "C" __global__ void causal_softmax(float* s, int rows, int seq) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    float* sr = s + (size_t)row * seq;
    int i = row % seq;
    float m = -3.0e38f;
    for (int j = lane; j <= i; j += 32) m = fmaxf(m, sr[j]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int j = lane; j <= i; j += 32) { float e = expf(sr[j] - m); sr[j] = e; sum += e; }
    float inv = 1.0f / warp_sum(sum);
    for (int j = lane; j < seq; j += 32) sr[j] = j <= i ? sr[j] * inv : 0.0f;
}
"#;

/// The compiled kernels of [`SOURCE`].
#[derive(Debug)]
pub struct Kernels {
    /// `rmsnorm(x, gain, y, rows, cols)`.
    pub rmsnorm: CudaFunction,
    /// `causal_softmax(s, rows, seq)`.
    pub causal_softmax: CudaFunction,
}

impl Kernels {
    /// Compiles [`SOURCE`] with nvrtc and loads it into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, PoolError> {
        let module = ctx.load_module(gpu_pool::interop::cudarc::nvrtc::compile_ptx(SOURCE)?)?;
        Ok(Kernels {
            rmsnorm: module.load_function("rmsnorm")?,
            causal_softmax: module.load_function("causal_softmax")?,
        })
    }
}

/// The launch of a one-warp-a-row kernel over `rows` rows: 4 warps a block.
pub fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(4) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
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

/// The scores of one batch element's heads: for each head `h`, `s_h = q_h k_h^T / sqrt(HEAD)`,
/// where `q_h`, `k_h` are the `seq x HEAD` column slices `h * HEAD..` of the element's `seq` rows
/// of `q` and `k` (leading dimension `D`), and `s_h` the `h`-th packed `seq x seq` block of its
/// scores. Column-major that is `s_h^T = k_h q_h^T`: called `gemm_strided_batched(cfg, k_b, q_b,
/// s_b)` on the element's rows; the heads are the batch, `HEAD` floats apart in `q` and `k`.
pub fn scores_config(seq: usize) -> StridedBatchedConfig<f32> {
    StridedBatchedConfig {
        gemm: GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: seq as i32,
            n: seq as i32,
            k: HEAD as i32,
            alpha: 1.0 / (HEAD as f32).sqrt(),
            lda: D as i32,
            ldb: D as i32,
            beta: 0.0,
            ldc: seq as i32,
        },
        batch_size: HEADS as i32,
        stride_a: HEAD as i64,
        stride_b: HEAD as i64,
        stride_c: (seq * seq) as i64,
    }
}

/// The context of one batch element's heads: `ctx_h = p_h v_h` into the column slice `h * HEAD..`
/// of the element's rows of `ctx`. Column-major, `ctx_h^T = v_h^T p_h^T`: called
/// `gemm_strided_batched(cfg, v_b, p_b, ctx_b)`.
pub fn context_config(seq: usize) -> StridedBatchedConfig<f32> {
    StridedBatchedConfig {
        gemm: GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: HEAD as i32,
            n: seq as i32,
            k: seq as i32,
            alpha: 1.0,
            lda: D as i32,
            ldb: seq as i32,
            beta: 0.0,
            ldc: D as i32,
        },
        batch_size: HEADS as i32,
        stride_a: HEAD as i64,
        stride_b: (seq * seq) as i64,
        stride_c: HEAD as i64,
    }
}

/// `a b` in f64: `a` is `rows x inner`, `b` (f32) `inner x cols`, row-major.
fn matmul(a: &[f64], b: &[f32], inner: usize, cols: usize) -> Vec<f64> {
    let mut c = vec![0.0; a.len() / inner * cols];
    for (ar, cr) in a.chunks(inner).zip(c.chunks_mut(cols)) {
        for (&x, br) in ar.iter().zip(b.chunks(cols)) {
            for (o, &w) in cr.iter_mut().zip(br) {
                *o += x * f64::from(w);
            }
        }
    }
    c
}

/// The attention block on the CPU, in f64: request `r`'s output for input `x`.
pub fn reference(w: &Weights, r: &Request, x: &[f32]) -> Vec<f64> {
    let mut xn: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    for row in xn.chunks_mut(D) {
        let scale = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / D as f64 + EPS).sqrt();
        for (v, &g) in row.iter_mut().zip(&w.gain) {
            *v *= scale * f64::from(g);
        }
    }
    let (q, k, v) = (
        matmul(&xn, &w.wq, D, D),
        matmul(&xn, &w.wk, D, D),
        matmul(&xn, &w.wv, D, D),
    );
    let mut ctx = vec![0.0; r.len()];
    let mut p = vec![0.0; r.seq];
    for b in 0..r.batch {
        for h in 0..HEADS {
            let at = |m: &[f64], t: usize, d: usize| m[(b * r.seq + t) * D + h * HEAD + d];
            for i in 0..r.seq {
                for (j, pj) in p.iter_mut().enumerate().take(i + 1) {
                    let dot: f64 = (0..HEAD).map(|d| at(&q, i, d) * at(&k, j, d)).sum();
                    *pj = dot / (HEAD as f64).sqrt();
                }
                let max = p[..=i].iter().copied().fold(f64::MIN, f64::max);
                p[..=i].iter_mut().for_each(|s| *s = (*s - max).exp());
                let sum: f64 = p[..=i].iter().sum();
                for d in 0..HEAD {
                    let c: f64 = (0..=i).map(|j| p[j] * at(&v, j, d)).sum();
                    ctx[(b * r.seq + i) * D + h * HEAD + d] = c / sum;
                }
            }
        }
    }
    matmul(&ctx, &w.wo, D, D)
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

/// Compares each `(request index, output)` with the reference (computed on several threads) and
/// returns the largest difference; an error names the twin if it is above [`TOLERANCE`] or if
/// not every one of the first `expected` requests has exactly one output.
pub fn check(
    twin: &str,
    work: &Work,
    outputs: &[(usize, Vec<f32>)],
    expected: usize,
) -> Result<f64, String> {
    let mut seen: Vec<usize> = outputs.iter().map(|(i, _)| *i).collect();
    seen.sort_unstable();
    if seen != (0..expected).collect::<Vec<_>>() {
        return Err(format!(
            "{twin}: outputs of requests {seen:?}, not of 0..{expected}"
        ));
    }
    let worst = std::thread::scope(|s| {
        let diffs: Vec<_> = outputs
            .iter()
            .map(|(i, got)| {
                s.spawn(move || {
                    let r = &work.requests[*i];
                    largest_difference(got, &reference(&work.weights, r, work.input(r)))
                })
            })
            .collect();
        diffs
            .into_iter()
            .map(|d| d.join().expect("the reference does not panic"))
            .fold(0.0, f64::max)
    });
    println!("{twin}: largest relative difference from the f64 CPU reference {worst:.2e}");
    if worst > TOLERANCE {
        return Err(format!(
            "{twin}: the attention output differs from the CPU reference by {worst:.2e} (more than {TOLERANCE:.0e})"
        ));
    }
    Ok(worst)
}

/// Serves `work` with the gpu-pool twin on `device` (two workers, the CPU twins of the kernels and
/// GEMMs where there is no CUDA) and checks every output: the host backend's run, and the test's.
pub fn run_on_host(device: &Device, work: &Work) -> Result<f64, Box<dyn Error>> {
    let loader = Stream::new(device)?;
    let model = Arc::new(pooled::Model::load(&loader, &work.weights)?);
    let mut workers = [
        pooled::Worker::new(device, work.largest())?,
        pooled::Worker::new(device, work.largest())?,
    ];
    let n = work.requests.len();
    let outputs = pooled::serve(&model, None, &mut workers, work, n, true)?;
    Ok(check("gpu-pool", work, &outputs, n)?)
}

/// The app: on CUDA, checks both twins, then times them interleaved and prints the table row; on
/// the host backend, checks the gpu-pool twin on a few small requests.
pub fn main() -> Result<(), Box<dyn Error>> {
    let device = Device::cuda_or_host();
    let Ok(ctx) = device.cudarc().cloned() else {
        run_on_host(&device, &Work::new(&Config::HOST))?;
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
    // SAFETY: before any cudarc slice exists. The cudarc twin's weights are written once on their
    // loading stream and synchronized before any worker reads them; afterwards they are only read
    // (by both workers' streams at once) and are freed after the workers' last synchronize. Each
    // temporary is allocated, used and freed on one worker's stream. gpu-pool's memory does not
    // use cudarc's events.
    unsafe { ctx.disable_event_tracking() };
    crate::harness::keep_freed_pool_memory(ctx)?;
    let kernels = Kernels::load(ctx)?;
    let work = Work::new(&Config::FULL);
    let (n, largest) = (work.requests.len(), work.largest());

    let loader = Stream::new(device)?;
    let model = Arc::new(pooled::Model::load(&loader, &work.weights)?);
    let mut workers = [
        pooled::Worker::new(device, largest)?,
        pooled::Worker::new(device, largest)?,
    ];
    let plain_model = Arc::new(plain::Model::load(ctx, &work.weights)?);
    let mut plain_workers = [
        plain::Worker::new(ctx, largest)?,
        plain::Worker::new(ctx, largest)?,
    ];
    let k = Some(&kernels);

    let got = pooled::serve(&model, k, &mut workers, &work, CHECKED, true)?;
    check("gpu-pool", &work, &got, CHECKED)?;
    let got = plain::serve(
        ctx,
        &plain_model,
        &kernels,
        &mut plain_workers,
        &work,
        CHECKED,
        true,
    )?;
    check("cudarc", &work, &got, CHECKED)?;

    // Warm-up: each worker alone serves the whole list, so every worker has served the largest
    // request (its stack grown to it, cuBLAS's kernels loaded) whichever requests it takes later.
    for i in 0..workers.len() {
        pooled::serve(&model, k, &mut workers[i..=i], &work, n, false)?;
        let alone = &mut plain_workers[i..=i];
        plain::serve(ctx, &plain_model, &kernels, alone, &work, n, false)?;
    }

    let before = device.stats().driver_alloc_calls;
    workers.iter_mut().for_each(|w| {
        w.take_calls();
    });
    // A round serves the list PASSES times: a pass (about 60 ms on an H200) is short enough
    // for the two workers' scheduling to swing it by 10%.
    let (pooled_us, plain_us) = harness::interleave(
        harness::rounds_arg(15),
        || -> Result<_, Box<dyn Error + Send + Sync>> {
            let start = Instant::now();
            for _ in 0..PASSES {
                pooled::serve(&model, k, &mut workers, &work, n, false)?;
            }
            Ok((start.elapsed(), PASSES * n))
        },
        || {
            let start = Instant::now();
            for _ in 0..PASSES {
                plain::serve(
                    ctx,
                    &plain_model,
                    &kernels,
                    &mut plain_workers,
                    &work,
                    n,
                    false,
                )?;
            }
            Ok((start.elapsed(), PASSES * n))
        },
    )?;
    let alloc_calls = device.stats().driver_alloc_calls - before;
    let calls = workers
        .iter_mut()
        .fold(gpu_pool::observe::DriverCalls::default(), |sum, w| {
            sum + w.take_calls()
        });
    harness::print_calls_per_unit(calls, PASSES * n * pooled_us.us.len(), "request");
    println!(
        "gpu-pool driver allocation calls during the timed rounds: {alloc_calls}{}",
        if alloc_calls == 0 {
            ""
        } else {
            " (expected 0 after warm-up)"
        }
    );
    println!(
        "driver asks per request: gpu-pool {:.2} allocation calls; cudarc {} cuMemAllocAsync + {} \
         cuMemFreeAsync (its eight temporaries, by construction)",
        alloc_calls as f64 / (PASSES * n * pooled_us.us.len()).max(1) as f64,
        plain::TEMPORARIES,
        plain::TEMPORARIES
    );
    println!(
        "requests/s (medians): gpu-pool {:.0}, cudarc {:.0}",
        1e6 / pooled_us.quantile(0.5),
        1e6 / plain_us.quantile(0.5)
    );
    harness::report(
        "attention",
        "request",
        (&pooled_us, &plain_us),
        (include_str!("pooled.rs"), include_str!("plain.rs")),
    );
    Ok(())
}
