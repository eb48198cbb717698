//! Backends know memory; pools know policy.
//!
//! A [`Backend`] allocates and frees device memory, makes streams and moves bytes on them. It knows
//! nothing of stacks, fallbacks or statistics: those live in the pool modules, which call a backend
//! only on their slow paths. Every address is a device address (`u64`, CUDA's `CUdeviceptr`), even on
//! the host backend, so the pool code is the same for both.

use std::fmt;

use crate::base::error::PoolError;

pub(crate) mod calls;
pub(crate) mod host;

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

/// A device address (`CUdeviceptr` on CUDA, a host address on the host backend). Zero is never a
/// live allocation.
pub(crate) type DevPtr = u64;

/// A backend's stream handle.
#[derive(Clone)]
pub(crate) enum RawStream {
    /// Host streams run every operation at once, in call order.
    Host,
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<cudarc::driver::CudaStream>),
}

impl fmt::Debug for RawStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RawStream::Host => f.write_str("HostStream"),
            #[cfg(feature = "cuda")]
            RawStream::Cuda(s) => write!(f, "CudaStream({:p})", s.cu_stream()),
        }
    }
}

/// A point in a stream's work, for another stream to wait on.
pub(crate) enum RawEvent {
    /// A host stream's work is done when queued, so its backend marks nothing; only a host device
    /// made for fault injection (`testing::host_with_wait_faults`) hands these out, so that the
    /// pool's paths for events, and for waits that fail, run without a GPU.
    Host,
    #[cfg(feature = "cuda")]
    Cuda(cudarc::driver::CudaEvent),
}

/// A 2D region of device memory: `rows` rows of `width` bytes, `pitch` bytes apart.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    pub(crate) ptr: DevPtr,
    pub(crate) pitch: usize,
    pub(crate) width: usize,
    pub(crate) rows: usize,
}

/// Memory and stream operations of one device.
///
/// Functions that touch memory through raw addresses are `unsafe`: the caller guarantees that the
/// addresses name live allocations of this backend, large enough for the region given.
pub(crate) trait Backend: Send + Sync + fmt::Debug {
    /// The device's texture alignment: the pitch of 2D buffers is a multiple of it.
    fn texture_alignment(&self) -> usize;
    /// Whether `alloc_async`/`free_async` are real stream-ordered operations.
    fn supports_stream_ordered(&self) -> bool;

