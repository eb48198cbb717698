//! One type per job (issue 31 item 3): `Temp` (a stack temporary, LIFO on its stream) and
//! `DeviceMat` (a driver allocation, any order), OpenCV's `GpuMat` over both, `MixMemory` over
//! `HostMem`, ppl.cv's pool as a value. On a private host device and on the GPU where there is one.

use crate::common::each_device;
use gpu_pool::compat::opencv::{BufferPool, GpuMat};
use gpu_pool::compat::pplcv::PplPool;
use gpu_pool::{
    DeviceMat, GpuRead, GpuWrite, PoolError, Source, Stream, Temp, compat::mix::MixMemory,
};

/// OpenCV-style code: takes `&GpuMat`, so it must keep taking both new types.
fn sum_opencv(m: &GpuMat<'_, u32>) -> Result<u32, PoolError> {
    Ok(m.to_vec()?.iter().sum())
}

#[test]
fn temps_are_stack_memory_and_device_mats_go_back_in_any_order() -> Result<(), PoolError> {
    each_device("types_rules", |device| {
        let stream = Stream::new(device)?;
        let mut below: Temp<'_, u32> = stream.temp(4, 4)?;
        let mut own: DeviceMat<'_, u32> = DeviceMat::new(&stream, 4, 4)?;
        let mut above = stream.temp_packed::<u32>(2, 3)?;
        assert_eq!(
            (below.source(), own.source(), above.source()),
            (Source::Stack, Source::Driver, Source::Stack)
        );
        assert_eq!(above.step(), 12, "packed");
        below.set_to(1)?;
        own.set_to(2)?;
        above.set_to(3)?;
        // Both coerce to OpenCV's type, read-only.
        assert_eq!(
            (sum_opencv(&below)?, sum_opencv(&own)?, sum_opencv(&above)?),
            (16, 32, 18)
        );
        // A driver allocation dropped between two temporaries breaks no order...
        drop(own);
        above.release()?;
        below.release()?;
        let stats = stream.stats();
        assert_eq!(
            (stats.lifo_violations, stats.stack_in_use),
            (0, 0),
            "a DeviceMat goes back in any order, the temporaries in theirs"
        );
        // ...and a temporary converted to OpenCV's type keeps its memory and its rule.
        let temp = stream.temp_1d::<u32>(64)?;
        let address = temp.device_ptr();
        let mat: GpuMat<'_, u32> = temp.into();
        assert_eq!((mat.device_ptr(), mat.source()), (address, Source::Stack));
        drop(mat);
        assert_eq!(stream.stats().stack_in_use, 0);
        let pooled = BufferPool::new(&stream).get_buffer::<u8>(2, 2)?;
        assert_eq!(pooled.source(), Source::Stack);
        Ok(())
    })
}

#[test]
fn from_host_packed_uploads_rows_with_no_padding() -> Result<(), PoolError> {
    each_device("types_from_host_packed", |device| {
        let stream = Stream::new(device)?;
        let data: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let packed = DeviceMat::from_host_packed(&stream, 2, 3, &data)?;
        let padded = DeviceMat::from_host(&stream, 2, 3, &data)?;
        assert_eq!(packed.step(), 12);
        assert!(packed.is_continuous() && packed.as_1d().is_ok());
        assert_eq!(packed.to_vec()?, data);
        assert_eq!(padded.to_vec()?, data);
        Ok(())
    })
}

#[test]
fn mix_memory_copies_the_shorter_side_and_tracks_copies_across_streams() -> Result<(), PoolError> {
    each_device("types_mix", |device| {
        let (a, b) = (Stream::new(device)?, Stream::new(device)?);
        let mut mix = MixMemory::new(device)?;
        mix.cpu::<u32>(8)?
            .copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let binding = mix.gpu::<u32>(4)?.device_ptr(); // a shorter device side
        assert_eq!(mix.device_ptr(), binding);
        assert_eq!(mix.capacity(), (32, 16));
        mix.copy_to_gpu_async(&a)?; // the first 4 elements
        mix.cpu::<u32>(8)?.fill(0); // waits for the upload on `a`
        mix.copy_to_cpu_async(&b)?; // queued on another stream: ordered after `a`'s copy
        assert_eq!(mix.cpu::<u32>(8)?, &[1, 2, 3, 4, 0, 0, 0, 0]);
        Ok(())
    })
}

#[test]
fn ppl_pools_are_values_side_by_side_with_the_global_one() -> Result<(), PoolError> {
    each_device("types_pplcv", |device| {
        let pool = PplPool::new(device, 4096)?;
        let image = pool.malloc_pitch(700, 2)?;
        let row = pool.malloc(100)?;
        assert_eq!(
            (image.pitch(), image.size(), row.offset()),
            (1024, 2048, 2048)
        );
        assert!(matches!(
            pool.malloc(2048),
            Err(PoolError::OutOfMemory {
                requested: 2048,
                ..
            })
        ));
        drop(image);
        assert_eq!(
            pool.malloc(2048)?.offset(),
            0,
            "a dropped block's bytes are free again"
        );
        assert_eq!(pool.in_use(), 100);
        drop(row);
        pool.close()
    })
}
