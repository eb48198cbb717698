//! Device buffers, one type per lifetime rule: a [`Temp`] is a stack temporary (LIFO on its
//! stream), a [`DeviceMat`] a driver allocation (released in any order). Both are a `Lease` with an
//! element type, so they cost the same to hold and to take.

use std::marker::PhantomData;

use bytemuck::Pod;

use crate::base::error::PoolError;
use crate::base::source::CallSite;
use crate::core::stream::{Lease, Stream};

/// The API every buffer type over a `Lease` shares (`Temp`, `DeviceMat`, OpenCV's `GpuMat`):
/// its shape and source, its views, `record_stream`, `Debug`, and [`GpuRead`](crate::GpuRead) /
/// [`GpuWrite`](crate::GpuWrite). `$name` must be `#[repr(transparent)]` over `lease: Lease<'s>`
/// and `_elem: PhantomData<T>`. Each type writes its own `release`, so the compiler's note on a
/// use after it points at the type's code, not into this macro.
macro_rules! lease_buffer {
    ($name:ident) => {
        impl<'s, T> $name<'s, T> {
            /// The buffer of `lease`, which a take for `T` made.
            #[inline(always)]
            pub(crate) fn on(lease: $crate::core::stream::Lease<'s>) -> $name<'s, T> {
                $name {
                    lease,
                    _elem: ::std::marker::PhantomData,
                }
            }

            /// The lease, for another buffer type over the same memory.
            #[inline(always)]
            #[allow(dead_code, reason = "not every buffer type converts into another")]
            pub(crate) fn into_lease(self) -> $crate::core::stream::Lease<'s> {
                self.lease
            }

            /// The address field kernel arguments point at.
            pub(crate) fn ptr_field(&self) -> &u64 {
                self.lease.ptr_field()
            }
        }

        impl<'s, T: ::bytemuck::Pod> $name<'s, T> {
            /// Whether the rows follow each other with no padding.
            #[must_use]
            pub fn is_continuous(&self) -> bool {
                self.window().is_continuous::<T>()
            }

            /// Where the memory came from.
            #[must_use]
            pub fn source(&self) -> $crate::base::source::Source {
                self.lease.source()
            }

            /// The stream the buffer belongs to; its operations run there.
            #[must_use]
            pub fn stream(&self) -> &'s $crate::core::stream::Stream {
                self.lease.stream()
            }

            /// Tells the pool that work queued on `user` (another stream of the same device) so
            /// far uses this buffer: when the buffer is released, its stream waits for that work
            /// before the memory can be handed out again (PyTorch's `record_stream`). Call it
            /// after queuing the last such work. Without it, memory is reused in the owning
            /// stream's order only.
            pub fn record_stream(
                &self,
                user: &$crate::core::stream::Stream,
            ) -> Result<(), $crate::base::error::PoolError> {
                $crate::core::buffer::record_stream(self.stream(), user)
            }

            fn window(&self) -> $crate::core::view::Window {
                $crate::core::view::Window {
                    ptr: self.lease.ptr(),
                    rows: self.lease.rows(),
                    cols: self.lease.cols(),
                    pitch: self.lease.pitch(),
                    owns_gaps: true,
                }
            }

            /// A read-only view of the whole buffer: [`GpuRead::view`](crate::GpuRead::view).
            pub(crate) fn whole(&self) -> $crate::core::view::GpuView<'_, T> {
                $crate::core::view::GpuView::new(
                    self.window(),
                    self.stream().device().id(),
                    $crate::core::view::Keeper::Stream(self.stream()),
                )
            }

            /// A writable view of the whole buffer:
            /// [`GpuWrite::view_mut`](crate::GpuWrite::view_mut).
            pub(crate) fn whole_mut(&mut self) -> $crate::core::view::GpuViewMut<'_, T> {
                $crate::core::view::GpuViewMut::new(
                    self.window(),
                    self.stream().device().id(),
                    $crate::core::view::Keeper::Stream(self.stream()),
                )
            }
        }

        impl<T: ::bytemuck::Pod> $crate::core::access::GpuRead<T> for $name<'_, T> {
            fn addr_ref(&self) -> &u64 {
                self.ptr_field()
            }

            fn view(&self) -> $crate::core::view::GpuView<'_, T> {
                $name::whole(self)
            }
        }

        impl<T: ::bytemuck::Pod> $crate::core::access::GpuWrite<T> for $name<'_, T> {
            fn view_mut(&mut self) -> $crate::core::view::GpuViewMut<'_, T> {
                $name::whole_mut(self)
            }
        }

        impl<T> ::std::fmt::Debug for $name<'_, T> {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("rows", &self.lease.rows())
                    .field("cols", &self.lease.cols())
                    .field("step", &self.lease.pitch())
                    .field("ptr", &format_args!("{:#x}", self.lease.ptr()))
                    .field("source", &self.lease.source())
                    .field("stream", &self.lease.stream().id())
                    .finish()
            }
        }
    };
}
pub(crate) use lease_buffer;

