//! `mlp_shapes`: `mlp_eager`'s MLP (784-256-10, batch 1 to 64 a step, 500 steps) with its forward
//! pass a graphed pooled function (`#[pooled(stream, graph)]`): captured the first time a batch
//! is seen, replayed after. Four twins in one run, each on the same steps:
//!
//! - `graphed`: gpu-pool, the graphed forward pass (`pooled.rs`);
//! - `pooled_eager`: gpu-pool, `mlp_eager`'s eager step;
//! - `pooled_graphs`: gpu-pool, one graph per batch captured by hand with `Stream::capture` (its
//!   input and output `DeviceMat`s per batch, made first): what the key lookup adds to a launch;
//! - `cudarc_graphs`: plain cudarc, one graph per batch captured by hand (`plain.rs`);
//! - `cudarc_eager`: plain cudarc, `mlp_eager`'s cudarc twin.
//!
//! Two measures: a whole step (upload from a pageable `Vec`, forward, download, wait), and the
//! forward pass alone (500 passes queued, then one wait: the host's time to queue one, and the
//! time per pass with the wait, which is the GPU's where the host keeps ahead).

mod plain;
pub mod pooled;

use std::cell::RefCell;
use std::error::Error;
use std::time::{Duration, Instant};

use gpu_pool::prelude::*;

use crate::harness::{Samples, rounds_arg};
use crate::mlp_eager::{self, CLASSES, Config, IN, Work};
use crate::mlp_graph;

const IDS: [&str; 5] = [
    "graphed",
    "pooled_graphs",
    "cudarc_graphs",
    "pooled_eager",
    "cudarc_eager",
];
/// Where `cudarc_graphs` is in `IDS`: the base of the ratios.
const BASE: usize = 2;

