//! Devices: one backend, one stack pool, one set of settings and counters each.
//!
//! All stacks of a device live in one allocation, made when a stream first takes a stack. Handing
//! stacks to streams and back takes the device's lock; nothing on the allocation hot path does.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use crate::backend::host::HostBackend;
use crate::backend::{Backend, DevPtr, RawStream};
use crate::caching::CachingPool;
use crate::config::{self, Fallback, PoolConfig};
use crate::error::{DeviceId, PoolError};
use crate::stack::Stack;
use crate::stats::{DeviceStats, Retired, StreamCounters, StreamStats, sum_streams};
use crate::sync;
use crate::unique::Counter;

/// A device: the host backend or a CUDA GPU. Cheap to clone; clones share one pool.
///
/// ```
/// use gpu_pool_runtime::Device;
/// let device = Device::host();
/// assert_eq!(device.id().to_string(), "host");
/// assert_eq!(device.texture_alignment(), 512);
/// ```
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    pub(crate) id: DeviceId,
    pub(crate) backend: Box<dyn Backend>,
    state: sync::Mutex<DeviceState>,
    driver_alloc_calls: AtomicU64,
    driver_free_calls: AtomicU64,
    /// Set after the first LIFO violation was logged, so the log is not flooded.
    pub(crate) lifo_warned: AtomicBool,
    /// The pool behind `Fallback::Caching`, made at first use.
    caching: OnceLock<Arc<CachingPool>>,
}

#[derive(Default)]
struct DeviceState {
    explicit_config: Option<PoolConfig>,
    fallback: Option<Fallback>,
    strict_lifo: Option<bool>,
    arena: Option<Arena>,
    streams_wanting: usize,
    streams_wanting_peak: usize,
    live_streams: Vec<Weak<StreamShared>>,
    retired: Retired,
}

/// The one allocation holding every stack, and which stacks are taken.
struct Arena {
    base: DevPtr,
    config: PoolConfig,
    held: Vec<bool>,
}

impl Arena {
    fn held_count(&self) -> usize {
        self.held.iter().filter(|h| **h).count()
    }
}

/// What a stream shares with its device for reporting.
#[derive(Debug)]
pub(crate) struct StreamShared {
    pub(crate) id: u64,
    pub(crate) counters: StreamCounters,
    /// The stack index, or `usize::MAX` while the stream holds none.
    pub(crate) stack_index: sync::AtomicUsize,
}

impl StreamShared {
    pub(crate) fn snapshot(&self, device: DeviceId) -> StreamStats {
        let index = self.stack_index.load(Relaxed);
        self.counters
            .snapshot(self.id, device, (index != usize::MAX).then_some(index))
    }
}

static REGISTRY: Mutex<Vec<Weak<DeviceInner>>> = Mutex::new(Vec::new());

/// Numbers of private host devices; 0 is [`Device::host`]'s.
static HOST_IDS: Counter = Counter::new();

/// Every device alive now, in creation order.
pub(crate) fn all_devices() -> Vec<Device> {
    lock(&REGISTRY)
        .iter()
        .filter_map(Weak::upgrade)
        .map(|inner| Device { inner })
        .collect()
}

