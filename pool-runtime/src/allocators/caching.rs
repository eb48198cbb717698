//! A binned caching allocator (PyOpenCL's `MemoryPool`): freed blocks are held in bins keyed by the
//! leading bits of their size and handed out again to requests of the same bin.
//!
//! Sizes round up to the largest size of their bin, so any held block of a bin serves any request
//! of it. A block freed on one stream is reused on that stream at once (stream order protects it),
//! and on another stream only once an event shows the freeing stream's work is done. On out of
//! memory the pool frees everything it holds and retries once.
//!
//! It serves a stream on its own (`Stream::with_allocator(&device, pool)`) or as the stack's
//! fallback (`device.set_fallback(Fallback::Caching)`, one shared pool per device).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use crate::allocators::{AllocContext, AllocRequest, Allocation, GpuAllocator};
use crate::base::error::PoolError;
use crate::base::holders::GaveBack;
use crate::base::id::DeviceId;
use crate::storage::IdleMemory;
use crate::storage::Storage;
use crate::storage::backend::{DevPtr, RawEvent};

/// Counters of a [`CachingPool`].
///
/// Bytes in use are counted two ways: as the requests asked
/// ([`active_requested_bytes`](Self::active_requested_bytes), PyOpenCL's `active_bytes`) and as
/// the blocks that serve them, rounded up to their bin's size
/// ([`active_rounded_bytes`](Self::active_rounded_bytes), what the device holds for them).
///
/// ```
/// use std::sync::Arc;
/// use gpu_pool::{alloc::CachingPool, compat::opencv::BufferPool, Device, PoolError, Stream};
/// let device = Device::private_host();
/// let cache = Arc::new(CachingPool::new(&device));
/// let stream = Stream::with_allocator(&device, cache.clone())?;
/// let buf = BufferPool::new(&stream).get_buffer_1d::<u8>(1000)?; // 1024 bytes asked of the pool
/// let stats = cache.stats();
/// assert_eq!(stats.active_requested_bytes, 1024);
/// assert_eq!(stats.active_rounded_bytes, 1087);                  // its bin's block size
/// drop(buf);
/// let stats = cache.stats();
/// assert_eq!((stats.active_rounded_bytes, stats.held_bytes), (0, 1087));
/// assert_eq!(stats.peak_active_rounded_bytes, 1087);
/// # Ok::<(), PoolError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CachingStats {
    /// Blocks held for reuse.
    pub held_blocks: usize,
    /// Bytes held for reuse (bin sizes).
    pub held_bytes: usize,
    /// Blocks handed out and not yet freed.
    pub active_blocks: usize,
    /// Bytes the requests of the blocks handed out and not yet freed asked for (each request's
    /// [`AllocRequest::bytes`](crate::alloc::AllocRequest::bytes), before rounding to its bin): PyOpenCL's
    /// `active_bytes`.
    pub active_requested_bytes: usize,
    /// Bytes of the blocks handed out and not yet freed, each its bin's size: what the device
    /// holds for them. `active_rounded_bytes - active_requested_bytes` is lost to rounding.
    pub active_rounded_bytes: usize,
    /// The most [`active_requested_bytes`](Self::active_requested_bytes) at once, since the pool
    /// was made or [`CachingPool::reset_peak`].
    pub peak_active_requested_bytes: usize,
    /// The most [`active_rounded_bytes`](Self::active_rounded_bytes) at once, since the pool was
    /// made or [`CachingPool::reset_peak`].
    pub peak_active_rounded_bytes: usize,
    /// Requests served by a held block (no driver allocation).
    pub hits: u64,
    /// Requests that needed a driver allocation.
    pub misses: u64,
    /// Out-of-memory allocations retried after freeing every held block.
    pub oom_retries: u64,
}

struct Held {
    ptr: DevPtr,
    /// The bin's block size.
    size: usize,
    stream: u64,
    /// Marks the freeing stream's work; `None` on the host backend, where nothing is pending.
    ready: Option<RawEvent>,
}

/// A block handed out.
#[derive(Clone, Copy)]
struct Active {
    bin: u64,
    /// The bin's block size.
    size: usize,
    /// What the request asked for.
    requested: usize,
}

/// Held blocks by bin, sorted by bin, no bin empty. A sorted `Vec` and not a `BTreeMap`: bins are
/// few, and each map type is thousands of lines of generic code in every build (issue 34).
#[derive(Default)]
struct Bins(Vec<(u64, Vec<Held>)>);

