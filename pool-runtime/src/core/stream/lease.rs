//! The take and the give-back: a request becomes a [`Lease`] on the stream's stack, its fallback
//! allocator or the driver, and the lease gives that memory back, once, when it is dropped.
//!
//! Read top to bottom, this file is a buffer's whole life in the pool: `Stream::take` (the stack,
//! else `Stream::take_fallback`), `Stream::take_from_driver` for long-lived buffers, then
//! [`Lease`]'s drop, which gives a stack block back (`Stream::give_back_block`) or anything else
//! (`Stream::give_back_other`: the allocator or the driver, or kept for a graph).

use std::fmt;
use std::mem::ManuallyDrop;

use crate::allocators::{self as allocator, AllocContext, AllocRequest, Allocation};
use crate::base::error::CaptureError;
use crate::base::error::{PoolError, RequestContext};
use crate::base::layout::Layout;
use crate::base::source::{CallSite, FallbackReason, Source};
use crate::core::capturing;
use crate::core::sink::Op;
use crate::core::stack::{Block, Release, Stack};
use crate::storage::backend::DevPtr;

use super::Stream;
use super::sizing::DemandBlock;
use crate::core::deferred::Kept;

/// Memory a buffer holds and how it goes back: its address, shape and pitch, where it came from,
/// and the stream it goes back to.
///
/// Made only by the stream's take ([`Stream::take`], [`Stream::take_from_driver`]); neither `Copy`
/// nor `Clone`, and it gives its memory back when dropped (or through [`release`](Lease::release),
/// which consumes it), so memory goes back exactly once.
// The shape is here, so a buffer is its lease and an element type (`GpuMat`), nothing more.
pub(crate) struct Lease<'s> {
    stream: &'s Stream,
    ptr: DevPtr,
    rows: usize,
    cols: usize,
    pitch: usize,
    /// Taken out once, by `drop` or `release`: no drop glue runs after them (a test and a branch
    /// on every release that the hot path would feel).
    held: ManuallyDrop<Held>,
}

/// What a lease holds, and so how it goes back.
enum Held {
    /// An empty buffer: nothing.
    Nothing,
    Stack(Block),
    /// Boxed: rare, and it keeps every lease small, which the hot path feels.
    Fallback(Box<FallbackHeld>),
    /// `cuMemAlloc`/`cuMemAllocPitch` memory of a long-lived buffer, stamped with the stream's
    /// capture epoch (see `Kept`).
    Driver {
        epoch: u64,
    },
}

struct FallbackHeld {
    allocation: Allocation,
    reason: FallbackReason,
    bytes: usize,
    epoch: u64,
    /// Its block of the stream's unlimited stack (`stream/sizing.rs`), unless the stream uses no
    /// stack by choice.
    demand: Option<DemandBlock>,
}

impl<'s> Lease<'s> {
    fn new(
        stream: &'s Stream,
        ptr: DevPtr,
        layout: &Layout,
        pitch: usize,
        held: Held,
    ) -> Lease<'s> {
        Lease {
            stream,
            ptr,
            rows: layout.rows,
            cols: layout.cols,
            pitch,
            held: ManuallyDrop::new(held),
        }
    }

    /// The device address of row 0 (0 for an empty buffer).
    #[inline]
    pub(crate) fn ptr(&self) -> DevPtr {
        self.ptr
    }

    /// The address itself, which kernel arguments point at.
    pub(crate) fn ptr_field(&self) -> &DevPtr {
        &self.ptr
    }

    /// Rows.
    #[inline]
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    #[inline]
    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes from one row to the next.
    #[inline]
    pub(crate) fn pitch(&self) -> usize {
        self.pitch
    }

    /// The stream the memory goes back to.
    #[inline]
    pub(crate) fn stream(&self) -> &'s Stream {
        self.stream
    }

    /// Where the memory came from.
    pub(crate) fn source(&self) -> Source {
        match &*self.held {
            Held::Nothing => Source::Empty,
            Held::Stack(_) => Source::Stack,
            Held::Fallback(f) => Source::Fallback(f.reason),
            Held::Driver { .. } => Source::Driver,
        }
    }

    /// Gives the memory back now and says what went wrong: a driver error from a free, or, in
    /// strict mode, `PoolError::LifoViolation` (the memory is reclaimed all the same).
    pub(crate) fn release(self) -> Result<(), PoolError> {
        // `drop` must not run: the memory goes back here, once.
        let mut this = ManuallyDrop::new(self);
        this.give_back()
    }

    /// Gives the memory back; called once, by `drop` or `release`.
    #[inline]
    fn give_back(&mut self) -> Result<(), PoolError> {
        // A stack block is read in place (the hot path); anything else is taken out.
        if let Held::Stack(block) = &*self.held {
            return self.stream.give_back_block(self.ptr, block);
        }
        // SAFETY: `held` is taken once: `give_back` runs once per lease, and nothing reads `held`
        // after it.
        let held = unsafe { ManuallyDrop::take(&mut self.held) };
        self.stream.give_back_other(self.ptr, held)
    }
}

