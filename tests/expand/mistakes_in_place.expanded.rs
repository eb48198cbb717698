fn mistakes(stream: &Stream, other: &Stream) -> Result<usize, PoolError> {
    let __gpu_pool_scope = ::gpu_pool::__private::scope(&*stream);
    let a = ::core::compile_error!(
        "unexpected end of input, expected `; T` after the size, naming the element type: `buffer!(rows, cols; T)`, `buffer!(rows, cols; T, packed)` or `buffer!(len; T)`"
    );
    let mut b = {
        let __gpu_pool_size_0: usize = 8;
        ::gpu_pool::__private::take_1d::<u8>(&__gpu_pool_scope, __gpu_pool_size_0, "b")
    }?;
    let b = ::gpu_pool::__private::handle(&mut b);
    let c = {
        let __gpu_pool_stream = &(other);
        let __gpu_pool_scope = ::gpu_pool::__private::scope(__gpu_pool_stream);
        drop(
            ::core::compile_error!(
                "`drop(b)` does not release a `buffer!`: `b` is a handle, and the memory goes back at the end of the block that declared it; to release it earlier, declare it in an inner block: `{ let b = buffer!(..)?; .. }`"
            ),
        );
        let d = ::core::compile_error!(
            "`buffer!` returns `Result<_, PoolError>`: handle the error where the buffer is taken, `let name = buffer!(..)?;` (or `.unwrap()` / `.expect(..)`)"
        );
        d.len()
    };
    Ok(a.len() + b.len() + c)
}
fn no_such_stream(stream: &Stream) -> Result<usize, PoolError> {
    let __gpu_pool_scope = ::core::compile_error!(
        "`strm` is not a parameter of `no_such_stream`; name the parameter that holds the stream (parameters: `stream`)"
    );
    let mut a = {
        let __gpu_pool_size_0: usize = 8;
        ::gpu_pool::__private::take_1d::<u8>(&__gpu_pool_scope, __gpu_pool_size_0, "a")
    }?;
    let a = ::gpu_pool::__private::handle(&mut a);
    Ok(a.len())
}
async fn awaits(stream: &Stream) -> usize {
    {
        let __gpu_pool_scope = ::core::compile_error!(
            "`.await` cannot be used inside `gpu_scope!`: a future suspended here would hold the scope's buffers, and could be dropped or forgotten while other code takes buffers from the stream; close the scope before awaiting"
        );
        let mut a = {
            let __gpu_pool_size_0: usize = 8;
            ::gpu_pool::__private::take_1d::<
                u8,
            >(&__gpu_pool_scope, __gpu_pool_size_0, "a")
        }
            .unwrap();
        let a = ::gpu_pool::__private::handle(&mut a);
        tick().await;
        a.len()
    }
}
