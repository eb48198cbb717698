//! What CUDA graph capture (`graph.rs`) needs of a stream: whether its own capture is under way,
//! a fence on its stack that grows to what the captured buffers used, the high-water mark the captured buffers reached, and
//! the epochs of its live graphs (what memory `core/deferred.rs` keeps for them).

use std::any::Any;
use std::cell::{Cell, RefCell};

#[cfg(feature = "cuda")]
use crate::capturing;
#[cfg(feature = "cuda")]
use crate::error::PoolError;
#[cfg(feature = "cuda")]
use crate::stack::{Block, Release, Stack};

use crate::core::replay::ReplayHook;

use super::Stream;

/// A stream's graph state.
#[derive(Default)]
pub(super) struct Graphs {
    /// The stream's own capture is under way: nothing may reach the driver's allocator.
    capturing: Cell<bool>,
    /// Captures begun on this stream: the epoch a fallback or driver allocation is stamped with.
    captures_begun: Cell<u64>,
    /// The epochs of this stream's live graphs (each its capture's count when it began).
    live: RefCell<Vec<u64>>,
    /// What features noted for the replays of the capture under way (SharedMat's accesses).
    replay: RefCell<Option<Box<dyn ReplayHook>>>,
}

impl Stream {
    /// Whether this stream's own [`capture`](Stream::capture) is under way (not whether the
    /// driver records its CUDA stream: `Backend::is_capturing` says that).
    #[inline]
    pub(crate) fn in_own_capture(&self) -> bool {
        self.graphs.capturing.get()
    }

    /// The epoch memory allocated now is stamped with.
    pub(super) fn capture_epoch(&self) -> u64 {
        self.graphs.captures_begun.get()
    }

    /// Whether a live graph of this stream began its capture after `epoch`: its replays may use
    /// memory allocated then.
    pub(crate) fn graph_newer_than(&self, epoch: u64) -> bool {
        self.graphs.live.borrow().iter().any(|&graph| graph > epoch)
    }

    /// Notes, in the hook of type `H` this stream's own capture holds (made on the first note),
    /// what its graph's replays must do. One feature notes (SharedMat): a hook of another type
    /// in the slot is a bug, and the note is dropped, said so.
    pub(crate) fn note_for_replay<H: ReplayHook + Default>(&self, note: impl FnOnce(&mut H)) {
        let mut slot = self.graphs.replay.borrow_mut();
        let hook: &mut dyn Any = &mut **slot.get_or_insert_with(|| Box::new(H::default()));
        match hook.downcast_mut::<H>() {
            Some(hook) => note(hook),
            None => debug_assert!(false, "one replay hook type a capture"),
        }
    }
}

#[cfg(feature = "cuda")]
impl Stream {
    /// This stream's own capture begins: nothing it takes may reach the driver's allocator.
    pub(crate) fn set_own_capture(&self, on: bool) {
        self.graphs.capturing.set(on);
        if on {
            // What a failed capture noted: its work never runs.
            self.graphs.replay.borrow_mut().take();
        }
    }

    /// Marks the stream's own capture under way (`true`) or finished, its graph made or not
    /// (`false`): meanwhile no give-back unmaps the stack above its top, where the captured
    /// buffers were (the graph's fence covers them only once it is made).
    pub(crate) fn hold_stack_for_capture(&self, on: bool) {
        if let Some(stack) = self.stack.get() {
            stack.set_capturing(on);
        }
    }

    /// What features noted for the replays of the capture that just ended, for its graph to hold.
    pub(crate) fn take_replay_hook(&self) -> Option<Box<dyn ReplayHook>> {
        let mut hook = self.graphs.replay.borrow_mut().take()?;
        hook.capture_ended();
        Some(hook)
    }

    /// A capture begins: allocations from now on are of a later epoch than its graph's.
    pub(crate) fn capture_begun(&self) -> u64 {
        let epoch = self.graphs.captures_begun.get() + 1;
        self.graphs.captures_begun.set(epoch);
        epoch
    }

    /// A graph of the capture begun at `epoch` was made: memory allocated before that capture is
    /// kept, when released, until the graph is dropped.
    pub(crate) fn graph_made(&self, epoch: u64) {
        self.graphs.live.borrow_mut().push(epoch);
    }

