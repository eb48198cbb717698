//! CUDA interop: pool memory lent to cudarc, kernel arguments, cuBLAS handles.

#[cfg(feature = "cublas")]
pub(crate) mod blas;
#[cfg(feature = "cuda")]
pub(crate) mod device_memory;
#[cfg(feature = "cuda")]
pub(crate) mod kernel_args;
