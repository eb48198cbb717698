//! Streams: a backend stream, the stack it holds, and the allocator behind the stack.
//!
//! A stream and its stack are used by one thread at a time: [`Stream`] is `Send` but not `Sync`. Only
//! that thread moves the stack's top, so taking a buffer needs no lock and no read-modify-write
//! (a growable stack's take adds one fence, for the device to give its idle memory back from
//! another thread: `core/stack/growable.rs`); sharing a stream between threads would need both on
//! every allocation. Move the stream to the thread that uses it, or give each thread its own.

// Without `graph` nothing makes graphs: the graph side of the capture seam is idle.
#[cfg_attr(not(feature = "graph"), allow(dead_code))]
mod capture;
mod clock;
mod lease;
mod sizing;
mod work;

use std::cell::{Cell, OnceCell};
use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};

use crate::allocators::{DriverAllocator, GpuAllocator, NoFallback, StreamOrderedAllocator};
use crate::base::counters::StreamCounters;
use crate::base::error::CaptureError;
use crate::base::error::PoolError;
use crate::core::capturing;
use crate::core::config::{self, DeviceConfig, Fallback};
use crate::core::deferred::{self, After, Deferred, GiveBack};
use crate::core::device::Device;
use crate::core::ledger::Ledger;
use crate::core::record::RecordEntry;
use crate::core::sink::{Op, Sink};
use crate::core::stack::{LayoutTrace, Stack};
use crate::core::stats::StreamStats;
use crate::storage::IdleMemory;
use crate::storage::backend::{DevPtr, RawEvent, RawStream};

use capture::CaptureState;
pub(crate) use clock::SyncClock;
pub(crate) use lease::Lease;
pub(crate) use sizing::Demand;
pub use sizing::Sizing;

/// A stream of work on a device, with the stack that its temporary buffers come from.
///
/// ```
/// use gpu_pool::{Device, Stream};
/// let stream = Stream::new(&Device::host())?;
/// assert_eq!(stream.device(), &Device::host());
/// stream.synchronize()?;
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
///
/// `Stream` is `Send` but not `Sync`:
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<gpu_pool::Stream>();
/// ```
pub struct Stream {
    device: Device,
    raw: RawStream,
    /// The device's texture alignment, kept here so the hot path makes no virtual call.
    texture_alignment: usize,
    /// The device's [`Packing`](crate::core::config::Packing) when the stream was made, as a block alignment.
    packing: usize,
    ledger: Arc<Ledger>,
    stack: OnceCell<Stack>,
    allocator: Arc<dyn GpuAllocator>,
    /// A user's allocator serves every buffer; the stack is not used.
    custom_allocator: bool,
    strict_lifo: bool,
    wants_stack: Cell<bool>,
    /// The device had no memory for the stacks when this stream first asked: it does not ask
    /// again (a driver call on every take), and its buffers fall back.
    no_stack_memory: Cell<bool>,
    /// What watches the takes and releases: the recording and the sizing of demand.
    sink: Sink,
    /// `deferred.any_waits() || sink.wants_releases()`: whether a release has more to do than
    /// release.
    release_hooks: Cell<bool>,
    /// What is given back later: kept memory, record_stream's waits (`core/deferred.rs`).
    deferred: Deferred,
    capture: CaptureState,
    /// Tickets of the host copies queued here, and which are done (`HostMem`).
    clock: Arc<SyncClock>,
    /// This pool stream's claim on its CUDA stream: no other pool stream may wrap it.
    #[cfg(feature = "cuda")]
    _wrapped: Option<capturing::Wrapped>,
}

impl Stream {
    /// Makes a stream on `device`. With pooling on it takes a free stack of the device (allocating
    /// the device's stack memory if it is the first); with none free, its buffers come from the
    /// fallback until one is.
    ///
    /// Errors: `GPU_POOL_CONF` malformed, or the backend could not make a stream. Without device
    /// memory for the stacks the stream is still made (as OpenCV's is): its buffers fall back with
    /// `FallbackReason::NoStackMemory`, and a stream made once memory is free gets a stack.
    pub fn new(device: &Device) -> Result<Stream, PoolError> {
        let config = device.config()?;
        let fallback = fallback_allocator(device, &config);
        let stream = Stream::build(device, &config, fallback, false)?;
        stream.first_claim()?;
        Ok(stream)
    }

