//! A dense layer, `y = relu(x W + b)`, as a `#[pooled]` function: the GEMM runs in cuBLAS (through
//! cudarc) on a pool buffer, and a bias + ReLU kernel reads that intermediate. The intermediate
//! comes from `buffer!`, so a loop of layers makes no driver allocation.
//!
//! `cargo run --release --features cublas --example mlp_cublas [BATCHES]`. Without a GPU (or without cuBLAS) the
//! layer runs as its CPU twin on the host backend, and the example says so. Every run is checked
//! against a plain CPU reference.

mod support;

use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::prelude::*;
use support::dense::{BATCH, IN, OUT, dense_relu, engine, largest_difference, parameters};

fn main() -> Result<(), PoolError> {
    let batches = support::count_arg(50);
    let mut device = Device::cuda_or_host();
    let mut stream = Stream::new(&device)?;
    let (engine, described) = match engine(&device, &stream) {
        // A GPU without libcublas: a typed error (cudarc alone would panic), and the host instead.
        Err(e @ PoolError::NoCudaLibrary { .. }) => {
            println!("{e}");
            device = Device::host();
            stream = Stream::new(&device)?;
            engine(&device, &stream)?
        }
        made => made?,
    };
    println!("device: {described}");

    let (wv, bv) = parameters();
    // The layer's parameters belong to the device, not to a stream: any stream, on any thread,
    // reads them (each read ordered after the upload on the GPU).
    let w = SharedMat::from_host(&stream, IN, OUT, &wv)?;
    let b = SharedMat::from_host(&stream, 1, OUT, &bv)?;
    let mut x = GpuMat::<f32>::new(&stream, BATCH, IN)?;
    let mut y = GpuMat::<f32>::new(&stream, BATCH, OUT)?;

    let (mut worst, mut calls_after_first) = (0.0f32, 0);
    let start = std::time::Instant::now();
    for batch in 0..batches {
        let xv: Vec<f32> = (0..BATCH * IN)
            .map(|i| ((i * 13 + batch * 7) % 97) as f32 / 97.0 - 0.5)
            .collect();
        x.upload(&xv)?;
        let before = stream.stats().driver_alloc_calls;
        let (w, b) = (w.read(&stream)?, b.read(&stream)?);
        dense_relu(&stream, &engine, &x, &w, &b, &mut y)?;
        if batch > 0 {
            calls_after_first += stream.stats().driver_alloc_calls - before;
        }
        worst = worst.max(largest_difference(&y.to_vec()?, &xv, &wv, &bv));
    }
    println!(
        "{batches} batches of {BATCH}x{IN} through a {IN}->{OUT} dense layer in {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    let stats = stream.stats();
    println!(
        "intermediates: {} from the stack, {} from the fallback; driver allocation calls after the first batch: {calls_after_first}",
        stats.stack_allocations,
        stats.fallback_allocations.total()
    );
    println!("largest relative difference from the f64 CPU reference: {worst:.2e}");
    assert!(worst < 1e-4, "the layer is wrong");
    drop((x, y, w, b));
    drop(engine);
    drop(stream);
    device.release_stack_memory()?;
    Ok(())
}
