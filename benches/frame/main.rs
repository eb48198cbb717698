//! The video-style frame loop, with its temporaries from four allocators and its frames moved two
//! ways, side by side in one run, at one or more frame sizes.
//!
//! Every frame: one grey (u8) frame is uploaded from page-locked host memory, five kernels run
//! through four device temporaries (`blur_h -> t1`, `blur_v -> t2`, `sobel_x -> gx`,
//! `sobel_y -> gy`, `magnitude(gx, gy) -> out`; t1 and t2 are u8, gx and gy i16), the result is
//! downloaded into page-locked host memory and the stream is synchronized. The kernels and the
//! synchronize are the same for every variant; what differs is where the temporaries come from
//! and, for one variant, how the frames move:
//!
//! - `gpu-pool`: `buffer!`s of a `#[pooled(stream)]` function, from the stream's stack; the
//!   frames move as in the floor (below);
//! - `gpu-pool own transfers`: the same `#[pooled(stream)]` frame, with gpu-pool's own frames and
//!   copies instead: `HostMem` page-locked host frames, packed `GpuMat` device frames allocated
//!   once (`new_packed`: rows back to back, as the floor's), `upload_async` / `download_async`
//!   between them (`HostMem` notes each copy with a ticket of the stream's clock, which the
//!   frame's synchronize covers, so the host cannot touch the memory under a copy);
//! - `cudarc alloc per frame`: `stream.alloc::<u8>` for each, dropped at the end of the frame
//!   (cudarc's stream-ordered allocation on the device's default pool, release threshold 0);
//! - `stream-ordered, raised threshold`: `cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on a pool
//!   whose release threshold is raised to keep everything (`driver::Competitor::AsyncRaised`);
//! - `allocated once`: four `cuMemAlloc`s before the loop, the floor.
//!
//! Every variant but `gpu-pool own transfers` moves its frames with cudarc's
//! `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` between `cuMemHostAlloc` host frames and contiguous
//! `cuMemAlloc` device frames allocated once. In every variant the temporaries are given back when
//! the frame's function returns, before the synchronize that ends the frame.
//!
//! Each frame size is measured on its own, in one process: its frames and the floor's temporaries
//! are allocated, each variant's output is checked against a CPU twin of the pipeline, then each
//! warms up, and the variants take turns, block by block, for several rounds. Each frame (upload
//! to synchronize) is timed with `Instant`; the medians and their ratios are printed as one
//! markdown table a size. gpu-pool's stack is sized once, for the largest size's temporaries.
//!
//! `cargo bench -p gpu-pool-benches --bench frame [-- ROUNDS [FRAMES]]` (or `FRAME_ROUNDS` /
//! `FRAME_FRAMES`; 20 rounds of 100 frames a variant by default). `FRAME_SIZES` lists the sizes,
//! `WxH`, comma-separated, measured in its order (1920x1080 by default; each side at least 64):
//! `FRAME_SIZES=256x256,640x480,1920x1080,3840x2160,7680x4320 cargo bench -p gpu-pool-benches --bench frame`.
//! `FRAME_STREAM=default` runs it with gpu-pool adopting the context's default stream (both
//! gpu-pool variants use it), which leaves cudarc out of its multi-stream (event-tracking) mode.
//! Without a CUDA device it says so and measures nothing.

#[path = "../gpu/driver.rs"]
#[allow(dead_code, reason = "this bench uses three of the competitors")]
mod driver;
#[path = "../support/run.rs"]
mod run;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use driver::{Block, Competitor, Driver};
use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::interop::cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, PushKernelArg, result,
};
use gpu_pool::interop::cudarc::nvrtc::compile_ptx;
use gpu_pool::prelude::*;
use gpu_pool::{
    HostMem, compat::opencv::set_buffer_pool_config, config::Fallback, interop::PITCHED_H,
    interop::Pitched, interop::PitchedMut, interop::grid_2d,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const WARM_UP: usize = 50;

/// A frame's shape: `rows x cols` u8 pixels. `FRAME_SIZES` writes it `WxH`, columns first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Size {
    rows: usize,
    cols: usize,
}

