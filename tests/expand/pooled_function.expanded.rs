fn gray_threshold(stream: &Stream, src: &GpuMat<[u8; 3]>) -> Result<(), PoolError> {
    let __gpu_pool_scope = ::gpu_pool::__private::scope(&*stream);
    let mut gray = {
        let __gpu_pool_size_0: usize = src.rows();
        let __gpu_pool_size_1: usize = src.cols();
        ::gpu_pool::__private::take::<
            u8,
        >(&__gpu_pool_scope, __gpu_pool_size_0, __gpu_pool_size_1, "gray")
    }?;
    let mut gray = ::gpu_pool::__private::handle(&mut gray);
    let mut sums = {
        let __gpu_pool_size_0: usize = src.rows();
        ::gpu_pool::__private::take_1d::<
            f32,
        >(&__gpu_pool_scope, __gpu_pool_size_0, "sums")
    }?;
    let sums = ::gpu_pool::__private::handle(&mut sums);
    gray.set_to(0)?;
    Ok(())
}
