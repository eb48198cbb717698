//! Sizing stacks before a GPU run: `Stream::measure` on the host backend gives the exact stack
//! size a pooled function needs, whatever stack it was measured on.

use gpu_pool::compat::opencv::BufferPool;
use gpu_pool::prelude::*;
use gpu_pool::{compat::opencv::set_buffer_pool_config, observe::Sizing};

const MIB: usize = 1 << 20;

/// A 1080p frame's temporaries; the third is gone before the fourth is taken.
#[pooled(stream)]
fn frame(stream: &Stream, rows: usize, cols: usize) -> Result<(), PoolError> {
    let mut gray = buffer!(rows, cols; u8)?;
    let grad = buffer!(rows, cols; f32)?;
    {
        let color = buffer!(rows, cols; [u8; 3])?;
        let _ = (&color, &grad);
    }
    let row_sums = buffer!(rows; f32)?;
    gray.set_to(0)?; // kernels would go here, skipped on the host
    let _ = &row_sums;
    Ok(())
}

/// The measurement on a fresh host device with `stack` bytes a stack (`None`: the default).
fn measured(stack: Option<usize>) -> Result<Sizing, PoolError> {
    let device = Device::private_host();
    if let Some(bytes) = stack {
        set_buffer_pool_config(&device, bytes, 1)?;
    }
    let stream = Stream::new(&device)?;
    let (result, sizing) = stream.measure(|s| frame(s, 1080, 1920));
    result?;
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(sizing)
}

#[test]
fn measure_gives_the_exact_stack_size_a_pooled_function_needs() -> Result<(), PoolError> {
    let device = Device::private_host();
    let bytes =
        |cols: usize, size: usize| device.footprint::<u8>(1080, cols * size).map(|f| f.bytes);
    // gray + grad + max(color, row_sums): all 2D layouts are whole rows of 512-byte multiples.
    let expected = bytes(1920, 1)? + bytes(1920, 4)? + bytes(1920, 3)?;

    let roomy = measured(Some(64 * MIB))?;
    assert_eq!(roomy.stack_bytes, expected);
    assert_eq!((roomy.buffers, roomy.fallbacks), (4, 0));

    for cramped in [measured(None)?, measured(Some(MIB))?] {
        // The default 10 MiB stack, and a smaller one: the need, not what the stack held.
        assert_eq!(cramped.stack_bytes, expected);
        assert!(cramped.fallbacks > 0);
    }

    let sized = measured(Some(expected))?;
    assert_eq!((sized.fallbacks, sized.driver_alloc_calls), (0, 0));
    let short = measured(Some(expected - bytes(1920, 4)?))?;
    assert_eq!(short.fallbacks, 1, "one buffer less is one fallback");
    Ok(())
}

#[test]
fn measure_counts_only_its_own_work_and_keeps_the_streams_peak() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let pool = BufferPool::new(&stream);
    let outside = pool.get_buffer::<u8>(100, 1000)?; // 100 x 1024 bytes, before the measurement
    let ((), sizing) = stream.measure(|s| {
        let pool = BufferPool::new(s);
        let _a = pool.get_buffer_1d::<u8>(512);
    });
    assert_eq!(sizing.stack_bytes, 512);
    assert_eq!(sizing.buffers, 1);
    assert_eq!(stream.stats().peak_demand, 100 * 1024 + 512);
    drop(outside);
    Ok(())
}

#[test]
fn a_reset_or_a_panic_inside_measure_loses_nothing() -> Result<(), PoolError> {
    let device = Device::private_host();
    let stream = Stream::new(&device)?;
    let mib_buffer = |s: &Stream| BufferPool::new(s).get_buffer_1d::<u8>(MIB).map(drop);
    let (taken, plain) = stream.measure(mib_buffer);
    taken?;
    assert_eq!(plain.stack_bytes, MIB);

    // Resets of the peaks while the work runs (the stream's own, or the device's from a monitor).
    let (taken, reset) = stream.measure(|s| {
        let r = mib_buffer(s);
        s.reset_peak();
        let _small = BufferPool::new(s).get_buffer_1d::<u8>(1024);
        r
    });
    taken?;
    assert_eq!(reset.stack_bytes, MIB, "the stream's reset");
    let (taken, device_reset) = stream.measure(|s| {
        let r = mib_buffer(s);
        device.reset_peak();
        r
    });
    taken?;
    assert_eq!(device_reset.stack_bytes, MIB, "the device's reset");

    // Nested: each sees its own work, the outer one the inner's too.
    let ((), outer) = stream.measure(|s| {
        let _a = BufferPool::new(s).get_buffer_1d::<u8>(4096);
        let ((), inner) = s.measure(|s| {
            let _b = BufferPool::new(s).get_buffer_1d::<u8>(128);
        });
        assert_eq!(inner.stack_bytes, 128);
    });
    assert_eq!(outer.stack_bytes, 4096 + 128);

    // A panic in the work leaves the stream's peak as it was.
    let peak = stream.stats().peak_demand;
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stream.measure(|_| panic!("work failed"))
    }));
    assert!(panicked.is_err());
    assert_eq!(stream.stats().peak_demand, peak);
    Ok(())
}

