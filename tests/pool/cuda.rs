//! What only a GPU shows: kernels on pooled memory, the steady-state pipeline, stream order across
//! streams, the device guard, stream-ordered fallbacks and several devices. Each test says plainly
//! when it skipped for want of a driver.
#![cfg(feature = "cuda")]

use gpu_pool::GpuRead;
use gpu_pool::GpuWrite;
use std::error::Error;
use std::sync::Arc;

use crate::common::gpu;
use crate::common::kernels::{self, Kernels, gray_of, pattern};
use gpu_pool::CaptureError;
use gpu_pool::interop::cudarc::driver::{CudaContext, PushKernelArg, result as cu};
use gpu_pool::{
    Device, FallbackReason, PoolError, Source, Stream, compat::opencv::BufferPool,
    compat::opencv::GpuMat, compat::opencv::set_buffer_pool_config, config::Fallback,
    interop::PITCHED_H, interop::Pitched, interop::PitchedMut, interop::grid_2d,
};

type TestResult = Result<(), Box<dyn Error>>;
const MIB: usize = 1 << 20;

#[test]
fn without_a_driver_cuda_is_a_clear_error() {
    match Device::cuda(0) {
        Ok(gpu) => println!("driver present: {} found", gpu.id()),
        Err(e) => {
            assert!(matches!(e, PoolError::NoCudaDriver { .. }), "{e}");
            assert!(e.to_string().contains("Device::host()"), "{e}");
            assert!(matches!(
                Device::cuda_device_count(),
                Err(PoolError::NoCudaDriver { .. })
            ));
            println!("no driver, as expected here: {e}");
        }
    }
}

#[test]
fn an_ordinal_past_the_last_is_no_such_device() {
    let Some((_gpu, _lock)) = gpu("no_such_device") else {
        return;
    };
    let count = Device::cuda_device_count().expect("driver present");
    let err = Device::cuda(count + 7).unwrap_err();
    assert!(
        matches!(err, PoolError::NoSuchDevice { count: c, .. } if c == count),
        "{err}"
    );
}

#[test]
fn the_device_reports_its_texture_alignment_and_memory_pools() {
    let Some((gpu, _lock)) = gpu("attributes") else {
        return;
    };
    let align = gpu.texture_alignment();
    println!(
        "{}: texture alignment {align}, stream-ordered {}",
        gpu.id(),
        gpu.supports_stream_ordered()
    );
    assert!(align.is_power_of_two() && align >= 256);
    assert_eq!(
        gpu.fallback(),
        Ok(Fallback::Driver),
        "the test lock resets it"
    );
}

#[test]
fn kernels_round_trip_through_pitched_pool_buffers() -> TestResult {
    let Some((gpu, _lock)) = gpu("kernel_round_trip") else {
        return Ok(());
    };
    let k = Kernels::load(&gpu);
    let stream = Stream::new(&gpu)?;
    let cu_stream = stream.cudarc().expect("a CUDA stream").clone();
    let pool = BufferPool::new(&stream);
    let (rows, cols) = (300usize, 700usize);
    let mut a = pool.get_buffer::<u8>(rows, cols)?;
    let mut b = pool.get_buffer::<u8>(rows, cols)?;
    assert_eq!(a.source(), Source::Stack);
    assert_eq!(a.step(), cols.next_multiple_of(gpu.texture_alignment()));
    let seed = 5;
    // SAFETY: `a` and `b` are on this stream's device and outlive its work (`to_vec` waits).
    unsafe {
        kernels::fill_pattern(&k, &cu_stream, a.pitched_mut(), seed)?;
        kernels::invert(&k, &cu_stream, a.pitched(), b.pitched_mut())?;
    }
    let out = b.to_vec()?;
    for y in 0..rows {
        for x in 0..cols {
            assert_eq!(out[y * cols + x], 255 - pattern(x, y, seed), "({x}, {y})");
        }
    }
    Ok(())
}

#[test]
fn a_pitched_argument_addresses_every_element_of_a_buffer_and_of_a_region() -> TestResult {
    let Some((gpu, _lock)) = gpu("pitched_argument") else {
        return Ok(());
    };
    let source = format!(
        "{PITCHED_H}{}",
        r#"
extern "C" __global__ void index(Pitched<unsigned> m, unsigned base) {
    unsigned c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y * blockDim.y + threadIdx.y;
    if (m.contains(r, c)) m(r, c) = base + r * 1000 + c;
}"#
    );
    let ptx = gpu_pool::interop::cudarc::nvrtc::compile_ptx(source)?;
    let ctx = gpu.cudarc().expect("CUDA");
    let f = ctx.load_module(ptx)?.load_function("index")?;
    let stream = Stream::new(&gpu)?;
    let cuda = stream.cudarc().expect("CUDA").clone();
    // 37 rows of 1001: a ragged last block both ways, and a step wider than a row.
    let (rows, cols) = (37usize, 1001usize);
    let mut m = BufferPool::new(&stream).get_buffer::<u32>(rows, cols)?;
    assert!(m.step() > cols * 4);
    let launch = |arg: PitchedMut<'_, u32>, base: u32| -> TestResult {
        let grid = grid_2d(arg.rows(), arg.cols())?;
        // SAFETY: `index` takes (Pitched<unsigned>, unsigned) and writes only inside the
        // argument's rows and columns, memory of this stream's device that outlives the kernel.
        unsafe { cuda.launch_builder(&f).arg(&arg).arg(&base).launch(grid) }?;
        Ok(())
    };
    launch(m.pitched_mut(), 0)?;
    // A region: rows 5..20, columns 100..350, numbered from its own corner.
    launch(m.roi_mut(5..20, 100..350)?.pitched_mut(), 1_000_000)?;
    let out = m.to_vec()?;
    for r in 0..rows {
        for c in 0..cols {
            let expected = if (5..20).contains(&r) && (100..350).contains(&c) {
                1_000_000 + (r - 5) * 1000 + (c - 100)
            } else {
                r * 1000 + c
            };
            assert_eq!(out[r * cols + c] as usize, expected, "({r}, {c})");
        }
    }
    // The read-only side carries the same four fields.
    let p: Pitched<'_, u32> = m.pitched();
    assert_eq!(
        (p.device_ptr(), p.step(), p.rows(), p.cols()),
        (m.device_ptr(), m.step(), rows, cols)
    );
    Ok(())
}

#[test]
fn the_pipeline_makes_no_driver_call_after_its_first_iteration() -> TestResult {
    let Some((gpu, _lock)) = gpu("pipeline_steady_state") else {
        return Ok(());
    };
    let k = Kernels::load(&gpu);
    set_buffer_pool_config(&gpu, 64 * MIB, 1)?;
    // The seed's size, then one with a ragged right edge for the kernels' 16-pixel vectors.
    pipeline_case(&gpu, &k, 4096, 4096)?;
    pipeline_case(&gpu, &k, 333, 1001)?;
    set_buffer_pool_config(&gpu, 10 * MIB, 5)?;
    Ok(())
}

