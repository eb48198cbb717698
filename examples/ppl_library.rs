//! ppl.cv's memory pool from both sides (`shared/seeds/002_*.txt`): library functions that need an
//! intermediate buffer take it from the pool when the application has activated one and allocate
//! it otherwise; the application calls them 1000 times, first without the pool, then with it.
//! Checks both against a CPU reference and prints the driver allocations of each run.
//!
//! `cargo run --release --features pplcv --example ppl_library [-- ITERATIONS]`

mod support;

use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::compat::pplcv::{
    GpuMemoryBlock, activate_gpu_memory_pool_on, ceil_2d_volume, memory_pool_used,
    ppl_cuda_malloc_pitch, shutdown_gpu_memory_pool,
};
use gpu_pool::prelude::*;

/// The library: a two-pass box filter and an adaptive threshold, as ppl.cv writes them.
mod library {
    use super::*;

    /// The float intermediate of the two passes: from the ppl.cv pool when it is active, else a
    /// buffer of its own (what the function would `cudaMallocPitch` without the pool).
    enum Scratch<'s> {
        Pool(GpuMemoryBlock),
        Own(GpuMat<'s, f32>),
    }

    impl<'s> Scratch<'s> {
        fn new(stream: &'s Stream, rows: usize, cols: usize) -> Result<Scratch<'s>, PoolError> {
            if memory_pool_used() {
                let mut block = GpuMemoryBlock::default();
                ppl_cuda_malloc_pitch(cols * 4, rows, &mut block)?;
                Ok(Scratch::Pool(block))
            } else {
                Ok(Scratch::Own(GpuMat::new(stream, rows, cols)?))
            }
        }

        /// The intermediate as a kernel's output, `rows x cols` floats.
        #[cfg(feature = "cuda")]
        fn pitched_mut(
            &mut self,
            rows: usize,
            cols: usize,
        ) -> gpu_pool::interop::PitchedMut<'_, f32> {
            match self {
                // SAFETY: the block holds `rows` rows of `cols` floats at its pitch (asked for in
                // `new`) and is borrowed, so it stays allocated, while the argument lives.
                Scratch::Pool(b) => unsafe {
                    gpu_pool::interop::PitchedMut::from_raw_parts(
                        b.device_ptr(),
                        b.pitch(),
                        rows,
                        cols,
                    )
                },
                Scratch::Own(m) => m.pitched_mut(),
            }
        }

        /// Writes the rows as host slices (host backend), for the CPU twin of pass 1.
        fn write_rows(
            &mut self,
            rows: usize,
            cols: usize,
            mut f: impl FnMut(usize, &mut [f32]),
        ) -> Result<(), PoolError> {
            match self {
                Scratch::Pool(b) => {
                    let pitch = b.pitch();
                    for (y, row) in b.host_bytes_mut()?.chunks_mut(pitch).take(rows).enumerate() {
                        f(y, bytemuck::cast_slice_mut(&mut row[..cols * 4]));
                    }
                    Ok(())
                }
                Scratch::Own(m) => m.for_each_host_row_mut(f),
            }
        }

        /// The rows as host slices (host backend), for the CPU twin of pass 2.
        fn read_rows(&mut self, rows: usize, cols: usize) -> Result<Vec<&[f32]>, PoolError> {
            match self {
                Scratch::Pool(b) => {
                    let pitch = b.pitch();
                    let bytes: &[u8] = b.host_bytes_mut()?;
                    Ok(bytes
                        .chunks(pitch)
                        .take(rows)
                        .map(|row| bytemuck::cast_slice(&row[..cols * 4]))
                        .collect())
                }
                Scratch::Own(m) => Ok(m.host_rows()?.collect()),
            }
        }
    }

    #[derive(Clone, Copy)]
    pub(crate) enum Output {
        Mean,
        Threshold(i32),
    }

    /// The shared two passes: horizontal sums into the intermediate, then vertical.
    pub(crate) fn box_pass(
        stages: &support::Stages,
        stream: &Stream,
        src: &impl GpuRead<u8>,
        dst: &mut impl GpuWrite<u8>,
        r: i32,
        out: Output,
    ) -> Result<(), PoolError> {
        let (rows, cols) = (src.rows(), src.cols());
        let mut tmp = Scratch::new(stream, rows, cols)?;
        let (mode, c) = match out {
            Output::Mean => (0, 0),
            Output::Threshold(c) => (1, c),
        };
        #[cfg(feature = "cuda")]
        if let Some(k) = stages.kernels() {
            let s = stream.cudarc().expect("CUDA stream");
            // SAFETY: the three buffers hold rows x cols of their element; the intermediate lives
            // until this function returns, after the stream has queued both kernels (ppl.cv's
            // reuse is in host order, on one stream), and `dst` is borrowed mutably meanwhile.
            unsafe {
                let tmp = tmp.pitched_mut(rows, cols);
                support::kernels::box_passes(
                    k,
                    s,
                    (src.pitched(), tmp),
                    dst.pitched_mut(),
                    r,
                    (c, mode),
                )
            }?;
            return Ok(());
        }
        let _ = stages;
        let src_rows: Vec<&[u8]> = src.host_rows()?.collect();
        tmp.write_rows(rows, cols, |y, row| {
            for (x, v) in row.iter_mut().enumerate() {
                *v = super::reference::row_sum(src_rows[y], x, r);
            }
        })?;
        let tmp_rows = tmp.read_rows(rows, cols)?;
        dst.for_each_host_row_mut(|y, out_row| {
            for (x, o) in out_row.iter_mut().enumerate() {
                *o = super::reference::finish(&tmp_rows, src_rows[y][x], x, y, r, mode, c);
            }
        })
    }

