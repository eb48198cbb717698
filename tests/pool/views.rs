//! Regions of interest and views: shape, step and bounds on every device; and buffers lent to
//! cudarc's own device-memory functions on the GPU.

use crate::common::each_device;
use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::prelude::*;

#[test]
fn a_region_keeps_its_parents_step_and_writes_only_inside() -> Result<(), PoolError> {
    each_device("roi", |device| {
        let stream = Stream::new(device)?;
        let pool = BufferPool::new(&stream);
        let mut image = pool.get_buffer::<u16>(6, 10)?;
        image.set_to(0)?;
        let step = image.step();
        {
            let window = image.roi(1..4, 2..7)?;
            assert_eq!((window.rows(), window.cols(), window.step()), (3, 5, step));
            assert_eq!(
                window.device_ptr(),
                image.device_ptr() + step as u64 + 2 * 2
            );
            assert!(!window.is_continuous());
        }
        // Fill the region: through the region on the host, through the whole image on a GPU.
        if device.is_host() {
            let mut region = image.roi_mut(1..4, 2..7)?;
            region.for_each_host_row_mut(|_, row| row.fill(7))?;
        } else {
            let mut whole = image.to_vec()?;
            for r in 1..4 {
                whole[r * 10 + 2..r * 10 + 7].fill(7);
            }
            image.upload(&whole)?;
        }
        let all = image.to_vec()?;
        for (i, &v) in all.iter().enumerate() {
            let (r, c) = (i / 10, i % 10);
            let inside = (1..4).contains(&r) && (2..7).contains(&c);
            assert_eq!(v, if inside { 7 } else { 0 }, "({r}, {c})");
        }
        // Regions of regions, row ranges, and an empty region.
        let inner = image.roi(1..4, 2..7)?.roi(1..2, 1..3)?;
        assert_eq!(inner.device_ptr(), image.roi(2..3, 3..5)?.device_ptr());
        let rows = image.row_range(2..5)?;
        assert_eq!((rows.rows(), rows.cols()), (3, 10));
        let empty = image.roi(3..3, 0..10)?;
        assert!(empty.is_empty());
        if device.is_host() {
            assert_eq!(empty.host_rows()?.count(), 0);
            let sum: u32 = image
                .roi(1..4, 2..7)?
                .host_rows()?
                .flatten()
                .map(|&v| u32::from(v))
                .sum();
            assert_eq!(sum, 7 * 15);
        }
        Ok(())
    })
}

#[test]
fn a_region_past_the_edge_is_an_error() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let mut image = BufferPool::new(&stream).get_buffer::<u8>(4, 8)?;
    for (rows, cols, what) in [
        (0..5, 0..8, "rows"),
        (0..4, 0..9, "cols"),
        (std::ops::Range { start: 3, end: 2 }, 0..8, "rows"),
        (0..4, 9..9, "cols"),
        (usize::MAX..usize::MAX, 0..1, "rows"),
    ] {
        let err = image.roi(rows.clone(), cols.clone()).unwrap_err();
        assert!(
            matches!(err, PoolError::OutOfBounds { what: w, .. } if w == what),
            "{rows:?} x {cols:?}: {err}"
        );
        assert!(image.roi_mut(rows, cols).is_err());
    }
    assert!(image.row_range(2..5).is_err());
    let err = image.as_1d().unwrap_err();
    assert!(matches!(err, PoolError::NotContinuous { .. }), "{err}");
    assert!(err.to_string().contains("buffer!(len; T)"), "{err}");
    Ok(())
}

#[test]
fn a_continuous_buffer_is_one_row() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let pool = BufferPool::new(&stream);
    let mut line = pool.get_buffer_1d::<f32>(100)?;
    line.as_1d_mut()?.for_each_host_row_mut(|r, row| {
        assert_eq!((r, row.len()), (0, 100));
        row.iter_mut().enumerate().for_each(|(i, v)| *v = i as f32);
    })?;
    let flat = line.as_1d()?;
    assert_eq!((flat.rows(), flat.cols(), flat.len()), (1, 100, 100));
    // A column is continuous too: one element a row.
    let column = pool.get_buffer::<u32>(7, 1)?;
    assert_eq!(column.as_1d()?.cols(), 7);
    // Views of views keep their bounds.
    let tail = line.roi(0..1, 90..100)?;
    assert_eq!(tail.host_rows()?.next().map(|r| r[0]), Some(90.0));
    assert!(tail.roi(0..1, 0..11).is_err());
    Ok(())
}

#[pooled(stream)]
fn halves(stream: &Stream, n: usize) -> Result<(u8, u8), PoolError> {
    let mut both = buffer!(2, n; u8)?;
    both.set_to(1)?;
    both.row_range_mut(1..2)?
        .for_each_host_row_mut(|_, row| row.fill(2))?;
    let top: u8 = both
        .row_range(0..1)?
        .host_rows()?
        .flatten()
        .copied()
        .max()
        .unwrap_or(0);
    let bottom: u8 = both
        .roi(1..2, 0..n)?
        .host_rows()?
        .flatten()
        .copied()
        .max()
        .unwrap_or(0);
    Ok((top, bottom))
}

