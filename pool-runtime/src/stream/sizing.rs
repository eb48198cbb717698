//! Measuring what a piece of pooled work needs of a stack, before sizing one: [`Stream::measure`].

use crate::stack::Stack;
use crate::stats::StreamCounters;

use super::Stream;

/// What [`Stream::measure`] saw the work take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sizing {
    /// The most stack bytes the work had in use at once, above what was in use when it began:
    /// buffers, their alignment padding, and the fallback buffers a large enough stack would have
    /// held. A stack with this many bytes free serves the work with no fallback. 0 on a stream
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
    /// [`cuda_stream`](Stream::cuda_stream) is `None`, and size the GPU's stacks
    /// ([`set_buffer_pool_config`]) from [`Sizing::stack_bytes`] before any GPU run. A CUDA graph
    /// captured from the same work holds those bytes plus one block for its fence.
    ///
    /// ```
    /// use gpu_pool_runtime::{BufferPool, Device, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let (sum, sizing) = stream.measure(|s| -> Result<usize, gpu_pool_runtime::PoolError> {
    ///     let pool = BufferPool::new(s);
    ///     let image = pool.get_buffer::<u8>(1080, 1920)?; // 1080 rows of 2048 bytes
    ///     let row = pool.get_buffer_1d::<f32>(1920)?;     // 7680 bytes
    ///     Ok(image.len() + row.len())
    /// });
    /// assert_eq!(sum?, 1080 * 1920 + 1920);
    /// assert_eq!(sizing.stack_bytes, 1080 * 2048 + 7680);
    /// assert_eq!((sizing.buffers, sizing.fallbacks), (2, 0));
    /// # Ok::<(), gpu_pool_runtime::PoolError>(())
    /// ```
    ///
    /// [`Device::footprint`]: crate::Device::footprint
    /// [`set_buffer_pool_config`]: crate::set_buffer_pool_config
    pub fn measure<R>(&self, work: impl FnOnce(&Stream) -> R) -> (R, Sizing) {
        let counters = self.counters();
        let before = Totals::of(counters);
        let measurement = Measurement::start(counters, self.demand_now());
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

    /// The bytes the stack would hold now with unlimited room: its top plus live overflow.
    fn demand_now(&self) -> u64 {
        let top = self.stack.get().map_or(0, Stack::top);
        top.saturating_add(self.overflow_live.get()) as u64
    }
}

/// A measurement under way: the stream's demand peak restarts at its level, and a reset of the
/// peaks meanwhile (`reset_peak`, from any thread) keeps what it lowered for the measurement.
/// Dropped, even by a panic in the work, it leaves the peak as it would be without it.
struct Measurement<'a> {
    counters: &'a StreamCounters,
    start: u64,
    peak_before: u64,
    measured_before: u64,
}

impl<'a> Measurement<'a> {
    fn start(counters: &'a StreamCounters, start: u64) -> Measurement<'a> {
        let measurement = Measurement {
            counters,
            start,
            peak_before: counters.demand_peak.get(),
            // An enclosing measurement's peak so far, which this one restarts from its level.
            measured_before: counters.measured_peak.get().max(counters.demand_peak.get()),
        };
        counters.measuring.add(1);
        counters.measured_peak.set(start);
        counters.demand_peak.set(start);
        measurement
    }

    /// The most bytes in use at once since the start, above its level.
    fn peak_above_start(&self) -> usize {
        let peak = self.peak();
        peak.saturating_sub(self.start) as usize
    }

    fn peak(&self) -> u64 {
        self.counters
            .demand_peak
            .get()
            .max(self.counters.measured_peak.get())
    }
}

impl Drop for Measurement<'_> {
    fn drop(&mut self) {
        let c = self.counters;
        let peak = self.peak();
        let reset = c.measured_peak.get() > self.start;
        // Without a reset the stream's peak is what it was or what the work reached; after one,
        // what the work reached since.
        if !reset {
            c.demand_peak.set(self.peak_before.max(peak));
        }
        // An enclosing measurement keeps what this one saw.
        c.measured_peak
            .set(self.measured_before.max(c.measured_peak.get()));
        c.measuring.set(c.measuring.get() - 1);
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
