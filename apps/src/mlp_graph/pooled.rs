//! The gpu-pool twin: `mlp_eager`'s forward pass (its weights read inside, its temporaries from
//! `buffer!`) captured once with `Stream::capture`. The input and output are `GpuMat`s made once;
//! the graph borrows them, so they sit in `RefCell`s, through which the host uploads each step's
//! input and downloads its output between replays.

use std::cell::RefCell;

use gpu_pool::graph::Graph;
use gpu_pool::interop::cudarc::cublas::CudaBlas;
use gpu_pool::prelude::*;

use super::{BATCH, CLASSES, Kernels, Work};
use crate::mlp_eager::pooled::{Model, forward};

/// Captures the forward pass of `x` into `probs` on `stream`: a graph that replays it.
pub fn capture<'a, 's: 'a>(
    stream: &'a Stream,
    (blas, k): (&'a CudaBlas, &'a Kernels),
    model: &'a Model,
    x: &'a RefCell<DeviceMat<'s, f32>>,
    probs: &'a RefCell<DeviceMat<'s, f32>>,
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
    x: &RefCell<DeviceMat<'_, f32>>,
    probs: &RefCell<DeviceMat<'_, f32>>,
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

/// The host's time in each part of `n` steps (upload, launch, download and wait), in µs a step.
pub fn phases(
    graph: &Graph<'_>,
    x: &RefCell<DeviceMat<'_, f32>>,
    probs: &RefCell<DeviceMat<'_, f32>>,
    work: &Work,
    n: usize,
) -> Result<[f64; 3], PoolError> {
    let mut out = vec![0.0; BATCH * CLASSES];
    let mut t = [std::time::Duration::ZERO; 3];
    for i in 0..n {
        let a = std::time::Instant::now();
        x.borrow_mut().upload(work.input(i % work.steps()))?;
        let b = std::time::Instant::now();
        graph.launch()?;
        let c = std::time::Instant::now();
        probs.borrow().download(&mut out)?;
        let d = std::time::Instant::now();
        t[0] += b - a;
        t[1] += c - b;
        t[2] += d - c;
    }
    Ok(t.map(|d| d.as_secs_f64() * 1e6 / n as f64))
}

/// `n` replays of `graph`, then one wait for them.
pub fn replay(stream: &Stream, graph: &Graph<'_>, n: usize) -> Result<(), PoolError> {
    for _ in 0..n {
        graph.launch()?;
    }
    stream.synchronize()
}
