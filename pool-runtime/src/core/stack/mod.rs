//! One stream's stack: a bump pointer over a slice of the device's stack memory.
//!
//! Taking is an aligned bump, on the alignment the request's layout asks (`Layout::block_align`: 256
//! for a row or a column, or 64 packed as OpenCV packs them with `Packing::OpenCv`, the texture
//! alignment for 2D); releasing the topmost block moves the top back. A block released out of
//! order cannot be reclaimed yet (buffers above it are live), so it waits in `pending` until the
//! blocks above it are gone. That keeps every live block intact whatever order safe code releases in;
//! `pending` is touched, and may allocate, only on that violation path.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::atomic::Ordering::{self, Relaxed, SeqCst};

use crate::base::layout::MAX_ELEMENT_ALIGN;
use crate::base::sync::{AtomicUsize, Mutex, fence};
use crate::storage::backend::DevPtr;

mod growable;
use growable::Growth;

/// A block of a stack, held by whoever took it until it is given back.
///
/// Neither `Copy` nor `Clone`, and made only by [`Stack::take_aligned`]: each block is one taker's
/// (a buffer's lease, a graph), which releases it when the taker goes (a lease once, by
/// `Lease::give_back`; a graph's by value, in `Stream::release_reserved`), so only blocks a take
/// handed out come back.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// Offset one past the last byte.
    end: usize,
    /// The top before this block was taken: where the top returns when it is released.
    prev_top: usize,
}

impl Block {
    /// Offset one past the block's last byte.
    #[inline]
    pub(crate) fn end(&self) -> usize {
        self.end
    }

    /// The top before the block was taken (its padding included, the block starts here).
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn prev_top(&self) -> usize {
        self.prev_top
    }

    /// Bytes the block holds of the stack, the padding that aligns its start included.
    #[inline]
    pub(crate) fn span(&self) -> u64 {
        (self.end - self.prev_top) as u64
    }
}

/// What a stream's stack has handed out, in a form that compares across ranks and processes: how
/// many blocks, where its top is, and a digest of every block's offset and end in order. Two
/// stacks with equal traces laid out the same blocks at the same offsets, which is what symmetric
/// memory (NCCL windows) asks of every rank. Made by [`Stream::layout_trace`](crate::Stream::layout_trace)
/// in builds with debug assertions; compared by [`check_symmetric`](crate::observe::check_symmetric).
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
/// let (a, b) = (Stream::new(&Device::private_host())?, Stream::new(&Device::private_host())?);
/// drop((BufferPool::new(&a).get_buffer::<f32>(8, 8)?, BufferPool::new(&b).get_buffer::<f32>(8, 8)?));
/// if let (Some(ta), Some(tb)) = (a.layout_trace(), b.layout_trace()) {
///     assert_eq!(ta, tb);
///     assert_eq!(ta.takes(), 1);
///     assert_eq!(gpu_pool::observe::LayoutTrace::from_bytes(ta.to_bytes()), ta); // to send to another process
/// }
/// # Ok::<(), PoolError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayoutTrace {
    takes: u64,
    top: u64,
    digest: u64,
}

