//! Graphs that share their scratch (`GraphFamily`), on a GPU: ten graphs of different shapes hold
//! the sum of their scratch when captured alone and the largest one in a family, and replaying the
//! family's members in any order leaves each one's output right.
#![cfg(feature = "cuda")]

use std::error::Error;

use gpu_pool::CaptureError;
use gpu_pool::compat::opencv::set_buffer_pool_config;
use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::prelude::*;

use crate::common::gpu;

type TestResult = Result<(), Box<dyn Error>>;
const MIB: usize = 1 << 20;

/// Graph `i`'s work: two temporaries of its own shape, filled with `i` and `i + 1`, the second
/// copied into its output.
fn member_work<'a>(
    i: usize,
    out: &'a mut GpuMat<'_, u32>,
) -> impl FnOnce(&Stream) -> Result<(), PoolError> + 'a {
    move |s| {
        let pool = BufferPool::new(s);
        let mut a = pool.get_buffer::<u32>(out.rows(), out.cols())?;
        let mut b = pool.get_buffer::<u32>(out.rows(), out.cols())?;
        a.set_to(i as u32)?;
        b.copy_from(&a)?;
        b.set_to(i as u32 + 1)?;
        out.copy_from(&b)
    }
}

#[test]
fn ten_graphs_of_a_family_hold_the_largest_scratch_not_the_sum() -> TestResult {
    let Some((device, _lock)) = gpu("graph_family") else {
        return Ok(());
    };
    set_buffer_pool_config(&device, 256 * MIB, 1)?;
    let stream = Stream::new(&device)?;
    let shapes: Vec<(usize, usize)> = (0..10).map(|i| (64 + 96 * i, 100 + 150 * i)).collect();
    let mut outputs = shapes
        .iter()
        .map(|&(r, c)| GpuMat::<u32>::new(&stream, r, c))
        .collect::<Result<Vec<_>, _>>()?;

    // Alone: each graph holds its own scratch.
    let alone: usize = {
        let graphs = outputs
            .iter_mut()
            .enumerate()
            .map(|(i, out)| stream.capture(member_work(i, out)))
            .collect::<Result<Vec<_>, _>>()?;
        graphs.iter().map(gpu_pool::graph::Graph::stack_bytes).sum()
    };
    assert_eq!(stream.stats().stack_in_use, 0);

    // In a family: one region, replayed in a scrambled order, each output still its own.
    let family = stream.graph_family()?;
    let graphs = outputs
        .iter_mut()
        .enumerate()
        .map(|(i, out)| family.capture(member_work(i, out)))
        .collect::<Result<Vec<_>, _>>()?;
    for round in 0..3 {
        for k in 0..graphs.len() {
            graphs[(k * 7 + round) % graphs.len()].launch()?;
        }
    }
    stream.synchronize()?;
    let shared = family.stack_bytes();
    let largest = graphs.len(); // the last shape is the largest
    drop(graphs);
    let wrong: usize = outputs
        .iter()
        .enumerate()
        .map(|(i, out)| {
            Ok::<_, PoolError>(out.to_vec()?.iter().filter(|&&v| v != i as u32 + 1).count())
        })
        .sum::<Result<usize, _>>()?;
    println!(
        "10 graphs of different shapes: {:.2} MiB of stack alone (the sum), {:.2} MiB in a family; \
         {wrong} output elements wrong after 3 scrambled rounds",
        alone as f64 / MIB as f64,
        shared as f64 / MIB as f64
    );
    let (rows, cols) = shapes[largest - 1];
    let largest_scratch = 2 * device.footprint::<u32>(rows, cols)?.bytes;
    assert!(
        shared >= largest_scratch && shared <= largest_scratch + 1024,
        "{shared}"
    );
    assert!(
        alone > 3 * shared,
        "the sum of ten growing shapes is several times the largest"
    );
    assert_eq!(wrong, 0);
    drop(family);
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}

#[test]
fn a_family_refuses_a_capture_under_a_live_buffer_and_a_replay_under_a_kept_one() -> TestResult {
    let Some((device, _lock)) = gpu("graph_family_refusals") else {
        return Ok(());
    };
    let stream = Stream::new(&device)?;
    let mut out = GpuMat::<u32>::new(&stream, 64, 64)?;
    let kept = std::cell::RefCell::new(None);
    let family = stream.graph_family()?;
    let first = family.capture(member_work(0, &mut out))?;

    // A buffer taken after the family, still live: the region cannot be lowered under it.
    let live = BufferPool::new(&stream).get_buffer_1d::<u8>(4096)?;
    let mut other = GpuMat::<u32>::new(&stream, 8, 8)?;
    let refused = family.capture(member_work(1, &mut other)).map(drop);
    assert!(
        matches!(refused, Err(PoolError::Unsupported { .. })),
        "{refused:?}"
    );
    drop(live);

    // A capture that keeps a buffer past its end makes no graph, and the kept buffer sits in the
    // lowered region: the first member may not replay until it is released.
    let failed = family
        .capture(|s| {
            let _ = s; // the same stream, named from outside so the buffer can outlive the closure
            *kept.borrow_mut() = Some(BufferPool::new(&stream).get_buffer_1d::<u8>(4096)?);
            Ok(())
        })
        .map(drop);
    assert!(
        matches!(failed, Err(PoolError::Capture(CaptureError::KeptBuffers))),
        "{failed:?}"
    );
    let blocked = first.launch();
    assert!(
        matches!(blocked, Err(PoolError::Unsupported { .. })),
        "{blocked:?}"
    );
    drop(kept.borrow_mut().take());
    first.launch()?;
    stream.synchronize()?;
    drop(first);
    assert!(out.to_vec()?.iter().all(|&v| v == 1));
    drop(family);
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}
