//! `MixMemory` (TensorRT-style): a paired pinned-host and device buffer that grows lazily.
//!
//! `gpu::<T>(n)` and `cpu::<T>(n)` return the memory they hold when it is large enough and
//! reallocate, zero-filled, only when more is asked. Either side can wrap memory the caller owns.
//! Every allocation and free runs on the buffer's own device, whatever device the calling thread
//! has current.
//!
//! A thin layer: the host side is a [`HostMem<u8>`](HostMem), whose copy tracking (tickets, or
//! events) is the pair's. Copies between the sides are queued on a stream; host access,
//! reallocation, release and drop first wait for the copies still in flight (`HostMem`'s own
//! waits), so the host never races the device.

use bytemuck::Pod;

use crate::base::error::PoolError;
use crate::core::device::Device;
use crate::core::stream::Stream;
use crate::core::view::{GpuView, GpuViewMut, Keeper, Window};
use crate::host_mem::HostMem;
use crate::storage::backend::{DevPtr, RawStream, Region};

enum Host<'a> {
    None,
    /// Page-locked memory of the pair's own: its copies are tracked by `HostMem`.
    Pinned(HostMem<u8>),
    /// The caller's memory: every copy of it is waited for before returning.
    Borrowed(&'a mut [u8]),
}

enum Gpu {
    None,
    Owned {
        ptr: DevPtr,
        bytes: usize,
    },
    /// Not ours: never freed here.
    Wrapped {
        ptr: DevPtr,
        bytes: usize,
    },
}

/// A pinned-host buffer and a device buffer that grow on demand.
///
/// ```
/// use gpu_pool::{compat::mix::MixMemory, Device, GpuRead, PoolError, Stream};
/// let device = Device::private_host();
/// let stream = Stream::new(&device)?;
/// let mut mix = MixMemory::new(&device)?;
/// mix.cpu::<f32>(4)?.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
/// let binding = mix.gpu::<f32>(4)?.device_ptr(); // device side of the same size (TensorRT's binding)
/// mix.copy_to_gpu_async(&stream)?;               // queued on the stream
/// mix.cpu::<f32>(4)?.fill(0.0);                  // waits for the copy first
/// mix.copy_to_cpu_async(&stream)?;
/// assert_eq!(mix.cpu::<f32>(4)?, &[1.0, 2.0, 3.0, 4.0]);
/// assert_eq!(mix.reallocations(), 2);            // one per side; asking for less reuses them
/// assert_eq!(mix.gpu::<f32>(2)?.device_ptr(), binding);
/// assert_eq!((mix.reallocations(), mix.device_ptr()), (2, binding));
/// # Ok::<(), PoolError>(())
/// ```
pub struct MixMemory<'a> {
    device: Device,
    /// For zero-filling new device memory.
    own: RawStream,
    host: Host<'a>,
    gpu: Gpu,
    reallocations: u64,
}

// SAFETY: the host side is a `HostMem` (`Send`) or a borrowed slice (`Send`); device addresses are
// plain numbers; `own` is a driver stream handle usable from any thread. Nothing is shared with
// another owner.
unsafe impl Send for MixMemory<'_> {}

impl MixMemory<'static> {
    /// An empty pair on `device`; nothing is allocated until asked for.
    pub fn new(device: &Device) -> Result<MixMemory<'static>, PoolError> {
        Ok(MixMemory {
            device: device.clone(),
            own: device.backend().new_stream()?,
            host: Host::None,
            gpu: Gpu::None,
            reallocations: 0,
        })
    }
}

impl<'a> MixMemory<'a> {
    /// A pair whose host side is `host`, memory the caller owns (pinned or not). Asking for more
    /// than it holds replaces it with pinned memory of the pair's own.
    pub fn wrap_cpu(device: &Device, host: &'a mut [u8]) -> Result<MixMemory<'a>, PoolError> {
        let mut mix = MixMemory::new(device)?;
        mix.host = Host::Borrowed(host);
        Ok(mix)
    }

    /// Uses `bytes` of device memory at `ptr`, which the caller owns, as the device side.
    ///
    /// # Safety
    /// `ptr..ptr + bytes` is live device memory of this pair's device, not used by anything else
    /// while the pair uses it, and outlives the pair (or its next `gpu` reallocation or release).
    pub unsafe fn wrap_gpu(&mut self, ptr: u64, bytes: usize) -> Result<(), PoolError> {
        self.release_gpu()?;
        self.gpu = Gpu::Wrapped { ptr, bytes };
        Ok(())
    }

    /// Waits for the copies still in flight.
    pub fn synchronize(&mut self) -> Result<(), PoolError> {
        match &self.host {
            // A refused wait leaves the copies tracked, so every later access and release waits
            // (or fails) again, and nothing is freed under them.
            Host::Pinned(mem) => mem.as_slice().map(drop),
            // Copies of a borrowed side were waited for when queued.
            Host::None | Host::Borrowed(_) => Ok(()),
        }
    }

    /// The device side as a writable one-row view of `n` elements, for kernel arguments (its
    /// [`device_ptr`](crate::GpuRead::device_ptr) is TensorRT's binding) and, on the host backend,
    /// the CPU twins of kernels. Reallocates, zero-filled, only when the device side holds less.
    /// Launch kernels on the stream the copies are queued on, so they run after them; on the
    /// host backend the copies in flight are waited for first.
    pub fn gpu<T: Pod>(&mut self, n: usize) -> Result<GpuViewMut<'_, T>, PoolError> {
        self.gpu_view_mut(n)
    }

