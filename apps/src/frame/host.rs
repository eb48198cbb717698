//! CPU twins of the kernels, on the host backend's buffers: what the gpu-pool twin runs where
//! there is no CUDA device.

use gpu_pool::prelude::*;

use super::{THRESHOLD, box3_at, gray_of, threshold_of};

/// Twin of `bgr_to_gray`.
pub(super) fn to_gray(
    bgr: &impl GpuRead<[u8; 3]>,
    gray: &mut impl GpuWrite<u8>,
) -> Result<(), PoolError> {
    let src: Vec<&[[u8; 3]]> = bgr.host_rows()?.collect();
    gray.for_each_host_row_mut(|r, out| {
        out.iter_mut()
            .zip(src[r])
            .for_each(|(o, &p)| *o = gray_of(p));
    })
}

/// Twin of `box3`.
pub(super) fn box3(src: &impl GpuRead<u8>, dst: &mut impl GpuWrite<u8>) -> Result<(), PoolError> {
    let (rows, cols, img) = (src.rows(), src.cols(), src.to_vec()?);
    dst.for_each_host_row_mut(|y, out| {
        for (x, o) in out.iter_mut().enumerate() {
            *o = box3_at(&img, (rows, cols), (y, x));
        }
    })
}

/// Twin of `threshold` at [`THRESHOLD`].
pub(super) fn threshold(
    src: &impl GpuRead<u8>,
    dst: &mut impl GpuWrite<u8>,
) -> Result<(), PoolError> {
    let src: Vec<&[u8]> = src.host_rows()?.collect();
    dst.for_each_host_row_mut(|r, out| {
        out.iter_mut()
            .zip(src[r])
            .for_each(|(o, &v)| *o = threshold_of(v, THRESHOLD));
    })
}
