//! Random take/release sequences on two streams of one device, checked after every step against a
//! plain model: live buffers never overlap and keep their contents, each stack buffer starts where
//! OpenCV's would (packed on 64 bytes, 2D on the texture alignment), the stack's use is the end of
//! its highest live buffer, counters add up, and everything returns to zero at the end.

use gpu_pool::{
    BufferPool, Device, Fallback, GpuMat, PoolError, Source, Stream, set_buffer_pool_config,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Take {
        stream: usize,
        rows: usize,
        cols: usize,
    },
    /// Releases the live buffer at this index (modulo the number live).
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, 0..24usize, 0..3000usize)
            .prop_map(|(stream, rows, cols)| Op::Take { stream, rows, cols }),
        2 => any::<usize>().prop_map(Op::Release),
    ]
}

struct Live<'s> {
    mat: GpuMat<'s, u8>,
    stream: usize,
    /// Order of taking, per run: a release is in LIFO order iff no live stack buffer of the same
    /// stream has a larger one.
    seq: usize,
    fill: u8,
}

fn span(m: &GpuMat<'_, u8>) -> std::ops::Range<u64> {
    let len = if m.is_empty() {
        0
    } else {
        m.step() * (m.rows() - 1) + m.cols()
    };
    m.device_ptr()..m.device_ptr() + len as u64
}

fn run(device: &Device, ops: Vec<Op>) -> Result<(), TestCaseError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, 256 << 10, 2).map_err(fail)?;
    let before = device.stats();
    let streams = [
        Stream::new(device).map_err(fail)?,
        Stream::new(device).map_err(fail)?,
    ];
    let pools = [BufferPool::new(&streams[0]), BufferPool::new(&streams[1])];
    let texture = device.texture_alignment();
    let mut live: Vec<Live<'_>> = Vec::new();
    let (mut takes, mut violations) = ([0u64; 2], [0u64; 2]);

    for (seq, op) in ops.into_iter().enumerate() {
        match op {
            Op::Take { stream, rows, cols } => {
                let top = streams[stream].stats().stack_in_use;
                let mut mat = pools[stream].get_buffer::<u8>(rows, cols).map_err(fail)?;
                if mat.source() == Source::Stack {
                    // Placed where OpenCV's `tip` is, a row or column rounded up to 64 bytes, a
                    // 2D buffer to the texture alignment.
                    let base = streams[stream].stack_range().map_or(0, |r| r.start);
                    let align = if rows > 1 && cols > 1 { texture } else { 64 };
                    prop_assert_eq!(mat.device_ptr() - base, top.next_multiple_of(align) as u64);
                }
                let fill = (seq % 251) as u8 + 1;
                mat.set_to(fill).map_err(fail)?;
                if mat.source() != Source::Empty {
                    takes[stream] += 1;
                }
                live.push(Live {
                    mat,
                    stream,
                    seq,
                    fill,
                });
            }
            Op::Release(i) if !live.is_empty() => {
                let gone = live.remove(i % live.len());
                let is_stack = gone.mat.source() == Source::Stack;
                let above = live.iter().any(|l| {
                    l.stream == gone.stream && l.mat.source() == Source::Stack && l.seq > gone.seq
                });
                if is_stack && above {
                    violations[gone.stream] += 1;
                }
                gone.mat.release().map_err(fail)?;
            }
            Op::Release(_) => {}
        }

        // Live buffers never overlap, and keep what was written into them.
        let mut spans: Vec<_> = live
            .iter()
            .map(|l| span(&l.mat))
            .filter(|s| !s.is_empty())
            .collect();
        spans.sort_by_key(|s| s.start);
        for pair in spans.windows(2) {
            prop_assert!(pair[0].end <= pair[1].start, "overlap: {:?}", pair);
        }
        for l in &live {
            prop_assert!(l.mat.to_vec().map_err(fail)?.iter().all(|&b| b == l.fill));
        }
        // Each stack's use is the end of its highest live buffer.
        for (i, s) in streams.iter().enumerate() {
            let stats = s.stats();
            let base = s.stack_range().map_or(0, |r| r.start);
            let top = live
                .iter()
                .filter(|l| l.stream == i && l.mat.source() == Source::Stack)
                .map(|l| l.mat.device_ptr() - base + stack_bytes(&l.mat) as u64)
                .max()
                .unwrap_or(0);
            prop_assert_eq!(stats.stack_in_use as u64, top);
            prop_assert_eq!(
                stats.stack_allocations + stats.fallback_allocations.total(),
                takes[i]
            );
            prop_assert_eq!(stats.lifo_violations, violations[i]);
        }
    }
    drop(live);
    for s in &streams {
        prop_assert_eq!(s.stats().stack_in_use, 0);
    }
    let stats = device.stats();
    prop_assert_eq!(
        stats.driver_alloc_calls - before.driver_alloc_calls,
        stats.driver_free_calls - before.driver_free_calls + 1,
        "every fallback freed; the stack memory stays"
    );
    Ok(())
}

/// OpenCV's layout: pitch x rows in 2D, the contiguous size rounded to 64 otherwise.
fn stack_bytes(m: &GpuMat<'_, u8>) -> usize {
    if m.rows() > 1 && m.cols() > 1 {
        m.step() * m.rows()
    } else {
        (m.rows() * m.cols()).div_ceil(64) * 64
    }
}

fn fail(e: PoolError) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn random_sequences_match_the_model(ops in prop::collection::vec(op(), 1..80)) {
        run(&Device::private_host(), ops)?;
    }
}

#[test]
fn random_sequences_match_the_model_on_the_gpu() {
    let Some((gpu, _lock)) = crate::common::gpu("model") else {
        return;
    };
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(32));
    runner
        .run(&prop::collection::vec(op(), 1..80), |ops| run(&gpu, ops))
        .expect("the GPU pool matches the model");
    println!("model: 32 random sequences matched on {}", gpu.id());
}