impl Size {
    /// The smallest side accepted: the check needs the strong edges of the test image's 60-pixel
    /// checkerboard (`test_image`) inside the frame.
    const MIN_SIDE: usize = 64;

    fn pixels(self) -> usize {
        self.rows * self.cols
    }

    /// `WxH`, such as `1920x1080`.
    fn parse(s: &str) -> Res<Size> {
        let s = s.trim();
        let bad = || format!("FRAME_SIZES: `{s}` is not WxH (such as 1920x1080)");
        let (w, h) = s.split_once(['x', 'X']).ok_or_else(bad)?;
        let side = |v: &str| v.trim().parse::<usize>().map_err(|_| bad());
        let size = Size {
            rows: side(h)?,
            cols: side(w)?,
        };
        if size.rows < Size::MIN_SIDE || size.cols < Size::MIN_SIDE {
            let min = Size::MIN_SIDE;
            return Err(format!("FRAME_SIZES: {size} has a side under {min} pixels").into());
        }
        Ok(size)
    }

    /// The sizes `FRAME_SIZES` names, in its order; 1920x1080 without it.
    fn from_env() -> Res<Vec<Size>> {
        let list = std::env::var("FRAME_SIZES").unwrap_or_else(|_| "1920x1080".into());
        let sizes: Vec<Size> = list
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(Size::parse)
            .collect::<Res<_>>()?;
        if sizes.is_empty() {
            return Err("FRAME_SIZES names no size".into());
        }
        Ok(sizes)
    }

    /// Bytes of the stack one frame's four temporaries take: each block starts on its alignment
    /// above the one before, as the stack's bump lays them out.
    fn stack_bytes(self, device: &Device) -> Res<usize> {
        let (rows, cols) = (self.rows, self.cols);
        let blocks = [
            device.footprint::<u8>(rows, cols)?,
            device.footprint::<u8>(rows, cols)?,
            device.footprint::<i16>(rows, cols)?,
            device.footprint::<i16>(rows, cols)?,
        ];
        let top = blocks.iter().fold(0, |top: usize, block| {
            top.next_multiple_of(block.align) + block.bytes
        });
        Ok(top)
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.cols, self.rows)
    }
}

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

    /// Queues the five kernels, one thread a pixel of `size`: `input` through the temporaries into
    /// `output`.
    ///
    /// # Safety
    /// Every argument is `size` memory (`size.rows` rows of `size.cols` elements) of `cs`'s
    /// context that stays allocated until `cs` has run the kernels, and nothing else uses the
    /// temporaries or `output` meanwhile.
    unsafe fn run(
        &self,
        cs: &CudaStream,
        size: Size,
        input: Pitched<'_, u8>,
        (t1, t2, gx, gy): Temps<'_>,
        output: PitchedMut<'_, u8>,
    ) -> Res<()> {
        let [blur_h, blur_v, sobel_x, sobel_y, magnitude] = &self.0;
        let grid = grid_2d(size.rows, size.cols)?;
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

/// The way in and out of every variant but `gpu-pool own transfers`: `cuMemcpyHtoDAsync` from
/// page-locked host memory into a device frame, `cuMemcpyDtoHAsync` from another back into
/// page-locked host memory. Both device frames are contiguous (step = `size.cols`), allocated once
/// for `size`, and outlive every `Io`; both host frames hold `size.pixels()` bytes.
struct Io<'a> {
    size: Size,
    host_in: &'a [u8],
    host_out: &'a mut [u8],
    dev_in: u64,
    dev_out: u64,
}

