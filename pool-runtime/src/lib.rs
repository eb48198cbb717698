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
//!
//! # Layers
//! Each module uses only modules of the layers below it (none imports one above, so there is no
//! import cycle). A buffer's path, stream -> frame -> stack -> buffer -> release, reads in files
//! named for each step.
//!
//! 1. Vocabulary, depending on nothing of the crate: `source` (where memory came from and why,
//!    and who asked: [`Source`], [`FallbackReason`], [`CallSite`]), `unique` (ids that never
//!    repeat), `sync` (the one lock).
//! 2. `error` ([`PoolError`]), then `layout` (how a shape becomes bytes: the one home of the
//!    pitch and alignment rules), `config` ([`PoolConfig`], `GPU_POOL_CONF`, the one settings
//!    lookup), `stats` (counters and their snapshots), `record` (the opt-in event ring).
//! 3. Storage, which knows memory and not policy: `backend` (host and CUDA: allocate, copy, fill,
//!    streams and events), and `storage` (one device's backend and its counted driver calls).
//! 4. Pools, built on storage: `stack` (one stream's bump stack), `allocator` (the [`GpuAllocator`]
//!    API and the built-in fallbacks, on [`AllocContext`]), `caching` ([`CachingPool`]).
//! 5. `device`: the composition root. A [`Device`] holds its storage, its stack arena, its settings
//!    and its caching pool, and chooses each new stream's fallback.
//! 6. `stream` ([`Stream`]: takes from its stack, else from its allocator), then what users hold:
//!    `buffer` ([`GpuMat`], [`BufferPool`]), `view` (views and regions), `frame` (what the DSL
//!    expands to), `mix` ([`MixMemory`]), `pplcv`, and, with CUDA, `graph`, `device_memory` and
//!    `kernel_args`.
//! 7. `report` (every device's stats), `timeline` (recordings as a Chrome trace and an SVG
//!    chart) and `testing` (hooks for tests, with the `testing` feature), over everything.

mod allocator;
mod arena;
mod backend;
mod buffer;
mod caching;
mod capturing;
mod config;
mod device;
#[cfg(feature = "cuda")]
mod device_memory;
mod error;
mod frame;
#[cfg(feature = "cuda")]
pub mod graph;
#[cfg(feature = "cuda")]
mod kernel_args;
mod layout;
mod ledger;
mod mix;
pub mod pplcv;
mod record;
mod report;
mod source;
mod stack;
mod stats;
mod storage;
mod stream;
mod sync;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "timeline")]
pub mod timeline;
mod unique;
mod view;

pub use allocator::{
    AllocContext, AllocRequest, Allocation, DriverAllocator, GpuAllocator, NoFallback,
    StreamOrderedAllocator,
};
pub use buffer::{BufferPool, GpuMat};
pub use caching::{CachingPool, CachingStats};
pub use config::{
    ENV_VAR, EnvConfig, Fallback, PoolConfig, buffer_pool_usage, env_config, set_buffer_pool_usage,
};
pub use device::{Device, set_buffer_pool_config};
#[cfg(feature = "cuda")]
pub use device_memory::{LentSlice, LentSliceMut};
pub use error::{DeviceId, PoolError, Request};
pub use frame::{AsStream, Element, Pooled};
#[cfg(feature = "cuda")]
pub use graph::Graph;
pub use layout::MAX_ELEMENT_ALIGN;
pub use mix::MixMemory;
pub use record::{Event, EventKind, StreamRecording};
pub use report::{Report, report};
pub use source::{CallSite, FallbackReason, Source};
pub use stats::{DeviceStats, FallbackCounts, SiteFallbacks, StreamStats};
pub use stream::Stream;
pub use view::{GpuView, GpuViewMut};

/// The crate README's example, compiled and run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// What the DSL's expansion calls; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use crate::frame::{frame, handle, take, take_1d};
}

/// The cudarc this crate was built with, for launching kernels on pool buffers.
#[cfg(feature = "cuda")]
pub use cudarc;
