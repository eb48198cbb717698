use gpu_pool::prelude::*;

#[pooled(stream)]
fn early(stream: &Stream) -> Result<(), PoolError> {
    let a = buffer!(8; u8)?;
    let _b = buffer!(8; u8)?;
    a.release()?;
    Ok(())
}

fn main() {}
