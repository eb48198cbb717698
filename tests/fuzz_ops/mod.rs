//! The fuzzer's bytes, decoded into the shared model's operations (`tests/common/model/`) and
//! checked by it on one host device: the fuzz target (`fuzz/`) and the corpus replay test
//! (`tests/fuzz_corpus.rs`) share this.
//!
//! Every operation does what the model predicts, an error included; nothing may panic. Live
//! buffers keep their contents, and when everything is dropped only the stack memory is left.
//!
//! The types below are the corpus's format (`arbitrary` decodes them variant by variant and field
//! by field), so they stay as they are: new operations go at the end of `Op`.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "shared by two crates, each using a different part; a test helper is not API"
)]

#[path = "../common/model/mod.rs"]
pub mod model;

use arbitrary::{Arbitrary, Unstructured};
use gpu_pool::{Device, config::Fallback};

use model::{Fill, Pick, Setup, Shape, StreamKind};

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
    /// Releases live buffer `i` (modulo the number live) of the episode: in or out of order.
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

impl From<Elem> for model::Elem {
    fn from(e: Elem) -> model::Elem {
        match e {
            Elem::U8 => model::Elem::U8,
            Elem::U32 => model::Elem::U32,
            Elem::Bgr => model::Elem::Bgr,
            Elem::F64 => model::Elem::F64,
        }
    }
}

/// What a run did, for the replay test's summary.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outcome {
    pub ops: usize,
    pub errors: usize,
}

/// Decodes `data` into operations and runs them; panics only when the pool and the model part.
pub fn run(data: &[u8]) -> Outcome {
    let mut u = Unstructured::new(data);
    let ops: Vec<Op> = u.arbitrary().unwrap_or_default();
    run_ops(&ops)
}

pub fn run_ops(ops: &[Op]) -> Outcome {
    // A limit makes the huge requests out-of-memory errors instead of the OS's problem.
    let limit = 32 << 20;
    let setup = Setup {
        // Small stacks to start with, so a run costs microseconds (the fuzzer's address
        // sanitizer makes large allocations slow); `Config` operations change them.
        stacks: Some((1 << 20, 4)),
        limit: Some(limit),
        max_live: 32,
        max_streams: 8,
        ..Setup::default()
    };
    let device = Device::host_with_limit(limit);
    let tally = model::run_ops(&device, setup, decode(&ops[..ops.len().min(512)]))
        .unwrap_or_else(|m| panic!("the pool and the model part: {m}"));
    Outcome {
        ops: tally.ops as usize,
        errors: tally.errors as usize,
    }
}

/// A run of buffer operations is an episode on one stream, the first one's pick; its buffers are
/// released at its end. `MixCopy` uses the newest stream.
fn decode(ops: &[Op]) -> Vec<model::Op> {
    let mut out = Vec::new();
    let mut streams = 0;
    let mut i = 0;
    while i < ops.len() {
        let episode = ops[i..].iter().take_while(|op| op.is_buffer_op()).count();
        if episode > 0 {
            if streams > 0 {
                let stream = ops[i].stream_pick();
                out.extend(ops[i..i + episode].iter().map(|op| buffer_op(op, stream)));
                out.push(model::Op::ReleaseAll);
            }
            i += episode;
            continue;
        }
        out.extend(match &ops[i] {
            Op::NewStream | Op::NewCachedStream if streams == 8 => vec![],
            Op::NewStream => {
                streams += 1;
                vec![model::Op::NewStream(StreamKind::Stack)]
            }
            Op::NewCachedStream => {
                streams += 1;
                vec![model::Op::NewStream(StreamKind::Cached)]
            }
            Op::DropStream(_) if streams == 0 => vec![],
            Op::DropStream(n) => {
                streams -= 1;
                vec![model::Op::DropStream(usize::from(*n))]
            }
            Op::Config { size, count } => vec![model::Op::Config {
                stack_size: size.get(),
                stack_count: count.get(),
            }],
            Op::Usage(on) => vec![model::Op::Usage(*on)],
            Op::Fallback(k) => vec![model::Op::Fallback(match k % 4 {
                0 => Fallback::Driver,
                1 => Fallback::StreamOrdered,
                2 => Fallback::Caching,
                _ => Fallback::Error,
            })],
            Op::StrictLifo(on) => vec![model::Op::StrictLifo(*on)],
            Op::Env(text) => vec![model::Op::ParseEnv(text.clone())],
            Op::MixCpu(n) => vec![
                model::Op::MixCpu(n.get().min(1 << 20)),
                model::Op::MixWrite(Fill::Uniform),
            ],
            Op::MixGpu(n) => vec![model::Op::MixGpu {
                len: n.get().min(1 << 18),
                elem: model::Elem::U32,
            }],
            Op::MixCopy(_) if streams == 0 => vec![],
            &Op::MixCopy(to_gpu) => vec![model::Op::MixCopy {
                stream: streams - 1,
                to_gpu,
            }],
            Op::FreeCached => vec![model::Op::FreeHeld],
            _ => unreachable!("buffer operations are episodes"),
        });
        i += 1;
    }
    out
}

fn buffer_op(op: &Op, stream: usize) -> model::Op {
    match *op {
        Op::Take {
            rows, cols, elem, ..
        } => model::Op::Take {
            stream,
            shape: Shape::Mat {
                rows: rows.get(),
                cols: cols.get(),
            },
            elem: elem.into(),
            fill: Fill::Uniform,
        },
        Op::Take1d { len, .. } => model::Op::Take {
            stream,
            shape: Shape::Row(len.get()),
            elem: model::Elem::U8,
            fill: Fill::Uniform,
        },
        Op::Release(i) => model::Op::Release(Pick::Any(usize::from(i))),
        Op::Check(i) => model::Op::Check(Pick::Any(usize::from(i))),
        _ => unreachable!("not a buffer operation"),
    }
}
