//! What users would pick instead of the pool: the driver's allocators and cudarc's, called the way
//! each is meant to be called, behind one take / release pair.

use std::sync::Arc;

use gpu_pool::interop::cudarc::driver::result::{self, DriverError};
use gpu_pool::interop::cudarc::driver::sys;
use gpu_pool::interop::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

/// An allocator the pool is compared against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Competitor {
    /// `cuMemAlloc` + `cuMemFree` (which synchronizes).
    MemAlloc,
    /// `cuMemAllocPitch` + `cuMemFree`: OpenCV's `DefaultAllocator`, so OpenCV without a pool.
    MemAllocPitch,
    /// `cuMemAllocAsync` + `cuMemFreeAsync` on the device's default pool (release threshold 0).
    AsyncDefault,
    /// `cuMemAllocFromPoolAsync` + `cuMemFreeAsync` on a pool whose release threshold is raised to
    /// keep everything.
    AsyncRaised,
    /// cudarc's `stream.alloc` and dropping the `CudaSlice` (stream-ordered, with its events).
    Cudarc,
}

impl Competitor {
    pub(crate) fn id(self) -> &'static str {
        match self {
            Competitor::MemAlloc => "cuMemAlloc",
            Competitor::MemAllocPitch => "cuMemAllocPitch",
            Competitor::AsyncDefault => "cuMemAllocAsync_default",
            Competitor::AsyncRaised => "cuMemAllocAsync_raised",
            Competitor::Cudarc => "cudarc_alloc",
        }
    }
}

/// Memory taken from a competitor.
pub(crate) enum Block {
    Raw { ptr: u64, pitch: usize },
    Cudarc { slice: CudaSlice<u8>, pitch: usize },
}

impl Block {
    /// The address and pitch, for a kernel launched on `stream`. cudarc's slice records its
    /// read/write events here, as it does for its own launches.
    pub(crate) fn ptr_pitch(&self, stream: &CudaStream) -> (u64, usize) {
        match self {
            Block::Raw { ptr, pitch } => (*ptr, *pitch),
            Block::Cudarc { slice, pitch } => (slice.device_ptr(stream).0, *pitch),
        }
    }
}

/// The driver state the competitors need: the stream, and the pool with the raised threshold.
pub(crate) struct Driver {
    pub(crate) stream: Arc<CudaStream>,
    raised: sys::CUmemoryPool,
    alignment: usize,
}

impl Driver {
    pub(crate) fn new(stream: Arc<CudaStream>, alignment: usize) -> Result<Driver, DriverError> {
        stream.context().bind_to_thread()?;
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: stream.context().ordinal() as i32,
            },
            win32SecurityAttributes: std::ptr::null_mut(),
            maxSize: 0,
            usage: 0,
            reserved: [0; 54],
        };
        // SAFETY: valid properties for a device-local pool of this context's device.
        let raised = unsafe { result::mem_pool::create(&props) }?;
        let mut keep_all = u64::MAX;
        // SAFETY: the release threshold attribute takes a `u64`, which `keep_all` is.
        unsafe {
            result::mem_pool::set_attribute(
                raised,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut keep_all).cast(),
            )
        }?;
        Ok(Driver {
            stream,
            raised,
            alignment,
        })
    }

    /// `rows` rows of `width` bytes.
    pub(crate) fn take(
        &self,
        who: Competitor,
        rows: usize,
        width: usize,
    ) -> Result<Block, DriverError> {
        let pitch = width.next_multiple_of(self.alignment);
        let bytes = pitch * rows;
        let cu = self.stream.cu_stream();
        // SAFETY: every arm is a plain allocation of `bytes` (or `width x rows`) bytes on the
        // context bound in `new`; the memory is only used through kernels on `self.stream`.
        let block = unsafe {
            match who {
                Competitor::MemAlloc => Block::Raw {
                    ptr: result::malloc_sync(bytes)?,
                    pitch,
                },
                Competitor::MemAllocPitch => {
                    let (mut ptr, mut pitch) = (0, 0);
                    sys::cuMemAllocPitch_v2(&mut ptr, &mut pitch, width, rows, 4).result()?;
                    Block::Raw { ptr, pitch }
                }
                Competitor::AsyncDefault => Block::Raw {
                    ptr: result::malloc_async(cu, bytes)?,
                    pitch,
                },
                Competitor::AsyncRaised => Block::Raw {
                    ptr: result::mem_pool::alloc_async(self.raised, bytes, cu)?,
                    pitch,
                },
                Competitor::Cudarc => Block::Cudarc {
                    slice: self.stream.alloc::<u8>(bytes)?,
                    pitch,
                },
            }
        };
        Ok(block)
    }

    /// Gives back what `take(who, ..)` returned.
    pub(crate) fn release(&self, who: Competitor, block: Block) -> Result<(), DriverError> {
        match block {
            // SAFETY: `ptr` came from `take(who, ..)`, is released once, and every use of it was
            // enqueued on `self.stream`: `cuMemFree` waits for the device, `cuMemFreeAsync` is
            // ordered after the uses.
            Block::Raw { ptr, .. } => unsafe {
                match who {
                    Competitor::AsyncDefault | Competitor::AsyncRaised => {
                        result::free_async(ptr, self.stream.cu_stream())
                    }
                    _ => result::free_sync(ptr),
                }
            },
            Block::Cudarc { slice, .. } => {
                drop(slice);
                Ok(())
            }
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        // SAFETY: every block of the pool was released and the stream has drained.
        let _ = unsafe { result::mem_pool::destroy(self.raised) };
    }
}