fn pipeline_case(gpu: &Device, k: &Kernels, rows: usize, cols: usize) -> TestResult {
    let stream = Stream::new(gpu)?;
    let s = stream.cudarc().expect("CUDA").clone();
    let pool = BufferPool::new(&stream);
    let image: Vec<[u8; 3]> = (0..rows * cols)
        .map(|i| [(i % 251) as u8, (i / cols % 241) as u8, (i * 7 % 239) as u8])
        .collect();
    let src = GpuMat::from_host(&stream, rows, cols, &image)?;
    let (_r, _c, t) = (rows as i32, cols as i32, 128u8);
    let mut calls_after_first = 0;
    let mut out = vec![0u8; rows * cols];
    for i in 0..20 {
        let mut gray = pool.get_buffer::<u8>(rows, cols)?;
        let mut binary = pool.get_buffer::<u8>(rows, cols)?;
        assert_eq!(
            (gray.source(), binary.source()),
            (Source::Stack, Source::Stack)
        );
        // SAFETY: all three are on this stream's device and outlive its work.
        unsafe {
            kernels::bgr_to_gray(k, &s, src.pitched(), gray.pitched_mut())?;
            kernels::threshold(k, &s, gray.pitched(), binary.pitched_mut(), t)?;
        }
        if i == 19 {
            binary.download(&mut out)?;
        }
        if i == 0 {
            calls_after_first = gpu.stats().driver_alloc_calls;
        }
    }
    let extra = gpu.stats().driver_alloc_calls - calls_after_first;
    println!(
        "pipeline {rows}x{cols} x20 on {}: driver allocation calls after iteration 1: {extra}",
        gpu.id()
    );
    assert_eq!(extra, 0);
    let wrong = image
        .iter()
        .zip(&out)
        .filter(|&(&px, &o)| (if gray_of(px) > t { 255 } else { 0 }) != o)
        .count();
    assert_eq!(wrong, 0, "pixels differing from the CPU reference");
    Ok(())
}

/// One round of the cross-stream hazard: `owner` lends a stack buffer to a slow reader on `user`,
/// releases it, and reuses the memory at once. Returns what the reader saw.
fn reuse_while_another_stream_reads(
    gpu: &Device,
    k: &Kernels,
    record: bool,
) -> Result<Vec<u8>, Box<dyn Error>> {
    let owner = Stream::new(gpu)?;
    let user = Stream::new(gpu)?;
    let n = 1 << 20;
    let seen = GpuMat::<u8>::new(&user, 1, n)?;
    let pool = BufferPool::new(&owner);
    let mut lent = pool.get_buffer_1d::<u8>(n)?;
    lent.set_to(1)?;
    owner.synchronize()?;
    let address = lent.device_ptr();
    let spin = 200_000_000; // about 0.1 s at H100 clocks
    // SAFETY: `lent` and `seen` hold n bytes each and outlive the kernel (the reader's result is
    // read back after it; `lent`'s memory is what the test watches being reused).
    unsafe {
        let cuda = user.cudarc().expect("CUDA");
        kernels::slow_copy(k, cuda, (lent.device_ptr(), seen.device_ptr()), n, spin)?;
    }
    if record {
        lent.record_stream(&user)?;
    }
    drop(lent);
    let mut reused = pool.get_buffer_1d::<u8>(n)?;
    assert_eq!(
        reused.device_ptr(),
        address,
        "the stack hands the same memory out again"
    );
    reused.set_to(2)?;
    Ok(seen.to_vec()?)
}

#[test]
fn record_stream_keeps_memory_from_reuse_until_the_other_stream_is_done() -> TestResult {
    let Some((gpu, _lock)) = gpu("record_stream") else {
        return Ok(());
    };
    let k = Kernels::load(&gpu);
    let unprotected = reuse_while_another_stream_reads(&gpu, &k, false)?;
    let clobbered = unprotected.iter().filter(|&&v| v != 1).count();
    println!(
        "without record_stream: {clobbered} of {} bytes read after reuse (the hazard)",
        unprotected.len()
    );
    let protected = reuse_while_another_stream_reads(&gpu, &k, true)?;
    assert!(
        protected.iter().all(|&v| v == 1),
        "with record_stream the reader saw the original data"
    );
    println!(
        "with record_stream: all {} bytes as written",
        protected.len()
    );
    Ok(())
}

#[test]
fn fallbacks_on_cuda_are_counted_and_work() -> TestResult {
    let Some((gpu, _lock)) = gpu("cuda_fallbacks") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, MIB, 1)?;
    for fallback in [Fallback::Driver, Fallback::StreamOrdered, Fallback::Error] {
        gpu.set_fallback(fallback);
        let stream = Stream::new(&gpu)?;
        let pool = BufferPool::new(&stream);
        let before = gpu.stats();
        match pool.get_buffer::<f32>(1024, 1024) {
            Ok(mut big) => {
                assert_eq!(big.source(), Source::Fallback(FallbackReason::TooLarge));
                big.set_to(3.0)?;
                assert!(big.to_vec()?.iter().all(|&v| v == 3.0));
                drop(big);
                let after = gpu.stats();
                assert_eq!(
                    after.driver_alloc_calls - before.driver_alloc_calls,
                    1,
                    "{fallback:?}"
                );
                assert_eq!(
                    after.driver_free_calls - before.driver_free_calls,
                    1,
                    "{fallback:?}"
                );
            }
            Err(e) => {
                assert_eq!(fallback, Fallback::Error);
                assert!(
                    matches!(
                        e,
                        PoolError::StackExhausted {
                            reason: FallbackReason::TooLarge,
                            ..
                        }
                    ),
                    "{e}"
                );
            }
        }
    }
    gpu.set_fallback(Fallback::Driver);
    set_buffer_pool_config(&gpu, 10 * MIB, 5)?;
    Ok(())
}

#[test]
fn stack_memory_larger_than_the_device_is_out_of_memory() -> TestResult {
    let Some((gpu, _lock)) = gpu("cuda_oom") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, 1 << 40, 4)?; // 4 TiB
    let starved = Stream::new(&gpu)?;
    assert_eq!(gpu.stats().stacks_held, 0);
    let b = BufferPool::new(&starved).get_buffer_1d::<u8>(10)?;
    println!(
        "4 TiB of stacks: the stream is made, its buffer from {:?}",
        b.source()
    );
    assert_eq!(b.source(), Source::Fallback(FallbackReason::NoStackMemory));
    drop(b);
    drop(starved);
    set_buffer_pool_config(&gpu, 10 * MIB, 5)?;
    let stream = Stream::new(&gpu)?;
    assert!(BufferPool::new(&stream).get_buffer_1d::<u8>(10)?.source() == Source::Stack);
    Ok(())
}

#[test]
fn the_device_guard_restores_the_callers_context() -> TestResult {
    let Some((gpu, _lock)) = gpu("device_guard") else {
        return Ok(());
    };
    let other = CudaContext::new_non_primary(0, 0)?; // a context that is not gpu-pool's
    other.bind_to_thread()?;
    let before = cu::ctx::get_current()?;
    let stream = Stream::new(&gpu)?;
    let mut buf = BufferPool::new(&stream).get_buffer::<u32>(64, 64)?;
    buf.set_to(7)?;
    assert!(buf.to_vec()?.iter().all(|&v| v == 7));
    buf.record_stream(&Stream::new(&gpu)?)?; // events are made and destroyed too
    drop(buf);
    drop(stream);
    assert_eq!(
        cu::ctx::get_current()?,
        before,
        "the caller's context is current again"
    );
    Ok(())
}

#[test]
fn a_stream_of_the_users_own_carries_pool_buffers_and_kernels() -> TestResult {
    let Some((gpu, _lock)) = gpu("from_cuda") else {
        return Ok(());
    };
    let ctx: Arc<CudaContext> = gpu.cudarc().expect("CUDA").clone();
    let theirs = ctx.new_stream()?;
    let stream = Stream::from_cuda(&gpu, theirs.clone())?;
    let k = Kernels::load(&gpu);
    let mut a = BufferPool::new(&stream).get_buffer::<u8>(16, 600)?;
    // SAFETY: `a` is on the device of `theirs` and outlives the kernel.
    unsafe { kernels::fill_pattern(&k, &theirs, a.pitched_mut(), 1)? };
    let out = a.to_vec()?;
    assert_eq!(out[600 + 3], pattern(3, 1, 1));
    Ok(())
}

