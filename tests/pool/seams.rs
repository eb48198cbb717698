//! Where graph capture and cudarc meet the rest of the pool (issue 17's attacks, kept as tests):
//! two pool streams over one CUDA stream, work that crosses streams inside a capture, `set_to`
//! captured without host memory, failed captures that must end, fallback memory released inside
//! a capture, and regions lent to cudarc. Each test says plainly when it skipped for want of a GPU.
#![cfg(feature = "cuda")]

use std::error::Error;

use crate::common::gpu;
use gpu_pool::CaptureError;
use gpu_pool::compat::opencv::set_buffer_pool_config;
use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::interop::cudarc::driver::{DeviceSlice, sys};
use gpu_pool::prelude::*;

type TestResult = Result<(), Box<dyn Error>>;
const MIB: usize = 1 << 20;

/// The stream takes, fills, reads back and releases a buffer, leaving its stack empty.
fn usable(stream: &Stream) -> TestResult {
    let mut b = BufferPool::new(stream).get_buffer::<u16>(64, 64)?;
    b.set_to(9)?;
    assert!(b.to_vec()?.iter().all(|&v| v == 9));
    drop(b);
    assert_eq!(stream.stats().stack_in_use, 0, "nothing left held");
    let status = stream.cudarc().expect("CUDA").capture_status()?;
    assert_eq!(
        status,
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    );
    Ok(())
}

/// Ends a capture that cudarc's `begin_capture` began on `cuda`, as its user would: cudarc's
/// `end_capture` returns an error its context holds without ending the capture, so it may take
/// more than one call. No attempt may yield a graph: the pool invalidated the capture.
fn end_foreign_capture(cuda: &std::sync::Arc<gpu_pool::interop::cudarc::driver::CudaStream>) {
    let none = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    for attempt in 0..3 {
        let ended = cuda.end_capture(sys::CUgraphInstantiate_flags(0));
        println!(
            "cudarc end_capture, attempt {attempt}: {:?}",
            ended.as_ref().map(Option::is_some)
        );
        assert!(
            !matches!(ended, Ok(Some(_))),
            "a graph of refused pool work was made"
        );
        if matches!(cuda.capture_status(), Ok(s) if s == none) {
            break;
        }
    }
}

#[test]
fn one_cuda_stream_is_wrapped_by_one_pool_stream_at_a_time() -> TestResult {
    let Some((gpu, _lock)) = gpu("one_pool_stream_per_cuda_stream") else {
        return Ok(());
    };
    let ctx = gpu.cudarc().expect("CUDA").clone();
    let first = Stream::new(&gpu)?;
    let again = Stream::from_cuda(&gpu, first.cudarc().expect("CUDA").clone());
    println!(
        "wrapping a pool stream's CUDA stream again: {:?}",
        again.as_ref().err()
    );
    assert!(
        matches!(again, Err(PoolError::StreamAlreadyWrapped { existing }) if existing == first.id())
    );

    let users = ctx.new_stream()?;
    let wrapped = Stream::from_cuda(&gpu, users.clone())?;
    let err = Stream::from_cuda(&gpu, users.clone()).unwrap_err();
    assert!(
        matches!(err, PoolError::StreamAlreadyWrapped { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("use that Stream"), "{err}");
    drop(wrapped);
    let rewrapped = Stream::from_cuda(&gpu, users)?;
    usable(&rewrapped)?;

    // The default stream is the same null handle every time it is asked for.
    let default = Stream::from_cuda(&gpu, ctx.default_stream())?;
    let err = Stream::from_cuda(&gpu, ctx.default_stream()).unwrap_err();
    assert!(
        matches!(err, PoolError::StreamAlreadyWrapped { .. }),
        "{err}"
    );
    drop(default);
    usable(&first)?;
    Ok(())
}

/// Capturing on the adopted legacy default stream: the driver refuses it with an error whose advice
/// says the context is unusable (it is not). The pool refuses it first, typed, with no driver
/// call, for `Stream::capture` and `GraphFamily::capture` alike; the stream works after.
#[test]
fn a_capture_on_the_adopted_legacy_default_stream_is_refused_up_front() -> TestResult {
    let Some((gpu, _lock)) = gpu("capture_legacy_stream") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, 4 * MIB, 2)?;
    let ctx = gpu.cudarc().expect("a CUDA device").clone();
    let default = Stream::from_cuda(&gpu, ctx.default_stream())?;
    let err = default
        .capture(|s| BufferPool::new(s).get_buffer::<u32>(32, 32)?.set_to(1))
        .unwrap_err();
    println!("capture on the adopted legacy default stream: {err}");
    assert!(
        matches!(
            err,
            PoolError::Capture(CaptureError::LegacyStream {
                what: "Stream::capture",
                ..
            })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("a stream of its own"), "{err}");
    assert!(!err.to_string().contains("unusable"), "{err}");
    let family = default.graph_family()?;
    let err = family.capture(|_| Ok(())).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::Capture(CaptureError::LegacyStream {
                what: "GraphFamily::capture",
                ..
            })
        ),
        "{err}"
    );
    drop(family);
    usable(&default)?;
    // A stream of its own captures.
    let own = Stream::new(&gpu)?;
    own.capture(|s| BufferPool::new(s).get_buffer::<u32>(32, 32)?.set_to(1))?
        .launch()?;
    usable(&own)?;
    Ok(())
}

