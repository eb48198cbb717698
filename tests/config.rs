//! Configuration, fallbacks, errors and statistics: on private host devices, and on the GPU where
//! there is one (`each_device`). None changes the process-wide usage flag (`tests/usage.rs` does).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::each_device;
use gpu_pool::{
    AllocContext, AllocRequest, Allocation, BufferPool, Device, DriverAllocator, Fallback,
    FallbackReason, GpuAllocator, GpuMat, PoolConfig, PoolError, Source, Stream,
    set_buffer_pool_config,
};

const MIB: usize = 1 << 20;

fn private(fallback: Fallback) -> Device {
    let device = Device::host_with_limit(None);
    device.set_fallback(fallback);
    device
}

#[test]
fn invalid_configs_are_refused_with_advice() {
    let device = private(Fallback::Driver);
    for (size, count, hint) in [
        (0, 2, "stack_size is 0"),
        (MIB, 0, "set_buffer_pool_usage(false)"),
        (usize::MAX, 1, "overflow"),
        (usize::MAX / 2, 3, "overflow"),
    ] {
        let err = set_buffer_pool_config(&device, size, count).unwrap_err();
        assert!(matches!(err, PoolError::InvalidConfig { .. }), "{err}");
        assert!(err.to_string().contains(hint), "{err}");
    }
    assert_eq!(
        device.pool_config().unwrap(),
        PoolConfig::default(),
        "nothing changed"
    );
}

#[test]
fn stack_sizes_round_up_to_the_stack_alignment() -> Result<(), PoolError> {
    assert_eq!(PoolConfig::new(1, 1)?.stack_size(), PoolConfig::STACK_ALIGN);
    assert_eq!(PoolConfig::new(10_000_000, 1)?.stack_size(), 10_002_432);
    assert_eq!(PoolConfig::new(64 * MIB, 3)?.stack_size(), 64 * MIB);
    Ok(())
}

#[test]
fn reconfiguring_while_a_stack_is_held_changes_nothing() -> Result<(), PoolError> {
    each_device("reconfigure", reconfigure)
}

fn reconfigure(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, 4 * MIB, 2)?;
    let stream = Stream::new(device)?;
    let buf = BufferPool::new(&stream).get_buffer_1d::<u8>(1000)?;
    let err = set_buffer_pool_config(device, 8 * MIB, 1).unwrap_err();
    assert_eq!(
        err,
        PoolError::ConfigInUse {
            device: device.id(),
            held: 1
        }
    );
    assert_eq!(device.pool_config()?.stack_size(), 4 * MIB);
    drop(buf);
    drop(stream);

    // With no stack held, the old memory is freed and the new config used at the next stream.
    let frees = device.stats().driver_free_calls;
    set_buffer_pool_config(device, 8 * MIB, 1)?;
    assert_eq!(device.stats().driver_free_calls, frees + 1);
    assert!(!device.stats().stacks_allocated);
    let stream = Stream::new(device)?;
    let big = BufferPool::new(&stream).get_buffer_1d::<u8>(8 * MIB)?;
    assert_eq!(big.source(), Source::Stack);
    Ok(())
}

#[test]
fn stack_memory_is_one_allocation_made_at_first_need() -> Result<(), PoolError> {
    each_device("one_allocation", one_allocation)
}

fn one_allocation(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, 2 * MIB, 4)?;
    let calls = device.stats().driver_alloc_calls;
    let streams: Vec<Stream> = (0..4)
        .map(|_| Stream::new(device))
        .collect::<Result<_, _>>()?;
    let stats = device.stats();
    assert_eq!(
        (stats.driver_alloc_calls - calls, stats.stacks_held),
        (1, 4)
    );
    let bases: Vec<u64> = streams
        .iter()
        .map(|s| {
            BufferPool::new(s)
                .get_buffer_1d::<u8>(1)
                .map(|b| b.device_ptr())
        })
        .collect::<Result<_, _>>()?;
    for pair in bases.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            2 * MIB as u64,
            "stacks are adjacent slices"
        );
    }
    Ok(())
}

#[test]
fn a_dropped_stream_gives_its_stack_to_a_stackless_stream() -> Result<(), PoolError> {
    each_device("stack_handover", stack_handover)
}

fn stack_handover(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, MIB, 1)?;
    let first = Stream::new(device)?;
    let second = Stream::new(device)?;
    let b = BufferPool::new(&second).get_buffer_1d::<u8>(10)?;
    assert_eq!(b.source(), Source::Fallback(FallbackReason::NoStack));
    drop(b);
    drop(first);
    let b = BufferPool::new(&second).get_buffer_1d::<u8>(10)?;
    assert_eq!(b.source(), Source::Stack);
    assert_eq!(second.stack_index(), Some(0));
    Ok(())
}

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
    let device = Device::host_with_limit(Some(3 * MIB));
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

#[test]
fn the_stack_memory_itself_can_be_out_of_memory() {
    let device = Device::host_with_limit(Some(MIB));
    set_buffer_pool_config(&device, 2 * MIB, 1).unwrap();
    let err = Stream::new(&device).unwrap_err();
    assert!(matches!(err, PoolError::OutOfMemory { .. }), "{err}");
    assert_eq!(device.stats().stacks_held, 0);
}

#[test]
fn bad_sizes_are_errors_and_zero_sizes_are_empty() -> Result<(), PoolError> {
    each_device("bad_sizes", bad_sizes)
}

