//! Seeing the pool: call sites of fallbacks, peaks and errors; recordings and their exports.

use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::prelude::*;
use gpu_pool::{
    FallbackReason, compat::opencv::set_buffer_pool_config, config::Fallback, observe::RecordKind,
};

/// A device with one small stack and the given fallback.
fn small(fallback: Fallback) -> Device {
    let device = Device::private_host();
    device.set_fallback(fallback);
    set_buffer_pool_config(&device, 64 << 10, 1).expect("a valid config");
    device
}

/// The lines of `grows`'s `buffer!`s, as the pool reports them.
#[derive(Clone, Copy)]
struct Lines {
    wide: u32,
    huge: u32,
}

#[pooled(stream)]
fn grows(stream: &Stream, big: usize) -> Result<Lines, PoolError> {
    let _small = buffer!(1024; u8)?;
    let wide = line!() + 1;
    let _wide = buffer!(4, 4096; u8)?; // the peak: the stack is highest here
    let huge = line!() + 1;
    let _huge = buffer!(big; u8)?; // falls back when `big` exceeds what is left
    Ok(Lines { wide, huge })
}

#[test]
fn fallbacks_and_the_peak_name_their_buffer_lines() -> Result<(), PoolError> {
    let device = small(Fallback::Driver);
    let stream = Stream::new(&device)?;
    grows(&stream, 100 << 10)?;
    let lines = grows(&stream, 100 << 10)?;
    let stats = stream.stats();
    assert_eq!(stats.fallback_sites.len(), 1, "{:?}", stats.fallback_sites);
    let site = stats.fallback_sites[0];
    assert_eq!(site.site.name(), Some("_huge"));
    assert!(
        site.site.file().ends_with("observe.rs"),
        "{}",
        site.site.file()
    );
    assert_eq!(site.site.line(), lines.huge);
    assert_eq!((site.count, site.reason), (2, FallbackReason::TooLarge));
    // Short of what the stack had free: all of it but what `_small` and `_wide` held.
    assert_eq!(
        site.bytes_short,
        (100 << 10) - ((64 << 10) - stats.stack_high_water)
    );
    let peak = stats.peak_at.expect("a peak was reached");
    assert_eq!(peak.line(), lines.wide);
    let report = gpu_pool::observe::report().to_string();
    assert!(
        report.contains(&format!("`_huge` at {}:{}", site.site.file(), lines.huge)),
        "{report}"
    );
    assert!(
        report.contains(&format!("peak reached at {}:{}", peak.file(), lines.wide)),
        "{report}"
    );
    Ok(())
}

#[pooled(stream)]
fn too_big(stream: &Stream) -> Result<(), PoolError> {
    let _fits = buffer!(8192; u8)?;
    let _image = buffer!(512, 512; f32)?;
    Ok(())
}

#[test]
fn an_exhausted_stack_names_the_line_the_stream_and_the_setting_that_fixes_it() {
    let device = small(Fallback::Error);
    let stream = Stream::new(&device).expect("a stream");
    let err = too_big(&stream).unwrap_err();
    let PoolError::StackExhausted {
        context: Some(context),
        requested,
        ..
    } = &err
    else {
        panic!("{err}");
    };
    assert_eq!(context.stream, stream.id());
    assert_eq!(context.site.name(), Some("_image"));
    let text = err.to_string();
    assert!(text.contains(&format!("stream {}", stream.id())), "{text}");
    assert!(text.contains("observe.rs:"), "{text}");
    // 8 KiB in use plus the 1 MiB image: a 2 MiB stack (in whole MiB) serves it.
    assert_eq!(*requested, 512 * 512 * 4);
    assert!(text.contains("GPU_POOL_CONF=stack_size=2MiB"), "{text}");
    assert_eq!(
        stream.stats().stack_in_use,
        0,
        "the buffer taken first went back"
    );
}

#[test]
fn runtime_api_requests_are_attributed_to_their_caller() -> Result<(), PoolError> {
    let device = Device::host_with_limit(8 << 20);
    set_buffer_pool_config(&device, 1 << 20, 1)?;
    let stream = Stream::new(&device)?;
    let pool = BufferPool::new(&stream);
    let (line, err) = (line!(), pool.get_buffer_1d::<u8>(1 << 30).unwrap_err());
    let PoolError::OutOfMemory {
        context: Some(request),
        ..
    } = err
    else {
        panic!("{err}");
    };
    let site = request.site;
    assert_eq!((site.name(), site.line()), (None, line));
    assert_eq!(request.stream, stream.id());
    // 1 GiB is more than a whole 1 MiB stack: a 1 GiB stack would have held it.
    assert_eq!(request.stack_needed, Some(1 << 30));
    assert!(
        err.to_string().contains(&format!("stream {}", stream.id())),
        "{err}"
    );
    assert!(
        err.to_string().contains("GPU_POOL_CONF=stack_size=1024MiB"),
        "{err}"
    );
    assert!(
        err.to_string().contains(&format!("observe.rs:{line}")),
        "{err}"
    );
    let line = line!() + 1;
    let err = GpuMat::<u8>::new(&stream, 1 << 20, 1 << 20).unwrap_err();
    assert!(
        err.to_string().contains(&format!("observe.rs:{line}")),
        "{err}"
    );
    Ok(())
}

#[test]
fn nothing_is_recorded_unless_asked() -> Result<(), PoolError> {
    let device = Device::private_host();
    let stream = Stream::new(&device)?;
    drop(BufferPool::new(&stream).get_buffer_1d::<u8>(64)?);
    assert!(device.recordings().is_empty());
    assert_eq!(device.recording_events_per_stream()?, 0);
    Ok(())
}

