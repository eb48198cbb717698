//! CUDA graph replay of pooled code against running it eagerly, on a launch-bound pipeline: six
//! kernels over three temporaries on a 512x512 image (`kernels::six_kernels`), in one run:
//!
//! - `eager_stack`: the `#[pooled]` function called each time, temporaries from the stack;
//! - `graph_replay`: the same function captured once with `Stream::capture`, then replayed;
//! - `graphed`: the same function as a graphed function (`#[pooled(stream, graph)]`), called
//!   each time: it captures itself on the first call and replays after (the key lookup, the
//!   output check and the launch);
//! - `cudarc_eager`: the six kernels on plain cudarc, its temporaries from `CudaStream::alloc`
//!   (cuMemAllocAsync / cuMemFreeAsync) each run;
//! - `cudarc_graph`: that function captured by hand with cudarc's `begin_capture` /
//!   `end_capture` and replayed with `CudaGraph::launch`;
//! - `eager_stream_ordered`: called each time on a stream whose temporaries come from
//!   `cuMemAllocFromPoolAsync` / `cuMemFreeAsync` (`StreamOrderedAllocator`: the backend's own
//!   memory pool, release threshold raised).
//!
//! Each sample queues `RUNS` pipelines and waits for the stream; the median per pipeline is
//! reported with its ratio to graph replay, and drawn to `target/criterion/charts/E_graph.svg`.
//! A second group times the host alone: queuing `RUNS` pipelines, with the wait left out of the
//! timing (the CPU time a launch-bound program spends per pipeline).
//! Every variant's output is checked against the eager one first. Without a CUDA device it says so
//! and measures nothing.

