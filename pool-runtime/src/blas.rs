//! cuBLAS on a pool stream: a handle made only where the library loads, so a missing `libcublas`
//! is a [`PoolError::NoCudaLibrary`], never cudarc's panic.

use cudarc::cublas::CudaBlas;

use crate::backend::cuda::ContextGuard;
use crate::error::PoolError;
use crate::stream::Stream;

/// Whether `libcublas` can be loaded. cudarc panics on the first cuBLAS call when it cannot, so
/// [`Stream::cublas`] asks this first.
fn cublas_present() -> bool {
    // SAFETY: only tries to open the library by its usual names; nothing in it is called.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

impl Stream {
    /// A cuBLAS handle whose work is queued on this stream, for cuBLAS calls on pool buffers
    /// (lent with [`GpuRead::as_cudarc`](crate::GpuRead::as_cudarc)). Feature `cublas`.
    ///
    /// Use it rather than cudarc's `CudaBlas::new`, which panics where `libcublas` cannot be
    /// loaded: `PoolError::NoCudaLibrary` if it cannot (checked first, wherever the stream runs);
    /// `PoolError::Unsupported` on the host backend; `PoolError::Cublas` if cuBLAS could not make
    /// the handle (its `CublasError` as the source). The caller's current CUDA context is kept.
    ///
    /// ```no_run
    /// use gpu_pool_runtime::{Device, PoolError, Stream};
    /// let stream = Stream::new(&Device::cuda(0)?)?;
    /// let blas = stream.cublas()?; // then `unsafe { blas.gemm(cfg, &a.as_cudarc()?, ...) }?`
    /// # drop(blas);
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn cublas(&self) -> Result<CudaBlas, PoolError> {
        if !cublas_present() {
            return Err(PoolError::NoCudaLibrary { library: "cublas" });
        }
        let Some(cuda) = self.cuda_stream() else {
            return Err(PoolError::Unsupported {
                device: self.device().id(),
                what: "cuBLAS",
            });
        };
        // cudarc binds the stream's context to this thread; the caller's stays current.
        let _restore = ContextGuard::keep_current()?;
        Ok(CudaBlas::new(cuda.clone())?)
    }
}
