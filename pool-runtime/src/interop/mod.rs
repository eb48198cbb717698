//! CUDA interop: pool memory lent to cudarc ([`LentSlice`]), buffers as kernel arguments
//! ([`LaunchArgsExt`], [`Pitched`], [`grid_2d`]), cuBLAS handles ([`Blas`]), and the [`cudarc`]
//! this crate was built with.

#[cfg(feature = "cublas")]
pub(crate) mod blas;
#[cfg(feature = "cuda")]
pub(crate) mod device_memory;
#[cfg(feature = "cuda")]
pub(crate) mod kernel_args;

#[cfg(feature = "cublas")]
#[cfg_attr(docsrs, doc(cfg(feature = "cublas")))]
pub use blas::{BLAS_WORKSPACE_BYTES, Blas, with_blas_workspace};
/// The cudarc this crate was built with, for launching kernels on pool buffers.
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use cudarc;
// The types are the core's (what its traits return); what makes them cudarc's is here.
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use crate::core::lent::{LentSlice, LentSliceMut};
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use crate::core::pitched::{Pitched, PitchedMut};
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use kernel_args::{BLOCK_2D, LaunchArgsExt, PITCHED_H, PitchedArg, grid_2d};
