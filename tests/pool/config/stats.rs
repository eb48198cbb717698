//! Statistics and the sizing report.

use gpu_pool::{BufferPool, Fallback, FallbackReason, PoolError, Stream, set_buffer_pool_config};

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
