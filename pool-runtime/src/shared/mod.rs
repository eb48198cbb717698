//! Long-lived memory that no stream owns: [`SharedMat`], for model weights, lookup tables and
//! anything else read by many streams on many threads.
//!
//! A [`GpuMat`](crate::compat::opencv::GpuMat) borrows its stream, and a stream is used by one thread at a time, so
//! a `GpuMat` cannot be shared by two workers, nor stored beside its stream in a struct. A
//! `SharedMat` belongs to its device instead: it is `Send + Sync`, every access names the stream it
//! runs on ([`read`](SharedMat::read) with `&self`, [`write`](SharedMat::write) with `&mut self`),
//! and the pool orders the accesses across streams: a read waits on the GPU for the last write, a
//! write for the last write and every read since. A read ends with a ticket of its stream (no
//! driver call); a write that finds a read whose stream has not synchronized or downloaded since
//! waits for that stream on the host, once, and the memory's later reads record events, which
//! later writes wait for on the GPU. The access guards
//! implement [`GpuRead`](crate::GpuRead) / [`GpuWrite`](crate::GpuWrite), so they go wherever a
//! buffer does: kernel arguments, `copy_from`, uploads, cudarc's device-memory traits.
//!
//! ```
//! use std::sync::Arc;
//! use std::thread;
//! use gpu_pool::{Device, GpuRead, GpuWrite, shared::SharedMat, Stream};
//! let device = Device::host();
//! let loader = Stream::new(&device)?;
//! let mut weights = SharedMat::<f32>::new(&device, 4, 8)?;
//! weights.write(&loader)?.upload(&[0.5; 32])?;     // written on one stream ...
//! let weights = Arc::new(weights);
//! let sums = (0..2).map(|_| {
//!     let (device, weights) = (device.clone(), Arc::clone(&weights));
//!     thread::spawn(move || {
//!         let stream = Stream::new(&device)?;       // ... read on others, on other threads
//!         let w = weights.read(&stream)?;
//!         Ok::<f32, gpu_pool::PoolError>(w.to_vec()?.iter().sum())
//!     })
//! });
//! for sum in sums {
//!     assert_eq!(sum.join().unwrap()?, 16.0);
//! }
//! # Ok::<(), gpu_pool::PoolError>(())
//! ```
//!
//! Inside a [`Stream::capture`](crate::Stream::capture), an access is recorded into the graph: the
//! host waits for the accesses it conflicts with before the capture records it (a capture cannot
//! wait on outside work), and every replay of the graph is an access of its own, ordered on the
//! graph's stream like one made outside a capture: a replay waits for the writes queued before
//! it, and later accesses wait for the replay, also while the graph lives (a capture that took
//! the memory through an `RwLock` lets writers in between replays). A replay borrows no
//! `SharedMat`, so it can be launched while another thread holds a guard whose work is not all
//! queued yet: such a replay is refused with `CaptureError::SharedAccessOpen` (a write guard open,
//! for a graph that reads; any guard, for one that writes), and nothing is queued. Hold the lock
//! that guards the `SharedMat` across the launch (its `RwLock`'s read lock for a graph that reads,
//! its write lock for one that writes), and only a guard that never ended can refuse it: one that
//! was forgotten (`mem::forget`), one dropped while its stream was captured outside
//! `Stream::capture`, or one begun before a capture of its stream and dropped inside it. Such an
//! access stays open until an eager access that conflicts with it (a write, for an open read)
//! waits for its stream and closes it.

mod memory;

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;

use crate::base::error::CaptureError;
use crate::base::error::PoolError;
use crate::base::layout::Layout;
use crate::core::capturing;
use crate::core::device::Device;
use crate::core::graph_key::{GraphKey, GraphKeys};
use crate::core::stream::Stream;

use crate::core::view::{GpuView, GpuViewMut, Keeper, Window};
use memory::{Access, SharedMemory};

/// A shared array's memory is a driver allocation of its own, aligned as the driver aligns it: no
/// stack block, so no packing to choose.
const DRIVER: usize = crate::core::config::Packing::Cuda.block_align();