impl Io<'_> {
    fn upload(&self, cs: &CudaStream) -> Res<()> {
        // SAFETY: `dev_in` holds `size.pixels()` bytes, as many as `host_in` (page-locked), which
        // is never written again and outlives the copy, which every frame waits for.
        unsafe { result::memcpy_htod_async(self.dev_in, self.host_in, cs.cu_stream()) }?;
        Ok(())
    }

    fn download(&mut self, cs: &CudaStream) -> Res<()> {
        // SAFETY: `dev_out` holds `size.pixels()` bytes, as many as `host_out` (page-locked),
        // which is borrowed mutably by `self` and only read after the synchronize that ends the
        // frame.
        unsafe { result::memcpy_dtoh_async(self.host_out, self.dev_out, cs.cu_stream()) }?;
        Ok(())
    }

    /// The device frames as the pipeline's input and output.
    fn frames(&self) -> (Pitched<'_, u8>, PitchedMut<'_, u8>) {
        let Size { rows, cols } = self.size;
        // SAFETY: two distinct allocations of `rows x cols` contiguous bytes, freed only after the
        // last frame's synchronize; only the stream's copies and kernels touch them.
        unsafe {
            (
                Pitched::from_raw_parts(self.dev_in, cols, rows, cols),
                PitchedMut::from_raw_parts(self.dev_out, cols, rows, cols),
            )
        }
    }
}

/// The way in and out of `gpu-pool own transfers`: gpu-pool's own frames and copies, to set
/// against cudarc's in `Io`. `HostMem` host frames (page-locked, `cuMemHostAlloc`) and `GpuMat`
/// device frames (`GpuMat::new_packed`: allocated once, rows back to back like cudarc's, so a copy
/// is one run of bytes rather than a row at a time), all of one `size`, with `upload_async` /
/// `download_async` between them, each noted by the `HostMem` (a ticket the frame's synchronize
/// covers), which waits for it before the host touches or frees the memory.
struct OwnIo<'s> {
    host_in: HostMem<u8>,
    host_out: HostMem<u8>,
    input: GpuMat<'s, u8>,
    output: GpuMat<'s, u8>,
}

/// One frame's work with its temporaries from the stack; they go back when it returns.
#[pooled(stream)]
fn pooled_frame(stream: &Stream, k: &Kernels, io: &mut Io<'_>, size: Size) -> Res<()> {
    let cs = stream.cudarc().expect("a CUDA stream");
    io.upload(cs)?;
    let mut t1 = buffer!(size.rows, size.cols; u8)?;
    let mut t2 = buffer!(size.rows, size.cols; u8)?;
    let mut gx = buffer!(size.rows, size.cols; i16)?;
    let mut gy = buffer!(size.rows, size.cols; i16)?;
    let (input, output) = io.frames();
    let temps = (
        t1.pitched_mut(),
        t2.pitched_mut(),
        gx.pitched_mut(),
        gy.pitched_mut(),
    );
    // SAFETY: `io`'s frames are `size` (`Io`); the temporaries are `size` buffers of this stream's
    // stack, borrowed by `temps` for the launches; the stack hands their memory out again only to
    // work queued later on this stream.
    unsafe { k.run(cs, size, input, temps, output) }?;
    io.download(cs)
}

/// `pooled_frame` with gpu-pool's own frames and copies (`OwnIo`): the upload and download are
/// queued on the stream and return; the frame's synchronize is the one wait, as for the others.
#[pooled(stream)]
fn pooled_own_frame(stream: &Stream, k: &Kernels, own: &mut OwnIo<'_>, size: Size) -> Res<()> {
    let cs = stream.cudarc().expect("a CUDA stream");
    own.input.upload_async(&own.host_in)?;
    let mut t1 = buffer!(size.rows, size.cols; u8)?;
    let mut t2 = buffer!(size.rows, size.cols; u8)?;
    let mut gx = buffer!(size.rows, size.cols; i16)?;
    let mut gy = buffer!(size.rows, size.cols; i16)?;
    let temps = (
        t1.pitched_mut(),
        t2.pitched_mut(),
        gx.pitched_mut(),
        gy.pitched_mut(),
    );
    let (input, output) = (own.input.pitched(), own.output.pitched_mut());
    // SAFETY: `own`'s device frames are `size` `GpuMat`s of this stream, borrowed by `input` and
    // `output` for the launches, and live until the last frame's synchronize; the temporaries as
    // in `pooled_frame`.
    unsafe { k.run(cs, size, input, temps, output) }?;
    own.output.download_async(&mut own.host_out)?;
    Ok(())
}

