//! The snapshots of a stream's counters (`base/counters.rs`) that streams and devices hand out,
//! readable from any thread (the device and [`report`] read them while the stream lives).

use crate::base::counters::{Counter, StreamCounters};
use crate::base::error::PoolError;
use crate::base::holders::IdleHolding;
use crate::base::id::DeviceId;
use crate::base::source::{CallSite, FallbackReason};
use crate::core::config::{PoolConfig, Stacks};

impl StreamCounters {
    pub(crate) fn snapshot(&self, id: u64, device: DeviceId, stack: Option<usize>) -> StreamStats {
        StreamStats {
            stream: id,
            device,
            stack_index: stack,
            stack_in_use: self.stack_in_use.get() as usize,
            stack_high_water: self.stack_high_water.get() as usize,
            stack_allocations: self.stack_allocations.get(),
            fallback_allocations: FallbackCounts(self.fallback.each_ref().map(Counter::get)),
            peak_demand: self.demand_peak.get() as usize,
            driver_alloc_calls: self.driver_alloc_calls.get(),
            driver_free_calls: self.driver_free_calls.get(),
            lifo_violations: self.lifo_violations.get(),
            stack_mapped: self.stack_mapped.get() as usize,
            live_bytes: self.live_bytes.get() as usize,
            live_buffers: self.live_buffers.get(),
            fallback_sites: Vec::new(),
            peak_at: None,
        }
    }
}

/// Fallback allocations, counted by reason.
///
/// ```
/// use gpu_pool::{FallbackReason, observe::FallbackCounts};
/// let counts = FallbackCounts::default();
/// assert_eq!(counts.get(FallbackReason::StackFull), 0);
/// assert_eq!(counts.total(), 0);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FallbackCounts([u64; FallbackReason::ALL.len()]);

impl FallbackCounts {
    /// Allocations that fell back for `reason`.
    #[must_use]
    pub fn get(&self, reason: FallbackReason) -> u64 {
        self.0[reason as usize]
    }
    /// All fallback allocations.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    fn add(&mut self, other: &FallbackCounts) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }
}

/// A snapshot of one stream's counters.
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, Stream};
/// let device = Device::private_host();
/// let stream = Stream::new(&device)?;
/// let pool = BufferPool::new(&stream);
/// let buf = pool.get_buffer_1d::<f32>(1000)?;
/// let stats = stream.stats();
/// assert_eq!((stats.stack_allocations, stats.stack_in_use), (1, 4032));
/// assert_eq!((stats.live_buffers, stats.live_bytes), (1, 4032));
/// drop(buf);
/// assert_eq!(stream.stats().stack_in_use, 0);
/// assert_eq!(stream.stats().live_bytes, 0);
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamStats {
    /// A number unique to the stream within the process.
    pub stream: u64,
    /// Its device.
    pub device: DeviceId,
    /// Which stack of the device it holds, if any.
    pub stack_index: Option<usize>,
    /// Stack bytes in use now, alignment padding included: the stack's top, which a buffer released
    /// out of LIFO order does not lower until the buffers above it are gone. What the live buffers
    /// hold is [`live_bytes`](Self::live_bytes).
    pub stack_in_use: usize,
    /// The most stack bytes in use at once, since the stream was made or its last
    /// [`Stream::reset_peak`](crate::Stream::reset_peak).
    pub stack_high_water: usize,
    /// Buffers served by the stack.
    pub stack_allocations: u64,
    /// Buffers served by the fallback allocator, by reason.
    pub fallback_allocations: FallbackCounts,
    /// The most bytes the stack would have held at once had it been large enough (fallback buffers
    /// counted where it would have placed them, alignment padding included): the stack size
    /// that avoids every `StackFull` and `TooLarge` fallback of this stream. Since the stream was
    /// made or the last [`Stream::reset_peak`](crate::Stream::reset_peak) or
    /// [`Device::reset_peak`](crate::Device::reset_peak).
    pub peak_demand: usize,
    /// Driver allocation calls made for this stream's buffers.
    pub driver_alloc_calls: u64,
    /// Driver free calls made for this stream's buffers.
    pub driver_free_calls: u64,
    /// Stack buffers released out of LIFO order.
    pub lifo_violations: u64,
    /// Bytes of device memory behind the stream's stack: a fixed stack's size, or what a
    /// growable stack has mapped now ([`Device::set_growable_stacks`](crate::Device::set_growable_stacks)).
    pub stack_mapped: usize,
    /// Bytes held by the stream's live pooled buffers (from its stack or its fallback; not
    /// [`GpuMat::new`](crate::compat::opencv::GpuMat::new)'s driver memory): a stack buffer counts its block, the
    /// padding that aligns its start included, a fallback buffer its layout's bytes. Unlike
    /// [`stack_in_use`](Self::stack_in_use), a buffer released out of order is no longer counted.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, compat::opencv::set_buffer_pool_config, Stream};
    /// let device = Device::private_host();
    /// set_buffer_pool_config(&device, 100 << 20, 1)?;
    /// let stream = Stream::new(&device)?;
    /// let pool = BufferPool::new(&stream);
    /// let mut held: Vec<_> = (0..10)
    ///     .map(|_| pool.get_buffer_1d::<u8>(10 << 20))
    ///     .collect::<Result<_, _>>()?;
    /// for i in [8, 6, 4, 2, 0] {
    ///     drop(held.remove(i)); // out of LIFO order
    /// }
    /// let stats = stream.stats();
    /// assert_eq!((stats.live_bytes, stats.live_buffers), (50 << 20, 5));
    /// assert_eq!(stats.stack_in_use, 100 << 20); // the top: the last buffer is live
    /// # drop(held);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub live_bytes: usize,
    /// The stream's live pooled buffers (from its stack or its fallback), empty ones not counted.
    pub live_buffers: u64,
    /// The requests that fell back, by the `buffer!` or call that made them.
    pub fallback_sites: Vec<SiteFallbacks>,
    /// Where the stack's high-water mark was reached: the source location of the request that
    /// took it highest (its [`name`](CallSite::name) is not kept: `None`). `None` before any, and
    /// after [`Stream::reset_peak`](crate::Stream::reset_peak) until a take raises the mark.
    pub peak_at: Option<CallSite>,
}