#[test]
fn work_that_crosses_streams_inside_a_capture_is_refused() -> TestResult {
    let Some((gpu, _lock)) = gpu("capture_cross_stream") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, 4 * MIB, 2)?;
    let (a, b) = (Stream::new(&gpu)?, Stream::new(&gpu)?);
    let mut on_b = BufferPool::new(&b).get_buffer::<u32>(32, 32)?;
    on_b.set_to(5)?;

    let err = a
        .capture(|s| {
            let mut t = BufferPool::new(s).get_buffer::<u32>(32, 32)?;
            t.copy_from(&on_b)
        })
        .unwrap_err();
    println!("copy_from another stream inside a capture: {err}");
    assert!(
        matches!(
            err,
            PoolError::Capture(CaptureError::CrossStream { what: "copy_from" })
        ),
        "{err}"
    );

    let err = a
        .capture(|s| {
            let mut t = BufferPool::new(s).get_buffer::<u32>(32, 32)?;
            t.set_to(1)?;
            let mut other = GpuMat::<u32>::new(&b, 32, 32);
            // A driver allocation would break the capture: refused before it is tried.
            assert!(matches!(
                other,
                Err(PoolError::Capture(CaptureError::Allocates { .. }))
            ));
            other = BufferPool::new(&b).get_buffer::<u32>(32, 32);
            other?.copy_from(&t)
        })
        .unwrap_err();
    assert!(
        matches!(err, PoolError::Capture(CaptureError::CrossStream { .. })),
        "{err}"
    );

    let err = a
        .capture(|s| {
            let t = BufferPool::new(s).get_buffer::<u32>(32, 32)?;
            t.record_stream(&b)
        })
        .unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::Capture(CaptureError::CrossStream {
                what: "record_stream"
            })
        ),
        "{err}"
    );
    usable(&a)?;
    usable_above(&b, &on_b)?;
    assert!(
        on_b.to_vec()?.iter().all(|&v| v == 5),
        "b's buffer untouched"
    );
    Ok(())
}

/// `usable`, for a stream that still holds `live` on its stack.
fn usable_above(stream: &Stream, live: &GpuMat<'_, u32>) -> TestResult {
    let before = stream.stats().stack_in_use;
    let mut t = BufferPool::new(stream).get_buffer::<u32>(16, 16)?;
    assert!(t.device_ptr() >= live.device_ptr() + (live.step() * live.rows()) as u64);
    t.set_to(3)?;
    assert!(t.to_vec()?.iter().all(|&v| v == 3));
    drop(t);
    assert_eq!(stream.stats().stack_in_use, before);
    Ok(())
}

