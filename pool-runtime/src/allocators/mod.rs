//! The allocator API: what serves the buffers a stack does not (OpenCV's `GpuMat::Allocator`),
//! built on the device's storage, never on the device itself.
//!
//! The built-in fallbacks are [`DriverAllocator`], [`StreamOrderedAllocator`] and [`NoFallback`];
//! a user can give a stream an allocator of their own with
//! [`Stream::with_allocator`](crate::Stream::with_allocator).

pub(crate) mod caching;

use std::fmt;

use crate::base::counters::StreamCounters;
use crate::base::error::PoolError;
use crate::base::id::DeviceId;
use crate::base::layout::is_aligned;
use crate::base::source::FallbackReason;
use crate::storage::Storage;
use crate::storage::backend::{DevPtr, RawStream};

/// What a buffer request needs: what a [`GpuAllocator`] is asked for. Made by the pool only; later
/// versions may add fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocRequest {
    /// Rows of the buffer.
    pub rows: usize,
    /// Columns of the buffer.
    pub cols: usize,
    /// Bytes of one row's elements (`cols * size_of::<T>()`).
    pub width_bytes: usize,
    /// Whether the buffer is pitched (more than one row and column): a driver allocation for it is
    /// `cuMemAllocPitch`; a single row or column is contiguous.
    pub pitched: bool,
    /// Bytes the stack would have reserved (OpenCV's layout); enough for any pitch of its own
    /// choosing only if `pitch <= ` the stack pitch.
    pub bytes: usize,
    /// The pitch the stack would have used.
    pub pitch: usize,
    /// Why the stack did not serve it.
    pub reason: FallbackReason,
    /// Bytes left on the stream's stack (0 without one).
    pub stack_free: usize,
    /// Bytes of the stream's stack (0 without one).
    pub stack_size: usize,
    /// `align_of::<T>()` (at most [`MAX_ELEMENT_ALIGN`](crate::config::MAX_ELEMENT_ALIGN)): the address
    /// and the pitch returned must be multiples of it.
    pub align: usize,
}

/// Memory handed out by a [`GpuAllocator`], made with [`Allocation::new`] (later versions may add
/// fields, with defaults).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Allocation {
    /// Device address of row 0.
    pub ptr: u64,
    /// Bytes between rows; at least the request's `width_bytes`.
    pub pitch: usize,
}

impl Allocation {
    /// Memory at device address `ptr`, rows `pitch` bytes apart.
    #[must_use]
    pub const fn new(ptr: u64, pitch: usize) -> Allocation {
        Allocation { ptr, pitch }
    }
}

/// The counted driver operations an allocator may use, bound to one stream.
pub struct AllocContext<'a> {
    pub(crate) storage: &'a Storage,
    pub(crate) stream: &'a RawStream,
    pub(crate) stream_id: u64,
    pub(crate) counters: &'a StreamCounters,
}

