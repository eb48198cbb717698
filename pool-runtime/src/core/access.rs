//! One way to take a buffer as a parameter: [`GpuRead`] for what a function reads, [`GpuWrite`]
//! for what it fills. A [`Temp`], a [`DeviceMat`](crate::DeviceMat), OpenCV's
//! [`GpuMat`](crate::compat::opencv::GpuMat), a `buffer!` handle ([`Pooled`]), a view or a region
//! ([`GpuView`], [`GpuViewMut`]) and an access to shared memory ([`SharedRead`], [`SharedWrite`])
//! all implement them, so one function serves them all, and every operation (uploads, downloads,
//! fills, copies, regions, kernel arguments, cudarc lending) is found in one place.
//!
//! ```
//! use gpu_pool::{compat::opencv::BufferPool, Device, compat::opencv::GpuMat, GpuRead, GpuWrite, PoolError, Stream};
//!
//! /// `out = 2 * src` (a kernel would go here; the host backend's CPU twin stands in).
//! fn double(src: &impl GpuRead<f32>, out: &mut impl GpuWrite<f32>) -> Result<(), PoolError> {
//!     let doubled: Vec<f32> = src.to_vec()?.iter().map(|v| 2.0 * v).collect();
//!     out.upload(&doubled)
//! }
//!
//! let stream = Stream::new(&Device::host())?;
//! let src = GpuMat::from_host(&stream, 2, 3, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
//! let mut whole = GpuMat::<f32>::new(&stream, 2, 3)?;
//! double(&src, &mut whole)?;                                     // a GpuMat
//! let mut batch = BufferPool::new(&stream).get_buffer::<f32>(8, 3)?;
//! double(&src, &mut batch.row_range_mut(0..2)?)?;                // a region of a bigger buffer
//! assert_eq!(whole.to_vec()?, batch.row_range(0..2)?.to_vec()?);
//! # Ok::<(), PoolError>(())
//! ```
//!
//! Inside a `#[pooled]` function the handles `buffer!` binds are passed the same way: `&x` where a
//! `&impl GpuRead<T>` is taken, `&mut x` where a `&mut impl GpuWrite<T>` is (bind it with
//! `let mut x = buffer!(..)`).

use std::ops::Range;

use bytemuck::Pod;

use crate::base::error::PoolError;
use crate::core::buffer::Temp;
use crate::core::scope::Pooled;
use crate::core::view::{GpuView, GpuViewMut};
#[cfg(feature = "cuda")]
use crate::core::{
    lent::{LentSlice, LentSliceMut},
    pitched::{Pitched, PitchedMut},
};

