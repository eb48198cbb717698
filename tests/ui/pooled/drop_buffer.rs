use gpu_pool::prelude::*;

#[pooled(stream)]
fn early(stream: &Stream) -> Result<(), PoolError> {
    let a = buffer!(8; u8)?;
    drop(a); // releases nothing: refused
    let _b = buffer!(8; u8)?;
    Ok(())
}

fn main() {}
