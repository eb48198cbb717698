//! ppl.cv's CUDA memory pool, for library authors: one allocation made by the application, carved
//! by library functions that need intermediate buffers ("one allocation and freeing, many uses").
//!
//! Same meaning as ppl.cv: the pool is one process-wide block of `size` bytes; a block starts at
//! the first gap between live blocks that holds it, on a 512-byte boundary; a 2D block's pitch is
//! the width rounded up to 512, and its size `pitch * height`. Where ppl.cv logs an error and
//! leaves the block unset (pool too small, not activated, double activation, unknown block), this
//! module returns a `PoolError` and changes nothing. Unlike ppl.cv, shutting the pool down while
//! blocks are live is refused (ppl.cv frees the memory under them), and a block also frees itself
//! when dropped.
//!
//! [`PplPool`] is the same pool as a value (several may live; a [`PplBlock`] borrows its pool and
//! frees itself when dropped); the ppl.cv-named functions below wrap one process-wide `PplPool`.
//!
//! Blocks are reused in host order, as in ppl.cv: use them on one stream, or synchronize before
//! a block freed by one stream's work is taken for another's.
//!
//! ```
//! use gpu_pool::compat::pplcv::*;
//! use gpu_pool::{Device, PoolError};
//!
//! // The application sizes and activates the pool once...
//! activate_gpu_memory_pool_on(&Device::private_host(), ceil_2d_volume(640 * 4, 480))?;
//! // ...and a library function takes its intermediate buffer from it when it is active.
//! fn library_function() -> Result<usize, PoolError> {
//!     let mut block = GpuMemoryBlock::default();
//!     if memory_pool_used() {
//!         ppl_cuda_malloc_pitch(640 * 4, 480, &mut block)?;
//!     }
//!     let pitch = block.pitch();
//!     ppl_cuda_free(&mut block)?;
//!     Ok(pitch)
//! }
//! assert_eq!(library_function()?, 2560);
//! shutdown_gpu_memory_pool()?;
//! # Ok::<(), PoolError>(())
//! ```

use std::sync::{Mutex, MutexGuard};

use crate::base::error::PoolError;
pub use crate::base::error::PplError;
use crate::base::id::DeviceId;
use crate::base::layout::align_up;
use crate::base::unique::Counter;
use crate::core::device::Device;
use crate::storage::backend::DevPtr;

/// ppl.cv's `PITCH_GRANULARITY`: block starts and 2D pitches are multiples of it.
pub const PITCH_GRANULARITY: usize = 512;

/// The pool bytes a 1D block of `volume` bytes needs (ppl.cv's `ceil1DVolume`): `volume` rounded
/// up to 512. Saturates at `usize::MAX`, which no activation can satisfy.
#[must_use]
pub fn ceil_1d_volume(volume: usize) -> usize {
    align_up(volume, PITCH_GRANULARITY).unwrap_or(usize::MAX)
}

/// The pool bytes a 2D block of `width` bytes by `height` rows needs (ppl.cv's `ceil2DVolume`):
/// the pitch, `width` rounded up to 512, times `height`. Saturates at `usize::MAX`.
#[must_use]
pub fn ceil_2d_volume(width: usize, height: usize) -> usize {
    align_up(width, PITCH_GRANULARITY)
        .and_then(|pitch| pitch.checked_mul(height))
        .unwrap_or(usize::MAX)
}

/// A block of the pool (ppl.cv's `GpuMemoryBlock`): kernels use [`device_ptr`](Self::device_ptr)
/// (ppl.cv's `data + offset`), rows [`pitch`](Self::pitch) bytes apart (0 for a 1D block). Dropping
/// an allocated block frees it.
///
/// ppl.cv's public fields are accessor methods here: the pool trusts a block's identity when it
/// frees it and when it lends its bytes, so safe code must not be able to forge one.
///
/// ```compile_fail
/// let mut block = gpu_pool::compat::pplcv::GpuMemoryBlock::default();
/// block.size = 1 << 30; // error: `size` is private; read it with `block.size()`
/// ```
#[derive(Debug, Default)]
pub struct GpuMemoryBlock {
    data: u64,
    offset: usize,
    size: usize,
    pitch: usize,
    /// The pool's record of this block: unique in the process, never reused; 0 while unallocated.
    id: u64,
    /// The device of the pool, while allocated.
    device: Option<DeviceId>,
}

impl GpuMemoryBlock {
    /// The pool's base address (ppl.cv's `data`); 0 while unallocated.
    #[must_use]
    pub fn data(&self) -> u64 {
        self.data
    }

