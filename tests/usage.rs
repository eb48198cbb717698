//! The process-wide usage flag. Its own test binary, since it changes global state; the tests here
//! hold `GLOBAL` so they do not race each other.

use std::sync::Mutex;

use gpu_pool::{
    Device, FallbackReason, PoolError, Source, Stream, compat::opencv::BufferPool,
    compat::opencv::buffer_pool_usage, compat::opencv::set_buffer_pool_config,
    compat::opencv::set_buffer_pool_usage, config::Fallback,
};

static GLOBAL: Mutex<()> = Mutex::new(());

fn private() -> Device {
    let device = Device::private_host();
    device.set_fallback(Fallback::Driver);
    device
}

#[test]
fn pooling_is_on_by_default() -> Result<(), PoolError> {
    let _g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    assert!(buffer_pool_usage()?);
    let stream = Stream::new(&private())?;
    assert_eq!(stream.stack_index(), Some(0));
    Ok(())
}

#[test]
fn streams_made_before_usage_was_switched_on_pool_from_their_first_request() -> Result<(), PoolError>
{
    let _g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    set_buffer_pool_usage(false);
    let device = private();
    // OpenCV's "NG" order: streams declared before setBufferPoolUsage(true).
    let stream = Stream::new(&device)?;
    assert_eq!(stream.stack_index(), None);
    let off = BufferPool::new(&stream).get_buffer_1d::<u8>(100)?;
    assert_eq!(off.source(), Source::Fallback(FallbackReason::Disabled));
    drop(off);

    set_buffer_pool_usage(true);
    set_buffer_pool_config(&device, 1 << 20, 1)?;
    let on = BufferPool::new(&stream).get_buffer_1d::<u8>(100)?;
    assert_eq!(on.source(), Source::Stack);
    assert_eq!(stream.stack_index(), Some(0));
    Ok(())
}

#[test]
fn with_usage_off_nothing_is_pooled_and_no_stack_memory_is_made() -> Result<(), PoolError> {
    let _g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    set_buffer_pool_usage(false);
    let device = private();
    let stream = Stream::new(&device)?;
    let buf = BufferPool::new(&stream).get_buffer::<f32>(8, 8)?;
    assert_eq!(buf.source(), Source::Fallback(FallbackReason::Disabled));
    let stats = device.stats();
    assert!(!stats.stacks_allocated);
    assert_eq!(stats.driver_alloc_calls, 1, "just the buffer's own");
    set_buffer_pool_usage(true);
    Ok(())
}
