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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

use crate::backend::DevPtr;
use crate::device::Device;
use crate::error::PoolError;
use crate::id::DeviceId;
use crate::layout::align_up;
use crate::unique::Counter;

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
        if !matches!(device, DeviceId::Host(_)) {
            return Err(PoolError::Unsupported {
                device,
                what: "host access to a ppl.cv pool block on a GPU",
            });
        }
        if self.size == 0 {
            return Ok(&mut []);
        }
        // SAFETY: the fields are private and set only by `take`, so this block owns the record
        // `id` of the active pool: `size` bytes at `offset` of the pool's host allocation, zeroed
        // at activation, overlapping no other live block's (zero-byte blocks hold no bytes). The
        // pool cannot be shut down while the record lives, and `&mut self` makes the slice ours.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.device_ptr() as usize as *mut u8, self.size)
        })
    }
}

impl Drop for GpuMemoryBlock {
    fn drop(&mut self) {
        if self.is_allocated()
            && let Err(e) = ppl_cuda_free(self)
        {
            tracing::error!(error = %e, "freeing a ppl.cv pool block failed");
        }
    }
}

struct Pool {
    device: Device,
    base: DevPtr,
    capacity: usize,
    /// Live blocks that hold bytes, by offset: (size, block id). They never overlap.
    blocks: BTreeMap<usize, (usize, u64)>,
    /// Live zero-byte blocks: they hold no bytes, so they stay out of the first-fit map (where one
    /// would share an offset with a real block and replace its record).
    empty: BTreeSet<u64>,
}

impl Pool {
    fn live_blocks(&self) -> usize {
        self.blocks.len() + self.empty.len()
    }

    /// First fit: the first gap between live blocks, in offset order, that holds `size` bytes, else
    /// the tail.
    fn first_fit(&self, size: usize) -> Option<usize> {
        let mut start: usize = 0;
        for (&offset, &(len, _)) in &self.blocks {
            if start.checked_add(size).is_some_and(|end| end <= offset) {
                return Some(start);
            }
            start = align_up(offset + len, PITCH_GRANULARITY)?;
        }
        start
            .checked_add(size)
            .is_some_and(|end| end <= self.capacity)
            .then_some(start)
    }
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);
static BLOCK_IDS: Counter = Counter::new();

fn lock() -> MutexGuard<'static, Option<Pool>> {
    // Each critical section below updates the map or the option in one step after its checks.
    crate::sync::lock(&POOL)
}

fn not_active() -> PoolError {
    PoolError::PplPoolState {
        reason: "not activated; call activate_gpu_memory_pool(size) first",
    }
}

/// Activates the pool on the first CUDA device, or the host device without one (ppl.cv's
/// `activateGpuMemoryPool`): one allocation of `size` bytes.
pub fn activate_gpu_memory_pool(size: usize) -> Result<(), PoolError> {
    activate_gpu_memory_pool_on(&Device::cuda_or_host(), size)
}

/// Activates the pool on `device`.
pub fn activate_gpu_memory_pool_on(device: &Device, size: usize) -> Result<(), PoolError> {
    let mut pool = lock();
    if pool.is_some() {
        return Err(PoolError::PplPoolState {
            reason: "already activated; shut it down first",
        });
    }
    if size == 0 {
        return Err(PoolError::PplPoolState {
            reason: "a pool of 0 bytes holds nothing; size it with ceil_1d_volume / ceil_2d_volume",
        });
    }
    let base = device.storage().alloc(size, None)?;
    *pool = Some(Pool {
        device: device.clone(),
        base,
        capacity: size,
        blocks: BTreeMap::new(),
        empty: BTreeSet::new(),
    });
    Ok(())
}

/// Frees the pool (ppl.cv's `shutDownGpuMemoryPool`). Refused while blocks are live
/// (`PoolError::PplPoolInUse`).
pub fn shutdown_gpu_memory_pool() -> Result<(), PoolError> {
    let mut guard = lock();
    let pool = guard.as_ref().ok_or_else(not_active)?;
    if pool.live_blocks() > 0 {
        return Err(PoolError::PplPoolInUse {
            device: pool.device.id(),
            live: pool.live_blocks(),
        });
    }
    let pool = guard.take().expect("checked above");
    // SAFETY: the pool's one allocation, freed once (the pool is taken out); no block is live, and
    // the driver's free waits for queued work.
    unsafe { pool.device.storage().free(pool.base, None) }
}

/// Whether the pool is activated (ppl.cv's `memoryPoolUsed`).
#[must_use]
pub fn memory_pool_used() -> bool {
    lock().is_some()
}

/// Bytes of the pool held by live blocks, or `None` when it is not activated.
#[must_use]
pub fn memory_pool_in_use() -> Option<usize> {
    lock()
        .as_ref()
        .map(|p| p.blocks.values().map(|&(size, _)| size).sum())
}

fn take(size: usize, pitch: usize, block: &mut GpuMemoryBlock) -> Result<(), PoolError> {
    if block.is_allocated() {
        return Err(PoolError::PplPoolState {
            reason: "this GpuMemoryBlock already holds memory; free it or use another",
        });
    }
    let mut guard = lock();
    let pool = guard.as_mut().ok_or_else(not_active)?;
    let id = BLOCK_IDS.next();
    let offset = if size == 0 {
        pool.empty.insert(id);
        0
    } else {
        let offset = pool.first_fit(size).ok_or(PoolError::OutOfMemory {
            device: pool.device.id(),
            requested: size,
            context: None,
            reclaimed: None,
        })?;
        pool.blocks.insert(offset, (size, id));
        offset
    };
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
    let overflow = || PoolError::SizeOverflow {
        rows: height,
        cols: width,
        elem_size: 1,
    };
    let pitch = align_up(width, PITCH_GRANULARITY).ok_or_else(overflow)?;
    take(
        pitch.checked_mul(height).ok_or_else(overflow)?,
        pitch,
        block,
    )
}

/// Returns a block to the pool (ppl.cv's `pplCudaFree`); the block is reset.
pub fn ppl_cuda_free(block: &mut GpuMemoryBlock) -> Result<(), PoolError> {
    if !block.is_allocated() {
        return Err(PoolError::PplPoolState {
            reason: "this GpuMemoryBlock holds no memory of the pool",
        });
    }
    let mut guard = lock();
    let pool = guard.as_mut().ok_or_else(not_active)?;
    let owned = if block.size == 0 {
        pool.empty.remove(&block.id)
    } else if pool.blocks.get(&block.offset) == Some(&(block.size, block.id)) {
        pool.blocks.remove(&block.offset).is_some()
    } else {
        false
    };
    if !owned {
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
