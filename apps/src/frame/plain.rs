//! The cudarc twin: page-locked host frames (`alloc_pinned_with_flags`) and device images
//! allocated once, outside the frame loop (the frame size is fixed); the copies with
//! `memcpy_htod` / `memcpy_dtoh`, one `synchronize` a frame.

use std::error::Error;
use std::sync::Arc;

use gpu_pool::interop::cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, PinnedHostSlice, PushKernelArg,
};

use super::{Kernels, Size, THRESHOLD, test_frame};

type Res<T> = Result<T, Box<dyn Error>>;

/// A 2D kernel argument: the `Pitched<T>` the kernels take (address, bytes between rows, rows,
/// columns).
#[repr(C)]
#[derive(Clone, Copy)]
struct Image {
    ptr: u64,
    step: u64,
    rows: u64,
    cols: u64,
}

// SAFETY: four `u64`s in `repr(C)`, the layout of the kernels' `Pitched<T>`; any bits are valid.
unsafe impl DeviceRepr for Image {}

/// The twin's stream, its host frames and its device images, all of one size.
pub(super) struct Twin {
    stream: Arc<CudaStream>,
    size: Size,
    inputs: [PinnedHostSlice<u8>; 2],
    output: PinnedHostSlice<u8>,
    bgr: CudaSlice<u8>,
    gray: CudaSlice<u8>,
    blurred: CudaSlice<u8>,
    binary: CudaSlice<u8>,
}

impl Twin {
    /// A stream of `ctx` with the test frames of `size` and the images a frame needs.
    pub(super) fn new(ctx: &Arc<CudaContext>, size: Size) -> Res<Twin> {
        let stream = ctx.new_stream()?;
        let n = size.pixels();
        // Not write-combined (`alloc_pinned`'s flag): the host reads the output, and reads of
        // write-combined memory are uncached.
        // SAFETY: uninitialised page-locked memory, filled below before any copy reads it.
        let pinned = || unsafe { ctx.alloc_pinned_with_flags::<u8>(3 * n, 0) };
        let (mut a, mut b) = (pinned()?, pinned()?);
        a.as_mut_slice()?
            .copy_from_slice(test_frame(size, 0).as_flattened());
        b.as_mut_slice()?
            .copy_from_slice(test_frame(size, 1).as_flattened());
        // SAFETY: as above; filled with 0x5a so that a download that did not land fails the check.
        let mut output = unsafe { ctx.alloc_pinned_with_flags::<u8>(n, 0) }?;
        output.as_mut_slice()?.fill(0x5a);
        // SAFETY: each image is written in full by the copy or the kernel before it is read.
        let (bgr, gray, blurred, binary) = unsafe {
            (
                stream.alloc::<u8>(3 * n)?,
                stream.alloc::<u8>(n)?,
                stream.alloc::<u8>(n)?,
                stream.alloc::<u8>(n)?,
            )
        };
        Ok(Twin {
            stream,
            size,
            inputs: [a, b],
            output,
            bgr,
            gray,
            blurred,
            binary,
        })
    }

    /// Runs `n` frames, input frame `i % 2` for frame `i`, and hands each binary image to `each`
    /// once the frame is done.
    pub(super) fn run(
        &mut self,
        k: &Kernels,
        n: usize,
        mut each: impl FnMut(usize, &[u8]),
    ) -> Res<()> {
        for i in 0..n {
            self.frame(k, i % 2)?;
            each(i, self.output.as_slice()?);
        }
        Ok(())
    }

    /// `slice` as a `size` image of `channels` bytes a pixel, rows back to back.
    fn image(&self, slice: &CudaSlice<u8>, channels: usize) -> Image {
        let (ptr, _) = slice.device_ptr(&self.stream);
        Image {
            ptr,
            step: (self.size.cols * channels) as u64,
            rows: self.size.rows as u64,
            cols: self.size.cols as u64,
        }
    }

    /// One frame: `output = threshold(box3(gray(inputs[which])))`.
    fn frame(&mut self, k: &Kernels, which: usize) -> Res<()> {
        let s = &self.stream;
        s.memcpy_htod(&self.inputs[which], &mut self.bgr)?;
        let grid = super::grid(self.size)?;
        let (bgr, gray) = (self.image(&self.bgr, 3), self.image(&self.gray, 1));
        let (blurred, binary) = (self.image(&self.blurred, 1), self.image(&self.binary, 1));
        // SAFETY: each image is a `size` allocation of this stream, alive until the twin drops,
        // with the kernels' parameter types (Pitched<uchar3> for `bgr`, Pitched<unsigned char>
        // for the others); each kernel writes only inside its output.
        unsafe {
            s.launch_builder(&k.bgr_to_gray)
                .arg(&bgr)
                .arg(&gray)
                .launch(grid)?;
            s.launch_builder(&k.box3)
                .arg(&gray)
                .arg(&blurred)
                .launch(grid)?;
            let mut launch = s.launch_builder(&k.threshold);
            launch
                .arg(&blurred)
                .arg(&binary)
                .arg(&THRESHOLD)
                .launch(grid)?;
        }
        s.memcpy_dtoh(&self.binary, &mut self.output)?;
        s.synchronize()?;
        Ok(())
    }
}
