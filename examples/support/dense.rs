//! A dense layer, `y = relu(x W + b)`, as a `#[pooled]` function: the GEMM in cuBLAS (through
//! cudarc) into a `buffer!` intermediate, then a bias + ReLU kernel; or the CPU twins of both on
//! the host backend. Shared by the `mlp_cublas` example and the GPU tests.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "the example and the tests use different parts"
)]

use gpu_pool::prelude::*;

pub const IN: usize = 256;
pub const OUT: usize = 128;
pub const BATCH: usize = 64;

/// The layer's weights (`IN x OUT`) and bias (`1 x OUT`), row-major: small values of both signs,
/// so the ReLU has work to do.
pub fn parameters() -> (Vec<f32>, Vec<f32>) {
    let w = (0..IN * OUT)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 400.0)
        .collect();
    let b = (0..OUT).map(|c| (c % 7) as f32 / 10.0 - 0.3).collect();
    (w, b)
}

/// The largest difference of `got` from the f64 CPU reference of the layer on `x`, `w`, `b`,
/// relative where the reference is above 1 in size.
pub fn largest_difference(got: &[f32], x: &[f32], w: &[f32], b: &[f32]) -> f32 {
    got.iter()
        .zip(reference(x, w, b))
        .map(|(g, e)| (g - e).abs() / e.abs().max(1.0))
        .fold(0.0f32, f32::max)
}

/// How the layer runs: cuBLAS and a kernel on a GPU, or CPU twins on the host backend.
pub enum Engine {
    Gpu {
        blas: gpu_pool::interop::Blas,
        kernels: super::kernels::Kernels,
    },
    Cpu,
}

/// `y = relu(x W + b)` for a batch: `x` is `BATCH x IN`, `w` is `IN x OUT`, `b` is `1 x OUT`,
/// `y` is `BATCH x OUT`, all row-major. `h = x W` is a temporary from the stream's stack.
#[pooled(stream)]
pub fn dense_relu(
    stream: &Stream,
    engine: &Engine,
    x: &impl GpuRead<f32>,
    w: &impl GpuRead<f32>,
    b: &impl GpuRead<f32>,
    y: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    match engine {
        Engine::Gpu { blas, kernels } => dense_relu_gpu(stream, blas, kernels, x, w, b, y),
        Engine::Cpu => {
            let mut h = buffer!(x.rows(), w.cols(); f32)?;
            cpu::gemm(x, w, &mut h)?;
            cpu::bias_relu(&h, b, y)
        }
    }
}

/// [`dense_relu`] on a GPU, with the cuBLAS handle and the kernels given apart (a handle lent to
/// `with_blas_workspace` is borrowed apart from its engine).
#[pooled(stream)]
pub fn dense_relu_gpu(
    stream: &Stream,
    blas: &gpu_pool::interop::cudarc::cublas::CudaBlas,
    kernels: &super::kernels::Kernels,
    x: &impl GpuRead<f32>,
    w: &impl GpuRead<f32>,
    b: &impl GpuRead<f32>,
    y: &mut impl GpuWrite<f32>,
) -> Result<(), PoolError> {
    // Packed: cuBLAS reads it at a leading dimension of its columns, not of a padded row.
    let mut h = buffer!(x.rows(), w.cols(); f32, packed)?;
    gpu::gemm(blas, x, w, &mut h)?;
    gpu::bias_relu(stream, kernels, &h, b, y)
}

mod gpu {
    use gpu_pool::interop::cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
    use gpu_pool::prelude::*;

