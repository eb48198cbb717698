//! The runtime of [gpu-pool](https://docs.rs/gpu-pool): per-stream stack pools, fallback
//! allocators, global configuration and statistics, on a CUDA or a host backend.
//!
//! Most users depend on the `gpu-pool` facade instead, which adds the `#[pooled]` DSL.
//!
//! ```
//! use gpu_pool::{Device, GpuRead, GpuWrite, Source, Stream};
//! let stream = Stream::new(&Device::host())?;
//! let mut a = stream.temp::<f32>(64, 64)?; // a Temp, from the stream's stack
//! a.set_to(1.5)?;
//! assert_eq!(a.source(), Source::Stack);
//! assert!(a.to_vec()?.iter().all(|&x| x == 1.5));
//! # Ok::<(), gpu_pool::PoolError>(())
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
//! `buffer!` (or [`Stream::temp`]) asks its stream for memory: `Stream::take`
//! (`core/stream/lease.rs`) lays the shape out (`layout`), bumps the stack (`stack`) or asks the
//! fallback allocator, and returns a `Lease`: the one value that holds the memory and knows how it
//! goes back. [`Temp`] is a lease with a shape ([`DeviceMat`] one of driver memory). Dropping it drops the lease, which gives the
//! memory back to the stack, or to the allocator, or keeps it while a CUDA graph may use it
//! (`core/stream/capture.rs`). A lease is made only by a take and is neither `Copy` nor `Clone`, so
//! memory goes back once.
//!
//! # Memory no stream owns
//! A `SharedMat` (feature `shared`) holds a `SharedMemory` (`shared/memory.rs`): a driver allocation and the
//! events of its last write and of each stream's reads since. An access names its stream; it
//! begins by making that stream wait for the accesses it conflicts with and ends by recording an
//! event there. Inside a capture the host waits instead, and each replay of the graph is an access
//! of its own, waited for and recorded around its launch. Views carry whose order their memory
//! follows (`Keeper`), so a copy out of shared memory on another stream is waited for by the
//! stream the access names.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod allocators;
mod base;
pub mod compat;
mod core;
#[cfg(all(feature = "graph", feature = "cuda"))]
#[cfg_attr(docsrs, doc(cfg(feature = "graph")))]
pub mod graph;
/// CUDA graphs; without CUDA only what graphed functions need, which then run eagerly.
#[cfg(all(feature = "graph", not(feature = "cuda")))]
#[cfg_attr(docsrs, doc(cfg(feature = "graph")))]
#[path = "graph/eager.rs"]
pub mod graph;
#[cfg(not(feature = "graph"))]
#[path = "graph/off.rs"]
mod graph;
mod host_mem;
pub mod interop;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod observe;
#[cfg(feature = "shared")]
pub mod shared;
mod storage;
#[cfg(feature = "testing")]
#[path = "observe/testing.rs"]
pub mod testing;

// The core, at the root: what every use of the pool names.
pub use self::core::access::{GpuRead, GpuWrite, PinnedHost};
pub use self::core::buffer::{DeviceMat, Temp};
pub use self::core::device::Device;
pub use self::core::scope::{AsStream, Element, Pooled};
pub use self::core::stream::Stream;
pub use self::core::view::{GpuView, GpuViewMut};
pub use base::error::{CaptureError, Cause, PoolError, RequestContext};
pub use base::id::DeviceId;
pub use base::source::{CallSite, FallbackReason, Source};
pub use host_mem::HostMem;

/// Settings: the stacks' size and count, the fallback, the packing, the `GPU_POOL_CONF`
/// environment variable, and what a shape takes of a stack.
pub mod config {
    pub use crate::core::config::{
        DeviceConfig, ENV_VAR, EnvConfig, Fallback, Packing, PoolConfig, Stacks, env_config,
    };
    // OpenCV's process-wide switch is public in `compat::opencv`; the crate reads it here.
    pub use crate::base::layout::{Footprint, MAX_ELEMENT_ALIGN};
    #[allow(unused_imports)]
    pub(crate) use crate::core::config::*;
}

/// Where memory comes from when a stack cannot serve a request: the [`GpuAllocator`](alloc::GpuAllocator) API, the
/// allocators it ships with, the [`CachingPool`](alloc::CachingPool), and the idle memory the pool can reclaim.
pub mod alloc {
    pub use crate::allocators::caching::{CachingPool, CachingStats};
    pub use crate::allocators::{
        AllocContext, AllocRequest, Allocation, DriverAllocator, GpuAllocator, NoFallback,
        StreamOrderedAllocator,
    };
    pub use crate::base::holders::{IdleHolding, Reclaimed, ReclaimedFrom};
}

/// The crate README's example, compiled and run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The feature modules this build has, for the facade to re-export whichever the runtime was
/// built with (its own features may be fewer: cargo unifies the runtime's); not part of the API.
#[doc(hidden)]
pub mod __features {
    #[cfg(feature = "graph")]
    pub use crate::graph;
    #[cfg(feature = "nccl")]
    pub use crate::nccl;
    #[cfg(feature = "shared")]
    pub use crate::shared;
    #[cfg(feature = "testing")]
    pub use crate::testing;

    /// The prelude's names from the features this build has.
    pub mod prelude {
        #[cfg(feature = "graph")]
        pub use crate::graph::GraphKey;
        #[cfg(feature = "shared")]
        pub use crate::shared::SharedMat;
    }
}

/// What the DSL's expansion calls; not part of the API.
#[doc(hidden)]
pub mod __private {
    pub use crate::core::graph_key::{GraphKey, GraphKeys};
    pub use crate::core::scope::{handle, scope, take, take_1d, take_packed};
    pub use crate::graph::{GraphSite, graphed};
}
