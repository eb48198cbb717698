//! Sizing stacks before a GPU run: `Stream::measure` on the host backend gives the exact stack
//! size a pooled function needs, whatever stack it was measured on.

use gpu_pool::prelude::*;
use gpu_pool::{Sizing, set_buffer_pool_config};

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
