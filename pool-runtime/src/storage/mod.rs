//! Device memory: one backend and the counted driver calls made on it.
//!
//! This is the layer the pools allocate through: the device's stack arena, the allocators behind
//! the stacks (through [`AllocContext`](crate::alloc::AllocContext)), the caching pool, ppl.cv's pool,
//! long-lived buffers ([`GpuMat::new`](crate::compat::opencv::GpuMat::new)) and `MixMemory`'s device side. It knows
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

pub(crate) mod backend;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};

use crate::base::counters::StreamCounters;
use crate::base::error::PoolError;
use crate::base::holders::{GaveBack, IdleHolding, Reclaimed, ReclaimedFrom};
use crate::base::id::DeviceId;
use crate::base::sync;
use crate::storage::backend::{Backend, DevPtr, RawStream};

/// Something that keeps memory of a device idle (mapped or allocated, used by no buffer).
pub(crate) trait IdleMemory: Send + Sync {
    /// Who holds it, as the stats and errors name it ("the caching pool", "stream 3's stack").
    fn holder(&self) -> String;
    /// Bytes it holds idle now.
    fn idle_bytes(&self) -> usize;
    /// Gives back what it safely can now, through `storage` (its device's); asks for the rest to
    /// go back at its next chance.
    fn give_back_idle(&self, storage: &Storage) -> GaveBack;
}

/// A device's memory: its backend and the driver calls made on it.
pub(crate) struct Storage {
    pub(crate) id: DeviceId,
    pub(crate) backend: Box<dyn Backend>,
    alloc_calls: AtomicU64,
    free_calls: AtomicU64,
    /// Bytes mapped into growable stacks.
    mapped: AtomicU64,
    /// Everything that keeps memory of this device idle and gives it back on request (the seam of
    /// `holders.rs`); dead entries are dropped as they are met.
    holders: Mutex<Vec<Weak<dyn IdleMemory>>>,
    /// The device's memory limit in bytes (`usize::MAX`: none), which every allocation through
    /// here counts against.
    limit: AtomicUsize,
    /// Sizes of the live allocations of `alloc`, `alloc_pitch` (and `alloc_async` where the
    /// backend has no memory pool, whose reserve is counted instead), for the limit: their frees
    /// name only the address.
    sizes: Mutex<HashMap<DevPtr, usize>>,
    /// Their sum.
    allocated: AtomicU64,
}

impl Storage {
    pub(crate) fn new(id: DeviceId, backend: Box<dyn Backend>) -> Storage {
        Storage {
            id,
            backend,
            alloc_calls: AtomicU64::new(0),
            free_calls: AtomicU64::new(0),
            mapped: AtomicU64::new(0),
            holders: Mutex::new(Vec::new()),
            limit: AtomicUsize::new(usize::MAX),
            sizes: Mutex::new(HashMap::new()),
            allocated: AtomicU64::new(0),
        }
    }

    /// Registers a holder of idle memory, asked by [`reclaim`](Self::reclaim) and the stats for as
    /// long as it lives.
    pub(crate) fn register_holder(&self, holder: Weak<dyn IdleMemory>) {
        let mut holders = sync::lock(&self.holders);
        holders.retain(|h| h.strong_count() > 0);
        holders.push(holder);
    }

