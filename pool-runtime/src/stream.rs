//! Streams: a backend stream, the stack it holds, and the allocator behind the stack.
//!
//! A stream and its stack are used by one thread at a time: [`Stream`] is `Send` but not `Sync`. The
//! stack's top is a plain `Cell`, so taking a buffer needs no atomic and no lock; sharing a stream
//! between threads would need both on every allocation. Move the stream to the thread that uses it,
//! or give each thread its own.

use std::cell::{Cell, OnceCell, RefCell};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use crate::allocator::{self, AllocContext, AllocRequest, Allocation, GpuAllocator};
use crate::backend::{DevPtr, RawEvent, RawStream};
use crate::capturing::{self, Kept, Memory};
use crate::config;
use crate::device::{Device, StreamShared};
use crate::error::{PoolError, Request};
use crate::layout::Layout;
use crate::record::{Event, EventKind};
use crate::source::{CallSite, FallbackReason, Source};
use crate::stack::{Block, Release, Stack};
use crate::stats::{StreamCounters, StreamStats};

/// A stream of work on a device, with the stack that its temporary buffers come from.
///
/// ```
/// use gpu_pool_runtime::{Device, Stream};
/// let stream = Stream::new(&Device::host())?;
/// assert_eq!(stream.device(), &Device::host());
/// stream.synchronize()?;
/// # Ok::<(), gpu_pool_runtime::PoolError>(())
/// ```
///
/// `Stream` is `Send` but not `Sync`:
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<gpu_pool_runtime::Stream>();
/// ```
pub struct Stream {
    device: Device,
    pub(crate) raw: RawStream,
    /// The device's texture alignment, kept here so the hot path makes no virtual call.
    pub(crate) texture_alignment: usize,
    shared: Arc<StreamShared>,
    stack: OnceCell<Stack>,
    allocator: Arc<dyn GpuAllocator>,
    /// A user's allocator serves every buffer; the stack is not used.
    custom_allocator: bool,
    strict_lifo: bool,
    wants_stack: Cell<bool>,
    /// The device had no memory for the stacks when this stream first asked: it does not ask
    /// again (a driver call on every take), and its buffers fall back.
    no_stack_memory: Cell<bool>,
    /// Other streams' work that released memory must wait for ([`GpuMat::record_stream`]).
    deferred_waits: RefCell<Vec<RawEvent>>,
    pub(crate) has_deferred_waits: Cell<bool>,
    /// `has_deferred_waits || recording`: whether a release has more to do than release.
    release_hooks: Cell<bool>,
    /// Bytes of live fallback buffers that a large enough stack would have held.
    overflow_live: Cell<usize>,
    /// A CUDA graph capture is under way: nothing may reach the driver's allocator.
    pub(crate) capturing: Cell<bool>,
    /// Whether this stream records its takes and releases (`shared.recorder` is set).
    recording: bool,
    /// Fallback and driver memory released while a capture was under way on this thread, or
    /// while a graph that may use it lived: kept until neither is true (see `capturing`).
    kept: RefCell<Vec<Kept>>,
    /// Captures begun on this stream: the epoch a fallback or driver allocation is stamped with.
    captures_begun: Cell<u64>,
    /// The epochs of this stream's live graphs (each its capture's count when it began).
    live_graphs: RefCell<Vec<u64>>,
    /// This pool stream's claim on its CUDA stream: no other pool stream may wrap it.
    #[cfg(feature = "cuda")]
    _wrapped: Option<capturing::Wrapped>,
}

/// What a buffer must give back, and to whom.
#[derive(Debug)]
pub(crate) enum Origin {
    Empty,
    Stack(Block),
    /// Boxed: rare, and it keeps every buffer small, which the hot path feels.
    Fallback(Box<FallbackOrigin>),
    /// A driver allocation, stamped with the stream's capture epoch (see `Kept`).
    Driver(DevPtr, u64),
}

#[derive(Debug)]
pub(crate) struct FallbackOrigin {
    allocation: Allocation,
    reason: FallbackReason,
    bytes: usize,
    epoch: u64,
}