#[test]
fn each_device_allocates_in_its_own_context() -> TestResult {
    let Some((gpu0, _lock)) = gpu("several_devices") else {
        return Ok(());
    };
    let count = Device::cuda_device_count()?;
    if count < 2 {
        crate::common::skipped(&format!(
            "several_devices: skipped: {count} CUDA device(s), 2 needed"
        ));
        return Ok(());
    }
    let gpu1 = Device::cuda(1)?;
    gpu0.cudarc().expect("CUDA").bind_to_thread()?;
    let s0 = Stream::new(&gpu0)?;
    let s1 = Stream::new(&gpu1)?;
    let mut a = BufferPool::new(&s0).get_buffer_1d::<u32>(1000)?;
    let mut b = BufferPool::new(&s1).get_buffer_1d::<u32>(1000)?;
    a.set_to(10)?;
    b.set_to(11)?;
    assert_eq!(
        cu::ctx::get_current()?,
        Some(gpu0.cudarc().expect("CUDA").cu_ctx())
    );
    assert!(a.to_vec()?.iter().all(|&v| v == 10));
    assert!(b.to_vec()?.iter().all(|&v| v == 11));
    assert!(matches!(
        a.copy_from(&b),
        Err(PoolError::DeviceMismatch { .. })
    ));
    println!("several_devices: buffers on cuda:0 and cuda:1, context of cuda:0 kept current");
    Ok(())
}

#[test]
fn box_filter_kernels_match_the_cpu_at_a_ragged_size() -> TestResult {
    let Some((gpu, _lock)) = gpu("box_filter") else {
        return Ok(());
    };
    let k = Kernels::load(&gpu);
    let stream = Stream::new(&gpu)?;
    let s = stream.cudarc().expect("CUDA").clone();
    let pool = BufferPool::new(&stream);
    // 1001 columns: each row ends in a partial group of four.
    let (rows, cols, r) = (37usize, 1001usize, 2i32);
    let image: Vec<u8> = (0..rows * cols).map(|i| (i * 37 % 251) as u8).collect();
    let src = GpuMat::from_host(&stream, rows, cols, &image)?;
    let mut tmp = pool.get_buffer::<f32>(rows, cols)?;
    let mut dst = pool.get_buffer::<u8>(rows, cols)?;
    let (c, mode) = (0i32, 0i32);
    // SAFETY: the three pitched buffers hold rows x cols of their element and outlive the kernels
    // (`to_vec` below waits for the stream).
    unsafe {
        crate::common::kernels::box_passes(
            &k,
            &s,
            (src.pitched(), tmp.pitched_mut()),
            dst.pitched_mut(),
            r,
            (c, mode),
        )?;
    }
    let at = |y: i64, x: i64| {
        let (y, x) = (y.clamp(0, rows as i64 - 1), x.clamp(0, cols as i64 - 1));
        f32::from(image[y as usize * cols + x as usize])
    };
    let r = i64::from(r);
    let wrong = dst
        .to_vec()?
        .iter()
        .enumerate()
        .filter(|&(i, &v)| {
            let (y, x) = ((i / cols) as i64, (i % cols) as i64);
            let sum: f32 = (-r..=r)
                .flat_map(|dy| (-r..=r).map(move |dx| (dy, dx)))
                .map(|(dy, dx)| at(y + dy, x + dx))
                .sum();
            v != (sum / ((2 * r + 1) * (2 * r + 1)) as f32 + 0.5) as u8
        })
        .count();
    assert_eq!(wrong, 0, "pixels differing from the CPU box filter");
    Ok(())
}

/// How many of `values` are not `expected`: the wrong bytes a missing wait leaves.
pub(crate) fn count_not(values: &[u8], expected: u8) -> usize {
    values.iter().filter(|&&v| v != expected).count()
}

/// Keeps `stream` busy for about 0.1 s (a spinning kernel on two bytes of `tick`), so work queued
/// after it is still pending when the host goes on: what makes a missing wait visible.
pub(crate) fn stall(stream: &Stream, k: &Kernels, tick: &GpuMat<'_, u8>) -> TestResult {
    let (src, dst) = (tick.device_ptr(), tick.device_ptr() + 1);
    // SAFETY: copies 1 byte within `tick`'s 2 bytes, which the caller keeps allocated until the
    // stream is done.
    unsafe {
        kernels::slow_copy(
            k,
            stream.cudarc().expect("CUDA"),
            (src, dst),
            1,
            200_000_000,
        )?
    };
    Ok(())
}

#[test]
fn an_upload_from_page_locked_memory_is_complete_when_it_returns() -> TestResult {
    let Some((gpu, _lock)) = gpu("upload_pinned") else {
        return Ok(());
    };
    let k = Kernels::load(&gpu);
    let stream = Stream::new(&gpu)?;
    let tick = GpuMat::<u8>::new(&stream, 1, 2)?;
    let n = 4 << 20;
    let mut mix = gpu_pool::compat::mix::MixMemory::new(&gpu)?;
    mix.cpu::<u8>(n)?.fill(1); // page-locked: the driver copies from it asynchronously
    let mut mat = GpuMat::<u8>::new(&stream, 1, n)?;
    stall(&stream, &k, &tick)?;
    mat.upload(mix.cpu::<u8>(n)?)?;
    mix.cpu::<u8>(n)?.fill(2); // the slice may be reused as soon as `upload` returns
    let seen = mat.to_vec()?;
    let wrong = seen.iter().filter(|&&v| v != 1).count();
    println!("upload from pinned memory: {wrong} of {n} bytes differ from what was uploaded");
    assert_eq!(wrong, 0);
    Ok(())
}

#[test]
fn a_forgotten_mix_memory_has_no_copy_in_flight_into_a_wrapped_slice() -> TestResult {
    let Some((gpu, _lock)) = gpu("mix_forget") else {
        return Ok(());
    };
    let k = Kernels::load(&gpu);
    let stream = Stream::new(&gpu)?;
    let tick = GpuMat::<u8>::new(&stream, 1, 2)?;
    let n = 4 << 20;
    let mut source = GpuMat::<u8>::new(&stream, 1, n)?;
    source.set_to(7)?;
    stream.synchronize()?;
    // The wrapped slice is page-locked (another pair's host side), so the driver copies into it
    // asynchronously; into pageable memory it would wait anyway.
    let mut pinned = gpu_pool::compat::mix::MixMemory::new(&gpu)?;
    let mut mix = gpu_pool::compat::mix::MixMemory::wrap_cpu(&gpu, pinned.cpu::<u8>(n)?)?;
    // SAFETY: `source` holds n bytes and outlives the pair, which only reads it.
    unsafe { mix.wrap_gpu(source.device_ptr(), n)? };
    stall(&stream, &k, &tick)?;
    mix.copy_to_cpu_async(&stream)?;
    std::mem::forget(mix); // ends the borrow of the slice with no drop to wait for the copy
    let arrived = pinned.cpu::<u8>(n)?.iter().filter(|&&v| v == 7).count();
    println!("after forgetting the pair: {arrived} of {n} bytes of the copy are in the slice");
    assert_eq!(
        arrived, n,
        "the copy into a borrowed slice finished before returning"
    );
    stream.synchronize()?;
    Ok(())
}

