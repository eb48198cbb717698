//! The binned caching pool and MixMemory, checked after every step of random sequences by the
//! shared model (`tests/common/model/`): live blocks never overlap and keep their contents, every
//! byte the backend hands out is accounted for, the counters add up, and the pool's state equals
//! the model's.

use gpu_pool::Device;
use proptest::prelude::*;

use crate::common::model::{self, Elem, Fill, Op, Pick, Setup, Shape, StreamKind};

fn fail(m: model::Mismatch) -> TestCaseError {
    TestCaseError::fail(m.to_string())
}

// The strategies keep the shapes of the regression file's cases.

/// Contiguous buffers on two streams of the run's caching pool, and its `free_held`.
fn cache_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // Sizes cluster so that bins repeat and hits happen.
        5 => (0..2usize, prop_oneof![1..64usize, 900..1200usize, 60_000..70_000usize])
            .prop_map(|(stream, bytes)| Op::Take {
                stream,
                shape: Shape::Row(bytes),
                elem: Elem::U8,
                fill: Fill::Uniform,
            }),
        4 => any::<usize>().prop_map(|i| Op::Release(Pick::Any(i))),
        1 => Just(Op::FreeHeld),
    ]
}

/// Both sides of a MixMemory: grow, write, copy both ways, release either.
fn mix_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..5000usize).prop_map(Op::MixCpu),
        2 => (0..5000usize).prop_map(|len| Op::MixGpu { len, elem: Elem::U8 }),
        2 => any::<u8>().prop_map(|seed| Op::MixWrite(Fill::Pattern(seed.into()))),
        2 => Just(Op::MixCopy { stream: 0, to_gpu: true }),
        2 => Just(Op::MixCopy { stream: 0, to_gpu: false }),
        1 => Just(Op::MixRelease { cpu: true }),
        1 => Just(Op::MixRelease { cpu: false }),
    ]
}

proptest! {
    #![proptest_config(super::model::config(96))]
    #[test]
    fn caching_pool_matches_its_model(ops in prop::collection::vec(cache_op(), 1..120)) {
        let streams = [Op::NewStream(StreamKind::Cached), Op::NewStream(StreamKind::Cached)];
        let device = Device::private_host();
        model::run_ops(&device, Setup::default(), streams.into_iter().chain(ops)).map_err(fail)?;
    }

    #[test]
    fn mix_memory_matches_its_model(ops in prop::collection::vec(mix_op(), 1..80)) {
        let stream = Op::NewStream(StreamKind::Stack);
        let device = Device::private_host();
        model::run_ops(&device, Setup::default(), std::iter::once(stream).chain(ops))
            .map_err(fail)?;
    }
}
