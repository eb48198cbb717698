//! Buffers: [`BufferPool`] hands them out, [`GpuMat`] owns one until it is dropped or released.

use std::fmt;
use std::marker::PhantomData;

use bytemuck::Pod;

use crate::allocator::GpuAllocator;
use crate::error::PoolError;
use crate::source::{CallSite, Source};
use crate::stream::{Lease, Stream};
use crate::view::{GpuView, GpuViewMut, Keeper, Window};

/// Hands out buffers from a stream's stack (OpenCV's `cv::cuda::BufferPool`).
///
/// ```
/// use gpu_pool::{BufferPool, Device, GpuRead, Source, Stream};
/// let stream = Stream::new(&Device::host())?;
/// let pool = BufferPool::new(&stream);
/// let image = pool.get_buffer::<[u8; 3]>(480, 640)?;    // 2D, pitched
/// let sums = pool.get_buffer_1d::<f32>(480)?;           // contiguous
/// assert_eq!(image.step(), 2048);                        // align_up(640 * 3, 512)
/// assert_eq!(image.source(), Source::Stack);
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct BufferPool<'s> {
    stream: &'s Stream,
}

impl<'s> BufferPool<'s> {
    /// The pool of `stream`'s stack.
    #[must_use]
    pub fn new(stream: &'s Stream) -> BufferPool<'s> {
        BufferPool { stream }
    }

    /// The stream buffers are taken for.
    #[must_use]
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }

    /// A `rows x cols` buffer. With more than one row and column it is pitched: its
    /// [`step`](crate::GpuRead::step) is `cols * size_of::<T>()` rounded up to the texture alignment. A single
    /// row or column is contiguous. No element is initialised by the pool.
    ///
    /// From the stack when it fits (no lock, no heap allocation, no driver call), else from the
    /// stream's fallback allocator.
    // Always inlined: returned through memory, the buffer's lease is stored in two halves and
    // reloaded whole by the caller, a store-forwarding stall that costs more than the rest of the
    // take (measured: 20 ns against 9 ns in a crate with the default 16 codegen units).
    ///
    /// The caller's line is the buffer's [`CallSite`]: errors, the sizing report and recordings
    /// name it.
    #[inline(always)]
    #[track_caller]
    pub fn get_buffer<T: Pod>(&self, rows: usize, cols: usize) -> Result<GpuMat<'s, T>, PoolError> {
        self.take_at(rows, cols, CallSite::here(""))
    }

    /// [`get_buffer`](Self::get_buffer) asked for at `site` (what `buffer!` calls, naming itself).
    #[inline(always)]
    pub(crate) fn take_at<T: Pod>(
        &self,
        rows: usize,
        cols: usize,
        site: CallSite,
    ) -> Result<GpuMat<'s, T>, PoolError> {
        self.stream.take::<T>(rows, cols, site).map(GpuMat::on)
    }

    /// A `rows x cols` buffer with no padding between its rows (OpenCV's `createContinuous`):
    /// its step is `cols * size_of::<T>()`, so it is lent to cuBLAS with a leading dimension of
    /// `cols` and flattens with `as_1d`. For GEMM operands, matrices of few columns and buffers
    /// handed to libraries that expect packed rows; [`get_buffer`](Self::get_buffer)'s padding
    /// is for 2D kernels that read image rows.
    ///
    /// ```
    /// use gpu_pool::{BufferPool, Device, GpuRead, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let pool = BufferPool::new(&stream);
    /// let logits = pool.get_buffer_packed::<f32>(256, 10)?;
    /// assert_eq!((logits.rows(), logits.cols(), logits.step()), (256, 10, 40)); // not 512
    /// assert!(logits.is_continuous());
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    #[inline(always)]
    #[track_caller]
    pub fn get_buffer_packed<T: Pod>(
        &self,
        rows: usize,
        cols: usize,
    ) -> Result<GpuMat<'s, T>, PoolError> {
        self.take_packed_at(rows, cols, CallSite::here(""))
    }

    /// [`get_buffer_packed`](Self::get_buffer_packed) asked for at `site`.
    #[inline(always)]
    pub(crate) fn take_packed_at<T: Pod>(
        &self,
        rows: usize,
        cols: usize,
        site: CallSite,
    ) -> Result<GpuMat<'s, T>, PoolError> {
        let len = crate::layout::packed_len::<T>(rows, cols)?;
        let lease = self.stream.take::<T>(1, len, site)?;
        Ok(GpuMat::on(lease.packed(rows, cols, size_of::<T>())))
    }

    /// A contiguous buffer of `len` elements (a `1 x len` [`GpuMat`]).
    #[inline(always)]
    #[track_caller]
    pub fn get_buffer_1d<T: Pod>(&self, len: usize) -> Result<GpuMat<'s, T>, PoolError> {
        self.get_buffer(1, len)
    }

    /// The allocator that serves this stream's buffers when the stack does not (OpenCV's
    /// `getAllocator`).
    #[must_use]
    pub fn allocator(&self) -> std::sync::Arc<dyn GpuAllocator> {
        self.stream.allocator()
    }
}

