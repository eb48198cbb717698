impl Filter {
    fn run(&mut self, other: &Stream) -> Result<u32, PoolError> {
        let __gpu_pool_stream = &(self.stream);
        let __gpu_pool_scope = ::gpu_pool::__private::scope(__gpu_pool_stream);
        let mut x = {
            let __gpu_pool_size_0: usize = 16;
            ::gpu_pool::__private::take_1d::<
                u32,
            >(&__gpu_pool_scope, __gpu_pool_size_0, "x")
        }?;
        let x = ::gpu_pool::__private::handle(&mut x);
        let y = {
            let __gpu_pool_stream = &(other);
            let __gpu_pool_scope = ::gpu_pool::__private::scope(__gpu_pool_stream);
            let mut y = {
                let __gpu_pool_size_0: usize = 16;
                ::gpu_pool::__private::take_1d::<
                    u32,
                >(&__gpu_pool_scope, __gpu_pool_size_0, "y")
            }?;
            let mut y = ::gpu_pool::__private::handle(&mut y);
            y.copy_from(&x)?;
            y.len() as u32
        };
        Ok(y)
    }
}