#[test]
fn regions_of_dsl_buffers() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    assert_eq!(halves(&stream, 33)?, (1, 2));
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}

#[cfg(feature = "cuda")]
#[test]
fn buffers_lent_to_cudarc_need_a_cuda_stream() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let mut b = BufferPool::new(&stream).get_buffer_1d::<f32>(8)?;
    assert!(matches!(b.as_cudarc(), Err(PoolError::Unsupported { .. })));
    assert!(matches!(
        b.as_cudarc_mut(),
        Err(PoolError::Unsupported { .. })
    ));
    Ok(())
}

#[cfg(feature = "cuda")]
#[test]
fn cudarc_copies_pool_buffers_and_regions() -> Result<(), Box<dyn std::error::Error>> {
    use gpu_pool::interop::cudarc::driver::DeviceSlice;
    let Some((gpu, _lock)) = crate::common::gpu("as_cudarc") else {
        return Ok(());
    };
    let stream = Stream::new(&gpu)?;
    let other = Stream::new(&gpu)?;
    let cuda = stream.cudarc().expect("CUDA").clone();
    let pool = BufferPool::new(&stream);
    let values: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let mut src = pool.get_buffer_1d::<f32>(1000)?;
    src.upload(&values)?;
    // cudarc's own copy, into a pool buffer and back out.
    let mut dst = pool.get_buffer_1d::<f32>(1000)?;
    cuda.memcpy_dtod(&src.as_cudarc()?, &mut dst.as_cudarc_mut()?)?;
    assert_eq!(cuda.clone_dtoh(&dst.as_cudarc()?)?, values);
    // A pitched buffer is lent as the run from its first element to its last, step included.
    let mut image = pool.get_buffer::<f32>(4, 100)?;
    image.set_to(2.5)?;
    let lent = image.as_cudarc()?;
    assert_eq!(
        (lent.ld(), lent.len()),
        (image.step() / 4, 3 * (image.step() / 4) + 100)
    );
    let row = image.roi(2..3, 10..20)?;
    assert_eq!(cuda.clone_dtoh(&row.as_cudarc()?)?, vec![2.5; 10]);
    // On another stream: that stream waits for this one's queued work first.
    let other_cuda = other.cudarc().expect("CUDA").clone();
    let mut late = pool.get_buffer_1d::<f32>(1000)?;
    late.set_to(4.0)?;
    let seen = other_cuda.clone_dtoh(&late.as_cudarc()?)?;
    assert!(
        seen.iter().all(|&v| v == 4.0),
        "the other stream saw the fill"
    );
    println!("as_cudarc: cudarc copies of pool buffers and regions, on two streams, all correct");
    Ok(())
}

/// A zero-sized element type aligned to 4: its slices still need an aligned (dangling) address.
#[derive(Clone, Copy, Debug, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C)]
struct Nothing([u32; 0]);

#[test]
fn zero_sized_elements_have_rows_regions_and_callbacks_of_their_shape() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let pool = BufferPool::new(&stream);
    let mut unit = pool.get_buffer::<()>(3, 4)?;
    let lens: Vec<usize> = unit.host_rows()?.map(<[()]>::len).collect();
    assert_eq!(lens, [4, 4, 4], "3 rows of 4");
    let lens: Vec<usize> = unit
        .roi(1..3, 1..4)?
        .host_rows()?
        .map(<[()]>::len)
        .collect();
    assert_eq!(lens, [3, 3], "a region's rows x cols");
    assert_eq!(unit.roi(1..1, 0..4)?.host_rows()?.count(), 0);
    assert_eq!(
        unit.roi(0..2, 2..2)?
            .host_rows()?
            .map(<[()]>::len)
            .sum::<usize>(),
        0
    );
    let mut calls = Vec::new();
    unit.for_each_host_row_mut(|r, row| calls.push((r, row.len())))?;
    assert_eq!(calls, [(0, 4), (1, 4), (2, 4)]);
    calls.clear();
    unit.roi_mut(0..2, 1..4)?
        .for_each_host_row_mut(|r, row| calls.push((r, row.len())))?;
    assert_eq!(calls, [(0, 3), (1, 3)]);

    let mut aligned = GpuMat::<Nothing>::new(&stream, 3, 4)?;
    for row in aligned.host_rows()? {
        assert_eq!(row.len(), 4);
        assert_eq!(row.as_ptr() as usize % 4, 0, "aligned for the type");
    }
    let mut n = 0;
    aligned.for_each_host_row_mut(|_, row| n += row.len())?;
    assert_eq!(n, 12);
    // One row or column, as 1D.
    assert_eq!(
        pool.get_buffer_1d::<()>(5)?
            .host_rows()?
            .map(<[()]>::len)
            .collect::<Vec<_>>(),
        [5]
    );
    assert_eq!(pool.get_buffer::<()>(5, 1)?.host_rows()?.count(), 5);
    assert_eq!(stream.stats().stack_in_use, 0, "no memory for no bytes");
    Ok(())
}
