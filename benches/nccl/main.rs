//! An all-reduce across two GPUs on `buffer!` temporaries, with the stacks in NCCL's memory used
//! three ways, interleaved in one run:
//!
//! - `unregistered`: the stacks are plain device memory to NCCL, which copies through its own
//!   buffers;
//! - `buffers`: every rank's stack memory registered with its communicator
//!   (`Communicators::register_stacks(false)`, `ncclCommRegister`);
//! - `window`: the same memory registered as one symmetric window
//!   (`register_stacks(true)`, `ncclCommWindowRegister`), which needs the same offsets on every
//!   rank: what the pool's LIFO stacks give.
//!
//! Each round, for each variant (registered at the round's start, deregistered at its end) and each
//! size, both ranks take a send and a receive buffer from their stacks, queue `ITERS` out-of-place
//! sum all-reduces as one group each, and wait; wall time / `ITERS` is one sample. The median, min
//! and max per all-reduce, the bus bandwidth (NCCL's 2(n-1)/n factor) and the ratio to
//! `unregistered` are printed as a markdown table; every result is checked (1 + 2 = 3).
//!
//! `cargo bench -p gpu-pool-benches --bench nccl [-- ROUNDS]` (or `NCCL_ROUNDS`; 7 by default). With fewer than two
//! GPUs, or without `libnccl`, it says so and measures nothing.

#[path = "../support/run.rs"]
mod run;

use std::time::{Duration, Instant};

use gpu_pool::compat::opencv::BufferPool;
use gpu_pool::compat::opencv::set_buffer_pool_config;
use gpu_pool::nccl::{Communicators, Reduce, use_driver_memory, use_nccl_memory};
use gpu_pool::prelude::*;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const SIZES: [usize; 5] = [64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20];
const VARIANTS: [&str; 3] = ["unregistered", "buffers", "window"];

fn main() -> Res<()> {
    let rounds = run::count(0, "NCCL_ROUNDS", 7);
    let count = Device::cuda_device_count().unwrap_or(0);
    if count < 2 {
        println!("nccl bench: skipped: {count} CUDA device(s), 2 needed");
        return Ok(());
    }
    let version = match gpu_pool::nccl::version() {
        Ok(v) => v,
        Err(e) => {
            println!("nccl bench: skipped: {e}");
            return Ok(());
        }
    };
    let gpus = [Device::cuda(0)?, Device::cuda(1)?];
    for gpu in &gpus {
        // A send and a receive buffer of the largest size, on one stack a device.
        set_buffer_pool_config(gpu, 2 * SIZES[4] + (64 << 20), 1)?;
        use_nccl_memory(gpu)?;
    }
    let nvls = std::env::var("NCCL_NVLS_ENABLE").unwrap_or_else(|_| "unset".into());
    println!(
        "nccl bench: 2 GPUs, driver {}, NCCL {}.{}.{}, NCCL_NVLS_ENABLE={nvls}, {rounds} rounds",
        run::driver_version()?,
        version / 10000,
        version / 100 % 100,
        version % 100
    );
    let mut samples = vec![vec![Vec::new(); SIZES.len()]; VARIANTS.len()];
    {
        let streams = [Stream::new(&gpus[0])?, Stream::new(&gpus[1])?];
        let ranks = Communicators::new(&[&streams[0], &streams[1]])?;
        for _round in 0..rounds {
            for (v, variant) in VARIANTS.iter().enumerate() {
                let registered = match *variant {
                    "buffers" => Some(ranks.register_stacks(false)?),
                    "window" => Some(ranks.register_stacks(true)?),
                    _ => None,
                };
                for (s, &bytes) in SIZES.iter().enumerate() {
                    samples[v][s].push(all_reduces(&ranks, &streams, bytes / 4)?);
                }
                drop(registered);
            }
        }
    }
    for gpu in &gpus {
        gpu.release_stack_memory()?;
        use_driver_memory(gpu)?;
    }
    println!();
    println!("| size | variant | median | min | max | bus GB/s | vs unregistered |");
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for (s, &bytes) in SIZES.iter().enumerate() {
        let base = median(&samples[0][s]);
        for (v, variant) in VARIANTS.iter().enumerate() {
            let xs = &samples[v][s];
            let m = median(xs);
            // NCCL's bus bandwidth for an all-reduce on n ranks: bytes * 2(n-1)/n / time.
            let bus = bytes as f64 / m.as_secs_f64() / 1e9;
            println!(
                "| {} | {variant} | {:.1} us | {:.1} us | {:.1} us | {bus:.1} | {:.3}x |",
                size_words(bytes),
                us(m),
                us(*xs.iter().min().expect("rounds > 0")),
                us(*xs.iter().max().expect("rounds > 0")),
                m.as_secs_f64() / base.as_secs_f64()
            );
        }
    }
    Ok(())
}

/// Queues sum all-reduces of `n` f32 from a send to a receive buffer on both ranks, checks the
/// sum, and returns the time of one.
fn all_reduces(ranks: &Communicators<'_>, streams: &[Stream; 2], n: usize) -> Res<Duration> {
    let iters = (256 << 20) / (n * 4) + 20;
    let (p0, p1) = (BufferPool::new(&streams[0]), BufferPool::new(&streams[1]));
    let (mut send0, mut send1) = (p0.get_buffer_1d::<f32>(n)?, p1.get_buffer_1d::<f32>(n)?);
    let (mut recv0, mut recv1) = (p0.get_buffer_1d::<f32>(n)?, p1.get_buffer_1d::<f32>(n)?);
    send0.set_to(1.0)?;
    send1.set_to(2.0)?;
    let mut once = || {
        ranks.group(|g| {
            g.all_reduce(0, &send0, &mut recv0, Reduce::Sum)?;
            g.all_reduce(1, &send1, &mut recv1, Reduce::Sum)
        })
    };
    for _ in 0..3 {
        once()?;
    }
    let wait = || -> Res<()> {
        streams[0].synchronize()?;
        streams[1].synchronize()?;
        Ok(())
    };
    wait()?;
    let start = Instant::now();
    for _ in 0..iters {
        once()?;
    }
    wait()?;
    let per = start.elapsed() / iters as u32;
    for recv in [&recv0, &recv1] {
        let wrong = recv.to_vec()?.iter().filter(|&&v| v != 3.0).count();
        if wrong > 0 {
            return Err(format!("{wrong} wrong sums of {n}").into());
        }
    }
    Ok(per)
}

fn median(xs: &[Duration]) -> Duration {
    let mut v = xs.to_vec();
    v.sort();
    v[v.len() / 2]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn size_words(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}
