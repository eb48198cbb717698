//! The seed's benchmark loop (OpenCV BufferPool article), with the DSL: a 4096x4096 BGR image
//! converted to gray and thresholded by a `#[pooled]` function whose two temporaries are
//! `buffer!`s, taken from the stream's stack at each call and given back, in reverse order, when
//! it returns. Checks the result against a plain CPU reference and reports how many driver
//! allocations the loop made after its first call. (`pipeline_runtime` is the same loop on the
//! runtime API.) The threshold is a kernel of this file, compiled with the `Pitched<T>` header
//! and launched on a `buffer!` handle: the kernel takes each image with its step and shape as
//! one parameter, and `grid_2d` makes the launch configuration.
//!
//! `cargo run --release --example pipeline [-- ITERATIONS]`

mod support;

use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::compat::opencv::set_buffer_pool_config;
use gpu_pool::prelude::*;
use support::Stages;

const ROWS: usize = 4096;
const COLS: usize = 4096;

/// BGR -> gray -> binary, both intermediates from the stack; the binary image is downloaded into
/// `out` when one is given.
#[pooled(stream)]
fn gray_threshold(
    stream: &Stream,
    stages: &Stages,
    kernel: &Threshold,
    src: &impl GpuRead<[u8; 3]>,
    out: Option<&mut [u8]>,
) -> Result<(), PoolError> {
    let mut gray = buffer!(src.rows(), src.cols(); u8)?;
    let mut binary = buffer!(src.rows(), src.cols(); u8)?;
    stages.bgr_to_gray(stream, src.view(), gray.view_mut())?;
    threshold(stream, kernel, &gray, &mut binary, 128)?;
    if let Some(out) = out {
        binary.download(out)?;
    }
    Ok(())
} // binary, then gray, go back to the stack: nothing reaches the driver

/// This example's own kernel, in CUDA C++ after `gpu_pool::interop::PITCHED_H`: one thread a pixel, inside
/// both images.
const THRESHOLD: &str = r#"
extern "C" __global__ void threshold(Pitched<const unsigned char> src, Pitched<unsigned char> dst, unsigned char t) {
    unsigned c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y * blockDim.y + threadIdx.y;
    if (dst.contains(r, c) && src.contains(r, c)) dst(r, c) = src(r, c) > t ? 255 : 0;
}
"#;

/// `THRESHOLD` compiled with nvrtc, on a CUDA device.
struct Threshold {
    #[cfg(feature = "cuda")]
    function: Option<gpu_pool::interop::cudarc::driver::CudaFunction>,
}

impl Threshold {
    fn load(device: &Device) -> Result<Threshold, PoolError> {
        #[cfg(not(feature = "cuda"))]
        let _ = (device, THRESHOLD); // the host backend runs the CPU twin
        Ok(Threshold {
            #[cfg(feature = "cuda")]
            function: match device.cudarc().ok() {
                Some(ctx) => {
                    let source = format!("{}{THRESHOLD}", gpu_pool::interop::PITCHED_H);
                    let ptx = gpu_pool::interop::cudarc::nvrtc::compile_ptx(source)?;
                    Some(ctx.load_module(ptx)?.load_function("threshold")?)
                }
                None => None,
            },
        })
    }
}

/// `dst = src > t ? 255 : 0`: the launch, or on the host backend its CPU twin.
fn threshold(
    stream: &Stream,
    kernel: &Threshold,
    src: &impl GpuRead<u8>,
    dst: &mut impl GpuWrite<u8>,
    t: u8,
) -> Result<(), PoolError> {
    #[cfg(feature = "cuda")]
    if let (Some(f), Some(cuda)) = (&kernel.function, stream.cudarc().ok()) {
        use gpu_pool::interop::cudarc::driver::PushKernelArg;
        let grid = gpu_pool::interop::grid_2d(dst.rows(), dst.cols())?;
        // SAFETY: `threshold` takes (Pitched<const unsigned char>, Pitched<unsigned char>,
        // unsigned char) and touches only pixels inside both images; the arguments borrow
        // buffers of this stream's device that only this stream's later work reuses.
        unsafe {
            cuda.launch_builder(f)
                .arg(&src.pitched())
                .arg(&dst.pitched_mut())
                .arg(&t)
                .launch(grid)
        }?;
        return Ok(());
    }
    let _ = (stream, kernel); // the twin runs in place, at once
    let rows: Vec<&[u8]> = src.host_rows()?.collect();
    dst.for_each_host_row_mut(|r, out| {
        for (o, &v) in out.iter_mut().zip(rows[r]) {
            *o = if v > t { 255 } else { 0 };
        }
    })
}

fn main() -> Result<(), PoolError> {
    let iterations = support::count_arg(10);
    let device = Device::cuda_or_host();
    let stages = Stages::new(&device);
    let kernel = Threshold::load(&device)?;
    // 64 MiB holds the gray image (16 MiB) and the thresholded one (16 MiB) twice over.
    set_buffer_pool_config(&device, 64 << 20, 1)?;
    let stream = Stream::new(&device)?;

    let image: Vec<[u8; 3]> = (0..ROWS * COLS)
        .map(|i| [(i % 251) as u8, (i / COLS % 241) as u8, (i * 7 % 239) as u8])
        .collect();
    let src = GpuMat::from_host(&stream, ROWS, COLS, &image)?;
    let mut out = vec![0u8; ROWS * COLS];

    let start = std::time::Instant::now();
    let mut calls_after_first = 0;
    for i in 0..iterations {
        let last = i == iterations - 1;
        gray_threshold(
            &stream,
            &stages,
            &kernel,
            &src,
            last.then_some(&mut out[..]),
        )?;
        if i == 0 {
            calls_after_first = device.stats().driver_alloc_calls;
        }
    }
    stream.synchronize()?;
    let elapsed = start.elapsed();

    support::report_seed_loop(
        &device,
        &stream,
        (&image, &out),
        (ROWS, COLS),
        (iterations, elapsed),
        calls_after_first,
    );
    drop(src);
    drop(stream);
    device.release_stack_memory()?; // everything freed before exit, as a leak checker wants
    Ok(())
}