#[path = "../gpu/chart.rs"]
mod chart;
#[path = "../../examples/support/kernels.rs"]
mod kernels;
#[path = "../support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::interop::cudarc::driver::{CudaStream, DevicePtr, sys};
use gpu_pool::interop::{Pitched, PitchedMut};
use gpu_pool::prelude::*;
use gpu_pool::{
    alloc::StreamOrderedAllocator, compat::opencv::set_buffer_pool_config, config::Fallback,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const GROUP: &str = "E_graph";
const HOST: &str = "E_graph_host";
const SIDE: usize = 512;
const RUNS: u32 = 100;
const IDS: [&str; 6] = [
    "graph_replay",
    "graphed",
    "cudarc_graph",
    "eager_stack",
    "cudarc_eager",
    "eager_stream_ordered",
];

/// The pipeline as a graphed function: captured on its first call, replayed after.
#[pooled(stream, graph)]
fn six_graphed(
    stream: &Stream,
    k: &kernels::Kernels,
    src: &GpuMat<'_, [u8; 3]>,
    out: &GpuMat<'_, u8>,
) -> Result<(), PoolError> {
    kernels::six_kernels(stream, k, src, out)
}

/// The pipeline on plain cudarc: three temporaries allocated on `s` each run, the same kernels.
fn cudarc_six(
    k: &kernels::Kernels,
    s: &Arc<CudaStream>,
    src: &GpuMat<'_, [u8; 3]>,
    out: &GpuMat<'_, u8>,
) -> Res<()> {
    let n = SIDE * SIDE;
    // SAFETY: every element is written by a kernel before it is read.
    let (gray, inv, sums) = unsafe { (s.alloc::<u8>(n)?, s.alloc::<u8>(n)?, s.alloc::<f32>(n)?) };
    let (g, _g) = gray.device_ptr(s);
    let (i, _i) = inv.device_ptr(s);
    let (m, _m) = sums.device_ptr(s);
    // SAFETY: the slices are `n` elements, packed `SIDE x SIDE`, alive until the kernels queued
    // on `s` ran (their frees are queued after them); `src` and `out` are `SIDE x SIDE` pool
    // buffers nothing else uses meanwhile.
    unsafe {
        let px = |p| Pitched::<u8>::from_raw_parts(p, SIDE, SIDE, SIDE);
        let px_mut = |p| PitchedMut::<u8>::from_raw_parts(p, SIDE, SIDE, SIDE);
        let sums = PitchedMut::<f32>::from_raw_parts(m, SIDE * 4, SIDE, SIDE);
        let out = PitchedMut::<u8>::from_raw_parts(out.device_ptr(), out.step(), SIDE, SIDE);
        kernels::bgr_to_gray(k, s, src.pitched(), px_mut(g))?;
        kernels::invert(k, s, px(g), px_mut(i))?;
        kernels::box_passes(k, s, (px(i), sums), px_mut(g), 2, (0, 0))?;
        kernels::threshold(k, s, px(g), px_mut(i), 100)?;
        kernels::invert(k, s, px(i), out)?;
    }
    Ok(())
}

fn main() -> Res<()> {
    let device = match Device::cuda(0) {
        Ok(device) => device,
        Err(e) => {
            println!("no CUDA device ({e}): the graph benchmark did not run");
            return Ok(());
        }
    };
    device.set_fallback(Fallback::Error); // the stack must serve the captured temporaries
    set_buffer_pool_config(&device, 64 << 20, 2)?;
    let ctx = device.cudarc()?.clone();
    // SAFETY: before any cudarc slice exists; the cudarc twin's slices are made, used (also by its
    // graph) and freed on its one stream. The pool's memory does not use cudarc's events.
    unsafe { ctx.disable_event_tracking() };
    let plain = ctx.new_stream()?;
    let stream = Stream::new(&device)?;
    let ordered = Stream::with_allocator(&device, Arc::new(StreamOrderedAllocator))?;
    let k = kernels::Kernels::load(&device);
    let image: Vec<[u8; 3]> = (0..SIDE * SIDE)
        .map(|i| [(i % 251) as u8, (i / SIDE % 241) as u8, (i * 7 % 239) as u8])
        .collect();
    let src = GpuMat::from_host(&stream, SIDE, SIDE, &image)?;
    let out = GpuMat::<u8>::new(&stream, SIDE, SIDE)?;
    let reference = GpuMat::<u8>::new(&stream, SIDE, SIDE)?;
    kernels::six_kernels(&stream, &k, &src, &reference)?;
    let expected = reference.to_vec()?;

    let graph = stream.capture(|s| kernels::six_kernels(s, &k, &src, &out))?;
    stream.synchronize()?;
    plain.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let worked = cudarc_six(&k, &plain, &src, &out);
    let ended = plain.end_capture(sys::CUgraphInstantiate_flags(0));
    worked?;
    let plain_graph = ended?.ok_or("cudarc's capture made no graph")?;
    let allocs = device.stats().driver_alloc_calls;
    let run = |id: &str| -> Res<()> {
        match id {
            "graph_replay" => graph.launch()?,
            "graphed" => six_graphed(&stream, &k, &src, &out)?,
            "eager_stack" => kernels::six_kernels(&stream, &k, &src, &out)?,
            "cudarc_eager" => cudarc_six(&k, &plain, &src, &out)?,
            "cudarc_graph" => plain_graph.launch()?,
            _ => kernels::six_kernels(&ordered, &k, &src, &out)?,
        }
        Ok(())
    };
    for id in IDS {
        run(id)?;
        stream.synchronize()?;
        ordered.synchronize()?;
        plain.synchronize()?;
        let wrong = out
            .to_vec()?
            .iter()
            .zip(&expected)
            .filter(|(a, b)| a != b)
            .count();
        println!("{id}: {wrong} pixels differ from the eager run");
        assert_eq!(wrong, 0, "{id} computes another image");
    }
    let graph_allocs = device.stats().driver_alloc_calls;
    for _ in 0..1000 {
        graph.launch()?;
    }
    stream.synchronize()?;
    println!(
        "1000 replays: {} driver allocation calls",
        device.stats().driver_alloc_calls - graph_allocs
    );
    println!(
        "stream-ordered eager run: {} driver allocation calls (3 per run)",
        graph_allocs - allocs
    );
    let before = device.stats().driver_alloc_calls;
    for _ in 0..1000 {
        six_graphed(&stream, &k, &src, &out)?;
    }
    stream.synchronize()?;
    println!(
        "1000 graphed calls: {} driver allocation calls; {}",
        device.stats().driver_alloc_calls - before,
        gpu_pool::graph::shape_stats(&stream)
    );

    // Another output each call, among more than the function keeps: captured while it has
    // room, then run eagerly (capturing each would evict a graph in use, for a call that costs
    // more captured than run).
    let outs = (0..32)
        .map(|_| GpuMat::<u8>::new(&stream, SIDE, SIDE))
        .collect::<Result<Vec<_>, _>>()?;
    let (before, start) = (gpu_pool::graph::shape_stats(&stream), Instant::now());
    for out in outs.iter().cycle().take(64) {
        six_graphed(&stream, &k, &src, out)?;
    }
    stream.synchronize()?;
    let per_call = start.elapsed() / 64;
    let after = gpu_pool::graph::shape_stats(&stream);
    println!(
        "a new output every call (32 outputs cycled, 16 graphs kept): {per_call:?} a call; \
         {} captures, {} replays, {} eager, {} evictions",
        after.captures - before.captures,
        after.replays - before.replays,
        after.eager_calls - before.eager_calls,
        after.evictions - before.evictions
    );
    drop(outs);

    let mut c = support::criterion();
    // One sample: `RUNS` pipelines queued, then the wait; the wait is timed in `GROUP` (the whole
    // pipeline) and left out in `HOST` (the host's part alone).
    let sample = |id: &str, wait_timed: bool| -> Duration {
        let start = Instant::now();
        for _ in 0..RUNS {
            run(id).expect("runs");
        }
        let queued = start.elapsed();
        stream.synchronize().expect("synchronizes");
        ordered.synchronize().expect("synchronizes");
        plain.synchronize().expect("synchronizes");
        let timed = if wait_timed { start.elapsed() } else { queued };
        timed / RUNS
    };
    for (group_name, wait_timed) in [(GROUP, true), (HOST, false)] {
        let mut group = c.benchmark_group(group_name);
        for id in IDS {
            group.bench_function(id, |b| {
                b.iter_custom(|iters| (0..iters).map(|_| sample(id, wait_timed)).sum())
            });
        }
        group.finish();
    }
    c.final_summary();
    support::print_table(
        &format!(
            "A launch-bound pooled pipeline: six kernels, three temporaries, {SIDE}x{SIDE} \
             (time per pipeline; ratio to graph replay)"
        ),
        GROUP,
        "graph_replay",
        &IDS,
    );
    support::print_table(
        "The same, host time to queue one pipeline (ratio to graph replay)",
        HOST,
        "graph_replay",
        &IDS,
    );
    let dir = support::output_dir().join("charts");
    std::fs::create_dir_all(&dir)?;
    let bars: Vec<(String, f64)> = support::medians(GROUP, &IDS)
        .into_iter()
        .map(|(id, ns)| (id, ns / 1e3))
        .collect();
    chart::linear_bars(
        &dir.join("E_graph.svg"),
        "E: six kernels on 512x512, per pipeline (median)",
        "microseconds",
        &bars,
    )?;
    println!("\nchart: {}", dir.join("E_graph.svg").display());
    drop(graph);
    drop(plain_graph);
    Ok(())
}
