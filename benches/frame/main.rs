//! The video-style frame loop, with its temporaries from four allocators, side by side in one run.
//!
//! Every frame: one 1920x1080 grey (u8) frame is uploaded from page-locked host memory, five
//! kernels run through four device temporaries (`blur_h -> t1`, `blur_v -> t2`, `sobel_x -> gx`,
//! `sobel_y -> gy`, `magnitude(gx, gy) -> out`; t1 and t2 are u8, gx and gy i16), the result is
//! downloaded into page-locked host memory and the stream is synchronized. The upload, kernels,
//! download and synchronize are the same for every variant; only where the temporaries come from
//! differs:
//!
//! - `gpu-pool`: `buffer!`s of a `#[pooled(stream)]` function, from the stream's stack;
//! - `cudarc alloc per frame`: `stream.alloc::<u8>` for each, dropped at the end of the frame
//!   (cudarc's stream-ordered allocation on the device's default pool, release threshold 0);
//! - `stream-ordered, raised threshold`: `cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on a pool
//!   whose release threshold is raised to keep everything (`driver::Competitor::AsyncRaised`);
//! - `allocated once`: four `cuMemAlloc`s before the loop, the floor.
//!
//! In every variant the temporaries are given back when the frame's function returns, before the
//! synchronize that ends the frame. Each variant's output is checked against a CPU twin of the
//! pipeline first; then each warms up, and the variants take turns, block by block, for several
//! rounds. Each frame (upload to synchronize) is timed with `Instant`; the medians and their ratios
//! are printed as a markdown table.
//!
//! `cargo bench --bench frame --features cuda [-- ROUNDS [FRAMES]]` (or `FRAME_ROUNDS` /
//! `FRAME_FRAMES`; 20 rounds of 100 frames a variant by default). `FRAME_STREAM=default` runs it
//! with gpu-pool adopting the context's default stream, which leaves cudarc out of its
//! multi-stream (event-tracking) mode. Without a CUDA device it says so
//! and measures nothing.

#[path = "../gpu/driver.rs"]
#[allow(dead_code, reason = "this bench uses three of the competitors")]
mod driver;
#[path = "../support/run.rs"]
mod run;

use std::sync::Arc;
use std::time::{Duration, Instant};

use driver::{Block, Competitor, Driver};
use gpu_pool::cudarc::driver::{CudaContext, CudaFunction, CudaStream, PushKernelArg, result};
use gpu_pool::cudarc::nvrtc::compile_ptx;
use gpu_pool::prelude::*;
use gpu_pool::{Fallback, PITCHED_H, Pitched, PitchedMut, grid_2d, set_buffer_pool_config};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const ROWS: usize = 1080;
const COLS: usize = 1920;
const FRAME: usize = ROWS * COLS;
const WARM_UP: usize = 50;

/// The pipeline, in CUDA C++ after `PITCHED_H`: one thread a pixel, neighbours clamped at the edges,
/// integer arithmetic only (so the CPU twin matches bit for bit).
const SOURCE: &str = r#"
#define PIXEL int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y * blockDim.y + threadIdx.y; \
    if (!dst.contains(y, x)) return; \
    int l = max(x - 1, 0), r = min(x + 1, (int)dst.cols - 1), u = max(y - 1, 0), d = min(y + 1, (int)dst.rows - 1); \
    (void)l; (void)r; (void)u; (void)d;
extern "C" __global__ void blur_h(Pitched<const unsigned char> src, Pitched<unsigned char> dst) {
    PIXEL dst(y, x) = (src(y, l) + 2 * src(y, x) + src(y, r) + 2) >> 2;
}
extern "C" __global__ void blur_v(Pitched<const unsigned char> src, Pitched<unsigned char> dst) {
    PIXEL dst(y, x) = (src(u, x) + 2 * src(y, x) + src(d, x) + 2) >> 2;
}
extern "C" __global__ void sobel_x(Pitched<const unsigned char> src, Pitched<short> dst) {
    PIXEL dst(y, x) = (src(u, r) + 2 * src(y, r) + src(d, r)) - (src(u, l) + 2 * src(y, l) + src(d, l));
}
extern "C" __global__ void sobel_y(Pitched<const unsigned char> src, Pitched<short> dst) {
    PIXEL dst(y, x) = (src(d, l) + 2 * src(d, x) + src(d, r)) - (src(u, l) + 2 * src(u, x) + src(u, r));
}
extern "C" __global__ void magnitude(Pitched<const short> gx, Pitched<const short> gy, Pitched<unsigned char> dst) {
    PIXEL dst(y, x) = min(abs(gx(y, x)) + abs(gy(y, x)), 255);
}
"#;

