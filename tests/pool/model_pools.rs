//! The binned caching pool and MixMemory against plain models, after every step of random
//! sequences: live blocks never overlap and keep their contents, every byte the backend hands out
//! is accounted for, the counters add up, and the state equals the model's.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpu_pool::{BufferPool, CachingPool, Device, GpuMat, MixMemory, PoolError, Stream};
use proptest::prelude::*;

fn fail(e: PoolError) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

// ---- The binned caching pool ----------------------------------------------------------------

#[derive(Clone, Debug)]
enum CacheOp {
    /// A contiguous buffer of this many bytes, on stream 0 or 1.
    Take {
        stream: usize,
        bytes: usize,
    },
    /// Releases the live buffer at this index (modulo the number live).
    Release(usize),
    FreeHeld,
}

fn cache_op() -> impl Strategy<Value = CacheOp> {
    prop_oneof![
        // Sizes cluster so that bins repeat and hits happen.
        5 => (0..2usize, prop_oneof![1..64usize, 900..1200usize, 60_000..70_000usize])
            .prop_map(|(stream, bytes)| CacheOp::Take { stream, bytes }),
        4 => any::<usize>().prop_map(CacheOp::Release),
        1 => Just(CacheOp::FreeHeld),
    ]
}

/// What the pool should hold: blocks per bin (the host backend has no pending work, so a held
/// block serves any stream), and the live ones.
#[derive(Default)]
struct CacheModel {
    held: BTreeMap<u64, usize>,
    hits: u64,
    misses: u64,
}

fn span(m: &GpuMat<'_, u8>) -> std::ops::Range<u64> {
    m.device_ptr()..m.device_ptr() + m.len() as u64
}

fn run_cache(ops: Vec<CacheOp>) -> Result<(), TestCaseError> {
    let device = Device::private_host();
    let cache = Arc::new(CachingPool::new(&device));
    let streams = [
        Stream::with_allocator(&device, cache.clone()).map_err(fail)?,
        Stream::with_allocator(&device, cache.clone()).map_err(fail)?,
    ];
    let pools = [BufferPool::new(&streams[0]), BufferPool::new(&streams[1])];
    let mut live: Vec<(GpuMat<'_, u8>, u8, usize)> = Vec::new(); // buffer, fill, bin size
    let (mut peak_requested, mut peak_rounded) = (0, 0);
    let mut model = CacheModel::default();

    for (seq, op) in ops.into_iter().enumerate() {
        match op {
            CacheOp::Take { stream, bytes } => {
                // The pool rounds a contiguous request to 64 bytes before binning.
                let (bin, size) = CachingPool::bin_of(
                    bytes.div_ceil(64) * 64,
                    gpu_pool::CachingPool::DEFAULT_LEADING_BITS,
                );
                match model.held.get_mut(&bin) {
                    Some(n) if *n > 0 => {
                        *n -= 1;
                        model.hits += 1;
                    }
                    _ => model.misses += 1,
                }
                let mut mat = pools[stream].get_buffer_1d::<u8>(bytes).map_err(fail)?;
                let fill = (seq % 251) as u8 + 1;
                mat.set_to(fill).map_err(fail)?;
                live.push((mat, fill, size));
            }
            CacheOp::Release(i) if !live.is_empty() => {
                let (mat, fill, size) = live.remove(i % live.len());
                prop_assert!(mat.to_vec().map_err(fail)?.iter().all(|&b| b == fill));
                let (bin, _) =
                    CachingPool::bin_of(size, gpu_pool::CachingPool::DEFAULT_LEADING_BITS);
                *model.held.entry(bin).or_default() += 1;
                mat.release().map_err(fail)?;
            }
            CacheOp::Release(_) => {}
            CacheOp::FreeHeld => {
                let freed = cache.free_held().map_err(fail)?;
                let held: usize = model
                    .held
                    .iter()
                    .map(|(&bin, &n)| size_of_bin(bin) * n)
                    .sum();
                prop_assert_eq!(freed, held, "free_held returns the bytes it freed");
                model.held.clear();
            }
        }

        let mut spans: Vec<_> = live.iter().map(|l| span(&l.0)).collect();
        spans.sort_by_key(|s| s.start);
        for pair in spans.windows(2) {
            prop_assert!(pair[0].end <= pair[1].start, "overlap: {:?}", pair);
        }
        let stats = cache.stats();
        let held_bytes: usize = model
            .held
            .iter()
            .map(|(&bin, &n)| n * size_of_bin(bin))
            .sum();
        prop_assert_eq!(stats.hits, model.hits);
        prop_assert_eq!(stats.misses, model.misses);
        prop_assert_eq!(stats.held_blocks, model.held.values().sum::<usize>());
        prop_assert_eq!(stats.held_bytes, held_bytes);
        prop_assert_eq!(stats.active_blocks, live.len());
        // Requested: the 64-byte rounded length the stream asks of the pool; rounded: the bins.
        let requested: usize = live.iter().map(|l| l.0.len().div_ceil(64) * 64).sum();
        let rounded: usize = live.iter().map(|l| l.2).sum();
        prop_assert_eq!(stats.active_requested_bytes, requested);
        prop_assert_eq!(stats.active_rounded_bytes, rounded);
        (peak_requested, peak_rounded) = (peak_requested.max(requested), peak_rounded.max(rounded));
        prop_assert_eq!(stats.peak_active_requested_bytes, peak_requested);
        prop_assert_eq!(stats.peak_active_rounded_bytes, peak_rounded);
        // Every byte the backend handed out is a held or an active block.
        prop_assert_eq!(
            gpu_pool::testing::host_live_bytes(&device),
            Some(stats.held_bytes + stats.active_rounded_bytes)
        );
        prop_assert_eq!(device.stats().driver_alloc_calls, model.misses);
    }
    drop(live);
    cache.free_held().map_err(fail)?;
    prop_assert_eq!(gpu_pool::testing::host_live_bytes(&device), Some(0));
    Ok(())
}

/// A bin's block size: bins of small sizes are the sizes; others keep their top bit and the
/// leading bits, the rest ones.
fn size_of_bin(bin: u64) -> usize {
    let top = bin >> 32;
    if top == 0 {
        return bin as usize;
    }
    let head = (bin & 0xffff_ffff) as usize;
    let shift = top as u32 - gpu_pool::CachingPool::DEFAULT_LEADING_BITS;
    (head << shift) | ((1usize << shift) - 1)
}

// ---- MixMemory --------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum MixOp {
    Cpu(usize),
    Gpu(usize),
    /// Writes a pattern of this seed over the host side.
    Write(u8),
    ToGpu,
    ToCpu,
    ReleaseCpu,
    ReleaseGpu,
}

