use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<(), PoolError> {
    let b = buffer!()?;
    Ok(())
}

fn main() {}
