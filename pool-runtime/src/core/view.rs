//! Views: a buffer's memory lent for a while, whole or as a region of it (OpenCV's ROI), for
//! kernel arguments, cudarc's device-memory traits and, on the host backend, CPU twins of kernels.
//!
//! A view borrows what it views, so it cannot outlive it; a region keeps its parent's step, so its
//! rows are the parent's rows, cut.
//!
//! ```
//! use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, Stream};
//! let stream = Stream::new(&Device::host())?;
//! let mut image = BufferPool::new(&stream).get_buffer::<u8>(8, 10)?;
//! image.set_to(0)?;
//! image.roi_mut(2..4, 3..7)?.for_each_host_row_mut(|_, row| row.fill(9))?; // a 2x4 window
//! let inside: usize = image.roi(2..4, 3..7)?.host_rows()?.flatten().map(|&v| usize::from(v)).sum();
//! assert_eq!(inside, 9 * 8);
//! assert_eq!(image.to_vec()?.iter().filter(|&&v| v == 9).count(), 8);
//! assert!(image.roi(0..9, 0..1).is_err()); // 9 rows of 8
//! # Ok::<(), gpu_pool::PoolError>(())
//! ```

use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::NonNull;

use bytemuck::Pod;

use crate::base::error::PoolError;
use crate::base::id::DeviceId;
use crate::core::stream::Stream;
use crate::storage::backend::{DevPtr, Region};

/// Where a view's elements are: the shape and step of a buffer or of a region of one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Window {
    pub(crate) ptr: DevPtr,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) pitch: usize,
    /// Whether the bytes between the end of one row and the start of the next belong to this
    /// window (a whole buffer's padding) rather than to elements outside it (a region's
    /// neighbours): only then may it be lent as one flat run.
    pub(crate) owns_gaps: bool,
}

impl Window {
    /// The region `rows x cols` of this window, or `PoolError::OutOfBounds` naming the range that
    /// does not fit. Its address stays inside the window, so no arithmetic below can wrap.
    pub(crate) fn region<T>(
        &self,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Window, PoolError> {
        check_range("rows", &rows, self.rows)?;
        check_range("cols", &cols, self.cols)?;
        let (height, width) = (rows.end - rows.start, cols.end - cols.start);
        let ptr = if height == 0 || width == 0 || self.ptr == 0 {
            // Nothing to address: like an empty buffer, no address at all.
            0
        } else {
            self.ptr + (rows.start * self.pitch + cols.start * size_of::<T>()) as DevPtr
        };
        Ok(Window {
            ptr,
            rows: height,
            cols: width,
            pitch: self.pitch,
            // Every column of a window that owns its gaps: the gaps are still its padding.
            owns_gaps: self.owns_gaps && width == self.cols,
        })
    }

    /// The whole window as one row, if its rows follow each other with no padding.
    pub(crate) fn flat<T>(&self) -> Result<Window, PoolError> {
        if !self.is_continuous::<T>() {
            return Err(PoolError::NotContinuous {
                rows: self.rows,
                cols: self.cols,
                step: self.pitch,
            });
        }
        // Cannot wrap: the buffer's layout checked `rows * cols` (and its bytes).
        let len = self.rows * self.cols;
        Ok(Window {
            ptr: self.ptr,
            rows: 1,
            cols: len,
            pitch: len * size_of::<T>(),
            owns_gaps: true,
        })
    }

    pub(crate) fn is_continuous<T>(&self) -> bool {
        self.rows <= 1 || self.pitch == self.cols * size_of::<T>()
    }
}

fn check_range(what: &'static str, range: &Range<usize>, len: usize) -> Result<(), PoolError> {
    if range.start <= range.end && range.end <= len {
        Ok(())
    } else {
        Err(PoolError::OutOfBounds {
            what,
            start: range.start,
            end: range.end,
            len,
        })
    }
}

/// A read-only view of a [`GpuMat`](crate::compat::opencv::GpuMat) or of a region of one: the address, shape and
/// step, valid while the buffer is borrowed. For kernel arguments, cudarc's device-memory traits
/// (through [`as_cudarc`](GpuView::as_cudarc)) and, on the host backend, CPU twins of kernels.
#[derive(Clone, Copy, Debug)]
#[must_use = "a view does nothing unless used"]
pub struct GpuView<'a, T> {
    pub(crate) window: Window,
    pub(crate) device: DeviceId,
    pub(crate) keeper: Keeper<'a>,
    _borrow: PhantomData<&'a T>,
}

