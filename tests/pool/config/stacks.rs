//! Stack configuration: sizes, counts, the one allocation that holds every stack, handing stacks
//! over between streams, and reconfiguring.

use crate::common::each_device;
use gpu_pool::GpuRead;
use gpu_pool::{
    Device, FallbackReason, PoolError, Source, Stream, compat::opencv::BufferPool,
    compat::opencv::set_buffer_pool_config, config::Fallback, config::Packing, config::PoolConfig,
};

use super::{MIB, private};

type TestResult = Result<(), PoolError>;

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

/// OpenCV makes the stream when the stacks' memory cannot be had, and serves it from the default
/// allocator: so does gpu-pool, and says why each buffer fell back.
#[test]
fn a_stream_is_made_without_memory_for_the_stacks_and_a_later_one_gets_a_stack() -> TestResult {
    let device = Device::host_with_limit(MIB);
    set_buffer_pool_config(&device, 2 * MIB, 1)?;
    let starved = Stream::new(&device)?;
    assert_eq!(starved.stack_index(), None);
    assert_eq!(device.stats().stacks_held, 0);
    let b = BufferPool::new(&starved).get_buffer_1d::<u8>(1000)?;
    assert_eq!(b.source(), Source::Fallback(FallbackReason::NoStackMemory));
    let again = BufferPool::new(&starved).get_buffer_1d::<u8>(10)?;
    assert_eq!(
        again.source(),
        Source::Fallback(FallbackReason::NoStackMemory)
    );
    let stats = starved.stats();
    assert_eq!(
        stats
            .fallback_allocations
            .get(FallbackReason::NoStackMemory),
        2
    );
    assert_eq!(
        stats.driver_alloc_calls, 2,
        "no retry of the stacks' memory per take"
    );
    assert!(
        stats
            .fallback_sites
            .iter()
            .any(|s| s.reason == FallbackReason::NoStackMemory),
        "the report names the site"
    );
    drop((b, again));

    // Once the stacks fit, the next stream gets one.
    set_buffer_pool_config(&device, MIB / 2, 1)?;
    let later = Stream::new(&device)?;
    assert_eq!(later.stack_index(), Some(0));
    let s = BufferPool::new(&later).get_buffer_1d::<u8>(1000)?;
    assert_eq!(s.source(), Source::Stack);
    Ok(())
}

/// An element type aligned to 256 bytes, the most a buffer takes.
#[derive(Clone, Copy, Debug, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(256))]
struct Line([u8; 256]);

#[test]
fn every_block_starts_on_256_bytes_by_default_as_cuda_malloc_aligns() -> Result<(), PoolError> {
    each_device("cuda_packing", cuda_packing)
}

/// RMM's random-size test on a stack: blocks of random sizes, rows, columns and 2D, each must
/// start on 256 bytes (OpenCV's packing put a 1D block on 64).
fn cuda_packing(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, 4 * MIB, 1)?;
    assert_eq!(device.packing()?, Packing::Cuda, "the default");
    let stream = Stream::new(device)?;
    let pool = BufferPool::new(&stream);
    let base = stream.stack_range().expect("a stack").start;
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |n: u64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (seed >> 33) % n + 1
    };
    let mut live = Vec::new();
    for i in 0..200 {
        let len = next(3000) as usize;
        let buffer = match i % 3 {
            0 => pool.get_buffer_1d::<u8>(len)?,
            1 => pool.get_buffer::<u8>(len, 1)?,
            _ => pool.get_buffer::<u8>(next(8) as usize, len)?,
        };
        assert_eq!(buffer.source(), Source::Stack);
        assert_eq!(
            (buffer.device_ptr() - base) % 256,
            0,
            "block {i} of {len} bytes"
        );
        assert_eq!(buffer.device_ptr() % 256, 0);
        live.push(buffer);
        if next(3) == 1 {
            drop(live.pop());
        }
    }
    live.into_iter().rev().for_each(drop);
    assert_eq!(stream.stats().lifo_violations, 0);

    // Ten 64-byte rows take ten 256-byte slots, less the last one's padding.
    let ten: Vec<_> = (0..10)
        .map(|_| pool.get_buffer_1d::<u8>(64))
        .collect::<Result<_, _>>()?;
    let offsets: Vec<u64> = ten.iter().map(|b| b.device_ptr() - base).collect();
    assert_eq!(offsets, (0..10).map(|i| i * 256).collect::<Vec<u64>>());
    assert_eq!(stream.stats().stack_in_use, 9 * 256 + 64);
    ten.into_iter().rev().for_each(drop);
    Ok(())
}

