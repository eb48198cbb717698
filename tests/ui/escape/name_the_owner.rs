use gpu_pool::prelude::*;

#[pooled(stream)]
fn peek(stream: &Stream) -> Result<(), PoolError> {
    let _ = buffer!(8; u8)?; // the owner of an unnamed buffer is numbered
    drop(__gpu_pool_owner_0);
    Ok(())
}

fn main() {}
