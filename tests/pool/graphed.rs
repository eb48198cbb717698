//! Graphs by shape (`#[pooled(stream, graph)]`): on the host backend every call runs eagerly with
//! the same results and its reason counted; on a GPU a key's first call is captured, later calls
//! replay, every shape shares one scratch, and what cannot be captured runs eagerly.

use gpu_pool::graph::{GraphKey, GraphKeys, shape_stats};
use gpu_pool::prelude::*;

/// `y = x * 2 + 1`, written with host-side fills so it runs on every backend.
#[pooled(stream, graph)]
fn twice_plus_one<'s>(
    stream: &'s Stream,
    x: &Temp<'_, f32>,
    rows: usize,
) -> Result<Temp<'s, f32>, PoolError> {
    let mut y = stream.temp::<f32>(rows, x.cols())?;
    let mut tmp = buffer!(rows, x.cols(); f32)?;
    tmp.copy_from(x)?;
    y.copy_from(&tmp)?;
    Ok(y)
}

#[derive(GraphKey)]
struct Filler<'s> {
    stream: &'s Stream,
    value: u8,
}

impl Filler<'_> {
    #[pooled(self.stream, graph(cap = 2))]
    fn fill(&self, out: &mut Temp<'_, u8>) -> Result<(), PoolError> {
        let mut tmp = buffer!(out.rows(), out.cols(); u8)?;
        tmp.set_to(self.value)?;
        out.copy_from(&tmp)
    }
}

#[test]
fn on_the_host_backend_a_graphed_function_runs_eagerly_with_the_same_results()
-> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let mut x = stream.temp::<f32>(3, 5)?;
    x.upload(&[1.5; 15])?;
    for _ in 0..3 {
        let y = twice_plus_one(&stream, &x, 3)?;
        assert_eq!(y.to_vec()?, vec![1.5; 15]);
    }
    let stats = shape_stats(&stream);
    assert_eq!(
        (stats.captures, stats.replays, stats.eager_calls),
        (0, 0, 3)
    );
    assert_eq!(stats.eager.len(), 1, "{stats}");
    assert!(
        stats.eager[0].function.ends_with("twice_plus_one"),
        "{stats}"
    );
    assert_eq!(stats.eager[0].calls, 3);
    assert!(stats.eager[0].reason.contains("host backend"), "{stats}");
    let report = gpu_pool::observe::report().to_string();
    assert!(report.contains("graphs by shape:"), "{report}");
    assert!(report.contains("twice_plus_one ran eagerly"), "{report}");
    drop(x);
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}

#[test]
fn a_graphed_method_keys_self_and_runs_on_the_host() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let mut out = stream.temp::<u8>(2, 7)?;
    for value in [3, 4, 3] {
        Filler {
            stream: &stream,
            value,
        }
        .fill(&mut out)?;
        assert_eq!(out.to_vec()?, vec![value; 14]);
    }
    assert_eq!(shape_stats(&stream).eager_calls, 3);
    Ok(())
}

#[test]
fn a_key_changes_with_every_scalar_buffer_and_field() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    fn key<K: GraphKey + ?Sized>(value: &K) -> Vec<u64> {
        let mut keys = GraphKeys::default();
        value.graph_key(&mut keys);
        keys.words().to_vec()
    }
    let (a, b) = (stream.temp::<f32>(4, 4)?, stream.temp::<f32>(4, 4)?);
    assert_eq!(key(&a), key(&a));
    assert_ne!(key(&a), key(&b), "another address");
    let c = stream.temp::<u32>(4, 4)?;
    let d = stream.temp::<u32>(2, 8)?;
    assert_ne!(key(&c), key(&d), "another shape");
    let filler = |value| Filler {
        stream: &stream,
        value,
    };
    assert_ne!(key(&filler(1)), key(&filler(2)), "another field");
    // Two derived types that write the same words, behind one `&dyn` parameter: two keys.
    trait Shape: GraphKey {}
    #[derive(GraphKey)]
    struct Square;
    #[derive(GraphKey)]
    struct Circle;
    impl Shape for Square {}
    impl Shape for Circle {}
    let (square, circle): (&dyn Shape, &dyn Shape) = (&Square, &Circle);
    assert_ne!(key(&square), key(&circle), "another type behind `dyn`");
    assert_eq!(key(&square), key(&(&Square as &dyn Shape)));
    assert_ne!(key(&1.0f32), key(&(-1.0f32)));
    // Past the inline words: still every word.
    let long: Vec<u64> = (0..100).collect();
    let mut longer = long.clone();
    longer[99] = 7;
    assert_ne!(key(&long), key(&longer));
    assert_eq!(key(&long).len(), 101);
    Ok(())
}