/// The four temporaries as kernel arguments: t1, t2 (u8), gx, gy (i16).
type Temps<'a> = (
    PitchedMut<'a, u8>,
    PitchedMut<'a, u8>,
    PitchedMut<'a, i16>,
    PitchedMut<'a, i16>,
);

struct Kernels([CudaFunction; 5]);

impl Kernels {
    fn load(ctx: &Arc<CudaContext>) -> Res<Kernels> {
        let module = ctx.load_module(compile_ptx(format!("{PITCHED_H}{SOURCE}"))?)?;
        let names = ["blur_h", "blur_v", "sobel_x", "sobel_y", "magnitude"];
        Ok(Kernels(names.map(|n| {
            module.load_function(n).expect("every kernel is in SOURCE")
        })))
    }

    /// Queues the five kernels: `input` through the temporaries into `output`.
    ///
    /// # Safety
    /// Every argument is `ROWS x COLS` memory of `cs`'s context that stays allocated until `cs` has
    /// run the kernels, and nothing else uses the temporaries or `output` meanwhile.
    unsafe fn run(
        &self,
        cs: &CudaStream,
        input: Pitched<'_, u8>,
        (t1, t2, gx, gy): Temps<'_>,
        output: PitchedMut<'_, u8>,
    ) -> Res<()> {
        let [blur_h, blur_v, sobel_x, sobel_y, magnitude] = &self.0;
        let grid = grid_2d(ROWS, COLS)?;
        // SAFETY: the caller's contract; each kernel's parameters are as in `SOURCE`.
        unsafe {
            cs.launch_builder(blur_h)
                .arg(&input)
                .arg(&t1)
                .launch(grid)?;
            let t1 = t1.as_const();
            cs.launch_builder(blur_v).arg(&t1).arg(&t2).launch(grid)?;
            let t2 = t2.as_const();
            cs.launch_builder(sobel_x).arg(&t2).arg(&gx).launch(grid)?;
            cs.launch_builder(sobel_y).arg(&t2).arg(&gy).launch(grid)?;
            let (gx, gy) = (gx.as_const(), gy.as_const());
            let mut last = cs.launch_builder(magnitude);
            last.arg(&gx).arg(&gy).arg(&output).launch(grid)?;
        }
        Ok(())
    }
}

/// The way in and out, the same for every variant: `cuMemcpyHtoDAsync` from page-locked host memory
/// into a device frame, `cuMemcpyDtoHAsync` from another back into page-locked host memory. Both
/// device frames are contiguous (step = COLS), allocated once, and outlive every `Io`.
struct Io<'a> {
    host_in: &'a [u8],
    host_out: &'a mut [u8],
    dev_in: u64,
    dev_out: u64,
}

impl Io<'_> {
    fn upload(&self, cs: &CudaStream) -> Res<()> {
        // SAFETY: `dev_in` holds FRAME bytes; `host_in` (FRAME bytes, page-locked) is never written
        // again and outlives the copy, which every frame waits for.
        unsafe { result::memcpy_htod_async(self.dev_in, self.host_in, cs.cu_stream()) }?;
        Ok(())
    }

    fn download(&mut self, cs: &CudaStream) -> Res<()> {
        // SAFETY: `dev_out` holds FRAME bytes; `host_out` (FRAME bytes, page-locked) is borrowed
        // mutably by `self` and only read after the synchronize that ends the frame.
        unsafe { result::memcpy_dtoh_async(self.host_out, self.dev_out, cs.cu_stream()) }?;
        Ok(())
    }

    /// The device frames as the pipeline's input and output.
    fn frames(&self) -> (Pitched<'_, u8>, PitchedMut<'_, u8>) {
        // SAFETY: two distinct allocations of ROWS x COLS contiguous bytes, freed only after the
        // last frame's synchronize; only the stream's copies and kernels touch them.
        unsafe {
            (
                Pitched::from_raw_parts(self.dev_in, COLS, ROWS, COLS),
                PitchedMut::from_raw_parts(self.dev_out, COLS, ROWS, COLS),
            )
        }
    }
}