/// One frame's work with temporaries from the driver (or cudarc), made by `take_temps`.
fn raw_frame(
    k: &Kernels,
    cs: &CudaStream,
    io: &mut Io<'_>,
    temps: &[Block; 4],
    size: Size,
) -> Res<()> {
    io.upload(cs)?;
    let [a, b, c, d] = temps.each_ref().map(|t| t.ptr_pitch(cs));
    let (input, output) = io.frames();
    // SAFETY: `io`'s frames are `size` (`Io`); each block holds `size.rows` rows of its pitch, at
    // least `size.cols` elements of its type a row (`take_temps(.., size)`), and is freed only
    // after these kernels: stream-ordered, on this stream, or after the last frame's synchronize.
    unsafe {
        let temps = (raw(a, size), raw(b, size), raw(c, size), raw(d, size));
        k.run(cs, size, input, temps, output)?;
    }
    io.download(cs)
}

/// `size.rows x size.cols` elements of `T` at `(address, pitch)`.
///
/// # Safety
/// As `PitchedMut::from_raw_parts`.
unsafe fn raw<T>((ptr, pitch): (u64, usize), size: Size) -> PitchedMut<'static, T> {
    // SAFETY: the caller's contract.
    unsafe { PitchedMut::from_raw_parts(ptr, pitch, size.rows, size.cols) }
}

/// t1, t2 (u8) and gx, gy (i16) of `size` from `who`.
fn take_temps(drv: &Driver, who: Competitor, size: Size) -> Res<[Block; 4]> {
    let (u8s, i16s) = (size.cols, size.cols * size_of::<i16>());
    Ok([
        drv.take(who, size.rows, u8s)?,
        drv.take(who, size.rows, u8s)?,
        drv.take(who, size.rows, i16s)?,
        drv.take(who, size.rows, i16s)?,
    ])
}

fn release_temps(drv: &Driver, who: Competitor, temps: [Block; 4]) -> Res<()> {
    for block in temps.into_iter().rev() {
        drv.release(who, block)?;
    }
    Ok(())
}

/// Where the four temporaries come from (and, for `PoolOwnTransfers`, how the frames move).
#[derive(Clone, Copy)]
enum Variant {
    Pool,
    PoolOwnTransfers,
    PerFrame(Competitor),
    Once,
}

/// The variants, in the table's order; the first is the reference, the last the floor.
const VARIANTS: [(&str, Variant); 5] = [
    ("gpu-pool", Variant::Pool),
    ("gpu-pool own transfers", Variant::PoolOwnTransfers),
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

/// What every variant needs to run a frame of one size.
struct Bench<'a> {
    stream: &'a Stream,
    drv: &'a Driver,
    k: &'a Kernels,
    size: Size,
    io: Io<'a>,
    own: OwnIo<'a>,
    once: [Block; 4],
}

impl Bench<'_> {
    /// One frame, from the upload to the synchronize; the time it took.
    fn frame(&mut self, v: Variant) -> Res<Duration> {
        let (drv, k, size) = (self.drv, self.k, self.size);
        let start = Instant::now();
        match v {
            Variant::Pool => pooled_frame(self.stream, k, &mut self.io, size)?,
            Variant::PoolOwnTransfers => pooled_own_frame(self.stream, k, &mut self.own, size)?,
            Variant::Once => raw_frame(k, &drv.stream, &mut self.io, &self.once, size)?,
            Variant::PerFrame(who) => {
                let temps = take_temps(drv, who, size)?;
                raw_frame(k, &drv.stream, &mut self.io, &temps, size)?;
                release_temps(drv, who, temps)?;
            }
        }
        self.stream.synchronize()?;
        Ok(start.elapsed())
    }

    /// Fills the host frame `v` downloads into with 0x5a, so that a download that did not land
    /// fails the check.
    fn clear_output(&mut self, v: Variant) -> Res<()> {
        match v {
            Variant::PoolOwnTransfers => self.own.host_out.as_mut_slice()?.fill(0x5a),
            _ => self.io.host_out.fill(0x5a),
        }
        Ok(())
    }

    /// The host frame `v` downloaded into (`HostMem` waits for its download first).
    fn output(&self, v: Variant) -> Res<&[u8]> {
        Ok(match v {
            Variant::PoolOwnTransfers => self.own.host_out.as_slice()?,
            _ => self.io.host_out,
        })
    }
}