/// What the host's measurement says a graph of the same work holds on the GPU: the work's stack
/// bytes plus the fence's block.
#[cfg(feature = "cuda")]
#[test]
fn a_graph_holds_what_measure_said_plus_its_fence() -> Result<(), Box<dyn std::error::Error>> {
    let Some((gpu, _lock)) = crate::common::gpu("graph_sizing") else {
        return Ok(());
    };
    let dry = Stream::new(&Device::private_host())?;
    let (result, sizing) = dry.measure(|s| frame(s, 1080, 1920));
    result?;
    set_buffer_pool_config(&gpu, 64 * MIB, 1)?;
    let stream = Stream::new(&gpu)?;
    let graph = stream.capture(|s| frame(s, 1080, 1920))?;
    let (held, measured) = (graph.stack_bytes(), sizing.stack_bytes);
    println!(
        "graph of a 1080p frame's temporaries: {held} stack bytes; measured on the host: {measured}"
    );
    assert!(
        held > measured && held - measured <= 512,
        "{held} vs {measured}"
    );
    Ok(())
}

/// The workload: ten pairs of a 64-byte row and an 8 KiB image, all live at once. On a
/// large stack each image starts on the texture alignment after its row (padding included).
fn rows_and_images(stream: &Stream) -> Result<(), PoolError> {
    let pool = BufferPool::new(stream);
    let mut live = Vec::new();
    for _ in 0..10 {
        live.push(pool.get_buffer_1d::<u8>(64)?);
        live.push(pool.get_buffer::<u8>(16, 512)?); // 16 rows of 512 bytes: 8 KiB, 2D
    }
    while live.pop().is_some() {} // released in reverse, as `buffer!`s would be
    Ok(())
}

/// `rows_and_images` measured on a fresh host device with `stack` bytes a stack.
fn measured_pairs(stack: usize) -> Result<Sizing, PoolError> {
    let device = Device::private_host();
    set_buffer_pool_config(&device, stack, 1)?;
    let stream = Stream::new(&device)?;
    let (result, sizing) = stream.measure(rows_and_images);
    result?;
    Ok(sizing)
}

/// A buffer that falls back is measured where the stack would have placed it, padding included:
/// the figure is the same on any stack, and a stack of that size runs the work with no fallback.
#[test]
fn a_fallback_is_measured_with_the_padding_a_stack_would_give_it() -> Result<(), PoolError> {
    let small = measured_pairs(4096)?;
    let large = measured_pairs(MIB)?;
    eprintln!(
        "ten (64-byte row, 8 KiB image) pairs: {} bytes measured on a 4 KiB stack ({} fallbacks), \
         {} on a 1 MiB one ({} fallbacks)",
        small.stack_bytes, small.fallbacks, large.stack_bytes, large.fallbacks
    );
    assert!(small.fallbacks > 0, "the small stack falls back");
    assert_eq!(large.fallbacks, 0);
    // A 64-byte row, then the image on the next 512-byte boundary: 8704 bytes a pair.
    assert_eq!(large.stack_bytes, 10 * (512 + 8192));
    assert_eq!(small.stack_bytes, large.stack_bytes, "whatever the stack");
    let sized = measured_pairs(small.stack_bytes)?;
    assert_eq!(
        (sized.fallbacks, sized.stack_bytes),
        (0, small.stack_bytes),
        "a stack of the figure measured on a small stack serves the work"
    );
    Ok(())
}