impl AllocContext<'_> {
    /// The device allocations are made on.
    #[must_use]
    pub fn device_id(&self) -> DeviceId {
        self.storage.id
    }

    /// The stream the allocation is for ([`Stream::id`](crate::Stream::id)).
    #[must_use]
    pub fn stream_id(&self) -> u64 {
        self.stream_id
    }

    /// Whether [`alloc_async`](Self::alloc_async) is truly stream-ordered on this device.
    #[must_use]
    pub fn supports_stream_ordered(&self) -> bool {
        self.storage.backend.supports_stream_ordered()
    }

    /// `cuMemAlloc`.
    pub fn alloc(&self, bytes: usize) -> Result<u64, PoolError> {
        self.storage.alloc(bytes, Some(self.counters))
    }

    /// `cuMemAllocPitch`: the address and the pitch.
    pub fn alloc_pitch(&self, width: usize, rows: usize) -> Result<(u64, usize), PoolError> {
        self.storage.alloc_pitch(width, rows, Some(self.counters))
    }

    /// `cuMemFree`.
    ///
    /// # Safety
    /// `ptr` came from [`alloc`](Self::alloc) or [`alloc_pitch`](Self::alloc_pitch) on this device,
    /// is freed once, and is not used afterwards.
    pub unsafe fn free(&self, ptr: u64) -> Result<(), PoolError> {
        // SAFETY: forwarded to the caller.
        unsafe { self.storage.free(ptr, Some(self.counters)) }
    }

    /// `cuMemAllocFromPoolAsync` on the context's stream, from a memory pool of our own with its
    /// release threshold raised, not the device's default pool (`cuMemAlloc` where the device has
    /// no memory pools).
    pub fn alloc_async(&self, bytes: usize) -> Result<u64, PoolError> {
        self.storage
            .alloc_async(bytes, self.stream, Some(self.counters))
    }

    /// `cuMemFreeAsync` on the context's stream.
    ///
    /// # Safety
    /// `ptr` came from [`alloc_async`](Self::alloc_async) on this device, is freed once, and every
    /// use of it is ordered before this call on the context's stream.
    pub unsafe fn free_async(&self, ptr: u64) -> Result<(), PoolError> {
        // SAFETY: forwarded to the caller.
        unsafe {
            self.storage
                .free_async(ptr, self.stream, Some(self.counters))
        }
    }
}

/// An allocator for buffers the stack does not serve.
///
/// # Safety
/// An implementation promises that every `Ok` [`Allocation`] of [`allocate`](Self::allocate) is device
/// memory of the context's device, exclusively owned by the buffer until `deallocate`, with room for
/// `request.rows` rows of `request.width_bytes` bytes at the returned pitch. Safe code writes through
/// it, so a wrong answer is undefined behaviour. (A null address, a pitch below the row width, or an
/// address or pitch that is no multiple of `request.align` is caught and refused with an error.)
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use gpu_pool::{alloc::{AllocContext, AllocRequest, Allocation, GpuAllocator}, compat::opencv::BufferPool, Device, PoolError, Stream};
///
/// /// Plain driver allocations, counted.
/// #[derive(Debug, Default)]
/// struct Counting(AtomicUsize);
///
/// // SAFETY: memory comes from `ctx.alloc` with the size the request needs, freed once.
/// unsafe impl GpuAllocator for Counting {
///     fn allocate(&self, ctx: &AllocContext<'_>, req: &AllocRequest) -> Result<Allocation, PoolError> {
///         self.0.fetch_add(1, Ordering::Relaxed);
///         Ok(Allocation::new(ctx.alloc(req.bytes)?, req.pitch))
///     }
///     unsafe fn deallocate(&self, ctx: &AllocContext<'_>, a: Allocation) -> Result<(), PoolError> {
///         // SAFETY: `a` came from `allocate` above, which used `ctx.alloc`.
///         unsafe { ctx.free(a.ptr) }
///     }
/// }
///
/// let counting = Arc::new(Counting::default());
/// let stream = Stream::with_allocator(&Device::host(), counting.clone())?;
/// let buf = BufferPool::new(&stream).get_buffer::<f32>(8, 8)?;
/// assert_eq!(counting.0.load(Ordering::Relaxed), 1);
/// # Ok::<(), PoolError>(())
/// ```
pub unsafe trait GpuAllocator: Send + Sync + fmt::Debug {
    /// Allocates memory for `request`.
    fn allocate(
        &self,
        ctx: &AllocContext<'_>,
        request: &AllocRequest,
    ) -> Result<Allocation, PoolError>;

    /// Frees an allocation.
    ///
    /// # Safety
    /// `allocation` came from `allocate` of this allocator on the same device and stream, and is
    /// deallocated once; work on the stream that uses it has been enqueued before this call.
    unsafe fn deallocate(
        &self,
        ctx: &AllocContext<'_>,
        allocation: Allocation,
    ) -> Result<(), PoolError>;
}

/// OpenCV's `DefaultAllocator`: `cuMemAllocPitch` for 2D requests, `cuMemAlloc` for a row or a
/// column, and a synchronizing `cuMemFree`.
#[derive(Clone, Copy, Debug, Default)]
pub struct DriverAllocator;

