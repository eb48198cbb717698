use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<(), PoolError> {
    let _b = buffer!(8; String)?;
    Ok(())
}

fn main() {}