#[test]
fn with_opencv_packing_contiguous_buffers_pack_on_64_and_2d_buffers_stay_texture_aligned()
-> Result<(), PoolError> {
    each_device("packing", packing)
}

fn packing(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, MIB, 1)?;
    let align = device.texture_alignment();
    let stream = stream_with(device, Packing::OpenCv)?;
    let pool = BufferPool::new(&stream);
    let ten: Vec<_> = (0..10)
        .map(|_| pool.get_buffer_1d::<u8>(64))
        .collect::<Result<_, _>>()?;
    let base = stream.stack_range().expect("a stack").start;
    let offsets: Vec<u64> = ten.iter().map(|b| b.device_ptr() - base).collect();
    assert_eq!(
        offsets,
        (0..10).map(|i| i * 64).collect::<Vec<u64>>(),
        "OpenCV: tip += size"
    );
    assert_eq!(
        stream.stats().stack_in_use,
        640,
        "ten 64-byte buffers take 640 bytes"
    );

    // A 2D buffer after them starts on the next texture-aligned boundary (1024 with 512).
    let image = pool.get_buffer::<u8>(4, 100)?;
    let at = (image.device_ptr() - base) as usize;
    assert_eq!(at, 640usize.next_multiple_of(align));
    assert_eq!(image.device_ptr() % align as u64, 0, "texture-aligned");
    assert_eq!(image.step(), align);
    assert_eq!(stream.stats().stack_in_use, at + 4 * align);
    // A column right after it, then a 1D buffer of a 256-aligned type: on its own alignment.
    let column = pool.get_buffer::<f32>(3, 1)?; // 12 bytes, rounded to 64
    assert_eq!(column.device_ptr() - base, (at + 4 * align) as u64);
    let line = pool.get_buffer_1d::<Line>(1)?;
    assert_eq!(
        line.device_ptr() - base,
        (at + 4 * align + 64).next_multiple_of(256) as u64
    );
    assert_eq!(line.device_ptr() % 256, 0);
    drop((line, column, image));
    ten.into_iter().rev().for_each(drop); // last taken, first released
    assert_eq!(stream.stats().stack_in_use, 0);
    assert_eq!(stream.stats().lifo_violations, 0);
    drop(stream);

    // A stack sized for 64 such buffers in OpenCV holds 64 of them here too; with the default
    // packing it holds 16 (each takes a 256-byte slot).
    set_buffer_pool_config(device, 4096, 1)?;
    for (packing, fits) in [(Packing::OpenCv, 64), (Packing::Cuda, 16)] {
        let stream = stream_with(device, packing)?;
        let pool = BufferPool::new(&stream);
        let held: Vec<_> = (0..fits)
            .map(|_| pool.get_buffer_1d::<f32>(16))
            .collect::<Result<_, _>>()?;
        assert!(held.iter().all(|b| b.source() == Source::Stack));
        let over = pool.get_buffer_1d::<f32>(16)?;
        assert_eq!(over.source(), Source::Fallback(FallbackReason::StackFull));
        drop(over);
        held.into_iter().rev().for_each(drop);
        assert_eq!(stream.stats().lifo_violations, 0);
    }
    set_buffer_pool_config(device, 10 * MIB, 5)?;
    Ok(())
}

/// A stream of `device` with `packing`, the device's own left as it was (the GPU device is the
/// whole test binary's).
fn stream_with(device: &Device, packing: Packing) -> Result<Stream, PoolError> {
    let before = device.packing()?;
    device.set_packing(packing);
    let stream = Stream::new(device);
    device.set_packing(before);
    stream
}

/// The same rule when a stream asks for its stack later than its creation (it had none free then):
/// no memory for the stacks at that moment is a fallback, not an error, and is not retried per take.
#[test]
fn a_later_claim_without_memory_for_the_stacks_falls_back() -> TestResult {
    let device = Device::host_with_limit(MIB);
    set_buffer_pool_config(&device, MIB / 2, 1)?;
    let first = Stream::new(&device)?;
    let second = Stream::new(&device)?; // the one stack is held: none for it yet
    assert_eq!(second.stack_index(), None);
    drop(first);
    device.release_stack_memory()?;
    set_buffer_pool_config(&device, 2 * MIB, 1)?; // more than the device has
    let b = BufferPool::new(&second).get_buffer_1d::<u8>(64)?;
    assert_eq!(b.source(), Source::Fallback(FallbackReason::NoStackMemory));
    let c = BufferPool::new(&second).get_buffer_1d::<u8>(64)?;
    assert_eq!(c.source(), Source::Fallback(FallbackReason::NoStackMemory));
    assert_eq!(
        second.stats().driver_alloc_calls,
        2,
        "the stacks' memory is asked for once"
    );
    Ok(())
}