/// Page-locked host memory an asynchronous copy reads or writes
/// ([`download_async`](GpuRead::download_async), [`upload_async`](GpuWrite::upload_async)):
/// [`HostMem`](crate::HostMem). Sealed: the memory must stay valid, unread and unwritten until the
/// copy is done, which only the crate's own types can promise.
pub trait PinnedHost<T: Pod>: sealed::Sealed {
    /// Queues a copy of `view` into this memory on the view's stream.
    #[doc(hidden)]
    fn download_from(&mut self, view: &GpuView<'_, T>) -> Result<(), PoolError>;

    /// Queues a copy of this memory into `view` on the view's stream.
    #[doc(hidden)]
    fn upload_into(&self, view: &mut GpuViewMut<'_, T>) -> Result<(), PoolError>;
}

/// Keeps [`PinnedHost`] to the crate's types.
pub(crate) mod sealed {
    /// Implemented by the crate's page-locked types only.
    pub trait Sealed {}
}

/// Device memory a function reads: a [`Temp`], a [`DeviceMat`](crate::DeviceMat), a `buffer!` handle, a view or region, or a read
/// of a `SharedMat` (feature `shared`). Take it as `src: &impl GpuRead<T>`.
///
/// Only [`view`](Self::view) is implemented by each type; every other method works on the view,
/// so all of them behave alike.
pub trait GpuRead<T: Pod>: crate::core::graph_key::GraphKey {
    /// The memory as a read-only view, queued on its stream.
    fn view(&self) -> GpuView<'_, T>;

    /// The field holding [`device_ptr`](Self::device_ptr), which a kernel argument pushed with
    /// `LaunchArgsExt::buf` points at until the launch: it lives as long as `self` is borrowed.
    #[doc(hidden)]
    fn addr_ref(&self) -> &u64;

    /// Rows.
    fn rows(&self) -> usize {
        self.view().window.rows
    }

    /// Columns.
    fn cols(&self) -> usize {
        self.view().window.cols
    }

    /// Elements (`rows * cols`).
    fn len(&self) -> usize {
        let view = self.view();
        // Cannot wrap: no memory is larger than the layout that checked `rows * cols`.
        view.window.rows * view.window.cols
    }

    /// Whether it has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes from the start of one row to the next.
    fn step(&self) -> usize {
        self.view().window.pitch
    }

    /// The device address of row 0 (0 for empty memory): a kernel's `T*` argument.
    fn device_ptr(&self) -> u64 {
        self.view().window.ptr
    }

    /// Copies the elements into `out` (`rows * cols`, row-major) and waits for the copy.
    fn download(&self, out: &mut [T]) -> Result<(), PoolError> {
        self.view().download(out)
    }

    /// Queues a copy of the elements into page-locked `dst` (`rows * cols`, row-major) on the
    /// memory's stream and returns at once: the host waits only when it reads `dst`
    /// ([`HostMem::as_slice`](crate::HostMem::as_slice)), so a frame loop queues its kernels behind the copy and
    /// synchronizes once. `dst` cannot be read or freed before the copy is done.
    ///
    /// Errors: `ShapeMismatch`, `DeviceMismatch`; `Unsupported` inside a graph capture on this
    /// thread and for memory of no stream; `CapturedElsewhere`.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, HostMem, PoolError, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let mut gpu = BufferPool::new(&stream).get_buffer::<f32>(4, 4)?;
    /// gpu.set_to(1.5)?;
    /// let mut host = HostMem::<f32>::new(stream.device(), 16)?;
    /// gpu.download_async(&mut host)?;
    /// assert_eq!(host.as_slice()?, &[1.5; 16]);
    /// # Ok::<(), PoolError>(())
    /// ```
    fn download_async(&self, dst: &mut dyn PinnedHost<T>) -> Result<(), PoolError> {
        dst.download_from(&self.view())
    }

    /// The elements, row-major, in a new `Vec`.
    fn to_vec(&self) -> Result<Vec<T>, PoolError> {
        let mut out = vec![T::zeroed(); self.len()];
        self.download(&mut out)?;
        Ok(out)
    }

    /// The region `rows x cols` (OpenCV's ROI), with the same step; `PoolError::OutOfBounds` for
    /// a range past the edge.
    fn roi(&self, rows: Range<usize>, cols: Range<usize>) -> Result<GpuView<'_, T>, PoolError> {
        self.view().roi(rows, cols)
    }

    /// Rows `rows`, every column (OpenCV's `rowRange`).
    fn row_range(&self, rows: Range<usize>) -> Result<GpuView<'_, T>, PoolError> {
        self.view().row_range(rows)
    }

    /// All elements as one contiguous row; `PoolError::NotContinuous` for padded rows.
    fn as_1d(&self) -> Result<GpuView<'_, T>, PoolError> {
        self.view().as_1d()
    }

    /// The rows as host slices, on the host backend (CPU twins of kernels);
    /// `PoolError::Unsupported` on a GPU.
    fn host_rows(&self) -> Result<impl Iterator<Item = &[T]>, PoolError>
    where
        Self: Sized,
    {
        self.view().host_rows()
    }

    /// The memory as a read-only 2D kernel argument (address, step, rows, columns).
    #[cfg(feature = "cuda")]
    fn pitched(&self) -> Pitched<'_, T> {
        self.view().pitched()
    }

    /// The memory lent to cudarc (`DeviceSlice` + `DevicePtr`): cuBLAS, cuFFT, cudarc's copies.
    /// A 2D buffer is lent as the run from its first element to its last; its leading dimension
    /// is [`LentSlice::ld`]. `PoolError::Unsupported` on the host backend.
    #[cfg(feature = "cuda")]
    fn as_cudarc(&self) -> Result<LentSlice<'_, T>, PoolError> {
        self.view().as_cudarc()
    }
}

/// Device memory a function fills: a [`Temp`], a [`DeviceMat`](crate::DeviceMat), a `buffer!` handle, a writable view or region,
/// or a write of a `SharedMat` (feature `shared`). Take it as `out: &mut impl GpuWrite<T>`.
pub trait GpuWrite<T: Pod>: GpuRead<T> {
    /// The memory as a writable view, queued on its stream.
    fn view_mut(&mut self) -> GpuViewMut<'_, T>;

    /// The field holding the address [`view_mut`](Self::view_mut) lends, which a kernel argument
    /// pushed with `LaunchArgsExt::buf_mut` points at. The read view's unless a type lends
    /// different memory for writing.
    #[doc(hidden)]
    fn addr_mut(&mut self) -> &u64 {
        self.addr_ref()
    }