    /// The device side's address (0 while it has none), for TensorRT's bindings.
    #[must_use]
    pub fn device_ptr(&self) -> u64 {
        match self.gpu {
            Gpu::None => 0,
            Gpu::Owned { ptr, .. } | Gpu::Wrapped { ptr, .. } => ptr,
        }
    }

    /// Grows the device side to `bytes`; its address.
    fn grow_gpu(&mut self, bytes: usize) -> Result<u64, PoolError> {
        match self.gpu {
            Gpu::Owned { ptr, bytes: held } | Gpu::Wrapped { ptr, bytes: held }
                if held >= bytes =>
            {
                return Ok(ptr);
            }
            // Nothing asked of an empty side: no allocation, and no address (as an empty buffer).
            Gpu::None if bytes == 0 => return Ok(0),
            _ => {}
        }
        self.release_gpu()?;
        let storage = self.device.storage();
        let ptr = storage.alloc(bytes, None)?;
        self.gpu = Gpu::Owned { ptr, bytes };
        self.reallocations += 1;
        let region = Region {
            ptr,
            pitch: bytes,
            width: bytes,
            rows: 1,
        };
        // SAFETY: `ptr` is a fresh allocation of `bytes` bytes, the region exactly that.
        unsafe { storage.backend.fill(region, &[0], &self.own) }?;
        storage.backend.synchronize(&self.own)?;
        Ok(ptr)
    }

