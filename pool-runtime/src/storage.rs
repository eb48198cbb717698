//! Device memory: one backend and the counted driver calls made on it.
//!
//! This is the layer the pools allocate through: the device's stack arena, the allocators behind
//! the stacks (through [`AllocContext`](crate::AllocContext)), the caching pool, ppl.cv's pool,
//! long-lived buffers ([`GpuMat::new`](crate::GpuMat::new)) and `MixMemory`'s device side. It knows
//! memory, not policy: no stacks, no fallbacks, no settings.
//!
//! Every allocation and free of device memory goes through the methods below (`cuMemAlloc`,
//! `cuMemAllocPitch`, `cuMemAllocFromPoolAsync`, `cuMemFree`, `cuMemFreeAsync`) and is counted,
//! per device and, where a stream asked, per stream, so tests can prove that the hot path makes
//! none. Two driver calls that allocate or free go to the backend directly and are not counted:
//! - `MixMemory`'s page-locked host side (`cuMemHostAlloc` / `cuMemFreeHost`, in `mix.rs`): host
//!   memory, not device memory; `MixMemory::reallocations` counts it instead.
//! - The free of the stack memory when a device's last handle drops (`Arena::free_at_exit`, in
//!   `arena.rs`, from `DeviceInner`'s `Drop`): nothing is left to read that device's counts. Freeing it before then
//!   (`Device::release_stack_memory`, a new configuration) is counted.
//!
//! The driver objects that hold no buffer (streams, events, the stream-ordered memory pool itself)
//! are not counted either.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::backend::{Backend, DevPtr, RawStream};
use crate::error::PoolError;
use crate::id::DeviceId;
use crate::stats::StreamCounters;

/// A device's memory: its backend and the driver calls made on it.
pub(crate) struct Storage {
    pub(crate) id: DeviceId,
    pub(crate) backend: Box<dyn Backend>,
    alloc_calls: AtomicU64,
    free_calls: AtomicU64,
    /// Bytes mapped into growable stacks.
    mapped: AtomicU64,
}

impl Storage {
    pub(crate) fn new(id: DeviceId, backend: Box<dyn Backend>) -> Storage {
        Storage {
            id,
            backend,
            alloc_calls: AtomicU64::new(0),
            free_calls: AtomicU64::new(0),
            mapped: AtomicU64::new(0),
        }
    }

    /// Driver allocation calls so far (every kind).
    pub(crate) fn alloc_calls(&self) -> u64 {
        self.alloc_calls.load(Relaxed)
    }

    /// Driver free calls so far (every kind).
    pub(crate) fn free_calls(&self) -> u64 {
        self.free_calls.load(Relaxed)
    }

    pub(crate) fn count_alloc(&self, stream: Option<&StreamCounters>) {
        self.alloc_calls.fetch_add(1, Relaxed);
        if let Some(s) = stream {
            s.driver_alloc_calls.add(1);
        }
    }

    pub(crate) fn count_free(&self, stream: Option<&StreamCounters>) {
        self.free_calls.fetch_add(1, Relaxed);
        if let Some(s) = stream {
            s.driver_free_calls.add(1);
        }
    }

    /// `cuMemAlloc`, counted.
    pub(crate) fn alloc(
        &self,
        bytes: usize,
        stream: Option<&StreamCounters>,
    ) -> Result<DevPtr, PoolError> {
        self.count_alloc(stream);
        self.backend.alloc(bytes)
    }

    /// `cuMemAllocPitch`, counted.
    pub(crate) fn alloc_pitch(
        &self,
        width: usize,
        rows: usize,
        stream: Option<&StreamCounters>,
    ) -> Result<(DevPtr, usize), PoolError> {
        self.count_alloc(stream);
        self.backend.alloc_pitch(width, rows)
    }

    /// `cuMemFree`, counted.
    ///
    /// # Safety
    /// As [`Backend::free`].
    pub(crate) unsafe fn free(
        &self,
        ptr: DevPtr,
        stream: Option<&StreamCounters>,
    ) -> Result<(), PoolError> {
        self.count_free(stream);
        // SAFETY: forwarded to the caller.
        unsafe { self.backend.free(ptr) }
    }

    /// `cuMemAllocFromPoolAsync` (or `cuMemAlloc`, without memory pools), counted.
    pub(crate) fn alloc_async(
        &self,
        bytes: usize,
        raw: &RawStream,
        stream: Option<&StreamCounters>,
    ) -> Result<DevPtr, PoolError> {
        self.count_alloc(stream);
        self.backend.alloc_async(bytes, raw)
    }

    /// `cuMemFreeAsync`, counted.
    ///
    /// # Safety
    /// As [`Backend::free_async`].
    pub(crate) unsafe fn free_async(
        &self,
        ptr: DevPtr,
        raw: &RawStream,
        stream: Option<&StreamCounters>,
    ) -> Result<(), PoolError> {
        self.count_free(stream);
        // SAFETY: forwarded to the caller.
        unsafe { self.backend.free_async(ptr, raw) }
    }

    /// `cuMemAddressReserve`, counted as an allocation call.
    pub(crate) fn reserve(&self, bytes: usize) -> Result<DevPtr, PoolError> {
        self.count_alloc(None);
        self.backend.reserve(bytes)
    }

    /// `cuMemAddressFree`, counted as a free call.
    ///
    /// # Safety
    /// As [`Backend::unreserve`].
    pub(crate) unsafe fn unreserve(&self, ptr: DevPtr, bytes: usize) -> Result<(), PoolError> {
        self.count_free(None);
        // SAFETY: forwarded to the caller.
        unsafe { self.backend.unreserve(ptr, bytes) }
    }

    /// Maps memory into a reservation (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`), counted as
    /// one allocation call, per device and for `stream`.
    pub(crate) fn map(
        &self,
        at: DevPtr,
        bytes: usize,
        stream: Option<&StreamCounters>,
    ) -> Result<u64, PoolError> {
        self.count_alloc(stream);
        let handle = self.backend.map(at, bytes)?;
        self.mapped.fetch_add(bytes as u64, Relaxed);
        Ok(handle)
    }

    /// Unmaps what [`map`](Self::map) mapped (`cuMemUnmap` + `cuMemRelease`), counted as one free
    /// call.
    ///
    /// # Safety
    /// As [`Backend::unmap`].
    pub(crate) unsafe fn unmap(
        &self,
        at: DevPtr,
        bytes: usize,
        handle: u64,
        stream: Option<&StreamCounters>,
    ) -> Result<(), PoolError> {
        self.count_free(stream);
        // SAFETY: forwarded to the caller.
        unsafe { self.backend.unmap(at, bytes, handle) }?;
        self.mapped.fetch_sub(bytes as u64, Relaxed);
        Ok(())
    }

    /// Bytes mapped into growable stacks now, on this device.
    pub(crate) fn mapped_bytes(&self) -> u64 {
        self.mapped.load(Relaxed)
    }
}
