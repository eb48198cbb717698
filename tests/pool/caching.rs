//! The binned caching pool (PyOpenCL's `MemoryPool`): standalone, as the stack's fallback, on out
//! of memory, and across streams. On a private host device, and on the GPU where there is one.

use std::sync::Arc;

use crate::common::each_device;
use gpu_pool::GpuRead;
use gpu_pool::{
    Device, FallbackReason, PoolError, Source, Stream, alloc::CachingPool,
    compat::opencv::BufferPool, compat::opencv::set_buffer_pool_config, config::Fallback,
};

#[test]
fn a_freed_block_serves_the_next_request_of_its_bin_without_a_driver_call() -> Result<(), PoolError>
{
    each_device("caching_hits", |device| {
        let cache = Arc::new(CachingPool::new(device));
        let stream = Stream::with_allocator(device, cache.clone())?;
        let pool = BufferPool::new(&stream);
        let first = pool.get_buffer_1d::<u8>(1000)?;
        let address = first.device_ptr();
        drop(first);
        let calls = device.stats();
        for len in [1000, 990, 1023, 1024] {
            // Each is 1024 bytes after the 64-byte rounding of 1D layouts; the bin holds 1024..=1087.
            let again = pool.get_buffer_1d::<u8>(len)?;
            assert_eq!(again.device_ptr(), address, "{len} reuses the held block");
        }
        let after = device.stats();
        assert_eq!(
            after.driver_alloc_calls, calls.driver_alloc_calls,
            "hits make no driver call"
        );
        assert_eq!(after.driver_free_calls, calls.driver_free_calls);
        let other_bin = pool.get_buffer_1d::<u8>(4096)?;
        assert_ne!(other_bin.device_ptr(), address);
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses), (4, 2));
        assert_eq!((stats.active_blocks, stats.held_blocks), (1, 1));
        drop(other_bin);
        assert_eq!(
            (cache.stats().held_blocks, cache.stats().held_bytes),
            (2, 1087 + 4351)
        );
        Ok(())
    })
}

#[test]
fn free_held_and_stop_holding_give_memory_back() -> Result<(), PoolError> {
    each_device("caching_release", |device| {
        let cache = Arc::new(CachingPool::new(device));
        let stream = Stream::with_allocator(device, cache.clone())?;
        let pool = BufferPool::new(&stream);
        drop((
            pool.get_buffer::<f32>(64, 64)?,
            pool.get_buffer_1d::<u8>(10)?,
        ));
        assert_eq!(cache.stats().held_blocks, 2);
        let frees = device.stats().driver_free_calls;
        let held = cache.stats().held_bytes;
        assert!(held >= 64 * 64 * 4 + 10, "{held}");
        assert_eq!(
            cache.free_held()?,
            held,
            "the bytes freed, as `stats` counted them"
        );
        assert_eq!(device.stats().driver_free_calls, frees + 2);
        assert_eq!(cache.stats().held_bytes, 0);
        cache.stop_holding()?;
        drop(pool.get_buffer_1d::<u8>(10)?);
        assert_eq!(cache.stats().held_blocks, 0, "not holding: freed at once");
        assert_eq!(device.stats().driver_free_calls, frees + 3);
        Ok(())
    })
}

#[test]
fn as_the_stack_fallback_it_turns_repeated_overflows_into_hits() -> Result<(), PoolError> {
    each_device("caching_fallback", |device| {
        device.set_fallback(Fallback::Caching);
        set_buffer_pool_config(device, 1 << 20, 1)?;
        let stream = Stream::new(device);
        device.set_fallback(Fallback::Driver);
        let stream = stream?;
        let pool = BufferPool::new(&stream);
        let calls = device.stats().driver_alloc_calls;
        for _ in 0..10 {
            let big = pool.get_buffer::<u8>(2048, 1024)?; // 2 MiB: larger than the stack
            assert_eq!(big.source(), Source::Fallback(FallbackReason::TooLarge));
        }
        assert_eq!(
            device.stats().driver_alloc_calls - calls,
            1,
            "one miss, nine hits"
        );
        drop(stream);
        set_buffer_pool_config(device, 10 << 20, 5)?;
        Ok(())
    })
}

