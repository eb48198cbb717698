use gpu_pool::prelude::*;

#[pooled(stream)]
fn leak<'s>(stream: &'s Stream) -> Result<Pooled<'s, 's, u8>, PoolError> {
    let b = buffer!(16; u8)?;
    Ok(b)
}

fn main() {}
