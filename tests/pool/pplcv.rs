//! ppl.cv's memory pool API. The pool is process-wide, so every test that activates it holds
//! `common::ppl_pool_lock` (the fault-injection test of `faults.rs` too).

use gpu_pool::compat::pplcv::PplError;
use gpu_pool::compat::pplcv::*;
use gpu_pool::{Device, PoolError};

fn serial() -> std::sync::MutexGuard<'static, ()> {
    let guard = crate::common::ppl_pool_lock();
    let _ = shutdown_gpu_memory_pool();
    guard
}

#[test]
fn ceil_helpers_round_like_ppl_cv() {
    assert_eq!(ceil_1d_volume(1), 512);
    assert_eq!(ceil_1d_volume(512), 512);
    assert_eq!(ceil_1d_volume(513), 1024);
    assert_eq!(ceil_2d_volume(1920 * 4, 1080), 7680 * 1080);
    assert_eq!(ceil_2d_volume(100, 3), 512 * 3);
    assert_eq!(ceil_1d_volume(usize::MAX), usize::MAX, "saturates");
    assert_eq!(ceil_2d_volume(usize::MAX / 2, 3), usize::MAX, "saturates");
}

#[test]
fn blocks_take_the_first_gap_that_holds_them() -> Result<(), PoolError> {
    let _g = serial();
    activate_gpu_memory_pool_on(&Device::private_host(), 8 * 512)?;
    let (mut a, mut b, mut c) = Default::default();
    ppl_cuda_malloc(100, &mut a)?;
    ppl_cuda_malloc_pitch(700, 2, &mut b)?; // pitch 1024: 2048 bytes
    ppl_cuda_malloc(512, &mut c)?;
    assert_eq!((a.offset(), b.offset(), c.offset()), (0, 512, 2560));
    assert_eq!((b.pitch(), b.size(), a.pitch()), (1024, 2048, 0));
    ppl_cuda_free(&mut b)?;
    let mut d = GpuMemoryBlock::default();
    ppl_cuda_malloc(1000, &mut d)?;
    assert_eq!(d.offset(), 512, "the freed gap is reused first");
    let mut e = GpuMemoryBlock::default();
    ppl_cuda_malloc(1000, &mut e)?;
    assert_eq!(e.offset(), 1536, "the rest of the gap");
    assert_eq!(memory_pool_in_use(), Some(100 + 512 + 1000 + 1000));
    drop((a, c, d, e)); // blocks free themselves
    assert_eq!(memory_pool_in_use(), Some(0));
    shutdown_gpu_memory_pool()
}

#[test]
fn a_pool_too_small_is_an_error_that_changes_nothing() -> Result<(), PoolError> {
    let _g = serial();
    activate_gpu_memory_pool_on(&Device::private_host(), ceil_2d_volume(640, 480))?;
    let mut a = GpuMemoryBlock::default();
    ppl_cuda_malloc_pitch(640, 480, &mut a)?;
    let mut b = GpuMemoryBlock::default();
    let err = ppl_cuda_malloc(1, &mut b).unwrap_err();
    assert!(
        matches!(err, PoolError::OutOfMemory { requested: 1, .. }),
        "{err}"
    );
    assert!(!b.is_allocated());
    let err = ppl_cuda_malloc_pitch(usize::MAX, 2, &mut b).unwrap_err();
    assert!(matches!(err, PoolError::SizeOverflow { .. }), "{err}");
    drop(a);
    shutdown_gpu_memory_pool()
}

#[test]
fn misuse_is_refused_where_ppl_cv_only_logs() -> Result<(), PoolError> {
    let _g = serial();
    let mut block = GpuMemoryBlock::default();
    assert!(!memory_pool_used());
    assert!(
        ppl_cuda_malloc(8, &mut block)
            .unwrap_err()
            .to_string()
            .contains("not activated")
    );
    assert!(shutdown_gpu_memory_pool().is_err());
    assert!(activate_gpu_memory_pool_on(&Device::private_host(), 0).is_err());

    let device = Device::private_host();
    activate_gpu_memory_pool_on(&device, 4096)?;
    assert!(memory_pool_used());
    let again = activate_gpu_memory_pool_on(&device, 4096).unwrap_err();
    assert!(again.to_string().contains("already activated"), "{again}");
    ppl_cuda_malloc(8, &mut block)?;
    assert!(
        ppl_cuda_malloc(8, &mut block)
            .unwrap_err()
            .to_string()
            .contains("already holds")
    );
    let live = shutdown_gpu_memory_pool().unwrap_err();
    assert!(
        matches!(live, PoolError::Ppl(PplError::InUse { live: 1, .. })),
        "{live}"
    );
    ppl_cuda_free(&mut block)?;
    assert!(
        ppl_cuda_free(&mut block).is_err(),
        "a double free is refused"
    );
    shutdown_gpu_memory_pool()?;

    // A block of an earlier activation cannot free into a later one.
    activate_gpu_memory_pool_on(&device, 4096)?;
    ppl_cuda_malloc(8, &mut block)?;
    let mut stale = GpuMemoryBlock::default();
    std::mem::swap(&mut stale, &mut block);
    ppl_cuda_free(&mut stale)?;
    shutdown_gpu_memory_pool()?;
    activate_gpu_memory_pool_on(&device, 4096)?;
    let frees = device.stats().driver_free_calls;
    shutdown_gpu_memory_pool()?;
    assert_eq!(
        device.stats().driver_free_calls,
        frees + 1,
        "one driver free for the pool"
    );
    Ok(())
}

