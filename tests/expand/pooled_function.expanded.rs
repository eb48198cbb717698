fn gray_threshold(stream: &Stream, src: &GpuMat<[u8; 3]>) -> Result<(), PoolError> {
    let __gpu_pool_frame = ::gpu_pool::__private::frame(&*stream);
    let mut gray = __gpu_pool_frame.take::<u8>(src.rows(), src.cols())?;
    let mut gray = gray.handle();
    let mut sums = __gpu_pool_frame.take_1d::<f32>(src.rows())?;
    let sums = sums.handle();
    gray.set_to(0)?;
    Ok(())
}
