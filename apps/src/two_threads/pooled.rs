//! The gpu-pool twin: each thread's stream serves its steps' three temporaries with `buffer!`.

use gpu_pool::interop::cudarc::driver::PushKernelArg;
use gpu_pool::prelude::*;

use super::{Kernels, PARTS, Step, host};

/// A thread's stream and the pageable `Vec` its results are downloaded into.
#[derive(Debug)]
pub struct Worker {
    stream: Stream,
    host: Vec<f32>,
}

impl Worker {
    /// A worker with a stream of its own on `device`.
    pub fn new(device: &Device) -> Result<Worker, PoolError> {
        Ok(Worker {
            stream: Stream::new(device)?,
            host: vec![0.0; PARTS],
        })
    }
}

/// Runs `lists[t]` on worker `t`'s thread, for every worker at once. With `keep`, returns every
/// step's result, by thread.
pub fn run(
    kernels: Option<&Kernels>,
    workers: &mut [Worker],
    lists: &[Vec<Step>],
    keep: bool,
) -> Result<Vec<Vec<Vec<f32>>>, PoolError> {
    std::thread::scope(|s| {
        let threads: Vec<_> = workers
            .iter_mut()
            .zip(lists)
            .map(|(w, list)| {
                s.spawn(move || -> Result<Vec<Vec<f32>>, PoolError> {
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
#[pooled(stream)]
fn pipeline(
    stream: &Stream,
    kernels: Option<&Kernels>,
    s: &Step,
    result: &mut [f32],
) -> Result<(), PoolError> {
    let mut y = buffer!(s.n; f32)?;
    let mut z = buffer!(s.n; f32)?;
    let mut partial = buffer!(PARTS; f32)?;
    match kernels.zip(stream.cudarc().ok()) {
        Some((k, cuda)) => {
            let n = s.n as i32;
            // SAFETY: `y` and `z` hold `n` floats and `partial` `PARTS`, as the kernels take them;
            // all three are this stream's and outlive the kernels in its order.
            unsafe {
                let mut affine = cuda.launch_builder(&k.affine);
                affine.arg(&mut y).arg(&n).arg(&s.a).arg(&s.b);
                affine.launch(super::elementwise(s.n))?;
                let mut square = cuda.launch_builder(&k.square);
                square.arg(&y).arg(&mut z).arg(&n);
                square.launch(super::elementwise(s.n))?;
                let mut sum = cuda.launch_builder(&k.block_sum);
                sum.arg(&z).arg(&n).arg(&mut partial);
                sum.launch(super::reduction())?;
            }
        }
        None => host::pipeline(s, &mut y, &mut z, &mut partial)?,
    }
    partial.download(result)
}
