//! `MixMemory` (TensorRT-style): a paired pinned-host and device buffer that grows lazily.
//!
//! `gpu::<T>(n)` and `cpu::<T>(n)` return the memory they hold when it is large enough and
//! reallocate, zero-filled, only when more is asked. Either side can wrap memory the caller owns.
//! Every allocation and free runs on the buffer's own device, whatever device the calling thread
//! has current. Copies between the two sides are queued on a stream; host access, reallocation,
//! release and drop first wait for a copy still in flight, so the host never races the device.

use bytemuck::Pod;

use crate::backend::{DevPtr, RawStream, Region};
use crate::device::Device;
use crate::error::PoolError;
use crate::stream::Stream;
use crate::view::{GpuView, GpuViewMut, Keeper, Window};

enum Host<'a> {
    None,
    Pinned { ptr: *mut u8, bytes: usize },
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
/// use gpu_pool::{compat::mix::MixMemory, Device, PoolError, Stream};
/// let device = Device::private_host();
/// let stream = Stream::new(&device)?;
/// let mut mix = MixMemory::new(&device)?;
/// mix.cpu::<f32>(4)?.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
/// mix.gpu::<f32>(4)?;                        // device side of the same size
/// mix.copy_to_gpu_async(&stream)?;           // queued on the stream
/// mix.cpu::<f32>(4)?.fill(0.0);              // waits for the copy first
/// mix.copy_to_cpu_async(&stream)?;
/// assert_eq!(mix.cpu::<f32>(4)?, &[1.0, 2.0, 3.0, 4.0]);
/// assert_eq!(mix.reallocations(), 2);        // one per side; asking for less reuses them
/// mix.gpu::<f32>(2)?;
/// assert_eq!(mix.reallocations(), 2);
/// # Ok::<(), PoolError>(())
/// ```
pub struct MixMemory<'a> {
    device: Device,
    /// For zero-filling new device memory.
    own: RawStream,
    host: Host<'a>,
    gpu: Gpu,
    /// A copy in flight, on this stream.
    pending: Option<RawStream>,
    reallocations: u64,
}

// SAFETY: the pinned pointer is owned memory like a `Box<[u8]>`; the borrowed slice is `Send`;
// device addresses are plain numbers. Nothing is shared with another owner.
unsafe impl Send for MixMemory<'_> {}

