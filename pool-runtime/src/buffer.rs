//! Buffers: [`BufferPool`] hands them out, [`GpuMat`] owns one until it is dropped or released.

use std::fmt;
use std::marker::PhantomData;

use bytemuck::Pod;

use crate::backend::{DevPtr, Region};
use crate::error::{DeviceId, PoolError};
use crate::fallback::GpuAllocator;
use crate::layout::Layout;
use crate::stream::{Origin, Source, Stream};

/// Hands out buffers from a stream's stack (OpenCV's `cv::cuda::BufferPool`).
///
/// ```
/// use pool_runtime::{BufferPool, Device, Source, Stream};
/// let stream = Stream::new(&Device::host())?;
/// let pool = BufferPool::new(&stream);
/// let image = pool.get_buffer::<[u8; 3]>(480, 640)?;    // 2D, pitched
/// let sums = pool.get_buffer_1d::<f32>(480)?;           // contiguous
/// assert_eq!(image.step(), 2048);                        // align_up(640 * 3, 512)
/// assert_eq!(image.source(), Source::Stack);
/// # Ok::<(), pool_runtime::PoolError>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct BufferPool<'s> {
    stream: &'s Stream,
}

impl<'s> BufferPool<'s> {
    /// The pool of `stream`'s stack.
    pub fn new(stream: &'s Stream) -> BufferPool<'s> {
        BufferPool { stream }
    }

    /// The stream buffers are taken for.
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }

    /// A `rows x cols` buffer. With more than one row and column it is pitched: its
    /// [`step`](GpuMat::step) is `cols * size_of::<T>()` rounded up to the texture alignment. A single
    /// row or column is contiguous. No element is initialised by the pool.
    ///
    /// From the stack when it fits (no lock, no heap allocation, no driver call), else from the
    /// stream's fallback allocator.
    // Always inlined: returned through memory, the buffer's origin is stored in two halves and
    // reloaded whole by the caller, a store-forwarding stall that costs more than the rest of the
    // take (measured: 20 ns against 9 ns in a crate with the default 16 codegen units).
    #[inline(always)]
    pub fn get_buffer<T: Pod>(&self, rows: usize, cols: usize) -> Result<GpuMat<'s, T>, PoolError> {
        let layout = Layout::of::<T>(rows, cols, self.stream.texture_alignment)?;
        let (ptr, pitch, origin) = self.stream.take(&layout)?;
        Ok(GpuMat {
            ptr,
            rows,
            cols,
            pitch,
            origin,
            stream: self.stream,
            _elem: PhantomData,
        })
    }

    /// A contiguous buffer of `len` elements (a `1 x len` [`GpuMat`]).
    #[inline(always)]
    pub fn get_buffer_1d<T: Pod>(&self, len: usize) -> Result<GpuMat<'s, T>, PoolError> {
        self.get_buffer(1, len)
    }

    /// The allocator that serves this stream's buffers when the stack does not (OpenCV's
    /// `getAllocator`).
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
/// use pool_runtime::{BufferPool, Device, Stream};
/// let buf = {
///     let stream = Stream::new(&Device::host()).unwrap();
///     BufferPool::new(&stream).get_buffer_1d::<u8>(8).unwrap()
/// };
/// ```
pub struct GpuMat<'s, T> {
    pub(crate) ptr: DevPtr,
    rows: usize,
    cols: usize,
    pitch: usize,
    origin: Origin,
    stream: &'s Stream,
    _elem: PhantomData<T>,
}

