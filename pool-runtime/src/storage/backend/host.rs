//! The host backend: real host memory, streams that run each operation at once.
//!
//! It exists so that every pool behaviour runs in CI and every example runs without a GPU. It keeps
//! the CUDA rules that matter to a pool: 512-byte texture alignment, pitched allocations, a memory
//! limit that produces out-of-memory, and frees of unknown addresses reported instead of obeyed.

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::sync::Mutex;

use super::{Backend, DevPtr, RawEvent, RawStream, Region};
use crate::base::error::PoolError;
use crate::base::id::DeviceId;

/// The texture alignment of the H100, used on the host too so layouts match.
pub(crate) const HOST_TEXTURE_ALIGNMENT: usize = 512;

#[derive(Debug)]
pub(crate) struct HostBackend {
    id: DeviceId,
    /// Bytes the backend may hand out in all; `usize::MAX` for no limit.
    limit: usize,
    /// Fault injection: the allocation call with this number (1-based) fails; 0 for none.
    fail_at: u64,
    /// How many allocation calls from `fail_at` on fail (1 unless a test asks for more).
    fail_for: u64,
    /// Fault injection: the unmap or unreserve call with this number (1-based) fails; 0 for none.
    fail_unmap_at: u64,
    unmap_calls: std::sync::atomic::AtomicU64,
    /// Fault injection: whether streams mark their work with events ([`RawEvent::Host`]), as a
    /// GPU's do, so that the pool waits for them.
    events: bool,
    /// Fault injection: the stream waits with these numbers (1-based, from `fail_wait_at`) fail.
    fail_wait: std::ops::Range<u64>,
    wait_calls: std::sync::atomic::AtomicU64,
    alloc_calls: std::sync::atomic::AtomicU64,
    live: Mutex<Live>,
}

#[derive(Debug, Default)]
struct Live {
    /// Device memory, as the layouts allocated (a zero-byte request takes one byte).
    bytes: usize,
    blocks: HashMap<DevPtr, Layout>,
    /// Pinned host memory; not held against the device's limit.
    pinned: usize,
    /// Reserved address ranges (growable stacks): host memory the OS commits only where written,
    /// and counted only where mapped.
    reservations: HashMap<DevPtr, Layout>,
    /// Mapped granules by handle: their address and bytes (held against the limit).
    mappings: HashMap<u64, (DevPtr, usize)>,
    next_handle: u64,
}

/// The host's granule of virtual memory: small, so tests see several mappings cheaply.
pub(crate) const HOST_VMM_GRANULE: usize = 64 << 10;

/// What a growable stack reserves on a host device without a memory limit.
const HOST_RESERVE: usize = 1 << 30;

impl HostBackend {
    pub(crate) fn new(id: DeviceId, limit: Option<usize>) -> HostBackend {
        HostBackend::with_fault(id, limit, 0)
    }

    pub(crate) fn with_fault(id: DeviceId, limit: Option<usize>, fail_at: u64) -> HostBackend {
        HostBackend {
            id,
            limit: limit.unwrap_or(usize::MAX),
            fail_at,
            fail_for: 1,
            fail_unmap_at: 0,
            unmap_calls: std::sync::atomic::AtomicU64::new(0),
            events: false,
            fail_wait: 0..0,
            wait_calls: std::sync::atomic::AtomicU64::new(0),
            alloc_calls: std::sync::atomic::AtomicU64::new(0),
            live: Mutex::new(Live::default()),
        }
    }

    /// A backend whose unmap or unreserve call number `fail_unmap_at` fails.
    /// As [`with_fault`](Self::with_fault), with `count` calls from `fail_at` on failing.
    #[cfg(feature = "testing")]
    pub(crate) fn with_faults(id: DeviceId, fail_at: u64, count: u64) -> HostBackend {
        let mut backend = HostBackend::with_fault(id, None, fail_at);
        backend.fail_for = count;
        backend
    }

    #[cfg(feature = "testing")]
    pub(crate) fn with_unmap_fault(id: DeviceId, fail_unmap_at: u64) -> HostBackend {
        let mut backend = HostBackend::with_fault(id, None, 0);
        backend.fail_unmap_at = fail_unmap_at;
        backend
    }

