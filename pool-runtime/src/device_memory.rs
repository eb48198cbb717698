//! Pool memory as cudarc device memory: [`DeviceRef`] and [`DeviceMut`] implement cudarc's
//! `DeviceSlice`, `DevicePtr` and `DevicePtrMut`, so pool buffers and regions go wherever cudarc
//! takes device memory: cuBLAS, cuFFT, cuDNN, its copies and fills.
//!
//! cudarc's traits name the stream the memory is ordered on, which only a CUDA buffer has, so a
//! buffer lends itself through [`GpuMat::device_ref`](crate::GpuMat::device_ref) and
//! [`GpuMat::device_mut`](crate::GpuMat::device_mut), which return `PoolError::Unsupported` on the
//! host backend. A 2D buffer is lent as the run of memory from its first element to its last, step
//! included: pass [`DeviceRef::ld`] as the leading dimension.
//!
//! The ordering contract of cudarc's traits holds: a library call on the buffer's own stream needs
//! nothing more; on another stream, that stream first waits for the work queued on the buffer's
//! stream (an event, no host wait), and the call is waited for before the returned guard drops,
//! since the buffer's memory is reused in its own stream's order.
//!
//! ```no_run
//! use gpu_pool_runtime::{BufferPool, Device, Stream};
//! use gpu_pool_runtime::cudarc::driver::DevicePtr;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let stream = Stream::new(&Device::cuda(0)?)?;
//! let mut x = BufferPool::new(&stream).get_buffer_1d::<f32>(1024)?;
//! x.set_to(1.0)?;
//! let cuda = stream.cuda_stream().unwrap();
//! let host: Vec<f32> = cuda.clone_dtoh(&x.device_ref()?)?; // cudarc's own copy
//! assert_eq!(host, vec![1.0; 1024]);
//! # Ok(()) }
//! ```

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, sys};

use crate::error::{DeviceId, PoolError};
use crate::view::Window;

/// A buffer or region lent to cudarc for reading.
#[derive(Debug)]
pub struct DeviceRef<'a, T> {
    ptr: u64,
    len: usize,
    ld: usize,
    stream: &'a Arc<CudaStream>,
    _borrow: PhantomData<&'a T>,
}

/// A buffer or region lent to cudarc for reading and writing.
#[derive(Debug)]
pub struct DeviceMut<'a, T> {
    ptr: u64,
    len: usize,
    ld: usize,
    stream: &'a Arc<CudaStream>,
    _borrow: PhantomData<&'a mut T>,
}

/// The flat run a window covers, in elements, its leading dimension (elements between rows), and
/// the stream it is ordered on.
fn span<'a, T>(
    window: &Window,
    device: DeviceId,
    stream: Option<&'a Arc<CudaStream>>,
) -> Result<(usize, usize, &'a Arc<CudaStream>), PoolError> {
    let Some(stream) = stream else {
        return Err(PoolError::Unsupported {
            device,
            what: "cudarc device memory (DevicePtr) outside a CUDA stream",
        });
    };
    let size = size_of::<T>();
    if window.rows <= 1 || size == 0 || window.is_continuous::<T>() {
        // Cannot wrap: the buffer's layout checked `rows * cols`.
        return Ok((window.rows * window.cols, window.cols.max(1), stream));
    }
    if !window.pitch.is_multiple_of(size) {
        // No whole number of elements between rows: no leading dimension describes it.
        return Err(PoolError::NotContinuous {
            rows: window.rows,
            cols: window.cols,
            step: window.pitch,
        });
    }
    let ld = window.pitch / size;
    // Inside the buffer: the last row starts `(rows - 1) * pitch` bytes in and holds `cols`.
    Ok(((window.rows - 1) * ld + window.cols, ld, stream))
}

/// The address for work queued on `user`, ordered against the memory's own stream `own`.
fn ordered<'a>(ptr: u64, own: &Arc<CudaStream>, user: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
    if own.cu_stream() == user.cu_stream() {
        return (ptr, SyncOnDrop::Record(None));
    }
    // `user` must see what `own` has queued so far ...
    match own.record_event(None) {
        Ok(done) => user.context().record_err(user.wait(&done)),
        // ... and where no event can say so, the host waits for it instead.
        Err(e) => {
            user.context().record_err::<()>(Err(e));
            user.context().record_err(own.synchronize());
        }
    }
    // ... and `own` may hand the memory out again only once `user`'s use is done.
    (ptr, SyncOnDrop::sync_stream(user))
}

/// What both lent kinds have alike: a constructor from a view's window, the leading dimension,
/// and cudarc's `DeviceSlice` and `DevicePtr`. Only `DeviceMut` adds `DevicePtrMut`.
macro_rules! lent {
    ($($lent:ident),*) => {$(
        impl<'a, T> $lent<'a, T> {
            pub(crate) fn new(
                window: Window,
                device: DeviceId,
                stream: Option<&'a Arc<CudaStream>>,
            ) -> Result<Self, PoolError> {
                let (len, ld, stream) = span::<T>(&window, device, stream)?;
                Ok($lent {
                    ptr: window.ptr,
                    len,
                    ld,
                    stream,
                    _borrow: PhantomData,
                })
            }

            /// Elements from one row to the next: cuBLAS's leading dimension of a row-major
            /// matrix.
            pub fn ld(&self) -> usize {
                self.ld
            }
        }

        impl<T> DeviceSlice<T> for $lent<'_, T> {
            fn len(&self) -> usize {
                self.len
            }
            fn stream(&self) -> &Arc<CudaStream> {
                self.stream
            }
        }

        impl<T> DevicePtr<T> for $lent<'_, T> {
            fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
                ordered(self.ptr, self.stream, stream)
            }
        }
    )*};
}
lent!(DeviceRef, DeviceMut);

impl<T> DevicePtrMut<T> for DeviceMut<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        ordered(self.ptr, self.stream, stream)
    }
}
