//! Pool memory lent to cudarc: [`LentSlice`] and [`LentSliceMut`], a view's memory as the flat run
//! cudarc's traits describe. Made here from a view's window; cudarc's `DeviceSlice`, `DevicePtr`
//! and `DevicePtrMut` on them, and the ordering between streams those promise, are
//! `interop::device_memory`'s.

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::CudaStream;

use crate::base::error::PoolError;
use crate::base::id::DeviceId;
use crate::core::stream::Stream;
use crate::core::view::{GpuView, GpuViewMut, Window};

/// A pool buffer or region lent to cudarc for reading: a `DeviceSlice` + `DevicePtr`, as cudarc's
/// own `CudaView`, made by [`GpuRead::as_cudarc`](crate::GpuRead::as_cudarc) and
/// [`GpuView::as_cudarc`](crate::GpuView::as_cudarc).
#[derive(Debug)]
#[must_use = "lent memory does nothing until passed to a cudarc call"]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub struct LentSlice<'a, T> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    ld: usize,
    pub(crate) stream: &'a Arc<CudaStream>,
    pub(crate) pool: &'a Stream,
    _borrow: PhantomData<&'a T>,
}

/// A pool buffer or region lent to cudarc for reading and writing: a `DeviceSlice` + `DevicePtr` +
/// `DevicePtrMut`, as cudarc's own `CudaViewMut`, made by
/// [`GpuWrite::as_cudarc_mut`](crate::GpuWrite::as_cudarc_mut) and
/// [`GpuViewMut::as_cudarc_mut`](crate::GpuViewMut::as_cudarc_mut).
#[derive(Debug)]
#[must_use = "lent memory does nothing until passed to a cudarc call"]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub struct LentSliceMut<'a, T> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    ld: usize,
    pub(crate) stream: &'a Arc<CudaStream>,
    pub(crate) pool: &'a Stream,
    _borrow: PhantomData<&'a mut T>,
}

/// The flat run a window covers, in elements, its leading dimension (elements between rows), and
/// the stream it is ordered on.
fn span<'a, T>(
    window: &Window,
    device: DeviceId,
    pool: Option<&'a Stream>,
) -> Result<(usize, usize, &'a Arc<CudaStream>, &'a Stream), PoolError> {
    let Some((stream, pool)) = pool.and_then(|p| Some((p.cuda_stream()?, p))) else {
        return Err(PoolError::Unsupported {
            device,
            what: "cudarc device memory (DevicePtr) outside a CUDA stream",
        });
    };
    let size = size_of::<T>();
    if window.rows <= 1 || size == 0 || window.is_continuous::<T>() {
        // Cannot wrap: the buffer's layout checked `rows * cols`.
        return Ok((window.rows * window.cols, window.cols.max(1), stream, pool));
    }
    if !window.owns_gaps || !window.pitch.is_multiple_of(size) {
        // A region's gaps are its neighbours' elements, which a flat run would hand to cudarc's
        // copies and fills; and with no whole number of elements between rows, no leading
        // dimension describes the rows.
        return Err(PoolError::NotContinuous {
            rows: window.rows,
            cols: window.cols,
            step: window.pitch,
        });
    }
    let ld = window.pitch / size;
    // Inside the buffer: the last row starts `(rows - 1) * pitch` bytes in and holds `cols`.
    Ok(((window.rows - 1) * ld + window.cols, ld, stream, pool))
}

/// What both lent kinds have alike: a constructor from a view's window and the leading dimension.
macro_rules! lent {
    ($($lent:ident),*) => {$(
        impl<'a, T> $lent<'a, T> {
            fn new(
                window: Window,
                device: DeviceId,
                pool: Option<&'a Stream>,
            ) -> Result<Self, PoolError> {
                let (len, ld, stream, pool) = span::<T>(&window, device, pool)?;
                Ok($lent {
                    ptr: window.ptr,
                    len,
                    ld,
                    stream,
                    pool,
                    _borrow: PhantomData,
                })
            }

            /// Elements from one row to the next: cuBLAS's leading dimension of a row-major
            /// matrix.
            #[must_use]
            pub fn ld(&self) -> usize {
                self.ld
            }
        }
    )*};
}
lent!(LentSlice, LentSliceMut);

// Buffers, handles and shared memory lend through their views (`GpuRead::as_cudarc`,
// `GpuWrite::as_cudarc_mut`).

impl<'a, T: Pod> GpuView<'a, T> {
    /// This view lent to cudarc (`DevicePtr`), for cuBLAS and the like; see [`LentSlice`].
    /// `PoolError::Unsupported` on the host backend.
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn as_cudarc(&self) -> Result<LentSlice<'a, T>, PoolError> {
        LentSlice::new(self.window, self.device, self.keeper.cuda())
    }
}

impl<'a, T: Pod> GpuViewMut<'a, T> {
    /// This view lent to cudarc for writing (`DevicePtrMut`); see [`LentSliceMut`].
    /// `PoolError::Unsupported` on the host backend.
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn as_cudarc_mut(&mut self) -> Result<LentSliceMut<'_, T>, PoolError> {
        LentSliceMut::new(self.window, self.device, self.keeper.cuda())
    }

    /// This view lent to cudarc for writing, keeping the view's borrow (what
    /// [`GpuWrite::as_cudarc_mut`](crate::GpuWrite::as_cudarc_mut) returns through a temporary
    /// view).
    pub(crate) fn into_cudarc_mut(self) -> Result<LentSliceMut<'a, T>, PoolError> {
        LentSliceMut::new(self.window, self.device, self.keeper.cuda())
    }
}