/// One frame's work with its temporaries from the stack; they go back when it returns.
#[pooled(stream)]
fn pooled_frame(stream: &Stream, k: &Kernels, io: &mut Io<'_>) -> Res<()> {
    let cs = stream.cuda_stream().expect("a CUDA stream");
    io.upload(cs)?;
    let mut t1 = buffer!(ROWS, COLS; u8)?;
    let mut t2 = buffer!(ROWS, COLS; u8)?;
    let mut gx = buffer!(ROWS, COLS; i16)?;
    let mut gy = buffer!(ROWS, COLS; i16)?;
    let (input, output) = io.frames();
    let temps = (
        t1.pitched_mut(),
        t2.pitched_mut(),
        gx.pitched_mut(),
        gy.pitched_mut(),
    );
    // SAFETY: ROWS x COLS buffers of this stream's stack, borrowed by `temps` for the launches; the
    // stack hands their memory out again only to work queued later on this stream.
    unsafe { k.run(cs, input, temps, output) }?;
    io.download(cs)
}

/// One frame's work with temporaries from the driver (or cudarc), made by `take_temps`.
fn raw_frame(k: &Kernels, cs: &CudaStream, io: &mut Io<'_>, temps: &[Block; 4]) -> Res<()> {
    io.upload(cs)?;
    let [a, b, c, d] = temps.each_ref().map(|t| t.ptr_pitch(cs));
    let (input, output) = io.frames();
    // SAFETY: each block holds ROWS rows of its pitch, at least COLS elements of its type a row
    // (`take_temps`), and is freed only after these kernels: stream-ordered, on this stream, or
    // after the last frame's synchronize.
    unsafe {
        let temps = (raw(a), raw(b), raw(c), raw(d));
        k.run(cs, input, temps, output)?;
    }
    io.download(cs)
}

/// `ROWS x COLS` elements of `T` at `(address, pitch)`.
///
/// # Safety
/// As `PitchedMut::from_raw_parts`.
unsafe fn raw<T>((ptr, pitch): (u64, usize)) -> PitchedMut<'static, T> {
    // SAFETY: the caller's contract.
    unsafe { PitchedMut::from_raw_parts(ptr, pitch, ROWS, COLS) }
}

/// t1, t2 (u8) and gx, gy (i16) from `who`.
fn take_temps(drv: &Driver, who: Competitor) -> Res<[Block; 4]> {
    let (u8s, i16s) = (COLS, COLS * size_of::<i16>());
    Ok([
        drv.take(who, ROWS, u8s)?,
        drv.take(who, ROWS, u8s)?,
        drv.take(who, ROWS, i16s)?,
        drv.take(who, ROWS, i16s)?,
    ])
}

fn release_temps(drv: &Driver, who: Competitor, temps: [Block; 4]) -> Res<()> {
    for block in temps.into_iter().rev() {
        drv.release(who, block)?;
    }
    Ok(())
}

/// Where the four temporaries come from.
#[derive(Clone, Copy)]
enum Variant {
    Pool,
    PerFrame(Competitor),
    Once,
}

/// The variants, in the table's order; the last is the floor.
const VARIANTS: [(&str, Variant); 4] = [
    ("gpu-pool", Variant::Pool),
    (
        "cudarc alloc per frame",
        Variant::PerFrame(Competitor::Cudarc),
    ),
    (
        "stream-ordered, raised threshold",
        Variant::PerFrame(Competitor::AsyncRaised),
    ),
    ("allocated once", Variant::Once),
];

/// What every variant needs to run a frame.
struct Bench<'a> {
    stream: &'a Stream,
    drv: &'a Driver,
    k: &'a Kernels,
    io: Io<'a>,
    once: [Block; 4],
}

