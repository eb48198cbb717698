//! Stack fences: what a graph reserves on its stream's stack. A fence is one byte taken at the
//! top when a capture begins, grown to what the captured buffers reached above it once the graph
//! is made, and released when the graph goes: the replays' memory stays reserved while the stack
//! goes on being used above it. The stack's high-water mark, measured from the fence, says how far
//! the captured buffers reached. Clients: `graph` (a graph's reserved block, a family's region).

#[cfg(feature = "cuda")]
use crate::base::error::CaptureError;
#[cfg(feature = "cuda")]
use crate::base::error::PoolError;
#[cfg(feature = "cuda")]
use crate::core::capturing;
#[cfg(feature = "cuda")]
use crate::core::stack::{Block, Release, Stack};
#[cfg(feature = "cuda")]
use crate::core::stream::Stream;

#[cfg(feature = "cuda")]
impl Stream {
    /// Marks the stream's own capture under way (`true`) or finished, its graph made or not
    /// (`false`): meanwhile no give-back unmaps the stack above its top, where the captured
    /// buffers were (the graph's fence covers them only once it is made).
    pub(crate) fn hold_stack_for_capture(&self, on: bool) {
        if let Some(stack) = self.stack() {
            stack.set_capturing(on);
        }
    }

    /// The stack's top, if the stream holds a stack.
    pub(crate) fn stack_top(&self) -> Option<usize> {
        self.stack().map(Stack::top)
    }

    /// Takes one byte of the stack as a fence: stack memory below it cannot be reclaimed, nor
    /// reused, until the fence is released (what a graph's replays need of the memory above it).
    pub(crate) fn reserve_fence(&self) -> Result<Block, PoolError> {
        let stack = match self.stack() {
            Some(stack) => Some(stack),
            None => self.claim_stack()?,
        };
        let taken = stack.and_then(|s| {
            s.take(1)
                .or_else(|| self.grow_and_take(s, 1, s.align()))
                .map(|(_, block)| (s, block))
        });
        let Some((stack, fence)) = taken else {
            return Err(PoolError::Capture(CaptureError::NeedsStack {
                requested: 1,
                available: stack.map_or(0, Stack::free_bytes),
                context: None,
            }));
        };
        self.counters().stack_in_use.set(stack.top() as u64);
        Ok(fence)
    }

    /// Grows `fence`, the topmost block, up to `end`: what a capture's buffers used above it.
    pub(crate) fn reserve_up_to(&self, fence: &mut Block, end: usize) -> Result<(), PoolError> {
        let Some(stack) = self.stack() else {
            return Ok(());
        };
        // The same bytes the capture's buffers had: they fitted then, and the top is where it was.
        // A growable stack may have been trimmed below them since (a family's lowered region):
        // map them again first, outside any capture.
        let available = stack.free_bytes();
        let may_map = !self.in_own_capture() && !capturing::on_this_thread();
        let storage = self.device().storage();
        if !stack.grow_mapped(fence, end, may_map, storage, self.counters())? {
            return Err(PoolError::Capture(CaptureError::NeedsStack {
                requested: end.saturating_sub(fence.end()),
                available,
                context: None,
            }));
        }
        self.counters().stack_in_use.set(stack.top() as u64);
        Ok(())
    }

    /// Shrinks `fence`, the topmost block, back to `end`: a graph family's region, lowered to its
    /// base for the capture of a member. `false` if something taken after it is still live.
    pub(crate) fn shrink_reserved(&self, fence: &mut Block, end: usize) -> bool {
        let Some(stack) = self.stack() else {
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
        if let Some(stack) = self.stack() {
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