    /// The live holders, taken out of the lock: a holder's answer may allocate or free through
    /// here.
    fn live_holders(&self) -> Vec<Arc<dyn IdleMemory>> {
        sync::lock(&self.holders)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// What each holder keeps idle now, the stream-ordered pool's reserve included; holders with
    /// nothing idle are left out.
    pub(crate) fn idle_holdings(&self) -> Vec<IdleHolding> {
        let mut all: Vec<IdleHolding> = self
            .live_holders()
            .iter()
            .map(|h| IdleHolding {
                holder: h.holder(),
                idle_bytes: h.idle_bytes(),
            })
            .collect();
        all.push(IdleHolding {
            holder: STREAM_ORDERED_POOL.into(),
            idle_bytes: self.backend.pool_idle_bytes(),
        });
        all.retain(|h| h.idle_bytes > 0);
        all
    }

    /// Asks every holder but `skip` (the caller's own, which it gave back itself) to give back its
    /// idle memory, and trims the stream-ordered pool to what its live allocations use: what each
    /// held and gave back. Never memory in use or in flight: each holder answers for its own.
    #[cold]
    pub(crate) fn reclaim(&self, skip: Option<*const ()>) -> Reclaimed {
        let mut reclaimed = Reclaimed::default();
        for holder in self.live_holders() {
            if skip.is_some_and(|s| std::ptr::addr_eq(Arc::as_ptr(&holder), s)) {
                continue;
            }
            let held = holder.idle_bytes();
            let gave = holder.give_back_idle(self);
            reclaimed.holders.push(ReclaimedFrom {
                holder: holder.holder(),
                held,
                given_back: gave.bytes,
                deferred: gave.deferred,
            });
        }
        let held = self.backend.pool_idle_bytes();
        // The driver releases only memory no allocation holds, and waits for pending frees.
        let given_back = self.backend.trim_pool().unwrap_or_else(|e| {
            crate::base::event::warn!(device = %self.id, error = %e, "trimming the stream-ordered pool failed");
            0
        });
        reclaimed.holders.push(ReclaimedFrom {
            holder: STREAM_ORDERED_POOL.into(),
            held,
            given_back,
            deferred: false,
        });
        reclaimed
    }

    /// The second attempt of an out-of-memory, after `own` (what the caller gave back itself) and
    /// every holder but `skip` (the caller's own) gave back their idle memory; its error says what
    /// was held and given back. The caller is not inside a capture on this thread (giving memory
    /// back waits for the device).
    #[cold]
    pub(crate) fn retry_reclaimed<T>(
        &self,
        skip: Option<*const ()>,
        own: Option<ReclaimedFrom>,
        attempt: &mut dyn FnMut() -> Result<T, PoolError>,
    ) -> Result<T, PoolError> {
        let mut reclaimed = self.reclaim(skip);
        if let Some(own) = own {
            reclaimed.holders.insert(0, own);
        }
        reclaimed.retried = true;
        attempt().map_err(|e| {
            if matches!(e, PoolError::OutOfMemory { .. }) {
                // A failed stream-ordered request may leave the pool holding what it reserved
                // trying (the issue saw 71 GiB of free memory become 9 MiB): none of it is used,
                // and none of it was the device's idle memory before the request.
                if let Err(e) = self.backend.trim_pool() {
                    crate::base::event::warn!(device = %self.id, error = %e, "trimming the stream-ordered pool failed");
                }
            }
            e.with_reclaimed(reclaimed)
        })
    }

    /// Sets the device's memory limit (`None`: none).
    pub(crate) fn set_limit(&self, limit: Option<usize>) {
        self.limit.store(limit.unwrap_or(usize::MAX), Relaxed);
    }

    /// The device's memory limit, if one is set.
    pub(crate) fn limit(&self) -> Option<usize> {
        Some(self.limit.load(Relaxed)).filter(|&l| l != usize::MAX)
    }

    /// Bytes counted against the limit: live allocations made here, memory mapped into growable
    /// stacks, and the stream-ordered pool's reserve (its idle memory included).
    pub(crate) fn limited_bytes(&self) -> usize {
        (self.allocated.load(Relaxed) as usize)
            .saturating_add(self.mapped.load(Relaxed) as usize)
            .saturating_add(self.backend.pool_reserved_bytes().unwrap_or(0))
    }

    /// `Err(OutOfMemory)` if `bytes` more would pass the device's memory limit. `reuses_idle`:
    /// the request is served from the stream-ordered pool, whose idle reserve (already counted)
    /// covers that much of it.
    ///
    /// A soft cap: threads that check at once may each pass, and together go past it by their
    /// requests.
    fn check_limit(&self, bytes: usize, reuses_idle: bool) -> Result<(), PoolError> {
        let Some(limit) = self.limit() else {
            return Ok(());
        };
        let counted = self.limited_bytes();
        let new = if reuses_idle {
            bytes.saturating_sub(self.backend.pool_idle_bytes())
        } else {
            bytes
        };
        if counted.saturating_add(new) <= limit {
            return Ok(());
        }
        Err(PoolError::OutOfMemory {
            device: self.id,
            requested: bytes,
            context: None,
            reclaimed: Some(Box::new(Reclaimed {
                holders: Vec::new(),
                limit: Some((limit, counted)),
                retried: false,
            })),
        })
    }

    /// Remembers a live allocation's size, for the limit.
    fn note_size(&self, ptr: DevPtr, bytes: usize) {
        sync::lock(&self.sizes).insert(ptr, bytes);
        self.allocated.fetch_add(bytes as u64, Relaxed);
    }

    /// Forgets a freed allocation's size.
    fn forget_size(&self, ptr: DevPtr) {
        if let Some(bytes) = sync::lock(&self.sizes).remove(&ptr) {
            self.allocated.fetch_sub(bytes as u64, Relaxed);
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
        self.check_limit(bytes, false)?;
        self.count_alloc(stream);
        let ptr = self.backend.alloc(bytes)?;
        self.note_size(ptr, bytes);
        Ok(ptr)
    }

    /// `cuMemAllocPitch`, counted.
    pub(crate) fn alloc_pitch(
        &self,
        width: usize,
        rows: usize,
        stream: Option<&StreamCounters>,
    ) -> Result<(DevPtr, usize), PoolError> {
        let align = self.backend.texture_alignment();
        self.check_limit(
            width
                .div_ceil(align)
                .saturating_mul(align)
                .saturating_mul(rows),
            false,
        )?;
        self.count_alloc(stream);
        let (ptr, pitch) = self.backend.alloc_pitch(width, rows)?;
        self.note_size(ptr, pitch.saturating_mul(rows));
        Ok((ptr, pitch))
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
        unsafe { self.backend.free(ptr) }?;
        self.forget_size(ptr);
        Ok(())
    }

    /// `cuMemAllocFromPoolAsync` (or `cuMemAlloc`, without memory pools), counted.
    pub(crate) fn alloc_async(
        &self,
        bytes: usize,
        raw: &RawStream,
        stream: Option<&StreamCounters>,
    ) -> Result<DevPtr, PoolError> {
        let pooled = self.backend.has_mem_pool();
        self.check_limit(bytes, pooled)?;
        self.count_alloc(stream);
        let ptr = self.backend.alloc_async(bytes, raw)?;
        if !pooled {
            // No memory pool: the allocation is the driver's own, counted as `alloc`'s.
            self.note_size(ptr, bytes);
        }
        Ok(ptr)
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
        unsafe { self.backend.free_async(ptr, raw) }?;
        if !self.backend.has_mem_pool() {
            self.forget_size(ptr);
        }
        Ok(())
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
        self.check_limit(bytes, false)?;
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

/// How errors and stats name the backend's stream-ordered memory pool.
const STREAM_ORDERED_POOL: &str = "the stream-ordered pool";
