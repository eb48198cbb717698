//! Pool memory as cudarc device memory: [`LentSlice`] and [`LentSliceMut`] implement cudarc's
//! `DeviceSlice`, `DevicePtr` and `DevicePtrMut`, so pool buffers and regions go wherever cudarc
//! takes device memory: cuBLAS, cuFFT, cuDNN, its copies and fills.
//!
//! cudarc's traits name the stream the memory is ordered on, which only a CUDA buffer has, so a
//! buffer lends itself through [`GpuRead::as_cudarc`](crate::GpuRead::as_cudarc) and
//! [`GpuWrite::as_cudarc_mut`](crate::GpuWrite::as_cudarc_mut), which return `PoolError::Unsupported`
//! on the host backend.
//!
//! cudarc's traits describe a flat run of `len` elements, and its safe calls (copies, fills) use
//! all of it. So a 2D buffer is lent as the run from its first element to its last, its padding
//! included (which it owns): pass [`LentSlice::ld`] as the leading dimension where the callee takes
//! one (cuBLAS). A region narrower than its buffer would lend its neighbours' elements between its
//! rows, so it is refused with `PoolError::NotContinuous` (rows of every column, and 1-row regions,
//! are lent); copy it into a buffer of its own first.
//!
//! The ordering contract of cudarc's traits holds: a library call on the buffer's own stream needs
//! nothing more; on another stream, that stream first waits for the work queued on the buffer's
//! stream (an event, no host wait), and the call is waited for before the returned guard drops,
//! since the buffer's memory is reused in its own stream's order.
//!
//! Graph capture: a call on the buffer's own stream inside that stream's
//! [`Stream::capture`](crate::Stream::capture) is recorded like any pooled work. A call that would
//! cross streams while either is capturing, or one on a stream captured by anything else, cannot
//! be ordered without pulling pool memory into a graph the pool does not reserve it for: every
//! capture it would reach is invalidated, so no graph of it is ever made (`Stream::capture` then
//! reports `CaptureError::CrossStream`). Where the call would run at once, unordered with
//! work queued before someone else's capture of the buffer's stream, it gets address 0: cudarc's
//! copies and fills are refused by the driver, and a kernel given it faults.
//!
//! ```no_run
//! use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, Stream};
//! use gpu_pool::interop::cudarc::driver::DevicePtr;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let stream = Stream::new(&Device::cuda(0)?)?;
//! let mut x = BufferPool::new(&stream).get_buffer_1d::<f32>(1024)?;
//! x.set_to(1.0)?;
//! let cuda = stream.cudarc()?;
//! let host: Vec<f32> = cuda.clone_dtoh(&x.as_cudarc()?)?; // cudarc's own copy
//! assert_eq!(host, vec![1.0; 1024]);
//! # Ok(()) }
//! ```

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, result, sys};

use crate::core::lent::{LentSlice, LentSliceMut};
use crate::core::stream::Stream;

/// The address for work queued on `user`, ordered against the memory's own stream `own` (the pool
/// stream `pool`'s cudarc stream).
fn ordered<'a>(
    ptr: u64,
    own: &Arc<CudaStream>,
    pool: &Stream,
    user: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>) {
    let same = own.cu_stream() == user.cu_stream();
    let user_capturing = is_capturing(user);
    if same {
        // Recorded into the pool stream's own capture, the memory is reserved for the graph's
        // life; recorded into any other capture, it is not.
        if user_capturing && !pool.in_own_capture() {
            // The call joins the capture refuse() invalidates: the driver refuses to queue it.
            refuse(user, own);
        }
        return (ptr, SyncOnDrop::Record(None));
    }
    let foreign = !pool.in_own_capture() && is_capturing(own);
    if user_capturing || pool.in_own_capture() || foreign {
        // An event between the two would join one stream to the other's capture, or make a
        // capture wait on work outside it. Refused: every capture involved is invalidated, so
        // nothing replays the call, and a call into one is not even queued.
        refuse(user, own);
        if foreign && !user_capturing {
            // The call would run now, unordered with what the memory's stream queued before
            // someone else's capture began, and nothing could wait for that: no address at all
            // (the driver refuses copies and fills to it; kernels given it fault).
            return (0, SyncOnDrop::Record(None));
        }
        // Run now (on `user`, outside any capture) the call races nothing: a pool capture waited
        // for its stream before it began, its own work never runs, and, failing, it waits for
        // the device before its memory is reused.
        return (ptr, SyncOnDrop::Record(None));
    }
    // `user` must see what `own` has queued so far, and where no event can say so, the host waits
    // for it instead. Raw calls: cudarc's would return an error its context holds for another
    // call instead of waiting.
    // SAFETY: both streams are live (borrowed) streams of one context, current in cudarc's
    // calling function; the event is made, recorded, waited on and destroyed here.
    unsafe {
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let waited = result::event::create(flags).and_then(|event| {
            let wait = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
            let done = result::event::record(event, own.cu_stream())
                .and_then(|()| result::stream::wait_event(user.cu_stream(), event, wait));
            let _ = result::event::destroy(event);
            done
        });
        if waited.is_err() && result::stream::synchronize(own.cu_stream()).is_err() {
            // Neither an event nor the host can order the call: it gets no address at all.
            return (0, SyncOnDrop::Record(None));
        }
    }
    // ... and `own` may hand the memory out again only once `user`'s use is done.
    (ptr, SyncOnDrop::sync_stream(user))
}

/// Whether work queued on `stream` now is recorded into a graph; a stream whose status cannot be
/// read counts as capturing, so the call is refused rather than risked.
fn is_capturing(stream: &CudaStream) -> bool {
    // SAFETY: `stream` is a live stream (borrowed); the query reads its state and nothing else.
    let status = unsafe { result::stream::is_capturing(stream.cu_stream()) };
    status.is_ok_and(|s| s != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        || status.is_err()
}

/// Fails the captures a call on `user` would reach: every capture under way on either stream is
/// invalidated (a stream query is illegal while capturing: the driver then makes no graph,
/// whoever ends the capture and however often, and queues nothing more into it), and a pool
/// capture on this thread is marked, for `Stream::capture` to report
/// `CaptureError::CrossStream`.
fn refuse(user: &CudaStream, own: &CudaStream) {
    for s in [user, own] {
        if is_capturing(s) {
            // SAFETY: a live stream (borrowed); the query changes nothing but the capture's
            // validity, which is what is wanted.
            let _ = unsafe { sys::cuStreamQuery(s.cu_stream()) };
        }
    }
    crate::core::capturing::note_refused();
}

/// cudarc's `DeviceSlice` and `DevicePtr`, alike on both lent kinds. Only `LentSliceMut` adds
/// `DevicePtrMut`.
macro_rules! lent {
    ($($lent:ident),*) => {$(
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
                ordered(self.ptr, self.stream, self.pool, stream)
            }
        }
    )*};
}
lent!(LentSlice, LentSliceMut);

impl<T> DevicePtrMut<T> for LentSliceMut<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        ordered(self.ptr, self.stream, self.pool, stream)
    }
}
