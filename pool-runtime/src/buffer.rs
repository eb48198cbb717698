//! Buffers: [`BufferPool`] hands them out, [`GpuMat`] owns one until it is dropped or released.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;

use bytemuck::Pod;

use crate::allocator::GpuAllocator;
use crate::backend::Region;
use crate::error::PoolError;
use crate::source::{CallSite, Source};
use crate::stream::{Lease, Stream};
use crate::view::{CudaOrder, GpuView, GpuViewMut, Window};

/// Hands out buffers from a stream's stack (OpenCV's `cv::cuda::BufferPool`).
///
/// ```
/// use gpu_pool_runtime::{BufferPool, Device, Source, Stream};
/// let stream = Stream::new(&Device::host())?;
/// let pool = BufferPool::new(&stream);
/// let image = pool.get_buffer::<[u8; 3]>(480, 640)?;    // 2D, pitched
/// let sums = pool.get_buffer_1d::<f32>(480)?;           // contiguous
/// assert_eq!(image.step(), 2048);                        // align_up(640 * 3, 512)
/// assert_eq!(image.source(), Source::Stack);
/// # Ok::<(), gpu_pool_runtime::PoolError>(())
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
    /// [`step`](GpuMat::step) is `cols * size_of::<T>()` rounded up to the texture alignment. A single
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
/// use gpu_pool_runtime::{BufferPool, Device, Stream};
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

    /// [`GpuMat::new`] filled from `data` (`rows * cols` elements, row-major).
    pub fn from_host(
        stream: &'s Stream,
        rows: usize,
        cols: usize,
        data: &[T],
    ) -> Result<GpuMat<'s, T>, PoolError> {
        let mut mat = GpuMat::new(stream, rows, cols)?;
        mat.upload(data)?;
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
    #[cfg(feature = "cuda")]
    pub(crate) fn ptr_field(&self) -> &u64 {
        self.lease.ptr_field()
    }
}

