//! Hooks for tests of code built on gpu-pool: fault injection and leak checks on the host
//! backend. Not needed in production code, so not on [`Device`] itself, and only with the
//! `testing` feature (off by default): enable it in `[dev-dependencies]`.
//!
//! ```
//! use gpu_pool::testing::{host_live_bytes, host_with_faults};
//! use gpu_pool::{compat::opencv::BufferPool, FallbackReason, PoolError, Source, Stream};
//! // The stack memory itself fails, and its retry: the stream goes without.
//! let device = host_with_faults(1, 2);
//! let stream = Stream::new(&device)?;
//! assert_eq!(stream.stack_index(), None);
//! let b = BufferPool::new(&stream).get_buffer_1d::<u8>(64)?;
//! assert_eq!(b.source(), Source::Fallback(FallbackReason::NoStackMemory));
//! drop(b);
//! drop(stream);
//! assert_eq!(host_live_bytes(&device), Some(0));
//! # Ok::<(), PoolError>(())
//! ```

use crate::core::device::Device;
use crate::host_mem::HostMem;

/// A private host device whose allocation call number `fail_at` (1-based, every kind of
/// allocation counted) fails with out-of-memory: for testing that every failure point is
/// survived. 0 never fails.
#[must_use]
pub fn host_with_fault(fail_at: u64) -> Device {
    Device::new_private_host(None, fail_at)
}

/// A private host device whose allocation calls `fail_at` to `fail_at + count - 1` fail with
/// out-of-memory. With `count` 2 a failure survives the one retry an out-of-memory gets after the
/// device's idle memory went back, so it reaches the caller.
///
/// ```
/// use gpu_pool::{config::Fallback, Device, compat::opencv::GpuMat, PoolError, compat::opencv::set_buffer_pool_config, Stream, testing};
/// for (count, fails) in [(1, false), (2, true)] {
///     let device = testing::host_with_faults(2, count);
///     device.set_fallback(Fallback::Driver);
///     set_buffer_pool_config(&device, 1 << 20, 1)?;
///     let stream = Stream::new(&device)?; // call 1: the stacks
///     assert_eq!(GpuMat::<u8>::new(&stream, 4, 4).is_err(), fails); // call 2, and its retry
/// }
/// # Ok::<(), PoolError>(())
/// ```
#[must_use]
pub fn host_with_faults(fail_at: u64, count: u64) -> Device {
    Device::new_private_host_faults(fail_at, count)
}

/// A private host device whose unmap or unreserve call number `fail_at` (1-based; growable
/// stacks' `Stream::trim` and the end of a stream make them) fails: for testing that a failed
/// give-back leaves the stack usable. 0 never fails.
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, PoolError, Stream, testing};
/// let device = testing::host_with_unmap_fault(1);
/// device.set_growable_stacks(true)?;
/// let stream = Stream::new(&device)?;
/// drop(BufferPool::new(&stream).get_buffer_1d::<u8>(16 << 20)?);
/// assert!(stream.trim().is_err()); // the injected failure
/// assert_eq!(stream.stats().stack_mapped, 16 << 20); // still mapped, still usable
/// drop(BufferPool::new(&stream).get_buffer_1d::<u8>(16 << 20)?);
/// assert_eq!(stream.trim()?, 16 << 20);
/// # Ok::<(), PoolError>(())
/// ```
#[must_use]
pub fn host_with_unmap_fault(fail_at: u64) -> Device {
    Device::new_private_host_unmap_fault(fail_at)
}

/// A private host device whose streams mark their work with events, as a GPU's do, and whose
/// stream waits (`cuStreamWaitEvent`'s stand-in) number `fail_at` to `fail_at + count - 1`
/// (1-based) fail: for testing that a wait that could not be made leaves no memory reused before
/// the work it was for.
///
/// ```
/// use gpu_pool::{PoolError, Stream, testing};
/// let device = testing::host_with_wait_faults(1, 1);
/// let (stream, user) = (Stream::new(&device)?, Stream::new(&device)?);
/// let used = stream.temp_1d::<u8>(64)?;
/// used.record_stream(&user)?; // the release must wait for `user`'s work...
/// drop(used); // ...the wait fails: the memory stays held
/// assert_eq!(stream.stats().stack_in_use, 64);
/// # Ok::<(), PoolError>(())
/// ```
#[must_use]
pub fn host_with_wait_faults(fail_at: u64, count: u64) -> Device {
    Device::new_private_host_wait_faults(fail_at, count)
}

/// On a host device, the bytes its backend has handed out and not taken back (device and pinned
/// memory): what a leak check compares. `None` on a GPU.
#[must_use]
pub fn host_live_bytes(device: &Device) -> Option<usize> {
    device.backend().live_bytes()
}

/// How many dropped [`HostMem`]s of `device` wait for their copies before their memory is freed
/// (checked at the device's next `HostMem::new` and each `Stream::synchronize`, waited for when
/// the device is dropped). Always 0 on the host backend, whose copies are done when queued.
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, HostMem, PoolError, Stream, testing};
/// let stream = Stream::new(&Device::private_host())?;
/// let mut mem = HostMem::<u8>::new(stream.device(), 64)?;
/// BufferPool::new(&stream).get_buffer_1d::<u8>(64)?.download_async(&mut mem)?;
/// drop(mem);
/// assert_eq!(testing::host_mem_frees_waiting(stream.device()), 0);
/// # Ok::<(), PoolError>(())
/// ```
#[must_use]
pub fn host_mem_frees_waiting(device: &Device) -> usize {
    device.inner.deferred.waiting()
}

/// Whether `mem`'s copies are marked by an event each rather than by a ticket of their stream's
/// clock: true once a wait on the host had to synchronize a whole stream (see `HostMem`).
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, GpuWrite, HostMem, PoolError, Stream, testing};
/// let stream = Stream::new(&Device::host())?;
/// let mut mem = HostMem::<u8>::new(stream.device(), 64)?;
/// BufferPool::new(&stream).get_buffer_1d::<u8>(64)?.upload_async(&mem)?;
/// stream.synchronize()?; // vouches for the copy
/// mem.as_mut_slice()?.fill(1);
/// assert!(!testing::host_mem_marks_copies_with_events(&mem));
/// # Ok::<(), PoolError>(())
/// ```
#[must_use]
pub fn host_mem_marks_copies_with_events<T: bytemuck::Pod>(mem: &HostMem<T>) -> bool {
    mem.marks_copies_with_events()
}
