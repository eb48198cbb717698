//! The attention app's gpu-pool twin on the host backend (CPU twins of the kernels and GEMMs),
//! checked against the f64 CPU reference; and the check itself shown able to fail.

use gpu_pool::prelude::*;
use gpu_pool_apps::attention::{self, Config, Work, pooled};
use std::sync::Arc;

#[test]
fn pooled_twin_matches_the_reference_on_the_host_backend() {
    let work = Work::new(&Config::HOST);
    // The list has requests of more than one shape, so buffers of changing sizes are exercised.
    let shapes: std::collections::BTreeSet<_> =
        work.requests.iter().map(|r| (r.batch, r.seq)).collect();
    assert!(shapes.len() > 1, "{shapes:?}");
    let worst = attention::run_on_host(&Device::host(), &work).expect("checked");
    eprintln!("host backend: largest relative difference {worst:.2e}");
    assert!(worst < 1e-5, "the host twins compute in f32: {worst:.2e}");
}

#[test]
fn the_check_catches_a_wrong_output() {
    let mut work = Work::new(&Config::HOST);
    work.requests.truncate(2);
    let device = Device::host();
    let stream = Stream::new(&device).unwrap();
    let model = Arc::new(pooled::Model::load(&stream, &work.weights).unwrap());
    let mut workers = [pooled::Worker::new(&device, work.largest()).unwrap()];
    let outputs = pooled::serve(&model, None, &mut workers, &work, 2, true).unwrap();
    attention::check("gpu-pool", &work, &outputs, 2).expect("right as served");

    let mut perturbed = outputs.clone();
    perturbed[1].1[7] += 0.01;
    assert!(attention::check("perturbed", &work, &perturbed, 2).is_err());
    let missing = &outputs[..1];
    assert!(attention::check("one missing", &work, missing, 2).is_err());
    // Another request's output in its place is caught too.
    let mut swapped = outputs.clone();
    swapped[0].0 = 1 - swapped[0].0;
    swapped[1].0 = 1 - swapped[1].0;
    assert!(attention::check("swapped", &work, &swapped, 2).is_err());
}
