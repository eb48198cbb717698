//! CPU twins of the kernels and cuBLAS calls, on the host backend's buffers: what the gpu-pool
//! twin runs where there is no CUDA device (f32, as the GPU computes).

use gpu_pool::prelude::*;

use super::{D, HEAD, HEADS, Request};

/// The rows of `m`, each `m.cols()` floats.
fn rows(m: &impl GpuRead<f32>) -> Result<Vec<&[f32]>, PoolError> {
    Ok(m.host_rows()?.collect())
}

/// Twin of the `rmsnorm` kernel.
pub(super) fn rmsnorm(
    x: &impl GpuRead<f32>,
    gain: &impl GpuRead<f32>,
    xn: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let (xs, gain) = (rows(x)?, gain.to_vec()?);
    xn.for_each_host_row_mut(|r, out| {
        let mean = xs[r].iter().map(|v| v * v).sum::<f32>() / xs[r].len() as f32;
        let scale = 1.0 / (mean + 1e-5).sqrt();
        for ((o, &v), &g) in out.iter_mut().zip(xs[r]).zip(&gain) {
            *o = v * scale * g;
        }
    })
}

/// Twin of the `causal_softmax` kernel.
pub(super) fn causal_softmax(seq: usize, s: &mut impl GpuWrite<f32>) -> Result<(), PoolError> {
    s.for_each_host_row_mut(|r, row| {
        let i = r % seq;
        let max = row[..=i].iter().copied().fold(f32::MIN, f32::max);
        row[..=i].iter_mut().for_each(|v| *v = (*v - max).exp());
        let sum: f32 = row[..=i].iter().sum();
        row[..=i].iter_mut().for_each(|v| *v /= sum);
        row[i + 1..].fill(0.0);
    })
}

/// Twin of the GEMM `c = a b`.
pub(super) fn gemm(
    a: &impl GpuRead<f32>,
    b: &impl GpuRead<f32>,
    c: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let (a, b) = (rows(a)?, rows(b)?);
    c.for_each_host_row_mut(|r, out| {
        out.fill(0.0);
        for (&x, br) in a[r].iter().zip(&b) {
            for (o, &w) in out.iter_mut().zip(*br) {
                *o += x * w;
            }
        }
    })
}

/// Twin of the scores' strided-batched GEMMs: `scores[b][h][i][j] = q_bh[i] . k_bh[j] / 8`.
pub(super) fn attention_scores(
    r: &Request,
    q: &impl GpuRead<f32>,
    k: &impl GpuRead<f32>,
    scores: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let (q, k, seq) = (rows(q)?, rows(k)?, r.seq);
    let scale = 1.0 / (HEAD as f32).sqrt();
    scores.for_each_host_row_mut(|row, out| {
        let (b, h, i) = (row / (HEADS * seq), row / seq % HEADS, row % seq);
        let head = h * HEAD..(h + 1) * HEAD;
        let qi = &q[b * seq + i][head.clone()];
        for (j, o) in out.iter_mut().enumerate() {
            let kj = &k[b * seq + j][head.clone()];
            *o = qi.iter().zip(kj).map(|(x, y)| x * y).sum::<f32>() * scale;
        }
    })
}

/// Twin of the context's strided-batched GEMMs: `ctx_bh[i] = sum_j probs[b][h][i][j] v_bh[j]`.
pub(super) fn attention_context(
    r: &Request,
    probs: &impl GpuRead<f32>,
    v: &impl GpuRead<f32>,
    ctx: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let (p, v, seq) = (rows(probs)?, rows(v)?, r.seq);
    ctx.for_each_host_row_mut(|row, out| {
        let (b, i) = (row / seq, row % seq);
        out.fill(0.0);
        for (h, head) in out.chunks_mut(HEAD).enumerate() {
            let pi = p[(b * HEADS + h) * seq + i];
            for (j, &w) in pi.iter().enumerate() {
                let vj = &v[b * seq + j][h * HEAD..(h + 1) * HEAD];
                head.iter_mut().zip(vj).for_each(|(o, &x)| *o += w * x);
            }
        }
        debug_assert_eq!(out.len(), D);
    })
}
