//! Data-parallel steps with one process per GPU, as torchrun, DDP or an MPI program run them:
//! this program starts itself once per GPU (`RANK`, `WORLD_SIZE`), rank 0 makes the NCCL unique
//! id and hands it to the others through a file, and every rank makes its communicator with
//! `Communicators::from_rank`. The step is `two_gpus`' on one rank: the gradient is a `buffer!`
//! temporary of the rank's stream, NCCL sums the gradients over the ranks, and rank 1 sends rank
//! 0 its gradient; it runs eagerly (the first step checked against every other rank's through
//! NCCL itself, `set_verify_groups`), then as a captured CUDA graph, and the stacks are checked to
//! be symmetric across the processes. Each rank prints its results and its driver allocations.
//!
//! `cargo run --release --features nccl --example ranks [STEPS] [RANKS]` (RANKS: every GPU by default). With
//! fewer than two GPUs, or without `libnccl`, it says why and exits.

#[path = "support/ranks.rs"]
mod ranks_support;

use std::process::ExitCode;
use std::time::Duration;

use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::nccl::NcclError;
use gpu_pool::nccl::{Communicators, Reduce, UniqueId};
use gpu_pool::prelude::*;
use ranks_support::{RankEnv, launch, publish_id, read_id};

/// Gradient elements per rank: 16 MiB of f32.
const N: usize = 4 << 20;

/// How long a rank waits for its peers (the id, NCCL's connections, a step) before it gives up.
const TIMEOUT: Duration = Duration::from_secs(120);

/// One step on rank `rank`: its gradient is `rank + 1` (a stand-in for a backward pass), the
/// gradients are summed over the ranks into `sum`, and rank 1 sends rank 0 its gradient, which
/// lands in `got`. Every rank takes the same two temporaries, so the stacks stay symmetric.
#[pooled(stream)]
fn train_step(
    ranks: &Communicators<'_>,
    stream: &Stream,
    rank: usize,
    sum: &mut GpuMat<'_, f32>,
    got: &mut GpuMat<'_, f32>,
) -> Result<(), PoolError> {
    let mut grad = buffer!(N; f32)?;
    let mut recv = buffer!(N; f32)?;
    grad.set_to((rank + 1) as f32)?;
    ranks.group(|g| {
        g.all_reduce(rank, &grad, sum, Reduce::Sum)?;
        match rank {
            0 => g.recv(0, &mut recv, 1),
            1 => g.send(1, &grad, 0),
            _ => Ok(()),
        }
    })?;
    if rank == 0 {
        got.copy_from(&recv)?;
    }
    Ok(())
}

/// Elements of `m` that are not `want`.
fn wrong(m: &GpuMat<'_, f32>, want: f32) -> Result<usize, PoolError> {
    Ok(m.to_vec()?.iter().filter(|&&v| v != want).count())
}

fn main() -> ExitCode {
    let arg = |i: usize| std::env::args().nth(i).and_then(|a| a.parse().ok());
    let steps: usize = arg(1).unwrap_or(50);
    match RankEnv::from_env() {
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
        Ok(Some(env)) => match rank_process(&env, steps) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("rank {}: failed: {e}", env.rank);
                ExitCode::FAILURE
            }
        },
        Ok(None) => launcher(steps, arg(2)),
    }
}