impl Bench<'_> {
    /// One frame, from the upload to the synchronize; the time it took.
    fn frame(&mut self, v: Variant) -> Res<Duration> {
        let (drv, k) = (self.drv, self.k);
        let start = Instant::now();
        match v {
            Variant::Pool => pooled_frame(self.stream, k, &mut self.io)?,
            Variant::Once => raw_frame(k, &drv.stream, &mut self.io, &self.once)?,
            Variant::PerFrame(who) => {
                let temps = take_temps(drv, who)?;
                raw_frame(k, &drv.stream, &mut self.io, &temps)?;
                release_temps(drv, who, temps)?;
            }
        }
        self.stream.synchronize()?;
        Ok(start.elapsed())
    }
}

fn main() -> Res<()> {
    let device = match Device::cuda(0) {
        Ok(device) => device,
        Err(e) => {
            println!("no CUDA device ({e}): the frame benchmark measured nothing");
            return Ok(());
        }
    };
    let (rounds, frames) = (
        run::count(0, "FRAME_ROUNDS", 20),
        run::count(1, "FRAME_FRAMES", 100),
    );
    let ctx = device.cuda_context().expect("a CUDA device").clone();
    ctx.bind_to_thread()?;
    println!(
        "device: {} ({}, driver {})",
        device.id(),
        ctx.name()?,
        run::driver_version()?
    );
    device.set_fallback(Fallback::Error); // every gpu-pool temporary must come from the stack
    set_buffer_pool_config(&device, 64 << 20, 1)?; // the four temporaries take 13 MB
    // `FRAME_STREAM=default`: gpu-pool adopts the context's default stream instead of making one,
    // so the process has no second cudarc stream and cudarc's per-use event tracking stays off.
    // Run both ways: the difference is what a gpu-pool stream costs the rest of a cudarc program.
    let adopt = std::env::var("FRAME_STREAM").is_ok_and(|v| v == "default");
    let stream = if adopt {
        Stream::from_cuda(&device, ctx.default_stream())?
    } else {
        Stream::new(&device)?
    };
    println!(
        "gpu-pool stream: {}; cudarc multi-stream mode (events at every CudaSlice use): {}",
        if adopt {
            "the context's default stream, adopted (Stream::from_cuda)"
        } else {
            "one of its own (Stream::new)"
        },
        ctx.is_in_multi_stream_mode()
    );
    let cs = stream.cuda_stream().expect("a CUDA stream").clone();
    let drv = Driver::new(cs, device.texture_alignment())?;
    let k = Kernels::load(&ctx)?;

    // SAFETY: page-locked host memory, uninitialised: `pinned_in` is written below before any
    // read, `pinned_out` by every download (and filled before each check).
    let (mut pinned_in, mut pinned_out) = unsafe {
        (
            ctx.alloc_pinned_with_flags::<u8>(FRAME, 0)?,
            ctx.alloc_pinned_with_flags::<u8>(FRAME, 0)?,
        )
    };
    let host_in = pinned_in.as_mut_slice()?;
    for (i, px) in host_in.iter_mut().enumerate() {
        let (y, x) = (i / COLS, i % COLS);
        // A checkerboard of 60-pixel squares (strong edges) over a texture (weak ones).
        *px = ((x / 60 + y / 60) % 2 * 120 + (x * 3 + y * 5) % 50 + x * y % 7) as u8;
    }
    let expected = cpu_pipeline(host_in);
    let dev = [
        drv.take(Competitor::MemAlloc, 1, FRAME)?,
        drv.take(Competitor::MemAlloc, 1, FRAME)?,
    ];
    let [dev_in, dev_out] = dev.each_ref().map(|b| b.ptr_pitch(&drv.stream).0);
    let io = Io {
        host_in,
        host_out: pinned_out.as_mut_slice()?,
        dev_in,
        dev_out,
    };
    let once = take_temps(&drv, Competitor::MemAlloc)?;
    let mut b = Bench {
        stream: &stream,
        drv: &drv,
        k: &k,
        io,
        once,
    };

    for (name, v) in VARIANTS {
        b.io.host_out.fill(0x5a);
        b.frame(v)?;
        let wrong = b.io.host_out.iter().zip(&expected);
        let wrong = wrong.filter(|(a, b)| a != b).count();
        println!("{name}: {wrong} pixels differ from the CPU reference");
        assert_eq!(wrong, 0, "{name} computes the wrong image");
        for _ in 0..WARM_UP {
            b.frame(v)?;
        }
    }

    let allocs = device.stats().driver_alloc_calls;
    let mut times = vec![Vec::with_capacity(rounds * frames); VARIANTS.len()];
    for round in 0..rounds {
        for i in 0..VARIANTS.len() {
            let v = (round + i) % VARIANTS.len(); // each round, another variant goes first
            for _ in 0..frames {
                times[v].push(b.frame(VARIANTS[v].1)?);
            }
        }
    }
    let pool_allocs = device.stats().driver_alloc_calls - allocs;
    print_table(&mut times, rounds, frames, pool_allocs);

    let Bench { once, .. } = b;
    release_temps(&drv, Competitor::MemAlloc, once)?;
    for block in dev {
        drv.release(Competitor::MemAlloc, block)?;
    }
    Ok(())
}

