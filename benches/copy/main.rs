//! What one asynchronous host copy costs the host to queue, three ways side by side in one run:
//!
//! - `gpu-pool`: `upload_async` / `download_async` between a `HostMem` (page-locked) and a packed
//!   `GpuMat`. The host memory cannot be touched or freed while the copy is in flight: each copy
//!   takes a ticket of the stream's clock (and checks that no graph capture took it); `COPY_EVENTS=1`
//!   first switches the `HostMem`s to an event after every copy, as after a wait the clock could
//!   not answer.
//! - `cudarc, tracked`: cudarc's safe `memcpy_htod` / `memcpy_dtoh` between a `PinnedHostSlice`
//!   and a `CudaSlice`, which waits on and records the pinned slice's event at every copy (and
//!   the `CudaSlice`'s events too while cudarc is in multi-stream mode).
//! - `raw, untracked`: `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` through cudarc's `result`
//!   module, the floor: nothing stops the host from writing or freeing memory under the copy.
//!
//! Each round times 50 copies of one variant queued back to back (the stream is synchronized
//! after, untimed); variants take turns for every round. The medians per copy and their ratios to
//! the floor are printed as a markdown table a size and direction. The sizes are the frame
//! bench's small frames (u8), where the cost of queuing a copy is a visible part of a frame.
//!
//! `cargo bench -p gpu-pool-benches --bench copy [-- ROUNDS]` (or `COPY_ROUNDS`; 200 by default).
//! `FRAME_STREAM=default` adopts the context's default stream, as in the frame bench, which keeps
//! cudarc out of multi-stream mode. Without a CUDA device it says so and measures nothing.

#[path = "../support/run.rs"]
mod run;

use std::time::{Duration, Instant};

use gpu_pool::HostMem;
use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::interop::cudarc::driver::{DevicePtr, result};
use gpu_pool::prelude::*;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Copies queued per timed block.
const BLOCK: usize = 50;
const SIZES: [(usize, usize); 3] = [(256, 256), (480, 640), (1080, 1920)];
const VARIANTS: [&str; 3] = ["gpu-pool", "cudarc, tracked", "raw, untracked"];

fn main() -> Res<()> {
    let device = match Device::cuda(0) {
        Ok(device) => device,
        Err(e) => {
            println!("no CUDA device ({e}): the copy benchmark measured nothing");
            return Ok(());
        }
    };
    let rounds = run::count(0, "COPY_ROUNDS", 200);
    let ctx = device.cudarc().expect("a CUDA device").clone();
    ctx.bind_to_thread()?;
    let stream = if std::env::var("FRAME_STREAM").is_ok_and(|v| v == "default") {
        Stream::from_cuda(&device, ctx.default_stream())?
    } else {
        Stream::new(&device)?
    };
    let cs = stream.cudarc().expect("a CUDA stream").clone();
    println!(
        "device: {} ({}, driver {}); cudarc multi-stream mode: {}",
        device.id(),
        ctx.name()?,
        run::driver_version()?,
        ctx.is_in_multi_stream_mode()
    );
    for (rows, cols) in SIZES {
        let n = rows * cols;
        let mut own_host = HostMem::<u8>::new(&device, n)?;
        own_host.as_mut_slice()?.fill(7);
        let mut own_dev = GpuMat::<u8>::new_packed(&stream, rows, cols)?;
        if std::env::var("COPY_EVENTS").is_ok_and(|v| v == "1") {
            // A wait with no synchronize since the copy: the clock cannot vouch for it, so from
            // here on this memory's copies are marked by an event each.
            own_dev.upload_async(&own_host)?;
            own_host.as_slice()?;
        }
        // SAFETY: page-locked memory, written (`fill`) before any read.
        let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(n, 0)? };
        pinned.as_mut_slice()?.fill(7);
        let mut slice = cs.alloc_zeros::<u8>(n)?;
        let raw_dev = cs.alloc_zeros::<u8>(n)?;
        let (raw_ptr, _record) = raw_dev.device_ptr(&cs);
        let raw_host = pinned.as_ptr()?.cast_mut();

        for upload in [true, false] {
            let mut times = [Vec::new(), Vec::new(), Vec::new()];
            for round in 0..=rounds {
                for (v, t) in times.iter_mut().enumerate() {
                    let start = Instant::now();
                    for _ in 0..BLOCK {
                        match (v, upload) {
                            (0, true) => own_dev.upload_async(&own_host)?,
                            (0, false) => own_dev.download_async(&mut own_host)?,
                            (1, true) => cs.memcpy_htod(&pinned, &mut slice)?,
                            (1, false) => cs.memcpy_dtoh(&slice, &mut pinned)?,
                            // SAFETY: `raw_host` is `n` page-locked bytes and `raw_ptr` `n` device
                            // bytes, both live until the end of the size; the host reads or
                            // writes `raw_host` only after the synchronize below.
                            (_, true) => unsafe {
                                let src = std::slice::from_raw_parts(raw_host, n);
                                result::memcpy_htod_async(raw_ptr, src, cs.cu_stream())?
                            },
                            // SAFETY: as above.
                            (_, false) => unsafe {
                                let dst = std::slice::from_raw_parts_mut(raw_host, n);
                                result::memcpy_dtoh_async(dst, raw_ptr, cs.cu_stream())?
                            },
                        }
                    }
                    let elapsed = start.elapsed() / BLOCK as u32;
                    stream.synchronize()?;
                    if round > 0 {
                        t.push(elapsed); // round 0 warms up
                    }
                }
            }
            print_table(&mut times, (rows, cols), upload, rounds);
        }
    }
    Ok(())
}

/// The median (and 10th / 90th percentile) host time to queue one copy, with the medians' ratios
/// to the untracked floor.
fn print_table(times: &mut [Vec<Duration>; 3], (rows, cols): (usize, usize), up: bool, n: usize) {
    let ns = |t: &[Duration], p: usize| t[(t.len() - 1) * p / 100].as_nanos() as f64;
    for t in times.iter_mut() {
        t.sort();
    }
    let floor = ns(&times[2], 50);
    let what = if up { "upload" } else { "download" };
    println!(
        "\n### Queuing one {cols}x{rows} u8 {what} ({} bytes; {n} rounds of {BLOCK} a variant)\n\n\
         | variant | median / copy | p10 | p90 | vs `raw, untracked` |\n|---|---:|---:|---:|---:|",
        rows * cols
    );
    for (name, t) in VARIANTS.iter().zip(times.iter()) {
        let m = ns(t, 50);
        println!(
            "| `{name}` | {m:.0} ns | {:.0} ns | {:.0} ns | {:.2}x |",
            ns(t, 10),
            ns(t, 90),
            m / floor
        );
    }
}