#[test]
fn out_of_memory_frees_what_is_held_and_retries_once() -> Result<(), PoolError> {
    // Bins round 2 MiB up to 2.125 MiB and 3 MiB to 3.125 MiB: both do not fit in 4 MiB.
    let device = Device::host_with_limit(4 << 20);
    let cache = Arc::new(CachingPool::new(&device));
    let stream = Stream::with_allocator(&device, cache.clone())?;
    let pool = BufferPool::new(&stream);
    drop(pool.get_buffer_1d::<u8>(2 << 20)?); // held: 2 MiB + rounding
    let big = pool.get_buffer_1d::<u8>(3 << 20)?; // another bin: needs the held memory back
    assert_eq!(big.len(), 3 << 20);
    let stats = cache.stats();
    assert_eq!((stats.oom_retries, stats.held_blocks), (1, 0));
    drop(big);
    // With nothing to give back, out of memory is an error that leaves the pool as it was.
    let live = pool.get_buffer_1d::<u8>(2 << 20)?;
    let err = pool.get_buffer_1d::<u8>(2 << 20).unwrap_err();
    assert!(matches!(err, PoolError::OutOfMemory { .. }), "{err}");
    assert_eq!(cache.stats().active_blocks, 1);
    drop(live);
    Ok(())
}

#[test]
fn bad_settings_and_foreign_devices_are_errors() -> Result<(), PoolError> {
    let a = Device::private_host();
    let b = Device::private_host();
    let err = CachingPool::with_leading_bits(&a, 40).unwrap_err();
    assert!(err.to_string().contains("0 to 16"), "{err}");
    let cache = Arc::new(CachingPool::with_leading_bits(&a, 2)?);
    let stream = Stream::with_allocator(&b, cache)?;
    let err = BufferPool::new(&stream).get_buffer_1d::<u8>(8).unwrap_err();
    assert!(matches!(err, PoolError::DeviceMismatch { .. }), "{err}");
    Ok(())
}

#[test]
fn a_block_freed_on_one_stream_reaches_another_only_when_its_work_is_done() -> Result<(), PoolError>
{
    // On the host backend every operation is finished when it returns: the block moves at once.
    let device = Device::private_host();
    let cache = Arc::new(CachingPool::new(&device));
    let (a, b) = (
        Stream::with_allocator(&device, cache.clone())?,
        Stream::with_allocator(&device, cache.clone())?,
    );
    let x = BufferPool::new(&a).get_buffer_1d::<u8>(5000)?.device_ptr();
    assert_eq!(
        BufferPool::new(&b).get_buffer_1d::<u8>(5000)?.device_ptr(),
        x
    );
    gpu_cross_stream()
}

