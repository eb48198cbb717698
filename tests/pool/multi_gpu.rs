//! Several GPUs: a stack per device, memory that stays on its device, and NCCL collectives on
//! `buffer!` temporaries driven from one thread, eager and captured, with symmetric stacks. Each
//! test says what it skipped where a second GPU or `libnccl` is missing.

use std::error::Error;
use std::time::Duration;

use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::nccl::NcclError;
use gpu_pool::nccl::{Communicators, Reduce};
use gpu_pool::prelude::*;
use gpu_pool::{
    GpuView, GpuViewMut, alloc::CachingPool, compat::mix::MixMemory,
    compat::opencv::set_buffer_pool_config, config::Fallback, config::PoolConfig, interop::cudarc,
    observe::check_symmetric,
};

use crate::common::{GpuLock, gpu, skipped};
use crate::ranks::ranks_support::{RankEnv, launch, publish_id, read_id};

type TestResult = Result<(), Box<dyn Error>>;

const MIB: usize = 1 << 20;

/// CUDA devices 0 and 1 with the GPU lock, reset as the tests assume; `None` (and a line saying
/// what was skipped) with fewer than two.
fn two_gpus(test: &str) -> Option<(Device, Device, GpuLock)> {
    let (gpu0, lock) = gpu(test)?;
    let count = Device::cuda_device_count().unwrap_or(0);
    if count < 2 {
        skipped(&format!(
            "{test}: skipped: {count} CUDA device(s), 2 needed"
        ));
        return None;
    }
    let gpu1 = Device::cuda(1).ok()?;
    gpu1.set_fallback(Fallback::Driver);
    gpu1.set_strict_lifo(false);
    let _ = gpu1.set_growable_stacks(false); // as device 0: fixed unless a test asks
    Some((gpu0, gpu1, lock))
}

/// Whether NCCL loads; says so and skips where it does not.
fn nccl_loads(test: &str) -> bool {
    match gpu_pool::nccl::version() {
        Ok(v) => {
            println!("{test}: NCCL {}.{}.{}", v / 10000, v / 100 % 100, v % 100);
            true
        }
        Err(e) => {
            skipped(&format!("{test}: NCCL part skipped: {e}"));
            false
        }
    }
}

/// Puts both devices back as the next test assumes (device 0's lock resets the rest of it) when
/// it drops: declared before the test's streams, it drops after them.
struct Reset<'a>(&'a Device, &'a Device);

impl Drop for Reset<'_> {
    fn drop(&mut self) {
        for d in [self.0, self.1] {
            d.set_fallback(Fallback::Driver);
            let _ = d.caching_pool().free_held();
            let _ = d.set_pool_config(PoolConfig::default());
            let _ = gpu_pool::nccl::use_driver_memory(d);
        }
    }
}

/// Free and total bytes of `device` as the driver reports them (what NCCL's own allocations would
/// change, which the pool's counters cannot see).
fn free_bytes(device: &Device) -> Result<usize, Box<dyn Error>> {
    let ctx = device.cudarc().expect("CUDA");
    ctx.bind_to_thread()?;
    Ok(cudarc::driver::result::mem_get_info()?.0)
}

#[test]
fn mix_memory_and_the_caching_pool_stay_on_their_own_device() -> TestResult {
    let Some((gpu0, gpu1, _lock)) = two_gpus("multi_gpu_devices") else {
        return Ok(());
    };
    let _reset = Reset(&gpu0, &gpu1);
    // MixMemory of device 1 from a thread where device 0's context is current.
    gpu0.cudarc().expect("CUDA").bind_to_thread()?;
    {
        let s1 = Stream::new(&gpu1)?;
        let mut mix = MixMemory::new(&gpu1)?;
        mix.cpu::<u32>(4096)?.fill(7);
        let _ = mix.gpu::<u32>(4096)?;
        mix.copy_to_gpu_async(&s1)?;
        mix.cpu::<u32>(4096)?.fill(0);
        mix.copy_to_cpu_async(&s1)?;
        mix.synchronize()?;
        assert!(mix.cpu::<u32>(4096)?.iter().all(|&v| v == 7));
        assert_eq!(
            cudarc::driver::result::ctx::get_current()?,
            Some(gpu0.cudarc().expect("CUDA").cu_ctx()),
            "the caller's context is current again"
        );
    }

    // The caching pools: a block freed on device 0 is never handed to device 1.
    gpu0.set_fallback(Fallback::Caching);
    gpu1.set_fallback(Fallback::Caching);
    set_buffer_pool_config(&gpu0, MIB, 1)?;
    set_buffer_pool_config(&gpu1, MIB, 1)?;
    let s0 = Stream::new(&gpu0)?;
    let s1 = Stream::new(&gpu1)?;
    let (pool0, pool1): (std::sync::Arc<CachingPool>, _) =
        (gpu0.caching_pool(), gpu1.caching_pool());
    let cached = |p: &CachingPool| p.stats();
    let big = 4 * MIB; // past the 1 MiB stacks: served by the caching pools
    {
        let mut a = BufferPool::new(&s0).get_buffer_1d::<u8>(big)?;
        a.set_to(1)?;
        assert!(matches!(a.source(), Source::Fallback(_)));
        s0.synchronize()?;
    }
    let before1 = cached(&pool1);
    let mut b = BufferPool::new(&s1).get_buffer_1d::<u8>(big)?;
    b.set_to(2)?;
    assert!(b.to_vec()?.iter().all(|&v| v == 2));
    let after1 = cached(&pool1);
    println!(
        "multi_gpu_devices: device 0 caching {:?}; device 1 before {before1:?} after {after1:?}",
        cached(&pool0)
    );
    assert!(
        after1.misses > before1.misses,
        "device 1 allocated its own block rather than reusing device 0's"
    );
    let mut a = BufferPool::new(&s0).get_buffer_1d::<u8>(big)?;
    a.set_to(3)?;
    assert!(a.to_vec()?.iter().all(|&v| v == 3));
    assert!(
        b.to_vec()?.iter().all(|&v| v == 2),
        "device 1's block is its own"
    );
    println!(
        "multi_gpu_devices: MixMemory on cuda:1 from a thread bound to cuda:0; caching pools kept apart"
    );
    Ok(())
}

