//! MixMemory: lazy growth, zero fill, round trips on a stream, wrapped memory, release, and the
//! device guard. On a private host device and on the GPU where there is one.

use crate::common::each_device;
use gpu_pool::GpuRead;
use gpu_pool::{Device, PoolError, Stream, compat::mix::MixMemory, compat::opencv::GpuMat};

#[test]
fn it_grows_only_when_more_is_asked_and_new_memory_is_zero() -> Result<(), PoolError> {
    each_device("mix_growth", |device| {
        let stream = Stream::new(device)?;
        let mut mix = MixMemory::new(device)?;
        assert_eq!(mix.capacity(), (0, 0), "nothing until asked");
        mix.cpu::<u32>(100)?.fill(7);
        let first = mix.gpu::<u32>(100)?.device_ptr();
        assert_eq!(mix.reallocations(), 2);
        assert_eq!(
            mix.gpu::<u32>(50)?.device_ptr(),
            first,
            "less is served by what is held"
        );
        assert_eq!(mix.cpu::<u32>(100)?[99], 7, "and keeps its contents");
        assert_eq!(mix.reallocations(), 2);
        let calls = device.stats().driver_alloc_calls;
        let _ = mix.gpu::<u32>(1000)?; // more: a new, zeroed device side
        assert_eq!(device.stats().driver_alloc_calls, calls + 1);
        mix.cpu::<u32>(1000)?; // a new, zeroed host side
        mix.copy_to_cpu_async(&stream)?;
        assert!(
            mix.cpu::<u32>(1000)?.iter().all(|&v| v == 0),
            "zero-filled on both sides"
        );
        assert_eq!(mix.reallocations(), 4);
        assert!(matches!(
            mix.gpu::<u64>(usize::MAX),
            Err(PoolError::SizeOverflow { .. })
        ));
        Ok(())
    })
}

#[test]
fn round_trips_on_a_stream_and_waits_before_host_access() -> Result<(), PoolError> {
    each_device("mix_round_trip", |device| {
        let stream = Stream::new(device)?;
        let mut mix = MixMemory::new(device)?;
        let n = 1 << 20;
        for (i, v) in mix.cpu::<f32>(n)?.iter_mut().enumerate() {
            *v = i as f32;
        }
        let _ = mix.gpu::<f32>(n)?;
        for round in 0..3 {
            mix.copy_to_gpu_async(&stream)?;
            mix.cpu::<f32>(n)?.fill(-1.0); // waits for the upload first
            mix.copy_to_cpu_async(&stream)?;
            let back = mix.cpu::<f32>(n)?;
            assert_eq!(
                (back[0], back[n - 1]),
                (0.0, (n - 1) as f32),
                "round {round}"
            );
        }
        let other = Stream::new(&Device::private_host())?;
        if other.device() != device {
            assert!(matches!(
                mix.copy_to_gpu_async(&other),
                Err(PoolError::DeviceMismatch { .. })
            ));
        }
        Ok(())
    })
}

#[test]
fn wrapped_memory_is_used_in_place_and_never_freed() -> Result<(), PoolError> {
    each_device("mix_wrap", |device| {
        let stream = Stream::new(device)?;
        let owned_by_caller = GpuMat::<u8>::new(&stream, 1, 4096)?;
        let mut host = vec![0u8; 4096];
        host[..4].copy_from_slice(&[1, 2, 3, 4]);
        {
            let mut mix = MixMemory::wrap_cpu(device, &mut host)?;
            // SAFETY: `owned_by_caller` is 4096 bytes of this device, used by nothing else, and
            // outlives `mix`.
            unsafe { mix.wrap_gpu(owned_by_caller.device_ptr(), 4096)? };
            assert_eq!(
                mix.gpu::<u8>(4096)?.device_ptr(),
                owned_by_caller.device_ptr()
            );
            mix.copy_to_gpu_async(&stream)?;
            mix.synchronize()?;
            assert_eq!(mix.reallocations(), 0);
            let frees = device.stats().driver_free_calls;
            mix.release_all()?;
            assert_eq!(
                device.stats().driver_free_calls,
                frees,
                "wrapped memory is not freed"
            );
        }
        assert_eq!(&owned_by_caller.to_vec()?[..4], &[1, 2, 3, 4]);
        Ok(())
    })
}

#[cfg(feature = "cuda")]
#[test]
fn it_allocates_on_its_own_device_and_restores_the_callers_context()
-> Result<(), Box<dyn std::error::Error>> {
    use gpu_pool::interop::cudarc::driver::{CudaContext, result as cu};
    let Some((gpu, _lock)) = crate::common::gpu("mix_device_guard") else {
        return Ok(());
    };
    let other = CudaContext::new_non_primary(0, 0)?;
    other.bind_to_thread()?;
    let before = cu::ctx::get_current()?;
    {
        let stream = Stream::new(&gpu)?;
        let mut mix = MixMemory::new(&gpu)?;
        mix.cpu::<u16>(4096)?.fill(9);
        let _ = mix.gpu::<u16>(4096)?;
        mix.copy_to_gpu_async(&stream)?;
        mix.release_cpu()?;
        mix.cpu::<u16>(4096)?; // zeroed again
        mix.copy_to_cpu_async(&stream)?;
        assert!(mix.cpu::<u16>(4096)?.iter().all(|&v| v == 9));
    }
    assert_eq!(
        cu::ctx::get_current()?,
        before,
        "the caller's context is current again"
    );
    println!(
        "mix_device_guard: pinned and device memory on {}, caller's context kept",
        gpu.id()
    );
    Ok(())
}
