//! Devices: one backend, one stack pool, one set of settings and counters each.
//!
//! All stacks of a device live in one allocation, made when a stream first takes a stack. Handing
//! stacks to streams and back takes the device's lock; nothing on the allocation hot path does.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::allocators::caching::CachingPool;
use crate::base::counters::DevicePeak;
use crate::base::error::PoolError;
use crate::base::holders::Reclaimed;
use crate::base::id::DeviceId;
use crate::base::layout::{Footprint, Layout};
use crate::base::sync;
use crate::base::unique::Counter;
use crate::core::arena::{Arena, StackMemory};
use crate::core::capturing;
use crate::core::config::{self, DeviceConfig, Fallback, Packing, PoolConfig, Stacks};
use crate::core::deferred::DeviceDeferred;
use crate::core::ledger::Ledger;
use crate::core::record::StreamRecording;
use crate::core::sink::DeviceSink;
use crate::core::stack::Stack;
use crate::core::stats::{DeviceStats, Retired, StreamStats, sum_streams};
use crate::storage::Storage;
use crate::storage::backend::host::HostBackend;
use crate::storage::backend::{Backend, DevPtr, RawEvent, RawStream};

/// A device: the host backend or a CUDA GPU. Cheap to clone; clones share one pool.
///
/// ```
/// use gpu_pool::Device;
/// let device = Device::host();
/// assert_eq!(device.id().to_string(), "host");
/// assert_eq!(device.texture_alignment(), 512);
/// ```
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    /// The device's memory, which allocators and the caching pool hold too.
    pub(crate) storage: Arc<Storage>,
    state: sync::Mutex<DeviceState>,
    /// Set after the first LIFO violation was logged, so the log is not flooded.
    pub(crate) lifo_warned: AtomicBool,
    /// Streams made from now on count their live bytes into the device's exact total.
    exact_live_peak: AtomicBool,
    /// The bytes of every live pooled buffer, over all streams, and their peak.
    pub(crate) live_peak: DevicePeak,
    /// What outlives the streams of the sink seam: their recordings.
    pub(crate) sink: DeviceSink,
    /// What goes back once its events have fired: dropped `HostMem`s' page-locked memory, and
    /// dropped streams' growable stacks (`core/deferred.rs`).
    pub(crate) deferred: DeviceDeferred,
    /// The [`CachingPool`] behind `Fallback::Caching`, made at first use.
    caching: OnceLock<Arc<CachingPool>>,
}

#[derive(Default)]
struct DeviceState {
    /// What the program configured; `None`: `GPU_POOL_CONF`'s, else the default.
    explicit: Explicit,
    /// The default stacks are growable (a CUDA device with virtual memory management).
    growable_default: bool,
    arena: Option<Arena>,
    /// Growable stacks made so far (their indexes), and held now.
    growable_made: usize,
    growable_held: usize,
    /// Where the next arena's memory comes from, if not the driver ([`Device::set_stack_source`]).
    stack_source: Option<Arc<dyn StackMemory>>,
    streams_wanting: usize,
    streams_wanting_peak: usize,
    live_streams: Vec<Weak<Ledger>>,
    retired: Retired,
}

/// The settings of a [`DeviceConfig`] the program set, each apart: a malformed `GPU_POOL_CONF` is
/// an error only for the settings nothing explicit overrides. The exact peak and the memory limit
/// live where they are read (`DeviceInner`, `Storage`), the variable's applied when the device is
/// made.
#[derive(Default)]
struct Explicit {
    stacks: Option<Stacks>,
    fallback: Option<Fallback>,
    strict_lifo: Option<bool>,
    packing: Option<Packing>,
    record: Option<usize>,
}

static REGISTRY: Mutex<Vec<Weak<DeviceInner>>> = Mutex::new(Vec::new());

/// Numbers of private host devices; 0 is [`Device::host`]'s.
static HOST_IDS: Counter = Counter::new();

/// Every device alive now, in creation order.
pub(crate) fn all_devices() -> Vec<Device> {
    sync::lock(&REGISTRY)
        .iter()
        .filter_map(Weak::upgrade)
        .map(|inner| Device { inner })
        .collect()
}

impl Device {
    pub(crate) fn from_backend(id: DeviceId, backend: Box<dyn Backend>) -> Device {
        let inner = Arc::new(DeviceInner {
            storage: Arc::new(Storage::new(id, backend)),
            state: sync::Mutex::new(DeviceState::default()),
            lifo_warned: AtomicBool::new(false),
            exact_live_peak: AtomicBool::new(false),
            live_peak: DevicePeak::default(),
            deferred: DeviceDeferred::default(),
            sink: DeviceSink::default(),
            caching: OnceLock::new(),
        });
        // The variable's device-wide settings, applied once here (a malformed variable is an
        // error where the other settings are read).
        if let Ok(env) = config::env_config() {
            if let Some(exact) = env.exact_live_peak {
                inner.exact_live_peak.store(exact, Relaxed);
            }
            if let Some(limit) = env.memory_limit {
                inner.storage.set_limit(limit);
            }
        }
        let mut registry = sync::lock(&REGISTRY);
        registry.retain(|d| d.strong_count() > 0);
        registry.push(Arc::downgrade(&inner));
        Device { inner }
    }

    /// The process-wide host device: real host memory, no limit. Every call returns the same device,
    /// so configuration made through one handle holds for all.
    #[must_use]
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

    /// A new, private host device: real host memory, no limit. Unlike [`Device::host`], its
    /// settings, stacks and counters are its own, so tests use it for isolation.
    ///
    /// ```
    /// use gpu_pool::Device;
    /// let (a, b) = (Device::private_host(), Device::private_host());
    /// assert_ne!(a, b);
    /// assert_ne!(a, Device::host());
    /// assert!(a.is_host());
    /// ```
    #[must_use]
    pub fn private_host() -> Device {
        Device::new_private_host(None, 0)
    }

