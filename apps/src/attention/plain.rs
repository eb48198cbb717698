//! The cudarc twin: the weights as `CudaSlice`s uploaded once, each request's eight temporaries
//! allocated on its worker's stream (stream-ordered `cuMemAllocAsync`, freed when they drop).

use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use gpu_pool::interop::cudarc::cublas::{CudaBlas, Gemm};
use gpu_pool::interop::cudarc::driver::{CudaContext, CudaSlice, CudaStream, PushKernelArg};

use super::{D, HEADS, Kernels, Request, Weights, Work};

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// Temporaries a request allocates (and frees).
pub(super) const TEMPORARIES: usize = 8;

/// The model on the device: `wq`, `wk`, `wv`, `wo` and the gain.
pub(super) struct Model {
    w: [CudaSlice<f32>; 4],
    gain: CudaSlice<f32>,
}

impl Model {
    /// Uploads `w` on a stream of its own and waits: the workers read it from theirs.
    pub(super) fn load(ctx: &Arc<CudaContext>, w: &Weights) -> Res<Model> {
        let stream = ctx.new_stream()?;
        let model = Model {
            w: [
                stream.clone_htod(&w.wq)?,
                stream.clone_htod(&w.wk)?,
                stream.clone_htod(&w.wv)?,
                stream.clone_htod(&w.wo)?,
            ],
            gain: stream.clone_htod(&w.gain)?,
        };
        stream.synchronize()?;
        Ok(model)
    }
}

/// A worker: its stream, its cuBLAS handle and the `Vec` its results are copied into.
pub(super) struct Worker {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    host: Vec<f32>,
}

impl Worker {
    /// A worker on a new stream of `ctx`, for results of up to `largest` floats.
    pub(super) fn new(ctx: &Arc<CudaContext>, largest: usize) -> Res<Worker> {
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        Ok(Worker {
            stream,
            blas,
            host: vec![0.0; largest],
        })
    }
}

/// Serves the first `n` requests of `work` on the workers' threads; with `keep`, returns each
/// request's output with its index.
pub(super) fn serve(
    ctx: &Arc<CudaContext>,
    model: &Arc<Model>,
    kernels: &Kernels,
    workers: &mut [Worker],
    work: &Work,
    n: usize,
    keep: bool,
) -> Res<Vec<(usize, Vec<f32>)>> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let threads: Vec<_> = workers
            .iter_mut()
            .map(|w| {
                let (model, next) = (Arc::clone(model), &next);
                s.spawn(move || -> Res<Vec<(usize, Vec<f32>)>> {
                    ctx.bind_to_thread()?; // cuBLAS launches in the thread's current context
                    let mut kept = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Relaxed);
                        let Some(r) = work.requests.get(i).filter(|_| i < n) else {
                            return Ok(kept);
                        };
                        let out = &mut w.host[..r.len()];
                        attend(&w.stream, &w.blas, kernels, &model, r, work.input(r), out)?;
                        if keep {
                            kept.push((i, out.to_vec()));
                        }
                    }
                })
            })
            .collect();
        let mut outputs = Vec::new();
        for t in threads {
            outputs.extend(t.join().expect("a worker panicked")?);
        }
        Ok(outputs)
    })
}

/// One request: `output = attention(input)`, `r.rows() x D` each.
fn attend(
    s: &Arc<CudaStream>,
    blas: &CudaBlas,
    kernels: &Kernels,
    model: &Model,
    r: &Request,
    input: &[f32],
    output: &mut [f32],
) -> Res<()> {
    let (m, seq, block) = (r.rows(), r.seq, HEADS * r.seq);
    // SAFETY: each temporary is written in full (by the upload, a kernel or a GEMM) before it is
    // read.
    let (mut x, mut xn, mut q, mut k, mut v, mut scores, mut ctx, mut out) = unsafe {
        (
            s.alloc::<f32>(m * D)?,
            s.alloc::<f32>(m * D)?,
            s.alloc::<f32>(m * D)?,
            s.alloc::<f32>(m * D)?,
            s.alloc::<f32>(m * D)?,
            s.alloc::<f32>(r.batch * block * seq)?,
            s.alloc::<f32>(m * D)?,
            s.alloc::<f32>(m * D)?,
        )
    };
    s.memcpy_htod(input, &mut x)?;
    let (rows, cols) = (m as i32, D as i32);
    let mut launch = s.launch_builder(&kernels.rmsnorm);
    launch
        .arg(&x)
        .arg(&model.gain)
        .arg(&mut xn)
        .arg(&rows)
        .arg(&cols);
    // SAFETY: `x` and `xn` hold `m x D` floats, `gain` `D`; all outlive the kernel on `s`.
    unsafe { launch.launch(super::warp_rows(m)) }?;
    let [wq, wk, wv, wo] = &model.w;
    let project = super::gemm_config(m, D, D);
    // SAFETY: the operands are packed matrices of the shapes the configuration says (`m x D`,
    // `D x D`; per batch element its `seq` rows and `HEADS * seq` score rows), so cuBLAS stays
    // inside each slice; all are used on `s`, the handle's stream.
    unsafe {
        blas.gemm(project, wq, &xn, &mut q)?;
        blas.gemm(project, wk, &xn, &mut k)?;
        blas.gemm(project, wv, &xn, &mut v)?;
        for b in 0..r.batch {
            let tokens = b * seq * D..(b + 1) * seq * D;
            let (qb, kb) = (q.slice(tokens.clone()), k.slice(tokens));
            let mut sb = scores.slice_mut(b * block * seq..(b + 1) * block * seq);
            blas.gemm_strided_batched(super::scores_config(seq), &kb, &qb, &mut sb)?;
        }
    }
    let (rows, seq_i) = ((r.batch * block) as i32, seq as i32);
    let mut launch = s.launch_builder(&kernels.causal_softmax);
    launch.arg(&mut scores).arg(&rows).arg(&seq_i);
    // SAFETY: `scores` holds `rows x seq` floats and outlives the kernel on `s`.
    unsafe { launch.launch(super::warp_rows(r.batch * block)) }?;
    // SAFETY: as for the GEMMs above.
    unsafe {
        for b in 0..r.batch {
            let tokens = b * seq * D..(b + 1) * seq * D;
            let (pb, vb) = (
                scores.slice(b * block * seq..(b + 1) * block * seq),
                v.slice(tokens.clone()),
            );
            let mut cb = ctx.slice_mut(tokens);
            blas.gemm_strided_batched(super::context_config(seq), &vb, &pb, &mut cb)?;
        }
        blas.gemm(project, wo, &ctx, &mut out)?;
    }
    s.memcpy_dtoh(&out, output)?;
    s.synchronize()?;
    Ok(())
}