#[test]
fn a_copy_from_another_stream_waits_for_its_writes_and_holds_off_its_reuse() -> TestResult {
    let Some((gpu, _lock)) = gpu("cross_stream_copy") else {
        return Ok(());
    };
    let k = Kernels::load(&gpu);
    let (a, b) = (Stream::new(&gpu)?, Stream::new(&gpu)?);
    let (tick_a, tick_b) = (GpuMat::<u8>::new(&a, 1, 2)?, GpuMat::<u8>::new(&b, 1, 2)?);
    let n = 4 << 20;
    let pool = BufferPool::new(&a);
    let mut dst = GpuMat::<u8>::new(&b, 1, n)?;

    // Writes still queued on `a` when `b` copies: the copy must come after them.
    let mut src = pool.get_buffer_1d::<u8>(n)?;
    src.set_to(0)?;
    a.synchronize()?;
    stall(&a, &k, &tick_a)?;
    src.set_to(1)?;
    dst.copy_from(&src)?;
    let stale = dst.to_vec()?.iter().filter(|&&v| v != 1).count();
    println!("copy after the source stream's writes: {stale} of {n} bytes stale");
    assert_eq!(stale, 0);
    a.synchronize()?;

    // The copy still queued on `b` when `src` goes back to `a`'s stack and is reused at once.
    stall(&b, &k, &tick_b)?;
    dst.copy_from(&src)?;
    let address = src.device_ptr();
    drop(src);
    let mut reused = pool.get_buffer_1d::<u8>(n)?;
    assert_eq!(
        reused.device_ptr(),
        address,
        "the stack hands the memory out again"
    );
    reused.set_to(2)?;
    let clobbered = dst.to_vec()?.iter().filter(|&&v| v != 1).count();
    println!("copy before the source's memory was reused: {clobbered} of {n} bytes clobbered");
    assert_eq!(clobbered, 0);
    Ok(())
}

/// `capture_with` takes a closure of the caller's own error type: its error comes back as it is,
/// the pool's errors inside (with `?`) and around it converted, and a graph is made as `capture`'s.
#[test]
fn capture_with_passes_the_closures_own_error_through() -> TestResult {
    #[derive(Debug)]
    enum AppError {
        Pool(PoolError),
        Mine,
    }
    impl From<PoolError> for AppError {
        fn from(e: PoolError) -> Self {
            AppError::Pool(e)
        }
    }
    let Some((gpu, _lock)) = gpu("capture_with") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, MIB, 1)?;
    let stream = Stream::new(&gpu)?;

    let err = stream
        .capture_with::<AppError>(|s| {
            BufferPool::new(s).get_buffer_1d::<u8>(64)?.set_to(1)?;
            Err(AppError::Mine)
        })
        .unwrap_err();
    assert!(matches!(err, AppError::Mine), "{err:?}");
    assert_eq!(stream.stats().stack_in_use, 0, "no fence left behind");

    let err = stream
        .capture_with::<AppError>(|s| {
            let _too_big = BufferPool::new(s).get_buffer_1d::<u8>(8 * MIB)?;
            Ok(())
        })
        .unwrap_err();
    assert!(
        matches!(
            err,
            AppError::Pool(PoolError::Capture(CaptureError::NeedsStack { .. }))
        ),
        "{err:?}"
    );

    let graph = stream
        .capture_with::<AppError>(|s| {
            BufferPool::new(s).get_buffer_1d::<u8>(64)?.set_to(7)?;
            Ok(())
        })
        .map_err(|e| format!("{e:?}"))?;
    graph.launch()?;
    assert!(graph.stack_bytes() >= 64, "the replays' buffer is held");
    drop(graph);
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}

#[test]
fn capture_is_unsupported_on_the_host_backend() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let err = stream.capture(|_| Ok(())).unwrap_err();
    assert!(matches!(err, PoolError::Unsupported { .. }), "{err}");
    let mut after = BufferPool::new(&stream).get_buffer_1d::<u8>(8)?;
    after.set_to(3)?;
    assert_eq!(after.to_vec()?, vec![3; 8]);
    drop(after);
    assert_eq!(stream.stats().stack_in_use, 0, "no fence left behind");
    Ok(())
}

/// A 512x512 BGR image of `pattern` with `seed`.
fn pattern_image(seed: i32) -> Vec<[u8; 3]> {
    (0..512 * 512)
        .map(|i| {
            let (x, y) = (i % 512, i / 512);
            [
                pattern(3 * x, y, seed),
                pattern(3 * x + 1, y, seed),
                pattern(3 * x + 2, y, seed),
            ]
        })
        .collect()
}

#[test]
fn a_captured_pooled_pipeline_replays_1000_times_with_no_allocation() -> TestResult {
    let Some((gpu, _lock)) = gpu("graph_replay") else {
        return Ok(());
    };
    let k = Kernels::load(&gpu);
    let stream = Stream::new(&gpu)?;
    let src = GpuMat::from_host(&stream, 512, 512, &pattern_image(1))?;
    let (out, eager) = (
        GpuMat::<u8>::new(&stream, 512, 512)?,
        GpuMat::<u8>::new(&stream, 512, 512)?,
    );
    let expected = |seed| -> Result<Vec<u8>, Box<dyn Error>> {
        let input = GpuMat::from_host(&stream, 512, 512, &pattern_image(seed))?;
        crate::common::kernels::six_kernels(&stream, &k, &input, &eager)?;
        Ok(eager.to_vec()?)
    };
    let first = expected(1)?;
    assert!(first.contains(&0) && first.contains(&255));

    let stack_before = stream.stats().stack_in_use;
    let graph = stream.capture(|s| crate::common::kernels::six_kernels(s, &k, &src, &out))?;
    let held = stream.stats().stack_in_use - stack_before;
    println!("graph: holds {held} stack bytes for its three temporaries");
    assert!(held >= 512 * 512 * (1 + 1 + 4), "three 512x512 temporaries");
    assert_eq!(graph.stack_bytes(), held);

    let calls = gpu.stats();
    for _ in 0..1000 {
        graph.launch()?;
    }
    let replayed = out.to_vec()?; // outputs are readable between replays
    let after = gpu.stats();
    assert_eq!(
        replayed, first,
        "1000 replays compute what the eager call does"
    );
    assert_eq!(after.driver_alloc_calls, calls.driver_alloc_calls);
    assert_eq!(after.driver_free_calls, calls.driver_free_calls);
    println!(
        "graph: 1000 replays, output equal to the eager call's, {} driver allocation calls",
        after.driver_alloc_calls - calls.driver_alloc_calls
    );

    // Buffers taken while the graph lives never get the memory its replays write.
    let mut other = BufferPool::new(&stream).get_buffer::<u8>(512, 512)?;
    other.set_to(7)?;
    graph.launch()?;
    assert!(
        other.to_vec()?.iter().all(|&v| v == 7),
        "the replay left it alone"
    );
    drop(other);

    // A replay reads its input when it runs: rewrite the input through its address, replay.
    let input = pattern_image(2);
    let staging = GpuMat::from_host(&stream, 512, 512, &input)?;
    // SAFETY: both hold 512x512 3-byte pixels (512 x 1536 bytes) at their steps, on this
    // stream, and outlive the kernel; `src` is written through its address, as the graph reads it.
    unsafe {
        let cuda = stream.cudarc().expect("CUDA");
        let from = Pitched::<u8>::from_raw_parts(staging.device_ptr(), staging.step(), 512, 1536);
        let to = PitchedMut::<u8>::from_raw_parts(src.device_ptr(), src.step(), 512, 1536);
        crate::common::kernels::invert(&k, cuda, from, to)?;
    }
    graph.launch()?;
    let inverted: Vec<[u8; 3]> = input.iter().map(|p| p.map(|b| 255 - b)).collect();
    let second = {
        let again = GpuMat::from_host(&stream, 512, 512, &inverted)?;
        crate::common::kernels::six_kernels(&stream, &k, &again, &eager)?;
        eager.to_vec()?
    };
    assert_eq!(out.to_vec()?, second, "the replay read the new input");
    assert_ne!(second, first);
    drop(graph);
    let stats = stream.stats();
    assert_eq!(
        stats.stack_in_use, stack_before,
        "the graph's stack bytes are back"
    );
    assert_eq!(stats.lifo_violations, 0);
    Ok(())
}

