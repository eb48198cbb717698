//! Every allocation failure point of a workload, for each pool: the allocation call number `k`
//! fails, for every `k` the workload makes, and so does the one retry an out-of-memory gets after
//! the device's idle memory went back (call `k + 1`), so each failure reaches the caller. Each run must end in success or a clean
//! `PoolError::OutOfMemory`, leave nothing allocated once its objects are dropped, and leave the
//! pool's counters consistent.

use std::sync::Arc;

use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::compat::pplcv::{self, GpuMemoryBlock};
use gpu_pool::prelude::*;
use gpu_pool::{
    alloc::CachingPool, compat::mix::MixMemory, compat::opencv::set_buffer_pool_config,
    config::Fallback,
};

/// Runs `workload` with call 1, 2, ... failing, until a run makes no failing call. Returns how many
/// runs ended in out-of-memory.
fn every_failure_point(name: &str, workload: impl Fn(&Device) -> Result<(), PoolError>) -> usize {
    let mut failed = 0;
    for k in 1.. {
        assert!(k < 500, "{name}: the workload never finished");
        let device = gpu_pool::testing::host_with_faults(k, 2);
        let result = workload(&device);
        // Give the stack memory back, so that what is left is a leak.
        set_buffer_pool_config(&device, 1 << 20, 1).expect("no stream is left");
        assert_eq!(
            gpu_pool::testing::host_live_bytes(&device),
            Some(0),
            "{name}: leak when call {k} fails"
        );
        match result {
            Err(PoolError::OutOfMemory { .. }) => failed += 1,
            Err(e) => panic!("{name}: call {k} failing gave {e}"),
            // The first run that makes fewer than k calls has passed every failure point.
            Ok(()) if ran_out(k, &workload) => break,
            Ok(()) => {}
        }
    }
    failed
}

/// Whether the workload makes fewer than `k` allocation calls (so failing call `k` never fires).
fn ran_out(k: u64, workload: &impl Fn(&Device) -> Result<(), PoolError>) -> bool {
    (k..k + 4).all(|later| workload(&gpu_pool::testing::host_with_faults(later, 2)).is_ok())
}

#[test]
fn the_stack_pool_and_the_dsl_survive_every_failure() {
    let failed = every_failure_point("stack", |device| {
        device.set_fallback(Fallback::Driver);
        set_buffer_pool_config(device, 1 << 20, 1)?;
        let a = Stream::new(device)?; // the stack memory: call 1
        let b = Stream::new(device)?; // no stack left: its buffers fall back
        let input = GpuMat::<u8>::new(&a, 16, 16)?;
        gpu_scope!(a, {
            let mut x = buffer!(512, 1024; u8)?;
            let _over = buffer!(1 << 20; u8)?; // stack full: a driver fallback
            x.set_to(1)?;
            let _y = gpu_scope!(b, {
                let y = buffer!(64; f32)?; // no stack: a driver fallback
                Ok::<_, PoolError>(y.len())
            })?;
            Ok::<_, PoolError>(())
        })?;
        assert_eq!(a.stats().stack_in_use, 0);
        drop(input);
        Ok(())
    });
    // The stack memory failing is no error: the stream is made without a stack, and falls back.
    assert_eq!(failed, 3, "the input and the two fallbacks");
}

#[test]
fn the_caching_pool_survives_every_failure() {
    let failed = every_failure_point("caching", |device| {
        let cache = Arc::new(CachingPool::new(device));
        let stream = Stream::with_allocator(device, cache.clone())?;
        let pool = BufferPool::new(&stream);
        for size in [1000, 5000, 1000, 70_000, 5000] {
            let _b = pool.get_buffer_1d::<u8>(size)?;
        }
        cache.free_held()?;
        let _c = pool.get_buffer::<f32>(64, 64)?;
        let stats = cache.stats();
        assert_eq!(stats.active_blocks, 1);
        Ok(())
    });
    // Calls 2 and 3 fail while blocks are held: the pool frees them and retries, so those failures
    // never reach the caller. Call 1 (nothing held) and call 4 (after free_held) do.
    assert_eq!(
        failed, 2,
        "the first allocation and the one after free_held"
    );
    let device = gpu_pool::testing::host_with_fault(3);
    let cache = Arc::new(CachingPool::new(&device));
    let stream = Stream::with_allocator(&device, cache.clone()).expect("host stream");
    let pool = BufferPool::new(&stream);
    for size in [1000, 5000, 1000, 70_000] {
        drop(
            pool.get_buffer_1d::<u8>(size)
                .expect("the third call's failure is absorbed"),
        );
    }
    assert_eq!(cache.stats().oom_retries, 1);
}