/// A 2D array of `T` in device memory that no stream owns: `Send + Sync`, read from any stream on
/// any thread through [`read`](Self::read), written through [`write`](Self::write) (`&mut`), with
/// the order across streams kept by the pool. See the [module docs](crate::shared).
///
/// Its memory comes from the driver (`cuMemAllocPitch`, counted), as [`GpuMat::new`]'s does, and
/// goes back when the `SharedMat` and every graph that accessed it are dropped, once the work
/// queued on it is done.
///
/// [`GpuMat::new`]: crate::compat::opencv::GpuMat::new
pub struct SharedMat<T> {
    memory: Arc<SharedMemory>,
    rows: usize,
    cols: usize,
    pitch: usize,
    _elem: PhantomData<T>,
}

impl<T: Pod> SharedMat<T> {
    /// A `rows x cols` array on `device`, not initialised (zeroed on the host backend). Pitched
    /// like a [`GpuMat::new`](crate::compat::opencv::GpuMat::new) with more than one row and column.
    ///
    /// `CaptureError::Allocates` while a CUDA graph is captured on this thread.
    pub fn new(device: &Device, rows: usize, cols: usize) -> Result<SharedMat<T>, PoolError> {
        let layout = Layout::of::<T>(rows, cols, device.backend().texture_alignment(), DRIVER)?;
        let (memory, pitch) = allocate(device, &layout)?;
        Ok(SharedMat::with(memory, rows, cols, pitch))
    }

    /// [`SharedMat::new`] with no padding between rows (step `cols * size_of::<T>()`), as
    /// [`BufferPool::get_buffer_packed`](crate::compat::opencv::BufferPool::get_buffer_packed): for weights
    /// handed to cuBLAS and matrices of few columns.
    pub fn new_packed(
        device: &Device,
        rows: usize,
        cols: usize,
    ) -> Result<SharedMat<T>, PoolError> {
        let len = crate::base::layout::packed_len::<T>(rows, cols)?;
        let layout = Layout::of::<T>(1, len, device.backend().texture_alignment(), DRIVER)?;
        let (memory, _) = allocate(device, &layout)?;
        Ok(SharedMat::with(memory, rows, cols, cols * size_of::<T>()))
    }

    /// [`SharedMat::new`] on `stream`'s device, filled from `data` (`rows * cols` elements,
    /// row-major) on `stream`.
    pub fn from_host(
        stream: &Stream,
        rows: usize,
        cols: usize,
        data: &[T],
    ) -> Result<SharedMat<T>, PoolError> {
        let mut mat = SharedMat::new(stream.device(), rows, cols)?;
        mat.write(stream)?.whole_mut().upload(data)?;
        Ok(mat)
    }

    fn with(memory: SharedMemory, rows: usize, cols: usize, pitch: usize) -> SharedMat<T> {
        SharedMat {
            memory: Arc::new(memory),
            rows,
            cols,
            pitch,
            _elem: PhantomData,
        }
    }

    /// Reads on `stream`: work queued on `stream` while the guard lives runs after the last write
    /// (whatever stream queued it); writes after the guard is dropped wait for that work.
    ///
    /// `PoolError::DeviceMismatch` for a stream of another device; `CaptureError::Elsewhere`
    /// if the stream is being captured by anything but its own `capture`.
    pub fn read<'a>(&'a self, stream: &'a Stream) -> Result<SharedRead<'a, T>, PoolError> {
        let in_capture = self.begin(stream, Access::Read)?;
        Ok(SharedRead {
            access: Guard {
                memory: &self.memory,
                stream,
                access: Access::Read,
                in_capture,
            },
            window: self.window(),
            _elem: PhantomData,
        })
    }

