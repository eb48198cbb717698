//! # gpu-pool
//!
//! Allocation-free GPU temporaries. Every stream owns a slice of one pre-allocated block of device
//! memory (a stack); `buffer!` bump-allocates from it and the buffer goes back, in reverse order,
//! when its name goes out of scope. The order is checked by the compiler, not by a debug assert.
//!
//! ```
//! use gpu_pool::prelude::*;
//!
//! /// Fills `out` from `src` through two temporaries. Inputs are `&impl GpuRead`, outputs
//! /// `&mut impl GpuWrite`: a `DeviceMat`, a `buffer!` handle, a region or shared memory all fit.
//! #[pooled(stream)]
//! fn gray_threshold(
//!     stream: &Stream,
//!     src: &impl GpuRead<[u8; 3]>,
//!     out: &mut impl GpuWrite<u8>,
//! ) -> Result<usize, PoolError> {
//!     let mut gray = buffer!(src.rows(), src.cols(); u8)?;   // 2D, pitched, from the stack
//!     let sums = buffer!(src.rows(); f32)?;                  // 1D, contiguous, from the stack
//!     gray.set_to(0)?;                                       // ... launch kernels on gray, sums ...
//!     out.copy_from(&gray)?;
//!     Ok(gray.step() + sums.len())
//! }   // sums, then gray, go back to the stack: nothing reaches the driver
//!
//! fn main() -> Result<(), PoolError> {
//!     let device = Device::cuda_or_host();                   // a GPU if there is one
//!     let stream = Stream::new(&device)?;                    // the stream's stack is made lazily
//!     let src = DeviceMat::new(&stream, 480, 640)?;          // a driver allocation, any order
//!     let mut out = DeviceMat::new(&stream, 480, 640)?;
//!     for _ in 0..100 {
//!         gray_threshold(&stream, &src, &mut out)?;
//!     }
//!     assert_eq!(stream.stats().fallback_allocations.total(), 0);
//!     println!("{}", gpu_pool::observe::report());         // peak use, fallbacks, the config to use
//!     Ok(())
//! }
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
//! - One module per job: [`config`], [`alloc`], [`observe`], [`interop`] (cudarc, cuBLAS, kernel
//!   arguments), [`compat`] (the seed APIs); and one per feature: `graph`, `shared`, `nccl`,
//!   `testing`.
//!
//! # Features
//! The default is what the example above needs. Each other feature is opt-in; what each adds to a
//! build is measured in BENCHMARKS.md (*Build cost*), and each item that needs one says so here.
//!
//! | feature | default | gives | adds to the build |
//! |---|---|---|---|
//! | `cuda` | yes | the CUDA backend (`Device::cuda`, kernel arguments); without it, the host backend only | cudarc and libloading; CUDA is loaded at run time, so it builds without CUDA installed |
//! | `graph` | no | the `graph` module: `Stream::capture`, graph families, and graphed functions (`#[pooled(stream, graph)]`, one graph per shape; eager on the host backend) | typeid (one small crate), and its code: a tenth of the runtime's compile |
//! | `shared` | no | the `shared` module: `SharedMat`, memory every stream reads and writes, ordered by events | nothing (its code only: a seventh of the runtime's compile) |
//! | `cublas` | no | `Stream::cublas`, cuBLAS workspaces from the stack, `gpu_pool::interop::cudarc::cublas` | cudarc's cuBLAS bindings (`libcublas` loaded at run time) |
//! | `nccl` | no | the `nccl` module: collectives on pool buffers, stacks NCCL can register (turns on `graph`) | cudarc's NCCL bindings (`libnccl` loaded at run time) |
//! | `timeline` | no | `observe::timeline`: recordings as a Chrome trace and an SVG chart | serde_json and plotters, with their dependencies |
//! | `testing` | no | the `testing` module: fault injection and leak checks on the host backend | nothing |
//! | `pplcv` | no | `compat::pplcv`: ppl.cv's memory pool (`PplPool` and the ppl.cv-named functions) | nothing (its code only) |
//! | `mix` | no | `compat::mix`: TensorRT-style `MixMemory`, a page-locked host and device pair | nothing (its code only) |
//! | `tracing` | no | the runtime's events (a free that failed in a `Drop`, a fallback taken, a LIFO violation) as `tracing` events for your subscriber; without it, errors and warnings go to stderr, one line each | tracing, tracing-core, once_cell, pin-project-lite |
//!
//! Element types of your own are `#[repr(C)]` structs that implement `bytemuck::Pod`: derive it
//! with bytemuck's `derive` feature in your own bytemuck dependency (gpu-pool does not turn it on,
//! since it builds a parser of its own).
//!
//! # Versions
//! The public API is every item these docs show; `#[doc(hidden)]` items (`__private`, the macros'
//! expansion) are not part of it. CHANGELOG.md says what each version changed and what a minor
//! version may change.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub use gpu_pool_macros::{GraphKey, buffer, gpu_scope, pooled};

// The core, at the root: every item is at one path (and the common ones in the prelude too).
pub use gpu_pool_runtime::{
    AsStream, CallSite, CaptureError, Cause, Device, DeviceId, DeviceMat, Element, FallbackReason,
    GpuRead, GpuView, GpuViewMut, GpuWrite, HostMem, PinnedHost, PoolError, Pooled, RequestContext,
    Source, Stream, Temp,
};

// One module per feature: `graph`, `shared`, `nccl` and `testing` are there when the runtime was
// built with them (the glob names only those four).
#[allow(
    unused_imports,
    unreachable_pub,
    reason = "a build without any of the four has none"
)]
pub use gpu_pool_runtime::__features::*;
pub use gpu_pool_runtime::{alloc, compat, config, interop, observe};

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
    // `GraphKey` (feature `graph`) and `SharedMat` (feature `shared`) where the runtime has them
    // (cargo may have turned its features on for another package): through the runtime's glob,
    // and by name in the docs, where each shows its feature.
    #[cfg(not(docsrs))]
    #[allow(
        unused_imports,
        unreachable_pub,
        reason = "a build without `graph` and `shared` has neither"
    )]
    pub use gpu_pool_runtime::__features::prelude::*;
    #[cfg(all(docsrs, feature = "graph"))]
    #[doc(cfg(feature = "graph"), no_inline)]
    pub use gpu_pool_runtime::graph::GraphKey;
    #[cfg(feature = "cuda")]
    #[doc(no_inline)]
    pub use gpu_pool_runtime::interop::{LaunchArgsExt, Pitched, grid_2d};
    #[cfg(all(docsrs, feature = "shared"))]
    #[doc(cfg(feature = "shared"), no_inline)]
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
