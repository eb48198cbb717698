//! The gpu-pool twin: the weights in `SharedMat`s read through guards, each step's temporaries
//! (`x`, `h`, `logits`, `probs`) from the stream's stack with `buffer!`, packed for cuBLAS.

use gpu_pool::interop::cudarc::cublas::{CudaBlas, Gemm};
use gpu_pool::interop::cudarc::driver::PushKernelArg;
use gpu_pool::prelude::*;

use super::{CLASSES, HIDDEN, IN, Kernels, Weights, Work, host};

/// The model on the device, packed: `w1` (`IN x HIDDEN`), `b1`, `w2` (`HIDDEN x CLASSES`), `b2`.
#[derive(Debug, GraphKey)]
pub struct Model {
    w1: SharedMat<f32>,
    b1: SharedMat<f32>,
    w2: SharedMat<f32>,
    b2: SharedMat<f32>,
}

impl Model {
    /// Uploads `w` on `stream`.
    pub fn load(stream: &Stream, w: &Weights) -> Result<Model, PoolError> {
        let upload = |rows, cols, data: &[f32]| -> Result<SharedMat<f32>, PoolError> {
            let mut m = SharedMat::new_packed(stream.device(), rows, cols)?;
            m.write(stream)?.upload(data)?;
            Ok(m)
        };
        Ok(Model {
            w1: upload(IN, HIDDEN, &w.w1)?,
            b1: upload(1, HIDDEN, &w.b1)?,
            w2: upload(HIDDEN, CLASSES, &w.w2)?,
            b2: upload(1, CLASSES, &w.b2)?,
        })
    }
}

/// What a step runs on a GPU: the stream's cuBLAS handle and the kernels (`None` on the host
/// backend, where the CPU twins run).
pub type Gpu<'a> = Option<(&'a CudaBlas, &'a Kernels)>;

/// Runs every step of `work`, handing each step's probabilities (`batch x CLASSES`, downloaded
/// into a pageable `Vec`) to `each`.
pub fn run(
    stream: &Stream,
    gpu: Gpu<'_>,
    model: &Model,
    work: &Work,
    mut each: impl FnMut(usize, &[f32]),
) -> Result<(), PoolError> {
    let mut probs = vec![0.0; work.max_batch() * CLASSES];
    for i in 0..work.steps() {
        let out = &mut probs[..work.batches[i] * CLASSES];
        step(stream, gpu, model, work.input(i), out)?;
        each(i, out);
    }
    Ok(())
}

/// One step: `probs_out = softmax(relu(input W1 + b1) W2 + b2)`, `input` being `batch x IN`.
#[pooled(stream)]
pub fn step(
    stream: &Stream,
    gpu: Gpu<'_>,
    model: &Model,
    input: &[f32],
    probs_out: &mut [f32],
) -> Result<(), PoolError> {
    let batch = input.len() / IN;
    let mut x = buffer!(batch, IN; f32, packed)?;
    let mut probs = buffer!(batch, CLASSES; f32, packed)?;
    x.upload(input)?;
    forward(stream, gpu, model, &x, &mut probs)?;
    probs.download(probs_out)
}

/// The forward pass: `probs = softmax(relu(x W1 + b1) W2 + b2)`, packed, one row a sample.
#[pooled(stream)]
pub fn forward(
    stream: &Stream,
    gpu: Gpu<'_>,
    model: &Model,
    x: &impl GpuRead<f32>,
    probs: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let (w1, b1) = (model.w1.read(stream)?, model.b1.read(stream)?);
    let (w2, b2) = (model.w2.read(stream)?, model.b2.read(stream)?);
    let mut h = buffer!(x.rows(), HIDDEN; f32, packed)?;
    let mut logits = buffer!(x.rows(), CLASSES; f32, packed)?;
    gemm(gpu, x, &w1, &mut h)?;
    add_bias(stream, gpu, true, &mut h, &b1)?;
    gemm(gpu, &h, &w2, &mut logits)?;
    add_bias(stream, gpu, false, &mut logits, &b2)?;
    softmax(stream, gpu, &logits, probs)
}

/// `c = a b`, packed row-major.
fn gemm(
    gpu: Gpu<'_>,
    a: &impl GpuRead<f32>,
    b: &impl GpuRead<f32>,
    c: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let Some((blas, _)) = gpu else {
        return host::gemm(a, b, c);
    };
    let cfg = super::gemm_config(a.rows(), a.cols(), b.cols());
    let (a, b, mut c) = (a.as_cudarc()?, b.as_cudarc()?, c.as_cudarc_mut()?);
    // SAFETY: `a`, `b` and `c` are packed `rows x inner`, `inner x cols` and `rows x cols`, as
    // the configuration says, so cuBLAS stays inside each.
    unsafe { blas.gemm(cfg, &b, &a, &mut c) }?;
    Ok(())
}

/// `m = m + b` (`bias`), or `relu(m + b)` with `relu` (`bias_relu`), `b` one row.
fn add_bias(
    stream: &Stream,
    gpu: Gpu<'_>,
    relu: bool,
    m: &mut impl GpuWrite<f32>,
    b: &impl GpuRead<f32>,
) -> Result<(), PoolError> {
    let (Some((_, k)), Some(cuda)) = (gpu, stream.cudarc().ok()) else {
        return host::add_bias(relu, m, b);
    };
    let kernel = if relu { &k.bias_relu } else { &k.bias };
    let (mp, bp, rows, cols) = (
        m.device_ptr(),
        b.device_ptr(),
        m.rows() as i32,
        m.cols() as i32,
    );
    let mut launch = cuda.launch_builder(kernel);
    launch.arg(&mp).arg(&bp).arg(&rows).arg(&cols);
    // SAFETY: `m` is packed `rows x cols` floats of this stream and `b` holds `cols` (read on
    // it); both outlive the kernel in the stream's order.
    unsafe { launch.launch(super::threads(m.len())) }?;
    Ok(())
}

/// `p = softmax(z)` row by row.
fn softmax(
    stream: &Stream,
    gpu: Gpu<'_>,
    z: &impl GpuRead<f32>,
    p: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let (Some((_, k)), Some(cuda)) = (gpu, stream.cudarc().ok()) else {
        return host::softmax(z, p);
    };
    let (zp, pp, rows, cols) = (
        z.device_ptr(),
        p.device_ptr(),
        z.rows() as i32,
        z.cols() as i32,
    );
    let mut launch = cuda.launch_builder(&k.softmax);
    launch.arg(&zp).arg(&pp).arg(&rows).arg(&cols);
    // SAFETY: `z` and `p` are packed `rows x cols` floats of this stream, alive past the kernel.
    unsafe { launch.launch(super::threads(z.rows())) }?;
    Ok(())
}
