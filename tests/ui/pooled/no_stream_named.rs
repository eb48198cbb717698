use gpu_pool::prelude::*;

#[pooled]
fn f(stream: &Stream) -> Result<(), PoolError> {
    let _b = buffer!(8; u8)?;
    Ok(())
}

fn main() {}
