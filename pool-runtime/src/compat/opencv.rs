//! OpenCV's `cv::cuda` names as a thin layer over the pool: [`BufferPool`] hands out stack
//! temporaries ([`Temp`]) and [`GpuMat`] is OpenCV's one matrix type, whichever rule its memory
//! follows. New code uses [`Stream::temp`] and [`DeviceMat`], one type per rule.
//!
//! A `&Temp` and a `&DeviceMat` coerce to a `&GpuMat` (both deref to it), and both convert into
//! one (`From`), so functions written against OpenCV's type keep taking either.
//!
//! ```
//! use gpu_pool::compat::opencv::{BufferPool, GpuMat};
//! use gpu_pool::{Device, DeviceMat, PoolError, Source, Stream};
//!
//! fn origin(m: &GpuMat<'_, f32>) -> Source {
//!     m.source()
//! }
//!
//! let stream = Stream::new(&Device::host())?;
//! let from_pool = BufferPool::new(&stream).get_buffer::<f32>(4, 4)?; // a GpuMat
//! let temp = stream.temp::<f32>(4, 4)?;
//! let own = DeviceMat::<f32>::new(&stream, 4, 4)?;
//! assert_eq!(origin(&from_pool), Source::Stack);
//! assert_eq!(origin(&temp), Source::Stack);
//! assert_eq!(origin(&own), Source::Driver);
//! # Ok::<(), PoolError>(())
//! ```

use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;

use bytemuck::Pod;

use crate::allocators::GpuAllocator;
use crate::base::error::PoolError;
use crate::base::source::CallSite;
use crate::core::buffer::{DeviceMat, Temp, lease_buffer};
use crate::core::stream::{Lease, Stream};

pub use crate::core::config::{buffer_pool_usage, set_buffer_pool_usage};
pub use crate::core::device::set_buffer_pool_config;

/// Hands out buffers from a stream's stack (OpenCV's `cv::cuda::BufferPool`): [`Stream::temp`]'s
/// temporaries, as OpenCV's [`GpuMat`].
///
/// ```
/// use gpu_pool::compat::opencv::BufferPool;
/// use gpu_pool::{Device, GpuRead, Source, Stream};
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

    /// A `rows x cols` buffer: [`Stream::temp`] (pitched with more than one row and column; from
    /// the stack when it fits, else from the stream's fallback allocator). The caller's line is
    /// the buffer's [`CallSite`].
    // Always inlined, as `Stream::temp` is, for the same reason (the lease is not returned
    // through memory).
    #[inline(always)]
    #[track_caller]
    pub fn get_buffer<T: Pod>(&self, rows: usize, cols: usize) -> Result<GpuMat<'s, T>, PoolError> {
        self.stream
            .temp_at(rows, cols, CallSite::here(""))
            .map(GpuMat::from)
    }

    /// A `rows x cols` buffer with no padding between its rows (OpenCV's `createContinuous`):
    /// [`Stream::temp_packed`].
    ///
    /// ```
    /// use gpu_pool::compat::opencv::BufferPool;
    /// use gpu_pool::{Device, GpuRead, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let logits = BufferPool::new(&stream).get_buffer_packed::<f32>(256, 10)?;
    /// assert_eq!((logits.rows(), logits.cols(), logits.step()), (256, 10, 40)); // not 512
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    #[inline(always)]
    #[track_caller]
    pub fn get_buffer_packed<T: Pod>(
        &self,
        rows: usize,
        cols: usize,
    ) -> Result<GpuMat<'s, T>, PoolError> {
        self.stream
            .temp_packed_at(rows, cols, CallSite::here(""))
            .map(GpuMat::from)
    }

    /// A contiguous buffer of `len` elements (a `1 x len` [`GpuMat`]).
    #[inline(always)]
    #[track_caller]
    pub fn get_buffer_1d<T: Pod>(&self, len: usize) -> Result<GpuMat<'s, T>, PoolError> {
        self.stream
            .temp_at(1, len, CallSite::here(""))
            .map(GpuMat::from)
    }

    /// The allocator that serves this stream's buffers when the stack does not (OpenCV's
    /// `getAllocator`).
    #[must_use]
    pub fn allocator(&self) -> Arc<dyn GpuAllocator> {
        self.stream.allocator()
    }
}

/// A 2D array of `T` in device memory, borrowed from a stream (OpenCV's `cv::cuda::GpuMat`): a
/// stack temporary ([`BufferPool::get_buffer`], a [`Temp`]) or a driver allocation
/// ([`GpuMat::new`], a [`DeviceMat`]); its [`source`](GpuMat::source) tells which, and the memory
/// goes back by that rule.
///
/// A buffer borrows its stream, so it cannot outlive it or move to another thread:
/// ```compile_fail
/// use gpu_pool::compat::opencv::BufferPool;
/// use gpu_pool::{Device, Stream};
/// let buf = {
///     let stream = Stream::new(&Device::host()).unwrap();
///     BufferPool::new(&stream).get_buffer_1d::<u8>(8).unwrap()
/// };
/// ```
#[must_use = "a buffer goes back to its pool when dropped: one never used is released at once"]
#[repr(transparent)]
pub struct GpuMat<'s, T> {
    /// The memory and its shape, which go back to the stream when the buffer is dropped.
    lease: Lease<'s>,
    _elem: PhantomData<T>,
}