/// One step of data-parallel training on two ranks, every buffer a `buffer!` temporary of its
/// rank's stream: each rank fills its gradient (rank r with r + 1), the gradients are summed on
/// both ranks (all-reduce), and rank 1 sends its gradient to rank 0. `sums[r]` gets rank r's sum,
/// `got` what rank 0 received.
fn step(
    ranks: &Communicators<'_>,
    (s0, s1): (&Stream, &Stream),
    n: usize,
    sums: &mut [GpuMat<'_, f32>; 2],
    got: &mut GpuMat<'_, f32>,
) -> Result<(), PoolError> {
    gpu_scope!(s0, {
        let mut g0 = buffer!(n; f32)?;
        let mut r0 = buffer!(n; f32)?;
        let mut t0 = buffer!(n; f32)?;
        gpu_scope!(s1, {
            let mut g1 = buffer!(n; f32)?;
            let mut r1 = buffer!(n; f32)?;
            let _t1 = buffer!(n; f32)?; // rank 1's twin of t0: the stacks stay symmetric
            g0.set_to(1.0)?;
            g1.set_to(2.0)?;
            ranks.group(|g| {
                g.all_reduce(0, &g0, &mut r0, Reduce::Sum)?;
                g.all_reduce(1, &g1, &mut r1, Reduce::Sum)?;
                g.send(1, &g1, 0)?;
                g.recv(0, &mut t0, 1)
            })?;
            let [sum0, sum1] = sums;
            sum0.copy_from(&r0)?;
            sum1.copy_from(&r1)?;
            got.copy_from(&t0)?;
        });
    });
    Ok(())
}

/// A type whose read view is one thing and writable view another: an NCCL write must go where
/// the writable view lends, never through the read view.
#[derive(gpu_pool::GraphKey)]
struct Sneaky<'v, 'm>(GpuView<'v, f32>, GpuMat<'m, f32>);

impl GpuRead<f32> for Sneaky<'_, '_> {
    fn view(&self) -> GpuView<'_, f32> {
        self.0
    }

    fn addr_ref(&self) -> &u64 {
        self.0.addr_ref()
    }
}

impl GpuWrite<f32> for Sneaky<'_, '_> {
    fn view_mut(&mut self) -> GpuViewMut<'_, f32> {
        self.1.view_mut()
    }

    fn addr_mut(&mut self) -> &u64 {
        self.1.addr_ref()
    }
}

/// Elements of `m` that are not `want`.
fn wrong(m: &GpuMat<'_, f32>, want: f32) -> Result<usize, PoolError> {
    Ok(m.to_vec()?.iter().filter(|&&v| v != want).count())
}

