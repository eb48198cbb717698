//! Statistics and the sizing report.

use gpu_pool::{
    FallbackReason, PoolError, Stream, compat::opencv::BufferPool,
    compat::opencv::set_buffer_pool_config, config::Fallback,
};

use super::{MIB, private};

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
    let text = gpu_pool::observe::Report::new(vec![stats]).to_string();
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
fn a_streams_reset_peak_starts_its_peaks_over_from_what_it_uses_now() -> Result<(), PoolError> {
    let device = private(Fallback::Driver);
    set_buffer_pool_config(&device, MIB, 1)?;
    let stream = Stream::new(&device)?;
    let pool = BufferPool::new(&stream);
    let kept = pool.get_buffer_1d::<u8>(1000)?; // 1024 bytes of stack
    let overflow = pool.get_buffer_1d::<u8>(2 * MIB)?; // a live fallback the stack would hold
    drop(pool.get_buffer::<u8>(100, 1000)?); // 100 x 1024 bytes, gone again
    let before = stream.stats();
    assert_eq!(before.stack_high_water, 1024 + 100 * 1024);
    assert_eq!(before.peak_demand, 1024 + 100 * 1024 + 2 * MIB);
    assert!(before.peak_at.is_some());

    stream.reset_peak();
    let after = stream.stats();
    assert_eq!(after.stack_high_water, after.stack_in_use);
    assert_eq!(after.stack_in_use, 1024);
    assert_eq!(
        after.peak_demand,
        1024 + 2 * MIB,
        "in use, plus the live fallback"
    );
    assert_eq!(after.peak_at, None, "no take reached the mark since");
    // Totals are kept.
    assert_eq!(after.stack_allocations, before.stack_allocations);
    assert_eq!(after.fallback_allocations, before.fallback_allocations);
    assert_eq!(after.fallback_sites, before.fallback_sites);

    // The peaks grow again from there, and the peak's line is the new one.
    let (line, small) = (line!(), pool.get_buffer_1d::<u8>(64)?);
    let grown = stream.stats();
    assert_eq!(grown.stack_high_water, 1024 + 64);
    assert_eq!(grown.peak_demand, 1024 + 64 + 2 * MIB);
    assert_eq!(grown.peak_at.map(|p| p.line()), Some(line));
    drop((small, overflow, kept));
    stream.reset_peak();
    let idle = stream.stats();
    assert_eq!((idle.stack_high_water, idle.peak_demand), (0, 0));
    Ok(())
}

#[test]
fn a_devices_reset_peak_starts_its_peaks_over_from_what_is_in_use_now() -> Result<(), PoolError> {
    let device = private(Fallback::Driver);
    set_buffer_pool_config(&device, MIB, 1)?;
    let (s1, s2) = (Stream::new(&device)?, Stream::new(&device)?);
    let kept = BufferPool::new(&s1).get_buffer_1d::<u8>(MIB / 2)?;
    drop(BufferPool::new(&s1).get_buffer_1d::<u8>(3 * MIB)?); // a demand of 3.5 MiB, gone
    drop(BufferPool::new(&s2).get_buffer_1d::<u8>(10)?); // s2 has no stack: it wants one
    let gone = Stream::new(&device)?;
    drop(BufferPool::new(&gone).get_buffer_1d::<u8>(5 * MIB)?); // a dropped stream's peak
    drop(gone);
    let before = device.stats();
    assert_eq!(before.peak_streams_wanting_stack, 3);
    assert_eq!(before.peak_stream_demand, 5 * MIB);
    let s1_mark = s1.stats().stack_high_water;

    device.reset_peak();
    let after = device.stats();
    assert_eq!(
        after.peak_streams_wanting_stack, 2,
        "s1 and s2 want stacks now"
    );
    assert_eq!(
        after.peak_stream_demand,
        MIB / 2,
        "s1's buffer is all that is in use"
    );
    let rec = after.recommended_config().expect("buffers were requested");
    assert_eq!((rec.stack_size(), rec.stack_count()), (MIB, 2));
    for s in &after.streams {
        assert_eq!(s.peak_demand, s.stack_in_use, "stream {}", s.stream);
    }
    // A stream's stack mark is its own thread's to reset (`Stream::reset_peak`).
    assert_eq!(s1.stats().stack_high_water, s1_mark);
    // Totals are kept.
    assert_eq!(after.fallback_allocations, before.fallback_allocations);
    assert_eq!(after.retired_fallback_sites, before.retired_fallback_sites);

    assert_eq!(
        (after.peak_live_bytes, before.peak_live_bytes),
        (MIB / 2, 5 * MIB + MIB / 2),
        "the device's live peak (5 MiB of `gone` beside `kept`) starts over from what is live"
    );

    // What comes next is measured from there.
    let big = BufferPool::new(&s2).get_buffer_1d::<u8>(2 * MIB)?;
    assert_eq!(device.stats().peak_stream_demand, 2 * MIB);
    assert_eq!(device.stats().peak_live_bytes, 2 * MIB + MIB / 2);
    drop((big, kept));
    Ok(())
}