    /// Offset of the block in the pool (ppl.cv's `offset`).
    #[must_use]
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Bytes of the block (ppl.cv's `size`).
    #[must_use]
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes between rows of a 2D block; 0 for a 1D block (ppl.cv's `pitch`).
    #[must_use]
    pub fn pitch(&self) -> usize {
        self.pitch
    }

    /// The block's first byte (`data + offset`); 0 while unallocated.
    #[must_use]
    pub fn device_ptr(&self) -> u64 {
        // No overflow: an allocated block lies inside the pool's one allocation, and an unallocated
        // one is all zeros.
        self.data + self.offset as u64
    }

    /// Whether the block holds memory of the pool (a zero-byte block holds an empty range of it).
    #[must_use]
    pub fn is_allocated(&self) -> bool {
        self.id != 0
    }

    /// The block's bytes as a host slice, on the host backend (where the pool is host memory): how
    /// CPU twins of kernels use a block. `PoolError::Unsupported` on a GPU, and an empty slice for
    /// an unallocated or zero-byte block.
    pub fn host_bytes_mut(&mut self) -> Result<&mut [u8], PoolError> {
        let Some(device) = self.device else {
            return Ok(&mut []);
        };
        // SAFETY: the fields are private and set only by `take`, so this block owns the record `id`
        // of the active pool, which cannot be shut down while the record lives; `&mut self` keeps
        // the bytes ours for the slice's lifetime.
        unsafe { host_bytes(device, self.device_ptr(), self.size) }
    }
}

impl Drop for GpuMemoryBlock {
    fn drop(&mut self) {
        if self.is_allocated()
            && let Err(e) = ppl_cuda_free(self)
        {
            crate::base::event::error!(error = %e, "freeing a ppl.cv pool block failed");
        }
    }
}

/// A ppl.cv pool as a value: one allocation of `size` bytes on a device, carved into blocks by
/// first fit on 512-byte boundaries, as the process-wide pool is (whose functions wrap one
/// `PplPool`). A [`PplBlock`] borrows its pool, so the pool cannot be freed under a live block, and
/// gives its bytes back when dropped; several pools may live side by side.
///
/// ```
/// use gpu_pool::compat::pplcv::{PplPool, ceil_2d_volume};
/// use gpu_pool::{Device, PoolError};
/// let pool = PplPool::new(&Device::private_host(), ceil_2d_volume(640 * 4, 480) + 512)?;
/// let image = pool.malloc_pitch(640 * 4, 480)?;
/// let sums = pool.malloc(480)?;
/// assert_eq!((image.pitch(), image.offset(), sums.offset()), (2560, 0, 2560 * 480));
/// drop(image);
/// assert_eq!(pool.in_use(), 480);                       // `sums` alone
/// # Ok::<(), PoolError>(())
/// ```
///
/// A block cannot outlive its pool:
/// ```compile_fail
/// use gpu_pool::{Device, compat::pplcv::PplPool};
/// let block = PplPool::new(&Device::private_host(), 1024).unwrap().malloc(8).unwrap();
/// ```
#[derive(Debug)]
pub struct PplPool {
    device: Device,
    base: DevPtr,
    capacity: usize,
    blocks: Mutex<Blocks>,
    /// Whether `close` freed the allocation already (then `Drop` does not).
    closed: bool,
}

#[derive(Debug, Default)]
struct Blocks {
    /// Live blocks that hold bytes, sorted by offset: (offset, size, block id). They never
    /// overlap. A sorted `Vec`, not a `BTreeMap`: first fit walks them all anyway, and each map
    /// type is thousands of lines of generic code in every build of the crate (issue 34).
    by_offset: Vec<(usize, usize, u64)>,
    /// Live zero-byte blocks' ids: they hold no bytes, so they stay out of the first-fit list
    /// (where one would share an offset with a real block).
    empty: Vec<u64>,
}

impl Blocks {
    fn live(&self) -> usize {
        self.by_offset.len() + self.empty.len()
    }

    /// First fit: the first gap between live blocks, in offset order, that holds `size` bytes, else
    /// the tail of a pool of `capacity` bytes.
    fn first_fit(&self, size: usize, capacity: usize) -> Option<usize> {
        let mut start: usize = 0;
        for &(offset, len, _) in &self.by_offset {
            if start.checked_add(size).is_some_and(|end| end <= offset) {
                return Some(start);
            }
            start = align_up(offset + len, PITCH_GRANULARITY)?;
        }
        start
            .checked_add(size)
            .is_some_and(|end| end <= capacity)
            .then_some(start)
    }
}

/// A block's place in its pool: what a [`PplBlock`] and a [`GpuMemoryBlock`] hold.
#[derive(Clone, Copy, Debug)]
struct Placed {
    offset: usize,
    size: usize,
    pitch: usize,
    /// Unique in the process, never reused.
    id: u64,
}

impl PplPool {
    /// A pool of `size` bytes on `device` (ppl.cv's `activateGpuMemoryPool`, as a value): one
    /// driver allocation. `PplError::State` for 0 bytes.
    pub fn new(device: &Device, size: usize) -> Result<PplPool, PoolError> {
        if size == 0 {
            return Err(PoolError::Ppl(PplError::State {
                reason: "a pool of 0 bytes holds nothing; size it with ceil_1d_volume / \
                         ceil_2d_volume",
            }));
        }
        let base = device.storage().alloc(size, None)?;
        Ok(PplPool {
            device: device.clone(),
            base,
            capacity: size,
            blocks: Mutex::new(Blocks::default()),
            closed: false,
        })
    }

    /// A 1D block of `size` bytes (ppl.cv's `pplCudaMalloc`); `PoolError::OutOfMemory` when no
    /// gap holds it.
    pub fn malloc(&self, size: usize) -> Result<PplBlock<'_>, PoolError> {
        let placed = self.place(size, 0)?;
        Ok(PplBlock { pool: self, placed })
    }

    /// A 2D block of `height` rows of `width` bytes, its pitch `width` rounded up to 512 (ppl.cv's
    /// `pplCudaMallocPitch`).
    pub fn malloc_pitch(&self, width: usize, height: usize) -> Result<PplBlock<'_>, PoolError> {
        let (size, pitch) = pitched(width, height)?;
        let placed = self.place(size, pitch)?;
        Ok(PplBlock { pool: self, placed })
    }

