//! D: what `#[pooled]` costs at compile time. Generates two crates of 200 functions each, one with
//! `#[pooled]` and `buffer!`, one with the same code written by hand on `BufferPool`, builds their
//! dependencies once, then times rebuilds of each crate alone, alternating, and prints the medians
//! and their ratio.
//!
//! `cargo bench -p gpu-pool-benches --bench build_time [-- ROUNDS]` (runs on the host; no GPU involved)

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const FUNCTIONS: usize = 200;

/// One generated function's source, from its index.
type Body = fn(usize) -> String;

fn pooled(i: usize) -> String {
    format!(
        "#[pooled(stream)]
pub fn f{i}(stream: &Stream, n: usize) -> Result<u64, PoolError> {{
    let a = buffer!(n, n; f32)?;
    let b = buffer!(n; u8)?;
    let c = buffer!(n, {cols}; u16)?;
    Ok(a.device_ptr() ^ b.device_ptr() ^ c.device_ptr())
}}
",
        cols = i + 1
    )
}

fn by_hand(i: usize) -> String {
    format!(
        "pub fn f{i}(stream: &Stream, n: usize) -> Result<u64, PoolError> {{
    let pool = BufferPool::new(stream);
    let a = pool.get_buffer::<f32>(n, n)?;
    let b = pool.get_buffer_1d::<u8>(n)?;
    let c = pool.get_buffer::<u16>(n, {cols})?;
    Ok(a.device_ptr() ^ b.device_ptr() ^ c.device_ptr())
}}
",
        cols = i + 1
    )
}

/// The workspace root: the facade's package, whose `Cargo.lock` and `target/` the bench uses.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("benches/ is in the workspace")
        .to_path_buf()
}

/// Writes crate `name` with `FUNCTIONS` functions from `body`; `round` changes a comment so cargo
/// rebuilds it.
fn write_crate(dir: &Path, name: &str, body: Body, round: usize) -> PathBuf {
    let root = dir.join(name);
    std::fs::create_dir_all(root.join("src")).expect("bench dir is writable");
    let manifest = format!(
        "[package]\nname = \"{name}\"\nversion = \"0.0.0\"\nedition = \"2024\"\n\n\
         [dependencies]\ngpu-pool = {{ path = {:?} }}\n\n[workspace]\n",
        workspace()
    );
    std::fs::write(root.join("Cargo.toml"), manifest).expect("writable");
    let lock = workspace().join("Cargo.lock");
    std::fs::copy(lock, root.join("Cargo.lock")).expect("the workspace has a Cargo.lock");
    let mut src = format!("// round {round}\nuse gpu_pool::prelude::*;\n\n");
    for i in 0..FUNCTIONS {
        src.push_str(&body(i));
    }
    std::fs::write(root.join("src/lib.rs"), src).expect("writable");
    root
}

fn build(root: &Path, target: &Path) -> Duration {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let start = Instant::now();
    let status = Command::new(cargo)
        .args(["build", "--offline", "--quiet", "--lib"])
        .env("CARGO_TARGET_DIR", target)
        .current_dir(root)
        .status()
        .expect("cargo runs");
    assert!(
        status.success(),
        "the generated crate {} builds",
        root.display()
    );
    start.elapsed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(9);
    let dir = workspace().join("target/build-time-bench");
    let target = dir.join("target");
    let cases: [(&str, Body); 2] = [("by_hand", by_hand), ("pooled", pooled)];
    for (name, body) in cases {
        build(&write_crate(&dir, name, body, 0), &target); // dependencies, once
    }
    let mut times = [Vec::new(), Vec::new()];
    for round in 1..=rounds {
        for (k, (name, body)) in cases.iter().enumerate() {
            times[k].push(build(&write_crate(&dir, name, *body, round), &target));
        }
    }
    let [hand, pooled] = times.map(median);
    println!(
        "\n### D: build time of a crate of {FUNCTIONS} functions (debug `cargo build` of the crate \
         alone, median of {rounds})\n\n| crate | median | ratio to `by_hand` |\n|---|---:|---:|"
    );
    println!("| `by_hand` | {:.2} s | 1.00x |", hand.as_secs_f64());
    println!(
        "| `pooled` | {:.2} s | {:.2}x |",
        pooled.as_secs_f64(),
        pooled.as_secs_f64() / hand.as_secs_f64()
    );
}
