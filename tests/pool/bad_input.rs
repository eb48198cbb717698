//! Rows of RELIABILITY.md's bad-input matrix that no other test covers: each gets its typed error
//! and leaves everything as it was.

use gpu_pool::GpuRead;
use gpu_pool::GpuWrite;
use gpu_pool::{Device, PoolError, Stream, compat::mix::MixMemory, compat::opencv::BufferPool};

#[test]
fn typed_access_to_memory_not_aligned_for_the_type_is_an_error() -> Result<(), PoolError> {
    let device = Device::private_host();
    let mut host = [0u8; 64];
    let mut mix = MixMemory::wrap_cpu(&device, &mut host[1..])?; // odd address
    let err = mix.cpu::<u32>(4).unwrap_err();
    assert!(
        matches!(err, PoolError::Misaligned { align: 4, .. }),
        "{err}"
    );
    assert_eq!(mix.cpu::<u8>(4)?.len(), 4, "the pair still works for bytes");

    let stream = Stream::new(&device)?;
    let owner = BufferPool::new(&stream).get_buffer_1d::<u8>(64)?;
    // SAFETY: 63 bytes of `owner`, which outlives `mix` and nothing else uses.
    unsafe { mix.wrap_gpu(owner.device_ptr() + 1, 63)? };
    let err = mix.gpu_view::<u32>(4).unwrap_err();
    assert!(err.to_string().contains("not aligned"), "{err}");
    assert_eq!(mix.gpu_view::<u8>(4)?.cols(), 4);
    Ok(())
}

#[test]
fn record_stream_with_a_stream_of_another_device_is_an_error() -> Result<(), PoolError> {
    let (a, b) = (Device::private_host(), Device::private_host());
    let (sa, sb) = (Stream::new(&a)?, Stream::new(&b)?);
    let buf = BufferPool::new(&sa).get_buffer::<f32>(8, 8)?;
    assert!(matches!(
        buf.record_stream(&sb),
        Err(PoolError::DeviceMismatch { .. })
    ));
    Ok(())
}

#[test]
fn releasing_stack_memory_while_a_stream_holds_a_stack_is_refused() -> Result<(), PoolError> {
    let device = Device::private_host();
    let stream = Stream::new(&device)?;
    let buf = BufferPool::new(&stream).get_buffer::<u8>(16, 16)?;
    let err = device.release_stack_memory().unwrap_err();
    assert!(
        matches!(err, PoolError::ConfigInUse { held: 1, .. }),
        "{err}"
    );
    assert_eq!(buf.to_vec()?.len(), 256, "the live buffer is untouched");
    drop(buf);
    drop(stream);
    assert_eq!(device.release_stack_memory()?, 50 << 20);
    assert_eq!(device.release_stack_memory()?, 0, "nothing left to free");
    assert_eq!(gpu_pool::testing::host_live_bytes(&device), Some(0));
    Ok(())
}

/// An element type aligned above what device memory guarantees (here 4096 bytes).
#[derive(Clone, Copy, Debug, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(4096))]
struct Page([u8; 4096]);

/// The most strictly aligned element type a buffer takes.
#[derive(Clone, Copy, Debug, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(256))]
struct Line([u8; 256]);

