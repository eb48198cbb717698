//! Sizing the pool without arithmetic: run the workload once, read the config `report()`
//! recommends, and run again with it and no fallback.
//!
//! The workload builds a 4K image pyramid (five levels, all live at once) on three streams, one per
//! thread, with `#[pooled]`: about 11.5 MiB per stream, more than the default 10 MiB stacks. The
//! first run, on OpenCV's fixed stacks, falls back for the largest levels and prints the report;
//! the example then starts itself again with `GPU_POOL_CONF` set to the recommended value, as you
//! would, and that run reports no fallback. A third run gives every stream a growable stack
//! (`Device::set_growable_stacks`, the CUDA default where the device can map memory): no size to
//! choose, no fallback, memory mapped up to each stream's peak. Every run records every stream and
//! writes its timeline: an SVG chart of stack use per stream with the fallbacks marked (and the
//! mapped bytes of growable stacks dashed), and a Chrome trace (open it in Perfetto), to
//! `target/timeline/sizing_report_{first,second,growable}.{svg,json}` (or the folder
//! `TIMELINE_DIR` names).
//!
//! `cargo run --release --features timeline --example sizing_report`

mod support;

use gpu_pool::prelude::*;
use support::Stages;
use support::kernels::pattern;

const ROWS: usize = 2160;
const COLS: usize = 3840;
const STREAMS: usize = 3;
/// Set in the second run's environment.
/// Which run this process is: unset for the first, `second` or `growable`.
const RUN: &str = "SIZING_REPORT_RUN";

/// Every level of the pyramid of `seed`, live at once: wrong pixels.
#[pooled(stream)]
fn pyramid(stages: &Stages, stream: &Stream, seed: i32) -> Result<usize, PoolError> {
    let mut wrong = 0;
    let mut check = |level: GpuView<'_, u8>, host: Vec<u8>| {
        let cols = level.cols();
        wrong += host
            .iter()
            .enumerate()
            .filter(|&(i, &v)| v != pattern(i % cols, i / cols, seed))
            .count();
    };
    let mut l0 = buffer!(ROWS, COLS; u8)?;
    let mut l1 = buffer!(ROWS / 2, COLS / 2; u8)?;
    let mut l2 = buffer!(ROWS / 4, COLS / 4; u8)?;
    let mut l3 = buffer!(ROWS / 8, COLS / 8; u8)?;
    let mut l4 = buffer!(ROWS / 16, COLS / 16; u8)?;
    for level in [&mut l0, &mut l1, &mut l2, &mut l3, &mut l4] {
        stages.fill_pattern(stream, level.view_mut(), seed)?;
    }
    for level in [&l0, &l1, &l2, &l3, &l4] {
        check(level.view(), level.to_vec()?);
    }
    Ok(wrong)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run = std::env::var(RUN).unwrap_or_else(|_| "first".into());
    let second = run == "second";
    let device = Device::cuda_or_host();
    // The first two runs show OpenCV's fixed stacks, whatever the device's default.
    device.set_growable_stacks(run == "growable")?;
    device.set_recording(1 << 12); // every take and release of the run, for the timeline
    let stages = Stages::new(&device);
    println!(
        "== {run} run, device: {}, config {} ({})",
        Stages::describe(&device),
        device.pool_config()?.env_value(),
        std::env::var("GPU_POOL_CONF")
            .map_or("the default".into(), |v| format!("GPU_POOL_CONF={v}")),
    );

    let wrong: usize = std::thread::scope(|s| {
        let workers: Vec<_> = (0..STREAMS)
            .map(|t| {
                let (stages, device) = (&stages, &device);
                s.spawn(move || -> Result<usize, PoolError> {
                    let stream = Stream::new(device)?;
                    let mut wrong = 0;
                    for frame in 0..4 {
                        wrong += pyramid(stages, &stream, (t * 10 + frame) as i32)?;
                    }
                    Ok(wrong)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("the worker does not panic"))
            .sum::<Result<usize, PoolError>>()
    })?;

    let report = gpu_pool::observe::report();
    println!("{report}");
    let stats = report
        .devices
        .iter()
        .find(|d| d.device == device.id())
        .expect("the device was used");
    println!("pixels differing from the CPU reference: {wrong}");
    if wrong != 0 {
        std::process::exit(1);
    }
    let fallbacks = stats.fallback_allocations.total();
    let dir =
        std::env::var_os("TIMELINE_DIR").map_or("target/timeline".into(), std::path::PathBuf::from);
    std::fs::create_dir_all(&dir)?;
    let (svg, trace) = (
        dir.join(format!("sizing_report_{run}.svg")),
        dir.join(format!("sizing_report_{run}.json")),
    );
    gpu_pool::observe::timeline::write_svg(&svg)?;
    gpu_pool::observe::timeline::write_chrome_trace(&trace)?;
    println!("timeline: {} and {}", svg.display(), trace.display());
    device.release_stack_memory()?; // the streams are gone: everything freed before exit
    if run == "growable" {
        println!(
            "fallback buffers with growable stacks: {fallbacks}; mapped now (every stream \
             dropped): {} bytes",
            device.stats().stack_mapped
        );
        std::process::exit(if fallbacks == 0 { 0 } else { 1 });
    }
    let exe = std::env::current_exe()?;
    if second {
        println!("fallback buffers with the recommended config: {fallbacks}");
        if fallbacks != 0 {
            std::process::exit(1);
        }
        println!("\nrunning again with growable stacks\n");
        let status = std::process::Command::new(exe)
            .env_remove("GPU_POOL_CONF")
            .env(RUN, "growable")
            .status()?;
        std::process::exit(status.code().unwrap_or(1));
    }
    let Some(recommended) = stats.recommended_config() else {
        return Ok(());
    };
    println!(
        "fallback buffers with the default config: {fallbacks}; running again with \
         GPU_POOL_CONF={}\n",
        recommended.env_value()
    );
    let status = std::process::Command::new(exe)
        .env("GPU_POOL_CONF", recommended.env_value())
        .env(RUN, "second")
        .status()?;
    std::process::exit(status.code().unwrap_or(1));
}
