//! The pool against what users would pick instead, on a CUDA GPU, in one run:
//!
//! - A: take + release of one buffer at 1, 16 and 48 MiB: the stack pool, a caching-pool hit, and
//!   every driver allocator (plus the stream-ordered ones with a stream synchronize per iteration,
//!   where the release threshold shows).
//! - B: the seed's pipeline (4096x4096 BGR -> gray -> threshold) at 10 and 200 iterations, with its
//!   two temporaries from the pool, allocated once before the loop, or allocated per iteration by
//!   each competitor; every variant's output is checked against the CPU first.
//! - The pipeline kernels' achieved bandwidth against the device's.
//!
//! `cargo bench -p gpu-pool-benches --bench gpu` prints markdown tables of medians and ratios and writes SVG charts of A
//! and B to `target/criterion/charts/`. Without a CUDA device it says so and measures nothing.

mod chart;
mod driver;
#[path = "../../examples/support/kernels.rs"]
mod kernels;
#[path = "../support/run.rs"]
#[allow(dead_code, reason = "Criterion sets this bench's run length")]
mod run;
#[path = "../support/mod.rs"]
mod support;

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion};
use driver::{Competitor, Driver};
use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::interop::cudarc::driver::{CudaStream, result, sys};
use gpu_pool::prelude::*;
use gpu_pool::{
    alloc::CachingPool, compat::opencv::set_buffer_pool_config, config::Fallback, interop::Pitched,
    interop::PitchedMut,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const MIB: usize = 1 << 20;
const SIZES: [usize; 3] = [1, 16, 48];
const TAKE: &str = "A_take_release";
const TAKE_SYNC: &str = "A_take_release_sync_16MiB";
const PIPELINE: &str = "B_pipeline";
const ROWS: usize = 4096;
const COLS: usize = 4096;
const COMPETITORS: [Competitor; 5] = [
    Competitor::MemAlloc,
    Competitor::MemAllocPitch,
    Competitor::AsyncDefault,
    Competitor::AsyncRaised,
    Competitor::Cudarc,
];

fn main() -> Res<()> {
    let device = match Device::cuda(0) {
        Ok(device) => device,
        Err(e) => {
            println!("no CUDA device ({e}): the GPU benchmarks did not run");
            return Ok(());
        }
    };
    let ctx = device.cudarc().expect("a CUDA device").clone();
    ctx.bind_to_thread()?;
    println!(
        "device: {} ({}, driver {}), {:.0} GiB",
        device.id(),
        ctx.name()?,
        run::driver_version()?,
        ctx.total_mem()? as f64 / (1u64 << 30) as f64
    );
    let mut c = support::criterion();

    device.set_fallback(Fallback::Error); // the stack must serve every stack case
    set_buffer_pool_config(&device, 512 * MIB, 1)?;
    let stream = Stream::new(&device)?;
    let cs = stream.cudarc().expect("a CUDA stream").clone();
    let drv = Driver::new(cs.clone(), device.texture_alignment())?;
    let cached = Stream::with_allocator(&device, Arc::new(CachingPool::new(&device)))?;

    // A growable stack, mapped to the largest size once before it is measured.
    device.set_growable_stacks(true)?;
    let growing = Stream::new(&device)?;
    device.set_growable_stacks(false)?; // fixed stacks for what follows
    drop(BufferPool::new(&growing).get_buffer_1d::<u8>(SIZES[2] * MIB)?);
    take_release(&mut c, &stream, &growing, &cached, &drv)?;
    take_release_sync(&mut c, &stream, &drv)?;
    let kernels = kernels::Kernels::load(&device);
    pipeline(&mut c, &stream, &drv, &kernels)?;
    c.final_summary();

    print_take_table();
    support::print_table(
        "Take + release + cuStreamSynchronize, 16 MiB (the release threshold at work)",
        TAKE_SYNC,
        "stack_pool",
        &[
            "stack_pool",
            "cuMemAllocAsync_default",
            "cuMemAllocAsync_raised",
            "cudarc_alloc",
        ],
    );
    let b_ids = pipeline_ids();
    for iters in [10, 200] {
        let ids: Vec<&str> = b_ids
            .iter()
            .filter(|id| id.ends_with(&format!("/x{iters}")))
            .map(String::as_str)
            .collect();
        support::print_table(
            &format!("The seed's pipeline, {iters} iterations (4096x4096, two temporaries each)"),
            PIPELINE,
            &format!("allocated_once/x{iters}"),
            &ids,
        );
    }
    bandwidth(&stream, &kernels)?;
    charts(&b_ids)?;
    Ok(())
}

fn take_release(
    c: &mut Criterion,
    stream: &Stream,
    growing: &Stream,
    cached: &Stream,
    drv: &Driver,
) -> Res<()> {
    let pool = BufferPool::new(stream);
    let grow = BufferPool::new(growing);
    let cache = BufferPool::new(cached);
    let mut group = c.benchmark_group(TAKE);
    for mib in SIZES {
        let bytes = mib * MIB;
        group.bench_with_input(BenchmarkId::new("stack_pool", mib), &bytes, |b, &n| {
            b.iter(|| {
                drop(black_box(
                    pool.get_buffer_1d::<u8>(black_box(n)).expect("fits"),
                ))
            })
        });
        group.bench_with_input(BenchmarkId::new("growable_stack", mib), &bytes, |b, &n| {
            b.iter(|| {
                drop(black_box(
                    grow.get_buffer_1d::<u8>(black_box(n)).expect("mapped"),
                ))
            })
        });
        drop(cache.get_buffer_1d::<u8>(bytes)?); // the one miss
        group.bench_with_input(
            BenchmarkId::new("caching_pool_hit", mib),
            &bytes,
            |b, &n| {
                b.iter(|| {
                    drop(black_box(
                        cache.get_buffer_1d::<u8>(black_box(n)).expect("a hit"),
                    ))
                })
            },
        );
        for who in COMPETITORS {
            group.bench_with_input(BenchmarkId::new(who.id(), mib), &bytes, |b, &n| {
                b.iter(|| {
                    let block = drv.take(who, n / 4096, 4096).expect("device memory");
                    drv.release(who, black_box(block)).expect("frees");
                })
            });
        }
    }
    group.finish();
    Ok(())
}

fn take_release_sync(c: &mut Criterion, stream: &Stream, drv: &Driver) -> Res<()> {
    let pool = BufferPool::new(stream);
    let bytes = 16 * MIB;
    let mut group = c.benchmark_group(TAKE_SYNC);
    group.bench_function("stack_pool", |b| {
        b.iter(|| {
            drop(black_box(pool.get_buffer_1d::<u8>(bytes).expect("fits")));
            stream.synchronize().expect("syncs");
        })
    });
    for who in [
        Competitor::AsyncDefault,
        Competitor::AsyncRaised,
        Competitor::Cudarc,
    ] {
        group.bench_function(who.id(), |b| {
            b.iter(|| {
                let block = drv.take(who, bytes / 4096, 4096).expect("device memory");
                drv.release(who, black_box(block)).expect("frees");
                drv.stream.synchronize().expect("syncs");
            })
        });
    }
    group.finish();
    Ok(())
}

/// Where the pipeline's two temporaries come from.
#[derive(Clone, Copy)]
enum Temps {
    Pool,
    Once,
    PerIteration(Competitor),
}

impl Temps {
    fn id(self) -> &'static str {
        match self {
            Temps::Pool => "pool",
            Temps::Once => "allocated_once",
            Temps::PerIteration(Competitor::MemAllocPitch) => "cuMemAllocPitch_per_iter",
            Temps::PerIteration(Competitor::AsyncDefault) => "stream_ordered_per_iter",
            Temps::PerIteration(Competitor::Cudarc) => "cudarc_per_iter",
            Temps::PerIteration(other) => other.id(),
        }
    }
}

