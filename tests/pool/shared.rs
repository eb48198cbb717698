//! Memory no stream owns (`SharedMat`) and the one parameter type every buffer satisfies
//! (`GpuRead` / `GpuWrite`), on the host backend. The GPU ordering is tested in `cuda.rs`.

use std::sync::Arc;

use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::prelude::*;
use gpu_pool::{DeviceId, shared::SharedRead};

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
    let mut mix = gpu_pool::compat::mix::MixMemory::new(&device)?;
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

/// What the traits must not take away: a handle's `stream()` is still its `&Stream`, regions of
/// temporary views can be kept, and the traits work as `dyn`.
#[test]
fn handles_regions_and_dyn_keep_working_with_the_traits() -> Result<(), PoolError> {
    #[pooled(stream)]
    fn kept_region(stream: &Stream) -> Result<Vec<u8>, PoolError> {
        let mut batch = buffer!(8, 4; u8)?;
        let own: &Stream = batch.stream();
        assert_eq!(own.id(), stream.id());
        batch.set_to(0)?;
        let mut window = batch.row_range_mut(2..6)?.into_roi_mut(0..2, 1..3)?;
        window.set_to(5)?;
        let corner = batch.view_mut().into_view().roi(2..3, 1..2)?;
        corner.to_vec()
    }
    fn elements(memory: &dyn GpuRead<u8>) -> usize {
        memory.len()
    }
    let stream = Stream::new(&Device::host())?;
    assert_eq!(kept_region(&stream)?, [5]);
    let mat = GpuMat::<u8>::new(&stream, 3, 7)?;
    let region = mat.roi(0..2, 0..2)?;
    assert_eq!([elements(&mat), elements(&region)], [21, 4]);
    Ok(())
}

/// Packed 2D buffers: rows back to back, from the stack, the driver and shared memory alike.
#[test]
fn packed_buffers_have_no_padding_between_rows() -> Result<(), PoolError> {
    #[pooled(stream)]
    fn logits(stream: &Stream, batch: usize) -> Result<(usize, bool, Vec<f32>), PoolError> {
        let mut scores = buffer!(batch, 10; f32, packed)?;
        scores.set_to(0.5)?;
        scores.row_range_mut(1..2)?.set_to(2.0)?;
        let flat = scores.as_1d()?.to_vec()?; // one run: no padding to skip
        Ok((scores.step(), scores.is_continuous(), flat))
    }
    let device = Device::private_host();
    let stream = Stream::new(&device)?;
    let (step, continuous, flat) = logits(&stream, 256)?;
    assert_eq!((step, continuous), (40, true));
    assert_eq!(flat.len(), 2560);
    assert_eq!(flat.iter().filter(|&&v| v == 2.0).count(), 10);
    let ((), sizing) = stream.measure(|s| {
        let _ = BufferPool::new(s).get_buffer_packed::<f32>(256, 10);
    });
    assert_eq!(
        sizing.stack_bytes, 10240,
        "256 x 10 x 4 bytes, not 256 x 512"
    );

    let long = GpuMat::<u16>::new_packed(&stream, 3, 5)?;
    assert_eq!((long.rows(), long.cols(), long.step()), (3, 5, 10));
    let mut weights = SharedMat::<f32>::new_packed(&device, 4, 3)?;
    weights.write(&stream)?.upload(&[1.0; 12])?;
    assert_eq!(weights.step(), 12);
    assert_eq!(weights.read(&stream)?.as_1d()?.to_vec()?, [1.0; 12]);

    // Sizes that overflow are errors; empty shapes are empty.
    assert!(matches!(
        BufferPool::new(&stream).get_buffer_packed::<u64>(usize::MAX / 4, 4),
        Err(PoolError::SizeOverflow { .. })
    ));
    assert!(
        BufferPool::new(&stream)
            .get_buffer_packed::<u8>(0, 7)?
            .is_empty()
    );
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}

/// A guard that is forgotten never ends its access: the next conflicting access waits for its
/// stream instead, and nothing is lost.
#[test]
fn a_forgotten_guard_does_not_leave_the_memory_unordered() -> Result<(), PoolError> {
    let device = Device::private_host();
    let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
    let mut shared = SharedMat::from_host(&a, 1, 4, &[1u8, 2, 3, 4])?;
    std::mem::forget(shared.read(&b)?);
    shared.write(&a)?.set_to(5)?;
    std::mem::forget(shared.write(&b)?);
    assert_eq!(shared.read(&a)?.to_vec()?, [5; 4]);
    drop(shared);
    assert_eq!(
        device.stats().driver_free_calls,
        1,
        "freed once, at the drop"
    );
    Ok(())
}