    /// The device the pool's memory is on.
    #[must_use]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of the pool.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes held by live blocks.
    #[must_use]
    pub fn in_use(&self) -> usize {
        self.lock().by_offset.iter().map(|&(_, size, _)| size).sum()
    }

    /// Frees the pool's allocation now and reports a driver error (dropping it logs one).
    pub fn close(mut self) -> Result<(), PoolError> {
        self.closed = true;
        // SAFETY: the pool's one allocation, freed once (`closed` keeps `Drop` from freeing it
        // again); no block is live, since blocks borrow the pool and `self` is owned here; the
        // driver's free waits for queued work.
        unsafe { self.device.storage().free(self.base, None) }
    }

    fn lock(&self) -> MutexGuard<'_, Blocks> {
        // Each critical section updates the maps in one step after its checks.
        crate::base::sync::lock(&self.blocks)
    }

    fn place(&self, size: usize, pitch: usize) -> Result<Placed, PoolError> {
        let mut blocks = self.lock();
        let id = BLOCK_IDS.next();
        let offset = if size == 0 {
            blocks.empty.push(id);
            0
        } else {
            let offset = blocks
                .first_fit(size, self.capacity)
                .ok_or(PoolError::OutOfMemory {
                    device: self.device.id(),
                    requested: size,
                    context: None,
                    reclaimed: None,
                })?;
            let at = blocks.by_offset.partition_point(|&(o, ..)| o < offset);
            blocks.by_offset.insert(at, (offset, size, id));
            offset
        };
        Ok(Placed {
            offset,
            size,
            pitch,
            id,
        })
    }

    /// Gives `placed`'s bytes back; `false` if the pool holds no such block.
    fn remove(&self, placed: &Placed) -> bool {
        let mut blocks = self.lock();
        let found = if placed.size == 0 {
            let at = blocks.empty.iter().position(|&id| id == placed.id);
            at.map(|at| blocks.empty.swap_remove(at))
        } else {
            let entry = (placed.offset, placed.size, placed.id);
            let at = blocks.by_offset.binary_search(&entry).ok();
            at.map(|at| blocks.by_offset.remove(at).2)
        };
        found.is_some()
    }

    fn live_blocks(&self) -> usize {
        self.lock().live()
    }
}

impl Drop for PplPool {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        // SAFETY: as in `close`: freed once, and no block borrows the pool any more.
        if let Err(e) = unsafe { self.device.storage().free(self.base, None) } {
            crate::base::event::error!(error = %e, "freeing a ppl.cv pool failed");
        }
    }
}

/// A block of a [`PplPool`], which it borrows; its bytes go back to the pool when it is dropped.
/// Kernels use [`device_ptr`](Self::device_ptr), rows [`pitch`](Self::pitch) bytes apart (0 for a
/// 1D block).
#[derive(Debug)]
pub struct PplBlock<'p> {
    pool: &'p PplPool,
    placed: Placed,
}