const VARIANTS: [Temps; 5] = [
    Temps::Once,
    Temps::Pool,
    Temps::PerIteration(Competitor::MemAllocPitch),
    Temps::PerIteration(Competitor::AsyncDefault),
    Temps::PerIteration(Competitor::Cudarc),
];

fn pipeline_ids() -> Vec<String> {
    [10, 200]
        .iter()
        .flat_map(|i| VARIANTS.iter().map(move |v| format!("{}/x{i}", v.id())))
        .collect()
}

/// The image and what every variant needs to run the loop.
struct Pipeline<'a> {
    stream: &'a Stream,
    drv: &'a Driver,
    k: &'a kernels::Kernels,
    src: GpuMat<'a, [u8; 3]>,
    once: (driver::Block, driver::Block),
}

impl Pipeline<'_> {
    fn launch(&self, gray: (u64, usize), binary: (u64, usize)) -> Res<()> {
        let cs: &Arc<CudaStream> = &self.drv.stream;
        // SAFETY: bgr_to_gray and threshold read and write ROWS x COLS pixels of pitched buffers
        // of that shape (the image, and two temporaries of at least ROWS rows of `pitch` bytes),
        // which stay allocated until the stream has run them.
        unsafe {
            let raw =
                |(ptr, step): (u64, usize)| PitchedMut::<u8>::from_raw_parts(ptr, step, ROWS, COLS);
            let mut gray = raw(gray);
            kernels::bgr_to_gray(self.k, cs, self.src.pitched(), gray.reborrow())?;
            kernels::threshold(self.k, cs, gray.as_const(), raw(binary), 128)?;
        }
        Ok(())
    }

    /// `iterations` of the loop, then a synchronize; `out` gets the last binary image.
    fn run(&self, temps: Temps, iterations: usize, mut out: Option<&mut [u8]>) -> Res<()> {
        let cs = &self.drv.stream;
        let pool = BufferPool::new(self.stream);
        for i in 0..iterations {
            let last = i + 1 == iterations;
            match temps {
                Temps::Pool => {
                    let gray = pool.get_buffer::<u8>(ROWS, COLS)?;
                    let binary = pool.get_buffer::<u8>(ROWS, COLS)?;
                    let b = (binary.device_ptr(), binary.step());
                    self.launch((gray.device_ptr(), gray.step()), b)?;
                    if let (true, Some(out)) = (last, out.as_deref_mut()) {
                        download(b, out)?;
                    }
                }
                Temps::Once => {
                    let (g, b) = (self.once.0.ptr_pitch(cs), self.once.1.ptr_pitch(cs));
                    self.launch(g, b)?;
                    if let (true, Some(out)) = (last, out.as_deref_mut()) {
                        download(b, out)?;
                    }
                }
                Temps::PerIteration(who) => {
                    let gray = self.drv.take(who, ROWS, COLS)?;
                    let binary = self.drv.take(who, ROWS, COLS)?;
                    let b = binary.ptr_pitch(cs);
                    self.launch(gray.ptr_pitch(cs), b)?;
                    if let (true, Some(out)) = (last, out.as_deref_mut()) {
                        download(b, out)?;
                    }
                    self.drv.release(who, binary)?;
                    self.drv.release(who, gray)?;
                }
            }
        }
        Ok(self.stream.synchronize()?)
    }
}

