//! The CUDA backend, on cudarc's driver API (loaded at run time, so it builds without CUDA).
//!
//! Every call runs in the device's primary context under a [`ContextGuard`] that restores the
//! caller's context afterwards (TensorRT's `AutoDevice`): a buffer is allocated and freed on its own
//! device whatever device the calling thread has current. Stream-ordered fallbacks come from a memory
//! pool of our own with its release threshold raised, so freed memory stays in the pool across
//! synchronizations and other users of the device's default pool are not affected.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys::{self, CUdevice_attribute, CUmemorytype};
use cudarc::driver::{CudaContext, CudaEvent};

use super::calls::{Call, count};
use super::{Backend, DevPtr, RawEvent, RawStream, Region};
use crate::base::error::PoolError;
use crate::base::id::DeviceId;

/// A driver error as a `PoolError`, the error kept as its source.
pub(crate) fn driver_error(call: &'static str, e: DriverError) -> PoolError {
    PoolError::Driver {
        call,
        source: e.into(),
    }
}

/// Whether the CUDA driver library can be loaded. cudarc panics on first use when it cannot, so
/// every entry point asks this first.
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its usual names; nothing is called.
    unsafe { sys::is_culib_present() }
}

/// The number of CUDA devices, or `NoCudaDriver`.
pub(crate) fn device_count() -> Result<usize, PoolError> {
    if !driver_present() {
        return Err(PoolError::NoCudaDriver {
            detail: "libcuda.so could not be loaded".into(),
        });
    }
    result::init().map_err(|e| driver_error("cuInit", e))?;
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| driver_error("cuDeviceGetCount", e))
}

pub(crate) struct CudaBackend {
    id: DeviceId,
    ctx: Arc<CudaContext>,
    texture_alignment: usize,
    /// Our stream-ordered pool, if the device supports memory pools.
    mem_pool: Option<sys::CUmemoryPool>,
    /// The granule of virtual memory management, if the device supports it.
    vmm_granularity: Option<usize>,
    /// The device's memory, in bytes.
    total_memory: usize,
}

// SAFETY: `CUmemoryPool` is a driver handle usable from any thread; the context is Send + Sync.
unsafe impl Send for CudaBackend {}
// SAFETY: as above; the backend has no interior state besides driver handles.
unsafe impl Sync for CudaBackend {}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("id", &self.id)
            .field("texture_alignment", &self.texture_alignment)
            .field("stream_ordered", &self.mem_pool.is_some())
            .finish()
    }
}

/// Makes a context current and restores the previous one on drop.
pub(crate) struct ContextGuard {
    previous: sys::CUcontext,
    changed: bool,
}

impl ContextGuard {
    pub(crate) fn bind(ctx: &CudaContext) -> Result<ContextGuard, PoolError> {
        let previous = result::ctx::get_current()
            .map_err(|e| driver_error("cuCtxGetCurrent", e))?
            .unwrap_or(std::ptr::null_mut());
        let changed = previous != ctx.cu_ctx();
        if changed {
            // SAFETY: `ctx` is a live context (the Arc keeps its primary context retained).
            unsafe { result::ctx::set_current(ctx.cu_ctx()) }
                .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        }
        Ok(ContextGuard { previous, changed })
    }

    /// Restores whatever is current now when dropped, for calls into cudarc that bind a context
    /// themselves.
    pub(crate) fn keep_current() -> Result<ContextGuard, PoolError> {
        let previous = result::ctx::get_current()
            .map_err(|e| driver_error("cuCtxGetCurrent", e))?
            .unwrap_or(std::ptr::null_mut());
        Ok(ContextGuard {
            previous,
            changed: true,
        })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: `previous` was current when the guard was made (or null, which unbinds);
            // restoring it is what the caller had.
            if let Err(e) = unsafe { result::ctx::set_current(self.previous) } {
                crate::base::event::error!(error = %driver_error("cuCtxSetCurrent", e), "restoring the caller's context failed");
            }
        }
    }
}