impl PplBlock<'_> {
    /// The block's first byte.
    #[must_use]
    pub fn device_ptr(&self) -> u64 {
        // No overflow: the block lies inside the pool's one allocation.
        self.pool.base + self.placed.offset as u64
    }

    /// Offset of the block in the pool.
    #[must_use]
    pub fn offset(&self) -> usize {
        self.placed.offset
    }

    /// Bytes of the block.
    #[must_use]
    pub fn size(&self) -> usize {
        self.placed.size
    }

    /// Bytes between rows of a 2D block; 0 for a 1D block.
    #[must_use]
    pub fn pitch(&self) -> usize {
        self.placed.pitch
    }

    /// The block's bytes as a host slice, on the host backend (CPU twins of kernels);
    /// `PoolError::Unsupported` on a GPU, and an empty slice for a zero-byte block.
    pub fn host_bytes_mut(&mut self) -> Result<&mut [u8], PoolError> {
        // SAFETY: the block's range is its own until it is dropped, its pool outlives it (borrowed),
        // and `&mut self` keeps the bytes ours for the slice's lifetime.
        unsafe { host_bytes(self.pool.device.id(), self.device_ptr(), self.placed.size) }
    }
}

impl Drop for PplBlock<'_> {
    fn drop(&mut self) {
        // Cannot fail: the block was placed by its pool, which it borrows, and is removed once.
        let removed = self.pool.remove(&self.placed);
        debug_assert!(removed, "a PplBlock's record is its pool's until dropped");
    }
}

/// The pool bytes and pitch of a 2D block of `height` rows of `width` bytes.
fn pitched(width: usize, height: usize) -> Result<(usize, usize), PoolError> {
    let overflow = || PoolError::SizeOverflow {
        rows: height,
        cols: width,
        elem_size: 1,
    };
    let pitch = align_up(width, PITCH_GRANULARITY).ok_or_else(overflow)?;
    Ok((pitch.checked_mul(height).ok_or_else(overflow)?, pitch))
}

/// `size` bytes at `ptr` of a pool on `device`, as a host slice (host backend only).
///
/// # Safety
/// `ptr..ptr + size` is a live block of a pool on `device` that outlives `'a`, and nothing else
/// reads or writes it during `'a`.
unsafe fn host_bytes<'a>(
    device: DeviceId,
    ptr: u64,
    size: usize,
) -> Result<&'a mut [u8], PoolError> {
    if !matches!(device, DeviceId::Host(_)) {
        return Err(PoolError::Unsupported {
            device,
            what: "host access to a ppl.cv pool block on a GPU",
        });
    }
    if size == 0 {
        return Ok(&mut []);
    }
    // SAFETY: on the host backend a pool is host memory, zeroed at creation; the caller promises
    // a live block's range that nothing else touches for 'a, and live blocks do not overlap.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr as usize as *mut u8, size) })
}

static POOL: Mutex<Option<PplPool>> = Mutex::new(None);
static BLOCK_IDS: Counter = Counter::new();

fn lock() -> MutexGuard<'static, Option<PplPool>> {
    // Each critical section below updates the map or the option in one step after its checks.
    crate::base::sync::lock(&POOL)
}

fn not_active() -> PoolError {
    PoolError::Ppl(PplError::State {
        reason: "not activated; call activate_gpu_memory_pool(size) first",
    })
}

/// Activates the pool on the first CUDA device, or the host device without one (ppl.cv's
/// `activateGpuMemoryPool`): one allocation of `size` bytes.
pub fn activate_gpu_memory_pool(size: usize) -> Result<(), PoolError> {
    activate_gpu_memory_pool_on(&Device::cuda_or_host(), size)
}

/// Activates the pool on `device`: the process-wide [`PplPool`].
pub fn activate_gpu_memory_pool_on(device: &Device, size: usize) -> Result<(), PoolError> {
    let mut pool = lock();
    if pool.is_some() {
        return Err(PoolError::Ppl(PplError::State {
            reason: "already activated; shut it down first",
        }));
    }
    *pool = Some(PplPool::new(device, size)?);
    Ok(())
}

