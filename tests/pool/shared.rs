//! Memory no stream owns (`SharedMat`) and the one parameter type every buffer satisfies
//! (`GpuRead` / `GpuWrite`), on the host backend. The GPU ordering is tested in `cuda.rs`.

use std::sync::Arc;

use gpu_pool::prelude::*;
use gpu_pool::{DeviceId, SharedRead};

/// `out = src + 1`, written once over the traits, CPU twin of a kernel (host backend).
fn add_one(src: &impl GpuRead<u32>, out: &mut impl GpuWrite<u32>) -> Result<(), PoolError> {
    let values: Vec<u32> = src.to_vec()?.iter().map(|v| v + 1).collect();
    out.upload(&values)
}

#[pooled(stream)]
fn through_a_temporary(
    stream: &Stream,
    src: &impl GpuRead<u32>,
    out: &mut impl GpuWrite<u32>,
) -> Result<(), PoolError> {
    let mut tmp = buffer!(src.rows(), src.cols(); u32)?;
    add_one(src, &mut tmp)?; // a handle, as an output
    add_one(&tmp, out) // and as an input
}

#[test]
fn one_function_takes_a_gpu_mat_a_handle_a_region_and_shared_memory() -> Result<(), PoolError> {
    let device = Device::host();
    let stream = Stream::new(&device)?;
    let src = GpuMat::from_host(&stream, 2, 3, &[0u32, 1, 2, 3, 4, 5])?;
    let expected: Vec<u32> = (2..8).collect();

    let mut mat = GpuMat::<u32>::new(&stream, 2, 3)?;
    through_a_temporary(&stream, &src, &mut mat)?;
    assert_eq!(mat.to_vec()?, expected);

    let mut batch = GpuMat::<u32>::new(&stream, 5, 3)?;
    batch.set_to(9)?;
    through_a_temporary(&stream, &src, &mut batch.row_range_mut(1..3)?)?;
    let rows = batch.to_vec()?;
    assert_eq!(&rows[3..9], &expected[..], "rows 1 and 2 filled");
    assert!(
        rows[..3].iter().chain(&rows[9..]).all(|&v| v == 9),
        "the other rows kept"
    );

    let mut shared = SharedMat::<u32>::new(&device, 2, 3)?;
    through_a_temporary(&stream, &src, &mut shared.write(&stream)?)?;
    assert_eq!(shared.read(&stream)?.to_vec()?, expected);

    // Shared memory as the input, a region as the input.
    let mut again = GpuMat::<u32>::new(&stream, 2, 3)?;
    through_a_temporary(&stream, &shared.read(&stream)?, &mut again)?;
    assert_eq!(again.to_vec()?, (4..10).collect::<Vec<_>>());
    let mut col = GpuMat::<u32>::new(&stream, 2, 1)?;
    through_a_temporary(&stream, &src.roi(0..2, 1..2)?, &mut col)?;
    assert_eq!(col.to_vec()?, [3, 6]);
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}

#[test]
fn views_upload_download_fill_and_copy_without_touching_their_neighbours() -> Result<(), PoolError>
{
    let stream = Stream::new(&Device::host())?;
    let pool = BufferPool::new(&stream);
    let mut image = pool.get_buffer::<u16>(4, 5)?;
    image.set_to(0)?;
    image.roi_mut(1..3, 1..4)?.upload(&[1, 2, 3, 4, 5, 6])?;
    image.roi_mut(3..4, 0..2)?.set_to(7)?;
    assert_eq!(
        image.to_vec()?,
        [0, 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 4, 5, 6, 0, 7, 7, 0, 0, 0]
    );
    assert_eq!(image.roi(1..3, 2..4)?.to_vec()?, [2, 3, 5, 6]);

    let mut other = pool.get_buffer::<u16>(2, 2)?;
    other.copy_from(&image.roi(1..3, 2..4)?)?;
    assert_eq!(other.to_vec()?, [2, 3, 5, 6]);
    image.roi_mut(0..2, 3..5)?.copy_from(&other)?;
    assert_eq!(
        image.row_range(0..2)?.to_vec()?,
        [0, 0, 0, 2, 3, 0, 1, 2, 5, 6]
    );

    // Wrong lengths and shapes are errors, and write nothing.
    let before = image.to_vec()?;
    assert!(matches!(
        image.roi_mut(0..1, 0..2)?.upload(&[1, 2, 3]),
        Err(PoolError::ShapeMismatch {
            expected: 2,
            actual: 3
        })
    ));
    assert!(matches!(
        image.roi_mut(0..1, 0..2)?.copy_from(&other),
        Err(PoolError::DimensionMismatch {
            dst: (1, 2),
            src: (2, 2)
        })
    ));
    let mut out = [0u16; 3];
    assert!(image.roi(0..1, 0..2)?.download(&mut out).is_err());
    assert_eq!(image.to_vec()?, before);
    Ok(())
}

