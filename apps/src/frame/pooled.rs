//! The gpu-pool twin: page-locked `HostMem` frames in and out, each frame's device images
//! (`bgr`, `gray`, `blurred`, `binary`) from the stream's stack with `buffer!`, the copies queued
//! with `upload_async` / `download_async`, one `stream.synchronize()` a frame.

use gpu_pool::HostMem;
use gpu_pool::interop::cudarc::driver::PushKernelArg;
use gpu_pool::prelude::*;

use super::{Kernels, Size, THRESHOLD, host, test_frame};

/// The page-locked host frames: the two input frames, which alternate, and the output.
#[derive(Debug)]
pub struct Frames {
    inputs: [HostMem<[u8; 3]>; 2],
    output: HostMem<u8>,
}

impl Frames {
    /// The test frames of `size` and an output frame, filled with 0x5a so that a download that
    /// did not land fails the check.
    pub fn new(device: &Device, size: Size) -> Result<Frames, PoolError> {
        let mut output = HostMem::new(device, size.pixels())?;
        output.as_mut_slice()?.fill(0x5a);
        Ok(Frames {
            inputs: [
                HostMem::from_slice(device, &test_frame(size, 0))?,
                HostMem::from_slice(device, &test_frame(size, 1))?,
            ],
            output,
        })
    }
}

/// Runs `n` frames of `size`, input frame `i % 2` for frame `i`, and hands each binary image to
/// `each` once the frame is done.
pub fn run(
    stream: &Stream,
    k: Option<&Kernels>,
    frames: &mut Frames,
    size: Size,
    n: usize,
    mut each: impl FnMut(usize, &[u8]),
) -> Result<(), PoolError> {
    for i in 0..n {
        frame(stream, k, &frames.inputs[i % 2], &mut frames.output, size)?;
        stream.synchronize()?; // the frame's one wait
        each(i, frames.output.as_slice()?);
    }
    Ok(())
}

/// One frame: `output = threshold(box3(gray(input)))`, both `size`.
#[pooled(stream)]
pub fn frame(
    stream: &Stream,
    k: Option<&Kernels>,
    input: &HostMem<[u8; 3]>,
    output: &mut HostMem<u8>,
    size: Size,
) -> Result<(), PoolError> {
    let mut bgr = buffer!(size.rows, size.cols; [u8; 3])?;
    let mut gray = buffer!(size.rows, size.cols; u8)?;
    let mut blurred = buffer!(size.rows, size.cols; u8)?;
    let mut binary = buffer!(size.rows, size.cols; u8)?;
    bgr.upload_async(input)?; // queued; `input` cannot be written until it has run
    to_gray(stream, k, &bgr, &mut gray)?;
    box3(stream, k, &gray, &mut blurred)?;
    threshold(stream, k, &blurred, &mut binary)?;
    binary.download_async(output) // queued; `output.as_slice()` waits for it
}

/// `gray = luma(bgr)`.
fn to_gray(
    stream: &Stream,
    k: Option<&Kernels>,
    bgr: &impl GpuRead<[u8; 3]>,
    gray: &mut impl GpuWrite<u8>,
) -> Result<(), PoolError> {
    let (Some(k), Some(cuda)) = (k, stream.cudarc().ok()) else {
        return host::to_gray(bgr, gray);
    };
    let grid = super::grid(Size {
        rows: gray.rows(),
        cols: gray.cols(),
    })?;
    let (src, dst) = (bgr.pitched(), gray.pitched_mut());
    // SAFETY: `bgr_to_gray` takes (Pitched<const uchar3>, Pitched<unsigned char>) and writes only
    // inside dst's shape, which is src's; both are this stream's memory, alive past the kernel.
    unsafe {
        cuda.launch_builder(&k.bgr_to_gray)
            .arg(&src)
            .arg(&dst)
            .launch(grid)
    }?;
    Ok(())
}

/// `dst = the 3x3 box mean of src`.
fn box3(
    stream: &Stream,
    k: Option<&Kernels>,
    src: &impl GpuRead<u8>,
    dst: &mut impl GpuWrite<u8>,
) -> Result<(), PoolError> {
    let (Some(k), Some(cuda)) = (k, stream.cudarc().ok()) else {
        return host::box3(src, dst);
    };
    let grid = super::grid(Size {
        rows: dst.rows(),
        cols: dst.cols(),
    })?;
    let (src, dst) = (src.pitched(), dst.pitched_mut());
    // SAFETY: `box3` takes two Pitched<unsigned char> of one shape and reads and writes only
    // inside it; both are this stream's memory, alive past the kernel.
    unsafe {
        cuda.launch_builder(&k.box3)
            .arg(&src)
            .arg(&dst)
            .launch(grid)
    }?;
    Ok(())
}

/// `dst = src > THRESHOLD ? 255 : 0`.
fn threshold(
    stream: &Stream,
    k: Option<&Kernels>,
    src: &impl GpuRead<u8>,
    dst: &mut impl GpuWrite<u8>,
) -> Result<(), PoolError> {
    let (Some(k), Some(cuda)) = (k, stream.cudarc().ok()) else {
        return host::threshold(src, dst);
    };
    let grid = super::grid(Size {
        rows: dst.rows(),
        cols: dst.cols(),
    })?;
    let (src, dst) = (src.pitched(), dst.pitched_mut());
    let mut launch = cuda.launch_builder(&k.threshold);
    launch.arg(&src).arg(&dst).arg(&THRESHOLD);
    // SAFETY: `threshold` takes two Pitched<unsigned char> of one shape and an unsigned char,
    // and writes only inside dst; both are this stream's memory, alive past the kernel.
    unsafe { launch.launch(grid) }?;
    Ok(())
}