#[test]
fn nccl_all_reduce_and_send_recv_on_buffer_temporaries_eager_and_captured() -> TestResult {
    let Some((gpu0, gpu1, _lock)) = two_gpus("multi_gpu_nccl") else {
        return Ok(());
    };
    let _reset = Reset(&gpu0, &gpu1);
    if !nccl_loads("multi_gpu_nccl") {
        return Ok(());
    }
    for d in [&gpu0, &gpu1] {
        // Three 4 MiB temporaries a rank: stacks that hold them, so no step falls back.
        set_buffer_pool_config(d, 16 * MIB, 2)?;
    }
    let (s0, s1) = (Stream::new(&gpu0)?, Stream::new(&gpu1)?);
    let ranks = Communicators::new(&[&s0, &s1])?;
    let n = (4 * MIB) / 4 + 3; // 4 MiB and a ragged tail
    let mut sums = [
        GpuMat::<f32>::new(&s0, 1, n)?,
        GpuMat::<f32>::new(&s1, 1, n)?,
    ];
    let mut got = GpuMat::<f32>::new(&s0, 1, n)?;

    // Eager: the first step warms NCCL up (its connections); later steps allocate nothing.
    step(&ranks, (&s0, &s1), n, &mut sums, &mut got)?;
    let calls = |d: &Device| d.stats().driver_alloc_calls;
    let (c0, c1) = (calls(&gpu0), calls(&gpu1));
    let (f0, f1) = (free_bytes(&gpu0)?, free_bytes(&gpu1)?);
    const STEPS: usize = 20;
    for _ in 0..STEPS {
        step(&ranks, (&s0, &s1), n, &mut sums, &mut got)?;
    }
    let eager_wrong = (
        wrong(&sums[0], 3.0)?,
        wrong(&sums[1], 3.0)?,
        wrong(&got, 2.0)?,
    );
    let eager_calls = (calls(&gpu0) - c0, calls(&gpu1) - c1);
    let eager_free = (
        f0 as i64 - free_bytes(&gpu0)? as i64,
        f1 as i64 - free_bytes(&gpu1)? as i64,
    );
    println!(
        "multi_gpu_nccl: eager, {STEPS} steps of {n} f32: wrong (sum0, sum1, received) = \
         {eager_wrong:?}; pool driver allocations after the first step (cuda:0, cuda:1) = \
         {eager_calls:?}; device bytes taken meanwhile (driver's count) = {eager_free:?}"
    );
    assert_eq!(eager_wrong, (0, 0, 0));
    assert_eq!(eager_calls, (0, 0));
    check_symmetric(&[&s0, &s1])?;
    let traces = (s0.layout_trace(), s1.layout_trace());
    println!("multi_gpu_nccl: layout traces {traces:?}");

    // Captured: each rank's part into its own stream's graph, replayed side by side.
    for m in sums.iter_mut().chain([&mut got]) {
        m.set_to(0.0)?;
    }
    s0.synchronize()?;
    s1.synchronize()?;
    {
        // A graph per rank, replayed together.
        let graphs = ranks.capture(|| step(&ranks, (&s0, &s1), n, &mut sums, &mut got))?;
        let (c0, c1) = (calls(&gpu0), calls(&gpu1));
        for _ in 0..STEPS {
            graphs.launch()?;
        }
        s0.synchronize()?;
        s1.synchronize()?;
        let replay_calls = (calls(&gpu0) - c0, calls(&gpu1) - c1);
        println!(
            "multi_gpu_nccl: captured, {STEPS} replays: pool driver allocations (cuda:0, cuda:1) \
             = {replay_calls:?}; graph nodes {:?}",
            graphs.nodes()?
        );
        assert_eq!(replay_calls, (0, 0));
    }
    let captured_wrong = (
        wrong(&sums[0], 3.0)?,
        wrong(&sums[1], 3.0)?,
        wrong(&got, 2.0)?,
    );
    println!("multi_gpu_nccl: captured: wrong (sum0, sum1, received) = {captured_wrong:?}");
    assert_eq!(captured_wrong, (0, 0, 0));
    Ok(())
}

