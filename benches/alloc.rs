//! Take + release of one stack buffer, stats included, beside a bare pointer bump with a LIFO check
//! (the floor) and the same request served by the fallback allocator, all in one run.
//!
//! `cargo bench -p gpu-pool-benches --bench alloc` prints a markdown table of medians and ratios at the end.
//!
//! `alloc loop N hand|dsl|child` (the bench binary, run directly) instead calls the two-buffer
//! function N times and nothing else, for instruction counts that do not depend on the machine's load:
//! under `valgrind --tool=callgrind` at two values of N, the difference of the counts over the
//! difference of N is the instructions per call (BENCHMARKS.md, G).

mod support;

use std::cell::Cell;
use std::hint::black_box;
use std::marker::PhantomData;

use criterion::BatchSize;
use gpu_pool::compat::opencv::BufferPool;
use gpu_pool::prelude::*;
use gpu_pool::{compat::opencv::set_buffer_pool_config, config::Fallback};

/// The least a stack can do: an aligned bump, and a LIFO check on release.
struct BareBump {
    top: Cell<usize>,
    size: usize,
}

impl BareBump {
    #[inline]
    fn take(&self, bytes: usize) -> Option<(usize, usize)> {
        let prev = self.top.get();
        let start = (prev + 511) & !511;
        let end = start.checked_add(bytes).filter(|&e| e <= self.size)?;
        self.top.set(end);
        Some((end, prev))
    }
    #[inline]
    fn release(&self, (end, prev): (usize, usize)) -> bool {
        let in_order = end == self.top.get();
        if in_order {
            self.top.set(prev);
        }
        in_order
    }
}

const GROUP: &str = "take_release_1KiB";
const DSL: &str = "dsl_vs_hand_written";

/// Two buffers, as a `#[pooled]` function.
#[pooled(stream)]
#[inline(never)]
fn with_dsl(stream: &Stream, n: usize) -> Result<u64, PoolError> {
    let a = buffer!(n, n; f32)?;
    let b = buffer!(n; u8)?;
    Ok(a.device_ptr() ^ b.device_ptr())
}

/// The same two buffers, written by hand against `BufferPool`.
#[inline(never)]
fn by_hand(stream: &Stream, n: usize) -> Result<u64, PoolError> {
    let pool = BufferPool::new(stream);
    let a = pool.get_buffer::<f32>(n, n)?;
    let b = pool.get_buffer_1d::<u8>(n)?;
    Ok(a.device_ptr() ^ b.device_ptr())
}

/// A prototype of bump-scope's child scope (issue 31, item 1), on the public runtime API only:
/// LIFO as a property of types. A scope borrows its stream; [`child`](Scope::child) borrows the
/// parent `&mut`, so the parent cannot take (or open another child) while the child lives; a
/// buffer taken through a scope borrows that scope, so it cannot outlive it.
///
/// ```text
/// let mut outer = Scope::new(&stream);
/// let inner = outer.child();
/// let a = outer.temp_1d::<u8>(16)?; // error[E0502]: `outer` is borrowed mutably by `inner`
/// drop(inner);                      //                 for as long as `inner` lives
/// ```
///
/// What it cannot do on the public API: reset the stack's top to a checkpoint. Each buffer here
/// still owns its `Temp` and releases itself (in reverse order, locals' drop order), which is the
/// release a guard would make; the scope's `Drop` has nothing left to do. A real implementation
/// needs from the core a `Checkpoint` (the stack's top when the scope opens, `stack_top` in
/// core/fence.rs, today crate-private) and a `reset_to(checkpoint)` on the stack seam that drops
/// the top back in one store, with the fence rule of `release_reserved` (never below a graph's
/// fence or a capture's hold); buffers would then carry no `Drop` of their own.
struct Scope<'s> {
    stream: &'s Stream,
}

/// A buffer taken through a [`Scope`]: it borrows the scope for `'a`.
struct ScopedTemp<'a, 's, T: gpu_pool::Element> {
    temp: Temp<'s, T>,
    _scope: PhantomData<&'a Scope<'s>>,
}

impl<'s> Scope<'s> {
    #[inline(always)]
    fn new(stream: &'s Stream) -> Self {
        Scope { stream }
    }

    /// A child scope: the parent is borrowed mutably until the child is dropped.
    #[inline(always)]
    fn child(&mut self) -> Scope<'_> {
        Scope {
            stream: self.stream,
        }
    }

    #[inline(always)]
    #[track_caller]
    fn temp<T: gpu_pool::Element>(
        &self,
        rows: usize,
        cols: usize,
    ) -> Result<ScopedTemp<'_, 's, T>, PoolError> {
        Ok(ScopedTemp {
            temp: self.stream.temp(rows, cols)?,
            _scope: PhantomData,
        })
    }

    #[inline(always)]
    #[track_caller]
    fn temp_1d<T: gpu_pool::Element>(
        &self,
        len: usize,
    ) -> Result<ScopedTemp<'_, 's, T>, PoolError> {
        Ok(ScopedTemp {
            temp: self.stream.temp_1d(len)?,
            _scope: PhantomData,
        })
    }
}

/// The same two buffers, taken through a child of the caller's scope.
#[inline(never)]
fn child_scope(scope: &mut Scope<'_>, n: usize) -> Result<u64, PoolError> {
    let child = scope.child();
    let a = child.temp::<f32>(n, n)?;
    let b = child.temp_1d::<u8>(n)?;
    // let c = scope.temp_1d::<u8>(n)?; // E0502: `*scope` is borrowed mutably by `child`
    Ok(a.temp.device_ptr() ^ b.temp.device_ptr())
}