#[test]
fn mix_memory_survives_every_failure() {
    let failed = every_failure_point("mix", |device| {
        let stream = Stream::new(device)?;
        let mut mix = MixMemory::new(device)?;
        for n in [100, 50, 10_000] {
            mix.cpu::<u32>(n)?.fill(3);
            let _ = mix.gpu::<u32>(n)?;
            mix.copy_to_gpu_async(&stream)?;
            mix.copy_to_cpu_async(&stream)?;
            assert_eq!(mix.cpu::<u32>(n)?[n - 1], 3);
        }
        Ok(())
    });
    assert!(failed >= 4, "{failed}: each growth of each side can fail");
}

#[test]
fn the_ppl_cv_pool_survives_every_failure() {
    let _pool = crate::common::ppl_pool_lock();
    let failed = every_failure_point("pplcv", |device| {
        let _ = pplcv::shutdown_gpu_memory_pool();
        let stream = Stream::new(device)?;
        let result = (|| {
            pplcv::activate_gpu_memory_pool_on(device, 1 << 16)?;
            let mut a = GpuMemoryBlock::default();
            pplcv::ppl_cuda_malloc_pitch(100, 10, &mut a)?;
            let _other = GpuMat::<u8>::new(&stream, 4, 4)?; // a driver allocation beside the pool
            pplcv::ppl_cuda_free(&mut a)
        })();
        let _ = pplcv::shutdown_gpu_memory_pool();
        result
    });
    assert_eq!(
        failed, 2,
        "the pool's allocation and the buffer beside it (the stream is made without its stacks)"
    );
}

/// A wrapper for any allocator whose `fail_at`-th allocation (1-based) fails: the fault injection
/// of the host backend, for any device, the GPU included.
#[derive(Debug)]
struct FailAt {
    inner: Arc<dyn gpu_pool::alloc::GpuAllocator>,
    fail_at: u64,
    calls: std::sync::atomic::AtomicU64,
}

// SAFETY: every `Ok` allocation is the inner allocator's, and every deallocation goes back to it.
unsafe impl gpu_pool::alloc::GpuAllocator for FailAt {
    fn allocate(
        &self,
        ctx: &gpu_pool::alloc::AllocContext<'_>,
        req: &gpu_pool::alloc::AllocRequest,
    ) -> Result<gpu_pool::alloc::Allocation, PoolError> {
        let n = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        // The call and the one retry the stream makes after the device gave idle memory back.
        if n == self.fail_at || n == self.fail_at + 1 {
            return Err(PoolError::OutOfMemory {
                device: ctx.device_id(),
                requested: req.bytes,
                context: None, // the stream attaches the request as the error leaves the take
                reclaimed: None,
            });
        }
        self.inner.allocate(ctx, req)
    }

    unsafe fn deallocate(
        &self,
        ctx: &gpu_pool::alloc::AllocContext<'_>,
        allocation: gpu_pool::alloc::Allocation,
    ) -> Result<(), PoolError> {
        // SAFETY: forwarded: `allocation` came from the inner allocator, through `allocate`.
        unsafe { self.inner.deallocate(ctx, allocation) }
    }
}

/// Three DSL buffers on a stream served by `FailAt` over a caching pool, twice (the second time
/// from the cache): a pattern written, read back and checked.
#[pooled(stream)]
fn cached_work(stream: &Stream, n: usize) -> Result<(), PoolError> {
    let mut a = buffer!(n, 300; u8)?;
    let b = buffer!(n; f32)?;
    let mut c = buffer!(7, n; u16)?;
    a.set_to(3)?;
    c.set_to(9)?;
    assert!(a.to_vec()?.iter().all(|&v| v == 3));
    assert!(c.to_vec()?.iter().all(|&v| v == 9));
    assert_eq!(b.len(), n);
    Ok(())
}