#[test]
fn capture_refuses_what_would_break_it_and_leaves_the_stream_usable() -> TestResult {
    let Some((gpu, _lock)) = gpu("graph_refusals") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, 4 * MIB, 2)?;
    let stream = Stream::new(&gpu)?;
    let usable = |stream: &Stream| -> Result<(), PoolError> {
        let mut b = BufferPool::new(stream).get_buffer::<u16>(64, 64)?;
        b.set_to(9)?;
        assert!(b.to_vec()?.iter().all(|&v| v == 9));
        drop(b);
        assert_eq!(stream.stats().stack_in_use, 0, "nothing left held");
        Ok(())
    };

    let err = stream
        .capture(|s| {
            let _too_big = BufferPool::new(s).get_buffer_1d::<u8>(8 * MIB)?;
            Ok(())
        })
        .unwrap_err();
    assert!(
        matches!(err, PoolError::Capture(CaptureError::NeedsStack { .. })),
        "{err}"
    );
    usable(&stream)?;

    let err = stream
        .capture(|s| GpuMat::<u8>::new(s, 4, 4).map(drop))
        .unwrap_err();
    assert!(
        matches!(err, PoolError::Capture(CaptureError::Allocates { .. })),
        "{err}"
    );
    usable(&stream)?;

    let err = stream
        .capture(|s| {
            let b = BufferPool::new(s).get_buffer_1d::<u8>(64)?;
            b.to_vec().map(drop) // a download waits for the stream: not capturable
        })
        .unwrap_err();
    println!("a download inside a capture: {err}");
    assert!(
        matches!(err, PoolError::Capture(CaptureError::HostCopy { .. })),
        "{err}"
    );
    usable(&stream)?;

    // An upload from a pageable slice: the driver would record it, reading the slice at every
    // replay after it is gone.
    let err = stream
        .capture(|s| {
            let mut b = BufferPool::new(s).get_buffer_1d::<u8>(64)?;
            b.upload(&[7u8; 64])
        })
        .unwrap_err();
    println!("an upload inside a capture: {err}");
    assert!(
        matches!(err, PoolError::Capture(CaptureError::HostCopy { .. })),
        "{err}"
    );
    usable(&stream)?;

    // Keeping a buffer through `&mut` of an outer vector does not compile (the vector would stay
    // borrowed for the stream's life); shared ownership gets past the borrow checker, and is
    // refused at run time.
    let kept = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let inside = kept.clone();
    let err = stream
        .capture(move |s| {
            inside
                .borrow_mut()
                .push(BufferPool::new(s).get_buffer_1d::<u8>(64)?);
            Ok(())
        })
        .unwrap_err();
    assert!(
        matches!(err, PoolError::Capture(CaptureError::KeptBuffers)),
        "{err}"
    );
    assert_eq!(
        kept.borrow().len(),
        1,
        "the kept buffer is still a valid buffer"
    );
    kept.borrow_mut().clear();
    usable(&stream)?;

    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = stream.capture(|s| {
            let _b = BufferPool::new(s).get_buffer_1d::<u8>(64)?;
            panic!("a kernel launch went wrong");
        });
    }));
    assert!(panicked.is_err());
    usable(&stream)?;
    println!("capture: every refusal left the stream usable and its stack empty");
    Ok(())
}

/// A capture's work: a temporary filled with `value`, copied into `out`.
fn fill_work<'a>(
    value: u32,
    out: &'a mut GpuMat<'_, u32>,
) -> impl FnOnce(&Stream) -> Result<(), PoolError> + 'a {
    move |s| {
        let mut t = BufferPool::new(s).get_buffer::<u32>(out.rows(), out.cols())?;
        t.set_to(value)?;
        out.copy_from(&t)
    }
}

/// A panic inside each kind of capture (`Stream::capture`, `capture_with`, a family's) ends the
/// driver's capture, discards its graph and leaves nothing set: the stream is not capturing, its
/// stack is empty and its high-water mark as it was, and the same capture works right after.
#[test]
fn a_panic_inside_any_capture_leaves_the_same_capture_working() -> TestResult {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let Some((gpu, _lock)) = gpu("capture_panics") else {
        return Ok(());
    };
    set_buffer_pool_config(&gpu, 4 * MIB, 1)?;
    let stream = Stream::new(&gpu)?;
    let mut out = GpuMat::<u32>::new(&stream, 64, 64)?;
    drop(BufferPool::new(&stream).get_buffer::<u32>(256, 256)?); // a high-water mark to keep
    let mark = stream.stats().stack_high_water;
    let clean = |stream: &Stream, what: &str| -> TestResult {
        let status = stream.cudarc().expect("CUDA").capture_status()?;
        let stats = stream.stats();
        println!(
            "capture_panics: after a panic in {what}: capture status {status:?}, {} stack bytes \
             in use, high-water mark {} (was {mark})",
            stats.stack_in_use, stats.stack_high_water
        );
        assert_eq!(
            status,
            gpu_pool::interop::cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        );
        assert_eq!(stats.stack_in_use, 0);
        assert_eq!(stats.stack_high_water, mark);
        Ok(())
    };
    let boom = |s: &Stream| -> Result<(), PoolError> {
        let _t = BufferPool::new(s).get_buffer::<u32>(64, 64)?;
        panic!("a kernel launch went wrong")
    };

    let panicked = catch_unwind(AssertUnwindSafe(|| drop(stream.capture(boom))));
    assert!(panicked.is_err());
    clean(&stream, "Stream::capture")?;
    stream.capture(fill_work(1, &mut out))?.launch()?;
    assert!(out.to_vec()?.iter().all(|&v| v == 1));

    let panicked = catch_unwind(AssertUnwindSafe(|| {
        drop(stream.capture_with::<Box<dyn Error>>(|s| Ok(boom(s)?)));
    }));
    assert!(panicked.is_err());
    clean(&stream, "Stream::capture_with")?;
    stream
        .capture_with::<Box<dyn Error>>(|s| Ok(fill_work(2, &mut out)(s)?))?
        .launch()?;
    assert!(out.to_vec()?.iter().all(|&v| v == 2));

    {
        let family = stream.graph_family()?;
        let panicked = catch_unwind(AssertUnwindSafe(|| drop(family.capture(boom))));
        assert!(panicked.is_err());
        let status = stream.cudarc().expect("CUDA").capture_status()?;
        println!("capture_panics: after a panic in GraphFamily::capture: {status:?}");
        family.capture(fill_work(3, &mut out))?.launch()?;
    }
    assert!(out.to_vec()?.iter().all(|&v| v == 3));
    clean(&stream, "GraphFamily::capture (family dropped)")?;
    Ok(())
}