    /// Writes on `stream`: work queued on `stream` while the guard lives runs after the last write
    /// and every read since; later reads and writes, on any stream, wait for it.
    ///
    /// A read whose stream has not synchronized (or downloaded) since may still be queued: the
    /// host waits for that stream, once for this memory (its later reads record events, waited
    /// for on the GPU). So a reader stream must not have queued work that waits on this thread
    /// (an NCCL collective whose peer this thread launches, say): write such memory before the
    /// readers start, or from a thread that does not feed them. `CaptureError::Elsewhere`
    /// while that reader stream is being captured (write after the capture ends); the errors of
    /// [`read`](Self::read) otherwise.
    pub fn write<'a>(&'a mut self, stream: &'a Stream) -> Result<SharedWrite<'a, T>, PoolError> {
        let in_capture = self.begin(stream, Access::Write)?;
        Ok(SharedWrite {
            access: Guard {
                memory: &self.memory,
                stream,
                access: Access::Write,
                in_capture,
            },
            window: self.window(),
            _elem: PhantomData,
        })
    }

    /// Begins an access: whether it was begun inside `stream`'s own capture.
    fn begin(&self, stream: &Stream, access: Access) -> Result<bool, PoolError> {
        let device = self.memory.device();
        if stream.device() != device {
            return Err(PoolError::DeviceMismatch {
                expected: device.id(),
                actual: stream.device().id(),
            });
        }
        stream.work_stream(match access {
            Access::Read => "SharedMat::read",
            Access::Write => "SharedMat::write",
        })?;
        self.memory.begin(stream, access)
    }

    fn window(&self) -> Window {
        Window {
            ptr: self.memory.ptr(),
            rows: self.rows,
            cols: self.cols,
            pitch: self.pitch,
            owns_gaps: true,
        }
    }

    /// Rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    #[must_use]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes from the start of one row to the next.
    #[must_use]
    pub fn step(&self) -> usize {
        self.pitch
    }

    /// The device the memory is on.
    #[must_use]
    pub fn device(&self) -> &Device {
        self.memory.device()
    }
}

/// A driver allocation of `layout` on `device` (none for an empty one), and its pitch.
fn allocate(device: &Device, layout: &Layout) -> Result<(SharedMemory, usize), PoolError> {
    if layout.is_empty() {
        // SAFETY: no allocation to own.
        return Ok((unsafe { SharedMemory::adopt(device, 0) }, layout.pitch));
    }
    if capturing::on_this_thread() {
        return Err(crate::core::graph_key::refusal(CaptureError::Allocates {
            what: "SharedMat::new",
            context: None,
        }));
    }
    let storage = device.storage();
    let (ptr, pitch) = device.or_reclaim(|| {
        if layout.is_pitched() {
            storage.alloc_pitch(layout.width_bytes, layout.rows, None)
        } else {
            Ok((storage.alloc(layout.bytes, None)?, layout.pitch))
        }
    })?;
    // SAFETY: allocated just above from this device's storage, used by no one yet.
    let memory = unsafe { SharedMemory::adopt(device, ptr) };
    if !layout.is_aligned(ptr, pitch) {
        // Dropping `memory` frees it. Not seen on any driver; checked since host slices of the
        // rows would be misaligned.
        return Err(PoolError::Unsupported {
            device: device.id(),
            what: "a driver allocation that is not aligned for the element type",
        });
    }
    Ok((memory, pitch))
}

impl<T> fmt::Debug for SharedMat<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedMat")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("step", &self.pitch)
            .field("memory", &self.memory)
            .finish()
    }
}

/// An access under way: ended, on its stream, when dropped.
struct Guard<'a> {
    memory: &'a Arc<SharedMemory>,
    stream: &'a Stream,
    access: Access,
    /// Begun inside the stream's own capture: where its end finds it.
    in_capture: bool,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.memory.end(self.stream, self.access, self.in_capture) {
            // No event marks the access: the host waits for it instead.
            crate::base::event::error!(stream = self.stream.id(), error = %e, "ending a shared-memory access failed; waiting for the stream");
            let _ = self.stream.synchronize();
        }
    }
}

/// A read of a [`SharedMat`] on one stream, from [`SharedMat::read`]: a [`GpuRead`](crate::GpuRead)
/// for kernels, copies and downloads, ordered after the last write.
#[must_use = "the access ends when the guard is dropped"]
pub struct SharedRead<'a, T> {
    access: Guard<'a>,
    window: Window,
    _elem: PhantomData<&'a T>,
}