impl MixMemory<'static> {
    /// An empty pair on `device`; nothing is allocated until asked for.
    pub fn new(device: &Device) -> Result<MixMemory<'static>, PoolError> {
        Ok(MixMemory {
            device: device.clone(),
            own: device.backend().new_stream()?,
            host: Host::None,
            gpu: Gpu::None,
            pending: None,
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

    /// Waits for a copy still in flight.
    pub fn synchronize(&mut self) -> Result<(), PoolError> {
        if let Some(stream) = &self.pending {
            // Forgotten only once waited for: a refused wait leaves the copy pending, so every
            // later access and release waits (or fails) again, and nothing is freed under it.
            self.device.backend().synchronize(stream)?;
            self.pending = None;
        }
        Ok(())
    }

    /// Device memory for `n` elements: the address. Reallocates, zero-filled, only when the
    /// device side holds less.
    pub fn gpu<T: Pod>(&mut self, n: usize) -> Result<u64, PoolError> {
        let bytes = byte_len::<T>(n)?;
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

    /// The device side as a one-row view of `n` elements, for kernel arguments and, on the host
    /// backend, for the CPU twins of kernels. Grows like [`gpu`](Self::gpu). Launch kernels on the
    /// stream the copies are queued on, so they run after them; on the host backend a copy in
    /// flight is waited for first.
    ///
    /// ```
    /// use gpu_pool::{compat::mix::MixMemory, Device, PoolError, Stream};
    /// let device = Device::host();
    /// let stream = Stream::new(&device)?;
    /// let mut mix = MixMemory::new(&device)?;
    /// mix.cpu::<u32>(3)?.copy_from_slice(&[1, 2, 3]);
    /// mix.gpu::<u32>(3)?;
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

    /// The device side as a writable one-row view of `n` elements; see [`gpu_view`](Self::gpu_view).
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
        let ptr = self.gpu::<T>(n)?;
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
    /// less; waits for a copy in flight first.
    pub fn cpu<T: Pod>(&mut self, n: usize) -> Result<&mut [T], PoolError> {
        self.synchronize()?;
        let bytes = byte_len::<T>(n)?;
        if self.host_bytes() < bytes {
            self.release_cpu()?;
            // Host memory: not among the device's counted driver calls (see `storage.rs`).
            let ptr = self.device.backend().alloc_pinned(bytes)?;
            self.host = Host::Pinned { ptr, bytes };
            self.reallocations += 1;
        }
        let all: &mut [u8] = match &mut self.host {
            Host::None => &mut [],
            // SAFETY: `ptr` holds `bytes` initialised (zeroed or written) bytes owned by `self`,
            // borrowed mutably for as long as the returned slice.
            Host::Pinned { ptr, bytes } => unsafe { std::slice::from_raw_parts_mut(*ptr, *bytes) },
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
            Host::Pinned { bytes, .. } => *bytes,
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
        self.synchronize()?;
        let bytes = self.host_bytes().min(self.gpu_bytes());
        let (Gpu::Owned { ptr, .. } | Gpu::Wrapped { ptr, .. }) = self.gpu else {
            return Ok(());
        };
        if bytes == 0 {
            return Ok(());
        }
        let (host, borrowed): (*mut u8, bool) = match &mut self.host {
            Host::None => return Ok(()),
            Host::Pinned { ptr, .. } => (*ptr, false),
            Host::Borrowed(slice) => (slice.as_mut_ptr(), true),
        };
        let region = Region {
            ptr,
            pitch: bytes,
            width: bytes,
            rows: 1,
        };
        let backend = self.device.backend();
        let raw = stream.work_stream(if to_gpu { "copy_to_gpu" } else { "copy_to_cpu" })?;
        // SAFETY: both sides hold at least `bytes`; the host side is owned or mutably borrowed by
        // `self`. An owned side stays valid until `pending`, set below, is waited for: every later
        // host access, reallocation, release and drop waits, and a forgotten `MixMemory` leaks the
        // memory rather than freeing it. A borrowed side is waited for before returning, since
        // `mem::forget(self)` would end the borrow with no drop to wait in.
        unsafe {
            if to_gpu {
                backend.upload_async(region, host, bytes, raw)?;
            } else {
                backend.download_async(region, host, bytes, raw)?;
            }
        }
        if borrowed {
            return backend.synchronize(raw);
        }
        self.pending = Some(raw.clone());
        Ok(())
    }

    /// Frees (or forgets, if wrapped) the device side.
    pub fn release_gpu(&mut self) -> Result<(), PoolError> {
        self.synchronize()?;
        if let Gpu::Owned { ptr, .. } = std::mem::replace(&mut self.gpu, Gpu::None) {
            // SAFETY: our own allocation, taken out of `self.gpu` so freed once; copies waited for.
            unsafe { self.device.storage().free(ptr, None) }?;
        }
        Ok(())
    }

    /// Frees (or lets go of, if wrapped) the host side.
    pub fn release_cpu(&mut self) -> Result<(), PoolError> {
        self.synchronize()?;
        if let Host::Pinned { ptr, bytes } = std::mem::replace(&mut self.host, Host::None) {
            // SAFETY: our own pinned allocation, taken out of `self.host` so freed once.
            unsafe { self.device.backend().free_pinned(ptr, bytes) }?;
        }
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
            tracing::error!(error = %e, "releasing MixMemory failed");
        }
        let own = std::mem::replace(&mut self.own, RawStream::Host);
        self.device.backend().drop_stream(own);
    }
}
