//! The gpu-pool twin: the weights in `SharedMat`s that both workers read through guards, each
//! request's eight temporaries from its worker's stack with `buffer!`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use gpu_pool::interop::cudarc::cublas::{CudaBlas, Gemm};
use gpu_pool::interop::cudarc::driver::PushKernelArg;
use gpu_pool::prelude::*;

use super::{D, HEADS, Kernels, Request, Weights, Work, host};

/// The model on the device: the projections (`D x D`) and the RMSNorm gain (`1 x D`), packed,
/// read by every worker.
#[derive(Debug)]
pub struct Model {
    wq: SharedMat<f32>,
    wk: SharedMat<f32>,
    wv: SharedMat<f32>,
    wo: SharedMat<f32>,
    gain: SharedMat<f32>,
}

impl Model {
    /// Uploads `w` on `stream`.
    pub fn load(stream: &Stream, w: &Weights) -> Result<Model, PoolError> {
        let upload = |rows, data: &[f32]| -> Result<SharedMat<f32>, PoolError> {
            let mut m = SharedMat::new_packed(stream.device(), rows, D)?;
            m.write(stream)?.upload(data)?;
            Ok(m)
        };
        Ok(Model {
            wq: upload(D, &w.wq)?,
            wk: upload(D, &w.wk)?,
            wv: upload(D, &w.wv)?,
            wo: upload(D, &w.wo)?,
            gain: upload(1, &w.gain)?,
        })
    }
}

/// A worker: its stream, its cuBLAS handle (none on the host backend) and the pageable `Vec` its
/// results are downloaded into.
#[derive(Debug)]
pub struct Worker {
    stream: Stream,
    blas: Option<gpu_pool::interop::Blas>,
    host: Vec<f32>,
    /// The pool's driver calls on this worker's threads, since the last `take_calls`.
    calls: gpu_pool::observe::DriverCalls,
}

impl Worker {
    /// A worker on `device` for results of up to `largest` floats.
    pub fn new(device: &Device, largest: usize) -> Result<Worker, PoolError> {
        let stream = Stream::new(device)?;
        let blas = match stream.cudarc().ok() {
            Some(_) => Some(stream.cublas()?),
            None => None,
        };
        Ok(Worker {
            stream,
            blas,
            host: vec![0.0; largest],
            calls: gpu_pool::observe::DriverCalls::default(),
        })
    }

    /// The pool's driver calls this worker made since the last call, and a fresh count.
    pub fn take_calls(&mut self) -> gpu_pool::observe::DriverCalls {
        std::mem::take(&mut self.calls)
    }
}

/// What a request runs on a GPU: the worker's cuBLAS handle and the kernels.
type Gpu<'a> = Option<(&'a CudaBlas, &'a Kernels)>;