/// `record_stream` of a buffer of `stream`.
pub(crate) fn record_stream(stream: &Stream, user: &Stream) -> Result<(), PoolError> {
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

/// A stack temporary: a 2D array of `T` taken from its stream's stack (or, when the stack is full,
/// from the stream's fallback allocator), what `buffer!` and [`Stream::temp`] hand out.
///
/// **Rule: LIFO on its stream.** Temporaries go back in the reverse order they were taken (the DSL
/// makes that so); one released out of order is reclaimed once those above it go back, and counted
/// as a violation (an error in strict mode). Dropping it gives the memory back;
/// [`release`](Temp::release) does the same and reports errors.
///
/// ```
/// use gpu_pool::{Device, GpuRead, GpuWrite, Source, Stream};
/// let stream = Stream::new(&Device::host())?;
/// let mut image = stream.temp::<[u8; 3]>(480, 640)?; // 2D, pitched
/// let sums = stream.temp_1d::<f32>(480)?;            // contiguous
/// assert_eq!(image.step(), 2048);                    // align_up(640 * 3, 512)
/// assert_eq!(sums.source(), Source::Stack);
/// image.set_to([0, 0, 0])?;
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
///
/// A temporary borrows its stream, so it cannot outlive it or move to another thread:
/// ```compile_fail
/// use gpu_pool::{Device, Stream};
/// let buf = {
///     let stream = Stream::new(&Device::host()).unwrap();
///     stream.temp_1d::<u8>(8).unwrap()
/// };
/// ```
#[must_use = "a temporary goes back to its stack when dropped: one never used is released at once"]
#[repr(transparent)]
pub struct Temp<'s, T> {
    /// The memory and its shape, which go back to the stream when the temporary is dropped.
    lease: Lease<'s>,
    _elem: PhantomData<T>,
}

lease_buffer!(Temp);

impl<T> Temp<'_, T> {
    /// Gives the memory back now and reports what went wrong: a driver error from the fallback's
    /// free, or, in strict mode, `PoolError::LifoViolation` (the memory is still reclaimed).
    pub fn release(self) -> Result<(), PoolError> {
        self.lease.release()
    }
}

/// A driver allocation: a 2D array of `T` with memory of its own (`cuMemAllocPitch`/`cuMemAlloc`),
/// for long-lived data such as inputs, outputs and weights.
///
/// **Rule: any order.** It follows no stack: drop it whenever, in any order with other buffers. Its
/// free is ordered on its stream (work queued there before the drop finishes first), and memory a
/// CUDA graph captured on that stream may use is kept until the graph is gone.
///
/// ```
/// use gpu_pool::{Device, DeviceMat, GpuRead, Source, Stream};
/// let stream = Stream::new(&Device::host())?;
/// let weights = DeviceMat::from_host(&stream, 2, 2, &[1.0f32, 2.0, 3.0, 4.0])?;
/// let scratch = stream.temp::<f32>(2, 2)?;
/// drop(weights);                                 // before the temporary: no stack, no order
/// assert_eq!(scratch.source(), Source::Stack);
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[must_use = "a buffer is freed when dropped: one never used is released at once"]
#[repr(transparent)]
pub struct DeviceMat<'s, T> {
    /// The memory and its shape, freed on the stream when the buffer is dropped.
    lease: Lease<'s>,
    _elem: PhantomData<T>,
}

lease_buffer!(DeviceMat);

impl<T> DeviceMat<'_, T> {
    /// Frees the memory now (ordered on its stream) and reports a driver error.
    pub fn release(self) -> Result<(), PoolError> {
        self.lease.release()
    }
}