#[test]
fn element_types_aligned_above_256_bytes_are_refused_everywhere() -> Result<(), PoolError> {
    let device = Device::private_host();
    let stream = Stream::new(&device)?;
    let pool = BufferPool::new(&stream);
    let refused = |e: PoolError| {
        assert!(
            matches!(
                e,
                PoolError::UnsupportedAlignment {
                    align: 4096,
                    max: 256,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("at most 256 bytes"), "{e}");
    };
    refused(pool.get_buffer::<Page>(3, 3).unwrap_err());
    refused(pool.get_buffer_1d::<Page>(5).unwrap_err());
    refused(pool.get_buffer::<Page>(0, 0).unwrap_err()); // even with nothing to allocate
    refused(gpu_pool::compat::opencv::GpuMat::<Page>::new(&stream, 2, 2).unwrap_err());
    let stats = stream.stats();
    assert_eq!((stats.stack_allocations, stats.stack_in_use), (0, 0));
    assert_eq!(stats.fallback_allocations.total(), 0);
    assert_eq!(gpu_pool::config::MAX_ELEMENT_ALIGN, 256);
    Ok(())
}

#[test]
fn rows_of_the_most_aligned_element_type_are_aligned() -> Result<(), PoolError> {
    let device = Device::host_with_limit(64 << 20);
    device.set_fallback(gpu_pool::config::Fallback::Driver);
    gpu_pool::compat::opencv::set_buffer_pool_config(&device, 64 << 10, 1)?;
    let stream = Stream::new(&device)?;
    let pool = BufferPool::new(&stream);
    // From the stack after a 1-byte block, from the fallback (too large), and from the driver.
    let _skew = pool.get_buffer_1d::<u8>(1)?;
    let mut mats = vec![
        pool.get_buffer::<Line>(3, 5)?,
        pool.get_buffer::<Line>(7, 1)?,
        pool.get_buffer::<Line>(300, 3)?,
        gpu_pool::compat::opencv::GpuMat::<Line>::new(&stream, 3, 3)?,
    ];
    for mat in &mut mats {
        mat.for_each_host_row_mut(|_, row| row.fill(Line([7; 256])))?;
        for row in mat.host_rows()? {
            assert_eq!(row.as_ptr() as usize % 256, 0, "{mat:?}");
            assert!(row.iter().all(|l| l.0[255] == 7));
        }
    }
    Ok(())
}

/// An allocator that answers with memory off by one byte: a buggy allocator, not UB.
#[derive(Debug, Default)]
struct Skewed(std::sync::atomic::AtomicUsize);

// SAFETY: the skewed address is refused by the pool before any buffer uses it, which the test
// checks; `deallocate` gives the driver its own address back.
unsafe impl gpu_pool::alloc::GpuAllocator for Skewed {
    fn allocate(
        &self,
        ctx: &gpu_pool::alloc::AllocContext<'_>,
        req: &gpu_pool::alloc::AllocRequest,
    ) -> Result<gpu_pool::alloc::Allocation, PoolError> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(gpu_pool::alloc::Allocation::new(
            ctx.alloc(req.bytes + 8)? + 4,
            req.pitch,
        ))
    }
    unsafe fn deallocate(
        &self,
        ctx: &gpu_pool::alloc::AllocContext<'_>,
        a: gpu_pool::alloc::Allocation,
    ) -> Result<(), PoolError> {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: `a.ptr - 4` is what `ctx.alloc` returned in `allocate`; freed once.
        unsafe { ctx.free(a.ptr - 4) }
    }
}

#[test]
fn an_allocator_answer_misaligned_for_the_type_is_refused_and_freed() -> Result<(), PoolError> {
    let device = Device::private_host();
    let skewed = std::sync::Arc::new(Skewed::default());
    let stream = Stream::with_allocator(&device, skewed.clone())?;
    let pool = BufferPool::new(&stream);
    let err = pool.get_buffer_1d::<u64>(10).unwrap_err();
    assert!(
        err.to_string().contains("multiples of the alignment"),
        "{err}"
    );
    assert_eq!(
        skewed.0.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "given back"
    );
    assert_eq!(gpu_pool::testing::host_live_bytes(&device), Some(0));
    // Bytes need no alignment: the same allocator serves them.
    assert_eq!(pool.get_buffer_1d::<u8>(10)?.len(), 10);
    Ok(())
}

#[test]
fn zero_sized_elements_with_huge_shapes_never_overflow() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let pool = BufferPool::new(&stream);
    for (rows, cols) in [(usize::MAX, 2), (2, usize::MAX), (1 << 33, 1 << 33)] {
        let err = pool.get_buffer::<()>(rows, cols).unwrap_err();
        assert!(matches!(err, PoolError::SizeOverflow { .. }), "{err}");
        let err = gpu_pool::compat::opencv::GpuMat::<()>::new(&stream, rows, cols).unwrap_err();
        assert!(matches!(err, PoolError::SizeOverflow { .. }), "{err}");
    }
    let mut huge = pool.get_buffer::<()>(usize::MAX, 1)?;
    assert_eq!((huge.len(), huge.is_empty()), (usize::MAX, false));
    huge.set_to(())?;
    let all = vec![(); usize::MAX];
    huge.upload(&all)?;
    let mut back = vec![(); usize::MAX];
    huge.download(&mut back)?;
    assert_eq!(huge.to_vec()?.len(), usize::MAX);
    assert_eq!(stream.stats().stack_in_use, 0, "no memory for no bytes");
    Ok(())
}

#[test]
fn a_copy_between_different_shapes_names_both() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let pool = BufferPool::new(&stream);
    let src = pool.get_buffer::<f32>(3, 2)?;
    let mut dst = pool.get_buffer::<f32>(2, 3)?; // the same 6 elements
    let err = dst.copy_from(&src).unwrap_err();
    assert_eq!(
        err,
        PoolError::DimensionMismatch {
            dst: (2, 3),
            src: (3, 2)
        }
    );
    assert!(
        err.to_string().contains("2x3") && err.to_string().contains("3x2"),
        "{err}"
    );
    Ok(())
}

#[test]
fn devices_never_share_an_identity() {
    let mut seen = std::collections::HashSet::new();
    for i in 0..1000 {
        let device = if i % 2 == 0 {
            Device::private_host()
        } else {
            gpu_pool::testing::host_with_fault(0)
        };
        assert!(seen.insert(device.id()), "{} given twice", device.id());
    }
}

#[test]
fn a_caching_pool_serves_only_its_own_device() -> Result<(), PoolError> {
    let (a, b) = (Device::private_host(), Device::private_host());
    let cache = std::sync::Arc::new(gpu_pool::alloc::CachingPool::new(&a));
    let on_b = Stream::with_allocator(&b, cache.clone())?;
    let err = BufferPool::new(&on_b).get_buffer_1d::<u8>(64).unwrap_err();
    assert!(matches!(err, PoolError::DeviceMismatch { .. }), "{err}");
    assert_eq!(gpu_pool::testing::host_live_bytes(&b), Some(0));
    Ok(())
}

/// The host backend has no cudarc stream or context: asking for one is `PoolError::Unsupported`
/// saying what to do instead (it was a bare `None`).
#[cfg(feature = "cuda")]
#[test]
fn cudarc_on_the_host_is_unsupported_and_says_what_to_do() -> Result<(), PoolError> {
    let device = Device::host();
    let stream = Stream::new(&device)?;
    let stream_err = stream.cudarc().expect_err("the host has no cudarc stream");
    let device_err = device.cudarc().expect_err("the host has no cudarc context");
    for (err, advice) in [(stream_err, "Device::cuda(n)"), (device_err, "CPU twins")] {
        assert!(matches!(err, PoolError::Unsupported { .. }), "{err}");
        assert!(err.to_string().contains(advice), "{err}");
    }
    Ok(())
}
