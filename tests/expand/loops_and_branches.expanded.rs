fn steps(stream: Stream, n: usize) -> Result<usize, PoolError> {
    let __gpu_pool_stream = &(stream);
    let __gpu_pool_scope = ::gpu_pool::__private::scope(__gpu_pool_stream);
    let mut total = 0;
    for i in 0..n {
        let mut t = {
            let __gpu_pool_size_0: usize = i + 1;
            ::gpu_pool::__private::take_1d::<
                f32,
            >(&__gpu_pool_scope, __gpu_pool_size_0, "t")
        }
            .expect("fits");
        let t = ::gpu_pool::__private::handle(&mut t);
        if i % 2 == 0 {
            let mut __gpu_pool_owner_1 = {
                let __gpu_pool_size_0: usize = 8;
                let __gpu_pool_size_1: usize = 8;
                ::gpu_pool::__private::take::<
                    u8,
                >(&__gpu_pool_scope, __gpu_pool_size_0, __gpu_pool_size_1, "_")
            }?;
            let _ = ::gpu_pool::__private::handle(&mut __gpu_pool_owner_1);
            continue;
        }
        total += t.len();
    }
    Ok(total)
}