    fn new_stream(&self) -> Result<RawStream, PoolError>;
    fn synchronize(&self, stream: &RawStream) -> Result<(), PoolError>;
    /// Marks the work queued on `stream` so far; `None` where streams run synchronously.
    fn record_event(&self, stream: &RawStream) -> Result<Option<RawEvent>, PoolError>;
    /// Moves `event` to the work queued on `stream` so far (`cuEventRecord` again), instead of
    /// making a new event; a host stream has no events.
    fn rerecord(&self, _event: &RawEvent, _stream: &RawStream) -> Result<(), PoolError> {
        Ok(())
    }
    /// Makes later work on `stream` wait for `event`, without blocking the host; consumes the event.
    fn wait_event(&self, stream: &RawStream, event: RawEvent) -> Result<(), PoolError>;
    /// Makes later work on `stream` wait for `event`, which stays the caller's to wait on again.
    fn wait_for(&self, stream: &RawStream, event: &RawEvent) -> Result<(), PoolError>;
    /// Blocks the host until the work `event` marks is done (`cuEventSynchronize`).
    fn wait_host(&self, event: &RawEvent) -> Result<(), PoolError>;
    /// Whether work queued on `stream` now is recorded into a CUDA graph instead of run
    /// (`cuStreamIsCapturing`); a host stream never is.
    fn is_capturing(&self, _stream: &RawStream) -> Result<bool, PoolError> {
        Ok(false)
    }
    /// Whether the work an event marks is done (`cuEventQuery`).
    fn event_done(&self, event: &RawEvent) -> Result<bool, PoolError>;
    /// Drops an event in this device's context (cudarc binds the context to destroy it).
    fn drop_event(&self, _event: RawEvent) {
        // Dropped here, on return.
    }
    /// Drops a stream handle in this device's context (cudarc binds the context to destroy it, and
    /// the caller's context must stay current).
    fn drop_stream(&self, _stream: RawStream) {
        // Dropped here, on return.
    }
    /// Bytes handed out and not taken back, where the backend keeps count (the host backend's
    /// leak check).
    #[cfg(any(test, feature = "testing"))]
    fn live_bytes(&self) -> Option<usize> {
        None
    }
    /// Whether `alloc_async` draws on a stream-ordered memory pool of our own (no driver call).
    fn has_mem_pool(&self) -> bool {
        false
    }
    /// Bytes the stream-ordered memory pool reserves (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), its
    /// live allocations included; `None` without a memory pool of our own (`alloc_async` is then
    /// `alloc`).
    fn pool_reserved_bytes(&self) -> Option<usize> {
        None
    }
    /// Bytes the stream-ordered memory pool reserves that no allocation uses (reserved minus
    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`): freed memory its release threshold keeps.
    fn pool_idle_bytes(&self) -> usize {
        0
    }
    /// Gives the stream-ordered pool's idle memory back to the device (`cuMemPoolTrimTo(pool, 0)`:
    /// the driver releases only memory no allocation holds): the bytes its reserve shrank by.
    fn trim_pool(&self) -> Result<usize, PoolError> {
        Ok(0)
    }
    /// The cudarc context, on a CUDA device.
    #[cfg(feature = "cuda")]
    fn cuda_context(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaContext>> {
        None
    }

    /// The granule of virtual memory management (`cuMemGetAllocationGranularity`), where the
    /// device has it: growable stacks reserve address ranges and map memory into them in
    /// multiples of it. `None`: no virtual memory management, fixed stacks only.
    fn vmm_granularity(&self) -> Option<usize> {
        None
    }
    /// The device's memory in bytes (`cuDeviceTotalMem`): how much a growable stack reserves.
    fn total_memory(&self) -> usize;
    /// `cuMemAddressReserve`: `bytes` (a multiple of the granule) of addresses, nothing mapped.
    fn reserve(&self, bytes: usize) -> Result<DevPtr, PoolError> {
        let _ = bytes;
        Err(self.no_vmm())
    }
    /// `cuMemAddressFree`.
    ///
    /// # Safety
    /// `ptr` came from `reserve(bytes)` of this backend, nothing is mapped in it any more, and it
    /// is freed once.
    unsafe fn unreserve(&self, ptr: DevPtr, bytes: usize) -> Result<(), PoolError> {
        let _ = (ptr, bytes);
        Err(self.no_vmm())
    }
    /// `cuMemCreate` + `cuMemMap` + `cuMemSetAccess`: `bytes` of memory (a multiple of the granule)
    /// mapped at `at`, inside a reservation, readable and writable by the device. Returns the
    /// physical allocation's handle, for [`unmap`](Self::unmap). On an error nothing is mapped.
    fn map(&self, at: DevPtr, bytes: usize) -> Result<u64, PoolError> {
        let _ = (at, bytes);
        Err(self.no_vmm())
    }
    /// `cuMemUnmap` + `cuMemRelease`.
    ///
    /// # Safety
    /// `at..at + bytes` is exactly what `map` mapped with `handle`, unmapped once, and no work
    /// queued or running uses it.
    unsafe fn unmap(&self, at: DevPtr, bytes: usize, handle: u64) -> Result<(), PoolError> {
        let _ = (at, bytes, handle);
        Err(self.no_vmm())
    }
    /// The error of a virtual memory call on a backend without it.
    fn no_vmm(&self) -> PoolError;

    /// `cuMemAlloc`.
    fn alloc(&self, bytes: usize) -> Result<DevPtr, PoolError>;
    /// `cuMemAllocPitch`: returns the address and the pitch.
    fn alloc_pitch(&self, width: usize, rows: usize) -> Result<(DevPtr, usize), PoolError>;
    /// `cuMemHostAlloc`: zeroed page-locked host memory (plain host memory on the host backend).
    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8, PoolError>;
    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `ptr` came from `alloc_pinned(bytes)` of this backend and is freed once; no copy uses it.
    unsafe fn free_pinned(&self, ptr: *mut u8, bytes: usize) -> Result<(), PoolError>;
    /// `cuMemFree`.
    ///
    /// # Safety
    /// `ptr` came from `alloc` or `alloc_pitch` of this backend, is freed once, and no queued work
    /// still uses it (a driver free synchronizes on CUDA, so stream work is covered).
    unsafe fn free(&self, ptr: DevPtr) -> Result<(), PoolError>;
    /// `cuMemAllocFromPoolAsync` on `stream`, from the backend's own memory pool (`cuMemAlloc`
    /// where the device has none).
    fn alloc_async(&self, bytes: usize, stream: &RawStream) -> Result<DevPtr, PoolError>;
    /// `cuMemFreeAsync` on `stream`.
    ///
    /// # Safety
    /// `ptr` came from `alloc_async` of this backend and is freed once; work using it is ordered
    /// before this call on `stream`.
    unsafe fn free_async(&self, ptr: DevPtr, stream: &RawStream) -> Result<(), PoolError>;

    /// Fills `dst` with a repeated `pattern` (whose length divides `dst.width`).
    ///
    /// # Safety
    /// `dst` lies in live memory of this backend.
    unsafe fn fill(&self, dst: Region, pattern: &[u8], stream: &RawStream)
    -> Result<(), PoolError>;
    /// Copies host rows (`src_pitch` bytes apart) into `dst`, and returns once `src` may be
    /// reused (the copy itself may still be in flight).
    ///
    /// # Safety
    /// `dst` lies in live memory of this backend; `src` holds `dst.rows` rows of `dst.width` bytes.
    unsafe fn upload(
        &self,
        dst: Region,
        src: &[u8],
        src_pitch: usize,
        stream: &RawStream,
    ) -> Result<(), PoolError>;
    /// Queues a copy of host rows at `src` (`src_pitch` bytes apart) into `dst` without waiting.
    ///
    /// # Safety
    /// `dst` lies in live memory of this backend; `src` is valid for reads of every row and is
    /// neither written nor freed until the stream has finished the copy.
    unsafe fn upload_async(
        &self,
        dst: Region,
        src: *const u8,
        src_pitch: usize,
        stream: &RawStream,
    ) -> Result<(), PoolError>;
    /// Copies `src` into host rows (`dst_pitch` bytes apart) and waits for the copy: when it
    /// returns, everything queued on `stream` before it is done.
    ///
    /// # Safety
    /// `src` lies in live memory of this backend; `dst` has room for its rows.
    unsafe fn download(
        &self,
        src: Region,
        dst: &mut [u8],
        dst_pitch: usize,
        stream: &RawStream,
    ) -> Result<(), PoolError>;
    /// Queues a copy of `src` into host memory at `dst` (rows `dst_pitch` apart) without waiting.
    ///
    /// # Safety
    /// `src` lies in live memory of this backend; `dst` is valid for writes of every row and is
    /// neither read nor freed until the stream has finished the copy.
    unsafe fn download_async(
        &self,
        src: Region,
        dst: *mut u8,
        dst_pitch: usize,
        stream: &RawStream,
    ) -> Result<(), PoolError>;
    /// Device-to-device copy of `src` into `dst` (same `width` and `rows`).
    ///
    /// # Safety
    /// Both regions lie in live memory of this backend and do not overlap.
    unsafe fn copy(&self, dst: Region, src: Region, stream: &RawStream) -> Result<(), PoolError>;
}