    /// A backend whose streams mark their work with events, and whose stream waits number
    /// `fail_at` to `fail_at + count - 1` fail.
    #[cfg(feature = "testing")]
    pub(crate) fn with_wait_faults(id: DeviceId, fail_at: u64, count: u64) -> HostBackend {
        let mut backend = HostBackend::with_fault(id, None, 0);
        backend.events = true;
        backend.fail_wait = fail_at..fail_at.saturating_add(count);
        backend
    }

    /// Counts a stream wait; `Err` if it is one chosen to fail.
    fn wait_fault(&self) -> Result<(), PoolError> {
        let call = self
            .wait_calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if self.fail_wait.contains(&call) {
            return Err(PoolError::Unsupported {
                device: self.id,
                what: "a stream wait that fault injection failed",
            });
        }
        Ok(())
    }

    /// Counts an unmap or unreserve call; `Err` if it is the one chosen to fail.
    fn unmap_fault(&self) -> Result<(), PoolError> {
        let call = self
            .unmap_calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if call == self.fail_unmap_at {
            return Err(PoolError::Unsupported {
                device: self.id,
                what: "an unmap that fault injection failed",
            });
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Live> {
        // A panic while the lock was held cannot leave `Live` half-updated: each update is one
        // insert or remove plus one addition, done after every fallible step.
        crate::base::sync::lock(&self.live)
    }

    /// Counts an allocation call; `Err` if it is the one chosen to fail.
    fn fault(&self, requested: usize) -> Result<(), PoolError> {
        let call = self
            .alloc_calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        if self.fail_at > 0 && (self.fail_at..self.fail_at + self.fail_for).contains(&call) {
            return Err(self.oom(requested));
        }
        Ok(())
    }

    /// Checks that the parts of `regions` inside a reservation (a growable stack) are mapped, as
    /// the device would fault on an access to unmapped memory: `Err(UnmappedAccess)` if not. Where
    /// one is, the returned guard keeps the mappings as they are until the access is done, so an
    /// unmap on another thread cannot slip between the check and the access.
    fn mapped_for(
        &self,
        regions: &[Region],
    ) -> Result<Option<std::sync::MutexGuard<'_, Live>>, PoolError> {
        let live = self.lock();
        let mut reserved = false;
        for r in regions.iter().filter(|r| r.rows > 0 && r.width > 0) {
            let start = r.ptr;
            let end = r.ptr + ((r.rows - 1) * r.pitch + r.width) as DevPtr;
            let inside = live
                .reservations
                .iter()
                .any(|(&base, layout)| start < base + layout.size() as DevPtr && base < end);
            if !inside {
                continue;
            }
            reserved = true;
            // Walk the mappings from `start`: each must begin where the last ended.
            let mut at = start;
            while at < end {
                let Some(&(m, n)) = live
                    .mappings
                    .values()
                    .find(|&&(m, n)| m <= at && at < m + n as DevPtr)
                else {
                    return Err(PoolError::UnknownBlock {
                        address: at,
                        owner: format!(
                            "the mapped memory of the host backend of {} (an access to stack \
                             memory that is not mapped)",
                            self.id
                        ),
                    });
                };
                at = m + n as DevPtr;
            }
        }
        Ok(reserved.then_some(live))
    }

    fn oom(&self, requested: usize) -> PoolError {
        PoolError::OutOfMemory {
            device: self.id,
            requested,
            context: None,
            reclaimed: None,
        }
    }
}

impl Backend for HostBackend {
    fn texture_alignment(&self) -> usize {
        HOST_TEXTURE_ALIGNMENT
    }

    fn supports_stream_ordered(&self) -> bool {
        true
    }

    fn new_stream(&self) -> Result<RawStream, PoolError> {
        Ok(RawStream::Host)
    }

    fn vmm_granularity(&self) -> Option<usize> {
        Some(HOST_VMM_GRANULE)
    }

    fn total_memory(&self) -> usize {
        self.limit.min(HOST_RESERVE)
    }

    fn no_vmm(&self) -> PoolError {
        PoolError::Unsupported {
            device: self.id,
            what: "virtual memory management",
        }
    }

    fn reserve(&self, bytes: usize) -> Result<DevPtr, PoolError> {
        self.fault(bytes)?;
        let layout =
            Layout::from_size_align(bytes.max(1), HOST_VMM_GRANULE).map_err(|_| self.oom(bytes))?;
        // SAFETY: `layout` has a non-zero size. Not zeroed: a large allocation is fresh pages the
        // OS commits only when written, so a reservation costs address space, as on CUDA; `map`
        // zeroes (so commits) what it maps.
        let ptr = unsafe { alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(self.oom(bytes));
        }
        self.lock().reservations.insert(ptr as DevPtr, layout);
        Ok(ptr as DevPtr)
    }

