//! OpenCV's `BufferPool` documentation (`shared/seeds/000_*.txt`), example by example: on a private
//! host device, then again on the GPU where there is one.

use crate::common::each_device;
use gpu_pool::GpuRead;
use gpu_pool::GpuWrite;
use gpu_pool::{
    Device, FallbackReason, PoolError, Source, Stream, compat::opencv::BufferPool,
    compat::opencv::GpuMat, compat::opencv::set_buffer_pool_config, config::Fallback,
    config::Packing,
};

const MIB: usize = 1 << 20;

fn config_64mib_x2(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, 64 * MIB, 2)
}

fn range_of<T: bytemuck::Pod>(m: &GpuMat<'_, T>) -> std::ops::Range<u64> {
    m.device_ptr()..m.device_ptr() + (m.step() * m.rows()) as u64
}

#[test]
fn two_streams_fill_their_stacks_and_the_next_buffer_falls_back() -> Result<(), PoolError> {
    each_device("seed_example", seed_example)
}

fn seed_example(device: &Device) -> Result<(), PoolError> {
    config_64mib_x2(device)?;
    let calls = device.stats().driver_alloc_calls;
    let (stream1, stream2) = (Stream::new(device)?, Stream::new(device)?);
    let (pool1, pool2) = (BufferPool::new(&stream1), BufferPool::new(&stream2));

    let d_src1 = pool1.get_buffer::<u8>(4096, 4096)?; // 16 MiB
    let d_dst1 = pool1.get_buffer::<[u8; 3]>(4096, 4096)?; // 48 MiB: pool1 is now full
    let d_src2 = pool2.get_buffer::<u8>(1024, 1024)?; // 1 MiB
    let d_dst2 = pool2.get_buffer::<[u8; 3]>(1024, 1024)?; // 3 MiB
    for m in [&d_src1, &d_src2] {
        assert_eq!(m.source(), Source::Stack);
    }
    for m in [&d_dst1, &d_dst2] {
        assert_eq!(m.source(), Source::Stack);
    }
    assert_eq!(stream1.stats().stack_in_use, 64 * MIB);
    assert_eq!(stream2.stats().stack_in_use, 4 * MIB);

    let stack1 = stream1.stack_range().expect("stream1 holds a stack");
    let stack2 = stream2.stack_range().expect("stream2 holds a stack");
    assert_eq!(stack1.end - stack1.start, (64 * MIB) as u64);
    assert!(
        stack1.end <= stack2.start || stack2.end <= stack1.start,
        "stacks are disjoint"
    );
    assert_eq!(range_of(&d_src1).start, stack1.start);
    assert_eq!(
        range_of(&d_dst1).end,
        stack1.end,
        "48 MiB buffer ends the stack"
    );
    assert!(stack2.contains(&d_dst2.device_ptr()));

    // "Stack for pool1 is full, memory is allocated with DefaultAllocator"
    let d_add1 = pool1.get_buffer::<u8>(1024, 1024)?;
    assert_eq!(d_add1.source(), Source::Fallback(FallbackReason::StackFull));
    for stack in [&stack1, &stack2] {
        let r = range_of(&d_add1);
        assert!(
            r.end <= stack.start || stack.end <= r.start,
            "the fallback lies outside the stacks"
        );
    }
    assert_eq!(
        stream1
            .stats()
            .fallback_allocations
            .get(FallbackReason::StackFull),
        1
    );

    // "Only 2 stacks were allocated, we've run out of stacks"
    let stream3 = Stream::new(device)?;
    assert_eq!(stream3.stack_index(), None);
    let d_src3 = BufferPool::new(&stream3).get_buffer::<u8>(1024, 1024)?;
    assert_eq!(d_src3.source(), Source::Fallback(FallbackReason::NoStack));

    // One driver call made all the stack memory; the two fallbacks made one each.
    assert_eq!(device.stats().driver_alloc_calls - calls, 3);
    let _ = (d_src1, d_dst1, d_src2, d_dst2, d_add1, d_src3);
    Ok(())
}