#[test]
fn shutting_down_under_live_blocks_is_an_error_of_the_ppl_cv_pool() -> Result<(), PoolError> {
    let _g = serial();
    let device = Device::private_host();
    activate_gpu_memory_pool_on(&device, 4096)?;
    let (mut a, mut b) = Default::default();
    ppl_cuda_malloc(8, &mut a)?;
    ppl_cuda_malloc(0, &mut b)?;
    let err = shutdown_gpu_memory_pool().unwrap_err();
    assert_eq!(
        err,
        PoolError::Ppl(PplError::InUse {
            device: device.id(),
            live: 2
        })
    );
    // It speaks of the ppl.cv pool and its blocks, not of the stack pool and streams.
    let text = err.to_string();
    assert!(
        text.contains("ppl.cv memory pool") && text.contains("ppl_cuda_free"),
        "{text}"
    );
    assert!(
        !text.contains("stream") && !text.contains("stack"),
        "{text}"
    );
    assert!(memory_pool_used(), "nothing changed");
    ppl_cuda_free(&mut a)?;
    drop(b);
    shutdown_gpu_memory_pool()
}

#[test]
fn on_the_gpu_the_pool_is_one_driver_allocation() -> Result<(), PoolError> {
    let _g = serial();
    let Some((gpu, _lock)) = crate::common::gpu("pplcv") else {
        return Ok(());
    };
    let before = gpu.stats();
    activate_gpu_memory_pool_on(&gpu, ceil_2d_volume(1920 * 4, 1080))?;
    for _ in 0..1000 {
        let mut block = GpuMemoryBlock::default();
        ppl_cuda_malloc_pitch(1920 * 4, 1080, &mut block)?;
        assert_eq!(block.pitch(), 7680);
        ppl_cuda_free(&mut block)?;
    }
    shutdown_gpu_memory_pool()?;
    let after = gpu.stats();
    assert_eq!(after.driver_alloc_calls - before.driver_alloc_calls, 1);
    assert_eq!(after.driver_free_calls - before.driver_free_calls, 1);
    println!(
        "pplcv: 1000 blocks from one driver allocation on {}",
        gpu.id()
    );
    Ok(())
}

#[test]
fn a_zero_byte_block_never_touches_another_blocks_record() -> Result<(), PoolError> {
    let _g = serial();
    activate_gpu_memory_pool_on(&Device::private_host(), 4 * 512)?;
    let mut a = GpuMemoryBlock::default();
    ppl_cuda_malloc(100, &mut a)?;
    let (mut zero, mut zero_2d) = (GpuMemoryBlock::default(), GpuMemoryBlock::default());
    ppl_cuda_malloc(0, &mut zero)?;
    ppl_cuda_malloc_pitch(0, 7, &mut zero_2d)?;
    assert!(zero.is_allocated() && zero_2d.is_allocated());
    assert_eq!((zero.size(), zero_2d.size()), (0, 0));
    assert!(zero.host_bytes_mut()?.is_empty(), "no bytes to alias");

    // The next block may not land on `a`: its record is intact.
    let mut b = GpuMemoryBlock::default();
    ppl_cuda_malloc(100, &mut b)?;
    assert_eq!((a.offset(), b.offset()), (0, 512));
    a.host_bytes_mut()?.fill(0xaa);
    b.host_bytes_mut()?.fill(0xbb);
    assert!(a.host_bytes_mut()?.iter().all(|&x| x == 0xaa));

    // Freeing the zero-byte blocks frees them, not `a`.
    ppl_cuda_free(&mut zero)?;
    drop(zero_2d);
    assert_eq!(memory_pool_in_use(), Some(200));
    drop(b);
    let live = shutdown_gpu_memory_pool().unwrap_err();
    assert!(
        matches!(live, PoolError::Ppl(PplError::InUse { live: 1, .. })),
        "`a` is still live: {live}"
    );
    ppl_cuda_free(&mut a)?;

    // A live zero-byte block keeps the pool from shutting down, like any block.
    let mut zero = GpuMemoryBlock::default();
    ppl_cuda_malloc(0, &mut zero)?;
    assert!(matches!(
        shutdown_gpu_memory_pool(),
        Err(PoolError::Ppl(PplError::InUse { live: 1, .. }))
    ));
    drop(zero);
    shutdown_gpu_memory_pool()
}

#[test]
fn a_block_from_another_activation_is_refused_and_keeps_its_bytes_apart() -> Result<(), PoolError> {
    let _g = serial();
    let device = Device::private_host();
    activate_gpu_memory_pool_on(&device, 4096)?;
    let mut old = GpuMemoryBlock::default();
    ppl_cuda_malloc(64, &mut old)?;
    let mut same_place = GpuMemoryBlock::default();
    std::mem::swap(&mut same_place, &mut old); // moving a block moves its identity, nothing else
    assert!(!old.is_allocated() && same_place.is_allocated());
    assert_eq!((old.data(), old.device_ptr()), (0, 0));
    ppl_cuda_free(&mut same_place)?;
    assert!(ppl_cuda_free(&mut same_place).is_err());
    shutdown_gpu_memory_pool()
}
