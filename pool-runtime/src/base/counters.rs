//! The per-stream counters the take and give-back bump, and the device's peak of live bytes.
//!
//! A stream's counters are written only by the thread that owns the stream, so they are relaxed
//! atomics updated with a load and a store: plain moves on x86, no locked instruction on the hot
//! path, yet readable from any thread. The snapshots users read are built in `core/stats.rs`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::base::source::FallbackReason;

/// One counter with a single writer: a relaxed load and store, no read-modify-write.
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    #[inline]
    pub(crate) fn add(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_add(n), Relaxed);
    }
    #[inline]
    pub(crate) fn sub(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_sub(n), Relaxed);
    }
    #[inline]
    pub(crate) fn set(&self, n: u64) {
        self.0.store(n, Relaxed);
    }
    #[inline]
    pub(crate) fn raise_to(&self, n: u64) {
        if n > self.0.load(Relaxed) {
            self.0.store(n, Relaxed);
        }
    }
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// The live counters of one stream (shared with its device for reporting).
#[derive(Debug, Default)]
pub(crate) struct StreamCounters {
    pub(crate) stack_in_use: Counter,
    pub(crate) stack_high_water: Counter,
    pub(crate) stack_allocations: Counter,
    pub(crate) fallback: [Counter; FallbackReason::ALL.len()],
    /// Bytes the stack would have held with unlimited room: stack use plus live overflow buffers.
    pub(crate) demand_peak: Counter,
    /// How far the stream's demand is above its stack's top now: the top of the stack it would
    /// have with unlimited room (`stream/sizing.rs`) less the real one. Kept by the stream for
    /// readers on other threads: a demand peak is reset to the top plus this.
    pub(crate) demand_over_top: Counter,
    pub(crate) driver_alloc_calls: Counter,
    pub(crate) driver_free_calls: Counter,
    pub(crate) lifo_violations: Counter,
    /// Bytes of memory behind the stream's stack: a fixed stack's size, or what a growable one
    /// has mapped.
    pub(crate) stack_mapped: Counter,
    /// Bytes and number of the stream's live pooled buffers (see `StreamStats::live_bytes`).
    pub(crate) live_bytes: Counter,
    pub(crate) live_buffers: Counter,
    /// The most `live_bytes` since the last reset: a take past it publishes the device's sum.
    pub(crate) live_high: Counter,
}

/// The peak of a device's live pooled bytes over all its streams.
///
/// Each stream counts its own live bytes (single-writer counters, as its others); the device adds
/// them up where the sum may have reached a new high: whenever a stream passes its own highest
/// use since the last reset (a cold path, rare once a program is warm), and at every read of the
/// device's stats. A sum can only pass the peak while some stream is above what it held at the
/// last sample, so the peak misses only a moment when several streams are up together, each below
/// its own high. A shared counter updated at every take would be exact, but its atomic
/// read-modify-write tripled a take + release on the H200's host (7.7 to 23 ns).
///
/// Streams made after [`Device::set_exact_live_peak`](crate::Device::set_exact_live_peak) pay
/// that atomic instead (RMM's statistics adaptor, which is opt-in too, does the same): `exact`
/// totals their live bytes at every take and release, and the peak follows it.
#[derive(Debug, Default)]
pub(crate) struct DevicePeak {
    peak: AtomicU64,
    exact: AtomicU64,
}

impl DevicePeak {
    /// The device's streams now hold `live` bytes at once.
    pub(crate) fn saw(&self, live: u64) {
        if live > self.peak.load(Relaxed) {
            self.peak.fetch_max(live, Relaxed);
        }
    }

    /// A stream counted exactly took `bytes`.
    #[inline]
    pub(crate) fn took_exact(&self, bytes: u64) {
        let now = self.exact.fetch_add(bytes, Relaxed).wrapping_add(bytes);
        self.saw(now);
    }

    /// A stream counted exactly gave `bytes` back.
    #[inline]
    pub(crate) fn gave_back_exact(&self, bytes: u64) {
        self.exact.fetch_sub(bytes, Relaxed);
    }

    /// The peak so far.
    pub(crate) fn get(&self) -> u64 {
        self.peak.load(Relaxed)
    }

    /// Starts the peak over from what is live now.
    pub(crate) fn reset(&self, live: u64) {
        self.peak.store(live, Relaxed);
    }
}

impl StreamCounters {
    /// The bytes the stack would hold now with unlimited room.
    pub(crate) fn demand_now(&self) -> u64 {
        self.stack_in_use
            .get()
            .saturating_add(self.demand_over_top.get())
    }

    /// Sets the peaks to what is in use now: the stack's high-water mark to `stack` where given
    /// (the stream's own thread decides, as a capture may be measuring with it), and the demand
    /// peak to `demand`. A measurement under way (`Stream::measure`) keeps a mark of its own,
    /// which this does not touch.
    pub(crate) fn reset_peaks(&self, stack: Option<usize>, demand: u64) {
        if let Some(top) = stack {
            self.stack_high_water.set(top as u64);
        }
        self.demand_peak.set(demand);
    }
}
