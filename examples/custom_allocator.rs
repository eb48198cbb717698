//! A `GpuAllocator` of your own (OpenCV's `GpuMat::Allocator` and `Stream(allocator)`): a memory
//! budget for a stream, on top of the driver's stream-ordered allocator where the device has one.
//!
//! The allocator refuses a request that would take the stream over its budget with a clean
//! `PoolError::OutOfMemory`, counts what it did, and frees on the stream, so nothing synchronizes.
//! The same workload then runs on a pooled stream for comparison: its stack serves everything.
//!
//! `cargo run --release --example custom_allocator [-- ITERATIONS]`

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use gpu_pool::compat::opencv::BufferPool;
use gpu_pool::prelude::*;
use gpu_pool::{
    alloc::AllocContext, alloc::AllocRequest, alloc::Allocation, alloc::GpuAllocator,
    compat::opencv::set_buffer_pool_config,
};
use support::Stages;
use support::kernels::pattern;

/// Driver memory for one stream, at most `budget` bytes live at once.
#[derive(Debug)]
struct Budgeted {
    budget: usize,
    live: AtomicUsize,
    peak: AtomicUsize,
    allocations: AtomicU64,
    refusals: AtomicU64,
    /// Bytes of each live allocation, to give back to the budget (`Allocation` has no size). A
    /// lock is fine here: this allocator serves what would otherwise be a driver call.
    sizes: Mutex<HashMap<u64, usize>>,
}

impl Budgeted {
    fn new(budget: usize) -> Budgeted {
        Budgeted {
            budget,
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            allocations: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
            sizes: Mutex::new(HashMap::new()),
        }
    }
}

// SAFETY: every `Ok` allocation is fresh driver memory of `pitch * rows` bytes (`alloc_async` or
// `alloc`), which holds `rows` rows of `width_bytes <= pitch` bytes, and is freed once, below.
unsafe impl GpuAllocator for Budgeted {
    fn allocate(
        &self,
        ctx: &AllocContext<'_>,
        req: &AllocRequest,
    ) -> Result<Allocation, PoolError> {
        let bytes = req.pitch * req.rows;
        let reserved = self.live.fetch_update(Relaxed, Relaxed, |live| {
            live.checked_add(bytes).filter(|&n| n <= self.budget)
        });
        if reserved.is_err() {
            self.refusals.fetch_add(1, Relaxed);
            return Err(PoolError::OutOfMemory {
                device: ctx.device_id(),
                requested: bytes,
                context: None,   // the stream attaches the request that needed it
                reclaimed: None, // and what the device gave back before it
            });
        }
        let ptr = if ctx.supports_stream_ordered() {
            ctx.alloc_async(bytes)
        } else {
            ctx.alloc(bytes)
        };
        match ptr {
            Ok(ptr) => {
                self.allocations.fetch_add(1, Relaxed);
                self.peak.fetch_max(self.live.load(Relaxed), Relaxed);
                self.sizes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(ptr, bytes);
                Ok(Allocation::new(ptr, req.pitch))
            }
            Err(e) => {
                self.live.fetch_sub(bytes, Relaxed); // give the reservation back
                Err(e)
            }
        }
    }

    unsafe fn deallocate(&self, ctx: &AllocContext<'_>, a: Allocation) -> Result<(), PoolError> {
        // SAFETY: `a` came from `allocate` above on this context's device and stream, freed once.
        let freed = unsafe {
            if ctx.supports_stream_ordered() {
                ctx.free_async(a.ptr)
            } else {
                ctx.free(a.ptr)
            }
        };
        let bytes = self
            .sizes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&a.ptr);
        self.live.fetch_sub(bytes.unwrap_or(0), Relaxed);
        freed
    }
}

const ROWS: usize = 1024;
const COLS: usize = 1000;

/// Fills a buffer, inverts it into a second one, and checks the result: wrong pixels.
fn work(stages: &Stages, stream: &Stream, seed: i32) -> Result<usize, PoolError> {
    let pool = BufferPool::new(stream);
    let mut src = pool.get_buffer::<u8>(ROWS, COLS)?;
    let mut dst = pool.get_buffer::<u8>(ROWS, COLS)?;
    stages.fill_pattern(stream, src.view_mut(), seed)?;
    stages.invert(stream, src.view(), dst.view_mut())?;
    let out = dst.to_vec()?;
    Ok(out
        .iter()
        .enumerate()
        .filter(|&(i, &v)| v != 255 - pattern(i % COLS, i / COLS, seed))
        .count())
}

fn main() -> Result<(), PoolError> {
    let iterations = support::count_arg(100);
    let device = Device::cuda_or_host();
    let stages = Stages::new(&device);
    set_buffer_pool_config(&device, 4 << 20, 1)?;
    println!("device: {}", Stages::describe(&device));

    // Room for two buffers of the shape at once, not three.
    let probe = Stream::new(&device)?;
    let one = BufferPool::new(&probe).get_buffer::<u8>(ROWS, COLS)?;
    let budgeted = Arc::new(Budgeted::new(2 * one.step() * ROWS));
    drop(one);
    drop(probe);
    let stream = Stream::with_allocator(&device, budgeted.clone())?;

    let mut wrong = 0;
    for i in 0..iterations {
        wrong += work(&stages, &stream, i as i32)?;
    }
    stream.synchronize()?;

    // A third buffer is over budget: a clean error, and the stream goes on working.
    let pool = BufferPool::new(&stream);
    let a = pool.get_buffer::<u8>(ROWS, COLS)?;
    let b = pool.get_buffer::<u8>(ROWS, COLS)?;
    let refused = pool.get_buffer::<u8>(ROWS, COLS).unwrap_err();
    drop((b, a));
    wrong += work(&stages, &stream, -1)?;

    let pooled = Stream::new(&device)?;
    for i in 0..iterations {
        wrong += work(&stages, &pooled, i as i32)?;
    }
    pooled.synchronize()?;

    let stats = stream.stats();
    println!(
        "budgeted stream ({} allocator calls), {iterations} iterations: {} allocations, \
         peak {:.2} MiB of a {:.2} MiB budget, {} refused",
        if device.supports_stream_ordered() {
            "stream-ordered"
        } else {
            "cuMemAlloc"
        },
        budgeted.allocations.load(Relaxed),
        budgeted.peak.load(Relaxed) as f64 / (1 << 20) as f64,
        budgeted.budget as f64 / (1 << 20) as f64,
        budgeted.refusals.load(Relaxed),
    );
    println!("  the request over budget got: {refused}");
    println!(
        "  its driver calls: {} alloc / {} free; bytes live now: {}",
        stats.driver_alloc_calls,
        stats.driver_free_calls,
        budgeted.live.load(Relaxed)
    );
    let pooled_stats = pooled.stats();
    println!(
        "pooled stream, {iterations} iterations: {} stack buffers, {} driver allocation calls",
        pooled_stats.stack_allocations, pooled_stats.driver_alloc_calls,
    );
    println!("pixels differing from the CPU reference: {wrong}");
    if wrong != 0 || budgeted.live.load(Relaxed) != 0 {
        std::process::exit(1);
    }
    drop(stream);
    drop(pooled);
    device.release_stack_memory()?; // everything freed before exit, as a leak checker wants
    Ok(())
}
