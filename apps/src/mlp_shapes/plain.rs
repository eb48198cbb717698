//! The cudarc twin with graphs by hand: one graph per batch, captured with `begin_capture` /
//! `end_capture` the first time the batch is seen (its temporaries allocated inside: the graph's
//! allocation and free nodes), each with its own input and output slices.

use std::collections::HashMap;

use gpu_pool::interop::cudarc::driver::{CudaGraph, CudaSlice, sys};

use crate::mlp_eager::plain::{Res, Twin};
use crate::mlp_eager::{CLASSES, IN, Kernels};

/// A batch's graph and the memory it reads and writes (the graph is destroyed first).
struct Captured {
    graph: CudaGraph,
    x: CudaSlice<f32>,
    probs: CudaSlice<f32>,
}

/// Every batch's graph so far.
#[derive(Default)]
pub(crate) struct ByBatch {
    graphs: HashMap<usize, Captured>,
}

impl ByBatch {
    fn graph(&mut self, twin: &Twin, k: &Kernels, batch: usize) -> Res<&mut Captured> {
        use std::collections::hash_map::Entry;
        match self.graphs.entry(batch) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(e) => {
                let s = &twin.stream;
                let x = s.alloc_zeros::<f32>(batch * IN)?;
                let mut probs = s.alloc_zeros::<f32>(batch * CLASSES)?;
                s.synchronize()?;
                s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
                let worked = twin.forward(k, &x, &mut probs, batch);
                let ended = s.end_capture(sys::CUgraphInstantiate_flags(0));
                worked?;
                let graph = ended?.ok_or("cudarc's capture made no graph")?;
                Ok(e.insert(Captured { graph, x, probs }))
            }
        }
    }

    /// One step: uploads the input into the batch's slice, replays, downloads, waits.
    pub(crate) fn step(
        &mut self,
        twin: &Twin,
        k: &Kernels,
        input: &[f32],
        out: &mut [f32],
    ) -> Res<()> {
        let c = self.graph(twin, k, input.len() / IN)?;
        let s = &twin.stream;
        s.memcpy_htod(input, &mut c.x)?;
        c.graph.launch()?;
        s.memcpy_dtoh(&c.probs, out)?;
        s.synchronize()?;
        Ok(())
    }

    /// The forward pass alone for `batch`: one replay, queued.
    pub(crate) fn forward(&mut self, twin: &Twin, k: &Kernels, batch: usize) -> Res<()> {
        self.graph(twin, k, batch)?.graph.launch()?;
        Ok(())
    }

    /// Graphs held.
    pub(crate) fn len(&self) -> usize {
        self.graphs.len()
    }
}