#[test]
fn an_nccl_group_that_would_hang_or_overrun_is_refused_before_nccl_sees_it() -> TestResult {
    let Some((gpu0, gpu1, _lock)) = two_gpus("multi_gpu_nccl_refusals") else {
        return Ok(());
    };
    let _reset = Reset(&gpu0, &gpu1);
    if !nccl_loads("multi_gpu_nccl_refusals") {
        return Ok(());
    }
    let (s0, s1) = (Stream::new(&gpu0)?, Stream::new(&gpu1)?);
    let ranks = Communicators::new(&[&s0, &s1])?;
    let (p0, p1) = (BufferPool::new(&s0), BufferPool::new(&s1));
    let mut a0 = p0.get_buffer_1d::<f32>(1000)?;
    let mut a1 = p1.get_buffer_1d::<f32>(1000)?;
    let mut short1 = p1.get_buffer_1d::<f32>(999)?;
    let mut short0 = p0.get_buffer_1d::<f32>(999)?;
    let mut b1_early = p1.get_buffer_1d::<f32>(1000)?;
    b1_early.set_to(5.0)?;
    a0.set_to(5.0)?;
    // Rank 1 makes no collective: NCCL would wait for it forever.
    let lone = ranks.group(|g| g.all_reduce_in_place(0, &mut a0, Reduce::Sum));
    assert!(
        matches!(lone, Err(PoolError::Nccl(NcclError::Group { .. }))),
        "{lone:?}"
    );
    // Counts that differ: rank 1 would reduce 999 elements against rank 0's 1000.
    let counts = ranks.group(|g| {
        g.all_reduce_in_place(0, &mut a0, Reduce::Sum)?;
        g.all_reduce_in_place(1, &mut short1, Reduce::Sum)
    });
    assert!(
        matches!(counts, Err(PoolError::Nccl(NcclError::Group { .. }))),
        "{counts:?}"
    );
    // A receive shorter than the send: NCCL would write past it or hang.
    let p2p = ranks.group(|g| {
        g.send(0, &a0, 1)?;
        g.recv(1, &mut short1, 0)
    });
    assert!(
        matches!(p2p, Err(PoolError::Nccl(NcclError::Group { .. }))),
        "{p2p:?}"
    );
    // A buffer of rank 1's stream handed to rank 0.
    let stray = ranks.group(|g| g.all_reduce_in_place(0, &mut a1, Reduce::Sum));
    assert!(
        matches!(stray, Err(PoolError::Unsupported { .. })),
        "{stray:?}"
    );
    // A rank that does not exist, and a peer that does not.
    let no_rank = ranks.group(|g| g.send(2, &a0, 1));
    assert!(
        matches!(no_rank, Err(PoolError::Nccl(NcclError::Group { .. }))),
        "{no_rank:?}"
    );
    let no_peer = ranks.group(|g| g.send(0, &a0, 5));
    assert!(
        matches!(no_peer, Err(PoolError::Nccl(NcclError::Group { .. }))),
        "{no_peer:?}"
    );
    // All-reduce into a buffer of another length.
    let shapes = ranks.group(|g| g.all_reduce(0, &a0, &mut short0, Reduce::Sum));
    assert!(
        matches!(shapes, Err(PoolError::ShapeMismatch { .. })),
        "{shapes:?}"
    );
    // Nothing above was queued: a correct group still works, and a0 kept its 5.0.
    let mut b1 = p1.get_buffer_1d::<f32>(1000)?;
    b1.set_to(1.0)?;
    ranks.group(|g| {
        g.all_reduce_in_place(0, &mut a0, Reduce::Max)?;
        g.all_reduce_in_place(1, &mut b1, Reduce::Max)
    })?;
    assert!(a0.to_vec()?.iter().all(|&v| v == 5.0));
    assert!(b1.to_vec()?.iter().all(|&v| v == 5.0));
    // A padded 2D buffer would hand NCCL its padding as elements.
    let mut padded0 = p0.get_buffer::<f32>(4, 100)?;
    let padded = ranks.group(|g| g.all_reduce_in_place(0, &mut padded0, Reduce::Sum));
    assert!(
        matches!(padded, Err(PoolError::NotContinuous { .. })),
        "{padded:?}"
    );
    // Two groups swapped: each was checked for the other's communicators.
    let (t0, t1) = (Stream::new(&gpu0)?, Stream::new(&gpu1)?);
    let other = Communicators::new(&[&t0, &t1])?;
    let (mut c0, mut c1) = (
        BufferPool::new(&t0).get_buffer_1d::<f32>(1000)?,
        BufferPool::new(&t1).get_buffer_1d::<f32>(1000)?,
    );
    let swapped = ranks.group(|ga| {
        other.group(|gb| {
            gb.all_reduce_in_place(0, &mut c0, Reduce::Sum)?;
            gb.all_reduce_in_place(1, &mut c1, Reduce::Sum)?;
            std::mem::swap(ga, gb);
            Ok(())
        })
    });
    assert!(
        matches!(swapped, Err(PoolError::Nccl(NcclError::Group { .. }))),
        "{swapped:?}"
    );
    // A group inside a capture of one rank's stream only (not Communicators::capture): its graph
    // would replay out of step with the other rank.
    let lone_capture = s0.capture(|_| {
        ranks.group(|g| {
            g.all_reduce_in_place(0, &mut a0, Reduce::Sum)?;
            g.all_reduce_in_place(1, &mut b1_early, Reduce::Sum)
        })
    });
    assert!(
        matches!(lone_capture, Err(PoolError::Nccl(NcclError::Group { .. }))),
        "{lone_capture:?}"
    );
    drop(lone_capture);
    // A write through a type whose read view is someone else's memory: NCCL writes only what
    // the writable view lends.
    let shared = SharedMat::<f32>::from_host(&s0, 1, 1000, &vec![4.0; 1000])?;
    {
        let guard = shared.read(&s0)?;
        let mut dummy = p0.get_buffer_1d::<f32>(1000)?;
        dummy.set_to(0.5)?;
        let mut sneaky = Sneaky(guard.view(), dummy);
        ranks.group(|g| {
            g.all_reduce_in_place(0, &mut sneaky, Reduce::Max)?;
            g.all_reduce_in_place(1, &mut b1_early, Reduce::Max)
        })?;
        assert!(
            sneaky.1.to_vec()?.iter().all(|&v| v == 5.0),
            "the writable view got the result"
        );
    }
    assert!(
        shared.read(&s0)?.to_vec()?.iter().all(|&v| v == 4.0),
        "the read-only memory is untouched"
    );
    // Growable stacks cannot be registered (their memory is not NCCL's, and it moves in and out).
    {
        gpu0.set_growable_stacks(true)?;
        gpu1.set_growable_stacks(true)?;
        let (u0, u1) = (Stream::new(&gpu0)?, Stream::new(&gpu1)?);
        gpu0.set_growable_stacks(false)?;
        gpu1.set_growable_stacks(false)?;
        drop((
            BufferPool::new(&u0).get_buffer_1d::<u8>(10)?,
            BufferPool::new(&u1).get_buffer_1d::<u8>(10)?,
        ));
        let growing = Communicators::new(&[&u0, &u1])?;
        let refused = growing.register_stacks(false);
        assert!(
            matches!(refused, Err(PoolError::Unsupported { .. })),
            "{refused:?}"
        );
    }
    // Two ranks on one GPU are refused before NCCL.
    let s0b = Stream::new(&gpu0)?;
    let twice = Communicators::new(&[&s0, &s0b]);
    assert!(
        matches!(twice, Err(PoolError::Unsupported { .. })),
        "{twice:?}"
    );
    println!(
        "multi_gpu_nccl_refusals: 11 bad groups and a growable registration refused, nothing queued, good ones after"
    );
    Ok(())
}