impl Bins {
    fn push(&mut self, bin: u64, held: Held) {
        match self.0.binary_search_by_key(&bin, |&(b, _)| b) {
            Ok(at) => self.0[at].1.push(held),
            Err(at) => self.0.insert(at, (bin, vec![held])),
        }
    }

    /// Takes the held block of `bin` at the index `choose` picks in the bin's list.
    fn take(&mut self, bin: u64, choose: impl FnOnce(&[Held]) -> Option<usize>) -> Option<Held> {
        let at_bin = self.0.binary_search_by_key(&bin, |&(b, _)| b).ok()?;
        let list = &mut self.0[at_bin].1;
        let held = list.swap_remove(choose(list)?);
        if list.is_empty() {
            self.0.remove(at_bin);
        }
        Some(held)
    }
}

struct State {
    bins: Bins,
    /// Live blocks, by address.
    active: HashMap<DevPtr, Active>,
    holding: bool,
    stats: CachingStats,
}

impl State {
    /// Counts a block handed out.
    fn activate(&mut self, ptr: DevPtr, block: Active) {
        let stats = &mut self.stats;
        stats.active_blocks += 1;
        stats.active_requested_bytes += block.requested;
        stats.active_rounded_bytes += block.size;
        stats.peak_active_requested_bytes = stats
            .peak_active_requested_bytes
            .max(stats.active_requested_bytes);
        stats.peak_active_rounded_bytes = stats
            .peak_active_rounded_bytes
            .max(stats.active_rounded_bytes);
        self.active.insert(ptr, block);
    }
}

/// A binned caching allocator for one device. Give it to streams as an `Arc`.
///
/// ```
/// use std::sync::Arc;
/// use gpu_pool::{alloc::CachingPool, compat::opencv::BufferPool, Device, PoolError, Stream};
/// let device = Device::private_host();
/// let cache = Arc::new(CachingPool::new(&device));
/// let stream = Stream::with_allocator(&device, cache.clone())?;
/// let pool = BufferPool::new(&stream);
/// drop(pool.get_buffer::<f32>(100, 100)?);           // a miss: one driver allocation
/// let again = pool.get_buffer::<f32>(100, 100)?;     // a hit: the same block, no driver call
/// let stats = cache.stats();
/// assert_eq!((stats.misses, stats.hits, stats.active_blocks), (1, 1, 1));
/// # Ok::<(), PoolError>(())
/// ```
pub struct CachingPool {
    leading_bits: u32,
    /// The blocks and counters, shared with the device as a holder of idle memory.
    cache: Arc<Cache>,
}

/// What a [`CachingPool`] holds: registered with its device, which asks it to free its held
/// blocks after an out-of-memory anywhere on the device.
struct Cache {
    /// The device's memory; weak, so a pool kept past its device frees nothing twice.
    storage: Weak<Storage>,
    id: DeviceId,
    state: Mutex<State>,
}

impl std::fmt::Debug for CachingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingPool")
            .field("device", &self.cache.id)
            .field("leading_bits", &self.leading_bits)
            .field("stats", &self.stats())
            .finish()
    }
}

impl CachingPool {
    /// PyOpenCL's default number of leading bits (after the first one) that name a bin.
    pub const DEFAULT_LEADING_BITS: u32 = 4;

    /// The bin of a request of `bytes` and the size every block of that bin has. Defined for every
    /// size.
    ///
    /// A size keeps its highest set bit and the `leading_bits` bits below it; the rest are set to one,
    /// which gives the largest size sharing those bits. Sizes of `leading_bits + 1` bits or fewer are
    /// their own bin. A request of 0 bytes shares the bin of 1 byte (as PyOpenCL's `bin_number(0)`
    /// equals `bin_number(1)`, whose blocks are 1 byte). Never overflows: the rounded size keeps
    /// the request's highest bit.
    ///
    /// ```
    /// use gpu_pool::alloc::CachingPool;
    /// assert_eq!(CachingPool::bin_of(1000, 4).1, 1023);          // 0b1111101000 -> 0b1111111111
    /// assert_eq!(CachingPool::bin_of(1024, 4).1, 1087);          // 0b10000000000 -> 0b10000111111
    /// assert_eq!(CachingPool::bin_of(17, 4).1, 17);              // small sizes are exact
    /// assert_eq!(CachingPool::bin_of(0, 4), CachingPool::bin_of(1, 4)); // nothing: the 1-byte bin
    /// assert_eq!(CachingPool::bin_of(usize::MAX, 4).1, usize::MAX);
    /// ```
    #[must_use]
    pub fn bin_of(bytes: usize, leading_bits: u32) -> (u64, usize) {
        let bytes = bytes.max(1);
        let top = usize::BITS - 1 - bytes.leading_zeros();
        if top <= leading_bits {
            // Exact: bin numbers of this range are the sizes themselves, below every rounded bin.
            return (bytes as u64, bytes);
        }
        let shift = top - leading_bits;
        let head = bytes >> shift; // the highest bit and the leading bits below it
        let size = (head << shift) | ((1usize << shift) - 1);
        let bin = (u64::from(top) << 32) | head as u64;
        (bin, size)
    }