    /// The device side as a one-row view of `n` elements; see [`gpu`](Self::gpu).
    ///
    /// ```
    /// use gpu_pool::{compat::mix::MixMemory, Device, GpuRead, PoolError, Stream};
    /// let device = Device::host();
    /// let stream = Stream::new(&device)?;
    /// let mut mix = MixMemory::new(&device)?;
    /// mix.cpu::<u32>(3)?.copy_from_slice(&[1, 2, 3]);
    /// let _ = mix.gpu::<u32>(3)?;
    /// mix.copy_to_gpu_async(&stream)?;
    /// let sum: u32 = mix.gpu_view::<u32>(3)?.host_rows()?.flatten().sum(); // a CPU twin's read
    /// assert_eq!(sum, 6);
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn gpu_view<T: Pod>(&mut self, n: usize) -> Result<GpuView<'_, T>, PoolError> {
        let ptr = self.gpu_for_view::<T>(n)?;
        Ok(GpuView::new(
            contiguous::<T>(ptr, n),
            self.device.id(),
            Keeper::Unordered,
        ))
    }

    /// The device side as a writable one-row view of `n` elements; see [`gpu`](Self::gpu).
    pub fn gpu_view_mut<T: Pod>(&mut self, n: usize) -> Result<GpuViewMut<'_, T>, PoolError> {
        let ptr = self.gpu_for_view::<T>(n)?;
        Ok(GpuViewMut::new(
            contiguous::<T>(ptr, n),
            self.device.id(),
            Keeper::Unordered,
        ))
    }

    fn gpu_for_view<T: Pod>(&mut self, n: usize) -> Result<u64, PoolError> {
        if self.device.is_host() {
            self.synchronize()?;
        }
        let ptr = self.grow_gpu(byte_len::<T>(n)?)?;
        if ptr % align_of::<T>() as u64 != 0 {
            return Err(PoolError::Misaligned {
                address: ptr,
                align: align_of::<T>(),
                type_name: std::any::type_name::<T>(),
            });
        }
        Ok(ptr)
    }

    /// Host memory for `n` elements. Reallocates (pinned, zero-filled) only when the host side holds
    /// less; waits for the copies in flight first.
    pub fn cpu<T: Pod>(&mut self, n: usize) -> Result<&mut [T], PoolError> {
        let bytes = byte_len::<T>(n)?;
        if self.host_bytes() < bytes {
            self.release_cpu()?;
            self.host = Host::Pinned(HostMem::new(&self.device, bytes)?);
            self.reallocations += 1;
        }
        let all: &mut [u8] = match &mut self.host {
            Host::None => &mut [],
            // Waits for the copies in flight.
            Host::Pinned(mem) => mem.as_mut_slice()?,
            Host::Borrowed(slice) => slice,
        };
        let address = all.as_ptr() as u64;
        bytemuck::try_cast_slice_mut(&mut all[..bytes]).map_err(|_| PoolError::Misaligned {
            address,
            align: align_of::<T>(),
            type_name: std::any::type_name::<T>(),
        })
    }

    fn host_bytes(&self) -> usize {
        match &self.host {
            Host::None => 0,
            Host::Pinned(mem) => mem.len(),
            Host::Borrowed(slice) => slice.len(),
        }
    }

    fn gpu_bytes(&self) -> usize {
        match self.gpu {
            Gpu::None => 0,
            Gpu::Owned { bytes, .. } | Gpu::Wrapped { bytes, .. } => bytes,
        }
    }

    /// The reallocations made so far, both sides.
    #[must_use]
    pub fn reallocations(&self) -> u64 {
        self.reallocations
    }

    /// Bytes held on (host, device).
    #[must_use]
    pub fn capacity(&self) -> (usize, usize) {
        (self.host_bytes(), self.gpu_bytes())
    }

    /// Queues a copy of the host side into the device side, `min` of their sizes, on `stream`.
    ///
    /// With a host side of the pair's own, the copy runs while the host goes on, and every later
    /// host access waits for it. With a wrapped host slice ([`wrap_cpu`](Self::wrap_cpu)) it is
    /// waited for before returning: the slice is only borrowed, and `mem::forget` of the pair would
    /// end that borrow with the copy still reading or writing it.
    pub fn copy_to_gpu_async(&mut self, stream: &Stream) -> Result<(), PoolError> {
        self.copy(stream, true)
    }

    /// Queues a copy of the device side into the host side, on `stream`; waited for before
    /// returning with a wrapped host slice, as in [`copy_to_gpu_async`](Self::copy_to_gpu_async).
    pub fn copy_to_cpu_async(&mut self, stream: &Stream) -> Result<(), PoolError> {
        self.copy(stream, false)
    }

    fn copy(&mut self, stream: &Stream, to_gpu: bool) -> Result<(), PoolError> {
        if stream.device() != &self.device {
            return Err(PoolError::DeviceMismatch {
                expected: self.device.id(),
                actual: stream.device().id(),
            });
        }
        if stream.in_own_capture() {
            // A captured copy would read or write the host side on every replay, after the pair
            // may have reallocated or freed it.
            return Err(PoolError::Unsupported {
                device: self.device.id(),
                what: "MixMemory copies inside a graph capture (copy before or after it)",
            });
        }
        let bytes = self.host_bytes().min(self.gpu_bytes());
        let ptr = self.device_ptr();
        if bytes == 0 || ptr == 0 {
            return Ok(());
        }
        // The device side as memory of `stream`, so the copy is queued there.
        let window = contiguous::<u8>(ptr, bytes);
        let device = self.device.id();
        let mut gpu = GpuViewMut::<u8>::new(window, device, Keeper::Stream(stream));
        match &mut self.host {
            Host::None => Ok(()),
            // `HostMem` orders the copy after the other streams' copies of the memory and tracks
            // it: every later host access, reallocation, release and drop waits for it.
            Host::Pinned(mem) if to_gpu => gpu.upload_async_from(mem, true),
            Host::Pinned(mem) => gpu.as_view().download_async_into(mem, true),
            // Synchronous copies: the borrow may end (`mem::forget` of the pair) right after.
            Host::Borrowed(slice) if to_gpu => gpu.upload(&slice[..bytes]),
            Host::Borrowed(slice) => gpu.as_view().download(&mut slice[..bytes]),
        }
    }

    /// Frees (or forgets, if wrapped) the device side.
    pub fn release_gpu(&mut self) -> Result<(), PoolError> {
        self.synchronize()?;
        if let Gpu::Owned { ptr, .. } = std::mem::replace(&mut self.gpu, Gpu::None) {
            // SAFETY: our own allocation, taken out of `self.gpu` so freed once; the copies of
            // it (all through the host side) were waited for above.
            unsafe { self.device.storage().free(ptr, None) }?;
        }
        Ok(())
    }

    /// Frees (or lets go of, if wrapped) the host side. A pinned side whose copies are still in
    /// flight is freed once they are done (`HostMem`'s drop).
    pub fn release_cpu(&mut self) -> Result<(), PoolError> {
        self.synchronize()?;
        self.host = Host::None;
        Ok(())
    }

    /// Frees both sides.
    pub fn release_all(&mut self) -> Result<(), PoolError> {
        self.release_gpu().and(self.release_cpu())
    }
}

/// One row of `n` elements at `ptr` (whose byte length `byte_len` has checked).
fn contiguous<T>(ptr: u64, n: usize) -> Window {
    Window {
        ptr,
        rows: 1,
        cols: n,
        pitch: n * size_of::<T>(),
        owns_gaps: true,
    }
}

fn byte_len<T>(n: usize) -> Result<usize, PoolError> {
    n.checked_mul(size_of::<T>())
        .ok_or(PoolError::SizeOverflow {
            rows: 1,
            cols: n,
            elem_size: size_of::<T>(),
        })
}

impl Drop for MixMemory<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.release_all() {
            crate::base::event::error!(error = %e, "releasing MixMemory failed");
        }
        let own = std::mem::replace(&mut self.own, RawStream::Host);
        self.device.backend().drop_stream(own);
    }
}