fn mix_op() -> impl Strategy<Value = MixOp> {
    prop_oneof![
        2 => (0..5000usize).prop_map(MixOp::Cpu),
        2 => (0..5000usize).prop_map(MixOp::Gpu),
        2 => any::<u8>().prop_map(MixOp::Write),
        2 => Just(MixOp::ToGpu),
        2 => Just(MixOp::ToCpu),
        1 => Just(MixOp::ReleaseCpu),
        1 => Just(MixOp::ReleaseGpu),
    ]
}

/// Both sides as plain vectors: their length is the capacity.
#[derive(Default)]
struct MixModel {
    host: Vec<u8>,
    gpu: Vec<u8>,
    reallocations: u64,
}

fn run_mix(ops: Vec<MixOp>) -> Result<(), TestCaseError> {
    let device = Device::private_host();
    let stream = Stream::new(&device).map_err(fail)?;
    let baseline = gpu_pool::testing::host_live_bytes(&device).unwrap_or(0); // none: the stack is lazy
    let mut mix = MixMemory::new(&device).map_err(fail)?;
    let mut model = MixModel::default();

    for op in ops {
        match op {
            MixOp::Cpu(n) => {
                let got = mix.cpu::<u8>(n).map_err(fail)?.len();
                prop_assert_eq!(got, n);
                if model.host.len() < n {
                    model.host = vec![0; n];
                    model.reallocations += 1;
                }
            }
            MixOp::Gpu(n) => {
                mix.gpu::<u8>(n).map_err(fail)?;
                if model.gpu.len() < n {
                    model.gpu = vec![0; n];
                    model.reallocations += 1;
                }
            }
            MixOp::Write(seed) => {
                let n = model.host.len();
                for (i, b) in mix.cpu::<u8>(n).map_err(fail)?.iter_mut().enumerate() {
                    *b = seed.wrapping_add(i as u8);
                }
                for (i, b) in model.host.iter_mut().enumerate() {
                    *b = seed.wrapping_add(i as u8);
                }
            }
            MixOp::ToGpu => {
                mix.copy_to_gpu_async(&stream).map_err(fail)?;
                let n = model.host.len().min(model.gpu.len());
                model.gpu[..n].copy_from_slice(&model.host[..n]);
            }
            MixOp::ToCpu => {
                mix.copy_to_cpu_async(&stream).map_err(fail)?;
                let n = model.host.len().min(model.gpu.len());
                model.host[..n].copy_from_slice(&model.gpu[..n]);
            }
            MixOp::ReleaseCpu => {
                mix.release_cpu().map_err(fail)?;
                model.host.clear();
            }
            MixOp::ReleaseGpu => {
                mix.release_gpu().map_err(fail)?;
                model.gpu.clear();
            }
        }

        prop_assert_eq!(mix.capacity(), (model.host.len(), model.gpu.len()));
        prop_assert_eq!(mix.reallocations(), model.reallocations);
        let (host_len, gpu_len) = (model.host.len(), model.gpu.len());
        prop_assert_eq!(&mix.cpu::<u8>(host_len).map_err(fail)?[..], &model.host[..]);
        let gpu: Vec<u8> = mix
            .gpu_view::<u8>(gpu_len)
            .map_err(fail)?
            .host_rows()
            .map_err(fail)?
            .flatten()
            .copied()
            .collect();
        prop_assert_eq!(&gpu[..], &model.gpu[..]);
        // Every byte handed out is one of the two sides.
        prop_assert_eq!(
            gpu_pool::testing::host_live_bytes(&device),
            Some(baseline + host_len + gpu_len)
        );
    }
    drop(mix);
    prop_assert_eq!(gpu_pool::testing::host_live_bytes(&device), Some(baseline));
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]
    #[test]
    fn caching_pool_matches_its_model(ops in prop::collection::vec(cache_op(), 1..120)) {
        run_cache(ops)?;
    }

    #[test]
    fn mix_memory_matches_its_model(ops in prop::collection::vec(mix_op(), 1..80)) {
        run_mix(ops)?;
    }
}
