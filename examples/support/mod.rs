//! What the examples share: the kernels, and running each stage on CUDA or as a CPU twin.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "each example uses a different part"
)]

pub mod kernels;

#[cfg(feature = "cuda")]
use gpu_pool::cudarc::driver::PushKernelArg;
use gpu_pool::prelude::*;

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
            gpu: device
                .cuda_context()
                .map(|_| kernels::Kernels::load(device)),
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
            format!(
                "{} (host backend: CPU twins of the kernels; no CUDA device found)",
                device.id()
            )
        } else {
            format!("{} (CUDA kernels compiled with nvrtc)", device.id())
        }
    }

    /// `dst = gray(src)`, on `dst`'s stream.
    pub fn bgr_to_gray(
        &self,
        src: &GpuMat<'_, [u8; 3]>,
        dst: &mut GpuMat<'_, u8>,
    ) -> Result<(), PoolError> {
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.gpu {
            let (r, c, ss, ds) = (src.rows() as i32, src.cols() as i32, src.step(), dst.step());
            let stream = dst
                .stream()
                .cuda_stream()
                .expect("a CUDA device has CUDA streams")
                .clone();
            // SAFETY: bgr_to_gray(const u8*, size_t, u8*, size_t, int, int) reads and writes rows x
            // cols inside two pitched buffers of that shape.
            unsafe {
                stream
                    .launch_builder(&k.bgr_to_gray)
                    .arg(src)
                    .arg(&ss)
                    .arg(dst)
                    .arg(&ds)
                    .arg(&r)
                    .arg(&c)
                    .launch(kernels::grid(src.rows(), src.cols()))
            }
            .map_err(|e| launch_error("bgr_to_gray", e))?;
            return Ok(());
        }
        let rows: Vec<&[[u8; 3]]> = src.host_rows()?.collect();
        dst.for_each_host_row_mut(|r, out| {
            for (o, &px) in out.iter_mut().zip(rows[r]) {
                *o = kernels::gray_of(px);
            }
        })
    }

    /// `dst = src > t ? 255 : 0`, on `dst`'s stream.
    pub fn threshold(
        &self,
        src: &GpuMat<'_, u8>,
        dst: &mut GpuMat<'_, u8>,
        t: u8,
    ) -> Result<(), PoolError> {
        #[cfg(feature = "cuda")]
        if let Some(k) = &self.gpu {
            let (r, c, ss, ds) = (src.rows() as i32, src.cols() as i32, src.step(), dst.step());
            let stream = dst
                .stream()
                .cuda_stream()
                .expect("a CUDA device has CUDA streams")
                .clone();
            // SAFETY: threshold(const u8*, size_t, u8*, size_t, int, int, u8) stays inside rows x
            // cols of two pitched buffers of that shape.
            unsafe {
                stream
                    .launch_builder(&k.threshold)
                    .arg(src)
                    .arg(&ss)
                    .arg(dst)
                    .arg(&ds)
                    .arg(&r)
                    .arg(&c)
                    .arg(&t)
                    .launch(kernels::grid(src.rows(), src.cols()))
            }
            .map_err(|e| launch_error("threshold", e))?;
            return Ok(());
        }
        let rows: Vec<&[u8]> = src.host_rows()?.collect();
        dst.for_each_host_row_mut(|r, out| {
            for (o, &v) in out.iter_mut().zip(rows[r]) {
                *o = kernels::threshold_of(v, t);
            }
        })
    }
}

#[cfg(feature = "cuda")]
/// A kernel launch's driver error as a `PoolError`.
pub fn launch_error(kernel: &'static str, e: gpu_pool::cudarc::driver::DriverError) -> PoolError {
    PoolError::Driver {
        call: kernel,
        name: e
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        description: e.to_string(),
    }
}