/// FNV-1a's 64-bit offset basis and prime: a cheap digest that any change of order or offset
/// changes.
#[cfg(debug_assertions)]
const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
#[cfg(debug_assertions)]
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl LayoutTrace {
    /// Blocks the stack handed out since its stream got it.
    #[must_use]
    pub fn takes(&self) -> u64 {
        self.takes
    }

    /// The stack's top (bytes in use, padding included) when the trace was taken.
    #[must_use]
    pub fn top(&self) -> u64 {
        self.top
    }

    /// The digest of every block's offset and end, in the order they were taken.
    #[must_use]
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// The trace as 24 bytes (little-endian), to exchange between processes (an NCCL all-gather).
    #[must_use]
    pub fn to_bytes(&self) -> [u8; 24] {
        let mut out = [0; 24];
        for (chunk, word) in out
            .chunks_exact_mut(8)
            .zip([self.takes, self.top, self.digest])
        {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        out
    }

    /// A trace read back from [`to_bytes`](Self::to_bytes).
    #[must_use]
    pub fn from_bytes(bytes: [u8; 24]) -> LayoutTrace {
        let word = |i: usize| {
            let mut w = [0; 8];
            w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        LayoutTrace {
            takes: word(0),
            top: word(1),
            digest: word(2),
        }
    }
}

/// The part of a stack that another thread may touch: its top, its limit and, for a growable
/// stack, its mappings. Shared (`Arc`) with the stream's ledger, through which the device gives a
/// growable stack's idle memory back ([`give_back_idle`](Bounds::give_back_idle)) from whichever
/// thread ran out of memory.
///
/// Only the stream's thread moves the top; a take raises it without a lock. A give-back, under the
/// mapping lock, lowers the limit to where it will unmap and then reads the top; a take raises the
/// top and then reads the limit, each with a `SeqCst` fence between (a Dekker handshake): either
/// the give-back sees the raised top and unmaps nothing under it, or the take sees the lowered
/// limit, puts the top back and maps again under the lock. Growth, and a give-back, run under the
/// lock.
#[derive(Debug)]
pub(crate) struct Bounds {
    /// Bytes in use, padding included: raised by a take and lowered by a release, on the stream's
    /// thread alone; every store a release store, so a give-back that reads it also sees the work
    /// queued on the blocks released before.
    top: AtomicUsize,
    /// Where the memory a take may hand out ends: `size` for a fixed stack, the mapped end for a
    /// growable one, lowered for a moment by a give-back.
    limit: AtomicUsize,
    /// Bytes mapped: the size of a fixed stack; of a growable one, written under the lock and read
    /// by the stats without it.
    mapped: AtomicUsize,
    growth: Option<Mutex<Growth>>,
}

impl Bounds {
    fn new(limit: usize, growth: Option<Growth>) -> Bounds {
        Bounds {
            top: AtomicUsize::new(0),
            limit: AtomicUsize::new(limit),
            mapped: AtomicUsize::new(limit),
            growth: growth.map(Mutex::new),
        }
    }

    /// Whether memory is mapped as the stack grows.
    pub(crate) fn is_growable(&self) -> bool {
        self.growth.is_some()
    }

    /// Bytes of memory behind the stack: its size, or what a growable one has mapped.
    pub(crate) fn mapped(&self) -> usize {
        self.mapped.load(Relaxed)
    }
}

#[derive(Debug)]
pub(crate) struct Stack {
    pub(crate) index: usize,
    pub(crate) base: DevPtr,
    /// Bytes of the stack: fixed, or the reservation of a growable one.
    size: usize,
    bounds: Arc<Bounds>,
    /// Whether a take must publish its top to a give-back (`bounds.growth` is set): one test of a
    /// field at hand on the take.
    growable: bool,
    /// Alignment of a block's start for [`take`](Self::take) (the device's texture alignment, a
    /// power of two); [`take_aligned`](Self::take_aligned) asks its own.
    align: usize,
    /// Blocks released out of order, sorted by `end`, all below `top`.
    pending: RefCell<Vec<Block>>,
    /// Whether `pending` is non-empty, so the in-order path reads one flag.
    has_pending: Cell<bool>,
    /// Blocks taken and the digest of their offsets and ends: only with debug assertions, so
    /// release builds keep the take as it was.
    #[cfg(debug_assertions)]
    trace: Cell<(u64, u64)>,
}

/// How a release went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    InOrder,
    OutOfOrder,
}

impl Stack {
    /// `size` is at most `usize::MAX - max(align, MAX_ELEMENT_ALIGN)` (configs are far smaller:
    /// multiples of 4096), so bumps cannot wrap.
    pub(crate) fn new(index: usize, base: DevPtr, size: usize, align: usize) -> Stack {
        Stack::with_bounds(index, base, size, align, Bounds::new(size, None))
    }

    fn with_bounds(index: usize, base: DevPtr, size: usize, align: usize, bounds: Bounds) -> Stack {
        debug_assert!(align.is_power_of_two() && size <= usize::MAX - align.max(MAX_ELEMENT_ALIGN));
        Stack {
            index,
            base,
            size,
            growable: bounds.is_growable(),
            bounds: Arc::new(bounds),
            align,
            pending: RefCell::new(Vec::new()),
            has_pending: Cell::new(false),
            #[cfg(debug_assertions)]
            trace: Cell::new((0, FNV_BASIS)),
        }
    }

    /// What the stack has handed out so far; `None` in builds without debug assertions.
    pub(crate) fn layout_trace(&self) -> Option<LayoutTrace> {
        #[cfg(debug_assertions)]
        {
            let (takes, digest) = self.trace.get();
            Some(LayoutTrace {
                takes,
                top: self.top() as u64,
                digest,
            })
        }
        #[cfg(not(debug_assertions))]
        None
    }

    /// The part of the stack a give-back on another thread touches.
    pub(crate) fn bounds(&self) -> &Arc<Bounds> {
        &self.bounds
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The alignment of a block's start for [`take`](Self::take).
    #[cfg(feature = "cuda")]
    pub(crate) fn align(&self) -> usize {
        self.align
    }

    /// Whether memory is mapped as the stack grows.
    pub(crate) fn is_growable(&self) -> bool {
        self.growable
    }

    /// Bytes of memory behind the stack: its size, or what a growable one has mapped.
    pub(crate) fn mapped(&self) -> usize {
        self.bounds.mapped()
    }

    #[inline]
    pub(crate) fn top(&self) -> usize {
        // Written by this thread alone.
        self.bounds.top.load(Relaxed)
    }

    /// Bytes a request could still get (ignoring the alignment of its start).
    pub(crate) fn free_bytes(&self) -> usize {
        self.size - self.top()
    }

    /// Takes `bytes` (non-zero) from the top on the stack's own (texture) alignment: see
    /// [`take_aligned`](Self::take_aligned). What a CUDA graph capture's fence takes.
    #[cfg(any(test, feature = "cuda"))]
    #[inline]
    pub(crate) fn take(&self, bytes: usize) -> Option<(usize, Block)> {
        self.take_aligned(bytes, self.align)
    }

    /// Takes `bytes` (non-zero) from the top, starting on the next multiple of `align` (a power of
    /// two, at most `max(texture alignment, MAX_ELEMENT_ALIGN)`): the block's offset and the
    /// block, or `None` if they do not fit. The padding below the block belongs to it: releasing
    /// it returns the top to where it was.
    #[inline]
    pub(crate) fn take_aligned(&self, bytes: usize, align: usize) -> Option<(usize, Block)> {
        debug_assert!(align.is_power_of_two() && align <= self.align.max(MAX_ELEMENT_ALIGN));
        let bounds = &*self.bounds;
        let prev_top = bounds.top.load(Relaxed);
        let (offset, end) = Stack::place(prev_top, bytes, align)
            .filter(|&(_, end)| end <= bounds.limit.load(Relaxed))?;
        bounds.top.store(end, Ordering::Release);
        if self.growable {
            // The Dekker handshake with `Bounds::give_back_idle` on another thread: top raised,
            // fence, limit read. A give-back that lowered the limit below `end` may not have seen
            // the top: the block is not handed out, and the caller maps under the lock.
            fence(SeqCst);
            if end > bounds.limit.load(Relaxed) {
                bounds.top.store(prev_top, Ordering::Release);
                return None;
            }
        }
        #[cfg(debug_assertions)]
        {
            let (takes, digest) = self.trace.get();
            let digest = ((digest ^ offset as u64).wrapping_mul(FNV_PRIME) ^ end as u64)
                .wrapping_mul(FNV_PRIME);
            self.trace.set((takes + 1, digest));
        }
        Some((offset, Block { end, prev_top }))
    }

    /// Where a block of `bytes` taken with the top at `top` lies, starting on the next multiple of
    /// `align` (a power of two): its offset and its end, or `None` past `usize::MAX`. The one
    /// placement rule, of every stack and of the unlimited stack a stream's demand is measured on
    /// (`stream/sizing.rs`), so the two agree to the byte.
    #[inline(always)]
    pub(crate) fn place(top: usize, bytes: usize, align: usize) -> Option<(usize, usize)> {
        let offset = top.checked_add(align - 1)? & !(align - 1);
        Some((offset, offset.checked_add(bytes)?))
    }

    /// Lowers the top (a release store: a give-back that reads it sees the work queued before).
    #[inline]
    fn lower_top(&self, to: usize) {
        self.bounds.top.store(to, Ordering::Release);
    }

    /// Gives `block` back. Reclaims it at once if it is topmost, else once everything above it is
    /// released.
    #[inline]
    // By reference: the holder reads its block in place (copied out right after it was written,
    // it stalls store forwarding), and is itself consumed by the release.
    pub(crate) fn release(&self, block: &Block) -> Release {
        if block.end == self.top() {
            self.lower_top(block.prev_top);
            if self.has_pending.get() {
                self.reclaim_pending();
            }
            Release::InOrder
        } else {
            self.defer(block);
            Release::OutOfOrder
        }
    }

    /// [`grow_mapped`](Self::grow_mapped) with nothing to map: on a fixed stack, or under the
    /// mapping lock.
    #[cfg(feature = "cuda")]
    fn grow(&self, block: &mut Block, end: usize) -> bool {
        if block.end != self.top() || end > self.bounds.limit.load(Relaxed) {
            return false;
        }
        if end > block.end {
            block.end = end;
            self.bounds.top.store(end, Ordering::Release);
        }
        true
    }

    /// Shrinks `block`, the topmost block, so it ends at `end` (at least where its own bytes
    /// begin). `false`, and no change, if the block is not topmost or `end` is not inside it.
    #[cfg(feature = "cuda")]
    pub(crate) fn shrink(&self, block: &mut Block, end: usize) -> bool {
        if block.end != self.top() || end > block.end || end <= block.prev_top {
            return false;
        }
        block.end = end;
        self.lower_top(end);
        true
    }

    #[cold]
    fn defer(&self, block: &Block) {
        let mut pending = self.pending.borrow_mut();
        let at = pending.partition_point(|b| b.end < block.end);
        let waiting = Block {
            end: block.end,
            prev_top: block.prev_top,
        };
        pending.insert(at, waiting);
        self.has_pending.set(true);
    }

    #[cold]
    fn reclaim_pending(&self) {
        let mut pending = self.pending.borrow_mut();
        while let Some(last) = pending.pop_if(|b| b.end == self.top()) {
            self.lower_top(last.prev_top);
        }
        self.has_pending.set(!pending.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifo_returns_to_zero() {
        let s = Stack::new(0, 0, 4096, 512);
        let (a_at, a) = s.take(100).unwrap();
        let (b_at, b) = s.take(600).unwrap();
        assert_eq!((a_at, b_at, b.end), (0, 512, 1112));
        assert_eq!(s.release(&b), Release::InOrder);
        assert_eq!(s.release(&a), Release::InOrder);
        assert_eq!(s.top(), 0);
    }

    #[test]
    fn out_of_order_blocks_wait_for_the_blocks_above() {
        let s = Stack::new(0, 0, 8192, 512);
        let [a, b, c] = [
            s.take(10).unwrap().1,
            s.take(10).unwrap().1,
            s.take(10).unwrap().1,
        ];
        assert_eq!(s.release(&a), Release::OutOfOrder);
        assert_eq!(s.release(&b), Release::OutOfOrder);
        assert_eq!(s.top(), c.end, "live block c keeps everything below it");
        let (d_at, d) = s.take(10).unwrap();
        assert!(d_at >= c.end, "no reuse of a or b while c lives");
        assert_eq!(s.release(&d), Release::InOrder);
        assert_eq!(s.release(&c), Release::InOrder);
        assert_eq!(s.top(), 0);
    }

    #[test]
    fn blocks_pack_on_their_own_alignment() {
        let s = Stack::new(0, 0, 4096, 512);
        let rows: Vec<(usize, Block)> = (0..10).map(|_| s.take_aligned(64, 64).unwrap()).collect();
        let offsets: Vec<usize> = rows.iter().map(|r| r.0).collect();
        assert_eq!(offsets, (0..10).map(|i| i * 64).collect::<Vec<_>>());
        assert_eq!(
            s.top(),
            640,
            "as OpenCV: each block at the previous one's end"
        );
        let (image_at, image) = s.take(1024).unwrap();
        assert_eq!(
            (image_at, image.prev_top),
            (1024, 640),
            "2D: texture-aligned"
        );
        let (wide_at, wide) = s.take_aligned(64, 256).unwrap();
        assert_eq!(wide_at, 2048);
        let (odd_at, odd) = s.take_aligned(1, 1).unwrap();
        assert_eq!(odd_at, 2112, "alignment 1 starts at the top itself");
        assert_eq!(
            s.take_aligned(4096 - 2113 + 1, 1),
            None,
            "one byte too many"
        );
        for block in [odd, wide, image] {
            assert_eq!(s.release(&block), Release::InOrder);
        }
        for (_, row) in rows.into_iter().rev() {
            assert_eq!(s.release(&row), Release::InOrder);
        }
        assert_eq!(s.top(), 0);
    }

    #[test]
    fn full_stack_refuses() {
        let s = Stack::new(0, 0, 1024, 512);
        assert!(s.take(1025).is_none());
        let (_, a) = s.take(1024).unwrap();
        assert!(s.take(1).is_none());
        s.release(&a);
        assert!(s.take(1).is_some());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn only_the_topmost_block_grows_and_only_within_the_stack() {
        let s = Stack::new(0, 0, 4096, 512);
        let (_, mut a) = s.take(1).unwrap();
        assert!(s.grow(&mut a, 1000));
        assert_eq!((a.end(), s.top()), (1000, 1000));
        assert!(s.grow(&mut a, 10), "a smaller end leaves it as it is");
        assert_eq!(a.end(), 1000);
        assert!(!s.grow(&mut a, 4097), "past the stack");
        let (_, b) = s.take(1).unwrap();
        assert!(!s.grow(&mut a, 3000), "not topmost");
        assert_eq!(s.release(&b), Release::InOrder);
        assert_eq!(s.release(&a), Release::InOrder);
        assert_eq!(s.top(), 0);
    }
}
