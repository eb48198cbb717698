//! Growable stacks (the CUDA default where the GPU maps memory): a stream's stack is a reserved
//! address range as large as the device's memory, and memory is mapped into it in granules as its
//! top rises (`Stack::grow_and_take`, the take's cold path), unmapped above the top on demand
//! (`Stream::trim`, an out-of-memory anywhere on the device through `IdleMemory for Ledger`, the
//! trim asked from another thread and honoured at `synchronize`), and whole when its stream goes
//! (`Stack::release_growable`, through the device's deferred give-back).
//!
//! Everything growable lives here: the mappings ([`Growth`]), `Bounds`' give-back from any thread,
//! the `Stack`, `Stream`, `Ledger` and device steps. What stays in `stack/mod.rs` is what every
//! stack has (`Bounds`' top and limit, which the take's hot path reads, and one test of
//! `Stack::growable` there); `stream/mod.rs` and `device.rs` only call in.

use std::sync::Arc;
use std::sync::atomic::Ordering::{Acquire, Relaxed, SeqCst};

use super::{Block, Bounds, Stack};
use crate::base::counters::StreamCounters;
use crate::base::error::{CaptureError, PoolError};
use crate::base::holders::{GaveBack, ReclaimedFrom};
use crate::base::sync::{self, fence};
use crate::core::capturing;
use crate::core::config::Stacks;
use crate::core::ledger::Ledger;
use crate::core::stream::Stream;
use crate::storage::backend::{DevPtr, RawStream};
use crate::storage::{IdleMemory, Storage};

/// What makes a stack growable: the stack is a reserved address range, and memory is mapped into
/// it in granules as the top rises past the mapped end (`Stack::grow_and_take`), unmapped on
/// demand (`Bounds::give_back_idle`) and when its stream goes (`Stack::unmap_all`).
#[derive(Debug)]
pub(super) struct Growth {
    base: DevPtr,
    granule: usize,
    /// The mapped chunks, lowest first: offset, bytes, and the backend's handle.
    chunks: Vec<(usize, usize, u64)>,
    /// The stream whose work uses the stack, waited for before a give-back unmaps; `None` once the
    /// stream is gone (then nothing is given back: its last work may still run).
    stream: Option<RawStream>,
    /// The stream's own capture is under way or being turned into a graph: memory above the top
    /// may be used by the captured work, so nothing is given back.
    capturing: bool,
    /// Bumped by every change a give-back waiting for the stream (with the lock let go) must
    /// not miss: a mapping (which puts the limit back up), a capture begun, an unmap.
    generation: u64,
}

impl Growth {
    /// The mapped end.
    fn end(&self) -> usize {
        self.chunks
            .last()
            .map_or(0, |&(offset, bytes, _)| offset + bytes)
    }

    /// Where the chunks that lie wholly at or above `top` begin: what a give-back keeps.
    fn keep_above(&self, top: usize) -> usize {
        let mut keep = self.end();
        for &(offset, _, _) in self.chunks.iter().rev() {
            if offset < top {
                break;
            }
            keep = offset;
        }
        keep
    }
}

/// How many times a give-back tries again when a take raced it past where it meant to unmap.
const GIVE_BACK_TRIES: usize = 3;

impl Bounds {
    /// Bytes a growable stack holds mapped above its top (0 for a fixed stack).
    pub(crate) fn idle_bytes(&self) -> usize {
        if !self.is_growable() {
            return 0;
        }
        self.mapped().saturating_sub(self.top.load(Relaxed))
    }

    /// Sets the limit and the mapped end to `end`, the mapped end of `growth` (whose lock the
    /// caller holds), and tells `counters`.
    fn settle(&self, growth: &Growth, counters: Option<&StreamCounters>) {
        let end = growth.end();
        self.mapped.store(end, Relaxed);
        self.limit.store(end, Relaxed);
        if let Some(c) = counters {
            c.stack_mapped.set(end as u64);
        }
    }

