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
use std::sync::atomic::Ordering::{self, Acquire, Relaxed, SeqCst};

use crate::base::counters::StreamCounters;
use crate::base::error::PoolError;
use crate::base::layout::MAX_ELEMENT_ALIGN;
use crate::base::sync::{self, AtomicUsize, Mutex, fence};
use crate::storage::Storage;
use crate::storage::backend::{DevPtr, RawStream};

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

/// What makes a stack growable: the stack is a reserved address range, and memory is mapped into
/// it in granules as the top rises past the mapped end (`Stack::grow_and_take`), unmapped on
/// demand (`Bounds::give_back_idle`) and when its stream goes (`Stack::unmap_all`).
#[derive(Debug)]
struct Growth {
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