#[test]
fn another_streams_scope_inside_a_capture_runs_eagerly_and_replays_never_touch_it() -> TestResult {
    let Some((gpu, _lock)) = gpu("capture_other_scope") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, 4 * MIB, 2)?;
    let (a, b) = (Stream::new(&gpu)?, Stream::new(&gpu)?);
    let scratch_address = std::cell::Cell::new(0);
    let graph = a.capture(|s| {
        let mut t = BufferPool::new(s).get_buffer::<u32>(64, 64)?;
        t.set_to(1)?;
        // The user's `gpu_scope!(b, ...)` inside the capture: b's buffer is filled now, not on
        // every replay.
        gpu_scope!(b, {
            let mut x = buffer!(64, 64; u32)?;
            x.set_to(7)?;
            scratch_address.set(x.device_ptr());
        });
        Ok(())
    })?;
    // b's stack hands the same memory to a live buffer; replays must leave it alone.
    let mut live = BufferPool::new(&b).get_buffer::<u32>(64, 64)?;
    assert_eq!(live.device_ptr(), scratch_address.get());
    live.set_to(42)?;
    for _ in 0..3 {
        graph.launch()?;
    }
    a.synchronize()?;
    let overwritten = live.to_vec()?.iter().filter(|&&v| v != 42).count();
    println!(
        "replays of a's graph: {overwritten} of {} elements of b's live buffer overwritten",
        live.len()
    );
    assert_eq!(overwritten, 0);

    // A user who joins b to a's capture with cudarc's safe `join` gets pool work on b refused,
    // and a capture that fails and ends.
    let (ca, cb) = (a.cudarc().expect("CUDA"), b.cudarc().expect("CUDA"));
    let err = a
        .capture(|_| {
            cb.join(ca).map_err(|e| PoolError::Unsupported {
                device: gpu.id(),
                what: Box::leak(format!("join: {e}").into_boxed_str()),
            })?;
            let refused = gpu_scope!(b, {
                let mut x = buffer!(64, 64; u32)?;
                x.set_to(9)
            });
            println!("set_to on a stream joined to another's capture: {refused:?}");
            assert!(matches!(
                refused,
                Err(PoolError::Capture(CaptureError::Elsewhere {
                    what: "set_to",
                    ..
                }))
            ));
            refused
        })
        .unwrap_err();
    assert!(
        matches!(err, PoolError::Capture(CaptureError::Elsewhere { .. })),
        "{err}"
    );
    drop(graph);
    usable(&a)?;
    assert!(live.to_vec()?.iter().all(|&v| v == 42));
    drop(live);
    usable(&b)?;
    Ok(())
}

#[test]
fn set_to_of_values_no_memset_writes_is_captured_without_host_memory() -> TestResult {
    let Some((gpu, _lock)) = gpu("capture_set_to") else {
        return Ok(());
    };
    let stream = Stream::new(&gpu)?;
    let pool = BufferPool::new(&stream);
    // Outputs, taken before the capture: read between replays, written by it through a copy.
    let wide = pool.get_buffer::<f64>(33, 77)?;
    let pixels = pool.get_buffer::<[u8; 3]>(19, 101)?;
    let words = pool.get_buffer::<[u32; 5]>(7, 9)?;
    let graph = stream.capture(|s| {
        filled_into(s, &wide, 2.5)?;
        filled_into(s, &pixels, [1, 2, 3])?;
        filled_into(s, &words, [1, 2, 3, 4, 5])
    })?;
    for round in 0..4 {
        // Churn the heap, so a replay reading a freed host row would see other bytes.
        let junk: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8 ^ 0x5a; 4096]).collect();
        graph.launch()?;
        drop(junk);
        let bad = wide.to_vec()?.iter().filter(|&&v| v != 2.5).count()
            + pixels.to_vec()?.iter().filter(|&&p| p != [1, 2, 3]).count()
            + words
                .to_vec()?
                .iter()
                .filter(|&&w| w != [1, 2, 3, 4, 5])
                .count();
        println!("replay {round}: {bad} elements wrong");
        assert_eq!(bad, 0);
    }
    drop(graph);
    drop((words, pixels, wide));

    // An element too large for memsets is filled from a host row: eagerly, never in a capture.
    let mut big = GpuMat::<[u8; 300]>::new(&stream, 3, 4)?;
    big.set_to([7; 300])?;
    assert!(big.to_vec()?.iter().all(|e| e.iter().all(|&v| v == 7)));
    let mut odd = [0u8; 301];
    odd.iter_mut().enumerate().for_each(|(i, v)| *v = i as u8);
    let mut bigger = GpuMat::<[u8; 301]>::new(&stream, 2, 3)?;
    bigger.set_to(odd)?;
    assert!(bigger.to_vec()?.iter().all(|e| *e == odd));
    let mut other_odd = odd;
    other_odd.reverse();
    let err = stream.capture(|_| bigger.set_to(other_odd)).unwrap_err();
    println!("a 301-byte set_to inside a capture: {err}");
    assert!(matches!(err, PoolError::Unsupported { .. }), "{err}");
    usable(&stream)?;
    Ok(())
}