/// The fallbacks of one call site on one stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SiteFallbacks {
    /// The `buffer!` or runtime call.
    pub site: CallSite,
    /// Why the stack could not serve it (the last time).
    pub reason: FallbackReason,
    /// How many of its requests fell back.
    pub count: u64,
    /// The most bytes the stack lacked for one of them (the request itself without a stack).
    pub bytes_short: usize,
}

/// A snapshot of one device's counters: its own driver calls plus every stream it has had.
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, Stream};
/// let device = Device::private_host();
/// let stream = Stream::new(&device)?;
/// drop(BufferPool::new(&stream).get_buffer::<u8>(16, 16)?);
/// let stats = device.stats();
/// assert_eq!(stats.driver_alloc_calls, 1); // the one allocation that holds every stack
/// assert_eq!(stats.streams.len(), 1);
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceStats {
    /// The device.
    pub device: DeviceId,
    /// Its stack config (the one in force, or the one the next allocation will use); the
    /// `GPU_POOL_CONF` error where that variable is malformed and nothing explicit overrides it.
    pub config: Result<PoolConfig, PoolError>,
    /// The stacks streams made now get ([`DeviceConfig::stacks`](crate::core::config::DeviceConfig::stacks)):
    /// growable ones, or fixed ones of [`config`](Self::config); the `GPU_POOL_CONF` error as
    /// for `config`.
    pub stacks: Result<Stacks, PoolError>,
    /// Stacks held by streams now.
    pub stacks_held: usize,
    /// Whether the stack memory is allocated now.
    pub stacks_allocated: bool,
    /// The most streams that held or wanted a stack at once, since the device was made or its
    /// last [`Device::reset_peak`](crate::Device::reset_peak).
    pub peak_streams_wanting_stack: usize,
    /// Stack bytes in use over all live streams (the sum of their tops; see
    /// [`StreamStats::stack_in_use`]).
    pub stack_in_use: usize,
    /// Bytes held by every live pooled buffer of the device, over all its streams (see
    /// [`StreamStats::live_bytes`]).
    pub live_bytes: usize,
    /// Live pooled buffers over all the device's streams.
    pub live_buffers: u64,
    /// The most bytes live pooled buffers of the device held at once, over all its streams (unlike
    /// [`peak_stream_demand`](Self::peak_stream_demand), one stream's largest demand), since the
    /// device was made or its last [`Device::reset_peak`](crate::Device::reset_peak). Never below
    /// [`live_bytes`](Self::live_bytes). The sum is taken whenever a stream passes its own highest
    /// use since the reset and at every read of the stats, not at every take (which would cost
    /// every take a shared atomic): it misses only a moment when several streams held more
    /// together, each below its own high. Exact, at that cost, for streams made after
    /// [`Device::set_exact_live_peak`](crate::Device::set_exact_live_peak).
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, Stream};
    /// let device = Device::private_host();
    /// let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
    /// let x = BufferPool::new(&a).get_buffer_1d::<u8>(1 << 20)?;
    /// let y = BufferPool::new(&b).get_buffer_1d::<u8>(2 << 20)?;
    /// drop((y, x));
    /// let stats = device.stats();
    /// assert_eq!(stats.peak_live_bytes, 3 << 20); // both at once
    /// assert_eq!(stats.peak_stream_demand, 2 << 20); // the larger stream alone
    /// assert_eq!(stats.live_bytes, 0);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub peak_live_bytes: usize,
    /// Stack buffers over all streams, live and dropped.
    pub stack_allocations: u64,
    /// Fallback buffers over all streams, live and dropped, by reason.
    pub fallback_allocations: FallbackCounts,
    /// Every driver allocation of device memory on this device: stack memory, fallbacks, custom
    /// allocators, pools, long-lived buffers. `MixMemory`'s page-locked host
    /// memory is not counted here.
    pub driver_alloc_calls: u64,
    /// Every driver free of device memory on this device.
    pub driver_free_calls: u64,
    /// LIFO violations over all streams.
    pub lifo_violations: u64,
    /// Bytes mapped into the device's growable stacks now (0 with fixed stacks, whose memory is
    /// the config's `total_bytes` once allocated).
    pub stack_mapped: usize,
    /// The largest `peak_demand` of any one stream, live or dropped (since the last
    /// [`Device::reset_peak`](crate::Device::reset_peak), which forgets dropped streams): what one
    /// stack must hold, not the device's peak ([`peak_live_bytes`](Self::peak_live_bytes)).
    pub peak_stream_demand: usize,
    /// Live streams, one snapshot each.
    pub streams: Vec<StreamStats>,
    /// The call sites that fell back on streams already dropped.
    pub retired_fallback_sites: Vec<SiteFallbacks>,
    /// Every holder of this device's memory that keeps some of it idle now (mapped or allocated,
    /// used by no buffer): growable stacks above their tops, the caching pools' held blocks, the
    /// stream-ordered pool's reserve. An out-of-memory on the device, or
    /// [`Device::reclaim_idle`](crate::Device::reclaim_idle), gives it back.
    pub idle_holders: Vec<IdleHolding>,
    /// The cap [`Device::set_memory_limit`](crate::Device::set_memory_limit) set, if any.
    pub memory_limit: Option<usize>,
    /// Bytes the pools hold of the device now, as the memory limit counts them: live driver
    /// allocations made through the pools, mapped growable stacks and the stream-ordered pool's
    /// reserve.
    pub memory_counted: usize,
}

