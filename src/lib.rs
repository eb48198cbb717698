//! # gpu-pool
//!
//! Allocation-free GPU temporaries. Every stream owns a slice of one pre-allocated block of device
//! memory (a stack); `buffer!` bump-allocates from it and the buffer goes back, in reverse order,
//! when its name goes out of scope. The order is checked by the compiler, not by a debug assert.
//!
//! ```
//! use gpu_pool::prelude::*;
//!
//! #[pooled(stream)]
//! fn gray_sum(stream: &Stream, src: &GpuMat<'_, [u8; 3]>) -> Result<u64, PoolError> {
//!     let mut gray = buffer!(src.rows(), src.cols(); u8)?;   // 2D, pitched, from the stack
//!     gray.set_to(1)?;                                       // ... kernels would go here
//!     Ok(gray.to_vec()?.iter().map(|&v| u64::from(v)).sum())
//! }                                                          // gray goes back to the stack
//!
//! let stream = Stream::new(&Device::cuda_or_host())?;
//! let src = GpuMat::new(&stream, 48, 64)?;
//! assert_eq!(gray_sum(&stream, &src)?, 48 * 64);
//! assert_eq!(stream.stats().stack_in_use, 0);
//! # Ok::<(), PoolError>(())
//! ```
//!
//! The runtime underneath ([`BufferPool`], [`GpuMat`], [`set_buffer_pool_config`], ...) follows
//! OpenCV's `cv::cuda::BufferPool` and can be used directly.

pub use gpu_pool_macros::{buffer, gpu_scope, pooled};
pub use gpu_pool_runtime::*;

/// The names most code needs, macros included.
pub mod prelude {
    pub use gpu_pool_macros::{buffer, gpu_scope, pooled};
    pub use gpu_pool_runtime::{
        BufferPool, Device, DeviceMat, GpuMat, GpuRead, GpuView, GpuViewMut, GpuWrite, HostMem,
        PoolError, Pooled, SharedMat, Source, Stream, Temp,
    };
}

/// The guide, the reference by task: the DSL, outputs, shared weights, threads and streams,
/// copies, kernel arguments, stacks and configuration, sizing, graphs, NCCL, the seed APIs and
/// errors, each with an example compiled as a doctest.
#[doc = include_str!("../docs/guide.md")]
pub mod guide {}

/// The README's examples, compiled and run as doctests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
