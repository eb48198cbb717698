//! Buffers themselves: bad and empty sizes, long-lived driver buffers, and moving a stream across
//! threads.

use crate::common::each_device;
use gpu_pool::{BufferPool, Device, Fallback, GpuMat, PoolError, Source, Stream};

use super::private;

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