// SAFETY: both allocation calls return fresh driver memory of at least the requested shape.
unsafe impl GpuAllocator for DriverAllocator {
    fn allocate(
        &self,
        ctx: &AllocContext<'_>,
        req: &AllocRequest,
    ) -> Result<Allocation, PoolError> {
        if req.pitched {
            let (ptr, pitch) = ctx.alloc_pitch(req.width_bytes, req.rows)?;
            Ok(Allocation { ptr, pitch })
        } else {
            Ok(Allocation {
                ptr: ctx.alloc(req.bytes)?,
                pitch: req.pitch,
            })
        }
    }

    unsafe fn deallocate(&self, ctx: &AllocContext<'_>, a: Allocation) -> Result<(), PoolError> {
        // SAFETY: `a` came from `allocate`, so from `alloc` or `alloc_pitch`; freed once per contract.
        unsafe { ctx.free(a.ptr) }
    }
}

/// `cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on the buffer's stream, from a memory pool of our
/// own whose release threshold is raised: no device synchronization, and freed memory stays in the
/// pool across synchronizations. Falls back to [`DriverAllocator`] on devices without
/// stream-ordered allocation.
#[derive(Clone, Copy, Debug, Default)]
pub struct StreamOrderedAllocator;

// SAFETY: as `DriverAllocator`; async allocations hold the stack layout's `bytes` at its `pitch`.
unsafe impl GpuAllocator for StreamOrderedAllocator {
    fn allocate(
        &self,
        ctx: &AllocContext<'_>,
        req: &AllocRequest,
    ) -> Result<Allocation, PoolError> {
        if !ctx.supports_stream_ordered() {
            return DriverAllocator.allocate(ctx, req);
        }
        Ok(Allocation {
            ptr: ctx.alloc_async(req.bytes)?,
            pitch: req.pitch,
        })
    }

    unsafe fn deallocate(&self, ctx: &AllocContext<'_>, a: Allocation) -> Result<(), PoolError> {
        if !ctx.supports_stream_ordered() {
            // SAFETY: forwarded; `allocate` used the driver allocator too.
            return unsafe { DriverAllocator.deallocate(ctx, a) };
        }
        // SAFETY: `a` came from `alloc_async` on this stream; the contract orders its uses before.
        unsafe { ctx.free_async(a.ptr) }
    }
}

/// The strict fallback: every request the stack cannot serve is `PoolError::StackExhausted`.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoFallback;

// SAFETY: never returns an allocation.
unsafe impl GpuAllocator for NoFallback {
    fn allocate(
        &self,
        ctx: &AllocContext<'_>,
        req: &AllocRequest,
    ) -> Result<Allocation, PoolError> {
        Err(PoolError::StackExhausted {
            device: ctx.device_id(),
            requested: req.bytes,
            available: req.stack_free,
            stack_size: req.stack_size,
            reason: req.reason,
            // The stream attaches the request as the error leaves the take.
            context: None,
        })
    }

    unsafe fn deallocate(&self, _: &AllocContext<'_>, _: Allocation) -> Result<(), PoolError> {
        Ok(())
    }
}

/// Checks an allocator's answer against the request, so that a buggy allocator yields an error
/// instead of a buffer whose rows overlap.
pub(crate) fn validate(
    a: &Allocation,
    req: &AllocRequest,
    device: DeviceId,
) -> Result<DevPtr, PoolError> {
    if a.ptr == 0 || a.pitch < req.width_bytes || !is_aligned(a.ptr, a.pitch, req.align) {
        return Err(PoolError::AllocatorContract {
            reason: format!(
                "the stream's allocator on {device} returned {a:?} for a request of {} bytes per row \
                 aligned to {}; an allocator must return a non-null address and a pitch of at least \
                 the row width, both multiples of the alignment",
                req.width_bytes, req.align
            ),
            context: None,
        });
    }
    Ok(a.ptr)
}
