//! `mlp_graph`: the MLP of [`mlp_eager`] at batch 32, its forward pass captured
//! once into a CUDA graph and replayed. Per step: a new input is uploaded from a pageable `Vec`,
//! the graph is launched, and the probabilities are downloaded into a pageable `Vec`. A second
//! measure is the replays alone: `REPLAYS` launches, then one synchronize, no copies.
//!
//! The forward pass, its kernels, the reference and the check are `mlp_eager`'s; `pooled.rs` and
//! `plain.rs` here hold what the graph adds. The line counts reported are of both files of each
//! twin (`mlp_eager`'s and this app's), so they count the whole program, with `mlp_eager`'s
//! eager step loop counted on both sides.

mod plain;
pub mod pooled;

use std::cell::RefCell;
use std::error::Error;
use std::time::Instant;

use gpu_pool::prelude::*;

use crate::harness;
use crate::mlp_eager::{self, CLASSES, IN, Kernels, Weights, Work};

/// Steps timed part by part.
const PHASE_STEPS: usize = 2000;

/// The batch every step has.
pub const BATCH: usize = 32;
/// Steps a round on a GPU.
pub const STEPS: usize = 500;
/// Steps on the host backend (CI, debug builds).
pub const HOST_STEPS: usize = 3;
/// Replays a round of the replay-only measure.
pub const REPLAYS: usize = 1000;

/// The workload: `steps` steps of batch [`BATCH`], each with its own input.
pub fn work(steps: usize) -> Work {
    let inputs: Vec<f32> = (0..(steps + 1) * BATCH * IN / 2)
        .map(|i| mlp_eager::noise(9, i as u64))
        .collect();
    Work {
        weights: Weights::new(),
        batches: vec![BATCH; steps],
        // Windows half a batch apart: every step's input differs from the last one's.
        offsets: (0..steps).map(|i| i * BATCH * IN / 2).collect(),
        inputs,
    }
}

/// Runs every step of `work` with the gpu-pool twin's step loop on `device` where no graph can be
/// captured (the host backend): each step calls the forward pass the graph would replay, with the
/// CPU twins of the kernels and GEMMs. Checks the outputs and returns the largest difference.
pub fn run_on_host(device: &Device, work: &Work) -> Result<f64, Box<dyn Error>> {
    let stream = Stream::new(device)?;
    let model = mlp_eager::pooled::Model::load(&stream, &work.weights)?;
    let x = RefCell::new(DeviceMat::<f32>::new_packed(&stream, BATCH, IN)?);
    let probs = RefCell::new(DeviceMat::<f32>::new_packed(&stream, BATCH, CLASSES)?);
    let forward = || {
        let (x, mut probs) = (x.borrow(), probs.borrow_mut());
        mlp_eager::pooled::forward(&stream, None, &model, &*x, &mut *probs)
    };
    let mut outputs = Vec::new();
    pooled::run(forward, &x, &probs, work, |_, p| outputs.push(p.to_vec()))?;
    Ok(mlp_eager::check(
        "gpu-pool",
        &mlp_eager::expected(work),
        &outputs,
    )?)
}