    /// Gives back what a growable stack has mapped above its top, from any thread: the bytes
    /// unmapped, or `Ok(None)` when the stack is being captured (the captured work may use memory
    /// above the top), by its own stream or by a capture begun elsewhere. Waits for the stream's
    /// work first: memory released by buffers may still be in use by queued work. Never touches
    /// memory in use: a take that races it either finds the memory still mapped or maps it again.
    ///
    /// `counters` are the stream's: its `stack_mapped` is set (under the lock, as every writer of
    /// it); `own` counts the unmaps as the stream's driver calls too, only on the stream's thread
    /// (its counters have one writer).
    pub(crate) fn give_back_idle(
        &self,
        storage: &Storage,
        counters: &StreamCounters,
        own: bool,
    ) -> Result<Option<usize>, PoolError> {
        let Some(lock) = &self.growth else {
            return Ok(Some(0));
        };
        let growth = sync::lock(lock);
        if growth.capturing {
            return Ok(None);
        }
        let Some(stream) = growth.stream.clone() else {
            return Ok(Some(0)); // the stream is gone: its stack goes back whole, after its work
        };
        if storage.backend.is_capturing(&stream)? {
            return Ok(None); // a wait would break someone else's capture of the stream
        }
        let mapped = growth.end();
        let mut keep = None;
        for _ in 0..GIVE_BACK_TRIES {
            let at = growth.keep_above(self.top.load(Acquire));
            if at == mapped {
                return Ok(Some(0));
            }
            // The Dekker handshake with `Stack::take_aligned`: limit lowered, fence, top read.
            self.limit.store(at, Relaxed);
            fence(SeqCst);
            if self.top.load(Acquire) <= at {
                keep = Some(at);
                break;
            }
            // A take is past `at` (or was, for a moment): what it uses stays.
            self.limit.store(mapped, Relaxed);
        }
        let Some(keep) = keep else {
            return Ok(Some(0)); // the stream keeps taking above: its memory is in use
        };
        // No take hands out memory above `keep` from here on without mapping under the lock
        // (which bumps the generation), and the top read above was stored after the work queued
        // on every block released above it: waiting for the stream covers that work. The wait
        // lets the lock go, so that the stream's own thread never waits for its GPU work in a
        // take (that work may wait on the thread).
        let generation = growth.generation;
        drop(growth);
        let waited = storage.backend.synchronize(&stream);
        let mut growth = sync::lock(lock);
        if let Err(e) = waited {
            self.settle(&growth, None);
            return Err(e);
        }
        if growth.generation != generation || growth.capturing || growth.stream.is_none() {
            // The stream mapped (its limit is back up), began a capture, or went: memory above
            // `keep` may be in use again. Nothing is given back this time.
            if growth.generation == generation {
                self.settle(&growth, None);
            }
            return Ok(Some(0));
        }
        growth.generation += 1;
        let mut freed = 0;
        let mut failed = None;
        while let Some(&(offset, bytes, handle)) = growth.chunks.last() {
            if offset < keep {
                break;
            }
            let unmapped = {
                let at = growth.base + offset as DevPtr;
                let calls = own.then_some(counters);
                // SAFETY: the chunk is what `grow_and_take` mapped with `handle`, and lies above
                // `keep`: no take can hand it out (the handshake above), no live block lies there
                // (all are below the top), and the work of the blocks released there is done
                // (waited for above). It leaves the list once unmapped.
                unsafe { storage.unmap(at, bytes, handle, calls) }
            };
            if let Err(e) = unmapped {
                failed = Some(e);
                break;
            }
            growth.chunks.pop();
            freed += bytes;
        }
        self.settle(&growth, Some(counters));
        match failed {
            Some(e) => Err(e),
            None => Ok(Some(freed)),
        }
    }
}

impl Stack {
    /// A growable stack of its own for a stream (`stream`), numbered `index`: a reservation as
    /// large as the device's memory, nothing mapped yet.
    pub(crate) fn reserve_growable(
        storage: &Storage,
        index: usize,
        stream: &RawStream,
    ) -> Result<Stack, PoolError> {
        let backend = &storage.backend;
        let granule = backend.vmm_granularity().ok_or_else(|| backend.no_vmm())?;
        let bytes = backend
            .total_memory()
            .div_ceil(granule)
            .checked_mul(granule)
            .ok_or_else(|| backend.no_vmm())?;
        let base = storage.reserve(bytes)?;
        let align = backend.texture_alignment();
        Ok(Stack::growable(
            index,
            base,
            bytes,
            align,
            granule,
            stream.clone(),
        ))
    }

