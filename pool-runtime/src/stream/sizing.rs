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
    /// held. A stack with this many bytes free serves the work with no fallback.
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
        let start = self.demand_now();
        let (peak_before, before) = (counters.demand_peak.get(), Totals::of(counters));
        counters.demand_peak.set(start);
        let result = work(self);
        let peak = counters.demand_peak.get();
        // Whatever else reads the peak sees what it would have without the measurement.
        counters.demand_peak.set(peak_before.max(peak));
        let after = Totals::of(counters);
        let sizing = Sizing {
            stack_bytes: peak.saturating_sub(start) as usize,
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
