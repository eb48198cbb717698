//! Stack fences: what a graph reserves on its stream's stack. A fence is one byte taken at the
//! top when a capture begins, grown to what the captured buffers reached above it once the graph
//! is made, and released when the graph goes: the replays' memory stays reserved while the stack
//! goes on being used above it. The stack's high-water mark, measured from the fence, says how far
//! the captured buffers reached. Clients: `graph` (a graph's reserved block, a family's region).
//!
//! A [`Fence`] is move-only and owns its block: made only by [`Stream::reserve_fence`], grown,
//! lowered and released only through the stream that made it (another stream refuses it, logged:
//! its block is not that stack's). A fence dropped without [`Stream::release_reserved`] cannot
//! reach its stack (the stream is not `Sync`, and the fence holds no borrow of it, which a graph
//! family's region could not carry), so it cannot go back, nor be handed to the deferred queue: it
//! stays reserved for the stream's life, which wastes memory but never corrupts the stack (nothing
//! hands its bytes out again). That is a bug of the fence's holder: the type is `#[must_use]`, and
//! its drop logs it (and fails a debug assertion, except while a panic unwinds).

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

/// A fence on a stream's stack: one taker's block at the top, which the stream's later buffers
/// stay above until it is released. Neither `Copy` nor `Clone`; see the module doc for its rules.
#[cfg(feature = "cuda")]
#[must_use = "a fence holds stack memory until its stream releases it (`Stream::release_reserved`)"]
#[derive(Debug)]
pub(crate) struct Fence {
    /// `None` once released.
    block: Option<Block>,
    /// The id of the stream whose stack holds the block.
    stream: u64,
}

#[cfg(feature = "cuda")]
impl Fence {
    /// Offset one past the fence's last byte.
    pub(crate) fn end(&self) -> usize {
        self.block().end()
    }

    /// The top before the fence was taken.
    pub(crate) fn prev_top(&self) -> usize {
        self.block().prev_top()
    }

    fn block(&self) -> &Block {
        self.block
            .as_ref()
            .expect("a fence holds its block until released")
    }

    /// The block, if `stream` made the fence; logged otherwise (the block is another stack's).
    fn block_on(&mut self, stream: &Stream) -> Option<&mut Block> {
        if self.stream != stream.id() {
            crate::base::event::error!(
                stream = stream.id(),
                fence_of = self.stream,
                "a fence was handed to a stream other than its own: refused"
            );
            debug_assert!(
                false,
                "a fence of stream {} used on stream {}",
                self.stream,
                stream.id()
            );
            return None;
        }
        self.block.as_mut()
    }
}