/// A writable view of a [`GpuMat`](crate::compat::opencv::GpuMat) or of a region of one, for kernel arguments,
/// cudarc's device-memory traits and CPU twins.
#[derive(Debug)]
#[must_use = "a view does nothing unless used"]
pub struct GpuViewMut<'a, T> {
    pub(crate) window: Window,
    pub(crate) device: DeviceId,
    pub(crate) keeper: Keeper<'a>,
    _borrow: PhantomData<&'a mut T>,
}

/// Whose order a view's memory follows, which decides how work on it is queued.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Keeper<'a> {
    /// No stream's (a `MixMemory`'s device side): kernel arguments only.
    #[cfg_attr(
        not(feature = "mix"),
        expect(
            dead_code,
            reason = "only `compat::mix` (feature `mix`) makes memory of no stream"
        )
    )]
    Unordered,
    /// A buffer of this pool stream, whose memory is reused in the stream's order.
    Stream(&'a Stream),
    /// Shared memory accessed on this stream (a `SharedMat`'s, feature `shared`).
    #[cfg_attr(
        not(feature = "shared"),
        expect(
            dead_code,
            reason = "only `shared` (feature `shared`) makes shared memory"
        )
    )]
    Shared(&'a Stream),
}

impl<'a> Keeper<'a> {
    /// The stream work on the memory is queued on.
    pub(crate) fn stream(self) -> Option<&'a Stream> {
        match self {
            Keeper::Unordered => None,
            Keeper::Stream(s) | Keeper::Shared(s) => Some(s),
        }
    }

    /// The stream whose cudarc stream orders the memory, on a CUDA device.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(self) -> Option<&'a Stream> {
        self.stream().filter(|s| s.cuda_stream().is_some())
    }

    /// The stream for work named `what`, or `PoolError::Unsupported` for memory of no stream.
    fn work_stream(self, device: DeviceId, what: &'static str) -> Result<&'a Stream, PoolError> {
        self.stream().ok_or(PoolError::Unsupported { device, what })
    }
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

macro_rules! view_common {
    ($view:ident) => {
        impl<'a, T> $view<'a, T> {
            /// A view of `window`: memory of `device` the caller keeps borrowed for `'a`, aligned
            /// for `T` (address and step), whose work is ordered on `cuda` where given.
            pub(crate) fn new(window: Window, device: DeviceId, keeper: Keeper<'a>) -> Self {
                $crate::core::graph_key::touched(window.ptr, (window.rows * window.pitch) as u64);
                $view {
                    window,
                    device,
                    keeper,
                    _borrow: PhantomData,
                }
            }

            /// Whether the rows follow each other with no padding.
            #[must_use]
            pub fn is_continuous(&self) -> bool {
                self.window.is_continuous::<T>()
            }
            /// The stream work on this view is queued on; `None` for memory of no stream (a
            /// `MixMemory`'s device side).
            #[must_use]
            pub fn stream(&self) -> Option<&'a Stream> {
                self.keeper.stream()
            }

            /// The region the backend copies and fills.
            pub(crate) fn region(&self) -> Region {
                Region {
                    ptr: self.window.ptr,
                    pitch: self.window.pitch,
                    width: self.window.cols * size_of::<T>(),
                    rows: self.window.rows,
                }
            }

            /// Elements (`rows * cols`): [`GpuRead::len`](crate::GpuRead::len), which this
            /// module's layer cannot name.
            pub(crate) fn elems(&self) -> usize {
                // Cannot wrap: a view is never larger than the buffer whose layout checked it.
                self.window.rows * self.window.cols
            }

            fn check_len(&self, actual: usize) -> Result<(), PoolError> {
                if actual == self.elems() {
                    Ok(())
                } else {
                    Err(PoolError::ShapeMismatch {
                        expected: self.elems(),
                        actual,
                    })
                }
            }

            /// Whether there is nothing to copy or fill.
            fn no_bytes(&self) -> bool {
                self.elems() == 0 || size_of::<T>() == 0
            }
        }
    };
}
view_common!(GpuView);
view_common!(GpuViewMut);