impl Origin {
    pub(crate) fn source(&self) -> Source {
        match self {
            Origin::Empty => Source::Empty,
            Origin::Stack(_) => Source::Stack,
            Origin::Fallback(f) => Source::Fallback(f.reason),
            Origin::Driver(..) => Source::Driver,
        }
    }
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
        let stream = Stream::build(device, device.fallback_allocator()?, false)?;
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
        Stream::build(device, allocator, true)
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
                actual: crate::error::DeviceId::Cuda(stream.context().ordinal()),
            });
        }
        let fallback = device.fallback_allocator()?;
        let made = Stream::build_on(device, RawStream::Cuda(stream), fallback, false)?;
        made.first_claim()?;
        Ok(made)
    }

    /// The cudarc stream, on a CUDA device: launch kernels on it.
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        match &self.raw {
            RawStream::Cuda(s) => Some(s),
            RawStream::Host => None,
        }
    }

    fn build(
        device: &Device,
        allocator: Arc<dyn GpuAllocator>,
        custom_allocator: bool,
    ) -> Result<Stream, PoolError> {
        config::env_config()?;
        let raw = device.storage().backend.new_stream()?;
        Stream::build_on(device, raw, allocator, custom_allocator)
    }

    fn build_on(
        device: &Device,
        raw: RawStream,
        allocator: Arc<dyn GpuAllocator>,
        custom_allocator: bool,
    ) -> Result<Stream, PoolError> {
        config::env_config()?;
        static STREAM_IDS: crate::unique::Counter = crate::unique::Counter::new();
        let record = device.recording()?;
        let id = STREAM_IDS.next();
        #[cfg(feature = "cuda")]
        let wrapped = capturing::Wrapped::claim(&raw, id)?;
        let shared = Arc::new(StreamShared::new(id, record));
        device.inner.register_stream(&shared);
        Ok(Stream {
            device: device.clone(),
            raw,
            texture_alignment: device.texture_alignment(),
            shared,
            stack: OnceCell::new(),
            allocator,
            custom_allocator,
            strict_lifo: device.strict_lifo()?,
            wants_stack: Cell::new(false),
            no_stack_memory: Cell::new(false),
            deferred_waits: RefCell::new(Vec::new()),
            has_deferred_waits: Cell::new(false),
            release_hooks: Cell::new(record > 0),
            overflow_live: Cell::new(0),
            capturing: Cell::new(false),
            recording: record > 0,
            kept: RefCell::new(Vec::new()),
            captures_begun: Cell::new(0),
            live_graphs: RefCell::new(Vec::new()),
            #[cfg(feature = "cuda")]
            _wrapped: wrapped,
        })
    }

    /// The stream's device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A number unique to this stream within the process.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// The index of the stack this stream holds, if any.
    pub fn stack_index(&self) -> Option<usize> {
        self.stack.get().map(|s| s.index)
    }

    /// The device addresses of the stack this stream holds, if any.
    pub fn stack_range(&self) -> Option<std::ops::Range<u64>> {
        self.stack
            .get()
            .map(|s| s.base..s.base + s.size() as DevPtr)
    }

    /// Waits until all work queued on the stream is done.
    pub fn synchronize(&self) -> Result<(), PoolError> {
        self.device.storage().backend.synchronize(&self.raw)
    }

    /// A snapshot of this stream's counters.
    pub fn stats(&self) -> StreamStats {
        self.shared.snapshot(self.device.id())
    }

    /// Starts this stream's peaks over from what it uses now (PyTorch's `reset_peak_memory_stats`),
    /// to measure one phase of a program: afterwards
    /// [`stack_high_water`](StreamStats::stack_high_water) equals `stack_in_use`,
    /// [`peak_demand`](StreamStats::peak_demand) equals the stack in use plus the live fallback
    /// buffers it would have held, and [`peak_at`](StreamStats::peak_at) is `None` until a take
    /// raises the mark again. Counts (allocations, fallbacks, driver calls, violations) and the
    /// fallback sites are totals, not peaks, and are kept.
    ///
    /// While the stream captures a CUDA graph its stack mark measures what the graph's replays will
    /// use, so it is not lowered then (the other figures are reset).
    ///
    /// ```
    /// use gpu_pool_runtime::{BufferPool, Device, Stream};
    /// let stream = Stream::new(&Device::host_with_limit(None))?;
    /// let pool = BufferPool::new(&stream);
    /// let kept = pool.get_buffer_1d::<u8>(1000)?;   // 1024 bytes of stack
    /// drop(pool.get_buffer_1d::<f32>(4096)?);       // a peak of 1024 + 16 KiB, gone
    /// assert_eq!(stream.stats().stack_high_water, 1024 + (16 << 10));
    /// stream.reset_peak();
    /// let stats = stream.stats();
    /// assert_eq!((stats.stack_high_water, stats.peak_demand), (1024, 1024));
    /// assert_eq!(stats.peak_at, None);
    /// drop(kept);
    /// # Ok::<(), gpu_pool_runtime::PoolError>(())
    /// ```
    pub fn reset_peak(&self) {
        let top = self.stack.get().map_or(0, Stack::top);
        // A capture's reservation is its high-water mark: lowering it mid-capture would leave
        // memory its replays write to later buffers.
        let stack = (!self.capturing.get()).then_some(top);
        let demand = top.saturating_add(self.overflow_live.get());
        self.shared.reset_peaks(stack, demand);
    }

    /// The allocator behind the stack (or the only one, for a stream made with
    /// [`Stream::with_allocator`]).
    pub fn allocator(&self) -> Arc<dyn GpuAllocator> {
        self.allocator.clone()
    }

    #[inline]
    fn counters(&self) -> &StreamCounters {
        &self.shared.counters
    }

    /// Takes a stack if pooling is on and one is free; returns it.
    #[cold]
    fn claim_stack(&self) -> Result<Option<&Stack>, PoolError> {
        if self.custom_allocator || self.no_stack_memory.get() || !config::buffer_pool_usage()? {
            return Ok(None);
        }
        if !self.wants_stack.replace(true) {
            self.device.inner.note_stream_wants_stack();
        }
        if !self.device.inner.has_free_stack() {
            return Ok(None);
        }
        match self.device.inner.claim_stack(&self.shared) {
            Ok(Some((stack, after))) => {
                if let Some(event) = after {
                    // The stack's last stream could not wait for its own work: this one does,
                    // before any of its work can touch the stack.
                    // Unordered use would race that work: on an error the stack stays held, unused.
                    self.device.storage().backend.wait_event(&self.raw, event)?;
                }
                Ok(Some(self.stack.get_or_init(|| stack)))
            }
            Ok(None) => Ok(None),
            Err(PoolError::OutOfMemory { requested, .. }) => {
                // OpenCV's rule: no memory for the stacks is no error; the buffers fall back.
                tracing::warn!(
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

    /// Memory for `layout`, asked for at `site`: from the stack when it fits, else from the
    /// allocator.
    #[inline(always)]
    pub(crate) fn take(
        &self,
        layout: &Layout,
        site: CallSite,
    ) -> Result<(DevPtr, usize, Origin), PoolError> {
        if layout.is_empty() {
            return Ok((0, layout.pitch, Origin::Empty));
        }
        let stack = match self.stack.get() {
            Some(stack) => stack,
            None => match self.claim_stack()? {
                Some(stack) => stack,
                None => {
                    let reason = if self.no_stack_memory.get() {
                        FallbackReason::NoStackMemory
                    } else if self.wants_stack.get() {
                        FallbackReason::NoStack
                    } else {
                        FallbackReason::Disabled
                    };
                    return self.take_fallback(layout, reason, (0, 0), site);
                }
            },
        };
        let Some((offset, block)) = stack.take_aligned(layout.bytes, layout.block_align) else {
            let reason = if layout.bytes > stack.size() {
                FallbackReason::TooLarge
            } else {
                FallbackReason::StackFull
            };
            return self.take_fallback(layout, reason, (stack.free_bytes(), stack.size()), site);
        };
        let c = self.counters();
        c.stack_allocations.add(1);
        c.stack_in_use.set(block.end as u64);
        if block.end as u64 > c.stack_high_water.get() {
            c.stack_high_water.set(block.end as u64);
            self.shared.note_peak(site.location());
        }
        if self.recording {
            self.record(
                EventKind::Take,
                Source::Stack,
                (offset, layout.bytes),
                Some(site),
            );
        }
        c.demand_peak
            .raise_to((block.end + self.overflow_live.get()) as u64);
        Ok((
            stack.base + offset as DevPtr,
            layout.pitch,
            Origin::Stack(block),
        ))
    }

    /// `(stack_free, stack_size)` is the stack's state (zeros without one).
    #[cold]
    fn take_fallback(
        &self,
        layout: &Layout,
        reason: FallbackReason,
        (stack_free, stack_size): (usize, usize),
        site: CallSite,
    ) -> Result<(DevPtr, usize, Origin), PoolError> {
        let short = layout.bytes.saturating_sub(stack_free);
        if reason != FallbackReason::Disabled {
            self.shared.note_fallback(site, reason, short);
        }
        if self.capturing.get() || capturing::on_this_thread() {
            // The driver refuses allocations from a capturing thread, and invalidates the capture.
            return Err(PoolError::CaptureNeedsStack {
                requested: layout.bytes,
                available: stack_free,
            });
        }
        self.free_kept_now();
        let request = AllocRequest {
            rows: layout.rows,
            cols: layout.cols,
            width_bytes: layout.width_bytes,
            pitched: layout.is_pitched(),
            bytes: layout.bytes,
            pitch: layout.pitch,
            reason,
            stack_free,
            stack_size,
            align: layout.elem_align,
        };
        let allocation = self
            .allocator
            .allocate(&self.alloc_context(), &request)
            .map_err(|e| {
                // What was in use plus the request; `None` where that wraps (no stack holds it).
                let stack_needed =
                    matches!(reason, FallbackReason::StackFull | FallbackReason::TooLarge)
                        .then(|| (stack_size - stack_free).checked_add(layout.bytes))
                        .flatten();
                e.at(Request {
                    site,
                    stream: self.id(),
                    stack_needed,
                })
            })?;
        let ptr = allocator::validate(&allocation, &request, self.device.id());
        let ptr = match ptr {
            Ok(ptr) => ptr,
            Err(e) => {
                // SAFETY: the allocation came from this allocator just now and is not used.
                let _ = unsafe { self.allocator.deallocate(&self.alloc_context(), allocation) };
                return Err(e);
            }
        };
        let c = self.counters();
        c.fallback[reason as usize].add(1);
        if reason != FallbackReason::Disabled {
            let overflow = self.overflow_live.get().saturating_add(layout.bytes);
            self.overflow_live.set(overflow);
            c.overflow_live.set(overflow as u64);
            let top = self.stack.get().map_or(0, Stack::top);
            c.demand_peak.raise_to(top.saturating_add(overflow) as u64);
        }
        if self.recording {
            let source = Source::Fallback(reason);
            self.record(EventKind::Take, source, (0, layout.bytes), Some(site));
        }
        Ok((
            ptr,
            allocation.pitch,
            Origin::Fallback(Box::new(FallbackOrigin {
                allocation,
                reason,
                bytes: layout.bytes,
                epoch: self.captures_begun.get(),
            })),
        ))
    }

    /// Memory of its own for a long-lived buffer: `cuMemAllocPitch` or `cuMemAlloc`, counted.
    pub(crate) fn take_from_driver(
        &self,
        layout: &Layout,
    ) -> Result<(DevPtr, usize, Origin), PoolError> {
        if self.capturing.get() || capturing::on_this_thread() {
            return Err(PoolError::CaptureNeedsStack {
                requested: layout.bytes,
                available: 0,
            });
        }
        self.free_kept_now();
        let storage = self.device.storage();
        let (ptr, pitch) = if layout.is_pitched() {
            storage.alloc_pitch(layout.width_bytes, layout.rows, Some(self.counters()))?
        } else {
            (
                storage.alloc(layout.bytes, Some(self.counters()))?,
                layout.pitch,
            )
        };
        if !layout.is_aligned(ptr, pitch) {
            // Not seen on any driver (allocations are 256-aligned, pitches multiples of 256), but
            // host slices of the rows would be misaligned, so it is checked, not assumed.
            // SAFETY: allocated just above, not used, freed once.
            unsafe { storage.free(ptr, Some(self.counters())) }?;
            return Err(PoolError::Unsupported {
                device: self.device.id(),
                what: "a driver allocation that is not aligned for the element type",
            });
        }
        Ok((ptr, pitch, Origin::Driver(ptr, self.captures_begun.get())))
    }

    fn alloc_context(&self) -> AllocContext<'_> {
        AllocContext {
            storage: self.device.storage(),
            stream: &self.raw,
            stream_id: self.shared.id,
            counters: self.counters(),
        }
    }

    /// Gives a buffer's memory back.
    ///
    /// # Safety
    /// `origin` was returned by `take` on this stream and is given back once; work that uses the
    /// memory is queued on this stream (stack memory is then reused in stream order).
    #[inline]
    pub(crate) unsafe fn give_back(&self, ptr: DevPtr, origin: &Origin) -> Result<(), PoolError> {
        // One flag for everything a release may have to do besides releasing, so a stream that
        // neither waits for other streams nor records pays one test.
        if self.release_hooks.get() {
            // SAFETY: forwarded.
            return unsafe { self.give_back_hooked(ptr, origin) };
        }
        // SAFETY: forwarded.
        unsafe { self.release(ptr, origin) }
    }

    /// The release itself.
    ///
    /// # Safety
    /// As [`Stream::give_back`].
    #[inline(always)]
    unsafe fn release(&self, ptr: DevPtr, origin: &Origin) -> Result<(), PoolError> {
        // Read in place: copying the origin out right after it was written stalls store forwarding.
        if let Origin::Stack(block) = origin
            && let Some(stack) = self.stack.get()
        {
            let release = stack.release(block);
            self.counters().stack_in_use.set(stack.top() as u64);
            return match release {
                Release::InOrder => Ok(()),
                Release::OutOfOrder => self.lifo_violation(ptr - stack.base),
            };
        }
        // SAFETY: forwarded.
        unsafe { self.give_back_slow(origin) }
    }

    /// A release with waits to issue first or an event to record after.
    ///
    /// # Safety
    /// As [`Stream::give_back`].
    #[cold]
    unsafe fn give_back_hooked(&self, ptr: DevPtr, origin: &Origin) -> Result<(), PoolError> {
        if self.has_deferred_waits.get() {
            self.issue_deferred_waits()?;
        }
        let stack_block = match origin {
            Origin::Stack(block) => self.stack.get().map(|s| (ptr - s.base, block.end)),
            _ => None,
        };
        // SAFETY: forwarded.
        let released = unsafe { self.release(ptr, origin) };
        if self.recording
            && let Some((offset, end)) = stack_block
        {
            self.record_release(offset, end, Source::Stack);
        }
        released
    }

    /// # Safety
    /// As [`Stream::give_back`].
    #[cold]
    unsafe fn give_back_slow(&self, origin: &Origin) -> Result<(), PoolError> {
        match origin {
            // A stack origin exists only once the stack does, so this is never reached for one.
            Origin::Empty | Origin::Stack(_) => Ok(()),
            Origin::Fallback(f) => {
                let FallbackOrigin {
                    allocation,
                    reason,
                    bytes,
                    epoch,
                } = **f;
                if reason != FallbackReason::Disabled {
                    let overflow = self.overflow_live.get().saturating_sub(bytes);
                    self.overflow_live.set(overflow);
                    self.counters().overflow_live.set(overflow as u64);
                }
                if self.recording {
                    self.record(
                        EventKind::Release,
                        Source::Fallback(reason),
                        (0, bytes),
                        None,
                    );
                }
                let memory = Memory::Fallback(allocation);
                // SAFETY: forwarded: the allocation came from this stream's allocator, once.
                unsafe { self.free_or_keep(Kept { memory, epoch }) }
            }
            // SAFETY: forwarded: `ptr` came from `take_from_driver`, once.
            &Origin::Driver(ptr, epoch) => unsafe {
                self.free_or_keep(Kept {
                    memory: Memory::Driver(ptr),
                    epoch,
                })
            },
        }
    }

    /// Frees released memory, or keeps it while something may still use it: a capture under way
    /// on this thread (whose work may use it, and which a driver free would break), a live graph
    /// whose capture began after it was allocated, or a capture of the stream begun elsewhere.
    ///
    /// # Safety
    /// `kept` came from this stream's allocator or `take_from_driver`, is given here once, and
    /// work that uses it is queued on this stream.
    #[cold]
    unsafe fn free_or_keep(&self, kept: Kept) -> Result<(), PoolError> {
        if self.must_keep(kept.epoch) {
            self.kept.borrow_mut().push(kept);
            return Ok(());
        }
        self.free_kept_now();
        // SAFETY: forwarded.
        unsafe { self.free_kept(kept) }
    }

    /// # Safety
    /// As [`Stream::free_or_keep`].
    unsafe fn free_kept(&self, kept: Kept) -> Result<(), PoolError> {
        match kept.memory {
            // SAFETY: forwarded: the allocation came from this stream's allocator, once; its work
            // is queued on this stream, which the allocator's free is ordered after.
            Memory::Fallback(allocation) => unsafe {
                self.allocator.deallocate(&self.alloc_context(), allocation)
            },
            // SAFETY: forwarded: `ptr` came from `take_from_driver`, once; the driver's free
            // synchronizes, so queued work using it is done.
            Memory::Driver(ptr) => unsafe {
                self.device.storage().free(ptr, Some(self.counters()))
            },
        }
    }

    /// Whether memory allocated at `epoch` must be kept rather than freed now.
    fn must_keep(&self, epoch: u64) -> bool {
        capturing::on_this_thread()
            || self.live_graphs.borrow().iter().any(|&graph| graph > epoch)
            || (!self.capturing.get()
                && self
                    .device
                    .storage()
                    .backend
                    .is_capturing(&self.raw)
                    .unwrap_or(true))
    }

    /// Frees the kept memory that nothing may use any more.
    #[cold]
    pub(crate) fn free_kept_now(&self) {
        if self.kept.borrow().is_empty() {
            return;
        }
        let kept = std::mem::take(&mut *self.kept.borrow_mut());
        for k in kept {
            if self.must_keep(k.epoch) {
                self.kept.borrow_mut().push(k);
                continue;
            }
            // SAFETY: every kept block came from `free_or_keep`, which owned it once, and left
            // the stream's list when it was taken here.
            if let Err(e) = unsafe { self.free_kept(k) } {
                tracing::error!(stream = self.id(), error = %e, "freeing memory kept for a graph failed");
            }
        }
    }

    /// A capture begins: allocations from now on are of a later epoch than its graph's.
    #[cfg(feature = "cuda")]
    pub(crate) fn capture_begun(&self) -> u64 {
        let epoch = self.captures_begun.get() + 1;
        self.captures_begun.set(epoch);
        epoch
    }

    /// A graph of the capture begun at `epoch` was made: memory allocated before that capture is
    /// kept, when released, until the graph is dropped.
    #[cfg(feature = "cuda")]
    pub(crate) fn graph_made(&self, epoch: u64) {
        self.live_graphs.borrow_mut().push(epoch);
    }

    /// The graph of `epoch` was dropped: what only it held is freed.
    #[cfg(feature = "cuda")]
    pub(crate) fn graph_dropped(&self, epoch: u64) {
        let mut live = self.live_graphs.borrow_mut();
        if let Some(i) = live.iter().position(|&e| e == epoch) {
            live.swap_remove(i);
        }
        drop(live);
        self.free_kept_now();
    }

    /// Whether this stream's own [`capture`](Stream::capture) is under way (not whether the
    /// driver records its CUDA stream: `Backend::is_capturing` says that).
    pub(crate) fn in_own_capture(&self) -> bool {
        self.capturing.get()
    }

    /// The backend stream for pool work named `what`: `PoolError::CapturedElsewhere` if the
    /// CUDA stream is being captured by anything but this stream's own
    /// [`capture`](Stream::capture), whose graph would replay it on memory the pool does not
    /// reserve.
    pub(crate) fn work_stream(&self, what: &'static str) -> Result<&RawStream, PoolError> {
        if !self.capturing.get() && self.device.storage().backend.is_capturing(&self.raw)? {
            return Err(PoolError::CapturedElsewhere {
                what,
                stream: self.id(),
            });
        }
        Ok(&self.raw)
    }

    /// `PoolError::CaptureCrossStream` if this stream or `other` is capturing: an event between
    /// them would join one to the other's capture or make a capture wait on outside work.
    pub(crate) fn check_cross_stream(
        &self,
        other: &Stream,
        what: &'static str,
    ) -> Result<(), PoolError> {
        let backend = &self.device.storage().backend;
        for s in [self, other] {
            if s.capturing.get() || backend.is_capturing(&s.raw)? {
                return Err(PoolError::CaptureCrossStream { what });
            }
        }
        Ok(())
    }

    /// Records that work queued on `user` so far uses memory of this stream: before that memory is
    /// handed out again, this stream waits for that work.
    pub(crate) fn defer_wait_for(&self, user: &Stream) -> Result<(), PoolError> {
        self.check_cross_stream(user, "record_stream")?;
        if let Some(event) = self.device.storage().backend.record_event(&user.raw)? {
            self.deferred_waits.borrow_mut().push(event);
            self.has_deferred_waits.set(true);
            self.release_hooks.set(true);
        }
        Ok(())
    }

    /// Makes this stream wait for every recorded use, so memory released now is reused (in this
    /// stream's order) only after that work.
    #[cold]
    pub(crate) fn issue_deferred_waits(&self) -> Result<(), PoolError> {
        let waits = std::mem::take(&mut *self.deferred_waits.borrow_mut());
        self.has_deferred_waits.set(false);
        self.release_hooks.set(self.recording);
        let mut result = Ok(());
        for event in waits {
            let waited = self.device.storage().backend.wait_event(&self.raw, event);
            result = result.and(waited);
        }
        result
    }

    /// Records a take: `(offset, bytes)` of the buffer.
    #[cold]
    fn record(
        &self,
        kind: EventKind,
        source: Source,
        (offset, bytes): (usize, usize),
        site: Option<CallSite>,
    ) {
        self.shared.record(Event {
            t_ns: crate::record::now_ns(),
            kind,
            source,
            offset,
            bytes,
            stack_in_use: self.stack.get().map_or(0, Stack::top),
            site,
        });
    }

    /// Records the release of the stack block at `offset` that ended at `end`.
    #[cold]
    fn record_release(&self, offset: u64, end: usize, source: Source) {
        let offset = offset as usize;
        let bytes = end.saturating_sub(offset);
        self.record(EventKind::Release, source, (offset, bytes), None);
    }

    #[cold]
    fn lifo_violation(&self, offset: u64) -> Result<(), PoolError> {
        self.counters().lifo_violations.add(1);
        let error = PoolError::LifoViolation {
            device: self.device.id(),
            offset: offset as usize,
        };
        if !self.device.inner.lifo_warned.swap(true, Relaxed) {
            tracing::warn!(
                stream = self.id(),
                "{error} (logged once per device; see lifo_violations in the stats)"
            );
        }
        if self.strict_lifo { Err(error) } else { Ok(()) }
    }
}

/// What CUDA graph capture (`graph.rs`) needs of a stream's stack: a fence, a reservation of what
/// the captured buffers used, and the high-water mark they reached.
#[cfg(feature = "cuda")]
impl Stream {
    /// The stack's top, if the stream holds a stack.
    pub(crate) fn stack_top(&self) -> Option<usize> {
        self.stack.get().map(Stack::top)
    }

    /// Takes one byte of the stack as a fence: stack memory below it cannot be reclaimed, nor
    /// reused, until the fence is released (what a graph's replays need of the memory above it).
    pub(crate) fn reserve_fence(&self) -> Result<Block, PoolError> {
        let stack = match self.stack.get() {
            Some(stack) => Some(stack),
            None => self.claim_stack()?,
        };
        let taken = stack.and_then(|s| s.take(1).map(|(_, block)| (s, block)));
        let Some((stack, fence)) = taken else {
            return Err(PoolError::CaptureNeedsStack {
                requested: 1,
                available: stack.map_or(0, Stack::free_bytes),
            });
        };
        self.counters().stack_in_use.set(stack.top() as u64);
        Ok(fence)
    }

    /// Takes the stack from its top up to `end`: what a capture's buffers used above its fence.
    /// `None` when they used nothing.
    pub(crate) fn reserve_up_to(&self, end: usize) -> Result<Option<Block>, PoolError> {
        let Some(stack) = self.stack.get() else {
            return Ok(None);
        };
        // From the top itself, not the next texture-aligned offset: a row or column buffer of the
        // capture was packed on 64 bytes right above the fence, below that offset.
        let start = stack.top();
        if end <= start {
            return Ok(None);
        }
        // The same bytes the capture's buffers had: they fitted then, and the top is where it was.
        let (_, block) =
            stack
                .take_aligned(end - start, 1)
                .ok_or(PoolError::CaptureNeedsStack {
                    requested: end - start,
                    available: stack.free_bytes(),
                })?;
        self.counters().stack_in_use.set(stack.top() as u64);
        Ok(Some(block))
    }

    /// Gives back a block of [`reserve_fence`](Self::reserve_fence) or
    /// [`reserve_up_to`](Self::reserve_up_to).
    pub(crate) fn release_reserved(&self, block: &Block) {
        if let Some(stack) = self.stack.get() {
            let release = stack.release(block);
            self.counters().stack_in_use.set(stack.top() as u64);
            if release == Release::OutOfOrder {
                // Reclaimed later, as any out-of-order block; counted and logged, never an error.
                let _ = self.lifo_violation(block.prev_top as u64);
            }
        }
    }

    /// Starts measuring the stack's high-water mark from `floor`; returns the mark so far.
    pub(crate) fn start_high_water(&self, floor: usize) -> u64 {
        let before = self.counters().stack_high_water.get();
        self.counters().stack_high_water.set(floor as u64);
        before
    }

    /// The mark reached since [`start_high_water`](Self::start_high_water), after which the
    /// stream's own mark is what it would have been without the measurement.
    pub(crate) fn end_high_water(&self, before: u64) -> usize {
        let peak = self.counters().stack_high_water.get();
        self.counters().stack_high_water.set(before.max(peak));
        peak as usize
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.has_deferred_waits.get()
            && let Err(e) = self.issue_deferred_waits()
        {
            tracing::error!(stream = self.id(), error = %e, "waiting for recorded uses failed");
        }
        // Queued work may still use the stack and kept memory: the next stream to take the stack,
        // and the allocator, must not race it. A capture on this thread refuses a wait (and would
        // break): there the stack goes back with an event its next stream waits for, and kept
        // memory, which no event can guard, is leaked, and said so.
        let holds = self.stack.get().is_some() || !self.kept.borrow().is_empty();
        let waited = if !holds {
            Ok(None)
        } else if capturing::on_this_thread() {
            let backend = &self.device.storage().backend;
            backend.record_event(&self.raw).and_then(|event| {
                event.map(Some).ok_or(PoolError::CaptureCrossStream {
                    what: "dropping a stream",
                })
            })
        } else {
            self.synchronize().map(|()| None)
        };
        let idle = matches!(waited, Ok(None));
        match waited {
            Ok(after) => {
                if let Some(stack) = self.stack.get() {
                    self.device.inner.return_stack(stack.index, after);
                }
            }
            Err(e) => {
                tracing::error!(stream = self.id(), error = %e, "a stream dropped with work nobody can wait for: its stack is kept out of use")
            }
        }
        let kept = std::mem::take(&mut *self.kept.borrow_mut());
        if idle && !capturing::on_this_thread() {
            for k in kept {
                // SAFETY: each kept block is freed once, here; the stream's work is done (waited
                // for above), and no graph of it is left (graphs borrow their stream).
                if let Err(e) = unsafe { self.free_kept(k) } {
                    tracing::error!(stream = self.id(), error = %e, "freeing kept memory failed");
                }
            }
        } else if !kept.is_empty() {
            tracing::error!(
                stream = self.id(),
                blocks = kept.len(),
                "a stream dropped with work nobody could wait for: its kept fallback memory is leaked"
            );
        }
        self.device
            .inner
            .retire_stream(&self.shared, self.wants_stack.get());
        let raw = std::mem::replace(&mut self.raw, RawStream::Host);
        self.device.storage().backend.drop_stream(raw);
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.shared.id)
            .field("device", &self.device.id())
            .field("stack", &self.stack_index())
            .field("allocator", &self.allocator)
            .finish()
    }
}