/// The unlimited stack a fallback starts follows releases out of order as the stack does, and
/// gives way to the real one once its blocks are gone.
#[test]
fn the_demand_follows_fallbacks_released_out_of_order() -> Result<(), PoolError> {
    let device = Device::private_host();
    set_buffer_pool_config(&device, 4096, 1)?;
    let stream = Stream::new(&device)?;
    let pool = BufferPool::new(&stream);
    let ((), sizing) = stream.measure(|_| {
        // Blocks start on 256 bytes (the default packing), images on 512.
        let a = pool.get_buffer_1d::<u8>(64).unwrap(); // stack [0, 64)
        let big = pool.get_buffer::<u8>(16, 512).unwrap(); // falls back: [512, 8704) unlimited
        let b = pool.get_buffer_1d::<u8>(64).unwrap(); // stack [256, 320); unlimited [8704, 8768)
        drop(big); // out of order there: [8704, 8768) keeps the top
        let c = pool.get_buffer_1d::<u8>(64).unwrap(); // unlimited [8960, 9024)
        drop((c, b)); // everything above `a` gone: the unlimited stack is the real one again
        let d = pool.get_buffer_1d::<u8>(64).unwrap(); // [256, 320) on both
        drop((d, a));
    });
    assert_eq!(sizing.stack_bytes, 9024);
    assert_eq!(sizing.fallbacks, 1);
    assert_eq!(stream.stats().peak_demand, 9024);
    stream.reset_peak();
    assert_eq!(
        stream.stats().peak_demand,
        0,
        "nothing is left of the demand"
    );
    drop(pool.get_buffer_1d::<u8>(64)?);
    assert_eq!(stream.stats().peak_demand, 64);
    Ok(())
}

/// `Device::reset_peak` from another thread while the stream measures: every measurement is the
/// work's exact need (it was 0 for some before, when a reset lowered the stream's peak between a
/// take and the measurement's read of it).
#[test]
fn a_reset_from_another_thread_never_changes_a_measurement() -> Result<(), PoolError> {
    use std::sync::atomic::{AtomicBool, Ordering};
    // About 0.2% of measurements went wrong before (a debug build on two cores): 40 expected here,
    // in a fraction of a second.
    const TRIES: usize = 20_000;
    let device = Device::private_host();
    let stream = Stream::new(&device)?;
    let done = AtomicBool::new(false);
    let (wrong, resets) = std::thread::scope(|scope| {
        let resetter = scope.spawn(|| {
            let mut resets = 0u64;
            while !done.load(Ordering::Relaxed) {
                device.reset_peak();
                resets += 1;
            }
            resets
        });
        let mut wrong = Vec::new();
        for _ in 0..TRIES {
            let (taken, sizing) =
                stream.measure(|s| BufferPool::new(s).get_buffer_1d::<u8>(MIB).map(drop));
            if taken.is_err() || sizing.stack_bytes != MIB {
                wrong.push(sizing.stack_bytes);
            }
        }
        done.store(true, Ordering::Relaxed);
        (wrong, resetter.join().expect("the resetting thread"))
    });
    eprintln!(
        "{TRIES} measurements of 1 MiB with {resets} device resets beside them: {} wrong {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(8)]
    );
    assert!(wrong.is_empty(), "{wrong:?}");
    Ok(())
}

/// A panic in measured work leaves no measurement behind: the next one is exact, and resets act
/// as before it.
#[test]
fn a_panic_inside_measure_leaves_the_next_measurement_exact() -> Result<(), PoolError> {
    let device = Device::private_host();
    set_buffer_pool_config(&device, 4096, 1)?;
    let stream = Stream::new(&device)?;
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stream.measure(|s| {
            let pool = BufferPool::new(s);
            let _row = pool.get_buffer_1d::<u8>(64);
            let _image = pool.get_buffer::<u8>(16, 512); // falls back
            panic!("work failed")
        })
    }));
    assert!(panicked.is_err());
    assert_eq!(stream.stats().stack_in_use, 0);
    let (taken, sizing) = stream.measure(rows_and_images);
    taken?;
    assert_eq!(sizing.stack_bytes, 10 * (512 + 8192));
    let ((), nothing) = stream.measure(|_| ());
    assert_eq!(nothing.stack_bytes, 0);
    stream.reset_peak();
    assert_eq!(stream.stats().peak_demand, 0);
    Ok(())
}