/// A write of a [`SharedMat`] on one stream, from [`SharedMat::write`]: a
/// [`GpuWrite`](crate::GpuWrite), ordered after every earlier access.
#[must_use = "the access ends when the guard is dropped"]
pub struct SharedWrite<'a, T> {
    access: Guard<'a>,
    window: Window,
    _elem: PhantomData<&'a mut T>,
}

impl<'a, T> SharedRead<'a, T> {
    /// The memory as a view on the guard's stream: [`GpuRead::view`](crate::GpuRead::view).
    pub(crate) fn whole(&self) -> GpuView<'_, T> {
        let stream = self.access.stream;
        GpuView::new(self.window, stream.device().id(), Keeper::Shared(stream))
    }

    /// The address field kernel arguments point at.
    pub(crate) fn ptr_field(&self) -> &u64 {
        &self.window.ptr
    }
}

impl<'a, T> SharedWrite<'a, T> {
    /// The memory as a view on the guard's stream: [`GpuRead::view`](crate::GpuRead::view).
    pub(crate) fn whole(&self) -> GpuView<'_, T> {
        let stream = self.access.stream;
        GpuView::new(self.window, stream.device().id(), Keeper::Shared(stream))
    }

    /// The memory as a writable view on the guard's stream:
    /// [`GpuWrite::view_mut`](crate::GpuWrite::view_mut).
    pub(crate) fn whole_mut(&mut self) -> GpuViewMut<'_, T> {
        let stream = self.access.stream;
        GpuViewMut::new(self.window, stream.device().id(), Keeper::Shared(stream))
    }

    /// The address field kernel arguments point at.
    pub(crate) fn ptr_field(&self) -> &u64 {
        &self.window.ptr
    }
}

macro_rules! guard_debug {
    ($($guard:ident),*) => {$(
        impl<T> fmt::Debug for $guard<'_, T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($guard))
                    .field("rows", &self.window.rows)
                    .field("cols", &self.window.cols)
                    .field("stream", &self.access.stream.id())
                    .finish()
            }
        }
    )*};
}
guard_debug!(SharedRead, SharedWrite);

macro_rules! key_guard {
    ($($guard:ident),*) => {$(
        // SAFETY: a guard lends its window (address, shape, step, element) and nothing else.
        unsafe impl<T: Pod> GraphKey for $guard<'_, T> {
            fn graph_key(&self, keys: &mut GraphKeys) {
                keys.buffer(self);
            }
        }
    )*};
}
key_guard!(SharedRead, SharedWrite);

// SAFETY: its memory's address and its shape: what a replay's accesses of it reach (the accesses
// themselves are ordered by the replay hook its capture noted).
unsafe impl<T: Pod> GraphKey for SharedMat<T> {
    fn graph_key(&self, keys: &mut GraphKeys) {
        keys.word(self.memory.ptr());
        keys.word(self.rows as u64);
        keys.word(self.cols as u64);
        keys.word(self.pitch as u64);
        keys.word(size_of::<T>() as u64);
        keys.names_memory(self.memory.ptr(), (self.rows * self.pitch) as u64);
    }
}

impl<T: Pod> crate::core::access::GpuRead<T> for SharedRead<'_, T> {
    fn addr_ref(&self) -> &u64 {
        self.ptr_field()
    }

    fn view(&self) -> GpuView<'_, T> {
        SharedRead::whole(self)
    }
}

impl<T: Pod> crate::core::access::GpuRead<T> for SharedWrite<'_, T> {
    fn addr_ref(&self) -> &u64 {
        self.ptr_field()
    }

    fn view(&self) -> GpuView<'_, T> {
        SharedWrite::whole(self)
    }
}

impl<T: Pod> crate::core::access::GpuWrite<T> for SharedWrite<'_, T> {
    fn view_mut(&mut self) -> GpuViewMut<'_, T> {
        SharedWrite::whole_mut(self)
    }
}

#[cfg(test)]
mod tests {
    /// Shared memory crosses threads (its point); the access guards stay with their stream's.
    #[test]
    fn shared_memory_is_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<super::SharedMat<f32>>();
        send_sync::<super::SharedMat<[u8; 3]>>();
    }
}
