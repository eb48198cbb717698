use gpu_pool::prelude::*;

#[pooled(stream)]
fn early(stream: &Stream) -> Result<(), PoolError> {
    let a = buffer!(8; u8)?;
    let renamed = a; // still the handle of `a`'s buffer
    drop(renamed); // releases nothing: refused
    Ok(())
}

fn main() {}