#[test]
fn a_recording_keeps_the_last_events_of_each_stream() -> Result<(), PoolError> {
    let device = small(Fallback::Driver);
    device.set_recording(6);
    let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
    for _ in 0..5 {
        grows(&a, 100 << 10)?; // 3 takes and 3 releases each, one a fallback
    }
    drop(BufferPool::new(&b).get_buffer::<u16>(8, 8)?);
    let recordings = device.recordings();
    assert_eq!(recordings.len(), 2);
    let ra = recordings.iter().find(|r| r.stream == a.id()).expect("a's");
    assert_eq!(
        (ra.events.len(), ra.dropped),
        (6, 30 - 6),
        "the ring holds the last 6"
    );
    // The last call, in order: three takes, then three releases in reverse.
    let kinds: Vec<RecordKind> = ra.events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [RecordKind::Take; 3]
            .into_iter()
            .chain([RecordKind::Release; 3])
            .collect::<Vec<_>>()
    );
    assert_eq!(ra.events[0].site.and_then(|s| s.name()), Some("_small"));
    assert!(matches!(
        ra.events[2].source,
        Source::Fallback(FallbackReason::TooLarge)
    ));
    assert_eq!(ra.events[1].stack_in_use, a.stats().stack_high_water);
    assert_eq!(ra.events[5].stack_in_use, 0);
    assert!(ra.events.windows(2).all(|w| w[0].t_ns <= w[1].t_ns));
    assert_eq!(ra.stack_size, 64 << 10);
    // A dropped stream's recording is kept.
    let b_id = b.id();
    drop(b);
    assert!(
        device
            .recordings()
            .iter()
            .any(|r| r.stream == b_id && r.events.len() == 2)
    );
    Ok(())
}

#[cfg(feature = "timeline")]
#[test]
fn the_exports_hold_every_stream_and_every_fallback() -> Result<(), PoolError> {
    let device = small(Fallback::Driver);
    set_buffer_pool_config(&device, 64 << 10, 2)?; // a stack for each stream
    device.set_recording(1000);
    let streams = [Stream::new(&device)?, Stream::new(&device)?];
    let lines = grows(&streams[0], 100 << 10)?; // falls back
    grows(&streams[1], 8 << 10)?; // does not
    let recordings = device.recordings();
    let trace: serde_json::Value =
        serde_json::from_str(&gpu_pool::observe::timeline::chrome_trace(&recordings))
            .expect("JSON");
    let events = trace["traceEvents"].as_array().expect("a trace");
    for stream in &streams {
        let of = |ph: &str| {
            events
                .iter()
                .filter(|e| e["ph"] == ph && e["tid"] == stream.id())
                .count()
        };
        assert_eq!(of("C"), 6, "a counter sample per take and release");
        assert_eq!(of("i"), 3, "an instant per take");
    }
    let fallbacks: Vec<&serde_json::Value> =
        events.iter().filter(|e| e["cat"] == "fallback").collect();
    assert_eq!(fallbacks.len(), 1);
    assert_eq!(fallbacks[0]["name"], "_huge");
    assert_eq!(fallbacks[0]["tid"], streams[0].id());
    let site = fallbacks[0]["args"]["site"].as_str().expect("a site");
    assert!(
        site.ends_with(&format!("observe.rs:{}", lines.huge)),
        "{site}"
    );

    let svg = gpu_pool::observe::timeline::svg(&recordings)?;
    for stream in &streams {
        let label = format!("stream {} ({})", stream.id(), device.id());
        assert_eq!(svg.matches(&label).count(), 1, "one series for {label}");
    }
    assert_eq!(
        svg.matches("stack size (0.06 MiB)").count(),
        1,
        "the stack size marked"
    );
    assert_eq!(svg.matches("<circle").count(), 1, "one fallback dot");
    let path = std::env::temp_dir().join(format!("gpu-pool-timeline-{}.svg", std::process::id()));
    gpu_pool::observe::timeline::write_svg(&path)?;
    let written = std::fs::read_to_string(&path).expect("written");
    assert!(written.contains(&format!("stream {}", streams[1].id())));
    let _ = std::fs::remove_file(path);
    Ok(())
}

/// The report's first line says what is configured: growable stacks are not "10 MiB x 5 stacks,
/// memory not allocated".
#[test]
fn the_report_says_growable_stacks_are_growable() -> Result<(), PoolError> {
    let device = Device::private_host();
    device.set_growable_stacks(true)?;
    let stream = Stream::new(&device)?;
    drop(BufferPool::new(&stream).get_buffer_1d::<u8>(12 << 20)?);
    let report = gpu_pool::observe::Report::new(vec![device.stats()]).to_string();
    let first = report
        .lines()
        .find(|l| l.starts_with(&format!("{}: config", device.id())))
        .expect("a line for the device");
    assert!(
        first.contains(
            "config growable stacks (10.00 MiB mapped at a stream's start; 1 held, 12.00 MiB \
             mapped now)"
        ),
        "{first}"
    );
    assert!(!first.contains("x 5 stacks"), "{first}");

    // Fixed stacks say their size, count and memory.
    let fixed = Device::private_host();
    set_buffer_pool_config(&fixed, 1 << 20, 2)?;
    let report = gpu_pool::observe::Report::new(vec![fixed.stats()]).to_string();
    assert!(
        report.contains("config 1.00 MiB x 2 stacks (0 held, memory not allocated)"),
        "{report}"
    );
    Ok(())
}
