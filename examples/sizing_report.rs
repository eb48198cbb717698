//! Sizing the pool without arithmetic: run the workload once, read the config `report()`
//! recommends, and run again with it and no fallback.
//!
//! The workload builds a 4K image pyramid (five levels, all live at once) on three streams, one per
//! thread, with `#[pooled]`: about 11.5 MiB per stream, more than the default 10 MiB stacks. The
//! first run falls back for the largest levels and prints the report; the example then starts
//! itself again with `GPU_POOL_CONF` set to the recommended value, as you would, and that run
//! reports no fallback. Both runs record every stream and write their timeline: an SVG chart of
//! stack use per stream with the fallbacks marked, and a Chrome trace (open it in Perfetto), to
//! `target/timeline/sizing_report_{first,second}.{svg,json}` (or the folder `TIMELINE_DIR` names).
//!
//! `cargo run --release --example sizing_report`

mod support;

use gpu_pool::prelude::*;
use support::Stages;
use support::kernels::pattern;

const ROWS: usize = 2160;
const COLS: usize = 3840;
const STREAMS: usize = 3;
/// Set in the second run's environment.
const SECOND_RUN: &str = "SIZING_REPORT_SECOND_RUN";

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
    let second = std::env::var_os(SECOND_RUN).is_some();
    let device = Device::cuda_or_host();
    device.set_recording(1 << 12); // every take and release of the run, for the timeline
    let stages = Stages::new(&device);
    println!(
        "== {} run, device: {}, config {} ({})",
        if second { "second" } else { "first" },
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

    let report = gpu_pool::report();
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
    let name = if second { "second" } else { "first" };
    let (svg, trace) = (
        dir.join(format!("sizing_report_{name}.svg")),
        dir.join(format!("sizing_report_{name}.json")),
    );
    gpu_pool::timeline::write_svg(&svg)?;
    gpu_pool::timeline::write_chrome_trace(&trace)?;
    println!("timeline: {} and {}", svg.display(), trace.display());
    device.release_stack_memory()?; // the streams are gone: everything freed before exit
    if second {
        println!("fallback buffers with the recommended config: {fallbacks}");
        std::process::exit(if fallbacks == 0 { 0 } else { 1 });
    }
    let Some(recommended) = stats.recommended_config() else {
        return Ok(());
    };
    println!(
        "fallback buffers with the default config: {fallbacks}; running again with \
         GPU_POOL_CONF={}\n",
        recommended.env_value()
    );
    let exe = std::env::current_exe()?;
    let status = std::process::Command::new(exe)
        .env("GPU_POOL_CONF", recommended.env_value())
        .env(SECOND_RUN, "1")
        .status()?;
    std::process::exit(status.code().unwrap_or(1));
}