lease_buffer!(GpuMat);

impl<T> GpuMat<'_, T> {
    /// Gives the memory back now and reports what went wrong: a driver error from the fallback's
    /// free, or, in strict mode, `PoolError::LifoViolation` (the memory is still reclaimed).
    pub fn release(self) -> Result<(), PoolError> {
        self.lease.release()
    }
}

impl<'s, T: Pod> GpuMat<'s, T> {
    /// A buffer with memory of its own, not from the stack: [`DeviceMat::new`].
    #[track_caller]
    pub fn new(stream: &'s Stream, rows: usize, cols: usize) -> Result<GpuMat<'s, T>, PoolError> {
        DeviceMat::new(stream, rows, cols).map(GpuMat::from)
    }

    /// [`GpuMat::new`] with no padding between rows: [`DeviceMat::new_packed`].
    #[track_caller]
    pub fn new_packed(
        stream: &'s Stream,
        rows: usize,
        cols: usize,
    ) -> Result<GpuMat<'s, T>, PoolError> {
        DeviceMat::new_packed(stream, rows, cols).map(GpuMat::from)
    }

    /// [`GpuMat::new`] filled from `data` (`rows * cols` elements, row-major):
    /// [`DeviceMat::from_host`].
    #[track_caller]
    pub fn from_host(
        stream: &'s Stream,
        rows: usize,
        cols: usize,
        data: &[T],
    ) -> Result<GpuMat<'s, T>, PoolError> {
        DeviceMat::from_host(stream, rows, cols, data).map(GpuMat::from)
    }
}

impl<'s, T> From<Temp<'s, T>> for GpuMat<'s, T> {
    #[inline(always)]
    fn from(temp: Temp<'s, T>) -> GpuMat<'s, T> {
        GpuMat::on(temp.into_lease())
    }
}

impl<'s, T> From<DeviceMat<'s, T>> for GpuMat<'s, T> {
    #[inline(always)]
    fn from(mat: DeviceMat<'s, T>) -> GpuMat<'s, T> {
        GpuMat::on(mat.into_lease())
    }
}

/// Read-only, so a `&Temp` passes where a `&GpuMat` is taken; no `DerefMut`, so the memory cannot
/// be swapped between buffers of different rules through a `&mut GpuMat`.
impl<'s, T> Deref for Temp<'s, T> {
    type Target = GpuMat<'s, T>;

    #[inline(always)]
    fn deref(&self) -> &GpuMat<'s, T> {
        // SAFETY: `Temp` and `GpuMat` are both `#[repr(transparent)]` over a `Lease<'s>` (their
        // other field is a `PhantomData<T>`), so they have one layout; the reference keeps the
        // borrow of `self`, and no `&mut` is handed out.
        unsafe { &*std::ptr::from_ref(self).cast::<GpuMat<'s, T>>() }
    }
}

/// As for [`Temp`]: a `&DeviceMat` passes where a `&GpuMat` is taken.
impl<'s, T> Deref for DeviceMat<'s, T> {
    type Target = GpuMat<'s, T>;

    #[inline(always)]
    fn deref(&self) -> &GpuMat<'s, T> {
        // SAFETY: as for `Temp`: both `#[repr(transparent)]` over the same `Lease<'s>`.
        unsafe { &*std::ptr::from_ref(self).cast::<GpuMat<'s, T>>() }
    }
}

#[cfg(feature = "cuda")]
mod kernel_args {
    use cudarc::driver::{LaunchArgs, PushKernelArg};

    use super::GpuMat;

    // SAFETY: pushes a pointer to the buffer's device address, a `u64` stored in the buffer, which
    // is borrowed for 'b and so outlives the launch builder ('a). The driver reads the argument at
    // launch; the kernel receives the address by value.
    unsafe impl<'a, 'b: 'a, 's, T> PushKernelArg<&'b GpuMat<'s, T>> for LaunchArgs<'a> {
        #[inline(always)]
        fn arg(&mut self, buffer: &'b GpuMat<'s, T>) -> &mut Self {
            <Self as PushKernelArg<&'b u64>>::arg(self, buffer.ptr_field())
        }
    }

    // SAFETY: as above.
    unsafe impl<'a, 'b: 'a, 's, T> PushKernelArg<&'b mut GpuMat<'s, T>> for LaunchArgs<'a> {
        #[inline(always)]
        fn arg(&mut self, buffer: &'b mut GpuMat<'s, T>) -> &mut Self {
            <Self as PushKernelArg<&'b u64>>::arg(self, buffer.ptr_field())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The deref casts rely on one layout, and the hot path on buffers no bigger than a lease.
    #[test]
    fn every_buffer_type_is_its_lease() {
        let lease = size_of::<Lease<'static>>();
        assert_eq!(size_of::<Temp<'static, [u8; 3]>>(), lease);
        assert_eq!(size_of::<DeviceMat<'static, f64>>(), lease);
        assert_eq!(size_of::<GpuMat<'static, u16>>(), lease);
        assert_eq!(
            align_of::<Temp<'static, u8>>(),
            align_of::<GpuMat<'static, u8>>()
        );
    }
}