/// A pitched device image into a contiguous host one, row by row (only to check results).
fn download((ptr, pitch): (u64, usize), out: &mut [u8]) -> Res<()> {
    for (r, row) in out.chunks_mut(COLS).enumerate() {
        // SAFETY: row `r` of the source holds `pitch >= COLS` bytes; `row` holds COLS bytes.
        unsafe { result::memcpy_dtoh_sync(row, ptr + (r * pitch) as u64) }?;
    }
    Ok(())
}

fn pipeline(c: &mut Criterion, stream: &Stream, drv: &Driver, k: &kernels::Kernels) -> Res<()> {
    let image: Vec<[u8; 3]> = (0..ROWS * COLS)
        .map(|i| [(i % 251) as u8, (i / COLS % 241) as u8, (i * 7 % 239) as u8])
        .collect();
    let expected: Vec<u8> = image
        .iter()
        .map(|&px| kernels::threshold_of(kernels::gray_of(px), 128))
        .collect();
    let p = Pipeline {
        stream,
        drv,
        k,
        src: GpuMat::from_host(stream, ROWS, COLS, &image)?,
        once: (
            drv.take(Competitor::MemAllocPitch, ROWS, COLS)?,
            drv.take(Competitor::MemAllocPitch, ROWS, COLS)?,
        ),
    };
    let mut out = vec![0u8; ROWS * COLS];
    for temps in VARIANTS {
        out.fill(1);
        p.run(temps, 2, Some(&mut out))?;
        let wrong = out.iter().zip(&expected).filter(|(a, b)| a != b).count();
        println!(
            "pipeline {}: {wrong} pixels differ from the CPU reference",
            temps.id()
        );
        assert_eq!(wrong, 0, "{} computes the wrong image", temps.id());
    }
    let calls = stream.device().stats().driver_alloc_calls;
    p.run(Temps::Pool, 200, None)?;
    println!(
        "pipeline pool x200: {} driver allocation calls",
        stream.device().stats().driver_alloc_calls - calls
    );

    let mut group = c.benchmark_group(PIPELINE);
    group
        .sample_size(20)
        .sampling_mode(criterion::SamplingMode::Flat);
    for iterations in [10, 200] {
        for temps in VARIANTS {
            let id = BenchmarkId::new(temps.id(), format!("x{iterations}"));
            group.bench_function(id, |b| {
                b.iter(|| p.run(temps, iterations, None).expect("runs"))
            });
        }
    }
    group.finish();
    let Pipeline { once, .. } = p;
    drv.release(Competitor::MemAllocPitch, once.1)?;
    drv.release(Competitor::MemAllocPitch, once.0)?;
    Ok(())
}

