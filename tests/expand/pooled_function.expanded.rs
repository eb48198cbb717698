fn gray_threshold(stream: &Stream, src: &GpuMat<[u8; 3]>) -> Result<(), PoolError> {
    let __gpu_pool_frame = ::gpu_pool::__private::frame(&*stream);
    let mut gray = {
        let __gpu_pool_size_0: usize = src.rows();
        let __gpu_pool_size_1: usize = src.cols();
        __gpu_pool_frame.take::<u8>(__gpu_pool_size_0, __gpu_pool_size_1, "gray")
    }?;
    let mut gray = gray.handle();
    let mut sums = {
        let __gpu_pool_size_0: usize = src.rows();
        __gpu_pool_frame.take_1d::<f32>(__gpu_pool_size_0, "sums")
    }?;
    let sums = sums.handle();
    gray.set_to(0)?;
    Ok(())
}
