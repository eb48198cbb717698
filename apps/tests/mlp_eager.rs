//! The mlp_eager app's gpu-pool twin on the host backend (CPU twins of the kernels and GEMMs),
//! checked against the f64 CPU reference; and the check itself shown able to fail.

use gpu_pool::prelude::*;
use gpu_pool_apps::mlp_eager::{self, Config, Work, pooled};

#[test]
fn pooled_twin_matches_the_reference_on_the_host_backend() {
    let work = Work::new(&Config::HOST);
    // The list has more than one batch, so buffers of changing sizes are exercised.
    let batches: std::collections::BTreeSet<_> = work.batches.iter().collect();
    assert!(batches.len() > 1, "{batches:?}");
    let device = Device::host();
    let worst = mlp_eager::run_on_host(&device, &work).expect("checked");
    eprintln!("host backend: largest relative difference {worst:.2e}");
    assert!(worst < 1e-5, "the host twins compute in f32: {worst:.2e}");
}

#[test]
fn the_full_list_covers_every_batch_from_1_to_64() {
    let work = Work::new(&Config::FULL);
    assert_eq!(work.steps(), 500);
    let batches: std::collections::BTreeSet<_> = work.batches.iter().copied().collect();
    assert_eq!(batches.first(), Some(&1));
    assert_eq!(batches.last(), Some(&64));
    assert!(batches.len() > 50, "{} distinct batches", batches.len());
}

#[test]
fn the_check_catches_a_wrong_output() {
    let work = Work::new(&Config::HOST);
    let stream = Stream::new(&Device::host()).unwrap();
    let model = pooled::Model::load(&stream, &work.weights).unwrap();
    let mut outputs = Vec::new();
    pooled::run(&stream, None, &model, &work, |_, p| {
        outputs.push(p.to_vec())
    })
    .unwrap();
    let want = mlp_eager::expected(&work);
    mlp_eager::check("gpu-pool", &want, &outputs).expect("right as computed");

    let mut perturbed = outputs.clone();
    perturbed[3][1] *= 1.001;
    assert!(mlp_eager::check("perturbed", &want, &perturbed).is_err());
    let mut missing = outputs.clone();
    missing.pop();
    assert!(mlp_eager::check("one missing", &want, &missing).is_err());
    let mut swapped = outputs.clone();
    swapped.swap(0, 1);
    assert!(mlp_eager::check("swapped", &want, &swapped).is_err());
}
