use gpu_pool::prelude::*;

#[pooled(device)]
fn f(device: &Device) -> Result<(), PoolError> {
    let _b = buffer!(8; u8)?;
    Ok(())
}

fn main() {}