    /// The graph of `epoch` was dropped: what only it held is freed.
    pub(crate) fn graph_dropped(&self, epoch: u64) {
        let mut live = self.graphs.live.borrow_mut();
        if let Some(i) = live.iter().position(|&e| e == epoch) {
            live.swap_remove(i);
        }
        drop(live);
        self.drain_deferred();
    }

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
        let taken = stack.and_then(|s| {
            s.take(1)
                .or_else(|| self.grow_and_take(s, 1, s.align()))
                .map(|(_, block)| (s, block))
        });
        let Some((stack, fence)) = taken else {
            return Err(PoolError::CaptureNeedsStack {
                requested: 1,
                available: stack.map_or(0, Stack::free_bytes),
                context: None,
            });
        };
        self.counters().stack_in_use.set(stack.top() as u64);
        Ok(fence)
    }

    /// Grows `fence`, the topmost block, up to `end`: what a capture's buffers used above it.
    pub(crate) fn reserve_up_to(&self, fence: &mut Block, end: usize) -> Result<(), PoolError> {
        let Some(stack) = self.stack.get() else {
            return Ok(());
        };
        // The same bytes the capture's buffers had: they fitted then, and the top is where it was.
        // A growable stack may have been trimmed below them since (a family's lowered region):
        // map them again first, outside any capture.
        let available = stack.free_bytes();
        let may_map = !self.in_own_capture() && !capturing::on_this_thread();
        let storage = self.device.storage();
        if !stack.grow_mapped(fence, end, may_map, storage, self.counters())? {
            return Err(PoolError::CaptureNeedsStack {
                requested: end.saturating_sub(fence.end()),
                available,
                context: None,
            });
        }
        self.counters().stack_in_use.set(stack.top() as u64);
        Ok(())
    }

    /// Shrinks `fence`, the topmost block, back to `end`: a graph family's region, lowered to its
    /// base for the capture of a member. `false` if something taken after it is still live.
    pub(crate) fn shrink_reserved(&self, fence: &mut Block, end: usize) -> bool {
        let Some(stack) = self.stack.get() else {
            return false;
        };
        let shrunk = stack.shrink(fence, end);
        if shrunk {
            self.counters().stack_in_use.set(stack.top() as u64);
        }
        shrunk
    }

    /// Gives back a block of [`reserve_fence`](Self::reserve_fence).
    pub(crate) fn release_reserved(&self, block: Block) {
        if let Some(stack) = self.stack.get() {
            let prev_top = block.prev_top();
            let release = stack.release(&block);
            self.counters().stack_in_use.set(stack.top() as u64);
            if release == Release::OutOfOrder {
                // Reclaimed later, as any out-of-order block; counted and logged, never an error.
                let _ = self.lifo_violation(prev_top as u64);
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

#[cfg(test)]
mod tests {
    /// What a CUDA graph capture does to a stream's stack (`graph.rs`), on the host: a fence, packed
    /// buffers above it, and a reservation of what they reached; buffers taken while the graph lives
    /// never get memory its replays write.
    #[cfg(feature = "cuda")]
    #[test]
    fn a_capture_reserves_what_its_packed_buffers_used() -> Result<(), crate::PoolError> {
        use crate::GpuRead;
        let device = crate::Device::private_host();
        let stream = crate::Stream::new(&device)?;
        let pool = crate::compat::opencv::BufferPool::new(&stream);
        let before = pool.get_buffer_1d::<u8>(64)?; // the top is not texture-aligned
        let mut fence = stream.reserve_fence()?;
        assert_eq!((fence.prev_top(), fence.end()), (64, 513));
        let high_water = stream.start_high_water(fence.end());
        let captured = [
            pool.get_buffer_1d::<u8>(64)?.device_ptr(),
            pool.get_buffer_1d::<u8>(100)?.device_ptr(),
        ];
        let base = stream.stack_range().expect("a stack").start;
        assert_eq!(
            captured.map(|p| p - base),
            [768, 1024],
            "above the fence, each on 256 bytes"
        );
        let peak = stream.end_high_water(high_water);
        assert_eq!(peak, 1152);
        stream.reserve_up_to(&mut fence, peak)?;
        assert_eq!((fence.prev_top(), fence.end()), (64, 1152));
        let after = pool.get_buffer_1d::<u8>(64)?;
        assert!(
            after.device_ptr() - base >= 1152,
            "nothing a replay writes is handed out"
        );
        drop(after);
        stream.release_reserved(fence);
        drop(before);
        assert_eq!(stream.stats().stack_in_use, 0);
        assert_eq!(stream.stats().lifo_violations, 0);
        Ok(())
    }
}
