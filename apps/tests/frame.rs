//! The frame app's gpu-pool twin on the host backend (CPU twins of the kernels), checked pixel by
//! pixel against the CPU reference; and the check itself shown able to fail.

use gpu_pool::prelude::*;
use gpu_pool_apps::frame::{
    self, CHECKED, HOST_SIZE, Size, THRESHOLD, differences, pooled, reference, test_frame,
};

#[test]
fn pooled_twin_matches_the_reference_on_the_host_backend() {
    let wrong = frame::run_on_host(&Device::host(), HOST_SIZE, CHECKED).expect("ran");
    assert_eq!(wrong, 0);
}

#[test]
fn the_test_frames_give_the_pipeline_work() {
    for size in [HOST_SIZE, frame::SIZES[1]] {
        let [a, b] = [0, 1].map(|seed| reference(&test_frame(size, seed), size));
        let white = a.iter().filter(|&&v| v == 255).count();
        assert!(
            white > 0 && white < a.len(),
            "{size}: {white} of {} above {THRESHOLD}",
            a.len()
        );
        assert!(a.iter().all(|&v| v == 0 || v == 255));
        assert_ne!(a, b, "{size}: the two input frames give different images");
    }
}

#[test]
fn the_check_catches_a_wrong_pixel_and_a_missed_frame() {
    let device = Device::host();
    let stream = Stream::new(&device).unwrap();
    let size = Size { rows: 20, cols: 33 };
    let mut io = pooled::Frames::new(&device, size).unwrap();
    let expected = [0, 1].map(|seed| reference(&test_frame(size, seed), size));
    let mut outputs = Vec::new();
    pooled::run(&stream, None, &mut io, size, 2, |_, out| {
        outputs.push(out.to_vec())
    })
    .unwrap();
    assert_eq!(differences(&outputs[0], &expected[0]), 0);
    assert_eq!(differences(&outputs[1], &expected[1]), 0);

    let mut flipped = outputs[1].clone();
    flipped[size.cols + 5] ^= 0xff;
    assert_eq!(differences(&flipped, &expected[1]), 1);
    // Last frame's image where this frame's should be (a download that did not land).
    assert!(differences(&outputs[0], &expected[1]) > 0);
    assert_eq!(
        differences(&outputs[0][1..], &expected[0]),
        expected[0].len()
    );
}
