// Mistakes are replaced where they stand and the user's code is kept: a `buffer!` that does not
// parse, a `drop` of a handle (here of the function's buffer inside a nested scope, whose tokens
// then carry the replacement), a `buffer!` whose error is not handled.
#[pooled(stream)]
fn mistakes(stream: &Stream, other: &Stream) -> Result<usize, PoolError> {
    let a = buffer!(8)?;
    let b = buffer!(8; u8)?;
    let c = gpu_scope!(other, {
        drop(b);
        let d = buffer!(8; u8);
        d.len()
    });
    Ok(a.len() + b.len() + c)
}

// A stream that names no parameter: the scope's local is bound to the error, and the body is kept.
#[pooled(strm)]
fn no_such_stream(stream: &Stream) -> Result<usize, PoolError> {
    let a = buffer!(8; u8)?;
    Ok(a.len())
}

// `.await` in a scope: the same, for `gpu_scope!`.
async fn awaits(stream: &Stream) -> usize {
    gpu_scope!(stream, {
        let a = buffer!(8; u8).unwrap();
        tick().await;
        a.len()
    })
}
