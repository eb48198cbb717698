use gpu_pool::prelude::*;

#[pooled(stream)]
fn assign<'s>(stream: &'s Stream, other: Temp<'s, u8>) -> Result<(), PoolError> {
    let mut a = buffer!(8; u8)?;
    *a = other;
    Ok(())
}

fn main() {}
