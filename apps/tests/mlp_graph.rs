//! The mlp_graph app's gpu-pool twin on the host backend: its step loop (upload into the input
//! `GpuMat`, the forward pass the graph would replay, download of the output `GpuMat`) checked
//! against the f64 CPU reference; the check shown able to fail; and capture refused off CUDA.

use std::cell::RefCell;

use gpu_pool::prelude::*;
use gpu_pool_apps::mlp_eager::{self, CLASSES, IN, pooled::Model};
use gpu_pool_apps::mlp_graph::{self, BATCH, HOST_STEPS, pooled};

#[test]
fn pooled_step_loop_matches_the_reference_on_the_host_backend() {
    let work = mlp_graph::work(HOST_STEPS);
    assert!(work.batches.iter().all(|&b| b == BATCH));
    assert_ne!(work.input(0), work.input(1), "every step has its own input");
    let worst = mlp_graph::run_on_host(&Device::host(), &work).expect("checked");
    eprintln!("host backend: largest relative difference {worst:.2e}");
    assert!(worst < 1e-5, "the host twins compute in f32: {worst:.2e}");
}

#[test]
fn the_check_catches_a_stale_output() {
    let work = mlp_graph::work(2);
    let stream = Stream::new(&Device::host()).unwrap();
    let model = Model::load(&stream, &work.weights).unwrap();
    let x = RefCell::new(DeviceMat::<f32>::new_packed(&stream, BATCH, IN).unwrap());
    let probs = RefCell::new(DeviceMat::<f32>::new_packed(&stream, BATCH, CLASSES).unwrap());
    // A step loop whose forward pass ran only once: the second step reads the first's output.
    let mut ran = false;
    let once = || {
        if !std::mem::replace(&mut ran, true) {
            let (x, mut probs) = (x.borrow(), probs.borrow_mut());
            mlp_eager::pooled::forward(&stream, None, &model, &*x, &mut *probs)?;
        }
        Ok(())
    };
    let mut outputs = Vec::new();
    pooled::run(once, &x, &probs, &work, |_, p| outputs.push(p.to_vec())).unwrap();
    assert!(
        mlp_eager::largest_difference(
            &outputs[0],
            &mlp_eager::reference(&work.weights, work.input(0))
        ) < 1e-5
    );
    let want = mlp_eager::expected(&work);
    assert!(mlp_eager::check("stale", &want, &outputs).is_err());
}

#[test]
fn capture_is_refused_on_the_host_backend() {
    // `mlp_graph::main` falls back to the eager loop there: the graph needs CUDA.
    let stream = Stream::new(&Device::host()).unwrap();
    let refused = stream.capture(|_| Ok(()));
    assert!(
        matches!(refused, Err(PoolError::Unsupported { .. })),
        "{refused:?}"
    );
}