    unsafe fn unreserve(&self, ptr: DevPtr, _bytes: usize) -> Result<(), PoolError> {
        self.unmap_fault()?;
        let mut live = self.lock();
        let Some(&layout) = live.reservations.get(&ptr) else {
            return Err(PoolError::UnknownBlock {
                address: ptr,
                owner: format!("the reservations of the host backend of {}", self.id),
            });
        };
        let end = ptr + layout.size() as DevPtr;
        if live.mappings.values().any(|&(at, _)| at >= ptr && at < end) {
            return Err(PoolError::Unsupported {
                device: self.id,
                what: "freeing a reservation with memory still mapped in it",
            });
        }
        live.reservations.remove(&ptr);
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly `layout` (recorded) and left the map
        // just above, so it is freed once.
        unsafe { alloc::dealloc(ptr as *mut u8, layout) };
        Ok(())
    }

    fn map(&self, at: DevPtr, bytes: usize) -> Result<u64, PoolError> {
        self.fault(bytes)?;
        let mut live = self.lock();
        let inside = live.reservations.iter().any(|(&base, layout)| {
            at >= base && at.saturating_add(bytes as DevPtr) <= base + layout.size() as DevPtr
        });
        let overlaps = live
            .mappings
            .values()
            .any(|&(m, n)| at < m + n as DevPtr && m < at + bytes as DevPtr);
        if !inside
            || overlaps
            || !bytes.is_multiple_of(HOST_VMM_GRANULE)
            || !at.is_multiple_of(HOST_VMM_GRANULE as u64)
        {
            return Err(PoolError::Unsupported {
                device: self.id,
                what: "mapping outside a reservation, over a mapping, or off the granule",
            });
        }
        let total = live.bytes.checked_add(bytes).ok_or(self.oom(bytes))?;
        if total > self.limit {
            return Err(self.oom(bytes));
        }
        live.bytes = total;
        live.next_handle += 1;
        let handle = live.next_handle;
        live.mappings.insert(handle, (at, bytes));
        // SAFETY: `at..at + bytes` lies in a reservation of ours (checked above), mapped by no one
        // else: zeroed, as fresh device memory reads, and committed now, as a mapping is.
        unsafe { std::ptr::write_bytes(at as *mut u8, 0, bytes) };
        Ok(handle)
    }

    unsafe fn unmap(&self, at: DevPtr, bytes: usize, handle: u64) -> Result<(), PoolError> {
        self.unmap_fault()?;
        let mut live = self.lock();
        if live.mappings.get(&handle) != Some(&(at, bytes)) {
            return Err(PoolError::UnknownBlock {
                address: at,
                owner: format!("the mappings of the host backend of {}", self.id),
            });
        }
        live.mappings.remove(&handle);
        live.bytes -= bytes; // added by `map` for this very mapping
        Ok(())
    }

    fn synchronize(&self, _stream: &RawStream) -> Result<(), PoolError> {
        Ok(())
    }

    fn record_event(&self, _stream: &RawStream) -> Result<Option<RawEvent>, PoolError> {
        // Host streams finish every operation before returning: nothing to wait for, unless a
        // test asks for events.
        Ok(self.events.then_some(RawEvent::Host))
    }

    fn wait_event(&self, _stream: &RawStream, _event: RawEvent) -> Result<(), PoolError> {
        // Whatever the event marks has finished: host operations complete before they return.
        self.wait_fault()
    }

    fn wait_for(&self, _stream: &RawStream, _event: &RawEvent) -> Result<(), PoolError> {
        self.wait_fault()
    }

    fn wait_host(&self, _event: &RawEvent) -> Result<(), PoolError> {
        Ok(())
    }

    /// Bytes allocated and not freed (device and pinned memory alike).
    #[cfg(any(test, feature = "testing"))]
    fn live_bytes(&self) -> Option<usize> {
        let live = self.lock();
        Some(live.bytes + live.pinned)
    }