impl CudaBackend {
    pub(crate) fn new(ordinal: usize) -> Result<CudaBackend, PoolError> {
        let id = DeviceId::Cuda(ordinal);
        let count = device_count()?;
        if ordinal >= count {
            return Err(PoolError::NoSuchDevice { device: id, count });
        }
        // cudarc binds the new context to this thread; the caller's stays current.
        let _restore = ContextGuard::keep_current()?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
        let attribute = |a: CUdevice_attribute| {
            ctx.attribute(a)
                .map_err(|e| driver_error("cuDeviceGetAttribute", e))
        };
        let texture_alignment =
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT)?.max(1) as usize;
        let mem_pool =
            if attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0 {
                let _guard = ContextGuard::bind(&ctx)?;
                Some(create_mem_pool(ordinal)?)
            } else {
                None
            };
        let vmm_granularity = if attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        )? != 0
        {
            let mut granule = 0usize;
            let prop = device_memory(ordinal);
            // SAFETY: `prop` describes device-local memory; `granule` receives one usize.
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &raw mut granule,
                    &raw const prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            }
            .result()
            .map_err(|e| driver_error("cuMemGetAllocationGranularity", e))?;
            (granule > 0).then_some(granule)
        } else {
            None
        };
        let mut total_memory = 0usize;
        // SAFETY: writes one usize for a device ordinal checked above.
        unsafe { sys::cuDeviceTotalMem_v2(&raw mut total_memory, ordinal as sys::CUdevice) }
            .result()
            .map_err(|e| driver_error("cuDeviceTotalMem", e))?;
        Ok(CudaBackend {
            id,
            ctx,
            texture_alignment: texture_alignment.next_power_of_two(),
            mem_pool,
            vmm_granularity,
            total_memory,
        })
    }

    fn cu_stream(&self, stream: &RawStream) -> Result<sys::CUstream, PoolError> {
        match stream {
            RawStream::Cuda(s) => Ok(s.cu_stream()),
            // Streams are made by their device's backend, so this is a caller's mix-up.
            RawStream::Host => Err(PoolError::Unsupported {
                device: self.id,
                what: "a host stream on a CUDA device",
            }),
        }
    }

    fn cu_event<'e>(&self, event: &'e RawEvent) -> Result<&'e CudaEvent, PoolError> {
        match event {
            RawEvent::Cuda(e) => Ok(e),
            // Events are made by their device's backend, so this is a caller's mix-up.
            RawEvent::Host => Err(PoolError::Unsupported {
                device: self.id,
                what: "a host event on a CUDA device",
            }),
        }
    }

    fn guard(&self) -> Result<ContextGuard, PoolError> {
        ContextGuard::bind(&self.ctx)
    }

    fn oom_or(&self, call: &'static str, requested: usize) -> impl Fn(DriverError) -> PoolError {
        let device = self.id;
        move |e| {
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                PoolError::OutOfMemory {
                    device,
                    requested,
                    context: None,
                    reclaimed: None,
                }
            } else {
                driver_error(call, e)
            }
        }
    }

    /// Whether the driver knows the memory `bytes` starts in (page-locked, registered or
    /// managed), so an asynchronous copy from it really is asynchronous. A copy from pageable
    /// memory it does not know (`CUDA_ERROR_INVALID_VALUE`) is staged whole before the call
    /// returns, whatever the later bytes are (a range only partly page-locked is staged too, or
    /// refused), so the first byte decides. Any other answer counts as known: a wait too many is
    /// only slower. One query costs the host about 1 µs on an H200 (`benches/shared_reads`).
    fn knows_host_memory(&self, bytes: &[u8]) -> bool {
        let Some(first) = bytes.first() else {
            return false;
        };
        count(Call::Other);
        let mut kind = 0u32;
        // SAFETY: a query of the driver's table of the address (no memory is accessed); the
        // out-parameter is a u32, as `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` answers.
        let asked = unsafe {
            sys::cuPointerGetAttribute(
                (&raw mut kind).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                std::ptr::from_ref(first) as sys::CUdeviceptr,
            )
        };
        asked != sys::CUresult::CUDA_ERROR_INVALID_VALUE
    }

    fn memcpy2d(&self, copy: &sys::CUDA_MEMCPY2D, stream: &RawStream) -> Result<(), PoolError> {
        count(Call::Copy);
        let _guard = self.guard()?;
        // Rows back to back on both sides are one run of bytes, and the driver queues a one-row
        // copy faster than a copy of many rows (40-70 ns less a copy on the H100): frames of
        // `new_packed` memory pay no 2D cost.
        let packed = copy.srcPitch == copy.WidthInBytes && copy.dstPitch == copy.WidthInBytes;
        let run;
        let copy = if packed && copy.Height > 1 {
            let bytes = copy.WidthInBytes * copy.Height;
            run = sys::CUDA_MEMCPY2D {
                WidthInBytes: bytes,
                Height: 1,
                srcPitch: bytes,
                dstPitch: bytes,
                ..*copy
            };
            &run
        } else {
            copy
        };
        // SAFETY: the caller of the `Backend` method guarantees both sides of `copy` are valid for
        // its width and height, so for the same bytes as one row when they are back to back; the
        // stream belongs to this context.
        unsafe { sys::cuMemcpy2DAsync_v2(copy, self.cu_stream(stream)?) }
            .result()
            .map_err(|e| driver_error("cuMemcpy2DAsync", e))
    }
}

