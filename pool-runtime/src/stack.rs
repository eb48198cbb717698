//! One stream's stack: a bump pointer over a slice of the device's stack memory.
//!
//! Taking is an aligned bump; releasing the topmost block moves the top back. A block released out of
//! order cannot be reclaimed yet (buffers above it are live), so it waits in `pending` until the
//! blocks above it are gone. That keeps every live block intact whatever order safe code releases in;
//! `pending` is touched, and may allocate, only on that violation path.

use std::cell::{Cell, RefCell};

use crate::backend::DevPtr;

/// A block of a stack, as its buffer remembers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// Offset one past the last byte.
    pub(crate) end: usize,
    /// The top before this block was taken: where the top returns when it is released.
    pub(crate) prev_top: usize,
}

#[derive(Debug)]
pub(crate) struct Stack {
    pub(crate) index: usize,
    pub(crate) base: DevPtr,
    size: usize,
    /// Alignment of each block's start (the device's texture alignment, a power of two).
    align: usize,
    top: Cell<usize>,
    /// Blocks released out of order, sorted by `end`, all below `top`.
    pending: RefCell<Vec<Block>>,
    /// Whether `pending` is non-empty, so the in-order path reads one flag.
    has_pending: Cell<bool>,
}

/// How a release went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    InOrder,
    OutOfOrder,
}

impl Stack {
    /// `size` is at most `usize::MAX - align` (configs are far smaller), so bumps cannot wrap.
    pub(crate) fn new(index: usize, base: DevPtr, size: usize, align: usize) -> Stack {
        debug_assert!(align.is_power_of_two() && size <= usize::MAX - align);
        Stack {
            index,
            base,
            size,
            align,
            top: Cell::new(0),
            pending: RefCell::new(Vec::new()),
            has_pending: Cell::new(false),
        }
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    #[inline]
    pub(crate) fn top(&self) -> usize {
        self.top.get()
    }

    /// Bytes a request could still get (ignoring the alignment of its start).
    pub(crate) fn free_bytes(&self) -> usize {
        self.size - self.top.get()
    }

    /// Takes `bytes` (non-zero) from the top: the block's offset and the block, or `None` if they do
    /// not fit.
    #[inline]
    pub(crate) fn take(&self, bytes: usize) -> Option<(usize, Block)> {
        let prev_top = self.top.get();
        // No overflow: prev_top <= size <= usize::MAX - align.
        let offset = (prev_top + self.align - 1) & !(self.align - 1);
        let end = offset.checked_add(bytes).filter(|&end| end <= self.size)?;
        self.top.set(end);
        Some((offset, Block { end, prev_top }))
    }

    /// Gives `block` back. Reclaims it at once if it is topmost, else once everything above it is
    /// released.
    #[inline]
    pub(crate) fn release(&self, block: &Block) -> Release {
        if block.end == self.top.get() {
            self.top.set(block.prev_top);
            if self.has_pending.get() {
                self.reclaim_pending();
            }
            Release::InOrder
        } else {
            self.defer(*block);
            Release::OutOfOrder
        }
    }

    #[cold]
    fn defer(&self, block: Block) {
        let mut pending = self.pending.borrow_mut();
        let at = pending.partition_point(|b| b.end < block.end);
        pending.insert(at, block);
        self.has_pending.set(true);
    }

    #[cold]
    fn reclaim_pending(&self) {
        let mut pending = self.pending.borrow_mut();
        while let Some(last) = pending.last().copied() {
            if last.end != self.top.get() {
                break;
            }
            self.top.set(last.prev_top);
            pending.pop();
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
    fn full_stack_refuses() {
        let s = Stack::new(0, 0, 1024, 512);
        assert!(s.take(1025).is_none());
        let (_, a) = s.take(1024).unwrap();
        assert!(s.take(1).is_none());
        s.release(&a);
        assert!(s.take(1).is_some());
    }
}