/// A panic inside `with_blas_workspace` gives the handle its own workspace back (the guard runs
/// on unwind): the same call works right after.
/// A handle's own workspace is one driver allocation. A graph may outlive the handle that
/// captured into it (here the handle is shared through an `Rc` the capture's closure owned), so a
/// dropped handle's workspace is kept for the next handle on the same stream, whose work comes
/// after the graph's replays there, and never handed to another stream; it is freed once nothing
/// holds its stream. Inside a capture, where the allocation would join the graph, a handle is
/// refused.
#[cfg(feature = "cublas")]
#[test]
fn a_blas_workspace_outlives_the_graphs_that_used_it_and_stays_on_its_stream() -> TestResult {
    use crate::common::dense::{BATCH, IN, OUT, dense_relu_gpu, largest_difference, parameters};
    let Some((gpu, _lock)) = gpu("blas_own_workspace") else {
        return Ok(());
    };
    let kernels = crate::common::kernels::Kernels::load(&gpu);
    let (wv, bv) = parameters();
    let xv: Vec<f32> = (0..BATCH * IN)
        .map(|i| (i % 89) as f32 / 89.0 - 0.5)
        .collect();
    let allocs = || gpu.stats().driver_alloc_calls;
    let frees = || gpu.stats().driver_free_calls;
    let (stream, other) = (Stream::new(&gpu)?, Stream::new(&gpu)?);
    let (w, b) = (
        GpuMat::from_host(&stream, IN, OUT, &wv)?,
        GpuMat::from_host(&stream, 1, OUT, &bv)?,
    );
    let x = GpuMat::from_host(&stream, BATCH, IN, &xv)?;
    let mut y = GpuMat::<f32>::new(&stream, BATCH, OUT)?;

    let before = allocs();
    let blas = std::rc::Rc::new(stream.cublas()?);
    let made = allocs() - before;
    let inside = std::rc::Rc::clone(&blas);
    let (k, out) = (&kernels, &mut y);
    let graph = stream.capture(move |s| dense_relu_gpu(s, &inside, k, &x, &w, &b, out))?;
    let (before, freed_before) = (allocs(), frees());
    drop(blas); // the last handle: the graph still writes its workspace at every replay
    let elsewhere = other.cublas()?; // must not be given that workspace
    let fresh_elsewhere = allocs() - before;
    for _ in 0..20 {
        graph.launch()?;
    }
    stream.synchronize()?;
    let again = stream.cublas()?; // the same stream: its workspace again, after the replays
    let reused = allocs() - before - fresh_elsewhere == 0;
    let freed_meanwhile = frees() - freed_before;
    drop(graph);
    let worst = largest_difference(&y.to_vec()?, &xv, &wv, &bv);
    println!(
        "blas_own_workspace: {made} allocation for a handle; after it was dropped with its graph \
         alive: {fresh_elsewhere} new for another stream's handle, the same stream's next handle \
         reused it: {reused}, {freed_meanwhile} frees; the replays' largest relative difference \
         {worst:.2e}"
    );
    assert!(worst < 1e-4);
    assert_eq!(made, 1);
    assert_eq!(
        fresh_elsewhere, 1,
        "another stream never gets a workspace a graph may use"
    );
    assert!(reused);
    assert_eq!(freed_meanwhile, 0);

    // Once nothing holds the other stream, its idle workspace goes back (at the next handle's
    // making or dropping), after the stream is done.
    drop(elsewhere);
    drop(other);
    let freed_before = frees();
    drop(again);
    stream.synchronize()?;
    println!(
        "blas_own_workspace: frees once the other stream is gone: {}",
        frees() - freed_before
    );
    assert_eq!(frees() - freed_before, 1);

    let mut refused = None;
    let graph = stream.capture(|s| {
        refused = Some(s.cublas().map(drop));
        Ok(())
    })?;
    drop(graph);
    println!("blas_own_workspace: a handle made inside a capture: {refused:?}");
    assert!(matches!(
        refused,
        Some(Err(PoolError::Capture(CaptureError::Allocates { .. })))
    ));
    Ok(())
}

#[cfg(feature = "cublas")]
#[test]
fn a_panic_inside_with_blas_workspace_leaves_it_working() -> TestResult {
    use gpu_pool::interop::with_blas_workspace;
    let Some((gpu, _lock)) = gpu("blas_workspace_panic") else {
        return Ok(());
    };
    let stream = Stream::new(&gpu)?;
    let mut blas = stream.cublas()?;
    let mut room = BufferPool::new(&stream).get_buffer_1d::<u8>(MIB)?;
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = with_blas_workspace(&mut blas, room.view_mut(), |_| panic!("a GEMM went wrong"));
    }));
    assert!(panicked.is_err());
    let again = with_blas_workspace(&mut blas, room.view_mut(), |_| 7);
    println!("blas_workspace_panic: the call after the panic: {again:?}");
    assert_eq!(again?, 7);
    Ok(())
}

#[cfg(feature = "cublas")]
#[test]
fn a_pooled_dense_layer_runs_its_gemm_in_cublas_on_a_stack_buffer() -> TestResult {
    use crate::common::dense::{
        BATCH, Engine, IN, OUT, dense_relu, engine, largest_difference, parameters,
    };
    let Some((gpu, _lock)) = gpu("cublas_dense") else {
        return Ok(());
    };
    let stream = Stream::new(&gpu)?;
    let (engine, described) = engine(&gpu, &stream)?;
    assert!(matches!(engine, Engine::Gpu { .. }), "{described}");
    let (wv, bv) = parameters();
    let xv: Vec<f32> = (0..BATCH * IN)
        .map(|i| (i % 97) as f32 / 97.0 - 0.5)
        .collect();
    let w = GpuMat::from_host(&stream, IN, OUT, &wv)?;
    let b = GpuMat::from_host(&stream, 1, OUT, &bv)?;
    let x = GpuMat::from_host(&stream, BATCH, IN, &xv)?;
    let mut y = GpuMat::<f32>::new(&stream, BATCH, OUT)?;
    dense_relu(&stream, &engine, &x, &w, &b, &mut y)?;
    let calls = stream.stats().driver_alloc_calls;
    for _ in 0..100 {
        dense_relu(&stream, &engine, &x, &w, &b, &mut y)?;
    }
    let got = y.to_vec()?;
    let worst = largest_difference(&got, &xv, &wv, &bv);
    let stats = stream.stats();
    println!(
        "cuBLAS dense layer: largest relative difference {worst:.2e}; 101 calls, {} stack \
         intermediates, {} driver allocation calls after the first",
        stats.stack_allocations,
        stats.driver_alloc_calls - calls
    );
    assert!(worst < 1e-4);
    assert!(
        got.iter().any(|&v| v > 0.0) && got.contains(&0.0),
        "ReLU did work"
    );
    assert_eq!(stats.driver_alloc_calls, calls);
    assert_eq!(stats.fallback_allocations.total(), 0);
    Ok(())
}