/// Table A: one row per allocator, one column per size, each cell the median and its ratio to the
/// stack pool at that size.
fn print_take_table() {
    let cases: Vec<&str> = ["stack_pool", "growable_stack", "caching_pool_hit"]
        .into_iter()
        .chain(COMPETITORS.iter().map(|c| c.id()))
        .collect();
    println!("\n### Take + release of one buffer (ratio to the stack pool at the same size)\n");
    println!(
        "| allocator | {} |\n|---|{}",
        SIZES.map(|s| format!("{s} MiB")).join(" | "),
        "---:|".repeat(SIZES.len())
    );
    for case in &cases {
        let cells: Vec<String> = SIZES
            .iter()
            .map(|mib| {
                let get = |c: &str| {
                    support::medians(TAKE, &[&format!("{c}/{mib}")])
                        .first()
                        .map(|m| m.1)
                };
                match (get(case), get("stack_pool")) {
                    (Some(ns), Some(base)) => {
                        format!("{} ({:.0}x)", support::format_ns(ns), ns / base)
                    }
                    _ => "-".into(),
                }
            })
            .collect();
        println!("| `{case}` | {} |", cells.join(" | "));
    }
}

/// Achieved bandwidth of every example kernel and of a device-to-device copy, against the peak the
/// device reports (memory clock x bus width x 2). Launches rotate over `SETS` sets of buffers,
/// 320 MB in all, so the data comes from DRAM and not from the 50 MB L2 cache. "Bytes moved" counts
/// what a kernel must read and write once; re-reads of neighbours (the box filter's) are not
/// counted.
fn bandwidth(stream: &Stream, k: &kernels::Kernels) -> Res<()> {
    const SETS: usize = 4;
    const REPS: usize = 100;
    let ctx = stream.device().cudarc().expect("a CUDA device").clone();
    let cs = stream.cudarc().expect("a CUDA stream").clone();
    let pool = BufferPool::new(stream);
    let mut owners = Vec::new();
    let mut sets = Vec::new(); // (bgr, gray, binary) addresses
    for set in 0..SETS {
        let mut src = pool.get_buffer::<[u8; 3]>(ROWS, COLS)?;
        src.set_to([7, 100 + set as u8, 200])?;
        let mut gray = pool.get_buffer::<u8>(ROWS, COLS)?;
        gray.set_to(90)?;
        let binary = pool.get_buffer::<u8>(ROWS, COLS)?;
        sets.push((src.device_ptr(), gray.device_ptr(), binary.device_ptr()));
        owners.push((src, gray, binary));
    }
    let (ss, gs) = (owners[0].0.step(), owners[0].1.step());
    let px = (ROWS * COLS) as f64;
    // The box filter's f32 intermediate for half the image lives in the BGR buffer (48 MB).
    let tp = COLS * 4;
    let floats = (ROWS * COLS / 4) as i32; // a gray buffer as f32s
    let radius = 2;

    let time = |f: &mut dyn FnMut(usize) -> Res<()>| -> Res<f64> {
        f(0)?; // warm
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = cs.record_event(flags)?;
        for i in 1..=REPS {
            f(i % SETS)?;
        }
        let end = cs.record_event(flags)?;
        Ok(f64::from(start.elapsed_ms(&end)?) / 1e3 / REPS as f64)
    };
    // Every launch below: the kernels' parameters are as in `kernels::SOURCE`; each
    // stays inside the ROWS x COLS (or ROWS/2 x COLS) pitched buffers of its set, which `owners`
    // keeps alive, and the f32 views of gray and BGR buffers fit in their bytes.
    let mut rows: Vec<(&str, f64, f64)> = Vec::new();
    rows.push((
        "bgr_to_gray: 3 B in, 1 B out a pixel",
        4.0 * px,
        time(&mut |i| {
            let (src, gray, _) = sets[i];
            // SAFETY: as the note above `rows` says.
            unsafe { kernels::bgr_to_gray(k, &cs, ro(src, ss, ROWS), rw(gray, gs, ROWS))? };
            Ok(())
        })?,
    ));
    rows.push((
        "threshold: 1 B in, 1 B out",
        2.0 * px,
        time(&mut |i| {
            let (_, gray, bin) = sets[i];
            // SAFETY: as the note above `rows` says.
            unsafe { kernels::threshold(k, &cs, ro(gray, gs, ROWS), rw(bin, gs, ROWS), 128)? };
            Ok(())
        })?,
    ));
    rows.push((
        "invert: 1 B in, 1 B out",
        2.0 * px,
        time(&mut |i| {
            let (_, gray, bin) = sets[i];
            // SAFETY: as the note above `rows` says.
            unsafe { kernels::invert(k, &cs, ro(gray, gs, ROWS), rw(bin, gs, ROWS))? };
            Ok(())
        })?,
    ));
    rows.push((
        "fill_pattern: 1 B out",
        px,
        time(&mut |i| {
            let bin = sets[i].2;
            // SAFETY: as the note above `rows` says.
            unsafe { kernels::fill_pattern(k, &cs, rw(bin, gs, ROWS), 0)? };
            Ok(())
        })?,
    ));
    rows.push((
        "affine_relu: 4 B in, 4 B out a float",
        8.0 * f64::from(floats),
        time(&mut |i| {
            let (_, gray, bin) = sets[i];
            // SAFETY: as the note above `rows` says.
            unsafe { kernels::affine_relu(k, &cs, (gray, bin), floats as usize, (1.5, -0.25))? };
            Ok(())
        })?,
    ));
    rows.push((
        "box_rows (r = 2): 1 B in, 4 B out",
        5.0 * px / 2.0,
        time(&mut |i| {
            let (tmp, gray, _) = sets[i];
            // SAFETY: as the note above `rows` says.
            unsafe {
                kernels::box_rows(
                    k,
                    &cs,
                    ro(gray, gs, ROWS / 2),
                    rw(tmp, tp, ROWS / 2),
                    radius,
                )?
            };
            Ok(())
        })?,
    ));
    rows.push((
        "box_cols (r = 2): 4 B in, 1 B out",
        5.0 * px / 2.0,
        time(&mut |i| {
            let (tmp, gray, bin) = sets[i];
            // SAFETY: as the note above `rows` says.
            unsafe {
                let half = ROWS / 2;
                let inputs = (ro(tmp, tp, half), ro(gray, gs, half));
                kernels::box_cols(k, &cs, inputs, rw(bin, gs, half), radius, (0, 0))?
            };
            Ok(())
        })?,
    ));
    let copy_bytes = ss * ROWS;
    rows.push((
        "cuMemcpyDtoDAsync of a BGR image",
        2.0 * copy_bytes as f64,
        time(&mut |i| {
            let (from, to) = (sets[i].0, sets[(i + 1) % SETS].0);
            // SAFETY: both buffers hold `copy_bytes` bytes and are distinct; the copy is ordered
            // on their stream.
            unsafe { result::memcpy_dtod_async(to, from, copy_bytes, cs.cu_stream()) }?;
            Ok(())
        })?,
    ));
    drop(owners);

    let clock_khz = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE);
    let bus_bits =
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
    let peak = match (clock_khz, bus_bits) {
        (Ok(k), Ok(b)) if k > 0 && b > 0 => Some(2.0 * f64::from(k) * 1e3 * f64::from(b) / 8.0),
        _ => None,
    };
    println!(
        "\n### Kernel bandwidth (4096x4096 images, {REPS} launches each over {SETS} buffer sets, CUDA events)\n"
    );
    match peak {
        Some(p) => println!(
            "Device peak (2 x memory clock x bus width): {:.0} GB/s\n",
            p / 1e9
        ),
        None => println!("The device does not report its memory clock; no peak to compare with.\n"),
    }
    println!("| kernel | bytes moved | time | achieved | of peak |\n|---|---:|---:|---:|---:|");
    for (name, bytes, secs) in rows {
        let achieved = bytes / secs;
        println!(
            "| {name} | {:.1} MB | {:.1} µs | {:.0} GB/s | {} |",
            bytes / 1e6,
            secs * 1e6,
            achieved / 1e9,
            peak.map_or("-".into(), |p| format!("{:.0}%", 100.0 * achieved / p))
        );
    }
    Ok(())
}

