use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<(), PoolError> {
    let Ok(b) = buffer!(8; u8) else { return Ok(()) };
    Ok(())
}

fn main() {}
