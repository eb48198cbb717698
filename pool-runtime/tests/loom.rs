//! loom explores every interleaving of streams taking and returning a device's stacks, and checks
//! that no two streams ever hold the same stack, that a stream with a stack serves from it, and
//! that every stack is free again at the end; and a growable stack's take against a give-back of its
//! idle memory on another thread (the handshake of `core/stack/growable.rs`).
//!
//! `RUSTFLAGS="--cfg loom" cargo test -p pool-runtime --no-default-features --release --test loom`
#![cfg(loom)]

use gpu_pool_runtime::{
    Device, GpuRead, GpuWrite, Source, Stream,
    compat::opencv::{BufferPool, set_buffer_pool_config},
};
use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, Ordering::SeqCst};

/// One flag per stack: set while a stream of the model holds it.
fn claim(flags: &[AtomicBool], stream: &Stream) -> Option<usize> {
    let index = stream.stack_index()?;
    let was_held = flags[index].swap(true, SeqCst);
    assert!(!was_held, "stack {index} handed to two streams at once");
    Some(index)
}

/// `threads` streams, each made, used and dropped on its own thread, over `stacks` stacks, with at
/// most `preemptions` forced thread switches per execution (loom's bound: bugs of this kind need
/// few, and the unbounded space of three threads does not finish).
fn model(threads: usize, stacks: usize, preemptions: Option<usize>) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = preemptions;
    let counter = runs.clone();
    builder.check(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let device = Device::private_host();
        set_buffer_pool_config(&device, 4096, stacks).expect("valid config");
        let flags: Arc<Vec<AtomicBool>> =
            Arc::new((0..stacks).map(|_| AtomicBool::new(false)).collect());
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (device, flags) = (device.clone(), flags.clone());
                loom::thread::spawn(move || {
                    let stream = Stream::new(&device).expect("a host stream");
                    // A stream that found no free stack takes one at a request if one is free by
                    // then, so what it holds is read after the request.
                    let buf = BufferPool::new(&stream)
                        .get_buffer_1d::<u8>(64)
                        .expect("host memory");
                    let held = claim(&flags, &stream);
                    assert_eq!(buf.source() == Source::Stack, held.is_some());
                    drop(buf);
                    if let Some(index) = held {
                        flags[index].store(false, SeqCst); // before the stream gives it back
                    }
                    drop(stream);
                })
            })
            .collect();
        for h in handles {
            h.join().expect("no thread panics");
        }
        let stats = device.stats();
        assert_eq!(stats.stacks_held, 0, "every stack given back");
        assert_eq!(stats.stack_in_use, 0);
    });
    // Past libtest's capture, so the log shows how much was explored.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "loom: {threads} streams over {stacks} stack(s), preemption bound {preemptions:?}: {} \
         interleavings explored",
        runs.load(std::sync::atomic::Ordering::Relaxed)
    );
}

#[test]
fn two_streams_one_stack() {
    model(2, 1, None);
}

#[test]
fn three_streams_two_stacks() {
    model(3, 2, Some(3));
}

/// A growable stack's give-back on another thread against its stream's take (the handshake of
/// `core/stack/growable.rs`): the stream's buffer, taken while the device reclaims, is always mapped (the host
/// backend refuses a fill of unmapped stack memory) and keeps its bytes, and the give-back never
/// unmaps it, whatever the interleaving.
#[test]
fn a_give_back_on_another_thread_never_unmaps_a_block_handed_out() {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    let counter = runs.clone();
    builder.check(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let device = Device::private_host();
        set_buffer_pool_config(&device, 4096, 1).expect("valid config");
        device
            .set_growable_stacks(true)
            .expect("the host models growable stacks");
        let stream = Stream::new(&device).expect("a host stream");
        let pool = BufferPool::new(&stream);
        // A peak left mapped above the top: idle memory for the other thread to give back.
        drop(pool.get_buffer_1d::<u8>(100 << 10).expect("host memory"));
        let reclaimer = {
            let device = device.clone();
            loom::thread::spawn(move || device.reclaim_idle().given_back())
        };
        let mut buf = pool
            .get_buffer_1d::<u8>(100 << 10)
            .expect("mapped, or mapped again");
        assert_eq!(buf.source(), Source::Stack);
        buf.set_to(7).expect("the block handed out is mapped");
        let given = reclaimer.join().expect("no thread panics");
        assert!(
            buf.to_vec().expect("still mapped").iter().all(|&x| x == 7),
            "a give-back unmapped the block in use"
        );
        let mapped = stream.stats().stack_mapped;
        assert!(
            mapped >= 100 << 10,
            "the block's memory stays mapped: {mapped}, {given} given back"
        );
        drop(buf);
    });
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "loom: take against a give-back on another thread: {} interleavings explored",
        runs.load(std::sync::atomic::Ordering::Relaxed)
    );
}
