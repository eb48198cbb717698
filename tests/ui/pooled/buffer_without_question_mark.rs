use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<(), PoolError> {
    let b = buffer!(8; u8);
    Ok(())
}

fn main() {}