impl<'s, T: Pod> GpuMat<'s, T> {
    /// Rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.lease.rows()
    }

    /// Columns.
    #[must_use]
    pub fn cols(&self) -> usize {
        self.lease.cols()
    }

    /// Elements (`rows * cols`).
    #[must_use]
    pub fn len(&self) -> usize {
        // Cannot wrap: every buffer's layout checked `rows * cols`, zero-sized elements included.
        self.lease.rows() * self.lease.cols()
    }

    /// Whether it has no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes from the start of one row to the next.
    #[must_use]
    pub fn step(&self) -> usize {
        self.lease.pitch()
    }

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

    /// The device address of row 0 (0 for an empty buffer).
    #[must_use]
    pub fn device_ptr(&self) -> u64 {
        self.lease.ptr()
    }

    fn region(&self) -> Region {
        Region {
            ptr: self.lease.ptr(),
            pitch: self.lease.pitch(),
            width: self.lease.cols() * size_of::<T>(),
            rows: self.lease.rows(),
        }
    }

    fn check_len(&self, actual: usize) -> Result<(), PoolError> {
        if actual == self.len() {
            Ok(())
        } else {
            Err(PoolError::ShapeMismatch {
                expected: self.len(),
                actual,
            })
        }
    }

    /// Copies `data` (`rows * cols` elements, row-major) into the buffer, on its stream, and waits
    /// until `data` has been read: `data` may be changed or freed as soon as this returns, even if
    /// it is page-locked memory (such as [`MixMemory::cpu`](crate::MixMemory::cpu)'s), which the
    /// driver copies asynchronously. For uploads that overlap other work, use
    /// [`MixMemory::copy_to_gpu_async`](crate::MixMemory::copy_to_gpu_async), which tracks the copy.
    pub fn upload(&mut self, data: &[T]) -> Result<(), PoolError> {
        self.check_len(data.len())?;
        if self.is_empty() || size_of::<T>() == 0 {
            return Ok(());
        }
        // SAFETY: the region is this buffer's live memory (its shape is what was taken), which
        // `&mut self` keeps from other writes; `data` holds its `rows` rows back to back.
        unsafe {
            self.stream()
                .upload(self.region(), bytemuck::cast_slice(data))
        }
    }

    /// Copies the buffer into `out` (`rows * cols` elements, row-major) and waits for the copy.
    pub fn download(&self, out: &mut [T]) -> Result<(), PoolError> {
        self.check_len(out.len())?;
        if self.is_empty() || size_of::<T>() == 0 {
            return Ok(());
        }
        // SAFETY: as in `upload`; `out` has room for every row.
        unsafe {
            self.stream()
                .download(self.region(), bytemuck::cast_slice_mut(out))
        }
    }

    /// The buffer's elements, row-major, in a new `Vec`.
    pub fn to_vec(&self) -> Result<Vec<T>, PoolError> {
        let mut out = vec![T::zeroed(); self.len()];
        self.download(&mut out)?;
        Ok(out)
    }

    /// Sets every element to `value`, on the buffer's stream (OpenCV's `setTo`).
    pub fn set_to(&mut self, value: T) -> Result<(), PoolError> {
        if self.is_empty() || size_of::<T>() == 0 {
            return Ok(());
        }
        // SAFETY: the region is this buffer's live memory; the pattern is one element, which
        // divides the row width.
        unsafe {
            self.stream()
                .fill(self.region(), bytemuck::bytes_of(&value))
        }
    }

    /// Copies `src` (same shape, same device) into this buffer, on this buffer's stream.
    ///
    /// When `src` belongs to another stream, the copy waits for the work queued on `src`'s stream
    /// so far (so it reads what that work wrote), and `src`'s memory is not reused by its stream
    /// until the copy is done (as after [`record_stream`](Self::record_stream)). Neither stream
    /// blocks the host.
    pub fn copy_from(&mut self, src: &GpuMat<'_, T>) -> Result<(), PoolError> {
        let (stream, src_stream) = (self.stream(), src.stream());
        if src_stream.device() != stream.device() {
            return Err(PoolError::DeviceMismatch {
                expected: stream.device().id(),
                actual: src_stream.device().id(),
            });
        }
        if (src.lease.rows(), src.lease.cols()) != (self.lease.rows(), self.lease.cols()) {
            return Err(PoolError::DimensionMismatch {
                dst: (self.lease.rows(), self.lease.cols()),
                src: (src.lease.rows(), src.lease.cols()),
            });
        }
        if self.is_empty() || size_of::<T>() == 0 {
            return Ok(());
        }
        // SAFETY: both regions are live buffers of this device, of one shape; `&mut self` and
        // `&src` cannot be the same buffer, and live buffers never overlap.
        unsafe { stream.copy(self.region(), src.region(), src_stream) }
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

    #[cfg(feature = "cuda")]
    fn cuda_order(&self) -> CudaOrder<'_> {
        let stream = self.stream();
        stream.cuda_stream().map(|_| stream)
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda_order(&self) -> CudaOrder<'_> {
        PhantomData
    }

    /// A read-only view for kernels.
    pub fn view(&self) -> GpuView<'_, T> {
        GpuView::new(
            self.window(),
            self.stream().device().id(),
            self.cuda_order(),
        )
    }

    /// A writable view for kernels.
    pub fn view_mut(&mut self) -> GpuViewMut<'_, T> {
        GpuViewMut::new(
            self.window(),
            self.stream().device().id(),
            self.cuda_order(),
        )
    }

    /// The region `rows x cols` (OpenCV's ROI): a view with this buffer's step, borrowing it.
    /// `PoolError::OutOfBounds` for a range past the buffer's edge (or one that ends before it
    /// starts).
    pub fn roi(&self, rows: Range<usize>, cols: Range<usize>) -> Result<GpuView<'_, T>, PoolError> {
        self.view().roi(rows, cols)
    }

    /// The writable region `rows x cols`, with this buffer's step.
    pub fn roi_mut(
        &mut self,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<GpuViewMut<'_, T>, PoolError> {
        let window = self.window().region::<T>(rows, cols)?;
        Ok(GpuViewMut::new(
            window,
            self.stream().device().id(),
            self.cuda_order(),
        ))
    }

    /// Rows `rows`, every column (OpenCV's `rowRange`).
    pub fn row_range(&self, rows: Range<usize>) -> Result<GpuView<'_, T>, PoolError> {
        self.view().row_range(rows)
    }

    /// Writable rows `rows`, every column.
    pub fn row_range_mut(&mut self, rows: Range<usize>) -> Result<GpuViewMut<'_, T>, PoolError> {
        self.roi_mut(rows, 0..self.lease.cols())
    }

    /// All elements as one contiguous row, for a buffer whose rows have no padding between them
    /// ([`is_continuous`](Self::is_continuous)); `PoolError::NotContinuous` otherwise.
    pub fn as_1d(&self) -> Result<GpuView<'_, T>, PoolError> {
        self.view().as_1d()
    }

    /// All elements as one writable contiguous row; `PoolError::NotContinuous` for padded rows.
    pub fn as_1d_mut(&mut self) -> Result<GpuViewMut<'_, T>, PoolError> {
        let window = self.window().flat::<T>()?;
        Ok(GpuViewMut::new(
            window,
            self.stream().device().id(),
            self.cuda_order(),
        ))
    }

    /// The rows as host slices, on the host backend (where device memory is host memory): the way
    /// CPU twins of kernels read buffers. `PoolError::Unsupported` on a GPU.
    pub fn host_rows(&self) -> Result<impl Iterator<Item = &[T]> + '_, PoolError> {
        self.view().host_rows()
    }

    /// Calls `f` with each row as a mutable host slice, on the host backend.
    pub fn for_each_host_row_mut(
        &mut self,
        f: impl FnMut(usize, &mut [T]),
    ) -> Result<(), PoolError> {
        self.view_mut().for_each_host_row_mut(f)
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
