//! The cudarc twin: `mlp_eager`'s forward pass captured once with `begin_capture` /
//! `end_capture` on the twin's stream (its temporaries allocated inside the capture: the graph's
//! allocation and free nodes), replayed with `CudaGraph::launch`; the input and output are
//! `CudaSlice`s made once.

use gpu_pool::interop::cudarc::driver::{CudaGraph, CudaSlice, sys};

use super::{BATCH, CLASSES, IN, Kernels, Work};
use crate::mlp_eager::plain::{Res, Twin};

/// The graph and the memory it reads and writes. (The graph is declared first: it is destroyed
/// before the memory is freed.)
pub(crate) struct Captured {
    graph: CudaGraph,
    x: CudaSlice<f32>,
    probs: CudaSlice<f32>,
}

impl Captured {
    /// Captures `twin`'s forward pass of a batch-[`BATCH`] input into a graph.
    pub(crate) fn new(twin: &Twin, k: &Kernels) -> Res<Captured> {
        let s = &twin.stream;
        let x = s.alloc_zeros::<f32>(BATCH * IN)?;
        let mut probs = s.alloc_zeros::<f32>(BATCH * CLASSES)?;
        s.synchronize()?;
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let worked = twin.forward(k, &x, &mut probs, BATCH);
        let ended = s.end_capture(sys::CUgraphInstantiate_flags(0));
        worked?;
        let graph = ended?.ok_or("cudarc's capture made no graph")?;
        Ok(Captured { graph, x, probs })
    }

    /// Runs every step of `work`: uploads its input, replays the graph and hands the
    /// probabilities, downloaded into a pageable `Vec`, to `each`.
    pub(crate) fn run(
        &mut self,
        twin: &Twin,
        work: &Work,
        mut each: impl FnMut(usize, &[f32]),
    ) -> Res<()> {
        let (s, mut out) = (&twin.stream, vec![0.0; BATCH * CLASSES]);
        for i in 0..work.steps() {
            s.memcpy_htod(work.input(i), &mut self.x)?;
            self.graph.launch()?;
            s.memcpy_dtoh(&self.probs, &mut out)?;
            s.synchronize()?;
            each(i, &out);
        }
        Ok(())
    }

    /// The host's time in each part of `n` steps (upload, launch, download and wait), in µs a step.
    pub(crate) fn phases(&mut self, twin: &Twin, work: &Work, n: usize) -> Res<[f64; 3]> {
        let (s, mut out) = (&twin.stream, vec![0.0; BATCH * CLASSES]);
        let mut t = [std::time::Duration::ZERO; 3];
        for i in 0..n {
            let a = std::time::Instant::now();
            s.memcpy_htod(work.input(i % work.steps()), &mut self.x)?;
            let b = std::time::Instant::now();
            self.graph.launch()?;
            let c = std::time::Instant::now();
            s.memcpy_dtoh(&self.probs, &mut out)?;
            s.synchronize()?;
            let d = std::time::Instant::now();
            t[0] += b - a;
            t[1] += c - b;
            t[2] += d - c;
        }
        Ok(t.map(|d| d.as_secs_f64() * 1e6 / n as f64))
    }

    /// `n` replays of the graph, then one wait for them.
    pub(crate) fn replay(&self, twin: &Twin, n: usize) -> Res<()> {
        for _ in 0..n {
            self.graph.launch()?;
        }
        twin.stream.synchronize()?;
        Ok(())
    }
}
