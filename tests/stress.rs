//! Stress: 8 threads, each with two streams of one shared device (one stream on the stack pool,
//! one on a caching pool shared by every thread), take, release (in and out of LIFO order),
//! upload and download at random for a bounded time. Each thread's operations are checked by the
//! shared model (`tests/common/model/`): its buffers come from where the model says and never
//! overlap, its streams' counters add up, and every buffer holds a pattern of its own, checked on
//! read-back and before release, so a buffer sharing memory with another thread's shows as a wrong
//! pattern. On the host backend, and on CUDA device 0 when there is one.
//!
//! By default a short run (1 s per device) keeps `cargo test --workspace` quick; the long run
//! (20 s per device, or `GPU_POOL_STRESS_SECS`) is ignored there and has its own CI step:
//! `cargo test -p gpu-pool-tests --test stress -- --ignored`.

mod common;

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::model::{self, Elem, Fill, Mismatch, Model, Op, Pick, Setup, Shape, StreamKind, Tally};
use gpu_pool::{
    Device, alloc::CachingPool, compat::opencv::set_buffer_pool_config, config::Fallback,
};

const THREADS: usize = 8;
const MAX_LIVE: usize = 12;

/// xorshift64*: enough randomness for a stress run, reproducible per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A thread's next operation on its streams (0: the stack pool, 1: the caching pool), until
/// `until`: takes up to `MAX_LIVE` a stream, releases mostly in LIFO order.
fn next_op(rng: &mut Rng, model: &Model, until: Instant) -> Option<Op> {
    while Instant::now() < until {
        let s = rng.below(2);
        let live = model.live_on(s);
        return Some(match rng.below(10) {
            0..4 if live < MAX_LIVE => {
                let shape = if rng.below(2) == 0 {
                    Shape::Row(1 + rng.below(200_000))
                } else {
                    Shape::Mat {
                        rows: 1 + rng.below(64),
                        cols: 1 + rng.below(4096),
                    }
                };
                let fill = Fill::Pattern(rng.next());
                Op::Take {
                    stream: s,
                    shape,
                    elem: Elem::U8,
                    fill,
                }
            }
            4..7 if live > 0 => Op::Release(Pick::Newest(s)),
            // Out of LIFO order: the pool must keep the blocks above intact.
            7 if live > 0 => Op::Release(Pick::OfStream(s, rng.below(live))),
            _ if live > 0 => Op::Check(Pick::OfStream(s, rng.below(live))),
            _ => continue,
        });
    }
    None
}

fn worker(
    device: &Device,
    cache: &Arc<CachingPool>,
    thread: usize,
    until: Instant,
) -> Result<Tally, Mismatch> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (thread as u64 + 1));
    let mut streams = [
        Op::NewStream(StreamKind::Stack),
        Op::NewStream(StreamKind::Cached),
    ]
    .into_iter();
    // Other threads share the device and the caching pool: the model checks this thread's own.
    let setup = Setup {
        cache: Some(cache.clone()),
        shared: true,
        ..Setup::default()
    };
    model::run(device, setup, |m| {
        streams.next().or_else(|| next_op(&mut rng, m, until))
    })
}

fn stress(device: &Device, secs: u64) -> Result<(Tally, Duration), Box<dyn Error>> {
    device.set_fallback(Fallback::Driver);
    // Fewer stacks than threads, so streams also run on the fallback.
    set_buffer_pool_config(device, 4 << 20, 6)?;
    let cache = Arc::new(CachingPool::new(device));
    let start = Instant::now();
    let until = start + Duration::from_secs(secs);
    let tallies = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let cache = &cache;
                scope.spawn(move || worker(device, cache, t, until))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no worker panics"))
            .collect::<Result<Vec<_>, _>>()
    })?;
    let mut total = Tally::default();
    for t in tallies {
        total.add(t);
    }
    // Every stack back, every cached block freed to the pool, and only the stacks' memory left.
    model::settled(device, &[&cache], 0)?;
    Ok((total, start.elapsed()))
}

/// Seconds per device of the short run, the one `cargo test` does.
const SHORT_SECS: u64 = 1;

#[test]
fn eight_threads_never_see_overlapping_buffers() -> Result<(), Box<dyn Error>> {
    run(SHORT_SECS)
}

#[test]
#[ignore = "long: run with cargo test -p gpu-pool-tests --test stress -- --ignored"]
fn eight_threads_never_see_overlapping_buffers_for_long() -> Result<(), Box<dyn Error>> {
    let secs = std::env::var("GPU_POOL_STRESS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    run(secs)
}

fn run(secs: u64) -> Result<(), Box<dyn Error>> {
    let report = |device: &Device, (t, took): (Tally, Duration)| {
        common::skipped(&format!(
            "stress on {}: {THREADS} threads x 2 streams, {:.1} s: {} operations, {} buffers \
             taken, {} read-backs ({:.1} MiB) checked, no wrong pattern",
            device.id(),
            took.as_secs_f64(),
            t.ops,
            t.takes,
            t.checks,
            t.bytes_checked as f64 / (1 << 20) as f64,
        ));
        assert!(t.checks > 0);
    };
    let host = Device::private_host();
    report(&host, stress(&host, secs)?);
    let arena = 6 * (4 << 20);
    assert_eq!(
        gpu_pool::testing::host_live_bytes(&host),
        Some(arena),
        "only the stacks remain"
    );
    if let Some((gpu, _lock)) = common::gpu("stress") {
        report(&gpu, stress(&gpu, secs)?);
        set_buffer_pool_config(&gpu, 10 << 20, 5)?;
    }
    Ok(())
}
