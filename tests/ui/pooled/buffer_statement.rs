use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<(), PoolError> {
    buffer!(8; u8);
    Ok(())
}

fn main() {}