#[cfg(feature = "cuda")]
impl Drop for Fence {
    fn drop(&mut self) {
        if self.block.is_some() {
            crate::base::event::error!(
                stream = self.stream,
                "a stack fence was dropped without being released: its memory stays reserved \
                 until the stream goes"
            );
            if !std::thread::panicking() {
                debug_assert!(false, "a stack fence was dropped without being released");
            }
        }
    }
}

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
    pub(crate) fn reserve_fence(&self) -> Result<Fence, PoolError> {
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
            return Err(crate::core::graph_key::refusal(CaptureError::NeedsStack {
                requested: 1,
                available: stack.map_or(0, Stack::free_bytes),
                context: None,
            }));
        };
        self.counters().stack_in_use.set(stack.top() as u64);
        Ok(Fence {
            block: Some(fence),
            stream: self.id(),
        })
    }

    /// Grows `fence`, the topmost block, up to `end`: what a capture's buffers used above it.
    pub(crate) fn reserve_up_to(&self, fence: &mut Fence, end: usize) -> Result<(), PoolError> {
        let Some(stack) = self.stack() else {
            return Ok(());
        };
        let Some(fence) = fence.block_on(self) else {
            return Err(PoolError::Unsupported {
                device: self.device().id(),
                what: "growing a stack fence through a stream other than its own",
            });
        };
        // The same bytes the capture's buffers had: they fitted then, and the top is where it was.
        // A growable stack may have been trimmed below them since (a family's lowered region):
        // map them again first, outside any capture.
        let available = stack.free_bytes();
        let may_map = !self.in_own_capture() && !capturing::on_this_thread();
        let storage = self.device().storage();
        if !stack.grow_mapped(fence, end, may_map, storage, self.counters())? {
            return Err(crate::core::graph_key::refusal(CaptureError::NeedsStack {
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
    pub(crate) fn shrink_reserved(&self, fence: &mut Fence, end: usize) -> bool {
        let Some(stack) = self.stack() else {
            return false;
        };
        let Some(fence) = fence.block_on(self) else {
            return false;
        };
        let shrunk = stack.shrink(fence, end);
        if shrunk {
            self.counters().stack_in_use.set(stack.top() as u64);
        }
        shrunk
    }

    /// Gives back a fence of [`reserve_fence`](Self::reserve_fence) (refused, logged, and kept
    /// reserved, if it is another stream's).
    pub(crate) fn release_reserved(&self, mut fence: Fence) {
        if fence.block_on(self).is_none() {
            // Logged there; its block is another stack's, which keeps it reserved.
            std::mem::forget(fence);
            return;
        }
        let Some(block) = fence.block.take() else {
            return;
        };
        if let Some(stack) = self.stack() {
            let release = stack.release(&block);
            self.counters().stack_in_use.set(stack.top() as u64);
            if release == Release::OutOfOrder {
                // Reclaimed later, as any out-of-order block; counted, never an error, and not
                // logged: graphs are dropped in whatever order their owner drops them (a
                // `Vec<Graph>` front to back), which no buffer rule asks the user to change.
                self.counters().lifo_violations.add(1);
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

    /// A fence is its stream's: another stream refuses to grow, lower or release it (a debug
    /// assertion, and in release builds a logged refusal), and its own stack is left as it was.
    #[cfg(feature = "cuda")]
    #[test]
    fn a_fence_is_refused_by_another_stream_and_its_stack_stays_whole()
    -> Result<(), crate::PoolError> {
        let device = crate::Device::private_host();
        let (own, other) = (crate::Stream::new(&device)?, crate::Stream::new(&device)?);
        let mut fence = own.reserve_fence()?;
        let end = fence.end();
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            other.shrink_reserved(&mut fence, 0)
        }));
        if cfg!(debug_assertions) {
            assert!(refused.is_err(), "a debug build asserts");
        } else {
            assert_eq!(refused.ok(), Some(false));
        }
        assert_eq!(fence.end(), end, "the fence is as it was");
        assert_eq!(own.stats().stack_in_use, end);
        assert_eq!(other.stats().stack_in_use, 0);
        own.release_reserved(fence);
        assert_eq!(own.stats().stack_in_use, 0);
        assert_eq!(own.stats().lifo_violations, 0);
        Ok(())
    }

    /// A fence dropped without its release is a bug of its holder (a debug assertion, logged), but
    /// never corrupts the stack: its bytes stay reserved, later buffers go above them and come
    /// back in order.
    #[cfg(feature = "cuda")]
    #[test]
    fn a_fence_dropped_unreleased_stays_reserved() -> Result<(), crate::PoolError> {
        use crate::GpuRead;
        let device = crate::Device::private_host();
        let stream = crate::Stream::new(&device)?;
        let fence = stream.reserve_fence()?;
        let end = fence.end();
        let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(fence)));
        assert_eq!(dropped.is_err(), cfg!(debug_assertions));
        assert_eq!(stream.stats().stack_in_use, end, "still reserved");
        let base = stream.stack_range().expect("a stack").start;
        let pool = crate::compat::opencv::BufferPool::new(&stream);
        let after = pool.get_buffer_1d::<u8>(64)?;
        assert!(
            after.device_ptr() - base >= end as u64,
            "nothing is handed out twice"
        );
        drop(after);
        assert_eq!(stream.stats().stack_in_use, end);
        assert_eq!(stream.stats().lifo_violations, 0);
        Ok(())
    }
}
