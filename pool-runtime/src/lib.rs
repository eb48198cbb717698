//! The runtime of [gpu-pool](https://docs.rs/gpu-pool): per-stream stack pools, fallback
//! allocators, global configuration and statistics, on a CUDA or a host backend.
//!
//! Most users depend on the `gpu-pool` facade instead, which adds the `#[pooled]` DSL.
//!
//! ```
//! use gpu_pool_runtime::{BufferPool, Device, Source, Stream};
//! let stream = Stream::new(&Device::host())?;
//! let pool = BufferPool::new(&stream);
//! let mut a = pool.get_buffer::<f32>(64, 64)?;
//! a.set_to(1.5)?;
//! assert_eq!(a.source(), Source::Stack);
//! assert!(a.to_vec()?.iter().all(|&x| x == 1.5));
//! # Ok::<(), gpu_pool_runtime::PoolError>(())
//! ```
//!
//! # Guarantees
//! - A request that fits the stream's stack takes no lock, allocates nothing on the heap and calls
//!   no driver function.
//! - Live buffers never overlap, whatever order safe code releases them in: a block released out of
//!   LIFO order is reclaimed once the blocks above it are released, and counted as a violation.
//! - Every bad input is a [`PoolError`]; no input panics.

mod backend;
mod buffer;
mod caching;
mod config;
mod device;
#[cfg(feature = "cuda")]
mod device_memory;
mod error;
mod fallback;
mod frame;
#[cfg(feature = "cuda")]
pub mod graph;
#[cfg(feature = "cuda")]
mod kernel_args;
mod layout;
mod mix;
pub mod pplcv;
mod stack;
mod stats;
mod stream;
mod sync;
mod unique;
mod view;

pub use buffer::{BufferPool, GpuMat};
pub use caching::{CachingPool, CachingStats, DEFAULT_LEADING_BITS, bin_of};
pub use config::{
    ENV_VAR, EnvConfig, Fallback, PoolConfig, buffer_pool_usage, env_config,
    set_buffer_pool_config, set_buffer_pool_usage,
};
pub use device::Device;
#[cfg(feature = "cuda")]
pub use device_memory::{DeviceMut, DeviceRef};
pub use error::{DeviceId, PoolError};
pub use fallback::{
    AllocContext, AllocRequest, Allocation, DriverAllocator, GpuAllocator, NoFallback,
    StreamOrderedAllocator,
};
pub use frame::{AsStream, Element, Pooled};
#[cfg(feature = "cuda")]
pub use graph::Graph;
pub use layout::MAX_ELEMENT_ALIGN;
pub use mix::MixMemory;
pub use stats::{DeviceStats, FallbackCounts, FallbackReason, Report, StreamStats, report};
pub use stream::{Source, Stream};
pub use view::{GpuView, GpuViewMut};

/// The crate README's example, compiled and run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// What the DSL's expansion calls; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use crate::frame::{Frame, Owner, frame};
}

/// The cudarc this crate was built with, for launching kernels on pool buffers.
#[cfg(feature = "cuda")]
pub use cudarc;