/// A captured GEMM whose cuBLAS workspace is a stack buffer: the graph has no allocation node,
/// holds the workspace with its other buffers, and replays to the CPU's result.
#[cfg(feature = "cublas")]
#[test]
fn a_captured_gemm_works_in_a_stack_workspace_and_allocates_nothing() -> TestResult {
    use crate::common::dense::{
        BATCH, Engine, IN, OUT, dense_relu_gpu, engine, largest_difference, parameters,
    };
    use gpu_pool::{interop::with_blas_workspace, shared::SharedMat};
    let Some((gpu, _lock)) = gpu("cublas_workspace") else {
        return Ok(());
    };
    let stream = Stream::new(&gpu)?;
    let (mut engine, _) = engine(&gpu, &stream)?;
    let Engine::Gpu { blas, kernels } = &mut engine else {
        panic!("a GPU engine on a CUDA stream")
    };
    let kernels = &*kernels;
    let (wv, bv) = parameters();
    let xv: Vec<f32> = (0..BATCH * IN)
        .map(|i| (i % 89) as f32 / 89.0 - 0.5)
        .collect();
    let w = GpuMat::from_host(&stream, IN, OUT, &wv)?;
    let b = GpuMat::from_host(&stream, 1, OUT, &bv)?;
    let x = GpuMat::from_host(&stream, BATCH, IN, &xv)?;
    let mut y = GpuMat::<f32>::new(&stream, BATCH, OUT)?;
    let right = |y: &GpuMat<'_, f32>| -> Result<f32, PoolError> {
        Ok(largest_difference(&y.to_vec()?, &xv, &wv, &bv))
    };
    const WORKSPACE: usize = 4 * MIB;

    let nodes_without = |blas: &gpu_pool::interop::cudarc::cublas::CudaBlas,
                         y: &mut GpuMat<'_, f32>| {
        stream
            .capture(|s| dense_relu_gpu(s, blas, kernels, &x, &w, &b, y))?
            .nodes()
    };
    let before = nodes_without(blas, &mut y)?;
    // The control: cudarc's own handle on the same stream, with cuBLAS's default workspace, which
    // cuBLAS allocates inside the capture.
    let bare =
        gpu_pool::interop::cudarc::cublas::CudaBlas::new(stream.cudarc().expect("CUDA").clone())?;
    let default_pool = nodes_without(&bare, &mut y)?;
    drop(bare);
    let graph = stream.capture(|s| {
        let mut room = BufferPool::new(s).get_buffer_1d::<u8>(WORKSPACE)?;
        with_blas_workspace(blas, room.view_mut(), |blas| {
            dense_relu_gpu(s, blas, kernels, &x, &w, &b, &mut y)
        })?
    })?;
    let nodes = graph.nodes()?;
    let calls = stream.stats().driver_alloc_calls;
    for _ in 0..10 {
        graph.launch()?;
    }
    stream.synchronize()?;
    let (held, after) = (graph.stack_bytes(), stream.stats().driver_alloc_calls);
    drop(graph);
    let worst = right(&y)?;
    // Afterwards the handle has its own workspace again: the same capture as before it.
    let restored = nodes_without(blas, &mut y)?;
    println!(
        "captured dense layer: on cuBLAS's default workspace {default_pool:?}; in the handle's \
         own {before:?}; with a 4 MiB stack workspace {nodes:?}, {held} stack bytes held, {} \
         driver allocation calls in 10 replays, largest relative difference {worst:.2e}; in its \
         own again afterwards {restored:?}",
        after - calls
    );
    assert!(
        default_pool.allocs > 0,
        "cuBLAS allocates its default workspace in the graph"
    );
    assert_eq!(
        (before.allocs, before.frees),
        (0, 0),
        "Stream::cublas's own workspace"
    );
    assert_eq!((nodes.allocs, nodes.frees), (0, 0));
    assert!(nodes.kernels >= 2, "the GEMM and the bias/ReLU kernel");
    assert!(held >= WORKSPACE, "the graph holds the workspace");
    assert_eq!(after, calls);
    assert!(worst < 1e-4);
    assert_eq!(restored, before, "the handle's own workspace is back");

    // Refused: memory of another stream (cuBLAS would use it out of that stream's order), shared
    // memory (a graph captured with it would outlive the access), and too little room after the
    // first 256-byte boundary.
    let other = Stream::new(&gpu)?;
    let mut elsewhere = BufferPool::new(&other).get_buffer_1d::<u8>(4096)?;
    let refused = with_blas_workspace(blas, elsewhere.view_mut(), |_| ());
    assert!(
        matches!(refused, Err(PoolError::Unsupported { .. })),
        "{refused:?}"
    );
    let mut shared = SharedMat::<u8>::new(&gpu, 1, 4096)?;
    let refused = with_blas_workspace(blas, shared.write(&stream)?.view_mut(), |_| ());
    assert!(
        matches!(refused, Err(PoolError::Unsupported { .. })),
        "{refused:?}"
    );
    let mut room = BufferPool::new(&stream).get_buffer_1d::<u8>(4096)?;
    let refused = with_blas_workspace(blas, room.roi_mut(0..1, 1..200)?, |_| ());
    assert!(
        matches!(refused, Err(PoolError::Unsupported { .. })),
        "{refused:?}"
    );
    with_blas_workspace(blas, room.roi_mut(0..1, 1..4096)?, |_| ())?; // aligned inside it
    drop(room);
    // And an eager layer still matches.
    dense_relu_gpu(&stream, blas, kernels, &x, &w, &b, &mut y)?;
    assert!(right(&y)? < 1e-4);
    Ok(())
}

/// A GEMM on packed operands (no padding between rows, leading dimension = columns) matches the
/// CPU, with its intermediate a packed `buffer!` too.
#[cfg(feature = "cublas")]
#[test]
fn a_gemm_on_packed_buffers_matches_the_cpu() -> TestResult {
    use crate::common::dense::{
        BATCH, Engine, IN, OUT, dense_relu, engine, largest_difference, parameters,
    };
    let Some((gpu, _lock)) = gpu("cublas_packed") else {
        return Ok(());
    };
    let stream = Stream::new(&gpu)?;
    let (engine, described) = engine(&gpu, &stream)?;
    assert!(matches!(engine, Engine::Gpu { .. }), "{described}");
    let (wv, bv) = parameters();
    let xv: Vec<f32> = (0..BATCH * IN)
        .map(|i| (i % 83) as f32 / 83.0 - 0.5)
        .collect();
    let packed = |rows, cols, values: &[f32]| -> Result<GpuMat<'_, f32>, PoolError> {
        let mut m = GpuMat::new_packed(&stream, rows, cols)?;
        m.upload(values)?;
        Ok(m)
    };
    let (x, w, b) = (
        packed(BATCH, IN, &xv)?,
        packed(IN, OUT, &wv)?,
        packed(1, OUT, &bv)?,
    );
    assert_eq!((x.step(), w.step()), (IN * 4, OUT * 4), "no padding");
    let mut y = GpuMat::<f32>::new_packed(&stream, BATCH, OUT)?;
    dense_relu(&stream, &engine, &x, &w, &b, &mut y)?;
    let worst = largest_difference(&y.to_vec()?, &xv, &wv, &bv);
    println!("cuBLAS on packed operands: largest relative difference {worst:.2e}");
    assert!(worst < 1e-4);
    Ok(())
}

/// A CUDA device's configuration as one value: `config` reads what `configure` wrote, and with
/// growable stacks (the default where the GPU can map memory) the report's first line says so
/// rather than "10 MiB x 5 stacks, memory not allocated".
#[test]
fn a_gpu_config_round_trips_and_the_report_names_growable_stacks() -> TestResult {
    let Some((gpu, _lock)) = gpu("device_config") else {
        return Ok(());
    };
    let before = gpu.config()?;
    eprintln!("device_config: {} starts as {before:?}", gpu.id());
    match gpu.set_growable_stacks(true) {
        Ok(()) => {
            let stream = Stream::new(&gpu)?;
            drop(BufferPool::new(&stream).get_buffer_1d::<u8>(12 * MIB)?);
            let report = gpu_pool::observe::Report::new(vec![gpu.stats()]).to_string();
            let line = report
                .lines()
                .find(|l| l.starts_with(&format!("{}: config", gpu.id())))
                .expect("a line for the GPU");
            eprintln!("device_config: {line}");
            assert!(line.contains("config growable stacks ("), "{line}");
            assert!(!line.contains("not allocated"), "{line}");
        }
        Err(e) => eprintln!("device_config: no growable stacks on this GPU: {e}"),
    }
    let mut changed = before.clone();
    changed.packing = gpu_pool::config::Packing::OpenCv;
    changed.record = 4;
    gpu.configure(changed.clone())?;
    assert_eq!(gpu.config()?, changed);
    gpu.configure(before.clone())?;
    assert_eq!(gpu.config()?, before);
    Ok(())
}