#[test]
fn a_failing_allocator_wrapper_leaves_every_device_clean() -> Result<(), PoolError> {
    let host = Device::private_host();
    wrapper_every_k(&host)?;
    // The GPU's lock: the device-wide counters compared below are shared with every GPU test.
    if let Some((gpu, _lock)) = crate::common::gpu("fault_wrapper") {
        wrapper_every_k(&gpu)?;
        println!(
            "fault wrapper: every failure point survived on {}",
            gpu.id()
        );
    }
    Ok(())
}

fn wrapper_every_k(device: &Device) -> Result<(), PoolError> {
    for k in 1..=7 {
        let before = device.stats();
        let cache = Arc::new(CachingPool::new(device));
        let failing = Arc::new(FailAt {
            inner: cache.clone(),
            fail_at: k,
            calls: Default::default(),
        });
        let result = {
            let stream = Stream::with_allocator(device, failing.clone())?;
            let r = cached_work(&stream, 100).and_then(|()| cached_work(&stream, 100));
            stream.synchronize()?;
            r
        };
        let calls = failing.calls.load(std::sync::atomic::Ordering::Relaxed);
        match result {
            Err(PoolError::OutOfMemory { .. }) => assert!(k <= calls),
            Err(e) => panic!("allocation {k} failing gave {e}"),
            Ok(()) => assert!(k > calls, "allocation {k} of {calls} failed unnoticed"),
        }
        assert_eq!(
            cache.stats().active_blocks,
            0,
            "call {k}: a block still handed out"
        );
        cache.free_held()?;
        let after = device.stats();
        assert_eq!(
            after.driver_alloc_calls - before.driver_alloc_calls,
            after.driver_free_calls - before.driver_free_calls,
            "call {k}: every driver allocation freed"
        );
    }
    Ok(())
}

// A `record_stream` wait that fails: the memory it guards is never reused before the other
// stream's work, so the failed wait stays queued and every later release tries it again.

#[test]
fn a_failed_record_stream_wait_stays_queued_for_the_next_release() -> Result<(), PoolError> {
    // Waits 1 and 2 fail, 3 on succeed.
    let device = gpu_pool::testing::host_with_wait_faults(1, 2);
    let (stream, user) = (Stream::new(&device)?, Stream::new(&device)?);
    let used = stream.temp_1d::<u8>(64)?;
    used.record_stream(&user)?;
    drop(used); // wait 1 fails: the block is held
    let first = stream.stats().stack_in_use;
    assert_eq!(first, 64);
    // The wait is still owed: this release tries it again (wait 2, failing), so it holds its block
    // too. Dropping the failed wait would let it go, and with it the order `user` needs.
    drop(stream.temp_1d::<u8>(64)?);
    let held = stream.stats().stack_in_use;
    println!("after a second release while the wait fails: the stack's top at {held} bytes");
    assert!(held > first, "the release went without the owed wait");
    // Wait 3 succeeds: this release goes, and no wait is owed after it.
    drop(stream.temp_1d::<u8>(64)?);
    assert_eq!(stream.stats().stack_in_use, held);
    drop(stream.temp_1d::<u8>(64)?);
    assert_eq!(stream.stats().stack_in_use, held);
    Ok(())
}

#[test]
fn a_stream_dropped_with_a_failed_record_stream_wait_keeps_its_stack_out_of_use()
-> Result<(), PoolError> {
    for (fails, kept_out) in [(2, true), (1, false)] {
        let device = gpu_pool::testing::host_with_wait_faults(1, fails);
        set_buffer_pool_config(&device, 1 << 20, 1)?;
        let (stream, user) = (Stream::new(&device)?, Stream::new(&device)?);
        let used = stream.temp_1d::<u8>(64)?;
        used.record_stream(&user)?;
        drop(used); // wait 1 fails
        // The drop issues the owed wait (wait 2): if it fails too, the stack is not reused.
        drop(stream);
        let next = Stream::new(&device)?;
        let source = next.temp_1d::<u8>(64)?.source();
        println!("{fails} failing waits: the next stream's temporary came from {source:?}");
        assert_eq!(source == Source::Stack, !kept_out, "{fails} failing waits");
    }
    Ok(())
}