/// `loop N hand|dsl|child [growable]`: the two-buffer function `N` times, for callgrind, on a fixed
/// stack or a growable one (mapped by the first call).
fn instruction_loop(mut args: impl Iterator<Item = String>) {
    let iterations: usize = args
        .next()
        .and_then(|a| a.parse().ok())
        .expect("loop N hand|dsl|child [growable]");
    let variant = args.next().unwrap_or_default();
    let device = Device::private_host();
    if args.next().is_some_and(|a| a == "growable") {
        device
            .set_growable_stacks(true)
            .expect("the host models growable stacks");
    }
    let stream = Stream::new(&device).expect("host stream");
    let mut scope = Scope::new(&stream);
    let mut x = 0;
    for _ in 0..iterations {
        x ^= match variant.as_str() {
            "dsl" => with_dsl(&stream, black_box(16)),
            "child" => child_scope(&mut scope, black_box(16)),
            _ => by_hand(&stream, black_box(16)),
        }
        .expect("fits");
    }
    black_box(x);
}

fn main() {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some("loop") {
        return instruction_loop(args);
    }
    let mut c = support::criterion();
    let device = Device::private_host();
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(&device, 64 << 20, 2).expect("valid config");
    let stream = Stream::new(&device).expect("host stream");
    let pool = BufferPool::new(&stream);
    // A growable stack, mapped by a first take: its take publishes the top for reclaims.
    let growable_device = Device::private_host();
    growable_device
        .set_growable_stacks(true)
        .expect("the host models growable stacks");
    let growable = Stream::new(&growable_device).expect("host stream");
    let growable_pool = BufferPool::new(&growable);
    drop(growable_pool.get_buffer_1d::<u8>(1024).expect("maps"));
    let fallback_device = Device::private_host();
    fallback_device.set_fallback(Fallback::Driver);
    gpu_pool::compat::opencv::set_buffer_pool_config(&fallback_device, 4096, 1)
        .expect("valid config");
    let full = Stream::new(&fallback_device).expect("host stream");
    let full_pool = BufferPool::new(&full);
    let _filler = full_pool
        .get_buffer_1d::<u8>(4096)
        .expect("fills the stack");

    let cache = std::sync::Arc::new(gpu_pool::alloc::CachingPool::new(&fallback_device));
    let cached = Stream::with_allocator(&fallback_device, cache.clone()).expect("host stream");
    let cached_pool = BufferPool::new(&cached);
    drop(cached_pool.get_buffer_1d::<u8>(1024).expect("host memory")); // the one miss

    let mut group = c.benchmark_group(GROUP);
    let bump = BareBump {
        top: Cell::new(0),
        size: 64 << 20,
    };
    group.bench_function("bare_bump_lifo", |b| {
        b.iter(|| {
            let block = bump.take(black_box(1024)).expect("fits");
            black_box(bump.release(black_box(block)))
        })
    });
    group.bench_function("stack_pool", |b| {
        b.iter(|| {
            drop(black_box(
                pool.get_buffer_1d::<u8>(black_box(1024)).expect("fits"),
            ))
        })
    });
    group.bench_function("stack_pool_growable", |b| {
        b.iter(|| {
            drop(black_box(
                growable_pool
                    .get_buffer_1d::<u8>(black_box(1024))
                    .expect("fits"),
            ))
        })
    });
    group.bench_function("stack_pool_2d", |b| {
        b.iter(|| {
            drop(black_box(
                pool.get_buffer::<f32>(black_box(16), black_box(16))
                    .expect("fits"),
            ))
        })
    });
    group.bench_function("caching_pool_hit", |b| {
        b.iter(|| {
            drop(black_box(
                cached_pool
                    .get_buffer_1d::<u8>(black_box(1024))
                    .expect("a hit"),
            ))
        })
    });
    group.bench_function("host_driver_fallback", |b| {
        b.iter_batched(
            || (),
            |()| {
                drop(black_box(
                    full_pool
                        .get_buffer_1d::<u8>(black_box(1024))
                        .expect("host memory"),
                ))
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();

    let mut group = c.benchmark_group(DSL);
    group.bench_function("by_hand", |b| {
        b.iter(|| black_box(by_hand(&stream, black_box(16)).expect("fits")))
    });
    group.bench_function("pooled_dsl", |b| {
        b.iter(|| black_box(with_dsl(&stream, black_box(16)).expect("fits")))
    });
    group.finish();
    c.final_summary();

    let stats = cache.stats();
    println!(
        "\ncaching pool over the whole run: {} hits, {} misses (driver allocations)",
        stats.hits, stats.misses
    );
    let calls = device.stats().driver_alloc_calls;
    println!(
        "\nstack device driver allocation calls over the whole run: {calls} (the stack memory itself)"
    );
    support::print_table(
        "Take + release of a 1 KiB buffer, host backend",
        GROUP,
        "bare_bump_lifo",
        &[
            "bare_bump_lifo",
            "stack_pool",
            "stack_pool_growable",
            "stack_pool_2d",
            "caching_pool_hit",
            "host_driver_fallback",
        ],
    );
    support::print_table(
        "Two buffers taken and released: `#[pooled]` against the same code on `BufferPool`",
        DSL,
        "by_hand",
        &["by_hand", "pooled_dsl"],
    );
}