#[test]
fn the_lifo_loop_leaves_every_stack_empty_and_calls_no_driver() -> Result<(), PoolError> {
    each_device("lifo_loop", lifo_loop)
}

fn lifo_loop(device: &Device) -> Result<(), PoolError> {
    config_64mib_x2(device)?;
    let (stream1, stream2) = (Stream::new(device)?, Stream::new(device)?);
    let (pool1, pool2) = (BufferPool::new(&stream1), BufferPool::new(&stream2));
    let calls_before = device.stats().driver_alloc_calls;
    for i in 0..10u8 {
        let mut d_src1 = pool1.get_buffer::<u8>(4096, 4096)?;
        let d_dst1 = pool1.get_buffer::<[u8; 3]>(4096, 4096)?;
        let mut d_src2 = pool2.get_buffer::<u8>(1024, 1024)?;
        let d_dst2 = pool2.get_buffer::<[u8; 3]>(1024, 1024)?;
        d_src1.set_to(i)?;
        d_src2.set_to(i)?;
        assert!(d_src2.to_vec()?.iter().all(|&v| v == i));
        assert!(d_src1.to_vec()?.iter().all(|&v| v == i));
        // Destruction order: d_dst2, d_src2, d_dst1, d_src1: LIFO per stack.
        let _ = (d_dst1, d_dst2);
    }
    for s in [&stream1, &stream2] {
        let stats = s.stats();
        assert_eq!(stats.stack_in_use, 0);
        assert_eq!(stats.lifo_violations, 0);
        assert_eq!(stats.stack_allocations, 20);
        assert_eq!(stats.fallback_allocations.total(), 0);
    }
    assert_eq!(
        device.stats().driver_alloc_calls,
        calls_before,
        "no driver call in the loop"
    );
    Ok(())
}

#[test]
fn the_ng_out_of_order_release_is_survived_and_counted() -> Result<(), PoolError> {
    each_device("ng_release", ng_release)
}

fn ng_release(device: &Device) -> Result<(), PoolError> {
    set_buffer_pool_config(device, 10 * MIB, 5)?; // the default
    let stream = Stream::new(device)?;
    let pool = BufferPool::new(&stream);
    let mut mat1 = pool.get_buffer::<u8>(1024, 1024)?;
    let mut mat2 = pool.get_buffer::<u8>(1024, 1024)?;
    mat1.set_to(1)?;
    mat2.set_to(2)?;
    let mat1_start = mat1.device_ptr();
    mat1.release()?; // erroneous usage: mat2 must be released first

    // mat1's memory is not handed out again while mat2 lives.
    let mut mat3 = pool.get_buffer::<u8>(1024, 1024)?;
    assert!(mat3.device_ptr() > mat2.device_ptr());
    mat3.set_to(3)?;
    assert!(mat2.to_vec()?.iter().all(|&v| v == 2), "mat2 intact");
    drop(mat3);
    drop(mat2);

    let stats = stream.stats();
    assert_eq!(stats.lifo_violations, 1);
    assert_eq!(
        stats.stack_in_use, 0,
        "mat1 reclaimed once mat2 was released"
    );
    let again = pool.get_buffer::<u8>(1024, 1024)?;
    assert_eq!(again.device_ptr(), mat1_start);
    Ok(())
}

#[test]
fn strict_mode_reports_the_violation_and_still_reclaims() -> Result<(), PoolError> {
    each_device("strict_lifo", strict_lifo)
}

