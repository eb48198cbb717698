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
//! use pool_runtime::pplcv::*;
//! use pool_runtime::{Device, PoolError};
//!
//! // The application sizes and activates the pool once...
//! activate_gpu_memory_pool_on(&Device::host_with_limit(None), ceil_2d_volume(640 * 4, 480))?;
//! // ...and a library function takes its intermediate buffer from it when it is active.
//! fn library_function() -> Result<usize, PoolError> {
//!     let mut block = GpuMemoryBlock::default();
//!     if memory_pool_used() {
//!         ppl_cuda_malloc_pitch(640 * 4, 480, &mut block)?;
//!     }
//!     let pitch = block.pitch;
//!     ppl_cuda_free(&mut block)?;
//!     Ok(pitch)
//! }
//! assert_eq!(library_function()?, 2560);
//! shutdown_gpu_memory_pool()?;
//! # Ok::<(), PoolError>(())
//! ```

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use crate::backend::DevPtr;
use crate::device::Device;
use crate::error::PoolError;
use crate::layout::align_up;

/// ppl.cv's `PITCH_GRANULARITY`: block starts and 2D pitches are multiples of it.
pub const PITCH_GRANULARITY: usize = 512;

/// The pool bytes a 1D block of `volume` bytes needs (ppl.cv's `ceil1DVolume`): `volume` rounded
/// up to 512. Saturates at `usize::MAX`, which no activation can satisfy.
pub fn ceil_1d_volume(volume: usize) -> usize {
    align_up(volume, PITCH_GRANULARITY).unwrap_or(usize::MAX)
}

/// The pool bytes a 2D block of `width` bytes by `height` rows needs (ppl.cv's `ceil2DVolume`):
/// the pitch, `width` rounded up to 512, times `height`. Saturates at `usize::MAX`.
pub fn ceil_2d_volume(width: usize, height: usize) -> usize {
    align_up(width, PITCH_GRANULARITY)
        .and_then(|pitch| pitch.checked_mul(height))
        .unwrap_or(usize::MAX)
}

/// A block of the pool (ppl.cv's `GpuMemoryBlock`): kernels use `data + offset`, rows `pitch`
/// bytes apart (0 for a 1D block). Dropping an allocated block frees it.
#[derive(Debug, Default)]
pub struct GpuMemoryBlock {
    /// The pool's base address (0 while unallocated).
    pub data: u64,
    /// Offset of the block in the pool.
    pub offset: usize,
    /// Bytes of the block.
    pub size: usize,
    /// Bytes between rows of a 2D block; 0 for a 1D block.
    pub pitch: usize,
    /// Which activation the block belongs to (0: none).
    generation: u64,
    /// Whether the pool lives in host memory (the host backend).
    host: bool,
}

impl GpuMemoryBlock {
    /// The block's first byte (`data + offset`).
    pub fn device_ptr(&self) -> u64 {
        self.data + self.offset as u64
    }

    /// Whether the block holds memory of the pool.
    pub fn is_allocated(&self) -> bool {
        self.generation != 0
    }

