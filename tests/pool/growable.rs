//! Growable stacks on the host backend, which models CUDA's virtual memory management (a reserved
//! range, 64 KiB granules mapped on demand, every reservation, map and unmap a counted call): the
//! rules every device follows, in CI.

use gpu_pool::CaptureError;
use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::prelude::*;
use gpu_pool::testing::{host_live_bytes, host_with_faults};
use gpu_pool::{FallbackReason, compat::opencv::set_buffer_pool_config};

const MIB: usize = 1 << 20;

/// A pipeline whose temporaries peak at `peak_mib` MiB: three nested 2D buffers.
#[pooled(stream)]
fn pipeline(stream: &Stream, peak_mib: usize) -> Result<(), PoolError> {
    let rows = peak_mib * MIB / 3 / 4096;
    let mut a = buffer!(rows, 1024; f32)?;
    a.set_to(1.0)?;
    {
        let mut b = buffer!(rows, 1024; f32)?;
        b.copy_from(&a)?;
        let mut c = buffer!(rows, 1024; f32)?;
        c.copy_from(&b)?;
        assert!(c.to_vec()?.iter().all(|&v| v == 1.0));
    }
    Ok(())
}

#[test]
fn a_peak_twenty_times_the_configured_stack_runs_with_no_fallback() -> Result<(), PoolError> {
    let device = Device::private_host();
    set_buffer_pool_config(&device, MIB, 1)?; // OpenCV's rule: a 1 MiB stack
    {
        let fixed = Stream::new(&device)?;
        pipeline(&fixed, 20)?;
        assert!(
            fixed.stats().fallback_allocations.total() > 0,
            "fixed: falls back"
        );
    }
    device.set_growable_stacks(true)?;
    let stream = Stream::new(&device)?;
    pipeline(&stream, 20)?;
    let stats = stream.stats();
    assert_eq!(stats.fallback_allocations.total(), 0);
    assert!(
        stats.stack_high_water >= 19 * MIB,
        "{}",
        stats.stack_high_water
    );
    // Mapped: the peak rounded up to the granule, not a guess.
    assert!(stats.stack_mapped >= stats.stack_high_water);
    assert!(stats.stack_mapped < stats.stack_high_water + 3 * 64 * 1024);
    assert!(device.growable_stacks());
    Ok(())
}

#[test]
fn a_loop_that_rises_and_falls_maps_once_and_trim_gives_the_memory_back() -> Result<(), PoolError> {
    let device = Device::private_host();
    device.set_growable_stacks(true)?;
    let stream = Stream::new(&device)?;
    pipeline(&stream, 12)?; // the first rise maps
    let after_first = device.stats();
    assert!(
        after_first.driver_alloc_calls > 1,
        "a reservation and the maps"
    );
    for _ in 0..50 {
        pipeline(&stream, 12)?;
    }
    let after_loop = device.stats();
    assert_eq!(
        after_loop.driver_alloc_calls, after_first.driver_alloc_calls,
        "0 calls after the first rise"
    );
    assert_eq!(after_loop.driver_free_calls, after_first.driver_free_calls);
    assert_eq!(
        after_loop.stack_mapped, after_first.stack_mapped,
        "memory stays mapped"
    );
    let mapped = stream.stats().stack_mapped;
    let live = host_live_bytes(&device).unwrap();
    assert!(live >= mapped, "the backend holds the mapped bytes");

    // Trim below a live buffer keeps what the buffer needs; with nothing live, everything goes.
    let kept = BufferPool::new(&stream).get_buffer_1d::<u8>(100)?;
    let freed = stream.trim()?;
    assert!(freed > 0 && freed < mapped + 1, "{freed} of {mapped}");
    assert!(
        stream.stats().stack_mapped > 0,
        "the live buffer's granule stays"
    );
    drop(kept);
    stream.trim()?;
    assert_eq!(stream.stats().stack_mapped, 0);
    assert_eq!(host_live_bytes(&device), Some(live - mapped));
    // And it grows again on demand.
    pipeline(&stream, 4)?;
    assert!(stream.stats().stack_mapped >= 4 * MIB - 64 * 1024);
    drop(stream);
    assert_eq!(
        host_live_bytes(&device),
        Some(0),
        "a dropped stream unmaps and unreserves"
    );
    assert_eq!(device.stats().stack_mapped, 0);
    Ok(())
}

#[test]
fn every_stream_gets_a_growable_stack_whatever_the_config_count() -> Result<(), PoolError> {
    let device = Device::private_host();
    set_buffer_pool_config(&device, MIB, 2)?;
    device.set_growable_stacks(true)?;
    let streams: Vec<Stream> = (0..8)
        .map(|_| Stream::new(&device))
        .collect::<Result<_, _>>()?;
    for s in &streams {
        pipeline(s, 3)?;
        assert_eq!(s.stats().fallback_allocations.total(), 0);
    }
    let indexes: std::collections::BTreeSet<_> =
        streams.iter().filter_map(Stream::stack_index).collect();
    assert_eq!(indexes.len(), 8, "eight stacks, each its own");
    assert_eq!(device.stats().stacks_held, 8);
    // set_buffer_pool_config means OpenCV's fixed stacks again, for streams made from now on.
    set_buffer_pool_config(&device, MIB, 1)?;
    assert!(!device.growable_stacks());
    let fixed = Stream::new(&device)?;
    pipeline(&fixed, 3)?;
    assert!(fixed.stats().fallback_allocations.total() > 0);
    for s in &streams {
        pipeline(s, 3)?; // the growable streams keep theirs
        assert_eq!(s.stats().fallback_allocations.total(), 0);
    }
    Ok(())
}

