//! One configuration value per device: `Device::configure`, `Device::config`, the setters that
//! wrap them, and `DeviceConfig::from_env_value` (the precedence over a real `GPU_POOL_CONF` is in
//! `tests/env_conf.rs`).

use gpu_pool::{
    Device, GpuRead, PoolError, Source, Stream, compat::opencv::BufferPool,
    compat::opencv::set_buffer_pool_config, config::DeviceConfig, config::Fallback,
    config::Packing, config::PoolConfig, config::Stacks,
};

use super::MIB;

fn every_field_changed() -> Result<DeviceConfig, PoolError> {
    let mut config = DeviceConfig::default();
    config.stacks = Stacks::Fixed(PoolConfig::new(2 * MIB, 3)?);
    config.fallback = Fallback::Error;
    config.strict_lifo = true;
    config.packing = Packing::OpenCv;
    config.record = 8;
    config.exact_live_peak = true;
    config.memory_limit = Some(512 * MIB);
    Ok(config)
}

#[test]
fn configure_then_config_gives_the_same_value_back() -> Result<(), PoolError> {
    let device = Device::private_host();
    let config = every_field_changed()?;
    device.configure(config.clone())?;
    assert_eq!(device.config()?, config);
    // The old getters read the same value.
    assert_eq!(device.pool_config()?, PoolConfig::new(2 * MIB, 3)?);
    assert_eq!(device.fallback()?, Fallback::Error);
    assert!(device.strict_lifo()?);
    assert_eq!(device.packing()?, Packing::OpenCv);
    assert_eq!(device.recording_events_per_stream()?, 8);
    assert!(device.exact_live_peak());
    assert_eq!(device.memory_limit(), Some(512 * MIB));
    Ok(())
}

#[test]
fn the_old_setters_write_the_one_value() -> Result<(), PoolError> {
    let device = Device::private_host();
    set_buffer_pool_config(&device, 2 * MIB, 3)?;
    device.set_fallback(Fallback::Error);
    device.set_strict_lifo(true);
    device.set_packing(Packing::OpenCv);
    device.set_recording(8);
    device.set_exact_live_peak(true);
    device.set_memory_limit(Some(512 * MIB));
    assert_eq!(device.config()?, every_field_changed()?);
    device.set_growable_stacks(true)?;
    assert_eq!(
        device.config()?.stacks,
        Stacks::Growable { mapped: 2 * MIB },
        "the stack size becomes what is mapped at a stream's start"
    );
    Ok(())
}

#[test]
fn a_fresh_host_device_has_the_host_defaults() -> Result<(), PoolError> {
    let device = Device::private_host();
    let mut expected = DeviceConfig::default();
    if !device.supports_stream_ordered() {
        expected.fallback = Fallback::Driver;
    }
    assert_eq!(device.config()?, expected);
    Ok(())
}

#[test]
fn streams_keep_what_they_were_made_with() -> Result<(), PoolError> {
    let device = Device::private_host();
    let mut config = device.config()?;
    config.fallback = Fallback::Driver;
    config.packing = Packing::OpenCv;
    device.configure(config.clone())?;
    let before = Stream::new(&device)?;
    config.fallback = Fallback::Error;
    config.packing = Packing::Cuda;
    device.configure(config)?; // the stacks stay: allowed while `before` holds one
    let after = Stream::new(&device)?;
    for (stream, gap, big) in [(&before, 64, true), (&after, 256, false)] {
        let pool = BufferPool::new(stream);
        let (a, b) = (pool.get_buffer_1d::<u8>(10)?, pool.get_buffer_1d::<u8>(10)?);
        assert_eq!(
            b.device_ptr() - a.device_ptr(),
            gap,
            "packing of {}",
            stream.id()
        );
        let fell_back = pool.get_buffer_1d::<u8>(64 * MIB);
        assert_eq!(fell_back.is_ok(), big, "fallback of {}", stream.id());
        if let Ok(buffer) = fell_back {
            assert!(matches!(buffer.source(), Source::Fallback(_)));
        }
    }
    Ok(())
}

#[test]
fn a_refused_configure_changes_nothing() -> Result<(), PoolError> {
    let device = Device::private_host();
    let stream = Stream::new(&device)?;
    let held = BufferPool::new(&stream).get_buffer_1d::<u8>(100)?;
    let before = device.config()?;
    let mut config = every_field_changed()?;
    let err = device.configure(config.clone()).unwrap_err();
    assert_eq!(
        err,
        PoolError::ConfigInUse {
            device: device.id(),
            held: 1
        }
    );
    assert_eq!(
        device.config()?,
        before,
        "no field changed, the limit neither"
    );
    drop(held);
    drop(stream);
    config.stacks = before.stacks;
    device.configure(config.clone())?;
    assert_eq!(device.config()?, config);
    Ok(())
}

#[test]
fn growable_stacks_configured_as_a_value_serve_what_fixed_ones_cannot() -> Result<(), PoolError> {
    let device = Device::private_host();
    let mut config = device.config()?;
    config.stacks = Stacks::Growable { mapped: 0 };
    // The host backend models virtual memory management: growable stacks work there.
    device.configure(config.clone())?;
    let stream = Stream::new(&device)?;
    assert_eq!(
        stream.stats().stack_mapped,
        0,
        "mapped: 0 maps nothing up front"
    );
    let big = BufferPool::new(&stream).get_buffer_1d::<u8>(32 * MIB)?;
    assert_eq!(big.source(), Source::Stack);
    config.stacks = Stacks::Growable { mapped: 4 * MIB };
    device.configure(config)?;
    let other = Stream::new(&device)?;
    assert_eq!(
        other.stats().stack_mapped,
        4 * MIB,
        "what the config says, at once"
    );
    Ok(())
}

#[test]
fn from_env_value_reads_every_field_over_the_defaults() -> Result<(), PoolError> {
    let config = DeviceConfig::from_env_value(
        "stack_size=2MiB, stack_count=3, fallback=error, strict_lifo=on, packing=opencv, \
         record=8, exact_live_peak=on, memory_limit=512MiB",
    )?;
    assert_eq!(config, every_field_changed()?);
    assert_eq!(DeviceConfig::from_env_value("")?, DeviceConfig::default());
    let growable = DeviceConfig::from_env_value("growable=on,stack_size=4MiB")?;
    assert_eq!(growable.stacks, Stacks::Growable { mapped: 4 * MIB });
    assert_eq!(
        DeviceConfig::from_env_value("growable=off")?.stacks,
        Stacks::Fixed(PoolConfig::default())
    );
    assert_eq!(
        DeviceConfig::from_env_value("memory_limit=none")?.memory_limit,
        None
    );
    Ok(())
}

#[test]
fn bad_values_are_typed_errors_that_say_what_to_write() {
    for (bad, why) in [
        ("growable=maybe", "expected on or off"),
        ("growable=on,stack_count=2", "drop stack_count"),
        ("exact_live_peak=2", "expected on or off"),
        ("memory_limit=lots", "or none"),
        ("stack_size=0", "must not be 0"),
        ("stacks=growable", "unknown key"),
    ] {
        let err = DeviceConfig::from_env_value(bad).unwrap_err();
        assert!(
            matches!(err, PoolError::InvalidEnvConfig { .. }),
            "{bad}: {err}"
        );
        assert!(err.to_string().contains(why), "{bad}: {err}");
    }
}
