use gpu_pool::prelude::*;

#[pooled(stream)]
fn take(stream: &Stream) -> Result<(), PoolError> {
    let mut a = buffer!(8; u8)?;
    let _old = std::mem::take(&mut *a);
    Ok(())
}

fn main() {}
