//! Measuring what a piece of pooled work needs of a stack, before sizing one: [`Stream::measure`].

use std::cell::{Cell, RefCell};

use crate::base::counters::StreamCounters;
use crate::base::layout::Layout;
use crate::core::stack::{Block, Stack};

use super::Stream;

/// What [`Stream::measure`] saw the work take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sizing {
    /// The most stack bytes the work had in use at once, above what was in use when it began:
    /// buffers, their alignment padding, and the fallback buffers a large enough stack would have
    /// held, each with the padding it would have had there. A stack with this many bytes free
    /// serves the work with no fallback, whatever stack it was measured on, when the work starts
    /// where it started in the measurement, or on a boundary as aligned (an empty stack, or a top
    /// on 512 bytes); started on a less aligned top, its first block may need up to 448 bytes more
    /// padding. 0 on a stream
    /// that uses no stack (pooling off, or [`Stream::with_allocator`]).
    pub stack_bytes: usize,
    /// Buffers the work took (stack and fallback).
    pub buffers: u64,
    /// Of those, the ones the stack could not serve.
    pub fallbacks: u64,
    /// Driver allocation calls made for the work's buffers.
    pub driver_alloc_calls: u64,
}

impl Stream {
    /// Runs `work` on this stream and says what it took: the stack bytes it needed at its peak
    /// (whether or not the stack had them), its buffers and its fallbacks.
    ///
    /// It is a dry run on the host backend, where buffers are host memory and every layout rule is
    /// the GPU's (512-byte row pitch, as on current NVIDIA GPUs; [`Device::footprint`] gives a
    /// device's own): run a pooled function there, with its kernels skipped where
    /// [`cudarc`](Stream::cudarc) is an error, and size the GPU's stacks
    /// ([`set_buffer_pool_config`]) from [`Sizing::stack_bytes`] before any GPU run. A CUDA graph
    /// captured from the same work holds those bytes plus one block for its fence.
    ///
    /// The figure is exact whatever the stack it runs on: a buffer that falls back is counted
    /// where a stack large enough would have placed it, alignment padding included. It keeps a
    /// mark of its own, so resets of the peaks meanwhile ([`Stream::reset_peak`] inside the work,
    /// [`Device::reset_peak`] from any thread) change nothing of it; the stream's own
    /// [`peak_demand`](crate::observe::StreamStats::peak_demand) sees the work as any other.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let (sum, sizing) = stream.measure(|s| -> Result<usize, gpu_pool::PoolError> {
    ///     let pool = BufferPool::new(s);
    ///     let image = pool.get_buffer::<u8>(1080, 1920)?; // 1080 rows of 2048 bytes
    ///     let row = pool.get_buffer_1d::<f32>(1920)?;     // 7680 bytes
    ///     Ok(image.len() + row.len())
    /// });
    /// assert_eq!(sum?, 1080 * 1920 + 1920);
    /// assert_eq!(sizing.stack_bytes, 1080 * 2048 + 7680);
    /// assert_eq!((sizing.buffers, sizing.fallbacks), (2, 0));
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    ///
    /// [`Device::footprint`]: crate::Device::footprint
    /// [`Device::reset_peak`]: crate::Device::reset_peak
    /// [`set_buffer_pool_config`]: crate::compat::opencv::set_buffer_pool_config
    pub fn measure<R>(&self, work: impl FnOnce(&Stream) -> R) -> (R, Sizing) {
        let counters = self.counters();
        let before = Totals::of(counters);
        let measurement = Measurement::start(self);
        let result = work(self);
        let stack_bytes = measurement.peak_above_start();
        drop(measurement);
        let after = Totals::of(counters);
        let sizing = Sizing {
            stack_bytes,
            buffers: after.buffers - before.buffers,
            fallbacks: after.fallbacks - before.fallbacks,
            driver_alloc_calls: after.driver_alloc_calls - before.driver_alloc_calls,
        };
        (result, sizing)
    }

