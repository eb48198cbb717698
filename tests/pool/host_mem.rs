//! `HostMem`: asynchronous uploads and downloads from page-locked memory, whose copies in flight
//! the host can neither touch nor free. Host-backend rules first (CI), then the attacks on a GPU,
//! each with one stream held back by a spinning kernel so a missing wait shows as wrong bytes.

use gpu_pool::compat::opencv::BufferPool;
use gpu_pool::prelude::*;
use gpu_pool::{HostMem, compat::mix::MixMemory};

#[test]
fn async_copies_round_trip_and_refuse_what_does_not_fit() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let data: Vec<u16> = (0..70 * 33).map(|i| i as u16).collect();
    let src = HostMem::from_slice(stream.device(), &data)?;
    let mut gpu = BufferPool::new(&stream).get_buffer::<u16>(33, 70)?; // padded rows
    gpu.upload_async(&src)?;
    let mut back = HostMem::<u16>::new(stream.device(), data.len())?;
    gpu.download_async(&mut back)?;
    assert_eq!(back.as_slice()?, &data[..]);
    // A region of the buffer, row by row.
    let mut band = HostMem::<u16>::new(stream.device(), 5 * 70)?;
    gpu.row_range(10..15)?.download_async(&mut band)?;
    assert_eq!(band.as_slice()?, &data[10 * 70..15 * 70]);

    let wrong_len = HostMem::<u16>::new(stream.device(), data.len() - 1)?;
    let err = gpu.upload_async(&wrong_len).unwrap_err();
    assert!(matches!(err, PoolError::ShapeMismatch { .. }), "{err}");
    let elsewhere = HostMem::from_slice(&Device::private_host(), &data)?;
    let err = gpu.upload_async(&elsewhere).unwrap_err();
    assert!(matches!(err, PoolError::DeviceMismatch { .. }), "{err}");
    // MixMemory's device side belongs to no stream: nothing would order the copy.
    let mut mix = MixMemory::new(stream.device())?;
    let mut unordered = mix.gpu_view_mut::<u16>(data.len())?;
    let err = unordered.upload_async(&src).unwrap_err();
    assert!(matches!(err, PoolError::Unsupported { .. }), "{err}");
    // Empty and zero-sized.
    let none = HostMem::<u16>::new(stream.device(), 0)?;
    BufferPool::new(&stream)
        .get_buffer_1d::<u16>(0)?
        .upload_async(&none)?;
    assert!(none.is_empty() && none.as_slice()?.is_empty());
    let units = HostMem::<()>::new(stream.device(), 5)?;
    assert_eq!(units.as_slice()?.len(), 5);
    // Over-aligned elements are refused, not misaligned.
    #[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
    #[repr(C, align(1024))]
    struct Wide([u8; 1024]);
    let err = HostMem::<Wide>::new(stream.device(), 1).unwrap_err();
    assert!(
        matches!(err, PoolError::UnsupportedAlignment { .. }),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_frame_loop_with_async_copies_leaks_nothing() -> Result<(), PoolError> {
    let device = gpu_pool::testing::host_with_fault(0);
    {
        let stream = Stream::new(&device)?;
        let mut input = HostMem::<u8>::new(&device, 64 * 64)?;
        let mut output = HostMem::<u8>::new(&device, 64 * 64)?;
        for frame in 0..5u8 {
            input.as_mut_slice()?.fill(frame);
            gpu_scope!(&stream, {
                let mut img = buffer!(64, 64; u8)?;
                img.upload_async(&input)?;
                img.download_async(&mut output)?;
            });
            stream.synchronize()?;
            assert!(output.as_slice()?.iter().all(|&v| v == frame));
        }
    }
    device.release_stack_memory()?;
    assert_eq!(gpu_pool::testing::host_live_bytes(&device), Some(0));
    Ok(())
}

#[test]
fn a_synchronize_vouches_for_copies_and_a_wait_without_one_switches_to_events()
-> Result<(), PoolError> {
    use gpu_pool::testing::host_mem_marks_copies_with_events as events;
    let device = Device::private_host();
    let (stream, other) = (Stream::new(&device)?, Stream::new(&device)?);
    let mut gpu = BufferPool::new(&stream).get_buffer_1d::<u8>(256)?;
    // Synchronized before the host touches it: the stream's clock answers, no event is made.
    let mut host = HostMem::from_slice(&device, &[4u8; 256])?;
    gpu.upload_async(&host)?;
    gpu.download_async(&mut host)?;
    stream.synchronize()?;
    assert_eq!(host.as_mut_slice()?, &[4; 256]);
    assert!(!events(&host));
    // Another stream's synchronize vouches for nothing of this one.
    gpu.upload_async(&host)?;
    other.synchronize()?;
    assert_eq!(host.as_slice()?, &[4; 256]); // waits for `stream` as a whole
    assert!(
        events(&host),
        "a whole-stream wait switches the memory to events"
    );
    gpu.upload_async(&host)?; // marked by an event now (none on the host backend: done at once)
    assert_eq!(host.as_slice()?, &[4; 256]);
    // A copy on another stream after one a ticket marks: ordered by a host wait, then events.
    let mut shared = HostMem::<u8>::new(&device, 256)?;
    gpu.download_async(&mut shared)?;
    let mut theirs = BufferPool::new(&other).get_buffer_1d::<u8>(256)?;
    theirs.upload_async(&shared)?;
    assert!(events(&shared));
    assert_eq!(theirs.to_vec()?, vec![4; 256]);
    // The memory outlives both streams: a ticket holds the CUDA stream it waits on, not the
    // pool stream.
    theirs.download_async(&mut host)?;
    drop(theirs);
    drop(other);
    assert_eq!(shared.as_slice()?, &[4; 256]);
    assert_eq!(host.as_slice()?, &[4; 256]);
    Ok(())
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::error::Error;

    use gpu_pool::CaptureError;
    use gpu_pool::HostMem;
    use gpu_pool::compat::opencv::{BufferPool, GpuMat};
    use gpu_pool::interop::cudarc::driver::CudaEvent;
    use gpu_pool::prelude::*;

    use crate::common::gpu;
    use crate::common::kernels::Kernels;
    use crate::cuda::{count_not, stall};

    type TestResult = Result<(), Box<dyn Error>>;
    const N: usize = 4 << 20;

    /// An event after the work queued on `stream` so far, to ask later whether it is done.
    fn mark(stream: &Stream) -> Result<CudaEvent, Box<dyn Error>> {
        Ok(stream.cudarc().expect("CUDA").record_event(None)?)
    }

    #[test]
    fn host_memory_written_during_an_upload_waits_for_it() -> TestResult {
        let Some((device, _lock)) = gpu("hostmem_write_in_flight") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let tick = GpuMat::<u8>::new(&stream, 1, 2)?;
        let mut host = HostMem::<u8>::new(&device, N)?;
        host.as_mut_slice()?.fill(1);
        let mut gpu = GpuMat::<u8>::new(&stream, 1, N)?;
        stall(&stream, &k, &tick)?;
        gpu.upload_async(&host)?; // queued behind the stall: reads `host` later
        let after = mark(&stream)?;
        host.as_mut_slice()?.fill(2); // must wait for the copy first
        assert!(
            after.is_complete(),
            "as_mut_slice returned before the upload was done"
        );
        let clobbered = count_not(&gpu.to_vec()?, 1);
        println!("hostmem_write_in_flight: {clobbered} of {N} bytes clobbered");
        assert_eq!(clobbered, 0);
        Ok(())
    }

    #[test]
    fn host_memory_dropped_during_a_download_is_freed_once_it_is_done_and_a_read_waits()
    -> TestResult {
        let Some((device, _lock)) = gpu("hostmem_drop_in_flight") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let tick = GpuMat::<u8>::new(&stream, 1, 2)?;
        let mut gpu = GpuMat::<u8>::new(&stream, 1, N)?;
        gpu.set_to(7)?;
        // Dropped while the download into it is queued behind a stall: the drop returns at once,
        // and the memory waits on the device's list until the download is done.
        stream.synchronize()?; // nothing deferred from earlier tests is left
        let waiting = gpu_pool::testing::host_mem_frees_waiting(&device);
        let mut doomed = HostMem::<u8>::new(&device, N)?;
        stall(&stream, &k, &tick)?;
        gpu.download_async(&mut doomed)?;
        let after = mark(&stream)?;
        let start = std::time::Instant::now();
        drop(doomed);
        let dropped_in = start.elapsed();
        let in_flight = !after.is_complete();
        let deferred = gpu_pool::testing::host_mem_frees_waiting(&device);
        // A new allocation meanwhile works, and frees nothing still written.
        let other = HostMem::<u8>::new(&device, N)?;
        let still_deferred = gpu_pool::testing::host_mem_frees_waiting(&device);
        stream.synchronize()?;
        let after_sync = gpu_pool::testing::host_mem_frees_waiting(&device);
        println!(
            "hostmem_drop_in_flight: drop returned in {:.3} ms with the download in flight \
             ({in_flight}); frees waiting {waiting} before, {deferred} after the drop, \
             {still_deferred} after a new HostMem, {after_sync} after synchronize",
            dropped_in.as_secs_f64() * 1e3
        );
        assert!(
            in_flight,
            "the stall was over before the drop: nothing measured"
        );
        assert!(dropped_in.as_millis() < 50, "the drop waited for the copy");
        assert_eq!(deferred, waiting + 1, "the memory waits for its download");
        assert_eq!(still_deferred, deferred, "not freed under the download");
        assert_eq!(after_sync, 0, "freed once the download is done");
        drop(other);
        // Read while the download is queued: the read waits and sees the bytes.
        let mut host = HostMem::<u8>::new(&device, N)?;
        stall(&stream, &k, &tick)?;
        gpu.download_async(&mut host)?;
        let stale = count_not(host.as_slice()?, 7);
        println!("hostmem_drop_in_flight: drop waited; {stale} of {N} bytes stale on read");
        assert_eq!(stale, 0);
        Ok(())
    }

    #[test]
    fn a_copy_on_another_stream_waits_for_the_copy_in_flight() -> TestResult {
        let Some((device, _lock)) = gpu("hostmem_cross_stream") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
        let tick = GpuMat::<u8>::new(&a, 1, 2)?;
        let mut src = GpuMat::<u8>::new(&a, 1, N)?;
        src.set_to(9)?;
        let mut host = HostMem::<u8>::new(&device, N)?; // zeros
        stall(&a, &k, &tick)?;
        src.download_async(&mut host)?; // on a, behind the stall: writes 9s later
        let mut dst = GpuMat::<u8>::new(&b, 1, N)?;
        dst.upload_async(&host)?; // on b: must read after a's download
        let stale = count_not(&dst.to_vec()?, 9);
        println!("hostmem_cross_stream: {stale} of {N} bytes read before the download landed");
        assert_eq!(stale, 0);
        Ok(())
    }

    #[test]
    fn after_one_whole_stream_wait_a_refill_waits_for_its_upload_alone() -> TestResult {
        use gpu_pool::testing::host_mem_marks_copies_with_events as events;
        let Some((device, _lock)) = gpu("hostmem_refill_overlap") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let tick = GpuMat::<u8>::new(&stream, 1, 2)?;
        let mut host = HostMem::<u8>::new(&device, N)?;
        let mut gpu = GpuMat::<u8>::new(&stream, 1, N)?;
        let mut overlapped = Vec::new();
        for value in 1..=3u8 {
            // Refill, upload, then a long kernel; the next refill comes while it runs.
            host.as_mut_slice()?.fill(value);
            gpu.upload_async(&host)?;
            stall(&stream, &k, &tick)?;
            let stalled = mark(&stream)?;
            host.as_mut_slice()?.fill(0xee); // waits for the upload
            overlapped.push(!stalled.is_complete());
            let clobbered = count_not(&gpu.to_vec()?, value);
            assert_eq!(clobbered, 0, "frame {value}: the refill reached the upload");
        }
        println!(
            "hostmem_refill_overlap: refill overlapped the kernel after the upload: {overlapped:?}, \
             events: {}",
            events(&host)
        );
        // The first refill's ticket could not tell: the whole stream was waited for. From then on
        // each upload has an event, and the refill waits for it alone.
        assert_eq!(overlapped, [false, true, true]);
        assert!(events(&host));
        Ok(())
    }

    #[test]
    fn a_frame_loop_that_synchronizes_makes_no_event() -> TestResult {
        use gpu_pool::testing::host_mem_marks_copies_with_events as events;
        let Some((device, _lock)) = gpu("hostmem_frame_tickets") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        let mut input = HostMem::<u8>::new(&device, N)?;
        let mut output = HostMem::<u8>::new(&device, N)?;
        let mut frame = GpuMat::<u8>::new_packed(&stream, 1, N)?;
        let mut wrong = 0;
        for value in 0..5u8 {
            input.as_mut_slice()?.fill(value);
            frame.upload_async(&input)?;
            frame.download_async(&mut output)?;
            stream.synchronize()?;
            wrong += count_not(output.as_slice()?, value);
        }
        println!(
            "hostmem_frame_tickets: {wrong} wrong bytes over 5 frames; events: ({}, {})",
            events(&input),
            events(&output)
        );
        assert_eq!(wrong, 0);
        assert!(
            !events(&input) && !events(&output),
            "a synchronized loop needs no event"
        );
        Ok(())
    }

    #[test]
    fn a_wait_refused_by_a_foreign_capture_loses_nothing() -> TestResult {
        use gpu_pool::interop::cudarc::driver::sys;
        let Some((device, _lock)) = gpu("hostmem_foreign_capture") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let tick = GpuMat::<u8>::new(&stream, 1, 2)?;
        let mut host = HostMem::<u8>::new(&device, N)?;
        host.as_mut_slice()?.fill(5);
        let mut gpu = GpuMat::<u8>::new(&stream, 1, N)?;
        stall(&stream, &k, &tick)?;
        gpu.upload_async(&host)?; // a ticket, not covered: only a synchronize could vouch for it
        let cuda = stream.cudarc().expect("CUDA").clone();
        cuda.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let refused = host.as_mut_slice().map(drop);
        let ended = cuda.end_capture(sys::CUgraphInstantiate_flags(0));
        println!(
            "hostmem_foreign_capture: {refused:?}; capture ended: {:?}",
            ended.is_ok()
        );
        assert!(
            matches!(
                refused,
                Err(PoolError::Capture(CaptureError::Elsewhere { .. }))
            ),
            "{refused:?}"
        );
        // After the capture the wait is made, and the upload read the bytes it was given.
        host.as_mut_slice()?.fill(6);
        assert_eq!(count_not(&gpu.to_vec()?, 5), 0);
        Ok(())
    }

    #[test]
    fn host_memory_dropped_inside_a_capture_is_freed_after_it() -> TestResult {
        let Some((device, _lock)) = gpu("hostmem_drop_in_capture") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let tick = GpuMat::<u8>::new(&stream, 1, 2)?;
        let host = HostMem::<u8>::new(&device, N)?;
        let mut gpu = GpuMat::<u8>::new(&stream, 1, N)?;
        gpu.set_to(9)?;
        stall(&stream, &k, &tick)?;
        gpu.upload_async(&host)?; // zeros, behind the stall; nothing vouches for it yet
        let graph = stream.capture(move |s| {
            drop(host); // a synchronize here would break the capture: after it
            BufferPool::new(s).get_buffer_1d::<u8>(64)?.set_to(1)
        })?;
        graph.launch()?;
        let stale = count_not(&gpu.to_vec()?, 0);
        println!("hostmem_drop_in_capture: capture and replay fine; {stale} of {N} bytes stale");
        assert_eq!(stale, 0);
        Ok(())
    }

    #[test]
    fn host_memory_outliving_its_stream_keeps_the_callers_context() -> TestResult {
        use gpu_pool::interop::cudarc::driver::{CudaContext, result};
        let Some((device, _lock)) = gpu("hostmem_context") else {
            return Ok(());
        };
        let other = CudaContext::new_non_primary(0, 0)?;
        let stream = Stream::new(&device)?;
        let host = HostMem::<u8>::new(&device, N)?;
        let mut gpu = GpuMat::<u8>::new(&stream, 1, N)?;
        gpu.upload_async(&host)?;
        stream.synchronize()?;
        drop(gpu);
        drop(stream); // the ticket now holds the last handle of the CUDA stream
        other.bind_to_thread()?;
        let before = result::ctx::get_current()?;
        drop(host);
        let after = result::ctx::get_current()?;
        println!("hostmem_context: current before the drop {before:?}, after {after:?}");
        assert_eq!(after, before, "the drop left another context current");
        Ok(())
    }

    #[test]
    fn async_host_copies_are_refused_inside_a_capture() -> TestResult {
        let Some((device, _lock)) = gpu("hostmem_capture") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        let host = HostMem::<u8>::new(&device, 1024)?;
        let captured = stream.capture(|s| {
            let mut tmp = BufferPool::new(s).get_buffer_1d::<u8>(1024)?;
            tmp.upload_async(&host)
        });
        assert!(
            matches!(captured, Err(PoolError::Unsupported { .. })),
            "{captured:?}"
        );
        drop(captured);
        // Nor is page-locked memory allocated inside one (the driver would break the capture).
        let made = stream.capture(|_| HostMem::<u8>::new(&device, 16).map(drop));
        assert!(
            matches!(
                made,
                Err(PoolError::Capture(CaptureError::Allocates { .. }))
            ),
            "{made:?}"
        );
        drop(made);
        // The stream is usable afterwards.
        let mut tmp = BufferPool::new(&stream).get_buffer_1d::<u8>(1024)?;
        tmp.upload_async(&host)?;
        assert_eq!(tmp.to_vec()?, vec![0; 1024]);
        Ok(())
    }
}