/// Device-local memory of `ordinal`, as virtual memory management allocates it.
fn device_memory(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all zeros is a valid value (no handle types, no flags).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    };
    prop
}

/// A pool of our own for stream-ordered allocations, keeping freed memory across synchronizations
/// (a 16 MiB async alloc/free with a synchronize: 136 µs at the default threshold, 4 µs raised).
fn create_mem_pool(ordinal: usize) -> Result<sys::CUmemoryPool, PoolError> {
    let props = sys::CUmemPoolProps {
        allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        handleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal as i32,
        },
        win32SecurityAttributes: std::ptr::null_mut(),
        maxSize: 0,
        usage: 0,
        reserved: [0; 54],
    };
    // SAFETY: `props` is fully initialised and describes device-local pinned memory.
    let pool = unsafe { result::mem_pool::create(&props) }
        .map_err(|e| driver_error("cuMemPoolCreate", e))?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the release threshold attribute takes a pointer to a u64.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast::<c_void>(),
        )
    }
    .map_err(|e| driver_error("cuMemPoolSetAttribute", e))?;
    Ok(pool)
}

/// A byte count attribute of `pool` (0 if the driver will not say).
fn pool_attribute(pool: sys::CUmemoryPool, attribute: sys::CUmemPool_attribute) -> usize {
    let mut value: u64 = 0;
    // SAFETY: our pool, alive while the backend is; the byte count attributes write a u64.
    let got = unsafe {
        result::mem_pool::get_attribute(pool, attribute, (&raw mut value).cast::<c_void>())
    };
    got.map_or(0, |()| value as usize)
}

fn copy2d(width: usize, rows: usize) -> sys::CUDA_MEMCPY2D {
    sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: 0,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: 0,
        dstArray: std::ptr::null_mut(),
        dstPitch: 0,
        WidthInBytes: width,
        Height: rows,
    }
}

impl Backend for CudaBackend {
    fn texture_alignment(&self) -> usize {
        self.texture_alignment
    }

    fn vmm_granularity(&self) -> Option<usize> {
        self.vmm_granularity
    }

    fn total_memory(&self) -> usize {
        self.total_memory
    }

    fn no_vmm(&self) -> PoolError {
        PoolError::Unsupported {
            device: self.id,
            what: "virtual memory management (growable stacks)",
        }
    }