    /// The bytes the stack would hold now with unlimited room: the unlimited stack's top.
    pub(super) fn demand_now(&self) -> usize {
        let top = self.stack.get().map_or(0, Stack::top);
        self.sink.demand.top().map_or(top, |shadow| shadow.max(top))
    }

    /// A stack block ending at `end` was taken for `layout` while the demand is watched (the
    /// unlimited stack holds blocks of its own, or a measurement is under way).
    #[cold]
    #[inline(never)]
    pub(super) fn stack_demand(&self, end: usize, layout: &Layout) {
        if let Some(top) = self.sink.demand.top() {
            self.sink.demand.push(Of::Stack(end), top, layout);
        }
        self.demand_reached();
    }

    /// A buffer for `layout` fell back: the unlimited stack holds it where the stack would have,
    /// from here on apart from the real one. Returns its block there.
    #[cold]
    pub(super) fn fallback_demand(&self, layout: &Layout) -> DemandBlock {
        // Where the two stacks part, the unlimited one starts at the real top.
        let top = self.demand_now();
        let number = self.sink.demand.fallbacks.get() + 1;
        self.sink.demand.fallbacks.set(number);
        let of = Of::Fallback(number);
        self.sink.demand.push(of, top, layout);
        // Every release must now reach the unlimited stack too.
        self.release_hooks.set(true);
        self.sink.demand.update_hooked();
        self.demand_reached();
        DemandBlock(of)
    }

    /// Releases `block` of the unlimited stack (nothing if it holds none: the block is the real
    /// stack's alone).
    pub(super) fn release_demand(&self, block: DemandBlock) {
        if self.sink.demand.top().is_none() {
            return;
        }
        self.sink.demand.release(block.0);
        if self.sink.demand.top().is_none() {
            self.sink.demand.update_hooked();
            self.set_release_hooks();
        }
        self.note_demand_over_top();
    }

    /// Raises the demand peaks to the demand now: the stream's, and a measurement's.
    fn demand_reached(&self) {
        let now = self.demand_now();
        self.counters().demand_peak.raise_to(now as u64);
        if self.sink.demand.measuring.get() > 0 {
            let peak = &self.sink.demand.measured_peak;
            peak.set(peak.get().max(now));
        }
        self.note_demand_over_top();
    }

    /// Tells readers on other threads (`Device::reset_peak`) how far the demand is above the top.
    fn note_demand_over_top(&self) {
        let top = self.stack.get().map_or(0, Stack::top);
        let over = self.demand_now() - top;
        self.counters().demand_over_top.set(over as u64);
    }
}

/// What a stream's demand is measured on: the stack it would have with unlimited room
/// ([`StreamStats::peak_demand`](crate::observe::StreamStats::peak_demand), [`Stream::measure`]).
///
/// Every buffer the stack would have held (stack and fallback buffers alike; not those of a stream
/// that uses no stack by choice) takes a block of it, placed by the stack's own rule
/// ([`Stack::place`]), alignment padding included. It is the real stack until a buffer falls back;
/// from there the blocks above are kept here, and released as the real stack releases (a block
/// released out of order waits for the blocks above it), until none is left and the two agree
/// again. While they agree it holds nothing, and the stack's take pays one flag for it.
#[derive(Debug, Default)]
pub(crate) struct Demand {
    /// The blocks above where the two stacks parted, lowest first; empty while they agree. The
    /// topmost is never a released one.
    blocks: RefCell<Vec<ShadowBlock>>,
    /// Fallback buffers taken: the number of each one's block.
    fallbacks: Cell<u64>,
    /// `Stream::measure` calls under way on the stream (nested ones included).
    measuring: Cell<u32>,
    /// While one is: the most bytes demanded at once since the innermost began. The stream's own:
    /// no reset of the stream's peaks, from any thread, touches it.
    measured_peak: Cell<usize>,
    /// `blocks` is not empty, or a measurement is under way: a stack take has more to note than
    /// the stream's demand peak.
    hooked: Cell<bool>,
}

/// A block of the unlimited stack.
#[derive(Debug)]
struct ShadowBlock {
    of: Of,
    end: usize,
    /// Released out of order: waits for the blocks above it.
    released: bool,
}

