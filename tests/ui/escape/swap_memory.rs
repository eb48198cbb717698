use gpu_pool::prelude::*;

#[pooled(stream)]
fn swap(stream: &Stream) -> Result<(), PoolError> {
    let mut a = buffer!(8; u8)?;
    let mut b = buffer!(8; u8)?;
    std::mem::swap(&mut *a, &mut *b);
    Ok(())
}

fn main() {}