/// Serves the first `n` requests of `work`, each worker on a thread of its own taking the next
/// request from a shared counter. With `keep`, returns each request's output with its index.
pub fn serve(
    model: &Arc<Model>,
    kernels: Option<&Kernels>,
    workers: &mut [Worker],
    work: &Work,
    n: usize,
    keep: bool,
) -> Result<Vec<(usize, Vec<f32>)>, PoolError> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let threads: Vec<_> = workers
            .iter_mut()
            .map(|w| {
                let (model, next) = (Arc::clone(model), &next);
                s.spawn(move || -> Result<Vec<(usize, Vec<f32>)>, PoolError> {
                    let mut kept = Vec::new();
                    let gpu = w.blas.as_deref().zip(kernels);
                    let start = gpu_pool::observe::DriverCalls::on_this_thread();
                    loop {
                        let i = next.fetch_add(1, Relaxed);
                        let Some(r) = work.requests.get(i).filter(|_| i < n) else {
                            let calls =
                                gpu_pool::observe::DriverCalls::on_this_thread().since(start);
                            w.calls = w.calls + calls;
                            return Ok(kept);
                        };
                        let out = &mut w.host[..r.len()];
                        attend(&w.stream, gpu, &model, r, work.input(r), out)?;
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
#[pooled(stream)]
fn attend(
    stream: &Stream,
    gpu: Gpu<'_>,
    model: &Model,
    r: &Request,
    input: &[f32],
    output: &mut [f32],
) -> Result<(), PoolError> {
    let (wq, wk, wv) = (
        model.wq.read(stream)?,
        model.wk.read(stream)?,
        model.wv.read(stream)?,
    );
    let (wo, gain) = (model.wo.read(stream)?, model.gain.read(stream)?);
    let m = r.rows();
    let mut x = buffer!(m, D; f32, packed)?;
    let mut xn = buffer!(m, D; f32, packed)?;
    let mut q = buffer!(m, D; f32, packed)?;
    let mut k = buffer!(m, D; f32, packed)?;
    let mut v = buffer!(m, D; f32, packed)?;
    let mut scores = buffer!(r.batch * HEADS * r.seq, r.seq; f32, packed)?;
    let mut ctx = buffer!(m, D; f32, packed)?;
    let mut out = buffer!(m, D; f32, packed)?;
    x.upload(input)?;
    rmsnorm(stream, gpu, &x, &gain, &mut xn)?;
    gemm(gpu, &xn, &wq, &mut q)?;
    gemm(gpu, &xn, &wk, &mut k)?;
    gemm(gpu, &xn, &wv, &mut v)?;
    attention_scores(gpu, r, &q, &k, &mut scores)?;
    causal_softmax(stream, gpu, r.seq, &mut scores)?;
    attention_context(gpu, r, &scores, &v, &mut ctx)?;
    gemm(gpu, &ctx, &wo, &mut out)?;
    out.download(output)
}

/// `xn = rmsnorm(x) * gain`.
fn rmsnorm(
    stream: &Stream,
    gpu: Gpu<'_>,
    x: &impl GpuRead<f32>,
    gain: &impl GpuRead<f32>,
    xn: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let (Some((_, kernels)), Some(cuda)) = (gpu, stream.cudarc().ok()) else {
        return host::rmsnorm(x, gain, xn);
    };
    let (xp, gp, yp) = (x.device_ptr(), gain.device_ptr(), xn.device_ptr());
    let (rows, cols) = (x.rows() as i32, x.cols() as i32);
    let mut launch = cuda.launch_builder(&kernels.rmsnorm);
    launch.arg(&xp).arg(&gp).arg(&yp).arg(&rows).arg(&cols);
    // SAFETY: `x` and `xn` are packed `rows x cols` floats and `gain` holds `cols`, all memory of
    // this stream (or read on it, for `gain`) that outlives the kernel in the stream's order.
    unsafe { launch.launch(super::warp_rows(x.rows())) }?;
    Ok(())
}

/// `scores = causal softmax of scores`, in place, rows of `seq`.
fn causal_softmax(
    stream: &Stream,
    gpu: Gpu<'_>,
    seq: usize,
    scores: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let (Some((_, kernels)), Some(cuda)) = (gpu, stream.cudarc().ok()) else {
        return host::causal_softmax(seq, scores);
    };
    let (sp, rows, seq_i) = (scores.device_ptr(), scores.rows() as i32, seq as i32);
    let mut launch = cuda.launch_builder(&kernels.causal_softmax);
    launch.arg(&sp).arg(&rows).arg(&seq_i);
    // SAFETY: `scores` is packed `rows x seq` floats of this stream, alive past the kernel.
    unsafe { launch.launch(super::warp_rows(scores.rows())) }?;
    Ok(())
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

/// `scores = q k^T / sqrt(HEAD)` for every (batch element, head): one strided-batched GEMM per
/// element over its heads.
fn attention_scores(
    gpu: Gpu<'_>,
    r: &Request,
    q: &impl GpuRead<f32>,
    k: &impl GpuRead<f32>,
    scores: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let Some((blas, _)) = gpu else {
        return host::attention_scores(r, q, k, scores);
    };
    let (seq, block) = (r.seq, HEADS * r.seq);
    for b in 0..r.batch {
        let tokens = b * seq..(b + 1) * seq;
        let (qb, kb) = (q.row_range(tokens.clone())?, k.row_range(tokens)?);
        let mut sb = scores.row_range_mut(b * block..(b + 1) * block)?;
        let (qb, kb, mut sb) = (qb.as_cudarc()?, kb.as_cudarc()?, sb.as_cudarc_mut()?);
        // SAFETY: the element's `seq` rows of `q` and `k` hold its heads at `HEAD` apart, and its
        // `HEADS * seq` rows of `scores` one `seq x seq` block a head, as `scores_config` says.
        unsafe { blas.gemm_strided_batched(super::scores_config(seq), &kb, &qb, &mut sb) }?;
    }
    Ok(())
}

/// `ctx = probs v` for every (batch element, head): one strided-batched GEMM per element.
fn attention_context(
    gpu: Gpu<'_>,
    r: &Request,
    probs: &impl GpuRead<f32>,
    v: &impl GpuRead<f32>,
    ctx: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let Some((blas, _)) = gpu else {
        return host::attention_context(r, probs, v, ctx);
    };
    let (seq, block) = (r.seq, HEADS * r.seq);
    for b in 0..r.batch {
        let tokens = b * seq..(b + 1) * seq;
        let (pb, vb) = (
            probs.row_range(b * block..(b + 1) * block)?,
            v.row_range(tokens.clone())?,
        );
        let mut cb = ctx.row_range_mut(tokens)?;
        let (pb, vb, mut cb) = (pb.as_cudarc()?, vb.as_cudarc()?, cb.as_cudarc_mut()?);
        // SAFETY: as in `attention_scores`, with `context_config`'s shapes.
        unsafe { blas.gemm_strided_batched(super::context_config(seq), &vb, &pb, &mut cb) }?;
    }
    Ok(())
}