    /// A pool over a device's memory whose bins are named by `leading_bits` bits after the
    /// highest: 0 to 16, else `PoolError::InvalidConfig`. The public constructors
    /// (`CachingPool::new(&device)`, `with_leading_bits`) sit with the device, which is above
    /// the allocators and hands them its storage.
    pub(crate) fn on_storage(
        storage: &Arc<Storage>,
        leading_bits: u32,
    ) -> Result<CachingPool, PoolError> {
        if leading_bits > 16 {
            return Err(PoolError::InvalidConfig {
                reason: format!(
                    "leading_bits is {leading_bits}; use 0 to 16 (PyOpenCL's default is 4)"
                ),
            });
        }
        let cache = Arc::new(Cache {
            storage: Arc::downgrade(storage),
            id: storage.id,
            state: Mutex::new(State {
                bins: Bins::default(),
                active: HashMap::new(),
                holding: true,
                stats: CachingStats::default(),
            }),
        });
        storage.register_holder(Arc::downgrade(&cache) as Weak<dyn IdleMemory>);
        Ok(CachingPool {
            leading_bits,
            cache,
        })
    }

    /// A snapshot of the counters.
    #[must_use]
    pub fn stats(&self) -> CachingStats {
        self.cache.lock().stats
    }

    /// Starts the peaks over from what is in use now (PyTorch's `reset_peak_memory_stats`):
    /// afterwards [`peak_active_requested_bytes`](CachingStats::peak_active_requested_bytes) and
    /// [`peak_active_rounded_bytes`](CachingStats::peak_active_rounded_bytes) equal the active
    /// bytes. Counts (hits, misses, retries) are totals and are kept.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use gpu_pool::{alloc::CachingPool, compat::opencv::BufferPool, Device, PoolError, Stream};
    /// let device = Device::private_host();
    /// let cache = Arc::new(CachingPool::new(&device));
    /// let stream = Stream::with_allocator(&device, cache.clone())?;
    /// let pool = BufferPool::new(&stream);
    /// let small = pool.get_buffer_1d::<u8>(64)?;
    /// drop(pool.get_buffer_1d::<u8>(1 << 20)?);
    /// assert!(cache.stats().peak_active_requested_bytes > 1 << 20);
    /// cache.reset_peak();
    /// let stats = cache.stats();
    /// assert_eq!(stats.peak_active_requested_bytes, 64);
    /// assert_eq!(stats.peak_active_rounded_bytes, stats.active_rounded_bytes);
    /// # drop(small);
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn reset_peak(&self) {
        let stats = &mut self.cache.lock().stats;
        stats.peak_active_requested_bytes = stats.active_requested_bytes;
        stats.peak_active_rounded_bytes = stats.active_rounded_bytes;
    }

    /// Frees every held block (`cuMemFree`, which waits for the device) and returns the bytes
    /// freed. If the driver refuses a free, that block stays held (and counted in
    /// [`stats`](Self::stats)), the others are still freed, and the first error is returned.
    pub fn free_held(&self) -> Result<usize, PoolError> {
        self.cache.free_held()
    }

    /// Stops holding: frees what is held, and frees blocks at once from now on.
    pub fn stop_holding(&self) -> Result<(), PoolError> {
        self.cache.lock().holding = false;
        self.cache.free_held().map(|_| ())
    }
}

