//! The cudarc twin: the weights as `CudaSlice`s uploaded once, each step's temporaries allocated
//! on the stream (stream-ordered `cuMemAllocAsync`, freed when they drop).

use std::error::Error;
use std::sync::Arc;

use gpu_pool::interop::cudarc::cublas::{CudaBlas, Gemm};
use gpu_pool::interop::cudarc::driver::{CudaContext, CudaSlice, CudaStream, PushKernelArg};

use super::{CLASSES, HIDDEN, IN, Kernels, Weights, Work};

pub(crate) type Res<T> = Result<T, Box<dyn Error>>;

/// Temporaries a step allocates (and frees): `x`, `h`, `logits`, `probs`.
pub(crate) const TEMPORARIES: usize = 4;

/// The model on the device: `w1`, `b1`, `w2`, `b2`, packed.
pub(crate) struct Model {
    w1: CudaSlice<f32>,
    b1: CudaSlice<f32>,
    w2: CudaSlice<f32>,
    b2: CudaSlice<f32>,
}

/// The twin's stream, its cuBLAS handle and the model.
pub(crate) struct Twin {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    pub(crate) model: Model,
}

impl Twin {
    /// A stream of `ctx` with the weights `w` uploaded on it.
    pub(crate) fn new(ctx: &Arc<CudaContext>, w: &Weights) -> Res<Twin> {
        let stream = ctx.new_stream()?;
        let model = Model {
            w1: stream.clone_htod(&w.w1)?,
            b1: stream.clone_htod(&w.b1)?,
            w2: stream.clone_htod(&w.w2)?,
            b2: stream.clone_htod(&w.b2)?,
        };
        let blas = CudaBlas::new(stream.clone())?;
        Ok(Twin {
            stream,
            blas,
            model,
        })
    }

    /// Runs every step of `work`, handing each step's probabilities to `each`.
    pub(crate) fn run(
        &self,
        k: &Kernels,
        work: &Work,
        mut each: impl FnMut(usize, &[f32]),
    ) -> Res<()> {
        let mut probs = vec![0.0; work.max_batch() * CLASSES];
        for i in 0..work.steps() {
            let out = &mut probs[..work.batches[i] * CLASSES];
            self.step(k, work.input(i), out)?;
            each(i, out);
        }
        Ok(())
    }

    /// One step: `probs_out = softmax(relu(input W1 + b1) W2 + b2)`, `input` being `batch x IN`.
    pub(crate) fn step(&self, k: &Kernels, input: &[f32], probs_out: &mut [f32]) -> Res<()> {
        let (s, batch) = (&self.stream, input.len() / IN);
        // SAFETY: `x` is written in full by the copy, `probs` by the softmax, before any read.
        let (mut x, mut probs) = unsafe {
            (
                s.alloc::<f32>(batch * IN)?,
                s.alloc::<f32>(batch * CLASSES)?,
            )
        };
        s.memcpy_htod(input, &mut x)?;
        self.forward(k, &x, &mut probs, batch)?;
        s.memcpy_dtoh(&probs, probs_out)?;
        s.synchronize()?;
        Ok(())
    }

    /// The forward pass: `probs = softmax(relu(x W1 + b1) W2 + b2)` for `batch` rows.
    pub(crate) fn forward(
        &self,
        k: &Kernels,
        x: &CudaSlice<f32>,
        probs: &mut CudaSlice<f32>,
        batch: usize,
    ) -> Res<()> {
        let (s, m) = (&self.stream, &self.model);
        // SAFETY: both are written in full (by the GEMMs) before they are read.
        let (mut h, mut logits) = unsafe {
            (
                s.alloc::<f32>(batch * HIDDEN)?,
                s.alloc::<f32>(batch * CLASSES)?,
            )
        };
        let (rows, hidden, classes) = (batch as i32, HIDDEN as i32, CLASSES as i32);
        // SAFETY: the operands are packed matrices of the shapes the configurations say, so
        // cuBLAS stays inside each slice; all are used on `s`, the handle's stream.
        unsafe {
            let l1 = super::gemm_config(batch, IN, HIDDEN);
            self.blas.gemm(l1, &m.w1, x, &mut h)?;
        }
        let mut launch = s.launch_builder(&k.bias_relu);
        launch.arg(&mut h).arg(&m.b1).arg(&rows).arg(&hidden);
        // SAFETY: `h` holds `batch x HIDDEN` floats and `b1` `HIDDEN`, all alive past the kernel.
        unsafe { launch.launch(super::threads(batch * HIDDEN)) }?;
        // SAFETY: as for the first GEMM.
        unsafe {
            let l2 = super::gemm_config(batch, HIDDEN, CLASSES);
            self.blas.gemm(l2, &m.w2, &h, &mut logits)?;
        }
        let mut launch = s.launch_builder(&k.bias);
        launch.arg(&mut logits).arg(&m.b2).arg(&rows).arg(&classes);
        // SAFETY: `logits` holds `batch x CLASSES` floats and `b2` `CLASSES`.
        unsafe { launch.launch(super::threads(batch * CLASSES)) }?;
        let mut launch = s.launch_builder(&k.softmax);
        launch.arg(&logits).arg(probs).arg(&rows).arg(&classes);
        // SAFETY: `logits` and `probs` hold `batch x CLASSES` floats.
        unsafe { launch.launch(super::threads(batch)) }?;
        Ok(())
    }
}