#[test]
fn stacks_in_nccl_memory_register_as_a_window_and_stay_put_while_registered() -> TestResult {
    let Some((gpu0, gpu1, _lock)) = two_gpus("multi_gpu_nccl_memory") else {
        return Ok(());
    };
    let _reset = Reset(&gpu0, &gpu1);
    if !nccl_loads("multi_gpu_nccl_memory") {
        return Ok(());
    }
    for d in [&gpu0, &gpu1] {
        set_buffer_pool_config(d, 64 * MIB, 2)?;
        gpu_pool::nccl::use_nccl_memory(d)?;
    }
    {
        let (s0, s1) = (Stream::new(&gpu0)?, Stream::new(&gpu1)?);
        let ranks = Communicators::new(&[&s0, &s1])?;
        let n = 8 * MIB / 4;
        let mut sums = [
            GpuMat::<f32>::new(&s0, 1, n)?,
            GpuMat::<f32>::new(&s1, 1, n)?,
        ];
        let mut got = GpuMat::<f32>::new(&s0, 1, n)?;
        for as_window in [false, true] {
            let registered = ranks.register_stacks(as_window)?;
            // A second registration at once would let the first's drop lift the second's checks.
            let twice = ranks.register_stacks(!as_window);
            assert!(
                matches!(twice, Err(PoolError::Unsupported { .. })),
                "{twice:?}"
            );
            drop(twice);
            // Registered memory cannot be freed or replaced under NCCL.
            assert!(matches!(
                gpu0.set_pool_config(PoolConfig::default()),
                Err(PoolError::StackMemoryRegistered { .. } | PoolError::ConfigInUse { .. })
            ));
            for _ in 0..3 {
                step(&ranks, (&s0, &s1), n, &mut sums, &mut got)?;
            }
            let w = (
                wrong(&sums[0], 3.0)?,
                wrong(&sums[1], 3.0)?,
                wrong(&got, 2.0)?,
            );
            println!(
                "multi_gpu_nccl_memory: registered as {}: wrong = {w:?}",
                if registered.is_window() {
                    "a window"
                } else {
                    "buffers"
                }
            );
            assert_eq!(w, (0, 0, 0));
            check_symmetric(&[&s0, &s1])?;
            drop(registered);
        }
    }
    for d in [&gpu0, &gpu1] {
        assert!(
            d.release_stack_memory()? > 0,
            "unregistered: the memory goes back"
        );
        gpu_pool::nccl::use_driver_memory(d)?;
    }
    Ok(())
}

/// Puts a shared GPU device back on driver memory and the default config when a one-rank test
/// ends, however it ends.
struct DriverMemoryBack<'a>(&'a Device);

impl Drop for DriverMemoryBack<'_> {
    fn drop(&mut self) {
        let _ = gpu_pool::nccl::use_driver_memory(self.0);
        let _ = self.0.set_pool_config(PoolConfig::default());
    }
}

/// What one GPU can show of NCCL: a communicator of one rank, its groups, registrations and the
/// refusals that need no peer.
#[test]
fn one_rank_on_one_gpu_registers_once_and_never_a_growable_stack() -> TestResult {
    let Some((gpu0, _lock)) = gpu("one_rank_nccl") else {
        return Ok(());
    };
    if !nccl_loads("one_rank_nccl") {
        return Ok(());
    }
    let _back = DriverMemoryBack(&gpu0);
    // A growable stack is refused.
    {
        gpu0.set_growable_stacks(true)?;
        let s = Stream::new(&gpu0)?;
        gpu0.set_growable_stacks(false)?;
        drop(BufferPool::new(&s).get_buffer_1d::<u8>(10)?);
        let rank = Communicators::new(&[&s])?;
        let refused = rank.register_stacks(false);
        assert!(
            matches!(refused, Err(PoolError::Unsupported { .. })),
            "{refused:?}"
        );
    }
    // NCCL memory: fixed stacks, registered once at a time, a group of one rank works.
    set_buffer_pool_config(&gpu0, 16 * MIB, 1)?;
    gpu_pool::nccl::use_nccl_memory(&gpu0)?;
    assert!(!gpu0.growable_stacks());
    let s = Stream::new(&gpu0)?;
    let rank = Communicators::new(&[&s])?;
    let mut x = BufferPool::new(&s).get_buffer_1d::<f32>(4096)?;
    x.set_to(2.5)?;
    for as_window in [false, true] {
        let registered = rank.register_stacks(as_window)?;
        let twice = rank.register_stacks(!as_window);
        assert!(
            matches!(twice, Err(PoolError::Unsupported { .. })),
            "{twice:?}"
        );
        drop(twice);
        let captured = rank.capture(|| Ok(()));
        assert!(
            matches!(captured, Err(PoolError::Unsupported { .. })),
            "{captured:?}"
        );
        drop(captured);
        rank.group(|g| g.all_reduce_in_place(0, &mut x, Reduce::Sum))?;
        drop(registered);
    }
    assert!(x.to_vec()?.iter().all(|&v| v == 2.5), "a sum over one rank");
    println!(
        "one_rank_nccl: one rank on cuda:0: registered as buffers and as a window, once at a time; a growable stack refused"
    );
    Ok(())
}

