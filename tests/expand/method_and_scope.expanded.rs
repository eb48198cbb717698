impl Filter {
    fn run(&mut self, other: &Stream) -> Result<u32, PoolError> {
        let __gpu_pool_stream = &(self.stream);
        let __gpu_pool_frame = ::gpu_pool::__private::frame(__gpu_pool_stream);
        let mut x = {
            let __gpu_pool_size_0: usize = 16;
            __gpu_pool_frame.take_1d::<u32>(__gpu_pool_size_0, "x")
        }?;
        let x = x.handle();
        let y = {
            let __gpu_pool_stream = &(other);
            let __gpu_pool_frame = ::gpu_pool::__private::frame(__gpu_pool_stream);
            let mut y = {
                let __gpu_pool_size_0: usize = 16;
                __gpu_pool_frame.take_1d::<u32>(__gpu_pool_size_0, "y")
            }?;
            let mut y = y.handle();
            y.copy_from(&x)?;
            y.len() as u32
        };
        Ok(y)
    }
}