/// What only a GPU shows: captures, replays, shared scratch, eager reasons.
#[cfg(feature = "cuda")]
mod gpu {
    use std::error::Error;

    use gpu_pool::graph::shape_stats;
    use gpu_pool::interop::cudarc::driver::PushKernelArg;
    use gpu_pool::observe::DriverCalls;
    use gpu_pool::prelude::*;

    use crate::common::gpu;
    use crate::common::kernels::{Kernels, affine_relu_of, line4};

    type TestResult = Result<(), Box<dyn Error>>;

    /// `y = relu(a * relu(a * x + b) + b)`, through a scratch buffer.
    #[pooled(stream, graph)]
    fn affine_twice<'s>(
        stream: &'s Stream,
        k: &Kernels,
        x: &Temp<'_, f32>,
        a: f32,
        b: f32,
    ) -> Result<Temp<'s, f32>, PoolError> {
        let n = x.len();
        let mut y = stream.temp_1d::<f32>(n)?;
        let mut tmp = buffer!(n; f32)?;
        let cuda = stream.cudarc()?;
        let n32 = n as i32;
        // SAFETY: `x`, `tmp` and `y` hold `n` floats of this stream, alive past the kernels.
        unsafe {
            cuda.launch_builder(&k.affine_relu)
                .buf(x)
                .buf_mut(&mut tmp)
                .arg(&n32)
                .arg(&a)
                .arg(&b)
                .launch(line4(n))?;
            cuda.launch_builder(&k.affine_relu)
                .buf(&tmp)
                .buf_mut(&mut y)
                .arg(&n32)
                .arg(&a)
                .arg(&b)
                .launch(line4(n))?;
        }
        Ok(y)
    }

    fn expected(x: &[f32], a: f32, b: f32) -> Vec<f32> {
        x.iter()
            .map(|&v| affine_relu_of(affine_relu_of(v, a, b), a, b))
            .collect()
    }

    fn input(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (i % 97) as f32 * 0.25 - 3.0 + seed)
            .collect()
    }

    #[test]
    fn a_key_is_captured_once_then_replayed_with_no_allocation() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_replays") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let mut x = stream.temp_1d::<f32>(4096)?;
        let mut warm = None;
        for call in 0..6 {
            let data = input(4096, call as f32);
            x.upload(&data)?;
            let before = DriverCalls::on_this_thread();
            let y = affine_twice(&stream, &k, &x, 1.5, -0.5)?;
            let calls = DriverCalls::on_this_thread().since(before);
            assert_eq!(y.to_vec()?, expected(&data, 1.5, -0.5), "call {call}");
            if call > 0 {
                warm.get_or_insert(calls);
                assert_eq!(calls.memory, 0, "a replay allocates nothing: {calls:?}");
            }
        }
        let stats = shape_stats(&stream);
        println!("{stats}; a replay's driver calls: {warm:?}");
        assert_eq!(
            (stats.captures, stats.replays, stats.eager_calls),
            (1, 5, 0),
            "{stats}"
        );
        // Another scalar is another graph; the first is still replayed.
        let y = affine_twice(&stream, &k, &x, 2.0, 0.0)?;
        assert_eq!(y.to_vec()?, expected(&x.to_vec()?, 2.0, 0.0));
        drop(y);
        let _ = affine_twice(&stream, &k, &x, 1.5, -0.5)?;
        let stats = shape_stats(&stream);
        assert_eq!((stats.captures, stats.replays), (2, 6), "{stats}");
        Ok(())
    }

    #[test]
    fn a_capture_refused_for_a_passing_reason_is_tried_again() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_retry") else {
            return Ok(());
        };
        device.set_pool_config(gpu_pool::config::PoolConfig::new(1 << 20, 1)?)?;
        let k = Kernels::load(&device);
        // The device's one stack is another stream's: this one's capture finds no stack for its
        // scratch (a passing reason), so its calls run eagerly from the fallback.
        let mut other = Some(Stream::new(&device)?);
        if let Some(other) = &other {
            drop(other.temp_1d::<u8>(256)?); // claims the stack, kept until the stream's drop
        }
        let stream = Stream::new(&device)?;
        let mut x = stream.temp_1d::<f32>(4096)?;
        assert_ne!(x.source(), gpu_pool::Source::Stack);
        for call in 0..20 {
            let data = input(4096, call as f32);
            x.upload(&data)?;
            let y = affine_twice(&stream, &k, &x, 1.5, -0.5)?;
            assert_eq!(y.to_vec()?, expected(&data, 1.5, -0.5), "call {call}");
            drop(y);
            if call == 0 {
                // The stack is free from now on: a later try captures.
                drop(other.take());
            }
        }
        let stats = shape_stats(&stream);
        eprintln!("graphed_retry: {stats}");
        // The first call, then the 16 eager calls of the wait; the 18th captures.
        assert_eq!(
            (stats.captures, stats.replays, stats.eager_calls),
            (1, 2, 17),
            "{stats}"
        );
        assert!(stats.eager[0].reason.contains("stack"), "{stats}");
        Ok(())
    }

    /// `y = x + 1`, keeping two graphs.
    #[pooled(stream, graph(cap = 2))]
    fn plus_one<'s>(
        stream: &'s Stream,
        k: &Kernels,
        x: &Temp<'_, f32>,
    ) -> Result<Temp<'s, f32>, PoolError> {
        let mut y = stream.temp_1d::<f32>(x.len())?;
        let cuda = stream.cudarc()?;
        let (n, a, b) = (x.len() as i32, 1.0f32, 1.0f32);
        // SAFETY: `x` and `y` hold `n` floats of this stream, alive past the kernel.
        unsafe {
            cuda.launch_builder(&k.affine_relu)
                .buf(x)
                .buf_mut(&mut y)
                .arg(&n)
                .arg(&a)
                .arg(&b)
                .launch(line4(x.len()))?;
        }
        Ok(y)
    }

    #[test]
    fn keys_that_come_and_go_faster_than_the_cap_run_eagerly_and_the_graphs_in_use_stay()
    -> TestResult {
        let Some((device, _lock)) = gpu("graphed_over_cap") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        // Six inputs (six keys), live throughout, so the stack's top stays where it is.
        let mut inputs = Vec::new();
        for i in 0..6 {
            let mut x = stream.temp_1d::<f32>(1024)?;
            x.upload(&vec![i as f32; 1024])?;
            inputs.push(x);
        }
        let mut call = |i: usize| -> TestResult {
            let y = plus_one(&stream, &k, &inputs[i])?;
            assert_eq!(y.to_vec()?, vec![i as f32 + 1.0; 1024], "input {i}");
            drop(y);
            // Other graphed functions' calls on the stream age none of its graphs.
            for _ in 0..4 {
                drop(filled::<One>(&stream, 64)?);
            }
            Ok(())
        };
        // Six keys in turn, a cap of two: captured and evicted on every call, were each new key
        // captured. The first two stay and replay; the other four run eagerly.
        for _ in 0..5 {
            (0..6).try_for_each(&mut call)?;
        }
        let stats = shape_stats(&stream);
        eprintln!("graphed_over_cap, six keys in turn: {stats}");
        assert_eq!(
            (
                stats.captures,
                stats.replays,
                stats.eager_calls,
                stats.evictions
            ),
            (2 + 1, 8 + 119, 20, 0), // `filled::<One>`: one capture, then replays
            "{stats}"
        );
        assert!(stats.eager[0].reason.contains("cap"), "{stats}");
        // A new working set of two: once the old graphs have gone unused a while (4 x cap
        // calls), its keys are captured and replayed.
        for i in 0..20 {
            call(4 + i % 2)?;
        }
        let after = shape_stats(&stream);
        eprintln!("graphed_over_cap, then two other keys: {after}");
        assert_eq!(
            (
                after.captures - stats.captures,
                after.replays - stats.replays,
                after.eager_calls - stats.eager_calls,
                after.evictions,
            ),
            (2, 16 + 80, 2, 2),
            "{after}"
        );
        Ok(())
    }

    #[test]
    fn every_shape_shares_one_scratch_and_other_buffers_give_their_results() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_shapes") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        for (call, n) in [1000, 64_000, 9000, 64_000, 1000, 9000]
            .into_iter()
            .enumerate()
        {
            // Each call's input is a stack temporary at the same place, whatever its size.
            let mut x = stream.temp_1d::<f32>(n)?;
            let data = input(n, call as f32);
            x.upload(&data)?;
            let y = affine_twice(&stream, &k, &x, 0.5, 1.0)?;
            assert_eq!(y.to_vec()?, expected(&data, 0.5, 1.0), "n = {n}");
        }
        let stats = shape_stats(&stream);
        println!(
            "{stats}; scratch: largest {} B, sum {} B, stack high water {} B",
            stats.scratch_largest,
            stats.scratch_sum,
            stream.stats().stack_high_water
        );
        assert_eq!((stats.captures, stats.replays), (3, 3), "{stats}");
        assert!(stats.scratch_largest < stats.scratch_sum, "{stats:?}");
        // The stack held the largest call (its input, then its graph's scratch), not the sum:
        // every graph's scratch is free stack between calls.
        assert!(
            stream.stats().stack_high_water <= 64_000 * 4 + stats.scratch_largest,
            "{stats:?}"
        );

        // Two inputs at two addresses alternate: two graphs, each replayed with its own input.
        let (mut a, mut b) = (stream.temp_1d::<f32>(2048)?, stream.temp_1d::<f32>(2048)?);
        for call in 0..4 {
            let (x, data) = if call % 2 == 0 {
                (&mut a, input(2048, 1.0))
            } else {
                (&mut b, input(2048, -1.0))
            };
            x.upload(&data)?;
            let y = affine_twice(&stream, &k, x, 1.0, 0.25)?;
            assert_eq!(y.to_vec()?, expected(&data, 1.0, 0.25), "call {call}");
        }
        Ok(())
    }

    #[test]
    fn an_output_kept_across_a_call_is_not_overwritten() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_kept_output") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let mut x = stream.temp_1d::<f32>(1024)?;
        x.upload(&input(1024, 0.0))?;
        let first = affine_twice(&stream, &k, &x, 1.0, 0.0)?;
        x.upload(&input(1024, 5.0))?;
        let second = affine_twice(&stream, &k, &x, 1.0, 0.0)?; // `first` is live: another top
        assert_eq!(first.to_vec()?, expected(&input(1024, 0.0), 1.0, 0.0));
        assert_eq!(second.to_vec()?, expected(&input(1024, 5.0), 1.0, 0.0));
        assert_ne!(first.device_ptr(), second.device_ptr());
        Ok(())
    }

    /// Downloads inside: a pageable copy, which a capture refuses.
    #[pooled(stream, graph)]
    fn sum_on_host(stream: &Stream, x: &Temp<'_, f32>) -> Result<(), PoolError> {
        let mut tmp = buffer!(x.len(); f32)?;
        tmp.copy_from(x)?;
        let host = tmp.to_vec()?;
        assert_eq!(host.len(), x.len());
        Ok(())
    }

    /// Goes on after a refused download: the graph would lack it.
    #[pooled(stream, graph)]
    fn swallows<'s>(stream: &'s Stream, x: &Temp<'_, f32>) -> Result<Temp<'s, f32>, PoolError> {
        let mut y = stream.temp_1d::<f32>(x.len())?;
        let mut tmp = buffer!(x.len(); f32)?;
        tmp.copy_from(x)?;
        let host = tmp.to_vec().unwrap_or_default(); // refused inside a capture
        let scale = if host.is_empty() { 0.0 } else { 1.0 };
        if scale > 0.0 {
            y.copy_from(&tmp)?;
        } else {
            y.set_to(-1.0)?;
        }
        Ok(y)
    }

    #[test]
    fn a_body_that_swallows_a_refusal_runs_eagerly() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_swallows") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        let mut x = stream.temp_1d::<f32>(64)?;
        for round in 0..3 {
            x.set_to(round as f32)?;
            let y = swallows(&stream, &x)?;
            assert_eq!(
                y.to_vec()?,
                vec![round as f32; 64],
                "what an eager call computes"
            );
        }
        let stats = shape_stats(&stream);
        println!("{stats}");
        assert_eq!((stats.captures, stats.replays), (0, 0), "{stats}");
        assert!(
            stats
                .eager
                .iter()
                .any(|e| e.reason.contains("went on after")),
            "{stats}"
        );
        Ok(())
    }

    #[test]
    fn what_cannot_be_captured_runs_eagerly_with_its_reason() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_eager") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        let x = stream.temp_1d::<f32>(256)?;
        for _ in 0..3 {
            sum_on_host(&stream, &x)?;
        }
        let stats = shape_stats(&stream);
        println!("{stats}");
        assert_eq!(
            (stats.captures, stats.replays, stats.eager_calls),
            (0, 0, 3),
            "{stats}"
        );
        assert_eq!(stats.eager.len(), 1, "{stats}");
        assert_eq!(
            stats.eager[0].calls, 3,
            "tried once, then eager for the key"
        );
        assert!(stats.eager[0].reason.contains("capture"), "{stats}");
        assert_eq!(stream.stats().stack_in_use, 256 * 4);
        Ok(())
    }

    /// An error type of the user's own, which wraps the pool's.
    #[derive(Debug)]
    struct AppError(#[allow(dead_code)] PoolError);
    impl From<PoolError> for AppError {
        fn from(e: PoolError) -> Self {
            AppError(e)
        }
    }

    static HOST_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// `sum_on_host`, returning the user's own error type, counting its host code's runs.
    #[pooled(stream, graph)]
    fn sum_on_host_wrapped(stream: &Stream, x: &Temp<'_, f32>) -> Result<(), AppError> {
        HOST_RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut tmp = buffer!(x.len(); f32)?;
        tmp.copy_from(x)?;
        let host = tmp.to_vec()?;
        assert_eq!(host.len(), x.len());
        Ok(())
    }

    #[test]
    fn a_refusal_inside_an_error_of_the_users_own_is_still_the_reason() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_eager_wrapped") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        let x = stream.temp_1d::<f32>(256)?;
        HOST_RUNS.store(0, std::sync::atomic::Ordering::Relaxed);
        for _ in 0..40 {
            sum_on_host_wrapped(&stream, &x).map_err(|e| format!("{e:?}"))?;
        }
        let stats = shape_stats(&stream);
        eprintln!("graphed_eager_wrapped: {stats}");
        // The host copy is the function's own: never tried again (a retry would run the host
        // code once more, at the 18th call: 42).
        assert_eq!((stats.captures, stats.eager_calls), (0, 40), "{stats}");
        assert_eq!(HOST_RUNS.load(std::sync::atomic::Ordering::Relaxed), 41);
        assert!(stats.eager[0].reason.contains("host"), "{stats}");
        Ok(())
    }

    #[test]
    fn a_function_whose_captures_fail_and_whose_keys_come_and_go_stops_trying() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_eager_new_keys") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        // Forty inputs, live throughout: a new key each call.
        let inputs = (0..40)
            .map(|_| stream.temp_1d::<f32>(256))
            .collect::<Result<Vec<_>, _>>()?;
        HOST_RUNS.store(0, std::sync::atomic::Ordering::Relaxed);
        for x in &inputs {
            sum_on_host_wrapped(&stream, x).map_err(|e| format!("{e:?}"))?;
        }
        let stats = shape_stats(&stream);
        eprintln!("graphed_eager_new_keys: {stats}");
        // Sixteen keys (the cap) tried and failed, each run twice; then, with every eager key in
        // use, a new one runs eagerly untried: 16 x 2 + 24, where trying each would be 80.
        assert_eq!((stats.captures, stats.eager_calls), (0, 40), "{stats}");
        assert_eq!(HOST_RUNS.load(std::sync::atomic::Ordering::Relaxed), 56);
        Ok(())
    }

    /// Allocates from the driver inside: what a capture refuses.
    #[pooled(stream, graph)]
    fn allocates(stream: &Stream, n: usize) -> Result<(), PoolError> {
        let mut m = DeviceMat::<f32>::new(stream, 1, n)?;
        let tmp = buffer!(n; f32)?;
        m.copy_from(&tmp)
    }

    #[test]
    fn a_driver_allocation_inside_runs_eagerly_with_its_reason() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_allocates") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        for _ in 0..2 {
            allocates(&stream, 64)?;
        }
        let stats = shape_stats(&stream);
        println!("{stats}");
        assert_eq!((stats.captures, stats.eager_calls), (0, 2), "{stats}");
        assert_eq!(stats.eager.len(), 1, "{stats}");
        Ok(())
    }

    /// What a type parameter chooses: a fill value.
    trait Fill {
        const VALUE: u8;
    }
    struct One;
    struct Two;
    impl Fill for One {
        const VALUE: u8 = 1;
    }
    impl Fill for Two {
        const VALUE: u8 = 2;
    }

    /// Its only difference between instances is a type no parameter names.
    #[pooled(stream, graph)]
    fn filled<'s, F: Fill>(stream: &'s Stream, n: usize) -> Result<Temp<'s, u8>, PoolError> {
        let mut y = stream.temp_1d::<u8>(n)?;
        y.set_to(F::VALUE)?;
        Ok(y)
    }

    #[test]
    fn instances_of_a_generic_function_have_graphs_of_their_own() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_generic") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        for _ in 0..3 {
            assert_eq!(filled::<One>(&stream, 64)?.to_vec()?, vec![1; 64]);
            assert_eq!(filled::<Two>(&stream, 64)?.to_vec()?, vec![2; 64]);
        }
        let stats = shape_stats(&stream);
        assert_eq!((stats.captures, stats.replays), (2, 4), "{stats}");
        Ok(())
    }

    /// A generic impl whose associated function (no `self`, no `Self` in its signature) differs
    /// between instances only by the impl's type parameter, which the attribute cannot see.
    struct Filler<F>(std::marker::PhantomData<F>);

    impl<F: Fill> Filler<F> {
        #[pooled(stream, graph)]
        fn fill<'s>(stream: &'s Stream, n: usize) -> Result<Temp<'s, u8>, PoolError> {
            let mut y = stream.temp_1d::<u8>(n)?;
            y.set_to(F::VALUE)?;
            Ok(y)
        }
    }

    /// What an `impl Trait` parameter's type chooses; a unit type writes no words.
    trait Kind: GraphKey {
        fn value(&self) -> u8;
    }
    #[derive(GraphKey)]
    struct Three;
    #[derive(GraphKey)]
    struct Four;
    impl Kind for Three {
        fn value(&self) -> u8 {
            3
        }
    }
    impl Kind for Four {
        fn value(&self) -> u8 {
            4
        }
    }

    /// Its only difference between instances is an `impl Trait` parameter's type.
    #[pooled(stream, graph)]
    fn filled_by<'s>(
        stream: &'s Stream,
        n: usize,
        kind: impl Kind,
    ) -> Result<Temp<'s, u8>, PoolError> {
        let mut y = stream.temp_1d::<u8>(n)?;
        y.set_to(kind.value())?;
        Ok(y)
    }

    #[test]
    fn instances_of_a_generic_impl_and_of_impl_trait_have_graphs_of_their_own() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_generic_impl") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        for _ in 0..3 {
            assert_eq!(Filler::<One>::fill(&stream, 64)?.to_vec()?, vec![1; 64]);
            assert_eq!(Filler::<Two>::fill(&stream, 64)?.to_vec()?, vec![2; 64]);
            assert_eq!(filled_by(&stream, 64, Three)?.to_vec()?, vec![3; 64]);
            assert_eq!(filled_by(&stream, 64, Four)?.to_vec()?, vec![4; 64]);
        }
        // Two types of one name (local to two blocks), which no parameter names: only the
        // instance tells them apart (their type names are the same).
        for _ in 0..3 {
            {
                struct Local;
                impl Fill for Local {
                    const VALUE: u8 = 5;
                }
                assert_eq!(Filler::<Local>::fill(&stream, 64)?.to_vec()?, vec![5; 64]);
            }
            {
                struct Local;
                impl Fill for Local {
                    const VALUE: u8 = 6;
                }
                assert_eq!(Filler::<Local>::fill(&stream, 64)?.to_vec()?, vec![6; 64]);
            }
        }
        let stats = shape_stats(&stream);
        eprintln!("generic impl and impl Trait: {stats}");
        assert_eq!((stats.captures, stats.replays), (6, 12), "{stats}");
        Ok(())
    }

    /// Ping-pong: copies `cur` into `nxt`, adds one, and swaps them on the host.
    #[pooled(stream, graph)]
    fn step<'r, 's>(
        stream: &Stream,
        k: &Kernels,
        cur: &mut &'r mut Temp<'s, f32>,
        nxt: &mut &'r mut Temp<'s, f32>,
    ) -> Result<(), PoolError> {
        let n = cur.len();
        let cuda = stream.cudarc()?;
        let (n32, a, b) = (n as i32, 1.0f32, 1.0f32);
        // SAFETY: both hold `n` floats of this stream, alive past the kernel.
        unsafe {
            cuda.launch_builder(&k.affine_relu)
                .buf(&**cur)
                .buf_mut(&mut **nxt)
                .arg(&n32)
                .arg(&a)
                .arg(&b)
                .launch(line4(n))?;
        }
        std::mem::swap(cur, nxt);
        Ok(())
    }

    #[test]
    fn a_function_that_changes_its_parameters_on_the_host_runs_eagerly() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_swap") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let (mut a, mut b) = (stream.temp_1d::<f32>(256)?, stream.temp_1d::<f32>(256)?);
        a.set_to(0.0)?;
        let (mut cur, mut nxt) = (&mut a, &mut b);
        for _ in 0..6 {
            step(&stream, &k, &mut cur, &mut nxt)?;
        }
        assert_eq!(
            cur.to_vec()?,
            vec![6.0; 256],
            "every call swapped and added one"
        );
        let stats = shape_stats(&stream);
        println!("{stats}");
        assert_eq!(stats.replays, 0, "{stats}");
        assert!(
            stats
                .eager
                .iter()
                .any(|e| e.reason.contains("changes its parameters")),
            "{stats}"
        );
        Ok(())
    }

    thread_local! {
        /// Device memory no parameter names.
        static HIDDEN: std::cell::RefCell<Option<SharedMat<f32>>> =
            const { std::cell::RefCell::new(None) };
    }

    /// Writes the thread-local memory: memory a replay could not follow.
    #[pooled(stream, graph)]
    fn into_hidden(stream: &Stream, x: &Temp<'_, f32>) -> Result<(), PoolError> {
        let mut tmp = buffer!(x.len(); f32)?;
        tmp.copy_from(x)?;
        HIDDEN.with(|h| match h.borrow_mut().as_mut() {
            Some(m) => m.write(stream)?.copy_from(&tmp),
            None => Ok(()),
        })
    }

    #[test]
    fn memory_no_parameter_names_makes_the_calls_eager() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_hidden") else {
            return Ok(());
        };
        let stream = Stream::new(&device)?;
        let mut x = stream.temp_1d::<f32>(128)?;
        for round in 0..3 {
            // New memory each round, where the last one was freed: a replay would write the
            // old address.
            let value = round as f32;
            HIDDEN.with(|h| -> Result<(), PoolError> {
                *h.borrow_mut() = Some(SharedMat::new(&device, 1, 128)?);
                Ok(())
            })?;
            x.set_to(value)?;
            into_hidden(&stream, &x)?;
            let got = HIDDEN.with(|h| -> Result<Vec<f32>, PoolError> {
                match h.borrow().as_ref() {
                    Some(m) => m.read(&stream)?.to_vec(),
                    None => Ok(Vec::new()),
                }
            })?;
            assert_eq!(got, vec![value; 128], "round {round}");
        }
        HIDDEN.with(|h| h.borrow_mut().take());
        let stats = shape_stats(&stream);
        println!("{stats}");
        assert_eq!(stats.replays, 0, "{stats}");
        assert!(
            stats
                .eager
                .iter()
                .any(|e| e.reason.contains("none of its parameters")),
            "{stats}"
        );
        Ok(())
    }

    /// `y = w` (a shared weight) through a scratch copy.
    #[pooled(stream, graph)]
    fn read_weights<'s>(
        stream: &'s Stream,
        w: &SharedMat<f32>,
    ) -> Result<Temp<'s, f32>, PoolError> {
        let w = w.read(stream)?;
        let mut y = stream.temp_1d::<f32>(w.len())?;
        let mut tmp = buffer!(w.len(); f32)?;
        tmp.copy_from(&w)?;
        y.copy_from(&tmp)?;
        Ok(y)
    }

    #[test]
    fn a_replay_after_a_weight_update_sees_the_new_weights() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_shared") else {
            return Ok(());
        };
        let (stream, loader) = (Stream::new(&device)?, Stream::new(&device)?);
        let mut w = SharedMat::<f32>::from_host(&loader, 1, 512, &[1.0; 512])?;
        for round in 0..4 {
            let value = round as f32 + 2.0;
            w.write(&loader)?.upload(&[value; 512])?; // on another stream, ordered by the guard
            let y = read_weights(&stream, &w)?;
            assert_eq!(y.to_vec()?, vec![value; 512], "round {round}");
        }
        let stats = shape_stats(&stream);
        assert_eq!((stats.captures, stats.replays), (1, 3), "{stats}");
        Ok(())
    }

    #[test]
    fn on_a_growable_stack_and_inside_a_capture() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_growable") else {
            return Ok(());
        };
        device.set_growable_stacks(true)?;
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let mut x = stream.temp_1d::<f32>(300_000)?;
        let data = input(300_000, 0.5);
        x.upload(&data)?;
        for _ in 0..3 {
            let y = affine_twice(&stream, &k, &x, 1.0, 1.0)?;
            // What the replay's scratch used above the top goes back while it waits.
            stream.trim()?;
            assert_eq!(y.to_vec()?, expected(&data, 1.0, 1.0));
        }
        assert_eq!(shape_stats(&stream).replays, 2);

        // Inside a capture of its stream the call is captured into that graph, eagerly.
        let out = std::cell::RefCell::new(DeviceMat::<f32>::new(&stream, 1, 300_000)?);
        let graph = stream.capture(|s| {
            let y = affine_twice(s, &k, &x, 1.0, 1.0)?;
            out.borrow_mut().copy_from(&y)
        })?;
        graph.launch()?;
        assert_eq!(out.borrow().to_vec()?, expected(&data, 1.0, 1.0));
        Ok(())
    }

    thread_local! {
        /// Whether `panics_once` panics on its next call (per thread).
        static PANIC_NEXT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// `affine_twice`, panicking when told to (after taking its output and scratch).
    #[pooled(stream, graph)]
    fn panics_once<'s>(
        stream: &'s Stream,
        k: &Kernels,
        x: &Temp<'_, f32>,
    ) -> Result<Temp<'s, f32>, PoolError> {
        let y = affine_twice(stream, k, x, 1.0, 1.0)?;
        let _scratch = buffer!(x.len(); f32)?;
        if PANIC_NEXT.with(|p| p.replace(false)) {
            panic!("user code panics inside a graphed capture");
        }
        Ok(y)
    }

    #[test]
    fn a_panic_inside_a_graphed_capture_leaves_the_function_and_the_stream_working() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_panic") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let stream = Stream::new(&device)?;
        let mut x = stream.temp_1d::<f32>(4096)?;
        let data = input(4096, 2.0);
        x.upload(&data)?;
        let in_use = stream.stats().stack_in_use;
        PANIC_NEXT.with(|p| p.set(true));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            panics_once(&stream, &k, &x)
        }));
        assert!(caught.is_err(), "the body panicked during the capture");
        assert_eq!(
            stream.stats().stack_in_use,
            in_use,
            "every buffer of the call went back"
        );
        // The same key again: captured this time, then replayed, with the right values.
        for _ in 0..3 {
            let y = panics_once(&stream, &k, &x)?;
            assert_eq!(y.to_vec()?, expected(&data, 1.0, 1.0));
        }
        let stats = shape_stats(&stream);
        eprintln!("graphed_panic: {stats}");
        assert_eq!((stats.captures, stats.replays), (1, 2), "{stats}");
        // A plain capture of the stream works too.
        let graph = stream.capture(|s| s.temp_1d::<f32>(16).map(drop))?;
        graph.launch()?;
        Ok(())
    }

    #[test]
    fn one_graphed_function_on_two_threads_keeps_each_streams_graphs_apart() -> TestResult {
        let Some((device, _lock)) = gpu("graphed_threads") else {
            return Ok(());
        };
        let k = Kernels::load(&device);
        let results = std::thread::scope(|scope| {
            let runs = [1.5f32, -2.0].map(|a| {
                let (device, k) = (&device, &k);
                scope.spawn(move || -> Result<(u64, u64), String> {
                    let stream = Stream::new(device).map_err(|e| e.to_string())?;
                    let mut x = stream.temp_1d::<f32>(8192).map_err(|e| e.to_string())?;
                    for call in 0..50 {
                        let data = input(8192, call as f32 + a);
                        x.upload(&data).map_err(|e| e.to_string())?;
                        let y = affine_twice(&stream, k, &x, a, 0.25).map_err(|e| e.to_string())?;
                        let got = y.to_vec().map_err(|e| e.to_string())?;
                        if got != expected(&data, a, 0.25) {
                            return Err(format!("a = {a}, call {call}: wrong values"));
                        }
                    }
                    let stats = shape_stats(&stream);
                    Ok((stats.captures, stats.replays))
                })
            });
            runs.map(|r| r.join().expect("no panic"))
        });
        for r in results {
            assert_eq!(r?, (1, 49));
        }
        Ok(())
    }
}