/// Frees the pool (ppl.cv's `shutDownGpuMemoryPool`). Refused while blocks are live
/// (`PplError::InUse`).
pub fn shutdown_gpu_memory_pool() -> Result<(), PoolError> {
    let mut guard = lock();
    let pool = guard.as_ref().ok_or_else(not_active)?;
    // `GpuMemoryBlock`s borrow nothing: their records, checked here under the lock that takes
    // and frees them, keep the pool alive.
    let live = pool.live_blocks();
    if live > 0 {
        return Err(PoolError::Ppl(PplError::InUse {
            device: pool.device.id(),
            live,
        }));
    }
    guard.take().expect("checked above").close()
}

/// Whether the pool is activated (ppl.cv's `memoryPoolUsed`).
#[must_use]
pub fn memory_pool_used() -> bool {
    lock().is_some()
}

/// Bytes of the pool held by live blocks, or `None` when it is not activated.
#[must_use]
pub fn memory_pool_in_use() -> Option<usize> {
    lock().as_ref().map(PplPool::in_use)
}

fn take(size: usize, pitch: usize, block: &mut GpuMemoryBlock) -> Result<(), PoolError> {
    if block.is_allocated() {
        return Err(PoolError::Ppl(PplError::State {
            reason: "this GpuMemoryBlock already holds memory; free it or use another",
        }));
    }
    let guard = lock();
    let pool = guard.as_ref().ok_or_else(not_active)?;
    let Placed {
        offset,
        size,
        pitch,
        id,
    } = pool.place(size, pitch)?;
    // The old value is unallocated (checked above), so dropping it frees nothing.
    *block = GpuMemoryBlock {
        data: pool.base,
        offset,
        size,
        pitch,
        id,
        device: Some(pool.device.id()),
    };
    Ok(())
}

/// A 1D block of `size` bytes (ppl.cv's `pplCudaMalloc`).
pub fn ppl_cuda_malloc(size: usize, block: &mut GpuMemoryBlock) -> Result<(), PoolError> {
    take(size, 0, block)
}

/// A 2D block of `height` rows of `width` bytes, pitch `width` rounded up to 512 (ppl.cv's
/// `pplCudaMallocPitch`).
pub fn ppl_cuda_malloc_pitch(
    width: usize,
    height: usize,
    block: &mut GpuMemoryBlock,
) -> Result<(), PoolError> {
    let (size, pitch) = pitched(width, height)?;
    take(size, pitch, block)
}

/// Returns a block to the pool (ppl.cv's `pplCudaFree`); the block is reset.
pub fn ppl_cuda_free(block: &mut GpuMemoryBlock) -> Result<(), PoolError> {
    if !block.is_allocated() {
        return Err(PoolError::Ppl(PplError::State {
            reason: "this GpuMemoryBlock holds no memory of the pool",
        }));
    }
    let guard = lock();
    let pool = guard.as_ref().ok_or_else(not_active)?;
    let placed = Placed {
        offset: block.offset,
        size: block.size,
        pitch: block.pitch,
        id: block.id,
    };
    if !pool.remove(&placed) {
        return Err(PoolError::UnknownBlock {
            address: block.device_ptr(),
            owner: "the active ppl.cv pool".into(),
        });
    }
    // Field by field: assigning a whole block would drop the old one, whose `Drop` frees it again.
    let GpuMemoryBlock {
        data,
        offset,
        size,
        pitch,
        id,
        device,
    } = block;
    (*data, *offset, *size, *pitch, *id, *device) = (0, 0, 0, 0, 0, None);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_values_whose_blocks_free_themselves() -> Result<(), PoolError> {
        let device = Device::private_host();
        let (a, b) = (PplPool::new(&device, 2048)?, PplPool::new(&device, 1024)?);
        let first = a.malloc(100)?;
        let mut second = a.malloc_pitch(700, 1)?; // pitch 1024, after `first` rounded to 512
        let other = b.malloc(1024)?; // the other pool is full, `a` is not
        assert_eq!(
            (first.offset(), second.offset(), second.pitch()),
            (0, 512, 1024)
        );
        assert_eq!((a.in_use(), b.in_use()), (1124, 1024));
        assert!(matches!(
            b.malloc(1),
            Err(PoolError::OutOfMemory { requested: 1, .. })
        ));
        second.host_bytes_mut()?.fill(7);
        drop(first);
        assert_eq!(a.malloc(512)?.offset(), 0, "a freed block's gap is reused");
        let empty = a.malloc(0)?;
        assert_eq!((empty.size(), a.live_blocks()), (0, 2));
        drop((second, empty, other));
        assert_eq!((a.in_use(), a.live_blocks(), b.in_use()), (0, 0, 0));
        a.close()?;
        assert!(matches!(
            PplPool::new(&device, 0),
            Err(PoolError::Ppl(PplError::State { .. }))
        ));
        Ok(())
    }
}