/// A stack buffer of `out`'s shape filled with `value` by `set_to`, then copied into `out` (shared:
/// a graph's outputs are read between replays) with a raw copy on `stream`.
fn filled_into<T: bytemuck::Pod>(
    stream: &Stream,
    out: &GpuMat<'_, T>,
    value: T,
) -> Result<(), PoolError> {
    let mut t = BufferPool::new(stream).get_buffer::<T>(out.rows(), out.cols())?;
    assert_eq!(t.step(), out.step());
    t.set_to(value)?;
    let bytes = out.step() * out.rows();
    // SAFETY: both buffers are live stack buffers of `bytes` (same shape and step), disjoint,
    // ordered on `stream`; `out` outlives the graph that replays this copy.
    unsafe {
        gpu_pool::interop::cudarc::driver::result::memcpy_dtod_async(
            out.device_ptr(),
            t.device_ptr(),
            bytes,
            stream.cudarc().expect("CUDA").cu_stream(),
        )
    }
    .map_err(|e| PoolError::Unsupported {
        device: stream.device().id(),
        what: Box::leak(format!("memcpy: {e}").into_boxed_str()),
    })
}

#[test]
fn a_failed_capture_always_ends_and_foreign_captures_get_no_pool_work() -> TestResult {
    let Some((gpu, _lock)) = gpu("capture_always_ends") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, 4 * MIB, 2)?;
    let stream = Stream::new(&gpu)?;
    let other = gpu.cudarc().expect("CUDA").new_stream()?;

    // cudarc's own copy on another stream, of pool memory, inside the capture.
    let err = stream
        .capture(|s| {
            let mut t = BufferPool::new(s).get_buffer::<f32>(16, 100)?;
            t.set_to(1.0)?;
            let mut lent = t.as_cudarc_mut()?;
            let ran = other.memset_zeros(&mut lent);
            println!("cudarc memset_zeros on another stream inside the capture: {ran:?} (run now)");
            // Any cudarc call clears cudarc's one error slot: the refusal must not depend on it.
            let _ = other.context().check_err();
            Ok(())
        })
        .unwrap_err();
    println!("the capture: {err}");
    assert!(
        matches!(err, PoolError::Capture(CaptureError::CrossStream { .. })),
        "{err}"
    );
    usable(&stream)?;

    // The other direction: memory of another pool stream used by cudarc on the capturing one.
    let b = Stream::new(&gpu)?;
    let mut on_b = BufferPool::new(&b).get_buffer_1d::<f32>(1000)?;
    on_b.set_to(4.0)?;
    let err = stream
        .capture(|s| {
            let cuda = s.cudarc().expect("CUDA");
            let _ = cuda.memset_zeros(&mut on_b.as_cudarc_mut()?);
            Ok(())
        })
        .unwrap_err();
    assert!(
        matches!(err, PoolError::Capture(CaptureError::CrossStream { .. })),
        "{err}"
    );
    usable(&stream)?;
    assert!(
        on_b.to_vec()?.iter().all(|&v| v == 4.0),
        "no replay wrote b's buffer"
    );
    drop(on_b);

    // A capture begun with cudarc's own API, not Stream::capture: pool work on it is refused.
    let cuda = stream.cudarc().expect("CUDA").clone();
    cuda.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let mut t = BufferPool::new(&stream).get_buffer_1d::<f32>(256)?;
    let refused = t.set_to(1.0);
    assert!(
        matches!(
            refused,
            Err(PoolError::Capture(CaptureError::Elsewhere {
                what: "set_to",
                ..
            }))
        ),
        "{refused:?}"
    );
    let lent = cuda.memset_zeros(&mut t.as_cudarc_mut()?);
    let nested = stream.capture(|_| Ok(())).unwrap_err();
    assert!(
        matches!(nested, PoolError::Capture(CaptureError::Elsewhere { .. })),
        "{nested}"
    );
    println!("cudarc memset on pool memory in a foreign capture: {lent:?}");
    end_foreign_capture(&cuda);
    drop(t);
    usable(&stream)?;

    // A call on another stream with a buffer of a stream someone else is capturing would race
    // what the stream queued before: it gets no address (not run eagerly, unordered).
    let other = gpu.cudarc().expect("CUDA").new_stream()?;
    let mut t = BufferPool::new(&stream).get_buffer_1d::<f32>(1000)?;
    t.set_to(4.0)?;
    stream.synchronize()?;
    cuda.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let refused = other.memset_zeros(&mut t.as_cudarc_mut()?);
    println!("memset on another stream during a foreign capture: {refused:?}");
    assert!(refused.is_err());
    end_foreign_capture(&cuda);
    other.synchronize()?;
    assert!(
        t.to_vec()?.iter().all(|&v| v == 4.0),
        "nothing wrote the buffer"
    );
    drop(t);
    usable(&stream)?;

    // A graph launched into someone else's capture would outlive its memory: refused.
    let graph = stream.capture(|s| {
        let mut t = BufferPool::new(s).get_buffer_1d::<f32>(64)?;
        t.set_to(2.0)
    })?;
    cuda.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let launched = graph.launch();
    let _ = cuda.end_capture(sys::CUgraphInstantiate_flags(0));
    println!("Graph::launch inside a foreign capture: {launched:?}");
    assert!(matches!(
        launched,
        Err(PoolError::Capture(CaptureError::Elsewhere {
            what: "Graph::launch",
            ..
        }))
    ));
    graph.launch()?;
    drop(graph);
    usable(&stream)?;
    Ok(())
}

