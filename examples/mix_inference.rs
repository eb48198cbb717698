//! TensorRT-style `MixMemory` in a pre-process / infer / post-process loop: one pinned-host plus
//! device pair per tensor, grown only when a batch is larger than any before it.
//!
//! Each batch: normalise pixels into the input's pinned host side (pre-process), copy it to the
//! device, run `y = max(a * x + b, 0)` (the "network"), copy the output back, and reduce it on the
//! host (post-process), checked against a CPU reference. Batch sizes vary, so the pairs grow a few
//! times and then serve every batch with no allocation.
//!
//! `cargo run --release --features mix --example mix_inference [-- BATCHES]`

mod support;

use gpu_pool::compat::mix::MixMemory;
use gpu_pool::prelude::*;
use support::Stages;
use support::kernels::affine_relu_of;

/// Elements of one image (224 x 224 x 3, as a classifier's input).
const IMAGE: usize = 224 * 224 * 3;
const BATCH_SIZES: [usize; 6] = [1, 8, 4, 16, 8, 2];
/// The "network": `y = max(A * x + B, 0)`.
const A: f32 = 1.5;
const B: f32 = -0.25;

fn pixel(image: usize, i: usize) -> u8 {
    (image * 31 + i * 7 % 253) as u8
}

fn normalise(p: u8) -> f32 {
    (f32::from(p) / 255.0 - 0.45) / 0.225
}

fn main() -> Result<(), PoolError> {
    let batches = support::count_arg(60);
    let device = Device::cuda_or_host();
    let stages = Stages::new(&device);
    let stream = Stream::new(&device)?;
    let mut input = MixMemory::new(&device)?;
    let mut output = MixMemory::new(&device)?;

    let start = std::time::Instant::now();
    let mut wrong = 0usize;
    let mut reallocations_after_largest = None;
    for b in 0..batches {
        let images = BATCH_SIZES[b % BATCH_SIZES.len()];
        let n = images * IMAGE;
        let first_image = b * 100;

        // Pre-process into pinned memory (waits for nothing: no copy of `input` is in flight).
        for (i, x) in input.cpu::<f32>(n)?.iter_mut().enumerate() {
            *x = normalise(pixel(first_image + i / IMAGE, i % IMAGE));
        }
        let _ = input.gpu::<f32>(n)?; // grows the device side
        input.copy_to_gpu_async(&stream)?;

        // Infer, on the same stream, so after the copy.
        let y = output.gpu::<f32>(n)?;
        stages.affine_relu(&stream, input.gpu_view::<f32>(n)?, y, A, B)?;
        output.cpu::<f32>(n)?;
        output.copy_to_cpu_async(&stream)?;

        // Post-process: `cpu` waits for the copy. One score per image, checked against the CPU.
        let scores = output.cpu::<f32>(n)?;
        for (image, chunk) in scores.chunks(IMAGE).enumerate() {
            let expected = (0..IMAGE)
                .map(|i| affine_relu_of(normalise(pixel(first_image + image, i)), A, B))
                .collect::<Vec<_>>();
            wrong += chunk.iter().zip(&expected).filter(|(a, b)| a != b).count();
        }
        if images == *BATCH_SIZES.iter().max().expect("not empty") {
            reallocations_after_largest
                .get_or_insert((input.reallocations(), output.reallocations()));
        }
    }
    let elapsed = start.elapsed();

    let (input_reallocs, output_reallocs) = (input.reallocations(), output.reallocations());
    println!("device: {}", Stages::describe(&device));
    println!(
        "{batches} batches of 1 to {} images ({:.1} MiB of f32 at most) in {:.1} ms",
        BATCH_SIZES.iter().max().expect("not empty"),
        (BATCH_SIZES.iter().max().expect("not empty") * IMAGE * 4) as f64 / (1 << 20) as f64,
        elapsed.as_secs_f64() * 1e3
    );
    println!(
        "reallocations (host + device sides): input {input_reallocs}, output {output_reallocs}; \
         held now: input {:?} bytes, output {:?} bytes (host, device)",
        input.capacity(),
        output.capacity()
    );
    if let Some(at_largest) = reallocations_after_largest {
        println!(
            "reallocations after the largest batch was first seen: {}",
            input_reallocs + output_reallocs - at_largest.0 - at_largest.1
        );
    }
    println!("scores differing from the CPU reference: {wrong}");
    if wrong != 0 {
        std::process::exit(1);
    }
    drop((input, output, stream));
    device.release_stack_memory()?; // everything freed before exit, as a leak checker wants
    Ok(())
}
