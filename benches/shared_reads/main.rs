//! What reading `SharedMat` weights through guards costs a two-worker server, and where it goes.
//!
//! Each worker (a thread with its own stream and cuBLAS handle) serves requests: a pageable upload
//! of `rows x 256` f32, four GEMMs against four shared 256x256 weights, a pageable download. The
//! variants differ only in how the weights are read: `per request` takes the four guards in each
//! request (the guide's code), `hoisted` takes them once per worker; `raw events` reads hoisted but
//! adds, per request, what a guard's end asked of the driver before issue 30 (an
//! `cuStreamIsCapturing` and a `cuEventRecord` per weight). Rounds are interleaved. A single-thread
//! loop then times one guard's read and drop on an idle stream.
//!
//! `cargo bench -p gpu-pool-benches --bench shared_reads [-- ROUNDS]`

#[path = "../support/run.rs"]
mod run;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::interop::cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use gpu_pool::interop::cudarc::driver::sys;
use gpu_pool::prelude::*;
use gpu_pool::shared::SharedRead;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const D: usize = 256;
const REQUESTS: usize = 400;
const WEIGHTS: usize = 4;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    PerRequest,
    Hoisted,
    RawEvents,
}

fn gemm(
    blas: &CudaBlas,
    x: &impl GpuRead<f32>,
    w: &impl GpuRead<f32>,
    y: &mut impl GpuWrite<f32>,
) -> Res<()> {
    let (xs, ws) = (x.as_cudarc()?, w.as_cudarc()?);
    let mut ys = y.as_cudarc_mut()?;
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: w.cols() as i32,
        n: x.rows() as i32,
        k: x.cols() as i32,
        alpha: 1.0f32,
        lda: ws.ld() as i32,
        ldb: xs.ld() as i32,
        beta: 1.0f32,
        ldc: ys.ld() as i32,
    };
    // SAFETY: x is n x k, w k x m, y n x m row-major f32 at the leading dimensions given.
    unsafe { blas.gemm(cfg, &ws, &xs, &mut ys) }?;
    Ok(())
}

#[pooled(stream)]
fn request(
    stream: &Stream,
    blas: &CudaBlas,
    weights: &[SharedMat<f32>],
    hoisted: Option<&[SharedRead<'_, f32>]>,
    input: &[f32],
    output: &mut [f32],
) -> Res<()> {
    let rows = input.len() / D;
    let mut x = buffer!(rows, D; f32, packed)?;
    let mut y = buffer!(rows, D; f32, packed)?;
    x.upload(input)?;
    y.set_to(0.0)?;
    match hoisted {
        Some(guards) => {
            for w in guards {
                gemm(blas, &x, w, &mut y)?;
            }
        }
        None => {
            for w in weights {
                let w = w.read(stream)?;
                gemm(blas, &x, &w, &mut y)?;
            }
        }
    }
    y.download(output)?;
    Ok(())
}

fn worker(
    device: &Device,
    weights: &[SharedMat<f32>],
    variant: Variant,
    next: &std::sync::atomic::AtomicUsize,
) -> Res<()> {
    let stream = Stream::new(device)?;
    let blas = stream.cublas()?;
    let cu = stream.cudarc().expect("CUDA").cu_stream();
    device.cudarc().expect("CUDA").bind_to_thread()?;
    let mut event = std::ptr::null_mut();
    // SAFETY: a fresh event handle out-parameter, on the current context (cublas bound it).
    unsafe {
        sys::cuEventCreate(
            &mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
        )
    }
    .result()?;
    let guards: Vec<_> = weights
        .iter()
        .map(|w| w.read(&stream))
        .collect::<Result<_, _>>()?;
    let mut output = vec![0f32; 1024 * D];
    loop {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if i >= REQUESTS {
            break;
        }
        let rows = 64 + (i * 37 % 16) * 64;
        let input = vec![(i % 7) as f32 * 0.01; rows * D];
        match variant {
            Variant::PerRequest => request(
                &stream,
                &blas,
                weights,
                None,
                &input,
                &mut output[..rows * D],
            )?,
            Variant::Hoisted | Variant::RawEvents => request(
                &stream,
                &blas,
                weights,
                Some(&guards),
                &input,
                &mut output[..rows * D],
            )?,
        }
        if variant == Variant::RawEvents {
            for _ in 0..WEIGHTS {
                let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
                // SAFETY: a live stream and event of this context.
                unsafe {
                    sys::cuStreamIsCapturing(cu, &mut status).result()?;
                    sys::cuEventRecord(event, cu).result()?;
                }
            }
        }
    }
    drop(guards);
    stream.synchronize()?;
    // SAFETY: recorded on `stream`, synchronized above.
    unsafe { sys::cuEventDestroy_v2(event) }.result()?;
    Ok(())
}

fn round(device: &Device, weights: &Arc<Vec<SharedMat<f32>>>, variant: Variant) -> Res<Duration> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let (device, weights, next) = (device.clone(), Arc::clone(weights), Arc::clone(&next));
            std::thread::spawn(move || worker(&device, &weights, variant, &next))
        })
        .collect();
    for w in workers {
        w.join().expect("a worker panicked")?;
    }
    Ok(start.elapsed())
}