impl<'s, T: Pod> GpuMat<'s, T> {
    /// A buffer with memory of its own (`cuMemAllocPitch`/`cuMemAlloc`), not from the stack: for
    /// long-lived data such as inputs and outputs, which need not follow the stack's LIFO order.
    /// Its pitch is the driver's choice.
    pub fn new(stream: &'s Stream, rows: usize, cols: usize) -> Result<GpuMat<'s, T>, PoolError> {
        let layout = Layout::of::<T>(rows, cols, stream.device().texture_alignment())?;
        let (ptr, pitch, origin) = if layout.is_empty() {
            (0, layout.pitch, Origin::Empty)
        } else {
            stream.take_from_driver(&layout)?
        };
        Ok(GpuMat {
            ptr,
            rows,
            cols,
            pitch,
            origin,
            stream,
            _elem: PhantomData,
        })
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

impl<'s, T: Pod> GpuMat<'s, T> {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Elements (`rows * cols`).
    pub fn len(&self) -> usize {
        // Cannot wrap: every buffer's layout checked `rows * cols`, zero-sized elements included.
        self.rows * self.cols
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes from the start of one row to the next.
    pub fn step(&self) -> usize {
        self.pitch
    }

    /// Whether the rows follow each other with no padding.
    pub fn is_continuous(&self) -> bool {
        self.rows <= 1 || self.pitch == self.cols * size_of::<T>()
    }

    /// Where the memory came from.
    pub fn source(&self) -> Source {
        self.origin.source()
    }

    /// The stream the buffer belongs to; its operations run there.
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }

    /// The device address of row 0 (0 for an empty buffer).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    fn region(&self) -> Region {
        Region {
            ptr: self.ptr,
            pitch: self.pitch,
            width: self.cols * size_of::<T>(),
            rows: self.rows,
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
        let region = self.region();
        // SAFETY: `region` is this buffer's live memory (its shape is what was allocated), and
        // `data` holds `rows` rows of `width` bytes back to back; it stays borrowed until the
        // synchronize below has seen the copy finish.
        unsafe {
            self.backend().upload(
                region,
                bytemuck::cast_slice(data),
                region.width,
                &self.stream.raw,
            )
        }?;
        // `data` is borrowed only for this call. From pageable memory the driver returns once it
        // has staged the bytes, but from page-locked memory the copy is still in flight.
        self.stream.synchronize()
    }

    /// Copies the buffer into `out` (`rows * cols` elements, row-major) and waits for the copy.
    pub fn download(&self, out: &mut [T]) -> Result<(), PoolError> {
        self.check_len(out.len())?;
        if self.is_empty() || size_of::<T>() == 0 {
            return Ok(());
        }
        let region = self.region();
        // SAFETY: as in `upload`; `out` has room for every row.
        unsafe {
            self.backend().download(
                region,
                bytemuck::cast_slice_mut(out),
                region.width,
                &self.stream.raw,
            )
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
        let region = self.region();
        // SAFETY: `region` is this buffer's live memory; the pattern is one element, which divides
        // the row width.
        unsafe {
            self.backend()
                .fill(region, bytemuck::bytes_of(&value), &self.stream.raw)
        }
    }

    /// Copies `src` (same shape, same device) into this buffer, on this buffer's stream.
    ///
    /// When `src` belongs to another stream, the copy waits for the work queued on `src`'s stream
    /// so far (so it reads what that work wrote), and `src`'s memory is not reused by its stream
    /// until the copy is done (as after [`record_stream`](Self::record_stream)). Neither stream
    /// blocks the host.
    pub fn copy_from(&mut self, src: &GpuMat<'_, T>) -> Result<(), PoolError> {
        if src.stream.device() != self.stream.device() {
            return Err(PoolError::DeviceMismatch {
                expected: self.stream.device().id(),
                actual: src.stream.device().id(),
            });
        }
        if (src.rows, src.cols) != (self.rows, self.cols) {
            return Err(PoolError::DimensionMismatch {
                dst: (self.rows, self.cols),
                src: (src.rows, src.cols),
            });
        }
        if self.is_empty() || size_of::<T>() == 0 {
            return Ok(());
        }
        let cross_stream = !std::ptr::eq(src.stream, self.stream);
        if cross_stream && let Some(written) = self.backend().record_event(&src.stream.raw)? {
            self.backend().wait_event(&self.stream.raw, written)?;
        }
        // SAFETY: both regions are live buffers of this device; `&mut self` and `&src` cannot be
        // the same buffer, and live buffers never overlap.
        unsafe {
            self.backend()
                .copy(self.region(), src.region(), &self.stream.raw)
        }?;
        if cross_stream {
            src.stream.defer_wait_for(self.stream)?;
        }
        Ok(())
    }

    /// Tells the pool that work queued on `user` (another stream of the same device) so far uses this
    /// buffer: when the buffer is released, its stream waits for that work before the memory can be
    /// handed out again (PyTorch's `record_stream`). Call it after queuing the last such work.
    /// Without it, memory is reused in the owning stream's order only.
    pub fn record_stream(&self, user: &Stream) -> Result<(), PoolError> {
        if std::ptr::eq(user, self.stream) {
            return Ok(());
        }
        if user.device() != self.stream.device() {
            return Err(PoolError::DeviceMismatch {
                expected: self.stream.device().id(),
                actual: user.device().id(),
            });
        }
        self.stream.defer_wait_for(user)
    }

    /// A read-only view for kernels.
    pub fn view(&self) -> GpuView<'_, T> {
        GpuView {
            ptr: self.ptr,
            rows: self.rows,
            cols: self.cols,
            pitch: self.pitch,
            device: self.stream.device().id(),
            _borrow: PhantomData,
        }
    }

    /// A writable view for kernels.
    pub fn view_mut(&mut self) -> GpuViewMut<'_, T> {
        GpuViewMut {
            ptr: self.ptr,
            rows: self.rows,
            cols: self.cols,
            pitch: self.pitch,
            device: self.stream.device().id(),
            _borrow: PhantomData,
        }
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

    fn backend(&self) -> &dyn crate::backend::Backend {
        &*self.stream.device().inner.backend
    }
}

impl<T> GpuMat<'_, T> {
    /// Gives the memory back now and reports what went wrong: a driver error from the fallback's
    /// free, or, in strict mode, `PoolError::LifoViolation` (the memory is still reclaimed).
    pub fn release(self) -> Result<(), PoolError> {
        // `Drop` must not run after this: the memory is given back here, once.
        let mut this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `origin` came from `take` on `stream` when this buffer was made; this buffer is
        // never dropped, so it is given back once. Its work was queued on its own stream.
        let released = unsafe { this.stream.give_back(this.ptr, &this.origin) };
        // The origin still owns the heap record of a fallback buffer, which no `Drop` frees here
        // (the fuzzer's leak sanitizer found it leaking).
        drop(std::mem::replace(&mut this.origin, Origin::Empty));
        released
    }
}

impl<T> Drop for GpuMat<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: as in `release`: drop runs once, and `release` forgets the buffer.
        if let Err(e) = unsafe { self.stream.give_back(self.ptr, &self.origin) } {
            tracing::error!(error = %e, "releasing a buffer failed");
        }
    }
}

