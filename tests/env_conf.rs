//! `GPU_POOL_CONF` is read once per process, so each case runs this test binary again as a child
//! process with the variable set, and the child runs `child_reports_what_it_sees`.

use std::process::Command;

use gpu_pool::config::{DeviceConfig, EnvConfig, Fallback, Packing, Stacks};
use gpu_pool::{Device, GpuRead, PoolError, Stream};

const CHILD: &str = "child_reports_what_it_sees";

fn run_child(conf: &str) -> String {
    run_named_child(CHILD, conf)
}

fn run_named_child(child: &str, conf: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            child,
            "--nocapture",
            "--include-ignored",
            "--test-threads=1",
        ])
        .env("GPU_POOL_CONF", conf)
        .output()
        .expect("the test binary runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Prints what the process sees; only meaningful as a child of the tests below.
#[test]
#[ignore = "run as a child process by the tests of this file"]
fn child_reports_what_it_sees() {
    let device = Device::private_host();
    match Stream::new(&device) {
        Ok(stream) => {
            let pool = gpu_pool::compat::opencv::BufferPool::new(&stream);
            let _b = pool.get_buffer_1d::<u8>(64);
            let events: usize = device.recordings().iter().map(|r| r.events.len()).sum();
            let next = pool.get_buffer_1d::<u8>(64);
            let gap = match (&_b, &next) {
                (Ok(a), Ok(b)) => b.device_ptr() - a.device_ptr(),
                _ => 0,
            };
            println!(
                "RESULT config={:?} fallback={:?} usage={:?} stack={:?} record={:?} events={events} \
                 packing={:?} gap={gap}",
                device.pool_config(),
                device.fallback(),
                gpu_pool::compat::opencv::buffer_pool_usage(),
                stream.stack_index(),
                device.recording_events_per_stream(),
                device.packing(),
            )
        }
        Err(e) => println!(
            "RESULT error={e} stats_config_is_err={} fallback_is_err={} strict_is_err={}",
            device.stats().config.is_err(),
            device.fallback().is_err(),
            device.strict_lifo().is_err(),
        ),
    }
}

#[test]
fn a_valid_value_configures_every_device() {
    let out = run_child("stack_size=64MiB,stack_count=2,fallback=driver");
    assert!(
        out.contains("stack_size: 67108864, stack_count: 2"),
        "{out}"
    );
    assert!(out.contains("fallback=Ok(Driver)"), "{out}");
}

#[test]
fn record_in_the_environment_records_every_new_stream() {
    let out = run_child("record=16");
    assert!(out.contains("record=Ok(16) events=1"), "{out}");
    let out = run_child("");
    assert!(out.contains("record=Ok(0) events=0"), "{out}");
}

#[test]
fn packing_in_the_environment_chooses_where_blocks_start() {
    let out = run_child("packing=opencv");
    assert!(out.contains("packing=Ok(OpenCv) gap=64"), "{out}");
    let out = run_child("");
    assert!(out.contains("packing=Ok(Cuda) gap=256"), "{out}");
}

#[test]
fn usage_off_in_the_environment_means_no_stack() {
    let out = run_child("usage=off");
    assert!(out.contains("usage=Ok(false) stack=None"), "{out}");
}

#[test]
fn a_malformed_value_is_an_error_at_first_use() {
    let out = run_child("stack_size=64MiB,stack_cnt=2");
    assert!(out.contains("RESULT error=invalid GPU_POOL_CONF"), "{out}");
    assert!(out.contains("unknown key `stack_cnt`"), "{out}");
    // The settings the variable would have chosen are that error too, not silent defaults.
    assert!(
        out.contains("stats_config_is_err=true fallback_is_err=true strict_is_err=true"),
        "{out}"
    );
}

#[test]
fn parse_accepts_units_and_spaces_and_refuses_the_rest() -> Result<(), PoolError> {
    let conf =
        EnvConfig::parse(" stack_size = 512KiB , stack_count=3, usage=on, strict_lifo=off ")?;
    assert_eq!(conf.stack_size, Some(512 << 10));
    assert_eq!(conf.stack_count, Some(3));
    assert_eq!((conf.usage, conf.strict_lifo), (Some(true), Some(false)));
    assert_eq!(EnvConfig::parse("")?, EnvConfig::default());
    assert_eq!(EnvConfig::parse("record=4096")?.record, Some(4096));
    assert_eq!(
        EnvConfig::parse("packing=opencv")?.packing,
        Some(Packing::OpenCv)
    );
    assert_eq!(
        EnvConfig::parse("packing=cuda")?.packing,
        Some(Packing::Cuda)
    );
    assert_eq!(EnvConfig::parse("stack_size=1g")?.stack_size, Some(1 << 30));
    assert_eq!(
        EnvConfig::parse("fallback=error")?.fallback,
        Some(Fallback::Error)
    );
    for (bad, why) in [
        ("stack_size", "not key=value"),
        ("stack_size=12XB", "expected a size"),
        ("stack_size=99999999999999999999", "expected a size"),
        ("stack_size=99999999999GiB", "expected a size"),
        ("stack_count=-1", "whole number"),
        ("stack_count=0", "must not be 0"),
        (
            "fallback=cuda",
            "expected driver, stream_ordered, caching or error",
        ),
        ("usage=maybe", "on or off"),
        ("record=lots", "whole number of events"),
        ("packing=64", "expected cuda or opencv"),
        ("stack_count=1,stack_count=2", "given twice"),
        ("colour=blue", "unknown key"),
    ] {
        let err = EnvConfig::parse(bad).unwrap_err();
        assert!(matches!(err, PoolError::InvalidEnvConfig { .. }));
        assert!(err.to_string().contains(why), "{bad}: {err}");
    }
    Ok(())
}

const CONFIG_CHILD: &str = "child_reports_the_precedence_of_device_config";

/// Prints a device's config under the variable, after one explicit setting, and after a whole
/// `configure`; only meaningful as a child of the tests below.
#[test]
#[ignore = "run as a child process by the tests of this file"]
fn child_reports_the_precedence_of_device_config() {
    let device = Device::private_host();
    println!("FROM_ENV {:?}", DeviceConfig::from_env());
    println!("FRESH {:?}", device.config());
    device.set_packing(Packing::Cuda);
    println!("ONE_SET {:?}", device.config());
    let mut whole = DeviceConfig::default();
    whole.fallback = Fallback::Error;
    whole.record = 2;
    device.configure(whole).expect("a valid config");
    println!("CONFIGURED {:?}", device.config());
}

fn line<'a>(out: &'a str, tag: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.find(tag).map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("no {tag} in {out}"))
}