    /// A new, private host device (as [`Device::private_host`]) whose backend hands out at most
    /// `limit` bytes in all (like a GPU's memory size): tests use it to provoke out-of-memory.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, config::Fallback, Device, PoolError, compat::opencv::set_buffer_pool_config, Stream};
    /// let small = Device::host_with_limit(1 << 20);
    /// small.set_fallback(Fallback::Driver);
    /// set_buffer_pool_config(&small, 512 << 10, 1)?;
    /// let stream = Stream::new(&small)?;
    /// let err = BufferPool::new(&stream).get_buffer_1d::<u8>(1 << 20).unwrap_err();
    /// assert!(matches!(err, PoolError::OutOfMemory { .. }));
    /// # Ok::<(), PoolError>(())
    /// ```
    #[must_use]
    pub fn host_with_limit(limit: usize) -> Device {
        Device::new_private_host(Some(limit), 0)
    }

    /// A private host device whose streams mark their work with events and whose stream waits
    /// `fail_at..fail_at + count` fail.
    #[cfg(feature = "testing")]
    pub(crate) fn new_private_host_wait_faults(fail_at: u64, count: u64) -> Device {
        let id = DeviceId::Host(HOST_IDS.next());
        let backend = HostBackend::with_wait_faults(id, fail_at, count);
        Device::from_backend(id, Box::new(backend))
    }

    /// A private host device whose unmap or unreserve call number `fail_at` fails.
    #[cfg(feature = "testing")]
    pub(crate) fn new_private_host_unmap_fault(fail_at: u64) -> Device {
        let id = DeviceId::Host(HOST_IDS.next());
        Device::from_backend(id, Box::new(HostBackend::with_unmap_fault(id, fail_at)))
    }

    /// A private host device whose allocation calls `fail_at..fail_at + count` fail.
    #[cfg(feature = "testing")]
    pub(crate) fn new_private_host_faults(fail_at: u64, count: u64) -> Device {
        let id = DeviceId::Host(HOST_IDS.next());
        Device::from_backend(id, Box::new(HostBackend::with_faults(id, fail_at, count)))
    }

    /// A new private host device with its own id, memory `limit` and fault injection.
    pub(crate) fn new_private_host(limit: Option<usize>, fail_at: u64) -> Device {
        let id = DeviceId::Host(HOST_IDS.next());
        Device::from_backend(id, Box::new(HostBackend::with_fault(id, limit, fail_at)))
    }