impl<'s, T: Pod> DeviceMat<'s, T> {
    /// A `rows x cols` buffer of its own, uninitialised; its pitch is the driver's choice.
    #[track_caller]
    pub fn new(
        stream: &'s Stream,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceMat<'s, T>, PoolError> {
        let lease = stream.take_from_driver::<T>(rows, cols, CallSite::here(""))?;
        Ok(DeviceMat::on(lease))
    }

    /// [`DeviceMat::new`] with no padding between rows (its step is `cols * size_of::<T>()`):
    /// see [`Stream::temp_packed`].
    #[track_caller]
    pub fn new_packed(
        stream: &'s Stream,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceMat<'s, T>, PoolError> {
        let len = crate::base::layout::packed_len::<T>(rows, cols)?;
        let lease = stream.take_from_driver::<T>(1, len, CallSite::here(""))?;
        Ok(DeviceMat::on(lease.packed(rows, cols, size_of::<T>())))
    }

    /// [`DeviceMat::new`] filled from `data` (`rows * cols` elements, row-major).
    #[track_caller]
    pub fn from_host(
        stream: &'s Stream,
        rows: usize,
        cols: usize,
        data: &[T],
    ) -> Result<DeviceMat<'s, T>, PoolError> {
        let mut mat = DeviceMat::new(stream, rows, cols)?;
        mat.whole_mut().upload(data)?;
        Ok(mat)
    }

    /// [`DeviceMat::new_packed`] filled from `data` (`rows * cols` elements, row-major): a GEMM
    /// operand or weights handed to a library that expects packed rows.
    ///
    /// ```
    /// use gpu_pool::{Device, DeviceMat, GpuRead, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let w = DeviceMat::from_host_packed(&stream, 2, 3, &[1u16, 2, 3, 4, 5, 6])?;
    /// assert_eq!((w.step(), w.to_vec()?), (6, vec![1, 2, 3, 4, 5, 6]));
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    #[track_caller]
    pub fn from_host_packed(
        stream: &'s Stream,
        rows: usize,
        cols: usize,
        data: &[T],
    ) -> Result<DeviceMat<'s, T>, PoolError> {
        let mut mat = DeviceMat::new_packed(stream, rows, cols)?;
        mat.whole_mut().upload(data)?;
        Ok(mat)
    }
}

/// Stack temporaries.
impl Stream {
    /// A `rows x cols` [`Temp`]. With more than one row and column it is pitched: its
    /// [`step`](crate::GpuRead::step) is `cols * size_of::<T>()` rounded up to the texture alignment. A
    /// single row or column is contiguous. No element is initialised.
    ///
    /// From the stack when it fits (no lock, no heap allocation, no driver call), else from the
    /// stream's fallback allocator. The caller's line is its [`CallSite`]: errors, the sizing report
    /// and recordings name it.
    // Always inlined: returned through memory, the lease is stored in two halves and reloaded whole
    // by the caller, a store-forwarding stall that costs more than the rest of the take (measured:
    // 20 ns against 9 ns in a crate with the default 16 codegen units).
    #[inline(always)]
    #[track_caller]
    pub fn temp<T: Pod>(&self, rows: usize, cols: usize) -> Result<Temp<'_, T>, PoolError> {
        self.temp_at(rows, cols, CallSite::here(""))
    }

    /// A contiguous [`Temp`] of `len` elements (`1 x len`).
    #[inline(always)]
    #[track_caller]
    pub fn temp_1d<T: Pod>(&self, len: usize) -> Result<Temp<'_, T>, PoolError> {
        self.temp_at(1, len, CallSite::here(""))
    }

    /// A `rows x cols` [`Temp`] with no padding between its rows (OpenCV's `createContinuous`):
    /// its step is `cols * size_of::<T>()`, so it is lent to cuBLAS with a leading dimension of
    /// `cols` and flattens with `as_1d`. For GEMM operands, matrices of few columns and buffers
    /// handed to libraries that expect packed rows; [`temp`](Self::temp)'s padding is for 2D
    /// kernels that read image rows.
    ///
    /// ```
    /// use gpu_pool::{Device, GpuRead, Stream};
    /// let stream = Stream::new(&Device::host())?;
    /// let logits = stream.temp_packed::<f32>(256, 10)?;
    /// assert_eq!((logits.rows(), logits.cols(), logits.step()), (256, 10, 40)); // not 512
    /// assert!(logits.is_continuous());
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    #[inline(always)]
    #[track_caller]
    pub fn temp_packed<T: Pod>(&self, rows: usize, cols: usize) -> Result<Temp<'_, T>, PoolError> {
        self.temp_packed_at(rows, cols, CallSite::here(""))
    }

    /// [`temp`](Self::temp) asked for at `site` (what `buffer!` calls, naming itself).
    #[inline(always)]
    pub(crate) fn temp_at<T: Pod>(
        &self,
        rows: usize,
        cols: usize,
        site: CallSite,
    ) -> Result<Temp<'_, T>, PoolError> {
        self.take::<T>(rows, cols, site).map(Temp::on)
    }

    /// [`temp_packed`](Self::temp_packed) asked for at `site`.
    #[inline(always)]
    pub(crate) fn temp_packed_at<T: Pod>(
        &self,
        rows: usize,
        cols: usize,
        site: CallSite,
    ) -> Result<Temp<'_, T>, PoolError> {
        let len = crate::base::layout::packed_len::<T>(rows, cols)?;
        let lease = self.take::<T>(1, len, site)?;
        Ok(Temp::on(lease.packed(rows, cols, size_of::<T>())))
    }
}
