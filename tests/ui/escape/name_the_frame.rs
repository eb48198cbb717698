use gpu_pool::prelude::*;

#[pooled(stream)]
fn peek(stream: &Stream) -> Result<(), PoolError> {
    let _b = __gpu_pool_frame.take_1d::<u8>(8)?;
    Ok(())
}

fn main() {}