#[test]
fn a_mix_memory_view_has_no_stream_and_its_copies_say_what_to_use() -> Result<(), PoolError> {
    let device = Device::host();
    let mut mix = gpu_pool::MixMemory::new(&device)?;
    let mut view = mix.gpu_view_mut::<u32>(4)?;
    assert!(view.stream().is_none());
    let error = view.upload(&[1, 2, 3, 4]).unwrap_err();
    assert!(matches!(error, PoolError::Unsupported { .. }), "{error}");
    assert!(error.to_string().contains("no stream"), "{error}");
    Ok(())
}

#[test]
fn shared_memory_is_written_on_one_stream_and_read_on_others_on_other_threads()
-> Result<(), PoolError> {
    let device = Device::host();
    let loader = Stream::new(&device)?;
    let weights: Vec<f32> = (0..64 * 48).map(|i| i as f32).collect();
    let shared = Arc::new(SharedMat::from_host(&loader, 64, 48, &weights)?);
    assert_eq!((shared.rows(), shared.cols()), (64, 48));
    assert_eq!(shared.step(), 512, "pitched like a GpuMat::new");
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let (device, shared) = (device.clone(), Arc::clone(&shared));
            std::thread::spawn(move || -> Result<f32, PoolError> {
                let stream = Stream::new(&device)?;
                let w_row = shared.read(&stream)?;
                let mut mine = BufferPool::new(&stream).get_buffer::<f32>(1, 48)?;
                mine.copy_from(&w_row.row_range(w..w + 1)?)?;
                Ok(mine.to_vec()?.iter().sum())
            })
        })
        .collect();
    for (w, worker) in workers.into_iter().enumerate() {
        let expected: f32 = weights[w * 48..(w + 1) * 48].iter().sum();
        assert_eq!(worker.join().expect("no panic")?, expected);
    }
    Ok(())
}

#[test]
fn shared_memory_is_one_counted_allocation_freed_once() -> Result<(), PoolError> {
    let device = Device::private_host();
    let stream = Stream::new(&device)?;
    let before = device.stats();
    let shared = SharedMat::<u8>::new(&device, 3, 700)?;
    let after = device.stats();
    assert_eq!(after.driver_alloc_calls - before.driver_alloc_calls, 1);
    {
        let read = shared.read(&stream)?;
        assert_eq!(read.to_vec()?.len(), 2100);
    }
    drop(shared);
    let freed = device.stats();
    assert_eq!(freed.driver_free_calls - before.driver_free_calls, 1);
    // No rows or no columns: nothing allocated, and every access works.
    let mut empty = SharedMat::<u64>::new(&device, 0, 5)?;
    empty.write(&stream)?.upload(&[])?;
    assert!(empty.read(&stream)?.to_vec()?.is_empty());
    assert_eq!(device.stats().driver_alloc_calls, freed.driver_alloc_calls);
    Ok(())
}

#[test]
fn shared_memory_refuses_another_devices_stream_and_over_aligned_types() -> Result<(), PoolError> {
    let (a, b) = (Device::private_host(), Device::private_host());
    let on_b = Stream::new(&b)?;
    let mut shared = SharedMat::<u32>::new(&a, 2, 2)?;
    let DeviceId::Host(_) = a.id() else {
        unreachable!("a host device")
    };
    assert!(matches!(
        shared.read(&on_b).map(|_| ()),
        Err(PoolError::DeviceMismatch { .. })
    ));
    assert!(matches!(
        shared.write(&on_b).map(|_| ()),
        Err(PoolError::DeviceMismatch { .. })
    ));

    #[derive(Clone, Copy)]
    #[repr(C, align(1024))]
    struct Huge([u8; 1024]);
    // SAFETY: plain bytes, no padding (1024 bytes at alignment 1024).
    unsafe impl bytemuck::Zeroable for Huge {}
    // SAFETY: as above.
    unsafe impl bytemuck::Pod for Huge {}
    assert!(matches!(
        SharedMat::<Huge>::new(&a, 1, 1),
        Err(PoolError::UnsupportedAlignment { .. })
    ));
    Ok(())
}

/// The guards are what a kernel launch or a copy borrows; the read guard is also readable where
/// a `GpuView` is wanted.
#[test]
fn a_read_guard_lends_views_and_regions() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    let shared = SharedMat::from_host(&stream, 3, 3, &[1u8, 2, 3, 4, 5, 6, 7, 8, 9])?;
    let read: SharedRead<'_, u8> = shared.read(&stream)?;
    let view: GpuView<'_, u8> = read.view();
    assert_eq!(view.stream().map(Stream::id), Some(stream.id()));
    let diagonal: Vec<u8> = (0..3)
        .map(|i| {
            read.roi(i..i + 1, i..i + 1)
                .and_then(|r| r.to_vec())
                .map(|v| v[0])
        })
        .collect::<Result<_, _>>()?;
    assert_eq!(diagonal, [1, 5, 9]);
    assert_eq!(read.host_rows()?.flatten().copied().max(), Some(9));
    Ok(())
}