impl<T> fmt::Debug for GpuMat<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuMat")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("step", &self.pitch)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("source", &self.origin.source())
            .field("stream", &self.stream.id())
            .finish()
    }
}

/// A read-only view of a [`GpuMat`], for kernel arguments: the address, shape and step, valid while
/// the buffer is borrowed. On the host backend it also reads rows as slices, for CPU twins of
/// kernels.
#[derive(Clone, Copy, Debug)]
pub struct GpuView<'a, T> {
    pub(crate) ptr: DevPtr,
    rows: usize,
    cols: usize,
    pitch: usize,
    device: DeviceId,
    _borrow: PhantomData<&'a T>,
}

/// A writable view of a [`GpuMat`], for kernel arguments and CPU twins.
#[derive(Debug)]
pub struct GpuViewMut<'a, T> {
    pub(crate) ptr: DevPtr,
    rows: usize,
    cols: usize,
    pitch: usize,
    device: DeviceId,
    _borrow: PhantomData<&'a mut T>,
}

fn check_host(device: DeviceId) -> Result<(), PoolError> {
    match device {
        DeviceId::Host(_) => Ok(()),
        DeviceId::Cuda(_) => Err(PoolError::Unsupported {
            device,
            what: "host access to device memory",
        }),
    }
}

impl<'a, T: Pod> GpuView<'a, T> {
    /// The rows as host slices, on the host backend; `PoolError::Unsupported` on a GPU.
    pub fn host_rows(self) -> Result<impl Iterator<Item = &'a [T]>, PoolError> {
        check_host(self.device)?;
        Ok((0..self.rows).map(move |r| {
            if self.ptr == 0 {
                // An empty buffer has no address, and a slice may not be built on a null one,
                // even an empty slice (debug builds' UB check caught it).
                return &[][..];
            }
            // SAFETY: on the host backend the address is host memory of a buffer borrowed for 'a;
            // row `r` holds `cols` initialised (zeroed or written) `T`s. It is aligned for `T`:
            // `align_of::<T>()` is at most MAX_ELEMENT_ALIGN (checked by `Layout::of`), every
            // buffer's address is a multiple of it (stack blocks and driver allocations are
            // 512-aligned on the host, fallback allocations are checked by `validate`), and so is
            // the pitch (a multiple of the texture alignment, of `size_of::<T>()`, or checked).
            // The shared borrow keeps writers out.
            unsafe {
                std::slice::from_raw_parts(
                    (self.ptr as usize + r * self.pitch) as *const T,
                    self.cols,
                )
            }
        }))
    }
}

impl<T: Pod> GpuViewMut<'_, T> {
    /// Calls `f` with each row as a mutable host slice, on the host backend; `PoolError::Unsupported`
    /// on a GPU.
    pub fn for_each_host_row_mut(
        &mut self,
        mut f: impl FnMut(usize, &mut [T]),
    ) -> Result<(), PoolError> {
        check_host(self.device)?;
        if self.ptr == 0 {
            return Ok(());
        }
        for r in 0..self.rows {
            // SAFETY: as in `GpuView::host_rows` (address, pitch and alignment), and the view's
            // exclusive borrow of the buffer makes the row ours alone; rows do not overlap since the
            // pitch is at least the row width.
            let row = unsafe {
                std::slice::from_raw_parts_mut(
                    (self.ptr as usize + r * self.pitch) as *mut T,
                    self.cols,
                )
            };
            f(r, row);
        }
        Ok(())
    }
}

macro_rules! view_accessors {
    ($view:ident) => {
        impl<T> $view<'_, T> {
            /// A one-row view of `len` elements at `ptr`, memory the caller keeps borrowed for the
            /// view's lifetime and that is aligned for `T`.
            pub(crate) fn contiguous(ptr: DevPtr, len: usize, device: DeviceId) -> Self {
                $view {
                    ptr,
                    rows: 1,
                    cols: len,
                    pitch: len * size_of::<T>(),
                    device,
                    _borrow: PhantomData,
                }
            }
            /// The device address of row 0.
            pub fn device_ptr(&self) -> u64 {
                self.ptr
            }
            /// Rows.
            pub fn rows(&self) -> usize {
                self.rows
            }
            /// Columns.
            pub fn cols(&self) -> usize {
                self.cols
            }
            /// Bytes between rows.
            pub fn step(&self) -> usize {
                self.pitch
            }
        }
    };
}
view_accessors!(GpuView);
view_accessors!(GpuViewMut);
