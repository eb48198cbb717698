//! One model of the pool for every randomized test: the operations they draw from (`op`), what
//! the pool should do with each (`reference`), and the checker that does each to the real pool
//! and to the model and compares them after every step (`check`, over the typed buffers of
//! `buffer`).
//!
//! The drivers only generate operations: proptest strategies (`tests/pool/model.rs`,
//! `tests/pool/model_pools.rs`), the fuzzer's byte decoder (`tests/fuzz_ops/`) and the stress
//! run's random loop (`tests/stress.rs`).
#![allow(
    dead_code,
    unused_imports,
    unreachable_pub,
    reason = "shared by several test crates, each using a different part; a test helper is not API"
)]

mod buffer;
mod check;
mod op;
mod reference;

pub use check::{Mismatch, Setup, Tally, run, run_ops, settled};
pub use op::{Elem, Fill, Op, Pick, Shape, StreamKind};
pub use reference::Model;