    /// ppl.cv's `BoxFilter`: the mean of each (2r+1)² window, edges clamped.
    pub(crate) fn box_filter(
        stages: &support::Stages,
        stream: &Stream,
        src: &impl GpuRead<u8>,
        dst: &mut impl GpuWrite<u8>,
        r: i32,
    ) -> Result<(), PoolError> {
        box_pass(stages, stream, src, dst, r, Output::Mean)
    }

    /// ppl.cv's `AdaptiveThreshold` (mean method): 255 where a pixel exceeds its window mean minus `c`.
    pub(crate) fn adaptive_threshold(
        stages: &support::Stages,
        stream: &Stream,
        src: &impl GpuRead<u8>,
        dst: &mut impl GpuWrite<u8>,
        r: i32,
        c: i32,
    ) -> Result<(), PoolError> {
        box_pass(stages, stream, src, dst, r, Output::Threshold(c))
    }
}

/// The CPU reference, the same float arithmetic as the kernels.
mod reference {
    pub(crate) fn row_sum(row: &[u8], x: usize, r: i32) -> f32 {
        let last = row.len() as i32 - 1;
        (-r..=r)
            .map(|k| f32::from(row[(x as i32 + k).clamp(0, last) as usize]))
            .sum()
    }

    pub(crate) fn finish(
        tmp: &[&[f32]],
        px: u8,
        x: usize,
        y: usize,
        r: i32,
        mode: i32,
        c: i32,
    ) -> u8 {
        let last = tmp.len() as i32 - 1;
        let s: f32 = (-r..=r)
            .map(|k| tmp[(y as i32 + k).clamp(0, last) as usize][x])
            .sum();
        let mean = s / ((2 * r + 1) * (2 * r + 1)) as f32;
        if mode == 0 {
            (mean + 0.5) as u8
        } else if f32::from(px) > mean - c as f32 {
            255
        } else {
            0
        }
    }

    pub(crate) fn run(
        image: &[u8],
        rows: usize,
        cols: usize,
        r: i32,
        mode: i32,
        c: i32,
    ) -> Vec<u8> {
        let tmp: Vec<Vec<f32>> = image
            .chunks(cols)
            .map(|row| (0..cols).map(|x| row_sum(row, x, r)).collect())
            .collect();
        let tmp: Vec<&[f32]> = tmp.iter().map(Vec::as_slice).collect();
        (0..rows * cols)
            .map(|i| finish(&tmp, image[i], i % cols, i / cols, r, mode, c))
            .collect()
    }
}

fn main() -> Result<(), PoolError> {
    let device = Device::cuda_or_host();
    let stages = support::Stages::new(&device);
    // 1080p on a GPU; a smaller image keeps the CPU twins quick on the host backend.
    let (rows, cols) = if device.is_host() {
        (96, 128)
    } else {
        (1080, 1920)
    };
    let iterations = support::count_arg(1000);
    let (r, c) = (2, 5);
    let stream = Stream::new(&device)?;
    let image: Vec<u8> = (0..rows * cols)
        .map(|i| ((i * 37) ^ (i / cols * 11)) as u8)
        .collect();
    let src = GpuMat::from_host(&stream, rows, cols, &image)?;
    let mut blurred = GpuMat::<u8>::new(&stream, rows, cols)?;
    let mut binary = GpuMat::<u8>::new(&stream, rows, cols)?;
    println!("device: {}", support::Stages::describe(&device));

    for pooled in [false, true] {
        if pooled {
            // The application sizes the pool for the largest intermediate and activates it once.
            activate_gpu_memory_pool_on(&device, ceil_2d_volume(cols * 4, rows))?;
        }
        let calls = device.stats().driver_alloc_calls;
        let start = std::time::Instant::now();
        for _ in 0..iterations {
            library::adaptive_threshold(&stages, &stream, &src, &mut binary, r, c)?;
            library::box_filter(&stages, &stream, &src, &mut blurred, r)?;
        }
        stream.synchronize()?;
        let elapsed = start.elapsed();
        let calls = device.stats().driver_alloc_calls - calls;
        if pooled {
            shutdown_gpu_memory_pool()?;
        }
        let wrong = reference::run(&image, rows, cols, r, 1, c)
            .iter()
            .zip(binary.to_vec()?)
            .chain(
                reference::run(&image, rows, cols, r, 0, 0)
                    .iter()
                    .zip(blurred.to_vec()?),
            )
            .filter(|&(a, b)| *a != b)
            .count();
        println!(
            "{} pool: {iterations} x (AdaptiveThreshold + BoxFilter) on {cols}x{rows} in {:.1} ms, {calls} driver allocations in the loop, {wrong} pixels differing from the CPU reference",
            if pooled { "with the   " } else { "without the" },
            elapsed.as_secs_f64() * 1e3,
        );
        if wrong != 0 {
            std::process::exit(1);
        }
    }
    drop((src, blurred, binary));
    drop(stream);
    device.release_stack_memory()?; // everything freed before exit, as a leak checker wants
    Ok(())
}
