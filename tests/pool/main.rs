//! The pool's integration tests, in one binary: none of these needs a process of its own, and one
//! link instead of a dozen saves minutes on a small machine. Tests that do need one stay beside
//! this folder (see `tests/README.md`): the usage flag (`usage.rs`), `GPU_POOL_CONF`
//! (`env_conf.rs`), the global allocator (`heap.rs`), the fuzz corpus (`fuzz_corpus.rs`, which
//! switches usage), the stress run (`stress.rs`) and trybuild (`ui.rs`).

#[path = "../common/mod.rs"]
mod common;

mod bad_input;
mod caching;
mod config;
#[cfg(feature = "cuda")]
mod cuda;
mod dsl;
mod errors;
mod family;
mod faults;
mod graphed;
mod growable;
mod holders;
mod host_mem;
mod mix;
mod model;
mod model_pools;
#[cfg(feature = "nccl")]
mod multi_gpu;
mod observe;
mod pplcv;
#[cfg(feature = "nccl")]
mod ranks;
mod seams;
mod seed;
mod shared;
mod sizing;
mod symmetric;
mod types;
mod views;