impl Cache {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every update below leaves the state consistent before any step that can panic.
        crate::base::sync::lock(&self.state)
    }

    /// Frees every held block (`cuMemFree`, which waits for the device) and returns the bytes
    /// freed. If the driver refuses a free, that block stays held (and counted in
    /// [`stats`](Self::stats)), the others are still freed, and the first error is returned.
    fn free_held(&self) -> Result<usize, PoolError> {
        let held: Vec<(u64, Held)> = {
            let mut state = self.lock();
            std::mem::take(&mut state.bins)
                .0
                .into_iter()
                .flat_map(|(bin, blocks)| blocks.into_iter().map(move |h| (bin, h)))
                .collect()
        };
        let Some(storage) = self.storage.upgrade() else {
            // The device is gone; its backend freed all its memory with it.
            let mut state = self.lock();
            (state.stats.held_blocks, state.stats.held_bytes) = (0, 0);
            return Ok(0);
        };
        let (mut freed, mut first_error) = (0, None);
        for (bin, mut block) in held {
            let size = block.size;
            if let Some(event) = block.ready.take() {
                storage.backend.drop_event(event);
            }
            // SAFETY: a held block is a live driver allocation of this device that no buffer uses
            // (it was freed to the pool) and is out of the bins now, so it is freed once; the
            // driver's free waits for queued work that may still use it.
            match unsafe { storage.free(block.ptr, None) } {
                Ok(()) => {
                    freed += size;
                    let mut state = self.lock();
                    state.stats.held_blocks -= 1;
                    state.stats.held_bytes -= size;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    self.lock().bins.push(bin, block);
                }
            }
        }
        first_error.map_or(Ok(freed), Err)
    }

    /// A held block of `bin` this stream may use now: one it freed itself, else one whose freeing
    /// stream has finished.
    fn take_held(&self, state: &mut State, bin: u64, ctx: &AllocContext<'_>) -> Option<Held> {
        state.bins.take(bin, |list| {
            list.iter()
                .position(|h| h.stream == ctx.stream_id)
                .or_else(|| {
                    list.iter().position(|h| {
                        h.ready
                            .as_ref()
                            .is_none_or(|e| ctx.storage.backend.event_done(e).unwrap_or(false))
                    })
                })
        })
    }
}

impl IdleMemory for Cache {
    fn holder(&self) -> String {
        "the caching pool".into()
    }

    fn idle_bytes(&self) -> usize {
        self.lock().stats.held_bytes
    }

    fn give_back_idle(&self, _storage: &crate::storage::Storage) -> GaveBack {
        // `cuMemFree` waits for the work that may still use a held block: none is in flight after.
        let bytes = self.free_held().unwrap_or_else(|e| {
            crate::base::event::warn!(device = %self.id, error = %e, "freeing the caching pool's blocks failed");
            0
        });
        GaveBack {
            bytes,
            deferred: false,
        }
    }
}

// SAFETY: a hit hands out a block that was allocated for this bin's size (at least the request's
// bytes), is held by no one else (removed from the bin under the lock), and whose previous user's
// work is ordered before (same stream) or finished (event). A miss hands out a fresh driver
// allocation of the bin's size.
unsafe impl GpuAllocator for CachingPool {
    fn allocate(
        &self,
        ctx: &AllocContext<'_>,
        req: &AllocRequest,
    ) -> Result<Allocation, PoolError> {
        // Devices, not ids, are compared: memory must never cross to another device's buffers.
        if !std::ptr::eq(ctx.storage, self.cache.storage.as_ptr()) {
            return Err(PoolError::DeviceMismatch {
                expected: self.cache.id,
                actual: ctx.device_id(),
            });
        }
        let (bin, size) = CachingPool::bin_of(req.bytes, self.leading_bits);
        let block = Active {
            bin,
            size,
            requested: req.bytes,
        };
        let mut state = self.cache.lock();
        if let Some(held) = self.cache.take_held(&mut state, bin, ctx) {
            state.stats.hits += 1;
            state.stats.held_blocks -= 1;
            state.stats.held_bytes -= size;
            state.activate(held.ptr, block);
            drop(state);
            if let Some(event) = held.ready {
                ctx.storage.backend.drop_event(event);
            }
            return Ok(Allocation {
                ptr: held.ptr,
                pitch: req.pitch,
            });
        }
        state.stats.misses += 1;
        drop(state);
        let ptr = match ctx.alloc(size) {
            Err(PoolError::OutOfMemory { .. }) if self.cache.lock().stats.held_blocks > 0 => {
                self.cache.lock().stats.oom_retries += 1;
                self.cache.free_held()?;
                ctx.alloc(size)?
            }
            other => other?,
        };
        self.cache.lock().activate(ptr, block);
        Ok(Allocation {
            ptr,
            pitch: req.pitch,
        })
    }