/// `.buf` / `.buf_mut` (`LaunchArgsExt`) push the address of the first element of whatever
/// `GpuRead` / `GpuWrite` is implemented for, through a generic function as through concrete
/// types, and `.pitched` pushes the 32-byte struct: each kernel sees the right memory.
#[test]
fn buf_and_buf_mut_push_the_address_of_every_kind_of_buffer() -> TestResult {
    use gpu_pool::interop::LaunchArgsExt;
    use gpu_pool::interop::cudarc::driver::{CudaFunction, LaunchConfig};
    let Some((gpu, _lock)) = gpu("buf_and_buf_mut") else {
        return Ok(());
    };
    let source = format!(
        "{PITCHED_H}{}",
        r#"
extern "C" __global__ void axpy(const float* x, float* y, float a, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}
extern "C" __global__ void rows(Pitched<const float> src, Pitched<float> dst) {
    unsigned c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y * blockDim.y + threadIdx.y;
    if (dst.contains(r, c)) dst(r, c) = src(r, c) + r;
}"#
    );
    let ptx = gpu_pool::interop::cudarc::nvrtc::compile_ptx(source)?;
    let module = gpu.cudarc()?.load_module(ptx)?;
    let (axpy, rows) = (module.load_function("axpy")?, module.load_function("rows")?);
    let stream = Stream::new(&gpu)?;

    fn generic(
        s: &Stream,
        f: &CudaFunction,
        x: &impl GpuRead<f32>,
        y: &mut impl GpuWrite<f32>,
        a: f32,
    ) -> TestResult {
        let n = x.len() as u32;
        let mut args = s.cudarc()?.launch_builder(f);
        args.buf(x).buf_mut(y).arg(&a).arg(&n);
        // SAFETY: `axpy` takes (const float*, float*, float, unsigned) and touches n elements of
        // x and y, both n long.
        unsafe { args.launch(LaunchConfig::for_num_elems(n)) }?;
        Ok(())
    }

    let n = 1000usize;
    let pool = BufferPool::new(&stream);
    let x = GpuMat::from_host(&stream, 1, n, &(0..n).map(|i| i as f32).collect::<Vec<_>>())?;
    let mut y = pool.get_buffer_1d::<f32>(n)?;
    y.set_to(1.0)?;
    generic(&stream, &axpy, &x, &mut y, 2.0)?; // concrete buffers through the generic function
    let mut batch = pool.get_buffer::<f32>(4, n)?; // a region of a bigger buffer, as the output
    batch.set_to(0.0)?;
    generic(
        &stream,
        &axpy,
        &y.view(),
        &mut batch.row_range_mut(2..3)?,
        1.0,
    )?;
    let got = batch.to_vec()?;
    let wrong = (0..4 * n)
        .filter(|&k| {
            let (r, i) = (k / n, k % n);
            let want = if r == 2 { 1.0 + 2.0 * i as f32 } else { 0.0 };
            got[k] != want
        })
        .count();
    eprintln!("buf_and_buf_mut: {wrong} wrong of {} elements", 4 * n);
    assert_eq!(wrong, 0);

    // `.pitched`: the struct, for a 2D kernel, from a region as input.
    let (r, c) = (3usize, 40usize);
    let src = batch.roi(1..4, 10..10 + c)?; // rows 1..4: 0, 1 + 2i, 0
    let mut dst = pool.get_buffer::<f32>(r, c)?;
    let (input, output) = (src.pitched(), dst.pitched_mut());
    let grid = grid_2d(r, c)?;
    // SAFETY: `rows` takes two Pitched<float> and writes only inside dst's rows and columns.
    unsafe {
        stream
            .cudarc()?
            .launch_builder(&rows)
            .pitched(&input)
            .pitched(&output)
            .launch(grid)
    }?;
    let got = dst.to_vec()?;
    for (k, v) in got.iter().enumerate() {
        let (row, col) = (k / c, k % c);
        let base = if row == 1 {
            1.0 + 2.0 * (10 + col) as f32
        } else {
            0.0
        };
        assert_eq!(*v, base + row as f32, "({row}, {col})");
    }
    Ok(())
}

/// A dropped pool stream lets go of its CUDA stream's claim before the stream is destroyed: the
/// driver may hand the same handle to a stream made on another thread at once, and that stream's
/// pool stream must not be refused as `StreamAlreadyWrapped` by a claim of a stream that is gone.
/// A race, so the test makes and drops streams on two threads and counts the refusals; before the
/// fix (the claim a field dropped after `Drop::drop`), a driver that reuses handles refuses some.
#[test]
fn a_dropped_streams_handle_can_be_wrapped_at_once_on_another_thread() -> TestResult {
    let Some((gpu, _lock)) = gpu("wrapped_claim_before_destroy") else {
        return Ok(());
    };
    const ROUNDS: usize = 20_000;
    let refused = std::sync::atomic::AtomicUsize::new(0);
    let reused = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| -> Result<(), PoolError> {
                    let mut last = 0usize;
                    for _ in 0..ROUNDS {
                        match Stream::new(&gpu) {
                            Ok(stream) => {
                                let handle = stream.cudarc()?.cu_stream() as usize;
                                if handle == last {
                                    reused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                }
                                last = handle;
                            }
                            Err(PoolError::StreamAlreadyWrapped { .. }) => {
                                refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("a worker panicked"))
    })?;
    let (refused, reused) = (refused.into_inner(), reused.into_inner());
    eprintln!(
        "{} streams made and dropped on two threads: {reused} got their thread's last handle \
         again, {refused} were refused as already wrapped",
        2 * ROUNDS
    );
    assert_eq!(refused, 0, "a claim outlived its CUDA stream");
    Ok(())
}

/// A stream with a growable stack dropped inside another stream's capture on its thread: its stack
/// cannot be unmapped there (a driver call the capture must not see) nor waited for, so it goes
/// through the deferred give-back: the thread's queue until the capture ends, then the device's,
/// after the event that follows the stream's work. Held until the capture ends, given back then.
#[test]
fn a_growable_stack_dropped_inside_a_capture_goes_back_when_it_ends() -> TestResult {
    let Some((gpu, _lock)) = gpu("growable_drop_in_capture") else {
        return Ok(());
    };
    let before = gpu.config()?;
    if let Err(e) = gpu.set_growable_stacks(true) {
        eprintln!("growable_drop_in_capture: no growable stacks on this GPU: {e}");
        return Ok(());
    }
    let capturing = Stream::new(&gpu)?;
    let doomed = Stream::new(&gpu)?;
    BufferPool::new(&doomed)
        .get_buffer_1d::<u8>(4 * MIB)?
        .set_to(3)?; // work queued on the stack that goes
    let held = gpu.stats().stacks_held;
    let inside = std::cell::Cell::new(None);
    let graph = capturing.capture(|s| {
        drop(doomed);
        inside.set(Some(s.device().stats().stacks_held));
        let mut b = BufferPool::new(s).get_buffer_1d::<u8>(256)?;
        b.set_to(1)
    })?;
    let after = gpu.stats().stacks_held;
    let waiting = gpu_pool::testing::host_mem_frees_waiting(&gpu);
    eprintln!(
        "growable_drop_in_capture: stacks held {held} before, {:?} inside the capture, \
         {after} after it; the device's deferred queue holds {waiting}",
        inside.get()
    );
    drop(graph);
    drop(capturing);
    gpu.configure(before)?;
    assert_eq!(inside.get(), Some(held), "kept while the capture ran");
    assert_eq!(after, held - 1, "given back when it ended");
    assert_eq!(waiting, 0);
    Ok(())
}