/// Which buffer a block of the unlimited stack is: a stack buffer by its block's end on the real
/// stack (unique among live blocks), a fallback buffer by its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Of {
    Stack(usize),
    Fallback(u64),
}

/// A buffer's block of the unlimited stack, to release with it.
#[derive(Clone, Copy, Debug)]
pub(super) struct DemandBlock(Of);

impl DemandBlock {
    /// The block of the stack buffer holding `block`.
    pub(super) fn stack(block: &Block) -> DemandBlock {
        DemandBlock(Of::Stack(block.end()))
    }
}

impl Demand {
    /// Whether a release must reach the unlimited stack: it holds blocks of its own.
    pub(crate) fn holds_blocks(&self) -> bool {
        self.top().is_some()
    }

    /// Whether a stack take must call [`Stream::stack_demand`].
    #[inline(always)]
    pub(super) fn hooked(&self) -> bool {
        self.hooked.get()
    }

    fn update_hooked(&self) {
        let hooked = self.top().is_some() || self.measuring.get() > 0;
        self.hooked.set(hooked);
    }

    /// The unlimited stack's top while it holds blocks of its own.
    fn top(&self) -> Option<usize> {
        self.blocks.borrow().last().map(|b| b.end)
    }

    /// Takes a block for `layout` with the top at `top` (the real stack's, where the two part).
    fn push(&self, of: Of, top: usize, layout: &Layout) {
        // Past `usize::MAX` no stack holds it: the demand says as much.
        let end = Stack::place(top, layout.bytes, layout.block_align).map_or(usize::MAX, |p| p.1);
        self.blocks.borrow_mut().push(ShadowBlock {
            of,
            end,
            released: false,
        });
    }

    /// Releases the block of `of`; the top comes down past every released block (to the end of
    /// the highest live one, or the real stack's top once none is left).
    fn release(&self, of: Of) {
        let mut blocks = self.blocks.borrow_mut();
        if let Some(block) = blocks.iter_mut().rev().find(|b| !b.released && b.of == of) {
            block.released = true;
        }
        while blocks.pop_if(|b| b.released).is_some() {}
    }
}

/// A measurement under way: the stream's own high-water mark of its demand, which no reset of the
/// stream's peaks touches, restarts at the demand now. Dropped, even by a panic in the work, it
/// hands what it saw to an enclosing measurement and leaves the stream as it was.
struct Measurement<'a> {
    stream: &'a Stream,
    start: usize,
    /// An enclosing measurement's peak so far.
    outer_peak: usize,
}

impl<'a> Measurement<'a> {
    fn start(stream: &'a Stream) -> Measurement<'a> {
        let demand = &stream.sink.demand;
        let start = stream.demand_now();
        let measurement = Measurement {
            stream,
            start,
            outer_peak: demand.measured_peak.replace(start),
        };
        demand.measuring.set(demand.measuring.get() + 1);
        demand.update_hooked();
        measurement
    }

    /// The most bytes in use at once since the start, above its level.
    fn peak_above_start(&self) -> usize {
        self.stream.sink.demand.measured_peak.get() - self.start
    }
}

impl Drop for Measurement<'_> {
    fn drop(&mut self) {
        let demand = &self.stream.sink.demand;
        let peak = demand.measured_peak.get();
        demand.measured_peak.set(self.outer_peak.max(peak));
        demand.measuring.set(demand.measuring.get() - 1);
        demand.update_hooked();
    }
}

/// Counters that only grow, read before and after the work.
struct Totals {
    buffers: u64,
    fallbacks: u64,
    driver_alloc_calls: u64,
}

impl Totals {
    fn of(c: &StreamCounters) -> Totals {
        let fallbacks = c.fallback.iter().map(|f| f.get()).sum();
        Totals {
            buffers: c.stack_allocations.get() + fallbacks,
            fallbacks,
            driver_alloc_calls: c.driver_alloc_calls.get(),
        }
    }
}