/// The cross-stream order on a GPU: each test holds one stream back with a spinning kernel, so a
/// missing wait shows as stale or clobbered bytes.
#[cfg(feature = "cuda")]
mod gpu {
    use std::error::Error;
    use std::sync::Arc;

    use gpu_pool::CaptureError;
    use gpu_pool::compat::opencv::{BufferPool, GpuMat};
    use gpu_pool::interop::cudarc::driver::CudaStream;
    use gpu_pool::prelude::*;

    use crate::common::gpu;
    use crate::common::kernels::{self, Kernels};
    use crate::cuda::{count_not, stall};

    type TestResult = Result<(), Box<dyn Error>>;
    const N: usize = 4 << 20;

    #[test]
    fn a_read_on_another_stream_waits_for_the_last_write() -> TestResult {
        let Some((device, _lock)) = gpu("shared_read_after_write") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&a, 1, 2)?;
        let mut shared = SharedMat::<u8>::new(&device, 1, N)?;
        shared.write(&a)?.set_to(1)?;
        a.synchronize()?;
        stall(&a, &k, &tick)?;
        shared.write(&a)?.set_to(2)?; // queued behind the stall
        let mut seen = BufferPool::new(&b).get_buffer_1d::<u8>(N)?;
        seen.copy_from(&shared.read(&b)?)?; // on b: must wait for a's write
        let stale = count_not(&seen.to_vec()?, 2);
        println!("shared read on another stream after a pending write: {stale} of {N} bytes stale");
        assert_eq!(stale, 0);

