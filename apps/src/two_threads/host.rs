//! CPU twins of the kernels, on the host backend's buffers: what the gpu-pool twin runs where
//! there is no CUDA device (f32, as the GPU computes).

use gpu_pool::prelude::*;

use super::{Step, part_of};

/// Twins of `affine`, `square` and `block_sum`, one after the other.
pub(super) fn pipeline(
    s: &Step,
    y: &mut impl GpuWrite<f32>,
    z: &mut impl GpuWrite<f32>,
    partial: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    y.for_each_host_row_mut(|_, row| {
        for (i, v) in row.iter_mut().enumerate() {
            *v = s.a.mul_add((i % 1024) as f32, s.b);
        }
    })?;
    let ys: Vec<f32> = y.to_vec()?;
    z.for_each_host_row_mut(|_, row| {
        for (v, &y) in row.iter_mut().zip(&ys) {
            *v = y * y;
        }
    })?;
    let mut sums = vec![0.0f32; partial.len()];
    for (i, v) in z.to_vec()?.into_iter().enumerate() {
        sums[part_of(i)] += v;
    }
    partial.upload(&sums)
}