#[test]
fn configure_wins_over_the_environment_which_wins_over_the_defaults() {
    let out = run_named_child(
        CONFIG_CHILD,
        "growable=on,stack_size=2MiB,fallback=driver,packing=opencv,record=4,exact_live_peak=on,\
         memory_limit=1GiB",
    );
    // The variable over the defaults, for `from_env` and for a fresh device alike.
    for tag in ["FROM_ENV", "FRESH"] {
        let l = line(&out, tag);
        assert!(l.contains("stacks: Growable { mapped: 2097152 }"), "{l}");
        assert!(l.contains("fallback: Driver"), "{l}");
        assert!(l.contains("packing: OpenCv"), "{l}");
        assert!(l.contains("record: 4"), "{l}");
        assert!(l.contains("exact_live_peak: true"), "{l}");
        assert!(l.contains("memory_limit: Some(1073741824)"), "{l}");
    }
    // One explicit setting wins over the variable; the rest still come from it.
    let l = line(&out, "ONE_SET");
    assert!(l.contains("packing: Cuda"), "{l}");
    assert!(l.contains("record: 4") && l.contains("Growable"), "{l}");
    // A whole configure wins over all of it.
    let l = line(&out, "CONFIGURED");
    assert!(
        l.contains("fallback: Error") && l.contains("record: 2"),
        "{l}"
    );
    assert!(l.contains("Fixed(") && l.contains("packing: Cuda"), "{l}");
    assert!(
        l.contains("exact_live_peak: false, memory_limit: None"),
        "{l}"
    );
    let _ = Stacks::Growable { mapped: 0 }; // the type the lines print
}

#[test]
fn a_malformed_variable_is_an_error_until_configure_sets_everything() {
    let out = run_named_child(CONFIG_CHILD, "packing=sideways");
    assert!(
        line(&out, "FROM_ENV").contains("Err(InvalidEnvConfig"),
        "{out}"
    );
    assert!(
        line(&out, "FRESH").contains("Err(InvalidEnvConfig"),
        "{out}"
    );
    assert!(
        line(&out, "ONE_SET").contains("Err(InvalidEnvConfig"),
        "{out}"
    );
    assert!(
        line(&out, "CONFIGURED").starts_with("CONFIGURED Ok("),
        "{out}"
    );
}
