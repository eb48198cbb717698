//! The cudarc twin: each thread its own stream (`ctx.new_stream()`), each step's three
//! temporaries allocated on it (stream-ordered `cuMemAllocAsync`, freed when they drop).

use std::error::Error;
use std::sync::Arc;

use gpu_pool::interop::cudarc::driver::{CudaContext, CudaStream, PushKernelArg};

use super::{Kernels, PARTS, Step};

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// Temporaries a step allocates (and frees).
pub(super) const TEMPORARIES: usize = 3;

/// A thread's stream and the `Vec` its results are copied into.
pub(super) struct Worker {
    stream: Arc<CudaStream>,
    host: Vec<f32>,
}

impl Worker {
    /// A worker with a new stream of `ctx`.
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Res<Worker> {
        Ok(Worker {
            stream: ctx.new_stream()?,
            host: vec![0.0; PARTS],
        })
    }
}

/// Runs `lists[t]` on worker `t`'s thread, for every worker at once; with `keep`, returns every
/// step's result, by thread.
pub(super) fn run(
    ctx: &Arc<CudaContext>,
    kernels: &Kernels,
    workers: &mut [Worker],
    lists: &[Vec<Step>],
    keep: bool,
) -> Res<Vec<Vec<Vec<f32>>>> {
    std::thread::scope(|s| {
        let threads: Vec<_> = workers
            .iter_mut()
            .zip(lists)
            .map(|(w, list)| {
                s.spawn(move || -> Res<Vec<Vec<f32>>> {
                    ctx.bind_to_thread()?;
                    let mut kept = Vec::new();
                    for step in list {
                        pipeline(&w.stream, kernels, step, &mut w.host)?;
                        if keep {
                            kept.push(w.host.clone());
                        }
                    }
                    Ok(kept)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a worker panicked"))
            .collect()
    })
}

/// One step: `result` = the block sums of `(a * (i % 1024) + b)^2` over `s.n` elements.
fn pipeline(cs: &Arc<CudaStream>, k: &Kernels, s: &Step, result: &mut [f32]) -> Res<()> {
    // SAFETY: each is written in full by a kernel before it is read.
    let (mut y, mut z, mut partial) = unsafe {
        (
            cs.alloc::<f32>(s.n)?,
            cs.alloc::<f32>(s.n)?,
            cs.alloc::<f32>(PARTS)?,
        )
    };
    let n = s.n as i32;
    // SAFETY: `y` and `z` hold `n` floats and `partial` `PARTS`, as the kernels take them; all
    // three are freed on `cs` after the kernels.
    unsafe {
        let mut affine = cs.launch_builder(&k.affine);
        affine.arg(&mut y).arg(&n).arg(&s.a).arg(&s.b);
        affine.launch(super::elementwise(s.n))?;
        let mut square = cs.launch_builder(&k.square);
        square.arg(&y).arg(&mut z).arg(&n);
        square.launch(super::elementwise(s.n))?;
        let mut sum = cs.launch_builder(&k.block_sum);
        sum.arg(&z).arg(&n).arg(&mut partial);
        sum.launch(super::reduction())?;
    }
    cs.memcpy_dtoh(&partial, result)?;
    cs.synchronize()?;
    Ok(())
}