fn main() -> Res<()> {
    let device = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no CUDA device ({e}): shared_reads measured nothing");
            return Ok(());
        }
    };
    let rounds = run::count(0, "ROUNDS", 9);
    println!(
        "device: {} (driver {})",
        device.id(),
        run::driver_version().map_err(|e| e.to_string())?
    );
    let loader = Stream::new(&device)?;
    let host: Vec<f32> = (0..D * D).map(|i| (i % 13) as f32 * 1e-3).collect();
    let weights = Arc::new(
        (0..WEIGHTS)
            .map(|_| SharedMat::from_host(&loader, D, D, &host))
            .collect::<Result<Vec<_>, _>>()?,
    );
    loader.synchronize()?;
    let names = ["per request", "hoisted", "raw events"];
    let variants = [Variant::PerRequest, Variant::Hoisted, Variant::RawEvents];
    let mut us: Vec<Vec<f64>> = vec![Vec::new(); 3];
    round(&device, &weights, Variant::PerRequest)?; // warm-up
    for r in 0..rounds {
        for k in 0..3 {
            let v = (r + k) % 3;
            us[v]
                .push(round(&device, &weights, variants[v])?.as_secs_f64() * 1e6 / REQUESTS as f64);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&mut us[1].clone());
    println!(
        "| variant | µs / request (median of {rounds}) | min | max | vs hoisted |\n|---|---:|---:|---:|---:|"
    );
    for (name, v) in names.iter().zip(&mut us) {
        let m = median(v);
        println!(
            "| {name} | {m:.2} | {:.2} | {:.2} | {:.3}x |",
            v[0],
            v[v.len() - 1],
            m / base
        );
    }
    // One guard on an idle stream, one thread.
    let stream = Stream::new(&device)?;
    let n = 100_000;
    let start = Instant::now();
    for _ in 0..n {
        drop(weights[0].read(&stream)?);
    }
    println!(
        "one read guard taken and dropped on an idle stream: {:.0} ns",
        start.elapsed().as_secs_f64() * 1e9 / n as f64
    );
    let cu = stream.cudarc().expect("CUDA").cu_stream();
    device.cudarc().expect("CUDA").bind_to_thread()?;
    let mut event = std::ptr::null_mut();
    // SAFETY: a fresh event handle out-parameter, on the current context.
    unsafe {
        sys::cuEventCreate(
            &mut event,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
        )
    }
    .result()?;
    let time = |what: &str, f: &mut dyn FnMut() -> Res<()>| -> Res<()> {
        let start = Instant::now();
        for _ in 0..n {
            f()?;
        }
        println!(
            "{what}: {:.0} ns",
            start.elapsed().as_secs_f64() * 1e9 / n as f64
        );
        Ok(())
    };
    time("cuStreamIsCapturing", &mut || {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream.
        unsafe { sys::cuStreamIsCapturing(cu, &mut status) }.result()?;
        Ok(())
    })?;
    time("cuEventRecord", &mut || {
        // SAFETY: a live event and stream of the current context.
        unsafe { sys::cuEventRecord(event, cu) }.result()?;
        Ok(())
    })?;
    time("cuCtxGetCurrent", &mut || {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: an out-parameter.
        unsafe { sys::cuCtxGetCurrent(&mut ctx) }.result()?;
        Ok(())
    })?;
    let pageable = vec![0u8; 1 << 20];
    time(
        "cuPointerGetAttribute(MEMORY_TYPE) on a pageable Vec",
        &mut || {
            let mut kind = 0u32;
            // SAFETY: a query of the driver's table of the address; the out-parameter is a u32.
            let _ = unsafe {
                sys::cuPointerGetAttribute(
                    (&raw mut kind).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    pageable.as_ptr() as sys::CUdeviceptr,
                )
            };
            Ok(())
        },
    )?;
    time("cuStreamQuery on an idle stream", &mut || {
        // SAFETY: a live stream.
        let _ = unsafe { sys::cuStreamQuery(cu) };
        Ok(())
    })?;
    let mut dev = GpuMat::<u8>::new(&stream, 1, 1 << 10)?;
    let small = vec![1u8; 1 << 10];
    let mut back = vec![0u8; 1 << 10];
    time("GpuMat::upload of 1 KiB pageable", &mut || {
        dev.upload(&small)?;
        Ok(())
    })?;
    time("GpuMat::download of 1 KiB pageable", &mut || {
        dev.download(&mut back)?;
        Ok(())
    })?;
    let cs = stream.cudarc().expect("CUDA").clone();
    let mut slice = cs.alloc_zeros::<u8>(1 << 10)?;
    time("cudarc memcpy_htod of 1 KiB pageable", &mut || {
        cs.memcpy_htod(&small, &mut slice)?;
        Ok(())
    })?;
    time(
        "cudarc memcpy_dtoh of 1 KiB pageable (+ synchronize)",
        &mut || {
            cs.memcpy_dtoh(&slice, &mut back)?;
            cs.synchronize()?;
            Ok(())
        },
    )?;
    drop(slice);
    let guards = weights
        .iter()
        .map(|w| w.read(&stream))
        .collect::<Result<Vec<_>, _>>()?;
    drop(guards);
    time("five read guards taken, then dropped", &mut || {
        let guards = weights
            .iter()
            .map(|w| w.read(&stream))
            .collect::<Result<Vec<_>, _>>()?;
        drop(guards);
        Ok(())
    })?;
    stream.synchronize()?;
    Ok(())
}