#[cfg(feature = "cuda")]
fn gpu_cross_stream() -> Result<(), PoolError> {
    let Some((gpu, _lock)) = crate::common::gpu("caching_cross_stream") else {
        return Ok(());
    };
    let k = crate::common::kernels::Kernels::load(&gpu);
    let cache = Arc::new(CachingPool::new(&gpu));
    let (a, b) = (
        Stream::with_allocator(&gpu, cache.clone())?,
        Stream::with_allocator(&gpu, cache.clone())?,
    );
    let n = 1 << 20;
    let src = gpu_pool::compat::opencv::GpuMat::<u8>::new(&a, 1, n)?;
    let x = BufferPool::new(&a).get_buffer_1d::<u8>(n)?;
    let address = x.device_ptr();
    // SAFETY: `src` and `x` hold n bytes each; `x` is what the test watches being reused.
    unsafe {
        let cuda = a.cudarc().expect("CUDA");
        crate::common::kernels::slow_copy(
            &k,
            cuda,
            (src.device_ptr(), x.device_ptr()),
            n,
            200_000_000,
        )
    }
    .map_err(|e| PoolError::Driver {
        call: "slow_copy",
        source: e.into(),
    })?;
    drop(x); // freed to the pool while a's kernel still writes it
    let busy = BufferPool::new(&b).get_buffer_1d::<u8>(n)?;
    assert_ne!(
        busy.device_ptr(),
        address,
        "not handed to b while a's work runs"
    );
    a.synchronize()?;
    let hits = cache.stats().hits;
    let done = BufferPool::new(&b).get_buffer_1d::<u8>(n)?;
    assert_eq!(
        done.device_ptr(),
        address,
        "once a's work is done, the block serves b"
    );
    assert_eq!(cache.stats().hits, hits + 1);
    println!(
        "caching_cross_stream on {}: refused while a ran, reused after: {:?}",
        gpu.id(),
        cache.stats()
    );
    drop((done, busy, src));
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn gpu_cross_stream() -> Result<(), PoolError> {
    Ok(())
}

#[test]
fn bin_of_is_total_from_zero_to_the_largest_size() {
    for bits in 0..=16 {
        // PyOpenCL's bin_number(0) == bin_number(1): a request of nothing shares the one-byte bin.
        assert_eq!(
            CachingPool::bin_of(0, bits),
            CachingPool::bin_of(1, bits),
            "{bits}"
        );
        assert_eq!(CachingPool::bin_of(1, bits), (1, 1), "{bits}");
        let mut bins = vec![CachingPool::bin_of(1, bits).0];
        for s in [
            usize::MAX / 2,
            usize::MAX / 2 + 1,
            usize::MAX - 128,
            usize::MAX - 127,
            usize::MAX - 1,
            usize::MAX,
        ] {
            let (bin, size) = CachingPool::bin_of(s, bits);
            assert!(size >= s, "{s} rounds up to {size} ({bits} bits)");
            assert_eq!(size.leading_zeros(), s.leading_zeros(), "no wrap: {s}");
            assert_eq!(CachingPool::bin_of(size, bits), (bin, size), "{s}: own bin");
            bins.push(bin);
        }
        assert!(
            bins.windows(2).all(|w| w[0] <= w[1]),
            "bins grow with sizes"
        );
        assert_eq!(CachingPool::bin_of(usize::MAX, bits).1, usize::MAX);
    }
}

#[test]
fn an_empty_buffer_on_a_caching_stream_asks_the_pool_for_nothing() -> Result<(), PoolError> {
    let device = Device::private_host();
    let cache = Arc::new(CachingPool::new(&device));
    let stream = Stream::with_allocator(&device, cache.clone())?;
    let pool = BufferPool::new(&stream);
    for (rows, cols) in [(0, 0), (0, 7), (7, 0)] {
        let empty = pool.get_buffer::<u8>(rows, cols)?;
        assert_eq!((empty.source(), empty.device_ptr()), (Source::Empty, 0));
    }
    assert_eq!(
        cache.stats(),
        Default::default(),
        "no hit, no miss, nothing active"
    );
    Ok(())
}

#[test]
fn active_bytes_are_counted_as_requested_and_as_rounded_and_peaks_reset() -> Result<(), PoolError> {
    let device = Device::private_host();
    let cache = Arc::new(CachingPool::new(&device));
    let stream = Stream::with_allocator(&device, cache.clone())?;
    let pool = BufferPool::new(&stream);
    let a = pool.get_buffer_1d::<u8>(1000)?; // asks the pool for 1024 bytes: a 1087-byte block
    let b = pool.get_buffer_1d::<u8>(5000)?; // 5056 bytes: the 5119-byte bin
    let stats = cache.stats();
    assert_eq!(stats.active_requested_bytes, 1024 + 5056);
    assert_eq!(stats.active_rounded_bytes, 1087 + 5119);
    drop(b);
    let stats = cache.stats();
    assert_eq!(
        (stats.active_requested_bytes, stats.active_rounded_bytes),
        (1024, 1087)
    );
    assert_eq!(
        (
            stats.peak_active_requested_bytes,
            stats.peak_active_rounded_bytes
        ),
        (1024 + 5056, 1087 + 5119)
    );
    let (hits, misses) = (stats.hits, stats.misses);

    cache.reset_peak();
    let stats = cache.stats();
    assert_eq!(
        stats.peak_active_requested_bytes,
        stats.active_requested_bytes
    );
    assert_eq!(stats.peak_active_rounded_bytes, stats.active_rounded_bytes);
    assert_eq!(
        (stats.hits, stats.misses),
        (hits, misses),
        "totals are kept"
    );
    assert_eq!(
        stats.held_bytes, 5119,
        "held blocks are not in use: no peak of theirs"
    );

    let c = pool.get_buffer_1d::<u8>(64)?; // the peak grows again from there; 64 -> the 67 bin
    let stats = cache.stats();
    assert_eq!(stats.peak_active_requested_bytes, 1024 + 64);
    assert_eq!(stats.peak_active_rounded_bytes, 1087 + 67);
    drop((c, a));
    cache.reset_peak();
    let stats = cache.stats();
    assert_eq!(
        (
            stats.peak_active_requested_bytes,
            stats.peak_active_rounded_bytes
        ),
        (0, 0)
    );
    Ok(())
}