    /// `h = x w`, row-major. cuBLAS is column-major, and a row-major matrix read column-major is
    /// its transpose: so it computes `h^T = w^T x^T`, with each matrix's step as its leading
    /// dimension.
    pub(super) fn gemm(
        blas: &CudaBlas,
        x: &impl GpuRead<f32>,
        w: &impl GpuRead<f32>,
        h: &mut impl GpuWrite<f32>,
    ) -> Result<(), PoolError> {
        let (xs, ws) = (x.as_cudarc()?, w.as_cudarc()?);
        let mut hs = h.as_cudarc_mut()?;
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: w.cols() as i32,
            n: x.rows() as i32,
            k: x.cols() as i32,
            alpha: 1.0f32,
            lda: ws.ld() as i32,
            ldb: xs.ld() as i32,
            beta: 0.0f32,
            ldc: hs.ld() as i32,
        };
        // SAFETY: `w` holds k x m, `x` n x k and `h` n x m row-major f32 at the leading dimensions
        // given (each lent whole, steps included), so every access stays inside them.
        unsafe { blas.gemm(cfg, &ws, &xs, &mut hs) }?;
        Ok(())
    }

    /// `y = max(h + b, 0)`, `b` broadcast over the rows.
    pub(super) fn bias_relu(
        stream: &Stream,
        k: &super::super::kernels::Kernels,
        h: &impl GpuRead<f32>,
        b: &impl GpuRead<f32>,
        y: &mut impl GpuWrite<f32>,
    ) -> Result<(), PoolError> {
        let cuda = stream.cudarc().expect("a GPU engine runs on a CUDA stream");
        // SAFETY: `h` and `y` are on this stream's device (the launcher checks their shapes)
        // and `b` holds `y.cols()` floats; `h` is a stack buffer this stream alone reuses, after
        // the kernel.
        unsafe {
            super::super::kernels::bias_relu(k, cuda, h.pitched(), b.device_ptr(), y.pitched_mut())
        }?;
        Ok(())
    }
}

mod cpu {
    use gpu_pool::prelude::*;

    /// The CPU twin of the GEMM, on the host backend's buffers.
    pub(super) fn gemm(
        x: &impl GpuRead<f32>,
        w: &impl GpuRead<f32>,
        h: &mut impl GpuWrite<f32>,
    ) -> Result<(), PoolError> {
        let xs: Vec<&[f32]> = x.host_rows()?.collect();
        let ws: Vec<&[f32]> = w.host_rows()?.collect();
        h.for_each_host_row_mut(|r, row| {
            for (c, out) in row.iter_mut().enumerate() {
                *out = (0..xs[r].len()).map(|i| xs[r][i] * ws[i][c]).sum();
            }
        })
    }

    /// The CPU twin of `bias_relu`.
    pub(super) fn bias_relu(
        h: &impl GpuRead<f32>,
        b: &impl GpuRead<f32>,
        y: &mut impl GpuWrite<f32>,
    ) -> Result<(), PoolError> {
        let hs: Vec<&[f32]> = h.host_rows()?.collect();
        let bias = b.to_vec()?;
        y.for_each_host_row_mut(|r, row| {
            for (c, out) in row.iter_mut().enumerate() {
                *out = (hs[r][c] + bias[c]).max(0.0);
            }
        })
    }
}

/// The reference: the same layer in plain Rust, f64 sums.
pub fn reference(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0f32; BATCH * OUT];
    for r in 0..BATCH {
        for c in 0..OUT {
            let dot: f64 = (0..IN)
                .map(|i| f64::from(x[r * IN + i]) * f64::from(w[i * OUT + c]))
                .sum();
            y[r * OUT + c] = (dot as f32 + b[c]).max(0.0);
        }
    }
    y
}

/// The engine for `stream`: cuBLAS on a CUDA stream, the CPU twins on the host backend; and where,
/// in words.
pub fn engine(device: &Device, stream: &Stream) -> Result<(Engine, String), PoolError> {
    if stream.cudarc().is_err() {
        return Ok((
            Engine::Cpu,
            format!("{} (host backend: CPU twins)", device.id()),
        ));
    }
    // `PoolError::NoCudaLibrary` where libcublas cannot be loaded (cudarc's `CudaBlas::new` would
    // panic).
    let blas = stream.cublas()?;
    let kernels = super::kernels::Kernels::load(device);
    Ok((
        Engine::Gpu { blas, kernels },
        format!("{} (cuBLAS GEMM + a bias/ReLU kernel)", device.id()),
    ))
}
