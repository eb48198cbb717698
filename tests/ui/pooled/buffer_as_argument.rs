use gpu_pool::prelude::*;

fn consume(_: Pooled<'_, '_, u8>) {}

#[pooled(stream)]
fn f(stream: &Stream) -> Result<(), PoolError> {
    consume(buffer!(8; u8)?);
    Ok(())
}

fn main() {}