/// Starts one process per GPU and prints what each did.
fn launcher(steps: usize, asked: Option<usize>) -> ExitCode {
    let count = match Device::cuda_device_count() {
        Ok(count) => count,
        Err(e) => {
            println!("skipped: {e}");
            return ExitCode::SUCCESS;
        }
    };
    if count < 2 {
        println!("skipped: {count} CUDA device(s), 2 needed (one process per GPU)");
        return ExitCode::SUCCESS;
    }
    let version = match gpu_pool::nccl::version() {
        Ok(v) => v,
        Err(e) => {
            println!("skipped: {e}");
            return ExitCode::SUCCESS;
        }
    };
    let world = asked.unwrap_or(count).clamp(2, count);
    println!(
        "{count} CUDA devices, NCCL {}.{}.{}: starting {world} rank processes, one per GPU, {steps} steps",
        version / 10000,
        version / 100 % 100,
        version % 100
    );
    let runs = match launch(world, &[&steps.to_string()], 4 * TIMEOUT) {
        Ok(runs) => runs,
        Err(e) => {
            println!("starting the ranks failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    for run in &runs {
        for line in run.output.lines() {
            println!("[rank {}] {line}", run.rank);
        }
        println!("[rank {}] exited: {}", run.rank, run.status);
        failed |= !run.ok;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// One rank: the id, the communicator, the steps eager and captured.
fn rank_process(env: &RankEnv, steps: usize) -> Result<(), PoolError> {
    let rank = env.rank;
    let id = if rank == 0 {
        let id = UniqueId::new()?;
        publish_id(&env.id_file, &id).map_err(|e| {
            PoolError::Nccl(NcclError::Id {
                problem: format!("writing {}: {e}", env.id_file.display()),
            })
        })?;
        id
    } else {
        read_id(&env.id_file, TIMEOUT)?
    };
    let gpu = Device::cuda(rank)?;
    // Two 16 MiB buffers a rank, padding included: a 64 MiB stack, the same on every rank.
    gpu_pool::compat::opencv::set_buffer_pool_config(&gpu, 64 << 20, 1)?;
    let stream = Stream::new(&gpu)?;
    // The buffers the collectives use before the communicator, so that it drops first: on an
    // error path its drop gives up at the timeout and aborts NCCL's kernels, whereas freeing a
    // GpuMat waits for the device, which a collective whose peer never comes would never leave.
    let mut sum = GpuMat::<f32>::new(&stream, 1, N)?;
    let mut got = GpuMat::<f32>::new(&stream, 1, N)?;
    let ranks = Communicators::from_rank(&stream, &id, rank, env.world, TIMEOUT)?;
    println!(
        "rank {rank} of {} on {}: communicator made",
        env.world,
        gpu.id()
    );
    let want_sum = (env.world * (env.world + 1) / 2) as f32;

    // The first step connects NCCL; its group is checked against every other rank's first.
    ranks.set_verify_groups(true);
    train_step(&ranks, &stream, rank, &mut sum, &mut got)?;
    ranks.set_verify_groups(false);
    ranks.wait()?;
    let calls = || gpu.stats().driver_alloc_calls;
    let before = calls();
    let start = std::time::Instant::now();
    for _ in 0..steps {
        train_step(&ranks, &stream, rank, &mut sum, &mut got)?;
    }
    ranks.wait()?;
    let eager = start.elapsed() / steps.max(1) as u32;
    let got_wrong = if rank == 0 { wrong(&got, 2.0)? } else { 0 };
    println!(
        "rank {rank}: eager: {steps} steps, {eager:?} a step; wrong: sum {}, received {got_wrong}; \
         driver allocations after the first step: {}",
        wrong(&sum, want_sum)?,
        calls() - before
    );
    match ranks.check_symmetric() {
        Ok(()) if cfg!(debug_assertions) => println!(
            "rank {rank}: stacks symmetric on every rank: {:?}",
            stream.layout_trace()
        ),
        Ok(()) => println!("rank {rank}: stacks: the symmetric check runs in debug builds"),
        Err(e) => println!("rank {rank}: {e}"),
    }

    sum.set_to(0.0)?;
    got.set_to(0.0)?;
    let before = calls();
    {
        // One graph on this rank; every rank replays its own as often, so they stay in step.
        let graphs = ranks.capture(|| train_step(&ranks, &stream, rank, &mut sum, &mut got))?;
        let start = std::time::Instant::now();
        for _ in 0..steps {
            graphs.launch()?;
        }
        ranks.wait()?;
        println!(
            "rank {rank}: graphs: {steps} replays, {:?} a step; graph {:?}",
            start.elapsed() / steps.max(1) as u32,
            graphs.nodes()?
        );
    }
    let got_wrong = if rank == 0 { wrong(&got, 2.0)? } else { 0 };
    println!(
        "rank {rank}: graphs: wrong: sum {}, received {got_wrong}; driver allocations for \
         capture and replays: {}",
        wrong(&sum, want_sum)?,
        calls() - before
    );
    Ok(())
}
