//! What the examples share: the kernels, and running each stage on CUDA or as a CPU twin.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "each example uses a different part"
)]

#[cfg(feature = "cublas")]
pub mod dense;
pub mod kernels;

use gpu_pool::prelude::*;

/// What the seed's loop (`pipeline`, `pipeline_runtime`) prints after it ran: where, how long,
/// the stack's use, the driver allocations after the first iteration, and the pixels of `out` that
/// differ from the CPU reference of `image` (the process exits with 1 if any does).
pub fn report_seed_loop(
    device: &Device,
    stream: &Stream,
    (image, out): (&[[u8; 3]], &[u8]),
    (rows, cols): (usize, usize),
    (iterations, elapsed): (usize, std::time::Duration),
    calls_after_first: u64,
) {
    let wrong = image
        .iter()
        .zip(out)
        .filter(|&(&px, &o)| kernels::threshold_of(kernels::gray_of(px), 128) != o)
        .count();
    let stats = stream.stats();
    println!("device: {}", Stages::describe(device));
    println!(
        "{iterations} iterations of {rows}x{cols} BGR -> gray -> threshold in {:.1} ms",
        elapsed.as_secs_f64() * 1e3
    );
    println!(
        "stack buffers: {}, fallback buffers: {}, peak stack use: {:.1} MiB",
        stats.stack_allocations,
        stats.fallback_allocations.total(),
        stats.stack_high_water as f64 / (1 << 20) as f64
    );
    println!(
        "driver allocation calls after the first iteration: {}",
        device.stats().driver_alloc_calls - calls_after_first
    );
    println!("pixels differing from the CPU reference: {wrong}");
    if wrong != 0 {
        std::process::exit(1);
    }
}

/// The example's first argument as a count (iterations, batches, frames), else `default`.
pub fn count_arg(default: usize) -> usize {
    std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// The kernels on CUDA, or nothing on the host backend (the CPU twins run instead).
pub struct Stages {
    #[cfg(feature = "cuda")]
    gpu: Option<kernels::Kernels>,
}

impl Stages {
    pub fn new(device: &Device) -> Stages {
        #[cfg(not(feature = "cuda"))]
        let _ = device; // only CUDA devices load kernels
        Stages {
            #[cfg(feature = "cuda")]
            gpu: device.cudarc().ok().map(|_| kernels::Kernels::load(device)),
        }
    }

    /// The compiled kernels, on a CUDA device.
    #[cfg(feature = "cuda")]
    pub fn kernels(&self) -> Option<&kernels::Kernels> {
        self.gpu.as_ref()
    }

    /// Where the stages run, in words.
    pub fn describe(device: &Device) -> String {
        if device.is_host() {
            // Why there is no GPU, as the program can tell: no driver, no device, a broken driver.
            let why = Device::cuda_or_host_with_reason().1;
            let why = why.map_or_else(|| "asked for".to_string(), |e| e.to_string());
            format!(
                "{} (host backend: CPU twins of the kernels; no CUDA device: {why})",
                device.id()
            )
        } else {
            format!("{} (CUDA kernels compiled with nvrtc)", device.id())
        }
    }

    /// `dst = gray(src)`, on `stream`.
    pub fn bgr_to_gray(
        &self,
        stream: &Stream,
        src: GpuView<'_, [u8; 3]>,
        mut dst: GpuViewMut<'_, u8>,
    ) -> Result<(), PoolError> {
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.gpu {
            // SAFETY: both views borrow buffers on this stream's device that this stream's later
            // work alone reuses (the launcher checks their shapes).
            unsafe { kernels::bgr_to_gray(k, cuda(stream), src.pitched(), dst.pitched_mut()) }?;
            return Ok(());
        }
        let _ = stream; // the host backend runs the twin in place, at once
        let rows: Vec<&[[u8; 3]]> = src.host_rows()?.collect();
        dst.for_each_host_row_mut(|r, out| {
            for (o, &px) in out.iter_mut().zip(rows[r]) {
                *o = kernels::gray_of(px);
            }
        })
    }

    /// `dst = src > t ? 255 : 0`, on `stream`.
    pub fn threshold(
        &self,
        stream: &Stream,
        src: GpuView<'_, u8>,
        mut dst: GpuViewMut<'_, u8>,
        t: u8,
    ) -> Result<(), PoolError> {
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.gpu {
            // SAFETY: as in `bgr_to_gray`.
            unsafe { kernels::threshold(k, cuda(stream), src.pitched(), dst.pitched_mut(), t) }?;
            return Ok(());
        }
        let _ = stream;
        let rows: Vec<&[u8]> = src.host_rows()?.collect();
        dst.for_each_host_row_mut(|r, out| {
            for (o, &v) in out.iter_mut().zip(rows[r]) {
                *o = kernels::threshold_of(v, t);
            }
        })
    }
}

impl Stages {
    /// `dst[y][x] = pattern(x, y, seed)`, on `stream`.
    pub fn fill_pattern(
        &self,
        stream: &Stream,
        mut dst: GpuViewMut<'_, u8>,
        seed: i32,
    ) -> Result<(), PoolError> {
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.gpu {
            // SAFETY: as in `bgr_to_gray`.
            unsafe { kernels::fill_pattern(k, cuda(stream), dst.pitched_mut(), seed) }?;
            return Ok(());
        }
        let _ = stream; // the host backend runs the twin in place, at once
        dst.for_each_host_row_mut(|y, row| {
            for (x, v) in row.iter_mut().enumerate() {
                *v = kernels::pattern(x, y, seed);
            }
        })
    }

    /// `dst = 255 - src`, on `stream`.
    pub fn invert(
        &self,
        stream: &Stream,
        src: GpuView<'_, u8>,
        mut dst: GpuViewMut<'_, u8>,
    ) -> Result<(), PoolError> {
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.gpu {
            // SAFETY: as in `bgr_to_gray`.
            unsafe { kernels::invert(k, cuda(stream), src.pitched(), dst.pitched_mut()) }?;
            return Ok(());
        }
        let _ = stream;
        let rows: Vec<&[u8]> = src.host_rows()?.collect();
        dst.for_each_host_row_mut(|y, out| {
            for (o, &v) in out.iter_mut().zip(rows[y]) {
                *o = 255 - v;
            }
        })
    }

    /// `y = max(a * x + b, 0)` over `x.cols()` floats, on `stream`.
    pub fn affine_relu(
        &self,
        stream: &Stream,
        x: GpuView<'_, f32>,
        mut y: GpuViewMut<'_, f32>,
        a: f32,
        b: f32,
    ) -> Result<(), PoolError> {
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.gpu {
            let xy = (x.device_ptr(), y.device_ptr());
            // SAFETY: both views hold `x.cols()` floats, as in `bgr_to_gray`.
            unsafe { kernels::affine_relu(k, cuda(stream), xy, x.cols(), (a, b)) }?;
            return Ok(());
        }
        let _ = stream;
        let input: Vec<f32> = x.host_rows()?.flatten().copied().collect();
        y.for_each_host_row_mut(|_, out| {
            for (o, &v) in out.iter_mut().zip(&input) {
                *o = kernels::affine_relu_of(v, a, b);
            }
        })
    }
}

/// The cudarc stream of a stream on a CUDA device.
#[cfg(feature = "cuda")]
fn cuda(stream: &Stream) -> &std::sync::Arc<gpu_pool::interop::cudarc::driver::CudaStream> {
    stream
        .cudarc()
        .expect("the kernels are loaded only on a CUDA device, whose streams are CUDA streams")
}
