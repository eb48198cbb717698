//! Random take/release sequences on two streams of one device, checked after every step by the
//! shared model (`tests/common/model/`): every buffer comes from where the model says, starting
//! where the device's packing puts it (rows and columns on 256 bytes, or packed on 64 as OpenCV's
//! with `Packing::OpenCv`, both chosen by turns; 2D on the texture alignment); live buffers never
//! overlap and keep their contents (read back after every step); each stack's use is the end of
//! its highest live buffer; counters and LIFO violations add up; at the end only the stack memory
//! is left.

use gpu_pool::{Device, config::Fallback, config::Packing};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

use crate::common::model::{self, Elem, Fill, Op, Pick, Setup, Shape, StreamKind};

/// The shape of the generated values is that of the regression file's cases: keep it.
fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..2usize, 0..24usize, 0..3000usize).prop_map(|(stream, rows, cols)| Op::Take {
            stream,
            shape: Shape::Mat { rows, cols },
            elem: Elem::U8,
            fill: Fill::Uniform,
        }),
        2 => any::<usize>().prop_map(|i| Op::Release(Pick::Any(i))),
    ]
}

/// `cases` cases, replaying the seeds of the regression file beside the test's source
/// (`model.proptest-regressions`): proptest's default file is one beside the folder of `main.rs`.
pub(crate) fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        source_file: Some(file!()),
        ..ProptestConfig::with_cases(cases)
    }
}

fn run(device: &Device, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let setup = Setup {
        stacks: Some((256 << 10, 2)),
        fallback: Some(Fallback::Driver),
        // Both packings, by turns (the generated values keep the regression file's shape).
        packing: Some(if ops.len().is_multiple_of(2) {
            Packing::Cuda
        } else {
            Packing::OpenCv
        }),
        contents_every_step: true,
        ..Setup::default()
    };
    let streams = [
        Op::NewStream(StreamKind::Stack),
        Op::NewStream(StreamKind::Stack),
    ];
    model::run_ops(device, setup, streams.into_iter().chain(ops))
        .map_err(|m| TestCaseError::fail(m.to_string()))?;
    Ok(())
}

proptest! {
    #![proptest_config(config(128))]
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
    let mut runner = proptest::test_runner::TestRunner::new(config(32));
    runner
        .run(&prop::collection::vec(op(), 1..80), |ops| run(&gpu, ops))
        .expect("the GPU pool matches the model");
    println!("model: 32 random sequences matched on {}", gpu.id());
}