    /// The CUDA device `ordinal` (its primary context). Every call for one ordinal returns the same
    /// device. `PoolError::NoCudaDriver` where no driver can be loaded (or the crate was built
    /// without the `cuda` feature), `PoolError::NoSuchDevice` for an ordinal past the last.
    ///
    /// ```
    /// use gpu_pool::{Device, PoolError};
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
            let mut devices = sync::lock(&CUDA);
            if let Some(d) = devices.iter().find(|d| d.id() == DeviceId::Cuda(ordinal)) {
                return Ok(d.clone());
            }
            let backend = crate::storage::backend::cuda::CudaBackend::new(ordinal)?;
            let device = Device::from_backend(DeviceId::Cuda(ordinal), Box::new(backend));
            // Growable stacks by default where the device can map memory (unless GPU_POOL_CONF
            // sets a stack size or count): the same take (BENCHMARKS.md, section M), no guess to
            // make, and memory equal to the peak.
            if device.inner.storage.backend.vmm_granularity().is_some() {
                device.inner.lock_state().growable_default = true;
            }
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
        return crate::storage::backend::cuda::device_count();
        #[cfg(not(feature = "cuda"))]
        Err(PoolError::NoCudaDriver {
            detail: "gpu-pool was built without the `cuda` feature".into(),
        })
    }

    /// The first CUDA device if there is one, else the host device: what examples run on. See
    /// [`cuda_or_host_with_reason`](Self::cuda_or_host_with_reason) for why it is the host.
    #[must_use]
    pub fn cuda_or_host() -> Device {
        Device::cuda_or_host_with_reason().0
    }

    /// [`cuda_or_host`](Self::cuda_or_host), with the reason it fell back to the host device: the
    /// error of [`Device::cuda(0)`](Self::cuda) (no driver, no device, a driver that failed to
    /// start), which a program can print, since a broken driver otherwise looks like "no GPU".
    ///
    /// ```
    /// use gpu_pool::Device;
    /// let (device, why_host) = Device::cuda_or_host_with_reason();
    /// match &why_host {
    ///     Some(reason) => println!("running on {} ({reason})", device.id()),
    ///     None => println!("running on {}", device.id()),
    /// }
    /// assert_eq!(device.is_host(), why_host.is_some());
    /// ```
    #[must_use]
    pub fn cuda_or_host_with_reason() -> (Device, Option<PoolError>) {
        match Device::cuda(0) {
            Ok(device) => (device, None),
            Err(reason) => (Device::host(), Some(reason)),
        }
    }

    /// What a `rows x cols` buffer of `T` takes of this device's stacks: its bytes, step and
    /// alignment, by the rule every take follows. For sizing stacks (and graphs, which hold what
    /// their buffers reached) before a run. The errors of a take of that shape: `SizeOverflow`,
    /// `UnsupportedAlignment`.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, Stream};
    /// let device = Device::private_host();
    /// let image = device.footprint::<[u8; 3]>(480, 640)?;
    /// assert_eq!((image.bytes, image.step, image.align), (480 * 2048, 2048, 512));
    /// let row = device.footprint::<f32>(1, 100)?;
    /// assert_eq!((row.bytes, row.align), (448, 256)); // 400 bytes, rounded to 64, on 256
    /// let stream = Stream::new(&device)?;
    /// let buffer = BufferPool::new(&stream).get_buffer::<[u8; 3]>(480, 640)?;
    /// assert_eq!(buffer.step(), image.step);
    /// assert_eq!(stream.stats().stack_in_use, image.bytes);
    /// # drop(buffer);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub fn footprint<T>(&self, rows: usize, cols: usize) -> Result<Footprint, PoolError> {
        let packing = self.packing()?.block_align();
        Layout::of::<T>(rows, cols, self.texture_alignment(), packing).map(|l| Footprint::of(&l))
    }

    /// The cudarc context of a CUDA device, for loading modules (`load_module`) and making
    /// cudarc's own streams and allocations.
    ///
    /// # Errors
    /// [`PoolError::Unsupported`] on the host backend, which has no cudarc context: skip the
    /// kernels there, or run their CPU twins.
    #[cfg(feature = "cuda")]
    pub fn cudarc(&self) -> Result<&std::sync::Arc<cudarc::driver::CudaContext>, PoolError> {
        self.cuda_context().ok_or(PoolError::Unsupported {
            device: self.id(),
            what: "a cudarc context (only a CUDA device has one: use Device::cuda(n), or run the \
                   kernels' CPU twins on the host backend)",
        })
    }

    /// The cudarc context of a CUDA device.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_context(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaContext>> {
        self.inner.storage.backend.cuda_context()
    }

    /// The device's backend, for the work streams and `MixMemory` queue on it.
    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.inner.storage.backend
    }

    /// The device's memory, for the pools that allocate through it.
    pub(crate) fn storage(&self) -> &Arc<Storage> {
        &self.inner.storage
    }

    /// Which device this is.
    #[must_use]
    pub fn id(&self) -> DeviceId {
        self.inner.storage.id
    }

    /// Whether this is a host-backend device.
    #[must_use]
    pub fn is_host(&self) -> bool {
        matches!(self.inner.storage.id, DeviceId::Host(_))
    }

    /// The texture alignment: 2D buffers have a pitch that is a multiple of it.
    #[must_use]
    pub fn texture_alignment(&self) -> usize {
        self.inner.storage.backend.texture_alignment()
    }

    /// Whether the device supports stream-ordered allocation (`cuMemAllocAsync`).
    #[must_use]
    pub fn supports_stream_ordered(&self) -> bool {
        self.inner.storage.backend.supports_stream_ordered()
    }

    /// Configures the device at once: every setting of `config` holds from now on, over
    /// `GPU_POOL_CONF` and the defaults. What happens to streams that exist is
    /// [`DeviceConfig`]'s one rule: a stream keeps what it was made with; the memory limit and
    /// the fixed stacks' memory are the device's. Errors, with nothing changed:
    /// `PoolError::Unsupported` for growable stacks on a device without virtual memory
    /// management, `PoolError::ConfigInUse` for a new fixed stack size or count while a stream
    /// holds a fixed stack.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, config::PoolConfig, PoolError, config::Stacks, Stream};
    /// let device = Device::private_host();
    /// let stream = Stream::new(&device)?;
    /// drop(BufferPool::new(&stream).get_buffer_1d::<u8>(64)?); // `stream` holds a stack
    /// let mut config = device.config()?;
    /// config.strict_lifo = true; // the stacks stay as they are: fine while held
    /// device.configure(config.clone())?;
    /// config.stacks = Stacks::Fixed(PoolConfig::new(1 << 20, 1)?);
    /// let err = device.configure(config).unwrap_err();
    /// assert!(matches!(err, PoolError::ConfigInUse { held: 1, .. }));
    /// assert!(device.config()?.strict_lifo);
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn configure(&self, config: DeviceConfig) -> Result<(), PoolError> {
        if matches!(config.stacks, Stacks::Growable { .. })
            && self.inner.storage.backend.vmm_granularity().is_none()
        {
            return Err(self.inner.storage.backend.no_vmm());
        }
        let mut state = self.inner.lock_state();
        if let Stacks::Fixed(fixed) = config.stacks
            && state.arena.as_ref().is_some_and(|a| a.config() != fixed)
        {
            self.inner.free_arena(&mut state)?;
        }
        state.explicit = Explicit {
            stacks: Some(config.stacks),
            fallback: Some(config.fallback),
            strict_lifo: Some(config.strict_lifo),
            packing: Some(config.packing),
            record: Some(config.record),
        };
        self.inner
            .exact_live_peak
            .store(config.exact_live_peak, Relaxed);
        self.inner.storage.set_limit(config.memory_limit);
        Ok(())
    }

    /// The configuration in force: what [`configure`](Self::configure) (or a setter) set, else
    /// what `GPU_POOL_CONF` sets, else the device's defaults (see [`DeviceConfig`]'s fields).
    /// `PoolError::InvalidEnvConfig` where the variable is malformed and a setting is left to it.
    ///
    /// ```
    /// use gpu_pool::{Device, config::Fallback, config::PoolConfig, config::Stacks};
    /// let device = Device::private_host();
    /// let config = device.config()?; // without GPU_POOL_CONF:
    /// assert_eq!(config.stacks, Stacks::Fixed(PoolConfig::default()));
    /// assert!(device.supports_stream_ordered()); // the host backend models it
    /// assert_eq!(config.fallback, Fallback::StreamOrdered);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub fn config(&self) -> Result<DeviceConfig, PoolError> {
        let state = self.inner.lock_state();
        let e = &state.explicit;
        let under = match (e.stacks, e.fallback, e.strict_lifo, e.packing, e.record) {
            (Some(_), Some(_), Some(_), Some(_), Some(_)) => self.inner.defaults(&state),
            _ => self.inner.under_explicit(&state)?,
        };
        Ok(DeviceConfig {
            stacks: e.stacks.unwrap_or(under.stacks),
            fallback: e.fallback.unwrap_or(under.fallback),
            strict_lifo: e.strict_lifo.unwrap_or(under.strict_lifo),
            packing: e.packing.unwrap_or(under.packing),
            record: e.record.unwrap_or(under.record),
            exact_live_peak: self.inner.exact_live_peak.load(Relaxed),
            memory_limit: self.inner.storage.limit(),
        })
    }

    /// One setting: the explicit one, else the variable's, else the default.
    fn setting<T>(
        &self,
        explicit: impl FnOnce(&Explicit) -> Option<T>,
        under: impl FnOnce(DeviceConfig) -> T,
    ) -> Result<T, PoolError> {
        let state = self.inner.lock_state();
        match explicit(&state.explicit) {
            Some(value) => Ok(value),
            None => self.inner.under_explicit(&state).map(under),
        }
    }

    /// Sets the stack size and count; see [`crate::compat::opencv::set_buffer_pool_config`].
    #[doc(hidden)]
    pub fn set_pool_config(&self, config: PoolConfig) -> Result<(), PoolError> {
        let mut state = self.inner.lock_state();
        self.inner.free_arena(&mut state)?;
        // A stack size and count mean OpenCV's fixed stacks.
        state.explicit.stacks = Some(Stacks::Fixed(config));
        Ok(())
    }

    /// Gives the streams made from now on growable stacks (`true`), or OpenCV's fixed stacks
    /// (`false`, what [`set_buffer_pool_config`](crate::compat::opencv::set_buffer_pool_config) also chooses).
    ///
    /// A growable stack is a range of addresses as large as the device's memory, reserved when its
    /// stream is made (`cuMemAddressReserve`), with the configured stack size
    /// ([`pool_config`](Self::pool_config)) mapped at once, so work that fits it makes no driver
    /// call after `Stream::new`; more memory is mapped in granules (`cuMemCreate` + `cuMemMap`,
    /// 2 MiB on the H100) only when the top passes the mapped end.
    /// Below the mapped end a take is the same bump as on a fixed stack, with no driver call;
    /// buffers never move; a stream never runs out of stack while the device has memory, and there
    /// is no count of stacks (every stream gets one). Memory stays mapped until
    /// [`Stream::trim`](crate::Stream::trim) or the stream's drop, so a loop that rises to a peak and falls back maps
    /// once, unless memory runs out elsewhere on the device: then the stack gives back what lies
    /// above its top, from whichever thread ran out, once the stream's work is done (a stream
    /// being captured keeps it until its next [`synchronize`](crate::Stream::synchronize) after
    /// the capture). Every reservation, map and unmap is a counted driver call.
    ///
    /// One window is left: a thread that runs out of memory checks that another stream is not
    /// being captured, then waits for that stream's work; a capture begun on that stream in
    /// between by code outside gpu-pool (cudarc's `begin_capture`) sees the wait and fails with a
    /// driver error. Nothing is unmapped then, and no memory is lost; captures through
    /// [`Stream::capture`](crate::Stream::capture) are not exposed to it.
    ///
    /// The default on a CUDA device with virtual memory management, unless `GPU_POOL_CONF` sets a
    /// stack size or count; fixed stacks on the host backend and elsewhere. Streams keep the
    /// stack they have. Each reservation takes address space as large as the device's memory: a process with
    /// hundreds of live streams per GPU runs out of addresses (later streams fall back, said in
    /// their stats). `PoolError::Unsupported` on a device without virtual memory management
    /// (the host backend models it, in 64 KiB granules).
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
    /// let device = Device::private_host();
    /// device.set_growable_stacks(true)?;
    /// let stream = Stream::new(&device)?;
    /// let big = BufferPool::new(&stream).get_buffer::<f32>(4096, 4096)?; // 64 MiB: no fallback
    /// assert_eq!(big.source(), gpu_pool::Source::Stack);
    /// assert_eq!(stream.stats().stack_mapped, 64 << 20);
    /// drop(big);
    /// assert_eq!(stream.trim()?, 64 << 20); // the memory goes back
    /// # Ok::<(), PoolError>(())
    /// ```
    #[doc(hidden)]
    pub fn set_growable_stacks(&self, on: bool) -> Result<(), PoolError> {
        if on && self.inner.storage.backend.vmm_granularity().is_none() {
            return Err(self.inner.storage.backend.no_vmm());
        }
        // The stack size stays: it becomes what is mapped at a stream's start, and back.
        let size = self.pool_config().unwrap_or_default();
        self.inner.lock_state().explicit.stacks = Some(if on {
            Stacks::Growable {
                mapped: size.stack_size(),
            }
        } else {
            Stacks::Fixed(size)
        });
        Ok(())
    }

    /// Whether streams made now get growable stacks ([`set_growable_stacks`](Self::set_growable_stacks)).
    #[doc(hidden)]
    #[must_use]
    pub fn growable_stacks(&self) -> bool {
        self.stacks()
            .is_ok_and(|s| matches!(s, Stacks::Growable { .. }))
    }

    /// The stacks streams made now get ([`DeviceConfig::stacks`]).
    pub(crate) fn stacks(&self) -> Result<Stacks, PoolError> {
        self.inner.stacks(&self.inner.lock_state())
    }

    /// Gives the stack memory back to the driver, for other libraries or before the process ends
    /// (so leak checkers such as compute-sanitizer see every allocation freed); the next stream
    /// that takes a stack allocates it again. Returns the bytes freed. `PoolError::ConfigInUse`
    /// while a stream holds a stack: drop those streams first.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
    /// let device = Device::private_host();
    /// let stream = Stream::new(&device)?;
    /// drop(BufferPool::new(&stream).get_buffer::<u8>(4, 4)?);
    /// assert!(device.release_stack_memory().is_err()); // `stream` holds a stack
    /// drop(stream);
    /// assert_eq!(device.release_stack_memory()?, 50 << 20); // the default 5 x 10 MiB
    /// assert_eq!(gpu_pool::testing::host_live_bytes(&device), Some(0));
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn release_stack_memory(&self) -> Result<usize, PoolError> {
        let mut state = self.inner.lock_state();
        self.inner.free_arena(&mut state)
    }

    /// The config in force, or the one the next stack allocation will use (for growable stacks:
    /// what is mapped at a stream's start, with the default count).
    pub fn pool_config(&self) -> Result<PoolConfig, PoolError> {
        self.inner.pool_config(&self.inner.lock_state())
    }

    /// Chooses where buffers come from when the stack cannot serve them, for streams made from now
    /// on. [`Fallback::StreamOrdered`] on a device without stream-ordered allocation acts as
    /// [`Fallback::Driver`].
    #[doc(hidden)]
    pub fn set_fallback(&self, fallback: Fallback) {
        self.inner.lock_state().explicit.fallback = Some(fallback);
    }

    /// The fallback new streams get: the last [`Device::set_fallback`], else `GPU_POOL_CONF`'s,
    /// else stream-ordered where supported and the driver allocator elsewhere. A malformed
    /// `GPU_POOL_CONF` is its error (as for [`Stream::new`](crate::Stream::new)) unless an explicit
    /// setting makes it irrelevant.
    pub fn fallback(&self) -> Result<Fallback, PoolError> {
        self.setting(|e| e.fallback, |c| c.fallback)
    }

    /// In strict mode a stack buffer released out of LIFO order makes its explicit
    /// [`release`](crate::compat::opencv::GpuMat::release) return `PoolError::LifoViolation` (the memory is still
    /// reclaimed correctly). Applies to streams made from now on. Off by default.
    #[doc(hidden)]
    pub fn set_strict_lifo(&self, strict: bool) {
        self.inner.lock_state().explicit.strict_lifo = Some(strict);
    }

    /// Whether new streams of this device are strict about LIFO order; a malformed
    /// `GPU_POOL_CONF` is its error unless [`Device::set_strict_lifo`] was called.
    pub fn strict_lifo(&self) -> Result<bool, PoolError> {
        self.setting(|e| e.strict_lifo, |c| c.strict_lifo)
    }

    /// Chooses where row and column blocks start on the stacks of streams made from now on:
    /// [`Packing::Cuda`] (256 bytes, the default) or [`Packing::OpenCv`] (64, OpenCV's packing).
    /// See [`Packing`].
    #[doc(hidden)]
    pub fn set_packing(&self, packing: Packing) {
        self.inner.lock_state().explicit.packing = Some(packing);
    }

    /// The packing new streams of this device get: the last [`Device::set_packing`], else
    /// `GPU_POOL_CONF`'s `packing`, else [`Packing::Cuda`]. A malformed `GPU_POOL_CONF` is its
    /// error unless [`Device::set_packing`] was called.
    pub fn packing(&self) -> Result<Packing, PoolError> {
        self.setting(|e| e.packing, |c| c.packing)
    }

    /// Records the last `events_per_stream` takes and releases of each stream made from now on (0:
    /// none), for the timeline's exports ([`Device::recordings`]). Off by default; `GPU_POOL_CONF=record=N`
    /// turns it on for every device. A stream that does not record pays nothing for it.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
    /// let device = Device::private_host();
    /// device.set_recording(100);
    /// let stream = Stream::new(&device)?;
    /// drop(BufferPool::new(&stream).get_buffer_1d::<u8>(64)?);
    /// let recording = &device.recordings()[0];
    /// assert_eq!(recording.events.len(), 2); // the take and the release
    /// # Ok::<(), PoolError>(())
    /// ```
    #[doc(hidden)]
    pub fn set_recording(&self, events_per_stream: usize) {
        self.inner.lock_state().explicit.record = Some(events_per_stream);
    }

    /// Makes [`DeviceStats::peak_live_bytes`] exact for the streams made from now on: each adds
    /// its live bytes to one device-wide atomic total at every take and release, and the peak
    /// follows that total, so no moment when several streams hold more together is missed. Off by
    /// default, as RMM's statistics adaptor is opt-in: the shared atomic costs every take and
    /// release (7.7 to 23 ns for a take + release on the H200's host, BENCHMARKS Q), where the
    /// default samples the sum when a stream passes its own high and at every stats read.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
    /// let device = Device::private_host();
    /// device.set_exact_live_peak(true);
    /// let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
    /// let (pa, pb) = (BufferPool::new(&a), BufferPool::new(&b));
    /// drop(pa.get_buffer_1d::<u8>(8 << 20)?); // each stream's own high: 8 MiB, alone
    /// drop(pb.get_buffer_1d::<u8>(8 << 20)?);
    /// let (x, y) = (pa.get_buffer_1d::<u8>(6 << 20)?, pb.get_buffer_1d::<u8>(6 << 20)?);
    /// drop((y, x)); // 12 MiB at once, each stream below its own high
    /// assert_eq!(device.stats().peak_live_bytes, 12 << 20);
    /// # Ok::<(), PoolError>(())
    /// ```
    #[doc(hidden)]
    pub fn set_exact_live_peak(&self, exact: bool) {
        self.inner.exact_live_peak.store(exact, Relaxed);
    }

    /// Whether streams made from now on keep the device's live peak exact
    /// ([`Device::set_exact_live_peak`]).
    pub fn exact_live_peak(&self) -> bool {
        self.inner.exact_live_peak.load(Relaxed)
    }

    /// The setting: events per stream that new streams record, [`Device::set_recording`]'s, else
    /// `GPU_POOL_CONF`'s `record`, else 0. What was recorded is [`Device::recordings`].
    pub fn recording_events_per_stream(&self) -> Result<usize, PoolError> {
        self.setting(|e| e.record, |c| c.record)
    }

    /// For the readers of recordings in `observe/`, at one moment: the recordings of dropped
    /// streams, the ledgers of live ones (a stream is in one or the other: it retires under the
    /// same lock) and the stack size.
    pub(crate) fn recording_sources(&self) -> (Vec<StreamRecording>, Vec<Arc<Ledger>>, usize) {
        let state = self.inner.lock_state();
        let live = state
            .live_streams
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let stack_size = self.inner.pool_config(&state).map_or(0, |c| c.stack_size());
        (self.inner.sink.retired(), live, stack_size)
    }

    /// `attempt`, and where it runs out of memory, once more after every holder of the device's
    /// idle memory gave it back; the final error says what was held and given back. For the
    /// allocations no stream makes (`SharedMat`, `HostMem`). Inside a capture on this thread there
    /// is no second attempt: giving memory back waits for the device.
    pub(crate) fn or_reclaim<T>(
        &self,
        mut attempt: impl FnMut() -> Result<T, PoolError>,
    ) -> Result<T, PoolError> {
        match attempt() {
            Err(PoolError::OutOfMemory { .. }) if !capturing::on_this_thread() => {
                self.inner.storage.retry_reclaimed(None, None, &mut attempt)
            }
            other => other,
        }
    }

    /// Asks every holder of this device's idle memory to give it back now (PyTorch's
    /// `empty_cache`): the caching pools free their held blocks, the stream-ordered pool is
    /// trimmed, and each stream's growable stack unmaps what lies above its top, whatever thread
    /// uses the stream, once the stream's work is done (this waits for it). What is in use or in
    /// flight stays: a stack whose stream is being captured keeps its memory, and is asked to give
    /// it back at its next [`synchronize`](crate::Stream::synchronize). An out-of-memory anywhere
    /// on the device does this and tries once more by itself.
    /// Inside a CUDA graph capture on this thread nothing is given back (a free would break the
    /// capture), and an empty `Reclaimed` is returned.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, config::Fallback, Device, PoolError, compat::opencv::set_buffer_pool_config, Stream};
    /// let device = Device::private_host();
    /// device.set_fallback(Fallback::Caching);
    /// set_buffer_pool_config(&device, 1 << 20, 1)?;
    /// let stream = Stream::new(&device)?;
    /// drop(BufferPool::new(&stream).get_buffer_1d::<u8>(4 << 20)?); // a caching-pool block, held
    /// assert!(device.stats().idle_bytes() >= 4 << 20);
    /// let reclaimed = device.reclaim_idle();
    /// assert!(reclaimed.given_back() >= 4 << 20);
    /// assert_eq!(device.stats().idle_bytes(), 0);
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn reclaim_idle(&self) -> Reclaimed {
        if capturing::on_this_thread() {
            // Freeing memory inside a capture would break it: nothing is given back.
            return Reclaimed::default();
        }
        self.inner.storage.reclaim(None)
    }

    /// Caps what this device's pools may hold at once (CuPy's `set_limit`, PyTorch's per-process
    /// memory fraction, RMM's limiting adaptor), `None` for no cap: every driver allocation made
    /// through the pools counts against it (stack memory, mapped growable stacks, fallbacks, the
    /// caching pool's blocks, `GpuMat::new`, `SharedMat`, the stream-ordered pool's reserve). A
    /// request that would pass it gives idle memory back and tries once more, then is
    /// `PoolError::OutOfMemory`, whose message says the limit. Memory already held stays.
    ///
    /// ```
    /// use gpu_pool::{config::Fallback, Device, compat::opencv::GpuMat, PoolError, Stream};
    /// let device = Device::private_host();
    /// device.set_fallback(Fallback::Driver);
    /// device.set_memory_limit(Some(64 << 20));
    /// let stream = Stream::new(&device)?; // 50 MiB of stacks
    /// let err = GpuMat::<u8>::new(&stream, 1, 32 << 20).unwrap_err();
    /// assert!(err.to_string().contains("memory limit is 67108864 bytes"), "{err}");
    /// assert!(GpuMat::<u8>::new(&stream, 1, 8 << 20).is_ok());
    /// # Ok::<(), PoolError>(())
    /// ```
    #[doc(hidden)]
    pub fn set_memory_limit(&self, limit: Option<usize>) {
        self.inner.storage.set_limit(limit);
    }

    /// The cap [`set_memory_limit`](Self::set_memory_limit) set, if any.
    #[must_use]
    pub fn memory_limit(&self) -> Option<usize> {
        self.inner.storage.limit()
    }

    /// The device's shared [`CachingPool`], which serves `Fallback::Caching`.
    #[must_use]
    pub fn caching_pool(&self) -> Arc<CachingPool> {
        self.inner
            .caching
            .get_or_init(|| Arc::new(CachingPool::new(self)))
            .clone()
    }

    /// Starts the device's peaks over from what is in use now (PyTorch's
    /// `reset_peak_memory_stats(device)`), to size the stacks for one phase of a program:
    /// afterwards [`peak_streams_wanting_stack`](DeviceStats::peak_streams_wanting_stack) is the
    /// number of streams that hold or want a stack now, and
    /// [`peak_stream_demand`](DeviceStats::peak_stream_demand) the largest demand of a live stream
    /// now (its stack in use plus the live fallback buffers the stack would have held, padding
    /// included), so [`recommended_config`](DeviceStats::recommended_config) covers what comes
    /// next, and [`peak_live_bytes`](DeviceStats::peak_live_bytes) is what is live now. Dropped
    /// streams use nothing, so their peaks are forgotten; counts and fallback sites are totals and
    /// are kept.
    ///
    /// It resets each live stream's demand peak, which the device's is made of. A stream's stack
    /// high-water mark and its peak site are left to [`Stream::reset_peak`](crate::Stream::reset_peak)
    /// on the thread that uses the stream: the mark is that thread's alone, and a CUDA graph capture
    /// on it reserves what the mark measures. A stream taking buffers on another thread during the
    /// reset may have its demand peak set a little low or high (to a level reached around it).
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, config::Fallback, Device, compat::opencv::set_buffer_pool_config, Stream};
    /// let device = Device::private_host();
    /// device.set_fallback(Fallback::Driver);
    /// set_buffer_pool_config(&device, 1 << 20, 1)?;
    /// let stream = Stream::new(&device)?;
    /// let pool = BufferPool::new(&stream);
    /// drop(pool.get_buffer_1d::<u8>(3 << 20)?);          // a 3 MiB fallback: demand 3 MiB
    /// assert_eq!(device.stats().recommended_config().unwrap().stack_size(), 3 << 20);
    /// device.reset_peak();
    /// let small = pool.get_buffer_1d::<u8>(1000)?;       // the next phase needs 1 KiB
    /// let stats = device.stats();
    /// assert_eq!(stats.peak_stream_demand, 1024);
    /// assert_eq!(stats.recommended_config().unwrap().stack_size(), 1 << 20);
    /// # drop(small);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub fn reset_peak(&self) {
        let mut state = self.inner.lock_state();
        state.streams_wanting_peak = state.streams_wanting;
        state.retired.peak_demand = 0;
        let mut live = 0;
        for ledger in state.live_streams.iter().filter_map(Weak::upgrade) {
            let demand = ledger.counters.demand_now();
            ledger.reset_peaks(None, demand as usize);
            // Another thread's take may raise it again at once: a high is then sampled anew.
            let now = ledger.counters.live_bytes.get();
            ledger.counters.live_high.set(now);
            live += now;
        }
        self.inner.live_peak.reset(live);
    }

    /// Raises the device's live peak to what its streams hold at once now.
    #[cold]
    pub(crate) fn sample_live_peak(&self) {
        let state = self.inner.lock_state();
        let live = state
            .live_streams
            .iter()
            .filter_map(Weak::upgrade)
            .map(|l| l.counters.live_bytes.get())
            .sum();
        self.inner.live_peak.saw(live);
    }

    /// A snapshot of the device's counters and of each live stream's.
    #[must_use]
    pub fn stats(&self) -> DeviceStats {
        // Asked before the lock: a holder's answer may take locks of its own.
        let idle_holders = self.inner.storage.idle_holdings();
        let state = self.inner.lock_state();
        let streams: Vec<StreamStats> = state
            .live_streams
            .iter()
            .filter_map(Weak::upgrade)
            .map(|s| s.snapshot(self.inner.storage.id))
            .collect();
        let (stack_allocations, fallback_allocations, lifo_violations, stack_in_use, peak_demand) =
            sum_streams(&state.retired, &streams);
        let live_bytes: usize = streams.iter().map(|s| s.live_bytes).sum();
        self.inner.live_peak.saw(live_bytes as u64);
        let peak_live_bytes = self.inner.live_peak.get();
        DeviceStats {
            device: self.inner.storage.id,
            config: self.inner.pool_config(&state),
            stacks: self.inner.stacks(&state),
            stacks_held: state.arena.as_ref().map_or(0, Arena::held_count) + state.growable_held,
            stacks_allocated: state.arena.is_some(),
            peak_streams_wanting_stack: state.streams_wanting_peak,
            stack_in_use,
            live_bytes,
            live_buffers: streams.iter().map(|s| s.live_buffers).sum(),
            peak_live_bytes: peak_live_bytes as usize,
            stack_allocations,
            fallback_allocations,
            driver_alloc_calls: self.inner.storage.alloc_calls(),
            driver_free_calls: self.inner.storage.free_calls(),
            lifo_violations,
            stack_mapped: self.inner.storage.mapped_bytes() as usize,
            peak_stream_demand: peak_demand,
            streams,
            retired_fallback_sites: state.retired.fallback_sites.clone(),
            idle_holders,
            memory_limit: self.inner.storage.limit(),
            memory_counted: self.inner.storage.limited_bytes(),
        }
    }
}