/// The pipeline on the CPU, as `SOURCE` computes it.
fn cpu_pipeline(src: &[u8]) -> Vec<u8> {
    /// `f(at)` at every pixel of `img`, `at(dy, dx)` reading its neighbour, clamped at the edges.
    fn map(img: &[i32], f: impl Fn(&dyn Fn(isize, isize) -> i32) -> i32) -> Vec<i32> {
        let clamp = |v: isize, n: usize| v.clamp(0, n as isize - 1) as usize;
        let mut out = Vec::with_capacity(img.len());
        for y in 0..ROWS as isize {
            for x in 0..COLS as isize {
                out.push(f(&|dy, dx| {
                    img[clamp(y + dy, ROWS) * COLS + clamp(x + dx, COLS)]
                }));
            }
        }
        out
    }
    let img: Vec<i32> = src.iter().map(|&v| i32::from(v)).collect();
    let t1 = map(&img, |at| (at(0, -1) + 2 * at(0, 0) + at(0, 1) + 2) >> 2);
    let t2 = map(&t1, |at| (at(-1, 0) + 2 * at(0, 0) + at(1, 0) + 2) >> 2);
    let gx = map(&t2, |at| {
        (at(-1, 1) + 2 * at(0, 1) + at(1, 1)) - (at(-1, -1) + 2 * at(0, -1) + at(1, -1))
    });
    let gy = map(&t2, |at| {
        (at(1, -1) + 2 * at(1, 0) + at(1, 1)) - (at(-1, -1) + 2 * at(-1, 0) + at(-1, 1))
    });
    let out: Vec<u8> = gx
        .iter()
        .zip(&gy)
        .map(|(a, b)| (a.abs() + b.abs()).min(255) as u8)
        .collect();
    assert!(
        out.contains(&255) && out.iter().any(|&v| v > 0 && v < 255),
        "the test frame has strong and weak edges"
    );
    out
}

/// The medians (and 10th / 90th percentiles) per frame, with the ratios of the medians.
fn print_table(times: &mut [Vec<Duration>], rounds: usize, frames: usize, pool_allocs: u64) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let pct = |t: &[Duration], p: usize| us(t[(t.len() - 1) * p / 100]);
    for t in times.iter_mut() {
        t.sort();
    }
    let median = |v: usize| pct(&times[v], 50);
    let (pool, once) = (median(0), median(VARIANTS.len() - 1));
    println!(
        "\n### One 1920x1080 u8 frame: upload, blur_h, blur_v, sobel_x, sobel_y, magnitude, \
         download, synchronize ({rounds} rounds x {frames} frames a variant, interleaved)\n"
    );
    println!(
        "Upload and download for every variant: cuMemcpyHtoDAsync / cuMemcpyDtoHAsync between \
         page-locked host buffers (cuMemHostAlloc) and contiguous device frames allocated once. \
         Temporaries: 2 x u8 + 2 x i16, 1920x1080, given back before the frame's synchronize.\n"
    );
    println!(
        "| temporaries | median / frame | p10 | p90 | vs `gpu-pool` | vs `allocated once` |\n\
         |---|---:|---:|---:|---:|---:|"
    );
    for (v, (name, _)) in VARIANTS.iter().enumerate() {
        let m = median(v);
        println!(
            "| `{name}` | {m:.1} µs | {:.1} µs | {:.1} µs | {:.2}x | {:.2}x |",
            pct(&times[v], 10),
            pct(&times[v], 90),
            m / pool,
            m / once
        );
    }
    println!("\ngpu-pool: {pool_allocs} driver allocation calls during the timed frames");
}