impl DeviceStats {
    /// Bytes held idle over all holders ([`idle_holders`](Self::idle_holders)).
    #[must_use]
    pub fn idle_bytes(&self) -> usize {
        self.idle_holders.iter().map(|h| h.idle_bytes).sum()
    }

    /// The config that would have served every stack-eligible request of this device's streams from
    /// a stack: the largest stream demand rounded up to a MiB, and as many stacks as streams wanted
    /// at once. `None` if no stream ever asked for a buffer.
    #[must_use]
    pub fn recommended_config(&self) -> Option<PoolConfig> {
        if self.peak_stream_demand == 0 {
            return None;
        }
        let size = self
            .peak_stream_demand
            .div_ceil(1 << 20)
            .checked_mul(1 << 20)?;
        PoolConfig::new(size, self.peak_streams_wanting_stack.max(1)).ok()
    }
}

/// Totals of streams that were dropped, kept by their device.
#[derive(Clone, Debug, Default)]
pub(crate) struct Retired {
    pub(crate) stack_allocations: u64,
    pub(crate) fallback_allocations: FallbackCounts,
    pub(crate) driver_alloc_calls: u64,
    pub(crate) driver_free_calls: u64,
    pub(crate) lifo_violations: u64,
    pub(crate) peak_demand: usize,
    pub(crate) fallback_sites: Vec<SiteFallbacks>,
}

impl Retired {
    pub(crate) fn absorb(&mut self, s: &StreamStats) {
        for site in &s.fallback_sites {
            match self.fallback_sites.iter_mut().find(|r| r.site == site.site) {
                Some(r) => {
                    r.count += site.count;
                    r.bytes_short = r.bytes_short.max(site.bytes_short);
                    r.reason = site.reason;
                }
                None => self.fallback_sites.push(*site),
            }
        }
        self.stack_allocations += s.stack_allocations;
        self.fallback_allocations.add(&s.fallback_allocations);
        self.driver_alloc_calls += s.driver_alloc_calls;
        self.driver_free_calls += s.driver_free_calls;
        self.lifo_violations += s.lifo_violations;
        self.peak_demand = self.peak_demand.max(s.peak_demand);
    }
}

pub(crate) fn sum_streams(
    retired: &Retired,
    live: &[StreamStats],
) -> (u64, FallbackCounts, u64, usize, usize) {
    let mut stack = retired.stack_allocations;
    let mut fallback = retired.fallback_allocations;
    let mut violations = retired.lifo_violations;
    let mut in_use = 0;
    let mut demand = retired.peak_demand;
    for s in live {
        stack += s.stack_allocations;
        fallback.add(&s.fallback_allocations);
        violations += s.lifo_violations;
        in_use += s.stack_in_use;
        demand = demand.max(s.peak_demand);
    }
    (stack, fallback, violations, in_use, demand)
}