/// The stack-memory seam: where fixed stacks' memory comes from, and keeping it while a library
/// has it registered. NCCL is its client (`nccl::use_nccl_memory`, `register_stacks`).
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
impl Device {
    /// Takes the stack memory from `source` (`None`: the driver) from now on. Memory already
    /// allocated elsewhere is freed if no stream holds a stack (`PoolError::ConfigInUse` if one
    /// does, and nothing changes), so the next stack comes from `source`.
    pub(crate) fn set_stack_source(
        &self,
        source: Option<Arc<dyn StackMemory>>,
    ) -> Result<(), PoolError> {
        let mut state = self.inner.lock_state();
        if state
            .arena
            .as_ref()
            .is_some_and(|a| !a.is_from(source.as_ref()))
        {
            self.inner.free_arena(&mut state)?;
        }
        state.stack_source = source;
        Ok(())
    }

    /// Whether the stacks come from a source of a library rather than the driver.
    pub(crate) fn stack_source_is_external(&self) -> bool {
        self.inner.lock_state().stack_source.is_some()
    }

    /// Keeps the fixed stacks' memory from being freed or replaced while the pin lives (a
    /// library registered it), allocating it now if it is not yet.
    pub(crate) fn pin_stacks(&self) -> Result<StackPin, PoolError> {
        let mut state = self.inner.lock_state();
        if state.arena.is_none() {
            let config = self.inner.pool_config(&state)?;
            let memory = state.stack_source.clone();
            state.arena = Some(Arena::allocate(&self.inner.storage, config, memory)?);
        }
        let arena = state.arena.as_mut().expect("set above");
        arena.pin();
        Ok(StackPin {
            device: self.clone(),
            range: arena.range(),
        })
    }
}