        // The control: the same read queued on b with no access on b (the address of a's), so
        // nothing orders it after the write. It must see stale bytes, or the test shows nothing.
        stall(&a, &k, &tick)?;
        shared.write(&a)?.set_to(3)?;
        let address = shared.read(&a)?.device_ptr();
        let cs = b.cudarc().expect("a CUDA stream");
        // SAFETY: both ranges are N live bytes of this context (`seen` and `shared`, which outlive
        // the synchronize below); the race on `shared`'s bytes is the point, and only reads them.
        unsafe {
            gpu_pool::interop::cudarc::driver::result::memcpy_dtod_async(
                seen.device_ptr(),
                address,
                N,
                cs.cu_stream(),
            )?
        };
        b.synchronize()?;
        let unordered = count_not(&seen.to_vec()?, 3);
        println!("the same read with no access on its stream: {unordered} of {N} bytes stale");
        assert!(
            unordered > 0,
            "the stall did not hold the write back: the test proves nothing"
        );
        a.synchronize()?;
        Ok(())
    }

    /// A stream's reads wait once for each write (later reads on it are after that wait already,
    /// and queue none): a new write on another stream is waited for again, and a write's event,
    /// recorded again by the next write, still orders the reads that waited on its first record.
    #[test]
    fn a_stream_that_waited_for_one_write_waits_for_the_next() -> TestResult {
        let Some((device, _lock)) = gpu("shared_waits_once_a_write") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&a, 1, 2)?;
        let mut shared = SharedMat::<u8>::new(&device, 1, N)?;
        let mut seen = GpuMat::<u8>::new(&b, 1, N)?;
        let mut stale = Vec::new();
        for value in 1..=3u8 {
            stall(&a, &k, &tick)?;
            shared.write(&a)?.set_to(value)?; // behind a's stall
            for _ in 0..3 {
                seen.copy_from(&shared.read(&b)?)?; // the first waits; the others need not
            }
            stale.push(count_not(&seen.to_vec()?, value));
        }
        println!("three writes, each read three times on another stream: stale bytes {stale:?}");
        assert_eq!(stale, [0, 0, 0]);
        Ok(())
    }

    #[test]
    fn a_write_waits_for_reads_queued_on_other_streams() -> TestResult {
        let Some((device, _lock)) = gpu("shared_write_after_read") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&b, 1, 2)?;
        let mut shared = SharedMat::<u8>::new(&device, 1, N)?;
        shared.write(&a)?.set_to(1)?;
        let mut copy = GpuMat::<u8>::new(&b, 1, N)?;
        stall(&b, &k, &tick)?;
        copy.copy_from(&shared.read(&b)?)?; // still queued on b ...
        shared.write(&a)?.set_to(3)?; // ... when a overwrites: a must wait for it
        let clobbered = count_not(&copy.to_vec()?, 1);
        println!(
            "shared write after a pending read on another stream: {clobbered} of {N} bytes clobbered"
        );
        assert_eq!(clobbered, 0);
        assert_eq!(count_not(&shared.read(&b)?.to_vec()?, 3), 0);

        // A copy on a third stream reading through b's guard is a read of that third stream too.
        let c = Stream::new(&device)?;
        let mut third = GpuMat::<u8>::new(&c, 1, N)?;
        let tick_c = GpuMat::<u8>::new(&c, 1, 2)?;
        stall(&c, &k, &tick_c)?;
        third.copy_from(&shared.read(&b)?)?; // queued on c, behind its stall
        shared.write(&a)?.set_to(4)?;
        let clobbered = count_not(&third.to_vec()?, 3);
        println!(
            "shared write after a pending cross-stream copy: {clobbered} of {N} bytes clobbered"
        );
        assert_eq!(clobbered, 0);

        // A read guard forgotten with its copy still queued: its end is never recorded, so the
        // write waits for its stream.
        stall(&b, &k, &tick)?;
        let read = shared.read(&b)?;
        copy.copy_from(&read)?;
        std::mem::forget(read);
        shared.write(&a)?.set_to(5)?;
        let clobbered = count_not(&copy.to_vec()?, 4);
        println!("shared write after a forgotten read guard: {clobbered} of {N} bytes clobbered");
        assert_eq!(clobbered, 0);
        Ok(())
    }

    #[test]
    fn a_captured_read_replays_after_the_write_and_later_writes_wait_for_the_replays() -> TestResult
    {
        let Some((device, _lock)) = gpu("shared_graph") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (s, a) = (Stream::new(&device)?, Stream::new(&device)?);
        let (tick_s, tick_a) = (GpuMat::<u8>::new(&s, 1, 2)?, GpuMat::<u8>::new(&a, 1, 2)?);
        let mut shared = SharedMat::<u8>::new(&device, 1, N)?;
        shared.write(&a)?.set_to(0)?;
        a.synchronize()?;
        stall(&a, &k, &tick_a)?;
        shared.write(&a)?.set_to(1)?; // pending when the capture reads it
        let mut out = GpuMat::<u8>::new(&s, 1, N)?;
        out.set_to(9)?;
        {
            let graph = s.capture(|s| {
                let weights = shared.read(s)?;
                let mut tmp = BufferPool::new(s).get_buffer_1d::<u8>(N)?;
                tmp.copy_from(&weights)?;
                out.copy_from(&tmp)
            })?;
            stall(&s, &k, &tick_s)?;
            for _ in 0..3 {
                graph.launch()?; // queued behind s's stall
            }
        } // the graph is dropped with its replays pending ...
        shared.write(&a)?.set_to(5)?; // ... so this write must wait for them
        let wrong = count_not(&out.to_vec()?, 1);
        println!(
            "graph replays reading shared memory, then a write on another stream: {wrong} of {N} bytes wrong"
        );
        assert_eq!(wrong, 0);
        assert_eq!(s.stats().stack_in_use, 0);
        Ok(())
    }

    #[test]
    fn shared_weights_serve_two_threads_and_cudarc() -> TestResult {
        let Some((device, _lock)) = gpu("shared_threads") else {
            return Ok(());
        };
        let loader = Stream::new(&device)?;
        let weights: Vec<f32> = (0..256 * 300).map(|i| (i % 1013) as f32).collect();
        let shared = Arc::new(SharedMat::from_host(&loader, 256, 300, &weights)?);
        let workers: Vec<_> = (0..2)
            .map(|w| {
                let (device, shared) = (device.clone(), Arc::clone(&shared));
                std::thread::spawn(move || -> Result<Vec<f32>, PoolError> {
                    let stream = Stream::new(&device)?;
                    let mut rows = BufferPool::new(&stream).get_buffer::<f32>(128, 300)?;
                    rows.copy_from(&shared.read(&stream)?.row_range(w * 128..(w + 1) * 128)?)?;
                    rows.to_vec()
                })
            })
            .collect();
        let mut joined = Vec::new();
        for worker in workers {
            joined.extend(worker.join().expect("no panic")?);
        }
        assert_eq!(joined, weights);

        // cudarc's own copy, on a stream of its own, through the read guard.
        let ctx = device.cudarc().expect("a CUDA device");
        let other: Arc<CudaStream> = ctx.new_stream()?;
        let read = shared.read(&loader)?;
        let host: Vec<f32> = other.clone_dtoh(&read.as_cudarc()?)?;
        assert_eq!(
            host.len(),
            255 * (read.step() / 4) + 300,
            "lent from the first element to the last"
        );
        let ld = read.step() / 4;
        assert!((0..256).all(|r| host[r * ld..r * ld + 300] == weights[r * 300..(r + 1) * 300]));
        Ok(())
    }

    #[test]
    fn shared_memory_refuses_what_would_break_a_capture() -> TestResult {
        let Some((device, _lock)) = gpu("shared_capture_seams") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        let mut shared = SharedMat::<u8>::new(&device, 1, 4096)?;
        shared.write(&stream)?.set_to(1)?;
        // Made inside a capture: refused before the driver is asked, and the capture goes on.
        let graph = stream.capture(|_| {
            let made = SharedMat::<u8>::new(&device, 1, 64).map(|_| ());
            assert!(
                matches!(
                    made,
                    Err(PoolError::Capture(CaptureError::Allocates { .. }))
                ),
                "{made:?}"
            );
            Ok(())
        })?;
        drop(graph);
        // A capture that cudarc began on the pool stream's CUDA stream: no access joins it.
        let cuda = stream.cudarc().expect("a CUDA stream");
        cuda.begin_capture(
            gpu_pool::interop::cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )?;
        let read = shared.read(&stream).map(|_| ());
        let write = shared.write(&stream).map(|_| ());
        let _ = cuda.end_capture(gpu_pool::interop::cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        println!("shared access on a stream captured by cudarc: read {read:?}, write {write:?}");
        assert!(matches!(
            read,
            Err(PoolError::Capture(CaptureError::Elsewhere { .. }))
        ));
        assert!(matches!(
            write,
            Err(PoolError::Capture(CaptureError::Elsewhere { .. }))
        ));
        assert_eq!(
            count_not(&shared.read(&stream)?.to_vec()?, 1),
            0,
            "usable after"
        );
        Ok(())
    }

    #[test]
    fn a_captured_write_is_waited_for_by_reads_after_the_graph() -> TestResult {
        let Some((device, _lock)) = gpu("shared_graph_write") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (s, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&s, 1, 2)?;
        let mut shared = SharedMat::<u8>::new(&device, 1, N)?;
        shared.write(&s)?.set_to(0)?;
        let source = GpuMat::from_host(&s, 1, N, &vec![6u8; N])?;
        {
            let graph = s.capture(|s| shared.write(s)?.copy_from(&source))?;
            stall(&s, &k, &tick)?;
            graph.launch()?; // pending behind the stall when the graph is dropped
        }
        let seen = shared.read(&b)?.to_vec()?; // on b: must wait for the replay
        let stale = count_not(&seen, 6);
        println!(
            "read on another stream after a dropped graph's pending write: {stale} of {N} bytes stale"
        );
        assert_eq!(stale, 0);
        Ok(())
    }

    #[test]
    fn kernels_read_and_write_shared_memory_through_its_guards() -> TestResult {
        let Some((device, _lock)) = gpu("shared_kernel_args") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let values: Vec<u8> = (0..300 * 500).map(|i| (i % 251) as u8).collect();
        let mut table = SharedMat::<u8>::new(&device, 300, 500)?;
        let source = GpuMat::from_host(&a, 300, 500, &values)?;
        {
            let mut w = table.write(&a)?;
            let cuda = a.cudarc().expect("a CUDA stream");
            // SAFETY: both are 300x500 u8 images on `a`'s device; `invert` writes only inside.
            unsafe { kernels::invert(&k, cuda, source.pitched(), w.pitched_mut())? };
        }
        // Read on another stream by a kernel launched there: after the write, by the events.
        let mut out = GpuMat::<u8>::new(&b, 300, 500)?;
        {
            let r = table.read(&b)?;
            let cuda = b.cudarc().expect("a CUDA stream");
            // SAFETY: as above, on `b`.
            unsafe { kernels::invert(&k, cuda, r.pitched(), out.pitched_mut())? };
        }
        let wrong = out
            .to_vec()?
            .iter()
            .zip(&values)
            .filter(|(o, v)| o != v)
            .count();
        println!(
            "invert twice through a shared table on two streams: {wrong} of {} wrong",
            values.len()
        );
        assert_eq!(wrong, 0);
        Ok(())
    }

    /// The guide's `RwLock<SharedMat>` pattern with a write guard still open (its kernel queued
    /// behind a stall) when a graph that captured a read of the same matrix is launched: the
    /// replay borrows no `SharedMat`, so nothing can order it after work not yet queued. It is
    /// refused, queues nothing, and runs in order once the guard is dropped. Plain graphs and
    /// family members take the same path.
    #[test]
    fn a_replay_is_refused_while_a_conflicting_guard_is_open() -> TestResult {
        let Some((device, _lock)) = gpu("shared_replay_open_write") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (s, w) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&w, 1, 2)?;
        let weights = std::sync::RwLock::new(SharedMat::<u8>::new(&device, 1, N)?);
        weights.write().unwrap().write(&w)?.set_to(1)?;
        let mut out = GpuMat::<u8>::new(&s, 1, N)?;
        let mut out_f = GpuMat::<u8>::new(&s, 1, N)?;
        let graph = s.capture(|s| out.copy_from(&weights.read().unwrap().read(s)?))?;
        let family = s.graph_family()?;
        let member = family.capture(|s| out_f.copy_from(&weights.read().unwrap().read(s)?))?;
        let launch_graph = || graph.launch();
        let launch_member = || member.launch();
        type Launch<'l> = &'l dyn Fn() -> Result<(), PoolError>;
        let launches: [(&str, Launch<'_>); 2] =
            [("graph", &launch_graph), ("family member", &launch_member)];
        for (name, launch) in launches {
            let mut lock = weights.write().unwrap();
            let mut write = lock.write(&w)?;
            stall(&w, &k, &tick)?;
            write.set_to(2)?; // queued behind the stall: half-done for about 0.1 s
            let refused = launch();
            println!("{name} replay reading while a write is open: {refused:?}");
            assert!(
                matches!(
                    refused,
                    Err(PoolError::Capture(CaptureError::SharedAccessOpen {
                        replay: "read",
                        open: "write",
                        ..
                    }))
                ),
                "{name}: a replay overtook an open write"
            );
            drop(write);
            drop(lock);
            launch()?; // after the write ended: ordered after it
            s.synchronize()?;
            weights.write().unwrap().write(&w)?.set_to(1)?;
        }
        drop((graph, member));
        drop(family);
        let (stale, stale_f) = (count_not(&out.to_vec()?, 2), count_not(&out_f.to_vec()?, 2));
        println!("replays after the write ended: {stale} and {stale_f} of {N} bytes stale");
        assert_eq!((stale, stale_f), (0, 0));

        // The control: the replay's copy queued with nothing ordering it after the open write
        // reads the half-done state, or the test shows nothing.
        let mut lock = weights.write().unwrap();
        let mut write = lock.write(&w)?;
        stall(&w, &k, &tick)?;
        write.set_to(3)?;
        let address = write.view().device_ptr();
        let cs = s.cudarc().expect("a CUDA stream");
        // SAFETY: both ranges are N live bytes of this context (`out` and the shared matrix,
        // which outlive the synchronize below); the race on the shared bytes is the point, and
        // this only reads them.
        unsafe {
            gpu_pool::interop::cudarc::driver::result::memcpy_dtod_async(
                out.device_ptr(),
                address,
                N,
                cs.cu_stream(),
            )?
        };
        s.synchronize()?;
        drop(write);
        drop(lock);
        let unordered = count_not(&out.to_vec()?, 3);
        println!("the replay's read with nothing ordering it: {unordered} of {N} bytes stale");
        assert!(
            unordered > 0,
            "the stall did not hold the write back: the test proves nothing"
        );
        w.synchronize()?;
        Ok(())
    }

    /// A read guard forgotten with its copy queued, then a graph that writes the memory: the
    /// replay is refused (it cannot tell a forgotten guard from a live one), where an eager write
    /// in its place waits for the forgotten read's stream; after that write the replay runs, in
    /// order.
    #[test]
    fn a_writing_replay_never_overtakes_a_forgotten_read() -> TestResult {
        let Some((device, _lock)) = gpu("shared_replay_forgotten_read") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (s, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&b, 1, 2)?;
        let shared = std::sync::RwLock::new(SharedMat::<u8>::new(&device, 1, N)?);
        shared.write().unwrap().write(&s)?.set_to(1)?;
        s.synchronize()?;
        let graph = s.capture(|s| shared.write().unwrap().write(s)?.set_to(7))?;
        let mut copy = GpuMat::<u8>::new(&b, 1, N)?;
        stall(&b, &k, &tick)?;
        let lock = shared.read().unwrap();
        let read = lock.read(&b)?;
        copy.copy_from(&read)?; // behind b's stall
        std::mem::forget(read);
        drop(lock);
        let refused = graph.launch();
        println!("writing replay after a forgotten read: {refused:?}");
        assert!(matches!(
            refused,
            Err(PoolError::Capture(CaptureError::SharedAccessOpen {
                replay: "write",
                open: "read",
                ..
            }))
        ));
        let clobbered = count_not(&copy.to_vec()?, 1);
        println!("the forgotten read's copy: {clobbered} of {N} bytes clobbered");
        assert_eq!(clobbered, 0);

        // An eager write in the replay's place waits for the forgotten read's stream, and ends
        // that access: the replay then runs, after it.
        stall(&b, &k, &tick)?;
        let lock = shared.read().unwrap();
        let read = lock.read(&b)?;
        copy.copy_from(&read)?;
        std::mem::forget(read);
        drop(lock);
        shared.write().unwrap().write(&s)?.set_to(5)?;
        let clobbered = count_not(&copy.to_vec()?, 1);
        graph.launch()?;
        s.synchronize()?;
        let replayed = count_not(&shared.read().unwrap().read(&s)?.to_vec()?, 7);
        println!(
            "an eager write after a forgotten read: {clobbered} of {N} bytes clobbered; the replay \
             after it: {replayed} bytes not written"
        );
        assert_eq!((clobbered, replayed), (0, 0));
        Ok(())
    }

    /// A read of weights nobody wrote since this stream's last read asks nothing of the driver:
    /// no event recorded, no wait queued (issue 30: the guide's server read five weights per
    /// request, and each guard's end recorded an event). The control is the read after a write,
    /// which must wait on the GPU.
    #[test]
    fn a_read_of_unchanged_weights_asks_the_driver_nothing() -> TestResult {
        let Some((device, _lock)) = gpu("shared_read_calls") else {
            return Ok(());
        };
        let (loader, worker) = (Stream::new(&device)?, Stream::new(&device)?);
        let mut weights = SharedMat::<f32>::from_host(&loader, 64, 64, &[0.5; 64 * 64])?;
        let mut out = GpuMat::<f32>::new(&worker, 64, 64)?;
        out.copy_from(&weights.read(&worker)?)?; // waits for the upload, once
        let before = gpu_pool::observe::DriverCalls::on_this_thread();
        for _ in 0..100 {
            let w = weights.read(&worker)?;
            out.copy_from(&w)?;
        }
        let calls = gpu_pool::observe::DriverCalls::on_this_thread().since(before);
        println!("100 reads of unchanged weights, each with a copy: {calls:?}");
        assert_eq!((calls.event_records, calls.stream_waits), (0, 0));
        assert_eq!(calls.copies, 100);

        weights.write(&loader)?.set_to(0.25)?;
        let before = gpu_pool::observe::DriverCalls::on_this_thread();
        out.copy_from(&weights.read(&worker)?)?;
        let calls = gpu_pool::observe::DriverCalls::on_this_thread().since(before);
        println!("the read after a write: {calls:?}");
        assert_eq!(
            calls.stream_waits, 1,
            "a read after a write waits for it on the GPU"
        );
        assert!(out.to_vec()?.iter().all(|&v| v == 0.25));
        Ok(())
    }

    /// Reads end with a ticket of their stream, not an event: a write that comes while a read's
    /// work is still queued (behind a stall, never synchronized) waits for it on the host, and
    /// from then on the memory's reads record events, so the next such write waits on the GPU
    /// alone. Both writes leave the reads' copies whole. The control: the same copy, with the
    /// write queued on another stream with nothing ordering it, is clobbered.
    #[test]
    fn a_write_waits_for_reads_whose_stream_has_not_synchronized() -> TestResult {
        let Some((device, _lock)) = gpu("shared_write_after_ticket_read") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (s, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&b, 1, 2)?;
        let mut shared = SharedMat::<u8>::new(&device, 1, N)?;
        let mut copy = GpuMat::<u8>::new(&b, 1, N)?;
        let mut outcomes = Vec::new();
        for round in 0..2u8 {
            shared.write(&s)?.set_to(1)?;
            s.synchronize()?;
            stall(&b, &k, &tick)?;
            copy.copy_from(&shared.read(&b)?)?; // behind b's stall; b never synchronizes
            let before = gpu_pool::observe::DriverCalls::on_this_thread();
            shared.write(&s)?.set_to(2 + round)?;
            let calls = gpu_pool::observe::DriverCalls::on_this_thread().since(before);
            let clobbered = count_not(&copy.to_vec()?, 1);
            println!(
                "write {round} after an unsynchronized read: {clobbered} of {N} bytes of the                  read clobbered; host waits {}, GPU waits {}",
                calls.host_waits, calls.stream_waits
            );
            outcomes.push((clobbered, calls.host_waits > 0, calls.stream_waits > 0));
        }
        assert_eq!(outcomes, [(0, true, false), (0, false, true)]);

        // The control: no ordering at all.
        shared.write(&s)?.set_to(1)?;
        s.synchronize()?;
        stall(&b, &k, &tick)?;
        let read = shared.read(&b)?;
        copy.copy_from(&read)?;
        let raw = read.device_ptr();
        drop(read);
        let cs = s.cudarc().expect("CUDA");
        // SAFETY: N bytes of live shared memory; the race with b's queued copy is this control's
        // point (it shows the ordering above is what keeps the copy whole).
        unsafe {
            gpu_pool::interop::cudarc::driver::result::memset_d8_async(raw, 9, N, cs.cu_stream())
        }?;
        let clobbered = count_not(&copy.to_vec()?, 1);
        println!("the control, a write ordered by nothing: {clobbered} of {N} bytes clobbered");
        assert!(clobbered > 0);
        Ok(())
    }

    /// A download into pageable memory returns with the copy done, and so with the stream's
    /// earlier work done: a read ended before it needs no wait from a later write.
    #[test]
    fn a_download_covers_the_reads_before_it() -> TestResult {
        let Some((device, _lock)) = gpu("shared_download_covers") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (s, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&b, 1, 2)?;
        let mut shared = SharedMat::<u8>::new(&device, 1, N)?;
        shared.write(&s)?.set_to(1)?;
        let mut copy = GpuMat::<u8>::new(&b, 1, N)?;
        stall(&b, &k, &tick)?;
        copy.copy_from(&shared.read(&b)?)?;
        let mut host = vec![0u8; N];
        copy.download(&mut host)?; // behind the stall: returns once it is done
        let before = gpu_pool::observe::DriverCalls::on_this_thread();
        shared.write(&s)?.set_to(2)?;
        let calls = gpu_pool::observe::DriverCalls::on_this_thread().since(before);
        let wrong = count_not(&host, 1);
        println!(
            "downloaded behind a stall: {wrong} of {N} bytes wrong; the write after: {calls:?}"
        );
        assert_eq!(wrong, 0);
        assert_eq!((calls.host_waits, calls.stream_waits), (0, 0));
        Ok(())
    }

    /// A read guard begun before a capture of its stream and dropped inside it: its eager work
    /// (queued before the capture) has no end event, so the access stays open, and a write on
    /// another stream waits for the stream instead of overtaking the read.
    #[test]
    fn a_guard_begun_before_a_capture_and_dropped_inside_it_stays_ordered() -> TestResult {
        let Some((device, _lock)) = gpu("shared_guard_into_capture") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (s, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&s, 1, 2)?;
        let mut shared = SharedMat::<u8>::new(&device, 1, N)?;
        shared.write(&b)?.set_to(1)?;
        b.synchronize()?;
        let mut copy = GpuMat::<u8>::new(&s, 1, N)?;
        let read = shared.read(&s)?;
        stall(&s, &k, &tick)?;
        copy.copy_from(&read)?; // eager, behind the stall
        let graph = s.capture(move |_| {
            drop(read);
            Ok(())
        })?;
        drop(graph);
        shared.write(&b)?.set_to(2)?;
        let clobbered = count_not(&copy.to_vec()?, 1);
        println!(
            "a write after a read guard dropped inside a capture: {clobbered} of {N} bytes clobbered"
        );
        assert_eq!(clobbered, 0);
        Ok(())
    }

    /// A graph's replays are accesses of their own: writes made while the graph lives (through an
    /// `RwLock`, which the capture held only while it recorded) wait for the replays queued
    /// before them, and replays wait for the writes queued before them.
    #[test]
    fn replays_and_writes_order_each_other_while_the_graph_lives() -> TestResult {
        let Some((device, _lock)) = gpu("shared_graph_rwlock") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (s, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let (tick_s, tick_b) = (GpuMat::<u8>::new(&s, 1, 2)?, GpuMat::<u8>::new(&b, 1, 2)?);
        let weights = std::sync::RwLock::new(SharedMat::<u8>::new(&device, 1, N)?);
        weights.write().unwrap().write(&b)?.set_to(1)?;
        let mut out = GpuMat::<u8>::new(&s, 1, N)?;
        // A write after a pending replay: the replay reads what was there before.
        let graph = s.capture(|s| out.copy_from(&weights.read().unwrap().read(s)?))?;
        stall(&s, &k, &tick_s)?;
        graph.launch()?;
        weights.write().unwrap().write(&b)?.set_to(2)?;
        s.synchronize()?;
        drop(graph);
        let clobbered = count_not(&out.to_vec()?, 1);
        // A replay after a pending write: it reads what the write wrote.
        let graph = s.capture(|s| out.copy_from(&weights.read().unwrap().read(s)?))?;
        stall(&b, &k, &tick_b)?;
        weights.write().unwrap().write(&b)?.set_to(3)?;
        graph.launch()?;
        s.synchronize()?;
        drop(graph);
        let stale = count_not(&out.to_vec()?, 3);
        println!(
            "replays and writes while the graph lives: {clobbered} of {N} bytes clobbered, {stale} stale"
        );
        assert_eq!((clobbered, stale), (0, 0));
        Ok(())
    }

    #[test]
    fn a_copy_out_of_a_write_guard_on_another_stream_is_done_before_the_next_write() -> TestResult {
        let Some((device, _lock)) = gpu("shared_copy_from_write_guard") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&a, 1, 2)?;
        let mut shared = SharedMat::<u8>::new(&device, 1, N)?;
        let mut out = GpuMat::<u8>::new(&a, 1, N)?;
        {
            let mut w = shared.write(&b)?;
            w.set_to(7)?;
            stall(&a, &k, &tick)?;
            out.copy_from(&w)?; // on a, behind its stall
            w.set_to(0)?; // the same guard, on b: after the copy
        }
        shared.write(&b)?.set_to(9)?; // and the next write too
        let wrong = count_not(&out.to_vec()?, 7);
        println!(
            "copy out of a write guard on another stream, then writes: {wrong} of {N} bytes wrong"
        );
        assert_eq!(wrong, 0);
        Ok(())
    }

    #[test]
    fn shared_memory_dropped_inside_a_capture_is_freed_after_it() -> TestResult {
        let Some((device, _lock)) = gpu("shared_drop_in_capture") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        let mat = SharedMat::<u8>::new(&device, 1, 4096)?;
        let frees = device.stats().driver_free_calls;
        let graph = stream.capture(move |s| {
            let mut tmp = BufferPool::new(s).get_buffer_1d::<u8>(64)?;
            tmp.set_to(1)?;
            drop(mat); // no driver free may run inside the capture
            Ok(())
        })?;
        graph.launch()?;
        stream.synchronize()?;
        assert_eq!(
            device.stats().driver_free_calls,
            frees + 1,
            "freed once the capture ended"
        );
        Ok(())
    }

    /// A write guard begun before its stream's capture and dropped inside it: its end finds the
    /// access where it was begun, and the capture's end marks the work it queued before the
    /// capture. A replay on another stream that reads the matrix is then ordered after the write,
    /// not refused as if the write were still open (before the fix, the access stayed open for
    /// good: every such replay was refused with `SharedAccessOpen`). The control drops the guard
    /// before the capture.
    #[test]
    fn a_guard_begun_before_a_capture_and_ended_inside_it_leaves_nothing_open() -> TestResult {
        let Some((device, _lock)) = gpu("shared_guard_across_capture") else {
            return Ok(());
        };
        let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
        for ended_inside in [false, true] {
            // Behind a lock, as in the guide: the reader's graph keeps its borrow.
            let shared = std::sync::RwLock::new(SharedMat::<u8>::new(&device, 1, N)?);
            let mut seen = GpuMat::<u8>::new(&b, 1, N)?;
            let mut other = GpuMat::<u8>::new(&a, 1, N)?;
            let reader = b.capture(|s| seen.copy_from(&shared.read().unwrap().read(s)?))?;
            let mut lock = shared.write().unwrap();
            let mut write = lock.write(&a)?;
            write.set_to(7)?;
            let writer = if ended_inside {
                a.capture(|_| {
                    drop(write);
                    other.set_to(1)
                })?
            } else {
                drop(write);
                a.capture(|_| other.set_to(1))?
            };
            drop(writer); // it holds the moved guard's borrow of the lock
            drop(lock);
            let replayed = reader.launch();
            println!(
                "guard ended inside the capture: {ended_inside}; the reader's replay: {replayed:?}"
            );
            replayed?;
            b.synchronize()?;
            drop(reader);
            let stale = count_not(&seen.to_vec()?, 7);
            println!("  {stale} of {N} bytes read before the write");
            assert_eq!(stale, 0);
        }
        Ok(())
    }
}
