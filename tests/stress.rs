//! Stress: 8 threads, each with two streams of one shared device (one stream on the stack pool,
//! one on a caching pool shared by every thread), take, release (in and out of LIFO order),
//! upload and download at random for a bounded time. Every buffer holds a pattern of its own,
//! checked on read-back and before release, so two live buffers sharing memory show as a wrong
//! pattern. On the host backend, and on CUDA device 0 when there is one.
//!
//! `GPU_POOL_STRESS_SECS` sets the time per device (default 20 s).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_pool::{
    BufferPool, CachingPool, Device, Fallback, GpuMat, PoolError, Stream, set_buffer_pool_config,
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

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) >> 3) as u8)
        .collect()
}

#[derive(Default, Debug, Clone, Copy)]
struct Tally {
    ops: u64,
    takes: u64,
    checks: u64,
    bytes_checked: u64,
    wrong: u64,
}

impl Tally {
    fn add(&mut self, o: Tally) {
        self.ops += o.ops;
        self.takes += o.takes;
        self.checks += o.checks;
        self.bytes_checked += o.bytes_checked;
        self.wrong += o.wrong;
    }
}

struct Live<'s> {
    mat: GpuMat<'s, u8>,
    seed: u64,
}

fn check(live: &Live<'_>, tally: &mut Tally) -> Result<(), PoolError> {
    let got = live.mat.to_vec()?;
    tally.checks += 1;
    tally.bytes_checked += got.len() as u64;
    if got != pattern(live.seed, got.len()) {
        tally.wrong += 1;
    }
    Ok(())
}

fn worker(
    device: &Device,
    cache: &Arc<CachingPool>,
    thread: usize,
    until: Instant,
) -> Result<Tally, PoolError> {
    let streams = [
        Stream::new(device)?,
        Stream::with_allocator(device, cache.clone())?,
    ];
    let pools = [BufferPool::new(&streams[0]), BufferPool::new(&streams[1])];
    let mut live: [Vec<Live<'_>>; 2] = [Vec::new(), Vec::new()];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (thread as u64 + 1));
    let mut tally = Tally::default();
    while Instant::now() < until {
        tally.ops += 1;
        let s = rng.below(2);
        match rng.below(10) {
            0..4 if live[s].len() < MAX_LIVE => {
                let mut mat = if rng.below(2) == 0 {
                    pools[s].get_buffer_1d::<u8>(1 + rng.below(200_000))?
                } else {
                    pools[s].get_buffer::<u8>(1 + rng.below(64), 1 + rng.below(4096))?
                };
                let seed = rng.next();
                mat.upload(&pattern(seed, mat.len()))?;
                live[s].push(Live { mat, seed });
                tally.takes += 1;
            }
            4..7 if !live[s].is_empty() => {
                let top = live[s].pop().expect("not empty");
                check(&top, &mut tally)?;
                top.mat.release()?;
            }
            7 if !live[s].is_empty() => {
                // Out of LIFO order: the pool must keep the blocks above intact.
                let at = rng.below(live[s].len());
                let gone = live[s].remove(at);
                check(&gone, &mut tally)?;
                gone.mat.release()?;
            }
            _ if !live[s].is_empty() => {
                let at = rng.below(live[s].len());
                check(&live[s][at], &mut tally)?;
            }
            _ => {}
        }
    }
    for list in &mut live {
        while let Some(l) = list.pop() {
            check(&l, &mut tally)?;
        }
    }
    for s in &streams {
        s.synchronize()?;
        assert_eq!(s.stats().stack_in_use, 0, "every stack block returned");
    }
    Ok(tally)
}

fn stress(device: &Device, secs: u64) -> Result<(Tally, Duration), PoolError> {
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
    let stats = device.stats();
    assert_eq!(stats.stacks_held, 0);
    assert_eq!(
        cache.stats().active_blocks,
        0,
        "every cached block freed to the pool"
    );
    cache.free_held()?;
    Ok((total, start.elapsed()))
}

#[test]
fn eight_threads_never_see_overlapping_buffers() -> Result<(), PoolError> {
    let secs = std::env::var("GPU_POOL_STRESS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let report = |device: &Device, (t, took): (Tally, Duration)| {
        common::skipped(&format!(
            "stress on {}: {THREADS} threads x 2 streams, {:.1} s: {} operations, {} buffers \
             taken, {} read-backs ({:.1} MiB) checked, {} wrong patterns",
            device.id(),
            took.as_secs_f64(),
            t.ops,
            t.takes,
            t.checks,
            t.bytes_checked as f64 / (1 << 20) as f64,
            t.wrong
        ));
        assert_eq!(t.wrong, 0, "a buffer's pattern was overwritten");
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