    /// Copies `data` (`rows * cols` elements, row-major) in, on the memory's stream, and waits
    /// until `data` has been read: `data` may be changed or freed as soon as this returns, even if
    /// it is page-locked memory (such as `MixMemory::cpu`'s), which the
    /// driver copies asynchronously. A region's rows are written without touching its parent's
    /// other columns, so a varying batch can fill the first rows of a fixed buffer.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let mut batch = BufferPool::new(&stream).get_buffer::<f32>(8, 4)?; // room for 8 rows
    /// batch.set_to(0.0)?;
    /// batch.row_range_mut(0..2)?.upload(&[1.0; 8])?;                      // 2 rows this time
    /// assert_eq!(batch.to_vec()?.iter().sum::<f32>(), 8.0);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    fn upload(&mut self, data: &[T]) -> Result<(), PoolError> {
        self.view_mut().upload(data)
    }

    /// Queues a copy of page-locked `src` (`rows * cols`, row-major) into the memory on its
    /// stream and returns at once: `src` cannot be written or freed before the copy is done
    /// ([`HostMem`](crate::HostMem) waits), and the kernels queued after it on the stream read the copy.
    ///
    /// Errors: as [`download_async`](GpuRead::download_async).
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, HostMem, PoolError, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let src = HostMem::from_slice(stream.device(), &[3u8; 12])?;
    /// let mut gpu = BufferPool::new(&stream).get_buffer::<u8>(3, 4)?;
    /// gpu.upload_async(&src)?;
    /// assert_eq!(gpu.to_vec()?, vec![3; 12]);
    /// # Ok::<(), PoolError>(())
    /// ```
    fn upload_async(&mut self, src: &dyn PinnedHost<T>) -> Result<(), PoolError> {
        src.upload_into(&mut self.view_mut())
    }

    /// Sets every element to `value`, on the memory's stream (OpenCV's `setTo`).
    fn set_to(&mut self, value: T) -> Result<(), PoolError> {
        self.view_mut().set_to(value)
    }

    /// Copies `src` (same shape, same device) in, on this memory's stream.
    ///
    /// When `src` is queued on another stream, the copy waits for the work queued there so far
    /// (so it reads what that work wrote), and `src`'s memory is not reused (or, for shared
    /// memory, written) until the copy is done. Neither stream blocks the host.
    fn copy_from<S: GpuRead<T> + ?Sized>(&mut self, src: &S) -> Result<(), PoolError>
    where
        Self: Sized,
    {
        self.view_mut().copy_view(src.view())
    }

    /// The writable region `rows x cols`, with the same step.
    fn roi_mut(
        &mut self,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<GpuViewMut<'_, T>, PoolError> {
        self.view_mut().into_roi_mut(rows, cols)
    }

    /// Writable rows `rows`, every column: a varying batch fills the first rows of a fixed buffer.
    fn row_range_mut(&mut self, rows: Range<usize>) -> Result<GpuViewMut<'_, T>, PoolError> {
        let cols = 0..self.cols();
        self.roi_mut(rows, cols)
    }

    /// All elements as one writable contiguous row; `PoolError::NotContinuous` for padded rows.
    fn as_1d_mut(&mut self) -> Result<GpuViewMut<'_, T>, PoolError> {
        self.view_mut().into_1d_mut()
    }

    /// Calls `f` with each row as a mutable host slice, on the host backend (CPU twins of
    /// kernels); `PoolError::Unsupported` on a GPU.
    fn for_each_host_row_mut(&mut self, f: impl FnMut(usize, &mut [T])) -> Result<(), PoolError>
    where
        Self: Sized,
    {
        self.view_mut().for_each_host_row_mut(f)
    }

    /// The memory as a writable 2D kernel argument.
    #[cfg(feature = "cuda")]
    fn pitched_mut(&mut self) -> PitchedMut<'_, T> {
        self.view_mut().into_pitched_mut()
    }

    /// The memory lent to cudarc for writing (`DevicePtrMut`); see
    /// [`as_cudarc`](GpuRead::as_cudarc).
    #[cfg(feature = "cuda")]
    fn as_cudarc_mut(&mut self) -> Result<LentSliceMut<'_, T>, PoolError> {
        self.view_mut().into_cudarc_mut()
    }
}

impl<T: Pod> GpuRead<T> for Pooled<'_, '_, T> {
    fn addr_ref(&self) -> &u64 {
        self.ptr_field()
    }

    fn view(&self) -> GpuView<'_, T> {
        Temp::whole(self)
    }
}

impl<T: Pod> GpuWrite<T> for Pooled<'_, '_, T> {
    fn view_mut(&mut self) -> GpuViewMut<'_, T> {
        self.mat_mut().whole_mut()
    }
}

impl<T: Pod> GpuRead<T> for GpuView<'_, T> {
    fn addr_ref(&self) -> &u64 {
        &self.window.ptr
    }

    fn view(&self) -> GpuView<'_, T> {
        *self
    }
}

impl<T: Pod> GpuRead<T> for GpuViewMut<'_, T> {
    fn addr_ref(&self) -> &u64 {
        &self.window.ptr
    }

    fn view(&self) -> GpuView<'_, T> {
        self.as_view()
    }
}

impl<T: Pod> GpuWrite<T> for GpuViewMut<'_, T> {
    fn view_mut(&mut self) -> GpuViewMut<'_, T> {
        GpuViewMut::new(self.window, self.device, self.keeper)
    }
}