fn main() -> Res<()> {
    let sizes = Size::from_env()?;
    let device = match Device::cuda(0) {
        Ok(device) => device,
        Err(e) => {
            println!("no CUDA device ({e}): the frame benchmark measured nothing");
            return Ok(());
        }
    };
    let runs = (
        run::count(0, "FRAME_ROUNDS", 20),
        run::count(1, "FRAME_FRAMES", 100),
    );
    let ctx = device.cudarc().expect("a CUDA device").clone();
    ctx.bind_to_thread()?;
    println!(
        "device: {} ({}, driver {})",
        device.id(),
        ctx.name()?,
        run::driver_version()?
    );
    device.set_fallback(Fallback::Error); // every gpu-pool temporary must come from the stack
    // One stack for every size, so it must hold the largest size's four temporaries (8K: about
    // 190 MiB); rounded up to a MiB, with one more to spare.
    let mut need = 0;
    for size in &sizes {
        need = need.max(size.stack_bytes(&device)?);
    }
    let stack_size = need.next_multiple_of(1 << 20) + (1 << 20);
    set_buffer_pool_config(&device, stack_size, 1)?;
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
    println!(
        "gpu-pool stack: {} MiB (the largest size's temporaries take {need} bytes)",
        stack_size >> 20
    );
    let cs = stream.cudarc().expect("a CUDA stream").clone();
    let drv = Driver::new(cs, device.texture_alignment())?;
    let k = Kernels::load(&ctx)?;
    for size in sizes {
        measure(&stream, &drv, &k, size, runs)?;
    }
    Ok(())
}