    fn reserve(&self, bytes: usize) -> Result<DevPtr, PoolError> {
        count(Call::Memory);
        let granule = self.vmm_granularity.ok_or_else(|| self.no_vmm())?;
        let _guard = self.guard()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` receives the start of a fresh range of `bytes` (a multiple of the granule,
        // the caller's contract), aligned to the granule.
        unsafe { sys::cuMemAddressReserve(&raw mut ptr, bytes, granule, 0, 0) }
            .result()
            .map_err(self.oom_or("cuMemAddressReserve", bytes))?;
        Ok(ptr)
    }

    unsafe fn unreserve(&self, ptr: DevPtr, bytes: usize) -> Result<(), PoolError> {
        count(Call::Memory);
        let _guard = self.guard()?;
        // SAFETY: the caller's contract: a reservation of `bytes`, nothing mapped, freed once.
        unsafe { sys::cuMemAddressFree(ptr, bytes) }
            .result()
            .map_err(|e| driver_error("cuMemAddressFree", e))
    }

    fn map(&self, at: DevPtr, bytes: usize) -> Result<u64, PoolError> {
        count(Call::Memory);
        let _guard = self.guard()?;
        let prop = device_memory(self.ctx.ordinal());
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `prop` describes device-local memory of this device; `handle` receives it.
        unsafe { sys::cuMemCreate(&raw mut handle, bytes, &raw const prop, 0) }
            .result()
            .map_err(self.oom_or("cuMemCreate", bytes))?;
        let release = |e: PoolError| {
            // SAFETY: the handle made above, never mapped (or unmapped just before), released once.
            let _ = unsafe { sys::cuMemRelease(handle) };
            e
        };
        // SAFETY: `at..at + bytes` lies in a reservation of ours with nothing mapped there (the
        // caller's contract); the handle holds `bytes`.
        unsafe { sys::cuMemMap(at, bytes, 0, handle, 0) }
            .result()
            .map_err(|e| release(driver_error("cuMemMap", e)))?;
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range was mapped just above; one access descriptor.
        if let Err(e) = unsafe { sys::cuMemSetAccess(at, bytes, &raw const access, 1) }.result() {
            // SAFETY: mapped just above, never accessed.
            let _ = unsafe { sys::cuMemUnmap(at, bytes) };
            return Err(release(driver_error("cuMemSetAccess", e)));
        }
        Ok(handle)
    }

    unsafe fn unmap(&self, at: DevPtr, bytes: usize, handle: u64) -> Result<(), PoolError> {
        count(Call::Memory);
        let _guard = self.guard()?;
        // SAFETY: the caller's contract: exactly what `map` mapped with `handle`, unused.
        unsafe { sys::cuMemUnmap(at, bytes) }
            .result()
            .map_err(|e| driver_error("cuMemUnmap", e))?;
        // SAFETY: unmapped just above: the handle is released once, with nothing mapping it.
        if let Err(e) = unsafe { sys::cuMemRelease(handle) }.result() {
            // The range is unmapped either way: the stack must stop counting it as mapped, so
            // this is no error of the unmap; the physical memory may leak, and is said so.
            crate::base::event::error!(error = %driver_error("cuMemRelease", e), bytes, "releasing unmapped stack memory failed");
        }
        Ok(())
    }

    fn supports_stream_ordered(&self) -> bool {
        self.mem_pool.is_some()
    }

    fn new_stream(&self) -> Result<RawStream, PoolError> {
        count(Call::Other);
        let _guard = self.guard()?;
        self.ctx
            .new_stream()
            .map(RawStream::Cuda)
            .map_err(|e| driver_error("cuStreamCreate", e))
    }

    fn synchronize(&self, stream: &RawStream) -> Result<(), PoolError> {
        count(Call::HostWait);
        let _guard = self.guard()?;
        let s = self.cu_stream(stream)?;
        // This thread may be capturing a graph in a mode that forbids waiting for other streams
        // (cudarc's `begin_capture` on another stream, say); the pool's waits guard memory, so
        // they run in relaxed mode. A wait for a stream that is itself capturing still fails.
        relaxed(|| {
            // SAFETY: the stream belongs to this context and is alive (the RawStream holds it).
            unsafe { result::stream::synchronize(s) }
        })
        .map_err(|e| driver_error("cuStreamSynchronize", e))
    }

    fn is_capturing(&self, stream: &RawStream) -> Result<bool, PoolError> {
        count(Call::CaptureQuery);
        let _guard = self.guard()?;
        // SAFETY: the stream belongs to this context and is alive (the RawStream holds it).
        let status = unsafe { result::stream::is_capturing(self.cu_stream(stream)?) }
            .map_err(|e| driver_error("cuStreamIsCapturing", e))?;
        // An invalidated capture is still a capture: work queued now joins it, and it must end.
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn rerecord(&self, event: &RawEvent, stream: &RawStream) -> Result<(), PoolError> {
        count(Call::EventRecord);
        let _guard = self.guard()?;
        let event = self.cu_event(event)?;
        let RawStream::Cuda(s) = stream else {
            return Err(self.cu_stream(stream).unwrap_err());
        };
        // SAFETY: both live in this context (bound above; the event is one `record_event` made
        // here), and the `RawEvent` and `RawStream` keep them alive. Not `CudaEvent::record`: that
        // binds the context a second time, on the path of every asynchronous copy.
        unsafe { result::event::record(event.cu_event(), s.cu_stream()) }
            .map_err(|e| driver_error("cuEventRecord", e))
    }

    fn record_event(&self, stream: &RawStream) -> Result<Option<RawEvent>, PoolError> {
        count(Call::EventRecord);
        let _guard = self.guard()?;
        let RawStream::Cuda(s) = stream else {
            return Err(self.cu_stream(stream).unwrap_err());
        };
        let event = self
            .ctx
            .new_event(None)
            .map_err(|e| driver_error("cuEventCreate", e))?;
        event
            .record(s)
            .map_err(|e| driver_error("cuEventRecord", e))?;
        Ok(Some(RawEvent::Cuda(event)))
    }

    fn wait_event(&self, stream: &RawStream, event: RawEvent) -> Result<(), PoolError> {
        count(Call::StreamWait);
        let _guard = self.guard()?;
        let RawEvent::Cuda(event) = event else {
            return Err(self.cu_event(&event).unwrap_err());
        };
        let s = match stream {
            RawStream::Cuda(s) => s,
            RawStream::Host => return Err(self.cu_stream(stream).unwrap_err()),
        };
        // The event is destroyed here, under the guard: cudarc binds its context to destroy it.
        s.wait(&event)
            .map_err(|e| driver_error("cuStreamWaitEvent", e))
    }

    fn wait_for(&self, stream: &RawStream, event: &RawEvent) -> Result<(), PoolError> {
        count(Call::StreamWait);
        let _guard = self.guard()?;
        let event = self.cu_event(event)?;
        let RawStream::Cuda(s) = stream else {
            return Err(self.cu_stream(stream).unwrap_err());
        };
        s.wait(event)
            .map_err(|e| driver_error("cuStreamWaitEvent", e))
    }

    fn wait_host(&self, event: &RawEvent) -> Result<(), PoolError> {
        count(Call::HostWait);
        let _guard = self.guard()?;
        let event = self.cu_event(event)?;
        event
            .synchronize()
            .map_err(|e| driver_error("cuEventSynchronize", e))
    }

    fn event_done(&self, event: &RawEvent) -> Result<bool, PoolError> {
        count(Call::Other);
        let _guard = self.guard()?;
        let event = self.cu_event(event)?;
        event
            .try_is_complete()
            .map_err(|e| driver_error("cuEventQuery", e))
    }

    fn drop_event(&self, event: RawEvent) {
        let guard = self.guard();
        drop(event);
        drop(guard);
    }

    fn drop_stream(&self, stream: RawStream) {
        let guard = self.guard();
        drop(stream);
        drop(guard);
    }

    fn cuda_context(&self) -> Option<&Arc<CudaContext>> {
        Some(&self.ctx)
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, PoolError> {
        count(Call::Memory);
        let _guard = self.guard()?;
        // SAFETY: plain allocation in the bound context.
        unsafe { result::malloc_sync(bytes.max(1)) }.map_err(self.oom_or("cuMemAlloc", bytes))
    }

    fn alloc_pitch(&self, width: usize, rows: usize) -> Result<(DevPtr, usize), PoolError> {
        count(Call::Memory);
        let _guard = self.guard()?;
        let mut ptr = MaybeUninit::uninit();
        let mut pitch = MaybeUninit::uninit();
        let requested = width.saturating_mul(rows);
        // SAFETY: out-pointers are valid; element size 16 lets the driver pick the widest pitch.
        unsafe {
            sys::cuMemAllocPitch_v2(
                ptr.as_mut_ptr(),
                pitch.as_mut_ptr(),
                width.max(1),
                rows.max(1),
                16,
            )
        }
        .result()
        .map_err(self.oom_or("cuMemAllocPitch", requested))?;
        // SAFETY: the call succeeded, so both were written.
        Ok(unsafe { (ptr.assume_init(), pitch.assume_init()) })
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8, PoolError> {
        count(Call::Memory);
        let _guard = self.guard()?;
        // SAFETY: plain page-locked allocation in the bound context.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }
            .map_err(self.oom_or("cuMemHostAlloc", bytes))?;
        // SAFETY: the allocation holds `bytes` bytes; zeroed as the host backend's (and MixMemory's
        // contract).
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(ptr.cast())
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, _bytes: usize) -> Result<(), PoolError> {
        count(Call::Memory);
        let _guard = self.guard()?;
        // SAFETY: forwarded contract: from `alloc_pinned`, freed once.
        unsafe { result::free_host(ptr.cast()) }.map_err(|e| driver_error("cuMemFreeHost", e))
    }

    unsafe fn free(&self, ptr: DevPtr) -> Result<(), PoolError> {
        count(Call::Memory);
        let _guard = self.guard()?;
        // SAFETY: forwarded contract: a live allocation of this context, freed once.
        unsafe { result::free_sync(ptr) }.map_err(|e| driver_error("cuMemFree", e))
    }

    fn has_mem_pool(&self) -> bool {
        self.mem_pool.is_some()
    }

    fn pool_reserved_bytes(&self) -> Option<usize> {
        let pool = self.mem_pool?;
        Some(pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        ))
    }

    fn pool_idle_bytes(&self) -> usize {
        let Some(pool) = self.mem_pool else {
            return 0;
        };
        let reserved = pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        );
        let used = pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        );
        reserved.saturating_sub(used)
    }

    fn trim_pool(&self) -> Result<usize, PoolError> {
        let Some(pool) = self.mem_pool else {
            return Ok(0);
        };
        let _guard = self.guard()?;
        let before = pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        );
        // SAFETY: our pool, alive until the backend drops. The driver keeps what live allocations
        // use and what frees still pending in some stream will hand back.
        unsafe { result::mem_pool::trim_to(pool, 0) }
            .map_err(|e| driver_error("cuMemPoolTrimTo", e))?;
        let after = pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        );
        Ok(before.saturating_sub(after))
    }

    fn alloc_async(&self, bytes: usize, stream: &RawStream) -> Result<DevPtr, PoolError> {
        count(Call::Memory);
        let Some(pool) = self.mem_pool else {
            return self.alloc(bytes);
        };
        let _guard = self.guard()?;
        // SAFETY: our pool belongs to this device; the stream to this context.
        unsafe { result::mem_pool::alloc_async(pool, bytes.max(1), self.cu_stream(stream)?) }
            .map_err(self.oom_or("cuMemAllocFromPoolAsync", bytes))
    }

    unsafe fn free_async(&self, ptr: DevPtr, stream: &RawStream) -> Result<(), PoolError> {
        count(Call::Memory);
        if self.mem_pool.is_none() {
            // SAFETY: `alloc_async` used `alloc` then; forwarded contract.
            return unsafe { self.free(ptr) };
        }
        let _guard = self.guard()?;
        // SAFETY: forwarded contract: from `alloc_async`, freed once, uses ordered before.
        unsafe { result::free_async(ptr, self.cu_stream(stream)?) }
            .map_err(|e| driver_error("cuMemFreeAsync", e))
    }

    unsafe fn fill(
        &self,
        dst: Region,
        pattern: &[u8],
        stream: &RawStream,
    ) -> Result<(), PoolError> {
        let _guard = self.guard()?;
        let s = self.cu_stream(stream)?;
        let Region {
            ptr,
            pitch,
            width,
            rows,
        } = dst;
        let uniform = pattern.iter().all(|&b| b == pattern[0]);
        // A 2- or 4-byte memset needs its address and pitch aligned to its width, which a custom
        // allocator's answer for `[u8; 4]` need not be: otherwise the pattern is written by parts.
        let aligned = |w: usize| ptr.is_multiple_of(w as u64) && pitch.is_multiple_of(w);
        // Each memset writes `rows` rows of `width` bytes at `pitch`: inside `dst`, which lies in live
        // memory of this context (the caller's contract). Element counts are `width` divided by the
        // memset's size, which divides the row width since the pattern is one element.
        let done = match pattern.len() {
            // SAFETY: see above.
            _ if uniform => unsafe {
                sys::cuMemsetD2D8Async(ptr, pitch, pattern[0], width, rows, s)
            },
            2 if aligned(2) => {
                let value = u16::from_ne_bytes([pattern[0], pattern[1]]);
                // SAFETY: see above; the address and the pitch are 2-byte aligned (checked).
                unsafe { sys::cuMemsetD2D16Async(ptr, pitch, value, width / 2, rows, s) }
            }
            4 if aligned(4) => {
                let value = u32::from_ne_bytes([pattern[0], pattern[1], pattern[2], pattern[3]]);
                // SAFETY: see above; the address and the pitch are 4-byte aligned (checked).
                unsafe { sys::cuMemsetD2D32Async(ptr, pitch, value, width / 4, rows, s) }
            }
            // SAFETY: forwarded contract.
            _ => return unsafe { self.fill_by_doubling(dst, pattern, stream) },
        };
        count(Call::Copy);
        done.result()
            .map_err(|e| driver_error("cuMemsetD2DAsync", e))
    }

    unsafe fn upload(
        &self,
        dst: Region,
        src: &[u8],
        src_pitch: usize,
        stream: &RawStream,
    ) -> Result<(), PoolError> {
        let mut copy = copy2d(dst.width, dst.rows);
        copy.srcMemoryType = CUmemorytype::CU_MEMORYTYPE_HOST;
        copy.srcHost = src.as_ptr().cast();
        copy.srcPitch = src_pitch;
        copy.dstDevice = dst.ptr;
        copy.dstPitch = dst.pitch;
        // The pointer query below asks this context.
        let _guard = self.guard()?;
        self.memcpy2d(&copy, stream)?;
        // A copy from pageable memory returns once the source is staged, so `src` may go after;
        // one from memory the driver knows (page-locked, managed) is still in flight.
        if self.knows_host_memory(src) {
            self.synchronize(stream)?;
        }
        Ok(())
    }

    unsafe fn download(
        &self,
        src: Region,
        dst: &mut [u8],
        dst_pitch: usize,
        stream: &RawStream,
    ) -> Result<(), PoolError> {
        // SAFETY: forwarded contract; `dst` stays valid until the synchronize below returns.
        unsafe { self.download_async(src, dst.as_mut_ptr(), dst_pitch, stream) }?;
        // `dst` is borrowed only for this call: the copy must be complete before returning. Into
        // pageable memory the driver returns once it is, but into page-locked memory it does not,
        // and telling them apart costs about as much as this wait on a stream with nothing left
        // to run (a pointer query, 1 µs on an H200).
        self.synchronize(stream)
    }

    unsafe fn upload_async(
        &self,
        dst: Region,
        src: *const u8,
        src_pitch: usize,
        stream: &RawStream,
    ) -> Result<(), PoolError> {
        let mut copy = copy2d(dst.width, dst.rows);
        copy.srcMemoryType = CUmemorytype::CU_MEMORYTYPE_HOST;
        copy.srcHost = src.cast();
        copy.srcPitch = src_pitch;
        copy.dstDevice = dst.ptr;
        copy.dstPitch = dst.pitch;
        self.memcpy2d(&copy, stream)
    }

    unsafe fn download_async(
        &self,
        src: Region,
        dst: *mut u8,
        dst_pitch: usize,
        stream: &RawStream,
    ) -> Result<(), PoolError> {
        let mut copy = copy2d(src.width, src.rows);
        copy.srcDevice = src.ptr;
        copy.srcPitch = src.pitch;
        copy.dstMemoryType = CUmemorytype::CU_MEMORYTYPE_HOST;
        copy.dstHost = dst.cast();
        copy.dstPitch = dst_pitch;
        self.memcpy2d(&copy, stream)
    }

    unsafe fn copy(&self, dst: Region, src: Region, stream: &RawStream) -> Result<(), PoolError> {
        let mut copy = copy2d(dst.width, dst.rows);
        copy.srcDevice = src.ptr;
        copy.srcPitch = src.pitch;
        copy.dstDevice = dst.ptr;
        copy.dstPitch = dst.pitch;
        self.memcpy2d(&copy, stream)
    }
}

/// Runs `f` with this thread's stream-capture mode relaxed, then restores the mode it had.
fn relaxed<R>(f: impl FnOnce() -> R) -> R {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: exchanges this thread's capture mode with `mode`, a valid value; restored below.
    let exchanged = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result();
    let out = f();
    if exchanged.is_ok() {
        // SAFETY: puts back the mode the exchange above returned.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
    out
}

impl CudaBackend {
    /// Fills `dst` with a pattern no single memset writes (an element of 3, 8, 12... bytes): the
    /// first element word by word with memsets, then copies that double the filled run along row
    /// 0, then down the rows. Nothing reads host memory, so the fill can be captured into a graph.
    /// Elements of more than `MAX_MEMSET_WORDS` words upload their first row from the host
    /// instead, which a graph could only replay from freed memory: refused while capturing.
    ///
    /// # Safety
    /// As [`Backend::fill`].
    unsafe fn fill_by_doubling(
        &self,
        dst: Region,
        pattern: &[u8],
        stream: &RawStream,
    ) -> Result<(), PoolError> {
        /// Memsets for the first element before its row is uploaded from the host instead.
        const MAX_MEMSET_WORDS: usize = 64;
        let elem = pattern.len();
        let word = [4, 2, 1]
            .into_iter()
            .find(|&w| elem.is_multiple_of(w) && dst.ptr.is_multiple_of(w as u64))
            .unwrap_or(1);
        if elem / word <= MAX_MEMSET_WORDS {
            // SAFETY: element 0 of `dst` is live (caller's contract).
            unsafe { self.fill_first_element(dst.ptr, pattern, word, stream) }?;
            // Double the filled run along row 0: [0, n) is copied to [n, 2n), disjoint and inside
            // the row, which holds `dst.width / elem` elements.
            let mut filled = elem;
            while filled < dst.width {
                let n = filled.min(dst.width - filled);
                let from = Region {
                    width: n,
                    rows: 1,
                    ..dst
                };
                let to = Region {
                    ptr: dst.ptr + filled as DevPtr,
                    ..from
                };
                // SAFETY: both runs lie in row 0 of `dst`, which is live, and do not overlap.
                unsafe { self.copy(to, from, stream) }?;
                filled += n;
            }
        } else {
            if self.is_capturing(stream)? {
                return Err(PoolError::Unsupported {
                    device: self.id,
                    what: "set_to inside a graph capture for an element of more than 64 memset \
                           words (its row is uploaded from host memory the graph would outlive)",
                });
            }
            let row: Vec<u8> = pattern.iter().copied().cycle().take(dst.width).collect();
            let first = Region { rows: 1, ..dst };
            // SAFETY: row 0 of `dst` is live (caller's contract); `row` holds one row. The copy
            // is from pageable memory, staged before the call returns, so `row` may go after.
            unsafe { self.upload(first, &row, dst.width, stream) }?;
        }
        let mut filled = 1;
        while filled < dst.rows {
            let n = filled.min(dst.rows - filled);
            let from = Region { rows: n, ..dst };
            let to = Region {
                ptr: dst.ptr + (filled * dst.pitch) as DevPtr,
                rows: n,
                ..dst
            };
            // SAFETY: rows [0, n) and [filled, filled + n) of `dst` are live and disjoint.
            unsafe { self.copy(to, from, stream) }?;
            filled += n;
        }
        Ok(())
    }

    /// Writes `pattern` (one element) at `ptr`, one memset of `word` bytes per word.
    ///
    /// # Safety
    /// `ptr` starts `pattern.len()` live bytes of this context, aligned to `word`, which divides
    /// the pattern's length.
    unsafe fn fill_first_element(
        &self,
        ptr: DevPtr,
        pattern: &[u8],
        word: usize,
        stream: &RawStream,
    ) -> Result<(), PoolError> {
        let _guard = self.guard()?;
        let s = self.cu_stream(stream)?;
        for (i, w) in pattern.chunks_exact(word).enumerate() {
            let at = ptr + (i * word) as DevPtr;
            // SAFETY: word `i` of the element lies in the live bytes at `ptr` and is aligned to
            // its size (the caller's contract), and each memset writes one word.
            let done = unsafe {
                match word {
                    4 => sys::cuMemsetD32Async(
                        at,
                        u32::from_ne_bytes([w[0], w[1], w[2], w[3]]),
                        1,
                        s,
                    ),
                    2 => sys::cuMemsetD16Async(at, u16::from_ne_bytes([w[0], w[1]]), 1, s),
                    _ => sys::cuMemsetD8Async(at, w[0], 1, s),
                }
            };
            done.result()
                .map_err(|e| driver_error("cuMemsetAsync", e))?;
        }
        Ok(())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(pool) = self.mem_pool.take() {
            // SAFETY: the backend is going away with its last device handle; every buffer of the
            // pool borrowed a stream that held that handle, so none is live.
            if let Err(e) = unsafe { result::mem_pool::destroy(pool) } {
                crate::base::event::error!(error = %driver_error("cuMemPoolDestroy", e), "destroying the memory pool failed");
            }
        }
    }
}