    /// The block's bytes as a host slice, on the host backend (where the pool is host memory): how
    /// CPU twins of kernels use a block. `PoolError::Unsupported` on a GPU, and an empty slice for
    /// an unallocated block.
    pub fn host_bytes_mut(&mut self) -> Result<&mut [u8], PoolError> {
        if !self.is_allocated() {
            return Ok(&mut []);
        }
        if !self.host {
            return Err(PoolError::Unsupported {
                device: crate::error::DeviceId::Cuda(0),
                what: "host access to a ppl.cv pool block on a GPU",
            });
        }
        // SAFETY: on the host backend the pool is host memory, zeroed at activation; this block
        // owns `size` bytes of it exclusively (live blocks never overlap) while it is allocated,
        // and the pool cannot be shut down while a block is live; `&mut self` keeps it ours.
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
    generation: u64,
    /// Live blocks: offset to size.
    blocks: BTreeMap<usize, usize>,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn lock() -> MutexGuard<'static, Option<Pool>> {
    // Each critical section below updates the map or the option in one step after its checks.
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

fn not_active() -> PoolError {
    PoolError::InvalidConfig {
        reason:
            "the ppl.cv memory pool is not activated; call activate_gpu_memory_pool(size) first"
                .into(),
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
        return Err(PoolError::InvalidConfig {
            reason: "the ppl.cv memory pool is already activated; shut it down first".into(),
        });
    }
    if size == 0 {
        return Err(PoolError::InvalidConfig {
            reason: "a ppl.cv memory pool of 0 bytes holds nothing; size it with ceil_1d_volume / ceil_2d_volume".into(),
        });
    }
    let base = device.inner.driver_alloc(size, None)?;
    *pool = Some(Pool {
        device: device.clone(),
        base,
        capacity: size,
        generation: GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        blocks: BTreeMap::new(),
    });
    Ok(())
}

/// Frees the pool (ppl.cv's `shutDownGpuMemoryPool`). Refused while blocks are live.
pub fn shutdown_gpu_memory_pool() -> Result<(), PoolError> {
    let mut guard = lock();
    let pool = guard.as_ref().ok_or_else(not_active)?;
    if !pool.blocks.is_empty() {
        return Err(PoolError::ConfigInUse {
            device: pool.device.id(),
            held: pool.blocks.len(),
        });
    }
    let pool = guard.take().expect("checked above");
    // SAFETY: the pool's one allocation, freed once (the pool is taken out); no block is live, and
    // the driver's free waits for queued work.
    unsafe { pool.device.inner.driver_free(pool.base, None) }
}

/// Whether the pool is activated (ppl.cv's `memoryPoolUsed`).
pub fn memory_pool_used() -> bool {
    lock().is_some()
}

/// Bytes of the pool held by live blocks, or `None` when it is not activated.
pub fn memory_pool_in_use() -> Option<usize> {
    lock().as_ref().map(|p| p.blocks.values().sum())
}

fn take(size: usize, pitch: usize, block: &mut GpuMemoryBlock) -> Result<(), PoolError> {
    if block.is_allocated() {
        return Err(PoolError::InvalidConfig {
            reason: "this GpuMemoryBlock already holds memory; free it or use another".into(),
        });
    }
    let mut guard = lock();
    let pool = guard.as_mut().ok_or_else(not_active)?;
    // First fit: the gaps between live blocks in offset order, then the tail.
    let mut start: usize = 0;
    let mut found = None;
    for (&offset, &len) in &pool.blocks {
        if start.checked_add(size).is_some_and(|end| end <= offset) {
            found = Some(start);
            break;
        }
        start = align_up(offset + len, PITCH_GRANULARITY).unwrap_or(usize::MAX);
    }
    let offset = match found {
        Some(offset) => offset,
        None if start
            .checked_add(size)
            .is_some_and(|end| end <= pool.capacity) =>
        {
            start
        }
        None => {
            return Err(PoolError::OutOfMemory {
                device: pool.device.id(),
                requested: size,
            });
        }
    };
    pool.blocks.insert(offset, size);
    *block = GpuMemoryBlock {
        data: pool.base,
        offset,
        size,
        pitch,
        generation: pool.generation,
        host: pool.device.is_host(),
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
        return Err(PoolError::InvalidConfig {
            reason: "this GpuMemoryBlock holds no memory of the pool".into(),
        });
    }
    let mut guard = lock();
    let pool = guard.as_mut().ok_or_else(not_active)?;
    if pool.generation != block.generation || pool.blocks.remove(&block.offset).is_none() {
        return Err(PoolError::InvalidConfig {
            reason: "this GpuMemoryBlock is not a live block of the active pool".into(),
        });
    }
    block.generation = 0;
    block.data = 0;
    Ok(())
}
