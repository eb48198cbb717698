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
//! fn gray_sum(stream: &Stream, src: &DeviceMat<'_, [u8; 3]>) -> Result<u64, PoolError> {
//!     let mut gray = buffer!(src.rows(), src.cols(); u8)?;   // 2D, pitched, from the stack
//!     gray.set_to(1)?;                                       // ... kernels would go here
//!     Ok(gray.to_vec()?.iter().map(|&v| u64::from(v)).sum())
//! }                                                          // gray goes back to the stack
//!
//! let stream = Stream::new(&Device::cuda_or_host())?;
//! let src = DeviceMat::new(&stream, 48, 64)?;
//! assert_eq!(gray_sum(&stream, &src)?, 48 * 64);
//! assert_eq!(stream.stats().stack_in_use, 0);
//! # Ok::<(), PoolError>(())
//! ```
//!
//! The runtime underneath can be used directly: [`Stream::temp`] takes a [`Temp`] as `buffer!`
//! does, [`DeviceMat`] is a driver allocation, [`config::DeviceConfig`] configures a device, and
//! OpenCV's own names (`GpuMat`, `BufferPool`, `set_buffer_pool_config`) are in
//! [`compat::opencv`].
//!
//! # Where things are
//! - [`prelude`]: what most code needs, macros included.
//! - The root: the core types ([`Stream`], [`Device`], [`PoolError`], the [`GpuRead`] /
//!   [`GpuWrite`] traits, views, [`Source`], [`Pooled`], [`HostMem`]).
//! - One module per feature: [`config`], [`alloc`], `graph`, [`shared`], `nccl`, [`observe`],
//!   [`interop`] (cudarc, cuBLAS, kernel arguments), [`compat`] (the seed APIs), `testing`.

pub use gpu_pool_macros::{GraphKey, buffer, gpu_scope, pooled};

// The core, at the root: every item is at one path (and the common ones in the prelude too).
pub use gpu_pool_runtime::{
    AsStream, CallSite, CaptureError, Cause, Device, DeviceId, DeviceMat, Element, FallbackReason,
    GpuRead, GpuView, GpuViewMut, GpuWrite, HostMem, PinnedHost, PoolError, Pooled, RequestContext,
    Source, Stream, Temp,
};

// One module per feature: `graph` (cuda), `nccl` and `testing` are there when the runtime was built
// with them (the glob names only those three).
pub use gpu_pool_runtime::__features::*;
pub use gpu_pool_runtime::{alloc, compat, config, interop, observe, shared};

#[doc(hidden)]
pub use gpu_pool_runtime::__private;

/// The names most code needs, macros and the traits whose methods buffers are used through
/// included: `use gpu_pool::prelude::*;`.
///
/// ```
/// use gpu_pool::prelude::*;
///
/// fn fill(out: &mut impl GpuWrite<f32>, v: f32) -> Result<(), PoolError> {
///     out.set_to(v)
/// }
///
/// #[pooled(stream)]
/// fn sum(stream: &Stream, n: usize) -> Result<f32, PoolError> {
///     let mut x = buffer!(n; f32)?;
///     fill(&mut x, 0.5)?;
///     Ok(x.to_vec()?.iter().sum())
/// }
///
/// let stream = Stream::new(&Device::host())?;
/// assert_eq!(sum(&stream, 8)?, 4.0);
/// assert_eq!(stream.stats().stack_in_use, 0);
/// # Ok::<(), PoolError>(())
/// ```
pub mod prelude {
    #[doc(no_inline)]
    pub use gpu_pool_macros::{GraphKey, buffer, gpu_scope, pooled};
    #[doc(no_inline)]
    pub use gpu_pool_runtime::graph::GraphKey;
    #[cfg(feature = "cuda")]
    #[doc(no_inline)]
    pub use gpu_pool_runtime::interop::{LaunchArgsExt, Pitched, grid_2d};
    #[doc(no_inline)]
    pub use gpu_pool_runtime::shared::SharedMat;
    #[doc(no_inline)]
    pub use gpu_pool_runtime::{
        Device, DeviceMat, GpuRead, GpuView, GpuViewMut, GpuWrite, HostMem, PoolError, Pooled,
        Source, Stream, Temp,
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
