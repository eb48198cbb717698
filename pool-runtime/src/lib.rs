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
//! Each module has a rank and imports only modules of a lower rank, never one of its own, so no
//! import cycle can form. `tests/layers.rs` reads the table below and checks every path into the
//! crate against it, the names re-exported here included (`crate::LentSlice` is an import of
//! `device_memory`); only `#[cfg(test)] mod` blocks may look anywhere. Every module file is named
//! once (a file under a module's directory is `dir::file`), or belongs to its nearest named parent
//! (`stream/lease.rs` is part of `stream`): a new module is one more name in a row, or a row of its
//! own (ranks only have to grow down the table).
//!
//! | rank | modules | what they hold |
//! |---:|---|---|
//! | 1 | `source`, `id`, `unique`, `sync`, `holders` | vocabulary: [`Source`], [`DeviceId`], ids, the lock; idle memory and who holds it ([`Reclaimed`]) |
//! | 2 | `error` | [`PoolError`] |
//! | 3 | `layout` | how a shape becomes bytes: the pitch and alignment rules |
//! | 4 | `config` | [`PoolConfig`], `GPU_POOL_CONF`: the one settings lookup |
//! | 5 | `stats`, `record` | counters and their snapshots; the opt-in event ring |
//! | 7 | `backend` | what a backend does: allocate, copy, fill, streams and events |
//! | 8 | `backend::host`, `backend::cuda`, `storage` | backends; counted driver calls |
//! | 9 | `stack`, `allocator`, `capturing` | a stream's bump stack; [`GpuAllocator`] and fallbacks; what a capture asks of every stream |
//! | 10 | `arena`, `pinned`, `ledger` | one allocation cut into a device's stacks; page-locked memory freed once its copies are done; what a stream shares with its device (counters, peak and fallback sites, recording, its stack's idle memory) |
//! | 11 | `device` | the composition root: storage, stack arena, settings, stream ledgers |
//! | 12 | `caching` | [`CachingPool`], made for a device |
//! | 13 | `stream` | [`Stream`]: the take and give-back (`stream/lease.rs`), its work, its captures |
//! | 14 | `view`, `graph`, `pplcv`, `symmetric` | views and regions; CUDA graphs; ppl.cv's pool; the symmetric-stack check |
//! | 15 | `buffer`, `mix`, `shared`, `host_mem` | [`GpuMat`], [`BufferPool`]; [`MixMemory`]; [`SharedMat`], memory no stream owns; [`HostMem`], page-locked memory for asynchronous copies |
//! | 16 | `frame` | what the DSL expands to |
//! | 17 | `device_memory`, `kernel_args`, `blas` | CUDA interop: views lent to cudarc; kernel arguments; cuBLAS handles |
//! | 18 | `access` | [`GpuRead`] / [`GpuWrite`]: one parameter type for every kind of buffer |
//! | 19 | `nccl` | NCCL communicators over pool streams; stacks in memory NCCL registers |
//! | 20 | `report`, `timeline`, `testing` | every device's stats; recordings exported; test hooks |
//!
//! Storage (ranks 7 and 8) knows memory, not policy; the stack and the allocators (9) build on
//! it and never name the device; the device holds the arena and its settings; the caching pool and
//! the streams sit on the device (a stream chooses its fallback when it is made); the user-facing
//! types (14 to 16) sit on the stream, CUDA interop on them, the one parameter type for all of them
//! (18) on top, NCCL (19) over it, and the reports on everything.
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

mod access;
mod allocator;
mod arena;
mod backend;
#[cfg(feature = "cublas")]
mod blas;
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
mod holders;
mod host_mem;
mod id;
#[cfg(feature = "cuda")]
mod kernel_args;
mod layout;
mod ledger;
mod mix;
#[cfg(feature = "nccl")]
pub mod nccl;
mod pinned;
pub mod pplcv;
mod record;
mod report;
pub mod shared;
mod source;
mod stack;
mod stats;
mod storage;
mod stream;
mod symmetric;
mod sync;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "timeline")]
pub mod timeline;
mod unique;
mod view;

pub use access::{GpuRead, GpuWrite};
pub use allocator::{
    AllocContext, AllocRequest, Allocation, DriverAllocator, GpuAllocator, NoFallback,
    StreamOrderedAllocator,
};
pub use backend::calls::DriverCalls;
#[cfg(feature = "cublas")]
pub use blas::{BLAS_WORKSPACE_BYTES, Blas, with_blas_workspace};
pub use buffer::{BufferPool, GpuMat};
pub use caching::{CachingPool, CachingStats};
pub use config::{
    ENV_VAR, EnvConfig, Fallback, Packing, PoolConfig, buffer_pool_usage, env_config,
    set_buffer_pool_usage,
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
    pub use crate::frame::{handle, scope, take, take_1d, take_packed};
}

/// The cudarc this crate was built with, for launching kernels on pool buffers.
/// # use gpu_pool_runtime::{GpuRead, GpuWrite};
#[cfg(feature = "cuda")]
pub use cudarc;