/// A panic inside `Communicators::capture` leaves the communicators as they were: the same capture
/// works right after, and so does a registration (the flag the capture sets was left set before,
/// refusing both for good). One rank is enough: the flag is the communicators'.
#[test]
fn a_panic_inside_an_nccl_capture_leaves_captures_and_registrations_working() -> TestResult {
    let Some((gpu0, _lock)) = gpu("nccl_capture_panic") else {
        return Ok(());
    };
    if !nccl_loads("nccl_capture_panic") {
        return Ok(());
    }
    let _back = DriverMemoryBack(&gpu0);
    set_buffer_pool_config(&gpu0, 16 * MIB, 1)?;
    gpu_pool::nccl::use_nccl_memory(&gpu0)?;
    let s = Stream::new(&gpu0)?;
    let rank = Communicators::new(&[&s])?;
    let mut x = BufferPool::new(&s).get_buffer_1d::<f32>(4096)?;
    x.set_to(2.5)?;
    rank.group(|g| g.all_reduce_in_place(0, &mut x, Reduce::Sum))?; // NCCL connects on first use

    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = rank.capture(|| panic!("a training step went wrong"));
    }));
    assert!(panicked.is_err());
    let status = s.cudarc().expect("CUDA").capture_status()?;
    assert_eq!(
        status,
        cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        "the panic ended the driver's capture"
    );

    let captured = rank
        .capture(|| rank.group(|g| g.all_reduce_in_place(0, &mut x, Reduce::Sum)))
        .map(|graphs| graphs.launch());
    println!("nccl_capture_panic: the capture after the panic, then its replay: {captured:?}");
    captured??;
    s.synchronize()?;
    let registered = rank.register_stacks(false);
    println!(
        "nccl_capture_panic: a registration after the panic: {:?}",
        registered.as_ref().map(|r| r.is_window())
    );
    drop(registered?);
    assert!(x.to_vec()?.iter().all(|&v| v == 2.5), "a sum over one rank");
    Ok(())
}

/// One rank's step when every rank is a process of its own: its gradient (rank r fills it with
/// r + 1) is summed over both ranks into `sum`, and rank 1 sends rank 0 its gradient, which lands
/// in `got` on rank 0. Both ranks take the same three temporaries: the stacks stay symmetric.
fn rank_step(
    ranks: &Communicators<'_>,
    s: &Stream,
    r: usize,
    n: usize,
    sum: &mut GpuMat<'_, f32>,
    got: &mut GpuMat<'_, f32>,
) -> Result<(), PoolError> {
    gpu_scope!(s, {
        let mut grad = buffer!(n; f32)?;
        let mut reduced = buffer!(n; f32)?;
        let mut received = buffer!(n; f32)?;
        grad.set_to((r + 1) as f32)?;
        ranks.group(|g| {
            g.all_reduce(r, &grad, &mut reduced, Reduce::Sum)?;
            if r == 1 {
                g.send(1, &grad, 0)
            } else {
                g.recv(0, &mut received, 1)
            }
        })?;
        sum.copy_from(&reduced)?;
        if r == 0 {
            got.copy_from(&received)?;
        }
    });
    Ok(())
}

/// Elements of `sum` that are not 3 and of `got` (rank 0's) that are not 2.
fn rank_wrong(
    r: usize,
    sum: &GpuMat<'_, f32>,
    got: &GpuMat<'_, f32>,
) -> Result<(usize, usize), PoolError> {
    Ok((wrong(sum, 3.0)?, if r == 0 { wrong(got, 2.0)? } else { 0 }))
}

