//! CPU twins of the kernels and the cuBLAS call, on the host backend's buffers: what the gpu-pool
//! twin runs where there is no CUDA device (f32, as the GPU computes).

use gpu_pool::prelude::*;

/// Twin of the GEMM `c = a b`.
pub(crate) fn gemm(
    a: &impl GpuRead<f32>,
    b: &impl GpuRead<f32>,
    c: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    let a: Vec<&[f32]> = a.host_rows()?.collect();
    let b: Vec<&[f32]> = b.host_rows()?.collect();
    c.for_each_host_row_mut(|r, out| {
        out.fill(0.0);
        for (&x, br) in a[r].iter().zip(&b) {
            out.iter_mut().zip(*br).for_each(|(o, &w)| *o += x * w);
        }
    })
}

/// Twin of `bias_relu` (`relu`) and `bias`: `m = m + b`, then `max(.., 0)` with `relu`.
pub(crate) fn add_bias(
    relu: bool,
    m: &mut impl GpuWrite<f32>,
    b: &impl GpuRead<f32>,
) -> Result<(), PoolError> {
    let b = b.to_vec()?;
    m.for_each_host_row_mut(|_, row| {
        for (v, &bias) in row.iter_mut().zip(&b) {
            *v += bias;
            if relu {
                *v = v.max(0.0);
            }
        }
    })
}

/// Twin of `softmax`.
pub(crate) fn softmax(z: &impl GpuRead<f32>, p: &mut impl GpuWrite<f32>) -> Result<(), PoolError> {
    let z: Vec<&[f32]> = z.host_rows()?.collect();
    p.for_each_host_row_mut(|r, out| {
        let max = z[r].iter().copied().fold(f32::MIN, f32::max);
        out.iter_mut()
            .zip(z[r])
            .for_each(|(o, &v)| *o = (v - max).exp());
        let sum: f32 = out.iter().sum();
        out.iter_mut().for_each(|o| *o /= sum);
    })
}