#[test]
fn a_failed_map_or_reservation_falls_back_and_loses_nothing() -> Result<(), PoolError> {
    // Call 1 is the reservation, 2 the map of the configured size (one granule), 3 and 4 the
    // growths for `a` and `b`. Each fails in turn, and so does the one retry the device makes
    // after giving idle memory back (the next call).
    for fail_at in 1..=4 {
        let device = host_with_faults(fail_at, 2);
        set_buffer_pool_config(&device, 64 << 10, 1)?;
        device.set_growable_stacks(true)?;
        let stream = Stream::new(&device)?;
        let pool = BufferPool::new(&stream);
        let mut a = pool.get_buffer::<u32>(256, 256)?;
        a.set_to(7)?;
        let mut b = pool.get_buffer::<u32>(512, 256)?;
        b.set_to(9)?;
        assert!(a.to_vec()?.iter().all(|&v| v == 7), "fail_at {fail_at}");
        assert!(b.to_vec()?.iter().all(|&v| v == 9), "fail_at {fail_at}");
        let stats = stream.stats();
        let fell_back = stats.fallback_allocations.total();
        match fail_at {
            1 => {
                // No reservation: as OpenCV with no memory for its stacks, the buffers fall back.
                assert_eq!(a.source(), Source::Fallback(FallbackReason::NoStackMemory));
                assert_eq!(fell_back, 2);
            }
            // The configured size could not be mapped: the stack grows on demand (call 3 fails,
            // its retry maps).
            2 => assert_eq!(fell_back, 0, "fail_at 2: the stack grew on demand"),
            _ => assert_eq!(
                fell_back, 1,
                "fail_at {fail_at}: the request whose map failed"
            ),
        }
        drop((b, a));
        stream.trim()?;
        drop(stream);
        assert_eq!(
            host_live_bytes(&device),
            Some(0),
            "fail_at {fail_at}: nothing leaked"
        );
    }
    Ok(())
}

#[test]
fn a_request_past_the_reservation_falls_back_as_too_large() -> Result<(), PoolError> {
    let device = gpu_pool::testing::host_with_faults(0, 1);
    device.set_growable_stacks(true)?;
    let stream = Stream::new(&device)?;
    // The host's reservation is 1 GiB: a 2 GiB request cannot be a stack buffer.
    let pool = BufferPool::new(&stream);
    let small = pool.get_buffer_1d::<u8>(1000)?;
    assert_eq!(small.source(), Source::Stack);
    let huge = pool.get_buffer_1d::<u8>(2 << 30);
    if let Ok(h) = &huge {
        assert_eq!(h.source(), Source::Fallback(FallbackReason::TooLarge));
    }
    Ok(())
}

