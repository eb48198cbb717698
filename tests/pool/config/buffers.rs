//! Buffers themselves: bad and empty sizes, long-lived driver buffers, and moving a stream across
//! threads.

use crate::common::each_device;
use gpu_pool::GpuRead;
use gpu_pool::GpuWrite;
use gpu_pool::{
    Device, PoolError, Source, Stream, compat::opencv::BufferPool, compat::opencv::GpuMat,
    config::Fallback,
};

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

/// `Device::footprint` is the rule takes follow: a stack of exactly the footprints (each start
/// rounded up to its alignment) holds the buffers with no fallback, and each buffer sits at the
/// offset the footprints predict, with the predicted step.
#[test]
fn footprints_predict_what_takes_use() -> Result<(), PoolError> {
    each_device("footprints", footprints)
}

fn footprints(device: &Device) -> Result<(), PoolError> {
    let shapes = [
        (1, 100),
        (100, 1),
        (480, 640),
        (3, 5),
        (1, 1),
        (7, 333),
        (0, 9),
    ];
    let stream = Stream::new(device)?;
    let pool = BufferPool::new(&stream);
    let mut top: usize = 0;
    let mut held = Vec::new();
    for (rows, cols) in shapes {
        let f = device.footprint::<[u8; 3]>(rows, cols)?;
        let buffer = pool.get_buffer::<[u8; 3]>(rows, cols)?;
        if rows * cols == 0 {
            assert_eq!(buffer.source(), Source::Empty);
            continue;
        }
        let start = top.next_multiple_of(f.align);
        let base = stream.stack_range().expect("a stack").start;
        assert_eq!(
            (buffer.device_ptr() - base, buffer.step()),
            (start as u64, f.step),
            "{rows}x{cols}: {f:?}"
        );
        top = start + f.bytes;
        assert_eq!(stream.stats().stack_in_use, top, "{rows}x{cols}: {f:?}");
        held.push(buffer);
    }
    let err = device.footprint::<u64>(usize::MAX, 2).unwrap_err();
    assert!(matches!(err, PoolError::SizeOverflow { .. }), "{err}");
    #[repr(align(8192))]
    struct Huge;
    let err = device.footprint::<Huge>(1, 1).unwrap_err();
    assert!(
        matches!(err, PoolError::UnsupportedAlignment { .. }),
        "{err}"
    );
    Ok(())
}

/// `cuda_or_host_with_reason` says why it is the host: without a driver, the error `Device::cuda`
/// gives; with a GPU, no reason and a CUDA device.
#[test]
fn the_host_fallback_says_why() {
    let (device, why) = Device::cuda_or_host_with_reason();
    match Device::cuda(0) {
        Ok(gpu) => assert_eq!((device, why), (gpu, None)),
        Err(e) => {
            assert!(device.is_host());
            assert_eq!(why.as_ref().map(ToString::to_string), Some(e.to_string()));
        }
    }
}
