//! The host heap the pool itself uses: releasing buffers frees every record the pool made for
//! them. A counting global allocator sees what a leak checker would, counted per thread: the
//! pool makes no thread of its own, and the test harness's threads allocate when they please.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use gpu_pool::{
    Device, PoolError, Stream, compat::opencv::BufferPool, compat::opencv::set_buffer_pool_config,
    config::Fallback,
};

struct Counting;

thread_local! {
    /// Bytes this thread allocated and did not free (a const `Cell`: no allocation, no destructor).
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

fn live() -> isize {
    LIVE.with(Cell::get)
}

// SAFETY: forwards to the system allocator, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LIVE.try_with(|l| l.set(l.get() + layout.size() as isize));
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = LIVE.try_with(|l| l.set(l.get() - layout.size() as isize));
        // SAFETY: forwarded: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn released_and_dropped_fallback_buffers_free_their_records() -> Result<(), PoolError> {
    let device = Device::private_host();
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(&device, 4096, 1)?;
    let stream = Stream::new(&device)?;
    let pool = BufferPool::new(&stream);
    let _fills_the_stack = pool.get_buffer_1d::<u8>(4096)?;
    // Warm up whatever the first fallback allocates once (maps, stats).
    pool.get_buffer_1d::<u8>(1000)?.release()?;
    drop(pool.get_buffer_1d::<u8>(1000)?);

    let before = live();
    for _ in 0..1000 {
        pool.get_buffer_1d::<u8>(1000)?.release()?; // 1000 bytes of device memory, and a record
        drop(pool.get_buffer_1d::<u8>(1000)?);
    }
    let grown = live() - before;
    assert_eq!(
        grown, 0,
        "the pool's heap grew by {grown} bytes over 2000 fallback buffers"
    );
    Ok(())
}
