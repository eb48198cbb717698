//! The gpu-pool twin: `mlp_eager`'s forward pass (its weights read inside, its temporaries from
//! `buffer!`) captured once with `Stream::capture`. The input and output are `GpuMat`s made once;
//! the graph borrows them, so they sit in `RefCell`s, through which the host uploads each step's
//! input and downloads its output between replays.

use std::cell::RefCell;

use gpu_pool::Graph;
use gpu_pool::cudarc::cublas::CudaBlas;
use gpu_pool::prelude::*;

use super::{BATCH, CLASSES, Kernels, Work};
use crate::mlp_eager::pooled::{Model, forward};

/// Captures the forward pass of `x` into `probs` on `stream`: a graph that replays it.
pub fn capture<'a, 's: 'a>(
    stream: &'a Stream,
    (blas, k): (&'a CudaBlas, &'a Kernels),
    model: &'a Model,
    x: &'a RefCell<GpuMat<'s, f32>>,
    probs: &'a RefCell<GpuMat<'s, f32>>,
) -> Result<Graph<'a>, PoolError> {
    stream.capture(move |s| {
        let (x, mut probs) = (x.borrow(), probs.borrow_mut());
        forward(s, Some((blas, k)), model, &*x, &mut *probs)
    })
}

/// Runs every step of `work`: uploads its input into `x`, runs `forward` (`graph.launch()`) and
/// hands the probabilities, downloaded into a pageable `Vec`, to `each`.
pub fn run(
    mut forward: impl FnMut() -> Result<(), PoolError>,
    x: &RefCell<GpuMat<'_, f32>>,
    probs: &RefCell<GpuMat<'_, f32>>,
    work: &Work,
    mut each: impl FnMut(usize, &[f32]),
) -> Result<(), PoolError> {
    let mut out = vec![0.0; BATCH * CLASSES];
    for i in 0..work.steps() {
        x.borrow_mut().upload(work.input(i))?;
        forward()?;
        probs.borrow().download(&mut out)?;
        each(i, &out);
    }
    Ok(())
}

/// `n` replays of `graph`, then one wait for them.
pub fn replay(stream: &Stream, graph: &Graph<'_>, n: usize) -> Result<(), PoolError> {
    for _ in 0..n {
        graph.launch()?;
    }
    stream.synchronize()
}