/// The body of each rank process of the test below; nothing in an ordinary run (only a process
/// started with the rank variables is a rank). Rank r works on cuda:r.
#[test]
fn nccl_two_process_rank() -> TestResult {
    let Some(env) = RankEnv::from_env()? else {
        return Ok(());
    };
    let r = env.rank;
    let id = if r == 0 {
        let id = gpu_pool::nccl::UniqueId::new()?;
        publish_id(&env.id_file, &id)?;
        id
    } else {
        read_id(&env.id_file, Duration::from_secs(60))?
    };
    let gpu = Device::cuda(r)?;
    gpu.set_fallback(Fallback::Driver);
    gpu.set_growable_stacks(false)?;
    set_buffer_pool_config(&gpu, 64 * MIB, 2)?;
    gpu_pool::nccl::use_nccl_memory(&gpu)?; // for the window below
    let s = Stream::new(&gpu)?;
    let n = (4 * MIB) / 4 + 3; // 4 MiB and a ragged tail
    // Before the communicator, which then drops (and aborts on a timeout) before their frees,
    // which wait for the device.
    let mut sum = GpuMat::<f32>::new(&s, 1, n)?;
    let mut got = GpuMat::<f32>::new(&s, 1, n)?;
    let ranks = Communicators::from_rank(&s, &id, r, env.world, Duration::from_secs(60))?;
    println!(
        "rank {r}: communicator of {} made on {}: {ranks:?}",
        env.world,
        gpu.id()
    );
    let calls = || gpu.stats().driver_alloc_calls;

    // Eager. The first step connects NCCL, its group checked against the other rank's.
    ranks.set_verify_groups(true);
    rank_step(&ranks, &s, r, n, &mut sum, &mut got)?;
    ranks.set_verify_groups(false);
    ranks.wait()?;
    let before = calls();
    const STEPS: usize = 20;
    for _ in 0..STEPS {
        rank_step(&ranks, &s, r, n, &mut sum, &mut got)?;
    }
    ranks.wait()?;
    let eager = (rank_wrong(r, &sum, &got)?, calls() - before);
    println!(
        "rank {r}: eager, {STEPS} steps of {n} f32: wrong (sum, received) = {:?}; driver \
         allocations after the first step = {}",
        eager.0, eager.1
    );
    assert_eq!(eager, ((0, 0), 0));
    ranks.check_symmetric()?;
    println!(
        "rank {r}: stacks symmetric across the processes: {:?}",
        s.layout_trace()
    );

    // Captured: this rank's graph, replayed as often as the other rank replays its own.
    sum.set_to(0.0)?;
    got.set_to(0.0)?;
    {
        let graphs = ranks.capture(|| rank_step(&ranks, &s, r, n, &mut sum, &mut got))?;
        let before = calls();
        for _ in 0..STEPS {
            graphs.launch()?;
        }
        ranks.wait()?;
        let replays = calls() - before;
        println!(
            "rank {r}: captured, {STEPS} replays: driver allocations = {replays}; graph {:?}",
            graphs.nodes()?
        );
        assert_eq!(replays, 0);
    }
    let captured = rank_wrong(r, &sum, &got)?;
    println!("rank {r}: captured: wrong (sum, received) = {captured:?}");
    assert_eq!(captured, (0, 0));

    // The stacks registered as buffers, then as a symmetric window.
    for as_window in [false, true] {
        let registered = ranks.register_stacks(as_window)?;
        for _ in 0..3 {
            rank_step(&ranks, &s, r, n, &mut sum, &mut got)?;
        }
        ranks.wait()?;
        let w = rank_wrong(r, &sum, &got)?;
        println!("rank {r}: registered (window: {as_window}): wrong = {w:?}");
        assert_eq!(w, (0, 0));
        ranks.check_symmetric()?;
        drop(registered);
    }

    // Registered as a window, groups are checked across the processes without set_verify_groups:
    // counts that differ would otherwise have NCCL's symmetric kernels reach other buffers of the
    // peer's stack. Refused on both ranks; a good group works after.
    {
        let window = ranks.register_stacks(true)?;
        let pool = BufferPool::new(&s);
        let mut t = pool.get_buffer_1d::<f32>(if r == 0 { 1000 } else { 999 })?;
        t.set_to(1.0)?;
        let counts = ranks.group(|g| g.all_reduce_in_place(r, &mut t, Reduce::Sum));
        println!("rank {r}: window, no set_verify_groups, counts 1000 against 999: {counts:?}");
        assert!(
            matches!(counts, Err(PoolError::Nccl(NcclError::Group { .. }))),
            "{counts:?}"
        );
        let mut u = pool.get_buffer_1d::<f32>(1000)?;
        u.set_to((r + 1) as f32)?;
        ranks.group(|g| g.all_reduce_in_place(r, &mut u, Reduce::Sum))?;
        ranks.wait()?;
        let good = u.to_vec()?.iter().filter(|&&v| v != 3.0).count();
        println!("rank {r}: window: the good group after: {good} wrong");
        assert_eq!(good, 0);
        assert!(
            t.to_vec()?.iter().all(|&v| v == 1.0),
            "the refused group queued nothing"
        );
        drop((u, t));
        drop(window);
    }

    // Verified groups: counts that differ across the processes are refused on both ranks, and
    // so is a group one rank refuses itself; nothing is queued, and a good group works after.
    ranks.set_verify_groups(true);
    let pool = BufferPool::new(&s);
    let mut a = pool.get_buffer_1d::<f32>(if r == 0 { 1000 } else { 999 })?;
    a.set_to(1.0)?;
    let counts = ranks.group(|g| g.all_reduce_in_place(r, &mut a, Reduce::Sum));
    println!("rank {r}: counts 1000 against 999: {counts:?}");
    assert!(
        matches!(counts, Err(PoolError::Nccl(NcclError::Group { .. }))),
        "{counts:?}"
    );
    let mut b = pool.get_buffer_1d::<f32>(1000)?;
    b.set_to((r + 1) as f32)?;
    let lone = ranks.group(|g| {
        if r == 1 {
            g.send(1, &b, 5) // no rank 5: refused here, and so on rank 0
        } else {
            g.recv(0, &mut b, 1)
        }
    });
    println!("rank {r}: a group rank 1 refused: {lone:?}");
    assert!(
        matches!(lone, Err(PoolError::Nccl(NcclError::Group { .. }))),
        "{lone:?}"
    );
    ranks.group(|g| g.all_reduce_in_place(r, &mut b, Reduce::Max))?;
    ranks.wait()?;
    assert!(
        b.to_vec()?.iter().all(|&v| v == 2.0),
        "the good group after"
    );
    assert!(
        a.to_vec()?.iter().all(|&v| v == 1.0),
        "the refused group queued nothing"
    );
    ranks.set_verify_groups(false);
    drop((b, a));

    // A collective rank 1 never makes: rank 0's wait gives up at the timeout, aborts, and the
    // communicator refuses every call from then on.
    ranks.set_timeout(Duration::from_secs(5));
    if r == 0 {
        let mut x = pool.get_buffer_1d::<f32>(1000)?;
        ranks.group(|g| g.all_reduce_in_place(0, &mut x, Reduce::Sum))?;
        let start = std::time::Instant::now();
        let waited = ranks.wait();
        println!(
            "rank 0: a collective without its peer: {waited:?} after {:?}",
            start.elapsed()
        );
        assert!(
            matches!(waited, Err(PoolError::Nccl(NcclError::Timeout { .. }))),
            "{waited:?}"
        );
        let after = ranks.group(|g| g.all_reduce_in_place(0, &mut x, Reduce::Sum));
        assert!(
            matches!(after, Err(PoolError::Nccl(NcclError::Group { .. }))),
            "{after:?}"
        );
        s.synchronize()?; // the abort ended the kernel: the stream drains
    }
    println!("rank {r}: done");
    Ok(())
}