/// On the GPU: growth past what was mapped, inside a capture and out, real memory behind it
/// (the driver's free memory moves with `trim`), and a graph's memory kept while it lives.
#[cfg(feature = "cuda")]
#[test]
fn on_the_gpu_a_stack_grows_inside_a_capture_and_trim_gives_memory_back()
-> Result<(), Box<dyn std::error::Error>> {
    use gpu_pool::interop::cudarc;
    let Some((device, _lock)) = crate::common::gpu("growable_gpu") else {
        return Ok(());
    };
    if let Err(e) = device.set_growable_stacks(true) {
        crate::common::skipped(&format!("growable_gpu: skipped: {e}"));
        return Ok(());
    }
    let free = || -> Result<usize, Box<dyn std::error::Error>> {
        device.cudarc().expect("CUDA").bind_to_thread()?;
        Ok(cudarc::driver::result::mem_get_info()?.0)
    };
    let stream = Stream::new(&device)?;
    device.set_growable_stacks(false)?; // other tests' streams get fixed stacks
    // The configured size, mapped when the stream was made (before `before`).
    let at_new = stream.stats().stack_mapped;
    // 200 MiB peak: 20x the default 10 MiB stack.
    let before = free()?;
    pipeline(&stream, 200)?;
    let first = device.stats();
    for _ in 0..10 {
        pipeline(&stream, 200)?;
    }
    let after = device.stats();
    let stats = stream.stats();
    println!(
        "growable_gpu: peak {} MiB, mapped {} MiB, fallbacks {}, driver calls in 10 more rounds: {}",
        stats.stack_high_water >> 20,
        stats.stack_mapped >> 20,
        stats.fallback_allocations.total(),
        after.driver_alloc_calls - first.driver_alloc_calls
    );
    assert_eq!(stats.fallback_allocations.total(), 0);
    assert_eq!(after.driver_alloc_calls, first.driver_alloc_calls);
    let used = before.saturating_sub(free()?);
    assert!(
        used + at_new >= stats.stack_mapped,
        "the driver sees the mapped memory: {used} + {at_new}"
    );

    // Growth inside a capture: the graph's buffers are past what is mapped.
    let mut out = GpuMat::<u32>::new(&stream, 1, 1 << 20)?;
    out.set_to(0)?;
    let mapped_before = stream.stats().stack_mapped;
    {
        let graph = stream.capture(|s| {
            let pool = BufferPool::new(s);
            let _low = pool.get_buffer_1d::<u8>(mapped_before)?; // up to the mapped end
            let mut high = pool.get_buffer_1d::<u32>(1 << 20)?; // mapped during the capture
            high.set_to(0xC0FFEE)?;
            out.copy_from(&high)
        })?;
        assert!(
            stream.stats().stack_mapped > mapped_before,
            "mapped during the capture"
        );
        // A trim while the graph lives keeps the graph's memory.
        stream.trim()?;
        for _ in 0..3 {
            graph.launch()?;
        }
        stream.synchronize()?;
    }
    assert!(out.to_vec()?.iter().all(|&v| v == 0xC0FFEE));
    // Refused inside a capture: trim waits for the stream.
    let refused = stream.capture(|s| s.trim().map(drop));
    assert!(
        matches!(
            refused,
            Err(PoolError::Capture(CaptureError::Allocates { .. }))
        ),
        "{refused:?}"
    );
    drop(refused);
    let mapped = stream.stats().stack_mapped;
    let freed = stream.trim()?;
    let regained = free()?;
    println!(
        "growable_gpu: trim unmapped {} MiB of {} MiB",
        freed >> 20,
        mapped >> 20
    );
    assert!(freed > 0 && stream.stats().stack_mapped < mapped);
    assert!(
        regained > before.saturating_sub(used),
        "the driver got memory back"
    );
    Ok(())
}

#[test]
fn a_failed_unmap_leaves_the_stack_mapped_and_usable() -> Result<(), PoolError> {
    // Call 1: the first trim's unmap; 2 in the second device: the drop's unmap; 3 its unreserve.
    for fail_at in 1..=3 {
        let device = gpu_pool::testing::host_with_unmap_fault(fail_at);
        device.set_growable_stacks(true)?;
        let stream = Stream::new(&device)?;
        pipeline(&stream, 3)?;
        let mapped = stream.stats().stack_mapped;
        if fail_at == 1 {
            assert!(stream.trim().is_err());
            assert_eq!(
                stream.stats().stack_mapped,
                mapped,
                "nothing given back, nothing lost"
            );
            pipeline(&stream, 3)?; // still served from the stack
            assert_eq!(stream.stats().fallback_allocations.total(), 0);
        }
        // The drop gives back what it can and says what it could not; it never panics.
        drop(stream);
        let live = host_live_bytes(&device).unwrap();
        if fail_at == 1 {
            assert_eq!(live, 0, "the drop's unmap and unreserve went through");
        } else {
            assert!(
                live <= mapped,
                "at most the mapping that failed stays: {live}"
            );
        }
    }
    Ok(())
}

/// A family's region lowered by a capture that kept a buffer leaves the members' scratch above
/// the top, where `trim` unmaps it: the next replay maps it again before covering it.
#[cfg(feature = "cuda")]
#[test]
fn on_the_gpu_a_trimmed_family_region_is_mapped_again_before_a_replay()
-> Result<(), Box<dyn std::error::Error>> {
    let Some((device, _lock)) = crate::common::gpu("growable_family") else {
        return Ok(());
    };
    if device.set_growable_stacks(true).is_err() {
        return Ok(());
    }
    let stream = Stream::new(&device)?;
    device.set_growable_stacks(false)?;
    let mut out = GpuMat::<u32>::new(&stream, 1, 1024)?;
    out.set_to(0)?;
    // Leaked: a cell that outlived the family would borrow it past its drop.
    let kept = &*Box::leak(Box::new(std::cell::RefCell::new(None)));
    let family = stream.graph_family()?;
    let trimmed;
    {
        let member = family.capture(|s| {
            let mut scratch = BufferPool::new(s).get_buffer_1d::<u32>(16 << 20)?; // 64 MiB
            scratch.set_to(77)?;
            out.copy_from(&scratch.roi(0..1, 0..1024)?)
        })?;
        let failed = family.capture(|s| {
            *kept.borrow_mut() = Some(BufferPool::new(s).get_buffer_1d::<u8>(1000)?);
            Ok(())
        });
        assert!(failed.is_err(), "a capture that keeps a buffer fails");
        drop(failed);
        trimmed = stream.trim()?;
        drop(kept.borrow_mut().take());
        for _ in 0..3 {
            member.launch()?;
        }
        stream.synchronize()?;
    }
    println!(
        "growable_family: trim unmapped {} MiB under the lowered region; replays mapped it again",
        trimmed >> 20
    );
    drop(family);
    assert!(out.to_vec()?.iter().all(|&v| v == 77));
    Ok(())
}
