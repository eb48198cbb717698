//! What serves the buffers a stack does not: each built-in fallback, a failed fallback, and custom
//! allocators, well-behaved or broken.

use gpu_pool::GpuRead;
use gpu_pool::GpuWrite;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::common::each_device;
use gpu_pool::pooled;
use gpu_pool::{
    Device, FallbackReason, PoolError, Source, Stream, alloc::AllocContext, alloc::AllocRequest,
    alloc::Allocation, alloc::DriverAllocator, alloc::GpuAllocator, compat::opencv::BufferPool,
    compat::opencv::set_buffer_pool_config, config::Fallback,
};

use super::{MIB, private};

#[test]
fn each_fallback_kind_behaves_as_documented() -> Result<(), PoolError> {
    each_device("fallback_kinds", fallback_kinds)
}

fn fallback_kinds(device: &Device) -> Result<(), PoolError> {
    set_buffer_pool_config(device, MIB, 1)?;
    for fallback in [Fallback::Driver, Fallback::StreamOrdered, Fallback::Error] {
        device.set_fallback(fallback);
        let stream = Stream::new(device)?;
        let pool = BufferPool::new(&stream);
        let result = pool.get_buffer::<u8>(2048, 1024); // 2 MiB: larger than the stack
        match fallback {
            Fallback::Error => {
                let err = result.unwrap_err();
                assert!(
                    matches!(
                        err,
                        PoolError::StackExhausted {
                            reason: FallbackReason::TooLarge,
                            requested: 2097152,
                            available: 1048576,
                            ..
                        }
                    ),
                    "{err}"
                );
                assert!(err.to_string().contains("set_buffer_pool_config"));
            }
            _ => {
                let mut buf = result?;
                assert_eq!(buf.source(), Source::Fallback(FallbackReason::TooLarge));
                buf.set_to(9)?;
                assert_eq!(buf.to_vec()?[2048 * 1024 - 1], 9);
            }
        }
        assert_eq!(
            stream.stats().stack_in_use,
            0,
            "{fallback:?}: the stack is untouched"
        );
    }
    device.set_fallback(Fallback::Driver);
    Ok(())
}

#[test]
fn a_failed_fallback_leaves_the_pool_as_it_was() -> Result<(), PoolError> {
    let device = Device::host_with_limit(3 * MIB);
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(&device, 2 * MIB, 1)?;
    let stream = Stream::new(&device)?;
    let pool = BufferPool::new(&stream);
    let a = pool.get_buffer_1d::<u8>(MIB)?;
    let err = pool.get_buffer_1d::<u8>(2 * MIB).unwrap_err();
    assert!(
        matches!(err, PoolError::OutOfMemory { requested, .. } if requested == 2 * MIB),
        "{err}"
    );
    let b = pool.get_buffer_1d::<u8>(MIB)?;
    assert_eq!(b.source(), Source::Stack);
    assert_eq!(b.device_ptr() - a.device_ptr(), MIB as u64);
    drop((b, a));
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}

#[derive(Debug, Default)]
struct Counting {
    allocations: AtomicUsize,
    frees: AtomicUsize,
}

// SAFETY: delegates to the driver allocator, which returns fresh memory of the requested shape.
unsafe impl GpuAllocator for Counting {
    fn allocate(
        &self,
        ctx: &AllocContext<'_>,
        req: &AllocRequest,
    ) -> Result<Allocation, PoolError> {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        DriverAllocator.allocate(ctx, req)
    }
    unsafe fn deallocate(&self, ctx: &AllocContext<'_>, a: Allocation) -> Result<(), PoolError> {
        self.frees.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded; `a` came from `DriverAllocator::allocate` above.
        unsafe { DriverAllocator.deallocate(ctx, a) }
    }
}

#[test]
fn a_custom_allocator_serves_every_buffer_of_its_stream() -> Result<(), PoolError> {
    each_device("custom_allocator", custom_allocator)
}

fn custom_allocator(device: &Device) -> Result<(), PoolError> {
    let counting = Arc::new(Counting::default());
    let stream = Stream::with_allocator(device, counting.clone())?;
    let pool = BufferPool::new(&stream);
    let allocator = pool.allocator();
    assert!(format!("{allocator:?}").contains("Counting"));
    {
        let a = pool.get_buffer::<f32>(16, 16)?;
        let b = pool.get_buffer_1d::<f32>(16)?;
        assert_eq!(a.source(), Source::Fallback(FallbackReason::Disabled));
        assert!(a.step() >= 64, "the driver's pitch");
        assert_eq!(b.step(), 64);
    }
    assert_eq!(counting.allocations.load(Ordering::Relaxed), 2);
    assert_eq!(counting.frees.load(Ordering::Relaxed), 2);
    assert_eq!(stream.stack_index(), None);
    assert_eq!(
        stream.stats().driver_alloc_calls,
        2,
        "counted through AllocContext"
    );
    Ok(())
}