/// A 2D array of `T` in device memory, borrowed from a stream (OpenCV's `GpuMat`).
///
/// It knows its shape, its step (bytes between rows) and where its memory came from; it uploads,
/// downloads, fills and copies on its stream, and lends [`GpuView`]s for kernels. Dropping it gives
/// the memory back; [`release`](GpuMat::release) does the same and reports errors.
///
/// A buffer borrows its stream, so it cannot outlive it or move to another thread:
/// ```compile_fail
/// use gpu_pool::{BufferPool, Device, Stream};
/// let buf = {
///     let stream = Stream::new(&Device::host()).unwrap();
///     BufferPool::new(&stream).get_buffer_1d::<u8>(8).unwrap()
/// };
/// ```
#[must_use = "a buffer goes back to its pool when dropped: one never used is released at once"]
pub struct GpuMat<'s, T> {
    /// The memory and its shape, which go back to the stream when the buffer is dropped.
    lease: Lease<'s>,
    _elem: PhantomData<T>,
}

impl<'s, T: Pod> GpuMat<'s, T> {
    /// A buffer with memory of its own (`cuMemAllocPitch`/`cuMemAlloc`), not from the stack: for
    /// long-lived data such as inputs and outputs, which need not follow the stack's LIFO order.
    /// Its pitch is the driver's choice.
    #[track_caller]
    pub fn new(stream: &'s Stream, rows: usize, cols: usize) -> Result<GpuMat<'s, T>, PoolError> {
        let lease = stream.take_from_driver::<T>(rows, cols, CallSite::here(""))?;
        Ok(GpuMat::on(lease))
    }

    /// [`GpuMat::new`] with no padding between rows: see
    /// [`BufferPool::get_buffer_packed`].
    #[track_caller]
    pub fn new_packed(
        stream: &'s Stream,
        rows: usize,
        cols: usize,
    ) -> Result<GpuMat<'s, T>, PoolError> {
        let len = crate::layout::packed_len::<T>(rows, cols)?;
        let lease = stream.take_from_driver::<T>(1, len, CallSite::here(""))?;
        Ok(GpuMat::on(lease.packed(rows, cols, size_of::<T>())))
    }

    /// [`GpuMat::new`] filled from `data` (`rows * cols` elements, row-major).
    pub fn from_host(
        stream: &'s Stream,
        rows: usize,
        cols: usize,
        data: &[T],
    ) -> Result<GpuMat<'s, T>, PoolError> {
        let mut mat = GpuMat::new(stream, rows, cols)?;
        mat.whole_mut().upload(data)?;
        Ok(mat)
    }
}

impl<'s, T> GpuMat<'s, T> {
    /// The buffer of `lease`, which a take for `T` made.
    #[inline(always)]
    fn on(lease: Lease<'s>) -> GpuMat<'s, T> {
        GpuMat {
            lease,
            _elem: PhantomData,
        }
    }

    /// The address field kernel arguments point at.
    pub(crate) fn ptr_field(&self) -> &u64 {
        self.lease.ptr_field()
    }
}

impl<'s, T: Pod> GpuMat<'s, T> {
    /// Whether the rows follow each other with no padding.
    #[must_use]
    pub fn is_continuous(&self) -> bool {
        self.window().is_continuous::<T>()
    }

    /// Where the memory came from.
    #[must_use]
    pub fn source(&self) -> Source {
        self.lease.source()
    }

    /// The stream the buffer belongs to; its operations run there.
    #[must_use]
    pub fn stream(&self) -> &'s Stream {
        self.lease.stream()
    }

    /// Tells the pool that work queued on `user` (another stream of the same device) so far uses this
    /// buffer: when the buffer is released, its stream waits for that work before the memory can be
    /// handed out again (PyTorch's `record_stream`). Call it after queuing the last such work.
    /// Without it, memory is reused in the owning stream's order only.
    pub fn record_stream(&self, user: &Stream) -> Result<(), PoolError> {
        let stream = self.stream();
        if std::ptr::eq(user, stream) {
            return Ok(());
        }
        if user.device() != stream.device() {
            return Err(PoolError::DeviceMismatch {
                expected: stream.device().id(),
                actual: user.device().id(),
            });
        }
        stream.defer_wait_for(user)
    }

    fn window(&self) -> Window {
        Window {
            ptr: self.lease.ptr(),
            rows: self.lease.rows(),
            cols: self.lease.cols(),
            pitch: self.lease.pitch(),
            owns_gaps: true,
        }
    }

    /// A read-only view of the whole buffer: [`GpuRead::view`](crate::GpuRead::view).
    pub(crate) fn whole(&self) -> GpuView<'_, T> {
        GpuView::new(
            self.window(),
            self.stream().device().id(),
            Keeper::Stream(self.stream()),
        )
    }

    /// A writable view of the whole buffer: [`GpuWrite::view_mut`](crate::GpuWrite::view_mut).
    pub(crate) fn whole_mut(&mut self) -> GpuViewMut<'_, T> {
        GpuViewMut::new(
            self.window(),
            self.stream().device().id(),
            Keeper::Stream(self.stream()),
        )
    }
}

impl<T> GpuMat<'_, T> {
    /// Gives the memory back now and reports what went wrong: a driver error from the fallback's
    /// free, or, in strict mode, `PoolError::LifoViolation` (the memory is still reclaimed).
    pub fn release(self) -> Result<(), PoolError> {
        self.lease.release()
    }
}

impl<T> fmt::Debug for GpuMat<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuMat")
            .field("rows", &self.lease.rows())
            .field("cols", &self.lease.cols())
            .field("step", &self.lease.pitch())
            .field("ptr", &format_args!("{:#x}", self.lease.ptr()))
            .field("source", &self.lease.source())
            .field("stream", &self.lease.stream().id())
            .finish()
    }
}