    /// Gives a growable stack's memory back: unmaps it and frees its reservation. A failure is
    /// logged: the reservation stays (a leak of address space, and of what failed to unmap, not of
    /// correctness).
    ///
    /// # Safety
    /// The stream that held it is gone and its work is done (it synchronized, or the event after
    /// its work fired: the deferred give-back's `After::Events`).
    pub(crate) unsafe fn release_growable(self, storage: &Storage) {
        let released = (|| {
            // SAFETY: the stream's work is done (the caller's contract) and the stack is consumed
            // here: nothing uses any of its memory.
            unsafe { self.unmap_all(storage) }?;
            // SAFETY: every chunk was unmapped just above; the reservation is freed once.
            unsafe { storage.unreserve(self.base, self.size()) }
        })();
        if let Err(e) = released {
            crate::base::event::error!(device = %storage.id, error = %e, "giving a growable stack back failed");
        }
    }

    /// A growable stack over a reservation of `size` bytes at `base` (both multiples of
    /// `granule`), nothing mapped yet, used by the work of `stream`.
    pub(crate) fn growable(
        index: usize,
        base: DevPtr,
        size: usize,
        align: usize,
        granule: usize,
        stream: RawStream,
    ) -> Stack {
        let growth = Growth {
            base,
            granule,
            chunks: Vec::new(),
            stream: Some(stream),
            capturing: false,
            generation: 0,
        };
        Stack::with_bounds(index, base, size, align, Bounds::new(0, Some(growth)))
    }

    /// Maps memory of `growth` (locked by the caller) so that the stack reaches `end` (rounded up
    /// to the granule), through `storage` (counted driver calls). `Ok(false)`, and nothing mapped,
    /// if `end` is past the reservation. On an error nothing more is mapped.
    fn map_locked(
        &self,
        growth: &mut Growth,
        end: usize,
        storage: &Storage,
        counters: Option<&StreamCounters>,
    ) -> Result<bool, PoolError> {
        if end > self.size {
            return Ok(false);
        }
        growth.generation += 1;
        let from = growth.end();
        // No overflow: `end <= size`, a multiple of the granule.
        let to = end.div_ceil(growth.granule) * growth.granule;
        if to > from {
            let handle = storage.map(self.base + from as DevPtr, to - from, counters)?;
            growth.chunks.push((from, to - from, handle));
        }
        self.bounds.settle(growth, counters);
        Ok(true)
    }

    /// Maps memory so that the stack reaches `end` (rounded up to the granule). `Ok(false)`, and
    /// nothing mapped, if it cannot: a fixed stack, or `end` past the reservation.
    #[cold]
    pub(crate) fn map_to(
        &self,
        end: usize,
        storage: &Storage,
        counters: Option<&StreamCounters>,
    ) -> Result<bool, PoolError> {
        let Some(growth) = &self.bounds.growth else {
            return Ok(false);
        };
        self.map_locked(&mut sync::lock(growth), end, storage, counters)
    }

    /// Maps memory up to the end of a block of `bytes` on `align` and takes it, under the mapping
    /// lock (so no give-back unmaps between the two). `Ok(None)` for a fixed stack or past the
    /// reservation. On an error nothing more is mapped.
    #[cold]
    pub(crate) fn grow_and_take(
        &self,
        bytes: usize,
        align: usize,
        storage: &Storage,
        counters: &StreamCounters,
    ) -> Result<Option<(usize, Block)>, PoolError> {
        let Some(growth) = &self.bounds.growth else {
            return Ok(None);
        };
        let Some((_, end)) = Stack::place(self.top(), bytes, align) else {
            return Ok(None);
        };
        let mut growth = sync::lock(growth);
        if !self.map_locked(&mut growth, end, storage, Some(counters))? {
            return Ok(None);
        }
        Ok(self.take_aligned(bytes, align))
    }

    /// Marks the stream's own capture under way (`true`), or over with its graph made or not
    /// (`false`): meanwhile nothing is given back. Waits for a give-back under way.
    #[cfg(feature = "cuda")]
    pub(crate) fn set_capturing(&self, on: bool) {
        if let Some(growth) = &self.bounds.growth {
            let mut growth = sync::lock(growth);
            growth.capturing = on;
            growth.generation += 1;
        }
    }

    /// The stream is going: no give-back waits for it, nor unmaps, any more (its last work may
    /// still run). Waits for a give-back under way.
    pub(crate) fn retire(&self) {
        if let Some(growth) = &self.bounds.growth {
            // Dropped here, on the stream's thread, not wherever the last `Bounds` goes.
            let _gone = sync::lock(growth).stream.take();
        }
    }