/// Locks ignoring poison: every critical section below leaves its data consistent before any step
/// that can panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Device {
    pub(crate) fn from_backend(id: DeviceId, backend: Box<dyn Backend>) -> Device {
        let inner = Arc::new(DeviceInner {
            id,
            backend,
            state: sync::Mutex::new(DeviceState::default()),
            driver_alloc_calls: AtomicU64::new(0),
            driver_free_calls: AtomicU64::new(0),
            lifo_warned: AtomicBool::new(false),
            caching: OnceLock::new(),
        });
        let mut registry = lock(&REGISTRY);
        registry.retain(|d| d.strong_count() > 0);
        registry.push(Arc::downgrade(&inner));
        Device { inner }
    }

    /// The process-wide host device: real host memory, no limit. Every call returns the same device,
    /// so configuration made through one handle holds for all.
    pub fn host() -> Device {
        static HOST: OnceLock<Device> = OnceLock::new();
        HOST.get_or_init(|| {
            Device::from_backend(
                DeviceId::Host(0),
                Box::new(HostBackend::new(DeviceId::Host(0), None)),
            )
        })
        .clone()
    }

    /// A new, private host device whose backend hands out at most `limit` bytes in all (like a GPU's
    /// memory size). Its settings and stacks are its own: tests use it for isolation and to provoke
    /// out-of-memory.
    ///
    /// ```
    /// use gpu_pool_runtime::{BufferPool, Device, Fallback, PoolError, Stream, set_buffer_pool_config};
    /// let small = Device::host_with_limit(Some(1 << 20));
    /// small.set_fallback(Fallback::Driver);
    /// set_buffer_pool_config(&small, 512 << 10, 1)?;
    /// let stream = Stream::new(&small)?;
    /// let err = BufferPool::new(&stream).get_buffer_1d::<u8>(1 << 20).unwrap_err();
    /// assert!(matches!(err, PoolError::OutOfMemory { .. }));
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn host_with_limit(limit: Option<usize>) -> Device {
        let id = DeviceId::Host(HOST_IDS.next());
        Device::from_backend(id, Box::new(HostBackend::new(id, limit)))
    }

    /// The CUDA device `ordinal` (its primary context). Every call for one ordinal returns the same
    /// device. `PoolError::NoCudaDriver` where no driver can be loaded (or the crate was built
    /// without the `cuda` feature), `PoolError::NoSuchDevice` for an ordinal past the last.
    ///
    /// ```
    /// use gpu_pool_runtime::{Device, PoolError};
    /// match Device::cuda(0) {
    ///     Ok(gpu) => assert!(gpu.texture_alignment() >= 256),
    ///     Err(PoolError::NoCudaDriver { .. }) => println!("no GPU here"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn cuda(ordinal: usize) -> Result<Device, PoolError> {
        #[cfg(feature = "cuda")]
        {
            static CUDA: Mutex<Vec<Device>> = Mutex::new(Vec::new());
            let mut devices = lock(&CUDA);
            if let Some(d) = devices.iter().find(|d| d.id() == DeviceId::Cuda(ordinal)) {
                return Ok(d.clone());
            }
            let backend = crate::backend::cuda::CudaBackend::new(ordinal)?;
            let device = Device::from_backend(DeviceId::Cuda(ordinal), Box::new(backend));
            devices.push(device.clone());
            Ok(device)
        }
        #[cfg(not(feature = "cuda"))]
        Err(PoolError::NoCudaDriver {
            detail: format!(
                "gpu-pool was built without the `cuda` feature (asked for cuda:{ordinal})"
            ),
        })
    }

    /// How many CUDA devices there are; `PoolError::NoCudaDriver` without a driver.
    pub fn cuda_device_count() -> Result<usize, PoolError> {
        #[cfg(feature = "cuda")]
        return crate::backend::cuda::device_count();
        #[cfg(not(feature = "cuda"))]
        Err(PoolError::NoCudaDriver {
            detail: "gpu-pool was built without the `cuda` feature".into(),
        })
    }

    /// The first CUDA device if there is one, else the host device: what examples run on.
    pub fn cuda_or_host() -> Device {
        Device::cuda(0).unwrap_or_else(|_| Device::host())
    }

    /// The cudarc context of a CUDA device, for loading modules and launching kernels.
    #[cfg(feature = "cuda")]
    pub fn cuda_context(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaContext>> {
        self.inner.backend.as_cuda().map(|b| b.context())
    }

    /// A private host device whose allocation call number `fail_at` (1-based, every kind of
    /// allocation counted) fails with out-of-memory: for testing that every failure point is
    /// survived. 0 never fails.
    ///
    /// ```
    /// use gpu_pool_runtime::{BufferPool, Device, PoolError, Stream};
    /// let device = Device::host_with_fault(1); // the stack memory itself fails
    /// assert!(matches!(Stream::new(&device), Err(PoolError::OutOfMemory { .. })));
    /// assert_eq!(device.host_live_bytes(), Some(0));
    /// ```
    pub fn host_with_fault(fail_at: u64) -> Device {
        let id = DeviceId::Host(HOST_IDS.next());
        Device::from_backend(id, Box::new(HostBackend::with_fault(id, None, fail_at)))
    }

    /// On a host device, the bytes its backend has handed out and not taken back (device and
    /// pinned memory): what a leak check compares. `None` on a GPU.
    pub fn host_live_bytes(&self) -> Option<usize> {
        self.inner.backend.as_host().map(HostBackend::live_bytes)
    }

    /// Which device this is.
    pub fn id(&self) -> DeviceId {
        self.inner.id
    }

    /// Whether this is a host-backend device.
    pub fn is_host(&self) -> bool {
        matches!(self.inner.id, DeviceId::Host(_))
    }

    /// The texture alignment: 2D buffers have a pitch that is a multiple of it.
    pub fn texture_alignment(&self) -> usize {
        self.inner.backend.texture_alignment()
    }

    /// Whether the device supports stream-ordered allocation (`cuMemAllocAsync`).
    pub fn supports_stream_ordered(&self) -> bool {
        self.inner.backend.supports_stream_ordered()
    }

    /// Sets the stack size and count; see [`crate::set_buffer_pool_config`].
    pub fn set_pool_config(&self, config: PoolConfig) -> Result<(), PoolError> {
        let mut state = self.inner.lock_state();
        self.inner.free_arena(&mut state)?;
        state.explicit_config = Some(config);
        Ok(())
    }

    /// Gives the stack memory back to the driver, for other libraries or before the process ends
    /// (so leak checkers such as compute-sanitizer see every allocation freed); the next stream
    /// that takes a stack allocates it again. Returns the bytes freed. `PoolError::ConfigInUse`
    /// while a stream holds a stack: drop those streams first.
    ///
    /// ```
    /// use gpu_pool_runtime::{BufferPool, Device, PoolError, Stream};
    /// let device = Device::host_with_limit(None);
    /// let stream = Stream::new(&device)?;
    /// BufferPool::new(&stream).get_buffer::<u8>(4, 4)?;
    /// assert!(device.release_stack_memory().is_err()); // `stream` holds a stack
    /// drop(stream);
    /// assert_eq!(device.release_stack_memory()?, 50 << 20); // the default 5 x 10 MiB
    /// assert_eq!(device.host_live_bytes(), Some(0));
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn release_stack_memory(&self) -> Result<usize, PoolError> {
        let mut state = self.inner.lock_state();
        self.inner.free_arena(&mut state)
    }

    /// The config in force, or the one the next stack allocation will use.
    pub fn pool_config(&self) -> Result<PoolConfig, PoolError> {
        self.inner.lock_state().effective_config()
    }

    /// Chooses where buffers come from when the stack cannot serve them, for streams made from now
    /// on. [`Fallback::StreamOrdered`] on a device without stream-ordered allocation acts as
    /// [`Fallback::Driver`].
    pub fn set_fallback(&self, fallback: Fallback) {
        self.inner.lock_state().fallback = Some(fallback);
    }

    /// The fallback new streams get: the last [`Device::set_fallback`], else `GPU_POOL_CONF`'s,
    /// else stream-ordered where supported and the driver allocator elsewhere. A malformed
    /// `GPU_POOL_CONF` is its error (as for [`Stream::new`](crate::Stream::new)) unless an explicit
    /// setting makes it irrelevant.
    pub fn fallback(&self) -> Result<Fallback, PoolError> {
        let explicit = self.inner.lock_state().fallback;
        let chosen = match explicit {
            Some(fallback) => Some(fallback),
            None => config::env_config()?.fallback,
        };
        Ok(chosen.unwrap_or(if self.supports_stream_ordered() {
            Fallback::StreamOrdered
        } else {
            Fallback::Driver
        }))
    }

    /// In strict mode a stack buffer released out of LIFO order makes its explicit
    /// [`release`](crate::GpuMat::release) return `PoolError::LifoViolation` (the memory is still
    /// reclaimed correctly). Applies to streams made from now on. Off by default.
    pub fn set_strict_lifo(&self, strict: bool) {
        self.inner.lock_state().strict_lifo = Some(strict);
    }

    /// Whether new streams of this device are strict about LIFO order; a malformed
    /// `GPU_POOL_CONF` is its error unless [`Device::set_strict_lifo`] was called.
    pub fn strict_lifo(&self) -> Result<bool, PoolError> {
        let explicit = self.inner.lock_state().strict_lifo;
        Ok(match explicit {
            Some(strict) => strict,
            None => config::env_config()?.strict_lifo.unwrap_or(false),
        })
    }

    /// The device's shared [`CachingPool`], which serves `Fallback::Caching`.
    pub fn caching_pool(&self) -> Arc<CachingPool> {
        self.inner
            .caching
            .get_or_init(|| Arc::new(CachingPool::new(self)))
            .clone()
    }

    /// A snapshot of the device's counters and of each live stream's.
    pub fn stats(&self) -> DeviceStats {
        let state = self.inner.lock_state();
        let streams: Vec<StreamStats> = state
            .live_streams
            .iter()
            .filter_map(Weak::upgrade)
            .map(|s| s.snapshot(self.inner.id))
            .collect();
        let (stack_allocations, fallback_allocations, lifo_violations, stack_in_use, peak_demand) =
            sum_streams(&state.retired, &streams);
        DeviceStats {
            device: self.inner.id,
            config: state.effective_config(),
            stacks_held: state.arena.as_ref().map_or(0, Arena::held_count),
            stacks_allocated: state.arena.is_some(),
            peak_streams_wanting_stack: state.streams_wanting_peak,
            stack_in_use,
            stack_allocations,
            fallback_allocations,
            driver_alloc_calls: self.inner.driver_alloc_calls.load(Relaxed),
            driver_free_calls: self.inner.driver_free_calls.load(Relaxed),
            lifo_violations,
            peak_stream_demand: peak_demand,
            streams,
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for Device {}

impl DeviceState {
    fn effective_config(&self) -> Result<PoolConfig, PoolError> {
        if let Some(arena) = &self.arena {
            return Ok(arena.config);
        }
        match self.explicit_config {
            Some(config) => Ok(config),
            None => config::env_config()?.pool_config(PoolConfig::default()),
        }
    }
}

impl DeviceInner {
    fn lock_state(&self) -> sync::MutexGuard<'_, DeviceState> {
        sync::lock(&self.state)
    }

    /// Frees the stack memory if no stack is held: the bytes freed.
    fn free_arena(&self, state: &mut DeviceState) -> Result<usize, PoolError> {
        let Some(arena) = &state.arena else {
            return Ok(0);
        };
        let held = arena.held_count();
        if held > 0 {
            return Err(PoolError::ConfigInUse {
                device: self.id,
                held,
            });
        }
        let (base, bytes) = (arena.base, arena.config.total_bytes());
        // SAFETY: no stack is held, so no stream can hand out or use stack memory; streams
        // synchronize before giving their stack back, so no queued work uses it either. The arena
        // is dropped right after, so the address is freed once.
        unsafe { self.driver_free(base, None) }?;
        state.arena = None;
        Ok(bytes)
    }

    /// Takes a free stack for a stream, allocating the stack memory if this is the first. `Ok(None)`
    /// when every stack is held.
    pub(crate) fn claim_stack(&self, shared: &StreamShared) -> Result<Option<Stack>, PoolError> {
        let mut state = self.lock_state();
        let config = state.effective_config()?;
        if state.arena.is_none() {
            let base = self.driver_alloc(config.total_bytes(), None)?;
            state.arena = Some(Arena {
                base,
                config,
                held: vec![false; config.stack_count()],
            });
        }
        let arena = state.arena.as_mut().expect("set above");
        let Some(index) = arena.held.iter().position(|h| !h) else {
            return Ok(None);
        };
        arena.held[index] = true;
        shared.stack_index.store(index, Relaxed);
        let size = arena.config.stack_size();
        Ok(Some(Stack::new(
            index,
            arena.base + (index * size) as DevPtr,
            size,
            self.backend.texture_alignment(),
        )))
    }

    /// Whether a stream without a stack could get one now.
    pub(crate) fn has_free_stack(&self) -> bool {
        let state = self.lock_state();
        state
            .arena
            .as_ref()
            .is_none_or(|a| a.held_count() < a.held.len())
    }

    /// Gives a stack back. The caller has synchronized the stream that used it.
    pub(crate) fn return_stack(&self, index: usize) {
        if let Some(slot) = self
            .lock_state()
            .arena
            .as_mut()
            .and_then(|arena| arena.held.get_mut(index))
        {
            *slot = false;
        }
    }

    pub(crate) fn register_stream(&self, shared: &Arc<StreamShared>) {
        let mut state = self.lock_state();
        state.live_streams.retain(|s| s.strong_count() > 0);
        state.live_streams.push(Arc::downgrade(shared));
    }

    pub(crate) fn retire_stream(&self, shared: &StreamShared, wanted_stack: bool) {
        let snapshot = shared.snapshot(self.id);
        let mut state = self.lock_state();
        state.retired.absorb(&snapshot);
        state
            .live_streams
            .retain(|s| s.strong_count() > 0 && !std::ptr::eq(s.as_ptr(), shared));
        if wanted_stack {
            state.streams_wanting -= 1;
        }
    }

    /// Counts a stream among those that want a stack (for the recommended `stack_count`).
    pub(crate) fn note_stream_wants_stack(&self) {
        let mut state = self.lock_state();
        state.streams_wanting += 1;
        state.streams_wanting_peak = state.streams_wanting_peak.max(state.streams_wanting);
    }

    fn count_alloc(&self, stream: Option<&StreamCounters>) {
        self.driver_alloc_calls.fetch_add(1, Relaxed);
        if let Some(s) = stream {
            s.driver_alloc_calls.add(1);
        }
    }

    fn count_free(&self, stream: Option<&StreamCounters>) {
        self.driver_free_calls.fetch_add(1, Relaxed);
        if let Some(s) = stream {
            s.driver_free_calls.add(1);
        }
    }

    /// `cuMemAlloc`, counted.
    pub(crate) fn driver_alloc(
        &self,
        bytes: usize,
        stream: Option<&StreamCounters>,
    ) -> Result<DevPtr, PoolError> {
        self.count_alloc(stream);
        self.backend.alloc(bytes)
    }

    /// `cuMemAllocPitch`, counted.
    pub(crate) fn driver_alloc_pitch(
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
    pub(crate) unsafe fn driver_free(
        &self,
        ptr: DevPtr,
        stream: Option<&StreamCounters>,
    ) -> Result<(), PoolError> {
        self.count_free(stream);
        // SAFETY: forwarded to the caller.
        unsafe { self.backend.free(ptr) }
    }

    /// `cuMemAllocAsync`, counted.
    pub(crate) fn driver_alloc_async(
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
    pub(crate) unsafe fn driver_free_async(
        &self,
        ptr: DevPtr,
        raw: &RawStream,
        stream: Option<&StreamCounters>,
    ) -> Result<(), PoolError> {
        self.count_free(stream);
        // SAFETY: forwarded to the caller.
        unsafe { self.backend.free_async(ptr, raw) }
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        if let Some(arena) = self.lock_state().arena.take() {
            // SAFETY: the last handle is gone, and streams hold one, so no stream uses the stacks.
            if let Err(e) = unsafe { self.backend.free(arena.base) } {
                tracing::error!(device = %self.id, error = %e, "freeing the stack memory failed");
            }
        }
    }
}