    /// A new stream's claim on a stack. Without device memory for the stacks the stream is made
    /// all the same, its buffers falling back with `FallbackReason::NoStackMemory`.
    fn first_claim(&self) -> Result<(), PoolError> {
        if !config::buffer_pool_usage()? {
            return Ok(());
        }
        self.claim_stack().map(drop)
    }

    /// Makes a stream whose buffers all come from `allocator` (OpenCV's `Stream(allocator)`): it
    /// takes no stack.
    pub fn with_allocator(
        device: &Device,
        allocator: Arc<dyn GpuAllocator>,
    ) -> Result<Stream, PoolError> {
        Stream::build(device, &device.config()?, allocator, true)
    }

    /// Wraps a cudarc stream of `device`'s context, so pooled buffers and your own kernels share it.
    /// Takes a stack as [`Stream::new`] does.
    ///
    /// One pool stream per CUDA stream: `PoolError::StreamAlreadyWrapped` if a live pool stream
    /// (made by `from_cuda` or [`Stream::new`]) already wraps `stream`. Two stacks ordered as one
    /// stream would be recorded together by a graph capture that reserves only one of them.
    #[cfg(feature = "cuda")]
    pub fn from_cuda(
        device: &Device,
        stream: Arc<cudarc::driver::CudaStream>,
    ) -> Result<Stream, PoolError> {
        // `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` are handles whose stream depends on the
        // calling thread (or that alias the null stream): a `Send` pool stream over one would
        // move to another CUDA stream with its thread, or share a stack with another pool stream.
        let handle = stream.cu_stream() as usize;
        if handle == 1 || handle == 2 {
            return Err(PoolError::Unsupported {
                device: device.id(),
                what: "a pool stream over CU_STREAM_LEGACY or CU_STREAM_PER_THREAD (wrap the null \
                       default stream, or a stream of your own)",
            });
        }
        let ours = device.cuda_context().map(|c| c.cu_ctx());
        if ours != Some(stream.context().cu_ctx()) {
            return Err(PoolError::DeviceMismatch {
                expected: device.id(),
                actual: crate::base::id::DeviceId::Cuda(stream.context().ordinal()),
            });
        }
        let config = device.config()?;
        let fallback = fallback_allocator(device, &config);
        let made = Stream::build_on(device, &config, RawStream::Cuda(stream), fallback, false)?;
        made.first_claim()?;
        Ok(made)
    }

    /// The cudarc stream of a CUDA device's stream: launch kernels on it (with
    /// `LaunchArgsExt::buf` for pool buffers), or hand it to cuBLAS.
    ///
    /// # Errors
    /// [`PoolError::Unsupported`] on the host backend, which has no cudarc stream: run the CPU
    /// twin of the kernel there (`host_rows`, `for_each_host_row_mut`).
    #[cfg(feature = "cuda")]
    pub fn cudarc(&self) -> Result<&Arc<cudarc::driver::CudaStream>, PoolError> {
        self.cuda_stream().ok_or(PoolError::Unsupported {
            device: self.device().id(),
            what: "a cudarc stream (only a CUDA device has one: make the stream on \
                   Device::cuda(n), or run the kernel's CPU twin on the host backend)",
        })
    }