fn bad_sizes(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    let stream = Stream::new(device)?;
    let pool = BufferPool::new(&stream);
    for (rows, cols) in [(usize::MAX, 2), (2, usize::MAX), (1 << 40, 1 << 40)] {
        let err = pool.get_buffer::<u32>(rows, cols).unwrap_err();
        assert!(matches!(err, PoolError::SizeOverflow { .. }), "{err}");
    }
    for (rows, cols) in [(0, 0), (0, 5), (5, 0)] {
        let empty = pool.get_buffer::<u32>(rows, cols)?;
        assert_eq!((empty.source(), empty.len()), (Source::Empty, 0));
        assert_eq!(empty.to_vec()?, Vec::<u32>::new());
    }
    let zst = pool.get_buffer::<()>(10, 10)?;
    assert_eq!(zst.source(), Source::Empty);
    let stats = stream.stats();
    assert_eq!((stats.stack_in_use, stats.stack_allocations), (0, 0));

    let mut buf = pool.get_buffer::<u32>(4, 4)?;
    let err = buf.upload(&[1, 2, 3]).unwrap_err();
    assert_eq!(
        err,
        PoolError::ShapeMismatch {
            expected: 16,
            actual: 3
        }
    );
    let other = Stream::new(&private(Fallback::Driver))?;
    let foreign = BufferPool::new(&other).get_buffer::<u32>(4, 4)?;
    assert!(matches!(
        buf.copy_from(&foreign),
        Err(PoolError::DeviceMismatch { .. })
    ));
    Ok(())
}

#[test]
fn long_lived_buffers_come_from_the_driver_not_the_stack() -> Result<(), PoolError> {
    each_device("long_lived", long_lived)
}

fn long_lived(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Error);
    let stream = Stream::new(device)?;
    let input = GpuMat::from_host(&stream, 2, 3, &[1u16, 2, 3, 4, 5, 6])?;
    assert_eq!(input.source(), Source::Driver);
    assert_eq!(input.to_vec()?, [1, 2, 3, 4, 5, 6]);
    assert_eq!(stream.stats().stack_in_use, 0);
    let calls = device.stats();
    drop(input);
    assert_eq!(
        device.stats().driver_free_calls,
        calls.driver_free_calls + 1
    );
    device.set_fallback(Fallback::Driver);
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
        Ok(Allocation { ptr: 0, pitch: 0 })
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

#[test]
fn stats_and_report_recommend_a_config_that_avoids_every_fallback() -> Result<(), PoolError> {
    let device = private(Fallback::Driver);
    set_buffer_pool_config(&device, MIB, 1)?;
    let s1 = Stream::new(&device)?;
    let s2 = Stream::new(&device)?;
    {
        let p1 = BufferPool::new(&s1);
        let _a = p1.get_buffer_1d::<u8>(MIB / 2)?;
        let _b = p1.get_buffer_1d::<u8>(MIB)?; // stack full
        let _c = p1.get_buffer_1d::<u8>(3 * MIB)?; // larger than a stack
        let _d = BufferPool::new(&s2).get_buffer_1d::<u8>(10)?; // no stack
    }
    let stats = device.stats();
    let fb = stats.fallback_allocations;
    assert_eq!(
        (
            fb.get(FallbackReason::StackFull),
            fb.get(FallbackReason::TooLarge),
            fb.get(FallbackReason::NoStack)
        ),
        (1, 1, 1)
    );
    assert_eq!(stats.stack_allocations, 1);
    assert_eq!(stats.peak_stream_demand, MIB / 2 + MIB + 3 * MIB);
    let rec = stats.recommended_config().expect("buffers were requested");
    assert_eq!((rec.stack_size(), rec.stack_count()), (5 * MIB, 2));
    let text = gpu_pool::Report {
        devices: vec![stats],
    }
    .to_string();
    assert!(text.contains("stack_size=5MiB,stack_count=2"), "{text}");

    // The recommended config serves the same workload with no fallback.
    drop((s1, s2));
    set_buffer_pool_config(&device, rec.stack_size(), rec.stack_count())?;
    let before = device.stats().fallback_allocations.total();
    let s1 = Stream::new(&device)?;
    let s2 = Stream::new(&device)?;
    let p1 = BufferPool::new(&s1);
    let _a = p1.get_buffer_1d::<u8>(MIB / 2)?;
    let _b = p1.get_buffer_1d::<u8>(MIB)?;
    let _c = p1.get_buffer_1d::<u8>(3 * MIB)?;
    let _d = BufferPool::new(&s2).get_buffer_1d::<u8>(10)?;
    assert_eq!(device.stats().fallback_allocations.total(), before);
    Ok(())
}

#[test]
fn stream_is_send_and_moves_to_another_thread() -> Result<(), PoolError> {
    let device = private(Fallback::Driver);
    let stream = Stream::new(&device)?;
    let used = std::thread::spawn(move || -> Result<usize, PoolError> {
        let buf = BufferPool::new(&stream).get_buffer::<u8>(64, 64)?;
        Ok(buf.step())
    })
    .join()
    .expect("no panic")?;
    assert_eq!(used, 512);
    assert_eq!(
        device.stats().stacks_held,
        0,
        "the dropped stream returned its stack"
    );
    Ok(())
}
