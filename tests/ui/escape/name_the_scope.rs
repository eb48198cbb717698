use gpu_pool::prelude::*;

#[pooled(stream)]
fn peek(stream: &Stream) -> Result<(), PoolError> {
    let _b = gpu_pool::__private::take_1d::<u8>(&__gpu_pool_scope, 8, "b")?;
    Ok(())
}

fn main() {}