    fn event_done(&self, _event: &RawEvent) -> Result<bool, PoolError> {
        Ok(true)
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, PoolError> {
        self.fault(bytes)?;
        // Zero-size layouts are not allowed by the global allocator; one byte stands in.
        let layout = Layout::from_size_align(bytes.max(1), HOST_TEXTURE_ALIGNMENT)
            .map_err(|_| self.oom(bytes))?;
        let mut live = self.lock();
        let total = live
            .bytes
            .checked_add(layout.size())
            .ok_or(self.oom(bytes))?;
        if total > self.limit {
            return Err(self.oom(bytes));
        }
        // SAFETY: `layout` has a non-zero size. Zeroed memory means a download of a buffer that was
        // never written reads zeros, not uninitialised bytes.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(self.oom(bytes));
        }
        let addr = ptr as DevPtr;
        live.bytes = total;
        live.blocks.insert(addr, layout);
        Ok(addr)
    }

    fn alloc_pitch(&self, width: usize, rows: usize) -> Result<(DevPtr, usize), PoolError> {
        let overflow = || self.oom(usize::MAX);
        let pitch = crate::base::layout::align_up(width.max(1), HOST_TEXTURE_ALIGNMENT)
            .ok_or_else(overflow)?;
        let bytes = pitch.checked_mul(rows).ok_or_else(overflow)?;
        Ok((self.alloc(bytes)?, pitch))
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8, PoolError> {
        self.fault(bytes)?;
        let layout = Layout::from_size_align(bytes.max(1), HOST_TEXTURE_ALIGNMENT)
            .map_err(|_| self.oom(bytes))?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(self.oom(bytes));
        }
        self.lock().pinned += layout.size();
        Ok(ptr)
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, bytes: usize) -> Result<(), PoolError> {
        let layout = Layout::from_size_align(bytes.max(1), HOST_TEXTURE_ALIGNMENT)
            .map_err(|_| self.oom(bytes))?;
        // SAFETY: the caller passes a pointer from `alloc_pinned(bytes)`, which used this layout.
        unsafe { alloc::dealloc(ptr, layout) };
        let mut live = self.lock();
        debug_assert!(live.pinned >= layout.size(), "pinned memory freed twice");
        live.pinned -= layout.size().min(live.pinned);
        Ok(())
    }

    unsafe fn free(&self, ptr: DevPtr) -> Result<(), PoolError> {
        let mut live = self.lock();
        let Some(layout) = live.blocks.remove(&ptr) else {
            return Err(PoolError::UnknownBlock {
                address: ptr,
                owner: format!("the host backend of {}", self.id),
            });
        };
        live.bytes -= layout.size(); // added by `alloc` with this very layout
        // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly `layout` (we recorded it) and
        // is removed from the map, so it is freed once.
        unsafe { alloc::dealloc(ptr as *mut u8, layout) };
        Ok(())
    }

    fn alloc_async(&self, bytes: usize, _stream: &RawStream) -> Result<DevPtr, PoolError> {
        self.alloc(bytes)
    }

    unsafe fn free_async(&self, ptr: DevPtr, _stream: &RawStream) -> Result<(), PoolError> {
        // SAFETY: forwarded contract; host streams have finished all earlier work already.
        unsafe { self.free(ptr) }
    }

    unsafe fn fill(
        &self,
        dst: Region,
        pattern: &[u8],
        _stream: &RawStream,
    ) -> Result<(), PoolError> {
        let _mapped = self.mapped_for(&[dst])?;
        for row in 0..dst.rows {
            // SAFETY: the caller guarantees `dst` lies in live memory: row `row` starts at
            // `ptr + row * pitch` and holds `width` bytes.
            let bytes = unsafe { row_mut(dst, row) };
            for chunk in bytes.chunks_mut(pattern.len().max(1)) {
                chunk.copy_from_slice(&pattern[..chunk.len()]);
            }
        }
        Ok(())
    }

    unsafe fn upload(
        &self,
        dst: Region,
        src: &[u8],
        src_pitch: usize,
        _stream: &RawStream,
    ) -> Result<(), PoolError> {
        let _mapped = self.mapped_for(&[dst])?;
        for row in 0..dst.rows {
            let from = &src[row * src_pitch..][..dst.width];
            // SAFETY: as in `fill`; `src` and device memory never overlap (device memory is ours).
            unsafe { row_mut(dst, row) }.copy_from_slice(from);
        }
        Ok(())
    }