/// One size, from start to end: its frames and the floor's temporaries, the check of every
/// variant against `cpu_pipeline`, the warm-up, `rounds` interleaved rounds of `frames` frames a
/// variant, and its table. Everything it allocates is freed before it returns.
fn measure(
    stream: &Stream,
    drv: &Driver,
    k: &Kernels,
    size: Size,
    (rounds, frames): (usize, usize),
) -> Res<()> {
    let device = stream.device();
    let ctx = drv.stream.context();
    let pixels = size.pixels();
    // SAFETY: page-locked host memory, uninitialised: `pinned_in` is written below before any
    // read, `pinned_out` by every download (and filled before each check).
    let (mut pinned_in, mut pinned_out) = unsafe {
        (
            ctx.alloc_pinned_with_flags::<u8>(pixels, 0)?,
            ctx.alloc_pinned_with_flags::<u8>(pixels, 0)?,
        )
    };
    let host_in = pinned_in.as_mut_slice()?;
    test_image(host_in, size);
    let expected = cpu_pipeline(host_in, size);
    let dev = [
        drv.take(Competitor::MemAlloc, 1, pixels)?,
        drv.take(Competitor::MemAlloc, 1, pixels)?,
    ];
    let [dev_in, dev_out] = dev.each_ref().map(|b| b.ptr_pitch(&drv.stream).0);
    let io = Io {
        size,
        host_in,
        host_out: pinned_out.as_mut_slice()?,
        dev_in,
        dev_out,
    };
    let mut own_in = HostMem::<u8>::new(device, pixels)?;
    test_image(own_in.as_mut_slice()?, size);
    let own = OwnIo {
        host_in: own_in,
        host_out: HostMem::new(device, pixels)?,
        input: GpuMat::new_packed(stream, size.rows, size.cols)?,
        output: GpuMat::new_packed(stream, size.rows, size.cols)?,
    };
    let once = take_temps(drv, Competitor::MemAlloc, size)?;
    let mut b = Bench {
        stream,
        drv,
        k,
        size,
        io,
        own,
        once,
    };

    println!("\n{size}:");
    for (name, v) in VARIANTS {
        b.clear_output(v)?;
        b.frame(v)?;
        let wrong = b.output(v)?.iter().zip(&expected);
        let wrong = wrong.filter(|(got, want)| got != want).count();
        println!("{name}: {wrong} pixels differ from the CPU reference");
        assert_eq!(wrong, 0, "{name} computes the wrong image at {size}");
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
    print_table(&mut times, size, (rounds, frames), pool_allocs);

    let Bench { once, own, .. } = b;
    drop(own); // its `GpuMat`s go back to the driver, its `HostMem`s wait for their copies
    release_temps(drv, Competitor::MemAlloc, once)?;
    for block in dev {
        drv.release(Competitor::MemAlloc, block)?;
    }
    Ok(())
}

/// The test image, the same for every variant: a checkerboard of 60-pixel squares (strong edges)
/// over a texture (weak ones).
fn test_image(pixels: &mut [u8], size: Size) {
    for (i, px) in pixels.iter_mut().enumerate() {
        let (y, x) = (i / size.cols, i % size.cols);
        *px = ((x / 60 + y / 60) % 2 * 120 + (x * 3 + y * 5) % 50 + x * y % 7) as u8;
    }
}

/// The pipeline on the CPU, as `SOURCE` computes it, on a `size` frame.
fn cpu_pipeline(src: &[u8], size: Size) -> Vec<u8> {
    let Size { rows, cols } = size;
    /// `f(at)` at every pixel of `img` (`rows x cols`), `at(dy, dx)` reading its neighbour,
    /// clamped at the edges.
    fn map(
        img: &[i32],
        (rows, cols): (usize, usize),
        f: impl Fn(&dyn Fn(isize, isize) -> i32) -> i32,
    ) -> Vec<i32> {
        let clamp = |v: isize, n: usize| v.clamp(0, n as isize - 1) as usize;
        let mut out = Vec::with_capacity(img.len());
        for y in 0..rows as isize {
            for x in 0..cols as isize {
                out.push(f(&|dy, dx| {
                    img[clamp(y + dy, rows) * cols + clamp(x + dx, cols)]
                }));
            }
        }
        out
    }
    let shape = (rows, cols);
    let img: Vec<i32> = src.iter().map(|&v| i32::from(v)).collect();
    let t1 = map(&img, shape, |at| {
        (at(0, -1) + 2 * at(0, 0) + at(0, 1) + 2) >> 2
    });
    let t2 = map(&t1, shape, |at| {
        (at(-1, 0) + 2 * at(0, 0) + at(1, 0) + 2) >> 2
    });
    let gx = map(&t2, shape, |at| {
        (at(-1, 1) + 2 * at(0, 1) + at(1, 1)) - (at(-1, -1) + 2 * at(0, -1) + at(1, -1))
    });
    let gy = map(&t2, shape, |at| {
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

/// The medians (and 10th / 90th percentiles) per frame at `size`, with the ratios of the medians.
fn print_table(
    times: &mut [Vec<Duration>],
    size: Size,
    (rounds, frames): (usize, usize),
    pool_allocs: u64,
) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let pct = |t: &[Duration], p: usize| us(t[(t.len() - 1) * p / 100]);
    for t in times.iter_mut() {
        t.sort();
    }
    let median = |v: usize| pct(&times[v], 50);
    let (pool, once) = (median(0), median(VARIANTS.len() - 1));
    println!(
        "\n### One {size} u8 frame: upload, blur_h, blur_v, sobel_x, sobel_y, magnitude, \
         download, synchronize ({rounds} rounds x {frames} frames a variant, interleaved)\n"
    );
    println!(
        "Upload and download: for `gpu-pool own transfers`, gpu-pool's `upload_async` / \
         `download_async` between `HostMem` page-locked host frames and packed `GpuMat` device \
         frames allocated once; for every other variant, cuMemcpyHtoDAsync / cuMemcpyDtoHAsync \
         between page-locked host buffers (cuMemHostAlloc) and contiguous device frames allocated \
         once. Temporaries: 2 x u8 + 2 x i16, {size}, given back before the frame's synchronize.\n"
    );
    println!(
        "| variant | median / frame | p10 | p90 | vs `gpu-pool` | vs `allocated once` |\n\
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