fn strict_lifo(device: &Device) -> Result<(), PoolError> {
    device.set_strict_lifo(true);
    let stream = Stream::new(device);
    device.set_strict_lifo(false);
    let stream = stream?;
    let pool = BufferPool::new(&stream);
    let mat1 = pool.get_buffer::<u8>(1024, 1024)?;
    let mat2 = pool.get_buffer::<u8>(1024, 1024)?;
    let err = mat1.release().unwrap_err();
    assert!(
        matches!(err, PoolError::LifoViolation { offset: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("reverse order"));
    mat2.release()?;
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}

#[test]
fn pitch_rules_match_opencv() -> Result<(), PoolError> {
    each_device("pitch_rules", pitch_rules)
}

fn pitch_rules(device: &Device) -> Result<(), PoolError> {
    let align = device.texture_alignment();
    // OpenCV's packing, asked for (the default starts every block on 256 bytes); the stream keeps
    // it, the shared device goes back to its own.
    let before = device.packing()?;
    device.set_packing(Packing::OpenCv);
    let stream = Stream::new(device);
    device.set_packing(before);
    let stream = stream?;
    let pool = BufferPool::new(&stream);
    let m = pool.get_buffer::<f32>(3, 100)?;
    assert_eq!(
        (m.step(), m.is_continuous()),
        (400usize.next_multiple_of(align), false)
    );
    let row = pool.get_buffer::<f32>(1, 100)?;
    assert_eq!((row.step(), row.is_continuous()), (400, true));
    let col = pool.get_buffer::<f32>(100, 1)?;
    assert_eq!((col.step(), col.is_continuous()), (4, true));
    // A row takes 400 bytes rounded to 64; the column starts right after it, as OpenCV's
    // `tip += size` puts it (a row or column block starts on 64 bytes, a 2D one on `align`).
    assert_eq!(col.device_ptr() - row.device_ptr(), 448);
    assert_eq!(row.device_ptr() % align as u64, 0, "it follows a 2D block");
    assert_eq!(m.device_ptr() % align as u64, 0);
    drop((col, row, m));
    // By default the column starts on the next 256 bytes.
    let stream = Stream::new(device)?;
    let pool = BufferPool::new(&stream);
    let row = pool.get_buffer::<f32>(1, 100)?;
    let col = pool.get_buffer::<f32>(100, 1)?;
    assert_eq!(col.device_ptr() - row.device_ptr(), 512);
    Ok(())
}

#[test]
fn buffers_round_trip_through_pitched_memory() -> Result<(), PoolError> {
    each_device("round_trip", round_trip)
}

fn round_trip(device: &Device) -> Result<(), PoolError> {
    let stream = Stream::new(device)?;
    let pool = BufferPool::new(&stream);
    let data: Vec<[u8; 3]> = (0..37 * 29).map(|i| [i as u8, (i >> 8) as u8, 7]).collect();
    let mut a = pool.get_buffer::<[u8; 3]>(37, 29)?;
    a.upload(&data)?;
    let mut b = pool.get_buffer::<[u8; 3]>(37, 29)?;
    b.copy_from(&a)?;
    assert_eq!(b.to_vec()?, data);
    // Fill patterns of 1, 2, 3 and 4 bytes take different paths on CUDA.
    let mut c = pool.get_buffer::<[u8; 3]>(37, 29)?;
    c.set_to([1, 2, 3])?;
    assert!(c.to_vec()?.iter().all(|&p| p == [1, 2, 3]));
    let mut d = pool.get_buffer::<u16>(5, 300)?;
    d.set_to(0xBEEF)?;
    assert!(d.to_vec()?.iter().all(|&v| v == 0xBEEF));
    let mut e = pool.get_buffer::<f32>(5, 300)?;
    e.set_to(-2.5)?;
    assert!(e.to_vec()?.iter().all(|&v| v == -2.5));
    if device.is_host() {
        let rows: Vec<&[[u8; 3]]> = b.host_rows()?.collect();
        assert_eq!(rows.len(), 37);
        assert_eq!(rows[1], &data[29..58]);
    } else {
        assert!(matches!(
            b.host_rows().err(),
            Some(PoolError::Unsupported { .. })
        ));
    }
    Ok(())
}
