//! The runtime of [gpu-pool](https://docs.rs/gpu-pool): per-stream stack pools, fallback
//! allocators, global configuration and statistics, on a CUDA or a host backend.
//!
//! Most users depend on the `gpu-pool` facade instead, which adds the `#[pooled]` DSL.
//!
//! ```
//! use gpu_pool_runtime::{BufferPool, Device, GpuRead, GpuWrite, Source, Stream};
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
//! Each folder under `src/` is a layer: `base`, `storage`, `allocators`, `core`, the features
//! (`graph`, `shared`, `host_mem`, `nccl`), `interop`, `compat`, `observe`, low to high. A file
//! imports only its own layer and lower ones; a feature uses the core's seams and no other feature
//! (but `nccl` records in `graph`s). `tests/layers.rs` checks every path. `ARCHITECTURE.md`, at the
//! repository's root, draws the layers, the seams and a buffer's path through them.
//!
//! # A buffer's path
//! `buffer!` (or [`BufferPool::get_buffer`]) asks its stream for memory: `Stream::take`
//! (`stream/lease.rs`) lays the shape out (`layout`), bumps the stack (`stack`) or asks the
//! fallback allocator, and returns a `Lease`: the one value that holds the memory and knows how it
//! goes back. [`GpuMat`] is a lease with a shape. Dropping it drops the lease, which gives the
//! memory back to the stack, or to the allocator, or keeps it while a CUDA graph may use it
//! (`stream/capture.rs`). A lease is made only by a take and is neither `Copy` nor `Clone`, so
//! memory goes back once.
//!
//! # Memory no stream owns
//! A [`SharedMat`] holds a `SharedMemory` (`stream/sharing.rs`): a driver allocation and the
//! events of its last write and of each stream's reads since. An access names its stream; it
//! begins by making that stream wait for the accesses it conflicts with and ends by recording an
//! event there. Inside a capture the host waits instead, and each replay of the graph is an access
//! of its own, waited for and recorded around its launch. Views carry whose order their memory
//! follows (`Keeper`), so a copy out of shared memory on another stream is waited for by the
//! stream the access names.

mod allocators;
mod base;
pub mod compat;
mod core;
#[cfg(feature = "cuda")]
pub mod graph;
mod host_mem;
mod interop;
#[cfg(feature = "nccl")]
pub mod nccl;
mod observe;
pub mod shared;
mod storage;

// The paths the modules used before they moved into layer folders; removed once every `use` names
// the layer.
use self::core::{
    access, arena, buffer, capturing, config, device, frame, ledger, pinned, record, stack, stats,
    stream, symmetric, view,
};
use allocators as allocator;
use allocators::caching;
use base::{counters, error, holders, id, layout, source, sync, unique};
use compat::mix;
pub use compat::pplcv;
#[cfg(feature = "cublas")]
use interop::blas;
#[cfg(feature = "cuda")]
use interop::{device_memory, kernel_args};
use observe::report;
#[cfg(feature = "testing")]
pub use observe::testing;
#[cfg(feature = "timeline")]
pub use observe::timeline;
use storage::backend;

pub use access::{GpuRead, GpuWrite, PinnedHost};
pub use allocator::{
    AllocContext, AllocRequest, Allocation, DriverAllocator, GpuAllocator, NoFallback,
    StreamOrderedAllocator,
};
pub use backend::calls::DriverCalls;
#[cfg(feature = "cublas")]
pub use blas::{BLAS_WORKSPACE_BYTES, Blas, with_blas_workspace};
pub use buffer::{DeviceMat, Temp};
pub use caching::{CachingPool, CachingStats};
pub use compat::opencv::{BufferPool, GpuMat};
pub use config::{
    DeviceConfig, ENV_VAR, EnvConfig, Fallback, Packing, PoolConfig, Stacks, buffer_pool_usage,
    env_config, set_buffer_pool_usage,
};
pub use device::{Device, set_buffer_pool_config};
#[cfg(feature = "cuda")]
pub use device_memory::{LentSlice, LentSliceMut};
#[cfg(feature = "nccl")]
pub use error::NcclFailure;
pub use error::{Cause, PoolError, RequestContext};
pub use frame::{AsStream, Element, Pooled};
#[cfg(feature = "cuda")]
pub use graph::{Graph, GraphFamily, GraphNodes};
pub use holders::{IdleHolding, Reclaimed, ReclaimedFrom};
pub use host_mem::HostMem;
pub use id::DeviceId;
#[cfg(feature = "cuda")]
pub use kernel_args::{BLOCK_2D, PITCHED_H, Pitched, PitchedMut, grid_2d};
pub use layout::{Footprint, MAX_ELEMENT_ALIGN};
pub use mix::MixMemory;
pub use record::{Event, EventKind, StreamRecording};
pub use report::{Report, report};
pub use shared::{SharedMat, SharedRead, SharedWrite};
pub use source::{CallSite, FallbackReason, Source};
pub use stack::LayoutTrace;
pub use stats::{DeviceStats, FallbackCounts, SiteFallbacks, StreamStats};
pub use stream::{Sizing, Stream};
pub use symmetric::check_symmetric;
pub use view::{GpuView, GpuViewMut};

/// The crate README's example, compiled and run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// What the DSL's expansion calls; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use crate::frame::{frame, handle, take, take_1d, take_packed};
}

/// The cudarc this crate was built with, for launching kernels on pool buffers.
/// # use gpu_pool_runtime::{GpuRead, GpuWrite};
#[cfg(feature = "cuda")]
pub use cudarc;