    unsafe fn upload_async(
        &self,
        dst: Region,
        src: *const u8,
        src_pitch: usize,
        _stream: &RawStream,
    ) -> Result<(), PoolError> {
        let _mapped = self.mapped_for(&[dst])?;
        for row in 0..dst.rows {
            // SAFETY: the caller's contract: `src` holds every row; device memory is ours, so
            // the two never overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.add(row * src_pitch),
                    row_mut(dst, row).as_mut_ptr(),
                    dst.width,
                );
            }
        }
        Ok(())
    }

    unsafe fn download(
        &self,
        src: Region,
        dst: &mut [u8],
        dst_pitch: usize,
        _stream: &RawStream,
    ) -> Result<(), PoolError> {
        let _mapped = self.mapped_for(&[src])?;
        for row in 0..src.rows {
            // SAFETY: the caller guarantees `src` lies in live memory.
            let from = unsafe { row_ref(src, row) };
            dst[row * dst_pitch..][..src.width].copy_from_slice(from);
        }
        Ok(())
    }

    unsafe fn download_async(
        &self,
        src: Region,
        dst: *mut u8,
        dst_pitch: usize,
        _stream: &RawStream,
    ) -> Result<(), PoolError> {
        let _mapped = self.mapped_for(&[src])?;
        for row in 0..src.rows {
            // SAFETY: the caller guarantees `src` is live and `dst` writable for every row; host
            // memory of a buffer and `dst` are distinct allocations.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    row_ref(src, row).as_ptr(),
                    dst.add(row * dst_pitch),
                    src.width,
                );
            }
        }
        Ok(())
    }

    unsafe fn copy(&self, dst: Region, src: Region, _stream: &RawStream) -> Result<(), PoolError> {
        let _mapped = self.mapped_for(&[dst, src])?;
        for row in 0..dst.rows {
            // SAFETY: the caller guarantees both regions are live and do not overlap.
            unsafe { row_mut(dst, row) }.copy_from_slice(unsafe { row_ref(src, row) });
        }
        Ok(())
    }
}

impl Drop for HostBackend {
    fn drop(&mut self) {
        let live = self.live.get_mut().unwrap_or_else(|e| e.into_inner());
        for (&ptr, &layout) in live.blocks.iter().chain(&live.reservations) {
            // SAFETY: every entry is a live block or reservation allocated with its recorded
            // layout; the backend is going away, so nothing can use it any more.
            unsafe { alloc::dealloc(ptr as *mut u8, layout) };
        }
    }
}

/// # Safety
/// Row `row` of `region` lies in live host-backend memory that nothing else borrows.
unsafe fn row_mut<'a>(region: Region, row: usize) -> &'a mut [u8] {
    let start = region.ptr as usize + row * region.pitch;
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts_mut(start as *mut u8, region.width) }
}

/// # Safety
/// Row `row` of `region` lies in live host-backend memory.
unsafe fn row_ref<'a>(region: Region, row: usize) -> &'a [u8] {
    let start = region.ptr as usize + row * region.pitch;
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts(start as *const u8, region.width) }
}

#[cfg(test)]
mod unmapped_tests {
    use super::*;

    /// A fill of stack memory that is not mapped is refused, as the device would fault on it.
    #[test]
    fn an_access_to_unmapped_stack_memory_is_refused() -> Result<(), PoolError> {
        let host = HostBackend::new(DeviceId::Host(0), None);
        let base = host.reserve(4 * HOST_VMM_GRANULE)?;
        let handle = host.map(base, HOST_VMM_GRANULE)?;
        let region = |ptr, width| Region {
            ptr,
            pitch: width,
            width,
            rows: 1,
        };
        let stream = RawStream::Host;
        // SAFETY: inside the reservation, which is host memory of ours all through.
        unsafe { host.fill(region(base, HOST_VMM_GRANULE), &[1], &stream) }?;
        let across = region(base + 16, HOST_VMM_GRANULE);
        // SAFETY: as above; refused before any byte is written.
        let err = unsafe { host.fill(across, &[1], &stream) }.unwrap_err();
        assert!(matches!(err, PoolError::UnknownBlock { .. }), "{err}");
        // SAFETY: mapped just above with `handle`, unused.
        unsafe { host.unmap(base, HOST_VMM_GRANULE, handle) }?;
        // SAFETY: as above.
        assert!(unsafe { host.fill(region(base, 64), &[1], &stream) }.is_err());
        // SAFETY: nothing is mapped in it any more.
        unsafe { host.unreserve(base, 4 * HOST_VMM_GRANULE) }
    }
}
