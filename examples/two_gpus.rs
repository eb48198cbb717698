//! Data-parallel steps on two GPUs from one thread: each rank's gradient is a `buffer!`
//! temporary of its own stream, NCCL sums the gradients across the GPUs, and rank 1 sends rank 0
//! its gradient; the step runs eagerly, then as two captured CUDA graphs, and the stacks are
//! checked to be symmetric (the same offsets on both GPUs).
//!
//! `cargo run --release --features nccl --example two_gpus [STEPS]`. It says where it ran and what it skipped: with
//! fewer than two GPUs, or without `libnccl`, it prints why and runs the step's stack work on the
//! host backend instead, twice, to show the symmetric-stack check.

use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::nccl::{Communicators, Reduce};
use gpu_pool::observe::check_symmetric;
use gpu_pool::prelude::*;

/// Gradient elements per rank: 16 MiB of f32.
const N: usize = 4 << 20;

/// One step: rank r fills its gradient with r + 1 (a stand-in for a backward pass), the
/// gradients are summed on both ranks, and rank 1 sends rank 0 its gradient. The sums land in
/// `sums`, what rank 0 received in `got`; every other buffer is a temporary.
#[pooled(s0)]
fn train_step(
    ranks: &Communicators<'_>,
    s0: &Stream,
    s1: &Stream,
    sums: &mut [GpuMat<'_, f32>; 2],
    got: &mut GpuMat<'_, f32>,
) -> Result<(), PoolError> {
    let mut grad0 = buffer!(N; f32)?;
    let mut recv0 = buffer!(N; f32)?;
    gpu_scope!(s1, {
        let mut grad1 = buffer!(N; f32)?;
        let _recv1 = buffer!(N; f32)?; // rank 1's twin of recv0: the stacks stay symmetric
        grad0.set_to(1.0)?;
        grad1.set_to(2.0)?;
        let [sum0, sum1] = sums;
        ranks.group(|g| {
            g.all_reduce(0, &grad0, sum0, Reduce::Sum)?;
            g.all_reduce(1, &grad1, sum1, Reduce::Sum)?;
            g.send(1, &grad1, 0)?;
            g.recv(0, &mut recv0, 1)
        })?;
        got.copy_from(&recv0)?;
    });
    Ok(())
}

/// Elements of `m` that are not `want`.
fn wrong(m: &GpuMat<'_, f32>, want: f32) -> Result<usize, PoolError> {
    Ok(m.to_vec()?.iter().filter(|&&v| v != want).count())
}

fn main() -> Result<(), PoolError> {
    let steps = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(50usize);
    let count = Device::cuda_device_count();
    let nccl = gpu_pool::nccl::version();
    match (count, &nccl) {
        (Err(e), _) => host_instead(&format!("skipped the GPUs: {e}")),
        (Ok(count @ 0..=1), _) => host_instead(&format!(
            "skipped the GPUs: {count} CUDA device(s), 2 needed"
        )),
        (Ok(count), Ok(v)) => {
            println!(
                "running on {count} CUDA devices, NCCL {}.{}.{}; ranks on cuda:0 and cuda:1",
                v / 10000,
                v / 100 % 100,
                v % 100
            );
            on_two_gpus(steps)
        }
        (Ok(_), Err(e)) => host_instead(&format!("skipped the GPUs: {e}")),
    }
}

fn on_two_gpus(steps: usize) -> Result<(), PoolError> {
    let (gpu0, gpu1) = (Device::cuda(0)?, Device::cuda(1)?);
    for gpu in [&gpu0, &gpu1] {
        // Two 16 MiB buffers a rank, padding included: a 64 MiB stack each.
        gpu_pool::compat::opencv::set_buffer_pool_config(gpu, 64 << 20, 1)?;
    }
    let (s0, s1) = (Stream::new(&gpu0)?, Stream::new(&gpu1)?);
    let ranks = Communicators::new(&[&s0, &s1])?;
    let mut sums = [
        GpuMat::<f32>::new(&s0, 1, N)?,
        GpuMat::<f32>::new(&s1, 1, N)?,
    ];
    let mut got = GpuMat::<f32>::new(&s0, 1, N)?;

    train_step(&ranks, &s0, &s1, &mut sums, &mut got)?; // NCCL connects on the first step
    let calls = |d: &Device| d.stats().driver_alloc_calls;
    let before = (calls(&gpu0), calls(&gpu1));
    let start = std::time::Instant::now();
    for _ in 0..steps {
        train_step(&ranks, &s0, &s1, &mut sums, &mut got)?;
    }
    s0.synchronize()?;
    s1.synchronize()?;
    let eager = start.elapsed() / steps.max(1) as u32;
    let bad = (
        wrong(&sums[0], 3.0)?,
        wrong(&sums[1], 3.0)?,
        wrong(&got, 2.0)?,
    );
    println!(
        "eager: {steps} steps, {eager:?} a step; wrong (sum on 0, sum on 1, received on 0): \
         {bad:?}; driver allocations after the first step: cuda:0 {}, cuda:1 {}",
        calls(&gpu0) - before.0,
        calls(&gpu1) - before.1
    );
    match check_symmetric(&[&s0, &s1]) {
        Ok(()) if cfg!(debug_assertions) => println!("stacks symmetric: {:?}", s0.layout_trace()),
        Ok(()) => println!("stacks: the symmetric check runs in debug builds"),
        Err(e) => println!("{e}"),
    }

    for m in sums.iter_mut().chain([&mut got]) {
        m.set_to(0.0)?;
    }
    let before = (calls(&gpu0), calls(&gpu1));
    {
        // One graph per rank, replayed together so the ranks stay in step.
        let graphs = ranks.capture(|| train_step(&ranks, &s0, &s1, &mut sums, &mut got))?;
        let start = std::time::Instant::now();
        for _ in 0..steps {
            graphs.launch()?;
        }
        s0.synchronize()?;
        s1.synchronize()?;
        println!(
            "graphs: {steps} replays, {:?} a step; the ranks' graphs {:?}",
            start.elapsed() / steps.max(1) as u32,
            graphs.nodes()?
        );
    }
    let bad = (
        wrong(&sums[0], 3.0)?,
        wrong(&sums[1], 3.0)?,
        wrong(&got, 2.0)?,
    );
    println!(
        "graphs: wrong {bad:?}; driver allocations for capture and replays: cuda:0 {}, cuda:1 {}",
        calls(&gpu0) - before.0,
        calls(&gpu1) - before.1
    );
    Ok(())
}

/// What runs without two GPUs: the stack work of a step on two host "ranks", and the check
/// that they laid their buffers out alike.
fn host_instead(why: &str) -> Result<(), PoolError> {
    println!("{why}");
    println!("running the step's stack work on the host backend instead (no NCCL, no kernels)");
    let ranks = [
        Stream::new(&Device::private_host())?,
        Stream::new(&Device::private_host())?,
    ];
    for rank in &ranks {
        gpu_scope!(rank, {
            let mut grad = buffer!(N; f32)?;
            let _recv = buffer!(N; f32)?;
            grad.set_to(1.0)?;
        });
    }
    match check_symmetric(&[&ranks[0], &ranks[1]]) {
        Ok(()) if cfg!(debug_assertions) => {
            println!("host ranks symmetric: {:?}", ranks[0].layout_trace())
        }
        Ok(()) => println!("host ranks: the symmetric check runs in debug builds"),
        Err(e) => println!("{e}"),
    }
    Ok(())
}