#[test]
fn a_fallback_buffer_released_inside_a_capture_lives_as_long_as_its_graph() -> TestResult {
    let Some((gpu, _lock)) = gpu("capture_fallback_release") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, MIB, 2)?;
    let stream = Stream::new(&gpu)?;
    let mut out = GpuMat::<u8>::new(&stream, 1, 4 * MIB)?; // moved into the capture, too
    let big = BufferPool::new(&stream).get_buffer_1d::<u8>(4 * MIB)?; // too large: a fallback
    assert!(matches!(big.source(), Source::Fallback(_)));
    let driver = GpuMat::<u8>::new(&stream, 1, 4096)?;
    let frees_before = stream.stats().driver_free_calls;
    let graph = stream.capture(move |_| {
        let mut big = big;
        big.set_to(6)?;
        out.copy_from(&big)?;
        drop(big); // released inside: the graph's replays still write it
        drop(driver);
        Ok(())
    })?;
    assert_eq!(
        stream.stats().driver_free_calls,
        frees_before,
        "nothing freed while the graph lives"
    );
    for _ in 0..3 {
        graph.launch()?;
    }
    stream.synchronize()?;
    drop(graph);
    let freed = stream.stats().driver_free_calls - frees_before;
    println!(
        "fallback and driver buffers released inside a capture: {freed} freed when its graph was dropped"
    );
    assert_eq!(freed, 3, "the fallback buffer, `driver` and `out`");
    usable(&stream)?;
    Ok(())
}

#[test]
fn a_region_lent_to_cudarc_never_exposes_its_neighbours() -> TestResult {
    let Some((gpu, _lock)) = gpu("lent_regions") else {
        return Ok(());
    };
    let stream = Stream::new(&gpu)?;
    let cuda = stream.cudarc().expect("CUDA").clone();
    let mut image = BufferPool::new(&stream).get_buffer::<f32>(16, 100)?;
    image.set_to(1.0)?;

    let err = image.roi_mut(4..8, 10..20)?.as_cudarc_mut().unwrap_err();
    println!("a 4x10 region of a 16x100 image lent to cudarc: {err}");
    assert!(matches!(err, PoolError::NotContinuous { .. }), "{err}");
    assert!(matches!(
        image.roi(4..8, 10..20)?.as_cudarc(),
        Err(PoolError::NotContinuous { .. })
    ));

    // Rows of every column own their gaps (the buffer's padding): lent with a leading dimension.
    let ld = image.step() / size_of::<f32>();
    assert!(ld > 100, "a padded image");
    {
        let mut rows = image.row_range_mut(4..8)?;
        let mut lent = rows.as_cudarc_mut()?;
        assert_eq!(lent.ld(), ld);
        assert_eq!(lent.len(), 3 * lent.ld() + 100);
        cuda.memset_zeros(&mut lent)?;
    }
    // One row of a region is contiguous: lent as it is.
    cuda.memset_zeros(&mut image.roi_mut(10..11, 10..20)?.as_cudarc_mut()?)?;
    let host = image.to_vec()?;
    let zeroed: Vec<usize> = (0..host.len()).filter(|&i| host[i] == 0.0).collect();
    let expected: Vec<usize> = (4 * 100..8 * 100)
        .chain(10 * 100 + 10..10 * 100 + 20)
        .collect();
    assert_eq!(zeroed, expected, "exactly the lent elements were zeroed");
    assert_eq!(
        image.as_cudarc_mut()?.len(),
        15 * ld + 100,
        "a whole buffer lends its padding"
    );
    Ok(())
}

