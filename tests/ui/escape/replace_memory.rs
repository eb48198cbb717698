use gpu_pool::prelude::*;

#[pooled(stream)]
fn replace(stream: &Stream, other: Temp<'_, u8>) -> Result<(), PoolError> {
    let mut a = buffer!(8; u8)?;
    let _old = std::mem::replace(&mut *a, other);
    Ok(())
}

fn main() {}