impl Lease<'_> {
    /// The lease of a one-row take of `rows * cols` elements of `elem_size` bytes, seen as
    /// `rows x cols` with no padding between rows (a packed 2D buffer: OpenCV's
    /// `createContinuous`). Only the shape changes: the memory and how it goes back stay.
    pub(crate) fn packed(mut self, rows: usize, cols: usize, elem_size: usize) -> Self {
        debug_assert_eq!(self.rows * self.cols, rows * cols);
        self.rows = rows;
        self.cols = cols;
        // Cannot overflow: the take checked `rows * cols * elem_size`.
        self.pitch = cols * elem_size;
        self
    }
}

impl Drop for Lease<'_> {
    #[inline]
    fn drop(&mut self) {
        if let Err(e) = self.give_back() {
            crate::base::event::error!(error = %e, "releasing a buffer failed");
        }
    }
}

impl fmt::Debug for Lease<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("shape", &(self.rows, self.cols))
            .field("pitch", &self.pitch)
            .field("source", &self.source())
            .field("stream", &self.stream.id())
            .finish()
    }
}

/// The take.
impl Stream {
    /// A `rows x cols` buffer of `T`, asked for at `site`: from the stack when it fits (no lock, no
    /// heap allocation, no driver call), else from the allocator.
    // Always inlined, with its callers: the site is then a constant used only on cold paths, and
    // the lease is not returned through memory (stored in halves and reloaded whole, a
    // store-forwarding stall that cost more than the rest of the take).
    #[inline(always)]
    pub(crate) fn take<T>(
        &self,
        rows: usize,
        cols: usize,
        site: CallSite,
    ) -> Result<Lease<'_>, PoolError> {
        let layout = Layout::of::<T>(rows, cols, self.texture_alignment, self.packing)?;
        // The lease is made here, once, from the parts either path returns. Made on each path, the
        // leases merged in memory and the caller copied the result right after it was written: a
        // store-forwarding stall that doubled a take + release (26 ns against 13, measured).
        let (ptr, pitch, held) = self.take_memory(&layout, site)?;
        Ok(Lease::new(self, ptr, &layout, pitch, held))
    }

    /// The memory for `layout`: from the stack when it fits, else from the allocator.
    #[inline(always)]
    fn take_memory(
        &self,
        layout: &Layout,
        site: CallSite,
    ) -> Result<(DevPtr, usize, Held), PoolError> {
        if layout.is_empty() {
            return Ok((0, layout.pitch, Held::Nothing));
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
        let Some((offset, block)) = stack
            .take_aligned(layout.bytes, layout.block_align)
            .or_else(|| self.grow_and_take(stack, layout.bytes, layout.block_align))
        else {
            let reason = if layout.bytes > stack.size() {
                FallbackReason::TooLarge
            } else if stack.is_growable() {
                // Below its reservation, a growable stack fails only when no memory was mapped.
                FallbackReason::NoStackMemory
            } else {
                FallbackReason::StackFull
            };
            return self.take_fallback(layout, reason, (stack.free_bytes(), stack.size()), site);
        };
        let c = self.counters();
        c.stack_allocations.add(1);
        c.stack_in_use.set(block.end() as u64);
        self.count_live(block.span());
        if block.end() as u64 > c.stack_high_water.get() {
            c.stack_high_water.set(block.end() as u64);
            self.ledger.note_peak(site.location());
        }
        if self.sink.records() {
            self.emit(Op::take(Source::Stack, offset, layout.bytes, site));
        }
        if self.sink.demand.hooked() {
            self.stack_demand(block.end(), layout);
        } else {
            // The unlimited stack is the real one: the demand is the top.
            c.demand_peak.raise_to(block.end() as u64);
        }
        let ptr = stack.base + offset as DevPtr;
        Ok((ptr, layout.pitch, Held::Stack(block)))
    }

    /// What a growable stack serves once memory is mapped up to the request's end; `None` for a
    /// fixed stack, past the reservation, or when the driver maps nothing (then the request falls
    /// back, and the allocator answers for the memory).
    #[cold]
    #[inline(never)]
    pub(crate) fn grow_and_take(
        &self,
        stack: &Stack,
        bytes: usize,
        align: usize,
    ) -> Option<(usize, Block)> {
        if !stack.is_growable() {
            return None;
        }
        let grow = || stack.grow_and_take(bytes, align, self.device.storage(), self.counters());
        // Out of memory, the other holders give theirs back first; this stack's own memory above
        // its top is what the growth maps on to, so it stays.
        match grow().or_else(|e| self.retry_after_reclaim(e, false, &mut { grow })) {
            Ok(taken) => taken,
            Err(e) => {
                // Counted as a fallback in the stats; under memory pressure it is every request.
                crate::base::event::debug!(stream = self.id(), error = %e, bytes, "mapping stack memory failed: the request falls back");
                None
            }
        }
    }

    /// What the stack could not serve, from the allocator. `(stack_free, stack_size)` is the
    /// stack's state (zeros without one).
    #[cold]
    fn take_fallback(
        &self,
        layout: &Layout,
        reason: FallbackReason,
        (stack_free, stack_size): (usize, usize),
        site: CallSite,
    ) -> Result<(DevPtr, usize, Held), PoolError> {
        let short = layout.bytes.saturating_sub(stack_free);
        if reason != FallbackReason::Disabled {
            self.ledger.note_fallback(site, reason, short);
        }
        // What was in use plus the request; `None` where that wraps (no stack holds it).
        let stack_needed = matches!(reason, FallbackReason::StackFull | FallbackReason::TooLarge)
            .then(|| (stack_size - stack_free).checked_add(layout.bytes))
            .flatten();
        let context = RequestContext {
            site,
            stream: self.id(),
            stack_needed,
        };
        if self.in_own_capture() || capturing::on_this_thread() {
            // The driver refuses allocations from a capturing thread, and invalidates the capture.
            return Err(crate::core::graph_key::refusal(CaptureError::NeedsStack {
                requested: layout.bytes,
                available: stack_free,
                context: None,
            })
            .at(context));
        }
        self.drain_deferred();
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
        let allocate = || self.allocator.allocate(&self.alloc_context(), &request);
        let allocation = allocate()
            .or_else(|e| self.retry_after_reclaim(e, true, &mut { allocate }))
            .map_err(|e| e.at(context))?;
        let ptr = match allocator::validate(&allocation, &request, self.device.id()) {
            Ok(ptr) => ptr,
            Err(e) => {
                // SAFETY: the allocation came from this allocator just now and is not used.
                let _ = unsafe { self.allocator.deallocate(&self.alloc_context(), allocation) };
                return Err(e.at(context));
            }
        };
        self.counters().fallback[reason as usize].add(1);
        self.count_live(layout.bytes as u64);
        let demand = (reason != FallbackReason::Disabled).then(|| self.fallback_demand(layout));
        if self.sink.records() {
            self.emit(Op::take(Source::Fallback(reason), 0, layout.bytes, site));
        }
        let held = Held::Fallback(Box::new(FallbackHeld {
            allocation,
            reason,
            bytes: layout.bytes,
            epoch: self.capture_epoch(),
            demand,
        }));
        Ok((ptr, allocation.pitch, held))
    }

    /// Memory of its own for a long-lived `rows x cols` buffer of `T`, asked for at `site`:
    /// `cuMemAllocPitch` or `cuMemAlloc`, counted.
    pub(crate) fn take_from_driver<T>(
        &self,
        rows: usize,
        cols: usize,
        site: CallSite,
    ) -> Result<Lease<'_>, PoolError> {
        let layout = Layout::of::<T>(rows, cols, self.texture_alignment, self.packing)?;
        if layout.is_empty() {
            return Ok(Lease::new(self, 0, &layout, layout.pitch, Held::Nothing));
        }
        let context = RequestContext {
            site,
            stream: self.id(),
            stack_needed: None,
        };
        if self.in_own_capture() || capturing::on_this_thread() {
            return Err(crate::core::graph_key::refusal(CaptureError::Allocates {
                what: "DeviceMat::new",
                context: None,
            })
            .at(context));
        }
        self.drain_deferred();
        let storage = self.device.storage();
        let allocate = || {
            if layout.is_pitched() {
                storage.alloc_pitch(layout.width_bytes, layout.rows, Some(self.counters()))
            } else {
                storage
                    .alloc(layout.bytes, Some(self.counters()))
                    .map(|ptr| (ptr, layout.pitch))
            }
        };
        let (ptr, pitch) = allocate()
            .or_else(|e| self.retry_after_reclaim(e, true, &mut { allocate }))
            .map_err(|e| e.at(context))?;
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
        let held = Held::Driver {
            epoch: self.capture_epoch(),
        };
        Ok(Lease::new(self, ptr, &layout, pitch, held))
    }

    /// The counted driver operations this stream's allocator may use.
    pub(crate) fn alloc_context(&self) -> AllocContext<'_> {
        AllocContext {
            storage: self.device.storage(),
            stream: &self.raw,
            stream_id: self.ledger.id,
            counters: self.counters(),
        }
    }
}