fn charts(b_ids: &[String]) -> Res<()> {
    let dir = support::output_dir().join("charts");
    std::fs::create_dir_all(&dir)?;
    let mut a = Vec::new();
    for mib in SIZES {
        let ids: Vec<String> = ["stack_pool", "caching_pool_hit"]
            .into_iter()
            .chain(COMPETITORS.iter().map(|c| c.id()))
            .map(|c| format!("{c}/{mib}"))
            .collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        a.extend(support::medians(TAKE, &refs).into_iter().map(|(id, ns)| {
            (
                format!("{} MiB  {}", mib, id.split('/').next().unwrap_or("")),
                ns,
            )
        }));
    }
    chart::log_bars(
        &dir.join("A_take_release.svg"),
        "A: take + release of one buffer (median, log scale)",
        "nanoseconds",
        &a,
    )?;
    let refs: Vec<&str> = b_ids.iter().map(String::as_str).collect();
    let b: Vec<(String, f64)> = support::medians(PIPELINE, &refs)
        .into_iter()
        .map(|(id, ns)| (id.replace('/', "  "), ns / 1e6))
        .collect();
    chart::log_bars(
        &dir.join("B_pipeline.svg"),
        "B: the seed's pipeline, whole loop (median, log scale)",
        "milliseconds",
        &b,
    )?;
    println!("\ncharts: {}", dir.display());
    Ok(())
}

/// `rows x COLS` elements of `T` at `step` bytes from `ptr`, read by a kernel.
///
/// # Safety
/// As `Pitched::from_raw_parts`.
unsafe fn ro<T>(ptr: u64, step: usize, rows: usize) -> Pitched<'static, T> {
    // SAFETY: the caller's contract.
    unsafe { Pitched::from_raw_parts(ptr, step, rows, COLS) }
}

/// `rows x COLS` elements of `T` at `step` bytes from `ptr`, written by a kernel.
///
/// # Safety
/// As `PitchedMut::from_raw_parts`.
unsafe fn rw<T>(ptr: u64, step: usize, rows: usize) -> PitchedMut<'static, T> {
    // SAFETY: the caller's contract.
    unsafe { PitchedMut::from_raw_parts(ptr, step, rows, COLS) }
}