/// RMM's statistics test on a stack: ten 10 MiB buffers, five freed out of order. The stack's top
/// stays at 100 MiB; what is live is 50 MiB in five buffers.
#[test]
fn live_bytes_count_what_is_live_not_the_stacks_top() -> Result<(), PoolError> {
    let device = private(Fallback::Driver);
    set_buffer_pool_config(&device, 100 * MIB, 1)?;
    let stream = Stream::new(&device)?;
    let pool = BufferPool::new(&stream);
    let mut held: Vec<_> = (0..10)
        .map(|_| pool.get_buffer_1d::<u8>(10 * MIB))
        .collect::<Result<_, _>>()?;
    for i in [8, 6, 4, 2, 0] {
        drop(held.remove(i));
    }
    let stats = stream.stats();
    eprintln!(
        "RMM scenario: stack_in_use {} MiB, live {} MiB in {} buffers",
        stats.stack_in_use >> 20,
        stats.live_bytes >> 20,
        stats.live_buffers
    );
    assert_eq!(stats.stack_in_use, 100 * MIB, "the top");
    assert_eq!((stats.live_bytes, stats.live_buffers), (50 * MIB, 5));
    let d = device.stats();
    assert_eq!((d.live_bytes, d.live_buffers), (50 * MIB, 5));
    assert_eq!(d.peak_live_bytes, 100 * MIB);

    // A fallback buffer counts too, and everything goes back to zero.
    let over = pool.get_buffer_1d::<u8>(MIB)?;
    assert!(matches!(over.source(), gpu_pool::Source::Fallback(_)));
    assert_eq!(stream.stats().live_bytes, 51 * MIB);
    assert_eq!(device.stats().peak_live_bytes, 100 * MIB);
    drop(over);
    drop(held);
    let (stats, d) = (stream.stats(), device.stats());
    assert_eq!(
        (stats.live_bytes, stats.live_buffers, stats.stack_in_use),
        (0, 0, 0)
    );
    assert_eq!((d.live_bytes, d.live_buffers), (0, 0));
    Ok(())
}

/// Two streams' buffers live at once: the device's peak is their sum, where the largest stream's
/// demand (the old device-wide peak) is one stream's alone.
#[test]
fn the_devices_peak_is_the_most_live_at_once_over_all_streams() -> Result<(), PoolError> {
    let device = private(Fallback::Driver);
    set_buffer_pool_config(&device, 4 * MIB, 2)?;
    let (s1, s2) = (Stream::new(&device)?, Stream::new(&device)?);
    let a = BufferPool::new(&s1).get_buffer_1d::<u8>(MIB)?;
    let b = BufferPool::new(&s2).get_buffer_1d::<u8>(2 * MIB)?;
    let together = s1.stats().live_bytes + s2.stats().live_bytes;
    drop((b, a));
    let stats = device.stats();
    eprintln!(
        "two streams: live at once {} MiB, device peak {} MiB, largest stream demand {} MiB",
        together >> 20,
        stats.peak_live_bytes >> 20,
        stats.peak_stream_demand >> 20
    );
    assert_eq!(together, 3 * MIB);
    assert!(stats.peak_live_bytes >= together);
    assert!(
        stats.peak_stream_demand < together,
        "one stream's demand reads below the device's use"
    );
    assert!(
        gpu_pool::observe::Report::new(vec![stats])
            .to_string()
            .contains("peak 3.00 MiB")
    );

    // The same from two threads, each holding its buffer while the other checks the peak.
    let barrier = std::sync::Barrier::new(2);
    std::thread::scope(|scope| {
        for (stream, bytes) in [(s1, MIB), (s2, 3 * MIB)] {
            let (device, barrier) = (&device, &barrier);
            scope.spawn(move || -> Result<(), PoolError> {
                for _ in 0..200 {
                    let held = BufferPool::new(&stream).get_buffer_1d::<u8>(bytes)?;
                    barrier.wait(); // both hold theirs now
                    assert!(device.stats().peak_live_bytes >= 4 * MIB);
                    barrier.wait();
                    drop(held);
                }
                Ok(())
            });
        }
    });
    assert_eq!(device.stats().live_bytes, 0);
    Ok(())
}

/// The device's live peak samples the sum when a stream passes its own high: two streams each
/// below their own highs, holding more together than ever, are missed by default (the documented
/// gap) and counted with `Device::set_exact_live_peak`.
#[test]
fn the_live_peak_is_exact_for_streams_that_ask_and_sampled_otherwise() -> Result<(), PoolError> {
    let mut peaks = Vec::new();
    for exact in [false, true] {
        let device = private(Fallback::Driver);
        set_buffer_pool_config(&device, 16 * MIB, 2)?;
        device.set_exact_live_peak(exact);
        let (s1, s2) = (Stream::new(&device)?, Stream::new(&device)?);
        let (p1, p2) = (BufferPool::new(&s1), BufferPool::new(&s2));
        drop(p1.get_buffer_1d::<u8>(8 * MIB)?); // each stream's own high, alone
        drop(p2.get_buffer_1d::<u8>(8 * MIB)?);
        let (a, b) = (
            p1.get_buffer_1d::<u8>(6 * MIB)?,
            p2.get_buffer_1d::<u8>(6 * MIB)?,
        );
        drop((b, a)); // 12 MiB at once, each below its own high
        let stats = device.stats();
        assert_eq!(stats.live_bytes, 0);
        peaks.push(stats.peak_live_bytes);
    }
    eprintln!("device live peak, sampled and exact: {peaks:?}");
    assert_eq!(peaks, [8 * MIB, 12 * MIB]);
    Ok(())
}
