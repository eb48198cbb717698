//! A stream's ledger: its counters, where its stack peaked, its fallbacks by call site and its
//! recording. The stream writes it on its own thread; its device reads it for stats, reports and
//! recordings, and absorbs it when the stream is dropped.

use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

use crate::base::counters::StreamCounters;
use crate::base::id::DeviceId;
use crate::base::source::{CallSite, FallbackReason};
use crate::base::sync;
use crate::core::record::{RecordEntry, Ring};
use crate::core::stack::Bounds;
use crate::core::stats::{SiteFallbacks, StreamStats};

/// A stream's counters and what else it shares with its device for reports: read by the device
/// (stats, recordings) while the stream's thread writes it.
#[derive(Debug)]
pub(crate) struct Ledger {
    /// The stream adds its live bytes to the device's exact total at every take and release
    /// ([`Device::set_exact_live_peak`](crate::Device::set_exact_live_peak)).
    pub(crate) exact_live: bool,
    pub(crate) id: u64,
    pub(crate) counters: StreamCounters,
    /// The stack index, or `usize::MAX` while the stream holds none.
    pub(crate) stack_index: sync::AtomicUsize,
    /// Where the stack's high-water mark was reached: a `&'static Location`, or null. One relaxed
    /// store when a take raises the mark, so the stack path stays lock-free.
    pub(crate) peak_at: AtomicPtr<Location<'static>>,
    /// Fallbacks by call site; touched on the fallback path only.
    pub(crate) fallback_sites: Mutex<Vec<SiteFallbacks>>,
    /// The recording, for a stream made while recording was on.
    pub(crate) recorder: Option<Mutex<Ring>>,
    /// The bounds of the stream's stack, once it has one: a growable stack's memory above its top
    /// is idle, and any thread gives it back through them.
    pub(crate) stack: OnceLock<Arc<Bounds>>,
    /// The device asked for the stack's idle memory back while the stack was being captured (its
    /// memory above the top may be the capture's): given back at the stream's next `synchronize`.
    pub(crate) trim_requested: AtomicBool,
}

impl Ledger {
    pub(crate) fn new(id: u64, record: usize, exact_live: bool) -> Ledger {
        Ledger {
            id,
            exact_live,
            counters: StreamCounters::default(),
            stack_index: sync::AtomicUsize::new(usize::MAX),
            peak_at: AtomicPtr::new(std::ptr::null_mut()),
            fallback_sites: Mutex::new(Vec::new()),
            recorder: (record > 0).then(|| Mutex::new(Ring::new(record))),
            stack: OnceLock::new(),
            trim_requested: AtomicBool::new(false),
        }
    }

    pub(crate) fn snapshot(&self, device: DeviceId) -> StreamStats {
        let index = self.stack_index.load(Relaxed);
        let mut stats =
            self.counters
                .snapshot(self.id, device, (index != usize::MAX).then_some(index));
        stats.fallback_sites = sync::lock(&self.fallback_sites).clone();
        let peak = self.peak_at.load(Relaxed);
        // SAFETY: `peak_at` holds null or a pointer made from a `&'static Location` (`note_peak`).
        stats.peak_at = unsafe { peak.as_ref() }.map(CallSite::at);
        stats
    }

    /// Sets the stream's peaks to what it uses now: the stack's mark to `stack` where given (then
    /// with no site: none reached it since), the demand peak to `demand`.
    pub(crate) fn reset_peaks(&self, stack: Option<usize>, demand: usize) {
        self.counters.reset_peaks(stack, demand as u64);
        if stack.is_some() {
            self.peak_at.store(std::ptr::null_mut(), Relaxed);
        }
    }

    /// Remembers where the stack's peak was reached.
    #[inline]
    pub(crate) fn note_peak(&self, at: &'static Location<'static>) {
        self.peak_at
            .store(std::ptr::from_ref(at).cast_mut(), Relaxed);
    }

    /// Counts a fallback of `site`, `short` bytes short of what the stack had.
    #[cold]
    pub(crate) fn note_fallback(&self, site: CallSite, reason: FallbackReason, short: usize) {
        let mut sites = sync::lock(&self.fallback_sites);
        match sites.iter_mut().find(|s| s.site == site) {
            Some(s) => {
                s.count += 1;
                s.reason = reason;
                s.bytes_short = s.bytes_short.max(short);
            }
            None => sites.push(SiteFallbacks {
                site,
                reason,
                count: 1,
                bytes_short: short,
            }),
        }
    }

    /// Records `event`, where this stream records.
    #[cold]
    pub(crate) fn record(&self, event: RecordEntry) {
        if let Some(recorder) = &self.recorder {
            sync::lock(recorder).push(event);
        }
    }
}