/// Runs the four twins (or, without CUDA, checks the graphed one eagerly).
pub fn main() -> Result<(), Box<dyn Error>> {
    let device = Device::cuda_or_host();
    let Ok(ctx) = device.cudarc().cloned() else {
        // The graphed forward needs cuBLAS: its eager twin's forward is what the host checks.
        mlp_eager::run_on_host(&device, &Work::new(&Config::HOST))?;
        println!("host backend: checked eagerly, no graphs and no cudarc twin (need CUDA)");
        return Ok(());
    };
    let kernels = mlp_eager::prepare(&ctx)?;
    let work = Work::new(&Config::FULL);
    let n = work.steps();

    let stream = Stream::new(&device)?;
    let blas = stream.cublas()?;
    let model = mlp_eager::pooled::Model::load(&stream, &work.weights)?;
    let twin = mlp_eager::plain::Twin::new(&ctx, &work.weights)?;
    let mut by_hand = plain::ByBatch::default();
    let per_batch = |cols| -> Result<Vec<_>, PoolError> {
        (1..=work.max_batch())
            .map(|b| {
                Ok(RefCell::new(DeviceMat::<f32>::new_packed(
                    &stream, b, cols,
                )?))
            })
            .collect()
    };
    let (xs, ps) = (per_batch(IN)?, per_batch(CLASSES)?);
    let graphs = (0..work.max_batch())
        .map(|b| mlp_graph::pooled::capture(&stream, (&blas, &kernels), &model, &xs[b], &ps[b]))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = vec![0.0; work.max_batch() * CLASSES];

    // One step of twin `id`.
    let mut step = |id: &str, i: usize, out: &mut [f32]| -> Result<(), Box<dyn Error>> {
        let input = work.input(i);
        match id {
            "graphed" => pooled::step(&stream, (&blas, &kernels), &model, input, out)?,
            "pooled_eager" => {
                mlp_eager::pooled::step(&stream, Some((&blas, &kernels)), &model, input, out)?;
            }
            "pooled_graphs" => {
                let b = input.len() / IN - 1;
                xs[b].borrow_mut().upload(input)?;
                graphs[b].launch()?;
                ps[b].borrow().download(out)?;
            }
            "cudarc_graphs" => by_hand.step(&twin, &kernels, input, out)?,
            _ => twin.step(&kernels, input, out)?,
        }
        Ok(())
    };

    // The check pass, which is also the warm-up (every batch captured once).
    let want = mlp_eager::expected(&work);
    for id in IDS {
        let mut got = Vec::new();
        for i in 0..n {
            let o = &mut out[..work.batches[i] * CLASSES];
            step(id, i, o)?;
            got.push(o.to_vec());
        }
        mlp_eager::check(id, &want, &got)?;
    }
    let shapes = gpu_pool::graph::shape_stats(&stream);
    println!(
        "graphed: {} graphs; scratch of the largest {} KiB, the sum over all \
         {} KiB ({:.1}x); stack high water {} KiB",
        shapes.graphs,
        shapes.scratch_largest / 1024,
        shapes.scratch_sum / 1024,
        shapes.scratch_sum as f64 / shapes.scratch_largest.max(1) as f64,
        stream.stats().stack_high_water / 1024
    );

    let rounds = rounds_arg(9);
    let allocs = device.stats().driver_alloc_calls;
    let mut steps = [(); IDS.len()].map(|()| Samples::default());
    for round in 0..rounds {
        for j in 0..IDS.len() {
            let which = (j + round) % IDS.len();
            let start = Instant::now();
            for i in 0..n {
                step(IDS[which], i, &mut out[..work.batches[i] * CLASSES])?;
            }
            steps[which].us.push(per(start.elapsed(), n));
        }
    }
    println!(
        "gpu-pool driver allocation calls during the timed steps: {}; {}; cudarc graphs by hand: {}",
        device.stats().driver_alloc_calls - allocs,
        gpu_pool::graph::shape_stats(&stream),
        by_hand.len()
    );

    // The forward pass alone: queued for every step's batch, then one wait.
    let xmax = twin.stream.alloc_zeros::<f32>(work.max_batch() * IN)?;
    let mut pmax = twin.stream.alloc_zeros::<f32>(work.max_batch() * CLASSES)?;
    let mut forward = |id: &str, batch: usize| -> Result<(), Box<dyn Error>> {
        match id {
            "graphed" => gpu_scope!(stream, {
                let x = buffer!(batch, IN; f32, packed)?;
                drop(pooled::forward(&stream, &blas, &kernels, &model, &x)?);
            }),
            "pooled_eager" => gpu_scope!(stream, {
                let x = buffer!(batch, IN; f32, packed)?;
                let mut p = buffer!(batch, CLASSES; f32, packed)?;
                mlp_eager::pooled::forward(&stream, Some((&blas, &kernels)), &model, &x, &mut p)?;
            }),
            "pooled_graphs" => graphs[batch - 1].launch()?,
            "cudarc_graphs" => by_hand.forward(&twin, &kernels, batch)?,
            _ => twin.forward(&kernels, &xmax, &mut pmax, batch)?,
        }
        Ok(())
    };
    let counted = gpu_pool::observe::DriverCalls::on_this_thread();
    for &batch in &work.batches {
        forward("graphed", batch)?;
    }
    stream.synchronize()?;
    let calls = gpu_pool::observe::DriverCalls::on_this_thread().since(counted);
    println!("driver calls of {n} graphed forward passes (besides the launches): {calls:?}");
    let mut queue = [(); IDS.len()].map(|()| Samples::default());
    let mut whole = [(); IDS.len()].map(|()| Samples::default());
    for round in 0..=rounds {
        for j in 0..IDS.len() {
            let which = (j + round) % IDS.len();
            let start = Instant::now();
            for &batch in &work.batches {
                forward(IDS[which], batch)?;
            }
            let queued = start.elapsed();
            stream.synchronize()?;
            twin.stream.synchronize()?;
            if round > 0 {
                queue[which].us.push(per(queued, n));
                whole[which].us.push(per(start.elapsed(), n));
            }
        }
    }

    println!(
        "\nmlp_shapes on {} ({rounds} rounds, medians, ratio to cudarc_graphs):",
        device.id()
    );
    println!(
        "| twin | step µs | ratio | forward: host µs to queue | ratio | forward µs with the wait | ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    let base = |s: &[Samples; IDS.len()]| s[BASE].quantile(0.5);
    for (i, id) in IDS.iter().enumerate() {
        let cells =
            [&steps, &queue, &whole].map(|s| (s[i].quantile(0.5), s[i].quantile(0.5) / base(s)));
        println!(
            "| {id} | {:.2} | {:.3}x | {:.2} | {:.3}x | {:.2} | {:.3}x |",
            cells[0].0, cells[0].1, cells[1].0, cells[1].1, cells[2].0, cells[2].1
        );
    }
    Ok(())
}

fn per(t: Duration, n: usize) -> f64 {
    t.as_secs_f64() * 1e6 / n.max(1) as f64
}
