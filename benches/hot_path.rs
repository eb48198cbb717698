//! The take + release hot path as a plain loop, for instruction counts that do not depend on the
//! machine's load: `valgrind --tool=callgrind target/release/deps/hot_path-* N hand|dsl`, at two
//! values of N; the difference divided by the difference of N is the instructions per call of two
//! buffers taken and released (BENCHMARKS.md, F). Without arguments (as `cargo bench` runs it) it
//! makes one call and says how to use it.

use std::hint::black_box;

use gpu_pool::prelude::*;

/// Two buffers on the runtime API.
#[inline(never)]
fn by_hand(stream: &Stream, n: usize) -> Result<u64, PoolError> {
    let pool = BufferPool::new(stream);
    let a = pool.get_buffer::<f32>(n, n)?;
    let b = pool.get_buffer_1d::<u8>(n)?;
    Ok(a.device_ptr() ^ b.device_ptr())
}

/// The same two buffers with the DSL.
#[pooled(stream)]
#[inline(never)]
fn with_dsl(stream: &Stream, n: usize) -> Result<u64, PoolError> {
    let a = buffer!(n, n; f32)?;
    let b = buffer!(n; u8)?;
    Ok(a.device_ptr() ^ b.device_ptr())
}

fn main() -> Result<(), PoolError> {
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let iterations: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1);
    let dsl = args.next().is_some_and(|a| a == "dsl");
    let stream = Stream::new(&Device::host_with_limit(None))?;
    let mut x = 0;
    for _ in 0..iterations {
        x ^= if dsl {
            with_dsl(&stream, black_box(16))?
        } else {
            by_hand(&stream, black_box(16))?
        };
    }
    black_box(x);
    if iterations == 1 {
        println!("hot_path: run it as `hot_path N hand|dsl` under valgrind --tool=callgrind");
    }
    Ok(())
}