/// The app: on CUDA, checks both twins' graphs, then times steps and replays interleaved and
/// prints two table rows; on the host backend, checks the gpu-pool twin's step loop eagerly.
pub fn main() -> Result<(), Box<dyn Error>> {
    let device = Device::cuda_or_host();
    let Ok(ctx) = device.cudarc().cloned() else {
        run_on_host(&device, &work(HOST_STEPS))?;
        println!(
            "host backend: gpu-pool twin checked (its forward pass eagerly: no graph capture without CUDA), no cudarc twin (needs CUDA)"
        );
        return Ok(());
    };
    // SAFETY: before any cudarc slice exists. Every cudarc slice of the cudarc twin is made, used
    // (by its kernels, copies and graph) and freed on its one stream; a capture may not wait on
    // events recorded outside it. gpu-pool's memory does not use cudarc's events.
    unsafe { ctx.disable_event_tracking() };
    ctx.bind_to_thread()?; // cuBLAS launches in the thread's current context
    let kernels = Kernels::load(&ctx)?;
    let work = work(STEPS);

    let stream = Stream::new(&device)?;
    let blas = stream.cublas()?;
    let model = mlp_eager::pooled::Model::load(&stream, &work.weights)?;
    let x = RefCell::new(DeviceMat::<f32>::new_packed(&stream, BATCH, IN)?);
    let probs = RefCell::new(DeviceMat::<f32>::new_packed(&stream, BATCH, CLASSES)?);
    let twin = mlp_eager::plain::Twin::new(&ctx, &work.weights)?;
    // One eager pass each first: cuBLAS and the module load what they load lazily.
    {
        let (x, mut probs) = (x.borrow(), probs.borrow_mut());
        mlp_eager::pooled::forward(&stream, Some((&blas, &kernels)), &model, &*x, &mut *probs)?;
    }
    stream.synchronize()?;
    let graph = pooled::capture(&stream, (&blas, &kernels), &model, &x, &probs)?;
    println!(
        "gpu-pool graph: {:?}; {} stack bytes held",
        graph.nodes()?,
        graph.stack_bytes()
    );
    let mut captured = plain::Captured::new(&twin, &kernels)?;

    // The check pass, which is also the warm-up.
    let want = mlp_eager::expected(&work);
    let mut got = Vec::new();
    pooled::run(
        || graph.launch(),
        &x,
        &probs,
        &work,
        |_, p| got.push(p.to_vec()),
    )?;
    mlp_eager::check("gpu-pool", &want, &got)?;
    let mut got = Vec::new();
    captured.run(&twin, &work, |_, p| got.push(p.to_vec()))?;
    mlp_eager::check("cudarc", &want, &got)?;
    pooled::replay(&stream, &graph, REPLAYS)?;
    captured.replay(&twin, REPLAYS)?;

    let before = device.stats().driver_alloc_calls;
    let rounds = harness::rounds_arg(9);
    let n = work.steps();
    let calls_0 = std::cell::Cell::new(gpu_pool::observe::DriverCalls::default());
    let (pooled_steps, plain_steps) = harness::interleave(
        rounds,
        || -> Result<_, Box<dyn Error>> {
            let start = Instant::now();
            let counted = gpu_pool::observe::DriverCalls::on_this_thread();
            pooled::run(|| graph.launch(), &x, &probs, &work, |_, _| {})?;
            calls_0.set(
                calls_0.get() + gpu_pool::observe::DriverCalls::on_this_thread().since(counted),
            );
            Ok((start.elapsed(), n))
        },
        || {
            let start = Instant::now();
            captured.run(&twin, &work, |_, _| {})?;
            Ok((start.elapsed(), n))
        },
    )?;
    harness::print_calls_per_unit(calls_0.get(), n * rounds, "step");
    let calls_1 = std::cell::Cell::new(gpu_pool::observe::DriverCalls::default());
    let (pooled_replays, plain_replays) = harness::interleave(
        rounds,
        || -> Result<_, Box<dyn Error>> {
            let start = Instant::now();
            let counted = gpu_pool::observe::DriverCalls::on_this_thread();
            pooled::replay(&stream, &graph, REPLAYS)?;
            calls_1.set(
                calls_1.get() + gpu_pool::observe::DriverCalls::on_this_thread().since(counted),
            );
            Ok((start.elapsed(), REPLAYS))
        },
        || {
            let start = Instant::now();
            captured.replay(&twin, REPLAYS)?;
            Ok((start.elapsed(), REPLAYS))
        },
    )?;
    harness::print_calls_per_unit(calls_1.get(), REPLAYS * rounds, "replay");
    // Where a step's host time goes, each twin in turn, three times.
    for _ in 0..3 {
        let p = pooled::phases(&graph, &x, &probs, &work, PHASE_STEPS)?;
        let c = captured.phases(&twin, &work, PHASE_STEPS)?;
        println!(
            "a step's parts (host µs: upload / launch / download and wait): gpu-pool {:.2} / \
             {:.2} / {:.2}, cudarc {:.2} / {:.2} / {:.2}",
            p[0], p[1], p[2], c[0], c[1], c[2]
        );
    }
    let alloc_calls = device.stats().driver_alloc_calls - before;
    println!(
        "gpu-pool driver allocation calls during the timed rounds: {alloc_calls}{}",
        if alloc_calls == 0 {
            ""
        } else {
            " (expected 0 after warm-up)"
        }
    );
    println!(
        "driver asks per step or replay: gpu-pool {:.2} allocation calls; cudarc 0 (its \
         temporaries are the graph's allocation nodes); a step of either twin: one upload, one \
         graph launch, one download",
        alloc_calls as f64 / ((n + REPLAYS) * rounds).max(1) as f64,
    );
    let sources = (
        concat!(
            include_str!("../mlp_eager/pooled.rs"),
            include_str!("pooled.rs")
        ),
        concat!(
            include_str!("../mlp_eager/plain.rs"),
            include_str!("plain.rs")
        ),
    );
    harness::report("mlp_graph", "step", (&pooled_steps, &plain_steps), sources);
    harness::report(
        "mlp_graph replay",
        "replay",
        (&pooled_replays, &plain_replays),
        sources,
    );
    drop(graph);
    Ok(())
}