/// The live counts, written by the stream's thread alone; the device adds them up when one passes
/// its high.
impl Stream {
    #[inline(always)]
    fn count_live(&self, bytes: u64) {
        let c = self.counters();
        c.live_bytes.add(bytes);
        c.live_buffers.add(1);
        if self.ledger.exact_live {
            self.device.inner.live_peak.took_exact(bytes);
        }
        if c.live_bytes.get() > c.live_high.get() {
            self.new_live_high();
        }
    }

    /// The stream holds more than ever since the last reset: the device's sum may be a new peak.
    #[cold]
    #[inline(never)]
    fn new_live_high(&self) {
        let c = self.counters();
        c.live_high.set(c.live_bytes.get());
        // The loom models check the hand-out, which the sample does not touch; its lock of the
        // device's state would multiply their interleavings for nothing.
        #[cfg(not(loom))]
        self.device.sample_live_peak();
    }

    #[inline(always)]
    fn uncount_live(&self, bytes: u64) {
        let c = self.counters();
        c.live_bytes.sub(bytes);
        c.live_buffers.sub(1);
        if self.ledger.exact_live {
            self.device.inner.live_peak.gave_back_exact(bytes);
        }
    }
}

/// The give-back.
impl Stream {
    /// Gives back the stack block of a lease at `ptr`. Its work was queued on this stream, so the
    /// memory is reused in stream order.
    #[inline]
    fn give_back_block(&self, ptr: DevPtr, block: &Block) -> Result<(), PoolError> {
        // One flag for everything a release may have to do besides releasing, so a stream that
        // neither waits for other streams nor records pays one test.
        if self.release_hooks.get() {
            return self.give_back_hooked(ptr, block);
        }
        self.release_block(ptr, block)
    }

