//! The two_threads app's gpu-pool twin on the host backend (CPU twins of the kernels), every step
//! checked against the f64 CPU reference; and the check itself shown able to fail.

use gpu_pool::prelude::*;
use gpu_pool_apps::two_threads::{self, Config, PARTS, THREADS, pooled, steps};

#[test]
fn pooled_twin_matches_the_reference_on_the_host_backend() {
    let lists: Vec<_> = (0..THREADS).map(|t| steps(&Config::HOST, t)).collect();
    assert_ne!(lists[0], lists[1], "each thread has a list of its own");
    assert!(
        lists[0].windows(2).any(|w| w[0].n != w[1].n),
        "sizes change"
    );
    let worst = two_threads::run_on_host(&Device::host(), &Config::HOST).expect("checked");
    eprintln!("host backend: largest relative difference {worst:.2e}");
    assert!(worst < 1e-5, "{worst:.2e}");
}

#[test]
fn the_check_catches_a_wrong_result() {
    let cfg = Config {
        steps: 3,
        n: (300, 5000),
    };
    let lists: Vec<_> = (0..THREADS).map(|t| steps(&cfg, t)).collect();
    let device = Device::host();
    let mut workers = [
        pooled::Worker::new(&device).unwrap(),
        pooled::Worker::new(&device).unwrap(),
    ];
    let results = pooled::run(None, &mut workers, &lists, true).unwrap();
    assert_eq!(results[1].len(), 3);
    assert_eq!(results[1][2].len(), PARTS);
    two_threads::check("gpu-pool", &lists, &results).expect("right as run");

    let mut perturbed = results.clone();
    perturbed[1][2][5] *= 1.001;
    assert!(two_threads::check("perturbed", &lists, &perturbed).is_err());
    let mut swapped = results.clone();
    swapped.swap(0, 1);
    assert!(two_threads::check("threads swapped", &lists, &swapped).is_err());
    let mut short = results;
    short[0].pop();
    assert!(two_threads::check("a step missing", &lists, &short).is_err());
}