// Found by review of the first fix: what safe code could still reach.

#[test]
fn cudarcs_own_end_capture_inside_a_capture_yields_no_graph() -> TestResult {
    let Some((gpu, _lock)) = gpu("capture_end_by_cudarc") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, 4 * MIB, 2)?;
    let stream = Stream::new(&gpu)?;
    let stolen = std::cell::RefCell::new(None);
    let result = stream.capture(|s| {
        let mut t = BufferPool::new(s).get_buffer_1d::<u8>(MIB)?;
        t.set_to(0xAB)?;
        let ended = s
            .cudarc()
            .expect("CUDA")
            .end_capture(sys::CUgraphInstantiate_flags(0));
        println!(
            "cudarc's end_capture inside Stream::capture: {:?}",
            ended.as_ref().map(Option::is_some)
        );
        *stolen.borrow_mut() = ended.ok().flatten();
        Ok(())
    });
    println!(
        "the pool's capture: {:?}",
        result.as_ref().map(|_| "a graph")
    );
    assert!(
        stolen.borrow().is_none(),
        "only the pool makes the capture's graph"
    );
    drop(result);
    usable(&stream)?;
    Ok(())
}

#[test]
fn memory_made_before_a_capture_and_freed_after_it_lives_while_the_graph_does() -> TestResult {
    let Some((gpu, _lock)) = gpu("capture_refcell_free") else {
        return Ok(());
    };
    let stream = Stream::new(&gpu)?;
    let slot = std::cell::RefCell::new(Some(GpuMat::<u8>::new(&stream, 1, 4 * MIB)?));
    let address = slot.borrow().as_ref().map(GpuMat::device_ptr);
    let graph = stream.capture(|_| slot.borrow_mut().as_mut().expect("made above").set_to(0xAB))?;
    let frees = stream.stats().driver_free_calls;
    drop(slot.borrow_mut().take()); // released while the graph, which writes it, lives
    assert_eq!(
        stream.stats().driver_free_calls,
        frees,
        "kept for the graph"
    );
    let mut victim = GpuMat::<u8>::new(&stream, 1, 4 * MIB)?;
    assert_ne!(
        Some(victim.device_ptr()),
        address,
        "the kept memory is not handed out"
    );
    victim.set_to(1)?;
    graph.launch()?;
    assert!(victim.to_vec()?.iter().all(|&v| v == 1));
    // Memory made after the capture is no graph's: freed at once, however long the graph lives.
    let before = stream.stats().driver_free_calls;
    for _ in 0..50 {
        drop(GpuMat::<u8>::new(&stream, 1, 4 * MIB)?);
    }
    let freed = stream.stats().driver_free_calls - before;
    println!("50 buffers made and dropped while a graph lives: {freed} freed at once");
    assert_eq!(freed, 50);
    drop(graph);
    assert_eq!(
        stream.stats().driver_free_calls,
        before + 51,
        "the kept one freed with the graph"
    );

    // MixMemory's host side could be reallocated under a captured copy: refused.
    let mut mix = gpu_pool::compat::mix::MixMemory::new(&gpu)?;
    mix.cpu::<u32>(1024)?.fill(3);
    let _ = mix.gpu::<u32>(1024)?;
    let err = stream.capture(|s| mix.copy_to_cpu_async(s)).unwrap_err();
    println!("a MixMemory copy inside a capture: {err}");
    assert!(matches!(err, PoolError::Unsupported { .. }), "{err}");
    usable(&stream)?;
    Ok(())
}