    /// The cudarc stream, on a CUDA device.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        match &self.raw {
            RawStream::Cuda(s) => Some(s),
            RawStream::Host => None,
        }
    }

    /// A stream made with `config`, the device's configuration read once when it is made: what
    /// the stream keeps ([`DeviceConfig`](crate::DeviceConfig)'s rule for existing streams).
    fn build(
        device: &Device,
        config: &DeviceConfig,
        allocator: Arc<dyn GpuAllocator>,
        custom_allocator: bool,
    ) -> Result<Stream, PoolError> {
        config::env_config()?;
        let raw = device.backend().new_stream()?;
        Stream::build_on(device, config, raw, allocator, custom_allocator)
    }

    fn build_on(
        device: &Device,
        config: &DeviceConfig,
        raw: RawStream,
        allocator: Arc<dyn GpuAllocator>,
        custom_allocator: bool,
    ) -> Result<Stream, PoolError> {
        config::env_config()?;
        static STREAM_IDS: crate::base::unique::Counter = crate::base::unique::Counter::new();
        let record = config.record;
        let id = STREAM_IDS.next();
        #[cfg(feature = "cuda")]
        let wrapped = capturing::Wrapped::claim(&raw, id)?;
        let exact_live = config.exact_live_peak;
        let ledger = Arc::new(Ledger::new(id, record, exact_live));
        device.inner.register_stream(&ledger);
        let holder: Weak<dyn IdleMemory> = Arc::downgrade(&ledger) as Weak<Ledger>;
        device.storage().register_holder(holder);
        Ok(Stream {
            device: device.clone(),
            raw,
            texture_alignment: device.texture_alignment(),
            packing: config.packing.block_align(),
            ledger,
            stack: OnceCell::new(),
            allocator,
            custom_allocator,
            strict_lifo: config.strict_lifo,
            wants_stack: Cell::new(false),
            no_stack_memory: Cell::new(false),
            sink: Sink::new(record),
            release_hooks: Cell::new(record > 0),
            deferred: Deferred::default(),
            capture: CaptureState::default(),
            clock: Arc::default(),
            #[cfg(feature = "cuda")]
            _wrapped: wrapped,
        })
    }

    /// The stream's counters and what other threads reach it by (the device's give-back of idle
    /// stack memory).
    pub(crate) fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// The stack this stream holds, if any.
    #[inline]
    pub(crate) fn stack(&self) -> Option<&Stack> {
        self.stack.get()
    }

    /// The stream's deferred give-backs (`core/deferred.rs`).
    pub(crate) fn deferred(&self) -> &Deferred {
        &self.deferred
    }

    /// Sets the release path's one flag from what it gates: pending waits, or a sink that wants
    /// releases.
    pub(crate) fn set_release_hooks(&self) {
        self.release_hooks
            .set(self.deferred.any_waits() || self.sink.wants_releases());
    }

    /// The backend stream, which features order their own work on (SharedMat's events).
    pub(crate) fn raw(&self) -> &RawStream {
        &self.raw
    }

    /// The stream's device.
    #[must_use]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A number unique to this stream within the process.
    #[must_use]
    pub fn id(&self) -> u64 {
        self.ledger.id
    }

    /// Whether the stream holds a growable stack.
    #[cfg(feature = "nccl")]
    pub(crate) fn has_growable_stack(&self) -> bool {
        self.stack.get().is_some_and(Stack::is_growable)
    }

    /// The index of the stack this stream holds, if any (growable stacks are numbered apart from a
    /// device's fixed ones, from 0 in the order they were made).
    #[must_use]
    pub fn stack_index(&self) -> Option<usize> {
        self.stack.get().map(|s| s.index)
    }

    /// The device addresses of the stack this stream holds, if any: for a growable stack, its whole
    /// reservation, of which only the mapped start (`stats().stack_mapped` bytes) has memory.
    #[must_use]
    pub fn stack_range(&self) -> Option<std::ops::Range<u64>> {
        self.stack
            .get()
            .map(|s| s.base..s.base + s.size() as DevPtr)
    }

    /// What this stream's stack has handed out since the stream got it (see [`LayoutTrace`]), to
    /// check that ranks running the same pooled work take the same offsets
    /// ([`check_symmetric`](crate::observe::check_symmetric)). `None` before the stream's first stack
    /// buffer, for a stream without a stack, and in builds without debug assertions (the take
    /// records nothing there).
    #[must_use]
    pub fn layout_trace(&self) -> Option<LayoutTrace> {
        self.stack.get()?.layout_trace()
    }

    /// Waits until all work queued on the stream is done. [`HostMem`](crate::HostMem) copies
    /// queued before it are then known done, with no driver call to ask.
    ///
    /// Where an out-of-memory elsewhere on the device asked for this stream's idle stack memory
    /// while a capture recorded the stream (see [`Device::reclaim_idle`](crate::Device::reclaim_idle)),
    /// it is given back here.
    pub fn synchronize(&self) -> Result<(), PoolError> {
        self.clock.synchronize(self.device.backend(), &self.raw)?;
        self.honour_trim_request();
        // What the device keeps for events now fired goes back (dropped `HostMem`s whose copies
        // are done): one atomic load if nothing waits.
        self.device
            .inner
            .deferred
            .give_back_done(&self.device.inner);
        Ok(())
    }

    /// A snapshot of this stream's counters.
    #[must_use]
    pub fn stats(&self) -> StreamStats {
        self.ledger.snapshot(self.device.id())
    }

    /// Starts this stream's peaks over from what it uses now (PyTorch's `reset_peak_memory_stats`),
    /// to measure one phase of a program: afterwards
    /// [`stack_high_water`](StreamStats::stack_high_water) equals `stack_in_use`,
    /// [`peak_demand`](StreamStats::peak_demand) equals the stack in use plus the live fallback
    /// buffers it would have held (placed, padding included, as it would have placed them), and [`peak_at`](StreamStats::peak_at) is `None` until a take
    /// raises the mark again. Counts (allocations, fallbacks, driver calls, violations) and the
    /// fallback sites are totals, not peaks, and are kept.
    ///
    /// While the stream captures a CUDA graph its stack mark measures what the graph's replays will
    /// use, so it is not lowered then (the other figures are reset).
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, Stream};
    /// let stream = Stream::new(&Device::private_host())?;
    /// let pool = BufferPool::new(&stream);
    /// let kept = pool.get_buffer_1d::<u8>(1000)?;   // 1024 bytes of stack
    /// drop(pool.get_buffer_1d::<f32>(4096)?);       // a peak of 1024 + 16 KiB, gone
    /// assert_eq!(stream.stats().stack_high_water, 1024 + (16 << 10));
    /// stream.reset_peak();
    /// let stats = stream.stats();
    /// assert_eq!((stats.stack_high_water, stats.peak_demand), (1024, 1024));
    /// assert_eq!(stats.peak_at, None);
    /// drop(kept);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub fn reset_peak(&self) {
        let top = self.stack.get().map_or(0, Stack::top);
        // A capture's reservation is its high-water mark: lowering it mid-capture would leave
        // memory its replays write to later buffers.
        let stack = (!self.in_own_capture()).then_some(top);
        self.ledger.reset_peaks(stack, self.demand_now());
    }

    /// The allocator behind the stack (or the only one, for a stream made with
    /// [`Stream::with_allocator`]).
    #[must_use]
    pub fn allocator(&self) -> Arc<dyn GpuAllocator> {
        self.allocator.clone()
    }

    #[inline]
    pub(crate) fn counters(&self) -> &StreamCounters {
        &self.ledger.counters
    }

    /// Takes a stack if pooling is on and one is free; returns it.
    #[cold]
    pub(crate) fn claim_stack(&self) -> Result<Option<&Stack>, PoolError> {
        if self.custom_allocator || self.no_stack_memory.get() || !config::buffer_pool_usage()? {
            return Ok(None);
        }
        if !self.wants_stack.replace(true) {
            self.device.inner.note_stream_wants_stack();
        }
        if !self.device.inner.has_free_stack() {
            return Ok(None);
        }
        let claimed = match self.device.inner.claim_stack(&self.ledger, &self.raw) {
            Err(e) => self.retry_after_reclaim(e, false, &mut || {
                self.device.inner.claim_stack(&self.ledger, &self.raw)
            }),
            claimed => claimed,
        };
        match claimed {
            Ok(Some((stack, after))) => {
                if let Some(event) = after {
                    // The stack's last stream could not wait for its own work: this one does,
                    // before any of its work can touch the stack.
                    // Unordered use would race that work: on an error the stack stays held, unused.
                    self.device.backend().wait_event(&self.raw, event)?;
                }
                // Before the ledger shares the bounds: no give-back writes it yet.
                self.counters().stack_mapped.set(stack.mapped() as u64);
                if stack.is_growable() {
                    self.map_configured(&stack);
                }
                let _ = self.ledger.stack.set(Arc::clone(stack.bounds()));
                Ok(Some(self.stack.get_or_init(|| stack)))
            }
            Ok(None) => Ok(None),
            Err(PoolError::OutOfMemory { requested, .. }) => {
                // OpenCV's rule: no memory for the stacks is no error; the buffers fall back.
                crate::base::event::warn!(
                    stream = self.id(),
                    requested,
                    "no device memory for the stacks: this stream's buffers come from its fallback"
                );
                self.no_stack_memory.set(true);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

impl Stream {}

/// The allocator that serves what a new stream's stack cannot: `config`'s fallback.
fn fallback_allocator(device: &Device, config: &DeviceConfig) -> Arc<dyn GpuAllocator> {
    match config.fallback {
        Fallback::Driver => Arc::new(DriverAllocator),
        Fallback::StreamOrdered => Arc::new(StreamOrderedAllocator),
        Fallback::Caching => device.caching_pool(),
        Fallback::Error => Arc::new(NoFallback),
    }
}

/// What a stream tells its sink and its ledger: takes and releases, LIFO violations.
impl Stream {
    /// Hands a take or a release to the sink, with the time and the stack's state now (the
    /// caller has checked `sink.records()`).
    #[cold]
    fn emit(&self, op: Op) {
        self.ledger.record(RecordEntry {
            t_ns: crate::core::record::now_ns(),
            kind: op.kind,
            source: op.source,
            offset: op.offset,
            bytes: op.bytes,
            stack_in_use: self.stack.get().map_or(0, Stack::top),
            stack_mapped: self.stack.get().map_or(0, Stack::mapped),
            site: op.site,
        });
    }

    /// Counts a release out of LIFO order (of the block at `offset`), logged once per device; an
    /// error in strict mode.
    #[cold]
    pub(crate) fn lifo_violation(&self, offset: u64) -> Result<(), PoolError> {
        self.counters().lifo_violations.add(1);
        let error = PoolError::LifoViolation {
            device: self.device.id(),
            offset: offset as usize,
        };
        if !self.device.inner.lifo_warned.swap(true, Relaxed) {
            crate::base::event::warn!(
                stream = self.id(),
                "{error} (logged once per device; see lifo_violations in the stats)"
            );
        }
        if self.strict_lifo { Err(error) } else { Ok(()) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Memory other streams used may be reused only after their work: if that cannot be
        // waited for, the stack stays out of use (as a failed wait at a release keeps its block).
        let issued = if self.deferred.any_waits() {
            self.issue_deferred_waits()
        } else {
            Ok(())
        };
        let waited = issued.and_then(|()| self.wait_or_record());
        let idle = matches!(waited, Ok(None));
        self.hand_stack_back(waited);
        self.drain_deferred_for_drop(idle && !capturing::on_this_thread());
        self.device
            .inner
            .retire_stream(&self.ledger, self.wants_stack.get());
        // The claim on the CUDA stream goes before the stream does: a stream made on another
        // thread may get the same handle from the driver as soon as it is destroyed.
        #[cfg(feature = "cuda")]
        drop(self._wrapped.take());
        let raw = std::mem::replace(&mut self.raw, RawStream::Host);
        self.device.backend().drop_stream(raw);
    }
}

/// A dropped stream's last steps.
impl Stream {
    /// Queued work may still use the stack and kept memory: the next stream to take the stack,
    /// and the allocator, must not race it. Waits for the stream (`Ok(None)`: its work is done),
    /// or, under a capture on this thread, which refuses a wait (and would break), records the
    /// event the stack's next stream waits for (kept memory, which no event can guard, is then
    /// leaked, and said so).
    fn wait_or_record(&self) -> Result<Option<RawEvent>, PoolError> {
        if self.stack.get().is_none() && !self.deferred.keeps_memory() {
            Ok(None)
        } else if capturing::on_this_thread() {
            let backend = self.device.backend();
            backend.record_event(&self.raw).and_then(|event| {
                event
                    .map(Some)
                    .ok_or(PoolError::Capture(CaptureError::CrossStream {
                        what: "dropping a stream",
                    }))
            })
        } else {
            self.synchronize().map(|()| None)
        }
    }

    /// Hands the stack back to the device, after `waited` (the event its next stream waits for,
    /// if any); kept out of use where the stream's work could be neither waited for nor marked.
    fn hand_stack_back(&mut self, waited: Result<Option<RawEvent>, PoolError>) {
        if let Some(stack) = self.stack.get() {
            // No give-back from another thread waits for this stream, nor unmaps, from here on.
            stack.retire();
        }
        match waited {
            Ok(after) => match self.stack.take() {
                Some(stack) if stack.is_growable() => {
                    // Unmapping is a driver call a capture on this thread must not see; then the
                    // stream's work is waited for (the event, if it could not synchronize).
                    let device = self.device.clone();
                    let after = After::Events(after.into_iter().collect());
                    deferred::after_captures(Box::new(move || {
                        // SAFETY: the stack retired with its stream, whose work is done once
                        // `after` holds (it synchronized, or the event follows its work).
                        let stack = unsafe { GiveBack::growable_stack(stack) };
                        device
                            .inner
                            .deferred
                            .give_back_after(&device.inner, after, stack, true);
                    }));
                }
                Some(stack) => self.device.inner.return_stack(stack.index, after),
                None => {}
            },
            Err(e) => {
                crate::base::event::error!(stream = self.id(), error = %e, "a stream dropped with work nobody can wait for: its stack is kept out of use")
            }
        }
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.ledger.id)
            .field("device", &self.device.id())
            .field("stack", &self.stack_index())
            .field("allocator", &self.allocator)
            .finish()
    }
}