/// The body of each rank process of the window-size test below; nothing in an ordinary run.
/// Rank r's stack is 64 + r MiB: a window is refused on both ranks before NCCL registers it,
/// buffers (whose sizes may differ) are registered.
#[test]
fn nccl_window_size_rank() -> TestResult {
    let Some(env) = RankEnv::from_env()? else {
        return Ok(());
    };
    let r = env.rank;
    let id = if r == 0 {
        let id = gpu_pool::nccl::UniqueId::new()?;
        publish_id(&env.id_file, &id)?;
        id
    } else {
        read_id(&env.id_file, Duration::from_secs(60))?
    };
    let gpu = Device::cuda(r)?;
    gpu.set_fallback(Fallback::Driver);
    gpu.set_growable_stacks(false)?;
    set_buffer_pool_config(&gpu, (64 + r) * MIB, 1)?;
    gpu_pool::nccl::use_nccl_memory(&gpu)?;
    let s = Stream::new(&gpu)?;
    let mut x = BufferPool::new(&s).get_buffer_1d::<f32>(1000)?; // the stack exists
    let ranks = Communicators::from_rank(&s, &id, r, env.world, Duration::from_secs(60))?;
    let window = ranks.register_stacks(true);
    println!("rank {r}: a window over {} MiB: {window:?}", 64 + r);
    assert!(
        matches!(&window, Err(PoolError::InvalidConfig { reason }) if reason.contains("same stack memory size")),
        "{window:?}"
    );
    drop(window);
    let buffers = ranks.register_stacks(false)?;
    x.set_to((r + 1) as f32)?;
    ranks.group(|g| g.all_reduce_in_place(r, &mut x, Reduce::Sum))?;
    ranks.wait()?;
    let wrong = x.to_vec()?.iter().filter(|&&v| v != 3.0).count();
    println!("rank {r}: registered as buffers of differing sizes: all-reduce wrong = {wrong}");
    assert_eq!(wrong, 0);
    drop(buffers);
    println!("rank {r}: done");
    Ok(())
}

#[test]
fn nccl_a_window_of_differing_sizes_across_processes_is_refused_on_every_rank() -> TestResult {
    if RankEnv::from_env()?.is_some() {
        return Ok(());
    }
    let Some((gpu0, gpu1, _lock)) = two_gpus("multi_gpu_window_sizes") else {
        return Ok(());
    };
    let _reset = Reset(&gpu0, &gpu1);
    if !nccl_loads("multi_gpu_window_sizes") {
        return Ok(());
    }
    let args = [
        "multi_gpu::nccl_window_size_rank",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ];
    let runs = launch(2, &args, Duration::from_secs(300))?;
    for run in &runs {
        println!(
            "multi_gpu_window_sizes: rank {} ({}):\n{}",
            run.rank, run.status, run.output
        );
    }
    for run in &runs {
        assert!(run.ok, "rank {} failed: {}", run.rank, run.status);
        assert!(run.output.contains(&format!("rank {}: done", run.rank)));
    }
    Ok(())
}

#[test]
fn nccl_ranks_in_two_processes_reduce_send_capture_register_verify_and_time_out() -> TestResult {
    if RankEnv::from_env()?.is_some() {
        return Ok(()); // a rank process: no launching from there
    }
    let Some((gpu0, gpu1, _lock)) = two_gpus("multi_gpu_ranks") else {
        return Ok(());
    };
    let _reset = Reset(&gpu0, &gpu1);
    if !nccl_loads("multi_gpu_ranks") {
        return Ok(());
    }
    let args = [
        "multi_gpu::nccl_two_process_rank",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ];
    let runs = launch(2, &args, Duration::from_secs(300))?;
    for run in &runs {
        println!(
            "multi_gpu_ranks: rank {} ({}):\n{}",
            run.rank, run.status, run.output
        );
    }
    for run in &runs {
        assert!(run.ok, "rank {} failed: {}", run.rank, run.status);
        assert!(run.output.contains(&format!("rank {}: done", run.rank)));
    }
    Ok(())
}
