//! Pool operations decoded from bytes, run against one host device and checked as they go: the
//! fuzz target (`fuzz/`) and the corpus replay test (`tests/fuzz_corpus.rs`) share this.
//!
//! Every operation either succeeds or returns a `PoolError`; nothing may panic. Live buffers keep
//! their patterns, and when everything is dropped only the stack memory is left.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "shared by two crates, each using a different part; a test helper is not API"
)]

use arbitrary::{Arbitrary, Unstructured};
use gpu_pool::{
    BufferPool, CachingPool, Device, EnvConfig, Fallback, GpuMat, MixMemory, PoolError, Stream,
    set_buffer_pool_config,
};

/// A size: mostly small, sometimes at the edges of `usize`.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Size {
    Small(u16),
    Medium(u32),
    Huge(u8),
}

impl Size {
    fn get(self) -> usize {
        match self {
            Size::Small(n) => usize::from(n),
            Size::Medium(n) => n as usize % (64 << 10),
            Size::Huge(k) => usize::MAX >> (k % 16),
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Elem {
    U8,
    U32,
    Bgr,
    F64,
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Op {
    NewStream,
    NewCachedStream,
    DropStream(u8),
    Take {
        stream: u8,
        rows: Size,
        cols: Size,
        elem: Elem,
    },
    Take1d {
        stream: u8,
        len: Size,
    },
    /// Releases live buffer `i` (modulo the number live) of the newest stream: in or out of order.
    Release(u8),
    Check(u8),
    Config {
        size: Size,
        count: Size,
    },
    Usage(bool),
    Fallback(u8),
    StrictLifo(bool),
    Env(String),
    MixCpu(Size),
    MixGpu(Size),
    MixCopy(bool),
    FreeCached,
}

impl Op {
    fn is_buffer_op(&self) -> bool {
        matches!(
            self,
            Op::Take { .. } | Op::Take1d { .. } | Op::Release(_) | Op::Check(_)
        )
    }

    fn stream_pick(&self) -> usize {
        match self {
            Op::Take { stream, .. } | Op::Take1d { stream, .. } => usize::from(*stream),
            _ => 0,
        }
    }
}

/// A buffer of the model, typed by its element.
enum Buf<'s> {
    U8(GpuMat<'s, u8>),
    U32(GpuMat<'s, u32>),
    Bgr(GpuMat<'s, [u8; 3]>),
    F64(GpuMat<'s, f64>),
}

impl Buf<'_> {
    fn bytes(&self) -> Result<Vec<u8>, PoolError> {
        Ok(match self {
            Buf::U8(m) => m.to_vec()?,
            Buf::U32(m) => bytemuck::cast_slice(&m.to_vec()?).to_vec(),
            Buf::Bgr(m) => bytemuck::cast_slice(&m.to_vec()?).to_vec(),
            Buf::F64(m) => bytemuck::cast_slice(&m.to_vec()?).to_vec(),
        })
    }

    fn release(self) -> Result<(), PoolError> {
        match self {
            Buf::U8(m) => m.release(),
            Buf::U32(m) => m.release(),
            Buf::Bgr(m) => m.release(),
            Buf::F64(m) => m.release(),
        }
    }
}

/// Fills with a byte pattern of `seed` (the uploads need whole elements, so it is typed).
fn fill(buf: &mut Buf<'_>, seed: u8) -> Result<(), PoolError> {
    match buf {
        Buf::U8(m) => m.set_to(seed),
        Buf::U32(m) => m.set_to(u32::from_ne_bytes([seed; 4])),
        Buf::Bgr(m) => m.set_to([seed; 3]),
        Buf::F64(m) => m.set_to(f64::from_ne_bytes([seed; 8])),
    }
}

fn take<'s>(
    pool: &BufferPool<'s>,
    rows: usize,
    cols: usize,
    elem: Elem,
) -> Result<Buf<'s>, PoolError> {
    Ok(match elem {
        Elem::U8 => Buf::U8(pool.get_buffer(rows, cols)?),
        Elem::U32 => Buf::U32(pool.get_buffer(rows, cols)?),
        Elem::Bgr => Buf::Bgr(pool.get_buffer(rows, cols)?),
        Elem::F64 => Buf::F64(pool.get_buffer(rows, cols)?),
    })
}

/// What a run did, for the replay test's summary.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outcome {
    pub ops: usize,
    pub errors: usize,
}

/// Decodes `data` into operations and runs them; panics only when an invariant breaks.
pub fn run(data: &[u8]) -> Outcome {
    let mut u = Unstructured::new(data);
    let ops: Vec<Op> = u.arbitrary().unwrap_or_default();
    run_ops(&ops)
}

pub fn run_ops(ops: &[Op]) -> Outcome {
    // A limit makes the huge requests out-of-memory errors instead of the OS's problem.
    let device = Device::host_with_limit(32 << 20);
    // Small stacks to start with, so a run costs microseconds (the fuzzer's address sanitizer
    // makes large allocations slow); `Config` operations change them.
    set_buffer_pool_config(&device, 1 << 20, 4).expect("a valid config");
    let cache = std::sync::Arc::new(CachingPool::new(&device));
    let mut outcome = Outcome::default();
    {
        let mut streams: Vec<Stream> = Vec::new();
        let mut mix = MixMemory::new(&device).expect("a host MixMemory");
        let mut seed = 0u8;
        let ops = &ops[..ops.len().min(512)];
        let mut i = 0;
        while i < ops.len() {
            // A run of buffer operations is an episode on one stream: buffers borrow it.
            let episode = ops[i..].iter().take_while(|op| op.is_buffer_op()).count();
            if episode > 0 {
                if !streams.is_empty() {
                    let pick = ops[i].stream_pick() % streams.len();
                    let done = run_buffers(&streams[pick], &ops[i..i + episode]);
                    outcome.ops += done.ops;
                    outcome.errors += done.errors;
                }
                i += episode;
                continue;
            }
            outcome.ops += 1;
            if step(&device, &cache, &mut streams, &mut mix, &ops[i], &mut seed).is_err() {
                outcome.errors += 1;
            }
            i += 1;
        }
    }
    // Streams, buffers and the MixMemory are gone: only the stacks and the caches' blocks remain
    // (the device's own caching pool serves streams whose fallback is `Fallback::Caching`).
    let _ = cache.free_held();
    let _ = device.caching_pool().free_held();
    let arena = device.stats();
    let live = gpu_pool::testing::host_live_bytes(&device).expect("a host device");
    let expected = if arena.stacks_allocated {
        arena
            .config
            .clone()
            .expect("allocated stacks have their config")
            .total_bytes()
    } else {
        0
    };
    assert_eq!(live, expected, "memory leaked or double-counted");
    gpu_pool::set_buffer_pool_usage(true);
    outcome
}

fn step(
    device: &Device,
    cache: &std::sync::Arc<CachingPool>,
    streams: &mut Vec<Stream>,
    mix: &mut MixMemory<'static>,
    op: &Op,
    seed: &mut u8,
) -> Result<(), PoolError> {
    match op {
        Op::NewStream if streams.len() < 8 => streams.push(Stream::new(device)?),
        Op::NewCachedStream if streams.len() < 8 => {
            streams.push(Stream::with_allocator(device, cache.clone())?)
        }
        Op::DropStream(i) if !streams.is_empty() => {
            let i = usize::from(*i) % streams.len();
            drop(streams.remove(i));
        }
        Op::Config { size, count } => set_buffer_pool_config(device, size.get(), count.get())?,
        Op::Usage(on) => gpu_pool::set_buffer_pool_usage(*on),
        Op::Fallback(k) => device.set_fallback(match k % 4 {
            0 => Fallback::Driver,
            1 => Fallback::StreamOrdered,
            2 => Fallback::Caching,
            _ => Fallback::Error,
        }),
        Op::StrictLifo(on) => device.set_strict_lifo(*on),
        Op::Env(text) => {
            let _ = EnvConfig::parse(text);
        }
        Op::MixCpu(n) => {
            let n = n.get().min(1 << 20);
            mix.cpu::<u8>(n)?.fill(*seed);
        }
        Op::MixGpu(n) => {
            mix.gpu::<u32>(n.get().min(1 << 18))?;
        }
        Op::MixCopy(to_gpu) if !streams.is_empty() => {
            let s = streams.last().expect("not empty");
            if *to_gpu {
                mix.copy_to_gpu_async(s)?;
            } else {
                mix.copy_to_cpu_async(s)?;
            }
        }
        Op::FreeCached => {
            cache.free_held()?;
        }
        _ => {}
    }
    *seed = seed.wrapping_add(1);
    Ok(())
}

/// Runs the buffer operations of `ops` on `stream`, checking patterns throughout.
pub fn run_buffers(stream: &Stream, ops: &[Op]) -> Outcome {
    let pool = BufferPool::new(stream);
    let mut live: Vec<(Buf<'_>, u8)> = Vec::new();
    let mut outcome = Outcome::default();
    for (n, op) in ops.iter().enumerate() {
        outcome.ops += 1;
        let seed = (n % 251) as u8 + 1;
        let result: Result<(), PoolError> = (|| {
            match op {
                Op::Take {
                    rows, cols, elem, ..
                } if live.len() < 32 => {
                    let mut buf = take(&pool, rows.get(), cols.get(), *elem)?;
                    fill(&mut buf, seed)?;
                    live.push((buf, seed));
                }
                Op::Take1d { len, .. } if live.len() < 32 => {
                    let mut buf = Buf::U8(pool.get_buffer_1d(len.get())?);
                    fill(&mut buf, seed)?;
                    live.push((buf, seed));
                }
                Op::Release(i) if !live.is_empty() => {
                    let (buf, s) = live.remove(usize::from(*i) % live.len());
                    assert!(
                        buf.bytes()?.iter().all(|&b| b == s),
                        "a live buffer was overwritten"
                    );
                    buf.release()?;
                }
                Op::Check(i) if !live.is_empty() => {
                    let (buf, s) = &live[usize::from(*i) % live.len()];
                    assert!(
                        buf.bytes()?.iter().all(|b| b == s),
                        "a live buffer was overwritten"
                    );
                }
                _ => {}
            }
            Ok(())
        })();
        if let Err(e) = result {
            outcome.errors += 1;
            // Every error says something a user can act on.
            assert!(!e.to_string().is_empty());
        }
    }
    for (buf, s) in live.drain(..).rev() {
        assert!(
            buf.bytes().is_ok_and(|b| b.iter().all(|&x| x == s)),
            "a live buffer was overwritten"
        );
    }
    outcome
}