    /// Unmaps every chunk; returns the bytes unmapped. A chunk that fails to unmap stays mapped,
    /// and the error is returned.
    ///
    /// # Safety
    /// No work queued or running uses the stack's memory, and none will: the stack is going.
    pub(crate) unsafe fn unmap_all(&self, storage: &Storage) -> Result<usize, PoolError> {
        let Some(growth) = &self.bounds.growth else {
            return Ok(0);
        };
        let mut growth = sync::lock(growth);
        let mut freed = 0;
        let mut result = Ok(());
        while let Some(&(offset, bytes, handle)) = growth.chunks.last() {
            let at = self.base + offset as DevPtr;
            // SAFETY: the chunk is what `map_locked` mapped with `handle`; nothing uses it (the
            // caller's contract), and it leaves the list once unmapped.
            if let Err(e) = unsafe { storage.unmap(at, bytes, handle, None) } {
                result = Err(e);
                break;
            }
            growth.chunks.pop();
            freed += bytes;
        }
        self.bounds.settle(&growth, None);
        result.map(|()| freed)
    }

    /// Grows `block`, the topmost block, so it ends at `end` (no change if it already ends there or
    /// past it), mapping memory up to `end` first where `may_map`. `Ok(false)`, and no change, if
    /// the block is not topmost or `end` is past the stack (or the mapped end, without `may_map`).
    #[cfg(feature = "cuda")]
    pub(crate) fn grow_mapped(
        &self,
        block: &mut Block,
        end: usize,
        may_map: bool,
        storage: &Storage,
        counters: &StreamCounters,
    ) -> Result<bool, PoolError> {
        let Some(growth) = &self.bounds.growth else {
            return Ok(self.grow(block, end));
        };
        // Under the mapping lock: no give-back lowers the limit meanwhile.
        let mut growth = sync::lock(growth);
        if may_map && end > growth.end() {
            self.map_locked(&mut growth, end, storage, Some(counters))?;
        }
        Ok(self.grow(block, end))
    }
}

/// A stream's growable stack: trimmed on demand, given back on an out-of-memory, mapped to the
/// configured size when it is claimed.
impl Stream {
    /// Gives back the memory of a growable stack above its top (see
    /// [`Device::set_growable_stacks`](crate::Device::set_growable_stacks)): every mapping that
    /// lies wholly above the top (a live buffer's, or a live graph's, keeps what it uses) is
    /// unmapped. Returns the bytes unmapped: 0 for a fixed stack, or a stream without a stack.
    ///
    /// Waits for the stream first (memory released by buffers may still be in use by queued
    /// work). Mappings are whole: one made to reach a peak goes back whole once the top is below
    /// its start. Refused inside a graph capture on this thread (`CaptureError::Allocates`:
    /// the wait would break it). An out-of-memory anywhere on the device, on any thread, gives
    /// this memory back as well ([`Device::reclaim_idle`](crate::Device::reclaim_idle)).
    pub fn trim(&self) -> Result<usize, PoolError> {
        if self.stack().is_none_or(|s| !s.is_growable()) {
            return Ok(0);
        }
        if self.in_own_capture() || capturing::on_this_thread() {
            return Err(crate::core::graph_key::refusal(CaptureError::Allocates {
                what: "Stream::trim",
                context: None,
            }));
        }
        // Host copies queued before are then known done too.
        self.synchronize()?;
        self.give_back_idle()?
            .ok_or(PoolError::Capture(CaptureError::Elsewhere {
                what: "Stream::trim",
                stream: self.id(),
            }))
    }

    /// Unmaps what a growable stack has mapped above its top, once the stream's work is done,
    /// through the same handshake as a give-back from another thread: the bytes unmapped, or
    /// `None` where a capture records the stream (a wait would break it). The caller is not
    /// inside a capture on this thread.
    #[cold]
    fn give_back_idle(&self) -> Result<Option<usize>, PoolError> {
        let Some(stack) = self.stack() else {
            return Ok(Some(0));
        };
        let given =
            stack
                .bounds()
                .give_back_idle(self.device().storage(), self.counters(), true)?;
        if given.is_some() {
            self.ledger().trim_requested.store(false, Relaxed);
        }
        Ok(given)
    }

    /// Where an out-of-memory elsewhere asked for this stream's idle stack memory while a capture
    /// recorded the stream (`IdleMemory for Ledger` below), gives it back: called by
    /// `synchronize`, the stream having just waited. One relaxed load when nothing was asked.
    #[inline]
    pub(crate) fn honour_trim_request(&self) {
        if self.ledger().trim_requested.load(Relaxed) {
            self.give_back_asked_idle();
        }
    }