#[derive(Debug)]
struct Broken;

// SAFETY: returns a null allocation, which the pool must refuse before anything uses it.
unsafe impl GpuAllocator for Broken {
    fn allocate(&self, _: &AllocContext<'_>, _: &AllocRequest) -> Result<Allocation, PoolError> {
        Ok(Allocation::new(0, 0))
    }
    unsafe fn deallocate(&self, _: &AllocContext<'_>, _: Allocation) -> Result<(), PoolError> {
        Ok(())
    }
}

#[test]
fn a_broken_allocator_answer_is_an_error_not_a_buffer() -> Result<(), PoolError> {
    let stream = Stream::with_allocator(&private(Fallback::Driver), Arc::new(Broken))?;
    let err = BufferPool::new(&stream).get_buffer::<u8>(4, 4).unwrap_err();
    assert!(err.to_string().contains("non-null address"), "{err}");
    Ok(())
}

/// `buffer!` of `len` bytes with a 64-byte stack buffer live under it.
#[pooled(stream)]
fn huge_over_a_live_buffer(stream: &Stream, len: usize) -> Result<(), PoolError> {
    let _live = buffer!(64; u8)?;
    let _huge = buffer!(len; u8)?;
    Ok(())
}

#[test]
fn a_huge_request_over_a_live_stack_buffer_is_an_error_for_every_fallback() -> Result<(), PoolError>
{
    // 2^64 - 128 bytes: a multiple of 64, so the layout keeps it; what is in use plus it wraps.
    let huge = usize::MAX - 127;
    for fallback in [
        Fallback::Driver,
        Fallback::StreamOrdered,
        Fallback::Caching,
        Fallback::Error,
    ] {
        let device = private(fallback);
        set_buffer_pool_config(&device, MIB, 1)?;
        let stream = Stream::new(&device)?;
        let pool = BufferPool::new(&stream);
        let mut live = pool.get_buffer_1d::<u8>(4096)?;
        live.set_to(5)?;
        // From the runtime API (4096 bytes in use), and from `buffer!` (4096 + 64).
        for (err, in_use) in [
            (pool.get_buffer_1d::<u8>(huge).unwrap_err(), 4096),
            (
                huge_over_a_live_buffer(&stream, huge).unwrap_err(),
                4096 + 64,
            ),
        ] {
            let text = err.to_string();
            match (fallback, &err) {
                (
                    Fallback::Error,
                    PoolError::StackExhausted {
                        requested,
                        available,
                        reason: FallbackReason::TooLarge,
                        ..
                    },
                ) => {
                    assert_eq!((*requested, *available), (huge, MIB - in_use), "{text}");
                    // No stack size holds it: the message says so instead of naming one.
                    assert!(!text.contains("GPU_POOL_CONF=stack_size"), "{text}");
                    assert!(text.contains("no stack size can hold it"), "{text}");
                    assert!(text.contains(&format!("{huge} bytes requested")), "{text}");
                }
                (Fallback::Error, _) => panic!("{fallback:?}: {text}"),
                (_, PoolError::OutOfMemory { context, .. }) => {
                    let request = context.expect("a buffer asked");
                    assert_eq!(request.stack_needed, None, "{fallback:?}: it wraps: {text}");
                    assert!(!text.contains("GPU_POOL_CONF"), "{text}");
                    assert!(text.starts_with("out of memory"), "{text}");
                }
                _ => panic!("{fallback:?}: {text}"),
            }
        }
        assert_eq!(
            live.to_vec()?,
            vec![5; 4096],
            "{fallback:?}: the live buffer kept"
        );
        assert_eq!(stream.stats().stack_in_use, 4096, "{fallback:?}");
        drop(live);
        // With nothing live the figure does not wrap, but no config is that large: no advice.
        let err = pool.get_buffer_1d::<u8>(huge).unwrap_err();
        assert!(
            !err.to_string().contains("GPU_POOL_CONF=stack_size"),
            "{err}"
        );
        if let PoolError::OutOfMemory { context, .. } = err {
            assert_eq!(context.and_then(|r| r.stack_needed), Some(huge));
        }
        assert_eq!(stream.stats().stack_in_use, 0);
    }
    Ok(())
}
