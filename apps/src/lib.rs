//! The apps suite: whole programs written the way the guide teaches, each beside its plain cudarc
//! twin (same kernels, same check against a CPU reference), run interleaved in one process.
//!
//! Each app is a module with `pooled.rs` (the gpu-pool twin), `plain.rs` (the cudarc twin, CUDA
//! only) and a `main` that checks both and times them: `cargo run --release -p gpu-pool-apps --bin
//! <app> [-- ROUNDS]`. On the host backend only the gpu-pool twin runs, as a correctness check
//! (`cargo test -p gpu-pool-apps`).

pub mod attention;
pub mod frame;
pub mod harness;
pub mod mlp_eager;
pub mod mlp_graph;
pub mod mlp_shapes;
pub mod two_threads;