impl<'a, T: Pod> GpuView<'a, T> {
    /// The region `rows x cols` of this view (OpenCV's ROI), with the same step;
    /// `PoolError::OutOfBounds` for a range past the view's edge.
    pub fn roi(&self, rows: Range<usize>, cols: Range<usize>) -> Result<GpuView<'a, T>, PoolError> {
        let window = self.window.region::<T>(rows, cols)?;
        Ok(GpuView::new(window, self.device, self.keeper))
    }

    /// Rows `rows` of this view, every column.
    pub fn row_range(&self, rows: Range<usize>) -> Result<GpuView<'a, T>, PoolError> {
        self.roi(rows, 0..self.window.cols)
    }

    /// The elements as one contiguous row, for a view whose rows have no padding between them;
    /// `PoolError::NotContinuous` otherwise.
    pub fn as_1d(&self) -> Result<GpuView<'a, T>, PoolError> {
        Ok(GpuView::new(
            self.window.flat::<T>()?,
            self.device,
            self.keeper,
        ))
    }

    /// Copies the elements into `out` (`rows * cols`, row-major) and waits for the copy: a
    /// region's rows are read without its parent's other columns.
    pub(crate) fn download(&self, out: &mut [T]) -> Result<(), PoolError> {
        self.check_len(out.len())?;
        let stream = self
            .keeper
            .work_stream(self.device, "download from memory of no stream")?;
        if self.no_bytes() {
            return Ok(());
        }
        // SAFETY: the view's window is live memory of its stream's device, borrowed for 'a (its
        // shape checked when it was cut); `out` holds every row, back to back.
        unsafe { stream.download(self.region(), bytemuck::cast_slice_mut(out)) }
    }

    /// The rows as host slices, on the host backend; `PoolError::Unsupported` on a GPU. Each of
    /// the `rows()` slices holds `cols()` elements, zero-sized ones included (they take no memory).
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let units = BufferPool::new(&stream).get_buffer::<()>(3, 4)?;
    /// let lens: Vec<usize> = units.view().host_rows()?.map(|row| row.len()).collect();
    /// assert_eq!(lens, [4, 4, 4]);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub fn host_rows(self) -> Result<impl Iterator<Item = &'a [T]>, PoolError> {
        check_host(self.device)?;
        let Window {
            ptr,
            rows,
            cols,
            pitch,
            ..
        } = self.window;
        Ok((0..rows).map(move |r| {
            if size_of::<T>() == 0 {
                // Zero-sized elements take no memory, so their buffers have no address; a row is
                // still `cols` of them.
                // SAFETY: a slice of zero-sized `T`s covers no byte: any non-null address aligned
                // for `T` (`dangling`) holds it, at any length, and `T: Pod` has its one value.
                return unsafe {
                    std::slice::from_raw_parts(NonNull::<T>::dangling().as_ptr(), cols)
                };
            }
            if ptr == 0 {
                // An empty view has no address, and a slice may not be built on a null one, even
                // an empty slice (debug builds' UB check caught it).
                return &[][..];
            }
            // SAFETY: on the host backend the address is host memory of a buffer borrowed for 'a;
            // row `r` of the view holds `cols` initialised (zeroed or written) `T`s inside the
            // buffer (a region is checked against its parent's shape). It is aligned for `T`:
            // `align_of::<T>()` is at most MAX_ELEMENT_ALIGN (checked by `Layout::of`), every
            // buffer's address is a multiple of it (a stack block starts on a multiple of its
            // layout's `block_align`, itself a multiple of `align_of::<T>()`, in stacks that are
            // 512-aligned on the host, as driver allocations are; fallback allocations are checked
            // by `validate`), so is the pitch (a multiple of the texture alignment, of
            // `size_of::<T>()`, or checked), and a region starts a whole number of elements into a
            // row. The shared borrow keeps writers out.
            unsafe { std::slice::from_raw_parts((ptr as usize + r * pitch) as *const T, cols) }
        }))
    }
}

