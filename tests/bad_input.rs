//! Rows of RELIABILITY.md's bad-input matrix that no other test covers: each gets its typed error
//! and leaves everything as it was.

use gpu_pool::{BufferPool, Device, MixMemory, PoolError, Stream};

#[test]
fn typed_access_to_memory_not_aligned_for_the_type_is_an_error() -> Result<(), PoolError> {
    let device = Device::host_with_limit(None);
    let mut host = [0u8; 64];
    let mut mix = MixMemory::wrap_cpu(&device, &mut host[1..])?; // odd address
    let err = mix.cpu::<u32>(4).unwrap_err();
    assert!(matches!(err, PoolError::InvalidConfig { .. }), "{err}");
    assert_eq!(mix.cpu::<u8>(4)?.len(), 4, "the pair still works for bytes");

    let stream = Stream::new(&device)?;
    let owner = BufferPool::new(&stream).get_buffer_1d::<u8>(64)?;
    // SAFETY: 63 bytes of `owner`, which outlives `mix` and nothing else uses.
    unsafe { mix.wrap_gpu(owner.device_ptr() + 1, 63)? };
    let err = mix.gpu_view::<u32>(4).unwrap_err();
    assert!(err.to_string().contains("not aligned"), "{err}");
    assert_eq!(mix.gpu_view::<u8>(4)?.cols(), 4);
    Ok(())
}

#[test]
fn record_stream_with_a_stream_of_another_device_is_an_error() -> Result<(), PoolError> {
    let (a, b) = (Device::host_with_limit(None), Device::host_with_limit(None));
    let (sa, sb) = (Stream::new(&a)?, Stream::new(&b)?);
    let buf = BufferPool::new(&sa).get_buffer::<f32>(8, 8)?;
    assert!(matches!(
        buf.record_stream(&sb),
        Err(PoolError::DeviceMismatch { .. })
    ));
    Ok(())
}

#[test]
fn releasing_stack_memory_while_a_stream_holds_a_stack_is_refused() -> Result<(), PoolError> {
    let device = Device::host_with_limit(None);
    let stream = Stream::new(&device)?;
    let buf = BufferPool::new(&stream).get_buffer::<u8>(16, 16)?;
    let err = device.release_stack_memory().unwrap_err();
    assert!(
        matches!(err, PoolError::ConfigInUse { held: 1, .. }),
        "{err}"
    );
    assert_eq!(buf.to_vec()?.len(), 256, "the live buffer is untouched");
    drop(buf);
    drop(stream);
    assert_eq!(device.release_stack_memory()?, 50 << 20);
    assert_eq!(device.release_stack_memory()?, 0, "nothing left to free");
    assert_eq!(device.host_live_bytes(), Some(0));
    Ok(())
}