    unsafe fn deallocate(&self, ctx: &AllocContext<'_>, a: Allocation) -> Result<(), PoolError> {
        let mut state = self.cache.lock();
        let Some(Active {
            bin,
            size,
            requested,
        }) = state.active.remove(&a.ptr)
        else {
            return Err(PoolError::UnknownBlock {
                address: a.ptr,
                owner: format!("the caching pool of {}", self.cache.id),
            });
        };
        state.stats.active_blocks -= 1;
        state.stats.active_requested_bytes -= requested;
        state.stats.active_rounded_bytes -= size;
        if !state.holding {
            drop(state);
            // SAFETY: the block came from `ctx.alloc` (a miss) and is freed once, by contract.
            return unsafe { ctx.free(a.ptr) };
        }
        drop(state);
        let ready = ctx.storage.backend.record_event(ctx.stream)?;
        let mut state = self.cache.lock();
        state.stats.held_blocks += 1;
        state.stats.held_bytes += size;
        state.bins.push(
            bin,
            Held {
                ptr: a.ptr,
                size,
                stream: ctx.stream_id,
                ready,
            },
        );
        Ok(())
    }
}

impl Drop for CachingPool {
    fn drop(&mut self) {
        if let Err(e) = self.cache.free_held() {
            crate::base::event::error!(device = %self.cache.id, error = %e, "freeing the caching pool's blocks failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_blocks_stay_sorted_by_bin_and_an_emptied_bin_goes() {
        let held = |ptr| Held {
            ptr,
            size: 0,
            stream: 0,
            ready: None,
        };
        let mut bins = Bins::default();
        for (bin, ptr) in [(7, 1), (3, 2), (7, 3), (5, 4)] {
            bins.push(bin, held(ptr));
        }
        let shape = |bins: &Bins| -> Vec<(u64, usize)> {
            bins.0
                .iter()
                .map(|(bin, list)| (*bin, list.len()))
                .collect()
        };
        assert_eq!(shape(&bins), [(3, 1), (5, 1), (7, 2)]);
        // `choose` sees the bin's list in push order and picks by index.
        let taken = bins.take(7, |list| list.iter().position(|h| h.ptr == 3));
        assert_eq!(taken.map(|h| h.ptr), Some(3));
        assert!(
            bins.take(7, |_| None).is_none(),
            "nothing chosen: nothing taken"
        );
        assert!(bins.take(4, |_| Some(0)).is_none(), "no such bin");
        assert_eq!(bins.take(5, |_| Some(0)).map(|h| h.ptr), Some(4));
        assert_eq!(shape(&bins), [(3, 1), (7, 1)]);
    }

    #[test]
    fn bins_round_up_and_never_wrap() {
        for bits in [0, 1, 4, 8, 16] {
            let mut sizes: Vec<usize> = (1..5000).collect();
            sizes.extend((1..64).map(|s| 1usize << s));
            sizes.extend((1..64).map(|s| (1usize << s) - 1));
            sizes.extend([
                usize::MAX,
                usize::MAX - 1,
                usize::MAX / 2 + 1,
                usize::MAX / 3,
            ]);
            for s in sizes {
                let (bin, size) = CachingPool::bin_of(s, bits);
                assert!(size >= s, "{s} rounds to {size}");
                assert_eq!(
                    CachingPool::bin_of(size, bits),
                    (bin, size),
                    "the rounded size is in its own bin"
                );
                assert_eq!(
                    size.leading_zeros(),
                    s.leading_zeros(),
                    "no wrap: same highest bit"
                );
            }
        }
    }

    #[test]
    fn devices_that_share_an_id_still_keep_their_memory_apart() -> Result<(), PoolError> {
        // Ids are unique now, but the pool must not rely on that: forge two devices with one id.
        let same = DeviceId::Host(7);
        let host = |id| {
            crate::Device::from_backend(
                id,
                Box::new(crate::storage::backend::host::HostBackend::new(id, None)),
            )
        };
        let (a, b) = (host(same), host(same));
        let cache = std::sync::Arc::new(CachingPool::new(&a));
        let on_a = crate::Stream::with_allocator(&a, cache.clone())?;
        drop(crate::compat::opencv::BufferPool::new(&on_a).get_buffer_1d::<u8>(4096)?); // now held by the cache
        let on_b = crate::Stream::with_allocator(&b, cache.clone())?;
        let err = crate::compat::opencv::BufferPool::new(&on_b)
            .get_buffer_1d::<u8>(4096)
            .unwrap_err();
        assert!(matches!(err, PoolError::DeviceMismatch { .. }), "{err}");
        assert_eq!(cache.stats().held_blocks, 1, "a's block stays a's");
        Ok(())
    }

    #[test]
    fn a_block_the_driver_will_not_free_stays_held_and_counted() -> Result<(), PoolError> {
        let device = crate::Device::private_host();
        let cache = std::sync::Arc::new(CachingPool::new(&device));
        let stream = crate::Stream::with_allocator(&device, cache.clone())?;
        drop(crate::compat::opencv::BufferPool::new(&stream).get_buffer_1d::<u8>(1000)?);
        let good = cache.stats().held_bytes;
        // A block the backend never handed out: its free is refused.
        let (bin, size) = CachingPool::bin_of(5000, cache.leading_bits);
        {
            let mut state = cache.cache.lock();
            state.bins.push(
                bin,
                Held {
                    ptr: 0xdead_0000,
                    size,
                    stream: 0,
                    ready: None,
                },
            );
            state.stats.held_blocks += 1;
            state.stats.held_bytes += size;
        }
        let err = cache.free_held().unwrap_err();
        assert!(matches!(err, PoolError::UnknownBlock { .. }), "{err}");
        let stats = cache.stats();
        assert_eq!(
            (stats.held_blocks, stats.held_bytes),
            (1, size),
            "the refused block stays"
        );
        assert!(good > 0);
        assert_eq!(
            device.backend().live_bytes(),
            Some(0),
            "the good one was freed"
        );
        cache.cache.lock().bins.0.clear(); // the forged block is no memory: forget it before drop
        Ok(())
    }

    #[test]
    fn a_request_of_zero_bytes_gets_a_one_byte_block() -> Result<(), PoolError> {
        let device = crate::Device::private_host();
        let cache = CachingPool::new(&device);
        let counters = crate::base::counters::StreamCounters::default();
        let ctx = AllocContext {
            storage: device.storage(),
            stream: &crate::storage::backend::RawStream::Host,
            stream_id: 1,
            counters: &counters,
        };
        let request = |bytes| AllocRequest {
            rows: 1,
            cols: bytes,
            width_bytes: bytes,
            pitched: false,
            bytes,
            pitch: bytes,
            reason: crate::FallbackReason::Disabled,
            stack_free: 0,
            stack_size: 0,
            align: 1,
        };
        let nothing = cache.allocate(&ctx, &request(0))?;
        assert_ne!(nothing.ptr, 0, "a real block, as PyOpenCL's bin 0");
        let stats = cache.stats();
        assert_eq!((stats.misses, stats.active_blocks), (1, 1));
        assert_eq!(
            (stats.active_requested_bytes, stats.active_rounded_bytes),
            (0, 1)
        );
        // SAFETY: allocated just above, freed once, never used.
        unsafe { cache.deallocate(&ctx, nothing) }?;
        assert_eq!(
            (cache.stats().held_blocks, cache.stats().held_bytes),
            (1, 1)
        );
        // A request of 1 byte is the same bin: the held block serves it, and 0 again after it.
        let one = cache.allocate(&ctx, &request(1))?;
        assert_eq!((one.ptr, cache.stats().hits), (nothing.ptr, 1));
        // SAFETY: as above.
        unsafe { cache.deallocate(&ctx, one) }?;
        let again = cache.allocate(&ctx, &request(0))?;
        assert_eq!((again.ptr, cache.stats().hits), (nothing.ptr, 2));
        // SAFETY: as above.
        unsafe { cache.deallocate(&ctx, again) }?;
        let stats = cache.stats();
        assert_eq!(
            (stats.active_requested_bytes, stats.active_rounded_bytes),
            (0, 0)
        );
        assert_eq!(stats.peak_active_rounded_bytes, 1);
        cache.free_held()?;
        assert_eq!(device.backend().live_bytes(), Some(0));
        Ok(())
    }

    #[test]
    fn each_bin_wastes_at_most_its_share() {
        // With 4 leading bits a block is at most 1/16 larger than the request (plus rounding).
        for s in [100_000usize, 1 << 20, (1 << 20) + 1, 48 << 20] {
            let (_, size) = CachingPool::bin_of(s, 4);
            assert!(size - s <= s / 16 + 1, "{s} -> {size}");
        }
    }
}