impl<'a, T: Pod> GpuViewMut<'a, T> {
    /// A read-only view of the same elements, taking this view (and its borrow) with it:
    /// `buf.view_mut().into_view().roi(..)` outlives the temporary.
    pub fn into_view(self) -> GpuView<'a, T> {
        GpuView::new(self.window, self.device, self.keeper)
    }

    /// A read-only view of the same elements, for as long as this one is borrowed.
    pub fn as_view(&self) -> GpuView<'_, T> {
        GpuView::new(self.window, self.device, self.keeper)
    }

    /// The writable region `rows x cols`, taking this view (and its borrow) with it: a region of
    /// a region kept in a variable, `buf.row_range_mut(2..6)?.into_roi_mut(0..2, 1..3)?`.
    pub fn into_roi_mut(
        self,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<GpuViewMut<'a, T>, PoolError> {
        let window = self.window.region::<T>(rows, cols)?;
        Ok(GpuViewMut::new(window, self.device, self.keeper))
    }

    /// The elements as one writable row, taking this view (and its borrow) with it;
    /// `PoolError::NotContinuous` for padded rows.
    pub fn into_1d_mut(self) -> Result<GpuViewMut<'a, T>, PoolError> {
        let window = self.window.flat::<T>()?;
        Ok(GpuViewMut::new(window, self.device, self.keeper))
    }

    /// Copies `data` (`rows * cols` elements, row-major) into the view, on its stream, and waits
    /// until `data` has been read ([`GpuWrite::upload`](crate::GpuWrite::upload)).
    pub(crate) fn upload(&mut self, data: &[T]) -> Result<(), PoolError> {
        self.check_len(data.len())?;
        let stream = self
            .keeper
            .work_stream(self.device, "upload to memory of no stream")?;
        if self.no_bytes() {
            return Ok(());
        }
        // SAFETY: the view's window is live memory of its stream's device, which the exclusive
        // borrow keeps from other writes; `data` holds every row, back to back.
        unsafe { stream.upload(self.region(), bytemuck::cast_slice(data)) }
    }

    /// Sets every element to `value`, on the view's stream (OpenCV's `setTo`); a region's
    /// parent keeps its other columns.
    pub(crate) fn set_to(&mut self, value: T) -> Result<(), PoolError> {
        let stream = self
            .keeper
            .work_stream(self.device, "set_to on memory of no stream")?;
        if self.no_bytes() {
            return Ok(());
        }
        // SAFETY: the view's live window, borrowed exclusively; the pattern is one element, which
        // divides the row width.
        unsafe { stream.fill(self.region(), bytemuck::bytes_of(&value)) }
    }

    /// Copies `src` (same shape, same device) into this view, on this view's stream.
    ///
    /// When `src` is queued on another stream, the copy waits for the work queued there so far
    /// (so it reads what that work wrote), and `src`'s memory is not reused (or, for shared memory,
    /// written) until the copy is done. Neither stream blocks the host.
    pub(crate) fn copy_view(&mut self, src: GpuView<'_, T>) -> Result<(), PoolError> {
        let stream = self
            .keeper
            .work_stream(self.device, "copy_from into memory of no stream")?;
        let src_stream = src
            .keeper
            .work_stream(src.device, "copy_from memory of no stream")?;
        if src.device != self.device {
            return Err(PoolError::DeviceMismatch {
                expected: self.device,
                actual: src.device,
            });
        }
        let shape = |w: Window| (w.rows, w.cols);
        if shape(src.window) != shape(self.window) {
            return Err(PoolError::DimensionMismatch {
                dst: shape(self.window),
                src: shape(src.window),
            });
        }
        if self.no_bytes() {
            return Ok(());
        }
        let src_shared = matches!(src.keeper, Keeper::Shared(..));
        // SAFETY: both windows are live memory of this device, of one shape; the exclusive borrow
        // of `self` and the shared one of `src` cannot be of one buffer, and live buffers (and
        // regions of distinct buffers) never overlap.
        unsafe { stream.copy(self.region(), src.region(), src_stream, src_shared) }
    }

    /// Calls `f` with each row as a mutable host slice, on the host backend; `PoolError::Unsupported`
    /// on a GPU. `f` is called once per row with `cols()` elements, zero-sized ones included.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let mut image = BufferPool::new(&stream).get_buffer::<u16>(3, 4)?;
    /// image.view_mut().for_each_host_row_mut(|r, row| row.fill(r as u16))?;
    /// assert_eq!(image.to_vec()?, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub fn for_each_host_row_mut(
        &mut self,
        mut f: impl FnMut(usize, &mut [T]),
    ) -> Result<(), PoolError> {
        check_host(self.device)?;
        let Window {
            ptr,
            rows,
            cols,
            pitch,
            ..
        } = self.window;
        if size_of::<T>() == 0 {
            for r in 0..rows {
                // SAFETY: as in `GpuView::host_rows`: zero-sized elements cover no byte, so rows
                // at one dangling address do not overlap, and each is ours for the call.
                f(r, unsafe {
                    std::slice::from_raw_parts_mut(NonNull::<T>::dangling().as_ptr(), cols)
                });
            }
            return Ok(());
        }
        if ptr == 0 {
            return Ok(());
        }
        for r in 0..rows {
            // SAFETY: as in `GpuView::host_rows` (bounds, address, pitch and alignment), and the
            // view's exclusive borrow of the buffer makes the row ours alone; rows do not overlap
            // since the pitch is at least the parent's row width, which the region's fits in.
            let row = unsafe {
                std::slice::from_raw_parts_mut((ptr as usize + r * pitch) as *mut T, cols)
            };
            f(r, row);
        }
        Ok(())
    }
}