    /// Gives back the idle stack memory the device asked for, the stream having just waited.
    #[cold]
    fn give_back_asked_idle(&self) {
        if self.in_own_capture() || capturing::on_this_thread() {
            return; // an unmap is a driver call a capture must not see; asked again next time
        }
        if let Err(e) = self.give_back_idle() {
            crate::base::event::warn!(stream = self.id(), error = %e, "giving idle stack memory back failed");
        }
    }

    /// `first`, an error of `attempt`: where it is an out-of-memory (and no capture is under way
    /// here), `attempt` once more, after this stream gave back its own idle stack memory (with
    /// `own`: not when the stack itself is growing) and every other holder of the device theirs.
    /// The final error says what was held where and what was given back.
    #[cold]
    #[inline(never)]
    pub(crate) fn retry_after_reclaim<T>(
        &self,
        first: PoolError,
        own: bool,
        attempt: &mut dyn FnMut() -> Result<T, PoolError>,
    ) -> Result<T, PoolError> {
        if !matches!(first, PoolError::OutOfMemory { .. })
            || self.in_own_capture()
            || capturing::on_this_thread()
        {
            return Err(first);
        }
        let mine = own.then(|| self.give_back_own_idle()).flatten();
        let skip = Arc::as_ptr(self.ledger()).cast::<()>();
        self.device()
            .storage()
            .retry_reclaimed(Some(skip), mine, attempt)
    }

    /// Unmaps this stream's growable stack above its top, once its work is done: what it held and
    /// gave back. `None` without a growable stack.
    #[cold]
    fn give_back_own_idle(&self) -> Option<ReclaimedFrom> {
        let stack = self.stack().filter(|s| s.is_growable())?;
        let before = stack.mapped();
        let held = stack.bounds().idle_bytes();
        let given = self.give_back_idle().unwrap_or_else(|e| {
            crate::base::event::warn!(stream = self.id(), error = %e, "giving idle stack memory back failed");
            Some(0)
        });
        Some(ReclaimedFrom {
            holder: self.ledger().holder(),
            held,
            given_back: before.saturating_sub(stack.mapped()),
            deferred: given.is_none() && held > 0,
        })
    }

    /// Maps the configured stack size into a new growable stack, so work that fits it makes no
    /// driver call after `Stream::new` (OpenCV's stacks exist once the stream does); growth past
    /// it stays on demand. Without the memory now, the stack starts empty and grows on demand.
    #[cold]
    pub(crate) fn map_configured(&self, stack: &Stack) {
        // Configured since the claim as fixed: nothing is asked to be mapped.
        let Ok(Stacks::Growable { mapped }) = self.device().stacks() else {
            return;
        };
        let size = mapped.min(stack.size());
        if size == 0 {
            return;
        }
        if let Err(e) = stack.map_to(size, self.device().storage(), Some(self.counters())) {
            crate::base::event::debug!(stream = self.id(), error = %e, "mapping the configured stack size failed: the stack grows on demand");
        }
    }
}

/// A growable stack's memory above its top is idle: whichever thread ran out of memory gives it
/// back, once the stream's work is done; a stack being captured is asked to give it back at its
/// next `synchronize`.
impl IdleMemory for Ledger {
    fn holder(&self) -> String {
        format!("stream {}'s stack", self.id)
    }

    fn idle_bytes(&self) -> usize {
        self.stack.get().map_or(0, |s| s.idle_bytes())
    }

    fn give_back_idle(&self, storage: &Storage) -> GaveBack {
        let Some(stack) = self.stack.get() else {
            return GaveBack::default();
        };
        // A wait or an unmap on a thread that captures would break its capture.
        let given = if capturing::on_this_thread() {
            Ok(None)
        } else {
            stack.give_back_idle(storage, &self.counters, false)
        };
        match given {
            Ok(Some(bytes)) => GaveBack {
                bytes,
                deferred: false,
            },
            Ok(None) => {
                let deferred = stack.idle_bytes() > 0;
                if deferred {
                    self.trim_requested.store(true, Relaxed);
                }
                GaveBack { bytes: 0, deferred }
            }
            Err(e) => {
                crate::base::event::warn!(stream = self.id, error = %e, "giving idle stack memory back failed");
                GaveBack::default()
            }
        }
    }
}