/// A device's fixed stack memory, kept (neither freed nor replaced) while this lives.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) struct StackPin {
    device: Device,
    range: (DevPtr, usize),
}

#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
impl StackPin {
    /// The pinned memory's first address and its bytes.
    pub(crate) fn range(&self) -> (DevPtr, usize) {
        self.range
    }
}

impl Drop for StackPin {
    fn drop(&mut self) {
        if let Some(arena) = self.device.inner.lock_state().arena.as_mut() {
            arena.unpin();
        }
    }
}

/// The caching pool's constructors: the pool sits below the device, on its storage.
impl CachingPool {
    /// A pool for `device` with [`DEFAULT_LEADING_BITS`](Self::DEFAULT_LEADING_BITS).
    #[must_use]
    pub fn new(device: &Device) -> CachingPool {
        CachingPool::on_storage(device.storage(), CachingPool::DEFAULT_LEADING_BITS)
            .unwrap_or_else(|_| unreachable!("the default leading bits are valid"))
    }

    /// A pool whose bins are named by `leading_bits` bits after the highest (PyOpenCL's
    /// `leading_bits_in_bin_id`): more bits, finer bins, less rounding, fewer hits. 0 to 16.
    pub fn with_leading_bits(device: &Device, leading_bits: u32) -> Result<CachingPool, PoolError> {
        CachingPool::on_storage(device.storage(), leading_bits)
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("id", &self.inner.storage.id)
            .finish()
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for Device {}

impl DeviceInner {
    fn lock_state(&self) -> sync::MutexGuard<'_, DeviceState> {
        sync::lock(&self.state)
    }

    /// The device's own defaults.
    fn defaults(&self, state: &DeviceState) -> DeviceConfig {
        DeviceConfig {
            stacks: if state.growable_default {
                Stacks::Growable {
                    mapped: PoolConfig::default().stack_size(),
                }
            } else {
                Stacks::Fixed(PoolConfig::default())
            },
            fallback: if self.storage.backend.supports_stream_ordered() {
                Fallback::StreamOrdered
            } else {
                Fallback::Driver
            },
            ..DeviceConfig::default()
        }
    }

    /// Where the settings nothing explicit sets come from: `GPU_POOL_CONF` over the defaults.
    fn under_explicit(&self, state: &DeviceState) -> Result<DeviceConfig, PoolError> {
        config::env_config()?.over(self.defaults(state))
    }

    /// The stacks streams made now get.
    fn stacks(&self, state: &DeviceState) -> Result<Stacks, PoolError> {
        match state.explicit.stacks {
            Some(stacks) => Ok(stacks),
            None => self.under_explicit(state).map(|c| c.stacks),
        }
    }

    /// The fixed stacks in force, or the ones the next allocation will make.
    fn pool_config(&self, state: &DeviceState) -> Result<PoolConfig, PoolError> {
        match &state.arena {
            Some(arena) => Ok(arena.config()),
            None => self.stacks(state).map(Stacks::pool_config),
        }
    }

    /// Frees the stack memory if no stack is held: the bytes freed.
    fn free_arena(&self, state: &mut DeviceState) -> Result<usize, PoolError> {
        Arena::free(&mut state.arena, &self.storage)
    }

    /// Takes a free stack for the stream of `ledger`, allocating the stack memory if this is the
    /// first, with the event its last stream's work must be waited for at, if any. `Ok(None)` when
    /// every stack is held.
    pub(crate) fn claim_stack(
        &self,
        ledger: &Ledger,
        stream: &RawStream,
    ) -> Result<Option<(Stack, Option<RawEvent>)>, PoolError> {
        let mut state = self.lock_state();
        let stacks = self.stacks(&state)?;
        if let Stacks::Growable { .. } = stacks {
            let index = state.growable_made;
            let stack = Stack::reserve_growable(&self.storage, index, stream)?;
            state.growable_made += 1;
            state.growable_held += 1;
            ledger.stack_index.store(index, Relaxed);
            return Ok(Some((stack, None)));
        }
        if state.arena.is_none() {
            let config = stacks.pool_config();
            let memory = state.stack_source.clone();
            state.arena = Some(Arena::allocate(&self.storage, config, memory)?);
        }
        let arena = state.arena.as_mut().expect("set above");
        let claimed = arena.claim(self.storage.backend.texture_alignment());
        if let Some((stack, _)) = &claimed {
            ledger.stack_index.store(stack.index, Relaxed);
        }
        Ok(claimed)
    }

    /// Gives a dropped stream's growable stack back (`core/stack/growable.rs`).
    ///
    /// # Safety
    /// As for [`Stack::release_growable`]: the stream is gone and its work is done.
    pub(crate) unsafe fn release_growable(&self, stack: Stack) {
        // SAFETY: the caller's contract.
        unsafe { stack.release_growable(&self.storage) };
        let mut state = self.lock_state();
        state.growable_held = state.growable_held.saturating_sub(1);
    }

    /// Whether a stream without a stack could get one now.
    pub(crate) fn has_free_stack(&self) -> bool {
        let state = self.lock_state();
        matches!(self.stacks(&state), Ok(Stacks::Growable { .. }))
            || state.arena.as_ref().is_none_or(Arena::has_free)
    }

    /// Gives a stack back. The caller has synchronized the stream that used it, or passes the
    /// event that marks the end of its work, for the next stream to wait for.
    pub(crate) fn return_stack(&self, index: usize, after: Option<RawEvent>) {
        let mut state = self.lock_state();
        if let Some(arena) = state.arena.as_mut() {
            arena.return_stack(index, after);
        }
    }

    pub(crate) fn register_stream(&self, ledger: &Arc<Ledger>) {
        let mut state = self.lock_state();
        state.live_streams.retain(|s| s.strong_count() > 0);
        state.live_streams.push(Arc::downgrade(ledger));
    }

    pub(crate) fn retire_stream(&self, ledger: &Ledger, wanted_stack: bool) {
        let snapshot = ledger.snapshot(self.storage.id);
        let recording = ledger
            .recorder
            .as_ref()
            .map(|r| StreamRecording::of(self.storage.id, ledger.id, &sync::lock(r)));
        let mut state = self.lock_state();
        state.retired.absorb(&snapshot);
        if let Some(recording) = recording {
            self.sink.retire(recording);
        }
        state
            .live_streams
            .retain(|s| s.strong_count() > 0 && !std::ptr::eq(s.as_ptr(), ledger));
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
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // The last copies of dropped `HostMem`s are waited for: their memory goes back with the
        // device (what cannot be waited for stays, logged).
        self.deferred.check(self, true);
        if self.deferred.waiting() != 0 {
            crate::base::event::error!(device = %self.storage.id, "memory whose work could not be waited for is leaked");
        }
        if let Some(arena) = self.lock_state().arena.take() {
            arena.free_at_exit(&self.storage);
        }
    }
}

/// Sets the stack size and count of `device` (OpenCV's `setBufferPoolConfig`).
///
/// `stack_size` is rounded up to a multiple of [`PoolConfig::STACK_ALIGN`]; zero sizes or counts are
/// `PoolError::InvalidConfig`. If streams hold stacks of the device, nothing changes and the result
/// is `PoolError::ConfigInUse`. Otherwise the old stack memory, if any, is freed, and the new one is
/// allocated when a stream first needs it.
///
/// ```
/// use gpu_pool::{Device, PoolError, compat::opencv::set_buffer_pool_config, Stream};
/// let device = Device::private_host();
/// set_buffer_pool_config(&device, 64 << 20, 2)?;
/// let stream = Stream::new(&device)?;
/// let err = set_buffer_pool_config(&device, 1 << 20, 1).unwrap_err();
/// assert!(matches!(err, PoolError::ConfigInUse { held: 1, .. }));
/// # Ok::<(), PoolError>(())
/// ```
pub fn set_buffer_pool_config(
    device: &Device,
    stack_size: usize,
    stack_count: usize,
) -> Result<(), PoolError> {
    device.set_pool_config(PoolConfig::new(stack_size, stack_count)?)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use super::*;
    use crate::Stream;
    use crate::compat::opencv::BufferPool;

    /// A stack source over the host backend's own memory that counts its calls.
    struct Counted {
        device: Device,
        allocs: AtomicUsize,
        frees: AtomicUsize,
    }

    impl StackMemory for Counted {
        fn alloc(&self, bytes: usize) -> Result<DevPtr, PoolError> {
            self.allocs.fetch_add(1, SeqCst);
            self.device.backend().alloc(bytes)
        }

        unsafe fn free(&self, ptr: DevPtr) -> Result<(), PoolError> {
            self.frees.fetch_add(1, SeqCst);
            // SAFETY: forwarded to the caller; `ptr` came from the backend's `alloc` above.
            unsafe { self.device.backend().free(ptr) }
        }
    }

    #[test]
    fn a_stack_source_serves_the_stacks_and_a_pin_keeps_its_memory() -> Result<(), PoolError> {
        let device = Device::private_host();
        let source = Arc::new(Counted {
            device: device.clone(),
            allocs: AtomicUsize::new(0),
            frees: AtomicUsize::new(0),
        });
        device.set_stack_source(Some(source.clone()))?;
        assert!(device.stack_source_is_external());
        let stream = Stream::new(&device)?;
        drop(BufferPool::new(&stream).get_buffer_1d::<u8>(64)?);
        assert_eq!(
            source.allocs.load(SeqCst),
            1,
            "the stacks came from the source"
        );
        drop(stream);
        let pin = device.pin_stacks()?;
        assert_eq!(pin.range().1, device.pool_config()?.total_bytes());
        let err = device.release_stack_memory().unwrap_err();
        assert!(
            matches!(err, PoolError::StackMemoryRegistered { .. }),
            "{err}"
        );
        drop(pin);
        device.set_stack_source(None)?; // frees the source's memory: no stack is held
        assert_eq!(source.frees.load(SeqCst), 1);
        assert!(!device.stack_source_is_external());
        Ok(())
    }
}