#[test]
fn per_thread_stream_handles_are_not_wrapped() -> TestResult {
    let Some((gpu, _lock)) = gpu("per_thread_handles") else {
        return Ok(());
    };
    let ctx = gpu.cudarc().expect("CUDA").clone();
    let err = Stream::from_cuda(&gpu, ctx.per_thread_stream()).unwrap_err();
    println!("from_cuda(per_thread_stream): {err}");
    assert!(matches!(err, PoolError::Unsupported { .. }), "{err}");
    Ok(())
}

#[test]
fn a_dropped_stream_hands_its_stack_on_only_once_its_work_is_done() -> TestResult {
    let Some((gpu, _lock)) = gpu("drop_waits") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, 256 * MIB, 1)?;
    let first = Stream::new(&gpu)?;
    {
        let mut big = BufferPool::new(&first).get_buffer_1d::<u8>(200 * MIB)?;
        for _ in 0..40 {
            big.set_to(1)?; // queued, still running when the stream is dropped
        }
    }
    first.reset_peak(); // the stack's high-water mark back to 0: no reason to skip the wait
    drop(first);
    let second = Stream::new(&gpu)?;
    let mut reused = BufferPool::new(&second).get_buffer_1d::<u8>(200 * MIB)?;
    reused.set_to(2)?;
    let stale = reused.to_vec()?.iter().filter(|&&v| v != 2).count();
    println!("a stack handed on after reset_peak: {stale} bytes written by the old stream's work");
    assert_eq!(stale, 0);
    drop(reused);

    // Dropped inside another stream's capture, where no wait is allowed: its stack goes back
    // with an event, which the next stream to take it waits for.
    drop(second);
    set_buffer_pool_config(&gpu, 64 * MIB, 2)?;
    let a = Stream::new(&gpu)?;
    let graph = a.capture(|_| {
        let b = Stream::new(&gpu)?;
        gpu_scope!(b, {
            let mut x = buffer!(48 * MIB; u8)?;
            for _ in 0..20 {
                x.set_to(5)?; // still running when b is dropped
            }
        });
        drop(b);
        Ok(())
    });
    println!(
        "a stream dropped inside a capture: {:?}",
        graph.as_ref().map(|_| "a graph")
    );
    drop(graph);
    assert_eq!(gpu.stats().stacks_held, 1, "b's stack went back");
    let c = Stream::new(&gpu)?;
    let mut y = BufferPool::new(&c).get_buffer_1d::<u8>(48 * MIB)?;
    y.set_to(6)?;
    let stale = y.to_vec()?.iter().filter(|&&v| v != 6).count();
    println!("the next stream on that stack: {stale} bytes written by the dropped stream's work");
    assert_eq!(stale, 0);
    drop(y);
    usable(&a)?;
    usable(&c)?;
    Ok(())
}

#[test]
fn a_mix_memory_copy_whose_wait_is_refused_stays_pending() -> TestResult {
    let Some((gpu, _lock)) = gpu("mix_pending") else {
        return Ok(());
    };
    let b = Stream::new(&gpu)?;
    let mut mix = gpu_pool::compat::mix::MixMemory::new(&gpu)?;
    mix.cpu::<u32>(1 << 20)?.fill(3);
    let _ = mix.gpu::<u32>(1 << 20)?;
    mix.copy_to_cpu_async(&b)?; // in flight on b
    // Someone begins a capture on b: the copy can no longer be waited for.
    let cuda = b.cudarc().expect("CUDA").clone();
    cuda.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let first = mix.cpu::<u32>(1 << 20).map(|_| ());
    let second = mix.cpu::<u32>(1 << 20).map(|_| ());
    println!("host access while the wait is refused: {first:?}, then {second:?}");
    let _ = cuda.end_capture(sys::CUgraphInstantiate_flags(0));
    assert!(first.is_err() && second.is_err(), "the copy stays pending");
    assert!(
        mix.cpu::<u32>(1 << 20)?.iter().all(|&v| v == 0),
        "the copy landed, waited for"
    );
    usable(&b)?;
    Ok(())
}
