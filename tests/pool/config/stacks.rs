//! Stack configuration: sizes, counts, the one allocation that holds every stack, handing stacks
//! over between streams, and reconfiguring.

use crate::common::each_device;
use gpu_pool::{
    BufferPool, Device, Fallback, FallbackReason, PoolConfig, PoolError, Source, Stream,
    set_buffer_pool_config,
};

use super::{MIB, private};

#[test]
fn invalid_configs_are_refused_with_advice() {
    let device = private(Fallback::Driver);
    for (size, count, hint) in [
        (0, 2, "stack_size is 0"),
        (MIB, 0, "set_buffer_pool_usage(false)"),
        (usize::MAX, 1, "overflow"),
        (usize::MAX / 2, 3, "overflow"),
    ] {
        let err = set_buffer_pool_config(&device, size, count).unwrap_err();
        assert!(matches!(err, PoolError::InvalidConfig { .. }), "{err}");
        assert!(err.to_string().contains(hint), "{err}");
    }
    assert_eq!(
        device.pool_config().unwrap(),
        PoolConfig::default(),
        "nothing changed"
    );
}

#[test]
fn stack_sizes_round_up_to_the_stack_alignment() -> Result<(), PoolError> {
    assert_eq!(PoolConfig::new(1, 1)?.stack_size(), PoolConfig::STACK_ALIGN);
    assert_eq!(PoolConfig::new(10_000_000, 1)?.stack_size(), 10_002_432);
    assert_eq!(PoolConfig::new(64 * MIB, 3)?.stack_size(), 64 * MIB);
    Ok(())
}

#[test]
fn reconfiguring_while_a_stack_is_held_changes_nothing() -> Result<(), PoolError> {
    each_device("reconfigure", reconfigure)
}

fn reconfigure(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, 4 * MIB, 2)?;
    let stream = Stream::new(device)?;
    let buf = BufferPool::new(&stream).get_buffer_1d::<u8>(1000)?;
    let err = set_buffer_pool_config(device, 8 * MIB, 1).unwrap_err();
    assert_eq!(
        err,
        PoolError::ConfigInUse {
            device: device.id(),
            held: 1
        }
    );
    assert_eq!(device.pool_config()?.stack_size(), 4 * MIB);
    drop(buf);
    drop(stream);

    // With no stack held, the old memory is freed and the new config used at the next stream.
    let frees = device.stats().driver_free_calls;
    set_buffer_pool_config(device, 8 * MIB, 1)?;
    assert_eq!(device.stats().driver_free_calls, frees + 1);
    assert!(!device.stats().stacks_allocated);
    let stream = Stream::new(device)?;
    let big = BufferPool::new(&stream).get_buffer_1d::<u8>(8 * MIB)?;
    assert_eq!(big.source(), Source::Stack);
    Ok(())
}

#[test]
fn stack_memory_is_one_allocation_made_at_first_need() -> Result<(), PoolError> {
    each_device("one_allocation", one_allocation)
}

fn one_allocation(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, 2 * MIB, 4)?;
    let calls = device.stats().driver_alloc_calls;
    let streams: Vec<Stream> = (0..4)
        .map(|_| Stream::new(device))
        .collect::<Result<_, _>>()?;
    let stats = device.stats();
    assert_eq!(
        (stats.driver_alloc_calls - calls, stats.stacks_held),
        (1, 4)
    );
    let bases: Vec<u64> = streams
        .iter()
        .map(|s| {
            BufferPool::new(s)
                .get_buffer_1d::<u8>(1)
                .map(|b| b.device_ptr())
        })
        .collect::<Result<_, _>>()?;
    for pair in bases.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            2 * MIB as u64,
            "stacks are adjacent slices"
        );
    }
    Ok(())
}

#[test]
fn a_dropped_stream_gives_its_stack_to_a_stackless_stream() -> Result<(), PoolError> {
    each_device("stack_handover", stack_handover)
}

fn stack_handover(device: &Device) -> Result<(), PoolError> {
    device.set_fallback(Fallback::Driver);
    set_buffer_pool_config(device, MIB, 1)?;
    let first = Stream::new(device)?;
    let second = Stream::new(device)?;
    let b = BufferPool::new(&second).get_buffer_1d::<u8>(10)?;
    assert_eq!(b.source(), Source::Fallback(FallbackReason::NoStack));
    drop(b);
    drop(first);
    let b = BufferPool::new(&second).get_buffer_1d::<u8>(10)?;
    assert_eq!(b.source(), Source::Stack);
    assert_eq!(second.stack_index(), Some(0));
    Ok(())
}

#[test]
fn the_stack_memory_itself_can_be_out_of_memory() {
    let device = Device::host_with_limit(Some(MIB));
    set_buffer_pool_config(&device, 2 * MIB, 1).unwrap();
    let err = Stream::new(&device).unwrap_err();
    assert!(matches!(err, PoolError::OutOfMemory { .. }), "{err}");
    assert_eq!(device.stats().stacks_held, 0);
}