    #[inline(always)]
    fn release_block(&self, ptr: DevPtr, block: &Block) -> Result<(), PoolError> {
        // A block exists only once the stack that made it does.
        let Some(stack) = self.stack.get() else {
            return Ok(());
        };
        let release = stack.release(block);
        self.counters().stack_in_use.set(stack.top() as u64);
        self.uncount_live(block.span());
        match release {
            Release::InOrder => Ok(()),
            Release::OutOfOrder => self.lifo_violation(ptr - stack.base),
        }
    }

    /// A stack release with waits to issue first or an event to record after.
    #[cold]
    fn give_back_hooked(&self, ptr: DevPtr, block: &Block) -> Result<(), PoolError> {
        if self.deferred.any_waits() {
            // If the waits cannot be issued, the memory is not given back (the block stays held
            // until the stream goes): reused, it could race the other streams' work.
            self.issue_deferred_waits()?;
        }
        let released = self.release_block(ptr, block);
        self.release_demand(DemandBlock::stack(block));
        if self.sink.records()
            && let Some(stack) = self.stack.get()
        {
            let offset = (ptr - stack.base) as usize;
            let bytes = block.end().saturating_sub(offset);
            self.emit(Op::release(Source::Stack, offset, bytes));
        }
        released
    }

    /// Gives back what a lease at `ptr` held besides a stack block.
    #[cold]
    fn give_back_other(&self, ptr: DevPtr, held: Held) -> Result<(), PoolError> {
        if self.deferred.any_waits() {
            // As for a stack block: without the waits the memory is not reused (it leaks).
            self.issue_deferred_waits()?;
        }
        match held {
            Held::Nothing => Ok(()),
            // `Lease::give_back` sends stack blocks to `give_back_block`; released all the same.
            Held::Stack(block) => {
                let released = self.release_block(ptr, &block);
                self.release_demand(DemandBlock::stack(&block));
                released
            }
            Held::Fallback(f) => {
                let FallbackHeld {
                    allocation,
                    reason,
                    bytes,
                    epoch,
                    demand,
                } = *f;
                self.uncount_live(bytes as u64);
                if let Some(block) = demand {
                    self.release_demand(block);
                }
                if self.sink.records() {
                    self.emit(Op::release(Source::Fallback(reason), 0, bytes));
                }
                // SAFETY: the allocation came from this stream's allocator (`take_fallback`), and
                // its lease gave it up by value: this is its one `Kept`.
                let kept = unsafe { Kept::fallback(allocation, epoch) };
                self.give_back_after(kept)
            }
            Held::Driver { epoch } => {
                // SAFETY: `ptr` came from `take_from_driver` on this stream, and its lease gave it
                // up by value: this is its one `Kept`.
                let kept = unsafe { Kept::driver(ptr, epoch) };
                self.give_back_after(kept)
            }
        }
    }
}
